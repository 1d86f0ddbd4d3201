// cast_bench: f32 -> bf16 conversion on the CPU, in GB/s of source bytes, against memcpy of the same
// source bytes in the same run. Usage: cast_bench [MiB of f32 source, default 256]
#include <cstring>
#include <vector>

#include "cli.h"
#include "harness.h"
#include "laminar/kernels/cast.h"

int main(int argc, char** argv) {
  CLI::App app{"f32 -> bf16 conversion on the CPU against memcpy of the same bytes"};
  app.option_defaults()->always_capture_default();
  std::size_t mib = 256;
  app.add_option("mib", mib, "MiB of f32 source")->check(laminar::bench::positive());
  CLI11_PARSE(app, argc, argv);
  const std::size_t n = mib * (1u << 20) / 4;
  std::vector<float> src(n);
  for (std::size_t i = 0; i < n; ++i) src[i] = float(i % 1000) * 0.37f - 100.f;
  std::vector<std::uint16_t> dst(n);
  std::vector<float> copy(n);
  const double bytes = double(n) * 4;

  laminar::kernels::CastParams p{src.data(), dst.data(), std::int64_t(n), laminar::DType::kF32,
                                 laminar::DType::kBF16};
  bool ok = true;
  auto ours = laminar::bench::measure([&] { ok = ok && laminar::kernels::run(p, laminar::Stream::host()).ok(); });
  auto base = laminar::bench::measure([&] { std::memcpy(copy.data(), src.data(), n * 4); });
  if (!ok) return 1;
  laminar::bench::require_stable_baseline("memcpy_1thread", base);
  laminar::bench::report_throughput("cast_f32_to_bf16_cpu", "GB/s", bytes / ours.median_s / 1e9,
                                    "memcpy_1thread", bytes / base.median_s / 1e9);
  return 0;
}
