// report_output.h: what the user of the simulator sees: a table comparing the schedules of one
// setting, a table of a GPU-count sweep, a JSON report file, gnuplot PNGs, a Chrome/Perfetto trace
// of one traced run, and a progress line for long sweeps. It reads SimReports only (simulator.h), so
// it works on reports built any way.
//
//   std::vector<SimReport> reports = ...;  // one per schedule, same config
//   Result<std::string> base = default_baseline(reports);
//   Result<Comparison> c = compare(reports, *base);
//   std::cout << format_comparison(*c);
//   Result<PlotFiles> plots = write_comparison_plots(reports, out_dir, "gnuplot");
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "laminar/clock.h"
#include "laminar/status.h"
#include "simulator.h"

namespace laminar::sim {

// The mean of staleness_histogram (versions between generating and training a trajectory); 0 with
// no trajectories.
double mean_staleness(const SimReport& report);

// One schedule's row of the comparison.
struct ComparisonRow {
  std::string schedule;
  std::optional<std::int64_t> max_ahead_steps;  // none: unbounded
  std::optional<double> max_step_share;         // laminar's cap on one step's samples an instance takes
  double samples_per_s = 0;
  double tokens_per_s = 0;
  double mean_step_s = 0;
  double generation_utilisation = 0;
  double mean_staleness = 0;
  std::int64_t max_staleness = 0;
  std::int64_t mixed_version_trajectories = 0;
  std::int64_t repack_moves = 0;
  double repack_gb = 0;  // 1e9 bytes
  std::int64_t preemptions = 0;
  double speedup_over_baseline = 0;       // samples_per_s / the baseline's
  std::optional<double> laminar_speedup;  // laminar's samples_per_s / this one's; none without laminar
};

struct Comparison {
  std::string baseline;
  std::int64_t gpus = 0;
  std::int64_t steps = 0;
  std::vector<ComparisonRow> rows;  // in the order of the reports
};

// The non-laminar schedule with the most samples/s ("laminar" when it is the only one).
// kInvalidArgument for no reports.
Result<std::string> default_baseline(const std::vector<SimReport>& reports);

// kInvalidArgument for no reports, an empty or repeated schedule, reports of different GPU or step
// counts (a comparison is of one setting), a baseline not among the reports, or a baseline or
// laminar with no samples/s to divide by.
Result<Comparison> compare(const std::vector<SimReport>& reports, std::string_view baseline);

// The aligned plain-text table, one column per schedule, and the speed-up lines under it.
std::string format_comparison(const Comparison& comparison);

// One (GPU count, schedule) of a sweep.
struct SweepPoint {
  std::int64_t gpus = 0;
  std::string schedule;
  double generation_tokens_per_s = 0;
  double samples_per_s = 0;
  // Generation tokens/s per GPU over the same schedule's at its smallest GPU count: 1 is linear.
  double scaling_efficiency = 0;
};

// Sorted by schedule (first appearance) then GPUs. kInvalidArgument for no reports, an empty
// schedule, a non-positive GPU count, a (schedule, GPUs) twice, or a schedule whose smallest run
// generated nothing.
Result<std::vector<SweepPoint>> sweep_points(const std::vector<SimReport>& reports);
std::string format_sweep(const std::vector<SweepPoint>& points);

// The setting's main numbers (cluster, model, GPU, workload size, steps, seed), for the report.
nlohmann::json config_summary(const SimConfig& config);

// Writes {"config": config, "comparison": ..., "sweep": [...], "reports": [every to_json()]} to
// `path` (its folder created), "comparison" null without one. kUnavailable when it cannot be written.
Status write_json_report(const std::filesystem::path& path, const nlohmann::json& config,
                         const std::vector<SimReport>& reports, const std::optional<Comparison>& comparison,
                         const std::vector<SweepPoint>& sweep);

// Chrome trace-event JSON of report.trace, loadable in Perfetto's UI: one track (tid) per rollout
// instance, an "X" event per span named by its kind, ts and dur in microseconds of virtual time,
// args version and batch. kInvalidArgument for a span ending before it starts or a negative instance.
Result<std::string> trace_json(const SimReport& report);

struct PlotFiles {
  std::vector<std::filesystem::path> pngs;
  std::string note;  // why plots are missing (no gnuplot), or empty
};
// throughput.png (samples/s and generation tokens/s per schedule, bars) and staleness.png (each
// schedule's share of trajectories at each staleness), under `dir` (created). `gnuplot` is looked
// up in PATH unless it holds a '/'; missing, the plots are skipped (note says so). gnuplot failing
// is kInternal with its output. kInvalidArgument for no reports.
Result<PlotFiles> write_comparison_plots(const std::vector<SimReport>& reports, const std::filesystem::path& dir,
                                         const std::string& gnuplot);
// scaling.png: generation tokens/s against GPUs (log-log), a line per schedule and the ideal linear
// line from the fastest schedule at the smallest GPU count. kInvalidArgument for no points.
Result<PlotFiles> write_sweep_plot(const std::vector<SweepPoint>& points, const std::filesystem::path& dir,
                                   const std::string& gnuplot);

// A progress line for long runs on stderr: "\r<label>  step <done>/<total>  elapsed 12s  ETA 40s",
// redrawn in place, at most every kRedrawPeriod (and at the last step), so fast runs do not flood a
// log. `clock` is the wall clock of the command; the simulation never reads it.
//
//   ProgressLine p(laminar::Clock::steady(), std::cerr, 600);
//   options.on_step = [&](std::int64_t done, std::int64_t) { p.update("laminar 64 GPUs", 1); };
//   p.finish();
class ProgressLine {
 public:
  static constexpr Duration kRedrawPeriod = std::chrono::milliseconds(200);
  // Precondition: total_steps > 0 (the command checks it).
  ProgressLine(std::shared_ptr<Clock> clock, std::ostream& out, std::int64_t total_steps);
  // `steps` more done, under `label` (the schedule running).
  void update(std::string_view label, std::int64_t steps);
  // Ends the line with a newline (once something was drawn).
  void finish();

  // Elapsed in whole seconds rounded down; ETA = remaining x elapsed / done, rounded up; "--" before
  // any step.
  static std::string format(std::string_view label, std::int64_t done, std::int64_t total, Duration elapsed);

 private:
  std::shared_ptr<Clock> clock_;
  std::ostream& out_;
  std::int64_t total_;
  std::int64_t done_ = 0;
  Duration started_;
  std::optional<Duration> last_draw_;
};

}  // namespace laminar::sim
