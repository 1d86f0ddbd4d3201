// local_relay_wire.h (internal): what a LocalRelayServer and its clients (WeightPuller::create_local)
// say over their Unix domain stream socket, the codec of its frames, and the client side of it.
//
// Requests are fixed 24-byte frames {u32 magic, u32 type, u64 a, u64 b}. Replies are a 16-byte
// header {u32 magic, u32 type, u64 payload bytes} and a payload; a grant carries the version's memfd
// as SCM_RIGHTS ancillary data on its first byte. Little-endian (ByteWriter / ByteReader); a word a
// request does not use is 0.
//
//   request kNewest                      -> kNewestIs {u64 has, u64 version (0 unless has)}
//   request kAcquire {a: 1 = version b,  -> kGrant {u64 lease, version, total_bytes, chunk_bytes,
//                     0 = newest}              num_chunks, json_bytes, u64 checksums[num_chunks],
//                                              manifest JSON} + fd
//   request kRelease {a: lease}          -> no reply
//   any request                          -> kError {u32 status code, message} instead
//
// The decoders below accept exactly what their encoders write and need no socket (the fuzz target
// tests/fuzz/local_relay_decode_fuzz.cc calls them); anything else is kDataLoss naming the frame,
// the field and its offset, and no length is trusted before it is checked against the bytes there.
// What the fields mean (a manifest that parses, a plan that fits it, the fd's seals and size) the
// connection checks.
//
//   auto frame = encode_local_request({LocalRequest::kRelease, std::nullopt, lease});
//   Result<LocalRequestFrame> r = decode_local_request(frame);   // r->lease == lease
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <sys/types.h>

#include "laminar/clock.h"
#include "laminar/relay_versions.h"
#include "laminar/status.h"
#include "laminar/types.h"
#include "laminar/weight_manifest.h"

namespace laminar::internal {

inline constexpr std::uint32_t kLocalRelayMagic = 0x3152'4d4c;  // "LMR1"
inline constexpr std::size_t kLocalRequestBytes = 24;
inline constexpr std::size_t kLocalReplyHeaderBytes = 16;
// Largest reply payload a client accepts: a manifest of many thousands of tensors fits easily.
inline constexpr std::uint64_t kLocalMaxPayloadBytes = 64ull << 20;
inline constexpr std::size_t kLocalMaxErrorTextBytes = 1024;

enum class LocalRequest : std::uint32_t { kNewest = 1, kAcquire = 2, kRelease = 3 };
enum class LocalReply : std::uint32_t { kNewestIs = 11, kGrant = 12, kError = 13 };

struct LocalRequestFrame {
  LocalRequest type = LocalRequest::kNewest;
  std::optional<Version> version;  // kAcquire: the version asked for; nullopt: the newest
  std::uint64_t lease = 0;         // kRelease
  friend bool operator==(const LocalRequestFrame&, const LocalRequestFrame&) = default;
};
std::array<std::byte, kLocalRequestBytes> encode_local_request(const LocalRequestFrame& r);
Result<LocalRequestFrame> decode_local_request(std::span<const std::byte> frame);

struct LocalReplyHeader {
  LocalReply type = LocalReply::kError;
  std::uint64_t payload_bytes = 0;  // at most kLocalMaxPayloadBytes
  friend bool operator==(const LocalReplyHeader&, const LocalReplyHeader&) = default;
};
std::array<std::byte, kLocalReplyHeaderBytes> encode_local_reply_header(const LocalReplyHeader& h);
Result<LocalReplyHeader> decode_local_reply_header(std::span<const std::byte> header);

// kNewestIs: the relay's newest committed version.
std::vector<std::byte> encode_local_newest(std::optional<Version> newest);
Result<std::optional<Version>> decode_local_newest(std::span<const std::byte> payload);

// kGrant, less the descriptor.
struct LocalGrantPayload {
  std::uint64_t lease = 0;
  Version version;
  std::uint64_t total_bytes = 0;
  std::uint64_t chunk_bytes = 0;
  std::vector<std::uint64_t> checksums;  // [number of chunks]
  std::string manifest_json;
  friend bool operator==(const LocalGrantPayload&, const LocalGrantPayload&) = default;
};
std::vector<std::byte> encode_local_grant(const LocalGrantPayload& g);
Result<LocalGrantPayload> decode_local_grant(std::span<const std::byte> payload);

// kError: the relay's own error, its message cut to kLocalMaxErrorTextBytes.
struct LocalErrorPayload {
  StatusCode code = StatusCode::kInternal;  // never kOk
  std::string message;
  friend bool operator==(const LocalErrorPayload&, const LocalErrorPayload&) = default;
};
// Precondition: !st.ok().
std::vector<std::byte> encode_local_error(const Status& st);
Result<LocalErrorPayload> decode_local_error(std::span<const std::byte> payload);

// A file descriptor closed on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }
  int get() const noexcept { return fd_; }
  int release() noexcept;
  void reset() noexcept;

 private:
  int fd_ = -1;
};

// A read-only shared mapping of [bytes] of a sealed memfd, unmapped on destruction.
class SharedMapping {
 public:
  // Which file a descriptor opens: the same memfd reached through two descriptors has one id (the
  // relay reuses a buffer's memfd for later versions).
  struct FileId {
    dev_t dev = 0;
    ino_t ino = 0;
    friend bool operator==(const FileId&, const FileId&) = default;
  };
  // Checks that fd is a memfd sealed against shrinking and writes by others and at least `bytes`
  // long: kDataLoss naming what is wrong with it.
  static Result<FileId> check(int fd, std::uint64_t bytes);
  // Maps [bytes] of a checked fd. kResourceExhausted when the mapping fails.
  static Result<std::shared_ptr<SharedMapping>> map(int fd, std::uint64_t bytes, FileId id);
  ~SharedMapping();
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;
  std::span<const std::byte> bytes() const noexcept { return {data_, size_}; }
  FileId id() const noexcept { return id_; }

 private:
  SharedMapping(const std::byte* data, std::size_t size, FileId id) : data_(data), size_(size), id_(id) {}
  const std::byte* data_;  // [size_]
  std::size_t size_;
  FileId id_;
};

// A clock and an eventfd that becomes readable on every jump of that clock, so a wait in poll() on a
// socket also ends when a virtual clock passes its deadline.
class ClockWaker {
 public:
  // kUnavailable when the eventfd cannot be made.
  static Result<std::shared_ptr<ClockWaker>> create(std::shared_ptr<Clock> clock);
  ~ClockWaker();
  ClockWaker(const ClockWaker&) = delete;
  ClockWaker& operator=(const ClockWaker&) = delete;
  const Clock& clock() const noexcept { return *clock_; }
  int fd() const noexcept { return fd_.get(); }
  // Empties the eventfd after poll() reported it readable.
  void drain() const noexcept;

 private:
  ClockWaker(std::shared_ptr<Clock> clock, UniqueFd fd) : clock_(std::move(clock)), fd_(std::move(fd)) {}
  std::shared_ptr<Clock> clock_;
  UniqueFd fd_;
  ClockSubscription wake_;
};

// One version a local relay granted: its layout and checksums, and its memory.
struct LocalGrant {
  std::uint64_t lease = 0;
  Version version;
  WeightManifest manifest;
  ChunkPlan plan;
  std::vector<std::uint64_t> checksums;  // [plan.num_chunks()]
  UniqueFd fd;
};

// The client end of one connection to a LocalRelayServer. Not thread-safe. Any failure of the
// socket or of a reply's format marks it broken(); errors the relay sent back do not.
class LocalRelayConnection {
 public:
  // kInvalidArgument for a path that does not fit a socket address, kUnavailable when nothing
  // accepts on it.
  // Waits for replies read `waker`'s clock.
  static Result<std::shared_ptr<LocalRelayConnection>> connect(const std::string& path,
                                                               std::shared_ptr<const ClockWaker> waker);

  const std::string& path() const noexcept { return path_; }
  bool broken() const noexcept { return broken_; }
  // Closes the connection (the relay then drops every lease it gave on it).
  void mark_broken() noexcept;

  // Newest committed version of the relay (nullopt: none yet).
  Result<std::optional<Version>> newest_version(Duration timeout);
  // Version v (newest when nullopt). The relay's error when it refuses (e.g. kNotFound); kUnavailable
  // / kDeadlineExceeded when the relay is gone or silent, kDataLoss for a malformed reply.
  Result<LocalGrant> acquire(std::optional<Version> v, Duration timeout);
  // Drops a lease. Best effort: a connection that is gone has dropped every lease already.
  void release(std::uint64_t lease) noexcept;

 private:
  LocalRelayConnection(UniqueFd fd, std::string path, std::shared_ptr<const ClockWaker> waker)
      : fd_(std::move(fd)), path_(std::move(path)), waker_(std::move(waker)) {}
  Status send_request(const LocalRequestFrame& request);
  // Reads one reply: its type, payload, and the descriptor that came with it (if any).
  Status read_reply(Duration timeout, LocalReply* type, std::vector<std::byte>* payload,
                    UniqueFd* fd);
  Status fail(Status why);
  // The relay's own error carried by an error reply, named after this relay (a reply too short
  // to hold a status code breaks the connection).
  Status error_reply(std::span<const std::byte> payload);

  UniqueFd fd_;
  std::string path_;
  std::shared_ptr<const ClockWaker> waker_;
  bool broken_ = false;
};

}  // namespace laminar::internal
