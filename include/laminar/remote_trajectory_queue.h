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
//   auto server = laminar::TrajectoryQueueServer::start(server_transport, *queue).value();
//   // in the rollout process:
//   auto ep = client_transport.connect(address).value();
//   auto producer = laminar::RemoteProducer::connect(ep).value();
//   laminar::Status st = producer->push(std::move(trajectory));   // the queue's answer
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "laminar/status.h"
#include "laminar/trajectory_queue.h"
#include "laminar/transport.h"

namespace laminar {

struct QueueServerOptions {
  // Push and push_many messages one producer may have in flight (granted in the handshake).
  std::uint32_t credits_per_producer = 16;
};

class TrajectoryQueueServer {
 public:
  struct Stats {
    std::uint64_t producers = 0;  // handshakes answered
    std::uint64_t received = 0;   // push and push_many messages
    std::uint64_t accepted = 0;   // trajectories pushed into the queue
    std::uint64_t refused = 0;    // trajectories answered with an error (invalid, duplicate, full, ...)
    std::uint64_t malformed = 0;  // undecodable messages (kDataLoss / kInvalidArgument)
    std::uint64_t held = 0;       // messages waiting for space right now
  };

  // Serves `queue` on `transport` (installs handlers for the three message types). kInvalidArgument
  // for zero credits. Both must outlive the server.
  static Result<std::unique_ptr<TrajectoryQueueServer>> start(Transport& transport, TrajectoryQueue& queue,
                                                              QueueServerOptions options = {});
  // Removes the handlers and answers every held push with kCancelled.
  ~TrajectoryQueueServer();
  TrajectoryQueueServer(const TrajectoryQueueServer&) = delete;
  TrajectoryQueueServer& operator=(const TrajectoryQueueServer&) = delete;

  Stats stats() const;

 private:
  struct Impl;
  explicit TrajectoryQueueServer(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;  // shared with the installed handlers while they run
};

class RemoteProducer {
 public:
  // Handshake over an authenticated endpoint: learns how many credits the server grants. Errors of
  // the transport as they come (kUnavailable, kDeadlineExceeded, ...); kDataLoss for a malformed
  // answer.
  static Result<std::unique_ptr<RemoteProducer>> connect(
      Endpoint endpoint, std::chrono::milliseconds timeout = std::chrono::seconds(10));
  RemoteProducer(const RemoteProducer&) = delete;
  RemoteProducer& operator=(const RemoteProducer&) = delete;
  ~RemoteProducer();

  // TrajectoryQueue::push across the wire; thread-safe (threads share the credits). Takes a credit
  // first (options.mode says what to do when none is free: wait, kUnavailable, or
  // kDeadlineExceeded after options.timeout), then returns the queue's answer, the same codes as
  // TrajectoryQueue::push, or the transport's error (the peer vanished: kUnavailable). `t` is moved
  // from only on OK. After a transport error the trajectory may or may not be in the queue; pushing
  // it again is safe: the queue refuses a duplicate id.
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
