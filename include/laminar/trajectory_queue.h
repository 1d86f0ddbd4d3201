// trajectory_queue.h: TrajectoryQueue, the experience buffer between rollouts and the actor.
//
// Rollout workers push finished trajectories, each tagged with the policy version that generated
// it; the actor pops batches by count or token budget on its own schedule. The queue is bounded
// (producers block, fail fast or time out when it is full), applies a staleness rule relative to
// the consumer's version, releases GRPO groups only whole (or by a group timeout), and delivers
// exactly once to the trainer: a popped batch is leased until ack(); nack() or lease expiry puts
// it back. With a write-ahead log, pushed-but-unacked trajectories survive a process kill and are
// delivered again after restart. Every timeout reads the injectable Clock (clock.h).
//
// Threads: the queue runs none. Every call is thread-safe and does its work on the caller's
// thread, under one lock; timeouts (leases, groups) fire inside whichever call comes next, and a
// waiting call wakes for the earliest of them.
//
//   auto q = laminar::TrajectoryQueue::create(laminar::TrajectoryQueueOptions{}).value();
//   laminar::Trajectory t;
//   t.id = laminar::TrajectoryId(1);
//   t.response_tokens = {5, 6};
//   t.logprobs = {-0.1f, -0.2f};
//   t.rewards = {1.0f};
//   laminar::Status st = q->push(std::move(t));
//   laminar::BatchSpec spec;
//   spec.max_trajectories = 32;
//   laminar::Result<laminar::Batch> b = q->pop_batch(spec);   // train on b->trajectories() ...
//   st = q->ack(b->id());                                      // ... then commit
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "laminar/clock.h"
#include "laminar/status.h"
#include "laminar/trajectory.h"
#include "laminar/types.h"

namespace laminar {

// What push() does when the queue is at capacity.
enum class PushMode : std::uint8_t {
  kBlock,     // wait for space (or close())
  kFailFast,  // return kUnavailable at once
  kTimeout,   // wait up to PushOptions::timeout, then kDeadlineExceeded
};

struct PushOptions {
  PushMode mode = PushMode::kBlock;
  Duration timeout{0};  // kTimeout only; kForever waits like kBlock

  static PushOptions block() { return {}; }
  static PushOptions fail_fast() { return {PushMode::kFailFast, Duration(0)}; }
  static PushOptions with_timeout(Duration d) { return {PushMode::kTimeout, d}; }
};

// staleness = consumer_version - trajectory.version (0 when the trajectory is newer).
enum class StalenessRule : std::uint8_t {
  kDrop,         // drop units with staleness > max_staleness (counted in stats as "stale")
  kKeep,         // deliver everything; max_staleness is ignored
  kKeepAndMark,  // deliver everything; TrajectoryInfo::over_limit marks staleness > max_staleness
};

// What happens to a GRPO group still incomplete when TrajectoryQueueOptions::group_timeout runs out. Either
// way the group is then closed: a member arriving later is refused with kFailedPrecondition.
enum class PartialGroupPolicy : std::uint8_t {
  kRelease,  // deliver the members present as one unit, marked partial_group
  kDrop,     // drop them (counted as "group_timeout")
};

struct TrajectoryQueueOptions {
  // Bounds on what the queue holds: waiting in groups, ready, and leased out (unacked). At most
  // 2^24 - 1 trajectories and 2^40 - 1 tokens.
  std::size_t capacity_trajectories = 1 << 16;
  std::size_t capacity_tokens = std::size_t(1) << 32;
  // Null: Clock::steady().
  std::shared_ptr<Clock> clock;
  // Lease of a popped batch when BatchSpec::lease is zero.
  Duration default_lease = std::chrono::seconds(600);
  // How long a group may wait for its last member, from its first arrival. kForever: no timeout
  // (then capacity must cover every group in flight, or producers can block on each other).
  Duration group_timeout = kForever;
  PartialGroupPolicy partial_group_policy = PartialGroupPolicy::kRelease;
  // push() scans every token id, log-prob, reward and the metadata JSON (validate_trajectory's
  // `contents`): about 2 us per 3k-token trajectory on the producer's thread, ten times what the
  // queue itself costs. Off: only the checks on the Trajectory's own fields (lengths, a reward
  // present, group fields, version, ids), for producers that are trusted engines; push() then
  // reads none of the arrays, whose cache misses would otherwise cost more than the queue.
  bool validate_contents = true;
  // Newest published version at start (a WAL's recorded version wins if higher).
  Version initial_version{0};
  // A pushed id is refused while it is in the queue and for the next id_dedup_window ids retired
  // (acked or dropped) after it; closed groups are remembered for as many group ids. At most 2^29.
  // The window's ids take 8 bytes each once that many have been retired.
  std::size_t id_dedup_window = 1 << 16;
  // Write-ahead log file; empty: none. Created if absent, replayed if present.
  std::string wal_path;
  // fsync after every record (push_many: after all of its records): survives power loss, not
  // only a process kill, at disk speed.
  bool wal_fsync = false;
  // Rewrite the log with only the live records once it is this large and at least half dead.
  std::uint64_t wal_compact_bytes = std::uint64_t(256) << 20;
};

struct BatchSpec {
  // At least one limit is set. A unit (a group, or one ungrouped trajectory) is never split: the
  // batch stops before a unit that would break a limit, except that a unit larger than a limit is
  // delivered alone rather than never.
  std::size_t max_trajectories = 0;  // 0: no count limit
  std::size_t max_tokens = 0;        // 0: no token limit; counts prompt + response tokens
  // Wait until this many trajectories are ready (after staleness drops), up to `wait` (kForever:
  // until they are, or close()).
  std::size_t min_trajectories = 1;
  Duration wait{0};
  // The consumer's current policy version; not ahead of the newest published one.
  Version consumer_version;
  StalenessRule staleness_rule = StalenessRule::kKeep;
  std::uint64_t max_staleness = 0;
  Duration lease{0};  // 0: TrajectoryQueueOptions::default_lease; kForever: never expires
};

// Per-trajectory facts attached to a batch, parallel to Batch::trajectories().
struct TrajectoryInfo {
  std::uint64_t staleness = 0;
  bool over_limit = false;     // kKeepAndMark and staleness > max_staleness
  bool partial_group = false;  // released by the group timeout with members missing
  std::uint32_t delivery = 1;  // 1 on first delivery, +1 each time a nack or expiry returns it
};

namespace internal {
struct BatchData;
}

// A leased batch. Cheap to copy (shared). Reading it stays valid after ack or expiry.
class Batch {
 public:
  Batch() = default;
  BatchId id() const noexcept;
  std::span<const Trajectory> trajectories() const noexcept;
  std::span<const TrajectoryInfo> info() const noexcept;
  std::size_t size() const noexcept { return trajectories().size(); }
  std::size_t num_tokens() const noexcept;
  Duration lease_deadline() const noexcept;  // on the queue's clock
  // Takes the trajectories out: moved when no one else holds them (after ack, and no copy of
  // this Batch left), copied otherwise. The batch is empty afterwards.
  std::vector<Trajectory> release();

 private:
  friend class TrajectoryQueue;
  explicit Batch(std::shared_ptr<internal::BatchData> d) : d_(std::move(d)) {}
  std::shared_ptr<internal::BatchData> d_;
};

// Power-of-two buckets of milliseconds: [0,1), [1,2), [2,4), ... the last one open-ended.
struct WaitHistogram {
  static constexpr int kBuckets = 16;
  std::uint64_t count = 0;
  double sum_ms = 0;
  double max_ms = 0;
  std::uint64_t buckets[kBuckets] = {};
};

struct TrajectoryQueueStats {
  // Depth.
  std::size_t ready = 0;               // trajectories ready to pop
  std::size_t ready_tokens = 0;
  std::size_t pending_groups = 0;      // groups waiting for members
  std::size_t pending_group_trajectories = 0;
  std::size_t leases = 0;              // batches leased, not yet acked
  std::size_t leased_trajectories = 0;
  std::size_t held_tokens = 0;         // all tokens the queue holds, what capacity_tokens bounds
  std::size_t blocked_producers = 0;   // threads waiting in push() for space
  std::size_t blocked_consumers = 0;   // threads waiting in pop_batch() for trajectories
  Version newest_version;
  // Flow.
  std::uint64_t pushed = 0;
  std::uint64_t delivered = 0;         // counted once per delivery, so redeliveries count again
  std::uint64_t acked = 0;             // trajectories
  std::uint64_t nacked_batches = 0;
  std::uint64_t expired_leases = 0;
  std::uint64_t redelivered = 0;       // trajectories returned by nack or expiry
  // Refused pushes.
  std::uint64_t rejected_invalid = 0;
  std::uint64_t rejected_full = 0;     // fail-fast, timed out, or closed while waiting
  // Drops by reason.
  std::uint64_t dropped_stale = 0;
  std::uint64_t dropped_group_timeout = 0;
  std::uint64_t dropped_late_for_group = 0;  // refused: the group had already been closed
  // Staleness of delivered trajectories: [0], [1], ... [kStalenessBuckets-2], and the rest.
  static constexpr int kStalenessBuckets = 17;
  std::uint64_t staleness[kStalenessBuckets] = {};
  // From a group's first member to its release (complete or timed out).
  WaitHistogram group_wait;
  // Write-ahead log.
  bool wal = false;
  std::uint64_t wal_bytes = 0;
  std::uint64_t wal_records = 0;
  std::uint64_t wal_compactions = 0;

  // {"depth": {...}, "flow": {...}, "rejected": {...}, "drops": {"stale": n, "group_timeout": n,
  //  "late_for_group": n}, "staleness_histogram": {"0": n, ..., "16+": n},
  //  "group_wait_ms": {"count", "mean", "max", "buckets": [{"lt": 1, "n": k}, ...]}, "wal": {...}}
  std::string to_json() const;
};

// What replaying the write-ahead log found.
struct RecoveryReport {
  bool replayed = false;           // a log existed
  std::uint64_t records = 0;       // good records read
  std::uint64_t recovered = 0;     // trajectories pushed and never acked or dropped: back in the queue
  std::uint64_t retired = 0;       // trajectories acked or dropped before the restart
  std::uint64_t discarded_bytes = 0;  // torn or corrupt tail cut off
  // OK, or kDataLoss naming the file, the offset and what was wrong with the tail that was cut.
  Status tail;

  // {"replayed", "records", "recovered", "retired", "discarded_bytes", "tail": "OK" or the status}
  std::string to_json() const;
};

class TrajectoryQueue;

// Keeps a callback registered by TrajectoryQueue::watch_room; unregisters it on destruction or
// reset(). Once that returns the callback is not running and will not run again. Move-only; an
// empty one holds nothing. Preconditions: the queue outlives it.
class RoomWatch {
 public:
  RoomWatch() = default;
  RoomWatch(const RoomWatch&) = delete;
  RoomWatch& operator=(const RoomWatch&) = delete;
  RoomWatch(RoomWatch&& o) noexcept : queue_(o.queue_), id_(o.id_) { o.queue_ = nullptr; }
  RoomWatch& operator=(RoomWatch&& o) noexcept;
  ~RoomWatch() { reset(); }
  void reset() noexcept;

 private:
  friend class TrajectoryQueue;
  RoomWatch(TrajectoryQueue* queue, std::uint64_t id) : queue_(queue), id_(id) {}
  TrajectoryQueue* queue_ = nullptr;
  std::uint64_t id_ = 0;
};

class TrajectoryQueue {
 public:
  // kInvalidArgument for zero or too large capacities, a non-positive default_lease or
  // group_timeout, or an id_dedup_window of 0 or above 2^29. With a WAL: kFailedPrecondition if
  // the path is not a regular file (a directory, a FIFO, ...), holds a file that is not a laminar
  // WAL (which is never overwritten), or is a log another queue has open; kDataLoss if it has a
  // corrupt record followed by anything but zero bytes (a damaged middle is not silently skipped:
  // records after it could be the acks that keep delivery exactly-once); a torn or corrupt tail is
  // cut and reported in recovery().
  static Result<std::unique_ptr<TrajectoryQueue>> create(TrajectoryQueueOptions options = {});
  // Preconditions: no thread is inside a call of this queue.
  ~TrajectoryQueue();
  TrajectoryQueue(const TrajectoryQueue&) = delete;
  TrajectoryQueue& operator=(const TrajectoryQueue&) = delete;

  // The actor announces a newly published version. kInvalidArgument if `v` is older than the
  // newest one (republishing the newest is fine).
  Status publish_version(Version v);
  Version newest_version() const noexcept;

  // Takes `t` (moved from only on success). Refusals, each leaving `t` untouched:
  //   kInvalidArgument: validate_trajectory (with TrajectoryQueueOptions::validate_contents) failed, version
  //     ahead of newest_version(), a group member disagreeing with the group (group_size, prompt_id)
  //     or repeating a sample_index, or a trajectory larger than capacity_tokens;
  //   kAlreadyExists: its id is in the queue or recently retired (a producer retrying a push it is
  //     unsure of may take this as delivered);
  //   kFailedPrecondition: its group was already closed (released, dropped or complete);
  //   kUnavailable (kFailFast) / kDeadlineExceeded (kTimeout): the queue is full;
  //   kCancelled: close() was called;  kDataLoss/kResourceExhausted: the WAL write failed.
  // Returns once the trajectory is in the queue (and in the WAL's file, when there is one).
  Status push(Trajectory&& t, PushOptions options = {});

  // push() for several trajectories, taking room for all of them at once and the lock once: for a
  // rollout engine that returns a prompt's samples together, or any producer with more than one
  // finished. One Status per trajectory, in order, the same push() would give; a trajectory is
  // moved from only when its Status is OK. When the queue has room for all of them they go in
  // together, and with a WAL their records too, with one fdatasync for all under wal_fsync (a
  // failed write or sync refuses every one of them); otherwise each is pushed on its own, in
  // order, waiting or failing as `options` says.
  std::vector<Status> push_many(std::span<Trajectory> ts, PushOptions options = {});

  // Leases a batch. kInvalidArgument for a spec with no limit, min_trajectories above
  // max_trajectories, or a consumer_version ahead of newest_version(); kUnavailable when fewer than
  // min_trajectories are ready and spec.wait is zero; kDeadlineExceeded when they did not become
  // ready within spec.wait; kCancelled after close().
  Result<Batch> pop_batch(const BatchSpec& spec);

  // Commits a batch: its trajectories are never delivered again. kNotFound for an unknown (or
  // already acked) id; kAborted when its lease ran out (its trajectories went back to the queue
  // and may already be with another consumer: do not apply this batch).
  Status ack(BatchId batch);
  // Gives a batch back for redelivery, ahead of everything else. Same errors as ack().
  Status nack(BatchId batch);

  // Wakes every blocked push and pop with kCancelled; later pushes and pops are refused. Acks and
  // nacks are still taken, so a consumer can commit what it holds.
  void close();

  // For a thread that waits for room among events of its own (the remote queue's server, which
  // must stay stoppable), in place of a blocking push: calls `wake` each time room may have come
  // free (trajectories acked or dropped), the queue closed, or its clock jumped, on the thread
  // that did it and with no lock of the queue held. `wake` must not call into the queue. A push
  // refused as full is worth trying again after a wake, or once until_group_timeout() passes.
  [[nodiscard]] RoomWatch watch_room(std::function<void()> wake);
  // How long until, on the queue's clock, the next group timeout falls due: zero when it has,
  // kForever when no group waits. It runs inside the next call, where it may drop members (freeing
  // room) or close a group (refusing a member that waits for room); a waiting push() wakes for
  // it, and so should a watcher.
  Duration until_group_timeout() const;

  TrajectoryQueueStats stats() const;
  const RecoveryReport& recovery() const noexcept;
  // The ids of the trajectories the write-ahead log gave back (RecoveryReport::recovered of them),
  // in the log's order: what a restarted actor tells its RolloutDispatcher is completed.
  std::span<const TrajectoryId> recovered_ids() const noexcept;
  // The first error of work no caller was waiting on: writing the log for a lease expiry, a group
  // timeout, a stale drop, a group's completion, or a compaction. OK when there was none. Such a
  // failure never loses a trajectory: the log then holds it as live, so a restart redelivers it.
  Status background_error() const;

 private:
  friend class RoomWatch;
  struct Impl;
  explicit TrajectoryQueue(std::unique_ptr<Impl> impl);
  void unwatch_room(std::uint64_t id) noexcept;
  std::unique_ptr<Impl> impl_;
};

}  // namespace laminar
