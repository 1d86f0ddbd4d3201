// repack_policy.h: RepackPolicy, the decision of which live sequences move where so that whole
// rollout workers empty out, pull the newest weights and take fresh prompts.
//
// In the long tail of a rollout, most workers of an old version decode a handful of long sequences
// each while fresh prompts wait for the new weights (a worker pulls only when it holds no live
// sequence). plan_repack() reads a snapshot of the fleet and answers with a MigrationPlan: moves of
// sequences, with their KV pages, onto other workers of the same version, chosen so that whole
// workers are left empty. The KvMigrator carries a plan out; the policy moves nothing, keeps no
// state and runs no thread, so the real fleet, the tests and a cluster simulator drive the same
// function. Make a plan every few seconds and after each trainer update.
//
//   laminar::FleetSnapshot fleet{
//       .tokens_per_page = 16, .workers = collect_workers(), .prompts_waiting = scheduler_queue_size()};
//   laminar::Result<laminar::MigrationPlan> plan = laminar::plan_repack(fleet, relay_newest);
//   if (!plan.ok()) return plan.status();
//   for (const laminar::Move& m : plan->moves) start_migration(m.sequence, m.from, m.to);
//   for (const laminar::FreedWorker& f : plan->freed) pull_when_empty(f.worker, relay_newest);
//
// The rule of the Laminar paper (RepackStrategy::kPaperBestFit):
//   - workers are repacked per version, older than the newest published one. Workers already on
//     the newest version are left alone (neither source nor destination): they take new prompts
//     into their free slots without pulling, so emptying one gains nothing;
//   - only draining workers take part: no waiting prompt, KV use no longer growing, and every used
//     batch slot a listed sequence (one still in prefill cannot move);
//   - sources smallest first (fewest pages held). Each sequence of a source goes to the destination
//     it leaves most densely packed (fewest free pages after it), within page and slot limits. A
//     source whose sequences do not all fit moves none and stays a destination; a worker that has
//     received a sequence is never a source, so nothing moves twice.
// A destination's page limit keeps room for growth: KV grows by a token per step, so a destination
// filled to its last page runs out within a page's worth of steps and the engine preempts. Each
// sequence it holds keeps growth_horizon_steps tokens of room.
//
// kCostAware, the default, keeps that rule and uses what the paper leaves out. Each sequence has an
// expected number of remaining tokens (the caller's estimate, else default_remaining_ratio times its
// tokens so far). Decode reads every token's KV each step, so a step costs a fixed part plus a part
// per token held (step_seconds_per_token, fitted across the snapshot's workers unless given), and a
// worker stays busy until its longest sequence ends while its batch shrinks. Then:
//   - a sequence keeps room for growth only until it is expected to end (at most
//     growth_horizon_steps), so short ones leave room for more;
//   - a source is emptied only when the busy time it frees, less the time to send its pages
//     (page_bytes, link_bytes_per_s, move_overhead per sequence) and how much later its
//     destinations end, exceeds min_gain;
//   - a sequence goes to a destination only if that worker, slowed by what it receives, is still
//     expected to end within max_tail_growth of the version's expected end: the version's last
//     trajectories decide when its GRPO groups complete; and, with max_step_slowdown set, only if
//     the destination's step stays within that factor of a step reading no KV;
//   - given the scheduler's queue (FleetSnapshot::prompts_waiting), workers are freed only while
//     prompts wait for them: nothing is moved when the newest version's workers have room.
// The estimates rank plans; they are not promises. The tail check is only as good as the length
// estimates (bench/README.md has the figures with exact and with noisy ones).
//
// Threads: none. plan_repack() is a pure function of its arguments and may run concurrently.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>
#include <vector>

#include "laminar/clock.h"
#include "laminar/status.h"
#include "laminar/types.h"

namespace laminar {

// One live sequence on a worker.
struct SequenceSnapshot {
  SequenceId id;
  std::int64_t tokens = 0;  // tokens in its KV so far (prompt and generated)
  std::int64_t pages = 0;   // KV pages it holds: at least tokens / tokens_per_page, rounded up
  // Tokens it is expected to generate before it ends (a length predictor's estimate).
  std::optional<std::int64_t> expected_remaining_tokens;
};

// One rollout worker (one inference engine instance).
struct WorkerSnapshot {
  WorkerId id;
  Version version;                          // the weights it decodes with
  std::vector<SequenceSnapshot> sequences;  // every live sequence it holds
  std::int64_t pages_total = 0;             // KV pages of its cache
  std::int64_t pages_used = 0;   // every page in use; pages no listed sequence holds (a prefix cache) stay
  std::int32_t slots_total = 0;  // most sequences one decode batch holds
  std::int32_t slots_used = 0;   // more than sequences.size() when some sequence is still in prefill
  Duration step_time{0};         // recent decode step time; positive when it holds a sequence
  std::int64_t waiting_prompts = 0;  // prompts queued for it
  bool kv_stopped_growing = false;   // pages_used has not risen over its recent steps

  std::int64_t pages_free() const noexcept { return pages_total - pages_used; }
};

// Every rollout worker, as one planner sees them.
struct FleetSnapshot {
  std::int32_t tokens_per_page = 0;  // page size of every worker's KV cache
  std::vector<WorkerSnapshot> workers;
  // Prompts no worker holds yet, which only a worker on the newest version may start (the
  // scheduler's queue). nullopt: not known.
  std::optional<std::int64_t> prompts_waiting;
};

enum class RepackStrategy : std::uint8_t {
  kPaperBestFit,  // the Laminar paper's rule, as above
  kCostAware,     // the paper's rule plus expected lengths, move cost and decode slowdown
};

std::string_view repack_strategy_name(RepackStrategy s) noexcept;

struct RepackPolicyOptions {
  RepackStrategy strategy = RepackStrategy::kCostAware;
  // Tokens of growth a destination keeps pages for, per sequence. Simulating 1,024 workers with RL
  // response lengths (median 2k tokens, p99 10x that), 1,024 left no worker short of pages before
  // its sequences ended, 512 fewer than one per plan, 128 about 40 (bench/README.md).
  std::int64_t growth_horizon_steps = 1024;
  // The rest is read by kCostAware only (and by the estimates of every plan).
  // Bytes of one page over every layer, K and V: 16 tokens of an 8B GQA model in bf16 are 2 MiB.
  std::uint64_t page_bytes = std::uint64_t(2) << 20;
  double link_bytes_per_s = 25e9;                         // what one worker sends (200 Gbit/s)
  Duration move_overhead = std::chrono::milliseconds(1);  // fixed cost of each move
  // Seconds each token of KV a worker holds adds to its decode step; unset, it is the slope of step
  // time against tokens held across the snapshot's workers.
  std::optional<double> step_seconds_per_token;
  // How much later a version's expected end may become (0.05: 5%); infinity turns the check off.
  double max_tail_growth = 0.05;
  // The net busy time a source must free to be emptied; Duration::min() turns the check off.
  Duration min_gain{0};
  // How much slower a destination's decode step may become than its part that reads no KV (weights,
  // launch): every sequence it holds then decodes at most that much slower than alone. Unlike
  // max_tail_growth, which each plan measures against the fleet as it finds it (so plans every few
  // seconds compound it), this bound holds however many plans run. Infinity turns it off.
  double max_step_slowdown = std::numeric_limits<double>::infinity();
  // With FleetSnapshot::prompts_waiting given, free workers only while the prompts outnumber the
  // free slots of the newest version's workers and of the workers freed so far: an emptied worker
  // with no prompt to start gains nothing, and its sequences slow the destinations that take them.
  // Simulating the paper's math setting at an admission bound of 4 (bench/README.md), repacking
  // without this ran at 273 samples/s against 366 with no repacking, and 368 with it; with a third
  // of the rollout GPUs, where prompts do wait, 383 against 351 with no repacking.
  bool only_for_waiting_prompts = true;
  // A sequence without expected_remaining_tokens is expected to run this many times its tokens so
  // far: 1 is the mean remaining life of a Pareto tail of index 2, a fit to RL response lengths
  // whose p99 is about 10x the median.
  double default_remaining_ratio = 1.0;
};

struct Move {
  SequenceId sequence;
  WorkerId from;
  WorkerId to;
  std::int64_t pages = 0;  // pages the sequence holds, which the migrator copies

  friend bool operator==(const Move&, const Move&) = default;
};

struct FreedWorker {
  WorkerId worker;
  Duration busy_left{0};  // how long it was expected to stay busy without the plan
  Duration move_time{0};  // sending its pages, plus move_overhead per sequence
  // busy_left - move_time - how much later its moves make its destinations finish.
  Duration gain{0};
};

struct MigrationPlan {
  // Every sequence of every freed worker, grouped by source; a source is free once its moves end.
  std::vector<Move> moves;
  std::vector<FreedWorker> freed;
  std::int64_t pages_moved = 0;
  Duration gain{0};  // the sum of the freed workers' gains
  // The largest, over versions, of the expected finish after the plan over the one before (1: no
  // version finishes later).
  double tail_growth = 1.0;
};

// The plan for `fleet` given `newest`, the newest version the relays publish.
// Preconditions, each answered with kInvalidArgument naming the worker, the sequence and the value:
//   - tokens_per_page > 0; worker ids unique; sequence ids unique across the fleet;
//   - every worker's version <= newest;
//   - 0 < pages_total <= 2^40, the pages of its sequences <= pages_used <= pages_total;
//   - 0 < slots_total <= 2^20, sequences.size() <= slots_used <= slots_total;
//   - step_time >= 0, and > 0 when the worker holds a sequence; waiting_prompts >= 0;
//   - every sequence: 0 <= tokens <= 2^40, pages covering its tokens, 0 <= expected remaining <= 2^40;
//   - options: a known strategy, growth_horizon_steps in [0, 2^40], page_bytes <= 2^40,
//     link_bytes_per_s > 0 and finite, move_overhead >= 0, step_seconds_per_token and
//     default_remaining_ratio >= 0 and finite, max_tail_growth and max_step_slowdown >= 0
//     (infinity allowed); prompts_waiting in [0, 2^40] when given.
Result<MigrationPlan> plan_repack(const FleetSnapshot& fleet, Version newest,
                                  const RepackPolicyOptions& options = {});

}  // namespace laminar
