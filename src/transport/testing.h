// testing.h: hooks that let tests act as a misbehaving transport peer. Compiled into the
// laminar_testing library (tests/support/CMakeLists.txt), which only tests link; the shipped laminar
// library holds none of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "laminar/status.h"
#include "laminar/transport.h"

namespace laminar::testing {

// Sends `wire` as one frame on an authenticated endpoint, bypassing the encoder, so tests can make
// a real peer receive truncated, corrupt or oversized frames. With `token`, the frame carries that
// token in its UCX header instead of the one the peer gave the connection. Returns once UCX is done
// with it.
Status send_raw_frame(const Endpoint& endpoint, std::vector<std::byte> wire,
                      std::optional<std::uint64_t> token = std::nullopt);

// An endpoint from `from` straight to `to`'s UCX worker, as a peer that learned the worker address
// without authenticating would have: no bootstrap connection, and frames carry `token`. The
// receiver must drop whatever it sends. Both transports live in this process.
Result<Endpoint> connect_ucx_only(Transport& from, Transport& to, std::uint64_t token);

}  // namespace laminar::testing
