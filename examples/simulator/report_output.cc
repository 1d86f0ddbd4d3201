#include "report_output.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gnuplot.h"
#include "text_table.h"

namespace laminar::sim {
namespace {

using examples::gp_quote;

constexpr std::string_view kLaminar = "laminar";

double seconds(Duration d) { return std::chrono::duration<double>(d).count(); }

Status write_file(const std::filesystem::path& path, std::string_view text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.close();
  if (!out) return unavailable(fmt::format("cannot write {}", path.string()));
  return ok_status();
}

Result<std::filesystem::path> make_dir(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return unavailable(fmt::format("cannot create {}: {}", dir.string(), ec.message()));
  std::filesystem::path abs = std::filesystem::absolute(dir, ec);
  if (ec) return unavailable(fmt::format("cannot resolve {}: {}", dir.string(), ec.message()));
  return abs;
}

std::string bound_name(const std::optional<std::int64_t>& max_ahead) {
  return max_ahead ? std::to_string(*max_ahead) : std::string("unbounded");
}

nlohmann::json optional_json(const std::optional<double>& v) { return v ? nlohmann::json(*v) : nlohmann::json(); }

// Runs `script` (written to dir/name.gp) through gnuplot, or says why not in `out.note`.
Status plot(const std::string& gnuplot, const std::filesystem::path& dir, const std::string& name,
            const std::string& script, PlotFiles& out) {
  std::optional<std::filesystem::path> program = examples::find_program(gnuplot);
  if (!program) {
    out.note = fmt::format("gnuplot ('{}') not found: plots skipped (install gnuplot-nox for PNG plots)", gnuplot);
    out.pngs.clear();
    return ok_status();
  }
  const std::filesystem::path gp = dir / (name + ".gp");
  LAMINAR_RETURN_IF_ERROR(write_file(gp, script));
  return examples::run_gnuplot(*program, gp, dir / (name + ".log"));
}

// A string column of a gnuplot data file: double-quoted, which data files read as one field.
std::string data_quote(std::string_view s) {
  std::string out = "\"";
  for (char c : s) out += c == '"' ? '\'' : c;
  return out + "\"";
}

constexpr std::size_t kStalenessBins = 16;

constexpr std::string_view kPngHeader = "set terminal pngcairo size 1000,600 noenhanced\n";

}  // namespace

double mean_staleness(const SimReport& report) {
  double n = 0, sum = 0;
  for (std::size_t k = 0; k < report.staleness_histogram.size(); ++k) {
    n += static_cast<double>(report.staleness_histogram[k]);
    sum += static_cast<double>(k) * static_cast<double>(report.staleness_histogram[k]);
  }
  return n > 0 ? sum / n : 0.0;
}

// --- Comparison -------------------------------------------------------------------------------

Result<std::string> default_baseline(const std::vector<SimReport>& reports) {
  if (reports.empty()) return invalid_argument("baseline: no reports");
  const SimReport* best = nullptr;
  for (const SimReport& r : reports) {
    if (r.schedule == kLaminar) continue;
    if (best == nullptr || r.samples_per_s > best->samples_per_s) best = &r;
  }
  return best != nullptr ? best->schedule : reports.front().schedule;
}

Result<Comparison> compare(const std::vector<SimReport>& reports, std::string_view baseline) {
  if (reports.empty()) return invalid_argument("comparison: no reports");
  std::set<std::string, std::less<>> seen;
  const SimReport* base = nullptr;
  const SimReport* lam = nullptr;
  for (const SimReport& r : reports) {
    if (r.schedule.empty()) return invalid_argument("comparison: a report has no schedule name");
    if (!seen.insert(r.schedule).second) {
      return invalid_argument(fmt::format("comparison: schedule '{}' appears twice", r.schedule));
    }
    if (r.gpus != reports.front().gpus || r.steps != reports.front().steps) {
      return invalid_argument(fmt::format(
          "comparison: '{}' ran {} GPUs x {} steps but '{}' {} x {}; compare one setting at a time", r.schedule,
          r.gpus, r.steps, reports.front().schedule, reports.front().gpus, reports.front().steps));
    }
    if (r.schedule == baseline) base = &r;
    if (r.schedule == kLaminar) lam = &r;
  }
  if (base == nullptr) {
    return invalid_argument(fmt::format("comparison: baseline '{}' is not among the schedules run ({})", baseline,
                                        fmt::join(seen, ", ")));
  }
  for (const SimReport* r : {base, lam}) {
    if (r != nullptr && !(r->samples_per_s > 0)) {
      return invalid_argument(fmt::format("comparison: '{}' trained {} samples/s; nothing to compare against",
                                          r->schedule, r->samples_per_s));
    }
  }
  Comparison c;
  c.baseline = std::string(baseline);
  c.gpus = reports.front().gpus;
  c.steps = reports.front().steps;
  for (const SimReport& r : reports) {
    ComparisonRow row{.schedule = r.schedule,
                      .max_ahead_steps = r.spec.max_ahead_steps,
                      .max_step_share = r.spec.max_step_share,
                      .samples_per_s = r.samples_per_s,
                      .tokens_per_s = r.tokens_per_s,
                      .mean_step_s = seconds(r.mean_step_time),
                      .generation_utilisation = r.generation_utilisation,
                      .mean_staleness = mean_staleness(r),
                      .max_staleness = r.max_staleness,
                      .mixed_version_trajectories = r.mixed_version_trajectories,
                      .repack_moves = r.repack_moves,
                      .repack_gb = r.repack_bytes / 1e9,
                      .preemptions = r.preemptions,
                      .speedup_over_baseline = r.samples_per_s / base->samples_per_s,
                      .laminar_speedup = std::nullopt};
    if (lam != nullptr && r.samples_per_s > 0) row.laminar_speedup = lam->samples_per_s / r.samples_per_s;
    c.rows.push_back(std::move(row));
  }
  return c;
}

std::string format_comparison(const Comparison& c) {
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> header = {fmt::format("{} GPUs, {} steps", c.gpus, c.steps)};
  for (const ComparisonRow& r : c.rows) header.push_back(r.schedule);
  rows.push_back(std::move(header));
  auto row = [&](std::string label, const std::function<std::string(const ComparisonRow&)>& cell) {
    std::vector<std::string> line = {std::move(label)};
    for (const ComparisonRow& r : c.rows) line.push_back(cell(r));
    rows.push_back(std::move(line));
  };
  row("admission: max steps ahead", [](const ComparisonRow& r) { return bound_name(r.max_ahead_steps); });
  row("dispatch: max share of a step", [](const ComparisonRow& r) {
    if (r.max_step_share) return fmt::format("{:g}", *r.max_step_share);
    return std::string(r.schedule == kLaminar ? "none" : "-");
  });
  row("samples/s", [](const ComparisonRow& r) { return fmt::format("{:.2f}", r.samples_per_s); });
  row("tokens/s", [](const ComparisonRow& r) { return fmt::format("{:.0f}", r.tokens_per_s); });
  row("mean step time (s)", [](const ComparisonRow& r) { return fmt::format("{:.1f}", r.mean_step_s); });
  row("generation utilisation", [](const ComparisonRow& r) { return fmt::format("{:.1f}%", 100 * r.generation_utilisation); });
  row("mean staleness", [](const ComparisonRow& r) { return fmt::format("{:.2f}", r.mean_staleness); });
  row("max staleness", [](const ComparisonRow& r) { return std::to_string(r.max_staleness); });
  row("mixed-version trajectories", [](const ComparisonRow& r) { return std::to_string(r.mixed_version_trajectories); });
  row("repack moves", [](const ComparisonRow& r) { return std::to_string(r.repack_moves); });
  row("repack GB moved", [](const ComparisonRow& r) { return fmt::format("{:.1f}", r.repack_gb); });
  row("preemptions", [](const ComparisonRow& r) { return std::to_string(r.preemptions); });
  row(fmt::format("speed-up over {}", c.baseline),
      [](const ComparisonRow& r) { return fmt::format("{:.2f}x", r.speedup_over_baseline); });
  const bool has_laminar = std::any_of(c.rows.begin(), c.rows.end(), [](const ComparisonRow& r) { return r.schedule == kLaminar; });
  if (has_laminar) {
    row("laminar's speed-up over it", [](const ComparisonRow& r) {
      return r.laminar_speedup ? fmt::format("{:.2f}x", *r.laminar_speedup) : std::string("-");
    });
  }

  std::string out = examples::aligned_table(rows, true);
  out += "speed-ups are ratios of trained samples/s; staleness counts versions between generating and training\n";
  return out;
}

// --- Sweep ------------------------------------------------------------------------------------

Result<std::vector<SweepPoint>> sweep_points(const std::vector<SimReport>& reports) {
  if (reports.empty()) return invalid_argument("sweep: no reports");
  std::vector<std::string> order;
  std::map<std::string, std::map<std::int64_t, const SimReport*>> by_schedule;
  for (const SimReport& r : reports) {
    if (r.schedule.empty()) return invalid_argument("sweep: a report has no schedule name");
    if (r.gpus <= 0) return invalid_argument(fmt::format("sweep: '{}' ran on {} GPUs", r.schedule, r.gpus));
    auto [it, fresh] = by_schedule.try_emplace(r.schedule);
    if (fresh) order.push_back(r.schedule);
    if (!it->second.emplace(r.gpus, &r).second) {
      return invalid_argument(fmt::format("sweep: '{}' at {} GPUs appears twice", r.schedule, r.gpus));
    }
  }
  std::vector<SweepPoint> points;
  for (const std::string& schedule : order) {
    const auto& runs = by_schedule.at(schedule);
    const SimReport& first = *runs.begin()->second;
    if (!(first.generation_tokens_per_s > 0)) {
      return invalid_argument(fmt::format("sweep: '{}' at {} GPUs generated {} tokens/s; no scaling base",
                                          schedule, first.gpus, first.generation_tokens_per_s));
    }
    const double base_per_gpu = first.generation_tokens_per_s / static_cast<double>(first.gpus);
    for (const auto& [gpus, r] : runs) {
      points.push_back({.gpus = gpus,
                        .schedule = schedule,
                        .generation_tokens_per_s = r->generation_tokens_per_s,
                        .samples_per_s = r->samples_per_s,
                        .scaling_efficiency = r->generation_tokens_per_s / static_cast<double>(gpus) / base_per_gpu});
    }
  }
  return points;
}

std::string format_sweep(const std::vector<SweepPoint>& points) {
  std::string out = fmt::format("{:<18}  {:>6}  {:>16}  {:>10}  {:>10}\n", "schedule", "GPUs", "gen tokens/s",
                                "samples/s", "scaling");
  out += std::string(68, '-') + '\n';
  for (const SweepPoint& p : points) {
    out += fmt::format("{:<18}  {:>6}  {:>16.0f}  {:>10.2f}  {:>9.1f}%\n", p.schedule, p.gpus,
                       p.generation_tokens_per_s, p.samples_per_s, 100 * p.scaling_efficiency);
  }
  out += "scaling: generation tokens/s per GPU against the schedule's own at its smallest GPU count\n";
  return out;
}

// --- Files ------------------------------------------------------------------------------------

nlohmann::json config_summary(const SimConfig& config) {
  return {{"gpus", config.cluster.gpus},
          {"trainer_gpus", config.cluster.trainer_gpus},
          {"max_batch", config.cluster.max_batch},
          {"failures", config.cluster.failures},
          {"gpu", config.cost.gpu.name},
          {"model", config.cost.model.name},
          {"tensor_parallel", config.cost.rollout.tensor_parallel},
          {"prompts_per_step", config.workload.prompts_per_step},
          {"samples_per_prompt", config.workload.samples_per_prompt},
          {"max_prompt_tokens", config.workload.prompt_length.max_tokens},
          {"max_response_tokens", config.workload.response_length.max_tokens},
          {"workload_seed", config.workload.seed},
          {"steps", config.steps},
          {"seed", config.seed}};
}

Status write_json_report(const std::filesystem::path& path, const nlohmann::json& config,
                         const std::vector<SimReport>& reports, const std::optional<Comparison>& comparison,
                         const std::vector<SweepPoint>& sweep) {
  nlohmann::json comparison_json;
  if (comparison) {
    nlohmann::json rows = nlohmann::json::array();
    for (const ComparisonRow& r : comparison->rows) {
      rows.push_back({{"schedule", r.schedule},
                      {"max_ahead_steps", r.max_ahead_steps ? nlohmann::json(*r.max_ahead_steps) : nlohmann::json()},
                      {"max_step_share", optional_json(r.max_step_share)},
                      {"samples_per_s", r.samples_per_s},
                      {"tokens_per_s", r.tokens_per_s},
                      {"mean_step_s", r.mean_step_s},
                      {"generation_utilisation", r.generation_utilisation},
                      {"mean_staleness", r.mean_staleness},
                      {"max_staleness", r.max_staleness},
                      {"mixed_version_trajectories", r.mixed_version_trajectories},
                      {"repack_moves", r.repack_moves},
                      {"repack_gb", r.repack_gb},
                      {"preemptions", r.preemptions},
                      {"speedup_over_baseline", r.speedup_over_baseline},
                      {"laminar_speedup", optional_json(r.laminar_speedup)}});
    }
    comparison_json = {{"baseline", comparison->baseline}, {"rows", std::move(rows)}};
  }
  nlohmann::json sweep_json = nlohmann::json::array();
  for (const SweepPoint& p : sweep) {
    sweep_json.push_back({{"gpus", p.gpus},
                          {"schedule", p.schedule},
                          {"generation_tokens_per_s", p.generation_tokens_per_s},
                          {"samples_per_s", p.samples_per_s},
                          {"scaling_efficiency", p.scaling_efficiency}});
  }
  nlohmann::json reports_json = nlohmann::json::array();
  for (const SimReport& r : reports) reports_json.push_back(r.to_json());
  nlohmann::json j = {{"config", config},
                      {"comparison", std::move(comparison_json)},
                      {"sweep", std::move(sweep_json)},
                      {"reports", std::move(reports_json)}};
  if (path.has_parent_path()) {
    Result<std::filesystem::path> dir = make_dir(path.parent_path());
    if (!dir.ok()) return dir.status();
  }
  return write_file(path, j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
}

Result<std::string> trace_json(const SimReport& report) {
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "process_name"},
                    {"ph", "M"},
                    {"pid", 1},
                    {"args", {{"name", fmt::format("{} ({} GPUs)", report.schedule, report.gpus)}}}});
  std::set<std::int64_t> instances;
  for (const TraceSpan& s : report.trace) {
    if (s.instance < 0) return invalid_argument(fmt::format("trace: a span of instance {}", s.instance));
    if (s.end < s.start) {
      return invalid_argument(fmt::format("trace: a {} span of instance {} ends at {} ns, before its start {} ns",
                                          trace_kind_name(s.kind), s.instance, s.end.count(), s.start.count()));
    }
    instances.insert(s.instance);
  }
  for (std::int64_t i : instances) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", i},
                      {"args", {{"name", fmt::format("instance {}", i)}}}});
  }
  for (const TraceSpan& s : report.trace) {
    events.push_back({{"name", trace_kind_name(s.kind)},
                      {"cat", report.schedule},
                      {"ph", "X"},
                      {"pid", 1},
                      {"tid", s.instance},
                      {"ts", static_cast<double>(s.start.count()) / 1e3},
                      {"dur", static_cast<double>((s.end - s.start).count()) / 1e3},
                      {"args", {{"version", s.version}, {"batch", s.batch}}}});
  }
  nlohmann::json j = {{"displayTimeUnit", "ms"}, {"traceEvents", std::move(events)}};
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

// --- Plots ------------------------------------------------------------------------------------

Result<PlotFiles> write_comparison_plots(const std::vector<SimReport>& reports, const std::filesystem::path& dir,
                                         const std::string& gnuplot) {
  if (reports.empty()) return invalid_argument("plots: no reports");
  Result<std::filesystem::path> abs = make_dir(dir);
  if (!abs.ok()) return abs.status();
  PlotFiles out;

  // Throughput: samples/s and tokens/s differ by orders of magnitude, so a panel each.
  std::string data = "# schedule samples_per_s generation_tokens_per_s\n";
  for (const SimReport& r : reports) {
    data += fmt::format("{} {:.9g} {:.9g}\n", data_quote(r.schedule), r.samples_per_s, r.generation_tokens_per_s);
  }
  LAMINAR_RETURN_IF_ERROR(write_file(*abs / "throughput.dat", data));
  out.pngs.push_back(*abs / "throughput.png");
  std::string script = fmt::format(
      "{}set output {}\nset multiplot layout 1,2 title {}\nset style fill solid 0.8 border -1\n"
      "set boxwidth 0.6\nset yrange [0:*]\nset grid y\nunset key\nset xtics rotate by -30\n"
      "set title 'trained samples/s'\nplot {} using 0:2:xtic(1) with boxes lc rgb '#1f77b4'\n"
      "set title 'generated tokens/s'\nplot {} using 0:3:xtic(1) with boxes lc rgb '#ff7f0e'\nunset multiplot\n\n",
      kPngHeader, gp_quote(out.pngs.back().string()),
      gp_quote(fmt::format("Throughput per schedule ({} GPUs, {} steps)", reports.front().gpus, reports.front().steps)),
      gp_quote((*abs / "throughput.dat").string()), gp_quote((*abs / "throughput.dat").string()));

  // Staleness: a row per bin of versions, a column per schedule with its share of trajectories in
  // the bin. Long tails (an unbounded admission rule) are binned so at most kStalenessBins remain.
  std::size_t kmax = 1;
  for (const SimReport& r : reports) kmax = std::max(kmax, r.staleness_histogram.size());
  const std::size_t width = (kmax + kStalenessBins - 1) / kStalenessBins;
  std::string stale = "versions";
  for (const SimReport& r : reports) stale += fmt::format(" {}", data_quote(r.schedule));
  stale += "\n";
  for (std::size_t lo = 0; lo < kmax; lo += width) {
    const std::size_t hi = std::min(lo + width, kmax) - 1;
    stale += data_quote(lo == hi ? std::to_string(lo) : fmt::format("{}-{}", lo, hi));
    for (const SimReport& r : reports) {
      double n = 0, in_bin = 0;
      for (std::size_t k = 0; k < r.staleness_histogram.size(); ++k) {
        n += static_cast<double>(r.staleness_histogram[k]);
        if (k >= lo && k <= hi) in_bin += static_cast<double>(r.staleness_histogram[k]);
      }
      stale += fmt::format(" {:.9g}", n > 0 ? in_bin / n : 0.0);
    }
    stale += "\n";
  }
  LAMINAR_RETURN_IF_ERROR(write_file(*abs / "staleness.dat", stale));
  out.pngs.push_back(*abs / "staleness.png");
  script += fmt::format(
      "reset\n{}set output {}\nset title 'Staleness: versions between generating a trajectory and training on it'\n"
      "set style data histograms\nset style histogram clustered gap 1\nset style fill solid 0.8 border -1\n"
      "set key autotitle columnhead top right\nset xlabel 'staleness (versions)'\n"
      "set ylabel 'share of trajectories'\nset yrange [0:1]\nset grid y\n"
      "plot for [i=2:{}] {} using i:xtic(1)\n",
      kPngHeader, gp_quote(out.pngs.back().string()), reports.size() + 1, gp_quote((*abs / "staleness.dat").string()));
  LAMINAR_RETURN_IF_ERROR(plot(gnuplot, *abs, "comparison", script, out));
  return out;
}

Result<PlotFiles> write_sweep_plot(const std::vector<SweepPoint>& points, const std::filesystem::path& dir,
                                   const std::string& gnuplot) {
  if (points.empty()) return invalid_argument("sweep plot: no points");
  Result<std::filesystem::path> abs = make_dir(dir);
  if (!abs.ok()) return abs.status();
  PlotFiles out;
  // The ideal line starts at the fastest schedule's point at the smallest GPU count.
  std::int64_t min_gpus = points.front().gpus, max_gpus = points.front().gpus;
  for (const SweepPoint& p : points) {
    min_gpus = std::min(min_gpus, p.gpus);
    max_gpus = std::max(max_gpus, p.gpus);
  }
  double ideal_base = 0;
  std::string data;
  std::vector<std::string> plots;
  const std::string file = gp_quote((*abs / "scaling.dat").string());
  std::string current;
  for (const SweepPoint& p : points) {
    if (p.gpus == min_gpus) ideal_base = std::max(ideal_base, p.generation_tokens_per_s);
    if (p.schedule != current) {
      if (!current.empty()) data += "\n\n";
      data += fmt::format("# {}\n", p.schedule);
      plots.push_back(fmt::format("{} index {} using 1:2 with linespoints lw 2 pt 7 title {}", file, plots.size(),
                                  gp_quote(p.schedule)));
      current = p.schedule;
    }
    data += fmt::format("{} {:.9g}\n", p.gpus, p.generation_tokens_per_s);
  }
  // Log axes need a positive range: the slowest positive point to the fastest or the ideal's end.
  double y_min = 0, y_max = ideal_base * static_cast<double>(max_gpus) / static_cast<double>(min_gpus);
  for (const SweepPoint& p : points) {
    if (p.generation_tokens_per_s > 0 && (y_min == 0 || p.generation_tokens_per_s < y_min)) {
      y_min = p.generation_tokens_per_s;
    }
    y_max = std::max(y_max, p.generation_tokens_per_s);
  }
  const std::string y_range = y_min > 0 ? fmt::format("set yrange [{:.9g}:{:.9g}]\n", y_min / 1.3, y_max * 1.3) : "";
  if (ideal_base > 0) {
    plots.push_back(fmt::format("{:.9g} * x / {} with lines dt 2 lw 1 lc rgb '#000000' title 'ideal linear'",
                                ideal_base, min_gpus));
  }
  LAMINAR_RETURN_IF_ERROR(write_file(*abs / "scaling.dat", data));
  out.pngs.push_back(*abs / "scaling.png");
  const std::string script = fmt::format(
      "{}set output {}\nset title 'Generation throughput against cluster size'\nset xlabel 'GPUs'\n"
      "set ylabel 'generated tokens/s'\nset logscale xy 2\nset format y '%.0s%c'\nset xrange [{}:{}]\n{}"
      "set grid\nset key top left\nplot {}\n",
      kPngHeader, gp_quote(out.pngs.back().string()), static_cast<double>(min_gpus) / 1.2,
      static_cast<double>(max_gpus) * 1.2, y_range, fmt::join(plots, ", \\\n     "));
  LAMINAR_RETURN_IF_ERROR(plot(gnuplot, *abs, "sweep", script, out));
  return out;
}

// --- Progress ---------------------------------------------------------------------------------

ProgressLine::ProgressLine(std::shared_ptr<Clock> clock, std::ostream& out, std::int64_t total_steps)
    : clock_(std::move(clock)), out_(out), total_(total_steps), started_(clock_->now()) {}

std::string ProgressLine::format(std::string_view label, std::int64_t done, std::int64_t total, Duration elapsed) {
  auto whole_seconds = [](double s, bool round_up) {
    const double r = round_up ? std::ceil(std::max(s, 0.0)) : std::floor(std::max(s, 0.0));
    const auto n = static_cast<std::int64_t>(r);
    return n < 60 ? fmt::format("{}s", n) : fmt::format("{}m{:02}s", n / 60, n % 60);
  };
  const double elapsed_s = seconds(elapsed);
  std::string eta = "--";
  if (done > 0) eta = whole_seconds(static_cast<double>(total - done) * elapsed_s / static_cast<double>(done), true);
  return fmt::format("{}  step {}/{}  elapsed {}  ETA {}", label, done, total, whole_seconds(elapsed_s, false), eta);
}

void ProgressLine::update(std::string_view label, std::int64_t steps) {
  done_ = std::min(total_, done_ + steps);
  const Duration now = clock_->now();
  if (last_draw_ && now - *last_draw_ < kRedrawPeriod && done_ < total_) return;
  out_ << '\r' << format(label, done_, total_, now - started_) << "\x1b[K";
  out_.flush();
  last_draw_ = now;
}

void ProgressLine::finish() {
  if (last_draw_) out_ << '\n';
  out_.flush();
  last_draw_.reset();
}

}  // namespace laminar::sim
