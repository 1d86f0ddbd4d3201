#include "laminar/types.h"

#include <catch2/catch.hpp>
#include <unordered_set>
#include <vector>

using laminar::DType;
using laminar::StatusCode;
using laminar::TensorView;

TEST_CASE("strong ids compare and hash but do not mix", "[types]") {
  laminar::Version a(3), b(4);
  CHECK(a < b);
  CHECK(a == laminar::Version(3));
  std::unordered_set<laminar::WorkerId> set{laminar::WorkerId(1), laminar::WorkerId(1), laminar::WorkerId(2)};
  CHECK(set.size() == 2);
  STATIC_REQUIRE_FALSE(std::is_convertible_v<laminar::Version, laminar::SequenceId>);
  STATIC_REQUIRE_FALSE(std::is_convertible_v<std::uint64_t, laminar::TrajectoryId>);
}

TEST_CASE("dtype names, sizes and DLPack codes round trip", "[types]") {
  for (DType t : laminar::kAllDTypes) {
    auto parsed = laminar::parse_dtype(laminar::dtype_name(t));
    REQUIRE(parsed.ok());
    CHECK(*parsed == t);
    auto from_dl = laminar::dtype_from_dlpack(laminar::dtype_to_dlpack(t));
    REQUIRE(from_dl.ok());
    CHECK(*from_dl == t);
    CHECK(laminar::dtype_to_dlpack(t).bits == laminar::dtype_size(t) * 8);
  }
  auto bad = laminar::parse_dtype("f8");
  CHECK(bad.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(bad.status().message(), Catch::Contains("'f8'"));
}

TEST_CASE("contiguous views have row-major strides", "[types]") {
  std::vector<float> buf(24);
  std::int64_t shape[] = {2, 3, 4};
  auto v = TensorView::contiguous(buf.data(), DType::kF32, shape);
  REQUIRE(v.ok());
  CHECK(v->numel() == 24);
  CHECK(v->nbytes() == 96);
  CHECK(v->stride(0) == 12);
  CHECK(v->stride(1) == 4);
  CHECK(v->stride(2) == 1);
  CHECK(v->is_contiguous());
  CHECK(v->describe() == "f32[2, 3, 4] strides [12, 4, 1] on cpu:0");
}

TEST_CASE("DLPack round trip is lossless", "[types][dlpack]") {
  std::vector<std::uint16_t> buf(64);
  std::int64_t shape[] = {4, 8};
  std::int64_t strides[] = {16, 2};  // every other column of a 4x16 buffer
  DLTensor dl{};
  dl.data = buf.data();
  dl.device = {kDLCUDAHost, 1};
  dl.ndim = 2;
  dl.dtype = {kDLBfloat, 16, 1};
  dl.shape = shape;
  dl.strides = strides;
  dl.byte_offset = 4;
  auto v = TensorView::from_dlpack(dl);
  REQUIRE(v.ok());
  CHECK(v->dtype() == DType::kBF16);
  CHECK(v->device() == laminar::Device{laminar::DeviceType::kCudaHost, 1});
  CHECK(v->data() == reinterpret_cast<char*>(buf.data()) + 4);
  CHECK_FALSE(v->is_contiguous());
  DLTensor back = v->to_dlpack();
  CHECK(back.data == dl.data);
  CHECK(back.byte_offset == dl.byte_offset);
  CHECK(back.device.device_type == dl.device.device_type);
  CHECK(back.device.device_id == dl.device.device_id);
  CHECK(back.dtype.code == dl.dtype.code);
  CHECK(back.dtype.bits == dl.dtype.bits);
  CHECK(back.dtype.lanes == dl.dtype.lanes);
  REQUIRE(back.ndim == 2);
  for (int i = 0; i < 2; ++i) {
    CHECK(back.shape[i] == shape[i]);
    CHECK(back.strides[i] == strides[i]);
  }
}

TEST_CASE("DLPack null strides mean row-major", "[types][dlpack]") {
  std::vector<std::int32_t> buf(6);
  std::int64_t shape[] = {2, 3};
  DLTensor dl{};
  dl.data = buf.data();
  dl.device = {kDLCPU, 0};
  dl.ndim = 2;
  dl.dtype = {kDLInt, 32, 1};
  dl.shape = shape;
  auto v = TensorView::from_dlpack(dl, TensorView::StridePolicy::kContiguous);
  REQUIRE(v.ok());
  CHECK(v->stride(0) == 3);
  CHECK(v->stride(1) == 1);
}

TEST_CASE("bad DLPack tensors are rejected with a message naming the problem", "[types][dlpack]") {
  std::vector<float> buf(16);
  std::int64_t shape[] = {4, 4};
  DLTensor good{};
  good.data = buf.data();
  good.device = {kDLCPU, 0};
  good.ndim = 2;
  good.dtype = {kDLFloat, 32, 1};
  good.shape = shape;
  REQUIRE(TensorView::from_dlpack(good).ok());

  auto expect_error = [](const DLTensor& t, const char* needle,
                         TensorView::StridePolicy policy = TensorView::StridePolicy::kNonNegative) {
    auto r = TensorView::from_dlpack(t, policy);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(r.status().message(), Catch::Contains(needle));
  };

  SECTION("null data with elements") {
    DLTensor t = good;
    t.data = nullptr;
    expect_error(t, "null data pointer");
  }
  SECTION("null data with zero elements is fine") {
    DLTensor t = good;
    t.data = nullptr;
    std::int64_t empty[] = {0, 4};
    t.shape = empty;
    CHECK(TensorView::from_dlpack(t).ok());
  }
  SECTION("unsupported dtypes") {
    DLTensor t = good;
    t.dtype = {kDLFloat, 64, 1};
    expect_error(t, "code=2, bits=64, lanes=1");
    t.dtype = {kDLFloat, 32, 4};
    expect_error(t, "lanes=4");
    t.dtype = {kDLComplex, 64, 1};
    expect_error(t, "unsupported DLPack dtype");
  }
  SECTION("negative strides unless allowed") {
    std::int64_t strides[] = {-4, 1};
    DLTensor t = good;
    t.data = buf.data() + 12;
    t.strides = strides;
    expect_error(t, "stride -4 of dim 0 is negative");
    CHECK(TensorView::from_dlpack(t, TensorView::StridePolicy::kAllowNegative).ok());
  }
  SECTION("non-contiguous where contiguous is required") {
    std::int64_t strides[] = {1, 4};  // column-major
    DLTensor t = good;
    t.strides = strides;
    CHECK(TensorView::from_dlpack(t).ok());
    expect_error(t, "contiguous tensor is required", TensorView::StridePolicy::kContiguous);
  }
  SECTION("negative dim") {
    std::int64_t neg[] = {4, -1};
    DLTensor t = good;
    t.shape = neg;
    expect_error(t, "dim 1 is negative (-1)");
  }
  SECTION("too many dims and bad ndim") {
    DLTensor t = good;
    t.ndim = 9;
    expect_error(t, "ndim 9");
    t.ndim = -1;
    expect_error(t, "ndim -1");
  }
  SECTION("unsupported device") {
    DLTensor t = good;
    t.device = {kDLVulkan, 0};
    expect_error(t, "device type 7");
  }
  SECTION("misaligned element pointer") {
    DLTensor t = good;
    t.byte_offset = 2;
    expect_error(t, "not aligned to 4 bytes");
  }
  SECTION("overflowing shape") {
    std::int64_t huge[] = {std::int64_t(1) << 40, std::int64_t(1) << 40};
    DLTensor t = good;
    t.shape = huge;
    expect_error(t, "overflows");
  }
}

TEST_CASE("strided() checks its arguments", "[types]") {
  std::vector<float> buf(8);
  std::int64_t shape[] = {2, 4};
  std::int64_t strides1[] = {4};
  auto r = TensorView::strided(buf.data(), DType::kF32, shape, strides1);
  CHECK_THAT(r.status().message(), Catch::Contains("2 dims but 1 strides"));
  std::int64_t nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
  CHECK_THAT(TensorView::contiguous(buf.data(), DType::kF32, nine).status().message(),
             Catch::Contains("9 dims"));
}
