#include "engine_kernels.h"

namespace async_grpo::cuda {
namespace {

constexpr int kThreads = 128;

int blocks_for(std::int64_t n) { return int((n + kThreads - 1) / kThreads); }

__global__ void embed_kernel(const float* embed, const float* pos_embed, const std::int32_t* token,
                             const std::int32_t* position, std::int64_t d, std::int64_t ld, float* x) {
  const std::int64_t r = blockIdx.x;
  const float* e = embed + std::int64_t(token[r]) * d;
  const float* p = pos_embed + std::int64_t(position[r]) * d;
  for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x) x[r * ld + i] = e[i] + p[i];
}

__global__ void rms_norm_kernel(const float* x, std::int64_t ld_x, const std::int64_t* row, const float* g,
                                std::int64_t n, float eps, float* out, std::int64_t ld_out) {
  const std::int64_t i = blockIdx.x;
  const float* xr = x + (row != nullptr ? row[i] : i) * ld_x;
  __shared__ float inv;
  if (threadIdx.x == 0) {
    // One thread, index order: the host engine's sum.
    float sum_sq = 0.0f;
    for (std::int64_t c = 0; c < n; ++c) sum_sq += xr[c] * xr[c];
    inv = 1.0f / sqrtf(sum_sq / float(n) + eps);
  }
  __syncthreads();
  for (std::int64_t c = threadIdx.x; c < n; c += blockDim.x) out[i * ld_out + c] = xr[c] * inv * g[c];
}

__global__ void silu_mul_kernel(float* gate, const float* up, std::int64_t n) {
  const std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

__global__ void add_kernel(float* x, const float* delta, std::int64_t n) {
  const std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] += delta[i];
}

template <typename T>
__global__ void store_kv_kernel(const T* k, const T* v, const std::int64_t* slot, std::int64_t row_elems, T* k_pool,
                                T* v_pool) {
  const std::int64_t r = blockIdx.x;
  const std::int64_t dst = slot[r] * row_elems;
  for (std::int64_t i = threadIdx.x; i < row_elems; i += blockDim.x) {
    k_pool[dst + i] = k[r * row_elems + i];
    v_pool[dst + i] = v[r * row_elems + i];
  }
}

}  // namespace

cudaError_t embed(const float* embed, const float* pos_embed, const std::int32_t* token,
                  const std::int32_t* position, std::int64_t rows, std::int64_t d, std::int64_t ld, float* x,
                  cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  embed_kernel<<<unsigned(rows), kThreads, 0, stream>>>(embed, pos_embed, token, position, d, ld, x);
  return cudaGetLastError();
}

cudaError_t rms_norm(const float* x, std::int64_t ld_x, const std::int64_t* row, std::int64_t rows, const float* g,
                     std::int64_t n, float eps, float* out, std::int64_t ld_out, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  rms_norm_kernel<<<unsigned(rows), kThreads, 0, stream>>>(x, ld_x, row, g, n, eps, out, ld_out);
  return cudaGetLastError();
}

cudaError_t silu_mul(float* gate, const float* up, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  silu_mul_kernel<<<blocks_for(n), kThreads, 0, stream>>>(gate, up, n);
  return cudaGetLastError();
}

cudaError_t add(float* x, const float* delta, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  add_kernel<<<blocks_for(n), kThreads, 0, stream>>>(x, delta, n);
  return cudaGetLastError();
}

cudaError_t store_kv(const void* k, const void* v, const std::int64_t* slot, std::int64_t rows,
                     std::int64_t row_elems, int elem_bytes, void* k_pool, void* v_pool, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (elem_bytes == 4) {
    store_kv_kernel<<<unsigned(rows), kThreads, 0, stream>>>(static_cast<const float*>(k), static_cast<const float*>(v),
                                                             slot, row_elems, static_cast<float*>(k_pool),
                                                             static_cast<float*>(v_pool));
  } else {
    store_kv_kernel<<<unsigned(rows), kThreads, 0, stream>>>(
        static_cast<const unsigned short*>(k), static_cast<const unsigned short*>(v), slot, row_elems,
        static_cast<unsigned short*>(k_pool), static_cast<unsigned short*>(v_pool));
  }
  return cudaGetLastError();
}

}  // namespace async_grpo::cuda
