// The simulator's configuration: schedule names and defaults, the paper's setting, and the checked
// JSON reader of a whole SimConfig.
#include <array>
#include <cmath>
#include <string>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "json_fields.h"
#include "simulator.h"

namespace laminar::sim {
namespace {

using internal::Need;
using internal::ObjectReader;
using nlohmann::json;

constexpr std::array kSchedules = {ScheduleKind::kSync,           ScheduleKind::kOneStep,
                                   ScheduleKind::kStreamGlobal,   ScheduleKind::kBoundedStaleness,
                                   ScheduleKind::kPartialRollout, ScheduleKind::kLaminar};

// The presets paper_math() takes its cost model from; a "cost" section without "gpu" or "model"
// keeps these.
constexpr std::string_view kPaperGpu = "h100";
constexpr std::string_view kPaperModel = "qwen2.5-7b";

// The same plan_repack() checks, 2^40 as there.
constexpr std::int64_t kMaxRepackCount = std::int64_t(1) << 40;

// A section's own from_json and validate name fields from the section down; the config's reader
// names them from the top.
Status within(std::string_view section, const Status& s) {
  if (s.ok()) return s;
  return invalid_argument(fmt::format("{}.{}", section, s.message()));
}

// The trainer's share of a disaggregated cluster (ClusterConfig::trainer_gpus, 0: a quarter).
std::int64_t trainer_gpus_of(const ClusterConfig& c) { return c.trainer_gpus > 0 ? c.trainer_gpus : c.gpus / 4; }

}  // namespace

std::string_view schedule_name(ScheduleKind kind) noexcept {
  switch (kind) {
    case ScheduleKind::kSync: return "sync";
    case ScheduleKind::kOneStep: return "one-step";
    case ScheduleKind::kStreamGlobal: return "stream-global";
    case ScheduleKind::kBoundedStaleness: return "bounded-staleness";
    case ScheduleKind::kPartialRollout: return "partial-rollout";
    case ScheduleKind::kLaminar: return "laminar";
  }
  return "unknown";
}

Result<ScheduleKind> parse_schedule(std::string_view name) {
  std::string known;
  for (ScheduleKind k : kSchedules) {
    if (schedule_name(k) == name) return k;
    known += known.empty() ? "" : ", ";
    known += schedule_name(k);
  }
  return invalid_argument(fmt::format("schedule: unknown schedule '{}' ({})", name, known));
}

ScheduleSpec ScheduleSpec::defaults(ScheduleKind kind) {
  ScheduleSpec s;
  s.kind = kind;
  switch (kind) {
    case ScheduleKind::kSync: s.max_ahead_steps = 0; break;
    case ScheduleKind::kOneStep:
    case ScheduleKind::kStreamGlobal:
    case ScheduleKind::kPartialRollout: s.max_ahead_steps = 1; break;
    // AReaL's default; Laminar's is the same, so the default comparison is at matched staleness (with
    // no bound its rollouts outrun a quarter of the GPUs training by tens of versions).
    case ScheduleKind::kBoundedStaleness:
    case ScheduleKind::kLaminar: s.max_ahead_steps = 4; break;
  }
  if (kind == ScheduleKind::kLaminar) s.max_step_share = kDefaultStepShare;
  return s;
}

Status ScheduleSpec::validate() const {
  bool known = false;
  for (ScheduleKind k : kSchedules) known = known || k == kind;
  if (!known) return invalid_argument(fmt::format("kind: unknown schedule {}", static_cast<int>(kind)));
  if (max_ahead_steps && *max_ahead_steps < 0) {
    return invalid_argument(fmt::format("max_ahead_steps: must be >= 0, got {}", *max_ahead_steps));
  }
  // Colocated generation and training alternate on the same GPUs: nothing can run ahead.
  if (kind == ScheduleKind::kSync && max_ahead_steps != std::optional<std::int64_t>(0)) {
    return invalid_argument(fmt::format("max_ahead_steps: sync admits only 0, got {}",
                                        max_ahead_steps ? std::to_string(*max_ahead_steps) : "unbounded"));
  }
  // Below 1 the instances together could never take a whole step.
  if (max_step_share && !(*max_step_share >= 1 && std::isfinite(*max_step_share))) {
    return invalid_argument(fmt::format("max_step_share: must be >= 1 and finite, got {}", *max_step_share));
  }
  if (max_step_share && kind != ScheduleKind::kLaminar) {
    return invalid_argument(fmt::format("max_step_share: applies to laminar only, set to {} on {}", *max_step_share,
                                        schedule_name(kind)));
  }
  if (partial_token_budget < 1) {
    return invalid_argument(fmt::format("partial_token_budget: must be >= 1, got {}", partial_token_budget));
  }
  if (repack_interval <= Duration::zero()) {
    return invalid_argument(fmt::format("repack_interval: must be > 0, got {} ns", repack_interval.count()));
  }
  const RepackPolicyOptions& o = repack_options;
  if (o.strategy != RepackStrategy::kPaperBestFit && o.strategy != RepackStrategy::kCostAware) {
    return invalid_argument(fmt::format("repack_options.strategy: unknown strategy {}", static_cast<int>(o.strategy)));
  }
  if (o.growth_horizon_steps < 0 || o.growth_horizon_steps > kMaxRepackCount) {
    return invalid_argument(
        fmt::format("repack_options.growth_horizon_steps: must be in [0, 2^40], got {}", o.growth_horizon_steps));
  }
  if (o.page_bytes > static_cast<std::uint64_t>(kMaxRepackCount)) {
    return invalid_argument(fmt::format("repack_options.page_bytes: must be <= 2^40, got {}", o.page_bytes));
  }
  if (!(o.link_bytes_per_s > 0) || !std::isfinite(o.link_bytes_per_s)) {
    return invalid_argument(
        fmt::format("repack_options.link_bytes_per_s: must be > 0 and finite, got {}", o.link_bytes_per_s));
  }
  if (o.move_overhead < Duration::zero()) {
    return invalid_argument(
        fmt::format("repack_options.move_overhead: must be >= 0, got {} ns", o.move_overhead.count()));
  }
  if (o.step_seconds_per_token && !(*o.step_seconds_per_token >= 0 && std::isfinite(*o.step_seconds_per_token))) {
    return invalid_argument(fmt::format("repack_options.step_seconds_per_token: must be >= 0 and finite, got {}",
                                        *o.step_seconds_per_token));
  }
  if (!(o.max_tail_growth >= 0)) {
    return invalid_argument(fmt::format("repack_options.max_tail_growth: must be >= 0, got {}", o.max_tail_growth));
  }
  if (!(o.default_remaining_ratio >= 0 && std::isfinite(o.default_remaining_ratio))) {
    return invalid_argument(fmt::format("repack_options.default_remaining_ratio: must be >= 0 and finite, got {}",
                                        o.default_remaining_ratio));
  }
  return ok_status();
}

SimConfig SimConfig::paper_math() {
  SimConfig c;
  c.workload = WorkloadConfig::paper_math();
  // Everything but the GPU and the model keeps CostConfig's defaults, so that a JSON "cost" section
  // (CostConfig::from_json, which starts from those defaults) overrides exactly this.
  c.cost.gpu = GpuSpec::preset(kPaperGpu).value();
  c.cost.model = ModelSpec::preset(kPaperModel).value();
  c.cluster.gpus = 1024;
  c.steps = 100;
  return c;
}

Result<SimConfig> SimConfig::from_json(std::string_view text) {
  Result<json> j = internal::parse_json(text, "simulator config");
  if (!j.ok()) return j.status();
  Result<ObjectReader> top = ObjectReader::open(*j, "");
  if (!top.ok()) return top.status();
  SimConfig c = paper_math();

  // Exactly WorkloadConfig's object: without "preset": "paper_math" it names every field itself.
  if (const json* w = top->child("workload")) {
    Result<ObjectReader> r = ObjectReader::open(*w, "workload");
    if (!r.ok()) return r.status();
    Result<WorkloadConfig> cfg = WorkloadConfig::from_json(w->dump());
    if (!cfg.ok()) return within("workload", cfg.status());
    c.workload = std::move(*cfg);
  }
  // CostConfig's object, whose "gpu" and "model" (required there) default to paper_math()'s presets
  // here; its other sections start from CostConfig's defaults, which paper_math() keeps.
  if (const json* s = top->child("cost")) {
    Result<ObjectReader> r = ObjectReader::open(*s, "cost");
    if (!r.ok()) return r.status();
    json cost = *s;
    if (!cost.contains("gpu")) cost["gpu"] = {{"preset", std::string(kPaperGpu)}};
    if (!cost.contains("model")) cost["model"] = {{"preset", std::string(kPaperModel)}};
    Result<CostConfig> cfg = CostConfig::from_json(cost.dump());
    if (!cfg.ok()) return within("cost", cfg.status());
    c.cost = std::move(*cfg);
  }
  if (const json* s = top->child("cluster")) {
    Result<ObjectReader> r = ObjectReader::open(*s, "cluster");
    if (!r.ok()) return r.status();
    LAMINAR_RETURN_IF_ERROR(r->integer("gpus", c.cluster.gpus, 1, Need::kOptional));
    LAMINAR_RETURN_IF_ERROR(r->integer("trainer_gpus", c.cluster.trainer_gpus, 0, Need::kOptional));
    LAMINAR_RETURN_IF_ERROR(r->integer("max_batch", c.cluster.max_batch, 1, Need::kOptional));
    if (const json* f = r->child("failures")) {
      if (!f->is_boolean()) {
        return invalid_argument(fmt::format("{}: must be true or false, got {}", r->path_of("failures"), f->dump()));
      }
      c.cluster.failures = f->get<bool>();
    }
    LAMINAR_RETURN_IF_ERROR(r->finish());
  }
  LAMINAR_RETURN_IF_ERROR(top->integer("steps", c.steps, 1, Need::kOptional));
  std::int64_t seed = static_cast<std::int64_t>(c.seed);
  LAMINAR_RETURN_IF_ERROR(top->integer("seed", seed, 0, Need::kOptional));
  c.seed = static_cast<std::uint64_t>(seed);
  LAMINAR_RETURN_IF_ERROR(top->finish());
  LAMINAR_RETURN_IF_ERROR(c.validate());
  return c;
}

Status SimConfig::validate() const {
  LAMINAR_RETURN_IF_ERROR(within("workload", workload.validate()));
  // create() adds to validate() the check that a rollout GPU has room for KV next to its weights.
  if (Result<CostModel> m = CostModel::create(cost); !m.ok()) return within("cost", m.status());
  if (cluster.gpus < 1) return invalid_argument(fmt::format("cluster.gpus: must be >= 1, got {}", cluster.gpus));
  if (cluster.trainer_gpus < 0) {
    return invalid_argument(fmt::format("cluster.trainer_gpus: must be >= 0, got {}", cluster.trainer_gpus));
  }
  if (cluster.max_batch < 1) {
    return invalid_argument(fmt::format("cluster.max_batch: must be >= 1, got {}", cluster.max_batch));
  }
  if (steps < 1) return invalid_argument(fmt::format("steps: must be >= 1, got {}", steps));
  // Every schedule must be runnable, so the disaggregated split must leave the trainer a GPU and
  // the rollouts one instance.
  const std::int64_t tp = cost.rollout.tensor_parallel;
  const std::int64_t trainer = trainer_gpus_of(cluster);
  if (trainer < 1) {
    return invalid_argument(fmt::format(
        "cluster.gpus: {} GPUs leave the trainer none (a quarter, rounded down); need >= 4 or set cluster.trainer_gpus",
        cluster.gpus));
  }
  if (cluster.gpus - trainer < tp) {
    return invalid_argument(fmt::format(
        "cluster.trainer_gpus: {} of {} GPUs leave {} for rollouts, fewer than one instance of "
        "cost.rollout.tensor_parallel = {}",
        trainer, cluster.gpus, cluster.gpus - trainer, tp));
  }
  return ok_status();
}

}  // namespace laminar::sim
