// workload.h: what the simulated cluster is asked to generate, step by step.
//
// A Workload turns a WorkloadConfig (from JSON or a preset) into the prompts of each training
// step: GRPO groups of samples, each with a prompt length, a response length and, for agentic
// tasks, tool calls that pause the sample for an environment's latency. Lengths within a group are
// correlated through a Gaussian copula (a shared per-prompt normal factor), so a hard prompt makes
// all of its samples long while each length keeps exactly the configured marginal distribution.
// Sampling is a pure function of (seed, step), bit-identical on one platform: the simulator may
// ask for steps in any order.
//
//   laminar::Result<WorkloadConfig> cfg = WorkloadConfig::from_json(text);  // or paper_math()
//   laminar::Result<Workload> w = Workload::create(*cfg);
//   laminar::Result<StepWorkload> s = w->step(0);
//   for (const PromptGroup& g : s->groups)
//     for (const SampleSpec& x : g.samples) schedule(g.prompt_tokens, x.response_tokens, x.turns);
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "laminar/clock.h"
#include "laminar/status.h"

namespace laminar::sim {

// A non-negative random quantity: a length in tokens or a latency in seconds.
//
// JSON, one of:
//   {"kind": "lognormal", "median": M, "sigma": S}    ln X ~ N(ln M, S^2)
//   {"kind": "lognormal", "mean": A, "sigma": S}      median = A * exp(-S^2 / 2)
//   {"kind": "pareto", "scale": XM, "alpha": A}       P(X > x) = (XM / x)^A for x >= XM
//   {"kind": "mixture", "components": [{"weight": W, "kind": ...}, ...]}
//   {"kind": "observed", "values": [...]}  or  {"kind": "observed", "file": PATH}
//       the empirical distribution of the values (a file holds whitespace-separated numbers)
//   {"kind": "constant", "value": V}
class Distribution {
 public:
  enum class Kind { kConstant, kLogNormal, kPareto, kMixture, kObserved };

  // Constant 0.
  Distribution() = default;

  static Result<Distribution> constant(double value);
  static Result<Distribution> log_normal(double median, double sigma);
  static Result<Distribution> log_normal_from_mean(double mean, double sigma);
  static Result<Distribution> pareto(double scale, double alpha);
  // Weights need not sum to 1; they are normalised.
  static Result<Distribution> mixture(std::vector<std::pair<double, Distribution>> components);
  static Result<Distribution> observed(std::vector<double> values);
  // `what` names the field in error messages ("response_length").
  static Result<Distribution> from_json(std::string_view text, std::string_view what = "distribution");

  // Deterministic draw: `z` a standard normal (the copula's variable; the value is the marginal's
  // quantile at Phi(z)), `pick` uniform in [0, 1) choosing a mixture's component.
  double sample(double z, double pick) const;
  // One independent draw from `rng`.
  double draw(std::mt19937_64& rng) const;

  Kind kind() const { return kind_; }
  // The median, exactly, where it has a closed form (constant, lognormal, pareto, observed);
  // mixtures report NaN.
  double median() const;

 private:
  Kind kind_ = Kind::kConstant;
  double a_ = 0;  // constant: value; lognormal: ln median; pareto: scale
  double b_ = 0;  // lognormal: sigma; pareto: alpha
  std::vector<double> weights_;             // mixture: cumulative, normalised to end at 1
  std::vector<Distribution> components_;    // mixture
  std::vector<double> values_;              // observed: sorted
};

// A length in tokens: the distribution's draw rounded to an integer and clamped to [min, max].
struct LengthSpec {
  Distribution distribution;
  std::int64_t max_tokens = 1;
};

// Agentic samples: after each generated segment the sample calls a tool with probability
// `call_probability` (at most `max_calls` times), waits `env_latency_s`, and appends
// `observation_tokens` of tool output to its context. The response's generated tokens are split
// evenly across its segments.
struct ToolCallSpec {
  double call_probability = 0;
  std::int64_t max_calls = 0;
  Distribution env_latency_s;
  Distribution observation_tokens;
};

// JSON: every field below, by name ("prompt_length" and "response_length" are a Distribution
// object with an extra "max"; "tool_calls" holds ToolCallSpec's fields). With "preset":
// "paper_math" every field is optional and overrides the preset's.
struct WorkloadConfig {
  std::uint64_t seed = 0;
  std::int64_t prompts_per_step = 1;
  std::int64_t samples_per_prompt = 1;  // GRPO group size
  LengthSpec prompt_length;
  LengthSpec response_length;
  // Correlation in [0, 1) of the copula's normal variable between two samples of one prompt.
  double group_correlation = 0;
  ToolCallSpec tool_calls;

  // The paper's math setting: 512 prompts x 16 samples, responses capped at 16k tokens, log-normal
  // response lengths with median 1,500 and p99 = 10 x median (sigma = ln 10 / z_0.99 = 0.9898).
  // Prompt lengths (median 256, sigma 0.5, cap 2,048) and the group correlation 0.5 are our
  // assumptions; the paper reports neither.
  static WorkloadConfig paper_math();
  static Result<WorkloadConfig> preset(std::string_view name);
  static Result<WorkloadConfig> from_json(std::string_view text);

  // kInvalidArgument naming the first bad field.
  Status validate() const;
};

// One generated segment of a sample and what follows it. The last turn has no tool call: its
// env_latency and observation_tokens are zero.
struct Turn {
  std::int64_t generate_tokens = 0;
  Duration env_latency{0};
  std::int64_t observation_tokens = 0;
};

struct SampleSpec {
  std::int64_t response_tokens = 0;  // generated tokens, the sum over turns
  std::vector<Turn> turns;           // at least one
};

struct PromptGroup {
  std::int64_t prompt_index = 0;  // within the step
  std::int64_t prompt_tokens = 0;
  std::vector<SampleSpec> samples;
};

struct StepWorkload {
  std::int64_t step = 0;
  std::vector<PromptGroup> groups;

  std::int64_t total_response_tokens() const;
  std::int64_t total_prompt_tokens() const;  // counted once per sample, as each sample prefills it
};

class Workload {
 public:
  // kInvalidArgument when `config` does not validate.
  static Result<Workload> create(WorkloadConfig config);

  // The prompts of training step `step` (>= 0); the same (seed, step) always gives the same result.
  Result<StepWorkload> step(std::int64_t step) const;

  const WorkloadConfig& config() const { return config_; }

 private:
  explicit Workload(WorkloadConfig config) : config_(std::move(config)) {}
  WorkloadConfig config_;
};

}  // namespace laminar::sim
