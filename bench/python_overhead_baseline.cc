// python_overhead_baseline.cc: the C++ side of python_overhead_bench.py, which runs it in the same
// run and times the same two operations through the Python bindings:
//   queue: push of a copy of one realistic trajectory (the binding's push copies too), pop_batch of
//          one, ack; per round;
//   pull:  WeightPuller::pull of one f32 tensor of --pull-mib MiB from a RelayStore in this process
//          into host memory.
// Prints one JSON object: {"queue_round_s": median seconds per round, "response_tokens": the
// trajectory's, "pull_s": median seconds per pull, "pull_bytes": n}; exits 3 when a timing's repeats
// disagree too much to compare against (harness.h).
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cli.h"
#include "harness.h"
#include "laminar/relay_store.h"
#include "laminar/trajectory_queue.h"
#include "laminar/weight_puller.h"
#include "realistic_trajectory.h"

namespace {

void check(const laminar::Status& st, const char* what) {
  if (!st.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, st.to_string().c_str());
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The C++ side of python_overhead_bench.py: a queue round and a weight pull"};
  app.option_defaults()->always_capture_default();
  int rounds = 1000;
  std::int64_t pull_mib = 256;
  app.add_option("--rounds", rounds, "queue rounds timed")->check(laminar::bench::positive());
  app.add_option("--pull-mib", pull_mib, "MiB of the pulled f32 tensor")->check(laminar::bench::positive());
  CLI11_PARSE(app, argc, argv);

  auto queue = laminar::TrajectoryQueue::create().value();
  std::mt19937 rng(7);
  laminar::Trajectory t;
  laminar::bench::fill_realistic(t, rng);
  laminar::BatchSpec spec;
  spec.max_trajectories = 1;
  std::uint64_t id = 0;
  laminar::bench::Timing queue_t = laminar::bench::measure([&] {
    for (int r = 0; r < rounds; ++r) {
      laminar::Trajectory copy = t;
      copy.id = laminar::TrajectoryId(++id);
      check(queue->push(std::move(copy)), "push");
      laminar::Result<laminar::Batch> b = queue->pop_batch(spec);
      check(b.status(), "pop_batch");
      check(queue->ack(b->id()), "ack");
    }
  });

  const std::int64_t n = pull_mib * (std::int64_t(1) << 20) / 4;
  std::vector<float> src(static_cast<std::size_t>(n), 1.5f), dst(static_cast<std::size_t>(n));
  std::shared_ptr<laminar::RelayStore> relay = laminar::RelayStore::create().value();
  laminar::WeightManifest manifest;
  check(manifest.add("w", laminar::DType::kF32, {n}), "manifest");
  std::int64_t shape[] = {n};
  laminar::NamedTensor in{"w", laminar::TensorView::contiguous(src.data(), laminar::DType::kF32, shape).value()};
  check(relay->publish(laminar::Version(1), manifest, {&in, 1}), "publish");
  check(relay->wait_for_version(laminar::Version(1), std::chrono::seconds(60)), "wait_for_version");
  auto puller = laminar::WeightPuller::create(relay).value();
  laminar::NamedTensor out{"w", laminar::TensorView::contiguous(dst.data(), laminar::DType::kF32, shape).value()};
  laminar::bench::Timing pull_t =
      laminar::bench::measure([&] { check(puller->pull(laminar::Version(1), {&out, 1}, false), "pull"); });

  laminar::bench::require_stable_baseline("cpp_queue_round", queue_t);
  laminar::bench::require_stable_baseline("cpp_pull", pull_t);
  std::printf("{\"queue_round_s\": %.9g, \"response_tokens\": %zu, \"pull_s\": %.9g, \"pull_bytes\": %lld}\n",
              queue_t.median_s / rounds, t.response_tokens.size(), pull_t.median_s, static_cast<long long>(n) * 4);
  return 0;
}
