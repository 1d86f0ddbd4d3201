#include "trajectory_wal.h"

#include <malloc.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "byte_codec.h"
#include "expect_code.h"

using laminar::StatusCode;
using laminar::Trajectory;
using laminar::internal::ByteWriter;
using laminar::internal::TrajectoryWal;
using laminar::internal::WalRecordType;
using laminar::internal::WalRetireReason;
using laminar::testing::expect_code;

// The heap bytes this process has in use, and their peak, counted by the replacements of the
// global allocation functions below: a test reads what a call allocated at most. (Its RSS would
// also count what the sanitizers hold back, and pages the allocator keeps.)
namespace {

std::atomic<std::size_t> heap_in_use{0};
std::atomic<std::size_t> heap_peak{0};

void* counted_alloc(std::size_t n) {
  void* p = std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  const std::size_t now = heap_in_use.fetch_add(malloc_usable_size(p)) + malloc_usable_size(p);
  std::size_t peak = heap_peak.load();
  while (now > peak && !heap_peak.compare_exchange_weak(peak, now)) {
  }
  return p;
}

void counted_free(void* p) noexcept {
  if (p == nullptr) return;
  heap_in_use.fetch_sub(malloc_usable_size(p));
  std::free(p);
}

void* counted_alloc_nothrow(std::size_t n) noexcept {
  try {
    return counted_alloc(n);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}

}  // namespace

void* operator new(std::size_t n) { return counted_alloc(n); }
void* operator new[](std::size_t n) { return counted_alloc(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return counted_alloc_nothrow(n); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return counted_alloc_nothrow(n); }
void operator delete(void* p) noexcept { counted_free(p); }
void operator delete[](void* p) noexcept { counted_free(p); }
void operator delete(void* p, std::size_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::size_t) noexcept { counted_free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { counted_free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { counted_free(p); }

namespace {

Trajectory make_traj(std::uint64_t id) {
  Trajectory t;
  t.id = laminar::TrajectoryId(id);
  t.prompt_id = laminar::PromptId(100 + id);
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

// One record framed as the WAL frames it.
std::string record_of(WalRecordType type, const std::string& payload) {
  std::string r;
  ByteWriter w(r);
  w.u32(0x52574D4Cu);
  w.u32(std::uint32_t(type));
  w.u64(payload.size());
  w.u64(TrajectoryWal::checksum(type, payload));
  w.u64(XXH64(r.data(), 24, 0x6C616D696E6172ull));
  w.bytes(payload);
  return r;
}

// A log's file header, then each record.
std::string log_of(const std::vector<std::pair<WalRecordType, std::string>>& records) {
  std::string file("LAMWAL01\x02\0\0\0\0\0\0\0", 16);
  for (const auto& [type, payload] : records) file += record_of(type, payload);
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

// What open() gave, and what it told its listener.
struct Opened {
  laminar::Status status;
  std::unique_ptr<TrajectoryWal> wal;  // open while this lives, when status is OK
  TrajectoryWal::Contents contents;
  std::vector<std::uint64_t> retired_ids;
  std::vector<laminar::GroupId> closed_groups;
  laminar::RecoveryReport report;
};

Opened open_log(const std::string& path) {
  Opened o;
  const TrajectoryWal::Listener listener{[&o](std::uint64_t id) { o.retired_ids.push_back(id); },
                                         [&o](laminar::GroupId g) { o.closed_groups.push_back(g); }};
  auto wal = TrajectoryWal::open(path, false, listener, o.contents, o.report);
  o.status = wal.status();
  if (wal.ok()) o.wal = std::move(wal).value();
  return o;
}

}  // namespace

// Logs written by older builds must replay: a change here is a format change.
TEST_CASE("WAL: the bytes of every record type are pinned", "[wal][encoding]") {
  const std::string path = temp_path("pinned");
  std::filesystem::remove(path);
  {
    const Opened o = open_log(path);
    REQUIRE(o.status.ok());
    std::string payload;
    for (std::uint64_t id : {1, 2, 3}) {
      payload.clear();
      encode_trajectory(make_traj(id), payload);
      REQUIRE(o.wal->append(WalRecordType::kPush, payload).ok());
    }
    const std::vector<std::uint64_t> acked = {1, 3};
    REQUIRE(o.wal->append_retire(WalRetireReason::kAck, acked).ok());
    REQUIRE(o.wal->append_u64(WalRecordType::kGroupClosed, 77).ok());
    REQUIRE(o.wal->append_u64(WalRecordType::kVersion, 5).ok());
  }
  const std::string file = read_all(path);
  CHECK(file.size() == 16 + 3 * (32 + 80 + 4 * (2 + 3 + 3 + 1)) + (32 + 32) + 2 * (32 + 8));
  std::vector<std::pair<WalRecordType, std::string>> records;
  for (std::uint64_t id : {1, 2, 3}) {
    records.emplace_back(WalRecordType::kPush, "");
    encode_trajectory(make_traj(id), records.back().second);
  }
  records.emplace_back(WalRecordType::kRetire, retire_payload(0, 2, {1, 3}));
  records.emplace_back(WalRecordType::kGroupClosed, u64_payload(77));
  records.emplace_back(WalRecordType::kVersion, u64_payload(5));
  CHECK(file == log_of(records));
  CHECK(XXH3_64bits(file.data(), file.size()) == 0x423b85f49dc95f81ull);

  const Opened o = open_log(path);
  REQUIRE(o.status.ok());
  CHECK(o.report.tail.ok());
  CHECK(o.report.records == 6);
  REQUIRE(o.contents.live.size() == 1);
  CHECK(o.contents.live[0] == make_traj(2));
  CHECK(o.retired_ids == std::vector<std::uint64_t>{1, 3});
  CHECK(o.closed_groups == std::vector<laminar::GroupId>{laminar::GroupId(77)});
  CHECK(o.contents.newest == laminar::Version(5));
  CHECK(o.contents.retired == 2);
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
  const std::vector<std::size_t> ends = {16, 16 + 40, 16 + 40 + 32 + push.size(), full.size() - 40, full.size()};
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
              wal + ": retire record: reason 9 is not a WalRetireReason at offset 48");
  expect_code(refused(log_of({{WalRecordType::kRetire, retire_payload(0, 3, {1, 2})}})), StatusCode::kDataLoss,
              wal + ": retire record: ids cut short at offset 64 (16 of 3 x 8 bytes)");
  expect_code(refused(log_of({{WalRecordType::kRetire, retire_payload(0, ~0ull, {1})}})), StatusCode::kDataLoss,
              "ids cut short at offset 64 (8 of 18446744073709551615 x 8 bytes)");
  std::string padded = retire_payload(0, 1, {1});
  padded[3] = 1;
  expect_code(refused(log_of({{WalRecordType::kRetire, padded}})), StatusCode::kDataLoss,
              "retire record: nonzero padding at offset 49");
  expect_code(refused(log_of({{WalRecordType::kVersion, u64_payload(3) + "x"}})), StatusCode::kDataLoss,
              wal + ": version record: 1 trailing bytes at offset 56");
  expect_code(refused(log_of({{WalRecordType::kGroupClosed, "abc"}})), StatusCode::kDataLoss,
              "group-closed record: group id cut short at offset 48 (3 of 8 bytes)");
  expect_code(refused(log_of({{WalRecordType::kPush, "abc"}})), StatusCode::kDataLoss,
              wal + ": push record at offset 16: encoded trajectory: format cut short at offset 0");
  // A header whose checksum passes was written whole: one that makes no sense is refused, last or not.
  const std::string good = log_of({{WalRecordType::kVersion, u64_payload(3)}});
  expect_code(refused(good + record_of(WalRecordType(9), u64_payload(4))), StatusCode::kDataLoss,
              wal + ": unknown record type 9 at offset 60");
  std::string huge = record_of(WalRecordType::kVersion, "");
  std::memset(huge.data() + 8, 0xff, 8);
  const std::uint64_t header_sum = XXH64(huge.data(), 24, 0x6C616D696E6172ull);
  std::memcpy(huge.data() + 24, &header_sum, 8);
  expect_code(refused(good + huge), StatusCode::kDataLoss,
              "implausible record length 18446744073709551615 at offset 64");
  std::string magic = record_of(WalRecordType::kVersion, u64_payload(4));
  magic[0] = 'X';
  const std::uint64_t magic_sum = XXH64(magic.data(), 24, 0x6C616D696E6172ull);
  std::memcpy(magic.data() + 24, &magic_sum, 8);
  expect_code(refused(good + magic), StatusCode::kDataLoss, "bad record magic 0x52574d58 at offset 56");

  std::string file = log_of({{WalRecordType::kVersion, u64_payload(3)}});
  file[8] = 7;
  expect_code(refused(file), StatusCode::kFailedPrecondition,
              wal + ": written in format 7, which this build does not read");

  // A header cut short is a torn tail, cut and reported.
  expect_code(tail(good + "LMWR"), StatusCode::kDataLoss, "record header cut short at offset 56 (4 of 32 bytes)");
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
  // The message shows what is there: here the header of another format, cut short.
  write_all(path, header.substr(0, 8) + std::string(3, '\xff'));
  expect_code(open_log(path).status, StatusCode::kFailedPrecondition,
              "its first bytes are 4c414d57414c3031ffffff; a log begins \"LAMWAL01\" and format 2");

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

// The tail rule must not hang on what a payload holds: a producer chooses its token ids, and so
// can write bytes that frame a whole record, here one that would retire an unacked trajectory.
TEST_CASE("WAL: a torn last record is cut whatever its payload holds, a record planted in it too",
          "[wal][bad-input]") {
  const std::string path = temp_path("planted");
  std::filesystem::remove(path);
  const std::string planted = record_of(WalRecordType::kRetire, retire_payload(0, 1, {1}));
  REQUIRE(planted.size() % 4 == 0);
  Trajectory carrier = make_traj(2);
  carrier.response_tokens.assign(planted.size() / 4 + 8, 0);  // the planted record, then 8 more tokens
  std::memcpy(carrier.response_tokens.data(), planted.data(), planted.size());
  carrier.logprobs.assign(carrier.response_tokens.size(), -0.5f);
  std::uint64_t before = 0;  // the log's size without the carrier
  {
    const Opened o = open_log(path);
    REQUIRE(o.status.ok());
    std::string payload;
    encode_trajectory(make_traj(1), payload);
    REQUIRE(o.wal->append(WalRecordType::kPush, payload).ok());
    before = o.wal->bytes();
    payload.clear();
    encode_trajectory(carrier, payload);
    REQUIRE(o.wal->append(WalRecordType::kPush, payload).ok());
  }
  const std::string full = read_all(path);
  const std::size_t at = full.find(planted);
  REQUIRE(at != std::string::npos);
  REQUIRE(at > before + 32);
  {
    const Opened o = open_log(path);
    REQUIRE(o.status.ok());
    CHECK(o.report.tail.ok());
    REQUIRE(o.contents.live.size() == 2);
    CHECK(o.contents.live[1] == carrier);
  }
  // Cut anywhere past the planted record: the carrier is torn, and only it is cut.
  for (std::size_t n = at + planted.size(); n < full.size(); ++n) {
    INFO("the log's first " << n << " bytes");
    write_all(path, full.substr(0, n));
    const Opened o = open_log(path);
    REQUIRE(o.status.ok());
    expect_code(o.report.tail, StatusCode::kDataLoss,
                "record payload cut short at offset " + std::to_string(before + 32));
    CHECK(o.report.discarded_bytes == n - before);
    CHECK(o.report.records == 1);
    REQUIRE(o.contents.live.size() == 1);
    CHECK(o.contents.live[0] == make_traj(1));
    CHECK(o.retired_ids.empty());
    CHECK(std::filesystem::file_size(path) == before);
  }
  std::filesystem::remove(path);
}

TEST_CASE("WAL: a damaged record with more than zeros after it is refused, with only zeros after it cut",
          "[wal][bad-input]") {
  const std::string path = temp_path("damage");
  std::vector<std::pair<WalRecordType, std::string>> records;
  for (std::uint64_t id : {1, 2, 3}) {
    records.emplace_back(WalRecordType::kPush, "");
    encode_trajectory(make_traj(id), records.back().second);
  }
  const std::string full = log_of(records);
  const std::size_t second = 16 + 32 + records[0].second.size();
  const std::size_t third = second + 32 + records[1].second.size();

  // One bit flipped anywhere in the second record or the third.
  for (std::size_t i = second; i < full.size(); ++i) {
    INFO("bit 5 of byte " << i << " flipped");
    std::string bad = full;
    bad[i] = char(bad[i] ^ 0x20);
    write_all(path, bad);
    const Opened o = open_log(path);
    if (i < third + 32) {
      // The second record, with the third after it; or the third's header, with its payload
      // after it, which could as well be more records. Either way the log is left as it was.
      expect_code(o.status, StatusCode::kDataLoss, "that are not all zero follow it");
      CHECK(read_all(path) == bad);
    } else {
      // The last record's payload, with nothing after it: a tail torn by a power cut.
      REQUIRE(o.status.ok());
      expect_code(o.report.tail, StatusCode::kDataLoss, "record checksum mismatch");
      CHECK(o.contents.live.size() == 2);
      CHECK(std::filesystem::file_size(path) == third);
    }
  }

  // Blocks a power cut left unwritten read as zeros.
  struct ZeroTail {
    const char* what;
    std::string file;
    std::size_t live;
  };
  const std::vector<ZeroTail> tails = {
      {"the last payload's end", full.substr(0, full.size() - 40) + std::string(40, '\0'), 2},
      {"the whole last record", full.substr(0, third) + std::string(full.size() - third, '\0'), 2},
      {"a block past the last record", full + std::string(4096, '\0'), 3},
      {"less than a header past the last record", full + std::string(20, '\0'), 3},
  };
  for (const ZeroTail& t : tails) {
    INFO("zeros in " << t.what);
    write_all(path, t.file);
    const Opened o = open_log(path);
    REQUIRE(o.status.ok());
    CHECK(o.report.tail.code() == StatusCode::kDataLoss);
    CHECK(o.contents.live.size() == t.live);
    CHECK(std::filesystem::file_size(path) == (t.live == 3 ? full.size() : third));
  }
  // Zeros, then anything else: records may lie past the zeros. (The zeros from full.size() on
  // are a damaged header; 4096 - 32 + 1 bytes follow it.)
  write_all(path, full + std::string(4096, '\0') + "x");
  expect_code(open_log(path).status, StatusCode::kDataLoss,
              "4065 bytes that are not all zero follow it (the first nonzero one at offset " +
                  std::to_string(full.size() + 4096) + ")");
  std::filesystem::remove(path);
}

// A restart after a long run reads a long log, mostly of what was acked long ago: replay holds
// about one record at a time, not the file, and nothing for each record it has read.
TEST_CASE("WAL: replay's memory stays near one record however long the log", "[wal][memory]") {
  const std::string path = temp_path("memory");
  std::filesystem::remove(path);
  constexpr std::size_t kBigTokens = 64 << 10;  // a 512 KiB push record
  constexpr std::uint64_t kBig = 64, kSmall = 100000;
  {
    const Opened o = open_log(path);
    REQUIRE(o.status.ok());
    std::string payload;
    std::vector<std::uint64_t> ids;
    for (std::uint64_t id = 1; id <= kBig + kSmall; ++id) {
      Trajectory t = make_traj(id);
      if (id <= kBig) {
        t.response_tokens.assign(kBigTokens, 7);
        t.logprobs.assign(kBigTokens, -0.5f);
      }
      payload.clear();
      encode_trajectory(t, payload);
      REQUIRE(o.wal->append(WalRecordType::kPush, payload).ok());
      ids.push_back(id);
      if (ids.size() == 1000 || id <= kBig) {
        REQUIRE(o.wal->append_retire(WalRetireReason::kAck, ids).ok());
        ids.clear();
      }
    }
  }
  const std::uint64_t log_bytes = std::filesystem::file_size(path);
  REQUIRE(log_bytes > (40u << 20));

  TrajectoryWal::Contents c;
  laminar::RecoveryReport report;
  std::uint64_t retired = 0;
  const TrajectoryWal::Listener count{[&retired](std::uint64_t) { ++retired; }, nullptr};
  const std::size_t before = heap_in_use.load();
  heap_peak.store(before);
  auto wal = TrajectoryWal::open(path, false, count, c, report);
  const std::size_t peak = heap_peak.load() - before;
  REQUIRE(wal.ok());
  CHECK(report.tail.ok());
  CHECK(retired == kBig + kSmall);
  CHECK(c.live.empty());
  INFO("a " << log_bytes << "-byte log took at most " << peak << " heap bytes to replay");
  // The read buffer (1 MiB, or the largest record) and the largest trajectory, decoded, with room
  // to spare; the whole file would be 40 MiB, an entry per record 10 MiB or more.
  CHECK(peak < (4u << 20));
  std::filesystem::remove(path);
}

TEST_CASE("WAL: a log has one writer: a second open is refused while the first holds it", "[wal][bad-input]") {
  const std::string path = temp_path("lock");
  std::filesystem::remove(path);
  Opened first = open_log(path);
  REQUIRE(first.status.ok());
  REQUIRE(first.wal->append_u64(WalRecordType::kVersion, 3).ok());
  const std::string bytes = read_all(path);
  expect_code(open_log(path).status, StatusCode::kFailedPrecondition, "WAL " + path + ": in use by another queue");
  CHECK(read_all(path) == bytes);

  // Compaction puts a new file in the log's place, locked before it gets there.
  const Trajectory t = make_traj(1);
  TrajectoryWal::Snapshot s;
  s.newest = laminar::Version(4);
  s.live = {&t};
  REQUIRE(first.wal->compact(s).ok());
  expect_code(open_log(path).status, StatusCode::kFailedPrecondition, "in use by another queue");

  first.wal.reset();
  const Opened again = open_log(path);
  REQUIRE(again.status.ok());
  REQUIRE(again.contents.live.size() == 1);
  CHECK(again.contents.live[0] == t);
  CHECK(again.contents.newest == laminar::Version(4));
  std::filesystem::remove(path);
}

TEST_CASE("WAL: compaction replaces only its own leftover file, never someone else's", "[wal][bad-input]") {
  const std::string path = temp_path("compact-path");
  const std::string tmp = path + ".compact";
  std::filesystem::remove(path);
  std::filesystem::remove_all(tmp);
  Opened log = open_log(path);
  REQUIRE(log.status.ok());
  const Trajectory t = make_traj(1);
  TrajectoryWal::Snapshot s;
  s.newest = laminar::Version(2);
  s.live = {&t};

  // A file that is not a laminar log, a directory, a link: refused, left as they were, and the log
  // goes on as before.
  {
    std::ofstream(tmp) << "someone's notes";
  }
  expect_code(log.wal->compact(s), StatusCode::kFailedPrecondition, "not a laminar write-ahead log");
  CHECK(read_all(tmp) == "someone's notes");
  std::filesystem::remove(tmp);
  std::filesystem::create_directory(tmp);
  expect_code(log.wal->compact(s), StatusCode::kFailedPrecondition, "is a directory");
  std::filesystem::remove(tmp);
  const std::string target = path + ".target";
  {
    std::ofstream(target) << "keep me";
  }
  std::filesystem::create_symlink(target, tmp);
  expect_code(log.wal->compact(s), StatusCode::kFailedPrecondition, "not a regular file");
  CHECK(read_all(target) == "keep me");
  std::filesystem::remove(tmp);
  std::filesystem::remove(target);
  REQUIRE(log.wal->append_u64(WalRecordType::kVersion, 3).ok());

  // What a compaction cut short by a crash leaves (a log's first bytes) is replaced.
  {
    std::ofstream(tmp) << read_all(path).substr(0, 8);
  }
  REQUIRE(log.wal->compact(s).ok());
  CHECK_FALSE(std::filesystem::exists(tmp));
  log.wal.reset();
  const Opened again = open_log(path);
  REQUIRE(again.status.ok());
  REQUIRE(again.contents.live.size() == 1);
  CHECK(again.contents.live[0] == t);
  std::filesystem::remove(path);
}
