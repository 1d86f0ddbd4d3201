// The asynchronous GRPO rollout engine (examples/async_grpo/engine.h): bit-identical decoding
// whatever the batch, the pages or the prompt's pass, re-scoring equal to the behaviour log-probs,
// logits against a double-precision forward written from policy_config.h's architecture comment,
// input checks that change nothing, and weights that arrive through a RelayStore and WeightPuller.
#include "engine.h"
#include "engine_test_fixtures.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "laminar/relay_store.h"
#include "laminar/weight_puller.h"

using async_grpo::Engine;
using async_grpo::PolicyConfig;
using laminar::DType;
using laminar::PagedKvCache;
using laminar::SequenceId;
using laminar::SequenceState;
using laminar::StatusCode;
using laminar::testing::bits;
using laminar::testing::new_sequence;
using laminar::testing::random_tokens;
using laminar::testing::random_weights;

namespace {

constexpr std::int32_t kPageSize = 16;

std::uint64_t fresh_seed(const char* what) { return laminar::testing::fresh_seed("grpo engine", what); }

Engine make_engine(std::uint64_t seed, std::int32_t cpu_threads = 1, const PolicyConfig& config = {}) {
  auto engine = Engine::create(config, {.cpu_threads = cpu_threads});
  REQUIRE(engine.ok());
  REQUIRE(engine->load_weights(random_weights(engine->manifest(), seed)).ok());
  return std::move(*engine);
}

PagedKvCache make_cache(const Engine& engine, std::int32_t num_pages = 64, DType dtype = DType::kF32) {
  auto cache = PagedKvCache::create(engine.kv_layout(num_pages, kPageSize, dtype));
  REQUIRE(cache.ok());
  return std::move(*cache);
}

// Steps `batch` until every sequence in it has `response` response tokens; one that has them
// leaves the batch.
void decode_to(const Engine& engine, PagedKvCache& cache, std::vector<SequenceState*> batch, std::size_t response) {
  for (;;) {
    std::erase_if(batch, [&](SequenceState* s) { return s->response_tokens.size() >= response; });
    if (batch.empty()) return;
    const laminar::Status st = engine.step(cache, batch);
    INFO(st.to_string());
    REQUIRE(st.ok());
  }
}

// The policy of policy_config.h in double precision, from its architecture comment: logits
// [tokens.size(), vocab] of every position.
std::vector<double> reference_logits(const PolicyConfig& c, const laminar::WeightManifest& m,
                                     std::span<const std::byte> bytes, const std::vector<std::int32_t>& tokens) {
  auto w = [&](const std::string& name) {
    return reinterpret_cast<const float*>(bytes.data() + (*m.find(name))->offset);
  };
  const std::size_t n = tokens.size(), d = std::size_t(c.d_model), hd = std::size_t(c.head_dim);
  const std::size_t qd = std::size_t(c.num_qo_heads) * hd, kd = std::size_t(c.num_kv_heads) * hd;
  const std::size_t group = std::size_t(c.num_qo_heads / c.num_kv_heads);
  using Rows = std::vector<std::vector<double>>;
  auto linear = [](const Rows& x, const float* wt, std::size_t out) {  // x W^T, W [out, in]
    Rows y(x.size(), std::vector<double>(out, 0.0));
    for (std::size_t t = 0; t < x.size(); ++t) {
      for (std::size_t o = 0; o < out; ++o) {
        for (std::size_t i = 0; i < x[t].size(); ++i) y[t][o] += double(wt[o * x[t].size() + i]) * x[t][i];
      }
    }
    return y;
  };
  auto rms_norm = [&](const Rows& x, const float* g) {
    Rows y = x;
    for (std::size_t t = 0; t < x.size(); ++t) {
      double ms = 0.0;
      for (double v : x[t]) ms += v * v;
      const double inv = 1.0 / std::sqrt(ms / double(d) + double(c.rms_eps));
      for (std::size_t i = 0; i < d; ++i) y[t][i] = x[t][i] * inv * double(g[i]);
    }
    return y;
  };
  Rows x(n, std::vector<double>(d));
  for (std::size_t t = 0; t < n; ++t) {
    for (std::size_t i = 0; i < d; ++i) {
      x[t][i] = double(w("embed")[std::size_t(tokens[t]) * d + i]) + double(w("pos_embed")[t * d + i]);
    }
  }
  for (std::int32_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    Rows h = rms_norm(x, w(p + "attn_norm"));
    const Rows q = linear(h, w(p + "wq"), qd), k = linear(h, w(p + "wk"), kd), v = linear(h, w(p + "wv"), kd);
    Rows attn(n, std::vector<double>(qd, 0.0));
    for (std::size_t t = 0; t < n; ++t) {
      for (std::size_t head = 0; head < std::size_t(c.num_qo_heads); ++head) {
        const std::size_t kv = head / group;
        std::vector<double> score(t + 1);
        double top = -INFINITY;
        for (std::size_t u = 0; u <= t; ++u) {
          double dot = 0.0;
          for (std::size_t i = 0; i < hd; ++i) dot += q[t][head * hd + i] * k[u][kv * hd + i];
          score[u] = dot / std::sqrt(double(hd));
          top = std::max(top, score[u]);
        }
        double sum = 0.0;
        for (double& s : score) sum += (s = std::exp(s - top));
        for (std::size_t u = 0; u <= t; ++u) {
          for (std::size_t i = 0; i < hd; ++i) attn[t][head * hd + i] += score[u] / sum * v[u][kv * hd + i];
        }
      }
    }
    const Rows o = linear(attn, w(p + "wo"), d);
    for (std::size_t t = 0; t < n; ++t) {
      for (std::size_t i = 0; i < d; ++i) x[t][i] += o[t][i];
    }
    h = rms_norm(x, w(p + "mlp_norm"));
    Rows gate = linear(h, w(p + "w_gate"), std::size_t(c.d_ff));
    const Rows up = linear(h, w(p + "w_up"), std::size_t(c.d_ff));
    for (std::size_t t = 0; t < n; ++t) {
      for (std::size_t i = 0; i < gate[t].size(); ++i) {
        gate[t][i] = gate[t][i] / (1.0 + std::exp(-gate[t][i])) * up[t][i];
      }
    }
    const Rows down = linear(gate, w(p + "w_down"), d);
    for (std::size_t t = 0; t < n; ++t) {
      for (std::size_t i = 0; i < d; ++i) x[t][i] += down[t][i];
    }
  }
  const Rows logits = linear(rms_norm(x, w("final_norm")), w("lm_head"), std::size_t(c.vocab));
  std::vector<double> out;
  for (const auto& row : logits) out.insert(out.end(), row.begin(), row.end());
  return out;
}

}  // namespace

TEST_CASE("grpo engine: a sequence decodes to the same bits alone, in a changing batch and in other pages") {
  const std::uint64_t seed = fresh_seed("batch invariance");
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const std::vector<std::int32_t> prompt = random_tokens(rng, 1 + rng() % 30);
  constexpr std::size_t kResponse = 70;

  const Engine alone_engine = make_engine(seed);
  PagedKvCache alone_cache = make_cache(alone_engine);
  SequenceState alone = new_sequence(1, prompt, 1234);
  REQUIRE(alone_engine.prefill(alone_cache, alone).ok());
  decode_to(alone_engine, alone_cache, {&alone}, kResponse);
  REQUIRE(alone.response_tokens.size() == kResponse);

  // Another engine with the same weights, kernels on two threads; a cache whose first pages a
  // filler holds, so the sequence lands elsewhere; prefilled in one pass with mates, then decoded
  // among mates that leave at other times, in a shuffled order every step.
  const Engine engine = make_engine(seed, 2);
  PagedKvCache cache = make_cache(engine);
  SequenceState filler = new_sequence(50, random_tokens(rng, 37), rng());
  REQUIRE(engine.prefill(cache, filler).ok());
  std::vector<SequenceState> mates;
  for (std::uint64_t m = 0; m < 5; ++m) {
    mates.push_back(new_sequence(10 + m, random_tokens(rng, 1 + rng() % 40), rng()));
  }
  SequenceState s = new_sequence(1, prompt, 1234);
  std::vector<SequenceState*> first = {&mates[0], &s, &mates[1], &mates[2], &mates[3], &mates[4]};
  std::shuffle(first.begin(), first.end(), rng);
  REQUIRE(engine.prefill(cache, first).ok());
  CHECK((*cache.pages(s.sequence))[0] != (*alone_cache.pages(alone.sequence))[0]);
  while (s.response_tokens.size() < kResponse) {
    std::vector<SequenceState*> batch = {&s};
    for (std::size_t m = 0; m < mates.size(); ++m) {
      if (mates[m].response_tokens.size() < 5 + 12 * m) batch.push_back(&mates[m]);
    }
    std::shuffle(batch.begin(), batch.end(), rng);
    REQUIRE(engine.step(cache, batch).ok());
  }
  CHECK(s.response_tokens == alone.response_tokens);
  CHECK(bits(s.logprobs) == bits(alone.logprobs));
  CHECK(s.kv_length == alone.kv_length);
  CHECK(s.rng_position == alone.rng_position);
  // Sampled at temperature 1 from random weights: not collapsed onto one token.
  std::vector<std::int32_t> distinct = s.response_tokens;
  std::sort(distinct.begin(), distinct.end());
  CHECK(std::unique(distinct.begin(), distinct.end()) - distinct.begin() > 3);
}

TEST_CASE("grpo engine: a prompt prefilled in one pass decodes as one fed token by token") {
  const DType dtype = GENERATE(DType::kF32, DType::kBF16);
  const std::uint64_t seed = fresh_seed("prefill");
  INFO("dtype " << laminar::dtype_name(dtype) << ", seed " << seed);
  std::mt19937_64 rng(seed);
  const Engine engine = make_engine(seed);
  const std::vector<std::int32_t> prompt = random_tokens(rng, 2 + rng() % 60);
  constexpr std::size_t kResponse = 20;

  PagedKvCache one_pass_cache = make_cache(engine, 64, dtype);
  SequenceState one_pass = new_sequence(1, prompt, 77, 0.8f);
  REQUIRE(engine.prefill(one_pass_cache, one_pass).ok());
  CHECK(one_pass.kv_length == prompt.size());
  CHECK(one_pass.response_tokens.size() == 1);
  decode_to(engine, one_pass_cache, {&one_pass}, kResponse);

  PagedKvCache stepped_cache = make_cache(engine, 64, dtype);
  SequenceState stepped = new_sequence(1, prompt, 77, 0.8f);
  REQUIRE(stepped_cache.add_sequence(stepped.sequence).ok());
  decode_to(engine, stepped_cache, {&stepped}, kResponse);

  CHECK(stepped.response_tokens == one_pass.response_tokens);
  CHECK(bits(stepped.logprobs) == bits(one_pass.logprobs));
  // And the K/V the two wrote: the same bytes, page by page.
  const auto a = *one_pass_cache.pages(one_pass.sequence), b = *stepped_cache.pages(stepped.sequence);
  REQUIRE(a.size() == b.size());
  for (std::int32_t l = 0; l < engine.config().num_layers; ++l) {
    for (std::size_t i = 0; i < a.size(); ++i) {
      CHECK(std::memcmp(*one_pass_cache.k_page(l, a[i]), *stepped_cache.k_page(l, b[i]),
                        std::size_t(one_pass_cache.layout().page_bytes())) == 0);
    }
  }
}

TEST_CASE("grpo engine: score() gives back the behaviour log-probs bit for bit") {
  const std::uint64_t seed = fresh_seed("score");
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const Engine engine = make_engine(seed);
  PagedKvCache cache = make_cache(engine);
  // Greedy, cooled and plain sampling: the raw log-prob does not depend on the temperature.
  const float temperatures[] = {0.0f, 0.7f, 1.0f, 1.0f};
  std::vector<SequenceState> seqs;
  for (std::uint64_t i = 0; i < 4; ++i) {
    seqs.push_back(new_sequence(i + 1, random_tokens(rng, 1 + rng() % 40), rng(), temperatures[i]));
  }
  std::vector<SequenceState*> batch;
  for (SequenceState& s : seqs) batch.push_back(&s);
  REQUIRE(engine.prefill(cache, batch).ok());
  decode_to(engine, cache, batch, 2 + rng() % 59);  // two tokens at least: the check below changes the first

  for (const SequenceState& s : seqs) {
    // Scored while the decode cache still holds every sequence, under a scratch id.
    auto scored = engine.score(cache, SequenceId(1000), s.prompt_tokens, s.response_tokens);
    REQUIRE(scored.ok());
    CHECK(bits(*scored) == bits(s.logprobs));
    CHECK_FALSE(cache.length(SequenceId(1000)).ok());
  }
  // A response token changed: its own log-prob and those after it change, not the ones before.
  const SequenceState& s = seqs[3];
  REQUIRE(s.response_tokens.size() >= 2);
  std::vector<std::int32_t> other = s.response_tokens;
  other[0] = (other[0] + 1) % engine.config().vocab;
  auto scored = engine.score(cache, SequenceId(1000), s.prompt_tokens, other);
  REQUIRE(scored.ok());
  CHECK(std::bit_cast<std::uint32_t>((*scored)[0]) != std::bit_cast<std::uint32_t>(s.logprobs[0]));
}

TEST_CASE("grpo engine: logits agree with a double-precision forward of the architecture") {
  const std::uint64_t seed = fresh_seed("reference");
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  // The policy's shape, and one with four query heads on two KV heads, head_dim 128 and an odd
  // d_model (the matmuls' partial lanes).
  const PolicyConfig config = GENERATE(PolicyConfig{},
                                       PolicyConfig{.vocab = 11, .num_layers = 3, .d_model = 37, .num_qo_heads = 4,
                                                    .num_kv_heads = 2, .head_dim = 128, .d_ff = 45,
                                                    .max_positions = 40});
  const Engine engine = make_engine(seed, 1, config);
  PagedKvCache cache = make_cache(engine);
  const std::vector<std::int32_t> tokens = random_tokens(rng, 1 + rng() % std::uint64_t(config.max_positions),
                                                         config.vocab);
  auto got = engine.logits(cache, SequenceId(3), tokens);
  REQUIRE(got.ok());
  const std::vector<double> want = reference_logits(config, engine.manifest(), engine.weight_bytes(), tokens);
  REQUIRE(got->size() == want.size());
  double worst = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    // f32 sums of a few hundred unit-size products err by about 1e-6 relative; 1e-4 leaves room
    // and still catches a wrong term, which moves logits by 1e-2 or more.
    worst = std::max(worst, std::abs(double((*got)[i]) - want[i]) / std::max(1.0, std::abs(want[i])));
  }
  std::printf("grpo engine reference: %zu tokens, worst relative logit error %.3g\n", tokens.size(), worst);
  CHECK(worst < 1e-4);
}

TEST_CASE("grpo engine: invalid input is refused, named, and changes nothing") {
  CHECK(Engine::create(PolicyConfig{.head_dim = 96}).status().code() == StatusCode::kInvalidArgument);
  CHECK(Engine::create(PolicyConfig{.num_qo_heads = 3}).status().code() == StatusCode::kInvalidArgument);
  CHECK(Engine::create({}, {.cpu_threads = -1}).status().code() == StatusCode::kInvalidArgument);

  Engine engine = make_engine(5);
  const PolicyConfig& c = engine.config();
  // Four pages: the sequence below fills three after its decode.
  PagedKvCache cache = make_cache(engine, 4);
  SequenceState s = new_sequence(7, std::vector<std::int32_t>(kPageSize, 3), 9);
  REQUIRE(engine.prefill(cache, s).ok());
  decode_to(engine, cache, {&s}, kPageSize + 1);
  REQUIRE(s.kv_length == 2 * kPageSize);
  const SequenceState before = s;
  const std::vector<std::byte> weights_before(engine.weight_bytes().begin(), engine.weight_bytes().end());

  // The status names what was wrong; the cache, the state and the weights are as they were.
  auto unchanged = [&](const laminar::Status& st, StatusCode code, const std::string& named) {
    INFO(st.to_string());
    CHECK(st.code() == code);
    CHECK(st.message().find(named) != std::string::npos);
    CHECK(cache.num_sequences() == 1);
    CHECK(*cache.length(s.sequence) == std::int64_t(before.kv_length));
    CHECK(cache.free_pages() == 2);
    CHECK(s == before);
    CHECK(std::equal(weights_before.begin(), weights_before.end(), engine.weight_bytes().begin()));
  };
  auto step = [&](std::vector<SequenceState*> batch) { return engine.step(cache, batch); };
  SequenceState t = s;
  SECTION("prefill: a prompt token outside the vocabulary") {
    SequenceState u = new_sequence(8, {1, 2, c.vocab}, 1);
    unchanged(engine.prefill(cache, u), StatusCode::kInvalidArgument, "sequence 8 prompt token 2");
  }
  SECTION("prefill: a negative token, in a batch with a good sequence") {
    SequenceState u = new_sequence(8, {1, 2}, 1), v = new_sequence(9, {-1}, 1);
    std::vector<SequenceState*> batch = {&u, &v};
    unchanged(engine.prefill(cache, batch), StatusCode::kInvalidArgument, "sequence 9");
    CHECK(u.response_tokens.empty());
  }
  SECTION("prefill: a prompt with no room left for the sampled token") {
    SequenceState u = new_sequence(8, std::vector<std::int32_t>(std::size_t(c.max_positions), 1), 1);
    unchanged(engine.prefill(cache, u), StatusCode::kInvalidArgument, "max_positions");
  }
  SECTION("prefill: a sequence already in the cache") {
    SequenceState u = new_sequence(7, {1}, 1);
    unchanged(engine.prefill(cache, u), StatusCode::kAlreadyExists, "sequence 7");
  }
  SECTION("prefill: prompts that need more pages than are free") {
    SequenceState u = new_sequence(8, std::vector<std::int32_t>(3 * kPageSize, 1), 1);
    unchanged(engine.prefill(cache, u), StatusCode::kResourceExhausted, "pages");
  }
  SECTION("prefill: sampling settings the sampler refuses") {
    SequenceState u = new_sequence(8, {1}, 1);
    u.temperature = -1.0f;
    unchanged(engine.prefill(cache, u), StatusCode::kInvalidArgument, "sequence 8");
  }
  SECTION("step: a token outside the vocabulary") {
    t.response_tokens.back() = c.vocab;
    unchanged(step({&t}), StatusCode::kInvalidArgument, "sequence 7 token 32");
  }
  SECTION("step: a state that disagrees with the cache") {
    t.kv_length -= 1;
    unchanged(step({&t}), StatusCode::kInvalidArgument, "kv_length");
  }
  SECTION("step: a sequence not in the cache") {
    t.sequence = SequenceId(99);
    unchanged(step({&t}), StatusCode::kNotFound, "99");
  }
  SECTION("step: a sequence twice, and a null one") {
    unchanged(step({&s, &s}), StatusCode::kInvalidArgument, "twice");
    unchanged(step({&s, nullptr}), StatusCode::kInvalidArgument, "batch[1]");
  }
  SECTION("step: a log-prob missing") {
    t.logprobs.pop_back();
    unchanged(step({&t}), StatusCode::kInvalidArgument, "log-probs");
  }
  SECTION("step: a sequence at max_positions") {
    t.response_tokens.resize(std::size_t(c.max_positions) - t.prompt_tokens.size(), 1);
    t.logprobs.resize(t.response_tokens.size(), -1.0f);
    t.kv_length = std::uint64_t(c.max_positions) - 1;
    PagedKvCache full = make_cache(engine, 16);
    REQUIRE(full.add_sequence(t.sequence).ok());
    REQUIRE(full.append_tokens(t.sequence, std::int64_t(t.kv_length)).ok());
    const SequenceState t_before = t;
    const laminar::Status st = engine.step(full, std::vector<SequenceState*>{&t});
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message().find("max_positions") != std::string::npos);
    CHECK(*full.length(t.sequence) == std::int64_t(t_before.kv_length));
    CHECK(t == t_before);
  }
  SECTION("step: a batch that needs more free pages than there are") {
    SequenceState u = new_sequence(8, {1}, 2), v = new_sequence(9, {1}, 3);
    REQUIRE(cache.add_sequence(u.sequence).ok());
    REQUIRE(cache.add_sequence(v.sequence).ok());
    const laminar::Status st = step({&s, &u, &v});
    CHECK(st.code() == StatusCode::kResourceExhausted);
    CHECK(*cache.length(u.sequence) == 0);
    CHECK(cache.free_pages() == 2);
    CHECK(s == before);
  }
  SECTION("a cache of another model") {
    auto created = PagedKvCache::create({.num_pages = 8, .page_size = kPageSize, .num_kv_heads = 1,
                                         .head_dim = 128, .dtype = DType::kF32, .num_layers = 2});
    REQUIRE(created.ok());
    PagedKvCache& other = *created;
    REQUIRE(other.add_sequence(t.sequence).ok());
    REQUIRE(other.append_tokens(t.sequence, std::int64_t(t.kv_length)).ok());
    const laminar::Status st = engine.step(other, std::vector<SequenceState*>{&t});
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message().find("head_dim 128") != std::string::npos);
    CHECK(*other.length(t.sequence) == std::int64_t(t.kv_length));
    CHECK(engine.logits(other, SequenceId(1), std::vector<std::int32_t>{1}).status().code() ==
          StatusCode::kInvalidArgument);
  }
  SECTION("logits and score: bad tokens, lengths and scratch ids") {
    const std::vector<std::int32_t> bad = {1, c.vocab};
    unchanged(engine.logits(cache, SequenceId(8), bad).status(), StatusCode::kInvalidArgument, "token 1");
    unchanged(engine.logits(cache, SequenceId(8), {}).status(), StatusCode::kInvalidArgument, "0 tokens");
    unchanged(engine.logits(cache, SequenceId(7), std::vector<std::int32_t>{1}).status(), StatusCode::kAlreadyExists,
              "sequence 7");
    unchanged(engine.logits(cache, SequenceId(8), std::vector<std::int32_t>(3 * kPageSize, 1)).status(),
              StatusCode::kResourceExhausted, "pages");
    unchanged(engine.score(cache, SequenceId(8), s.prompt_tokens, {}).status(), StatusCode::kInvalidArgument,
              "response");
    unchanged(engine.score(cache, SequenceId(8), s.prompt_tokens, bad).status(), StatusCode::kInvalidArgument,
              "response token 1");
    const std::vector<std::int32_t> too_long(std::size_t(c.max_positions), 1);
    unchanged(engine.score(cache, SequenceId(8), s.prompt_tokens, too_long).status(), StatusCode::kInvalidArgument,
              "max_positions");
  }
  SECTION("load_weights: a wrong size, another layout, a NaN") {
    std::vector<std::byte> bytes = random_weights(engine.manifest(), 6);
    unchanged(engine.load_weights(std::span(bytes).first(bytes.size() - 4)), StatusCode::kInvalidArgument, "bytes");
    laminar::WeightManifest other = *async_grpo::weight_manifest({.d_ff = 128});
    unchanged(engine.load_weights(other, bytes), StatusCode::kInvalidArgument, "layers.0.w_gate");
    const float nan = NAN;
    const auto* entry = *engine.manifest().find("layers.1.wv");
    std::memcpy(bytes.data() + entry->offset + 5 * sizeof(float), &nan, sizeof nan);
    unchanged(engine.load_weights(bytes), StatusCode::kInvalidArgument, "layers.1.wv[5]");
  }
  SECTION("weights written in place with a NaN: check_weights names it, a step refuses to sample") {
    for (const laminar::NamedTensor& w : engine.weight_tensors()) {
      if (w.name == "lm_head") w.view.data_as<float>()[3] = NAN;
    }
    const laminar::Status checked = engine.check_weights();
    CHECK(checked.code() == StatusCode::kInvalidArgument);
    CHECK(checked.message().find("lm_head[3]") != std::string::npos);
    const laminar::Status st = step({&t});
    CHECK(st.code() == StatusCode::kFailedPrecondition);
    CHECK(st.message().find("sequence 7") != std::string::npos);
    CHECK(t.response_tokens == before.response_tokens);
    SequenceState u = new_sequence(8, {1, 2}, 1);
    CHECK(engine.prefill(cache, u).code() == StatusCode::kFailedPrecondition);
    CHECK_FALSE(cache.length(u.sequence).ok());
  }
}

TEST_CASE("grpo engine: device kCuda is refused, named, where it cannot run") {
  CHECK(Engine::create({}, {.device = async_grpo::EngineDevice::kCuda, .cuda_device = -1}).status().code() ==
        StatusCode::kInvalidArgument);
  auto engine = Engine::create({}, {.device = async_grpo::EngineDevice::kCuda});
#if LAMINAR_GRPO_ENGINE_CUDA
  if (engine.ok()) {
    // A machine with a GPU: the engine's caches are on it (async_grpo_engine_cuda_test runs it).
    auto cache = engine->make_cache(4, kPageSize);
    REQUIRE(cache.ok());
    CHECK((*cache)->device() == laminar::Device::cuda(0));
    return;
  }
  std::printf("grpo engine kCuda: %s\n", engine.status().to_string().c_str());
  CHECK(engine.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(engine.status().message(), Catch::Contains("CUDA"));
  auto beyond = Engine::create({}, {.device = async_grpo::EngineDevice::kCuda, .cuda_device = 1 << 20});
  CHECK(beyond.status().code() == StatusCode::kFailedPrecondition);
#else
  CHECK(engine.status().code() == StatusCode::kUnimplemented);
  CHECK_THAT(engine.status().message(), Catch::Contains("no CUDA"));
#endif
}

TEST_CASE("grpo engine: weights pulled through a RelayStore and WeightPuller give the logits of loaded bytes") {
  const std::uint64_t seed = fresh_seed("relay");
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  // The trainer's side: a flat buffer published as version 1.
  Engine trainer = make_engine(seed);
  const std::vector<std::byte> bytes(trainer.weight_bytes().begin(), trainer.weight_bytes().end());
  laminar::RelayStoreOptions options;
  options.chunk_bytes = 64 << 10;  // several chunks for the puller to copy
  auto store = laminar::RelayStore::create(options);
  REQUIRE(store.ok());
  std::shared_ptr<laminar::RelayStore> relay = std::move(*store);
  const std::vector<laminar::NamedTensor> published = trainer.weight_tensors();
  REQUIRE(relay->publish(laminar::Version(1), trainer.manifest(), published).ok());
  REQUIRE(relay->wait_for_version(laminar::Version(1), std::chrono::seconds(10)).ok());

  auto pulled = Engine::create({});
  REQUIRE(pulled.ok());
  auto puller = laminar::WeightPuller::create(relay);
  REQUIRE(puller.ok());
  const laminar::Status st = (*puller)->pull(laminar::Version(1), pulled->weight_tensors(), false);
  INFO(st.to_string());
  REQUIRE(st.ok());
  REQUIRE(pulled->check_weights().ok());

  auto loaded = Engine::create({});
  REQUIRE(loaded.ok());
  REQUIRE(loaded->load_weights(bytes).ok());
  CHECK(std::equal(bytes.begin(), bytes.end(), pulled->weight_bytes().begin(), pulled->weight_bytes().end()));

  PagedKvCache cache = make_cache(*loaded);
  const std::vector<std::int32_t> tokens = random_tokens(rng, 1 + rng() % 100);
  auto a = loaded->logits(cache, SequenceId(1), tokens);
  auto b = pulled->logits(cache, SequenceId(1), tokens);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(bits(*a) == bits(*b));
  // And not the logits of a zero model: the pull carried the weights.
  auto zero = Engine::create({});
  auto z = zero->logits(cache, SequenceId(1), tokens);
  REQUIRE(z.ok());
  CHECK(bits(*z) != bits(*a));
}
