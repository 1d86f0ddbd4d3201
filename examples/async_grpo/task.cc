#include "task.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

namespace async_grpo {
namespace {

// splitmix64 (Steele, Lea, Flood 2014): a counter-based generator, so a prompt needs only its
// (seed, index) and no generator state; the same bits on every platform, unlike <random>'s
// distributions.
std::uint64_t splitmix64(std::uint64_t& state) noexcept {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform in (0, 1): 53 random bits, never 0 so the log below is finite.
double uniform(std::uint64_t& state) noexcept {
  return (double(splitmix64(state) >> 11) + 0.5) * 0x1.0p-53;
}

}  // namespace

std::string_view digit_op_name(DigitOp op) noexcept {
  switch (op) {
    case DigitOp::kCopy: return "copy";
    case DigitOp::kReverse: return "reverse";
    case DigitOp::kSort: return "sort";
  }
  return "unknown";
}

laminar::Result<DigitOp> parse_digit_op(std::string_view name) {
  for (DigitOp op : {DigitOp::kCopy, DigitOp::kReverse, DigitOp::kSort}) {
    if (name == digit_op_name(op)) return op;
  }
  return laminar::invalid_argument("digit op '" + std::string(name) +
                                   "' is not copy, reverse or sort");
}

laminar::Result<DigitTask> DigitTask::create(const DigitTaskOptions& o, std::uint64_t seed) {
  if (o.op != DigitOp::kCopy && o.op != DigitOp::kReverse && o.op != DigitOp::kSort) {
    return laminar::invalid_argument("DigitTaskOptions.op " + std::to_string(int(o.op)) +
                                     " is not a DigitOp");
  }
  if (o.max_length < 1 || 2 * std::int64_t(o.max_length) + 4 > o.max_positions) {
    return laminar::invalid_argument("DigitTaskOptions.max_length " + std::to_string(o.max_length) +
                                     ": prompt and response must fit max_positions " +
                                     std::to_string(o.max_positions));
  }
  if (!(o.median_length >= 1.0 && o.median_length <= o.max_length)) {
    return laminar::invalid_argument("DigitTaskOptions.median_length " +
                                     std::to_string(o.median_length) + " not in [1, max_length]");
  }
  if (!(o.length_sigma >= 0.0 && std::isfinite(o.length_sigma))) {
    return laminar::invalid_argument("DigitTaskOptions.length_sigma " +
                                     std::to_string(o.length_sigma) + " must be finite and >= 0");
  }
  if (o.response_slack < 0) {
    return laminar::invalid_argument("DigitTaskOptions.response_slack " +
                                     std::to_string(o.response_slack) + " is negative");
  }
  return DigitTask(o, seed);
}

DigitPrompt DigitTask::prompt(std::uint64_t index) const {
  std::uint64_t state = seed_ ^ (index * 0xd1b54a32d192ed03ull);
  splitmix64(state);
  // Box-Muller: one standard normal from two uniforms.
  const double z = std::sqrt(-2.0 * std::log(uniform(state))) *
                   std::cos(2.0 * std::numbers::pi * uniform(state));
  const double drawn = std::round(options_.median_length * std::exp(options_.length_sigma * z));
  const auto n = std::int32_t(std::clamp(drawn, 1.0, double(options_.max_length)));

  DigitPrompt p;
  p.index = index;
  p.tokens.reserve(std::size_t(n) + 3);
  p.tokens.push_back(kBos);
  p.tokens.push_back(kOpCopy + std::int32_t(options_.op));
  std::vector<std::int32_t> digits(static_cast<std::size_t>(n));
  for (auto& d : digits) d = std::int32_t(splitmix64(state) % kDigits);
  p.tokens.insert(p.tokens.end(), digits.begin(), digits.end());
  p.tokens.push_back(kSep);

  switch (options_.op) {
    case DigitOp::kCopy: break;
    case DigitOp::kReverse: std::reverse(digits.begin(), digits.end()); break;
    case DigitOp::kSort: std::sort(digits.begin(), digits.end()); break;
  }
  p.answer = std::move(digits);
  p.answer.push_back(kEos);
  return p;
}

std::int32_t DigitTask::max_response_tokens(const DigitPrompt& prompt) const noexcept {
  const auto answer = std::int64_t(prompt.tokens.size()) - 2;  // n digits and EOS
  const auto room = std::int64_t(options_.max_positions) - std::int64_t(prompt.tokens.size());
  return std::int32_t(std::max<std::int64_t>(0, std::min(answer + options_.response_slack, room)));
}

float DigitTask::reward(const DigitPrompt& prompt,
                        std::span<const std::int32_t> response) const noexcept {
  if (prompt.answer.empty()) return 0.0f;  // not a prompt this task made
  const auto eos = std::find(response.begin(), response.end(), kEos);
  if (eos == response.end() || eos + 1 != response.end()) return 0.0f;
  const auto digits = response.first(std::size_t(eos - response.begin()));
  for (std::int32_t t : digits) {
    if (t < 0 || t >= kDigits) return 0.0f;
  }
  const std::span<const std::int32_t> want(prompt.answer.data(), prompt.answer.size() - 1);
  if (std::equal(digits.begin(), digits.end(), want.begin(), want.end())) return 1.0f;
  const std::size_t common = std::min(digits.size(), want.size());
  std::size_t matches = 0;
  for (std::size_t i = 0; i < common; ++i) matches += digits[i] == want[i] ? 1 : 0;
  return 0.5f * float(matches) / float(std::max(digits.size(), want.size()));
}

std::vector<DigitPrompt> DigitTask::held_out_prompts(std::size_t count) const {
  std::vector<DigitPrompt> out;
  out.reserve(count);
  for (std::size_t i = 0; i < count; ++i) out.push_back(prompt(kHeldOutFirstPrompt + i));
  return out;
}

}  // namespace async_grpo
