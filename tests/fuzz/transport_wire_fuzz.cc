// libFuzzer target for the transport's decoders: the only code that parses bytes from a peer.
// Built with clang (-fsanitize=fuzzer,address,undefined) by tests/CMakeLists.txt and run briefly as
// the CTest test transport_wire_fuzz; seeds in transport_wire_corpus/.
//
// Properties: decoding never crashes, leaks or trips a sanitizer, whatever the bytes; anything that
// decodes re-encodes to a frame that decodes to the same fields.
#include <cstddef>
#include <cstdint>
#include <span>

#include "laminar/transport.h"
#include "transport/wire.h"

namespace {
constexpr std::size_t kMaxBody = 1 << 16;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  auto frame = laminar::internal::decode_frame(bytes, kMaxBody);
  if (frame.ok()) {
    auto again = laminar::internal::decode_frame(laminar::internal::encode_frame(*frame), kMaxBody);
    LAMINAR_CHECK(again.ok());
    LAMINAR_CHECK(again->kind == frame->kind && again->type == frame->type && again->id == frame->id);
    LAMINAR_CHECK(again->body == frame->body && again->mac == frame->mac);
    LAMINAR_CHECK(again->code == frame->code && again->error == frame->error);
  }
  auto region = laminar::RemoteRegion::deserialize(bytes);
  if (region.ok()) {
    auto again = laminar::RemoteRegion::deserialize(region->serialize());
    LAMINAR_CHECK(again.ok() && again->address == region->address && again->size == region->size &&
                  again->rkey == region->rkey);
  }
  return 0;
}
