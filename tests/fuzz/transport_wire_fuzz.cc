// libFuzzer target for the transport's decoders (src/transport/wire.h): the frames and remote
// region descriptors a peer sends. Each input goes to both. Built with clang
// (-fsanitize=fuzzer,address,undefined) by tests/CMakeLists.txt and run briefly as the CTest test
// transport_wire_fuzz; seeds in transport_wire_corpus/.
//
// Properties: decoding never crashes, leaks or trips a sanitizer, whatever the bytes; a refusal is
// kDataLoss naming an offset (only a body present in full and longer than kMaxBody would be
// kInvalidArgument, and inputs stay shorter: libFuzzer's -max_len is 4096 unless raised); anything
// that decodes re-encodes to exactly the same bytes, so it decodes to the same again.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "laminar/transport.h"
#include "transport/wire.h"

namespace {

constexpr std::size_t kMaxBody = 1 << 16;

void check_refusal(const laminar::Status& st) {
  LAMINAR_CHECK_MSG(st.code() == laminar::StatusCode::kDataLoss, st.to_string());
  LAMINAR_CHECK_MSG(st.message().find(" at offset ") != std::string::npos, st.message());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  if (auto frame = laminar::internal::decode_frame(bytes, kMaxBody); frame.ok()) {
    LAMINAR_CHECK(std::ranges::equal(laminar::internal::encode_frame(*frame), bytes));
  } else {
    check_refusal(frame.status());
  }
  if (auto region = laminar::RemoteRegion::deserialize(bytes); region.ok()) {
    LAMINAR_CHECK(std::ranges::equal(region->serialize(), bytes));
  } else {
    check_refusal(region.status());
  }
  return 0;
}
