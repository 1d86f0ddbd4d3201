// The readable reference: sort the row, then apply the rules of kernels/sampling.h literally in
// double precision.
#include "laminar/ref/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "laminar/internal/numerics.h"
#include "laminar/internal/philox.h"

namespace laminar::ref {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::vector<float> load_row(const void* logits, DType dtype, std::int64_t stride, std::int64_t row,
                            std::int64_t vocab) {
  std::vector<float> x(static_cast<std::size_t>(vocab));
  for (std::int64_t i = 0; i < vocab; ++i) {
    const std::int64_t at = row * stride + i;
    if (dtype == DType::kF32) {
      x[i] = static_cast<const float*>(logits)[at];
    } else {
      const std::uint16_t h = static_cast<const std::uint16_t*>(logits)[at];
      x[i] = dtype == DType::kF16 ? internal::f16_to_f32(h) : internal::bf16_to_f32(h);
    }
  }
  return x;
}

// Orders floats like their values, except that -0 sorts just below +0: "tied" means equal bits.
std::uint32_t order_key(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

bool has_distribution(const std::vector<float>& x) {
  bool any_finite = false;
  for (float v : x) {
    if (std::isnan(v) || v == std::numeric_limits<float>::infinity()) return false;
    any_finite = any_finite || std::isfinite(v);
  }
  return any_finite;
}

// log-softmax(x)[token] in double.
double log_softmax_at(const std::vector<float>& x, std::int64_t token) {
  const double m = *std::max_element(x.begin(), x.end());
  double z = 0;
  for (float v : x) z += std::exp(double(v) - m);
  return double(x[token]) - m - std::log(z);
}

struct Row {
  double temperature = 1;
  std::int32_t top_k = 0;
  double top_p = 1;
  double min_p = 0;
  std::uint64_t seed = 0;
  std::int64_t position = 0;
};

struct Sampled {
  std::int32_t token = kernels::kInvalidToken;
  double raw = kNaN;
  double processed = kNaN;
  double kept = 0;
};

Sampled sample_row(const std::vector<float>& x, const Row& r) {
  Sampled out;
  if (!has_distribution(x)) return out;
  const auto vocab = static_cast<std::int64_t>(x.size());
  // Token ids from the largest logit down; equal logits by ascending id.
  std::vector<std::int64_t> order(static_cast<std::size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    const std::uint32_t ka = order_key(x[a]), kb = order_key(x[b]);
    return ka != kb ? ka > kb : a < b;
  });
  if (r.temperature < double(1e-5f)) {  // greedy, as documented in kernels/sampling.h
    out.token = static_cast<std::int32_t>(order[0]);
    out.raw = log_softmax_at(x, order[0]);
    out.processed = 0;
    out.kept = 1;
    return out;
  }
  const double m = x[order[0]];
  std::vector<double> w(static_cast<std::size_t>(vocab));
  double z_all = 0;
  for (std::int64_t i = 0; i < vocab; ++i) {
    w[i] = std::exp((double(x[i]) - m) / r.temperature);
    z_all += w[i];
  }
  // Threshold on the sorted position: keep order[0..cut).
  std::int64_t cut = vocab;
  auto extend_over_ties = [&](std::int64_t n) {
    while (n < vocab && order_key(x[order[n]]) == order_key(x[order[n - 1]])) ++n;
    return n;
  };
  if (r.top_k > 0 && r.top_k < vocab) cut = extend_over_ties(r.top_k);
  if (r.top_p < 1) {
    double z_k = 0;
    for (std::int64_t j = 0; j < cut; ++j) z_k += w[order[j]];
    double acc = 0;
    std::int64_t n = 0;
    while (n < cut) {
      acc += w[order[n]];
      ++n;
      if (n < cut && order_key(x[order[n]]) == order_key(x[order[n - 1]])) continue;  // whole tie groups
      if (acc >= r.top_p * z_k) break;
    }
    cut = n;
  }
  std::vector<bool> kept(static_cast<std::size_t>(vocab), false);
  for (std::int64_t j = 0; j < cut; ++j) {
    const std::int64_t i = order[j];
    kept[i] = w[i] >= r.min_p;  // p_i / p_max = w_i because the maximum has weight exp(0) = 1
  }
  double z_kept = 0;
  for (std::int64_t i = 0; i < vocab; ++i) z_kept += kept[i] ? w[i] : 0;
  // Inverse CDF in token-id order with the kernels' 64 random bits.
  const double u = double(internal::sampling_draw(r.seed, std::uint64_t(r.position))) * 0x1p-64 * z_kept;
  double acc = 0;
  std::int64_t token = -1;
  for (std::int64_t i = 0; i < vocab; ++i) {
    if (!kept[i]) continue;
    acc += w[i];
    token = i;
    if (acc > u) break;
  }
  out.token = static_cast<std::int32_t>(token);
  out.raw = log_softmax_at(x, token);
  out.processed = (double(x[token]) - m) / r.temperature - std::log(z_kept);
  out.kept = z_kept / z_all;
  return out;
}

}  // namespace

Status sample(const kernels::SamplingParams& p) {
  LAMINAR_RETURN_IF_ERROR(kernels::can_implement(p, Stream::host()));
  LAMINAR_RETURN_IF_ERROR(kernels::check_row_settings(p));
  const std::int64_t stride = p.row_stride == 0 ? p.vocab : p.row_stride;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    Row r;
    if (p.temperature) r.temperature = p.temperature[b];
    if (p.top_k) r.top_k = p.top_k[b];
    if (p.top_p) r.top_p = p.top_p[b];
    if (p.min_p) r.min_p = p.min_p[b];
    r.seed = p.seed[b];
    r.position = p.position[b];
    const Sampled s = sample_row(load_row(p.logits, p.logits_dtype, stride, b, p.vocab), r);
    p.token[b] = s.token;
    if (p.raw_logprob) p.raw_logprob[b] = static_cast<float>(s.raw);
    if (p.processed_logprob) p.processed_logprob[b] = static_cast<float>(s.processed);
    if (p.kept_mass) p.kept_mass[b] = static_cast<float>(s.kept);
  }
  return ok_status();
}

Status token_logprob(const kernels::TokenLogprobParams& p) {
  LAMINAR_RETURN_IF_ERROR(kernels::can_implement(p, Stream::host()));
  for (std::int64_t b = 0; b < p.batch; ++b) {
    if (p.token[b] < 0 || p.token[b] >= p.vocab) {
      return invalid_argument("token_logprob: token[" + std::to_string(b) + "] = " +
                              std::to_string(p.token[b]) + " is outside [0, " +
                              std::to_string(p.vocab) + ")");
    }
  }
  const std::int64_t stride = p.row_stride == 0 ? p.vocab : p.row_stride;
  for (std::int64_t b = 0; b < p.batch; ++b) {
    const std::vector<float> x = load_row(p.logits, p.logits_dtype, stride, b, p.vocab);
    p.logprob[b] = static_cast<float>(has_distribution(x) ? log_softmax_at(x, p.token[b]) : kNaN);
  }
  return ok_status();
}

}  // namespace laminar::ref
