// libFuzzer target for the WAL's replay: the input is a whole log file, which TrajectoryWal::open
// reads from a memfd by its /proc path, as it would a file on disk. Built with clang
// (-fsanitize=fuzzer,address,undefined) by tests/CMakeLists.txt and run briefly as the CTest test
// wal_replay_fuzz; seeds in wal_replay_corpus/.
//
// Properties: open never crashes, hangs or trips a sanitizer, whatever the bytes. It either refuses
// a file that is not a laminar WAL with kFailedPrecondition naming the path, leaving it as it was,
// or refuses with kDataLoss naming an offset, or keeps a prefix of whole records and cuts the rest;
// the log it leaves then takes an append and replays to the same contents plus that record, with a
// clean tail.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "trajectory_wal.h"

using laminar::RecoveryReport;
using laminar::StatusCode;
using laminar::internal::TrajectoryWal;
using laminar::internal::WalRecordType;

namespace {

constexpr std::uint64_t kAppendedGroup = 0xfeedull;

// One memfd for the whole run; each input replaces its contents.
struct Log {
  int fd;
  std::string path;
};

const Log& the_log() {
  static const Log log = [] {
    const int fd = ::memfd_create("wal_replay_fuzz", 0);
    LAMINAR_CHECK(fd >= 0);
    return Log{fd, "/proc/self/fd/" + std::to_string(fd)};
  }();
  return log;
}

void write_log(const std::uint8_t* data, std::size_t size) {
  const int fd = the_log().fd;
  LAMINAR_CHECK(::ftruncate(fd, 0) == 0);
  std::size_t done = 0;
  while (done < size) {
    const ssize_t w = ::pwrite(fd, data + done, size - done, off_t(done));
    LAMINAR_CHECK(w > 0);
    done += std::size_t(w);
  }
}

// One replay of the log: what open() gave, and what it told its listener.
struct Replayed {
  TrajectoryWal::Contents contents;
  std::vector<std::uint64_t> retired_ids;
  std::vector<laminar::GroupId> closed_groups;
  RecoveryReport report;

  laminar::Result<std::unique_ptr<TrajectoryWal>> open() {
    const TrajectoryWal::Listener listener{[this](std::uint64_t id) { retired_ids.push_back(id); },
                                           [this](laminar::GroupId g) { closed_groups.push_back(g); }};
    return TrajectoryWal::open(the_log().path, false, listener, contents, report);
  }
};

// Whether the log still holds exactly the input.
bool same_as_input(const std::uint8_t* data, std::size_t size) {
  std::string now(size + 1, '\0');
  const ssize_t n = ::pread(the_log().fd, now.data(), now.size(), 0);
  return n == ssize_t(size) && std::memcmp(now.data(), data, size) == 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  write_log(data, size);
  Replayed first;
  {
    auto wal = first.open();
    if (!wal.ok()) {
      // Not a laminar WAL of this format: refused, naming the path, and left as it was.
      if (wal.status().code() == StatusCode::kFailedPrecondition) {
        LAMINAR_CHECK_MSG(wal.status().message().find(the_log().path) != std::string::npos,
                          wal.status().to_string());
        LAMINAR_CHECK(same_as_input(data, size));
        return 0;
      }
      LAMINAR_CHECK_MSG(wal.status().code() == StatusCode::kDataLoss, wal.status().to_string());
      LAMINAR_CHECK_MSG(wal.status().message().find(" at offset ") != std::string::npos,
                        wal.status().to_string());
      return 0;
    }
    LAMINAR_CHECK(first.report.tail.ok() == (first.report.discarded_bytes == 0));
    // A log shorter than its file header starts afresh with a new header.
    const std::size_t kept = size < 16 ? 16 : size - first.report.discarded_bytes;
    LAMINAR_CHECK((*wal)->bytes() == kept);
    LAMINAR_CHECK((*wal)->append_u64(WalRecordType::kGroupClosed, kAppendedGroup).ok());
  }
  Replayed second;
  auto wal = second.open();
  LAMINAR_CHECK_MSG(wal.ok(), wal.status().to_string());
  LAMINAR_CHECK_MSG(second.report.tail.ok(), second.report.tail.to_string());
  LAMINAR_CHECK(second.report.records == first.report.records + 1);
  first.closed_groups.push_back(laminar::GroupId(kAppendedGroup));
  LAMINAR_CHECK(second.contents.live == first.contents.live);
  LAMINAR_CHECK(second.retired_ids == first.retired_ids);
  LAMINAR_CHECK(second.closed_groups == first.closed_groups);
  LAMINAR_CHECK(second.contents.newest == first.contents.newest);
  LAMINAR_CHECK(second.contents.live_bytes == first.contents.live_bytes &&
                second.contents.retired == first.contents.retired);
  return 0;
}
