// kv_page_checksum.cuh: a 64-bit checksum of KV cache pages where they lie, in device memory, which
// both sides of a device-pool KV migration compute over their own copy of each page (the source
// before it sends, the destination once it received) and compare. Built by nvcc (kv_page_checksum.cu)
// and, for tests, by the host compiler under cuda/emulation.
//
// The checksum of one page covers every layer of both pools: segments s = 0 .. 2L-1, K layers
// 0..L-1 then V layers 0..L-1, each the page's page_bytes in that layer. A segment is read as
// W = ceil(page_bytes / 4) little-endian u32 words, the last one zero-padded; word j of segment s
// has the index i = s * W + j. Then
//   checksum = mix64(sum over i of mix64(mix64(i) ^ word_i)  (mod 2^64)  ^  2L * W)
// with mix64 the splitmix64 finaliser. A sum of mixed terms is the same in any order, so the
// threads of a block add their words in whatever order they run. It is not xxh3 and need not be:
// only the two sides' results are compared.
#pragma once

#include <cstdint>

#include "kernel_compat.cuh"
#include "laminar/internal/numerics.h"

namespace laminar::kernels::cuda_detail {

struct KvChecksumParams {
  const void* k_pool = nullptr;  // [num_layers, num_pages, page_bytes] bytes
  const void* v_pool = nullptr;
  std::int64_t num_pages = 0;   // pages of one layer in the pools
  std::int64_t page_bytes = 0;  // > 0
  std::int32_t num_layers = 0;  // > 0
  const std::int32_t* pages = nullptr;  // [count] page ids, in [0, num_pages)
  std::int64_t count = 0;
  std::uint64_t* out = nullptr;  // [count]
};

inline constexpr int kChecksumThreads = 256;

// One partial sum per warp of a block.
struct ChecksumShared {
  std::uint64_t partial[kChecksumThreads / 32];
};

LAMINAR_HOST_DEVICE std::uint64_t checksum_mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Word j of a segment of n bytes at p.
LAMINAR_HOST_DEVICE std::uint32_t checksum_word(const unsigned char* p, std::int64_t n, std::int64_t j) {
  if (n % 4 == 0) return reinterpret_cast<const std::uint32_t*>(p)[j];
  std::uint32_t w = 0;
  for (int b = 0; b < 4; ++b) {
    const std::int64_t at = 4 * j + b;
    if (at < n) w |= std::uint32_t(p[at]) << (8 * b);
  }
  return w;
}

#if LAMINAR_KERNELS
// One block per page (grid-stride over pages); the block's threads split the page's words and add
// their terms through warp shuffles and one shared slot per warp.
__global__ void __launch_bounds__(kChecksumThreads) kv_page_checksum_kernel(KvChecksumParams p) {
  LAMINAR_SHARED(ChecksumShared, sh);
  const std::int64_t words = (p.page_bytes + 3) / 4;
  const std::int64_t total = 2 * std::int64_t(p.num_layers) * words;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  for (std::int64_t k = blockIdx.x; k < p.count; k += gridDim.x) {
    const std::int64_t page = p.pages[k];
    std::uint64_t sum = 0;
    for (std::int64_t i = threadIdx.x; i < total; i += blockDim.x) {
      const std::int64_t seg = i / words, j = i % words;
      const void* pool = seg < p.num_layers ? p.k_pool : p.v_pool;
      const std::int64_t layer = seg % p.num_layers;
      const auto* base =
          static_cast<const unsigned char*>(pool) + (layer * p.num_pages + page) * p.page_bytes;
      sum += checksum_mix64(checksum_mix64(std::uint64_t(i)) ^ checksum_word(base, p.page_bytes, j));
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, o);
    if (lane == 0) sh.partial[warp] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
      std::uint64_t all = 0;
      for (int w = 0; w < int(blockDim.x) / 32; ++w) all += sh.partial[w];
      p.out[k] = checksum_mix64(all ^ std::uint64_t(total));
    }
    // sh is reused by the next page.
    __syncthreads();
  }
}
#endif

}  // namespace laminar::kernels::cuda_detail
