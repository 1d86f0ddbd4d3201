// core_loop: the asynchronous RL loop on laminar's parts, in one process.
//
// The actor publishes each policy version to a RelayStore and trains on whole GRPO groups popped
// from a TrajectoryQueue. A rollout thread pulls the newest version whenever it has nothing in
// flight, samples with laminar's sampling kernel, and pushes each trajectory tagged with the
// version that generated it. Neither side waits for the other's step. The policy is one logit per
// token and the reward is the share of sampled tokens equal to kTarget, so the mean reward climbs
// as the policy learns. Exits 0 when it learned (final mean reward above --goal).
//
// The lines between "README snippet begin" and "README snippet end" are the README's core loop,
// word for word (the readme_core_loop_snippet test compares them).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

#include "laminar/laminar.h"

namespace {

using namespace laminar;
using namespace std::chrono_literals;

constexpr std::int64_t kVocab = 16;
constexpr std::int64_t kLen = 8;          // response tokens per trajectory
constexpr std::uint32_t kGroup = 4;       // samples per prompt (GRPO group)
constexpr std::int32_t kTarget = 7;
constexpr std::int64_t kShape[] = {kVocab};  // the policy's one tensor

// One trajectory of kLen tokens sampled from `w` (the policy's logits), with their log-probs.
Result<Trajectory> generate(const std::vector<float>& w, Version v, std::uint64_t id, std::uint64_t group,
                            std::uint32_t sample) {
  std::vector<float> logits;  // [kLen, kVocab]: every position sees the same logits
  for (std::int64_t i = 0; i < kLen; ++i) logits.insert(logits.end(), w.begin(), w.end());
  std::vector<std::uint64_t> seed(kLen, id);
  std::vector<std::int64_t> position(kLen);
  std::iota(position.begin(), position.end(), 0);
  Trajectory t;
  t.response_tokens.resize(kLen);
  t.logprobs.resize(kLen);
  kernels::SamplingParams p;
  p.logits = logits.data();
  p.batch = kLen;
  p.vocab = kVocab;
  p.seed = seed.data();
  p.position = position.data();
  p.token = t.response_tokens.data();
  p.raw_logprob = t.logprobs.data();
  p.cpu_threads = 1;
  if (Status st = kernels::run(p, Stream::host()); !st.ok()) return st;
  t.id = TrajectoryId(id);
  t.prompt_id = PromptId(group);
  t.group_id = GroupId(group);
  t.group_size = kGroup;
  t.sample_index = sample;
  t.version = v;
  t.prompt_tokens = {0};
  const auto hits = std::count(t.response_tokens.begin(), t.response_tokens.end(), kTarget);
  t.rewards = {float(hits) / float(kLen)};
  return t;
}

// Policy gradient with the group's mean reward as baseline: w += lr * advantage * d log p / d w.
void train(std::vector<float>& w, const Batch& batch, float lr) {
  std::vector<float> prob(w.size());
  const float top = *std::max_element(w.begin(), w.end());
  float z = 0;
  for (std::size_t i = 0; i < w.size(); ++i) z += prob[i] = std::exp(w[i] - top);
  for (float& p : prob) p /= z;
  std::vector<float> grad(w.size(), 0.0f);
  const auto ts = batch.trajectories();
  for (std::size_t g = 0; g < ts.size(); g += kGroup) {
    float mean = 0;
    for (std::size_t i = g; i < g + kGroup; ++i) mean += ts[i].rewards[0] / kGroup;
    for (std::size_t i = g; i < g + kGroup; ++i)
      for (std::int32_t tok : ts[i].response_tokens)
        for (std::size_t k = 0; k < w.size(); ++k)
          grad[k] += (ts[i].rewards[0] - mean) * ((std::int32_t(k) == tok ? 1.0f : 0.0f) - prob[k]);
  }
  for (std::size_t k = 0; k < w.size(); ++k) w[k] += lr * grad[k] / float(ts.size());
}

int fail(const char* what, const Status& st) {
  std::fprintf(stderr, "core_loop: %s: %s\n", what, st.to_string().c_str());
  return 1;
}

// Prints one step's mean reward and its oldest trajectory's staleness; returns the mean reward.
float report(int step, const Batch& batch) {
  float reward = 0;
  std::uint64_t stalest = 0;
  for (std::size_t i = 0; i < batch.size(); ++i) {
    reward += batch.trajectories()[i].rewards[0] / float(batch.size());
    stalest = std::max(stalest, batch.info()[i].staleness);
  }
  std::printf("step %2d: mean reward %.3f, oldest trajectory %llu versions behind\n", step, reward,
              static_cast<unsigned long long>(stalest));
  return reward;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The asynchronous RL loop on laminar's parts, in one process"};
  int steps = 40;
  float lr = 2.0f, goal = 0.5f;
  app.add_option("--steps", steps, "actor updates")->check(CLI::PositiveNumber);
  app.add_option("--lr", lr, "learning rate")->check(CLI::PositiveNumber);
  app.add_option("--goal", goal, "final mean reward that counts as learned")->check(CLI::Range(0.0, 1.0));
  CLI11_PARSE(app, argc, argv);

  WeightManifest manifest;
  if (Status st = manifest.add("logits", DType::kF32, {kVocab}); !st.ok()) return fail("manifest", st);
  TrajectoryQueueOptions qo;
  qo.capacity_trajectories = 8 * kGroup;  // backpressure: rollouts run at most a few batches ahead
  qo.group_timeout = 30s;
  std::vector<float> actor_w(kVocab, 0.0f);
  // README snippet begin
  std::shared_ptr<RelayStore> relay = RelayStore::create().value();
  std::shared_ptr<TrajectoryQueue> queue = TrajectoryQueue::create(qo).value();
  auto publish = [&](Version v) {             // the actor's weights, as a DLPack-style view
    NamedTensor t{"logits", TensorView::contiguous(actor_w.data(), DType::kF32, kShape).value()};
    Status st = queue->publish_version(v);    // first, so the queue accepts what v generates
    return st.ok() ? relay->publish(v, manifest, {&t, 1}) : st;
  };
  // README snippet end
  if (Status st = publish(Version(1)); !st.ok()) return fail("publish", st);
  if (Status st = relay->wait_for_version(Version(1), 30s); !st.ok()) return fail("seal", st);

  // README snippet begin
  std::thread rollout([&] {                   // a rollout worker: pull when idle, generate, push
    auto puller = WeightPuller::create(relay).value();
    std::vector<float> w(kVocab);
    NamedTensor dst{"logits", TensorView::contiguous(w.data(), DType::kF32, kShape).value()};
    for (std::uint64_t group = 0;; ++group) {
      PullDecision d = puller->next_action(/*has_live_trajectory=*/false);
      if (d.action == PullAction::kPull && !puller->pull(d.version, {&dst, 1}, false).ok()) return;
      for (std::uint32_t s = 0; s < kGroup; ++s) {
        Result<Trajectory> t = generate(w, *puller->current_version(), group * kGroup + s, group, s);
        if (!t.ok() || !queue->push(std::move(*t)).ok()) return;  // close() ends the loop
      }
    }
  });
  // README snippet end

  float reward = 0;
  // README snippet begin
  for (int step = 1; step <= steps; ++step) {  // the actor: pop whole groups, train, ack, publish
    Result<Batch> batch = queue->pop_batch({.max_trajectories = 4 * kGroup, .min_trajectories = 4 * kGroup,
                                            .wait = 30s, .consumer_version = Version(std::uint64_t(step)),
                                            .staleness_rule = StalenessRule::kDrop, .max_staleness = 2});
    if (!batch.ok()) return fail("pop_batch", batch.status());
    train(actor_w, *batch, lr);
    if (Status st = queue->ack(batch->id()); !st.ok()) return fail("ack", st);
    if (Status st = publish(Version(std::uint64_t(step) + 1)); !st.ok()) return fail("publish", st);
    reward = report(step, *batch);
  }
  // README snippet end
  queue->close();
  rollout.join();
  std::printf("queue: %s\n", queue->stats().to_json().c_str());
  return reward > goal ? 0 : 1;
}
