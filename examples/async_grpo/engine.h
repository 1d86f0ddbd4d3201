// engine.h: the rollout workers' inference loop for the policy of policy_config.h: its matmuls,
// norms and MLP in plain C++ on the host, its attention through laminar's paged decode/prefill
// kernel over a PagedKvCache, its sampling through laminar's sampler. With
// EngineOptions::device = kCuda (a build with CUDA) the same loop runs on a GPU: the weights in
// device memory, the matmuls through cuBLAS, attention and sampling through laminar's CUDA kernels,
// over a cache whose pools are device memory (make_cache).
//
// The weights live in one flat host f32 buffer laid out by weight_manifest(config), so a
// WeightPuller copies a version straight into weight_tensors(), and load_weights() takes the same
// bytes from a file or a test. Every row of every matmul, norm and MLP is computed by the same code
// in a fixed order whatever the rows around it, and the kernels promise the same for attention and
// sampling, so a sequence's tokens and log-probs depend on nothing but its own tokens, seed and the
// weights: not on its batch mates, its pages, or whether its prompt went in one pass or token by
// token. score() re-reads a finished trajectory through the prefill form and gives the behaviour
// log-probs back bit for bit.
//
// Threads: the const calls keep no state of their own, so threads may run them at once on separate
// caches (on a device they take turns on the engine's stream); nothing may write the weights (a
// pull, load_weights) while one runs.
//
// On a device (kCuda) every matmul is one cublasSgemv per row, the same call (shapes, alignment,
// pedantic math, no atomics) for every row, since cuBLAS may pick another algorithm for another
// batch size; the norms reduce each row on one thread in index order, and the kernels keep their
// promises. So a row's bits still depend on nothing but its own inputs, and score() equals the
// log-probs step() and prefill() recorded bit for bit on the same device (same GPU model and
// cuBLAS version). The device does not give the host's bits: its dot products sum in
// cuBLAS' order and exp() is the GPU's, so log-probs differ from the host engine's by rounding
// (async_grpo_engine_cuda_test bounds the difference), and a re-scoring check compares host with
// host and device with device. The GPU test, on a machine with a CUDA device:
//   cmake --preset default -B build/cuda -DLAMINAR_CUDA=ON
//   cmake --build build/cuda --target async_grpo_engine_cuda_test
//   ctest --test-dir build/cuda -R async_grpo_engine_cuda_test --output-on-failure
//
//   auto engine = async_grpo::Engine::create(async_grpo::PolicyConfig{}, {.device = EngineDevice::kCuda}).value();
//   LAMINAR_RETURN_IF_ERROR(puller->pull(v, engine.weight_tensors(), /*has_live_trajectory=*/false));
//   LAMINAR_RETURN_IF_ERROR(engine.check_weights());      // on a device, also copies them there
//   auto cache = engine.make_cache(256, 16).value();       // host or device pools, as the engine runs
//   LAMINAR_RETURN_IF_ERROR(engine.prefill(*cache, seq));  // whole prompt, samples the first token
//   laminar::SequenceState* batch[] = {&seq};
//   while (seq.response_tokens.size() < 32) LAMINAR_RETURN_IF_ERROR(engine.step(*cache, batch));
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "laminar/kv_cache.h"
#include "laminar/kernels/sampling.h"
#include "laminar/kv_migrator.h"
#include "laminar/relay_store.h"
#include "laminar/status.h"
#include "laminar/types.h"
#include "laminar/weight_manifest.h"
#include "policy_config.h"

namespace async_grpo {

enum class EngineDevice { kCpu, kCuda };

struct EngineOptions {
  std::int32_t cpu_threads = 1;  // host: threads of the attention and sampling kernels; 0: all
  EngineDevice device = EngineDevice::kCpu;
  std::int32_t cuda_device = 0;  // kCuda: the device's ordinal
};

class Engine {
 public:
  // The weights start at zero. kInvalidArgument naming the field of a config validate() refuses, a
  // negative cpu_threads or cuda_device. kCuda: kUnimplemented in a build without CUDA;
  // kFailedPrecondition naming the CUDA error when there is no such device or no driver.
  static laminar::Result<Engine> create(const PolicyConfig& config, const EngineOptions& options = {});

  const PolicyConfig& config() const noexcept { return config_; }
  const EngineOptions& options() const noexcept { return options_; }
  // weight_manifest(config()): names, shapes and offsets of the weight buffer.
  const laminar::WeightManifest& manifest() const noexcept { return manifest_; }

  // One host f32 view per manifest entry, in manifest order, into the weight buffer: the
  // destinations of WeightPuller::pull. Valid while the engine lives (moves included). On a device
  // the engine runs on the weights the last load_weights() or check_weights() found valid: call
  // check_weights() after writing these views.
  std::vector<laminar::NamedTensor> weight_tensors();
  // The weight buffer, manifest().total_bytes() bytes.
  std::span<const std::byte> weight_bytes() const noexcept;
  // Copies a flat buffer laid out by `layout` into the weights. Preconditions (kInvalidArgument
  // naming the entry or the size, and the weights unchanged):
  //   layout equals manifest(): same names, dtypes, shapes and offsets in the same order;
  //   bytes.size() == manifest().total_bytes();
  //   every weight finite.
  laminar::Status load_weights(const laminar::WeightManifest& layout, std::span<const std::byte> bytes);
  laminar::Status load_weights(std::span<const std::byte> bytes) { return load_weights(manifest_, bytes); }
  // kInvalidArgument naming the first weight that is NaN or infinite (e.g. after a pull). On a
  // device, weights that pass are copied there (kFailedPrecondition naming a CUDA error).
  laminar::Status check_weights();

  // A cache layout for this model: its layers, KV heads and head_dim. The engine runs on caches of
  // f32, f16 or bf16 in host memory; f32 (the default) rounds nothing, f16 and bf16 round q, K, V
  // and the attention output to the cache's dtype (the bits still agree across batches and passes).
  laminar::KvLayout kv_layout(std::int32_t num_pages, std::int32_t page_size,
                              laminar::DType dtype = laminar::DType::kF32) const;
  // A cache of kv_layout(num_pages, page_size, dtype) where the engine runs: pools in host memory,
  // or in the engine's device memory (freed with the cache). kInvalidArgument for a bad layout,
  // kResourceExhausted when the memory is not there.
  laminar::Result<std::shared_ptr<laminar::PagedKvCache>> make_cache(std::int32_t num_pages, std::int32_t page_size,
                                                                     laminar::DType dtype = laminar::DType::kF32) const;

  // Adds each sequence to the cache and feeds its whole prompt through the prefill form of the
  // paged kernel in one pass, then samples its first response token (appended with its raw
  // log-prob; rng_position advances). Preconditions, each an error naming the sequence and nothing
  // changed:
  //   the cache's layout is this model's (layers, KV heads, head_dim; f32/f16/bf16), where the
  //   engine runs (the host, or its CUDA device);
  //   a non-empty prompt, no response or log-probs yet, kv_length 0, the id not in the cache
  //   (kAlreadyExists), no id twice;
  //   prompt tokens in [0, vocab), prompt shorter than max_positions (room for the sampled token);
  //   sampling settings as kernels::SamplingParams takes them, rng_position < 2^63;
  //   enough free pages for the prompts (kResourceExhausted).
  laminar::Status prefill(laminar::PagedKvCache& cache, std::span<laminar::SequenceState* const> batch) const;
  laminar::Status prefill(laminar::PagedKvCache& cache, laminar::SequenceState& seq) const;

  // One step for every sequence of `batch`: each feeds its next token (index kv_length of prompt
  // then response) at position kv_length, and grows its cache entry by that token. A sequence that
  // fed its last token samples the next, keyed by (seed, rng_position): it is appended to
  // response_tokens with its raw log-prob, and rng_position advances. Preconditions, each an error
  // naming the sequence and nothing changed:
  //   the cache's layout is this model's, where the engine runs (kInvalidArgument);
  //   each sequence in the cache (kNotFound) with length kv_length, no sequence twice;
  //   kv_length < prompt + response tokens, the token it feeds in [0, vocab);
  //   one log-prob per response token;
  //   a sequence that samples has fewer than max_positions tokens;
  //   sampling settings as kernels::SamplingParams takes them, rng_position < 2^63;
  //   enough free pages for the batch's growth (kResourceExhausted).
  // kFailedPrecondition naming the sequence when its logits are not finite (weights that
  // check_weights() refuses): the batch's sequences then hold one more token in the cache than
  // their states say, so release them.
  laminar::Status step(laminar::PagedKvCache& cache, std::span<laminar::SequenceState* const> batch) const;

  // Logits [tokens.size(), vocab] of every position of `tokens`, fed in one prefill pass as
  // sequence `scratch`, which the call adds to the cache and releases. Preconditions
  // (kInvalidArgument unless said, nothing changed): the cache's layout is this model's; 1 to
  // max_positions tokens, each in [0, vocab); scratch not in the cache (kAlreadyExists); enough free
  // pages (kResourceExhausted).
  laminar::Result<std::vector<float>> logits(laminar::PagedKvCache& cache, laminar::SequenceId scratch,
                                             std::span<const std::int32_t> tokens) const;

  // Re-scores a finished trajectory: the log-prob of each response token given the tokens before
  // it, from one prefill pass (as logits()) and kernels::TokenLogprobParams. Equal bit for bit to
  // the raw log-probs step() and prefill() recorded while sampling it. Preconditions as logits() for
  // prompt + response minus its last token, with a non-empty prompt and response.
  laminar::Result<std::vector<float>> score(laminar::PagedKvCache& cache, laminar::SequenceId scratch,
                                            std::span<const std::int32_t> prompt,
                                            std::span<const std::int32_t> response) const;

 private:
  // Rows of one forward pass: sequence b feeds tokens [start[b], start[b] + count[b]) of its own.
  struct Pass {
    std::vector<laminar::SequenceId> ids;  // [batch]
    std::vector<std::int64_t> start;       // [batch] position of the sequence's first fed token
    std::vector<std::int32_t> count;       // [batch] tokens it feeds, >= 1
    std::vector<std::int32_t> tokens;      // [rows] fed tokens, sequence by sequence
    std::vector<std::int64_t> logit_rows;  // rows whose logits the caller wants, in output order
  };
  // The device path (engine_cuda.cc): its weights, stream and cuBLAS handle.
  struct Cuda;
  struct CudaDeleter {
    void operator()(Cuda* cuda) const noexcept;
  };
  // What a device pass does with the logits of pass.logit_rows: exactly one is set, each with host
  // arrays.
  struct LogitsUse {
    float* logits = nullptr;  // [logit_rows, vocab]: copied back
    // Settings in, token and raw_logprob out; logits, logits_dtype and row_stride ignored.
    const laminar::kernels::SamplingParams* sample = nullptr;
    // token in, logprob out; logits, logits_dtype and row_stride ignored.
    const laminar::kernels::TokenLogprobParams* score = nullptr;
  };
  // The weights of one layer, pointers into weights_.
  struct LayerWeights {
    const float* attn_norm;  // [d_model]
    const float* wq;         // [num_qo_heads * head_dim, d_model]
    const float* wk;         // [num_kv_heads * head_dim, d_model]
    const float* wv;         // [num_kv_heads * head_dim, d_model]
    const float* wo;         // [d_model, num_qo_heads * head_dim]
    const float* mlp_norm;   // [d_model]
    const float* w_gate;     // [d_ff, d_model]
    const float* w_up;       // [d_ff, d_model]
    const float* w_down;     // [d_model, d_ff]
  };

  Engine(const PolicyConfig& config, const EngineOptions& options, laminar::WeightManifest manifest);
  const float* weight(std::size_t entry) const;
  LayerWeights layer(std::int32_t l) const;
  laminar::Status check_cache(const laminar::PagedKvCache& cache, const char* call) const;
  // Runs the rows of `pass` (already appended to the cache) through the model; writes the logits
  // of the rows pass.logit_rows names into `logits` [logit_rows.size(), vocab].
  laminar::Status forward(laminar::PagedKvCache& cache, const Pass& pass, float* logits) const;
  // Feeds `tokens` in one prefill pass as sequence `scratch` (added to the cache and released) and
  // hands the logits of rows [first_row, tokens.size()) to `use`. Preconditions as logits().
  laminar::Status feed(laminar::PagedKvCache& cache, laminar::SequenceId scratch, std::span<const std::int32_t> tokens,
                       std::size_t first_row, const LogitsUse& use) const;
  // Runs `pass` on the device, then `use` on its logit rows.
  laminar::Status forward_cuda(laminar::PagedKvCache& cache, const Pass& pass, const LogitsUse& use) const;
  // Runs `pass` and samples logit row r for batch[r], appending the token; kFailedPrecondition when
  // a row has no distribution.
  laminar::Status forward_sample(laminar::PagedKvCache& cache, const Pass& pass,
                                 std::span<laminar::SequenceState* const> batch) const;
  // kCuda: the device state with the weights zeroed; kUnimplemented in a build without CUDA.
  static laminar::Result<std::unique_ptr<Cuda, CudaDeleter>> create_cuda(std::int32_t ordinal,
                                                                          std::size_t weight_bytes);
  // Copies the host weights to the device.
  laminar::Status upload_weights();
  laminar::Result<std::shared_ptr<laminar::PagedKvCache>> make_device_cache(const laminar::KvLayout& layout) const;

  PolicyConfig config_;
  EngineOptions options_;
  laminar::WeightManifest manifest_;
  std::vector<float> weights_;  // manifest_.total_bytes() / 4 floats
  std::unique_ptr<Cuda, CudaDeleter> cuda_;  // null on the host
};

}  // namespace async_grpo
