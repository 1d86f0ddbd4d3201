// The simulator's outputs (report_output.h, report_json.cc) from hand-built SimReports: the
// comparison's numbers and speed-ups, the sweep's scaling efficiency, the JSON fields, the Perfetto
// trace, gnuplot's PNGs and the progress line under a ManualClock.
#include "report_output.h"
#include "temp_dir.h"

#include <stdlib.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

using laminar::StatusCode;
using laminar::sim::Comparison;
using laminar::sim::ScheduleKind;
using laminar::sim::SimReport;
using laminar::sim::SweepPoint;
using laminar::sim::TraceSpan;
using namespace std::chrono_literals;

namespace {

using laminar::testing::read_all;
using laminar::testing::TempDir;

SimReport report(std::string schedule, ScheduleKind kind, std::optional<std::int64_t> max_ahead, double samples_per_s,
                 std::vector<std::int64_t> staleness, std::int64_t gpus = 64) {
  SimReport r;
  r.schedule = std::move(schedule);
  r.spec.kind = kind;
  r.spec.max_ahead_steps = max_ahead;
  r.gpus = gpus;
  r.rollout_gpus = gpus * 3 / 4;
  r.trainer_gpus = gpus / 4;
  r.steps = 10;
  r.samples_per_s = samples_per_s;
  r.tokens_per_s = samples_per_s * 1500;
  r.generation_tokens_per_s = samples_per_s * 1600;
  r.generation_utilisation = 0.5;
  r.mean_step_time = 12'500ms;
  r.total = 125s;
  r.staleness_histogram = std::move(staleness);
  return r;
}

// sync 10 samples/s, one-step 20, bounded-staleness 16, laminar 30.
std::vector<SimReport> setting() {
  std::vector<SimReport> reports = {report("sync", ScheduleKind::kSync, 0, 10, {8}),
                                    report("one-step", ScheduleKind::kOneStep, 1, 20, {0, 8}),
                                    report("bounded-staleness", ScheduleKind::kBoundedStaleness, 4, 16, {3, 2, 0, 1}),
                                    report("laminar", ScheduleKind::kLaminar, std::nullopt, 30, {2, 1, 1})};
  reports[3].repack_moves = 7;
  reports[3].spec.max_step_share = 2.5;
  reports[3].repack_bytes = 2.5e9;
  reports[2].mixed_version_trajectories = 5;
  reports[2].max_staleness = 3;
  reports[2].preemptions = 11;
  return reports;
}

bool is_png(const std::filesystem::path& p) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(p, ec) || std::filesystem::file_size(p, ec) < 8) return false;
  return read_all(p).substr(0, 8) == std::string("\x89PNG\r\n\x1a\n", 8);
}

}  // namespace

TEST_CASE("sim output: the comparison's rows and speed-ups", "[sim_output]") {
  std::vector<SimReport> reports = setting();
  auto base = laminar::sim::default_baseline(reports);
  REQUIRE(base.ok());
  CHECK(*base == "one-step");  // the fastest that is not laminar

  auto c = laminar::sim::compare(reports, *base);
  REQUIRE(c.ok());
  REQUIRE(c->rows.size() == 4);
  std::map<std::string, laminar::sim::ComparisonRow> rows;
  for (const auto& r : c->rows) rows[r.schedule] = r;
  CHECK(rows["sync"].speedup_over_baseline == Approx(0.5));
  CHECK(rows["one-step"].speedup_over_baseline == Approx(1.0));
  CHECK(rows["bounded-staleness"].speedup_over_baseline == Approx(0.8));
  CHECK(rows["laminar"].speedup_over_baseline == Approx(1.5));
  CHECK(*rows["sync"].laminar_speedup == Approx(3.0));
  CHECK(*rows["bounded-staleness"].laminar_speedup == Approx(1.875));
  CHECK(*rows["laminar"].laminar_speedup == Approx(1.0));
  CHECK(rows["laminar"].mean_staleness == Approx(0.75));              // (0*2 + 1*1 + 2*1) / 4
  CHECK(rows["bounded-staleness"].mean_staleness == Approx(0.8333333));  // (2 + 3) / 6
  CHECK(rows["laminar"].repack_gb == Approx(2.5));
  CHECK(rows["sync"].mean_step_s == Approx(12.5));
  CHECK(!rows["laminar"].max_ahead_steps.has_value());
  CHECK(rows["laminar"].max_step_share == 2.5);
  CHECK(!rows["sync"].max_step_share.has_value());

  const std::string table = laminar::sim::format_comparison(*c);
  INFO(table);
  CHECK(table.find("unbounded") != std::string::npos);
  CHECK(table.find("speed-up over one-step") != std::string::npos);
  CHECK(table.find("dispatch: max share of a step") != std::string::npos);
  CHECK(table.find("1.88x") != std::string::npos);  // laminar over bounded-staleness
  CHECK(table.find("0.83") != std::string::npos);
  CHECK(table.find("2.5") != std::string::npos);

  SECTION("without laminar there is no laminar row") {
    reports.pop_back();
    auto c2 = laminar::sim::compare(reports, "sync");
    REQUIRE(c2.ok());
    CHECK(!c2->rows[1].laminar_speedup.has_value());
    CHECK(c2->rows[1].speedup_over_baseline == Approx(2.0));
    CHECK(laminar::sim::format_comparison(*c2).find("laminar's speed-up") == std::string::npos);
  }
  SECTION("a baseline that did not run, a schedule twice, or two settings are errors") {
    auto missing = laminar::sim::compare(reports, "partial-rollout");
    CHECK(missing.status().code() == StatusCode::kInvalidArgument);
    CHECK(missing.status().message().find("partial-rollout") != std::string::npos);
    reports.push_back(reports[0]);
    CHECK(laminar::sim::compare(reports, "sync").status().code() == StatusCode::kInvalidArgument);
    reports.pop_back();
    reports[1].gpus = 128;
    CHECK(laminar::sim::compare(reports, "sync").status().code() == StatusCode::kInvalidArgument);
    CHECK(laminar::sim::compare({}, "sync").status().code() == StatusCode::kInvalidArgument);
  }
  SECTION("a baseline with no throughput cannot be divided by") {
    reports[0].samples_per_s = 0;
    CHECK(laminar::sim::compare(reports, "sync").status().code() == StatusCode::kInvalidArgument);
  }
}

TEST_CASE("sim output: sweep scaling efficiency against the smallest GPU count", "[sim_output]") {
  std::vector<SimReport> reports;
  // Given out of order: the points come back sorted by GPUs within each schedule.
  for (auto [gpus, tps] : {std::pair{256, 3200.0}, {64, 1000.0}, {128, 1800.0}}) {
    reports.push_back(report("laminar", ScheduleKind::kLaminar, std::nullopt, 1, {1}, gpus));
    reports.back().generation_tokens_per_s = tps;
  }
  for (auto [gpus, tps] : {std::pair{64, 500.0}, {128, 1000.0}}) {
    reports.push_back(report("sync", ScheduleKind::kSync, 0, 1, {1}, gpus));
    reports.back().generation_tokens_per_s = tps;
  }
  auto points = laminar::sim::sweep_points(reports);
  REQUIRE(points.ok());
  REQUIRE(points->size() == 5);
  CHECK((*points)[0].schedule == "laminar");
  CHECK((*points)[0].gpus == 64);
  CHECK((*points)[0].scaling_efficiency == Approx(1.0));
  CHECK((*points)[1].gpus == 128);
  CHECK((*points)[1].scaling_efficiency == Approx(0.9));  // 1800/128 over 1000/64
  CHECK((*points)[2].gpus == 256);
  CHECK((*points)[2].scaling_efficiency == Approx(0.8));
  CHECK((*points)[4].schedule == "sync");
  CHECK((*points)[4].scaling_efficiency == Approx(1.0));
  const std::string table = laminar::sim::format_sweep(*points);
  INFO(table);
  CHECK(table.find("90.0%") != std::string::npos);
  CHECK(table.find("80.0%") != std::string::npos);

  reports.push_back(reports[0]);
  CHECK(laminar::sim::sweep_points(reports).status().code() == StatusCode::kInvalidArgument);
  reports.pop_back();
  reports[1].generation_tokens_per_s = 0;  // the 64-GPU base
  CHECK(laminar::sim::sweep_points(reports).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("sim output: report JSON holds seconds and null for an unbounded admission rule", "[sim_output]") {
  std::vector<SimReport> reports = setting();
  reports[3].step_records.push_back({.step = 0, .start = 1500ms, .end = 14s, .mean_staleness = 0.25});
  reports[3].trace.push_back({.instance = 2, .kind = TraceSpan::Kind::kPull, .start = 3s, .end = 4s, .version = 1});

  const nlohmann::json lam = reports[3].to_json();
  CHECK(lam["schedule"] == "laminar");
  CHECK(lam["spec"]["schedule"] == "laminar");
  CHECK(lam["spec"]["max_ahead_steps"].is_null());
  CHECK(lam["spec"]["repack_interval_s"].get<double>() == Approx(5.0));
  CHECK(lam["total_s"].get<double>() == Approx(125.0));
  CHECK(lam["mean_step_time_s"].get<double>() == Approx(12.5));
  CHECK(lam["staleness_histogram"] == nlohmann::json({2, 1, 1}));
  CHECK(lam["repack_bytes"].get<double>() == Approx(2.5e9));
  CHECK(lam["step_records"][0]["start_s"].get<double>() == Approx(1.5));
  CHECK(lam["step_records"][0]["end_s"].get<double>() == Approx(14.0));
  CHECK(lam["trace"][0]["kind"] == "pull");
  const nlohmann::json bs = reports[2].to_json();
  CHECK(bs["spec"]["max_ahead_steps"] == 4);
  CHECK(bs["spec"]["schedule"] == "bounded-staleness");
  CHECK(bs["mixed_version_trajectories"] == 5);
  CHECK(!bs.contains("trace"));

  TempDir dir("sim_output");
  auto c = laminar::sim::compare(reports, "sync");
  REQUIRE(c.ok());
  auto points = laminar::sim::sweep_points(reports);
  REQUIRE(points.ok());
  const std::filesystem::path path = dir.path() / "out" / "report.json";
  REQUIRE(laminar::sim::write_json_report(path, {{"gpus", 64}}, reports, *c, *points).ok());
  const nlohmann::json j = nlohmann::json::parse(read_all(path));
  CHECK(j["config"]["gpus"] == 64);
  CHECK(j["comparison"]["baseline"] == "sync");
  CHECK(j["comparison"]["rows"][3]["max_ahead_steps"].is_null());
  CHECK(j["comparison"]["rows"][3]["speedup_over_baseline"].get<double>() == Approx(3.0));
  CHECK(j["comparison"]["rows"][0]["max_ahead_steps"] == 0);
  CHECK(j["comparison"]["rows"][3]["max_step_share"] == 2.5);
  CHECK(j["comparison"]["rows"][0]["max_step_share"].is_null());
  CHECK(j["reports"][3]["spec"]["max_step_share"] == 2.5);
  REQUIRE(j["reports"].size() == 4);
  CHECK(j["reports"][1]["schedule"] == "one-step");
  CHECK(j["sweep"].size() == 4);

  REQUIRE(laminar::sim::write_json_report(path, {}, reports, std::nullopt, {}).ok());
  CHECK(nlohmann::json::parse(read_all(path))["comparison"].is_null());
  CHECK(laminar::sim::write_json_report(path / "x.json", {}, reports, std::nullopt, {}).code() ==
        StatusCode::kUnavailable);
}

TEST_CASE("sim output: the trace is Chrome trace JSON, one event per span in microseconds", "[sim_output]") {
  SimReport r = report("laminar", ScheduleKind::kLaminar, std::nullopt, 1, {1});
  r.trace = {{.instance = 0, .kind = TraceSpan::Kind::kGenerate, .start = 0ns, .end = 1500us, .version = 0, .batch = 12},
             {.instance = 0, .kind = TraceSpan::Kind::kPull, .start = 1500us, .end = 2'250'500ns, .version = 1},
             {.instance = 3, .kind = TraceSpan::Kind::kMigrate, .start = 2s, .end = 2s + 7ms, .version = 1, .batch = 3},
             {.instance = 3, .kind = TraceSpan::Kind::kWaitWeights, .start = 3s, .end = 3s, .version = 1}};
  auto text = laminar::sim::trace_json(r);
  REQUIRE(text.ok());
  const nlohmann::json j = nlohmann::json::parse(*text);
  std::vector<nlohmann::json> spans;
  std::map<std::int64_t, std::string> tracks;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "X") spans.push_back(e);
    if (e["ph"] == "M" && e["name"] == "thread_name") tracks[e["tid"].get<std::int64_t>()] = e["args"]["name"];
  }
  REQUIRE(spans.size() == r.trace.size());
  CHECK(tracks == std::map<std::int64_t, std::string>{{0, "instance 0"}, {3, "instance 3"}});
  CHECK(spans[0]["name"] == "generate");
  CHECK(spans[0]["ts"].get<double>() == Approx(0.0));
  CHECK(spans[0]["dur"].get<double>() == Approx(1500.0));
  CHECK(spans[0]["args"]["batch"] == 12);
  CHECK(spans[1]["name"] == "pull");
  CHECK(spans[1]["ts"].get<double>() == Approx(1500.0));
  CHECK(spans[1]["dur"].get<double>() == Approx(750.5));
  CHECK(spans[1]["args"]["version"] == 1);
  CHECK(spans[2]["tid"] == 3);
  CHECK(spans[2]["ts"].get<double>() == Approx(2e6));
  CHECK(spans[2]["dur"].get<double>() == Approx(7000.0));
  CHECK(spans[2]["name"] == "migrate");
  CHECK(spans[3]["dur"].get<double>() == Approx(0.0));

  r.trace[1].end = r.trace[1].start - 1ns;
  CHECK(laminar::sim::trace_json(r).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("sim output: gnuplot writes the throughput, staleness and scaling PNGs", "[sim_output]") {
  TempDir dir("sim_output");
  std::vector<SimReport> reports = setting();
  std::vector<SimReport> sweep;
  for (int gpus : {64, 128, 256}) {
    for (const char* s : {"sync", "laminar"}) {
      sweep.push_back(report(s, s[0] == 's' ? ScheduleKind::kSync : ScheduleKind::kLaminar, 0, 1, {1}, gpus));
      sweep.back().generation_tokens_per_s = (s[0] == 's' ? 10.0 : 15.0) * gpus * (1.0 - gpus / 1024.0);
    }
  }
  auto points = laminar::sim::sweep_points(sweep);
  REQUIRE(points.ok());

  SECTION("without gnuplot the plots are skipped and say why") {
    auto plots = laminar::sim::write_comparison_plots(reports, dir.path(), "/nonexistent/gnuplot");
    REQUIRE(plots.ok());
    CHECK(plots->pngs.empty());
    CHECK(plots->note.find("gnuplot") != std::string::npos);
  }
  SECTION("a long staleness tail is binned into at most 16 bars") {
    reports[3].staleness_histogram.assign(40, 1);  // 0..39: bins of 3 versions, the last 39 alone
    REQUIRE(laminar::sim::write_comparison_plots(reports, dir.path(), "/nonexistent/gnuplot").ok());
    std::istringstream data(read_all(dir.path() / "staleness.dat"));
    std::vector<std::string> lines;
    for (std::string line; std::getline(data, line);) lines.push_back(line);
    REQUIRE(lines.size() == 1 + 14);
    CHECK(lines[1].rfind("\"0-2\" 1 1 ", 0) == 0);  // sync all at 0, one-step all at 1
    CHECK(lines[14].rfind("\"39\" ", 0) == 0);
    CHECK(lines[14].substr(lines[14].rfind(' ') + 1) == "0.025");  // laminar: 1 of 40
  }
  SECTION("with gnuplot every PNG is a non-empty PNG file") {
    auto plots = laminar::sim::write_comparison_plots(reports, dir.path() / "plots", "gnuplot");
    REQUIRE(plots.ok());
    if (!plots->note.empty()) {
      WARN("gnuplot is not installed, PNG checks skipped: " << plots->note);
      return;
    }
    auto scaling = laminar::sim::write_sweep_plot(*points, dir.path() / "plots", "gnuplot");
    REQUIRE(scaling.ok());
    REQUIRE(plots->pngs.size() == 2);
    REQUIRE(scaling->pngs.size() == 1);
    for (const auto& p : {plots->pngs[0], plots->pngs[1], scaling->pngs[0]}) {
      INFO(p);
      CHECK(is_png(p));
    }
    CHECK(plots->pngs[0].filename() == "throughput.png");
    CHECK(plots->pngs[1].filename() == "staleness.png");
    CHECK(scaling->pngs[0].filename() == "scaling.png");
  }
  CHECK(laminar::sim::write_comparison_plots({}, dir.path(), "gnuplot").status().code() == StatusCode::kInvalidArgument);
  CHECK(laminar::sim::write_sweep_plot({}, dir.path(), "gnuplot").status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("sim output: the progress line counts steps and estimates from the wall clock", "[sim_output]") {
  CHECK(laminar::sim::ProgressLine::format("sync 64 GPUs", 0, 12, 0s) == "sync 64 GPUs  step 0/12  elapsed 0s  ETA --");
  CHECK(laminar::sim::ProgressLine::format("laminar", 3, 12, 6s) == "laminar  step 3/12  elapsed 6s  ETA 18s");
  CHECK(laminar::sim::ProgressLine::format("laminar", 12, 12, 100s) == "laminar  step 12/12  elapsed 1m40s  ETA 0s");
  CHECK(laminar::sim::ProgressLine::format("laminar", 1, 3, 1500ms) == "laminar  step 1/3  elapsed 1s  ETA 3s");

  auto clock = std::make_shared<laminar::ManualClock>();
  std::ostringstream out;
  laminar::sim::ProgressLine p(clock, out, 4);
  REQUIRE(clock->advance(2s).ok());
  p.update("sync", 1);
  REQUIRE(clock->advance(2s).ok());
  p.update("laminar", 1);
  p.update("laminar", 1);  // within the redraw period: not drawn
  REQUIRE(clock->advance(1500ms).ok());
  p.update("laminar", 1);  // the last step: always drawn
  p.finish();
  CHECK(out.str() ==
        "\rsync  step 1/4  elapsed 2s  ETA 6s\x1b[K\rlaminar  step 2/4  elapsed 4s  ETA 4s\x1b[K"
        "\rlaminar  step 4/4  elapsed 5s  ETA 0s\x1b[K\n");
}
