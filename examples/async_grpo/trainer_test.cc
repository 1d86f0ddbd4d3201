// The async GRPO example's libtorch trainer (examples/async_grpo/trainer.h): its weights against
// the manifest, the GRPO objective's pieces, the warm-up, and a short run that learns.
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <unistd.h>
#include <vector>

#include "policy_config.h"
#include "task.h"
#include "trainer.h"

using async_grpo::DigitTask;
using async_grpo::Trainer;
using async_grpo::TrainerOptions;

namespace {

std::unique_ptr<Trainer> make_trainer(std::uint64_t seed, TrainerOptions o = {}) {
  o.seed = seed;
  auto trainer = Trainer::create(o);
  REQUIRE(trainer.ok());
  return std::move(*trainer);
}

std::vector<std::byte> saved(const Trainer& t) {
  std::vector<std::byte> flat(t.manifest().total_bytes());
  REQUIRE(t.save_weights(flat).ok());
  return flat;
}

laminar::Trajectory trajectory(std::uint64_t group, float reward) {
  laminar::Trajectory t;
  t.group_id = laminar::GroupId(group);
  t.prompt_tokens = {async_grpo::kBos, async_grpo::kOpSort, 3, 1, async_grpo::kSep};
  t.response_tokens = {1, 3, async_grpo::kEos};
  t.logprobs = {-1.0f, -1.0f, -1.0f};
  t.rewards = {reward};
  return t;
}

// A task of short lists, so the learning checks below run in seconds.
DigitTask short_task(std::uint64_t seed) {
  async_grpo::DigitTaskOptions o;
  o.op = async_grpo::DigitOp::kSort;
  o.median_length = 3;
  o.length_sigma = 0.5;
  o.max_length = 8;
  auto task = DigitTask::create(o, seed);
  REQUIRE(task.ok());
  return *task;
}

std::vector<async_grpo::DigitPrompt> prompts(const DigitTask& task, std::uint64_t first, int n) {
  std::vector<async_grpo::DigitPrompt> out;
  for (int i = 0; i < n; ++i) out.push_back(task.prompt(first + std::uint64_t(i)));
  return out;
}

double mean_reward(std::span<const laminar::Trajectory> batch) {
  double sum = 0;
  for (const auto& t : batch) sum += t.rewards.front();
  return sum / double(batch.size());
}

}  // namespace

TEST_CASE("grpo trainer: weights follow the manifest and round-trip through the flat buffer") {
  const async_grpo::PolicyConfig config;
  const auto manifest = async_grpo::weight_manifest(config);
  REQUIRE(manifest.ok());
  auto a = make_trainer(1);
  CHECK(a->manifest() == *manifest);

  auto views = a->weights();
  REQUIRE(views.ok());
  REQUIRE(views->size() == manifest->size());
  for (std::size_t i = 0; i < views->size(); ++i) {
    const auto& e = manifest->entries()[i];
    const auto& v = (*views)[i];
    INFO(e.name);
    CHECK(v.name == e.name);
    CHECK(v.view.dtype() == laminar::DType::kF32);
    CHECK(v.view.is_contiguous());
    CHECK(std::vector<std::int64_t>(v.view.shape().begin(), v.view.shape().end()) == e.shape);
    CHECK(manifest->check_view(e.name, v.view).ok());
  }

  // The views alias the parameters: the flat buffer holds exactly what they show.
  const auto flat = saved(*a);
  for (std::size_t i = 0; i < views->size(); ++i) {
    const auto& e = manifest->entries()[i];
    CHECK(std::memcmp(flat.data() + e.offset, (*views)[i].view.data(), e.nbytes) == 0);
  }

  // Same seed, same weights; another seed differs until it loads the buffer.
  CHECK(saved(*make_trainer(1)) == flat);
  auto b = make_trainer(2);
  CHECK(saved(*b) != flat);
  REQUIRE(b->load_weights(flat).ok());
  CHECK(saved(*b) == flat);
  const std::vector<laminar::Trajectory> batch = {trajectory(0, 1.0f)};
  CHECK(a->log_probs(batch).value() == b->log_probs(batch).value());

  // Malformed buffers are refused and change nothing.
  auto c = make_trainer(3);
  const auto before = saved(*c);
  CHECK(c->load_weights(std::span(flat).first(flat.size() - 4)).code() ==
        laminar::StatusCode::kInvalidArgument);
  auto poisoned = flat;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(poisoned.data() + manifest->find("lm_head").value()->offset, &nan, sizeof nan);
  const auto st = c->load_weights(poisoned);
  CHECK(st.code() == laminar::StatusCode::kInvalidArgument);
  CHECK_THAT(st.message(), Catch::Contains("lm_head"));
  CHECK(saved(*c) == before);
}

TEST_CASE("grpo trainer: advantages are normalised within each group") {
  // Group 7: rewards 1, 0, 0, 1 (mean 0.5, std 0.5); group 9: all equal; group 4: one sample.
  const std::vector<laminar::Trajectory> batch = {
      trajectory(7, 1.0f), trajectory(9, 0.3f), trajectory(7, 0.0f), trajectory(4, 1.0f),
      trajectory(7, 0.0f), trajectory(9, 0.3f), trajectory(7, 1.0f)};
  const float eps = 1e-4f;
  const auto adv = async_grpo::group_advantages(batch, eps);
  REQUIRE(adv.ok());
  const float unit = 0.5f / (0.5f + eps);
  const std::vector<float> want = {unit, 0.0f, -unit, 0.0f, -unit, 0.0f, unit};
  REQUIRE(adv->size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) CHECK((*adv)[i] == Approx(want[i]).margin(1e-6));

  auto no_reward = batch;
  no_reward[3].rewards.clear();
  const auto bad = async_grpo::group_advantages(no_reward, eps);
  CHECK(bad.status().code() == laminar::StatusCode::kInvalidArgument);
  CHECK_THAT(bad.status().message(), Catch::Contains("trajectory 3"));
}

TEST_CASE("grpo trainer: the clip zeroes the gradient beyond it in the advantage's direction") {
  TrainerOptions o;
  o.clip_low = 0.2f;
  o.clip_high = 0.28f;
  o.truncation = 2.0f;
  // Token: pi_theta / pi_prox, advantage, and whether the clip stops its gradient.
  struct Case {
    double ratio;
    float advantage;
    bool clipped;
  };
  const std::vector<Case> cases = {
      {1.5, 1.0f, true},    // above 1 + clip_high, pushed further up: stopped
      {1.2, 1.0f, false},   // inside the clip
      {0.5, 1.0f, false},   // below it, advantage pulls it back up: kept
      {0.5, -1.0f, true},   // below 1 - clip_low, pushed further down: stopped
      {0.9, -1.0f, false},  // inside
      {1.5, -1.0f, false},  // above, advantage pulls it back down: kept
  };
  std::vector<float> logp, prox, behaviour, advantage;
  for (const Case& c : cases) {
    prox.push_back(-1.0f);
    logp.push_back(float(-1.0 + std::log(c.ratio)));
    behaviour.push_back(-1.0f);  // on policy: weight 1
    advantage.push_back(c.advantage);
  }
  const auto out = async_grpo::grpo_token_objective(logp, prox, behaviour, advantage, o);
  REQUIRE(out.ok());
  const double tokens = double(cases.size());
  for (std::size_t i = 0; i < cases.size(); ++i) {
    INFO("ratio " << cases[i].ratio << " advantage " << cases[i].advantage);
    CHECK(out->clipped[i] == cases[i].clipped);
    if (cases[i].clipped) {
      CHECK(out->grad_logp[i] == 0.0f);
    } else {
      // d/dlogp of -r A / T is -r A / T.
      CHECK(out->grad_logp[i] == Approx(-cases[i].ratio * cases[i].advantage / tokens).epsilon(1e-5));
    }
  }

  // A stale token whose behaviour log-prob is far below the actor's: its weight pi_prox / mu
  // (e^3) is truncated to 2.
  const std::vector<float> one_logp = {-1.0f}, one_prox = {-1.0f}, stale = {-4.0f}, one_adv = {0.5f};
  const auto truncated = async_grpo::grpo_token_objective(one_logp, one_prox, stale, one_adv, o);
  REQUIRE(truncated.ok());
  CHECK(truncated->grad_logp[0] == Approx(-2.0 * 0.5));

  const std::vector<float> short_adv = {1.0f};
  CHECK(async_grpo::grpo_token_objective(logp, prox, behaviour, short_adv, o).status().code() ==
        laminar::StatusCode::kInvalidArgument);
}

TEST_CASE("grpo trainer: the supervised warm-up lowers the loss") {
  const DigitTask task = short_task(5);
  auto trainer = make_trainer(5);
  double first = 0, last = 0;
  for (int step = 0; step < 20; ++step) {
    auto stats = trainer->warmup_step(prompts(task, std::uint64_t(step) * 32, 32));
    REQUIRE(stats.ok());
    if (step == 0) first = stats->loss;
    last = stats->loss;
  }
  std::printf("warm-up loss %.3f -> %.3f over 20 steps\n", first, last);
  CHECK(first > std::log(16.0) * 0.8);  // near uniform over the vocabulary at init
  CHECK(last < first * 0.6);
}

TEST_CASE("grpo trainer: the recompute matches the sampler's log-probs") {
  const DigitTask task = short_task(8);
  auto trainer = make_trainer(8);
  auto batch = trainer->generate(task, prompts(task, 0, 6), 4, 1.0f, 99, laminar::Version(3));
  REQUIRE(batch.ok());
  REQUIRE(batch->size() == 24);
  auto recompute = trainer->log_probs(*batch);
  REQUIRE(recompute.ok());
  double worst = 0;
  for (std::size_t i = 0; i < batch->size(); ++i) {
    const auto& t = (*batch)[i];
    CHECK(t.version == laminar::Version(3));
    CHECK(t.group_id == laminar::GroupId(i / 4));
    CHECK(laminar::validate_trajectory(t).ok());
    REQUIRE((*recompute)[i].size() == t.logprobs.size());
    for (std::size_t j = 0; j < t.logprobs.size(); ++j) {
      worst = std::max(worst, double(std::abs((*recompute)[i][j] - t.logprobs[j])));
    }
  }
  std::printf("max |recompute - sampler| %.3g\n", worst);
  // The same f32 forward over a differently padded batch: only summation order differs.
  CHECK(worst < 1e-4);
  // The same seed samples the same responses.
  auto again = trainer->generate(task, prompts(task, 0, 6), 4, 1.0f, 99, laminar::Version(3));
  REQUIRE(again.ok());
  for (std::size_t i = 0; i < batch->size(); ++i) {
    CHECK((*again)[i].response_tokens == (*batch)[i].response_tokens);
  }
}

TEST_CASE("grpo trainer: a row's log-probs are the same packed with others as alone") {
  // Long-tailed lengths up to the policy's 128 positions: many short rows share a bin, long ones
  // fill one each, and a row longer than half a bin leaves room only for short ones.
  async_grpo::DigitTaskOptions o;
  o.median_length = 4;
  o.length_sigma = 1.1;
  auto task = DigitTask::create(o, 5);
  REQUIRE(task.ok());
  auto trainer = make_trainer(5);
  std::vector<laminar::Trajectory> batch;
  std::size_t longest = 0;
  for (std::uint64_t i = 0; i < 40; ++i) {
    const async_grpo::DigitPrompt p = task->prompt(i);
    laminar::Trajectory t;
    t.id = laminar::TrajectoryId(i);
    t.prompt_tokens = p.tokens;
    t.response_tokens = p.answer;
    longest = std::max(longest, p.tokens.size() + p.answer.size());
    batch.push_back(std::move(t));
  }
  INFO("longest row " << longest);
  auto together = trainer->log_probs(batch);
  REQUIRE(together.ok());
  double worst = 0;
  for (std::size_t i = 0; i < batch.size(); ++i) {
    auto alone = trainer->log_probs(std::span(batch).subspan(i, 1));
    REQUIRE(alone.ok());
    REQUIRE((*together)[i].size() == batch[i].response_tokens.size());
    for (std::size_t j = 0; j < (*alone)[0].size(); ++j) {
      worst = std::max(worst, double(std::abs((*together)[i][j] - (*alone)[0][j])));
    }
  }
  std::printf("max |packed - alone| %.3g over rows up to %zu tokens\n", worst, longest);
  CHECK(worst < 1e-5);
}

TEST_CASE("grpo trainer: malformed batches are refused and leave the weights alone") {
  auto trainer = make_trainer(4);
  const auto before = saved(*trainer);
  auto refused = [&](std::vector<laminar::Trajectory> batch, const char* what) {
    const auto stats = trainer->train_step(batch);
    REQUIRE_FALSE(stats.ok());
    CHECK(stats.status().code() == laminar::StatusCode::kInvalidArgument);
    CHECK_THAT(stats.status().message(), Catch::Contains(what));
  };
  refused({}, "empty");
  auto t = trajectory(0, 1.0f);
  t.logprobs.pop_back();
  refused({trajectory(0, 0.0f), t}, "trajectory 1");
  t = trajectory(0, 1.0f);
  t.response_tokens[0] = 16;
  refused({t}, "outside vocab");
  t = trajectory(0, 1.0f);
  t.prompt_tokens.assign(126, 3);
  refused({t}, "max_positions");
  t = trajectory(0, 1.0f);
  t.logprobs[1] = std::numeric_limits<float>::infinity();
  refused({t}, "logprob");
  CHECK(saved(*trainer) == before);

  TrainerOptions o;
  o.minibatches = 0;
  CHECK_THAT(Trainer::create(o).status().message(), Catch::Contains("minibatches"));
  o = {};
  o.policy.head_dim = 32;
  CHECK_THAT(Trainer::create(o).status().message(), Catch::Contains("head_dim"));
}

TEST_CASE("grpo trainer: the learning-rate ramp scales the first steps") {
  laminar::Trajectory worse = trajectory(0, 0.0f);
  worse.response_tokens = {3, 1, async_grpo::kEos};
  std::vector<laminar::Trajectory> batch = {trajectory(0, 1.0f), worse};
  TrainerOptions ramped;
  ramped.learning_rate_warmup_steps = 4;
  auto full = make_trainer(5);
  auto ramp = make_trainer(5, ramped);
  auto own = full->log_probs(batch);
  REQUIRE(own.ok());
  for (std::size_t i = 0; i < batch.size(); ++i) batch[i].logprobs = (*own)[i];
  const auto before = saved(*full);
  REQUIRE(saved(*ramp) == before);
  REQUIRE(full->train_step(batch).ok());
  REQUIRE(ramp->train_step(batch).ok());
  // Adam's first steps move each weight by about the learning rate, so the distance moved scales
  // with it: a quarter of the rate on the first of 4 ramp steps.
  auto moved = [&](const Trainer& t) {
    const auto after = saved(t);
    std::vector<float> a(before.size() / 4), b(after.size() / 4);
    std::memcpy(a.data(), before.data(), before.size());
    std::memcpy(b.data(), after.data(), after.size());
    double sum = 0;
    for (std::size_t i = 0; i < a.size(); ++i) sum += std::fabs(double(b[i]) - double(a[i]));
    return sum;
  };
  const double ratio = moved(*ramp) / moved(*full);
  std::printf("ramped / full first step: %.3f\n", ratio);
  CHECK(ratio > 0.2);
  CHECK(ratio < 0.3);

  TrainerOptions o;
  o.learning_rate_warmup_steps = -1;
  CHECK_THAT(Trainer::create(o).status().message(), Catch::Contains("learning_rate_warmup_steps"));
}

TEST_CASE("grpo trainer: GRPO on its own samples raises the reward after a warm-up") {
  // Fixed, as a learning curve is checked against a margin; LAMINAR_TEST_SEED tries another.
  const char* other = std::getenv("LAMINAR_TEST_SEED");
  const std::uint64_t seed = other != nullptr ? std::strtoull(other, nullptr, 10) : 17;
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  const DigitTask task = short_task(seed);
  auto trainer = make_trainer(seed);
  const auto began = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  };
  for (int step = 0; step < 25; ++step) {
    REQUIRE(trainer->warmup_step(prompts(task, std::uint64_t(step) * 32, 32)).ok());
  }
  // GRPO cycles through a pool of 32 prompts, 8 per step, 8 samples each; the pool is scored with
  // 4 samples per prompt before and after. A pool, not fresh prompts, so that a dozen steps move
  // the score well past its sampling noise (learning on unseen prompts: grpo_learning_curve).
  const auto pool = prompts(task, 1u << 30, 32);
  auto score = [&] {
    auto samples = trainer->generate(task, pool, 4, 1.0f, seed, laminar::Version(0));
    REQUIRE(samples.ok());
    return mean_reward(*samples);
  };
  const double start = score();
  const double warm_seconds = elapsed();
  std::vector<double> rewards;
  for (int step = 0; step < 12; ++step) {
    const auto first = pool.begin() + (step % 4) * 8;
    const std::vector<async_grpo::DigitPrompt> group_prompts(first, first + 8);
    auto batch = trainer->generate(task, group_prompts, 8, 1.0f, seed + 1 + std::uint64_t(step),
                                   laminar::Version(std::uint64_t(step)));
    REQUIRE(batch.ok());
    auto stats = trainer->train_step(*batch);
    REQUIRE(stats.ok());
    rewards.push_back(stats->mean_reward);
  }
  const double end = score();
  std::printf("warm-up and first score %.1fs, 12 GRPO steps and second score %.1fs\n", warm_seconds,
              elapsed() - warm_seconds);
  std::printf("pool reward %.3f -> %.3f; batch rewards:", start, end);
  for (double r : rewards) std::printf(" %.2f", r);
  std::printf("\n");
  CHECK(end > start + 0.05);  // seeds 1-4 and 17 rose by 0.08 to 0.14
}

TEST_CASE("grpo trainer: a trainer restored from a checkpoint takes the same next step, bit for bit") {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("laminar-checkpoint-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  // A ramp, so that the step count matters too; two groups, so that each has an advantage.
  TrainerOptions o;
  o.learning_rate_warmup_steps = 4;
  std::vector<laminar::Trajectory> batch = {trajectory(0, 1.0f), trajectory(0, 0.0f), trajectory(1, 1.0f),
                                            trajectory(1, 0.5f)};
  batch[1].response_tokens = {3, 1, async_grpo::kEos};
  batch[3].response_tokens = {1, async_grpo::kEos, async_grpo::kEos};
  auto a = make_trainer(3, o);
  for (int i = 0; i < 2; ++i) REQUIRE(a->train_step(batch).ok());
  const std::vector<std::byte> host{std::byte(1), std::byte(0), std::byte(255)};
  REQUIRE(a->save_checkpoint(dir / "ckpt", 7, host).ok());
  CHECK_FALSE(std::filesystem::exists(dir / "ckpt.tmp"));
  REQUIRE(a->train_step(batch).ok());

  auto b = make_trainer(4, o);  // other weights, no moments, no steps
  REQUIRE(saved(*b) != saved(*a));
  auto loaded = b->load_checkpoint(dir / "ckpt");
  REQUIRE(loaded.ok());
  CHECK(loaded->version == 7);
  CHECK(loaded->host_state == host);
  REQUIRE(b->train_step(batch).ok());
  CHECK(saved(*b) == saved(*a));

  // What is not a checkpoint of this policy leaves the trainer as it was.
  const auto before = saved(*b);
  CHECK(b->load_checkpoint(dir / "none").status().code() == laminar::StatusCode::kNotFound);
  std::ofstream(dir / "garbage") << "not a checkpoint";
  CHECK(b->load_checkpoint(dir / "garbage").status().code() == laminar::StatusCode::kDataLoss);
  {
    // Cut short, as by a full disk.
    const auto size = std::filesystem::file_size(dir / "ckpt");
    std::filesystem::copy_file(dir / "ckpt", dir / "short");
    std::filesystem::resize_file(dir / "short", size / 2);
    CHECK(b->load_checkpoint(dir / "short").status().code() == laminar::StatusCode::kDataLoss);
  }
  TrainerOptions wide;
  wide.policy.d_model = 256;
  REQUIRE(make_trainer(5, wide)->save_checkpoint(dir / "wide", 1).ok());
  const auto other = b->load_checkpoint(dir / "wide");
  CHECK(other.status().code() == laminar::StatusCode::kDataLoss);
  CHECK_THAT(other.status().message(), Catch::Contains("embed"));
  CHECK(saved(*b) == before);
  std::filesystem::remove_all(dir);
}
