// sampling.cuh: the CUDA sampling and token-log-prob kernels, one thread block per row.
//
// Each block follows the CPU path's steps with block-wide reductions in place of loops. The
// candidates (tokens within 28 of the maximum) are compacted, in token-id order, into shared
// memory when they fit (kCapacity); otherwise passes re-read the row from global memory and
// recompute the weights they need, until a top-k cut leaves a set that fits, which is then
// compacted the same way. Thresholds come from the same radix selection as on the CPU (four rounds
// of 256-bin histograms in shared memory); integer atomics make the bins exact, so the order in
// which threads add to them does not matter.
//
// Installed as <laminar/cuda/sampling.cuh>, for a host application's nvcc build to instantiate the
// kernels (sampling_kernel<LogitKind>, token_logprob_kernel<LogitKind>) or call the row arithmetic
// of sampling_row.cuh from kernels of its own. A launch takes kThreads threads and
// sizeof(SharedState) bytes of dynamic shared memory per row.
#pragma once

#include <cstdint>

#include "kernel_compat.cuh"
#include "sampling_row.cuh"

namespace laminar::kernels::sampling_detail {

inline constexpr int kThreads = 512;
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kCapacity = 2048;

// Dynamic shared memory of one block.
struct SharedState {
  std::uint64_t weight[kCapacity];  // temperature-scaled fixed-point weight of each candidate
  std::uint32_t key[kCapacity];
  std::int32_t id[kCapacity];
  std::uint64_t warp_u64[kWarps];
  std::uint32_t warp_u32[kWarps];
  unsigned long long hist[256];  // radix-selection bins (count or weight); the type atomicAdd takes
  std::int32_t found;
};

#if LAMINAR_KERNELS

__device__ __forceinline__ int popcount32(unsigned v) {
#if defined(__CUDA_ARCH__)
  return __popc(v);
#else
  return __builtin_popcount(v);
#endif
}

__device__ __forceinline__ int lowest_set_bit(unsigned v) {
#if defined(__CUDA_ARCH__)
  return __ffs(int(v)) - 1;
#else
  return __builtin_ctz(v);
#endif
}

// Adds `add` to bin `bucket` for every lane with `has`, one atomic per distinct bin in the warp:
// keys bunch into a few bins (the top byte is mostly the exponent), and lanes hitting one shared
// address would otherwise serialise.
__device__ __forceinline__ void warp_histogram_add(bool has, unsigned bucket, unsigned long long add,
                                                   unsigned long long* hist) {
  const int lane = int(threadIdx.x) % 32;
  unsigned pending = __ballot_sync(0xffffffffu, has);
  while (pending != 0) {
    const int leader = lowest_set_bit(pending);
    const unsigned leader_bucket = __shfl_sync(0xffffffffu, bucket, leader);
    const bool mine = has && bucket == leader_bucket;
    const unsigned same = __ballot_sync(0xffffffffu, mine);
    unsigned long long v = mine ? add : 0ull;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == leader) atomicAdd(&hist[leader_bucket], v);
    if (mine) has = false;
    pending &= ~same;
  }
}

__device__ __forceinline__ std::uint64_t block_sum(std::uint64_t v, SharedState& sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (lane == 0) sh.warp_u64[warp] = v;
  __syncthreads();
  std::uint64_t total = 0;
  for (int w = 0; w < kWarps; ++w) total += sh.warp_u64[w];
  __syncthreads();
  return total;
}

// kMax: the block's largest value, else its smallest.
template <bool kMax>
__device__ __forceinline__ std::uint32_t block_extreme(std::uint32_t v, SharedState& sh) {
  for (int o = 16; o > 0; o >>= 1) {
    const std::uint32_t other = __shfl_xor_sync(0xffffffffu, v, o);
    v = kMax ? (other > v ? other : v) : (other < v ? other : v);
  }
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (lane == 0) sh.warp_u32[warp] = v;
  __syncthreads();
  std::uint32_t r = sh.warp_u32[0];
  for (int w = 1; w < kWarps; ++w) r = kMax ? (sh.warp_u32[w] > r ? sh.warp_u32[w] : r) : (sh.warp_u32[w] < r ? sh.warp_u32[w] : r);
  __syncthreads();
  return r;
}

// Inclusive prefix sum over the block in thread order; *total gets the block's sum.
__device__ __forceinline__ std::uint64_t block_inclusive_scan(std::uint64_t v, SharedState& sh, std::uint64_t* total) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  for (int o = 1; o < 32; o <<= 1) {
    const std::uint64_t up = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += up;
  }
  if (lane == 31) sh.warp_u64[warp] = v;
  __syncthreads();
  std::uint64_t before = 0, sum = 0;
  for (int w = 0; w < kWarps; ++w) {
    before += w < warp ? sh.warp_u64[w] : 0;
    sum += sh.warp_u64[w];
  }
  __syncthreads();
  *total = sum;
  return before + v;
}

// The candidates of one row, either compacted in shared memory or read from the row.
template <LogitKind kKind>
struct Candidates {
  const void* row;
  std::int64_t vocab;
  float m;
  RowSettings r;
  bool in_shared;
  std::int64_t count;  // candidates in shared memory (in_shared)
  SharedState* sh;

  __device__ std::int64_t size() const { return in_shared ? count : vocab; }
  // Slot j's key, token id and d = x - max; false when the slot holds no candidate.
  __device__ bool at(std::int64_t j, std::uint32_t* key, std::int32_t* id, float* d) const {
    if (in_shared) {
      *key = sh->key[j];
      *id = sh->id[j];
      *d = internal::sub_rn(key_value(*key), m);
      return true;
    }
    const float x = load_logit<kKind>(row, j);
    *d = internal::sub_rn(x, m);
    if (!is_candidate(*d, r)) return false;
    *key = order_key(x);
    *id = static_cast<std::int32_t>(j);
    return true;
  }
  // Temperature-scaled weight of slot j, computed only when a pass needs it.
  __device__ std::uint64_t weight(std::int64_t j, float d) const {
    return in_shared ? sh->weight[j] : fixed_weight(scaled(d, r));
  }
};

// The largest key t >= floor_key such that the candidates with key >= t hold at least `need` (of
// count, or of weight when by_weight): radix selection, 8 bits a round from the top.
template <class Cands>
__device__ std::uint32_t select_threshold(const Cands& c, std::uint32_t floor_key, bool by_weight, std::uint64_t need,
                                          SharedState& sh) {
  std::uint32_t prefix = 0;
  std::uint64_t above = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = int(threadIdx.x); b < 256; b += kThreads) sh.hist[b] = 0;
    __syncthreads();
    const std::uint32_t high = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
    // Whole tiles, so every lane of a warp reaches the warp-wide histogram update.
    for (std::int64_t tile = 0; tile < c.size(); tile += kThreads) {
      const std::int64_t j = tile + threadIdx.x;
      std::uint32_t key = 0;
      std::int32_t id;
      float d;
      unsigned long long add = 0;
      if (j < c.size() && c.at(j, &key, &id, &d) && key >= floor_key && (key & high) == prefix) {
        add = by_weight ? c.weight(j, d) : 1ull;
      }
      warp_histogram_add(add != 0, (key >> shift) & 0xffu, add, sh.hist);
    }
    __syncthreads();
    int bucket = 255;
    for (; bucket > 0; --bucket) {
      if (above + sh.hist[bucket] >= need) break;
      above += sh.hist[bucket];
    }
    prefix |= std::uint32_t(bucket) << shift;
    __syncthreads();
  }
  return prefix;
}

// Stores the candidates with key >= floor_key in shared memory, in token-id order (warp ballots,
// then warp offsets through shared memory), as far as kCapacity allows, and returns how many there
// are. Adds each one's raw and temperature-scaled weights to this thread's partial sums.
template <LogitKind kKind>
__device__ std::int64_t compact_candidates(const void* row, std::int64_t vocab, float m, const RowSettings& r,
                                           std::uint32_t floor_key, SharedState& sh, std::uint64_t* z_raw_part,
                                           std::uint64_t* z_all_part) {
  std::int64_t base = 0;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  for (std::int64_t tile = 0; tile < vocab; tile += kThreads) {
    const std::int64_t i = tile + threadIdx.x;
    float x = 0, d = 0;
    bool cand = false;
    if (i < vocab) {
      x = load_logit<kKind>(row, i);
      d = internal::sub_rn(x, m);
      cand = is_candidate(d, r) && order_key(x) >= floor_key;
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, cand);
    if (lane == 0) sh.warp_u32[warp] = static_cast<std::uint32_t>(popcount32(ballot));
    __syncthreads();
    std::int64_t offset = base, tile_count = 0;
    for (int w = 0; w < kWarps; ++w) {
      offset += w < warp ? sh.warp_u32[w] : 0;
      tile_count += sh.warp_u32[w];
    }
    __syncthreads();
    if (cand) {
      const std::uint64_t q = r.greedy ? 0 : fixed_weight(scaled(d, r));
      *z_raw_part += (r.inv_t == 1.0f && !r.greedy) ? q : fixed_weight(d);
      *z_all_part += q;
      const std::int64_t slot = offset + popcount32(ballot & ((1u << lane) - 1u));
      if (slot < kCapacity) {
        sh.key[slot] = order_key(x);
        sh.weight[slot] = q;
        sh.id[slot] = static_cast<std::int32_t>(i);
      }
    }
    base += tile_count;
  }
  return base;
}

template <LogitKind kKind>
__global__ void __launch_bounds__(kThreads, 1) sampling_kernel(SamplingParams p, std::int64_t stride) {
  LAMINAR_DYNAMIC_SHARED(smem_raw);
  SharedState& sh = *reinterpret_cast<SharedState*>(smem_raw);
  const std::int64_t row_id = blockIdx.x;
  const void* row = static_cast<const unsigned char*>(p.logits) +
                    row_id * stride * static_cast<std::int64_t>(kKind == LogitKind::kF32 ? 4 : 2);
  const RowSettings r = row_settings(p, row_id);
  std::uint32_t lo = 0xffffffffu, hi = 0;
  for (std::int64_t i = threadIdx.x; i < p.vocab; i += kThreads) {
    const std::uint32_t k = order_key(load_logit<kKind>(row, i));
    lo = k < lo ? k : lo;
    hi = k > hi ? k : hi;
  }
  const std::uint32_t min_key = block_extreme<false>(lo, sh);
  const std::uint32_t max_key = block_extreme<true>(hi, sh);
  if (!r.valid || !has_distribution(min_key, max_key)) {
    if (threadIdx.x == 0) write_result(p, row_id, invalid_result());
    return;
  }
  const float m = row_max(max_key);
  std::uint64_t z_raw_part = 0, z_all_part = 0;
  const std::int64_t count = compact_candidates<kKind>(row, p.vocab, m, r, 0, sh, &z_raw_part, &z_all_part);
  const std::uint64_t z_raw = block_sum(z_raw_part, sh);
  const std::uint64_t z_all = block_sum(z_all_part, sh);
  Candidates<kKind> c{row, p.vocab, m, r, count <= kCapacity, count, &sh};
  if (r.greedy) {
    std::uint32_t first = 0xffffffffu;
    for (std::int64_t j = threadIdx.x; j < c.size(); j += kThreads) {
      std::uint32_t key;
      std::int32_t id;
      float d;
      if (c.at(j, &key, &id, &d) && key == max_key && std::uint32_t(id) < first) first = std::uint32_t(id);
    }
    const auto token = static_cast<std::int32_t>(block_extreme<false>(first, sh));
    if (threadIdx.x == 0) {
      const float xt = load_logit<kKind>(row, token);
      write_result(p, row_id, greedy_result(token, xt, m, z_raw));
    }
    return;
  }
  std::uint32_t threshold = 0;
  std::uint64_t z_k = z_all;
  if (r.top_k > 0 && r.top_k < count) {
    threshold = select_threshold(c, 0, false, std::uint64_t(r.top_k), sh);
    std::uint64_t part = 0;
    if (c.in_shared) {
      for (std::int64_t j = threadIdx.x; j < c.size(); j += kThreads) {
        part += sh.key[j] >= threshold ? sh.weight[j] : 0;
      }
      z_k = block_sum(part, sh);
    } else {
      // The candidates did not fit in shared memory; the top-k set usually does.
      std::uint64_t unused = 0;
      const std::int64_t top = compact_candidates<kKind>(row, p.vocab, m, r, threshold, sh, &unused, &part);
      z_k = block_sum(part, sh);
      if (top <= kCapacity) {
        c.in_shared = true;
        c.count = top;
      }
    }
  }
  if (r.top_p < 1.0f) threshold = select_threshold(c, threshold, true, top_p_target(r.top_p, z_k), sh);
  // Kept weight of slot j (0 outside the kept set), and its token id.
  auto kept_weight = [&](std::int64_t j, std::int32_t* id) -> std::uint64_t {
    std::uint32_t key;
    float d;
    if (j >= c.size() || !c.at(j, &key, id, &d)) return 0;
    const bool kept = key >= threshold && scaled(d, r) >= r.ln_min_p;
    return kept ? c.weight(j, d) : 0;
  };
  std::uint64_t part = 0;
  for (std::int64_t j = threadIdx.x; j < c.size(); j += kThreads) {
    std::int32_t id;
    part += kept_weight(j, &id);
  }
  const std::uint64_t z_kept = block_sum(part, sh);
  const std::uint64_t point = draw_point(r, z_kept);
  // Inverse CDF in token-id order, one tile of kThreads slots at a time.
  if (threadIdx.x == 0) sh.found = kInvalidToken;
  std::uint64_t before = 0;
  for (std::int64_t tile = 0; tile < c.size(); tile += kThreads) {
    std::int32_t id = 0;
    const std::uint64_t w = kept_weight(tile + threadIdx.x, &id);
    std::uint64_t tile_total = 0;
    const std::uint64_t incl = before + block_inclusive_scan(w, sh, &tile_total);
    if (w > 0 && incl > point && incl - w <= point) sh.found = id;
    before += tile_total;
    __syncthreads();
    if (sh.found != kInvalidToken) break;
  }
  if (threadIdx.x == 0) {
    const std::int32_t token = sh.found;
    write_result(p, row_id, sampled_result(token, load_logit<kKind>(row, token), m, r, z_raw, z_all, z_kept));
  }
}

template <LogitKind kKind>
__global__ void __launch_bounds__(kThreads, 1) token_logprob_kernel(TokenLogprobParams p, std::int64_t stride) {
  LAMINAR_DYNAMIC_SHARED(smem_raw);
  SharedState& sh = *reinterpret_cast<SharedState*>(smem_raw);
  const std::int64_t row_id = blockIdx.x;
  const void* row = static_cast<const unsigned char*>(p.logits) +
                    row_id * stride * static_cast<std::int64_t>(kKind == LogitKind::kF32 ? 4 : 2);
  std::uint32_t lo = 0xffffffffu, hi = 0;
  for (std::int64_t i = threadIdx.x; i < p.vocab; i += kThreads) {
    const std::uint32_t k = order_key(load_logit<kKind>(row, i));
    lo = k < lo ? k : lo;
    hi = k > hi ? k : hi;
  }
  const std::uint32_t min_key = block_extreme<false>(lo, sh);
  const std::uint32_t max_key = block_extreme<true>(hi, sh);
  const std::int32_t token = p.token[row_id];
  if (token < 0 || token >= p.vocab || !has_distribution(min_key, max_key)) {
    if (threadIdx.x == 0) p.logprob[row_id] = internal::f32_from_bits(0x7fc00000u);
    return;
  }
  const float m = row_max(max_key);
  std::uint64_t part = 0;
  for (std::int64_t i = threadIdx.x; i < p.vocab; i += kThreads) {
    part += fixed_weight(internal::sub_rn(load_logit<kKind>(row, i), m));
  }
  const std::uint64_t z_raw = block_sum(part, sh);
  if (threadIdx.x == 0) p.logprob[row_id] = raw_logprob(load_logit<kKind>(row, token), m, z_raw);
}

#endif  // LAMINAR_KERNELS

}  // namespace laminar::kernels::sampling_detail
