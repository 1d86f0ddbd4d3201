// The asynchronous GRPO run's reporting (examples/async_grpo/records.h, report.h): records through
// real files, the table's numbers from hand-made records, the trace JSON, gnuplot's PNGs and the
// progress lines under a ManualClock.
#include "report.h"
#include "temp_dir.h"

#include <stdlib.h>

#include <algorithm>
#include <array>
#include <optional>
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

using async_grpo::Progress;
using async_grpo::Record;
using async_grpo::Records;
using async_grpo::RecordWriter;
using async_grpo::RepackEvent;
using async_grpo::RewardPoint;
using async_grpo::ScheduleRun;
using async_grpo::Span;
using async_grpo::SpanKind;
using async_grpo::TrajectoryFact;
using async_grpo::WeightSync;
using laminar::StatusCode;

namespace {

constexpr std::int64_t kS = 1'000'000'000;  // ns per second

using laminar::testing::read_all;
using laminar::testing::TempDir;

void write_all(const std::filesystem::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
}

Span span(std::string process, std::uint32_t worker, SpanKind kind, std::int64_t start_ns, std::int64_t end_ns) {
  return Span{.process = std::move(process), .worker = worker, .kind = kind, .start_ns = start_ns, .end_ns = end_ns};
}

Records random_records(std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int64_t> time(0, 1'000'000 * kS);
  std::uniform_int_distribution<std::uint64_t> small(0, 1000);
  std::uniform_int_distribution<int> kind(0, async_grpo::kNumSpanKinds - 1);
  Records r;
  for (int i = 0; i < 50; ++i) {
    std::int64_t a = time(rng), b = a + time(rng);
    Span s = span("rollout-" + std::to_string(small(rng)), static_cast<std::uint32_t>(small(rng)),
                  static_cast<SpanKind>(kind(rng)), a, b);
    s.version = small(rng);
    s.sequences = small(rng);
    s.bytes = rng();  // the full 64-bit range
    s.tokens = small(rng);
    r.add(s);
    std::uint64_t behaviour = small(rng);
    r.add(TrajectoryFact{.behaviour_version = behaviour, .trained_version = behaviour + small(rng) % 5,
                         .length = 1 + small(rng), .group = rng()});
    // Rewards that need every digit of a double to come back equal.
    r.add(RewardPoint{.time_ns = time(rng), .version = small(rng),
                      .mean_reward = std::uniform_real_distribution<double>(-1, 1)(rng), .samples = 1 + small(rng)});
    r.add(RepackEvent{.time_ns = time(rng), .moved_sequences = small(rng), .bytes = small(rng)});
    r.add(WeightSync{.process = "rollout-" + std::to_string(small(rng) % 4), .version = small(rng),
                     .start_ns = a, .end_ns = b});
  }
  return r;
}

// A record file with one good span, then `bad` as its second line.
laminar::Status parse_with_second_line(const std::string& bad) {
  std::string good = async_grpo::encode_record(span("actor", 0, SpanKind::kTrain, 1, 2)).value();
  return async_grpo::parse_records(good + "\n" + bad + "\n" + good + "\n", "f.jsonl").status();
}

}  // namespace

TEST_CASE("grpo report: records round-trip through a file") {
  const std::uint64_t seed = std::random_device{}();
  INFO("seed " << seed);
  std::cout << "grpo report round-trip seed " << seed << "\n";
  std::mt19937_64 rng(seed);
  const Records written = random_records(rng);

  TempDir dir("grpo_report");
  const auto path = dir.path() / "rollout.jsonl";
  {
    RecordWriter w = RecordWriter::open(path).value();
    // Interleaved as a process writes them; read_records sorts them back by type in file order.
    for (std::size_t i = 0; i < written.spans.size(); ++i) {
      REQUIRE(w.write(written.spans[i]).ok());
      REQUIRE(w.write(written.trajectories[i]).ok());
      REQUIRE(w.write(written.rewards[i]).ok());
      REQUIRE(w.write(written.repacks[i]).ok());
      REQUIRE(w.write(written.syncs[i]).ok());
    }
  }
  laminar::Result<Records> back = async_grpo::read_records(path);
  REQUIRE(back.ok());
  CHECK(*back == written);

  // Two processes' files, and a file of another kind, in one directory: the run is both files.
  std::filesystem::copy_file(path, dir.path() / "actor.jsonl");
  write_all(dir.path() / "notes.txt", "not records\n");
  laminar::Result<Records> both = async_grpo::read_record_dir(dir.path());
  REQUIRE(both.ok());
  Records expected = written;
  expected.append(written);
  CHECK(*both == expected);
  CHECK(async_grpo::read_record_dir(dir.path() / "absent").status().code() == StatusCode::kNotFound);
  write_all(dir.path() / "broken.jsonl", "{}\n");
  laminar::Status st = async_grpo::read_record_dir(dir.path()).status();
  CHECK(st.message().find("broken.jsonl line 1") != std::string::npos);

  for (int k = 0; k < async_grpo::kNumSpanKinds; ++k) {
    auto kind = static_cast<SpanKind>(k);
    CHECK(async_grpo::parse_span_kind(async_grpo::span_kind_name(kind)).value() == kind);
  }
}

TEST_CASE("grpo report: the actor's waits are its own idle spans, from the first one's start") {
  Records r;
  CHECK(actor_waits(r).by_end_ns.empty());
  CHECK(actor_waits(r).total_ns == 0);
  r.spans.push_back(span("actor", 0, SpanKind::kIdleWait, 500, 800));
  r.spans.push_back(span("actor", 0, SpanKind::kTrain, 800, 900));
  r.spans.push_back(span("rollout-0", 0, SpanKind::kIdleWait, 100, 2000));
  r.spans.push_back(span("actor", 0, SpanKind::kIdleWait, 200, 300));
  const async_grpo::ActorWaits w = actor_waits(r);
  CHECK(w.first_start_ns == 200);
  CHECK(w.total_ns == 400);
  CHECK(w.by_end_ns == std::map<std::int64_t, std::int64_t>{{300, 100}, {800, 300}});
}

TEST_CASE("grpo report: a truncated or corrupt record file is refused, naming the line") {
  TempDir dir("grpo_report");
  const auto path = dir.path() / "rollout.jsonl";
  {
    RecordWriter w = RecordWriter::open(path).value();
    for (int i = 0; i < 3; ++i) REQUIRE(w.write(span("rollout-1", 0, SpanKind::kDecode, i * kS, (i + 1) * kS)).ok());
    // An invalid record is refused and nothing is written.
    laminar::Status st = w.write(span("rollout-1", 0, SpanKind::kDecode, 5 * kS, 4 * kS));
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message().find("end_ns") != std::string::npos);
    CHECK(w.write(span("bad name", 0, SpanKind::kDecode, 0, 1)).code() == StatusCode::kInvalidArgument);
  }
  const std::string text = read_all(path);
  REQUIRE(async_grpo::read_records(path).value().spans.size() == 3);

  SECTION("a process killed mid-line leaves a truncated last line") {
    write_all(path, text.substr(0, text.size() - 10));
    laminar::Status st = async_grpo::read_records(path).status();
    CHECK(st.code() == StatusCode::kDataLoss);
    CHECK(st.message().find(path.string() + " line 3") != std::string::npos);
  }
  SECTION("a corrupt line") {
    std::string corrupt = text;
    corrupt[text.find('\n') + 5] = '#';
    write_all(path, corrupt);
    laminar::Status st = async_grpo::read_records(path).status();
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message().find(path.string() + " line 2") != std::string::npos);
  }
  SECTION("a missing file") {
    CHECK(async_grpo::read_records(dir.path() / "absent.jsonl").status().code() == StatusCode::kNotFound);
  }
  SECTION("each way a line can be wrong names line 2 and the fault") {
    const std::vector<std::pair<std::string, std::string>> bad = {
        {"{\"type\":\"span\",\"process\":\"a\"", "not valid JSON"},
        {"[1,2]", "JSON object"},
        {"{\"kind\":\"decode\"}", "'type'"},
        {"{\"type\":\"spam\"}", "unknown record type 'spam'"},
        {R"({"type":"span","process":"a","worker":0,"kind":"sleep","start_ns":0,"end_ns":1,"version":0,)"
         R"("sequences":0,"bytes":0,"tokens":0})",
         "unknown span kind 'sleep'"},
        {R"({"type":"span","process":"a","worker":0,"kind":"decode","start_ns":0,"end_ns":1,"version":0,)"
         R"("sequences":0,"bytes":0})",
         "missing field 'tokens'"},
        {R"({"type":"span","process":"a","worker":-1,"kind":"decode","start_ns":0,"end_ns":1,"version":0,)"
         R"("sequences":0,"bytes":0,"tokens":0})",
         "field 'worker'"},
        {R"({"type":"span","process":"a","worker":4294967296,"kind":"decode","start_ns":0,"end_ns":1,)"
         R"("version":0,"sequences":0,"bytes":0,"tokens":0})",
         "field 'worker'"},
        {R"({"type":"span","process":"a","worker":0,"kind":"decode","start_ns":0,"end_ns":1,"version":0,)"
         R"("sequences":0,"bytes":0,"tokens":0,"colour":"red"})",
         "unknown field 'colour'"},
        {R"({"type":"reward","time_ns":-5,"version":1,"mean_reward":0.5,"samples":8})", "negative"},
        {R"({"type":"reward","time_ns":5,"version":1,"mean_reward":"high","samples":8})", "'mean_reward'"},
        {R"({"type":"reward","time_ns":5,"version":1,"mean_reward":0.5,"samples":0})", "samples is 0"},
        {R"({"type":"trajectory","behaviour_version":4,"trained_version":3,"length":9,"group":1})", "before behaviour_version"},
        {R"({"type":"trajectory","behaviour_version":3,"trained_version":3,"length":0,"group":1})", "length is 0"},
        {R"({"type":"weight_sync","process":"r/1","version":1,"start_ns":0,"end_ns":1})", "'r/1'"},
        {R"({"type":"repack","time_ns":1.5,"moved_sequences":1,"bytes":1})", "field 'time_ns'"},
    };
    for (const auto& [line, fault] : bad) {
      INFO(line);
      laminar::Status st = parse_with_second_line(line);
      CHECK(st.code() == StatusCode::kInvalidArgument);
      CHECK(st.message().rfind("f.jsonl line 2: ", 0) == 0);
      CHECK(st.message().find(fault) != std::string::npos);
    }
  }
}

TEST_CASE("grpo report: the table's numbers come from the records") {
  const std::int64_t t0 = 50 * kS;  // the launcher's start: the epoch
  const double wall_s = 10;
  ScheduleRun run{.schedule = "laminar", .start_ns = t0, .end_ns = t0 + 10 * kS, .rollout_workers = 3};
  auto at = [&](double s) { return t0 + static_cast<std::int64_t>(std::llround(s * 1e9)); };

  // Generation spans: on rollout-1, decode [1, 3] and prefill [2.5, 4] overlap (3 s busy); on
  // rollout-2, a decode from before the start clipped to [0, 0.5] and one past the end clipped to [9, 10].
  // Pulls, migrations and the actor's training are not generation.
  auto& spans = run.records.spans;
  spans.push_back(span("rollout-1", 0, SpanKind::kDecode, at(1), at(3)));
  spans.push_back(span("rollout-1", 0, SpanKind::kPrefill, at(2.5), at(4)));
  spans.push_back(span("rollout-2", 0, SpanKind::kDecode, t0 - 2 * kS, at(0.5)));
  spans.push_back(span("rollout-2", 0, SpanKind::kDecode, at(9), at(12)));
  spans.push_back(span("rollout-2", 0, SpanKind::kPull, at(4), at(6)));
  spans.push_back(span("rollout-2", 0, SpanKind::kMigrateOut, at(6), at(7)));
  // Training steps of 10 s, 2 ms and 4 ms: the first after a wait of 0.5 s (10 ms a token), the
  // second after one of 50 ms (1 ms a token), the third with no tokens, so no cost per token. A
  // rollout's long wait is not the actor's.
  spans.push_back(span("actor", 0, SpanKind::kIdleWait, at(-0.5), at(0)));
  spans.push_back(span("actor", 0, SpanKind::kTrain, at(0), at(10)));
  spans.back().tokens = 1000;
  spans.push_back(span("rollout-1", 0, SpanKind::kIdleWait, at(5), at(10)));
  spans.push_back(span("actor", 0, SpanKind::kIdleWait, at(9.95), at(10)));
  spans.push_back(span("actor", 0, SpanKind::kTrain, at(10), at(10.002)));
  spans.back().tokens = 2;
  spans.push_back(span("actor", 0, SpanKind::kTrain, at(10), at(10.004)));
  const double busy_s = (4.0 - 1.0) + (0.5 - 0.0) + (10.0 - 9.0);

  // Staleness of each trajectory: trained_version - behaviour_version.
  const std::vector<std::uint64_t> staleness = {0, 0, 1, 0, 2, 1, 3, 7, 0, 1};
  std::array<std::uint64_t, 4> histogram{};
  std::uint64_t tokens = 0;
  for (std::size_t i = 0; i < staleness.size(); ++i) {
    const std::uint64_t length = 10 + 3 * i;
    run.records.trajectories.push_back({.behaviour_version = 5, .trained_version = 5 + staleness[i], .length = length});
    ++histogram[std::min<std::uint64_t>(staleness[i], 3)];
    tokens += length;
  }

  // Reward points out of time order; the final one is the latest in time.
  run.records.rewards = {{.time_ns = at(8), .version = 4, .mean_reward = 0.7, .samples = 8},
                         {.time_ns = at(2), .version = 1, .mean_reward = 0.1, .samples = 8},
                         {.time_ns = at(6), .version = 3, .mean_reward = 0.45, .samples = 8},
                         {.time_ns = at(4), .version = 2, .mean_reward = 0.5, .samples = 8}};

  run.records.repacks = {{.time_ns = at(3), .moved_sequences = 4, .bytes = 100},
                         {.time_ns = at(5), .moved_sequences = 2, .bytes = 50}};

  // Weight syncs of 1..n ms, shuffled.
  const std::uint64_t seed = std::random_device{}();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const int n = GENERATE(7, 100);
  std::vector<double> sync_ms;
  for (int i = 1; i <= n; ++i) sync_ms.push_back(i);
  std::shuffle(sync_ms.begin(), sync_ms.end(), rng);
  for (double ms : sync_ms) {
    run.records.syncs.push_back({.process = "rollout-1", .version = 1, .start_ns = at(1),
                                 .end_ns = at(1) + static_cast<std::int64_t>(ms * 1e6)});
  }
  auto nearest_rank = [&](double p) {
    std::vector<double> sorted = sync_ms;
    std::sort(sorted.begin(), sorted.end());
    return sorted[static_cast<std::size_t>(std::ceil(p / 100 * static_cast<double>(sorted.size()))) - 1];
  };

  auto m = async_grpo::compute_metrics(run, 0.5);
  REQUIRE(m.ok());
  CHECK(m->wall_s == Approx(wall_s));
  REQUIRE(m->time_to_target_s);
  CHECK(*m->time_to_target_s == Approx(4.0));  // the first point at or above 0.5, in time order
  CHECK(m->trained_samples == staleness.size());
  CHECK(m->trained_tokens == tokens);
  CHECK(m->samples_per_s == Approx(static_cast<double>(staleness.size()) / wall_s));
  CHECK(m->tokens_per_s == Approx(static_cast<double>(tokens) / wall_s));
  CHECK(m->generation_utilisation == Approx(busy_s / (3 * wall_s)));
  CHECK(m->staleness == histogram);
  CHECK(m->repacks == 2);
  CHECK(m->moved_sequences == 4 + 2);
  REQUIRE(m->weight_sync_p50_ms);
  CHECK(*m->weight_sync_p50_ms == Approx(nearest_rank(50)));
  CHECK(*m->weight_sync_p99_ms == Approx(nearest_rank(99)));
  REQUIRE(m->train_step_p50_ms);
  CHECK(*m->train_step_p50_ms == Approx(4.0));  // the median of 10 s, 2 ms and 4 ms
  // The loop: from the actor's first wait (-0.5 s) to its last reward (8 s), 0.55 s of it waiting.
  REQUIRE(m->loop_samples_per_s);
  CHECK(*m->loop_samples_per_s == Approx(static_cast<double>(staleness.size()) / 8.5));
  REQUIRE(m->actor_waiting_share);
  CHECK(*m->actor_waiting_share == Approx(0.55 / 8.5));
  ScheduleRun no_rewards = run;
  no_rewards.records.rewards.clear();  // no loop: against its 10.006 s of training
  CHECK(*async_grpo::compute_metrics(no_rewards, 0.5).value().actor_waiting_share == Approx(0.55 / (0.55 + 10.006)));
  CHECK(!m->predicted_samples_per_s);
  ScheduleRun predicted = run;
  predicted.predicted_samples_per_s = 1.25;
  predicted.predicted_waiting_share = 0.5;
  CHECK(async_grpo::compute_metrics(predicted, 0.5).value().predicted_samples_per_s == 1.25);
  CHECK(async_grpo::compute_metrics(predicted, 0.5).value().predicted_waiting_share == 0.5);
  REQUIRE(m->train_ms_per_token_ready_p50);
  CHECK(*m->train_ms_per_token_ready_p50 == Approx(1.0));
  REQUIRE(m->train_ms_per_token_after_wait_p50);
  CHECK(*m->train_ms_per_token_after_wait_p50 == Approx(10.0));
  REQUIRE(m->final_training_reward);
  CHECK(*m->final_training_reward == 0.7);
  CHECK(m->held_out_versions == 0);
  CHECK(!m->final_held_out);

  CHECK(!async_grpo::compute_metrics(run, 0.71).value().time_to_target_s);

  SECTION("invalid runs are refused, naming what is wrong") {
    ScheduleRun bad = run;
    bad.rollout_workers = 1;  // two workers decoded
    auto st = async_grpo::compute_metrics(bad, 0.5).status();
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message().find("2 workers") != std::string::npos);
    bad = run;
    bad.records.rewards.push_back({.time_ns = at(11), .version = 9, .mean_reward = 1, .samples = 1});
    CHECK(async_grpo::compute_metrics(bad, 0.5).status().message().find("outside the run") != std::string::npos);
    bad = run;
    bad.end_ns = bad.start_ns;
    CHECK(async_grpo::compute_metrics(bad, 0.5).status().code() == StatusCode::kInvalidArgument);
    bad = run;
    bad.schedule = "one step";
    CHECK(async_grpo::compute_metrics(bad, 0.5).status().code() == StatusCode::kInvalidArgument);
    bad = run;
    bad.records.trajectories.push_back({.behaviour_version = 2, .trained_version = 1, .length = 1});
    CHECK(async_grpo::compute_metrics(bad, 0.5).status().code() == StatusCode::kInvalidArgument);
    CHECK(async_grpo::compute_metrics(run, std::nan("")).status().code() == StatusCode::kInvalidArgument);
    CHECK(async_grpo::nearest_rank_percentile({}, 50).status().code() == StatusCode::kInvalidArgument);
    CHECK(async_grpo::nearest_rank_percentile({1.0}, 0).status().code() == StatusCode::kInvalidArgument);
  }

  SECTION("the comparison against sync: target, speedup, table and metrics JSON") {
    ScheduleRun sync{.schedule = "sync", .start_ns = 200 * kS, .end_ns = 230 * kS, .rollout_workers = 3};
    sync.records.rewards = {{.time_ns = 205 * kS, .version = 1, .mean_reward = 0.2, .samples = 8},
                            {.time_ns = 220 * kS, .version = 2, .mean_reward = 0.6, .samples = 8},
                            {.time_ns = 228 * kS, .version = 3, .mean_reward = 0.5, .samples = 8}};
    // No target given: sync's final reward, 0.5, which sync first reaches at 20 s and laminar at 4 s.
    auto c = async_grpo::compare({sync, run}, {});
    REQUIRE(c.ok());
    CHECK(c->target_reward == 0.5);
    REQUIRE(c->speedup);
    CHECK(*c->speedup == Approx((220.0 - 200.0) / 4.0));
    REQUIRE(c->schedules.size() == 2);
    CHECK(c->schedules[0].schedule == "sync");

    const std::string table = async_grpo::format_table(*c);
    INFO(table);
    std::vector<std::string> lines;
    std::istringstream in(table);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    // Header, rule, 24 rows, the speedup line, what the actor's waiting and the simulator's rows
    // mean, the pacing line; every line of the grid as wide as the rule.
    REQUIRE(lines.size() == 30);
    for (std::size_t i = 0; i < 26; ++i) CHECK(lines[i].size() == lines[1].size());
    CHECK(lines[0].find("sync") != std::string::npos);
    CHECK(lines[0].find("laminar") > lines[0].find("sync"));
    CHECK(table.find("time to training reward 0.500 (s)") != std::string::npos);
    CHECK(table.find(fmt::format("{:.1f}%", 100 * busy_s / (3 * wall_s))) != std::string::npos);
    CHECK(table.find("step ms/token p50, after a wait >= 0.2 s") != std::string::npos);
    CHECK(lines[26] == fmt::format("laminar reaches training reward 0.500 {:.2f}x as fast as sync (4.0 s against 20.0 s)",
                                   20.0 / 4.0));
    CHECK(lines[27].rfind("actor waiting for samples: ", 0) == 0);
    CHECK(lines[28].rfind("simulator: ", 0) == 0);
    CHECK(lines[29] == "rollout pacing: none");

    auto j = nlohmann::json::parse(async_grpo::metrics_json(*c));
    CHECK(j["target_reward"] == 0.5);
    CHECK(j["curve"] == "training");
    CHECK(j["speedup"].get<double>() == Approx(5.0));
    const auto& lam = j["schedules"][1];
    CHECK(lam["schedule"] == "laminar");
    CHECK(lam["time_to_target_s"].get<double>() == Approx(4.0));
    CHECK(lam["generation_utilisation"].get<double>() == Approx(busy_s / (3 * wall_s)));
    CHECK(lam["staleness"]["3+"] == histogram[3]);
    CHECK(lam["moved_sequences"] == 6);
    CHECK(lam["weight_sync_p99_ms"].get<double>() == Approx(nearest_rank(99)));
    CHECK(lam["train_ms_per_token_ready_p50"].get<double>() == Approx(1.0));
    CHECK(lam["train_ms_per_token_after_wait_p50"].get<double>() == Approx(10.0));
    CHECK(j["schedules"][0]["weight_sync_p50_ms"].is_null());  // sync recorded no syncs

    // A target only laminar reaches: no speedup, and the table says who fell short.
    auto far = async_grpo::compare({sync, run}, {.target_reward = 0.65});
    REQUIRE(far.ok());
    CHECK(!far->speedup);
    CHECK(async_grpo::format_table(*far).find("sync did not reach training reward 0.650") != std::string::npos);

    CHECK(async_grpo::compare({sync, sync}, {}).status().message().find("twice") != std::string::npos);
    CHECK(async_grpo::compare({run}, {}).status().code() == StatusCode::kInvalidArgument);  // no sync, no target
    CHECK(async_grpo::compare({}, {}).status().code() == StatusCode::kInvalidArgument);
  }
}

TEST_CASE("grpo report: held-out rewards are smoothed over versions and set the target") {
  using async_grpo::HeldOutPoint;
  SECTION("the moving average trails, in version order") {
    // Out of version order on purpose.
    std::vector<HeldOutPoint> points = {{.version = 3, .time_ns = 30, .reward = 0.6},
                                        {.version = 1, .time_ns = 10, .reward = 0.0},
                                        {.version = 4, .time_ns = 40, .reward = 0.9},
                                        {.version = 2, .time_ns = 20, .reward = 0.3}};
    auto s3 = async_grpo::smooth_held_out(points, 3);
    REQUIRE(s3.ok());
    REQUIRE(s3->size() == 2);
    CHECK((*s3)[0].version == 3);
    CHECK((*s3)[0].time_ns == 30);
    CHECK((*s3)[0].reward == Approx((0.0 + 0.3 + 0.6) / 3));
    CHECK((*s3)[1].version == 4);
    CHECK((*s3)[1].reward == Approx((0.3 + 0.6 + 0.9) / 3));
    auto s1 = async_grpo::smooth_held_out(points, 1);
    REQUIRE(s1.ok());
    REQUIRE(s1->size() == 4);
    CHECK((*s1)[1].reward == 0.3);
    // Fewer points than the window: their mean, at the last.
    auto s9 = async_grpo::smooth_held_out(points, 9);
    REQUIRE(s9.ok());
    REQUIRE(s9->size() == 1);
    CHECK((*s9)[0].version == 4);
    CHECK((*s9)[0].reward == Approx(1.8 / 4));
    CHECK(async_grpo::smooth_held_out({}, 3).value().empty());

    CHECK(async_grpo::smooth_held_out(points, 0).status().code() == StatusCode::kInvalidArgument);
    auto twice = points;
    twice.push_back({.version = 2, .time_ns = 50, .reward = 0.1});
    CHECK(async_grpo::smooth_held_out(twice, 3).status().message().find("version 2 appears twice") != std::string::npos);
    auto out_of_range = points;
    out_of_range[0].reward = 1.5;
    CHECK(async_grpo::smooth_held_out(out_of_range, 3).status().message().find("not in [0, 1]") != std::string::npos);
    out_of_range[0].reward = std::nan("");
    CHECK(async_grpo::smooth_held_out(out_of_range, 3).status().code() == StatusCode::kInvalidArgument);
  }

  SECTION("the comparison reads the held-out curve, not the training reward") {
    // sync: held-out 0.2, 0.3, 0.4, 0.5, 0.6 at 10..50 s; target = mean of its last three = 0.5,
    // which its moving average first reaches at version 5 (50 s).
    ScheduleRun sync{.schedule = "sync", .start_ns = 0, .end_ns = 60 * kS, .rollout_workers = 2};
    for (std::uint64_t v = 1; v <= 5; ++v) {
      sync.held_out.push_back({.version = v, .time_ns = std::int64_t(v) * 10 * kS, .reward = 0.1 + 0.1 * double(v)});
      // A training reward that would reach any target at once: the held-out curve must win.
      sync.records.rewards.push_back({.time_ns = std::int64_t(v) * 10 * kS, .version = v, .mean_reward = 0.9,
                                      .samples = 8});
    }
    // laminar: publishes every 4 s; its version 3 alone reaches 0.7, but the average of versions
    // 3..5 (0.7, 0.3, 0.5) is 0.5 only at version 5 (20 s).
    ScheduleRun laminar{.schedule = "laminar", .start_ns = 100 * kS, .end_ns = 140 * kS, .rollout_workers = 2};
    const std::vector<double> rewards = {0.2, 0.3, 0.7, 0.3, 0.5, 0.6};
    for (std::size_t i = 0; i < rewards.size(); ++i) {
      laminar.held_out.push_back({.version = i + 1, .time_ns = 100 * kS + std::int64_t(i + 1) * 4 * kS,
                                  .reward = rewards[i]});
    }
    auto c = async_grpo::compare({sync, laminar}, {.pacing = "qwen2.5-7b on h100"});
    REQUIRE(c.ok());
    CHECK(c->curve == async_grpo::RewardCurve::kHeldOut);
    CHECK(c->target_reward == Approx(0.5));
    REQUIRE(c->schedules[0].time_to_target_s);
    CHECK(*c->schedules[0].time_to_target_s == Approx(50.0));
    REQUIRE(c->schedules[1].time_to_target_s);
    CHECK(*c->schedules[1].time_to_target_s == Approx(20.0));
    REQUIRE(c->speedup);
    CHECK(*c->speedup == Approx(50.0 / 20.0));
    CHECK(c->schedules[1].first_held_out == 0.2);
    CHECK(*c->schedules[1].final_held_out == Approx((0.3 + 0.5 + 0.6) / 3));
    CHECK(c->schedules[1].held_out_versions == 6);
    CHECK(c->schedules[0].final_training_reward == 0.9);

    const std::string table = async_grpo::format_table(*c);
    INFO(table);
    CHECK(table.find("time to held-out reward 0.500 (s)") != std::string::npos);
    CHECK(table.find("laminar reaches held-out reward 0.500 2.50x as fast as sync (20.0 s against 50.0 s)") !=
          std::string::npos);
    CHECK(table.find("moving average over 3 versions") != std::string::npos);
    CHECK(table.find("\nrollout pacing: qwen2.5-7b on h100\n") != std::string::npos);
    CHECK(table.find("actor BLAS") == std::string::npos);  // neither run says
    auto j = nlohmann::json::parse(async_grpo::metrics_json(*c));
    CHECK(j["curve"] == "held_out");
    CHECK(j["pacing"] == "qwen2.5-7b on h100");
    CHECK(j["schedules"][1]["held_out_versions"] == 6);

    // The BLAS the actors trained on: one line when they agree, one per schedule when not.
    sync.actor_blas = laminar.actor_blas = "OpenBLAS 0.3.21, SkylakeX kernels, 1 thread (/x/libblas.so.3)";
    std::string with_blas = async_grpo::format_table(*async_grpo::compare({sync, laminar}, {}));
    CHECK(with_blas.find("\nactor BLAS: OpenBLAS 0.3.21, SkylakeX kernels, 1 thread (/x/libblas.so.3)\n") !=
          std::string::npos);
    laminar.actor_blas = "reference BLAS (netlib) (/x/blas/libblas.so.3)";
    with_blas = async_grpo::format_table(*async_grpo::compare({sync, laminar}, {}));
    CHECK(with_blas.find("actor BLAS (sync): OpenBLAS") != std::string::npos);
    CHECK(with_blas.find("actor BLAS (laminar): reference BLAS (netlib)") != std::string::npos);
    CHECK(nlohmann::json::parse(async_grpo::metrics_json(*async_grpo::compare({sync, laminar}, {})))["schedules"][1]
                                                                                                       ["actor_blas"] ==
          "reference BLAS (netlib) (/x/blas/libblas.so.3)");

    // One schedule against itself: its own final reward is the target, and there is no speedup.
    auto alone = async_grpo::compare({laminar}, {.baseline = "laminar", .contender = "laminar"});
    REQUIRE(alone.ok());
    CHECK_FALSE(alone->speedup);
    CHECK(async_grpo::format_table(*alone).find("one schedule: the target is laminar's own final held-out reward") !=
          std::string::npos);

    // A window of one: laminar's single lucky version 3 (12 s) counts.
    auto single = async_grpo::compare({sync, laminar}, {.smoothing = 1});
    REQUIRE(single.ok());
    CHECK(single->target_reward == Approx(0.6));
    CHECK(*single->schedules[1].time_to_target_s == Approx(12.0));

    // A contender without held-out points never reaches the target.
    ScheduleRun bare = laminar;
    bare.held_out.clear();
    auto none = async_grpo::compare({sync, bare}, {});
    REQUIRE(none.ok());
    CHECK(!none->schedules[1].time_to_target_s);
    CHECK(!none->speedup);
    // Held-out points, but none for the baseline to take the target from: refused.
    ScheduleRun bare_sync = sync;
    bare_sync.held_out.clear();
    CHECK(async_grpo::compare({bare_sync, laminar}, {}).status().message().find("held-out points") !=
          std::string::npos);

    ScheduleRun bad = laminar;
    bad.held_out.push_back({.version = 9, .time_ns = 150 * kS, .reward = 0.5});
    CHECK(async_grpo::compare({sync, bad}, {}).status().message().find("outside the run") != std::string::npos);
    bad = laminar;
    bad.held_out[2].reward = -0.1;
    CHECK(async_grpo::compare({sync, bad}, {}).status().message().find("not in [0, 1]") != std::string::npos);
    bad = laminar;
    bad.held_out[2].version = 1;
    CHECK(async_grpo::compare({sync, bad}, {}).status().message().find("appears twice") != std::string::npos);
    CHECK(async_grpo::compare({sync, laminar}, {.smoothing = 0}).status().code() == StatusCode::kInvalidArgument);
  }
}

TEST_CASE("grpo report: the trace holds every span as a complete event") {
  const std::int64_t t0 = 7 * kS;
  ScheduleRun run{.schedule = "laminar", .start_ns = t0, .end_ns = t0 + 5 * kS, .rollout_workers = 2};
  std::vector<Span> spans = {span("rollout-1", 0, SpanKind::kDecode, t0 + 1000, t0 + 501000),
                             span("rollout-1", 1, SpanKind::kPull, t0 + 2 * kS, t0 + 3 * kS),
                             span("rollout-2", 0, SpanKind::kMigrateIn, t0 + kS, t0 + kS + 2500),
                             span("rollout-2", 0, SpanKind::kMigrateOut, t0 + kS, t0 + kS + 2500),
                             span("actor", 0, SpanKind::kTrain, t0, t0 + 4 * kS)};
  spans[0].version = 3;
  spans[0].tokens = 640;
  spans[1].bytes = 123456789;
  spans[2].sequences = 4;
  run.records.spans = spans;

  auto text = async_grpo::trace_json(run);
  REQUIRE(text.ok());
  auto j = nlohmann::json::parse(*text);
  REQUIRE(j["traceEvents"].is_array());
  std::map<int, std::string> process_of_pid;
  std::vector<nlohmann::json> complete;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") process_of_pid[e["pid"]] = e["args"]["name"];
    if (e["ph"] == "X") complete.push_back(e);
  }
  CHECK(process_of_pid.size() == 3);
  REQUIRE(complete.size() == spans.size());
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const auto& e = complete[i];
    const Span& s = spans[i];
    CHECK(process_of_pid.at(e["pid"]) == s.process);
    CHECK(e["tid"] == s.worker);
    CHECK(e["name"] == std::string(async_grpo::span_kind_name(s.kind)));
    CHECK(e["ts"].get<double>() == Approx(static_cast<double>(s.start_ns - t0) / 1e3));
    CHECK(e["dur"].get<double>() == Approx(static_cast<double>(s.end_ns - s.start_ns) / 1e3));
    CHECK(e["args"]["version"] == s.version);
    CHECK(e["args"]["sequences"] == s.sequences);
    CHECK(e["args"]["bytes"] == s.bytes);
    CHECK(e["args"]["tokens"] == s.tokens);
  }
  // Both workers of rollout-1 are threads of one process.
  CHECK(complete[0]["pid"] == complete[1]["pid"]);
  CHECK(complete[0]["pid"] != complete[2]["pid"]);
}

TEST_CASE("grpo report: write_report writes the table, JSON and PNG plots") {
  std::vector<ScheduleRun> runs;
  for (const std::string name : {"sync", "one-step", "laminar"}) {
    const std::int64_t t0 = (100 + 100 * static_cast<std::int64_t>(runs.size())) * kS;
    ScheduleRun r{.schedule = name, .start_ns = t0, .end_ns = t0 + 40 * kS, .rollout_workers = 2};
    for (int v = 0; v < 8; ++v) {
      const std::int64_t at = t0 + (v + 1) * 4 * kS;
      r.records.rewards.push_back({.time_ns = at, .version = static_cast<std::uint64_t>(v),
                                   .mean_reward = 0.1 * v * (1 + static_cast<double>(runs.size()) / 4), .samples = 16});
      r.held_out.push_back({.version = static_cast<std::uint64_t>(v) + 1, .time_ns = at,
                            .reward = 0.05 * v * (1 + static_cast<double>(runs.size()) / 4)});
      for (std::uint32_t w = 1; w <= 2; ++w) {
        const std::string worker = "rollout-" + std::to_string(w);
        r.records.spans.push_back(span(worker, 0, SpanKind::kPull, at - 4 * kS, at - 3 * kS));
        r.records.spans.push_back(span(worker, 0, SpanKind::kDecode, at - 3 * kS, at - kS / 2));
        r.records.spans.push_back(span(worker, 0, SpanKind::kIdleWait, at - kS / 2, at));
      }
      r.records.spans.push_back(span("actor", 0, SpanKind::kTrain, at - kS, at));
    }
    runs.push_back(std::move(r));
  }

  TempDir dir("grpo_report");
  SECTION("without gnuplot the report is written and says plots were skipped") {
    auto files = async_grpo::write_report(runs, {.gnuplot = "/nonexistent/gnuplot"}, dir.path() / "out");
    REQUIRE(files.ok());
    CHECK(files->plots.empty());
    CHECK(files->plot_note.find("not found") != std::string::npos);
    CHECK(read_all(files->table_txt) == files->table);
    CHECK(nlohmann::json::parse(read_all(files->metrics))["schedules"].size() == 3);
    REQUIRE(files->traces.size() == 3);
    CHECK(nlohmann::json::accept(read_all(files->traces[2])));
  }
  SECTION("with gnuplot the plots are PNG files") {
    auto files = async_grpo::write_report(runs, {}, dir.path());
    REQUIRE(files.ok());
    if (files->plots.empty()) {
      WARN("gnuplot is not installed, PNG checks skipped: " << files->plot_note);
      CHECK(files->plot_note.find("gnuplot") != std::string::npos);
      return;
    }
    CHECK(files->plot_note.empty());
    std::set<std::string> names;
    for (const auto& p : files->plots) names.insert(p.filename().string());
    CHECK(names == std::set<std::string>{"reward.png", "training_reward.png", "activity_sync.png",
                                         "activity_one-step.png", "activity_laminar.png"});
    for (const auto& p : files->plots) {
      INFO(p.string());
      const std::string png = read_all(p);
      CHECK(png.size() > 1000);
      CHECK(png.rfind("\x89PNG\r\n\x1a\n", 0) == 0);
    }
  }
}

TEST_CASE("grpo report: progress lines show rate and ETA under a manual clock") {
  auto clock = std::make_shared<laminar::ManualClock>();
  std::ostringstream out;

  SECTION("a log gets a full line every period") {
    Progress p(clock, out, Progress::Mode::kPeriodic, std::chrono::seconds(10));
    CHECK(p.update(1).code() == StatusCode::kFailedPrecondition);
    REQUIRE(p.begin("sync", 100, "samples").ok());
    CHECK(out.str() == "sync  0/100 samples  0.00 samples/s  ETA --\n");
    REQUIRE(clock->advance(std::chrono::seconds(5)).ok());
    REQUIRE(p.update(25).ok());
    CHECK(out.str() == "sync  0/100 samples  0.00 samples/s  ETA --\n");  // not due yet
    REQUIRE(clock->advance(std::chrono::seconds(5)).ok());
    REQUIRE(p.update(40).ok());
    // 40 in 10 s: 4/s, so the other 60 take 15 s.
    const double rate = 40.0 / 10.0;
    const int eta = static_cast<int>(std::ceil((100 - 40) / rate));
    std::string expected = "sync  0/100 samples  0.00 samples/s  ETA --\n" +
                           fmt::format("sync  40/100 samples  {:.2f} samples/s  ETA {}s\n", rate, eta);
    CHECK(out.str() == expected);
    CHECK(p.update(30).code() == StatusCode::kInvalidArgument);   // went down
    CHECK(p.update(101).code() == StatusCode::kInvalidArgument);  // past the total
    REQUIRE(clock->advance(std::chrono::milliseconds(2500)).ok());
    REQUIRE(p.update(100).ok());  // not due: finish prints it
    REQUIRE(p.finish().ok());
    expected += fmt::format("sync  100/100 samples  {:.2f} samples/s  done in 13s\n", 100 / 12.5);
    CHECK(out.str() == expected);
    CHECK(p.finish().code() == StatusCode::kFailedPrecondition);
    CHECK(p.begin("", 10, "x").code() == StatusCode::kInvalidArgument);
    CHECK(p.begin("laminar", 0, "x").code() == StatusCode::kInvalidArgument);
    CHECK(p.begin("lam\rinar", 10, "x").code() == StatusCode::kInvalidArgument);
  }

  SECTION("a terminal gets the line redrawn in place") {
    Progress p(clock, out, Progress::Mode::kInPlace);
    REQUIRE(p.begin("warm-up", 3000, "steps").ok());
    REQUIRE(clock->advance(std::chrono::seconds(20)).ok());
    REQUIRE(p.update(7).ok());
    // 7 steps in 20 s: the other 2993 take 2993 * 20 / 7 s, rounded up.
    const auto eta_s = static_cast<std::int64_t>(std::ceil(2993.0 * 20.0 / 7.0));
    const std::string eta = fmt::format("{}h{:02}m{:02}s", eta_s / 3600, eta_s / 60 % 60, eta_s % 60);
    const std::string second =
        fmt::format("\rwarm-up  7/3000 steps  {:.2f} steps/s  ETA {}\x1b[K", 7.0 / 20.0, eta);
    const std::string first = "\rwarm-up  0/3000 steps  0.00 steps/s  ETA --\x1b[K";
    CHECK(out.str() == first + second);
    REQUIRE(clock->advance(std::chrono::milliseconds(100)).ok());
    REQUIRE(p.update(8).ok());  // within the redraw period: nothing drawn
    CHECK(out.str() == first + second);
    // A second phase ends the first one's line with a newline and starts its own.
    REQUIRE(p.begin("laminar", 10, "samples").ok());
    const std::string closing =
        fmt::format("\rwarm-up  8/3000 steps  {:.2f} steps/s  ETA {}\x1b[K\n", 8.0 / 20.1,
                    async_grpo::Progress::format_duration(std::chrono::nanoseconds(
                        static_cast<std::int64_t>(std::ceil(2992.0 * 20.1e9 / 8.0)))));
    CHECK(out.str() == first + second + closing + "\rlaminar  0/10 samples  0.00 samples/s  ETA --\x1b[K");
  }

  CHECK(Progress::format_duration(std::chrono::milliseconds(59200)) == "1m00s");
  CHECK(Progress::format_duration(std::chrono::seconds(3725)) == "1h02m05s");
  CHECK(Progress::format_duration(std::chrono::nanoseconds(1)) == "1s");
}

TEST_CASE("grpo report: seeds summed up as median and range, each against its own baseline", "[seeds]") {
  using async_grpo::Comparison;
  using async_grpo::ScheduleMetrics;
  auto metrics = [](std::string name, std::optional<double> t, double rate, std::array<std::uint64_t, 4> stale,
                    double step_ms) {
    ScheduleMetrics m;
    m.schedule = std::move(name);
    m.time_to_target_s = t;
    m.samples_per_s = rate;
    m.staleness = stale;
    m.trained_samples = stale[0] + stale[1] + stale[2] + stale[3];
    m.actor_waiting_share = 0.5;
    m.train_step_p50_ms = step_ms;
    return m;
  };
  auto comparison = [](ScheduleMetrics sync, ScheduleMetrics laminar) {
    Comparison c;
    c.baseline = "sync";
    c.contender = "laminar";
    c.schedules = {std::move(sync), std::move(laminar)};
    return c;
  };
  // Seed 3: laminar never reaches the target (speedup 0); seed 4: sync does not either, so that
  // seed has no speedup at all.
  const std::vector<Comparison> cs = {
      comparison(metrics("sync", 40, 100, {10, 0, 0, 0}, 80), metrics("laminar", 20, 250, {2, 6, 2, 0}, 84)),
      comparison(metrics("sync", 50, 110, {10, 0, 0, 0}, 80), metrics("laminar", 20, 240, {1, 5, 3, 1}, 80)),
      comparison(metrics("sync", 45, 100, {10, 0, 0, 0}, 90), metrics("laminar", std::nullopt, 200, {0, 4, 4, 2}, 90)),
      comparison(metrics("sync", std::nullopt, 90, {10, 0, 0, 0}, 90), metrics("laminar", 30, 270, {3, 5, 2, 0}, 99)),
  };
  auto s = async_grpo::summarize_seeds({1, 2, 3, 4}, cs);
  REQUIRE(s.ok());
  CHECK(s->baseline == "sync");
  REQUIRE(s->schedules.size() == 2);
  const auto& lam = s->schedules[1];
  CHECK(lam.schedule == "laminar");
  CHECK(lam.seeds == 4);
  CHECK(lam.reached == 3);
  REQUIRE(lam.time_to_target_s);
  CHECK(lam.time_to_target_s->median == 20);
  CHECK(lam.time_to_target_s->max == 30);
  REQUIRE(lam.speedup);  // 2.0, 2.5 and 0 (not reached); seed 4 left out
  CHECK(lam.speedup->median == Approx(2.0));
  CHECK(lam.speedup->min == 0);
  CHECK(lam.speedup->max == Approx(2.5));
  CHECK(lam.samples_per_s.median == Approx((240.0 + 250.0) / 2));  // even count: the middle two
  CHECK(lam.samples_per_s.min == 200);
  REQUIRE(lam.samples_per_s_ratio);
  CHECK(lam.samples_per_s_ratio->max == Approx(3.0));
  REQUIRE(lam.at_most_one_stale);
  CHECK(lam.at_most_one_stale->min == Approx(0.4));
  CHECK(lam.at_most_one_stale->max == Approx(0.8));
  REQUIRE(lam.train_step_ratio);
  CHECK(lam.train_step_ratio->max == Approx(1.1));
  CHECK(s->schedules[0].speedup->median == Approx(1.0));

  const std::string table = async_grpo::format_seed_table(*s);
  INFO(table);
  CHECK(table.find("20.0 [20.0, 30.0] (3/4 reached)") != std::string::npos);
  CHECK(table.find("2.00x [0.00, 2.50]") != std::string::npos);
  CHECK(table.find("seeds 1, 2, 3, 4;") != std::string::npos);
  auto j = nlohmann::json::parse(async_grpo::seed_summary_json(*s));
  CHECK(j["schedules"][1]["reached"] == 3);
  CHECK(j["schedules"][1]["speedup"]["median"].get<double>() == Approx(2.0));

  CHECK(async_grpo::summarize_seeds({}, {}).status().code() == StatusCode::kInvalidArgument);
  CHECK(async_grpo::summarize_seeds({1, 2}, {cs[0]}).status().message().find("2 seeds but 1") != std::string::npos);
  CHECK(async_grpo::summarize_seeds({1, 1}, {cs[0], cs[1]}).status().message().find("twice") != std::string::npos);
  std::vector<Comparison> other = {cs[0], cs[1]};
  other[1].baseline = "one-step";
  CHECK(async_grpo::summarize_seeds({1, 2}, other).status().message().find("not 'sync'") != std::string::npos);
}
