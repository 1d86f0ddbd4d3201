// prompt_dispatch.h: PromptServer and PromptClient, how prompts get from the actor to the rollout
// workers under the three schedules, so that every prompt's samples reach the trainer exactly once
// and a rollout worker that dies loses no prompt.
//
// The unit of work is a group: prompt `prompt_index` of the task's deterministic prompt stream,
// times group_size samples. Group g (counted from 0 in the order the server makes them) is prompt
// first_prompt + g; its sample s has trajectory id prompt_index * group_size + s and a sampling seed
// drawn from (seed, trajectory id), so a sample handed out again is the same sample, and two runs
// with the same options (sync and laminar on one seed, say) deal the same prompts and seeds. The
// worker's Trajectory carries that id, and prompt_index as its prompt_id and group_id.
//
// The PromptServer lives in the actor's process, on its Transport (which listens). Each rollout
// worker's PromptClient asks it for work: "worker w, weights v, k free slots, and these trajectory
// ids I decode now". The answer is a Grant: up to k samples (the oldest group first, whole groups
// preferred: a group is split only when the worker has room for none of it), or "pull version u or
// newer first", or "nothing now". What may be handed out is gated by windows the actor sets, which
// is where the schedules differ:
//   - open(vmin, vmax, n): n new groups, for workers whose weights are in [vmin, vmax];
//   - set_stream(...): groups made on demand for any worker whose weights are at least
//     newest - max_staleness (set_newest_version), while at most max_in_flight samples are handed
//     out or waiting; stop_stream() ends it.
//
//   sync:      publish v; set_newest_version(v); open(v, v, B); wait until the batch's groups are
//              done (wait_done(k * B) at step k); train; repeat.
//   one-step:  publish v0; open(v0, kAnyNewer, B). Then each step: wait until the batch's groups
//              are done; open(v, kAnyNewer, B) for the next batch, v the newest published; train
//              on the batch just done; publish v + 1. Generation runs one version ahead of
//              training; a sample reissued after the publish goes to the newer weights too (with
//              a version_max of v it would wait for a worker still on v, which may be none).
//   laminar:   set_newest_version(v0); set_stream({max_staleness, max_in_flight}); then train on
//              whatever the queue holds and set_newest_version(v) on every publish; stop_stream()
//              at the end.
//
// Completion. The actor calls completed(id) for each trajectory its TrajectoryQueue took; a group
// is done when all its samples are. A completed id is never handed out again, and completing it
// again is counted (stats().duplicates), not double-counted.
//
// Ownership and loss. Each request's held list says what the worker decodes now: an id on it is
// that worker's, wherever it was before (a migrated sequence is claimed by its new worker, and an
// id waiting to be handed out again is taken back). A sample a worker stops listing without its
// completion arriving (it is in flight to the queue, or migrating) is released; if nobody completes
// or claims it within one lease it goes back to be handed out again. A worker is lost when its
// connection closes or it has not asked for anything within a lease (on the server's clock,
// checked on every request and by the server's thread at each lease's end): what it held and
// nobody completed or claimed goes back to the front of the queue at once, same trajectory id and
// seed. Memory is bounded: max_workers workers, max_held ids per worker, and
// max_open_groups groups between the oldest group not done and the newest (open() and the stream
// make no group past it).
//
// Threads. Requests are answered on the transport's callback thread; connection closes are taken
// there too. The server's own thread wakes at lease ends to find silent workers and released
// samples (with a ManualClock: when the clock moves). on_available runs on any of these threads
// and on those calling the server's methods. Every method is thread-safe. A PromptClient has no
// thread: request() blocks its caller; request_async() returns at once.
//
//   // the actor:
//   auto server = async_grpo::PromptServer::create(transport, {.group_size = 8, .seed = 1}).value();
//   (void)server->open(v, v, 16);
//   // a rollout worker:
//   auto client = async_grpo::PromptClient::create(transport, {.worker = w, .server = addr}).value();
//   laminar::Result<async_grpo::Grant> g = client->request(v, free_slots, held_ids);
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
#include "prompt_dispatch_wire.h"

namespace async_grpo {

// open()'s version_max for "these weights or any newer".
inline constexpr laminar::Version kAnyNewer{std::numeric_limits<std::uint64_t>::max()};

struct PromptServerOptions {
  // Samples per group, G (positive).
  std::uint32_t group_size = 0;
  // Base of every sample's sampling seed.
  std::uint64_t seed = 0;
  // Prompt index of group 0.
  std::uint64_t first_prompt = 0;
  // A worker silent this long is lost; a released sample nobody claims this long is handed out
  // again (positive).
  laminar::Duration lease = std::chrono::seconds(10);
  // Workers known at once (positive): a request from one more is refused with kResourceExhausted.
  std::uint32_t max_workers = 64;
  // Ids one worker may hold: its held list plus its free slots (positive).
  std::uint32_t max_held = 1024;
  // Groups from the oldest not done to the newest (positive).
  std::uint64_t max_open_groups = 1 << 16;
  // Time of leases (null: Clock::steady()).
  std::shared_ptr<laminar::Clock> clock = nullptr;
  // Called with stats().available each time it changes (null: never), on the thread that changed
  // it and holding the server's lock, so the calls arrive in order: it must not call the server.
  std::function<void(std::uint64_t)> on_available = nullptr;
};

// The laminar schedule's window.
struct StreamWindow {
  // A worker's weights may lag the newest version by this many versions.
  std::uint64_t max_staleness = 1;
  // Samples handed out or waiting to be, not yet completed, at most (positive); the stream makes
  // a group only while one more group fits under it.
  std::uint64_t max_in_flight = 0;
};

struct PromptServerStats {
  std::uint64_t requests = 0;          // requests answered with a grant
  std::uint64_t refused = 0;           // requests answered with an error (malformed, invalid, full)
  std::uint64_t groups_made = 0;       // by open() and by the stream
  std::uint64_t groups_done = 0;       // every sample completed
  std::uint64_t handed_out = 0;        // samples in grants, reissued ones included
  std::uint64_t reissued = 0;          // samples put back to be handed out again
  std::uint64_t claimed = 0;           // held ids that moved to the worker listing them
  std::uint64_t completed = 0;         // completions counted once
  std::uint64_t duplicates = 0;        // completions of an id completed already
  std::uint64_t lost_workers = 0;      // by connection close or lease
  std::uint64_t workers = 0;           // known now
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

class PromptServer {
 public:
  // Installs the request handler for kPromptRequestMessage on `transport` (which the host makes
  // listen) and starts the lease thread. kInvalidArgument for a null transport, zero group_size,
  // max_workers, max_held or max_open_groups, a non-positive lease, or a first_prompt whose
  // trajectory ids would overflow; kAlreadyExists when another PromptServer serves on `transport`.
  static laminar::Result<std::unique_ptr<PromptServer>> create(std::shared_ptr<laminar::Transport> transport,
                                                               PromptServerOptions options);
  // Removes the handler (waiting for a request being answered) and stops the thread.
  ~PromptServer();
  PromptServer(const PromptServer&) = delete;
  PromptServer& operator=(const PromptServer&) = delete;

  // Makes `groups` new groups for workers whose weights are in [version_min, version_max]; returns
  // the first one's prompt index (the others follow it). kInvalidArgument for zero groups or
  // version_min > version_max; kResourceExhausted when they would pass max_open_groups.
  laminar::Result<std::uint64_t> open(laminar::Version version_min, laminar::Version version_max,
                                      std::uint64_t groups);
  // Starts (or changes) the stream. kInvalidArgument for zero max_in_flight or one below
  // group_size (no group would ever fit).
  laminar::Status set_stream(StreamWindow window);
  // The stream makes no more groups; those it made are still handed out and reissued.
  void stop_stream();
  // The newest published version, which the stream's staleness counts from. kInvalidArgument for
  // one older than the newest already set.
  laminar::Status set_newest_version(laminar::Version v);

  // The trajectory `id` reached the trainer's queue. kNotFound for an id of no group made yet, or
  // a sample index past group_size.
  laminar::Result<Completion> completed(laminar::TrajectoryId id);

  // Blocks until `groups` groups are done in all (stats().groups_done), on the server's clock.
  // kDeadlineExceeded after `timeout` (kForever: no deadline).
  laminar::Status wait_done(std::uint64_t groups, laminar::Duration timeout);

  PromptServerStats stats() const;
  // The first grant that could not be sent for a reason other than its worker being gone; OK
  // otherwise.
  laminar::Status background_error() const;

 private:
  struct Impl;
  explicit PromptServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct PromptClientOptions {
  // This worker (any id unique in the fleet).
  laminar::WorkerId worker{};
  // "host:port" of the actor's transport.
  std::string server{};
  // Connecting in all, retrying every retry_interval while the server is not there yet (positive).
  laminar::Duration connect_timeout = std::chrono::seconds(10);
  laminar::Duration retry_interval = std::chrono::milliseconds(100);
  // Default of a request's timeout (positive).
  laminar::Duration request_timeout = std::chrono::seconds(5);
};

// A request in flight (PromptClient::request_async).
class PendingGrant {
 public:
  // Whether get() would return at once.
  bool ready() const;
  // The grant or the request's error; once.
  laminar::Result<Grant> get();

 private:
  friend class PromptClient;
  PendingGrant(laminar::Status error) : error_(std::move(error)) {}  // NOLINT(google-explicit-constructor)
  PendingGrant(std::future<laminar::Result<laminar::Message>> reply, std::size_t max_samples, std::size_t max_drop)
      : reply_(std::move(reply)), max_samples_(max_samples), max_drop_(max_drop) {}
  std::future<laminar::Result<laminar::Message>> reply_;
  laminar::Status error_;
  std::size_t max_samples_ = 0;
  std::size_t max_drop_ = 0;
};

class PromptClient {
 public:
  // Connects to the server through `transport`, retrying until connect_timeout. kInvalidArgument
  // for a null transport or non-positive durations; the transport's last error otherwise.
  static laminar::Result<std::unique_ptr<PromptClient>> create(std::shared_ptr<laminar::Transport> transport,
                                                               PromptClientOptions options);
  PromptClient(const PromptClient&) = delete;
  PromptClient& operator=(const PromptClient&) = delete;
  ~PromptClient();

  // Asks for up to `free_slots` samples for weights `version`, telling the server which ids this
  // worker decodes now. Returns the server's grant or its error (kInvalidArgument: it refused the
  // request; kResourceExhausted: too many workers), the transport's (kDeadlineExceeded after
  // `timeout`, default request_timeout; kUnavailable: the server is gone), or kDataLoss for a
  // malformed grant. A request after a broken connection connects again first (one try).
  // Preconditions:
  //   `held` lists every sample granted to this worker that it has neither pushed to the queue nor
  //   migrated away (a migrated-in one included); a granted sample left off is released.
  //   The worker asks at least once per lease, with zero free slots while it has none, or it is
  //   counted lost.
  laminar::Result<Grant> request(laminar::Version version, std::uint32_t free_slots,
                                 std::span<const laminar::TrajectoryId> held,
                                 std::optional<laminar::Duration> timeout = std::nullopt);
  // The same without blocking, for a decode loop that keeps stepping meanwhile. One request at a
  // time per worker: a request sent before the previous grant arrived would leave that grant's
  // samples off its held list, releasing them.
  PendingGrant request_async(laminar::Version version, std::uint32_t free_slots,
                             std::span<const laminar::TrajectoryId> held,
                             std::optional<laminar::Duration> timeout = std::nullopt);

  // Closes the connection: the server counts this worker lost and hands its samples out again.
  void close();

 private:
  struct Impl;
  explicit PromptClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace async_grpo
