// remote_trajectory_queue_wire.h (private to src/): the message bodies a RemoteProducer and a
// TrajectoryQueueServer exchange, written with ByteWriter and read with ByteReader (byte_codec.h).
// Kept apart from the server and the producer so the decoders, which read bytes from a peer, can
// be fuzzed without a transport (tests/fuzz/remote_queue_decode_fuzz.cc).
//
// Layouts, all little-endian; padding is zero and checked, so every message has one encoding:
//   hello answer:     u32 protocol (kQueueProtocol), u32 credits granted (not 0)
//   push:             u32 magic "TQP1", u8 PushMode, 3 padding, i64 timeout_ns; then one
//                     encode_trajectory
//   push_many:        u32 magic "TQM1", u8 PushMode, 3 padding, i64 timeout_ns, u32 count
//                     (1..kMaxPushManyCount), 4 padding; then `count` times a u64 length and
//                     that many bytes of one encode_trajectory
//   push_many answer: u32 count; then per trajectory a u8 StatusCode, 3 padding, a u32 length and
//                     the Status's message
// (The hello request, a push's answer, a ping and its answer have empty bodies.) Decoders answer kDataLoss naming the
// message, the field and its offset; kInvalidArgument for well-formed bytes carrying a value no
// producer sends (a mode past kTimeout, a negative timeout, a count out of range, a trajectory
// that fails validate_trajectory(t, /*contents=*/false)). The arrays' values are the queue's to
// check, as its validate_contents says, when the server pushes them: one pass, not two.
//
//   std::string body;
//   internal::encode_queue_push(trajectory, {PushMode::kBlock, 0}, body);
//   Result<internal::QueuePush> push = internal::decode_queue_push(as_bytes(body));
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "laminar/status.h"
#include "laminar/trajectory.h"
#include "laminar/trajectory_queue.h"

namespace laminar::internal {

// 2: the server answers pings; a producer would take a server of 1, which leaves them unanswered,
// for a hung one.
inline constexpr std::uint32_t kQueueProtocol = 2;
inline constexpr std::size_t kQueuePushHeaderBytes = 16;
inline constexpr std::size_t kQueuePushManyHeaderBytes = 24;
inline constexpr std::uint32_t kMaxPushManyCount = 1024;

// How long the server may hold a push for room: the producer's mode, and for kTimeout what is left
// of its timeout (0 otherwise).
struct QueuePushWait {
  PushMode mode = PushMode::kBlock;
  std::int64_t timeout_ns = 0;
};

// A push message (one trajectory) or a push_many message, decoded.
struct QueuePush {
  QueuePushWait wait;
  std::vector<Trajectory> trajectories;
};

std::vector<std::byte> encode_queue_hello(std::uint32_t credits);
// The credits granted; kDataLoss for another protocol or none granted.
Result<std::uint32_t> decode_queue_hello(std::span<const std::byte> body);

// Appends a whole push message to `out`.
void encode_queue_push(const Trajectory& t, QueuePushWait wait, std::string& out);
Result<QueuePush> decode_queue_push(std::span<const std::byte> body);

// A push_many message is written back to front, since a producer knows what is left of its timeout
// only once a credit is free: kQueuePushManyHeaderBytes of room, the trajectories appended one by
// one, then the header written over the room.
void append_queue_push_many_item(const Trajectory& t, std::string& out);
// Precondition: `out` starts with kQueuePushManyHeaderBytes for the header.
void write_queue_push_many_header(QueuePushWait wait, std::uint32_t count, std::string& out);
Result<QueuePush> decode_queue_push_many(std::span<const std::byte> body);

// One Status per trajectory of a push_many message, in its order.
std::string encode_queue_statuses(std::span<const Status> statuses);
Result<std::vector<Status>> decode_queue_statuses(std::span<const std::byte> body);

}  // namespace laminar::internal
