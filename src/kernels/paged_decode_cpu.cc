// Highway implementation of the paged decode tasks. Compiled once per SIMD target by
// foreach_target.h. On AVX2 and AVX-512 a "pack" is an 8-lane f32 vector, and its lanes are exactly
// the 8 partial sums / 8 head-dim elements of the reduction order in cuda/paged_decode.cuh (fused
// multiply-add is native there). On older targets a pack is 8 scalars run through numerics.h, the
// same arithmetic without vectors.

// Targets between the baseline and AVX2 (no native fma) and the newer AVX-512 flavours add
// compile time, not speed, to a kernel that uses 8-lane vectors.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4 | HWY_AVX3_DL)
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/paged_decode_cpu.cc"  // relative to src/, re-included per target
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include "paged_decode_cpu.h"

HWY_BEFORE_NAMESPACE();
namespace laminar::kernels::cpu_detail {
namespace HWY_NAMESPACE {

using cuda_detail::DecodeArgs;
using cuda_detail::KvElemT;
using cuda_detail::KvKind;
using cuda_detail::kMaxGroup;
using cuda_detail::kSplit;
using cuda_detail::RowInfo;

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
namespace hn = hwy::HWY_NAMESPACE;
using D8 = hn::FixedTag<float, 8>;
using DI8 = hn::FixedTag<std::int32_t, 8>;
using Pack = hn::Vec<D8>;

HWY_INLINE Pack pzero() { return hn::Zero(D8()); }
HWY_INLINE Pack pset(float x) { return hn::Set(D8(), x); }
HWY_INLINE Pack pload(const float* p) { return hn::LoadU(D8(), p); }
HWY_INLINE void pstore(Pack v, float* p) { hn::StoreU(v, D8(), p); }
HWY_INLINE Pack pfma(Pack a, Pack b, Pack c) { return hn::MulAdd(a, b, c); }
HWY_INLINE Pack psub(Pack a, Pack b) { return hn::Sub(a, b); }
HWY_INLINE Pack pdiv(Pack a, Pack b) { return hn::Div(a, b); }

template <KvKind K>
HWY_INLINE Pack pload_kv(const KvElemT<K>* p) {
  if constexpr (K == KvKind::kF32) {
    return hn::LoadU(D8(), p);
  } else if constexpr (K == KvKind::kF16) {
    const hn::Rebind<hwy::float16_t, D8> dh;
    return hn::PromoteTo(D8(), hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
  } else {
    const hn::Rebind<hwy::bfloat16_t, D8> db;
    return hn::PromoteTo(D8(), hn::LoadU(db, reinterpret_cast<const hwy::bfloat16_t*>(p)));
  }
}

// The fixed tree of step 1: (p0+p4, p1+p5, p2+p6, p3+p7), then (a0+a2, a1+a3), then the sum.
HWY_INLINE float ptree(Pack v) {
  const hn::Half<D8> d4;
  const auto a = hn::Add(hn::LowerHalf(d4, v), hn::UpperHalf(d4, v));
  const auto b = hn::Add(a, hn::Shuffle1032(a));
  const auto c = hn::Add(b, hn::Shuffle2301(b));
  return hn::GetLane(c);
}

// numerics.h's exp_f32, lane by lane, with the same operations in the same order.
HWY_INLINE Pack pexp(Pack x) {
  using namespace internal::exp_consts;
  const D8 d;
  const DI8 di;
  const auto is_nan = hn::IsNaN(x);
  const Pack xc = hn::Min(hn::Max(x, hn::Set(d, kLo)), hn::Set(d, kHi));
  const Pack t = hn::MulAdd(xc, hn::Set(d, kLog2e), hn::Set(d, kRoundMagic));
  const Pack kf = hn::Sub(t, hn::Set(d, kRoundMagic));
  const auto n = hn::ConvertTo(di, kf);
  Pack r = hn::MulAdd(kf, hn::Set(d, -kLn2Hi), xc);
  r = hn::MulAdd(kf, hn::Set(d, -kLn2Lo), r);
  Pack p = hn::MulAdd(hn::Set(d, kP5), r, hn::Set(d, kP4));
  p = hn::MulAdd(p, r, hn::Set(d, kP3));
  p = hn::MulAdd(p, r, hn::Set(d, kP2));
  p = hn::MulAdd(p, r, hn::Set(d, kP1));
  p = hn::MulAdd(p, r, hn::Set(d, kP0));
  const Pack r2 = hn::Mul(r, r);
  const Pack y = hn::Add(hn::MulAdd(p, r2, r), hn::Set(d, 1.0f));
  const auto n1 = hn::ShiftRight<1>(n);
  const auto n2 = hn::Sub(n, n1);
  const Pack s1 = hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(n1, hn::Set(di, 127))));
  const Pack s2 = hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(n2, hn::Set(di, 127))));
  return hn::IfThenElse(is_nan, x, hn::Mul(hn::Mul(y, s1), s2));
}
#else
struct Pack {
  float v[8];
};

inline Pack pzero() { return Pack{{0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}}; }
inline Pack pset(float x) { return Pack{{x, x, x, x, x, x, x, x}}; }
inline Pack pload(const float* p) {
  Pack r;
  for (int i = 0; i < 8; ++i) r.v[i] = p[i];
  return r;
}
inline void pstore(Pack v, float* p) {
  for (int i = 0; i < 8; ++i) p[i] = v.v[i];
}
inline Pack pfma(Pack a, Pack b, Pack c) {
  for (int i = 0; i < 8; ++i) c.v[i] = internal::fma_rn(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline Pack psub(Pack a, Pack b) {
  for (int i = 0; i < 8; ++i) a.v[i] = internal::sub_rn(a.v[i], b.v[i]);
  return a;
}
inline Pack pdiv(Pack a, Pack b) {
  for (int i = 0; i < 8; ++i) a.v[i] = internal::div_rn(a.v[i], b.v[i]);
  return a;
}
template <KvKind K>
inline Pack pload_kv(const KvElemT<K>* p) {
  Pack r;
  for (int i = 0; i < 8; ++i) r.v[i] = cuda_detail::to_f32<K>(p[i]);
  return r;
}
inline float ptree(Pack v) { return cuda_detail::tree8(v.v); }
inline Pack pexp(Pack x) {
  for (int i = 0; i < 8; ++i) x.v[i] = internal::exp_f32(x.v[i]);
  return x;
}
#endif

// Step 1 for a whole split: scores of every token against the G query heads of the group. Tiles of
// 8 / G tokens keep 8 independent fma chains in flight (one per (token, head)); each chain is still
// exactly the lane-strided sum of the reduction order.
// Pages are scattered and a token's row for one KV head is only Dh elements, so the hardware
// prefetchers see no stream: fetch the K and V rows this many tokens ahead (V then waits in L2 for
// step 2).
constexpr int kPrefetchTokens = 16;

template <KvKind K, int Dh>
HWY_INLINE void PrefetchRow(const KvElemT<K>* row) {
  const char* p = reinterpret_cast<const char*>(row);
  for (std::size_t b = 0; b < Dh * sizeof(KvElemT<K>); b += 64) hwy::Prefetch(p + b);
}

template <KvKind K, int Dh, int G>
void ScoresT(const float* q_f, const KvElemT<K>* const* krow, const KvElemT<K>* const* vrow, int n, float scale,
             float* p_s) {
  constexpr int kTile = G >= 8 ? 1 : 8 / G;
  for (int j = 0; j < kPrefetchTokens && j < n; ++j) {
    PrefetchRow<K, Dh>(krow[j]);
    PrefetchRow<K, Dh>(vrow[j]);
  }
  for (int j0 = 0; j0 < n; j0 += kTile) {
    for (int t = 0; t < kTile && j0 + kPrefetchTokens + t < n; ++t) {
      PrefetchRow<K, Dh>(krow[j0 + kPrefetchTokens + t]);
      PrefetchRow<K, Dh>(vrow[j0 + kPrefetchTokens + t]);
    }
    // A short last tile repeats its last token; those extra results are not stored.
    const KvElemT<K>* k[kTile];
    for (int t = 0; t < kTile; ++t) k[t] = krow[j0 + t < n ? j0 + t : n - 1];
    Pack acc[kTile * G];
    for (auto& x : acc) x = pzero();
    for (int i = 0; i < Dh; i += 8) {
      Pack kp[kTile];
      for (int t = 0; t < kTile; ++t) kp[t] = pload_kv<K>(k[t] + i);
      for (int g = 0; g < G; ++g) {
        const Pack qp = pload(q_f + g * Dh + i);
        for (int t = 0; t < kTile; ++t) acc[t * G + g] = pfma(qp, kp[t], acc[t * G + g]);
      }
    }
    for (int t = 0; t < kTile && j0 + t < n; ++t) {
      for (int g = 0; g < G; ++g) p_s[g * kSplit + j0 + t] = internal::mul_rn(ptree(acc[t * G + g]), scale);
    }
  }
}

// Step 2's weighted V for all G heads at once: blocks of 128 / G head-dim elements, so 16 packs
// accumulate per pass and every V element is widened once. Each (head, element) is still one
// fma chain in increasing token order.
template <KvKind K, int Dh, int G>
void WeightedValuesT(const float* p_s, const KvElemT<K>* const* vrow, int n, float* o, std::int64_t head_stride) {
  constexpr int kBlock = (128 / G) < Dh ? (128 / G) : Dh;
  constexpr int kPacks = kBlock / 8;
  for (int db = 0; db < Dh; db += kBlock) {
    Pack acc[G * kPacks];
    for (auto& x : acc) x = pzero();
    for (int j = 0; j < n; ++j) {
      Pack v[kPacks];
      for (int c = 0; c < kPacks; ++c) v[c] = pload_kv<K>(vrow[j] + db + 8 * c);
      for (int g = 0; g < G; ++g) {
        const Pack pj = pset(p_s[g * kSplit + j]);
        for (int c = 0; c < kPacks; ++c) acc[g * kPacks + c] = pfma(pj, v[c], acc[g * kPacks + c]);
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < kPacks; ++c) pstore(acc[g * kPacks + c], o + g * head_stride + db + 8 * c);
    }
  }
}

template <KvKind K, int Dh>
void SplitTaskT(const DecodeArgs& a, int local_row, int h, int split) {
  using Elem = KvElemT<K>;
  const int row = a.row_begin + local_row;
  const RowInfo r = cuda_detail::row_info(a.indptr, a.last_page_len, a.qo_indptr, a.batch, a.page_size, row);
  const int start = split * kSplit;
  if (start >= r.kv_len) return;
  const int n = r.kv_len - start < kSplit ? r.kv_len - start : kSplit;
  const int group = a.num_qo_heads / a.num_kv_heads;

  alignas(64) float q_f[kMaxGroup * Dh];
  alignas(64) float p_s[kMaxGroup * kSplit];
  const Elem* krow[kSplit];
  const Elem* vrow[kSplit];

  const Elem* q = static_cast<const Elem*>(a.q) + (std::int64_t(row) * a.num_qo_heads + std::int64_t(h) * group) * Dh;
  for (int i = 0; i < group * Dh; ++i) q_f[i] = cuda_detail::to_f32<K>(q[i]);

  const std::int64_t token_stride = std::int64_t(a.num_kv_heads) * Dh;
  const std::int32_t* pages = a.indices + a.indptr[r.seq];
  for (int j = 0; j < n; ++j) {
    const int t = start + j;
    const std::int64_t off =
        (std::int64_t(pages[t / a.page_size]) * a.page_size + t % a.page_size) * token_stride + std::int64_t(h) * Dh;
    krow[j] = static_cast<const Elem*>(a.k_pages) + off;
    vrow[j] = static_cast<const Elem*>(a.v_pages) + off;
  }

  switch (group) {
    case 1: ScoresT<K, Dh, 1>(q_f, krow, vrow, n, a.sm_scale, p_s); break;
    case 2: ScoresT<K, Dh, 2>(q_f, krow, vrow, n, a.sm_scale, p_s); break;
    case 4: ScoresT<K, Dh, 4>(q_f, krow, vrow, n, a.sm_scale, p_s); break;
    default: ScoresT<K, Dh, 8>(q_f, krow, vrow, n, a.sm_scale, p_s); break;
  }

  // Step 2: max, probabilities, their sum, and the probability-weighted V.
  const std::int64_t ws_row = (std::int64_t(local_row) * a.num_qo_heads + std::int64_t(h) * group) * a.max_splits + split;
  for (int g = 0; g < group; ++g) {
    float* p = p_s + g * kSplit;
    float m = p[0];
    for (int j = 1; j < n; ++j) m = cuda_detail::max_f32(m, p[j]);
    const Pack mv = pset(m);
    int j = 0;
    for (; j + 8 <= n; j += 8) pstore(pexp(psub(pload(p + j), mv)), p + j);
    for (; j < n; ++j) p[j] = internal::exp_f32(internal::sub_rn(p[j], m));
    float l = 0.0f;
    for (j = 0; j < n; ++j) l = internal::add_rn(l, p[j]);
    a.ws_l[ws_row + std::int64_t(g) * a.max_splits] = l;
    a.ws_m[ws_row + std::int64_t(g) * a.max_splits] = m;
  }
  float* o = a.ws_o + ws_row * Dh;
  const std::int64_t head_stride = std::int64_t(a.max_splits) * Dh;
  switch (group) {
    case 1: WeightedValuesT<K, Dh, 1>(p_s, vrow, n, o, head_stride); break;
    case 2: WeightedValuesT<K, Dh, 2>(p_s, vrow, n, o, head_stride); break;
    case 4: WeightedValuesT<K, Dh, 4>(p_s, vrow, n, o, head_stride); break;
    default: WeightedValuesT<K, Dh, 8>(p_s, vrow, n, o, head_stride); break;
  }
}

template <KvKind K, int Dh>
void MergeTaskT(const DecodeArgs& a, int local_row, int hq) {
  const int row = a.row_begin + local_row;
  const RowInfo r = cuda_detail::row_info(a.indptr, a.last_page_len, a.qo_indptr, a.batch, a.page_size, row);
  const std::int64_t out_row = std::int64_t(row) * a.num_qo_heads + hq;
  KvElemT<K>* out = static_cast<KvElemT<K>*>(a.out) + out_row * Dh;
  const int splits = cuda_detail::num_splits(r.kv_len);
  if (splits == 0) {
    for (int d = 0; d < Dh; ++d) out[d] = cuda_detail::from_f32<K>(0.0f);
    if (a.lse != nullptr) a.lse[out_row] = internal::f32_from_bits(0xff800000u);
    return;
  }
  const std::int64_t base = (std::int64_t(local_row) * a.num_qo_heads + hq) * a.max_splits;
  float m = a.ws_m[base];
  for (int s = 1; s < splits; ++s) m = cuda_detail::max_f32(m, a.ws_m[base + s]);
  Pack o[Dh / 8];
  for (auto& x : o) x = pzero();
  float l = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float w = internal::exp_f32(internal::sub_rn(a.ws_m[base + s], m));
    l = internal::fma_rn(a.ws_l[base + s], w, l);
    const Pack wv = pset(w);
    const float* os = a.ws_o + (base + s) * Dh;
    for (int c = 0; c < Dh / 8; ++c) o[c] = pfma(pload(os + 8 * c), wv, o[c]);
  }
  alignas(64) float res[Dh];
  const Pack lv = pset(l);
  for (int c = 0; c < Dh / 8; ++c) pstore(pdiv(o[c], lv), res + 8 * c);
  for (int d = 0; d < Dh; ++d) out[d] = cuda_detail::from_f32<K>(res[d]);
  if (a.lse != nullptr) a.lse[out_row] = internal::add_rn(m, internal::log_f32(l));
}

// The one place where the runtime dtype and head_dim become template arguments on the host.
void SplitTask(const DecodeArgs& a, int kind, int head_dim, int local_row, int h, int split) {
  const bool d64 = head_dim == 64;
  switch (KvKind(kind)) {
    case KvKind::kF32:
      return d64 ? SplitTaskT<KvKind::kF32, 64>(a, local_row, h, split) : SplitTaskT<KvKind::kF32, 128>(a, local_row, h, split);
    case KvKind::kF16:
      return d64 ? SplitTaskT<KvKind::kF16, 64>(a, local_row, h, split) : SplitTaskT<KvKind::kF16, 128>(a, local_row, h, split);
    case KvKind::kBF16:
      return d64 ? SplitTaskT<KvKind::kBF16, 64>(a, local_row, h, split) : SplitTaskT<KvKind::kBF16, 128>(a, local_row, h, split);
  }
}

void MergeTask(const DecodeArgs& a, int kind, int head_dim, int local_row, int hq) {
  const bool d64 = head_dim == 64;
  switch (KvKind(kind)) {
    case KvKind::kF32:
      return d64 ? MergeTaskT<KvKind::kF32, 64>(a, local_row, hq) : MergeTaskT<KvKind::kF32, 128>(a, local_row, hq);
    case KvKind::kF16:
      return d64 ? MergeTaskT<KvKind::kF16, 64>(a, local_row, hq) : MergeTaskT<KvKind::kF16, 128>(a, local_row, hq);
    case KvKind::kBF16:
      return d64 ? MergeTaskT<KvKind::kBF16, 64>(a, local_row, hq) : MergeTaskT<KvKind::kBF16, 128>(a, local_row, hq);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace laminar::kernels::cpu_detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace laminar::kernels::cpu_detail {

HWY_EXPORT(SplitTask);
HWY_EXPORT(MergeTask);

void split_task(const cuda_detail::DecodeArgs& a, cuda_detail::KvKind kind, int head_dim, int local_row, int h,
                int split) {
  HWY_DYNAMIC_DISPATCH(SplitTask)(a, int(kind), head_dim, local_row, h, split);
}

void merge_task(const cuda_detail::DecodeArgs& a, cuda_detail::KvKind kind, int head_dim, int local_row, int hq) {
  HWY_DYNAMIC_DISPATCH(MergeTask)(a, int(kind), head_dim, local_row, hq);
}

}  // namespace laminar::kernels::cpu_detail
#endif
