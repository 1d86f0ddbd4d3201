#include "cost_model.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "json_fields.h"
#include "sim_random.h"

namespace laminar::sim {
namespace {

using internal::Need;
using internal::ObjectReader;
using nlohmann::json;

Status positive(double v, std::string_view field) {
  if (!std::isfinite(v) || v <= 0) return invalid_argument(fmt::format("{}: must be > 0, got {}", field, v));
  return ok_status();
}
Status non_negative(double v, std::string_view field) {
  if (!std::isfinite(v) || v < 0) return invalid_argument(fmt::format("{}: must be >= 0, got {}", field, v));
  return ok_status();
}
Status unit_fraction(double v, std::string_view field) {
  if (!(v > 0 && v <= 1)) return invalid_argument(fmt::format("{}: must be in (0, 1], got {}", field, v));
  return ok_status();
}
Status at_least(std::int64_t v, std::int64_t min, std::string_view field) {
  if (v < min) return invalid_argument(fmt::format("{}: must be >= {}, got {}", field, min, v));
  return ok_status();
}

// Opens the section `key` of `top`; kNotFound when it is absent, which optional sections allow.
Result<ObjectReader> section(ObjectReader& top, std::string_view key) {
  const json* j = top.child(key);
  if (j == nullptr) return not_found(std::string(key));
  return ObjectReader::open(*j, std::string(key));
}

// A pipelined chain of `hops` links of bandwidth `bw`: the first chunk crosses every hop, then the
// rest streams behind it (the chain/ring broadcast term of NCCL's cost model, and of Thakur et al.
// 2005, "Optimization of Collective Communication Operations in MPICH").
double pipelined_chain_s(double bytes, std::int64_t hops, double bw, double chunk, double latency) {
  if (hops <= 0) return 0;
  double c = std::min(chunk, bytes);
  return (bytes + static_cast<double>(hops - 1) * c) / bw + static_cast<double>(hops) * latency;
}

}  // namespace

Duration seconds(double s) {
  // Saturates: a duration past Duration's range is "never" (a huge MTBF, say), not an overflow.
  const double ns = s * 1e9;
  if (!(ns < static_cast<double>(kForever.count()))) return kForever;
  return Duration(std::llround(ns));
}

Result<GpuSpec> GpuSpec::preset(std::string_view name) {
  GpuSpec g;
  g.hbm_bytes = 80e9;
  g.hbm_bytes_per_s = 3.35e12;
  g.peak_flops = 989e12;
  g.pcie_bytes_per_s = 64e9;
  g.network_bytes_per_s = 50e9;
  if (name == "h100") {
    g.name = "h100";
    g.nvlink_bytes_per_s = 450e9;
  } else if (name == "h800") {
    g.name = "h800";
    g.nvlink_bytes_per_s = 200e9;
  } else {
    return invalid_argument(fmt::format("gpu.preset: unknown GPU '{}' (h100, h800)", name));
  }
  return g;
}

Result<ModelSpec> ModelSpec::preset(std::string_view name) {
  ModelSpec m;
  m.name = std::string(name);
  m.head_dim = 128;
  if (name == "qwen2.5-7b") {
    m.layers = 28, m.hidden = 3584, m.heads = 28, m.kv_heads = 4, m.params = 7.61e9;
  } else if (name == "qwen2.5-32b") {
    m.layers = 64, m.hidden = 5120, m.heads = 40, m.kv_heads = 8, m.params = 32.5e9;
  } else if (name == "qwen2.5-72b") {
    m.layers = 80, m.hidden = 8192, m.heads = 64, m.kv_heads = 8, m.params = 72.7e9;
  } else {
    return invalid_argument(
        fmt::format("model.preset: unknown model '{}' (qwen2.5-7b, qwen2.5-32b, qwen2.5-72b)", name));
  }
  return m;
}

Result<CostConfig> CostConfig::from_json(std::string_view text) {
  Result<json> j = internal::parse_json(text, "cost config");
  if (!j.ok()) return j.status();
  Result<ObjectReader> top = ObjectReader::open(*j, "");
  if (!top.ok()) return top.status();
  CostConfig c;

  Result<ObjectReader> g = section(*top, "gpu");
  if (!g.ok()) {
    return g.status().code() == StatusCode::kNotFound ? invalid_argument("gpu: required section is missing")
                                                      : g.status();
  }
  Need need = Need::kRequired;
  if (g->has("preset")) {
    std::string name;
    LAMINAR_RETURN_IF_ERROR(g->text("preset", name, Need::kRequired));
    Result<GpuSpec> p = GpuSpec::preset(name);
    if (!p.ok()) return p.status();
    c.gpu = std::move(*p);
    need = Need::kOptional;
  }
  LAMINAR_RETURN_IF_ERROR(g->text("name", c.gpu.name, need));
  LAMINAR_RETURN_IF_ERROR(g->positive("hbm_bytes", c.gpu.hbm_bytes, need));
  LAMINAR_RETURN_IF_ERROR(g->positive("hbm_bytes_per_s", c.gpu.hbm_bytes_per_s, need));
  LAMINAR_RETURN_IF_ERROR(g->positive("peak_flops", c.gpu.peak_flops, need));
  LAMINAR_RETURN_IF_ERROR(g->positive("nvlink_bytes_per_s", c.gpu.nvlink_bytes_per_s, need));
  LAMINAR_RETURN_IF_ERROR(g->positive("pcie_bytes_per_s", c.gpu.pcie_bytes_per_s, need));
  LAMINAR_RETURN_IF_ERROR(g->positive("network_bytes_per_s", c.gpu.network_bytes_per_s, need));
  LAMINAR_RETURN_IF_ERROR(g->finish());

  Result<ObjectReader> m = section(*top, "model");
  if (!m.ok()) {
    return m.status().code() == StatusCode::kNotFound ? invalid_argument("model: required section is missing")
                                                      : m.status();
  }
  need = Need::kRequired;
  if (m->has("preset")) {
    std::string name;
    LAMINAR_RETURN_IF_ERROR(m->text("preset", name, Need::kRequired));
    Result<ModelSpec> p = ModelSpec::preset(name);
    if (!p.ok()) return p.status();
    c.model = std::move(*p);
    need = Need::kOptional;
  }
  LAMINAR_RETURN_IF_ERROR(m->text("name", c.model.name, need));
  LAMINAR_RETURN_IF_ERROR(m->integer("layers", c.model.layers, 1, need));
  LAMINAR_RETURN_IF_ERROR(m->integer("hidden", c.model.hidden, 1, need));
  LAMINAR_RETURN_IF_ERROR(m->integer("heads", c.model.heads, 1, need));
  LAMINAR_RETURN_IF_ERROR(m->integer("kv_heads", c.model.kv_heads, 1, need));
  LAMINAR_RETURN_IF_ERROR(m->integer("head_dim", c.model.head_dim, 1, need));
  LAMINAR_RETURN_IF_ERROR(m->positive("params", c.model.params, need));
  LAMINAR_RETURN_IF_ERROR(m->finish());

  const Need opt = Need::kOptional;
  if (Result<ObjectReader> r = section(*top, "rollout"); r.ok()) {
    RolloutConfig& x = c.rollout;
    LAMINAR_RETURN_IF_ERROR(r->integer("tensor_parallel", x.tensor_parallel, 1, opt));
    LAMINAR_RETURN_IF_ERROR(r->positive("weight_bytes_per_param", x.weight_bytes_per_param, opt));
    LAMINAR_RETURN_IF_ERROR(r->positive("kv_bytes_per_element", x.kv_bytes_per_element, opt));
    LAMINAR_RETURN_IF_ERROR(r->positive("hbm_efficiency", x.hbm_efficiency, opt));
    LAMINAR_RETURN_IF_ERROR(r->positive("decode_mfu", x.decode_mfu, opt));
    LAMINAR_RETURN_IF_ERROR(r->positive("prefill_mfu", x.prefill_mfu, opt));
    LAMINAR_RETURN_IF_ERROR(r->non_negative("step_overhead_s", x.step_overhead_s, opt));
    LAMINAR_RETURN_IF_ERROR(r->positive("memory_utilization", x.memory_utilization, opt));
    LAMINAR_RETURN_IF_ERROR(r->non_negative("activation_reserve_bytes", x.activation_reserve_bytes, opt));
    LAMINAR_RETURN_IF_ERROR(r->integer("page_tokens", x.page_tokens, 1, opt));
    LAMINAR_RETURN_IF_ERROR(r->finish());
  } else if (r.status().code() != StatusCode::kNotFound) {
    return r.status();
  }
  if (Result<ObjectReader> r = section(*top, "train"); r.ok()) {
    LAMINAR_RETURN_IF_ERROR(r->positive("mfu", c.train.mfu, opt));
    LAMINAR_RETURN_IF_ERROR(r->non_negative("step_overhead_s", c.train.step_overhead_s, opt));
    LAMINAR_RETURN_IF_ERROR(r->finish());
  } else if (r.status().code() != StatusCode::kNotFound) {
    return r.status();
  }
  if (Result<ObjectReader> r = section(*top, "network"); r.ok()) {
    NetworkConfig& x = c.network;
    LAMINAR_RETURN_IF_ERROR(r->integer("gpus_per_node", x.gpus_per_node, 1, opt));
    LAMINAR_RETURN_IF_ERROR(r->positive("link_efficiency", x.link_efficiency, opt));
    LAMINAR_RETURN_IF_ERROR(r->non_negative("latency_s", x.latency_s, opt));
    LAMINAR_RETURN_IF_ERROR(r->positive("chunk_bytes", x.chunk_bytes, opt));
    LAMINAR_RETURN_IF_ERROR(r->finish());
  } else if (r.status().code() != StatusCode::kNotFound) {
    return r.status();
  }
  if (Result<ObjectReader> r = section(*top, "failure"); r.ok()) {
    FailureConfig& x = c.failure;
    LAMINAR_RETURN_IF_ERROR(r->positive("node_mtbf_s", x.node_mtbf_s, opt));
    LAMINAR_RETURN_IF_ERROR(r->non_negative("detection_s", x.detection_s, opt));
    LAMINAR_RETURN_IF_ERROR(r->non_negative("restart_s", x.restart_s, opt));
    LAMINAR_RETURN_IF_ERROR(r->finish());
  } else if (r.status().code() != StatusCode::kNotFound) {
    return r.status();
  }
  LAMINAR_RETURN_IF_ERROR(top->finish());
  LAMINAR_RETURN_IF_ERROR(c.validate());
  return c;
}

Status CostConfig::validate() const {
  LAMINAR_RETURN_IF_ERROR(positive(gpu.hbm_bytes, "gpu.hbm_bytes"));
  LAMINAR_RETURN_IF_ERROR(positive(gpu.hbm_bytes_per_s, "gpu.hbm_bytes_per_s"));
  LAMINAR_RETURN_IF_ERROR(positive(gpu.peak_flops, "gpu.peak_flops"));
  LAMINAR_RETURN_IF_ERROR(positive(gpu.nvlink_bytes_per_s, "gpu.nvlink_bytes_per_s"));
  LAMINAR_RETURN_IF_ERROR(positive(gpu.pcie_bytes_per_s, "gpu.pcie_bytes_per_s"));
  LAMINAR_RETURN_IF_ERROR(positive(gpu.network_bytes_per_s, "gpu.network_bytes_per_s"));
  LAMINAR_RETURN_IF_ERROR(at_least(model.layers, 1, "model.layers"));
  LAMINAR_RETURN_IF_ERROR(at_least(model.hidden, 1, "model.hidden"));
  LAMINAR_RETURN_IF_ERROR(at_least(model.heads, 1, "model.heads"));
  LAMINAR_RETURN_IF_ERROR(at_least(model.kv_heads, 1, "model.kv_heads"));
  LAMINAR_RETURN_IF_ERROR(at_least(model.head_dim, 1, "model.head_dim"));
  LAMINAR_RETURN_IF_ERROR(positive(model.params, "model.params"));
  if (model.heads % model.kv_heads != 0) {
    return invalid_argument(fmt::format("model.kv_heads: must divide heads ({}), got {}", model.heads,
                                        model.kv_heads));
  }
  const RolloutConfig& r = rollout;
  LAMINAR_RETURN_IF_ERROR(at_least(r.tensor_parallel, 1, "rollout.tensor_parallel"));
  // Tensor parallelism shards attention by heads.
  if (model.heads % r.tensor_parallel != 0) {
    return invalid_argument(fmt::format("rollout.tensor_parallel: must divide model.heads ({}), got {}",
                                        model.heads, r.tensor_parallel));
  }
  LAMINAR_RETURN_IF_ERROR(positive(r.weight_bytes_per_param, "rollout.weight_bytes_per_param"));
  LAMINAR_RETURN_IF_ERROR(positive(r.kv_bytes_per_element, "rollout.kv_bytes_per_element"));
  LAMINAR_RETURN_IF_ERROR(unit_fraction(r.hbm_efficiency, "rollout.hbm_efficiency"));
  LAMINAR_RETURN_IF_ERROR(unit_fraction(r.decode_mfu, "rollout.decode_mfu"));
  LAMINAR_RETURN_IF_ERROR(unit_fraction(r.prefill_mfu, "rollout.prefill_mfu"));
  LAMINAR_RETURN_IF_ERROR(non_negative(r.step_overhead_s, "rollout.step_overhead_s"));
  LAMINAR_RETURN_IF_ERROR(unit_fraction(r.memory_utilization, "rollout.memory_utilization"));
  LAMINAR_RETURN_IF_ERROR(non_negative(r.activation_reserve_bytes, "rollout.activation_reserve_bytes"));
  LAMINAR_RETURN_IF_ERROR(at_least(r.page_tokens, 1, "rollout.page_tokens"));
  LAMINAR_RETURN_IF_ERROR(unit_fraction(train.mfu, "train.mfu"));
  LAMINAR_RETURN_IF_ERROR(non_negative(train.step_overhead_s, "train.step_overhead_s"));
  LAMINAR_RETURN_IF_ERROR(at_least(network.gpus_per_node, 1, "network.gpus_per_node"));
  if (r.tensor_parallel > network.gpus_per_node) {
    return invalid_argument(fmt::format("rollout.tensor_parallel: must fit in one node ({} GPUs), got {}",
                                        network.gpus_per_node, r.tensor_parallel));
  }
  LAMINAR_RETURN_IF_ERROR(unit_fraction(network.link_efficiency, "network.link_efficiency"));
  LAMINAR_RETURN_IF_ERROR(non_negative(network.latency_s, "network.latency_s"));
  LAMINAR_RETURN_IF_ERROR(positive(network.chunk_bytes, "network.chunk_bytes"));
  LAMINAR_RETURN_IF_ERROR(positive(failure.node_mtbf_s, "failure.node_mtbf_s"));
  LAMINAR_RETURN_IF_ERROR(non_negative(failure.detection_s, "failure.detection_s"));
  LAMINAR_RETURN_IF_ERROR(non_negative(failure.restart_s, "failure.restart_s"));
  return ok_status();
}

Result<CostModel> CostModel::create(CostConfig config) {
  LAMINAR_RETURN_IF_ERROR(config.validate());
  CostModel probe(config, 0);
  // Per rank: the engine's share of HBM, less its weight shard and the activation reserve; the
  // rest holds KV pages (vLLM's profiling in "Efficient Memory Management for Large Language Model
  // Serving with PagedAttention", Kwon et al. 2023, sizes its cache the same way).
  const double usable = config.gpu.hbm_bytes * config.rollout.memory_utilization -
                        probe.weight_bytes_per_rank() - config.rollout.activation_reserve_bytes;
  const double page_bytes = probe.kv_bytes_per_token_per_rank() * static_cast<double>(config.rollout.page_tokens);
  const double pages = usable > 0 ? std::floor(usable / page_bytes) : 0;
  if (pages < 1) {
    return invalid_argument(fmt::format(
        "rollout.tensor_parallel: {} with {} weight bytes per rank leaves {} of {}'s {} HBM bytes "
        "for KV, less than one page ({} bytes); raise tensor_parallel",
        config.rollout.tensor_parallel, probe.weight_bytes_per_rank(), usable, config.gpu.name,
        config.gpu.hbm_bytes, page_bytes));
  }
  return CostModel(std::move(config), static_cast<std::int64_t>(pages));
}

double CostModel::weight_bytes() const { return c_.model.params * c_.rollout.weight_bytes_per_param; }

double CostModel::weight_bytes_per_rank() const {
  return weight_bytes() / static_cast<double>(c_.rollout.tensor_parallel);
}

double CostModel::kv_bytes_per_token_per_rank() const {
  const std::int64_t tp = c_.rollout.tensor_parallel;
  const std::int64_t heads_per_rank = (c_.model.kv_heads + tp - 1) / tp;
  // K and V, for every layer.
  return 2.0 * static_cast<double>(c_.model.layers * heads_per_rank * c_.model.head_dim) *
         c_.rollout.kv_bytes_per_element;
}

// Roofline (Williams, Waterman, Patterson 2009, "Roofline: an insightful visual performance model"):
// a step takes the longer of its memory traffic over bandwidth and its FLOPs over peak. Per rank,
// a decode step streams its weight shard once and reads every sequence's KV; it computes 2 FLOPs
// per parameter per sequence plus attention's 4 x heads x head_dim FLOPs per layer per context
// token (QK^T and PV). A fixed overhead is added on top.
Result<Duration> CostModel::decode_step(std::int64_t batch, std::int64_t kv_tokens) const {
  if (batch < 1) return invalid_argument(fmt::format("batch: must be >= 1, got {}", batch));
  if (kv_tokens < 0) return invalid_argument(fmt::format("kv_tokens: must be >= 0, got {}", kv_tokens));
  const RolloutConfig& r = c_.rollout;
  const double tp = static_cast<double>(r.tensor_parallel);
  const double bytes = weight_bytes_per_rank() + static_cast<double>(kv_tokens) * kv_bytes_per_token_per_rank();
  const double memory_s = bytes / (c_.gpu.hbm_bytes_per_s * r.hbm_efficiency);
  const double attention_flops = 4.0 * static_cast<double>(c_.model.layers * c_.model.heads * c_.model.head_dim) *
                                 static_cast<double>(kv_tokens);
  const double flops = (2.0 * c_.model.params * static_cast<double>(batch) + attention_flops) / tp;
  const double compute_s = flops / (c_.gpu.peak_flops * r.decode_mfu);
  return seconds(std::max(memory_s, compute_s) + r.step_overhead_s);
}

// The same roofline for a prefill chunk: 2 FLOPs per parameter per new token, plus causal
// attention where each new token attends to the cached context and, on average, half the chunk.
// Large chunks are compute bound; a small one still streams the weights once.
Result<Duration> CostModel::prefill(std::int64_t new_tokens, std::int64_t cached_tokens) const {
  if (new_tokens < 1) return invalid_argument(fmt::format("new_tokens: must be >= 1, got {}", new_tokens));
  if (cached_tokens < 0) {
    return invalid_argument(fmt::format("cached_tokens: must be >= 0, got {}", cached_tokens));
  }
  const RolloutConfig& r = c_.rollout;
  const double n = static_cast<double>(new_tokens);
  const double attention_flops = 4.0 * static_cast<double>(c_.model.layers * c_.model.heads * c_.model.head_dim) *
                                 n * (static_cast<double>(cached_tokens) + n / 2);
  const double flops = (2.0 * c_.model.params * n + attention_flops) / static_cast<double>(r.tensor_parallel);
  const double compute_s = flops / (c_.gpu.peak_flops * r.prefill_mfu);
  const double memory_s = weight_bytes_per_rank() / (c_.gpu.hbm_bytes_per_s * r.hbm_efficiency);
  return seconds(std::max(memory_s, compute_s) + r.step_overhead_s);
}

Result<std::int64_t> CostModel::pages_for(std::int64_t tokens) const {
  if (tokens < 0) return invalid_argument(fmt::format("tokens: must be >= 0, got {}", tokens));
  return (tokens + c_.rollout.page_tokens - 1) / c_.rollout.page_tokens;
}

Result<Duration> CostModel::preemption_recompute(std::int64_t context_tokens) const {
  if (context_tokens < 1) {
    return invalid_argument(fmt::format("context_tokens: must be >= 1, got {}", context_tokens));
  }
  return prefill(context_tokens, 0);
}

// Training FLOPs = 6 x params x tokens (forward 2, backward 4; Kaplan et al. 2020, "Scaling Laws
// for Neural Language Models"), delivered at MFU x peak per GPU (Chowdhery et al. 2022, PaLM).
Result<Duration> CostModel::train_step(std::int64_t tokens, std::int64_t gpus) const {
  if (tokens < 1) return invalid_argument(fmt::format("tokens: must be >= 1, got {}", tokens));
  if (gpus < 1) return invalid_argument(fmt::format("gpus: must be >= 1, got {}", gpus));
  const double flops = 6.0 * c_.model.params * static_cast<double>(tokens);
  return seconds(flops / (static_cast<double>(gpus) * c_.gpu.peak_flops * c_.train.mfu) +
                 c_.train.step_overhead_s);
}

double CostModel::node_network_bytes_per_s() const {
  return static_cast<double>(c_.network.gpus_per_node) * c_.gpu.network_bytes_per_s * c_.network.link_efficiency;
}

// One copy of the weights per rollout node, pipelined node to node over each node's NICs (a
// node's GPUs then share it over NVLink, overlapped with the next chunk).
Result<Duration> CostModel::global_broadcast(std::int64_t rollout_gpus) const {
  if (rollout_gpus < 1) return invalid_argument(fmt::format("rollout_gpus: must be >= 1, got {}", rollout_gpus));
  const std::int64_t nodes = (rollout_gpus + c_.network.gpus_per_node - 1) / c_.network.gpus_per_node;
  return seconds(pipelined_chain_s(weight_bytes(), nodes, node_network_bytes_per_s(), c_.network.chunk_bytes,
                                   c_.network.latency_s));
}

// The trainer's ranks push their shards together into the first relay's host memory, limited by
// that node's NICs.
Duration CostModel::actor_to_relay() const {
  return seconds(weight_bytes() / node_network_bytes_per_s() + c_.network.latency_s);
}

Result<Duration> CostModel::relay_chain(std::int64_t relays) const {
  if (relays < 1) return invalid_argument(fmt::format("relays: must be >= 1, got {}", relays));
  return seconds(pipelined_chain_s(weight_bytes(), relays - 1, node_network_bytes_per_s(),
                                   c_.network.chunk_bytes, c_.network.latency_s));
}

// Every GPU loads its shard from host memory over its own PCIe link, all in parallel.
Duration CostModel::relay_to_device() const {
  return seconds(weight_bytes_per_rank() / (c_.gpu.pcie_bytes_per_s * c_.network.link_efficiency) +
                 c_.network.latency_s);
}

Result<WeightSync> CostModel::weight_sync(WeightSyncSchedule schedule, std::int64_t rollout_gpus) const {
  if (rollout_gpus < 1) return invalid_argument(fmt::format("rollout_gpus: must be >= 1, got {}", rollout_gpus));
  WeightSync w;
  if (schedule == WeightSyncSchedule::kGlobalBroadcast) {
    Result<Duration> b = global_broadcast(rollout_gpus);
    if (!b.ok()) return b.status();
    w.trainer_blocked = w.rollout_stall = w.all_arrived = *b;
    return w;
  }
  // One relay per rollout node.
  const std::int64_t relays = (rollout_gpus + c_.network.gpus_per_node - 1) / c_.network.gpus_per_node;
  Result<Duration> chain = relay_chain(relays);
  if (!chain.ok()) return chain.status();
  w.trainer_blocked = actor_to_relay();
  w.rollout_stall = relay_to_device();
  w.all_arrived = w.trainer_blocked + *chain + w.rollout_stall;
  return w;
}

Result<Duration> CostModel::kv_migration(std::int64_t tokens, bool same_node) const {
  if (tokens < 0) return invalid_argument(fmt::format("tokens: must be >= 0, got {}", tokens));
  const double link = same_node ? c_.gpu.nvlink_bytes_per_s : c_.gpu.network_bytes_per_s;
  return seconds(static_cast<double>(tokens) * kv_bytes_per_token_per_rank() / (link * c_.network.link_efficiency) +
                 c_.network.latency_s);
}

// Failures as a Poisson process over nodes (the independence Llama 3's interruption statistics
// are reported under): exponential waits with mean MTBF / nodes, by inverting the CDF.
Result<Duration> CostModel::time_to_failure(std::int64_t nodes, std::mt19937_64& rng) const {
  if (nodes < 1) return invalid_argument(fmt::format("nodes: must be >= 1, got {}", nodes));
  const double u = internal::uniform01(rng);
  return seconds(-std::log1p(-u) * c_.failure.node_mtbf_s / static_cast<double>(nodes));
}

Result<double> CostModel::expected_failures(std::int64_t nodes, Duration span) const {
  if (nodes < 1) return invalid_argument(fmt::format("nodes: must be >= 1, got {}", nodes));
  if (span < Duration::zero()) return invalid_argument(fmt::format("span: must be >= 0, got {} ns", span.count()));
  return static_cast<double>(nodes) * (static_cast<double>(span.count()) * 1e-9) / c_.failure.node_mtbf_s;
}

Duration CostModel::recovery_time() const {
  const double fetch_s = weight_bytes() / node_network_bytes_per_s() + c_.network.latency_s;
  return seconds(c_.failure.detection_s + c_.failure.restart_s + fetch_s) + relay_to_device();
}

}  // namespace laminar::sim
