// The async GRPO example's task (examples/async_grpo/task.h): its length distribution, its
// verifier, and prompts that depend on (seed, index) alone.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdio>
#include <vector>

#include "task.h"

using async_grpo::DigitOp;
using async_grpo::DigitTask;
using async_grpo::DigitTaskOptions;

namespace {

DigitTask make_task(DigitOp op, std::uint64_t seed) {
  DigitTaskOptions o;
  o.op = op;
  auto task = DigitTask::create(o, seed);
  REQUIRE(task.ok());
  return *task;
}

}  // namespace

TEST_CASE("grpo task: response lengths have a long tail that fits the policy") {
  const std::uint64_t seed = 20261127;
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  const DigitTask task = make_task(DigitOp::kSort, seed);
  std::vector<std::size_t> lengths;
  for (std::uint64_t i = 0; i < 20000; ++i) {
    const auto p = task.prompt(i);
    REQUIRE(p.tokens.size() == p.answer.size() + 2);
    REQUIRE(p.tokens.size() + p.answer.size() <= 128);
    REQUIRE(task.max_response_tokens(p) >= std::int32_t(p.answer.size()));
    REQUIRE(p.tokens.size() + std::size_t(task.max_response_tokens(p)) <= 128);
    lengths.push_back(p.answer.size());
  }
  std::sort(lengths.begin(), lengths.end());
  const double median = double(lengths[lengths.size() / 2]);
  const double p99 = double(lengths[lengths.size() * 99 / 100]);
  std::printf("response tokens: min %zu median %.0f p99 %.0f max %zu, p99/median %.2f\n",
              lengths.front(), median, p99, lengths.back(), p99 / median);
  CHECK(lengths.front() == 2);  // one digit and EOS
  CHECK(p99 / median >= 7.0);
  CHECK(p99 / median <= 14.0);
  CHECK(lengths.back() == 63);  // the clip at max_length 62 is reached
}

TEST_CASE("grpo task: the verifier scores exact, partial and malformed responses") {
  const DigitTask task = make_task(DigitOp::kSort, 3);
  std::uint64_t index = 0;
  while (task.prompt(index).answer.size() < 5) ++index;  // four digits or more
  const auto p = task.prompt(index);
  const std::vector<std::int32_t> answer = p.answer;  // digits then EOS
  const auto n = answer.size() - 1;
  std::printf("prompt %llu, %zu digits\n", static_cast<unsigned long long>(index), n);

  CHECK(task.reward(p, answer) == 1.0f);

  auto wrong_first = answer;
  wrong_first[0] = (wrong_first[0] + 1) % 10;
  CHECK(task.reward(p, wrong_first) == Approx(0.5 * double(n - 1) / double(n)));

  auto longer = answer;
  longer.insert(longer.end() - 1, 7);  // one extra digit before EOS
  CHECK(task.reward(p, longer) == Approx(0.5 * double(n) / double(n + 1)));

  const std::vector<std::int32_t> only_eos = {async_grpo::kEos};
  CHECK(task.reward(p, only_eos) == 0.0f);

  auto no_eos = answer;
  no_eos.pop_back();
  CHECK(task.reward(p, no_eos) == 0.0f);
  auto non_digit = answer;
  non_digit[1] = async_grpo::kSep;
  CHECK(task.reward(p, non_digit) == 0.0f);
  auto after_eos = answer;
  after_eos.push_back(3);
  CHECK(task.reward(p, after_eos) == 0.0f);
  auto out_of_vocab = answer;
  out_of_vocab[0] = -4;
  CHECK(task.reward(p, out_of_vocab) == 0.0f);
  CHECK(task.reward(p, {}) == 0.0f);
  CHECK(task.reward(async_grpo::DigitPrompt{}, answer) == 0.0f);
}

TEST_CASE("grpo task: prompts depend on seed and index alone, answers on the op") {
  for (DigitOp op : {DigitOp::kCopy, DigitOp::kReverse, DigitOp::kSort}) {
    const DigitTask a = make_task(op, 11), b = make_task(op, 11), other = make_task(op, 12);
    int differ = 0;
    for (std::uint64_t i = 0; i < 200; ++i) {
      const auto p = a.prompt(i);
      // Asked out of order, from another instance: the same prompt.
      const auto q = b.prompt(199 - i);
      CHECK(b.prompt(i).tokens == p.tokens);
      CHECK(b.prompt(i).answer == p.answer);
      CHECK(a.prompt(199 - i).tokens == q.tokens);
      differ += other.prompt(i).tokens != p.tokens ? 1 : 0;

      REQUIRE(p.tokens.front() == async_grpo::kBos);
      REQUIRE(p.tokens[1] == async_grpo::kOpCopy + std::int32_t(op));
      REQUIRE(p.tokens.back() == async_grpo::kSep);
      REQUIRE(p.answer.back() == async_grpo::kEos);
      std::vector<std::int32_t> digits(p.tokens.begin() + 2, p.tokens.end() - 1);
      for (std::int32_t d : digits) REQUIRE((d >= 0 && d < async_grpo::kDigits));
      if (op == DigitOp::kReverse) std::reverse(digits.begin(), digits.end());
      if (op == DigitOp::kSort) std::sort(digits.begin(), digits.end());
      REQUIRE(std::equal(digits.begin(), digits.end(), p.answer.begin(), p.answer.end() - 1));
    }
    CHECK(differ > 190);
  }
}

TEST_CASE("grpo task: the held-out prompts are their own index range") {
  const DigitTask task = make_task(DigitOp::kSort, 3);
  const auto held_out = task.held_out_prompts(40);
  REQUIRE(held_out.size() == 40);
  for (std::size_t i = 0; i < held_out.size(); ++i) {
    CHECK(held_out[i].index == async_grpo::kHeldOutFirstPrompt + i);
    CHECK(held_out[i].tokens == task.prompt(async_grpo::kHeldOutFirstPrompt + i).tokens);
  }
  // RL deals from 0 and the warm-up from kWarmupFirstPrompt: neither reaches the held-out range.
  STATIC_REQUIRE(async_grpo::kWarmupFirstPrompt < async_grpo::kHeldOutFirstPrompt);
  STATIC_REQUIRE(async_grpo::kHeldOutFirstPrompt - async_grpo::kWarmupFirstPrompt > (1ull << 40));
  CHECK(task.held_out_prompts(0).empty());
}

TEST_CASE("grpo task: options out of range are rejected by name") {
  auto rejects = [](DigitTaskOptions o, const char* field) {
    auto task = DigitTask::create(o, 1);
    REQUIRE_FALSE(task.ok());
    CHECK(task.status().code() == laminar::StatusCode::kInvalidArgument);
    CHECK_THAT(task.status().message(), Catch::Contains(field));
  };
  DigitTaskOptions o;
  o.max_length = 63;  // 63 + 3 prompt tokens and 64 response tokens exceed 128
  rejects(o, "max_length");
  o = {};
  o.median_length = 0.5;
  rejects(o, "median_length");
  o = {};
  o.length_sigma = -1;
  rejects(o, "length_sigma");
  o = {};
  o.response_slack = -1;
  rejects(o, "response_slack");
  o = {};
  o.op = static_cast<DigitOp>(9);
  rejects(o, "op");
  CHECK(async_grpo::parse_digit_op("reverse").value() == DigitOp::kReverse);
  CHECK_FALSE(async_grpo::parse_digit_op("add").ok());
}
