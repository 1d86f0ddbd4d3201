// tiny_model.h: a tiny transformer with random weights, decoding on laminar's paged KV cache and
// kernels: how an inference engine embeds laminar.
//
// It is the rollout engine of examples/async_grpo (engine.h: the architecture of policy_config.h,
// attention through the paged decode/prefill kernel, sampling through laminar's sampler) with
// weights that are a function of one seed (a fixed integer hash, so every process and every build
// makes the same ones). Every row is computed in a fixed order and the kernels are batch-invariant,
// so a sequence's tokens and log-probs do not depend on its batch mates or on the cache it lives
// in: the property that lets the KvMigrator move it mid-decode.
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
#include <utility>
#include <vector>

#include "laminar/kv_cache.h"
#include "laminar/kv_migrator.h"
#include "laminar/status.h"
#include "laminar/types.h"
#include "engine.h"

namespace tiny_model {

struct TinyModelConfig {
  std::uint64_t seed = 1;  // the weights depend on it alone
  std::int32_t vocab = 64;
  std::int32_t num_layers = 2;
  std::int32_t d_model = 128;
  std::int32_t num_qo_heads = 4;
  std::int32_t num_kv_heads = 2;  // num_qo_heads / num_kv_heads is 1, 2, 4 or 8 (the kernel's GQA groups)
  std::int32_t head_dim = 64;     // 64 or 128 (the paged decode kernel's)
  std::int32_t d_ff = 256;
  std::int32_t max_positions = 1024;  // prompt plus response tokens of one sequence
  std::int32_t cpu_threads = 1;       // threads of the attention and sampling kernels; 0: all
};

class TinyModel {
 public:
  // kInvalidArgument naming the field: a count out of range, head_dim not 64/128, a GQA group the
  // kernel does not take.
  static laminar::Result<TinyModel> create(const TinyModelConfig& config);

  const TinyModelConfig& config() const noexcept { return config_; }
  const async_grpo::Engine& engine() const noexcept { return engine_; }
  // A cache layout for this model: its layers, KV heads and head_dim (f32, f16 or bf16).
  laminar::KvLayout kv_layout(std::int32_t num_pages, std::int32_t page_size, laminar::DType dtype) const {
    return engine_.kv_layout(num_pages, page_size, dtype);
  }

  // One step for every sequence of `batch`: Engine::step (each feeds its next token; one that fed
  // its last samples the next), with its preconditions.
  laminar::Status step(laminar::PagedKvCache& cache, std::span<laminar::SequenceState* const> batch) const {
    return engine_.step(cache, batch);
  }

  // Adds the sequence to the cache and feeds its whole prompt in one pass, which samples its first
  // response token: Engine::prefill, with its preconditions.
  laminar::Status prefill(laminar::PagedKvCache& cache, laminar::SequenceState& seq) const {
    return engine_.prefill(cache, seq);
  }

 private:
  TinyModel(const TinyModelConfig& config, async_grpo::Engine engine)
      : config_(config), engine_(std::move(engine)) {}

  TinyModelConfig config_;
  async_grpo::Engine engine_;
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
