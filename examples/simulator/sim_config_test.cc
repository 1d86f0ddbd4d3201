// The simulator's configuration: schedule names, each schedule's defaults, the paper's setting and
// the checks of SimConfig's JSON reader.
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "simulator.h"

namespace {

using laminar::Duration;
using laminar::StatusCode;
using namespace laminar::sim;

const std::vector<ScheduleKind> kAll = {ScheduleKind::kSync,           ScheduleKind::kOneStep,
                                        ScheduleKind::kStreamGlobal,   ScheduleKind::kBoundedStaleness,
                                        ScheduleKind::kPartialRollout, ScheduleKind::kLaminar};

// `s` is kInvalidArgument and its message starts with `field` followed by ':'.
void check_names(const laminar::Status& s, const std::string& field) {
  INFO(s.to_string());
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message().rfind(field + ":", 0) == 0);
}

template <class T>
void check_names(const laminar::Result<T>& r, const std::string& field) {
  REQUIRE_FALSE(r.ok());
  check_names(r.status(), field);
}

}  // namespace

TEST_CASE("sim config: schedule names round-trip") {
  std::vector<std::string> names;
  for (ScheduleKind k : kAll) {
    const std::string name(schedule_name(k));
    laminar::Result<ScheduleKind> back = parse_schedule(name);
    REQUIRE(back.ok());
    CHECK(*back == k);
    names.push_back(name);
  }
  CHECK(names == std::vector<std::string>{"sync", "one-step", "stream-global", "bounded-staleness",
                                          "partial-rollout", "laminar"});
}

TEST_CASE("sim config: an unknown schedule is refused with the known ones listed") {
  for (const char* bad : {"lamina", "", "Sync", "one_step"}) {
    laminar::Result<ScheduleKind> r = parse_schedule(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    const std::string m = r.status().message();
    CHECK(m.find(std::string("'") + bad + "'") != std::string::npos);
    for (ScheduleKind k : kAll) CHECK(m.find(std::string(schedule_name(k))) != std::string::npos);
  }
}

TEST_CASE("sim config: each schedule's defaults") {
  const std::vector<std::pair<ScheduleKind, std::optional<std::int64_t>>> expected = {
      {ScheduleKind::kSync, 0},         {ScheduleKind::kOneStep, 1},
      {ScheduleKind::kStreamGlobal, 1}, {ScheduleKind::kBoundedStaleness, 4},
      {ScheduleKind::kPartialRollout, 1}, {ScheduleKind::kLaminar, 4}};
  for (const auto& [kind, ahead] : expected) {
    INFO(schedule_name(kind));
    ScheduleSpec s = ScheduleSpec::defaults(kind);
    CHECK(s.kind == kind);
    CHECK(s.max_ahead_steps == ahead);
    CHECK(s.validate().ok());
  }
}

TEST_CASE("sim config: schedule validation names each bad field") {
  const std::vector<std::pair<std::string, std::function<void(ScheduleSpec&)>>> cases = {
      {"kind", [](ScheduleSpec& s) { s.kind = static_cast<ScheduleKind>(99); }},
      {"max_ahead_steps", [](ScheduleSpec& s) { s.max_ahead_steps = -1; }},
      {"max_step_share", [](ScheduleSpec& s) { s.max_step_share = 0; }},
      {"partial_token_budget", [](ScheduleSpec& s) { s.partial_token_budget = 0; }},
      {"repack_interval", [](ScheduleSpec& s) { s.repack_interval = Duration(0); }},
      {"repack_options.strategy",
       [](ScheduleSpec& s) { s.repack_options.strategy = static_cast<laminar::RepackStrategy>(99); }},
      {"repack_options.growth_horizon_steps", [](ScheduleSpec& s) { s.repack_options.growth_horizon_steps = -1; }},
      {"repack_options.page_bytes", [](ScheduleSpec& s) { s.repack_options.page_bytes = std::uint64_t(1) << 41; }},
      {"repack_options.link_bytes_per_s", [](ScheduleSpec& s) { s.repack_options.link_bytes_per_s = 0; }},
      {"repack_options.move_overhead", [](ScheduleSpec& s) { s.repack_options.move_overhead = Duration(-1); }},
      {"repack_options.step_seconds_per_token", [](ScheduleSpec& s) { s.repack_options.step_seconds_per_token = -1; }},
      {"repack_options.max_tail_growth", [](ScheduleSpec& s) { s.repack_options.max_tail_growth = -0.5; }},
      {"repack_options.default_remaining_ratio",
       [](ScheduleSpec& s) { s.repack_options.default_remaining_ratio = -1; }},
  };
  for (const auto& [field, spoil] : cases) {
    INFO(field);
    ScheduleSpec s = ScheduleSpec::defaults(ScheduleKind::kLaminar);
    spoil(s);
    check_names(s.validate(), field);
  }

  // Sync's generation and training alternate on the same GPUs: it admits no other bound.
  ScheduleSpec sync = ScheduleSpec::defaults(ScheduleKind::kSync);
  sync.max_ahead_steps = 1;
  check_names(sync.validate(), "max_ahead_steps");
  sync.max_ahead_steps = std::nullopt;
  check_names(sync.validate(), "max_ahead_steps");
  // Any other schedule may be bounded or not.
  ScheduleSpec stream = ScheduleSpec::defaults(ScheduleKind::kStreamGlobal);
  stream.max_ahead_steps = std::nullopt;
  CHECK(stream.validate().ok());
  stream.max_ahead_steps = 0;
  CHECK(stream.validate().ok());
}

TEST_CASE("sim config: the paper's math setting") {
  SimConfig c = SimConfig::paper_math();
  REQUIRE(c.validate().ok());
  CHECK(c.cluster.gpus == 1024);
  CHECK(c.steps == 100);
  CHECK(c.workload.prompts_per_step == 512);
  CHECK(c.workload.samples_per_prompt == 16);
  CHECK(c.workload.response_length.max_tokens == 16384);
  CHECK(c.cost.gpu.hbm_bytes == GpuSpec::preset("h100")->hbm_bytes);
  CHECK(c.cost.model.name == "qwen2.5-7b");
  CHECK(c.cost.model.params == ModelSpec::preset("qwen2.5-7b")->params);
}

TEST_CASE("sim config: validation names each bad field") {
  const std::vector<std::pair<std::string, std::function<void(SimConfig&)>>> cases = {
      {"workload.prompts_per_step", [](SimConfig& c) { c.workload.prompts_per_step = 0; }},
      {"workload.group_correlation", [](SimConfig& c) { c.workload.group_correlation = 1; }},
      {"cost.gpu.hbm_bytes", [](SimConfig& c) { c.cost.gpu.hbm_bytes = 0; }},
      {"cost.rollout.tensor_parallel", [](SimConfig& c) { c.cost.rollout.tensor_parallel = 3; }},
      // 72B weights on one 80 GB GPU leave no room for KV: CostModel::create refuses it.
      {"cost.rollout.tensor_parallel", [](SimConfig& c) { c.cost.model = *ModelSpec::preset("qwen2.5-72b"); }},
      {"cluster.gpus", [](SimConfig& c) { c.cluster.gpus = 0; }},
      {"cluster.trainer_gpus", [](SimConfig& c) { c.cluster.trainer_gpus = -1; }},
      {"cluster.max_batch", [](SimConfig& c) { c.cluster.max_batch = 0; }},
      {"steps", [](SimConfig& c) { c.steps = 0; }},
  };
  for (const auto& [field, spoil] : cases) {
    INFO(field);
    SimConfig c = SimConfig::paper_math();
    spoil(c);
    check_names(c.validate(), field);
  }
}

TEST_CASE("sim config: a cluster too small for a rollout instance and the trainer") {
  SimConfig c = SimConfig::paper_math();
  c.cost.rollout.tensor_parallel = 4;
  c.cluster.gpus = 5;
  c.cluster.trainer_gpus = 1;
  CHECK(c.validate().ok());  // one instance of 4 GPUs and one trainer GPU: the smallest that runs
  c.cluster.trainer_gpus = 2;
  check_names(c.validate(), "cluster.trainer_gpus");
  c.cluster.trainer_gpus = 5;
  check_names(c.validate(), "cluster.trainer_gpus");
  c.cluster.gpus = 4;
  c.cluster.trainer_gpus = 1;
  check_names(c.validate(), "cluster.trainer_gpus");

  // A quarter of 3 GPUs is no trainer GPU; a quarter of 8 is 2, leaving 6 for a TP 4 instance.
  c.cluster.trainer_gpus = 0;
  c.cluster.gpus = 3;
  c.cost.rollout.tensor_parallel = 1;
  check_names(c.validate(), "cluster.gpus");
  c.cluster.gpus = 8;
  c.cost.rollout.tensor_parallel = 4;
  CHECK(c.validate().ok());
  c.cost.rollout.tensor_parallel = 7;  // divides Qwen2.5-7B's 28 heads
  check_names(c.validate(), "cluster.trainer_gpus");
}

TEST_CASE("sim config: JSON fields override the paper's setting") {
  laminar::Result<SimConfig> empty = SimConfig::from_json("{}");
  REQUIRE(empty.ok());
  const SimConfig paper = SimConfig::paper_math();
  CHECK(empty->cluster.gpus == paper.cluster.gpus);
  CHECK(empty->steps == paper.steps);
  CHECK(empty->workload.prompts_per_step == paper.workload.prompts_per_step);
  CHECK(empty->cost.model.name == paper.cost.model.name);

  laminar::Result<SimConfig> r = SimConfig::from_json(R"({
    "workload": {"preset": "paper_math", "prompts_per_step": 64, "samples_per_prompt": 8},
    "cost": {"model": {"preset": "qwen2.5-32b"}, "rollout": {"tensor_parallel": 2}, "train": {"mfu": 0.4}},
    "cluster": {"gpus": 64, "trainer_gpus": 16, "max_batch": 128, "failures": true},
    "steps": 7, "seed": 42})");
  REQUIRE(r.ok());
  CHECK(r->workload.prompts_per_step == 64);
  CHECK(r->workload.samples_per_prompt == 8);
  CHECK(r->workload.response_length.max_tokens == paper.workload.response_length.max_tokens);
  CHECK(r->cost.model.name == "qwen2.5-32b");
  CHECK(r->cost.gpu.hbm_bytes == paper.cost.gpu.hbm_bytes);  // "gpu" left out: paper_math's H100
  CHECK(r->cost.rollout.tensor_parallel == 2);
  CHECK(r->cost.train.mfu == 0.4);
  CHECK(r->cost.rollout.hbm_efficiency == paper.cost.rollout.hbm_efficiency);
  CHECK(r->cluster.gpus == 64);
  CHECK(r->cluster.trainer_gpus == 16);
  CHECK(r->cluster.max_batch == 128);
  CHECK(r->cluster.failures);
  CHECK(r->steps == 7);
  CHECK(r->seed == 42);

  // An empty cost section is paper_math()'s cost model, field for field.
  laminar::Result<SimConfig> cost = SimConfig::from_json(R"({"cost": {}})");
  REQUIRE(cost.ok());
  CHECK(cost->cost.gpu.name == paper.cost.gpu.name);
  CHECK(cost->cost.gpu.network_bytes_per_s == paper.cost.gpu.network_bytes_per_s);
  CHECK(cost->cost.model.layers == paper.cost.model.layers);
  CHECK(cost->cost.rollout.page_tokens == paper.cost.rollout.page_tokens);
  CHECK(cost->cost.network.gpus_per_node == paper.cost.network.gpus_per_node);
  CHECK(cost->cost.failure.node_mtbf_s == paper.cost.failure.node_mtbf_s);
}

TEST_CASE("sim config: JSON errors name the field") {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"config", "[1, 2]"},
      {"simulator config", "{\"steps\": "},
      {"stepz", R"({"stepz": 3})"},
      {"steps", R"({"steps": 0})"},
      {"steps", R"({"steps": 1.5})"},
      {"seed", R"({"seed": -1})"},
      {"cluster", R"({"cluster": 4})"},
      {"cluster.gpus", R"({"cluster": {"gpus": 0}})"},
      {"cluster.gpus", R"({"cluster": {"gpus": "many"}})"},
      {"cluster.trainer_gpus", R"({"cluster": {"trainer_gpus": -2}})"},
      {"cluster.max_batch", R"({"cluster": {"max_batch": 0}})"},
      {"cluster.failures", R"({"cluster": {"failures": 1}})"},
      {"cluster.gpu", R"({"cluster": {"gpu": 8}})"},
      {"cluster.trainer_gpus", R"({"cluster": {"gpus": 8, "trainer_gpus": 8}})"},
      {"workload", R"({"workload": "paper_math"})"},
      {"workload.prompts_per_step", R"({"workload": {"preset": "paper_math", "prompts_per_step": 0}})"},
      {"workload.preset", R"({"workload": {"preset": "paper_maths"}})"},
      {"workload.prompt_length", R"({"workload": {"prompts_per_step": 4, "samples_per_prompt": 2}})"},
      {"workload.colour", R"({"workload": {"preset": "paper_math", "colour": 1}})"},
      {"cost", R"({"cost": []})"},
      {"cost.gpu.preset", R"({"cost": {"gpu": {"preset": "a100"}}})"},
      {"cost.rollout.tensor_parallel", R"({"cost": {"rollout": {"tensor_parallel": 0}}})"},
      {"cost.rollout.tensor_parallel", R"({"cost": {"rollout": {"tensor_parallel": 16}}})"},
      {"cost.train.mfu", R"({"cost": {"train": {"mfu": 2}}})"},
      {"cost.trian", R"({"cost": {"trian": {}}})"},
  };
  for (const auto& [field, text] : cases) {
    INFO(text);
    check_names(SimConfig::from_json(text), field);
  }
}
