// remote_trajectory_queue.h: TrajectoryQueueServer and RemoteProducer, so rollout workers in other
// processes (or on other hosts) push into a TrajectoryQueue over the Transport.
//
// Each push is one request message carrying one whole encoded trajectory (encode_trajectory), and
// each push_many one message carrying several, so a producer that dies mid-send leaves nothing
// behind: the server only ever decodes, validates and pushes complete messages (a push_many
// message with one bad trajectory is refused whole), and answers with the queue's own Status for
// each trajectory. A push_many message goes into the queue with TrajectoryQueue::push_many: under
// wal_fsync, one fdatasync for all of its trajectories. Backpressure is credit
// based: in the handshake the server grants each producer a number of credits, the pushes it may
// have in flight; a credit comes back with each answer. While the queue is full the server holds
// the pushes it got (at most the credits it granted) and answers them as space frees, so a full
// queue stops producers at the source instead of piling up messages in the server.
//
// Threads: the server's handlers run on its transport's callback thread and push at once when
// there is room; one worker thread of the server retries held pushes, each time the queue reports
// that room may have freed (TrajectoryQueue::watch_room) or a group timeout of the queue falls
// due, and answers them, or answers kDeadlineExceeded when their timeout passes on the server's
// clock. Between those events it sleeps. Every failure of that work is the answer to the push it
// belongs to, so the server has no background_error(). A producer has no thread: push and
// push_many block the calling thread, waiting for a credit on the producer's clock.
//
//   // the actor's process, on the one Transport it made (listening):
//   auto server = laminar::TrajectoryQueueServer::create(transport, queue).value();
//   // a rollout process, on its own Transport:
//   auto producer = laminar::RemoteProducer::create(transport, "10.0.0.1:4000").value();
//   laminar::Status st = producer->push(std::move(trajectory));   // the queue's answer
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "laminar/clock.h"
#include "laminar/status.h"
#include "laminar/trajectory_queue.h"
#include "laminar/transport.h"

namespace laminar {

struct TrajectoryQueueServerOptions {
  // Push and push_many messages one producer may have in flight (granted in the handshake).
  std::uint32_t credits_per_producer = 16;
  // Time of the producers' push timeouts and of the retries while the queue is full (null:
  // Clock::steady()).
  std::shared_ptr<Clock> clock;
  // Called with the ids of a message's trajectories that went into the queue (none: not called),
  // once all of the message is settled and before its producer hears the answer, on the thread
  // that pushed them (the transport's, or the server's own for held pushes). So a host that marks
  // work done here (RolloutDispatcher::completed) has done so before the producer learns of it.
  // It must not wait on the queue's producers; it may run until the server's destructor returns.
  std::function<void(std::span<const TrajectoryId>)> on_accepted;
};

struct TrajectoryQueueServerStats {
  std::uint64_t producers = 0;  // handshakes answered
  std::uint64_t received = 0;   // push and push_many messages
  std::uint64_t accepted = 0;   // trajectories pushed into the queue
  std::uint64_t refused = 0;    // trajectories answered with an error (invalid, duplicate, full, ...)
  std::uint64_t malformed = 0;  // undecodable messages (kDataLoss / kInvalidArgument)
  std::uint64_t held = 0;       // messages waiting for space right now

  std::string to_json() const;
};

class TrajectoryQueueServer {
 public:
  // Serves `queue` on `transport` (installs handlers for the queue's message types; the host makes
  // the transport listen). kInvalidArgument for a null transport or queue, or zero credits;
  // kAlreadyExists when another TrajectoryQueueServer serves on `transport`.
  static Result<std::unique_ptr<TrajectoryQueueServer>> create(std::shared_ptr<Transport> transport,
                                                               std::shared_ptr<TrajectoryQueue> queue,
                                                               TrajectoryQueueServerOptions options = {});
  // Removes the handlers (waiting for a call in progress) and answers every held push with
  // kCancelled.
  ~TrajectoryQueueServer();
  TrajectoryQueueServer(const TrajectoryQueueServer&) = delete;
  TrajectoryQueueServer& operator=(const TrajectoryQueueServer&) = delete;

  TrajectoryQueueServerStats stats() const;

 private:
  struct Impl;
  explicit TrajectoryQueueServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct RemoteProducerOptions {
  // Connecting (when given an address) plus the handshake.
  Duration connect_timeout = std::chrono::seconds(10);
  // Time of push timeouts and of the pings' pace (null: Clock::steady()).
  std::shared_ptr<Clock> clock;
  // A server that leaves a ping unanswered this long counts as hung (positive, or kForever: never
  // ping). A push waiting for its answer pings each stall_timeout / 2 on `clock`; the ping's
  // deadline runs on the transport's clock.
  Duration stall_timeout = std::chrono::seconds(10);
};

class RemoteProducer {
 public:
  // Connects to the queue server at "host:port" through `transport`, then handshakes: learns how
  // many credits the server grants. kInvalidArgument for a null transport or a non-positive
  // connect_timeout or stall_timeout; errors of the transport as they come (kUnavailable,
  // kDeadlineExceeded, ...); kDataLoss for a malformed answer.
  static Result<std::unique_ptr<RemoteProducer>> create(std::shared_ptr<Transport> transport,
                                                        std::string_view address,
                                                        RemoteProducerOptions options = {});
  // The same over an endpoint `transport` connected already (kInvalidArgument when it is not valid).
  static Result<std::unique_ptr<RemoteProducer>> create(std::shared_ptr<Transport> transport, Endpoint endpoint,
                                                        RemoteProducerOptions options = {});
  RemoteProducer(const RemoteProducer&) = delete;
  RemoteProducer& operator=(const RemoteProducer&) = delete;
  ~RemoteProducer();

  // TrajectoryQueue::push across the wire; thread-safe (threads share the credits). Takes a credit
  // first (options.mode says what to do when none is free: wait, kUnavailable, or
  // kDeadlineExceeded after options.timeout on the producer's clock), then returns the queue's answer, the same codes as
  // TrajectoryQueue::push, or the transport's error (the peer vanished: kUnavailable). `t` is moved
  // from only on OK. After a transport error the trajectory may or may not be in the queue; pushing
  // it again is safe: the queue refuses a duplicate id (kAlreadyExists). A server that hangs (stopped, wedged) keeps
  // its connection and answers nothing: a timed push then ends kDeadlineExceeded once its timeout
  // plus 5 s for the round trip has passed, a fail-fast one after the transport's
  // operation_timeout, unless a ping ends it sooner. A push still waiting after stall_timeout / 2
  // pings the server: a blocking push waits as long as a live server holds it for room, however
  // long the queue stays full, and any push whose ping goes unanswered for stall_timeout ends
  // kUnavailable, as does every later push of this producer (the endpoint is closed, as for a
  // vanished server).
  Status push(Trajectory&& t, PushOptions options = {});

  // TrajectoryQueue::push_many across the wire: one Status per trajectory, in order, and a
  // trajectory is moved from only when its Status is OK. The trajectories travel in one message
  // (several for more than 1024 or past 4 MB, each taking a credit), which the server pushes with
  // push_many. Where the queue has room for only some, those go in and the rest wait in the
  // server or fail as `options` says. Each message's trajectories share its transport error.
  std::vector<Status> push_many(std::span<Trajectory> ts, PushOptions options = {});

  std::uint32_t credits_granted() const noexcept;
  std::uint32_t credits_free() const;

 private:
  struct Impl;
  explicit RemoteProducer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace laminar
