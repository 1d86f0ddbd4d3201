// Frame and RemoteRegion encoding (see wire.h). Everything a peer sends is validated here before
// the transport looks at it.
#include "transport/wire.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <exception>
#include <limits>
#include <nlohmann/json.hpp>

namespace laminar::internal {
namespace {

using json = nlohmann::json;
using Bytes = std::vector<std::uint8_t>;

json binary_of(std::span<const std::byte> b) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(b.data());
  return json::binary(Bytes(p, p + b.size()));
}

std::uint64_t checksum(std::span<const std::byte> b) { return XXH3_64bits(b.data(), b.size()); }

// Field readers: each names the field it could not read.
Result<std::uint64_t> read_uint(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end()) return data_loss(fmt::format("frame field '{}' is missing", key));
  if (!it->is_number_unsigned()) {
    return data_loss(fmt::format("frame field '{}' is not an unsigned integer", key));
  }
  return it->get<std::uint64_t>();
}

Result<std::vector<std::byte>> read_binary(const json& j, const char* key, std::size_t max_bytes) {
  auto it = j.find(key);
  if (it == j.end()) return data_loss(fmt::format("frame field '{}' is missing", key));
  if (!it->is_binary()) return data_loss(fmt::format("frame field '{}' is not a byte string", key));
  const Bytes& b = it->get_binary();
  if (b.size() > max_bytes) {
    return invalid_argument(
        fmt::format("frame field '{}' holds {} bytes, over the limit of {}", key, b.size(), max_bytes));
  }
  const auto* p = reinterpret_cast<const std::byte*>(b.data());
  return std::vector<std::byte>(p, p + b.size());
}

Result<std::vector<std::byte>> read_fixed(const json& j, const char* key, std::size_t bytes) {
  auto r = read_binary(j, key, bytes);
  if (!r.ok()) return r.status().code() == StatusCode::kInvalidArgument
                          ? data_loss(fmt::format("frame field '{}' must hold {} bytes", key, bytes))
                          : r.status();
  if (r->size() != bytes) {
    return data_loss(fmt::format("frame field '{}' holds {} bytes, not {}", key, r->size(), bytes));
  }
  return r;
}

Result<std::string> read_text(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end()) return data_loss(fmt::format("frame field '{}' is missing", key));
  if (!it->is_string()) return data_loss(fmt::format("frame field '{}' is not a string", key));
  const auto& s = it->get_ref<const std::string&>();
  if (s.size() > kMaxErrorTextBytes) {
    return data_loss(fmt::format("frame field '{}' holds {} bytes of text, over {}", key, s.size(),
                                 kMaxErrorTextBytes));
  }
  return s;
}

Status read_message_body(const json& j, Frame& f, std::size_t max_body_bytes) {
  auto type = read_uint(j, "t");
  if (!type.ok()) return type.status();
  if (*type > std::numeric_limits<MessageType>::max()) {
    return data_loss(fmt::format("frame field 't' = {} does not fit a message type", *type));
  }
  f.type = static_cast<MessageType>(*type);
  auto body = read_binary(j, "b", max_body_bytes);
  if (!body.ok()) return body.status();
  f.body = std::move(*body);
  auto sum = read_uint(j, "x");
  if (!sum.ok()) return sum.status();
  if (*sum != checksum(f.body)) {
    return data_loss(fmt::format("message body of {} bytes fails its checksum", f.body.size()));
  }
  return ok_status();
}

Status read_request_id(const json& j, Frame& f) {
  auto id = read_uint(j, "i");
  if (!id.ok()) return id.status();
  if (*id == 0) return data_loss("frame field 'i' (request id) is 0");
  f.id = *id;
  return ok_status();
}

Result<Frame> decode_checked(std::span<const std::byte> wire, std::size_t max_body_bytes) {
  if (wire.empty()) return data_loss("empty frame");
  if (wire.size() > max_body_bytes + kFrameOverheadBytes) {
    return invalid_argument(fmt::format("frame of {} bytes is over the limit of {} (max_message_bytes {})",
                                        wire.size(), max_body_bytes + kFrameOverheadBytes,
                                        max_body_bytes));
  }
  const auto* p = reinterpret_cast<const std::uint8_t*>(wire.data());
  json j = json::from_cbor(p, p + wire.size(), /*strict=*/true, /*allow_exceptions=*/false);
  if (j.is_discarded()) return data_loss(fmt::format("frame of {} bytes is not valid CBOR", wire.size()));
  if (!j.is_object()) return data_loss("frame is not a CBOR map");

  auto version = read_uint(j, "v");
  if (!version.ok()) return version.status();
  if (*version != kWireVersion) {
    return data_loss(fmt::format("frame version {} is not the supported {}", *version, kWireVersion));
  }
  auto kind = read_uint(j, "k");
  if (!kind.ok()) return kind.status();
  if (*kind < 1 || *kind > kMaxFrameKind) return data_loss(fmt::format("unknown frame kind {}", *kind));

  Frame f;
  f.kind = static_cast<FrameKind>(*kind);
  switch (f.kind) {
    case FrameKind::kHello:
    case FrameKind::kProof: {
      auto b = read_fixed(j, "b", f.kind == FrameKind::kHello ? kNonceBytes : kMacBytes);
      if (!b.ok()) return b.status();
      f.body = std::move(*b);
      break;
    }
    case FrameKind::kChallenge: {
      auto b = read_fixed(j, "b", kNonceBytes);
      if (!b.ok()) return b.status();
      auto m = read_fixed(j, "m", kMacBytes);
      if (!m.ok()) return m.status();
      f.body = std::move(*b);
      f.mac = std::move(*m);
      break;
    }
    case FrameKind::kWelcome:
      break;
    case FrameKind::kRefused: {
      auto e = read_text(j, "e");
      if (!e.ok()) return e.status();
      f.error = std::move(*e);
      break;
    }
    case FrameKind::kMessage:
      LAMINAR_RETURN_IF_ERROR(read_message_body(j, f, max_body_bytes));
      break;
    case FrameKind::kRequest:
    case FrameKind::kReply:
      LAMINAR_RETURN_IF_ERROR(read_request_id(j, f));
      LAMINAR_RETURN_IF_ERROR(read_message_body(j, f, max_body_bytes));
      break;
    case FrameKind::kErrorReply: {
      LAMINAR_RETURN_IF_ERROR(read_request_id(j, f));
      auto code = read_uint(j, "c");
      if (!code.ok()) return code.status();
      if (*code == 0 || *code > static_cast<std::uint64_t>(StatusCode::kInternal)) {
        return data_loss(fmt::format("error reply carries unknown status code {}", *code));
      }
      f.code = static_cast<StatusCode>(*code);
      auto e = read_text(j, "e");
      if (!e.ok()) return e.status();
      f.error = std::move(*e);
      break;
    }
  }
  return f;
}

}  // namespace

std::vector<std::byte> encode_frame(const Frame& f) {
  json j = json::object();
  j["v"] = kWireVersion;
  j["k"] = static_cast<std::uint8_t>(f.kind);
  switch (f.kind) {
    case FrameKind::kHello:
    case FrameKind::kProof:
      j["b"] = binary_of(f.body);
      break;
    case FrameKind::kChallenge:
      j["b"] = binary_of(f.body);
      j["m"] = binary_of(f.mac);
      break;
    case FrameKind::kWelcome:
      break;
    case FrameKind::kRefused:
      j["e"] = f.error.substr(0, kMaxErrorTextBytes);
      break;
    case FrameKind::kRequest:
    case FrameKind::kReply:
      j["i"] = f.id;
      [[fallthrough]];
    case FrameKind::kMessage:
      j["t"] = f.type;
      j["b"] = binary_of(f.body);
      j["x"] = checksum(f.body);
      break;
    case FrameKind::kErrorReply:
      j["i"] = f.id;
      j["c"] = static_cast<std::uint8_t>(f.code);
      j["e"] = f.error.substr(0, kMaxErrorTextBytes);
      break;
  }
  Bytes out = json::to_cbor(j);
  const auto* p = reinterpret_cast<const std::byte*>(out.data());
  return {p, p + out.size()};
}

Result<Frame> decode_frame(std::span<const std::byte> wire, std::size_t max_body_bytes) {
  // from_cbor reports malformed input without exceptions, but the json accessors and allocations
  // around it may still throw (e.g. bad_alloc); none of that may leave this function.
  try {
    return decode_checked(wire, max_body_bytes);
  } catch (const std::exception& e) {
    return data_loss(fmt::format("frame of {} bytes could not be decoded: {}", wire.size(), e.what()));
  }
}

}  // namespace laminar::internal

namespace laminar {

std::vector<std::byte> RemoteRegion::serialize() const {
  nlohmann::json j = nlohmann::json::object();
  j["v"] = internal::kWireVersion;
  j["a"] = address;
  j["s"] = size;
  j["r"] = internal::binary_of(rkey);
  std::vector<std::uint8_t> out = nlohmann::json::to_cbor(j);
  const auto* p = reinterpret_cast<const std::byte*>(out.data());
  return {p, p + out.size()};
}

Result<RemoteRegion> RemoteRegion::deserialize(std::span<const std::byte> bytes) {
  // A packed UCX remote key is a few hundred bytes at most; this bounds what a peer can make us hold.
  constexpr std::size_t kMaxRkeyBytes = 64 * 1024;
  try {
    if (bytes.empty()) return data_loss("remote region: empty bytes");
    const auto* p = reinterpret_cast<const std::uint8_t*>(bytes.data());
    auto j = nlohmann::json::from_cbor(p, p + bytes.size(), true, false);
    if (j.is_discarded() || !j.is_object()) {
      return data_loss(fmt::format("remote region: {} bytes are not a valid CBOR map", bytes.size()));
    }
    auto version = internal::read_uint(j, "v");
    if (!version.ok()) return version.status().with_context("remote region");
    if (*version != internal::kWireVersion) {
      return data_loss(fmt::format("remote region: version {} is not the supported {}", *version,
                                   internal::kWireVersion));
    }
    auto address = internal::read_uint(j, "a");
    auto size = internal::read_uint(j, "s");
    if (!address.ok()) return address.status().with_context("remote region");
    if (!size.ok()) return size.status().with_context("remote region");
    if (*address + *size < *address) {
      return data_loss(fmt::format("remote region: address {:#x} + size {} overflows", *address, *size));
    }
    auto rkey = internal::read_binary(j, "r", kMaxRkeyBytes);
    if (!rkey.ok()) return data_loss(rkey.status().message()).with_context("remote region");
    if (rkey->empty()) return data_loss("remote region: empty remote key");
    return RemoteRegion{*address, *size, std::move(*rkey)};
  } catch (const std::exception& e) {
    return data_loss(fmt::format("remote region of {} bytes could not be decoded: {}", bytes.size(),
                                 e.what()));
  }
}

}  // namespace laminar
