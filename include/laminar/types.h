// types.h: the vocabulary every laminar component shares.
//
// Strong ids (Version, SequenceId, WorkerId, TrajectoryId, PromptId, GroupId, BatchId, MigrationId,
// EndpointId, RequestId) so a worker id is never passed where a version is expected; DType; Device;
// Stream (an opaque handle, so no CUDA header leaks into user code); and TensorView, a non-owning
// view of a strided tensor that converts losslessly from and to DLPack's DLTensor, which is how
// tensors cross from PyTorch, JAX or the host engine into laminar.
//
//   float buf[6] = {};
//   std::int64_t shape[2] = {2, 3};
//   auto view = laminar::TensorView::contiguous(buf, laminar::DType::kF32, shape);
//   DLTensor dl = view->to_dlpack();                      // points into *view's shape/strides
//   auto back = laminar::TensorView::from_dlpack(dl);     // same data, dtype, shape, strides
#pragma once

#include <dlpack/dlpack.h>

#include <array>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>

#include "laminar/status.h"

namespace laminar {

// A typed integer id. Tag keeps ids of different kinds from mixing.
template <class Tag, class Rep>
class StrongId {
 public:
  using rep_type = Rep;
  constexpr StrongId() noexcept = default;
  constexpr explicit StrongId(Rep value) noexcept : value_(value) {}
  constexpr Rep value() const noexcept { return value_; }
  friend constexpr auto operator<=>(StrongId, StrongId) noexcept = default;

 private:
  Rep value_{};
};

struct VersionTag {};
struct SequenceIdTag {};
struct WorkerIdTag {};
struct TrajectoryIdTag {};
struct PromptIdTag {};
struct GroupIdTag {};
struct BatchIdTag {};
struct MigrationIdTag {};
struct EndpointIdTag {};
struct RequestIdTag {};

// A policy version. Versions published by one actor strictly increase; 0 is the initial policy.
using Version = StrongId<VersionTag, std::uint64_t>;
// A live decoding sequence (unique within a cluster, so it survives migration).
using SequenceId = StrongId<SequenceIdTag, std::uint64_t>;
// A rollout worker (one inference engine instance).
using WorkerId = StrongId<WorkerIdTag, std::uint32_t>;
// A finished trajectory in the experience buffer.
using TrajectoryId = StrongId<TrajectoryIdTag, std::uint64_t>;
// The prompt a trajectory answers (chosen by whoever hands out prompts).
using PromptId = StrongId<PromptIdTag, std::uint64_t>;
// A GRPO group: the trajectories sampled for one prompt that a TrajectoryQueue delivers together.
using GroupId = StrongId<GroupIdTag, std::uint64_t>;
// A batch leased out by a TrajectoryQueue, acked or nacked by this id.
using BatchId = StrongId<BatchIdTag, std::uint64_t>;
// One KV migration between two rollout workers (random, chosen by its source; never 0).
using MigrationId = StrongId<MigrationIdTag, std::uint64_t>;
// One connection of a Transport (Endpoint::id(): unique within its transport; never 0).
using EndpointId = StrongId<EndpointIdTag, std::uint64_t>;
// A request waiting for its reply on one connection (Incoming::request_id; RequestId(), 0, for a
// one-way message).
using RequestId = StrongId<RequestIdTag, std::uint64_t>;

// Element types laminar moves and computes on.
enum class DType : std::uint8_t { kF32, kF16, kBF16, kI32, kI64, kU8 };

inline constexpr std::array<DType, 6> kAllDTypes = {DType::kF32, DType::kF16, DType::kBF16,
                                                    DType::kI32, DType::kI64, DType::kU8};

constexpr std::size_t dtype_size(DType t) noexcept {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kU8: return 1;
  }
  return 0;
}

// "f32", "f16", "bf16", "i32", "i64", "u8".
std::string_view dtype_name(DType t) noexcept;
// Inverse of dtype_name; kInvalidArgument naming the text when it is not a dtype.
Result<DType> parse_dtype(std::string_view name);
Result<DType> dtype_from_dlpack(DLDataType t);
DLDataType dtype_to_dlpack(DType t) noexcept;

enum class DeviceType : std::uint8_t {
  kCpu,       // pageable host memory
  kCudaHost,  // page-locked host memory, reachable by CUDA copies
  kCuda,      // device memory
};

struct Device {
  DeviceType type = DeviceType::kCpu;
  std::int32_t id = 0;

  static constexpr Device cpu() noexcept { return {DeviceType::kCpu, 0}; }
  static constexpr Device cuda(std::int32_t ordinal) noexcept { return {DeviceType::kCuda, ordinal}; }
  bool is_host() const noexcept { return type != DeviceType::kCuda; }
  friend constexpr bool operator==(Device, Device) noexcept = default;
};

std::string to_string(Device d);

// Where a kernel runs: the host (null handle) or a CUDA stream (a cudaStream_t passed as void*,
// the legacy default stream being Stream::cuda(nullptr) with on_device set).
struct Stream {
  void* handle = nullptr;
  bool on_device = false;

  static constexpr Stream host() noexcept { return {nullptr, false}; }
  static Stream cuda(void* cuda_stream) noexcept { return {cuda_stream, true}; }
};

// A non-owning view of a strided tensor. Shape and strides are stored inline (at most kMaxDims),
// strides in elements as in DLPack. byte_offset is kept apart from data so DLPack round trips are
// exact. The view does not keep the memory alive.
class TensorView {
 public:
  static constexpr int kMaxDims = 8;

  enum class StridePolicy : std::uint8_t {
    kNonNegative,  // default: strides >= 0 (all laminar kernels and copies need this)
    kAllowNegative,
    kContiguous,  // strides must describe a dense row-major layout
  };

  TensorView() = default;

  // A dense row-major view. kInvalidArgument if shape has a negative dim or too many dims, or data
  // is null while the tensor has elements.
  static Result<TensorView> contiguous(void* data, DType dtype, std::span<const std::int64_t> shape,
                                       Device device = Device::cpu());
  // A strided view; strides in elements, same length as shape.
  static Result<TensorView> strided(void* data, DType dtype, std::span<const std::int64_t> shape,
                                    std::span<const std::int64_t> strides,
                                    Device device = Device::cpu(),
                                    StridePolicy policy = StridePolicy::kNonNegative);

  // From DLPack. Rejects: unsupported dtype (naming code/bits/lanes), ndim outside [0, kMaxDims],
  // negative dims, null data with elements, negative strides unless policy allows them,
  // non-contiguous strides under kContiguous, device types other than CPU/CUDA/CUDAHost, and an
  // element pointer not aligned to its dtype. Null strides mean row-major, as DLPack says.
  static Result<TensorView> from_dlpack(const DLTensor& t,
                                        StridePolicy policy = StridePolicy::kNonNegative);

  // A DLTensor whose shape and strides point into this view: valid while the view lives and is
  // not moved. Strides are always filled in.
  DLTensor to_dlpack() const;

  // Address of element [0, ..., 0] (data + byte_offset).
  void* data() const noexcept { return static_cast<char*>(data_) + byte_offset_; }
  template <class T>
  T* data_as() const noexcept {
    return static_cast<T*>(data());
  }
  void* base_data() const noexcept { return data_; }
  std::uint64_t byte_offset() const noexcept { return byte_offset_; }
  DType dtype() const noexcept { return dtype_; }
  Device device() const noexcept { return device_; }
  int ndim() const noexcept { return ndim_; }
  std::span<const std::int64_t> shape() const noexcept { return {shape_.data(), std::size_t(ndim_)}; }
  std::span<const std::int64_t> strides() const noexcept {
    return {strides_.data(), std::size_t(ndim_)};
  }
  std::int64_t dim(int i) const noexcept { return shape_[std::size_t(i)]; }
  std::int64_t stride(int i) const noexcept { return strides_[std::size_t(i)]; }
  std::int64_t numel() const noexcept;
  // numel * dtype_size: the bytes a dense copy of this tensor occupies.
  std::size_t nbytes() const noexcept { return std::size_t(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const noexcept;

  // "f32[2, 3] strides [3, 1] on cpu:0"
  std::string describe() const;

 private:
  void* data_ = nullptr;
  std::uint64_t byte_offset_ = 0;
  DType dtype_ = DType::kF32;
  Device device_ = Device::cpu();
  int ndim_ = 0;
  std::array<std::int64_t, kMaxDims> shape_{};
  std::array<std::int64_t, kMaxDims> strides_{};
};

}  // namespace laminar

template <class Tag, class Rep>
struct std::hash<laminar::StrongId<Tag, Rep>> {
  std::size_t operator()(laminar::StrongId<Tag, Rep> id) const noexcept {
    return std::hash<Rep>{}(id.value());
  }
};
