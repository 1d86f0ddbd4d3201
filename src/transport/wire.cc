// Frame and RemoteRegion encoding (see wire.h). Everything a peer sends is validated here before
// the transport looks at it.
#include "transport/wire.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <bit>
#include <exception>
#include <limits>
#include <string_view>
#include <utility>

namespace laminar::internal {
namespace {

// CBOR (RFC 8949) for frames and region descriptors, written and read here rather than through a
// general library: nlohmann-json's reader takes a byte string one byte at a time, which made
// decoding a 20 KB message body cost more than the rest of its delivery, and milliseconds for a
// 4 MB one. A frame is one map of short text keys to unsigned integers, byte strings and text
// strings, with definite lengths and the shortest heads (what nlohmann-json also wrote, in the
// same sorted key order, so the bytes are unchanged).

constexpr std::uint8_t kUintMajor = 0, kNegativeMajor = 1, kBytesMajor = 2, kTextMajor = 3, kArrayMajor = 4,
                       kMapMajor = 5, kTagMajor = 6, kSimpleMajor = 7;
// Arrays and maps nested deeper than this in a frame are refused (no frame has any).
constexpr int kMaxNesting = 16;

class CborWriter {
 public:
  explicit CborWriter(std::size_t entries, std::size_t reserve) {
    out_.reserve(reserve + 64);
    head(kMapMajor, entries);
  }
  void uint(char key, std::uint64_t v) {
    text_key(key);
    head(kUintMajor, v);
  }
  void bytes(char key, std::span<const std::byte> b) {
    text_key(key);
    head(kBytesMajor, b.size());
    out_.insert(out_.end(), b.begin(), b.end());
  }
  void text(char key, std::string_view t) {
    text_key(key);
    head(kTextMajor, t.size());
    const auto* p = reinterpret_cast<const std::byte*>(t.data());
    out_.insert(out_.end(), p, p + t.size());
  }
  std::vector<std::byte> take() { return std::move(out_); }

 private:
  void head(std::uint8_t major, std::uint64_t arg) {
    const auto m = std::uint8_t(major << 5);
    if (arg < 24) return put(m | std::uint8_t(arg));
    const int bytes = arg <= 0xff ? 1 : arg <= 0xffff ? 2 : arg <= 0xffffffffu ? 4 : 8;
    put(m | std::uint8_t(24 + std::countr_zero(unsigned(bytes))));
    for (int i = bytes - 1; i >= 0; --i) put(std::uint8_t(arg >> (8 * i)));
  }
  void text_key(char k) {
    put(std::uint8_t(kTextMajor << 5) | 1);
    put(std::uint8_t(k));
  }
  void put(std::uint8_t b) { out_.push_back(std::byte{b}); }
  std::vector<std::byte> out_;
};

// One value of a map: an unsigned integer, a byte string, a text string, or another well-formed
// item (kOther: a negative number, float, simple value, array or map), which no field accepts.
struct CborValue {
  enum class Kind { kUint, kBytes, kText, kOther } kind = Kind::kOther;
  std::uint64_t uint = 0;
  std::span<const std::uint8_t> data;  // kBytes, kText; points into the parsed bytes
};

class CborMap {
 public:
  enum class Error { kNone, kInvalid, kNotMap };

  // Exactly one well-formed map, nothing after it; its values point into `bytes`. Keys must be
  // text strings; a repeated key keeps its last value. Indefinite lengths and tags are kInvalid.
  static Error parse(std::span<const std::uint8_t> bytes, CborMap& out) {
    Reader r{bytes.data(), bytes.data() + bytes.size()};
    const std::uint8_t* start = r.p;
    std::uint8_t major = 0;
    std::uint64_t n = 0;
    if (!r.head(major, n)) return Error::kInvalid;
    if (major != kMapMajor) {
      r.p = start;
      return r.value(nullptr, 0) && r.p == r.end ? Error::kNotMap : Error::kInvalid;
    }
    if (n > r.left() / 2) return Error::kInvalid;
    for (std::uint64_t i = 0; i < n; ++i) {
      std::span<const std::uint8_t> key;
      CborValue v;
      if (!r.text(key) || !r.value(&v, 1)) return Error::kInvalid;
      out.entries_.emplace_back(std::string_view(reinterpret_cast<const char*>(key.data()), key.size()), v);
    }
    return r.p == r.end ? Error::kNone : Error::kInvalid;
  }

  const CborValue* find(std::string_view key) const {
    for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {
      if (it->first == key) return &it->second;
    }
    return nullptr;
  }

 private:
  struct Reader {
    const std::uint8_t* p;
    const std::uint8_t* end;

    std::size_t left() const { return std::size_t(end - p); }
    // An item's first byte and argument (the count, length or value that follows it).
    bool head(std::uint8_t& major, std::uint64_t& arg) {
      if (p == end) return false;
      const std::uint8_t b = *p++;
      major = b >> 5;
      const std::uint8_t info = b & 31;
      if (info < 24) {
        arg = info;
        return true;
      }
      if (info > 27) return false;  // reserved, or an indefinite length
      const std::size_t n = std::size_t(1) << (info - 24);
      if (left() < n) return false;
      arg = 0;
      for (std::size_t i = 0; i < n; ++i) arg = (arg << 8) | p[i];
      p += n;
      return true;
    }
    bool text(std::span<const std::uint8_t>& out) {
      std::uint8_t major = 0;
      std::uint64_t n = 0;
      if (!head(major, n) || major != kTextMajor || n > left()) return false;
      out = {p, std::size_t(n)};
      p += n;
      return true;
    }
    // One whole item, kept in `out` when given.
    bool value(CborValue* out, int depth) {
      if (depth > kMaxNesting) return false;
      std::uint8_t major = 0;
      std::uint64_t n = 0;
      if (!head(major, n)) return false;
      CborValue v;
      switch (major) {
        case kUintMajor:
          v.kind = CborValue::Kind::kUint;
          v.uint = n;
          break;
        case kBytesMajor:
        case kTextMajor:
          if (n > left()) return false;
          v.kind = major == kBytesMajor ? CborValue::Kind::kBytes : CborValue::Kind::kText;
          v.data = {p, std::size_t(n)};
          p += n;
          break;
        case kArrayMajor:
          if (n > left()) return false;
          for (std::uint64_t i = 0; i < n; ++i) {
            if (!value(nullptr, depth + 1)) return false;
          }
          break;
        case kMapMajor: {
          if (n > left() / 2) return false;
          std::span<const std::uint8_t> key;
          for (std::uint64_t i = 0; i < n; ++i) {
            if (!text(key) || !value(nullptr, depth + 1)) return false;
          }
          break;
        }
        case kTagMajor:
          return false;
        case kNegativeMajor:
        case kSimpleMajor:  // false, true, null, floats: head() took their bytes
          break;
      }
      if (out != nullptr) *out = v;
      return true;
    }
  };

  std::vector<std::pair<std::string_view, CborValue>> entries_;
};

std::uint64_t checksum(std::span<const std::byte> b) { return XXH3_64bits(b.data(), b.size()); }

// Field readers: each names the field it could not read.
Result<std::uint64_t> read_uint(const CborMap& m, const char* key) {
  const CborValue* v = m.find(key);
  if (v == nullptr) return data_loss(fmt::format("frame field '{}' is missing", key));
  if (v->kind != CborValue::Kind::kUint) {
    return data_loss(fmt::format("frame field '{}' is not an unsigned integer", key));
  }
  return v->uint;
}

Result<std::vector<std::byte>> read_binary(const CborMap& m, const char* key, std::size_t max_bytes) {
  const CborValue* v = m.find(key);
  if (v == nullptr) return data_loss(fmt::format("frame field '{}' is missing", key));
  if (v->kind != CborValue::Kind::kBytes) return data_loss(fmt::format("frame field '{}' is not a byte string", key));
  if (v->data.size() > max_bytes) {
    return invalid_argument(
        fmt::format("frame field '{}' holds {} bytes, over the limit of {}", key, v->data.size(), max_bytes));
  }
  const auto* p = reinterpret_cast<const std::byte*>(v->data.data());
  return std::vector<std::byte>(p, p + v->data.size());
}

Result<std::vector<std::byte>> read_fixed(const CborMap& m, const char* key, std::size_t bytes) {
  auto r = read_binary(m, key, bytes);
  if (!r.ok())
    return r.status().code() == StatusCode::kInvalidArgument
               ? data_loss(fmt::format("frame field '{}' must hold {} bytes", key, bytes))
               : r.status();
  if (r->size() != bytes) {
    return data_loss(fmt::format("frame field '{}' holds {} bytes, not {}", key, r->size(), bytes));
  }
  return r;
}

Result<std::string> read_text(const CborMap& m, const char* key) {
  const CborValue* v = m.find(key);
  if (v == nullptr) return data_loss(fmt::format("frame field '{}' is missing", key));
  if (v->kind != CborValue::Kind::kText) return data_loss(fmt::format("frame field '{}' is not a string", key));
  if (v->data.size() > kMaxErrorTextBytes) {
    return data_loss(fmt::format("frame field '{}' holds {} bytes of text, over {}", key, v->data.size(),
                                 kMaxErrorTextBytes));
  }
  return std::string(reinterpret_cast<const char*>(v->data.data()), v->data.size());
}

Status read_message_body(const CborMap& j, Frame& f, std::size_t max_body_bytes) {
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

Status read_request_id(const CborMap& j, Frame& f) {
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
                                        wire.size(), max_body_bytes + kFrameOverheadBytes, max_body_bytes));
  }
  CborMap j;
  switch (CborMap::parse({reinterpret_cast<const std::uint8_t*>(wire.data()), wire.size()}, j)) {
    case CborMap::Error::kNone:
      break;
    case CborMap::Error::kInvalid:
      return data_loss(fmt::format("frame of {} bytes is not valid CBOR", wire.size()));
    case CborMap::Error::kNotMap:
      return data_loss("frame is not a CBOR map");
  }

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
  // Keys in sorted order: b, c, e, i, k, m, t, v, x.
  switch (f.kind) {
    case FrameKind::kHello:
    case FrameKind::kProof: {
      CborWriter w(3, f.body.size());
      w.bytes('b', f.body);
      w.uint('k', std::uint8_t(f.kind));
      w.uint('v', kWireVersion);
      return w.take();
    }
    case FrameKind::kChallenge: {
      CborWriter w(4, f.body.size() + f.mac.size());
      w.bytes('b', f.body);
      w.uint('k', std::uint8_t(f.kind));
      w.bytes('m', f.mac);
      w.uint('v', kWireVersion);
      return w.take();
    }
    case FrameKind::kWelcome: {
      CborWriter w(2, 0);
      w.uint('k', std::uint8_t(f.kind));
      w.uint('v', kWireVersion);
      return w.take();
    }
    case FrameKind::kRefused: {
      const std::string_view e = std::string_view(f.error).substr(0, kMaxErrorTextBytes);
      CborWriter w(3, e.size());
      w.text('e', e);
      w.uint('k', std::uint8_t(f.kind));
      w.uint('v', kWireVersion);
      return w.take();
    }
    case FrameKind::kMessage:
    case FrameKind::kRequest:
    case FrameKind::kReply: {
      const bool with_id = f.kind != FrameKind::kMessage;
      CborWriter w(with_id ? 6 : 5, f.body.size());
      w.bytes('b', f.body);
      if (with_id) w.uint('i', f.id);
      w.uint('k', std::uint8_t(f.kind));
      w.uint('t', f.type);
      w.uint('v', kWireVersion);
      w.uint('x', checksum(f.body));
      return w.take();
    }
    case FrameKind::kErrorReply: {
      const std::string_view e = std::string_view(f.error).substr(0, kMaxErrorTextBytes);
      CborWriter w(5, e.size());
      w.uint('c', std::uint8_t(f.code));
      w.text('e', e);
      w.uint('i', f.id);
      w.uint('k', std::uint8_t(f.kind));
      w.uint('v', kWireVersion);
      return w.take();
    }
  }
  return {};
}

Result<Frame> decode_frame(std::span<const std::byte> wire, std::size_t max_body_bytes) {
  // Allocating the body may throw (bad_alloc); that may not leave this function.
  try {
    return decode_checked(wire, max_body_bytes);
  } catch (const std::exception& e) {
    return data_loss(fmt::format("frame of {} bytes could not be decoded: {}", wire.size(), e.what()));
  }
}

}  // namespace laminar::internal

namespace laminar {

std::vector<std::byte> RemoteRegion::serialize() const {
  internal::CborWriter w(4, rkey.size());
  w.uint('a', address);
  w.bytes('r', rkey);
  w.uint('s', size);
  w.uint('v', internal::kWireVersion);
  return w.take();
}

Result<RemoteRegion> RemoteRegion::deserialize(std::span<const std::byte> bytes) {
  // A packed UCX remote key is a few hundred bytes at most; this bounds what a peer can make us hold.
  constexpr std::size_t kMaxRkeyBytes = 64 * 1024;
  try {
    if (bytes.empty()) return data_loss("remote region: empty bytes");
    internal::CborMap j;
    if (internal::CborMap::parse({reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()}, j) !=
        internal::CborMap::Error::kNone) {
      return data_loss(fmt::format("remote region: {} bytes are not a valid CBOR map", bytes.size()));
    }
    auto version = internal::read_uint(j, "v");
    if (!version.ok()) return version.status().with_context("remote region");
    if (*version != internal::kWireVersion) {
      return data_loss(
          fmt::format("remote region: version {} is not the supported {}", *version, internal::kWireVersion));
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
    return data_loss(
        fmt::format("remote region of {} bytes could not be decoded: {}", bytes.size(), e.what()));
  }
}

}  // namespace laminar
