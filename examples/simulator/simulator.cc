// simulate(): the engine. One event loop on a ManualClock drives the rollout instances
// (rollout_instance.h), the trainer, the real TrajectoryQueue between them and, for Laminar, the
// relay tier's version bookkeeping and plan_repack(). Schedules differ only in what an instance may
// admit and in how a new version reaches the instances (on_train_done(), on_publish()).
#include <algorithm>
#include <cmath>
#include <deque>
#include <memory>
#include <optional>
#include <queue>
#include <random>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "event_loop.h"
#include "laminar/relay_versions.h"
#include "laminar/trajectory_queue.h"
#include "rollout_instance.h"
#include "sim_random.h"
#include "simulator.h"

namespace laminar::sim {
namespace {

using internal::Event;
using internal::EventKind;
using internal::RolloutInstance;
using internal::Sample;
using State = RolloutInstance::State;
using Stage = Sample::Stage;

double to_s(Duration d) { return static_cast<double>(d.count()) * 1e-9; }

struct Layout {
  std::int64_t rollout_gpus = 0;
  std::int64_t trainer_gpus = 0;
  std::int64_t instances = 0;
};

Result<Layout> layout_of(const SimConfig& c, ScheduleKind kind) {
  const ClusterConfig& k = c.cluster;
  if (k.gpus < 1) return invalid_argument(fmt::format("cluster.gpus: must be >= 1, got {}", k.gpus));
  if (k.trainer_gpus < 0) {
    return invalid_argument(fmt::format("cluster.trainer_gpus: must be >= 0, got {}", k.trainer_gpus));
  }
  if (k.max_batch < 1) return invalid_argument(fmt::format("cluster.max_batch: must be >= 1, got {}", k.max_batch));
  const std::int64_t tp = c.cost.rollout.tensor_parallel;
  Layout l;
  if (kind == ScheduleKind::kSync) {
    l.rollout_gpus = l.trainer_gpus = k.gpus;
    if (l.rollout_gpus < tp) {
      return invalid_argument(fmt::format("cluster.gpus: {} GPUs cannot hold one rollout instance of {} "
                                          "(rollout.tensor_parallel)", k.gpus, tp));
    }
  } else {
    l.trainer_gpus = k.trainer_gpus > 0 ? k.trainer_gpus : k.gpus / 4;
    l.rollout_gpus = k.gpus - l.trainer_gpus;
    if (l.trainer_gpus < 1 || l.rollout_gpus < tp) {
      return invalid_argument(fmt::format(
          "cluster.gpus: {} GPUs leave {} to the trainer and {} to rollouts; a disaggregated schedule needs at "
          "least 1 trainer GPU and one rollout instance of {} (rollout.tensor_parallel)",
          k.gpus, l.trainer_gpus, l.rollout_gpus, tp));
    }
  }
  l.instances = l.rollout_gpus / tp;
  return l;
}

// One training step's prompts and its samples' progress; dropped once all of it is trained.
struct StepState {
  StepWorkload workload;
  std::vector<Sample> samples;
  std::vector<std::int32_t> finished;  // per group: samples done (the group is queued with its last)
  std::vector<std::int64_t> taken;     // per instance: samples dispatched there, less those handed back
  std::int64_t trained = 0;
};

class Engine final : public internal::SampleTable {
 public:
  Engine(const SimConfig& config, const ScheduleSpec& spec, const SimOptions& options, CostModel cost,
         Workload workload, Layout layout);
  Status init();
  Result<SimReport> run();

  Sample& sample(std::int64_t id) override {
    return steps_[static_cast<std::size_t>(id / step_samples_)]->samples[static_cast<std::size_t>(id % step_samples_)];
  }

 private:
  bool global_update() const {
    return kind_ == ScheduleKind::kOneStep || kind_ == ScheduleKind::kStreamGlobal ||
           kind_ == ScheduleKind::kPartialRollout;
  }
  std::int64_t budget() const { return kind_ == ScheduleKind::kPartialRollout ? spec_.partial_token_budget : 0; }
  bool admits(const RolloutInstance& in) const;

  // The event handlers.
  void on_segment_end(RolloutInstance& in);
  void on_tool_return(Sample& s);
  void on_instance_ready(RolloutInstance& in);
  void on_sample_arrive(RolloutInstance& in, Sample& s);
  void on_train_done(std::int64_t step);
  void on_publish(std::int64_t version);
  void on_relay_arrive(std::int64_t relay, std::int64_t version);
  void on_repack_tick();
  void on_failure();

  // Instances.
  void settle(RolloutInstance& in);
  void resume(RolloutInstance& in);
  void on_idle(RolloutInstance& in);
  void admit(RolloutInstance& in, Sample& s);
  void remove_live(RolloutInstance& in, Sample& s);
  void finish(RolloutInstance& in, Sample& s);
  void push_group(std::int64_t first);
  void busy_for(RolloutInstance& in, Duration d, TraceSpan::Kind kind, std::int64_t load_version);
  void return_fresh_waiting(RolloutInstance& in);
  void span(const RolloutInstance& in, TraceSpan::Kind kind, Duration start, Duration end, std::int64_t batch);

  // The pool of samples not yet on an instance, and the trainer.
  void release_steps(bool capped_out = false);
  // Dispatch once every event of this instant is handled, so instances freed together share fairly.
  void request_dispatch() {
    if (dispatch_pending_) return;
    dispatch_pending_ = true;
    loop_.after(Duration::zero(), Event{EventKind::kDispatch});
  }
  void dispatch();
  void dispatch_capped();
  void assign(RolloutInstance& in, Sample& s);
  using Load = std::pair<std::int64_t, std::int32_t>;
  Load give_front(std::vector<Load>& open);
  static void reopen(std::vector<Load>& open, std::int64_t load, std::int32_t id);
  void start_touched();
  void uncharge(Sample& s);
  bool may_take(const RolloutInstance& in) const;
  void try_train();
  void check_barrier();
  void restart_carried();
  SimReport finish_report();
  void fail(Status st) {
    if (error_.ok()) error_ = std::move(st);
  }

  SimConfig config_;
  ScheduleSpec spec_;
  SimOptions options_;
  ScheduleKind kind_;
  CostModel cost_;
  Workload workload_;
  Layout layout_;
  std::int64_t step_samples_;
  std::int64_t group_size_;
  std::optional<std::int64_t> step_cap_;  // Laminar: ScheduleSpec::max_step_share in samples

  internal::EventLoop loop_;
  std::unique_ptr<TrajectoryQueue> queue_;
  std::vector<std::unique_ptr<StepState>> steps_;
  std::int64_t next_release_ = 0;
  std::deque<std::int64_t> pool_;
  std::vector<std::int64_t> carried_;  // partial rollout: over budget, back at the next version
  bool dispatch_pending_ = false;
  std::vector<Load> dispatch_open_;          // dispatch()'s heap, reused
  std::vector<std::int32_t> dispatch_touched_;
  std::vector<bool> dispatch_marked_;        // per instance: in dispatch_touched_
  std::deque<std::int64_t> dispatch_kept_;   // dispatch_capped()'s, reused
  std::vector<std::int64_t> pool_steps_;     // the steps pooled after the last dispatch_capped()
  std::vector<std::int64_t> stopped_;        // settle()'s, reused
  std::vector<Trajectory> group_buffer_;     // push_group()'s, reused
  std::vector<RolloutInstance> instances_;
  std::vector<std::int64_t> loading_version_;  // per instance: the version a kBusy pull brings
  std::uint64_t admitted_ = 0;
  std::int64_t watermark_pages_ = 0;

  // Trainer.
  std::int64_t version_ = 0;  // newest published
  bool trainer_busy_ = false;
  std::int64_t steps_trained_ = 0;
  std::int64_t ready_trajectories_ = 0;
  std::optional<std::int64_t> pending_version_;  // global update waiting for its barrier
  std::vector<std::uint8_t> popped_;             // per sample id: trained once

  // Laminar's relays, one per rollout node.
  std::vector<VersionLedger> ledgers_;
  std::vector<std::int64_t> relay_newest_;
  FleetVersions fleet_;
  ChunkPlan weight_plan_;
  bool repack_tick_pending_ = false;
  RepackPolicyOptions repack_options_;

  std::mt19937_64 rng_;
  std::int64_t nodes_ = 0;
  SimReport report_;
  Status error_;
  bool done_ = false;
};

Engine::Engine(const SimConfig& config, const ScheduleSpec& spec, const SimOptions& options, CostModel cost,
               Workload workload, Layout layout)
    : config_(config),
      spec_(spec),
      options_(options),
      kind_(spec.kind),
      cost_(std::move(cost)),
      workload_(std::move(workload)),
      layout_(layout),
      step_samples_(config.workload.prompts_per_step * config.workload.samples_per_prompt),
      group_size_(config.workload.samples_per_prompt),
      rng_(config.seed) {}

Status Engine::init() {
  TrajectoryQueueOptions q;
  q.clock = loop_.clock();
  q.validate_contents = false;
  q.capacity_trajectories = static_cast<std::size_t>(std::min<std::int64_t>(config_.steps * step_samples_ + 1, (1 << 24) - 1));
  q.default_lease = kForever;
  Result<std::unique_ptr<TrajectoryQueue>> made = TrajectoryQueue::create(q);
  if (!made.ok()) return made.status();
  queue_ = std::move(*made);

  const CostConfig& c = cost_.config();
  const std::int64_t tp = c.rollout.tensor_parallel, gpn = c.network.gpus_per_node;
  nodes_ = (layout_.instances * tp + gpn - 1) / gpn;
  instances_.resize(static_cast<std::size_t>(layout_.instances));
  loading_version_.assign(instances_.size(), -1);
  dispatch_marked_.assign(instances_.size(), false);
  for (std::size_t i = 0; i < instances_.size(); ++i) {
    instances_[i].id = static_cast<std::int32_t>(i);
    instances_[i].node = static_cast<std::int32_t>(static_cast<std::int64_t>(i) * tp / gpn);
  }
  watermark_pages_ = std::max<std::int64_t>(1, cost_.kv_capacity_pages() / 100);
  if (kind_ == ScheduleKind::kLaminar && spec_.max_step_share) {
    const double fair = std::ceil(static_cast<double>(step_samples_) / static_cast<double>(layout_.instances));
    step_cap_ = std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(*spec_.max_step_share * fair)));
  }
  steps_.resize(static_cast<std::size_t>(config_.steps));
  popped_.assign(static_cast<std::size_t>(config_.steps * step_samples_), 0);
  report_.step_records.resize(static_cast<std::size_t>(config_.steps));
  for (std::size_t i = 0; i < report_.step_records.size(); ++i) report_.step_records[i].step = static_cast<std::int64_t>(i);

  if (kind_ == ScheduleKind::kLaminar) {
    const auto bytes = static_cast<std::uint64_t>(cost_.weight_bytes());
    Result<ChunkPlan> plan = ChunkPlan::make(std::max<std::uint64_t>(bytes, ChunkPlan::kMinChunkBytes),
                                             std::max<std::uint64_t>(bytes, ChunkPlan::kMinChunkBytes));
    if (!plan.ok()) return plan.status();
    weight_plan_ = *plan;
    ledgers_.resize(static_cast<std::size_t>(nodes_));
    relay_newest_.assign(static_cast<std::size_t>(nodes_), 0);
    for (std::int64_t r = 0; r < nodes_; ++r) {
      LAMINAR_RETURN_IF_ERROR(ledgers_[static_cast<std::size_t>(r)].begin(Version(0), weight_plan_));
      Result<std::pair<bool, std::vector<Version>>> done = ledgers_[static_cast<std::size_t>(r)].chunk_verified(Version(0), 0);
      if (!done.ok()) return done.status();
      LAMINAR_RETURN_IF_ERROR(fleet_.set_held(static_cast<std::uint32_t>(r), FleetVersions::Role::kRelay, Version(0)));
    }
    for (const RolloutInstance& in : instances_) {
      LAMINAR_RETURN_IF_ERROR(fleet_.set_held(static_cast<std::uint32_t>(nodes_ + in.id), FleetVersions::Role::kPuller,
                                              Version(0)));
    }
    repack_options_ = spec_.repack_options;
    const RepackPolicyOptions defaults;
    const double kv_page_bytes = cost_.kv_bytes_per_token_per_rank() * static_cast<double>(tp * c.rollout.page_tokens);
    if (repack_options_.page_bytes == defaults.page_bytes) {
      repack_options_.page_bytes = static_cast<std::uint64_t>(kv_page_bytes);
    }
    if (repack_options_.link_bytes_per_s == defaults.link_bytes_per_s) {
      repack_options_.link_bytes_per_s = c.gpu.network_bytes_per_s * static_cast<double>(tp) * c.network.link_efficiency;
    }
  }
  if (config_.cluster.failures) {
    Result<Duration> ttf = cost_.time_to_failure(nodes_, rng_);
    if (!ttf.ok()) return ttf.status();
    loop_.at(*ttf, Event{EventKind::kFailure});
  }
  request_dispatch();
  return ok_status();
}

bool Engine::admits(const RolloutInstance& in) const {
  if (in.state == State::kBusy || in.state == State::kDown) return false;
  switch (kind_) {
    case ScheduleKind::kLaminar:
      return in.version >= relay_newest_[static_cast<std::size_t>(in.node)];
    case ScheduleKind::kStreamGlobal:
    case ScheduleKind::kPartialRollout:
      return !pending_version_.has_value();
    default:
      return true;
  }
}

// Puts the next steps' samples into the pool while the admission rule allows and the pool is
// empty, so that the pool never runs ahead of what instances can take.
// `capped_out`: the pool holds only samples the step share keeps from the instances with room, so
// one more step may go to them.
void Engine::release_steps(bool capped_out) {
  // The rule bounds the weights a prompt starts on. Laminar's instances start fresh prompts only on
  // their relay's newest version, so a step waits until every relay holds the version the rule
  // needs; the trainer's publish alone would let prompts start on the version before.
  const std::int64_t admissible =
      kind_ == ScheduleKind::kLaminar ? *std::min_element(relay_newest_.begin(), relay_newest_.end()) : version_;
  while ((pool_.empty() || capped_out) && next_release_ < config_.steps &&
         (!spec_.max_ahead_steps || admissible >= next_release_ - *spec_.max_ahead_steps)) {
    capped_out = false;
    const std::int64_t s = next_release_++;
    Result<StepWorkload> w = workload_.step(s);
    if (!w.ok()) {
      fail(w.status());
      return;
    }
    auto st = std::make_unique<StepState>();
    st->workload = std::move(*w);
    st->finished.assign(st->workload.groups.size(), 0);
    st->taken.assign(instances_.size(), 0);
    st->samples.reserve(static_cast<std::size_t>(step_samples_));
    for (const PromptGroup& g : st->workload.groups) {
      for (std::size_t i = 0; i < g.samples.size(); ++i) {
        Sample x;
        x.id = s * step_samples_ + static_cast<std::int64_t>(st->samples.size());
        x.step = s;
        x.group = s * config_.workload.prompts_per_step + g.prompt_index;
        x.index = static_cast<std::int32_t>(i);
        x.prompt_tokens = g.prompt_tokens;
        x.response_tokens = g.samples[i].response_tokens;
        x.turns = &g.samples[i].turns;
        x.turn_count = static_cast<std::int32_t>(g.samples[i].turns.size());
        x.restart();
        st->samples.push_back(x);
        pool_.push_back(x.id);
      }
    }
    steps_[static_cast<std::size_t>(s)] = std::move(st);
  }
}

// Samples go one by one to the least loaded instance that admits them and has a free slot.
void Engine::dispatch() {
  dispatch_pending_ = false;
  if (step_cap_) return dispatch_capped();
  for (;;) {
    release_steps();
    if (pool_.empty()) return;
    // A min-heap of (load, id) in a reused buffer: the least loaded first, ties to the lowest id.
    std::vector<Load>& open = dispatch_open_;
    open.clear();
    for (const RolloutInstance& in : instances_) {
      if (admits(in) && in.load() < config_.cluster.max_batch) open.emplace_back(in.load(), in.id);
    }
    std::make_heap(open.begin(), open.end(), std::greater<>());
    dispatch_touched_.clear();
    while (!pool_.empty() && !open.empty()) {
      const auto [load, id] = give_front(open);
      if (load < config_.cluster.max_batch) reopen(open, load, id);
    }
    start_touched();
    if (!pool_.empty()) return;  // no room anywhere: instances take the rest as slots free
  }
}

// Gives the pool's front sample to the least loaded instance of the min-heap `open`, which it
// leaves; returns that instance's new load and id. The instance is settled by start_touched().
Engine::Load Engine::give_front(std::vector<Load>& open) {
  std::pop_heap(open.begin(), open.end(), std::greater<>());
  const auto [load, id] = open.back();
  open.pop_back();
  if (!dispatch_marked_[static_cast<std::size_t>(id)]) {
    dispatch_marked_[static_cast<std::size_t>(id)] = true;
    dispatch_touched_.push_back(id);
  }
  Sample& s = sample(pool_.front());
  pool_.pop_front();
  assign(instances_[static_cast<std::size_t>(id)], s);
  return {load + 1, id};
}

void Engine::reopen(std::vector<Load>& open, std::int64_t load, std::int32_t id) {
  open.emplace_back(load, id);
  std::push_heap(open.begin(), open.end(), std::greater<>());
}

// Settles every instance a dispatch gave samples to and starts the idle ones.
void Engine::start_touched() {
  for (std::int32_t id : dispatch_touched_) {
    dispatch_marked_[static_cast<std::size_t>(id)] = false;
    RolloutInstance& in = instances_[static_cast<std::size_t>(id)];
    settle(in);
    if (in.state == State::kIdle) resume(in);
  }
}

// Laminar with a step share: as dispatch(), but an instance takes at most step_cap_ samples of one
// step. Samples no instance may take stay in the pool, in order, for the instances that pull next;
// when only such samples are left and instances still have room, the next admissible step goes to
// them.
void Engine::dispatch_capped() {
  const std::int64_t max_batch = config_.cluster.max_batch;
  std::vector<Load>& open = dispatch_open_;
  std::deque<std::int64_t>& kept = dispatch_kept_;
  for (;;) {
    release_steps();
    if (pool_.empty()) return;
    dispatch_touched_.clear();
    kept.clear();
    pool_steps_.clear();
    // The pool in runs of one step (returned samples go to its front): each run's own heap holds the
    // admitting instances with room that are still under the cap of its step.
    while (!pool_.empty()) {
      const std::int64_t step = sample(pool_.front()).step;
      std::vector<std::int64_t>& taken = steps_[static_cast<std::size_t>(step)]->taken;
      open.clear();
      for (const RolloutInstance& in : instances_) {
        if (admits(in) && in.load() < max_batch && taken[static_cast<std::size_t>(in.id)] < *step_cap_) {
          open.emplace_back(in.load(), in.id);
        }
      }
      std::make_heap(open.begin(), open.end(), std::greater<>());
      while (!pool_.empty() && sample(pool_.front()).step == step) {
        if (open.empty()) {
          if (pool_steps_.empty() || pool_steps_.back() != step) pool_steps_.push_back(step);
          kept.push_back(pool_.front());
          pool_.pop_front();
          continue;
        }
        const auto [load, id] = give_front(open);
        if (load < max_batch && taken[static_cast<std::size_t>(id)] < *step_cap_) reopen(open, load, id);
      }
    }
    pool_.swap(kept);
    start_touched();
    if (pool_.empty()) continue;
    const bool room = std::any_of(instances_.begin(), instances_.end(), [&](const RolloutInstance& in) {
      return admits(in) && in.load() < max_batch;
    });
    if (!room) return;
    const std::int64_t released = next_release_;
    release_steps(/*capped_out=*/true);
    if (next_release_ == released) return;  // the admission rule holds the next step back
  }
}

// `s` leaves the pool for `in`, counting against in's share of its step.
void Engine::assign(RolloutInstance& in, Sample& s) {
  s.stage = Stage::kWaiting;
  s.instance = in.id;
  s.charged = in.id;
  in.waiting.push_back(s.id);
  std::int64_t& taken = steps_[static_cast<std::size_t>(s.step)]->taken[static_cast<std::size_t>(in.id)];
  report_.max_step_samples_per_instance = std::max(report_.max_step_samples_per_instance, ++taken);
}

// `s` goes back to the pool unstarted: its instance's share of the step is free again.
void Engine::uncharge(Sample& s) {
  if (s.charged < 0) return;
  --steps_[static_cast<std::size_t>(s.step)]->taken[static_cast<std::size_t>(s.charged)];
  s.charged = -1;
}

// Whether a dispatch could give `in` a pooled sample under the step share (pool_steps_ is as of the
// last dispatch; whatever adds to the pool since asks for a dispatch itself).
bool Engine::may_take(const RolloutInstance& in) const {
  if (!step_cap_) return true;
  return std::any_of(pool_steps_.begin(), pool_steps_.end(), [&](std::int64_t step) {
    return steps_[static_cast<std::size_t>(step)]->taken[static_cast<std::size_t>(in.id)] < *step_cap_;
  });
}

void Engine::span(const RolloutInstance& in, TraceSpan::Kind kind, Duration start, Duration end, std::int64_t batch) {
  if (!options_.trace || end <= start) return;
  report_.trace.push_back(TraceSpan{in.id, kind, start, end, in.version, batch});
}

// Brings a running instance's decoding up to now and handles the samples that stopped.
void Engine::settle(RolloutInstance& in) {
  if (in.state != State::kRunning) return;
  const Duration start = in.seg_start;
  const std::int64_t batch = in.seg_batch;
  internal::settle(in, loop_.now(), *this, budget(), stopped_);
  span(in, TraceSpan::Kind::kGenerate, start, loop_.now(), batch);
  for (std::int64_t id : stopped_) {
    Sample& s = sample(id);
    if (s.turn_left <= 0 && s.last_turn()) {
      finish(in, s);
    } else if (s.turn_left <= 0) {
      internal::leave_decoding(in, s);
      in.kv_parked += s.context;
      loop_.after((*s.turns)[static_cast<std::size_t>(s.turn)].env_latency,
                  Event{EventKind::kToolReturn, s.id, 0, s.incarnation});
    } else {
      // Partial rollout: over this iteration's budget, it waits for the next version.
      remove_live(in, s);
      s.stage = Stage::kPooled;
      s.kv_missing = s.context;
      carried_.push_back(s.id);
    }
  }
}

void Engine::remove_live(RolloutInstance& in, Sample& s) {
  if (s.stage == Stage::kDecoding) {
    internal::leave_decoding(in, s);
  } else {
    in.kv_parked -= s.context;
  }
  in.live.erase(std::find(in.live.begin(), in.live.end(), s.id));
  s.instance = -1;
}

void Engine::finish(RolloutInstance& in, Sample& s) {
  remove_live(in, s);
  s.stage = Stage::kDone;
  StepState& step = *steps_[static_cast<std::size_t>(s.step)];
  const auto g = static_cast<std::size_t>(s.group - s.step * config_.workload.prompts_per_step);
  if (++step.finished[g] == group_size_) push_group(s.id - s.index);
}

// A group's samples are adjacent ids from `first`; they go to the queue together, in sample
// order, with one push_many: one admission for the group instead of one per member.
void Engine::push_group(std::int64_t first) {
  group_buffer_.clear();
  for (std::int64_t i = 0; i < group_size_; ++i) {
    const Sample& s = sample(first + i);
    Trajectory& t = group_buffer_.emplace_back();
    t.id = TrajectoryId(static_cast<std::uint64_t>(s.id) + 1);
    t.prompt_id = PromptId(static_cast<std::uint64_t>(s.group));
    t.group_id = GroupId(static_cast<std::uint64_t>(s.group) + 1);
    t.group_size = static_cast<std::uint32_t>(group_size_);
    t.sample_index = static_cast<std::uint32_t>(s.index);
    t.version = Version(static_cast<std::uint64_t>(s.oldest_version));
    // The real lengths stay in the engine's tables, so the token arrays stay empty (no batch here
    // has a token limit); a trajectory needs its reward.
    t.rewards = {0.0f};
  }
  (void)loop_.clock();  // brought up to now: the queue reads it
  const std::vector<Status> st = queue_->push_many(group_buffer_, PushOptions::fail_fast());
  for (std::size_t i = 0; i < st.size(); ++i) {
    if (!st[i].ok()) {
      return fail(internal_error(fmt::format("sample {}: queue refused it: {}", first + static_cast<std::int64_t>(i),
                                             st[i].to_string())));
    }
  }
  ready_trajectories_ += group_size_;
}

void Engine::admit(RolloutInstance& in, Sample& s) {
  s.instance = in.id;
  s.admitted_order = ++admitted_;
  in.live.push_back(s.id);
  internal::enter_decoding(in, s, budget());
  if (s.oldest_version < 0) {
    s.oldest_version = in.version;
  } else if (s.last_version != in.version) {
    s.mixed = true;
    s.oldest_version = std::min(s.oldest_version, in.version);
  }
  s.last_version = in.version;
}

// An idle instance: make room in its KV cache, admit what it may, and decode.
void Engine::resume(RolloutInstance& in) {
  if (in.state != State::kIdle) return;
  const std::int64_t capacity = cost_.kv_capacity_pages();
  const std::int64_t page_tokens = cost_.config().rollout.page_tokens;
  // KV full: preempt the most recently admitted decoding sample (vLLM's recompute preemption).
  while (in.pages_used(page_tokens, in.decoding) > capacity) {
    Sample* victim = nullptr;
    std::int64_t decoding = 0;
    for (std::int64_t id : in.live) {
      Sample& s = sample(id);
      if (s.stage != Stage::kDecoding) continue;
      ++decoding;
      if (victim == nullptr || s.admitted_order > victim->admitted_order) victim = &s;
    }
    if (decoding <= 1) break;
    remove_live(in, *victim);
    victim->stage = Stage::kWaiting;
    victim->instance = in.id;
    victim->kv_missing = victim->context;
    in.waiting.push_front(victim->id);
    ++report_.preemptions;
  }
  const bool fresh_ok = admits(in);
  auto fits = [&](const Sample& s) {
    return static_cast<std::int64_t>(in.live.size()) < config_.cluster.max_batch &&
           in.pages_used(page_tokens) + cost_.pages_for(s.context + 1).value() + watermark_pages_ <= capacity;
  };
  while (!in.waiting.empty()) {
    Sample& s = sample(in.waiting.front());
    if ((s.oldest_version < 0 && !fresh_ok) || !fits(s)) break;
    in.waiting.pop_front();
    admit(in, s);
  }
  if (fresh_ok && !pool_.empty() && in.load() < config_.cluster.max_batch && may_take(in)) request_dispatch();
  const Duration idle_from = in.state_since;
  if (!internal::start_segment(in, loop_.now(), cost_, *this)) {
    on_idle(in);
    return;
  }
  span(in, TraceSpan::Kind::kIdle, idle_from, loop_.now(), 0);
  loop_.at(in.seg_end, Event{EventKind::kSegmentEnd, in.id, 0, in.epoch});
}

// Nothing decodes here now.
void Engine::on_idle(RolloutInstance& in) {
  if (kind_ == ScheduleKind::kLaminar) {
    if (!in.live.empty() || !in.waiting.empty()) return;
    const std::int64_t newest = relay_newest_[static_cast<std::size_t>(in.node)];
    PullDecision d = next_pull(PullerView{Version(static_cast<std::uint64_t>(in.version)), std::nullopt, false},
                               Version(static_cast<std::uint64_t>(newest)), PullPolicy::kWhenIdle);
    if (d.action == PullAction::kPull) busy_for(in, cost_.relay_to_device(), TraceSpan::Kind::kPull, newest);
    return;
  }
  if (global_update()) check_barrier();
}

void Engine::busy_for(RolloutInstance& in, Duration d, TraceSpan::Kind kind, std::int64_t load_version) {
  in.state = State::kBusy;
  ++in.epoch;
  loading_version_[static_cast<std::size_t>(in.id)] = load_version;
  span(in, kind, loop_.now(), loop_.now() + d, 0);
  loop_.after(d, Event{EventKind::kInstanceReady, in.id, 0, in.epoch});
}

// An instance that may not start fresh prompts hands back the ones it has not begun.
void Engine::return_fresh_waiting(RolloutInstance& in) {
  std::deque<std::int64_t> keep;
  for (auto it = in.waiting.rbegin(); it != in.waiting.rend(); ++it) {
    Sample& s = sample(*it);
    if (s.oldest_version >= 0) {
      keep.push_front(*it);
    } else {
      uncharge(s);
      s.stage = Stage::kPooled;
      s.instance = -1;
      pool_.push_front(*it);
      request_dispatch();
    }
  }
  in.waiting = std::move(keep);
}

// kOneStep, kStreamGlobal, kPartialRollout: the broadcast starts once no instance holds a live
// sample (kOneStep: once the whole admitted step is generated). Partial rollout with no update
// coming and nothing left but carried samples starts their next iteration on the same weights:
// otherwise groups held back by the budget could never complete a batch.
void Engine::check_barrier() {
  if (!pending_version_ && (kind_ != ScheduleKind::kPartialRollout || carried_.empty() || !pool_.empty())) return;
  for (const RolloutInstance& in : instances_) {
    if (in.state == State::kDown) continue;
    if (!in.live.empty()) return;
    for (std::int64_t id : in.waiting) {
      if (kind_ == ScheduleKind::kOneStep || sample(id).oldest_version >= 0) return;
    }
  }
  if (kind_ == ScheduleKind::kOneStep && !pool_.empty()) return;
  if (!pending_version_) {
    restart_carried();
    return;
  }
  const std::int64_t v = *pending_version_;
  pending_version_.reset();
  const Duration b = cost_.weight_sync(WeightSyncSchedule::kGlobalBroadcast, layout_.rollout_gpus).value().rollout_stall;
  // Published before the instances come back, so nothing is pushed with a version the queue lacks.
  loop_.after(b, Event{EventKind::kPublish, v});
  for (RolloutInstance& in : instances_) {
    if (in.state != State::kDown) busy_for(in, b, TraceSpan::Kind::kWaitWeights, v);
  }
}

void Engine::on_segment_end(RolloutInstance& in) {
  settle(in);
  resume(in);
}

void Engine::on_tool_return(Sample& s) {
  RolloutInstance& in = instances_[static_cast<std::size_t>(s.instance)];
  settle(in);
  const Turn& done = (*s.turns)[static_cast<std::size_t>(s.turn)];
  ++s.turn;
  s.turn_left = (*s.turns)[static_cast<std::size_t>(s.turn)].generate_tokens;
  in.kv_parked -= s.context;
  s.context += done.observation_tokens;
  s.kv_missing += done.observation_tokens;
  internal::enter_decoding(in, s, budget());
  resume(in);
}

void Engine::on_instance_ready(RolloutInstance& in) {
  std::int64_t v = loading_version_[static_cast<std::size_t>(in.id)];
  if (in.state == State::kDown) {
    v = kind_ == ScheduleKind::kLaminar ? relay_newest_[static_cast<std::size_t>(in.node)] : version_;
    span(in, TraceSpan::Kind::kRecover, in.state_since, loop_.now(), 0);
  }
  if (v > in.version) {
    in.version = v;
    ++report_.weight_updates;
    if (kind_ == ScheduleKind::kLaminar) {
      fail(fleet_.set_held(static_cast<std::uint32_t>(nodes_ + in.id), FleetVersions::Role::kPuller,
                           Version(static_cast<std::uint64_t>(v))));
    }
  }
  in.state = State::kIdle;
  in.state_since = loop_.now();
  ++in.epoch;
  // Weights changed under live samples (bounded staleness): their KV is recomputed.
  for (std::int64_t id : in.live) {
    Sample& s = sample(id);
    if (s.last_version == in.version) continue;
    s.mixed = true;
    s.last_version = in.version;
    if (s.stage == Stage::kDecoding) {
      internal::sync(in, s);
      if (s.kv_missing == 0) in.prefilling.push_back(s.id);
    }
    s.kv_missing = s.context;
  }
  request_dispatch();
  resume(in);
}

void Engine::on_sample_arrive(RolloutInstance& in, Sample& s) {
  settle(in);
  in.kv_parked -= s.context;
  internal::enter_decoding(in, s, budget());
  resume(in);
}

void Engine::try_train() {
  const std::int64_t batch_size = step_samples_;
  if (trainer_busy_ || steps_trained_ == config_.steps || ready_trajectories_ < batch_size) return;
  const std::int64_t step = steps_trained_;
  BatchSpec b;
  b.max_trajectories = b.min_trajectories = static_cast<std::size_t>(batch_size);
  b.consumer_version = Version(static_cast<std::uint64_t>(step));
  b.lease = kForever;
  (void)loop_.clock();
  Result<Batch> batch = queue_->pop_batch(b);
  if (!batch.ok()) return fail(internal_error(fmt::format("step {}: pop_batch: {}", step, batch.status().to_string())));
  if (static_cast<std::int64_t>(batch->size()) != batch_size) {
    return fail(internal_error(fmt::format("step {}: popped {} trajectories, expected {}", step, batch->size(), batch_size)));
  }
  std::int64_t tokens = 0;
  double staleness_sum = 0;
  for (const Trajectory& t : batch->trajectories()) {
    const std::int64_t id = static_cast<std::int64_t>(t.id.value()) - 1;
    if (id < 0 || id >= static_cast<std::int64_t>(popped_.size()) || popped_[static_cast<std::size_t>(id)] != 0) {
      return fail(internal_error(fmt::format("step {}: trajectory {} delivered twice or never made", step, id)));
    }
    popped_[static_cast<std::size_t>(id)] = 1;
    const Sample& s = sample(id);
    if (s.stage != Stage::kDone) return fail(internal_error(fmt::format("step {}: sample {} trained unfinished", step, id)));
    tokens += s.prompt_tokens + s.response_tokens;
    report_.tokens_trained += s.response_tokens;
    const std::int64_t stale = step - s.oldest_version;
    if (static_cast<std::int64_t>(report_.staleness_histogram.size()) <= stale) {
      report_.staleness_histogram.resize(static_cast<std::size_t>(stale) + 1, 0);
    }
    ++report_.staleness_histogram[static_cast<std::size_t>(stale)];
    report_.max_staleness = std::max(report_.max_staleness, stale);
    if (s.mixed) ++report_.mixed_version_trajectories;
    staleness_sum += static_cast<double>(stale);
  }
  for (const Trajectory& t : batch->trajectories()) {
    const std::int64_t id = static_cast<std::int64_t>(t.id.value()) - 1;
    StepState& st = *steps_[static_cast<std::size_t>(id / step_samples_)];
    if (++st.trained == step_samples_) steps_[static_cast<std::size_t>(id / step_samples_)].reset();
  }
  if (Status st = queue_->ack(batch->id()); !st.ok()) return fail(internal_error(fmt::format("step {}: ack: {}", step, st.to_string())));
  report_.samples_trained += batch_size;
  ready_trajectories_ -= batch_size;
  ++steps_trained_;
  trainer_busy_ = true;
  StepRecord& r = report_.step_records[static_cast<std::size_t>(step)];
  r.start = loop_.now();
  r.mean_staleness = staleness_sum / static_cast<double>(batch_size);
  loop_.after(cost_.train_step(tokens, layout_.trainer_gpus).value(), Event{EventKind::kTrainDone, step});
}

void Engine::on_train_done(std::int64_t step) {
  const std::int64_t v = step + 1;
  switch (kind_) {
    case ScheduleKind::kSync: {
      // Colocated: each GPU reshards its training weights into the inference engine's layout, one
      // read and one write of its shard through HBM; nothing crosses the network.
      const CostConfig& c = cost_.config();
      const double reshard_s = 2 * cost_.weight_bytes_per_rank() / (c.gpu.hbm_bytes_per_s * c.rollout.hbm_efficiency);
      loop_.after(seconds(reshard_s), Event{EventKind::kPublish, v});
      break;
    }
    case ScheduleKind::kLaminar: {
      const WeightSync w = cost_.weight_sync(WeightSyncSchedule::kRelay, layout_.rollout_gpus).value();
      loop_.after(w.trainer_blocked, Event{EventKind::kPublish, v});
      for (std::int64_t r = 0; r < nodes_; ++r) {
        loop_.after(w.trainer_blocked + cost_.relay_chain(r + 1).value(), Event{EventKind::kRelayArrive, r, v});
      }
      break;
    }
    case ScheduleKind::kBoundedStaleness: {
      // Every rollout stops at once for the broadcast; live samples keep their tokens.
      const Duration b = cost_.weight_sync(WeightSyncSchedule::kGlobalBroadcast, layout_.rollout_gpus).value().rollout_stall;
      loop_.after(b, Event{EventKind::kPublish, v});
      for (RolloutInstance& in : instances_) {
        if (in.state == State::kDown) continue;
        settle(in);
        busy_for(in, b, TraceSpan::Kind::kWaitWeights, v);
      }
      break;
    }
    default:
      pending_version_ = v;
      check_barrier();
  }
}

void Engine::on_publish(std::int64_t v) {
  version_ = v;
  (void)loop_.clock();
  if (Status st = queue_->publish_version(Version(static_cast<std::uint64_t>(v))); !st.ok()) return fail(st);
  trainer_busy_ = false;
  report_.step_records[static_cast<std::size_t>(v - 1)].end = loop_.now();
  if (options_.on_step) options_.on_step(v, config_.steps);
  if (v == config_.steps) {
    done_ = true;
    return;
  }
  if (kind_ == ScheduleKind::kSync) {
    for (RolloutInstance& in : instances_) {
      if (in.state == State::kDown) continue;
      in.version = v;
      ++report_.weight_updates;
    }
  }
  if (kind_ == ScheduleKind::kPartialRollout) restart_carried();
  request_dispatch();
}

// Partial rollout: a new iteration; the carried samples go first.
void Engine::restart_carried() {
  for (auto it = carried_.rbegin(); it != carried_.rend(); ++it) {
    sample(*it).iteration_tokens = 0;
    pool_.push_front(*it);
  }
  carried_.clear();
  request_dispatch();
}

void Engine::on_relay_arrive(std::int64_t relay, std::int64_t v) {
  const auto r = static_cast<std::size_t>(relay);
  const Version version(static_cast<std::uint64_t>(v));
  if (Status st = ledgers_[r].begin(version, weight_plan_); !st.ok()) return fail(st);
  if (auto done = ledgers_[r].chunk_verified(version, 0); !done.ok()) return fail(done.status());
  if (Status st = fleet_.set_held(static_cast<std::uint32_t>(relay), FleetVersions::Role::kRelay, version); !st.ok()) {
    return fail(st);
  }
  relay_newest_[r] = v;
  for (RolloutInstance& in : instances_) {
    if (in.node != relay || in.version >= v || in.state == State::kDown || in.state == State::kBusy) continue;
    return_fresh_waiting(in);
    if (in.live.empty() && in.waiting.empty()) on_idle(in);
  }
  if (relay == nodes_ - 1) request_dispatch();  // the whole tier holds v: the admission rule may release a step
  if (spec_.repack && relay == nodes_ - 1 && !repack_tick_pending_) {
    repack_tick_pending_ = true;
    loop_.after(Duration::zero(), Event{EventKind::kRepackTick});
  }
}

// Laminar: consolidate the instances draining an older version so that emptied ones pull.
void Engine::on_repack_tick() {
  repack_tick_pending_ = false;
  const std::int64_t newest = *std::max_element(relay_newest_.begin(), relay_newest_.end());
  FleetSnapshot fleet;
  fleet.tokens_per_page = static_cast<std::int32_t>(cost_.config().rollout.page_tokens);
  // Dispatch runs whenever an admitting instance has room, so pooled samples are ones the newest
  // version's instances have no slot or step share for: the listed instances' free slots need not
  // be counted.
  fleet.prompts_waiting = static_cast<std::int64_t>(pool_.size());
  std::vector<std::int32_t> settled;
  bool draining = false;
  for (RolloutInstance& in : instances_) {
    // An instance whose relay lacks the newest version still admits prompts: it is not draining.
    if (in.version >= relay_newest_[static_cast<std::size_t>(in.node)] || in.live.empty() ||
        in.state == State::kBusy || in.state == State::kDown) {
      continue;
    }
    draining = true;
    settle(in);
    settled.push_back(in.id);
    if (in.live.empty()) continue;
    WorkerSnapshot w;
    w.id = WorkerId(static_cast<std::uint32_t>(in.id));
    w.version = Version(static_cast<std::uint64_t>(in.version));
    std::int64_t pages_used = 0;
    for (std::int64_t id : in.live) {
      Sample& s = sample(id);
      if (s.stage == Stage::kDecoding) internal::sync(in, s);
      const std::int64_t pages = cost_.pages_for(s.context).value();
      pages_used += pages;
      if (s.stage == Stage::kDecoding && s.kv_missing == 0) {
        w.sequences.push_back(SequenceSnapshot{SequenceId(static_cast<std::uint64_t>(id)), s.context, pages, std::nullopt});
      }
    }
    // Tool observations and arrivals may overfill a cache until the instance's next preemption.
    w.pages_total = std::max(cost_.kv_capacity_pages(), pages_used);
    w.pages_used = pages_used;
    w.slots_total = static_cast<std::int32_t>(config_.cluster.max_batch);
    w.slots_used = static_cast<std::int32_t>(in.live.size());
    w.step_time = cost_.decode_step(std::max<std::int64_t>(in.decoding, 1), in.kv_decoding).value();
    w.waiting_prompts = static_cast<std::int64_t>(in.waiting.size());
    w.kv_stopped_growing = true;
    fleet.workers.push_back(std::move(w));
  }
  if (!fleet.workers.empty()) {
    Result<MigrationPlan> plan = plan_repack(fleet, Version(static_cast<std::uint64_t>(newest)), repack_options_);
    if (!plan.ok()) return fail(internal_error(fmt::format("plan_repack: {}", plan.status().to_string())));
    ++report_.repack_plans;
    report_.repack_moves += static_cast<std::int64_t>(plan->moves.size());
    report_.repack_bytes += static_cast<double>(plan->pages_moved) * static_cast<double>(repack_options_.page_bytes);
    // Each source sends its sequences one after another; it is free once the last has gone.
    std::vector<Duration> sent(instances_.size(), Duration::zero());
    for (const Move& m : plan->moves) {
      RolloutInstance& from = instances_[m.from.value()];
      RolloutInstance& to = instances_[m.to.value()];
      Sample& s = sample(static_cast<std::int64_t>(m.sequence.value()));
      sent[from.id] += cost_.kv_migration(s.context, from.node == to.node).value();
      remove_live(from, s);
      s.instance = to.id;
      s.stage = Stage::kMigrating;
      to.live.push_back(s.id);
      to.kv_parked += s.context;
      loop_.after(sent[from.id], Event{EventKind::kSampleArrive, to.id, s.id, s.incarnation});
    }
    for (const FreedWorker& f : plan->freed) {
      RolloutInstance& in = instances_[f.worker.value()];
      busy_for(in, sent[in.id], TraceSpan::Kind::kMigrate, in.version);
    }
  }
  for (std::int32_t id : settled) resume(instances_[static_cast<std::size_t>(id)]);
  if (draining) {
    repack_tick_pending_ = true;
    loop_.after(spec_.repack_interval, Event{EventKind::kRepackTick});
  }
}

// A rollout node fails: its samples start over elsewhere, its instances come back after recovery.
void Engine::on_failure() {
  const auto node = static_cast<std::int32_t>(internal::uniform01(rng_) * static_cast<double>(nodes_));
  ++report_.failures;
  for (RolloutInstance& in : instances_) {
    if (in.node != node || in.state == State::kDown) continue;
    if (in.state == State::kRunning) in.busy_generating += loop_.now() - in.seg_start;
    for (std::int64_t id : in.live) {
      uncharge(sample(id));
      sample(id).restart();
    }
    for (std::int64_t id : in.waiting) {
      uncharge(sample(id));
      sample(id).restart();
    }
    for (auto it = in.live.rbegin(); it != in.live.rend(); ++it) pool_.push_front(*it);
    for (auto it = in.waiting.rbegin(); it != in.waiting.rend(); ++it) pool_.push_front(*it);
    internal::clear(in);
    in.state = State::kDown;
    in.state_since = loop_.now();
    ++in.epoch;
    loop_.after(cost_.recovery_time(), Event{EventKind::kInstanceReady, in.id, 0, in.epoch});
  }
  request_dispatch();
  if (global_update()) check_barrier();
  loop_.after(cost_.time_to_failure(nodes_, rng_).value(), Event{EventKind::kFailure});
}

Result<SimReport> Engine::run() {
  LAMINAR_RETURN_IF_ERROR(init());
  while (!done_ && error_.ok()) {
    std::optional<Event> e = loop_.next();
    if (!e) {
      return internal_error(fmt::format("{}: no event left at {} s with {} of {} steps trained",
                                        schedule_name(kind_), to_s(loop_.now()), steps_trained_, config_.steps));
    }
    switch (e->kind) {
      case EventKind::kSegmentEnd: {
        RolloutInstance& in = instances_[static_cast<std::size_t>(e->a)];
        if (in.state == State::kRunning && in.epoch == e->epoch) on_segment_end(in);
        break;
      }
      case EventKind::kToolReturn: {
        Sample& s = sample(e->a);
        if (s.incarnation == e->epoch && s.stage == Stage::kToolWait) on_tool_return(s);
        break;
      }
      case EventKind::kInstanceReady: {
        RolloutInstance& in = instances_[static_cast<std::size_t>(e->a)];
        if (in.epoch == e->epoch && (in.state == State::kBusy || in.state == State::kDown)) on_instance_ready(in);
        break;
      }
      case EventKind::kSampleArrive: {
        Sample& s = sample(e->b);
        if (s.incarnation == e->epoch && s.stage == Stage::kMigrating) {
          on_sample_arrive(instances_[static_cast<std::size_t>(e->a)], s);
        }
        break;
      }
      case EventKind::kTrainDone:
        on_train_done(e->a);
        break;
      case EventKind::kPublish:
        on_publish(e->a);
        break;
      case EventKind::kRelayArrive:
        on_relay_arrive(e->a, e->b);
        break;
      case EventKind::kRepackTick:
        on_repack_tick();
        break;
      case EventKind::kFailure:
        on_failure();
        break;
      case EventKind::kDispatch:
        dispatch();
        break;
    }
    if (done_) break;
    try_train();
  }
  LAMINAR_RETURN_IF_ERROR(error_);
  // Exactly once: every trained sample was popped once (checked as popped); no group is missing a
  // member, and the count is the steps' worth.
  std::int64_t trained = 0;
  for (std::size_t g = 0; g < popped_.size(); g += static_cast<std::size_t>(group_size_)) {
    std::int64_t members = 0;
    for (std::size_t i = g; i < g + static_cast<std::size_t>(group_size_); ++i) members += popped_[i];
    if (members != 0 && members != group_size_) {
      return internal_error(fmt::format("group {}: {} of its {} samples trained", g / static_cast<std::size_t>(group_size_),
                                        members, group_size_));
    }
    trained += members;
  }
  if (trained != config_.steps * step_samples_) {
    return internal_error(fmt::format("{} samples trained, expected {}", trained, config_.steps * step_samples_));
  }
  return finish_report();
}

SimReport Engine::finish_report() {
  const Duration end = loop_.now();
  SimReport& r = report_;
  for (RolloutInstance& in : instances_) settle(in);
  r.schedule = std::string(schedule_name(kind_));
  r.spec = spec_;
  r.gpus = config_.cluster.gpus;
  r.rollout_gpus = layout_.rollout_gpus;
  r.trainer_gpus = layout_.trainer_gpus;
  r.steps = config_.steps;
  r.total = end;
  const double total_s = to_s(end);
  Duration generating{0};
  std::int64_t generated = 0;
  for (const RolloutInstance& in : instances_) {
    generating += in.busy_generating;
    generated += in.tokens_generated;
  }
  if (total_s > 0) {
    r.samples_per_s = static_cast<double>(r.samples_trained) / total_s;
    r.tokens_per_s = static_cast<double>(r.tokens_trained) / total_s;
    r.generation_utilisation = to_s(generating) * static_cast<double>(cost_.config().rollout.tensor_parallel) /
                               (static_cast<double>(layout_.rollout_gpus) * total_s);
    r.generation_tokens_per_s = static_cast<double>(generated) / total_s;
  }
  r.mean_step_time = config_.steps > 0 ? end / config_.steps : Duration::zero();
  r.events = loop_.processed();
  return std::move(r);
}

}  // namespace

Result<SimReport> simulate(const SimConfig& config, const ScheduleSpec& spec, const SimOptions& options) {
  if (config.steps < 1) return invalid_argument(fmt::format("steps: must be >= 1, got {}", config.steps));
  Result<Layout> layout = layout_of(config, spec.kind);
  if (!layout.ok()) return layout.status();
  LAMINAR_RETURN_IF_ERROR(config.validate());
  LAMINAR_RETURN_IF_ERROR(spec.validate());
  Result<CostModel> cost = CostModel::create(config.cost);
  if (!cost.ok()) return cost.status();
  const std::int64_t longest = config.workload.prompt_length.max_tokens + config.workload.response_length.max_tokens;
  if (longest > cost->kv_capacity_tokens()) {
    return invalid_argument(fmt::format(
        "workload: a sample of {} tokens (prompt_length.max + response_length.max) cannot fit one rollout "
        "instance's KV cache of {} tokens",
        longest, cost->kv_capacity_tokens()));
  }
  Result<Workload> workload = Workload::create(config.workload);
  if (!workload.ok()) return workload.status();
  Engine engine(config, spec, options, std::move(*cost), std::move(*workload), *layout);
  return engine.run();
}

}  // namespace laminar::sim
