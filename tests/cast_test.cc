#include "laminar/kernels/cast.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "laminar/internal/numerics.h"
#include "laminar/ref/cast.h"

using laminar::DType;
using laminar::kernels::CastParams;

namespace {

// Random bit patterns cover every class: normals, subnormals, zeros, infinities and NaNs; plus the
// values where rounding is decided (exact ties and the overflow threshold).
std::vector<std::uint32_t> test_f32_bits(std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::uint32_t> v = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                                  0x7f800001u, 0x3f808000u, 0x3f818000u, 0x477ff000u, 0x477fefffu,
                                  0x38800000u, 0x33000000u, 0x33000001u, 0x387fc000u, 0x00000001u,
                                  0x7f7fffffu, 0x7f7f8000u};
  for (int i = 0; i < 1500; ++i) v.push_back(rng());
  // Values in f16's range, where most interesting rounding happens.
  std::uniform_real_distribution<float> mag(-70000.f, 70000.f);
  for (int i = 0; i < 500; ++i) v.push_back(laminar::internal::f32_bits(mag(rng)));
  return v;
}

bool same(std::uint32_t a, std::uint32_t b, DType t) {
  if (t == DType::kF32) {
    const float fa = laminar::internal::f32_from_bits(a), fb = laminar::internal::f32_from_bits(b);
    return (std::isnan(fa) && std::isnan(fb)) || a == b;
  }
  const bool nan_a = (t == DType::kF16) ? ((a & 0x7c00u) == 0x7c00u && (a & 0x3ffu)) : ((a & 0x7f80u) == 0x7f80u && (a & 0x7fu));
  const bool nan_b = (t == DType::kF16) ? ((b & 0x7c00u) == 0x7c00u && (b & 0x3ffu)) : ((b & 0x7f80u) == 0x7f80u && (b & 0x7fu));
  // NaN payloads differ between implementations by design; NaN-ness may not.
  return (nan_a && nan_b) || a == b;
}

std::uint32_t read(const std::vector<std::uint8_t>& buf, DType t, std::size_t i) {
  if (t == DType::kF32) {
    std::uint32_t u;
    std::memcpy(&u, buf.data() + 4 * i, 4);
    return u;
  }
  std::uint16_t h;
  std::memcpy(&h, buf.data() + 2 * i, 2);
  return h;
}

}  // namespace

TEST_CASE("cast matches the reference bit for bit", "[cast]") {
  const std::uint32_t seed = 1234;
  INFO("seed " << seed);
  const auto bits = test_f32_bits(seed);
  const DType floats[] = {DType::kF32, DType::kF16, DType::kBF16};
  for (DType src_t : floats) {
    // Source values: the f32 patterns narrowed to src_t by the reference, so every src dtype sees
    // its own specials.
    std::vector<std::uint8_t> src(bits.size() * laminar::dtype_size(src_t));
    CastParams narrow{bits.data(), src.data(), std::int64_t(bits.size()), DType::kF32, src_t};
    REQUIRE(laminar::ref::cast(narrow).ok());
    for (DType dst_t : floats) {
      DYNAMIC_SECTION(laminar::dtype_name(src_t) << " -> " << laminar::dtype_name(dst_t)) {
        std::vector<std::uint8_t> fast(bits.size() * laminar::dtype_size(dst_t));
        std::vector<std::uint8_t> slow(fast.size());
        CastParams p{src.data(), fast.data(), std::int64_t(bits.size()), src_t, dst_t};
        REQUIRE(laminar::kernels::run(p, laminar::Stream::host()).ok());
        p.dst = slow.data();
        REQUIRE(laminar::ref::cast(p).ok());
        for (std::size_t i = 0; i < bits.size(); ++i) {
          INFO("element " << i << " src bits " << std::hex << read(src, src_t, i));
          REQUIRE(same(read(fast, dst_t, i), read(slow, dst_t, i), dst_t));
        }
      }
    }
  }
}

TEST_CASE("cast rounds to nearest even at known points", "[cast]") {
  using namespace laminar::internal;
  CHECK(f32_to_bf16(f32_from_bits(0x3f808000u)) == 0x3f80);  // tie, even stays
  CHECK(f32_to_bf16(f32_from_bits(0x3f818000u)) == 0x3f82);  // tie, odd rounds up
  CHECK(f32_to_f16(65504.f) == 0x7bff);
  CHECK(f32_to_f16(65520.f) == 0x7c00);  // exactly half an ulp past max: infinity
  CHECK(f32_to_f16(5.9604645e-8f) == 0x0001);  // smallest subnormal
  CHECK(f16_to_f32(0x0001) == 5.9604645e-8f);
  CHECK(std::isnan(f16_to_f32(f32_to_f16(std::nanf("")))));
}

TEST_CASE("cast rejects bad parameters", "[cast]") {
  std::vector<float> a(8), b(8);
  auto code = [](const CastParams& p) { return laminar::kernels::run(p, laminar::Stream::host()).code(); };
  using laminar::StatusCode;
  CHECK(code({a.data(), b.data(), -1, DType::kF32, DType::kF16}) == StatusCode::kInvalidArgument);
  CHECK(code({nullptr, b.data(), 8, DType::kF32, DType::kF16}) == StatusCode::kInvalidArgument);
  CHECK(code({a.data(), a.data() + 1, 4, DType::kF32, DType::kF32}) == StatusCode::kInvalidArgument);
  CHECK(code({a.data(), b.data(), 8, DType::kI32, DType::kF32}) == StatusCode::kInvalidArgument);
  CHECK(code({nullptr, nullptr, 0, DType::kF32, DType::kF16}) == StatusCode::kOk);
  auto st = laminar::kernels::run({a.data(), b.data(), 8, DType::kU8, DType::kF32}, laminar::Stream::host());
  CHECK_THAT(st.message(), Catch::Contains("u8 -> f32 is not supported"));
}
