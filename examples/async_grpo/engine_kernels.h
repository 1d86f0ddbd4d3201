// engine_kernels.h: the device engine's own element-wise and per-row kernels (engine_kernels.cu),
// the parts of the forward pass that are neither a matmul (cuBLAS) nor attention or sampling
// (laminar's kernels). Every row is computed by the same code whatever the rows around it, in the
// host engine's order where the host sums: rms_norm sums a row on one thread in index order, so
// with --fmad=false its bits are the host's.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace async_grpo::cuda {

// x[r, :d] = embed[token[r], :] + pos_embed[position[r], :] for r < rows.
//   embed [vocab, d], pos_embed [max_positions, d], token [rows], position [rows], x [rows, ld]
cudaError_t embed(const float* embed, const float* pos_embed, const std::int32_t* token,
                  const std::int32_t* position, std::int64_t rows, std::int64_t d, std::int64_t ld, float* x,
                  cudaStream_t stream);

// out[i, :n] = rms_norm(x[src_i, :n], g) with src_i = row[i] (row null: i), for i < rows.
//   x [*, ld_x], row [rows] or null, g [n], out [rows, ld_out]
cudaError_t rms_norm(const float* x, std::int64_t ld_x, const std::int64_t* row, std::int64_t rows, const float* g,
                     std::int64_t n, float eps, float* out, std::int64_t ld_out, cudaStream_t stream);

// gate[i] = silu(gate[i]) * up[i] for i < n.
cudaError_t silu_mul(float* gate, const float* up, std::int64_t n, cudaStream_t stream);

// x[i] += delta[i] for i < n.
cudaError_t add(float* x, const float* delta, std::int64_t n, cudaStream_t stream);

// Writes row r of k and v into token slot slot[r] of one layer's pools, element by element
// (elem_bytes 2 or 4, already the pools' dtype).
//   k, v [rows, row_elems], slot [rows] (page * page_size + offset), k_pool, v_pool [slots, row_elems]
cudaError_t store_kv(const void* k, const void* v, const std::int64_t* slot, std::int64_t rows,
                     std::int64_t row_elems, int elem_bytes, void* k_pool, void* v_pool, cudaStream_t stream);

}  // namespace async_grpo::cuda
