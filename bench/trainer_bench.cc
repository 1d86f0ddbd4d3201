// One GRPO step of the asynchronous GRPO actor (examples/async_grpo/trainer.h) on one thread: 8
// prompts x 8 samples of the default task, responses the task's answers (long-tailed lengths), at
// the policy's shape (policy_config.h).
//   value: the step's useful GFLOP/s: the model's FLOPs on the batch's real tokens (the recompute
//     of pi_prox, then forward and backward: four forwards' worth; causal attention counted on its
//     lower triangle), over the step's median wall time. Padding and every non-matmul op count
//     against it.
//   baseline: single-thread sgemm (torch::mm) on the same shapes in the same run, a repeat of it
//     after each step: each linear layer and the LM head as [tokens, in] x [in, out], with the
//     backward's two products, four times over.
// The first lines say which BLAS libtorch loaded, and warn when it is the reference BLAS or
// OpenBLAS's fallback kernels (examples/async_grpo/blas.h); the goal is a ratio of at least 0.5.
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "blas.h"
#include "cli.h"
#include "harness.h"
#include "policy_config.h"
#include "task.h"
#include "trainer.h"

namespace {

[[noreturn]] void fail(const char* what, const laminar::Status& st) {
  std::fprintf(stderr, "trainer_bench: %s: %s\n", what, st.to_string().c_str());
  std::exit(1);
}

// The batch: each prompt's answer as every sample's response, rewards alternating so that every
// group has an advantage, behaviour log-probs near a confident policy's.
std::vector<laminar::Trajectory> batch(const async_grpo::DigitTask& task, int prompts, int group) {
  std::vector<laminar::Trajectory> out;
  for (int p = 0; p < prompts; ++p) {
    const async_grpo::DigitPrompt prompt = task.prompt(std::uint64_t(p));
    for (int s = 0; s < group; ++s) {
      laminar::Trajectory t;
      t.id = laminar::TrajectoryId(std::uint64_t(p * group + s));
      t.prompt_id = laminar::PromptId(std::uint64_t(p));
      t.group_id = laminar::GroupId(std::uint64_t(p));
      t.group_size = std::uint32_t(group);
      t.sample_index = std::uint32_t(s);
      t.prompt_tokens = prompt.tokens;
      t.response_tokens = prompt.answer;
      t.logprobs.assign(prompt.answer.size(), -0.5f);
      t.rewards = {float(s % 2)};
      out.push_back(std::move(t));
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  async_grpo::use_right_blas_kernels(argv);
  CLI::App app{"One GRPO step of the async GRPO actor against single-thread sgemm of its shapes"};
  int prompts = 8, group = 8, repeats = 9, width = 1;
  std::uint64_t seed = 1;
  app.add_option("--prompts", prompts, "prompts in the batch")->check(laminar::bench::at_least(1));
  app.add_option("--group-size", group, "samples per prompt")->check(laminar::bench::at_least(2));
  app.add_option("--repeats", repeats, "timed steps (the median is reported)")->check(laminar::bench::at_least(1));
  app.add_option("--seed", seed, "task and initial weights");
  app.add_option("--width", width,
                 "the policy's widths times this: d_model 128 w, 2 w query heads, w KV heads, d_ff 256 w")
      ->check(laminar::bench::at_least(1));
  CLI11_PARSE(app, argc, argv);

  auto task = async_grpo::DigitTask::create({}, seed);
  if (!task.ok()) fail("task", task.status());
  async_grpo::TrainerOptions to;
  to.seed = seed;
  to.intra_op_threads = 1;
  to.policy.d_model *= width;
  to.policy.num_qo_heads *= width;
  to.policy.num_kv_heads *= width;
  to.policy.d_ff *= width;
  auto trainer = async_grpo::Trainer::create(to);
  if (!trainer.ok()) fail("trainer", trainer.status());
  const std::vector<laminar::Trajectory> b = batch(*task, prompts, group);
  // After the trainer set the BLAS's threads.
  const async_grpo::BlasInfo blas = async_grpo::loaded_blas();
  std::printf("BLAS: %s\n", blas.describe().c_str());
  if (!blas.warning().empty()) std::printf("%s\n", blas.warning().c_str());

  // FLOPs of one forward over the real tokens.
  const async_grpo::PolicyConfig c = to.policy;
  const double d = c.d_model, q = double(c.num_qo_heads) * c.head_dim, kv = double(c.num_kv_heads) * c.head_dim;
  const double linear_per_token = 2 * (d * q + 2 * d * kv + q * d + 3 * d * c.d_ff) * c.num_layers + 2 * d * c.vocab;
  double tokens = 0, forward_flops = 0, response_tokens = 0;
  for (const laminar::Trajectory& t : b) {
    const double n = double(t.prompt_tokens.size() + t.response_tokens.size());
    tokens += n;
    response_tokens += double(t.response_tokens.size());
    forward_flops += n * linear_per_token + c.num_layers * 2 * q * n * (n + 1);
  }
  const double step_flops = 4 * forward_flops;

  // The same products as plain sgemm: [M, in] x [in, out] forward, and the backward's
  // [M, out] x [out, in] and [out, M] x [M, in].
  torch::set_num_threads(1);
  const auto m = std::int64_t(tokens);
  struct Shape {
    std::int64_t in, out;
  };
  std::vector<Shape> shapes;
  for (int l = 0; l < c.num_layers; ++l) {
    for (Shape s : {Shape{c.d_model, std::int64_t(q)}, Shape{c.d_model, std::int64_t(kv)},
                    Shape{c.d_model, std::int64_t(kv)}, Shape{std::int64_t(q), c.d_model},
                    Shape{c.d_model, c.d_ff}, Shape{c.d_model, c.d_ff}, Shape{c.d_ff, c.d_model}}) {
      shapes.push_back(s);
    }
  }
  shapes.push_back({c.d_model, c.vocab});
  std::vector<torch::Tensor> x, w, dy;
  double gemm_flops = 0;
  for (const Shape& s : shapes) {
    x.push_back(torch::randn({m, s.in}));
    w.push_back(torch::randn({s.in, s.out}));
    dy.push_back(torch::randn({m, s.out}));
    gemm_flops += 4 * 2.0 * double(m) * double(s.in) * double(s.out);
  }
  const auto [step, gemm] = laminar::bench::measure_interleaved(
      [&] {
        auto st = (*trainer)->train_step(b);
        if (!st.ok()) fail("train_step", st.status());
      },
      [&] {
        for (std::size_t i = 0; i < shapes.size(); ++i) {
          (void)torch::mm(x[i], w[i]);  // pi_prox
          (void)torch::mm(x[i], w[i]);  // forward
          (void)torch::mm(dy[i], w[i].t());
          (void)torch::mm(dy[i].t(), x[i]);
        }
      },
      {.warmup = 2, .repeats = repeats});
  laminar::bench::require_stable_baseline("sgemm", gemm);

  const double step_gflops = step_flops / step.median_s / 1e9;
  const double gemm_gflops = gemm_flops / gemm.median_s / 1e9;
  std::printf("batch: %zu samples, %.0f tokens (%.0f response), %.3f GFLOP a step\n", b.size(), tokens,
              response_tokens, step_flops / 1e9);
  std::printf("GRPO step: median %.1f ms (%.1f-%.1f), %.2f GFLOP/s\n", step.median_s * 1e3, step.min_s * 1e3,
              step.max_s * 1e3, step_gflops);
  std::printf("sgemm of its shapes, 1 thread: median %.2f ms, %.2f GFLOP/s\n", gemm.median_s * 1e3, gemm_gflops);
  laminar::bench::report_throughput("trainer_grpo_step", "GFLOP/s", step_gflops, "sgemm_same_shapes_1_thread",
                                    gemm_gflops);
  return 0;
}
