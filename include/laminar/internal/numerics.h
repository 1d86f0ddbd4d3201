// numerics.h: scalar math shared bit-for-bit by the CPU kernels and the CUDA kernels.
//
// Every function here is plain C++ marked LAMINAR_HOST_DEVICE, so nvcc compiles the same source
// for the device and the host compiler for the CPU path; no CUDA intrinsics, so both produce the
// same bits. Conversions round to nearest, ties to even, and keep NaN a NaN.
//
// Arithmetic that must give the same bits everywhere goes through fma_rn / mul_rn / add_rn /
// div_rn: nvcc contracts a * b + c into one fma by default (and a host compiler may, under
// -ffp-contract=fast), which would change the rounding between the two builds. On the device these
// map to __fmaf_rn / __fmul_rn / __fadd_rn / __fdiv_rn, the IEEE round-to-nearest operations that
// nvcc never contracts; on the host to std::fma and plain operators (laminar builds ISO C++, where
// GCC does not contract). exp_f32 / log_f32 are our own so no libm or __expf difference leaks in.
#pragma once

#include <cmath>
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

LAMINAR_HOST_DEVICE float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

LAMINAR_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

LAMINAR_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

LAMINAR_HOST_DEVICE float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

LAMINAR_HOST_DEVICE float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

LAMINAR_HOST_DEVICE bool is_nan(float x) { return (f32_bits(x) & 0x7fffffffu) > 0x7f800000u; }

// Constants of exp_f32 / log_f32, public so the vectorised CPU versions (which must follow the same
// operation sequence lane by lane) use the very same values.
namespace exp_consts {
inline constexpr float kLo = -104.0f;  // exp(-104) < 2^-150: rounds to +0
inline constexpr float kHi = 89.0f;    // exp(89) > FLT_MAX: rounds to +inf
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
inline constexpr float kLn2Hi = 0.693359375f;      // ln 2 split Cody-Waite style: kLn2Hi has
inline constexpr float kLn2Lo = -2.12194440e-4f;   // few bits, so n * kLn2Hi is exact
// Minimax polynomial for (exp(r) - 1 - r) / r^2 on |r| <= ln2 / 2 (Cephes expf).
inline constexpr float kP0 = 5.0000001201e-1f;
inline constexpr float kP1 = 1.6666665459e-1f;
inline constexpr float kP2 = 4.1665795894e-2f;
inline constexpr float kP3 = 8.3334519073e-3f;
inline constexpr float kP4 = 1.3981999507e-3f;
inline constexpr float kP5 = 1.9875691500e-4f;
}  // namespace exp_consts

// e^x in float, the same bits on host and device. Max error 1.01 ulp of the exact value over
// (-104, 89), subnormal results included (an ulp there is 2^-149), measured over every 7th float by
// a sweep against double exp (tests/numerics_test.cc checks a sparser sweep against the same bound).
// exp(x <= -104) = +0, exp(x >= 89) = +inf, exp(-inf) = 0, NaN in gives the same NaN out.
// Method: x = n ln2 + r with |r| <= ln2/2, e^r by a degree-7 polynomial, then 2^n applied as two
// exact power-of-two factors so n from -150 to 129 needs no special case.
LAMINAR_HOST_DEVICE float exp_f32(float x) {
  using namespace exp_consts;
  if (is_nan(x)) return x;
  const float xc = x < kLo ? kLo : (x > kHi ? kHi : x);
  const float t = fma_rn(xc, kLog2e, kRoundMagic);
  const float kf = sub_rn(t, kRoundMagic);
  const auto n = static_cast<std::int32_t>(kf);
  float r = fma_rn(kf, -kLn2Hi, xc);
  r = fma_rn(kf, -kLn2Lo, r);
  float p = fma_rn(kP5, r, kP4);
  p = fma_rn(p, r, kP3);
  p = fma_rn(p, r, kP2);
  p = fma_rn(p, r, kP1);
  p = fma_rn(p, r, kP0);
  const float r2 = mul_rn(r, r);
  const float y = add_rn(fma_rn(p, r2, r), 1.0f);
  const std::int32_t n1 = n >> 1;  // arithmetic shift: floor(n / 2)
  const std::int32_t n2 = n - n1;
  const float s1 = f32_from_bits(std::uint32_t(n1 + 127) << 23);
  const float s2 = f32_from_bits(std::uint32_t(n2 + 127) << 23);
  return mul_rn(mul_rn(y, s1), s2);
}

namespace log_consts {
inline constexpr float kSqrtHalf = 0.707106781186547524f;
inline constexpr float kLn2Hi = 0.693359375f;
inline constexpr float kLn2Lo = -2.12194440e-4f;
inline constexpr float kTwo23 = 8388608.0f;  // scales a subnormal input into the normal range
// Minimax polynomial for (log(1 + f) - f + f^2 / 2) / f^3 on sqrt(1/2) - 1 <= f < sqrt(2) - 1
// (Cephes logf).
inline constexpr float kQ0 = 3.3333331174e-1f;
inline constexpr float kQ1 = -2.4999993993e-1f;
inline constexpr float kQ2 = 2.0000714765e-1f;
inline constexpr float kQ3 = -1.6668057665e-1f;
inline constexpr float kQ4 = 1.4249322787e-1f;
inline constexpr float kQ5 = -1.2420140846e-1f;
inline constexpr float kQ6 = 1.1676998740e-1f;
inline constexpr float kQ7 = -1.1514610310e-1f;
inline constexpr float kQ8 = 7.0376836292e-2f;
}  // namespace log_consts

// Natural log in float, the same bits on host and device. Max error 0.81 ulp of the exact value over
// all positive finite floats, subnormals included (same sweep as exp_f32).
// log(+0) = log(-0) = -inf, log(x < 0) = NaN, log(+inf) = +inf, NaN in gives the same NaN out.
// Method: x = 2^e * m with sqrt(1/2) <= m < sqrt(2), log(m) = f - f^2/2 + f^3 P(f) with f = m - 1
// (exact), plus e ln 2 split in two parts.
LAMINAR_HOST_DEVICE float log_f32(float x) {
  using namespace log_consts;
  if (is_nan(x)) return x;
  if (x < 0.0f) return f32_from_bits(0x7fc00000u);
  if (x == 0.0f) return f32_from_bits(0xff800000u);
  if (x == f32_from_bits(0x7f800000u)) return x;
  std::int32_t e_adj = 0;
  if (x < 1.17549435e-38f) {  // subnormal: exact scaling by 2^23
    x = mul_rn(x, kTwo23);
    e_adj = -23;
  }
  const std::uint32_t u = f32_bits(x);
  std::int32_t e = std::int32_t(u >> 23) - 127 + e_adj;
  float m = f32_from_bits((u & 0x007fffffu) | 0x3f800000u);  // [1, 2)
  if (m > 2.0f * kSqrtHalf) {
    m = mul_rn(m, 0.5f);
    ++e;
  }
  const float f = sub_rn(m, 1.0f);
  const float fe = static_cast<float>(e);
  const float z = mul_rn(f, f);
  float q = fma_rn(kQ8, f, kQ7);
  q = fma_rn(q, f, kQ6);
  q = fma_rn(q, f, kQ5);
  q = fma_rn(q, f, kQ4);
  q = fma_rn(q, f, kQ3);
  q = fma_rn(q, f, kQ2);
  q = fma_rn(q, f, kQ1);
  q = fma_rn(q, f, kQ0);
  float y = mul_rn(mul_rn(q, f), z);
  y = fma_rn(fe, kLn2Lo, y);
  y = fma_rn(-0.5f, z, y);
  const float r = add_rn(f, y);
  return fma_rn(fe, kLn2Hi, r);
}

}  // namespace laminar::internal
