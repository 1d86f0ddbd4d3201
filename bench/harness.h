// harness.h: the one small benchmark harness every bench/ binary uses.
//
// measure() runs a body after warm-up and reports the median of its repeats; report() prints the
// JSON line bench/README.md describes (last line of every benchmark binary). The baseline is always
// measured in the same run, because these machines are shared and noisy.
//
//   auto ours = laminar::bench::measure([&] { copy_with_laminar(); });
//   auto base = laminar::bench::measure([&] { std::memcpy(dst, src, n); });
//   laminar::bench::report_throughput("cast_f32_bf16", "GB/s", n / ours.median_s / 1e9,
//                                     "memcpy", n / base.median_s / 1e9);
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace laminar::bench {

struct Timing {
  double median_s = 0;
  double min_s = 0;
  double max_s = 0;
  int repeats = 0;
};

struct MeasureOptions {
  int warmup = 2;
  int repeats = 9;
};

inline Timing summarize(std::vector<double> seconds) {
  std::sort(seconds.begin(), seconds.end());
  return {seconds[seconds.size() / 2], seconds.front(), seconds.back(), int(seconds.size())};
}

template <class F>
double seconds_of(F&& body) {
  const auto start = std::chrono::steady_clock::now();
  body();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

template <class F>
Timing measure(F&& body, MeasureOptions opt = {}) {
  for (int i = 0; i < opt.warmup; ++i) body();
  std::vector<double> t;
  for (int i = 0; i < opt.repeats; ++i) t.push_back(seconds_of(body));
  return summarize(std::move(t));
}

// Ours and the baseline turn about, repeat by repeat, so that a slow spell of a shared machine
// falls on both rather than on whichever ran during it.
template <class A, class B>
std::pair<Timing, Timing> measure_interleaved(A&& ours, B&& baseline, MeasureOptions opt = {}) {
  for (int i = 0; i < opt.warmup; ++i) {
    ours();
    baseline();
  }
  std::vector<double> a, b;
  for (int i = 0; i < opt.repeats; ++i) {
    a.push_back(seconds_of(ours));
    b.push_back(seconds_of(baseline));
  }
  return {summarize(std::move(a)), summarize(std::move(b))};
}

// A baseline's repeats must agree before a ratio is taken against it. A median more than
// kMaxBaselineSpread times the fastest repeat means the machine stalled while the baseline ran (one
// relay_node_bench run read a memcpy median of 0.77 s where runs give about 0.11 s), and the ratio would
// flatter us; such a run prints why and exits with kUnstableBaselineExit instead of reporting.
inline constexpr double kMaxBaselineSpread = 2.0;
inline constexpr int kUnstableBaselineExit = 3;

inline void require_stable_baseline(const std::string& baseline, double median_s, double fastest_s) {
  if (fastest_s > 0 && median_s <= fastest_s * kMaxBaselineSpread) return;
  std::fprintf(stderr,
               "baseline %s is unstable: median %.6g s against its fastest repeat %.6g s (more than %.1fx); "
               "not reported, run again on a quieter machine\n",
               baseline.c_str(), median_s, fastest_s, kMaxBaselineSpread);
  std::exit(kUnstableBaselineExit);
}
// A baseline with a known floor (its bytes at a rate-limited link's rate) must come within
// kMaxBaselineOverFloor of it: far above its floor, the machine, not the work, set its time, even
// when every repeat agrees.
inline constexpr double kMaxBaselineOverFloor = 1.5;

inline void require_baseline_near_floor(const std::string& baseline, double median_s, double floor_s) {
  if (median_s <= floor_s * kMaxBaselineOverFloor) return;
  std::fprintf(stderr,
               "baseline %s is off its usual value: median %.6g s against a floor of %.6g s (more than %.1fx); "
               "not reported, run again on a quieter machine\n",
               baseline.c_str(), median_s, floor_s, kMaxBaselineOverFloor);
  std::exit(kUnstableBaselineExit);
}
inline void require_stable_baseline(const std::string& baseline, const Timing& t) {
  require_stable_baseline(baseline, t.median_s, t.min_s);
}
inline void require_stable_baseline(const std::string& baseline, std::vector<double> seconds) {
  if (seconds.empty()) return require_stable_baseline(baseline, 0, 0);
  std::sort(seconds.begin(), seconds.end());
  require_stable_baseline(baseline, seconds[seconds.size() / 2], seconds.front());
}

// Prints {"bench", "metric", "value", "baseline", "baseline_value", "ratio"} on one line. For a
// "higher is better" metric (throughput) ratio = value / baseline_value.
inline void report_throughput(const std::string& bench, const std::string& metric, double value,
                              const std::string& baseline, double baseline_value) {
  std::printf(
      "{\"bench\": \"%s\", \"metric\": \"%s\", \"value\": %.6g, \"baseline\": \"%s\", "
      "\"baseline_value\": %.6g, \"ratio\": %.4f}\n",
      bench.c_str(), metric.c_str(), value, baseline.c_str(), baseline_value,
      baseline_value > 0 ? value / baseline_value : 0.0);
  std::fflush(stdout);
}

// For a time (lower is better): ratio = baseline_time / our_time.
inline void report_time(const std::string& bench, const std::string& metric, double value,
                        const std::string& baseline, double baseline_value) {
  std::printf(
      "{\"bench\": \"%s\", \"metric\": \"%s\", \"value\": %.6g, \"baseline\": \"%s\", "
      "\"baseline_value\": %.6g, \"ratio\": %.4f}\n",
      bench.c_str(), metric.c_str(), value, baseline.c_str(), baseline_value,
      value > 0 ? baseline_value / value : 0.0);
  std::fflush(stdout);
}

}  // namespace laminar::bench
