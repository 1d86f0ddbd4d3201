// philox.h: counter-based Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as
// 1, 2, 3", SC'11), the random source of the sampling kernels.
//
// A counter-based generator has no state to carry: the draw for a (key, counter) pair is a pure
// function, so a sequence keyed by (request seed, token position) samples the same token in any
// batch row, on any worker, on the CPU or on a GPU, and after a KV migration. Every function is
// LAMINAR_HOST_DEVICE plain integer arithmetic, so host and device produce the same bits.
//
//   auto r = laminar::internal::philox4x32_10({pos_lo, pos_hi, 0, 0}, {seed_lo, seed_hi});
//   std::uint64_t u = laminar::internal::sampling_draw(seed, position);  // 64 uniform bits
#pragma once

#include <cstdint>

#include "laminar/internal/numerics.h"

namespace laminar::internal {

struct Philox4x32Counter {
  std::uint32_t v[4];
};
struct Philox4x32Key {
  std::uint32_t v[2];
};

// Multipliers and Weyl key increments of the published Philox4x32 (Random123's defaults).
inline constexpr std::uint32_t kPhiloxM0 = 0xD2511F53u;
inline constexpr std::uint32_t kPhiloxM1 = 0xCD9E8D57u;
inline constexpr std::uint32_t kPhiloxW0 = 0x9E3779B9u;
inline constexpr std::uint32_t kPhiloxW1 = 0xBB67AE85u;

LAMINAR_HOST_DEVICE Philox4x32Counter philox4x32_round(Philox4x32Counter c, Philox4x32Key k) {
  const std::uint64_t p0 = std::uint64_t(kPhiloxM0) * c.v[0];
  const std::uint64_t p1 = std::uint64_t(kPhiloxM1) * c.v[2];
  const auto hi0 = std::uint32_t(p0 >> 32), lo0 = std::uint32_t(p0);
  const auto hi1 = std::uint32_t(p1 >> 32), lo1 = std::uint32_t(p1);
  return {{hi1 ^ c.v[1] ^ k.v[0], lo1, hi0 ^ c.v[3] ^ k.v[1], lo0}};
}

// Ten rounds; the key is bumped between rounds (nine bumps), as in Random123's philox4x32_R.
LAMINAR_HOST_DEVICE Philox4x32Counter philox4x32_10(Philox4x32Counter c, Philox4x32Key k) {
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k.v[0] += kPhiloxW0;
      k.v[1] += kPhiloxW1;
    }
    c = philox4x32_round(c, k);
  }
  return c;
}

// The 64 uniform bits behind one sampled token: key = request seed, counter = (token position,
// 0, 0). Word 2 of the counter stays 0 for the sampling draw; other consumers of the same
// (seed, position) pair take other values of it so their streams never overlap.
LAMINAR_HOST_DEVICE std::uint64_t sampling_draw(std::uint64_t seed, std::uint64_t position) {
  const Philox4x32Counter r = philox4x32_10(
      {{std::uint32_t(position), std::uint32_t(position >> 32), 0u, 0u}},
      {{std::uint32_t(seed), std::uint32_t(seed >> 32)}});
  return std::uint64_t(r.v[0]) | (std::uint64_t(r.v[1]) << 32);
}

// floor(a * b / 2^64), exactly: maps 64 uniform bits onto [0, b) without a division.
LAMINAR_HOST_DEVICE std::uint64_t mul_hi_u64(std::uint64_t a, std::uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#else
  const std::uint64_t a_lo = a & 0xffffffffu, a_hi = a >> 32;
  const std::uint64_t b_lo = b & 0xffffffffu, b_hi = b >> 32;
  const std::uint64_t lo_lo = a_lo * b_lo;
  const std::uint64_t hi_lo = a_hi * b_lo;
  const std::uint64_t lo_hi = a_lo * b_hi;
  const std::uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xffffffffu) + lo_hi;
  return a_hi * b_hi + (hi_lo >> 32) + (cross >> 32);
#endif
}

}  // namespace laminar::internal
