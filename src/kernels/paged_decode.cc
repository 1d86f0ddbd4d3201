#include "laminar/kernels/paged_decode.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include "paged_decode_args.h"
#include "paged_decode_cpu.h"

namespace laminar::kernels {

#if defined(LAMINAR_HAVE_CUDA)
namespace cuda_detail {
Status launch_paged_decode(const DecodeArgs& a, KvKind kind, int head_dim, std::int32_t num_rows, void* stream);
}
#endif

namespace {

using cuda_detail::DecodeArgs;
using cuda_detail::KvKind;

static_assert(cuda_detail::kSplit == kSplitTokens, "the kernels and the public header disagree on the split size");

// A CUDA run keeps this much workspace at most (a long prefill goes in row chunks); the CPU keeps
// less, so one chunk's partials stay in the last-level cache.
constexpr std::size_t kCudaWorkspaceBudget = std::size_t(256) << 20;
constexpr std::size_t kCpuWorkspaceBudget = std::size_t(16) << 20;

KvKind kind_of(DType t) { return t == DType::kF32 ? KvKind::kF32 : t == DType::kF16 ? KvKind::kF16 : KvKind::kBF16; }

using cuda_detail::decode_max_splits;
using cuda_detail::decode_row_floats;
using cuda_detail::make_decode_args;

std::int32_t chunk_rows(const PagedDecodeParams& p, std::size_t budget_bytes) {
  const std::size_t per_row = decode_row_floats(p) * sizeof(float);
  return std::int32_t(std::clamp<std::size_t>(budget_bytes / per_row, 1, std::size_t(std::max(p.num_rows, 1))));
}


// Runs task(i, next) for i in [0, n) on `threads` threads (the caller is one of them); `next` is
// the index the same thread runs afterwards (-1 when none), claimed before task i starts so the
// task can fetch its data meanwhile.
template <class F>
void parallel_for(std::int64_t n, int threads, const F& task) {
  if (n <= 0) return;
  threads = int(std::min<std::int64_t>(threads, n));
  std::atomic<std::int64_t> next{0};
  auto worker = [&] {
    std::int64_t i = next.fetch_add(1);
    while (i < n) {
      const std::int64_t after = next.fetch_add(1);
      task(i, after < n ? after : -1);
      i = after;
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(std::size_t(threads - 1));
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

Status check_host_table(const PagedDecodeParams& p) {
  if (p.table.batch == 0 && p.num_rows == 0) return ok_status();  // empty batch: nothing to read
  LAMINAR_RETURN_IF_ERROR(validate(p.table, p.kv.layout).with_context("paged_decode"));
  for (std::int32_t b = 0; b < p.table.batch; ++b) {
    const std::int64_t len = sequence_length(p.table, b, p.kv.layout.page_size);
    if (len > p.max_kv_len) {
      return invalid_argument(
          fmt::format("paged_decode: sequence {} has {} tokens, more than max_kv_len {}", b, len, p.max_kv_len));
    }
  }
  if (p.qo_indptr == nullptr) return ok_status();
  if (p.qo_indptr[0] != 0) return invalid_argument(fmt::format("paged_decode: qo_indptr[0] = {}, not 0", p.qo_indptr[0]));
  for (std::int32_t b = 0; b < p.table.batch; ++b) {
    const std::int64_t n = std::int64_t(p.qo_indptr[b + 1]) - p.qo_indptr[b];
    const std::int64_t len = sequence_length(p.table, b, p.kv.layout.page_size);
    if (n < 0 || n > len) {
      return invalid_argument(fmt::format("paged_decode: sequence {} has {} query rows for {} tokens", b, n, len));
    }
  }
  if (p.qo_indptr[p.table.batch] != p.num_rows) {
    return invalid_argument(fmt::format("paged_decode: qo_indptr[batch] = {} but num_rows = {}",
                                        p.qo_indptr[p.table.batch], p.num_rows));
  }
  return ok_status();
}

Status run_host(const PagedDecodeParams& p) {
  if (p.num_rows == 0) return ok_status();
  const int threads = p.cpu_threads > 0 ? p.cpu_threads : int(std::max(1u, std::thread::hardware_concurrency()));
  const std::int32_t rows = chunk_rows(p, kCpuWorkspaceBudget);
  // Kept per calling thread between calls (at most kCpuWorkspaceBudget bytes, or one row's worth):
  // a fresh buffer each decode step would cost its page faults every step. Every slot a merge reads
  // is written by a split task of the same call first.
  thread_local std::vector<float> ws;
  if (ws.size() < decode_row_floats(p) * std::size_t(rows)) ws.resize(decode_row_floats(p) * std::size_t(rows));
  DecodeArgs a = make_decode_args(p, ws.data(), rows);
  const KvKind kind = kind_of(p.kv.layout.dtype);
  const int head_dim = p.kv.layout.head_dim;
  for (std::int32_t begin = 0; begin < p.num_rows; begin += rows) {
    const std::int32_t count = std::min(rows, p.num_rows - begin);
    a.row_begin = begin;
    // Only the splits each row really has become tasks. A task takes as many KV heads of its split
    // as fit (kCpuQoHeadsPerTask query heads), unless that leaves fewer tasks than threads to
    // share: then one head each.
    std::vector<std::int32_t> row_splits(static_cast<std::size_t>(count));
    std::int64_t total_splits = 0;
    for (std::int32_t r = 0; r < count; ++r) {
      const auto info = cuda_detail::row_info(a.indptr, a.last_page_len, a.qo_indptr, a.batch, a.page_size, begin + r);
      row_splits[std::size_t(r)] = cuda_detail::num_splits(info.kv_len);
      total_splits += row_splits[std::size_t(r)];
    }
    const std::int32_t group = a.num_qo_heads / a.num_kv_heads;
    const std::int32_t heads_per_task =
        total_splits >= 2 * threads ? std::min(a.num_kv_heads, cpu_detail::kCpuQoHeadsPerTask / group) : 1;
    std::vector<cpu_detail::SplitWork> tasks;
    for (std::int32_t r = 0; r < count; ++r) {
      for (std::int32_t s = 0; s < row_splits[std::size_t(r)]; ++s) {
        for (std::int32_t h = 0; h < a.num_kv_heads; h += heads_per_task) {
          tasks.push_back({r, s, h, std::min(heads_per_task, a.num_kv_heads - h)});
        }
      }
    }
    parallel_for(std::int64_t(tasks.size()), threads, [&](std::int64_t i, std::int64_t after) {
      cpu_detail::split_task(a, kind, head_dim, tasks[std::size_t(i)], after >= 0 ? &tasks[std::size_t(after)] : nullptr);
    });
    parallel_for(std::int64_t(count) * p.num_qo_heads, threads, [&](std::int64_t i, std::int64_t) {
      cpu_detail::merge_task(a, kind, head_dim, int(i / p.num_qo_heads), int(i % p.num_qo_heads));
    });
  }
  return ok_status();
}

}  // namespace

std::size_t workspace_bytes(const PagedDecodeParams& p) {
  if (p.num_rows <= 0 || p.num_qo_heads <= 0 || p.kv.layout.head_dim <= 0) return 0;
  return decode_row_floats(p) * sizeof(float) * std::size_t(chunk_rows(p, kCudaWorkspaceBudget));
}

Status can_implement(const PagedDecodeParams& p, Stream stream) {
  const KvLayout& l = p.kv.layout;
  LAMINAR_RETURN_IF_ERROR(validate(l).with_context("paged_decode"));
  if (l.head_dim != 64 && l.head_dim != 128) {
    return invalid_argument(fmt::format("paged_decode: head_dim {} is not supported (64 or 128)", l.head_dim));
  }
  if (p.num_qo_heads <= 0 || p.num_qo_heads % l.num_kv_heads != 0) {
    return invalid_argument(fmt::format("paged_decode: num_qo_heads {} is not a positive multiple of num_kv_heads {}",
                                        p.num_qo_heads, l.num_kv_heads));
  }
  const int group = p.num_qo_heads / l.num_kv_heads;
  if (group != 1 && group != 2 && group != 4 && group != 8) {
    return invalid_argument(fmt::format("paged_decode: group size {} (num_qo_heads {} / num_kv_heads {}) is not 1, 2, 4 or 8",
                                        group, p.num_qo_heads, l.num_kv_heads));
  }
  if (!(std::isfinite(p.sm_scale) && p.sm_scale > 0.0f)) {
    return invalid_argument(fmt::format("paged_decode: sm_scale {} must be finite and positive", p.sm_scale));
  }
  if (p.num_rows < 0 || p.table.batch < 0 || p.max_kv_len < 0) {
    return invalid_argument(fmt::format("paged_decode: negative count (num_rows {}, batch {}, max_kv_len {})", p.num_rows,
                                        p.table.batch, p.max_kv_len));
  }
  if (p.qo_indptr == nullptr && p.num_rows != p.table.batch) {
    return invalid_argument(
        fmt::format("paged_decode: decode needs num_rows == batch, got {} and {}", p.num_rows, p.table.batch));
  }
  if (std::int64_t(decode_max_splits(p)) > 65535) {
    return invalid_argument(fmt::format("paged_decode: max_kv_len {} is beyond {} splits", p.max_kv_len, 65535));
  }
  if (p.num_rows > 0 && (p.q == nullptr || p.out == nullptr)) {
    return invalid_argument(fmt::format("paged_decode: null {} with {} rows", p.q ? "out" : "q", p.num_rows));
  }
  if (p.table.batch > 0 && (p.kv.k_pages == nullptr || p.kv.v_pages == nullptr)) {
    return invalid_argument("paged_decode: null K or V page pool");
  }
  const auto misaligned = [](const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 != 0; };
  if (misaligned(p.kv.k_pages) || misaligned(p.kv.v_pages) || misaligned(p.q) || misaligned(p.out)) {
    return invalid_argument("paged_decode: q, out and the page pools must be 16-byte aligned");
  }
  if (stream.on_device) {
    if (p.num_rows > 0 && (p.workspace == nullptr || p.workspace_bytes < workspace_bytes(p))) {
      return invalid_argument(fmt::format("paged_decode: workspace of {} bytes, {} needed", p.workspace_bytes,
                                          workspace_bytes(p)));
    }
    if (p.table.indptr == nullptr || (p.table.batch > 0 && p.table.last_page_len == nullptr)) {
      return invalid_argument("paged_decode: null page table");
    }
    return ok_status();
  }
  return check_host_table(p);
}

Status run(const PagedDecodeParams& p, Stream stream) {
  LAMINAR_RETURN_IF_ERROR(can_implement(p, stream));
  if (stream.on_device) {
#if defined(LAMINAR_HAVE_CUDA)
    if (p.num_rows == 0) return ok_status();
    const std::int32_t rows = chunk_rows(p, kCudaWorkspaceBudget);
    DecodeArgs a = make_decode_args(p, static_cast<float*>(p.workspace), rows);
    for (std::int32_t begin = 0; begin < p.num_rows; begin += rows) {
      a.row_begin = begin;
      LAMINAR_RETURN_IF_ERROR(cuda_detail::launch_paged_decode(a, kind_of(p.kv.layout.dtype), p.kv.layout.head_dim,
                                                               std::min(rows, p.num_rows - begin), stream.handle));
    }
    return ok_status();
#else
    return unimplemented("paged_decode on a CUDA stream: laminar was built without CUDA (LAMINAR_CUDA=OFF)");
#endif
  }
  return run_host(p);
}

}  // namespace laminar::kernels
