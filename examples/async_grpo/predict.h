// predict.h: the run's own simulator. It replays one schedule's workload (each group's prompt length
// and its samples' response lengths, in the order the dispatcher dealt them) through a
// discrete-event model of the run's processes:
//   - `workers` rollout workers of `slots` sequences, whose prefill and decode steps take what the
//     run's Pacing says (the cluster simulator's cost model, scaled); a prefill of newly granted
//     samples samples their first token, and each decode step one more token of every live one;
//   - the dispatcher's admission rule, as rollout_dispatcher.h states it: sync and one-step open
//     one batch of groups per version; the streams make groups on demand for workers on the newest
//     weights (or at most max_staleness behind) while fewer than the in-flight window's samples are
//     out; whole groups first, the oldest first, part of the oldest only when none fits;
//   - laminar's workers pull a newer version only when they hold nothing; areal's take it at their
//     next step and re-prefill every live sequence;
//   - an actor that pops whole groups, a batch at a time, and is busy for the run's measured time
//     per step (training, and re-scoring and publishing around it) before it publishes; one-step
//     opens its next batch once the batch taken is re-scored.
// What it leaves out is what a gap between prediction and measurement points at: the control
// plane's latency, the host CPU's own time (processes share 2 cores), weight pulls (under a
// millisecond here), and repacking (laminar moves tails between workers; the model does not).
//
//   async_grpo::PredictConfig c{.schedule = "laminar", .train_step_s = 0.065, .steps = 90};
//   laminar::Result<async_grpo::Prediction> p = async_grpo::predict(c, pacing, groups);
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "laminar/status.h"
#include "pacing.h"

namespace async_grpo {

// One group of the workload, in dealing order.
struct PredictGroup {
  std::int64_t prompt_tokens = 1;               // >= 1
  std::vector<std::int64_t> response_tokens;    // one per sample, each >= 1; group_size of them
};

struct PredictConfig {
  std::string schedule = "laminar";  // sync, one-step, areal or laminar
  int workers = 3;
  int slots = 16;  // sequences a worker decodes at once (--max-live)
  int group_size = 8;
  int groups_per_step = 8;
  int max_staleness = 0;          // the streams: how far a worker taking samples may lag
  double in_flight_batches = 1;   // the streams: samples out at once, in batches
  // The actor's time per step apart from waiting for samples (training, re-scoring, publishing), > 0.
  double train_step_s = 0.065;
  // Of that, the time from taking a batch to starting to train on it (re-scoring it), >= 0 and at
  // most train_step_s: one-step opens the next batch only then.
  double score_s = 0;
  std::int64_t steps = 90;        // training steps to simulate, >= 1
};

struct Prediction {
  double time_s = 0;               // from the start to the last step's publish
  std::int64_t trained_samples = 0;
  double samples_per_s = 0;        // trained_samples / time_s
  double actor_waiting_share = 0;  // waiting / (waiting + training)
  double generation_utilisation = 0;  // workers' time in prefill or decode / (workers x time_s)
};

// kInvalidArgument naming the field: an unknown schedule, workers, slots, group_size,
// groups_per_step or steps below 1, a negative max_staleness, a window below one group, a training
// step not positive, a scoring time outside [0, train_step_s]; no groups, or a group whose size is not group_size or with a length below 1.
// Past the last group (those still in flight when the run stopped are not in its records) the
// groups are dealt again from the first.
laminar::Result<Prediction> predict(const PredictConfig& config, const Pacing& pacing,
                                    std::span<const PredictGroup> groups);

}  // namespace async_grpo
