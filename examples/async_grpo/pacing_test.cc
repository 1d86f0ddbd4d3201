#include "pacing.h"

#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>

#include "cost_model.h"

using async_grpo::Pacing;
using async_grpo::PacingOptions;
using laminar::StatusCode;

TEST_CASE("pacing: the cost model's step, as many steps as a token stands for, time scaled", "[pacing]") {
  const Pacing p = Pacing::create({.model = "qwen2.5-7b", .gpu = "h100", .tokens = 256, .speedup = 128}).value();
  CHECK(p.paced());
  laminar::sim::CostConfig config;
  config.gpu = laminar::sim::GpuSpec::preset("h100").value();
  config.model = laminar::sim::ModelSpec::preset("qwen2.5-7b").value();
  const laminar::sim::CostModel cost = laminar::sim::CostModel::create(config).value();
  const double one = double(cost.decode_step(1, 10 * 256)->count());
  CHECK(double(p.decode(1, 10).count()) == Approx(one * 256 / 128).margin(1));
  // A 7B model's decode step streams its weights whatever the batch: one sequence of 10 tokens
  // costs 15-25 ms here. Sixteen long sequences add their KV bytes on top.
  CHECK(p.decode(1, 10) > std::chrono::milliseconds(15));
  CHECK(p.decode(1, 10) < std::chrono::milliseconds(25));
  CHECK(p.decode(16, 16 * 80) > p.decode(16, 16 * 10));
  CHECK(p.decode(16, 16 * 10) > p.decode(1, 10));
  CHECK(p.decode(16, 16 * 80) > p.decode(1, 10) * 1.3);
  // A prefill is one pass over all of its prompts' tokens.
  CHECK(double(p.prefill(96).count()) == Approx(double(cost.prefill(96 * 256)->count()) / 128).margin(1));
  CHECK(p.prefill(96) > p.prefill(6));
  // Out-of-range arguments are clamped, never an error in the decode loop.
  CHECK(p.decode(0, -5) == p.decode(1, 0));
  CHECK(p.prefill(0) == p.prefill(1));

  // Twice the speedup halves every step.
  const Pacing fast = Pacing::create({.model = "qwen2.5-7b", .gpu = "h100", .tokens = 256, .speedup = 256}).value();
  CHECK(double(fast.decode(16, 160).count()) == Approx(double(p.decode(16, 160).count()) / 2).epsilon(1e-6));

  const std::string line = p.describe(16, 10, 6);
  INFO(line);
  CHECK(line.find("qwen2.5-7b on h100") != std::string::npos);
  CHECK(line.find("256 of its tokens") != std::string::npos);
  CHECK(line.find("128x faster") != std::string::npos);
}

TEST_CASE("pacing: none runs at the CPU's speed", "[pacing]") {
  const Pacing p = Pacing::create({.model = "none"}).value();
  CHECK(!p.paced());
  CHECK(p.decode(16, 1000) == std::chrono::nanoseconds(0));
  CHECK(p.prefill(100) == std::chrono::nanoseconds(0));
  CHECK(p.describe(16, 10, 6).find("none") == 0);
}

TEST_CASE("pacing: bad options are refused, naming the option", "[pacing][bad-input]") {
  auto refused = [](PacingOptions o, const char* what) {
    auto p = Pacing::create(o);
    REQUIRE(!p.ok());
    CHECK(p.status().code() == StatusCode::kInvalidArgument);
    INFO(p.status().message());
    CHECK(p.status().message().find(what) != std::string::npos);
  };
  refused({.model = "gpt-5"}, "unknown model 'gpt-5'");
  refused({.gpu = "a100"}, "unknown GPU 'a100'");
  refused({.tokens = 0.5}, "tokens must be");
  refused({.tokens = std::nan("")}, "tokens must be");
  refused({.speedup = 0}, "speedup must be");
  refused({.speedup = INFINITY}, "speedup must be");
}
