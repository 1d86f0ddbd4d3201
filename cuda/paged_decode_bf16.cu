// Explicit instantiations of the paged decode kernels for bf16 KV, head_dim 64 and 128.
#include "paged_decode_launch.cuh"

namespace laminar::kernels::cuda_detail {

template cudaError_t launch_split_merge<KvKind::kBF16, 64>(const DecodeArgs&, int, cudaStream_t);
template cudaError_t launch_split_merge<KvKind::kBF16, 128>(const DecodeArgs&, int, cudaStream_t);

}  // namespace laminar::kernels::cuda_detail
