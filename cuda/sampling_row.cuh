// sampling_row.cuh: the per-row arithmetic of the sampling kernels, shared by the CPU path
// (src/kernels/sampling.cc), the CUDA kernel (cuda/sampling.cuh) and the CUDA kernel run on the CPU
// in tests. Every result that leaves a kernel is computed here, so the paths agree bit for bit.
//
// Why fixed point: a token's weight is w_i = exp((x_i - max) / T) in (0, 1], stored as
// floor(w_i * 2^40) in a 64-bit integer. Sums of integers are exact, so the row totals, the top-k
// and top-p thresholds and the inverse-CDF walk come out the same whatever order threads, SIMD
// lanes or histogram bins add them in. Vocabularies up to 2^23 keep every sum below 2^63.
#pragma once

#include <cstdint>

#include "laminar/internal/numerics.h"
#include "laminar/internal/philox.h"
#include "laminar/kernels/sampling.h"

namespace laminar::kernels::sampling_detail {

inline constexpr float kWeightScale = 1099511627776.0f;  // 2^40
inline constexpr float kInvWeightScale = 1.0f / 1099511627776.0f;
// Tokens below max - 28 (in units of T) weigh 0: exp(-28) * 2^40 < 1 would truncate to 0 anyway,
// and skipping them saves their exp.
inline constexpr float kCutoff = -28.0f;
// Temperatures below this are greedy (as in vLLM): 1 / T would overflow and the distribution is a
// point mass to within float precision anyway.
inline constexpr float kMinTemperature = 1e-5f;
inline constexpr std::uint32_t kKeyNegInf = 0x007fffffu;  // order_key(-inf)
inline constexpr std::uint32_t kKeyPosInf = 0xff800000u;  // order_key(+inf)

enum class LogitKind : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

template <LogitKind kKind>
LAMINAR_HOST_DEVICE float load_logit(const void* p, std::int64_t i) {
  if constexpr (kKind == LogitKind::kF32) return static_cast<const float*>(p)[i];
  if constexpr (kKind == LogitKind::kF16) return internal::f16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
  if constexpr (kKind == LogitKind::kBF16) return internal::bf16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
}

// Unsigned integers ordered like the floats: larger logit, larger key; -0 just below +0; NaNs
// beyond +-inf (so the row's min and max keys reveal them).
LAMINAR_HOST_DEVICE std::uint32_t order_key(float f) {
  const std::uint32_t u = internal::f32_bits(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

LAMINAR_HOST_DEVICE float key_value(std::uint32_t k) {
  return internal::f32_from_bits((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// False when the row holds a NaN or +inf, or nothing but -inf.
LAMINAR_HOST_DEVICE bool has_distribution(std::uint32_t min_key, std::uint32_t max_key) {
  return min_key >= kKeyNegInf && max_key < kKeyPosInf && max_key > kKeyNegInf;
}

// The row maximum as the subtrahend of x - max; adding +0 turns a -0 maximum into +0 so every
// path subtracts the same zero.
LAMINAR_HOST_DEVICE float row_max(std::uint32_t max_key) { return internal::add_rn(key_value(max_key), 0.0f); }

// floor(exp(s) * 2^40) for s <= 0, and 0 below the cutoff.
LAMINAR_HOST_DEVICE std::uint64_t fixed_weight(float s) {
  if (!(s >= kCutoff)) return 0;
  return static_cast<std::uint64_t>(internal::mul_rn(internal::exp_f32(s), kWeightScale));
}

// log(z / 2^40): the log of a fixed-point sum.
LAMINAR_HOST_DEVICE float log_fixed(std::uint64_t z) {
  return internal::log_f32(internal::mul_rn(static_cast<float>(z), kInvWeightScale));
}

struct RowSettings {
  float inv_t = 1;  // 1 / temperature; 1 for greedy, so the candidate test needs no branch
  std::int32_t top_k = 0;
  float top_p = 1;
  float ln_min_p = 0;  // log(min_p); -inf when min-p is off
  std::uint64_t seed = 0;
  std::uint64_t position = 0;
  bool greedy = false;
  bool valid = true;  // false: a setting is out of range (only a CUDA launch gets this far with one)
};

LAMINAR_HOST_DEVICE RowSettings row_settings(const SamplingParams& p, std::int64_t row) {
  RowSettings r;
  const float t = p.temperature ? p.temperature[row] : 1.0f;
  const float top_p = p.top_p ? p.top_p[row] : 1.0f;
  const float min_p = p.min_p ? p.min_p[row] : 0.0f;
  r.top_k = p.top_k ? p.top_k[row] : 0;
  r.seed = p.seed[row];
  const std::int64_t pos = p.position[row];
  r.valid = t >= 0.0f && t <= 3.40282347e38f && r.top_k >= 0 && top_p >= 0.0f && top_p <= 1.0f &&
            min_p >= 0.0f && min_p <= 1.0f && pos >= 0;
  r.position = static_cast<std::uint64_t>(pos);
  r.greedy = t < kMinTemperature;
  r.inv_t = r.greedy ? 1.0f : internal::div_rn(1.0f, t);
  r.top_p = top_p;
  r.ln_min_p = min_p > 0.0f ? internal::log_f32(min_p) : internal::f32_from_bits(0xff800000u);
  return r;
}

LAMINAR_HOST_DEVICE float scaled(float d, const RowSettings& r) { return internal::mul_rn(d, r.inv_t); }

// A token whose raw or temperature-scaled weight can be non-zero. An upper set of the logits:
// both tests are monotone in x.
LAMINAR_HOST_DEVICE bool is_candidate(float d, const RowSettings& r) {
  return d >= kCutoff || scaled(d, r) >= kCutoff;
}

// The top-p cut: the kept upper set must hold at least this much of the top-k set's weight z_k.
// At least 1, so top_p = 0 keeps exactly the tokens tied at the maximum.
LAMINAR_HOST_DEVICE std::uint64_t top_p_target(float top_p, std::uint64_t z_k) {
  const auto t = static_cast<std::uint64_t>(static_cast<double>(top_p) * static_cast<double>(z_k));
  return t < 1 ? 1 : (t > z_k ? z_k : t);
}

// The random point of the inverse-CDF walk: uniform on [0, z_kept).
LAMINAR_HOST_DEVICE std::uint64_t draw_point(const RowSettings& r, std::uint64_t z_kept) {
  return internal::mul_hi_u64(internal::sampling_draw(r.seed, r.position), z_kept);
}

struct RowResult {
  std::int32_t token = kInvalidToken;
  float raw_logprob = 0;
  float processed_logprob = 0;
  float kept_mass = 0;
};

LAMINAR_HOST_DEVICE RowResult invalid_result() {
  const float nan = internal::f32_from_bits(0x7fc00000u);
  return {kInvalidToken, nan, nan, 0.0f};
}

LAMINAR_HOST_DEVICE float raw_logprob(float x_token, float m, std::uint64_t z_raw) {
  return internal::sub_rn(internal::sub_rn(x_token, m), log_fixed(z_raw));
}

LAMINAR_HOST_DEVICE RowResult greedy_result(std::int32_t token, float x_token, float m, std::uint64_t z_raw) {
  return {token, raw_logprob(x_token, m, z_raw), 0.0f, 1.0f};
}

LAMINAR_HOST_DEVICE RowResult sampled_result(std::int32_t token, float x_token, float m, const RowSettings& r,
                                             std::uint64_t z_raw, std::uint64_t z_all, std::uint64_t z_kept) {
  RowResult out;
  out.token = token;
  out.raw_logprob = raw_logprob(x_token, m, z_raw);
  out.processed_logprob = internal::sub_rn(scaled(internal::sub_rn(x_token, m), r), log_fixed(z_kept));
  out.kept_mass = static_cast<float>(static_cast<double>(z_kept) / static_cast<double>(z_all));
  return out;
}

LAMINAR_HOST_DEVICE void write_result(const SamplingParams& p, std::int64_t row, const RowResult& res) {
  p.token[row] = res.token;
  if (p.raw_logprob) p.raw_logprob[row] = res.raw_logprob;
  if (p.processed_logprob) p.processed_logprob[row] = res.processed_logprob;
  if (p.kept_mass) p.kept_mass[row] = res.kept_mass;
}

}  // namespace laminar::kernels::sampling_detail
