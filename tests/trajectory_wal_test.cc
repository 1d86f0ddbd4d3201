#include "trajectory_wal.h"

#include <unistd.h>
#include <xxhash.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

using laminar::Trajectory;
using laminar::internal::TrajectoryWal;
using laminar::internal::WalRecordType;
using laminar::internal::WalRetireReason;

namespace {

Trajectory make_traj(std::uint64_t id) {
  Trajectory t;
  t.id = laminar::TrajectoryId(id);
  t.prompt_id = 100 + id;
  t.version = laminar::Version(3);
  t.prompt_tokens = {1, 2};
  t.response_tokens = {5, 6, 7};
  t.logprobs = {-0.25f, -0.5f, -1.0f};
  t.rewards = {0.5f};
  t.timings = {10, 20};
  return t;
}

std::string temp_path(const char* name) {
  return (std::filesystem::temp_directory_path() /
          (std::string("laminar_wal_") + name + "_" + std::to_string(::getpid())))
      .string();
}

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

}  // namespace

// Logs written by older builds must replay: a change here is a format change.
TEST_CASE("WAL: the bytes of every record type are pinned", "[wal][encoding]") {
  const std::string path = temp_path("pinned");
  std::filesystem::remove(path);
  {
    TrajectoryWal::Contents c;
    laminar::RecoveryReport report;
    auto wal = TrajectoryWal::open(path, false, c, report);
    REQUIRE(wal.ok());
    std::string payload;
    for (std::uint64_t id : {1, 2, 3}) {
      payload.clear();
      encode_trajectory(make_traj(id), payload);
      REQUIRE((*wal)->append(WalRecordType::kPush, payload).ok());
    }
    const std::vector<std::uint64_t> acked = {1, 3};
    REQUIRE((*wal)->append_retire(WalRetireReason::kAck, acked).ok());
    REQUIRE((*wal)->append_u64(WalRecordType::kGroupClosed, 77).ok());
    REQUIRE((*wal)->append_u64(WalRecordType::kVersion, 5).ok());
  }
  const std::string file = read_all(path);
  CHECK(file.size() == 16 + 3 * (24 + 80 + 4 * (2 + 3 + 3 + 1)) + (24 + 32) + 2 * (24 + 8));
  CHECK(XXH3_64bits(file.data(), file.size()) == 0x2a5c6b51b61e5b76ull);

  TrajectoryWal::Contents c;
  laminar::RecoveryReport report;
  auto wal = TrajectoryWal::open(path, false, c, report);
  REQUIRE(wal.ok());
  CHECK(report.tail.ok());
  CHECK(report.records == 6);
  REQUIRE(c.live.size() == 1);
  CHECK(c.live[0] == make_traj(2));
  CHECK(c.retired_ids == std::vector<std::uint64_t>{1, 3});
  CHECK(c.closed_groups == std::vector<std::uint64_t>{77});
  CHECK(c.newest == laminar::Version(5));
  CHECK(c.retired == 2);
  std::filesystem::remove(path);
}
