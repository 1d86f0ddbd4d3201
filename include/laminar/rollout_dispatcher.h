// rollout_dispatcher.h: RolloutDispatcher and DispatchClient, the control plane between the actor
// and its rollout workers: which prompts go to which worker, gated by the schedule's admission
// rule, handed out again when a worker is lost, and completed exactly once.
//
// The unit of work is a group: a prompt times group_size samples. Group g (counted from 0 in the
// order the dispatcher makes them) is prompt first_prompt + g; its sample s has trajectory id
// prompt_index * group_size + s and a sampling seed drawn from (seed, trajectory id), so a sample
// handed out again is the same sample, and two runs with the same options deal the same prompts
// and seeds. A worker maps prompt_index to its prompt itself, or reads the group's payload (the
// bytes RolloutDispatcherOptions::payload gave for it).
//
// The dispatcher lives in the actor's process, on its Transport (which listens). Each rollout
// worker's DispatchClient asks: "worker w, weights v, k free slots, these trajectory ids I decode
// now, and you may hold this request up to `wait`". The answer is a Grant: up to k samples (the
// oldest group first, whole groups preferred: a group is split only when the worker has room for
// none of it), or "pull version u or newer first", or "nothing". A request that would get nothing
// waits at the dispatcher (a long poll) until there is work for it or its wait ends, so a worker
// with free slots asks once and sleeps; a worker with none asks only to renew its lease.
//
// What may be handed out is the admission rule's choice, a value the host sets (set_rule):
//   sync:           open(B) makes B groups for workers on exactly the newest published weights;
//                   the host waits for them (wait_done), trains, publishes, repeats.
//   one step ahead: open(B) makes B groups for the newest weights or any newer; generation runs one
//                   version ahead of training.
//   stream:         groups are made on demand for any worker whose weights are at least
//                   newest - max_staleness, while at most max_in_flight samples are handed out or
//                   waiting. A worker drains its live sequences before it pulls newer weights.
//   interruptible:  the stream's gate, and every grant to a worker behind the newest version says
//                   so (Grant::interrupt): the worker pulls at once and keeps its live sequences,
//                   re-prefilling them under the new weights (AReaL's interruptible rollouts). Their
//                   tokens then span versions; the host tags such trajectories (its metadata).
// open(vmin, vmax, n) makes groups for any window of versions, under any rule.
//
// Completion. The actor calls completed(id) for each trajectory its TrajectoryQueue took (for
// remote producers, from TrajectoryQueueServerOptions::on_accepted, before the producer hears its
// push went in); a group is done when all its samples are. A completed id is never handed out again, and completing it
// again is counted (stats().duplicates), not double-counted.
//
// Ownership and loss. Each request's held list says what the worker decodes now: an id on it is
// that worker's, wherever it was before (a migrated sequence is claimed by its new worker, and an
// id waiting to be handed out again is taken back). A sample a worker stops listing without its
// completion arriving (in flight to the queue, or migrating) is released; if nobody completes or
// claims it within one lease it goes back to be handed out again. One it lists as returned goes
// back at once. A worker is lost when its
// connection closes or it has asked nothing within a lease (a request waiting at the dispatcher
// counts as asking): what it held and nobody completed or claimed goes back to the front of the
// queue at once, same trajectory id and seed. Memory is bounded: max_workers workers (each with at
// most one waiting request), max_held ids per worker, max_open_groups groups between the oldest
// not done and the newest, max_payload_bytes per group.
//
// Restart. The dispatcher lives and dies with the actor's process. snapshot() gives what a
// successor needs (the groups made, and of those not done which samples are completed, out with a
// worker, or waiting), small enough to keep with the trainer's checkpoint. A dispatcher created
// with it (RolloutDispatcherOptions::resume) goes on from there: groups the snapshot has as done
// stay done; a sample that was out waits claim_window for its worker to list it (the workers
// reconnect and ask again) or for its completion (the queue's write-ahead log gives back what was
// pushed), and is then handed out again. Groups made after the snapshot are not in it: a resumed
// dispatcher adopts them when a worker lists one of their samples or the host completes one (all
// of their samples count as out until then), and its streams make new groups after the newest it
// knows. So a sample its worker has not listed again yet may be handed out a second time; the
// queue takes whichever copy comes first and refuses the other (kAlreadyExists), and the worker
// still decoding it is told to drop it.
//
// Threads. Requests are taken on the transport's callback thread; a request that gets an answer
// at once is answered there. The dispatcher's own thread answers the requests that waited (when a
// change gives them work, or their wait ends) and wakes at lease ends; it sleeps otherwise. Every
// method is thread-safe. A DispatchClient has no thread: request() blocks its caller;
// request_async() returns at once, and DispatchClientOptions::on_answer tells a loop that sleeps
// on its own condition variable that the answer is there.
//
//   // the actor:
//   auto d = laminar::RolloutDispatcher::create(transport, {.group_size = 8, .seed = 1}).value();
//   (void)d->publish(laminar::Version(1));
//   (void)d->open(16);                                            // sync: 16 groups for version 1
//   // a rollout worker:
//   auto c = laminar::DispatchClient::create(transport, {.worker = w, .server = address}).value();
//   laminar::Result<laminar::Grant> g = c->request({.version = v, .free_slots = 4, .wait = 1s});
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "laminar/clock.h"
#include "laminar/status.h"
#include "laminar/transport.h"
#include "laminar/types.h"

namespace laminar {

// A window's version_max for "these weights or any newer".
inline constexpr Version kAnyNewerVersion{std::numeric_limits<std::uint64_t>::max()};

// Which groups exist and which workers may take them.
struct AdmissionRule {
  enum class Kind : std::uint8_t { kSync, kOneStepAhead, kStream, kInterruptible };
  Kind kind = Kind::kSync;
  // Streams only: a worker's weights may lag the newest version by this many versions.
  std::uint64_t max_staleness = 0;
  // Streams only (at least group_size): samples handed out or waiting to be, not yet completed; the
  // stream makes a group only while one more fits under it.
  std::uint64_t max_in_flight = 0;

  static AdmissionRule sync() { return {}; }
  static AdmissionRule one_step_ahead() { return {Kind::kOneStepAhead, 0, 0}; }
  static AdmissionRule stream(std::uint64_t max_staleness, std::uint64_t max_in_flight) {
    return {Kind::kStream, max_staleness, max_in_flight};
  }
  static AdmissionRule interruptible(std::uint64_t max_staleness, std::uint64_t max_in_flight) {
    return {Kind::kInterruptible, max_staleness, max_in_flight};
  }
  bool is_stream() const { return kind == Kind::kStream || kind == Kind::kInterruptible; }
  friend bool operator==(const AdmissionRule&, const AdmissionRule&) = default;
};

// What a dispatcher hands to its successor after the host's process restarts
// (RolloutDispatcher::snapshot, RolloutDispatcherOptions::resume). Group g is prompt
// first_prompt + g; groups below groups_made and not in `open` are done.
struct DispatcherSnapshot {
  enum class SampleState : std::uint8_t {
    kWaiting = 0,    // not handed out yet
    kOut = 1,        // with a worker, or released by one and not completed yet
    kCompleted = 2,  // in the trainer's queue
  };
  struct Group {
    std::uint64_t index = 0;
    bool stream = false;  // made by a stream rule; otherwise for weights in [version_min, version_max]
    Version version_min;
    Version version_max;
    std::vector<SampleState> samples;  // group_size of them, by sample index; not all completed
    friend bool operator==(const Group&, const Group&) = default;
  };
  std::uint32_t group_size = 0;
  std::uint64_t first_prompt = 0;
  std::uint64_t groups_made = 0;
  std::vector<Group> open;  // made and not done, oldest first

  // The bytes to keep (a checkpoint's): little-endian u32 group_size, u64 first_prompt,
  // u64 groups_made, u32 n, then n times u64 index, u8 stream, u64 version_min, u64 version_max
  // and group_size u8 states.
  std::vector<std::byte> encode() const;
  // kDataLoss naming the field and offset for bytes encode() would not write (short, long);
  // kInvalidArgument for a snapshot that cannot be (RolloutDispatcher::create's checks on resume).
  static Result<DispatcherSnapshot> decode(std::span<const std::byte> bytes);
  friend bool operator==(const DispatcherSnapshot&, const DispatcherSnapshot&) = default;
};

struct RolloutDispatcherOptions {
  // Samples per group, G (positive).
  std::uint32_t group_size = 0;
  // Base of every sample's sampling seed.
  std::uint64_t seed = 0;
  // Prompt index of group 0.
  std::uint64_t first_prompt = 0;
  // The rule at the start (set_rule changes it).
  AdmissionRule rule = AdmissionRule::sync();
  // A worker silent this long is lost; a released sample nobody claims this long is handed out
  // again (positive).
  Duration lease = std::chrono::seconds(10);
  // The longest a request may wait for work (positive, at most lease): a longer wait asked for is
  // cut to it.
  Duration max_wait = std::chrono::seconds(5);
  // Workers known at once (positive): a request from one more is refused with kResourceExhausted.
  std::uint32_t max_workers = 64;
  // Ids one request may carry: its held list, its returned list and its free slots (positive).
  std::uint32_t max_held = 1024;
  // Groups from the oldest not done to the newest (positive).
  std::uint64_t max_open_groups = 1 << 16;
  // The bytes each group's samples carry to the worker (Sample::payload), from its prompt index
  // (null: none). Called when the group is made, holding the dispatcher's lock: it must not call
  // the dispatcher. A payload above max_payload_bytes makes no group: open() answers
  // kInvalidArgument, and the stream stops making groups and keeps the error as background_error().
  std::function<std::string(std::uint64_t prompt_index)> payload = nullptr;
  std::uint32_t max_payload_bytes = 64 << 10;
  // Time of leases and waits (null: Clock::steady()).
  std::shared_ptr<Clock> clock = nullptr;
  // Called with stats().available each time it changes (null: never), on the thread that changed
  // it and holding the dispatcher's lock, so the calls arrive in order: it must not call the
  // dispatcher.
  std::function<void(std::uint64_t)> on_available = nullptr;
  // Go on from a predecessor's snapshot (see Restart above; null: a new run). Its group_size and
  // first_prompt must be these options'.
  std::optional<DispatcherSnapshot> resume = std::nullopt;
  // Resumed only: how long a sample that was out (or is in a group adopted since) waits for its
  // worker to list it, or for its completion, before it is handed out again (positive, at most the
  // lease). About the workers' reconnect interval: longer only delays the samples nobody holds.
  Duration claim_window = std::chrono::seconds(2);
};

struct RolloutDispatcherStats {
  std::uint64_t requests = 0;          // requests answered with a grant
  std::uint64_t refused = 0;           // requests answered with an error (malformed, invalid, full)
  std::uint64_t waited = 0;            // requests that waited for work before their answer
  std::uint64_t groups_made = 0;       // by open() and by the stream
  std::uint64_t groups_done = 0;       // every sample completed
  std::uint64_t handed_out = 0;        // samples in grants, reissued ones included
  std::uint64_t reissued = 0;          // samples put back to be handed out again
  std::uint64_t returned = 0;          // of those, given back unstarted by their worker
  std::uint64_t claimed = 0;           // held ids that moved to the worker listing them
  std::uint64_t completed = 0;         // completions counted once
  std::uint64_t duplicates = 0;        // completions of an id completed already
  std::uint64_t lost_workers = 0;      // by connection close or lease
  std::uint64_t adopted_groups = 0;    // resumed: groups made after the snapshot, made again here
  std::uint64_t workers = 0;           // known now
  std::uint64_t waiting_requests = 0;  // requests waiting for work now
  std::uint64_t in_flight = 0;         // samples made and not completed, now
  std::uint64_t waiting = 0;           // of those, waiting to be handed out (fresh or reissued)
  // Samples a request on the newest weights could be handed now: the waiting ones its weights may
  // take, and those the stream may still make under max_in_flight. The scheduler's queue, as a
  // RepackCoordinator counts it (set_prompts_waiting): on demand, the stream's room is a queue.
  std::uint64_t available = 0;

  std::string to_json() const;
};

// What completed() found.
struct Completion {
  std::uint64_t prompt_index = 0;
  bool duplicate = false;   // completed before: nothing changed
  bool group_done = false;  // this completion finished its group
};

// One sample of one group: prompt `prompt_index`, sample `sample_index` of its group, decoded
// with sampling seed `seed`.
struct Sample {
  TrajectoryId id;
  std::uint64_t prompt_index = 0;
  std::uint32_t sample_index = 0;
  std::uint64_t seed = 0;
  std::string payload;  // the group's RolloutDispatcherOptions::payload

  friend bool operator==(const Sample&, const Sample&) = default;
};

enum class GrantKind : std::uint8_t {
  kWork = 0,       // `samples` holds the work (at least one sample)
  kPullNewer = 1,  // there is work, for weights of pull_version or newer: pull them, then ask again
  kNothing = 2,    // no work this worker may take now (its wait ended, or it had no free slots)
};

struct Grant {
  GrantKind kind = GrantKind::kNothing;
  Version pull_version;  // kPullNewer only
  std::vector<Sample> samples;  // kWork only
  // Ids of the request's held list that are completed already (another worker finished them):
  // decoding them further is wasted.
  std::vector<TrajectoryId> drop;
  // The newest published version.
  Version newest;
  // Interruptible rule, and the worker's weights are older than `newest`: pull it now, keeping the
  // live sequences.
  bool interrupt = false;

  friend bool operator==(const Grant&, const Grant&) = default;
};

class RolloutDispatcher {
 public:
  // Installs the request handler on `transport` (which the host makes listen) and starts the
  // dispatcher's thread. kInvalidArgument for a null transport, zero group_size, max_workers,
  // max_held or max_open_groups, a non-positive lease or max_wait, a max_wait above the lease, a
  // rule set_rule would refuse, or a first_prompt whose trajectory ids would overflow;
  // kAlreadyExists when another RolloutDispatcher serves on `transport`.
  static Result<std::unique_ptr<RolloutDispatcher>> create(std::shared_ptr<Transport> transport,
                                                           RolloutDispatcherOptions options);
  // Removes the handler (waiting for a request being taken), answers every waiting request with
  // kCancelled and stops the thread.
  ~RolloutDispatcher();
  RolloutDispatcher(const RolloutDispatcher&) = delete;
  RolloutDispatcher& operator=(const RolloutDispatcher&) = delete;

  // Changes the rule; groups made already keep their versions. kInvalidArgument for a stream whose
  // max_in_flight is below one group.
  [[nodiscard]] Status set_rule(AdmissionRule rule);
  // The newest published version, which open(groups) and the streams count from. kInvalidArgument
  // for one older than the newest already set.
  [[nodiscard]] Status publish(Version v);

  // Makes `groups` groups under the sync or one-step-ahead rule (for the newest published version,
  // or it and any newer); returns the first one's prompt index. kFailedPrecondition under a stream
  // (it makes its own); otherwise as open(vmin, vmax, groups).
  Result<std::uint64_t> open(std::uint64_t groups);
  // Makes `groups` groups for workers whose weights are in [version_min, version_max].
  // kInvalidArgument for zero groups, version_min > version_max, or a payload above
  // max_payload_bytes; kResourceExhausted when they would pass max_open_groups.
  Result<std::uint64_t> open(Version version_min, Version version_max, std::uint64_t groups);

  // The trajectory `id` reached the trainer's queue. kNotFound for an id of no group made yet.
  Result<Completion> completed(TrajectoryId id);

  // Blocks until `groups` groups are done in all (stats().groups_done), on the dispatcher's clock.
  // kDeadlineExceeded after `timeout` (kForever: no deadline).
  [[nodiscard]] Status wait_done(std::uint64_t groups, Duration timeout);

  RolloutDispatcherStats stats() const;
  // The state a successor resumes from (RolloutDispatcherOptions::resume): consistent with every
  // completion returned before the call.
  DispatcherSnapshot snapshot() const;
  // The first answer that could not be sent for a reason other than its worker being gone, or a
  // payload the stream refused; OK otherwise.
  Status background_error() const;

 private:
  struct Impl;
  explicit RolloutDispatcher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct DispatchClientOptions {
  // This worker (any id unique in the fleet).
  WorkerId worker{};
  // "host:port" of the actor's transport.
  std::string server{};
  // Connecting in all, retrying every retry_interval while the server is not there yet (positive).
  Duration connect_timeout = std::chrono::seconds(10);
  Duration retry_interval = std::chrono::milliseconds(100);
  // How long an answer may take beyond the request's wait (positive).
  Duration request_timeout = std::chrono::seconds(5);
  // Called once per request_async when its answer (or error) is ready (null: never), on the
  // transport's own thread: it may only wake a waiter.
  std::function<void()> on_answer = nullptr;
};

// What a worker asks.
struct DispatchRequest {
  Version version;               // the weights the worker decodes with
  std::uint32_t free_slots = 0;  // samples it can start now
  // Every sample granted to this worker that it has neither pushed to the queue nor migrated away
  // (a migrated-in one included); a granted sample left off is released.
  std::vector<TrajectoryId> held = {};
  // How long the dispatcher may hold the request while there is nothing for it (zero: answer at
  // once; at most RolloutDispatcherOptions::max_wait is used).
  Duration wait{0};
  // The worker holds nothing and takes the newest weights before any new work (laminar's idle
  // pull): while its version is behind the newest published one it is answered kPullNewer with the
  // newest, at once or as soon as a newer version is published while the request waits.
  bool idle_pull = false;
  // Samples granted to this worker that it gives back unstarted (two answers brought more than it
  // had room for, say): handed out again at once, where leaving them off `held` would hold them for
  // a lease. None may be in `held`; one this worker no longer holds is ignored.
  std::vector<TrajectoryId> returned = {};

  friend bool operator==(const DispatchRequest&, const DispatchRequest&) = default;
};

// A request in flight (DispatchClient::request_async).
class PendingGrant {
 public:
  PendingGrant() = default;
  // Whether get() would return at once.
  bool ready() const;
  // The grant or the request's error; once (kFailedPrecondition after that, or for an empty one).
  Result<Grant> get();

 private:
  friend class DispatchClient;
  explicit PendingGrant(Status error) : error_(std::move(error)), taken_(false) {}
  PendingGrant(std::future<Result<Message>> reply, std::size_t max_samples, std::size_t max_drop,
               std::size_t max_payload)
      : reply_(std::move(reply)), taken_(false), max_samples_(max_samples), max_drop_(max_drop),
        max_payload_(max_payload) {}
  std::future<Result<Message>> reply_;
  Status error_;
  bool taken_ = true;
  std::size_t max_samples_ = 0;
  std::size_t max_drop_ = 0;
  std::size_t max_payload_ = 0;
};

class DispatchClient {
 public:
  // Connects to the server through `transport`, retrying until connect_timeout. kInvalidArgument
  // for a null transport or non-positive durations; the transport's last error otherwise.
  static Result<std::unique_ptr<DispatchClient>> create(std::shared_ptr<Transport> transport,
                                                        DispatchClientOptions options);
  DispatchClient(const DispatchClient&) = delete;
  DispatchClient& operator=(const DispatchClient&) = delete;
  ~DispatchClient();

  // Asks, and returns the dispatcher's grant or its error (kInvalidArgument: it refused the
  // request; kResourceExhausted: too many workers; kCancelled: it shut down), the transport's
  // (kDeadlineExceeded after wait + request_timeout; kUnavailable: the server is gone), or
  // kDataLoss for a malformed grant. A request after a broken connection connects again first
  // (one try).
  // Preconditions:
  //   one request at a time, but for one that waits at the dispatcher, which a new request
  //   replaces (it is answered kNothing); the host takes both answers, and lists in its next
  //   request any sample the replaced one brought after all (the new request released them);
  //   the worker asks at least once per lease (a request waiting at the dispatcher counts).
  Result<Grant> request(const DispatchRequest& request);
  // The same without blocking; on_answer runs when it is ready.
  PendingGrant request_async(const DispatchRequest& request);

  // Closes the connection: the server counts this worker lost and hands its samples out again.
  void close();

 private:
  struct Impl;
  explicit DispatchClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What a worker's loop knows of itself each time round, for DispatchAsker::ask.
struct WorkerState {
  Version version;           // the weights it decodes with
  bool taking = false;       // it may start new work (false while it must pull first)
  std::uint32_t room = 0;    // slots free now, taking or not
  bool idle = false;         // nothing live and nothing migrating
  std::vector<TrajectoryId> held = {};  // as DispatchRequest::held
};

// A rollout worker's questions to the dispatcher, for a loop with no thread of its own: it keeps
// DispatchClient's preconditions (one question out, and the one it replaced until that is
// answered) and asks exactly when the worker's state calls for it, so a worker that has what it
// asked for sends nothing until something changes. Each time round the loop takes the answers
// (answers()), starts their work, gives back what did not fit (give_back()), and then calls
// ask() before it sleeps on DispatchClientOptions::on_answer. ask() sends a question when
//   there is none out and the worker takes work and has room, has samples to give back, holds a
//   sample the dispatcher has not heard it hold (one migrated in: unclaimed, it would be handed
//   out again after a lease), or has asked nothing for renew_after (a worker silent for a lease is
//   lost); or replaces the one out (at most one replaced at a time) when the worker went idle
//   after asking busy (so an idle pull hears of newer weights), has less room than it asked for,
//   has samples to give back, or holds one the question did not list.
// Not thread-safe: one loop owns it.
struct DispatchAskerOptions {
  // Each question's DispatchRequest::wait (positive).
  Duration wait = std::chrono::seconds(4);
  // With no question out, ask (for nothing, when there is no room) once this long has passed since
  // the last question (positive; below the dispatcher's lease).
  Duration renew_after = std::chrono::seconds(5);
  // Time of renew_after (null: Clock::steady()).
  std::shared_ptr<Clock> clock = nullptr;
};

class DispatchAsker {
 public:
  // `client` asks (it must outlive the asker). kInvalidArgument for a null client or a
  // non-positive wait or renew_after.
  static Result<DispatchAsker> create(DispatchClient* client, DispatchAskerOptions options = {});

  // The answers that arrived, the replaced question's first; empty when none did. A question that
  // failed (DispatchClient::request's errors) is returned as its error, on its own: an answer
  // taken with it comes with the next call.
  Result<std::vector<Grant>> answers();
  // Samples granted to this worker that it will not start: the next question gives them back.
  void give_back(std::vector<TrajectoryId> ids);
  // Asks, asks again or does nothing, as above. Returns whether it sent a question.
  bool ask(WorkerState state);

  // A question is out (a worker that is idle with none out may pull the newest weights itself).
  bool asking() const { return asking_.has_value(); }
  // Questions sent.
  std::uint64_t questions() const { return questions_; }

 private:
  DispatchAsker(DispatchClient* client, DispatchAskerOptions options)
      : client_(client), opt_(std::move(options)) {}
  DispatchClient* client_;
  DispatchAskerOptions opt_;
  std::optional<PendingGrant> asking_, replaced_;
  bool asking_idle_ = false;          // the question out was asked idle (with idle_pull)
  std::uint32_t asked_slots_ = 0;     // and offered these slots
  std::vector<TrajectoryId> told_;    // the held list of the last question, sorted
  Duration asked_at_{0};              // when the last question went out (on opt_.clock)
  std::vector<TrajectoryId> returned_;
  Status failed_;                     // a question's error, kept for the next answers()
  std::uint64_t questions_ = 0;
};

}  // namespace laminar
