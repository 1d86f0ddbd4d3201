#include "test_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <unordered_set>
#include <utility>

#include "laminar/kernels/cast.h"
#include "laminar/kernels/paged_decode.h"
#include "laminar/kernels/sampling.h"

namespace laminar::testing {
namespace {

// splitmix64's finaliser: every output bit depends on every input bit.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A value in [-1, 1) from 24 bits of a hash of (seed, index): integer arithmetic and an exact
// conversion, so every process and every standard library makes the same weights.
float uniform(std::uint64_t seed, std::uint64_t index) {
  return float(std::int32_t(mix(mix(seed) + index) >> 40) - (1 << 23)) * 0x1p-23f;
}

// y [rows, out] = x [rows, in] w^T for w [out, in]: each dot product summed in index order by the
// same code whatever the rows around it (this file is compiled without fused multiply-adds).
void matmul(const float* x, std::int64_t rows, std::int64_t in, const float* w, std::int64_t out, float* y) {
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t o = 0; o < out; ++o) {
      float sum = 0.0f;
      for (std::int64_t i = 0; i < in; ++i) sum += x[r * in + i] * w[o * in + i];
      y[r * out + o] = sum;
    }
  }
}

// out = x / sqrt(mean(x^2) + eps), row by row.
void norm(const float* x, std::int64_t rows, std::int64_t n, float* out) {
  for (std::int64_t r = 0; r < rows; ++r) {
    float sum_sq = 0.0f;
    for (std::int64_t i = 0; i < n; ++i) sum_sq += x[r * n + i] * x[r * n + i];
    const float inv = 1.0f / std::sqrt(sum_sq / float(n) + 1e-5f);
    for (std::int64_t i = 0; i < n; ++i) out[r * n + i] = x[r * n + i] * inv;
  }
}

Status cast(const void* src, DType from, void* dst, DType to, std::int64_t n) {
  kernels::CastParams p;
  p.src = src;
  p.src_dtype = from;
  p.dst = dst;
  p.dst_dtype = to;
  p.n = n;
  return kernels::run(p, Stream::host());
}

// Token i of prompt then response.
std::int32_t token_at(const SequenceState& s, std::int64_t i) {
  const auto n = std::int64_t(s.prompt_tokens.size());
  return i < n ? s.prompt_tokens[std::size_t(i)] : s.response_tokens[std::size_t(i - n)];
}

std::int64_t pages_for(std::int64_t tokens, std::int32_t page_size) { return (tokens + page_size - 1) / page_size; }

}  // namespace

TestModel::TestModel(const TestModelConfig& config) : config_(config) {
  const std::int64_t d = config.d_model, q = std::int64_t(config.num_qo_heads) * config.head_dim,
                     kv = std::int64_t(config.num_kv_heads) * config.head_dim;
  const std::int64_t per_layer = 2 * q * d + 2 * kv * d;
  weights_.resize(std::size_t((2 * config.vocab + config.max_positions) * d + config.num_layers * per_layer));
  // Each tensor's uniform values times the gain that keeps unit-variance inputs near unit variance
  // (a uniform value in [-1, 1) has variance 1/3); half gain where a layer adds into the residual,
  // and logits of standard deviation about 2: spread out, not flat, at temperature 0.8.
  const auto gain = [](std::int64_t fan_in) { return std::sqrt(3.0f / float(fan_in)); };
  std::uint64_t index = 0;
  float* w = weights_.data();
  const auto fill = [&](std::int64_t n, float scale) {
    for (std::int64_t i = 0; i < n; ++i) *w++ = scale * uniform(config.seed, index++);
  };
  fill(config.vocab * d, gain(1));
  fill(config.max_positions * d, 0.5f);
  for (std::int32_t l = 0; l < config.num_layers; ++l) {
    fill(q * d, gain(d));
    fill(2 * kv * d, gain(d));
    fill(d * q, 0.5f * gain(q));
  }
  fill(config.vocab * d, 2.0f * gain(d));
}

Result<TestModel> TestModel::create(const TestModelConfig& config) {
  const auto in_range = [](const char* name, std::int64_t v, std::int64_t lo, std::int64_t hi) -> Status {
    if (v < lo || v > hi) {
      return invalid_argument(fmt::format("test model: {} = {} is outside [{}, {}]", name, v, lo, hi));
    }
    return ok_status();
  };
  LAMINAR_RETURN_IF_ERROR(in_range("vocab", config.vocab, 2, 1 << 16));
  LAMINAR_RETURN_IF_ERROR(in_range("num_layers", config.num_layers, 1, 64));
  LAMINAR_RETURN_IF_ERROR(in_range("d_model", config.d_model, 1, 1 << 14));
  LAMINAR_RETURN_IF_ERROR(in_range("num_kv_heads", config.num_kv_heads, 1, 64));
  LAMINAR_RETURN_IF_ERROR(in_range("max_positions", config.max_positions, 2, 1 << 20));
  LAMINAR_RETURN_IF_ERROR(in_range("cpu_threads", config.cpu_threads, 0, 1024));
  if (config.head_dim != 64 && config.head_dim != 128) {
    return invalid_argument(fmt::format("test model: head_dim = {} is not 64 or 128", config.head_dim));
  }
  const std::int32_t group = config.num_qo_heads / config.num_kv_heads;
  if (config.num_qo_heads % config.num_kv_heads != 0 || (group != 1 && group != 2 && group != 4 && group != 8)) {
    return invalid_argument(fmt::format("test model: {} query heads over {} KV heads is not a group of 1, 2, 4 or 8",
                                        config.num_qo_heads, config.num_kv_heads));
  }
  return TestModel(config);
}

KvLayout TestModel::kv_layout(std::int32_t num_pages, std::int32_t page_size, DType dtype) const {
  return {.num_pages = num_pages,
          .page_size = page_size,
          .num_kv_heads = config_.num_kv_heads,
          .head_dim = config_.head_dim,
          .dtype = dtype,
          .num_layers = config_.num_layers};
}

const float* TestModel::pos_embed() const { return embed() + std::int64_t(config_.vocab) * config_.d_model; }

const float* TestModel::layer(std::int32_t l) const {
  const std::int64_t d = config_.d_model, q = std::int64_t(config_.num_qo_heads) * config_.head_dim,
                     kv = std::int64_t(config_.num_kv_heads) * config_.head_dim;
  return pos_embed() + std::int64_t(config_.max_positions) * d + l * (2 * q * d + 2 * kv * d);
}

const float* TestModel::lm_head() const { return layer(config_.num_layers); }

Status TestModel::check(const PagedKvCache& cache, std::span<SequenceState* const> batch, bool prefill) const {
  const char* call = prefill ? "prefill" : "step";
  const KvLayout& layout = cache.layout();
  if (layout.num_layers != config_.num_layers || layout.num_kv_heads != config_.num_kv_heads ||
      layout.head_dim != config_.head_dim || !cache.device().is_host()) {
    return invalid_argument(fmt::format("test model {}: the cache is not a host cache of this model's layout", call));
  }
  std::unordered_set<SequenceId> seen;
  std::int64_t new_pages = 0;
  for (const SequenceState* s : batch) {
    if (s == nullptr) return invalid_argument(fmt::format("test model {}: a null sequence", call));
    const std::uint64_t id = s->sequence.value();
    if (!seen.insert(s->sequence).second) {
      return invalid_argument(fmt::format("test model {}: sequence {} is in the batch twice", call, id));
    }
    const std::int64_t total = total_tokens(*s), kv = std::int64_t(s->kv_length);
    const std::int64_t feeds = prefill ? total : 1;
    if (prefill) {
      if (s->prompt_tokens.empty() || !s->response_tokens.empty() || !s->logprobs.empty() || kv != 0) {
        return invalid_argument(fmt::format("test model prefill: sequence {} needs a prompt, no response and "
                                            "kv_length 0", id));
      }
      if (cache.length(s->sequence).ok()) {
        return already_exists(fmt::format("test model prefill: sequence {} is already in the cache", id));
      }
      new_pages += pages_for(total, layout.page_size);
    } else {
      Result<std::int64_t> length = cache.length(s->sequence);
      if (!length.ok()) return length.status().with_context("test model step");
      if (*length != kv || kv >= total || s->logprobs.size() != s->response_tokens.size()) {
        return invalid_argument(fmt::format(
            "test model step: sequence {} has kv_length {} of {} tokens, {} log-probs for {} response tokens, and "
            "{} tokens in the cache", id, kv, total, s->logprobs.size(), s->response_tokens.size(), *length));
      }
      if (kv % layout.page_size == 0) ++new_pages;
    }
    for (std::int64_t i = kv; i < kv + feeds; ++i) {
      if (token_at(*s, i) < 0 || token_at(*s, i) >= config_.vocab) {
        return invalid_argument(fmt::format("test model {}: sequence {} token {} = {} is outside [0, {})", call, id,
                                            i, token_at(*s, i), config_.vocab));
      }
    }
    if (kv + feeds > config_.max_positions || (kv + feeds == total && total >= config_.max_positions)) {
      return invalid_argument(fmt::format("test model {}: sequence {} has {} tokens, max_positions is {}", call, id,
                                          total, config_.max_positions));
    }
    if (s->rng_position > std::uint64_t(std::numeric_limits<std::int64_t>::max())) {
      return invalid_argument(fmt::format("test model {}: sequence {} rng_position {} exceeds 2^63 - 1", call, id,
                                          s->rng_position));
    }
    const auto position = std::int64_t(s->rng_position);
    kernels::SamplingParams settings;
    settings.batch = 1;
    settings.temperature = &s->temperature;
    settings.top_p = &s->top_p;
    settings.top_k = &s->top_k;
    settings.position = &position;
    if (Status st = kernels::check_row_settings(settings); !st.ok()) {
      return st.with_context(fmt::format("test model {}: sequence {}", call, id));
    }
  }
  if (new_pages > cache.free_pages()) {
    return resource_exhausted(fmt::format("test model {}: the batch needs {} new pages, the cache has {} free", call,
                                          new_pages, cache.free_pages()));
  }
  return ok_status();
}

Status TestModel::prefill(PagedKvCache& cache, SequenceState& seq) const {
  SequenceState* batch[] = {&seq};
  LAMINAR_RETURN_IF_ERROR(check(cache, batch, /*prefill=*/true));
  const auto count = std::int32_t(seq.prompt_tokens.size());
  Status st = cache.add_sequence(seq.sequence);
  if (st.ok()) st = cache.append_tokens(seq.sequence, count);
  if (st.ok()) st = forward(cache, batch, std::span(&count, 1));
  if (!st.ok()) {
    (void)cache.release(seq.sequence);
    return st.with_context("test model prefill");
  }
  seq.kv_length = std::uint64_t(count);
  return ok_status();
}

Status TestModel::step(PagedKvCache& cache, std::span<SequenceState* const> batch) const {
  LAMINAR_RETURN_IF_ERROR(check(cache, batch, /*prefill=*/false));
  for (SequenceState* s : batch) LAMINAR_RETURN_IF_ERROR(cache.append_tokens(s->sequence, 1));
  LAMINAR_RETURN_IF_ERROR(forward(cache, batch, std::vector<std::int32_t>(batch.size(), 1)));
  for (SequenceState* s : batch) ++s->kv_length;
  return ok_status();
}

Status TestModel::forward(PagedKvCache& cache, std::span<SequenceState* const> batch,
                          std::span<const std::int32_t> count) const {
  if (batch.empty()) return ok_status();
  const DType dtype = cache.layout().dtype;
  const std::int64_t d = config_.d_model, qd = std::int64_t(config_.num_qo_heads) * config_.head_dim,
                     kd = std::int64_t(config_.num_kv_heads) * config_.head_dim;
  std::vector<SequenceId> ids;
  std::vector<std::int32_t> qo_indptr{0};  // [batch + 1]
  std::vector<std::int64_t> sample_rows;   // the last row of each sequence that samples
  std::vector<SequenceState*> sampling;
  std::int32_t max_kv_len = 0;
  for (std::size_t b = 0; b < batch.size(); ++b) {
    const SequenceState& s = *batch[b];
    ids.push_back(s.sequence);
    qo_indptr.push_back(qo_indptr.back() + count[b]);
    max_kv_len = std::max(max_kv_len, std::int32_t(s.kv_length) + count[b]);
    if (std::int64_t(s.kv_length) + count[b] == total_tokens(s)) {
      sample_rows.push_back(qo_indptr.back() - 1);
      sampling.push_back(batch[b]);
    }
  }
  const std::int64_t rows = qo_indptr.back();
  std::vector<float> x(std::size_t(rows * d));  // [rows, d_model]: the residual stream
  for (std::size_t b = 0, r = 0; b < batch.size(); ++b) {
    for (std::int32_t j = 0; j < count[b]; ++j, ++r) {
      const std::int64_t position = std::int64_t(batch[b]->kv_length) + j;
      const float* e = embed() + std::int64_t(token_at(*batch[b], position)) * d;
      const float* p = pos_embed() + position * d;
      for (std::int64_t i = 0; i < d; ++i) x[r * std::size_t(d) + std::size_t(i)] = e[i] + p[i];
    }
  }
  PageTableBuffer table;
  LAMINAR_RETURN_IF_ERROR(cache.build_page_table(ids, &table));

  const std::size_t elem = dtype_size(dtype);
  std::vector<float> h(x.size());                    // [rows, d_model]
  std::vector<float> q(std::size_t(rows * qd));      // [rows, num_qo_heads, head_dim]
  std::vector<float> kv(std::size_t(rows * 2 * kd)); // [rows, K then V of num_kv_heads, head_dim]
  std::vector<float> attn(q.size());                 // [rows, num_qo_heads, head_dim]
  std::vector<float> delta(x.size());                // [rows, d_model]
  std::vector<unsigned char> q_cache(q.size() * elem), out_cache(q.size() * elem);  // in the cache's dtype
  for (std::int32_t l = 0; l < config_.num_layers; ++l) {
    const float* wq = layer(l);
    const float* wkv = wq + qd * d;  // wk then wv: [2 * kv_dim, d_model]
    const float* wo = wkv + 2 * kd * d;
    norm(x.data(), rows, d, h.data());
    matmul(h.data(), rows, d, wq, qd, q.data());
    matmul(h.data(), rows, d, wkv, 2 * kd, kv.data());
    for (std::size_t b = 0, r = 0; b < batch.size(); ++b) {
      for (std::int32_t j = 0; j < count[b]; ++j, ++r) {
        auto slot = cache.token_slot(batch[b]->sequence, std::int64_t(batch[b]->kv_length) + j, l);
        LAMINAR_RETURN_IF_ERROR(slot.status());
        LAMINAR_RETURN_IF_ERROR(cast(&kv[r * 2 * std::size_t(kd)], DType::kF32, slot->k, dtype, kd));
        LAMINAR_RETURN_IF_ERROR(cast(&kv[(r * 2 + 1) * std::size_t(kd)], DType::kF32, slot->v, dtype, kd));
      }
    }
    LAMINAR_RETURN_IF_ERROR(cast(q.data(), DType::kF32, q_cache.data(), dtype, rows * qd));
    Result<PagedKv> view = cache.view(l);
    LAMINAR_RETURN_IF_ERROR(view.status());
    kernels::PagedDecodeParams p;
    p.q = q_cache.data();
    p.out = out_cache.data();
    p.kv = *view;
    p.table = table.view();
    p.qo_indptr = qo_indptr.data();
    p.num_rows = std::int32_t(rows);
    p.num_qo_heads = config_.num_qo_heads;
    p.sm_scale = 1.0f / std::sqrt(float(config_.head_dim));
    p.max_kv_len = max_kv_len;
    p.cpu_threads = config_.cpu_threads;
    LAMINAR_RETURN_IF_ERROR(kernels::run(p, Stream::host()));
    LAMINAR_RETURN_IF_ERROR(cast(out_cache.data(), dtype, attn.data(), DType::kF32, rows * qd));
    matmul(attn.data(), rows, qd, wo, d, delta.data());
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += delta[i];
  }
  if (sampling.empty()) return ok_status();

  const auto n = std::int64_t(sampling.size());
  std::vector<float> last(std::size_t(n * d));                 // [n, d_model]
  std::vector<float> logits(std::size_t(n * config_.vocab));  // [n, vocab]
  for (std::int64_t i = 0; i < n; ++i) norm(&x[std::size_t(sample_rows[std::size_t(i)] * d)], 1, d, &last[i * d]);
  matmul(last.data(), n, d, lm_head(), config_.vocab, logits.data());
  std::vector<float> temperature, top_p;
  std::vector<std::int32_t> top_k, token(sampling.size());
  std::vector<std::uint64_t> seed;
  std::vector<std::int64_t> position;
  std::vector<float> logprob(sampling.size());
  for (const SequenceState* s : sampling) {
    temperature.push_back(s->temperature);
    top_p.push_back(s->top_p);
    top_k.push_back(s->top_k);
    seed.push_back(s->seed);
    position.push_back(std::int64_t(s->rng_position));
  }
  kernels::SamplingParams p;
  p.logits = logits.data();
  p.logits_dtype = DType::kF32;
  p.batch = n;
  p.vocab = config_.vocab;
  p.temperature = temperature.data();
  p.top_p = top_p.data();
  p.top_k = top_k.data();
  p.seed = seed.data();
  p.position = position.data();
  p.token = token.data();
  p.raw_logprob = logprob.data();
  p.cpu_threads = config_.cpu_threads;
  LAMINAR_RETURN_IF_ERROR(kernels::run(p, Stream::host()));
  for (std::size_t i = 0; i < sampling.size(); ++i) {
    // The weights are finite and the logits normed: every row has a distribution.
    LAMINAR_CHECK(token[i] != kernels::kInvalidToken);
    sampling[i]->response_tokens.push_back(token[i]);
    sampling[i]->logprobs.push_back(logprob[i]);
    ++sampling[i]->rng_position;
  }
  return ok_status();
}

SequenceState start_sequence(SequenceId id, std::vector<std::int32_t> prompt, std::uint64_t seed, float temperature,
                             float top_p) {
  SequenceState s;
  s.sequence = id;
  s.trajectory = TrajectoryId(id.value());
  s.temperature = temperature;
  s.top_p = top_p;
  s.seed = seed;
  s.rng_position = prompt.size();
  s.prompt_tokens = std::move(prompt);
  return s;
}

}  // namespace laminar::testing
