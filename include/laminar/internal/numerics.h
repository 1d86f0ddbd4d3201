// numerics.h: scalar math shared bit-for-bit by the CPU kernels and the CUDA kernels.
//
// Every function here is plain C++ marked LAMINAR_HOST_DEVICE, so nvcc compiles the same source
// for the device and the host compiler for the CPU path; no CUDA intrinsics, so both produce the
// same bits. Conversions round to nearest, ties to even, and keep NaN a NaN.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define LAMINAR_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LAMINAR_HOST_DEVICE inline
#endif

namespace laminar::internal {

LAMINAR_HOST_DEVICE std::uint32_t f32_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

LAMINAR_HOST_DEVICE float f32_from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

LAMINAR_HOST_DEVICE float bf16_to_f32(std::uint16_t h) { return f32_from_bits(std::uint32_t(h) << 16); }

LAMINAR_HOST_DEVICE std::uint16_t f32_to_bf16(float f) {
  const std::uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return std::uint16_t((u >> 16) | 0x40u);  // quiet NaN
  const std::uint32_t lsb = (u >> 16) & 1u;
  return std::uint16_t((u + 0x7fffu + lsb) >> 16);
}

LAMINAR_HOST_DEVICE float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return f32_from_bits(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp != 0) return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return f32_from_bits(sign);
  // Subnormal half: normalise into a float.
  std::uint32_t e = 113;
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return f32_from_bits(sign | (e << 23) | ((mant & 0x3ffu) << 13));
}

LAMINAR_HOST_DEVICE std::uint16_t f32_to_f16(float f) {
  const std::uint32_t u = f32_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return std::uint16_t(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // NaN
  if (abs >= 0x477ff000u) return std::uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (abs >= 0x38800000u) {  // normal half
    const std::uint32_t lsb = (abs >> 13) & 1u;
    return std::uint16_t(sign | ((abs - 0x38000000u + 0xfffu + lsb) >> 13));
  }
  if (abs < 0x33000000u) return std::uint16_t(sign);  // below half the smallest subnormal: zero
  // Subnormal half: shift the full mantissa right, rounding to nearest even.
  const std::uint32_t exp = abs >> 23;
  const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
  const std::uint32_t shift = 126u - exp;  // 14..24
  const std::uint32_t half = 1u << (shift - 1);
  const std::uint32_t rem = mant & ((1u << shift) - 1u);
  std::uint32_t q = mant >> shift;
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return std::uint16_t(sign | q);
}

}  // namespace laminar::internal
