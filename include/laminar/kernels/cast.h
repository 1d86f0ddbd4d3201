// cast.h: element-wise conversion between f32, f16 and bf16, on the host or a CUDA stream.
//
// Used when the actor publishes weights in one precision and a rollout engine runs in another
// (f32 master weights pulled into a bf16 engine). CPU and CUDA produce the same bits: both
// call internal/numerics.h (round to nearest even, NaN kept).
//
//   laminar::kernels::CastParams p;
//   p.src = master; p.src_dtype = laminar::DType::kF32;
//   p.dst = engine; p.dst_dtype = laminar::DType::kBF16;
//   p.n = count;
//   laminar::Status st = laminar::kernels::run(p, laminar::Stream::host());
//
// From tensors (DLPack views of an engine's buffers): CastParams::from_tensors(src, dst).
#pragma once

#include <cstddef>
#include <cstdint>

#include "laminar/status.h"
#include "laminar/types.h"

namespace laminar::kernels {

struct CastParams {
  const void* src = nullptr;  // [n] of src_dtype
  void* dst = nullptr;        // [n] of dst_dtype; must not overlap src
  std::int64_t n = 0;
  DType src_dtype = DType::kF32;
  DType dst_dtype = DType::kBF16;

  // src and dst: the same shape, both dense, dtypes f32/f16/bf16, all on the host or both on one
  // CUDA device. kInvalidArgument naming the tensor and the mismatch.
  static Result<CastParams> from_tensors(const TensorView& src, const TensorView& dst);
};

// kInvalidArgument for a negative n, null pointers with n > 0, overlapping buffers, or a dtype
// other than f32/f16/bf16.
Status can_implement(const CastParams& p, Stream stream);
// Always 0: the cast needs no scratch.
std::size_t workspace_bytes(const CastParams& p);
// On Stream::host() runs on the calling thread; on a CUDA stream enqueues the kernel (pointers are
// then device or page-locked memory) and returns without waiting. kUnimplemented for a CUDA stream
// in a build without CUDA; kFailedPrecondition when no CUDA device or driver takes the launch.
Status run(const CastParams& p, Stream stream);

}  // namespace laminar::kernels
