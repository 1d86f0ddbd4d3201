// libFuzzer target for the decoders of the local relay's frames (local_relay_wire.h): the requests
// a LocalRelayServer reads from its clients and the replies a client reads from the relay. Built
// with clang (-fsanitize=fuzzer,address,undefined) by tests/CMakeLists.txt and run briefly as the
// CTest test local_relay_decode_fuzz; seeds in local_relay_decode_corpus/.
//
// Every input goes to each decoder. Properties: decoding never crashes, leaks or trips a sanitizer,
// whatever the bytes; a refusal is kDataLoss naming an offset; anything that decodes re-encodes to
// exactly the same bytes, which decode to the same frame.
#include <cstddef>
#include <cstdint>
#include <span>

#include "local_relay_wire.h"
#include "round_trip.h"

using laminar::Status;
using laminar::fuzz::check_round_trip;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace in = laminar::internal;
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  check_round_trip(bytes, in::decode_local_request, in::encode_local_request);
  check_round_trip(bytes, in::decode_local_reply_header, in::encode_local_reply_header);
  check_round_trip(bytes, in::decode_local_newest, in::encode_local_newest);
  check_round_trip(bytes, in::decode_local_grant, in::encode_local_grant);
  check_round_trip(bytes, in::decode_local_error,
                   [](const in::LocalErrorPayload& e) { return in::encode_local_error(Status(e.code, e.message)); });
  return 0;
}
