#include "trajectory_wal.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
// Inlined: the hash sits on every WAL record and needs no shared library at run time.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "byte_codec.h"

namespace laminar::internal {
namespace {

constexpr std::string_view kFileMagic = "LAMWAL01";
constexpr std::uint32_t kFormat = 2;
constexpr std::uint64_t kFileHeaderBytes = 16;
constexpr std::uint32_t kRecordMagic = 0x52574D4Cu;  // "LMWR"
constexpr std::uint64_t kRecordHeaderBytes = 32;
constexpr std::uint64_t kHeaderCheckedBytes = 24;  // what the header checksum covers: all before it
// A bigger length field is damage, not a trajectory (which the capacity bounds far below this).
constexpr std::uint64_t kMaxPayload = std::uint64_t(1) << 32;
// Replay reads the log in pieces of this many bytes (one record at a time when it is larger).
constexpr std::size_t kReadChunk = std::size_t(1) << 20;

constexpr std::uint64_t kSeed = 0x6C616D696E6172ull;

std::uint64_t record_checksum(std::uint32_t type, std::uint64_t length, std::string_view payload) {
  XXH64_state_t state;
  XXH64_reset(&state, kSeed);
  XXH64_update(&state, &type, sizeof(type));
  XXH64_update(&state, &length, sizeof(length));
  XXH64_update(&state, payload.data(), payload.size());
  return XXH64_digest(&state);
}

std::string errno_text(int e) { return fmt::format("{} (errno {})", std::strerror(e), e); }

Status io_error(std::string_view what, const std::string& path, int e) {
  const std::string m = fmt::format("WAL {}: {} failed: {}", path, what, errno_text(e));
  return e == ENOSPC || e == EDQUOT ? resource_exhausted(m) : data_loss(m);
}

Status not_a_regular_file(const std::string& path, mode_t mode) {
  const char* kind = S_ISDIR(mode)    ? "a directory"
                     : S_ISFIFO(mode) ? "a FIFO"
                     : S_ISSOCK(mode) ? "a socket"
                     : S_ISCHR(mode)  ? "a character device"
                     : S_ISBLK(mode)  ? "a block device"
                                      : "not a regular file";
  return failed_precondition(fmt::format("WAL {}: is {}; a write-ahead log is a regular file", path, kind));
}

// The file at the path begins with `first`, which is not how a laminar WAL of this build begins.
Status not_a_wal(const std::string& path, std::string_view first) {
  std::string hex;
  for (unsigned char c : first.substr(0, kFileHeaderBytes)) hex += fmt::format("{:02x}", c);
  return failed_precondition(fmt::format("WAL {}: not a laminar write-ahead log (its first bytes are {}; a log "
                                         "begins \"{}\" and format {}); refusing to overwrite it",
                                         path, hex, kFileMagic, kFormat));
}

// A log has one writer: a second queue on it, in this process or another, would interleave its
// records with the first's. The lock goes with the file description, so a killed holder frees it.
Status lock(int fd, const std::string& path) {
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return ok_status();
  if (errno == EWOULDBLOCK) {
    return failed_precondition(
        fmt::format("WAL {}: in use by another queue, which holds its lock; a log has one queue at a time", path));
  }
  return io_error("flock", path, errno);
}

// 0, or the errno of the failed write.
int write_all(int fd, const void* data, std::size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    p += w;
    n -= std::size_t(w);
  }
  return 0;
}

// A record header: magic, type, length and payload checksum, then the checksum of those.
void put_record_header(std::string& out, WalRecordType type, std::uint64_t length, std::uint64_t payload_sum) {
  const std::size_t at = out.size();
  ByteWriter w(out);
  w.u32(kRecordMagic);
  w.u32(std::uint32_t(type));
  w.u64(length);
  w.u64(payload_sum);
  w.u64(XXH64(out.data() + at, kHeaderCheckedBytes, kSeed));
}

// What replay finds where the chain of records leads.
struct Found {
  enum Kind {
    kGood,
    kTorn,     // the file ends inside it
    kDamaged,  // all there, but a checksum fails
  };
  Kind kind;
  WalRecordType type{};
  std::string_view payload;  // kGood
  // kDamaged: where the bytes that follow it begin (past its payload when its header is good,
  // past its header when not: then its length is not known).
  std::uint64_t after = 0;
  Status why;  // kTorn, kDamaged: what is wrong, naming the offset
};

// Reads the log front to back through one buffer of kReadChunk bytes, or of the largest record
// read when that is larger: replay's memory does not grow with the log.
class FileReader {
 public:
  FileReader(int fd, std::uint64_t size, const std::string& path) : fd_(fd), size_(size), path_(path) {}

  std::uint64_t size() const noexcept { return size_; }

  // The file's bytes [off, off + n), valid until the next read.
  // Preconditions:
  //   off + n <= size().
  Result<std::string_view> read(std::uint64_t off, std::size_t n) {
    if (off >= start_ && off + n <= start_ + len_) return std::string_view(buf_.get() + (off - start_), n);
    const std::size_t want = std::max<std::uint64_t>(n, std::min<std::uint64_t>(kReadChunk, size_ - off));
    if (want > cap_) {
      buf_.reset();  // before the new one, so the two are never held together
      buf_ = std::make_unique_for_overwrite<char[]>(want);
      cap_ = want;
    }
    const std::size_t fill = std::size_t(std::min<std::uint64_t>(cap_, size_ - off));
    std::size_t got = 0;
    while (got < fill) {
      const ssize_t r = ::pread(fd_, buf_.get() + got, fill - got, off_t(off + got));
      if (r < 0) {
        if (errno == EINTR) continue;
        len_ = 0;
        return io_error("read", path_, errno);
      }
      if (r == 0) break;
      got += std::size_t(r);
    }
    start_ = off;
    len_ = got;
    if (got < n) {
      return aborted(fmt::format("WAL {}: the file shrank from {} to {} bytes while being replayed (is another "
                                 "process writing it?)",
                                 path_, size_, off + got));
    }
    return std::string_view(buf_.get(), n);
  }

  // The offset of the first byte at or past `from` that is not zero, or size() when none is.
  Result<std::uint64_t> first_nonzero(std::uint64_t from) {
    for (std::uint64_t off = from; off < size_;) {
      const std::size_t n = std::size_t(std::min<std::uint64_t>(kReadChunk, size_ - off));
      Result<std::string_view> bytes = read(off, n);
      if (!bytes.ok()) return bytes.status();
      if (const std::size_t i = bytes->find_first_not_of('\0'); i != std::string_view::npos) return off + i;
      off += n;
    }
    return size_;
  }

 private:
  int fd_;
  std::uint64_t size_;  // when replay began
  const std::string& path_;
  std::unique_ptr<char[]> buf_;
  std::size_t cap_ = 0;
  std::uint64_t start_ = 0;  // buf_ holds the file's bytes [start_, start_ + len_)
  std::size_t len_ = 0;
};

// The record at `off`. An error for one whose checksums pass but whose header makes no sense:
// that is not damage a crash or a bad disk leaves, and replay refuses it wherever it is.
Result<Found> read_record(FileReader& in, std::uint64_t off, std::string_view what) {
  const std::uint64_t left = in.size() - off;
  if (left < kRecordHeaderBytes) {
    return Found{Found::kTorn, {}, {}, 0,
                 data_loss(fmt::format("{}: record header cut short at offset {} ({} of {} bytes)", what, off, left,
                                       kRecordHeaderBytes))};
  }
  Result<std::string_view> header = in.read(off, kRecordHeaderBytes);
  if (!header.ok()) return header.status();
  ByteReader h(*header, what, off);
  const std::uint32_t magic = h.u32("record magic");
  const std::uint32_t type = h.u32("record type");
  const std::uint64_t length = h.u64("record length");
  const std::uint64_t stored = h.u64("record checksum");
  const std::uint64_t stored_header = h.u64("record header checksum");
  const std::uint64_t header_sum = XXH64(header->data(), kHeaderCheckedBytes, kSeed);
  if (header_sum != stored_header) {
    h.fail(off + kHeaderCheckedBytes,
           fmt::format("record header checksum mismatch (stored {:#018x}, computed {:#018x})", stored_header,
                       header_sum));
    return Found{Found::kDamaged, {}, {}, off + kRecordHeaderBytes, h.status()};
  }
  if (magic != kRecordMagic) h.fail(off, fmt::format("bad record magic {:#010x}", magic));
  if (type < std::uint32_t(WalRecordType::kPush) || type > std::uint32_t(WalRecordType::kVersion)) {
    h.fail(off + 4, fmt::format("unknown record type {}", type));
  }
  if (length > kMaxPayload) h.fail(off + 8, fmt::format("implausible record length {}", length));
  LAMINAR_RETURN_IF_ERROR(h.status());
  const std::uint64_t payload_at = off + kRecordHeaderBytes;
  if (length > left - kRecordHeaderBytes) {
    return Found{Found::kTorn, {}, {}, 0,
                 data_loss(fmt::format("{}: record payload cut short at offset {} ({} of {} bytes)", what,
                                       payload_at, left - kRecordHeaderBytes, length))};
  }
  Result<std::string_view> payload = in.read(payload_at, std::size_t(length));
  if (!payload.ok()) return payload.status();
  const std::uint64_t sum = record_checksum(type, length, *payload);
  if (sum != stored) {
    return Found{Found::kDamaged, {}, {}, payload_at + length,
                 data_loss(fmt::format("{}: record checksum mismatch (stored {:#018x}, computed {:#018x}) at offset {}",
                                       what, stored, sum, off + 16))};
  }
  return Found{Found::kGood, WalRecordType(type), *payload, 0, {}};
}

std::string file_header() {
  std::string h;
  ByteWriter w(h);
  w.bytes(kFileMagic);
  w.u32(kFormat);
  w.u32(0);
  return h;
}

Status write_file_header(int fd, const std::string& path) {
  const std::string h = file_header();
  if (::ftruncate(fd, 0) != 0) return io_error("ftruncate", path, errno);
  if (::lseek(fd, 0, SEEK_SET) < 0) return io_error("lseek", path, errno);
  if (const int e = write_all(fd, h.data(), h.size()); e != 0) return io_error("write header", path, e);
  return ok_status();
}

Status sync_dir_of(const std::string& path) {
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  Fd d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d.get() < 0) return io_error("open directory", dir, errno);
  if (::fsync(d.get()) != 0) return io_error("fsync directory", dir, errno);
  return ok_status();
}

}  // namespace

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

namespace {

// Replays records into Contents: it holds the pushes not yet retired, in log order, and passes
// retired ids and closed groups on to the listener, so that what it keeps is what the queue will.
class Replayer {
 public:
  Replayer(const std::string& path, const TrajectoryWal::Listener& listener, TrajectoryWal::Contents& c)
      : path_(path), listener_(listener), c_(c) {}

  // The record at `off`, its payload `p`.
  Status record(WalRecordType type, std::string_view p, std::uint64_t off) {
    const std::uint64_t payload_at = off + kRecordHeaderBytes;
    switch (type) {
      case WalRecordType::kPush: {
        // Contents as the queue checked them at push (validate_contents); the fields always.
        Result<Trajectory> t = decode_trajectory(p, /*contents=*/false);
        if (!t.ok()) {
          return t.status().with_context(fmt::format("WAL {}: push record at offset {}", path_, off));
        }
        const std::uint64_t id = t->id.value();
        if (index_.count(id) != 0) {
          return data_loss(
              fmt::format("WAL {}: push record at offset {}: trajectory {} pushed twice", path_, off, id));
        }
        c_.newest = std::max(c_.newest, t->version);
        live_.push_back(std::move(*t));
        index_.emplace(id, std::prev(live_.end()));
        return ok_status();
      }
      case WalRecordType::kRetire: {
        ByteReader r(p, "retire record", payload_at);
        const std::uint8_t reason = r.u8("reason");
        if (reason > std::uint8_t(WalRetireReason::kWindow)) {
          r.fail(payload_at, fmt::format("reason {} is not a WalRetireReason", reason));
        }
        if (r.bytes("padding", 7) != std::string_view("\0\0\0\0\0\0\0", 7)) {
          r.fail(payload_at + 1, "nonzero padding");
        }
        const std::uint64_t n = r.u64("count");
        r.array("ids", n, ids_);
        if (Status st = r.finish(); !st.ok()) return st.with_context(fmt::format("WAL {}", path_));
        for (std::uint64_t id : ids_) {
          if (listener_.retired) listener_.retired(id);
          if (auto it = index_.find(id); it != index_.end()) {
            live_.erase(it->second);
            index_.erase(it);
            ++c_.retired;
          }
        }
        return ok_status();
      }
      case WalRecordType::kGroupClosed:
      case WalRecordType::kVersion: {
        const bool version = type == WalRecordType::kVersion;
        ByteReader r(p, version ? "version record" : "group-closed record", payload_at);
        const std::uint64_t v = r.u64(version ? "version" : "group id");
        if (Status st = r.finish(); !st.ok()) return st.with_context(fmt::format("WAL {}", path_));
        if (version) {
          c_.newest = std::max(c_.newest, Version(v));
        } else if (listener_.group_closed) {
          listener_.group_closed(GroupId(v));
        }
        return ok_status();
      }
    }
    return internal_error(fmt::format("WAL {}: record type {} passed the header check", path_, int(type)));
  }

  void finish() {
    c_.live.reserve(live_.size());
    for (Trajectory& t : live_) {
      c_.live_bytes += TrajectoryWal::push_record_bytes(t);
      c_.live.push_back(std::move(t));
    }
    live_.clear();
    index_.clear();
  }

 private:
  const std::string& path_;
  const TrajectoryWal::Listener& listener_;
  TrajectoryWal::Contents& c_;
  std::list<Trajectory> live_;  // pushed, not yet retired, in log order
  std::unordered_map<std::uint64_t, std::list<Trajectory>::iterator> index_;
  std::vector<std::uint64_t> ids_;  // of the retire record being read, kept to reuse its memory
};

}  // namespace

Result<std::unique_ptr<TrajectoryWal>> TrajectoryWal::open(const std::string& path, bool fsync_each,
                                                           const Listener& listener, Contents& contents,
                                                           RecoveryReport& report) {
  report = RecoveryReport{};
  contents = Contents{};
  Replayer replay(path, listener, contents);
  if (path.empty()) return invalid_argument("WAL path is empty");
  // The type is checked before the open, which would fail on a directory and could block on a
  // FIFO, and again after it on what was opened, in case the path changed in between.
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) return not_a_regular_file(path, st.st_mode);
  // O_NONBLOCK: opening a FIFO never waits for a writer; it changes nothing for a regular file.
  Fd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0644));
  if (fd.get() < 0) {
    const int e = errno;
    return Status(e == ENOENT || e == ENOTDIR || e == EACCES ? StatusCode::kInvalidArgument
                  : e == EISDIR || e == ENXIO             ? StatusCode::kFailedPrecondition
                                                          : StatusCode::kUnavailable,
                  fmt::format("WAL {}: cannot open: {}", path, errno_text(e)));
  }
  if (::fstat(fd.get(), &st) != 0) return io_error("fstat", path, errno);
  if (!S_ISREG(st.st_mode)) return not_a_regular_file(path, st.st_mode);
  LAMINAR_RETURN_IF_ERROR(lock(fd.get(), path));
  std::uint64_t good_end = kFileHeaderBytes;
  std::uint64_t records = 0;
  {
    FileReader in(fd.get(), std::uint64_t(st.st_size), path);
    Result<std::string_view> first = in.read(0, std::size_t(std::min<std::uint64_t>(in.size(), kFileHeaderBytes)));
    if (!first.ok()) return first.status();
    const std::string header_bytes = file_header();
    if (in.size() < kFileHeaderBytes) {
      // Empty: open(O_CREAT) made it, or a crash came before the header. A prefix of the header
      // this build writes: the crash came while writing it. Either way nothing was logged. Any
      // other bytes are someone else's, and are not overwritten.
      if (*first != std::string_view(header_bytes).substr(0, first->size())) return not_a_wal(path, *first);
      if (!first->empty()) {
        report.replayed = true;
        report.discarded_bytes = first->size();
        report.tail = data_loss(
            fmt::format("WAL {}: file header cut short at offset 0 ({} of {} bytes); started afresh", path,
                        first->size(), kFileHeaderBytes));
      }
      LAMINAR_RETURN_IF_ERROR(write_file_header(fd.get(), path));
      if (fsync_each) {
        // The first records' fdatasync would make the header durable but not the file's name.
        if (::fsync(fd.get()) != 0) return io_error("fsync", path, errno);
        LAMINAR_RETURN_IF_ERROR(sync_dir_of(path));
      }
    } else {
      if (first->substr(0, kFileMagic.size()) != kFileMagic) return not_a_wal(path, *first);
      const std::string what = "WAL " + path;
      ByteReader header(first->substr(kFileMagic.size()), what, kFileMagic.size());
      const std::uint32_t format = header.u32("format");
      if (format != kFormat) {
        return failed_precondition(fmt::format("WAL {}: written in format {}, which this build does not read "
                                               "(it reads format {}); refusing to replay or overwrite it",
                                               path, format, kFormat));
      }
      // Bytes 12..16 are reserved: written as zero, not checked.
      report.replayed = true;
      std::uint64_t off = kFileHeaderBytes;
      while (off < in.size()) {
        Result<Found> rec = read_record(in, off, what);
        if (!rec.ok()) return rec.status();
        if (rec->kind == Found::kGood) {
          LAMINAR_RETURN_IF_ERROR(replay.record(rec->type, rec->payload, off));
          ++records;
          off += kRecordHeaderBytes + rec->payload.size();
          good_end = off;
          continue;
        }
        if (rec->kind == Found::kDamaged) {
          // Every record starts with a nonzero magic, so zeros hide none; anything else might.
          Result<std::uint64_t> nonzero = in.first_nonzero(rec->after);
          if (!nonzero.ok()) return nonzero.status();
          if (*nonzero < in.size()) {
            return data_loss(fmt::format(
                "{}, and {} bytes that are not all zero follow it (the first nonzero one at offset {}): records "
                "may lie past the damage, so the log is not cut (cutting it to {} bytes would drop them)",
                rec->why.message(), in.size() - rec->after, *nonzero, off));
          }
        }
        report.discarded_bytes = in.size() - off;
        report.tail = data_loss(fmt::format("{}; torn or corrupt tail: {} bytes cut, {} earlier records kept",
                                            rec->why.message(), report.discarded_bytes, records));
        break;
      }
      if (good_end < in.size()) {
        if (::ftruncate(fd.get(), off_t(good_end)) != 0) return io_error("ftruncate", path, errno);
        if (::fsync(fd.get()) != 0) return io_error("fsync", path, errno);
      }
    }
  }
  report.records = records;
  replay.finish();
  report.recovered = contents.live.size();
  if (::lseek(fd.get(), off_t(good_end), SEEK_SET) < 0) return io_error("lseek", path, errno);
  auto wal = std::unique_ptr<TrajectoryWal>(new TrajectoryWal(path, std::move(fd), good_end, fsync_each));
  wal->records_ = records;
  return wal;
}

std::uint64_t TrajectoryWal::push_record_bytes(const Trajectory& t) {
  return kRecordHeaderBytes + encoded_trajectory_size(t);
}

Status TrajectoryWal::append_retire(WalRetireReason reason, std::span<const std::uint64_t> ids) {
  if (ids.empty()) return ok_status();
  std::string buf;
  ByteWriter w(buf);
  w.reserve(16 + 8 * ids.size());
  w.u8(std::uint8_t(reason));
  w.bytes(std::string_view("\0\0\0\0\0\0\0", 7));  // aligns the ids to 8 bytes
  w.u64(ids.size());
  w.array(ids);
  return append(WalRecordType::kRetire, buf);
}

Status TrajectoryWal::append_u64(WalRecordType type, std::uint64_t v, bool sync) {
  std::string payload;
  ByteWriter(payload).u64(v);
  return append(type, payload, sync);
}

Status TrajectoryWal::compact(const Snapshot& s) {
  return rewrite([&s](TrajectoryWal& w) -> Status {
    LAMINAR_RETURN_IF_ERROR(w.append_u64(WalRecordType::kVersion, s.newest.value()));
    // The dedup window survives a restart too (kWindow records no ack), then the closed groups.
    if (!s.window.empty()) LAMINAR_RETURN_IF_ERROR(w.append_retire(WalRetireReason::kWindow, s.window));
    for (GroupId g : s.closed_groups) LAMINAR_RETURN_IF_ERROR(w.append_u64(WalRecordType::kGroupClosed, g.value()));
    std::string buf;
    for (const Trajectory* t : s.live) {
      buf.clear();
      encode_trajectory(*t, buf);
      LAMINAR_RETURN_IF_ERROR(w.append(WalRecordType::kPush, buf));
    }
    return ok_status();
  });
}

std::uint64_t TrajectoryWal::checksum(WalRecordType type, std::string_view payload) {
  return record_checksum(std::uint32_t(type), payload.size(), payload);
}

void TrajectoryWal::cut_back() {
  if (::ftruncate(fd_.get(), off_t(size_)) == 0) (void)::lseek(fd_.get(), off_t(size_), SEEK_SET);
}

Status TrajectoryWal::append(WalRecordType type, std::string_view payload, bool sync) {
  const Record one{type, payload, checksum(type, payload)};
  return append_all(std::span<const Record>(&one, 1), sync);
}

Status TrajectoryWal::append_all(std::span<const Record> records, bool sync) {
  std::string headers;
  headers.reserve(kRecordHeaderBytes * records.size());
  for (const Record& r : records) put_record_header(headers, r.type, r.payload.size(), r.checksum);
  std::uint64_t written = 0;
  for (std::size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    iovec iov[2] = {{headers.data() + i * kRecordHeaderBytes, kRecordHeaderBytes},
                    {const_cast<char*>(r.payload.data()), r.payload.size()}};
    const std::size_t total = kRecordHeaderBytes + r.payload.size();
    std::size_t done = 0;
    while (done < total) {
      // Rebuild the vector past what was written (writev may stop early on a signal or a full disk).
      iovec cur[2];
      int n = 0;
      std::size_t skip = done;
      for (const iovec& v : iov) {
        if (skip >= v.iov_len) {
          skip -= v.iov_len;
          continue;
        }
        cur[n++] = {static_cast<char*>(v.iov_base) + skip, v.iov_len - skip};
        skip = 0;
      }
      const ssize_t wrote = ::writev(fd_.get(), cur, n);
      if (wrote < 0) {
        if (errno == EINTR) continue;
        const int e = errno;
        // Cut the partial record so later appends do not sit behind a torn one.
        cut_back();
        return io_error("append", path_, e);
      }
      done += std::size_t(wrote);
    }
    written += total;
  }
  if (sync && fsync_each_ && ::fdatasync(fd_.get()) != 0) {
    // The caller is told the records are not in the log, so they must not come back on replay.
    const int e = errno;
    cut_back();
    return io_error("fdatasync", path_, e);
  }
  size_ += written;
  records_ += records.size();
  return ok_status();
}

namespace {

// A compaction interrupted by a crash leaves its file behind, which the next one replaces; anything
// else at that path is not the log's to overwrite (nor is a link, which would be followed).
Status check_compaction_path(const std::string& tmp) {
  struct stat st;
  if (::lstat(tmp.c_str(), &st) != 0) return errno == ENOENT ? ok_status() : io_error("lstat", tmp, errno);
  if (!S_ISREG(st.st_mode)) return not_a_regular_file(tmp, st.st_mode);
  Fd fd(::open(tmp.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
  if (fd.get() < 0) return io_error("open", tmp, errno);
  std::string first(kFileMagic.size(), '\0');
  const ssize_t n = ::pread(fd.get(), first.data(), first.size(), 0);
  if (n < 0) return io_error("read", tmp, errno);
  first.resize(std::size_t(n));
  if (first != kFileMagic) return not_a_wal(tmp, first);
  return ok_status();
}

}  // namespace

Status TrajectoryWal::rewrite(const std::function<Status(TrajectoryWal&)>& write_live) {
  const std::string tmp = path_ + ".compact";
  LAMINAR_RETURN_IF_ERROR(check_compaction_path(tmp));
  Fd fd(::open(tmp.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (fd.get() < 0) return io_error("open", tmp, errno);
  // Locked before it takes the log's name, so the log is never without its lock.
  LAMINAR_RETURN_IF_ERROR(lock(fd.get(), tmp));
  LAMINAR_RETURN_IF_ERROR(write_file_header(fd.get(), tmp));
  TrajectoryWal fresh(tmp, std::move(fd), kFileHeaderBytes, false);
  Status st = write_live(fresh);
  if (st.ok() && ::fsync(fresh.fd_.get()) != 0) st = io_error("fsync", tmp, errno);
  if (st.ok() && ::rename(tmp.c_str(), path_.c_str()) != 0) st = io_error("rename", tmp, errno);
  if (!st.ok()) {
    ::unlink(tmp.c_str());
    return st;
  }
  LAMINAR_RETURN_IF_ERROR(sync_dir_of(path_));
  fd_ = std::move(fresh.fd_);
  size_ = fresh.size_;
  records_ = fresh.records_;
  return ok_status();
}

}  // namespace laminar::internal
