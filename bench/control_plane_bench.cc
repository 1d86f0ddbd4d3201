// control_plane_bench: whether laminar's control plane leaves a machine quiet. One actor process
// and --workers rollout worker processes (this binary re-executed), wired as
// examples/async_grpo wires them, with no model:
//   actor:   a listening Transport; a RolloutDispatcher; a TrajectoryQueue behind a
//            TrajectoryQueueServer; a RelayStore + RelayNode, the head of the weight chain; a
//            RepackCoordinator (the example's settings: a plan every 2 ms, reports stale after 3 s,
//            the paper's best-fit rule). Its main thread is the trainer: it pops batches of
//            --batch-groups groups, calls completed() for each sample, "trains" --train-ms, acks and
//            publishes the next version (--weight-mib MiB) to the queue, relay, dispatcher and
//            coordinator.
//   worker:  its own Transport (listening, for migrations), DispatchClient, RemoteProducer,
//            RelayStore + RelayNode (subscribed to the actor) + WeightPuller, a KvMigrator on a
//            cache from KvMigrator::allocate_cache and a RepackDriver (report every 1 ms, the
//            example's). It runs Rollout::loop of examples/async_grpo/rollout.cc: one question out
//            at the dispatcher while it has free slots, with a wait (4 s), sleeping on
//            DispatchClientOptions::on_answer; the newest version pulled when idle; RepackDriver::step
//            with a snapshot between steps. A sample "decodes" one token per --step-ms step (the
//            KV cache grows a token a step, so migrations move real pages); its length is drawn
//            log-normal from its sampling seed (median --median-tokens, p99 10x the median, capped
//            at --max-tokens), so a migrated sample keeps its length.
//   floor:   a process with a listening Transport and one connection to the actor, nothing else:
//            what any process of laminar pays.
//
// Phases. Idle (--idle-s): everything connected, version 1 pulled, and nothing to do (the sync
// rule with no group opened), the floor process beside them. Load (--load-s): the stream rule
// (staleness --max-staleness, --in-flight samples out), groups of 8, the trainer popping and
// publishing; then the rule goes back to sync and what is out drains. Then the baseline: new worker
// processes in the polling shape the example had before the dispatcher answered on events (each
// loop asks with wait 0, every decode step and every 2 ms while idle) run the same load again.
//
// Wake-ups: the sum over a process's threads (/proc/PID/task/*/status) of voluntary and
// nonvoluntary context switches, at each phase's start and end (the actor reads its children's by
// pid); a thread that exits mid-phase loses its count. Every process names its threads after the
// component whose create() started them (tid sets before and after, written to
// /proc/self/task/TID/comm), so the per-thread table shows which part wakes; threads that start
// later (the head relay's sender per subscriber, UCX's own) are named at the next point the
// process knows what they are, or "late".
//
// Control messages (counted from stats, actor side, per generated sample in the load phase): the
// dispatcher's requests (RolloutDispatcherStats::requests + refused: one request and its answer
// each), the repack reports the coordinator received (RepackCoordinatorStats::reports +
// keepalives + reports_refused) and the orders it sent (orders_sent + orders_failed). Not control: the pushes
// (one message per sample: the sample itself; printed), weight chunks, KV migration traffic (its
// offer, stages and answers move pages; migrations are printed). Control without a counter, left
// out of the number and estimated in the breakdown: the relay's idle messages (one per subscriber
// every stall_timeout / 4 while it waits for a version) and a RemoteProducer's pings (only while a
// push waits stall_timeout / 2 for its answer: none here).
//
// Baselines, measured in the same run: for wake-ups the floor process (a Transport and nothing
// else); for control messages per sample the polling workers of the same bench on the same load,
// so the ratio shows what answering on events saves. Ratios are baseline / value (lower is better
// for both), as for times.
//
//   control_plane_bench [--idle-s 10] [--load-s 10] [--workers 3] [--quick] ...
//
// Prints '#' lines (per process and per thread, wake-ups per sample under load, the control
// messages' breakdown, each worker's own counts) and JSON lines: idle_wakeups_per_s per process
// (informational), control_messages_per_sample, and last, the headline, idle_wakeups_per_s of the
// process that woke most.
#include <dirent.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cli.h"
#include "harness.h"
#include "laminar/kv_cache.h"
#include "laminar/kv_migrator.h"
#include "laminar/relay_node.h"
#include "laminar/relay_store.h"
#include "laminar/remote_trajectory_queue.h"
#include "laminar/repack_coordinator.h"
#include "laminar/repack_driver.h"
#include "laminar/rollout_dispatcher.h"
#include "laminar/trajectory_queue.h"
#include "laminar/weight_manifest.h"
#include "laminar/weight_puller.h"
#include "process.h"

using namespace std::chrono_literals;
using laminar::Result;
using laminar::Status;

namespace {

const char* const kToken = "control-plane-bench-token-0123456789";
constexpr std::uint32_t kGroup = 8;
constexpr std::int32_t kPageSize = 16;
constexpr std::size_t kPromptTokens = 8;
// How long a worker's question may wait at the dispatcher (examples/async_grpo/rollout.cc).
constexpr laminar::Duration kAskWait = 4s;
// The relay's default stall_timeout: its idle messages go every quarter of it.
constexpr double kRelayStallS = 10;

struct Config {
  double idle_s = 10;
  double load_s = 10;
  int workers = 3;
  double step_ms = 20;
  int max_live = 16;
  double median_tokens = 16;
  int max_tokens = 256;
  std::uint64_t in_flight = 64;
  std::uint64_t max_staleness = 1;
  int batch_groups = 8;
  double train_ms = 100;
  int weight_mib = 4;
  double plan_interval_ms = 2;
  double report_interval_ms = 50;
  std::uint64_t seed = 1;
  bool quick = false;
  bool skip_polling = false;
};

[[noreturn]] void die(const std::string& what, const Status& st = {}) {
  std::fprintf(stderr, "control_plane_bench[%d]: %s%s%s\n", int(::getpid()), what.c_str(), st.ok() ? "" : ": ",
               st.ok() ? "" : st.to_string().c_str());
  std::exit(1);
}

template <class T>
T must(Result<T> r, const char* what) {
  if (!r.ok()) die(what, r.status());
  return std::move(r).value();
}

void must(const Status& s, const char* what) {
  if (!s.ok()) die(what, s);
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::shared_ptr<laminar::Transport> make_transport() {
  laminar::TransportOptions o;
  o.cluster_token = kToken;
  o.max_inbox_bytes = 0;  // only handlers and replies, as the example's processes
  return must(laminar::Transport::create(o), "transport");
}

// ---------------------------------------------------------------------------------------------
// Threads and their context switches.

std::vector<pid_t> task_ids(pid_t pid) {
  std::vector<pid_t> out;
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') out.push_back(pid_t(std::atoi(e->d_name)));
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Names the threads that appeared since the last call after what started them. With several
// names, the newest threads take the last names (Transport::create starts UCX's async thread, when
// UCX makes one, then its progress thread, then its callback thread).
class ThreadNamer {
 public:
  // The first call names every thread there is (the main thread, when called first thing).
  // Returns the threads it named.
  std::vector<pid_t> name(std::vector<std::string> names) {
    std::vector<pid_t> fresh;
    for (pid_t t : task_ids(::getpid()))
      if (seen_.insert(t).second) fresh.push_back(t);
    for (std::size_t i = 0; i < fresh.size(); ++i) {
      const std::size_t from_end = fresh.size() - 1 - i;
      const std::string& n = from_end < names.size() ? names[names.size() - 1 - from_end] : names.front();
      rename(fresh[i], n);
    }
    return fresh;
  }
  std::vector<pid_t> name(const std::string& what) { return name(std::vector<std::string>{what}); }
  static void rename(pid_t tid, const std::string& name) {
    std::ofstream f("/proc/self/task/" + std::to_string(tid) + "/comm");
    f << name.substr(0, 15);
  }

 private:
  std::set<pid_t> seen_;
};

// Transport::create's threads, oldest first.
const std::vector<std::string> kTransportThreads = {"ucx-async", "xport-progress", "xport-callback"};

struct ThreadCount {
  std::string comm;
  std::uint64_t voluntary = 0;
  std::uint64_t nonvoluntary = 0;
};
using ProcessSample = std::map<pid_t, ThreadCount>;

ProcessSample sample_process(pid_t pid) {
  ProcessSample s;
  for (pid_t t : task_ids(pid)) {
    const std::string base = "/proc/" + std::to_string(pid) + "/task/" + std::to_string(t);
    ThreadCount c;
    std::ifstream comm(base + "/comm");
    std::getline(comm, c.comm);
    std::ifstream status(base + "/status");
    std::string line;
    bool any = false;
    while (std::getline(status, line)) {
      if (line.rfind("voluntary_ctxt_switches:", 0) == 0) {
        c.voluntary = std::stoull(line.substr(line.find(':') + 1));
        any = true;
      } else if (line.rfind("nonvoluntary_ctxt_switches:", 0) == 0) {
        c.nonvoluntary = std::stoull(line.substr(line.find(':') + 1));
      }
    }
    if (any) s[t] = c;  // a thread gone between the listing and the read counts as gone
  }
  return s;
}

struct ThreadDelta {
  pid_t tid = 0;
  std::string comm;
  std::uint64_t voluntary = 0;
  std::uint64_t nonvoluntary = 0;
  std::uint64_t total() const { return voluntary + nonvoluntary; }
};

// Per thread, end minus start (a thread born in the phase counts from zero), most first.
std::vector<ThreadDelta> deltas(const ProcessSample& start, const ProcessSample& end) {
  std::vector<ThreadDelta> out;
  for (const auto& [tid, e] : end) {
    ThreadDelta d{tid, e.comm, e.voluntary, e.nonvoluntary};
    if (auto it = start.find(tid); it != start.end()) {
      d.voluntary -= it->second.voluntary;
      d.nonvoluntary -= it->second.nonvoluntary;
    }
    out.push_back(d);
  }
  std::sort(out.begin(), out.end(), [](const ThreadDelta& a, const ThreadDelta& b) { return a.total() > b.total(); });
  return out;
}

std::uint64_t total(const std::vector<ThreadDelta>& ds) {
  std::uint64_t n = 0;
  for (const ThreadDelta& d : ds) n += d.total();
  return n;
}

double load_average() {
  std::ifstream f("/proc/loadavg");
  double a = 0;
  f >> a;
  return a;
}

// ---------------------------------------------------------------------------------------------
// Weights: --weight-mib MiB in 8 f32 tensors, the same manifest on every process.

struct Weights {
  laminar::WeightManifest manifest;
  std::vector<std::vector<float>> data;
  std::vector<laminar::NamedTensor> named;
  std::vector<std::string> names;

  explicit Weights(int mib) {
    const std::int64_t rows = std::int64_t(mib) * (1 << 20) / 8 / 4 / 1024;
    for (int i = 0; i < 8; ++i) {
      names.push_back("layer" + std::to_string(i) + ".w");
      must(manifest.add(names.back(), laminar::DType::kF32, {rows, 1024}), "manifest");
    }
    for (const auto& e : manifest.entries()) data.emplace_back(std::size_t(e.nbytes / 4));
    for (std::size_t i = 0; i < data.size(); ++i) {
      const auto& e = manifest.entries()[i];
      named.push_back({e.name, must(laminar::TensorView::contiguous(data[i].data(), e.dtype, e.shape), "view")});
    }
  }
};

// ---------------------------------------------------------------------------------------------
// A rollout worker.

// A sample's response length, from its sampling seed alone: log-normal with p99 = 10 x median.
std::int32_t response_length(std::uint64_t seed, const Config& c) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> d(std::log(c.median_tokens), std::log(10.0) / 2.326);
  return std::int32_t(std::clamp(d(rng), 1.0, double(c.max_tokens)));
}

struct Live {
  bool paused = false;  // a migration out of this worker holds it
  laminar::SequenceState seq;
  std::int32_t length = 0;
  std::int64_t start_ns = 0;
};

class Worker {
 public:
  Worker(const Config& c, std::string actor, int index, bool polling)
      : c_(c), actor_(std::move(actor)), id_(std::uint32_t(index)), polling_(polling), weights_(c.weight_mib) {}

  int run() {
    // Every thread started from here on inherits the blocked SIGTERM; one of them waits for it.
    sigset_t term;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &term, nullptr);
    ThreadNamer namer;
    namer.name("main");
    transport_ = make_transport();
    namer.name(kTransportThreads);
    (void)must(transport_->listen("127.0.0.1", 0), "listen");  // migrations arrive at this address
    namer.name("transport");
    pages_ = c_.max_live * (std::int32_t(kPromptTokens) + c_.max_tokens + kPageSize) / kPageSize + 8;
    laminar::KvLayout layout{.num_pages = pages_, .page_size = kPageSize, .num_kv_heads = 1, .head_dim = 64,
                             .dtype = laminar::DType::kF32, .num_layers = 2};
    auto pools = must(laminar::KvMigrator::allocate_cache(*transport_, layout), "cache");
    cache_ = pools.cache;
    laminar::KvMigratorOptions mo;
    mo.k_pool_region = pools.k_pool;
    mo.v_pool_region = pools.v_pool;
    mo.max_sequences = std::uint32_t(c_.max_live);
    migrator_ = must(laminar::KvMigrator::create(transport_, cache_, mo), "migrator");
    namer.name("kv-migrator");
    laminar::RepackDriverOptions dopt;
    dopt.worker = id_;
    dopt.coordinator = actor_;
    dopt.min_report_interval = std::chrono::duration_cast<laminar::Duration>(
        std::chrono::duration<double, std::milli>(c_.report_interval_ms));
    dopt.keepalive_interval = 1s;  // the example's: a third of the coordinator's stale_after
    driver_ = must(laminar::RepackDriver::create(transport_, migrator_, dopt), "repack driver");
    driver_->set_notify([this] { wake(); });
    namer.name("driver-report");
    store_ = must(laminar::RelayStore::create(), "relay store");
    namer.name("store-sealer");
    laminar::RelayNodeOptions ro;
    ro.upstreams = {actor_};
    node_ = must(laminar::RelayNode::create(transport_, store_, ro), "relay node");
    namer.name("relay-subscr");
    puller_ = must(laminar::WeightPuller::create(store_), "puller");
    namer.name("puller");
    client_ = must(laminar::DispatchClient::create(transport_, {.worker = id_, .server = actor_,
                                                                .on_answer = [this] { wake(); }}),
                   "dispatch client");
    namer.name("dispatch-cli");
    producer_ = must(laminar::RemoteProducer::create(transport_, actor_), "producer");
    namer.name("producer");
    std::thread stopper([&] {
      int sig = 0;
      sigwait(&term, &sig);
      stop_ = true;
      wake();
    });
    namer.name("sigwait");
    // The first version, before any work: the actor published it before starting the workers.
    must(store_->wait_for_version(laminar::Version(1), 30s), "first version");
    must(pull(store_->newest_version().value()), "first pull");
    namer.name("late");
    std::printf("ready\n");
    std::fflush(stdout);

    const Status st = polling_ ? poll_loop() : loop();
    if (!st.ok()) die("worker loop", st);
    namer.name("late");
    const laminar::RepackDriverStats ds = driver_->stats();
    const laminar::KvMigratorStats ms = migrator_->stats();
    std::printf("stats {\"pushed\": %llu, \"asked\": %llu, \"pulls\": %llu, \"reports_sent\": %llu, "
                "\"orders\": %llu, \"migrations_out\": %llu, \"done_out\": %llu, \"migrations_in\": %llu}\n",
                (unsigned long long)pushed_, (unsigned long long)asked_, (unsigned long long)pulls_,
                (unsigned long long)ds.reports_sent, (unsigned long long)ds.orders,
                (unsigned long long)ms.migrations_out, (unsigned long long)ms.done_out,
                (unsigned long long)ms.migrations_in);
    std::fflush(stdout);
    stopper.join();
    return 0;
  }

 private:
  std::uint64_t current() const { return puller_->current_version() ? puller_->current_version()->value() : 0; }
  bool idle() const { return live_.empty() && migrator_->moving().empty(); }

  Status drive() {
    Result<std::vector<laminar::MigrationEvent>> events = driver_->step(snapshot());
    if (!events.ok()) return events.status();
    for (laminar::MigrationEvent& e : *events) LAMINAR_RETURN_IF_ERROR(handle(e));
    return laminar::ok_status();
  }

  // examples/async_grpo/rollout.cc's Rollout::loop, with the bench's decode step.
  Status loop() {
    laminar::Version want{0};
    laminar::DispatchAsker asker = must(laminar::DispatchAsker::create(client_.get(), {.wait = kAskWait}), "dispatch asker");
    while (!stop_) {
      LAMINAR_RETURN_IF_ERROR(drive());
      Result<std::vector<laminar::Grant>> grants = asker.answers();
      if (!grants.ok()) return stop_ ? laminar::ok_status() : grants.status();
      for (const laminar::Grant& grant : *grants) LAMINAR_RETURN_IF_ERROR(take_grant(grant, want));
      if (idle() && !asker.asking()) {
        const std::optional<laminar::Version> newest = puller_->newest_version();
        if (newest && newest->value() > current() && *newest >= want) {
          LAMINAR_RETURN_IF_ERROR(pull(*newest));
          want = laminar::Version(0);
        }
      }
      taking_ = want.value() == 0 && current() > 0;
      asker.give_back(std::exchange(returned_, {}));
      if (asker.ask({.version = laminar::Version(current()),
                     .taking = taking_,
                     .room = free_slots_now(),
                     .idle = idle(),
                     .held = held()})) {
        ++asked_;
      }
      if (!idle() && steppable()) {
        LAMINAR_RETURN_IF_ERROR(step());
        continue;
      }
      if (idle() && want.value() > 0) {
        (void)store_->wait_for_version(want, 1s);
      } else if (asker.asking() || !idle()) {
        sleep_until_woken();
      }
    }
    return laminar::ok_status();
  }

  // The example's loop before the dispatcher answered on events: a request with wait 0 every
  // iteration, a decode step or a 2 ms sleep between them.
  Status poll_loop() {
    laminar::Version want{0};
    while (!stop_) {
      LAMINAR_RETURN_IF_ERROR(drive());
      if (idle()) {
        const std::optional<laminar::Version> newest = puller_->newest_version();
        if (newest && newest->value() > current() && *newest >= want) {
          LAMINAR_RETURN_IF_ERROR(pull(*newest));
          want = laminar::Version(0);
        }
      }
      const bool take = want.value() == 0 && current() > 0;
      taking_ = take;
      const std::uint32_t free_slots = take ? free_slots_now() : 0;
      ++asked_;
      Result<laminar::Grant> grant = client_->request({.version = laminar::Version(current()),
                                                       .free_slots = free_slots,
                                                       .held = held(),
                                                       .returned = std::exchange(returned_, {})});
      if (!grant.ok()) return stop_ ? laminar::ok_status() : grant.status();
      LAMINAR_RETURN_IF_ERROR(take_grant(*grant, want));
      if (!idle()) {
        LAMINAR_RETURN_IF_ERROR(step());
      } else if (want.value() > 0) {
        (void)store_->wait_for_version(want, 20ms);
      } else {
        std::this_thread::sleep_for(2ms);
      }
    }
    return laminar::ok_status();
  }

  // Sequences that migrated in while a question was out can take this worker past max_live (the
  // migrator bounds its cache, not the host's batch): then it has no free slot, not 2^32 - k.
  std::uint32_t free_slots_now() const { return std::uint32_t(std::max(0, c_.max_live - int(live_.size()))); }

  std::vector<laminar::TrajectoryId> held() const {
    std::vector<laminar::TrajectoryId> h;
    for (const Live& l : live_) h.push_back(l.seq.trajectory);
    return h;
  }

  Status take_grant(const laminar::Grant& g, laminar::Version& want) {
    for (laminar::TrajectoryId id : g.drop) drop(id);
    if (g.kind == laminar::GrantKind::kPullNewer) want = g.pull_version;
    if (g.kind == laminar::GrantKind::kWork) return start(g.samples);
    return laminar::ok_status();
  }

  void wake() {
    {
      std::lock_guard l(wake_mu_);
      woken_ = true;
    }
    wake_cv_.notify_all();
  }

  void sleep_until_woken() {
    const std::shared_ptr<laminar::Clock> clock = laminar::Clock::steady();
    const laminar::Duration until = std::min(laminar::deadline_after(*clock, kAskWait + 10s), driver_->poll_deadline());
    std::unique_lock l(wake_mu_);
    while (!woken_ && clock->now() < until) clock->wait_until(wake_cv_, l, until);
    woken_ = false;
  }

  bool steppable() const {
    return std::any_of(live_.begin(), live_.end(),
                       [&](const Live& l) { return !l.paused && (!ended(l) || !moving(l.seq.sequence)); });
  }

  laminar::WorkerSnapshot snapshot() {
    laminar::WorkerSnapshot w;
    w.id = id_;
    w.version = migrator_->version();
    w.pages_total = pages_;
    w.pages_used = cache_->used_pages();
    w.slots_total = c_.max_live;
    w.slots_used = std::int32_t(live_.size());
    w.step_time = live_.empty() ? laminar::Duration(0) : step_time_;
    w.kv_stopped_growing = w.pages_used < peak_pages_ || !taking_;
    for (const Live& l : live_) {
      auto pages = cache_->pages(l.seq.sequence);
      const std::int64_t expected = std::int64_t(l.length) - std::int64_t(l.seq.response_tokens.size());
      w.sequences.push_back({l.seq.sequence, std::int64_t(l.seq.kv_length), pages.ok() ? std::int64_t(pages->size()) : 0,
                             expected > 0 ? std::optional<std::int64_t>(expected) : std::nullopt});
    }
    return w;
  }

  // As the example's Rollout::handle, without its records.
  Status handle(laminar::MigrationEvent& e) {
    using Kind = laminar::MigrationEvent::Kind;
    auto find = [&](laminar::SequenceId id) {
      return std::find_if(live_.begin(), live_.end(), [&](const Live& l) { return l.seq.sequence == id; });
    };
    switch (e.kind) {
      case Kind::kPauseRequested: {
        std::vector<laminar::SequenceState> states;
        for (laminar::SequenceId id : e.sequences) {
          auto it = find(id);
          if (it == live_.end()) return laminar::internal_error("pause of a sequence not live");
          it->paused = true;
          states.push_back(it->seq);
        }
        const Status st = migrator_->finish(e.id, std::move(states));
        if (!st.ok() && st.code() != laminar::StatusCode::kFailedPrecondition &&
            st.code() != laminar::StatusCode::kResourceExhausted)
          return st;
        return laminar::ok_status();
      }
      case Kind::kDone:
        for (laminar::SequenceId id : e.sequences)
          if (auto it = find(id); it != live_.end()) live_.erase(it);
        return laminar::ok_status();
      case Kind::kAborted:
        if (e.outgoing)
          for (laminar::SequenceId id : e.sequences)
            if (auto it = find(id); it != live_.end()) it->paused = false;
        return laminar::ok_status();
      case Kind::kArrived:
        for (laminar::SequenceState& st : e.states) {
          Live l;
          l.length = response_length(st.seed, c_);
          l.start_ns = now_ns();
          l.seq = std::move(st);
          live_.push_back(std::move(l));
        }
        return laminar::ok_status();
    }
    return laminar::ok_status();
  }

  Status pull(laminar::Version v) {
    LAMINAR_RETURN_IF_ERROR(puller_->pull(v, weights_.named, /*has_live_trajectory=*/false));
    migrator_->set_version(v);
    ++pulls_;
    return laminar::ok_status();
  }

  void drop(laminar::TrajectoryId id) {
    auto it = std::find_if(live_.begin(), live_.end(), [&](const Live& l) { return l.seq.trajectory == id; });
    if (it == live_.end() || it->paused || moving(it->seq.sequence)) return;
    (void)cache_->release(it->seq.sequence);
    live_.erase(it);
  }

  bool moving(laminar::SequenceId id) const {
    const std::vector<laminar::SequenceId> m = migrator_->moving();
    return std::find(m.begin(), m.end(), id) != m.end();
  }

  // Prefill: the prompt's tokens into the cache at once (no pacing: a step of the batch's own).
  Status start(std::vector<laminar::Sample> samples) {
    for (std::size_t i = free_slots_now(); i < samples.size(); ++i) returned_.push_back(samples[i].id);
    if (samples.size() > free_slots_now()) samples.resize(free_slots_now());
    peak_pages_ = 0;
    for (const laminar::Sample& x : samples) {
      Live l;
      l.length = response_length(x.seed, c_);
      l.start_ns = now_ns();
      l.seq.sequence = laminar::SequenceId(x.id.value());
      l.seq.trajectory = x.id;
      l.seq.prompt_id = laminar::PromptId(x.prompt_index);
      l.seq.group_id = laminar::GroupId(x.prompt_index);
      l.seq.group_size = kGroup;
      l.seq.sample_index = x.sample_index;
      l.seq.version = laminar::Version(current());
      l.seq.seed = x.seed;
      l.seq.prompt_tokens.assign(kPromptTokens, std::int32_t(x.prompt_index % 1000));
      LAMINAR_RETURN_IF_ERROR(cache_->add_sequence(l.seq.sequence));
      LAMINAR_RETURN_IF_ERROR(cache_->append_tokens(l.seq.sequence, std::int64_t(kPromptTokens)));
      l.seq.kv_length = kPromptTokens;
      live_.push_back(std::move(l));
    }
    return laminar::ok_status();
  }

  static bool ended(const Live& l) { return std::int32_t(l.seq.response_tokens.size()) >= l.length; }

  // One decode step of every live sequence not paused: a token each, --step-ms long.
  Status step() {
    const std::int64_t t0 = now_ns();
    std::size_t n = 0;
    for (Live& l : live_) {
      if (l.paused || ended(l)) continue;
      LAMINAR_RETURN_IF_ERROR(cache_->append_tokens(l.seq.sequence, 1));
      l.seq.kv_length += 1;
      l.seq.response_tokens.push_back(std::int32_t(l.seq.response_tokens.size() % 100));
      l.seq.logprobs.push_back(-0.5f);
      ++n;
    }
    if (n > 0) {
      const std::int64_t left = t0 + std::int64_t(c_.step_ms * 1e6) - now_ns();
      if (left > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(left));
      step_time_ = std::chrono::nanoseconds(now_ns() - t0);
      peak_pages_ = std::max(peak_pages_, std::int64_t(cache_->used_pages()));
    }
    return finish_done();
  }

  // Pushes every live sequence that ended and is not moving.
  Status finish_done() {
    const std::vector<laminar::SequenceId> in_flight = migrator_->moving();
    for (std::size_t i = 0; i < live_.size();) {
      Live& l = live_[i];
      if (l.paused || !ended(l) || std::find(in_flight.begin(), in_flight.end(), l.seq.sequence) != in_flight.end()) {
        ++i;
        continue;
      }
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
      t.rewards = {0.0f};
      t.finish_reason = laminar::FinishReason::kStop;
      t.timings = {.generation_start_ns = l.start_ns, .generation_end_ns = now_ns()};
      LAMINAR_RETURN_IF_ERROR(cache_->release(l.seq.sequence));
      live_.erase(live_.begin() + std::ptrdiff_t(i));
      Status st = producer_->push(std::move(t));
      if (!st.ok() && st.code() != laminar::StatusCode::kAlreadyExists) return st;
      ++pushed_;
    }
    return laminar::ok_status();
  }

  const Config& c_;
  std::string actor_;
  laminar::WorkerId id_;
  bool polling_;
  Weights weights_;
  std::shared_ptr<laminar::Transport> transport_;
  std::shared_ptr<laminar::PagedKvCache> cache_;
  std::shared_ptr<laminar::KvMigrator> migrator_;
  std::unique_ptr<laminar::RepackDriver> driver_;
  std::shared_ptr<laminar::RelayStore> store_;
  std::unique_ptr<laminar::RelayNode> node_;
  std::unique_ptr<laminar::WeightPuller> puller_;
  std::unique_ptr<laminar::DispatchClient> client_;
  std::unique_ptr<laminar::RemoteProducer> producer_;
  std::int32_t pages_ = 0;
  std::int64_t peak_pages_ = 0;
  laminar::Duration step_time_{0};
  bool taking_ = false;
  std::vector<laminar::TrajectoryId> returned_;  // granted, not started: for the next question
  std::vector<Live> live_;
  std::mutex wake_mu_;
  std::condition_variable wake_cv_;
  bool woken_ = false;
  std::atomic<bool> stop_{false};
  std::uint64_t pushed_ = 0, asked_ = 0, pulls_ = 0;
};

// The floor: a listening Transport with one connection to the actor, until SIGTERM.
int run_floor(const std::string& actor) {
  sigset_t term;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &term, nullptr);
  ThreadNamer namer;
  namer.name("main");
  auto transport = make_transport();
  namer.name(kTransportThreads);
  (void)must(transport->listen("127.0.0.1", 0), "listen");
  [[maybe_unused]] laminar::Endpoint ep = must(transport->connect(actor, 10s), "connect");
  namer.name("transport");
  std::printf("ready\n");
  std::fflush(stdout);
  int sig = 0;
  sigwait(&term, &sig);
  return 0;
}

// ---------------------------------------------------------------------------------------------
// The actor.

struct Counters {
  laminar::RolloutDispatcherStats dispatch;
  laminar::RepackCoordinatorStats repack;
  laminar::TrajectoryQueueServerStats queue;
  laminar::RelayNodeStats relay;
};

struct Proc {
  std::string name;
  pid_t pid = 0;
  std::optional<laminar::testing::ChildProcess> child;  // none for the actor itself
};

struct PhaseResult {
  double seconds = 0;
  std::map<std::string, std::vector<ThreadDelta>> threads;  // per process
  Counters start, end;
  double load_start = 0, load_end = 0;
};

class Actor {
 public:
  Actor(const Config& c) : c_(c), weights_(c.weight_mib) {}

  int run() {
    namer_.name("main");
    transport_ = make_transport();
    namer_.name(kTransportThreads);
    address_ = must(transport_->listen("127.0.0.1", 0), "listen");
    namer_.name("transport");
    laminar::TrajectoryQueueOptions qo;
    qo.group_timeout = laminar::kForever;
    queue_ = must(laminar::TrajectoryQueue::create(qo), "queue");
    namer_.name("queue");
    qserver_ = must(laminar::TrajectoryQueueServer::create(transport_, queue_), "queue server");
    namer_.name("queue-server");
    relay_ = must(laminar::RelayStore::create(), "relay store");
    namer_.name("store-sealer");
    head_ = must(laminar::RelayNode::create(transport_, relay_, {}), "relay node");
    namer_.name("relay-head");
    laminar::RepackCoordinatorOptions co;  // the example's (examples/async_grpo/actor.cc)
    co.tokens_per_page = kPageSize;
    co.min_plan_interval = std::chrono::duration_cast<laminar::Duration>(
        std::chrono::duration<double, std::milli>(c_.plan_interval_ms));
    co.stale_after = 3s;
    co.policy.page_bytes = std::uint64_t(2) * 2 * 64 * kPageSize * 4;
    co.policy.link_bytes_per_s = 1e9;
    co.policy.growth_horizon_steps = c_.max_tokens;
    co.policy.strategy = laminar::RepackStrategy::kPaperBestFit;
    coordinator_ = must(laminar::RepackCoordinator::create(transport_, co), "repack coordinator");
    namer_.name("repack-planner");
    laminar::RolloutDispatcherOptions po;
    po.group_size = kGroup;
    po.seed = c_.seed;
    po.rule = laminar::AdmissionRule::sync();  // nothing opened: nothing to hand out
    po.on_available = [c = coordinator_.get()](std::uint64_t n) {
      (void)c->set_prompts_waiting(std::int64_t(std::min<std::uint64_t>(n, std::uint64_t(1) << 40)));
    };
    dispatcher_ = must(laminar::RolloutDispatcher::create(transport_, po), "dispatcher");
    namer_.name("dispatcher");
    must(publish(), "publish");
    namer_.name("late");

    std::printf("# control_plane_bench: actor + %d workers + floor on %u cores, load average %.2f at start\n",
                c_.workers, std::thread::hardware_concurrency(), load_average());
    std::fflush(stdout);
    floor_ = spawn("floor", {"floor", address_});
    for (int i = 0; i < c_.workers; ++i) workers_.push_back(spawn_worker(i, false));
    std::this_thread::sleep_for(2s);  // connections made, first questions asked and reports sent
    name_senders();

    // Phase 1: idle.
    const double idle_load0 = load_average();
    idle_ = measure_phase([&] { std::this_thread::sleep_for(std::chrono::duration<double>(c_.idle_s)); }, true);
    idle_.load_start = idle_load0;
    idle_.load_end = load_average();
    stop(floor_);

    // Phase 2: load, event-driven workers.
    load_ = measure_phase([&] { run_load(); }, false);
    for (Proc& w : workers_) stop(w);

    // Phase 3: the same load, polling workers.
    if (!c_.skip_polling) {
      std::vector<Proc> pollers;
      for (int i = 0; i < c_.workers; ++i) pollers.push_back(spawn_worker(c_.workers + i, true));
      std::swap(workers_, pollers);
      std::this_thread::sleep_for(1s);
      name_senders();
      polled_ = measure_phase([&] { run_load(); }, false);
      for (Proc& w : workers_) stop(w);
    }
    report();
    return 0;
  }

 private:
  // The head relay starts one sender thread per subscriber (RelayNode::Impl::on_subscribe, as gdb
  // shows); anything else that started meanwhile makes the count differ, and then all are "late".
  void name_senders() {
    const std::vector<pid_t> fresh = namer_.name("relay-sender");
    if (fresh.size() != std::size_t(c_.workers))
      for (pid_t t : fresh) ThreadNamer::rename(t, "late");
  }

  Status publish() {
    const laminar::Version v(++version_);
    for (auto& d : weights_.data) d[0] = float(v.value());
    LAMINAR_RETURN_IF_ERROR(queue_->publish_version(v));
    LAMINAR_RETURN_IF_ERROR(relay_->publish(v, weights_.manifest, weights_.named));
    LAMINAR_RETURN_IF_ERROR(dispatcher_->publish(v));
    return coordinator_->set_newest_version(v);
  }

  Proc spawn(const std::string& name, std::vector<std::string> args) {
    laminar::testing::ChildOptions o;
    o.program = "/proc/self/exe";
    o.args = std::move(args);
    Proc p;
    p.name = name;
    p.child.emplace(must(laminar::testing::ChildProcess::spawn(std::move(o)), "spawn"));
    p.pid = p.child->pid();
    auto line = p.child->read_line(60s);
    if (!line.ok() || *line != "ready") die(name + " did not start", line.ok() ? Status() : line.status());
    return p;
  }

  Proc spawn_worker(int index, bool polling) {
    auto num = [](double x) {
      std::ostringstream s;
      s << x;
      return s.str();
    };
    std::vector<std::string> args = {"--step-ms", num(c_.step_ms), "--max-live", std::to_string(c_.max_live),
                                     "--median-tokens", num(c_.median_tokens), "--max-tokens",
                                     std::to_string(c_.max_tokens), "--weight-mib", std::to_string(c_.weight_mib),
                                     "--report-interval-ms", num(c_.report_interval_ms),
                                     "worker", address_, std::to_string(index)};
    if (polling) args.push_back("--poll");
    return spawn((polling ? "poll-worker-" : "worker-") + std::to_string(index), std::move(args));
  }

  // SIGTERM, its stats line, its exit; SIGKILL (the ChildProcess destructor) if it will not go.
  void stop(Proc& p) {
    if (!p.child) return;
    p.child->kill(SIGTERM);
    for (;;) {
      auto line = p.child->read_line(10s);
      if (!line.ok()) break;
      if (line->rfind("stats ", 0) == 0) stats_[p.name] = line->substr(6);
    }
    auto rc = p.child->wait(10s);
    if (!rc.ok() || *rc != 0)
      std::fprintf(stderr, "control_plane_bench: %s did not exit cleanly (%s)\n", p.name.c_str(),
                   rc.ok() ? std::to_string(*rc).c_str() : rc.status().to_string().c_str());
    p.child.reset();  // kills (if still running) and reaps
  }

  Counters counters() const {
    return {dispatcher_->stats(), coordinator_->stats(), qserver_->stats(), head_->stats()};
  }

  template <class F>
  PhaseResult measure_phase(F&& body, bool with_floor) {
    std::vector<const Proc*> procs;
    for (const Proc& w : workers_) procs.push_back(&w);
    if (with_floor) procs.push_back(&floor_);
    PhaseResult r;
    std::map<std::string, ProcessSample> start;
    r.start = counters();
    start["actor"] = sample_process(::getpid());
    for (const Proc* p : procs) start[p->name] = sample_process(p->pid);
    const auto t0 = std::chrono::steady_clock::now();
    body();
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.threads["actor"] = deltas(start["actor"], sample_process(::getpid()));
    for (const Proc* p : procs) r.threads[p->name] = deltas(start[p->name], sample_process(p->pid));
    r.end = counters();
    return r;
  }

  // The trainer under the stream rule for --load-s, then the drain under the sync rule.
  void run_load() {
    must(dispatcher_->set_rule(laminar::AdmissionRule::stream(c_.max_staleness, c_.in_flight)), "stream rule");
    const std::size_t batch = std::size_t(c_.batch_groups) * kGroup;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(c_.load_s);
    auto take = [&](laminar::Batch& b) {
      for (const laminar::Trajectory& t : b.trajectories()) (void)must(dispatcher_->completed(t.id), "completed");
    };
    for (;;) {
      const auto left = deadline - std::chrono::steady_clock::now();
      if (left <= laminar::Duration::zero()) break;
      laminar::BatchSpec spec;
      spec.max_trajectories = spec.min_trajectories = batch;
      spec.wait = std::chrono::duration_cast<laminar::Duration>(left);
      spec.consumer_version = laminar::Version(version_);
      Result<laminar::Batch> b = queue_->pop_batch(spec);
      if (!b.ok()) {
        if (b.status().code() == laminar::StatusCode::kDeadlineExceeded) break;
        die("pop_batch", b.status());
      }
      take(*b);
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(c_.train_ms));
      must(queue_->ack(b->id()), "ack");
      must(publish(), "publish");
      ++steps_;
    }
    must(dispatcher_->set_rule(laminar::AdmissionRule::sync()), "sync rule");
    const auto drain_deadline = std::chrono::steady_clock::now() + 60s;
    while (std::chrono::steady_clock::now() < drain_deadline) {
      const auto s = dispatcher_->stats();
      if (s.groups_done == s.groups_made) break;
      laminar::BatchSpec spec;
      spec.max_trajectories = batch;
      spec.min_trajectories = 1;
      spec.wait = 1s;
      spec.consumer_version = laminar::Version(version_);
      Result<laminar::Batch> b = queue_->pop_batch(spec);
      if (!b.ok()) {
        if (b.status().code() == laminar::StatusCode::kDeadlineExceeded) continue;
        die("drain", b.status());
      }
      take(*b);
      must(queue_->ack(b->id()), "ack");
    }
    const auto s = dispatcher_->stats();
    if (s.groups_done != s.groups_made) die("the load did not drain within 60 s");
  }

  struct Control {
    double samples = 0, requests = 0, reports = 0, orders = 0, pushes = 0, plans = 0, waited = 0;
    double total() const { return requests + reports + orders; }
  };
  static Control control(const PhaseResult& r) {
    Control c;
    c.samples = double(r.end.dispatch.completed - r.start.dispatch.completed);
    c.requests = double(r.end.dispatch.requests + r.end.dispatch.refused - r.start.dispatch.requests -
                        r.start.dispatch.refused);
    c.waited = double(r.end.dispatch.waited - r.start.dispatch.waited);
    c.reports = double(r.end.repack.reports + r.end.repack.keepalives + r.end.repack.reports_refused -
                       r.start.repack.reports - r.start.repack.keepalives - r.start.repack.reports_refused);
    c.orders = double(r.end.repack.orders_sent + r.end.repack.orders_failed - r.start.repack.orders_sent -
                      r.start.repack.orders_failed);
    c.plans = double(r.end.repack.plans - r.start.repack.plans);
    c.pushes = double(r.end.queue.received - r.start.queue.received);
    return c;
  }

  static void print_threads(const char* phase, const std::string& proc, const std::vector<ThreadDelta>& ts,
                            double seconds) {
    std::uint64_t preempted = 0;
    for (const ThreadDelta& t : ts) preempted += t.nonvoluntary;
    std::printf("#   %s %s: %.1f wake-ups/s (%.1f of them preempted)", phase, proc.c_str(), double(total(ts)) / seconds,
                double(preempted) / seconds);
    std::printf("  [");
    bool first = true;
    for (const ThreadDelta& t : ts) {
      if (t.total() == 0) continue;
      std::printf("%s%s(%d) %.1f%s", first ? "" : ", ", t.comm.c_str(), int(t.tid), double(t.total()) / seconds,
                  t.nonvoluntary > t.voluntary ? " mostly preempted" : "");
      first = false;
    }
    std::printf("]\n");
  }

  void report() {
    // Idle: per process, per thread.
    std::printf("# idle phase: %.1f s, load average %.2f -> %.2f\n", idle_.seconds, idle_.load_start, idle_.load_end);
    for (const auto& [proc, ts] : idle_.threads) print_threads("idle", proc, ts, idle_.seconds);
    const Control ic = control(idle_);
    std::printf("#   idle control messages: %.2f/s (dispatcher requests %.0f, repack reports %.0f, orders %.0f; "
                "plans %.0f); relay idle messages (not counted) about %.1f/s\n",
                ic.total() / idle_.seconds, ic.requests, ic.reports, ic.orders, ic.plans,
                double(c_.workers) * 4 / kRelayStallS);
    const double floor_rate = double(total(idle_.threads.at("floor"))) / idle_.seconds;
    std::string worst;
    double worst_rate = -1;
    for (const auto& [proc, ts] : idle_.threads) {
      if (proc == "floor") continue;
      const double rate = double(total(ts)) / idle_.seconds;
      if (rate > worst_rate) worst_rate = rate, worst = proc;
    }
    // Load: per process, per thread, per sample.
    auto print_load = [&](const char* name, const PhaseResult& r) {
      const Control c = control(r);
      std::printf("# %s phase: %.1f s (drain included), %.0f samples (%.1f/s), load average %.2f\n", name, r.seconds,
                  c.samples, c.samples / r.seconds, load_average());
      for (const auto& [proc, ts] : r.threads) {
        print_threads(name, proc, ts, r.seconds);
        std::printf("#     %.2f wake-ups per sample\n", c.samples > 0 ? double(total(ts)) / c.samples : 0.0);
      }
      std::printf("#   control messages per sample: %.3f = dispatcher requests %.3f (%.0f, %.0f waited) + repack "
                  "reports %.3f (%.0f) + orders %.3f (%.0f; %.0f plans); data: pushes %.3f per sample; relay idle "
                  "messages (not counted) at most %.3f per sample\n",
                  c.total() / c.samples, c.requests / c.samples, c.requests, c.waited, c.reports / c.samples, c.reports,
                  c.orders / c.samples, c.orders, c.plans, c.pushes / c.samples,
                  double(c_.workers) * 4 / kRelayStallS * r.seconds / c.samples);
      return c;
    };
    const Control lc = print_load("load", load_);
    Control pc;
    if (!c_.skip_polling) pc = print_load("polling-load", polled_);
    for (const auto& [proc, s] : stats_) std::printf("#   %s: %s\n", proc.c_str(), s.c_str());
    std::fflush(stdout);

    for (const auto& [proc, ts] : idle_.threads) {
      if (proc == "floor") continue;
      laminar::bench::report_time("control_plane_idle_" + proc, "idle_wakeups_per_s",
                                  double(total(ts)) / idle_.seconds, "floor_transport_only", floor_rate);
    }
    const double value = lc.total() / lc.samples;
    if (!c_.skip_polling) {
      laminar::bench::report_time("control_plane_load", "control_messages_per_sample", value,
                                  "polling_dispatch_client", pc.total() / pc.samples);
    } else {
      laminar::bench::report_time("control_plane_load", "control_messages_per_sample", value, "pushes_per_sample",
                                  lc.pushes / lc.samples);
    }
    laminar::bench::report_time("control_plane_idle", "idle_wakeups_per_s", worst_rate, "floor_transport_only",
                                floor_rate);
    std::printf("# headline process: %s\n", worst.c_str());
  }

  const Config& c_;
  ThreadNamer namer_;
  Weights weights_;
  std::shared_ptr<laminar::Transport> transport_;
  std::string address_;
  std::shared_ptr<laminar::TrajectoryQueue> queue_;
  std::unique_ptr<laminar::TrajectoryQueueServer> qserver_;
  std::shared_ptr<laminar::RelayStore> relay_;
  std::unique_ptr<laminar::RelayNode> head_;
  std::unique_ptr<laminar::RepackCoordinator> coordinator_;
  std::unique_ptr<laminar::RolloutDispatcher> dispatcher_;
  std::uint64_t version_ = 0;
  std::uint64_t steps_ = 0;
  Proc floor_;
  std::vector<Proc> workers_;
  PhaseResult idle_, load_, polled_;
  std::map<std::string, std::string> stats_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Wake-ups of idle laminar processes and control messages per sample under load"};
  app.option_defaults()->always_capture_default();
  Config c;
  app.add_option("--idle-s", c.idle_s, "seconds of the idle phase")->check(laminar::bench::positive());
  app.add_option("--load-s", c.load_s, "seconds of each load phase (the drain comes after)")
      ->check(laminar::bench::positive());
  app.add_option("--workers", c.workers, "rollout worker processes")->check(laminar::bench::at_least(2));
  app.add_option("--step-ms", c.step_ms, "a simulated decode step")->check(laminar::bench::positive());
  app.add_option("--max-live", c.max_live, "sequences a worker decodes at once")->check(laminar::bench::positive());
  app.add_option("--median-tokens", c.median_tokens, "median response length (p99 is 10x)")
      ->check(laminar::bench::positive());
  app.add_option("--max-tokens", c.max_tokens, "longest response")->check(laminar::bench::positive());
  app.add_option("--in-flight", c.in_flight, "the stream's max_in_flight samples")->check(laminar::bench::at_least(kGroup));
  app.add_option("--max-staleness", c.max_staleness, "the stream's max_staleness in versions");
  app.add_option("--batch-groups", c.batch_groups, "groups of 8 in one training batch")
      ->check(laminar::bench::positive());
  app.add_option("--train-ms", c.train_ms, "a simulated training step")->check(laminar::bench::at_least(0));
  app.add_option("--weight-mib", c.weight_mib, "MiB of each published version")->check(laminar::bench::positive());
  app.add_option("--plan-interval-ms", c.plan_interval_ms, "RepackCoordinatorOptions::min_plan_interval")
      ->check(laminar::bench::positive());
  app.add_option("--report-interval-ms", c.report_interval_ms, "RepackDriverOptions::min_report_interval")
      ->check(laminar::bench::positive());
  app.add_option("--seed", c.seed, "the dispatcher's seed (sampling seeds, hence lengths)");
  app.add_flag("--quick", c.quick, "2 s idle, 3 s load, 1 MiB versions: a smoke run");
  app.add_flag("--skip-polling", c.skip_polling, "no polling baseline (control messages against pushes instead)");
  // The processes this bench starts of itself; the empty group keeps them out of --help.
  CLI::App* worker = app.add_subcommand("worker", "a rollout worker")->group("");
  std::string actor;
  int index = 0;
  bool polling = false;
  worker->add_option("actor", actor)->required();
  worker->add_option("index", index)->required();
  worker->add_flag("--poll", polling);
  CLI::App* floor = app.add_subcommand("floor", "a process with a Transport only")->group("");
  floor->add_option("actor", actor)->required();
  CLI11_PARSE(app, argc, argv);
  if (worker->parsed()) return Worker(c, actor, index, polling).run();
  if (floor->parsed()) return run_floor(actor);
  if (c.quick) {
    c.idle_s = 2;
    c.load_s = 3;
    c.weight_mib = 1;
  }
  std::printf("# seed %llu\n", static_cast<unsigned long long>(c.seed));
  return Actor(c).run();
}
