// libFuzzer target for the decoders of the KV migration protocol's messages (kv_migration_wire.h),
// which read what another rollout worker sends. Built with clang
// (-fsanitize=fuzzer,address,undefined) by tests/CMakeLists.txt and run briefly as the CTest test
// kv_migration_decode_fuzz; seeds in kv_migration_decode_corpus/.
//
// Every input goes to each decoder. Properties: decoding never crashes, leaks or trips a sanitizer,
// whatever the bytes; a refusal is kDataLoss naming an offset, or kInvalidArgument, which the
// header documents for well-formed values out of range; anything that decodes re-encodes to exactly
// the same bytes, which decode to the same message.
#include <cstddef>
#include <cstdint>
#include <span>

#include "kv_migration_wire.h"
#include "round_trip.h"

using laminar::fuzz::check_round_trip;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace in = laminar::internal;
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  constexpr bool kInvalidArgumentAllowed = true;
  check_round_trip(bytes, in::decode_migration_offer, in::encode_migration_offer, kInvalidArgumentAllowed);
  check_round_trip(bytes, in::decode_migration_reservation, in::encode_migration_reservation, kInvalidArgumentAllowed);
  check_round_trip(bytes, in::decode_migration_stage, in::encode_migration_stage, kInvalidArgumentAllowed);
  check_round_trip(bytes, in::decode_migration_stage_answer, in::encode_migration_stage_answer,
                   kInvalidArgumentAllowed);
  check_round_trip(bytes, in::decode_migration_abort, in::encode_migration_abort, kInvalidArgumentAllowed);
  return 0;
}
