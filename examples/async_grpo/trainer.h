// trainer.h: Trainer, the actor's side of the asynchronous GRPO run: the policy of policy_config.h
// in libtorch's C++ frontend, its GRPO update, its supervised warm-up, and its weights as laminar
// views for RelayStore::publish.
//
// The actor pops a batch of trajectories from its TrajectoryQueue, calls train_step, and publishes
// weights() as the next version; rollout workers decode that version and push trajectories that
// carry their behaviour log-probs, which train_step weighs against its own. No torch type appears
// here, so the actor's other files compile without libtorch's headers.
//
//   auto trainer = async_grpo::Trainer::create({});                 // seeded init
//   auto warm = (*trainer)->warmup_step(prompts);                   // supervised, on task answers
//   auto stats = (*trainer)->train_step(batch);                     // span<const Trajectory>
//   auto views = (*trainer)->weights();                             // manifest order
//   auto st = store->publish(laminar::Version(1), (*trainer)->manifest(), *views);
//
// The GRPO objective, per response token t of trajectory i (group g = its group_id):
//   A_i   = (R_i - mean_g R) / (std_g R + advantage_eps)             DeepSeekMath (Shao et al. 2024,
//                                                                    arXiv:2402.03300), eq. 3 and 4
//   w_t   = min(pi_prox(t) / mu(t), truncation)                      truncated importance weight:
//                                                                    IMPALA's rho-bar (Espeholt et al.
//                                                                    2018, arXiv:1802.01561, eq. 1)
//   r_t   = pi_theta(t) / pi_prox(t)
//   L     = -(1 / T) sum_t w_t * min(r_t A_i, clip(r_t, 1 - clip_low, 1 + clip_high) A_i)
// mu is the behaviour policy (the log-probs the trajectory carries), pi_prox the actor's weights
// when train_step starts (its recompute, no gradient), pi_theta the weights being updated. This is
// the decoupled PPO objective of Hilton et al. 2022 (arXiv:2110.00641, eq. 2) as AReaL uses it for
// stale rollouts (Fu et al. 2025, arXiv:2505.24298, eq. 5), with the behaviour weight truncated as
// in Yao et al. 2025 ("Your efficient RL framework secretly brings you off-policy RL training"):
// a sample k versions stale moves the update by at most `truncation` times its on-policy weight,
// and the PPO clip bounds how far the minibatches of one step move pi_theta from pi_prox. T counts
// every response token of the minibatch (token-level mean, DAPO: Yu et al. 2025, arXiv:2503.14476,
// eq. 8), so a long response is not down-weighted per token.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "laminar/relay_store.h"
#include "laminar/status.h"
#include "laminar/trajectory.h"
#include "laminar/weight_manifest.h"
#include "policy_config.h"
#include "task.h"

namespace async_grpo {

struct TrainerOptions {
  PolicyConfig policy;
  std::uint64_t seed = 0;  // initial weights, and nothing else
  // libtorch's intra-op threads, and the BLAS's (set_blas_threads). Process-wide: the actor shares
  // the machine's cores with rollout workers.
  std::int32_t intra_op_threads = 1;

  float learning_rate = 3e-4f;         // GRPO steps (1e-4 learns slower, 1e-3 collapses)
  // train_steps over which the GRPO learning rate ramps linearly up to learning_rate (0: none).
  // Adam's first steps after a restart move every weight by about the learning rate whatever its
  // gradient's size (the second moment has seen one gradient), which undoes part of the warm-up.
  std::int32_t learning_rate_warmup_steps = 0;
  // Supervised warm-up steps. 30 steps of 32 default-task prompts reach answer-token accuracy
  // 0.65-0.74 and held-out reward 0.25-0.29: room left for GRPO to show.
  float warmup_learning_rate = 1e-3f;
  float adam_beta1 = 0.9f;
  float adam_beta2 = 0.99f;
  float adam_eps = 1e-8f;
  float max_grad_norm = 1.0f;  // global L2 clip before each optimizer step

  float clip_low = 0.2f;   // r_t below 1 - clip_low stops pushing a negative advantage
  float clip_high = 0.2f;  // r_t above 1 + clip_high stops pushing a positive advantage
  float truncation = 2.0f;  // cap of w_t = pi_prox / mu
  float advantage_eps = 1e-4f;
  // Optimizer steps per train_step, each on a contiguous slice of the batch; every slice after
  // the first sees r_t != 1, which is where the PPO clip acts.
  std::int32_t minibatches = 2;
};

// What one train_step did. Token statistics are means over every response token of the batch.
struct TrainStats {
  double loss = 0;           // mean of the minibatches' L
  double mean_reward = 0;    // of rewards[0], over trajectories
  double clip_fraction = 0;  // tokens whose gradient the PPO clip zeroed
  double mean_ratio = 0;     // pi_theta / mu when the token's gradient was taken
  double truncated_fraction = 0;  // tokens with pi_prox / mu above truncation
  double kl = 0;             // KL(mu || pi_prox), Schulman's k3 estimator: (q - 1) - log q, q = pi_prox / mu
  double grad_norm = 0;      // before clipping, mean over minibatches
  double seconds = 0;        // wall time of the step
  std::int64_t tokens = 0;   // response tokens trained on
  std::int64_t trajectories = 0;
};

struct WarmupStats {
  double loss = 0;      // mean cross-entropy per answer token, before the step
  double accuracy = 0;  // answer tokens whose argmax was right, before the step
  double seconds = 0;
};

// The GRPO loss of one token slice and its gradient with respect to log pi_theta: the function
// train_step differentiates, exposed so its clipping can be checked token by token.
struct TokenObjective {
  double loss = 0;
  std::vector<float> grad_logp;  // [tokens] d loss / d log pi_theta(t)
  std::vector<bool> clipped;     // [tokens] the PPO clip zeroed this token's gradient
};

// A_i of the objective above, one per trajectory in `batch` order, grouped by group_id over the
// trajectories present. A group of one, or whose rewards are all equal, gets zeros.
// kInvalidArgument naming the trajectory when it has no reward or a non-finite one.
laminar::Result<std::vector<float>> group_advantages(std::span<const laminar::Trajectory> batch,
                                                     float advantage_eps);

// L and its gradient for `logp`, `prox_logp`, `behaviour_logp` and `advantage`, all [tokens].
// kInvalidArgument when the lengths differ or a value is not finite.
laminar::Result<TokenObjective> grpo_token_objective(std::span<const float> logp,
                                                     std::span<const float> prox_logp,
                                                     std::span<const float> behaviour_logp,
                                                     std::span<const float> advantage,
                                                     const TrainerOptions& options);

class Trainer {
 public:
  // kInvalidArgument naming the option that is out of range (the policy through validate()).
  static laminar::Result<std::unique_ptr<Trainer>> create(const TrainerOptions& options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  const TrainerOptions& options() const noexcept;
  const laminar::WeightManifest& manifest() const noexcept;

  // One view per manifest entry, in manifest order, named by it, taken from the parameters through
  // DLPack. The views alias the live parameters: valid while the Trainer lives, and their contents
  // change with every step, so publish (which copies) between steps.
  laminar::Result<std::vector<laminar::NamedTensor>> weights() const;

  // The flat layout of manifest(): each tensor at its entry's offset, f32, padding zeroed.
  // kInvalidArgument when `flat` is not manifest().total_bytes() long, or (load) holds a
  // non-finite value, naming the tensor. Loading keeps the optimizer's moments.
  laminar::Status load_weights(std::span<const std::byte> flat);
  laminar::Status save_weights(std::span<std::byte> flat) const;

  // The whole training state, so that a restarted actor goes on as if it had not stopped: every
  // weight, Adam's moments and step counts, the number of train_steps taken (the learning-rate
  // ramp), `version`, the policy version the weights were published as, and `host_state`, bytes of
  // the caller's that must change with the weights or not at all (the actor's: what its queue and
  // dispatcher need to go on). Written whole (to `path` + ".tmp", then renamed): a process killed
  // while saving leaves the last checkpoint. kUnavailable when it cannot be written.
  laminar::Status save_checkpoint(const std::filesystem::path& path, std::uint64_t version,
                                  std::span<const std::byte> host_state = {}) const;
  struct Checkpoint {
    std::uint64_t version = 0;
    std::vector<std::byte> host_state;
  };
  // Loads what save_checkpoint wrote and returns its version and host state. kNotFound when `path`
  // does not exist; kDataLoss when it is not a whole checkpoint of this policy (another shape,
  // truncated, not a checkpoint), and then the trainer is unchanged.
  laminar::Result<Checkpoint> load_checkpoint(const std::filesystem::path& path);

  // log pi(response token | prompt, earlier response tokens) under the current weights, one vector
  // per trajectory ([num_response_tokens]): the actor's recompute of the behaviour log-probs.
  // kInvalidArgument naming the trajectory when a token is outside the vocabulary, the prompt is
  // empty, or prompt plus response exceed max_positions.
  laminar::Result<std::vector<std::vector<float>>> log_probs(
      std::span<const laminar::Trajectory> batch) const;

  // One GRPO update on `batch` (the objective above; rewards[0] is the reward). Besides what
  // log_probs checks, kInvalidArgument naming the trajectory when its logprobs and response differ
  // in length, it has no response, or a reward or log-prob is not finite; kInvalidArgument when
  // the batch is empty. On kInvalidArgument the weights are unchanged.
  laminar::Result<TrainStats> train_step(std::span<const laminar::Trajectory> batch);

  // One supervised step: cross-entropy of each prompt's answer (digits and EOS) after its tokens.
  // kInvalidArgument when `prompts` is empty or one does not fit the policy.
  laminar::Result<WarmupStats> warmup_step(std::span<const DigitPrompt> prompts);

  // group_size samples of each prompt from the current weights at `temperature` (> 0), each up to
  // task.max_response_tokens(prompt) tokens, stopping at EOS; rewarded by task.reward. Each comes
  // back as a Trajectory: id = index * group_size + sample, prompt_id = group_id = the prompt's
  // index, version `version`, the log-probs of the distribution sampled from (at temperature 1
  // the policy's own). Deterministic in `seed` and the weights.
  laminar::Result<std::vector<laminar::Trajectory>> generate(const DigitTask& task,
                                                             std::span<const DigitPrompt> prompts,
                                                             std::int32_t group_size,
                                                             float temperature, std::uint64_t seed,
                                                             laminar::Version version) const;

 private:
  struct Impl;
  explicit Trainer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace async_grpo
