// sampling_gpu_bench: the CUDA sampling kernel (top-k 50 + top-p 0.9, 152k vocabulary, bf16 and
// f32 logits) in GB/s of logits read, against a device-to-device cudaMemcpy of the same logits in
// the same run (counted as read + write traffic, as paged_decode_gpu_bench counts it). Prints the
// device name and both as a share of the HBM peak; exits 77 (skipped) when there is no CUDA device.
//   sampling_gpu_bench [--batch B] [--vocab V]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cli.h"
#include "harness.h"
#include "laminar/internal/numerics.h"
#include "laminar/kernels/sampling.h"

namespace {

bool check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::fprintf(stderr, "sampling_gpu_bench: %s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The CUDA sampling kernel against a device-to-device cudaMemcpy of the same logits"};
  app.option_defaults()->always_capture_default();
  std::int64_t batch = 64, vocab = 152064;
  app.add_option("--batch", batch, "rows")->check(laminar::bench::positive());
  app.add_option("--vocab", vocab, "logits a row")->check(laminar::bench::positive());
  CLI11_PARSE(app, argc, argv);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("sampling_gpu_bench: no CUDA device, skipping\n");
    return 77;
  }
  cudaDeviceProp prop{};
  int mem_khz = 0, bus_bits = 0;
  if (!check(cudaGetDeviceProperties(&prop, 0), "properties") ||
      !check(cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, 0), "memory clock") ||
      !check(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0), "bus width")) {
    return 1;
  }
  const double peak_gbs = 2.0 * mem_khz * 1e3 * (bus_bits / 8.0) / 1e9;  // double data rate
  std::printf("device: %s, HBM peak %.0f GB/s, batch %lld, vocab %lld\n", prop.name, peak_gbs,
              static_cast<long long>(batch), static_cast<long long>(vocab));

  std::mt19937 rng(1234);
  std::normal_distribution<float> bulk(0.0f, 2.5f);
  std::vector<float> logits(static_cast<std::size_t>(batch * vocab));
  for (auto& v : logits) v = bulk(rng);
  for (std::int64_t r = 0; r < batch; ++r) {
    for (int j = 0; j < 40; ++j) logits[static_cast<std::size_t>(r * vocab + std::int64_t(rng() % vocab))] += 12.0f;
  }
  std::vector<std::uint16_t> half(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i) half[i] = laminar::internal::f32_to_bf16(logits[i]);
  std::vector<float> temperature(static_cast<std::size_t>(batch), 1.0f), top_p(static_cast<std::size_t>(batch), 0.9f);
  std::vector<std::int32_t> top_k(static_cast<std::size_t>(batch), 50);
  std::vector<std::uint64_t> seed(static_cast<std::size_t>(batch), 7);
  std::vector<std::int64_t> position(static_cast<std::size_t>(batch), 3);

  void *d_logits = nullptr, *d_copy = nullptr, *d_settings = nullptr;
  const std::size_t n = static_cast<std::size_t>(batch);
  const std::size_t settings_bytes = n * (4 + 4 + 4 + 8 + 8 + 4 + 4);
  const bool allocated = check(cudaMalloc(&d_logits, logits.size() * 4), "malloc") &&
                         check(cudaMalloc(&d_copy, logits.size() * 4), "malloc") &&
                         check(cudaMalloc(&d_settings, settings_bytes), "malloc");
  if (!allocated) {
    return 1;
  }
  auto* base = static_cast<unsigned char*>(d_settings);
  auto* d_temp = reinterpret_cast<float*>(base);
  auto* d_top_p = reinterpret_cast<float*>(base + 4 * n);
  auto* d_top_k = reinterpret_cast<std::int32_t*>(base + 8 * n);
  auto* d_seed = reinterpret_cast<std::uint64_t*>(base + 12 * n + (n % 2) * 4);
  auto* d_pos = reinterpret_cast<std::int64_t*>(reinterpret_cast<unsigned char*>(d_seed) + 8 * n);
  auto* d_token = reinterpret_cast<std::int32_t*>(reinterpret_cast<unsigned char*>(d_pos) + 8 * n);
  auto* d_lp = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(d_token) + 4 * n);
  bool ok = check(cudaMemcpy(d_temp, temperature.data(), 4 * n, cudaMemcpyHostToDevice), "copy") &&
            check(cudaMemcpy(d_top_p, top_p.data(), 4 * n, cudaMemcpyHostToDevice), "copy") &&
            check(cudaMemcpy(d_top_k, top_k.data(), 4 * n, cudaMemcpyHostToDevice), "copy") &&
            check(cudaMemcpy(d_seed, seed.data(), 8 * n, cudaMemcpyHostToDevice), "copy") &&
            check(cudaMemcpy(d_pos, position.data(), 8 * n, cudaMemcpyHostToDevice), "copy");
  if (!ok) return 1;

  double last_gbs = 0, copy_gbs = 0;
  for (laminar::DType dtype : {laminar::DType::kF32, laminar::DType::kBF16}) {
    const std::size_t bytes = logits.size() * laminar::dtype_size(dtype);
    const void* src = dtype == laminar::DType::kF32 ? static_cast<const void*>(logits.data()) : half.data();
    if (!check(cudaMemcpy(d_logits, src, bytes, cudaMemcpyHostToDevice), "copy logits")) return 1;
    laminar::kernels::SamplingParams p;
    p.logits = d_logits;
    p.logits_dtype = dtype;
    p.batch = batch;
    p.vocab = vocab;
    p.temperature = d_temp;
    p.top_k = d_top_k;
    p.top_p = d_top_p;
    p.seed = d_seed;
    p.position = d_pos;
    p.token = d_token;
    p.raw_logprob = d_lp;
    const auto t = laminar::bench::measure([&] {
      ok = ok && laminar::kernels::run(p, laminar::Stream::cuda(nullptr)).ok();
      ok = ok && check(cudaDeviceSynchronize(), "sync");
    });
    const auto c = laminar::bench::measure([&] {
      ok = ok && check(cudaMemcpy(d_copy, d_logits, bytes, cudaMemcpyDeviceToDevice), "copy");
      ok = ok && check(cudaDeviceSynchronize(), "sync");
    });
    if (!ok) return 1;
    laminar::bench::require_stable_baseline("cudaMemcpyD2D", c);
    last_gbs = double(bytes) / t.median_s / 1e9;
    copy_gbs = 2.0 * double(bytes) / c.median_s / 1e9;  // a copy reads and writes
    std::printf("%s logits: %.1f us per batch, %.0f GB/s of logits, %.1f%% of HBM peak; D2D copy of the same "
                "bytes %.1f us (%.1f%% of peak, read + write)\n",
                std::string(laminar::dtype_name(dtype)).c_str(), t.median_s * 1e6, last_gbs, 100 * last_gbs / peak_gbs,
                c.median_s * 1e6, 100 * copy_gbs / peak_gbs);
  }
  cudaFree(d_logits);
  cudaFree(d_copy);
  cudaFree(d_settings);
  laminar::bench::report_throughput("sampling_gpu_top_k50_top_p0.9_bf16", "GB/s", last_gbs, "cudaMemcpyD2D", copy_gbs);
  return 0;
}
