// repack_wire.h (private to src/): the bodies of the repack protocol's two messages, by which
// rollout workers (RepackDriver) tell the fleet's RepackCoordinator what they hold and the
// coordinator tells each source worker which of its sequences to move where (issue #20). Encoded
// and decoded apart from any transport so that a fuzz target (tests/fuzz/repack_decode_fuzz.cc)
// reaches both decoders. Both messages are one-way: nobody waits on an answer.
//
// Little-endian, on ByteWriter / ByteReader (byte_codec.h); "blob" is a u32 length and that many
// bytes; a flag is a u8, 0 or 1:
//   report  worker -> coordinator   u32 worker id, u64 report number, flag migrating, blob migrator
//                                   address, u64 version, i64 pages_total, i64 pages_used,
//                                   i32 slots_total, i32 slots_used, i64 step_time_ns,
//                                   i64 waiting_prompts, flag kv_stopped_growing, u32 n; n times:
//                                   u64 sequence id, i64 tokens, i64 pages, flag expected,
//                                   and with expected 1: i64 expected remaining tokens
//   orders  coordinator -> worker   u64 plan number, u64 report number, u64 version, u32 d; d times:
//                                   u32 worker id, blob migrator address, u32 m, u64 sequence id[m]
//
// A decoder accepts exactly what its encoder writes: anything else is kDataLoss naming the
// message, the field and its offset. kInvalidArgument, naming the message, for well-formed values
// out of range: a report or plan number of 0, an address empty or longer than
// kMaxRepackAddressBytes, a count above its bound, an orders' destination without sequences or
// named twice, a sequence named twice. What a snapshot's numbers must satisfy (plan_repack's
// preconditions) is for the coordinator to check: the decoder reads them as they are.
//
//   std::vector<std::byte> body = encode_repack_orders({1, 4, Version(2), {{WorkerId(3), "10.0.0.3:7000",
//                                                                           {SequenceId(9)}}}});
//   Result<RepackOrders> o = decode_repack_orders(body);   // o->destinations[0].worker == WorkerId(3)
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "laminar/repack_policy.h"
#include "laminar/status.h"
#include "laminar/types.h"

namespace laminar::internal {

// Live sequences of one report, and sequences of one orders message over all its destinations
// (each destination takes at least one): what one KvMigrator::migrate() takes, so no destination's
// share is ever more than one migration.
inline constexpr std::uint32_t kMaxRepackSequences = 1024;
// A migrator's "host:port".
inline constexpr std::size_t kMaxRepackAddressBytes = 256;

// What a worker tells the coordinator, every report interval.
struct RepackReport {
  std::uint64_t report = 0;  // the worker's count of its reports, from 1; orders name it
  bool migrating = false;    // a migration of this worker runs, either way
  std::string migrator_address;
  WorkerSnapshot snapshot;
};
bool operator==(const RepackReport& a, const RepackReport& b);

// Sequences a source moves to one destination.
struct RepackDestination {
  WorkerId worker;
  std::string migrator_address;
  std::vector<SequenceId> sequences;
  friend bool operator==(const RepackDestination&, const RepackDestination&) = default;
};

// A source worker's part of one plan.
struct RepackOrders {
  std::uint64_t plan = 0;    // the coordinator's count of its plans, from 1
  std::uint64_t report = 0;  // the source's report the plan read
  Version version;           // the source's version in that report
  std::vector<RepackDestination> destinations;
  friend bool operator==(const RepackOrders&, const RepackOrders&) = default;
};

// Encoders' preconditions: addresses of at most kMaxRepackAddressBytes; a report of at most
// kMaxRepackSequences sequences; orders of at most kMaxRepackSequences destinations. (Orders whose
// sequences number more in all encode, and are refused by the decoder.)
std::vector<std::byte> encode_repack_report(const RepackReport& m);
Result<RepackReport> decode_repack_report(std::span<const std::byte> body);

std::vector<std::byte> encode_repack_orders(const RepackOrders& m);
Result<RepackOrders> decode_repack_orders(std::span<const std::byte> body);

}  // namespace laminar::internal
