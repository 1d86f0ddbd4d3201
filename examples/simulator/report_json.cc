// The simulator's results as JSON: durations in seconds, the admission rule as a number or null
// (no bound), so a report reads the same in any tool without knowing Duration's unit.
#include <chrono>
#include <cmath>

#include "simulator.h"

namespace laminar::sim {
namespace {

double seconds(Duration d) { return std::chrono::duration<double>(d).count(); }

nlohmann::json repack_options_json(const RepackPolicyOptions& o) {
  nlohmann::json j = {{"strategy", repack_strategy_name(o.strategy)},
                      {"growth_horizon_steps", o.growth_horizon_steps},
                      {"page_bytes", o.page_bytes},
                      {"link_bytes_per_s", o.link_bytes_per_s},
                      {"move_overhead_s", seconds(o.move_overhead)},
                      {"step_seconds_per_token", nullptr},
                      {"max_tail_growth", nullptr},
                      {"min_gain_s", nullptr},
                      {"default_remaining_ratio", o.default_remaining_ratio}};
  if (o.step_seconds_per_token) j["step_seconds_per_token"] = *o.step_seconds_per_token;
  // Infinity (the check off) has no JSON number: null says "off".
  if (std::isfinite(o.max_tail_growth)) j["max_tail_growth"] = o.max_tail_growth;
  if (o.min_gain != Duration::min()) j["min_gain_s"] = seconds(o.min_gain);
  return j;
}

}  // namespace

std::string_view trace_kind_name(TraceSpan::Kind kind) noexcept {
  switch (kind) {
    case TraceSpan::Kind::kGenerate: return "generate";
    case TraceSpan::Kind::kWaitWeights: return "wait-weights";
    case TraceSpan::Kind::kPull: return "pull";
    case TraceSpan::Kind::kMigrate: return "migrate";
    case TraceSpan::Kind::kIdle: return "idle";
    case TraceSpan::Kind::kRecover: return "recover";
  }
  return "unknown";
}

nlohmann::json ScheduleSpec::to_json() const {
  nlohmann::json j = {{"schedule", schedule_name(kind)},
                      {"max_ahead_steps", nullptr},
                      {"max_step_share", nullptr},
                      {"partial_token_budget", partial_token_budget},
                      {"repack", repack},
                      {"repack_interval_s", seconds(repack_interval)},
                      {"repack_options", repack_options_json(repack_options)}};
  if (max_ahead_steps) j["max_ahead_steps"] = *max_ahead_steps;
  if (max_step_share) j["max_step_share"] = *max_step_share;
  return j;
}

nlohmann::json SimReport::to_json() const {
  nlohmann::json steps_json = nlohmann::json::array();
  for (const StepRecord& r : step_records) {
    steps_json.push_back({{"step", r.step},
                          {"start_s", seconds(r.start)},
                          {"end_s", seconds(r.end)},
                          {"mean_staleness", r.mean_staleness}});
  }
  nlohmann::json j = {{"schedule", schedule},
                      {"spec", spec.to_json()},
                      {"gpus", gpus},
                      {"rollout_gpus", rollout_gpus},
                      {"trainer_gpus", trainer_gpus},
                      {"steps", steps},
                      {"total_s", seconds(total)},
                      {"samples_trained", samples_trained},
                      {"tokens_trained", tokens_trained},
                      {"samples_per_s", samples_per_s},
                      {"tokens_per_s", tokens_per_s},
                      {"mean_step_time_s", seconds(mean_step_time)},
                      {"generation_utilisation", generation_utilisation},
                      {"generation_tokens_per_s", generation_tokens_per_s},
                      {"staleness_histogram", staleness_histogram},
                      {"mixed_version_trajectories", mixed_version_trajectories},
                      {"max_staleness", max_staleness},
                      {"repack_plans", repack_plans},
                      {"repack_moves", repack_moves},
                      {"repack_bytes", repack_bytes},
                      {"preemptions", preemptions},
                      {"max_step_samples_per_instance", max_step_samples_per_instance},
                      {"weight_updates", weight_updates},
                      {"failures", failures},
                      {"events", events},
                      {"step_records", std::move(steps_json)}};
  if (!trace.empty()) {
    nlohmann::json spans = nlohmann::json::array();
    for (const TraceSpan& s : trace) {
      spans.push_back({{"instance", s.instance},
                       {"kind", trace_kind_name(s.kind)},
                       {"start_s", seconds(s.start)},
                       {"end_s", seconds(s.end)},
                       {"version", s.version},
                       {"batch", s.batch}});
    }
    j["trace"] = std::move(spans);
  }
  return j;
}

}  // namespace laminar::sim
