// Engine's device path (engine.h, EngineOptions::device = kCuda): weights in device memory,
// matmuls through cuBLAS, attention and sampling through laminar's CUDA kernels, norms and
// element-wise steps through engine_kernels.cu, all on the engine's own stream.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <utility>
#include <span>
#include <string_view>
#include <vector>

#include "engine.h"
#include "engine_kernels.h"
#include "laminar/kernels/cast.h"
#include "laminar/kernels/paged_decode.h"
#include "laminar/kernels/sampling.h"

namespace async_grpo {
namespace {

using laminar::DType;
using laminar::PagedKvCache;
using laminar::Result;
using laminar::Status;
using laminar::Stream;

Status cuda_status(cudaError_t e, std::string_view what) {
  if (e == cudaSuccess) return laminar::ok_status();
  return laminar::failed_precondition(
      fmt::format("engine: {}: {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

Status blas_status(cublasStatus_t s, std::string_view what) {
  if (s == CUBLAS_STATUS_SUCCESS) return laminar::ok_status();
  return laminar::failed_precondition(
      fmt::format("engine: {}: {} ({})", what, cublasGetStatusName(s), cublasGetStatusString(s)));
}

Status allocation_status(cudaError_t e, std::size_t bytes, std::string_view what) {
  if (e == cudaErrorMemoryAllocation) {
    return laminar::resource_exhausted(fmt::format("engine: {} bytes of device memory for {}", bytes, what));
  }
  return cuda_status(e, what);
}

// Row stride of the activations in floats: every row starts 256-byte aligned, so cuBLAS sees the
// same alignment, and takes the same path, for every row.
std::int64_t padded(std::int64_t n) { return (n + 63) / 64 * 64; }

// Device memory from cudaMalloc, freed with the owner.
struct DeviceMemory {
  void* ptr = nullptr;
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() {
    if (ptr != nullptr) (void)cudaFree(ptr);
  }
  void* release() { return std::exchange(ptr, nullptr); }
};

// Zeroed scratch of one pass, stream-ordered, freed on the stream with the owner. Keeps the first
// error, so a pass allocates everything and checks once.
class Scratch {
 public:
  explicit Scratch(cudaStream_t stream) : stream_(stream) {}
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    for (void* p : ptrs_) (void)cudaFreeAsync(p, stream_);
  }

  template <typename T>
  T* take(std::int64_t n) {
    const std::size_t bytes = std::max<std::size_t>(1, std::size_t(n) * sizeof(T));
    void* p = nullptr;
    if (!status_.ok()) return nullptr;
    if (cudaError_t e = cudaMallocAsync(&p, bytes, stream_); e != cudaSuccess) {
      status_ = allocation_status(e, bytes, "pass scratch");
      return nullptr;
    }
    ptrs_.push_back(p);
    if (cudaError_t e = cudaMemsetAsync(p, 0, bytes, stream_); e != cudaSuccess) status_ = cuda_status(e, "memset");
    return static_cast<T*>(p);
  }
  // A device copy of host data (null when absent).
  template <typename T>
  T* copy(const T* host, std::int64_t n) {
    if (host == nullptr) return nullptr;
    T* p = take<T>(n);
    if (p != nullptr && n > 0) {
      if (cudaError_t e = cudaMemcpyAsync(p, host, std::size_t(n) * sizeof(T), cudaMemcpyHostToDevice, stream_);
          e != cudaSuccess) {
        status_ = cuda_status(e, "copy to the device");
      }
    }
    return p;
  }
  const Status& status() const { return status_; }

 private:
  cudaStream_t stream_;
  std::vector<void*> ptrs_;
  Status status_;
};

}  // namespace

struct Engine::Cuda {
  std::int32_t ordinal = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  float* weights = nullptr;  // [manifest total_bytes / 4] the last weights found valid
  std::size_t weight_bytes = 0;
  std::mutex mu;  // one call at a time on the stream and the handle

  ~Cuda() {
    if (blas != nullptr) (void)cublasDestroy(blas);
    if (weights != nullptr) (void)cudaFree(weights);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
};

void Engine::CudaDeleter::operator()(Cuda* cuda) const noexcept { delete cuda; }

Result<std::unique_ptr<Engine::Cuda, Engine::CudaDeleter>> Engine::create_cuda(std::int32_t ordinal,
                                                                                std::size_t weight_bytes) {
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    return laminar::failed_precondition(fmt::format("device kCuda needs a CUDA device: cudaGetDeviceCount: {} ({})",
                                                    cudaGetErrorName(e), cudaGetErrorString(e)));
  }
  if (ordinal >= count) {
    return laminar::failed_precondition(
        fmt::format("device kCuda: cuda_device {} but this machine has {} CUDA devices", ordinal, count));
  }
  std::unique_ptr<Cuda, CudaDeleter> c(new Cuda);
  c->ordinal = ordinal;
  c->weight_bytes = weight_bytes;
  LAMINAR_RETURN_IF_ERROR(cuda_status(cudaSetDevice(ordinal), "cudaSetDevice"));
  LAMINAR_RETURN_IF_ERROR(
      cuda_status(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"));
  LAMINAR_RETURN_IF_ERROR(allocation_status(cudaMalloc(reinterpret_cast<void**>(&c->weights), weight_bytes),
                                            weight_bytes, "the weights"));
  LAMINAR_RETURN_IF_ERROR(cuda_status(cudaMemset(c->weights, 0, weight_bytes), "cudaMemset"));
  LAMINAR_RETURN_IF_ERROR(blas_status(cublasCreate(&c->blas), "cublasCreate"));
  LAMINAR_RETURN_IF_ERROR(blas_status(cublasSetStream(c->blas, c->stream), "cublasSetStream"));
  // The precision each call prescribes, with no TF32 (not even under NVIDIA_TF32_OVERRIDE).
  LAMINAR_RETURN_IF_ERROR(blas_status(cublasSetMathMode(c->blas, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode"));
  // No atomics: a gemv's sums then come in the same order on every run.
  LAMINAR_RETURN_IF_ERROR(
      blas_status(cublasSetAtomicsMode(c->blas, CUBLAS_ATOMICS_NOT_ALLOWED), "cublasSetAtomicsMode"));
  return c;
}

Status Engine::upload_weights() {
  std::lock_guard lock(cuda_->mu);
  LAMINAR_RETURN_IF_ERROR(cuda_status(cudaSetDevice(cuda_->ordinal), "cudaSetDevice"));
  LAMINAR_RETURN_IF_ERROR(cuda_status(
      cudaMemcpyAsync(cuda_->weights, weights_.data(), cuda_->weight_bytes, cudaMemcpyHostToDevice, cuda_->stream),
      "copying the weights to the device"));
  return cuda_status(cudaStreamSynchronize(cuda_->stream), "copying the weights to the device");
}

Result<std::shared_ptr<PagedKvCache>> Engine::make_device_cache(const laminar::KvLayout& layout) const {
  LAMINAR_RETURN_IF_ERROR(cuda_status(cudaSetDevice(cuda_->ordinal), "cudaSetDevice"));
  const std::size_t bytes = std::size_t(layout.pool_bytes());
  DeviceMemory k, v;
  LAMINAR_RETURN_IF_ERROR(allocation_status(cudaMalloc(&k.ptr, bytes), bytes, "the K pool"));
  LAMINAR_RETURN_IF_ERROR(allocation_status(cudaMalloc(&v.ptr, bytes), bytes, "the V pool"));
  LAMINAR_RETURN_IF_ERROR(cuda_status(cudaMemset(k.ptr, 0, bytes), "cudaMemset"));
  LAMINAR_RETURN_IF_ERROR(cuda_status(cudaMemset(v.ptr, 0, bytes), "cudaMemset"));
  const std::int64_t shape[] = {layout.num_layers, layout.num_pages, layout.page_size, layout.num_kv_heads,
                                layout.head_dim};
  const laminar::Device device = laminar::Device::cuda(cuda_->ordinal);
  Result<laminar::TensorView> k_view = laminar::TensorView::contiguous(k.ptr, layout.dtype, shape, device);
  Result<laminar::TensorView> v_view = laminar::TensorView::contiguous(v.ptr, layout.dtype, shape, device);
  if (!k_view.ok()) return k_view.status().with_context("engine make_cache");
  if (!v_view.ok()) return v_view.status().with_context("engine make_cache");
  Result<PagedKvCache> cache = PagedKvCache::create(layout, *k_view, *v_view);
  if (!cache.ok()) return cache.status().with_context("engine make_cache");
  // The cache adopts the pools; they go with it.
  return std::shared_ptr<PagedKvCache>(new PagedKvCache(std::move(*cache)),
                                       [k_pool = k.release(), v_pool = v.release()](PagedKvCache* c) {
                                         delete c;
                                         (void)cudaFree(k_pool);
                                         (void)cudaFree(v_pool);
                                       });
}

Status Engine::forward_cuda(PagedKvCache& cache, const Pass& pass, const LogitsUse& use) const {
  Cuda& c = *cuda_;
  std::lock_guard lock(c.mu);
  LAMINAR_RETURN_IF_ERROR(cuda_status(cudaSetDevice(c.ordinal), "cudaSetDevice"));
  const cudaStream_t stream = c.stream;
  const Stream on_stream = Stream::cuda(stream);
  const DType dtype = cache.layout().dtype;
  const std::size_t elem = laminar::dtype_size(dtype);
  const std::int64_t rows = std::int64_t(pass.tokens.size());
  const std::int64_t n = std::int64_t(pass.logit_rows.size());
  const std::int64_t d = config_.d_model, ff = config_.d_ff, vocab = config_.vocab;
  // qd and kd are multiples of head_dim (64 or 128): their rows are aligned as they are.
  const std::int64_t qd = std::int64_t(config_.num_qo_heads) * config_.head_dim;
  const std::int64_t kd = std::int64_t(config_.num_kv_heads) * config_.head_dim;
  const std::int64_t ld = padded(d), ldf = padded(ff), ldv = padded(vocab);
  const float eps = config_.rms_eps;
  auto dw = [&](std::size_t entry) { return c.weights + manifest_.entries()[entry].offset / sizeof(float); };

  // The pass on the host: positions, every row's K/V slot, the page table.
  std::vector<std::int32_t> position, qo_indptr{0};  // [rows], [batch + 1]
  std::vector<std::int64_t> slot;                    // [rows] page * page_size + offset
  std::int32_t max_kv_len = 0;
  for (std::size_t b = 0; b < pass.ids.size(); ++b) {
    for (std::int32_t j = 0; j < pass.count[b]; ++j) {
      Result<PagedKvCache::TokenSlot> at = cache.token_slot(pass.ids[b], pass.start[b] + j, 0);
      LAMINAR_RETURN_IF_ERROR(at.status());
      position.push_back(std::int32_t(pass.start[b] + j));
      slot.push_back(std::int64_t(at->page) * cache.layout().page_size + at->offset);
    }
    qo_indptr.push_back(qo_indptr.back() + pass.count[b]);
    max_kv_len = std::max(max_kv_len, std::int32_t(pass.start[b] + pass.count[b]));
  }
  laminar::PageTableBuffer table;
  LAMINAR_RETURN_IF_ERROR(cache.build_page_table(pass.ids, &table));

  Scratch s(stream);
  const std::int32_t* token = s.copy(pass.tokens.data(), rows);
  const std::int32_t* pos = s.copy(position.data(), rows);
  const std::int64_t* slots = s.copy(slot.data(), rows);
  const std::int32_t* indptr = s.copy(table.indptr.data(), std::int64_t(table.indptr.size()));
  const std::int32_t* indices = s.copy(table.indices.data(), std::int64_t(table.indices.size()));
  const std::int32_t* last = s.copy(table.last_page_len.data(), std::int64_t(table.last_page_len.size()));
  const std::int32_t* qo = s.copy(qo_indptr.data(), std::int64_t(qo_indptr.size()));
  const std::int64_t* logit_rows = s.copy(pass.logit_rows.data(), n);
  float* x = s.take<float>(rows * ld);       // [rows, ld] the residual stream
  float* h = s.take<float>(rows * ld);       // [rows, ld] normed residual
  float* delta = s.take<float>(rows * ld);   // [rows, ld]
  float* q = s.take<float>(rows * qd);       // [rows, num_qo_heads, head_dim]
  float* k = s.take<float>(rows * kd);       // [rows, num_kv_heads, head_dim]
  float* v = s.take<float>(rows * kd);       // [rows, num_kv_heads, head_dim]
  float* attn = s.take<float>(rows * qd);    // [rows, num_qo_heads, head_dim]
  float* gate = s.take<float>(rows * ldf);   // [rows, ldf]
  float* up = s.take<float>(rows * ldf);     // [rows, ldf]
  float* logits = s.take<float>(n * ldv);    // [n, ldv]
  // q, K, V and the attention output in the cache's dtype (f16 / bf16 caches).
  void* q_c = dtype == DType::kF32 ? nullptr : s.take<unsigned char>(rows * qd * std::int64_t(elem));
  void* out_c = dtype == DType::kF32 ? nullptr : s.take<unsigned char>(rows * qd * std::int64_t(elem));
  void* k_c = dtype == DType::kF32 ? nullptr : s.take<unsigned char>(rows * kd * std::int64_t(elem));
  void* v_c = dtype == DType::kF32 ? nullptr : s.take<unsigned char>(rows * kd * std::int64_t(elem));

  laminar::kernels::PagedDecodeParams p;
  p.q = dtype == DType::kF32 ? static_cast<const void*>(q) : q_c;
  p.out = dtype == DType::kF32 ? static_cast<void*>(attn) : out_c;
  p.table = {indptr, indices, last, std::int32_t(table.last_page_len.size())};
  p.qo_indptr = qo;
  p.num_rows = std::int32_t(rows);
  p.num_qo_heads = config_.num_qo_heads;
  p.sm_scale = 1.0f / std::sqrt(float(config_.head_dim));
  p.max_kv_len = max_kv_len;
  Result<laminar::PagedKv> view0 = cache.view(0);
  LAMINAR_RETURN_IF_ERROR(view0.status());
  p.kv = *view0;
  p.workspace_bytes = laminar::kernels::workspace_bytes(p);
  p.workspace = s.take<unsigned char>(std::int64_t(p.workspace_bytes));
  LAMINAR_RETURN_IF_ERROR(s.status());

  const float one = 1.0f, zero = 0.0f;
  // y[r, :out] = w [out, in] x[r, :in] for r < count: one gemv per row, the same call for every row,
  // so a row's bits never depend on how many rows the pass has.
  auto matmul = [&](const float* w, std::int64_t in, std::int64_t out, const float* xs, std::int64_t ldx, float* ys,
                    std::int64_t ldy, std::int64_t count) -> Status {
    for (std::int64_t r = 0; r < count; ++r) {
      LAMINAR_RETURN_IF_ERROR(blas_status(cublasSgemv(c.blas, CUBLAS_OP_T, int(in), int(out), &one, w, int(in),
                                                      xs + r * ldx, 1, &zero, ys + r * ldy, 1),
                                          "cublasSgemv"));
    }
    return laminar::ok_status();
  };
  auto cast = [&](const void* src, DType from, void* dst, DType to, std::int64_t count) {
    laminar::kernels::CastParams cp;
    cp.src = src;
    cp.src_dtype = from;
    cp.dst = dst;
    cp.dst_dtype = to;
    cp.n = count;
    return laminar::kernels::run(cp, on_stream);
  };

  LAMINAR_RETURN_IF_ERROR(cuda_status(cuda::embed(dw(0), dw(1), token, pos, rows, d, ld, x, stream), "embed"));
  for (std::int32_t l = 0; l < config_.num_layers; ++l) {
    // Manifest order: embed, pos_embed, then nine tensors per layer.
    const std::size_t w = 2 + 9 * std::size_t(l);
    LAMINAR_RETURN_IF_ERROR(
        cuda_status(cuda::rms_norm(x, ld, nullptr, rows, dw(w), d, eps, h, ld, stream), "rms_norm"));
    LAMINAR_RETURN_IF_ERROR(matmul(dw(w + 1), d, qd, h, ld, q, qd, rows));
    LAMINAR_RETURN_IF_ERROR(matmul(dw(w + 2), d, kd, h, ld, k, kd, rows));
    LAMINAR_RETURN_IF_ERROR(matmul(dw(w + 3), d, kd, h, ld, v, kd, rows));
    const void* k_src = k;
    const void* v_src = v;
    if (dtype != DType::kF32) {
      LAMINAR_RETURN_IF_ERROR(cast(q, DType::kF32, q_c, dtype, rows * qd));
      LAMINAR_RETURN_IF_ERROR(cast(k, DType::kF32, k_c, dtype, rows * kd));
      LAMINAR_RETURN_IF_ERROR(cast(v, DType::kF32, v_c, dtype, rows * kd));
      k_src = k_c;
      v_src = v_c;
    }
    Result<laminar::PagedKv> view = cache.view(l);
    LAMINAR_RETURN_IF_ERROR(view.status());
    LAMINAR_RETURN_IF_ERROR(cuda_status(cuda::store_kv(k_src, v_src, slots, rows, kd, int(elem),
                                                       const_cast<void*>(view->k_pages),
                                                       const_cast<void*>(view->v_pages), stream),
                                        "store_kv"));
    p.kv = *view;
    LAMINAR_RETURN_IF_ERROR(laminar::kernels::run(p, on_stream));
    if (dtype != DType::kF32) LAMINAR_RETURN_IF_ERROR(cast(out_c, dtype, attn, DType::kF32, rows * qd));
    LAMINAR_RETURN_IF_ERROR(matmul(dw(w + 4), qd, d, attn, qd, delta, ld, rows));
    LAMINAR_RETURN_IF_ERROR(cuda_status(cuda::add(x, delta, rows * ld, stream), "add"));
    LAMINAR_RETURN_IF_ERROR(
        cuda_status(cuda::rms_norm(x, ld, nullptr, rows, dw(w + 5), d, eps, h, ld, stream), "rms_norm"));
    LAMINAR_RETURN_IF_ERROR(matmul(dw(w + 6), d, ff, h, ld, gate, ldf, rows));
    LAMINAR_RETURN_IF_ERROR(matmul(dw(w + 7), d, ff, h, ld, up, ldf, rows));
    LAMINAR_RETURN_IF_ERROR(cuda_status(cuda::silu_mul(gate, up, rows * ldf, stream), "silu_mul"));
    LAMINAR_RETURN_IF_ERROR(matmul(dw(w + 8), ff, d, gate, ldf, delta, ld, rows));
    LAMINAR_RETURN_IF_ERROR(cuda_status(cuda::add(x, delta, rows * ld, stream), "add"));
  }
  LAMINAR_RETURN_IF_ERROR(cuda_status(
      cuda::rms_norm(x, ld, logit_rows, n, dw(manifest_.size() - 2), d, eps, h, ld, stream), "rms_norm"));
  LAMINAR_RETURN_IF_ERROR(matmul(dw(manifest_.size() - 1), d, vocab, h, ld, logits, ldv, n));

  struct CopyBack {
    void* host;
    const void* device;
    std::size_t bytes;
  };
  std::vector<CopyBack> results;  // copied back once the kernels are enqueued
  if (use.logits != nullptr && n > 0) {
    LAMINAR_RETURN_IF_ERROR(cuda_status(
        cudaMemcpy2DAsync(use.logits, std::size_t(vocab) * sizeof(float), logits, std::size_t(ldv) * sizeof(float),
                          std::size_t(vocab) * sizeof(float), std::size_t(n), cudaMemcpyDeviceToHost, stream),
        "copying the logits back"));
  } else if (use.sample != nullptr && n > 0) {
    const laminar::kernels::SamplingParams& host = *use.sample;
    laminar::kernels::SamplingParams sp;
    sp.logits = logits;
    sp.logits_dtype = DType::kF32;
    sp.batch = n;
    sp.vocab = vocab;
    sp.row_stride = ldv;
    sp.temperature = s.copy(host.temperature, n);
    sp.top_k = s.copy(host.top_k, n);
    sp.top_p = s.copy(host.top_p, n);
    sp.min_p = s.copy(host.min_p, n);
    sp.seed = s.copy(host.seed, n);
    sp.position = s.copy(host.position, n);
    sp.token = s.take<std::int32_t>(n);
    sp.raw_logprob = host.raw_logprob != nullptr ? s.take<float>(n) : nullptr;
    LAMINAR_RETURN_IF_ERROR(s.status());
    LAMINAR_RETURN_IF_ERROR(laminar::kernels::run(sp, on_stream));
    results.push_back({host.token, sp.token, std::size_t(n) * sizeof(std::int32_t)});
    if (host.raw_logprob != nullptr) results.push_back({host.raw_logprob, sp.raw_logprob, std::size_t(n) * sizeof(float)});
  } else if (use.score != nullptr && n > 0) {
    laminar::kernels::TokenLogprobParams tp;
    tp.logits = logits;
    tp.logits_dtype = DType::kF32;
    tp.batch = n;
    tp.vocab = vocab;
    tp.row_stride = ldv;
    tp.token = s.copy(use.score->token, n);
    tp.logprob = s.take<float>(n);
    LAMINAR_RETURN_IF_ERROR(s.status());
    LAMINAR_RETURN_IF_ERROR(laminar::kernels::run(tp, on_stream));
    results.push_back({use.score->logprob, tp.logprob, std::size_t(n) * sizeof(float)});
  }
  for (const CopyBack& r : results) {
    LAMINAR_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(r.host, r.device, r.bytes, cudaMemcpyDeviceToHost, stream),
                                        "copying the results back"));
  }
  return cuda_status(cudaStreamSynchronize(stream), "the forward pass");
}

}  // namespace async_grpo
