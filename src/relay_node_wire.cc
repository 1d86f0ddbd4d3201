#include "relay_node_wire.h"

#include <fmt/format.h>

#include <limits>

#include "byte_codec.h"

namespace laminar::internal {

namespace {

// The has-flag of a subscribe: 0 or 1, and no version without it.
std::optional<Version> read_have(ByteReader& r) {
  const std::size_t has_at = r.offset();
  const std::uint8_t has = r.u8("has");
  const std::size_t newest_at = r.offset();
  const std::uint64_t newest = r.u64("newest");
  if (has > 1) r.fail(has_at, fmt::format("has is {}, not 0 or 1", has));
  if (has == 0 && newest != 0) r.fail(newest_at, fmt::format("newest is {} without has", newest));
  if (has == 0) return std::nullopt;
  return Version(newest);
}

}  // namespace

std::vector<std::byte> encode_relay_subscribe(const RelaySubscribe& m) {
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.u8(m.have ? 1 : 0);
  w.u64(m.have ? m.have->value() : 0);
  w.u64(m.idle_every_ns);
  return out;
}

Result<RelaySubscribe> decode_relay_subscribe(std::span<const std::byte> body) {
  ByteReader r(body, "relay subscribe message");
  RelaySubscribe m;
  m.have = read_have(r);
  m.idle_every_ns = r.u64("idle_every_ns");
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return m;
}

std::vector<std::byte> encode_relay_begin(const RelayBegin& m) {
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.reserve(16 + m.manifest_json.size());
  w.u64(m.version.value());
  w.u64(m.chunk_bytes);
  w.bytes(m.manifest_json);
  return out;
}

Result<RelayBegin> decode_relay_begin(std::span<const std::byte> body) {
  ByteReader r(body, "relay begin message");
  RelayBegin m;
  m.version = Version(r.u64("version"));
  m.chunk_bytes = r.u64("chunk_bytes");
  m.manifest_json = r.bytes("manifest", r.left());
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return m;
}

std::vector<std::byte> encode_relay_begin_reply(const RelayBeginReply& m) {
  LAMINAR_CHECK(m.missing.size() <= std::numeric_limits<std::uint32_t>::max());
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.reserve(4 + 4 * m.missing.size() + m.region.size());
  w.u32(std::uint32_t(m.missing.size()));
  w.array(std::span(m.missing));
  w.bytes(std::span(m.region));
  return out;
}

Result<RelayBeginReply> decode_relay_begin_reply(std::span<const std::byte> body) {
  ByteReader r(body, "relay begin reply");
  RelayBeginReply m;
  const std::uint32_t n = r.u32("missing count");
  const std::size_t missing_at = r.offset();
  r.array("missing", n, m.missing);
  for (std::size_t k = 1; k < m.missing.size(); ++k) {
    if (m.missing[k] <= m.missing[k - 1]) {
      r.fail(missing_at + 4 * k, fmt::format("missing chunk {} follows chunk {}; they must ascend", m.missing[k],
                                             m.missing[k - 1]));
      break;
    }
  }
  const std::string_view region = r.bytes("region", r.left());
  const auto* p = reinterpret_cast<const std::byte*>(region.data());
  m.region.assign(p, p + region.size());
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return m;
}

std::vector<std::byte> encode_relay_chunk(const RelayChunk& m) {
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.reserve(20);
  w.u64(m.version.value());
  w.u32(m.index);
  w.u64(m.checksum);
  return out;
}

Result<RelayChunk> decode_relay_chunk(std::span<const std::byte> body) {
  ByteReader r(body, "relay chunk message");
  RelayChunk m;
  m.version = Version(r.u64("version"));
  m.index = r.u32("index");
  m.checksum = r.u64("checksum");
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return m;
}

std::vector<std::byte> encode_relay_idle(const RelayIdle&) { return {}; }

Result<RelayIdle> decode_relay_idle(std::span<const std::byte> body) {
  ByteReader r(body, "relay idle message");
  LAMINAR_RETURN_IF_ERROR(r.finish());
  return RelayIdle{};
}

}  // namespace laminar::internal
