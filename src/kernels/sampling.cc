// CPU path of the sampling kernels: threads over rows, Highway SIMD over the vocabulary for the
// passes that touch every logit (conversion, min/max key, candidate selection), and the shared row
// arithmetic of cuda/sampling_row.cuh for every value that leaves the kernel.
//
// Per row: (1) min and max order key, which also reveal NaN / +inf / all -inf; (2) the candidates,
// tokens within 28 (raw or temperature-scaled) of the maximum, in token-id order; (3) their
// fixed-point weights and the row sums; (4) the top-k and top-p thresholds by radix selection over
// the candidates' keys (four rounds of 8 bits, no sort); (5) the inverse-CDF walk over the kept
// candidates in token-id order.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/sampling.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include "../../cuda/sampling_row.cuh"

HWY_BEFORE_NAMESPACE();
namespace laminar::kernels::sampling_detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// dst[i] = f32(src[i]) for f16 (is_bf16 false) or bf16 input; exact conversions either way.
void widen_row(const std::uint16_t* HWY_RESTRICT src, float* HWY_RESTRICT dst, std::int64_t n, bool is_bf16) {
  const hn::ScalableTag<float> df;
  const hn::ScalableTag<std::uint32_t> du32;
  const hn::Rebind<std::uint16_t, decltype(df)> du16;
  const hn::Rebind<hwy::float16_t, decltype(df)> df16;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(df));
  std::int64_t i = 0;
  if (is_bf16) {
    for (; i + lanes <= n; i += lanes) {
      const auto wide = hn::PromoteTo(du32, hn::LoadU(du16, src + i));
      hn::StoreU(hn::BitCast(df, hn::ShiftLeft<16>(wide)), df, dst + i);
    }
    for (; i < n; ++i) dst[i] = internal::bf16_to_f32(src[i]);
  } else {
    const auto* half = reinterpret_cast<const hwy::float16_t*>(src);
    for (; i + lanes <= n; i += lanes) hn::StoreU(hn::PromoteTo(df, hn::LoadU(df16, half + i)), df, dst + i);
    for (; i < n; ++i) dst[i] = internal::f16_to_f32(src[i]);
  }
}

// Smallest and largest order_key() of x[0, n).
void key_range(const float* HWY_RESTRICT x, std::int64_t n, std::uint32_t* min_key, std::uint32_t* max_key) {
  const hn::ScalableTag<float> df;
  const hn::ScalableTag<std::int32_t> di;
  const hn::ScalableTag<std::uint32_t> du;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(df));
  auto lo = hn::Set(du, 0xffffffffu);
  auto hi = hn::Zero(du);
  const auto sign = hn::Set(di, std::int32_t(0x80000000u));
  std::int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto bits = hn::BitCast(di, hn::LoadU(df, x + i));
    // Negative floats: all bits flipped; positive: the sign bit set (see order_key()).
    const auto key = hn::BitCast(du, hn::Xor(bits, hn::Or(hn::ShiftRight<31>(bits), sign)));
    lo = hn::Min(lo, key);
    hi = hn::Max(hi, key);
  }
  std::uint32_t mn = hn::GetLane(hn::MinOfLanes(du, lo));
  std::uint32_t mx = hn::GetLane(hn::MaxOfLanes(du, hi));
  for (; i < n; ++i) {
    const std::uint32_t k = order_key(x[i]);
    mn = k < mn ? k : mn;
    mx = k > mx ? k : mx;
  }
  *min_key = mn;
  *max_key = mx;
}

// Writes the ids of is_candidate() tokens to out in increasing order and returns their count. out
// has room for n + Lanes() ids (a compressing store writes whole vectors).
std::int64_t find_candidates(const float* HWY_RESTRICT x, std::int64_t n, float m, float inv_t,
                             std::int32_t* HWY_RESTRICT out) {
  const hn::ScalableTag<float> df;
  const hn::ScalableTag<std::int32_t> di;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(df));
  const auto vm = hn::Set(df, m);
  const auto vinv = hn::Set(df, inv_t);
  const auto cutoff = hn::Set(df, kCutoff);
  auto ids = hn::Iota(di, 0);
  const auto step = hn::Set(di, static_cast<std::int32_t>(lanes));
  std::int64_t count = 0;
  std::int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const auto d = hn::Sub(hn::LoadU(df, x + i), vm);
    const auto keep = hn::Or(hn::Ge(d, cutoff), hn::Ge(hn::Mul(d, vinv), cutoff));
    if (!hn::AllFalse(df, keep)) {
      count += static_cast<std::int64_t>(hn::CompressStore(ids, hn::RebindMask(di, keep), di, out + count));
    }
    ids = hn::Add(ids, step);
  }
  RowSettings r;
  r.inv_t = inv_t;
  for (; i < n; ++i) {
    if (is_candidate(internal::sub_rn(x[i], m), r)) out[count++] = static_cast<std::int32_t>(i);
  }
  return count;
}

#if HWY_NATIVE_FMA
// exp_f32 of internal/numerics.h lane by lane: the same constants and the same sequence of fused
// multiply-adds and correctly rounded operations, so every lane has the scalar function's bits.
// Only where the target has a real FMA (an emulated MulAdd rounds twice).
template <class D, class V>
V exp_lanes(D df, V x) {
  namespace c = internal::exp_consts;
  const hn::RebindToSigned<D> di;
  const V xc = hn::Min(hn::Max(x, hn::Set(df, c::kLo)), hn::Set(df, c::kHi));
  const V t = hn::MulAdd(xc, hn::Set(df, c::kLog2e), hn::Set(df, c::kRoundMagic));
  const V kf = hn::Sub(t, hn::Set(df, c::kRoundMagic));
  const auto n = hn::ConvertTo(di, kf);
  V r = hn::MulAdd(kf, hn::Set(df, -c::kLn2Hi), xc);
  r = hn::MulAdd(kf, hn::Set(df, -c::kLn2Lo), r);
  V p = hn::MulAdd(hn::Set(df, c::kP5), r, hn::Set(df, c::kP4));
  p = hn::MulAdd(p, r, hn::Set(df, c::kP3));
  p = hn::MulAdd(p, r, hn::Set(df, c::kP2));
  p = hn::MulAdd(p, r, hn::Set(df, c::kP1));
  p = hn::MulAdd(p, r, hn::Set(df, c::kP0));
  const V r2 = hn::Mul(r, r);
  const V y = hn::Add(hn::MulAdd(p, r2, r), hn::Set(df, 1.0f));
  const auto n1 = hn::ShiftRight<1>(n);
  const auto n2 = hn::Sub(n, n1);
  const auto bias = hn::Set(di, 127);
  const V s1 = hn::BitCast(df, hn::ShiftLeft<23>(hn::Add(n1, bias)));
  const V s2 = hn::BitCast(df, hn::ShiftLeft<23>(hn::Add(n2, bias)));
  return hn::Mul(hn::Mul(y, s1), s2);
}
#endif

// out[j] = fixed_weight((x[ids[j]] - m) * inv_t) as a float (an integer below 2^41, converted by
// the caller), for the n candidate ids.
void candidate_weights(const float* HWY_RESTRICT x, const std::int32_t* HWY_RESTRICT ids, std::int64_t n, float m,
                       float inv_t, float* HWY_RESTRICT out) {
  std::int64_t j = 0;
#if HWY_NATIVE_FMA
  const hn::ScalableTag<float> df;
  const hn::RebindToSigned<decltype(df)> di;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(df));
  const auto vm = hn::Set(df, m);
  const auto vinv = hn::Set(df, inv_t);
  const auto cutoff = hn::Set(df, kCutoff);
  const auto scale = hn::Set(df, kWeightScale);
  for (; j + lanes <= n; j += lanes) {
    const auto s = hn::Mul(hn::Sub(hn::GatherIndex(df, x, hn::LoadU(di, ids + j)), vm), vinv);
    const auto w = hn::Mul(exp_lanes(df, s), scale);
    hn::StoreU(hn::IfThenElseZero(hn::Ge(s, cutoff), w), df, out + j);
  }
#endif
  RowSettings r;
  r.inv_t = inv_t;
  for (; j < n; ++j) {
    const float s = scaled(internal::sub_rn(x[ids[j]], m), r);
    out[j] = s >= kCutoff ? internal::mul_rn(internal::exp_f32(s), kWeightScale) : 0.0f;
  }
}

}  // namespace laminar::kernels::sampling_detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include "tensor_args.h"

namespace laminar::kernels {

#if defined(LAMINAR_HAVE_CUDA)
namespace cuda_detail {
Status launch_sampling(const SamplingParams& p, void* stream);
Status launch_token_logprob(const TokenLogprobParams& p, void* stream);
}  // namespace cuda_detail
#endif

namespace sampling_detail {

HWY_EXPORT(widen_row);
HWY_EXPORT(key_range);
HWY_EXPORT(find_candidates);
HWY_EXPORT(candidate_weights);

namespace {

bool is_float(DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; }

// Structural checks shared by both kernels.
Status check_shape(const char* kernel, const void* logits, DType dtype, std::int64_t batch, std::int64_t vocab,
                   std::int64_t row_stride, int cpu_threads) {
  if (batch < 0) return invalid_argument(fmt::format("{}: batch is negative ({})", kernel, batch));
  if (vocab < 1 || vocab > kMaxSamplingVocab) {
    return invalid_argument(fmt::format("{}: vocab = {} is outside 1..{}", kernel, vocab, kMaxSamplingVocab));
  }
  if (row_stride != 0 && row_stride < vocab) {
    return invalid_argument(fmt::format("{}: row_stride = {} is below vocab = {}", kernel, row_stride, vocab));
  }
  if (!is_float(dtype)) {
    return invalid_argument(
        fmt::format("{}: logits_dtype {} is not supported (f32, f16, bf16 only)", kernel, dtype_name(dtype)));
  }
  if (cpu_threads < 0) return invalid_argument(fmt::format("{}: cpu_threads is negative ({})", kernel, cpu_threads));
  if (batch > 0 && logits == nullptr) return invalid_argument(fmt::format("{}: logits is null with batch = {}", kernel, batch));
  return ok_status();
}

// Per-thread buffers, reused across the rows a thread handles.
struct Scratch {
  std::vector<float> widened;           // [vocab] the row in f32 when the logits are f16 / bf16
  std::vector<std::int32_t> ids;        // [vocab + lanes] candidate token ids, increasing
  std::vector<std::uint32_t> keys;      // [candidates]
  std::vector<std::uint64_t> weights;   // [candidates] temperature-scaled fixed-point weights
  std::vector<float> scaled_w, raw_w;   // [candidates] the same before conversion, and raw (T = 1)
  std::vector<std::uint32_t> sel_keys;  // radix-selection working copies
  std::vector<std::uint64_t> sel_weights;
};

const float* row_f32(const void* logits, DType dtype, std::int64_t stride, std::int64_t row, std::int64_t vocab,
                     Scratch& s) {
  if (dtype == DType::kF32) return static_cast<const float*>(logits) + row * stride;
  s.widened.resize(static_cast<std::size_t>(vocab));
  const auto* src = static_cast<const std::uint16_t*>(logits) + row * stride;
  HWY_DYNAMIC_DISPATCH(widen_row)(src, s.widened.data(), vocab, dtype == DType::kBF16);
  return s.widened.data();
}

// The largest key t such that the candidates with key >= t hold at least `need`: of count when
// weights is null, else of weight. Radix selection, 8 bits a round from the top; the caller
// guarantees that all candidates together reach `need`.
std::uint32_t select_threshold(const std::uint32_t* keys, const std::uint64_t* weights, std::int64_t n,
                               std::uint32_t floor_key, std::uint64_t need, Scratch& s) {
  std::uint32_t prefix = 0;
  std::uint64_t above = 0;  // count or weight of the candidates above the current bucket
  // Round one reads the candidates in place; later rounds only the survivors of the chosen bucket.
  const std::uint32_t* cur_keys = keys;
  const std::uint64_t* cur_weights = weights;
  std::int64_t cur_n = n;
  for (int shift = 24; shift >= 0; shift -= 8) {
    std::uint64_t hist[256] = {};
    for (std::int64_t j = 0; j < cur_n; ++j) {
      if (cur_keys[j] < floor_key) continue;
      hist[(cur_keys[j] >> shift) & 0xffu] += cur_weights ? cur_weights[j] : 1;
    }
    int bucket = 255;
    for (; bucket > 0; --bucket) {
      if (above + hist[bucket] >= need) break;
      above += hist[bucket];
    }
    prefix |= std::uint32_t(bucket) << shift;
    if (shift == 0) break;
    s.sel_keys.resize(static_cast<std::size_t>(cur_n));
    s.sel_weights.resize(static_cast<std::size_t>(cur_n));
    std::int64_t kept = 0;
    for (std::int64_t j = 0; j < cur_n; ++j) {
      if (cur_keys[j] < floor_key || int((cur_keys[j] >> shift) & 0xffu) != bucket) continue;
      s.sel_keys[kept] = cur_keys[j];
      s.sel_weights[kept] = cur_weights ? cur_weights[j] : 1;
      ++kept;
    }
    cur_keys = s.sel_keys.data();
    cur_weights = s.sel_weights.data();
    cur_n = kept;
  }
  return prefix;
}

RowResult sample_row(const float* x, std::int64_t vocab, const RowSettings& r, Scratch& s) {
  std::uint32_t min_key = 0, max_key = 0;
  HWY_DYNAMIC_DISPATCH(key_range)(x, vocab, &min_key, &max_key);
  if (!has_distribution(min_key, max_key)) return invalid_result();
  const float m = row_max(max_key);
  s.ids.resize(static_cast<std::size_t>(vocab) + hwy::kMaxVectorSize / sizeof(float));
  std::int64_t n = HWY_DYNAMIC_DISPATCH(find_candidates)(x, vocab, m, r.inv_t, s.ids.data());
  s.keys.resize(static_cast<std::size_t>(n));
  s.weights.resize(static_cast<std::size_t>(n));
  s.scaled_w.resize(static_cast<std::size_t>(n));
  s.raw_w.resize(static_cast<std::size_t>(n));
  // Greedy needs only the raw weights; T = 1 makes the scaled ones the raw ones.
  if (!r.greedy) HWY_DYNAMIC_DISPATCH(candidate_weights)(x, s.ids.data(), n, m, r.inv_t, s.scaled_w.data());
  const bool separate_raw = r.greedy || r.inv_t != 1.0f;
  if (separate_raw) HWY_DYNAMIC_DISPATCH(candidate_weights)(x, s.ids.data(), n, m, 1.0f, s.raw_w.data());
  const std::vector<float>& raw_w = separate_raw ? s.raw_w : s.scaled_w;
  std::uint64_t z_raw = 0, z_all = 0;
  std::int64_t argmax = -1;
  for (std::int64_t j = 0; j < n; ++j) {
    const float xi = x[s.ids[j]];
    const std::uint64_t q = r.greedy ? 0 : static_cast<std::uint64_t>(s.scaled_w[j]);
    z_raw += static_cast<std::uint64_t>(raw_w[j]);
    z_all += q;
    s.keys[j] = order_key(xi);
    s.weights[j] = q;
    if (argmax < 0 && s.keys[j] == max_key) argmax = j;
  }
  if (r.greedy) return greedy_result(s.ids[argmax], x[s.ids[argmax]], m, z_raw);
  // Top-k, then top-p over the top-k set, as one threshold on the keys.
  std::uint32_t threshold = 0;
  std::uint64_t z_k = z_all;
  if (r.top_k > 0 && r.top_k < n) {
    threshold = select_threshold(s.keys.data(), nullptr, n, 0, std::uint64_t(r.top_k), s);
    // Only the top-k set matters from here on: keep it, still in token-id order.
    std::int64_t kept = 0;
    z_k = 0;
    for (std::int64_t j = 0; j < n; ++j) {
      if (s.keys[j] < threshold) continue;
      s.ids[kept] = s.ids[j];
      s.keys[kept] = s.keys[j];
      s.weights[kept] = s.weights[j];
      z_k += s.weights[j];
      ++kept;
    }
    n = kept;
  }
  if (r.top_p < 1.0f) {
    threshold = select_threshold(s.keys.data(), s.weights.data(), n, threshold, top_p_target(r.top_p, z_k), s);
  }
  // Min-p joins as a third upper set; weights outside the kept set become 0 for the walk.
  std::uint64_t z_kept = 0;
  for (std::int64_t j = 0; j < n; ++j) {
    const bool kept = s.keys[j] >= threshold && scaled(internal::sub_rn(x[s.ids[j]], m), r) >= r.ln_min_p;
    if (!kept) s.weights[j] = 0;
    z_kept += s.weights[j];
  }
  const std::uint64_t point = draw_point(r, z_kept);
  std::uint64_t acc = 0;
  std::int64_t pick = 0;
  for (; pick < n; ++pick) {
    acc += s.weights[pick];
    if (acc > point) break;
  }
  const std::int32_t token = s.ids[pick];
  return sampled_result(token, x[token], m, r, z_raw, z_all, z_kept);
}

float token_logprob_row(const float* x, std::int64_t vocab, std::int32_t token, Scratch& s) {
  std::uint32_t min_key = 0, max_key = 0;
  HWY_DYNAMIC_DISPATCH(key_range)(x, vocab, &min_key, &max_key);
  if (!has_distribution(min_key, max_key)) return internal::f32_from_bits(0x7fc00000u);
  const float m = row_max(max_key);
  s.ids.resize(static_cast<std::size_t>(vocab) + hwy::kMaxVectorSize / sizeof(float));
  const std::int64_t n = HWY_DYNAMIC_DISPATCH(find_candidates)(x, vocab, m, 1.0f, s.ids.data());
  s.raw_w.resize(static_cast<std::size_t>(n));
  HWY_DYNAMIC_DISPATCH(candidate_weights)(x, s.ids.data(), n, m, 1.0f, s.raw_w.data());
  std::uint64_t z_raw = 0;
  for (std::int64_t j = 0; j < n; ++j) z_raw += static_cast<std::uint64_t>(s.raw_w[j]);
  return raw_logprob(x[token], m, z_raw);
}

// Runs row_fn(row, scratch) for every row on up to cpu_threads threads (rows handed out one at a
// time, so uneven rows balance); each row's result depends only on the row.
template <class RowFn>
void for_each_row(std::int64_t batch, std::int64_t vocab, int cpu_threads, RowFn&& row_fn) {
  if (batch == 0) return;
  std::int64_t threads = cpu_threads > 0 ? cpu_threads : std::max(1u, std::thread::hardware_concurrency());
  // Below ~64k logits per thread a thread costs more to start than it saves.
  threads = std::min({threads, batch, std::max<std::int64_t>(1, batch * vocab / 65536)});
  std::atomic<std::int64_t> next{0};
  auto work = [&] {
    Scratch scratch;
    for (std::int64_t row = next++; row < batch; row = next++) row_fn(row, scratch);
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(threads - 1));
  for (std::int64_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

}  // namespace
}  // namespace sampling_detail

namespace sampling_detail {
namespace {

namespace ta = tensor_args;

// The logits' batch, vocab and row stride: a 2-D view of a float dtype whose last dim is dense.
Status logits_shape(const char* kernel, const TensorView& logits, std::int64_t* batch, std::int64_t* vocab,
                    std::int64_t* row_stride) {
  LAMINAR_RETURN_IF_ERROR(ta::expect_ndim(kernel, "logits", logits, 2, "[batch, vocab]"));
  if (!is_float(logits.dtype())) {
    return ta::mismatch(kernel, "logits",
                        fmt::format("dtype {} but f32, f16 or bf16 is needed", dtype_name(logits.dtype())));
  }
  *batch = logits.dim(0);
  *vocab = logits.dim(1);
  if (*vocab > 1 && logits.stride(1) != 1) {
    return ta::mismatch(kernel, "logits", fmt::format("stride {} along the vocabulary, not 1", logits.stride(1)));
  }
  // One row has no row stride to speak of (frameworks give size-1 dims any stride).
  *row_stride = *batch > 1 ? logits.stride(0) : 0;
  if (*batch > 1 && *row_stride < *vocab) {
    return ta::mismatch(kernel, "logits",
                        fmt::format("row stride {} below the vocabulary of {}", *row_stride, *vocab));
  }
  return ok_status();
}

template <class T>
Result<T*> row_vector(const char* kernel, const char* name, const TensorView& v, std::int64_t batch, DType dtype) {
  LAMINAR_RETURN_IF_ERROR(ta::expect_vector(kernel, name, v, batch, "logits", dtype));
  return v.data_as<T>();
}

template <class T>
Result<T*> optional_row_vector(const char* kernel, const char* name, const std::optional<TensorView>& v,
                               std::int64_t batch, DType dtype) {
  if (!v) return static_cast<T*>(nullptr);
  return row_vector<T>(kernel, name, *v, batch, dtype);
}

Stream stream_for(const ta::Placement& where) { return where.on_device() ? Stream::cuda(nullptr) : Stream::host(); }

}  // namespace
}  // namespace sampling_detail

Result<SamplingParams> SamplingParams::from_tensors(const SamplingTensors& t) {
  using sampling_detail::optional_row_vector;
  using sampling_detail::row_vector;
  constexpr const char* k = "sample";
  tensor_args::Placement where(k);
  LAMINAR_RETURN_IF_ERROR(where.add("logits", t.logits));
  LAMINAR_RETURN_IF_ERROR(where.add("temperature", t.temperature));
  LAMINAR_RETURN_IF_ERROR(where.add("top_k", t.top_k));
  LAMINAR_RETURN_IF_ERROR(where.add("top_p", t.top_p));
  LAMINAR_RETURN_IF_ERROR(where.add("min_p", t.min_p));
  LAMINAR_RETURN_IF_ERROR(where.add("seed", t.seed));
  LAMINAR_RETURN_IF_ERROR(where.add("position", t.position));
  LAMINAR_RETURN_IF_ERROR(where.add("token", t.token));
  LAMINAR_RETURN_IF_ERROR(where.add("raw_logprob", t.raw_logprob));
  LAMINAR_RETURN_IF_ERROR(where.add("processed_logprob", t.processed_logprob));
  LAMINAR_RETURN_IF_ERROR(where.add("kept_mass", t.kept_mass));
  SamplingParams p;
  LAMINAR_RETURN_IF_ERROR(sampling_detail::logits_shape(k, t.logits, &p.batch, &p.vocab, &p.row_stride));
  p.logits = t.logits.data();
  p.logits_dtype = t.logits.dtype();
  const std::int64_t b = p.batch;
  LAMINAR_ASSIGN_OR_RETURN(p.temperature,
                           optional_row_vector<const float>(k, "temperature", t.temperature, b, DType::kF32));
  LAMINAR_ASSIGN_OR_RETURN(p.top_k, optional_row_vector<const std::int32_t>(k, "top_k", t.top_k, b, DType::kI32));
  LAMINAR_ASSIGN_OR_RETURN(p.top_p, optional_row_vector<const float>(k, "top_p", t.top_p, b, DType::kF32));
  LAMINAR_ASSIGN_OR_RETURN(p.min_p, optional_row_vector<const float>(k, "min_p", t.min_p, b, DType::kF32));
  // An int64_t read through uint64_t is the same bits (signed and unsigned variants may alias).
  LAMINAR_ASSIGN_OR_RETURN(p.seed, row_vector<const std::uint64_t>(k, "seed", t.seed, b, DType::kI64));
  LAMINAR_ASSIGN_OR_RETURN(p.position, row_vector<const std::int64_t>(k, "position", t.position, b, DType::kI64));
  LAMINAR_ASSIGN_OR_RETURN(p.token, row_vector<std::int32_t>(k, "token", t.token, b, DType::kI32));
  LAMINAR_ASSIGN_OR_RETURN(p.raw_logprob, optional_row_vector<float>(k, "raw_logprob", t.raw_logprob, b, DType::kF32));
  LAMINAR_ASSIGN_OR_RETURN(p.processed_logprob,
                           optional_row_vector<float>(k, "processed_logprob", t.processed_logprob, b, DType::kF32));
  LAMINAR_ASSIGN_OR_RETURN(p.kept_mass, optional_row_vector<float>(k, "kept_mass", t.kept_mass, b, DType::kF32));
  LAMINAR_RETURN_IF_ERROR(can_implement(p, sampling_detail::stream_for(where)));
  return p;
}

std::size_t workspace_bytes(const SamplingParams&) { return 0; }

Status can_implement(const SamplingParams& p, Stream stream) {
  LAMINAR_RETURN_IF_ERROR(sampling_detail::check_shape("sample", p.logits, p.logits_dtype, p.batch, p.vocab,
                                                       p.row_stride, p.cpu_threads));
  if (stream.on_device && p.batch > 0x7fffffff) {
    return invalid_argument(fmt::format("sample: batch {} is above 2^31 - 1 rows on a CUDA stream", p.batch));
  }
  if (p.batch > 0) {
    if (p.seed == nullptr) return invalid_argument(fmt::format("sample: seed is null with batch = {}", p.batch));
    if (p.position == nullptr) return invalid_argument(fmt::format("sample: position is null with batch = {}", p.batch));
    if (p.token == nullptr) return invalid_argument(fmt::format("sample: token is null with batch = {}", p.batch));
  }
  return ok_status();
}

Status check_row_settings(const SamplingParams& p) {
  for (std::int64_t b = 0; b < p.batch; ++b) {
    if (p.temperature && !(p.temperature[b] >= 0.0f && std::isfinite(p.temperature[b]))) {
      return invalid_argument(fmt::format("sample: temperature[{}] = {} is not a finite value >= 0", b, p.temperature[b]));
    }
    if (p.top_k && p.top_k[b] < 0) {
      return invalid_argument(fmt::format("sample: top_k[{}] = {} is negative (0 disables top-k)", b, p.top_k[b]));
    }
    if (p.top_p && !(p.top_p[b] >= 0.0f && p.top_p[b] <= 1.0f)) {
      return invalid_argument(fmt::format("sample: top_p[{}] = {} is outside [0, 1]", b, p.top_p[b]));
    }
    if (p.min_p && !(p.min_p[b] >= 0.0f && p.min_p[b] <= 1.0f)) {
      return invalid_argument(fmt::format("sample: min_p[{}] = {} is outside [0, 1]", b, p.min_p[b]));
    }
    if (p.position[b] < 0) {
      return invalid_argument(fmt::format("sample: position[{}] = {} is negative", b, p.position[b]));
    }
  }
  return ok_status();
}

Status run(const SamplingParams& p, Stream stream) {
  LAMINAR_RETURN_IF_ERROR(can_implement(p, stream));
  if (stream.on_device) {
#if defined(LAMINAR_HAVE_CUDA)
    return cuda_detail::launch_sampling(p, stream.handle);
#else
    return unimplemented("sample on a CUDA stream: laminar was built without CUDA (LAMINAR_CUDA=OFF)");
#endif
  }
  LAMINAR_RETURN_IF_ERROR(check_row_settings(p));
  const std::int64_t stride = p.row_stride == 0 ? p.vocab : p.row_stride;
  sampling_detail::for_each_row(p.batch, p.vocab, p.cpu_threads, [&](std::int64_t row, sampling_detail::Scratch& s) {
    const float* x = sampling_detail::row_f32(p.logits, p.logits_dtype, stride, row, p.vocab, s);
    const sampling_detail::RowSettings r = sampling_detail::row_settings(p, row);
    sampling_detail::write_result(p, row, sampling_detail::sample_row(x, p.vocab, r, s));
  });
  return ok_status();
}

Result<TokenLogprobParams> TokenLogprobParams::from_tensors(const TokenLogprobTensors& t,
                                                           std::vector<std::int32_t>* token_copy) {
  using sampling_detail::row_vector;
  constexpr const char* k = "token_logprob";
  tensor_args::Placement where(k);
  LAMINAR_RETURN_IF_ERROR(where.add("logits", t.logits));
  LAMINAR_RETURN_IF_ERROR(where.add("token", t.token));
  LAMINAR_RETURN_IF_ERROR(where.add("logprob", t.logprob));
  TokenLogprobParams p;
  LAMINAR_RETURN_IF_ERROR(sampling_detail::logits_shape(k, t.logits, &p.batch, &p.vocab, &p.row_stride));
  p.logits = t.logits.data();
  p.logits_dtype = t.logits.dtype();
  LAMINAR_RETURN_IF_ERROR(tensor_args::expect_ndim(k, "token", t.token, 1, "[batch]"));
  LAMINAR_RETURN_IF_ERROR(tensor_args::expect_dim(k, "token", t.token, 0, p.batch, "logits"));
  LAMINAR_RETURN_IF_ERROR(tensor_args::expect_dense(k, "token", t.token));
  LAMINAR_ASSIGN_OR_RETURN(p.token, tensor_args::int32_indices(k, "token", t.token, where.on_device(), token_copy));
  LAMINAR_ASSIGN_OR_RETURN(p.logprob, row_vector<float>(k, "logprob", t.logprob, p.batch, DType::kF32));
  LAMINAR_RETURN_IF_ERROR(can_implement(p, sampling_detail::stream_for(where)));
  return p;
}

std::size_t workspace_bytes(const TokenLogprobParams&) { return 0; }

Status can_implement(const TokenLogprobParams& p, Stream stream) {
  LAMINAR_RETURN_IF_ERROR(sampling_detail::check_shape("token_logprob", p.logits, p.logits_dtype, p.batch, p.vocab,
                                                       p.row_stride, p.cpu_threads));
  if (stream.on_device && p.batch > 0x7fffffff) {
    return invalid_argument(fmt::format("token_logprob: batch {} is above 2^31 - 1 rows on a CUDA stream", p.batch));
  }
  if (p.batch > 0 && p.token == nullptr) {
    return invalid_argument(fmt::format("token_logprob: token is null with batch = {}", p.batch));
  }
  if (p.batch > 0 && p.logprob == nullptr) {
    return invalid_argument(fmt::format("token_logprob: logprob is null with batch = {}", p.batch));
  }
  return ok_status();
}

Status run(const TokenLogprobParams& p, Stream stream) {
  LAMINAR_RETURN_IF_ERROR(can_implement(p, stream));
  if (stream.on_device) {
#if defined(LAMINAR_HAVE_CUDA)
    return cuda_detail::launch_token_logprob(p, stream.handle);
#else
    return unimplemented("token_logprob on a CUDA stream: laminar was built without CUDA (LAMINAR_CUDA=OFF)");
#endif
  }
  for (std::int64_t b = 0; b < p.batch; ++b) {
    if (p.token[b] < 0 || p.token[b] >= p.vocab) {
      return invalid_argument(fmt::format("token_logprob: token[{}] = {} is outside [0, {})", b, p.token[b], p.vocab));
    }
  }
  const std::int64_t stride = p.row_stride == 0 ? p.vocab : p.row_stride;
  sampling_detail::for_each_row(p.batch, p.vocab, p.cpu_threads, [&](std::int64_t row, sampling_detail::Scratch& s) {
    const float* x = sampling_detail::row_f32(p.logits, p.logits_dtype, stride, row, p.vocab, s);
    p.logprob[row] = sampling_detail::token_logprob_row(x, p.vocab, p.token[row], s);
  });
  return ok_status();
}

}  // namespace laminar::kernels

#endif  // HWY_ONCE
