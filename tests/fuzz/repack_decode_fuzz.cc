// libFuzzer target for the decoders of the repack protocol's messages (repack_wire.h): the reports
// a coordinator reads from every rollout worker and the orders a worker reads from its coordinator.
// Built with clang (-fsanitize=fuzzer,address,undefined) by tests/CMakeLists.txt and run briefly as
// the CTest test repack_decode_fuzz; seeds in repack_decode_corpus/.
//
// Every input goes to both decoders. Properties: decoding never crashes, leaks or trips a
// sanitizer, whatever the bytes; a refusal is kDataLoss naming an offset, or kInvalidArgument,
// which the header documents for well-formed values out of range; anything that decodes
// re-encodes to exactly the same bytes, which decode to the same message.
#include <cstddef>
#include <cstdint>
#include <span>

#include "repack_wire.h"
#include "round_trip.h"

using laminar::fuzz::check_round_trip;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace in = laminar::internal;
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  constexpr bool kInvalidArgumentAllowed = true;
  check_round_trip(bytes, in::decode_repack_report, in::encode_repack_report, kInvalidArgumentAllowed);
  check_round_trip(bytes, in::decode_repack_orders, in::encode_repack_orders, kInvalidArgumentAllowed);
  return 0;
}
