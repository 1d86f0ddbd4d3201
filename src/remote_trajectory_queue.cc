#include "laminar/remote_trajectory_queue.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#include "clock_wait.h"
#include "handler_gate.h"
#include "transport/protocol.h"

namespace laminar {
using internal::kQueueHelloMessage;
using internal::kQueuePushManyMessage;
using internal::kQueuePushMessage;

namespace {

constexpr std::uint32_t kProtocol = 1;
constexpr std::uint32_t kPushMagic = 0x31505154u;  // "TQP1"
constexpr std::size_t kPushHeaderBytes = 16;
// While the queue is full, held pushes are retried this often (on the server's clock). The queue
// tells nobody when room frees, and blocking in it would leave the server unstoppable.
constexpr Duration kRetryEvery = std::chrono::milliseconds(1);
// A timed push's request may take this much longer than the push's own timeout: the server
// answers kDeadlineExceeded itself, and the slack covers the round trip.
constexpr Duration kRequestSlack = std::chrono::seconds(5);

struct PushHeader {
  std::uint32_t magic;
  std::uint8_t mode;
  std::uint8_t pad[3];
  std::int64_t timeout_ns;
};
static_assert(sizeof(PushHeader) == kPushHeaderBytes);

// A push_many message: this header, then `count` times a u64 length and that many bytes of one
// encoded trajectory. Its answer: a u32 count, then per trajectory a u8 StatusCode, 3 bytes of
// padding, a u32 length and the Status's message.
constexpr std::uint32_t kPushManyMagic = 0x314d5154u;  // "TQM1"
constexpr std::size_t kPushManyHeaderBytes = 24;
struct PushManyHeader {
  std::uint32_t magic;
  std::uint8_t mode;
  std::uint8_t pad[3];
  std::int64_t timeout_ns;
  std::uint32_t count;
  std::uint32_t pad2;
};
static_assert(sizeof(PushManyHeader) == kPushManyHeaderBytes);
// RemoteProducer::push_many splits a longer span, and a message past kPushManyBytes, over
// several messages (a trajectory larger than that goes alone).
constexpr std::uint32_t kMaxPushManyCount = 1024;
constexpr std::size_t kPushManyBytes = std::size_t(4) << 20;

Status check_mode(std::string_view what, std::uint8_t mode, std::int64_t timeout_ns) {
  if (mode > std::uint8_t(PushMode::kTimeout) || timeout_ns < 0) {
    return invalid_argument(fmt::format("{}: push mode {} with timeout {} ns", what, int(mode), timeout_ns));
  }
  return ok_status();
}

template <class T>
void append_pod(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

// The trajectories of a push_many message, whole or not at all.
Result<std::vector<Trajectory>> decode_many(std::string_view bytes, std::uint32_t count) {
  std::vector<Trajectory> ts;
  ts.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i) {
    std::uint64_t len = 0;
    if (bytes.size() < sizeof(len)) {
      return data_loss(fmt::format("queue push_many message: ends before trajectory {} of {}", i, count));
    }
    std::memcpy(&len, bytes.data(), sizeof(len));
    bytes.remove_prefix(sizeof(len));
    if (len > bytes.size()) {
      return data_loss(fmt::format("queue push_many message: trajectory {} of {} claims {} bytes, {} are left", i,
                                   count, len, bytes.size()));
    }
    Result<Trajectory> t = decode_trajectory(bytes.substr(0, len));
    if (!t.ok()) return t.status().with_context(fmt::format("queue push_many message: trajectory {} of {}", i, count));
    ts.push_back(std::move(t).value());
    bytes.remove_prefix(len);
  }
  if (!bytes.empty()) {
    return data_loss(fmt::format("queue push_many message: {} bytes after its {} trajectories", bytes.size(), count));
  }
  return ts;
}

std::string encode_statuses(const std::vector<Status>& out) {
  std::string b;
  append_pod(b, std::uint32_t(out.size()));
  for (const Status& s : out) {
    const std::uint8_t code[4] = {std::uint8_t(s.code()), 0, 0, 0};
    b.append(reinterpret_cast<const char*>(code), 4);
    append_pod(b, std::uint32_t(s.message().size()));
    b.append(s.message());
  }
  return b;
}

Result<std::vector<Status>> decode_statuses(std::span<const std::byte> body, std::size_t want) {
  std::string_view b(reinterpret_cast<const char*>(body.data()), body.size());
  std::uint32_t n = 0;
  if (b.size() < 4 || (std::memcpy(&n, b.data(), 4), n != want)) {
    return data_loss(fmt::format("push_many answer of {} bytes: not {} statuses", b.size(), want));
  }
  b.remove_prefix(4);
  std::vector<Status> out;
  out.reserve(n);
  for (std::uint32_t i = 0; i < n; ++i) {
    std::uint32_t len = 0;
    if (b.size() < 8 || (std::memcpy(&len, b.data() + 4, 4), len > b.size() - 8) ||
        std::uint8_t(b[0]) > std::uint8_t(StatusCode::kInternal)) {
      return data_loss(fmt::format("push_many answer: status {} of {} is malformed", i, n));
    }
    const auto code = StatusCode(std::uint8_t(b[0]));
    out.push_back(code == StatusCode::kOk ? ok_status() : Status(code, std::string(b.substr(8, len))));
    b.remove_prefix(8 + len);
  }
  if (!b.empty()) return data_loss(fmt::format("push_many answer: {} bytes after its statuses", b.size()));
  return out;
}

std::vector<std::byte> u32_pair(std::uint32_t a, std::uint32_t b) {
  std::vector<std::byte> out(8);
  std::memcpy(out.data(), &a, 4);
  std::memcpy(out.data() + 4, &b, 4);
  return out;
}

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
  const std::shared_ptr<TrajectoryQueue> queue;
  const TrajectoryQueueServerOptions opt;
  const std::shared_ptr<Clock> clock;

  mutable std::mutex mu;
  // Signalled on arrivals, on stopping and on every jump of a virtual clock (clock_wake).
  std::condition_variable cv;
  std::deque<Held> held;  // arrival order; only the worker takes from the front
  bool stopping = false;
  TrajectoryQueueServerStats st;
  std::thread worker;
  ClockSubscription clock_wake;
  internal::HandlerGate gate;

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
    {
      std::lock_guard<std::mutex> l(mu);
      for (const Status& s : h.out) ++(s.ok() ? st.accepted : st.refused);
    }
    if (!h.many) {
      answer(h.in, h.out[0]);
      return;
    }
    const std::string body = encode_statuses(h.out);
    Endpoint from = h.in.from;
    (void)from.reply(h.in, Message::from_bytes(kQueuePushManyMessage,
                                               std::as_bytes(std::span<const char>(body.data(), body.size()))));
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
    (void)from.reply(in, Message{kQueueHelloMessage, u32_pair(kProtocol, opt.credits_per_producer)});
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

  void on_push(Incoming in) {
    const auto& body = in.message.body;
    if (body.size() < kPushHeaderBytes) {
      return refuse_malformed(in, data_loss(fmt::format("queue push message of {} bytes, shorter than its {}-byte header",
                                                        body.size(), kPushHeaderBytes)));
    }
    PushHeader h{};
    std::memcpy(&h, body.data(), sizeof(h));
    if (h.magic != kPushMagic) {
      return refuse_malformed(in, data_loss(fmt::format("queue push message: bad magic {:#010x}", h.magic)));
    }
    if (Status bad = check_mode("queue push message", h.mode, h.timeout_ns); !bad.ok()) return refuse_malformed(in, bad);
    Result<Trajectory> t = decode_trajectory(std::string_view(reinterpret_cast<const char*>(body.data()) + kPushHeaderBytes,
                                                              body.size() - kPushHeaderBytes));
    if (!t.ok()) return refuse_malformed(in, t.status());
    Held hd{std::move(in), false, {}, {}, kForever};
    hd.ts.push_back(std::move(t).value());
    take(std::move(hd), PushMode(h.mode), h.timeout_ns);
  }

  void on_push_many(Incoming in) {
    const auto& body = in.message.body;
    if (body.size() < kPushManyHeaderBytes) {
      return refuse_malformed(in, data_loss(fmt::format("queue push_many message of {} bytes, shorter than its "
                                                        "{}-byte header", body.size(), kPushManyHeaderBytes)));
    }
    PushManyHeader h{};
    std::memcpy(&h, body.data(), sizeof(h));
    if (h.magic != kPushManyMagic) {
      return refuse_malformed(in, data_loss(fmt::format("queue push_many message: bad magic {:#010x}", h.magic)));
    }
    if (Status bad = check_mode("queue push_many message", h.mode, h.timeout_ns); !bad.ok()) {
      return refuse_malformed(in, bad);
    }
    if (h.count == 0 || h.count > kMaxPushManyCount) {
      return refuse_malformed(in, invalid_argument(fmt::format("queue push_many message: {} trajectories, not in [1, {}]",
                                                               h.count, kMaxPushManyCount)));
    }
    Result<std::vector<Trajectory>> ts = decode_many(
        std::string_view(reinterpret_cast<const char*>(body.data()) + kPushManyHeaderBytes,
                         body.size() - kPushManyHeaderBytes),
        h.count);
    if (!ts.ok()) return refuse_malformed(in, ts.status());
    take(Held{std::move(in), true, std::move(ts).value(), {}, kForever}, PushMode(h.mode), h.timeout_ns);
  }

  // A well-formed message: pushed at once when nothing waits ahead of it and there is room,
  // otherwise (for a blocking or timed push) held for the worker.
  void take(Held hd, PushMode mode, std::int64_t timeout_ns) {
    hd.out.assign(hd.ts.size(), unavailable("waiting for room"));
    std::unique_lock<std::mutex> l(mu);
    ++st.received;
    if (stopping) {
      l.unlock();
      hd.settle(cancelled("queue server is stopping"));
      return answer(hd);
    }
    if (held.empty()) {
      // Nobody is waiting ahead of it: try at once, without holding up the transport's thread.
      l.unlock();
      if (attempt(hd) || mode == PushMode::kFailFast) return answer(hd);
      l.lock();
      if (stopping) {
        l.unlock();
        hd.settle(cancelled("queue server is stopping"));
        return answer(hd);
      }
    }
    if (mode == PushMode::kTimeout) hd.deadline = internal::deadline_after(*clock, Duration(timeout_ns));
    held.push_back(std::move(hd));
    st.held = held.size();
    cv.notify_all();
  }

  void run() {
    std::unique_lock<std::mutex> l(mu);
    while (!stopping) {
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
      l.unlock();
      const bool done = attempt(front);
      l.lock();
      if (!done) {
        Duration wake = internal::deadline_after(*clock, kRetryEvery);
        for (const Held& h : held) wake = std::min(wake, h.deadline);
        if (!stopping) clock->wait_until(cv, l, wake);
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
  auto impl = std::make_unique<Impl>(std::move(transport), std::move(queue), std::move(options));
  impl->clock_wake = impl->clock->subscribe([raw = impl.get()] {
    std::lock_guard<std::mutex> l(raw->mu);
    raw->cv.notify_all();
  });
  impl->worker = std::thread([raw = impl.get()] { raw->run(); });
  // The types are laminar's own, in the reserved range: registering them cannot fail.
  Impl* p = impl.get();
  LAMINAR_CHECK(internal::on_protocol_message(*p->transport, kQueueHelloMessage,
                                              p->gate.wrap([p](Incoming in) { p->on_hello(in); }))
                    .ok());
  LAMINAR_CHECK(internal::on_protocol_message(*p->transport, kQueuePushMessage,
                                              p->gate.wrap([p](Incoming in) { p->on_push(std::move(in)); }))
                    .ok());
  LAMINAR_CHECK(internal::on_protocol_message(*p->transport, kQueuePushManyMessage,
                                              p->gate.wrap([p](Incoming in) { p->on_push_many(std::move(in)); }))
                    .ok());
  return std::unique_ptr<TrajectoryQueueServer>(new TrajectoryQueueServer(std::move(impl)));
}

TrajectoryQueueServer::TrajectoryQueueServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TrajectoryQueueServer::~TrajectoryQueueServer() {
  (void)internal::on_protocol_message(*impl_->transport, kQueueHelloMessage, {});
  (void)internal::on_protocol_message(*impl_->transport, kQueuePushMessage, {});
  (void)internal::on_protocol_message(*impl_->transport, kQueuePushManyMessage, {});
  impl_->gate.close();
  {
    std::lock_guard<std::mutex> l(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  impl_->worker.join();
  impl_->clock_wake.reset();
}

TrajectoryQueueServerStats TrajectoryQueueServer::stats() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  return impl_->st;
}

std::string TrajectoryQueueServerStats::to_json() const {
  return fmt::format(R"({{"producers":{},"received":{},"accepted":{},"refused":{},"malformed":{},"held":{}}})",
                     producers, received, accepted, refused, malformed, held);
}

// ---------------------------------------------------------------------------------------------
// Producer.

struct RemoteProducer::Impl {
  std::shared_ptr<Transport> transport;  // kept alive for the endpoint
  Endpoint ep;
  std::shared_ptr<Clock> clock;
  std::uint32_t granted = 0;
  mutable std::mutex mu;
  // Signalled when a credit comes back and on every jump of a virtual clock (clock_wake).
  std::condition_variable cv;
  std::uint32_t free = 0;
  ClockSubscription clock_wake;

  ~Impl() { clock_wake.reset(); }

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

Result<std::unique_ptr<RemoteProducer>> RemoteProducer::create(std::shared_ptr<Transport> transport,
                                                               std::string_view address,
                                                               RemoteProducerOptions options) {
  if (!transport) return invalid_argument("RemoteProducer::create: the transport is null");
  if (options.connect_timeout <= Duration::zero()) {
    return invalid_argument(fmt::format("RemoteProducer::create: connect_timeout is {} ns",
                                        options.connect_timeout.count()));
  }
  auto ep = transport->connect(address, options.connect_timeout);
  if (!ep.ok()) return ep.status().with_context(fmt::format("queue server at {}", address));
  return create(std::move(transport), std::move(*ep), std::move(options));
}

Result<std::unique_ptr<RemoteProducer>> RemoteProducer::create(std::shared_ptr<Transport> transport,
                                                               Endpoint endpoint, RemoteProducerOptions options) {
  if (!transport) return invalid_argument("RemoteProducer::create: the transport is null");
  if (!endpoint.valid()) return invalid_argument("RemoteProducer::create: endpoint is not connected");
  if (options.connect_timeout <= Duration::zero()) {
    return invalid_argument(fmt::format("RemoteProducer::create: connect_timeout is {} ns",
                                        options.connect_timeout.count()));
  }
  Result<Message> r = internal::request_protocol(endpoint, Message{kQueueHelloMessage, {}}, options.connect_timeout);
  if (!r.ok()) return r.status().with_context("queue handshake");
  if (r->type != kQueueHelloMessage || r->body.size() != 8) {
    return data_loss(fmt::format("queue handshake: answer of type {:#x} with {} bytes", r->type, r->body.size()));
  }
  std::uint32_t protocol = 0, credits = 0;
  std::memcpy(&protocol, r->body.data(), 4);
  std::memcpy(&credits, r->body.data() + 4, 4);
  if (protocol != kProtocol || credits == 0) {
    return data_loss(fmt::format("queue handshake: protocol {} (expected {}) granting {} credits", protocol,
                                 kProtocol, credits));
  }
  auto impl = std::make_unique<Impl>();
  impl->transport = std::move(transport);
  impl->ep = std::move(endpoint);
  impl->clock = internal::clock_or_steady(std::move(options.clock));
  impl->granted = credits;
  impl->free = credits;
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

}  // namespace

std::vector<Status> RemoteProducer::push_many(std::span<Trajectory> ts, PushOptions options) {
  std::vector<Status> out(ts.size());
  if (options.mode == PushMode::kTimeout && options.timeout < Clock::Duration::zero()) {
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
    bytes.assign(kPushManyHeaderBytes, '\0');
    chunk.clear();
    while (next < send.size() && chunk.size() < kMaxPushManyCount &&
           (chunk.empty() || bytes.size() < kPushManyBytes)) {
      const std::size_t at = bytes.size();
      append_pod(bytes, std::uint64_t(0));
      encode_trajectory(ts[send[next]], bytes);
      const std::uint64_t len = bytes.size() - at - 8;
      std::memcpy(bytes.data() + at, &len, 8);
      chunk.push_back(send[next++]);
    }
    Status credit = impl_->acquire(options, start);
    if (!credit.ok()) {
      for (std::uint32_t i : chunk) out[i] = credit;
      continue;
    }
    const auto [timeout_ns, request_timeout] = request_limits(options, *impl_->clock, start);
    const PushManyHeader h{kPushManyMagic, std::uint8_t(options.mode), {0, 0, 0}, timeout_ns,
                           std::uint32_t(chunk.size()), 0};
    std::memcpy(bytes.data(), &h, sizeof(h));
    Result<Message> r = internal::request_protocol(
        impl_->ep,
        Message::from_bytes(kQueuePushManyMessage, std::as_bytes(std::span<const char>(bytes.data(), bytes.size()))),
        request_timeout);
    impl_->give_back();
    Result<std::vector<Status>> answers =
        !r.ok() ? Result<std::vector<Status>>(r.status())
        : r->type != kQueuePushManyMessage
            ? Result<std::vector<Status>>(data_loss(fmt::format("push_many answer of type {:#x}", r->type)))
            : decode_statuses(r->body, chunk.size());
    for (std::size_t k = 0; k < chunk.size(); ++k) {
      out[chunk[k]] = answers.ok() ? std::move((*answers)[k]) : answers.status();
      if (out[chunk[k]].ok()) ts[chunk[k]] = Trajectory{};
    }
  }
  return out;
}

Status RemoteProducer::push(Trajectory&& t, PushOptions options) {
  if (options.mode == PushMode::kTimeout && options.timeout < Clock::Duration::zero()) {
    return invalid_argument(fmt::format("remote push: negative timeout {} ns", options.timeout.count()));
  }
  // Checked here too, so a bad trajectory costs no credit and no round trip.
  LAMINAR_RETURN_IF_ERROR(validate_trajectory(t, /*contents=*/false));
  const Duration start = impl_->clock->now();
  LAMINAR_RETURN_IF_ERROR(impl_->acquire(options, start));
  std::string bytes(kPushHeaderBytes, '\0');
  const auto [timeout_ns, request_timeout] = request_limits(options, *impl_->clock, start);
  const PushHeader h{kPushMagic, std::uint8_t(options.mode), {0, 0, 0}, timeout_ns};
  std::memcpy(bytes.data(), &h, sizeof(h));
  encode_trajectory(t, bytes);
  Result<Message> r = internal::request_protocol(
      impl_->ep,
      Message::from_bytes(kQueuePushMessage, std::as_bytes(std::span<const char>(bytes.data(), bytes.size()))),
      request_timeout);
  impl_->give_back();
  if (!r.ok()) return r.status();
  t = Trajectory{};
  return ok_status();
}

}  // namespace laminar
