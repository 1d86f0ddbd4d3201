// The CPU tasks of paged decode attention (vectorised with Highway, dispatched at run time). They
// follow cuda/paged_decode.cuh's reduction order operation for operation, so their results equal the
// CUDA kernels' bit for bit.
#pragma once

#include "../../cuda/paged_decode.cuh"

namespace laminar::kernels::cpu_detail {

// Query heads one split task covers at most: its q, scores and accumulators stay in L1 / L2.
inline constexpr int kCpuQoHeadsPerTask = 32;

// One split task: KV heads [h_begin, h_begin + heads) of split `split` of row row_begin + local_row.
// Preconditions: heads * group <= kCpuQoHeadsPerTask.
struct SplitWork {
  std::int32_t local_row, split, h_begin, heads;
};

// What the split blocks of the CUDA kernel for the task's KV heads compute: their partials of
// (local_row, split). `next` (or null): the task this thread runs after it, whose K rows are
// fetched into L2 while this one computes.
void split_task(const cuda_detail::DecodeArgs& a, cuda_detail::KvKind kind, int head_dim, const SplitWork& w,
                const SplitWork* next);
// What one merge block computes: out and lse of (local_row, query head hq).
void merge_task(const cuda_detail::DecodeArgs& a, cuda_detail::KvKind kind, int head_dim, int local_row, int hq);

}  // namespace laminar::kernels::cpu_detail
