// Sampling kernels: Philox known answers, the reference's agreement, sampling distributions,
// batch invariance, degenerate input, and bit-exactness between the CPU kernel and the CUDA kernel
// run on the CPU.
#include "laminar/kernels/sampling.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "laminar/internal/numerics.h"
#include "laminar/internal/philox.h"
#include "laminar/ref/sampling.h"

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

TEST_CASE("Philox4x32-10 matches the Random123 known-answer vectors", "[sampling][philox]") {
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

TEST_CASE("mul_hi_u64 is the exact high half of the 128-bit product", "[sampling][philox]") {
  std::mt19937_64 rng(11);
  for (int i = 0; i < 100000; ++i) {
    const std::uint64_t a = i < 4 ? ~std::uint64_t(0) * (i & 1) : rng();
    const std::uint64_t b = i < 4 ? ~std::uint64_t(0) * (i >> 1) : rng();
    __extension__ using u128 = unsigned __int128;
    CHECK(laminar::internal::mul_hi_u64(a, b) == std::uint64_t((u128(a) * b) >> 64));
  }
}

TEST_CASE("greedy picks the largest logit, ties to the lowest id", "[sampling]") {
  Batch b(2, 10);
  for (int i = 0; i < 10; ++i) b.row(0)[i] = float(i % 4);  // maxima at 3 and 7
  for (int i = 0; i < 10; ++i) b.row(1)[i] = -float(i);
  b.temperature = {0.0f, 0.0f};
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
