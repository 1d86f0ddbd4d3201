#include "laminar/types.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>

namespace laminar {

std::string_view dtype_name(DType t) noexcept {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kU8: return "u8";
  }
  return "?";
}

Result<DType> parse_dtype(std::string_view name) {
  for (DType t : kAllDTypes) {
    if (dtype_name(t) == name) return t;
  }
  return invalid_argument(
      fmt::format("unknown dtype '{}' (expected one of f32, f16, bf16, i32, i64, u8)", name));
}

Result<DType> dtype_from_dlpack(DLDataType t) {
  if (t.lanes == 1) {
    switch (t.code) {
      case kDLFloat:
        if (t.bits == 32) return DType::kF32;
        if (t.bits == 16) return DType::kF16;
        break;
      case kDLBfloat:
        if (t.bits == 16) return DType::kBF16;
        break;
      case kDLInt:
        if (t.bits == 32) return DType::kI32;
        if (t.bits == 64) return DType::kI64;
        break;
      case kDLUInt:
        if (t.bits == 8) return DType::kU8;
        break;
      default:
        break;
    }
  }
  return invalid_argument(fmt::format(
      "unsupported DLPack dtype (code={}, bits={}, lanes={}); laminar supports f32, f16, bf16, i32, "
      "i64, u8 with lanes=1",
      int(t.code), int(t.bits), int(t.lanes)));
}

DLDataType dtype_to_dlpack(DType t) noexcept {
  switch (t) {
    case DType::kF32: return {kDLFloat, 32, 1};
    case DType::kF16: return {kDLFloat, 16, 1};
    case DType::kBF16: return {kDLBfloat, 16, 1};
    case DType::kI32: return {kDLInt, 32, 1};
    case DType::kI64: return {kDLInt, 64, 1};
    case DType::kU8: return {kDLUInt, 8, 1};
  }
  return {kDLFloat, 32, 1};
}

std::string to_string(Device d) {
  switch (d.type) {
    case DeviceType::kCpu: return fmt::format("cpu:{}", d.id);
    case DeviceType::kCudaHost: return fmt::format("cuda_host:{}", d.id);
    case DeviceType::kCuda: return fmt::format("cuda:{}", d.id);
  }
  return "?";
}

namespace {

Result<Device> device_from_dlpack(DLDevice d) {
  switch (d.device_type) {
    case kDLCPU: return Device{DeviceType::kCpu, d.device_id};
    case kDLCUDAHost: return Device{DeviceType::kCudaHost, d.device_id};
    case kDLCUDA: return Device{DeviceType::kCuda, d.device_id};
    default:
      return invalid_argument(fmt::format(
          "unsupported DLPack device type {} (laminar takes CPU=1, CUDA=2, CUDAHost=3)",
          int(d.device_type)));
  }
}

DLDevice device_to_dlpack(Device d) {
  switch (d.type) {
    case DeviceType::kCpu: return {kDLCPU, d.id};
    case DeviceType::kCudaHost: return {kDLCUDAHost, d.id};
    case DeviceType::kCuda: return {kDLCUDA, d.id};
  }
  return {kDLCPU, 0};
}

// Dense row-major strides. Multiplication saturates instead of overflowing: a shape that large is
// rejected by check_view() afterwards, with a message.
template <class Dim>
void row_major_strides(int ndim, Dim dim, std::int64_t* strides) {
  std::int64_t stride = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    strides[i] = stride;
    const std::int64_t d = dim(i) > 0 ? dim(i) : 1;
    if (__builtin_mul_overflow(stride, d, &stride)) stride = std::numeric_limits<std::int64_t>::max();
  }
}

}  // namespace

std::int64_t TensorView::numel() const noexcept {
  std::int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= shape_[std::size_t(i)];
  return n;
}

bool TensorView::is_contiguous() const noexcept {
  std::int64_t expected = 1;
  for (int i = ndim_ - 1; i >= 0; --i) {
    // A dim of size 1 may carry any stride: it is never stepped over.
    if (shape_[std::size_t(i)] != 1 && strides_[std::size_t(i)] != expected) return false;
    expected *= shape_[std::size_t(i)];
  }
  return true;
}

std::string TensorView::describe() const {
  return fmt::format("{}{} strides {} on {}", dtype_name(dtype_), shape(), strides(),
                     to_string(device_));
}

namespace {

// Everything a view must satisfy, whichever way it was made.
Status check_view(const TensorView& v, TensorView::StridePolicy policy) {
  using StridePolicy = TensorView::StridePolicy;
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  std::int64_t numel = 1;
  bool overflow = false;
  for (int i = 0; i < v.ndim(); ++i) {
    const std::int64_t d = v.dim(i);
    if (d < 0) {
      return invalid_argument(fmt::format("tensor shape {}: dim {} is negative ({})", v.shape(), i, d));
    }
    if (d != 0 && numel > kMax / d) overflow = true;
    numel = overflow ? numel : numel * d;
  }
  if (overflow || numel > kMax / std::int64_t(dtype_size(v.dtype()))) {
    return invalid_argument(
        fmt::format("tensor shape {} of {} overflows 64-bit byte counts", v.shape(), dtype_name(v.dtype())));
  }
  if (numel > 0 && v.base_data() == nullptr) {
    return invalid_argument(
        fmt::format("tensor {}{} has {} elements but a null data pointer", dtype_name(v.dtype()), v.shape(),
                    numel));
  }
  for (int i = 0; i < v.ndim(); ++i) {
    const std::int64_t s = v.stride(i);
    if (s < 0 && policy != StridePolicy::kAllowNegative) {
      return invalid_argument(fmt::format(
          "tensor {}{}: stride {} of dim {} is negative, which this call does not allow",
          dtype_name(v.dtype()), v.shape(), s, i));
    }
  }
  if (policy == StridePolicy::kContiguous && !v.is_contiguous()) {
    return invalid_argument(fmt::format("tensor {}{} has strides {}, but a contiguous tensor is required",
                                        dtype_name(v.dtype()), v.shape(), v.strides()));
  }
  const auto addr = reinterpret_cast<std::uintptr_t>(v.data());
  if (numel > 0 && addr % dtype_size(v.dtype()) != 0) {
    return invalid_argument(fmt::format("tensor {}{}: element pointer {:#x} is not aligned to {} bytes",
                                        dtype_name(v.dtype()), v.shape(), addr, dtype_size(v.dtype())));
  }
  return ok_status();
}

}  // namespace

Result<TensorView> TensorView::contiguous(void* data, DType dtype, std::span<const std::int64_t> shape,
                                          Device device) {
  if (shape.size() > std::size_t(kMaxDims)) {
    return invalid_argument(fmt::format("tensor has {} dims; at most {} are supported", shape.size(), kMaxDims));
  }
  TensorView v;
  v.data_ = data;
  v.dtype_ = dtype;
  v.device_ = device;
  v.ndim_ = int(shape.size());
  std::copy(shape.begin(), shape.end(), v.shape_.begin());
  row_major_strides(v.ndim_, [&](int i) { return shape[std::size_t(i)]; }, v.strides_.data());
  LAMINAR_RETURN_IF_ERROR(check_view(v, StridePolicy::kNonNegative));
  return v;
}

Result<TensorView> TensorView::strided(void* data, DType dtype, std::span<const std::int64_t> shape,
                                       std::span<const std::int64_t> strides, Device device,
                                       StridePolicy policy) {
  if (shape.size() > std::size_t(kMaxDims)) {
    return invalid_argument(fmt::format("tensor has {} dims; at most {} are supported", shape.size(), kMaxDims));
  }
  if (strides.size() != shape.size()) {
    return invalid_argument(
        fmt::format("tensor has {} dims but {} strides", shape.size(), strides.size()));
  }
  TensorView v;
  v.data_ = data;
  v.dtype_ = dtype;
  v.device_ = device;
  v.ndim_ = int(shape.size());
  for (std::size_t i = 0; i < shape.size(); ++i) {
    v.shape_[i] = shape[i];
    v.strides_[i] = strides[i];
  }
  LAMINAR_RETURN_IF_ERROR(check_view(v, policy));
  return v;
}

Result<TensorView> TensorView::from_dlpack(const DLTensor& t, StridePolicy policy) {
  Result<DType> dtype = dtype_from_dlpack(t.dtype);
  if (!dtype.ok()) return dtype.status();
  Result<Device> device = device_from_dlpack(t.device);
  if (!device.ok()) return device.status();
  if (t.ndim < 0 || t.ndim > kMaxDims) {
    return invalid_argument(fmt::format("DLPack tensor has ndim {}; laminar takes 0..{}", t.ndim, kMaxDims));
  }
  if (t.ndim > 0 && t.shape == nullptr) {
    return invalid_argument(fmt::format("DLPack tensor has ndim {} but a null shape pointer", t.ndim));
  }
  TensorView v;
  v.data_ = t.data;
  v.byte_offset_ = t.byte_offset;
  v.dtype_ = *dtype;
  v.device_ = *device;
  v.ndim_ = t.ndim;
  std::copy(t.shape, t.shape + t.ndim, v.shape_.begin());
  if (t.strides != nullptr) {
    std::copy(t.strides, t.strides + t.ndim, v.strides_.begin());
  } else {
    row_major_strides(v.ndim_, [&](int i) { return t.shape[i]; }, v.strides_.data());
  }
  LAMINAR_RETURN_IF_ERROR(check_view(v, policy));
  return v;
}

DLTensor TensorView::to_dlpack() const {
  DLTensor t{};
  t.data = data_;
  t.device = device_to_dlpack(device_);
  t.ndim = ndim_;
  t.dtype = dtype_to_dlpack(dtype_);
  t.shape = const_cast<std::int64_t*>(shape_.data());
  t.strides = const_cast<std::int64_t*>(strides_.data());
  t.byte_offset = byte_offset_;
  return t;
}

}  // namespace laminar
