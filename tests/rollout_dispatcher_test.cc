// RolloutDispatcher and DispatchClient over real transports: each admission rule's gating, requests
// that wait for work, exactly-once completion, claims of migrated samples, and the reissue of what a
// lost worker held, lost by a closed connection, by a lease on a ManualClock, or by a killed process.
#include "laminar/rollout_dispatcher.h"

#include <csignal>
#include <cstdio>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <limits>
#include <span>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "eventually.h"
#include "expect_code.h"
#include "make_transport.h"
#include "process.h"
#include "rollout_dispatch_wire.h"
#include "transport/protocol.h"

using laminar::AdmissionRule;
using laminar::DispatchClient;
using laminar::Grant;
using laminar::GrantKind;
using laminar::RolloutDispatcher;
using laminar::RolloutDispatcherOptions;
using laminar::Sample;
using laminar::StatusCode;
using laminar::TrajectoryId;
using laminar::Transport;
using laminar::Version;
using laminar::WorkerState;
using laminar::WorkerId;
using laminar::testing::eventually;
using laminar::testing::expect_code;
using laminar::testing::make_transport;
using namespace std::chrono_literals;

namespace {

const char* kToken = "rollout-dispatcher-test-token-0123456";

// A rollout worker: its own transport (so closing it is a real connection closing) and client.
struct Worker {
  std::shared_ptr<Transport> transport;
  std::unique_ptr<DispatchClient> client;
  std::vector<TrajectoryId> held;

  // Asks for `slots` more, holding what it took before; keeps what it gets.
  Grant ask(Version v, std::uint32_t slots) {
    laminar::Result<Grant> g = client->request({.version = v, .free_slots = slots, .held = held});
    INFO(g.status().to_string());
    REQUIRE(g.ok());
    for (const Sample& s : g->samples) held.push_back(s.id);
    return std::move(g).value();
  }
};

// The actor's transport and server, and workers connecting to it.
struct Actor {
  std::shared_ptr<Transport> transport = make_transport(kToken);
  std::string addr = transport->listen("127.0.0.1", 0).value();
  std::unique_ptr<RolloutDispatcher> dispatcher;

  explicit Actor(RolloutDispatcherOptions o) {
    auto s = RolloutDispatcher::create(transport, std::move(o));
    REQUIRE(s.ok());
    dispatcher = std::move(s).value();
  }
  Worker worker(std::uint32_t id, std::function<void()> on_answer = nullptr) {
    Worker w{make_transport(kToken), nullptr, {}};
    auto c = DispatchClient::create(w.transport,
                                    {.worker = WorkerId(id), .server = addr, .on_answer = std::move(on_answer)});
    REQUIRE(c.ok());
    w.client = std::move(c).value();
    return w;
  }
  // Completes every id once, checking none was completed before.
  void complete(const std::vector<Sample>& samples) {
    for (const Sample& s : samples) {
      laminar::Result<laminar::Completion> c = dispatcher->completed(s.id);
      REQUIRE(c.ok());
      CHECK_FALSE(c->duplicate);
    }
  }
};

std::set<std::uint64_t> ids_of(const std::vector<Sample>& samples) {
  std::set<std::uint64_t> out;
  for (const Sample& s : samples) out.insert(s.id.value());
  return out;
}

// Every sample is sample s of prompt p with id p * G + s.
void check_numbering(const std::vector<Sample>& samples, std::uint32_t group_size) {
  for (const Sample& s : samples) {
    CHECK(s.sample_index < group_size);
    CHECK(s.id.value() == s.prompt_index * group_size + s.sample_index);
  }
}

}  // namespace

TEST_CASE("rollout dispatcher: the wire refuses truncated, trailing and out-of-bound bodies", "[rollout_dispatcher]") {
  namespace in = laminar::internal;
  const in::DispatchRequestMessage q{WorkerId(3),
                                     {Version(9), 5, {TrajectoryId(1), TrajectoryId(77)}, 2s, true, {TrajectoryId(4)}}};
  const std::vector<std::byte> qb = in::encode_dispatch_request(q);
  REQUIRE(qb.size() == 29 + 16 + 4 + 8);
  auto back = in::decode_dispatch_request(qb, 2);
  REQUIRE(back.ok());
  CHECK(*back == q);
  expect_code(in::decode_dispatch_request(qb, 1).status(), StatusCode::kInvalidArgument, "held count is 2");
  in::DispatchRequestMessage many_back = q;
  many_back.request.returned.assign(3, TrajectoryId(5));
  expect_code(in::decode_dispatch_request(in::encode_dispatch_request(many_back), 2).status(),
              StatusCode::kInvalidArgument, "returned count is 3");
  Grant g{GrantKind::kWork, Version(0), {{TrajectoryId(13), 3, 1, 42, "prompt"}, {TrajectoryId(14), 3, 2, 43, ""}},
          {TrajectoryId(5)}, Version(4), true};
  const std::vector<std::byte> gb = in::encode_grant(g);
  REQUIRE(gb.size() == 22 + 2 * 32 + 6 + 4 + 8);
  auto gback = in::decode_grant(gb, 2, 1, 6);
  REQUIRE(gback.ok());
  CHECK(*gback == g);
  expect_code(in::decode_grant(gb, 1, 1, 6).status(), StatusCode::kInvalidArgument, "sample count is 2");
  expect_code(in::decode_grant(gb, 2, 1, 5).status(), StatusCode::kDataLoss, "exceeds the limit of 5 bytes");
  for (const std::vector<std::byte>* body : {&qb, &gb}) {
    for (std::size_t n = 0; n < body->size(); ++n) {
      const std::span<const std::byte> prefix = std::span(*body).first(n);
      const laminar::Status st = body == &qb ? in::decode_dispatch_request(prefix, 2).status()
                                             : in::decode_grant(prefix, 2, 1, 6).status();
      INFO("prefix of " << n << " bytes: " << st.to_string());
      CHECK(st.code() == StatusCode::kDataLoss);
    }
    std::vector<std::byte> longer = *body;
    longer.push_back(std::byte{0});
    const laminar::Status st = body == &qb ? in::decode_dispatch_request(longer, 2).status()
                                           : in::decode_grant(longer, 2, 1, 6).status();
    expect_code(st, StatusCode::kDataLoss, "trailing bytes");
  }
  std::vector<std::byte> bad_kind = gb;
  bad_kind[0] = std::byte{7};
  expect_code(in::decode_grant(bad_kind, 2, 1, 6).status(), StatusCode::kInvalidArgument, "kind 7");
  std::vector<std::byte> bad_flag = gb;
  bad_flag[1] = std::byte{2};
  expect_code(in::decode_grant(bad_flag, 2, 1, 6).status(), StatusCode::kInvalidArgument, "interrupt flag 2");
  g.kind = GrantKind::kNothing;
  expect_code(in::decode_grant(in::encode_grant(g), 2, 1, 6).status(), StatusCode::kInvalidArgument,
              "kind 2 with 2 samples");
  std::vector<std::byte> bad_pull = qb;
  bad_pull[24] = std::byte{3};
  expect_code(in::decode_dispatch_request(bad_pull, 2).status(), StatusCode::kInvalidArgument, "idle_pull flag 3");
  in::DispatchRequestMessage negative = q;
  negative.request.wait = -1ns;
  expect_code(in::decode_dispatch_request(in::encode_dispatch_request(negative), 2).status(),
              StatusCode::kInvalidArgument, "wait -1 ns");
  std::vector<std::byte> lying = qb;
  lying[25] = std::byte{4};  // four held ids announced, two there
  expect_code(in::decode_dispatch_request(lying, 8).status(), StatusCode::kDataLoss, "cut short");
}

TEST_CASE("rollout dispatcher: sync hands out exactly B groups at v, whole groups first, and nothing to an older worker",
          "[rollout_dispatcher]") {
  constexpr std::uint32_t kG = 4;
  Actor actor({.group_size = kG, .seed = 11, .first_prompt = 100});
  REQUIRE(actor.dispatcher->publish(Version(2)).ok());
  laminar::Result<std::uint64_t> first = actor.dispatcher->open(Version(2), Version(2), 3);
  REQUIRE(first.ok());
  CHECK(*first == 100);
  Worker old = actor.worker(1);
  Worker a = actor.worker(2);
  Worker b = actor.worker(3);

  const Grant stale = old.ask(Version(1), 8);
  CHECK(stale.kind == GrantKind::kPullNewer);
  CHECK(stale.pull_version == Version(2));
  // A worker on newer weights than the window's gets nothing.
  CHECK(old.ask(Version(3), 8).kind == GrantKind::kNothing);
  // 6 slots take one whole group, not a group and a half.
  const Grant g1 = a.ask(Version(2), 6);
  REQUIRE(g1.kind == GrantKind::kWork);
  CHECK(g1.samples.size() == kG);
  // 3 slots fit no whole group: part of the oldest.
  const Grant g2 = b.ask(Version(2), 3);
  CHECK(g2.samples.size() == 3);
  // The rest of that group and the last one.
  const Grant g3 = a.ask(Version(2), 5);
  CHECK(g3.samples.size() == 5);
  CHECK(a.ask(Version(2), 8).kind == GrantKind::kNothing);
  // With nothing left to hand out there is nothing to pull for either.
  CHECK(old.ask(Version(1), 8).kind == GrantKind::kNothing);

  std::vector<Sample> all = g1.samples;
  all.insert(all.end(), g2.samples.begin(), g2.samples.end());
  all.insert(all.end(), g3.samples.begin(), g3.samples.end());
  check_numbering(all, kG);
  std::set<std::uint64_t> prompts;
  std::set<std::uint64_t> seeds;
  for (const Sample& s : all) {
    prompts.insert(s.prompt_index);
    seeds.insert(s.seed);
  }
  CHECK(ids_of(all).size() == 3 * kG);
  CHECK(prompts == std::set<std::uint64_t>{100, 101, 102});
  CHECK(seeds.size() == 3 * kG);
  for (const Sample& s : g1.samples) CHECK(s.prompt_index == 100);

  CHECK(actor.dispatcher->wait_done(1, 0ns).code() == StatusCode::kDeadlineExceeded);
  actor.complete(all);
  CHECK(actor.dispatcher->wait_done(3, 0ns).ok());
  CHECK(actor.dispatcher->wait_done(4, 0ns).code() == StatusCode::kDeadlineExceeded);
  const laminar::RolloutDispatcherStats st = actor.dispatcher->stats();
  CHECK(st.groups_made == 3);
  CHECK(st.groups_done == 3);
  CHECK(st.handed_out == 3 * kG);
  CHECK(st.completed == 3 * kG);
  CHECK(st.in_flight == 0);
  CHECK(st.reissued == 0);
  CHECK(st.workers == 3);
  CHECK_THAT(st.to_json(), Catch::Contains("\"groups_done\":3"));
  CHECK(actor.dispatcher->background_error().ok());

  // The same options deal the same samples: ids and seeds depend on nothing else.
  Actor again({.group_size = kG, .seed = 11, .first_prompt = 100});
  REQUIRE(again.dispatcher->open(Version(0), Version(0), 3).ok());
  Worker c = again.worker(1);
  const Grant same = c.ask(Version(0), 12);
  std::map<std::uint64_t, std::uint64_t> seed_of;
  for (const Sample& s : all) seed_of[s.id.value()] = s.seed;
  REQUIRE(same.samples.size() == 3 * kG);
  for (const Sample& s : same.samples) CHECK(seed_of.at(s.id.value()) == s.seed);
}

TEST_CASE("rollout dispatcher: one-step opens the next batch for the weights being trained on", "[rollout_dispatcher]") {
  constexpr std::uint32_t kG = 2;
  constexpr std::uint64_t kB = 2;
  Actor actor({.group_size = kG, .seed = 5});
  Worker w0 = actor.worker(1);
  Worker w1 = actor.worker(2);
  REQUIRE(actor.dispatcher->open(Version(0), laminar::kAnyNewerVersion, kB).ok());
  const Grant batch0 = w0.ask(Version(0), 8);
  REQUIRE(batch0.samples.size() == kB * kG);
  actor.complete(batch0.samples);
  w0.held.clear();
  REQUIRE(actor.dispatcher->wait_done(kB, 0ns).ok());
  // The trainer trains on batch 0 (towards version 1) while batch 1 is generated with version 0.
  REQUIRE(actor.dispatcher->open(Version(0), laminar::kAnyNewerVersion, kB).ok());
  const Grant part = w0.ask(Version(0), 2);
  REQUIRE(part.samples.size() == kG);
  CHECK(part.samples[0].prompt_index == 2);
  // Version 1 is published: what is left of batch 1 goes to the newer weights too.
  REQUIRE(actor.dispatcher->publish(Version(1)).ok());
  const Grant rest = w1.ask(Version(1), 8);
  REQUIRE(rest.samples.size() == kG);
  CHECK(rest.samples[0].prompt_index == 3);
  actor.complete(part.samples);
  actor.complete(rest.samples);
  w0.held.clear();
  REQUIRE(actor.dispatcher->wait_done(2 * kB, 0ns).ok());
  // Batch 2 is for version 1, generated while the trainer trains on batch 1.
  REQUIRE(actor.dispatcher->open(Version(1), laminar::kAnyNewerVersion, kB).ok());
  const Grant behind = w0.ask(Version(0), 8);
  CHECK(behind.kind == GrantKind::kPullNewer);
  CHECK(behind.pull_version == Version(1));
  const Grant batch2 = w1.ask(Version(1), 8);
  CHECK(batch2.samples.size() == kB * kG);
  std::set<std::uint64_t> p2;
  for (const Sample& s : batch2.samples) p2.insert(s.prompt_index);
  CHECK(p2 == std::set<std::uint64_t>{4, 5});
  CHECK(actor.dispatcher->stats().groups_made == 3 * kB);
}

TEST_CASE("rollout dispatcher: the laminar stream bounds staleness and samples in flight", "[rollout_dispatcher]") {
  constexpr std::uint32_t kG = 2;
  Actor actor({.group_size = kG, .seed = 3});
  expect_code(actor.dispatcher->set_rule(AdmissionRule::stream(1, 1)), StatusCode::kInvalidArgument,
              "below one group");
  REQUIRE(actor.dispatcher->publish(Version(5)).ok());
  REQUIRE(actor.dispatcher->set_rule(AdmissionRule::stream(1, 6)).ok());
  Worker stale = actor.worker(1);
  Worker a = actor.worker(2);
  Worker b = actor.worker(3);

  const Grant too_old = stale.ask(Version(3), 4);
  CHECK(too_old.kind == GrantKind::kPullNewer);
  CHECK(too_old.pull_version == Version(4));
  // One version behind is within the bound; the in-flight bound stops it at 6 samples.
  const Grant ga = a.ask(Version(4), 10);
  REQUIRE(ga.kind == GrantKind::kWork);
  CHECK(ga.samples.size() == 6);
  check_numbering(ga.samples, kG);
  CHECK(b.ask(Version(5), 10).kind == GrantKind::kNothing);
  CHECK(actor.dispatcher->stats().in_flight == 6);
  // A group's completion makes room for one more.
  actor.complete({ga.samples[0], ga.samples[1]});
  const Grant gb = b.ask(Version(5), 10);
  CHECK(gb.samples.size() == kG);
  CHECK(gb.samples[0].prompt_index == 3);
  // Newer weights published: version 4 falls out of the bound, 5 stays in.
  REQUIRE(actor.dispatcher->publish(Version(6)).ok());
  expect_code(actor.dispatcher->publish(Version(5)), StatusCode::kInvalidArgument, "older than the newest");
  actor.complete(gb.samples);
  const Grant behind = a.ask(Version(4), 10);
  CHECK(behind.kind == GrantKind::kPullNewer);
  CHECK(behind.pull_version == Version(5));
  CHECK(b.ask(Version(5), 10).samples.size() == kG);
  CHECK(actor.dispatcher->stats().in_flight == 6);
  // Stopped: no group more, however much room.
  actor.dispatcher->set_rule(AdmissionRule::sync()).ok();
  actor.complete({ga.samples.begin() + 2, ga.samples.end()});
  // Asked without blocking, as a decode loop does.
  laminar::PendingGrant pending = b.client->request_async({.version = Version(6), .free_slots = 10, .held = b.held});
  REQUIRE(eventually([&] { return pending.ready(); }));
  laminar::Result<Grant> none = pending.get();
  REQUIRE(none.ok());
  CHECK(none->kind == GrantKind::kNothing);
  CHECK(pending.get().status().code() == StatusCode::kFailedPrecondition);
  CHECK(actor.dispatcher->stats().groups_made == 5);
}

TEST_CASE("rollout dispatcher: on_available hears what a request on the newest weights could take, as it changes",
          "[rollout_dispatcher]") {
  constexpr std::uint32_t kG = 2;
  std::mutex mu;
  std::vector<std::uint64_t> heard;
  auto heard_now = [&] {
    std::lock_guard l(mu);
    return heard;
  };
  Actor actor({.group_size = kG, .seed = 3, .on_available = [&](std::uint64_t n) {
                 std::lock_guard l(mu);
                 heard.push_back(n);
               }});
  REQUIRE(actor.dispatcher->publish(Version(5)).ok());
  CHECK(heard_now() == std::vector<std::uint64_t>{0});
  // The stream's room is what may be handed out, though no group of it is made yet.
  REQUIRE(actor.dispatcher->set_rule(AdmissionRule::stream(1, 6)).ok());
  CHECK(actor.dispatcher->stats().available == 6);
  CHECK(actor.dispatcher->stats().groups_made == 0);
  Worker a = actor.worker(1);
  const Grant ga = a.ask(Version(5), 4);
  REQUIRE(ga.samples.size() == 4);
  CHECK(heard_now() == std::vector<std::uint64_t>{0, 6, 2});
  // A batch group for the newest weights takes the stream's last room: 2 all the same, unheard.
  REQUIRE(actor.dispatcher->open(Version(5), Version(5), 1).ok());
  // One for older weights only is not counted.
  REQUIRE(actor.dispatcher->open(Version(4), Version(4), 1).ok());
  CHECK(actor.dispatcher->stats().waiting == 4);
  CHECK(actor.dispatcher->stats().available == 2);
  CHECK(heard_now() == std::vector<std::uint64_t>{0, 6, 2});
  // Completions make room for one more stream group once two samples are done.
  actor.complete(ga.samples);
  CHECK(heard_now() == std::vector<std::uint64_t>{0, 6, 2, 4});
  actor.dispatcher->set_rule(AdmissionRule::sync()).ok();
  CHECK(heard_now() == std::vector<std::uint64_t>{0, 6, 2, 4, 2});
  CHECK_THAT(actor.dispatcher->stats().to_json(), Catch::Contains(R"("available":2})"));
}

TEST_CASE("rollout dispatcher: every sample completes exactly once under duplicate completions", "[rollout_dispatcher]") {
  const unsigned seed = std::random_device{}();
  std::printf("rollout dispatcher duplicates seed %u\n", seed);
  std::mt19937 rng(seed);
  constexpr std::uint32_t kG = 3;
  Actor actor({.group_size = kG, .seed = 9});
  REQUIRE(actor.dispatcher->open(Version(0), Version(0), 4).ok());
  Worker a = actor.worker(1);
  Worker b = actor.worker(2);
  const Grant ga = a.ask(Version(0), 12);
  REQUIRE(ga.samples.size() == 12);
  // Each id completed one to three times, in a random order.
  std::vector<TrajectoryId> completions;
  for (const Sample& s : ga.samples) {
    for (unsigned k = 0; k <= rng() % 3; ++k) completions.push_back(s.id);
  }
  std::shuffle(completions.begin(), completions.end(), rng);
  std::uint64_t duplicates = 0;
  std::uint64_t groups_done = 0;
  std::set<std::uint64_t> done;
  // Completes, in `completions` order, the ids of one parity.
  auto complete = [&](std::uint64_t parity) {
    for (TrajectoryId id : completions) {
      if (id.value() % 2 != parity) continue;
      laminar::Result<laminar::Completion> c = actor.dispatcher->completed(id);
      REQUIRE(c.ok());
      CHECK(c->duplicate == (done.count(id.value()) != 0));
      duplicates += c->duplicate ? 1 : 0;
      groups_done += c->group_done ? 1 : 0;
      done.insert(id.value());
    }
  };
  // Only the even ids for now: the rest stay with the worker when it goes.
  complete(0);
  // A worker still decoding a completed sample hears it may drop it.
  const std::vector<TrajectoryId> held = a.held;
  laminar::Result<Grant> g = a.client->request({.version = Version(0), .free_slots = 0, .held = held});
  REQUIRE(g.ok());
  std::set<std::uint64_t> dropped;
  for (TrajectoryId id : g->drop) dropped.insert(id.value());
  CHECK(dropped == done);
  // The worker goes: only its samples not completed come back, and never a completed one.
  a.client->close();
  REQUIRE(eventually([&] { return actor.dispatcher->stats().lost_workers == 1; }));
  const Grant gb = b.ask(Version(0), 12);
  for (const Sample& s : gb.samples) CHECK(done.count(s.id.value()) == 0);
  CHECK(gb.samples.size() == 12 - done.size());
  complete(1);  // then the odd ids, which b now holds
  CHECK(done.size() == 12);
  CHECK(groups_done == 4);
  // A group done is forgotten, and its ids still count as duplicates.
  laminar::Result<laminar::Completion> late = actor.dispatcher->completed(ga.samples[0].id);
  REQUIRE(late.ok());
  CHECK(late->duplicate);
  ++duplicates;
  expect_code(actor.dispatcher->completed(TrajectoryId(12 * kG)).status(), StatusCode::kNotFound, "of no group made");
  const laminar::RolloutDispatcherStats st = actor.dispatcher->stats();
  CHECK(st.completed == 12);
  CHECK(st.duplicates == duplicates);
  CHECK(st.groups_done == 4);
  CHECK(st.in_flight == 0);
  CHECK(b.ask(Version(0), 12).kind == GrantKind::kNothing);
}

TEST_CASE("rollout dispatcher: a held id claimed by another worker is not reissued when its first worker goes",
          "[rollout_dispatcher]") {
  constexpr std::uint32_t kG = 4;
  Actor actor({.group_size = kG, .seed = 2});
  REQUIRE(actor.dispatcher->open(Version(0), Version(0), 1).ok());
  Worker a = actor.worker(1);
  Worker b = actor.worker(2);
  Worker c = actor.worker(3);
  const Grant ga = a.ask(Version(0), 4);
  REQUIRE(ga.samples.size() == 4);
  // Sample 1 migrates from a to b: b claims it first, then a stops listing it.
  b.held = {ga.samples[1].id};
  CHECK(b.ask(Version(0), 0).kind == GrantKind::kNothing);
  CHECK(actor.dispatcher->stats().claimed == 1);
  a.held.erase(a.held.begin() + 1);
  (void)a.ask(Version(0), 0);
  a.transport.reset();
  a.client.reset();
  REQUIRE(eventually([&] { return actor.dispatcher->stats().lost_workers == 1; }));
  const Grant gc = c.ask(Version(0), 8);
  CHECK(ids_of(gc.samples) == ids_of({ga.samples[0], ga.samples[2], ga.samples[3]}));
  // Handed out again as the same samples: same ids, same seeds.
  for (const Sample& s : gc.samples) {
    CHECK(std::find(ga.samples.begin(), ga.samples.end(), s) != ga.samples.end());
  }
  CHECK(actor.dispatcher->stats().reissued == 3);
  // b goes too: its claim comes back.
  b.client->close();
  REQUIRE(eventually([&] { return actor.dispatcher->stats().lost_workers == 2; }));
  const Grant again = c.ask(Version(0), 8);
  REQUIRE(again.samples.size() == 1);
  CHECK(again.samples[0] == ga.samples[1]);
  actor.complete(ga.samples);
  CHECK(actor.dispatcher->stats().groups_done == 1);
}

TEST_CASE("rollout dispatcher: a worker whose connection closes has its samples handed to another", "[rollout_dispatcher]") {
  constexpr std::uint32_t kG = 4;
  Actor actor({.group_size = kG, .seed = 4});
  REQUIRE(actor.dispatcher->open(Version(0), Version(0), 3).ok());
  Worker a = actor.worker(1);
  Worker b = actor.worker(2);
  const Grant ga = a.ask(Version(0), 8);
  REQUIRE(ga.samples.size() == 8);
  const Grant gb = b.ask(Version(0), 8);
  REQUIRE(gb.samples.size() == 4);
  actor.complete({gb.samples.begin(), gb.samples.begin() + 2});
  // The whole process of a goes: its transport and every connection with it.
  a.client.reset();
  a.transport.reset();
  REQUIRE(eventually([&] { return actor.dispatcher->stats().lost_workers == 1; }));
  CHECK(actor.dispatcher->stats().workers == 1);
  CHECK(actor.dispatcher->stats().waiting == 8);
  b.held.erase(b.held.begin(), b.held.begin() + 2);
  const Grant again = b.ask(Version(0), 8);
  REQUIRE(again.samples.size() == 8);
  std::vector<Sample> want = ga.samples;
  std::vector<Sample> got = again.samples;
  auto by_id = [](const Sample& x, const Sample& y) { return x.id < y.id; };
  std::sort(want.begin(), want.end(), by_id);
  std::sort(got.begin(), got.end(), by_id);
  CHECK(got == want);
  actor.complete(again.samples);
  actor.complete({gb.samples.begin() + 2, gb.samples.end()});
  const laminar::RolloutDispatcherStats st = actor.dispatcher->stats();
  CHECK(st.groups_done == 3);
  CHECK(st.completed == 12);
  CHECK(st.duplicates == 0);
  CHECK(st.reissued == 8);
}

TEST_CASE("rollout dispatcher: a silent worker and an unclaimed sample lose their lease on the server's clock",
          "[rollout_dispatcher]") {
  auto clock = std::make_shared<laminar::ManualClock>();
  constexpr std::uint32_t kG = 2;
  Actor actor({.group_size = kG, .seed = 6, .lease = 10s, .clock = clock});
  REQUIRE(actor.dispatcher->open(Version(0), Version(0), 2).ok());
  Worker a = actor.worker(1);
  Worker b = actor.worker(2);
  Worker c = actor.worker(3);
  const Grant ga = a.ask(Version(0), 2);
  const Grant gb = b.ask(Version(0), 2);
  REQUIRE(ga.samples.size() == 2);
  REQUIRE(gb.samples.size() == 2);
  // b keeps asking and lets one sample go unlisted (it went nowhere: no completion, no claim).
  b.held = {gb.samples[0].id};
  REQUIRE(clock->advance(6s).ok());
  (void)b.ask(Version(0), 0);
  REQUIRE(clock->advance(4s).ok());
  // Exactly one lease since a asked: not lost yet (a request sweeps before it is served).
  CHECK(c.ask(Version(0), 4).kind == GrantKind::kNothing);
  CHECK(actor.dispatcher->stats().lost_workers == 0);
  REQUIRE(clock->advance(1ns).ok());
  REQUIRE(eventually([&] { return actor.dispatcher->stats().lost_workers == 1; }));
  (void)b.ask(Version(0), 0);
  const Grant gc = c.ask(Version(0), 4);
  CHECK(ids_of(gc.samples) == ids_of(ga.samples));
  // b's unlisted sample comes back one lease after b stopped listing it; b itself stays.
  REQUIRE(clock->advance(6s).ok());
  (void)b.ask(Version(0), 0);
  REQUIRE(eventually([&] { return actor.dispatcher->stats().waiting == 1; }));
  const Grant gc2 = c.ask(Version(0), 4);
  REQUIRE(gc2.samples.size() == 1);
  CHECK(gc2.samples[0] == gb.samples[1]);
  CHECK(actor.dispatcher->stats().lost_workers == 1);
  CHECK(actor.dispatcher->stats().reissued == 3);
}

TEST_CASE("rollout dispatcher: malformed and invalid requests are refused and the server keeps serving",
          "[rollout_dispatcher]") {
  constexpr std::uint32_t kG = 2;
  Actor actor({.group_size = kG, .seed = 1, .max_workers = 2, .max_held = 8});
  REQUIRE(actor.dispatcher->open(Version(0), Version(0), 2).ok());
  std::shared_ptr<Transport> raw_tr = make_transport(kToken);
  laminar::Endpoint raw = raw_tr->connect(actor.addr).value();
  auto send = [&](std::vector<std::byte> body) {
    return laminar::internal::request_protocol(raw, {laminar::internal::kDispatchRequestMessage, std::move(body)})
        .status();
  };
  auto request = [&](WorkerId w, Version v, std::uint32_t slots, std::vector<TrajectoryId> held) {
    return send(laminar::internal::encode_dispatch_request({w, {v, slots, std::move(held)}}));
  };
  expect_code(send({}), StatusCode::kDataLoss, "worker cut short");
  std::vector<std::byte> longer = laminar::internal::encode_dispatch_request({WorkerId(1), {Version(0), 1, {}}});
  longer.resize(longer.size() + 3, std::byte{0x5a});
  expect_code(send(longer), StatusCode::kDataLoss, "3 trailing bytes");
  std::vector<std::byte> lying = laminar::internal::encode_dispatch_request({WorkerId(1), {Version(0), 1, {}}});
  lying[25] = std::byte{4};  // four held ids announced, none there
  expect_code(send(lying), StatusCode::kDataLoss, "cut short");
  expect_code(request(WorkerId(1), Version(0), 1, std::vector<TrajectoryId>(9, TrajectoryId(0))),
              StatusCode::kInvalidArgument, "held count is 9, above 8");
  expect_code(request(WorkerId(1), Version(0), 7, {TrajectoryId(0), TrajectoryId(1)}),
              StatusCode::kInvalidArgument, "above max_held 8");
  expect_code(request(WorkerId(1), Version(0), 1, {TrajectoryId(4)}), StatusCode::kInvalidArgument,
              "of no group made");
  CHECK(actor.dispatcher->stats().refused == 6);
  CHECK(actor.dispatcher->stats().workers == 0);

  // The refusals changed nothing: two workers fill the server, a third is refused.
  Worker a = actor.worker(1);
  Worker b = actor.worker(2);
  CHECK(a.ask(Version(0), 2).samples.size() == kG);
  CHECK(b.ask(Version(0), 2).samples.size() == kG);
  Worker c = actor.worker(3);
  expect_code(c.client->request({.version = Version(0), .free_slots = 2, .held = {}}).status(), StatusCode::kResourceExhausted, "max_workers 2");
  // Worker 1's id on another connection: its process started again, and what it held comes back.
  laminar::Result<laminar::Message> restarted = laminar::internal::request_protocol(
      raw, {laminar::internal::kDispatchRequestMessage,
            laminar::internal::encode_dispatch_request({WorkerId(1), {Version(0), 2, {}}})});
  REQUIRE(restarted.ok());
  laminar::Result<Grant> rg = laminar::internal::decode_grant(restarted->body, 2, 0, 0);
  REQUIRE(rg.ok());
  CHECK(ids_of(rg->samples) == std::set<std::uint64_t>{a.held[0].value(), a.held[1].value()});
  // That connection now serves worker 1: another id on it is refused, and worker 2 keeps its samples.
  expect_code(request(WorkerId(2), Version(0), 1, {}), StatusCode::kInvalidArgument,
              "worker 2 asks on the connection of worker 1");
  const laminar::RolloutDispatcherStats st = actor.dispatcher->stats();
  CHECK(st.lost_workers == 1);
  CHECK(st.reissued == kG);
  CHECK(st.handed_out == 3 * kG);
  CHECK(st.refused == 8);
  CHECK(st.workers == 2);
  CHECK(actor.dispatcher->background_error().ok());

  // Entry points check their arguments.
  expect_code(RolloutDispatcher::create(nullptr, {.group_size = 1}).status(), StatusCode::kInvalidArgument,
              "transport is null");
  expect_code(RolloutDispatcher::create(actor.transport, {.group_size = 0}).status(), StatusCode::kInvalidArgument,
              "group_size 0");
  expect_code(RolloutDispatcher::create(actor.transport, {.group_size = 1, .lease = 0s}).status(),
              StatusCode::kInvalidArgument, "lease");
  expect_code(RolloutDispatcher::create(actor.transport, {.group_size = 1}).status(), StatusCode::kAlreadyExists,
              "another one serves");
  expect_code(actor.dispatcher->open(Version(0), Version(0), 0).status(), StatusCode::kInvalidArgument, "0 groups");
  expect_code(actor.dispatcher->open(Version(2), Version(1), 1).status(), StatusCode::kInvalidArgument, "[2, 1]");
  expect_code(actor.dispatcher->wait_done(1, -1s), StatusCode::kInvalidArgument, "timeout");
  Actor small({.group_size = 2, .max_open_groups = 3});
  REQUIRE(small.dispatcher->open(Version(0), Version(0), 3).ok());
  expect_code(small.dispatcher->open(Version(0), Version(0), 1).status(), StatusCode::kResourceExhausted,
              "max_open_groups 3");
  expect_code(DispatchClient::create(nullptr, {.worker = WorkerId(1), .server = actor.addr}).status(),
              StatusCode::kInvalidArgument, "transport is null");
  expect_code(DispatchClient::create(raw_tr, {.worker = WorkerId(1), .server = actor.addr, .retry_interval = 0s})
                  .status(),
              StatusCode::kInvalidArgument, "retry_interval 0");
  expect_code(a.client->request({.version = Version(0), .free_slots = 1, .wait = -1s}).status(),
              StatusCode::kInvalidArgument, "wait -1000000000 ns");
}

TEST_CASE("rollout dispatcher: a rollout worker process killed mid-run loses no sample", "[rollout_dispatcher][process]") {
  constexpr std::uint32_t kG = 4;
  constexpr std::uint64_t kGroups = 4;
  // The lease only backs up the connection's close, which the kill brings.
  Actor actor({.group_size = kG, .seed = 21, .lease = 60s});
  REQUIRE(actor.dispatcher->publish(Version(1)).ok());
  REQUIRE(actor.dispatcher->open(Version(1), Version(1), kGroups).ok());
  laminar::testing::ChildOptions co;
  co.program = LAMINAR_DISPATCH_CHILD;
  co.args = {actor.addr, "7", "1", "12", "5"};
  co.env = {{"LAMINAR_TEST_TOKEN", kToken}};
  auto child = laminar::testing::ChildProcess::spawn(co);
  REQUIRE(child.ok());
  std::map<std::uint64_t, std::uint64_t> child_seed;
  std::set<std::uint64_t> done;
  for (;;) {
    laminar::Result<std::string> line = child->read_line(20s);
    REQUIRE(line.ok());
    if (*line == "READY") break;
    unsigned long long id = 0;
    unsigned long long seed = 0;
    if (std::sscanf(line->c_str(), "S %llu %llu", &id, &seed) == 2) {
      child_seed[id] = seed;
    } else {
      REQUIRE(std::sscanf(line->c_str(), "D %llu", &id) == 1);
      // The queue took it: the actor completes it.
      laminar::Result<laminar::Completion> c = actor.dispatcher->completed(TrajectoryId(id));
      REQUIRE(c.ok());
      CHECK_FALSE(c->duplicate);
      done.insert(id);
    }
  }
  REQUIRE(child_seed.size() == 12);
  REQUIRE(done.size() == 5);
  CHECK(actor.dispatcher->stats().workers == 1);
  child->kill(SIGKILL);
  laminar::Result<int> code = child->wait(10s);
  REQUIRE(code.ok());
  CHECK(*code == 128 + SIGKILL);
  REQUIRE(eventually([&] { return actor.dispatcher->stats().lost_workers == 1; }, 20s));

  // Another worker takes everything left: the killed one's held samples, as it had them, and the
  // group nobody had taken.
  Worker b = actor.worker(8);
  const Grant gb = b.ask(Version(1), 16);
  REQUIRE(gb.samples.size() == kGroups * kG - done.size());
  std::size_t reissued = 0;
  for (const Sample& s : gb.samples) {
    CHECK(done.count(s.id.value()) == 0);
    auto it = child_seed.find(s.id.value());
    if (it == child_seed.end()) continue;
    CHECK(it->second == s.seed);
    ++reissued;
  }
  CHECK(reissued == 12 - done.size());
  actor.complete(gb.samples);
  const laminar::RolloutDispatcherStats st = actor.dispatcher->stats();
  INFO(st.to_json());
  CHECK(st.groups_done == kGroups);
  CHECK(st.completed == kGroups * kG);
  CHECK(st.duplicates == 0);
  CHECK(st.reissued == 12 - done.size());
  CHECK(st.in_flight == 0);
  CHECK_FALSE(child->running());
}

TEST_CASE("rollout dispatcher: workers on threads take, migrate and finish samples while one dies, and each completes once",
          "[rollout_dispatcher]") {
  const unsigned seed = std::random_device{}();
  std::printf("rollout dispatcher threads seed %u\n", seed);
  constexpr std::uint32_t kG = 4;
  constexpr std::uint64_t kGroups = 30;
  constexpr int kWorkers = 4;
  constexpr int kVictim = 3;
  Actor actor({.group_size = kG, .seed = seed, .lease = 5s});
  REQUIRE(actor.dispatcher->open(Version(0), Version(0), kGroups).ok());
  std::vector<Worker> workers;
  for (int w = 0; w < kWorkers; ++w) workers.push_back(actor.worker(std::uint32_t(w + 1)));
  // Work for the victim before the others start, however the threads are scheduled.
  REQUIRE(workers[kVictim].ask(Version(0), 8).samples.size() == 8);

  std::mutex mu;
  std::condition_variable finished_cv;
  std::vector<TrajectoryId> finished;                      // pushed to the queue, for the actor
  std::vector<std::vector<TrajectoryId>> inbox(kWorkers);  // migrated in, not claimed yet
  std::atomic<bool> all_done{false};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937 rng(seed + unsigned(w));
      Worker& me = workers[std::size_t(w)];
      for (int step = 0; !all_done.load(); ++step) {
        {
          std::lock_guard l(mu);
          me.held.insert(me.held.end(), inbox[std::size_t(w)].begin(), inbox[std::size_t(w)].end());
          inbox[std::size_t(w)].clear();
        }
        if (w == kVictim && step == 3) {
          // The process dies holding what it has.
          me.client.reset();
          me.transport.reset();
          return;
        }
        // Asked to wait for work, so a worker with nothing to take sleeps at the dispatcher.
        laminar::Result<Grant> g =
            me.client->request({.version = Version(0), .free_slots = 1 + std::uint32_t(rng() % 6), .held = me.held,
                                .wait = 20ms});
        if (!g.ok()) {
          ++failures;
          return;
        }
        for (const Sample& s : g->samples) me.held.push_back(s.id);
        std::vector<TrajectoryId> keep;
        std::lock_guard l(mu);
        for (TrajectoryId id : me.held) {
          // The victim only takes work, so that it surely holds some when it dies.
          const unsigned r = w == kVictim ? 7 : rng() % 8;
          if (r < 3) {
            finished.push_back(id);
          } else if (r == 3) {
            // Migrates to another worker that stays, which claims it on its next request.
            int to = int(rng() % (kVictim - 1));
            if (to >= w) ++to;
            inbox[std::size_t(to)].push_back(id);
          } else {
            keep.push_back(id);
          }
        }
        me.held = std::move(keep);
        finished_cv.notify_all();
      }
    });
  }
  std::map<std::uint64_t, int> first_completions;
  std::uint64_t duplicates = 0;
  std::mt19937 rng(seed);
  const auto start = std::chrono::steady_clock::now();
  while (actor.dispatcher->stats().groups_done < kGroups && std::chrono::steady_clock::now() - start < 60s) {
    std::vector<TrajectoryId> batch;
    {
      std::unique_lock l(mu);
      finished_cv.wait_for(l, 100ms, [&] { return !finished.empty(); });
      batch.swap(finished);
    }
    for (TrajectoryId id : batch) {
      // Now and then the same id twice, as a retried push might bring it.
      for (unsigned k = 0; k <= (rng() % 10 == 0 ? 1u : 0u); ++k) {
        laminar::Result<laminar::Completion> c = actor.dispatcher->completed(id);
        CHECK(c.ok());
        if (!c.ok()) continue;
        if (c->duplicate) {
          ++duplicates;
        } else {
          ++first_completions[id.value()];
        }
      }
    }
  }
  all_done = true;
  for (auto& t : threads) t.join();
  CHECK(failures == 0);
  const laminar::RolloutDispatcherStats st = actor.dispatcher->stats();
  INFO(st.to_json());
  REQUIRE(st.groups_done == kGroups);
  CHECK(first_completions.size() == kGroups * kG);
  for (const auto& [id, n] : first_completions) CHECK(n == 1);
  CHECK(st.completed == kGroups * kG);
  CHECK(st.duplicates == duplicates);
  CHECK(st.lost_workers == 1);
  CHECK(st.reissued > 0);
  CHECK(st.claimed > 0);
  CHECK(st.in_flight == 0);
}

TEST_CASE("rollout dispatcher: a request with nothing to take waits until work comes, or until its wait ends",
          "[rollout_dispatcher]") {
  auto clock = std::make_shared<laminar::ManualClock>();
  constexpr std::uint32_t kG = 2;
  Actor actor({.group_size = kG, .seed = 8, .lease = 10s, .max_wait = 4s, .clock = clock});
  REQUIRE(actor.dispatcher->publish(Version(1)).ok());
  std::atomic<int> answers{0};
  Worker a = actor.worker(1, [&] { ++answers; });
  // Nothing is open: the request waits at the dispatcher, unanswered.
  laminar::PendingGrant first = a.client->request_async({.version = Version(1), .free_slots = 4, .wait = 3s});
  REQUIRE(eventually([&] { return actor.dispatcher->stats().waiting_requests == 1; }));
  CHECK_FALSE(first.ready());
  // Work for it: answered at once, without any clock moving.
  REQUIRE(actor.dispatcher->open(1).ok());
  REQUIRE(eventually([&] { return first.ready(); }));
  // on_answer runs just after the answer is ready, on the transport's thread.
  CHECK(eventually([&] { return answers == 1; }));
  laminar::Result<Grant> g = first.get();
  REQUIRE(g.ok());
  REQUIRE(g->kind == GrantKind::kWork);
  CHECK(g->samples.size() == kG);
  CHECK(g->newest == Version(1));
  for (const Sample& s : g->samples) a.held.push_back(s.id);

  // Nothing more: the next request waits for its whole wait on the dispatcher's clock.
  laminar::PendingGrant second =
      a.client->request_async({.version = Version(1), .free_slots = 2, .held = a.held, .wait = 3s});
  REQUIRE(eventually([&] { return actor.dispatcher->stats().waiting_requests == 1; }));
  REQUIRE(clock->advance(2s).ok());
  // Another worker's answer has gone through the dispatcher since: the first is still waiting.
  Worker b = actor.worker(2);
  CHECK(b.ask(Version(1), 0).kind == GrantKind::kNothing);
  CHECK_FALSE(second.ready());
  REQUIRE(clock->advance(1s).ok());
  REQUIRE(eventually([&] { return second.ready(); }));
  laminar::Result<Grant> none = second.get();
  REQUIRE(none.ok());
  CHECK(none->kind == GrantKind::kNothing);
  CHECK(eventually([&] { return answers == 2; }));
  // A wait longer than max_wait is cut to it.
  laminar::PendingGrant third =
      a.client->request_async({.version = Version(1), .free_slots = 2, .held = a.held, .wait = 1h});
  REQUIRE(eventually([&] { return actor.dispatcher->stats().waiting_requests == 1; }));
  REQUIRE(clock->advance(4s).ok());
  REQUIRE(eventually([&] { return third.ready(); }));
  CHECK(third.get()->kind == GrantKind::kNothing);
  // A worker that waits is not lost, however long it waits in all.
  CHECK(actor.dispatcher->stats().lost_workers == 0);

  // Sync: version 2 is published and a batch opened for it; a worker waiting on version 1 hears it
  // must pull.
  laminar::PendingGrant fourth =
      a.client->request_async({.version = Version(1), .free_slots = 2, .held = a.held, .wait = 3s});
  REQUIRE(eventually([&] { return actor.dispatcher->stats().waiting_requests == 1; }));
  REQUIRE(actor.dispatcher->publish(Version(2)).ok());
  CHECK_FALSE(fourth.ready());
  REQUIRE(actor.dispatcher->open(1).ok());
  REQUIRE(eventually([&] { return fourth.ready(); }));
  laminar::Result<Grant> pull = fourth.get();
  REQUIRE(pull.ok());
  CHECK(pull->kind == GrantKind::kPullNewer);
  CHECK(pull->pull_version == Version(2));
  const laminar::RolloutDispatcherStats st = actor.dispatcher->stats();
  CHECK(st.waited == 4);
  CHECK(st.waiting_requests == 0);
}

TEST_CASE("rollout dispatcher: samples a worker returns unstarted go out again at once", "[rollout_dispatcher]") {
  constexpr std::uint32_t kG = 4;
  Actor actor({.group_size = kG, .seed = 6, .lease = 30s, .max_held = 8});
  REQUIRE(actor.dispatcher->open(Version(0), Version(0), 1).ok());
  Worker a = actor.worker(1), b = actor.worker(2);
  const Grant all = a.ask(Version(0), kG);
  REQUIRE(all.samples.size() == kG);
  // b waits: nothing is left.
  laminar::PendingGrant waiting = b.client->request_async({.version = Version(0), .free_slots = kG, .wait = 5s});
  REQUIRE(eventually([&] { return actor.dispatcher->stats().waiting_requests == 1; }));

  // a starts two and gives the other two back: b has them at once, the same ids and seeds, not a
  // lease later.
  const std::vector<TrajectoryId> kept = {all.samples[0].id, all.samples[1].id};
  const std::vector<TrajectoryId> back = {all.samples[2].id, all.samples[3].id};
  laminar::Result<Grant> g = a.client->request({.version = Version(0), .held = kept, .returned = back});
  REQUIRE(g.ok());
  CHECK(g->kind == GrantKind::kNothing);
  REQUIRE(eventually([&] { return waiting.ready(); }));
  laminar::Result<Grant> got = waiting.get();
  REQUIRE(got.ok());
  REQUIRE(got->kind == GrantKind::kWork);
  CHECK(ids_of(got->samples) == ids_of({all.samples[2], all.samples[3]}));
  for (const Sample& s : got->samples) CHECK(s.seed == all.samples[s.sample_index].seed);
  laminar::RolloutDispatcherStats st = actor.dispatcher->stats();
  CHECK(st.returned == 2);
  CHECK(st.reissued == 2);
  CHECK(st.handed_out == kG + 2);

  // Returning what it no longer holds (b has them now) changes nothing.
  REQUIRE(a.client->request({.version = Version(0), .held = kept, .returned = back}).ok());
  st = actor.dispatcher->stats();
  CHECK(st.returned == 2);
  CHECK(st.waiting == 0);
  // A sample both held and returned, or of no group made, is refused.
  expect_code(a.client->request({.version = Version(0), .held = kept, .returned = {kept[0]}}).status(),
              StatusCode::kInvalidArgument, "both held and returned");
  expect_code(a.client->request({.version = Version(0), .held = kept, .returned = {TrajectoryId(999)}}).status(),
              StatusCode::kInvalidArgument, "returns trajectory 999, of no group made");
  expect_code(a.client->request({.version = Version(0), .free_slots = 5, .held = kept, .returned = back}).status(),
              StatusCode::kInvalidArgument, "5 free slots, 2 held and 2 returned ids, above max_held 8");
  // Every sample completes once, whoever decoded it.
  actor.complete(all.samples);
  CHECK(actor.dispatcher->stats().groups_done == 1);
}

TEST_CASE("rollout dispatcher: a stream answers a waiting request when a completion makes room",
          "[rollout_dispatcher]") {
  constexpr std::uint32_t kG = 2;
  Actor actor({.group_size = kG, .seed = 4, .rule = AdmissionRule::stream(1, 4)});
  REQUIRE(actor.dispatcher->publish(Version(3)).ok());
  Worker a = actor.worker(1);
  Worker b = actor.worker(2);
  const Grant ga = a.ask(Version(3), 8);
  REQUIRE(ga.samples.size() == 4);
  laminar::PendingGrant waiting = b.client->request_async({.version = Version(3), .free_slots = 8, .wait = 4s});
  REQUIRE(eventually([&] { return actor.dispatcher->stats().waiting_requests == 1; }));
  // One sample done is not room for a group; the second is.
  actor.complete({ga.samples[0]});
  CHECK(actor.dispatcher->stats().waiting_requests == 1);
  actor.complete({ga.samples[1]});
  REQUIRE(eventually([&] { return waiting.ready(); }));
  laminar::Result<Grant> g = waiting.get();
  REQUIRE(g.ok());
  CHECK(g->kind == GrantKind::kWork);
  CHECK(g->samples.size() == kG);
  CHECK_FALSE(g->interrupt);
  CHECK(actor.dispatcher->stats().groups_made == 3);
}

TEST_CASE("rollout dispatcher: the interruptible rule tells a worker behind the newest version to pull now",
          "[rollout_dispatcher]") {
  constexpr std::uint32_t kG = 2;
  Actor actor({.group_size = kG, .seed = 4, .rule = AdmissionRule::interruptible(1, 8)});
  REQUIRE(actor.dispatcher->publish(Version(3)).ok());
  Worker a = actor.worker(1);
  const Grant current = a.ask(Version(3), 2);
  CHECK(current.kind == GrantKind::kWork);
  CHECK_FALSE(current.interrupt);
  REQUIRE(actor.dispatcher->publish(Version(4)).ok());
  // Within the staleness bound it still gets work, and hears it should pull.
  const Grant behind = a.ask(Version(3), 2);
  CHECK(behind.kind == GrantKind::kWork);
  CHECK(behind.interrupt);
  CHECK(behind.newest == Version(4));
  // A request with no free slots has nothing to wait for: it is answered at once.
  laminar::PendingGrant waiting =
      a.client->request_async({.version = Version(4), .free_slots = 0, .held = a.held, .wait = 4s});
  laminar::Result<Grant> no_slots = waiting.get();
  REQUIRE(no_slots.ok());
  CHECK(no_slots->kind == GrantKind::kNothing);
  CHECK(actor.dispatcher->stats().waited == 0);  // no free slots: nothing to wait for
  Worker b = actor.worker(2);
  REQUIRE(actor.dispatcher->set_rule(AdmissionRule::interruptible(1, 4)).ok());
  laminar::PendingGrant parked = b.client->request_async({.version = Version(4), .free_slots = 2, .wait = 4s});
  REQUIRE(eventually([&] { return actor.dispatcher->stats().waiting_requests == 1; }));
  REQUIRE(actor.dispatcher->publish(Version(5)).ok());
  REQUIRE(eventually([&] { return parked.ready(); }));
  laminar::Result<Grant> told = parked.get();
  REQUIRE(told.ok());
  CHECK(told->kind == GrantKind::kNothing);
  CHECK(told->interrupt);
  CHECK(told->newest == Version(5));
  expect_code(actor.dispatcher->open(1).status(), StatusCode::kFailedPrecondition, "under a stream rule");
  expect_code(actor.dispatcher->set_rule(AdmissionRule::interruptible(1, 1)), StatusCode::kInvalidArgument,
              "below one group");
}

TEST_CASE("rollout dispatcher: groups carry the host's payload, bounded", "[rollout_dispatcher]") {
  constexpr std::uint32_t kG = 2;
  Actor actor({.group_size = kG,
               .seed = 4,
               .payload = [](std::uint64_t prompt) { return std::string(prompt == 3 ? 9 : 2, char('a' + prompt)); },
               .max_payload_bytes = 8});
  REQUIRE(actor.dispatcher->open(Version(0), Version(0), 2).ok());
  Worker a = actor.worker(1);
  const Grant g = a.ask(Version(0), 4);
  REQUIRE(g.samples.size() == 4);
  for (const Sample& s : g.samples) CHECK(s.payload == std::string(2, char('a' + s.prompt_index)));
  // Prompt 3's payload is too big: no group is made, not even prompt 2's.
  expect_code(actor.dispatcher->open(Version(0), Version(0), 2).status(), StatusCode::kInvalidArgument,
              "payload of prompt 3 is 9 bytes");
  CHECK(actor.dispatcher->stats().groups_made == 2);
  // The stream makes prompt 2's group, stops at prompt 3's and keeps the error.
  REQUIRE(actor.dispatcher->set_rule(AdmissionRule::stream(0, 8)).ok());
  const Grant streamed = a.ask(Version(0), 4);
  REQUIRE(streamed.samples.size() == kG);
  CHECK(streamed.samples[0].prompt_index == 2);
  expect_code(actor.dispatcher->background_error(), StatusCode::kInvalidArgument, "payload of prompt 3");
  CHECK(actor.dispatcher->stats().available == 0);
}

TEST_CASE("rollout dispatcher: a waiting request is answered when the dispatcher goes, and when it is replaced",
          "[rollout_dispatcher]") {
  Actor actor({.group_size = 2, .seed = 4});
  std::shared_ptr<Transport> raw_tr = make_transport(kToken);
  laminar::Endpoint raw = raw_tr->connect(actor.addr).value();
  auto ask = [&](std::uint32_t slots) {
    return laminar::internal::request_protocol_async(
        raw, {laminar::internal::kDispatchRequestMessage,
              laminar::internal::encode_dispatch_request({WorkerId(1), {Version(0), slots, {}, 4s}})},
        10s);
  };
  auto first = ask(2);
  REQUIRE(eventually([&] { return actor.dispatcher->stats().waiting_requests == 1; }));
  // The same worker asks again: the first request is answered with nothing, the second waits.
  auto second = ask(3);
  laminar::Result<laminar::Message> replaced = first.get();
  REQUIRE(replaced.ok());
  CHECK(laminar::internal::decode_grant(replaced->body, 2, 0, 0)->kind == GrantKind::kNothing);
  REQUIRE(eventually([&] { return actor.dispatcher->stats().waiting_requests == 1; }));
  actor.dispatcher.reset();
  expect_code(second.get().status(), StatusCode::kCancelled, "shut down");
}

TEST_CASE("rollout dispatcher: an idle worker that pulls first is told of each newer version", "[rollout_dispatcher]") {
  constexpr std::uint32_t kG = 2;
  Actor actor({.group_size = kG, .seed = 4, .rule = AdmissionRule::stream(2, 4)});
  REQUIRE(actor.dispatcher->publish(Version(3)).ok());
  Worker a = actor.worker(1);
  // Within the staleness bound a worker on version 2 gets work, unless it pulls first when idle.
  laminar::Result<Grant> pull =
      a.client->request({.version = Version(2), .free_slots = 2, .wait = 4s, .idle_pull = true});
  REQUIRE(pull.ok());
  CHECK(pull->kind == GrantKind::kPullNewer);
  CHECK(pull->pull_version == Version(3));
  const Grant work = a.ask(Version(2), 2);
  REQUIRE(work.kind == GrantKind::kWork);
  // Holding something it is not idle: the flag changes nothing.
  laminar::Result<Grant> busy =
      a.client->request({.version = Version(2), .free_slots = 2, .held = a.held, .idle_pull = true});
  REQUIRE(busy.ok());
  CHECK(busy->kind == GrantKind::kWork);
  // On the newest version with no room left, it waits; a publish answers it.
  Worker b = actor.worker(2);
  laminar::PendingGrant waiting =
      b.client->request_async({.version = Version(3), .free_slots = 2, .wait = 4s, .idle_pull = true});
  REQUIRE(eventually([&] { return actor.dispatcher->stats().waiting_requests == 1; }));
  REQUIRE(actor.dispatcher->publish(Version(4)).ok());
  REQUIRE(eventually([&] { return waiting.ready(); }));
  laminar::Result<Grant> told = waiting.get();
  REQUIRE(told.ok());
  CHECK(told->kind == GrantKind::kPullNewer);
  CHECK(told->pull_version == Version(4));
}

TEST_CASE("rollout dispatcher: the header's usage example runs", "[rollout_dispatcher]") {
  std::shared_ptr<Transport> transport = make_transport(kToken);
  const std::string address = transport->listen("127.0.0.1", 0).value();
  const WorkerId w(1);
  const Version v(1);
  // From rollout_dispatcher.h, with the worker on the actor's own transport.
  // the actor:
  auto d = laminar::RolloutDispatcher::create(transport, {.group_size = 8, .seed = 1}).value();
  (void)d->publish(laminar::Version(1));
  (void)d->open(16);  // sync: 16 groups for version 1
  // a rollout worker:
  auto c = laminar::DispatchClient::create(transport, {.worker = w, .server = address}).value();
  laminar::Result<laminar::Grant> g = c->request({.version = v, .free_slots = 4, .wait = 1s});
  REQUIRE(g.ok());
  CHECK(g->kind == GrantKind::kWork);
  CHECK(g->samples.size() == 4);
  CHECK(d->stats().groups_made == 16);
}

namespace {

// The next `n` answers an asker takes, or its error.
laminar::Result<std::vector<Grant>> next_answers(laminar::DispatchAsker& asker, std::size_t n) {
  std::vector<Grant> got;
  laminar::Status failed;
  eventually([&] {
    laminar::Result<std::vector<Grant>> a = asker.answers();
    if (!a.ok()) {
      failed = a.status();
      return true;
    }
    got.insert(got.end(), a->begin(), a->end());
    return got.size() >= n;
  });
  if (!failed.ok()) return failed;
  return got;
}

}  // namespace

TEST_CASE("rollout dispatcher: a worker's asker sends a question only when its state calls for one",
          "[rollout_dispatcher]") {
  constexpr std::uint32_t kG = 2;
  Actor actor({.group_size = kG, .seed = 4, .rule = AdmissionRule::stream(1, kG), .lease = 30s});
  REQUIRE(actor.dispatcher->publish(Version(1)).ok());
  Worker a = actor.worker(1);
  laminar::DispatchAsker asker = laminar::DispatchAsker::create(a.client.get(), {.wait = 4s}).value();

  // Idle with room: one question, and the same state asks nothing more while it is out.
  CHECK(asker.ask({.version = Version(1), .taking = true, .room = kG, .idle = true}));
  CHECK_FALSE(asker.ask({.version = Version(1), .taking = true, .room = kG, .idle = true}));
  laminar::Result<std::vector<Grant>> got = next_answers(asker, 1);
  REQUIRE(got.ok());
  REQUIRE(got->size() == 1);
  REQUIRE((*got)[0].kind == GrantKind::kWork);
  const std::vector<Sample> first = (*got)[0].samples;
  REQUIRE(first.size() == kG);
  // Full: nothing to ask.
  CHECK_FALSE(asker.ask({.version = Version(1), .taking = true, .room = 0, .held = {first[0].id, first[1].id}}));
  CHECK_FALSE(asker.asking());

  // A newer version, and one sample migrates away: a busy question for one slot, which waits (the
  // stream's samples in flight are all out).
  REQUIRE(actor.dispatcher->publish(Version(2)).ok());
  CHECK(asker.ask({.version = Version(1), .taking = true, .room = 1, .held = {first[1].id}}));
  REQUIRE(eventually([&] { return actor.dispatcher->stats().waiting_requests == 1; }));
  // The other goes too: idle now, it asks again with an idle pull, which the dispatcher answers
  // with the newer version at once, where the busy question would have waited for work on version 1.
  CHECK(asker.ask({.version = Version(1), .taking = true, .room = kG, .idle = true}));
  got = next_answers(asker, 2);
  REQUIRE(got.ok());
  REQUIRE(got->size() == 2);
  // The replaced question is answered with nothing, and the new one (the two may come in one call
  // or one after the other, in either order).
  std::sort(got->begin(), got->end(), [](const Grant& x, const Grant& y) { return x.kind < y.kind; });
  CHECK((*got)[0].kind == GrantKind::kPullNewer);
  CHECK((*got)[0].pull_version == Version(2));
  CHECK((*got)[1].kind == GrantKind::kNothing);
  CHECK(asker.questions() == 3);

  // Pulled and idle, it asks and waits; a sequence migrates in and takes a slot it offered: it asks
  // again for one, and gets one sample of the next group when the first completes.
  CHECK(asker.ask({.version = Version(2), .taking = true, .room = kG, .idle = true}));
  REQUIRE(eventually([&] { return actor.dispatcher->stats().waiting_requests == 1; }));
  CHECK(asker.ask({.version = Version(2), .taking = true, .room = kG - 1, .held = {first[0].id}}));
  got = next_answers(asker, 1);  // the replaced question, answered when the new one came
  REQUIRE(got.ok());
  REQUIRE(got->size() == 1);
  CHECK((*got)[0].kind == GrantKind::kNothing);
  REQUIRE(eventually([&] { return actor.dispatcher->stats().waiting_requests == 1; }));
  actor.complete(first);
  got = next_answers(asker, 1);
  REQUIRE(got.ok());
  REQUIRE(got->size() == 1);
  REQUIRE((*got)[0].kind == GrantKind::kWork);
  REQUIRE((*got)[0].samples.size() == 1);
  const TrajectoryId extra = (*got)[0].samples[0].id;

  // It cannot start that one after all: a question with no free slot gives it back, and it is
  // handed out again at once (here to the same worker, with its group's other sample).
  asker.give_back({extra});
  CHECK(asker.ask({.version = Version(2), .taking = true, .room = 0}));
  got = next_answers(asker, 1);
  REQUIRE(got.ok());
  CHECK((*got)[0].kind == GrantKind::kNothing);
  CHECK(actor.dispatcher->stats().returned == 1);
  CHECK(asker.ask({.version = Version(2), .taking = true, .room = kG, .idle = true}));
  got = next_answers(asker, 1);
  REQUIRE(got.ok());
  REQUIRE((*got)[0].kind == GrantKind::kWork);
  const std::vector<Sample> second = (*got)[0].samples;
  REQUIRE(second.size() == kG);
  CHECK(ids_of(second).count(extra.value()) == 1);
  CHECK(asker.questions() == 7);

  // A question out when the dispatcher goes comes back as its error.
  CHECK(asker.ask({.version = Version(2), .taking = true, .room = 1, .held = {second[0].id, second[1].id}}));
  REQUIRE(eventually([&] { return actor.dispatcher->stats().waiting_requests == 1; }));
  actor.dispatcher.reset();
  expect_code(next_answers(asker, 1).status(), StatusCode::kCancelled, "shut down");
}

TEST_CASE("rollout dispatcher: an asker needs a client and a positive wait", "[rollout_dispatcher]") {
  Actor actor({.group_size = 2, .seed = 4});
  Worker a = actor.worker(1);
  expect_code(laminar::DispatchAsker::create(nullptr).status(), StatusCode::kInvalidArgument, "the client is null");
  expect_code(laminar::DispatchAsker::create(a.client.get(), {.wait = 0s}).status(), StatusCode::kInvalidArgument,
              "wait 0 ns, renew_after 5000000000 ns (each must be positive)");
  expect_code(laminar::DispatchAsker::create(a.client.get(), {.renew_after = -1s}).status(),
              StatusCode::kInvalidArgument, "renew_after -1000000000 ns");
}

TEST_CASE("rollout dispatcher: an asker claims what migrates in, and renews its lease when it has nothing to ask",
          "[rollout_dispatcher]") {
  constexpr std::uint32_t kG = 2;
  Actor actor({.group_size = kG, .seed = 4, .lease = 30s});
  REQUIRE(actor.dispatcher->open(Version(0), Version(0), 1).ok());
  Worker a = actor.worker(1), b = actor.worker(2);
  const Grant both = a.ask(Version(0), kG);
  REQUIRE(both.samples.size() == kG);
  auto clock = std::make_shared<laminar::ManualClock>();
  laminar::DispatchAsker asker =
      laminar::DispatchAsker::create(b.client.get(), {.wait = 4s, .renew_after = 5s, .clock = clock}).value();

  // b has no room, but one of a's samples migrated in: it tells the dispatcher at once, which
  // would otherwise hand the sample out again after a's lease on it.
  const WorkerState full{.version = Version(0), .taking = true, .room = 0, .held = {both.samples[1].id}};
  CHECK(asker.ask(full));
  laminar::Result<std::vector<Grant>> got = next_answers(asker, 1);
  REQUIRE(got.ok());
  CHECK((*got)[0].kind == GrantKind::kNothing);
  CHECK(actor.dispatcher->stats().claimed == 1);
  // Told once: the same state asks nothing, until renew_after has passed without a question.
  CHECK_FALSE(asker.ask(full));
  REQUIRE(clock->advance(4s).ok());
  CHECK_FALSE(asker.ask(full));
  REQUIRE(clock->advance(1s).ok());
  CHECK(asker.ask(full));
  REQUIRE(next_answers(asker, 1).ok());
  CHECK(asker.questions() == 2);
  CHECK(actor.dispatcher->stats().lost_workers == 0);
}

TEST_CASE("rollout dispatcher: a snapshot's bytes round trip, and bad ones are refused", "[rollout_dispatcher]") {
  using State = laminar::DispatcherSnapshot::SampleState;
  const laminar::DispatcherSnapshot snap{
      .group_size = 2,
      .first_prompt = 5,
      .groups_made = 9,
      .open = {{3, false, Version(2), laminar::kAnyNewerVersion, {State::kCompleted, State::kOut}},
               {7, true, Version(0), Version(0), {State::kWaiting, State::kWaiting}}}};
  const std::vector<std::byte> bytes = snap.encode();
  REQUIRE(bytes.size() == 24 + 2 * (25 + 2));
  auto back = laminar::DispatcherSnapshot::decode(bytes);
  REQUIRE(back.ok());
  CHECK(*back == snap);
  for (std::size_t cut : {std::size_t(0), std::size_t(23), bytes.size() - 1})
    expect_code(laminar::DispatcherSnapshot::decode(std::span(bytes).first(cut)).status(), StatusCode::kDataLoss,
                "dispatcher snapshot");
  std::vector<std::byte> longer = bytes;
  longer.push_back(std::byte(0));
  expect_code(laminar::DispatcherSnapshot::decode(longer).status(), StatusCode::kDataLoss, "dispatcher snapshot");
  // Well-formed bytes of a snapshot that cannot be.
  auto refused = [](laminar::DispatcherSnapshot s, const char* why) {
    expect_code(laminar::DispatcherSnapshot::decode(s.encode()).status(), StatusCode::kInvalidArgument, why);
  };
  laminar::DispatcherSnapshot s = snap;
  s.open[1].index = 9;
  refused(s, "not below 9 groups made");
  s = snap;
  std::swap(s.open[0], s.open[1]);
  refused(s, "after group 7");
  s = snap;
  s.open[0].samples = {State::kCompleted, State::kCompleted};
  refused(s, "every sample completed");
  s = snap;
  s.open[0].samples.push_back(State::kOut);  // bytes cannot say so; a snapshot made in memory can
  RolloutDispatcherOptions o{.group_size = 2, .first_prompt = 5};
  o.resume = s;
  expect_code(RolloutDispatcher::create(make_transport(kToken), o).status(), StatusCode::kInvalidArgument,
              "3 samples, not 2");
  s = snap;
  s.open[0].version_min = Version(7);
  s.open[0].version_max = Version(6);
  refused(s, "versions [7, 6]");
  s = snap;
  s.groups_made = std::numeric_limits<std::uint64_t>::max() / 2;
  refused(s, "overflow");
  std::vector<std::byte> bad_state = bytes;
  bad_state[24 + 25 + 1] = std::byte(3);
  expect_code(laminar::DispatcherSnapshot::decode(bad_state).status(), StatusCode::kInvalidArgument, "state 3");
}

TEST_CASE("rollout dispatcher: one resumed from its predecessor's snapshot completes every sample once",
          "[rollout_dispatcher]") {
  auto clock = std::make_shared<laminar::ManualClock>();
  constexpr std::uint32_t kG = 2;
  const RolloutDispatcherOptions o{.group_size = kG, .seed = 8, .rule = AdmissionRule::stream(0, 8), .lease = 10s,
                                   .clock = clock};
  laminar::DispatcherSnapshot snap;
  std::vector<Sample> ga, gb, gc;
  {
    // The predecessor: groups 0 and 1 to a, 2 to b; group 0 and sample 2 completed; the snapshot;
    // then group 3 to c and sample 3 completed (the queue's log keeps it), and the process ends.
    Actor first(o);
    REQUIRE(first.dispatcher->publish(Version(1)).ok());
    Worker a = first.worker(1);
    Worker b = first.worker(2);
    Worker c = first.worker(3);
    ga = a.ask(Version(1), 4).samples;
    gb = b.ask(Version(1), 2).samples;
    REQUIRE(ga.size() == 4);
    REQUIRE(gb.size() == 2);
    first.complete({ga[0], ga[1], ga[2]});
    snap = first.dispatcher->snapshot();
    gc = c.ask(Version(1), 2).samples;
    REQUIRE(gc.size() == 2);
    first.complete({ga[3]});
  }
  using State = laminar::DispatcherSnapshot::SampleState;
  REQUIRE(snap.groups_made == 3);
  REQUIRE(snap.open.size() == 2);
  CHECK(snap.open[0].samples == std::vector<State>{State::kCompleted, State::kOut});
  CHECK(snap.open[1].samples == std::vector<State>{State::kOut, State::kOut});

  RolloutDispatcherOptions mismatched = o;
  mismatched.resume = snap;
  mismatched.first_prompt = 1;
  expect_code(RolloutDispatcher::create(make_transport(kToken), mismatched).status(), StatusCode::kInvalidArgument,
              "from prompt 0");
  mismatched = o;
  mismatched.resume = snap;
  mismatched.claim_window = 11s;
  expect_code(RolloutDispatcher::create(make_transport(kToken), mismatched).status(), StatusCode::kInvalidArgument,
              "claim_window");

  RolloutDispatcherOptions resumed = o;
  resumed.resume = snap;
  resumed.claim_window = 2s;
  Actor second(resumed);
  REQUIRE(second.dispatcher->publish(Version(2)).ok());
  {
    const laminar::RolloutDispatcherStats st = second.dispatcher->stats();
    CHECK(st.groups_made == 3);
    CHECK(st.groups_done == 1);
    CHECK(st.completed == 3);
  }
  // The host completes what the queue's log gave back: sample 3 is new to the snapshot, sample 2
  // is not.
  auto c3 = second.dispatcher->completed(ga[3].id);
  REQUIRE(c3.ok());
  CHECK_FALSE(c3->duplicate);
  CHECK(c3->group_done);
  auto c2 = second.dispatcher->completed(ga[2].id);
  REQUIRE(c2.ok());
  CHECK(c2->duplicate);
  // c holds group 3, made after the snapshot: adopted and claimed. b now lists only sample 4 (it
  // pushed sample 5, which the queue never got).
  Worker c = second.worker(3);
  c.held = {gc[0].id, gc[1].id};
  CHECK(c.ask(Version(1), 0).kind == GrantKind::kNothing);
  CHECK(second.dispatcher->stats().adopted_groups == 1);
  CHECK(second.dispatcher->stats().groups_made == 4);
  Worker b = second.worker(2);
  b.held = {gb[0].id};
  (void)b.ask(Version(1), 0);
  // Within the claim window nothing goes out again; after it, sample 5 does, and nothing else.
  Worker d = second.worker(4);
  REQUIRE(clock->advance(2s).ok());
  CHECK(second.dispatcher->stats().waiting == 0);
  REQUIRE(clock->advance(1ns).ok());
  REQUIRE(eventually([&] { return second.dispatcher->stats().waiting == 1; }));
  const Grant gd = d.ask(Version(2), 1);
  REQUIRE(gd.samples.size() == 1);
  CHECK(gd.samples[0] == gb[1]);
  CHECK(second.dispatcher->stats().reissued == 1);
  // Every sample completes once; new groups follow the newest known.
  second.complete({gb[0], gb[1], gc[0], gc[1]});
  const Grant fresh = d.ask(Version(2), 2);
  REQUIRE(fresh.samples.size() == kG);
  CHECK(fresh.samples[0].prompt_index == 4);
  second.complete(fresh.samples);
  const laminar::RolloutDispatcherStats st = second.dispatcher->stats();
  CHECK(st.groups_done == st.groups_made);
  CHECK(st.completed == st.groups_made * kG);
  CHECK(st.duplicates == 1);
  // A dispatcher that is not resumed adopts nothing.
  Actor fresh_actor(o);
  expect_code(fresh_actor.dispatcher->completed(TrajectoryId(6)).status(), StatusCode::kNotFound, "no group made");
}
