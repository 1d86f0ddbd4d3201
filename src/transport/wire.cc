// Frame and RemoteRegion encoding (see wire.h). Everything a peer sends is validated here before
// the transport looks at it.
#include "transport/wire.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <iterator>
#include <string_view>

#include "byte_codec.h"

namespace laminar::internal {
namespace {

using Writer = ByteWriter<std::vector<std::byte>>;

std::uint64_t checksum(std::span<const std::byte> b) { return XXH3_64bits(b.data(), b.size()); }

std::vector<std::byte> copy(std::string_view b) {
  const auto* p = reinterpret_cast<const std::byte*>(b.data());
  return {p, p + b.size()};
}

// What the errors of each kind call its frames.
std::string_view frame_name(FrameKind kind) {
  static constexpr std::string_view kNames[] = {"transport message frame", "transport request frame",
                                                "transport reply frame", "transport error reply frame"};
  static_assert(std::size(kNames) == kMaxFrameKind);
  return kNames[std::uint8_t(kind) - 1];
}

// Error text is cut to what a peer may send.
void write_error(Writer& w, const std::string& error) {
  w.prefixed(std::string_view(error).substr(0, kMaxErrorTextBytes));
}

void write_message(Writer& w, const Frame& f) {
  w.u32(f.type);
  w.u64(checksum(f.body));
  w.u64(f.body.size());
  w.bytes(std::span(f.body));
}

std::uint64_t read_request_id(ByteReader& r) {
  const std::size_t at = r.offset();
  const std::uint64_t id = r.u64("request id");
  if (r.ok() && id == 0) r.fail(at, "request id 0");
  return id;
}

// A message's type and body. The body is refused before it is copied when it is longer than
// max_body_bytes (kInvalidArgument; a length past the frame's end is kDataLoss, as for any field)
// or fails its checksum.
Status read_message(ByteReader& r, std::string_view what, std::size_t max_body_bytes, Frame& f) {
  f.type = r.u32("message type");
  const std::size_t sum_at = r.offset();
  const std::uint64_t sum = r.u64("checksum");
  const std::size_t length_at = r.offset();
  const std::uint64_t length = r.u64("body length");
  const std::string_view body = r.bytes("body", length);
  if (r.ok() && length > max_body_bytes) {
    return invalid_argument(fmt::format("{}: body of {} bytes at offset {} is over the limit of {}", what, length,
                                        length_at, max_body_bytes));
  }
  if (r.ok() && checksum(std::as_bytes(std::span(body.data(), body.size()))) != sum) {
    r.fail(sum_at, fmt::format("message body of {} bytes fails its checksum", length));
  }
  if (r.ok()) f.body = copy(body);
  return ok_status();
}

}  // namespace

std::vector<std::byte> encode_frame(const Frame& f) {
  std::vector<std::byte> out;
  Writer w(out);
  w.reserve(32 + f.body.size() + std::min(f.error.size(), kMaxErrorTextBytes));
  w.u8(kWireVersion);
  w.u8(std::uint8_t(f.kind));
  switch (f.kind) {
    case FrameKind::kRequest:
    case FrameKind::kReply:
      w.u64(f.id);
      [[fallthrough]];
    case FrameKind::kMessage:
      write_message(w, f);
      break;
    case FrameKind::kErrorReply:
      w.u64(f.id);
      w.u8(std::uint8_t(f.code));
      write_error(w, f.error);
      break;
  }
  return out;
}

Result<Frame> decode_frame(std::span<const std::byte> wire, std::size_t max_body_bytes) {
  if (wire.size() > max_body_bytes + kFrameOverheadBytes) {
    return invalid_argument(fmt::format("frame of {} bytes is over the limit of {} (max_message_bytes {})",
                                        wire.size(), max_body_bytes + kFrameOverheadBytes, max_body_bytes));
  }
  ByteReader head(wire, "transport frame");
  const std::uint8_t version = head.u8("version");
  if (head.ok() && version != kWireVersion) {
    head.fail(0, fmt::format("version {} is not the supported {}", version, kWireVersion));
  }
  const std::uint8_t kind = head.u8("kind");
  if (head.ok() && (kind == 0 || kind > kMaxFrameKind)) head.fail(1, fmt::format("unknown kind {}", kind));
  LAMINAR_RETURN_IF_ERROR(head.status());

  Frame f;
  f.kind = FrameKind(kind);
  const std::string_view what = frame_name(f.kind);
  ByteReader r(wire.subspan(head.offset()), what, head.offset());
  switch (f.kind) {
    case FrameKind::kRequest:
    case FrameKind::kReply:
      f.id = read_request_id(r);
      [[fallthrough]];
    case FrameKind::kMessage:
      LAMINAR_RETURN_IF_ERROR(read_message(r, what, max_body_bytes, f));
      break;
    case FrameKind::kErrorReply: {
      f.id = read_request_id(r);
      const std::size_t at = r.offset();
      const std::uint8_t code = r.u8("status code");
      if (r.ok() && (code == 0 || code > std::uint8_t(StatusCode::kInternal))) {
        r.fail(at, fmt::format("unknown status code {}", code));
      }
      f.code = StatusCode(code);
      f.error = r.prefixed("error text", kMaxErrorTextBytes);
      break;
    }
  }
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return f;
}

}  // namespace laminar::internal

namespace laminar {

namespace {
// A packed UCX remote key is a few hundred bytes at most; this bounds what a peer can make us hold.
constexpr std::size_t kMaxRkeyBytes = 64 * 1024;
}  // namespace

std::vector<std::byte> RemoteRegion::serialize() const {
  std::vector<std::byte> out;
  internal::Writer w(out);
  w.reserve(33 + rkey.size());
  w.u8(internal::kWireVersion);
  w.u64(address);
  w.u64(size);
  w.u32(std::uint32_t(rkey.size()));
  w.bytes(std::span(rkey));
  w.u32(pid);
  w.u64(host);
  return out;
}

Result<RemoteRegion> RemoteRegion::deserialize(std::span<const std::byte> bytes) {
  internal::ByteReader r(bytes, "remote region");
  const std::uint8_t version = r.u8("version");
  if (r.ok() && version != internal::kWireVersion) {
    r.fail(0, fmt::format("version {} is not the supported {}", version, internal::kWireVersion));
  }
  RemoteRegion region;
  region.address = r.u64("address");
  const std::size_t size_at = r.offset();
  region.size = r.u64("size");
  if (r.ok() && region.address + region.size < region.address) {
    r.fail(size_at, fmt::format("address {:#x} + size {} overflows", region.address, region.size));
  }
  const std::size_t rkey_at = r.offset();
  region.rkey = internal::copy(r.prefixed("remote key", kMaxRkeyBytes));
  if (r.ok() && region.rkey.empty()) r.fail(rkey_at, "empty remote key");
  region.pid = r.u32("pid");
  region.host = r.u64("host");
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return region;
}

}  // namespace laminar
