// The fiber scheduler behind emulation.h. One Launch object per launch_body() call; the running
// fiber and launch are thread_local so independent threads may emulate independent launches.
#include "emulation.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define LAMINAR_EMU_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define LAMINAR_EMU_TSAN 1
#endif

namespace laminar::emu {
namespace {

#if defined(LAMINAR_EMU_ASAN)
constexpr std::size_t kStackBytes = std::size_t(1) << 20;  // ASan redzones make frames larger
#else
constexpr std::size_t kStackBytes = std::size_t(256) << 10;
#endif

// An mmap'd fiber stack with an inaccessible guard page below it, so an overflow faults at once.
class FiberStack {
 public:
  FiberStack() {
    page_ = std::size_t(sysconf(_SC_PAGESIZE));
    void* p = mmap(nullptr, kStackBytes + page_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      std::fprintf(stderr, "cuda emulation: cannot map a %zu byte fiber stack\n", kStackBytes);
      std::abort();
    }
    base_ = static_cast<char*>(p);
    mprotect(base_, page_, PROT_NONE);
  }
  FiberStack(const FiberStack&) = delete;
  FiberStack& operator=(const FiberStack&) = delete;
  ~FiberStack() {
#if defined(LAMINAR_EMU_TSAN)
    if (tsan_fiber != nullptr) __tsan_destroy_fiber(tsan_fiber);
#endif
    munmap(base_, kStackBytes + page_);
  }
  char* bottom() const { return base_ + page_; }
  std::size_t size() const { return kStackBytes; }
  // The fiber last run on this stack never returned (its launch failed), so ASan redzones of its
  // frames may still be poisoned here.
  bool dirty = false;
  // TSan's state for the fibers run on this stack, created once: creating one per block and thread
  // dominated emulation time under TSan.
  void* tsan_fiber = nullptr;

 private:
  char* base_ = nullptr;
  std::size_t page_ = 0;
};

enum class Wait : std::uint8_t { kNone, kBlock, kWarp, kDone };

struct Launch;

struct Fiber {
  ucontext_t ctx{};
  FiberStack* stack = nullptr;
  ThreadCoords coords;
  unsigned linear = 0;
  Wait wait = Wait::kNone;
  // What the fiber waits for at a warp collective.
  const char* warp_kind = nullptr;
  unsigned warp_mask = 0;
  int src_lane = 0;
  std::uint64_t result = 0;
  void* asan_fake_stack = nullptr;
  void* tsan_fiber = nullptr;
};

struct Warp {
  std::uint64_t slots[2][kWarpSize] = {};
  unsigned generation = 0;
};

struct Launch {
  const std::function<void()>* body = nullptr;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::vector<unsigned char> dynamic_shared;
  std::map<const void*, std::unique_ptr<unsigned char[]>> static_shared;
  std::size_t static_shared_bytes = 0;
  ucontext_t scheduler{};
  Fiber* running = nullptr;
  std::string error;
  const void* sched_stack_bottom = nullptr;
  std::size_t sched_stack_size = 0;
  void* sched_fake_stack = nullptr;
  void* sched_tsan_fiber = nullptr;
};

thread_local Launch* g_launch = nullptr;
// Stacks are kept between launches on this thread: mapping 128 of them per launch would dominate.
thread_local std::vector<std::unique_ptr<FiberStack>> g_stacks;

// ---- switching, with the sanitizer annotations swapcontext needs ----

void switch_to_fiber(Launch& l, Fiber& f) {
  l.running = &f;
#if defined(LAMINAR_EMU_ASAN)
  __sanitizer_start_switch_fiber(&l.sched_fake_stack, f.stack->bottom(), f.stack->size());
#endif
#if defined(LAMINAR_EMU_TSAN)
  __tsan_switch_to_fiber(f.tsan_fiber, 0);
#endif
  swapcontext(&l.scheduler, &f.ctx);
#if defined(LAMINAR_EMU_ASAN)
  __sanitizer_finish_switch_fiber(l.sched_fake_stack, nullptr, nullptr);
#endif
  l.running = nullptr;
}

// From the running fiber back to the scheduler; returns when the scheduler resumes it.
// `final` is true for a fiber that will never run again.
void switch_to_scheduler(Launch& l, bool final) {
  Fiber& f = *l.running;
#if defined(LAMINAR_EMU_ASAN)
  __sanitizer_start_switch_fiber(final ? nullptr : &f.asan_fake_stack, l.sched_stack_bottom,
                                 l.sched_stack_size);
#else
  (void)final;
#endif
#if defined(LAMINAR_EMU_TSAN)
  __tsan_switch_to_fiber(l.sched_tsan_fiber, 0);
#endif
  swapcontext(&f.ctx, &l.scheduler);
#if defined(LAMINAR_EMU_ASAN)
  __sanitizer_finish_switch_fiber(f.asan_fake_stack, &l.sched_stack_bottom, &l.sched_stack_size);
#endif
}

void fiber_entry() {
  Launch& l = *g_launch;
#if defined(LAMINAR_EMU_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &l.sched_stack_bottom, &l.sched_stack_size);
#endif
  (*l.body)();
  l.running->wait = Wait::kDone;
  l.running->stack->dirty = false;
  switch_to_scheduler(l, true);
  std::abort();  // a finished fiber is never resumed
}

Launch& current_launch(const char* what) {
  if (g_launch == nullptr || g_launch->running == nullptr) {
    std::fprintf(stderr, "cuda emulation: %s called outside a kernel run by laminar::emu::launch\n", what);
    std::abort();
  }
  return *g_launch;
}

unsigned warp_of(const Fiber& f) { return f.linear / kWarpSize; }

// Parks the running fiber until the scheduler releases it. If the launch failed meanwhile the fiber
// is simply never resumed.
void park(Launch& l, Wait w) {
  l.running->wait = w;
  switch_to_scheduler(l, false);
}

std::string where(const Fiber& f) {
  const auto& c = f.coords;
  return "block (" + std::to_string(c.block_idx.x) + "," + std::to_string(c.block_idx.y) + "," +
         std::to_string(c.block_idx.z) + ") thread (" + std::to_string(c.thread_idx.x) + "," +
         std::to_string(c.thread_idx.y) + "," + std::to_string(c.thread_idx.z) + ")";
}

// Releases warp w's collective as soon as every lane its mask names waits at it, while the other
// warps keep running: a warp does not wait for its block at a shuffle, so a barrier missing
// between warps is not hidden by one. Appends the released lanes to `ready`. Returns false with
// l.error set when lanes of the warp meet at different collectives or the mask names a lane that
// has returned.
bool release_warp(Launch& l, unsigned w, std::vector<Fiber*>& ready) {
  const unsigned n = unsigned(l.fibers.size());
  const unsigned first = w * kWarpSize;
  const unsigned last = std::min(n, first + kWarpSize);
  Fiber* leader = nullptr;
  for (unsigned i = first; i < last; ++i) {
    if (l.fibers[i].wait == Wait::kWarp) {
      leader = &l.fibers[i];
      break;
    }
  }
  if (leader == nullptr) return true;
  const unsigned mask = leader->warp_mask;
  bool complete = true;
  for (unsigned i = first; i < last; ++i) {
    const Fiber& f = l.fibers[i];
    const bool in_mask = (mask >> (i - first)) & 1u;
    if (!in_mask) continue;
    if (f.wait == Wait::kDone) {
      l.error = std::string(leader->warp_kind) + " at " + where(*leader) + " names lane " +
                std::to_string(i - first) + " in its mask, which has already returned";
      return false;
    }
    if (f.wait != Wait::kWarp) {
      complete = false;
      continue;
    }
    if (f.warp_mask != mask || std::strcmp(f.warp_kind, leader->warp_kind) != 0) {
      l.error = "lanes of one warp meet at different collectives: " + std::string(leader->warp_kind) +
                " (mask " + std::to_string(mask) + ") at " + where(*leader) + " vs " + f.warp_kind +
                " (mask " + std::to_string(f.warp_mask) + ") at " + where(f);
      return false;
    }
  }
  if (last - first < unsigned(kWarpSize) && (mask >> (last - first)) != 0) {
    l.error = std::string(leader->warp_kind) + " mask names lanes beyond the block's last warp";
    return false;
  }
  if (!complete) return true;
  Warp& warp = l.warps[w];
  const unsigned slot = warp.generation & 1u;
  for (unsigned i = first; i < last; ++i) {
    Fiber& f = l.fibers[i];
    if (!((mask >> (i - first)) & 1u)) continue;
    const int src = f.src_lane;
    const bool src_ok = src >= 0 && src < int(last - first) && ((mask >> src) & 1u);
    f.result = src_ok ? warp.slots[slot][src] : warp.slots[slot][i - first];
    f.wait = Wait::kNone;
    ready.push_back(&f);
  }
  ++warp.generation;
  return true;
}

// All fibers are parked and no warp collective is complete: release the block barrier, or report
// why nothing can go on. Returns the fibers to run next (empty with l.error set on failure, empty
// without error when every fiber is done).
std::vector<Fiber*> release(Launch& l) {
  std::vector<Fiber*> ready;
  const unsigned n = unsigned(l.fibers.size());
  // Block barrier: every fiber must be there.
  unsigned at_barrier = 0, done = 0;
  const Fiber* waiting = nullptr;
  const Fiber* returned = nullptr;
  const Fiber* at_warp = nullptr;
  for (const Fiber& f : l.fibers) {
    if (f.wait == Wait::kBlock) {
      ++at_barrier;
      waiting = &f;
    } else if (f.wait == Wait::kDone) {
      ++done;
      returned = &f;
    } else if (f.wait == Wait::kWarp) {
      at_warp = &f;
    }
  }
  if (done == n) return {};
  if (at_barrier == n) {
    for (Fiber& f : l.fibers) {
      f.wait = Wait::kNone;
      ready.push_back(&f);
    }
    return ready;
  }
  if (at_warp != nullptr) {
    l.error = std::string("deadlock: ") + at_warp->warp_kind + " at " + where(*at_warp) +
              " waits for lanes that are elsewhere (at __syncthreads or returned)";
  } else if (waiting != nullptr && returned != nullptr) {
    l.error = "__syncthreads reached by " + std::to_string(at_barrier) + " of " + std::to_string(n) +
              " threads: " + where(*returned) + " returned without reaching it (barrier in divergent code)";
  } else {
    l.error = "deadlock: no thread can make progress";
  }
  return {};
}

// Out of line: getcontext returns twice, which would make the caller's locals "clobbered".
[[gnu::noinline]] void init_context(Fiber& f) {
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = f.stack->bottom();
  f.ctx.uc_stack.ss_size = f.stack->size();
  f.ctx.uc_link = nullptr;
  makecontext(&f.ctx, fiber_entry, 0);
}

std::string describe_launch(dim3 g, dim3 b, std::uint64_t seed) {
  return "grid (" + std::to_string(g.x) + "," + std::to_string(g.y) + "," + std::to_string(g.z) + ") block (" +
         std::to_string(b.x) + "," + std::to_string(b.y) + "," + std::to_string(b.z) +
         ") seed " + std::to_string(seed);
}

}  // namespace

const ThreadCoords& coords() { return current_launch("threadIdx/blockIdx").running->coords; }

void sync_block() { park(current_launch("__syncthreads"), Wait::kBlock); }

std::uint64_t warp_exchange(const char* kind, unsigned mask, std::uint64_t value, int src_lane) {
  Launch& l = current_launch(kind);
  Fiber& f = *l.running;
  const unsigned lane = f.linear % kWarpSize;
  if (!((mask >> lane) & 1u)) fail((std::string(kind) + ": the calling lane is not in its own mask").c_str());
  Warp& w = l.warps[warp_of(f)];
  // Double-buffered slots: a lane that runs ahead to the next collective writes the other half,
  // and cannot pass that one before every lane has read this one.
  w.slots[w.generation & 1u][lane] = value;
  f.warp_kind = kind;
  f.warp_mask = mask;
  f.src_lane = src_lane;
  park(l, Wait::kWarp);
  return f.result;
}

unsigned warp_ballot(const char* kind, unsigned mask, bool predicate) {
  // Right after the release no lane can have written this generation's half again (see
  // warp_exchange), so every lane may read all of it.
  Launch& l = current_launch(kind);
  Fiber& f = *l.running;
  Warp& w = l.warps[warp_of(f)];
  const unsigned slot = w.generation & 1u;
  warp_exchange(kind, mask, predicate ? 1u : 0u, int(f.linear % kWarpSize));
  unsigned bits = 0;
  for (unsigned i = 0; i < unsigned(kWarpSize); ++i) {
    if (((mask >> i) & 1u) && w.slots[slot][i] != 0) bits |= 1u << i;
  }
  return bits;
}

void sync_warp(unsigned mask) { (void)warp_exchange("__syncwarp", mask, 0, 0); }

unsigned char* dynamic_shared() {
  Launch& l = current_launch("dynamic shared memory");
  return l.dynamic_shared.data();
}

void* static_shared(const void* key, std::size_t size, std::size_t align) {
  Launch& l = current_launch("LAMINAR_SHARED");
  auto it = l.static_shared.find(key);
  if (it == l.static_shared.end()) {
    constexpr std::size_t kMaxStaticShared = 48 * 1024;  // CUDA's static shared-memory limit
    l.static_shared_bytes += size;
    if (l.static_shared_bytes > kMaxStaticShared) fail("static shared memory exceeds 48 KiB");
    auto mem = std::make_unique<unsigned char[]>(size + align);
    std::memset(mem.get(), 0xff, size + align);
    it = l.static_shared.emplace(key, std::move(mem)).first;
  }
  const auto raw = reinterpret_cast<std::uintptr_t>(it->second.get());
  return reinterpret_cast<void*>((raw + align - 1) / align * align);
}

void fail(const char* message) {
  Launch& l = current_launch("fail");
  if (l.error.empty()) l.error = std::string("kernel failed at ") + where(*l.running) + ": " + message;
  l.running->wait = Wait::kDone;
  switch_to_scheduler(l, true);
  std::abort();  // never resumed
}

Status launch_body(dim3 grid, dim3 block, std::size_t dynamic_shared_bytes, std::uint64_t seed,
                   const std::function<void()>& body) {
  const std::uint64_t threads = std::uint64_t(block.x) * block.y * block.z;
  const std::uint64_t blocks = std::uint64_t(grid.x) * grid.y * grid.z;
  if (threads == 0 || threads > 1024) {
    return invalid_argument("cuda emulation: " + std::to_string(threads) + " threads per block (1..1024)");
  }
  if (block.z > 64 || grid.y > 65535 || grid.z > 65535) {
    return invalid_argument("cuda emulation: launch dimensions beyond CUDA's limits: " +
                            describe_launch(grid, block, seed));
  }
  if (dynamic_shared_bytes > 227 * 1024) {
    return invalid_argument("cuda emulation: " + std::to_string(dynamic_shared_bytes) +
                            " bytes of dynamic shared memory (sm_90 allows 227 KiB)");
  }
  if (g_launch != nullptr) return failed_precondition("cuda emulation: launch from inside a kernel");
  if (blocks == 0) return ok_status();

  Launch l;
  l.body = &body;
  l.fibers.resize(threads);
  l.warps.resize((threads + kWarpSize - 1) / kWarpSize);
  while (g_stacks.size() < threads) g_stacks.push_back(std::make_unique<FiberStack>());
  for (std::size_t i = 0; i < threads; ++i) l.fibers[i].stack = g_stacks[i].get();
#if defined(LAMINAR_EMU_TSAN)
  l.sched_tsan_fiber = __tsan_get_current_fiber();
#endif
  g_launch = &l;

  std::vector<std::uint64_t> order(blocks);
  for (std::uint64_t i = 0; i < blocks; ++i) order[i] = i;
  std::mt19937_64 rng(seed);
  std::shuffle(order.begin(), order.end(), rng);

  for (std::uint64_t b : order) {
    const uint3 bidx{unsigned(b % grid.x), unsigned((b / grid.x) % grid.y), unsigned(b / (std::uint64_t(grid.x) * grid.y))};
    l.dynamic_shared.assign(dynamic_shared_bytes, 0xff);
    l.static_shared.clear();
    l.static_shared_bytes = 0;
    for (auto& w : l.warps) w.generation = 0;
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& f = l.fibers[t];
      f.linear = t;
      f.coords.thread_idx = {t % block.x, (t / block.x) % block.y, unsigned(t / (std::uint64_t(block.x) * block.y))};
      f.coords.block_idx = bidx;
      f.coords.block_dim = block;
      f.coords.grid_dim = grid;
      f.wait = Wait::kNone;
      f.asan_fake_stack = nullptr;
#if defined(LAMINAR_EMU_ASAN)
      if (f.stack->dirty) ASAN_UNPOISON_MEMORY_REGION(f.stack->bottom(), f.stack->size());
#endif
      f.stack->dirty = true;
#if defined(LAMINAR_EMU_TSAN)
      if (f.stack->tsan_fiber == nullptr) f.stack->tsan_fiber = __tsan_create_fiber(0);
      f.tsan_fiber = f.stack->tsan_fiber;
#endif
      init_context(f);
    }
    // Runnable fibers; each step runs one drawn at random until it parks.
    std::vector<Fiber*> ready;
    for (auto& f : l.fibers) ready.push_back(&f);
    while (l.error.empty()) {
      if (ready.empty()) {
        ready = release(l);
        if (ready.empty()) break;
      }
      const std::size_t pick = std::size_t(rng() % ready.size());
      Fiber* f = ready[pick];
      ready[pick] = ready.back();
      ready.pop_back();
      switch_to_fiber(l, *f);
      if (l.error.empty() && f->wait == Wait::kWarp) release_warp(l, warp_of(*f), ready);
    }
    if (!l.error.empty()) break;
  }
  g_launch = nullptr;
  if (!l.error.empty()) return internal_error("cuda emulation: " + l.error + " [" + describe_launch(grid, block, seed) + "]");
  return ok_status();
}

std::uint64_t test_seed() {
  static const std::uint64_t seed = [] {
    std::uint64_t s = 0;
    if (const char* env = std::getenv("LAMINAR_EMU_SEED")) {
      s = std::strtoull(env, nullptr, 10);
    } else {
      std::random_device rd;
      s = (std::uint64_t(rd()) << 32) | rd();
    }
    std::fprintf(stderr, "cuda emulation seed: %llu (replay with LAMINAR_EMU_SEED=%llu)\n",
                 static_cast<unsigned long long>(s), static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

}  // namespace laminar::emu
