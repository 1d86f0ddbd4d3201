// Sampling kernels: Philox known answers, the reference's agreement, sampling distributions,
// batch invariance, degenerate input, and bit-exactness between the CPU kernel and the CUDA kernel
// run on the CPU.
// The harness header comes first: it gives the CUDA kernel source its meaning on the host.
#include "emulation/emulation.h"
#include "laminar/kernels/sampling.h"

#include <fmt/format.h>
#include <hwy/targets.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_absent.h"
#include "expect_code.h"
#include "laminar/internal/numerics.h"
#include "laminar/internal/philox.h"
#include "laminar/ref/sampling.h"
#include "../cuda/sampling.cuh"

namespace {

using laminar::DType;
using laminar::Stream;
using laminar::kernels::SamplingParams;
using laminar::kernels::TokenLogprobParams;

constexpr float kInf = std::numeric_limits<float>::infinity();

// One batch: logits plus per-row settings and outputs, owned together so tests stay short.
struct Batch {
  std::int64_t batch = 0, vocab = 0;
  std::vector<float> logits;
  std::vector<float> temperature, top_p, min_p;
  std::vector<std::int32_t> top_k;
  std::vector<std::uint64_t> seed;
  std::vector<std::int64_t> position;
  std::vector<std::int32_t> token;
  std::vector<float> raw, processed, kept;

  Batch(std::int64_t b, std::int64_t v)
      : batch(b), vocab(v), logits(std::size_t(b * v)), temperature(std::size_t(b), 1.0f),
        top_p(std::size_t(b), 1.0f), min_p(std::size_t(b), 0.0f), top_k(std::size_t(b), 0),
        seed(std::size_t(b), 1), position(std::size_t(b), 0), token(std::size_t(b), -7),
        raw(std::size_t(b)), processed(std::size_t(b)), kept(std::size_t(b)) {}

  float* row(std::int64_t r) { return logits.data() + r * vocab; }

  SamplingParams params() {
    SamplingParams p;
    p.logits = logits.data();
    p.batch = batch;
    p.vocab = vocab;
    p.temperature = temperature.data();
    p.top_k = top_k.data();
    p.top_p = top_p.data();
    p.min_p = min_p.data();
    p.seed = seed.data();
    p.position = position.data();
    p.token = token.data();
    p.raw_logprob = raw.data();
    p.processed_logprob = processed.data();
    p.kept_mass = kept.data();
    return p;
  }
};

void fill_normal(std::vector<float>& v, std::mt19937& rng, float sigma) {
  std::normal_distribution<float> nd(0.0f, sigma);
  for (auto& x : v) x = nd(rng);
}

std::uint32_t bits(float f) { return laminar::internal::f32_bits(f); }

}  // namespace

TEST_CASE("sampling: Philox4x32-10 matches the Random123 known-answer vectors", "[sampling][philox]") {
  using laminar::internal::philox4x32_10;
  // Random123 kat_vectors, "philox4x32 10" lines: counter[4] key[2] -> output[4].
  struct Kat {
    std::uint32_t ctr[4], key[2], out[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat& k : kats) {
    const auto r = philox4x32_10({{k.ctr[0], k.ctr[1], k.ctr[2], k.ctr[3]}}, {{k.key[0], k.key[1]}});
    for (int i = 0; i < 4; ++i) CHECK(r.v[i] == k.out[i]);
  }
}

TEST_CASE("sampling: mul_hi_u64 is the exact high half of the 128-bit product", "[sampling][philox]") {
  std::mt19937_64 rng(11);
  for (int i = 0; i < 100000; ++i) {
    const std::uint64_t a = i < 4 ? ~std::uint64_t(0) * (i & 1) : rng();
    const std::uint64_t b = i < 4 ? ~std::uint64_t(0) * (i >> 1) : rng();
    __extension__ using u128 = unsigned __int128;
    CHECK(laminar::internal::mul_hi_u64(a, b) == std::uint64_t((u128(a) * b) >> 64));
  }
}

TEST_CASE("sampling: greedy picks the largest logit, ties to the lowest id", "[sampling]") {
  Batch b(2, 10);
  for (int i = 0; i < 10; ++i) b.row(0)[i] = float(i % 4);  // maxima at 3 and 7
  for (int i = 0; i < 10; ++i) b.row(1)[i] = -float(i);
  b.temperature = {0.0f, 1e-6f};  // below 1e-5 is greedy too
  REQUIRE(laminar::kernels::run(b.params(), Stream::host()).ok());
  CHECK(b.token[0] == 3);
  CHECK(b.token[1] == 0);
  CHECK(b.processed[0] == 0.0f);
  CHECK(b.kept[0] == 1.0f);
  // log-softmax of row 0 at a maximum: 3 - log(sum exp(x)).
  double z = 0;
  for (int i = 0; i < 10; ++i) z += std::exp(double(i % 4));
  CHECK(b.raw[0] == Approx(3.0 - std::log(z)).margin(1e-6));
}

namespace {

// |kernel - reference| for a log-prob: the kernel rounds x - max, the temperature scaling, the
// float log (< 1 ulp) and the final subtraction in float, each within an ulp of values at most
// max(1, |log-prob|) in size, and truncates each 40-bit weight (relative error of the row sum
// below vocab * 2^-40 <= 1e-6 here); the reference is double. 1e-6 * max(1, |x|) covers 8 ulps.
double logprob_tolerance(double ref) { return 1e-6 + 1e-6 * std::max(1.0, std::fabs(ref)); }

struct Random {
  std::uint64_t seed;
  std::mt19937 rng;
  explicit Random(std::uint64_t s) : seed(s), rng(static_cast<std::uint32_t>(s)) {
    std::printf("random seed %llu\n", static_cast<unsigned long long>(s));
  }
};

// Random settings that exercise each filter alone and together.
void random_settings(Batch& b, std::mt19937& rng) {
  std::uniform_int_distribution<int> mode(0, 7);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (std::int64_t r = 0; r < b.batch; ++r) {
    const int m = mode(rng);
    b.temperature[r] = m == 0 ? 0.0f : 0.3f + 1.5f * unit(rng);
    b.top_k[r] = (m & 1) ? 1 + int(rng() % 64) : 0;
    b.top_p[r] = (m & 2) ? 0.5f + 0.5f * unit(rng) : 1.0f;
    b.min_p[r] = (m & 4) ? 0.2f * unit(rng) : 0.0f;
    b.seed[r] = (std::uint64_t(rng()) << 32) | rng();
    b.position[r] = rng() % 100000;
  }
}

std::vector<std::uint16_t> to_half(const std::vector<float>& x, DType t) {
  std::vector<std::uint16_t> h(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    h[i] = t == DType::kF16 ? laminar::internal::f32_to_f16(x[i]) : laminar::internal::f32_to_bf16(x[i]);
  }
  return h;
}

}  // namespace

TEST_CASE("sampling: kernel agrees with the reference on random rows, dtypes and settings", "[sampling][ref]") {
  Random rnd(20261122);
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (std::int64_t vocab : {1, 7, 300, 5000, 40000}) {
      Batch b(vocab > 10000 ? 6 : 24, vocab);
      fill_normal(b.logits, rnd.rng, vocab % 2 ? 3.0f : 1.0f);
      random_settings(b, rnd.rng);
      const std::vector<std::uint16_t> half = to_half(b.logits, dtype);
      SamplingParams p = b.params();
      p.logits_dtype = dtype;
      if (dtype != DType::kF32) p.logits = half.data();
      REQUIRE(laminar::kernels::run(p, Stream::host()).ok());
      Batch want = b;
      SamplingParams q = want.params();
      q.logits_dtype = dtype;
      if (dtype != DType::kF32) q.logits = half.data();
      REQUIRE(laminar::ref::sample(q).ok());
      for (std::int64_t r = 0; r < b.batch; ++r) {
        INFO("dtype " << laminar::dtype_name(dtype) << " vocab " << vocab << " row " << r << " T "
                      << b.temperature[r] << " k " << b.top_k[r] << " p " << b.top_p[r] << " min_p " << b.min_p[r]);
        REQUIRE(b.token[r] == want.token[r]);
        CHECK(std::fabs(b.raw[r] - want.raw[r]) <= logprob_tolerance(want.raw[r]));
        CHECK(std::fabs(b.processed[r] - want.processed[r]) <= logprob_tolerance(want.processed[r]));
        // The kept mass is a ratio of two sums, each within vocab * 2^-40 of the exact one.
        CHECK(std::fabs(b.kept[r] - want.kept[r]) <= 1e-5 * want.kept[r]);
      }
    }
  }
}

namespace {

// The distribution sample() draws from, computed independently of both kernel and reference:
// keep the k largest (ties kept), then the smallest top group reaching top_p of that mass, then
// min-p; renormalise.
std::vector<double> expected_distribution(const std::vector<float>& x, float t, int k, float top_p, float min_p) {
  const std::size_t v = x.size();
  std::vector<std::size_t> order(v);
  for (std::size_t i = 0; i < v; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return x[a] > x[b]; });
  const double m = x[order[0]];
  std::vector<double> w(v);
  for (std::size_t i = 0; i < v; ++i) w[i] = std::exp((x[i] - m) / t);
  std::size_t cut = v;
  if (k > 0 && std::size_t(k) < v) {
    cut = std::size_t(k);
    while (cut < v && x[order[cut]] == x[order[cut - 1]]) ++cut;
  }
  double zk = 0;
  for (std::size_t j = 0; j < cut; ++j) zk += w[order[j]];
  if (top_p < 1) {
    double acc = 0;
    std::size_t n = 0;
    while (n < cut) {
      acc += w[order[n++]];
      if (n < cut && x[order[n]] == x[order[n - 1]]) continue;
      if (acc >= top_p * zk) break;
    }
    cut = n;
  }
  std::vector<double> prob(v, 0.0);
  double z = 0;
  for (std::size_t j = 0; j < cut; ++j) {
    if (w[order[j]] >= min_p) z += prob[order[j]] = w[order[j]];
  }
  for (auto& pr : prob) pr /= z;
  return prob;
}

// Upper critical value of chi-square with df degrees of freedom at about p = 1e-6 (Wilson-Hilferty),
// so a correct kernel fails once in a million runs.
double chi2_critical(int df) {
  const double z = 4.75;
  const double a = 2.0 / (9.0 * df);
  return df * std::pow(1 - a + z * std::sqrt(a), 3);
}

}  // namespace

TEST_CASE("sampling: draw frequencies match the truncated distribution; tokens outside it are never drawn",
          "[sampling][distribution]") {
  Random rnd(777);
  const std::int64_t vocab = 40, draws = 40000;
  std::vector<float> logits(vocab);
  fill_normal(logits, rnd.rng, 1.5f);
  logits[5] = logits[6] = 2.5f;  // an exact tie inside the kept set
  struct Setting {
    float t;
    int k;
    float top_p, min_p;
  };
  const Setting settings[] = {
      {1.0f, 0, 1.0f, 0.0f}, {0.7f, 10, 1.0f, 0.0f}, {1.0f, 0, 0.6f, 0.0f},
      {1.3f, 0, 1.0f, 0.1f}, {0.9f, 12, 0.8f, 0.05f}, {2.0f, 5, 1.0f, 0.0f},
  };
  for (const Setting& s : settings) {
    INFO("T " << s.t << " k " << s.k << " top_p " << s.top_p << " min_p " << s.min_p);
    Batch b(draws, vocab);
    for (std::int64_t r = 0; r < draws; ++r) {
      std::copy(logits.begin(), logits.end(), b.row(r));
      b.temperature[r] = s.t;
      b.top_k[r] = s.k;
      b.top_p[r] = s.top_p;
      b.min_p[r] = s.min_p;
      b.seed[r] = 99;
      b.position[r] = r;  // one request, many steps: the Philox counter advances
    }
    REQUIRE(laminar::kernels::run(b.params(), Stream::host()).ok());
    const std::vector<double> prob = expected_distribution(logits, s.t, s.k, s.top_p, s.min_p);
    std::vector<std::int64_t> seen(vocab, 0);
    for (std::int32_t t : b.token) {
      REQUIRE(t >= 0);
      REQUIRE(t < vocab);
      ++seen[t];
    }
    double chi2 = 0;
    int kept = 0;
    for (std::int64_t i = 0; i < vocab; ++i) {
      if (prob[i] == 0) {
        INFO("token " << i << " is outside the kept set");
        CHECK(seen[i] == 0);
        continue;
      }
      ++kept;
      const double e = prob[i] * draws;
      chi2 += (seen[i] - e) * (seen[i] - e) / e;
    }
    REQUIRE(kept >= 2);
    CHECK(chi2 < chi2_critical(kept - 1));
    // The kernel's processed log-prob is the log of the same probability.
    for (std::int64_t r = 0; r < 50; ++r) CHECK(b.processed[r] == Approx(std::log(prob[b.token[r]])).margin(1e-5));
  }
}

TEST_CASE("sampling: a request's outputs do not depend on its row, its batch mates or the thread count",
          "[sampling][invariance]") {
  Random rnd(4242);
  for (std::int64_t vocab : {64, 3000, 70000}) {
    Batch alone(1, vocab);
    fill_normal(alone.logits, rnd.rng, 2.0f);
    random_settings(alone, rnd.rng);
    alone.temperature[0] = 0.9f;
    alone.top_k[0] = 40;
    alone.top_p[0] = 0.9f;
    REQUIRE(laminar::kernels::run(alone.params(), Stream::host()).ok());
    for (int trial = 0; trial < 6; ++trial) {
      const std::int64_t batch = 1 + std::int64_t(rnd.rng() % 64);
      const std::int64_t at = std::int64_t(rnd.rng() % std::uint32_t(batch));
      Batch b(batch, vocab);
      fill_normal(b.logits, rnd.rng, 4.0f);
      random_settings(b, rnd.rng);
      std::copy(alone.logits.begin(), alone.logits.end(), b.row(at));
      b.temperature[at] = alone.temperature[0];
      b.top_k[at] = alone.top_k[0];
      b.top_p[at] = alone.top_p[0];
      b.min_p[at] = alone.min_p[0];
      b.seed[at] = alone.seed[0];
      b.position[at] = alone.position[0];
      SamplingParams p = b.params();
      p.cpu_threads = 1 + trial % 3;
      REQUIRE(laminar::kernels::run(p, Stream::host()).ok());
      INFO("vocab " << vocab << " batch " << batch << " row " << at << " threads " << p.cpu_threads);
      CHECK(b.token[at] == alone.token[0]);
      CHECK(bits(b.raw[at]) == bits(alone.raw[0]));
      CHECK(bits(b.processed[at]) == bits(alone.processed[0]));
      CHECK(bits(b.kept[at]) == bits(alone.kept[0]));
    }
  }
}

TEST_CASE("sampling: token_logprob equals the sampled raw log-prob bit for bit and the reference within tolerance",
          "[sampling][logprob]") {
  Random rnd(31337);
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    Batch b(16, 20000);
    fill_normal(b.logits, rnd.rng, 3.0f);
    random_settings(b, rnd.rng);
    const std::vector<std::uint16_t> half = to_half(b.logits, dtype);
    SamplingParams p = b.params();
    p.logits_dtype = dtype;
    if (dtype != DType::kF32) p.logits = half.data();
    REQUIRE(laminar::kernels::run(p, Stream::host()).ok());
    std::vector<float> lp(16), want(16);
    TokenLogprobParams t{p.logits, dtype, 16, 20000, 0, b.token.data(), lp.data(), 0};
    REQUIRE(laminar::kernels::run(t, Stream::host()).ok());
    t.logprob = want.data();
    REQUIRE(laminar::ref::token_logprob(t).ok());
    for (int r = 0; r < 16; ++r) {
      INFO("dtype " << laminar::dtype_name(dtype) << " row " << r);
      CHECK(bits(lp[r]) == bits(b.raw[r]));
      CHECK(std::fabs(lp[r] - want[r]) <= logprob_tolerance(want[r]));
    }
  }
}

TEST_CASE("sampling: f16 and bf16 logits give the bits of the same logits widened to f32", "[sampling][dtype]") {
  // Every finite f16 / bf16 pattern in one row, so the SIMD widening meets subnormals and extremes.
  for (DType dtype : {DType::kF16, DType::kBF16}) {
    std::vector<std::uint16_t> half;
    for (std::uint32_t h = 0; h < 65536; ++h) {
      const float f = dtype == DType::kF16 ? laminar::internal::f16_to_f32(std::uint16_t(h))
                                           : laminar::internal::bf16_to_f32(std::uint16_t(h));
      if (std::isfinite(f) && std::fabs(f) < 60000.0f) half.push_back(std::uint16_t(h));
    }
    const auto vocab = std::int64_t(half.size());
    std::vector<float> wide(half.size());
    for (std::size_t i = 0; i < half.size(); ++i) {
      wide[i] = dtype == DType::kF16 ? laminar::internal::f16_to_f32(half[i]) : laminar::internal::bf16_to_f32(half[i]);
    }
    std::vector<std::int32_t> tok = {0};
    std::vector<float> a(1), w(1);
    tok[0] = std::int32_t(vocab / 3);
    TokenLogprobParams t{half.data(), dtype, 1, vocab, 0, tok.data(), a.data(), 1};
    REQUIRE(laminar::kernels::run(t, Stream::host()).ok());
    t.logits = wide.data();
    t.logits_dtype = DType::kF32;
    t.logprob = w.data();
    REQUIRE(laminar::kernels::run(t, Stream::host()).ok());
    CHECK(bits(a[0]) == bits(w[0]));
  }
}

TEST_CASE("sampling: degenerate rows give defined results", "[sampling][degenerate]") {
  Batch b(6, 5);
  const float rows[6][5] = {
      {-kInf, -kInf, -kInf, -kInf, -kInf},                             // no distribution
      {0.0f, std::numeric_limits<float>::quiet_NaN(), 1.0f, 2.0f, 3.0f},  // NaN
      {0.0f, kInf, 1.0f, 2.0f, 3.0f},                                  // +inf
      {-kInf, 2.0f, -kInf, 2.0f, -kInf},                               // two finite, tied
      {1.0f, 3.0f, 3.0f, 2.0f, 0.0f},                                  // top_p = 0
      {1.0f, 2.0f, 3.0f, 4.0f, 5.0f},                                  // min_p = 1
  };
  for (int r = 0; r < 6; ++r) std::copy(rows[r], rows[r] + 5, b.row(r));
  b.top_p[4] = 0.0f;
  b.min_p[5] = 1.0f;
  REQUIRE(laminar::kernels::run(b.params(), Stream::host()).ok());
  for (int r = 0; r < 3; ++r) {
    INFO("row " << r);
    CHECK(b.token[r] == laminar::kernels::kInvalidToken);
    CHECK(std::isnan(b.raw[r]));
    CHECK(std::isnan(b.processed[r]));
    CHECK(b.kept[r] == 0.0f);
  }
  CHECK((b.token[3] == 1 || b.token[3] == 3));
  CHECK(b.raw[3] == Approx(std::log(0.5)).margin(1e-6));
  CHECK(b.processed[3] == Approx(std::log(0.5)).margin(1e-6));
  // top_p = 0 keeps the tokens tied at the maximum; min_p = 1 keeps only the maximum.
  CHECK((b.token[4] == 1 || b.token[4] == 2));
  CHECK(b.token[5] == 4);
  CHECK(b.processed[5] == 0.0f);
  // The two ties of row 3 are both drawn over many positions.
  Batch many(200, 5);
  for (int r = 0; r < 200; ++r) {
    std::copy(rows[3], rows[3] + 5, many.row(r));
    many.position[r] = r;
  }
  REQUIRE(laminar::kernels::run(many.params(), Stream::host()).ok());
  const auto ones = std::count(many.token.begin(), many.token.end(), 1);
  const auto threes = std::count(many.token.begin(), many.token.end(), 3);
  CHECK(ones + threes == 200);
  CHECK(ones > 50);
  CHECK(threes > 50);
}

TEST_CASE("sampling: top_k = 0 disables top-k; vocab 1 always samples token 0", "[sampling][degenerate]") {
  Random rnd(5);
  Batch off(8, 100), full(8, 100);
  fill_normal(off.logits, rnd.rng, 1.0f);
  full.logits = off.logits;
  for (int r = 0; r < 8; ++r) {
    off.position[r] = full.position[r] = r;
    full.top_k[r] = 100;
  }
  REQUIRE(laminar::kernels::run(off.params(), Stream::host()).ok());
  REQUIRE(laminar::kernels::run(full.params(), Stream::host()).ok());
  CHECK(off.token == full.token);
  CHECK(off.kept == full.kept);
  Batch one(3, 1);
  one.logits = {-3.0f, 0.0f, 1e30f};
  one.temperature = {0.0f, 1.0f, 5.0f};
  REQUIRE(laminar::kernels::run(one.params(), Stream::host()).ok());
  for (int r = 0; r < 3; ++r) {
    CHECK(one.token[r] == 0);
    CHECK(one.raw[r] == 0.0f);
    CHECK(one.processed[r] == 0.0f);
    CHECK(one.kept[r] == 1.0f);
  }
}

TEST_CASE("sampling: bad input is rejected with the field and value named, outputs untouched", "[sampling][errors]") {
  Batch b(3, 10);
  auto expect_error = [&](SamplingParams p, const char* needle) {
    const laminar::Status st = laminar::kernels::run(p, Stream::host());
    INFO(st.to_string());
    CHECK(st.code() == laminar::StatusCode::kInvalidArgument);
    CHECK(st.message().find(needle) != std::string::npos);
    CHECK(b.token == std::vector<std::int32_t>(3, -7));
  };
  SamplingParams p = b.params();
  p.vocab = 0;
  expect_error(p, "vocab = 0");
  p = b.params();
  p.batch = -1;
  expect_error(p, "batch is negative (-1)");
  p = b.params();
  p.logits_dtype = DType::kI32;
  expect_error(p, "logits_dtype i32");
  p = b.params();
  p.row_stride = 5;
  expect_error(p, "row_stride = 5");
  p = b.params();
  p.seed = nullptr;
  expect_error(p, "seed is null");
  b.temperature[1] = -1.0f;
  expect_error(b.params(), "temperature[1] = -1");
  b.temperature[1] = std::numeric_limits<float>::quiet_NaN();
  expect_error(b.params(), "temperature[1] = nan");
  b.temperature[1] = 1.0f;
  b.top_k[2] = -3;
  expect_error(b.params(), "top_k[2] = -3");
  b.top_k[2] = 0;
  b.top_p[0] = 1.5f;
  expect_error(b.params(), "top_p[0] = 1.5");
  b.top_p[0] = 1.0f;
  b.min_p[2] = -0.25f;
  expect_error(b.params(), "min_p[2] = -0.25");
  b.min_p[2] = 0.0f;
  b.position[1] = -4;
  expect_error(b.params(), "position[1] = -4");
  b.position[1] = 0;
  CHECK(laminar::ref::sample(b.params()).ok());
  // Empty batch: nothing to do, null pointers allowed.
  SamplingParams empty;
  empty.vocab = 10;
  CHECK(laminar::kernels::run(empty, Stream::host()).ok());
  // token_logprob: a token outside the vocabulary names the row and the id.
  std::vector<std::int32_t> tok = {3, 10, 0};
  std::vector<float> lp(3, 1.0f);
  TokenLogprobParams t{b.logits.data(), DType::kF32, 3, 10, 0, tok.data(), lp.data(), 0};
  const laminar::Status st = laminar::kernels::run(t, Stream::host());
  CHECK(st.code() == laminar::StatusCode::kInvalidArgument);
  CHECK(st.message().find("token[1] = 10") != std::string::npos);
  CHECK(lp == std::vector<float>(3, 1.0f));
}

TEST_CASE("sampling: a CUDA stream without a device answers kFailedPrecondition (kUnimplemented without CUDA)",
          "[sampling][cuda]") {
  const auto code = laminar::testing::code_without_device();
  if (!code) return;  // a device is present: sampling_cuda_test runs the kernels
  Batch b(3, 10);
  REQUIRE(laminar::kernels::can_implement(b.params(), Stream::cuda(nullptr)).ok());
  laminar::testing::expect_code(laminar::kernels::run(b.params(), Stream::cuda(nullptr)), *code, "sample");
  CHECK(b.token == std::vector<std::int32_t>(3, -7));
  std::vector<std::int32_t> tok = {3, 1, 0};
  std::vector<float> lp(3, 1.0f);
  const TokenLogprobParams t{b.logits.data(), DType::kF32, 3, 10, 0, tok.data(), lp.data(), 0};
  REQUIRE(laminar::kernels::can_implement(t, Stream::cuda(nullptr)).ok());
  laminar::testing::expect_code(laminar::kernels::run(t, Stream::cuda(nullptr)), *code, "token_logprob");
  CHECK(lp == std::vector<float>(3, 1.0f));
}

TEST_CASE("sampling: SIMD weights equal the scalar definition bit for bit across the whole weight range",
          "[sampling][simd]") {
  // Logits spread over [max - 30, max], so every weight from 2^40 down to the cutoff occurs, and
  // the vocabulary is not a multiple of any vector width (tails run the scalar code).
  namespace sd = laminar::kernels::sampling_detail;
  Random rnd(8080);
  std::uniform_real_distribution<float> spread(-30.0f, 0.0f);
  for (float t : {1.0f, 0.37f, 2.5f}) {
    const std::int64_t vocab = 100003;
    Batch b(1, vocab);
    for (auto& x : b.logits) x = 4.0f + spread(rnd.rng);
    b.temperature[0] = t;
    REQUIRE(laminar::kernels::run(b.params(), Stream::host()).ok());
    std::uint32_t max_key = 0;
    for (float x : b.logits) max_key = std::max(max_key, sd::order_key(x));
    const float m = sd::row_max(max_key);
    sd::RowSettings r;
    r.inv_t = laminar::internal::div_rn(1.0f, t);
    std::uint64_t z_raw = 0, z_all = 0;
    for (float x : b.logits) {
      const float d = laminar::internal::sub_rn(x, m);
      z_raw += sd::fixed_weight(d);
      z_all += sd::fixed_weight(sd::scaled(d, r));
    }
    const std::int32_t tok = b.token[0];
    REQUIRE(tok >= 0);
    const sd::RowResult want = sd::sampled_result(tok, b.logits[std::size_t(tok)], m, r, z_raw, z_all, z_all);
    INFO("T " << t);
    CHECK(bits(b.raw[0]) == bits(want.raw_logprob));
    CHECK(bits(b.processed[0]) == bits(want.processed_logprob));
    CHECK(b.kept[0] == 1.0f);
  }
}

namespace {

// Runs the CUDA sampling kernel on the CPU through the harness, one block per row.
laminar::Status run_emulated(const SamplingParams& p) {
  namespace sd = laminar::kernels::sampling_detail;
  const std::int64_t stride = p.row_stride == 0 ? p.vocab : p.row_stride;
  const auto grid = laminar::emu::dim3(static_cast<unsigned>(p.batch));
  const auto block = laminar::emu::dim3(sd::kThreads);
  const std::size_t smem = sizeof(sd::SharedState);
  const std::uint64_t seed = laminar::emu::test_seed();
  switch (p.logits_dtype) {
    case DType::kF16:
      return laminar::emu::launch(grid, block, smem, seed, sd::sampling_kernel<sd::LogitKind::kF16>, p, stride);
    case DType::kBF16:
      return laminar::emu::launch(grid, block, smem, seed, sd::sampling_kernel<sd::LogitKind::kBF16>, p, stride);
    default:
      return laminar::emu::launch(grid, block, smem, seed, sd::sampling_kernel<sd::LogitKind::kF32>, p, stride);
  }
}

laminar::Status run_emulated(const TokenLogprobParams& p) {
  namespace sd = laminar::kernels::sampling_detail;
  const std::int64_t stride = p.row_stride == 0 ? p.vocab : p.row_stride;
  return laminar::emu::launch(laminar::emu::dim3(static_cast<unsigned>(p.batch)), laminar::emu::dim3(sd::kThreads),
                              sizeof(sd::SharedState), laminar::emu::test_seed(),
                              sd::token_logprob_kernel<sd::LogitKind::kF32>, p, stride);
}

void check_same_bits(const Batch& a, const Batch& b) {
  for (std::int64_t r = 0; r < a.batch; ++r) {
    INFO("row " << r << " T " << a.temperature[r] << " k " << a.top_k[r] << " p " << a.top_p[r] << " min_p "
                << a.min_p[r]);
    CHECK(a.token[r] == b.token[r]);
    CHECK(bits(a.raw[r]) == bits(b.raw[r]));
    CHECK(bits(a.processed[r]) == bits(b.processed[r]));
    CHECK(bits(a.kept[r]) == bits(b.kept[r]));
  }
}

}  // namespace

TEST_CASE("sampling: CUDA kernel run on the CPU equals the CPU kernel bit for bit", "[sampling][emulation]") {
  Random rnd(9001);
  // Vocabularies below and above the shared-memory candidate capacity (2048): narrow logits make
  // every token a candidate, so 3000 and 9000 exercise the re-read-from-global path.
  struct Shape {
    std::int64_t batch, vocab;
    float sigma;
    DType dtype;
  };
  const Shape shapes[] = {{6, 1, 1.0f, DType::kF32},   {10, 37, 2.0f, DType::kF32},  {10, 1000, 3.0f, DType::kBF16},
                          {6, 3000, 1.0f, DType::kF32}, {4, 9000, 8.0f, DType::kF16}, {3, 9000, 1.0f, DType::kF32}};
  for (const Shape& sh : shapes) {
    Batch cpu(sh.batch, sh.vocab);
    fill_normal(cpu.logits, rnd.rng, sh.sigma);
    random_settings(cpu, rnd.rng);
    if (sh.vocab > 100) cpu.row(0)[7] = std::numeric_limits<float>::quiet_NaN();  // an invalid row rides along
    const std::vector<std::uint16_t> half = to_half(cpu.logits, sh.dtype);
    Batch emu = cpu;
    SamplingParams p = cpu.params(), q = emu.params();
    p.logits_dtype = q.logits_dtype = sh.dtype;
    if (sh.dtype != DType::kF32) p.logits = q.logits = half.data();
    REQUIRE(laminar::kernels::run(p, Stream::host()).ok());
    const laminar::Status st = run_emulated(q);
    INFO("vocab " << sh.vocab << " dtype " << laminar::dtype_name(sh.dtype) << ": " << st.to_string());
    REQUIRE(st.ok());
    check_same_bits(cpu, emu);
  }
}

TEST_CASE("sampling: CUDA token_logprob run on the CPU equals the CPU kernel bit for bit", "[sampling][emulation]") {
  Random rnd(1234567);
  Batch b(5, 2500);
  fill_normal(b.logits, rnd.rng, 2.0f);
  for (int r = 0; r < 5; ++r) b.token[r] = std::int32_t(rnd.rng() % 2500);
  std::vector<float> cpu(5), emu(5);
  TokenLogprobParams p{b.logits.data(), DType::kF32, 5, 2500, 0, b.token.data(), cpu.data(), 0};
  REQUIRE(laminar::kernels::run(p, Stream::host()).ok());
  p.logprob = emu.data();
  REQUIRE(run_emulated(p).ok());
  for (int r = 0; r < 5; ++r) CHECK(bits(cpu[r]) == bits(emu[r]));
}

TEST_CASE("sampling: row_stride skips padding: padded rows give the packed rows' bits, CPU and CUDA-on-CPU",
          "[sampling][stride]") {
  Random rnd(2718);
  const std::int64_t batch = 5, vocab = 700, stride = 1031;
  Batch packed(batch, vocab);
  fill_normal(packed.logits, rnd.rng, 2.0f);
  random_settings(packed, rnd.rng);
  Batch padded = packed, emu = packed;
  std::vector<float> wide(std::size_t(batch * stride), std::numeric_limits<float>::quiet_NaN());
  for (std::int64_t r = 0; r < batch; ++r) std::copy(packed.row(r), packed.row(r) + vocab, wide.data() + r * stride);
  REQUIRE(laminar::kernels::run(packed.params(), Stream::host()).ok());
  SamplingParams p = padded.params(), q = emu.params();
  p.logits = q.logits = wide.data();
  p.row_stride = q.row_stride = stride;
  REQUIRE(laminar::kernels::run(p, Stream::host()).ok());
  REQUIRE(run_emulated(q).ok());
  check_same_bits(packed, padded);
  check_same_bits(packed, emu);
}

TEST_CASE("sampling: extreme temperatures and logit scales agree with the reference", "[sampling][ref]") {
  Random rnd(16180);
  const float temps[] = {1e-4f, 0.01f, 50.0f, 1000.0f};
  const float scales[] = {1e-3f, 1.0f, 1000.0f};
  for (float t : temps) {
    for (float scale : scales) {
      Batch b(4, 3000);
      fill_normal(b.logits, rnd.rng, scale);
      random_settings(b, rnd.rng);
      for (std::int64_t r = 0; r < b.batch; ++r) b.temperature[r] = t;
      Batch want = b;
      REQUIRE(laminar::kernels::run(b.params(), Stream::host()).ok());
      REQUIRE(laminar::ref::sample(want.params()).ok());
      for (std::int64_t r = 0; r < b.batch; ++r) {
        INFO("T " << t << " scale " << scale << " row " << r << " k " << b.top_k[r] << " p " << b.top_p[r]
                  << " min_p " << b.min_p[r]);
        REQUIRE(b.token[r] == want.token[r]);
        CHECK(std::fabs(b.raw[r] - want.raw[r]) <= logprob_tolerance(want.raw[r]));
        CHECK(std::fabs(b.processed[r] - want.processed[r]) <= logprob_tolerance(want.processed[r]));
        CHECK(std::fabs(b.kept[r] - want.kept[r]) <= 1e-5 * want.kept[r]);
      }
    }
  }
}

TEST_CASE("sampling: every SIMD target compiled in gives the same bits", "[sampling][simd]") {
  // The FMA targets run exp lane by lane, the others the scalar exp_f32; all must agree.
  Random rnd(424242);
  Batch b(12, 20011);
  fill_normal(b.logits, rnd.rng, 2.0f);
  random_settings(b, rnd.rng);
  const std::vector<std::uint16_t> half = to_half(b.logits, DType::kBF16);
  std::vector<Batch> results;
  std::vector<std::vector<float>> logprobs;
  const std::vector<std::int64_t> targets = hwy::SupportedAndGeneratedTargets();
  for (std::int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    hwy::GetChosenTarget().Update(hwy::SupportedTargets());
    std::printf("SIMD target %s\n", hwy::TargetName(target));
    Batch out = b;
    SamplingParams p = out.params();
    p.logits_dtype = DType::kBF16;
    p.logits = half.data();
    REQUIRE(laminar::kernels::run(p, Stream::host()).ok());
    std::vector<float> lp(12);
    TokenLogprobParams t{b.logits.data(), DType::kF32, 12, 20011, 0, out.token.data(), lp.data(), 0};
    REQUIRE(laminar::kernels::run(t, Stream::host()).ok());
    results.push_back(out);
    logprobs.push_back(lp);
  }
  hwy::SetSupportedTargetsForTest(0);
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
  REQUIRE(!results.empty());
  for (std::size_t i = 1; i < results.size(); ++i) {
    INFO("target " << hwy::TargetName(targets[i]) << " vs " << hwy::TargetName(targets[0]));
    check_same_bits(results[0], results[i]);
    for (int r = 0; r < 12; ++r) CHECK(bits(logprobs[i][r]) == bits(logprobs[0][r]));
  }
}

namespace {

laminar::TensorView vec_view(void* data, DType t, std::int64_t n, laminar::Device d = laminar::Device::cpu()) {
  const std::int64_t shape[1] = {n};
  return laminar::TensorView::contiguous(data, t, shape, d).value();
}

// Views of a Batch, logits taken as [batch, vocab] rows `stride` apart inside `logits`, seeds as the
// i64 tensor a framework holds them in.
struct BatchViews {
  std::vector<std::int64_t> seed_i64;
  laminar::kernels::SamplingTensors t;

  BatchViews(Batch& b, float* logits, std::int64_t stride) : seed_i64(b.seed.size()) {
    std::memcpy(seed_i64.data(), b.seed.data(), b.seed.size() * sizeof(std::uint64_t));
    const std::int64_t shape[2] = {b.batch, b.vocab}, strides[2] = {stride, 1};
    t.logits = laminar::TensorView::strided(logits, DType::kF32, shape, strides).value();
    t.temperature = vec_view(b.temperature.data(), DType::kF32, b.batch);
    t.top_k = vec_view(b.top_k.data(), DType::kI32, b.batch);
    t.top_p = vec_view(b.top_p.data(), DType::kF32, b.batch);
    t.min_p = vec_view(b.min_p.data(), DType::kF32, b.batch);
    t.seed = vec_view(seed_i64.data(), DType::kI64, b.batch);
    t.position = vec_view(b.position.data(), DType::kI64, b.batch);
    t.token = vec_view(b.token.data(), DType::kI32, b.batch);
    t.raw_logprob = vec_view(b.raw.data(), DType::kF32, b.batch);
    t.processed_logprob = vec_view(b.processed.data(), DType::kF32, b.batch);
    t.kept_mass = vec_view(b.kept.data(), DType::kF32, b.batch);
  }
};

void expect_refused(const laminar::kernels::SamplingTensors& t, const char* text) {
  auto p = SamplingParams::from_tensors(t);
  REQUIRE_FALSE(p.ok());
  CHECK(p.status().code() == laminar::StatusCode::kInvalidArgument);
  CHECK_THAT(p.status().message(), Catch::Contains(text));
}

}  // namespace

TEST_CASE("sampling: from tensors (strided logits, i64 seeds) matches the raw-pointer call bit for bit",
          "[sampling][tensors]") {
  Random rnd(4242);
  const std::int64_t batch = 6, vocab = 900, stride = 1024;
  Batch raw(batch, vocab);
  fill_normal(raw.logits, rnd.rng, 2.0f);
  random_settings(raw, rnd.rng);
  for (std::int64_t r = 0; r < batch; ++r) raw.seed[std::size_t(r)] = (std::uint64_t(rnd.rng()) << 32) | rnd.rng();
  raw.seed[0] = ~std::uint64_t(0);  // a seed above INT64_MAX keeps its bits through the i64 tensor
  Batch viewed = raw;
  std::vector<float> wide(std::size_t(batch * stride), std::numeric_limits<float>::quiet_NaN());
  for (std::int64_t r = 0; r < batch; ++r) std::copy(raw.row(r), raw.row(r) + vocab, wide.data() + r * stride);
  REQUIRE(laminar::kernels::run(raw.params(), Stream::host()).ok());
  BatchViews v(viewed, wide.data(), stride);
  auto p = SamplingParams::from_tensors(v.t);
  REQUIRE(p.ok());
  CHECK(p->row_stride == stride);
  CHECK(laminar::kernels::workspace_bytes(*p) == 0);
  p->cpu_threads = 2;
  REQUIRE(laminar::kernels::run(*p, Stream::host()).ok());
  check_same_bits(raw, viewed);

  // Optional settings left out give every row the default, as null pointers do.
  Batch defaults = raw;
  SamplingParams d = defaults.params();
  d.temperature = nullptr;
  d.top_k = nullptr;
  d.top_p = nullptr;
  d.min_p = nullptr;
  REQUIRE(laminar::kernels::run(d, Stream::host()).ok());
  Batch defaults_viewed = raw;
  BatchViews dv(defaults_viewed, wide.data(), stride);
  dv.t.temperature.reset();
  dv.t.top_k.reset();
  dv.t.top_p.reset();
  dv.t.min_p.reset();
  auto dp = SamplingParams::from_tensors(dv.t);
  REQUIRE(dp.ok());
  CHECK(dp->temperature == nullptr);
  REQUIRE(laminar::kernels::run(*dp, Stream::host()).ok());
  check_same_bits(defaults, defaults_viewed);
}

TEST_CASE("sampling: from tensors, each kind of mismatch is refused, naming the tensor", "[sampling][tensors]") {
  Batch b(4, 50);
  std::vector<std::int64_t> wrong_i64(8);
  std::vector<float> wrong_f32(8);
  BatchViews good(b, b.logits.data(), 50);
  REQUIRE(SamplingParams::from_tensors(good.t).ok());
  {
    BatchViews v(b, b.logits.data(), 50);
    v.t.temperature = vec_view(wrong_f32.data(), DType::kF32, 5);
    expect_refused(v.t, "sample: temperature: shape [5] but logits gives dim 0 = 4");
  }
  {
    BatchViews v(b, b.logits.data(), 50);
    v.t.top_k = vec_view(wrong_i64.data(), DType::kI64, 4);
    expect_refused(v.t, "sample: top_k: dtype i64 but i32 is needed");
  }
  {
    BatchViews v(b, b.logits.data(), 50);
    v.t.seed = vec_view(b.token.data(), DType::kI32, 4);
    expect_refused(v.t, "sample: seed: dtype i32 but i64 is needed");
  }
  {
    BatchViews v(b, b.logits.data(), 50);
    const std::int64_t shape[1] = {4}, strides[1] = {2};
    v.t.position = laminar::TensorView::strided(wrong_i64.data(), DType::kI64, shape, strides).value();
    expect_refused(v.t, "sample: position: strides [2] of shape [4] are not dense");
  }
  {
    BatchViews v(b, b.logits.data(), 50);
    v.t.token = vec_view(b.token.data(), DType::kI32, 4, laminar::Device::cuda(0));
    expect_refused(v.t, "sample: token: on cuda:0 but logits is on cpu:0");
  }
  {
    BatchViews v(b, b.logits.data(), 50);
    v.t.kept_mass = vec_view(wrong_f32.data(), DType::kF32, 4, laminar::Device::cuda(0));
    expect_refused(v.t, "sample: kept_mass: on cuda:0 but logits is on cpu:0");
  }
  {
    BatchViews v(b, b.logits.data(), 50);
    const std::int64_t shape[2] = {4, 25}, strides[2] = {1, 4};
    v.t.logits = laminar::TensorView::strided(b.logits.data(), DType::kF32, shape, strides).value();
    v.t.temperature = vec_view(b.temperature.data(), DType::kF32, 4);
    expect_refused(v.t, "sample: logits: stride 4 along the vocabulary, not 1");
  }
  {
    BatchViews v(b, b.logits.data(), 50);
    const std::int64_t shape[2] = {4, 50}, strides[2] = {40, 1};
    v.t.logits = laminar::TensorView::strided(b.logits.data(), DType::kF32, shape, strides).value();
    expect_refused(v.t, "sample: logits: row stride 40 below the vocabulary of 50");
  }
  {
    BatchViews v(b, b.logits.data(), 50);
    v.t.logits = vec_view(b.logits.data(), DType::kF32, 200);
    expect_refused(v.t, "sample: logits: shape [200] but [batch, vocab] is needed");
  }
  {
    BatchViews v(b, b.logits.data(), 50);
    const std::int64_t shape[2] = {4, 50};
    v.t.logits = laminar::TensorView::contiguous(b.logits.data(), DType::kI32, shape).value();
    expect_refused(v.t, "sample: logits: dtype i32 but f32, f16 or bf16 is needed");
  }
}

TEST_CASE("sampling: from tensors, every tensor's wrong shape, dtype, stride and device is refused, naming it",
          "[sampling][tensors]") {
  using laminar::kernels::SamplingTensors;
  using laminar::TensorView;
  Batch b(4, 50);
  // Room for a [4] tensor of any dtype at stride 2, or a [5] one.
  std::vector<std::int64_t> scratch(16);
  struct Field {
    const char* name;
    TensorView& (*get)(SamplingTensors&);
    DType wrong_dtype;
  };
  const Field fields[] = {
      {"temperature", [](SamplingTensors& t) -> TensorView& { return *t.temperature; }, DType::kF16},
      {"top_k", [](SamplingTensors& t) -> TensorView& { return *t.top_k; }, DType::kI64},
      {"top_p", [](SamplingTensors& t) -> TensorView& { return *t.top_p; }, DType::kF16},
      {"min_p", [](SamplingTensors& t) -> TensorView& { return *t.min_p; }, DType::kBF16},
      {"seed", [](SamplingTensors& t) -> TensorView& { return t.seed; }, DType::kI32},
      {"position", [](SamplingTensors& t) -> TensorView& { return t.position; }, DType::kI32},
      {"token", [](SamplingTensors& t) -> TensorView& { return t.token; }, DType::kI64},
      {"raw_logprob", [](SamplingTensors& t) -> TensorView& { return *t.raw_logprob; }, DType::kF16},
      {"processed_logprob", [](SamplingTensors& t) -> TensorView& { return *t.processed_logprob; }, DType::kI32},
      {"kept_mass", [](SamplingTensors& t) -> TensorView& { return *t.kept_mass; }, DType::kU8},
  };
  BatchViews good(b, b.logits.data(), 50);
  REQUIRE(SamplingParams::from_tensors(good.t).ok());
  for (const Field& f : fields) {
    INFO("tensor " << f.name);
    const std::string at = std::string("sample: ") + f.name + ": ";
    const DType dtype = f.get(good.t).dtype();
    const auto refused_with = [&](const TensorView& replacement, const std::string& text) {
      BatchViews v(b, b.logits.data(), 50);
      f.get(v.t) = replacement;
      expect_refused(v.t, (at + text).c_str());
    };
    refused_with(vec_view(scratch.data(), dtype, 5), "shape [5] but logits gives dim 0 = 4");
    const std::int64_t column[2] = {4, 1};
    refused_with(TensorView::contiguous(scratch.data(), dtype, column).value(), "shape [4, 1] but [4] is needed");
    refused_with(vec_view(scratch.data(), f.wrong_dtype, 4),
                 fmt::format("dtype {} but {} is needed", laminar::dtype_name(f.wrong_dtype),
                             laminar::dtype_name(dtype)));
    const std::int64_t shape[1] = {4}, strides[1] = {2};
    refused_with(TensorView::strided(scratch.data(), dtype, shape, strides).value(),
                 "strides [2] of shape [4] are not dense");
    refused_with(vec_view(scratch.data(), dtype, 4, laminar::Device::cuda(0)), "on cuda:0 but logits is on cpu:0");
  }
  // logits, which every other tensor is measured against.
  const auto refused_logits = [&](const TensorView& logits, const char* text) {
    BatchViews v(b, b.logits.data(), 50);
    v.t.logits = logits;
    expect_refused(v.t, text);
  };
  const std::int64_t shape[2] = {4, 50}, taller[2] = {5, 40};
  refused_logits(vec_view(b.logits.data(), DType::kF32, 200),
                 "sample: logits: shape [200] but [batch, vocab] is needed");
  refused_logits(TensorView::contiguous(b.logits.data(), DType::kI64, shape).value(),
                 "sample: logits: dtype i64 but f32, f16 or bf16 is needed");
  refused_logits(TensorView::contiguous(b.logits.data(), DType::kF32, taller).value(),
                 "sample: temperature: shape [4] but logits gives dim 0 = 5");
  const std::int64_t column_major[2] = {1, 4};
  refused_logits(TensorView::strided(b.logits.data(), DType::kF32, shape, column_major).value(),
                 "sample: logits: stride 4 along the vocabulary, not 1");
  refused_logits(TensorView::contiguous(b.logits.data(), DType::kF32, shape, laminar::Device::cuda(0)).value(),
                 "sample: temperature: on cpu:0 but logits is on cuda:0");
}

TEST_CASE("sampling: token_logprob from tensors, i32 and i64 token ids match the raw-pointer call bit for bit",
          "[sampling][tensors]") {
  Random rnd(777);
  const std::int64_t batch = 5, vocab = 1300;
  Batch b(batch, vocab);
  fill_normal(b.logits, rnd.rng, 2.0f);
  std::vector<std::int64_t> ids64(static_cast<std::size_t>(batch));
  for (std::int64_t r = 0; r < batch; ++r) {
    b.token[std::size_t(r)] = std::int32_t(rnd.rng() % vocab);
    ids64[std::size_t(r)] = b.token[std::size_t(r)];
  }
  const auto n = static_cast<std::size_t>(batch);
  std::vector<float> raw(n), from32(n), from64(n);
  TokenLogprobParams rp{b.logits.data(), DType::kF32, batch, vocab, 0, b.token.data(), raw.data(), 0};
  REQUIRE(laminar::kernels::run(rp, Stream::host()).ok());
  const std::int64_t shape[2] = {batch, vocab};
  laminar::kernels::TokenLogprobTensors t{laminar::TensorView::contiguous(b.logits.data(), DType::kF32, shape).value(),
                                          vec_view(b.token.data(), DType::kI32, batch),
                                          vec_view(from32.data(), DType::kF32, batch)};
  auto p32 = TokenLogprobParams::from_tensors(t);
  REQUIRE(p32.ok());
  REQUIRE(laminar::kernels::run(*p32, Stream::host()).ok());
  t.token = vec_view(ids64.data(), DType::kI64, batch);
  t.logprob = vec_view(from64.data(), DType::kF32, batch);
  // i64 ids need somewhere to put their i32 copy.
  auto no_copy = TokenLogprobParams::from_tensors(t);
  REQUIRE_FALSE(no_copy.ok());
  CHECK_THAT(no_copy.status().message(), Catch::Contains("token_logprob: token: i64 indices need a buffer"));
  std::vector<std::int32_t> copy;
  auto p64 = TokenLogprobParams::from_tensors(t, &copy);
  REQUIRE(p64.ok());
  REQUIRE(laminar::kernels::run(*p64, Stream::host()).ok());
  for (std::int64_t r = 0; r < batch; ++r) {
    CHECK(bits(from32[std::size_t(r)]) == bits(raw[std::size_t(r)]));
    CHECK(bits(from64[std::size_t(r)]) == bits(raw[std::size_t(r)]));
  }
  // An id that does not fit int32, a wrong length, a wrong output dtype, i64 on a device.
  ids64[2] = std::int64_t(1) << 40;
  auto big = TokenLogprobParams::from_tensors(t, &copy);
  REQUIRE_FALSE(big.ok());
  CHECK_THAT(big.status().message(), Catch::Contains("token: [2] = 1099511627776 does not fit int32"));
  t.token = vec_view(ids64.data(), DType::kI64, batch - 1);
  CHECK_THAT(TokenLogprobParams::from_tensors(t, &copy).status().message(),
             Catch::Contains("token: shape [4] but logits gives dim 0 = 5"));
  t.token = vec_view(b.token.data(), DType::kI32, batch);
  t.logprob = vec_view(ids64.data(), DType::kI64, batch);
  CHECK_THAT(TokenLogprobParams::from_tensors(t).status().message(),
             Catch::Contains("logprob: dtype i64 but f32 is needed"));
  const auto gpu = laminar::Device::cuda(0);
  t.logits = laminar::TensorView::contiguous(b.logits.data(), DType::kF32, shape, gpu).value();
  t.token = vec_view(ids64.data(), DType::kI64, batch, gpu);
  t.logprob = vec_view(from64.data(), DType::kF32, batch, gpu);
  CHECK_THAT(TokenLogprobParams::from_tensors(t, &copy).status().message(),
             Catch::Contains("token: i64 on a CUDA device"));
}

TEST_CASE("sampling: token_logprob from tensors, every tensor's wrong shape, dtype, stride and device is "
          "refused, naming it",
          "[sampling][tensors]") {
  using laminar::TensorView;
  using laminar::kernels::TokenLogprobTensors;
  Batch b(4, 50);
  std::vector<float> lp(4);
  std::vector<std::int64_t> scratch(16);
  const std::int64_t shape[2] = {4, 50};
  const TokenLogprobTensors good{TensorView::contiguous(b.logits.data(), DType::kF32, shape).value(),
                                 vec_view(b.token.data(), DType::kI32, 4), vec_view(lp.data(), DType::kF32, 4)};
  REQUIRE(TokenLogprobParams::from_tensors(good).ok());
  const auto refused = [&](TensorView TokenLogprobTensors::*member, const TensorView& replacement,
                           const char* text) {
    TokenLogprobTensors t = good;
    t.*member = replacement;
    std::vector<std::int32_t> copy;
    auto p = TokenLogprobParams::from_tensors(t, &copy);
    REQUIRE_FALSE(p.ok());
    laminar::testing::expect_code(p.status(), laminar::StatusCode::kInvalidArgument, text);
  };
  const std::int64_t column[2] = {4, 1}, one[1] = {4}, two[1] = {2};
  for (const auto& [member, name, dtype, wrong] :
       {std::tuple{&TokenLogprobTensors::token, "token", DType::kI32, DType::kF32},
        std::tuple{&TokenLogprobTensors::logprob, "logprob", DType::kF32, DType::kBF16}}) {
    INFO("tensor " << name);
    const std::string at = std::string("token_logprob: ") + name + ": ";
    refused(member, vec_view(scratch.data(), dtype, 5), (at + "shape [5] but logits gives dim 0 = 4").c_str());
    refused(member, TensorView::contiguous(scratch.data(), dtype, column).value(), (at + "shape [4, 1] but").c_str());
    refused(member, vec_view(scratch.data(), wrong, 4),
            (at + "dtype " + std::string(laminar::dtype_name(wrong))).c_str());
    refused(member, TensorView::strided(scratch.data(), dtype, one, two).value(),
            (at + "strides [2] of shape [4] are not dense").c_str());
    refused(member, vec_view(scratch.data(), dtype, 4, laminar::Device::cuda(0)),
            (at + "on cuda:0 but logits is on cpu:0").c_str());
  }
  const std::int64_t taller[2] = {5, 40}, column_major[2] = {1, 4};
  refused(&TokenLogprobTensors::logits, vec_view(b.logits.data(), DType::kF32, 200),
          "token_logprob: logits: shape [200] but [batch, vocab] is needed");
  refused(&TokenLogprobTensors::logits, TensorView::contiguous(b.logits.data(), DType::kI32, shape).value(),
          "token_logprob: logits: dtype i32 but f32, f16 or bf16 is needed");
  refused(&TokenLogprobTensors::logits, TensorView::contiguous(b.logits.data(), DType::kF32, taller).value(),
          "token_logprob: token: shape [4] but logits gives dim 0 = 5");
  refused(&TokenLogprobTensors::logits, TensorView::strided(b.logits.data(), DType::kF32, shape, column_major).value(),
          "token_logprob: logits: stride 4 along the vocabulary, not 1");
  refused(&TokenLogprobTensors::logits,
          TensorView::contiguous(b.logits.data(), DType::kF32, shape, laminar::Device::cuda(0)).value(),
          "token_logprob: token: on cpu:0 but logits is on cuda:0");
}
