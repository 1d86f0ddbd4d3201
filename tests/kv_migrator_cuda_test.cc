// KV migration's device parts on one GPU: the page checksum kernel against the host definition, a
// migrator over device pools, and two migrators on the same GPU (NCCL takes one rank per GPU: the
// link is refused, and the migration ends with both sides whole). Exits with the skip code without
// a device (gpu_test_main.cc); the migration between two GPUs is kv_migrator_nccl_test.
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "kv_migrator_device.h"
#include "kv_page_checksum_reference.h"
#include "laminar/kv_migrator.h"

namespace {

// A worker whose pools are cudaMalloc'ed on device 0, with a listening transport.
struct DeviceWorker {
  void* k = nullptr;
  void* v = nullptr;
  std::shared_ptr<laminar::Transport> transport;
  std::shared_ptr<laminar::PagedKvCache> cache;
  std::unique_ptr<laminar::KvMigrator> migrator;
  std::vector<laminar::MigrationEvent> events;

  DeviceWorker() {
    const laminar::KvLayout l{16, 4, 2, 8, laminar::DType::kF32, 3};
    REQUIRE(cudaMalloc(&k, std::size_t(l.pool_bytes())) == cudaSuccess);
    REQUIRE(cudaMalloc(&v, std::size_t(l.pool_bytes())) == cudaSuccess);
    REQUIRE(cudaMemset(k, 0x3c, std::size_t(l.pool_bytes())) == cudaSuccess);
    REQUIRE(cudaMemset(v, 0x5a, std::size_t(l.pool_bytes())) == cudaSuccess);
    const std::vector<std::int64_t> shape = {l.num_layers, l.num_pages, l.page_size, l.num_kv_heads, l.head_dim};
    auto kv = laminar::TensorView::contiguous(k, laminar::DType::kF32, shape, laminar::Device::cuda(0)).value();
    auto vv = laminar::TensorView::contiguous(v, laminar::DType::kF32, shape, laminar::Device::cuda(0)).value();
    cache = std::make_shared<laminar::PagedKvCache>(laminar::PagedKvCache::create(l, kv, vv).value());
    laminar::TransportOptions to;
    to.cluster_token = "kv-migrator-cuda-test-token-0123456789";
    transport = laminar::Transport::create(to).value();
    (void)transport->listen("127.0.0.1", 0).value();
    laminar::KvMigratorOptions o;
    o.stall_timeout = std::chrono::seconds(20);
    auto m = laminar::KvMigrator::create(transport, cache, o);
    INFO(m.status().to_string());
    REQUIRE(m.ok());
    migrator = std::move(*m);
  }
  ~DeviceWorker() {
    migrator.reset();
    cache.reset();
    cudaFree(k);
    cudaFree(v);
  }
  void poll() {
    for (laminar::MigrationEvent& e : migrator->poll()) events.push_back(std::move(e));
  }
  const laminar::MigrationEvent* find(laminar::MigrationEvent::Kind kind) const {
    for (const laminar::MigrationEvent& e : events) {
      if (e.kind == kind) return &e;
    }
    return nullptr;
  }
};

struct DeviceBytes {
  void* p = nullptr;
  explicit DeviceBytes(const std::vector<unsigned char>& host) {
    REQUIRE(cudaMalloc(&p, host.size()) == cudaSuccess);
    REQUIRE(cudaMemcpy(p, host.data(), host.size(), cudaMemcpyHostToDevice) == cudaSuccess);
  }
  ~DeviceBytes() { cudaFree(p); }
};

}  // namespace

TEST_CASE("kv migrator cuda: the device page checksum equals the host definition", "[kv_migrator][gpu]") {
  namespace li = laminar::internal;
  const std::uint64_t seed = std::random_device{}();
  std::printf("kv migrator cuda seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  auto token = li::KvDeviceLink::new_token();
  REQUIRE(token.ok());
  // A link nobody else joins: checksum-only work runs on its stream all the same.
  auto link = li::KvDeviceLink::join(*token, 0, laminar::Device::cuda(0));
  REQUIRE(link.ok());
  for (auto [bytes, layers] : {std::pair<std::int64_t, std::int32_t>{2, 1}, {6, 3}, {4096, 2}, {1030, 4}}) {
    INFO("page_bytes " << bytes << ", layers " << layers);
    const std::int64_t num_pages = 70;
    std::vector<unsigned char> k(std::size_t(num_pages * bytes * layers)), v(k.size());
    for (auto& b : k) b = static_cast<unsigned char>(rng());
    for (auto& b : v) b = static_cast<unsigned char>(rng());
    DeviceBytes dk(k), dv(v);
    std::vector<std::int32_t> pages;
    for (int i = 0; i < 300; ++i) pages.push_back(std::int32_t(rng() % num_pages));
    auto work = (*link)->post({}, {dk.p, dv.p, num_pages, bytes, layers}, pages);
    REQUIRE(work.ok());
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    laminar::Result<bool> done = false;
    while ((done = (*work)->done()).ok() && !*done && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    REQUIRE(done.ok());
    REQUIRE(*done);
    const std::vector<std::uint64_t>& got = (*work)->checksums();
    REQUIRE(got.size() == pages.size());
    for (std::size_t i = 0; i < pages.size(); ++i) {
      CHECK(got[i] == laminar::testing::reference_page_checksum(k.data(), v.data(), num_pages, bytes, layers, pages[i]));
    }
  }
}

TEST_CASE("kv migrator cuda: two migrators on one GPU end the migration whole on both sides", "[kv_migrator][gpu]") {
  using Kind = laminar::MigrationEvent::Kind;
  DeviceWorker src, dst;
  const laminar::SequenceId seq(7);
  REQUIRE(src.cache->add_sequence(seq).ok());
  REQUIRE(src.cache->append_tokens(seq, 10).ok());
  const std::int64_t dst_free = dst.cache->free_pages();
  auto id = src.migrator->migrate(*dst.migrator->address(), std::vector<laminar::SequenceId>{seq});
  REQUIRE(id.ok());
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  bool finished = false;
  while (!src.find(Kind::kDone) && !src.find(Kind::kAborted) && std::chrono::steady_clock::now() < until) {
    src.poll();
    dst.poll();
    if (const laminar::MigrationEvent* e = src.find(Kind::kPauseRequested); e && !finished) {
      laminar::SequenceState st;
      st.sequence = seq;
      st.kv_length = 10;
      st.prompt_tokens.assign(10, 1);
      // Refused only if the migration ended in this same poll, which the checks below look at.
      (void)src.migrator->finish(e->id, {st});
      finished = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // NCCL refuses two ranks on one GPU when the link is joined: the migration ends before any page
  // moved, the sequence stays at the source, and the destination's reserved pages return.
  const laminar::MigrationEvent* aborted = src.find(Kind::kAborted);
  REQUIRE(aborted != nullptr);
  INFO(aborted->reason.to_string());
  CHECK_THAT(aborted->reason.message(), Catch::Contains("NCCL link"));
  CHECK(src.cache->length(seq).value() == 10);
  while (dst.cache->free_pages() != dst_free && std::chrono::steady_clock::now() < until) {
    dst.poll();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CHECK(dst.cache->free_pages() == dst_free);
  CHECK(dst.find(Kind::kArrived) == nullptr);
  CHECK(*dst.migrator->state(*id) != laminar::MigrationState::kDone);
}
