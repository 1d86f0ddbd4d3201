// testing.h: hooks that let tests act as a misbehaving transport peer. Compiled into the
// laminar_testing library (tests/support/CMakeLists.txt), which only tests link; the shipped laminar
// library holds none of it.
#pragma once

#include <cstddef>
#include <string_view>
#include <vector>

#include "laminar/status.h"
#include "laminar/transport.h"

namespace laminar::testing {

// Sends `wire` as one frame on an authenticated endpoint, bypassing the encoder, so tests can make
// a real peer receive truncated, corrupt or oversized frames. Returns once UCX is done with it.
Status send_raw_frame(const Endpoint& endpoint, std::vector<std::byte> wire);

// Connects without authenticating: the endpoint is usable at once on this side, as a peer that
// skips the handshake would be. The server must refuse whatever it sends.
Result<Endpoint> connect_without_handshake(Transport& transport, std::string_view address);

}  // namespace laminar::testing
