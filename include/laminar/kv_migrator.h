// kv_migrator.h: KvMigrator, which moves live sequences with their paged KV cache from one rollout
// worker to another, same host or not, without changing a token they go on to produce.
//
// One KvMigrator per rollout worker, on the process's Transport and the worker's PagedKvCache. It
// is both a source (migrate() sends sequences away) and a destination (it answers offers from other
// workers' migrators). What moves: every page a sequence fills, in every layer of both pools, and
// its SequenceState (tokens so far, sampling parameters, RNG seed and position, policy version,
// behaviour log-probs, trajectory and group ids, the engine's own opaque state).
//
// How a migration runs (after Llumnix, OSDI'24):
//   1. offer: the source names the sequences, their lengths, the pages each needs (with room to
//      keep growing while it is copied), its version and its KV layout. The destination refuses
//      before anything moves (another version or layout, not enough free pages or batch slots, an
//      id it already holds) or takes the pages out of its free list under a lease and answers
//      with their ids and its pools' registered regions.
//   2. live stages: while the source keeps decoding, it puts every page filled since the last
//      stage straight into the reserved pages (Transport::put) and then sends their xxh3
//      checksums; the destination checks them against what arrived. A page is copied once it is
//      full, and a full page never changes again, so decoding and copying do not race.
//   3. final stage: once a live stage finds little new (pause_after_pages), or after
//      max_live_stages, the source asks its host to pause the sequences (kPauseRequested); the host
//      stops decoding them and hands over their states (finish()). The source puts what is left
//      (the last, partly filled page and any full page since the last stage) and sends the final
//      stage with the states. The destination checks page counts and checksums, makes the
//      sequences its own (they are live there from this moment: kArrived) and answers; the source,
//      on that answer, releases them (kDone). Only the final stage pauses a sequence, so its
//      downtime does not grow with its length. max_live_stages 0 is the blocking copy: pause at
//      once, copy everything while paused.
// A migration cut anywhere leaves each sequence at exactly one worker: until the destination
// commits, the source still holds it and resumes it (kAborted); the destination commits only a
// final stage whose pages all checked out, and the source lets go only on the destination's
// answer. Either side may abort() before the final stage; a destination that hears nothing from
// its source for `lease`, or sees its connection close, gives up; a source that waits on its
// destination for stall_timeout, or sees the connection close, aborts and resumes. A destination
// that gives up while its source may still be putting (abort(), a refused stage, an expired
// lease) keeps the reserved pages out of the free list until the source confirms, by its own
// abort, that its puts landed, or the connection closes, or another lease passes: a late put
// never lands in a page another sequence took.
// One case is left to the layer above: when the link fails after the destination committed but
// before its answer arrived, both sides hold the sequence; its trajectory id is the same on both,
// so the TrajectoryQueue takes only the first of the two (exactly-once by id).
//
// Device pools. When the cache's pools are in CUDA device memory, the pages go by NCCL send/recv
// instead of Transport puts; everything else (offer, stages, checksums checked on both sides,
// leases, aborts) is the same protocol over the transport. The destination makes one NCCL
// communicator of two ranks per source connection and hands its unique id over in the reservation;
// both sides join it in the background (ncclCommInitRankConfig, non-blocking: poll() watches it,
// and gives up after stall_timeout) and keep it for later migrations. A stage's message goes first
// (which pages, in which runs, their checksums), then the source posts one grouped ncclSend per run
// and layer and pool on a stream of the link's own, and the destination the matching receives, in
// the order the stages were numbered on the link. Checksums come from a kernel both sides run on
// their own device (cuda/kv_page_checksum.cuh), the source before its stage goes, the destination
// once the pages are in; poll() only queries events. A migration that ends short, on either side,
// aborts its link (ncclCommAbort), which ends every transfer in flight on it: NCCL writes only into
// receives the destination posted, so after that no late write can land in a page, and the
// reserved pages return at once. The next migration between the two makes a new link. NCCL takes
// one rank per GPU: the two workers must be on different devices.
//
// Threads. The migrator never touches the cache from a thread of its own: PagedKvCache is not
// thread-safe, and the host's decode loop owns it. Everything that reads or changes the cache runs
// inside poll(), migrate(), finish() and abort(), which the host calls from its decode loop
// between steps. The transport's callback thread only queues the messages that arrive; its
// progress thread reads source pages for puts (full pages, which no longer change) and writes
// reserved pages (which the cache hands to nobody else). Host pools must be memory the migrator
// can register with the transport, or memory the transport allocated (allocate_cache): on one
// host, peers put into the latter with one memcpy, into the former through UCX's software
// emulation of a put, more than ten times slower (bench/README.md). Device pools are reached only
// by CUDA and NCCL calls made from those same calls (on the cache's device, which they make
// current) and by NCCL's own threads, which join links and move the bytes; no call waits for the
// peer.
//
//   auto pools = laminar::KvMigrator::allocate_cache(*transport, layout).value();
//   laminar::KvMigratorOptions options;
//   options.k_pool_region = pools.k_pool;
//   options.v_pool_region = pools.v_pool;
//   auto mig = laminar::KvMigrator::create(transport, pools.cache, options).value();
//   mig->set_version(current_version);                           // whenever the weights change
//   laminar::Result<laminar::MigrationId> id = mig->migrate(dest_address, {SequenceId(7)});
//   for (;;) {                                                   // the decode loop
//     for (laminar::MigrationEvent& e : mig->poll()) {
//       if (e.kind == laminar::MigrationEvent::Kind::kPauseRequested)
//         (void)mig->finish(e.id, states_of(e.sequences));       // and stop decoding them
//       if (e.kind == laminar::MigrationEvent::Kind::kArrived) resume_here(e.states);
//       if (e.kind == laminar::MigrationEvent::Kind::kAborted && e.outgoing) resume(e.sequences);
//       if (e.kind == laminar::MigrationEvent::Kind::kDone) forget(e.sequences);
//     }
//     decode_one_step();
//   }
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "laminar/clock.h"
#include "laminar/kv_cache.h"
#include "laminar/status.h"
#include "laminar/transport.h"
#include "laminar/types.h"

namespace laminar {

// What a sequence's decoding resumes from on the destination. The host fills it when the source
// pauses the sequence (finish()) and receives it back in kArrived.
struct SequenceState {
  SequenceId sequence;
  TrajectoryId trajectory;
  PromptId prompt_id;
  GroupId group_id;
  std::uint32_t group_size = 1;    // as Trajectory: 1 is not grouped
  std::uint32_t sample_index = 0;  // < group_size
  Version version;                 // policy version of every response token
  float temperature = 1.0f;        // finite, >= 0
  float top_p = 1.0f;              // in (0, 1]
  std::int32_t top_k = 0;          // >= 0; 0: off
  std::uint64_t seed = 0;
  std::uint64_t rng_position = 0;
  std::uint64_t kv_length = 0;  // tokens whose K and V are in the pages; <= prompt + response
  std::vector<std::int32_t> prompt_tokens;
  std::vector<std::int32_t> response_tokens;
  std::vector<float> logprobs;  // [response_tokens.size()], each <= 0
  std::string engine_state;     // opaque to laminar, at most 1 MiB
  friend bool operator==(const SequenceState&, const SequenceState&) = default;
};

// Where a migration stands, as either side sees it.
enum class MigrationState : std::uint8_t {
  kRunning,                // offered, staging, or paused for the final stage
  kAbortedBySource,        // the source gave up (abort(), its destination stalled, a bad answer)
  kAbortedByDestination,   // the destination refused, gave up, vanished, or its lease ran out
  kDone,                   // the destination holds the sequences; the source released them
};
std::string_view to_string(MigrationState s) noexcept;

struct MigrationEvent {
  enum class Kind : std::uint8_t {
    kPauseRequested,  // source: stop decoding `sequences` and call finish() with their states
    kDone,            // source: `sequences` live at the destination and were released from the cache
    kAborted,         // outgoing: `sequences` are still here, resume them; incoming: the reserved
                      //   pages went back to the free list (state() already said aborted)
    kArrived,         // destination: `sequences` are in the cache, decode them from `states`
  };
  Kind kind = Kind::kDone;
  MigrationId id;
  bool outgoing = true;  // this worker is the migration's source
  MigrationState state = MigrationState::kRunning;
  std::vector<SequenceId> sequences;
  std::vector<SequenceState> states;  // kArrived only, in the order of `sequences`
  Status reason;                      // kAborted: why (names the side and the cause)
};

struct KvMigratorOptions {
  // A destination returns a migration's reserved pages when it hears nothing from the source for
  // this long (positive). Every stage and answer renews it.
  Duration lease = std::chrono::seconds(10);
  // A source aborts when its destination leaves a reservation or a stage unanswered this long
  // (positive, or kForever). It must exceed the destination's time to check one stage's checksums
  // and one of its decode steps (the destination answers from poll()).
  Duration stall_timeout = std::chrono::seconds(10);
  // Connecting to a destination (migrate() waits for it).
  Duration connect_timeout = std::chrono::seconds(5);
  // Live stages before the source asks to pause; 0 is the blocking copy.
  std::uint32_t max_live_stages = 8;
  // The source asks to pause once a live stage copied at most this many pages per sequence
  // (the sequences have caught up: what is left is about one step's growth).
  std::uint32_t pause_after_pages = 1;
  // Pages a sequence may still fill while it is copied, reserved at the destination beyond those
  // it fills at the offer. A sequence that reaches them is paused at once.
  std::uint32_t growth_pages = 4;
  // Bytes of pages (all layers, both pools) behind one stage message at most: the copy is
  // pipelined in pieces of this size, and the destination checks one while the next is in flight.
  std::size_t stage_bytes = std::size_t{32} << 20;
  // Batch slots of this worker: an offer that would take cache sequences plus incoming ones past
  // this is refused.
  std::uint32_t max_sequences = 256;
  // Migrations at once, each way; one more migrate() is kUnavailable, one more offer refused with
  // kUnavailable (both transient: retry once one ends).
  std::uint32_t max_migrations = 8;
  // Time of leases and stalls (null: Clock::steady()).
  std::shared_ptr<Clock> clock;
  // The transport's regions that are the cache's pools, both or neither: each starts at its pool
  // and is as long (KvMigrator::allocate_cache makes them). Empty: create() registers the pools.
  MemoryRegion k_pool_region;
  MemoryRegion v_pool_region;
};

struct KvMigratorStats {
  std::uint64_t migrations_out = 0;      // started by migrate()
  std::uint64_t migrations_in = 0;       // offers this worker reserved pages for
  std::uint64_t done_out = 0;            // outgoing migrations that reached kDone
  std::uint64_t done_in = 0;             // incoming migrations committed here
  std::uint64_t aborted_out = 0;
  std::uint64_t aborted_in = 0;          // incoming ones aborted, lease expiries included
  std::uint64_t offers_refused = 0;      // offers refused before any page was reserved
  std::uint64_t lease_expiries = 0;
  std::uint64_t pages_sent = 0;          // page copies put (a page counts once for all layers)
  std::uint64_t pages_received = 0;      // page copies checked here
  std::uint64_t bytes_sent = 0;
  std::uint64_t checksum_failures = 0;   // pages that arrived here and failed their check

  std::string to_json() const;
};

class KvMigrator {
 public:
  // Registers host pools with the transport (unless the options give their regions) and installs
  // the migration handlers (laminar's reserved message types). kInvalidArgument for a null
  // transport or cache, non-positive lease, connect_timeout or stall_timeout, zero stage_bytes,
  // max_sequences or max_migrations, pool regions given alone, of another transport, or not
  // exactly the pools; for pools in device memory, kUnimplemented in a build without CUDA and
  // kFailedPrecondition, naming the CUDA error, without a usable device; kAlreadyExists when
  // another KvMigrator serves on `transport`.
  static Result<std::unique_ptr<KvMigrator>> create(std::shared_ptr<Transport> transport,
                                                    std::shared_ptr<PagedKvCache> cache,
                                                    KvMigratorOptions options = {});
  // A cache whose pools `transport` allocates (zero-filled), and their regions for
  // KvMigratorOptions. The cache keeps the memory alive. kInvalidArgument for a bad layout;
  // kResourceExhausted when the memory is not there.
  struct AllocatedCache {
    std::shared_ptr<PagedKvCache> cache;
    MemoryRegion k_pool;
    MemoryRegion v_pool;
  };
  static Result<AllocatedCache> allocate_cache(Transport& transport, const KvLayout& layout);
  // Aborts every running migration (telling each peer), returns reserved pages and removes the
  // handlers. Outgoing sequences stay in the cache.
  ~KvMigrator();
  KvMigrator(const KvMigrator&) = delete;
  KvMigrator& operator=(const KvMigrator&) = delete;

  // The policy version of this worker's weights: offers of another version are refused, and
  // outgoing migrations carry it.
  void set_version(Version v);
  Version version() const;

  // Starts moving `sequences` (live in the cache, none already moving) to the migrator listening
  // at `destination` ("host:port" of its transport). Connects first if not connected (at most
  // connect_timeout), then sends the offer and returns; the rest runs in poll(). kInvalidArgument:
  // empty or repeated ids, more than 1024; kNotFound: an id not in the cache; kFailedPrecondition:
  // an id already moving; kUnavailable: max_migrations running (retry once one ends); kUnavailable /
  // kDeadlineExceeded / kFailedPrecondition from connecting.
  Result<MigrationId> migrate(std::string_view destination, std::span<const SequenceId> sequences);

  // Advances every migration, both ways: takes answers and offers that arrived, puts pages, sends
  // stages, checks checksums, expires leases. Returns what happened since the last call, in order.
  // Never blocks on a peer.
  std::vector<MigrationEvent> poll();

  // Waiting instead of polling in a loop, for a host with nothing to decode (or a test). The same
  // thread rules as poll().
  // poll(), then, while it returns nothing, waits until the transport brings something (a message,
  // an answer, a put that landed, a closed connection), a lease or stall timeout falls due, or
  // `timeout` passes on the migrator's clock (a ManualClock's jump wakes it), and polls again.
  // Returns the first events, or none once `timeout` passed. With device pools, while NCCL work is
  // in flight, it polls every 100 us: a transfer that ends wakes nothing.
  std::vector<MigrationEvent> wait_event(Duration timeout);
  // For a host that waits for several things at once on its own condition variable: `notify` runs
  // each time poll() may have something new, on whichever thread learnt it (the transport's, one
  // advancing a ManualClock, or the caller's own inside a migrator call), so it must only wake a
  // waiter, never call into this migrator. Such a waiter also wakes by poll_deadline(). Replaces the
  // previous hook (empty: none); once this returns the previous one is not running.
  void set_notify(std::function<void()> notify);
  // The instant (on the migrator's clock) by which poll() should run even if no notify comes: the
  // nearest lease or stall timeout, now when work is ready at once, kForever when nothing is timed.
  Duration poll_deadline() const;

  // After kPauseRequested: the states of the paused sequences, one per sequence of the event, in
  // any order. Starts the final stage. kNotFound: unknown migration; kFailedPrecondition: not
  // waiting for its states; kInvalidArgument naming the sequence: a state missing, repeated or of
  // another sequence, its kv_length not the cache's length, its version not this worker's, or a
  // state the wire refuses (see SequenceState); after any of these the migration still waits for
  // a valid finish(). A sequence that left the cache or outgrew the pages reserved for it cannot
  // move: the migration aborts (kAborted event) and finish() returns why (kFailedPrecondition /
  // kResourceExhausted).
  Status finish(MigrationId id, std::vector<SequenceState> states);

  // Gives a running migration up, from either side, and tells the peer. Source: the sequences
  // stay here (resume them after the kAborted event); destination: the reserved pages return once
  // the source confirms (the kAborted event), its connection closes, or a lease passes.
  // kNotFound: unknown or finished migration; kFailedPrecondition: the final stage is already sent
  // (source) or committed (destination): its outcome is the destination's now.
  Status abort(MigrationId id, std::string_view reason);

  // kRunning, kAbortedBy..., kDone for a migration this worker took part in (either side);
  // kNotFound once forgotten (a finished migration is kept until 1,024 newer ones finished).
  Result<MigrationState> state(MigrationId id) const;
  // Sequences of running migrations, either way: a host does not decode incoming ones (not in the
  // cache yet) and must not migrate or release outgoing ones.
  std::vector<SequenceId> moving() const;
  // "host:port" to give sources: the transport's listen address (none if it does not listen).
  std::optional<std::string> address() const;
  KvMigratorStats stats() const;
  // First error of background work that cannot be retried (a peer sent bytes that do not decode
  // is not one: that migration aborts); OK otherwise.
  Status background_error() const;

 private:
  struct Impl;
  explicit KvMigrator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace laminar
