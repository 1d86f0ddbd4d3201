// simulator: runs the cluster simulator (simulator.h) for one setting and prints how the schedules
// compare, or sweeps the GPU count; optionally writes a JSON report, gnuplot PNGs and a Perfetto
// trace of a small run.
//
//   simulator                                   # every schedule, the paper's math setting, 1,024 GPUs
//   simulator --gpus 64 --steps 5 --out out/    # smaller; out/report.json, throughput.png, staleness.png
//   simulator --schedule laminar --max-ahead 2 --model qwen2.5-32b
//   simulator --sweep 64,128,256,512,1024       # generation tokens/s against GPUs; out/scaling.png
//   simulator --schedule laminar --trace trace.json   # open in Perfetto's UI
#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "laminar/clock.h"
#include "report_output.h"
#include "simulator.h"

namespace {

using laminar::Result;
using laminar::Status;
using laminar::sim::ScheduleKind;
using laminar::sim::ScheduleSpec;
using laminar::sim::SimConfig;
using laminar::sim::SimReport;

constexpr ScheduleKind kAllSchedules[] = {ScheduleKind::kSync,           ScheduleKind::kOneStep,
                                          ScheduleKind::kStreamGlobal,   ScheduleKind::kBoundedStaleness,
                                          ScheduleKind::kPartialRollout, ScheduleKind::kLaminar};
// A traced run records every span of every instance: kept this small, its trace stays loadable.
constexpr std::int64_t kTraceMaxGpus = 64;
constexpr std::int64_t kTraceMaxSteps = 3;

int fail(std::string_view what, const Status& st) {
  std::fprintf(stderr, "simulator: %.*s: %s\n", static_cast<int>(what.size()), what.data(), st.to_string().c_str());
  return 1;
}

struct Args {
  std::string config_file;
  std::string schedule = "all";
  std::optional<std::int64_t> steps, gpus;
  std::optional<std::uint64_t> seed;
  std::string model;
  std::string max_ahead;
  std::string repack = "on";
  std::string step_share;
  std::string baseline;
  std::string sweep;
  std::string trace_file;
  std::string out_dir;
  std::string gnuplot = "gnuplot";
};

Result<std::string> read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return laminar::not_found(fmt::format("cannot open config file '{}'", path));
  std::stringstream s;
  s << in.rdbuf();
  if (in.bad()) return laminar::unavailable(fmt::format("cannot read config file '{}'", path));
  return s.str();
}

Result<std::int64_t> parse_count(std::string_view text, std::string_view what, std::int64_t min) {
  std::int64_t v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v < min) {
    return laminar::invalid_argument(fmt::format("{}: '{}' is not an integer >= {}", what, text, min));
  }
  return v;
}

// "64,128,256": positive and distinct, returned sorted.
Result<std::vector<std::int64_t>> parse_sweep(std::string_view text) {
  std::set<std::int64_t> counts;
  while (true) {
    const std::size_t comma = text.find(',');
    Result<std::int64_t> n = parse_count(text.substr(0, comma), "--sweep", 1);
    if (!n.ok()) return n.status();
    if (!counts.insert(*n).second) return laminar::invalid_argument(fmt::format("--sweep: {} GPUs given twice", *n));
    if (comma == std::string_view::npos) break;
    text.remove_prefix(comma + 1);
  }
  return std::vector<std::int64_t>(counts.begin(), counts.end());
}

// Tensor parallelism vLLM deployments commonly give each model on 80 GB GPUs: the weights (2 bytes a
// parameter) take at most about half of each GPU's memory, leaving the rest for KV.
std::int64_t tensor_parallel_for(std::string_view model) {
  if (model == "qwen2.5-72b") return 4;
  if (model == "qwen2.5-32b") return 2;
  return 1;
}

Result<SimConfig> build_config(const Args& a) {
  SimConfig cfg = SimConfig::paper_math();
  if (!a.config_file.empty()) {
    Result<std::string> text = read_text(a.config_file);
    if (!text.ok()) return text.status();
    Result<SimConfig> parsed = SimConfig::from_json(*text);
    if (!parsed.ok()) return parsed.status().with_context(fmt::format("--config {}", a.config_file));
    cfg = std::move(*parsed);
  }
  for (auto [flag, value] : {std::pair{"--steps", a.steps}, std::pair{"--gpus", a.gpus}}) {
    if (value && *value < 1) return laminar::invalid_argument(fmt::format("{}: must be >= 1, got {}", flag, *value));
  }
  if (a.steps) cfg.steps = *a.steps;
  if (a.gpus) cfg.cluster.gpus = *a.gpus;
  if (a.seed) {
    cfg.seed = *a.seed;
    cfg.workload.seed = *a.seed;
  }
  if (!a.model.empty()) {
    Result<laminar::sim::ModelSpec> model = laminar::sim::ModelSpec::preset(a.model);
    if (!model.ok()) return model.status().with_context("--model");
    cfg.cost.model = std::move(*model);
    cfg.cost.rollout.tensor_parallel = tensor_parallel_for(a.model);
  }
  LAMINAR_RETURN_IF_ERROR(cfg.validate());
  return cfg;
}

Result<std::vector<ScheduleSpec>> build_specs(const Args& a) {
  std::vector<ScheduleKind> kinds;
  if (a.schedule == "all") {
    kinds.assign(std::begin(kAllSchedules), std::end(kAllSchedules));
  } else {
    Result<ScheduleKind> kind = laminar::sim::parse_schedule(a.schedule);
    if (!kind.ok()) return kind.status();
    kinds.push_back(*kind);
  }
  std::optional<std::optional<std::int64_t>> max_ahead;
  if (a.max_ahead == "unbounded") {
    max_ahead.emplace(std::nullopt);
  } else if (!a.max_ahead.empty()) {
    Result<std::int64_t> n = parse_count(a.max_ahead, "--max-ahead (a step count or 'unbounded')", 0);
    if (!n.ok()) return n.status();
    max_ahead.emplace(*n);
  }
  std::optional<std::optional<double>> step_share;
  if (a.step_share == "none") {
    step_share.emplace(std::nullopt);
  } else if (!a.step_share.empty()) {
    double v = 0;
    auto [end, ec] = std::from_chars(a.step_share.data(), a.step_share.data() + a.step_share.size(), v);
    if (ec != std::errc() || end != a.step_share.data() + a.step_share.size()) {
      return laminar::invalid_argument(
          fmt::format("--step-share: '{}' is not a number or 'none'", a.step_share));
    }
    step_share.emplace(v);
  }
  if (step_share && std::none_of(kinds.begin(), kinds.end(), [](ScheduleKind k) { return k == ScheduleKind::kLaminar; })) {
    return laminar::invalid_argument(fmt::format("--step-share {}: applies to laminar only", a.step_share));
  }
  std::vector<ScheduleSpec> specs;
  for (ScheduleKind kind : kinds) {
    ScheduleSpec spec = ScheduleSpec::defaults(kind);
    // sync and one-step are defined by their bound (0 and 1); the others take any.
    if (max_ahead && kind != ScheduleKind::kSync && kind != ScheduleKind::kOneStep) spec.max_ahead_steps = *max_ahead;
    if (kind == ScheduleKind::kLaminar) spec.repack = a.repack == "on";
    if (kind == ScheduleKind::kLaminar && step_share) spec.max_step_share = *step_share;
    LAMINAR_RETURN_IF_ERROR(spec.validate().with_context(fmt::format("schedule {}", laminar::sim::schedule_name(kind))));
    specs.push_back(std::move(spec));
  }
  if (max_ahead && std::none_of(specs.begin(), specs.end(), [](const ScheduleSpec& s) {
        return s.kind != ScheduleKind::kSync && s.kind != ScheduleKind::kOneStep;
      })) {
    return laminar::invalid_argument(
        fmt::format("--max-ahead {}: schedule {} has a fixed admission rule", a.max_ahead, a.schedule));
  }
  return specs;
}

// Runs every spec at every GPU count, drawing the progress line on stderr.
Result<std::vector<SimReport>> run_all(SimConfig cfg, const std::vector<ScheduleSpec>& specs,
                                       const std::vector<std::int64_t>& gpu_counts) {
  laminar::sim::ProgressLine progress(laminar::Clock::steady(), std::cerr,
                                      cfg.steps * static_cast<std::int64_t>(specs.size() * gpu_counts.size()));
  std::vector<SimReport> reports;
  for (std::int64_t gpus : gpu_counts) {
    cfg.cluster.gpus = gpus;
    for (const ScheduleSpec& spec : specs) {
      const std::string label = fmt::format("{}, {} GPUs", laminar::sim::schedule_name(spec.kind), gpus);
      std::int64_t last = 0;
      laminar::sim::SimOptions options;
      options.on_step = [&](std::int64_t done, std::int64_t) {
        progress.update(label, done - last);
        last = done;
      };
      Result<SimReport> r = laminar::sim::simulate(cfg, spec, options);
      if (!r.ok()) {
        progress.finish();
        return r.status().with_context(label);
      }
      reports.push_back(std::move(*r));
    }
  }
  progress.finish();
  return reports;
}

Status write_trace(SimConfig cfg, const ScheduleSpec& spec, const std::string& path) {
  cfg.cluster.gpus = std::min(cfg.cluster.gpus, kTraceMaxGpus);
  cfg.steps = std::min(cfg.steps, kTraceMaxSteps);
  LAMINAR_RETURN_IF_ERROR(cfg.validate());
  laminar::sim::SimOptions options;
  options.trace = true;
  Result<SimReport> r = laminar::sim::simulate(cfg, spec, options);
  if (!r.ok()) return r.status();
  Result<std::string> text = laminar::sim::trace_json(*r);
  if (!text.ok()) return text.status();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << *text;
  out.close();
  if (!out) return laminar::unavailable(fmt::format("cannot write {}", path));
  std::cout << fmt::format("trace: {} spans of {} at {} GPUs x {} steps in {} (open in Perfetto's UI)\n",
                           r->trace.size(), r->schedule, cfg.cluster.gpus, cfg.steps, path);
  return laminar::ok_status();
}

void print_plots(const laminar::sim::PlotFiles& plots) {
  for (const auto& p : plots.pngs) std::cout << "plot: " << p.string() << "\n";
  if (!plots.note.empty()) std::cout << plots.note << "\n";
}

int run(const Args& a) {
  Result<SimConfig> cfg = build_config(a);
  if (!cfg.ok()) return fail("config", cfg.status());
  Result<std::vector<ScheduleSpec>> specs = build_specs(a);
  if (!specs.ok()) return fail("schedules", specs.status());
  std::optional<std::vector<std::int64_t>> sweep;
  if (!a.sweep.empty()) {
    Result<std::vector<std::int64_t>> counts = parse_sweep(a.sweep);
    if (!counts.ok()) return fail("sweep", counts.status());
    for (std::int64_t gpus : *counts) {
      SimConfig c = *cfg;
      c.cluster.gpus = gpus;
      if (Status st = c.validate(); !st.ok()) return fail(fmt::format("sweep at {} GPUs", gpus), st);
    }
    sweep = std::move(*counts);
  }
  if (!a.baseline.empty()) {
    if (sweep) {
      return fail("--baseline", laminar::invalid_argument("a sweep compares GPU counts, not schedules: drop --baseline or --sweep"));
    }
    Result<ScheduleKind> kind = laminar::sim::parse_schedule(a.baseline);
    if (!kind.ok()) return fail("--baseline", kind.status());
    if (std::none_of(specs->begin(), specs->end(), [&](const ScheduleSpec& s) { return s.kind == *kind; })) {
      return fail("--baseline", laminar::invalid_argument(fmt::format(
                                    "'{}' is not among the schedules run (--schedule {})", a.baseline, a.schedule)));
    }
  }

  const SimConfig& c = *cfg;
  std::cout << fmt::format("setting: {} on {} {} GPUs (rollout tensor parallel {}), {} prompts x {} samples a step, "
                           "responses up to {} tokens, {} steps, seed {}\n",
                           c.cost.model.name, sweep ? fmt::format("{}", fmt::join(*sweep, "/")) : std::to_string(c.cluster.gpus),
                           c.cost.gpu.name, c.cost.rollout.tensor_parallel, c.workload.prompts_per_step,
                           c.workload.samples_per_prompt, c.workload.response_length.max_tokens, c.steps, c.seed);
  nlohmann::json config_json = laminar::sim::config_summary(c);
  if (!a.config_file.empty()) config_json["config_file"] = a.config_file;

  Result<std::vector<SimReport>> reports = run_all(c, *specs, sweep ? *sweep : std::vector<std::int64_t>{c.cluster.gpus});
  if (!reports.ok()) return fail("simulate", reports.status());

  std::optional<laminar::sim::Comparison> comparison;
  std::vector<laminar::sim::SweepPoint> points;
  if (sweep) {
    Result<std::vector<laminar::sim::SweepPoint>> p = laminar::sim::sweep_points(*reports);
    if (!p.ok()) return fail("sweep", p.status());
    points = std::move(*p);
    std::cout << laminar::sim::format_sweep(points);
  } else {
    Result<std::string> baseline = a.baseline.empty() ? laminar::sim::default_baseline(*reports) : Result<std::string>(a.baseline);
    if (!baseline.ok()) return fail("baseline", baseline.status());
    Result<laminar::sim::Comparison> cmp = laminar::sim::compare(*reports, *baseline);
    if (!cmp.ok()) return fail("comparison", cmp.status());
    comparison = std::move(*cmp);
    std::cout << laminar::sim::format_comparison(*comparison);
  }

  if (!a.out_dir.empty()) {
    const std::filesystem::path dir(a.out_dir);
    if (Status st = laminar::sim::write_json_report(dir / "report.json", config_json, *reports, comparison, points);
        !st.ok()) {
      return fail("--out", st);
    }
    std::cout << "report: " << (dir / "report.json").string() << "\n";
    Result<laminar::sim::PlotFiles> plots = sweep ? laminar::sim::write_sweep_plot(points, dir, a.gnuplot)
                                                  : laminar::sim::write_comparison_plots(*reports, dir, a.gnuplot);
    if (!plots.ok()) return fail("plots", plots.status());
    print_plots(*plots);
  }
  if (!a.trace_file.empty()) {
    // With several schedules, laminar's is the one worth looking at.
    const ScheduleSpec& spec = specs->size() == 1 ? specs->front() : specs->back();
    if (Status st = write_trace(c, spec, a.trace_file); !st.ok()) return fail("--trace", st);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Simulates RL post-training on a GPU cluster under each schedule, in virtual time, and compares them."};
  Args a;
  app.add_option("--config", a.config_file, "SimConfig JSON file (default: the paper's math setting)")
      ->check(CLI::ExistingFile);
  app.add_option("--schedule", a.schedule,
                 "sync, one-step, stream-global, bounded-staleness, partial-rollout, laminar, or all");
  app.add_option("--steps", a.steps, "training steps to simulate (>= 1)");
  app.add_option("--gpus", a.gpus, "GPUs in the cluster (>= 1)");
  app.add_option("--model", a.model,
                 "qwen2.5-7b, qwen2.5-32b or qwen2.5-72b (rollout tensor parallel 1, 2 or 4)")
      ->check(CLI::IsMember({"qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b"}));
  app.add_option("--max-ahead", a.max_ahead,
                 "admission rule of stream-global, bounded-staleness, partial-rollout and laminar: a prompt of step "
                 "s starts once version s - N is published; N >= 0 or 'unbounded'");
  app.add_option("--repack", a.repack, "laminar's repacking of draining instances: on (default) or off")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_option("--step-share", a.step_share,
                 "laminar: the most of one step's samples an instance takes, as a multiple of the step's samples "
                 "over the rollout instances (default 8), or 'none' (up to max_batch)");
  app.add_option("--baseline", a.baseline, "schedule the speed-ups are over (default: the fastest but laminar)");
  app.add_option("--sweep", a.sweep, "comma-separated GPU counts: runs each schedule at each, e.g. 64,128,256");
  app.add_option("--trace", a.trace_file,
                 fmt::format("Chrome/Perfetto trace JSON of one traced run (the schedule, or laminar with all; at "
                             "most {} GPUs and {} steps)", kTraceMaxGpus, kTraceMaxSteps));
  app.add_option("--out", a.out_dir, "folder for report.json and the gnuplot PNGs");
  app.add_option("--seed", a.seed, "seed of the workload and of failures");
  app.add_option("--gnuplot", a.gnuplot, "gnuplot program (PNGs are skipped when it is missing)");
  CLI11_PARSE(app, argc, argv);
  return run(a);
}
