// Compiled by nvcc against the installed headers only (nothing runs): laminar's attention, sampling
// and cast device code instantiated inside this project, and called from a kernel of its own.
#include <cstdint>
#include <laminar/cuda/cast.cuh>
#include <laminar/cuda/paged_decode.cuh>
#include <laminar/cuda/sampling.cuh>

namespace cd = laminar::kernels::cuda_detail;
namespace sd = laminar::kernels::sampling_detail;

// laminar's kernels, for this project's dtype and head size.
template __global__ void cd::paged_decode_split_kernel<cd::KvKind::kBF16, 128>(cd::DecodeArgs);
template __global__ void cd::paged_decode_merge_kernel<cd::KvKind::kBF16, 128>(cd::DecodeArgs);
template __global__ void sd::sampling_kernel<sd::LogitKind::kBF16>(laminar::kernels::SamplingParams, std::int64_t);
template __global__ void sd::token_logprob_kernel<sd::LogitKind::kF16>(laminar::kernels::TokenLogprobParams,
                                                                       std::int64_t);
template __global__ void cd::cast_kernel<cd::CastKind::kF32, cd::CastKind::kBF16>(const void*, void*, std::int64_t);

// laminar's device functions inside the project's own kernel: the attention splits of a sequence
// length, and the order key of a logit.
__global__ void consumer_kernel(const std::int32_t* kv_len, const float* logits, std::int32_t* splits,
                                std::uint32_t* keys, int n) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= n) return;
  splits[i] = cd::num_splits(kv_len[i]);
  keys[i] = sd::order_key(logits[i]);
}
