// libFuzzer target for WeightManifest::from_json, which reads the manifest a relay peer sends ahead
// of a version's bytes (relay chain begin messages, local relay replies). Built with clang
// (-fsanitize=fuzzer,address,undefined) by tests/CMakeLists.txt and run briefly as the CTest test
// weight_manifest_fuzz; seeds in weight_manifest_corpus/.
//
// Properties: parsing never crashes, leaks or trips a sanitizer, whatever the text; a refusal is
// kInvalidArgument; a manifest that parses writes JSON that parses to an equal manifest, with the
// same layout (every offset aligned, inside total_bytes).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "laminar/weight_manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto m = laminar::WeightManifest::from_json(text);
  if (!m.ok()) {
    LAMINAR_CHECK_MSG(m.status().code() == laminar::StatusCode::kInvalidArgument, m.status().to_string());
    return 0;
  }
  for (const auto& e : m->entries()) {
    LAMINAR_CHECK(e.offset % laminar::WeightManifest::kAlignment == 0);
    LAMINAR_CHECK(e.offset <= m->total_bytes() && e.nbytes <= m->total_bytes() - e.offset);
  }
  auto again = laminar::WeightManifest::from_json(m->to_json());
  LAMINAR_CHECK_MSG(again.ok(), again.status().to_string());
  LAMINAR_CHECK(*again == *m);
  return 0;
}
