// rollout_dispatch_wire.h (private to src/): the two message bodies a DispatchClient and a
// RolloutDispatcher exchange (rollout_dispatcher.h), and a DispatcherSnapshot's bytes, encoded
// apart from any transport so that a fuzz target (tests/fuzz/rollout_dispatch_decode_fuzz.cc)
// reaches every decoder.
//
// Little-endian, on ByteWriter / ByteReader (byte_codec.h); "blob" is a u32 length and that many
// bytes:
//   request  worker -> dispatcher  u32 worker, u64 version, u32 free_slots, i64 wait_ns, u8 idle_pull,
//                                  u32 n; n times u64 held trajectory id; u32 r; r times u64
//                                  returned trajectory id
//   grant    dispatcher -> worker  u8 kind, u8 interrupt, u64 pull_version, u64 newest, u32 n;
//                                  n times u64 trajectory id, u64 prompt_index, u32 sample_index,
//                                  u64 seed, blob payload; then u32 d and d times u64 dropped id
// A decoder accepts exactly what its encoder writes: anything else (a payload above the caller's
// limit included) is kDataLoss naming the field and its offset. kInvalidArgument for well-formed
// values out of range: a count above the caller's limit, a kind no dispatcher sends, kWork without
// samples (or samples without kWork), a flag other than 0 or 1, a negative wait.
//
//   std::vector<std::byte> body = encode_dispatch_request({WorkerId(3), {Version(2), 4, {}, 1s}});
//   Result<DispatchRequestMessage> back = decode_dispatch_request(body, /*max_held=*/1024);
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "laminar/rollout_dispatcher.h"
#include "laminar/status.h"
#include "laminar/types.h"

namespace laminar::internal {

// A request as it travels: who asks, and what.
struct DispatchRequestMessage {
  WorkerId worker;
  DispatchRequest request;
  friend bool operator==(const DispatchRequestMessage&, const DispatchRequestMessage&) = default;
};

std::vector<std::byte> encode_dispatch_request(const DispatchRequestMessage& m);
// max_held: the most held ids, and the most returned ids, a request may list.
Result<DispatchRequestMessage> decode_dispatch_request(std::span<const std::byte> body, std::size_t max_held);

std::vector<std::byte> encode_grant(const Grant& g);
// max_samples: the free slots asked for; max_drop: the ids held; max_payload: bytes per payload.
Result<Grant> decode_grant(std::span<const std::byte> body, std::size_t max_samples, std::size_t max_drop,
                           std::size_t max_payload);

// DispatcherSnapshot's bytes (its encode() and decode()), and the checks a snapshot passes to be
// resumed from: kInvalidArgument naming what does not fit (a zero group_size, groups whose
// trajectory ids would overflow, open groups not ascending or not below groups_made, a group
// with another count of samples, a state no snapshot has, a group with every sample completed,
// a window with version_min above version_max).
std::vector<std::byte> encode_snapshot(const DispatcherSnapshot& s);
Result<DispatcherSnapshot> decode_snapshot(std::span<const std::byte> bytes);
Status check_snapshot(const DispatcherSnapshot& s);

}  // namespace laminar::internal
