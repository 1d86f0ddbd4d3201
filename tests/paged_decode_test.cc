// Paged decode / causal prefill attention: the CPU kernel against the readable reference (within a
// tolerance), against the CUDA kernels run on the CPU by cuda/emulation (bit for bit), batch
// invariance and decode == prefill (bit for bit), and degenerate input.
#include "emulation/emulation.h"
#include "paged_decode.cuh"

#include <hwy/targets.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_absent.h"
#include "expect_code.h"
#include "laminar/internal/numerics.h"
#include "laminar/kernels/paged_decode.h"
#include "laminar/ref/paged_decode.h"
#include "kernels/paged_decode_args.h"

namespace {

using laminar::DType;
using laminar::Status;
using laminar::StatusCode;
using laminar::Stream;
using laminar::kernels::PagedDecodeParams;
namespace cd = laminar::kernels::cuda_detail;
namespace li = laminar::internal;

std::uint64_t fresh_seed() {
  static const std::uint64_t seed = [] {
    const std::uint64_t s = laminar::emu::test_seed();
    std::printf("paged_decode_test seed %llu\n", static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

struct Shape {
  DType dtype = DType::kBF16;
  int head_dim = 128;
  int num_kv_heads = 2;
  int group = 4;
  int page_size = 16;
};

float to_float(const std::vector<std::uint8_t>& buf, std::size_t i, DType t) {
  if (t == DType::kF32) {
    float f;
    std::memcpy(&f, buf.data() + 4 * i, 4);
    return f;
  }
  std::uint16_t h;
  std::memcpy(&h, buf.data() + 2 * i, 2);
  return t == DType::kF16 ? li::f16_to_f32(h) : li::bf16_to_f32(h);
}

void put_float(std::vector<std::uint8_t>& buf, std::size_t i, DType t, float v) {
  if (t == DType::kF32) {
    std::memcpy(buf.data() + 4 * i, &v, 4);
    return;
  }
  const std::uint16_t h = t == DType::kF16 ? li::f32_to_f16(v) : li::f32_to_bf16(v);
  std::memcpy(buf.data() + 2 * i, &h, 2);
}

// A batch of sequences with their KV in randomly placed pages, one query row per sequence (decode)
// or per position (prefill), and output buffers.
struct Problem {
  Shape s;
  std::vector<std::int32_t> lengths;
  std::vector<std::uint8_t> k, v, q, out;
  std::vector<float> lse;
  std::vector<std::int32_t> indptr{0}, indices, last_page_len, qo_indptr;
  int num_pages = 0;
  int num_rows = 0;
  bool prefill = false;

  int qo_heads() const { return s.num_kv_heads * s.group; }
  std::size_t elem() const { return laminar::dtype_size(s.dtype); }

  PagedDecodeParams params() {
    PagedDecodeParams p;
    p.q = q.data();
    p.out = out.data();
    p.lse = lse.data();
    p.kv.k_pages = k.data();
    p.kv.v_pages = v.data();
    p.kv.layout = {num_pages, s.page_size, s.num_kv_heads, s.head_dim, s.dtype};
    p.table = {indptr.data(), indices.data(), last_page_len.data(), std::int32_t(lengths.size())};
    p.qo_indptr = prefill ? qo_indptr.data() : nullptr;
    p.num_rows = num_rows;
    p.num_qo_heads = qo_heads();
    p.sm_scale = 1.0f / std::sqrt(float(s.head_dim));
    p.max_kv_len = std::max(1, *std::max_element(lengths.begin(), lengths.end()));
    return p;
  }
};

// Builds the page table for `lengths` over freshly shuffled pages and fills K, V, q with N(0, 1)
// values rounded to the dtype. queries[b] = number of prefill rows of sequence b (empty: decode).
Problem make_problem(const Shape& s, const std::vector<std::int32_t>& lengths, std::uint64_t seed,
                     const std::vector<std::int32_t>& queries = {}) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Problem pb;
  pb.s = s;
  pb.lengths = lengths;
  int total_pages = 0;
  for (int len : lengths) total_pages += (len + s.page_size - 1) / s.page_size;
  pb.num_pages = total_pages + 3;  // a few pages nobody uses
  std::vector<std::int32_t> perm(std::size_t(pb.num_pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  int next = 0;
  for (int len : lengths) {
    const int pages = (len + s.page_size - 1) / s.page_size;
    for (int i = 0; i < pages; ++i) pb.indices.push_back(perm[std::size_t(next++)]);
    pb.indptr.push_back(std::int32_t(pb.indices.size()));
    pb.last_page_len.push_back(len == 0 ? 0 : len - (pages - 1) * s.page_size);
  }
  const std::size_t pool = std::size_t(pb.num_pages) * s.page_size * s.num_kv_heads * s.head_dim;
  pb.k.resize(pool * pb.elem());
  pb.v.resize(pool * pb.elem());
  for (std::size_t i = 0; i < pool; ++i) put_float(pb.k, i, s.dtype, normal(rng));
  for (std::size_t i = 0; i < pool; ++i) put_float(pb.v, i, s.dtype, normal(rng));
  pb.prefill = !queries.empty();
  if (pb.prefill) {
    pb.qo_indptr.push_back(0);
    for (int n : queries) pb.qo_indptr.push_back(pb.qo_indptr.back() + n);
    pb.num_rows = pb.qo_indptr.back();
  } else {
    pb.num_rows = int(lengths.size());
  }
  const std::size_t qn = std::size_t(pb.num_rows) * pb.qo_heads() * s.head_dim;
  pb.q.resize(qn * pb.elem());
  for (std::size_t i = 0; i < qn; ++i) put_float(pb.q, i, s.dtype, normal(rng));
  pb.out.assign(qn * pb.elem(), 0xcd);
  pb.lse.assign(std::size_t(pb.num_rows) * pb.qo_heads(), -1.0f);
  return pb;
}

struct Result {
  std::vector<std::uint8_t> out;
  std::vector<float> lse;
};

// Poisons the outputs so a run that writes nothing cannot pass for the previous run's results.
void poison(Problem& pb) {
  std::fill(pb.out.begin(), pb.out.end(), std::uint8_t(0xcd));
  std::fill(pb.lse.begin(), pb.lse.end(), std::numeric_limits<float>::quiet_NaN());
}

Result run_cpu(Problem& pb, int threads = 2) {
  poison(pb);
  PagedDecodeParams p = pb.params();
  p.cpu_threads = threads;
  const Status st = laminar::kernels::run(p, Stream::host());
  REQUIRE(st.ok());
  return {pb.out, pb.lse};
}

Result run_ref(Problem& pb) {
  poison(pb);
  const Status st = laminar::ref::paged_decode(pb.params());
  REQUIRE(st.ok());
  return {pb.out, pb.lse};
}

template <cd::KvKind K, int D>
Status emulate_kernels(const cd::DecodeArgs& a, int rows, std::uint64_t seed) {
  const int group = a.num_qo_heads / a.num_kv_heads;
  const Status st = laminar::emu::launch(dim3(unsigned(rows * a.num_kv_heads), unsigned(a.max_splits)),
                                         dim3(cd::kDecodeThreads), cd::split_smem_bytes(group, D), seed,
                                         cd::paged_decode_split_kernel<K, D>, a);
  if (!st.ok()) return st;
  return laminar::emu::launch(dim3(unsigned(rows * a.num_qo_heads)), dim3(D), 0, seed + 1,
                              cd::paged_decode_merge_kernel<K, D>, a);
}

// The CUDA kernels' own code, run on the CPU by cuda/emulation.
Result run_emulated(Problem& pb, std::uint64_t seed) {
  poison(pb);
  const PagedDecodeParams p = pb.params();
  // NaN-filled, so a partial the kernels read without writing shows up in the results.
  std::vector<float> ws(cd::decode_row_floats(p) * std::size_t(pb.num_rows), std::numeric_limits<float>::quiet_NaN());
  const cd::DecodeArgs a = cd::make_decode_args(p, ws.data(), pb.num_rows);
  const bool d64 = pb.s.head_dim == 64;
  Status st;
  switch (pb.s.dtype) {
    case DType::kF32:
      st = d64 ? emulate_kernels<cd::KvKind::kF32, 64>(a, pb.num_rows, seed)
               : emulate_kernels<cd::KvKind::kF32, 128>(a, pb.num_rows, seed);
      break;
    case DType::kF16:
      st = d64 ? emulate_kernels<cd::KvKind::kF16, 64>(a, pb.num_rows, seed)
               : emulate_kernels<cd::KvKind::kF16, 128>(a, pb.num_rows, seed);
      break;
    default:
      st = d64 ? emulate_kernels<cd::KvKind::kBF16, 64>(a, pb.num_rows, seed)
               : emulate_kernels<cd::KvKind::kBF16, 128>(a, pb.num_rows, seed);
      break;
  }
  INFO(st.to_string());
  REQUIRE(st.ok());
  return {pb.out, pb.lse};
}

std::uint32_t bits(float f) { return li::f32_bits(f); }

void require_same_bits(const Result& a, const Result& b) {
  REQUIRE(a.out.size() == b.out.size());
  const bool out_same = a.out == b.out;
  std::size_t first_lse = a.lse.size();
  for (std::size_t i = 0; i < a.lse.size(); ++i) {
    if (bits(a.lse[i]) != bits(b.lse[i])) {
      first_lse = i;
      break;
    }
  }
  CHECK(out_same);
  INFO("first differing lse index " << first_lse);
  CHECK(first_lse == a.lse.size());
}

// Spacing of representable values of the dtype near |x|.
double ulp_of(DType t, double x) {
  const int mant = t == DType::kF32 ? 23 : t == DType::kF16 ? 10 : 7;
  int e = 0;
  std::frexp(std::max(std::fabs(x), 1e-30), &e);
  return std::ldexp(1.0, e - 1 - mant);
}

const char* name(DType t) { return t == DType::kF32 ? "f32" : t == DType::kF16 ? "f16" : "bf16"; }

Shape random_shape(std::mt19937_64& rng) {
  const DType dtypes[] = {DType::kF32, DType::kF16, DType::kBF16};
  const int groups[] = {1, 2, 4, 8};
  const int pages[] = {1, 16, 64};
  Shape s;
  s.dtype = dtypes[rng() % 3];
  s.head_dim = rng() % 2 ? 64 : 128;
  s.group = groups[rng() % 4];
  s.num_kv_heads = 1 + int(rng() % 2);
  s.page_size = pages[rng() % 3];
  return s;
}

}  // namespace

TEST_CASE("paged decode: the CPU kernel matches the reference on random shapes", "[paged_decode]") {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 24; ++trial) {
    const Shape s = random_shape(rng);
    std::vector<std::int32_t> lengths(1 + rng() % 4);
    for (auto& len : lengths) len = 1 + std::int32_t(rng() % 1500);
    // A few long sequences: up to 32k tokens, kept to single small-head cases to bound time.
    if (trial % 8 == 7) lengths = {std::int32_t(8000 + rng() % 24768)};
    Problem pb = make_problem(s, lengths, rng());
    const Result fast = run_cpu(pb);
    const Result ref = run_ref(pb);
    INFO("trial " << trial << " " << name(s.dtype) << " D" << s.head_dim << " group " << s.group << " kv heads "
                  << s.num_kv_heads << " page " << s.page_size << " max len " << pb.params().max_kv_len);
    // Tolerance: the kernel accumulates in f32 in a fixed order (<= 256 sequential terms per split,
    // <= 128 splits), so its pre-rounding output is within about 384 * 2^-24 * sum|p v| / sum p
    // <= 1e-4 for |v| <~ 4; the reference is exact to double precision. Both then round to the
    // output dtype, which can put them one output ulp apart.
    double worst_out = 0, worst_lse = 0;
    for (std::size_t i = 0; i < fast.out.size() / pb.elem(); ++i) {
      const double f = to_float(fast.out, i, s.dtype), r = to_float(ref.out, i, s.dtype);
      worst_out = std::max(worst_out, std::fabs(f - r) / (2e-4 + ulp_of(s.dtype, r)));
    }
    // lse = max + log(sum): f32 scores from a D-term fma chain (relative 2^-24 * D of sum|q k|)
    // and the 1-ulp exp/log: 2e-4 absolute covers |scores| up to ~20.
    for (std::size_t i = 0; i < fast.lse.size(); ++i) {
      worst_lse = std::max(worst_lse, std::fabs(double(fast.lse[i]) - ref.lse[i]) / 2e-4);
    }
    CHECK(worst_out <= 1.0);
    CHECK(worst_lse <= 1.0);
  }
}

TEST_CASE("paged decode: CPU kernel and the CUDA kernels under emulation agree bit for bit", "[paged_decode]") {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed + 1);
  for (int trial = 0; trial < 10; ++trial) {
    Shape s = random_shape(rng);
    std::vector<std::int32_t> lengths(1 + rng() % 3);
    for (auto& len : lengths) len = 1 + std::int32_t(rng() % 700);
    if (trial == 0) lengths = {1, 256, 257, 0, 512};  // split edges and an empty sequence
    if (trial == 1) lengths = {3000};
    // More query heads than one CPU task takes (32): the heads of a split go to several tasks.
    if (trial == 2) s.num_kv_heads = 12, s.group = 4, lengths = {600, 300, 40};
    if (trial == 3) s.num_kv_heads = 40, s.group = 1, lengths = {520, 7};
    Problem pb = make_problem(s, lengths, rng());
    INFO("trial " << trial << " " << name(s.dtype) << " D" << s.head_dim << " group " << s.group << " kv heads "
                  << s.num_kv_heads << " page " << s.page_size);
    const Result cpu = run_cpu(pb);
    const Result emu = run_emulated(pb, rng());
    require_same_bits(cpu, emu);
  }
}

TEST_CASE("paged decode: batch invariance, a sequence alone or among 1..64 mates gives the same bits",
          "[paged_decode]") {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed + 2);
  Shape s;
  s.dtype = DType::kBF16;
  s.head_dim = 128;
  s.num_kv_heads = 2;
  s.group = 4;
  s.page_size = 16;
  const std::int32_t target_len = 1337;
  // The target's KV and query, copied into every batch at a random slot and random pages.
  Problem alone = make_problem(s, {target_len}, seed);
  const Result solo = run_cpu(alone, 1);
  const std::size_t token_bytes = std::size_t(s.num_kv_heads) * s.head_dim * alone.elem();
  const std::size_t q_bytes = std::size_t(alone.qo_heads()) * s.head_dim * alone.elem();
  for (int mates : {1, 7, 31, 64}) {
    std::vector<std::int32_t> lengths(std::size_t(mates) + 1);
    for (auto& len : lengths) len = std::int32_t(rng() % 2500);
    const std::size_t slot = rng() % lengths.size();
    lengths[slot] = target_len;
    Problem batch = make_problem(s, lengths, rng());
    // Copy the target's tokens into its new pages and its query into its row.
    for (int t = 0; t < target_len; ++t) {
      auto token_at = [&](const Problem& pb, std::size_t b) {
        const std::int32_t page = pb.indices[std::size_t(pb.indptr[b] + t / s.page_size)];
        return (std::size_t(page) * s.page_size + std::size_t(t % s.page_size)) * token_bytes;
      };
      std::memcpy(batch.k.data() + token_at(batch, slot), alone.k.data() + token_at(alone, 0), token_bytes);
      std::memcpy(batch.v.data() + token_at(batch, slot), alone.v.data() + token_at(alone, 0), token_bytes);
    }
    std::memcpy(batch.q.data() + slot * q_bytes, alone.q.data(), q_bytes);
    const Result together = run_cpu(batch, 1 + int(rng() % 3));
    INFO(mates << " batch mates, target at slot " << slot);
    CHECK(std::memcmp(together.out.data() + slot * q_bytes, solo.out.data(), q_bytes) == 0);
    for (int h = 0; h < alone.qo_heads(); ++h) {
      CHECK(bits(together.lse[slot * std::size_t(alone.qo_heads()) + std::size_t(h)]) == bits(solo.lse[std::size_t(h)]));
    }
    if (mates == 7) {  // the CUDA code too (emulated), with the same target
      const Result emu = run_emulated(batch, rng());
      CHECK(std::memcmp(emu.out.data() + slot * q_bytes, solo.out.data(), q_bytes) == 0);
    }
  }
}

TEST_CASE("paged decode: causal prefill equals decode step by step, bit for bit", "[paged_decode]") {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed + 3);
  for (int trial = 0; trial < 4; ++trial) {
    Shape s = random_shape(rng);
    // Trial 0 crosses the split boundary at 512, trial 1 is a whole-sequence prefill; both also run
    // the CUDA code under emulation. The others are CPU only, with random lengths.
    const std::int32_t len = trial == 0 ? 530 : trial == 1 ? 1 + std::int32_t(rng() % 120) : 1 + std::int32_t(rng() % 400);
    const std::int32_t nq = trial == 0 ? 40 : trial == 1 ? len : 1 + std::int32_t(rng() % std::min(len, 300));
    // One sequence, prefill of its last nq positions; a second sequence rides along.
    Problem pre = make_problem(s, {len, 37}, rng(), {nq, 2});
    const Result prefill = run_cpu(pre);
    const Result prefill_emu = trial < 2 ? run_emulated(pre, rng()) : prefill;
    require_same_bits(prefill, prefill_emu);
    // Decode: the same pages, the table cut to each prefix length, the query of that position.
    const std::size_t row_bytes = std::size_t(pre.qo_heads()) * s.head_dim * pre.elem();
    for (std::int32_t i = 0; i < nq; ++i) {
      const std::int32_t prefix = len - nq + i + 1;
      const std::int32_t pages = (prefix + s.page_size - 1) / s.page_size;
      std::int32_t indptr[2] = {0, pages};
      std::int32_t last[1] = {prefix - (pages - 1) * s.page_size};
      std::vector<std::uint8_t> out(row_bytes);
      std::vector<float> lse(std::size_t(pre.qo_heads()));
      PagedDecodeParams p = pre.params();
      p.qo_indptr = nullptr;
      p.num_rows = 1;
      p.table = {indptr, pre.indices.data(), last, 1};
      p.q = pre.q.data() + i * row_bytes;
      p.out = out.data();
      p.lse = lse.data();
      p.cpu_threads = 1;
      REQUIRE(laminar::kernels::run(p, Stream::host()).ok());
      const Result step{out, lse};
      INFO("trial " << trial << " position " << prefix - 1 << " of " << len);
      REQUIRE(std::memcmp(step.out.data(), prefill.out.data() + i * row_bytes, row_bytes) == 0);
      for (int h = 0; h < pre.qo_heads(); ++h) {
        REQUIRE(bits(step.lse[std::size_t(h)]) == bits(prefill.lse[std::size_t(i * pre.qo_heads() + h)]));
      }
    }
  }
}

TEST_CASE("paged decode: every compiled SIMD target of the CPU kernel gives the same bits", "[paged_decode]") {
  const std::uint64_t seed = fresh_seed();
  Shape s;
  s.dtype = DType::kF16;
  s.head_dim = 64;
  s.group = 2;
  Problem pb = make_problem(s, {700, 5, 300}, seed + 4);
  const Result best = run_cpu(pb);
  int tried = 0;
  for (std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    const Result r = run_cpu(pb);
    INFO("target " << hwy::TargetName(target));
    require_same_bits(best, r);
    ++tried;
  }
  hwy::SetSupportedTargetsForTest(0);
  CHECK(tried >= 2);  // at least the AVX2 path and the scalar baseline on x86
}

TEST_CASE("paged decode: degenerate and bad input", "[paged_decode]") {
  const std::uint64_t seed = fresh_seed();
  Shape s;
  s.dtype = DType::kF32;
  s.head_dim = 64;
  s.group = 1;
  s.num_kv_heads = 1;

  // A sequence of length 0 gives zeros and lse = -inf; its batch mate is unaffected.
  Problem pb = make_problem(s, {0, 20}, seed);
  const Result r = run_cpu(pb);
  for (int d = 0; d < 64; ++d) CHECK(to_float(r.out, std::size_t(d), s.dtype) == 0.0f);
  CHECK(r.lse[0] == -std::numeric_limits<float>::infinity());
  CHECK(std::isfinite(r.lse[1]));
  const Result e = run_emulated(pb, seed);
  require_same_bits(r, e);

  // Empty batch: nothing to do, no pointers needed.
  PagedDecodeParams empty = pb.params();
  empty.table = {};
  empty.num_rows = 0;
  empty.q = nullptr;
  empty.out = nullptr;
  CHECK(laminar::kernels::run(empty, Stream::host()).ok());

  auto expect_invalid = [&](PagedDecodeParams p, const char* needle) {
    const Status st = laminar::kernels::run(p, Stream::host());
    INFO(st.to_string());
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK(st.message().find(needle) != std::string::npos);
  };
  auto expect_invalid_on_device = [&](PagedDecodeParams p, const char* needle) {
    laminar::testing::expect_code(laminar::kernels::run(p, Stream::cuda(nullptr)), StatusCode::kInvalidArgument,
                                  needle);
  };
  PagedDecodeParams p = pb.params();
  p.kv.layout.dtype = DType::kI32;
  expect_invalid(p, "i32");
  p = pb.params();
  p.kv.layout.head_dim = 96;
  expect_invalid(p, "head_dim 96");
  p = pb.params();
  p.num_qo_heads = 3;
  expect_invalid(p, "group size 3");
  p = pb.params();
  p.sm_scale = std::numeric_limits<float>::quiet_NaN();
  expect_invalid(p, "sm_scale");
  p = pb.params();
  p.max_kv_len = 10;
  expect_invalid(p, "max_kv_len 10");
  p = pb.params();
  p.num_rows = 3;
  expect_invalid(p, "num_rows == batch");
  pb.indices[0] = 1000;
  expect_invalid(pb.params(), "indices[0] = 1000");
  pb.indices[0] = 0;
  pb.last_page_len[1] = 0;
  expect_invalid(pb.params(), "last_page_len 0");
  pb.last_page_len[1] = 4;

  // Prefill asking for more rows than a sequence has tokens.
  Problem pre = make_problem(s, {4}, seed, {4});
  pre.qo_indptr[1] = 5;
  pre.num_rows = 5;
  expect_invalid(pre.params(), "5 query rows for 4 tokens");

  // A CUDA stream needs a workspace.
  p = pb.params();
  expect_invalid_on_device(p, "workspace");
  CHECK(laminar::kernels::workspace_bytes(p) > 0);
  CHECK(laminar::ref::paged_decode(pb.params()).ok());
}

TEST_CASE("paged decode: a CUDA stream without a device answers kFailedPrecondition (kUnimplemented without CUDA)",
          "[paged_decode][cuda]") {
  const auto code = laminar::testing::code_without_device();
  if (!code) return;  // a device is present: paged_decode_cuda_test runs the kernels
  Shape s;
  s.dtype = DType::kF32;
  s.head_dim = 64;
  Problem pb = make_problem(s, {40, 7}, fresh_seed());
  PagedDecodeParams p = pb.params();
  std::vector<std::uint8_t> workspace(laminar::kernels::workspace_bytes(p));
  p.workspace = workspace.data();
  p.workspace_bytes = workspace.size();
  REQUIRE(laminar::kernels::can_implement(p, Stream::cuda(nullptr)).ok());
  std::fill(pb.out.begin(), pb.out.end(), std::uint8_t(0x5a));
  laminar::testing::expect_code(laminar::kernels::run(p, Stream::cuda(nullptr)), *code, "paged_decode");
  CHECK(std::count(pb.out.begin(), pb.out.end(), std::uint8_t(0x5a)) == std::ptrdiff_t(pb.out.size()));
}

namespace {

using laminar::TensorView;
using laminar::kernels::PagedDecodeTensors;

TensorView dense(void* data, DType t, std::vector<std::int64_t> shape, laminar::Device d = laminar::Device::cpu()) {
  return TensorView::contiguous(data, t, shape, d).value();
}

// Views of a Problem's buffers, shaped as an engine holds them; index tensors as i32 or, copied
// into the i64 vectors, as i64.
struct ProblemViews {
  std::vector<std::int64_t> indptr64, indices64, last64, qo64;
  PagedDecodeTensors t;

  ProblemViews(Problem& pb, bool i64) {
    const std::int64_t heads = pb.qo_heads(), d = pb.s.head_dim;
    t.q = dense(pb.q.data(), pb.s.dtype, {pb.num_rows, heads, d});
    t.out = dense(pb.out.data(), pb.s.dtype, {pb.num_rows, heads, d});
    t.lse = dense(pb.lse.data(), DType::kF32, {pb.num_rows, heads});
    const std::vector<std::int64_t> pool = {pb.num_pages, pb.s.page_size, pb.s.num_kv_heads, d};
    t.k_pages = dense(pb.k.data(), pb.s.dtype, pool);
    t.v_pages = dense(pb.v.data(), pb.s.dtype, pool);
    const auto index = [&](std::vector<std::int32_t>& v32, std::vector<std::int64_t>& v64) {
      if (!i64) return dense(v32.data(), DType::kI32, {std::int64_t(v32.size())});
      v64.assign(v32.begin(), v32.end());
      return dense(v64.data(), DType::kI64, {std::int64_t(v64.size())});
    };
    t.indptr = index(pb.indptr, indptr64);
    t.indices = index(pb.indices, indices64);
    t.last_page_len = index(pb.last_page_len, last64);
    if (pb.prefill) t.qo_indptr = index(pb.qo_indptr, qo64);
  }
};

void expect_refused(const PagedDecodeTensors& t, const char* text) {
  laminar::kernels::PagedDecodeIndexCopies copies;
  auto p = PagedDecodeParams::from_tensors(t, &copies);
  REQUIRE_FALSE(p.ok());
  CHECK(p.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(p.status().message(), Catch::Contains(text));
}

}  // namespace

TEST_CASE("paged decode: from tensors (i32 and i64 page tables) matches the raw-pointer call bit for bit",
          "[paged_decode][tensors]") {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed + 11);
  for (int trial = 0; trial < 4; ++trial) {
    const Shape s = random_shape(rng);
    const bool prefill = trial % 2 == 1;
    const bool i64 = trial >= 2;
    INFO("trial " << trial << " prefill " << prefill << " i64 " << i64);
    Problem pb = prefill ? make_problem(s, {300, 17, 0}, rng(), {20, 17, 0}) : make_problem(s, {300, 17, 0}, rng());
    const Result raw = run_cpu(pb);
    poison(pb);
    ProblemViews v(pb, i64);
    laminar::kernels::PagedDecodeIndexCopies copies;
    auto p = PagedDecodeParams::from_tensors(v.t, &copies);
    REQUIRE(p.ok());
    CHECK(p->max_kv_len == 300);  // the longest sequence, read from the host table
    CHECK(p->sm_scale == 1.0f / std::sqrt(float(s.head_dim)));
    CHECK(p->num_qo_heads == pb.qo_heads());
    CHECK((p->table.indices == pb.indices.data()) == !i64);
    p->cpu_threads = 2;
    REQUIRE(laminar::kernels::run(*p, Stream::host()).ok());
    require_same_bits(raw, Result{pb.out, pb.lse});
  }
}

TEST_CASE("paged decode: from tensors, each kind of mismatch is refused, naming the tensor",
          "[paged_decode][tensors]") {
  Shape s;
  s.dtype = DType::kBF16;
  s.head_dim = 64;
  s.num_kv_heads = 2;
  s.group = 2;
  s.page_size = 4;
  Problem pb = make_problem(s, {9, 3}, 5);
  std::vector<std::uint8_t> other(pb.q.size() * 2);
  {
    ProblemViews v(pb, false);
    REQUIRE(PagedDecodeParams::from_tensors(v.t).ok());
    // Without max_kv_len or sm_scale given, the defaults; given, they are kept.
    v.t.max_kv_len = 4096;
    v.t.sm_scale = 0.5f;
    auto p = PagedDecodeParams::from_tensors(v.t);
    REQUIRE(p.ok());
    CHECK(p->max_kv_len == 4096);
    CHECK(p->sm_scale == 0.5f);
  }
  {
    ProblemViews v(pb, false);
    v.t.out = dense(other.data(), s.dtype, {2, 4, 32});
    expect_refused(v.t, "paged_decode: out: shape [2, 4, 32] but q has [2, 4, 64]");
  }
  {
    ProblemViews v(pb, false);
    v.t.q = dense(other.data(), DType::kF16, {2, 4, 64});
    expect_refused(v.t, "paged_decode: q: dtype f16 but bf16 is needed");
  }
  {
    ProblemViews v(pb, false);
    v.t.q = dense(other.data(), s.dtype, {2, 4, 128});
    v.t.out = dense(pb.out.data(), s.dtype, {2, 4, 128});
    expect_refused(v.t, "paged_decode: q: shape [2, 4, 128] but k_pages gives dim 2 = 64");
  }
  {
    ProblemViews v(pb, false);
    v.t.lse = dense(other.data(), DType::kF32, {2, 3});
    expect_refused(v.t, "paged_decode: lse: shape [2, 3] but q gives dim 1 = 4");
  }
  {
    ProblemViews v(pb, false);
    v.t.v_pages = dense(pb.v.data(), s.dtype, {pb.num_pages - 1, 4, 2, 64});
    expect_refused(v.t, "paged_decode: v_pages: shape [");
  }
  {
    ProblemViews v(pb, false);
    const std::int64_t shape[3] = {2, 4, 64}, strides[3] = {4 * 64, 1, 4};
    v.t.q = TensorView::strided(pb.q.data(), s.dtype, shape, strides).value();
    expect_refused(v.t, "paged_decode: q: strides [256, 1, 4] of shape [2, 4, 64] are not dense");
  }
  {
    ProblemViews v(pb, false);
    v.t.indptr = dense(pb.indptr.data(), DType::kI32, {2});
    expect_refused(v.t, "paged_decode: indptr: shape [2] but last_page_len (batch + 1) gives dim 0 = 3");
  }
  {
    ProblemViews v(pb, false);
    v.t.indices = dense(pb.indices.data(), DType::kI32, {2});
    expect_refused(v.t, "paged_decode: indices: 2 entries but indptr[2] = 4");
  }
  {
    ProblemViews v(pb, false);
    v.t.last_page_len = dense(pb.last_page_len.data(), DType::kF32, {2});
    expect_refused(v.t, "paged_decode: last_page_len: dtype f32 but i32 (or i64 on the host) is needed");
  }
  {
    ProblemViews v(pb, true);
    v.indices64[1] = std::int64_t(1) << 33;
    expect_refused(v.t, "paged_decode: indices: [1] = 8589934592 does not fit int32");
    auto no_copies = PagedDecodeParams::from_tensors(v.t);
    REQUIRE_FALSE(no_copies.ok());
    CHECK_THAT(no_copies.status().message(), Catch::Contains("i64 indices need a buffer"));
  }
  {
    ProblemViews v(pb, false);
    v.t.q = dense(other.data(), s.dtype, {3, 4, 64});
    v.t.out = dense(pb.out.data(), s.dtype, {3, 4, 64});
    v.t.lse.reset();
    expect_refused(v.t, "paged_decode: q: 3 rows but last_page_len holds 2 sequences");
  }
  {
    ProblemViews v(pb, false);
    v.t.k_pages = dense(pb.k.data(), s.dtype, {pb.num_pages, 4, 2, 64}, laminar::Device::cuda(0));
    expect_refused(v.t, "paged_decode: k_pages: on cuda:0 but q is on cpu:0");
  }
  {
    // All on one device: i64 page tables are refused there (the kernel reads them in place), and
    // max_kv_len has to be given.
    const auto gpu = laminar::Device::cuda(0);
    ProblemViews v(pb, true);
    for (TensorView* t :
         {&v.t.q, &v.t.out, &v.t.k_pages, &v.t.v_pages, &v.t.indptr, &v.t.indices, &v.t.last_page_len}) {
      *t = dense(t->data(), t->dtype(), {t->shape().begin(), t->shape().end()}, gpu);
    }
    v.t.lse = dense(v.t.lse->data(), DType::kF32, {2, 4}, gpu);
    expect_refused(v.t, "paged_decode: last_page_len: i64 on a CUDA device");
    v.t.indptr = dense(pb.indptr.data(), DType::kI32, {3}, gpu);
    v.t.indices = dense(pb.indices.data(), DType::kI32, {4}, gpu);
    v.t.last_page_len = dense(pb.last_page_len.data(), DType::kI32, {2}, gpu);
    expect_refused(v.t, "max_kv_len must be given");
    v.t.max_kv_len = 9;
    auto p = PagedDecodeParams::from_tensors(v.t);
    REQUIRE(p.ok());
    // The workspace comes after: its size depends on the params.
    CHECK(laminar::kernels::workspace_bytes(*p) > 0);
    CHECK(laminar::kernels::can_implement(*p, Stream::cuda(nullptr)).code() == StatusCode::kInvalidArgument);
    std::vector<std::uint8_t> ws(laminar::kernels::workspace_bytes(*p));
    p->workspace = ws.data();
    p->workspace_bytes = ws.size();
    CHECK(laminar::kernels::can_implement(*p, Stream::cuda(nullptr)).ok());
  }
}

TEST_CASE("paged decode: from tensors, every tensor's wrong shape, dtype, stride and device is refused, naming it",
          "[paged_decode][tensors]") {
  Shape s;
  s.dtype = DType::kBF16;
  s.head_dim = 64;
  s.num_kv_heads = 2;
  s.group = 2;
  s.page_size = 4;
  // Prefill, so qo_indptr is among the tensors: 3 rows of sequence 0, 1 of sequence 1.
  Problem pb = make_problem(s, {9, 3}, 5, {3, 1});
  // Room for any of the tensors below at stride 2 or with one row more.
  std::vector<std::int64_t> scratch(pb.k.size() + pb.q.size() + 64);
  std::vector<std::uint8_t> workspace(1 << 16);
  struct Field {
    const char* name;
    TensorView& (*get)(PagedDecodeTensors&);
    DType wrong_dtype;
    const char* wrong_dtype_text;  // what the refusal says of the wrong dtype
    const char* longer_text;       // ... of dim 0 one larger (null: a longer one is fine)
  };
  const Field fields[] = {
      {"q", [](PagedDecodeTensors& t) -> TensorView& { return t.q; }, DType::kF16, "q: dtype f16 but bf16 is needed",
       "out: shape [4, 4, 64] but q has [5, 4, 64]"},
      {"out", [](PagedDecodeTensors& t) -> TensorView& { return t.out; }, DType::kF32, "out: dtype f32 but q is bf16",
       "out: shape [5, 4, 64] but q has [4, 4, 64]"},
      {"lse", [](PagedDecodeTensors& t) -> TensorView& { return *t.lse; }, DType::kBF16,
       "lse: dtype bf16 but f32 is needed", "lse: shape [5, 4] but q gives dim 0 = 4"},
      {"k_pages", [](PagedDecodeTensors& t) -> TensorView& { return t.k_pages; }, DType::kF16,
       "v_pages: dtype bf16 but k_pages is f16", "v_pages: shape [7, 4, 2, 64] but k_pages has [8, 4, 2, 64]"},
      {"v_pages", [](PagedDecodeTensors& t) -> TensorView& { return t.v_pages; }, DType::kF16,
       "v_pages: dtype f16 but k_pages is bf16", "v_pages: shape [8, 4, 2, 64] but k_pages has [7, 4, 2, 64]"},
      {"indptr", [](PagedDecodeTensors& t) -> TensorView& { return t.indptr; }, DType::kF32,
       "indptr: dtype f32 but i32 (or i64 on the host) is needed",
       "indptr: shape [4] but last_page_len (batch + 1) gives dim 0 = 3"},
      {"indices", [](PagedDecodeTensors& t) -> TensorView& { return t.indices; }, DType::kU8,
       "indices: dtype u8 but i32 (or i64 on the host) is needed", nullptr},
      {"last_page_len", [](PagedDecodeTensors& t) -> TensorView& { return t.last_page_len; }, DType::kF16,
       "last_page_len: dtype f16 but i32 (or i64 on the host) is needed",
       "indptr: shape [3] but last_page_len (batch + 1) gives dim 0 = 4"},
      {"qo_indptr", [](PagedDecodeTensors& t) -> TensorView& { return *t.qo_indptr; }, DType::kBF16,
       "qo_indptr: dtype bf16 but i32 (or i64 on the host) is needed",
       "qo_indptr: shape [4] but last_page_len (batch + 1) gives dim 0 = 3"},
  };
  ProblemViews good(pb, false);
  good.t.workspace = dense(workspace.data(), DType::kU8, {std::int64_t(workspace.size())});
  REQUIRE(PagedDecodeParams::from_tensors(good.t).ok());
  for (const Field& f : fields) {
    INFO("tensor " << f.name);
    const std::string at = std::string("paged_decode: ") + f.name;
    const TensorView& right = f.get(good.t);
    const std::vector<std::int64_t> shape(right.shape().begin(), right.shape().end());
    const auto refused_with = [&](const TensorView& replacement, const std::string& text) {
      ProblemViews v(pb, false);
      v.t.workspace = good.t.workspace;
      f.get(v.t) = replacement;
      expect_refused(v.t, text.c_str());
    };
    // One dimension more, then dim 0 one larger (for the pools: a page more than k_pages has).
    std::vector<std::int64_t> deeper = shape;
    deeper.push_back(1);
    refused_with(dense(scratch.data(), right.dtype(), deeper), at + ": shape [");
    if (f.longer_text != nullptr) {
      std::vector<std::int64_t> longer = shape;
      longer[0] += 1;
      refused_with(dense(scratch.data(), right.dtype(), longer), std::string("paged_decode: ") + f.longer_text);
    }
    refused_with(dense(scratch.data(), f.wrong_dtype, shape), std::string("paged_decode: ") + f.wrong_dtype_text);
    std::vector<std::int64_t> strides(shape.size());
    std::int64_t step = 2;
    for (std::size_t i = shape.size(); i-- > 0;) {
      strides[i] = step;
      step *= shape[i];
    }
    refused_with(TensorView::strided(scratch.data(), right.dtype(), shape, strides).value(),
                 at + ": strides [" + std::to_string(strides[0]));
    const std::string first = std::string(f.name) == "q" ? "out: on cpu:0 but q is on cuda:0" : ": on cuda:0 but q";
    refused_with(dense(scratch.data(), right.dtype(), shape, laminar::Device::cuda(0)),
                 std::string(f.name) == "q" ? "paged_decode: " + first : at + first);
  }
  // A page table shorter than its indptr says, and a workspace that is not dense or on another device.
  {
    ProblemViews v(pb, false);
    v.t.indices = dense(pb.indices.data(), DType::kI32, {std::int64_t(pb.indices.size()) - 1});
    expect_refused(v.t, "paged_decode: indices: 3 entries but indptr[2] = 4");
  }
  {
    ProblemViews v(pb, false);
    const std::int64_t shape[1] = {64}, strides[1] = {2};
    v.t.workspace = TensorView::strided(workspace.data(), DType::kU8, shape, strides).value();
    expect_refused(v.t, "paged_decode: workspace: strides [2] of shape [64] are not dense");
    v.t.workspace = dense(workspace.data(), DType::kU8, {64}, laminar::Device::cuda(0));
    expect_refused(v.t, "paged_decode: workspace: on cuda:0 but q is on cpu:0");
  }
}
