#include "trajectory_wal.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <xxhash.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "byte_codec.h"

using laminar::StatusCode;
using laminar::Trajectory;
using laminar::internal::ByteWriter;
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

void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// A log's file header, then each record framed as the WAL frames it.
std::string log_of(const std::vector<std::pair<WalRecordType, std::string>>& records) {
  std::string file("LAMWAL01\x01\0\0\0\0\0\0\0", 16);
  ByteWriter w(file);
  for (const auto& [type, payload] : records) {
    w.u32(0x52574D4Cu);
    w.u32(std::uint32_t(type));
    w.u64(payload.size());
    w.u64(TrajectoryWal::checksum(type, payload));
    w.bytes(payload);
  }
  return file;
}

std::string u64_payload(std::uint64_t v) {
  std::string p;
  ByteWriter(p).u64(v);
  return p;
}

std::string retire_payload(std::uint8_t reason, std::uint64_t count, const std::vector<std::uint64_t>& ids) {
  std::string p;
  ByteWriter w(p);
  w.u8(reason);
  w.bytes(std::string(7, '\0'));
  w.u64(count);
  w.array(std::span<const std::uint64_t>(ids));
  return p;
}

struct Opened {
  laminar::Status status;
  TrajectoryWal::Contents contents;
  laminar::RecoveryReport report;
};

Opened open_log(const std::string& path) {
  Opened o;
  auto wal = TrajectoryWal::open(path, false, o.contents, o.report);
  o.status = wal.status();
  return o;
}

void expect_code(const laminar::Status& st, StatusCode code, const std::string& needle) {
  INFO(st.to_string());
  CHECK(st.code() == code);
  CHECK_THAT(st.message(), Catch::Contains(needle));
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

TEST_CASE("WAL: a log cut at any byte replays its whole records and trims the rest", "[wal][bad-input]") {
  const std::string path = temp_path("cut");
  std::string push;
  encode_trajectory(make_traj(1), push);
  const std::string full = log_of({{WalRecordType::kVersion, u64_payload(4)},
                                   {WalRecordType::kPush, push},
                                   {WalRecordType::kRetire, retire_payload(0, 1, {1})},
                                   {WalRecordType::kGroupClosed, u64_payload(9)}});
  const std::vector<std::size_t> ends = {16, 16 + 32, 16 + 32 + 24 + push.size(), full.size() - 32, full.size()};
  for (std::size_t n = 0; n <= full.size(); ++n) {
    INFO("first " << n << " bytes");
    write_all(path, full.substr(0, n));
    const Opened o = open_log(path);
    REQUIRE(o.status.ok());
    std::size_t whole = 0;
    while (whole + 1 < ends.size() && ends[whole + 1] <= n) ++whole;
    CHECK(o.report.records == whole);
    const bool clean = n == 0 || n == ends[whole];
    CHECK(o.report.tail.ok() == clean);
    if (n >= 16) CHECK(std::filesystem::file_size(path) == ends[whole]);
    CHECK(o.contents.live.size() == (whole == 2 ? 1u : 0u));
  }
  std::filesystem::remove(path);
}

TEST_CASE("WAL: a malformed record names the record, the field and its offset", "[wal][bad-input]") {
  const std::string path = temp_path("malformed");
  auto refused = [&](const std::string& file) {
    write_all(path, file);
    return open_log(path).status;
  };
  auto tail = [&](const std::string& file) {
    write_all(path, file);
    Opened o = open_log(path);
    REQUIRE(o.status.ok());
    return o.report.tail;
  };
  const std::string wal = "WAL " + path;

  expect_code(refused(log_of({{WalRecordType::kRetire, retire_payload(9, 1, {1})}})), StatusCode::kDataLoss,
              wal + ": retire record: reason 9 is not a WalRetireReason at offset 40");
  expect_code(refused(log_of({{WalRecordType::kRetire, retire_payload(0, 3, {1, 2})}})), StatusCode::kDataLoss,
              wal + ": retire record: ids cut short at offset 56 (16 of 3 x 8 bytes)");
  expect_code(refused(log_of({{WalRecordType::kRetire, retire_payload(0, ~0ull, {1})}})), StatusCode::kDataLoss,
              "ids cut short at offset 56 (8 of 18446744073709551615 x 8 bytes)");
  std::string padded = retire_payload(0, 1, {1});
  padded[3] = 1;
  expect_code(refused(log_of({{WalRecordType::kRetire, padded}})), StatusCode::kDataLoss,
              "retire record: nonzero padding at offset 41");
  expect_code(refused(log_of({{WalRecordType::kVersion, u64_payload(3) + "x"}})), StatusCode::kDataLoss,
              wal + ": version record: 1 trailing bytes at offset 48");
  expect_code(refused(log_of({{WalRecordType::kGroupClosed, "abc"}})), StatusCode::kDataLoss,
              "group-closed record: group id cut short at offset 40 (3 of 8 bytes)");
  expect_code(refused(log_of({{WalRecordType::kPush, "abc"}})), StatusCode::kDataLoss,
              wal + ": push record at offset 16: encoded trajectory: format cut short at offset 0");

  std::string file = log_of({{WalRecordType::kVersion, u64_payload(3)}});
  file[8] = 7;
  expect_code(refused(file), StatusCode::kFailedPrecondition, wal + ": written in format 7, which this build does not read");

  // The last record's header: damage there is a torn tail, cut and reported.
  const std::string good = log_of({{WalRecordType::kVersion, u64_payload(3)}});
  const std::string two =
      log_of({{WalRecordType::kVersion, u64_payload(3)}, {WalRecordType::kVersion, u64_payload(4)}});
  std::string bad_type = two;
  bad_type[good.size() + 4] = 9;
  expect_code(tail(bad_type), StatusCode::kDataLoss, wal + ": unknown record type 9 at offset 52");
  std::string huge = two;
  std::memset(huge.data() + good.size() + 8, 0xff, 8);
  expect_code(tail(huge), StatusCode::kDataLoss, "implausible record length 18446744073709551615 at offset 56");
  expect_code(tail(good + "LMWR"), StatusCode::kDataLoss, "record header cut short at offset 48 (4 of 24 bytes)");
  std::filesystem::remove(path);
}

TEST_CASE("WAL: open refuses what is not a regular file, naming the path and what it is", "[wal][bad-input]") {
  const std::string path = temp_path("kind");
  std::filesystem::remove_all(path);

  REQUIRE(std::filesystem::create_directory(path));
  expect_code(open_log(path).status, StatusCode::kFailedPrecondition, "WAL " + path + ": is a directory");
  std::filesystem::remove(path);

  // A FIFO with no writer: open must answer, not wait for one.
  REQUIRE(::mkfifo(path.c_str(), 0600) == 0);
  expect_code(open_log(path).status, StatusCode::kFailedPrecondition, "WAL " + path + ": is a FIFO");
  std::filesystem::remove(path);

  const int sock = ::socket(AF_UNIX, SOCK_STREAM, 0);
  REQUIRE(sock >= 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  REQUIRE(path.size() < sizeof(addr.sun_path));
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  REQUIRE(::bind(sock, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0);
  expect_code(open_log(path).status, StatusCode::kFailedPrecondition, "WAL " + path + ": is a socket");
  ::close(sock);
  std::filesystem::remove(path);

  expect_code(open_log("/dev/null").status, StatusCode::kFailedPrecondition, "WAL /dev/null: is a character device");
}

TEST_CASE("WAL: a file that is not a laminar WAL is refused and left as it was", "[wal][bad-input]") {
  const std::string path = temp_path("foreign");
  std::filesystem::remove(path);
  {
    const Opened fresh = open_log(path);
    REQUIRE(fresh.status.ok());
  }
  const std::string header = read_all(path);
  REQUIRE(header.size() == 16);

  // Short ones too: only a prefix of the header this build writes is taken as a log of its own.
  for (const std::string& foreign : {std::string("x"), std::string("hello"), std::string(15, '\0'),
                                     header.substr(0, 8) + std::string(3, '\xff'), std::string(16, '\0'),
                                     std::string("this is not a log at all")}) {
    INFO("file bytes: " << foreign);
    write_all(path, foreign);
    expect_code(open_log(path).status, StatusCode::kFailedPrecondition,
                "WAL " + path + ": not a laminar write-ahead log");
    CHECK(read_all(path) == foreign);
  }

  // An empty file is a new log; a prefix of the header is a creation cut short, started afresh.
  for (std::size_t n = 0; n < header.size(); ++n) {
    INFO("the header's first " << n << " bytes");
    write_all(path, header.substr(0, n));
    const Opened o = open_log(path);
    REQUIRE(o.status.ok());
    CHECK(o.report.replayed == (n > 0));
    CHECK(o.report.tail.ok() == (n == 0));
    CHECK(o.report.discarded_bytes == n);
    CHECK(read_all(path) == header);
  }
  std::filesystem::remove(path);
}
