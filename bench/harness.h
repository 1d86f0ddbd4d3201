// harness.h: the one small benchmark harness every bench/ binary uses.
//
// measure() runs a body after warm-up and reports the median of its repeats; report() prints the
// JSON line STYLE.md asks for (last line of every benchmark binary). The baseline is always
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
#include <string>
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

template <class F>
Timing measure(F&& body, MeasureOptions opt = {}) {
  for (int i = 0; i < opt.warmup; ++i) body();
  std::vector<double> t;
  t.reserve(std::size_t(opt.repeats));
  for (int i = 0; i < opt.repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    body();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front(), t.back(), opt.repeats};
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
