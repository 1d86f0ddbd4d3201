// Launchers of the sampling kernels: the one place where the logits dtype becomes a template
// argument. One block per row; the grid's x dimension covers batches up to 2^31 - 1 rows (can_implement
// refuses more).
#include "laminar/kernels/sampling.h"
#include "launch_status.h"
#include "sampling.cuh"

namespace laminar::kernels::cuda_detail {

namespace {

using sampling_detail::LogitKind;

LogitKind kind_of(DType t) {
  return t == DType::kF32 ? LogitKind::kF32 : t == DType::kF16 ? LogitKind::kF16 : LogitKind::kBF16;
}

constexpr std::size_t kSmem = sizeof(sampling_detail::SharedState);

}  // namespace

Status launch_sampling(const SamplingParams& p, void* stream) {
  if (p.batch == 0) return ok_status();
  auto s = static_cast<cudaStream_t>(stream);
  const std::int64_t stride = p.row_stride == 0 ? p.vocab : p.row_stride;
  const dim3 grid(static_cast<unsigned>(p.batch));
  constexpr int kT = sampling_detail::kThreads;
  switch (kind_of(p.logits_dtype)) {
    case LogitKind::kF32: sampling_detail::sampling_kernel<LogitKind::kF32><<<grid, kT, kSmem, s>>>(p, stride); break;
    case LogitKind::kF16: sampling_detail::sampling_kernel<LogitKind::kF16><<<grid, kT, kSmem, s>>>(p, stride); break;
    case LogitKind::kBF16: sampling_detail::sampling_kernel<LogitKind::kBF16><<<grid, kT, kSmem, s>>>(p, stride); break;
  }
  return launch_status("sample", cudaGetLastError());
}

Status launch_token_logprob(const TokenLogprobParams& p, void* stream) {
  if (p.batch == 0) return ok_status();
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
  return launch_status("token_logprob", cudaGetLastError());
}

}  // namespace laminar::kernels::cuda_detail
