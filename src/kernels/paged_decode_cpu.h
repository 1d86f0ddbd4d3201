// The CPU tasks of paged decode attention (vectorised with Highway, dispatched at run time). They
// follow cuda/paged_decode.cuh's reduction order operation for operation, so their results equal the
// CUDA kernels' bit for bit.
#pragma once

#include "../../cuda/paged_decode.cuh"

namespace laminar::kernels::cpu_detail {

// Query heads one split task covers at most: its q, scores and accumulators stay in L1 / L2.
inline constexpr int kCpuQoHeadsPerTask = 32;

// What the split blocks of the CUDA kernel for KV heads [h_begin, h_begin + heads) compute:
// partials of (local_row, split) for those heads. Preconditions: heads * group <= kCpuQoHeadsPerTask.
void split_task(const cuda_detail::DecodeArgs& a, cuda_detail::KvKind kind, int head_dim, int local_row, int split,
                int h_begin, int heads);
// What one merge block computes: out and lse of (local_row, query head hq).
void merge_task(const cuda_detail::DecodeArgs& a, cuda_detail::KvKind kind, int head_dim, int local_row, int hq);

}  // namespace laminar::kernels::cpu_detail
