// Launcher for the cast kernel: the one place where runtime dtypes become template arguments.
#include <algorithm>

#include "cast.cuh"
#include "launch_status.h"
#include "laminar/kernels/cast.h"

namespace laminar::kernels::cuda_detail {

namespace {

CastKind kind_of(DType t) {
  return t == DType::kF32 ? CastKind::kF32 : t == DType::kF16 ? CastKind::kF16 : CastKind::kBF16;
}

template <CastKind kSrc>
void launch_for_src(CastKind dst, const CastParams& p, unsigned grid, cudaStream_t s) {
  switch (dst) {
    case CastKind::kF32: cast_kernel<kSrc, CastKind::kF32><<<grid, 256, 0, s>>>(p.src, p.dst, p.n); break;
    case CastKind::kF16: cast_kernel<kSrc, CastKind::kF16><<<grid, 256, 0, s>>>(p.src, p.dst, p.n); break;
    case CastKind::kBF16: cast_kernel<kSrc, CastKind::kBF16><<<grid, 256, 0, s>>>(p.src, p.dst, p.n); break;
  }
}

}  // namespace

Status launch_cast(const CastParams& p, void* stream) {
  if (p.n == 0) return ok_status();
  auto s = static_cast<cudaStream_t>(stream);
  constexpr std::int64_t kMaxGrid = 4096;
  const auto grid = static_cast<unsigned>(std::min<std::int64_t>((p.n + 255) / 256, kMaxGrid));
  switch (kind_of(p.src_dtype)) {
    case CastKind::kF32: launch_for_src<CastKind::kF32>(kind_of(p.dst_dtype), p, grid, s); break;
    case CastKind::kF16: launch_for_src<CastKind::kF16>(kind_of(p.dst_dtype), p, grid, s); break;
    case CastKind::kBF16: launch_for_src<CastKind::kBF16>(kind_of(p.dst_dtype), p, grid, s); break;
  }
  return launch_status("cast", cudaGetLastError());
}

}  // namespace laminar::kernels::cuda_detail
