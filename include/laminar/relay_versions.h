// relay_versions.h: the version bookkeeping of the relay tier, as pure logic with no byte movement.
//
// RelayStore and WeightPuller move bytes; the decisions they take live here so that a cluster
// simulator can drive the same logic in virtual time:
//   - ChunkPlan: how a version's flat buffer is cut into checksummed chunks;
//   - VersionLedger: one store's versions (receiving or committed), which chunks are verified
//     (and so where a cut transfer resumes), who holds a read reference, and which versions may be
//     freed within a memory budget;
//   - next_pull(): what a rollout worker should do next (nothing, pull, prefetch, swap);
//   - FleetVersions: which version every relay and puller holds, and who still lacks a version.
//
// Threads: none. These are plain values: const calls may run concurrently, a change needs its
// caller's lock (RelayStore holds one around its VersionLedger).
//
//   laminar::VersionLedger ledger(/*memory_budget_bytes=*/8ull << 30);
//   auto plan = laminar::ChunkPlan::make(/*total_bytes=*/1 << 20, /*chunk_bytes=*/1 << 18);
//   laminar::Status st = ledger.begin(laminar::Version(1), *plan);
//   for (std::uint32_t c = 0; c < plan->num_chunks(); ++c) {
//     auto done = ledger.chunk_verified(laminar::Version(1), c);  // .first: versions to free now
//   }
//   auto d = laminar::next_pull({std::nullopt, std::nullopt, false}, ledger.newest_committed(), laminar::PullPolicy::kWhenIdle);
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "laminar/status.h"
#include "laminar/types.h"

namespace laminar {

// A version's flat buffer [total_bytes] cut into chunks of chunk_bytes (the last one shorter). Every
// relay of a chain uses the plan of the version's publisher, so chunk i means the same bytes everywhere.
class ChunkPlan {
 public:
  // Chunks are at least this big so per-chunk bookkeeping stays small next to the bytes.
  static constexpr std::uint64_t kMinChunkBytes = 4096;

  ChunkPlan() = default;
  // kInvalidArgument for total_bytes == 0, chunk_bytes below kMinChunkBytes, or more than 2^32 - 1
  // chunks.
  static Result<ChunkPlan> make(std::uint64_t total_bytes, std::uint64_t chunk_bytes);

  std::uint64_t total_bytes() const noexcept { return total_bytes_; }
  std::uint64_t chunk_bytes() const noexcept { return chunk_bytes_; }
  std::uint32_t num_chunks() const noexcept { return num_chunks_; }
  // Preconditions: i < num_chunks().
  std::uint64_t chunk_offset(std::uint32_t i) const noexcept { return std::uint64_t(i) * chunk_bytes_; }
  std::uint64_t chunk_size(std::uint32_t i) const noexcept;
  // Chunks [first, last) overlapping the byte range [offset, offset + nbytes); empty for nbytes == 0.
  // Preconditions: offset + nbytes <= total_bytes().
  std::pair<std::uint32_t, std::uint32_t> chunks_covering(std::uint64_t offset,
                                                          std::uint64_t nbytes) const noexcept;

  friend bool operator==(const ChunkPlan&, const ChunkPlan&) = default;

 private:
  std::uint64_t total_bytes_ = 0;
  std::uint64_t chunk_bytes_ = 0;
  std::uint32_t num_chunks_ = 0;
};

// One store's versions. Every mutating call returns the versions the caller must free now (their
// buffers are no longer needed by anyone); the ledger forgets them at once.
//
// Policy: the newest committed version, every version a reader references, and every version still
// being received (unless a newer one has committed) are kept; everything else is freed eagerly.
class VersionLedger {
 public:
  static constexpr std::uint64_t kUnlimited = std::numeric_limits<std::uint64_t>::max();

  enum class State : std::uint8_t { kReceiving, kCommitted };

  explicit VersionLedger(std::uint64_t memory_budget_bytes = kUnlimited)
      : budget_(memory_budget_bytes) {}

  // Starts receiving version v laid out as plan.
  // kInvalidArgument when v is not above every version begun so far (versions strictly increase),
  // kResourceExhausted when the bytes held plus plan.total_bytes() exceed the budget (the message
  // names the versions held and their reference counts). On error nothing changes.
  Status begin(Version v, const ChunkPlan& plan);

  // Records that chunk i of v arrived and matched its checksum. Returns true in .second when this
  // completed the version (it is now committed and visible); .first lists versions to free. A chunk
  // verified twice is counted once. kNotFound for an unknown or already freed version,
  // kOutOfRange for i >= num_chunks.
  Result<std::pair<bool, std::vector<Version>>> chunk_verified(Version v, std::uint32_t i);

  // Drops an incomplete version (its sender gave up). kNotFound for an unknown version,
  // kFailedPrecondition for a committed one.
  Status abandon(Version v);

  // A reader takes / gives back a reference on a committed version.
  // kNotFound when v is not held, kFailedPrecondition when v is not committed (add) or has no
  // reference to give back (release).
  Status add_ref(Version v);
  Result<std::vector<Version>> release(Version v);

  std::optional<Version> newest_committed() const noexcept { return newest_committed_; }
  std::optional<Version> newest_begun() const noexcept { return newest_begun_; }
  bool contains(Version v) const { return versions_.count(v) != 0; }
  bool is_committed(Version v) const;
  // The first chunk of v not yet verified: where a cut transfer resumes (num_chunks when complete).
  // kNotFound for an unknown version.
  Result<std::uint32_t> resume_point(Version v) const;
  // Every chunk of v not yet verified, in order. kNotFound for an unknown version.
  Result<std::vector<std::uint32_t>> missing_chunks(Version v) const;
  Result<std::uint32_t> refs(Version v) const;
  Result<ChunkPlan> plan(Version v) const;

  std::uint64_t bytes_held() const noexcept { return bytes_held_; }
  std::uint64_t memory_budget() const noexcept { return budget_; }
  std::vector<Version> versions() const;

 private:
  struct Entry {
    ChunkPlan plan;
    State state = State::kReceiving;
    std::vector<bool> verified;  // [num_chunks]
    std::uint32_t num_verified = 0;
    std::uint32_t refs = 0;
  };

  std::uint64_t budget_;
  std::uint64_t bytes_held_ = 0;
  std::map<Version, Entry> versions_;
  std::optional<Version> newest_committed_;
  std::optional<Version> newest_begun_;
};

// How a rollout worker takes new weights.
enum class PullPolicy : std::uint8_t {
  kWhenIdle,          // Laminar's default: pull only with no live trajectory (one version each)
  kPrefetchThenSwap,  // fetch into spare memory while generating, swap in when idle
};

// What a worker holds, as the decision needs it.
struct PullerView {
  std::optional<Version> held;        // version in the engine's weight buffers
  std::optional<Version> prefetched;  // version staged by a prefetch, not yet swapped in
  bool has_live_trajectory = false;
};

enum class PullAction : std::uint8_t { kNone, kPull, kPrefetch, kSwap };

struct PullDecision {
  PullAction action = PullAction::kNone;
  Version version;  // meaningful unless action == kNone

  friend bool operator==(const PullDecision&, const PullDecision&) = default;
};

// What the worker should do next given the newest version its relay offers. Never kPull or kSwap
// while a trajectory is live (the weights under a trajectory do not change); kPrefetch only under
// kPrefetchThenSwap.
PullDecision next_pull(const PullerView& worker, std::optional<Version> newest_available,
                       PullPolicy policy) noexcept;

std::string_view pull_action_name(PullAction a) noexcept;

// Which version every relay and puller of a cluster holds. Ids are the caller's (a rank, a host).
class FleetVersions {
 public:
  enum class Role : std::uint8_t { kRelay, kPuller };

  // Records that node holds v. kInvalidArgument when v is below what the node held before (a node
  // never goes back) or when the node was registered with the other role.
  Status set_held(std::uint32_t node, Role role, Version v);
  // Forgets a node (it died or left). kNotFound when unknown.
  Status remove(std::uint32_t node);

  std::optional<Version> held(std::uint32_t node) const;
  // Nodes of the role that do not hold v yet (they hold something older), by id: the relays
  // a chain still has to reach, the pullers that should fetch next.
  std::vector<std::uint32_t> lacking(Version v, Role role) const;
  // The oldest version any puller still runs: relays must keep a version at least this new around
  // if pullers may need to re-read it.
  std::optional<Version> oldest_held(Role role) const;
  std::size_t size() const noexcept { return nodes_.size(); }

 private:
  struct Node {
    Role role = Role::kRelay;
    Version held;
  };
  std::map<std::uint32_t, Node> nodes_;
};

}  // namespace laminar
