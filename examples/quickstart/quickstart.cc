// quickstart: what the actor side does before publishing a policy version.
// Describes a small transformer's weights as a WeightManifest, takes them in through DLPack views,
// converts the f32 master copy to bf16 for the rollout engines, prints the manifest the relays would
// ship, and shows that a corrupt manifest from a peer is refused with a clear error.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "laminar/laminar.h"

namespace {

// A bf16 value is the top half of the f32 with the same sign, exponent and leading mantissa bits.
float bf16_to_f32(std::uint16_t bits) {
  const std::uint32_t wide = std::uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

int fail(const laminar::Status& st) {
  std::fprintf(stderr, "quickstart: %s\n", st.to_string().c_str());
  return 1;
}

}  // namespace

int main() {
  const std::int64_t vocab = 512, dim = 128, layers = 2;
  laminar::WeightManifest manifest;
  laminar::Status st = manifest.add("embed.weight", laminar::DType::kBF16, {vocab, dim});
  for (std::int64_t l = 0; l < layers && st.ok(); ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    st = manifest.add(p + "attn.qkv.weight", laminar::DType::kBF16, {3 * dim, dim});
    if (st.ok()) st = manifest.add(p + "mlp.up.weight", laminar::DType::kBF16, {4 * dim, dim});
    if (st.ok()) st = manifest.add(p + "norm.weight", laminar::DType::kBF16, {dim});
  }
  if (!st.ok()) return fail(st);

  // The actor's f32 master weights, and the bf16 flat buffer a relay would hold.
  std::vector<std::uint8_t> flat(manifest.total_bytes());
  double max_rel_err = 0;
  for (const auto& e : manifest.entries()) {
    std::vector<float> master(e.nbytes / 2);
    for (std::size_t i = 0; i < master.size(); ++i) master[i] = std::sin(float(i) * 0.01f) * 0.02f;
    std::vector<std::int64_t> shape = e.shape;
    auto view = laminar::TensorView::contiguous(master.data(), laminar::DType::kF32, shape);
    if (!view.ok()) return fail(view.status());
    DLTensor dl = view->to_dlpack();  // how a framework would hand the tensor over
    auto in = laminar::TensorView::from_dlpack(dl, laminar::TensorView::StridePolicy::kContiguous);
    if (!in.ok()) return fail(in.status());
    laminar::kernels::CastParams cast{in->data(), flat.data() + e.offset, in->numel(), laminar::DType::kF32,
                                      e.dtype};
    if (st = laminar::kernels::run(cast, laminar::Stream::host()); !st.ok()) return fail(st);
    const auto* out = reinterpret_cast<const std::uint16_t*>(flat.data() + e.offset);
    for (std::size_t i = 0; i < master.size(); ++i) {
      if (master[i] == 0) continue;
      const double back = bf16_to_f32(out[i]);
      max_rel_err = std::fmax(max_rel_err, std::fabs(back - master[i]) / std::fabs(master[i]));
    }
  }
  std::printf("manifest: %zu tensors, %llu bytes (bf16, 256-byte aligned)\n", manifest.size(),
              static_cast<unsigned long long>(manifest.total_bytes()));
  std::printf("f32 -> bf16 max relative error: %.3g (7 stored mantissa bits: bound 2^-8 = %.3g)\n", max_rel_err,
              std::ldexp(1.0, -8));
  const std::string json = manifest.to_json();
  std::printf("manifest JSON (%zu bytes): %.160s...\n", json.size(), json.c_str());

  auto roundtrip = laminar::WeightManifest::from_json(json);
  if (!roundtrip.ok() || !(*roundtrip == manifest)) return fail(laminar::internal_error("round trip differs"));
  std::string corrupt = json;
  const std::string second = "\"offset\":" + std::to_string(manifest.entries()[1].offset);
  corrupt.replace(corrupt.find(second), second.size(), second + "1");
  auto refused = laminar::WeightManifest::from_json(corrupt);
  std::printf("corrupt manifest from a peer: %s\n", refused.status().to_string().c_str());
  return refused.ok() || max_rel_err > std::ldexp(1.0, -8) ? 1 : 0;
}
