// kv_migration_wire.h (private to src/): the bodies of the KV migration protocol's messages, by
// which a source rollout worker hands live sequences and their paged KV cache to a destination
// (issue #20, KvMigrator). Encoded and decoded apart from any transport so that a fuzz target
// (tests/fuzz/kv_migration_decode_fuzz.cc) can reach every decoder. The pages themselves go by
// Transport put into the destination's pools (host pools) or by NCCL (device pools), never in
// these messages.
//
// Little-endian, on ByteWriter / ByteReader (byte_codec.h); "blob" is a u32 length and that many
// bytes; a refusal is u8 StatusCode (not kOk), blob text (<= kMaxMigrationTextBytes):
//   offer        source -> dest   u64 migration id, u64 version, i32 num_layers, i32 page_size,
//                                 i32 num_kv_heads, i32 head_dim, u8 dtype, u8 pools (0 host,
//                                 1 device), u32 n; n times: u64 sequence id, u64 tokens,
//                                 u32 pages needed
//   reservation  dest -> source   u8 granted (0/1); 0: a refusal. 1: u64 lease_ns, u32 n; n times:
//                                 u64 sequence id, u32 m, i32 page id[m]; then blob K pool region,
//                                 blob V pool region (RemoteRegion::serialize; empty for device
//                                 pools), u64 link, blob link token (device pools: the link the
//                                 pages go by and the NCCL unique id that joins it; 0 and empty
//                                 for host pools)
//   stage        source -> dest   u64 migration id, u32 stage, u8 final (0/1), u64 batch (0: the
//                                 pages came by put; else the link's transfer number), u32 n;
//                                 n times: u64 sequence id, u32 first page, u32 m, u64 checksum[m]
//                                 (one per page copied this stage: xxh3 for host pools, the device
//                                 checksum for device pools); with batch not 0, u32 r, u32 run[r]
//                                 (the pages in transfer order, in runs consecutive on both
//                                 sides); with final 1, then a sequence state
//   stage answer dest -> source   u8 acked (0/1); 1: u32 stage. 0: a refusal
//   abort        either way       u64 migration id, u8 side (0 source, 1 destination), a refusal
// A sequence state is u64 sequence id, u64 trajectory id, u64 prompt id, u64 group id,
// u32 group size, u32 sample index, u64 version, f32 temperature, f32 top_p, i32 top_k, u64 seed,
// u64 rng position, u64 kv length, u32 n, i32 prompt[n], u32 m, i32 response[m], u32 k,
// f32 logprob[k], then blob engine state.
//
// A decoder accepts exactly what its encoder writes: anything else is kDataLoss naming the
// message, the field and its offset. kInvalidArgument, naming the message (and the sequence), for
// well-formed values out of range: a count or length above its bound, a migration id of 0, a
// layout no KvCache takes, too few pages for a sequence's tokens, staged pages past the bound,
// logprobs not one per response token, a link without its token (or the reverse), runs that do
// not cover a stage's pages, a NaN or positive logprob, a KV length past the tokens, a
// sample index outside its group, sampling parameters no sampler takes, a staged state of another
// sequence. A decoder checks only what the message itself states: what needs the migrator's state
// (the sequences offered, page ids one per page offered and in the pool, checksums that match, a
// stage in order) is for the migrator to check.
//
//   std::vector<std::byte> body = encode_migration_abort({7, MigrationSide::kSource,
//                                                         StatusCode::kCancelled, "shutdown"});
//   Result<MigrationAbort> a = decode_migration_abort(body);   // a->migration_id == 7
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "laminar/kv_migrator.h"
#include "laminar/status.h"
#include "laminar/types.h"

namespace laminar::internal {

// Prompt plus response tokens of one sequence, and its KV length.
inline constexpr std::uint64_t kMaxMigrationTokens = std::uint64_t(1) << 20;
// Pages of one sequence: one token a page at worst.
inline constexpr std::uint32_t kMaxMigrationPages = std::uint32_t(kMaxMigrationTokens);
inline constexpr std::uint32_t kMaxMigrationSequences = 1024;
inline constexpr std::size_t kMaxMigrationEngineBytes = std::size_t(1) << 20;
// A refusal's text, as the transport bounds its error texts; a longer one is cut when encoded.
inline constexpr std::size_t kMaxMigrationTextBytes = 1024;
// A serialized RemoteRegion: two u64 and a UCX rkey of some hundred bytes.
inline constexpr std::size_t kMaxMigrationRegionBytes = 4096;
// A link token: an NCCL unique id (NCCL_UNIQUE_ID_BYTES).
inline constexpr std::size_t kMigrationLinkTokenBytes = 128;

// Where the cache's pools are, which decides how pages move: Transport puts between host pools,
// NCCL send/recv between device pools.
enum class KvPools : std::uint8_t { kHost, kDevice };

// The fields of a KvLayout that both sides' pages must share (num_pages is each side's own).
struct KvLayoutFingerprint {
  std::int32_t num_layers = 1;
  std::int32_t page_size = 0;
  std::int32_t num_kv_heads = 0;
  std::int32_t head_dim = 0;
  DType dtype = DType::kBF16;  // f32, f16 or bf16
  friend bool operator==(const KvLayoutFingerprint&, const KvLayoutFingerprint&) = default;
};

struct OfferedSequence {
  SequenceId sequence;
  std::uint64_t tokens = 0;
  std::uint32_t pages_needed = 0;  // >= ceil(tokens / page_size): room to keep decoding
  friend bool operator==(const OfferedSequence&, const OfferedSequence&) = default;
};

struct MigrationOffer {
  std::uint64_t migration_id = 0;  // not 0
  Version version;
  KvLayoutFingerprint layout;
  std::vector<OfferedSequence> sequences;
  KvPools pools = KvPools::kHost;
  friend bool operator==(const MigrationOffer&, const MigrationOffer&) = default;
};

// A failure as one side tells the other: never kOk.
struct MigrationRefusal {
  StatusCode code = StatusCode::kInternal;
  std::string text;
  friend bool operator==(const MigrationRefusal&, const MigrationRefusal&) = default;
};

struct ReservedSequence {
  SequenceId sequence;
  std::vector<std::int32_t> pages;  // destination page ids, one per page needed
  friend bool operator==(const ReservedSequence&, const ReservedSequence&) = default;
};

// Either a refusal (and nothing else), or the lease and its pages.
struct MigrationReservation {
  std::optional<MigrationRefusal> refusal;
  std::uint64_t lease_ns = 0;
  std::vector<ReservedSequence> sequences;
  std::vector<std::byte> k_pool;  // RemoteRegion::serialize() of the destination's K pool
  std::vector<std::byte> v_pool;  // and of its V pool
  // Device pools: the communicator the pages go by (not 0) and the NCCL unique id that joins it
  // ([kMigrationLinkTokenBytes]). Every reservation carries both, so a source that holds the link
  // already knows it by its id, whatever order the reservations are read in.
  std::uint64_t link = 0;
  std::vector<std::byte> link_token;
  friend bool operator==(const MigrationReservation&, const MigrationReservation&) = default;
};

struct StagedSequence {
  SequenceId sequence;
  std::uint32_t first_page = 0;          // index into the sequence's reserved pages
  std::vector<std::uint64_t> checksums;  // xxh3 of each page copied this stage
  std::optional<SequenceState> state;    // in the final stage only, and then for every sequence
  std::vector<std::uint32_t> runs;       // device pools: page counts (each > 0) summing to the pages
  friend bool operator==(const StagedSequence&, const StagedSequence&) = default;
};

struct MigrationStage {
  std::uint64_t migration_id = 0;  // not 0
  std::uint32_t stage = 0;
  bool final = false;  // the sequences are paused and their states follow
  std::vector<StagedSequence> sequences;
  // Device pools: the number of this stage's transfers on its link, from 1 (the destination posts
  // its receives in this order, as the source posted its sends); 0 for host pools.
  std::uint64_t batch = 0;
  friend bool operator==(const MigrationStage&, const MigrationStage&) = default;
};

// Either the stage acknowledged, or a refusal.
struct MigrationStageAnswer {
  std::optional<MigrationRefusal> refusal;
  std::uint32_t stage = 0;  // 0 with a refusal
  friend bool operator==(const MigrationStageAnswer&, const MigrationStageAnswer&) = default;
};

enum class MigrationSide : std::uint8_t { kSource, kDestination };

struct MigrationAbort {
  std::uint64_t migration_id = 0;  // not 0
  MigrationSide side = MigrationSide::kSource;
  StatusCode code = StatusCode::kAborted;  // not kOk
  std::string reason;                      // cut to kMaxMigrationTextBytes when encoded
  friend bool operator==(const MigrationAbort&, const MigrationAbort&) = default;
};

// Encoders' preconditions: every count and length fits in a u32; a stage's sequences carry a state
// exactly when it is final, and runs exactly when its batch is not 0.
std::vector<std::byte> encode_migration_offer(const MigrationOffer& m);
Result<MigrationOffer> decode_migration_offer(std::span<const std::byte> body);

std::vector<std::byte> encode_migration_reservation(const MigrationReservation& m);
Result<MigrationReservation> decode_migration_reservation(std::span<const std::byte> body);

std::vector<std::byte> encode_migration_stage(const MigrationStage& m);
Result<MigrationStage> decode_migration_stage(std::span<const std::byte> body);

std::vector<std::byte> encode_migration_stage_answer(const MigrationStageAnswer& m);
Result<MigrationStageAnswer> decode_migration_stage_answer(std::span<const std::byte> body);

std::vector<std::byte> encode_migration_abort(const MigrationAbort& m);
Result<MigrationAbort> decode_migration_abort(std::span<const std::byte> body);

}  // namespace laminar::internal
