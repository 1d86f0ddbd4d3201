#include "local_relay_wire.h"

#include <fmt/format.h>

#include <algorithm>

#include "byte_codec.h"

namespace laminar::internal {

namespace {

// The fields of the fixed header: 48 bytes before the checksums.
constexpr std::size_t kGrantFixedBytes = 48;

template <std::size_t N>
std::array<std::byte, N> to_array(const std::vector<std::byte>& v) {
  LAMINAR_CHECK(v.size() == N);
  std::array<std::byte, N> out;
  std::copy(v.begin(), v.end(), out.begin());
  return out;
}

void read_magic(ByteReader& r) {
  const std::size_t at = r.offset();
  const std::uint32_t magic = r.u32("magic");
  if (r.ok() && magic != kLocalRelayMagic) r.fail(at, fmt::format("bad magic {:#010x}", magic));
}

// A word the request does not use (`request` names it): 0.
void read_unused(ByteReader& r, std::string_view field, std::string_view request) {
  const std::size_t at = r.offset();
  const std::uint64_t x = r.u64(field);
  if (x != 0) r.fail(at, fmt::format("{} is {}, but {} leaves it 0", field, x, request));
}

}  // namespace

std::array<std::byte, kLocalRequestBytes> encode_local_request(const LocalRequestFrame& r) {
  std::uint64_t a = 0;
  std::uint64_t b = 0;
  if (r.type == LocalRequest::kAcquire && r.version) {
    a = 1;
    b = r.version->value();
  } else if (r.type == LocalRequest::kRelease) {
    a = r.lease;
  }
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.u32(kLocalRelayMagic);
  w.u32(std::uint32_t(r.type));
  w.u64(a);
  w.u64(b);
  return to_array<kLocalRequestBytes>(out);
}

Result<LocalRequestFrame> decode_local_request(std::span<const std::byte> frame) {
  ByteReader r(frame, "local relay request");
  read_magic(r);
  const std::size_t type_at = r.offset();
  const std::uint32_t type = r.u32("type");
  LocalRequestFrame f;
  switch (LocalRequest(type)) {
    case LocalRequest::kNewest:
      f.type = LocalRequest::kNewest;
      read_unused(r, "a", "a newest request");
      read_unused(r, "b", "a newest request");
      break;
    case LocalRequest::kAcquire: {
      f.type = LocalRequest::kAcquire;
      const std::size_t flag_at = r.offset();
      const std::uint64_t flag = r.u64("a");
      if (flag == 1) {
        f.version = Version(r.u64("b"));
      } else {
        if (flag != 0) r.fail(flag_at, fmt::format("acquire with flag {}, not 0 or 1", flag));
        read_unused(r, "b", "an acquire of the newest");
      }
      break;
    }
    case LocalRequest::kRelease:
      f.type = LocalRequest::kRelease;
      f.lease = r.u64("a");
      read_unused(r, "b", "a release request");
      break;
    default:
      if (r.ok()) r.fail(type_at, fmt::format("unknown type {}", type));
  }
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return f;
}

std::array<std::byte, kLocalReplyHeaderBytes> encode_local_reply_header(const LocalReplyHeader& h) {
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.u32(kLocalRelayMagic);
  w.u32(std::uint32_t(h.type));
  w.u64(h.payload_bytes);
  return to_array<kLocalReplyHeaderBytes>(out);
}

Result<LocalReplyHeader> decode_local_reply_header(std::span<const std::byte> header) {
  ByteReader r(header, "local relay reply header");
  read_magic(r);
  const std::size_t type_at = r.offset();
  const std::uint32_t type = r.u32("type");
  const std::size_t len_at = r.offset();
  const std::uint64_t len = r.u64("payload_bytes");
  LocalReplyHeader h;
  h.type = LocalReply(type);
  h.payload_bytes = len;
  if (h.type != LocalReply::kNewestIs && h.type != LocalReply::kGrant && h.type != LocalReply::kError) {
    r.fail(type_at, fmt::format("unknown type {}", type));
  }
  if (len > kLocalMaxPayloadBytes) {
    r.fail(len_at, fmt::format("payload of {} bytes is over the limit of {}", len, kLocalMaxPayloadBytes));
  }
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return h;
}

std::vector<std::byte> encode_local_newest(std::optional<Version> newest) {
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.u64(newest ? 1 : 0);
  w.u64(newest ? newest->value() : 0);
  return out;
}

Result<std::optional<Version>> decode_local_newest(std::span<const std::byte> payload) {
  ByteReader r(payload, "local relay newest reply");
  const std::size_t has_at = r.offset();
  const std::uint64_t has = r.u64("has");
  if (has > 1) r.fail(has_at, fmt::format("has is {}, not 0 or 1", has));
  const std::size_t version_at = r.offset();
  const std::uint64_t version = r.u64("version");
  if (has == 0 && version != 0) r.fail(version_at, fmt::format("version is {} without has", version));
  LAMINAR_RETURN_IF_ERROR(r.finish());
  if (has == 0) return std::optional<Version>();
  return std::optional<Version>(Version(version));
}

std::vector<std::byte> encode_local_grant(const LocalGrantPayload& g) {
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.reserve(kGrantFixedBytes + 8 * g.checksums.size() + g.manifest_json.size());
  w.u64(g.lease);
  w.u64(g.version.value());
  w.u64(g.total_bytes);
  w.u64(g.chunk_bytes);
  w.u64(g.checksums.size());
  w.u64(g.manifest_json.size());
  w.array(std::span(g.checksums));
  w.bytes(g.manifest_json);
  return out;
}

Result<LocalGrantPayload> decode_local_grant(std::span<const std::byte> payload) {
  ByteReader r(payload, "local relay grant");
  LocalGrantPayload g;
  g.lease = r.u64("lease");
  g.version = Version(r.u64("version"));
  g.total_bytes = r.u64("total_bytes");
  g.chunk_bytes = r.u64("chunk_bytes");
  const std::size_t counts_at = r.offset();
  const std::uint64_t num_chunks = r.u64("num_chunks");
  const std::uint64_t json_bytes = r.u64("json_bytes");
  // Both counts against what is there before either is used: they must add up to it exactly.
  const std::uint64_t rest = r.left();
  if (r.ok() && (num_chunks > rest / 8 || json_bytes != rest - num_chunks * 8)) {
    r.fail(counts_at, fmt::format("{} checksums and {} manifest bytes announced, {} bytes follow", num_chunks,
                                  json_bytes, rest));
  }
  r.array("checksums", std::size_t(num_chunks), g.checksums);
  g.manifest_json = r.bytes("manifest", std::size_t(json_bytes));
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return g;
}

std::vector<std::byte> encode_local_error(const Status& st) {
  LAMINAR_CHECK(!st.ok());
  const std::string_view msg = std::string_view(st.message()).substr(0, kLocalMaxErrorTextBytes);
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.reserve(4 + msg.size());
  w.u32(std::uint32_t(st.code()));
  w.bytes(msg);
  return out;
}

Result<LocalErrorPayload> decode_local_error(std::span<const std::byte> payload) {
  ByteReader r(payload, "local relay error reply");
  const std::uint32_t code = r.u32("code");
  if (code == 0) r.fail(0, "status code 0 (OK) in an error reply");
  if (code > std::uint32_t(StatusCode::kInternal)) r.fail(0, fmt::format("unknown status code {}", code));
  const std::size_t message_at = r.offset();
  if (r.left() > kLocalMaxErrorTextBytes) {
    r.fail(message_at, fmt::format("message of {} bytes is over the limit of {}", r.left(), kLocalMaxErrorTextBytes));
  }
  LocalErrorPayload e;
  e.code = StatusCode(code);
  e.message = r.bytes("message", r.left());
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return e;
}

}  // namespace laminar::internal
