// trajectory_wal.h (private to src/): the append-only log behind TrajectoryQueue's durability.
//
// File: a 16-byte header ("LAMWAL01", u32 format 2, u32 zero) then records, each a 32-byte header
// {u32 magic, u32 type, u64 payload length, u64 XXH64 of type, length and payload, u64 XXH64 of
// the header's first 24 bytes} and the payload. A record is appended with one write at the end
// (the kernel keeps it across a kill of this process; fsync, when asked for, across power loss
// too). Replay turns the records into Contents; compaction writes a Snapshot in their place.
//
// Replay streams the file through one buffer (1 MiB, or the largest record), and keeps only the
// pushes not yet retired: its memory is what the queue will hold, plus about one record.
//
// It follows the chain of records from the file header: each record is looked for only where
// the one before it ends, and its length is believed only once its header checksum passes, so no
// byte inside a payload (which a producer chooses: token ids) is ever read as a record. The chain
// ends at the first record that is not whole and good:
//   - torn: the file ends inside it (less than a header is left, or the header is good and the
//     payload runs past the end). A crash mid-append leaves this: it is cut and reported.
//   - damaged: it is all there but fails a checksum. If only zero bytes follow it (past its
//     payload when its header is good, else past its header), it was the last write and a power
//     cut tore it (blocks never written read as zeros): cut and reported. Otherwise records may
//     follow it, and they could be the acks that keep delivery exactly-once: open refuses the log
//     (kDataLoss) rather than cut them.
//   - malformed: its checksums pass but it makes no sense (a bad type or contents): kDataLoss.
// So what is cut never hides a record: every record begins with a nonzero magic. A kill of the
// process only ever leaves a torn record; a damaged one takes a power cut or a bad disk.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "laminar/status.h"
#include "laminar/trajectory.h"
#include "laminar/trajectory_queue.h"

namespace laminar::internal {

enum class WalRecordType : std::uint32_t {
  kPush = 1,         // payload: encode_trajectory
  kRetire = 2,       // payload: u8 reason (WalRetireReason), u8[7] zero, u64 count, u64 ids[count]
  kGroupClosed = 3,  // payload: u64 group id
  kVersion = 4,      // payload: u64 newest published version
};

enum class WalRetireReason : std::uint8_t { kAck = 0, kStale = 1, kGroupTimeout = 2, kWindow = 3 };

// An owned file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();
  int get() const noexcept { return fd_; }

 private:
  int fd_ = -1;
};

class TrajectoryWal {
 public:
  // What a log holds: the state a queue restarts from.
  struct Contents {
    Version newest;                // the newest version it records (0 if none)
    std::vector<Trajectory> live;  // pushed and never retired, in log order
    std::uint64_t live_bytes = 0;  // bytes of the records of `live`
    std::uint64_t retired = 0;     // pushes it retires
  };
  // Told, in log order as replay reads them, of each id a retire record names and each group a
  // group-closed record names (either may be empty). Replay keeps neither list: the caller keeps
  // what it needs (the queue: its dedup windows), so replay's memory does not grow with the log.
  // When open fails, what they were told counts for nothing.
  struct Listener {
    std::function<void(std::uint64_t id)> retired;
    std::function<void(GroupId group)> group_closed;
  };

  // Opens `path` (creating it) and replays it into `contents` and `report`. kFailedPrecondition,
  // naming the path, when it is not a regular file or not a laminar WAL of this format: such a file
  // is never written to; or when another TrajectoryWal, in any process, has it open (an exclusive
  // flock, which compaction carries over to the new file and a process's death releases). An empty
  // file is a new log (open made it, then a crash came before the header); so is one that holds a
  // prefix of the header this build writes (the crash came while writing it), which is reported as
  // a cut tail. kDataLoss for a malformed record, a trajectory
  // pushed twice while live, or a damaged record with more than zeros after it (see above).
  static Result<std::unique_ptr<TrajectoryWal>> open(const std::string& path, bool fsync_each,
                                                     const Listener& listener, Contents& contents,
                                                     RecoveryReport& report);

  // What compact() writes: everything a restart needs, nothing retired.
  struct Snapshot {
    Version newest;
    std::vector<std::uint64_t> window;         // retired ids in the dedup window, oldest first
    std::vector<GroupId> closed_groups;        // oldest first
    std::vector<const Trajectory*> live;       // in the order they should come back
  };
  // Replaces the log with `s`, atomically (write aside, fsync, rename).
  Status compact(const Snapshot& s);

  // Appends one record; `sync` as in append_all. On failure (of the write, or of the fdatasync
  // with fsync_each) the file is cut back to where it was, so a failed append never leaves a torn
  // record in front of later ones, nor one that replay would bring back.
  Status append(WalRecordType type, std::string_view payload, bool sync = true);
  static std::uint64_t checksum(WalRecordType type, std::string_view payload);
  // A record for append_all, its checksum computed beforehand: it reads the whole payload, so a
  // writer computes it before taking the lock that serialises appends.
  struct Record {
    WalRecordType type;
    std::string_view payload;
    std::uint64_t checksum;
  };
  // Appends `records` in order, then, with fsync_each and `sync`, one fdatasync for all of them:
  // all are in the log, or, on failure, none (the file is cut back). Without `sync` a record is
  // made durable by the next append that syncs, for one whose loss in a power cut costs nothing.
  Status append_all(std::span<const Record> records, bool sync = true);

  // A kRetire record of `ids`.
  Status append_retire(WalRetireReason reason, std::span<const std::uint64_t> ids);
  // A record of one u64 (kGroupClosed, kVersion); `sync` as in append_all.
  Status append_u64(WalRecordType type, std::uint64_t v, bool sync = true);

  // Bytes of the kPush record of `t`.
  static std::uint64_t push_record_bytes(const Trajectory& t);

  std::uint64_t bytes() const noexcept { return size_; }
  std::uint64_t records() const noexcept { return records_; }

 private:
  TrajectoryWal(std::string path, Fd fd, std::uint64_t size, bool fsync_each)
      : path_(std::move(path)), fd_(std::move(fd)), size_(size), fsync_each_(fsync_each) {}
  // Cuts the file back to the last record appended in full.
  void cut_back();
  Status rewrite(const std::function<Status(TrajectoryWal&)>& write_live);

  std::string path_;
  Fd fd_;
  std::uint64_t size_ = 0;
  std::uint64_t records_ = 0;
  bool fsync_each_ = false;
};

}  // namespace laminar::internal
