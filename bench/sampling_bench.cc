// CPU sampling (top-k + top-p, 152k vocabulary, batch 64) against the full-sort baseline most
// samplers start from: per row, softmax, std::sort of (prob, id) pairs, cumulative sum, draw.
// Greedy, which needs no sort, is against an argmax and the row's softmax normaliser (the kernel
// returns the token's log-prob too). Both run on the same threads over rows, so the ratio is the
// algorithm, not the parallelism.
//
//   sampling_bench [--threads N] [--vocab V] [--batch B]
// Prints one JSON line per case; the last is the headline (top-k 50 + top-p 0.9, T = 1).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cli.h"
#include "harness.h"
#include "laminar/kernels/sampling.h"

namespace {

struct Case {
  const char* name;
  float temperature;
  int top_k;
  float top_p;
};

// LLM-like logits: a Gaussian bulk (sd 2.5) with a few dozen tokens lifted 8..16 above it.
std::vector<float> make_logits(std::int64_t batch, std::int64_t vocab) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> bulk(0.0f, 2.5f);
  std::uniform_real_distribution<float> lift(8.0f, 16.0f);
  std::vector<float> x(std::size_t(batch * vocab));
  for (auto& v : x) v = bulk(rng);
  for (std::int64_t r = 0; r < batch; ++r) {
    for (int j = 0; j < 40; ++j) x[std::size_t(r * vocab + std::int64_t(rng() % vocab))] += lift(rng);
  }
  return x;
}

// The baseline for one row: softmax, full sort, top-k cut, cumulative top-p cut, inverse CDF.
std::int32_t sort_sample_row(const float* x, std::int64_t vocab, const Case& c, double u,
                             std::vector<std::pair<float, std::int32_t>>& buf) {
  float m = x[0];
  for (std::int64_t i = 1; i < vocab; ++i) m = std::max(m, x[i]);
  buf.resize(std::size_t(vocab));
  for (std::int64_t i = 0; i < vocab; ++i) buf[i] = {std::exp((x[i] - m) / c.temperature), std::int32_t(i)};
  std::sort(buf.begin(), buf.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::size_t keep = c.top_k > 0 ? std::min<std::size_t>(std::size_t(c.top_k), buf.size()) : buf.size();
  double zk = 0;
  for (std::size_t j = 0; j < keep; ++j) zk += buf[j].first;
  double acc = 0;
  std::size_t n = 0;
  while (n < keep) {
    acc += buf[n++].first;
    if (acc >= c.top_p * zk) break;
  }
  double target = u * acc, walk = 0;
  for (std::size_t j = 0; j < n; ++j) {
    walk += buf[j].first;
    if (walk > target) return buf[j].second;
  }
  return buf[n - 1].second;
}

// Greedy's baseline for one row: the top token and its log-prob.
std::int32_t argmax_row(const float* x, std::int64_t vocab, float& logprob) {
  const float* top = std::max_element(x, x + vocab);
  double z = 0;
  for (std::int64_t i = 0; i < vocab; ++i) z += std::exp(x[i] - *top);
  logprob = float(-std::log(z));
  return std::int32_t(top - x);
}

template <class F>
void parallel_rows(std::int64_t batch, int threads, F&& f) {
  std::atomic<std::int64_t> next{0};
  auto work = [&] {
    std::vector<std::pair<float, std::int32_t>> buf;
    for (std::int64_t r = next++; r < batch; r = next++) f(r, buf);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"CPU sampling (top-k, top-p, greedy) against a full-sort sampler on the same threads"};
  app.option_defaults()->always_capture_default();
  int threads = std::max(1u, std::thread::hardware_concurrency());
  std::int64_t vocab = 152064, batch = 64;
  app.add_option("--threads", threads, "CPU threads, for both")->check(laminar::bench::positive());
  app.add_option("--vocab", vocab, "logits a row")->check(laminar::bench::positive());
  app.add_option("--batch", batch, "rows")->check(laminar::bench::positive());
  CLI11_PARSE(app, argc, argv);
  std::printf("sampling_bench: batch %lld, vocab %lld, %d threads\n", static_cast<long long>(batch),
              static_cast<long long>(vocab), threads);
  const std::vector<float> logits = make_logits(batch, vocab);
  const Case cases[] = {
      {"sampling_top_p_0.95_T0.7", 0.7f, 0, 0.95f},
      {"sampling_greedy", 0.0f, 0, 1.0f},
      {"sampling_top_k50_top_p0.9", 1.0f, 50, 0.9f},
  };
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(batch));
  std::vector<float> raw(static_cast<std::size_t>(batch)), processed(static_cast<std::size_t>(batch));
  std::vector<std::uint64_t> seeds(static_cast<std::size_t>(batch));
  std::vector<std::int64_t> positions(static_cast<std::size_t>(batch), 17);
  for (std::int64_t r = 0; r < batch; ++r) seeds[std::size_t(r)] = std::uint64_t(r) * 7919u + 1;
  for (const Case& c : cases) {
    std::vector<float> temperature(static_cast<std::size_t>(batch), c.temperature), top_p(static_cast<std::size_t>(batch), c.top_p);
    std::vector<std::int32_t> top_k(static_cast<std::size_t>(batch), c.top_k);
    laminar::kernels::SamplingParams p;
    p.logits = logits.data();
    p.batch = batch;
    p.vocab = vocab;
    p.temperature = temperature.data();
    p.top_k = top_k.data();
    p.top_p = top_p.data();
    p.seed = seeds.data();
    p.position = positions.data();
    p.token = tokens.data();
    p.raw_logprob = raw.data();
    p.processed_logprob = processed.data();
    p.cpu_threads = threads;
    bool ok = true;
    const auto ours = laminar::bench::measure([&] { ok = ok && laminar::kernels::run(p, laminar::Stream::host()).ok(); },
                                              {1, 7});
    if (!ok) {
      std::fprintf(stderr, "sampling_bench: run failed\n");
      return 1;
    }
    const bool greedy = c.temperature == 0;
    const char* base_name = greedy ? "argmax_logprob" : "full_sort";
    std::vector<std::int32_t> base_tokens(static_cast<std::size_t>(batch));
    std::vector<float> base_logprob(static_cast<std::size_t>(batch));
    const auto base = laminar::bench::measure(
        [&] {
          parallel_rows(batch, threads, [&](std::int64_t r, std::vector<std::pair<float, std::int32_t>>& buf) {
            const float* row = logits.data() + r * vocab;
            base_tokens[std::size_t(r)] = greedy ? argmax_row(row, vocab, base_logprob[std::size_t(r)])
                                                 : sort_sample_row(row, vocab, c, 0.5, buf);
          });
        },
        {1, greedy ? 7 : 3});
    std::printf("%s: ours %.3f ms, %s %.3f ms per batch\n", c.name, ours.median_s * 1e3, base_name,
                base.median_s * 1e3);
    laminar::bench::require_stable_baseline(base_name, base);
    laminar::bench::report_time(c.name, "ms_per_batch", ours.median_s * 1e3, base_name, base.median_s * 1e3);
  }
  return 0;
}
