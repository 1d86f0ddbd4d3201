// The rollout side of remote_trajectory_queue_test: connects to a TrajectoryQueueServer and pushes
// test_remote::make(id) from several threads sharing one RemoteProducer, printing "P id" after each
// push the queue accepted. The cluster token comes from LAMINAR_TEST_TOKEN.
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
  auto ep = transport->connect(argv[1]);
  if (!ep.ok()) {
    std::fprintf(stderr, "producer: %s\n", ep.status().to_string().c_str());
    return 2;
  }
  auto producer = laminar::RemoteProducer::connect(*ep);
  if (!producer.ok()) {
    std::fprintf(stderr, "producer: %s\n", producer.status().to_string().c_str());
    return 2;
  }
  std::atomic<int> failures{0};
  std::vector<std::thread> pool;
  for (int k = 0; k < threads; ++k) {
    pool.emplace_back([&, k] {
      for (std::uint64_t id = first + std::uint64_t(k); id < first + count; id += std::uint64_t(threads)) {
        laminar::Status st = (*producer)->push(laminar::test_remote::make(id));
        if (!st.ok()) {
          std::fprintf(stderr, "producer: push %llu: %s\n", static_cast<unsigned long long>(id),
                       st.to_string().c_str());
          ++failures;
          return;
        }
        std::string line = "P ";
        line.append(std::to_string(id)).push_back('\n');
        if (::write(1, line.data(), line.size()) != ssize_t(line.size())) std::_Exit(3);
      }
    });
  }
  for (auto& t : pool) t.join();
  return failures == 0 ? 0 : 1;
}
