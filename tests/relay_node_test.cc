// RelayNode in one process (one Transport hosting a node and a queue server; the node's retries and
// its stall timer on a ManualClock, with the test as a quiet upstream or a subscriber that stops
// answering), and the relay chain across real processes (examples/relay_server built with
// laminar_testing's faults, started with laminar_test_support):
// actor + a chain of 4 relays + pullers with every byte checked, a relay killed mid-broadcast, a
// corrupt chunk, a late joiner, a puller whose relay dies mid-pull resuming from another, a relay
// stopped (SIGSTOP) mid-broadcast, and a slow relay that is kept.
#include <catch2/catch.hpp>

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "eventually.h"
#include "expect_line.h"
#include "laminar/relay_node.h"
#include "laminar/remote_trajectory_queue.h"
#include "laminar/trajectory_queue.h"
#include "process.h"
#include "relay_node_wire.h"
#include "relay_test_util.h"
#include "remote_trajectory_protocol.h"
#include "transport/protocol.h"

using namespace std::chrono_literals;
using laminar::testing::ChildOptions;
using laminar::testing::ChildProcess;

namespace {

const std::string kToken = "relay-chain-test-token-0123456789";
constexpr int kMib = 16;
constexpr int kChunkKib = 256;
// relay_server's workload: kMib MiB of tensors plus one small tensor padded to 256 bytes.
constexpr std::uint64_t kChunks = ((std::uint64_t(kMib) << 20) + 256 + (kChunkKib << 10) - 1) / (kChunkKib << 10);

ChildProcess start(std::vector<std::string> args, int mib = kMib) {
  ChildOptions o;
  o.program = LAMINAR_RELAY_SERVER;
  o.args = {"--token", kToken, "--mib", std::to_string(mib), "--chunk-kib", std::to_string(kChunkKib)};
  o.args.insert(o.args.end(), args.begin(), args.end());
  auto child = ChildProcess::spawn(std::move(o));
  INFO(child.status().to_string());
  REQUIRE(child.ok());
  return std::move(*child);
}

std::string expect_line(ChildProcess& child, const std::string& prefix, std::vector<std::string>* seen = nullptr) {
  return laminar::testing::expect_line(child, prefix, 30s, seen);
}

std::string listening(ChildProcess& c) { return expect_line(c, "listening "); }

// Stops a child with SIGTERM and returns its final "stats" line.
std::string stop(ChildProcess& c) {
  c.kill(SIGTERM);
  std::string stats = expect_line(c, "stats ");
  auto code = c.wait(10s);
  REQUIRE(code.ok());
  CHECK(*code == 0);
  return stats;
}

// An actor that has published version 1: its process, the address it listens on and the version's
// digest. `args` are its options beyond those.
struct Actor {
  ChildProcess process;
  std::string addr;
  std::string digest;
};

Actor start_actor(std::vector<std::string> args = {}, int mib = kMib) {
  args.insert(args.begin(), {"--actor", "--versions", "1"});
  ChildProcess process = start(std::move(args), mib);
  std::string addr = listening(process);
  std::string digest = expect_line(process, "published 1 ");
  return {std::move(process), std::move(addr), std::move(digest)};
}

std::string received(std::uint64_t n) { return "received " + std::to_string(n) + " "; }

std::shared_ptr<laminar::Transport> make_transport() {
  laminar::TransportOptions o;
  o.cluster_token = kToken;
  return laminar::Transport::create(o).value();
}

// Events a node reported, for a test thread to wait on.
struct Events {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<laminar::RelayEvent> seen;

  std::function<void(const laminar::RelayEvent&)> callback() {
    return [this](const laminar::RelayEvent& e) {
      std::lock_guard lock(mu);
      seen.push_back(e);
      cv.notify_all();
    };
  }
  std::size_t count(laminar::RelayEvent::Kind kind) {
    std::lock_guard lock(mu);
    return std::size_t(std::count_if(seen.begin(), seen.end(), [&](const auto& e) { return e.kind == kind; }));
  }
  // Waits (up to 30 s) until at least n events of `kind` were reported.
  bool wait_for(laminar::RelayEvent::Kind kind, std::size_t n) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, 30s, [&] {
      return std::size_t(std::count_if(seen.begin(), seen.end(), [&](const auto& e) { return e.kind == kind; })) >= n;
    });
  }
};

}  // namespace

TEST_CASE("one transport hosts a relay node and a queue server; a peer subscribes and pushes over one link",
          "[relay_node][remote]") {
  using laminar::Version;
  // The actor's process: one transport, listening, shared by its relay node and its queue server.
  std::shared_ptr<laminar::Transport> actor_tr = make_transport();
  const std::string addr = actor_tr->listen("127.0.0.1", 0).value();
  laminar::RelayStoreOptions small_chunks;
  small_chunks.chunk_bytes = 4096;
  std::shared_ptr<laminar::RelayStore> actor_store = laminar::RelayStore::create(small_chunks).value();
  auto head = laminar::RelayNode::create(actor_tr, actor_store).value();
  CHECK(head->address() == addr);
  std::shared_ptr<laminar::TrajectoryQueue> queue = laminar::TrajectoryQueue::create(laminar::TrajectoryQueueOptions{}).value();
  auto server = laminar::TrajectoryQueueServer::create(actor_tr, queue).value();
  // A second node cannot take over the same transport's relay protocol.
  CHECK(laminar::RelayNode::create(actor_tr, actor_store).status().code() == laminar::StatusCode::kAlreadyExists);

  // The rollout's process: one transport that does not listen, hosting a leaf node and a producer.
  std::shared_ptr<laminar::Transport> rollout_tr = make_transport();
  std::shared_ptr<laminar::RelayStore> rollout_store = laminar::RelayStore::create({}).value();
  Events events;
  laminar::RelayNodeOptions o;
  o.upstreams = {addr};
  o.on_event = events.callback();
  auto leaf = laminar::RelayNode::create(rollout_tr, rollout_store, o).value();
  CHECK_FALSE(leaf->address());
  auto producer = laminar::RemoteProducer::create(rollout_tr, addr).value();

  laminar::testing::WeightSet w = laminar::testing::WeightSet::make(7, 1);
  REQUIRE(actor_store->publish(Version(1), w.manifest, w.named).ok());
  REQUIRE(rollout_store->wait_for_version(Version(1), 30s).ok());
  auto h = rollout_store->acquire(Version(1)).value();
  for (std::size_t i = 0; i < w.manifest.size(); ++i) {
    CHECK(laminar::testing::first_mismatch(h.tensor(w.manifest.entries()[i].name).value(), 7, 1, i) == -1);
  }
  CHECK(leaf->upstream() == addr);
  REQUIRE(events.wait_for(laminar::RelayEvent::Kind::kCommitted, 1));
  CHECK(events.count(laminar::RelayEvent::Kind::kChunkStored) == h.plan().num_chunks());

  for (std::uint64_t id = 1; id <= 4; ++id) REQUIRE(producer->push(laminar::test_remote::make(id)).ok());
  CHECK(queue->stats().pushed == 4);
  CHECK(server->stats().accepted == 4);
  CHECK(head->stats().subscribers == 1);
  CHECK(head->background_error().ok());
  CHECK(leaf->background_error().ok());
  CHECK_THAT(head->stats().to_json(), Catch::Contains("\"subscribers\":1"));

  // Each part leaves the shared transport to the others when it goes.
  server.reset();
  producer.reset();
  laminar::testing::WeightSet w2 = laminar::testing::WeightSet::make(7, 2);
  REQUIRE(actor_store->publish(Version(2), w2.manifest, w2.named).ok());
  REQUIRE(rollout_store->wait_for_version(Version(2), 30s).ok());
}

TEST_CASE("a node whose upstreams are all down goes round its list again only as its clock moves",
          "[relay_node][clock]") {
  // An address nothing listens on: a transport that listened there and is gone.
  std::string dead;
  {
    std::shared_ptr<laminar::Transport> gone = make_transport();
    dead = gone->listen("127.0.0.1", 0).value();
  }
  auto clock = std::make_shared<laminar::ManualClock>();
  Events events;
  laminar::RelayNodeOptions o;
  o.upstreams = {dead};
  o.retry_interval = std::chrono::seconds(5);
  o.clock = clock;
  o.on_event = events.callback();
  auto node = laminar::RelayNode::create(make_transport(), laminar::RelayStore::create({}).value(), o).value();
  using K = laminar::RelayEvent::Kind;
  REQUIRE(events.wait_for(K::kUpstreamUnreachable, 1));
  // Every further round needs the clock to pass the retry interval: at most one per step.
  for (std::size_t step = 1; step <= 3; ++step) {
    CHECK(events.count(K::kUpstreamUnreachable) == step);
    REQUIRE(clock->advance(std::chrono::seconds(5)).ok());
    REQUIRE(events.wait_for(K::kUpstreamUnreachable, step + 1));
  }
  CHECK(events.count(K::kUpstream) == 0);
  CHECK_FALSE(node->upstream());
  node.reset();  // stops while waiting on a clock that will not move again

  auto bad = [](auto&& edit) {
    laminar::RelayNodeOptions b;
    edit(b);
    return laminar::RelayNode::create(make_transport(), laminar::RelayStore::create({}).value(), b).status().code();
  };
  CHECK(bad([](laminar::RelayNodeOptions& b) { b.window = 0; }) == laminar::StatusCode::kInvalidArgument);
  CHECK(bad([](laminar::RelayNodeOptions& b) { b.connect_timeout = {}; }) == laminar::StatusCode::kInvalidArgument);
  CHECK(bad([](laminar::RelayNodeOptions& b) { b.retry_interval = -1s; }) == laminar::StatusCode::kInvalidArgument);
  CHECK(bad([](laminar::RelayNodeOptions& b) { b.stall_timeout = {}; }) == laminar::StatusCode::kInvalidArgument);
  CHECK(bad([](laminar::RelayNodeOptions& b) { b.stall_timeout = -1s; }) == laminar::StatusCode::kInvalidArgument);
  CHECK(laminar::RelayNode::create(nullptr, laminar::RelayStore::create({}).value()).status().code() ==
        laminar::StatusCode::kInvalidArgument);
  CHECK(laminar::RelayNode::create(make_transport(), nullptr).status().code() == laminar::StatusCode::kInvalidArgument);
}

TEST_CASE("a sender forwards each chunk as it lands, and the node's destruction ends its wait, on clocks that stand "
          "still", "[relay_node][clock]") {
  using laminar::Version;
  // Nothing moves this clock: the head's sender may look up only for chunks, versions and stop.
  auto still = std::make_shared<laminar::ManualClock>();
  laminar::RelayStoreOptions so;
  so.chunk_bytes = 4096;
  so.clock = still;
  std::shared_ptr<laminar::RelayStore> head_store = laminar::RelayStore::create(so).value();
  std::shared_ptr<laminar::Transport> head_tr = make_transport();
  const std::string addr = head_tr->listen("127.0.0.1", 0).value();
  laminar::RelayNodeOptions ho;
  ho.clock = still;
  auto head = laminar::RelayNode::create(head_tr, head_store, ho).value();

  // The leaf waits in real time, so that a chunk that never comes fails the test.
  std::shared_ptr<laminar::RelayStore> leaf_store = laminar::RelayStore::create({}).value();
  Events events;
  laminar::RelayNodeOptions lo;
  lo.upstreams = {addr};
  lo.clock = still;
  lo.on_event = events.callback();
  auto leaf = laminar::RelayNode::create(make_transport(), leaf_store, lo).value();
  REQUIRE(events.wait_for(laminar::RelayEvent::Kind::kUpstream, 1));

  // The head is fed chunk by chunk, as from an upstream of its own.
  laminar::testing::WeightSet w = laminar::testing::WeightSet::make(11, 1);
  laminar::RelayStoreOptions source_options;
  source_options.chunk_bytes = so.chunk_bytes;
  std::shared_ptr<laminar::RelayStore> source = laminar::RelayStore::create(source_options).value();
  REQUIRE(source->publish(Version(1), w.manifest, w.named).ok());
  REQUIRE(source->wait_for_version(Version(1), 30s).ok());
  laminar::ReadHandle whole = source->acquire(Version(1)).value();
  const std::uint32_t n = whole.plan().num_chunks();
  REQUIRE(n >= 3);
  REQUIRE(head_store->begin_version(Version(1), whole.manifest(), whole.plan()).ok());
  REQUIRE(leaf_store->wait_for_newer(std::nullopt, 30s));  // begun below too, before any chunk
  for (std::uint32_t i = 0; i + 1 < n; ++i) {
    REQUIRE(head_store->put_chunk(Version(1), i, whole.chunk(i).value(), whole.checksum(i).value()).ok());
    REQUIRE(leaf_store->read_chunk(Version(1), i, 30s).ok());  // forwarded before the next one lands
  }

  // The head's sender now waits in its store for the last chunk.
  std::future<void> gone = std::async(std::launch::async, [&] { head.reset(); });
  const bool prompt = gone.wait_for(30s) == std::future_status::ready;
  CHECK(prompt);
  // A sender that only the clock could wake: move it, so the failure ends instead of hanging.
  if (!prompt) REQUIRE(laminar::testing::advance_until_ready(*still, gone, 1s, 100));
  CHECK(leaf_store->missing_chunks(Version(1)).value() == std::vector<std::uint32_t>{n - 1});
}

TEST_CASE("relay messages: each decoder takes what its encoder writes and refuses the rest, naming field and offset",
          "[relay_node][bad-input]") {
  namespace in = laminar::internal;
  using laminar::Version;
  const auto refused = [](const laminar::Status& st, const char* needle) {
    INFO(st.to_string());
    CHECK(st.code() == laminar::StatusCode::kDataLoss);
    CHECK_THAT(st.message(), Catch::Contains(needle) && Catch::Contains("at offset"));
  };
  const in::RelaySubscribe sub{Version(5), 2'500'000'000};
  CHECK(in::decode_relay_subscribe(in::encode_relay_subscribe(sub)).value() == sub);
  CHECK(in::decode_relay_subscribe(in::encode_relay_subscribe({})).value() == in::RelaySubscribe{});
  const in::RelayBegin begin{Version(3), 4096, R"({"tensors":[]})"};
  CHECK(in::decode_relay_begin(in::encode_relay_begin(begin)).value() == begin);
  const in::RelayBeginReply reply{{0, 2, 9}, {std::byte{1}, std::byte{2}}};
  CHECK(in::decode_relay_begin_reply(in::encode_relay_begin_reply(reply)).value() == reply);
  const in::RelayChunk chunk{Version(3), 7, 0xfeed};
  CHECK(in::decode_relay_chunk(in::encode_relay_chunk(chunk)).value() == chunk);
  CHECK(in::decode_relay_idle(in::encode_relay_idle({})).value() == in::RelayIdle{});

  std::vector<std::byte> b = in::encode_relay_subscribe(sub);
  b[0] = std::byte{2};
  refused(in::decode_relay_subscribe(b).status(), "has is 2");
  b = in::encode_relay_subscribe({});
  b[1] = std::byte{1};
  refused(in::decode_relay_subscribe(b).status(), "newest is 1 without has");
  b = in::encode_relay_subscribe(sub);
  refused(in::decode_relay_subscribe(std::span(b).first(12)).status(), "idle_every_ns cut short at offset 9");
  refused(in::decode_relay_idle(std::vector<std::byte>(3)).status(), "relay idle message: 3 trailing bytes at offset 0");
  b = in::encode_relay_begin(begin);
  refused(in::decode_relay_begin(std::span(b).first(12)).status(), "chunk_bytes cut short at offset 8");
  b = in::encode_relay_begin_reply(reply);
  refused(in::decode_relay_begin_reply(std::span(b).first(10)).status(), "missing cut short at offset 4");
  b = in::encode_relay_begin_reply({{4, 4}, {}});
  refused(in::decode_relay_begin_reply(b).status(), "missing chunk 4 follows chunk 4; they must ascend at offset 8");
  // A count far beyond the bytes there is refused before anything is allocated for it.
  b = {std::byte{0xff}, std::byte{0xff}, std::byte{0xff}, std::byte{0xff}};
  refused(in::decode_relay_begin_reply(b).status(), "missing cut short at offset 4 (0 of 4294967295 x 4 bytes)");
  b = in::encode_relay_chunk(chunk);
  b.push_back(std::byte{0});
  refused(in::decode_relay_chunk(b).status(), "1 trailing bytes at offset 20");
  refused(in::decode_relay_chunk(std::span(b).first(19)).status(), "checksum cut short at offset 12");
}

TEST_CASE("a relay node answers malformed messages from a peer with kDataLoss and keeps serving",
          "[relay_node][bad-input]") {
  namespace in = laminar::internal;
  std::shared_ptr<laminar::Transport> node_tr = make_transport();
  const std::string addr = node_tr->listen("127.0.0.1", 0).value();
  auto node = laminar::RelayNode::create(node_tr, laminar::RelayStore::create({}).value()).value();
  std::shared_ptr<laminar::Transport> peer_tr = make_transport();
  laminar::Endpoint ep = peer_tr->connect(addr).value();
  const auto send = [&](laminar::MessageType type, std::vector<std::byte> body) {
    return in::request_protocol(ep, laminar::Message{type, std::move(body)}).status();
  };
  const auto refused = [](const laminar::Status& st, const char* needle) {
    INFO(st.to_string());
    CHECK(st.code() == laminar::StatusCode::kDataLoss);
    CHECK_THAT(st.message(), Catch::Contains(needle) && Catch::Contains("at offset"));
  };
  refused(send(in::kRelaySubscribeMessage, {std::byte{1}}), "relay subscribe message: newest cut short");
  refused(send(in::kRelayBeginMessage, std::vector<std::byte>(12)), "relay begin message: chunk_bytes cut short");
  refused(send(in::kRelayChunkMessage, std::vector<std::byte>(21)), "relay chunk message: 1 trailing bytes");
  CHECK(node->background_error().ok());
  CHECK(node->stats().subscribers == 0);
  // A well-formed subscribe on the same link is still served.
  CHECK(send(in::kRelaySubscribeMessage, in::encode_relay_subscribe({})).ok());
  // The node answers before it counts the subscriber.
  CHECK(laminar::testing::eventually([&] { return node->stats().subscribers == 1; }));
}

TEST_CASE("actor, a chain of 4 relays and 2 pullers: every relay and puller gets every byte", "[relay_node]") {
  ChildProcess actor = start({"--actor", "--versions", "2", "--interval-ms", "1500"});
  std::string up = listening(actor);
  std::vector<ChildProcess> relays;
  std::vector<std::string> addrs;
  for (int k = 0; k < 4; ++k) {
    relays.push_back(start({"--upstream", up}));
    up = listening(relays.back());
    addrs.push_back(up);
  }
  ChildProcess p_tail = start({"--pull", "--upstream", addrs[3], "--exit-after-version", "2"});
  ChildProcess p_mid = start({"--pull", "--upstream", addrs[1], "--exit-after-version", "2"});
  const std::string d1 = expect_line(actor, "published 1 ");
  const std::string d2 = expect_line(actor, "published 2 ");
  for (auto& r : relays) {
    // v1 may have been published before this relay subscribed; it then starts at v2.
    std::vector<std::string> seen;
    CHECK(expect_line(r, "committed 2 ", &seen) == d2);
    for (const auto& l : seen) {
      if (l.rfind("committed 1 ", 0) == 0) CHECK(l.substr(12) == d1);
    }
  }
  for (ChildProcess* p : {&p_tail, &p_mid}) {
    CHECK(expect_line(*p, "pulled 2 ") == "ok");
    auto code = p->wait(10s);
    REQUIRE(code.ok());
    CHECK(*code == 0);
  }
  for (auto& r : relays) stop(r);
  stop(actor);
}

TEST_CASE("a relay killed mid-broadcast: the chain re-forms and the version still reaches everyone",
          "[relay_node]") {
  auto [actor, a, digest] = start_actor();
  ChildProcess r1 = start({"--upstream", a});
  const std::string a1 = listening(r1);
  // r2 hangs after storing a third of the version, as a wedged relay would, and is then killed.
  ChildProcess r2 = start({"--upstream", a1, "--stall-after", std::to_string(kChunks / 3)});
  const std::string a2 = listening(r2);
  ChildProcess r3 = start({"--upstream", a2, "--upstream", a1, "--report-chunks"});
  const std::string a3 = listening(r3);
  ChildProcess r4 = start({"--upstream", a3});
  listening(r4);
  CHECK(expect_line(r1, "committed 1 ") == digest);
  CHECK(expect_line(r3, "upstream ") == a2);
  // r3 has every chunk r2 stored before hanging (r2 forwards each one it stores).
  for (std::uint64_t k = 0; k < kChunks / 3; ++k) expect_line(r3, "stored 1 ");
  r2.kill(SIGKILL);
  CHECK(expect_line(r3, "lost ") == a2);
  CHECK(expect_line(r3, "upstream ") == a1);
  CHECK(expect_line(r3, "committed 1 ") == digest);
  CHECK(expect_line(r4, "committed 1 ") == digest);
  // r3 resumed: it stored every chunk exactly once across both upstreams.
  CHECK_THAT(stop(r3), Catch::StartsWith(received(kChunks)) && Catch::EndsWith("failovers 1"));
  stop(r4);
  stop(r1);
  stop(actor);
}

TEST_CASE("a corrupt chunk on the wire is refused, resent, and never served", "[relay_node]") {
  auto [actor, a, digest] = start_actor();
  ChildProcess r1 = start({"--upstream", a, "--corrupt", "1:5"});
  const std::string a1 = listening(r1);
  ChildProcess r2 = start({"--upstream", a1});
  const std::string a2 = listening(r2);
  ChildProcess puller = start({"--pull", "--upstream", a2, "--exit-after-version", "1"});
  CHECK(expect_line(r2, "rejected ") == "1 5");
  CHECK(expect_line(r2, "committed 1 ") == digest);
  CHECK(expect_line(puller, "pulled 1 ") == "ok");
  REQUIRE(puller.wait(10s).ok());
  CHECK_THAT(stop(r1), Catch::Contains("resent 1 "));
  CHECK_THAT(stop(r2), Catch::StartsWith(received(kChunks)));
  stop(actor);
}

TEST_CASE("a relay that joins late gets the newest version", "[relay_node]") {
  ChildProcess actor = start({"--actor", "--versions", "3"});
  const std::string a = listening(actor);
  expect_line(actor, "published 1 ");
  expect_line(actor, "published 2 ");
  const std::string d3 = expect_line(actor, "published 3 ");
  ChildProcess late = start({"--upstream", a, "--exit-after-version", "3"});
  listening(late);
  std::vector<std::string> seen;
  CHECK(expect_line(late, "committed ", &seen) == "3 " + d3);  // its first version is the newest
  CHECK_THAT(expect_line(late, "stats "), Catch::StartsWith(received(kChunks)));
  REQUIRE(late.wait(10s).ok());
  stop(actor);
}

TEST_CASE("a puller whose relay dies mid-pull fails over and resumes from the last verified chunk",
          "[relay_node]") {
  auto [actor, a, digest] = start_actor();
  ChildProcess r1 = start({"--upstream", a});
  const std::string a1 = listening(r1);
  CHECK(expect_line(r1, "committed 1 ") == digest);
  ChildProcess r2 = start({"--upstream", a1, "--stall-after", std::to_string(kChunks / 2)});
  const std::string a2 = listening(r2);
  ChildProcess puller = start({"--pull", "--upstream", a2, "--upstream", a1, "--report-chunks"});
  listening(puller);
  CHECK(expect_line(puller, "upstream ") == a2);
  // The puller holds every chunk r2 stored before hanging; the puller process itself is stopped
  // and continued, then its relay dies.
  for (std::uint64_t k = 0; k < kChunks / 2; ++k) expect_line(puller, "stored 1 ");
  puller.kill(SIGSTOP);
  puller.kill(SIGCONT);
  r2.kill(SIGKILL);
  CHECK(expect_line(puller, "lost ") == a2);
  CHECK(expect_line(puller, "upstream ") == a1);
  CHECK(expect_line(puller, "pulled 1 ") == "ok");
  CHECK_THAT(stop(puller), Catch::StartsWith(received(kChunks)) && Catch::EndsWith("failovers 1"));
  stop(r1);
  stop(actor);
}

namespace {

// The test as a relay's upstream, speaking the protocol itself: it serves `version` of `store`
// chunk by chunk when told to, or says nothing at all.
struct FakeUpstream {
  std::shared_ptr<laminar::Transport> tr = make_transport();
  std::string addr = tr->listen("127.0.0.1", 0).value();
  laminar::ReadHandle h;
  laminar::MemoryRegion local;
  laminar::RemoteRegion remote;
  std::atomic<bool> taken{false};
  std::promise<laminar::Endpoint> subscribed;
  laminar::Endpoint down;

  explicit FakeUpstream(laminar::ReadHandle version) : h(std::move(version)) {
    local = tr->allocate(h.bytes().size()).value();
    std::memcpy(local.data(), h.bytes().data(), h.bytes().size());
    REQUIRE(laminar::internal::on_protocol_message(*tr, laminar::internal::kRelaySubscribeMessage,
                                                   [this](laminar::Incoming in) {
                                                     // Serves one subscription; a second is refused.
                                                     if (taken.exchange(true)) {
                                                       (void)in.from.reply_error(in, laminar::unavailable("taken"));
                                                       return;
                                                     }
                                                     (void)in.from.reply(in, laminar::Message{in.message.type, {}});
                                                     subscribed.set_value(in.from);
                                                   })
                .ok());
  }
  ~FakeUpstream() {
    (void)laminar::internal::on_protocol_message(*tr, laminar::internal::kRelaySubscribeMessage, {});
  }

  // Waits for the node's subscription, then begins the version: the node answers which chunks it lacks.
  std::vector<std::uint32_t> begin() {
    auto f = subscribed.get_future();
    REQUIRE(f.wait_for(30s) == std::future_status::ready);
    down = f.get();
    namespace in = laminar::internal;
    const in::RelayBegin b{h.version(), h.plan().chunk_bytes(), h.manifest().to_json()};
    auto reply = in::request_protocol(down, laminar::Message{in::kRelayBeginMessage, in::encode_relay_begin(b)});
    INFO(reply.status().to_string());
    REQUIRE(reply.ok());
    auto answer = in::decode_relay_begin_reply(reply->body).value();
    remote = laminar::RemoteRegion::deserialize(answer.region).value();
    return answer.missing;
  }

  // Puts chunk i into the node's buffer and asks it to check it, as an upstream relay does.
  laminar::Status send_chunk(std::uint32_t i) {
    namespace in = laminar::internal;
    const std::uint64_t off = h.plan().chunk_offset(i);
    LAMINAR_RETURN_IF_ERROR(down.put(local, off, remote, off, h.plan().chunk_size(i)).get());
    const in::RelayChunk c{h.version(), i, h.checksum(i).value()};
    return in::request_protocol(down, laminar::Message{in::kRelayChunkMessage, in::encode_relay_chunk(c)}).status();
  }

  // An idle message, then a malformed begin: its refusal comes back once the node has handled the
  // idle message too (one peer's messages are handled in order).
  void idle() {
    namespace in = laminar::internal;
    REQUIRE(in::send_protocol(down, laminar::Message{in::kRelayIdleMessage, in::encode_relay_idle({})}).ok());
    auto refused = in::request_protocol(down, laminar::Message{in::kRelayBeginMessage, {}});
    CHECK(refused.status().code() == laminar::StatusCode::kDataLoss);
  }
};

}  // namespace

TEST_CASE("a node fails over from an upstream that goes quiet mid-version, timed on its clock, and resumes",
          "[relay_node][stall][clock]") {
  using laminar::Version;
  using K = laminar::RelayEvent::Kind;
  // The head, which will finish the version, and the same version served by the test.
  std::shared_ptr<laminar::Transport> head_tr = make_transport();
  const std::string head_addr = head_tr->listen("127.0.0.1", 0).value();
  laminar::RelayStoreOptions small_chunks;
  small_chunks.chunk_bytes = 4096;
  std::shared_ptr<laminar::RelayStore> head_store = laminar::RelayStore::create(small_chunks).value();
  auto head = laminar::RelayNode::create(head_tr, head_store).value();
  laminar::testing::WeightSet w = laminar::testing::WeightSet::make(7, 1);
  REQUIRE(head_store->publish(Version(1), w.manifest, w.named).ok());
  REQUIRE(head_store->wait_for_version(Version(1), 30s).ok());
  FakeUpstream fake(head_store->acquire(Version(1)).value());
  const std::uint32_t chunks = fake.h.plan().num_chunks();
  REQUIRE(chunks > 4);

  auto clock = std::make_shared<laminar::ManualClock>();
  constexpr laminar::Duration kStall = 10s;
  Events events;
  laminar::RelayNodeOptions o;
  o.upstreams = {fake.addr, head_addr};
  o.connect_timeout = 30s;  // the node must reach the test first, however loaded the machine
  o.stall_timeout = kStall;
  o.clock = clock;
  o.on_event = events.callback();
  std::shared_ptr<laminar::RelayStore> store = laminar::RelayStore::create({}).value();
  auto node = laminar::RelayNode::create(make_transport(), store, o).value();
  REQUIRE(fake.begin().size() == chunks);

  // Slow but never quiet for stall_timeout: a chunk, or an idle message, just within it each time.
  for (std::uint32_t i = 0; i < 3; ++i) {
    REQUIRE(fake.send_chunk(i).ok());
    REQUIRE(clock->advance(kStall - 1ms).ok());
  }
  fake.idle();
  REQUIRE(clock->advance(kStall - 1ms).ok());
  REQUIRE(fake.send_chunk(3).ok());  // still linked: the node kept its upstream
  CHECK(events.count(K::kUpstreamStalled) == 0);
  CHECK(node->upstream() == fake.addr);

  // Then quiet: once stall_timeout passes on the node's clock, it drops the upstream (closing the
  // link) and resumes from the next, which sends only the chunks still missing.
  REQUIRE(clock->advance(kStall).ok());
  REQUIRE(events.wait_for(K::kUpstreamStalled, 1));
  CHECK(laminar::testing::eventually([&] { return !fake.down.status().ok(); }));
  REQUIRE(store->wait_for_version(Version(1), 30s).ok());
  CHECK(node->upstream() == head_addr);
  auto h = store->acquire(Version(1)).value();
  for (std::size_t i = 0; i < w.manifest.size(); ++i) {
    CHECK(laminar::testing::first_mismatch(h.tensor(w.manifest.entries()[i].name).value(), 7, 1, i) == -1);
  }
  // Each chunk stored once across both upstreams (the last one is counted just after it commits).
  CHECK(laminar::testing::eventually([&] { return node->stats().chunks_received == chunks; }));
  CHECK(laminar::testing::eventually([&] { return head->stats().chunks_sent == chunks - 4; }));
  const laminar::RelayNodeStats st = node->stats();
  CHECK(st.upstream_stalls == 1);
  CHECK(st.failovers == 1);
  {
    std::lock_guard lock(events.mu);
    const auto stalled = std::find_if(events.seen.begin(), events.seen.end(),
                                      [](const auto& e) { return e.kind == K::kUpstreamStalled; });
    CHECK(stalled->upstream == fake.addr);
    CHECK(std::none_of(events.seen.begin(), events.seen.end(),
                       [](const auto& e) { return e.kind == K::kUpstreamLost; }));
  }
  CHECK(node->background_error().ok());
}

TEST_CASE("an upstream drops a subscriber that stops answering; its other subscribers are served meanwhile",
          "[relay_node][stall]") {
  using laminar::Version;
  using K = laminar::RelayEvent::Kind;
  namespace in = laminar::internal;
  std::shared_ptr<laminar::Transport> head_tr = make_transport();
  const std::string head_addr = head_tr->listen("127.0.0.1", 0).value();
  std::shared_ptr<laminar::RelayStore> head_store = laminar::RelayStore::create({}).value();
  Events head_events;
  laminar::RelayNodeOptions ho;
  ho.stall_timeout = 1s;
  ho.on_event = head_events.callback();
  auto head = laminar::RelayNode::create(head_tr, head_store, ho).value();

  // A subscriber that asks for an idle message every 20 ms and never answers a begin.
  std::shared_ptr<laminar::Transport> hung_tr = make_transport();
  std::atomic<int> idles{0};
  std::mutex held_mu;
  std::vector<laminar::Incoming> unanswered;
  REQUIRE(in::on_protocol_message(*hung_tr, in::kRelayIdleMessage, [&](laminar::Incoming) { ++idles; }).ok());
  REQUIRE(in::on_protocol_message(*hung_tr, in::kRelayBeginMessage, [&](laminar::Incoming i) {
            std::lock_guard lock(held_mu);
            unanswered.push_back(std::move(i));
          }).ok());
  laminar::Endpoint hung = hung_tr->connect(head_addr).value();
  const in::RelaySubscribe sub{std::nullopt, std::uint64_t(std::chrono::nanoseconds(20ms).count())};
  const laminar::Message subscribe{in::kRelaySubscribeMessage, in::encode_relay_subscribe(sub)};
  REQUIRE(in::request_protocol(hung, subscribe).ok());
  // Nothing to send: the head says so at the pace asked for.
  REQUIRE(laminar::testing::eventually([&] { return idles.load() >= 3; }));

  std::shared_ptr<laminar::RelayStore> leaf_store = laminar::RelayStore::create({}).value();
  laminar::RelayNodeOptions lo;
  lo.upstreams = {head_addr};
  auto leaf = laminar::RelayNode::create(make_transport(), leaf_store, lo).value();
  laminar::testing::WeightSet w = laminar::testing::WeightSet::make(3, 1, 8);
  REQUIRE(head_store->publish(Version(1), w.manifest, w.named).ok());
  REQUIRE(leaf_store->wait_for_version(Version(1), 30s).ok());
  REQUIRE(head_events.wait_for(K::kSubscriberStalled, 1));
  CHECK(laminar::testing::eventually([&] { return !hung.status().ok(); }));
  CHECK(head->stats().subscribers_stalled == 1);
  CHECK(leaf->stats().upstream_stalls == 0);
  {
    std::lock_guard lock(held_mu);
    CHECK(unanswered.size() == 1);
  }
  CHECK(head->background_error().ok());
  (void)in::on_protocol_message(*hung_tr, in::kRelayIdleMessage, {});
  (void)in::on_protocol_message(*hung_tr, in::kRelayBeginMessage, {});
}

TEST_CASE("a relay stopped (SIGSTOP) mid-broadcast is failed over within stall_timeout; only the relay below it moves",
          "[relay_node][stall]") {
  using Ms = std::chrono::milliseconds;
  constexpr Ms kStall = 1000ms;
  const std::string stall = std::to_string(kStall.count());
  auto [actor, a, digest] = start_actor({"--stall-timeout-ms", "60000"});
  // The middle relay hangs after a third of the version. Its own stall_timeout is long, so it counts
  // itself fed and keeps telling the tail it is waiting: that alone is no reason to leave it.
  ChildProcess mid =
      start({"--upstream", a, "--stall-after", std::to_string(kChunks / 3), "--stall-timeout-ms", "60000"});
  const std::string am = listening(mid);
  ChildProcess tail = start({"--upstream", am, "--upstream", a, "--report-chunks", "--stall-timeout-ms", stall});
  const std::string at = listening(tail);
  ChildProcess puller = start({"--pull", "--upstream", at, "--stall-timeout-ms", stall, "--exit-after-version", "1"});
  listening(puller);
  CHECK(expect_line(tail, "upstream ") == am);
  for (std::uint64_t k = 0; k < kChunks / 3; ++k) expect_line(tail, "stored 1 ");
  // Nothing more for over twice the tail's stall_timeout: no chunk, and no failover either.
  CHECK(tail.read_line(2 * kStall + 500ms).status().code() == laminar::StatusCode::kDeadlineExceeded);

  // Stopped, the middle keeps its connections but says nothing: the tail gives it up.
  mid.kill(SIGSTOP);
  const auto stopped = std::chrono::steady_clock::now();
  CHECK(expect_line(tail, "stalled ") == am);
  const auto stalled_after = std::chrono::duration_cast<Ms>(std::chrono::steady_clock::now() - stopped);
  CHECK(expect_line(tail, "upstream ") == a);
  CHECK(expect_line(tail, "committed 1 ") == digest);
  const auto committed_after = std::chrono::duration_cast<Ms>(std::chrono::steady_clock::now() - stopped);
  std::printf("stopped relay failed over: stall_timeout %lld ms, stalled after %lld ms, committed after %lld ms\n",
              static_cast<long long>(kStall.count()), static_cast<long long>(stalled_after.count()),
              static_cast<long long>(committed_after.count()));
  // The middle's last word came about a quarter of stall_timeout before it stopped (later on a
  // loaded machine): the tail waited for the timeout, it did not leave at once.
  CHECK(stalled_after >= kStall / 2);
  CHECK(stalled_after < kStall + 2000ms);
  // The puller below the tail never lost its upstream: the tail kept telling it it was waiting.
  CHECK(expect_line(puller, "pulled 1 ") == "ok");
  CHECK_THAT(expect_line(puller, "stats "),
             Catch::StartsWith(received(kChunks)) && Catch::EndsWith("stalled 0 dropped 0 failovers 0"));
  REQUIRE(puller.wait(10s).ok());
  // The tail stored every chunk once, across both upstreams.
  CHECK_THAT(stop(tail), Catch::StartsWith(received(kChunks)) && Catch::EndsWith("stalled 1 dropped 0 failovers 1"));
  // Continued, the middle finds its subscriber gone and stops cleanly.
  mid.kill(SIGCONT);
  stop(mid);
  stop(actor);
}

TEST_CASE("a slow upstream that keeps delivering is not failed over, however long the version takes",
          "[relay_node][stall]") {
  using Ms = std::chrono::milliseconds;
  constexpr int kSmallMib = 1;
  constexpr std::uint64_t kSmallChunks =
      ((std::uint64_t(kSmallMib) << 20) + 256 + (kChunkKib << 10) - 1) / (kChunkKib << 10);
  auto [actor, a, digest] = start_actor({}, kSmallMib);
  // Each chunk leaves the middle 400 ms late: the version takes about twice the tail's stall_timeout,
  // but a chunk lands well within it every time.
  ChildProcess mid = start({"--upstream", a, "--delay-chunk-ms", "400"}, kSmallMib);
  const std::string am = listening(mid);
  ChildProcess tail = start({"--upstream", am, "--upstream", a, "--stall-timeout-ms", "1000"}, kSmallMib);
  listening(tail);
  CHECK(expect_line(tail, "upstream ") == am);
  const auto linked = std::chrono::steady_clock::now();
  CHECK(expect_line(tail, "committed 1 ") == digest);
  CHECK(std::chrono::duration_cast<Ms>(std::chrono::steady_clock::now() - linked) > 1000ms);
  CHECK_THAT(stop(tail),
             Catch::StartsWith(received(kSmallChunks)) && Catch::EndsWith("stalled 0 dropped 0 failovers 0"));
  CHECK_THAT(stop(mid), Catch::Contains("dropped 0 "));
  stop(actor);
}
