// queue_server: the actor's side of the experience path across processes, and a rollout that feeds
// it. One process serves a TrajectoryQueue on its Transport and trains on it (a consumer thread
// pops whole GRPO groups and acks them); a producer process pushes trajectories into it. Lines are
// printed one at a time so a script or test can follow.
//
//   queue_server --token T --port 4100                       # serve; prints "listening ADDR"
//   queue_server --token T --port 4100 --wal /data/queue.wal # ... surviving its own crash
//   queue_server --token T --produce 127.0.0.1:4100 --count 256 --first-id 1000
//
// Serving prints "listening ADDR", then "trained N" each time the consumer has acked N more
// trajectories (--report-every), and at exit "stats {...}" with the queue's and the server's stats.
// Ends on SIGTERM / SIGINT. Producing prints "pushed N in MS ms" and exits 0 when every push was
// accepted, 1 otherwise (each refusal is printed as "refused ID STATUS").
#include <pthread.h>
#include <signal.h>

#include <CLI/CLI.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "laminar/remote_trajectory_queue.h"
#include "laminar/trajectory_queue.h"
#include "laminar/transport.h"

namespace {

using namespace std::chrono_literals;

// What stops the server: blocked in every thread, taken by sigwait.
const sigset_t stop_signals = [] {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}();

void say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

int fail(const char* what, const laminar::Status& st) {
  std::fprintf(stderr, "queue_server: %s: %s\n", what, st.to_string().c_str());
  return 1;
}

// Trajectory `id` of a group of `group` samples, with a response of 1-4k tokens as rollouts make.
laminar::Trajectory make(std::uint64_t id, std::uint32_t group) {
  laminar::Trajectory t;
  t.id = laminar::TrajectoryId(id);
  t.prompt_id = laminar::PromptId(id / group);
  t.group_id = laminar::GroupId(id / group);
  t.group_size = group;
  t.sample_index = std::uint32_t(id % group);
  t.version = laminar::Version(1);
  t.prompt_tokens.assign(16, 1);
  const std::size_t n = 1000 + (id * 7919) % 3000;
  t.response_tokens.resize(n);
  t.logprobs.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    t.response_tokens[i] = std::int32_t((id * 31 + i) % 50000);
    t.logprobs[i] = -float((id + i) % 97) / 16.0f;
  }
  t.rewards = {float(id % 2)};
  return t;
}

int produce(std::shared_ptr<laminar::Transport> transport, const std::string& address, std::uint64_t first,
            std::uint64_t count, std::uint32_t group) {
  const auto start = std::chrono::steady_clock::now();
  auto producer = laminar::RemoteProducer::create(std::move(transport), address);
  if (!producer.ok()) return fail("connect", producer.status());
  std::vector<laminar::Trajectory> ts;
  for (std::uint64_t id = first; id < first + count; ++id) ts.push_back(make(id, group));
  const std::vector<laminar::Status> st = (*producer)->push_many(ts);
  int refused = 0;
  for (std::size_t i = 0; i < st.size(); ++i) {
    if (st[i].ok()) continue;
    ++refused;
    say("refused " + std::to_string(first + i) + " " + st[i].to_string());
  }
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  say("pushed " + std::to_string(count - std::uint64_t(refused)) + " in " + std::to_string(ms.count()) + " ms");
  return refused == 0 ? 0 : 1;
}

int serve(std::shared_ptr<laminar::Transport> transport, std::uint16_t port, const std::string& wal,
          std::uint64_t report_every) {
  laminar::TrajectoryQueueOptions qo;
  qo.wal_path = wal;
  qo.group_timeout = 30s;
  auto queue = laminar::TrajectoryQueue::create(qo);
  if (!queue.ok()) return fail("queue", queue.status());
  std::shared_ptr<laminar::TrajectoryQueue> q = std::move(*queue);
  if (laminar::Status st = q->publish_version(laminar::Version(1)); !st.ok()) return fail("publish_version", st);
  auto listened = transport->listen("127.0.0.1", port);
  if (!listened.ok()) return fail("listen", listened.status());
  auto server = laminar::TrajectoryQueueServer::create(transport, q);
  if (!server.ok()) return fail("server", server.status());
  say("listening " + *listened);

  // The trainer: pops what is ready and acks it, as a training step would after its update.
  std::atomic<std::uint64_t> trained{0};
  std::thread trainer([&] {
    laminar::BatchSpec spec;
    spec.max_trajectories = 64;
    spec.wait = laminar::kForever;  // close() ends the wait
    spec.consumer_version = laminar::Version(1);
    std::uint64_t reported = 0;
    for (;;) {
      laminar::Result<laminar::Batch> b = q->pop_batch(spec);
      if (!b.ok()) {
        if (b.status().code() != laminar::StatusCode::kCancelled) say("trainer: " + b.status().to_string());
        break;  // kCancelled: closed
      }
      const std::size_t n = b->size();
      if (!q->ack(b->id()).ok()) continue;
      trained += n;
      if (trained - reported >= report_every) {
        reported = trained;
        say("trained " + std::to_string(reported));
      }
    }
  });
  // Sleeps until SIGTERM or SIGINT, which main() blocked in every thread so that this one takes it.
  int signal = 0;
  (void)sigwait(&stop_signals, &signal);
  q->close();
  trainer.join();
  say("stats {\"queue\": " + q->stats().to_json() + ", \"server\": " + (*server)->stats().to_json() + "}");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Serves a TrajectoryQueue to remote producers (and trains on it), or produces into one"};
  std::string token, produce_to, wal;
  std::uint16_t port = 0;
  std::uint64_t count = 64, first_id = 0, report_every = 64;
  std::uint32_t group = 4;
  app.add_option("--token", token, "cluster token shared by every peer")->required();
  app.add_option("--port", port, "port to serve on (0: any free one)");
  app.add_option("--wal", wal, "write-ahead log of the queue (serving)");
  app.add_option("--report-every", report_every, "print \"trained N\" every this many acked trajectories")
      ->check(CLI::PositiveNumber);
  app.add_option("--produce", produce_to, "push into the queue server at this address instead of serving");
  app.add_option("--count", count, "trajectories to push (producing)")->check(CLI::PositiveNumber);
  app.add_option("--first-id", first_id,
                 "id of the first trajectory pushed (producing); a multiple of --group, so groups are whole");
  app.add_option("--group", group, "GRPO group size; --count should be a multiple of it too")
      ->check(CLI::Range(1, 1 << 16));
  CLI11_PARSE(app, argc, argv);
  if (produce_to.empty()) pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);  // before any thread starts

  laminar::TransportOptions to;
  to.cluster_token = token;
  to.max_inbox_bytes = 0;  // only laminar's handlers run here: nothing waits for receive()
  auto transport = laminar::Transport::create(to);
  if (!transport.ok()) return fail("transport", transport.status());
  std::shared_ptr<laminar::Transport> shared = std::move(*transport);
  if (!produce_to.empty()) return produce(std::move(shared), produce_to, first_id, count, group);
  return serve(std::move(shared), port, wal, report_every);
}
