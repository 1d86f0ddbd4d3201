// realistic_trajectory.h: the trajectories the queue benchmarks move, shaped like GRPO rollouts of
// an LLM: 256 prompt tokens, 1-4k response tokens with a behaviour log-prob each, one reward and a
// small JSON metadata object. The caller sets ids and groups.
#pragma once

#include <cstdint>
#include <random>

#include "laminar/trajectory_queue.h"

namespace laminar::bench {

inline void fill_realistic(Trajectory& t, std::mt19937& rng) {
  t.prompt_tokens.resize(256);
  for (auto& tok : t.prompt_tokens) tok = std::int32_t(rng() % 151000);
  const std::size_t len = 1024 + rng() % 3073;  // 1-4k response tokens
  t.response_tokens.resize(len);
  t.logprobs.resize(len);
  for (std::size_t k = 0; k < len; ++k) {
    t.response_tokens[k] = std::int32_t(rng() % 151000);
    t.logprobs[k] = -float(rng() % 1000) / 100.0f;
  }
  t.rewards = {float(rng() % 2)};
  t.finish_reason = FinishReason::kStop;
  t.timings = {1000, 2000};
  t.metadata = R"({"task": "math", "source": "gsm8k"})";
}

}  // namespace laminar::bench
