// paged_decode.h: attention of new queries over a paged KV cache — decode (one query per sequence,
// at its last position) and causal prefill (several trailing positions of a sequence) — with the
// log-sum-exp of every row, on the host or a CUDA stream.
//
// Rollout workers call it once per decode step for the whole batch; the trainer side (or a
// re-scoring pass) calls it in prefill form over finished trajectories. The design promise is
// bit-for-bit reproducibility: a sequence's output does not depend on its batch mates (the KV is
// cut into splits of a FIXED kSplitTokens tokens, whatever the batch), and a prefill row at
// position t equals the decode step that saw t + 1 tokens. The reduction order (cuda/paged_decode.cuh,
// "Reduction order") is shared by the CPU kernel and the CUDA kernel, so they agree bit for bit.
//
//   laminar::kernels::PagedDecodeParams p;
//   p.q = q;  p.out = out;  p.lse = lse;            // [batch, 32, 128] bf16, [batch, 32] f32
//   p.kv = cache.view(layer).value();               // one layer of a laminar::PagedKvCache
//   p.table = table.view();                         // the same table for every layer
//   p.num_qo_heads = 32;  p.sm_scale = 1.0f / std::sqrt(128.0f);  p.max_kv_len = 32768;
//   laminar::Status st = laminar::kernels::run(p, laminar::Stream::host());
//
// From tensors (DLPack views of an engine's buffers, every shape, dtype, stride and device checked):
//   laminar::kernels::PagedDecodeTensors t{.q = q, .out = out, .k_pages = k, .v_pages = v,
//                                          .indptr = indptr, .indices = indices, .last_page_len = last};
//   auto p = laminar::kernels::PagedDecodeParams::from_tensors(t);
//
// Grouped-query attention: with group = num_qo_heads / num_kv_heads, query head h reads KV head
// h / group (query heads [g * group, (g + 1) * group) share KV head g), as in FlashInfer and vLLM.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "laminar/kv_cache.h"
#include "laminar/status.h"
#include "laminar/types.h"

namespace laminar::kernels {

// KV tokens per split. A constant, never derived from the batch: this is what makes every
// sequence's reduction order depend on its own length only.
inline constexpr std::int32_t kSplitTokens = 256;

struct PagedDecodeTensors;
struct PagedDecodeIndexCopies;

struct PagedDecodeParams {
  // Decode: num_rows = table.batch, row b is sequence b's query at position len_b - 1.
  // Prefill: num_rows = qo_indptr[batch]; rows qo_indptr[b] .. qo_indptr[b + 1] are the last
  // n_b = qo_indptr[b + 1] - qo_indptr[b] positions of sequence b (n_b <= len_b), in order; row i of
  // them attends to the first len_b - n_b + i + 1 tokens (causal).
  const void* q = nullptr;    // [num_rows, num_qo_heads, head_dim] of kv.layout.dtype
  void* out = nullptr;        // [num_rows, num_qo_heads, head_dim] of kv.layout.dtype
  float* lse = nullptr;       // [num_rows, num_qo_heads] natural-log sum of exp(scaled scores); may be null
  PagedKv kv;                 // one layer's pools (layout.num_layers 1); layout.head_dim 64 or 128
  PageTable table;            // one entry per sequence
  const std::int32_t* qo_indptr = nullptr;  // [table.batch + 1] for prefill; null for decode
  std::int32_t num_rows = 0;
  std::int32_t num_qo_heads = 0;  // num_kv_heads * group, group 1, 2, 4 or 8; head h reads KV head h / group
  float sm_scale = 0.0f;          // scores are dot(q, k) * sm_scale; finite and > 0
  std::int32_t max_kv_len = 0;    // >= every sequence's length; sizes the CUDA grid and workspace
  // CUDA only: device scratch of at least workspace_bytes(p) bytes (split partial results).
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  // Host only: worker threads (0 = all hardware threads).
  std::int32_t cpu_threads = 0;

  // Fills every field but cpu_threads from the views (see PagedDecodeTensors), which must all be on
  // the host or all on one CUDA device. i64 index tensors are accepted on the host: they are copied,
  // each value checked to fit int32, into *index_copies, which must then be given and outlive the
  // params. kInvalidArgument naming the tensor and the mismatch.
  static Result<PagedDecodeParams> from_tensors(const PagedDecodeTensors& t,
                                                PagedDecodeIndexCopies* index_copies = nullptr);
};

// The tensors of one paged attention call. Every tensor is dense. Index tensors are i32; i64 (the
// dtype frameworks default to) is accepted on the host only, because on a CUDA device the kernels
// read the page table in place and laminar does not convert device memory behind the caller's back.
struct PagedDecodeTensors {
  TensorView q;                   // [num_rows, num_qo_heads, head_dim] of the pools' dtype
  TensorView out;                 // [num_rows, num_qo_heads, head_dim] of the pools' dtype
  std::optional<TensorView> lse;  // [num_rows, num_qo_heads] f32
  TensorView k_pages;             // [num_pages, page_size, num_kv_heads, head_dim] f32/f16/bf16
  TensorView v_pages;             // [num_pages, page_size, num_kv_heads, head_dim] like k_pages
  TensorView indptr;              // [batch + 1]
  TensorView indices;             // [n] with n >= indptr[batch]
  TensorView last_page_len;       // [batch]
  std::optional<TensorView> qo_indptr;  // [batch + 1]; prefill only
  // CUDA: at least workspace_bytes(params) bytes, any dtype. May be left out and set on the params
  // afterwards, since its size depends on them.
  std::optional<TensorView> workspace;
  std::optional<float> sm_scale;        // default 1 / sqrt(head_dim)
  // Default on the host: the longest sequence of the page table. On a CUDA device the table is in
  // device memory, so a run with rows needs it given.
  std::optional<std::int32_t> max_kv_len;
};

// int32 copies of i64 index tensors given to PagedDecodeParams::from_tensors on the host.
struct PagedDecodeIndexCopies {
  std::vector<std::int32_t> indptr;
  std::vector<std::int32_t> indices;
  std::vector<std::int32_t> last_page_len;
  std::vector<std::int32_t> qo_indptr;
};

// Bytes of workspace a CUDA run needs (0 on the host path, which allocates its own).
std::size_t workspace_bytes(const PagedDecodeParams& p);

// kInvalidArgument naming the field for: a layout of more than one layer, head_dim not 64/128,
// dtype not f32/f16/bf16, group size not 1/2/4/8, null pointers where data is needed, negative
// cpu_threads, non-finite or non-positive sm_scale, negative counts, decode with num_rows != batch.
// On the host the page table (and qo_indptr) is checked too: indices in range, lengths <=
// max_kv_len, prefill rows within their sequences. On a CUDA stream those live in device memory and
// are the caller's responsibility.
Status can_implement(const PagedDecodeParams& p, Stream stream);
// Rows of length 0 give out = 0 and lse = -inf. On Stream::host() runs now on cpu_threads threads;
// on a CUDA stream enqueues the split and merge kernels and returns. kUnimplemented for a CUDA
// stream in a build without CUDA; kFailedPrecondition when no CUDA device or driver takes the launch.
Status run(const PagedDecodeParams& p, Stream stream);

}  // namespace laminar::kernels
