// engine_test_fixtures.h: what the async GRPO engine tests (host and CUDA) share: a seed printed
// with the test's name, a float vector's bits, a seeded random weight buffer, random prompts and
// fresh sequences.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "laminar/kv_migrator.h"
#include "laminar/weight_manifest.h"

namespace laminar::testing {

// A fresh seed, printed so that a failing run can be repeated.
inline std::uint64_t fresh_seed(const char* test, const char* what) {
  const std::uint64_t seed = std::random_device{}();
  std::printf("%s %s: seed %llu\n", test, what, static_cast<unsigned long long>(seed));
  return seed;
}

inline std::vector<std::uint32_t> bits(const std::vector<float>& v) {
  std::vector<std::uint32_t> out;
  for (float f : v) out.push_back(std::bit_cast<std::uint32_t>(f));
  return out;
}

// A flat f32 weight buffer laid out by `m`: uniform values scaled so that activations stay near
// unit size through every layer (norm gains near 1), and logits of standard deviation about 2.
inline std::vector<std::byte> random_weights(const WeightManifest& m, std::uint64_t seed) {
  std::vector<std::byte> bytes(m.total_bytes());
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (const auto& e : m.entries()) {
    const std::int64_t in = e.shape.size() == 2 ? e.shape[1] : 1;
    float centre = 0.0f, scale = std::sqrt(3.0f / float(in));
    if (e.name == "pos_embed") scale = 0.5f;
    if (e.name.ends_with("norm")) centre = 1.0f, scale = 0.1f;
    if (e.name == "lm_head") scale *= 2.0f;
    for (std::uint64_t i = 0; i < e.nbytes / sizeof(float); ++i) {
      const float v = centre + scale * u(rng);
      std::memcpy(bytes.data() + e.offset + i * sizeof(float), &v, sizeof v);
    }
  }
  return bytes;
}

inline std::vector<std::int32_t> random_tokens(std::mt19937_64& rng, std::size_t n, std::int32_t vocab = 16) {
  std::vector<std::int32_t> t;
  for (std::size_t i = 0; i < n; ++i) t.push_back(std::int32_t(rng() % std::uint64_t(vocab)));
  return t;
}

// A sequence about to be prefilled: its prompt, sampling seed and temperature, no response yet.
inline SequenceState new_sequence(std::uint64_t id, std::vector<std::int32_t> prompt, std::uint64_t seed,
                                  float temperature = 1.0f) {
  SequenceState s;
  s.sequence = SequenceId(id);
  s.trajectory = TrajectoryId(id);
  s.temperature = temperature;
  s.seed = seed;
  s.rng_position = prompt.size();
  s.prompt_tokens = std::move(prompt);
  return s;
}

}  // namespace laminar::testing
