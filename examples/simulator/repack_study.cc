// sim_repack_study: why repacking wins or loses in the Laminar schedule, on the paper's math
// setting. Runs simulate() for Laminar with repacking off and under each RepackPolicy rule and
// interval, on 7B/TP1 clusters of 768 and 256 rollout GPUs and a 32B/TP4 one, with the admission
// bound at 4 steps and unbounded, and prints per run the throughput, the plans and, from the
// trace, where rollout time went.
//
//   sim_repack_study [--steps N] [--model 7b|7b-r256|32b|all] [--bound 4|none|all] [--only NAME]
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "simulator.h"

namespace laminar::sim {
namespace {

using namespace std::chrono_literals;

double to_s(Duration d) { return static_cast<double>(d.count()) * 1e-9; }

struct Variant {
  std::string name;
  std::function<void(ScheduleSpec&)> set;
};

std::vector<Variant> variants() {
  auto rule = [](RepackStrategy s, Duration every) {
    return [=](ScheduleSpec& spec) {
      spec.repack_options.strategy = s;
      spec.repack_interval = every;
    };
  };
  return {
      {"off", [](ScheduleSpec& s) { s.repack = false; }},
      {"paper 5s", rule(RepackStrategy::kPaperBestFit, 5s)},
      {"paper 30s", rule(RepackStrategy::kPaperBestFit, 30s)},
      {"cost 2s", rule(RepackStrategy::kCostAware, 2s)},
      {"cost 5s", rule(RepackStrategy::kCostAware, 5s)},
      {"cost 30s", rule(RepackStrategy::kCostAware, 30s)},
      {"cost 120s", rule(RepackStrategy::kCostAware, 120s)},
      // cost-aware without the waiting-prompts rule: frees every worker its checks allow.
      {"cost 5s no-demand",
       [=](ScheduleSpec& s) {
         rule(RepackStrategy::kCostAware, 5s)(s);
         s.repack_options.only_for_waiting_prompts = false;
       }},
      {"cost 5s no-demand step0.25",
       [=](ScheduleSpec& s) {
         rule(RepackStrategy::kCostAware, 5s)(s);
         s.repack_options.only_for_waiting_prompts = false;
         s.repack_options.max_step_slowdown = 0.25;
       }},
  };
}

// "7b": paper_math, 768 rollout GPUs, trainer-bound or latency-bound; "7b-r256": the same with 768
// trainer GPUs, so that rollouts are the bottleneck; "32b": a Qwen2.5-32B-shaped model at TP 4.
SimConfig model_config(const std::string& model, std::int64_t steps) {
  SimConfig c = SimConfig::paper_math();
  if (model == "7b-r256") c.cluster.trainer_gpus = 768;
  if (model == "32b") {
    c.cost.model = ModelSpec::preset("qwen2.5-32b").value();
    c.cost.rollout.tensor_parallel = 4;
  }
  c.steps = steps;
  return c;
}

// Where rollout instance time went, from the trace. An instance is draining while it generates
// with weights older than the newest published version; the time outside these spans is idle.
struct TimeSplit {
  double generate_new = 0, generate_old = 0, migrate = 0, pull = 0;
  double old_batch_time = 0;  // sum of batch x seconds over draining generation
  double new_batch_time = 0;
};

TimeSplit split_of(const SimReport& r) {
  TimeSplit t;
  std::vector<double> publish;  // publish[v - 1]: when version v was published
  for (const StepRecord& s : r.step_records) publish.push_back(to_s(s.end));
  auto newest_at = [&](double when) {
    return static_cast<std::int64_t>(std::upper_bound(publish.begin(), publish.end(), when) - publish.begin());
  };
  for (const TraceSpan& s : r.trace) {
    const double a = to_s(s.start), b = to_s(s.end), d = b - a;
    switch (s.kind) {
      case TraceSpan::Kind::kGenerate:
        // Split the span at the publish that makes it old.
        if (s.version >= newest_at(a)) {
          const double cut = s.version < static_cast<std::int64_t>(publish.size())
                                 ? std::clamp(publish[static_cast<std::size_t>(s.version)], a, b)
                                 : b;
          t.generate_new += cut - a;
          t.new_batch_time += static_cast<double>(s.batch) * (cut - a);
          t.generate_old += b - cut;
          t.old_batch_time += static_cast<double>(s.batch) * (b - cut);
        } else {
          t.generate_old += d;
          t.old_batch_time += static_cast<double>(s.batch) * d;
        }
        break;
      case TraceSpan::Kind::kMigrate: t.migrate += d; break;
      case TraceSpan::Kind::kPull: t.pull += d; break;
      default: break;
    }
  }
  return t;
}

int run(int argc, char** argv) {
  CLI::App app{"Why repacking wins or loses in the simulated Laminar schedule, on the paper's math setting"};
  std::int64_t steps = 100;
  std::string model = "all", bound = "all", only;
  app.add_option("--steps", steps, "training steps per run")->check(CLI::PositiveNumber);
  app.add_option("--model", model, "cluster")->check(CLI::IsMember({"7b", "7b-r256", "32b", "all"}));
  app.add_option("--bound", bound, "admission bound in steps")->check(CLI::IsMember({"4", "none", "all"}));
  app.add_option("--only", only, "run only the variants whose name contains this (and \"off\")");
  CLI11_PARSE(app, argc, argv);
  std::printf("%-7s %-5s %-26s %8s %7s %6s %8s %8s %6s | %7s %7s %6s %6s %6s %6s %6s %6s\n", "model", "bound",
              "repack", "samp/s", "step_s", "stale", "plans", "moves", "GB", "util", "gen_new", "gen_old",
              "migr", "pull", "idle", "b_new", "b_old");
  for (const std::string m : {"7b", "7b-r256", "32b"}) {
    if (model != "all" && model != m) continue;
    for (const std::optional<std::int64_t> b : {std::optional<std::int64_t>(4), std::optional<std::int64_t>()}) {
      const std::string bname = b ? std::to_string(*b) : "none";
      if (bound != "all" && bound != bname) continue;
      const SimConfig c = model_config(m, steps);
      for (const Variant& v : variants()) {
        if (!only.empty() && v.name.find(only) == std::string::npos && v.name != "off") continue;
        ScheduleSpec spec = ScheduleSpec::defaults(ScheduleKind::kLaminar);
        spec.max_ahead_steps = b;
        v.set(spec);
        SimOptions o;
        o.trace = true;
        Result<SimReport> r = simulate(c, spec, o);
        if (!r.ok()) {
          std::fprintf(stderr, "%s %s %s: %s\n", m.c_str(), bname.c_str(), v.name.c_str(),
                       r.status().to_string().c_str());
          return 1;
        }
        const TimeSplit t = split_of(*r);
        // Instance-seconds, as a share of all rollout instance time.
        const double inst_s = static_cast<double>(r->rollout_gpus / c.cost.rollout.tensor_parallel) * to_s(r->total);
        double stale = 0;
        for (std::size_t k = 0; k < r->staleness_histogram.size(); ++k) {
          stale += static_cast<double>(k) * static_cast<double>(r->staleness_histogram[k]);
        }
        stale /= static_cast<double>(r->samples_trained);
        std::printf("%-7s %-5s %-26s %8.1f %7.2f %6.2f %8lld %8lld %6.0f | %7.3f %7.3f %6.3f %6.3f %6.3f %6.3f %6.1f %6.1f\n",
                    m.c_str(), bname.c_str(), v.name.c_str(), r->samples_per_s, to_s(r->mean_step_time), stale,
                    static_cast<long long>(r->repack_plans), static_cast<long long>(r->repack_moves),
                    r->repack_bytes / 1e9, r->generation_utilisation, t.generate_new / inst_s,
                    t.generate_old / inst_s, t.migrate / inst_s, t.pull / inst_s,
                    1 - (t.generate_new + t.generate_old + t.migrate + t.pull) / inst_s,
                    t.generate_new > 0 ? t.new_batch_time / t.generate_new : 0.0,
                    t.generate_old > 0 ? t.old_batch_time / t.generate_old : 0.0);
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace laminar::sim

int main(int argc, char** argv) { return laminar::sim::run(argc, argv); }
