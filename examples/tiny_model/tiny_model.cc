#include "tiny_model.h"

#include <fmt/format.h>

#include <cmath>
#include <span>
#include <string_view>
#include <utility>

namespace tiny_model {
namespace {

using laminar::Result;
using laminar::SequenceId;
using laminar::SequenceState;
using laminar::Status;

// splitmix64's finaliser: every output bit depends on every input bit.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A value in [-1, 1) from 24 bits of a hash of (seed, stream, index): integer arithmetic and an
// exact conversion, so every process and every standard library makes the same weights.
float uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  const std::uint64_t h = mix(mix(seed ^ mix(stream)) + index);
  return float(std::int32_t(h >> 40) - (1 << 23)) * 0x1p-23f;
}

// The scale that keeps unit-variance inputs at unit variance through a sum of fan_in products (a
// uniform value in [-1, 1) has variance 1/3).
float unit_gain(std::int64_t fan_in) { return std::sqrt(3.0f / float(fan_in)); }

// The scale of a weight tensor's uniform values, by its name in the policy's manifest (for the
// matrices, shape [out, in]), and the centre they spread around.
struct Init {
  float centre = 0.0f;
  float scale = 0.0f;
};
Init init_of(std::string_view name, std::span<const std::int64_t> shape) {
  const auto is = [&](std::string_view suffix) { return name.ends_with(suffix); };
  if (name == "embed") return {0.0f, unit_gain(1)};
  // Smaller than the token embeddings: the position shifts what a token means, it does not drown it.
  if (name == "pos_embed") return {0.0f, 0.5f};
  if (is("norm")) return {1.0f, 0.1f};
  // Logits of standard deviation about 2: a spread out but not flat distribution at temperature 0.8.
  if (name == "lm_head") return {0.0f, 2.0f * unit_gain(shape[1])};
  // Half gain where a block adds into the residual stream: each layer nudges it rather than
  // replacing it.
  if (is("wo") || is("w_down")) return {0.0f, 0.5f * unit_gain(shape[1])};
  return {0.0f, unit_gain(shape[1])};
}

}  // namespace

Result<TinyModel> TinyModel::create(const TinyModelConfig& config) {
  const auto in_range = [](const char* name, std::int64_t v, std::int64_t lo, std::int64_t hi) -> Status {
    if (v < lo || v > hi) {
      return laminar::invalid_argument(fmt::format("tiny model: {} = {} is outside [{}, {}]", name, v, lo, hi));
    }
    return laminar::ok_status();
  };
  LAMINAR_RETURN_IF_ERROR(in_range("vocab", config.vocab, 2, 1 << 16));
  LAMINAR_RETURN_IF_ERROR(in_range("num_layers", config.num_layers, 1, 64));
  LAMINAR_RETURN_IF_ERROR(in_range("d_model", config.d_model, 1, 1 << 14));
  LAMINAR_RETURN_IF_ERROR(in_range("num_kv_heads", config.num_kv_heads, 1, 64));
  LAMINAR_RETURN_IF_ERROR(in_range("d_ff", config.d_ff, 1, 1 << 16));
  LAMINAR_RETURN_IF_ERROR(in_range("max_positions", config.max_positions, 2, 1 << 20));
  LAMINAR_RETURN_IF_ERROR(in_range("cpu_threads", config.cpu_threads, 0, 1024));
  const async_grpo::PolicyConfig policy{.vocab = config.vocab,
                                        .num_layers = config.num_layers,
                                        .d_model = config.d_model,
                                        .num_qo_heads = config.num_qo_heads,
                                        .num_kv_heads = config.num_kv_heads,
                                        .head_dim = config.head_dim,
                                        .d_ff = config.d_ff,
                                        .max_positions = config.max_positions};
  Result<async_grpo::Engine> engine = async_grpo::Engine::create(policy, {.cpu_threads = config.cpu_threads});
  if (!engine.ok()) return engine.status().with_context("tiny model");
  // One hash stream per tensor, in manifest order.
  std::uint64_t stream = 1;
  for (const laminar::NamedTensor& t : engine->weight_tensors()) {
    const Init init = init_of(t.name, t.view.shape());
    float* w = t.view.data_as<float>();
    for (std::int64_t i = 0; i < t.view.numel(); ++i) {
      w[i] = init.centre + init.scale * uniform(config.seed, stream, std::uint64_t(i));
    }
    ++stream;
  }
  return TinyModel(config, std::move(*engine));
}

SequenceState start_sequence(SequenceId id, std::vector<std::int32_t> prompt, std::uint64_t seed, float temperature,
                             float top_p) {
  SequenceState s;
  s.sequence = id;
  s.trajectory = laminar::TrajectoryId(id.value());
  s.temperature = temperature;
  s.top_p = top_p;
  s.seed = seed;
  s.rng_position = prompt.size();
  s.prompt_tokens = std::move(prompt);
  return s;
}

}  // namespace tiny_model
