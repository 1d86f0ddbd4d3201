// cost_model.h: how long each thing a GPU cluster does takes, for the simulator's virtual clock.
//
// Every model is a small closed formula over a CostConfig (GPU, model shape, deployment, network,
// failures), each documented where it is defined with the source of its form and constants. The
// simulator asks these for durations and advances laminar::ManualClock by them; nothing here reads a
// clock or keeps state.
//
//   laminar::Result<CostConfig> cfg = CostConfig::from_json(
//       R"({"gpu": {"preset": "h100"}, "model": {"preset": "qwen2.5-7b"}})");
//   laminar::Result<CostModel> m = CostModel::create(*cfg);
//   laminar::Result<laminar::Duration> d = m->decode_step(/*batch=*/64, /*kv_tokens=*/64 * 2000);
//   laminar::Result<laminar::Duration> t = m->train_step(/*tokens=*/8'000'000, /*gpus=*/256);
//   WeightSync w = *m->weight_sync(WeightSyncSchedule::kRelay, /*rollout_gpus=*/768);
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <string_view>

#include "laminar/clock.h"
#include "laminar/status.h"

namespace laminar::sim {

// One accelerator. Bandwidths are per GPU and per direction, in bytes per second.
// Presets "h100" and "h800" (SXM5), from NVIDIA's H100 datasheet: 80 GB HBM3 at 3.35 TB/s,
// 989 TFLOPS dense BF16, PCIe Gen5 x16 (64 GB/s), NVLink 900 GB/s (H100) or 400 GB/s (H800) both
// directions together, and one 400 Gb/s InfiniBand NIC per GPU (50 GB/s; the H800 clusters of the
// DeepSeek-V3 report, section 3.1, have the same).
struct GpuSpec {
  std::string name;
  double hbm_bytes = 0;
  double hbm_bytes_per_s = 0;
  double peak_flops = 0;  // dense BF16
  double nvlink_bytes_per_s = 0;
  double pcie_bytes_per_s = 0;
  double network_bytes_per_s = 0;

  static Result<GpuSpec> preset(std::string_view name);
};

// A dense decoder's shape. Presets "qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b" from the models'
// Hugging Face config.json (layers, hidden size, heads, KV heads; head_dim = hidden / heads = 128)
// and their model cards (parameter counts).
struct ModelSpec {
  std::string name;
  std::int64_t layers = 0;
  std::int64_t hidden = 0;
  std::int64_t heads = 0;
  std::int64_t kv_heads = 0;
  std::int64_t head_dim = 0;
  double params = 0;

  static Result<ModelSpec> preset(std::string_view name);
};

// How a rollout instance runs the model.
struct RolloutConfig {
  std::int64_t tensor_parallel = 1;  // GPUs per rollout instance
  double weight_bytes_per_param = 2;  // BF16
  double kv_bytes_per_element = 2;    // BF16 KV cache
  // Fraction of peak HBM bandwidth a decode step's streaming reads reach; ~0.8 is what memory-bound
  // GEMV kernels measure on H100 (the roofline analyses of LLM inference, e.g. Yuan et al. 2024,
  // "LLM Inference Unveiled: Survey and Roofline Model Insights", use the same discount).
  double hbm_efficiency = 0.8;
  double decode_mfu = 0.5;   // fraction of peak FLOPs in compute-bound decode steps
  double prefill_mfu = 0.5;  // and in prefill
  // Per decode or prefill step: kernel launches, sampling, the scheduler, tensor-parallel
  // all-reduce latency. A few milliseconds in vLLM and SGLang traces at small batches.
  double step_overhead_s = 0.003;
  double memory_utilization = 0.9;  // share of HBM the engine may use (vLLM's default)
  double activation_reserve_bytes = 2e9;  // per GPU, for activations and CUDA graphs
  std::int64_t page_tokens = 16;  // tokens per KV page (vLLM's default block size)
};

struct TrainConfig {
  double mfu = 0.35;  // model FLOPs utilisation of the trainer (PaLM's definition)
  double step_overhead_s = 0;  // optimizer step, checkpointing: anything not 6ND
};

struct NetworkConfig {
  std::int64_t gpus_per_node = 8;
  double link_efficiency = 0.8;  // achieved share of a link's nominal bandwidth
  double latency_s = 1e-5;       // per message: RDMA plus software
  double chunk_bytes = 64.0 * 1024 * 1024;  // pipelining unit of chained transfers
};

// Meta's Llama 3 report (section 3.3.4) saw 419 unexpected interruptions in 54 days on 16,384
// H100s: one per 16,384 * 54 * 24 / 419 = 50,677 GPU-hours, so about 6,335 hours per 8-GPU node.
struct FailureConfig {
  double node_mtbf_s = 6335.0 * 3600;
  double detection_s = 30;  // heartbeat timeout
  double restart_s = 120;   // replacement node up, engine loaded
};

// JSON: {"gpu": {...}, "model": {...}, "rollout": {...}, "train": {...}, "network": {...},
// "failure": {...}}, fields named as in the structs. "gpu" and "model" are required and take a
// "preset" whose fields the others override (without one, every field is required); the other
// sections are optional, each field overriding its default.
struct CostConfig {
  GpuSpec gpu;
  ModelSpec model;
  RolloutConfig rollout;
  TrainConfig train;
  NetworkConfig network;
  FailureConfig failure;

  static Result<CostConfig> from_json(std::string_view text);
  // kInvalidArgument naming the first bad field.
  Status validate() const;
};

enum class WeightSyncSchedule {
  kGlobalBroadcast,  // the trainer broadcasts to every rollout GPU; all of them wait
  kRelay,            // actor -> relay, relay chain, each rollout pulls from its node's relay
};

// What one weight update costs each side.
struct WeightSync {
  Duration trainer_blocked{0};  // the trainer cannot start the next step
  Duration rollout_stall{0};    // one rollout instance stops generating
  Duration all_arrived{0};      // from the trainer's first byte until every rollout GPU holds it
};

class CostModel {
 public:
  // kInvalidArgument when the config does not validate, or when the model's weights leave no room
  // for a single KV page on a GPU.
  static Result<CostModel> create(CostConfig config);

  const CostConfig& config() const { return c_; }

  double weight_bytes() const;           // the whole model
  double weight_bytes_per_rank() const;  // one tensor-parallel rank's shard
  // KV bytes one rank stores per token: its KV heads (replicated when TP exceeds the KV heads).
  double kv_bytes_per_token_per_rank() const;

  // One decode step of `batch` >= 1 sequences holding `kv_tokens` >= 0 context tokens in total.
  Result<Duration> decode_step(std::int64_t batch, std::int64_t kv_tokens) const;
  // Prefill of `new_tokens` >= 1 tokens after `cached_tokens` >= 0 already in the KV cache.
  Result<Duration> prefill(std::int64_t new_tokens, std::int64_t cached_tokens = 0) const;

  // KV cache of one rollout instance (each of its TP ranks holds its heads' share of every page).
  // When the running sequences need more pages than this, the simulator preempts one and later
  // pays preemption_recompute for it.
  std::int64_t kv_capacity_pages() const { return capacity_pages_; }
  std::int64_t kv_capacity_tokens() const { return capacity_pages_ * c_.rollout.page_tokens; }
  // Pages a sequence of `tokens` >= 0 occupies.
  Result<std::int64_t> pages_for(std::int64_t tokens) const;
  // A sequence preempted when the cache is full loses its KV and is recomputed when resumed
  // (vLLM's default recompute preemption): a prefill of its whole context.
  Result<Duration> preemption_recompute(std::int64_t context_tokens) const;

  // One trainer step over `tokens` >= 1 on `gpus` >= 1.
  Result<Duration> train_step(std::int64_t tokens, std::int64_t gpus) const;

  // Weight-sync pieces and their sum per schedule, for `rollout_gpus` >= 1 rollout GPUs.
  Result<Duration> global_broadcast(std::int64_t rollout_gpus) const;
  Duration actor_to_relay() const;
  Result<Duration> relay_chain(std::int64_t relays) const;  // relays >= 1
  Duration relay_to_device() const;
  Result<WeightSync> weight_sync(WeightSyncSchedule schedule, std::int64_t rollout_gpus) const;

  // Moving one sequence's KV of `tokens` >= 0 tokens to another instance, each rank sending its
  // shard in parallel over NVLink (`same_node`) or its NIC.
  Result<Duration> kv_migration(std::int64_t tokens, bool same_node) const;

  // Time from now to the next node failure among `nodes` >= 1 (exponential, rate nodes / MTBF).
  Result<Duration> time_to_failure(std::int64_t nodes, std::mt19937_64& rng) const;
  // Expected failures among `nodes` >= 1 over `span` >= 0.
  Result<double> expected_failures(std::int64_t nodes, Duration span) const;
  // A failed rollout node back to generating: detection, restart, fetching the current weights
  // from a surviving relay and loading them.
  Duration recovery_time() const;

 private:
  CostModel(CostConfig c, std::int64_t capacity_pages) : c_(std::move(c)), capacity_pages_(capacity_pages) {}
  // Bandwidth of one node's NICs together, derated.
  double node_network_bytes_per_s() const;

  CostConfig c_;
  std::int64_t capacity_pages_;
};

// Seconds (>= 0) to Duration, rounding to the nanosecond; kForever past Duration's range.
Duration seconds(double s);

}  // namespace laminar::sim
