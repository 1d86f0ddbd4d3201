// pacing.h: how long a rollout worker's decode and prefill steps take, as on an accelerator. The
// host engine decodes this run's small policy in well under a millisecond a step, at nearly the
// same cost for one sequence as for sixteen. Pacing stretches each step to what the simulator's
// cost model (examples/simulator/cost_model.h: a roofline of weight and KV bytes, FLOPs and a
// per-step overhead) says a named model on a named GPU would take, scaled so the run fits in
// minutes:
//   - each token of this run stands for `tokens` tokens of the named model's rollout, so a
//     sequence's KV and a prompt's prefill are `tokens` times as large, and one decode step of
//     this run is `tokens` decode steps of the named model;
//   - time then runs `speedup` times faster than the named model's.
// So a step of a big batch with long contexts costs more than a step of one short sequence, and
// a batch's prefill costs what its prompts' tokens cost.
//
//   auto pacing = async_grpo::Pacing::create({.model = "qwen2.5-7b", .gpu = "h100"}).value();
//   const std::int64_t t0 = now_ns();
//   engine.step(cache, batch);
//   sleep_until(t0 + pacing.decode(batch.size(), kv_tokens).count());
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "laminar/status.h"

namespace async_grpo {

struct PacingOptions {
  // A model preset of the simulator's cost model (qwen2.5-7b, qwen2.5-32b, qwen2.5-72b), or
  // "none": steps take what the host engine takes.
  std::string model = "qwen2.5-7b";
  std::string gpu = "h100";  // a GPU preset of the cost model (h100, h800)
  double tokens = 256;       // the named model's tokens per token of this run (>= 1)
  double speedup = 128;      // how much faster than the named model the run's time goes (> 0)
};

class Pacing {
 public:
  // kInvalidArgument naming the option: an unknown model or GPU, tokens below 1 or speedup not
  // positive (either not finite).
  static laminar::Result<Pacing> create(const PacingOptions& options);

  const PacingOptions& options() const noexcept { return options_; }
  bool paced() const noexcept { return options_.model != "none"; }

  // One decode step of `batch` >= 1 sequences holding `kv_tokens` >= 0 tokens in all (this run's
  // tokens); 0 when unpaced. Out-of-range arguments are clamped.
  std::chrono::nanoseconds decode(std::int64_t batch, std::int64_t kv_tokens) const;
  // A prefill of `new_tokens` >= 1 prompt tokens in all; 0 when unpaced.
  std::chrono::nanoseconds prefill(std::int64_t new_tokens) const;

  // One line for the report: the model, GPU and scales, and what these take: a decode step of one
  // sequence of `context` tokens and of `batch` of them, and a prefill of `batch` prompts of
  // `prompt` tokens.
  std::string describe(std::int64_t batch, std::int64_t context, std::int64_t prompt) const;

 private:
  struct Model;
  Pacing(PacingOptions options, std::shared_ptr<const Model> model)
      : options_(std::move(options)), model_(std::move(model)) {}

  PacingOptions options_;
  std::shared_ptr<const Model> model_;  // null when unpaced
};

}  // namespace async_grpo
