#include "laminar/kernels/cast.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "cuda_absent.h"
#include "expect_code.h"
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

TEST_CASE("cast: matches the reference bit for bit", "[cast]") {
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

TEST_CASE("cast: rounds to nearest even at known points", "[cast]") {
  using namespace laminar::internal;
  CHECK(f32_to_bf16(f32_from_bits(0x3f808000u)) == 0x3f80);  // tie, even stays
  CHECK(f32_to_bf16(f32_from_bits(0x3f818000u)) == 0x3f82);  // tie, odd rounds up
  CHECK(f32_to_f16(65504.f) == 0x7bff);
  CHECK(f32_to_f16(65520.f) == 0x7c00);  // exactly half an ulp past max: infinity
  CHECK(f32_to_f16(5.9604645e-8f) == 0x0001);  // smallest subnormal
  CHECK(f16_to_f32(0x0001) == 5.9604645e-8f);
  CHECK(std::isnan(f16_to_f32(f32_to_f16(std::nanf("")))));
}

TEST_CASE("cast: bad parameters are rejected", "[cast]") {
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

TEST_CASE("cast: from tensors matches the raw-pointer call bit for bit", "[cast][tensors]") {
  const auto bits = test_f32_bits(99);
  const std::int64_t n = std::int64_t(bits.size());
  const std::int64_t shape[2] = {2, n / 2};
  std::vector<std::uint16_t> via_views(static_cast<std::size_t>(n)), via_raw(static_cast<std::size_t>(n));
  auto src = laminar::TensorView::contiguous(const_cast<std::uint32_t*>(bits.data()), DType::kF32, shape);
  auto dst = laminar::TensorView::contiguous(via_views.data(), DType::kBF16, shape);
  REQUIRE(src.ok());
  REQUIRE(dst.ok());
  auto p = CastParams::from_tensors(*src, *dst);
  REQUIRE(p.ok());
  CHECK(p->n == shape[0] * shape[1]);
  CHECK(laminar::kernels::workspace_bytes(*p) == 0);
  REQUIRE(laminar::kernels::can_implement(*p, laminar::Stream::host()).ok());
  REQUIRE(laminar::kernels::run(*p, laminar::Stream::host()).ok());
  CastParams raw{bits.data(), via_raw.data(), shape[0] * shape[1], DType::kF32, DType::kBF16};
  REQUIRE(laminar::kernels::run(raw, laminar::Stream::host()).ok());
  CHECK(via_views == via_raw);
}

TEST_CASE("cast: from tensors, mismatched tensors are refused, naming them", "[cast][tensors]") {
  std::vector<float> a(24), b(24);
  const std::int64_t s23[2] = {2, 3}, s32[2] = {3, 2}, s6[1] = {6};
  const auto view = [](void* data, DType t, std::span<const std::int64_t> shape,
                       laminar::Device d = laminar::Device::cpu()) {
    return laminar::TensorView::contiguous(data, t, shape, d).value();
  };
  const auto refused = [](const laminar::TensorView& src, const laminar::TensorView& dst, const char* text) {
    auto p = CastParams::from_tensors(src, dst);
    REQUIRE_FALSE(p.ok());
    CHECK(p.status().code() == laminar::StatusCode::kInvalidArgument);
    CHECK_THAT(p.status().message(), Catch::Contains(text));
  };
  refused(view(a.data(), DType::kF32, s23), view(b.data(), DType::kF16, s32),
          "cast: dst: shape [3, 2] but src has [2, 3]");
  refused(view(a.data(), DType::kF32, s6), view(b.data(), DType::kF16, s23), "dst: shape [2, 3] but src has [6]");
  refused(view(a.data(), DType::kI32, s6), view(b.data(), DType::kF16, s6), "src: dtype i32 but f32, f16 or bf16");
  refused(view(a.data(), DType::kF32, s6), view(b.data(), DType::kI64, s6), "dst: dtype i64 but f32, f16 or bf16");
  refused(view(a.data(), DType::kF32, s6), view(b.data(), DType::kF16, s6, laminar::Device::cuda(0)),
          "dst: on cuda:0 but src is on cpu:0");
  refused(view(a.data(), DType::kF32, s6, laminar::Device::cuda(1)),
          view(b.data(), DType::kF16, s6, laminar::Device::cuda(0)), "dst: on cuda:0 but src is on cuda:1");
  const std::int64_t strides[2] = {6, 2};
  auto strided = laminar::TensorView::strided(a.data(), DType::kF32, s23, strides).value();
  refused(strided, view(b.data(), DType::kF16, s23), "src: strides [6, 2] of shape [2, 3] are not dense");
  refused(view(a.data(), DType::kF32, s23), laminar::TensorView::strided(b.data(), DType::kF16, s23, strides).value(),
          "dst: strides [6, 2] of shape [2, 3] are not dense");
  refused(view(a.data(), DType::kF32, s6), view(a.data() + 1, DType::kF32, s6), "src and dst overlap");
  // Page-locked host memory counts as host: no device mismatch.
  const laminar::Device pinned{laminar::DeviceType::kCudaHost, 0};
  CHECK(CastParams::from_tensors(view(a.data(), DType::kF32, s6), view(b.data(), DType::kF16, s6, pinned)).ok());
}

TEST_CASE("cast: a CUDA stream without a device answers kFailedPrecondition (kUnimplemented without CUDA)",
          "[cast][cuda]") {
  const auto code = laminar::testing::code_without_device();
  if (!code) return;  // a device is present: cast_cuda_test runs the kernel
  std::vector<float> a(300, 1.5f);
  std::vector<std::uint16_t> b(300, 0);
  const CastParams p{a.data(), b.data(), 300, DType::kF32, DType::kBF16};
  REQUIRE(laminar::kernels::can_implement(p, laminar::Stream::cuda(nullptr)).ok());
  laminar::testing::expect_code(laminar::kernels::run(p, laminar::Stream::cuda(nullptr)), *code, "cast");
  CHECK(b == std::vector<std::uint16_t>(300, 0));
}
