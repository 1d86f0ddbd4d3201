// The simulator's cost models against hand-computed values, their presets and their JSON checks.
#include "cost_model.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

namespace {

using laminar::Duration;
using laminar::StatusCode;
using namespace laminar::sim;

double to_s(Duration d) { return static_cast<double>(d.count()) * 1e-9; }
double to_s(const laminar::Result<Duration>& d) { return to_s(d.value()); }

// Durations round to the nanosecond, so compare to 1 ns (and a few for sums of rounded parts).
Approx near(double seconds) { return Approx(seconds).margin(4e-9); }

CostConfig config(const std::string& gpu, const std::string& model, std::int64_t tp = 1) {
  CostConfig c;
  c.gpu = *GpuSpec::preset(gpu);
  c.model = *ModelSpec::preset(model);
  c.rollout.tensor_parallel = tp;
  return c;
}

CostModel qwen7b_h100() { return *CostModel::create(config("h100", "qwen2.5-7b")); }

}  // namespace

TEST_CASE("sim cost: model sizes per rank") {
  CostModel m = qwen7b_h100();
  CHECK(m.weight_bytes() == Approx(15.22e9));  // 7.61e9 params x 2 bytes
  CHECK(m.weight_bytes_per_rank() == Approx(15.22e9));
  // K and V x 28 layers x 4 KV heads x 128 x 2 bytes = 57,344.
  CHECK(m.kv_bytes_per_token_per_rank() == 57344);

  // TP 7 > 4 KV heads: each rank holds one replicated KV head: 2 x 28 x 1 x 128 x 2 = 14,336.
  CostModel tp7 = *CostModel::create(config("h100", "qwen2.5-7b", 7));
  CHECK(tp7.kv_bytes_per_token_per_rank() == 14336);
  CHECK(tp7.weight_bytes_per_rank() == Approx(15.22e9 / 7));
  // 72B at TP 4: 2 x 80 layers x 2 KV heads per rank x 128 x 2 = 81,920.
  CostModel big = *CostModel::create(config("h100", "qwen2.5-72b", 4));
  CHECK(big.kv_bytes_per_token_per_rank() == 81920);
}

TEST_CASE("sim cost: decode step follows the roofline") {
  CostModel m = qwen7b_h100();
  const double bw = 3.35e12 * 0.8;     // HBM x efficiency = 2.68e12 B/s
  const double flops = 989e12 * 0.5;   // peak x decode MFU = 4.945e14 FLOP/s
  // Batch 1, empty context: weights only, memory bound: 15.22e9 / 2.68e12 = 5.679 ms, + 3 ms.
  CHECK(to_s(m.decode_step(1, 0)) == near(15.22e9 / bw + 0.003));
  CHECK(m.decode_step(2, 0).value() == m.decode_step(1, 0).value());  // still memory bound

  // Batch 64 x 2,000 context tokens: + 128,000 x 57,344 KV bytes = 22.560032e9 bytes -> 8.418 ms;
  // compute 2 x 7.61e9 x 64 + 4 x 28 x 28 x 128 x 128,000 = 1.0254602e12 FLOPs -> 2.07 ms.
  const double bytes = 15.22e9 + 128000.0 * 57344;
  CHECK(2 * 7.61e9 * 64 + 4.0 * 28 * 28 * 128 * 128000 < bytes / bw * flops);
  CHECK(to_s(m.decode_step(64, 128000)) == near(bytes / bw + 0.003));

  // Batch 4,096, empty context: compute bound, 2 x 7.61e9 x 4096 / 4.945e14 = 126.1 ms.
  CHECK(to_s(m.decode_step(4096, 0)) == near(2 * 7.61e9 * 4096 / flops + 0.003));

  // TP 4 on 32B: weights 65e9 / 4 per rank; 8 KV heads -> 2 per rank: 2 x 64 x 2 x 128 x 2 = 65,536.
  CostModel tp4 = *CostModel::create(config("h100", "qwen2.5-32b", 4));
  CHECK(to_s(tp4.decode_step(8, 10000)) == near((65e9 / 4 + 10000.0 * 65536) / bw + 0.003));

  CHECK(m.decode_step(0, 0).status().code() == StatusCode::kInvalidArgument);
  CHECK(m.decode_step(0, 0).status().message().find("batch") != std::string::npos);
  CHECK(m.decode_step(1, -1).status().message().find("kv_tokens") != std::string::npos);
}

TEST_CASE("sim cost: prefill is compute bound for long prompts, weight bound for short ones") {
  CostModel m = qwen7b_h100();
  // 1,000 new tokens: 2 x 7.61e9 x 1000 + 4 x 28 x 28 x 128 x 1000 x (0 + 500) = 1.5420704e13 FLOPs
  // over 4.945e14 = 31.18 ms, + 3 ms.
  CHECK(to_s(m.prefill(1000)) == near(1.5420704e13 / 4.945e14 + 0.003));
  // After 3,000 cached tokens each new token also attends to them: + 401,408 x 1000 x 3000 FLOPs.
  CHECK(to_s(m.prefill(1000, 3000)) == near((1.5420704e13 + 401408.0 * 1000 * 3000) / 4.945e14 + 0.003));
  // One token: the weights' read (5.679 ms) dominates.
  CHECK(to_s(m.prefill(1)) == near(15.22e9 / 2.68e12 + 0.003));
  CHECK(m.prefill(0).status().code() == StatusCode::kInvalidArgument);
  CHECK(m.prefill(1, -5).status().message().find("cached_tokens") != std::string::npos);
}

TEST_CASE("sim cost: KV capacity after weights, pages and preemption") {
  CostModel m = qwen7b_h100();
  // 80e9 x 0.9 - 15.22e9 weights - 2e9 reserve = 54.78e9 bytes; a page is 16 x 57,344 = 917,504.
  const auto pages = static_cast<std::int64_t>(std::floor(54.78e9 / 917504));
  CHECK(pages == 59705);
  CHECK(m.kv_capacity_pages() == pages);
  CHECK(m.kv_capacity_tokens() == pages * 16);
  CHECK(*m.pages_for(0) == 0);
  CHECK(*m.pages_for(16) == 1);
  CHECK(*m.pages_for(17) == 2);
  // A preempted 5,000-token sequence is recomputed: the prefill of its context.
  CHECK(m.preemption_recompute(5000).value() == m.prefill(5000).value());
  CHECK(m.pages_for(-1).status().code() == StatusCode::kInvalidArgument);
  CHECK(m.preemption_recompute(0).status().code() == StatusCode::kInvalidArgument);

  // 72B at TP 4: 72e9 - 72.7e9 x 2 / 4 - 2e9 = 33.65e9 bytes over 16 x 81,920 per page.
  CostModel big = *CostModel::create(config("h100", "qwen2.5-72b", 4));
  CHECK(big.kv_capacity_pages() == static_cast<std::int64_t>(std::floor(33.65e9 / (16.0 * 81920))));

  // 72B on one GPU: 145.4e9 bytes of weights do not fit in 80e9.
  laminar::Result<CostModel> none = CostModel::create(config("h100", "qwen2.5-72b", 1));
  CHECK(none.status().code() == StatusCode::kInvalidArgument);
  CHECK(none.status().message().find("rollout.tensor_parallel") != std::string::npos);
}

TEST_CASE("sim cost: training step is 6 x params x tokens over GPUs x peak x MFU") {
  CostModel m = qwen7b_h100();
  // 6 x 7.61e9 x 8e6 = 3.6528e17 FLOPs over 256 x 989e12 x 0.35 = 8.86144e16 FLOP/s = 4.122 s.
  CHECK(to_s(m.train_step(8'000'000, 256)) == near(3.6528e17 / 8.86144e16));
  CHECK(to_s(m.train_step(8'000'000, 512)) == near(3.6528e17 / 8.86144e16 / 2));
  CHECK(m.train_step(0, 1).status().code() == StatusCode::kInvalidArgument);
  CHECK(m.train_step(1, 0).status().message().find("gpus") != std::string::npos);

  CostConfig c = config("h100", "qwen2.5-7b");
  c.train.step_overhead_s = 1.5;
  CHECK(to_s(CostModel::create(c)->train_step(8'000'000, 256)) == near(3.6528e17 / 8.86144e16 + 1.5));
}

TEST_CASE("sim cost: weight sync per schedule") {
  CostModel m = qwen7b_h100();
  const double node_bw = 8 * 50e9 * 0.8;  // 8 NICs x 50 GB/s x 0.8 = 320e9 B/s
  const double chunk = 64.0 * 1024 * 1024;
  const double lat = 1e-5;
  // 768 rollout GPUs = 96 nodes; the first chunk crosses 96 hops, the rest streams behind it.
  const double broadcast = (15.22e9 + 95 * chunk) / node_bw + 96 * lat;
  CHECK(to_s(m.global_broadcast(768)) == near(broadcast));
  CHECK(to_s(m.global_broadcast(8)) == near(15.22e9 / node_bw + lat));  // one node, one hop

  const double to_relay = 15.22e9 / node_bw + lat;   // 47.56 ms
  const double chain = (15.22e9 + 94 * chunk) / node_bw + 95 * lat;  // 96 relays, 95 hops
  const double to_device = 15.22e9 / (64e9 * 0.8) + lat;  // PCIe Gen5 x 0.8: 297.3 ms
  CHECK(to_s(m.actor_to_relay()) == near(to_relay));
  CHECK(to_s(m.relay_chain(96)) == near(chain));
  CHECK(to_s(m.relay_chain(1)) == 0);
  CHECK(to_s(m.relay_to_device()) == near(to_device));

  WeightSync g = *m.weight_sync(WeightSyncSchedule::kGlobalBroadcast, 768);
  CHECK(to_s(g.trainer_blocked) == near(broadcast));
  CHECK(to_s(g.rollout_stall) == near(broadcast));
  CHECK(to_s(g.all_arrived) == near(broadcast));
  WeightSync r = *m.weight_sync(WeightSyncSchedule::kRelay, 768);
  CHECK(to_s(r.trainer_blocked) == near(to_relay));
  CHECK(to_s(r.rollout_stall) == near(to_device));
  CHECK(to_s(r.all_arrived) == near(to_relay + chain + to_device));
  // The relay decouples the trainer: it waits for one node's copy, not the whole chain.
  CHECK(r.trainer_blocked < g.trainer_blocked);

  CHECK(m.global_broadcast(0).status().code() == StatusCode::kInvalidArgument);
  CHECK(m.relay_chain(0).status().code() == StatusCode::kInvalidArgument);
  CHECK(m.weight_sync(WeightSyncSchedule::kRelay, -3).status().message().find("rollout_gpus") != std::string::npos);
}

TEST_CASE("sim cost: KV migration is bytes over the link plus latency") {
  CostModel m = qwen7b_h100();
  // 2,000 tokens x 57,344 bytes = 114.688e6 bytes over 50e9 x 0.8 (a NIC) or 450e9 x 0.8 (NVLink).
  CHECK(to_s(m.kv_migration(2000, false)) == near(114.688e6 / 40e9 + 1e-5));
  CHECK(to_s(m.kv_migration(2000, true)) == near(114.688e6 / 360e9 + 1e-5));
  CHECK(to_s(m.kv_migration(0, false)) == near(1e-5));
  CHECK(m.kv_migration(-1, true).status().code() == StatusCode::kInvalidArgument);

  CostModel h800 = *CostModel::create(config("h800", "qwen2.5-7b"));
  CHECK(to_s(h800.kv_migration(2000, true)) == near(114.688e6 / 160e9 + 1e-5));  // 200e9 x 0.8
}

TEST_CASE("sim cost: failures arrive at nodes / MTBF and recovery reloads the weights") {
  CostModel m = qwen7b_h100();
  const double mtbf = 6335.0 * 3600;
  // 128 nodes for a day: 128 x 86,400 / 22,806,000 = 0.485 failures.
  CHECK(*m.expected_failures(128, std::chrono::hours(24)) == Approx(128 * 86400 / mtbf));

  // Exponential waits: the mean of 20k draws is MTBF / nodes within 3% (sd/mean = 1: stderr 0.7%);
  // the same seed gives the same draws.
  std::mt19937_64 rng(42), again(42);
  double mean = 0;
  for (int i = 0; i < 20000; ++i) {
    Duration d = *m.time_to_failure(128, rng);
    REQUIRE(d == *m.time_to_failure(128, again));
    mean += to_s(d) / 20000;
  }
  CHECK(mean == Approx(mtbf / 128).epsilon(0.03));

  // 30 s detection + 120 s restart + fetching 15.22e9 bytes at 320e9 B/s + loading over PCIe.
  CHECK(to_s(m.recovery_time()) == near(150 + 15.22e9 / 320e9 + 1e-5 + 15.22e9 / 51.2e9 + 1e-5));
  CHECK(m.time_to_failure(0, rng).status().code() == StatusCode::kInvalidArgument);

  // A wait past Duration's range saturates to "never" instead of overflowing.
  CostConfig c = config("h100", "qwen2.5-7b");
  c.failure.node_mtbf_s = 1e300;
  CHECK(*CostModel::create(c)->time_to_failure(1, rng) == laminar::kForever);
  CHECK(seconds(1.5) == Duration(1'500'000'000));
  CHECK(m.expected_failures(1, Duration(-1)).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("sim cost: presets load and every one builds a model") {
  for (const char* gpu : {"h100", "h800"}) {
    for (auto [model, tp] : std::vector<std::pair<const char*, std::int64_t>>{
             {"qwen2.5-7b", 1}, {"qwen2.5-32b", 2}, {"qwen2.5-72b", 4}}) {
      INFO(gpu << " " << model);
      laminar::Result<CostModel> m = CostModel::create(config(gpu, model, tp));
      REQUIRE(m.ok());
      CHECK(m->kv_capacity_tokens() > 100'000);
    }
  }
  CHECK(GpuSpec::preset("h800")->nvlink_bytes_per_s < GpuSpec::preset("h100")->nvlink_bytes_per_s);
  CHECK(ModelSpec::preset("qwen2.5-32b")->layers == 64);
  CHECK(ModelSpec::preset("qwen2.5-72b")->hidden == 8192);
  CHECK(GpuSpec::preset("a100").status().message().find("gpu.preset: unknown GPU 'a100'") != std::string::npos);
  CHECK(ModelSpec::preset("llama").status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("sim cost: JSON overrides every constant and names bad fields") {
  laminar::Result<CostConfig> c = CostConfig::from_json(R"({
      "gpu": {"preset": "h100", "hbm_bytes_per_s": 2e12},
      "model": {"preset": "qwen2.5-7b", "params": 8e9},
      "rollout": {"step_overhead_s": 0, "hbm_efficiency": 1},
      "train": {"mfu": 0.5},
      "network": {"gpus_per_node": 4, "latency_s": 0},
      "failure": {"node_mtbf_s": 1000}})");
  REQUIRE(c.ok());
  CostModel m = *CostModel::create(*c);
  CHECK(to_s(m.decode_step(1, 0)) == near(16e9 / 2e12));  // 8e9 x 2 bytes over 2e12, no overhead
  CHECK(to_s(m.actor_to_relay()) == near(16e9 / (4 * 50e9 * 0.8)));
  CHECK(*m.expected_failures(1, std::chrono::seconds(500)) == Approx(0.5));

  laminar::Result<CostConfig> bare = CostConfig::from_json(R"({
      "gpu": {"name": "x", "hbm_bytes": 4e10, "hbm_bytes_per_s": 1e12, "peak_flops": 1e14,
              "nvlink_bytes_per_s": 1e11, "pcie_bytes_per_s": 2e10, "network_bytes_per_s": 1e10},
      "model": {"name": "m", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16,
                "params": 1e6}})");
  REQUIRE(bare.ok());
  CHECK(bare->gpu.name == "x");
  CHECK(bare->model.kv_heads == 2);

  struct Case {
    std::string json;
    std::string field;
  };
  const std::string model = R"("model": {"preset": "qwen2.5-7b"})";
  const std::vector<Case> cases = {
      {"{", "cost config: not valid JSON"},
      {"{" + model + "}", "gpu: required section is missing"},
      {R"({"gpu": {"preset": "h100"}})", "model: required section is missing"},
      {R"({"gpu": {"preset": "h100"}, "model": {"layers": 2}})", "model.name: required field is missing"},
      {R"({"gpu": {"name": "x"}, )" + model + "}", "gpu.hbm_bytes: required field is missing"},
      {R"({"gpu": {"preset": "b200"}, )" + model + "}", "gpu.preset: unknown GPU 'b200'"},
      {R"({"gpu": {"preset": "h100", "hbm_bytes": -1}, )" + model + "}", "gpu.hbm_bytes: must be > 0, got -1"},
      {R"({"gpu": {"preset": "h100", "hbm_bytes": "80GB"}, )" + model + "}", "gpu.hbm_bytes: must be a number"},
      {R"({"gpu": {"preset": "h100"}, "model": {"preset": "qwen2.5-7b", "kv_heads": 5}})",
       "model.kv_heads: must divide heads (28), got 5"},
      {R"({"gpu": {"preset": "h100"}, "model": {"preset": "qwen2.5-7b", "layers": 0}})",
       "model.layers: must be >= 1, got 0"},
      {R"({"gpu": {"preset": "h100"}, )" + model + R"(, "rollout": {"tensor_paralel": 2}})",
       "rollout.tensor_paralel: unknown field"},
      {R"({"gpu": {"preset": "h100"}, )" + model + R"(, "rollout": {"tensor_parallel": 3}})",
       "rollout.tensor_parallel: must divide model.heads (28), got 3"},
      {R"({"gpu": {"preset": "h100"}, )" + model + R"(, "rollout": {"decode_mfu": 1.5}})",
       "rollout.decode_mfu: must be in (0, 1], got 1.5"},
      {R"({"gpu": {"preset": "h100"}, )" + model + R"(, "rollout": {"page_tokens": 0}})",
       "rollout.page_tokens: must be >= 1, got 0"},
      {R"({"gpu": {"preset": "h100"}, )" + model + R"(, "train": {"mfu": 0}})", "train.mfu: must be > 0, got 0"},
      {R"({"gpu": {"preset": "h100"}, )" + model + R"(, "network": {"link_efficiency": 2}})",
       "network.link_efficiency: must be in (0, 1], got 2"},
      {R"({"gpu": {"preset": "h100"}, )" + model + R"(, "network": {"gpus_per_node": 2}, "rollout": {"tensor_parallel": 4}})",
       "rollout.tensor_parallel: must fit in one node (2 GPUs), got 4"},
      {R"({"gpu": {"preset": "h100"}, )" + model + R"(, "failure": {"restart_s": -1}})",
       "failure.restart_s: must be >= 0, got -1"},
      {R"({"gpu": {"preset": "h100"}, )" + model + R"(, "failure": 3})", "failure: must be a JSON object"},
      {R"({"gpu": {"preset": "h100"}, )" + model + R"(, "cluster": {}})", "cluster: unknown field"},
  };
  for (const Case& k : cases) {
    laminar::Result<CostConfig> r = CostConfig::from_json(k.json);
    INFO(k.json << "\n -> " << r.status().to_string());
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK(r.status().message().find(k.field) != std::string::npos);
  }
}
