// The asynchronous GRPO rollout engine on a GPU (examples/async_grpo/engine.h, device kCuda): its
// logits, greedy tokens and decode log-probs against the host engine on the same weights, score()
// equal bit for bit to the log-probs its own decode recorded whatever the batch, and caches and
// weights kept where the engine runs. Exits with the skip code when there is no CUDA device.
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "engine.h"
#include "engine_test_fixtures.h"

using async_grpo::Engine;
using async_grpo::EngineDevice;
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
// Host and device sum the same f32 products in other orders, and exp() differs in its last bit:
// logits and log-probs part by about 1e-5 through the policy's two layers. 1e-3 leaves room and
// still catches a real mistake (a wrong weight, position or page moves them by 1e-2 or more).
constexpr double kHostDeviceTolerance = 1e-3;

std::uint64_t fresh_seed(const char* what) { return laminar::testing::fresh_seed("grpo engine cuda", what); }

Engine make_engine(EngineDevice device, const std::vector<std::byte>& weights,
                   const async_grpo::PolicyConfig& config = {}) {
  auto engine = Engine::create(config, {.device = device});
  INFO(engine.status().to_string());
  REQUIRE(engine.ok());
  REQUIRE(engine->load_weights(weights).ok());
  return std::move(*engine);
}

std::shared_ptr<PagedKvCache> make_cache(const Engine& engine, DType dtype = DType::kF32) {
  auto cache = engine.make_cache(64, kPageSize, dtype);
  INFO(cache.status().to_string());
  REQUIRE(cache.ok());
  return *cache;
}

// Prefills `seqs` as one batch, then steps them until each has `response` tokens.
void decode(const Engine& engine, PagedKvCache& cache, std::vector<SequenceState>& seqs, std::size_t response) {
  std::vector<SequenceState*> batch;
  for (SequenceState& s : seqs) batch.push_back(&s);
  const laminar::Status st = engine.prefill(cache, batch);
  INFO(st.to_string());
  REQUIRE(st.ok());
  for (;;) {
    std::erase_if(batch, [&](SequenceState* s) { return s->response_tokens.size() >= response; });
    if (batch.empty()) return;
    const laminar::Status step = engine.step(cache, batch);
    INFO(step.to_string());
    REQUIRE(step.ok());
  }
}

}  // namespace

TEST_CASE("grpo engine cuda: logits, greedy tokens and log-probs agree with the host engine") {
  const std::uint64_t seed = fresh_seed("host");
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  // The policy's shape, and one with four query heads on two KV heads, head_dim 128 and sizes that
  // are no multiple of the device's row padding.
  const async_grpo::PolicyConfig config =
      GENERATE(async_grpo::PolicyConfig{},
               async_grpo::PolicyConfig{.vocab = 11, .num_layers = 3, .d_model = 37, .num_qo_heads = 4,
                                        .num_kv_heads = 2, .head_dim = 128, .d_ff = 45, .max_positions = 40});
  const Engine host = make_engine(EngineDevice::kCpu, random_weights(*async_grpo::weight_manifest(config), seed),
                                  config);
  const Engine device = make_engine(EngineDevice::kCuda, std::vector<std::byte>(host.weight_bytes().begin(),
                                                                                host.weight_bytes().end()),
                                    config);
  auto host_cache = make_cache(host);
  auto device_cache = make_cache(device);
  CHECK(device_cache->device() == laminar::Device::cuda(0));

  const std::vector<std::int32_t> tokens = random_tokens(rng, 1 + rng() % 30, config.vocab);
  auto want = host.logits(*host_cache, SequenceId(9), tokens);
  auto got = device.logits(*device_cache, SequenceId(9), tokens);
  REQUIRE(want.ok());
  INFO(got.status().to_string());
  REQUIRE(got.ok());
  REQUIRE(got->size() == want->size());
  double worst = 0.0;
  for (std::size_t i = 0; i < want->size(); ++i) worst = std::max(worst, std::abs(double((*got)[i] - (*want)[i])));
  std::printf("grpo engine cuda: %zu tokens, worst logit difference from the host %.3g\n", tokens.size(), worst);
  CHECK(worst < kHostDeviceTolerance);

  // Greedy decoding of a batch: the same tokens, log-probs within the tolerance. Where the two
  // disagree on a token, its top two logits must be a near tie on the host; the sequences part there.
  std::vector<SequenceState> on_host, on_device;
  for (std::uint64_t i = 0; i < 4; ++i) {
    on_host.push_back(new_sequence(i + 1, random_tokens(rng, 1 + rng() % 12, config.vocab), rng(), 0.0f));
  }
  on_device = on_host;
  const std::size_t response = std::size_t(std::min<std::int32_t>(24, config.max_positions - 13));
  decode(host, *host_cache, on_host, response);
  decode(device, *device_cache, on_device, response);
  std::size_t compared = 0;
  for (std::size_t b = 0; b < on_host.size(); ++b) {
    const SequenceState& h = on_host[b];
    const SequenceState& d = on_device[b];
    for (std::size_t t = 0; t < h.response_tokens.size(); ++t) {
      CHECK(std::abs(double(d.logprobs[t]) - double(h.logprobs[t])) < kHostDeviceTolerance);
      ++compared;
      if (d.response_tokens[t] != h.response_tokens[t]) {
        std::vector<std::int32_t> prefix = h.prompt_tokens;
        prefix.insert(prefix.end(), h.response_tokens.begin(), h.response_tokens.begin() + std::ptrdiff_t(t));
        auto row = host.logits(*host_cache, SequenceId(99), prefix);
        REQUIRE(row.ok());
        const float* last = row->data() + (prefix.size() - 1) * std::size_t(config.vocab);
        CHECK(std::abs(last[h.response_tokens[t]] - last[d.response_tokens[t]]) < kHostDeviceTolerance);
        break;
      }
    }
  }
  CHECK(compared >= on_host.size());
}

TEST_CASE("grpo engine cuda: score() gives back the decode's log-probs bit for bit, whatever the batch") {
  const std::uint64_t seed = fresh_seed("score");
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  const DType dtype = GENERATE(DType::kF32, DType::kBF16);
  const Engine engine = make_engine(EngineDevice::kCuda, random_weights(*async_grpo::weight_manifest({}), seed));
  auto cache = make_cache(engine, dtype);
  // Greedy, cooled and plain sampling, prompts of different lengths in one batch.
  const float temperatures[] = {0.0f, 0.7f, 1.0f, 1.0f, 1.0f};
  std::vector<SequenceState> batch;
  for (std::uint64_t i = 0; i < 5; ++i) {
    batch.push_back(new_sequence(i + 1, random_tokens(rng, 1 + rng() % 40, 16), rng(), temperatures[i]));
  }
  std::vector<SequenceState> alone = batch;
  decode(engine, *cache, batch, 1 + rng() % 60);
  for (SequenceState& s : batch) REQUIRE(cache->release(s.sequence).ok());

  for (std::size_t b = 0; b < batch.size(); ++b) {
    const SequenceState& s = batch[b];
    auto scored = engine.score(*cache, SequenceId(1000), s.prompt_tokens, s.response_tokens);
    INFO(scored.status().to_string());
    REQUIRE(scored.ok());
    CHECK(bits(*scored) == bits(s.logprobs));
    // Decoded alone, in other pages: the same tokens and bits as in the batch.
    std::vector<SequenceState> one{alone[b]};
    decode(engine, *cache, one, s.response_tokens.size());
    CHECK(one[0].response_tokens == s.response_tokens);
    CHECK(bits(one[0].logprobs) == bits(s.logprobs));
    REQUIRE(cache->release(one[0].sequence).ok());
  }
}

TEST_CASE("grpo engine cuda: caches and weights are where the engine runs") {
  const std::uint64_t seed = fresh_seed("placement");
  INFO("seed " << seed);
  const std::vector<std::byte> weights = random_weights(*async_grpo::weight_manifest({}), seed);
  Engine device = make_engine(EngineDevice::kCuda, weights);
  const Engine host = make_engine(EngineDevice::kCpu, weights);
  auto host_cache = make_cache(host);
  auto device_cache = make_cache(device);
  const std::vector<std::int32_t> tokens{1, 2, 3, 4};

  auto refused = device.logits(*host_cache, SequenceId(1), tokens);
  CHECK(refused.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(refused.status().message(), Catch::Contains("the engine runs on"));
  CHECK(host.logits(*device_cache, SequenceId(1), tokens).status().code() == StatusCode::kInvalidArgument);

  // Weights written in place reach the device when check_weights() passes them, not before.
  auto before = device.logits(*device_cache, SequenceId(1), tokens);
  REQUIRE(before.ok());
  std::vector<laminar::NamedTensor> views = device.weight_tensors();
  float* lm_head = static_cast<float*>(views.back().view.data());
  lm_head[0] += 1.0f;
  auto unchecked = device.logits(*device_cache, SequenceId(1), tokens);
  REQUIRE(unchecked.ok());
  CHECK(bits(*unchecked) == bits(*before));
  REQUIRE(device.check_weights().ok());
  auto after = device.logits(*device_cache, SequenceId(1), tokens);
  REQUIRE(after.ok());
  CHECK(bits(*after) != bits(*before));
  // A NaN is refused and stays off the device.
  lm_head[1] = std::nanf("");
  CHECK(device.check_weights().code() == StatusCode::kInvalidArgument);
  auto kept = device.logits(*device_cache, SequenceId(1), tokens);
  REQUIRE(kept.ok());
  CHECK(bits(*kept) == bits(*after));
}
