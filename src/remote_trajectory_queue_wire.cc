// The remote trajectory queue's message bodies (see remote_trajectory_queue_wire.h).
#include "remote_trajectory_queue_wire.h"

#include <fmt/format.h>

#include <string_view>

#include "byte_codec.h"

namespace laminar::internal {
namespace {

constexpr std::uint32_t kPushMagic = 0x31505154u;      // "TQP1"
constexpr std::uint32_t kPushManyMagic = 0x314d5154u;  // "TQM1"
constexpr std::string_view kZeros("\0\0\0\0", 4);

void read_padding(ByteReader& r, std::size_t n) {
  const std::size_t at = r.offset();
  if (r.bytes("padding", n) != kZeros.substr(0, n)) r.fail(at, "nonzero padding");
}

// The fields both push headers open with.
template <class Out>
void write_wait(ByteWriter<Out>& w, std::uint32_t magic, QueuePushWait wait) {
  w.u32(magic);
  w.u8(std::uint8_t(wait.mode));
  w.bytes(kZeros.substr(0, 3));
  w.i64(wait.timeout_ns);
}

QueuePushWait read_wait(ByteReader& r, std::uint32_t magic) {
  const std::size_t at = r.offset();
  const std::uint32_t m = r.u32("magic");
  if (r.ok() && m != magic) r.fail(at, fmt::format("bad magic {:#010x}", m));
  QueuePushWait wait;
  wait.mode = PushMode(r.u8("mode"));
  read_padding(r, 3);
  wait.timeout_ns = r.i64("timeout_ns");
  return wait;
}

Status check_wait(std::string_view what, QueuePushWait wait) {
  if (std::uint8_t(wait.mode) > std::uint8_t(PushMode::kTimeout) || wait.timeout_ns < 0) {
    return invalid_argument(
        fmt::format("{}: push mode {} with timeout {} ns", what, int(wait.mode), wait.timeout_ns));
  }
  return ok_status();
}

}  // namespace

std::vector<std::byte> encode_queue_hello(std::uint32_t credits) {
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.u32(kQueueProtocol);
  w.u32(credits);
  return out;
}

Result<std::uint32_t> decode_queue_hello(std::span<const std::byte> body) {
  ByteReader r(body, "queue hello answer");
  const std::uint32_t protocol = r.u32("protocol");
  if (r.ok() && protocol != kQueueProtocol) {
    r.fail(0, fmt::format("protocol {} (expected {})", protocol, kQueueProtocol));
  }
  const std::uint32_t credits = r.u32("credits");
  if (r.ok() && credits == 0) r.fail(4, "no credits granted");
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return credits;
}

void encode_queue_push(const Trajectory& t, QueuePushWait wait, std::string& out) {
  ByteWriter w(out);
  w.reserve(kQueuePushHeaderBytes + encoded_trajectory_size(t));
  write_wait(w, kPushMagic, wait);
  encode_trajectory(t, out);
}

Result<QueuePush> decode_queue_push(std::span<const std::byte> body) {
  constexpr std::string_view kWhat = "queue push message";
  ByteReader r(body, kWhat);
  ByteReader h = r.sub("header", kQueuePushHeaderBytes);
  const QueuePushWait wait = read_wait(h, kPushMagic);
  LAMINAR_RETURN_IF_ERROR(h.finish());
  LAMINAR_RETURN_IF_ERROR(check_wait(kWhat, wait));
  const std::string_view rest = r.bytes("trajectory", r.left());
  Result<Trajectory> t = decode_trajectory(rest, /*contents=*/false);
  if (!t.ok()) return t.status().with_context(fmt::format("{}: trajectory at offset {}", kWhat, kQueuePushHeaderBytes));
  QueuePush push{wait, {}};
  push.trajectories.push_back(std::move(t).value());
  return push;
}

void append_queue_push_many_item(const Trajectory& t, std::string& out) {
  ByteWriter w(out);
  const std::size_t size = encoded_trajectory_size(t);
  w.reserve(8 + size);
  w.u64(size);
  encode_trajectory(t, out);
}

void write_queue_push_many_header(QueuePushWait wait, std::uint32_t count, std::string& out) {
  LAMINAR_CHECK(out.size() >= kQueuePushManyHeaderBytes);
  std::string header;
  ByteWriter w(header);
  write_wait(w, kPushManyMagic, wait);
  w.u32(count);
  w.bytes(kZeros);
  out.replace(0, header.size(), header);
}

Result<QueuePush> decode_queue_push_many(std::span<const std::byte> body) {
  constexpr std::string_view kWhat = "queue push_many message";
  ByteReader r(body, kWhat);
  ByteReader h = r.sub("header", kQueuePushManyHeaderBytes);
  QueuePush push{read_wait(h, kPushManyMagic), {}};
  const std::uint32_t count = h.u32("count");
  read_padding(h, 4);
  LAMINAR_RETURN_IF_ERROR(h.finish());
  LAMINAR_RETURN_IF_ERROR(check_wait(kWhat, push.wait));
  if (count == 0 || count > kMaxPushManyCount) {
    return invalid_argument(fmt::format("{}: {} trajectories, not in [1, {}]", kWhat, count, kMaxPushManyCount));
  }
  push.trajectories.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i) {
    // Which trajectory is named only on failure: formatting it for every field read would cost
    // more than reading it.
    const std::uint64_t len = r.u64("length");
    const std::size_t at = r.offset();
    const std::string_view bytes = r.bytes("encoding", len);
    if (!r.ok()) return r.status().with_context(fmt::format("trajectory {} of {}", i, count));
    Result<Trajectory> t = decode_trajectory(bytes, /*contents=*/false);
    if (!t.ok()) {
      return t.status().with_context(fmt::format("{}: trajectory {} of {} at offset {}", kWhat, i, count, at));
    }
    push.trajectories.push_back(std::move(t).value());
  }
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return push;
}

std::string encode_queue_statuses(std::span<const Status> statuses) {
  std::string out;
  ByteWriter w(out);
  w.u32(std::uint32_t(statuses.size()));
  for (const Status& s : statuses) {
    w.u8(std::uint8_t(s.code()));
    w.bytes(kZeros.substr(0, 3));
    w.prefixed(s.message());
  }
  return out;
}

Result<std::vector<Status>> decode_queue_statuses(std::span<const std::byte> body) {
  // A status takes at least its code, padding and length.
  constexpr std::size_t kMinStatusBytes = 8;
  ByteReader r(body, "queue push_many answer");
  const std::uint32_t count = r.u32("count");
  if (r.ok() && count > r.left() / kMinStatusBytes) {
    r.fail(0, fmt::format("count {} does not fit in the {} bytes that follow", count, r.left()));
  }
  if (!r.ok()) return r.status();
  std::vector<Status> out;
  out.reserve(count);
  for (std::uint32_t i = 0; i < count && r.ok(); ++i) {
    const std::size_t at = r.offset();
    const std::uint8_t code = r.u8("status code");
    if (r.ok() && code > std::uint8_t(StatusCode::kInternal)) r.fail(at, fmt::format("status code {}", code));
    read_padding(r, 3);
    const std::string_view message = r.prefixed("message", r.left());
    out.emplace_back(StatusCode(code), std::string(message));
  }
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return out;
}

}  // namespace laminar::internal
