// simulator.h: a discrete-event simulation of one RL post-training run on a GPU cluster, in virtual
// time, for each of the schedules RL systems use.
//
// The simulator keeps one event heap on a laminar::ManualClock and drives laminar's own parts on
// it: every finished GRPO group goes through a real TrajectoryQueue (the trainer pops its batches
// there, so exactly-once delivery and staleness are the queue's), the Laminar schedule's relays and
// rollouts keep their versions with relay_versions.h (VersionLedger, next_pull, FleetVersions), and
// its repacking asks the real plan_repack(). Everything a GPU would do takes the time the cost
// model (cost_model.h) gives; nothing reads a wall clock. The same config and seed give the same
// report, bit for bit.
//
//   laminar::Result<SimConfig> cfg = SimConfig::from_json(text);  // or SimConfig::paper_math()
//   laminar::Result<SimReport> r = simulate(*cfg, ScheduleSpec::defaults(ScheduleKind::kLaminar));
//   std::cout << r->to_json().dump(2);
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "cost_model.h"
#include "laminar/clock.h"
#include "laminar/repack_policy.h"
#include "laminar/status.h"
#include "workload.h"

namespace laminar::sim {

// What every schedule shares: the workload's training step s is the dataset batch s (its prompts,
// prompts_per_step GRPO groups of samples_per_prompt); the trainer's step trains on
// prompts_per_step complete groups popped from the TrajectoryQueue and publishes version s + 1
// (version 0 is the initial policy). Samples are dispatched one by one to the least loaded
// rollout instance that admits them (a group's samples may run on different instances, each
// prefilling the prompt); a group is pushed to the queue, whole, when its last sample ends, and is
// then ready for the trainer.
enum class ScheduleKind : std::uint8_t {
  // Colocated (verl's hybrid engine): every GPU generates step s with version s, then every GPU
  // trains on it; the weights move between the two engines on each GPU, never over the network.
  kSync,
  // Disaggregated rollout and trainer GPUs. Rollouts generate step s + 1 with version s while the
  // trainer trains on step s; at each step boundary every rollout waits for the global broadcast of
  // the new version.
  kOneStep,
  // Disaggregated; rollouts stream groups continuously into the queue. Each new version is a global
  // update: rollouts stop admitting prompts, drain their live sequences, and take the broadcast all
  // together before generating again.
  kStreamGlobal,
  // AReaL: disaggregated and streaming. A new version interrupts every rollout at once (global
  // broadcast); live sequences keep their tokens, recompute their KV under the new weights and
  // continue, so a trajectory mixes versions (it is tagged with its oldest).
  kBoundedStaleness,
  // Kimi k1.5's partial rollout: each iteration, rollouts generate under a per-iteration token
  // budget; sequences not done within it are carried over, unfinished, into the next iteration
  // (which runs newer weights, so they mix versions). The trainer takes the first prompts_per_step
  // groups complete; a global broadcast separates iterations.
  kPartialRollout,
  // Laminar: disaggregated. The trainer publishes to a relay tier (actor -> relay, relay chain);
  // each rollout instance pulls the newest version only when it holds no live sequence (next_pull,
  // kWhenIdle), and an instance older than the newest stops admitting prompts and drains. Draining
  // instances are consolidated by plan_repack(), their sequences moving with their KV
  // (cost_model's kv_migration), so emptied instances pull and start fresh prompts.
  kLaminar,
};

std::string_view schedule_name(ScheduleKind kind) noexcept;  // "sync", "one-step", "stream-global",
                                                              // "bounded-staleness", "partial-rollout", "laminar"
// kInvalidArgument naming the unknown schedule and listing the known ones.
Result<ScheduleKind> parse_schedule(std::string_view name);

struct ScheduleSpec {
  ScheduleKind kind = ScheduleKind::kLaminar;
  // The admission rule: a prompt of training step s may start generating only once the trainer has
  // published version s - max_ahead_steps (so no trajectory is more than max_ahead_steps versions
  // older than the batch it trains in, apart from versions mixed inside one). kSync is 0, kOneStep
  // 1; nullopt: no bound (prompts start whenever a rollout has room). Reported with the results:
  // it decides both staleness and speed.
  std::optional<std::int64_t> max_ahead_steps;
  // kLaminar: the most of one step's samples an instance may take, as a multiple of its fair share
  // (the step's samples over the rollout instances, rounded up); the rest wait in the pool for the
  // instances that pull next, and the next admissible step is released for the instances the cap
  // stops. Without it a released step goes to the few instances that have already drained and
  // pulled, each up to max_batch, while the rest of the fleet finishes older tails; too small a
  // share holds a step's last samples until nearly every instance has drained. At least 1, or the
  // fleet could never take a whole step; nullopt: no cap but max_batch (defaults() sets
  // kDefaultStepShare). The other schedules admit on every instance at once, so the least loaded
  // rule already spreads a step evenly: it applies to kLaminar only.
  std::optional<double> max_step_share;
  // kPartialRollout: generated tokens per sequence per iteration.
  std::int64_t partial_token_budget = 4096;
  // kLaminar: repacking (off: instances drain alone), how often a plan is made while some
  // instance drains, and the policy's options (page_bytes and link_bytes_per_s are filled in from
  // the cost model unless set here).
  bool repack = true;
  Duration repack_interval = std::chrono::seconds(5);
  RepackPolicyOptions repack_options;

  // The defaults of each schedule: kSync 0, kOneStep 1, kStreamGlobal 1, kBoundedStaleness 4
  // (AReaL's), kPartialRollout 1, kLaminar 4; kLaminar's max_step_share kDefaultStepShare, the
  // fastest measured at bound 4 on the paper's math setting (examples/simulator/README.md).
  static constexpr double kDefaultStepShare = 8.0;
  static ScheduleSpec defaults(ScheduleKind kind);
  // kInvalidArgument naming the first bad field (negative bounds, a bound on kSync other than 0, a
  // step share below 1 or set on a schedule other than kLaminar).
  Status validate() const;
  nlohmann::json to_json() const;
};

// The cluster's shape.
struct ClusterConfig {
  std::int64_t gpus = 1024;
  // Disaggregated schedules: GPUs given to the trainer; the rest run rollout instances of
  // cost.rollout.tensor_parallel GPUs each. 0: a quarter of the GPUs.
  std::int64_t trainer_gpus = 0;
  std::int64_t max_batch = 256;  // sequences one instance decodes at once (vLLM's max_num_seqs)
  bool failures = false;         // inject node failures drawn from the cost model
};

struct SimConfig {
  WorkloadConfig workload;
  CostConfig cost;
  ClusterConfig cluster;
  std::int64_t steps = 100;  // training steps to simulate
  std::uint64_t seed = 0;    // failures and any other randomness outside the workload

  // The paper's math setting on 1,024 H100s with a Qwen2.5-7B-shaped model.
  static SimConfig paper_math();
  // JSON: {"workload": {...}, "cost": {...}, "cluster": {...}, "steps": N, "seed": S}, each
  // section as its type's from_json reads it; missing sections keep paper_math()'s.
  static Result<SimConfig> from_json(std::string_view text);
  Status validate() const;
};

// One trainer step.
struct StepRecord {
  std::int64_t step = 0;
  Duration start{0};  // the trainer popped its batch
  Duration end{0};    // the version it made was published
  double mean_staleness = 0;  // over its trajectories: step - trajectory version
};

// One rollout instance's activity over an interval, for the trace.
struct TraceSpan {
  enum class Kind : std::uint8_t { kGenerate, kWaitWeights, kPull, kMigrate, kIdle, kRecover };
  std::int64_t instance = 0;
  Kind kind = Kind::kGenerate;
  Duration start{0};
  Duration end{0};
  std::int64_t version = 0;  // the weights it ran
  std::int64_t batch = 0;    // live sequences (kGenerate)
};
std::string_view trace_kind_name(TraceSpan::Kind kind) noexcept;

struct SimReport {
  std::string schedule;  // schedule_name()
  ScheduleSpec spec;
  std::int64_t gpus = 0;
  std::int64_t rollout_gpus = 0;  // kSync: every GPU
  std::int64_t trainer_gpus = 0;  // kSync: every GPU
  std::int64_t steps = 0;
  Duration total{0};  // virtual time from the start to the last step's publish

  std::int64_t samples_trained = 0;
  std::int64_t tokens_trained = 0;  // response tokens
  double samples_per_s = 0;
  double tokens_per_s = 0;
  Duration mean_step_time{0};
  // Share of rollout GPU time spent generating (decode and prefill), and generated tokens per
  // second over the run (the number the GPU-count sweep plots).
  double generation_utilisation = 0;
  double generation_tokens_per_s = 0;

  // staleness_histogram[k]: trajectories trained k versions after the one they were generated with
  // (their oldest, for mixed ones).
  std::vector<std::int64_t> staleness_histogram;
  std::int64_t mixed_version_trajectories = 0;
  std::int64_t max_staleness = 0;

  std::int64_t repack_plans = 0;
  std::int64_t repack_moves = 0;
  double repack_bytes = 0;
  std::int64_t preemptions = 0;
  // The most samples of one step dispatched to one instance (ScheduleSpec::max_step_share bounds it).
  std::int64_t max_step_samples_per_instance = 0;
  std::int64_t weight_updates = 0;  // instance weight loads
  std::int64_t failures = 0;
  std::int64_t events = 0;  // events the loop processed

  std::vector<StepRecord> step_records;
  std::vector<TraceSpan> trace;  // only with SimOptions::trace

  nlohmann::json to_json() const;
};

struct SimOptions {
  // Record every instance's TraceSpans (large: keep runs small).
  bool trace = false;
  // Called after each trainer step with (steps done, steps); for progress lines.
  std::function<void(std::int64_t, std::int64_t)> on_step;
};

// Runs `config` under `spec`. kInvalidArgument for a config or spec that does not validate, or a
// cluster too small for one rollout instance and the trainer.
Result<SimReport> simulate(const SimConfig& config, const ScheduleSpec& spec, const SimOptions& options = {});

}  // namespace laminar::sim
