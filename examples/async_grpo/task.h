// task.h: DigitTask, the generated task the asynchronous GRPO run learns, and its verifier.
//
// Each prompt is a list of digits and an operation; the answer is the list transformed. The list
// length is drawn log-normally, so most responses are short and a few are ten times longer: the
// long tail that leaves rollout workers idle under a synchronous schedule. Prompts are a pure
// function of (seed, index), so any process regenerates prompt i (a lost rollout is generated
// again elsewhere) and the verifier needs nothing but the prompt and the response.
//
//   auto task = async_grpo::DigitTask::create({}, /*seed=*/7);
//   async_grpo::DigitPrompt p = task->prompt(42);        // p.tokens: BOS SORT 3 1 2 SEP
//   std::vector<std::int32_t> out = {1, 2, 3, async_grpo::kEos};
//   float r = task->reward(p, out);                      // 1.0: exact
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "laminar/status.h"

namespace async_grpo {

// Token ids (PolicyConfig::vocab = 16): the digits are their own ids.
inline constexpr std::int32_t kDigits = 10;  // ids 0..9: the digits 0..9
inline constexpr std::int32_t kBos = 10;     // first prompt token
inline constexpr std::int32_t kSep = 11;     // last prompt token: the response starts after it
inline constexpr std::int32_t kEos = 12;     // ends the response
inline constexpr std::int32_t kOpCopy = 13;
inline constexpr std::int32_t kOpReverse = 14;
inline constexpr std::int32_t kOpSort = 15;
inline constexpr std::int32_t kTaskVocab = 16;

// The operation a prompt asks for. The prompt's second token names it (kOpCopy + kind).
enum class DigitOp : std::uint8_t { kCopy = 0, kReverse = 1, kSort = 2 };

// "copy", "reverse", "sort"; parse_digit_op is its inverse (kInvalidArgument naming the text).
std::string_view digit_op_name(DigitOp op) noexcept;
laminar::Result<DigitOp> parse_digit_op(std::string_view name);

struct DigitTaskOptions {
  DigitOp op = DigitOp::kSort;
  // List length n = clamp(round(median_length * exp(length_sigma * z)), 1, max_length), z ~ N(0, 1).
  // sigma 1.1 puts the response length's p99 near ten times its median (n + 1 tokens: 4 and ~40).
  // Median 3 so that RL shows within minutes: after a 30-step warm-up (32 prompts each, 25 s on one
  // thread), 60 GRPO steps of 8 prompts x 8 samples (2-3 minutes) raised held-out sort reward
  // (128 prompts) from 0.25-0.29 to 0.45-0.46 on three seeds; at median 4, 20 steps showed no rise.
  double median_length = 3.0;
  double length_sigma = 1.1;
  // Prompt (n + 3 tokens) plus response (n + 1) must fit the policy's positions: n <= 62 for 128.
  std::int32_t max_length = 62;
  std::int32_t max_positions = 128;
  // Tokens a response may run past the answer's length before the engine cuts it (see
  // max_response_tokens); a cut response has no EOS and earns nothing.
  std::int32_t response_slack = 4;
};

struct DigitPrompt {
  std::uint64_t index = 0;
  std::vector<std::int32_t> tokens;  // [n + 3]: BOS op d_1 .. d_n SEP
  std::vector<std::int32_t> answer;  // [n + 1]: the transformed digits, then EOS
};

// Prompt indices by use, so no run trains on a prompt it evaluates on: RL deals indices from 0,
// a supervised warm-up from kWarmupFirstPrompt, held-out evaluation from kHeldOutFirstPrompt.
inline constexpr std::uint64_t kWarmupFirstPrompt = 1ull << 40;
inline constexpr std::uint64_t kHeldOutFirstPrompt = 1ull << 48;

class DigitTask {
 public:
  // kInvalidArgument naming the option: op not a DigitOp, median_length not in [1, max_length],
  // length_sigma negative or not finite, max_length < 1 or 2 * max_length + 4 > max_positions,
  // response_slack negative.
  static laminar::Result<DigitTask> create(const DigitTaskOptions& options, std::uint64_t seed);

  const DigitTaskOptions& options() const noexcept { return options_; }
  std::uint64_t seed() const noexcept { return seed_; }

  // Prompt `index`: the same (seed, index) gives the same prompt in every process.
  DigitPrompt prompt(std::uint64_t index) const;

  // The most tokens a rollout may generate for `prompt`: its answer's length plus response_slack,
  // within max_positions. Depends only on the prompt's length, which the policy sees too.
  std::int32_t max_response_tokens(const DigitPrompt& prompt) const noexcept;

  // The verifier. `response` is what the policy generated after SEP.
  //   1                       the answer's digits then EOS, nothing after;
  //   0.5 * matches / longer  a well-formed wrong answer: matches counts positions where the
  //                           response's digit equals the answer's, longer is the longer length;
  //   0                       malformed: no EOS, a non-digit before EOS, or tokens after it.
  float reward(const DigitPrompt& prompt, std::span<const std::int32_t> response) const noexcept;

  // The held-out set: prompts kHeldOutFirstPrompt .. + count - 1.
  std::vector<DigitPrompt> held_out_prompts(std::size_t count) const;

 private:
  DigitTask(const DigitTaskOptions& options, std::uint64_t seed) : options_(options), seed_(seed) {}

  DigitTaskOptions options_;
  std::uint64_t seed_ = 0;
};

}  // namespace async_grpo
