#include "engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <unordered_set>
#include <utility>

#include "laminar/kernels/cast.h"
#include "laminar/kernels/paged_decode.h"
#include "laminar/kernels/sampling.h"

namespace async_grpo {
namespace {

using laminar::DType;
using laminar::PagedKvCache;
using laminar::Result;
using laminar::SequenceId;
using laminar::SequenceState;
using laminar::Status;
using laminar::Stream;

// Eight float lanes (one AVX register, two SSE2 or NEON ones): element-wise arithmetic only, so
// the bits do not depend on the instruction set the compiler picks.
typedef float Lanes __attribute__((vector_size(32)));

// By reference: a 32-byte vector returned by value has another ABI with AVX than without.
[[gnu::always_inline]] inline void load(Lanes& v, const float* p) { std::memcpy(&v, p, sizeof v); }

// The first n <= 8 floats at p, zeros after.
[[gnu::always_inline]] inline void load_partial(Lanes& v, const float* p, std::int64_t n) {
  v = Lanes{};
  std::memcpy(&v, p, std::size_t(n) * sizeof(float));
}

// y[r, o] = dot(x[r], w[o]) for kRows rows of x [kRows, in] and every row of w [out, in], into
// y [kRows, out]. Each dot product accumulates element c in lane c mod 16 (two registers of eight,
// so that consecutive adds do not wait on each other) and sums the sixteen lanes in a fixed tree,
// the same for every kRows: a row's bits never depend on the rows beside it.
template <int kRows>
[[gnu::always_inline]] inline void dot_rows(const float* x, std::int64_t in, const float* w, std::int64_t out,
                                            float* y) {
  for (std::int64_t o = 0; o < out; ++o) {
    const float* wo = w + o * in;
    Lanes even[kRows], odd[kRows];
    for (int r = 0; r < kRows; ++r) even[r] = odd[r] = Lanes{};
    std::int64_t c = 0;
    Lanes w0, w1, x0, x1;
    for (; c + 16 <= in; c += 16) {
      load(w0, wo + c);
      load(w1, wo + c + 8);
      for (int r = 0; r < kRows; ++r) {
        load(x0, x + r * in + c);
        load(x1, x + r * in + c + 8);
        even[r] += w0 * x0;
        odd[r] += w1 * x1;
      }
    }
    if (c < in) {
      const std::int64_t n0 = std::min<std::int64_t>(8, in - c), n1 = in - c - n0;
      load_partial(w0, wo + c, n0);
      load_partial(w1, wo + c + 8, n1);
      for (int r = 0; r < kRows; ++r) {
        load_partial(x0, x + r * in + c, n0);
        load_partial(x1, x + r * in + c + 8, n1);
        even[r] += w0 * x0;
        odd[r] += w1 * x1;
      }
    }
    for (int r = 0; r < kRows; ++r) {
      const Lanes a = even[r] + odd[r];
      y[r * out + o] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    }
  }
}

// On x86-64, matmul() is compiled for AVX2 as well as the baseline, picked at load time: the same
// lanes and sums either way. Not under ThreadSanitizer: GCC instruments the clones' ifunc resolver,
// which the loader runs before TSan's runtime is set up, so the program crashes as it loads.
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
#define LAMINAR_GRPO_MATMUL_CLONES [[gnu::target_clones("avx2", "default")]]
#else
#define LAMINAR_GRPO_MATMUL_CLONES
#endif

// y [rows, out] = x [rows, in] w^T for w [out, in]. Four rows share each load of w.
LAMINAR_GRPO_MATMUL_CLONES void matmul(const float* x, std::int64_t rows, std::int64_t in, const float* w,
                                       std::int64_t out, float* y) {
  std::int64_t r = 0;
  for (; r + 4 <= rows; r += 4) dot_rows<4>(x + r * in, in, w, out, y + r * out);
  for (; r < rows; ++r) dot_rows<1>(x + r * in, in, w, out, y + r * out);
}

// out = x / sqrt(mean(x^2) + eps) * g for one row of n.
void rms_norm(const float* x, const float* g, std::int64_t n, float eps, float* out) {
  float sum_sq = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) sum_sq += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum_sq / float(n) + eps);
  for (std::int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * g[i];
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

std::int64_t total_tokens(const SequenceState& s) {
  return std::int64_t(s.prompt_tokens.size() + s.response_tokens.size());
}

// Token i of prompt then response.
std::int32_t token_at(const SequenceState& s, std::size_t i) {
  return i < s.prompt_tokens.size() ? s.prompt_tokens[i] : s.response_tokens[i - s.prompt_tokens.size()];
}

// The sampling settings of one sequence as the sampler checks them, and rng_position's range.
Status check_sampling(const SequenceState& s) {
  if (s.rng_position > std::uint64_t(std::numeric_limits<std::int64_t>::max())) {
    return laminar::invalid_argument(fmt::format("rng_position {} exceeds 2^63 - 1", s.rng_position));
  }
  const std::int64_t position = std::int64_t(s.rng_position);
  laminar::kernels::SamplingParams settings;
  settings.batch = 1;
  settings.temperature = &s.temperature;
  settings.top_p = &s.top_p;
  settings.top_k = &s.top_k;
  settings.position = &position;
  return laminar::kernels::check_row_settings(settings);
}

std::int64_t pages_for(std::int64_t tokens, std::int32_t page_size) { return (tokens + page_size - 1) / page_size; }

}  // namespace

Engine::Engine(const PolicyConfig& config, const EngineOptions& options, laminar::WeightManifest manifest)
    : config_(config),
      options_(options),
      manifest_(std::move(manifest)),
      weights_(std::size_t(manifest_.total_bytes() / sizeof(float)), 0.0f) {}

Result<Engine> Engine::create(const PolicyConfig& config, const EngineOptions& options) {
  if (options.cpu_threads < 0) {
    return laminar::invalid_argument(fmt::format("engine: cpu_threads = {} is negative", options.cpu_threads));
  }
  if (options.device != EngineDevice::kCpu && options.device != EngineDevice::kCuda) {
    return laminar::invalid_argument(fmt::format("engine: device {} is neither kCpu nor kCuda", int(options.device)));
  }
  if (options.cuda_device < 0) {
    return laminar::invalid_argument(fmt::format("engine: cuda_device = {} is negative", options.cuda_device));
  }
  Result<laminar::WeightManifest> manifest = weight_manifest(config);
  if (!manifest.ok()) return manifest.status().with_context("engine");
  Engine engine(config, options, std::move(*manifest));
  if (options.device == EngineDevice::kCuda) {
    auto cuda = create_cuda(options.cuda_device, engine.manifest_.total_bytes());
    if (!cuda.ok()) return cuda.status().with_context("engine");
    engine.cuda_ = std::move(*cuda);
  }
  return engine;
}

std::vector<laminar::NamedTensor> Engine::weight_tensors() {
  std::vector<laminar::NamedTensor> out;
  auto* base = reinterpret_cast<unsigned char*>(weights_.data());
  for (const laminar::WeightManifest::Entry& e : manifest_.entries()) {
    // The manifest's shapes are valid and its offsets inside the buffer, so the view is.
    Result<laminar::TensorView> view = laminar::TensorView::contiguous(base + e.offset, e.dtype, e.shape);
    LAMINAR_CHECK(view.ok());
    out.push_back({e.name, *view});
  }
  return out;
}

std::span<const std::byte> Engine::weight_bytes() const noexcept {
  return {reinterpret_cast<const std::byte*>(weights_.data()), weights_.size() * sizeof(float)};
}

Status Engine::load_weights(const laminar::WeightManifest& layout, std::span<const std::byte> bytes) {
  const auto ours = manifest_.entries();
  const auto theirs = layout.entries();
  for (std::size_t i = 0; i < std::max(ours.size(), theirs.size()); ++i) {
    if (i >= ours.size() || i >= theirs.size() || !(ours[i] == theirs[i])) {
      return laminar::invalid_argument(fmt::format(
          "engine load_weights: entry {} is {} in the given layout, {} in the model's", i,
          i < theirs.size() ? "'" + theirs[i].name + "'" : "missing", i < ours.size() ? "'" + ours[i].name + "'"
                                                                                       : "missing"));
    }
  }
  if (bytes.size() != manifest_.total_bytes()) {
    return laminar::invalid_argument(fmt::format("engine load_weights: {} bytes given, the manifest lays out {}",
                                                 bytes.size(), manifest_.total_bytes()));
  }
  for (const laminar::WeightManifest::Entry& e : ours) {
    const std::byte* p = bytes.data() + e.offset;
    for (std::uint64_t i = 0; i < e.nbytes / sizeof(float); ++i) {
      float v;
      std::memcpy(&v, p + i * sizeof(float), sizeof v);
      if (!std::isfinite(v)) {
        return laminar::invalid_argument(fmt::format("engine load_weights: {}[{}] is {}", e.name, i, v));
      }
    }
  }
  std::memcpy(weights_.data(), bytes.data(), bytes.size());
  if (cuda_) return upload_weights().with_context("engine load_weights");
  return laminar::ok_status();
}

Status Engine::check_weights() {
  for (std::size_t k = 0; k < manifest_.size(); ++k) {
    const laminar::WeightManifest::Entry& e = manifest_.entries()[k];
    const float* w = weight(k);
    for (std::uint64_t i = 0; i < e.nbytes / sizeof(float); ++i) {
      if (!std::isfinite(w[i])) {
        return laminar::invalid_argument(fmt::format("engine: weight {}[{}] is {}", e.name, i, w[i]));
      }
    }
  }
  if (cuda_) return upload_weights().with_context("engine check_weights");
  return laminar::ok_status();
}

const float* Engine::weight(std::size_t entry) const {
  return weights_.data() + manifest_.entries()[entry].offset / sizeof(float);
}

Engine::LayerWeights Engine::layer(std::int32_t l) const {
  // Manifest order: embed, pos_embed, then nine tensors per layer.
  const std::size_t first = 2 + 9 * std::size_t(l);
  return {weight(first), weight(first + 1), weight(first + 2), weight(first + 3), weight(first + 4),
          weight(first + 5), weight(first + 6), weight(first + 7), weight(first + 8)};
}

laminar::KvLayout Engine::kv_layout(std::int32_t num_pages, std::int32_t page_size, DType dtype) const {
  return {.num_pages = num_pages,
          .page_size = page_size,
          .num_kv_heads = config_.num_kv_heads,
          .head_dim = config_.head_dim,
          .dtype = dtype,
          .num_layers = config_.num_layers};
}

Result<std::shared_ptr<PagedKvCache>> Engine::make_cache(std::int32_t num_pages, std::int32_t page_size,
                                                         DType dtype) const {
  const laminar::KvLayout layout = kv_layout(num_pages, page_size, dtype);
  if (Status st = laminar::validate(layout); !st.ok()) return st.with_context("engine make_cache");
  if (cuda_) return make_device_cache(layout);
  Result<PagedKvCache> cache = PagedKvCache::create(layout);
  if (!cache.ok()) return cache.status().with_context("engine make_cache");
  return std::make_shared<PagedKvCache>(std::move(*cache));
}

Status Engine::check_cache(const PagedKvCache& cache, const char* call) const {
  const laminar::KvLayout& layout = cache.layout();
  if (layout.num_layers != config_.num_layers || layout.num_kv_heads != config_.num_kv_heads ||
      layout.head_dim != config_.head_dim) {
    return laminar::invalid_argument(fmt::format(
        "engine {}: the cache holds {} layers x {} KV heads x head_dim {}, the model needs {} x {} x {}", call,
        layout.num_layers, layout.num_kv_heads, layout.head_dim, config_.num_layers, config_.num_kv_heads,
        config_.head_dim));
  }
  if (layout.dtype != DType::kF32 && layout.dtype != DType::kF16 && layout.dtype != DType::kBF16) {
    return laminar::invalid_argument(fmt::format("engine {}: the cache holds {}, the engine runs on f32, f16 or bf16",
                                                 call, laminar::dtype_name(layout.dtype)));
  }
  const laminar::Device here = cuda_ ? laminar::Device::cuda(options_.cuda_device) : laminar::Device::cpu();
  if (cache.device().is_host() ? !here.is_host() : cache.device() != here) {
    return laminar::invalid_argument(fmt::format("engine {}: the cache is on {}, the engine runs on {} (make_cache)",
                                                 call, to_string(cache.device()), to_string(here)));
  }
  return laminar::ok_status();
}

Status Engine::forward(PagedKvCache& cache, const Pass& pass, float* logits) const {
  const DType dtype = cache.layout().dtype;
  const std::int64_t rows = std::int64_t(pass.tokens.size());
  const std::int64_t d = config_.d_model, ff = config_.d_ff;
  const std::int64_t qd = std::int64_t(config_.num_qo_heads) * config_.head_dim;
  const std::int64_t kd = std::int64_t(config_.num_kv_heads) * config_.head_dim;
  const float eps = config_.rms_eps;

  std::vector<float> x(std::size_t(rows * d));  // [rows, d_model]: the residual stream
  std::vector<std::int32_t> qo_indptr{0};        // [batch + 1]
  std::int32_t max_kv_len = 0;
  {
    const float* embed = weight(0);      // [vocab, d_model]
    const float* pos_embed = weight(1);  // [max_positions, d_model]
    std::int64_t r = 0;
    for (std::size_t b = 0; b < pass.ids.size(); ++b) {
      for (std::int32_t j = 0; j < pass.count[b]; ++j, ++r) {
        const float* e = embed + std::int64_t(pass.tokens[std::size_t(r)]) * d;
        const float* p = pos_embed + (pass.start[b] + j) * d;
        for (std::int64_t i = 0; i < d; ++i) x[std::size_t(r * d + i)] = e[i] + p[i];
      }
      qo_indptr.push_back(qo_indptr.back() + pass.count[b]);
      max_kv_len = std::max(max_kv_len, std::int32_t(pass.start[b] + pass.count[b]));
    }
  }
  laminar::PageTableBuffer table;
  LAMINAR_RETURN_IF_ERROR(cache.build_page_table(pass.ids, &table));

  const std::size_t elem = laminar::dtype_size(dtype);
  std::vector<float> h(std::size_t(rows * d));       // [rows, d_model] normed residual
  std::vector<float> q(std::size_t(rows * qd));      // [rows, num_qo_heads, head_dim]
  std::vector<float> k(std::size_t(rows * kd));      // [rows, num_kv_heads, head_dim]
  std::vector<float> v(std::size_t(rows * kd));      // [rows, num_kv_heads, head_dim]
  std::vector<float> attn(std::size_t(rows * qd));   // [rows, num_qo_heads, head_dim]
  std::vector<float> delta(std::size_t(rows * d));   // [rows, d_model]
  std::vector<float> gate(std::size_t(rows * ff));   // [rows, d_ff]
  std::vector<float> up(std::size_t(rows * ff));     // [rows, d_ff]
  std::vector<unsigned char> q_cache, out_cache;     // q and attention out in the cache's dtype
  if (dtype != DType::kF32) {
    q_cache.resize(std::size_t(rows * qd) * elem);
    out_cache.resize(std::size_t(rows * qd) * elem);
  }
  auto add_delta = [&] {
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += delta[i];
  };

  for (std::int32_t l = 0; l < config_.num_layers; ++l) {
    const LayerWeights w = layer(l);
    for (std::int64_t r = 0; r < rows; ++r) {
      rms_norm(&x[std::size_t(r * d)], w.attn_norm, d, eps, &h[std::size_t(r * d)]);
    }
    matmul(h.data(), rows, d, w.wq, qd, q.data());
    matmul(h.data(), rows, d, w.wk, kd, k.data());
    matmul(h.data(), rows, d, w.wv, kd, v.data());
    std::int64_t r = 0;
    for (std::size_t b = 0; b < pass.ids.size(); ++b) {
      for (std::int32_t j = 0; j < pass.count[b]; ++j, ++r) {
        Result<PagedKvCache::TokenSlot> slot = cache.token_slot(pass.ids[b], pass.start[b] + j, l);
        LAMINAR_RETURN_IF_ERROR(slot.status());
        LAMINAR_RETURN_IF_ERROR(convert(&k[std::size_t(r * kd)], DType::kF32, slot->k, dtype, kd));
        LAMINAR_RETURN_IF_ERROR(convert(&v[std::size_t(r * kd)], DType::kF32, slot->v, dtype, kd));
      }
    }
    Result<laminar::PagedKv> view = cache.view(l);
    LAMINAR_RETURN_IF_ERROR(view.status());
    laminar::kernels::PagedDecodeParams p;
    if (dtype == DType::kF32) {
      p.q = q.data();
      p.out = attn.data();
    } else {
      LAMINAR_RETURN_IF_ERROR(convert(q.data(), DType::kF32, q_cache.data(), dtype, rows * qd));
      p.q = q_cache.data();
      p.out = out_cache.data();
    }
    p.kv = *view;
    p.table = table.view();
    p.qo_indptr = qo_indptr.data();
    p.num_rows = std::int32_t(rows);
    p.num_qo_heads = config_.num_qo_heads;
    p.sm_scale = 1.0f / std::sqrt(float(config_.head_dim));
    p.max_kv_len = max_kv_len;
    p.cpu_threads = options_.cpu_threads;
    LAMINAR_RETURN_IF_ERROR(laminar::kernels::run(p, Stream::host()));
    if (dtype != DType::kF32) {
      LAMINAR_RETURN_IF_ERROR(convert(out_cache.data(), dtype, attn.data(), DType::kF32, rows * qd));
    }
    matmul(attn.data(), rows, qd, w.wo, d, delta.data());
    add_delta();

    for (std::int64_t i = 0; i < rows; ++i) {
      rms_norm(&x[std::size_t(i * d)], w.mlp_norm, d, eps, &h[std::size_t(i * d)]);
    }
    matmul(h.data(), rows, d, w.w_gate, ff, gate.data());
    matmul(h.data(), rows, d, w.w_up, ff, up.data());
    for (std::size_t i = 0; i < gate.size(); ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    matmul(gate.data(), rows, ff, w.w_down, d, delta.data());
    add_delta();
  }

  const std::int64_t n = std::int64_t(pass.logit_rows.size());
  const float* final_norm = weight(manifest_.size() - 2);  // [d_model]
  const float* lm_head = weight(manifest_.size() - 1);     // [vocab, d_model]
  for (std::int64_t i = 0; i < n; ++i) {
    rms_norm(&x[std::size_t(pass.logit_rows[std::size_t(i)] * d)], final_norm, d, eps, &h[std::size_t(i * d)]);
  }
  matmul(h.data(), n, d, lm_head, config_.vocab, logits);
  return laminar::ok_status();
}

Status Engine::forward_sample(PagedKvCache& cache, const Pass& pass, std::span<SequenceState* const> batch) const {
  const std::size_t n = batch.size();
  std::vector<float> temperature, top_p;
  std::vector<std::int32_t> top_k;
  std::vector<std::uint64_t> seed;
  std::vector<std::int64_t> position;
  for (const SequenceState* s : batch) {
    temperature.push_back(s->temperature);
    top_p.push_back(s->top_p);
    top_k.push_back(s->top_k);
    seed.push_back(s->seed);
    position.push_back(std::int64_t(s->rng_position));
  }
  std::vector<std::int32_t> token(n);
  std::vector<float> logprob(n);
  laminar::kernels::SamplingParams p;
  p.logits_dtype = DType::kF32;
  p.batch = std::int64_t(n);
  p.vocab = config_.vocab;
  p.temperature = temperature.data();
  p.top_p = top_p.data();
  p.top_k = top_k.data();
  p.seed = seed.data();
  p.position = position.data();
  p.token = token.data();
  p.raw_logprob = logprob.data();
  p.cpu_threads = options_.cpu_threads;
  if (cuda_) {
    LAMINAR_RETURN_IF_ERROR(forward_cuda(cache, pass, {.sample = &p}));
  } else {
    std::vector<float> logits(n * std::size_t(config_.vocab));  // [n, vocab]
    LAMINAR_RETURN_IF_ERROR(forward(cache, pass, logits.data()));
    if (n == 0) return laminar::ok_status();
    p.logits = logits.data();
    LAMINAR_RETURN_IF_ERROR(laminar::kernels::run(p, Stream::host()));
  }
  for (std::size_t r = 0; r < n; ++r) {
    if (token[r] == laminar::kernels::kInvalidToken) {
      return laminar::failed_precondition(
          fmt::format("engine: sequence {} has logits with no distribution (NaN or infinite): see check_weights()",
                      batch[r]->sequence.value()));
    }
  }
  for (std::size_t r = 0; r < n; ++r) {
    SequenceState& s = *batch[r];
    s.response_tokens.push_back(token[r]);
    s.logprobs.push_back(logprob[r]);
    ++s.rng_position;
  }
  return laminar::ok_status();
}

Status Engine::prefill(PagedKvCache& cache, SequenceState& seq) const {
  SequenceState* batch[] = {&seq};
  return prefill(cache, batch);
}

Status Engine::prefill(PagedKvCache& cache, std::span<SequenceState* const> batch) const {
  LAMINAR_RETURN_IF_ERROR(check_cache(cache, "prefill"));
  std::unordered_set<SequenceId> seen;
  std::int64_t new_pages = 0;
  for (std::size_t b = 0; b < batch.size(); ++b) {
    if (batch[b] == nullptr) return laminar::invalid_argument(fmt::format("engine prefill: batch[{}] is null", b));
    const SequenceState& s = *batch[b];
    const std::uint64_t id = s.sequence.value();
    if (!seen.insert(s.sequence).second) {
      return laminar::invalid_argument(fmt::format("engine prefill: sequence {} is in the batch twice", id));
    }
    if (s.prompt_tokens.empty() || !s.response_tokens.empty() || !s.logprobs.empty() || s.kv_length != 0) {
      return laminar::invalid_argument(fmt::format(
          "engine prefill: sequence {} has {} prompt tokens, {} response tokens, {} log-probs and kv_length {}; "
          "needs a prompt, no response and kv_length 0",
          id, s.prompt_tokens.size(), s.response_tokens.size(), s.logprobs.size(), s.kv_length));
    }
    if (cache.length(s.sequence).ok()) {
      return laminar::already_exists(fmt::format("engine prefill: sequence {} is already in the cache", id));
    }
    if (std::int64_t(s.prompt_tokens.size()) >= config_.max_positions) {
      return laminar::invalid_argument(
          fmt::format("engine prefill: sequence {} has a prompt of {} tokens, max_positions is {} (one is for the "
                      "sampled token)",
                      id, s.prompt_tokens.size(), config_.max_positions));
    }
    for (std::size_t i = 0; i < s.prompt_tokens.size(); ++i) {
      if (s.prompt_tokens[i] < 0 || s.prompt_tokens[i] >= config_.vocab) {
        return laminar::invalid_argument(fmt::format("engine prefill: sequence {} prompt token {} = {} is outside "
                                                     "[0, {})", id, i, s.prompt_tokens[i], config_.vocab));
      }
    }
    if (Status st = check_sampling(s); !st.ok()) {
      return st.with_context(fmt::format("engine prefill: sequence {}", id));
    }
    new_pages += pages_for(std::int64_t(s.prompt_tokens.size()), cache.layout().page_size);
  }
  if (new_pages > cache.free_pages()) {
    return laminar::resource_exhausted(fmt::format(
        "engine prefill: the prompts need {} pages, the cache has {} free", new_pages, cache.free_pages()));
  }
  if (batch.empty()) return laminar::ok_status();

  Pass pass;
  for (const SequenceState* s : batch) {
    pass.ids.push_back(s->sequence);
    pass.start.push_back(0);
    pass.count.push_back(std::int32_t(s->prompt_tokens.size()));
    pass.tokens.insert(pass.tokens.end(), s->prompt_tokens.begin(), s->prompt_tokens.end());
    pass.logit_rows.push_back(std::int64_t(pass.tokens.size()) - 1);
  }
  auto release = [&](std::size_t added) {
    for (std::size_t b = 0; b < added; ++b) (void)cache.release(batch[b]->sequence);
  };
  for (std::size_t b = 0; b < batch.size(); ++b) {
    // Checked above: the id is new and the pages are free.
    Status st = cache.add_sequence(batch[b]->sequence);
    if (st.ok()) st = cache.append_tokens(batch[b]->sequence, pass.count[b]);
    if (!st.ok()) {
      release(b + 1);
      return st.with_context("engine prefill");
    }
  }
  Status st = forward_sample(cache, pass, batch);
  if (st.ok()) {
    for (SequenceState* s : batch) s->kv_length = s->prompt_tokens.size();
  }
  if (!st.ok()) {
    release(batch.size());
    return st.with_context("engine prefill");
  }
  return laminar::ok_status();
}

Status Engine::step(PagedKvCache& cache, std::span<SequenceState* const> batch) const {
  LAMINAR_RETURN_IF_ERROR(check_cache(cache, "step"));
  std::unordered_set<SequenceId> seen;
  std::int64_t new_pages = 0;
  for (std::size_t b = 0; b < batch.size(); ++b) {
    if (batch[b] == nullptr) return laminar::invalid_argument(fmt::format("engine step: batch[{}] is null", b));
    const SequenceState& s = *batch[b];
    const std::uint64_t id = s.sequence.value();
    if (!seen.insert(s.sequence).second) {
      return laminar::invalid_argument(fmt::format("engine step: sequence {} is in the batch twice", id));
    }
    Result<std::int64_t> len = cache.length(s.sequence);
    if (!len.ok()) return len.status().with_context("engine step");
    if (std::uint64_t(*len) != s.kv_length) {
      return laminar::invalid_argument(fmt::format(
          "engine step: sequence {} has kv_length {} but {} tokens in the cache", id, s.kv_length, *len));
    }
    const std::int64_t total = total_tokens(s);
    if (std::int64_t(s.kv_length) >= total) {
      return laminar::invalid_argument(fmt::format(
          "engine step: sequence {} has no token to feed (kv_length {} of {} tokens)", id, s.kv_length, total));
    }
    const bool samples = std::int64_t(s.kv_length) + 1 == total;
    if (total > config_.max_positions || (samples && total >= config_.max_positions)) {
      return laminar::invalid_argument(fmt::format(
          "engine step: sequence {} has {} tokens, max_positions is {}: no position left for the next", id, total,
          config_.max_positions));
    }
    if (s.logprobs.size() != s.response_tokens.size()) {
      return laminar::invalid_argument(fmt::format("engine step: sequence {} has {} log-probs for {} response tokens",
                                                   id, s.logprobs.size(), s.response_tokens.size()));
    }
    const std::int32_t token = token_at(s, std::size_t(s.kv_length));
    if (token < 0 || token >= config_.vocab) {
      return laminar::invalid_argument(fmt::format("engine step: sequence {} token {} = {} is outside [0, {})", id,
                                                   s.kv_length, token, config_.vocab));
    }
    if (Status st = check_sampling(s); !st.ok()) return st.with_context(fmt::format("engine step: sequence {}", id));
    if (s.kv_length % std::uint64_t(cache.layout().page_size) == 0) ++new_pages;
  }
  if (new_pages > cache.free_pages()) {
    return laminar::resource_exhausted(fmt::format(
        "engine step: the batch needs {} new pages, the cache has {} free", new_pages, cache.free_pages()));
  }
  if (batch.empty()) return laminar::ok_status();

  Pass pass;
  std::vector<SequenceState*> sampling;  // the sequences that feed their last token
  for (SequenceState* s : batch) {
    // Checked above: the sequence is in the cache and its page is free.
    LAMINAR_CHECK(cache.append_tokens(s->sequence, 1).ok());
    pass.ids.push_back(s->sequence);
    pass.start.push_back(std::int64_t(s->kv_length));
    pass.count.push_back(1);
    pass.tokens.push_back(token_at(*s, std::size_t(s->kv_length)));
    if (std::int64_t(s->kv_length) + 1 == total_tokens(*s)) {
      pass.logit_rows.push_back(std::int64_t(pass.tokens.size()) - 1);
      sampling.push_back(s);
    }
  }
  LAMINAR_RETURN_IF_ERROR(forward_sample(cache, pass, sampling));
  for (SequenceState* s : batch) ++s->kv_length;
  return laminar::ok_status();
}

Result<std::vector<float>> Engine::logits(PagedKvCache& cache, SequenceId scratch,
                                          std::span<const std::int32_t> tokens) const {
  std::vector<float> out(tokens.size() * std::size_t(config_.vocab));  // [tokens, vocab]
  LAMINAR_RETURN_IF_ERROR(feed(cache, scratch, tokens, 0, {.logits = out.data()}));
  return out;
}

Status Engine::feed(PagedKvCache& cache, SequenceId scratch, std::span<const std::int32_t> tokens,
                    std::size_t first_row, const LogitsUse& use) const {
  LAMINAR_RETURN_IF_ERROR(check_cache(cache, "logits"));
  if (tokens.empty() || std::int64_t(tokens.size()) > config_.max_positions) {
    return laminar::invalid_argument(fmt::format("engine logits: {} tokens, the model takes 1 to {}", tokens.size(),
                                                 config_.max_positions));
  }
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= config_.vocab) {
      return laminar::invalid_argument(
          fmt::format("engine logits: token {} = {} is outside [0, {})", i, tokens[i], config_.vocab));
    }
  }
  if (cache.length(scratch).ok()) {
    return laminar::already_exists(fmt::format("engine logits: sequence {} is already in the cache", scratch.value()));
  }
  const std::int64_t pages = pages_for(std::int64_t(tokens.size()), cache.layout().page_size);
  if (pages > cache.free_pages()) {
    return laminar::resource_exhausted(
        fmt::format("engine logits: {} tokens need {} pages, the cache has {} free", tokens.size(), pages,
                    cache.free_pages()));
  }
  Pass pass;
  pass.ids = {scratch};
  pass.start = {0};
  pass.count = {std::int32_t(tokens.size())};
  pass.tokens.assign(tokens.begin(), tokens.end());
  for (std::int64_t r = std::int64_t(first_row); r < std::int64_t(tokens.size()); ++r) pass.logit_rows.push_back(r);
  Status st = cache.add_sequence(scratch);
  if (!st.ok()) return st.with_context("engine logits");
  st = cache.append_tokens(scratch, std::int64_t(tokens.size()));
  if (st.ok() && cuda_) {
    st = forward_cuda(cache, pass, use);
  } else if (st.ok()) {
    std::vector<float> scored;  // [logit_rows, vocab] for use.score
    if (use.score != nullptr) scored.resize(pass.logit_rows.size() * std::size_t(config_.vocab));
    st = forward(cache, pass, use.score != nullptr ? scored.data() : use.logits);
    if (st.ok() && use.score != nullptr) {
      laminar::kernels::TokenLogprobParams p = *use.score;
      p.logits = scored.data();
      p.logits_dtype = DType::kF32;
      p.row_stride = 0;
      st = laminar::kernels::run(p, Stream::host());
    }
  }
  (void)cache.release(scratch);
  if (!st.ok()) return st.with_context("engine logits");
  return laminar::ok_status();
}

Result<std::vector<float>> Engine::score(PagedKvCache& cache, SequenceId scratch, std::span<const std::int32_t> prompt,
                                         std::span<const std::int32_t> response) const {
  if (prompt.empty() || response.empty()) {
    return laminar::invalid_argument(fmt::format("engine score: {} prompt and {} response tokens; needs both",
                                                 prompt.size(), response.size()));
  }
  if (std::int64_t(prompt.size() + response.size()) > config_.max_positions) {
    return laminar::invalid_argument(fmt::format("engine score: {} prompt + {} response tokens exceed max_positions {}",
                                                 prompt.size(), response.size(), config_.max_positions));
  }
  for (std::size_t i = 0; i < response.size(); ++i) {
    if (response[i] < 0 || response[i] >= config_.vocab) {
      return laminar::invalid_argument(
          fmt::format("engine score: response token {} = {} is outside [0, {})", i, response[i], config_.vocab));
    }
  }
  // Every token but the last is fed; the logits of position t give the token at t + 1.
  std::vector<std::int32_t> fed(prompt.begin(), prompt.end());
  fed.insert(fed.end(), response.begin(), response.end() - 1);
  std::vector<float> out(response.size());
  laminar::kernels::TokenLogprobParams p;
  p.batch = std::int64_t(response.size());
  p.vocab = config_.vocab;
  p.token = response.data();
  p.logprob = out.data();
  p.cpu_threads = options_.cpu_threads;
  if (Status st = feed(cache, scratch, fed, prompt.size() - 1, {.score = &p}); !st.ok()) {
    return st.with_context("engine score");
  }
  return out;
}

}  // namespace async_grpo
