// The relay chain across real processes (examples/relay_server, started with laminar_test_support):
// actor + a chain of 4 relays + pullers with every byte checked, a relay killed mid-broadcast, a
// corrupt chunk, a late joiner, and a puller whose relay dies mid-pull resuming from another.
#include <catch2/catch.hpp>

#include <signal.h>

#include <chrono>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "expect_line.h"
#include "process.h"

using namespace std::chrono_literals;
using laminar::testing::ChildOptions;
using laminar::testing::ChildProcess;

namespace {

const std::string kToken = "relay-chain-test-token-0123456789";
constexpr int kMib = 16;
constexpr int kChunkKib = 256;
// relay_server's workload: kMib MiB of tensors plus one small tensor padded to 256 bytes.
constexpr std::uint64_t kChunks = ((std::uint64_t(kMib) << 20) + 256 + (kChunkKib << 10) - 1) / (kChunkKib << 10);

ChildProcess start(std::vector<std::string> args) {
  ChildOptions o;
  o.program = LAMINAR_RELAY_SERVER;
  o.args = {"--token", kToken, "--mib", std::to_string(kMib), "--chunk-kib", std::to_string(kChunkKib)};
  o.args.insert(o.args.end(), args.begin(), args.end());
  auto child = ChildProcess::spawn(std::move(o));
  INFO(child.status().to_string());
  REQUIRE(child.ok());
  return std::move(*child);
}

std::string expect_line(ChildProcess& child, const std::string& prefix, std::vector<std::string>* seen = nullptr) {
  return laminar::testing::expect_line(child, prefix, 30s, seen);
}

std::string listening(ChildProcess& c) { return expect_line(c, "listening "); }

// Stops a child with SIGTERM and returns its final "stats" line.
std::string stop(ChildProcess& c) {
  c.kill(SIGTERM);
  std::string stats = expect_line(c, "stats ");
  auto code = c.wait(10s);
  REQUIRE(code.ok());
  CHECK(*code == 0);
  return stats;
}

std::string received(std::uint64_t n) { return "received " + std::to_string(n) + " "; }

}  // namespace

TEST_CASE("actor, a chain of 4 relays and 2 pullers: every relay and puller gets every byte", "[relay_node]") {
  ChildProcess actor = start({"--actor", "--versions", "2", "--interval-ms", "1500"});
  std::string up = listening(actor);
  std::vector<ChildProcess> relays;
  std::vector<std::string> addrs;
  for (int k = 0; k < 4; ++k) {
    relays.push_back(start({"--upstream", up}));
    up = listening(relays.back());
    addrs.push_back(up);
  }
  ChildProcess p_tail = start({"--pull", "--upstream", addrs[3], "--exit-after-version", "2"});
  ChildProcess p_mid = start({"--pull", "--upstream", addrs[1], "--exit-after-version", "2"});
  const std::string d1 = expect_line(actor, "published 1 ");
  const std::string d2 = expect_line(actor, "published 2 ");
  for (auto& r : relays) {
    // v1 may have been published before this relay subscribed; it then starts at v2.
    std::vector<std::string> seen;
    CHECK(expect_line(r, "committed 2 ", &seen) == d2);
    for (const auto& l : seen) {
      if (l.rfind("committed 1 ", 0) == 0) CHECK(l.substr(12) == d1);
    }
  }
  for (ChildProcess* p : {&p_tail, &p_mid}) {
    CHECK(expect_line(*p, "pulled 2 ") == "ok");
    auto code = p->wait(10s);
    REQUIRE(code.ok());
    CHECK(*code == 0);
  }
  for (auto& r : relays) stop(r);
  stop(actor);
}

TEST_CASE("a relay killed mid-broadcast: the chain re-forms and the version still reaches everyone",
          "[relay_node]") {
  ChildProcess actor = start({"--actor", "--versions", "1"});
  const std::string a = listening(actor);
  const std::string digest = expect_line(actor, "published 1 ");
  ChildProcess r1 = start({"--upstream", a});
  const std::string a1 = listening(r1);
  // r2 hangs after storing a third of the version, as a wedged relay would, and is then killed.
  ChildProcess r2 = start({"--upstream", a1, "--stall-after", std::to_string(kChunks / 3)});
  const std::string a2 = listening(r2);
  ChildProcess r3 = start({"--upstream", a2, "--upstream", a1});
  const std::string a3 = listening(r3);
  ChildProcess r4 = start({"--upstream", a3});
  listening(r4);
  CHECK(expect_line(r1, "committed 1 ") == digest);
  CHECK(expect_line(r3, "upstream ") == a2);
  std::this_thread::sleep_for(300ms);  // r3 has what r2 forwarded before hanging
  r2.kill(SIGKILL);
  CHECK(expect_line(r3, "lost ") == a2);
  CHECK(expect_line(r3, "upstream ") == a1);
  CHECK(expect_line(r3, "committed 1 ") == digest);
  CHECK(expect_line(r4, "committed 1 ") == digest);
  // r3 resumed: it stored every chunk exactly once across both upstreams.
  CHECK_THAT(stop(r3), Catch::StartsWith(received(kChunks)) && Catch::EndsWith("failovers 1"));
  stop(r4);
  stop(r1);
  stop(actor);
}

TEST_CASE("a corrupt chunk on the wire is refused, resent, and never served", "[relay_node]") {
  ChildProcess actor = start({"--actor", "--versions", "1"});
  const std::string a = listening(actor);
  const std::string digest = expect_line(actor, "published 1 ");
  ChildProcess r1 = start({"--upstream", a, "--corrupt", "1:5"});
  const std::string a1 = listening(r1);
  ChildProcess r2 = start({"--upstream", a1});
  const std::string a2 = listening(r2);
  ChildProcess puller = start({"--pull", "--upstream", a2, "--exit-after-version", "1"});
  CHECK(expect_line(r2, "rejected ") == "1 5");
  CHECK(expect_line(r2, "committed 1 ") == digest);
  CHECK(expect_line(puller, "pulled 1 ") == "ok");
  REQUIRE(puller.wait(10s).ok());
  CHECK_THAT(stop(r1), Catch::Contains("resent 1 "));
  CHECK_THAT(stop(r2), Catch::StartsWith(received(kChunks)));
  stop(actor);
}

TEST_CASE("a relay that joins late gets the newest version", "[relay_node]") {
  ChildProcess actor = start({"--actor", "--versions", "3"});
  const std::string a = listening(actor);
  expect_line(actor, "published 1 ");
  expect_line(actor, "published 2 ");
  const std::string d3 = expect_line(actor, "published 3 ");
  ChildProcess late = start({"--upstream", a, "--exit-after-version", "3"});
  listening(late);
  std::vector<std::string> seen;
  CHECK(expect_line(late, "committed ", &seen) == "3 " + d3);  // its first version is the newest
  CHECK_THAT(expect_line(late, "stats "), Catch::StartsWith(received(kChunks)));
  REQUIRE(late.wait(10s).ok());
  stop(actor);
}

TEST_CASE("a puller whose relay dies mid-pull fails over and resumes from the last verified chunk",
          "[relay_node]") {
  ChildProcess actor = start({"--actor", "--versions", "1"});
  const std::string a = listening(actor);
  const std::string digest = expect_line(actor, "published 1 ");
  ChildProcess r1 = start({"--upstream", a});
  const std::string a1 = listening(r1);
  CHECK(expect_line(r1, "committed 1 ") == digest);
  ChildProcess r2 = start({"--upstream", a1, "--stall-after", std::to_string(kChunks / 2)});
  const std::string a2 = listening(r2);
  ChildProcess puller = start({"--pull", "--upstream", a2, "--upstream", a1});
  listening(puller);
  CHECK(expect_line(puller, "upstream ") == a2);
  // Also stop the puller process itself for a moment mid-transfer; it carries on when continued.
  std::this_thread::sleep_for(200ms);
  puller.kill(SIGSTOP);
  std::this_thread::sleep_for(300ms);
  puller.kill(SIGCONT);
  r2.kill(SIGKILL);
  CHECK(expect_line(puller, "lost ") == a2);
  CHECK(expect_line(puller, "upstream ") == a1);
  CHECK(expect_line(puller, "pulled 1 ") == "ok");
  CHECK_THAT(stop(puller), Catch::StartsWith(received(kChunks)) && Catch::EndsWith("failovers 1"));
  stop(r1);
  stop(actor);
}
