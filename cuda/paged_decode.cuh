// paged_decode.cuh: the paged decode / causal prefill attention kernels, and the scalar pieces of
// their arithmetic shared with the CPU kernel (src/kernels/paged_decode_cpu.cc).
//
// Compiled three ways: by nvcc (cuda/paged_decode_*.cu), by the host compiler inside tests through
// cuda/emulation (the same kernels run on the CPU), and by the library for the LAMINAR_HOST_DEVICE
// helpers only (LAMINAR_KERNELS = 0).
//
// Work decomposition. A "row" is one query position: row b of a decode batch, or one position of a
// prefill. Its KV length is the number of tokens it attends to. The KV of a row is cut into splits
// of kSplit tokens ([0, 256), [256, 512), ...; the last one shorter): a constant, so the cut depends
// on the row's own length only. The split kernel runs one block per (row, kv head, split) for all
// query heads of the group; the merge kernel one block per (row, query head).
//
// Reduction order (the CPU kernel follows it operation for operation; every + * fma below is one
// correctly rounded f32 operation, exp/log are numerics.h's exp_f32/log_f32):
//   1. score s_j = dot(q, k_j) * sm_scale, where dot over head_dim D uses 8 partial sums:
//      P[r] = fma(q[i], k_j[i], P[r]) for i = r, r + 8, r + 16, ... in increasing order, from +0;
//      then P[r] += P[r + 4] (r < 4), P[r] += P[r + 2] (r < 2), dot = P[0] + P[1].
//   2. per split: m = max_j s_j (exact, any order); p_j = exp(s_j - m);
//      l = (((0 + p_0) + p_1) + ...) in increasing j; o[d] = fma(p_j, v_j[d], o[d]) in increasing
//      j from +0.
//   3. per row and query head, over its S splits in increasing split order:
//      M = max_s m_s; w_s = exp(m_s - M); L = fma(l_s, w_s, L) and O[d] = fma(o_s[d], w_s, O[d])
//      from +0; out[d] = O[d] / L (rounded once more to the output dtype); lse = M + log(L).
//      A row of length 0 gives out = 0, lse = -inf.
// Nothing in it depends on other rows, on the batch, or on the number of threads.
//
// Installed as <laminar/cuda/paged_decode.cuh>: a host application's nvcc build can instantiate the
// kernels for its own dtype and head size (tests/consumer/kernels.cu does), as engines consume
// FlashInfer's headers:
//   template __global__ void laminar::kernels::cuda_detail::paged_decode_split_kernel<
//       laminar::kernels::cuda_detail::KvKind::kBF16, 128>(laminar::kernels::cuda_detail::DecodeArgs);
#pragma once

#include <cstdint>

#include "kernel_compat.cuh"
#include "laminar/internal/numerics.h"

namespace laminar::kernels::cuda_detail {

enum class KvKind : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

inline constexpr int kSplit = 256;          // = kernels::kSplitTokens (checked where both are seen)
inline constexpr int kDecodeThreads = 128;  // threads of a split block
inline constexpr int kMaxGroup = 8;         // query heads per KV head
inline constexpr int kWarp = 32;

template <KvKind K>
struct KvElem {
  using type = std::uint16_t;
};
template <>
struct KvElem<KvKind::kF32> {
  using type = float;
};
template <KvKind K>
using KvElemT = typename KvElem<K>::type;

template <KvKind K>
LAMINAR_HOST_DEVICE float to_f32(KvElemT<K> x) {
  if constexpr (K == KvKind::kF32) return x;
  if constexpr (K == KvKind::kF16) return internal::f16_to_f32(x);
  if constexpr (K == KvKind::kBF16) return internal::bf16_to_f32(x);
}

template <KvKind K>
LAMINAR_HOST_DEVICE KvElemT<K> from_f32(float x) {
  if constexpr (K == KvKind::kF32) return x;
  if constexpr (K == KvKind::kF16) return internal::f32_to_f16(x);
  if constexpr (K == KvKind::kBF16) return internal::f32_to_bf16(x);
}

// Eight consecutive elements (16-byte aligned for 16-bit types, 32-byte for f32) as floats.
template <KvKind K>
LAMINAR_HOST_DEVICE void load8(const KvElemT<K>* p, float (&x)[8]) {
#if defined(__CUDA_ARCH__)
  if constexpr (K == KvKind::kF32) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    x[0] = to_f32<K>(std::uint16_t(raw.x & 0xffffu)), x[1] = to_f32<K>(std::uint16_t(raw.x >> 16));
    x[2] = to_f32<K>(std::uint16_t(raw.y & 0xffffu)), x[3] = to_f32<K>(std::uint16_t(raw.y >> 16));
    x[4] = to_f32<K>(std::uint16_t(raw.z & 0xffffu)), x[5] = to_f32<K>(std::uint16_t(raw.z >> 16));
    x[6] = to_f32<K>(std::uint16_t(raw.w & 0xffffu)), x[7] = to_f32<K>(std::uint16_t(raw.w >> 16));
  }
#else
  for (int i = 0; i < 8; ++i) x[i] = to_f32<K>(p[i]);
#endif
}

// Step 1's fixed tree over the 8 partial sums.
LAMINAR_HOST_DEVICE float tree8(const float (&p)[8]) {
  using internal::add_rn;
  const float a0 = add_rn(p[0], p[4]), a1 = add_rn(p[1], p[5]), a2 = add_rn(p[2], p[6]), a3 = add_rn(p[3], p[7]);
  return add_rn(add_rn(a0, a2), add_rn(a1, a3));
}

LAMINAR_HOST_DEVICE float max_f32(float a, float b) { return a > b ? a : b; }

// Everything the kernels read, by value (the same struct on host and device).
struct DecodeArgs {
  const void* q;                     // [num_rows, num_qo_heads, D]
  void* out;                         // [num_rows, num_qo_heads, D]
  float* lse;                        // [num_rows, num_qo_heads] or null
  const void* k_pages;               // [num_pages, page_size, num_kv_heads, D]
  const void* v_pages;               // [num_pages, page_size, num_kv_heads, D]
  const std::int32_t* indptr;        // [batch + 1]
  const std::int32_t* indices;       // [indptr[batch]]
  const std::int32_t* last_page_len; // [batch]
  const std::int32_t* qo_indptr;     // [batch + 1] (prefill) or null (decode)
  // Split partials of the rows [row_begin, row_begin + chunk_rows) being processed (a long prefill
  // goes in chunks so the workspace stays bounded); indexed by row - row_begin.
  float* ws_o;                       // [chunk_rows, num_qo_heads, max_splits, D]
  float* ws_m;                       // [chunk_rows, num_qo_heads, max_splits]
  float* ws_l;                       // [chunk_rows, num_qo_heads, max_splits]
  std::int32_t batch;
  std::int32_t row_begin;
  std::int32_t num_qo_heads;
  std::int32_t num_kv_heads;
  std::int32_t page_size;
  std::int32_t max_splits;
  float sm_scale;
};

struct RowInfo {
  std::int32_t seq;
  std::int32_t kv_len;
};

LAMINAR_HOST_DEVICE std::int32_t seq_len(const std::int32_t* indptr, const std::int32_t* last_page_len,
                                         std::int32_t page_size, std::int32_t b) {
  const std::int32_t pages = indptr[b + 1] - indptr[b];
  return pages == 0 ? 0 : (pages - 1) * page_size + last_page_len[b];
}

// The sequence a row belongs to and how many tokens it attends to.
LAMINAR_HOST_DEVICE RowInfo row_info(const std::int32_t* indptr, const std::int32_t* last_page_len,
                                     const std::int32_t* qo_indptr, std::int32_t batch, std::int32_t page_size,
                                     std::int32_t row) {
  if (qo_indptr == nullptr) return {row, seq_len(indptr, last_page_len, page_size, row)};
  std::int32_t lo = 0, hi = batch;  // qo_indptr[lo] <= row < qo_indptr[hi]
  while (hi - lo > 1) {
    const std::int32_t mid = lo + (hi - lo) / 2;
    if (qo_indptr[mid] <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const std::int32_t len = seq_len(indptr, last_page_len, page_size, lo);
  const std::int32_t n = qo_indptr[lo + 1] - qo_indptr[lo];
  return {lo, len - n + (row - qo_indptr[lo]) + 1};
}

LAMINAR_HOST_DEVICE std::int32_t num_splits(std::int32_t kv_len) { return (kv_len + kSplit - 1) / kSplit; }

// Dynamic shared memory of a split block: q [group, D], scores/probabilities [group, kSplit], max [group].
LAMINAR_HOST_DEVICE std::size_t split_smem_bytes(int group, int head_dim) {
  return sizeof(float) * std::size_t(group * head_dim + group * kSplit + kMaxGroup);
}

#if LAMINAR_KERNELS

// One block per (chunk row, kv head) in blockIdx.x and split in blockIdx.y; kDecodeThreads threads.
template <KvKind K, int D>
__global__ void __launch_bounds__(kDecodeThreads) paged_decode_split_kernel(DecodeArgs a) {
  using internal::add_rn;
  using internal::fma_rn;
  using internal::mul_rn;
  using internal::sub_rn;
  using Elem = KvElemT<K>;
  static_assert(D % 8 == 0 && kDecodeThreads % D == 0, "head_dim must divide the block");
  const int local_row = int(blockIdx.x) / a.num_kv_heads;
  const int row = a.row_begin + local_row;
  const int h = int(blockIdx.x) % a.num_kv_heads;
  const int split = int(blockIdx.y);
  const RowInfo r = row_info(a.indptr, a.last_page_len, a.qo_indptr, a.batch, a.page_size, row);
  const int start = split * kSplit;
  if (start >= r.kv_len) return;  // the whole block leaves together
  const int n = r.kv_len - start < kSplit ? r.kv_len - start : kSplit;
  const int group = a.num_qo_heads / a.num_kv_heads;
  const int tid = int(threadIdx.x);

  LAMINAR_DYNAMIC_SHARED(smem);
  float* q_s = reinterpret_cast<float*>(smem);  // [group, D]
  float* p_s = q_s + group * D;                 // [group, kSplit]
  float* m_s = p_s + group * kSplit;            // [group]

  const Elem* q = static_cast<const Elem*>(a.q) + (std::int64_t(row) * a.num_qo_heads + std::int64_t(h) * group) * D;
  for (int i = tid; i < group * D; i += kDecodeThreads) q_s[i] = to_f32<K>(q[i]);
  __syncthreads();

  const std::int64_t token_stride = std::int64_t(a.num_kv_heads) * D;
  const std::int32_t* pages = a.indices + a.indptr[r.seq];
  const Elem* k_pool = static_cast<const Elem*>(a.k_pages);
  const Elem* v_pool = static_cast<const Elem*>(a.v_pages);
  for (int j = tid; j < n; j += kDecodeThreads) {
    const int t = start + j;
    const Elem* k = k_pool + (std::int64_t(pages[t / a.page_size]) * a.page_size + t % a.page_size) * token_stride +
                    std::int64_t(h) * D;
    for (int g = 0; g < group; ++g) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      LAMINAR_NO_UNROLL  // unrolling this loop makes ptxas spill on sm_80
      for (int i = 0; i < D; i += 8) {
        float kv[8];
        load8<K>(k + i, kv);
        LAMINAR_UNROLL
        for (int c = 0; c < 8; ++c) acc[c] = fma_rn(q_s[g * D + i + c], kv[c], acc[c]);
      }
      p_s[g * kSplit + j] = mul_rn(tree8(acc), a.sm_scale);
    }
  }
  __syncthreads();

  const int warp = tid / kWarp, lane = tid % kWarp;
  for (int g = warp; g < group; g += kDecodeThreads / kWarp) {
    float m = p_s[g * kSplit];
    for (int j = lane; j < n; j += kWarp) m = max_f32(m, p_s[g * kSplit + j]);
    for (int off = kWarp / 2; off > 0; off /= 2) m = max_f32(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (lane == 0) m_s[g] = m;
  }
  __syncthreads();

  for (int i = tid; i < group * kSplit; i += kDecodeThreads) {
    if (i % kSplit < n) p_s[i] = internal::exp_f32(sub_rn(p_s[i], m_s[i / kSplit]));
  }
  __syncthreads();

  const std::int64_t ws_row = (std::int64_t(local_row) * a.num_qo_heads + std::int64_t(h) * group) * a.max_splits + split;
  if (tid < group) {
    float l = 0.0f;
    for (int j = 0; j < n; ++j) l = add_rn(l, p_s[tid * kSplit + j]);
    a.ws_l[ws_row + std::int64_t(tid) * a.max_splits] = l;
    a.ws_m[ws_row + std::int64_t(tid) * a.max_splits] = m_s[tid];
  }
  constexpr int kHeadsPerPass = kDecodeThreads / D;
  constexpr int kAcc = kMaxGroup / kHeadsPerPass;
  const int d = tid % D, g0 = tid / D;
  float acc[kAcc];
  LAMINAR_UNROLL
  for (int c = 0; c < kAcc; ++c) acc[c] = 0.0f;
  for (int j = 0; j < n; ++j) {
    const int t = start + j;
    const float vd = to_f32<K>(v_pool[(std::int64_t(pages[t / a.page_size]) * a.page_size + t % a.page_size) *
                                          token_stride +
                                      std::int64_t(h) * D + d]);
    LAMINAR_UNROLL
    for (int c = 0; c < kAcc; ++c) {
      const int g = g0 + c * kHeadsPerPass;
      if (g < group) acc[c] = fma_rn(p_s[g * kSplit + j], vd, acc[c]);
    }
  }
  LAMINAR_UNROLL
  for (int c = 0; c < kAcc; ++c) {
    const int g = g0 + c * kHeadsPerPass;
    if (g < group) a.ws_o[(ws_row + std::int64_t(g) * a.max_splits) * D + d] = acc[c];
  }
}

// One block of D threads per (chunk row, query head) in blockIdx.x.
template <KvKind K, int D>
__global__ void __launch_bounds__(D) paged_decode_merge_kernel(DecodeArgs a) {
  using internal::fma_rn;
  using internal::sub_rn;
  const int local_row = int(blockIdx.x) / a.num_qo_heads;
  const int row = a.row_begin + local_row;
  const int hq = int(blockIdx.x) % a.num_qo_heads;
  const int d = int(threadIdx.x);
  const RowInfo r = row_info(a.indptr, a.last_page_len, a.qo_indptr, a.batch, a.page_size, row);
  const std::int64_t out_row = std::int64_t(row) * a.num_qo_heads + hq;
  KvElemT<K>* out = static_cast<KvElemT<K>*>(a.out) + out_row * D;
  const int splits = num_splits(r.kv_len);
  if (splits == 0) {
    out[d] = from_f32<K>(0.0f);
    if (d == 0 && a.lse != nullptr) a.lse[out_row] = internal::f32_from_bits(0xff800000u);
    return;
  }
  const std::int64_t base = (std::int64_t(local_row) * a.num_qo_heads + hq) * a.max_splits;
  float m = a.ws_m[base];
  for (int s = 1; s < splits; ++s) m = max_f32(m, a.ws_m[base + s]);
  float l = 0.0f, o = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float w = internal::exp_f32(sub_rn(a.ws_m[base + s], m));
    l = fma_rn(a.ws_l[base + s], w, l);
    o = fma_rn(a.ws_o[(base + s) * D + d], w, o);
  }
  out[d] = from_f32<K>(internal::div_rn(o, l));
  if (d == 0 && a.lse != nullptr) a.lse[out_row] = internal::add_rn(m, internal::log_f32(l));
}

#endif  // LAMINAR_KERNELS

}  // namespace laminar::kernels::cuda_detail
