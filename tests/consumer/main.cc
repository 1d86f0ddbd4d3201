// Uses the installed headers and library: builds a manifest, round-trips it through JSON and checks
// that a bad one is rejected; fills a cast from tensor views and checks that a mismatched pair is
// refused. Exits non-zero on any surprise.
#include <cstdint>
#include <cstdio>
#include <laminar/laminar.h>

int main() {
  laminar::WeightManifest m;
  if (!m.add("w", laminar::DType::kBF16, {4, 8}).ok()) return 1;
  auto back = laminar::WeightManifest::from_json(m.to_json());
  if (!back.ok() || !(*back == m)) return 2;
  auto bad = laminar::WeightManifest::from_json("{\"version\":1}");
  if (bad.ok()) return 3;

  float src[6] = {1.0f, -2.5f, 3.0f, 0.0f, 65504.0f, 1e-3f};
  std::uint16_t dst[6] = {};
  const std::int64_t shape[2] = {2, 3}, other[2] = {3, 2};
  auto cast = laminar::kernels::CastParams::from_tensors(
      laminar::TensorView::contiguous(src, laminar::DType::kF32, shape).value(),
      laminar::TensorView::contiguous(dst, laminar::DType::kBF16, shape).value());
  if (!cast.ok() || !laminar::kernels::run(*cast, laminar::Stream::host()).ok()) return 4;
  if (dst[0] != 0x3f80) return 5;  // 1.0 in bf16
  auto mismatched = laminar::kernels::CastParams::from_tensors(
      laminar::TensorView::contiguous(src, laminar::DType::kF32, shape).value(),
      laminar::TensorView::contiguous(dst, laminar::DType::kBF16, other).value());
  if (mismatched.ok()) return 6;
  std::printf("consumer ok: %llu bytes; bad manifest -> %s; mismatched cast -> %s\n",
              static_cast<unsigned long long>(m.total_bytes()), bad.status().to_string().c_str(),
              mismatched.status().to_string().c_str());
  return 0;
}
