// grpo_learning_curve: how fast the policy learns a DigitTask in one process, with no laminar
// between the sampler and the trainer: a supervised warm-up, then synchronous GRPO on the
// trainer's own samples. One line per step (elapsed seconds, loss or reward), so the tasks and
// settings can be compared by measurement.
//
//   grpo_learning_curve --op sort --warmup-steps 30 --rl-steps 60 --seed 1
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <string>

#include "engine.h"
#include "held_out.h"
#include "task.h"
#include "trainer.h"

namespace {

struct Args {
  async_grpo::DigitOp op = async_grpo::DigitOp::kSort;
  int warmup_steps = 30;
  int warmup_batch = 32;
  int rl_steps = 60;
  int prompts = 8;  // per GRPO step
  int group = 8;    // samples per prompt
  float temperature = 1.0f;
  std::uint64_t seed = 1;
  int threads = 1;
  float lr = 3e-4f;
  float warmup_lr = 1e-3f;
  int minibatches = 2;
  double median = 3.0;
  double sigma = 1.1;
  int max_length = 62;
  int eval_every = 10;  // GRPO steps between evaluations
  int eval_prompts = 128;
  int eval_samples = 1;  // per held-out prompt
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"How fast the policy learns a DigitTask in one process: supervised warm-up, then synchronous GRPO"};
  Args a;
  std::string op = "sort";
  app.add_option("--op", op, "the task")->check(CLI::IsMember({"copy", "reverse", "sort"}));
  app.add_option("--warmup-steps", a.warmup_steps, "supervised warm-up steps")->check(CLI::NonNegativeNumber);
  app.add_option("--warmup-batch", a.warmup_batch, "prompts per warm-up step")->check(CLI::PositiveNumber);
  app.add_option("--rl-steps", a.rl_steps, "GRPO steps")->check(CLI::NonNegativeNumber);
  app.add_option("--prompts", a.prompts, "prompts per GRPO step")->check(CLI::PositiveNumber);
  app.add_option("--group", a.group, "samples per prompt")->check(CLI::PositiveNumber);
  app.add_option("--temperature", a.temperature, "sampling temperature")->check(CLI::PositiveNumber);
  app.add_option("--seed", a.seed, "task, weights and sampling seed");
  app.add_option("--threads", a.threads, "the trainer's intra-op threads")->check(CLI::PositiveNumber);
  app.add_option("--lr", a.lr, "GRPO learning rate")->check(CLI::PositiveNumber);
  app.add_option("--warmup-lr", a.warmup_lr, "warm-up learning rate")->check(CLI::PositiveNumber);
  app.add_option("--minibatches", a.minibatches, "minibatches per step")->check(CLI::PositiveNumber);
  app.add_option("--median", a.median, "median digit-list length")->check(CLI::PositiveNumber);
  app.add_option("--sigma", a.sigma, "log-normal sigma of the lengths")->check(CLI::NonNegativeNumber);
  app.add_option("--max-length", a.max_length, "longest digit list")->check(CLI::PositiveNumber);
  app.add_option("--eval-every", a.eval_every, "GRPO steps between evaluations")->check(CLI::PositiveNumber);
  app.add_option("--eval-prompts", a.eval_prompts, "held-out prompts")->check(CLI::PositiveNumber);
  app.add_option("--eval-samples", a.eval_samples, "samples per held-out prompt")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  a.op = async_grpo::parse_digit_op(op).value();  // IsMember above admits only valid names

  async_grpo::DigitTaskOptions task_options;
  task_options.op = a.op;
  task_options.median_length = a.median;
  task_options.length_sigma = a.sigma;
  task_options.max_length = a.max_length;
  auto task = async_grpo::DigitTask::create(task_options, a.seed);
  async_grpo::TrainerOptions trainer_options;
  trainer_options.seed = a.seed;
  trainer_options.intra_op_threads = a.threads;
  trainer_options.learning_rate = a.lr;
  trainer_options.warmup_learning_rate = a.warmup_lr;
  trainer_options.minibatches = a.minibatches;
  auto trainer = async_grpo::Trainer::create(trainer_options);
  if (!task.ok() || !trainer.ok()) {
    std::fprintf(stderr, "%s\n", (task.ok() ? trainer.status() : task.status()).to_string().c_str());
    return 1;
  }
  std::printf("op %s seed %llu threads %d\n", std::string(async_grpo::digit_op_name(a.op)).c_str(),
              static_cast<unsigned long long>(a.seed), a.threads);
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };

  std::uint64_t next_prompt = 0;
  auto draw = [&](int n) {
    std::vector<async_grpo::DigitPrompt> out;
    for (int i = 0; i < n; ++i) out.push_back(task->prompt(next_prompt++));
    return out;
  };
  for (int s = 0; s < a.warmup_steps; ++s) {
    auto stats = (*trainer)->warmup_step(draw(a.warmup_batch));
    if (!stats.ok()) {
      std::fprintf(stderr, "%s\n", stats.status().to_string().c_str());
      return 1;
    }
    std::printf("warmup %3d t %6.2fs loss %.4f token_acc %.3f\n", s, elapsed(), stats->loss,
                stats->accuracy);
  }
  // Scored by the rollout engine on the trainer's weights, as the async GRPO launcher scores each
  // published version.
  auto engine = async_grpo::Engine::create(async_grpo::PolicyConfig{});
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", engine.status().to_string().c_str());
    return 1;
  }
  const std::vector<async_grpo::DigitPrompt> held_out = task->held_out_prompts(std::size_t(a.eval_prompts));
  std::vector<std::byte> flat((*trainer)->manifest().total_bytes());
  auto evaluate = [&](int step) {
    laminar::Status st = (*trainer)->save_weights(flat);
    if (st.ok()) st = engine->load_weights(flat);
    auto r = st.ok() ? async_grpo::evaluate_held_out(*engine, *task, held_out,
                                                     {.samples_per_prompt = a.eval_samples, .seed = 12345})
                     : laminar::Result<async_grpo::HeldOutReward>(st);
    if (!r.ok()) {
      std::fprintf(stderr, "%s\n", r.status().to_string().c_str());
      return false;
    }
    std::printf("eval after %d grpo steps t %6.2fs held_out_reward %.3f exact %.3f\n", step, elapsed(),
                r->reward, r->exact);
    return true;
  };
  for (int s = 0; s < a.rl_steps; ++s) {
    if (a.eval_every > 0 && s % a.eval_every == 0 && !evaluate(s)) return 1;
    const auto gen_start = elapsed();
    auto batch = (*trainer)->generate(*task, draw(a.prompts), a.group, a.temperature,
                                      a.seed * 1000003 + std::uint64_t(s), laminar::Version(0));
    if (!batch.ok()) {
      std::fprintf(stderr, "%s\n", batch.status().to_string().c_str());
      return 1;
    }
    const double gen_seconds = elapsed() - gen_start;
    int exact = 0;
    for (const auto& t : *batch) exact += t.rewards.front() == 1.0f ? 1 : 0;
    auto stats = (*trainer)->train_step(*batch);
    if (!stats.ok()) {
      std::fprintf(stderr, "%s\n", stats.status().to_string().c_str());
      return 1;
    }
    std::printf(
        "grpo %3d t %6.2fs reward %.3f exact %.3f tokens %lld gen %.2fs train %.2fs clip %.3f "
        "ratio %.3f kl %.4f grad %.3f\n",
        s, elapsed(), stats->mean_reward, double(exact) / double(batch->size()),
        static_cast<long long>(stats->tokens), gen_seconds, stats->seconds, stats->clip_fraction,
        stats->mean_ratio, stats->kl, stats->grad_norm);
    std::fflush(stdout);
  }
  if (a.eval_every > 0 && !evaluate(a.rl_steps)) return 1;
  return 0;
}
