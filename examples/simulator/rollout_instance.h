// rollout_instance.h: one simulated inference engine (cost.rollout.tensor_parallel GPUs) and the
// samples it decodes, advanced in segments.
//
// Between two interesting moments (a sample ending a turn, an admission, a weight update, a
// migration) an instance decodes a constant batch whose KV grows by `batch` tokens a step, so the
// time of its first k steps has a closed form (DecodeCurve) and a segment is one event, however
// many steps it holds. A segment costs O(log batch), not O(batch): a decoding sample's progress is
// the instance's step count since the sample was last synced, and a heap keeps the step at which
// each one stops. An instance knows nothing of schedules: the engine (simulator.cc) decides what it
// admits, when it stops and which weights it runs.
//
//   enter_decoding(in, s, cost);                           // admitted
//   if (start_segment(in, now, cost, table, budget)) loop.at(in.seg_end, ...);
//   settle(in, now, table, budget, stopped);               // at the event
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <queue>
#include <vector>

#include "cost_model.h"
#include "laminar/clock.h"
#include "workload.h"

namespace laminar::sim::internal {

// One sample's truth (from the workload) and progress.
struct Sample {
  enum class Stage : std::uint8_t { kPooled, kWaiting, kDecoding, kToolWait, kMigrating, kDone };

  std::int64_t id = 0;     // global: step * prompts * samples + group * samples + index
  std::int64_t step = 0;
  std::int64_t group = 0;  // global group id: step * prompts + prompt index
  std::int32_t index = 0;  // within its group
  std::int32_t turn_count = 0;  // turns->size(), kept here: reading it through `turns` misses the cache
  std::int64_t prompt_tokens = 0;
  std::int64_t response_tokens = 0;
  const std::vector<Turn>* turns = nullptr;  // the step's workload, alive while the sample is

  Stage stage = Stage::kPooled;
  std::int32_t turn = 0;
  std::int64_t turn_left = 0;        // tokens still to generate in the current turn
  // Its tokens so far (prompt, generated, tool observations); while decoding, as of instance step
  // `synced` (sync() brings it up to date).
  std::int64_t context = 0;
  std::int64_t kv_missing = 0;       // the last of those not in its KV yet: prefilled before decoding
  std::int64_t synced = 0;
  std::int64_t stop_step = 0;        // the instance step at which it stops, while decoding
  std::int32_t slot = -1;            // its batch slot on the instance, while decoding
  std::int64_t iteration_tokens = 0; // generated since the last weight update (partial rollout)
  std::int64_t oldest_version = -1;  // -1: not started
  std::int64_t last_version = -1;
  bool mixed = false;
  std::int32_t instance = -1;
  std::int32_t charged = -1;         // the instance whose share of the step it counts against
  std::uint64_t admitted_order = 0;  // preemption evicts the most recent
  std::uint64_t incarnation = 0;     // bumped when a failure restarts it: stale events ignore it

  bool last_turn() const { return turn + 1 == turn_count; }
  // Back to not started: a failure lost its tokens.
  void restart();
};

// Decode time of k steps of a constant batch: step j costs max(a0 + s0 j, a1 + s1 j) seconds, the
// cost model's roofline (memory- or compute-bound, each linear in the KV read) sampled at both
// ends of the segment, so a step's time is exact wherever at most one bound changes over it.
struct DecodeCurve {
  double a0 = 0, s0 = 0, a1 = 0, s1 = 0;

  static DecodeCurve fit(const CostModel& cost, std::int64_t batch, std::int64_t kv_tokens, std::int64_t steps);
  double seconds_for(std::int64_t k) const;  // the first k steps
  std::int64_t steps_within(double s, std::int64_t max_steps) const;  // the most steps done in s seconds
};

struct RolloutInstance {
  enum class State : std::uint8_t {
    kIdle,       // not decoding (nothing to decode, or not allowed to admit)
    kRunning,    // a segment is under way
    kBusy,       // loading weights, sending migrated KV, or stalled by a global update
    kDown,       // its node failed; recovering
  };

  std::int32_t id = 0;
  std::int32_t node = 0;
  std::int64_t version = 0;  // weights it runs
  State state = State::kIdle;
  std::uint64_t epoch = 0;   // bumped on each new segment or busy period: stale events ignore it

  std::vector<std::int64_t> live;       // resident samples: decoding, tool-waiting, or migrating in
  std::deque<std::int64_t> waiting;     // assigned, not admitted: preempted ones at the front
  std::int64_t decoded = 0;             // decode steps run so far
  std::int64_t decoding = 0;            // samples in the batch
  std::int64_t kv_decoding = 0;         // their tokens
  std::int64_t kv_parked = 0;           // tokens of resident samples not decoding
  // Batch slots: the sample in each, and a generation bumped when it leaves, so that the stops
  // heap's entries of samples gone (preempted, migrated) are skipped without reading them.
  struct Stop {
    std::int64_t step;
    std::int32_t slot;
    std::uint32_t generation;
    bool operator>(const Stop& o) const { return step != o.step ? step > o.step : slot > o.slot; }
  };
  std::priority_queue<Stop, std::vector<Stop>, std::greater<>> stops;
  std::vector<std::int64_t> slot_sample;
  std::vector<std::uint32_t> slot_generation;
  std::vector<std::int32_t> free_slots;
  std::vector<std::int64_t> prefilling;  // decoding samples with kv_missing > 0

  // The current segment.
  Duration seg_start{0};
  double seg_prefill_s = 0;
  std::int64_t seg_batch = 0;
  std::int64_t seg_steps = 0;
  DecodeCurve seg_curve;
  Duration seg_end{0};

  // Accounting.
  Duration busy_generating{0};
  std::int64_t tokens_generated = 0;
  Duration state_since{0};  // for trace spans

  std::int64_t load() const { return static_cast<std::int64_t>(live.size() + waiting.size()); }
  // KV pages held: each resident sample's tokens rounded up to pages, bounded from above by
  // assuming each sample's last page holds one token.
  std::int64_t pages_used(std::int64_t page_tokens, std::int64_t extra_tokens = 0) const {
    const auto n = static_cast<std::int64_t>(live.size());
    return (kv_decoding + kv_parked + extra_tokens + n * (page_tokens - 1)) / page_tokens;
  }
};

// What the instance needs from the engine's tables.
class SampleTable {
 public:
  virtual ~SampleTable() = default;
  virtual Sample& sample(std::int64_t id) = 0;
};

// Brings a decoding sample's context, turn and iteration counts up to its instance's step.
void sync(const RolloutInstance& in, Sample& s);
// A resident sample joins the batch (`budget` > 0: partial rollout's per-iteration token budget).
void enter_decoding(RolloutInstance& in, Sample& s, std::int64_t budget);
// A decoding sample leaves the batch and stays resident (a tool call, a migration on its way).
void leave_decoding(RolloutInstance& in, Sample& s);

// Forgets every resident sample (its node failed).
void clear(RolloutInstance& in);

// Decode progress up to `now` of the running segment (the whole segment if now >= seg_end).
// Replaces `stopped` (a buffer the caller reuses) with the decoding samples, synced, that have no
// tokens left in their turn or reached the iteration budget (`budget` > 0). Leaves the instance
// kIdle.
void settle(RolloutInstance& in, Duration now, SampleTable& samples, std::int64_t budget,
            std::vector<std::int64_t>& stopped);

// Starts a segment at `now` over the decoding samples (their pending prefill first), ending at the
// first sample's stop or where the KV cache fills. False when nothing decodes.
bool start_segment(RolloutInstance& in, Duration now, const CostModel& cost, SampleTable& samples);

}  // namespace laminar::sim::internal
