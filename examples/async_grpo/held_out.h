// held_out.h: the policy's reward on prompts no run trains on, measured with the rollout engine
// (engine.h), so a published version is scored by the same inference loop that generated its
// training samples. The async GRPO launcher scores every published version with it after a
// schedule, and grpo_learning_curve scores its trainer's weights with it every few steps.
//
//   auto engine = async_grpo::Engine::create(async_grpo::PolicyConfig{}).value();
//   LAMINAR_RETURN_IF_ERROR(engine.load_weights(flat));                 // a published version
//   const auto prompts = task.held_out_prompts(128);
//   auto r = async_grpo::evaluate_held_out(engine, task, prompts, {.seed = 7});
//   if (r.ok()) std::printf("held-out reward %.3f\n", r->reward);
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "engine.h"
#include "laminar/status.h"
#include "task.h"

namespace async_grpo {

struct HeldOutOptions {
  std::int32_t samples_per_prompt = 1;
  // Sample s of prompt i is keyed by (seed, i, s): two versions evaluated with one seed differ in
  // their weights alone.
  std::uint64_t seed = 0;
  std::int32_t max_live = 64;  // sequences decoded at once
};

struct HeldOutReward {
  double reward = 0;  // mean verifier reward over the samples, in [0, 1]
  double exact = 0;   // fraction of samples with reward 1
  std::size_t samples = 0;
  std::size_t tokens = 0;  // response tokens generated
};

// Samples each prompt at temperature 1 (the policy's own distribution), each response up to
// task.max_response_tokens(prompt) tokens or EOS, and scores it with task.reward.
// kInvalidArgument for no prompts, samples_per_prompt or max_live < 1, or a prompt that does not
// fit the engine's max_positions with its response budget; kFailedPrecondition when the engine's
// weights give no distribution (check_weights refuses them).
laminar::Result<HeldOutReward> evaluate_held_out(const Engine& engine, const DigitTask& task,
                                                 std::span<const DigitPrompt> prompts,
                                                 const HeldOutOptions& options = {});

}  // namespace async_grpo
