// The CPU tasks of paged decode attention (vectorised with Highway, dispatched at run time). They
// follow cuda/paged_decode.cuh's reduction order operation for operation, so their results equal the
// CUDA kernels' bit for bit.
#pragma once

#include "../../cuda/paged_decode.cuh"

namespace laminar::kernels::cpu_detail {

// What one split block of the CUDA kernel computes: partials of (local_row, kv head h, split).
void split_task(const cuda_detail::DecodeArgs& a, cuda_detail::KvKind kind, int head_dim, int local_row, int h,
                int split);
// What one merge block computes: out and lse of (local_row, query head hq).
void merge_task(const cuda_detail::DecodeArgs& a, cuda_detail::KvKind kind, int head_dim, int local_row, int hq);

}  // namespace laminar::kernels::cpu_detail
