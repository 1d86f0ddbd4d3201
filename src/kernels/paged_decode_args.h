// The arguments of the paged decode kernels (cuda_detail::DecodeArgs) built from the public
// PagedDecodeParams, with the split-workspace layout they expect. One definition for the CUDA launch,
// the CPU path, and the tests that run the CUDA kernels through cuda/emulation.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "../../cuda/paged_decode.cuh"
#include "laminar/kernels/paged_decode.h"

namespace laminar::kernels::cuda_detail {

// Splits of the longest sequence: the workspace holds this many partials per (row, query head).
inline std::int32_t decode_max_splits(const PagedDecodeParams& p) { return num_splits(std::max(p.max_kv_len, 1)); }

// Workspace floats of one row: o, m and l of every (query head, split).
inline std::size_t decode_row_floats(const PagedDecodeParams& p) {
  return std::size_t(p.num_qo_heads) * std::size_t(decode_max_splits(p)) * std::size_t(p.kv.layout.head_dim + 2);
}

// Preconditions: ws holds decode_row_floats(p) * rows floats.
inline DecodeArgs make_decode_args(const PagedDecodeParams& p, float* ws, std::int32_t rows) {
  DecodeArgs a{};
  a.q = p.q;
  a.out = p.out;
  a.lse = p.lse;
  a.k_pages = p.kv.k_pages;
  a.v_pages = p.kv.v_pages;
  a.indptr = p.table.indptr;
  a.indices = p.table.indices;
  a.last_page_len = p.table.last_page_len;
  a.qo_indptr = p.qo_indptr;
  const std::size_t per_split = std::size_t(rows) * std::size_t(p.num_qo_heads) * std::size_t(decode_max_splits(p));
  a.ws_o = ws;
  a.ws_m = ws + per_split * std::size_t(p.kv.layout.head_dim);
  a.ws_l = a.ws_m + per_split;
  a.batch = p.table.batch;
  a.row_begin = 0;
  a.num_qo_heads = p.num_qo_heads;
  a.num_kv_heads = p.kv.layout.num_kv_heads;
  a.page_size = p.kv.layout.page_size;
  a.max_splits = decode_max_splits(p);
  a.sm_scale = p.sm_scale;
  return a;
}

}  // namespace laminar::kernels::cuda_detail
