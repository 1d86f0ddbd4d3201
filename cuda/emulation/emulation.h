// emulation.h: runs CUDA kernel source on the CPU with CUDA's execution model, for tests.
//
// There is no GPU on the build machines, yet a wrong index or a missing __syncthreads in a kernel
// must fail CI. So the same .cuh that nvcc compiles for sm_80/sm_90a is also compiled by the host
// compiler against this header and run by a small harness:
//   - every CUDA thread of a block is a fiber (makecontext/swapcontext) with its own stack and its
//     own threadIdx; blockIdx/blockDim/gridDim are set per block; blocks run one after another in
//     a shuffled order;
//   - __syncthreads() parks the fiber until every thread of the block has arrived (a thread that
//     returned before a barrier its block mates wait at is reported as an error, not skipped);
//   - warp shuffles, votes and __syncwarp wait for all lanes named in the mask (only those: the
//     other warps run on), exchanging values through per-warp slots; lanes that meet at different
//     collectives are reported;
//   - shared memory is one arena per block, refilled with 0xff bytes (float NaN, int -1) before
//     each block, so reading what no thread wrote shows up;
//   - the next fiber to run is drawn from a seeded RNG each time one parks, so a missing barrier
//     makes readers run before writers. Failures name the seed to replay.
//
// Writing a kernel that works under both (see cuda/paged_decode.cuh):
//   1. include "kernel_compat.cuh" and wrap __global__ functions in `#if LAMINAR_KERNELS`;
//   2. reach shared memory only through LAMINAR_DYNAMIC_SHARED(name) (dynamic, sized at launch) or
//      LAMINAR_SHARED(type, name): a plain function-local `__shared__` array would be private to
//      each fiber on the host;
//   3. use the *_sync warp intrinsics with an explicit mask, __syncthreads, and math from
//      laminar/internal/numerics.h (no __expf-style intrinsics: the host has none);
//   4. keep device-only code (vector loads, __ldg) behind `#if defined(__CUDA_ARCH__)` with a host
//      twin that does the same arithmetic.
// A test then includes this header first, the .cuh second, and launches:
//
//   #include "emulation/emulation.h"
//   #include "my_kernel.cuh"
//   laminar::Status st = laminar::emu::launch({grid}, {128}, smem_bytes, seed, my_kernel<float>,
//                                             args...);
//
// Not modelled: memory-model races inside one barrier interval other than through ordering, timing,
// occupancy, and grid-wide synchronisation. Kernels in one launch see each other's blocks' writes
// only in the shuffled block order, as on a GPU where the order is unknown too.
#pragma once

#if defined(__CUDACC__)
#error "cuda/emulation/emulation.h is for host compilers; nvcc builds the kernels natively"
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#include "laminar/status.h"

#define LAMINAR_CUDA_EMULATION 1

namespace laminar::emu {

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};

inline constexpr int kWarpSize = 32;

// What a running fiber sees as threadIdx, blockIdx, blockDim, gridDim.
struct ThreadCoords {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};

// The coordinates of the fiber now running. Only valid inside a kernel run by launch().
const ThreadCoords& coords();

// Block-wide barrier (__syncthreads).
void sync_block();
// Every lane in `mask` publishes `value` and gets the value of the lane src_of(own lane) returns
// (its own when that lane is outside the mask or the segment). kind names the intrinsic in errors.
std::uint64_t warp_exchange(const char* kind, unsigned mask, std::uint64_t value, int src_lane);
// Ballot over the lanes in mask (__ballot_sync); also the base of __any_sync / __all_sync.
unsigned warp_ballot(const char* kind, unsigned mask, bool predicate);
// __syncwarp(mask).
void sync_warp(unsigned mask);
// This block's dynamic shared memory (the size given to launch()).
unsigned char* dynamic_shared();
// This block's instance of the LAMINAR_SHARED variable identified by key (allocated on first use
// in the block, then the same address for every thread of the block).
void* static_shared(const void* key, std::size_t size, std::size_t align);
// Ends the launch with an error (a kernel-side assertion); does not return.
[[noreturn]] void fail(const char* message);

// Runs body once per thread of grid x block, as CUDA would run a kernel. Returns the first error:
// a deadlock (threads waiting at different barriers), a barrier some threads skipped by returning,
// a misused intrinsic, or fail(). Blocks run sequentially on the calling thread.
Status launch_body(dim3 grid, dim3 block, std::size_t dynamic_shared_bytes, std::uint64_t seed,
                   const std::function<void()>& body);

// Typed front end: launch(grid, block, smem, seed, kernel, args...) like kernel<<<grid, block, smem>>>.
template <class... Params, class... Args>
Status launch(dim3 grid, dim3 block, std::size_t dynamic_shared_bytes, std::uint64_t seed,
              void (*kernel)(Params...), Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "kernel argument count mismatch");
  return launch_body(grid, block, dynamic_shared_bytes, seed, [&] { kernel(Params(args)...); });
}

// The seed tests should use: $LAMINAR_EMU_SEED when set, else a fresh random one. Printed to
// stderr the first time, so a failing run can be replayed.
std::uint64_t test_seed();

template <class T>
std::uint64_t to_slot(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a type wider than 8 bytes");
  std::uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}

template <class T>
T from_slot(std::uint64_t u) {
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

inline unsigned lane_id() {
  const ThreadCoords& c = coords();
  const unsigned tid = c.thread_idx.x + c.block_dim.x * (c.thread_idx.y + c.block_dim.y * c.thread_idx.z);
  return tid % kWarpSize;
}

// Index of the source lane for a shuffle within segments of `width` lanes.
inline int segment_base(int width) { return int(lane_id()) & ~(width - 1); }

}  // namespace laminar::emu

// ---- CUDA spellings on the host ----
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

#define threadIdx (::laminar::emu::coords().thread_idx)
#define blockIdx (::laminar::emu::coords().block_idx)
#define blockDim (::laminar::emu::coords().block_dim)
#define gridDim (::laminar::emu::coords().grid_dim)

using ::laminar::emu::dim3;

#define LAMINAR_DYNAMIC_SHARED(name) unsigned char* name = ::laminar::emu::dynamic_shared()
#define LAMINAR_SHARED(type, name)                                                               \
  static const char name##_laminar_shared_key = 0;                                               \
  std::add_lvalue_reference_t<type> name = *static_cast<std::add_pointer_t<type>>(               \
      ::laminar::emu::static_shared(&name##_laminar_shared_key, sizeof(type), alignof(type)))

inline void __syncthreads() { ::laminar::emu::sync_block(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::laminar::emu::sync_warp(mask); }
inline void __threadfence() {}
inline void __threadfence_block() {}

template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  using namespace ::laminar::emu;
  const int src = segment_base(width) + (src_lane % width);
  return from_slot<T>(warp_exchange("__shfl_sync", mask, to_slot(v), src));
}

template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  using namespace ::laminar::emu;
  const int lane = int(lane_id());
  int src = lane ^ lane_mask;
  if (src < segment_base(width) || src >= segment_base(width) + width) src = lane;
  return from_slot<T>(warp_exchange("__shfl_xor_sync", mask, to_slot(v), src));
}

template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  using namespace ::laminar::emu;
  const int lane = int(lane_id());
  const int src = (lane - segment_base(width)) + int(delta) < width ? lane + int(delta) : lane;
  return from_slot<T>(warp_exchange("__shfl_down_sync", mask, to_slot(v), src));
}

template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  using namespace ::laminar::emu;
  const int lane = int(lane_id());
  const int src = (lane - segment_base(width)) >= int(delta) ? lane - int(delta) : lane;
  return from_slot<T>(warp_exchange("__shfl_up_sync", mask, to_slot(v), src));
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return ::laminar::emu::warp_ballot("__ballot_sync", mask, predicate != 0);
}
inline int __any_sync(unsigned mask, int predicate) {
  return ::laminar::emu::warp_ballot("__any_sync", mask, predicate != 0) != 0;
}
inline int __all_sync(unsigned mask, int predicate) {
  return ::laminar::emu::warp_ballot("__all_sync", mask, predicate != 0) == mask;
}

// Fibers of a launch never run at the same time, so plain read-modify-write is atomic here.
template <class T>
T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}
template <class T>
T atomicMax(T* p, T v) {
  const T old = *p;
  if (v > old) *p = v;
  return old;
}
template <class T>
T atomicCAS(T* p, T compare, T v) {
  const T old = *p;
  if (old == compare) *p = v;
  return old;
}
template <class T>
T __ldg(const T* p) {
  return *p;
}

#include "../kernel_compat.cuh"
