// report.h: what the user of the asynchronous GRPO run sees: a progress line per phase while it
// runs, then, from the records every process wrote (records.h), a table comparing the schedules, a
// metrics JSON, a Chrome/Perfetto trace per schedule and gnuplot PNGs.
//
// The launcher reads each schedule's record files into a ScheduleRun and hands them all over:
//
//   std::vector<async_grpo::ScheduleRun> runs = ...;  // {"sync", start_ns, end_ns, workers, records}, ...
//   laminar::Result<async_grpo::ReportFiles> files = async_grpo::write_report(runs, {}, out_dir);
//   if (!files.ok()) return fail(files.status());
//   std::cout << files->table;                          // also out_dir/table.txt
//   if (!files->plot_note.empty()) std::cout << files->plot_note << "\n";  // e.g. gnuplot missing
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "laminar/clock.h"
#include "laminar/status.h"
#include "records.h"

namespace async_grpo {

// One phase at a time ("warm-up", "sync", "laminar", ...): "<phase>  <done>/<total> <unit>  <rate>
// <unit>/s  ETA <t>". On a terminal the line is redrawn in place; elsewhere (CI logs) a line is
// printed every `period`. Thread-safe.
//
//   async_grpo::Progress p(laminar::Clock::steady(), std::cout, async_grpo::Progress::mode_for_stdout());
//   Status st = p.begin("sync", 400, "samples");
//   st = p.update(120);  // redraws or prints when due
//   st = p.finish();     // the final line with its total time, and a newline
class Progress {
 public:
  enum class Mode {
    kInPlace,   // a terminal: '\r', the line, erase to its end
    kPeriodic,  // a log: one full line every `period`
  };
  // kInPlace when stdout is a terminal.
  static Mode mode_for_stdout();

  static constexpr laminar::Duration kLogPeriod = std::chrono::seconds(10);
  static constexpr laminar::Duration kRedrawPeriod = std::chrono::milliseconds(250);
  // `period`: the log interval (kPeriodic) or the least time between redraws (kInPlace); by
  // default kLogPeriod or kRedrawPeriod.
  Progress(std::shared_ptr<laminar::Clock> clock, std::ostream& out, Mode mode,
           std::optional<laminar::Duration> period = std::nullopt);

  // Starts a phase (finishing the one before, if any) and prints its first line.
  // kInvalidArgument: empty phase, total 0, or a unit or phase holding a control character.
  laminar::Status begin(std::string phase, std::uint64_t total, std::string unit);
  // Preconditions: a phase is running; done <= total; done never goes down.
  // kFailedPrecondition with no phase; kInvalidArgument otherwise.
  laminar::Status update(std::uint64_t done);
  // Prints the phase's final line. kFailedPrecondition with no phase.
  laminar::Status finish();

  // The line for `done` of `total` after `elapsed`: rate = done / elapsed, ETA = (total - done) / rate
  // rounded up to whole seconds ("ETA --" before any progress; "done in <t>" when done == total).
  static std::string format_line(std::string_view phase, std::uint64_t done, std::uint64_t total,
                                 std::string_view unit, laminar::Duration elapsed);
  // "45s", "3m05s", "1h02m07s" (whole seconds, rounded up).
  static std::string format_duration(laminar::Duration d);

 private:
  void print_locked(bool final_line);

  std::shared_ptr<laminar::Clock> clock_;
  std::ostream& out_;
  Mode mode_;
  laminar::Duration period_;
  std::mutex mu_;
  bool running_ = false;
  std::string phase_, unit_;
  std::uint64_t total_ = 0, done_ = 0;
  laminar::Duration started_{}, last_print_{};
};

// The held-out reward of one published version (trainer.h's evaluate_held_out), which the launcher
// measures after the run from the weights the actor kept, so evaluating costs the run no time.
struct HeldOutPoint {
  std::uint64_t version = 0;
  std::int64_t time_ns = 0;  // steady_clock: when the actor published the version
  double reward = 0;         // in [0, 1]
  friend bool operator==(const HeldOutPoint&, const HeldOutPoint&) = default;
};

// The trailing moving average of `points` in version order: point i (from window - 1 on) keeps
// its version and time and takes the mean reward of points i - window + 1 .. i. With fewer than
// `window` points, one point: their mean at the last one. kInvalidArgument for window 0, a
// version twice, or a reward outside [0, 1].
laminar::Result<std::vector<HeldOutPoint>> smooth_held_out(std::vector<HeldOutPoint> points, std::size_t window);

// One schedule's run as the launcher saw it, and everything its processes recorded.
struct ScheduleRun {
  std::string schedule;             // "sync", "one-step", "laminar": a file-name-safe word, unique
  std::int64_t start_ns = 0;        // steady_clock: the launcher's start of the schedule, the epoch
  std::int64_t end_ns = 0;          // > start_ns
  std::uint32_t rollout_workers = 0;  // > 0; decode/prefill spans come from at most this many workers
  Records records{};                // reward points lie within [start_ns, end_ns]
  std::vector<HeldOutPoint> held_out{};  // one per version, published within [start_ns, end_ns]
  std::string actor_blas{};         // the BLAS the actor's trainer ran on (BlasInfo::describe); "" unknown
  // The run's simulator (predict.h) on this run's workload, for as many steps: trained samples/s and
  // the actor's waiting share. None: not predicted.
  std::optional<double> predicted_samples_per_s{};
  std::optional<double> predicted_waiting_share{};
};

// The table's column for one schedule.
struct ScheduleMetrics {
  std::string schedule;
  double wall_s = 0;
  // From the start to the first point at or above the target on the comparison's curve (the
  // smoothed held-out reward, or the per-step training reward without held-out points); none when
  // never reached.
  std::optional<double> time_to_target_s;
  std::uint64_t trained_samples = 0;  // trajectory facts
  std::uint64_t trained_tokens = 0;   // their lengths summed
  double samples_per_s = 0;           // over wall_s
  double tokens_per_s = 0;
  // Busy generation time (decode and prefill spans, overlaps on one worker counted once, clipped to
  // the run) / (rollout_workers x wall).
  double generation_utilisation = 0;
  // The actor's time waiting for a batch (its kIdleWait spans) / its training loop (below); without
  // a loop, / its time waiting and training (kTrain spans). Under sync, generation's share of a
  // step. None without either.
  std::optional<double> actor_waiting_share;
  // Trained samples / the training loop's time (the actor's first wait for a batch to its last
  // step's reward): what the run's simulator predicts, without the start and the drain.
  std::optional<double> loop_samples_per_s;
  std::optional<double> predicted_samples_per_s;  // ScheduleRun's
  std::optional<double> predicted_waiting_share;
  // Trajectories trained 0, 1, 2 and 3+ versions after the version that generated them.
  std::array<std::uint64_t, 4> staleness{};
  std::uint64_t repacks = 0;
  std::uint64_t moved_sequences = 0;
  // Nearest-rank percentiles of the weight-sync durations; none without syncs.
  std::optional<double> weight_sync_p50_ms;
  std::optional<double> weight_sync_p99_ms;
  // The median of the actor's training steps (its kTrain spans): what the schedule's other
  // processes take from the trainer on shared cores. None without steps.
  std::optional<double> train_step_p50_ms;
  // The median cost of a training step per token it trained (ms), over the steps whose batch the
  // actor waited for less than kReadyWaitNs, and over those it waited for longer: a step right after
  // the actor idled runs slower per token in every schedule, so only like steps compare across
  // schedules. None without such steps.
  std::optional<double> train_ms_per_token_ready_p50;
  std::optional<double> train_ms_per_token_after_wait_p50;
  std::optional<double> final_training_reward;  // the last training step's mean sample reward
  std::size_t held_out_versions = 0;
  std::optional<double> first_held_out;  // the first version's held-out reward
  std::optional<double> final_held_out;  // the last smoothed held-out reward
  std::string actor_blas;                // ScheduleRun::actor_blas
};

// A batch the actor waited for less than this was ready when it asked (ScheduleMetrics).
inline constexpr std::int64_t kReadyWaitNs = 200'000'000;

// Which reward the time to target reads.
enum class RewardCurve : std::uint8_t {
  kHeldOut,   // smooth_held_out(run.held_out, smoothing)
  kTraining,  // run.records.rewards: the mean reward of each step's training samples
};

// Validates `run` (see ScheduleRun) and computes its column. kInvalidArgument also for smoothing 0.
laminar::Result<ScheduleMetrics> compute_metrics(const ScheduleRun& run, double target_reward,
                                                 RewardCurve curve = RewardCurve::kTraining,
                                                 std::size_t smoothing = 3);

// The nearest-rank percentile (0 < p <= 100) of non-empty `values`: the ceil(p/100 x n)-th smallest.
laminar::Result<double> nearest_rank_percentile(std::vector<double> values, double p);

struct ReportOptions {
  // Absent: the baseline schedule's final reward on the curve compared (its last smoothed held-out
  // reward when any run has held-out points, else its last training reward).
  std::optional<double> target_reward = std::nullopt;
  // Versions in the held-out moving average: one version's reward on a few hundred samples is
  // noisy, and a single lucky version would otherwise decide the time to target.
  std::size_t smoothing = 3;
  // The rollout workers' pacing (Pacing::describe), stated with the table; empty: none.
  std::string pacing{};
  std::string baseline = "sync";
  std::string contender = "laminar";
  // The gnuplot program, looked up in PATH unless it holds a '/'. Missing: plots are skipped.
  std::string gnuplot = "gnuplot";
};

struct Comparison {
  double target_reward = 0;
  RewardCurve curve = RewardCurve::kTraining;
  std::size_t smoothing = 3;
  std::string pacing{};
  std::string baseline, contender;
  std::vector<ScheduleMetrics> schedules;  // in the order of the runs
  // baseline's time to target / contender's; none unless both reached it, or when the baseline is
  // the contender.
  std::optional<double> speedup;
};

// The curve is kHeldOut when any run has held-out points. kInvalidArgument for an invalid or
// duplicate run, no runs, smoothing 0, or no target (none given and no
// baseline run with a point on the curve).
laminar::Result<Comparison> compare(const std::vector<ScheduleRun>& runs, const ReportOptions& options);

// The aligned plain-text table, one column per schedule, and the speedup line under it.
std::string format_table(const Comparison& comparison);
// Everything in the table, as JSON.
std::string metrics_json(const Comparison& comparison);
// Chrome trace-event JSON of every span of `run` ("X" events; pid per process, tid per worker, name
// the kind, times in microseconds from the run's start; args version, sequences, bytes, tokens),
// loadable in Perfetto's UI.
laminar::Result<std::string> trace_json(const ScheduleRun& run);

struct PlotFiles {
  std::vector<std::filesystem::path> pngs;  // reward.png, training_reward.png, activity_<schedule>.png
  std::string note;                         // why plots are missing (no gnuplot, no data), or empty
};
// Writes data files and scripts under `dir` (created if needed) and runs gnuplot on them: reward.png
// (held-out reward against publish time, each version's and the moving average over `smoothing`,
// a colour per schedule), training_reward.png (each training step's mean sample reward against
// wall time) and activity_<schedule>.png (a row per worker, a box per span,
// coloured by kind). A missing gnuplot is not an error (note says so); gnuplot failing is
// kInternal with its output.
laminar::Result<PlotFiles> write_plots(const std::vector<ScheduleRun>& runs, const std::filesystem::path& dir,
                                       const std::string& gnuplot, std::size_t smoothing = 3);

// Several seeds' comparisons summed up per schedule: the median and range over seeds.
struct Spread {
  double median = 0;  // of an even count, the mean of the middle two
  double min = 0;
  double max = 0;
};
// The spread of `values`; none when empty.
std::optional<Spread> spread(std::vector<double> values);

struct SeedScheduleSummary {
  std::string schedule;
  std::size_t seeds = 0;    // seeds this schedule ran
  std::size_t reached = 0;  // of them, those where it reached its seed's target
  // Over the seeds where it reached the target.
  std::optional<Spread> time_to_target_s;
  // The baseline's time to target / this schedule's, per seed; a seed where this schedule did
  // not reach the target counts as 0 (below every speedup), one where the baseline did not is
  // left out. None without any seed to count.
  std::optional<Spread> speedup;
  Spread samples_per_s;
  std::optional<Spread> samples_per_s_ratio;  // / the baseline's on the same seed
  std::optional<Spread> at_most_one_stale;    // share of trained samples with staleness 0 or 1
  std::optional<Spread> actor_waiting_share;
  std::optional<Spread> train_step_ratio;     // actor training step p50 / the baseline's
};

struct SeedSummary {
  std::string baseline;
  std::vector<std::uint64_t> seeds;
  std::vector<SeedScheduleSummary> schedules;  // in the order of the first seed's runs
};

// One Comparison per seed (each against its own baseline run's target), in the order of `seeds`.
// kInvalidArgument for no seeds, a count that differs from the comparisons', a seed twice, or
// comparisons with different baselines.
laminar::Result<SeedSummary> summarize_seeds(const std::vector<std::uint64_t>& seeds,
                                             const std::vector<Comparison>& comparisons);
// One row per measure, one column per schedule: "median [min, max]".
std::string format_seed_table(const SeedSummary& summary);
std::string seed_summary_json(const SeedSummary& summary);

struct ReportFiles {
  Comparison comparison;
  std::string table;
  std::filesystem::path table_txt, metrics;
  std::vector<std::filesystem::path> traces;  // trace_<schedule>.json
  std::vector<std::filesystem::path> plots;
  std::string plot_note;
};
// Everything above into `dir` (created if needed). kUnavailable when a file cannot be written.
laminar::Result<ReportFiles> write_report(const std::vector<ScheduleRun>& runs, const ReportOptions& options,
                                          const std::filesystem::path& dir);

}  // namespace async_grpo
