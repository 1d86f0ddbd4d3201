#include "roles.h"

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

using async_grpo::RoleArgs;
using async_grpo::Settings;
using async_grpo::Woke;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

// An environment of its own, so a test reads only the variables it sets.
struct Env {
  std::map<std::string, std::string> vars;
  std::function<const char*(const char*)> fn() const {
    return [this](const char* name) -> const char* {
      auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    };
  }
};

fs::path scratch(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("laminar-roles-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

RoleArgs args(std::string role, std::string dir = "/tmp/run", std::string schedule = "laminar") {
  RoleArgs a;
  a.role = std::move(role);
  a.dir = std::move(dir);
  a.run_schedule = std::move(schedule);
  return a;
}

RoleArgs auto_role() { return args("auto"); }

}  // namespace

TEST_CASE("roles: rank 0 is the actor, then the relays, then the rollout workers") {
  Settings s;
  s.workers = 3;
  s.relays = 1;
  Env env{{{"SLURM_NTASKS", "5"}, {"LAMINAR_TOKEN", "a-token-of-sixteen-bytes"}}};
  const std::vector<std::pair<std::string, int>> want = {{"actor", 0}, {"relay", 0}, {"rollout", 0}, {"rollout", 1},
                                                         {"rollout", 2}};
  for (int rank = 0; rank < 5; ++rank) {
    env.vars["SLURM_PROCID"] = std::to_string(rank);
    RoleArgs a = auto_role();
    REQUIRE(async_grpo::assign_role(s, a, env.fn()).ok());
    CHECK(a.role == want[std::size_t(rank)].first);
    CHECK(a.index == want[std::size_t(rank)].second);
    CHECK(a.token == "a-token-of-sixteen-bytes");
  }
  // torchrun's variables when Slurm's are absent; flags over both.
  Env torchrun{{{"RANK", "4"}, {"WORLD_SIZE", "5"}, {"LAMINAR_TOKEN", "a-token-of-sixteen-bytes"}}};
  RoleArgs a = auto_role();
  REQUIRE(async_grpo::assign_role(s, a, torchrun.fn()).ok());
  CHECK(a.role == "rollout");
  CHECK(a.index == 2);
  a = auto_role();
  a.rank = 1;
  REQUIRE(async_grpo::assign_role(s, a, torchrun.fn()).ok());
  CHECK(a.role == "relay");
}

TEST_CASE("roles: what does not fit is refused, naming it", "[bad-input]") {
  Settings s;
  s.workers = 3;
  s.relays = 1;
  auto refused = [&](RoleArgs a, const Env& env, const std::string& what) {
    const laminar::Status st = async_grpo::assign_role(s, a, env.fn());
    REQUIRE_FALSE(st.ok());
    CHECK(st.code() == laminar::StatusCode::kInvalidArgument);
    CHECK_THAT(st.message(), Catch::Contains(what));
  };
  const std::string token = "a-token-of-sixteen-bytes";
  refused(auto_role(), Env{{{"LAMINAR_TOKEN", token}}}, "--rank or $SLURM_PROCID or $RANK");
  refused(auto_role(), Env{{{"SLURM_PROCID", "x1"}, {"SLURM_NTASKS", "5"}}}, "$SLURM_PROCID is 'x1'");
  refused(auto_role(), Env{{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"LAMINAR_TOKEN", token}}}, "the world is 4");
  refused(auto_role(), Env{{{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "5"}, {"LAMINAR_TOKEN", token}}}, "rank 5");
  refused(auto_role(), Env{{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "5"}}}, "no cluster token");
  RoleArgs a = auto_role();
  a.run_schedule = "compare";
  refused(a, Env{{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "5"}, {"LAMINAR_TOKEN", token}}}, "not 'compare'");
  a = auto_role();
  a.dir.clear();
  refused(a, Env{{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "5"}, {"LAMINAR_TOKEN", token}}}, "--dir");
  a = args("rollout");
  a.index = 3;
  refused(a, Env{{{"LAMINAR_TOKEN", token}}}, "rollout index 3 with --workers 3");
  a = args("actor");
  a.token_file = "/nonexistent/token";
  refused(a, Env{}, "--token-file /nonexistent/token");
  a = auto_role();
  a.resume = true;
  refused(a, Env{{{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "5"}, {"LAMINAR_TOKEN", token}}},
          "--resume restarts the actor, and this process is a relay");
}

TEST_CASE("roles: the token comes from --token-file before the environment") {
  const fs::path dir = scratch("token");
  std::ofstream(dir / "token") << "from-the-file-0123456789\n";
  Settings s;
  RoleArgs a = args("actor", dir.string(), "sync");
  a.token_file = (dir / "token").string();
  REQUIRE(async_grpo::assign_role(s, a, Env{{{"LAMINAR_TOKEN", "from-the-environment"}}}.fn()).ok());
  CHECK(a.token == "from-the-file-0123456789");
  fs::remove_all(dir);
}

TEST_CASE("roles: --host auto is an address of this machine") {
  CHECK(async_grpo::listen_host("10.1.2.3").value() == "10.1.2.3");
  auto host = async_grpo::listen_host("auto");
  // A machine without a network has none, and says so.
  if (!host.ok()) {
    CHECK(host.status().code() == laminar::StatusCode::kNotFound);
    return;
  }
  CHECK(host->find('.') != std::string::npos);
  CHECK(host->rfind("127.", 0) != 0);
}

TEST_CASE("roles: a process waiting for the others wakes when their files appear") {
  const fs::path dir = scratch("wait");
  const std::vector<std::string> names = {"actor.addr", "relay-0.addr"};
  CHECK(async_grpo::wait_for_files(dir, names, 50ms) == Woke::kTimeout);
  std::thread writer([&] {
    std::this_thread::sleep_for(100ms);  // the other processes start later
    REQUIRE(async_grpo::write_address(dir, "actor", "127.0.0.1:1").ok());
    REQUIRE(async_grpo::write_address(dir, "relay-0", "127.0.0.1:2").ok());
  });
  const auto start = std::chrono::steady_clock::now();
  CHECK(async_grpo::wait_for_files(dir, names, 60s) == Woke::kFiles);
  // Woken by the writes, not by its deadline.
  CHECK(std::chrono::steady_clock::now() - start < 30s);
  writer.join();

  Settings s;
  s.relays = 1;
  RoleArgs a = args("rollout", dir.string());
  REQUIRE(async_grpo::find_peers(s, a, 1s).ok());
  CHECK(a.actor == "127.0.0.1:1");
  CHECK(a.relays == std::vector<std::string>{"127.0.0.1:2"});
  s.relays = 2;
  RoleArgs b = args("rollout", dir.string());
  const laminar::Status missing = async_grpo::find_peers(s, b, 50ms);
  CHECK(missing.code() == laminar::StatusCode::kDeadlineExceeded);
  CHECK_THAT(missing.message(), Catch::Contains("relay-1.addr"));
  fs::remove_all(dir);
}
