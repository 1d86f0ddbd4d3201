// Encoding and decoding of bootstrap frames (bootstrap_wire.h), through ByteWriter and ByteReader.
#include "transport/bootstrap_wire.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "byte_codec.h"

namespace laminar::internal {

namespace {

constexpr std::size_t kLengthBytes = 4;
// The largest frame (a proof): version, kind, mac, token, worker address and address list.
static_assert(2 + kBootstrapMacBytes + 8 + 4 + kMaxWorkerAddressBytes + 1 + kMaxPeerAddresses * 17 <=
              kMaxBootstrapFrameBytes);
constexpr std::uint8_t kMaxKind = static_cast<std::uint8_t>(BootstrapKind::kRefused);

void write_addresses(ByteWriter<std::string>& w, const std::vector<IpAddress>& addresses) {
  LAMINAR_CHECK(addresses.size() <= kMaxPeerAddresses);
  w.u8(static_cast<std::uint8_t>(addresses.size()));
  for (const IpAddress& a : addresses) {
    w.u8(a.family);
    w.bytes(std::span<const std::byte>(a.bytes.data(), a.size()));
  }
}

std::vector<IpAddress> read_addresses(ByteReader& r) {
  std::vector<IpAddress> out;
  const std::size_t at = r.offset();
  const std::size_t n = r.u8("address count");
  if (n > kMaxPeerAddresses) {
    r.fail(at, fmt::format("{} addresses, over the limit of {}", n, kMaxPeerAddresses));
    return out;
  }
  for (std::size_t i = 0; i < n && r.ok(); ++i) {
    IpAddress a;
    const std::size_t family_at = r.offset();
    a.family = r.u8("address family");
    if (r.ok() && a.family != 4 && a.family != 6) {
      r.fail(family_at, fmt::format("address family {} is neither 4 nor 6", a.family));
      break;
    }
    const std::string_view b = r.bytes("address", a.size());
    if (b.empty()) break;  // cut short: the reader holds the error
    std::memcpy(a.bytes.data(), b.data(), b.size());
    out.push_back(a);
  }
  return out;
}

template <std::size_t N>
void read_array(ByteReader& r, std::string_view field, std::array<std::byte, N>& out) {
  const std::string_view b = r.bytes(field, N);
  if (!b.empty()) std::memcpy(out.data(), b.data(), N);
}

}  // namespace

std::vector<std::byte> encode_bootstrap_frame(const BootstrapFrame& f) {
  LAMINAR_CHECK(f.worker_address.size() <= kMaxWorkerAddressBytes && f.reason.size() <= kMaxRefusalBytes);
  // Written as a std::string: GCC 12 sees phantom overflows in a growing std::vector<std::byte>.
  std::string out(kLengthBytes, '\0');
  ByteWriter w(out);
  w.u8(kBootstrapVersion);
  w.u8(static_cast<std::uint8_t>(f.kind));
  switch (f.kind) {
    case BootstrapKind::kHello:
      w.bytes(f.nonce);
      break;
    case BootstrapKind::kChallenge:
      w.bytes(f.nonce);
      w.bytes(f.mac);
      write_addresses(w, f.addresses);
      break;
    case BootstrapKind::kProof:
      w.bytes(f.mac);
      w.u64(f.token);
      w.prefixed({reinterpret_cast<const char*>(f.worker_address.data()), f.worker_address.size()});
      write_addresses(w, f.addresses);
      break;
    case BootstrapKind::kWelcome:
      w.u64(f.token);
      w.prefixed({reinterpret_cast<const char*>(f.worker_address.data()), f.worker_address.size()});
      break;
    case BootstrapKind::kReady:
      break;
    case BootstrapKind::kRefused:
      w.u8(std::uint8_t(f.code));
      w.prefixed(f.reason);
      break;
  }
  const auto length = static_cast<std::uint32_t>(out.size() - kLengthBytes);
  LAMINAR_CHECK(length <= kMaxBootstrapFrameBytes);
  std::memcpy(out.data(), &length, kLengthBytes);
  const auto* first = reinterpret_cast<const std::byte*>(out.data());
  return {first, first + out.size()};
}

Result<std::optional<BootstrapFrame>> take_bootstrap_frame(std::vector<std::byte>& buffer) {
  if (buffer.size() < kLengthBytes) return std::optional<BootstrapFrame>();
  const std::uint32_t length =
      ByteReader(std::span<const std::byte>(buffer.data(), kLengthBytes), "bootstrap frame").u32("length");
  if (length > kMaxBootstrapFrameBytes) {
    return data_loss(fmt::format("bootstrap frame: length {} at offset 0 exceeds the limit of {} bytes", length,
                                 kMaxBootstrapFrameBytes));
  }
  if (buffer.size() - kLengthBytes < length) return std::optional<BootstrapFrame>();

  ByteReader r(std::span<const std::byte>(buffer.data() + kLengthBytes, length), "bootstrap frame", kLengthBytes);
  BootstrapFrame f;
  const std::uint8_t version = r.u8("version");
  if (r.ok() && version != kBootstrapVersion) {
    r.fail(kLengthBytes, fmt::format("version {} is not {}", version, kBootstrapVersion));
  }
  const std::size_t kind_at = r.offset();
  const std::uint8_t kind = r.u8("kind");
  if (r.ok() && (kind == 0 || kind > kMaxKind)) r.fail(kind_at, fmt::format("unknown kind {}", kind));
  f.kind = static_cast<BootstrapKind>(kind);
  if (r.ok()) {
    switch (f.kind) {
      case BootstrapKind::kHello:
        read_array(r, "nonce", f.nonce);
        break;
      case BootstrapKind::kChallenge:
        read_array(r, "nonce", f.nonce);
        read_array(r, "mac", f.mac);
        f.addresses = read_addresses(r);
        break;
      case BootstrapKind::kProof: {
        read_array(r, "mac", f.mac);
        f.token = r.u64("token");
        const std::string_view a = r.prefixed("worker address", kMaxWorkerAddressBytes);
        f.worker_address.assign(reinterpret_cast<const std::byte*>(a.data()),
                                reinterpret_cast<const std::byte*>(a.data()) + a.size());
        f.addresses = read_addresses(r);
        break;
      }
      case BootstrapKind::kWelcome: {
        f.token = r.u64("token");
        const std::string_view a = r.prefixed("worker address", kMaxWorkerAddressBytes);
        f.worker_address.assign(reinterpret_cast<const std::byte*>(a.data()),
                                reinterpret_cast<const std::byte*>(a.data()) + a.size());
        break;
      }
      case BootstrapKind::kReady:
        break;
      case BootstrapKind::kRefused: {
        const std::size_t code_at = r.offset();
        const std::uint8_t code = r.u8("code");
        if (r.ok() && code != std::uint8_t(StatusCode::kUnavailable) &&
            code != std::uint8_t(StatusCode::kFailedPrecondition)) {
          r.fail(code_at, fmt::format("refusal code {}", code));
        }
        f.code = StatusCode(code);
        f.reason = std::string(r.prefixed("reason", kMaxRefusalBytes));
        break;
      }
    }
  }
  LAMINAR_RETURN_IF_ERROR(r.finish());
  buffer.erase(buffer.begin(), buffer.begin() + static_cast<std::ptrdiff_t>(kLengthBytes + length));
  return std::optional<BootstrapFrame>(std::move(f));
}

}  // namespace laminar::internal
