// Launcher of the paged decode kernels: the one place where the runtime dtype and head_dim become
// template arguments for the device.
#include "launch_status.h"
#include "paged_decode_launch.cuh"

namespace laminar::kernels::cuda_detail {

Status launch_paged_decode(const DecodeArgs& a, KvKind kind, int head_dim, std::int32_t num_rows, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const bool d64 = head_dim == 64;
  cudaError_t err = cudaSuccess;
  switch (kind) {
    case KvKind::kF32:
      err = d64 ? launch_split_merge<KvKind::kF32, 64>(a, num_rows, s) : launch_split_merge<KvKind::kF32, 128>(a, num_rows, s);
      break;
    case KvKind::kF16:
      err = d64 ? launch_split_merge<KvKind::kF16, 64>(a, num_rows, s) : launch_split_merge<KvKind::kF16, 128>(a, num_rows, s);
      break;
    case KvKind::kBF16:
      err = d64 ? launch_split_merge<KvKind::kBF16, 64>(a, num_rows, s)
                : launch_split_merge<KvKind::kBF16, 128>(a, num_rows, s);
      break;
  }
  return launch_status("paged_decode", err);
}

}  // namespace laminar::kernels::cuda_detail
