// RepackCoordinator over real transports. The workers here are transports that report and take
// orders through the protocol's own messages (src/repack_wire.h), so each test states exactly what
// the coordinator is told; tests/repack_driver_test.cc runs it with real drivers and migrators.
#include "laminar/repack_coordinator.h"

#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "eventually.h"
#include "make_transport.h"
#include "laminar/transport.h"
#include "repack_wire.h"
#include "transport/protocol.h"

using laminar::Endpoint;
using laminar::ManualClock;
using laminar::Message;
using laminar::RepackCoordinator;
using laminar::RepackCoordinatorOptions;
using laminar::SequenceId;
using laminar::StatusCode;
using laminar::Transport;
using laminar::Version;
using laminar::WorkerId;
using laminar::WorkerSnapshot;
using laminar::internal::RepackOrders;
using laminar::testing::eventually;
using laminar::testing::make_transport;
using namespace std::chrono_literals;

namespace {

const char* kToken = "repack-coordinator-test-token-0123456789";
constexpr std::int32_t kPageSize = 4;

// A worker that drains: no waiting prompt, KV no longer growing, every slot a listed sequence.
// `seqs` are (id, tokens).
WorkerSnapshot draining(std::uint32_t id, Version v, const std::vector<std::pair<std::uint64_t, std::int64_t>>& seqs) {
  WorkerSnapshot w;
  w.id = WorkerId(id);
  w.version = v;
  w.pages_total = 64;
  w.slots_total = 8;
  w.step_time = 10ms;
  w.kv_stopped_growing = true;
  for (const auto& [seq, tokens] : seqs) {
    const std::int64_t pages = (tokens + kPageSize - 1) / kPageSize;
    w.sequences.push_back({SequenceId(seq), tokens, pages, std::nullopt});
    w.pages_used += pages;
  }
  w.slots_used = std::int32_t(seqs.size());
  return w;
}

struct Coordinated {
  std::shared_ptr<ManualClock> clock = std::make_shared<ManualClock>();
  std::shared_ptr<Transport> tr = make_transport(kToken);
  std::string addr = tr->listen("127.0.0.1", 0).value();
  std::unique_ptr<RepackCoordinator> coordinator;

  explicit Coordinated(RepackCoordinatorOptions o = options()) {
    o.clock = clock;
    auto c = RepackCoordinator::create(tr, std::move(o));
    REQUIRE(c.ok());
    coordinator = std::move(c).value();
  }
  static RepackCoordinatorOptions options() {
    RepackCoordinatorOptions o;
    o.tokens_per_page = kPageSize;
    o.min_plan_interval = 0s;  // every event plans at once; one test sets it
    o.stale_after = 3s;
    o.policy.strategy = laminar::RepackStrategy::kPaperBestFit;
    o.policy.growth_horizon_steps = 4;
    return o;
  }
  laminar::RepackCoordinatorStats stats() const { return coordinator->stats(); }
};

// A rollout worker's transport that reports by hand and keeps the orders it is sent.
struct Worker {
  std::mutex mu;
  std::vector<RepackOrders> orders;
  int malformed = 0;
  std::shared_ptr<Transport> tr = make_transport(kToken);
  std::string addr = tr->listen("127.0.0.1", 0).value();
  Endpoint to_coordinator;

  explicit Worker(const std::string& coordinator) {
    REQUIRE(laminar::internal::on_protocol_message(*tr, laminar::internal::kRepackOrdersMessage,
                                                   [this](laminar::Incoming in) {
                                                     auto o = laminar::internal::decode_repack_orders(in.message.body);
                                                     std::lock_guard l(mu);
                                                     if (o.ok()) {
                                                       orders.push_back(std::move(o).value());
                                                     } else {
                                                       ++malformed;
                                                     }
                                                   })
                .ok());
    to_coordinator = tr->connect(coordinator).value();
  }
  ~Worker() { (void)laminar::internal::on_protocol_message(*tr, laminar::internal::kRepackOrdersMessage, {}); }

  void report(std::uint64_t number, const WorkerSnapshot& s, bool migrating = false) {
    const laminar::internal::RepackReport r{number, migrating, addr, s};
    REQUIRE(laminar::internal::send_protocol(
                to_coordinator,
                Message{laminar::internal::kRepackReportMessage, laminar::internal::encode_repack_report(r)})
                .ok());
  }
  std::vector<RepackOrders> received() {
    std::lock_guard l(mu);
    return orders;
  }
};

}  // namespace

TEST_CASE("repack coordinator: a newer version plans at once and orders the smaller worker onto the other") {
  Coordinated c;
  Worker small(c.addr), big(c.addr);
  // Each new worker plans; all on the newest version (0), nothing moves.
  small.report(1, draining(1, Version(0), {{10, 6}}));
  REQUIRE(eventually([&] { return c.stats().plans == 1; }));
  big.report(1, draining(2, Version(0), {{20, 9}, {21, 13}, {22, 5}}));
  REQUIRE(eventually([&] { return c.stats().plans == 2; }));
  CHECK(c.stats().moves == 0);

  REQUIRE(c.coordinator->set_newest_version(Version(1)).ok());
  REQUIRE(eventually([&] { return c.stats().orders_sent == 1; }));
  REQUIRE(eventually([&] { return small.received().size() == 1; }));
  const RepackOrders o = small.received()[0];
  CHECK(o.plan == 3);  // after the two reports' plans
  CHECK(o.report == 1);
  CHECK(o.version == Version(0));
  REQUIRE(o.destinations.size() == 1);
  CHECK(o.destinations[0].worker == WorkerId(2));
  CHECK(o.destinations[0].migrator_address == big.addr);
  CHECK(o.destinations[0].sequences == std::vector<SequenceId>{SequenceId(10)});
  CHECK(big.received().empty());
  laminar::RepackCoordinatorStats st = c.stats();
  CHECK(st.plans == 3);
  CHECK(st.planned_workers == 2);
  CHECK(st.moves == 1);
  CHECK(st.workers_freed == 1);
  CHECK(st.orders_failed == 0);
  CHECK_THAT(st.to_json(), Catch::Contains(R"("plans":3,)") && Catch::Contains(R"("moves":1,)"));
  // Never told of the prompts: the plan did not know them.
  CHECK_FALSE(st.prompts_waiting.has_value());
  CHECK_THAT(st.to_json(), Catch::Contains(R"("prompts_waiting":null)"));

  // Both were named in that plan, so the next one leaves them out until they report again.
  REQUIRE(c.coordinator->set_newest_version(Version(2)).ok());
  REQUIRE(eventually([&] { return c.stats().plans == 4; }));
  CHECK(c.stats().planned_workers == 0);
  CHECK(c.stats().left_out == 2);
  CHECK(c.stats().moves == 1);
  // Their keep-alives (the same reports again) bring neither back, nor plan.
  small.report(1, draining(1, Version(0), {{10, 6}}));
  big.report(1, draining(2, Version(0), {{20, 9}, {21, 13}, {22, 5}}));
  REQUIRE(eventually([&] { return c.stats().keepalives == 2; }));
  // Reporting again does, each a plan: small's still leaves big out, big's moves small.
  small.report(2, draining(1, Version(0), {{10, 7}}));
  REQUIRE(eventually([&] { return c.stats().plans == 5; }));
  CHECK(c.stats().moves == 1);
  big.report(2, draining(2, Version(0), {{20, 10}, {21, 14}, {22, 6}}));
  REQUIRE(eventually([&] { return small.received().size() == 2; }));
  CHECK(small.received()[1].report == 2);
  CHECK(small.received()[1].plan == 6);
  CHECK(c.stats().moves == 2);
  CHECK(c.stats().plans == 6);
  CHECK(c.stats().reports == 4);
  CHECK(c.coordinator->background_error().ok());
}

TEST_CASE("repack coordinator: under the cost-aware policy, workers are freed only while prompts wait for them") {
  RepackCoordinatorOptions o = Coordinated::options();
  o.stale_after = 10s;  // one report each serves every plan below
  o.policy.strategy = laminar::RepackStrategy::kCostAware;
  o.policy.max_tail_growth = INFINITY;
  o.policy.min_gain = laminar::Duration::min();
  Coordinated c(o);
  // One event at a time, each planned before the next: events that arrive while a plan runs
  // share the next one, and the counts below would not be exact.
  REQUIRE(c.coordinator->set_prompts_waiting(0).ok());
  CHECK(c.coordinator->prompts_waiting() == 0);
  REQUIRE(eventually([&] { return c.stats().plans == 1; }));
  Worker small(c.addr), big(c.addr), fresh(c.addr);
  small.report(1, draining(1, Version(0), {{10, 6}}));
  REQUIRE(eventually([&] { return c.stats().plans == 2; }));
  big.report(1, draining(2, Version(0), {{20, 9}, {21, 13}, {22, 5}}));
  REQUIRE(eventually([&] { return c.stats().plans == 3; }));
  fresh.report(1, draining(3, Version(1), {{30, 5}, {31, 5}}));  // the newest version, 6 slots free
  REQUIRE(eventually([&] { return c.stats().plans == 4; }));
  CHECK(c.stats().reports == 3);
  const std::uint64_t plans = c.stats().plans;

  // Without a waiting prompt the small worker stays (the first test moves it).
  REQUIRE(c.coordinator->set_newest_version(Version(1)).ok());
  REQUIRE(eventually([&] { return c.stats().plans == plans + 1; }));
  laminar::RepackCoordinatorStats st = c.stats();
  CHECK(st.planned_workers == 3);
  CHECK(st.prompts_waiting == 0);
  CHECK(st.moves == 0);
  CHECK_THAT(st.to_json(), Catch::Contains(R"("prompts_waiting":0})"));

  // As many as the newest version's free slots take: still nothing to free. A new count plans at
  // once; the same count again does not.
  REQUIRE(c.coordinator->set_prompts_waiting(6).ok());
  REQUIRE(eventually([&] { return c.stats().plans == plans + 2; }));
  CHECK(c.stats().prompts_waiting == 6);
  CHECK(c.stats().moves == 0);
  CHECK(small.received().empty());
  REQUIRE(c.coordinator->set_prompts_waiting(6).ok());

  // More than they take: the small worker is freed for them.
  REQUIRE(c.coordinator->set_prompts_waiting(100).ok());
  REQUIRE(eventually([&] { return small.received().size() == 1; }));
  st = c.stats();
  CHECK(st.plans == plans + 3);
  CHECK(st.prompts_waiting == 100);
  CHECK(st.moves == 1);
  CHECK(st.workers_freed == 1);
  const RepackOrders orders = small.received()[0];
  REQUIRE(orders.destinations.size() == 1);
  CHECK(orders.destinations[0].worker == WorkerId(2));
  CHECK(orders.destinations[0].sequences == std::vector<SequenceId>{SequenceId(10)});
  CHECK(big.received().empty());
  CHECK(fresh.received().empty());
  CHECK(c.coordinator->background_error().ok());
}

TEST_CASE("repack coordinator: a worker whose reports stop is left out of plans") {
  Coordinated c;
  Worker small(c.addr), big(c.addr);
  small.report(1, draining(1, Version(0), {{10, 6}}));
  REQUIRE(eventually([&] { return c.stats().plans == 1; }));
  big.report(1, draining(2, Version(0), {{20, 9}, {21, 13}}));
  REQUIRE(eventually([&] { return c.stats().plans == 2; }));
  REQUIRE(c.clock->advance(4s).ok());  // past stale_after (3 s): no plan, nothing happened
  small.report(2, draining(1, Version(0), {{10, 7}}));
  REQUIRE(eventually([&] { return c.stats().reports == 3; }));
  REQUIRE(eventually([&] { return c.stats().plans == 3; }));

  REQUIRE(c.coordinator->set_newest_version(Version(1)).ok());
  REQUIRE(eventually([&] { return c.stats().plans == 4; }));
  laminar::RepackCoordinatorStats st = c.stats();
  CHECK(st.planned_workers == 1);
  CHECK(st.left_out == 1);
  CHECK(st.moves == 0);
  CHECK(st.orders_sent == 0);

  // Reporting again brings it back, and plans: it moves small's sequence.
  big.report(2, draining(2, Version(0), {{20, 10}, {21, 14}}));
  REQUIRE(eventually([&] { return small.received().size() == 1; }));
  CHECK(c.stats().plans == 5);
  CHECK(small.received()[0].destinations[0].worker == WorkerId(2));
  CHECK(c.stats().planned_workers == 2);
}

TEST_CASE("repack coordinator: migrating workers, and two workers reporting one sequence, are left out") {
  Coordinated c;
  Worker a(c.addr), b(c.addr), busy(c.addr), dest(c.addr);
  // Each new worker plans; one at a time, so that no plan is still running when the version moves
  // (one running then would count as the version's plan, and the next would pass it).
  a.report(1, draining(1, Version(0), {{10, 6}}));
  REQUIRE(eventually([&] { return c.stats().plans == 1; }));
  b.report(1, draining(2, Version(0), {{10, 6}, {11, 3}}));  // 10 committed at b, not yet released at a
  REQUIRE(eventually([&] { return c.stats().plans == 2; }));
  busy.report(1, draining(3, Version(0), {{30, 3}}), true);
  REQUIRE(eventually([&] { return c.stats().plans == 3; }));
  dest.report(1, draining(4, Version(0), {{40, 20}, {41, 20}}));
  REQUIRE(eventually([&] { return c.stats().plans == 4; }));
  CHECK(c.stats().reports == 4);
  REQUIRE(c.coordinator->set_newest_version(Version(1)).ok());
  REQUIRE(eventually([&] { return c.stats().plans == 5; }));
  const laminar::RepackCoordinatorStats st = c.stats();
  CHECK(st.planned_workers == 1);
  CHECK(st.left_out == 3);
  CHECK(st.moves == 0);
  CHECK(c.coordinator->background_error().ok());
}

TEST_CASE("repack coordinator: malformed, invalid and replayed reports are refused, and planning goes on") {
  Coordinated c;
  const std::uint32_t seed = std::random_device{}();
  INFO("seed " << seed);
  std::printf("repack coordinator: random report bodies, seed %u\n", seed);
  std::mt19937 rng(seed);
  auto peer = make_transport(kToken);
  Endpoint raw = peer->connect(c.addr).value();
  auto send = [&](std::vector<std::byte> body) {
    REQUIRE(laminar::internal::send_protocol(raw, Message{laminar::internal::kRepackReportMessage, std::move(body)})
                .ok());
  };
  std::uint64_t refused = 0;
  send({});
  send({std::byte{'h'}, std::byte{'i'}});
  refused += 2;
  laminar::internal::RepackReport good{1, false, "127.0.0.1:1", draining(7, Version(0), {{70, 5}})};
  good.snapshot.waiting_prompts = 1;  // not draining: no part in the plan below
  std::vector<std::byte> body = laminar::internal::encode_repack_report(good);
  body.pop_back();
  send(body);
  ++refused;
  laminar::internal::RepackReport bad = good;
  bad.snapshot.pages_used = bad.snapshot.pages_total + 1;  // plan_repack's preconditions
  send(laminar::internal::encode_repack_report(bad));
  bad = good;
  bad.snapshot.sequences[0].pages = 0;  // 5 tokens in no page
  send(laminar::internal::encode_repack_report(bad));
  bad = good;
  bad.snapshot.step_time = -1ns;
  send(laminar::internal::encode_repack_report(bad));
  refused += 3;
  for (int i = 0; i < 200; ++i) {
    std::vector<std::byte> junk(std::uniform_int_distribution<std::size_t>(0, 300)(rng));
    for (std::byte& x : junk) x = std::byte(rng());
    send(junk);
  }
  // The good one, then again on the same connection (a keep-alive), then the same number with
  // other content (a replay).
  send(laminar::internal::encode_repack_report(good));
  send(laminar::internal::encode_repack_report(good));
  laminar::internal::RepackReport replay = good;
  replay.snapshot.waiting_prompts = 2;
  send(laminar::internal::encode_repack_report(replay));
  ++refused;
  REQUIRE(eventually([&] {
    return c.stats().reports + c.stats().keepalives + c.stats().reports_refused == 2 + refused + 200;
  }));
  CHECK(c.stats().reports_refused == refused + 200);
  CHECK(c.stats().reports == 1);
  CHECK(c.stats().keepalives == 1);

  // It still plans from the good reports.
  Worker small(c.addr), big(c.addr);
  small.report(1, draining(1, Version(0), {{10, 6}}));
  big.report(1, draining(2, Version(0), {{20, 9}, {21, 13}}));
  REQUIRE(eventually([&] { return c.stats().workers == 3; }));
  REQUIRE(c.coordinator->set_newest_version(Version(1)).ok());
  REQUIRE(eventually([&] { return small.received().size() == 1; }));
  CHECK(c.coordinator->background_error().ok());
}

TEST_CASE("repack coordinator: at most max_workers reports are kept, and a stale one makes room") {
  RepackCoordinatorOptions o = Coordinated::options();
  o.max_workers = 2;
  Coordinated c(o);
  Worker a(c.addr), b(c.addr), late(c.addr);
  a.report(1, draining(1, Version(0), {{10, 6}}));
  b.report(1, draining(2, Version(0), {{20, 6}}));
  REQUIRE(eventually([&] { return c.stats().reports == 2; }));
  late.report(1, draining(3, Version(0), {{30, 6}}));
  REQUIRE(eventually([&] { return c.stats().reports_refused == 1; }));
  CHECK(c.stats().workers == 2);

  REQUIRE(c.clock->advance(4s).ok());
  b.report(2, draining(2, Version(0), {{20, 7}}));
  REQUIRE(eventually([&] { return c.stats().reports == 3; }));
  late.report(2, draining(3, Version(0), {{30, 7}}));  // takes the place of a's stale report
  REQUIRE(eventually([&] { return c.stats().reports == 4; }));
  CHECK(c.stats().workers == 2);
  CHECK(c.stats().reports_refused == 1);
}

TEST_CASE("repack coordinator: options and versions are checked") {
  auto tr = make_transport(kToken);
  auto expect = [&](RepackCoordinatorOptions o, StatusCode code, const char* needle) {
    auto c = RepackCoordinator::create(tr, std::move(o));
    REQUIRE_FALSE(c.ok());
    INFO(c.status().to_string());
    CHECK(c.status().code() == code);
    CHECK_THAT(c.status().message(), Catch::Contains(needle));
  };
  const RepackCoordinatorOptions good = Coordinated::options();
  {
    auto c = RepackCoordinator::create(nullptr, good);
    REQUIRE_FALSE(c.ok());
    CHECK(c.status().code() == StatusCode::kInvalidArgument);
  }
  RepackCoordinatorOptions o = good;
  o.tokens_per_page = 0;
  expect(o, StatusCode::kInvalidArgument, "tokens_per_page 0");
  o = good;
  o.min_plan_interval = -1ns;
  expect(o, StatusCode::kInvalidArgument, "min_plan_interval -1 ns");
  o = good;
  o.stale_after = -1s;
  expect(o, StatusCode::kInvalidArgument, "stale_after -1000000000 ns");
  o = good;
  o.send_timeout = 0s;
  expect(o, StatusCode::kInvalidArgument, "send_timeout 0 ns");
  o = good;
  o.max_workers = 0;
  expect(o, StatusCode::kInvalidArgument, "max_workers 0");
  o = good;
  o.policy.link_bytes_per_s = 0;
  expect(o, StatusCode::kInvalidArgument, "policy");

  auto c = RepackCoordinator::create(tr, good);
  REQUIRE(c.ok());
  expect(good, StatusCode::kAlreadyExists, "another repack coordinator");
  REQUIRE((*c)->set_newest_version(Version(3)).ok());
  REQUIRE((*c)->set_newest_version(Version(3)).ok());
  const laminar::Status older = (*c)->set_newest_version(Version(2));
  CHECK(older.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(older.message(), Catch::Contains("version 2 is older than the newest, 3"));
  CHECK((*c)->newest_version() == Version(3));

  CHECK_FALSE((*c)->prompts_waiting().has_value());
  for (const std::int64_t bad : {std::int64_t(-1), (std::int64_t(1) << 40) + 1, INT64_MIN}) {
    const laminar::Status s = (*c)->set_prompts_waiting(bad);
    INFO(s.to_string());
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(s.message(), Catch::Contains(fmt::format("prompts_waiting is {},", bad)));
  }
  CHECK_FALSE((*c)->prompts_waiting().has_value());
  REQUIRE((*c)->set_prompts_waiting(std::int64_t(1) << 40).ok());
  CHECK((*c)->prompts_waiting() == std::int64_t(1) << 40);
  CHECK((*c)->set_prompts_waiting(-5).code() == StatusCode::kInvalidArgument);
  CHECK((*c)->prompts_waiting() == std::int64_t(1) << 40);
  c->reset();
  CHECK(RepackCoordinator::create(tr, good).ok());  // the transport is free again
}

TEST_CASE("repack coordinator: plans once per event that changes what a plan reads, and never on its own") {
  RepackCoordinatorOptions o = Coordinated::options();
  o.stale_after = 1000s;
  Coordinated c(o);
  Worker a(c.addr), b(c.addr);
  a.report(1, draining(1, Version(0), {{10, 6}}));
  REQUIRE(eventually([&] { return c.stats().plans == 1; }));
  b.report(1, draining(2, Version(0), {{20, 9}}));
  REQUIRE(eventually([&] { return c.stats().plans == 2; }));

  // Nothing happens for a long while, but keep-alives and a report that changes nothing a plan
  // reads (a new number, the same snapshot): no plan. A timer would have planned hundreds of times.
  REQUIRE(c.clock->advance(900s).ok());
  a.report(1, draining(1, Version(0), {{10, 6}}));
  b.report(1, draining(2, Version(0), {{20, 9}}));
  a.report(2, draining(1, Version(0), {{10, 6}}));
  REQUIRE(eventually([&] { return c.stats().keepalives == 2 && c.stats().reports == 3; }));
  // The same count twice plans once, then a newer version once.
  REQUIRE(c.coordinator->set_prompts_waiting(3).ok());
  REQUIRE(c.coordinator->set_prompts_waiting(3).ok());
  REQUIRE(eventually([&] { return c.stats().plans == 3; }));
  REQUIRE(c.coordinator->set_newest_version(Version(0)).ok());  // not newer: nothing
  REQUIRE(c.coordinator->set_newest_version(Version(1)).ok());
  REQUIRE(eventually([&] { return c.stats().plans == 4; }));
  // A changed report plans.
  b.report(2, draining(2, Version(0), {{20, 10}}));
  REQUIRE(eventually([&] { return c.stats().plans == 5; }));
  // Each event above was planned once: no plan ran on the idle stretch or the repeats.
  CHECK(c.stats().plans == 5);
  CHECK(c.stats().reports == 4);
}

TEST_CASE("repack coordinator: events closer than min_plan_interval share one plan, that long after the last") {
  RepackCoordinatorOptions o = Coordinated::options();
  o.min_plan_interval = 2s;
  Coordinated c(o);
  Worker a(c.addr), b(c.addr);
  a.report(1, draining(1, Version(0), {{10, 6}}));
  REQUIRE(eventually([&] { return c.stats().plans == 1; }));  // the first plans at once
  b.report(1, draining(2, Version(0), {{20, 9}}));
  REQUIRE(eventually([&] { return c.stats().reports == 2; }));
  REQUIRE(c.coordinator->set_prompts_waiting(4).ok());
  REQUIRE(c.coordinator->set_newest_version(Version(1)).ok());
  REQUIRE(c.clock->advance(1s).ok());
  CHECK(c.stats().plans == 1);
  REQUIRE(c.clock->advance(1s).ok());
  REQUIRE(eventually([&] { return c.stats().plans == 2; }));
  CHECK(c.stats().prompts_waiting == 4);
  CHECK(c.stats().planned_workers == 2);
  CHECK(c.stats().plans == 2);
}
