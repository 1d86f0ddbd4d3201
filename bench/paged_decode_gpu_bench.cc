// paged_decode_gpu_bench: one decode step of paged attention on the GPU, as effective KV bandwidth
// (K + V bytes per second), reported with the device name and as a share of the device's peak
// memory bandwidth, against a device-to-device cudaMemcpy of the same bytes in the same run.
// Exits 77 (skipped) when there is no CUDA device.
//
// Usage: paged_decode_gpu_bench [--dtype bf16|f16|f32] [--batch 64] [--len 4096] [--kv-heads 8]
//                               [--group 4] [--head-dim 128] [--page 16]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cli.h"
#include "harness.h"
#include "laminar/kernels/paged_decode.h"

namespace {

constexpr int kSkip = 77;

#define LAMINAR_BENCH_CUDA(call)                                                                  \
  do {                                                                                            \
    const cudaError_t err_ = (call);                                                              \
    if (err_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(err_));                   \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

// `repeats` timed runs of body on the default stream, after two warm-ups.
template <class F>
laminar::bench::Timing time_gpu(F&& body, int repeats = 9) {
  cudaEvent_t start, stop;
  LAMINAR_BENCH_CUDA(cudaEventCreate(&start));
  LAMINAR_BENCH_CUDA(cudaEventCreate(&stop));
  body();
  body();
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    LAMINAR_BENCH_CUDA(cudaEventRecord(start));
    body();
    LAMINAR_BENCH_CUDA(cudaEventRecord(stop));
    LAMINAR_BENCH_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    LAMINAR_BENCH_CUDA(cudaEventElapsedTime(&ms, start, stop));
    t.push_back(ms / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front(), t.back(), repeats};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"One decode step of paged attention on the GPU against a device-to-device cudaMemcpy"};
  app.option_defaults()->always_capture_default();
  std::string dtype_name = "bf16";
  int batch = 64, len = 4096, kv_heads = 8, group = 4, head_dim = 128, page = 16;
  app.add_option("--dtype", dtype_name, "K, V and Q element type")->check(CLI::IsMember({"bf16", "f16", "f32"}));
  app.add_option("--batch", batch, "sequences")->check(laminar::bench::positive());
  app.add_option("--len", len, "tokens a sequence")->check(laminar::bench::positive());
  app.add_option("--kv-heads", kv_heads, "KV heads")->check(laminar::bench::positive());
  app.add_option("--group", group, "query heads a KV head")->check(laminar::bench::positive());
  app.add_option("--head-dim", head_dim, "head dimension")->check(laminar::bench::positive());
  app.add_option("--page", page, "tokens a page")->check(laminar::bench::positive());
  CLI11_PARSE(app, argc, argv);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("no CUDA device: skipping\n");
    return kSkip;
  }
  auto dtype = laminar::parse_dtype(dtype_name);
  if (!dtype.ok()) {
    std::fprintf(stderr, "%s\n", dtype.status().to_string().c_str());
    return 2;
  }
  const std::size_t elem = laminar::dtype_size(*dtype);
  const int pages_per_seq = (len + page - 1) / page;
  const int num_pages = batch * pages_per_seq;
  const std::size_t pool_bytes = std::size_t(num_pages) * page * kv_heads * head_dim * elem;
  const int qo_heads = kv_heads * group;
  const std::size_t q_bytes = std::size_t(batch) * qo_heads * head_dim * elem;

  // Host side: values near 1 in every dtype (top byte 0x3c / 0x3b), shuffled pages.
  std::vector<unsigned char> host(pool_bytes);
  std::uint64_t x = 0x9e3779b97f4a7c15ull;
  for (std::size_t i = 0; i < pool_bytes; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    host[i] = (i % elem == elem - 1) ? 0x3c : static_cast<unsigned char>(x);
  }
  std::mt19937 rng(1);
  std::vector<std::int32_t> indices(static_cast<std::size_t>(num_pages));
  std::iota(indices.begin(), indices.end(), 0);
  std::shuffle(indices.begin(), indices.end(), rng);
  std::vector<std::int32_t> indptr(static_cast<std::size_t>(batch) + 1), last(static_cast<std::size_t>(batch));
  for (int b = 0; b <= batch; ++b) indptr[std::size_t(b)] = b * pages_per_seq;
  for (int b = 0; b < batch; ++b) last[std::size_t(b)] = len - (pages_per_seq - 1) * page;

  void *k, *v, *q, *out, *copy_dst, *ws;
  std::int32_t *d_indptr, *d_indices, *d_last;
  float* lse;
  LAMINAR_BENCH_CUDA(cudaMalloc(&k, pool_bytes));
  LAMINAR_BENCH_CUDA(cudaMalloc(&v, pool_bytes));
  LAMINAR_BENCH_CUDA(cudaMalloc(&copy_dst, 2 * pool_bytes));
  LAMINAR_BENCH_CUDA(cudaMalloc(&q, q_bytes));
  LAMINAR_BENCH_CUDA(cudaMalloc(&out, q_bytes));
  LAMINAR_BENCH_CUDA(cudaMalloc(&lse, std::size_t(batch) * qo_heads * sizeof(float)));
  LAMINAR_BENCH_CUDA(cudaMalloc(&d_indptr, indptr.size() * 4));
  LAMINAR_BENCH_CUDA(cudaMalloc(&d_indices, indices.size() * 4));
  LAMINAR_BENCH_CUDA(cudaMalloc(&d_last, last.size() * 4));
  LAMINAR_BENCH_CUDA(cudaMemcpy(k, host.data(), pool_bytes, cudaMemcpyHostToDevice));
  LAMINAR_BENCH_CUDA(cudaMemcpy(v, host.data(), pool_bytes, cudaMemcpyHostToDevice));
  LAMINAR_BENCH_CUDA(cudaMemcpy(q, host.data(), q_bytes, cudaMemcpyHostToDevice));
  LAMINAR_BENCH_CUDA(cudaMemcpy(d_indptr, indptr.data(), indptr.size() * 4, cudaMemcpyHostToDevice));
  LAMINAR_BENCH_CUDA(cudaMemcpy(d_indices, indices.data(), indices.size() * 4, cudaMemcpyHostToDevice));
  LAMINAR_BENCH_CUDA(cudaMemcpy(d_last, last.data(), last.size() * 4, cudaMemcpyHostToDevice));

  laminar::kernels::PagedDecodeParams p;
  p.q = q;
  p.out = out;
  p.lse = lse;
  p.kv = {k, v, {num_pages, page, kv_heads, head_dim, *dtype}};
  p.table = {d_indptr, d_indices, d_last, batch};
  p.num_rows = batch;
  p.num_qo_heads = qo_heads;
  p.sm_scale = 1.0f / std::sqrt(float(head_dim));
  p.max_kv_len = len;
  p.workspace_bytes = laminar::kernels::workspace_bytes(p);
  LAMINAR_BENCH_CUDA(cudaMalloc(&ws, p.workspace_bytes));
  p.workspace = ws;
  const laminar::Stream stream = laminar::Stream::cuda(nullptr);
  const laminar::Status st = laminar::kernels::can_implement(p, stream);
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.to_string().c_str());
    return 2;
  }
  bool ok = true;
  const double ours = time_gpu([&] { ok = ok && laminar::kernels::run(p, stream).ok(); }).median_s;
  const laminar::bench::Timing copy = time_gpu([&] {
    LAMINAR_BENCH_CUDA(cudaMemcpyAsync(copy_dst, k, pool_bytes, cudaMemcpyDeviceToDevice));
    LAMINAR_BENCH_CUDA(cudaMemcpyAsync(static_cast<char*>(copy_dst) + pool_bytes, v, pool_bytes, cudaMemcpyDeviceToDevice));
  });
  laminar::bench::require_stable_baseline("cudaMemcpyD2D", copy);
  const double base = copy.median_s;
  LAMINAR_BENCH_CUDA(cudaDeviceSynchronize());
  if (!ok) {
    std::fprintf(stderr, "paged decode failed\n");
    return 1;
  }

  int dev = 0, clock_khz = 0, bus_bits = 0;
  LAMINAR_BENCH_CUDA(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  LAMINAR_BENCH_CUDA(cudaGetDeviceProperties(&prop, dev));
  LAMINAR_BENCH_CUDA(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, dev));
  LAMINAR_BENCH_CUDA(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev));
  const double peak = 2.0 * clock_khz * 1e3 * (bus_bits / 8.0);  // double data rate
  const double bytes = 2.0 * double(pool_bytes);
  const double ours_bw = bytes / ours, copy_bw = 2.0 * bytes / base;  // a copy reads and writes
  std::printf("device %s: peak memory bandwidth %.0f GB/s\n", prop.name, peak / 1e9);
  std::printf("paged decode %s: batch %d x %d tokens, %d kv heads x group %d, head_dim %d, page %d: %.3f ms per step, "
              "KV %.0f MiB, %.1f%% of peak; D2D copy of the same bytes %.3f ms (%.1f%% of peak, read + write)\n",
              dtype_name.c_str(), batch, len, kv_heads, group, head_dim, page, ours * 1e3, bytes / (1 << 20),
              100.0 * ours_bw / peak, base * 1e3, 100.0 * copy_bw / peak);
  // Baseline: the D2D copy's bandwidth counted as read + write traffic, so both sides are "bytes
  // moved through HBM per second".
  laminar::bench::report_throughput("paged_decode_gpu_" + dtype_name, "GB/s", ours_bw / 1e9, "cudaMemcpyD2D",
                                    copy_bw / 1e9);
  cudaFree(k);
  cudaFree(v);
  cudaFree(copy_dst);
  cudaFree(q);
  cudaFree(out);
  cudaFree(lse);
  cudaFree(ws);
  cudaFree(d_indptr);
  cudaFree(d_indices);
  cudaFree(d_last);
  return 0;
}
