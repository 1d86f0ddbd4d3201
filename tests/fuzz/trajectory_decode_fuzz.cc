// libFuzzer target for decode_trajectory, which reads bytes from remote producers and from the
// WAL's push records. Built with clang (-fsanitize=fuzzer,address,undefined) by tests/CMakeLists.txt
// and run briefly as the CTest test trajectory_decode_fuzz; seeds in trajectory_decode_corpus/.
//
// Properties: decoding never crashes, leaks or trips a sanitizer, whatever the bytes; a refusal
// for malformed bytes names an offset; anything that decodes re-encodes to exactly the same bytes.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "laminar/trajectory.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  laminar::Result<laminar::Trajectory> t = laminar::decode_trajectory(bytes);
  if (!t.ok()) {
    const laminar::Status st = t.status();
    // kInvalidArgument: well-formed bytes of a trajectory that fails validate_trajectory.
    LAMINAR_CHECK(st.code() == laminar::StatusCode::kDataLoss ||
                  st.code() == laminar::StatusCode::kInvalidArgument);
    LAMINAR_CHECK_MSG(st.code() != laminar::StatusCode::kDataLoss ||
                          st.message().find(" at offset ") != std::string::npos,
                      st.message());
    return 0;
  }
  std::string again;
  laminar::encode_trajectory(*t, again);
  LAMINAR_CHECK(again == bytes);
  LAMINAR_CHECK(laminar::encoded_trajectory_size(*t) == size);
  return 0;
}
