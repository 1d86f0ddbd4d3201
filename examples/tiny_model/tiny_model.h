// tiny_model.h: a tiny transformer-shaped model with random weights, decoding on laminar's paged KV
// cache and kernels: how an inference engine embeds laminar.
//
// The weights are a function of one seed (a fixed integer hash, so every process and every build
// makes the same ones). A decode step runs a batch of live sequences: each feeds its next token
// through embedding, then per layer RMS norm, q/k/v projections, its K and V rows written into the
// PagedKvCache, paged attention over the cache (kernels::run on one layer's view), and the output
// projection added back; then the logits, and kernels::run(SamplingParams) keyed by the sequence's
// seed and RNG position. Every row is computed by loops of its own in a fixed order and the kernels
// are batch-invariant, so a sequence's tokens and log-probs do not depend on its batch mates or on
// the cache it lives in: the property that lets the KvMigrator move it mid-decode.
//
// A sequence is its laminar::SequenceState (prompt, response so far, log-probs, seed, RNG position,
// kv_length) plus its pages; pause it by not stepping it, ship both, and resume with step().
//
//   auto model = tiny_model::TinyModel::create({.seed = 7}).value();
//   auto cache = laminar::PagedKvCache::create(model.kv_layout(256, 16, laminar::DType::kBF16)).value();
//   laminar::SequenceState s = tiny_model::start_sequence(laminar::SequenceId(1), {3, 1, 4}, 42);
//   LAMINAR_RETURN_IF_ERROR(model.prefill(cache, s));  // feeds the prompt, samples the first token
//   laminar::SequenceState* batch[] = {&s};
//   while (s.response_tokens.size() < 32) LAMINAR_RETURN_IF_ERROR(model.step(cache, batch));
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "laminar/kv_cache.h"
#include "laminar/kv_migrator.h"
#include "laminar/status.h"
#include "laminar/types.h"

namespace tiny_model {

struct TinyModelConfig {
  std::uint64_t seed = 1;  // the weights depend on it alone
  std::int32_t vocab = 64;
  std::int32_t num_layers = 2;
  std::int32_t d_model = 128;
  std::int32_t num_qo_heads = 4;
  std::int32_t num_kv_heads = 2;  // num_qo_heads / num_kv_heads is 1, 2, 4 or 8 (the kernel's GQA groups)
  std::int32_t head_dim = 64;     // 64 or 128 (the paged decode kernel's)
  std::int32_t cpu_threads = 1;   // threads of the attention and sampling kernels; 0: all
};

class TinyModel {
 public:
  // kInvalidArgument naming the field: a count out of range, head_dim not 64/128, a GQA group the
  // kernel does not take.
  static laminar::Result<TinyModel> create(const TinyModelConfig& config);

  const TinyModelConfig& config() const noexcept { return config_; }
  // A cache layout for this model: its layers, KV heads and head_dim.
  laminar::KvLayout kv_layout(std::int32_t num_pages, std::int32_t page_size, laminar::DType dtype) const;

  // One step for every sequence of `batch`: each feeds its next token (index kv_length of prompt
  // then response) at position kv_length, and grows its cache entry by that token. A sequence that
  // fed its last token samples the next: it is appended to response_tokens with its raw log-prob,
  // and rng_position advances. Preconditions, each kInvalidArgument naming the sequence (and
  // nothing changed):
  //   the cache's layout is kv_layout(...) of this model, in host memory (else kInvalidArgument);
  //   each sequence is in the cache (kNotFound) with length kv_length;
  //   kv_length < prompt + response tokens, every token in [0, vocab);
  //   sampling settings as kernels::SamplingParams takes them, rng_position < 2^63;
  //   no sequence twice; enough free pages for the batch's growth (kResourceExhausted).
  laminar::Status step(laminar::PagedKvCache& cache, std::span<laminar::SequenceState* const> batch) const;

  // Adds the sequence to the cache and runs its prompt through step(), one token at a time, which
  // samples its first response token. Preconditions: a non-empty prompt, no response yet,
  // kv_length 0, the id not in the cache.
  laminar::Status prefill(laminar::PagedKvCache& cache, laminar::SequenceState& seq) const;

 private:
  struct Layer {
    std::vector<float> wq;  // [num_qo_heads * head_dim, d_model]
    std::vector<float> wk;  // [num_kv_heads * head_dim, d_model]
    std::vector<float> wv;  // [num_kv_heads * head_dim, d_model]
    std::vector<float> wo;  // [d_model, num_qo_heads * head_dim]
  };

  explicit TinyModel(const TinyModelConfig& config) : config_(config) {}
  laminar::Status check(const laminar::PagedKvCache& cache, std::span<laminar::SequenceState* const> batch) const;
  // x [d_model] of the token at `position`: its embedding plus a position embedding.
  void embed(std::int32_t token, std::int64_t position, float* x) const;

  TinyModelConfig config_;
  std::vector<float> embedding_;  // [vocab, d_model]
  std::vector<Layer> layers_;
  std::vector<float> unembedding_;  // [vocab, d_model]
};

// A new sequence: its prompt and sampling settings, nothing fed yet. Its trajectory id is its
// sequence id, and its RNG position the index of its first response token.
laminar::SequenceState start_sequence(laminar::SequenceId id, std::vector<std::int32_t> prompt,
                                      std::uint64_t seed, float temperature = 0.8f, float top_p = 0.95f);

// Prompt and response tokens.
inline std::int64_t total_tokens(const laminar::SequenceState& s) {
  return std::int64_t(s.prompt_tokens.size() + s.response_tokens.size());
}

}  // namespace tiny_model
