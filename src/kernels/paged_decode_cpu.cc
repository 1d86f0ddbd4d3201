// Highway implementation of the paged decode tasks. Compiled once per SIMD target by
// foreach_target.h. On AVX2 and AVX-512 a "pack" is an 8-lane f32 vector, and its lanes are exactly
// the 8 partial sums of the reduction order in cuda/paged_decode.cuh (fused multiply-add is native
// there); the weighted V pass, where every head-dim element is its own chain, uses the widest
// vectors ("wide", 16 lanes on AVX-512). On older targets both are 8 scalars run through
// numerics.h, the same arithmetic without vectors.

// Targets between the baseline and AVX2 (no native fma) and the newer AVX-512 flavours add
// compile time, not speed.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4 | HWY_AVX3_DL)
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/paged_decode_cpu.cc"  // relative to src/, re-included per target
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "paged_decode_cpu.h"

HWY_BEFORE_NAMESPACE();
namespace laminar::kernels::cpu_detail {
namespace HWY_NAMESPACE {

using cuda_detail::DecodeArgs;
using cuda_detail::KvElemT;
using cuda_detail::KvKind;
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
HWY_INLINE Pack padd(Pack a, Pack b) { return hn::Add(a, b); }
HWY_INLINE Pack pmax(Pack a, Pack b) { return hn::IfThenElse(hn::Gt(a, b), a, b); }  // max_f32, lane by lane
HWY_INLINE Pack pdiv(Pack a, Pack b) { return hn::Div(a, b); }

// Lanes(d) KV elements widened to f32.
template <KvKind K, class D>
HWY_INLINE hn::Vec<D> load_kv(D d, const KvElemT<K>* p) {
  if constexpr (K == KvKind::kF32) {
    return hn::LoadU(d, p);
  } else if constexpr (K == KvKind::kF16) {
    const hn::Rebind<hwy::float16_t, D> dh;
    return hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
  } else {
    const hn::Rebind<hwy::bfloat16_t, D> db;
    return hn::PromoteTo(d, hn::LoadU(db, reinterpret_cast<const hwy::bfloat16_t*>(p)));
  }
}
template <KvKind K>
HWY_INLINE Pack pload_kv(const KvElemT<K>* p) {
  return load_kv<K>(D8(), p);
}

// The fixed tree of step 1 for eight packs at once, by a transposition: out[k] is v[k]'s
// (p0+p4, p1+p5, p2+p6, p3+p7), then (a0+a2, a1+a3), then their sum, times scale; each addition
// the tree makes runs in its own lane.
HWY_INLINE void ptree8_scaled(const Pack* v, float scale, float* out) {
  const auto half_sums = [&](int k, int m) {  // [v_k lo + v_k hi | v_m lo + v_m hi]
    return _mm256_add_ps(_mm256_permute2f128_ps(v[k].raw, v[m].raw, 0x20), _mm256_permute2f128_ps(v[k].raw, v[m].raw, 0x31));
  };
  const __m256 b01 = half_sums(0, 1), b23 = half_sums(2, 3), b45 = half_sums(4, 5), b67 = half_sums(6, 7);
  const __m256 c0123 = _mm256_add_ps(_mm256_shuffle_ps(b01, b23, 0x44), _mm256_shuffle_ps(b01, b23, 0xee));
  const __m256 c4567 = _mm256_add_ps(_mm256_shuffle_ps(b45, b67, 0x44), _mm256_shuffle_ps(b45, b67, 0xee));
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(c0123, c4567, 0x88), _mm256_shuffle_ps(c0123, c4567, 0xdd));
  alignas(32) float r[8];  // sums of packs 0, 2, 4, 6, 1, 3, 5, 7
  _mm256_store_ps(r, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
  for (int k = 0; k < 4; ++k) out[2 * k] = r[k], out[2 * k + 1] = r[4 + k];
}

// The weighted V pass accumulates each head-dim element on its own, so it may use the widest
// vectors there are (16 lanes with AVX-512).
using DW = hn::CappedTag<float, 16>;
using Wide = hn::Vec<DW>;
constexpr int kWide = int(hn::MaxLanes(DW()));
HWY_INLINE Wide wzero() { return hn::Zero(DW()); }
HWY_INLINE Wide wset(float x) { return hn::Set(DW(), x); }
HWY_INLINE Wide wload(const float* p) { return hn::LoadU(DW(), p); }
HWY_INLINE void wstore(Wide v, float* p) { hn::StoreU(v, DW(), p); }
HWY_INLINE Wide wfma(Wide a, Wide b, Wide c) { return hn::MulAdd(a, b, c); }
template <KvKind K>
HWY_INLINE Wide wload_kv(const KvElemT<K>* p) {
  return load_kv<K>(DW(), p);
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
inline Pack padd(Pack a, Pack b) {
  for (int i = 0; i < 8; ++i) a.v[i] = internal::add_rn(a.v[i], b.v[i]);
  return a;
}
inline Pack pmax(Pack a, Pack b) {
  for (int i = 0; i < 8; ++i) a.v[i] = cuda_detail::max_f32(a.v[i], b.v[i]);
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
inline void ptree8_scaled(const Pack* v, float scale, float* out) {
  for (int k = 0; k < 8; ++k) out[k] = internal::mul_rn(cuda_detail::tree8(v[k].v), scale);
}
using Wide = Pack;
constexpr int kWide = 8;
inline Wide wzero() { return pzero(); }
inline Wide wset(float x) { return pset(x); }
inline Wide wload(const float* p) { return pload(p); }
inline void wstore(Wide v, float* p) { pstore(v, p); }
inline Wide wfma(Wide a, Wide b, Wide c) { return pfma(a, b, c); }
template <KvKind K>
inline Wide wload_kv(const KvElemT<K>* p) {
  return pload_kv<K>(p);
}
inline Pack pexp(Pack x) {
  for (int i = 0; i < 8; ++i) x.v[i] = internal::exp_f32(x.v[i]);
  return x;
}
#endif

// A task covers KV heads [h_begin, h_begin + heads) of one (row, split) and walks the split token
// by token, every head of a token before the next token: a page keeps all heads of a token side
// by side, so the reads run through each page in address order (one head at a time would jump by
// a token's stride). Pages are scattered, so memory is asked for explicitly and evenly over the
// work, which keeps it busy while the cores compute: the scores pass fetches the task's V rows a
// few tokens ahead into L2, the weighted V pass the next task's K rows.
constexpr int kPrefetchTokens = 4;

// The task's token rows: token j's row of its first KV head, the next heads following it.
template <class Elem>
struct TaskRows {
  int n = 0;  // tokens of the split
  const Elem* k[kSplit];
  const Elem* v[kSplit];
};

template <class Elem, int Dh>
void GetTaskRows(const DecodeArgs& a, const SplitWork& w, TaskRows<Elem>& rows) {
  const RowInfo r = cuda_detail::row_info(a.indptr, a.last_page_len, a.qo_indptr, a.batch, a.page_size,
                                          a.row_begin + w.local_row);
  const int start = w.split * kSplit;
  rows.n = start >= r.kv_len ? 0 : r.kv_len - start < kSplit ? r.kv_len - start : kSplit;
  const std::int64_t token_stride = std::int64_t(a.num_kv_heads) * Dh;
  const std::int32_t* pages = a.indices + a.indptr[r.seq];
  for (int j = 0; j < rows.n; ++j) {
    const int t = start + j;
    const std::int64_t off = (std::int64_t(pages[t / a.page_size]) * a.page_size + t % a.page_size) * token_stride +
                             std::int64_t(w.h_begin) * Dh;
    rows.k[j] = static_cast<const Elem*>(a.k_pages) + off;
    rows.v[j] = static_cast<const Elem*>(a.v_pages) + off;
  }
}

// Asks for `bytes` from p on into L2 (locality 2: not L1, which holds the task's q, scores and
// accumulators).
HWY_INLINE void PrefetchL2(const void* p, std::size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (std::size_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, 2);
}

// Step 1: scores of every token against the query heads. Tiles of 8 / G tokens keep 8 independent
// fma chains in flight (one per (token, query head)); each chain is still exactly the
// lane-strided sum of the reduction order.
template <KvKind K, int Dh, int G>
void ScoresT(const float* q_f, const TaskRows<KvElemT<K>>& rows, int heads, float scale, float* p_t, int ld) {
  constexpr int kTile = G >= 8 ? 1 : 8 / G;
  static_assert(kTile * G == 8, "a tile is eight fma chains");
  const int n = rows.n;
  for (int j0 = 0; j0 < n; j0 += kTile) {
    for (int h = 0; h < heads; ++h) {
      for (int t = j0 + kPrefetchTokens; t < j0 + kPrefetchTokens + kTile && t < n; ++t) {
        PrefetchL2(rows.k[t] + h * Dh, Dh * sizeof(KvElemT<K>));  // in L2 already, unless the first task
        PrefetchL2(rows.v[t] + h * Dh, Dh * sizeof(KvElemT<K>));
      }
      // A short last tile repeats its last token; those extra results are not stored.
      const KvElemT<K>* k[kTile];
      for (int t = 0; t < kTile; ++t) k[t] = rows.k[j0 + t < n ? j0 + t : n - 1] + h * Dh;
      const float* q = q_f + h * G * Dh;
      Pack acc[kTile * G];
      for (auto& x : acc) x = pzero();
      for (int i = 0; i < Dh; i += 8) {
        Pack kp[kTile];
        for (int t = 0; t < kTile; ++t) kp[t] = pload_kv<K>(k[t] + i);
        for (int g = 0; g < G; ++g) {
          const Pack qp = pload(q + g * Dh + i);
          for (int t = 0; t < kTile; ++t) acc[t * G + g] = pfma(qp, kp[t], acc[t * G + g]);
        }
      }
      float sc[8];
      ptree8_scaled(acc, scale, sc);
      for (int t = 0; t < kTile && j0 + t < n; ++t) {
        for (int g = 0; g < G; ++g) p_t[(j0 + t) * ld + h * G + g] = sc[t * G + g];
      }
    }
  }
}

// Max, probabilities and their sum per query head: each is a sequential chain over the tokens in
// increasing order, and the scores sit token-major (p_t [n, kPacks * 8]), so pack q runs the
// chains of query heads [8q, 8q + 8) side by side and the kPacks packs interleave. Padding lanes
// hold zeros.
template <int kPacks>
void SoftmaxRowsT(float* p_t, int n, float* m_out, float* l_out) {
  constexpr int ld = kPacks * 8;
  Pack m[kPacks], l[kPacks];
  for (int q = 0; q < kPacks; ++q) m[q] = pload(p_t + 8 * q), l[q] = pzero();
  for (int j = 1; j < n; ++j) {
    for (int q = 0; q < kPacks; ++q) m[q] = pmax(m[q], pload(p_t + j * ld + 8 * q));
  }
  for (int j = 0; j < n; ++j) {
    for (int q = 0; q < kPacks; ++q) {
      const Pack p = pexp(psub(pload(p_t + j * ld + 8 * q), m[q]));
      pstore(p, p_t + j * ld + 8 * q);
      l[q] = padd(l[q], p);
    }
  }
  for (int q = 0; q < kPacks; ++q) pstore(m[q], m_out + 8 * q), pstore(l[q], l_out + 8 * q);
}

void SoftmaxRows(float* p_t, int ld, int n, float* m_out, float* l_out) {
  static_assert(kCpuQoHeadsPerTask == 32, "one case per pack count");
  switch (ld / 8) {
    case 1: return SoftmaxRowsT<1>(p_t, n, m_out, l_out);
    case 2: return SoftmaxRowsT<2>(p_t, n, m_out, l_out);
    case 3: return SoftmaxRowsT<3>(p_t, n, m_out, l_out);
    default: return SoftmaxRowsT<4>(p_t, n, m_out, l_out);
  }
}

// Step 2's weighted V, accumulated in acc [heads * G, Dh] (L1-resident). Tiles of T tokens read
// and write each accumulator once per T fma, their probabilities held in registers; each (query
// head, element) is still one fma chain in increasing token order.
template <KvKind K, int Dh, int G, int T>
HWY_INLINE void WeightedTile(const float* p_t, int ld, const KvElemT<K>* const* vtok, int j0, int heads, float* acc) {
  for (int h = 0; h < heads; ++h) {
    Wide pv[G * T];
    for (int g = 0; g < G; ++g) {
      for (int t = 0; t < T; ++t) pv[g * T + t] = wset(p_t[(j0 + t) * ld + h * G + g]);
    }
    const KvElemT<K>* v[T];
    for (int t = 0; t < T; ++t) v[t] = vtok[j0 + t] + h * Dh;
    float* a = acc + h * G * Dh;
    for (int c = 0; c < Dh; c += kWide) {
      Wide vp[T];
      for (int t = 0; t < T; ++t) vp[t] = wload_kv<K>(v[t] + c);
      for (int g = 0; g < G; ++g) {
        Wide x = wload(a + g * Dh + c);
        for (int t = 0; t < T; ++t) x = wfma(pv[g * T + t], vp[t], x);
        wstore(x, a + g * Dh + c);
      }
    }
  }
}

template <KvKind K, int Dh, int G>
void WeightedValuesT(const float* p_t, int ld, const TaskRows<KvElemT<K>>& rows, int heads, float* acc,
                     const TaskRows<KvElemT<K>>* next, int next_heads) {
  // Tokens per tile: its G * T probabilities and T rows of V stay in registers (twice as many
  // with AVX-512's 32).
  constexpr int kHeld = kWide == 16 ? 16 : 8;
  constexpr int T = kHeld / G < 8 ? kHeld / G : 8;
  const int n = rows.n;
  for (int i = 0; i < heads * G * Dh; i += kWide) wstore(wzero(), acc + i);
  // The next task's K rows, spread over this pass's tiles.
  const int next_n = next != nullptr ? next->n : 0;
  const int tiles = (n + T - 1) / T;
  const int per_tile = (next_n + tiles - 1) / tiles;
  const std::size_t next_bytes = std::size_t(next_heads) * Dh * sizeof(KvElemT<K>);
  int fetched = 0;
  int j = 0;
  for (; j + T <= n; j += T) {
    for (int e = 0; e < per_tile && fetched < next_n; ++e) PrefetchL2(next->k[fetched++], next_bytes);
    WeightedTile<K, Dh, G, T>(p_t, ld, rows.v, j, heads, acc);
  }
  for (; j < n; ++j) {
    for (int e = 0; e < per_tile && fetched < next_n; ++e) PrefetchL2(next->k[fetched++], next_bytes);
    WeightedTile<K, Dh, G, 1>(p_t, ld, rows.v, j, heads, acc);
  }
}

template <KvKind K, int Dh, int G>
void SplitTaskG(const DecodeArgs& a, const SplitWork& w, const SplitWork* next) {
  using Elem = KvElemT<K>;
  TaskRows<Elem> rows;
  GetTaskRows<Elem, Dh>(a, w, rows);
  const int n = rows.n;
  if (n == 0) return;
  const int row = a.row_begin + w.local_row;
  const int nq = w.heads * G;
  const int hq0 = w.h_begin * G;

  alignas(64) float q_f[kCpuQoHeadsPerTask * Dh];    // then the weighted-V accumulators
  alignas(64) float p_t[kSplit * kCpuQoHeadsPerTask];  // scores, then probabilities [n, ld]
  alignas(64) float m[kCpuQoHeadsPerTask], l[kCpuQoHeadsPerTask];
  const int ld = (nq + 7) / 8 * 8;

  const Elem* q = static_cast<const Elem*>(a.q) + (std::int64_t(row) * a.num_qo_heads + hq0) * Dh;
  for (int i = 0; i < nq * Dh; ++i) q_f[i] = cuda_detail::to_f32<K>(q[i]);
  for (int j = 0; j < n; ++j) {
    for (int i = nq; i < ld; ++i) p_t[j * ld + i] = 0.0f;
  }
  ScoresT<K, Dh, G>(q_f, rows, w.heads, a.sm_scale, p_t, ld);
  SoftmaxRows(p_t, ld, n, m, l);
  TaskRows<Elem> next_rows;
  if (next != nullptr) GetTaskRows<Elem, Dh>(a, *next, next_rows);
  float* acc = q_f;
  WeightedValuesT<K, Dh, G>(p_t, ld, rows, w.heads, acc, next != nullptr ? &next_rows : nullptr,
                            next != nullptr ? next->heads : 0);

  const std::int64_t ws_row = (std::int64_t(w.local_row) * a.num_qo_heads + hq0) * a.max_splits + w.split;
  for (int i = 0; i < nq; ++i) {
    a.ws_l[ws_row + std::int64_t(i) * a.max_splits] = l[i];
    a.ws_m[ws_row + std::int64_t(i) * a.max_splits] = m[i];
    float* o = a.ws_o + (ws_row + std::int64_t(i) * a.max_splits) * Dh;
    for (int d = 0; d < Dh; d += 8) pstore(pload(acc + i * Dh + d), o + d);
  }
}

template <KvKind K, int Dh>
void SplitTaskT(const DecodeArgs& a, const SplitWork& w, const SplitWork* next) {
  switch (a.num_qo_heads / a.num_kv_heads) {
    case 1: return SplitTaskG<K, Dh, 1>(a, w, next);
    case 2: return SplitTaskG<K, Dh, 2>(a, w, next);
    case 4: return SplitTaskG<K, Dh, 4>(a, w, next);
    default: return SplitTaskG<K, Dh, 8>(a, w, next);
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
void SplitTask(const DecodeArgs& a, int kind, int head_dim, const SplitWork& w, const SplitWork* next) {
  const bool d64 = head_dim == 64;
  switch (KvKind(kind)) {
    case KvKind::kF32:
      return d64 ? SplitTaskT<KvKind::kF32, 64>(a, w, next) : SplitTaskT<KvKind::kF32, 128>(a, w, next);
    case KvKind::kF16:
      return d64 ? SplitTaskT<KvKind::kF16, 64>(a, w, next) : SplitTaskT<KvKind::kF16, 128>(a, w, next);
    case KvKind::kBF16:
      return d64 ? SplitTaskT<KvKind::kBF16, 64>(a, w, next) : SplitTaskT<KvKind::kBF16, 128>(a, w, next);
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

void split_task(const cuda_detail::DecodeArgs& a, cuda_detail::KvKind kind, int head_dim, const SplitWork& w,
                const SplitWork* next) {
  HWY_DYNAMIC_DISPATCH(SplitTask)(a, int(kind), head_dim, w, next);
}

void merge_task(const cuda_detail::DecodeArgs& a, cuda_detail::KvKind kind, int head_dim, int local_row, int hq) {
  HWY_DYNAMIC_DISPATCH(MergeTask)(a, int(kind), head_dim, local_row, hq);
}

}  // namespace laminar::kernels::cpu_detail
#endif
