// Accuracy and special values of the shared exp_f32 / log_f32 (internal/numerics.h), measured in
// ulps of the exact value computed in double.
#include "laminar/internal/numerics.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

using laminar::internal::exp_f32;
using laminar::internal::f32_bits;
using laminar::internal::f32_from_bits;
using laminar::internal::log_f32;

// |got - truth| in units of the float ulp at truth (2^-149 in the subnormal range).
double ulp_error(float got, double truth) {
  int e = 0;
  std::frexp(std::fabs(truth), &e);
  const double ulp = std::ldexp(1.0, std::max(e - 24, -149));
  return std::fabs(double(got) - truth) / ulp;
}

// Every 1021st float bit pattern (about 4.2 million inputs, all binades hit).
template <class F>
void sweep(F&& f) {
  for (std::uint64_t u = 0; u < (std::uint64_t(1) << 32); u += 1021) f(f32_from_bits(std::uint32_t(u)));
}

}  // namespace

TEST_CASE("numerics: exp_f32 is within its documented 1.01 ulp", "[numerics]") {
  double worst = 0;
  float worst_x = 0;
  sweep([&](float x) {
    if (!(x > -104.0f && x < 88.72f)) return;  // beyond 88.72 the true value overflows float
    const double err = ulp_error(exp_f32(x), std::exp(double(x)));
    if (err > worst) {
      worst = err;
      worst_x = x;
    }
  });
  INFO("worst input " << worst_x);
  CHECK(worst <= 1.01);
  CHECK(worst > 0.5);  // the sweep really measured something
}

TEST_CASE("numerics: log_f32 is within its documented 0.81 ulp", "[numerics]") {
  double worst = 0;
  float worst_x = 0;
  sweep([&](float x) {
    if (!(x > 0.0f) || std::isinf(x)) return;
    const double err = ulp_error(log_f32(x), std::log(double(x)));
    if (err > worst) {
      worst = err;
      worst_x = x;
    }
  });
  INFO("worst input " << worst_x);
  CHECK(worst <= 0.81);
  CHECK(worst > 0.5);
}

TEST_CASE("numerics: exp_f32 and log_f32 special values", "[numerics]") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = f32_from_bits(0x7fc01234u);
  CHECK(exp_f32(0.0f) == 1.0f);
  CHECK(exp_f32(-inf) == 0.0f);
  CHECK(exp_f32(-200.0f) == 0.0f);
  CHECK(exp_f32(inf) == inf);
  CHECK(exp_f32(100.0f) == inf);
  CHECK(f32_bits(exp_f32(nan)) == f32_bits(nan));
  CHECK(exp_f32(1.0f) == std::exp(1.0f));
  CHECK(log_f32(1.0f) == 0.0f);
  CHECK(log_f32(0.0f) == -inf);
  CHECK(log_f32(-0.0f) == -inf);
  CHECK(std::isnan(log_f32(-1.0f)));
  CHECK(log_f32(inf) == inf);
  CHECK(f32_bits(log_f32(nan)) == f32_bits(nan));
  const float denorm_min = std::numeric_limits<float>::denorm_min();
  CHECK(ulp_error(log_f32(denorm_min), std::log(double(denorm_min))) <= 0.81);
  // exp(log(x)) comes back within a few ulps across the range.
  for (float x : {1e-30f, 0.001f, 0.5f, 3.0f, 1e10f, 1e30f}) {
    CHECK(ulp_error(exp_f32(log_f32(x)), double(x)) < 64.0);
  }
}
