// Launchers of the sampling kernels: the one place where the logits dtype becomes a template
// argument. One block per row; the grid's x dimension covers batches up to 2^31 - 1 rows.
#include <cuda_runtime.h>

#include <string>

#include "laminar/kernels/sampling.h"
#include "sampling.cuh"

namespace laminar::kernels::cuda_detail {

namespace {

using sampling_detail::LogitKind;

LogitKind kind_of(DType t) {
  return t == DType::kF32 ? LogitKind::kF32 : t == DType::kF16 ? LogitKind::kF16 : LogitKind::kBF16;
}

Status launch_status(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return unavailable(std::string(what) + " kernel launch failed: " + cudaGetErrorString(err));
  return ok_status();
}

constexpr std::size_t kSmem = sizeof(sampling_detail::SharedState);

}  // namespace

Status launch_sampling(const SamplingParams& p, void* stream) {
  if (p.batch == 0) return ok_status();
  if (p.batch > 0x7fffffff) return invalid_argument("sample: batch above 2^31 - 1 rows on a CUDA stream");
  auto s = static_cast<cudaStream_t>(stream);
  const std::int64_t stride = p.row_stride == 0 ? p.vocab : p.row_stride;
  const dim3 grid(static_cast<unsigned>(p.batch));
  constexpr int kT = sampling_detail::kThreads;
  switch (kind_of(p.logits_dtype)) {
    case LogitKind::kF32: sampling_detail::sampling_kernel<LogitKind::kF32><<<grid, kT, kSmem, s>>>(p, stride); break;
    case LogitKind::kF16: sampling_detail::sampling_kernel<LogitKind::kF16><<<grid, kT, kSmem, s>>>(p, stride); break;
    case LogitKind::kBF16: sampling_detail::sampling_kernel<LogitKind::kBF16><<<grid, kT, kSmem, s>>>(p, stride); break;
  }
  return launch_status("sampling");
}

Status launch_token_logprob(const TokenLogprobParams& p, void* stream) {
  if (p.batch == 0) return ok_status();
  if (p.batch > 0x7fffffff) return invalid_argument("token_logprob: batch above 2^31 - 1 rows on a CUDA stream");
  auto s = static_cast<cudaStream_t>(stream);
  const std::int64_t stride = p.row_stride == 0 ? p.vocab : p.row_stride;
  const dim3 grid(static_cast<unsigned>(p.batch));
  constexpr int kT = sampling_detail::kThreads;
  switch (kind_of(p.logits_dtype)) {
    case LogitKind::kF32:
      sampling_detail::token_logprob_kernel<LogitKind::kF32><<<grid, kT, kSmem, s>>>(p, stride);
      break;
    case LogitKind::kF16:
      sampling_detail::token_logprob_kernel<LogitKind::kF16><<<grid, kT, kSmem, s>>>(p, stride);
      break;
    case LogitKind::kBF16:
      sampling_detail::token_logprob_kernel<LogitKind::kBF16><<<grid, kT, kSmem, s>>>(p, stride);
      break;
  }
  return launch_status("token_logprob");
}

}  // namespace laminar::kernels::cuda_detail
