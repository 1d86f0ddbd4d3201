#include "report.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gnuplot.h"
#include "text_table.h"

namespace async_grpo {
namespace {

using examples::aligned_table;
using examples::find_program;
using examples::gp_quote;
using examples::run_gnuplot;
using laminar::Duration;
using laminar::Result;
using laminar::Status;

constexpr double kNsPerS = 1e9;

bool has_control_char(std::string_view s) {
  return std::any_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; });
}

bool is_generation(SpanKind k) { return k == SpanKind::kDecode || k == SpanKind::kPrefill; }

Status check_held_out(const HeldOutPoint& p) {
  if (!(p.reward >= 0 && p.reward <= 1)) {
    return laminar::invalid_argument(fmt::format("held-out reward {} of version {} is not in [0, 1]", p.reward, p.version));
  }
  return laminar::ok_status();
}

Status check_run(const ScheduleRun& run) {
  LAMINAR_RETURN_IF_ERROR(check_name("schedule", run.schedule));
  const std::string what = fmt::format("schedule '{}'", run.schedule);
  if (run.start_ns < 0 || run.end_ns <= run.start_ns) {
    return laminar::invalid_argument(
        fmt::format("{}: the run must end after it starts, got start_ns {} end_ns {}", what, run.start_ns,
                    run.end_ns));
  }
  if (run.rollout_workers == 0) return laminar::invalid_argument(what + ": rollout_workers is 0");
  const Records& r = run.records;
  for (const Span& s : r.spans) LAMINAR_RETURN_IF_ERROR(validate_record(s).with_context(what));
  for (const TrajectoryFact& t : r.trajectories) LAMINAR_RETURN_IF_ERROR(validate_record(t).with_context(what));
  for (const RepackEvent& e : r.repacks) LAMINAR_RETURN_IF_ERROR(validate_record(e).with_context(what));
  for (const WeightSync& w : r.syncs) LAMINAR_RETURN_IF_ERROR(validate_record(w).with_context(what));
  for (const RewardPoint& p : r.rewards) {
    LAMINAR_RETURN_IF_ERROR(validate_record(p).with_context(what));
    if (p.time_ns < run.start_ns || p.time_ns > run.end_ns) {
      return laminar::invalid_argument(fmt::format("{}: reward point of version {} at {} ns lies outside the run [{}, {}]",
                                                   what, p.version, p.time_ns, run.start_ns, run.end_ns));
    }
  }
  std::set<std::uint64_t> versions;
  for (const HeldOutPoint& p : run.held_out) {
    LAMINAR_RETURN_IF_ERROR(check_held_out(p).with_context(what));
    if (!versions.insert(p.version).second) {
      return laminar::invalid_argument(fmt::format("{}: held-out version {} appears twice", what, p.version));
    }
    if (p.time_ns < run.start_ns || p.time_ns > run.end_ns) {
      return laminar::invalid_argument(fmt::format("{}: held-out version {} published at {} ns, outside the run [{}, {}]",
                                                   what, p.version, p.time_ns, run.start_ns, run.end_ns));
    }
  }
  return laminar::ok_status();
}

// Busy generation time per worker: its decode and prefill spans clipped to the run, overlaps merged.
Result<double> generation_busy_s(const ScheduleRun& run) {
  std::map<std::pair<std::string, std::uint32_t>, std::vector<std::pair<std::int64_t, std::int64_t>>> by_worker;
  for (const Span& s : run.records.spans) {
    if (!is_generation(s.kind)) continue;
    auto& intervals = by_worker[{s.process, s.worker}];
    std::int64_t a = std::max(s.start_ns, run.start_ns), b = std::min(s.end_ns, run.end_ns);
    if (a < b) intervals.emplace_back(a, b);
  }
  if (by_worker.size() > run.rollout_workers) {
    return laminar::invalid_argument(fmt::format("schedule '{}': {} workers recorded decode or prefill spans, but the run has {} rollout workers",
                                                 run.schedule, by_worker.size(), run.rollout_workers));
  }
  std::int64_t busy_ns = 0;
  for (auto& [worker, intervals] : by_worker) {
    std::sort(intervals.begin(), intervals.end());
    std::int64_t cur_a = 0, cur_b = -1;
    for (auto [a, b] : intervals) {
      if (a > cur_b) {
        if (cur_b > cur_a) busy_ns += cur_b - cur_a;
        cur_a = a;
        cur_b = b;
      } else {
        cur_b = std::max(cur_b, b);
      }
    }
    if (cur_b > cur_a) busy_ns += cur_b - cur_a;
  }
  return static_cast<double>(busy_ns) / kNsPerS;
}

Status write_file(const std::filesystem::path& path, std::string_view text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.close();
  if (!out) return laminar::unavailable(fmt::format("cannot write {}", path.string()));
  return laminar::ok_status();
}

std::string fixed(double v, int digits) { return fmt::format("{:.{}f}", v, digits); }

std::string optional_fixed(const std::optional<double>& v, int digits, std::string_view none) {
  return v ? fixed(*v, digits) : std::string(none);
}

nlohmann::ordered_json optional_json(const std::optional<double>& v) {
  return v ? nlohmann::ordered_json(*v) : nlohmann::ordered_json(nullptr);
}

constexpr std::array<std::string_view, kNumSpanKinds> kKindColours = {
    "#2ca02c", "#98df8a", "#1f77b4", "#ff7f0e", "#ffbb78", "#d62728", "#9467bd", "#c7c7c7"};

// The rows of an activity plot: every (process, worker) with a span, in name order.
std::map<std::pair<std::string, std::uint32_t>, int> activity_rows(const ScheduleRun& run) {
  std::map<std::pair<std::string, std::uint32_t>, int> rows;
  for (const Span& s : run.records.spans) rows.emplace(std::make_pair(s.process, s.worker), 0);
  int i = 0;
  for (auto& [key, row] : rows) row = i++;
  return rows;
}

}  // namespace

// --- Progress ---------------------------------------------------------------------------------

Progress::Mode Progress::mode_for_stdout() { return isatty(STDOUT_FILENO) ? Mode::kInPlace : Mode::kPeriodic; }

Progress::Progress(std::shared_ptr<laminar::Clock> clock, std::ostream& out, Mode mode,
                   std::optional<Duration> period)
    : clock_(std::move(clock)),
      out_(out),
      mode_(mode),
      period_(period.value_or(mode == Mode::kInPlace ? kRedrawPeriod : kLogPeriod)) {}

std::string Progress::format_duration(Duration d) {
  std::int64_t ns = std::max<std::int64_t>(d.count(), 0);
  std::int64_t s = ns / 1'000'000'000 + (ns % 1'000'000'000 != 0 ? 1 : 0);
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}h{:02}m{:02}s", s / 3600, (s / 60) % 60, s % 60);
}

std::string Progress::format_line(std::string_view phase, std::uint64_t done, std::uint64_t total,
                                  std::string_view unit, Duration elapsed) {
  const double elapsed_s = static_cast<double>(elapsed.count()) / kNsPerS;
  const double rate = elapsed_s > 0 ? static_cast<double>(done) / elapsed_s : 0.0;
  std::string line = fmt::format("{}  {}/{} {}  {:.2f} {}/s  ", phase, done, total, unit, rate, unit);
  if (done >= total) return line + "done in " + format_duration(elapsed);
  if (done == 0 || elapsed_s <= 0) return line + "ETA --";
  const double eta_ns = static_cast<double>(total - done) * static_cast<double>(elapsed.count()) /
                        static_cast<double>(done);
  return line + "ETA " + format_duration(Duration(static_cast<std::int64_t>(std::ceil(eta_ns))));
}

void Progress::print_locked(bool final_line) {
  const Duration now = clock_->now();
  std::string line = format_line(phase_, done_, total_, unit_, now - started_);
  if (mode_ == Mode::kInPlace) {
    out_ << '\r' << line << "\x1b[K";
    if (final_line) out_ << '\n';
  } else {
    out_ << line << '\n';
  }
  out_.flush();
  last_print_ = now;
}

Status Progress::begin(std::string phase, std::uint64_t total, std::string unit) {
  if (phase.empty() || has_control_char(phase)) {
    return laminar::invalid_argument(fmt::format("progress: phase name '{}' is empty or holds a control character", phase));
  }
  if (has_control_char(unit)) return laminar::invalid_argument("progress: unit holds a control character");
  if (total == 0) return laminar::invalid_argument(fmt::format("progress: phase '{}' has a total of 0", phase));
  std::lock_guard<std::mutex> lock(mu_);
  if (running_) print_locked(/*final_line=*/true);
  running_ = true;
  phase_ = std::move(phase);
  unit_ = std::move(unit);
  total_ = total;
  done_ = 0;
  started_ = clock_->now();
  print_locked(/*final_line=*/false);
  return laminar::ok_status();
}

Status Progress::update(std::uint64_t done) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!running_) return laminar::failed_precondition("progress: update with no phase begun");
  if (done > total_) {
    return laminar::invalid_argument(fmt::format("progress: phase '{}': done {} is over its total {}", phase_, done, total_));
  }
  if (done < done_) {
    return laminar::invalid_argument(fmt::format("progress: phase '{}': done went down from {} to {}", phase_, done_, done));
  }
  done_ = done;
  if (clock_->now() - last_print_ >= period_) print_locked(/*final_line=*/false);
  return laminar::ok_status();
}

Status Progress::finish() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!running_) return laminar::failed_precondition("progress: finish with no phase begun");
  print_locked(/*final_line=*/true);
  running_ = false;
  return laminar::ok_status();
}

// --- Metrics ----------------------------------------------------------------------------------

Result<double> nearest_rank_percentile(std::vector<double> values, double p) {
  if (values.empty()) return laminar::invalid_argument("percentile of no values");
  if (!(p > 0 && p <= 100)) return laminar::invalid_argument(fmt::format("percentile {} is not in (0, 100]", p));
  std::sort(values.begin(), values.end());
  auto rank = static_cast<std::size_t>(std::ceil(p / 100.0 * static_cast<double>(values.size())));
  return values[std::clamp<std::size_t>(rank, 1, values.size()) - 1];
}

Result<std::vector<HeldOutPoint>> smooth_held_out(std::vector<HeldOutPoint> points, std::size_t window) {
  if (window == 0) return laminar::invalid_argument("held-out smoothing window 0");
  std::sort(points.begin(), points.end(),
            [](const HeldOutPoint& a, const HeldOutPoint& b) { return a.version < b.version; });
  for (std::size_t i = 0; i < points.size(); ++i) {
    LAMINAR_RETURN_IF_ERROR(check_held_out(points[i]));
    if (i > 0 && points[i].version == points[i - 1].version) {
      return laminar::invalid_argument(fmt::format("held-out version {} appears twice", points[i].version));
    }
  }
  const std::size_t w = std::min(window, points.size());
  std::vector<HeldOutPoint> out;
  double sum = 0;
  for (std::size_t i = 0; i < points.size(); ++i) {
    sum += points[i].reward;
    if (i >= w) sum -= points[i - w].reward;
    if (i + 1 >= w) out.push_back({.version = points[i].version, .time_ns = points[i].time_ns,
                                   .reward = sum / static_cast<double>(w)});
  }
  return out;
}

Result<ScheduleMetrics> compute_metrics(const ScheduleRun& run, double target_reward, RewardCurve curve,
                                        std::size_t smoothing) {
  if (!std::isfinite(target_reward)) {
    return laminar::invalid_argument(fmt::format("target reward {} is not finite", target_reward));
  }
  LAMINAR_RETURN_IF_ERROR(check_run(run));
  ScheduleMetrics m;
  m.schedule = run.schedule;
  m.actor_blas = run.actor_blas;
  m.wall_s = static_cast<double>(run.end_ns - run.start_ns) / kNsPerS;

  std::vector<RewardPoint> rewards = run.records.rewards;
  std::stable_sort(rewards.begin(), rewards.end(),
                   [](const RewardPoint& a, const RewardPoint& b) { return a.time_ns < b.time_ns; });
  if (!rewards.empty()) m.final_training_reward = rewards.back().mean_reward;
  Result<std::vector<HeldOutPoint>> smoothed = smooth_held_out(run.held_out, smoothing);
  if (!smoothed.ok()) return smoothed.status().with_context(fmt::format("schedule '{}'", run.schedule));
  m.held_out_versions = run.held_out.size();
  if (!run.held_out.empty()) {
    m.first_held_out = std::min_element(run.held_out.begin(), run.held_out.end(), [](const auto& a, const auto& b) {
                         return a.version < b.version;
                       })->reward;
    m.final_held_out = smoothed->back().reward;
  }
  auto reached = [&](std::int64_t time_ns, double reward) {
    if (m.time_to_target_s || reward < target_reward) return;
    m.time_to_target_s = static_cast<double>(time_ns - run.start_ns) / kNsPerS;
  };
  if (curve == RewardCurve::kHeldOut) {
    for (const HeldOutPoint& p : *smoothed) reached(p.time_ns, p.reward);
  } else {
    for (const RewardPoint& p : rewards) reached(p.time_ns, p.mean_reward);
  }

  for (const TrajectoryFact& t : run.records.trajectories) {
    ++m.trained_samples;
    m.trained_tokens += t.length;
    ++m.staleness[std::min<std::uint64_t>(t.trained_version - t.behaviour_version, 3)];
  }
  m.samples_per_s = static_cast<double>(m.trained_samples) / m.wall_s;
  m.tokens_per_s = static_cast<double>(m.trained_tokens) / m.wall_s;

  Result<double> busy = generation_busy_s(run);
  if (!busy.ok()) return busy.status();
  m.generation_utilisation = *busy / (static_cast<double>(run.rollout_workers) * m.wall_s);

  m.repacks = run.records.repacks.size();
  for (const RepackEvent& e : run.records.repacks) m.moved_sequences += e.moved_sequences;

  if (!run.records.syncs.empty()) {
    std::vector<double> ms;
    for (const WeightSync& w : run.records.syncs) ms.push_back(static_cast<double>(w.end_ns - w.start_ns) / 1e6);
    m.weight_sync_p50_ms = nearest_rank_percentile(ms, 50).value();
    m.weight_sync_p99_ms = nearest_rank_percentile(std::move(ms), 99).value();
  }
  // A step's wait is the last one that ended by the step's start.
  const ActorWaits aw = actor_waits(run.records);
  const auto& waits = aw.by_end_ns;
  std::vector<double> train_ms, ready_ms, after_wait_ms;
  const double waiting_ms = static_cast<double>(aw.total_ns) / 1e6;
  double training_ms = 0;
  for (const Span& sp : run.records.spans) {
    if (sp.kind != SpanKind::kTrain) continue;
    const double ms = static_cast<double>(sp.end_ns - sp.start_ns) / 1e6;
    train_ms.push_back(ms);
    training_ms += ms;
    if (sp.tokens == 0) continue;
    const auto wait = waits.upper_bound(sp.start_ns);
    const bool waited = wait != waits.begin() && std::prev(wait)->second >= kReadyWaitNs;
    (waited ? after_wait_ms : ready_ms).push_back(ms / static_cast<double>(sp.tokens));
  }
  if (waiting_ms + training_ms > 0) m.actor_waiting_share = waiting_ms / (waiting_ms + training_ms);
  if (!waits.empty() && !rewards.empty()) {
    const std::int64_t loop_ns = rewards.back().time_ns - aw.first_start_ns;
    if (loop_ns > 0) {
      m.loop_samples_per_s = static_cast<double>(m.trained_samples) * kNsPerS / static_cast<double>(loop_ns);
      m.actor_waiting_share = std::min(1.0, waiting_ms * 1e6 / static_cast<double>(loop_ns));
    }
  }
  m.predicted_samples_per_s = run.predicted_samples_per_s;
  m.predicted_waiting_share = run.predicted_waiting_share;
  if (!train_ms.empty()) m.train_step_p50_ms = nearest_rank_percentile(std::move(train_ms), 50).value();
  if (!ready_ms.empty()) m.train_ms_per_token_ready_p50 = nearest_rank_percentile(std::move(ready_ms), 50).value();
  if (!after_wait_ms.empty()) {
    m.train_ms_per_token_after_wait_p50 = nearest_rank_percentile(std::move(after_wait_ms), 50).value();
  }
  return m;
}

Result<Comparison> compare(const std::vector<ScheduleRun>& runs, const ReportOptions& options) {
  if (runs.empty()) return laminar::invalid_argument("report: no schedule runs");
  std::set<std::string> names;
  const ScheduleRun* baseline = nullptr;
  for (const ScheduleRun& run : runs) {
    LAMINAR_RETURN_IF_ERROR(check_run(run));
    if (!names.insert(run.schedule).second) {
      return laminar::invalid_argument(fmt::format("report: schedule '{}' appears twice", run.schedule));
    }
    if (run.schedule == options.baseline) baseline = &run;
  }
  if (options.smoothing == 0) return laminar::invalid_argument("report: smoothing 0");
  Comparison c;
  c.baseline = options.baseline;
  c.contender = options.contender;
  c.smoothing = options.smoothing;
  c.pacing = options.pacing;
  const bool held_out = std::any_of(runs.begin(), runs.end(), [](const ScheduleRun& r) { return !r.held_out.empty(); });
  c.curve = held_out ? RewardCurve::kHeldOut : RewardCurve::kTraining;
  if (options.target_reward) {
    c.target_reward = *options.target_reward;
  } else if (held_out) {
    if (baseline == nullptr || baseline->held_out.empty()) {
      return laminar::invalid_argument(fmt::format(
          "report: no target reward given and no baseline schedule '{}' with held-out points to take it from",
          options.baseline));
    }
    Result<std::vector<HeldOutPoint>> smoothed = smooth_held_out(baseline->held_out, options.smoothing);
    if (!smoothed.ok()) return smoothed.status();
    c.target_reward = smoothed->back().reward;
  } else {
    if (baseline == nullptr || baseline->records.rewards.empty()) {
      return laminar::invalid_argument(fmt::format(
          "report: no target reward given and no baseline schedule '{}' with a reward point to take it from",
          options.baseline));
    }
    const auto last = std::max_element(
        baseline->records.rewards.begin(), baseline->records.rewards.end(),
        [](const RewardPoint& a, const RewardPoint& b) { return a.time_ns < b.time_ns; });
    c.target_reward = last->mean_reward;
  }
  std::optional<double> base_t, cont_t;
  for (const ScheduleRun& run : runs) {
    Result<ScheduleMetrics> m = compute_metrics(run, c.target_reward, c.curve, c.smoothing);
    if (!m.ok()) return m.status();
    if (run.schedule == options.baseline) base_t = m->time_to_target_s;
    if (run.schedule == options.contender) cont_t = m->time_to_target_s;
    c.schedules.push_back(std::move(*m));
  }
  // A schedule against itself is no comparison: its target is only its own final reward.
  if (base_t && cont_t && *cont_t > 0 && c.baseline != c.contender) c.speedup = *base_t / *cont_t;
  return c;
}

// --- Output -----------------------------------------------------------------------------------

std::string format_table(const Comparison& c) {
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> header = {""};
  for (const ScheduleMetrics& m : c.schedules) header.push_back(m.schedule);
  rows.push_back(header);
  auto row = [&](std::string label, auto cell) {
    std::vector<std::string> r = {std::move(label)};
    for (const ScheduleMetrics& m : c.schedules) r.push_back(cell(m));
    rows.push_back(std::move(r));
  };
  row("wall time (s)", [](const ScheduleMetrics& m) { return fixed(m.wall_s, 1); });
  const std::string curve = c.curve == RewardCurve::kHeldOut ? "held-out reward" : "training reward";
  row(fmt::format("time to {} {:.3f} (s)", curve, c.target_reward),
      [](const ScheduleMetrics& m) { return optional_fixed(m.time_to_target_s, 1, "not reached"); });
  row("trained samples/s", [](const ScheduleMetrics& m) { return fixed(m.samples_per_s, 2); });
  row("trained tokens/s", [](const ScheduleMetrics& m) { return fixed(m.tokens_per_s, 1); });
  row("generation utilisation", [](const ScheduleMetrics& m) { return fixed(100 * m.generation_utilisation, 1) + "%"; });
  row("actor waiting for samples", [](const ScheduleMetrics& m) {
    return m.actor_waiting_share ? fixed(100 * *m.actor_waiting_share, 1) + "%" : std::string("-");
  });
  row("simulator: samples/s in the loop, predicted", [](const ScheduleMetrics& m) {
    if (!m.predicted_samples_per_s || !m.loop_samples_per_s) return std::string("-");
    return fmt::format("{:.1f} ({:+.0f}%)", *m.predicted_samples_per_s,
                       100 * (*m.predicted_samples_per_s / *m.loop_samples_per_s - 1));
  });
  row("simulator: samples/s in the loop, measured",
      [](const ScheduleMetrics& m) { return optional_fixed(m.loop_samples_per_s, 1, "-"); });
  row("simulator: actor waiting, predicted", [](const ScheduleMetrics& m) {
    return m.predicted_waiting_share ? fixed(100 * *m.predicted_waiting_share, 1) + "%" : std::string("-");
  });
  static constexpr std::array<std::string_view, 4> kStale = {"= 0", "= 1", "= 2", ">= 3"};
  for (std::size_t i = 0; i < kStale.size(); ++i) {
    row(fmt::format("staleness {}", kStale[i]), [i](const ScheduleMetrics& m) {
      if (m.trained_samples == 0) return std::string("0");
      return fmt::format("{} ({:.1f}%)", m.staleness[i],
                         100.0 * static_cast<double>(m.staleness[i]) / static_cast<double>(m.trained_samples));
    });
  }
  row("repacks", [](const ScheduleMetrics& m) { return std::to_string(m.repacks); });
  row("moved sequences", [](const ScheduleMetrics& m) { return std::to_string(m.moved_sequences); });
  row("weight sync p50 (ms)", [](const ScheduleMetrics& m) { return optional_fixed(m.weight_sync_p50_ms, 2, "-"); });
  row("weight sync p99 (ms)", [](const ScheduleMetrics& m) { return optional_fixed(m.weight_sync_p99_ms, 2, "-"); });
  row("actor training step p50 (ms)", [](const ScheduleMetrics& m) { return optional_fixed(m.train_step_p50_ms, 1, "-"); });
  row("step ms/token p50, batch ready",
      [](const ScheduleMetrics& m) { return optional_fixed(m.train_ms_per_token_ready_p50, 3, "-"); });
  row(fmt::format("step ms/token p50, after a wait >= {:g} s", static_cast<double>(kReadyWaitNs) / kNsPerS),
      [](const ScheduleMetrics& m) { return optional_fixed(m.train_ms_per_token_after_wait_p50, 3, "-"); });
  row("held-out reward, first version", [](const ScheduleMetrics& m) { return optional_fixed(m.first_held_out, 3, "-"); });
  row(fmt::format("held-out reward, last {} versions", c.smoothing),
      [](const ScheduleMetrics& m) { return optional_fixed(m.final_held_out, 3, "-"); });
  row("versions evaluated", [](const ScheduleMetrics& m) { return std::to_string(m.held_out_versions); });
  row("last step's training reward", [](const ScheduleMetrics& m) { return optional_fixed(m.final_training_reward, 3, "-"); });

  std::string out = aligned_table(rows, true);
  const ScheduleMetrics* base = nullptr;
  const ScheduleMetrics* cont = nullptr;
  for (const ScheduleMetrics& m : c.schedules) {
    if (m.schedule == c.baseline) base = &m;
    if (m.schedule == c.contender) cont = &m;
  }
  if (c.speedup) {
    out += fmt::format("{} reaches {} {:.3f} {:.2f}x as fast as {} ({:.1f} s against {:.1f} s)\n", c.contender,
                       curve, c.target_reward, *c.speedup, c.baseline, *cont->time_to_target_s, *base->time_to_target_s);
  } else if (c.baseline == c.contender) {
    out += fmt::format("one schedule: the target is {}'s own final {} (--schedule compare or all compares schedules)\n",
                       c.baseline, curve);
  } else if (base != nullptr && cont != nullptr) {
    out += fmt::format("no speedup of {} over {}: {} did not reach {} {:.3f}\n", c.contender, c.baseline,
                       cont->time_to_target_s ? c.baseline : c.contender, curve, c.target_reward);
  }
  if (c.curve == RewardCurve::kHeldOut) {
    out += fmt::format("held-out reward: each published version's, moving average over {} versions, against its "
                       "publish time\n", c.smoothing);
  }
  out += "actor waiting for samples: its share of its training loop; under sync, generation's share of a step\n";
  out += "simulator: examples/async_grpo/predict.h replays the run's groups through a model of its workers, "
         "pacing, dispatcher and actor (error against the training loop's measured rate)\n";
  out += fmt::format("rollout pacing: {}\n", c.pacing.empty() ? "none" : c.pacing);
  // One line when every actor ran on the same BLAS, else one per schedule.
  std::set<std::string> blas;
  for (const ScheduleMetrics& m : c.schedules)
    if (!m.actor_blas.empty()) blas.insert(m.actor_blas);
  if (blas.size() == 1) {
    out += fmt::format("actor BLAS: {}\n", *blas.begin());
  } else {
    for (const ScheduleMetrics& m : c.schedules)
      if (!m.actor_blas.empty()) out += fmt::format("actor BLAS ({}): {}\n", m.schedule, m.actor_blas);
  }
  return out;
}

std::string metrics_json(const Comparison& c) {
  using nlohmann::ordered_json;
  ordered_json schedules = ordered_json::array();
  for (const ScheduleMetrics& m : c.schedules) {
    schedules.push_back({{"schedule", m.schedule},
                         {"wall_s", m.wall_s},
                         {"time_to_target_s", optional_json(m.time_to_target_s)},
                         {"trained_samples", m.trained_samples},
                         {"trained_tokens", m.trained_tokens},
                         {"samples_per_s", m.samples_per_s},
                         {"tokens_per_s", m.tokens_per_s},
                         {"generation_utilisation", m.generation_utilisation},
                         {"actor_waiting_share", optional_json(m.actor_waiting_share)},
                         {"loop_samples_per_s", optional_json(m.loop_samples_per_s)},
                         {"predicted_samples_per_s", optional_json(m.predicted_samples_per_s)},
                         {"predicted_waiting_share", optional_json(m.predicted_waiting_share)},
                         {"staleness", {{"0", m.staleness[0]}, {"1", m.staleness[1]}, {"2", m.staleness[2]},
                                        {"3+", m.staleness[3]}}},
                         {"repacks", m.repacks},
                         {"moved_sequences", m.moved_sequences},
                         {"weight_sync_p50_ms", optional_json(m.weight_sync_p50_ms)},
                         {"weight_sync_p99_ms", optional_json(m.weight_sync_p99_ms)},
                         {"train_step_p50_ms", optional_json(m.train_step_p50_ms)},
                         {"train_ms_per_token_ready_p50", optional_json(m.train_ms_per_token_ready_p50)},
                         {"train_ms_per_token_after_wait_p50", optional_json(m.train_ms_per_token_after_wait_p50)},
                         {"final_training_reward", optional_json(m.final_training_reward)},
                         {"held_out_versions", m.held_out_versions},
                         {"first_held_out", optional_json(m.first_held_out)},
                         {"final_held_out", optional_json(m.final_held_out)},
                         {"actor_blas", m.actor_blas}});
  }
  ordered_json j = {{"target_reward", c.target_reward},
                    {"curve", c.curve == RewardCurve::kHeldOut ? "held_out" : "training"},
                    {"smoothing", c.smoothing},
                    {"pacing", c.pacing},
                    {"baseline", c.baseline},
                    {"contender", c.contender},
                    {"speedup", optional_json(c.speedup)},
                    {"schedules", std::move(schedules)}};
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

Result<std::string> trace_json(const ScheduleRun& run) {
  LAMINAR_RETURN_IF_ERROR(check_run(run));
  using nlohmann::ordered_json;
  std::map<std::string, int> pids;
  std::set<std::pair<int, std::uint32_t>> threads;
  for (const Span& s : run.records.spans) pids.emplace(s.process, 0);
  int next = 1;
  for (auto& [name, pid] : pids) pid = next++;
  ordered_json events = ordered_json::array();
  for (const auto& [name, pid] : pids) {
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"args", {{"name", name}}}});
  }
  for (const Span& s : run.records.spans) {
    const int pid = pids.at(s.process);
    if (threads.emplace(pid, s.worker).second) {
      events.push_back({{"name", "thread_name"},
                        {"ph", "M"},
                        {"pid", pid},
                        {"tid", s.worker},
                        {"args", {{"name", fmt::format("worker {}", s.worker)}}}});
    }
    events.push_back({{"name", span_kind_name(s.kind)},
                      {"cat", run.schedule},
                      {"ph", "X"},
                      {"pid", pid},
                      {"tid", s.worker},
                      {"ts", static_cast<double>(s.start_ns - run.start_ns) / 1e3},
                      {"dur", static_cast<double>(s.end_ns - s.start_ns) / 1e3},
                      {"args", {{"version", s.version}, {"sequences", s.sequences}, {"bytes", s.bytes},
                                {"tokens", s.tokens}}}});
  }
  ordered_json j = {{"displayTimeUnit", "ms"}, {"traceEvents", std::move(events)}};
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

Result<PlotFiles> write_plots(const std::vector<ScheduleRun>& runs, const std::filesystem::path& dir,
                              const std::string& gnuplot, std::size_t smoothing) {
  if (smoothing == 0) return laminar::invalid_argument("plots: smoothing 0");
  for (const ScheduleRun& run : runs) LAMINAR_RETURN_IF_ERROR(check_run(run));
  PlotFiles out;
  std::optional<std::filesystem::path> program = find_program(gnuplot);
  if (!program) {
    out.note = fmt::format("gnuplot ('{}') not found: plots skipped (install gnuplot-nox for PNG plots)", gnuplot);
    return out;
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::filesystem::path abs = ec ? dir : std::filesystem::absolute(dir, ec);
  if (ec) return laminar::unavailable(fmt::format("cannot create {}: {}", dir.string(), ec.message()));

  std::string script;
  std::vector<std::string> skipped;

  // Held-out reward against publish time: per schedule, a block of each version's reward and one
  // of its moving average, in one colour.
  std::string held_data;
  std::vector<std::string> held_plots;
  int blocks = 0;
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const ScheduleRun& run = runs[i];
    if (run.held_out.empty()) continue;
    Result<std::vector<HeldOutPoint>> smoothed = smooth_held_out(run.held_out, smoothing);
    if (!smoothed.ok()) return smoothed.status();
    std::vector<HeldOutPoint> raw = run.held_out;
    std::sort(raw.begin(), raw.end(), [](const HeldOutPoint& a, const HeldOutPoint& b) { return a.version < b.version; });
    for (const std::vector<HeldOutPoint>* curve : {&raw, &*smoothed}) {
      held_data += fmt::format("# {} {}\n", run.schedule, curve == &raw ? "per version" : "moving average");
      for (const HeldOutPoint& p : *curve) {
        held_data += fmt::format("{:.6f} {:.9g} {}\n", static_cast<double>(p.time_ns - run.start_ns) / kNsPerS,
                                 p.reward, p.version);
      }
      held_data += "\n\n";
    }
    const std::string data = gp_quote((abs / "held_out.dat").string());
    held_plots.push_back(fmt::format("{} index {} using 1:2 with points pt 7 ps 0.6 lc {} title {}", data, blocks,
                                     i + 1, gp_quote(run.schedule + ", each version")));
    held_plots.push_back(fmt::format("{} index {} using 1:2 with lines lw 2 lc {} title {}", data, blocks + 1, i + 1,
                                     gp_quote(fmt::format("{}, mean of {} versions", run.schedule, smoothing))));
    blocks += 2;
  }
  // A reward plot against wall time: its data file, PNG and gnuplot commands, or why it is missing.
  auto line_plot = [&](const std::string& name, const std::string& data_file, const std::string& data,
                       const std::vector<std::string>& plots, std::string_view title, std::string_view ylabel,
                       std::string_view missing) -> Status {
    if (plots.empty()) {
      skipped.push_back(fmt::format("{}.png ({})", name, missing));
      return laminar::ok_status();
    }
    LAMINAR_RETURN_IF_ERROR(write_file(abs / data_file, data));
    out.pngs.push_back(abs / (name + ".png"));
    script += fmt::format(
        "reset\nset terminal pngcairo size 1000,600 noenhanced\nset output {}\nset title '{}'\n"
        "set xlabel 'wall time (s)'\nset xrange [0:*]\nset ylabel '{}'\nset grid\nset key bottom right\n"
        "plot {}\n\n",
        gp_quote(out.pngs.back().string()), title, ylabel, fmt::join(plots, ", \\\n     "));
    return laminar::ok_status();
  };
  LAMINAR_RETURN_IF_ERROR(line_plot("reward", "held_out.dat", held_data, held_plots,
                                    "Held-out reward of each published version against its publish time",
                                    "held-out reward", "no held-out evaluations"));

  // Training reward against wall time: one data block (index) per schedule with reward points.
  std::string reward_data;
  std::vector<std::string> reward_plots;
  for (const ScheduleRun& run : runs) {
    std::vector<RewardPoint> rewards = run.records.rewards;
    if (rewards.empty()) continue;
    std::stable_sort(rewards.begin(), rewards.end(),
                     [](const RewardPoint& a, const RewardPoint& b) { return a.time_ns < b.time_ns; });
    reward_data += fmt::format("# {}\n", run.schedule);
    for (const RewardPoint& p : rewards) {
      reward_data += fmt::format("{:.6f} {:.9g}\n", static_cast<double>(p.time_ns - run.start_ns) / kNsPerS,
                                 p.mean_reward);
    }
    reward_data += "\n\n";
    reward_plots.push_back(fmt::format("{} index {} using 1:2 with linespoints lw 2 title {}",
                                       gp_quote((abs / "training_reward.dat").string()), reward_plots.size(),
                                       gp_quote(run.schedule)));
  }
  LAMINAR_RETURN_IF_ERROR(line_plot(
      "training_reward", "training_reward.dat", reward_data, reward_plots,
      "Training reward of each step (mean over the samples it trained on) against wall time", "mean training reward",
      "no reward points"));

  // Activity: a row per worker, a box per span (x centre, row, half width), a data block per kind.
  for (const ScheduleRun& run : runs) {
    if (run.records.spans.empty()) {
      skipped.push_back(fmt::format("activity_{}.png (no spans)", run.schedule));
      continue;
    }
    const auto rows = activity_rows(run);
    const std::filesystem::path data = abs / fmt::format("activity_{}.dat", run.schedule);
    std::string text;
    std::vector<std::string> plots;
    for (int k = 0; k < kNumSpanKinds; ++k) {
      std::string block;
      for (const Span& s : run.records.spans) {
        if (static_cast<int>(s.kind) != k) continue;
        const double a = static_cast<double>(s.start_ns - run.start_ns) / kNsPerS;
        const double b = static_cast<double>(s.end_ns - run.start_ns) / kNsPerS;
        block += fmt::format("{:.9g} {} {:.9g}\n", (a + b) / 2, rows.at({s.process, s.worker}), (b - a) / 2);
      }
      if (block.empty()) continue;
      text += block + "\n\n";
      plots.push_back(fmt::format("{} index {} using 1:2:3:(0.35) with boxxyerror lc rgb '{}' title '{}'",
                                  gp_quote(data.string()), plots.size(), kKindColours[static_cast<std::size_t>(k)],
                                  span_kind_name(static_cast<SpanKind>(k))));
    }
    LAMINAR_RETURN_IF_ERROR(write_file(data, text));
    std::vector<std::string> tics;
    for (const auto& [key, row] : rows) tics.push_back(fmt::format("'{}/{}' {}", key.first, key.second, row));
    out.pngs.push_back(abs / fmt::format("activity_{}.png", run.schedule));
    script += fmt::format(
        "reset\nset terminal pngcairo size 1200,{} noenhanced\nset output {}\n"
        "set title {}\nset xlabel 'wall time (s)'\nset xrange [0:{:.9g}]\nset yrange [-0.6:{}]\nset ytics ({})\n"
        "set style fill solid 1.0 noborder\nset key outside right top\nset grid x\nplot {}\n\n",
        160 + 40 * rows.size(), gp_quote(out.pngs.back().string()),
        gp_quote(fmt::format("Worker activity: {}", run.schedule)),
        static_cast<double>(run.end_ns - run.start_ns) / kNsPerS, static_cast<double>(rows.size()) - 0.4,
        fmt::join(tics, ", "), fmt::join(plots, ", \\\n     "));
  }

  if (!skipped.empty()) out.note = fmt::format("plots skipped: {}", fmt::join(skipped, ", "));
  if (script.empty()) return out;
  const std::filesystem::path gp = abs / "plots.gp";
  LAMINAR_RETURN_IF_ERROR(write_file(gp, script));
  LAMINAR_RETURN_IF_ERROR(run_gnuplot(*program, gp, abs / "gnuplot.log"));
  return out;
}

Result<ReportFiles> write_report(const std::vector<ScheduleRun>& runs, const ReportOptions& options,
                                 const std::filesystem::path& dir) {
  Result<Comparison> c = compare(runs, options);
  if (!c.ok()) return c.status();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return laminar::unavailable(fmt::format("cannot create {}: {}", dir.string(), ec.message()));
  ReportFiles files;
  files.comparison = *c;
  files.table = format_table(*c);
  files.table_txt = dir / "table.txt";
  LAMINAR_RETURN_IF_ERROR(write_file(files.table_txt, files.table));
  files.metrics = dir / "metrics.json";
  LAMINAR_RETURN_IF_ERROR(write_file(files.metrics, metrics_json(*c)));
  for (const ScheduleRun& run : runs) {
    Result<std::string> trace = trace_json(run);
    if (!trace.ok()) return trace.status();
    files.traces.push_back(dir / fmt::format("trace_{}.json", run.schedule));
    LAMINAR_RETURN_IF_ERROR(write_file(files.traces.back(), *trace));
  }
  Result<PlotFiles> plots = write_plots(runs, dir, options.gnuplot, options.smoothing);
  if (!plots.ok()) return plots.status();
  files.plots = std::move(plots->pngs);
  files.plot_note = std::move(plots->note);
  return files;
}

// --- Seeds ------------------------------------------------------------------------------------

std::optional<Spread> spread(std::vector<double> values) {
  if (values.empty()) return std::nullopt;
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  const double median = n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
  return Spread{.median = median, .min = values.front(), .max = values.back()};
}

Result<SeedSummary> summarize_seeds(const std::vector<std::uint64_t>& seeds, const std::vector<Comparison>& comparisons) {
  if (seeds.empty()) return laminar::invalid_argument("seed summary: no seeds");
  if (seeds.size() != comparisons.size()) {
    return laminar::invalid_argument(
        fmt::format("seed summary: {} seeds but {} comparisons", seeds.size(), comparisons.size()));
  }
  if (std::set<std::uint64_t>(seeds.begin(), seeds.end()).size() != seeds.size())
    return laminar::invalid_argument("seed summary: a seed appears twice");
  SeedSummary out;
  out.baseline = comparisons.front().baseline;
  out.seeds = seeds;
  struct Values {
    std::vector<double> time, speedup, rate, rate_ratio, fresh, waiting, step_ratio;
    std::size_t seeds = 0, reached = 0;
  };
  std::vector<std::string> order;
  std::map<std::string, Values> by_schedule;
  for (std::size_t i = 0; i < comparisons.size(); ++i) {
    const Comparison& c = comparisons[i];
    if (c.baseline != out.baseline) {
      return laminar::invalid_argument(fmt::format("seed summary: seed {} compares against '{}', not '{}'", seeds[i],
                                                   c.baseline, out.baseline));
    }
    const ScheduleMetrics* base = nullptr;
    for (const ScheduleMetrics& m : c.schedules)
      if (m.schedule == c.baseline) base = &m;
    for (const ScheduleMetrics& m : c.schedules) {
      if (!by_schedule.contains(m.schedule)) order.push_back(m.schedule);
      Values& v = by_schedule[m.schedule];
      ++v.seeds;
      if (m.time_to_target_s) {
        ++v.reached;
        v.time.push_back(*m.time_to_target_s);
      }
      if (base != nullptr && base->time_to_target_s && *base->time_to_target_s > 0) {
        v.speedup.push_back(m.time_to_target_s && *m.time_to_target_s > 0
                                ? *base->time_to_target_s / *m.time_to_target_s
                                : 0.0);
      }
      v.rate.push_back(m.samples_per_s);
      if (base != nullptr && base->samples_per_s > 0) v.rate_ratio.push_back(m.samples_per_s / base->samples_per_s);
      if (m.trained_samples > 0) {
        v.fresh.push_back(static_cast<double>(m.staleness[0] + m.staleness[1]) /
                          static_cast<double>(m.trained_samples));
      }
      if (m.actor_waiting_share) v.waiting.push_back(*m.actor_waiting_share);
      if (base != nullptr && base->train_step_p50_ms && m.train_step_p50_ms && *base->train_step_p50_ms > 0)
        v.step_ratio.push_back(*m.train_step_p50_ms / *base->train_step_p50_ms);
    }
  }
  for (const std::string& name : order) {
    Values& v = by_schedule[name];
    out.schedules.push_back({.schedule = name,
                             .seeds = v.seeds,
                             .reached = v.reached,
                             .time_to_target_s = spread(v.time),
                             .speedup = spread(v.speedup),
                             .samples_per_s = spread(v.rate).value(),
                             .samples_per_s_ratio = spread(v.rate_ratio),
                             .at_most_one_stale = spread(v.fresh),
                             .actor_waiting_share = spread(v.waiting),
                             .train_step_ratio = spread(v.step_ratio)});
  }
  return out;
}

namespace {

std::string spread_cell(const std::optional<Spread>& s, int digits, std::string_view unit, double scale = 1,
                        std::string_view none = "-") {
  if (!s) return std::string(none);
  return fmt::format("{:.{}f}{} [{:.{}f}, {:.{}f}]", s->median * scale, digits, unit, s->min * scale, digits,
                     s->max * scale, digits);
}

nlohmann::ordered_json spread_json(const std::optional<Spread>& s) {
  if (!s) return nullptr;
  return {{"median", s->median}, {"min", s->min}, {"max", s->max}};
}

}  // namespace

std::string format_seed_table(const SeedSummary& summary) {
  std::vector<std::vector<std::string>> rows;
  std::vector<std::string> header = {fmt::format("{} seeds: median [min, max]", summary.seeds.size())};
  for (const SeedScheduleSummary& m : summary.schedules) header.push_back(m.schedule);
  rows.push_back(header);
  auto row = [&](std::string label, auto cell) {
    std::vector<std::string> r = {std::move(label)};
    for (const SeedScheduleSummary& m : summary.schedules) r.push_back(cell(m));
    rows.push_back(std::move(r));
  };
  row(fmt::format("time to {}'s final held-out reward (s)", summary.baseline), [](const SeedScheduleSummary& m) {
    return fmt::format("{} ({}/{} reached)", spread_cell(m.time_to_target_s, 1, ""), m.reached, m.seeds);
  });
  row(fmt::format("sooner than {} (x; 0: not reached)", summary.baseline),
      [](const SeedScheduleSummary& m) { return spread_cell(m.speedup, 2, "x"); });
  row("trained samples/s", [](const SeedScheduleSummary& m) { return spread_cell(m.samples_per_s, 1, ""); });
  row(fmt::format("trained samples/s / {}'s", summary.baseline),
      [](const SeedScheduleSummary& m) { return spread_cell(m.samples_per_s_ratio, 2, "x"); });
  row("samples at most 1 version stale",
      [](const SeedScheduleSummary& m) { return spread_cell(m.at_most_one_stale, 0, "%", 100); });
  row("actor waiting for samples",
      [](const SeedScheduleSummary& m) { return spread_cell(m.actor_waiting_share, 0, "%", 100); });
  row(fmt::format("actor training step / {}'s", summary.baseline),
      [](const SeedScheduleSummary& m) { return spread_cell(m.train_step_ratio, 2, "x"); });
  std::string out = aligned_table(rows, false);
  out += fmt::format("seeds {}; each seed's target is its {} run's final held-out reward\n",
                     fmt::join(summary.seeds, ", "), summary.baseline);
  return out;
}

std::string seed_summary_json(const SeedSummary& summary) {
  using nlohmann::ordered_json;
  ordered_json schedules = ordered_json::array();
  for (const SeedScheduleSummary& m : summary.schedules) {
    schedules.push_back({{"schedule", m.schedule},
                         {"seeds", m.seeds},
                         {"reached", m.reached},
                         {"time_to_target_s", spread_json(m.time_to_target_s)},
                         {"speedup", spread_json(m.speedup)},
                         {"samples_per_s", spread_json(m.samples_per_s)},
                         {"samples_per_s_ratio", spread_json(m.samples_per_s_ratio)},
                         {"at_most_one_stale", spread_json(m.at_most_one_stale)},
                         {"actor_waiting_share", spread_json(m.actor_waiting_share)},
                         {"train_step_ratio", spread_json(m.train_step_ratio)}});
  }
  ordered_json j = {{"baseline", summary.baseline}, {"seeds", summary.seeds}, {"schedules", std::move(schedules)}};
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

}  // namespace async_grpo
