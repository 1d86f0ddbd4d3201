// The simulator's engine on small clusters: determinism, exactly-once training under every
// schedule, where Laminar's advantage comes from, virtual time only, and its input checks.
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <ctime>
#include <limits>
#include <optional>
#include <string>
#include <thread>

#include <catch2/catch.hpp>

#include "simulator.h"

namespace {

// Counts clock_gettime calls made on the thread running simulate(); everything else passes through.
std::atomic<long> wall_clock_reads{0};
thread_local bool counting = false;

}  // namespace

extern "C" int clock_gettime(clockid_t id, timespec* ts) {
  if (counting) wall_clock_reads.fetch_add(1, std::memory_order_relaxed);
  return static_cast<int>(syscall(SYS_clock_gettime, id, ts));
}

namespace laminar::sim {
namespace {

constexpr ScheduleKind kAll[] = {ScheduleKind::kSync,           ScheduleKind::kOneStep,
                                 ScheduleKind::kStreamGlobal,   ScheduleKind::kBoundedStaleness,
                                 ScheduleKind::kPartialRollout, ScheduleKind::kLaminar};

ScheduleSpec spec_of(ScheduleKind kind) {
  ScheduleSpec s;
  s.kind = kind;
  switch (kind) {
    case ScheduleKind::kSync: s.max_ahead_steps = 0; break;
    case ScheduleKind::kBoundedStaleness: s.max_ahead_steps = 4; break;
    case ScheduleKind::kLaminar: s.max_ahead_steps = std::nullopt; break;
    default: s.max_ahead_steps = 1;
  }
  s.partial_token_budget = 1024;  // below the longest responses, so some are carried over
  return s;
}

// 32 H100s, a Qwen2.5-7B-shaped model, 16 prompts x 8 samples, responses of median 1,000 tokens
// with the paper's long tail capped at 4k.
SimConfig small_config() {
  SimConfig c;
  c.workload = WorkloadConfig::paper_math();
  c.workload.prompts_per_step = 16;
  c.workload.samples_per_prompt = 8;
  c.workload.response_length = {*Distribution::log_normal(1000, std::log(10.0) / 2.326), 4096};
  c.cost.gpu = *GpuSpec::preset("h100");
  c.cost.model = *ModelSpec::preset("qwen2.5-7b");
  c.cluster.gpus = 32;
  c.cluster.trainer_gpus = 8;
  c.cluster.max_batch = 64;
  c.steps = 6;
  c.seed = 7;
  return c;
}

SimReport run(const SimConfig& c, ScheduleKind kind, const SimOptions& o = {}) {
  Result<SimReport> r = simulate(c, spec_of(kind), o);
  INFO(schedule_name(kind) << ": " << r.status().to_string());
  REQUIRE(r.ok());
  return std::move(*r);
}

TEST_CASE("sim engine: the same config and seed give the same report") {
  SimConfig c = small_config();
  c.cluster.failures = true;
  c.cost.failure.node_mtbf_s = 60;  // a few failures over the run
  for (ScheduleKind kind : {ScheduleKind::kLaminar, ScheduleKind::kBoundedStaleness, ScheduleKind::kSync}) {
    INFO(schedule_name(kind));
    SimReport a = run(c, kind), b = run(c, kind);
    CHECK(a.total == b.total);
    CHECK(a.events == b.events);
    CHECK(a.staleness_histogram == b.staleness_histogram);
    CHECK(a.preemptions == b.preemptions);
    CHECK(a.failures == b.failures);
    CHECK(a.repack_moves == b.repack_moves);
    CHECK(a.weight_updates == b.weight_updates);
    CHECK(a.generation_utilisation == b.generation_utilisation);
    REQUIRE(a.step_records.size() == b.step_records.size());
    for (std::size_t i = 0; i < a.step_records.size(); ++i) {
      CHECK(a.step_records[i].start == b.step_records[i].start);
      CHECK(a.step_records[i].end == b.step_records[i].end);
    }
    CHECK(a.failures > 0);
    // The seed draws the failures: another one gives another run.
    SimConfig reseeded = c;
    reseeded.seed = c.seed + 1;
    CHECK(run(reseeded, kind).total != a.total);
  }
}

TEST_CASE("sim engine: every schedule trains every sample exactly once") {
  const SimConfig c = small_config();
  const std::int64_t batch = c.workload.prompts_per_step * c.workload.samples_per_prompt;
  for (ScheduleKind kind : kAll) {
    INFO(schedule_name(kind));
    std::int64_t calls = 0;
    SimOptions o;
    o.on_step = [&](std::int64_t done, std::int64_t steps) {
      CHECK(done == ++calls);
      CHECK(steps == c.steps);
    };
    const SimReport r = run(c, kind, o);
    CHECK(calls == c.steps);
    CHECK(r.samples_trained == c.steps * batch);
    std::int64_t histogram = 0;
    for (std::int64_t n : r.staleness_histogram) histogram += n;
    CHECK(histogram == r.samples_trained);
    CHECK(r.tokens_trained > r.samples_trained);
    CHECK(r.schedule == schedule_name(kind));
    CHECK(r.total == r.step_records.back().end);
    for (std::size_t i = 0; i < r.step_records.size(); ++i) {
      CHECK(r.step_records[i].start < r.step_records[i].end);
      if (i > 0) CHECK(r.step_records[i - 1].end <= r.step_records[i].start);
    }
    CHECK(r.generation_utilisation > 0);
    CHECK(r.generation_utilisation <= 1);
    CHECK(r.trace.empty());
    // Mixed trajectories keep their oldest version however long they run: the admission rule
    // bounds when a prompt starts, not how many versions it spans.
    if (spec_of(kind).max_ahead_steps && r.mixed_version_trajectories == 0) {
      CHECK(r.max_staleness <= *spec_of(kind).max_ahead_steps);
    }
    if (kind == ScheduleKind::kSync) CHECK(r.max_staleness == 0);
    if (kind == ScheduleKind::kBoundedStaleness || kind == ScheduleKind::kPartialRollout) {
      CHECK(r.mixed_version_trajectories > 0);
    } else {
      CHECK(r.mixed_version_trajectories == 0);
    }
  }
}

// Long enough that trained steps' tables are freed while instances still hold their samples' state.
TEST_CASE("sim engine: Laminar under an admission bound trains every sample once") {
  SimConfig c = small_config();
  c.steps = 16;
  for (std::int64_t bound : {1, 2}) {
    INFO("max_ahead_steps " << bound);
    ScheduleSpec spec = spec_of(ScheduleKind::kLaminar);
    spec.max_ahead_steps = bound;
    Result<SimReport> r = simulate(c, spec);
    REQUIRE(r.ok());
    CHECK(r->samples_trained == c.steps * c.workload.prompts_per_step * c.workload.samples_per_prompt);
    CHECK(r->spec.max_ahead_steps == bound);
  }
}

double mean_staleness(const SimReport& r) {
  double sum = 0, n = 0;
  for (std::size_t k = 0; k < r.staleness_histogram.size(); ++k) {
    sum += static_cast<double>(k) * static_cast<double>(r.staleness_histogram[k]);
    n += static_cast<double>(r.staleness_histogram[k]);
  }
  return sum / n;
}

TEST_CASE("sim engine: an admission bound holds Laminar's staleness to what it holds AReaL's") {
  // The bound is on the weights a prompt starts on: Laminar's rollouts start fresh prompts on
  // their relay's version, which trails the trainer's publish by the relay chain.
  SimConfig c = small_config();
  c.steps = 10;
  for (std::int64_t bound : {1, 2}) {
    ScheduleSpec laminar = spec_of(ScheduleKind::kLaminar), areal = spec_of(ScheduleKind::kBoundedStaleness);
    laminar.max_ahead_steps = areal.max_ahead_steps = bound;
    Result<SimReport> l = simulate(c, laminar), a = simulate(c, areal);
    REQUIRE(l.ok());
    REQUIRE(a.ok());
    INFO("max_ahead_steps " << bound << ": laminar " << mean_staleness(*l) << ", bounded-staleness "
                            << mean_staleness(*a));
    CHECK(mean_staleness(*l) <= mean_staleness(*a) + 0.25);
    CHECK(mean_staleness(*l) <= static_cast<double>(bound) + 0.25);
  }
}

TEST_CASE("sim engine: Laminar repacks draining instances and records a trace when asked") {
  // By default the policy empties instances only while prompts wait for one; here every prompt
  // finds a slot at once, so nothing moves. With room for 8 sequences an instance, prompts wait.
  ScheduleSpec spec = spec_of(ScheduleKind::kLaminar);
  SimConfig c = small_config();
  Result<SimReport> roomy = simulate(c, spec);
  REQUIRE(roomy.ok());
  CHECK(roomy->repack_plans > 0);
  CHECK(roomy->repack_moves == 0);
  c.cluster.max_batch = 8;
  Result<SimReport> tight = simulate(c, spec);
  REQUIRE(tight.ok());
  CHECK(tight->repack_moves > 0);
  // Without that rule, the roomy cluster repacks too.
  spec.repack_options.only_for_waiting_prompts = false;
  SimOptions o;
  o.trace = true;
  Result<SimReport> made = simulate(small_config(), spec, o);
  REQUIRE(made.ok());
  const SimReport& r = *made;
  CHECK(r.repack_plans > 0);
  CHECK(r.repack_moves > 0);
  CHECK(r.repack_bytes > 0);
  CHECK(r.weight_updates > 0);
  REQUIRE_FALSE(r.trace.empty());
  bool pulled = false;
  for (const TraceSpan& s : r.trace) {
    CHECK(s.start < s.end);
    pulled = pulled || s.kind == TraceSpan::Kind::kPull;
  }
  CHECK(pulled);
}

// Laminar's edge over one-step staleness is the long tail: with every response the same length
// there is no straggler for one-step to wait on. Each step's samples fill every rollout slot, so
// both schedules decode full batches and only the tail tells them apart.
TEST_CASE("sim engine: Laminar's speed-up over one-step comes from the long tail") {
  SimConfig tail = small_config();
  tail.cluster.gpus = 16;
  tail.cluster.trainer_gpus = 8;
  tail.cluster.max_batch = 32;
  tail.workload.prompts_per_step = 32;  // 256 samples: 8 instances x 32 slots
  SimConfig flat = tail;
  flat.workload.response_length = {*Distribution::constant(1000), 4096};
  const double tail_ratio = run(tail, ScheduleKind::kLaminar).samples_per_s / run(tail, ScheduleKind::kOneStep).samples_per_s;
  const double flat_ratio = run(flat, ScheduleKind::kLaminar).samples_per_s / run(flat, ScheduleKind::kOneStep).samples_per_s;
  INFO("long tail " << tail_ratio << ", constant " << flat_ratio);
  // Measured: 1.34 and 1.00.
  CHECK(tail_ratio > 1.2);
  CHECK(flat_ratio < 1.1);
}

TEST_CASE("sim engine: tool calls pause samples and a full KV cache preempts, each trained once") {
  SimConfig c = small_config();
  c.workload.tool_calls.call_probability = 0.5;
  c.workload.tool_calls.max_calls = 3;
  c.workload.tool_calls.env_latency_s = *Distribution::log_normal(2, 0.5);
  c.workload.tool_calls.observation_tokens = *Distribution::constant(200);
  const SimReport quick = run(c, ScheduleKind::kSync);
  c.workload.tool_calls.env_latency_s = *Distribution::log_normal(20, 0.5);
  const SimReport slow = run(c, ScheduleKind::kSync);
  CHECK(slow.total > quick.total);  // the environment's latency is on the critical path
  CHECK(quick.preemptions == 0);

  // About 65k tokens of KV per instance: 64 samples of ~1k tokens and growing do not fit.
  c.cost.rollout.memory_utilization = 0.26;
  c.cluster.gpus = 8;
  c.cluster.trainer_gpus = 2;
  c.workload.prompts_per_step = 64;
  for (ScheduleKind kind : kAll) {
    INFO(schedule_name(kind));
    const SimReport r = run(c, kind);
    CHECK(r.preemptions > 0);
    CHECK(r.samples_trained == c.steps * c.workload.prompts_per_step * c.workload.samples_per_prompt);
  }
}

TEST_CASE("sim engine: a virtual-time run never reads the wall clock") {
  const SimConfig c = small_config();
  // The counter sees a read on this thread, so a zero below is not the interposer missing.
  counting = true;
  (void)std::chrono::steady_clock::now();
  counting = false;
  REQUIRE(wall_clock_reads.load() > 0);
  for (ScheduleKind kind : kAll) {
    INFO(schedule_name(kind));
    wall_clock_reads = 0;
    counting = true;
    Result<SimReport> r = simulate(c, spec_of(kind));
    counting = false;
    REQUIRE(r.ok());
    CHECK(wall_clock_reads.load() == 0);
  }
}

TEST_CASE("sim engine: a cluster too small or a bad config is refused, naming it") {
  SimConfig c = small_config();
  c.cluster.gpus = 0;
  Result<SimReport> r = simulate(c, spec_of(ScheduleKind::kLaminar));
  REQUIRE(r.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(r.status().message(), Catch::Contains("cluster.gpus"));

  c = small_config();
  c.cluster.gpus = 1;  // a quarter of one GPU is no trainer
  r = simulate(c, spec_of(ScheduleKind::kOneStep));
  REQUIRE(r.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(r.status().message(), Catch::Contains("cluster.gpus"));

  c = small_config();
  c.cost.rollout.tensor_parallel = 4;
  c.cluster.gpus = 8;
  c.cluster.trainer_gpus = 5;  // three left: less than one instance of four
  r = simulate(c, spec_of(ScheduleKind::kLaminar));
  REQUIRE(r.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(r.status().message(), Catch::Contains("tensor_parallel"));

  c = small_config();
  c.cluster.max_batch = 0;
  r = simulate(c, spec_of(ScheduleKind::kSync));
  REQUIRE(r.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(r.status().message(), Catch::Contains("cluster.max_batch"));
}

// Every instance is fresh at step 0, so a step's samples first spread over all of them; later steps
// are released while few instances have drained and pulled. The cap is the step's samples over the
// instances, rounded up, times the share, rounded up.
TEST_CASE("sim engine: Laminar's step share caps one step's samples on an instance, each trained once") {
  SimConfig c = small_config();
  c.steps = 10;
  const std::int64_t batch = c.workload.prompts_per_step * c.workload.samples_per_prompt;
  const std::int64_t instances = c.cluster.gpus - c.cluster.trainer_gpus;  // TP 1
  const std::int64_t fair = (batch + instances - 1) / instances;
  for (std::optional<std::int64_t> bound : {std::optional<std::int64_t>(1), std::optional<std::int64_t>(2),
                                             std::optional<std::int64_t>()}) {
    ScheduleSpec spec = spec_of(ScheduleKind::kLaminar);
    spec.max_ahead_steps = bound;
    const Result<SimReport> uncapped = simulate(c, spec);
    REQUIRE(uncapped.ok());
    INFO("max_ahead_steps " << (bound ? std::to_string(*bound) : "unbounded") << ", uncapped: "
                            << uncapped->max_step_samples_per_instance << " of a step on one instance");
    // Under a bound, without a cap some instance takes more than its fair share, so the checks below
    // can fail. (Unbounded, each step is released while every instance still admits.)
    if (bound) CHECK(uncapped->max_step_samples_per_instance > fair);
    for (double share : {1.0, 1.5, 2.0}) {
      INFO("max_step_share " << share);
      spec.max_step_share = share;
      const Result<SimReport> r = simulate(c, spec);
      REQUIRE(r.ok());
      const auto cap = static_cast<std::int64_t>(std::ceil(share * static_cast<double>(fair)));
      CHECK(r->max_step_samples_per_instance <= cap);
      CHECK(r->max_step_samples_per_instance > 0);
      CHECK(r->samples_trained == c.steps * batch);
      CHECK(r->spec.max_step_share == share);
      CHECK(r->to_json()["spec"]["max_step_share"] == share);
      CHECK(r->to_json()["max_step_samples_per_instance"] == r->max_step_samples_per_instance);
      // The bound holds when a prompt starts; the trainer takes groups as they complete, so a capped
      // step's last groups may train a step late.
      if (bound) CHECK(mean_staleness(*r) <= static_cast<double>(*bound) + 0.25);
    }
  }
}

TEST_CASE("sim engine: with a step share, failures and repacking still train every sample once") {
  SimConfig c = small_config();
  c.cluster.failures = true;
  c.cost.failure.node_mtbf_s = 30;
  c.cluster.max_batch = 8;  // prompts wait, so repacking moves sequences
  ScheduleSpec spec = spec_of(ScheduleKind::kLaminar);
  spec.max_step_share = 1;
  const Result<SimReport> r = simulate(c, spec);
  REQUIRE(r.ok());
  CHECK(r->failures > 0);
  CHECK(r->repack_moves > 0);
  CHECK(r->samples_trained == c.steps * c.workload.prompts_per_step * c.workload.samples_per_prompt);
  CHECK(r->max_step_samples_per_instance <= 6);  // 128 samples over 24 instances, rounded up
}

TEST_CASE("sim engine: the step share is Laminar's, defaults to kDefaultStepShare and must be >= 1") {
  for (ScheduleKind kind : kAll) {
    INFO(schedule_name(kind));
    const ScheduleSpec d = ScheduleSpec::defaults(kind);
    if (kind == ScheduleKind::kLaminar) {
      CHECK(d.max_step_share == ScheduleSpec::kDefaultStepShare);
      CHECK(d.to_json()["max_step_share"] == ScheduleSpec::kDefaultStepShare);
    } else {
      CHECK(!d.max_step_share.has_value());
      CHECK(d.to_json()["max_step_share"].is_null());
      ScheduleSpec set = d;
      set.max_step_share = 1;
      const Status st = set.validate();
      REQUIRE(st.code() == StatusCode::kInvalidArgument);
      CHECK_THAT(st.message(), Catch::Contains("max_step_share") && Catch::Contains("laminar only"));
      CHECK(simulate(small_config(), set).status().code() == StatusCode::kInvalidArgument);
    }
  }
  for (double bad : {0.999, 0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    INFO("max_step_share " << bad);
    ScheduleSpec spec = ScheduleSpec::defaults(ScheduleKind::kLaminar);
    spec.max_step_share = bad;
    const Result<SimReport> r = simulate(small_config(), spec);
    REQUIRE(r.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(r.status().message(), Catch::Contains("max_step_share: must be >= 1"));
  }
}

TEST_CASE("sim engine: node failures restart their samples and the run still trains each once") {
  SimConfig c = small_config();
  c.cluster.failures = true;
  c.cost.failure.node_mtbf_s = 30;
  for (ScheduleKind kind : kAll) {
    INFO(schedule_name(kind));
    const SimReport r = run(c, kind);
    CHECK(r.failures > 0);
    CHECK(r.samples_trained == c.steps * c.workload.prompts_per_step * c.workload.samples_per_prompt);
  }
}

}  // namespace
}  // namespace laminar::sim
