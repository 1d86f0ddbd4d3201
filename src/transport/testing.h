// testing.h (internal): hooks that let tests act as a misbehaving peer. Not part of the API.
#pragma once

#include <cstddef>
#include <vector>

#include "laminar/status.h"
#include "laminar/transport.h"

namespace laminar::internal {

// Sends `wire` as one frame on an authenticated endpoint, bypassing the encoder, so tests can make
// a real peer receive truncated, corrupt or oversized frames. Returns once UCX is done with it.
Status send_raw_frame(const Endpoint& endpoint, std::vector<std::byte> wire);

}  // namespace laminar::internal
