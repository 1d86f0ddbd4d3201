// trajectory_queue_bench: push + pop throughput of realistic trajectories (1-4k response tokens,
// 256 prompt tokens, per-token log-probs, a reward, a small JSON metadata object) with N producer
// and M consumer threads, against moodycamel::ConcurrentQueue moving the very same objects in the
// same run.
//
// Each repeat moves the pool through the queue `passes` times: producers stamp a fresh id and push
// their slice, consumers pop and put each trajectory back in its place in the pool, and a producer
// pushes a trajectory again once it is back. Time runs from the start signal to the moment the
// last trajectory is consumed. Several passes make it a throughput measurement: with 4 threads on
// 2 cores a consumer thread often first runs about a millisecond after the start (when a
// producer's time slice ends), and a single pass of the pool (--passes 1) is over in 1-3 ms, so
// it mostly measures that start-up, more so for whichever queue's producers take longer.
//
// TrajectoryQueue runs with every semantic on: validation of the trajectory's own fields
// (lengths, a reward present, group fields), version check, unique ids, GRPO groups of 8 released
// whole, leases acked per batch, staleness keep-and-mark, statistics; a second instance also
// scans token ids, log-probs, rewards and metadata JSON (TrajectoryQueueOptions::validate_contents),
// reported on its own line. moodycamel moves the objects with producer and consumer
// tokens and bulk dequeue, its fastest use. A second pair of runs pushes each group of 8 with one
// call: push_many() against moodycamel's enqueue_bulk(). Then the same TrajectoryQueue with its
// write-ahead log on (page cache, no fsync), reported separately; that run moves the pool once.
// The throughput baseline, a std::deque behind a std::mutex with no semantics at all, moves the
// same objects interleaved with the others.
// Last, with wal_fsync, a pool of 1024 moved once: each group of 8 with one push_many() (one
// fdatasync) against push() one by one (one each).
// The same producer and consumer threads run every repeat of every queue (see Workers).
//
// Then the latency at a realistic rate: one producer pushing groups of 16 at 10^4
// trajectories/s to a consumer waiting in pop_batch, from a group's last push to its delivery,
// against a bare std::condition_variable handoff of the same groups (see latency_laminar).
//
//   trajectory_queue_bench [--producers N] [--consumers M] [--pool P] [--passes K] [--repeats R]
//                          [--wal-dir DIR] [--pin 1] [--latency-groups G] [--latency-repeats L]
//                          [--latency-rate T]
//
// --pin 1 pins worker i (producers first, then consumers) to the i-th CPU this process may run
// on, round robin.
//
// Lines (JSON, one per metric, the headline last):
//   trajectory_queue_contents_checked vs moodycamel::ConcurrentQueue;
//   trajectory_queue_push_group_pop vs moodycamel::ConcurrentQueue with enqueue_bulk;
//   trajectory_queue_wal vs trajectory_queue without WAL;
//   trajectory_queue_wal_fsync_push_many vs push() with wal_fsync;
//   trajectory_queue_push_pop_vs_moodycamel (reference);
//   trajectory_queue_push_pop vs a std::deque behind a std::mutex, no semantics (goal: >= 1e6/s);
//   trajectory_queue_group_latency_p99 vs a std::condition_variable handoff (goal: ratio >= 0.5).
// Every baseline must be stable (harness.h): repeats whose median is more than twice the fastest
// end the run with exit code 3 instead of its line.
#include <concurrentqueue/concurrentqueue.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <filesystem>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cli.h"
#include "harness.h"
#include "realistic_trajectory.h"
#include "laminar/trajectory_queue.h"

namespace {

using laminar::Trajectory;
using Clock = std::chrono::steady_clock;

constexpr std::uint32_t kGroupSize = 8;
constexpr std::size_t kBatch = 64;

struct Config {
  int producers = 2;
  int consumers = 2;
  std::size_t pool = 8192;
  int passes = 8;
  int repeats = 15;
  int wal_repeats = 3;
  std::size_t latency_groups = 1000;  // per latency run
  int latency_repeats = 5;
  double latency_rate = 1e4;  // trajectories/s
  std::string wal_dir = std::filesystem::temp_directory_path().string();
  bool pin = false;
};

std::vector<Trajectory> make_pool(std::size_t n) {
  std::mt19937 rng(1234);
  std::vector<Trajectory> pool(n);
  for (Trajectory& t : pool) laminar::bench::fill_realistic(t, rng);
  return pool;
}

// Gives trajectory `i` of pass `pass` of repeat `rep` a fresh id and its group (groups never
// straddle producers: slices are multiples of kGroupSize).
void stamp(Trajectory& t, std::size_t i, int rep, int pass, const Config& cfg) {
  const std::uint64_t serial = std::uint64_t(rep) * std::uint64_t(cfg.passes) + std::uint64_t(pass);
  const std::uint64_t id = serial * cfg.pool + i + 1;
  t.id = laminar::TrajectoryId(id);
  t.group_size = kGroupSize;
  t.group_id = laminar::GroupId((id - 1) / kGroupSize);
  t.prompt_id = laminar::PromptId(t.group_id.value());
  t.sample_index = std::uint32_t((id - 1) % kGroupSize);
  t.version = laminar::Version(std::uint64_t(rep));
}

struct Slice {
  std::size_t begin, end;
};
Slice slice_of(int p, int producers, std::size_t pool) {
  const std::size_t groups = pool / kGroupSize;
  return {groups * std::size_t(p) / std::size_t(producers) * kGroupSize,
          groups * std::size_t(p + 1) / std::size_t(producers) * kGroupSize};
}

std::size_t total(const Config& cfg) { return cfg.pool * std::size_t(cfg.passes); }

// The pool, and which of its trajectories are back in place, free to be pushed again.
class Returned {
 public:
  explicit Returned(std::vector<Trajectory>& pool)
      : pool_(pool), flags_(new std::atomic<bool>[pool.size()]), n_(pool.size()) {
    for (std::size_t i = 0; i < n_; ++i) flags_[i].store(true, std::memory_order_relaxed);
  }
  // Waits until trajectories [i, i + n) are back, then hands them out.
  std::span<Trajectory> take(std::size_t i, std::size_t n) {
    for (std::size_t k = i; k < i + n; ++k) {
      while (!flags_[k].load(std::memory_order_acquire)) std::this_thread::yield();
      flags_[k].store(false, std::memory_order_relaxed);
    }
    return std::span<Trajectory>(pool_).subspan(i, n);
  }
  // A consumed trajectory goes back to its place (its id says which).
  void put_back(Trajectory&& t) {
    const std::size_t i = (t.id.value() - 1) % n_;
    pool_[i] = std::move(t);
    flags_[i].store(true, std::memory_order_release);
  }
  bool all_back() const {
    for (std::size_t i = 0; i < n_; ++i) {
      if (!flags_[i].load(std::memory_order_acquire)) return false;
    }
    return true;
  }

 private:
  std::vector<Trajectory>& pool_;
  std::unique_ptr<std::atomic<bool>[]> flags_;
  std::size_t n_;
};

// A producer's loop: `passes` times over its slice, `per_push` trajectories at a time (1, or a
// whole group) once they are back.
template <class Push>
void produce_passes(const Config& cfg, int p, int rep, Returned& back, std::size_t per_push, Push push) {
  const Slice sl = slice_of(p, cfg.producers, cfg.pool);
  for (int pass = 0; pass < cfg.passes; ++pass) {
    for (std::size_t i = sl.begin; i < sl.end; i += per_push) {
      std::span<Trajectory> ts = back.take(i, per_push);
      for (std::size_t k = 0; k < per_push; ++k) stamp(ts[k], i + k, rep, pass, cfg);
      push(ts);
    }
  }
}

double thread_cpu_s() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

// One repeat: wall time from start to the last trajectory consumed, and the CPU time the producer
// and the consumer threads used (which, unlike wall time, hardly depends on where the scheduler
// put them; consumers waiting for data count too).
struct RunTime {
  double wall_s = 0;
  double producers_cpu_s = 0;
  double consumers_cpu_s = 0;
};

// The producer and consumer threads, started once and reused by every run, as a rollout and a
// trainer's threads are. Threads started afresh for each run (1-20 ms) measured the scheduler as
// much as the queue: ps showed new threads often all beginning on one core, and a run could be
// over before load balancing spread them. Between runs the workers wait yielding.
class Workers {
 public:
  // `pin`: worker i runs only on the i-th allowed CPU (round robin).
  Workers(int n, bool pin) {
    std::vector<int> cpus;
    cpu_set_t allowed;
    if (pin && ::sched_getaffinity(0, sizeof allowed, &allowed) == 0) {
      for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
      }
    }
    for (int i = 0; i < n; ++i) {
      const int cpu = cpus.empty() ? -1 : cpus[std::size_t(i) % cpus.size()];
      threads_.emplace_back([this, i, cpu] {
        if (cpu >= 0) pin_to(cpu);
        loop(i);
      });
    }
  }
  ~Workers() {
    stop_.store(true);
    generation_.fetch_add(1);
    for (auto& t : threads_) t.join();
  }
  // Runs job(i) on worker i, for each worker; returns, once all are done, the time it started them.
  Clock::time_point run(const std::function<void(int)>& job) {
    job_ = &job;
    done_.store(0);
    const auto start = Clock::now();
    generation_.fetch_add(1, std::memory_order_acq_rel);
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return done_.load() == int(threads_.size()); });
    return start;
  }

 private:
  static void pin_to(int cpu) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    if (::sched_setaffinity(0, sizeof one, &one) != 0) {
      std::fprintf(stderr, "trajectory_queue_bench: cannot pin a worker to CPU %d\n", cpu);
      std::exit(1);
    }
  }
  void loop(int i) {
    std::uint64_t seen = 0;
    for (;;) {
      while (generation_.load(std::memory_order_acquire) == seen) std::this_thread::yield();
      seen = generation_.load(std::memory_order_acquire);
      if (stop_.load()) return;
      (*job_)(i);
      if (done_.fetch_add(1) + 1 == int(threads_.size())) {
        std::lock_guard<std::mutex> l(mu_);
        cv_.notify_one();
      }
    }
  }
  std::vector<std::thread> threads_;
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<int> done_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

// Runs producers (workers [0, producers)) and consumers (the rest).
template <class Produce, class Consume>
RunTime run_threads(const Config& cfg, Workers& workers, std::atomic<std::size_t>& consumed, Produce produce,
                    Consume consume) {
  std::atomic<Clock::rep> end_ticks{0};
  std::mutex cpu_mu;
  RunTime rt;
  consumed = 0;
  const std::function<void(int)> job = [&](int i) {
    const double cpu = thread_cpu_s();
    if (i < cfg.producers) {
      produce(i);
    } else {
      consume(i - cfg.producers, [&](std::size_t n) {
        if (consumed.fetch_add(n) + n == total(cfg)) end_ticks = Clock::now().time_since_epoch().count();
      });
    }
    std::lock_guard<std::mutex> l(cpu_mu);
    (i < cfg.producers ? rt.producers_cpu_s : rt.consumers_cpu_s) += thread_cpu_s() - cpu;
  };
  const auto start = workers.run(job);
  rt.wall_s = std::chrono::duration<double>(Clock::duration(end_ticks.load()) - start.time_since_epoch()).count();
  return rt;
}

laminar::bench::Timing summarize(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front(), t.back(), int(t.size())};
}

[[noreturn]] void die(const char* what, const laminar::Status& st) {
  std::fprintf(stderr, "trajectory_queue_bench: %s: %s\n", what, st.to_string().c_str());
  std::exit(1);
}

// One repeat through a TrajectoryQueue, pushing `per_push` trajectories per call (push() for 1,
// push_many() for more); every trajectory ends back in its place in `pool`.
RunTime run_laminar(const Config& cfg, Workers& workers, laminar::TrajectoryQueue& q, std::vector<Trajectory>& pool,
                    int rep, std::size_t per_push = 1) {
  if (laminar::Status st = q.publish_version(laminar::Version(std::uint64_t(rep))); !st.ok()) die("publish", st);
  Returned back(pool);
  std::atomic<std::size_t> consumed{0};
  const RunTime s = run_threads(
      cfg, workers, consumed,
      [&](int p) {
        produce_passes(cfg, p, rep, back, per_push, [&](std::span<Trajectory> ts) {
          if (ts.size() == 1) {
            if (laminar::Status st = q.push(std::move(ts[0])); !st.ok()) die("push", st);
            return;
          }
          for (const laminar::Status& st : q.push_many(ts)) {
            if (!st.ok()) die("push_many", st);
          }
        });
      },
      [&](int, auto done) {
        laminar::BatchSpec spec;
        spec.max_trajectories = kBatch;
        spec.wait = std::chrono::milliseconds(1);
        spec.consumer_version = laminar::Version(std::uint64_t(rep));
        spec.staleness_rule = laminar::StalenessRule::kKeepAndMark;
        spec.max_staleness = 4;
        while (consumed.load(std::memory_order_relaxed) < total(cfg)) {
          laminar::Result<laminar::Batch> b = q.pop_batch(spec);
          if (!b.ok()) continue;
          if (laminar::Status st = q.ack(b->id()); !st.ok()) die("ack", st);
          std::vector<Trajectory> got = b->release();
          for (Trajectory& t : got) back.put_back(std::move(t));
          done(got.size());
        }
      });
  if (!back.all_back()) {
    std::fprintf(stderr, "trajectory_queue_bench: not every trajectory came back\n");
    std::exit(1);
  }
  return s;
}

RunTime run_moodycamel(const Config& cfg, Workers& workers, std::vector<Trajectory>& pool, int rep,
                       std::size_t per_push = 1) {
  moodycamel::ConcurrentQueue<Trajectory> q;
  Returned back(pool);
  std::atomic<std::size_t> consumed{0};
  const RunTime s = run_threads(
      cfg, workers, consumed,
      [&](int p) {
        moodycamel::ProducerToken tok(q);
        produce_passes(cfg, p, rep, back, per_push, [&](std::span<Trajectory> ts) {
          const bool queued = ts.size() == 1 ? q.enqueue(tok, std::move(ts[0]))
                                             : q.enqueue_bulk(tok, std::make_move_iterator(ts.begin()), ts.size());
          if (!queued) std::exit(1);
        });
      },
      [&](int, auto done) {
        moodycamel::ConsumerToken tok(q);
        std::vector<Trajectory> got(kBatch);
        while (consumed.load(std::memory_order_relaxed) < total(cfg)) {
          const std::size_t n = q.try_dequeue_bulk(tok, got.begin(), kBatch);
          if (n == 0) {
            std::this_thread::yield();
            continue;
          }
          for (std::size_t k = 0; k < n; ++k) back.put_back(std::move(got[k]));
          done(n);
        }
      });
  if (!back.all_back()) std::exit(1);
  return s;
}

// A queue with none of TrajectoryQueue's semantics behind one std::mutex: a std::deque that
// producers append to and consumers take up to kBatch from at a time, sleeping on a condition
// variable while it is empty (up to 1 ms, as the TrajectoryQueue consumers ask for), what a
// framework's locked buffer does. What the lock and the sleeping cost, without the bookkeeping.
RunTime run_locked_deque(const Config& cfg, Workers& workers, std::vector<Trajectory>& pool, int rep) {
  std::mutex mu;
  std::condition_variable cv;
  int waiting = 0;
  std::deque<Trajectory> q;
  Returned back(pool);
  std::atomic<std::size_t> consumed{0};
  const RunTime s = run_threads(
      cfg, workers, consumed,
      [&](int p) {
        produce_passes(cfg, p, rep, back, 1, [&](std::span<Trajectory> ts) {
          bool wake = false;
          {
            std::lock_guard<std::mutex> l(mu);
            q.push_back(std::move(ts[0]));
            wake = waiting > 0;
          }
          if (wake) cv.notify_all();
        });
      },
      [&](int, auto done) {
        std::vector<Trajectory> got;
        got.reserve(kBatch);
        while (consumed.load(std::memory_order_relaxed) < total(cfg)) {
          {
            std::unique_lock<std::mutex> l(mu);
            if (q.empty()) {
              ++waiting;
              cv.wait_for(l, std::chrono::milliseconds(1));
              --waiting;
            }
            while (!q.empty() && got.size() < kBatch) {
              got.push_back(std::move(q.front()));
              q.pop_front();
            }
          }
          for (Trajectory& t : got) back.put_back(std::move(t));
          done(got.size());
          got.clear();
        }
      });
  if (!back.all_back()) std::exit(1);
  return s;
}

// --- Latency at a realistic rate ---
//
// One producer pushes a group of kLatencyGroup trajectories every kLatencyGroup / rate seconds
// (10^4 trajectories/s: a group every 1.6 ms) into a queue a consumer waits on; the latency of a
// group runs from just before its last member is pushed to the moment pop_batch hands it to the
// consumer. The baseline does the same handoff with nothing but a std::mutex, a std::vector and a
// std::condition_variable: the producer appends each member under the lock and notifies once the
// group is complete; the consumer waits until it is, then takes it. Both move the same fresh
// copies of realistic trajectories.
constexpr std::uint32_t kLatencyGroup = 16;

// p99 of `v`, in seconds, the first tenth left out as warm-up (first allocations and page
// faults of the queue and of the trajectories' copies).
double p99(std::vector<double> v) {
  v.erase(v.begin(), v.begin() + std::ptrdiff_t(v.size() / 10));
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, v.size() * 99 / 100)];
}

// Paces `groups` groups at `rate` trajectories/s; push(group, g) pushes group g (and notes the
// time just before its last member goes in).
template <class Push>
void paced_producer(const std::vector<Trajectory>& pool, std::size_t groups, double rate, Push push) {
  const auto period = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kLatencyGroup / rate));
  auto next = Clock::now();
  for (std::size_t g = 0; g < groups; ++g) {
    std::vector<Trajectory> group(kLatencyGroup);
    for (std::uint32_t k = 0; k < kLatencyGroup; ++k) {
      group[k] = pool[(g * kLatencyGroup + k) % pool.size()];
      group[k].id = laminar::TrajectoryId(g * kLatencyGroup + k + 1);
      group[k].group_id = laminar::GroupId(g);
      group[k].prompt_id = laminar::PromptId(g);
      group[k].group_size = kLatencyGroup;
      group[k].sample_index = k;
      group[k].version = laminar::Version(0);
    }
    std::this_thread::sleep_until(next);  // pacing, not synchronisation
    next += period;
    push(group, g);
  }
}

// The p99 latency through a TrajectoryQueue with every semantic on (as the throughput runs, plus
// contents validation, which is on by default).
double latency_laminar(const std::vector<Trajectory>& pool, std::size_t groups, double rate) {
  laminar::TrajectoryQueueOptions opt;
  opt.group_timeout = std::chrono::seconds(10);
  auto q = laminar::TrajectoryQueue::create(opt);
  if (!q.ok()) die("create", q.status());
  std::vector<Clock::time_point> last_push(groups);
  std::vector<double> lat(groups);
  std::thread consumer([&] {
    laminar::BatchSpec spec;
    spec.max_trajectories = kLatencyGroup;
    spec.wait = laminar::kForever;
    spec.staleness_rule = laminar::StalenessRule::kKeepAndMark;
    spec.max_staleness = 4;
    for (std::size_t n = 0; n < groups;) {
      laminar::Result<laminar::Batch> b = (*q)->pop_batch(spec);
      const auto got = Clock::now();
      if (!b.ok()) die("pop_batch", b.status());
      const std::uint64_t g = b->trajectories()[0].group_id.value();
      lat[g] = std::chrono::duration<double>(got - last_push[g]).count();
      if (laminar::Status st = (*q)->ack(b->id()); !st.ok()) die("ack", st);
      ++n;
    }
  });
  paced_producer(pool, groups, rate, [&](std::vector<Trajectory>& group, std::size_t g) {
    for (std::uint32_t k = 0; k < kLatencyGroup; ++k) {
      if (k + 1 == kLatencyGroup) last_push[g] = Clock::now();
      if (laminar::Status st = (*q)->push(std::move(group[k])); !st.ok()) die("push", st);
    }
  });
  consumer.join();
  return p99(lat);
}

double latency_condvar(const std::vector<Trajectory>& pool, std::size_t groups, double rate) {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Trajectory> pending;
  std::size_t complete = 0;  // trajectories of complete groups at the front of `pending`
  std::vector<Clock::time_point> last_push(groups);
  std::vector<double> lat(groups);
  std::thread consumer([&] {
    for (std::size_t n = 0; n < groups; ++n) {
      std::vector<Trajectory> got;
      {
        std::unique_lock<std::mutex> l(mu);
        cv.wait(l, [&] { return complete >= kLatencyGroup; });
        got.assign(std::make_move_iterator(pending.begin()), std::make_move_iterator(pending.begin() + kLatencyGroup));
        pending.erase(pending.begin(), pending.begin() + kLatencyGroup);
        complete -= kLatencyGroup;
      }
      const auto at = Clock::now();
      const std::uint64_t g = got[0].group_id.value();
      lat[g] = std::chrono::duration<double>(at - last_push[g]).count();
    }
  });
  paced_producer(pool, groups, rate, [&](std::vector<Trajectory>& group, std::size_t g) {
    for (std::uint32_t k = 0; k < kLatencyGroup; ++k) {
      if (k + 1 == kLatencyGroup) last_push[g] = Clock::now();
      bool whole = false;
      {
        std::lock_guard<std::mutex> l(mu);
        pending.push_back(std::move(group[k]));
        if (k + 1 == kLatencyGroup) {
          complete += kLatencyGroup;
          whole = true;
        }
      }
      if (whole) cv.notify_one();
    }
  });
  consumer.join();
  return p99(lat);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"TrajectoryQueue push + pop throughput and latency against moodycamel::ConcurrentQueue"};
  app.option_defaults()->always_capture_default();
  Config cfg;
  app.add_option("--producers", cfg.producers, "producer threads")->check(laminar::bench::positive());
  app.add_option("--consumers", cfg.consumers, "consumer threads")->check(laminar::bench::positive());
  app.add_option("--pool", cfg.pool, "trajectories, rounded down to a multiple of 8 x --producers")
      ->check(laminar::bench::positive());
  app.add_option("--passes", cfg.passes, "times a repeat moves the pool")->check(laminar::bench::positive());
  app.add_option("--repeats", cfg.repeats, "timed repeats")->check(laminar::bench::positive());
  app.add_option("--wal-dir", cfg.wal_dir, "directory of the write-ahead logs")->check(CLI::ExistingDirectory);
  app.add_option("--pin", cfg.pin, "1: pin each worker thread to a CPU");
  app.add_option("--latency-groups", cfg.latency_groups, "groups a latency run")
      ->check(laminar::bench::at_least(100));
  app.add_option("--latency-repeats", cfg.latency_repeats, "latency runs")->check(laminar::bench::positive());
  app.add_option("--latency-rate", cfg.latency_rate, "trajectories/s the latency producer pushes")
      ->check(laminar::bench::positive());
  CLI11_PARSE(app, argc, argv);
  const std::size_t pool_step = kGroupSize * std::size_t(cfg.producers);
  cfg.pool -= cfg.pool % pool_step;
  if (cfg.pool == 0) {
    return app.exit(CLI::ValidationError("--pool", "less than one group of 8 for each producer (" +
                                                       std::to_string(pool_step) + ")"));
  }
  std::vector<Trajectory> pool = make_pool(cfg.pool);
  std::size_t tokens = 0;
  for (const Trajectory& t : pool) tokens += t.num_tokens();
  std::printf("# %d producers, %d consumers%s, a pool of %zu trajectories moved %d times per repeat (%.0f tokens "
              "on average)\n",
              cfg.producers, cfg.consumers, cfg.pin ? " (pinned)" : "", cfg.pool, cfg.passes,
              double(tokens) / double(cfg.pool));

  // The headline runs the validation the issue asks for (lengths, version, unique ids, group
  // fields); the "contents checked" run also scans every token id, log-prob, reward and the
  // metadata JSON.
  laminar::TrajectoryQueueOptions opt;
  opt.group_timeout = std::chrono::seconds(10);
  opt.validate_contents = false;
  auto q = laminar::TrajectoryQueue::create(opt);
  if (!q.ok()) die("open", q.status());
  laminar::TrajectoryQueueOptions checked_opt = opt;
  checked_opt.validate_contents = true;
  auto qc = laminar::TrajectoryQueue::create(checked_opt);
  if (!qc.ok()) die("open", qc.status());

  Workers workers(cfg.producers + cfg.consumers, cfg.pin);
  int rep = 0;
  std::vector<double> ours, checked, base, ours_group, base_group, locked;
  // Per trajectory: producers' and consumers' CPU, ours and moodycamel's.
  std::vector<double> ours_prod_cpu, ours_cons_cpu, base_prod_cpu, base_cons_cpu;
  for (int r = 0; r < 2; ++r) {  // warm-up, all six
    run_laminar(cfg, workers, **q, pool, rep++);
    run_laminar(cfg, workers, **qc, pool, rep++);
    run_moodycamel(cfg, workers, pool, rep++);
    run_laminar(cfg, workers, **q, pool, rep++, kGroupSize);
    run_moodycamel(cfg, workers, pool, rep++, kGroupSize);
    run_locked_deque(cfg, workers, pool, rep++);
  }
  // Interleaved so that all six see the same machine load.
  for (int r = 0; r < cfg.repeats; ++r) {
    const RunTime o = run_laminar(cfg, workers, **q, pool, rep++);
    checked.push_back(run_laminar(cfg, workers, **qc, pool, rep++).wall_s);
    const RunTime b = run_moodycamel(cfg, workers, pool, rep++);
    ours_group.push_back(run_laminar(cfg, workers, **q, pool, rep++, kGroupSize).wall_s);
    base_group.push_back(run_moodycamel(cfg, workers, pool, rep++, kGroupSize).wall_s);
    locked.push_back(run_locked_deque(cfg, workers, pool, rep++).wall_s);
    ours.push_back(o.wall_s);
    base.push_back(b.wall_s);
    const double n = double(total(cfg));
    ours_prod_cpu.push_back(o.producers_cpu_s / n);
    ours_cons_cpu.push_back(o.consumers_cpu_s / n);
    base_prod_cpu.push_back(b.producers_cpu_s / n);
    base_cons_cpu.push_back(b.consumers_cpu_s / n);
  }
  laminar::bench::require_stable_baseline("moodycamel::ConcurrentQueue", base);
  laminar::bench::require_stable_baseline("moodycamel::ConcurrentQueue enqueue_bulk", base_group);
  laminar::bench::require_stable_baseline("std::mutex + std::deque", locked);
  const double checked_rate = double(total(cfg)) / summarize(checked).median_s;
  const auto t_ours = summarize(ours);
  const auto t_base = summarize(base);
  const double ours_rate = double(total(cfg)) / t_ours.median_s;
  const double base_rate = double(total(cfg)) / t_base.median_s;
  const double group_rate = double(total(cfg)) / summarize(ours_group).median_s;
  const double base_group_rate = double(total(cfg)) / summarize(base_group).median_s;
  const double locked_rate = double(total(cfg)) / summarize(locked).median_s;
  std::printf("# stats after the last repeat: %s\n", (*q)->stats().to_json().c_str());

  // The log run moves the pool once: at its rate start-up does not matter, and every pass would
  // write the whole pool (about 180 MB) to the log again, measuring the disk's writeback.
  Config wal_cfg = cfg;
  wal_cfg.passes = 1;
  // One repeat through a queue on a fresh log (fsync'd or not), the file removed afterwards.
  const std::string wal_path = cfg.wal_dir + "/laminar_tq_bench_" + std::to_string(::getpid()) + ".wal";
  auto run_logged = [&](const Config& c, std::vector<Trajectory>& p, bool fsync, std::size_t per_push,
                        std::uint64_t* bytes = nullptr) {
    laminar::TrajectoryQueueOptions wopt = opt;
    wopt.wal_path = wal_path;
    wopt.wal_fsync = fsync;
    std::filesystem::remove(wal_path);
    auto wq = laminar::TrajectoryQueue::create(wopt);
    if (!wq.ok()) die("open with WAL", wq.status());
    const double s = run_laminar(c, workers, **wq, p, rep++, per_push).wall_s;
    if (bytes != nullptr) *bytes = (*wq)->stats().wal_bytes;
    wq->reset();
    std::filesystem::remove(wal_path);
    return s;
  };
  std::vector<double> wal;
  std::uint64_t wal_bytes = 0;
  for (int r = 0; r < cfg.wal_repeats; ++r) wal.push_back(run_logged(wal_cfg, pool, false, 1, &wal_bytes));
  const auto t_wal = summarize(wal);
  const double wal_rate = double(total(wal_cfg)) / t_wal.median_s;

  // With wal_fsync a push returns once its record is on the disk: push() syncs each record,
  // push_many() one group's 8 at once. A smaller pool, moved once: at a few thousand syncs a
  // second the whole one would take seconds.
  Config sync_cfg = wal_cfg;
  const std::size_t sync_unit = kGroupSize * std::size_t(cfg.producers);
  sync_cfg.pool = std::max(sync_unit, std::min<std::size_t>(cfg.pool, 1024) / sync_unit * sync_unit);
  std::vector<Trajectory> sync_pool(pool.begin(), pool.begin() + std::ptrdiff_t(sync_cfg.pool));
  std::vector<double> sync_one, sync_group;
  for (int r = 0; r < cfg.wal_repeats; ++r) {
    sync_one.push_back(run_logged(sync_cfg, sync_pool, true, 1));
    sync_group.push_back(run_logged(sync_cfg, sync_pool, true, kGroupSize));
  }
  laminar::bench::require_stable_baseline("trajectory_queue_wal_fsync_push", sync_one);
  const double sync_one_rate = double(total(sync_cfg)) / summarize(sync_one).median_s;
  const double sync_group_rate = double(total(sync_cfg)) / summarize(sync_group).median_s;
  std::printf("# WAL: %.1f MB per repeat, %.0f MB/s\n", double(wal_bytes) / 1e6,
              double(wal_bytes) / 1e6 / t_wal.median_s);
  auto ns = [](std::vector<double> v) { return summarize(std::move(v)).median_s * 1e9; };
  std::printf("# CPU per trajectory (medians): TrajectoryQueue %.0f ns in producers + %.0f ns in consumers; "
              "moodycamel %.0f + %.0f ns\n",
              ns(ours_prod_cpu), ns(ours_cons_cpu), ns(base_prod_cpu), ns(base_cons_cpu));
  std::printf("# no WAL: median %.2f ms (min %.2f, max %.2f); moodycamel: median %.2f ms (min %.2f, max %.2f)\n",
              t_ours.median_s * 1e3, t_ours.min_s * 1e3, t_ours.max_s * 1e3, t_base.median_s * 1e3,
              t_base.min_s * 1e3, t_base.max_s * 1e3);

  laminar::bench::report_throughput("trajectory_queue_contents_checked", "trajectories/s", checked_rate,
                                    "moodycamel::ConcurrentQueue", base_rate);
  laminar::bench::report_throughput("trajectory_queue_push_group_pop", "trajectories/s", group_rate,
                                    "moodycamel::ConcurrentQueue enqueue_bulk", base_group_rate);
  laminar::bench::report_throughput("trajectory_queue_wal", "trajectories/s", wal_rate,
                                    "trajectory_queue_no_wal", ours_rate);
  laminar::bench::report_throughput("trajectory_queue_wal_fsync_push_many", "trajectories/s", sync_group_rate,
                                    "trajectory_queue_wal_fsync_push", sync_one_rate);
  std::printf("# std::mutex + std::deque, no semantics: %.3g trajectories/s, %.2f of moodycamel\n", locked_rate,
              locked_rate / base_rate);
  laminar::bench::report_throughput("trajectory_queue_push_pop_vs_moodycamel", "trajectories/s", ours_rate,
                                    "moodycamel::ConcurrentQueue", base_rate);
  // Goal: >= 1 M trajectories/s with every semantic on.
  laminar::bench::report_throughput("trajectory_queue_push_pop", "trajectories/s", ours_rate,
                                    "std::mutex + std::deque, no semantics", locked_rate);

  // Latency, alternating so both see the same load; the median of the runs' p99s.
  std::vector<double> lat_ours, lat_base;
  for (int r = 0; r < cfg.latency_repeats; ++r) {
    lat_ours.push_back(latency_laminar(pool, cfg.latency_groups, cfg.latency_rate));
    lat_base.push_back(latency_condvar(pool, cfg.latency_groups, cfg.latency_rate));
  }
  std::printf("# latency p99 per run (us): TrajectoryQueue");
  for (double v : lat_ours) std::printf(" %.1f", v * 1e6);
  std::printf("; condition variable");
  for (double v : lat_base) std::printf(" %.1f", v * 1e6);
  std::printf("\n");
  // Goal: within 2x of the bare handoff (ratio >= 0.5). The headline.
  laminar::bench::require_stable_baseline("std::condition_variable handoff", lat_base);
  laminar::bench::report_time("trajectory_queue_group_latency_p99", "us", summarize(lat_ours).median_s * 1e6,
                              "std::condition_variable handoff", summarize(lat_base).median_s * 1e6);
  return 0;
}
