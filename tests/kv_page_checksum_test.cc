// The device page checksum of KV migration (cuda/kv_page_checksum.cuh), run on the CPU by the CUDA
// emulation and compared with a host implementation written from the header's definition.
#include "emulation/emulation.h"
#include "kv_page_checksum.cuh"
#include "kv_page_checksum_reference.h"

#include <catch2/catch.hpp>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

namespace {

using laminar::kernels::cuda_detail::KvChecksumParams;
using laminar::kernels::cuda_detail::kChecksumThreads;
using laminar::kernels::cuda_detail::kv_page_checksum_kernel;
using laminar::testing::reference_page_checksum;

struct Pools {
  std::int64_t num_pages;
  std::int64_t page_bytes;
  std::int32_t layers;
  std::vector<unsigned char> k, v;
  Pools(std::int64_t pages, std::int64_t bytes, std::int32_t l, std::mt19937_64& rng)
      : num_pages(pages), page_bytes(bytes), layers(l), k(std::size_t(pages * bytes * l)), v(k.size()) {
    for (auto& b : k) b = static_cast<unsigned char>(rng());
    for (auto& b : v) b = static_cast<unsigned char>(rng());
  }
  std::vector<std::uint64_t> emulated(const std::vector<std::int32_t>& pages, unsigned grid) const {
    std::vector<std::uint64_t> out(pages.size(), 0);
    KvChecksumParams p;
    p.k_pool = k.data();
    p.v_pool = v.data();
    p.num_pages = num_pages;
    p.page_bytes = page_bytes;
    p.num_layers = layers;
    p.pages = pages.data();
    p.count = std::int64_t(pages.size());
    p.out = out.data();
    const laminar::Status st =
        laminar::emu::launch({grid}, {kChecksumThreads}, 0, laminar::emu::test_seed(), kv_page_checksum_kernel, p);
    REQUIRE(st.ok());
    return out;
  }
};

}  // namespace

TEST_CASE("kv page checksum: the emulated kernel equals the host definition") {
  const std::uint64_t seed = std::random_device{}();
  std::printf("kv page checksum seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  // Page sizes in words and not (a bf16 page of one token, one head, head_dim 1 is 2 bytes), one
  // layer and several, fewer words than threads and more.
  for (auto [bytes, layers] : {std::pair<std::int64_t, std::int32_t>{2, 1}, {6, 3}, {64, 2}, {4096, 2}, {1030, 4}}) {
    INFO("page_bytes " << bytes << ", layers " << layers);
    const Pools pools(9, bytes, layers, rng);
    std::vector<std::int32_t> pages = {8, 0, 3, 3, 5};
    // A grid of one block takes every page through the grid-stride loop; one per page, in parallel.
    for (unsigned grid : {1u, unsigned(pages.size())}) {
      const std::vector<std::uint64_t> got = pools.emulated(pages, grid);
      for (std::size_t i = 0; i < pages.size(); ++i) {
        CHECK(got[i] == reference_page_checksum(pools.k.data(), pools.v.data(), pools.num_pages, pools.page_bytes, pools.layers, pages[i]));
      }
    }
  }
}

TEST_CASE("kv page checksum: one changed byte in any layer of either pool changes the page's checksum") {
  const std::uint64_t seed = std::random_device{}();
  std::printf("kv page checksum seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  Pools pools(4, 40, 3, rng);
  const std::vector<std::int32_t> pages = {0, 1, 2, 3};
  const std::vector<std::uint64_t> before = pools.emulated(pages, 4);
  for (bool in_v : {false, true}) {
    for (std::int32_t layer = 0; layer < pools.layers; ++layer) {
      auto& pool = in_v ? pools.v : pools.k;
      const std::size_t at = std::size_t((layer * pools.num_pages + 2) * pools.page_bytes + 39);
      pool[at] ^= 0x10;
      const std::vector<std::uint64_t> after = pools.emulated(pages, 4);
      INFO((in_v ? "V" : "K") << " layer " << layer);
      CHECK(after[0] == before[0]);
      CHECK(after[1] == before[1]);
      CHECK(after[2] != before[2]);
      CHECK(after[3] == before[3]);
      pool[at] ^= 0x10;
    }
  }
  // The same bytes in another page of the pool (another position) give another checksum.
  CHECK(before[0] != before[1]);
}
