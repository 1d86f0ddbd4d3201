// Shared by the relay tier tests: a weight set whose bytes are a known function of (seed, version,
// tensor), so every byte a reader gets can be checked.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <future>
#include <span>
#include <string>
#include <vector>

#include "laminar/clock.h"
#include "laminar/relay_store.h"
#include "laminar/weight_manifest.h"

namespace laminar::testing {

// Moves `clock` forward by `step` until `f` is ready (a thread blocked on the clock has returned),
// at most `max_steps` times; returns whether it became ready. The thread may start waiting at any
// point of the walk: each step wakes it to re-check its deadline.
template <class T>
bool advance_until_ready(ManualClock& clock, std::future<T>& f, Duration step, int max_steps) {
  for (int i = 0; i < max_steps; ++i) {
    if (f.wait_for(std::chrono::milliseconds(1)) == std::future_status::ready) return true;
    if (!clock.advance(step).ok()) return false;
  }
  return f.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
}

// splitmix64: cheap, and every (seed, version, tensor, byte) gets its own value.
inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline void fill_pattern(std::span<std::byte> out, std::uint64_t seed, std::uint64_t version, std::size_t tensor) {
  const std::uint64_t base = mix(seed ^ mix(version * 1315423911u + tensor));
  std::size_t i = 0;
  for (; i + 8 <= out.size(); i += 8) {
    const std::uint64_t w = mix(base + i);
    std::memcpy(out.data() + i, &w, 8);
  }
  const std::uint64_t w = mix(base + i);
  std::memcpy(out.data() + i, &w, out.size() - i);
}

// Byte index of the first difference from the pattern, or -1 when all match.
inline std::int64_t first_mismatch(std::span<const std::byte> got, std::uint64_t seed, std::uint64_t version,
                                   std::size_t tensor) {
  std::vector<std::byte> want(got.size());
  fill_pattern(want, seed, version, tensor);
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) return std::int64_t(i);
  }
  return -1;
}

// A small model: odd sizes, so tensors straddle chunk boundaries and padding sits inside chunks.
struct WeightSet {
  WeightManifest manifest;
  std::vector<std::vector<std::byte>> storage;  // one per manifest entry
  std::vector<TensorView> views;
  std::vector<NamedTensor> named;

  static WeightSet make(std::uint64_t seed, std::uint64_t version, std::int64_t scale = 1) {
    WeightSet w;
    LAMINAR_CHECK(w.manifest.add("embed", DType::kBF16, {97 * scale, 33}).ok());
    LAMINAR_CHECK(w.manifest.add("layer0.w", DType::kF32, {61, 45 * scale}).ok());
    LAMINAR_CHECK(w.manifest.add("layer0.b", DType::kF32, {45}).ok());
    LAMINAR_CHECK(w.manifest.add("layer1.w", DType::kF16, {128 * scale, 77}).ok());
    LAMINAR_CHECK(w.manifest.add("steps", DType::kI64, {3}).ok());
    w.fill(seed, version);
    return w;
  }

  void fill(std::uint64_t seed, std::uint64_t version) {
    storage.clear();
    views.clear();
    named.clear();
    for (std::size_t i = 0; i < manifest.size(); ++i) {
      const auto& e = manifest.entries()[i];
      storage.emplace_back(e.nbytes);
      fill_pattern(storage.back(), seed, version, i);
      views.push_back(TensorView::contiguous(storage.back().data(), e.dtype, e.shape).value());
    }
    for (std::size_t i = 0; i < manifest.size(); ++i) named.push_back({manifest.entries()[i].name, views[i]});
  }
};

}  // namespace laminar::testing
