#include "laminar/kernels/paged_decode.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include "paged_decode_args.h"
#include "paged_decode_cpu.h"
#include "tensor_args.h"

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

namespace {

// The checks of can_implement that do not depend on where the kernel runs.
Status check_params(const PagedDecodeParams& p) {
  const KvLayout& l = p.kv.layout;
  LAMINAR_RETURN_IF_ERROR(validate(l).with_context("paged_decode"));
  // The pointers address one layer; a multi-layer layout means the caller passed the whole cache.
  if (l.num_layers != 1) {
    return invalid_argument(
        fmt::format("paged_decode: kv.layout.num_layers is {}, not 1 (pass PagedKvCache::view(layer))", l.num_layers));
  }
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
  if (p.cpu_threads < 0) {
    return invalid_argument(fmt::format("paged_decode: cpu_threads is negative ({})", p.cpu_threads));
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
  return ok_status();
}

Status check_device_table(const PagedDecodeParams& p) {
  if (p.table.indptr == nullptr || (p.table.batch > 0 && p.table.last_page_len == nullptr)) {
    return invalid_argument("paged_decode: null page table");
  }
  return ok_status();
}

Status check_workspace(const PagedDecodeParams& p) {
  if (p.num_rows > 0 && (p.workspace == nullptr || p.workspace_bytes < workspace_bytes(p))) {
    return invalid_argument(
        fmt::format("paged_decode: workspace of {} bytes, {} needed", p.workspace_bytes, workspace_bytes(p)));
  }
  return ok_status();
}

}  // namespace

Status can_implement(const PagedDecodeParams& p, Stream stream) {
  LAMINAR_RETURN_IF_ERROR(check_params(p));
  if (stream.on_device) {
    LAMINAR_RETURN_IF_ERROR(check_workspace(p));
    return check_device_table(p);
  }
  return check_host_table(p);
}

Result<PagedDecodeParams> PagedDecodeParams::from_tensors(const PagedDecodeTensors& t,
                                                         PagedDecodeIndexCopies* index_copies) {
  namespace ta = tensor_args;
  constexpr const char* k = "paged_decode";
  ta::Placement where(k);
  LAMINAR_RETURN_IF_ERROR(where.add("q", t.q));
  LAMINAR_RETURN_IF_ERROR(where.add("out", t.out));
  LAMINAR_RETURN_IF_ERROR(where.add("lse", t.lse));
  LAMINAR_RETURN_IF_ERROR(where.add("k_pages", t.k_pages));
  LAMINAR_RETURN_IF_ERROR(where.add("v_pages", t.v_pages));
  LAMINAR_RETURN_IF_ERROR(where.add("indptr", t.indptr));
  LAMINAR_RETURN_IF_ERROR(where.add("indices", t.indices));
  LAMINAR_RETURN_IF_ERROR(where.add("last_page_len", t.last_page_len));
  LAMINAR_RETURN_IF_ERROR(where.add("qo_indptr", t.qo_indptr));
  LAMINAR_RETURN_IF_ERROR(where.add("workspace", t.workspace));
  const bool on_device = where.on_device();

  // The pools fix the layout; every other tensor is checked against them.
  LAMINAR_RETURN_IF_ERROR(
      ta::expect_ndim(k, "k_pages", t.k_pages, 4, "[num_pages, page_size, num_kv_heads, head_dim]"));
  LAMINAR_RETURN_IF_ERROR(ta::expect_like(k, "v_pages", t.v_pages, "k_pages", t.k_pages));
  LAMINAR_RETURN_IF_ERROR(ta::expect_dense(k, "k_pages", t.k_pages));
  LAMINAR_RETURN_IF_ERROR(ta::expect_dense(k, "v_pages", t.v_pages));
  for (int i = 0; i < 4; ++i) {
    if (t.k_pages.dim(i) > std::numeric_limits<std::int32_t>::max()) {
      return ta::mismatch(k, "k_pages", fmt::format("dim {} = {} does not fit int32", i, t.k_pages.dim(i)));
    }
  }
  PagedDecodeParams p;
  p.kv.k_pages = t.k_pages.data();
  p.kv.v_pages = t.v_pages.data();
  p.kv.layout = {std::int32_t(t.k_pages.dim(0)), std::int32_t(t.k_pages.dim(1)), std::int32_t(t.k_pages.dim(2)),
                 std::int32_t(t.k_pages.dim(3)), t.k_pages.dtype()};
  LAMINAR_RETURN_IF_ERROR(validate(p.kv.layout).with_context("paged_decode: k_pages"));

  LAMINAR_RETURN_IF_ERROR(ta::expect_ndim(k, "q", t.q, 3, "[num_rows, num_qo_heads, head_dim]"));
  LAMINAR_RETURN_IF_ERROR(ta::expect_dim(k, "q", t.q, 2, t.k_pages.dim(3), "k_pages"));
  LAMINAR_RETURN_IF_ERROR(ta::expect_dtype(k, "q", t.q, t.k_pages.dtype()));
  LAMINAR_RETURN_IF_ERROR(ta::expect_dense(k, "q", t.q));
  LAMINAR_RETURN_IF_ERROR(ta::expect_like(k, "out", t.out, "q", t.q));
  LAMINAR_RETURN_IF_ERROR(ta::expect_dense(k, "out", t.out));
  if (t.q.dim(0) > std::numeric_limits<std::int32_t>::max() || t.q.dim(1) > std::numeric_limits<std::int32_t>::max()) {
    return ta::mismatch(k, "q", fmt::format("shape {} does not fit int32 counts", ta::shape_string(t.q.shape())));
  }
  p.q = t.q.data();
  p.out = t.out.data();
  p.num_rows = std::int32_t(t.q.dim(0));
  p.num_qo_heads = std::int32_t(t.q.dim(1));
  if (t.lse) {
    LAMINAR_RETURN_IF_ERROR(ta::expect_ndim(k, "lse", *t.lse, 2, "[num_rows, num_qo_heads]"));
    LAMINAR_RETURN_IF_ERROR(ta::expect_dim(k, "lse", *t.lse, 0, t.q.dim(0), "q"));
    LAMINAR_RETURN_IF_ERROR(ta::expect_dim(k, "lse", *t.lse, 1, t.q.dim(1), "q"));
    LAMINAR_RETURN_IF_ERROR(ta::expect_dtype(k, "lse", *t.lse, DType::kF32));
    LAMINAR_RETURN_IF_ERROR(ta::expect_dense(k, "lse", *t.lse));
    p.lse = t.lse->data_as<float>();
  }

  // The page table: batch from last_page_len, the rest sized by it.
  LAMINAR_RETURN_IF_ERROR(ta::expect_ndim(k, "last_page_len", t.last_page_len, 1, "[batch]"));
  const std::int64_t batch = t.last_page_len.dim(0);
  if (batch >= std::numeric_limits<std::int32_t>::max()) {
    return ta::mismatch(k, "last_page_len", fmt::format("batch {} does not fit int32", batch));
  }
  // A 1-D index tensor, of length batch + 1 where `batch_plus_one` says so.
  const auto index_vector = [&](const char* name, const TensorView& v, bool batch_plus_one,
                                std::vector<std::int32_t>* copy) -> Result<const std::int32_t*> {
    LAMINAR_RETURN_IF_ERROR(ta::expect_ndim(k, name, v, 1, "a 1-D index tensor"));
    if (batch_plus_one) LAMINAR_RETURN_IF_ERROR(ta::expect_dim(k, name, v, 0, batch + 1, "last_page_len (batch + 1)"));
    LAMINAR_RETURN_IF_ERROR(ta::expect_dense(k, name, v));
    return ta::int32_indices(k, name, v, on_device, copy);
  };
  const auto copy_of = [&](std::vector<std::int32_t> PagedDecodeIndexCopies::*member) {
    return index_copies != nullptr ? &(index_copies->*member) : nullptr;
  };
  p.table.batch = std::int32_t(batch);
  LAMINAR_ASSIGN_OR_RETURN(p.table.last_page_len, index_vector("last_page_len", t.last_page_len, false,
                                                               copy_of(&PagedDecodeIndexCopies::last_page_len)));
  LAMINAR_ASSIGN_OR_RETURN(p.table.indptr, index_vector("indptr", t.indptr, true,
                                                        copy_of(&PagedDecodeIndexCopies::indptr)));
  LAMINAR_ASSIGN_OR_RETURN(p.table.indices,
                           index_vector("indices", t.indices, false, copy_of(&PagedDecodeIndexCopies::indices)));
  if (t.qo_indptr) {
    LAMINAR_ASSIGN_OR_RETURN(p.qo_indptr,
                             index_vector("qo_indptr", *t.qo_indptr, true, copy_of(&PagedDecodeIndexCopies::qo_indptr)));
  } else if (t.q.dim(0) != batch) {
    return ta::mismatch(k, "q", fmt::format("{} rows but last_page_len holds {} sequences (decode: one row each; "
                                            "prefill needs qo_indptr)", t.q.dim(0), batch));
  }
  if (!on_device && p.table.indptr[batch] > t.indices.dim(0)) {
    return ta::mismatch(k, "indices", fmt::format("{} entries but indptr[{}] = {}", t.indices.dim(0), batch,
                                                  p.table.indptr[batch]));
  }

  p.sm_scale = t.sm_scale.value_or(1.0f / std::sqrt(float(p.kv.layout.head_dim)));
  if (t.max_kv_len) {
    p.max_kv_len = *t.max_kv_len;
  } else if (!on_device) {
    LAMINAR_RETURN_IF_ERROR(validate(p.table, p.kv.layout).with_context("paged_decode"));
    for (std::int32_t b = 0; b < p.table.batch; ++b) {
      const std::int64_t len = sequence_length(p.table, b, p.kv.layout.page_size);
      // A length beyond int32 is clamped, so can_implement names the sequence that exceeds it.
      p.max_kv_len = std::int32_t(std::min<std::int64_t>(std::max<std::int64_t>(p.max_kv_len, len),
                                                         std::numeric_limits<std::int32_t>::max()));
    }
  } else if (p.num_rows > 0) {
    return invalid_argument("paged_decode: max_kv_len must be given for tensors on a CUDA device (the page table is in "
                            "device memory)");
  }
  if (t.workspace) {
    LAMINAR_RETURN_IF_ERROR(ta::expect_dense(k, "workspace", *t.workspace));
    p.workspace = t.workspace->data();
    p.workspace_bytes = t.workspace->nbytes();
  }
  LAMINAR_RETURN_IF_ERROR(check_params(p));
  if (!on_device) LAMINAR_RETURN_IF_ERROR(check_host_table(p));
  // On a device the workspace may come later: its size is workspace_bytes() of these params.
  if (on_device && t.workspace) LAMINAR_RETURN_IF_ERROR(check_workspace(p));
  return p;
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
