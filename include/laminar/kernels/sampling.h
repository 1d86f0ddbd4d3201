// sampling.h: token sampling from logits with per-row temperature, top-k, top-p and min-p, and
// the selected-token log-prob kernel the trainer uses to score the same tokens.
//
// A rollout worker decodes one token per live sequence per step: the engine produces logits
// [batch, vocab], sample() picks each row's token with counter-based Philox randomness keyed by
// (request seed, token position), and the token's log-probs go into the trajectory as behaviour
// log-probs. The trainer later calls token_logprob() on its own logits and gets, for the same
// logits, the same bits as raw_logprob. Results depend only on the row's own logits and settings:
// never on its batch row or batch mates, the thread count, or CPU vs CUDA.
//
//   laminar::kernels::SamplingParams p;
//   p.logits = logits; p.logits_dtype = laminar::DType::kBF16; p.batch = b; p.vocab = v;
//   p.temperature = temps; p.top_p = top_ps; p.seed = seeds; p.position = positions;
//   p.token = out_tokens; p.raw_logprob = out_logprobs;
//   laminar::Status st = laminar::kernels::run(p, laminar::Stream::host());
//
// From tensors (DLPack views of an engine's buffers, every shape, dtype, stride and device checked):
//   laminar::kernels::SamplingTensors t{.logits = logits_view, .seed = seeds, .position = positions,
//                                       .token = tokens};
//   auto p = laminar::kernels::SamplingParams::from_tensors(t);
//
// Semantics (the readable reference in ref/sampling.h spells out the same rules):
// - Temperature T < 1e-5 (0 included) is greedy: the largest logit, ties to the lowest token id.
// - Randomness: Philox4x32-10 keyed by the row's seed, counter = its position. Give each sequence
//   its own seed (e.g. a hash of the request seed and the sequence id); positions then never repeat.
// - Otherwise the distribution is p_i ∝ exp((x_i - max) / T). The kept set is every token whose
//   logit is >= a threshold, the largest of: the k-th largest logit (top_k; ties with it are kept,
//   so more than k tokens survive when logits tie; 0 disables), the smallest logit whose upper set
//   holds >= top_p of the top-k set's mass (top_p = 1 disables; top_p = 0 keeps only the tokens
//   tied at the maximum), and min-p (p_i >= min_p * p_max; 0 disables). The token is drawn from
//   the kept set renormalised: the first token, in id order, whose running weight exceeds
//   floor(u * kept weight), u being the 64 Philox bits as a fraction.
// - Weights are exp((x_i - max) / T) in 40-bit fixed point (tokens more than 28 below the maximum,
//   in units of T, weigh 0: a probability below 7e-13 of the top token's). Sums of integers do not
//   depend on their order, which is what makes every path agree bit for bit. raw_logprob is
//   (x - max) - log(sum of the T = 1 weights / 2^40), in float, the same way in every path.
// - A row whose logits hold a NaN or +inf, or are all -inf, has no distribution: its token is
//   kInvalidToken, its log-probs NaN and its kept mass 0.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "laminar/status.h"
#include "laminar/types.h"

namespace laminar::kernels {

// Largest vocabulary: keeps the sum of 40-bit weights of a whole row below 2^63.
inline constexpr std::int64_t kMaxSamplingVocab = std::int64_t(1) << 23;
// Token written for a row with no valid distribution (NaN or +inf logits, or all -inf).
inline constexpr std::int32_t kInvalidToken = -1;

struct SamplingTensors;
struct TokenLogprobTensors;

struct SamplingParams {
  const void* logits = nullptr;  // [batch, row_stride] of logits_dtype; the first vocab of each row
  DType logits_dtype = DType::kF32;  // f32, f16 or bf16
  std::int64_t batch = 0;
  std::int64_t vocab = 0;       // 1..kMaxSamplingVocab
  std::int64_t row_stride = 0;  // elements between rows; 0 means vocab

  // Per-row settings; a null pointer gives every row the default.
  const float* temperature = nullptr;   // [batch]; finite, >= 0; below 1e-5 = greedy; default 1
  const std::int32_t* top_k = nullptr;  // [batch]; >= 0; 0 = disabled (default)
  const float* top_p = nullptr;         // [batch]; in [0, 1]; 1 = disabled (default)
  const float* min_p = nullptr;         // [batch]; in [0, 1]; 0 = disabled (default)
  const std::uint64_t* seed = nullptr;  // [batch]; the request's seed
  const std::int64_t* position = nullptr;  // [batch]; >= 0; the token's position in its sequence

  std::int32_t* token = nullptr;         // [batch] out: sampled token id
  float* raw_logprob = nullptr;          // [batch] out, optional: log-softmax of the raw logits
  float* processed_logprob = nullptr;    // [batch] out, optional: log-prob under the distribution
                                         //   sampled from (0 for greedy)
  float* kept_mass = nullptr;            // [batch] out, optional: mass of the kept set under the
                                         //   temperature-scaled softmax (1 for greedy)

  std::int32_t cpu_threads = 0;  // host stream only: worker threads over rows; 0 = hardware concurrency

  // Fills every field but cpu_threads from the views (see SamplingTensors), which must all be on
  // the host or all on one CUDA device. kInvalidArgument naming the tensor and the mismatch.
  static Result<SamplingParams> from_tensors(const SamplingTensors& t);
};

// The tensors of one sample() call. Per-row tensors are dense [batch]; an absent optional one gives
// every row the default. Seeds are i64 as frameworks hold them (torch has no uint64): their bits are
// the uint64 seed. top_k is i32 and token i32, the types the kernels read and write in place.
struct SamplingTensors {
  TensorView logits;                      // [batch, vocab] f32/f16/bf16; dim 1 dense, any row stride >= vocab
  std::optional<TensorView> temperature;  // [batch] f32
  std::optional<TensorView> top_k;        // [batch] i32
  std::optional<TensorView> top_p;        // [batch] f32
  std::optional<TensorView> min_p;        // [batch] f32
  TensorView seed;                        // [batch] i64
  TensorView position;                    // [batch] i64
  TensorView token;                       // [batch] i32 out
  std::optional<TensorView> raw_logprob;        // [batch] f32 out
  std::optional<TensorView> processed_logprob;  // [batch] f32 out
  std::optional<TensorView> kept_mass;          // [batch] f32 out
};

// kInvalidArgument for a negative batch, a vocab outside 1..kMaxSamplingVocab, a row_stride below
// vocab, a dtype other than f32/f16/bf16, a negative cpu_threads, or a null required pointer
// (logits, seed, position, token) with batch > 0.
// On a CUDA stream, also a batch above 2^31 - 1 rows (one block per row).
Status can_implement(const SamplingParams& p, Stream stream);
// Always 0: each row's scratch lives in the kernel's own memory (shared memory on CUDA).
std::size_t workspace_bytes(const SamplingParams& p);
// Host stream: also checks every row's settings (kInvalidArgument naming the row, the field and
// its value) before writing any output, then runs on cpu_threads threads. CUDA stream: pointers
// are device memory; a row whose settings are out of range gets kInvalidToken; returns without
// waiting. kUnimplemented for a CUDA stream in a build without CUDA; kFailedPrecondition when no
// CUDA device or driver takes the launch.
Status run(const SamplingParams& p, Stream stream);
// Checks every row's settings in host memory (the per-row part of run() on the host stream):
// kInvalidArgument naming the row, the field and its value.
Status check_row_settings(const SamplingParams& p);

struct TokenLogprobParams {
  const void* logits = nullptr;  // [batch, row_stride] of logits_dtype; the first vocab of each row
  DType logits_dtype = DType::kF32;
  std::int64_t batch = 0;
  std::int64_t vocab = 0;       // 1..kMaxSamplingVocab
  std::int64_t row_stride = 0;  // elements between rows; 0 means vocab
  const std::int32_t* token = nullptr;  // [batch]; in [0, vocab)
  float* logprob = nullptr;             // [batch] out: log-softmax(logits[row])[token[row]],
                                        //   bit-identical to SamplingParams::raw_logprob
  std::int32_t cpu_threads = 0;  // host stream only; 0 = hardware concurrency

  // Fills every field but cpu_threads from the views (see TokenLogprobTensors). An i64 token tensor
  // (the dtype frameworks hold token ids in) is accepted on the host: it is copied, each id checked
  // to fit int32, into *token_copy, which must then be given and outlive the params. On a CUDA
  // device the kernel reads the ids in place, so they must be i32 there.
  static Result<TokenLogprobParams> from_tensors(const TokenLogprobTensors& t,
                                                 std::vector<std::int32_t>* token_copy = nullptr);
};

struct TokenLogprobTensors {
  TensorView logits;   // [batch, vocab] f32/f16/bf16; dim 1 dense, any row stride >= vocab
  TensorView token;    // [batch] i32 (i64 on the host)
  TensorView logprob;  // [batch] f32 out
};

// Same structural checks as for SamplingParams.
Status can_implement(const TokenLogprobParams& p, Stream stream);
// Always 0.
std::size_t workspace_bytes(const TokenLogprobParams& p);
// Host stream: kInvalidArgument naming the row when a token id is outside [0, vocab). CUDA stream:
// such a row gets NaN; kFailedPrecondition when no CUDA device or driver takes the launch. A row
// with NaN or +inf logits, or all -inf, gets NaN.
Status run(const TokenLogprobParams& p, Stream stream);

}  // namespace laminar::kernels
