// PagedKvCache: page accounting, per-sequence page lists, CSR page tables, and validation of
// layouts and page tables given from outside, and pools adopted from the host application.
#include "laminar/kv_cache.h"

#include <catch2/catch.hpp>
#include <algorithm>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "laminar/kernels/paged_decode.h"

using laminar::DType;
using laminar::KvLayout;
using laminar::PagedKvCache;
using laminar::PageTableBuffer;
using laminar::SequenceId;
using laminar::StatusCode;

TEST_CASE("PagedKvCache hands out pages as sequences grow and takes them back", "[kv_cache]") {
  auto cache = PagedKvCache::create({8, 4, 2, 8, DType::kF16});
  REQUIRE(cache.ok());
  REQUIRE(cache->add_sequence(SequenceId(1)).ok());
  REQUIRE(cache->add_sequence(SequenceId(2)).ok());
  CHECK(cache->add_sequence(SequenceId(1)).code() == StatusCode::kAlreadyExists);
  REQUIRE(cache->append_tokens(SequenceId(1), 5).ok());  // 2 pages
  REQUIRE(cache->append_tokens(SequenceId(2), 4).ok());  // 1 page
  REQUIRE(cache->append_tokens(SequenceId(1), 3).ok());  // still 2 pages (8 tokens)
  CHECK(cache->used_pages() == 3);
  CHECK(*cache->length(SequenceId(1)) == 8);
  CHECK(cache->pages(SequenceId(1))->size() == 2);
  // 5 free pages: 21 more tokens for sequence 2 needs 6 more pages; refused without any change.
  CHECK(cache->append_tokens(SequenceId(2), 21).code() == StatusCode::kResourceExhausted);
  CHECK(*cache->length(SequenceId(2)) == 4);
  CHECK(cache->free_pages() == 5);
  CHECK(cache->append_tokens(SequenceId(9), 1).code() == StatusCode::kNotFound);
  CHECK(cache->append_tokens(SequenceId(2), -1).code() == StatusCode::kInvalidArgument);

  // Token slots are distinct, inside the pools, and where the page table says.
  auto s0 = cache->token_slot(SequenceId(1), 0);
  auto s5 = cache->token_slot(SequenceId(1), 5);
  REQUIRE(s0.ok());
  REQUIRE(s5.ok());
  CHECK(s5->page == (*cache->pages(SequenceId(1)))[1]);
  CHECK(s5->offset == 1);
  const std::int64_t row = 2 * 8 * 2;  // heads * head_dim * sizeof(f16)
  CHECK(static_cast<char*>(s5->k) ==
        static_cast<char*>(cache->k_page(s5->page)) + row);
  CHECK(cache->token_slot(SequenceId(1), 8).status().code() == StatusCode::kOutOfRange);

  PageTableBuffer table;
  const SequenceId batch[] = {SequenceId(2), SequenceId(1)};
  REQUIRE(cache->build_page_table(batch, &table).ok());
  CHECK(table.indptr == std::vector<std::int32_t>{0, 1, 3});
  CHECK(table.last_page_len == std::vector<std::int32_t>{4, 4});
  REQUIRE(laminar::validate(table.view(), cache->layout()).ok());
  CHECK(laminar::sequence_length(table.view(), 1, 4) == 8);
  const SequenceId twice[] = {SequenceId(1), SequenceId(1)};
  CHECK(cache->build_page_table(twice, &table).code() == StatusCode::kInvalidArgument);

  REQUIRE(cache->release(SequenceId(1)).ok());
  CHECK(cache->release(SequenceId(1)).code() == StatusCode::kNotFound);
  CHECK(cache->free_pages() == 7);
  CHECK(cache->num_sequences() == 1);
}

TEST_CASE("PagedKvCache survives random grow/release churn with no page owned twice", "[kv_cache]") {
  const std::uint64_t seed = std::random_device{}();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  auto cache = PagedKvCache::create({64, 16, 1, 8, DType::kF32});
  REQUIRE(cache.ok());
  std::vector<std::uint64_t> live;
  for (int step = 0; step < 2000; ++step) {
    const auto op = rng() % 3;
    if (op == 0 || live.empty()) {
      const std::uint64_t id = rng();
      if (cache->add_sequence(SequenceId(id)).ok()) live.push_back(id);
    } else if (op == 1) {
      const auto st = cache->append_tokens(SequenceId(live[rng() % live.size()]), std::int64_t(rng() % 40));
      REQUIRE((st.ok() || st.code() == StatusCode::kResourceExhausted));
    } else {
      const std::size_t i = rng() % live.size();
      REQUIRE(cache->release(SequenceId(live[i])).ok());
      live.erase(live.begin() + std::ptrdiff_t(i));
    }
    std::vector<int> owner(64, 0);
    int used = 0;
    for (std::uint64_t id : live) {
      const auto pages = cache->pages(SequenceId(id));
      REQUIRE(pages.ok());
      CHECK(std::int64_t(pages->size()) == (*cache->length(SequenceId(id)) + 15) / 16);
      for (std::int32_t p : *pages) {
        REQUIRE(owner[std::size_t(p)] == 0);
        owner[std::size_t(p)] = 1;
        ++used;
      }
    }
    REQUIRE(used == cache->used_pages());
  }
}

TEST_CASE("bad layouts and page tables are rejected with the offending value", "[kv_cache]") {
  CHECK(PagedKvCache::create({0, 16, 1, 8, DType::kF32}).status().code() == StatusCode::kInvalidArgument);
  CHECK(PagedKvCache::create({4, 16, 1, 8, DType::kI32}).status().message().find("i32") != std::string::npos);
  CHECK(laminar::validate(KvLayout{1 << 30, 1 << 20, 64, 256, DType::kF32}).code() == StatusCode::kInvalidArgument);
  const KvLayout l{4, 16, 1, 8, DType::kBF16};
  std::int32_t indptr[] = {0, 2, 3};
  std::int32_t indices[] = {0, 3, 1};
  std::int32_t last[] = {16, 1};
  laminar::PageTable t{indptr, indices, last, 2};
  REQUIRE(laminar::validate(t, l).ok());
  indices[1] = 4;
  CHECK(laminar::validate(t, l).message().find("indices[1] = 4") != std::string::npos);
  indices[1] = -1;
  CHECK(laminar::validate(t, l).code() == StatusCode::kInvalidArgument);
  indices[1] = 3;
  last[1] = 17;
  CHECK(laminar::validate(t, l).message().find("last_page_len 17") != std::string::npos);
  last[1] = 1;
  indptr[2] = 1;
  CHECK(laminar::validate(t, l).message().find("decreases") != std::string::npos);
  indptr[2] = 2;
  last[1] = 3;
  CHECK(laminar::validate(t, l).message().find("no pages but last_page_len 3") != std::string::npos);
  indptr[0] = 1;
  CHECK(laminar::validate(t, l).code() == StatusCode::kInvalidArgument);
  t.indptr = nullptr;
  CHECK(laminar::validate(t, l).code() == StatusCode::kInvalidArgument);
}

TEST_CASE("PagedKvCache adopts K/V pools the host allocated, without owning them", "[kv_cache][adopt]") {
  const KvLayout layout{6, 4, 2, 64, DType::kBF16};
  const std::int64_t shape[4] = {6, 4, 2, 64};
  const std::size_t elems = 6 * 4 * 2 * 64;
  // The engine's pools, filled before laminar sees them: adopting must not clear them.
  std::vector<std::uint16_t> k(elems, 0x3f80), v(elems, 0x4000);
  {
    auto kv = laminar::TensorView::contiguous(k.data(), DType::kBF16, shape).value();
    auto vv = laminar::TensorView::contiguous(v.data(), DType::kBF16, shape).value();
    auto cache = PagedKvCache::create(layout, kv, vv);
    REQUIRE(cache.ok());
    CHECK_FALSE(cache->owns_pools());
    CHECK(cache->device() == laminar::Device::cpu());
    CHECK(cache->view().k_pages == k.data());
    CHECK(cache->view().v_pages == v.data());
    CHECK(cache->k_pool().data() == k.data());
    CHECK(cache->k_pool().is_contiguous());
    CHECK(cache->free_pages() == 6);
    REQUIRE(cache->add_sequence(SequenceId(3)).ok());
    REQUIRE(cache->append_tokens(SequenceId(3), 6).ok());
    auto slot = cache->token_slot(SequenceId(3), 5);
    REQUIRE(slot.ok());
    CHECK(static_cast<std::uint16_t*>(slot->k) == k.data() + (std::size_t(slot->page) * 4 + 1) * 2 * 64);
    CHECK(static_cast<std::uint16_t*>(slot->v) == v.data() + (std::size_t(slot->page) * 4 + 1) * 2 * 64);
    static_cast<std::uint16_t*>(slot->k)[0] = 0x1234;
    CHECK(k[(std::size_t(slot->page) * 4 + 1) * 2 * 64] == 0x1234);
  }
  // The cache is gone; the engine's memory is still its own, untouched but for the write above.
  CHECK(std::count(k.begin(), k.end(), std::uint16_t(0x3f80)) == std::ptrdiff_t(elems) - 1);
  CHECK(std::count(v.begin(), v.end(), std::uint16_t(0x4000)) == std::ptrdiff_t(elems));
  // A cache that allocates its own pools owns them and hands out host views.
  auto own = PagedKvCache::create(layout);
  REQUIRE(own.ok());
  CHECK(own->owns_pools());
  CHECK(own->k_pool().dim(3) == 64);

  // Device pools are adopted as device addresses (nothing is read from them here).
  const auto gpu = laminar::Device::cuda(1);
  auto kd = laminar::TensorView::contiguous(k.data(), DType::kBF16, shape, gpu).value();
  auto vd = laminar::TensorView::contiguous(v.data(), DType::kBF16, shape, gpu).value();
  auto on_device = PagedKvCache::create(layout, kd, vd);
  REQUIRE(on_device.ok());
  CHECK(on_device->device() == gpu);
  CHECK(on_device->k_pool().device() == gpu);
}

TEST_CASE("PagedKvCache refuses pools that do not match the layout, naming the pool", "[kv_cache][adopt]") {
  const KvLayout layout{6, 4, 2, 64, DType::kBF16};
  const std::int64_t shape[4] = {6, 4, 2, 64};
  std::vector<std::uint16_t> k(6 * 4 * 2 * 64 * 2), v(6 * 4 * 2 * 64 * 2);
  const auto view = [](void* data, DType t, std::span<const std::int64_t> s,
                       laminar::Device d = laminar::Device::cpu()) {
    return laminar::TensorView::contiguous(data, t, s, d).value();
  };
  const auto refused = [&](const laminar::TensorView& kv, const laminar::TensorView& vv, const char* text) {
    auto c = PagedKvCache::create(layout, kv, vv);
    REQUIRE_FALSE(c.ok());
    CHECK(c.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(c.status().message(), Catch::Contains(text));
  };
  const auto good_k = view(k.data(), DType::kBF16, shape);
  const auto good_v = view(v.data(), DType::kBF16, shape);
  REQUIRE(PagedKvCache::create(layout, good_k, good_v).ok());
  const std::int64_t wrong[4] = {6, 4, 2, 128};
  refused(good_k, view(v.data(), DType::kBF16, wrong),
          "PagedKvCache: v_pool: shape [6, 4, 2, 128] but the layout gives [6, 4, 2, 64]");
  const std::int64_t flat[1] = {6 * 4 * 2 * 64};
  refused(view(k.data(), DType::kBF16, flat), good_v, "k_pool: shape [3072] but the layout gives");
  refused(view(k.data(), DType::kF16, shape), good_v, "k_pool: dtype f16 but the layout's is bf16");
  const std::int64_t strides[4] = {4 * 2 * 128, 2 * 128, 128, 1};
  refused(good_k, laminar::TensorView::strided(v.data(), DType::kBF16, shape, strides).value(),
          "v_pool: strides [1024, 256, 128, 1] of shape [6, 4, 2, 64] are not dense");
  refused(good_k, view(v.data(), DType::kBF16, shape, laminar::Device::cuda(0)),
          "v_pool: on cuda:0 but k_pool is on cpu:0");
  refused(good_k, view(k.data() + 64, DType::kBF16, shape), "v_pool: overlaps k_pool");
  CHECK(PagedKvCache::create({0, 4, 2, 64, DType::kBF16}, good_k, good_v).status().code() ==
        StatusCode::kInvalidArgument);
}

TEST_CASE("a paged decode over adopted pools matches the same data in a cache's own pools", "[kv_cache][adopt]") {
  const KvLayout layout{8, 4, 2, 64, DType::kF32};
  auto own = PagedKvCache::create(layout);
  REQUIRE(own.ok());
  const std::size_t elems = 8 * 4 * 2 * 64;
  std::vector<float> k(elems), v(elems);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::size_t i = 0; i < elems; ++i) {
    k[i] = nd(rng);
    v[i] = nd(rng);
  }
  std::memcpy(own->k_page(0), k.data(), elems * sizeof(float));
  std::memcpy(own->v_page(0), v.data(), elems * sizeof(float));
  auto adopted =
      PagedKvCache::create(layout, laminar::TensorView::contiguous(k.data(), DType::kF32, own->k_pool().shape()).value(),
                           laminar::TensorView::contiguous(v.data(), DType::kF32, own->v_pool().shape()).value());
  REQUIRE(adopted.ok());
  const std::int64_t qshape[3] = {2, 4, 64};
  std::vector<float> q(2 * 4 * 64);
  for (auto& x : q) x = nd(rng);
  std::vector<std::vector<float>> outs;
  for (PagedKvCache* cache : {&*own, &*adopted}) {
    REQUIRE(cache->add_sequence(SequenceId(1)).ok());
    REQUIRE(cache->add_sequence(SequenceId(2)).ok());
    REQUIRE(cache->append_tokens(SequenceId(1), 7).ok());
    REQUIRE(cache->append_tokens(SequenceId(2), 13).ok());
    PageTableBuffer table;
    const SequenceId ids[] = {SequenceId(2), SequenceId(1)};
    REQUIRE(cache->build_page_table(ids, &table).ok());
    std::vector<float> out(q.size());
    laminar::kernels::PagedDecodeTensors t;
    t.q = laminar::TensorView::contiguous(q.data(), DType::kF32, qshape).value();
    t.out = laminar::TensorView::contiguous(out.data(), DType::kF32, qshape).value();
    t.k_pages = cache->k_pool();
    t.v_pages = cache->v_pool();
    const std::int64_t n3[1] = {3}, n2[1] = {2}, nnz[1] = {std::int64_t(table.indices.size())};
    t.indptr = laminar::TensorView::contiguous(table.indptr.data(), DType::kI32, n3).value();
    t.indices = laminar::TensorView::contiguous(table.indices.data(), DType::kI32, nnz).value();
    t.last_page_len = laminar::TensorView::contiguous(table.last_page_len.data(), DType::kI32, n2).value();
    auto p = laminar::kernels::PagedDecodeParams::from_tensors(t);
    REQUIRE(p.ok());
    REQUIRE(laminar::kernels::run(*p, laminar::Stream::host()).ok());
    outs.push_back(out);
  }
  CHECK(std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * sizeof(float)) == 0);
}
