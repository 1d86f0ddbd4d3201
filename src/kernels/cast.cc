#include "laminar/kernels/cast.h"

#include <fmt/format.h>

#include <algorithm>

#include "../../cuda/cast.cuh"
#include "tensor_args.h"

namespace laminar::kernels {

#if defined(LAMINAR_HAVE_CUDA)
namespace cuda_detail {
Status launch_cast(const CastParams& p, void* stream);
}
#endif

namespace {

using cuda_detail::CastKind;

bool is_float(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }

CastKind kind_of(DType t) {
  return t == DType::kF32 ? CastKind::kF32 : t == DType::kF16 ? CastKind::kF16 : CastKind::kBF16;
}

template <CastKind kSrc, CastKind kDst>
void cast_host(const CastParams& p) {
  for (std::int64_t i = 0; i < p.n; ++i) {
    cuda_detail::cast_one<kSrc, kDst>(p.src, p.dst, i);
  }
}

template <CastKind kSrc>
void cast_host_for_src(CastKind dst, const CastParams& p) {
  switch (dst) {
    case CastKind::kF32: cast_host<kSrc, CastKind::kF32>(p); break;
    case CastKind::kF16: cast_host<kSrc, CastKind::kF16>(p); break;
    case CastKind::kBF16: cast_host<kSrc, CastKind::kBF16>(p); break;
  }
}

}  // namespace

Result<CastParams> CastParams::from_tensors(const TensorView& src, const TensorView& dst) {
  tensor_args::Placement where("cast");
  LAMINAR_RETURN_IF_ERROR(where.add("src", src));
  LAMINAR_RETURN_IF_ERROR(where.add("dst", dst));
  if (!std::equal(dst.shape().begin(), dst.shape().end(), src.shape().begin(), src.shape().end())) {
    return invalid_argument(fmt::format("cast: dst: shape {} but src has {}", tensor_args::shape_string(dst.shape()),
                                        tensor_args::shape_string(src.shape())));
  }
  LAMINAR_RETURN_IF_ERROR(tensor_args::expect_dense("cast", "src", src));
  LAMINAR_RETURN_IF_ERROR(tensor_args::expect_dense("cast", "dst", dst));
  for (const auto& [name, v] : {std::pair<const char*, const TensorView&>{"src", src}, {"dst", dst}}) {
    if (!is_float(v.dtype())) {
      return tensor_args::mismatch("cast", name,
                                   fmt::format("dtype {} but f32, f16 or bf16 is needed", dtype_name(v.dtype())));
    }
  }
  CastParams p;
  p.src = src.data();
  p.dst = dst.data();
  p.n = src.numel();
  p.src_dtype = src.dtype();
  p.dst_dtype = dst.dtype();
  LAMINAR_RETURN_IF_ERROR(can_implement(p, where.on_device() ? Stream::cuda(nullptr) : Stream::host()));
  return p;
}

std::size_t workspace_bytes(const CastParams&) { return 0; }

Status can_implement(const CastParams& p, Stream) {
  if (p.n < 0) return invalid_argument(fmt::format("cast: n is negative ({})", p.n));
  if (!is_float(p.src_dtype) || !is_float(p.dst_dtype)) {
    return invalid_argument(fmt::format("cast: {} -> {} is not supported (f32, f16, bf16 only)",
                                        dtype_name(p.src_dtype), dtype_name(p.dst_dtype)));
  }
  if (p.n == 0) return ok_status();
  if (p.src == nullptr || p.dst == nullptr) {
    return invalid_argument(fmt::format("cast: null {} pointer with n = {}", p.src ? "dst" : "src", p.n));
  }
  const auto s = reinterpret_cast<std::uintptr_t>(p.src);
  const auto d = reinterpret_cast<std::uintptr_t>(p.dst);
  const auto s_end = s + std::uintptr_t(p.n) * dtype_size(p.src_dtype);
  const auto d_end = d + std::uintptr_t(p.n) * dtype_size(p.dst_dtype);
  if (s < d_end && d < s_end) return invalid_argument("cast: src and dst overlap");
  if (s % dtype_size(p.src_dtype) != 0 || d % dtype_size(p.dst_dtype) != 0) {
    return invalid_argument("cast: src or dst is not aligned to its element size");
  }
  return ok_status();
}

Status run(const CastParams& p, Stream stream) {
  LAMINAR_RETURN_IF_ERROR(can_implement(p, stream));
  if (stream.on_device) {
#if defined(LAMINAR_HAVE_CUDA)
    return cuda_detail::launch_cast(p, stream.handle);
#else
    return unimplemented("cast on a CUDA stream: laminar was built without CUDA (LAMINAR_CUDA=OFF)");
#endif
  }
  switch (kind_of(p.src_dtype)) {
    case CastKind::kF32: cast_host_for_src<CastKind::kF32>(kind_of(p.dst_dtype), p); break;
    case CastKind::kF16: cast_host_for_src<CastKind::kF16>(kind_of(p.dst_dtype), p); break;
    case CastKind::kBF16: cast_host_for_src<CastKind::kBF16>(kind_of(p.dst_dtype), p); break;
  }
  return ok_status();
}

}  // namespace laminar::kernels
