// PromptServer and PromptClient (examples/async_grpo/prompt_dispatch.h) over real transports: each
// schedule's gating, exactly-once completion, claims of migrated samples, and the reissue of what a
// lost worker held, lost by a closed connection, by a lease on a ManualClock, or by a killed process.
#include "prompt_dispatch.h"

#include <csignal>
#include <cstdio>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
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

using async_grpo::Grant;
using async_grpo::GrantKind;
using async_grpo::PromptClient;
using async_grpo::PromptServer;
using async_grpo::PromptServerOptions;
using async_grpo::Sample;
using laminar::StatusCode;
using laminar::TrajectoryId;
using laminar::Transport;
using laminar::Version;
using laminar::WorkerId;
using laminar::testing::eventually;
using laminar::testing::expect_code;
using laminar::testing::make_transport;
using namespace std::chrono_literals;

namespace {

const char* kToken = "grpo-dispatch-test-token-0123456789";

// A rollout worker: its own transport (so closing it is a real connection closing) and client.
struct Worker {
  std::shared_ptr<Transport> transport;
  std::unique_ptr<PromptClient> client;
  std::vector<TrajectoryId> held;

  // Asks for `slots` more, holding what it took before; keeps what it gets.
  Grant ask(Version v, std::uint32_t slots) {
    laminar::Result<Grant> g = client->request(v, slots, held);
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
  std::unique_ptr<PromptServer> server;

  explicit Actor(PromptServerOptions o) {
    auto s = PromptServer::create(transport, std::move(o));
    REQUIRE(s.ok());
    server = std::move(s).value();
  }
  Worker worker(std::uint32_t id) {
    Worker w{make_transport(kToken), nullptr, {}};
    auto c = PromptClient::create(w.transport, {.worker = WorkerId(id), .server = addr});
    REQUIRE(c.ok());
    w.client = std::move(c).value();
    return w;
  }
  // Completes every id once, checking none was completed before.
  void complete(const std::vector<Sample>& samples) {
    for (const Sample& s : samples) {
      laminar::Result<async_grpo::Completion> c = server->completed(s.id);
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

TEST_CASE("grpo dispatch: the wire refuses truncated, trailing and out-of-bound bodies", "[grpo_dispatch]") {
  const async_grpo::PromptRequest q{WorkerId(3), Version(9), 5, {TrajectoryId(1), TrajectoryId(77)}};
  const std::vector<std::byte> qb = async_grpo::encode_prompt_request(q);
  REQUIRE(qb.size() == async_grpo::kPromptRequestHeaderBytes + 16);
  auto back = async_grpo::decode_prompt_request(qb, 2);
  REQUIRE(back.ok());
  CHECK(back->worker == q.worker);
  CHECK(back->version == q.version);
  CHECK(back->free_slots == 5);
  CHECK(back->held == q.held);
  expect_code(async_grpo::decode_prompt_request(qb, 1).status(), StatusCode::kInvalidArgument, "held count is 2");
  const Grant g{GrantKind::kWork, Version(0), {{TrajectoryId(13), 3, 1, 42}, {TrajectoryId(14), 3, 2, 43}},
                {TrajectoryId(5)}};
  const std::vector<std::byte> gb = async_grpo::encode_grant(g);
  REQUIRE(gb.size() == async_grpo::kGrantHeaderBytes + 2 * async_grpo::kGrantSampleBytes + 4 + 8);
  auto gback = async_grpo::decode_grant(gb, 2, 1);
  REQUIRE(gback.ok());
  CHECK(gback->samples == g.samples);
  CHECK(gback->drop == g.drop);
  expect_code(async_grpo::decode_grant(gb, 1, 1).status(), StatusCode::kInvalidArgument, "sample count is 2");
  for (const std::vector<std::byte>* body : {&qb, &gb}) {
    for (std::size_t n = 0; n < body->size(); ++n) {
      const std::span<const std::byte> prefix = std::span(*body).first(n);
      const laminar::Status st = body == &qb ? async_grpo::decode_prompt_request(prefix, 2).status()
                                             : async_grpo::decode_grant(prefix, 2, 1).status();
      INFO("prefix of " << n << " bytes: " << st.to_string());
      CHECK(st.code() == StatusCode::kDataLoss);
    }
    std::vector<std::byte> longer = *body;
    longer.push_back(std::byte{0});
    const laminar::Status st = body == &qb ? async_grpo::decode_prompt_request(longer, 2).status()
                                           : async_grpo::decode_grant(longer, 2, 1).status();
    expect_code(st, StatusCode::kDataLoss, "left over");
  }
  std::vector<std::byte> bad_kind = gb;
  bad_kind[4] = std::byte{7};
  expect_code(async_grpo::decode_grant(bad_kind, 2, 1).status(), StatusCode::kInvalidArgument, "kind 7");
  std::vector<std::byte> bad_magic = qb;
  bad_magic[0] = std::byte{0};
  expect_code(async_grpo::decode_prompt_request(bad_magic, 2).status(), StatusCode::kDataLoss, "magic");
}

TEST_CASE("grpo dispatch: sync hands out exactly B groups at v, whole groups first, and nothing to an older worker",
          "[grpo_dispatch]") {
  constexpr std::uint32_t kG = 4;
  Actor actor({.group_size = kG, .seed = 11, .first_prompt = 100});
  REQUIRE(actor.server->set_newest_version(Version(2)).ok());
  laminar::Result<std::uint64_t> first = actor.server->open(Version(2), Version(2), 3);
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

  CHECK(actor.server->wait_done(1, 0ns).code() == StatusCode::kDeadlineExceeded);
  actor.complete(all);
  CHECK(actor.server->wait_done(3, 0ns).ok());
  CHECK(actor.server->wait_done(4, 0ns).code() == StatusCode::kDeadlineExceeded);
  const async_grpo::PromptServerStats st = actor.server->stats();
  CHECK(st.groups_made == 3);
  CHECK(st.groups_done == 3);
  CHECK(st.handed_out == 3 * kG);
  CHECK(st.completed == 3 * kG);
  CHECK(st.in_flight == 0);
  CHECK(st.reissued == 0);
  CHECK(st.workers == 3);
  CHECK_THAT(st.to_json(), Catch::Contains("\"groups_done\":3"));
  CHECK(actor.server->background_error().ok());

  // The same options deal the same samples: ids and seeds depend on nothing else.
  Actor again({.group_size = kG, .seed = 11, .first_prompt = 100});
  REQUIRE(again.server->open(Version(0), Version(0), 3).ok());
  Worker c = again.worker(1);
  const Grant same = c.ask(Version(0), 12);
  std::map<std::uint64_t, std::uint64_t> seed_of;
  for (const Sample& s : all) seed_of[s.id.value()] = s.seed;
  REQUIRE(same.samples.size() == 3 * kG);
  for (const Sample& s : same.samples) CHECK(seed_of.at(s.id.value()) == s.seed);
}

TEST_CASE("grpo dispatch: one-step opens the next batch for the weights being trained on", "[grpo_dispatch]") {
  constexpr std::uint32_t kG = 2;
  constexpr std::uint64_t kB = 2;
  Actor actor({.group_size = kG, .seed = 5});
  Worker w0 = actor.worker(1);
  Worker w1 = actor.worker(2);
  REQUIRE(actor.server->open(Version(0), async_grpo::kAnyNewer, kB).ok());
  const Grant batch0 = w0.ask(Version(0), 8);
  REQUIRE(batch0.samples.size() == kB * kG);
  actor.complete(batch0.samples);
  w0.held.clear();
  REQUIRE(actor.server->wait_done(kB, 0ns).ok());
  // The trainer trains on batch 0 (towards version 1) while batch 1 is generated with version 0.
  REQUIRE(actor.server->open(Version(0), async_grpo::kAnyNewer, kB).ok());
  const Grant part = w0.ask(Version(0), 2);
  REQUIRE(part.samples.size() == kG);
  CHECK(part.samples[0].prompt_index == 2);
  // Version 1 is published: what is left of batch 1 goes to the newer weights too.
  REQUIRE(actor.server->set_newest_version(Version(1)).ok());
  const Grant rest = w1.ask(Version(1), 8);
  REQUIRE(rest.samples.size() == kG);
  CHECK(rest.samples[0].prompt_index == 3);
  actor.complete(part.samples);
  actor.complete(rest.samples);
  w0.held.clear();
  REQUIRE(actor.server->wait_done(2 * kB, 0ns).ok());
  // Batch 2 is for version 1, generated while the trainer trains on batch 1.
  REQUIRE(actor.server->open(Version(1), async_grpo::kAnyNewer, kB).ok());
  const Grant behind = w0.ask(Version(0), 8);
  CHECK(behind.kind == GrantKind::kPullNewer);
  CHECK(behind.pull_version == Version(1));
  const Grant batch2 = w1.ask(Version(1), 8);
  CHECK(batch2.samples.size() == kB * kG);
  std::set<std::uint64_t> p2;
  for (const Sample& s : batch2.samples) p2.insert(s.prompt_index);
  CHECK(p2 == std::set<std::uint64_t>{4, 5});
  CHECK(actor.server->stats().groups_made == 3 * kB);
}

TEST_CASE("grpo dispatch: the laminar stream bounds staleness and samples in flight", "[grpo_dispatch]") {
  constexpr std::uint32_t kG = 2;
  Actor actor({.group_size = kG, .seed = 3});
  expect_code(actor.server->set_stream({.max_staleness = 1, .max_in_flight = 1}), StatusCode::kInvalidArgument,
              "below one group");
  REQUIRE(actor.server->set_newest_version(Version(5)).ok());
  REQUIRE(actor.server->set_stream({.max_staleness = 1, .max_in_flight = 6}).ok());
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
  CHECK(actor.server->stats().in_flight == 6);
  // A group's completion makes room for one more.
  actor.complete({ga.samples[0], ga.samples[1]});
  const Grant gb = b.ask(Version(5), 10);
  CHECK(gb.samples.size() == kG);
  CHECK(gb.samples[0].prompt_index == 3);
  // Newer weights published: version 4 falls out of the bound, 5 stays in.
  REQUIRE(actor.server->set_newest_version(Version(6)).ok());
  expect_code(actor.server->set_newest_version(Version(5)), StatusCode::kInvalidArgument, "older than the newest");
  actor.complete(gb.samples);
  const Grant behind = a.ask(Version(4), 10);
  CHECK(behind.kind == GrantKind::kPullNewer);
  CHECK(behind.pull_version == Version(5));
  CHECK(b.ask(Version(5), 10).samples.size() == kG);
  CHECK(actor.server->stats().in_flight == 6);
  // Stopped: no group more, however much room.
  actor.server->stop_stream();
  actor.complete({ga.samples.begin() + 2, ga.samples.end()});
  // Asked without blocking, as a decode loop does.
  async_grpo::PendingGrant pending = b.client->request_async(Version(6), 10, b.held);
  REQUIRE(eventually([&] { return pending.ready(); }));
  laminar::Result<Grant> none = pending.get();
  REQUIRE(none.ok());
  CHECK(none->kind == GrantKind::kNothing);
  CHECK(pending.get().status().code() == StatusCode::kFailedPrecondition);
  CHECK(actor.server->stats().groups_made == 5);
}

TEST_CASE("grpo dispatch: on_available hears what a request on the newest weights could take, as it changes",
          "[grpo_dispatch]") {
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
  REQUIRE(actor.server->set_newest_version(Version(5)).ok());
  CHECK(heard_now() == std::vector<std::uint64_t>{0});
  // The stream's room is what may be handed out, though no group of it is made yet.
  REQUIRE(actor.server->set_stream({.max_staleness = 1, .max_in_flight = 6}).ok());
  CHECK(actor.server->stats().available == 6);
  CHECK(actor.server->stats().groups_made == 0);
  Worker a = actor.worker(1);
  const Grant ga = a.ask(Version(5), 4);
  REQUIRE(ga.samples.size() == 4);
  CHECK(heard_now() == std::vector<std::uint64_t>{0, 6, 2});
  // A batch group for the newest weights takes the stream's last room: 2 all the same, unheard.
  REQUIRE(actor.server->open(Version(5), Version(5), 1).ok());
  // One for older weights only is not counted.
  REQUIRE(actor.server->open(Version(4), Version(4), 1).ok());
  CHECK(actor.server->stats().waiting == 4);
  CHECK(actor.server->stats().available == 2);
  CHECK(heard_now() == std::vector<std::uint64_t>{0, 6, 2});
  // Completions make room for one more stream group once two samples are done.
  actor.complete(ga.samples);
  CHECK(heard_now() == std::vector<std::uint64_t>{0, 6, 2, 4});
  actor.server->stop_stream();
  CHECK(heard_now() == std::vector<std::uint64_t>{0, 6, 2, 4, 2});
  CHECK_THAT(actor.server->stats().to_json(), Catch::Contains(R"("available":2})"));
}

TEST_CASE("grpo dispatch: every sample completes exactly once under duplicate completions", "[grpo_dispatch]") {
  const unsigned seed = std::random_device{}();
  std::printf("grpo dispatch duplicates seed %u\n", seed);
  std::mt19937 rng(seed);
  constexpr std::uint32_t kG = 3;
  Actor actor({.group_size = kG, .seed = 9});
  REQUIRE(actor.server->open(Version(0), Version(0), 4).ok());
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
      laminar::Result<async_grpo::Completion> c = actor.server->completed(id);
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
  laminar::Result<Grant> g = a.client->request(Version(0), 0, held);
  REQUIRE(g.ok());
  std::set<std::uint64_t> dropped;
  for (TrajectoryId id : g->drop) dropped.insert(id.value());
  CHECK(dropped == done);
  // The worker goes: only its samples not completed come back, and never a completed one.
  a.client->close();
  REQUIRE(eventually([&] { return actor.server->stats().lost_workers == 1; }));
  const Grant gb = b.ask(Version(0), 12);
  for (const Sample& s : gb.samples) CHECK(done.count(s.id.value()) == 0);
  CHECK(gb.samples.size() == 12 - done.size());
  complete(1);  // then the odd ids, which b now holds
  CHECK(done.size() == 12);
  CHECK(groups_done == 4);
  // A group done is forgotten, and its ids still count as duplicates.
  laminar::Result<async_grpo::Completion> late = actor.server->completed(ga.samples[0].id);
  REQUIRE(late.ok());
  CHECK(late->duplicate);
  ++duplicates;
  expect_code(actor.server->completed(TrajectoryId(12 * kG)).status(), StatusCode::kNotFound, "of no group made");
  const async_grpo::PromptServerStats st = actor.server->stats();
  CHECK(st.completed == 12);
  CHECK(st.duplicates == duplicates);
  CHECK(st.groups_done == 4);
  CHECK(st.in_flight == 0);
  CHECK(b.ask(Version(0), 12).kind == GrantKind::kNothing);
}

TEST_CASE("grpo dispatch: a held id claimed by another worker is not reissued when its first worker goes",
          "[grpo_dispatch]") {
  constexpr std::uint32_t kG = 4;
  Actor actor({.group_size = kG, .seed = 2});
  REQUIRE(actor.server->open(Version(0), Version(0), 1).ok());
  Worker a = actor.worker(1);
  Worker b = actor.worker(2);
  Worker c = actor.worker(3);
  const Grant ga = a.ask(Version(0), 4);
  REQUIRE(ga.samples.size() == 4);
  // Sample 1 migrates from a to b: b claims it first, then a stops listing it.
  b.held = {ga.samples[1].id};
  CHECK(b.ask(Version(0), 0).kind == GrantKind::kNothing);
  CHECK(actor.server->stats().claimed == 1);
  a.held.erase(a.held.begin() + 1);
  (void)a.ask(Version(0), 0);
  a.transport.reset();
  a.client.reset();
  REQUIRE(eventually([&] { return actor.server->stats().lost_workers == 1; }));
  const Grant gc = c.ask(Version(0), 8);
  CHECK(ids_of(gc.samples) == ids_of({ga.samples[0], ga.samples[2], ga.samples[3]}));
  // Handed out again as the same samples: same ids, same seeds.
  for (const Sample& s : gc.samples) {
    CHECK(std::find(ga.samples.begin(), ga.samples.end(), s) != ga.samples.end());
  }
  CHECK(actor.server->stats().reissued == 3);
  // b goes too: its claim comes back.
  b.client->close();
  REQUIRE(eventually([&] { return actor.server->stats().lost_workers == 2; }));
  const Grant again = c.ask(Version(0), 8);
  REQUIRE(again.samples.size() == 1);
  CHECK(again.samples[0] == ga.samples[1]);
  actor.complete(ga.samples);
  CHECK(actor.server->stats().groups_done == 1);
}

TEST_CASE("grpo dispatch: a worker whose connection closes has its samples handed to another", "[grpo_dispatch]") {
  constexpr std::uint32_t kG = 4;
  Actor actor({.group_size = kG, .seed = 4});
  REQUIRE(actor.server->open(Version(0), Version(0), 3).ok());
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
  REQUIRE(eventually([&] { return actor.server->stats().lost_workers == 1; }));
  CHECK(actor.server->stats().workers == 1);
  CHECK(actor.server->stats().waiting == 8);
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
  const async_grpo::PromptServerStats st = actor.server->stats();
  CHECK(st.groups_done == 3);
  CHECK(st.completed == 12);
  CHECK(st.duplicates == 0);
  CHECK(st.reissued == 8);
}

TEST_CASE("grpo dispatch: a silent worker and an unclaimed sample lose their lease on the server's clock",
          "[grpo_dispatch]") {
  auto clock = std::make_shared<laminar::ManualClock>();
  constexpr std::uint32_t kG = 2;
  Actor actor({.group_size = kG, .seed = 6, .lease = 10s, .clock = clock});
  REQUIRE(actor.server->open(Version(0), Version(0), 2).ok());
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
  CHECK(actor.server->stats().lost_workers == 0);
  REQUIRE(clock->advance(1ns).ok());
  REQUIRE(eventually([&] { return actor.server->stats().lost_workers == 1; }));
  (void)b.ask(Version(0), 0);
  const Grant gc = c.ask(Version(0), 4);
  CHECK(ids_of(gc.samples) == ids_of(ga.samples));
  // b's unlisted sample comes back one lease after b stopped listing it; b itself stays.
  REQUIRE(clock->advance(6s).ok());
  (void)b.ask(Version(0), 0);
  REQUIRE(eventually([&] { return actor.server->stats().waiting == 1; }));
  const Grant gc2 = c.ask(Version(0), 4);
  REQUIRE(gc2.samples.size() == 1);
  CHECK(gc2.samples[0] == gb.samples[1]);
  CHECK(actor.server->stats().lost_workers == 1);
  CHECK(actor.server->stats().reissued == 3);
}

TEST_CASE("grpo dispatch: malformed and invalid requests are refused and the server keeps serving",
          "[grpo_dispatch]") {
  constexpr std::uint32_t kG = 2;
  Actor actor({.group_size = kG, .seed = 1, .max_workers = 2, .max_held = 8});
  REQUIRE(actor.server->open(Version(0), Version(0), 2).ok());
  std::shared_ptr<Transport> raw_tr = make_transport(kToken);
  laminar::Endpoint raw = raw_tr->connect(actor.addr).value();
  auto send = [&](std::vector<std::byte> body) {
    return raw.request(laminar::Message{async_grpo::kPromptRequestMessage, std::move(body)}).status();
  };
  auto request = [&](async_grpo::PromptRequest q) { return send(async_grpo::encode_prompt_request(q)); };
  expect_code(send({}), StatusCode::kDataLoss, "magic truncated");
  expect_code(send(std::vector<std::byte>(40, std::byte{0x5a})), StatusCode::kDataLoss, "not the expected magic");
  std::vector<std::byte> lying = async_grpo::encode_prompt_request({WorkerId(1), Version(0), 1, {}});
  lying[20] = std::byte{4};  // four held ids announced, none there
  expect_code(send(lying), StatusCode::kDataLoss, "runs past the end");
  expect_code(request({WorkerId(1), Version(0), 1, std::vector<TrajectoryId>(9, TrajectoryId(0))}),
              StatusCode::kInvalidArgument, "held count is 9, above 8");
  expect_code(request({WorkerId(1), Version(0), 7, {TrajectoryId(0), TrajectoryId(1)}}),
              StatusCode::kInvalidArgument, "above max_held 8");
  expect_code(request({WorkerId(1), Version(0), 1, {TrajectoryId(4)}}), StatusCode::kInvalidArgument,
              "of no group made");
  CHECK(actor.server->stats().refused == 6);
  CHECK(actor.server->stats().workers == 0);

  // The refusals changed nothing: two workers fill the server, a third is refused.
  Worker a = actor.worker(1);
  Worker b = actor.worker(2);
  CHECK(a.ask(Version(0), 2).samples.size() == kG);
  CHECK(b.ask(Version(0), 2).samples.size() == kG);
  Worker c = actor.worker(3);
  expect_code(c.client->request(Version(0), 2, {}).status(), StatusCode::kResourceExhausted, "max_workers 2");
  // Worker 1's id on another connection: its process started again, and what it held comes back.
  laminar::Result<laminar::Message> restarted = raw.request(laminar::Message{
      async_grpo::kPromptRequestMessage, async_grpo::encode_prompt_request({WorkerId(1), Version(0), 2, {}})});
  REQUIRE(restarted.ok());
  laminar::Result<Grant> rg = async_grpo::decode_grant(restarted->body, 2, 0);
  REQUIRE(rg.ok());
  CHECK(ids_of(rg->samples) == std::set<std::uint64_t>{a.held[0].value(), a.held[1].value()});
  // That connection now serves worker 1: another id on it is refused, and worker 2 keeps its samples.
  expect_code(request({WorkerId(2), Version(0), 1, {}}), StatusCode::kInvalidArgument,
              "worker 2 asks on the connection of worker 1");
  const async_grpo::PromptServerStats st = actor.server->stats();
  CHECK(st.lost_workers == 1);
  CHECK(st.reissued == kG);
  CHECK(st.handed_out == 3 * kG);
  CHECK(st.refused == 8);
  CHECK(st.workers == 2);
  CHECK(actor.server->background_error().ok());

  // Entry points check their arguments.
  expect_code(PromptServer::create(nullptr, {.group_size = 1}).status(), StatusCode::kInvalidArgument,
              "transport is null");
  expect_code(PromptServer::create(actor.transport, {.group_size = 0}).status(), StatusCode::kInvalidArgument,
              "group_size 0");
  expect_code(PromptServer::create(actor.transport, {.group_size = 1, .lease = 0s}).status(),
              StatusCode::kInvalidArgument, "lease");
  expect_code(PromptServer::create(actor.transport, {.group_size = 1}).status(), StatusCode::kAlreadyExists,
              "another one serves");
  expect_code(actor.server->open(Version(0), Version(0), 0).status(), StatusCode::kInvalidArgument, "0 groups");
  expect_code(actor.server->open(Version(2), Version(1), 1).status(), StatusCode::kInvalidArgument, "[2, 1]");
  expect_code(actor.server->wait_done(1, -1s), StatusCode::kInvalidArgument, "timeout");
  Actor small({.group_size = 2, .max_open_groups = 3});
  REQUIRE(small.server->open(Version(0), Version(0), 3).ok());
  expect_code(small.server->open(Version(0), Version(0), 1).status(), StatusCode::kResourceExhausted,
              "max_open_groups 3");
  expect_code(PromptClient::create(nullptr, {.worker = WorkerId(1), .server = actor.addr}).status(),
              StatusCode::kInvalidArgument, "transport is null");
  expect_code(PromptClient::create(raw_tr, {.worker = WorkerId(1), .server = actor.addr, .retry_interval = 0s})
                  .status(),
              StatusCode::kInvalidArgument, "retry_interval 0");
  expect_code(a.client->request(Version(0), 1, {}, 0s).status(), StatusCode::kInvalidArgument, "timeout");
}

TEST_CASE("grpo dispatch: a rollout worker process killed mid-run loses no sample", "[grpo_dispatch][process]") {
  constexpr std::uint32_t kG = 4;
  constexpr std::uint64_t kGroups = 4;
  // The lease only backs up the connection's close, which the kill brings.
  Actor actor({.group_size = kG, .seed = 21, .lease = 60s});
  REQUIRE(actor.server->set_newest_version(Version(1)).ok());
  REQUIRE(actor.server->open(Version(1), Version(1), kGroups).ok());
  laminar::testing::ChildOptions co;
  co.program = LAMINAR_GRPO_DISPATCH_CHILD;
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
      laminar::Result<async_grpo::Completion> c = actor.server->completed(TrajectoryId(id));
      REQUIRE(c.ok());
      CHECK_FALSE(c->duplicate);
      done.insert(id);
    }
  }
  REQUIRE(child_seed.size() == 12);
  REQUIRE(done.size() == 5);
  CHECK(actor.server->stats().workers == 1);
  child->kill(SIGKILL);
  laminar::Result<int> code = child->wait(10s);
  REQUIRE(code.ok());
  CHECK(*code == 128 + SIGKILL);
  REQUIRE(eventually([&] { return actor.server->stats().lost_workers == 1; }, 20s));

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
  const async_grpo::PromptServerStats st = actor.server->stats();
  INFO(st.to_json());
  CHECK(st.groups_done == kGroups);
  CHECK(st.completed == kGroups * kG);
  CHECK(st.duplicates == 0);
  CHECK(st.reissued == 12 - done.size());
  CHECK(st.in_flight == 0);
  CHECK_FALSE(child->running());
}

TEST_CASE("grpo dispatch: workers on threads take, migrate and finish samples while one dies, and each completes once",
          "[grpo_dispatch]") {
  const unsigned seed = std::random_device{}();
  std::printf("grpo dispatch threads seed %u\n", seed);
  constexpr std::uint32_t kG = 4;
  constexpr std::uint64_t kGroups = 30;
  constexpr int kWorkers = 4;
  constexpr int kVictim = 3;
  Actor actor({.group_size = kG, .seed = seed, .lease = 5s});
  REQUIRE(actor.server->open(Version(0), Version(0), kGroups).ok());
  std::vector<Worker> workers;
  for (int w = 0; w < kWorkers; ++w) workers.push_back(actor.worker(std::uint32_t(w + 1)));
  // Work for the victim before the others start, however the threads are scheduled.
  REQUIRE(workers[kVictim].ask(Version(0), 8).samples.size() == 8);

  std::mutex mu;
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
        laminar::Result<Grant> g = me.client->request(Version(0), 1 + rng() % 6, me.held);
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
        if (g->kind != GrantKind::kWork) std::this_thread::sleep_for(1ms);
      }
    });
  }
  std::map<std::uint64_t, int> first_completions;
  std::uint64_t duplicates = 0;
  std::mt19937 rng(seed);
  const auto start = std::chrono::steady_clock::now();
  while (actor.server->stats().groups_done < kGroups && std::chrono::steady_clock::now() - start < 60s) {
    std::vector<TrajectoryId> batch;
    {
      std::lock_guard l(mu);
      batch.swap(finished);
    }
    for (TrajectoryId id : batch) {
      // Now and then the same id twice, as a retried push might bring it.
      for (unsigned k = 0; k <= (rng() % 10 == 0 ? 1u : 0u); ++k) {
        laminar::Result<async_grpo::Completion> c = actor.server->completed(id);
        CHECK(c.ok());
        if (!c.ok()) continue;
        if (c->duplicate) {
          ++duplicates;
        } else {
          ++first_completions[id.value()];
        }
      }
    }
    std::this_thread::sleep_for(1ms);
  }
  all_done = true;
  for (auto& t : threads) t.join();
  CHECK(failures == 0);
  const async_grpo::PromptServerStats st = actor.server->stats();
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
