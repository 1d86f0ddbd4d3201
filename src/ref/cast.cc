#include "laminar/ref/cast.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace laminar::ref {

namespace {

// Half and bfloat16 decoded by their definition: (-1)^s * 2^(e - bias) * (1.m), subnormals 2^(1-bias) * 0.m.
double decode(std::uint16_t bits, int mant_bits, int exp_bits) {
  const int bias = (1 << (exp_bits - 1)) - 1;
  const bool neg = (bits >> 15) & 1;
  const int e = (bits >> mant_bits) & ((1 << exp_bits) - 1);
  const int m = bits & ((1 << mant_bits) - 1);
  double v;
  if (e == (1 << exp_bits) - 1) {
    v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (e == 0) {
    v = std::ldexp(double(m), 1 - bias - mant_bits);
  } else {
    v = std::ldexp(double(m + (1 << mant_bits)), e - bias - mant_bits);
  }
  return neg ? -v : v;
}

// Every finite non-negative value of the format, indexed by bit pattern; increasing in the pattern.
const std::vector<double>& finite_values(int mant_bits) {
  static const std::vector<double> f16 = [] {
    std::vector<double> v(0x7c00);
    for (std::size_t b = 0; b < v.size(); ++b) v[b] = decode(std::uint16_t(b), 10, 5);
    return v;
  }();
  static const std::vector<double> bf16 = [] {
    std::vector<double> v(0x7f80);
    for (std::size_t b = 0; b < v.size(); ++b) v[b] = decode(std::uint16_t(b), 7, 8);
    return v;
  }();
  return mant_bits == 10 ? f16 : bf16;
}

// The pattern whose value is nearest to x, ties to the even pattern; infinity once x is half an
// ulp or more past the largest finite value (the IEEE overflow rule).
std::uint16_t encode(double x, int mant_bits, int exp_bits) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const auto inf = std::uint16_t(((1 << exp_bits) - 1) << mant_bits);
  if (std::isnan(x)) return std::uint16_t(sign | inf | (1 << (mant_bits - 1)));
  const double a = std::fabs(x);
  const std::vector<double>& values = finite_values(mant_bits);
  const double max = values.back();
  const double half_ulp = (max - values[values.size() - 2]) / 2;
  if (a >= max + half_ulp) return std::uint16_t(sign | inf);
  auto hi = std::lower_bound(values.begin(), values.end(), a);
  if (hi == values.end()) return std::uint16_t(sign | (values.size() - 1));
  auto hi_bits = std::uint16_t(hi - values.begin());
  if (*hi == a || hi_bits == 0) return std::uint16_t(sign | hi_bits);
  const auto lo_bits = std::uint16_t(hi_bits - 1);
  const double d_lo = a - values[lo_bits], d_hi = *hi - a;
  const bool pick_hi = d_hi < d_lo || (d_hi == d_lo && (hi_bits & 1) == 0);
  return std::uint16_t(sign | (pick_hi ? hi_bits : lo_bits));
}

double load(const void* p, DType t, std::int64_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kF16: return decode(static_cast<const std::uint16_t*>(p)[i], 10, 5);
    case DType::kBF16: return decode(static_cast<const std::uint16_t*>(p)[i], 7, 8);
    default: return 0;
  }
}

void store(void* p, DType t, std::int64_t i, double v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::kF16: static_cast<std::uint16_t*>(p)[i] = encode(v, 10, 5); break;
    case DType::kBF16: static_cast<std::uint16_t*>(p)[i] = encode(v, 7, 8); break;
    default: break;
  }
}

}  // namespace

Status cast(const kernels::CastParams& p) {
  LAMINAR_RETURN_IF_ERROR(kernels::can_implement(p, Stream::host()));
  for (std::int64_t i = 0; i < p.n; ++i) {
    if (p.src_dtype == p.dst_dtype) {
      std::memcpy(static_cast<char*>(p.dst) + i * dtype_size(p.dst_dtype),
                  static_cast<const char*>(p.src) + i * dtype_size(p.src_dtype), dtype_size(p.src_dtype));
    } else {
      store(p.dst, p.dst_dtype, i, load(p.src, p.src_dtype, i));
    }
  }
  return ok_status();
}

}  // namespace laminar::ref
