// The CUDA execution harness (cuda/emulation): blocks, threads, barriers, warp collectives and shared
// memory behave as on a GPU, and kernels with a missing or divergent barrier fail.
#include "emulation/emulation.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace {

constexpr unsigned kFull = 0xffffffffu;

unsigned tid() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }

// Each thread publishes a value in shared memory; after the barrier every thread reads its
// neighbour's. Without the barrier a thread that runs before its neighbour reads the 0xff fill.
template <bool kWithBarrier>
__global__ void rotate_kernel(const int* in, int* out, int n) {
  LAMINAR_DYNAMIC_SHARED(smem);
  int* s = reinterpret_cast<int*>(smem);
  const int t = int(threadIdx.x);
  const int base = int(blockIdx.x) * n;
  s[t] = in[base + t];
  if constexpr (kWithBarrier) __syncthreads();
  out[base + t] = s[(t + 1) % n];
}

// Shared-memory tree reduction, the classic place where a barrier goes missing.
template <bool kWithBarrier>
__global__ void tree_sum_kernel(const int* in, int* out) {
  LAMINAR_SHARED(int[256], s);
  const unsigned t = threadIdx.x;
  s[t] = in[blockIdx.x * blockDim.x + t];
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (t < stride) s[t] += s[t + stride];
    if constexpr (kWithBarrier) __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = s[0];
}

// Warp 0 fills shared memory and warp 1 sums it, each after a shuffle of its own. A shuffle orders
// nothing between warps: without the barrier warp 1 may read before warp 0 has written.
template <bool kWithBarrier>
__global__ void cross_warp_kernel(const int* in, int* out) {
  LAMINAR_SHARED(int[32], s);
  const unsigned t = threadIdx.x, lane = t % 32;
  if (t < 32) s[lane] = in[lane];
  if constexpr (kWithBarrier) __syncthreads();
  const int partner = __shfl_xor_sync(kFull, int(lane), 1);
  if (t >= 32) {
    int sum = 0;
    for (int i = 0; i < 32; ++i) sum += s[i];
    out[lane] = sum + (partner ^ 1) - int(lane);
  }
}

__global__ void warp_ops_kernel(const int* in, int* out) {
  const unsigned t = tid();
  const unsigned lane = t % 32;
  int v = in[t];
  int sum = v;
  for (int m = 16; m > 0; m /= 2) sum += __shfl_xor_sync(kFull, sum, m);
  const int down = __shfl_down_sync(kFull, v, 3);
  const int up = __shfl_up_sync(kFull, v, 5);
  const int bcast = __shfl_sync(kFull, v, 7);
  const int seg = __shfl_xor_sync(kFull, v, 1, 8);
  const unsigned ballot = __ballot_sync(kFull, v % 3 == 0);
  const int any = __any_sync(kFull, v == 1000);
  const int all = __all_sync(kFull, v >= 0);
  __syncwarp();
  int* o = out + t * 8;
  o[0] = sum;
  o[1] = down;
  o[2] = up;
  o[3] = bcast;
  o[4] = seg;
  o[5] = int(ballot);
  o[6] = any;
  o[7] = all;
  (void)lane;
}

__global__ void coords_kernel(unsigned* out) {
  const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned threads = blockDim.x * blockDim.y * blockDim.z;
  atomicAdd(&out[block * threads + tid()], 1u);
}

__global__ void divergent_barrier_kernel(int* out) {
  if (threadIdx.x < 16) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void mixed_collectives_kernel(int* out) {
  int v = int(threadIdx.x);
  if (threadIdx.x % 2 == 0) {
    v = __shfl_xor_sync(kFull, v, 1);
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = v;
}

__global__ void failing_kernel(int n) {
  if (int(threadIdx.x) == n) laminar::emu::fail("thread reported a bad input");
}

std::vector<int> random_ints(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int> v(n);
  for (auto& x : v) x = int(rng() % 1000);
  return v;
}

}  // namespace

TEST_CASE("cuda emulation: emulated blocks see their own threads and a correct barrier", "[cuda_emulation]") {
  const std::uint64_t seed = laminar::emu::test_seed();
  const int n = 96, blocks = 5;
  const auto in = random_ints(std::size_t(n * blocks), seed);
  std::vector<int> out(in.size(), 0);
  const laminar::Status st =
      laminar::emu::launch(dim3(blocks), dim3(n), n * sizeof(int), seed, rotate_kernel<true>, in.data(), out.data(), n);
  REQUIRE(st.ok());
  for (int b = 0; b < blocks; ++b) {
    for (int t = 0; t < n; ++t) REQUIRE(out[b * n + t] == in[b * n + (t + 1) % n]);
  }
}

TEST_CASE("cuda emulation: a removed barrier is caught", "[cuda_emulation]") {
  const std::uint64_t seed = laminar::emu::test_seed();
  const int n = 96;
  const auto in = random_ints(n, seed);
  std::vector<int> out(n, 0);
  REQUIRE(laminar::emu::launch(dim3(1), dim3(n), n * sizeof(int), seed, rotate_kernel<false>, in.data(), out.data(), n).ok());
  int wrong = 0;
  for (int t = 0; t < n; ++t) wrong += out[t] != in[(t + 1) % n];
  CHECK(wrong > 0);

  // The tree reduction without its loop barrier, over several seeds: every one must be wrong.
  const auto vals = random_ints(256, seed + 1);
  const int expect = std::accumulate(vals.begin(), vals.end(), 0);
  int good_sum = 0;
  REQUIRE(laminar::emu::launch(dim3(1), dim3(256), 0, seed, tree_sum_kernel<true>, vals.data(), &good_sum).ok());
  CHECK(good_sum == expect);
  for (std::uint64_t s = seed; s < seed + 5; ++s) {
    int bad_sum = 0;
    REQUIRE(laminar::emu::launch(dim3(1), dim3(256), 0, s, tree_sum_kernel<false>, vals.data(), &bad_sum).ok());
    INFO("seed " << s);
    CHECK(bad_sum != expect);
  }
}

TEST_CASE("cuda emulation: a barrier missing between warps is caught although each warp meets at a shuffle", "[cuda_emulation]") {
  const std::uint64_t seed = laminar::emu::test_seed();
  const auto in = random_ints(32, seed);
  const int expect = std::accumulate(in.begin(), in.end(), 0);
  std::vector<int> out(32, 0);
  REQUIRE(laminar::emu::launch(dim3(1), dim3(64), 0, seed, cross_warp_kernel<true>, in.data(), out.data()).ok());
  for (int x : out) REQUIRE(x == expect);
  // Warp 1 passes its shuffle as soon as its own 32 lanes have run once. In about half the
  // schedules (the last lane to run for the first time is one of warp 0's) warp 0 has not written
  // everything by then; with the shuffle as a block-wide wait no schedule would show it.
  int caught = 0;
  for (std::uint64_t s = seed; s < seed + 20; ++s) {
    REQUIRE(laminar::emu::launch(dim3(1), dim3(64), 0, s, cross_warp_kernel<false>, in.data(), out.data()).ok());
    caught += std::any_of(out.begin(), out.end(), [&](int x) { return x != expect; });
  }
  INFO(caught << " of 20 seeds caught it");
  CHECK(caught > 0);
}

TEST_CASE("cuda emulation: emulated warp shuffles and votes follow CUDA's definitions", "[cuda_emulation]") {
  const std::uint64_t seed = laminar::emu::test_seed();
  const int n = 64;
  auto in = random_ints(n, seed);
  in[5] = 1000;  // lane 5 of warp 0 makes __any_sync true there only
  std::vector<int> out(std::size_t(n) * 8, -1);
  REQUIRE(laminar::emu::launch(dim3(1), dim3(n), 0, seed, warp_ops_kernel, in.data(), out.data()).ok());
  for (int t = 0; t < n; ++t) {
    const int w = t / 32 * 32, lane = t % 32;
    int sum = 0;
    unsigned ballot = 0;
    bool any = false;
    for (int i = 0; i < 32; ++i) {
      sum += in[w + i];
      if (in[w + i] % 3 == 0) ballot |= 1u << i;
      any = any || in[w + i] == 1000;
    }
    const int* o = &out[std::size_t(t) * 8];
    INFO("thread " << t);
    CHECK(o[0] == sum);
    CHECK(o[1] == (lane + 3 < 32 ? in[t + 3] : in[t]));
    CHECK(o[2] == (lane >= 5 ? in[t - 5] : in[t]));
    CHECK(o[3] == in[w + 7]);
    CHECK(o[4] == in[t ^ 1]);
    CHECK(unsigned(o[5]) == ballot);
    CHECK(o[6] == int(any));
    CHECK(o[7] == 1);
  }
}

TEST_CASE("cuda emulation: every thread of a 3-D grid of 3-D blocks runs exactly once", "[cuda_emulation]") {
  const dim3 grid(3, 2, 2), block(8, 4, 2);
  std::vector<unsigned> out(3 * 2 * 2 * 8 * 4 * 2, 0);
  REQUIRE(laminar::emu::launch(grid, block, 0, laminar::emu::test_seed(), coords_kernel, out.data()).ok());
  for (unsigned x : out) REQUIRE(x == 1u);
}

TEST_CASE("cuda emulation: broken synchronisation is reported, not run", "[cuda_emulation]") {
  std::vector<int> out(64, 0);
  const std::uint64_t seed = laminar::emu::test_seed();
  laminar::Status st = laminar::emu::launch(dim3(1), dim3(64), 0, seed, divergent_barrier_kernel, out.data());
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().find("__syncthreads reached by 48 of 64") != std::string::npos);
  st = laminar::emu::launch(dim3(1), dim3(64), 0, seed, mixed_collectives_kernel, out.data());
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().find("__shfl_xor_sync") != std::string::npos);
  st = laminar::emu::launch(dim3(2), dim3(32), 0, seed, failing_kernel, 7);
  REQUIRE_FALSE(st.ok());
  CHECK(st.message().find("thread (7,0,0): thread reported a bad input") != std::string::npos);
  CHECK(st.message().find("seed " + std::to_string(seed)) != std::string::npos);
  // The harness is usable again after a failed launch.
  const auto in = random_ints(32, seed);
  std::vector<int> rot(32, 0);
  REQUIRE(laminar::emu::launch(dim3(1), dim3(32), 32 * sizeof(int), seed, rotate_kernel<true>, in.data(), rot.data(), 32).ok());
  CHECK(rot[0] == in[1]);
}

TEST_CASE("cuda emulation: launch rejects impossible configurations", "[cuda_emulation]") {
  const std::uint64_t seed = laminar::emu::test_seed();
  CHECK(laminar::emu::launch(dim3(1), dim3(2048), 0, seed, failing_kernel, 0).code() ==
        laminar::StatusCode::kInvalidArgument);
  CHECK(laminar::emu::launch(dim3(1), dim3(0), 0, seed, failing_kernel, 0).code() ==
        laminar::StatusCode::kInvalidArgument);
  CHECK(laminar::emu::launch(dim3(1), dim3(32), 300 * 1024, seed, failing_kernel, 0).code() ==
        laminar::StatusCode::kInvalidArgument);
  CHECK(laminar::emu::launch(dim3(0), dim3(32), 0, seed, failing_kernel, 0).ok());
}
