// The rollout worker process of rollout_dispatcher_test: connects a DispatchClient to the actor's
// RolloutDispatcher, takes up to SLOTS samples for weights VERSION and prints "S id seed" for each. It
// reports the first DONE of them finished ("D id": the test completes them as the actor would once
// its queue took them), asks again holding the rest, prints "READY", and then waits to be killed.
// The cluster token comes from LAMINAR_TEST_TOKEN.
//
//   rollout_dispatcher_child ADDRESS WORKER VERSION SLOTS DONE
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "laminar/rollout_dispatcher.h"

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s ADDRESS WORKER VERSION SLOTS DONE\n", argv[0]);
    return 2;
  }
  const auto worker = laminar::WorkerId(std::uint32_t(std::strtoul(argv[2], nullptr, 10)));
  const auto version = laminar::Version(std::strtoull(argv[3], nullptr, 10));
  const auto slots = std::uint32_t(std::strtoul(argv[4], nullptr, 10));
  const auto done = std::size_t(std::strtoul(argv[5], nullptr, 10));
  laminar::TransportOptions o;
  const char* token = std::getenv("LAMINAR_TEST_TOKEN");
  o.cluster_token = token != nullptr ? token : "";
  auto transport = laminar::Transport::create(o);
  if (!transport.ok()) {
    std::fprintf(stderr, "child: %s\n", transport.status().to_string().c_str());
    return 2;
  }
  auto client = laminar::DispatchClient::create(std::move(*transport), {.worker = worker, .server = argv[1]});
  if (!client.ok()) {
    std::fprintf(stderr, "child: %s\n", client.status().to_string().c_str());
    return 2;
  }
  laminar::Result<laminar::Grant> g = (*client)->request({.version = version, .free_slots = slots});
  if (!g.ok() || g->kind != laminar::GrantKind::kWork) {
    std::fprintf(stderr, "child: no work: %s\n", g.status().to_string().c_str());
    return 1;
  }
  std::vector<laminar::TrajectoryId> held;
  for (std::size_t i = 0; i < g->samples.size(); ++i) {
    const laminar::Sample& s = g->samples[i];
    std::printf("S %llu %llu\n", static_cast<unsigned long long>(s.id.value()),
                static_cast<unsigned long long>(s.seed));
    if (i < done) {
      std::printf("D %llu\n", static_cast<unsigned long long>(s.id.value()));
    } else {
      held.push_back(s.id);
    }
  }
  laminar::Result<laminar::Grant> again = (*client)->request({.version = version, .held = held});
  if (!again.ok()) {
    std::fprintf(stderr, "child: %s\n", again.status().to_string().c_str());
    return 1;
  }
  std::printf("READY\n");
  std::fflush(stdout);
  for (;;) ::pause();
}
