// test_model.h: the tiny transformer the library's KV tests decode with (test_model_test, and
// kv_migrator_multiprocess_test with its child kv_migrator_peer through kv_migrator_workload.h).
// Built on laminar's public API only: a PagedKvCache, the paged decode/prefill kernel, the cast
// kernel and the sampler, all on the host.
//
//   x = embed[token] + pos_embed[position]
//   per layer: h = norm(x); x += attention(h wq^T, h wk^T, h wv^T) wo^T   (K and V go to the cache)
//   logits = norm(x) lm_head^T,   norm(x) = x / sqrt(mean(x^2) + 1e-5)
//
// Its weights are a function of one seed (an integer hash: every process and build makes the same
// ones). Every row is computed by the same code in a fixed order and the kernels are batch-invariant,
// so a sequence's tokens and log-probs depend only on its own tokens, its seed and the weights: not
// on its batch mates, its pages or the cache it lives in, which is what lets the KvMigrator move it
// mid-decode bit for bit. A sequence is its laminar::SequenceState plus its pages.
//
//   auto model = laminar::testing::TestModel::create({.seed = 7}).value();
//   auto cache = laminar::PagedKvCache::create(model.kv_layout(256, 16, laminar::DType::kBF16)).value();
//   laminar::SequenceState s = laminar::testing::start_sequence(laminar::SequenceId(1), {3, 1, 4}, 42);
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

namespace laminar::testing {

struct TestModelConfig {
  std::uint64_t seed = 1;  // the weights depend on it alone
  std::int32_t vocab = 64;
  std::int32_t num_layers = 2;
  std::int32_t d_model = 128;
  std::int32_t num_qo_heads = 4;
  std::int32_t num_kv_heads = 2;  // num_qo_heads / num_kv_heads is 1, 2, 4 or 8 (the kernel's groups)
  std::int32_t head_dim = 64;     // 64 or 128 (the paged kernel's)
  std::int32_t max_positions = 1024;  // prompt plus response tokens of one sequence
  std::int32_t cpu_threads = 1;       // threads of the attention and sampling kernels; 0: all
};

class TestModel {
 public:
  // kInvalidArgument naming the field: a count out of range, head_dim not 64/128, a GQA group the
  // kernel does not take.
  static Result<TestModel> create(const TestModelConfig& config);

  const TestModelConfig& config() const noexcept { return config_; }
  // A cache layout for this model: its layers, KV heads and head_dim (f32, f16 or bf16).
  KvLayout kv_layout(std::int32_t num_pages, std::int32_t page_size, DType dtype) const;

  // Adds the sequence to the cache and feeds its whole prompt in one prefill pass, which samples
  // its first response token. Preconditions (kInvalidArgument unless said; nothing changed):
  //   the cache's layout is this model's; a prompt of 1 to max_positions - 1 tokens in [0, vocab),
  //   no response yet, kv_length 0, the id not in the cache (kAlreadyExists), sampling settings the
  //   sampler takes; free pages for the prompt (kResourceExhausted).
  Status prefill(PagedKvCache& cache, SequenceState& seq) const;

  // One step for every sequence of `batch`: each feeds its next token (index kv_length of prompt
  // then response); one that fed its last samples the next (appended with its raw log-prob;
  // rng_position advances). Preconditions (kInvalidArgument unless said; nothing changed):
  //   the cache's layout is this model's; no sequence twice or null;
  //   each in the cache (kNotFound) holding kv_length tokens, with a token left to feed, in [0, vocab);
  //   one that samples has fewer than max_positions tokens, sampling settings the sampler takes;
  //   free pages for the batch's growth (kResourceExhausted).
  Status step(PagedKvCache& cache, std::span<SequenceState* const> batch) const;

 private:
  explicit TestModel(const TestModelConfig& config);
  const float* embed() const { return weights_.data(); }  // [vocab, d_model]
  const float* pos_embed() const;                          // [max_positions, d_model]
  // Layer l's wq [qo_dim, d_model], wk and wv [kv_dim, d_model], wo [d_model, qo_dim], in turn.
  const float* layer(std::int32_t l) const;
  const float* lm_head() const;  // [vocab, d_model]
  // The checks of prefill() and step(); `prefill` says which.
  Status check(const PagedKvCache& cache, std::span<SequenceState* const> batch, bool prefill) const;
  // Feeds `count[b]` tokens of batch[b] from its kv_length (already appended to the cache) and
  // samples the next token of each sequence that fed its last.
  Status forward(PagedKvCache& cache, std::span<SequenceState* const> batch,
                 std::span<const std::int32_t> count) const;

  TestModelConfig config_;
  std::vector<float> weights_;
};

// A new sequence: its prompt and sampling settings, nothing fed yet. Its trajectory id is its
// sequence id, and its RNG position the index of its first response token.
SequenceState start_sequence(SequenceId id, std::vector<std::int32_t> prompt, std::uint64_t seed,
                             float temperature = 0.8f, float top_p = 0.95f);

// Prompt and response tokens.
inline std::int64_t total_tokens(const SequenceState& s) {
  return std::int64_t(s.prompt_tokens.size() + s.response_tokens.size());
}

}  // namespace laminar::testing
