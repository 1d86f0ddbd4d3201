// The run across emulated hosts: the actor, the relay and the rollout workers each in a network
// namespace of their own (tests/support/process.h's NetnsSwitch), every link limited to 1 Gbit/s,
// UCX over tcp only, each process started on its own (--role, --host, the run's directory). The
// relay is SIGKILLed once training is under way: the workers fail over to the actor and keep
// pulling. Root only; skipped with LAMINAR_SKIP_CODE otherwise.
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "process.h"

using laminar::testing::ChildProcess;
using laminar::testing::NetnsSwitch;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

// "version hash" lines: the actor's published.txt, each worker's weights-rollout-<i>.txt.
std::map<std::uint64_t, std::string> hashes(const fs::path& file) {
  std::map<std::uint64_t, std::string> out;
  std::ifstream f(file);
  std::uint64_t v;
  std::string h;
  while (f >> v >> h) out[v] = h;
  return out;
}

}  // namespace

TEST_CASE("async_grpo across hosts: three namespaces on 1 Gbit/s links, the relay killed mid-run") {
  auto net = NetnsSwitch::create("lmag", 3, 1000);
  if (!net.ok()) {
    std::printf("skipped: %s\n", net.status().to_string().c_str());
    std::exit(LAMINAR_SKIP_CODE);
  }
  const fs::path dir = fs::temp_directory_path() / ("async-grpo-hosts-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const int workers = 3;
  const std::vector<std::string> run = {"--dir", dir.string(), "--schedule", "laminar", "--workers",
                                        std::to_string(workers), "--relays", "1", "--steps", "12",
                                        "--warmup-steps", "20", "--groups-per-step", "4"};
  auto start = [&](std::vector<std::string> args, int host) {
    args.insert(args.end(), {"--host", net->address(host)});
    args.insert(args.end(), run.begin(), run.end());
    auto child = ChildProcess::spawn({.program = ASYNC_GRPO_BINARY,
                                      .args = args,
                                      .env = {{"LAMINAR_TOKEN", "async-grpo-hosts-test-token"}},
                                      .netns = net->name(host),
                                      .force_tcp = true});
    REQUIRE(child.ok());
    return std::move(*child);
  };
  ChildProcess actor = start({"--role", "actor"}, 0);
  ChildProcess relay = start({"--role", "relay", "--index", "0"}, 1);
  std::vector<ChildProcess> rollouts;
  for (int w = 0; w < workers; ++w) rollouts.push_back(start({"--role", "rollout", "--index", std::to_string(w)}, 2));

  // The relay dies once the actor has trained three steps, while versions keep coming.
  std::vector<std::string> checks;
  bool killed = false;
  for (;;) {
    auto line = actor.read_line(120s);
    REQUIRE(line.ok());
    if (!killed && line->rfind("progress 3 ", 0) == 0) {
      relay.kill(SIGKILL);
      killed = true;
    }
    if (line->rfind("check ", 0) == 0) checks.push_back(*line);
    if (line->rfind("steps ", 0) == 0) break;
  }
  REQUIRE(killed);
  for (ChildProcess& r : rollouts) CHECK(r.wait(120s).value() == 0);
  CHECK(actor.wait(120s).value() == 0);
  CHECK(relay.wait(10s).value() == 128 + SIGKILL);

  for (const std::string& c : checks) {
    INFO(c);
    CHECK(c.find(" ok ") != std::string::npos);
  }
  CHECK(checks.size() >= 5);
  // Every version a worker pulled, before and after the relay died, is the actor's bit for bit.
  // The relay died with version 4 published (the first is published before step 1): each worker
  // takes new samples only on the newest weights, so each pulled a later one, from the actor.
  const auto published = hashes(dir / "published.txt");
  REQUIRE_FALSE(published.empty());
  for (int w = 0; w < workers; ++w) {
    const auto pulled = hashes(dir / ("weights-rollout-" + std::to_string(w) + ".txt"));
    INFO("rollout-" << w);
    REQUIRE_FALSE(pulled.empty());
    for (const auto& [v, h] : pulled) CHECK(published.at(v) == h);
    CHECK(pulled.rbegin()->first > 4);
  }
  fs::remove_all(dir);
}
