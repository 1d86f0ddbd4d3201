#include "laminar/remote_trajectory_queue.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <optional>
#include <utility>

#include "clock_wait.h"
#include "clocked_thread.h"
#include "laminar/handler_gate.h"
#include "remote_trajectory_queue_wire.h"
#include "transport/protocol.h"
#include "transport_claim.h"
#include "stats_fields.h"

namespace laminar {
using internal::kQueueHelloMessage;
using internal::kQueuePingMessage;
using internal::kQueuePushManyMessage;
using internal::kQueuePushMessage;

namespace {

// A timed push's request may take this much longer than the push's own timeout: the server
// answers kDeadlineExceeded itself, and the slack covers the round trip.
constexpr Duration kRequestSlack = std::chrono::seconds(5);
// RemoteProducer::push_many splits a longer span, and a message past kPushManyBytes, over
// several messages (a trajectory larger than that goes alone).
constexpr std::size_t kPushManyBytes = std::size_t(4) << 20;
template <class T>
bool is_ready(const std::future<T>& f) {
  return f.wait_for(Duration::zero()) == std::future_status::ready;
}

std::span<const std::byte> as_bytes(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Server.

struct TrajectoryQueueServer::Impl {
  Impl(std::shared_ptr<Transport> t, std::shared_ptr<TrajectoryQueue> q, TrajectoryQueueServerOptions o)
      : transport(std::move(t)),
        queue(std::move(q)),
        opt(std::move(o)),
        clock(internal::clock_or_steady(opt.clock)) {}

  // A push or push_many message whose trajectories are not all answered yet.
  struct Held {
    Incoming in;
    bool many = false;  // a push_many message: answered with one Status per trajectory
    std::vector<Trajectory> ts;
    std::vector<TrajectoryId> ids;  // of ts, kept since ts are moved into the queue
    // The answers; kUnavailable for the ones still waiting for room.
    std::vector<Status> out;
    Duration deadline = kForever;  // on the server's clock

    bool waiting() const {
      return std::any_of(out.begin(), out.end(), [](const Status& s) { return s.code() == StatusCode::kUnavailable; });
    }
    // Every answer still waiting becomes `s`.
    void settle(const Status& s) {
      for (Status& o : out) {
        if (o.code() == StatusCode::kUnavailable) o = s;
      }
    }
  };

  const std::shared_ptr<Transport> transport;
  internal::TransportClaim claim;  // the one queue server on the transport, until shutdown
  const std::shared_ptr<TrajectoryQueue> queue;
  const TrajectoryQueueServerOptions opt;
  const std::shared_ptr<Clock> clock;

  mutable std::mutex mu;
  // Signalled on arrivals, on stopping, on every jump of a virtual clock and when the queue may
  // have room (room_watch).
  std::condition_variable cv;
  std::deque<Held> held;  // arrival order; only the worker takes from the front
  // Bumped by room_watch: whether room may have come free since the worker's last attempt.
  std::uint64_t room_changes = 0;
  RoomWatch room_watch;  // set before the worker starts, reset after it stops
  TrajectoryQueueServerStats st;
  internal::ClockedThread worker;
  HandlerGate gate;

  static void answer(const Incoming& in, const Status& s) {
    // The producer may be gone; then there is nobody to tell, and nothing else to do.
    Endpoint from = in.from;  // a handle; replying is not const
    if (s.ok()) {
      (void)from.reply(in, Message{kQueuePushMessage, {}});
    } else {
      (void)from.reply_error(in, s);
    }
  }

  // Answers a message once nothing in it waits for room, counting its trajectories.
  void answer(Held& h) {
    std::vector<TrajectoryId> accepted;
    for (std::size_t i = 0; i < h.out.size(); ++i)
      if (h.out[i].ok()) accepted.push_back(h.ids[i]);
    {
      std::lock_guard<std::mutex> l(mu);
      st.accepted += accepted.size();
      st.refused += h.out.size() - accepted.size();
    }
    if (opt.on_accepted && !accepted.empty()) opt.on_accepted(accepted);
    if (!h.many) {
      answer(h.in, h.out[0]);
      return;
    }
    const std::string body = internal::encode_queue_statuses(h.out);
    Endpoint from = h.in.from;
    (void)from.reply(h.in, Message::from_bytes(kQueuePushManyMessage, as_bytes(body)));
  }

  // Pushes what waits for room, without waiting; true once none is left waiting.
  bool attempt(Held& h) {
    std::vector<std::uint32_t> idx;
    for (std::uint32_t i = 0; i < h.out.size(); ++i) {
      if (h.out[i].code() == StatusCode::kUnavailable) idx.push_back(i);
    }
    std::vector<Trajectory> ts;
    ts.reserve(idx.size());
    for (std::uint32_t i : idx) ts.push_back(std::move(h.ts[i]));
    std::vector<Status> r = queue->push_many(ts, PushOptions::fail_fast());
    for (std::size_t k = 0; k < idx.size(); ++k) {
      if (!r[k].ok()) h.ts[idx[k]] = std::move(ts[k]);
      h.out[idx[k]] = std::move(r[k]);
    }
    return !h.waiting();
  }

  void on_hello(const Incoming& in) {
    {
      std::lock_guard<std::mutex> l(mu);
      ++st.producers;
    }
    Endpoint from = in.from;
    (void)from.reply(in, Message{kQueueHelloMessage, internal::encode_queue_hello(opt.credits_per_producer)});
  }

  // A producer waiting long for an answer asks whether the server is alive: answered at once,
  // since a full queue holds pushes, never pings.
  void on_ping(const Incoming& in) {
    Endpoint from = in.from;
    (void)from.reply(in, Message{kQueuePingMessage, {}});
  }

  // Answers a message that could not be read; nothing of it was pushed.
  void refuse_malformed(const Incoming& in, const Status& s) {
    {
      std::lock_guard<std::mutex> l(mu);
      ++st.received;
      ++st.malformed;
    }
    answer(in, s);
  }

  // A push message (`many` false) or a push_many message.
  void on_push(Incoming in, bool many) {
    Result<internal::QueuePush> p =
        many ? internal::decode_queue_push_many(in.message.body) : internal::decode_queue_push(in.message.body);
    if (!p.ok()) return refuse_malformed(in, p.status());
    take(Held{std::move(in), many, std::move(p->trajectories), {}, {}, kForever}, p->wait);
  }

  // A well-formed message: pushed at once when nothing waits ahead of it and there is room,
  // otherwise (for a blocking or timed push) held for the worker.
  void take(Held hd, internal::QueuePushWait wait) {
    hd.out.assign(hd.ts.size(), unavailable("waiting for room"));
    for (const Trajectory& t : hd.ts) hd.ids.push_back(t.id);
    std::unique_lock<std::mutex> l(mu);
    ++st.received;
    if (worker.stopping()) {
      l.unlock();
      hd.settle(cancelled("queue server is stopping"));
      return answer(hd);
    }
    if (held.empty()) {
      // Nobody is waiting ahead of it: try at once, without holding up the transport's thread.
      l.unlock();
      if (attempt(hd) || wait.mode == PushMode::kFailFast) return answer(hd);
      l.lock();
      if (worker.stopping()) {
        l.unlock();
        hd.settle(cancelled("queue server is stopping"));
        return answer(hd);
      }
    }
    if (wait.mode == PushMode::kTimeout) hd.deadline = deadline_after(*clock, Duration(wait.timeout_ns));
    held.push_back(std::move(hd));
    st.held = held.size();
    cv.notify_all();
  }

  void run() {
    std::unique_lock<std::mutex> l(mu);
    while (!worker.stopping()) {
      if (held.empty()) {
        cv.wait(l);
        continue;
      }
      const Duration now = clock->now();
      for (auto it = held.begin(); it != held.end();) {
        if (it->deadline <= now) {
          Held h = std::move(*it);
          it = held.erase(it);
          st.held = held.size();
          l.unlock();
          h.settle(deadline_exceeded("push: the queue stayed full past the producer's timeout"));
          answer(h);
          l.lock();
        } else {
          ++it;
        }
      }
      if (held.empty()) continue;
      // References to the front stay valid while the handler appends at the back.
      Held& front = held.front();
      const std::uint64_t seen = room_changes;
      l.unlock();
      const bool done = attempt(front);
      // A group timeout of the queue runs only inside a call: the next attempt makes that call.
      const Duration group_in = done ? kForever : queue->until_group_timeout();
      l.lock();
      if (!done) {
        // Room freed during the attempt was not seen by it: try again at once.
        if (room_changes != seen) continue;
        Duration wake = deadline_after(*clock, group_in);
        for (const Held& h : held) wake = std::min(wake, h.deadline);
        if (!worker.stopping()) clock->wait_until(cv, l, wake);
        continue;
      }
      Held h = std::move(held.front());
      held.pop_front();
      st.held = held.size();
      l.unlock();
      answer(h);
      l.lock();
    }
    std::deque<Held> left = std::move(held);
    held.clear();
    st.held = 0;
    l.unlock();
    for (Held& h : left) {
      h.settle(cancelled("queue server stopped"));
      answer(h);
    }
  }
};

Result<std::unique_ptr<TrajectoryQueueServer>> TrajectoryQueueServer::create(std::shared_ptr<Transport> transport,
                                                                             std::shared_ptr<TrajectoryQueue> queue,
                                                                             TrajectoryQueueServerOptions options) {
  if (!transport) return invalid_argument("queue server: the transport is null");
  if (!queue) return invalid_argument("queue server: the queue is null");
  if (options.credits_per_producer == 0) return invalid_argument("TrajectoryQueueServerOptions: credits_per_producer is 0");
  Result<internal::TransportClaim> claim = internal::TransportClaim::take(*transport, "queue server");
  if (!claim.ok()) return claim.status();
  auto impl = std::make_unique<Impl>(std::move(transport), std::move(queue), std::move(options));
  impl->claim = std::move(*claim);
  Impl* p = impl.get();
  p->room_watch = p->queue->watch_room([p] {
    std::lock_guard<std::mutex> l(p->mu);
    ++p->room_changes;
    p->cv.notify_all();
  });
  impl->worker.start(p->mu, p->cv, *p->clock, [p] { p->run(); });
  // The types are laminar's own, in the reserved range: registering them cannot fail.
  LAMINAR_CHECK(internal::on_protocol_message(*p->transport, kQueueHelloMessage,
                                              p->gate.wrap([p](Incoming in) { p->on_hello(in); }))
                    .ok());
  LAMINAR_CHECK(internal::on_protocol_message(*p->transport, kQueuePingMessage,
                                              p->gate.wrap([p](Incoming in) { p->on_ping(in); }))
                    .ok());
  LAMINAR_CHECK(internal::on_protocol_message(*p->transport, kQueuePushMessage,
                                              p->gate.wrap([p](Incoming in) { p->on_push(std::move(in), false); }))
                    .ok());
  LAMINAR_CHECK(internal::on_protocol_message(*p->transport, kQueuePushManyMessage,
                                              p->gate.wrap([p](Incoming in) { p->on_push(std::move(in), true); }))
                    .ok());
  return std::unique_ptr<TrajectoryQueueServer>(new TrajectoryQueueServer(std::move(impl)));
}

TrajectoryQueueServer::TrajectoryQueueServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TrajectoryQueueServer::~TrajectoryQueueServer() {
  (void)internal::on_protocol_message(*impl_->transport, kQueueHelloMessage, {});
  (void)internal::on_protocol_message(*impl_->transport, kQueuePingMessage, {});
  (void)internal::on_protocol_message(*impl_->transport, kQueuePushMessage, {});
  (void)internal::on_protocol_message(*impl_->transport, kQueuePushManyMessage, {});
  impl_->gate.close();
  impl_->worker.stop();
  impl_->room_watch.reset();
  impl_->claim.release();
}

TrajectoryQueueServerStats TrajectoryQueueServer::stats() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  return impl_->st;
}

std::string TrajectoryQueueServerStats::to_json() const { return internal::stats_json(*this); }

// ---------------------------------------------------------------------------------------------
// Producer.

struct RemoteProducer::Impl {
  std::shared_ptr<Transport> transport;  // kept alive for the endpoint
  Endpoint ep;
  std::shared_ptr<Clock> clock;
  Duration stall_timeout = kForever;
  std::uint32_t granted = 0;
  mutable std::mutex mu;
  // Signalled when a credit comes back and on every jump of a virtual clock (clock_wake).
  std::condition_variable cv;
  std::uint32_t free = 0;
  // kUnavailable once the server left a ping unanswered for stall_timeout; every later push ends
  // with it, as for a server that vanished.
  Status stalled;
  ClockSubscription clock_wake;

  ~Impl() { clock_wake.reset(); }

  Status stalled_status() const {
    std::lock_guard<std::mutex> l(mu);
    return stalled;
  }

  // Wakes a push waiting for its answer: the transport once its answer or its ping's is in, the
  // clock on every jump of virtual time. Shared with those callbacks, which may outlive the push.
  struct Waiter {
    std::mutex mu;
    std::condition_variable cv;
    void wake() {
      std::lock_guard<std::mutex> l(mu);
      cv.notify_all();
    }
  };

  // Sends a push or push_many request and waits for its answer. The server holds a push while the
  // queue is full, so silence alone says nothing; each stall_timeout / 2 of it (on the producer's
  // clock), a ping asks whether the server is alive, and one left unanswered for stall_timeout (on
  // the transport's clock) fails the push and the endpoint.
  Result<Message> exchange(const Message& m, std::optional<Duration> timeout) {
    LAMINAR_RETURN_IF_ERROR(stalled_status());
    if (stall_timeout == kForever) return internal::request_protocol_async(ep, m, timeout).get();
    auto waiter = std::make_shared<Waiter>();
    const auto wake = [waiter] { waiter->wake(); };
    const ClockSubscription jumps = clock->subscribe(wake);
    std::future<Result<Message>> answer = internal::request_protocol_async(ep, m, timeout, wake);
    std::future<Result<Message>> ping;
    Duration ping_at = deadline_after(*clock, stall_timeout / 2);
    bool unanswered = false;
    {
      std::unique_lock<std::mutex> l(waiter->mu);
      while (!is_ready(answer)) {
        if (ping.valid() && is_ready(ping)) {
          // Any other error broke the endpoint, which ends the push's own request too.
          if (ping.get().status().code() == StatusCode::kDeadlineExceeded) {
            unanswered = true;
            break;
          }
          ping_at = deadline_after(*clock, stall_timeout / 2);
        } else if (!ping.valid() && clock->now() >= ping_at) {
          // Unlocked: a request refused at once runs `wake` on this thread.
          l.unlock();
          ping = internal::request_protocol_async(ep, Message{kQueuePingMessage, {}}, stall_timeout, wake);
          l.lock();
        } else {
          clock->wait_until(waiter->cv, l, ping.valid() ? kForever : ping_at);
        }
      }
    }
    if (unanswered) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(stall_timeout).count();
      {
        std::lock_guard<std::mutex> l(mu);
        if (stalled.ok()) {
          stalled = unavailable(fmt::format("queue server {} answered nothing for {} ms", ep.peer_address(), ms));
        }
      }
      ep.close();
    }
    Result<Message> r = answer.get();
    // A push that the close above cut off reports the stall, not the close.
    if (!r.ok()) {
      if (Status st = stalled_status(); !st.ok()) return st;
    }
    return r;
  }

  // Takes a credit as `o`, begun at `start` (on the clock), says; OK when taken.
  Status acquire(const PushOptions& o, Duration start) {
    std::unique_lock<std::mutex> l(mu);
    if (free > 0) {
      --free;
      return ok_status();
    }
    if (o.mode == PushMode::kFailFast) {
      return unavailable(fmt::format("remote push: all {} credits in flight", granted));
    }
    const Duration deadline =
        o.mode == PushMode::kBlock || o.timeout >= kForever - start ? kForever : start + o.timeout;
    if (!internal::wait_until(*clock, cv, l, deadline, [&] { return free > 0; })) {
      return deadline_exceeded(fmt::format("remote push: no credit free within {} ns", o.timeout.count()));
    }
    --free;
    return ok_status();
  }
  void give_back() {
    {
      std::lock_guard<std::mutex> l(mu);
      ++free;
    }
    cv.notify_one();
  }
};

namespace {

Status check_options(const RemoteProducerOptions& o) {
  if (o.connect_timeout <= Duration::zero()) {
    return invalid_argument(fmt::format("RemoteProducer::create: connect_timeout is {} ns", o.connect_timeout.count()));
  }
  if (o.stall_timeout <= Duration::zero()) {
    return invalid_argument(fmt::format("RemoteProducer::create: stall_timeout is {} ns", o.stall_timeout.count()));
  }
  return ok_status();
}

}  // namespace

Result<std::unique_ptr<RemoteProducer>> RemoteProducer::create(std::shared_ptr<Transport> transport,
                                                               std::string_view address,
                                                               RemoteProducerOptions options) {
  if (!transport) return invalid_argument("RemoteProducer::create: the transport is null");
  LAMINAR_RETURN_IF_ERROR(check_options(options));
  auto ep = transport->connect(address, options.connect_timeout);
  if (!ep.ok()) return ep.status().with_context(fmt::format("queue server at {}", address));
  return create(std::move(transport), std::move(*ep), std::move(options));
}

Result<std::unique_ptr<RemoteProducer>> RemoteProducer::create(std::shared_ptr<Transport> transport,
                                                               Endpoint endpoint, RemoteProducerOptions options) {
  if (!transport) return invalid_argument("RemoteProducer::create: the transport is null");
  if (!endpoint.valid()) return invalid_argument("RemoteProducer::create: endpoint is not connected");
  LAMINAR_RETURN_IF_ERROR(check_options(options));
  Result<Message> r = internal::request_protocol(endpoint, Message{kQueueHelloMessage, {}}, options.connect_timeout);
  if (!r.ok()) return r.status().with_context("queue handshake");
  if (r->type != kQueueHelloMessage) {
    return data_loss(fmt::format("queue handshake: answer of type {:#x}", r->type));
  }
  Result<std::uint32_t> credits = internal::decode_queue_hello(r->body);
  if (!credits.ok()) return credits.status().with_context("queue handshake");
  auto impl = std::make_unique<Impl>();
  impl->transport = std::move(transport);
  impl->ep = std::move(endpoint);
  impl->clock = internal::clock_or_steady(std::move(options.clock));
  impl->stall_timeout = options.stall_timeout;
  impl->granted = *credits;
  impl->free = *credits;
  impl->clock_wake = impl->clock->subscribe([raw = impl.get()] {
    std::lock_guard<std::mutex> l(raw->mu);
    raw->cv.notify_all();
  });
  return std::unique_ptr<RemoteProducer>(new RemoteProducer(std::move(impl)));
}

RemoteProducer::RemoteProducer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RemoteProducer::~RemoteProducer() = default;

std::uint32_t RemoteProducer::credits_granted() const noexcept { return impl_->granted; }
std::uint32_t RemoteProducer::credits_free() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  return impl_->free;
}

namespace {

// What is left of a push's timeout `o` begun at `start`, and how long its request may take (a
// blocking push waits as long as the server holds it; a broken link still ends it).
std::pair<std::int64_t, std::optional<Duration>> request_limits(const PushOptions& o, const Clock& clock,
                                                                Duration start) {
  if (o.mode == PushMode::kFailFast) return {0, std::nullopt};
  if (o.mode == PushMode::kBlock) return {0, kForever};
  const Duration left = std::max(o.timeout - (clock.now() - start), Duration::zero());
  return {left.count(), left >= kForever - kRequestSlack ? kForever : left + kRequestSlack};
}

// The server's answer to a push_many message of `want` trajectories.
Result<std::vector<Status>> decode_answers(std::span<const std::byte> body, std::size_t want) {
  Result<std::vector<Status>> out = internal::decode_queue_statuses(body);
  if (out.ok() && out->size() != want) {
    return data_loss(fmt::format("queue push_many answer: {} statuses for {} trajectories", out->size(), want));
  }
  return out;
}

}  // namespace

std::vector<Status> RemoteProducer::push_many(std::span<Trajectory> ts, PushOptions options) {
  std::vector<Status> out(ts.size());
  if (options.mode == PushMode::kTimeout && options.timeout < Duration::zero()) {
    std::fill(out.begin(), out.end(),
              invalid_argument(fmt::format("remote push_many: negative timeout {} ns", options.timeout.count())));
    return out;
  }
  const Duration start = impl_->clock->now();
  // Checked here too, so a bad trajectory costs no bytes on the wire.
  std::vector<std::uint32_t> send;
  for (std::uint32_t i = 0; i < ts.size(); ++i) {
    out[i] = validate_trajectory(ts[i], /*contents=*/false);
    if (out[i].ok()) send.push_back(i);
  }
  std::string bytes;
  std::vector<std::uint32_t> chunk;
  for (std::size_t next = 0; next < send.size();) {
    bytes.assign(internal::kQueuePushManyHeaderBytes, '\0');
    chunk.clear();
    while (next < send.size() && chunk.size() < internal::kMaxPushManyCount &&
           (chunk.empty() || bytes.size() < kPushManyBytes)) {
      internal::append_queue_push_many_item(ts[send[next]], bytes);
      chunk.push_back(send[next++]);
    }
    Status credit = impl_->acquire(options, start);
    if (!credit.ok()) {
      for (std::uint32_t i : chunk) out[i] = credit;
      continue;
    }
    const auto [timeout_ns, request_timeout] = request_limits(options, *impl_->clock, start);
    internal::write_queue_push_many_header({options.mode, timeout_ns}, std::uint32_t(chunk.size()), bytes);
    Result<Message> r = impl_->exchange(Message::from_bytes(kQueuePushManyMessage, as_bytes(bytes)), request_timeout);
    impl_->give_back();
    Result<std::vector<Status>> answers =
        !r.ok() ? Result<std::vector<Status>>(r.status())
        : r->type != kQueuePushManyMessage
            ? Result<std::vector<Status>>(data_loss(fmt::format("push_many answer of type {:#x}", r->type)))
            : decode_answers(r->body, chunk.size());
    for (std::size_t k = 0; k < chunk.size(); ++k) {
      out[chunk[k]] = answers.ok() ? std::move((*answers)[k]) : answers.status();
      if (out[chunk[k]].ok()) ts[chunk[k]] = Trajectory{};
    }
  }
  return out;
}

Status RemoteProducer::push(Trajectory&& t, PushOptions options) {
  if (options.mode == PushMode::kTimeout && options.timeout < Duration::zero()) {
    return invalid_argument(fmt::format("remote push: negative timeout {} ns", options.timeout.count()));
  }
  // Checked here too, so a bad trajectory costs no credit and no round trip.
  LAMINAR_RETURN_IF_ERROR(validate_trajectory(t, /*contents=*/false));
  const Duration start = impl_->clock->now();
  LAMINAR_RETURN_IF_ERROR(impl_->acquire(options, start));
  const auto [timeout_ns, request_timeout] = request_limits(options, *impl_->clock, start);
  std::string bytes;
  internal::encode_queue_push(t, {options.mode, timeout_ns}, bytes);
  Result<Message> r = impl_->exchange(Message::from_bytes(kQueuePushMessage, as_bytes(bytes)), request_timeout);
  impl_->give_back();
  if (!r.ok()) return r.status();
  t = Trajectory{};
  return ok_status();
}

}  // namespace laminar
