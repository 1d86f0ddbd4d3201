// paged_decode_bench: one CPU decode step of paged attention over a batch, as effective KV
// bandwidth (K + V bytes read per second), against a 2-thread memcpy of the same number of bytes
// in the same run (goal: ratio >= 0.7). The KV is larger than the last-level cache, as in a real
// rollout step.
//
// Usage: paged_decode_bench [--dtype bf16|f16|f32] [--batch 64] [--len 4096] [--kv-heads 8]
//                           [--group 4] [--head-dim 128] [--page 16] [--threads 2]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cli.h"
#include "harness.h"
#include "laminar/kernels/paged_decode.h"

namespace {

struct Options {
  std::string dtype = "bf16";
  int batch = 64;
  int len = 4096;
  int kv_heads = 8;
  int group = 4;
  int head_dim = 128;
  int page = 16;
  int threads = 2;
};

void* aligned_bytes(std::size_t n) { return std::aligned_alloc(64, (n + 63) / 64 * 64); }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"One CPU decode step of paged attention against a 2-thread memcpy of the same bytes"};
  app.option_defaults()->always_capture_default();
  Options o;
  app.add_option("--dtype", o.dtype, "K, V and Q element type")->check(CLI::IsMember({"bf16", "f16", "f32"}));
  app.add_option("--batch", o.batch, "sequences")->check(laminar::bench::positive());
  app.add_option("--len", o.len, "tokens a sequence")->check(laminar::bench::positive());
  app.add_option("--kv-heads", o.kv_heads, "KV heads")->check(laminar::bench::positive());
  app.add_option("--group", o.group, "query heads a KV head")->check(laminar::bench::positive());
  app.add_option("--head-dim", o.head_dim, "head dimension")->check(laminar::bench::positive());
  app.add_option("--page", o.page, "tokens a page")->check(laminar::bench::positive());
  app.add_option("--threads", o.threads, "CPU threads")->check(laminar::bench::positive());
  CLI11_PARSE(app, argc, argv);
  auto dtype = laminar::parse_dtype(o.dtype);
  if (!dtype.ok()) {
    std::fprintf(stderr, "%s\n", dtype.status().to_string().c_str());
    return 2;
  }
  const std::size_t elem = laminar::dtype_size(*dtype);
  const int pages_per_seq = (o.len + o.page - 1) / o.page;
  const int num_pages = o.batch * pages_per_seq;
  const std::size_t pool_bytes = std::size_t(num_pages) * o.page * o.kv_heads * o.head_dim * elem;
  auto* k = static_cast<unsigned char*>(aligned_bytes(pool_bytes));
  auto* v = static_cast<unsigned char*>(aligned_bytes(pool_bytes));
  auto* copy_dst = static_cast<unsigned char*>(aligned_bytes(2 * pool_bytes));
  // Finite values near 1 in every dtype: random low bytes under a fixed top byte (0x3c.. is about
  // 1.0 in f16 and bf16, and a small positive exponent in f32).
  std::mt19937 rng(1);
  std::uint64_t x = 0x9e3779b97f4a7c15ull;
  for (std::size_t i = 0; i < pool_bytes; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;  // xorshift: filling a GiB with mt19937 takes seconds
    k[i] = (i % elem == elem - 1) ? 0x3c : static_cast<unsigned char>(x);
    v[i] = (i % elem == elem - 1) ? 0x3b : static_cast<unsigned char>(x >> 8);
  }
  std::memset(copy_dst, 0, 2 * pool_bytes);

  // Pages in shuffled order, as a long-running cache hands them out.
  std::vector<std::int32_t> indices(static_cast<std::size_t>(num_pages));
  std::iota(indices.begin(), indices.end(), 0);
  std::shuffle(indices.begin(), indices.end(), rng);
  std::vector<std::int32_t> indptr(std::size_t(o.batch) + 1), last(std::size_t(o.batch));
  for (int b = 0; b <= o.batch; ++b) indptr[std::size_t(b)] = b * pages_per_seq;
  for (int b = 0; b < o.batch; ++b) last[std::size_t(b)] = o.len - (pages_per_seq - 1) * o.page;

  const int qo_heads = o.kv_heads * o.group;
  const std::size_t q_bytes = std::size_t(o.batch) * qo_heads * o.head_dim * elem;
  auto* q = static_cast<unsigned char*>(aligned_bytes(q_bytes));
  auto* out = static_cast<unsigned char*>(aligned_bytes(q_bytes));
  for (std::size_t i = 0; i < q_bytes; ++i) q[i] = (i % elem == elem - 1) ? 0x3c : static_cast<unsigned char>(rng());
  std::vector<float> lse(std::size_t(o.batch) * qo_heads);

  laminar::kernels::PagedDecodeParams p;
  p.q = q;
  p.out = out;
  p.lse = lse.data();
  p.kv = {k, v, {num_pages, o.page, o.kv_heads, o.head_dim, *dtype}};
  p.table = {indptr.data(), indices.data(), last.data(), o.batch};
  p.num_rows = o.batch;
  p.num_qo_heads = qo_heads;
  p.sm_scale = 1.0f / std::sqrt(float(o.head_dim));
  p.max_kv_len = o.len;
  p.cpu_threads = o.threads;
  const laminar::Status st = laminar::kernels::can_implement(p, laminar::Stream::host());
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.to_string().c_str());
    return 2;
  }

  bool ok = true;
  const laminar::bench::MeasureOptions opt{2, 7};
  const auto ours = laminar::bench::measure([&] { ok = ok && laminar::kernels::run(p, laminar::Stream::host()).ok(); }, opt);
  // Baseline: the same bytes (K then V) copied by `threads` threads, each its own contiguous share.
  const auto base = laminar::bench::measure(
      [&] {
        std::vector<std::thread> pool;
        const std::size_t total = 2 * pool_bytes;
        const std::size_t share = (total / std::size_t(o.threads) + 63) / 64 * 64;
        for (int t = 0; t < o.threads; ++t) {
          pool.emplace_back([&, t] {
            for (std::size_t off = std::size_t(t) * share; off < std::min(total, std::size_t(t + 1) * share);) {
              const std::size_t end = std::min({total, std::size_t(t + 1) * share, off < pool_bytes ? pool_bytes : total});
              const unsigned char* src = off < pool_bytes ? k + off : v + (off - pool_bytes);
              std::memcpy(copy_dst + off, src, end - off);
              off = end;
            }
          });
        }
        for (auto& th : pool) th.join();
      },
      opt);
  if (!ok) {
    std::fprintf(stderr, "paged decode failed\n");
    return 1;
  }
  const double bytes = 2.0 * double(pool_bytes);
  std::printf("paged decode %s: batch %d x %d tokens, %d kv heads x group %d, head_dim %d, page %d, %d threads: "
              "%.2f ms per step (KV %.0f MiB), memcpy %.2f ms\n",
              o.dtype.c_str(), o.batch, o.len, o.kv_heads, o.group, o.head_dim, o.page, o.threads,
              ours.median_s * 1e3, bytes / (1 << 20), base.median_s * 1e3);
  laminar::bench::require_stable_baseline("memcpy", base);
  laminar::bench::report_throughput("paged_decode_cpu_" + o.dtype, "GB/s", bytes / ours.median_s / 1e9,
                                    "memcpy_" + std::to_string(o.threads) + "threads", bytes / base.median_s / 1e9);
  std::free(k);
  std::free(v);
  std::free(copy_dst);
  std::free(q);
  std::free(out);
  return 0;
}
