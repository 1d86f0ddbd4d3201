#include "pacing.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "cost_model.h"

namespace async_grpo {

struct Pacing::Model {
  laminar::sim::CostModel cost;
};

laminar::Result<Pacing> Pacing::create(const PacingOptions& options) {
  if (!(std::isfinite(options.tokens) && options.tokens >= 1))
    return laminar::invalid_argument(fmt::format("pacing: tokens must be a finite value >= 1, got {}", options.tokens));
  if (!(std::isfinite(options.speedup) && options.speedup > 0))
    return laminar::invalid_argument(fmt::format("pacing: speedup must be a finite value > 0, got {}", options.speedup));
  if (options.model == "none") return Pacing(options, nullptr);
  laminar::Result<laminar::sim::GpuSpec> gpu = laminar::sim::GpuSpec::preset(options.gpu);
  if (!gpu.ok()) return gpu.status().with_context("pacing");
  laminar::Result<laminar::sim::ModelSpec> model = laminar::sim::ModelSpec::preset(options.model);
  if (!model.ok()) return model.status().with_context("pacing");
  laminar::sim::CostConfig config;
  config.gpu = std::move(*gpu);
  config.model = std::move(*model);
  laminar::Result<laminar::sim::CostModel> cost = laminar::sim::CostModel::create(std::move(config));
  if (!cost.ok()) return cost.status().with_context("pacing");
  return Pacing(options, std::make_shared<const Model>(Model{std::move(*cost)}));
}

namespace {

// The named model's duration, `steps` of them, in this run's time.
std::chrono::nanoseconds scaled(const laminar::Result<laminar::Duration>& d, double steps, double speedup) {
  if (!d.ok()) return std::chrono::nanoseconds(0);
  return std::chrono::nanoseconds(std::llround(double(d->count()) * steps / speedup));
}

}  // namespace

std::chrono::nanoseconds Pacing::decode(std::int64_t batch, std::int64_t kv_tokens) const {
  if (!model_) return std::chrono::nanoseconds(0);
  const double k = options_.tokens;
  return scaled(model_->cost.decode_step(std::max<std::int64_t>(batch, 1),
                                         std::llround(double(std::max<std::int64_t>(kv_tokens, 0)) * k)),
                k, options_.speedup);
}

std::chrono::nanoseconds Pacing::prefill(std::int64_t new_tokens) const {
  if (!model_) return std::chrono::nanoseconds(0);
  return scaled(model_->cost.prefill(std::llround(double(std::max<std::int64_t>(new_tokens, 1)) * options_.tokens)),
                1, options_.speedup);
}

std::string Pacing::describe(std::int64_t batch, std::int64_t context, std::int64_t prompt) const {
  if (!model_) return "none (decode steps run at this CPU's speed)";
  auto ms = [](std::chrono::nanoseconds d) { return double(d.count()) / 1e6; };
  return fmt::format(
      "{} on {} (the simulator's cost model), each token here {:g} of its tokens, time {:g}x faster: a decode "
      "step of 1 sequence of {} tokens {:.1f} ms, of {} {:.1f} ms; a prefill of {} prompts of {} tokens {:.1f} ms",
      options_.model, options_.gpu, options_.tokens, options_.speedup, context, ms(decode(1, context)), batch,
      ms(decode(batch, batch * context)), batch, prompt, ms(prefill(batch * prompt)));
}

}  // namespace async_grpo
