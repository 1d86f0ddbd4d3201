#include "predict.h"

#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <random>
#include <vector>

using async_grpo::Pacing;
using async_grpo::PredictConfig;
using async_grpo::PredictGroup;
using laminar::StatusCode;

namespace {

double s(std::chrono::nanoseconds d) { return double(d.count()) / 1e9; }

const Pacing& pacing() {
  static const Pacing p = Pacing::create({}).value();
  return p;
}

// Groups of 8 whose lengths have the task's long tail: one length per prompt, log-normal.
std::vector<PredictGroup> long_tail(std::size_t n) {
  std::mt19937_64 rng(7);
  std::lognormal_distribution<double> length(std::log(4.0), 1.1);
  std::vector<PredictGroup> groups;
  for (std::size_t g = 0; g < n; ++g) {
    const auto l = std::int64_t(std::clamp(std::round(length(rng)), 1.0, 63.0));
    groups.push_back({.prompt_tokens = l + 2, .response_tokens = std::vector<std::int64_t>(8, l)});
  }
  return groups;
}

}  // namespace

TEST_CASE("predict: a sync step is the batch's prefill, its decode steps and the training step", "[predict]") {
  // One worker of 4 slots, one group of 2 a step: a prompt of 3 tokens, responses of 2 and 3.
  const std::vector<PredictGroup> groups = {{.prompt_tokens = 3, .response_tokens = {2, 3}}};
  PredictConfig c{.schedule = "sync", .workers = 1, .slots = 4, .group_size = 2, .groups_per_step = 1,
                  .train_step_s = 0.05, .steps = 3};
  // Prefill samples each first token; then both decode (contexts 4 + 1 each); then the longer one.
  const double generation = s(pacing().prefill(6)) + s(pacing().decode(2, 10)) + s(pacing().decode(1, 6));
  auto p = async_grpo::predict(c, pacing(), groups);
  REQUIRE(p.ok());
  CHECK(p->time_s == Approx(3 * (generation + 0.05)));
  CHECK(p->trained_samples == 6);
  CHECK(p->samples_per_s == Approx(6 / p->time_s));
  CHECK(p->actor_waiting_share == Approx(generation / (generation + 0.05)));
  CHECK(p->generation_utilisation == Approx(generation / (generation + 0.05)));

  // One step ahead: the next batch is generated while the actor trains, so a step costs the
  // longer of the two.
  c.schedule = "one-step";
  auto ahead = async_grpo::predict(c, pacing(), groups);
  REQUIRE(ahead.ok());
  CHECK(ahead->time_s == Approx(generation + 2 * std::max(generation, 0.05) + 0.05));
  // The next batch opens once the actor has re-scored the one it took.
  c.score_s = 0.02;
  auto scored = async_grpo::predict(c, pacing(), groups);
  REQUIRE(scored.ok());
  CHECK(scored->time_s == Approx(generation + 2 * std::max(generation + 0.02, 0.05) + 0.05));
}

TEST_CASE("predict: with a long tail the streams train more samples a second than sync", "[predict]") {
  const std::vector<PredictGroup> groups = long_tail(4000);
  PredictConfig c{.workers = 3, .slots = 16, .group_size = 8, .groups_per_step = 8, .train_step_s = 0.065,
                  .steps = 60};
  auto rate = [&](const char* schedule) {
    c.schedule = schedule;
    auto p = async_grpo::predict(c, pacing(), groups);
    REQUIRE(p.ok());
    INFO(schedule << ": " << p->samples_per_s << " samples/s, actor waiting " << p->actor_waiting_share);
    CHECK(p->trained_samples == 60 * 64);
    CHECK(p->actor_waiting_share > 0);
    CHECK(p->actor_waiting_share < 1);
    return p->samples_per_s;
  };
  const double sync = rate("sync");
  const double one_step = rate("one-step");
  const double laminar = rate("laminar");
  const double areal = rate("areal");
  CHECK(one_step > sync);
  CHECK(laminar > 1.5 * sync);
  CHECK(areal > 1.5 * sync);
  // The same inputs give the same prediction.
  CHECK(rate("laminar") == laminar);
}

TEST_CASE("predict: bad configurations are refused, naming the field", "[predict][bad-input]") {
  const std::vector<PredictGroup> groups = {{.prompt_tokens = 3, .response_tokens = {2, 3}}};
  auto refused = [&](PredictConfig c, std::vector<PredictGroup> g, const char* what) {
    auto p = async_grpo::predict(c, pacing(), g);
    REQUIRE(!p.ok());
    CHECK(p.status().code() == StatusCode::kInvalidArgument);
    INFO(p.status().message());
    CHECK(p.status().message().find(what) != std::string::npos);
  };
  const PredictConfig ok{.group_size = 2, .groups_per_step = 1};
  PredictConfig c = ok;
  c.schedule = "async";
  refused(c, groups, "unknown schedule 'async'");
  c = ok;
  c.workers = 0;
  refused(c, groups, "at least 1");
  c = ok;
  c.max_staleness = -1;
  refused(c, groups, "max_staleness -1");
  c = ok;
  c.in_flight_batches = 0.1;
  refused(c, groups, "below one group");
  c = ok;
  c.train_step_s = 0;
  refused(c, groups, "train_step_s");
  c = ok;
  c.score_s = ok.train_step_s * 2;
  refused(c, groups, "score_s");
  refused(ok, {}, "no groups");
  refused(ok, {{.prompt_tokens = 3, .response_tokens = {2}}}, "group 0 has 1 samples");
  refused(ok, {{.prompt_tokens = 3, .response_tokens = {2, 0}}}, "below 1 token");
}
