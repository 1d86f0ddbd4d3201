// remote_trajectory_queue_bench: rollout processes pushing into a TrajectoryQueue over the Transport. A child
// process (this binary re-executed) pushes realistic trajectories (realistic_trajectory.h) from
// several threads sharing one RemoteProducer, while a consumer thread in the parent pops and acks.
// Each group of 8 goes in one RemoteProducer::push_many() message, against push() one trajectory
// at a time (a round trip each) in the same run, children alternating. Then both again into a
// queue with wal_fsync, where a push_many message also takes one fdatasync for its 8 where push()
// takes one each.
//
//   remote_trajectory_queue_bench [--count N] [--fsync-count N] [--threads T] [--repeats R] [--wal-dir DIR]
//
// Time runs in the child from its first push to its last answer (connecting is not counted).
// Lines (JSON): remote_push_many_wal_fsync vs remote_push_wal_fsync; remote_push_many vs
// remote_push (the headline, last).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cli.h"
#include "harness.h"
#include "realistic_trajectory.h"
#include "laminar/remote_trajectory_queue.h"
#include "process.h"

using namespace std::chrono_literals;
using laminar::Trajectory;

namespace {

const char* const kToken = "remote-queue-bench-token-0123456789";
constexpr std::size_t kGroup = 8;

[[noreturn]] void die(const std::string& what, const laminar::Status& st = {}) {
  std::fprintf(stderr, "remote_trajectory_queue_bench: %s%s%s\n", what.c_str(), st.ok() ? "" : ": ",
               st.to_string().c_str());
  std::exit(1);
}

std::shared_ptr<laminar::Transport> make_transport() {
  laminar::TransportOptions o;
  o.cluster_token = kToken;
  o.operation_timeout = 60s;
  auto t = laminar::Transport::create(o);
  if (!t.ok()) die("transport", t.status());
  return std::move(t).value();
}

// Trajectories [first, first + n): group (id - 1) / 8, as a rollout engine returns a prompt's samples.
std::vector<Trajectory> make_trajectories(std::uint64_t first, std::size_t n) {
  std::mt19937 rng{std::uint32_t(first)};
  std::vector<Trajectory> ts(n);
  for (std::size_t i = 0; i < n; ++i) {
    Trajectory& t = ts[i];
    const std::uint64_t id = first + i;
    t.id = laminar::TrajectoryId(id);
    t.group_size = kGroup;
    t.group_id = laminar::GroupId((id - 1) / kGroup);
    t.prompt_id = laminar::PromptId(t.group_id.value());
    t.sample_index = std::uint32_t((id - 1) % kGroup);
    laminar::bench::fill_realistic(t, rng);
  }
  return ts;
}

// The child: `produce ADDRESS MODE FIRST COUNT THREADS`, MODE "one" (push) or "many" (push_many
// per group). Prints the seconds from its first push to its last answer.
int produce(const std::string& address, const std::string& mode, std::uint64_t first, std::size_t count,
            std::size_t threads) {
  auto producer = laminar::RemoteProducer::create(make_transport(), address);
  if (!producer.ok()) die("connect", producer.status());
  std::vector<Trajectory> ts = make_trajectories(first, count);
  const std::size_t groups = count / kGroup;
  std::atomic<int> failed{0};
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (std::size_t k = 0; k < threads; ++k) {
    pool.emplace_back([&, k] {
      for (std::size_t g = k; g < groups; g += threads) {
        std::span<Trajectory> group(ts.data() + g * kGroup, kGroup);
        if (mode == "many") {
          for (const laminar::Status& s : (*producer)->push_many(group)) failed += !s.ok();
        } else {
          for (Trajectory& tr : group) failed += !(*producer)->push(std::move(tr)).ok();
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (failed != 0) die(std::to_string(failed.load()) + " pushes failed");
  std::printf("%.9f\n", s);
  return 0;
}

// A queue served on its own transport, with a consumer thread popping and acking everything.
class Served {
 public:
  explicit Served(laminar::TrajectoryQueueOptions opt) : transport_(make_transport()) {
    auto q = laminar::TrajectoryQueue::create(std::move(opt));
    if (!q.ok()) die("open", q.status());
    queue_ = std::move(q).value();
    auto addr = transport_->listen("127.0.0.1", 0);
    if (!addr.ok()) die("listen", addr.status());
    address_ = *addr;
    auto server = laminar::TrajectoryQueueServer::create(transport_, queue_);
    if (!server.ok()) die("server", server.status());
    server_ = std::move(server).value();
    consumer_ = std::thread([this] {
      laminar::BatchSpec spec;
      spec.max_trajectories = 64;
      spec.wait = 5ms;
      while (!stop_.load()) {
        auto b = queue_->pop_batch(spec);
        if (b.ok() && !queue_->ack(b->id()).ok()) die("ack");
      }
    });
  }
  ~Served() {
    stop_ = true;
    consumer_.join();
    server_.reset();
  }
  const std::string& address() const { return address_; }

 private:
  std::shared_ptr<laminar::Transport> transport_;
  std::shared_ptr<laminar::TrajectoryQueue> queue_;
  std::string address_;
  std::unique_ptr<laminar::TrajectoryQueueServer> server_;
  std::atomic<bool> stop_{false};
  std::thread consumer_;
};

// One child pushing `count` trajectories from `first`; its seconds.
double run_child(const std::string& address, const char* mode, std::uint64_t first, std::size_t count,
                 std::size_t threads) {
  laminar::testing::ChildOptions co;
  co.program = "/proc/self/exe";
  co.args = {"produce", address, mode, std::to_string(first), std::to_string(count), std::to_string(threads)};
  auto child = laminar::testing::ChildProcess::spawn(std::move(co));
  if (!child.ok()) die("spawn", child.status());
  auto line = child->read_line(300s);
  if (!line.ok()) die("producer did not finish", line.status());
  auto rc = child->wait(60s);
  if (!rc.ok() || *rc != 0) die("producer exited badly");
  return std::atof(line->c_str());
}

struct Config {
  std::size_t count = 2048;
  std::size_t fsync_count = 256;
  std::size_t threads = 4;
  int repeats = 5;
  std::string wal_dir = std::filesystem::temp_directory_path().string();
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Rollout processes pushing into a TrajectoryQueue over the Transport: push_many against push"};
  app.option_defaults()->always_capture_default();
  Config cfg;
  const CLI::Validator at_least_a_group = laminar::bench::at_least(kGroup);
  app.add_option("--count", cfg.count, "trajectories a run, rounded down to a multiple of 8")->check(at_least_a_group);
  app.add_option("--fsync-count", cfg.fsync_count, "trajectories a run into the wal_fsync queue, as --count")
      ->check(at_least_a_group);
  app.add_option("--threads", cfg.threads, "the child's pushing threads")->check(laminar::bench::positive());
  app.add_option("--repeats", cfg.repeats, "timed runs of each")->check(laminar::bench::positive());
  app.add_option("--wal-dir", cfg.wal_dir, "directory of the wal_fsync queue's log")->check(CLI::ExistingDirectory);
  // The pushing child this bench starts of itself; the empty group keeps it out of --help.
  CLI::App* produce_mode = app.add_subcommand("produce", "push COUNT trajectories from FIRST to ADDRESS")->group("");
  std::string child_address, child_mode;
  std::uint64_t child_first = 0;
  std::size_t child_count = 0, child_threads = 0;
  produce_mode->add_option("address", child_address)->required();
  produce_mode->add_option("mode", child_mode)->required()->check(CLI::IsMember({"one", "many"}));
  produce_mode->add_option("first", child_first)->required();
  produce_mode->add_option("count", child_count)->required()->check(laminar::bench::positive());
  produce_mode->add_option("threads", child_threads)->required()->check(laminar::bench::positive());
  CLI11_PARSE(app, argc, argv);
  if (produce_mode->parsed()) return produce(child_address, child_mode, child_first, child_count, child_threads);
  cfg.count -= cfg.count % kGroup;
  cfg.fsync_count -= cfg.fsync_count % kGroup;
  std::printf("# a child process pushes over the transport from %zu threads; %zu trajectories per run (%zu "
              "with wal_fsync), %d runs each, alternating\n",
              cfg.threads, cfg.count, cfg.fsync_count, cfg.repeats);

  laminar::TrajectoryQueueOptions opt;
  opt.group_timeout = std::chrono::seconds(60);
  const std::string wal_path = cfg.wal_dir + "/laminar_remote_bench_" + std::to_string(::getpid()) + ".wal";
  std::filesystem::remove(wal_path);
  laminar::TrajectoryQueueOptions wal_opt = opt;
  wal_opt.wal_path = wal_path;
  wal_opt.wal_fsync = true;
  std::vector<double> one, many, one_sync, many_sync;
  {
    Served plain(opt);
    Served synced(wal_opt);
    std::uint64_t next = 1;
    auto timed = [&](const Served& s, const char* mode, std::size_t n) {
      const double secs = run_child(s.address(), mode, next, n, cfg.threads);
      next += n;
      return secs;
    };
    timed(plain, "one", cfg.count);  // warm-up
    timed(plain, "many", cfg.count);
    for (int r = 0; r < cfg.repeats; ++r) {
      one.push_back(timed(plain, "one", cfg.count));
      many.push_back(timed(plain, "many", cfg.count));
      one_sync.push_back(timed(synced, "one", cfg.fsync_count));
      many_sync.push_back(timed(synced, "many", cfg.fsync_count));
    }
  }
  std::filesystem::remove(wal_path);
  auto rate = [](std::vector<double> secs, std::size_t n) {
    std::sort(secs.begin(), secs.end());
    return double(n) / secs[secs.size() / 2];
  };
  laminar::bench::require_stable_baseline("remote_push_wal_fsync", one_sync);
  laminar::bench::require_stable_baseline("remote_push", one);
  laminar::bench::report_throughput("remote_push_many_wal_fsync", "trajectories/s",
                                    rate(many_sync, cfg.fsync_count), "remote_push_wal_fsync",
                                    rate(one_sync, cfg.fsync_count));
  laminar::bench::report_throughput("remote_push_many", "trajectories/s", rate(many, cfg.count), "remote_push",
                                    rate(one, cfg.count));
  return 0;
}
