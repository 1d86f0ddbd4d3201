// The cluster simulator (examples/simulator) over its whole schedule sweep: SimConfig::paper_math()
// (1,024 GPUs x 100 training steps of 512 prompts x 16 samples) under every schedule's defaults,
// each simulate() call timed with the wall clock. The headline is the sweep's events per second
// (SimReport::events summed over the schedules, over the summed seconds).
//
// The baseline, measured in the same run, is a bare event loop doing nothing but the heap work
// every discrete-event simulator does: the classic "hold" model of priority-queue benchmarks. A
// std::priority_queue (binary heap) starts with one event per GPU of the config at uniformly random
// virtual times in [0, 1 s); each step pops the earliest event and pushes one follow-up at the
// popped time plus a uniformly random delay in [0, 1 s), so the heap keeps that many pending events,
// until as many events have been popped as the sweep processed. What the simulator spends above
// that is its model: segments, the cost model, the TrajectoryQueue, the schedules.
//
// A third measurement shows the part of that the real TrajectoryQueue takes: one run's trajectories
// pushed and popped as the engine does (each group whole with push_many, one pop_batch and ack per
// step), with nothing simulated; the sweep's ratio cannot beat what the queue alone leaves.
//
//   simulator_bench [--steps N] [--gpus N] [--schedule NAME]
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <queue>
#include <random>
#include <string>
#include <vector>

#include "cli.h"
#include "harness.h"
#include "laminar/clock.h"
#include "laminar/trajectory_queue.h"
#include "simulator.h"

namespace {

using laminar::sim::ScheduleKind;
using laminar::sim::ScheduleSpec;
using laminar::sim::SimConfig;
using laminar::sim::SimReport;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "simulator_bench: %s\n", what.c_str());
  std::exit(1);
}

struct Row {
  std::string schedule;
  double seconds = 0;
  std::int64_t events = 0;
  double samples_per_s = 0;  // simulated: samples trained per virtual second
};

struct Event {
  std::int64_t time_ns = 0;
  std::int64_t id = 0;
  bool operator>(const Event& o) const { return time_ns > o.time_ns; }
};

// The hold model above: `events` pops from a heap holding `pending` events. Returns a checksum of
// the popped times (unsigned, so it wraps) so the loop cannot be optimised away.
std::uint64_t bare_heap(std::int64_t pending, std::int64_t events, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::int64_t> delay(0, 999'999'999);
  std::vector<Event> storage;
  storage.reserve(static_cast<std::size_t>(pending));
  std::priority_queue<Event, std::vector<Event>, std::greater<>> heap(std::greater<>{}, std::move(storage));
  for (std::int64_t i = 0; i < pending; ++i) heap.push({delay(rng), i});
  std::uint64_t checksum = 0;
  for (std::int64_t n = 0; n < events; ++n) {
    const Event e = heap.top();
    heap.pop();
    checksum += static_cast<std::uint64_t>(e.time_ns ^ e.id);
    heap.push({e.time_ns + delay(rng), e.id});
  }
  return checksum;
}

// The queue's work in one simulate() run of `c`: steps x prompts groups of samples_per_prompt
// trajectories, carrying what the engine's do, each group pushed with push_many, then one batch of
// the step's trajectories popped and acked. Returns the trajectories moved.
std::int64_t queue_alone(const SimConfig& c) {
  const std::int64_t prompts = c.workload.prompts_per_step, n = c.workload.samples_per_prompt;
  laminar::TrajectoryQueueOptions q;
  q.clock = std::make_shared<laminar::ManualClock>();
  q.validate_contents = false;
  q.capacity_trajectories = static_cast<std::size_t>(c.steps * prompts * n + 1);
  q.default_lease = laminar::kForever;
  laminar::Result<std::unique_ptr<laminar::TrajectoryQueue>> made = laminar::TrajectoryQueue::create(q);
  if (!made.ok()) fail("queue: " + made.status().to_string());
  laminar::TrajectoryQueue& queue = **made;
  std::vector<laminar::Trajectory> group;
  for (std::int64_t step = 0; step < c.steps; ++step) {
    for (std::int64_t g = 0; g < prompts; ++g) {
      group.clear();
      for (std::int64_t i = 0; i < n; ++i) {
        laminar::Trajectory& t = group.emplace_back();
        t.id = laminar::TrajectoryId(static_cast<std::uint64_t>((step * prompts + g) * n + i) + 1);
        t.prompt_id = laminar::PromptId(static_cast<std::uint64_t>(step * prompts + g));
        t.group_id = laminar::GroupId(t.prompt_id.value() + 1);
        t.group_size = static_cast<std::uint32_t>(n);
        t.sample_index = static_cast<std::uint32_t>(i);
        t.version = laminar::Version(static_cast<std::uint64_t>(step));
        t.rewards = {0.0f};
      }
      for (const laminar::Status& st : queue.push_many(group, laminar::PushOptions::fail_fast())) {
        if (!st.ok()) fail("queue: push_many: " + st.to_string());
      }
    }
    laminar::BatchSpec b;
    b.max_trajectories = b.min_trajectories = static_cast<std::size_t>(prompts * n);
    b.consumer_version = laminar::Version(static_cast<std::uint64_t>(step));
    b.lease = laminar::kForever;
    laminar::Result<laminar::Batch> batch = queue.pop_batch(b);
    if (!batch.ok()) fail("queue: pop_batch: " + batch.status().to_string());
    if (laminar::Status st = queue.ack(batch->id()); !st.ok()) fail("queue: ack: " + st.to_string());
    if (laminar::Status st = queue.publish_version(laminar::Version(static_cast<std::uint64_t>(step + 1))); !st.ok()) {
      fail("queue: publish_version: " + st.to_string());
    }
  }
  return c.steps * prompts * n;
}

}  // namespace

int main(int argc, char** argv) {
  SimConfig config = SimConfig::paper_math();
  std::vector<ScheduleKind> kinds = {ScheduleKind::kSync,           ScheduleKind::kOneStep,
                                     ScheduleKind::kStreamGlobal,   ScheduleKind::kBoundedStaleness,
                                     ScheduleKind::kPartialRollout, ScheduleKind::kLaminar};
  CLI::App app{"The cluster simulator's schedule sweep against a bare event heap"};
  app.option_defaults()->always_capture_default();
  std::string schedule;
  app.add_option("--steps", config.steps, "training steps simulated")->check(laminar::bench::positive());
  app.add_option("--gpus", config.cluster.gpus, "GPUs in the cluster")->check(laminar::bench::positive());
  app.add_option("--schedule", schedule, "one schedule instead of the sweep over all")
      ->check([](const std::string& name) {
        laminar::Result<ScheduleKind> k = laminar::sim::parse_schedule(name);
        return k.ok() ? std::string() : k.status().to_string();
      });
  CLI11_PARSE(app, argc, argv);
  if (!schedule.empty()) kinds = {*laminar::sim::parse_schedule(schedule)};
  if (laminar::Status st = config.validate(); !st.ok()) fail(st.to_string());

  std::vector<Row> rows;
  double sweep_s = 0;
  std::int64_t sweep_events = 0;
  for (ScheduleKind kind : kinds) {
    const auto start = std::chrono::steady_clock::now();
    laminar::Result<SimReport> r = laminar::sim::simulate(config, ScheduleSpec::defaults(kind));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!r.ok()) fail(std::string(laminar::sim::schedule_name(kind)) + ": " + r.status().to_string());
    rows.push_back({r->schedule, s, r->events, r->samples_per_s});
    sweep_s += s;
    sweep_events += r->events;
  }
  if (sweep_events < 1 || sweep_s <= 0) fail("the sweep processed no events");

  std::uint64_t checksum = 0;
  const laminar::bench::Timing bare = laminar::bench::measure(
      [&] { checksum += bare_heap(config.cluster.gpus, sweep_events, 1); }, {.warmup = 1, .repeats = 5});
  laminar::bench::require_stable_baseline("bare_heap", bare);

  std::int64_t queued = 0;
  const laminar::bench::Timing queue_run = laminar::bench::measure([&] { queued = queue_alone(config); },
                                                                   {.warmup = 1, .repeats = 3});
  const double queue_ns = queue_run.median_s * 1e9 / static_cast<double>(queued);
  const double sweep_trajectories = static_cast<double>(queued) * static_cast<double>(kinds.size());

  std::printf("simulator_bench: %" PRId64 " GPUs x %" PRId64 " steps, %" PRId64 " prompts x %" PRId64
              " samples a step\n",
              config.cluster.gpus, config.steps, config.workload.prompts_per_step,
              config.workload.samples_per_prompt);
  std::printf("%-34s %10s %14s %14s %22s\n", "schedule", "seconds", "events", "events/s", "samples/s simulated");
  for (const Row& row : rows) {
    std::printf("%-34s %10.3f %14" PRId64 " %14.4g %22.1f\n", row.schedule.c_str(), row.seconds, row.events,
                static_cast<double>(row.events) / row.seconds, row.samples_per_s);
  }
  const double sim_rate = static_cast<double>(sweep_events) / sweep_s;
  const double bare_rate = static_cast<double>(sweep_events) / bare.median_s;
  std::printf("%-34s %10.3f %14" PRId64 " %14.4g\n", "total sweep", sweep_s, sweep_events, sim_rate);
  std::printf("%-34s %10.3f %14" PRId64 " %14.4g   (median of %d; checksum %" PRIu64 ")\n",
              ("bare heap, " + std::to_string(config.cluster.gpus) + " pending").c_str(), bare.median_s,
              sweep_events, bare_rate, bare.repeats, checksum);
  // What the queue alone leaves: the bare loop's time per event over that plus the queue's share.
  const double bare_ns = 1e9 / bare_rate;
  const double queue_ns_per_event = queue_ns * sweep_trajectories / static_cast<double>(sweep_events);
  std::printf("TrajectoryQueue alone, the sweep's pushes and pops: %.0f ns per trajectory, %.0f ns per sweep event "
              "against the bare heap's %.0f: ratio at most %.2f with nothing simulated (median of %d)\n",
              queue_ns, queue_ns_per_event, bare_ns, bare_ns / (bare_ns + queue_ns_per_event), queue_run.repeats);
  laminar::bench::report_throughput("simulator_bench", "events_per_s", sim_rate, "bare_heap", bare_rate);
  return 0;
}
