// libFuzzer target for the decoders of the rollout dispatch protocol (rollout_dispatch_wire.h): the
// requests a RolloutDispatcher reads from every rollout worker, the grants a DispatchClient
// reads from its dispatcher, and the snapshots a restarted host reads back from its checkpoint. Built with clang (-fsanitize=fuzzer,address,undefined) by
// tests/CMakeLists.txt and run briefly as the CTest test rollout_dispatch_decode_fuzz; seeds in
// rollout_dispatch_decode_corpus/.
//
// Every input goes to both decoders, with small limits so that the limit checks are reached.
// Properties: decoding never crashes, leaks or trips a sanitizer, whatever the bytes; a refusal is
// kDataLoss naming an offset, or kInvalidArgument, which the header documents for well-formed
// values out of range; anything that decodes re-encodes to exactly the same bytes, which decode to
// the same message.
#include <cstddef>
#include <cstdint>
#include <span>

#include "rollout_dispatch_wire.h"
#include "round_trip.h"

using laminar::fuzz::check_round_trip;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace in = laminar::internal;
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  constexpr bool kInvalidArgumentAllowed = true;
  check_round_trip(
      bytes, +[](std::span<const std::byte> b) { return in::decode_dispatch_request(b, 16); },
      in::encode_dispatch_request, kInvalidArgumentAllowed);
  check_round_trip(
      bytes, +[](std::span<const std::byte> b) { return in::decode_grant(b, 16, 16, 64); }, in::encode_grant,
      kInvalidArgumentAllowed);
  check_round_trip(bytes, in::decode_snapshot, in::encode_snapshot, kInvalidArgumentAllowed);
  return 0;
}
