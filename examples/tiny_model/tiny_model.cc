#include "tiny_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_set>
#include <utility>

#include "laminar/kernels/cast.h"
#include "laminar/kernels/paged_decode.h"
#include "laminar/kernels/sampling.h"

namespace tiny_model {
namespace {

using laminar::DType;
using laminar::PagedKvCache;
using laminar::Result;
using laminar::SequenceId;
using laminar::SequenceState;
using laminar::Status;
using laminar::Stream;

// splitmix64's finaliser: every output bit depends on every input bit.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A value in [-1, 1) from 24 bits of a hash of (seed, stream, index): integer arithmetic and an
// exact conversion, so every process and every standard library makes the same weights.
float uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  const std::uint64_t h = mix(mix(seed ^ mix(stream)) + index);
  return float(std::int32_t(h >> 40) - (1 << 23)) * 0x1p-23f;
}

// [rows, cols] of uniform values in [-scale, scale).
std::vector<float> random_matrix(std::uint64_t seed, std::uint64_t stream, std::int64_t rows, std::int64_t cols,
                                 float scale) {
  std::vector<float> w(std::size_t(rows * cols));
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = scale * uniform(seed, stream, i);
  return w;
}

// The scale that keeps unit-variance inputs at unit variance through a sum of fan_in products (a
// uniform value in [-1, 1) has variance 1/3).
float unit_gain(std::int64_t fan_in) { return std::sqrt(3.0f / float(fan_in)); }

// Tensor streams of the hash: one per weight matrix.
constexpr std::uint64_t kEmbeddingStream = 1;
constexpr std::uint64_t kPositionStream = 2;
constexpr std::uint64_t kUnembeddingStream = 3;
constexpr std::uint64_t layer_stream(std::int32_t layer, std::uint64_t which) {
  return 16 + 4 * std::uint64_t(layer) + which;
}

// y[r] = sum over c of w[r, c] * x[c], summed in c order whatever the batch: this fixed order is
// what keeps a row's bits independent of its batch mates.
void matvec(const std::vector<float>& w, const float* x, std::int64_t rows, std::int64_t cols, float* y) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* wr = w.data() + r * cols;
    float acc = 0.0f;
    for (std::int64_t c = 0; c < cols; ++c) acc += wr[c] * x[c];
    y[r] = acc;
  }
}

void rms_norm(const float* x, std::int64_t n, float* out) {
  float sum_sq = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) sum_sq += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum_sq / float(n) + 1e-5f);
  for (std::int64_t i = 0; i < n; ++i) out[i] = x[i] * inv;
}

Status convert(const void* src, DType from, void* dst, DType to, std::int64_t n) {
  laminar::kernels::CastParams c;
  c.src = src;
  c.src_dtype = from;
  c.dst = dst;
  c.dst_dtype = to;
  c.n = n;
  return laminar::kernels::run(c, Stream::host());
}

// The token a sequence feeds next: index kv_length of its prompt followed by its response.
std::int32_t next_input(const SequenceState& s) {
  const std::size_t next = std::size_t(s.kv_length);
  return next < s.prompt_tokens.size() ? s.prompt_tokens[next] : s.response_tokens[next - s.prompt_tokens.size()];
}

bool valid_group(std::int32_t group) { return group == 1 || group == 2 || group == 4 || group == 8; }

}  // namespace

Result<TinyModel> TinyModel::create(const TinyModelConfig& config) {
  const auto in_range = [](const char* name, std::int64_t v, std::int64_t lo, std::int64_t hi) -> Status {
    if (v < lo || v > hi) {
      return laminar::invalid_argument(fmt::format("tiny model: {} = {} is outside [{}, {}]", name, v, lo, hi));
    }
    return laminar::ok_status();
  };
  LAMINAR_RETURN_IF_ERROR(in_range("vocab", config.vocab, 2, 1 << 16));
  LAMINAR_RETURN_IF_ERROR(in_range("num_layers", config.num_layers, 1, 64));
  LAMINAR_RETURN_IF_ERROR(in_range("d_model", config.d_model, 1, 1 << 14));
  LAMINAR_RETURN_IF_ERROR(in_range("num_kv_heads", config.num_kv_heads, 1, 64));
  LAMINAR_RETURN_IF_ERROR(in_range("cpu_threads", config.cpu_threads, 0, 1024));
  if (config.head_dim != 64 && config.head_dim != 128) {
    return laminar::invalid_argument(fmt::format("tiny model: head_dim = {} is not 64 or 128", config.head_dim));
  }
  if (config.num_qo_heads % config.num_kv_heads != 0 || !valid_group(config.num_qo_heads / config.num_kv_heads)) {
    return laminar::invalid_argument(fmt::format(
        "tiny model: num_qo_heads = {} is not 1, 2, 4 or 8 times num_kv_heads = {}", config.num_qo_heads,
        config.num_kv_heads));
  }

  TinyModel m(config);
  const std::int64_t d = config.d_model;
  const std::int64_t qd = std::int64_t(config.num_qo_heads) * config.head_dim;
  const std::int64_t kd = std::int64_t(config.num_kv_heads) * config.head_dim;
  m.embedding_ = random_matrix(config.seed, kEmbeddingStream, config.vocab, d, unit_gain(1));
  m.layers_.resize(std::size_t(config.num_layers));
  for (std::int32_t l = 0; l < config.num_layers; ++l) {
    Layer& layer = m.layers_[std::size_t(l)];
    layer.wq = random_matrix(config.seed, layer_stream(l, 0), qd, d, unit_gain(d));
    layer.wk = random_matrix(config.seed, layer_stream(l, 1), kd, d, unit_gain(d));
    layer.wv = random_matrix(config.seed, layer_stream(l, 2), kd, d, unit_gain(d));
    // Half gain: each layer nudges the residual stream rather than replacing it.
    layer.wo = random_matrix(config.seed, layer_stream(l, 3), d, qd, 0.5f * unit_gain(qd));
  }
  // Logits of standard deviation about 2: a spread out but not flat distribution at temperature 0.8.
  m.unembedding_ = random_matrix(config.seed, kUnembeddingStream, config.vocab, d, 2.0f * unit_gain(d));
  return m;
}

laminar::KvLayout TinyModel::kv_layout(std::int32_t num_pages, std::int32_t page_size, DType dtype) const {
  return {.num_pages = num_pages,
          .page_size = page_size,
          .num_kv_heads = config_.num_kv_heads,
          .head_dim = config_.head_dim,
          .dtype = dtype,
          .num_layers = config_.num_layers};
}

void TinyModel::embed(std::int32_t token, std::int64_t position, float* x) const {
  const std::int64_t d = config_.d_model;
  const float* e = embedding_.data() + std::int64_t(token) * d;
  // A hashed position embedding rather than a table: any position, nothing to size.
  for (std::int64_t i = 0; i < d; ++i) {
    x[i] = e[i] + 0.5f * uniform(config_.seed, kPositionStream, std::uint64_t(position * d + i));
  }
}

Status TinyModel::check(const PagedKvCache& cache, std::span<SequenceState* const> batch) const {
  const laminar::KvLayout& layout = cache.layout();
  if (layout.num_layers != config_.num_layers || layout.num_kv_heads != config_.num_kv_heads ||
      layout.head_dim != config_.head_dim) {
    return laminar::invalid_argument(fmt::format(
        "tiny model step: the cache holds {} layers x {} KV heads x head_dim {}, the model needs {} x {} x {}",
        layout.num_layers, layout.num_kv_heads, layout.head_dim, config_.num_layers, config_.num_kv_heads,
        config_.head_dim));
  }
  if (!cache.device().is_host()) {
    return laminar::invalid_argument(
        fmt::format("tiny model step: the cache is on {}, the model runs on the host", to_string(cache.device())));
  }
  std::unordered_set<SequenceId> seen;
  std::int64_t new_pages = 0;
  for (std::size_t b = 0; b < batch.size(); ++b) {
    if (batch[b] == nullptr) return laminar::invalid_argument(fmt::format("tiny model step: batch[{}] is null", b));
    const SequenceState& s = *batch[b];
    const std::uint64_t id = s.sequence.value();
    if (!seen.insert(s.sequence).second) {
      return laminar::invalid_argument(fmt::format("tiny model step: sequence {} is in the batch twice", id));
    }
    Result<std::int64_t> len = cache.length(s.sequence);
    if (!len.ok()) return len.status().with_context("tiny model step");
    if (std::uint64_t(*len) != s.kv_length) {
      return laminar::invalid_argument(fmt::format(
          "tiny model step: sequence {} has kv_length {} but {} tokens in the cache", id, s.kv_length, *len));
    }
    if (std::int64_t(s.kv_length) >= total_tokens(s)) {
      return laminar::invalid_argument(fmt::format(
          "tiny model step: sequence {} has no token to feed (kv_length {} of {} tokens)", id, s.kv_length,
          total_tokens(s)));
    }
    if (s.kv_length >= std::uint64_t(std::numeric_limits<std::int32_t>::max())) {
      return laminar::invalid_argument(
          fmt::format("tiny model step: sequence {} is too long for the kernels ({} tokens)", id, s.kv_length));
    }
    if (s.logprobs.size() != s.response_tokens.size()) {
      return laminar::invalid_argument(fmt::format("tiny model step: sequence {} has {} log-probs for {} response "
                                                   "tokens", id, s.logprobs.size(), s.response_tokens.size()));
    }
    const std::int32_t token = next_input(s);
    if (token < 0 || token >= config_.vocab) {
      return laminar::invalid_argument(fmt::format("tiny model step: sequence {} token {} = {} is outside [0, {})", id,
                                                   s.kv_length, token, config_.vocab));
    }
    if (s.rng_position > std::uint64_t(std::numeric_limits<std::int64_t>::max())) {
      return laminar::invalid_argument(
          fmt::format("tiny model step: sequence {} rng_position {} exceeds 2^63 - 1", id, s.rng_position));
    }
    const float temperature = s.temperature;
    const float top_p = s.top_p;
    const std::int32_t top_k = s.top_k;
    const std::int64_t position = std::int64_t(s.rng_position);
    laminar::kernels::SamplingParams settings;
    settings.batch = 1;
    settings.temperature = &temperature;
    settings.top_p = &top_p;
    settings.top_k = &top_k;
    settings.position = &position;
    if (Status st = laminar::kernels::check_row_settings(settings); !st.ok()) {
      return st.with_context(fmt::format("tiny model step: sequence {}", id));
    }
    if (s.kv_length % std::uint64_t(layout.page_size) == 0) ++new_pages;
  }
  if (new_pages > cache.free_pages()) {
    return laminar::resource_exhausted(fmt::format(
        "tiny model step: the batch needs {} new pages, the cache has {} free", new_pages, cache.free_pages()));
  }
  return laminar::ok_status();
}

Status TinyModel::step(PagedKvCache& cache, std::span<SequenceState* const> batch) const {
  LAMINAR_RETURN_IF_ERROR(check(cache, batch));
  if (batch.empty()) return laminar::ok_status();
  const DType dtype = cache.layout().dtype;
  const std::int64_t rows = std::int64_t(batch.size());
  const std::int64_t d = config_.d_model;
  const std::int64_t qd = std::int64_t(config_.num_qo_heads) * config_.head_dim;
  const std::int64_t kd = std::int64_t(config_.num_kv_heads) * config_.head_dim;

  std::vector<SequenceId> ids;
  std::vector<float> x(std::size_t(rows * d));  // [rows, d_model]: the residual stream
  std::int32_t max_kv_len = 0;
  for (std::int64_t b = 0; b < rows; ++b) {
    const SequenceState& s = *batch[std::size_t(b)];
    ids.push_back(s.sequence);
    // check() counted the free pages, so this cannot fail.
    LAMINAR_CHECK(cache.append_tokens(s.sequence, 1).ok());
    embed(next_input(s), std::int64_t(s.kv_length), x.data() + b * d);
    max_kv_len = std::max(max_kv_len, std::int32_t(s.kv_length + 1));
  }
  laminar::PageTableBuffer table;
  LAMINAR_RETURN_IF_ERROR(cache.build_page_table(ids, &table));

  const std::size_t elem = laminar::dtype_size(dtype);
  std::vector<float> h(static_cast<std::size_t>(d));
  std::vector<float> kv_row(static_cast<std::size_t>(kd));
  std::vector<float> q(std::size_t(rows * qd));              // [rows, num_qo_heads, head_dim]
  std::vector<float> attn(std::size_t(rows * qd));           // [rows, num_qo_heads, head_dim]
  std::vector<unsigned char> q_cache(std::size_t(rows * qd) * elem);    // q in the cache's dtype
  std::vector<unsigned char> out_cache(std::size_t(rows * qd) * elem);  // attention out, cache dtype
  std::vector<float> delta(static_cast<std::size_t>(d));
  for (std::int32_t l = 0; l < config_.num_layers; ++l) {
    const Layer& layer = layers_[std::size_t(l)];
    for (std::int64_t b = 0; b < rows; ++b) {
      const SequenceState& s = *batch[std::size_t(b)];
      rms_norm(x.data() + b * d, d, h.data());
      matvec(layer.wq, h.data(), qd, d, q.data() + b * qd);
      Result<PagedKvCache::TokenSlot> slot = cache.token_slot(s.sequence, std::int64_t(s.kv_length), l);
      LAMINAR_RETURN_IF_ERROR(slot.status());
      matvec(layer.wk, h.data(), kd, d, kv_row.data());
      LAMINAR_RETURN_IF_ERROR(convert(kv_row.data(), DType::kF32, slot->k, dtype, kd));
      matvec(layer.wv, h.data(), kd, d, kv_row.data());
      LAMINAR_RETURN_IF_ERROR(convert(kv_row.data(), DType::kF32, slot->v, dtype, kd));
    }
    LAMINAR_RETURN_IF_ERROR(convert(q.data(), DType::kF32, q_cache.data(), dtype, rows * qd));
    Result<laminar::PagedKv> view = cache.view(l);
    LAMINAR_RETURN_IF_ERROR(view.status());
    laminar::kernels::PagedDecodeParams p;
    p.q = q_cache.data();
    p.out = out_cache.data();
    p.kv = *view;
    p.table = table.view();
    p.num_rows = std::int32_t(rows);
    p.num_qo_heads = config_.num_qo_heads;
    p.sm_scale = 1.0f / std::sqrt(float(config_.head_dim));
    p.max_kv_len = max_kv_len;
    p.cpu_threads = config_.cpu_threads;
    LAMINAR_RETURN_IF_ERROR(laminar::kernels::run(p, Stream::host()));
    LAMINAR_RETURN_IF_ERROR(convert(out_cache.data(), dtype, attn.data(), DType::kF32, rows * qd));
    for (std::int64_t b = 0; b < rows; ++b) {
      matvec(layer.wo, attn.data() + b * qd, d, qd, delta.data());
      for (std::int64_t i = 0; i < d; ++i) x[std::size_t(b * d + i)] += delta[std::size_t(i)];
    }
  }

  // Only a sequence that fed its last token samples; the others are still reading their prompt.
  std::vector<std::size_t> sampling;
  for (std::size_t b = 0; b < batch.size(); ++b) {
    if (std::int64_t(batch[b]->kv_length) + 1 == total_tokens(*batch[b])) sampling.push_back(b);
  }
  const std::int64_t n = std::int64_t(sampling.size());
  std::vector<float> logits(std::size_t(n * config_.vocab));  // [n, vocab]
  std::vector<float> temperature, top_p;
  std::vector<std::int32_t> top_k;
  std::vector<std::uint64_t> seed;
  std::vector<std::int64_t> position;
  for (std::int64_t r = 0; r < n; ++r) {
    const SequenceState& s = *batch[sampling[std::size_t(r)]];
    rms_norm(x.data() + std::int64_t(sampling[std::size_t(r)]) * d, d, h.data());
    matvec(unembedding_, h.data(), config_.vocab, d, logits.data() + r * config_.vocab);
    temperature.push_back(s.temperature);
    top_p.push_back(s.top_p);
    top_k.push_back(s.top_k);
    seed.push_back(s.seed);
    position.push_back(std::int64_t(s.rng_position));
  }
  std::vector<std::int32_t> token(static_cast<std::size_t>(n));
  std::vector<float> logprob(static_cast<std::size_t>(n));
  if (n > 0) {
    laminar::kernels::SamplingParams p;
    p.logits = logits.data();
    p.logits_dtype = DType::kF32;
    p.batch = n;
    p.vocab = config_.vocab;
    p.temperature = temperature.data();
    p.top_k = top_k.data();
    p.top_p = top_p.data();
    p.seed = seed.data();
    p.position = position.data();
    p.token = token.data();
    p.raw_logprob = logprob.data();
    p.cpu_threads = config_.cpu_threads;
    LAMINAR_RETURN_IF_ERROR(laminar::kernels::run(p, Stream::host()));
  }

  for (SequenceState* s : batch) ++s->kv_length;
  for (std::int64_t r = 0; r < n; ++r) {
    SequenceState& s = *batch[sampling[std::size_t(r)]];
    // The weights are finite, so every row has a distribution; an invalid token is a bug here.
    LAMINAR_CHECK(token[std::size_t(r)] != laminar::kernels::kInvalidToken);
    s.response_tokens.push_back(token[std::size_t(r)]);
    s.logprobs.push_back(logprob[std::size_t(r)]);
    ++s.rng_position;
  }
  return laminar::ok_status();
}

Status TinyModel::prefill(PagedKvCache& cache, SequenceState& seq) const {
  if (seq.prompt_tokens.empty() || !seq.response_tokens.empty() || seq.kv_length != 0) {
    return laminar::invalid_argument(fmt::format(
        "tiny model prefill: sequence {} has {} prompt tokens, {} response tokens and kv_length {}; needs a "
        "prompt, no response and kv_length 0",
        seq.sequence.value(), seq.prompt_tokens.size(), seq.response_tokens.size(), seq.kv_length));
  }
  LAMINAR_RETURN_IF_ERROR(cache.add_sequence(seq.sequence));
  SequenceState* batch[] = {&seq};
  while (seq.response_tokens.empty()) {
    if (Status st = step(cache, batch); !st.ok()) {
      // Leave the cache and the state as they were.
      (void)cache.release(seq.sequence);
      seq.kv_length = 0;
      return st.with_context("tiny model prefill");
    }
  }
  return laminar::ok_status();
}

SequenceState start_sequence(SequenceId id, std::vector<std::int32_t> prompt, std::uint64_t seed, float temperature,
                             float top_p) {
  SequenceState s;
  s.sequence = id;
  s.trajectory = laminar::TrajectoryId(id.value());
  s.temperature = temperature;
  s.top_p = top_p;
  s.seed = seed;
  s.rng_position = prompt.size();
  s.prompt_tokens = std::move(prompt);
  return s;
}

}  // namespace tiny_model
