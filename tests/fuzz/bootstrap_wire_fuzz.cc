// libFuzzer target for the bootstrap frame decoder: the first code that reads bytes from a peer
// nobody has authenticated yet (laminar's own listening socket). Built with clang
// (-fsanitize=fuzzer,address,undefined) by tests/CMakeLists.txt and run briefly as the CTest test
// bootstrap_wire_fuzz; seeds in bootstrap_wire_corpus/.
//
// The input is a connection's byte stream, delivered in two reads split where its first byte says.
// Properties: taking frames never crashes, leaks or trips a sanitizer, never buffers more than one
// frame's worth, and either needs more bytes, fails for good, or yields frames that re-encode to
// the same fields.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "laminar/status.h"
#include "transport/bootstrap_wire.h"

using laminar::internal::BootstrapFrame;
using laminar::internal::kMaxBootstrapFrameBytes;
using laminar::internal::take_bootstrap_frame;

namespace {

bool same(const BootstrapFrame& a, const BootstrapFrame& b) {
  return a.kind == b.kind && a.nonce == b.nonce && a.mac == b.mac && a.token == b.token &&
         a.worker_address == b.worker_address && a.addresses == b.addresses && a.reason == b.reason &&
         a.code == b.code;
}

// Takes every whole frame off `buffer`; false once the stream is refused.
bool drain(std::vector<std::byte>& buffer) {
  for (;;) {
    auto frame = take_bootstrap_frame(buffer);
    if (!frame.ok()) {
      LAMINAR_CHECK(frame.status().code() == laminar::StatusCode::kDataLoss);
      return false;
    }
    if (!frame->has_value()) {
      LAMINAR_CHECK(buffer.size() <= 4 + kMaxBootstrapFrameBytes);
      return true;
    }
    std::vector<std::byte> again = laminar::internal::encode_bootstrap_frame(**frame);
    auto decoded = take_bootstrap_frame(again);
    LAMINAR_CHECK(decoded.ok() && decoded->has_value() && again.empty());
    LAMINAR_CHECK(same(**decoded, **frame));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const auto* bytes = reinterpret_cast<const std::byte*>(data + 1);
  const std::size_t n = size - 1;
  const std::size_t split = std::min<std::size_t>(data[0] * 17, n);
  // As the connection reads them: never more than one frame's worth of room at a time.
  std::vector<std::byte> buffer(bytes, bytes + std::min(split, 4 + kMaxBootstrapFrameBytes));
  if (!drain(buffer)) return 0;
  const std::size_t room = 4 + kMaxBootstrapFrameBytes - buffer.size();
  buffer.insert(buffer.end(), bytes + split, bytes + split + std::min(n - split, room));
  drain(buffer);
  return 0;
}
