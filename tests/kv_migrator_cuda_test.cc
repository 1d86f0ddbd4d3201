// KV migration's device parts on one GPU: the page checksum kernel against the host definition,
// and a migrator over device pools. Exits with the skip code without a device (gpu_test_main.cc);
// the two-process migration between device pools is kv_migrator_nccl_test (two GPUs).
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

TEST_CASE("kv migrator cuda: a migrator takes a cache whose pools are in device memory", "[kv_migrator][gpu]") {
  laminar::TransportOptions to;
  to.cluster_token = "kv-migrator-cuda-test-token-0123456789";
  std::shared_ptr<laminar::Transport> t = laminar::Transport::create(to).value();
  const laminar::KvLayout l{8, 4, 2, 8, laminar::DType::kF32, 3};
  void* k = nullptr;
  void* v = nullptr;
  REQUIRE(cudaMalloc(&k, std::size_t(l.pool_bytes())) == cudaSuccess);
  REQUIRE(cudaMalloc(&v, std::size_t(l.pool_bytes())) == cudaSuccess);
  const std::vector<std::int64_t> shape = {l.num_layers, l.num_pages, l.page_size, l.num_kv_heads, l.head_dim};
  auto kv = laminar::TensorView::contiguous(k, laminar::DType::kF32, shape, laminar::Device::cuda(0)).value();
  auto vv = laminar::TensorView::contiguous(v, laminar::DType::kF32, shape, laminar::Device::cuda(0)).value();
  {
    auto cache = std::make_shared<laminar::PagedKvCache>(laminar::PagedKvCache::create(l, kv, vv).value());
    auto m = laminar::KvMigrator::create(t, cache);
    INFO(m.status().to_string());
    CHECK(m.ok());
  }
  cudaFree(k);
  cudaFree(v);
}
