// sim_random.h: the simulator's random draws, bit-identical for a seed on one platform.
//
// std's distributions are not specified bit for bit, so the simulator draws its own uniforms from
// std::mt19937_64 (whose output is specified) and builds everything else from them. Uniforms are
// the same everywhere; normals go through libm's log and cos, whose last bit may differ between
// C libraries.
//
//   std::mt19937_64 rng(seed);
//   double u = internal::uniform01(rng);        // [0, 1)
//   double z = internal::standard_normal(rng);  // N(0, 1)
#pragma once

#include <cmath>
#include <random>

namespace laminar::sim::internal {

// The top 53 bits as a double in [0, 1): exact.
inline double uniform01(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

// Box-Muller, keeping one of the pair so each normal costs exactly two draws.
inline double standard_normal(std::mt19937_64& rng) {
  constexpr double kTwoPi = 6.283185307179586;
  double u1 = 1.0 - uniform01(rng);  // (0, 1]: the log stays finite
  double u2 = uniform01(rng);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2);
}

}  // namespace laminar::sim::internal
