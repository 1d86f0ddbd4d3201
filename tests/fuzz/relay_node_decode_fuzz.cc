// libFuzzer target for the decoders of the relay protocol's messages (relay_node_wire.h), which
// read what another relay node sends. Built with clang (-fsanitize=fuzzer,address,undefined) by
// tests/CMakeLists.txt and run briefly as the CTest test relay_node_decode_fuzz; seeds in
// relay_node_decode_corpus/.
//
// Every input goes to each decoder. Properties: decoding never crashes, leaks or trips a sanitizer,
// whatever the bytes; a refusal is kDataLoss naming an offset; anything that decodes re-encodes to
// exactly the same bytes, which decode to the same message.
#include <cstddef>
#include <cstdint>
#include <span>

#include "relay_node_wire.h"
#include "round_trip.h"

using laminar::fuzz::check_round_trip;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace in = laminar::internal;
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  check_round_trip(bytes, in::decode_relay_subscribe, in::encode_relay_subscribe);
  check_round_trip(bytes, in::decode_relay_begin, in::encode_relay_begin);
  check_round_trip(bytes, in::decode_relay_begin_reply, in::encode_relay_begin_reply);
  check_round_trip(bytes, in::decode_relay_chunk, in::encode_relay_chunk);
  check_round_trip(bytes, in::decode_relay_idle, in::encode_relay_idle);
  return 0;
}
