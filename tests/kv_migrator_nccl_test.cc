// KV migration between device pools across two real processes, pages by NCCL: this process is the
// destination on CUDA device 1, a copy of it started with `--source ADDRESS` the source on device 0.
// The source decodes (grows its sequences) between polls while live stages copy; once the
// sequences arrive, every K and V byte of every layer is read back from the destination's device
// and compared with what the source wrote. NCCL takes one rank per GPU, so the test needs two
// devices and exits with the skip code otherwise.
#define CATCH_CONFIG_RUNNER
#include <cuda_runtime.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "laminar/kv_migrator.h"
#include "process.h"

namespace {

using namespace std::chrono_literals;
using laminar::KvLayout;
using laminar::KvMigrator;
using laminar::MigrationEvent;
using laminar::PagedKvCache;
using laminar::SequenceId;
using Kind = laminar::MigrationEvent::Kind;

const std::string kToken = "kv-migrator-nccl-test-token-0123456789";
const std::vector<std::pair<std::uint64_t, std::int64_t>> kSequences = {{1, 3}, {2, 4}, {3, 9}, {4, 30}};
constexpr std::int64_t kGrowth = 5;  // tokens each sequence decodes while it is copied

KvLayout layout() { return {64, 4, 2, 8, laminar::DType::kF32, 3}; }

// Element e of token pos's K (pool 0) or V (pool 1) row in `layer`: distinct, exact in f32.
float pattern(std::uint64_t seq, std::int64_t pos, std::int32_t layer, int pool, std::int64_t e) {
  std::uint64_t h = seq * 0x9E3779B97F4A7C15ull ^ std::uint64_t(pos) * 0xC2B2AE3D27D4EB4Full ^
                    std::uint64_t(layer) * 0x165667B19E3779F9ull ^ std::uint64_t(pool) * 0x27D4EB2F165667C5ull ^
                    std::uint64_t(e) * 0x85EBCA77C2B2AE63ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return float(h & 0xFFFFFF);
}

// A worker whose pools are in device memory on `device`.
struct DeviceWorker {
  int device = 0;
  void* k = nullptr;
  void* v = nullptr;
  std::shared_ptr<laminar::Transport> transport;
  std::shared_ptr<PagedKvCache> cache;
  std::unique_ptr<KvMigrator> migrator;
  std::vector<MigrationEvent> events;

  explicit DeviceWorker(int d, bool listen) : device(d) {
    if (cudaSetDevice(d) != cudaSuccess) std::abort();
    const KvLayout l = layout();
    if (cudaMalloc(&k, std::size_t(l.pool_bytes())) != cudaSuccess) std::abort();
    if (cudaMalloc(&v, std::size_t(l.pool_bytes())) != cudaSuccess) std::abort();
    const std::vector<std::int64_t> shape = {l.num_layers, l.num_pages, l.page_size, l.num_kv_heads, l.head_dim};
    auto kv = laminar::TensorView::contiguous(k, laminar::DType::kF32, shape, laminar::Device::cuda(d)).value();
    auto vv = laminar::TensorView::contiguous(v, laminar::DType::kF32, shape, laminar::Device::cuda(d)).value();
    cache = std::make_shared<PagedKvCache>(PagedKvCache::create(l, kv, vv).value());
    laminar::TransportOptions to;
    to.cluster_token = kToken;
    transport = laminar::Transport::create(to).value();
    if (listen) (void)transport->listen("127.0.0.1", 0).value();
    migrator = KvMigrator::create(transport, cache).value();
  }
  ~DeviceWorker() {
    migrator.reset();
    cache.reset();
    cudaFree(k);
    cudaFree(v);
  }
  void poll() {
    for (MigrationEvent& e : migrator->poll()) events.push_back(std::move(e));
  }
  const MigrationEvent* find(Kind kind) const {
    for (const MigrationEvent& e : events) {
      if (e.kind == kind) return &e;
    }
    return nullptr;
  }
  // Grows a sequence by one token and writes its rows in every layer.
  bool append(SequenceId s) {
    const std::int64_t pos = cache->length(s).value();
    if (!cache->append_tokens(s, 1).ok()) return false;
    const KvLayout& l = cache->layout();
    std::vector<float> row(std::size_t(l.token_elems()));
    for (std::int32_t layer = 0; layer < l.num_layers; ++layer) {
      auto slot = cache->token_slot(s, pos, layer).value();
      for (int pool = 0; pool < 2; ++pool) {
        for (std::size_t e = 0; e < row.size(); ++e) row[e] = pattern(s.value(), pos, layer, pool, std::int64_t(e));
        if (cudaMemcpy(pool == 0 ? slot.k : slot.v, row.data(), row.size() * 4, cudaMemcpyHostToDevice) !=
            cudaSuccess) {
          return false;
        }
      }
    }
    return true;
  }
};

laminar::SequenceState state_of(PagedKvCache& cache, SequenceId s) {
  laminar::SequenceState st;
  st.sequence = s;
  st.trajectory = laminar::TrajectoryId(s.value() + 1000);
  st.kv_length = std::uint64_t(cache.length(s).value());
  st.rng_position = st.kv_length;
  st.prompt_tokens.assign(st.kv_length, 7);
  return st;
}

// The source: moves every sequence to `address`, decoding while live stages run. 0 once done.
int run_source(const char* address) {
  DeviceWorker w(0, false);
  std::vector<SequenceId> ids;
  for (auto [id, len] : kSequences) {
    ids.push_back(SequenceId(id));
    if (!w.cache->add_sequence(SequenceId(id)).ok()) return 2;
    for (std::int64_t i = 0; i < len; ++i) {
      if (!w.append(SequenceId(id))) return 2;
    }
  }
  auto id = w.migrator->migrate(address, ids);
  if (!id.ok()) {
    std::fprintf(stderr, "migrate: %s\n", id.status().to_string().c_str());
    return 3;
  }
  std::int64_t grown = 0;
  bool paused = false;
  const auto deadline = std::chrono::steady_clock::now() + 120s;
  while (std::chrono::steady_clock::now() < deadline) {
    w.poll();
    if (w.find(Kind::kDone)) return 0;
    if (const MigrationEvent* e = w.find(Kind::kAborted)) {
      std::fprintf(stderr, "aborted: %s\n", e->reason.to_string().c_str());
      return 4;
    }
    if (const MigrationEvent* e = w.find(Kind::kPauseRequested); e && !paused) {
      paused = true;  // decoding stops here
      std::vector<laminar::SequenceState> states;
      for (SequenceId s : ids) states.push_back(state_of(*w.cache, s));
      if (laminar::Status st = w.migrator->finish(e->id, std::move(states)); !st.ok()) {
        std::fprintf(stderr, "finish: %s\n", st.to_string().c_str());
        return 5;
      }
      continue;
    }
    if (grown < kGrowth && !paused) {
      for (SequenceId s : ids) {
        if (!w.append(s)) return 2;
      }
      ++grown;
    }
    std::this_thread::sleep_for(100us);
  }
  return 6;
}

}  // namespace

TEST_CASE("kv migrator nccl: sequences move between device pools of two processes, every byte", "[gpu]") {
  DeviceWorker dst(1, true);
  laminar::testing::ChildOptions o;
  o.program = "/proc/self/exe";
  o.args = {"--source", dst.transport->listen_address().value()};
  auto src = laminar::testing::ChildProcess::spawn(std::move(o));
  REQUIRE(src.ok());
  const auto deadline = std::chrono::steady_clock::now() + 120s;
  while (!dst.find(Kind::kArrived) && !dst.find(Kind::kAborted) && std::chrono::steady_clock::now() < deadline) {
    dst.poll();
    std::this_thread::sleep_for(100us);
  }
  const MigrationEvent* aborted = dst.find(Kind::kAborted);
  INFO((aborted ? aborted->reason.to_string() : std::string("not aborted")));
  const MigrationEvent* arrived = dst.find(Kind::kArrived);
  REQUIRE(arrived != nullptr);
  auto code = src->wait(60s);
  REQUIRE(code.ok());
  CHECK(*code == 0);
  CHECK(dst.migrator->stats().checksum_failures == 0);
  CHECK(dst.migrator->stats().pages_received > 0);
  const KvLayout& l = dst.cache->layout();
  REQUIRE(arrived->states.size() == kSequences.size());
  for (const laminar::SequenceState& st : arrived->states) {
    const std::int64_t length = dst.cache->length(st.sequence).value();
    CHECK(std::uint64_t(length) == st.kv_length);
    // Every token the source wrote, the ones decoded during the copy too.
    std::vector<float> row(std::size_t(l.token_elems()));
    std::int64_t wrong = 0;
    for (std::int64_t pos = 0; pos < length; ++pos) {
      for (std::int32_t layer = 0; layer < l.num_layers; ++layer) {
        auto slot = dst.cache->token_slot(st.sequence, pos, layer).value();
        for (int pool = 0; pool < 2; ++pool) {
          REQUIRE(cudaMemcpy(row.data(), pool == 0 ? slot.k : slot.v, row.size() * 4, cudaMemcpyDeviceToHost) ==
                  cudaSuccess);
          for (std::size_t e = 0; e < row.size(); ++e) {
            const float want = pattern(st.sequence.value(), pos, layer, pool, std::int64_t(e));
            if (std::memcmp(&row[e], &want, 4) != 0) ++wrong;
          }
        }
      }
    }
    INFO("sequence " << st.sequence.value());
    CHECK(wrong == 0);
  }
}

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "--source") == 0) return run_source(argv[2]);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2) {
    std::printf("needs two CUDA devices (NCCL takes one rank per GPU), found %d: skipping\n", count);
    return LAMINAR_SKIP_CODE;
  }
  return Catch::Session().run(argc, argv);
}
