#include "laminar/remote_trajectory_queue.h"

#include <fmt/format.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

namespace laminar {
namespace {

constexpr std::uint32_t kProtocol = 1;
constexpr std::uint32_t kPushMagic = 0x31505154u;  // "TQP1"
constexpr std::size_t kPushHeaderBytes = 16;
// While the queue is full, held pushes are retried this often. Polling rather than blocking in the
// queue keeps the server independent of the queue's clock (which may be virtual) and stoppable.
constexpr auto kRetryEvery = std::chrono::milliseconds(1);
// A blocking push has no deadline of its own; the request still needs one.
constexpr auto kBlockingRequestTimeout = std::chrono::hours(24);

struct PushHeader {
  std::uint32_t magic;
  std::uint8_t mode;
  std::uint8_t pad[3];
  std::int64_t timeout_ns;
};
static_assert(sizeof(PushHeader) == kPushHeaderBytes);

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
  Impl(Transport& t, TrajectoryQueue& q, QueueServerOptions o) : transport(t), queue(q), opt(o) {}

  struct Held {
    Incoming in;
    Trajectory t;
    bool has_deadline = false;
    std::chrono::steady_clock::time_point deadline;
  };

  Transport& transport;
  TrajectoryQueue& queue;
  QueueServerOptions opt;

  mutable std::mutex mu;
  std::condition_variable cv;
  std::deque<Held> held;  // arrival order; only the worker takes from the front
  bool stopping = false;
  Stats st;
  std::thread worker;

  static void answer(const Incoming& in, const Status& s) {
    // The producer may be gone; then there is nobody to tell, and nothing else to do.
    Endpoint from = in.from;  // a handle; replying is not const
    if (s.ok()) {
      (void)from.reply(in, Message{kQueuePushMessage, {}});
    } else {
      (void)from.reply_error(in, s);
    }
  }

  void count(const Status& s) {
    std::lock_guard<std::mutex> l(mu);
    ++(s.ok() ? st.accepted : st.refused);
  }

  void on_hello(const Incoming& in) {
    {
      std::lock_guard<std::mutex> l(mu);
      ++st.producers;
    }
    Endpoint from = in.from;
    (void)from.reply(in, Message{kQueueHelloMessage, u32_pair(kProtocol, opt.credits_per_producer)});
  }

  void on_push(Incoming in) {
    const auto& body = in.message.body;
    PushHeader h{};
    Status bad;
    if (body.size() < kPushHeaderBytes) {
      bad = data_loss(fmt::format("queue push message of {} bytes, shorter than its {}-byte header",
                                  body.size(), kPushHeaderBytes));
    } else {
      std::memcpy(&h, body.data(), sizeof(h));
      if (h.magic != kPushMagic) {
        bad = data_loss(fmt::format("queue push message: bad magic {:#010x}", h.magic));
      } else if (h.mode > std::uint8_t(PushMode::kTimeout) || h.timeout_ns < 0) {
        bad = invalid_argument(fmt::format("queue push message: push mode {} with timeout {} ns", int(h.mode),
                                           h.timeout_ns));
      }
    }
    Result<Trajectory> t = bad.ok() ? decode_trajectory(std::string_view(
                                          reinterpret_cast<const char*>(body.data()) + kPushHeaderBytes,
                                          body.size() - kPushHeaderBytes))
                                    : Result<Trajectory>(bad);
    std::unique_lock<std::mutex> l(mu);
    ++st.received;
    if (!t.ok()) {
      ++st.malformed;
      l.unlock();
      answer(in, t.status());
      return;
    }
    if (stopping) {
      l.unlock();
      answer(in, cancelled("queue server is stopping"));
      return;
    }
    const auto mode = PushMode(h.mode);
    if (held.empty()) {
      // Nobody is waiting ahead of it: try at once, without holding up the transport's thread.
      l.unlock();
      Status s = queue.push(std::move(*t), PushOptions::fail_fast());
      if (s.ok() || s.code() != StatusCode::kUnavailable || mode == PushMode::kFailFast) {
        count(s);
        answer(in, s);
        return;
      }
      l.lock();
      if (stopping) {
        l.unlock();
        answer(in, cancelled("queue server is stopping"));
        return;
      }
    }
    Held hd{std::move(in), std::move(*t), mode == PushMode::kTimeout, {}};
    if (hd.has_deadline) hd.deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(h.timeout_ns);
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
      const auto now = std::chrono::steady_clock::now();
      for (auto it = held.begin(); it != held.end();) {
        if (it->has_deadline && it->deadline <= now) {
          Incoming in = std::move(it->in);
          it = held.erase(it);
          ++st.refused;
          l.unlock();
          answer(in, deadline_exceeded("push: the queue stayed full past the producer's timeout"));
          l.lock();
        } else {
          ++it;
        }
      }
      if (held.empty()) continue;
      // References to the front stay valid while the handler appends at the back.
      Held& front = held.front();
      l.unlock();
      Status s = queue.push(std::move(front.t), PushOptions::fail_fast());
      l.lock();
      if (s.code() == StatusCode::kUnavailable) {
        cv.wait_for(l, kRetryEvery);
        continue;
      }
      Incoming in = std::move(held.front().in);
      held.pop_front();
      st.held = held.size();
      ++(s.ok() ? st.accepted : st.refused);
      l.unlock();
      answer(in, s);
      l.lock();
    }
    std::deque<Held> left = std::move(held);
    held.clear();
    st.held = 0;
    l.unlock();
    for (Held& h : left) answer(h.in, cancelled("queue server stopped"));
  }
};

Result<std::unique_ptr<TrajectoryQueueServer>> TrajectoryQueueServer::start(Transport& transport,
                                                                            TrajectoryQueue& queue,
                                                                            QueueServerOptions options) {
  if (options.credits_per_producer == 0) return invalid_argument("QueueServerOptions: credits_per_producer is 0");
  auto impl = std::make_shared<Impl>(transport, queue, options);
  impl->worker = std::thread([raw = impl.get()] { raw->run(); });
  transport.on_message(kQueueHelloMessage, [impl](Incoming in) { impl->on_hello(in); });
  transport.on_message(kQueuePushMessage, [impl](Incoming in) { impl->on_push(std::move(in)); });
  return std::unique_ptr<TrajectoryQueueServer>(new TrajectoryQueueServer(std::move(impl)));
}

TrajectoryQueueServer::TrajectoryQueueServer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

TrajectoryQueueServer::~TrajectoryQueueServer() {
  impl_->transport.on_message(kQueueHelloMessage, {});
  impl_->transport.on_message(kQueuePushMessage, {});
  {
    std::lock_guard<std::mutex> l(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  impl_->worker.join();
}

TrajectoryQueueServer::Stats TrajectoryQueueServer::stats() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  return impl_->st;
}

// ---------------------------------------------------------------------------------------------
// Producer.

struct RemoteProducer::Impl {
  Endpoint ep;
  std::uint32_t granted = 0;
  mutable std::mutex mu;
  std::condition_variable cv;
  std::uint32_t free = 0;

  // Takes a credit as `o` says; OK when taken.
  Status acquire(const PushOptions& o) {
    std::unique_lock<std::mutex> l(mu);
    if (free > 0) {
      --free;
      return ok_status();
    }
    if (o.mode == PushMode::kFailFast) {
      return unavailable(fmt::format("remote push: all {} credits in flight", granted));
    }
    if (o.mode == PushMode::kBlock) {
      cv.wait(l, [&] { return free > 0; });
    } else if (!cv.wait_for(l, o.timeout, [&] { return free > 0; })) {
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

Result<std::unique_ptr<RemoteProducer>> RemoteProducer::connect(Endpoint endpoint,
                                                                std::chrono::milliseconds timeout) {
  if (!endpoint.valid()) return invalid_argument("RemoteProducer::connect: endpoint is not connected");
  Result<Message> r = endpoint.request(Message{kQueueHelloMessage, {}}, timeout);
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
  impl->ep = std::move(endpoint);
  impl->granted = credits;
  impl->free = credits;
  return std::unique_ptr<RemoteProducer>(new RemoteProducer(std::move(impl)));
}

RemoteProducer::RemoteProducer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RemoteProducer::~RemoteProducer() = default;

std::uint32_t RemoteProducer::credits_granted() const noexcept { return impl_->granted; }
std::uint32_t RemoteProducer::credits_free() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  return impl_->free;
}

Status RemoteProducer::push(Trajectory&& t, PushOptions options) {
  if (options.mode == PushMode::kTimeout && options.timeout < Clock::Duration::zero()) {
    return invalid_argument(fmt::format("remote push: negative timeout {} ns", options.timeout.count()));
  }
  // Checked here too, so a bad trajectory costs no credit and no round trip.
  LAMINAR_RETURN_IF_ERROR(validate_trajectory(t, /*contents=*/false));
  const auto start = std::chrono::steady_clock::now();
  LAMINAR_RETURN_IF_ERROR(impl_->acquire(options));
  std::string bytes(kPushHeaderBytes, '\0');
  PushHeader h{kPushMagic, std::uint8_t(options.mode), {0, 0, 0}, 0};
  std::chrono::milliseconds request_timeout = kBlockingRequestTimeout;
  if (options.mode == PushMode::kTimeout) {
    const auto left = std::max(options.timeout - (std::chrono::steady_clock::now() - start),
                               Clock::Duration::zero());
    h.timeout_ns = left.count();
    // The server answers kDeadlineExceeded itself; the slack covers the round trip.
    request_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(left) + std::chrono::seconds(5);
  } else if (options.mode == PushMode::kFailFast) {
    request_timeout = kDefaultTimeout;
  }
  std::memcpy(bytes.data(), &h, sizeof(h));
  encode_trajectory(t, bytes);
  Result<Message> r = impl_->ep.request(
      Message::from_bytes(kQueuePushMessage, std::as_bytes(std::span<const char>(bytes.data(), bytes.size()))),
      request_timeout);
  impl_->give_back();
  if (!r.ok()) return r.status();
  t = Trajectory{};
  return ok_status();
}

}  // namespace laminar
