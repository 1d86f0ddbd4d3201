// Held-out evaluation through the rollout engine (examples/async_grpo/held_out.h).
#include "held_out.h"

#include <catch2/catch.hpp>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

using async_grpo::DigitTask;
using async_grpo::Engine;

namespace {

// Every weight drawn from N(0, 0.05): a policy that samples varied, mostly malformed responses.
void random_weights(Engine& engine, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<float> w(engine.manifest().total_bytes() / sizeof(float));
  for (float& x : w) x = normal(rng);
  std::vector<std::byte> flat(engine.manifest().total_bytes());
  std::memcpy(flat.data(), w.data(), flat.size());
  REQUIRE(engine.load_weights(flat).ok());
}

}  // namespace

TEST_CASE("grpo held-out: the reward is seeded, in range, and counts every sample") {
  const std::uint64_t seed = std::random_device{}();
  INFO("seed " << seed);
  std::printf("grpo held-out seed %llu\n", static_cast<unsigned long long>(seed));
  auto task = DigitTask::create({}, 4);
  REQUIRE(task.ok());
  auto engine = Engine::create(async_grpo::PolicyConfig{});
  REQUIRE(engine.ok());
  random_weights(*engine, seed);
  const auto prompts = task->held_out_prompts(24);

  // max_live below the sample count: sequences finish and free their slots for the next ones.
  auto r = async_grpo::evaluate_held_out(*engine, *task, prompts, {.samples_per_prompt = 3, .seed = 5, .max_live = 7});
  REQUIRE(r.ok());
  CHECK(r->samples == 72);
  CHECK((r->reward >= 0 && r->reward <= 1));
  CHECK((r->exact >= 0 && r->exact <= r->reward));
  CHECK(r->tokens >= r->samples);
  // A sample's tokens depend on its seed and prompt alone, not on how many decode beside it.
  auto wide = async_grpo::evaluate_held_out(*engine, *task, prompts, {.samples_per_prompt = 3, .seed = 5, .max_live = 72});
  REQUIRE(wide.ok());
  CHECK(wide->reward == r->reward);
  CHECK(wide->tokens == r->tokens);
}

TEST_CASE("grpo held-out: a uniform policy scores near zero") {
  // All-zero weights give equal logits: each token is drawn uniformly from 16, so an exact answer
  // of n + 1 tokens has probability 16^-(n+1) and a well-formed one (digits, then EOS last) is rare.
  auto task = DigitTask::create({}, 9);
  REQUIRE(task.ok());
  auto engine = Engine::create(async_grpo::PolicyConfig{});
  REQUIRE(engine.ok());
  const auto prompts = task->held_out_prompts(64);
  auto r = async_grpo::evaluate_held_out(*engine, *task, prompts, {.seed = 1});
  REQUIRE(r.ok());
  CHECK(r->samples == 64);
  CHECK(r->exact < 0.05);
  CHECK(r->reward < 0.1);
}

TEST_CASE("grpo held-out: bad arguments are refused by name") {
  auto task = DigitTask::create({}, 1);
  REQUIRE(task.ok());
  auto engine = Engine::create(async_grpo::PolicyConfig{});
  REQUIRE(engine.ok());
  const auto prompts = task->held_out_prompts(4);
  CHECK(async_grpo::evaluate_held_out(*engine, *task, {}, {}).status().message().find("no prompts") != std::string::npos);
  CHECK(async_grpo::evaluate_held_out(*engine, *task, prompts, {.samples_per_prompt = 0}).status().message().find(
            "samples_per_prompt") != std::string::npos);
  CHECK(async_grpo::evaluate_held_out(*engine, *task, prompts, {.max_live = 0}).status().message().find("max_live") !=
        std::string::npos);
  async_grpo::DigitPrompt empty;
  CHECK(async_grpo::evaluate_held_out(*engine, *task, std::span(&empty, 1), {}).status().code() ==
        laminar::StatusCode::kInvalidArgument);
}
