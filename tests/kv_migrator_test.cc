// KvMigrator: live sequences and their KV pages moved between two rollout workers, each a real
// Transport with its own PagedKvCache and KvMigrator in this process. The test thread plays both
// hosts' decode loops: it polls both migrators in turn, writes tokens between polls, and answers
// their events.
#include "laminar/kv_migrator.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda_absent.h"
#include "host_buffer.h"
#include "kv_migration_wire.h"
#include "laminar/kernels/paged_decode.h"
#include "transport/protocol.h"

using laminar::DType;
using laminar::KvLayout;
using laminar::KvMigrator;
using laminar::KvMigratorOptions;
using laminar::MigrationEvent;
using laminar::MigrationId;
using laminar::MigrationState;
using laminar::PagedKvCache;
using laminar::SequenceId;
using laminar::SequenceState;
using laminar::StatusCode;
using laminar::Version;
using Kind = laminar::MigrationEvent::Kind;
using namespace std::chrono_literals;

namespace {

const std::string kToken = "kv-migrator-test-token-0123456789";

KvLayout layout(std::int32_t num_pages, std::int32_t head_dim = 8) {
  return {num_pages, /*page_size=*/4, /*num_kv_heads=*/2, head_dim, DType::kF32, /*num_layers=*/3};
}

std::shared_ptr<laminar::Transport> make_transport() {
  laminar::TransportOptions o;
  o.cluster_token = kToken;
  return laminar::Transport::create(o).value();
}

// One rollout worker: a listening transport, its cache and its migrator, and every event its
// migrator reported so far.
struct Worker {
  std::shared_ptr<laminar::Transport> transport;
  std::shared_ptr<PagedKvCache> cache;
  std::unique_ptr<KvMigrator> migrator;
  std::string address;
  std::shared_ptr<laminar::Clock> clock;  // the migrator's
  std::vector<MigrationEvent> events;

  const MigrationEvent* find(Kind kind, MigrationId id) const {
    for (const MigrationEvent& e : events) {
      if (e.kind == kind && e.id == id) return &e;
    }
    return nullptr;
  }
  std::size_t count(Kind kind) const {
    return std::size_t(std::ranges::count_if(events, [&](const MigrationEvent& e) { return e.kind == kind; }));
  }
};

// Pools: the cache's own, registered by create(), or allocated by the transport.
enum class Pools { kRegistered, kAllocated };

Worker make_worker(KvMigratorOptions options = {}, KvLayout l = layout(64), Pools pools = Pools::kRegistered) {
  Worker w;
  w.transport = make_transport();
  w.address = w.transport->listen("127.0.0.1", 0).value();
  if (pools == Pools::kAllocated) {
    auto allocated = KvMigrator::allocate_cache(*w.transport, l);
    REQUIRE(allocated.ok());
    w.cache = allocated->cache;
    options.k_pool_region = allocated->k_pool;
    options.v_pool_region = allocated->v_pool;
  } else {
    w.cache = std::make_shared<PagedKvCache>(PagedKvCache::create(l).value());
  }
  w.clock = options.clock ? options.clock : laminar::Clock::steady();
  auto m = KvMigrator::create(w.transport, w.cache, std::move(options));
  REQUIRE(m.ok());
  w.migrator = std::move(*m);
  return w;
}

// The value element `e` of token `pos`'s row of sequence `seq`, in `layer` of pool `pool` (0: K,
// 1: V): distinct for every argument, and exact in f32 (below 2^24).
float pattern(SequenceId seq, std::int64_t pos, std::int32_t layer, int pool, std::int64_t e) {
  std::uint64_t h = seq.value() * 0x9E3779B97F4A7C15ull ^ std::uint64_t(pos) * 0xC2B2AE3D27D4EB4Full ^
                    std::uint64_t(layer) * 0x165667B19E3779F9ull ^ std::uint64_t(pool) * 0x27D4EB2F165667C5ull ^
                    std::uint64_t(e) * 0x85EBCA77C2B2AE63ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return float(h & 0xFFFFFF);
}

// Grows a sequence by n tokens and writes their K and V rows in every layer.
void append(PagedKvCache& cache, SequenceId seq, std::int64_t n) {
  const std::int64_t from = cache.length(seq).value();
  REQUIRE(cache.append_tokens(seq, n).ok());
  const KvLayout& l = cache.layout();
  for (std::int64_t pos = from; pos < from + n; ++pos) {
    for (std::int32_t layer = 0; layer < l.num_layers; ++layer) {
      auto slot = cache.token_slot(seq, pos, layer);
      REQUIRE(slot.ok());
      auto* k = static_cast<float*>(slot->k);
      auto* v = static_cast<float*>(slot->v);
      for (std::int64_t e = 0; e < l.token_elems(); ++e) {
        k[e] = pattern(seq, pos, layer, 0, e);
        v[e] = pattern(seq, pos, layer, 1, e);
      }
    }
  }
}

void add(PagedKvCache& cache, SequenceId seq, std::int64_t n) {
  REQUIRE(cache.add_sequence(seq).ok());
  append(cache, seq, n);
}

// Every token of every layer holds the rows append() wrote; returns the first mismatch, if any.
std::string rows_differ(PagedKvCache& cache, SequenceId seq, std::int64_t length) {
  if (cache.length(seq).value() != length) return "length " + std::to_string(cache.length(seq).value());
  const KvLayout& l = cache.layout();
  for (std::int64_t pos = 0; pos < length; ++pos) {
    for (std::int32_t layer = 0; layer < l.num_layers; ++layer) {
      auto slot = cache.token_slot(seq, pos, layer).value();
      const auto* k = static_cast<const float*>(slot.k);
      const auto* v = static_cast<const float*>(slot.v);
      for (std::int64_t e = 0; e < l.token_elems(); ++e) {
        if (k[e] != pattern(seq, pos, layer, 0, e) || v[e] != pattern(seq, pos, layer, 1, e)) {
          return "token " + std::to_string(pos) + " layer " + std::to_string(layer);
        }
      }
    }
  }
  return "";
}

SequenceState state_of(PagedKvCache& cache, SequenceId seq, Version v = Version(0)) {
  SequenceState s;
  s.sequence = seq;
  s.trajectory = laminar::TrajectoryId(seq.value() + 1000);
  s.prompt_id = laminar::PromptId(seq.value() * 7);
  s.group_id = laminar::GroupId(3);
  s.group_size = 4;
  s.sample_index = std::uint32_t(seq.value() % 4);
  s.version = v;
  s.temperature = 0.7f;
  s.top_p = 0.9f;
  s.top_k = 20;
  s.seed = 0xABCDEF00 + seq.value();
  s.kv_length = std::uint64_t(cache.length(seq).value());
  s.rng_position = s.kv_length;
  s.prompt_tokens.assign(std::size_t(s.kv_length), std::int32_t(seq.value()));
  s.response_tokens = {5, 6};
  s.logprobs = {-0.5f, -1.25f};
  s.engine_state = "engine of " + std::to_string(seq.value());
  return s;
}

std::vector<SequenceState> states_of(PagedKvCache& cache, const std::vector<SequenceId>& seqs, Version v = Version(0)) {
  std::vector<SequenceState> out;
  for (SequenceId s : seqs) out.push_back(state_of(cache, s, v));
  return out;
}

// One step of both decode loops.
void poll(Worker& w) {
  for (MigrationEvent& e : w.migrator->poll()) w.events.push_back(std::move(e));
}

// What the test thread waits on between rounds of polls: every migrator's notify hook, and the
// answers ProtocolPeer asks for, set it.
struct Wakeup {
  std::mutex mu;
  std::condition_variable cv;
  bool woken = false;

  void wake() {
    {
      std::lock_guard l(mu);
      woken = true;
    }
    cv.notify_all();
  }
};
Wakeup& wakeup() {
  static Wakeup w;
  return w;
}

// Polls the workers in turn until `done` holds, or 20 s pass (false: a bug fails, never hangs).
// `between` runs after each round of polls, playing the hosts' decoding; it returns whether it
// changed a cache or called a migrator (then the next round polls at once, as a decode loop would).
// Otherwise the round waits for a migrator's notify or the nearest poll_deadline(), never a pause.
bool drive(std::vector<Worker*> workers, const std::function<bool()>& done,
           const std::function<bool()>& between = {}) {
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  Wakeup& wake = wakeup();
  for (Worker* w : workers) w->migrator->set_notify([&wake] { wake.wake(); });
  bool ok = true;
  for (;;) {
    {
      std::lock_guard l(wake.mu);
      wake.woken = false;
    }
    for (Worker* w : workers) poll(*w);
    if (done()) break;
    if (std::chrono::steady_clock::now() > deadline) {
      ok = false;
      break;
    }
    if (between && between()) continue;
    // Each migrator's deadline, on its own clock; a ManualClock's wakes its notify when it moves.
    auto until = deadline;
    for (Worker* w : workers) {
      const laminar::Duration due = w->migrator->poll_deadline();
      if (due == laminar::kForever) continue;
      until = std::min(until, std::chrono::steady_clock::now() +
                                  std::max(laminar::Duration::zero(), due - w->clock->now()));
    }
    std::unique_lock l(wake.mu);
    wake.cv.wait_until(l, until, [&] { return wake.woken; });
  }
  for (Worker* w : workers) w->migrator->set_notify({});
  return ok;
}

// Runs a migration of `seqs` from src to dst through to the end: pause, finish with their states.
MigrationId migrate_all(Worker& src, Worker& dst, const std::vector<SequenceId>& seqs) {
  auto id = src.migrator->migrate(dst.address, seqs);
  REQUIRE(id.ok());
  REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kPauseRequested, *id) != nullptr; }));
  REQUIRE(src.migrator->finish(*id, states_of(*src.cache, seqs)).ok());
  REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kDone, *id) && dst.find(Kind::kArrived, *id); }));
  return *id;
}

std::int64_t pages_of(std::int64_t tokens) { return (tokens + 3) / 4; }

// Orders the test thread after everything w's transport threads did so far, pages put into w
// included: a message through those threads whose handler releases the test thread. (The put's
// own completion reached the source through a socket, which orders nothing for ThreadSanitizer.)
void sync_with(Worker& from, Worker& w) {
  constexpr laminar::MessageType kSync = 1;
  auto arrived = std::make_shared<std::promise<void>>();
  REQUIRE(w.transport->on_message(kSync, [arrived](laminar::Incoming) { arrived->set_value(); }).ok());
  auto ep = from.transport->connect(w.address);
  REQUIRE(ep.ok());
  REQUIRE(ep->send(laminar::Message::from_string(kSync, "sync")).ok());
  REQUIRE(arrived->get_future().wait_for(10s) == std::future_status::ready);
  REQUIRE(w.transport->on_message(kSync, {}).ok());
}

// The test speaking the migration protocol to `dst` by hand, through a transport of its own.
struct ProtocolPeer {
  Worker& dst;
  std::shared_ptr<laminar::Transport> transport = make_transport();
  laminar::Endpoint ep = transport->connect(dst.address).value();

  // Sends a request and polls the destination until it answers.
  laminar::Result<laminar::Message> ask(laminar::MessageType type, std::vector<std::byte> body) {
    auto answer = laminar::internal::request_protocol_async(ep, laminar::Message{type, std::move(body)}, 10s,
                                                            [] { wakeup().wake(); });
    REQUIRE(drive({&dst}, [&] { return answer.wait_for(0s) == std::future_status::ready; }));
    return answer.get();
  }
};

}  // namespace

TEST_CASE("kv migrator: sequences of several lengths move with every K/V byte and their states") {
  Worker src = make_worker();
  Worker dst = make_worker();
  // 13 tokens: a partial last page; 8: exactly two pages; 1: one token; 30: eight pages.
  const std::vector<SequenceId> seqs = {SequenceId(1), SequenceId(2), SequenceId(3), SequenceId(4)};
  const std::vector<std::int64_t> lengths = {13, 8, 1, 30};
  for (std::size_t i = 0; i < seqs.size(); ++i) add(*src.cache, seqs[i], lengths[i]);
  const std::vector<SequenceState> states = states_of(*src.cache, seqs);

  const MigrationId id = migrate_all(src, dst, seqs);

  const MigrationEvent* arrived = dst.find(Kind::kArrived, id);
  REQUIRE(arrived != nullptr);
  CHECK_FALSE(arrived->outgoing);
  CHECK(arrived->sequences == seqs);
  CHECK(arrived->states == states);
  std::int64_t pages = 0;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    INFO("sequence " << seqs[i].value());
    CHECK(rows_differ(*dst.cache, seqs[i], lengths[i]) == "");
    CHECK_FALSE(src.cache->length(seqs[i]).ok());
    pages += pages_of(lengths[i]);
  }
  CHECK(src.find(Kind::kDone, id)->sequences == seqs);
  CHECK(src.cache->free_pages() == 64);
  CHECK(src.cache->num_sequences() == 0);
  CHECK(dst.cache->free_pages() == 64 - pages);
  CHECK(dst.cache->reserved_pages() == 0);
  CHECK(*src.migrator->state(id) == MigrationState::kDone);
  CHECK(*dst.migrator->state(id) == MigrationState::kDone);
  CHECK(src.migrator->moving().empty());
  CHECK(dst.migrator->moving().empty());

  const auto s = src.migrator->stats();
  const auto d = dst.migrator->stats();
  CHECK(s.migrations_out == 1);
  CHECK(s.done_out == 1);
  CHECK(s.aborted_out == 0);
  CHECK(s.pages_sent == std::uint64_t(pages));
  CHECK(s.bytes_sent == std::uint64_t(pages) * 2 * 3 * std::uint64_t(src.cache->layout().page_bytes()));
  CHECK(d.migrations_in == 1);
  CHECK(d.done_in == 1);
  CHECK(d.pages_received == std::uint64_t(pages));
  CHECK(d.checksum_failures == 0);
  CHECK(src.migrator->background_error().ok());
  CHECK(dst.migrator->background_error().ok());
  CHECK(s.to_json().find("\"done_out\":1") != std::string::npos);

  // The sequences decode on at the destination: they grow like any other.
  append(*dst.cache, SequenceId(1), 5);
  CHECK(rows_differ(*dst.cache, SequenceId(1), 18) == "");
}

TEST_CASE("kv migrator: live stages copy pages while the source keeps decoding") {
  KvMigratorOptions o;
  o.max_live_stages = 4;
  o.pause_after_pages = 1;
  o.growth_pages = 200;
  Worker src = make_worker(o, layout(512));
  Worker dst = make_worker(o, layout(512));
  const std::vector<SequenceId> seqs = {SequenceId(10), SequenceId(11)};
  add(*src.cache, seqs[0], 21);
  add(*src.cache, seqs[1], 40);

  auto id = src.migrator->migrate(dst.address, seqs);
  REQUIRE(id.ok());
  CHECK(src.migrator->finish(*id, states_of(*src.cache, seqs)).code() == StatusCode::kFailedPrecondition);
  // Each time a live stage's pages went out, the host decodes two more pages of each sequence:
  // every stage then finds more than pause_after_pages new pages, so only max_live_stages pauses.
  std::uint64_t sent = 0;
  int stages_before_pause = 0;
  REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kPauseRequested, *id) != nullptr; },
                [&] {
                  const std::uint64_t now = src.migrator->stats().pages_sent;
                  if (now == sent || src.find(Kind::kPauseRequested, *id)) return false;
                  sent = now;
                  ++stages_before_pause;
                  for (SequenceId s : seqs) append(*src.cache, s, 8);
                  return true;
                }));
  CHECK(stages_before_pause == 3);
  CHECK(sent > 0);
  CHECK(src.migrator->moving().size() == 2);
  CHECK(dst.migrator->moving().size() == 2);
  const std::int64_t len0 = src.cache->length(seqs[0]).value();
  const std::int64_t len1 = src.cache->length(seqs[1]).value();
  const std::vector<SequenceState> states = states_of(*src.cache, seqs);
  REQUIRE(src.migrator->finish(*id, states).ok());
  CHECK(src.migrator->finish(*id, states).code() == StatusCode::kFailedPrecondition);
  REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kDone, *id) && dst.find(Kind::kArrived, *id); }));

  CHECK(rows_differ(*dst.cache, seqs[0], len0) == "");
  CHECK(rows_differ(*dst.cache, seqs[1], len1) == "");
  CHECK(dst.find(Kind::kArrived, *id)->states == states);
  CHECK(src.migrator->stats().pages_sent == std::uint64_t(pages_of(len0) + pages_of(len1)));
  CHECK(dst.cache->free_pages() == 512 - pages_of(len0) - pages_of(len1));
  CHECK(src.cache->free_pages() == 512);
}

TEST_CASE("kv migrator: the blocking copy pauses before any page moves") {
  KvMigratorOptions o;
  o.max_live_stages = 0;
  Worker src = make_worker(o);
  Worker dst = make_worker(o);
  add(*src.cache, SequenceId(5), 17);
  auto id = src.migrator->migrate(dst.address, std::vector<SequenceId>{SequenceId(5)});
  REQUIRE(id.ok());
  REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kPauseRequested, *id) != nullptr; }));
  CHECK(src.migrator->stats().pages_sent == 0);
  // The destination answered the offer and has seen no stage.
  CHECK(dst.migrator->stats().pages_received == 0);
  CHECK(dst.cache->reserved_pages() == pages_of(17) + 4);
  REQUIRE(src.migrator->finish(*id, states_of(*src.cache, {SequenceId(5)})).ok());
  REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kDone, *id) && dst.find(Kind::kArrived, *id); }));
  CHECK(rows_differ(*dst.cache, SequenceId(5), 17) == "");
  CHECK(src.migrator->stats().pages_sent == std::uint64_t(pages_of(17)));
  CHECK(dst.cache->reserved_pages() == 0);
}

TEST_CASE("kv migrator: a destination refuses what it cannot take, and nothing changes on either side") {
  struct Case {
    const char* name;
    StatusCode code;
    std::function<void(Worker&)> setup;  // on the destination
    KvMigratorOptions options;
    KvLayout layout;
  };
  KvMigratorOptions one_slot;
  one_slot.max_sequences = 2;
  const std::vector<Case> cases = {
      {"another version", StatusCode::kFailedPrecondition, [](Worker& w) { w.migrator->set_version(Version(2)); },
       {}, layout(64)},
      {"another layout", StatusCode::kFailedPrecondition, {}, {}, layout(64, 16)},
      {"not enough free pages", StatusCode::kResourceExhausted, {}, {}, layout(8)},
      {"no batch slot", StatusCode::kResourceExhausted, [](Worker& w) { add(*w.cache, SequenceId(99), 3); },
       one_slot, layout(64)},
      {"an id already live", StatusCode::kAlreadyExists, [](Worker& w) { add(*w.cache, SequenceId(21), 2); }, {},
       layout(64)},
  };
  for (const Case& c : cases) {
    SECTION(c.name) {
      Worker src = make_worker();
      Worker dst = make_worker(c.options, c.layout);
      if (c.setup) c.setup(dst);
      add(*src.cache, SequenceId(20), 9);
      add(*src.cache, SequenceId(21), 4);
      const std::int32_t src_free = src.cache->free_pages();
      const std::int32_t dst_free = dst.cache->free_pages();
      const std::size_t dst_seqs = dst.cache->num_sequences();
      const std::vector<SequenceId> seqs = {SequenceId(20), SequenceId(21)};
      auto id = src.migrator->migrate(dst.address, seqs);
      REQUIRE(id.ok());
      REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kAborted, *id) != nullptr; }));
      const MigrationEvent& e = *src.find(Kind::kAborted, *id);
      INFO(e.reason.to_string());
      CHECK(e.outgoing);
      CHECK(e.state == MigrationState::kAbortedByDestination);
      CHECK(e.reason.code() == c.code);
      CHECK(e.sequences == seqs);
      CHECK(*src.migrator->state(*id) == MigrationState::kAbortedByDestination);
      CHECK(dst.migrator->state(*id).status().code() == StatusCode::kNotFound);
      CHECK(src.cache->free_pages() == src_free);
      CHECK(rows_differ(*src.cache, SequenceId(20), 9) == "");
      CHECK(rows_differ(*src.cache, SequenceId(21), 4) == "");
      CHECK(dst.cache->free_pages() == dst_free);
      CHECK(dst.cache->reserved_pages() == 0);
      CHECK(dst.cache->num_sequences() == dst_seqs);
      CHECK(dst.migrator->stats().offers_refused == 1);
      CHECK(dst.migrator->stats().migrations_in == 0);
      CHECK(src.migrator->stats().aborted_out == 1);
      CHECK(src.migrator->moving().empty());
      // Nothing is left half way: the same sequences can be offered again.
      auto again = src.migrator->migrate(dst.address, seqs);
      CHECK(again.ok());
    }
  }
}

TEST_CASE("kv migrator: migrate() refuses bad arguments before anything is sent") {
  KvMigratorOptions o;
  o.max_migrations = 1;
  Worker src = make_worker(o);
  Worker dst = make_worker();
  add(*src.cache, SequenceId(1), 5);
  add(*src.cache, SequenceId(2), 5);
  const auto migrate = [&](std::vector<SequenceId> ids) { return src.migrator->migrate(dst.address, ids); };
  CHECK(migrate({}).status().code() == StatusCode::kInvalidArgument);
  CHECK(migrate({SequenceId(1), SequenceId(1)}).status().code() == StatusCode::kInvalidArgument);
  auto unknown = migrate({SequenceId(1), SequenceId(77)});
  CHECK(unknown.status().code() == StatusCode::kNotFound);
  CHECK(unknown.status().message().find("77") != std::string::npos);
  std::vector<SequenceId> many;
  for (std::uint64_t i = 0; i < 1025; ++i) many.push_back(SequenceId(1000 + i));
  CHECK(migrate(many).status().code() == StatusCode::kInvalidArgument);
  CHECK(src.migrator->stats().migrations_out == 0);
  CHECK(dst.migrator->stats().offers_refused == 0);

  auto first = migrate({SequenceId(1)});
  REQUIRE(first.ok());
  auto moving = migrate({SequenceId(2), SequenceId(1)});
  CHECK(moving.status().code() == StatusCode::kFailedPrecondition);
  // max_migrations (1) running: transient, retried once one ends.
  auto busy = migrate({SequenceId(2)});
  CHECK(busy.status().code() == StatusCode::kUnavailable);
  CHECK_THAT(busy.status().message(), Catch::Contains("1 outgoing migrations running, max_migrations 1"));
  CHECK(src.migrator->stats().migrations_out == 1);
  CHECK(src.migrator->moving() == std::vector<SequenceId>{SequenceId(1)});
  CHECK(src.migrator->finish(MigrationId(12345), {}).code() == StatusCode::kNotFound);
  REQUIRE(src.migrator->abort(*first, "make room").ok());
  // Nobody listens there: connecting fails, and nothing starts.
  auto unreachable = src.migrator->migrate("127.0.0.1:1", std::vector<SequenceId>{SequenceId(2)});
  CHECK(unreachable.status().code() == StatusCode::kUnavailable);
  CHECK(src.migrator->moving().empty());
  CHECK(src.migrator->stats().migrations_out == 1);
  CHECK(src.migrator->abort(MigrationId(12345), "no such").code() == StatusCode::kNotFound);
  CHECK(src.migrator->state(MigrationId(12345)).status().code() == StatusCode::kNotFound);
}

TEST_CASE("kv migrator: create() validates its options and serves one migrator per transport") {
  std::shared_ptr<laminar::Transport> t = make_transport();
  auto cache = std::make_shared<PagedKvCache>(PagedKvCache::create(layout(8)).value());
  CHECK(KvMigrator::create(nullptr, cache).status().code() == StatusCode::kInvalidArgument);
  CHECK(KvMigrator::create(t, nullptr).status().code() == StatusCode::kInvalidArgument);
  const std::vector<std::function<void(KvMigratorOptions&)>> bad = {
      [](KvMigratorOptions& o) { o.lease = 0s; },
      [](KvMigratorOptions& o) { o.stall_timeout = -1s; },
      [](KvMigratorOptions& o) { o.connect_timeout = 0s; },
      [](KvMigratorOptions& o) { o.stage_bytes = 0; },
      [](KvMigratorOptions& o) { o.max_sequences = 0; },
      [](KvMigratorOptions& o) { o.max_migrations = 0; },
  };
  for (const auto& change : bad) {
    KvMigratorOptions o;
    change(o);
    CHECK(KvMigrator::create(t, cache, o).status().code() == StatusCode::kInvalidArgument);
  }
  auto m = KvMigrator::create(t, cache);
  REQUIRE(m.ok());
  CHECK(KvMigrator::create(t, cache).status().code() == StatusCode::kAlreadyExists);
  CHECK(!(*m)->address().has_value());
  m->reset();
  CHECK(KvMigrator::create(t, cache).ok());
  CHECK(laminar::to_string(MigrationState::kAbortedBySource) == "aborted by source");
  CHECK(laminar::to_string(MigrationState::kDone) == "done");
}

TEST_CASE("kv migrator: pools the transport allocates move every byte, either way round") {
  for (const auto& [src_pools, dst_pools] : {std::pair{Pools::kAllocated, Pools::kAllocated},
                                             std::pair{Pools::kRegistered, Pools::kAllocated},
                                             std::pair{Pools::kAllocated, Pools::kRegistered}}) {
    INFO("source pools allocated " << (src_pools == Pools::kAllocated) << ", destination's "
                                   << (dst_pools == Pools::kAllocated));
    Worker src = make_worker({}, layout(64), src_pools);
    Worker dst = make_worker({}, layout(64), dst_pools);
    const std::vector<SequenceId> seqs = {SequenceId(1), SequenceId(2)};
    const std::vector<std::int64_t> lengths = {13, 30};
    for (std::size_t i = 0; i < seqs.size(); ++i) add(*src.cache, seqs[i], lengths[i]);
    const MigrationId id = migrate_all(src, dst, seqs);
    REQUIRE(dst.find(Kind::kArrived, id) != nullptr);
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      INFO("sequence " << seqs[i].value());
      CHECK(rows_differ(*dst.cache, seqs[i], lengths[i]) == "");
    }
    CHECK(src.cache->free_pages() == 64);
    CHECK(dst.migrator->stats().checksum_failures == 0);
  }
}

TEST_CASE("kv migrator: allocate_cache() gives zeroed pools, and create() takes only regions that are the pools") {
  std::shared_ptr<laminar::Transport> t = make_transport();
  std::shared_ptr<laminar::Transport> other = make_transport();
  KvLayout bad = layout(8);
  bad.page_size = 0;
  CHECK(KvMigrator::allocate_cache(*t, bad).status().code() == StatusCode::kInvalidArgument);

  auto pools = KvMigrator::allocate_cache(*t, layout(8));
  REQUIRE(pools.ok());
  const auto bytes = std::size_t(layout(8).pool_bytes());
  CHECK(pools->k_pool.size() == bytes);
  CHECK(pools->cache->k_pool().data() == pools->k_pool.data());
  CHECK(pools->cache->v_pool().data() == pools->v_pool.data());
  CHECK(std::ranges::all_of(pools->k_pool.bytes(), [](std::byte b) { return b == std::byte{0}; }));
  CHECK(std::ranges::all_of(pools->v_pool.bytes(), [](std::byte b) { return b == std::byte{0}; }));
  CHECK(t->owns(pools->k_pool));
  CHECK_FALSE(other->owns(pools->k_pool));
  CHECK_FALSE(t->owns(laminar::MemoryRegion{}));

  auto elsewhere = KvMigrator::allocate_cache(*other, layout(8));
  auto same_transport = KvMigrator::allocate_cache(*t, layout(8));
  REQUIRE(elsewhere.ok());
  REQUIRE(same_transport.ok());
  const auto with = [](laminar::MemoryRegion k, laminar::MemoryRegion v) {
    KvMigratorOptions o;
    o.k_pool_region = std::move(k);
    o.v_pool_region = std::move(v);
    return o;
  };
  const std::vector<std::pair<std::string, KvMigratorOptions>> wrong = {
      {"a k region alone", with(pools->k_pool, {})},
      {"a v region alone", with({}, pools->v_pool)},
      {"the pools swapped", with(pools->v_pool, pools->k_pool)},
      {"another transport's", with(elsewhere->k_pool, elsewhere->v_pool)},
      {"another cache's", with(same_transport->k_pool, same_transport->v_pool)},
  };
  for (const auto& [what, o] : wrong) {
    INFO(what);
    auto m = KvMigrator::create(t, pools->cache, o);
    CHECK(m.status().code() == StatusCode::kInvalidArgument);
  }
  // Refused before it took the transport: the right regions still make one.
  auto m = KvMigrator::create(t, pools->cache, with(pools->k_pool, pools->v_pool));
  CHECK(m.ok());
}

TEST_CASE("kv migrator: an abort from the source mid-staging returns the destination's pages") {
  KvMigratorOptions o;
  o.stage_bytes = 1;  // one page a stage: many stages for one sequence
  Worker src = make_worker(o);
  Worker dst = make_worker(o);
  add(*src.cache, SequenceId(3), 40);
  auto id = src.migrator->migrate(dst.address, std::vector<SequenceId>{SequenceId(3)});
  REQUIRE(id.ok());
  REQUIRE(drive({&src, &dst}, [&] { return src.migrator->stats().pages_sent >= 2; }));
  REQUIRE(src.find(Kind::kPauseRequested, *id) == nullptr);
  CHECK(dst.cache->reserved_pages() == pages_of(40) + 4);
  REQUIRE(src.migrator->abort(*id, "the policy changed its mind").ok());
  CHECK(src.migrator->abort(*id, "twice").code() == StatusCode::kNotFound);
  REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kAborted, *id) && dst.find(Kind::kAborted, *id); }));
  const MigrationEvent& s = *src.find(Kind::kAborted, *id);
  CHECK(s.state == MigrationState::kAbortedBySource);
  CHECK(s.reason.message().find("the policy changed its mind") != std::string::npos);
  const MigrationEvent& d = *dst.find(Kind::kAborted, *id);
  CHECK_FALSE(d.outgoing);
  CHECK(d.state == MigrationState::kAbortedBySource);
  CHECK(d.sequences == std::vector<SequenceId>{SequenceId(3)});
  CHECK(*src.migrator->state(*id) == MigrationState::kAbortedBySource);
  CHECK(*dst.migrator->state(*id) == MigrationState::kAbortedBySource);
  CHECK(dst.cache->reserved_pages() == 0);
  CHECK(dst.cache->free_pages() == 64);
  CHECK(rows_differ(*src.cache, SequenceId(3), 40) == "");
  CHECK(dst.migrator->stats().aborted_in == 1);
  CHECK(src.migrator->stats().aborted_out == 1);
  // More polls change nothing: no event repeats, no late stage revives it.
  for (int i = 0; i < 20; ++i) {
    poll(src);
    poll(dst);
  }
  CHECK(src.count(Kind::kAborted) == 1);
  CHECK(dst.count(Kind::kAborted) == 1);
  CHECK(dst.count(Kind::kArrived) == 0);
}

TEST_CASE("kv migrator: an abort from the destination leaves the sequences decoding at the source") {
  Worker src = make_worker();
  Worker dst = make_worker();
  add(*src.cache, SequenceId(8), 22);
  auto id = src.migrator->migrate(dst.address, std::vector<SequenceId>{SequenceId(8)});
  REQUIRE(id.ok());
  REQUIRE(drive({&src, &dst}, [&] { return !dst.migrator->moving().empty(); }));
  REQUIRE(dst.migrator->abort(*id, "out of room after all").ok());
  CHECK(*dst.migrator->state(*id) == MigrationState::kAbortedByDestination);
  CHECK(dst.migrator->moving().empty());
  // The pages return once the source confirms that none of its puts is still in flight.
  REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kAborted, *id) && dst.find(Kind::kAborted, *id); }));
  CHECK(dst.cache->reserved_pages() == 0);
  CHECK(dst.cache->free_pages() == 64);
  const MigrationEvent& s = *src.find(Kind::kAborted, *id);
  INFO(s.reason.to_string());
  CHECK(s.state == MigrationState::kAbortedByDestination);
  CHECK(s.reason.message().find("out of room after all") != std::string::npos);
  CHECK(*dst.migrator->state(*id) == MigrationState::kAbortedByDestination);
  CHECK(dst.find(Kind::kAborted, *id)->state == MigrationState::kAbortedByDestination);
  // Still the source's: it decodes on.
  CHECK(src.migrator->moving().empty());
  append(*src.cache, SequenceId(8), 7);
  CHECK(rows_differ(*src.cache, SequenceId(8), 29) == "");
  CHECK(src.migrator->finish(*id, states_of(*src.cache, {SequenceId(8)})).code() == StatusCode::kNotFound);
}

TEST_CASE("kv migrator: a destination whose source falls silent gives up when the lease runs out") {
  auto clock = std::make_shared<laminar::ManualClock>();
  KvMigratorOptions o;
  o.lease = 5s;
  o.clock = clock;
  Worker src = make_worker();
  Worker dst = make_worker(o);
  add(*src.cache, SequenceId(4), 10);
  auto id = src.migrator->migrate(dst.address, std::vector<SequenceId>{SequenceId(4)});
  REQUIRE(id.ok());
  // Only the destination polls: the source, stuck, never takes the reservation.
  REQUIRE(drive({&dst}, [&] { return dst.cache->reserved_pages() > 0; }));
  const std::int32_t reserved = dst.cache->reserved_pages();
  CHECK(reserved == pages_of(10) + 4);
  REQUIRE(clock->advance(4s).ok());
  poll(dst);
  CHECK(dst.migrator->stats().lease_expiries == 0);
  CHECK(*dst.migrator->state(*id) == MigrationState::kRunning);
  REQUIRE(clock->advance(2s).ok());
  poll(dst);
  CHECK(dst.migrator->stats().lease_expiries == 1);
  CHECK(dst.migrator->stats().aborted_in == 1);
  CHECK(*dst.migrator->state(*id) == MigrationState::kAbortedByDestination);
  CHECK(dst.migrator->moving().empty());
  // Given up, but a source that is only slow could still put into the pages: they stay out of
  // the free list until it is heard from, gone, or another lease passed.
  CHECK(dst.cache->reserved_pages() == reserved);
  CHECK(dst.count(Kind::kAborted) == 0);
  SECTION("the source wakes up, hears of the expiry and keeps its sequence") {
    REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kAborted, *id) && dst.find(Kind::kAborted, *id); }));
    CHECK(src.find(Kind::kAborted, *id)->state == MigrationState::kAbortedByDestination);
    CHECK(src.find(Kind::kAborted, *id)->reason.code() == StatusCode::kDeadlineExceeded);
    CHECK(rows_differ(*src.cache, SequenceId(4), 10) == "");
  }
  SECTION("the source is gone") {
    src.migrator.reset();
    src.transport.reset();
    REQUIRE(drive({&dst}, [&] { return dst.find(Kind::kAborted, *id) != nullptr; }));
  }
  SECTION("the source never answers") {
    REQUIRE(clock->advance(4s).ok());
    poll(dst);
    CHECK(dst.count(Kind::kAborted) == 0);
    REQUIRE(clock->advance(1s).ok());
    poll(dst);
    CHECK(dst.find(Kind::kAborted, *id) != nullptr);
  }
  CHECK(dst.find(Kind::kAborted, *id)->reason.code() == StatusCode::kDeadlineExceeded);
  CHECK(dst.find(Kind::kAborted, *id)->state == MigrationState::kAbortedByDestination);
  CHECK(dst.cache->reserved_pages() == 0);
  CHECK(dst.cache->free_pages() == 64);
}

TEST_CASE("kv migrator: a destination that vanishes mid-migration leaves the sequences at the source") {
  KvMigratorOptions o;
  o.stage_bytes = 1;
  Worker src = make_worker(o);
  Worker dst = make_worker(o);
  add(*src.cache, SequenceId(6), 33);
  add(*src.cache, SequenceId(7), 3);
  const std::vector<SequenceId> seqs = {SequenceId(6), SequenceId(7)};
  auto id = src.migrator->migrate(dst.address, seqs);
  REQUIRE(id.ok());
  REQUIRE(drive({&src, &dst}, [&] { return src.migrator->stats().pages_sent > 0; }));
  dst.migrator.reset();
  dst.transport.reset();
  REQUIRE(drive({&src}, [&] { return src.find(Kind::kAborted, *id) != nullptr; }));
  const MigrationEvent& e = *src.find(Kind::kAborted, *id);
  INFO(e.reason.to_string());
  CHECK(e.state == MigrationState::kAbortedByDestination);
  CHECK(e.sequences == seqs);
  CHECK(rows_differ(*src.cache, SequenceId(6), 33) == "");
  CHECK(rows_differ(*src.cache, SequenceId(7), 3) == "");
  CHECK(src.migrator->moving().empty());
  append(*src.cache, SequenceId(7), 2);
  CHECK(rows_differ(*src.cache, SequenceId(7), 5) == "");
}

TEST_CASE("kv migrator: finish() refuses wrong states and the migration waits for right ones") {
  Worker src = make_worker();
  Worker dst = make_worker();
  add(*src.cache, SequenceId(1), 6);
  add(*src.cache, SequenceId(2), 9);
  add(*src.cache, SequenceId(3), 2);
  const std::vector<SequenceId> seqs = {SequenceId(1), SequenceId(2)};
  auto id = src.migrator->migrate(dst.address, seqs);
  REQUIRE(id.ok());
  REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kPauseRequested, *id) != nullptr; }));
  const std::vector<SequenceState> good = states_of(*src.cache, seqs);
  const auto refused = [&](std::vector<SequenceState> states, const char* what) {
    INFO(what);
    const laminar::Status st = src.migrator->finish(*id, std::move(states));
    INFO(st.to_string());
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(*src.migrator->state(*id) == MigrationState::kRunning);
  };
  refused({good[0]}, "missing");
  refused({good[0], good[1], state_of(*src.cache, SequenceId(3))}, "extra");
  refused({good[0], good[0], good[1]}, "repeated");
  auto wrong_length = good;
  wrong_length[1].kv_length = 8;
  refused(wrong_length, "kv_length");
  auto wrong_version = good;
  wrong_version[0].version = Version(3);
  refused(wrong_version, "version");
  auto bad_sampling = good;
  bad_sampling[1].temperature = -1.0f;
  refused(bad_sampling, "temperature");
  auto bad_logprobs = good;
  bad_logprobs[0].logprobs = {-1.0f};
  refused(bad_logprobs, "logprobs");
  CHECK(src.migrator->finish(MigrationId(id->value() + 1), good).code() == StatusCode::kNotFound);
  // Polls meanwhile move nothing on.
  for (int i = 0; i < 10; ++i) {
    poll(src);
    poll(dst);
  }
  CHECK(dst.count(Kind::kArrived) == 0);
  // In any order.
  REQUIRE(src.migrator->finish(*id, {good[1], good[0]}).ok());
  REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kDone, *id) && dst.find(Kind::kArrived, *id); }));
  CHECK(dst.find(Kind::kArrived, *id)->states == good);
  CHECK(rows_differ(*dst.cache, SequenceId(1), 6) == "");
  CHECK(rows_differ(*dst.cache, SequenceId(2), 9) == "");
  CHECK(src.cache->length(SequenceId(3)).value() == 2);
  CHECK(src.migrator->abort(*id, "too late").code() == StatusCode::kFailedPrecondition);
}

TEST_CASE("kv migrator: a page that arrives corrupted fails its checksum and nothing is committed") {
  KvMigratorOptions o;
  o.max_live_stages = 0;
  Worker src = make_worker(o);
  Worker dst = make_worker(o);
  add(*src.cache, SequenceId(9), 14);
  auto id = src.migrator->migrate(dst.address, std::vector<SequenceId>{SequenceId(9)});
  REQUIRE(id.ok());
  REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kPauseRequested, *id) != nullptr; }));
  REQUIRE(src.migrator->finish(*id, states_of(*src.cache, {SequenceId(9)})).ok());
  // The pages landed and the final stage is on its way, not yet checked: flip one byte in every
  // page of the destination, none of which holds a live sequence.
  REQUIRE(drive({&src}, [&] { return src.migrator->stats().pages_sent == std::uint64_t(pages_of(14)); }));
  sync_with(src, dst);
  const std::int32_t layer = 2;
  for (std::int32_t p = 0; p < 64; ++p) static_cast<unsigned char*>(dst.cache->v_page(layer, p).value())[5] ^= 1;
  REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kAborted, *id) && dst.find(Kind::kAborted, *id); }));
  CHECK(dst.migrator->stats().checksum_failures == std::uint64_t(pages_of(14)));
  CHECK(dst.find(Kind::kAborted, *id)->reason.code() == StatusCode::kDataLoss);
  const MigrationEvent& s = *src.find(Kind::kAborted, *id);
  CHECK(s.reason.code() == StatusCode::kDataLoss);
  CHECK(s.state == MigrationState::kAbortedByDestination);
  CHECK(dst.cache->num_sequences() == 0);
  CHECK(dst.cache->reserved_pages() == 0);
  CHECK(dst.count(Kind::kArrived) == 0);
  CHECK(rows_differ(*src.cache, SequenceId(9), 14) == "");
}

TEST_CASE("kv migrator: a source whose destination stops answering gives up after stall_timeout") {
  auto clock = std::make_shared<laminar::ManualClock>();
  KvMigratorOptions o;
  o.stall_timeout = 3s;
  o.clock = clock;
  Worker src = make_worker(o);
  Worker dst = make_worker();
  add(*src.cache, SequenceId(2), 12);
  auto id = src.migrator->migrate(dst.address, std::vector<SequenceId>{SequenceId(2)});
  REQUIRE(id.ok());
  REQUIRE(drive({&dst}, [&] { return dst.cache->reserved_pages() > 0; }));
  // The destination answered the offer and then hangs: the first stage goes out unanswered.
  REQUIRE(drive({&src}, [&] { return src.migrator->stats().pages_sent > 0; }));
  REQUIRE(clock->advance(2s).ok());
  poll(src);
  CHECK(src.count(Kind::kAborted) == 0);
  REQUIRE(clock->advance(2s).ok());
  poll(src);
  REQUIRE(src.find(Kind::kAborted, *id) != nullptr);
  const MigrationEvent& e = *src.find(Kind::kAborted, *id);
  CHECK(e.state == MigrationState::kAbortedBySource);
  CHECK(e.reason.code() == StatusCode::kDeadlineExceeded);
  CHECK(rows_differ(*src.cache, SequenceId(2), 12) == "");
  // The destination comes back, finds the abort after the stage, and returns the pages.
  REQUIRE(drive({&src, &dst}, [&] { return dst.find(Kind::kAborted, *id) != nullptr; }));
  CHECK(dst.find(Kind::kAborted, *id)->state == MigrationState::kAbortedBySource);
  CHECK(dst.cache->reserved_pages() == 0);
  CHECK(dst.cache->free_pages() == 64);
  CHECK(dst.count(Kind::kArrived) == 0);
}

TEST_CASE("kv migrator: a sequence that fills its reserved pages is paused, and one that outgrows them stays") {
  KvMigratorOptions o;
  o.growth_pages = 1;
  Worker src = make_worker(o);
  Worker dst = make_worker(o);
  add(*src.cache, SequenceId(1), 8);  // two pages; three reserved
  auto id = src.migrator->migrate(dst.address, std::vector<SequenceId>{SequenceId(1)});
  REQUIRE(id.ok());
  append(*src.cache, SequenceId(1), 1);  // the third page
  REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kPauseRequested, *id) != nullptr; }));
  // Paused on reaching the reservation, before any live stage.
  CHECK(src.migrator->stats().pages_sent == 0);
  append(*src.cache, SequenceId(1), 4);  // a fourth page: it no longer fits at the destination
  const laminar::Status st = src.migrator->finish(*id, states_of(*src.cache, {SequenceId(1)}));
  CHECK(st.code() == StatusCode::kResourceExhausted);
  REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kAborted, *id) && dst.find(Kind::kAborted, *id); }));
  CHECK(src.find(Kind::kAborted, *id)->state == MigrationState::kAbortedBySource);
  CHECK(*src.migrator->state(*id) == MigrationState::kAbortedBySource);
  CHECK(rows_differ(*src.cache, SequenceId(1), 13) == "");
  CHECK(dst.cache->reserved_pages() == 0);
}

TEST_CASE("kv migrator: a sequence that fills its pages while the offer waits is paused and moves whole") {
  KvMigratorOptions o;
  o.growth_pages = 1;
  Worker src = make_worker(o);
  Worker dst = make_worker(o);
  add(*src.cache, SequenceId(1), 8);  // two pages; three offered
  auto id = src.migrator->migrate(dst.address, std::vector<SequenceId>{SequenceId(1)});
  REQUIRE(id.ok());
  append(*src.cache, SequenceId(1), 1);  // the third page, before the destination even polled
  REQUIRE(drive({&src}, [&] { return src.find(Kind::kPauseRequested, *id) != nullptr; }));
  CHECK(dst.cache->reserved_pages() == 0);
  REQUIRE(src.migrator->finish(*id, states_of(*src.cache, {SequenceId(1)})).ok());
  REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kDone, *id) && dst.find(Kind::kArrived, *id); }));
  CHECK(rows_differ(*dst.cache, SequenceId(1), 9) == "");
  CHECK(src.migrator->stats().pages_sent == 3);
  CHECK(src.cache->free_pages() == 64);
  CHECK(dst.cache->reserved_pages() == 0);
}

TEST_CASE("kv migrator: two workers move sequences to each other at once") {
  Worker a = make_worker();
  Worker b = make_worker();
  add(*a.cache, SequenceId(1), 11);
  add(*a.cache, SequenceId(2), 4);
  add(*b.cache, SequenceId(3), 19);
  add(*b.cache, SequenceId(4), 6);
  auto ab = a.migrator->migrate(b.address, std::vector<SequenceId>{SequenceId(1), SequenceId(2)});
  auto ba = b.migrator->migrate(a.address, std::vector<SequenceId>{SequenceId(3)});
  REQUIRE(ab.ok());
  REQUIRE(ba.ok());
  CHECK(a.migrator->moving().size() == 2);
  // Each host answers its pause requests as its decode loop would.
  std::size_t answered_a = 0;
  std::size_t answered_b = 0;
  const auto answer = [](Worker& w, std::size_t& answered) {
    bool any = false;
    for (; answered < w.events.size(); ++answered) {
      const MigrationEvent& e = w.events[answered];
      if (e.kind != Kind::kPauseRequested) continue;
      REQUIRE(w.migrator->finish(e.id, states_of(*w.cache, e.sequences)).ok());
      any = true;
    }
    return any;
  };
  REQUIRE(drive({&a, &b},
                [&] {
                  return a.find(Kind::kDone, *ab) && b.find(Kind::kDone, *ba) && a.find(Kind::kArrived, *ba) &&
                         b.find(Kind::kArrived, *ab);
                },
                [&] {
                  const bool by_a = answer(a, answered_a);
                  return answer(b, answered_b) || by_a;
                }));
  CHECK(rows_differ(*b.cache, SequenceId(1), 11) == "");
  CHECK(rows_differ(*b.cache, SequenceId(2), 4) == "");
  CHECK(rows_differ(*a.cache, SequenceId(3), 19) == "");
  CHECK(rows_differ(*b.cache, SequenceId(4), 6) == "");
  CHECK(a.cache->num_sequences() == 1);
  CHECK(b.cache->num_sequences() == 3);
  CHECK(a.cache->reserved_pages() == 0);
  CHECK(b.cache->reserved_pages() == 0);
  CHECK(a.cache->free_pages() == 64 - pages_of(19));
  CHECK(b.cache->free_pages() == 64 - pages_of(11) - pages_of(4) - pages_of(6));
}

TEST_CASE("kv migrator: random lengths, stage sizes and decoding between polls still move every byte") {
  // LAMINAR_TEST_SEED replays a failure.
  const char* replay = std::getenv("LAMINAR_TEST_SEED");
  const std::uint64_t seed = replay != nullptr ? std::strtoull(replay, nullptr, 10) : std::random_device{}();
  INFO("seed " << seed);
  std::printf("kv migrator random test: seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  const auto uniform = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  for (int round = 0; round < 4; ++round) {
    KvMigratorOptions o;
    o.max_live_stages = std::uint32_t(uniform(0, 5));
    o.pause_after_pages = std::uint32_t(uniform(0, 3));
    o.growth_pages = 64;
    // From one page (of all layers and both pools: 768 bytes) a stage to all of them.
    o.stage_bytes = std::size_t(uniform(1, 40)) * 768;
    Worker src = make_worker(o, layout(1024));
    Worker dst = make_worker(o, layout(1024));
    std::vector<SequenceId> seqs;
    std::vector<std::int64_t> reserved;  // tokens each sequence may reach while it moves
    const std::int64_t n = uniform(1, 6);
    for (std::int64_t i = 0; i < n; ++i) {
      seqs.push_back(SequenceId(std::uint64_t(100 * round + i)));
      add(*src.cache, seqs.back(), uniform(0, 60));
      reserved.push_back((std::int64_t(src.cache->pages(seqs.back())->size()) + 64) * 4);
    }
    auto id = src.migrator->migrate(dst.address, seqs);
    REQUIRE(id.ok());
    // Decodes a few tokens of each sequence now and then, until asked to pause.
    REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kPauseRequested, *id) != nullptr; },
                  [&] {
                    if (src.find(Kind::kPauseRequested, *id) || uniform(0, 3) != 0) return false;
                    for (std::size_t i = 0; i < seqs.size(); ++i) {
                      const std::int64_t room = reserved[i] - src.cache->length(seqs[i]).value();
                      append(*src.cache, seqs[i], std::min<std::int64_t>(uniform(0, 6), room));
                    }
                    return true;
                  }));
    std::vector<std::int64_t> lengths;
    for (SequenceId s : seqs) lengths.push_back(src.cache->length(s).value());
    const std::vector<SequenceState> states = states_of(*src.cache, seqs);
    REQUIRE(src.migrator->finish(*id, states).ok());
    const bool moved = drive({&src, &dst}, [&] { return src.find(Kind::kDone, *id) && dst.find(Kind::kArrived, *id); });
    for (const Worker* w : {&src, &dst}) {
      for (const MigrationEvent& e : w->events) {
        UNSCOPED_INFO((w == &src ? "source" : "destination") << " event " << int(e.kind) << " "
                                                              << e.reason.to_string());
      }
    }
    REQUIRE(moved);
    CHECK(dst.find(Kind::kArrived, *id)->states == states);
    std::int64_t pages = 0;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      INFO("sequence " << seqs[i].value() << " of " << lengths[i] << " tokens");
      CHECK(rows_differ(*dst.cache, seqs[i], lengths[i]) == "");
      pages += pages_of(lengths[i]);
    }
    CHECK(src.migrator->stats().pages_sent == std::uint64_t(pages));
    CHECK(dst.migrator->stats().pages_received == std::uint64_t(pages));
    CHECK(src.cache->free_pages() == 1024);
    CHECK(dst.cache->free_pages() == 1024 - pages);
    CHECK(dst.cache->reserved_pages() == 0);
  }
}

TEST_CASE("kv migrator: bytes that do not decode, stray stages and forged aborts change nothing") {
  namespace li = laminar::internal;
  Worker src = make_worker();
  Worker dst = make_worker();
  add(*src.cache, SequenceId(1), 10);
  ProtocolPeer peer{dst};
  const auto garbage = [](std::size_t n) { return std::vector<std::byte>(n, std::byte{0xA5}); };

  auto offer = peer.ask(li::kMigrationOfferMessage, garbage(7));
  CHECK(offer.status().code() == StatusCode::kDataLoss);
  CHECK(dst.migrator->stats().offers_refused == 1);
  auto stage = peer.ask(li::kMigrationStageMessage, garbage(30));
  CHECK_FALSE(stage.ok());
  // A well-formed stage of a migration nobody started here.
  auto stray = peer.ask(li::kMigrationStageMessage, li::encode_migration_stage({77, 0, false, {}}));
  REQUIRE(stray.ok());
  auto refused = li::decode_migration_stage_answer(stray->body);
  REQUIRE(refused.ok());
  REQUIRE(refused->refusal.has_value());
  CHECK(refused->refusal->code == StatusCode::kNotFound);
  REQUIRE(li::send_protocol(peer.ep, laminar::Message{li::kMigrationAbortMessage, garbage(3)}).ok());

  // A real migration runs alongside; an abort of it from another connection is ignored.
  auto id = src.migrator->migrate(dst.address, std::vector<SequenceId>{SequenceId(1)});
  REQUIRE(id.ok());
  REQUIRE(drive({&src, &dst}, [&] { return !dst.migrator->moving().empty(); }));
  const li::MigrationAbort forged{id->value(), li::MigrationSide::kSource, StatusCode::kAborted, "forged"};
  REQUIRE(li::send_protocol(peer.ep, laminar::Message{li::kMigrationAbortMessage, li::encode_migration_abort(forged)})
              .ok());
  auto late = peer.ask(li::kMigrationStageMessage, li::encode_migration_stage({id->value(), 0, false, {}}));
  REQUIRE(late.ok());
  CHECK(li::decode_migration_stage_answer(late->body)->refusal->code == StatusCode::kNotFound);
  CHECK(*dst.migrator->state(*id) == MigrationState::kRunning);
  REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kPauseRequested, *id) != nullptr; }));
  REQUIRE(src.migrator->finish(*id, states_of(*src.cache, {SequenceId(1)})).ok());
  REQUIRE(drive({&src, &dst}, [&] { return src.find(Kind::kDone, *id) && dst.find(Kind::kArrived, *id); }));
  CHECK(rows_differ(*dst.cache, SequenceId(1), 10) == "");
  CHECK(dst.count(Kind::kAborted) == 0);
  CHECK(dst.migrator->background_error().ok());
}

TEST_CASE("kv migrator: a destination that does not poll queues at most 256 messages and refuses the rest") {
  namespace li = laminar::internal;
  Worker dst = make_worker();
  ProtocolPeer peer{dst};
  std::vector<std::future<laminar::Result<laminar::Message>>> answers;
  for (int i = 0; i < 260; ++i) {
    answers.push_back(li::request_protocol_async(
        peer.ep, laminar::Message{li::kMigrationOfferMessage, std::vector<std::byte>(5, std::byte{1})}, 20s));
  }
  // Without a poll, only the four past the bound are answered, by the transport's callback thread.
  // Transient: the room comes back at the next poll().
  std::size_t refused = 0;
  for (std::size_t i = 256; i < answers.size(); ++i) {
    REQUIRE(answers[i].wait_for(10s) == std::future_status::ready);
    refused += answers[i].get().status().code() == StatusCode::kUnavailable;
  }
  CHECK(refused == 4);
  CHECK(answers[0].wait_for(0s) != std::future_status::ready);
  poll(dst);
  for (std::size_t i = 0; i < 256; ++i) {
    REQUIRE(answers[i].wait_for(10s) == std::future_status::ready);
    CHECK(answers[i].get().status().code() == StatusCode::kDataLoss);
  }
  CHECK(dst.migrator->stats().offers_refused == 256);
}

TEST_CASE("kv migrator: attention over the moved pages equals the source's bit for bit") {
  // head_dim 64: a size the attention kernels take.
  Worker src = make_worker({}, layout(64, 64));
  Worker dst = make_worker({}, layout(64, 64));
  add(*dst.cache, SequenceId(50), 7);  // the destination's own pages come first there
  const std::vector<SequenceId> seqs = {SequenceId(1), SequenceId(2)};
  add(*src.cache, seqs[0], 37);
  add(*src.cache, seqs[1], 4);
  constexpr std::int32_t kHeads = 4;  // two query heads per KV head
  const KvLayout& l = src.cache->layout();
  constexpr std::size_t kRow = kHeads * 64;
  // Each sequence's query: [kHeads, 64].
  const auto query = [](SequenceId s) {
    std::vector<float> q(kRow);
    for (std::size_t i = 0; i < q.size(); ++i) q[i] = pattern(s, std::int64_t(i), 0, 0, 0) / float(1 << 24);
    return q;
  };
  // Each layer's outputs and log-sum-exps for the batch `order`, rows in the order of `seqs`.
  const auto attend = [&](PagedKvCache& cache, const std::vector<SequenceId>& order) {
    std::vector<float> q;
    for (SequenceId s : order) {
      const std::vector<float> row = query(s);
      q.insert(q.end(), row.begin(), row.end());
    }
    std::vector<float> all;
    laminar::PageTableBuffer table;
    REQUIRE(cache.build_page_table(order, &table).ok());
    for (std::int32_t layer = 0; layer < l.num_layers; ++layer) {
      std::vector<float> out(q.size());
      std::vector<float> lse(2 * kHeads);
      laminar::kernels::PagedDecodeParams p;
      p.q = q.data();
      p.out = out.data();
      p.lse = lse.data();
      p.kv = cache.view(layer).value();
      p.table = table.view();
      p.num_rows = 2;
      p.num_qo_heads = kHeads;
      p.sm_scale = 0.125f;
      p.max_kv_len = 64;
      REQUIRE(laminar::kernels::run(p, laminar::Stream::host()).ok());
      const bool swapped = order[0] != seqs[0];
      for (std::size_t row : {swapped ? 1u : 0u, swapped ? 0u : 1u}) {
        all.insert(all.end(), out.begin() + std::ptrdiff_t(row * kRow), out.begin() + std::ptrdiff_t((row + 1) * kRow));
        all.insert(all.end(), lse.begin() + std::ptrdiff_t(row * kHeads),
                   lse.begin() + std::ptrdiff_t((row + 1) * kHeads));
      }
    }
    return all;
  };
  const std::vector<float> before = attend(*src.cache, seqs);
  migrate_all(src, dst, seqs);
  // Other page ids and the other batch order: the same bits.
  const std::vector<float> after = attend(*dst.cache, {seqs[1], seqs[0]});
  REQUIRE(before.size() == after.size());
  CHECK(std::memcmp(before.data(), after.data(), before.size() * sizeof(float)) == 0);
  CHECK((*dst.cache->pages(seqs[1]))[0] != (*dst.cache->pages(SequenceId(50)))[0]);
}

TEST_CASE("kv migrator: device pools need a usable device, and say so when there is none") {
  std::shared_ptr<laminar::Transport> t = make_transport();
  const KvLayout l = layout(8);
  // Views that name CUDA device 0: create() decides from the device before it reads a byte.
  std::vector<float> k(std::size_t(l.pool_bytes() / 4)), v(k.size());
  const std::vector<std::int64_t> shape = {l.num_layers, l.num_pages, l.page_size, l.num_kv_heads, l.head_dim};
  auto kv = laminar::TensorView::contiguous(k.data(), DType::kF32, shape, laminar::Device::cuda(0));
  auto vv = laminar::TensorView::contiguous(v.data(), DType::kF32, shape, laminar::Device::cuda(0));
  REQUIRE(kv.ok());
  REQUIRE(vv.ok());
  auto cache = std::make_shared<PagedKvCache>(PagedKvCache::create(l, *kv, *vv).value());
  const auto code = laminar::testing::code_without_device();
  auto m = KvMigrator::create(t, cache);
  if (!code) {
    // A machine with a device: the migrator takes the pools (their pages would go by NCCL).
    CHECK(m.ok());
    return;
  }
  INFO(m.status().to_string());
  REQUIRE_FALSE(m.ok());
  CHECK_THAT(m.status().message(), Catch::Contains("the cache's pools are on cuda:0"));
  if (*code == StatusCode::kUnimplemented) {
    // Not compiled in.
    CHECK(m.status().code() == StatusCode::kUnimplemented);
    CHECK_THAT(m.status().message(), Catch::Contains("built without CUDA (LAMINAR_CUDA=OFF)"));
  } else {
    // Compiled in, and the runtime names why it cannot use a device.
    CHECK(m.status().code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(m.status().message(), Catch::Contains("no usable CUDA device"));
  }
}

TEST_CASE("kv migrator: a host-pool worker refuses device pools' offers and stages, and nothing changes") {
  namespace li = laminar::internal;
  Worker dst = make_worker();
  ProtocolPeer peer{dst};
  const std::int64_t free_before = dst.cache->free_pages();
  const KvLayout& l = dst.cache->layout();
  li::MigrationOffer offer{5, dst.migrator->version(), {l.num_layers, l.page_size, l.num_kv_heads, l.head_dim, l.dtype},
                           {{SequenceId(3), 6, 4}}, li::KvPools::kDevice};
  auto answer = peer.ask(li::kMigrationOfferMessage, li::encode_migration_offer(offer));
  REQUIRE(answer.ok());
  auto r = li::decode_migration_reservation(answer->body);
  REQUIRE(r.ok());
  REQUIRE(r->refusal.has_value());
  CHECK(r->refusal->code == StatusCode::kFailedPrecondition);
  CHECK_THAT(r->refusal->text, Catch::Contains("the source's pools are in device memory, this worker's in host memory"));
  CHECK(dst.cache->free_pages() == free_before);
  CHECK(dst.migrator->moving().empty());

  // The same offer of host pools is taken; a stage that says its pages came by NCCL is refused
  // and the reservation returns.
  offer.pools = li::KvPools::kHost;
  answer = peer.ask(li::kMigrationOfferMessage, li::encode_migration_offer(offer));
  REQUIRE(answer.ok());
  r = li::decode_migration_reservation(answer->body);
  REQUIRE(r.ok());
  REQUIRE_FALSE(r->refusal.has_value());
  CHECK(r->link == 0);
  CHECK(r->link_token.empty());
  CHECK(dst.cache->free_pages() == free_before - 4);
  li::MigrationStage stage{5, 0, false, {{SequenceId(3), 0, {1}, {}, {1}}}, 1};
  auto refused = peer.ask(li::kMigrationStageMessage, li::encode_migration_stage(stage));
  REQUIRE(refused.ok());
  auto a = li::decode_migration_stage_answer(refused->body);
  REQUIRE(a.ok());
  REQUIRE(a->refusal.has_value());
  CHECK(a->refusal->code == StatusCode::kInvalidArgument);
  CHECK_THAT(a->refusal->text, Catch::Contains("its pages came by NCCL, this worker's pools are in host memory"));
  CHECK(*dst.migrator->state(MigrationId(5)) == MigrationState::kAbortedByDestination);
  // Fenced as any refused stage: the pages return once the source confirms or its connection goes.
  peer.ep.close();
  REQUIRE(drive({&dst}, [&] { return dst.cache->free_pages() == free_before; }));
}

TEST_CASE("kv migrator: wait_event wakes on what the peer sends and on its own lease, and returns empty at its deadline") {
  SECTION("two hosts that wait instead of polling move a sequence") {
    Worker src = make_worker();
    Worker dst = make_worker();
    add(*src.cache, SequenceId(6), 14);
    const auto start = std::chrono::steady_clock::now();
    auto id = src.migrator->migrate(dst.address, std::vector<SequenceId>{SequenceId(6)});
    REQUIRE(id.ok());
    // The destination's host: nothing to decode, so it waits, until the sequence arrives.
    std::future<std::vector<MigrationEvent>> arrived = std::async(std::launch::async, [&] {
      std::vector<MigrationEvent> seen;
      for (;;) {
        std::vector<MigrationEvent> events = dst.migrator->wait_event(20s);
        if (events.empty()) return seen;  // the deadline: fails below
        for (MigrationEvent& e : events) seen.push_back(std::move(e));
        if (std::ranges::any_of(seen, [](const MigrationEvent& e) { return e.kind == Kind::kArrived; })) return seen;
      }
    });
    std::vector<MigrationEvent> events = src.migrator->wait_event(20s);
    REQUIRE(events.size() == 1);
    CHECK(events[0].kind == Kind::kPauseRequested);
    REQUIRE(src.migrator->finish(*id, states_of(*src.cache, {SequenceId(6)})).ok());
    events = src.migrator->wait_event(20s);
    REQUIRE(events.size() == 1);
    CHECK(events[0].kind == Kind::kDone);
    const std::vector<MigrationEvent> at_dst = arrived.get();
    REQUIRE(at_dst.size() == 1);
    CHECK(at_dst[0].kind == Kind::kArrived);
    // Woken by each step of the protocol, never by the 20 s deadline.
    CHECK(std::chrono::steady_clock::now() - start < 10s);
    CHECK(rows_differ(*dst.cache, SequenceId(6), 14) == "");
  }
  SECTION("a lease and a fence that run out on a ManualClock") {
    auto clock = std::make_shared<laminar::ManualClock>();
    KvMigratorOptions o;
    o.lease = 5s;
    o.clock = clock;
    Worker src = make_worker();
    Worker dst = make_worker(o);
    add(*src.cache, SequenceId(4), 10);
    auto id = src.migrator->migrate(dst.address, std::vector<SequenceId>{SequenceId(4)});
    REQUIRE(id.ok());
    REQUIRE(drive({&dst}, [&] { return dst.cache->reserved_pages() > 0; }));
    CHECK(dst.migrator->poll_deadline() == 5s);  // the lease
    REQUIRE(clock->advance(6s).ok());
    CHECK(dst.migrator->wait_event(0s).empty());
    CHECK(dst.migrator->stats().lease_expiries == 1);
    CHECK(dst.migrator->poll_deadline() == 11s);  // the fence, a lease after the expiry
    // No deadline of its own: the fence's end wakes it, when the clock gets there.
    std::future<std::vector<MigrationEvent>> waited =
        std::async(std::launch::async, [&] { return dst.migrator->wait_event(laminar::kForever); });
    REQUIRE(clock->advance(5s).ok());
    REQUIRE(waited.wait_for(10s) == std::future_status::ready);
    const std::vector<MigrationEvent> events = waited.get();
    REQUIRE(events.size() == 1);
    CHECK(events[0].kind == Kind::kAborted);
    CHECK_FALSE(events[0].outgoing);
    CHECK(dst.cache->reserved_pages() == 0);
    CHECK(dst.migrator->poll_deadline() == laminar::kForever);
  }
  SECTION("nothing happens") {
    Worker w = make_worker();
    CHECK(w.migrator->wait_event(0s).empty());
    CHECK(w.migrator->poll_deadline() == laminar::kForever);
    const auto start = std::chrono::steady_clock::now();
    CHECK(w.migrator->wait_event(30ms).empty());
    CHECK(std::chrono::steady_clock::now() - start >= 30ms);  // at the deadline, not before
  }
}
