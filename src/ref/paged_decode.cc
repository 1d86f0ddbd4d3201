#include "laminar/ref/paged_decode.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "laminar/internal/numerics.h"

namespace laminar::ref {

namespace {

float load(const void* base, std::int64_t i, DType t) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kF16: return internal::f16_to_f32(static_cast<const std::uint16_t*>(base)[i]);
    default: return internal::bf16_to_f32(static_cast<const std::uint16_t*>(base)[i]);
  }
}

void store(void* base, std::int64_t i, DType t, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(base)[i] = v; break;
    case DType::kF16: static_cast<std::uint16_t*>(base)[i] = internal::f32_to_f16(v); break;
    default: static_cast<std::uint16_t*>(base)[i] = internal::f32_to_bf16(v); break;
  }
}

}  // namespace

Status paged_decode(const kernels::PagedDecodeParams& p) {
  LAMINAR_RETURN_IF_ERROR(kernels::can_implement(p, Stream::host()));
  const KvLayout& l = p.kv.layout;
  const int dim = l.head_dim;
  const int group = p.num_qo_heads / l.num_kv_heads;
  for (std::int32_t row = 0; row < p.num_rows; ++row) {
    // Which sequence this row reads, and how many of its tokens (causal for prefill rows).
    std::int32_t seq = row;
    std::int64_t kv_len = 0;
    if (p.qo_indptr == nullptr) {
      kv_len = sequence_length(p.table, row, l.page_size);
    } else {
      seq = 0;
      while (p.qo_indptr[seq + 1] <= row) ++seq;
      const std::int64_t n = p.qo_indptr[seq + 1] - p.qo_indptr[seq];
      kv_len = sequence_length(p.table, seq, l.page_size) - n + (row - p.qo_indptr[seq]) + 1;
    }
    for (int hq = 0; hq < p.num_qo_heads; ++hq) {
      const int h = hq / group;
      const std::int64_t qrow = (std::int64_t(row) * p.num_qo_heads + hq) * dim;
      // Element offset of token t's K/V row for kv head h.
      auto kv_offset = [&](std::int64_t t) {
        const std::int64_t page = p.table.indices[p.table.indptr[seq] + t / l.page_size];
        return ((page * l.page_size + t % l.page_size) * l.num_kv_heads + h) * dim;
      };
      std::vector<double> scores(static_cast<std::size_t>(kv_len));
      double max_score = -std::numeric_limits<double>::infinity();
      for (std::int64_t t = 0; t < kv_len; ++t) {
        double dot = 0;
        for (int d = 0; d < dim; ++d) dot += double(load(p.q, qrow + d, l.dtype)) * load(p.kv.k_pages, kv_offset(t) + d, l.dtype);
        scores[std::size_t(t)] = dot * p.sm_scale;
        max_score = std::max(max_score, scores[std::size_t(t)]);
      }
      double sum = 0;
      std::vector<double> acc(std::size_t(dim), 0.0);
      for (std::int64_t t = 0; t < kv_len; ++t) {
        const double w = std::exp(scores[std::size_t(t)] - max_score);
        sum += w;
        for (int d = 0; d < dim; ++d) acc[std::size_t(d)] += w * load(p.kv.v_pages, kv_offset(t) + d, l.dtype);
      }
      for (int d = 0; d < dim; ++d) store(p.out, qrow + d, l.dtype, kv_len == 0 ? 0.0f : float(acc[std::size_t(d)] / sum));
      if (p.lse != nullptr) {
        p.lse[std::int64_t(row) * p.num_qo_heads + hq] =
            kv_len == 0 ? -std::numeric_limits<float>::infinity() : float(max_score + std::log(sum));
      }
    }
  }
  return ok_status();
}

}  // namespace laminar::ref
