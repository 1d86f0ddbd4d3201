// RepackDriver with real transports, paged KV caches and KvMigrators, a RepackCoordinator among
// them, all in one process. The test thread plays every worker's decode loop: it calls step(),
// acts on the migrator's events as KvMigrator's header says, and decodes one token per live
// sequence between steps (writing each token's K and V, so that what arrives can be checked), up
// to kMaxLength.
#include "laminar/repack_driver.h"

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdio>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "eventually.h"
#include "make_transport.h"
#include "laminar/kv_cache.h"
#include "laminar/kv_migrator.h"
#include "laminar/repack_coordinator.h"
#include "laminar/transport.h"
#include "repack_wire.h"
#include "transport/protocol.h"

using laminar::Endpoint;
using laminar::KvMigrator;
using laminar::ManualClock;
using laminar::Message;
using laminar::MigrationEvent;
using laminar::PagedKvCache;
using laminar::RepackCoordinator;
using laminar::RepackDriver;
using laminar::RepackDriverOptions;
using laminar::SequenceId;
using laminar::SequenceState;
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

const char* kToken = "repack-driver-test-token-0123456789";
constexpr std::int32_t kPageSize = 4;
constexpr std::int32_t kPages = 256;
// A sequence stops growing at this length, as if its decode step were held up there, so that the
// cache never runs out however many turns a test's loop takes.
constexpr std::int64_t kMaxLength = 48;

laminar::KvLayout layout() {
  laminar::KvLayout l;
  l.num_pages = kPages;
  l.page_size = kPageSize;
  l.num_kv_heads = 2;
  l.head_dim = 8;
  l.dtype = laminar::DType::kF32;
  l.num_layers = 2;
  return l;
}

// What token `pos` of sequence `id` holds in `layer`, K (v false) or V: distinct everywhere.
float kv_value(SequenceId id, std::int64_t pos, std::int32_t layer, bool v, int i) {
  return float(id.value() * 100000 + std::uint64_t(pos) * 100 + std::uint64_t(layer) * 40 + (v ? 20 : 0) + i);
}

// One rollout worker: its transport, cache, migrator and driver, and the engine state of what it
// decodes.
struct Worker {
  WorkerId id;
  Version version;
  std::shared_ptr<ManualClock> clock;
  std::shared_ptr<Transport> tr = make_transport(kToken);
  std::string addr = tr->listen("127.0.0.1", 0).value();
  std::shared_ptr<PagedKvCache> cache = std::make_shared<PagedKvCache>(PagedKvCache::create(layout()).value());
  std::shared_ptr<KvMigrator> mig;
  std::unique_ptr<RepackDriver> driver;
  std::map<SequenceId, SequenceState> live;  // decoded here (paused ones too)
  std::set<SequenceId> paused;
  std::map<SequenceId, std::int64_t> finished_at;  // length handed over in finish()
  std::map<SequenceId, std::int64_t> arrived_at;   // length of what arrived here
  laminar::Duration step_time = 10ms;               // what snapshots report
  int events = 0;

  Worker(std::uint32_t worker, Version v, std::shared_ptr<ManualClock> c, const std::string& coordinator)
      : id(worker), version(v), clock(std::move(c)) {
    laminar::KvMigratorOptions mo;
    mo.clock = clock;
    auto m = KvMigrator::create(tr, cache, mo);
    REQUIRE(m.ok());
    mig = std::move(m).value();
    mig->set_version(version);
    RepackDriverOptions o;
    o.worker = id;
    o.coordinator = coordinator;
    o.min_report_interval = 100ms;
    o.keepalive_interval = 1s;  // a third of the coordinator's stale_after
    o.clock = clock;
    auto d = RepackDriver::create(tr, mig, o);
    REQUIRE(d.ok());
    driver = std::move(d).value();
  }
  ~Worker() {
    driver.reset();
    mig.reset();
  }

  void write_token(SequenceId s, std::int64_t pos) {
    for (std::int32_t layer = 0; layer < 2; ++layer) {
      auto slot = cache->token_slot(s, pos, layer);
      REQUIRE(slot.ok());
      for (int i = 0; i < 16; ++i) {
        static_cast<float*>(slot->k)[i] = kv_value(s, pos, layer, false, i);
        static_cast<float*>(slot->v)[i] = kv_value(s, pos, layer, true, i);
      }
    }
  }
  bool holds_written(SequenceId s) {
    auto n = cache->length(s);
    if (!n.ok()) return false;
    for (std::int64_t pos = 0; pos < *n; ++pos) {
      for (std::int32_t layer = 0; layer < 2; ++layer) {
        auto slot = cache->token_slot(s, pos, layer);
        for (int i = 0; i < 16; ++i) {
          if (static_cast<float*>(slot->k)[i] != kv_value(s, pos, layer, false, i) ||
              static_cast<float*>(slot->v)[i] != kv_value(s, pos, layer, true, i)) {
            return false;
          }
        }
      }
    }
    return true;
  }

  // A sequence whose prompt of `tokens` tokens is in the cache.
  void start(std::uint64_t seq, std::int64_t tokens) {
    const SequenceId s(seq);
    REQUIRE(cache->add_sequence(s).ok());
    REQUIRE(cache->append_tokens(s, tokens).ok());
    for (std::int64_t pos = 0; pos < tokens; ++pos) write_token(s, pos);
    SequenceState st;
    st.sequence = s;
    st.trajectory = laminar::TrajectoryId(1000 + seq);
    st.version = version;
    st.seed = seq;
    st.kv_length = std::uint64_t(tokens);
    st.prompt_tokens.assign(std::size_t(tokens), 3);
    live[s] = st;
  }

  WorkerSnapshot snapshot() const {
    WorkerSnapshot w;
    w.id = id;
    w.version = version;
    w.pages_total = kPages;
    w.pages_used = cache->used_pages();
    w.slots_total = 8;
    w.slots_used = std::int32_t(live.size());
    w.step_time = step_time;
    w.kv_stopped_growing = true;
    for (const auto& [s, st] : live) {
      w.sequences.push_back({s, cache->length(s).value(), std::int64_t(cache->pages(s)->size()), std::nullopt});
    }
    return w;
  }

  void handle(MigrationEvent& e) {
    ++events;
    switch (e.kind) {
      case MigrationEvent::Kind::kPauseRequested: {
        std::vector<SequenceState> states;
        for (SequenceId s : e.sequences) {
          paused.insert(s);
          SequenceState st = live.at(s);
          st.kv_length = std::uint64_t(cache->length(s).value());
          finished_at[s] = std::int64_t(st.kv_length);
          states.push_back(std::move(st));
        }
        const laminar::Status f = mig->finish(e.id, std::move(states));
        INFO(f.to_string());
        REQUIRE(f.ok());
        break;
      }
      case MigrationEvent::Kind::kAborted:
        if (e.outgoing) {
          for (SequenceId s : e.sequences) paused.erase(s);
        }
        break;
      case MigrationEvent::Kind::kDone:
        for (SequenceId s : e.sequences) {
          live.erase(s);
          paused.erase(s);
        }
        break;
      case MigrationEvent::Kind::kArrived:
        for (const SequenceState& st : e.states) {
          live[st.sequence] = st;
          arrived_at[st.sequence] = std::int64_t(st.kv_length);
        }
        break;
    }
  }

  // One turn of the decode loop: the driver's step, then one token for each sequence decoding.
  void step() {
    auto events_now = driver->step(snapshot());
    INFO(events_now.status().to_string());
    REQUIRE(events_now.ok());
    for (MigrationEvent& e : *events_now) handle(e);
    for (auto& [s, st] : live) {
      const std::int64_t pos = cache->length(s).value();
      if (paused.contains(s) || pos >= kMaxLength) continue;
      REQUIRE(cache->append_tokens(s, 1).ok());
      write_token(s, pos);
      st.response_tokens.push_back(5);
      st.logprobs.push_back(-0.5f);
      st.kv_length = std::uint64_t(pos + 1);
    }
  }
};

struct Fleet {
  std::shared_ptr<ManualClock> clock = std::make_shared<ManualClock>();
  std::shared_ptr<Transport> tr = make_transport(kToken);
  std::string addr = tr->listen("127.0.0.1", 0).value();
  std::unique_ptr<RepackCoordinator> coordinator;

  Fleet() {
    laminar::RepackCoordinatorOptions o;
    o.tokens_per_page = kPageSize;
    o.stale_after = 3s;
    o.policy.strategy = laminar::RepackStrategy::kPaperBestFit;
    o.policy.growth_horizon_steps = 4;
    o.clock = clock;
    auto c = RepackCoordinator::create(tr, o);
    REQUIRE(c.ok());
    coordinator = std::move(c).value();
  }
  laminar::RepackCoordinatorStats stats() const { return coordinator->stats(); }
};

// Steps every worker in `loop` (one virtual millisecond a turn) until `done` or 30 s of real time.
template <class Done>
bool run_until(Fleet& f, const std::vector<Worker*>& loop, Done done) {
  return eventually(
      [&] {
        for (Worker* w : loop) w->step();
        REQUIRE(f.clock->advance(1ms).ok());
        return done();
      },
      30s);
}

}  // namespace

TEST_CASE("repack driver: a newer version moves the smaller worker's sequences onto the other") {
  Fleet f;
  Worker small(1, Version(0), f.clock, f.addr), big(2, Version(0), f.clock, f.addr);
  Worker newest(3, Version(1), f.clock, f.addr);  // already on the newest weights: left alone
  small.start(10, 5);
  small.start(11, 9);
  big.start(20, 7);
  big.start(21, 13);
  big.start(22, 6);
  big.start(23, 10);
  newest.start(30, 3);
  const std::vector<Worker*> all = {&small, &big, &newest};
  REQUIRE(run_until(f, all, [&] { return f.stats().reports >= 3; }));
  CHECK(f.stats().moves == 0);  // none before the newer version

  REQUIRE(f.coordinator->set_newest_version(Version(1)).ok());
  const bool moved = run_until(f, all, [&] { return small.live.empty() && big.live.size() == 6; });
  INFO("small " << small.driver->stats().to_json() << " " << small.mig->stats().to_json());
  INFO("big " << big.driver->stats().to_json() << " " << big.mig->stats().to_json());
  INFO("coordinator " << f.stats().to_json());
  REQUIRE(moved);

  CHECK(small.cache->num_sequences() == 0);
  CHECK(small.cache->used_pages() == 0);
  CHECK(small.cache->reserved_pages() == 0);
  for (std::uint64_t s : {10, 11}) {
    const SequenceId q(s);
    INFO("sequence " << s);
    REQUIRE(big.arrived_at.contains(q));
    CHECK(big.arrived_at.at(q) == small.finished_at.at(q));
    // Decoded since it arrived: its cache length is its state's, and every token is what was written.
    CHECK(big.cache->length(q).value() == std::int64_t(big.live.at(q).kv_length));
    CHECK(big.live.at(q).trajectory == laminar::TrajectoryId(1000 + s));
    CHECK(big.holds_written(q));
  }
  CHECK(big.cache->num_sequences() == 6);
  CHECK(big.cache->reserved_pages() == 0);
  CHECK(newest.live.size() == 1);
  CHECK(newest.events == 0);

  // Each plan that moved anything moved both sequences; orders that came after the migration
  // started name sequences already moving or gone, so exactly one migration ran.
  const laminar::RepackCoordinatorStats st = f.stats();
  CHECK(st.plans >= 1);
  CHECK(st.moves >= 2);
  CHECK(st.moves % 2 == 0);
  CHECK(st.workers_freed == st.moves / 2);
  CHECK(st.orders_sent == st.moves / 2);
  CHECK(st.orders_failed == 0);
  const laminar::RepackDriverStats ds = small.driver->stats();
  CHECK(ds.orders >= 1);
  CHECK(ds.migrations_started == 1);  // both sequences, one destination: one migration
  CHECK(ds.migrations_refused == 0);
  CHECK(small.mig->stats().done_out == 1);
  CHECK(big.mig->stats().done_in == 1);
  CHECK(f.coordinator->background_error().ok());
}

TEST_CASE("repack driver: a worker whose reports stop is left out of plans") {
  Fleet f;
  Worker small(1, Version(0), f.clock, f.addr), big(2, Version(0), f.clock, f.addr);
  small.start(10, 5);
  // More pages than small's one sequence can reach (kMaxLength), so big is never the smaller.
  big.start(20, 40);
  big.start(21, 44);
  REQUIRE(run_until(f, {&small, &big}, [&] { return f.stats().reports >= 2; }));

  // big's loop stops; small's goes on past stale_after. First every report either loop queued
  // goes out (after min_report_interval) and arrives, so that none arrives after the jump.
  REQUIRE(f.clock->advance(200ms).ok());
  REQUIRE(eventually(
      [&] {
        const laminar::RepackDriverStats a = small.driver->stats(), b = big.driver->stats();
        const laminar::RepackCoordinatorStats c = f.stats();
        return a.reports_queued == 0 && b.reports_queued == 0 &&
               c.reports + c.keepalives + c.reports_refused ==
                   a.reports_sent + a.keepalives_sent + b.reports_sent + b.keepalives_sent;
      },
      30s));
  REQUIRE(f.clock->advance(4s).ok());
  const std::uint64_t before = f.stats().reports;
  REQUIRE(run_until(f, {&small}, [&] { return f.stats().reports > before; }));
  const std::uint64_t plans = f.stats().plans;
  REQUIRE(f.coordinator->set_newest_version(Version(1)).ok());
  REQUIRE(run_until(f, {&small}, [&] { return f.stats().plans > plans; }));
  CHECK(f.stats().planned_workers == 1);
  CHECK(f.stats().left_out == 1);
  CHECK(f.stats().moves == 0);
  for (int i = 0; i < 500; ++i) {  // small's reports plan meanwhile
    small.step();
    REQUIRE(f.clock->advance(1ms).ok());
  }
  CHECK(f.stats().moves == 0);
  CHECK(small.live.size() == 1);
  CHECK(small.driver->stats().orders == 0);

  // Once big reports again, a plan moves small's sequence onto it.
  const bool moved = run_until(f, {&small, &big}, [&] { return small.live.empty() && big.live.size() == 3; });
  INFO("small " << small.driver->stats().to_json() << " " << small.mig->stats().to_json());
  INFO("big " << big.driver->stats().to_json() << " " << big.mig->stats().to_json());
  INFO("coordinator " << f.stats().to_json());
  REQUIRE(moved);
  CHECK(big.holds_written(SequenceId(10)));
  CHECK(small.cache->used_pages() == 0);
}

namespace {

// A coordinator played by hand: it keeps the reports of worker 1 and the connection they came on,
// and sends orders through it.
struct FakeCoordinator {
  std::mutex mu;
  std::vector<laminar::internal::RepackReport> reports;
  int malformed = 0;
  Endpoint from;
  std::shared_ptr<Transport> tr = make_transport(kToken);
  std::string addr;

  explicit FakeCoordinator(std::uint16_t port = 0) {
    auto a = tr->listen("127.0.0.1", port);
    REQUIRE(a.ok());
    addr = *a;
    REQUIRE(laminar::internal::on_protocol_message(*tr, laminar::internal::kRepackReportMessage,
                                                   [this](laminar::Incoming in) { take(in); })
                .ok());
  }
  ~FakeCoordinator() { (void)laminar::internal::on_protocol_message(*tr, laminar::internal::kRepackReportMessage, {}); }
  void take(const laminar::Incoming& in) {
    auto r = laminar::internal::decode_repack_report(in.message.body);
    std::lock_guard l(mu);
    if (!r.ok()) {
      ++malformed;
    } else if (r->snapshot.id == WorkerId(1)) {
      reports.push_back(std::move(r).value());
      from = in.from;
    }
  }
  std::size_t count() {
    std::lock_guard l(mu);
    return reports.size();
  }
  laminar::internal::RepackReport last() {
    std::lock_guard l(mu);
    return reports.back();
  }
  void send(std::vector<std::byte> body) {
    Endpoint ep;
    {
      std::lock_guard l(mu);
      ep = from;
    }
    REQUIRE(laminar::internal::send_protocol(ep, Message{laminar::internal::kRepackOrdersMessage, std::move(body)})
                .ok());
  }
};

}  // namespace

TEST_CASE("repack driver: reports go out on change at most every min_report_interval, keep alive, and stale, foreign or malformed orders are not taken") {
  auto clock = std::make_shared<ManualClock>();
  FakeCoordinator fc;
  Worker w(1, Version(4), clock, fc.addr);
  Worker other(2, Version(4), clock, fc.addr);  // a destination that exists, for the orders below
  // At kMaxLength: they no longer grow, so the snapshot stands still while the loop steps.
  w.start(10, kMaxLength);
  w.start(11, kMaxLength);

  // Before its first decode step the worker has no step time: the report waits for one.
  w.step_time = 0ms;
  w.step();
  CHECK(w.driver->stats().reports_held == 1);
  w.step_time = 10ms;
  w.step();
  REQUIRE(eventually([&] { return fc.count() == 1; }));
  CHECK(fc.last().snapshot.step_time == 10ms);
  CHECK(fc.last().report == 1);
  // A loop that waits on its own wakes for the next keep-alive at the latest.
  CHECK(w.driver->poll_deadline() == std::min(w.mig->poll_deadline(), laminar::deadline_after(*clock, 1s)));
  // The next report is spaced from when the driver noted this send: wait for that before moving
  // the clock.
  REQUIRE(eventually([&] { return w.driver->stats().reports_sent == 1; }));

  // 900 steps over 900 ms with nothing new but step-time jitter: no report.
  for (int i = 0; i < 900; ++i) {
    w.step_time = i % 2 == 0 ? 9ms : 12ms;
    w.step();
    REQUIRE(clock->advance(1ms).ok());
  }
  // A new sequence is a change: it goes at once (the last report is 900 ms old), and is the second
  // report the coordinator hears, number 2.
  w.start(12, kMaxLength);
  w.step();
  REQUIRE(eventually([&] { return fc.count() >= 2; }));
  CHECK(fc.count() == 2);
  CHECK(fc.last().report == 2);
  CHECK(fc.last().snapshot.sequences.size() == 3);
  // The driver notes the send (and its time, from which the next report is spaced) once the send
  // returns, which may be after the coordinator has it: wait for that before moving the clock.
  REQUIRE(eventually([&] { return w.driver->stats().reports_sent == 2; }));

  // A keep-alive: the first step a second after the last report sends it again, number and all.
  REQUIRE(clock->advance(999ms).ok());
  w.step();
  CHECK(w.driver->stats().keepalives_sent == 0);
  REQUIRE(clock->advance(1ms).ok());
  w.step();
  REQUIRE(eventually([&] { return fc.count() == 3; }));
  CHECK(fc.last().report == 2);
  REQUIRE(eventually([&] { return w.driver->stats().keepalives_sent == 1; }));
  CHECK(w.driver->stats().reports_sent == 2);

  // A sequence that grows changes the snapshot every page (4 tokens); over 300 ms at most one
  // report per 100 ms goes, each with the newest snapshot.
  w.start(13, 1);
  for (int i = 0; i < 300; ++i) {
    w.step();
    REQUIRE(clock->advance(1ms).ok());
  }
  REQUIRE(eventually([&] { return fc.count() >= 4; }));
  CHECK(fc.count() <= 3 + 4);
  CHECK(w.driver->stats().reports_sent <= 2 + 4);
  // A report held for the spacing goes once it has passed (the driver's thread may have sent the
  // one before late in the loop, on the clock it found then).
  REQUIRE(clock->advance(100ms).ok());
  // Everything the driver sent arrived, and the last report is the newest snapshot's page count.
  REQUIRE(eventually([&] {
    const laminar::RepackDriverStats ds = w.driver->stats();
    return fc.count() == ds.reports_sent + ds.keepalives_sent &&
           fc.last().snapshot.sequences[3].pages == kMaxLength / kPageSize;
  }));

  auto orders_for = [&](std::uint64_t report, Version v, std::vector<SequenceId> seqs) {
    return laminar::internal::encode_repack_orders(
        RepackOrders{1, report, v, {{WorkerId(2), other.addr, std::move(seqs)}}});
  };
  auto taken = [&] {
    const laminar::RepackDriverStats s = w.driver->stats();
    return s.orders + s.orders_dropped + s.orders_refused;
  };
  // Planned from report 1, older than the last one sent: taken, and checked against this step's
  // snapshot (the sequence it names is no longer live here).
  fc.send(orders_for(1, Version(4), {SequenceId(76)}));
  REQUIRE(eventually([&] {
    w.step();
    return taken() == 1;
  }));
  CHECK(w.driver->stats().orders == 1);
  CHECK(w.driver->stats().sequences_skipped == 1);
  CHECK(w.driver->stats().orders_dropped == 0);
  // For another version.
  fc.send(orders_for(2, Version(3), {SequenceId(10)}));
  REQUIRE(eventually([&] {
    w.step();
    return taken() == 2;
  }));
  CHECK(w.driver->stats().orders_dropped == 1);
  // Bytes that do not decode.
  fc.send({std::byte{1}, std::byte{2}, std::byte{3}});
  REQUIRE(eventually([&] { return taken() == 3; }));
  CHECK(w.driver->stats().orders_refused == 1);
  // From a peer that is not the coordinator.
  auto stranger = make_transport(kToken);
  Endpoint to_w = stranger->connect(w.addr).value();
  REQUIRE(laminar::internal::send_protocol(
              to_w, Message{laminar::internal::kRepackOrdersMessage, orders_for(2, Version(4), {SequenceId(10)})})
              .ok());
  REQUIRE(eventually([&] { return taken() == 4; }));
  CHECK(w.driver->stats().orders_refused == 2);
  // Sequences that are not live here are skipped; with none left, nothing starts.
  fc.send(orders_for(2, Version(4), {SequenceId(77)}));
  REQUIRE(eventually([&] {
    w.step();
    return taken() == 5;
  }));
  CHECK(w.driver->stats().orders == 2);
  CHECK(w.driver->stats().sequences_skipped == 2);
  CHECK(w.driver->stats().migrations_started == 0);
  CHECK(w.mig->moving().empty());
  CHECK(w.live.size() == 4);

  // A destination nobody listens at: migrate() refuses, and the sequence stays, not moving.
  const auto unreachable = laminar::internal::encode_repack_orders(
      RepackOrders{1, 2, Version(4), {{WorkerId(9), "127.0.0.1:1", {SequenceId(11)}}}});
  fc.send(unreachable);
  REQUIRE(eventually([&] {
    w.step();
    return taken() == 6;
  }));
  CHECK(w.driver->stats().migrations_refused == 1);
  CHECK(w.driver->stats().migrations_started == 0);
  CHECK(w.mig->moving().empty());
  CHECK(w.live.contains(SequenceId(11)));

  // Valid orders start one migration for the live sequence, skipping the unknown one, and the
  // next report says a migration runs.
  fc.send(orders_for(2, Version(4), {SequenceId(10), SequenceId(78)}));
  REQUIRE(eventually([&] {
    w.step();
    return w.driver->stats().orders == 4;
  }));
  CHECK(w.driver->stats().migrations_started == 1);
  CHECK(w.driver->stats().sequences_skipped == 3);
  REQUIRE_FALSE(w.mig->moving().empty());
  REQUIRE(clock->advance(100ms).ok());
  w.step();
  REQUIRE(eventually([&] { return fc.last().migrating; }));
  // It completes with both loops running.
  REQUIRE(eventually([&] {
    w.step();
    other.step();
    return !w.live.contains(SequenceId(10)) && other.live.contains(SequenceId(10));
  }));
  CHECK(other.holds_written(SequenceId(10)));
  std::lock_guard l(fc.mu);
  CHECK(fc.malformed == 0);
}

TEST_CASE("repack driver: a coordinator that goes away is connected to again while the loop steps on") {
  auto clock = std::make_shared<ManualClock>();
  auto fc = std::make_unique<FakeCoordinator>();
  const std::string addr = fc->addr;
  const auto port = std::uint16_t(std::stoi(addr.substr(addr.rfind(':') + 1)));
  Worker w(1, Version(0), clock, addr);
  w.start(10, 5);
  w.step();
  REQUIRE(eventually([&] { return fc->count() == 1; }));

  // Its transport is gone: a report fails, then the connects, retried every retry_interval (1 s).
  fc.reset();
  REQUIRE(eventually([&] {
    REQUIRE(clock->advance(100ms).ok());
    w.step();
    return w.driver->stats().connects_failed >= 2;
  }));
  CHECK(w.driver->stats().reports_sent + w.driver->stats().reports_failed >= 2);

  // A coordinator at the same address again: the reports reach it.
  fc = std::make_unique<FakeCoordinator>(port);
  REQUIRE(eventually([&] {
    REQUIRE(clock->advance(100ms).ok());
    w.step();
    return fc->count() >= 1;
  }));
  CHECK(fc->last().snapshot.sequences.size() == 1);
}

TEST_CASE("repack driver: create and step check what they are given") {
  auto clock = std::make_shared<ManualClock>();
  auto tr = make_transport(kToken);
  const std::string addr = tr->listen("127.0.0.1", 0).value();
  auto cache = std::make_shared<PagedKvCache>(PagedKvCache::create(layout()).value());
  std::shared_ptr<KvMigrator> mig = KvMigrator::create(tr, cache, {}).value();
  RepackDriverOptions good;
  good.worker = WorkerId(5);
  good.coordinator = "127.0.0.1:1";
  good.clock = clock;
  auto expect = [&](std::shared_ptr<Transport> t, std::shared_ptr<KvMigrator> m, RepackDriverOptions o,
                    StatusCode code, const char* needle) {
    auto d = RepackDriver::create(std::move(t), std::move(m), std::move(o));
    REQUIRE_FALSE(d.ok());
    INFO(d.status().to_string());
    CHECK(d.status().code() == code);
    CHECK_THAT(d.status().message(), Catch::Contains(needle));
  };
  expect(nullptr, mig, good, StatusCode::kInvalidArgument, "transport is null");
  expect(tr, nullptr, good, StatusCode::kInvalidArgument, "migrator is null");
  RepackDriverOptions o = good;
  o.coordinator.clear();
  expect(tr, mig, o, StatusCode::kInvalidArgument, "empty coordinator address");
  o = good;
  o.min_report_interval = 0s;
  expect(tr, mig, o, StatusCode::kInvalidArgument, "min_report_interval 0 ns");
  o = good;
  o.keepalive_interval = -1ns;
  expect(tr, mig, o, StatusCode::kInvalidArgument, "keepalive_interval -1 ns");
  o = good;
  o.retry_interval = -1s;
  expect(tr, mig, o, StatusCode::kInvalidArgument, "retry_interval -1000000000 ns");
  {
    auto quiet = make_transport(kToken);  // does not listen
    auto quiet_cache = std::make_shared<PagedKvCache>(PagedKvCache::create(layout()).value());
    std::shared_ptr<KvMigrator> quiet_mig = KvMigrator::create(quiet, quiet_cache, {}).value();
    expect(quiet, quiet_mig, good, StatusCode::kFailedPrecondition, "no address");
  }

  auto d = RepackDriver::create(tr, mig, good);
  REQUIRE(d.ok());
  expect(tr, mig, good, StatusCode::kAlreadyExists, "another repack driver");

  WorkerSnapshot s;
  s.id = WorkerId(6);
  auto r = (*d)->step(s);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(r.status().message(), Catch::Contains("snapshot of worker 6, not 5"));
  s.id = WorkerId(5);
  s.version = Version(9);
  r = (*d)->step(s);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(r.status().message(), Catch::Contains("snapshot of version 9, the migrator's is 0"));
  s.version = Version(0);
  for (std::uint64_t i = 0; i <= laminar::internal::kMaxRepackSequences; ++i) {
    s.sequences.push_back({SequenceId(i), 1, 1, std::nullopt});
  }
  r = (*d)->step(s);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(r.status().message(), Catch::Contains("snapshot of 1025 sequences, above 1024"));
  s.sequences.clear();
  CHECK((*d)->step(s).ok());
  // Nobody listens at the coordinator's address: the driver's thread fails to connect, and the
  // loop is not held up.
  REQUIRE(eventually([&] { return (*d)->stats().connects_failed >= 1; }));
  CHECK((*d)->stats().reports_sent == 0);
  // A coordinator not up yet is retried, not a background error.
  CHECK((*d)->background_error().ok());
}

TEST_CASE("repack driver: a coordinator address that does not parse is a background error, and the loop steps on") {
  auto clock = std::make_shared<ManualClock>();
  Worker w(1, Version(0), clock, "no-port-here");
  CHECK(w.driver->background_error().ok());
  w.start(10, 5);
  w.step();
  REQUIRE(eventually([&] { return !w.driver->background_error().ok(); }));
  const laminar::Status e = w.driver->background_error();
  INFO(e.to_string());
  CHECK(e.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(e.message(), Catch::Contains("repack driver: connecting to the coordinator"));
  CHECK(w.driver->stats().connects_failed >= 1);
  CHECK(w.driver->stats().reports_sent == 0);
  w.step();  // the decode loop is not held up
}

TEST_CASE("repack driver: wait_event and set_notify wake on orders and on the migrator; false at the deadline") {
  // The steady clock: the waits below are real.
  FakeCoordinator fc;
  Worker w(1, Version(0), nullptr, fc.addr);
  Worker other(2, Version(0), nullptr, fc.addr);
  w.start(10, 6);
  w.step();  // polls: the migrator's first notify is spent
  REQUIRE(eventually([&] { return fc.count() == 1; }));

  // Nothing happens: false, at the deadline and not before.
  auto start = std::chrono::steady_clock::now();
  CHECK_FALSE(w.driver->wait_event(30ms));
  CHECK(std::chrono::steady_clock::now() - start >= 30ms);

  // Orders arrive: true, long before the deadline; a host's own waiter hears of them too.
  std::atomic<int> notified{0};
  w.driver->set_notify([&] { ++notified; });
  start = std::chrono::steady_clock::now();
  fc.send(laminar::internal::encode_repack_orders(
      RepackOrders{1, 1, Version(0), {{WorkerId(2), other.addr, {SequenceId(10)}}}}));
  CHECK(w.driver->wait_event(20s));
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  // The host's waiter is told after the driver's own wakes.
  REQUIRE(eventually([&] { return notified >= 1; }));
  w.driver->set_notify({});
  CHECK(w.driver->poll_deadline() <= w.mig->poll_deadline());
  w.step();  // starts the migration
  CHECK(w.driver->stats().migrations_started == 1);

  // The migration's steps wake both loops, each waiting instead of spinning, until it is done.
  // The destination's loop, on a thread of its own (no Catch assertions there).
  auto dest = std::async(std::launch::async, [&] {
    while (!other.live.contains(SequenceId(10))) {
      if (!other.driver->wait_event(20s)) return false;
      auto events = other.driver->step(other.snapshot());
      if (!events.ok()) return false;
      for (MigrationEvent& e : *events) {
        if (e.kind != MigrationEvent::Kind::kArrived) continue;
        for (SequenceState& st : e.states) other.live[st.sequence] = std::move(st);
      }
    }
    return true;
  });
  while (w.live.contains(SequenceId(10))) {
    REQUIRE(w.driver->wait_event(20s));
    w.step();
  }
  CHECK(dest.get());
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  CHECK(other.holds_written(SequenceId(10)));
}
