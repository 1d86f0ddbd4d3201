// The relay and rollout worker roles: the processes between the actor's head relay and the
// trajectories that reach its queue.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "engine.h"
#include "pacing.h"
#include "laminar/kv_migrator.h"
#include "laminar/migration_host.h"
#include "laminar/relay_node.h"
#include "laminar/relay_store.h"
#include "laminar/remote_trajectory_queue.h"
#include "laminar/repack_driver.h"
#include "laminar/rollout_dispatcher.h"
#include "laminar/weight_puller.h"
#include "records.h"
#include "roles.h"
#include "task.h"

namespace async_grpo {

namespace fs = std::filesystem;
using laminar::Result;
using laminar::Status;
using namespace std::chrono_literals;

// A relay: a RelayNode between the actor and the workers.
int run_relay(const Settings& s, const RoleArgs& args) {
  RoleArgs a = args;
  const std::string who = fmt::format("relay-{}", a.index);
  if (Status st = find_peers(s, a, kRendezvousTimeout); !st.ok()) return fail(who, "rendezvous", st);
  auto transport = make_transport(a.token);
  if (!transport.ok()) return fail(who, "transport", transport.status());
  auto host = listen_host(a.host);
  if (!host.ok()) return fail(who, "host", host.status());
  auto address = (*transport)->listen(*host, 0);
  if (!address.ok()) return fail(who, "listen", address.status());
  auto store = laminar::RelayStore::create();
  if (!store.ok()) return fail(who, "relay store", store.status());
  laminar::RelayNodeOptions o;
  o.upstreams = {a.actor};
  auto node = laminar::RelayNode::create(*transport, std::move(*store), o);
  if (!node.ok()) return fail(who, "relay node", node.status());
  if (Status st = write_address(a.dir, who, *address); !st.ok()) return fail(who, "address", st);
  // Serves until the actor has left, or a stop signal; a restarted actor finds it still serving.
  (void)wait_for_files(a.dir, std::array{std::string("actor.left")}, kForeverish, /*on_signal=*/true);
  return 0;
}

// A rollout worker: engine, cache, worker-local store, puller, dispatch client, queue producer, and
// under the laminar schedule a KvMigrator and a RepackDriver.
namespace {

// {"versions":[3,4],"from_token":[0,5]}: the metadata of a trajectory decoded under several
// versions, which the actor leaves out of its bit-equal re-scoring.
std::string mixed_versions_json(const std::vector<std::pair<std::uint64_t, std::size_t>>& versions) {
  std::string v, from;
  for (const auto& [version, token] : versions) {
    v += fmt::format("{}{}", v.empty() ? "" : ",", version);
    from += fmt::format("{}{}", from.empty() ? "" : ",", token);
  }
  return fmt::format(R"({{"versions":[{}],"from_token":[{}]}})", v, from);
}

struct Live {
  bool paused = false;  // a migration out of this worker holds it
  laminar::SequenceState seq;
  // The areal schedule: each version the sequence was decoded under, and the index of the first
  // response token sampled under it (seq.version is the first).
  std::vector<std::pair<std::uint64_t, std::size_t>> versions;
  async_grpo::DigitPrompt prompt;
  std::int32_t max_tokens = 0;
  std::int64_t start_ns = 0;
};

class Rollout {
 public:
  Rollout(const Settings& s, const RoleArgs& a) : s_(s), a_(a), who_(fmt::format("rollout-{}", a.index)) {}

  int run() {
    auto task = make_task(s_);
    if (!task.ok()) return fail(who_, "task", task.status());
    auto pacing = Pacing::create(s_.pacing);
    if (!pacing.ok()) return fail(who_, "pacing", pacing.status());
    pacing_.emplace(std::move(*pacing));
    task_.emplace(std::move(*task));
    auto engine = async_grpo::Engine::create(async_grpo::PolicyConfig{}, s_.engine_options());
    if (!engine.ok()) return fail(who_, "engine", engine.status());
    engine_.emplace(std::move(*engine));
    destinations_ = engine_->weight_tensors();
    std::error_code made;
    fs::create_directories(fs::path(a_.dir) / "records", made);
    auto writer = async_grpo::RecordWriter::open(fs::path(a_.dir) / "records" / (who_ + ".jsonl"));
    if (!writer.ok()) return fail(who_, "records", writer.status());
    writer_.emplace(std::move(*writer));
    hashes_.emplace(fs::path(a_.dir) / ("weights-" + who_ + ".txt"));
    moved_log_.emplace(fs::path(a_.dir) / ("moved-" + who_ + ".txt"));

    auto transport = make_transport(a_.token);
    if (!transport.ok()) return fail(who_, "transport", transport.status());
    transport_ = *transport;
    const std::int32_t page_size = Settings::kPageSize;
    pages_ = s_.max_live * (engine_->config().max_positions / page_size + 1) + 8;
    auto pools = laminar::KvMigrator::allocate_cache(*transport_, engine_->kv_layout(pages_, page_size));
    if (!pools.ok()) return fail(who_, "cache", pools.status());
    cache_ = pools->cache;
    // Device workers decode in device pools; they run without repack (the launcher refuses it), so
    // the host pools above stay unused.
    if (s_.device == "cuda") {
      auto device_cache = engine_->make_cache(pages_, page_size);
      if (!device_cache.ok()) return fail(who_, "cache", device_cache.status());
      cache_ = *device_cache;
    }
    if (a_.run_schedule == "laminar" && s_.repack) {
      // Migrations arrive at this worker's own address.
      auto listen_on = listen_host(a_.host);
      if (!listen_on.ok()) return fail(who_, "host", listen_on.status());
      if (auto address = transport_->listen(*listen_on, 0); !address.ok()) return fail(who_, "listen", address.status());
      laminar::KvMigratorOptions mo;
      mo.k_pool_region = pools->k_pool;
      mo.v_pool_region = pools->v_pool;
      mo.max_sequences = std::uint32_t(s_.max_live);
      auto migrator = laminar::KvMigrator::create(transport_, cache_, mo);
      if (!migrator.ok()) return fail(who_, "migrator", migrator.status());
      migrator_ = std::move(*migrator);
      migrator_->set_version(laminar::Version(0));
      laminar::RepackDriverOptions dopt;
      dopt.worker = laminar::WorkerId(std::uint32_t(a_.index));
      dopt.coordinator = a_.actor;
      // Reports on change, at most one every 50 ms (two or three paced decode steps): a plan needs
      // the tail's shape, not every page. With nothing new, a keep-alive every third of the
      // actor's stale_after (3 s); the loop's sleep ends by then (poll_deadline).
      dopt.min_report_interval = 50ms;
      dopt.keepalive_interval = 1s;
      auto driver = laminar::RepackDriver::create(transport_, migrator_, dopt);
      if (!driver.ok()) return fail(who_, "repack driver", driver.status());
      driver_ = std::move(*driver);
      driver_->set_notify([this] { wake(); });
      auto host = laminar::MigrationHost::create(migrator_, migration_handlers());
      if (!host.ok()) return fail(who_, "migration host", host.status());
      migration_host_ = std::move(*host);
    }
    auto store = laminar::RelayStore::create();
    if (!store.ok()) return fail(who_, "relay store", store.status());
    store_ = std::move(*store);
    laminar::RelayNodeOptions o;
    o.upstreams = a_.relays;
    o.upstreams.push_back(a_.actor);  // the chain re-forms around a dead relay
    auto node = laminar::RelayNode::create(transport_, store_, o);
    if (!node.ok()) return fail(who_, "relay node", node.status());
    node_ = std::move(*node);
    auto puller = laminar::WeightPuller::create(store_);
    if (!puller.ok()) return fail(who_, "puller", puller.status());
    puller_ = std::move(*puller);
    // The actor may be out of reach for a while here too (stopped, its host cut off): this worker
    // tries again as its loop does; the producer is made again when the first push needs it.
    for (;;) {
      auto client = laminar::DispatchClient::create(transport_, {.worker = laminar::WorkerId(std::uint32_t(a_.index)),
                                                                 .server = a_.actor,
                                                                 .on_answer = [this] { wake(); }});
      if (client.ok()) {
        client_ = std::move(*client);
        in_reach();
        break;
      }
      if (!transient(client.status())) return fail(who_, "dispatch client", client.status());
      if (Status st = out_of_reach(client.status()); !st.ok()) return fail(who_, "dispatch client", st);
      std::this_thread::sleep_until(retry_at_);
    }
    auto producer = laminar::RemoteProducer::create(transport_, a_.actor);
    if (producer.ok()) {
      producer_ = std::move(*producer);
    } else if (!transient(producer.status())) {
      return fail(who_, "producer", producer.status());
    }

    Status st = loop();
    flush_decode();
    if (!st.ok()) return fail(who_, "loop", st);
    // Leaving with the final version still arriving would free memory its relay writes into.
    if (Status w = store_->wait_for_version(laminar::Version(final_version(a_.dir)), 30s); !w.ok())
      return fail(who_, "final version", w);
    std::printf("%s finished: %llu trajectories pushed, %llu refused as already delivered, %llu pulls, "
                "%llu reconnections\n",
                who_.c_str(), static_cast<unsigned long long>(pushed_), static_cast<unsigned long long>(refused_),
                static_cast<unsigned long long>(pulls_), static_cast<unsigned long long>(reconnects_));
    return 0;
  }

 private:
  std::uint64_t current() const { return puller_->current_version() ? puller_->current_version()->value() : 0; }

  // How long the dispatcher may hold a request while it has nothing for this worker: a worker with
  // free slots asks once and sleeps; the answer comes when there is work, or a new version to pull.
  static constexpr laminar::Duration kAskWait = std::chrono::seconds(4);

  Status loop() {
    laminar::Version want{0};  // the dispatcher asked for this version or newer (0: it did not)
    Result<laminar::DispatchAsker> made = laminar::DispatchAsker::create(client_.get(), {.wait = kAskWait});
    if (!made.ok()) return made.status();
    laminar::DispatchAsker asker = std::move(made).value();
    while (final_version(a_.dir) == 0) {
      if (driver_) {
        Result<std::vector<laminar::MigrationEvent>> events = driver_->step(snapshot());
        if (!events.ok()) return events.status();
        for (laminar::MigrationEvent& e : *events) LAMINAR_RETURN_IF_ERROR(handle(e));
      }
      // Finished samples the actor could not take before (out of its reach) go first.
      LAMINAR_RETURN_IF_ERROR(push_unpushed());
      // Answers first, so that a question answered is asked again below before the loop sleeps.
      Result<std::vector<laminar::Grant>> grants = asker.answers();
      if (!grants.ok()) {
        // After the run the actor leaves, and with it the dispatcher.
        if (final_version(a_.dir) > 0) return laminar::ok_status();
        if (!transient(grants.status())) return grants.status();
        LAMINAR_RETURN_IF_ERROR(out_of_reach(grants.status()));
        grants = std::vector<laminar::Grant>{};
      } else if (!grants->empty()) {
        in_reach();
      }
      for (laminar::Grant& grant : *grants) {
        for (laminar::TrajectoryId id : grant.drop) drop(id);
        if (grant.kind == laminar::GrantKind::kPullNewer) want = grant.pull_version;
        if (grant.kind == laminar::GrantKind::kWork) LAMINAR_RETURN_IF_ERROR(start(std::move(grant.samples)));
      }
      if (idle() && !asker.asking()) {
        const std::optional<laminar::Version> newest = puller_->newest_version();
        if (newest && newest->value() > current() && *newest >= want) LAMINAR_RETURN_IF_ERROR(pull(*newest));
      } else if (interruptible() && !idle()) {
        // AReaL's rule: a new version is taken as soon as it is here, live sequences and all.
        const std::optional<laminar::Version> newest = puller_->newest_version();
        if (newest && newest->value() > current()) LAMINAR_RETURN_IF_ERROR(interrupt(*newest));
      }
      if (current() >= want.value()) want = laminar::Version(0);
      // No work before the first pull: the engine's weights are zeros until then.
      taking_ = want.value() == 0 && current() > 0;
      asker.give_back(std::exchange(returned_, {}));
      std::vector<laminar::TrajectoryId> held;
      for (const Live& l : live_) held.push_back(l.seq.trajectory);
      // The next question reconnects first (DispatchClient::request), once it is time to try.
      if (may_try())
        asker.ask({.version = laminar::Version(current()),
                   .taking = taking_,
                   .room = live_.size() < std::size_t(s_.max_live) ? std::uint32_t(s_.max_live - int(live_.size())) : 0,
                   .idle = idle(),
                   .held = std::move(held)});
      if (!idle() && steppable()) {
        LAMINAR_RETURN_IF_ERROR(step());
        continue;
      }
      // Nothing to decode: everything left is paused or moving, or nothing is live.
      flush_decode();
      const std::int64_t t0 = now_ns();
      if (idle() && want.value() > 0) {
        (void)store_->wait_for_version(want, version_wait());
      } else if (asker.asking() || !idle()) {
        sleep_until_woken();
      } else {
        // Before the first version: one committed (one still arriving is not pulled yet).
        (void)store_->wait_for_version(laminar::Version(current() + 1), version_wait());
      }
      LAMINAR_RETURN_IF_ERROR(writer_->write(async_grpo::Span{.process = who_,
                                                              .kind = async_grpo::SpanKind::kIdleWait,
                                                              .start_ns = t0, .end_ns = now_ns(),
                                                              .version = current()}));
    }
    return laminar::ok_status();
  }

  // The dispatcher answered (DispatchClientOptions::on_answer, on the transport's thread).
  void wake() {
    {
      std::lock_guard l(wake_mu_);
      woken_ = true;
    }
    wake_cv_.notify_all();
  }

  // Sleeps until the dispatcher answers or the driver has something for step() (its notify), or
  // the migrator's next deadline; the bound only covers an answer lost with its connection, which
  // the request's own deadline reports.
  void sleep_until_woken() {
    const std::shared_ptr<laminar::Clock> clock = laminar::Clock::steady();
    laminar::Duration until = laminar::deadline_after(*clock, kAskWait + 10s);
    if (driver_) until = std::min(until, driver_->poll_deadline());
    if (!reachable_) until = std::min(until, laminar::deadline_after(*clock, until_retry()));
    std::unique_lock l(wake_mu_);
    while (!woken_ && clock->now() < until) clock->wait_until(wake_cv_, l, until);
    woken_ = false;
  }

  // How long an idle worker waits for a version: while samples it finished wait for an actor out
  // of reach, only until it tries again. (The actor may be waiting for those very samples before
  // it publishes: waiting out the whole bound kept a stopped and continued actor idle 20 s.)
  laminar::Duration version_wait() const { return unpushed_.empty() ? laminar::Duration(30s) : until_retry(); }
  // How long until the next try of an actor out of reach (zero when it is due).
  laminar::Duration until_retry() const {
    const auto left = std::chrono::duration_cast<laminar::Duration>(retry_at_ - std::chrono::steady_clock::now());
    return std::max(left, laminar::Duration(0));
  }

  // The actor out of reach: its host cut off, or it restarting. The worker decodes what it holds,
  // keeps what it finishes, and tries again at doubling intervals up to 2 s; after
  // kRendezvousTimeout without an answer it gives up.
  static bool transient(const Status& st) {
    return st.code() == laminar::StatusCode::kUnavailable || st.code() == laminar::StatusCode::kDeadlineExceeded;
  }
  Status out_of_reach(const Status& why) {
    const auto now = std::chrono::steady_clock::now();
    if (reachable_) {
      reachable_ = false;
      unreachable_since_ = now;
      backoff_ = 100ms;
      std::printf("%s: the actor is out of reach (%s); trying again\n", who_.c_str(), why.to_string().c_str());
      std::fflush(stdout);
    } else {
      backoff_ = std::min<std::chrono::milliseconds>(backoff_ * 2, 2s);
    }
    if (now - unreachable_since_ > kRendezvousTimeout) return why;
    retry_at_ = now + backoff_;
    return laminar::ok_status();
  }
  void in_reach() {
    if (reachable_) return;
    reachable_ = true;
    ++reconnects_;
    const double away_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - unreachable_since_).count();
    std::printf("%s: the actor is back after %.1f s; %llu samples finished meanwhile\n", who_.c_str(), away_s,
                static_cast<unsigned long long>(std::exchange(finished_away_, 0)));
    std::fflush(stdout);
  }
  bool may_try() const { return reachable_ || std::chrono::steady_clock::now() >= retry_at_; }

  // Pushes what is finished, in order; a producer whose server vanished is made again first. The
  // queue refuses a copy it holds already (a sample handed out again after this worker looked lost).
  Status push_unpushed() {
    while (!unpushed_.empty() && may_try()) {
      if (!producer_) {
        laminar::RemoteProducerOptions po;
        po.connect_timeout = 2s;  // the loop decodes what it holds between tries
        auto producer = laminar::RemoteProducer::create(transport_, a_.actor, po);
        if (!producer.ok()) {
          if (!transient(producer.status())) return producer.status();
          return out_of_reach(producer.status());
        }
        producer_ = std::move(*producer);
      }
      laminar::Trajectory& t = unpushed_.front();
      const std::uint64_t id = t.id.value();
      Status st = producer_->push(std::move(t));
      if (transient(st)) {
        producer_.reset();  // closed: every later push of it fails
        return out_of_reach(st);
      }
      if (st.code() == laminar::StatusCode::kAlreadyExists) {
        ++refused_;
      } else if (!st.ok()) {
        return st;
      }
      in_reach();
      unpushed_.pop_front();
      if (moved_.contains(id)) moved_log_->write(fmt::format("push {}", id));
      ++pushed_;
    }
    return laminar::ok_status();
  }

  // Whether a decode step has anything to do (or to push).
  bool steppable() const {
    return std::any_of(live_.begin(), live_.end(), [&](const Live& l) { return !l.paused && (!ended(l) || !moving(l.seq.sequence)); });
  }

  // Nothing live and nothing moving: the only time weights may change, except under the areal
  // schedule's interruptions.
  bool idle() const { return live_.empty() && (!migrator_ || migrator_->moving().empty()); }

  bool interruptible() const { return a_.run_schedule == "areal"; }

  // Takes version v with sequences live (no migration runs under areal): each one's KV is computed
  // again under v, every token but the last, which the next decode step feeds to sample under v.
  // Their earlier tokens keep the log-probs they were sampled with.
  Status interrupt(laminar::Version newest) {
    // No live KV survives below, so none was computed under weights the pull replaces.
    LAMINAR_RETURN_IF_ERROR(pull(newest));
    const laminar::Version v(current());  // newest, or one newer that replaced it meanwhile
    const std::int64_t t0 = now_ns();
    std::vector<laminar::SequenceState*> batch;
    std::int64_t tokens = 0;
    for (Live& l : live_) {
      LAMINAR_RETURN_IF_ERROR(cache_->release(l.seq.sequence));
      l.seq.kv_length = 0;
      LAMINAR_RETURN_IF_ERROR(cache_->add_sequence(l.seq.sequence));
      l.versions.emplace_back(v.value(), l.seq.response_tokens.size());
      batch.push_back(&l.seq);
      tokens += std::int64_t(l.seq.prompt_tokens.size() + l.seq.response_tokens.size()) - 1;
    }
    // Token by token: the engine's bits are the same as in one pass, and this is the re-prefill of
    // the live sequences that pacing charges as one prefill of all their tokens.
    for (;;) {
      std::vector<laminar::SequenceState*> behind;
      for (laminar::SequenceState* seq : batch)
        if (seq->kv_length + 1 < seq->prompt_tokens.size() + seq->response_tokens.size())
          behind.push_back(seq);
      if (behind.empty()) break;
      LAMINAR_RETURN_IF_ERROR(engine_->step(*cache_, behind));
    }
    pace(t0, pacing_->prefill(tokens));
    return writer_->write(async_grpo::Span{.process = who_, .kind = async_grpo::SpanKind::kPrefill, .start_ns = t0,
                                           .end_ns = now_ns(), .version = v.value(), .sequences = batch.size(),
                                           .tokens = std::uint64_t(tokens)});
  }

  laminar::WorkerSnapshot snapshot() {
    laminar::WorkerSnapshot w;
    w.id = laminar::WorkerId(std::uint32_t(a_.index));
    w.version = migrator_->version();
    w.pages_total = pages_;
    w.pages_used = cache_->used_pages();
    w.slots_total = s_.max_live;
    // Slots a question out may still fill count as free: a migration into them makes the loop
    // ask again for fewer (and start() takes no more than fits).
    w.slots_used = std::int32_t(live_.size());
    w.step_time = live_.empty() ? laminar::Duration(0) : step_time_;
    // Taking no new samples (it waits for newer weights) or past its peak: its KV only shrinks now.
    w.kv_stopped_growing = w.pages_used < peak_pages_ || !taking_;
    for (const Live& l : live_) {
      auto pages = cache_->pages(l.seq.sequence);
      // The answer's length is the prompt's digit count plus EOS: the task's own length predictor.
      // A response already past it runs on to EOS or its token limit, which it does not tell: the
      // policy's own estimate then.
      const std::int64_t expected = std::int64_t(l.prompt.answer.size()) - std::int64_t(l.seq.response_tokens.size());
      w.sequences.push_back({l.seq.sequence, std::int64_t(l.seq.kv_length), pages.ok() ? std::int64_t(pages->size()) : 0,
                             expected > 0 ? std::optional<std::int64_t>(expected) : std::nullopt});
    }
    return w;
  }

  Status handle(laminar::MigrationEvent& e) { return migration_host_->handle(e); }

  // What the migrator's events do to this worker's batch (MigrationHost calls these).
  laminar::MigrationHandlers migration_handlers() {
    auto find = [this](laminar::SequenceId id) {
      return std::find_if(live_.begin(), live_.end(), [&](const Live& l) { return l.seq.sequence == id; });
    };
    laminar::MigrationHandlers h;
    h.pause = [this, find](const laminar::MigrationEvent& e) -> Result<std::vector<laminar::SequenceState>> {
      std::vector<laminar::SequenceState> states;
      for (laminar::SequenceId id : e.sequences) {
        auto it = find(id);
        if (it == live_.end()) return laminar::internal_error(fmt::format("pause of sequence {}, not live", id.value()));
        it->paused = true;
        states.push_back(it->seq);
      }
      paused_at_[e.id] = now_ns();
      return states;
    };
    h.forget = [this, find](const laminar::MigrationEvent& e) -> Status {
      const std::int64_t end = now_ns();
      const std::int64_t start = paused_at_.contains(e.id) ? paused_at_[e.id] : end;
      paused_at_.erase(e.id);
      std::uint64_t pages = 0;
      for (laminar::SequenceId id : e.sequences) {
        auto it = find(id);
        if (it == live_.end()) continue;
        pages += (it->seq.kv_length + Settings::kPageSize - 1) / Settings::kPageSize;
        moved_log_->write(fmt::format("out {}", it->seq.trajectory.value()));
        moved_.insert(it->seq.trajectory.value());
        live_.erase(it);  // the migrator released it from the cache
      }
      const std::uint64_t bytes = pages * std::uint64_t(engine_->config().num_layers) * 2 *
                                  std::uint64_t(engine_->config().num_kv_heads) * std::uint64_t(engine_->config().head_dim) *
                                  Settings::kPageSize * sizeof(float);
      LAMINAR_RETURN_IF_ERROR(writer_->write(async_grpo::Span{.process = who_,
                                                              .kind = async_grpo::SpanKind::kMigrateOut,
                                                              .start_ns = start, .end_ns = end, .version = current(),
                                                              .sequences = e.sequences.size(), .bytes = bytes}));
      return writer_->write(async_grpo::RepackEvent{.time_ns = end, .moved_sequences = e.sequences.size(),
                                                    .bytes = bytes});
    };
    h.resume = [this, find](const laminar::MigrationEvent& e) -> Status {
      paused_at_.erase(e.id);
      for (laminar::SequenceId id : e.sequences)
        if (auto it = find(id); it != live_.end()) it->paused = false;
      return laminar::ok_status();
    };
    h.adopt = [this](laminar::MigrationEvent& e) -> Status {
      const std::int64_t t = now_ns();
      for (laminar::SequenceState& st : e.states) {
        moved_log_->write(fmt::format("in {}", st.trajectory.value()));
        moved_.insert(st.trajectory.value());
        Live l;
        l.versions = {{st.version.value(), 0}};
        l.prompt = task_->prompt(st.prompt_id.value());
        l.max_tokens = task_->max_response_tokens(l.prompt);
        l.start_ns = t;
        l.seq = std::move(st);
        live_.push_back(std::move(l));
      }
      return writer_->write(async_grpo::Span{.process = who_, .kind = async_grpo::SpanKind::kMigrateIn,
                                             .start_ns = t, .end_ns = now_ns(), .version = current(),
                                             .sequences = e.states.size()});
    };
    return h;
  }

  Status pull(laminar::Version v) {
    const std::int64_t seen = now_ns();
    Status pulled = puller_->pull(v, destinations_, /*has_live_trajectory=*/false);
    // A newer version may have replaced `v` in the store since it was seen: take that one.
    for (std::optional<laminar::Version> newest = puller_->newest_version();
         pulled.code() == laminar::StatusCode::kNotFound && newest && *newest > v; newest = puller_->newest_version()) {
      v = *newest;
      pulled = puller_->pull(v, destinations_, /*has_live_trajectory=*/false);
    }
    LAMINAR_RETURN_IF_ERROR(pulled);
    LAMINAR_RETURN_IF_ERROR(engine_->check_weights());
    if (migrator_) migrator_->set_version(v);
    const std::int64_t end = now_ns();
    ++pulls_;
    hashes_->write(fmt::format("{} {:016x}", v.value(), weight_hash(engine_->weight_bytes())));
    LAMINAR_RETURN_IF_ERROR(writer_->write(async_grpo::Span{.process = who_, .kind = async_grpo::SpanKind::kPull,
                                                            .start_ns = seen, .end_ns = end, .version = v.value(),
                                                            .bytes = engine_->weight_bytes().size()}));
    return writer_->write(async_grpo::WeightSync{.process = who_, .version = v.value(), .start_ns = seen,
                                                 .end_ns = end});
  }

  void drop(laminar::TrajectoryId id) {
    auto it = std::find_if(live_.begin(), live_.end(), [&](const Live& l) { return l.seq.trajectory == id; });
    if (it == live_.end() || it->paused || moving(it->seq.sequence)) return;  // the migration's until it ends
    (void)cache_->release(it->seq.sequence);
    live_.erase(it);
  }

  // Starts what fits; a sample that does not (a migration came in meanwhile) is left off the next
  // question's held list, so the dispatcher hands it out again after one lease.
  Status start(std::vector<laminar::Sample> samples) {
    const std::size_t first = live_.size();
    const std::size_t fits = live_.size() < std::size_t(s_.max_live) ? std::size_t(s_.max_live) - live_.size() : 0;
    // More than fits (a replaced question's answer and the new one both brought work, or a
    // migration took slots asked for): the rest goes back with the next question.
    for (std::size_t i = fits; i < samples.size(); ++i) returned_.push_back(samples[i].id);
    if (samples.size() > fits) samples.resize(fits);
    if (samples.empty()) return laminar::ok_status();
    peak_pages_ = 0;  // new samples: the KV grows again
    for (const laminar::Sample& x : samples) {
      Live l;
      l.prompt = task_->prompt(x.prompt_index);
      l.max_tokens = task_->max_response_tokens(l.prompt);
      l.start_ns = now_ns();
      l.seq.sequence = laminar::SequenceId(x.id.value());
      l.seq.trajectory = x.id;
      l.seq.prompt_id = laminar::PromptId(x.prompt_index);
      l.seq.group_id = laminar::GroupId(x.prompt_index);
      l.seq.group_size = std::uint32_t(s_.group_size);
      l.seq.sample_index = x.sample_index;
      l.seq.version = laminar::Version(current());
      l.seq.seed = x.seed;
      l.seq.prompt_tokens = l.prompt.tokens;
      l.versions = {{current(), 0}};
      live_.push_back(std::move(l));
    }
    std::vector<laminar::SequenceState*> batch;
    std::uint64_t tokens = 0;
    for (std::size_t i = first; i < live_.size(); ++i) {
      batch.push_back(&live_[i].seq);
      tokens += live_[i].seq.prompt_tokens.size();
    }
    const std::int64_t t0 = now_ns();
    if (Status st = engine_->prefill(*cache_, batch); !st.ok()) {
      live_.resize(first);
      return st;
    }
    pace(t0, pacing_->prefill(std::int64_t(tokens)));
    // The launcher's kill test waits for this line, so the worker dies holding samples.
    if (s_.kill_rollout_at > 0 && a_.index == 0) {
      std::printf("granted %zu\n", batch.size());
      std::fflush(stdout);
    }
    LAMINAR_RETURN_IF_ERROR(writer_->write(async_grpo::Span{.process = who_, .kind = async_grpo::SpanKind::kPrefill,
                                                            .start_ns = t0, .end_ns = now_ns(), .version = current(),
                                                            .sequences = batch.size(), .tokens = tokens}));
    return finish_done();
  }

  // At EOS or its token limit: pushed by finish_done, or held while a migration moves it.
  static bool ended(const Live& l) {
    return (!l.seq.response_tokens.empty() && l.seq.response_tokens.back() == async_grpo::kEos) ||
           std::int32_t(l.seq.response_tokens.size()) >= l.max_tokens;
  }

  bool moving(laminar::SequenceId id) const {
    if (!migrator_) return false;
    const std::vector<laminar::SequenceId> m = migrator_->moving();
    return std::find(m.begin(), m.end(), id) != m.end();
  }

  Status step() {
    std::vector<laminar::SequenceState*> batch;
    for (Live& l : live_)
      if (!l.paused && !ended(l)) batch.push_back(&l.seq);
    // What ended while it was moving, and was then handed back or arrived here.
    if (batch.empty()) return finish_done();
    if (decode_start_ == 0) decode_start_ = now_ns();
    std::int64_t kv_tokens = 0;
    for (const laminar::SequenceState* seq : batch) kv_tokens += seq->kv_length + 1;
    const std::int64_t t0 = now_ns();
    LAMINAR_RETURN_IF_ERROR(engine_->step(*cache_, batch));
    pace(t0, pacing_->decode(std::int64_t(batch.size()), kv_tokens));
    step_time_ = std::chrono::nanoseconds(now_ns() - t0);
    peak_pages_ = std::max(peak_pages_, std::int64_t(cache_->used_pages()));
    decode_tokens_ += batch.size();
    decode_max_seqs_ = std::max<std::uint64_t>(decode_max_seqs_, batch.size());
    if (now_ns() - decode_start_ > 50'000'000) flush_decode();  // one span per 50 ms of decoding
    return finish_done();
  }

  // A step that began at t0 lasts what the pacing says it would on the accelerator it stands for.
  static void pace(std::int64_t t0, std::chrono::nanoseconds step) {
    const std::int64_t left = t0 + step.count() - now_ns();
    if (left > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(left));
  }

  void flush_decode() {
    if (decode_start_ == 0) return;
    (void)writer_->write(async_grpo::Span{.process = who_, .kind = async_grpo::SpanKind::kDecode,
                                          .start_ns = decode_start_, .end_ns = now_ns(), .version = current(),
                                          .sequences = decode_max_seqs_, .tokens = decode_tokens_});
    decode_start_ = 0;
    decode_tokens_ = decode_max_seqs_ = 0;
  }

  // Pushes every live sequence that ended (EOS or its token limit), rewarded by the verifier. One
  // a migration moves stays until the migration ends: its destination pushes it, or it comes back.
  Status finish_done() {
    std::vector<laminar::SequenceId> in_flight;
    if (migrator_) in_flight = migrator_->moving();
    for (std::size_t i = 0; i < live_.size();) {
      Live& l = live_[i];
      if (l.paused || !ended(l) ||
          std::find(in_flight.begin(), in_flight.end(), l.seq.sequence) != in_flight.end()) {
        ++i;
        continue;
      }
      const bool eos = !l.seq.response_tokens.empty() && l.seq.response_tokens.back() == async_grpo::kEos;
      const bool mixed = l.versions.size() > 1;
      if (!mixed && l.seq.version.value() != current())
        return laminar::internal_error(fmt::format("{}: trajectory {} mixes versions {} and {}", who_,
                                                   l.seq.trajectory.value(), l.seq.version.value(), current()));
      laminar::Trajectory t;
      t.id = l.seq.trajectory;
      t.prompt_id = l.seq.prompt_id;
      t.group_id = l.seq.group_id;
      t.group_size = l.seq.group_size;
      t.sample_index = l.seq.sample_index;
      t.version = l.seq.version;
      t.prompt_tokens = l.seq.prompt_tokens;
      t.response_tokens = l.seq.response_tokens;
      t.logprobs = l.seq.logprobs;
      t.rewards = {task_->reward(l.prompt, t.response_tokens)};
      t.finish_reason = eos ? laminar::FinishReason::kStop : laminar::FinishReason::kLength;
      t.timings = {.generation_start_ns = l.start_ns, .generation_end_ns = now_ns()};
      // Interrupted: tagged with every version and where its tokens start; t.version is the first.
      if (mixed) t.metadata = mixed_versions_json(l.versions);
      LAMINAR_RETURN_IF_ERROR(cache_->release(l.seq.sequence));
      live_.erase(live_.begin() + std::ptrdiff_t(i));
      unpushed_.push_back(std::move(t));
      if (!reachable_) ++finished_away_;
      LAMINAR_RETURN_IF_ERROR(push_unpushed());
    }
    return laminar::ok_status();
  }

  const Settings& s_;
  const RoleArgs& a_;
  std::string who_;
  std::optional<async_grpo::DigitTask> task_;
  std::optional<Pacing> pacing_;
  std::optional<async_grpo::Engine> engine_;
  std::vector<laminar::NamedTensor> destinations_;
  std::optional<async_grpo::RecordWriter> writer_;
  std::optional<LineFile> hashes_;
  // Trajectories a migration moved out of or into this worker: each one's out, in and push lines.
  std::optional<LineFile> moved_log_;
  std::unordered_set<std::uint64_t> moved_;
  std::shared_ptr<laminar::Transport> transport_;
  std::shared_ptr<laminar::PagedKvCache> cache_;
  std::shared_ptr<laminar::KvMigrator> migrator_;
  std::unique_ptr<laminar::RepackDriver> driver_;
  std::unique_ptr<laminar::MigrationHost> migration_host_;
  std::map<laminar::MigrationId, std::int64_t> paused_at_;
  std::int32_t pages_ = 0;
  std::int64_t peak_pages_ = 0;
  laminar::Duration step_time_{0};
  bool taking_ = false;
  std::shared_ptr<laminar::RelayStore> store_;
  std::unique_ptr<laminar::RelayNode> node_;
  std::unique_ptr<laminar::WeightPuller> puller_;
  std::unique_ptr<laminar::DispatchClient> client_;
  std::vector<laminar::TrajectoryId> returned_;  // granted, not started: for the next question
  std::mutex wake_mu_;
  std::condition_variable wake_cv_;
  bool woken_ = false;
  std::unique_ptr<laminar::RemoteProducer> producer_;
  std::vector<Live> live_;
  std::int64_t decode_start_ = 0;
  std::uint64_t decode_tokens_ = 0, decode_max_seqs_ = 0;
  std::uint64_t pushed_ = 0, pulls_ = 0;
  std::uint64_t refused_ = 0;  // pushes the queue refused: it already held the sample
  std::deque<laminar::Trajectory> unpushed_;  // finished, not in the queue yet
  bool reachable_ = true;
  std::chrono::steady_clock::time_point unreachable_since_{}, retry_at_{};
  std::chrono::milliseconds backoff_{100};
  std::uint64_t reconnects_ = 0;  // times the actor was back in reach
  std::uint64_t finished_away_ = 0;  // samples finished since the actor went out of reach
};

}  // namespace

int run_rollout(const Settings& s, const RoleArgs& args) {
  RoleArgs a = args;
  const std::string who = fmt::format("rollout-{}", a.index);
  if (Status st = find_peers(s, a, kRendezvousTimeout); !st.ok()) return fail(who, "rendezvous", st);
  const int code = Rollout(s, a).run();
  // Failed or done, it has left: the actor waits for every worker's mark before it goes.
  if (Status st = mark_left(a.dir, who); !st.ok()) return fail(who, "leaving", st);
  return code;
}

}  // namespace async_grpo
