// repack_policy_bench: how long plan_repack takes on a fleet of 1,024 workers holding 64 live sequences
// each on average (65k in all), and what its plans do, against the paper's best fit on the same fleets.
//
// Fleets come from tests/support/repack_fleet.h: each worker took a batch of prompts when it last
// pulled, log-normal response lengths (median 2k tokens, p99 10x) up to a 32k cap, length estimates
// with a log-normal error of sigma 0.5 and none for a fifth of the sequences. Both strategies keep
// the same growth room (the default growth_horizon_steps).
//
// Plan time: both strategies on each fleet, alternating which goes first, after a warm-up; median
// and p99 over every plan. Then, per plan: workers freed, and a simulation that plays each fleet
// forward with the true lengths (which the plans only estimate) and a decode step that follows the
// KV tokens a worker holds as its batch shrinks: worker-seconds of older-version work saved, how
// much later each version's last sequence ends, and how many workers run out of KV pages before
// their sequences end. The paper's rule is also simulated with no growth room, as the paper states
// it, and the cost-aware plan again with exact length estimates.
//
//   repack_policy_bench [--fleets N] [--sim-fleets M]
// Prints a table, then JSON lines: workers freed, worker-seconds saved (simulated), p99 plan time,
// and last the headline, median plan time (on a shared machine the p99 mostly measures preemption).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cli.h"
#include "harness.h"
#include "laminar/repack_policy.h"
#include "repack_fleet.h"

namespace {

using laminar::MigrationPlan;
using laminar::RepackPolicyOptions;
using laminar::RepackStrategy;
using laminar::testing::FleetShape;
using laminar::testing::RandomFleet;

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, std::size_t(q * double(v.size())))];
}

MigrationPlan plan_or_die(const RandomFleet& f, const RepackPolicyOptions& o) {
  auto plan = laminar::plan_repack(f.fleet, f.newest, o);
  if (!plan.ok()) {
    std::fprintf(stderr, "plan_repack: %s\n", plan.status().to_string().c_str());
    std::exit(1);
  }
  return std::move(plan).value();
}

struct SimTotals {
  double freed = 0;
  double saved_s = 0;  // worker-seconds of older-version work saved against no plan
  double tail = 0;     // mean over versions of (last end with the plan / without)
  double worst_tail = 0;
  double out_of_pages = 0;  // more than without a plan
  int fleets = 0;
};

void add_sim(SimTotals& t, const RandomFleet& f, const FleetShape& shape, const MigrationPlan& plan,
             const RepackPolicyOptions& o, const laminar::testing::Outcome& none) {
  const laminar::testing::Outcome after = laminar::testing::simulate(f, shape, &plan, o);
  double sum = 0;
  for (const auto& [v, end] : after.finish_s) {
    const double g = end / none.finish_s.at(v);
    sum += g;
    t.worst_tail = std::max(t.worst_tail, g);
  }
  t.freed += double(plan.freed.size());
  t.saved_s += none.busy_worker_s - after.busy_worker_s;
  t.tail += sum / double(after.finish_s.size());
  t.out_of_pages += double(after.out_of_pages - none.out_of_pages);
  ++t.fleets;
}

void print_sim(const char* name, const SimTotals& t) {
  const double n = t.fleets;
  std::printf("  %-34s %8.1f %12.0f %10.3f %10.3f %12.1f\n", name, t.freed / n, t.saved_s / n, t.tail / n,
              t.worst_tail, t.out_of_pages / n);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"plan_repack's plan time and plan quality against the paper's best fit"};
  app.option_defaults()->always_capture_default();
  int fleets = 48, sim_fleets = 12;
  app.add_option("--fleets", fleets, "fleets of 1,024 workers planned")
      ->check(laminar::bench::at_least(2));
  app.add_option("--sim-fleets", sim_fleets, "of those, fleets simulated; at most --fleets (the default: all of fewer)")
      ->check(laminar::bench::positive());
  CLI11_PARSE(app, argc, argv);
  if (sim_fleets > fleets) {
    if (app.count("--sim-fleets") > 0) {
      return app.exit(CLI::ValidationError("--sim-fleets", std::to_string(sim_fleets) + " is more than --fleets " +
                                                              std::to_string(fleets)));
    }
    sim_fleets = fleets;  // the default, for fewer fleets than it
  }
  const std::uint64_t seed = 1014;
  std::printf("repack_policy_bench: %d fleets of 1,024 workers (seed %llu), %d simulated\n", fleets,
              static_cast<unsigned long long>(seed), sim_fleets);

  FleetShape shape;
  shape.workers = 1024;
  shape.batch = 184;  // 64 live sequences per worker on average
  std::mt19937_64 rng(seed);
  std::vector<RandomFleet> fleet(static_cast<std::size_t>(fleets));
  std::size_t sequences = 0;
  for (auto& f : fleet) {
    f = laminar::testing::random_fleet(rng, shape);
    for (const auto& w : f.fleet.workers) sequences += w.sequences.size();
  }
  std::printf("  live sequences per worker: %.1f\n", double(sequences) / fleets / shape.workers);

  RepackPolicyOptions cost;
  RepackPolicyOptions paper;
  paper.strategy = RepackStrategy::kPaperBestFit;

  // Plan time.
  for (int i = 0; i < 3; ++i) {
    plan_or_die(fleet[std::size_t(i) % fleet.size()], cost);
    plan_or_die(fleet[std::size_t(i) % fleet.size()], paper);
  }
  std::vector<double> cost_s, paper_s;
  constexpr int kRepeats = 5;
  for (int r = 0; r < kRepeats; ++r) {
    for (std::size_t i = 0; i < fleet.size(); ++i) {
      for (int k = 0; k < 2; ++k) {
        const bool ours = (k == 0) == ((i + std::size_t(r)) % 2 == 0);
        const auto start = std::chrono::steady_clock::now();
        const MigrationPlan p = plan_or_die(fleet[i], ours ? cost : paper);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        (ours ? cost_s : paper_s).push_back(s);
      }
    }
  }
  // Per fleet (the samples hold repeat r of fleet i at r * fleets + i): the median and the fastest
  // of its repeats. The fastest is what planning a fleet costs without the preemptions of a shared
  // machine; the baseline's spread is judged fleet by fleet, since fleets differ in size.
  auto per_fleet = [&](const std::vector<double>& samples, double q) {
    std::vector<double> out;
    for (std::size_t i = 0; i < fleet.size(); ++i) {
      std::vector<double> runs;
      for (std::size_t k = i; k < samples.size(); k += fleet.size()) runs.push_back(samples[k]);
      out.push_back(percentile(runs, q));
    }
    return out;
  };
  const std::vector<double> fastest = per_fleet(cost_s, 0.0);
  const double cost_med = percentile(cost_s, 0.5), cost_p99 = percentile(cost_s, 0.99);
  const double paper_med = percentile(paper_s, 0.5), paper_p99 = percentile(paper_s, 0.99);
  std::printf("  plan time, ms: cost-aware median %.3f p99 %.3f; paper's best fit median %.3f p99 %.3f\n",
              cost_med * 1e3, cost_p99 * 1e3, paper_med * 1e3, paper_p99 * 1e3);
  std::printf("  cost-aware, each fleet's fastest of %d runs, ms: median %.3f, slowest fleet %.3f\n", kRepeats,
              percentile(fastest, 0.5) * 1e3, percentile(fastest, 1.0) * 1e3);

  // Workers freed, on every fleet.
  double cost_freed = 0, paper_freed = 0;
  int fewer = 0, more = 0;
  for (const auto& f : fleet) {
    const double a = double(plan_or_die(f, cost).freed.size());
    const double b = double(plan_or_die(f, paper).freed.size());
    cost_freed += a;
    paper_freed += b;
    more += a > b ? 1 : 0;
    fewer += a < b ? 1 : 0;
  }
  std::printf("  workers freed per plan: cost-aware %.1f, paper's best fit %.1f (more on %d fleets, fewer on %d)\n",
              cost_freed / fleets, paper_freed / fleets, more, fewer);

  // Simulated outcome.
  RepackPolicyOptions literal = paper;
  literal.growth_horizon_steps = 0;
  SimTotals sim_cost, sim_paper, sim_literal, sim_exact, sim_exact_paper;
  for (int i = 0; i < sim_fleets; ++i) {
    const RandomFleet& f = fleet[std::size_t(i)];
    const auto none = laminar::testing::simulate(f, shape, nullptr, cost);
    add_sim(sim_cost, f, shape, plan_or_die(f, cost), cost, none);
    add_sim(sim_paper, f, shape, plan_or_die(f, paper), paper, none);
    add_sim(sim_literal, f, shape, plan_or_die(f, literal), literal, none);
    RandomFleet exact = f;
    for (std::size_t w = 0; w < exact.fleet.workers.size(); ++w) {
      for (std::size_t s = 0; s < exact.fleet.workers[w].sequences.size(); ++s) {
        exact.fleet.workers[w].sequences[s].expected_remaining_tokens = exact.remaining[w][s];
      }
    }
    add_sim(sim_exact, exact, shape, plan_or_die(exact, cost), cost, none);
    add_sim(sim_exact_paper, exact, shape, plan_or_die(exact, paper), paper, none);
  }
  std::printf("  simulated, per plan:               %8s %12s %10s %10s %12s\n", "freed", "saved w-s", "tail mean",
              "tail worst", "out of pages");
  print_sim("paper, no growth room", sim_literal);
  print_sim("paper", sim_paper);
  print_sim("cost-aware", sim_cost);
  print_sim("paper, exact estimates", sim_exact_paper);
  print_sim("cost-aware, exact estimates", sim_exact);

  laminar::bench::require_stable_baseline("paper_best_fit", percentile(per_fleet(paper_s, 0.5), 0.5),
                                          percentile(per_fleet(paper_s, 0.0), 0.5));
  laminar::bench::report_throughput("repack_policy_workers_freed", "workers freed per plan", cost_freed / fleets,
                                    "paper_best_fit", paper_freed / fleets);
  laminar::bench::report_throughput("repack_policy_sim_saved", "worker-seconds saved per plan (simulated)",
                                    sim_cost.saved_s / sim_cost.fleets, "paper_best_fit",
                                    sim_paper.saved_s / sim_paper.fleets);
  laminar::bench::report_time("repack_policy_plan_time_p99", "ms per plan (p99), 1,024 workers x 64 sequences",
                              cost_p99 * 1e3, "paper_best_fit", paper_p99 * 1e3);
  laminar::bench::report_time("repack_policy_plan_time_median", "ms per plan, 1,024 workers x 64 sequences",
                              cost_med * 1e3, "paper_best_fit", paper_med * 1e3);
  return 0;
}
