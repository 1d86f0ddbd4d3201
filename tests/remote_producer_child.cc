// The rollout side of remote_trajectory_queue_test: connects to a TrajectoryQueueServer and pushes
// test_remote::make(id) from several threads sharing one RemoteProducer, printing "P id" for each
// trajectory the queue accepted. Even threads push one at a time, odd ones kPerPushMany with one
// push_many. The cluster token comes from LAMINAR_TEST_TOKEN.
//
//   remote_producer_child ADDRESS FIRST_ID COUNT THREADS
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "laminar/remote_trajectory_queue.h"
#include "remote_trajectory_protocol.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s ADDRESS FIRST_ID COUNT THREADS\n", argv[0]);
    return 2;
  }
  const std::uint64_t first = std::strtoull(argv[2], nullptr, 10);
  const std::uint64_t count = std::strtoull(argv[3], nullptr, 10);
  const int threads = std::atoi(argv[4]);
  laminar::TransportOptions o;
  const char* token = std::getenv("LAMINAR_TEST_TOKEN");
  o.cluster_token = token != nullptr ? token : "";
  auto transport = laminar::Transport::create(o);
  if (!transport.ok()) {
    std::fprintf(stderr, "producer: %s\n", transport.status().to_string().c_str());
    return 2;
  }
  auto producer = laminar::RemoteProducer::create(std::move(*transport), argv[1]);
  if (!producer.ok()) {
    std::fprintf(stderr, "producer: %s\n", producer.status().to_string().c_str());
    return 2;
  }
  constexpr std::size_t kPerPushMany = 3;
  std::atomic<int> failures{0};
  std::vector<std::thread> pool;
  for (int k = 0; k < threads; ++k) {
    pool.emplace_back([&, k] {
      const std::size_t per_call = k % 2 == 1 ? kPerPushMany : 1;
      const std::uint64_t step = std::uint64_t(threads);
      std::vector<laminar::Trajectory> ts;
      std::vector<std::uint64_t> ids;
      for (std::uint64_t id = first + std::uint64_t(k); id < first + count;) {
        ts.clear();
        ids.clear();
        for (; ids.size() < per_call && id < first + count; id += step) {
          ids.push_back(id);
          ts.push_back(laminar::test_remote::make(id));
        }
        std::vector<laminar::Status> st;
        if (per_call == 1) {
          st.push_back((*producer)->push(std::move(ts[0])));
        } else {
          st = (*producer)->push_many(ts);
        }
        std::string lines;
        for (std::size_t i = 0; i < ids.size(); ++i) {
          if (!st[i].ok()) {
            std::fprintf(stderr, "producer: push %llu: %s\n", static_cast<unsigned long long>(ids[i]),
                         st[i].to_string().c_str());
            ++failures;
            return;
          }
          lines.append("P ").append(std::to_string(ids[i])).push_back('\n');
        }
        if (::write(1, lines.data(), lines.size()) != ssize_t(lines.size())) std::_Exit(3);
      }
    });
  }
  for (auto& t : pool) t.join();
  return failures == 0 ? 0 : 1;
}
