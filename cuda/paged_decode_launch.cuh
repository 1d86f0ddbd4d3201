// paged_decode_launch.cuh: the launcher template of the split + merge kernels (nvcc only). Each
// dtype's instantiations live in their own paged_decode_<dtype>.cu so they compile in parallel;
// paged_decode.cu holds the one dispatch from runtime dtype / head_dim to these.
#pragma once

#include <cuda_runtime.h>

#include "paged_decode.cuh"

namespace laminar::kernels::cuda_detail {

// Rows [a.row_begin, a.row_begin + rows): split blocks for every (row, kv head, split < max_splits)
// (blocks past a row's length leave at once), then the merge.
template <KvKind K, int D>
cudaError_t launch_split_merge(const DecodeArgs& a, int rows, cudaStream_t stream) {
  const int group = a.num_qo_heads / a.num_kv_heads;
  const dim3 split_grid(unsigned(rows) * unsigned(a.num_kv_heads), unsigned(a.max_splits));
  paged_decode_split_kernel<K, D>
      <<<split_grid, kDecodeThreads, split_smem_bytes(group, D), stream>>>(a);
  paged_decode_merge_kernel<K, D><<<unsigned(rows) * unsigned(a.num_qo_heads), D, 0, stream>>>(a);
  return cudaGetLastError();
}

#define LAMINAR_DECLARE_PAGED_DECODE(KIND)                                                        \
  extern template cudaError_t launch_split_merge<KIND, 64>(const DecodeArgs&, int, cudaStream_t); \
  extern template cudaError_t launch_split_merge<KIND, 128>(const DecodeArgs&, int, cudaStream_t)

LAMINAR_DECLARE_PAGED_DECODE(KvKind::kF32);
LAMINAR_DECLARE_PAGED_DECODE(KvKind::kF16);
LAMINAR_DECLARE_PAGED_DECODE(KvKind::kBF16);

}  // namespace laminar::kernels::cuda_detail
