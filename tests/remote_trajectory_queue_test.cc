#include "laminar/remote_trajectory_queue.h"

#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "eventually.h"
#include "expect_code.h"
#include "make_transport.h"
#include "process.h"
#include "relay_test_util.h"
#include "remote_trajectory_protocol.h"
#include "remote_trajectory_queue_wire.h"
#include "transport/protocol.h"

using laminar::BatchSpec;
using laminar::PushOptions;
using laminar::TrajectoryQueueOptions;
using laminar::RemoteProducer;
using laminar::StatusCode;
using laminar::Trajectory;
using laminar::TrajectoryQueue;
using laminar::TrajectoryQueueServer;
using laminar::Transport;
using laminar::internal::kQueuePushManyMessage;
using laminar::internal::kQueuePushMessage;
using laminar::internal::request_protocol;
using laminar::testing::eventually;
using laminar::testing::expect_code;
using laminar::testing::make_transport;
using namespace std::chrono_literals;

namespace {

const char* kToken = "remote-queue-test-token-0123456789";

// A queue served over the transport, and a client transport to reach it.
struct Served {
  std::shared_ptr<Transport> server_tr = make_transport(kToken);
  std::string addr = server_tr->listen("127.0.0.1", 0).value();
  std::unique_ptr<TrajectoryQueueServer> server;
  std::shared_ptr<Transport> client_tr = make_transport(kToken);

  explicit Served(std::shared_ptr<TrajectoryQueue> q, laminar::TrajectoryQueueServerOptions o = {})
      : server(TrajectoryQueueServer::create(server_tr, std::move(q), std::move(o)).value()) {}
  laminar::Endpoint connect() { return client_tr->connect(addr).value(); }
  std::unique_ptr<RemoteProducer> producer(laminar::RemoteProducerOptions o = {}) {
    return RemoteProducer::create(client_tr, addr, std::move(o)).value();
  }
};


}  // namespace

TEST_CASE("remote push: answers, errors and credit-based backpressure", "[remote]") {
  TrajectoryQueueOptions qo;
  qo.capacity_trajectories = 3;
  std::shared_ptr<TrajectoryQueue> queue = TrajectoryQueue::create(qo).value();
  laminar::TrajectoryQueueServerOptions so;
  so.credits_per_producer = 2;
  Served served(queue, so);
  auto producer = served.producer();
  CHECK(producer->credits_granted() == 2);

  REQUIRE(producer->push(laminar::test_remote::make(1)).ok());
  BatchSpec spec;
  spec.max_trajectories = 8;
  auto b = queue->pop_batch(spec);
  REQUIRE(b.ok());
  REQUIRE(b->size() == 1);
  CHECK(b->trajectories()[0] == laminar::test_remote::make(1));  // every byte arrived

  Trajectory ahead = laminar::test_remote::make(2);
  ahead.version = laminar::Version(9);
  expect_code(producer->push(std::move(ahead)), StatusCode::kInvalidArgument, "ahead of the newest");
  CHECK(ahead.version == laminar::Version(9));  // refused: still the caller's
  expect_code(producer->push(laminar::test_remote::make(1)), StatusCode::kAlreadyExists, "already pushed");
  Trajectory bad = laminar::test_remote::make(3);
  bad.logprobs.pop_back();  // caught before it costs a credit
  expect_code(producer->push(std::move(bad)), StatusCode::kInvalidArgument, "logprobs for");

  // The queue holds 1 leased + 2 more = full.
  REQUIRE(producer->push(laminar::test_remote::make(4)).ok());
  REQUIRE(producer->push(laminar::test_remote::make(5)).ok());
  expect_code(producer->push(laminar::test_remote::make(6), PushOptions::fail_fast()), StatusCode::kUnavailable,
              "queue full");
  expect_code(producer->push(laminar::test_remote::make(6), PushOptions::with_timeout(100ms)),
              StatusCode::kDeadlineExceeded, "stayed full");

  // Two blocking pushes use both credits and wait in the server; a third finds no credit.
  std::vector<laminar::Status> results(2);
  std::vector<std::thread> blocked;
  for (int i = 0; i < 2; ++i) {
    blocked.emplace_back([&, i] { results[std::size_t(i)] = producer->push(laminar::test_remote::make(10 + std::uint64_t(i))); });
  }
  REQUIRE(eventually([&] { return served.server->stats().held == 2; }));
  CHECK(producer->credits_free() == 0);
  expect_code(producer->push(laminar::test_remote::make(12), PushOptions::fail_fast()), StatusCode::kUnavailable,
              "credits in flight");
  expect_code(producer->push(laminar::test_remote::make(12), PushOptions::with_timeout(50ms)),
              StatusCode::kDeadlineExceeded, "no credit free");
  REQUIRE(queue->ack(b->id()).ok());  // one slot frees
  auto b2 = queue->pop_batch(spec);
  REQUIRE(b2.ok());
  REQUIRE(queue->ack(b2->id()).ok());  // and the rest
  for (auto& t : blocked) t.join();
  CHECK(results[0].ok());
  CHECK(results[1].ok());
  CHECK(producer->credits_free() == 2);
  auto st = served.server->stats();
  CHECK(st.producers == 1);
  CHECK(st.held == 0);
  CHECK(st.accepted == 5);
  CHECK(st.malformed == 0);
}

TEST_CASE("remote push: one queue server per transport; a second is refused until the first is gone", "[remote]") {
  std::shared_ptr<TrajectoryQueue> queue = TrajectoryQueue::create().value();
  Served served(queue);
  // A second server would take over the first one's handlers, and its destruction remove them.
  expect_code(TrajectoryQueueServer::create(served.server_tr, queue).status(), StatusCode::kAlreadyExists,
              "queue server");
  auto producer = served.producer();
  REQUIRE(producer->push(laminar::test_remote::make(1)).ok());  // the first still serves

  served.server.reset();
  auto again = TrajectoryQueueServer::create(served.server_tr, queue);
  REQUIRE(again.ok());
  auto later = served.producer();
  REQUIRE(later->push(laminar::test_remote::make(2)).ok());
  CHECK((*again)->stats().accepted == 1);
}

TEST_CASE("remote push timeouts run on the clocks: the producer's for a credit, the server's for a held push",
          "[remote][clock]") {
  auto clock = std::make_shared<laminar::ManualClock>();
  TrajectoryQueueOptions qo;
  qo.capacity_trajectories = 1;
  std::shared_ptr<TrajectoryQueue> queue = TrajectoryQueue::create(qo).value();
  laminar::TrajectoryQueueServerOptions so;
  so.credits_per_producer = 1;
  so.clock = clock;
  Served served(queue, so);
  laminar::RemoteProducerOptions po;
  po.clock = clock;
  auto producer = served.producer(po);
  REQUIRE(producer->push(laminar::test_remote::make(1)).ok());  // the queue is full now

  using Timed = std::pair<laminar::Status, laminar::Duration>;
  auto timed_push = [&](std::uint64_t id, laminar::Duration timeout) {
    const laminar::Duration start = clock->now();
    laminar::Status st = producer->push(laminar::test_remote::make(id), PushOptions::with_timeout(timeout));
    return Timed(st, clock->now() - start);
  };
  // Held by the server, with the only credit, until the server's clock passes its timeout.
  std::future<Timed> held = std::async(std::launch::async, timed_push, 2, std::chrono::seconds(1000));
  REQUIRE(eventually([&] { return served.server->stats().held == 1; }));
  // Waits for that credit on the producer's clock.
  std::future<Timed> no_credit = std::async(std::launch::async, timed_push, 3, std::chrono::seconds(5));
  REQUIRE(laminar::testing::advance_until_ready(*clock, no_credit, std::chrono::seconds(1), 500));
  const Timed c = no_credit.get();
  expect_code(c.first, StatusCode::kDeadlineExceeded, "no credit free");
  CHECK(c.second >= std::chrono::seconds(5));
  CHECK(held.wait_for(0s) == std::future_status::timeout);
  REQUIRE(laminar::testing::advance_until_ready(*clock, held, std::chrono::seconds(50), 500));
  const Timed h = held.get();
  expect_code(h.first, StatusCode::kDeadlineExceeded, "stayed full");
  CHECK(h.second >= std::chrono::seconds(1000));
  CHECK(producer->credits_free() == 1);
  CHECK(queue->stats().pushed == 1);
}

TEST_CASE("a held push goes in once a consumer frees room, with the server's clock standing still",
          "[remote][clock]") {
  // Nothing moves the server's clock: only the queue's news of room can bring the push in.
  auto still = std::make_shared<laminar::ManualClock>();
  TrajectoryQueueOptions qo;
  qo.capacity_trajectories = 1;
  std::shared_ptr<TrajectoryQueue> queue = TrajectoryQueue::create(qo).value();
  laminar::TrajectoryQueueServerOptions so;
  so.clock = still;
  Served served(queue, so);
  auto producer = served.producer();
  REQUIRE(producer->push(laminar::test_remote::make(1)).ok());  // the queue is full now

  std::future<laminar::Status> held =
      std::async(std::launch::async, [&] { return producer->push(laminar::test_remote::make(2)); });
  // Both tries have found the queue full, the handler's and the worker's: the worker sleeps now.
  REQUIRE(eventually([&] { return queue->stats().rejected_full == 2; }));
  BatchSpec spec;
  spec.max_trajectories = 1;
  auto b = queue->pop_batch(spec);
  REQUIRE(b.ok());
  REQUIRE(queue->ack(b->id()).ok());
  // Real time only bounds a failure: the answer follows the ack.
  REQUIRE(held.wait_for(30s) == std::future_status::ready);
  CHECK(held.get().ok());
  CHECK(queue->stats().pushed == 2);
  CHECK(served.server->stats().held == 0);
}

TEST_CASE("a push held past its timeout costs the server no retries meanwhile", "[remote]") {
  TrajectoryQueueOptions qo;
  qo.capacity_trajectories = 1;
  std::shared_ptr<TrajectoryQueue> queue = TrajectoryQueue::create(qo).value();
  Served served(queue);
  auto producer = served.producer();
  REQUIRE(producer->push(laminar::test_remote::make(1)).ok());  // the queue is full now
  // Each try of the server's to push a held trajectory that finds the queue full is a refusal.
  const std::uint64_t before = queue->stats().rejected_full;
  expect_code(producer->push(laminar::test_remote::make(2), PushOptions::with_timeout(300ms)),
              StatusCode::kDeadlineExceeded, "stayed full");
  // One try as the push arrives and one as the worker takes it up; a retry a millisecond would be
  // hundreds.
  CHECK(queue->stats().rejected_full - before <= 3);
}

TEST_CASE("a held push goes in when a group timeout of the queue's clock frees room", "[remote][clock]") {
  auto clock = std::make_shared<laminar::ManualClock>();
  TrajectoryQueueOptions qo;
  qo.capacity_trajectories = 2;
  qo.clock = clock;
  qo.group_timeout = 10s;
  qo.partial_group_policy = laminar::PartialGroupPolicy::kDrop;
  std::shared_ptr<TrajectoryQueue> queue = TrajectoryQueue::create(qo).value();
  Trajectory member = laminar::test_remote::make(1);
  member.group_id = laminar::GroupId(5);
  member.group_size = 2;
  REQUIRE(queue->push(std::move(member)).ok());
  REQUIRE(queue->push(laminar::test_remote::make(3)).ok());  // full, until the group times out
  Served served(queue);
  auto producer = served.producer();
  std::future<laminar::Status> held =
      std::async(std::launch::async, [&] { return producer->push(laminar::test_remote::make(2)); });
  REQUIRE(eventually([&] { return served.server->stats().held == 1; }));
  REQUIRE(clock->advance(10s).ok());  // nobody calls the queue: the server's retry runs the timeout
  REQUIRE(held.wait_for(30s) == std::future_status::ready);
  CHECK(held.get().ok());
  CHECK(queue->stats().dropped_group_timeout == 1);
}

TEST_CASE("queue wire: answers round-trip, and answers cut short or out of range are refused", "[remote][bad-input]") {
  using laminar::internal::decode_queue_hello;
  using laminar::internal::decode_queue_statuses;
  auto bytes = [](const std::string& s) { return std::as_bytes(std::span(s.data(), s.size())); };

  const std::vector<std::byte> hello = laminar::internal::encode_queue_hello(5);
  REQUIRE(decode_queue_hello(hello).ok());
  CHECK(*decode_queue_hello(hello) == 5);
  expect_code(decode_queue_hello(std::span(hello).first(7)).status(), StatusCode::kDataLoss,
              "credits cut short at offset 4");
  // A server of protocol 1 leaves pings unanswered: refused at the handshake.
  expect_code(decode_queue_hello(bytes(std::string("\1\0\0\0\5\0\0\0", 8))).status(), StatusCode::kDataLoss,
              "protocol 1 (expected 2)");
  expect_code(decode_queue_hello(laminar::internal::encode_queue_hello(0)).status(), StatusCode::kDataLoss,
              "no credits granted");

  const std::vector<laminar::Status> statuses = {laminar::ok_status(), laminar::not_found("no such group"),
                                                 laminar::unavailable("queue full")};
  const std::string answer = laminar::internal::encode_queue_statuses(statuses);
  auto back = decode_queue_statuses(bytes(answer));
  REQUIRE(back.ok());
  CHECK(*back == statuses);
  for (std::size_t n = 0; n < answer.size(); ++n) {
    INFO("cut to " << n);
    CHECK(decode_queue_statuses(bytes(answer.substr(0, n))).status().code() == StatusCode::kDataLoss);
  }
  std::string lie = answer;
  lie[0] = char(200);  // far more statuses than the bytes could hold
  expect_code(decode_queue_statuses(bytes(lie)).status(), StatusCode::kDataLoss, "count 200 does not fit");
  lie = answer;
  lie[4] = char(200);
  expect_code(decode_queue_statuses(bytes(lie)).status(), StatusCode::kDataLoss, "status code 200 at offset 4");
}

TEST_CASE("remote push: malformed and truncated messages are refused, the server keeps serving",
          "[remote][bad-input]") {
  std::shared_ptr<TrajectoryQueue> queue = TrajectoryQueue::create(TrajectoryQueueOptions{}).value();
  Served served(queue);
  auto ep = served.connect();

  expect_code(request_protocol(ep, laminar::Message::from_string(kQueuePushMessage, "short")).status(),
              StatusCode::kDataLoss, "header cut short at offset 0 (5 of 16 bytes)");
  expect_code(request_protocol(ep, laminar::Message::from_string(kQueuePushMessage, std::string(40, 'x'))).status(),
              StatusCode::kDataLoss, "bad magic");
  // A real push message cut short, as a producer dying mid-send would leave it if it ever arrived.
  std::string body;
  laminar::internal::encode_queue_push(laminar::test_remote::make(7), {}, body);
  for (std::size_t cut : {body.size() - 1, body.size() / 2, std::size_t(17)}) {
    expect_code(request_protocol(ep, laminar::Message::from_string(kQueuePushMessage, body.substr(0, cut))).status(),
                StatusCode::kDataLoss, "encoded trajectory");
  }
  CHECK(served.server->stats().malformed == 5);
  CHECK(queue->stats().pushed == 0);
  REQUIRE(request_protocol(ep, laminar::Message::from_string(kQueuePushMessage, body)).ok());
  CHECK(queue->stats().pushed == 1);
  laminar::TrajectoryQueueServerOptions no_credit;
  no_credit.credits_per_producer = 0;
  expect_code(TrajectoryQueueServer::create(make_transport(kToken), queue, no_credit).status(),
              StatusCode::kInvalidArgument, "credits_per_producer");
  expect_code(TrajectoryQueueServer::create(nullptr, queue).status(), StatusCode::kInvalidArgument, "transport");
  expect_code(TrajectoryQueueServer::create(make_transport(kToken), nullptr).status(), StatusCode::kInvalidArgument,
              "queue");
  expect_code(RemoteProducer::create(nullptr, served.addr).status(), StatusCode::kInvalidArgument, "transport");
  expect_code(RemoteProducer::create(served.client_tr, laminar::Endpoint()).status(), StatusCode::kInvalidArgument,
              "not connected");
  for (laminar::Duration stall : {laminar::Duration::zero(), laminar::Duration(-1)}) {
    laminar::RemoteProducerOptions po;
    po.stall_timeout = stall;
    expect_code(RemoteProducer::create(served.client_tr, served.addr, po).status(), StatusCode::kInvalidArgument,
                "stall_timeout");
    expect_code(RemoteProducer::create(served.client_tr, served.connect(), po).status(),
                StatusCode::kInvalidArgument, "stall_timeout");
  }
}

TEST_CASE("a blocking push waits for a full queue past many stall_timeouts: a live server answers pings",
          "[remote][clock]") {
  TrajectoryQueueOptions qo;
  qo.capacity_trajectories = 1;
  std::shared_ptr<TrajectoryQueue> queue = TrajectoryQueue::create(qo).value();
  Served served(queue);
  auto clock = std::make_shared<laminar::ManualClock>();
  laminar::RemoteProducerOptions po;
  po.clock = clock;
  po.stall_timeout = 10s;
  auto producer = served.producer(po);
  REQUIRE(producer->push(laminar::test_remote::make(1)).ok());

  std::future<laminar::Status> blocked =
      std::async(std::launch::async, [&] { return producer->push(laminar::test_remote::make(2)); });
  REQUIRE(eventually([&] { return served.server->stats().held == 1; }));
  // Holding a push, the server still answers a ping at once.
  laminar::Endpoint ep = served.connect();
  CHECK(request_protocol(ep, laminar::Message{laminar::internal::kQueuePingMessage, {}}, 10s).ok());
  // Five stall_timeouts of the producer's clock, a ping due at every half of one.
  for (int i = 0; i < 10; ++i) REQUIRE(clock->advance(po.stall_timeout / 2).ok());

  BatchSpec spec;
  spec.max_trajectories = 1;
  auto b = queue->pop_batch(spec);
  REQUIRE(b.ok());
  REQUIRE(queue->ack(b->id()).ok());
  REQUIRE(blocked.wait_for(10s) == std::future_status::ready);
  CHECK(blocked.get().ok());
  // The server answered this one itself: the producer was never taken for stalled.
  expect_code(producer->push(laminar::test_remote::make(3), PushOptions::fail_fast()), StatusCode::kUnavailable,
              "queue full");
}

TEST_CASE("remote push: pings follow the producer's clock, and one unanswered on the transport's clock ends the push",
          "[remote][clock]") {
  // A server made by hand on a real transport: it holds every push and answers pings while told to.
  std::atomic<int> pushes{0};
  std::atomic<int> pings{0};
  std::atomic<bool> answer_pings{true};
  std::mutex held_mu;
  std::vector<laminar::Incoming> held;
  std::shared_ptr<Transport> server_tr = make_transport(kToken);
  const std::string addr = server_tr->listen("127.0.0.1", 0).value();
  using laminar::internal::on_protocol_message;
  REQUIRE(on_protocol_message(*server_tr, laminar::internal::kQueueHelloMessage, [](laminar::Incoming in) {
            const std::vector<std::byte> credits = laminar::internal::encode_queue_hello(1);
            (void)in.from.reply(in, laminar::Message::from_bytes(laminar::internal::kQueueHelloMessage, credits));
          }).ok());
  REQUIRE(on_protocol_message(*server_tr, kQueuePushMessage, [&](laminar::Incoming in) {
            std::lock_guard<std::mutex> l(held_mu);
            held.push_back(std::move(in));
            ++pushes;
          }).ok());
  // Counted once it is decided whether to answer and before the answer leaves: a test that sees the
  // count knows the fate of that ping, and that the producer cannot have sent the next one yet.
  REQUIRE(on_protocol_message(*server_tr, laminar::internal::kQueuePingMessage, [&](laminar::Incoming in) {
            const bool answer = answer_pings;
            ++pings;
            if (answer) (void)in.from.reply(in, laminar::Message{laminar::internal::kQueuePingMessage, {}});
          }).ok());

  auto producer_clock = std::make_shared<laminar::ManualClock>();
  auto transport_clock = std::make_shared<laminar::ManualClock>();
  laminar::TransportOptions to;
  to.cluster_token = kToken;
  to.clock = transport_clock;
  std::shared_ptr<Transport> client_tr = Transport::create(to).value();
  laminar::RemoteProducerOptions po;
  po.clock = producer_clock;
  po.stall_timeout = 10s;
  auto producer = RemoteProducer::create(client_tr, addr, po).value();

  std::future<laminar::Status> blocked =
      std::async(std::launch::async, [&] { return producer->push(laminar::test_remote::make(1)); });
  REQUIRE(eventually([&] { return pushes.load() == 1; }));
  // Only the producer's clock brings a ping: moved on until the server has seen `n` of them.
  const auto pinged_after_clock_moves = [&](int n) {
    return eventually([&] {
      if (pings.load() >= n) return true;
      REQUIRE(producer_clock->advance(po.stall_timeout / 4).ok());
      return false;
    });
  };
  // Answered pings keep the push waiting, however long the producer's clock runs.
  for (int n = 1; n <= 4; ++n) REQUIRE(pinged_after_clock_moves(n));
  CHECK(producer_clock->now() >= 4 * po.stall_timeout / 2);

  // Unanswered, a ping times out on the transport's clock, and that ends the push.
  answer_pings = false;
  const int answered = pings.load();
  REQUIRE(pinged_after_clock_moves(answered + 1));
  REQUIRE(laminar::testing::advance_until_ready(*transport_clock, blocked, 1s, 100));
  expect_code(blocked.get(), StatusCode::kUnavailable, "answered nothing for 10000 ms");
  CHECK(transport_clock->now() >= po.stall_timeout);
  expect_code(producer->push(laminar::test_remote::make(2)), StatusCode::kUnavailable, "answered nothing");

  for (laminar::MessageType type : {laminar::internal::kQueueHelloMessage, kQueuePushMessage,
                                     laminar::internal::kQueuePingMessage}) {
    REQUIRE(on_protocol_message(*server_tr, type, {}).ok());
  }
}

TEST_CASE("remote push_many: one answer per trajectory, only the accepted ones moved from", "[remote]") {
  std::shared_ptr<TrajectoryQueue> queue = TrajectoryQueue::create(TrajectoryQueueOptions{}).value();
  Served served(queue);
  auto producer = served.producer();
  REQUIRE(producer->push(laminar::test_remote::make(1)).ok());

  std::vector<Trajectory> ts;
  for (std::uint64_t id : {10, 1, 11, 12, 13, 14}) ts.push_back(laminar::test_remote::make(id));
  ts[2].logprobs.pop_back();         // caught before it is sent
  ts[3].version = laminar::Version(9);  // ahead of the newest
  ts[5].response_tokens[0] = -5;     // sent; the queue checks the contents (validate_contents)
  const std::vector<laminar::Status> out = producer->push_many(ts);
  REQUIRE(out.size() == 6);
  CHECK(out[0].ok());
  expect_code(out[1], StatusCode::kAlreadyExists, "already pushed");
  expect_code(out[2], StatusCode::kInvalidArgument, "logprobs for");
  expect_code(out[3], StatusCode::kInvalidArgument, "ahead of the newest");
  CHECK(out[4].ok());
  expect_code(out[5], StatusCode::kInvalidArgument, "is a negative token id");
  CHECK(ts[0].response_tokens.empty());  // moved from
  CHECK(ts[1] == laminar::test_remote::make(1));
  CHECK(ts[3].version == laminar::Version(9));

  BatchSpec spec;
  spec.max_trajectories = 8;
  auto b = queue->pop_batch(spec);
  REQUIRE(b.ok());
  std::vector<std::uint64_t> ids;
  for (const Trajectory& t : b->trajectories()) {
    ids.push_back(t.id.value());
    CHECK(t == laminar::test_remote::make(t.id.value()));
  }
  CHECK(ids == std::vector<std::uint64_t>{1, 10, 13});
  const auto st = served.server->stats();
  CHECK(st.received == 2);
  CHECK(st.accepted == 3);
  CHECK(st.refused == 3);

  // More than one message's worth: split by count and bytes, each message taking a credit.
  std::vector<Trajectory> many;
  for (std::uint64_t id = 1000; id < 2100; ++id) many.push_back(laminar::test_remote::make(id));
  for (const laminar::Status& s : producer->push_many(many)) REQUIRE(s.ok());
  CHECK(served.server->stats().received > 3);
  CHECK(queue->stats().ready == 1100);
  CHECK(producer->credits_free() == producer->credits_granted());
}

TEST_CASE("on_accepted names each trajectory the queue took, before its producer hears so", "[remote]") {
  TrajectoryQueueOptions qo;
  qo.capacity_trajectories = 3;
  std::shared_ptr<TrajectoryQueue> queue = TrajectoryQueue::create(qo).value();
  std::mutex mu;
  std::vector<std::uint64_t> accepted;
  laminar::TrajectoryQueueServerOptions so;
  so.on_accepted = [&](std::span<const laminar::TrajectoryId> ids) {
    std::lock_guard<std::mutex> l(mu);
    for (laminar::TrajectoryId id : ids) accepted.push_back(id.value());
  };
  Served served(queue, so);
  auto producer = served.producer();
  auto seen = [&] {
    std::lock_guard<std::mutex> l(mu);
    return accepted;
  };

  REQUIRE(producer->push(laminar::test_remote::make(1)).ok());
  CHECK(seen() == std::vector<std::uint64_t>{1});
  expect_code(producer->push(laminar::test_remote::make(1)), StatusCode::kAlreadyExists, "already pushed");
  std::vector<Trajectory> ts;
  for (std::uint64_t id : {2, 1, 3}) ts.push_back(laminar::test_remote::make(id));
  ts[2].response_tokens[0] = -5;  // refused by the queue's content check
  const std::vector<laminar::Status> out = producer->push_many(ts);
  REQUIRE(out.size() == 3);
  CHECK(out[0].ok());
  CHECK(!out[1].ok());
  CHECK(!out[2].ok());
  CHECK(seen() == std::vector<std::uint64_t>{1, 2});

  // Full: the push waits in the server, and goes in on the server's own thread once room frees.
  REQUIRE(producer->push(laminar::test_remote::make(4)).ok());
  laminar::Status held = laminar::internal_error("not answered");
  std::thread blocked([&] { held = producer->push(laminar::test_remote::make(5)); });
  REQUIRE(eventually([&] { return served.server->stats().held == 1; }));
  CHECK(seen() == std::vector<std::uint64_t>{1, 2, 4});
  BatchSpec spec;
  spec.max_trajectories = 1;
  auto b = queue->pop_batch(spec);
  REQUIRE(b.ok());
  REQUIRE(queue->ack(b->id()).ok());
  blocked.join();
  CHECK(held.ok());
  CHECK(seen() == std::vector<std::uint64_t>{1, 2, 4, 5});
  CHECK(served.server->stats().accepted == 4);
}

TEST_CASE("remote push_many: a full queue takes what fits, the rest waits or fails as asked", "[remote]") {
  TrajectoryQueueOptions qo;
  qo.capacity_trajectories = 3;
  std::shared_ptr<TrajectoryQueue> queue = TrajectoryQueue::create(qo).value();
  Served served(queue);
  auto producer = served.producer();
  auto make_many = [](std::uint64_t first, std::uint64_t n) {
    std::vector<Trajectory> ts;
    for (std::uint64_t id = first; id < first + n; ++id) ts.push_back(laminar::test_remote::make(id));
    return ts;
  };

  std::vector<Trajectory> five = make_many(1, 5);
  std::vector<laminar::Status> out = producer->push_many(five, PushOptions::fail_fast());
  REQUIRE(out.size() == 5);
  for (int i = 0; i < 3; ++i) CHECK(out[std::size_t(i)].ok());
  expect_code(out[3], StatusCode::kUnavailable, "queue full");
  expect_code(out[4], StatusCode::kUnavailable, "queue full");
  CHECK(five[4] == laminar::test_remote::make(5));  // still the caller's

  std::vector<Trajectory> late = make_many(4, 2);
  for (const laminar::Status& s : producer->push_many(late, PushOptions::with_timeout(100ms))) {
    expect_code(s, StatusCode::kDeadlineExceeded, "stayed full");
  }

  // A blocking push_many waits in the server until acks make room for all of it.
  std::vector<laminar::Status> blocked_out;
  std::thread blocked([&] { blocked_out = producer->push_many(late); });
  REQUIRE(eventually([&] { return served.server->stats().held == 1; }));
  BatchSpec spec;
  spec.max_trajectories = 1;
  for (int i = 0; i < 2; ++i) {
    auto b = queue->pop_batch(spec);
    REQUIRE(b.ok());
    REQUIRE(queue->ack(b->id()).ok());
  }
  blocked.join();
  REQUIRE(blocked_out.size() == 2);
  CHECK(blocked_out[0].ok());
  CHECK(blocked_out[1].ok());
  CHECK(queue->stats().pushed == 5);
  CHECK(served.server->stats().held == 0);
}

TEST_CASE("remote push_many: a malformed message is refused whole, the server keeps serving",
          "[remote][bad-input]") {
  std::shared_ptr<TrajectoryQueue> queue = TrajectoryQueue::create(TrajectoryQueueOptions{}).value();
  Served served(queue);
  auto ep = served.connect();

  auto message = [](std::uint32_t count, const std::vector<Trajectory>& ts) {
    std::string body(laminar::internal::kQueuePushManyHeaderBytes, '\0');
    for (const Trajectory& t : ts) laminar::internal::append_queue_push_many_item(t, body);
    laminar::internal::write_queue_push_many_header({laminar::PushMode::kFailFast, 0}, count, body);
    return body;
  };
  const std::vector<Trajectory> two = {laminar::test_remote::make(1), laminar::test_remote::make(2)};
  const std::string good = message(2, two);
  auto send = [&](const std::string& body) {
    return request_protocol(ep, laminar::Message::from_string(kQueuePushManyMessage, body));
  };
  auto changed = [&](std::size_t at, char x) {
    std::string b = good;
    b[at] = char(b[at] ^ x);
    return b;
  };

  expect_code(send(good.substr(0, 20)).status(), StatusCode::kDataLoss, "header cut short at offset 0 (20 of 24");
  expect_code(send(changed(0, 1)).status(), StatusCode::kDataLoss, "bad magic");
  expect_code(send(changed(4, 7)).status(), StatusCode::kInvalidArgument, "push mode 6");
  expect_code(send(changed(5, 1)).status(), StatusCode::kDataLoss, "nonzero padding at offset 5");
  expect_code(send(message(0, {})).status(), StatusCode::kInvalidArgument, "0 trajectories");
  expect_code(send(message(2000, two)).status(), StatusCode::kInvalidArgument, "2000 trajectories");
  // Cut inside the second trajectory, as a producer dying mid-send would leave it: the first,
  // whole, does not go in either.
  expect_code(send(good.substr(0, good.size() - 10)).status(), StatusCode::kDataLoss,
              "trajectory 1 of 2: queue push_many message: encoding cut short");
  expect_code(send(message(3, two)).status(), StatusCode::kDataLoss,
              "trajectory 2 of 3: queue push_many message: length cut short");
  expect_code(send(good + "xy").status(), StatusCode::kDataLoss, "2 trailing bytes");
  // Bytes of the second trajectory's 80-byte header changed: its response length (at 68), so the
  // sizes no longer add up, or its sample index (at 40), which no longer fits its group.
  const std::size_t second = 24 + 8 + laminar::encoded_trajectory_size(two[0]) + 8;
  expect_code(send(changed(second + 68, 0x7f)).status(), StatusCode::kDataLoss, "trajectory 1 of 2");
  expect_code(send(changed(second + 40, 0x7f)).status(), StatusCode::kInvalidArgument,
              "trajectory 1 of 2 at offset");
  CHECK(served.server->stats().malformed == 11);
  CHECK(queue->stats().pushed == 0);

  auto r = send(good);
  REQUIRE(r.ok());
  CHECK(r->body.size() == 4 + 2 * 8);  // two statuses, both OK with no message
  CHECK(queue->stats().pushed == 2);
}

TEST_CASE("remote push_many to a vanished server: each trajectory gets the error, none is moved from",
          "[remote][bad-input]") {
  std::shared_ptr<TrajectoryQueue> queue = TrajectoryQueue::create(TrajectoryQueueOptions{}).value();
  auto served = std::make_unique<Served>(queue);
  auto producer = RemoteProducer::create(make_transport(kToken), served->addr).value();
  std::vector<Trajectory> first(2);
  first[0] = laminar::test_remote::make(1);
  first[1] = laminar::test_remote::make(2);
  for (const laminar::Status& s : producer->push_many(first)) REQUIRE(s.ok());

  served.reset();  // the server process's transport is gone
  std::vector<Trajectory> ts;
  for (std::uint64_t id = 3; id < 6; ++id) ts.push_back(laminar::test_remote::make(id));
  const std::vector<laminar::Status> out = producer->push_many(ts, PushOptions::with_timeout(2s));
  REQUIRE(out.size() == 3);
  for (std::size_t i = 0; i < out.size(); ++i) {
    INFO(out[i].to_string());
    CHECK_FALSE(out[i].ok());
    CHECK(out[i].code() == out[0].code());
    CHECK(ts[i] == laminar::test_remote::make(3 + i));  // still the caller's, to push elsewhere
  }
  CHECK(producer->credits_free() == producer->credits_granted());
  CHECK(queue->stats().pushed == 2);
}

TEST_CASE("remote push_many into a queue with wal_fsync: the records survive a reopen", "[remote][wal]") {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("laminar_remote_many_" + std::to_string(::getpid()) + ".wal")).string();
  std::filesystem::remove(path);
  TrajectoryQueueOptions qo;
  qo.wal_path = path;
  qo.wal_fsync = true;
  {
    std::shared_ptr<TrajectoryQueue> queue = TrajectoryQueue::create(qo).value();
    Served served(queue);
    auto producer = served.producer();
    std::vector<Trajectory> ts;
    for (std::uint64_t id = 1; id <= 8; ++id) ts.push_back(laminar::test_remote::make(id));
    for (const laminar::Status& s : producer->push_many(ts)) REQUIRE(s.ok());
  }
  std::shared_ptr<TrajectoryQueue> reopened = TrajectoryQueue::create(qo).value();
  CHECK(reopened->recovery().recovered == 8);
  BatchSpec spec;
  spec.max_trajectories = 8;
  auto b = reopened->pop_batch(spec);
  REQUIRE(b.ok());
  REQUIRE(b->size() == 8);
  for (const Trajectory& t : b->trajectories()) CHECK(t == laminar::test_remote::make(t.id.value()));
  reopened.reset();
  std::filesystem::remove(path);
}

TEST_CASE("a producer process killed mid-stream leaves only whole trajectories", "[remote][process]") {
  const unsigned seed = std::random_device{}();
  std::printf("remote kill seed %u\n", seed);
  std::mt19937 rng(seed);
  TrajectoryQueueOptions qo;
  qo.capacity_trajectories = 32;  // small: the child's pushes wait for the consumer below
  std::shared_ptr<TrajectoryQueue> queue = TrajectoryQueue::create(qo).value();
  Served served(queue);

  // The consumer: pops, checks every byte against the id, acks.
  std::atomic<bool> stop{false};
  std::map<std::uint64_t, int> seen;
  std::atomic<int> mismatched{0};
  std::thread consumer([&] {
    BatchSpec spec;
    spec.max_trajectories = 16;
    spec.wait = 20ms;
    while (true) {
      auto b = queue->pop_batch(spec);
      if (!b.ok()) {
        if (stop) return;
        continue;
      }
      for (const Trajectory& t : b->trajectories()) {
        ++seen[t.id.value()];
        if (!(t == laminar::test_remote::make(t.id.value()))) ++mismatched;
      }
      if (!queue->ack(b->id()).ok()) ++mismatched;
    }
  });

  auto run_child = [&](std::uint64_t first, std::uint64_t count, int kill_after, std::set<std::uint64_t>& acked) {
    laminar::testing::ChildOptions co;
    co.program = LAMINAR_REMOTE_PRODUCER;
    co.args = {served.addr, std::to_string(first), std::to_string(count), "4"};
    co.env = {{"LAMINAR_TEST_TOKEN", kToken}};
    auto child = laminar::testing::ChildProcess::spawn(co).value();
    int lines = 0;
    for (;;) {
      auto line = child.read_line(20s);
      if (!line.ok()) break;
      std::istringstream in(*line);
      std::string kind;
      std::uint64_t id = 0;
      in >> kind >> id;
      REQUIRE(kind == "P");
      acked.insert(id);
      if (++lines == kill_after) child.kill(SIGKILL);
    }
    return child.wait(20s).value();
  };

  std::set<std::uint64_t> first_acked, second_acked;
  const int kill_after = 40 + int(rng() % 200);
  CHECK(run_child(1, 1'000'000, kill_after, first_acked) == 128 + SIGKILL);
  // A second producer after the death: the server is unharmed.
  CHECK(run_child(2'000'000, 60, -1, second_acked) == 0);
  CHECK(second_acked.size() == 60);
  REQUIRE(eventually([&] { return queue->stats().held_tokens == 0 && served.server->stats().held == 0; }));
  stop = true;
  consumer.join();

  CHECK(mismatched == 0);
  std::uint64_t twice = 0, missing = 0, unknown = 0;
  for (const auto& [id, n] : seen) {
    if (n != 1) ++twice;
    if (id >= 1'000'000 && id < 2'000'000) ++unknown;
  }
  for (std::uint64_t id : first_acked) missing += seen.count(id) == 0;
  for (std::uint64_t id : second_acked) missing += seen.count(id) == 0;
  // Pushes in flight at the kill may have landed unannounced: at most one per thread pushing one
  // at a time (2 of the 4), three per thread pushing three with push_many (the other 2).
  const std::size_t extra = seen.size() - first_acked.size() - second_acked.size();
  INFO(first_acked.size() << " announced before the kill, " << seen.size() << " consumed");
  CHECK(first_acked.size() >= std::size_t(kill_after));
  CHECK(twice == 0);
  CHECK(missing == 0);
  CHECK(unknown == 0);
  CHECK(extra <= 8);
  CHECK(served.server->stats().malformed == 0);
}

#ifdef LAMINAR_QUEUE_SERVER
TEST_CASE("a push to a stopped (SIGSTOP) queue server ends after its timeout, a blocking one after stall_timeout",
          "[remote][process]") {
  laminar::testing::ChildOptions co;
  co.program = LAMINAR_QUEUE_SERVER;
  co.args = {"--token", kToken};
  auto server = laminar::testing::ChildProcess::spawn(co).value();
  auto line = server.read_line(30s);
  REQUIRE(line.ok());
  REQUIRE(line->rfind("listening ", 0) == 0);
  laminar::TransportOptions to;
  to.cluster_token = kToken;
  to.operation_timeout = 2s;  // bounds a fail-fast push, which has no timeout of its own
  std::shared_ptr<Transport> tr = Transport::create(to).value();
  auto producer = RemoteProducer::create(tr, line->substr(10)).value();
  REQUIRE(producer->push(laminar::test_remote::make(1)).ok());
  laminar::RemoteProducerOptions watched_options;
  watched_options.stall_timeout = 1s;
  auto watched = RemoteProducer::create(tr, line->substr(10), watched_options).value();

  // Stopped, the server keeps its connection open and answers nothing.
  REQUIRE(server.stop(10s).ok());
  const auto timed = [&](std::uint64_t id, PushOptions o, RemoteProducer* p) {
    const auto start = std::chrono::steady_clock::now();
    laminar::Status st = p->push(laminar::test_remote::make(id), o);
    return std::make_pair(st, std::chrono::steady_clock::now() - start);
  };
  // A timed push waits its timeout plus the slack a round trip is allowed (5 s), no longer.
  const auto [timed_st, timed_took] = timed(2, PushOptions::with_timeout(500ms), producer.get());
  expect_code(timed_st, StatusCode::kDeadlineExceeded, "took longer than");
  CHECK(timed_took >= 500ms);
  CHECK(timed_took < 500ms + 5s + 3s);
  const auto [fast_st, fast_took] = timed(3, PushOptions::fail_fast(), producer.get());
  expect_code(fast_st, StatusCode::kDeadlineExceeded, "took longer than");
  CHECK(fast_took >= 2s);
  CHECK(fast_took < 2s + 3s);
  std::printf("push to a stopped queue server: timeout 500 ms ended after %lld ms, fail-fast after %lld ms\n",
              static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(timed_took).count()),
              static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(fast_took).count()));
  CHECK(producer->credits_free() == producer->credits_granted());

  // A blocking push pings after stall_timeout / 2 and gives up when the ping goes unanswered for
  // stall_timeout; the producer is then done with, as for a vanished server.
  const auto [block_st, block_took] = timed(5, PushOptions{}, watched.get());
  expect_code(block_st, StatusCode::kUnavailable, "answered nothing for 1000 ms");
  CHECK(block_took >= 1s);
  CHECK(block_took < 5s);
  std::printf("blocking push to a stopped queue server: stall_timeout 1000 ms ended after %lld ms\n",
              static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(block_took).count()));
  expect_code(watched->push(laminar::test_remote::make(6)), StatusCode::kUnavailable, "answered nothing");

  // Continued, it serves the first producer again (the pushes that timed out may have landed late).
  server.kill(SIGCONT);
  REQUIRE(producer->push(laminar::test_remote::make(4), PushOptions::with_timeout(10s)).ok());
  server.kill(SIGTERM);
  CHECK(server.wait(10s).value() == 0);
}
#endif
