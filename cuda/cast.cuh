// cast.cuh: the element-wise cast kernel body, shared by nvcc builds of every architecture.
#pragma once

#include <cstdint>

#include "laminar/internal/numerics.h"

namespace laminar::kernels::cuda_detail {

enum class CastKind : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

template <CastKind kKind>
LAMINAR_HOST_DEVICE float load_f32(const void* p, std::int64_t i) {
  if constexpr (kKind == CastKind::kF32) return static_cast<const float*>(p)[i];
  if constexpr (kKind == CastKind::kF16) return internal::f16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
  if constexpr (kKind == CastKind::kBF16) return internal::bf16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
}

template <CastKind kKind>
LAMINAR_HOST_DEVICE void store_f32(void* p, std::int64_t i, float v) {
  if constexpr (kKind == CastKind::kF32) static_cast<float*>(p)[i] = v;
  if constexpr (kKind == CastKind::kF16) static_cast<std::uint16_t*>(p)[i] = internal::f32_to_f16(v);
  if constexpr (kKind == CastKind::kBF16) static_cast<std::uint16_t*>(p)[i] = internal::f32_to_bf16(v);
}

// Same-kind casts copy the bits, so NaN payloads survive a plain copy.
template <CastKind kSrc, CastKind kDst>
LAMINAR_HOST_DEVICE void cast_one(const void* src, void* dst, std::int64_t i) {
  if constexpr (kSrc == kDst && kSrc == CastKind::kF32) {
    static_cast<std::uint32_t*>(dst)[i] = static_cast<const std::uint32_t*>(src)[i];
  } else if constexpr (kSrc == kDst) {
    static_cast<std::uint16_t*>(dst)[i] = static_cast<const std::uint16_t*>(src)[i];
  } else {
    store_f32<kDst>(dst, i, load_f32<kSrc>(src, i));
  }
}

#if defined(__CUDACC__)
// Grid-stride loop: one launch covers any n with a grid sized to the device, not to n.
template <CastKind kSrc, CastKind kDst>
__global__ void __launch_bounds__(256) cast_kernel(const void* __restrict__ src, void* __restrict__ dst,
                                                   std::int64_t n) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    cast_one<kSrc, kDst>(src, dst, i);
  }
}
#endif

}  // namespace laminar::kernels::cuda_detail
