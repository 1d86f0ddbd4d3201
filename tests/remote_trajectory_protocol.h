// Shared by remote_trajectory_queue_test and its child program remote_producer_child: the
// trajectory both sides derive from an id, so the test can check every byte that arrived.
#pragma once

#include <cstdint>
#include <string>

#include "laminar/trajectory_queue.h"

namespace laminar::test_remote {

inline Trajectory make(std::uint64_t id) {
  Trajectory t;
  t.id = TrajectoryId(id);
  t.prompt_id = PromptId(id / 3);
  t.prompt_tokens.assign(8 + id % 32, std::int32_t(id % 1000));
  const std::size_t n = 1000 + (id * 7919) % 3000;  // 1-4k response tokens
  t.response_tokens.resize(n);
  t.logprobs.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    t.response_tokens[i] = std::int32_t((id * 31 + i) % 50000);
    t.logprobs[i] = -float((id + i) % 97) / 16.0f;
  }
  t.rewards = {float(id % 2), 0.5f};
  t.timings = {std::int64_t(id), std::int64_t(id) + 1000};
  t.metadata = "{\"id\": " + std::to_string(id) + "}";
  return t;
}

}  // namespace laminar::test_remote
