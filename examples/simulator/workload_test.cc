// The simulator's workload: determinism, the configured distributions, tool calls, JSON checks.
#include "workload.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <unistd.h>

namespace {

using laminar::StatusCode;
using namespace laminar::sim;

// Sorted response lengths of one step.
std::vector<double> response_lengths(const StepWorkload& s) {
  std::vector<double> v;
  for (const PromptGroup& g : s.groups) {
    for (const SampleSpec& x : g.samples) v.push_back(static_cast<double>(x.response_tokens));
  }
  std::sort(v.begin(), v.end());
  return v;
}

double quantile(const std::vector<double>& sorted, double q) {
  return sorted[static_cast<std::size_t>(q * static_cast<double>(sorted.size() - 1))];
}

std::vector<double> draws(const Distribution& d, int n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> v;
  for (int i = 0; i < n; ++i) v.push_back(d.draw(rng));
  std::sort(v.begin(), v.end());
  return v;
}

// 6,250 prompts x 16 samples = 100k independent response lengths from `dist`, uncapped in practice.
WorkloadConfig hundred_thousand(Distribution dist) {
  WorkloadConfig c;
  c.seed = 7;
  c.prompts_per_step = 6250;
  c.samples_per_prompt = 16;
  c.prompt_length = {*Distribution::constant(100), 1000};
  c.response_length = {std::move(dist), 1'000'000};
  return c;
}

bool same(const StepWorkload& a, const StepWorkload& b) {
  if (a.groups.size() != b.groups.size()) return false;
  for (std::size_t i = 0; i < a.groups.size(); ++i) {
    const PromptGroup& x = a.groups[i];
    const PromptGroup& y = b.groups[i];
    if (x.prompt_tokens != y.prompt_tokens || x.samples.size() != y.samples.size()) return false;
    for (std::size_t j = 0; j < x.samples.size(); ++j) {
      const SampleSpec& p = x.samples[j];
      const SampleSpec& q = y.samples[j];
      if (p.response_tokens != q.response_tokens || p.turns.size() != q.turns.size()) return false;
      for (std::size_t t = 0; t < p.turns.size(); ++t) {
        if (p.turns[t].generate_tokens != q.turns[t].generate_tokens ||
            p.turns[t].env_latency != q.turns[t].env_latency ||
            p.turns[t].observation_tokens != q.turns[t].observation_tokens) {
          return false;
        }
      }
    }
  }
  return true;
}

}  // namespace

TEST_CASE("sim workload: the same seed gives the same lengths, in any step order") {
  WorkloadConfig c = WorkloadConfig::paper_math();
  c.tool_calls = {0.5, 3, *Distribution::log_normal(2.0, 0.5), *Distribution::constant(40)};
  Workload a = *Workload::create(c);
  Workload b = *Workload::create(c);
  StepWorkload b0 = *b.step(0);  // b asks for step 0 first; a does not
  StepWorkload a3 = *a.step(3);
  StepWorkload b3 = *b.step(3);
  REQUIRE(a3.groups.size() == 512);
  REQUIRE(a3.groups[0].samples.size() == 16);
  CHECK(same(a3, b3));
  CHECK_FALSE(same(a3, b0));  // steps differ from each other

  c.seed += 1;
  Workload other = *Workload::create(c);
  CHECK_FALSE(same(a3, *other.step(3)));
  CHECK(a.step(-1).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("sim workload: log-normal median and p99 match the configured ones over 100k samples") {
  // p99 = median * exp(sigma * z_0.99) = 1500 * exp(0.9898 * 2.3263) = 15000.
  const double sigma = std::log(10.0) / 2.3263478740408408;
  Workload w = *Workload::create(hundred_thousand(*Distribution::log_normal(1500, sigma)));
  std::vector<double> v = response_lengths(*w.step(0));
  REQUIRE(v.size() == 100'000);
  // Sample-quantile standard errors at n = 100k: ~0.4% at the median, ~1.2% at p99.
  CHECK(quantile(v, 0.5) == Approx(1500).epsilon(0.02));
  CHECK(quantile(v, 0.99) == Approx(15000).epsilon(0.05));

  // From a mean: median = mean * exp(-sigma^2 / 2) = 1000 * exp(-0.5) = 606.53.
  Distribution from_mean = *Distribution::log_normal_from_mean(1000, 1.0);
  CHECK(from_mean.median() == Approx(606.5307).epsilon(1e-6));
  std::vector<double> m = draws(from_mean, 100'000, 11);
  double mean = 0;
  for (double x : m) mean += x / static_cast<double>(m.size());
  CHECK(mean == Approx(1000).epsilon(0.03));  // sd/mean = sqrt(e - 1) = 1.31: stderr 0.4%
}

TEST_CASE("sim workload: the paper preset has p99 about 10x the median and the 16k cap") {
  Workload w = *Workload::create(WorkloadConfig::paper_math());
  std::vector<double> v;
  for (int step = 0; step < 12; ++step) {  // 12 x 8192 = 98k samples
    std::vector<double> s = response_lengths(*w.step(step));
    v.insert(v.end(), s.begin(), s.end());
  }
  std::sort(v.begin(), v.end());
  // Correlated within groups (rho 0.5 over 16 samples): ~8x fewer effective samples, so wider bounds.
  CHECK(quantile(v, 0.5) == Approx(1500).epsilon(0.05));
  CHECK(quantile(v, 0.99) / quantile(v, 0.5) == Approx(10).epsilon(0.15));
  CHECK(v.back() == 16384);  // P(X > 16384) = 0.8%: the cap is hit
}

TEST_CASE("sim workload: pareto, mixture and observed distributions sample as configured") {
  // Pareto scale 100, alpha 2: median = 100 * 2^(1/2) = 141.42, p99 = 100 * 0.01^(-1/2) = 1000.
  Distribution p = *Distribution::pareto(100, 2);
  std::vector<double> v = draws(p, 100'000, 3);
  CHECK(p.median() == Approx(141.42136));
  CHECK(quantile(v, 0.5) == Approx(141.42136).epsilon(0.02));
  CHECK(quantile(v, 0.99) == Approx(1000).epsilon(0.05));
  CHECK(v.front() >= 100);

  // 3:1 weights: 75% of draws are 100. Standard error sqrt(0.75 * 0.25 / 1e5) = 0.14%.
  Distribution mix = *Distribution::mixture({{3, *Distribution::constant(100)}, {1, *Distribution::constant(1000)}});
  std::vector<double> m = draws(mix, 100'000, 5);
  double share = static_cast<double>(std::count(m.begin(), m.end(), 100.0)) / 100'000;
  CHECK(share == Approx(0.75).margin(0.01));
  CHECK(std::count(m.begin(), m.end(), 1000.0) + std::count(m.begin(), m.end(), 100.0) == 100'000);

  // Nested: 1/2 of 10, then 1/4 each of 20 and 30.
  Distribution inner = *Distribution::mixture({{1, *Distribution::constant(20)}, {1, *Distribution::constant(30)}});
  Distribution nested = *Distribution::mixture({{1, *Distribution::constant(10)}, {1, inner}});
  std::vector<double> n = draws(nested, 100'000, 6);
  CHECK(static_cast<double>(std::count(n.begin(), n.end(), 30.0)) / 1e5 == Approx(0.25).margin(0.01));

  // Observed 1..100: every draw is one of them, and the median is near 50.
  std::vector<double> values;
  for (int i = 1; i <= 100; ++i) values.push_back(i);
  Distribution o = *Distribution::observed(values);
  std::vector<double> ov = draws(o, 100'000, 9);
  CHECK(ov.front() == 1);
  CHECK(ov.back() == 100);
  CHECK(quantile(ov, 0.5) == Approx(50.5).margin(1.5));
}

TEST_CASE("sim workload: observed lengths load from a file") {
  std::filesystem::path file =
      std::filesystem::temp_directory_path() / ("sim_workload_lengths_" + std::to_string(::getpid()) + ".txt");
  {
    std::ofstream out(file);
    out << "300 300 300\n900\n";
  }
  std::string json = R"({"kind": "observed", "file": ")" + file.string() + R"("})";
  laminar::Result<Distribution> d = Distribution::from_json(json, "response_length");
  std::filesystem::remove(file);
  REQUIRE(d.ok());
  std::vector<double> v = draws(*d, 40'000, 2);
  CHECK(static_cast<double>(std::count(v.begin(), v.end(), 900.0)) / 40'000 == Approx(0.25).margin(0.01));

  laminar::Result<Distribution> gone = Distribution::from_json(json, "response_length");
  CHECK(gone.status().code() == StatusCode::kInvalidArgument);
  CHECK(gone.status().message().find("response_length.file: cannot open") != std::string::npos);
}

TEST_CASE("sim workload: group correlation shares a per-prompt factor") {
  // Share of the log-length variance left within a group: 1 - rho for a Gaussian copula over a
  // log-normal (the log is linear in z).
  for (double rho : {0.0, 0.5, 0.9}) {
    WorkloadConfig c = hundred_thousand(*Distribution::log_normal(1000, 1.0));
    c.prompts_per_step = 2000;
    c.group_correlation = rho;
    StepWorkload s = *Workload::create(c)->step(0);
    double within = 0, total = 0, all_mean = 0;
    std::vector<double> logs;
    for (const PromptGroup& g : s.groups) {
      double mean = 0;
      for (const SampleSpec& x : g.samples) mean += std::log(static_cast<double>(x.response_tokens)) / 16;
      for (const SampleSpec& x : g.samples) {
        double l = std::log(static_cast<double>(x.response_tokens));
        within += (l - mean) * (l - mean) / 15;  // unbiased within-group variance
        logs.push_back(l);
        all_mean += l;
      }
    }
    all_mean /= static_cast<double>(logs.size());
    for (double l : logs) total += (l - all_mean) * (l - all_mean);
    within /= static_cast<double>(s.groups.size());
    total /= static_cast<double>(logs.size() - 1);
    INFO("rho " << rho << " within/total " << within / total);
    CHECK(within / total == Approx(1 - rho).margin(0.05));
  }
}

TEST_CASE("sim workload: tool calls split the response and carry the environment's latency") {
  WorkloadConfig c = WorkloadConfig::paper_math();
  c.prompts_per_step = 64;
  c.tool_calls = {1.0, 3, *Distribution::constant(2.5), *Distribution::constant(40)};
  StepWorkload s = *Workload::create(c)->step(1);
  for (const PromptGroup& g : s.groups) {
    for (const SampleSpec& x : g.samples) {
      REQUIRE(x.turns.size() == 4);  // every call happens at probability 1, up to max_calls
      std::int64_t sum = 0;
      for (std::size_t t = 0; t < x.turns.size(); ++t) {
        sum += x.turns[t].generate_tokens;
        CHECK(x.turns[t].generate_tokens >= 1);
        bool last = t + 1 == x.turns.size();
        CHECK(x.turns[t].env_latency == (last ? laminar::Duration(0) : laminar::Duration(2'500'000'000)));
        CHECK(x.turns[t].observation_tokens == (last ? 0 : 40));
      }
      CHECK(sum == x.response_tokens);
    }
  }

  // Geometric calls at probability 0.5, capped at 10: mean = sum_{k=1..10} 0.5^k = 0.99902.
  c.prompts_per_step = 2000;
  c.tool_calls.call_probability = 0.5;
  c.tool_calls.max_calls = 10;
  StepWorkload g = *Workload::create(c)->step(0);
  double calls = 0;
  for (const PromptGroup& pg : g.groups) {
    for (const SampleSpec& x : pg.samples) calls += static_cast<double>(x.turns.size() - 1);
  }
  CHECK(calls / 32'000 == Approx(0.99902).margin(0.03));
}

TEST_CASE("sim workload: presets load from JSON and fields override them") {
  laminar::Result<WorkloadConfig> p = WorkloadConfig::from_json(R"({"preset": "paper_math"})");
  REQUIRE(p.ok());
  CHECK(p->prompts_per_step == 512);
  CHECK(p->samples_per_prompt == 16);
  CHECK(p->response_length.max_tokens == 16384);
  CHECK(same(*Workload::create(*p)->step(2), *Workload::create(WorkloadConfig::paper_math())->step(2)));

  laminar::Result<WorkloadConfig> o = WorkloadConfig::from_json(
      R"({"preset": "paper_math", "prompts_per_step": 8, "seed": 99,
          "response_length": {"kind": "pareto", "scale": 200, "alpha": 1.5, "max": 4096},
          "tool_calls": {"call_probability": 0.3, "max_calls": 2,
                         "env_latency_s": {"kind": "lognormal", "mean": 1.5, "sigma": 0.4},
                         "observation_tokens": {"kind": "constant", "value": 64}}})");
  REQUIRE(o.ok());
  CHECK(o->prompts_per_step == 8);
  CHECK(o->samples_per_prompt == 16);
  CHECK(o->seed == 99);
  CHECK(o->response_length.max_tokens == 4096);
  CHECK(o->response_length.distribution.kind() == Distribution::Kind::kPareto);
  CHECK(o->tool_calls.max_calls == 2);

  laminar::Result<WorkloadConfig> full = WorkloadConfig::from_json(
      R"({"seed": 3, "prompts_per_step": 4, "samples_per_prompt": 2,
          "prompt_length": {"kind": "constant", "value": 10, "max": 10},
          "response_length": {"kind": "mixture", "max": 100, "components": [
              {"weight": 1, "kind": "constant", "value": 5},
              {"weight": 1, "kind": "observed", "values": [7, 8]}]}})");
  REQUIRE(full.ok());
  CHECK(full->group_correlation == 0);
  CHECK(full->tool_calls.max_calls == 0);
}

TEST_CASE("sim workload: JSON validation names the bad field") {
  const std::string base = R"("prompt_length": {"kind": "constant", "value": 10, "max": 10})";
  struct Case {
    std::string json;
    std::string field;
  };
  const std::vector<Case> cases = {
      {"not json", "workload: not valid JSON"},
      {"[1]", "config: must be a JSON object"},
      {R"({"samples_per_prompt": 2})", "prompts_per_step: required field is missing"},
      {R"({"preset": "paper_math", "prompts_per_step": 0})", "prompts_per_step: must be >= 1, got 0"},
      {R"({"preset": "paper_math", "samples_per_prompt": "16"})", "samples_per_prompt: must be an integer"},
      {R"({"preset": "paper_math", "seed": -1})", "seed: must be >= 0"},
      {R"({"preset": "paper_math", "respons_length": {}})", "respons_length: unknown field"},
      {R"({"preset": "paper_math", "group_correlation": 1.0})", "group_correlation: must be in [0, 1)"},
      {R"({"preset": "paper_math", "group_correlation": 1.5})", "group_correlation: must be in [0, 1], got 1.5"},
      {R"({"preset": "math"})", "preset: unknown workload preset 'math'"},
      {R"({"preset": "paper_math", "response_length": {"kind": "lognormal", "median": 10, "sigma": -1, "max": 9}})",
       "response_length.sigma: must be > 0, got -1"},
      {R"({"preset": "paper_math", "response_length": {"kind": "lognormal", "median": 10, "sigma": 1}})",
       "response_length.max: required field is missing"},
      {R"({"preset": "paper_math", "response_length": {"kind": "lognormal", "median": 10, "mean": 5, "sigma": 1, "max": 9}})",
       "response_length: give exactly one of median and mean"},
      {R"({"preset": "paper_math", "response_length": {"kind": "gamma", "max": 9}})",
       "response_length.kind: unknown kind 'gamma'"},
      {R"({"preset": "paper_math", "response_length": {"kind": "pareto", "scale": 1, "alpha": 2, "max": 0}})",
       "response_length.max: must be >= 1, got 0"},
      {R"({"preset": "paper_math", "response_length": {"kind": "mixture", "max": 9, "components": [{"weight": 0, "kind": "constant", "value": 1}]}})",
       "response_length.components[0].weight: must be > 0, got 0"},
      {R"({"preset": "paper_math", "response_length": {"kind": "mixture", "max": 9, "components": [{"weight": 1, "kind": "constant", "value": 1, "shape": 2}]}})",
       "response_length.components[0].shape: unknown field"},
      {R"({"preset": "paper_math", "response_length": {"kind": "observed", "values": [], "max": 9}})",
       "response_length: observed: needs at least one value"},
      {R"({"preset": "paper_math", "prompt_length": {"kind": "observed", "values": [1, "x"], "max": 9}})",
       "prompt_length.values[1]: must be a number"},
      {R"({"preset": "paper_math", "tool_calls": {"call_probability": 1.5, "max_calls": 1}})",
       "tool_calls.call_probability: must be in [0, 1], got 1.5"},
      {R"({"preset": "paper_math", "tool_calls": {"call_probability": 0.5, "max_calls": 1,
           "observation_tokens": {"kind": "constant", "value": 1}}})",
       "tool_calls.env_latency_s: required field is missing"},
      {R"({"prompts_per_step": 1, "samples_per_prompt": 1, )" + base + "}",
       "response_length: required field is missing"},
  };
  for (const Case& c : cases) {
    laminar::Result<WorkloadConfig> r = WorkloadConfig::from_json(c.json);
    INFO(c.json << "\n -> " << r.status().to_string());
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kInvalidArgument);
    CHECK(r.status().message().find(c.field) != std::string::npos);
  }

  WorkloadConfig bad = WorkloadConfig::paper_math();
  bad.samples_per_prompt = 0;
  CHECK(Workload::create(bad).status().code() == StatusCode::kInvalidArgument);
  CHECK(Distribution::log_normal(0, 1).status().code() == StatusCode::kInvalidArgument);
  CHECK(Distribution::pareto(1, -2).status().code() == StatusCode::kInvalidArgument);
  CHECK(Distribution::constant(std::nan("")).status().code() == StatusCode::kInvalidArgument);
}
