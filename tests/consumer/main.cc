// Uses the installed headers and library: builds a manifest, round-trips it through JSON and checks
// that a bad one is rejected. Exits non-zero on any surprise.
#include <cstdio>
#include <laminar/laminar.h>

int main() {
  laminar::WeightManifest m;
  if (!m.add("w", laminar::DType::kBF16, {4, 8}).ok()) return 1;
  auto back = laminar::WeightManifest::from_json(m.to_json());
  if (!back.ok() || !(*back == m)) return 2;
  auto bad = laminar::WeightManifest::from_json("{\"version\":1}");
  if (bad.ok()) return 3;
  std::printf("consumer ok: %llu bytes; bad manifest -> %s\n",
              static_cast<unsigned long long>(m.total_bytes()), bad.status().to_string().c_str());
  return 0;
}
