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

TEST_CASE("kv cache: PagedKvCache hands out pages as sequences grow and takes them back", "[kv_cache]") {
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
  auto s0 = cache->token_slot(SequenceId(1), 0, 0);
  auto s5 = cache->token_slot(SequenceId(1), 5, 0);
  REQUIRE(s0.ok());
  REQUIRE(s5.ok());
  CHECK(s5->page == (*cache->pages(SequenceId(1)))[1]);
  CHECK(s5->offset == 1);
  const std::int64_t row = 2 * 8 * 2;  // heads * head_dim * sizeof(f16)
  CHECK(static_cast<char*>(s5->k) ==
        static_cast<char*>(*cache->k_page(0, s5->page)) + row);
  CHECK(cache->token_slot(SequenceId(1), 8, 0).status().code() == StatusCode::kOutOfRange);

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

TEST_CASE("kv cache: PagedKvCache moves as a value: its pools, pages and sequences stay where they are", "[kv_cache]") {
  auto created = PagedKvCache::create({8, 4, 2, 8, DType::kF32});
  REQUIRE(created.ok());
  PagedKvCache cache = std::move(created).value();
  REQUIRE(cache.add_sequence(SequenceId(1)).ok());
  REQUIRE(cache.append_tokens(SequenceId(1), 6).ok());
  auto slot = cache.token_slot(SequenceId(1), 5, 0);
  REQUIRE(slot.ok());
  static_cast<float*>(slot->k)[0] = 42.0f;
  const void* k_pool = cache.k_pool().data();

  PagedKvCache moved = std::move(cache);
  CHECK(moved.k_pool().data() == k_pool);
  CHECK(moved.owns_pools());
  CHECK(*moved.length(SequenceId(1)) == 6);
  CHECK(moved.used_pages() == 2);
  auto same = moved.token_slot(SequenceId(1), 5, 0);
  REQUIRE(same.ok());
  CHECK(same->k == slot->k);
  CHECK(static_cast<float*>(same->k)[0] == 42.0f);

  // Assigned over another cache: that one's pools go, the moved ones stay.
  auto other = PagedKvCache::create({4, 4, 2, 8, DType::kF32});
  REQUIRE(other.ok());
  *other = std::move(moved);
  CHECK(other->k_pool().data() == k_pool);
  CHECK(other->layout().num_pages == 8);
  CHECK(*other->length(SequenceId(1)) == 6);
}

TEST_CASE("kv cache: PagedKvCache survives random grow/release churn with no page owned twice", "[kv_cache]") {
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

TEST_CASE("kv cache: bad layouts and page tables are rejected with the offending value", "[kv_cache]") {
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

TEST_CASE("kv cache: PagedKvCache adopts K/V pools the host allocated, without owning them", "[kv_cache][adopt]") {
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
    CHECK(cache->view(0)->k_pages == k.data());
    CHECK(cache->view(0)->v_pages == v.data());
    CHECK(cache->k_pool().data() == k.data());
    CHECK(cache->k_pool().is_contiguous());
    CHECK(cache->free_pages() == 6);
    REQUIRE(cache->add_sequence(SequenceId(3)).ok());
    REQUIRE(cache->append_tokens(SequenceId(3), 6).ok());
    auto slot = cache->token_slot(SequenceId(3), 5, 0);
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
  CHECK(own->k_pool().ndim() == 5);
  CHECK(own->k_pool().dim(0) == 1);
  CHECK(own->k_pool().dim(4) == 64);

  // Device pools are adopted as device addresses (nothing is read from them here).
  const auto gpu = laminar::Device::cuda(1);
  auto kd = laminar::TensorView::contiguous(k.data(), DType::kBF16, shape, gpu).value();
  auto vd = laminar::TensorView::contiguous(v.data(), DType::kBF16, shape, gpu).value();
  auto on_device = PagedKvCache::create(layout, kd, vd);
  REQUIRE(on_device.ok());
  CHECK(on_device->device() == gpu);
  CHECK(on_device->k_pool().device() == gpu);
}

TEST_CASE("kv cache: PagedKvCache refuses pools that do not match the layout, naming the pool", "[kv_cache][adopt]") {
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

TEST_CASE("kv cache: a paged decode over adopted pools matches the same data in a cache's own pools",
          "[kv_cache][adopt]") {
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
  std::memcpy(*own->k_page(0, 0), k.data(), elems * sizeof(float));
  std::memcpy(*own->v_page(0, 0), v.data(), elems * sizeof(float));
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
    // from_tensors takes one layer's 4-D pools: the cache's 5-D pools without their layer dimension.
    const auto layer0 = [&](const laminar::TensorView& pool) {
      return laminar::TensorView::contiguous(pool.data(), pool.dtype(), pool.shape().subspan(1)).value();
    };
    t.k_pages = layer0(cache->k_pool());
    t.v_pages = layer0(cache->v_pool());
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

TEST_CASE("kv cache: KvLayout counts layers in its sizes and validation", "[kv_cache][layers]") {
  const KvLayout l{.num_pages = 4, .page_size = 2, .num_kv_heads = 1, .head_dim = 8, .dtype = DType::kF16,
                   .num_layers = 3};
  CHECK(l.page_bytes() == 2 * 8 * 2);
  CHECK(l.layer_bytes() == 4 * 2 * 8 * 2);
  CHECK(l.pool_bytes() == 3 * 4 * 2 * 8 * 2);
  CHECK(laminar::validate(l).ok());
  CHECK(KvLayout{4, 2, 1, 8, DType::kF16}.num_layers == 1);
  for (std::int32_t bad : {0, -2}) {
    KvLayout b = l;
    b.num_layers = bad;
    const auto st = laminar::validate(b);
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(st.message(), Catch::Contains("num_layers must be positive, got " + std::to_string(bad)));
  }
  // 2^48 bytes per layer is allowed; 2^15 such layers (2^63 bytes) are not.
  KvLayout big{1 << 20, 1 << 16, 8, 128, DType::kF32};
  CHECK(laminar::validate(big).ok());
  big.num_layers = 1 << 15;
  CHECK_THAT(laminar::validate(big).message(), Catch::Contains("too large"));
}

TEST_CASE("kv cache: PagedKvCache layers are separate memory addressed by the same page ids", "[kv_cache][layers]") {
  const KvLayout layout{.num_pages = 4, .page_size = 2, .num_kv_heads = 2, .head_dim = 4, .dtype = DType::kF32,
                        .num_layers = 3};
  auto cache = PagedKvCache::create(layout);
  REQUIRE(cache.ok());
  REQUIRE(cache->add_sequence(SequenceId(1)).ok());
  REQUIRE(cache->append_tokens(SequenceId(1), 3).ok());  // 2 pages, shared by all 3 layers
  CHECK(cache->used_pages() == 2);
  const auto* k_base = static_cast<const char*>(cache->k_pool().data());
  const auto* v_base = static_cast<const char*>(cache->v_pool().data());
  CHECK(cache->k_pool().dim(0) == 3);
  const std::int64_t row = 2 * 4 * 4;  // heads * head_dim * sizeof(f32)
  const std::int32_t page = (*cache->pages(SequenceId(1)))[1];
  for (std::int32_t layer = 0; layer < 3; ++layer) {
    INFO("layer " << layer);
    const auto view = cache->view(layer);
    REQUIRE(view.ok());
    CHECK(static_cast<const char*>(view->k_pages) == k_base + layer * layout.layer_bytes());
    CHECK(static_cast<const char*>(view->v_pages) == v_base + layer * layout.layer_bytes());
    CHECK(view->layout.num_layers == 1);
    CHECK(view->layout.num_pages == 4);
    CHECK(view->layout.head_dim == 4);
    CHECK(*cache->k_page(layer, page) == static_cast<const char*>(view->k_pages) + page * layout.page_bytes());
    CHECK(*cache->v_page(layer, page) == static_cast<const char*>(view->v_pages) + page * layout.page_bytes());
    const auto slot = cache->token_slot(SequenceId(1), 2, layer);
    REQUIRE(slot.ok());
    CHECK(slot->page == page);
    CHECK(slot->offset == 0);
    CHECK(static_cast<char*>(slot->k) == static_cast<char*>(*cache->k_page(layer, page)));
    CHECK(static_cast<char*>(slot->v) == static_cast<char*>(*cache->v_page(layer, page)));
    const auto first = cache->token_slot(SequenceId(1), 1, layer);
    REQUIRE(first.ok());
    CHECK(static_cast<char*>(first->k) ==
          static_cast<char*>(*cache->k_page(layer, (*cache->pages(SequenceId(1)))[0])) + row);
  }

  // Writing token 2 of layer 1 leaves the other layers' copy of that token as it was.
  auto l1 = cache->token_slot(SequenceId(1), 2, 1);
  REQUIRE(l1.ok());
  std::fill_n(static_cast<float*>(l1->k), 8, 1.5f);
  std::fill_n(static_cast<float*>(l1->v), 8, -2.5f);
  for (std::int32_t layer : {0, 2}) {
    auto other = cache->token_slot(SequenceId(1), 2, layer);
    REQUIRE(other.ok());
    CHECK(std::count(static_cast<float*>(other->k), static_cast<float*>(other->k) + 8, 0.0f) == 8);
    CHECK(std::count(static_cast<float*>(other->v), static_cast<float*>(other->v) + 8, 0.0f) == 8);
  }
  const auto* k_all = static_cast<const float*>(cache->k_pool().data());
  const std::int64_t elems = cache->k_pool().numel();
  CHECK(std::count(k_all, k_all + elems, 1.5f) == 8);
  CHECK(std::count(k_all, k_all + elems, 0.0f) == elems - 8);
}

TEST_CASE("kv cache: PagedKvCache refuses a layer or page outside the cache, naming it", "[kv_cache][layers]") {
  auto cache = PagedKvCache::create({.num_pages = 4, .page_size = 2, .num_kv_heads = 1, .head_dim = 8,
                                     .dtype = DType::kBF16, .num_layers = 2});
  REQUIRE(cache.ok());
  REQUIRE(cache->add_sequence(SequenceId(1)).ok());
  REQUIRE(cache->append_tokens(SequenceId(1), 1).ok());
  const auto out_of_range = [](const laminar::Status& st, const char* text) {
    CHECK(st.code() == StatusCode::kOutOfRange);
    CHECK_THAT(st.message(), Catch::Contains(text));
  };
  out_of_range(cache->view(2).status(), "layer 2 outside a cache of 2 layers");
  out_of_range(cache->view(-1).status(), "layer -1 outside");
  out_of_range(cache->token_slot(SequenceId(1), 0, 2).status(), "layer 2 outside");
  out_of_range(cache->k_page(2, 0).status(), "layer 2 outside");
  out_of_range(cache->v_page(-1, 0).status(), "layer -1 outside");
  out_of_range(cache->k_page(1, 4).status(), "page 4 outside a pool of 4 pages");
  out_of_range(cache->v_page(0, -1).status(), "page -1 outside");
  CHECK(cache->view(1).ok());
  CHECK(cache->token_slot(SequenceId(1), 0, 1).ok());
}

TEST_CASE("kv cache: PagedKvCache adopts 5-D pools of several layers, and 4-D pools only for one",
          "[kv_cache][layers][adopt]") {
  const KvLayout layout{.num_pages = 3, .page_size = 2, .num_kv_heads = 1, .head_dim = 4, .dtype = DType::kF32,
                        .num_layers = 2};
  const std::int64_t five[5] = {2, 3, 2, 1, 4};
  const std::int64_t four[4] = {3, 2, 1, 4};
  const std::size_t elems = 2 * 3 * 2 * 1 * 4;
  std::vector<float> k(elems), v(elems);
  const auto view = [](std::vector<float>& data, std::span<const std::int64_t> s) {
    return laminar::TensorView::contiguous(data.data(), DType::kF32, s).value();
  };
  auto cache = PagedKvCache::create(layout, view(k, five), view(v, five));
  REQUIRE(cache.ok());
  CHECK(cache->view(1)->k_pages == k.data() + elems / 2);
  CHECK(cache->view(1)->v_pages == v.data() + elems / 2);
  CHECK(cache->k_pool().data() == k.data());
  CHECK(cache->k_pool().dim(0) == 2);

  auto four_for_two = PagedKvCache::create(layout, view(k, four), view(v, four));
  REQUIRE_FALSE(four_for_two.ok());
  CHECK(four_for_two.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(four_for_two.status().message(),
             Catch::Contains("k_pool: shape [3, 2, 1, 4] but the layout gives [2, 3, 2, 1, 4]"));
  const std::int64_t three_layers[5] = {3, 3, 2, 1, 4};
  std::vector<float> big(3 * elems / 2);
  CHECK_THAT(PagedKvCache::create(layout, view(k, five), view(big, three_layers)).status().message(),
             Catch::Contains("v_pool: shape [3, 3, 2, 1, 4]"));

  // The overlap check spans every layer: V starting in K's second layer is refused.
  std::vector<float> both(2 * elems);
  auto overlapping = PagedKvCache::create(
      layout, laminar::TensorView::contiguous(both.data(), DType::kF32, five).value(),
      laminar::TensorView::contiguous(both.data() + elems - 1, DType::kF32, five).value());
  CHECK_THAT(overlapping.status().message(), Catch::Contains("v_pool: overlaps k_pool"));

  KvLayout one = layout;
  one.num_layers = 1;
  const std::int64_t five_one[5] = {1, 3, 2, 1, 4};
  CHECK(PagedKvCache::create(one, view(k, four), view(v, four)).ok());
  CHECK(PagedKvCache::create(one, view(k, five_one), view(v, five_one)).ok());
}

TEST_CASE("kv cache: paged decode reads one layer's view and refuses a multi-layer layout", "[kv_cache][layers]") {
  // A 2-layer cache and a 1-layer cache holding layer 1's data: decoding view(1) of the first must
  // give the bits of the second, and layer 0 (different data) must not.
  const KvLayout two{.num_pages = 4, .page_size = 4, .num_kv_heads = 2, .head_dim = 64, .dtype = DType::kF32,
                     .num_layers = 2};
  KvLayout one_layout = two;
  one_layout.num_layers = 1;
  auto cache = PagedKvCache::create(two);
  auto one = PagedKvCache::create(one_layout);
  REQUIRE(cache.ok());
  REQUIRE(one.ok());
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const auto fill = [&](const laminar::TensorView& pool) {
    auto* f = static_cast<float*>(pool.data());
    for (std::int64_t i = 0; i < pool.numel(); ++i) f[i] = nd(rng);
  };
  fill(cache->k_pool());
  fill(cache->v_pool());
  const std::size_t layer_bytes = std::size_t(two.layer_bytes());
  std::memcpy(*one->k_page(0, 0), *cache->k_page(1, 0), layer_bytes);
  std::memcpy(*one->v_page(0, 0), *cache->v_page(1, 0), layer_bytes);
  std::vector<float> q(2 * 64);
  for (auto& x : q) x = nd(rng);

  const auto decode = [&](PagedKvCache& c, const laminar::PagedKv& kv, laminar::Status* st) {
    if (!c.pages(SequenceId(1)).ok()) {
      REQUIRE(c.add_sequence(SequenceId(1)).ok());
      REQUIRE(c.append_tokens(SequenceId(1), 11).ok());
    }
    PageTableBuffer table;
    const SequenceId ids[] = {SequenceId(1)};
    REQUIRE(c.build_page_table(ids, &table).ok());
    std::vector<float> out(q.size());
    laminar::kernels::PagedDecodeParams p;
    p.q = q.data();
    p.out = out.data();
    p.kv = kv;
    p.table = table.view();
    p.num_rows = 1;
    p.num_qo_heads = 2;
    p.sm_scale = 0.125f;
    p.max_kv_len = 11;
    *st = laminar::kernels::run(p, laminar::Stream::host());
    return out;
  };
  laminar::Status st;
  const auto from_layer1 = decode(*cache, *cache->view(1), &st);
  REQUIRE(st.ok());
  const auto from_one = decode(*one, *one->view(0), &st);
  REQUIRE(st.ok());
  const auto from_layer0 = decode(*cache, *cache->view(0), &st);
  REQUIRE(st.ok());
  CHECK(std::memcmp(from_layer1.data(), from_one.data(), q.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(from_layer0.data(), from_one.data(), q.size() * sizeof(float)) != 0);

  // The whole cache's layout handed to a kernel is refused before anything is read.
  laminar::PagedKv whole = *cache->view(0);
  whole.layout.num_layers = 2;
  decode(*cache, whole, &st);
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(st.message(), Catch::Contains("num_layers is 2, not 1"));
}

TEST_CASE("kv cache: PagedKvCache reserves pages for an incoming sequence and takes them back", "[kv_cache][reserve]") {
  auto cache = PagedKvCache::create({8, 4, 2, 8, DType::kF32, 2});
  REQUIRE(cache.ok());
  REQUIRE(cache->add_sequence(SequenceId(1)).ok());
  REQUIRE(cache->append_tokens(SequenceId(1), 4).ok());  // 1 page
  auto r = cache->reserve_pages(5);
  REQUIRE(r.ok());
  CHECK(r->size() == 5);
  CHECK(cache->reserved_pages() == 5);
  CHECK(cache->free_pages() == 2);
  CHECK(cache->used_pages() == 6);
  // Reserved pages are nobody's: a growing sequence takes only the free ones.
  REQUIRE(cache->append_tokens(SequenceId(1), 8).ok());
  const std::span<const std::int32_t> grown = cache->pages(SequenceId(1)).value();
  for (std::int32_t p : grown) CHECK(std::ranges::find(*r, p) == r->end());
  CHECK(cache->free_pages() == 0);
  CHECK(cache->reserve_pages(1).status().code() == StatusCode::kResourceExhausted);
  CHECK(cache->reserved_pages() == 5);

  const std::vector<std::int32_t> two(r->begin(), r->begin() + 2);
  REQUIRE(cache->unreserve_pages(two).ok());
  CHECK(cache->reserved_pages() == 3);
  CHECK(cache->free_pages() == 2);
  // Given back already: refused, naming the page, and nothing changes.
  auto again = cache->unreserve_pages(std::vector<std::int32_t>{(*r)[2], (*r)[0]});
  CHECK(again.code() == StatusCode::kInvalidArgument);
  CHECK(again.message().find(std::to_string((*r)[0])) != std::string::npos);
  CHECK(cache->reserved_pages() == 3);
  CHECK(cache->free_pages() == 2);
  CHECK(cache->unreserve_pages(std::vector<std::int32_t>{(*r)[2], (*r)[2]}).code() == StatusCode::kInvalidArgument);
  CHECK(cache->unreserve_pages(std::vector<std::int32_t>{-1}).code() == StatusCode::kInvalidArgument);
  CHECK(cache->unreserve_pages(std::vector<std::int32_t>{8}).code() == StatusCode::kInvalidArgument);
  CHECK(cache->reserve_pages(0).status().code() == StatusCode::kInvalidArgument);
  CHECK(cache->reserved_pages() == 3);
  CHECK(cache->free_pages() == 2);
}

TEST_CASE("kv cache: PagedKvCache adopts a sequence from reserved pages and frees the rest", "[kv_cache][reserve]") {
  auto cache = PagedKvCache::create({8, 4, 2, 8, DType::kF32, 2});
  REQUIRE(cache.ok());
  auto r = cache->reserve_pages(4);
  REQUIRE(r.ok());
  REQUIRE(cache->add_sequence(SequenceId(2)).ok());
  // Refusals: the id is live, a negative length, too few pages, a page not reserved or twice.
  CHECK(cache->adopt_sequence(SequenceId(2), *r, 5).code() == StatusCode::kAlreadyExists);
  CHECK(cache->adopt_sequence(SequenceId(7), *r, -1).code() == StatusCode::kInvalidArgument);
  CHECK(cache->adopt_sequence(SequenceId(7), *r, 17).code() == StatusCode::kInvalidArgument);
  const std::vector<std::int32_t> twice = {(*r)[0], (*r)[1], (*r)[0]};
  CHECK(cache->adopt_sequence(SequenceId(7), twice, 5).code() == StatusCode::kInvalidArgument);
  std::int32_t free_page = 0;
  while (std::ranges::find(*r, free_page) != r->end()) ++free_page;
  const std::vector<std::int32_t> not_reserved = {(*r)[0], free_page};
  CHECK(cache->adopt_sequence(SequenceId(7), not_reserved, 5).code() == StatusCode::kInvalidArgument);
  CHECK(cache->reserved_pages() == 4);
  CHECK(cache->free_pages() == 4);
  CHECK(cache->num_sequences() == 1);

  // 6 tokens take the first two pages in order; the other two return to the free list.
  REQUIRE(cache->adopt_sequence(SequenceId(7), *r, 6).ok());
  CHECK(*cache->length(SequenceId(7)) == 6);
  CHECK(std::ranges::equal(*cache->pages(SequenceId(7)), std::vector<std::int32_t>{(*r)[0], (*r)[1]}));
  CHECK(cache->reserved_pages() == 0);
  CHECK(cache->free_pages() == 6);
  // It is an ordinary sequence now: it grows into its last page, then takes free ones.
  REQUIRE(cache->append_tokens(SequenceId(7), 3).ok());
  CHECK(cache->pages(SequenceId(7))->size() == 3);
  CHECK(cache->unreserve_pages(std::vector<std::int32_t>{(*r)[0]}).code() == StatusCode::kInvalidArgument);
  REQUIRE(cache->release(SequenceId(7)).ok());
  CHECK(cache->free_pages() == 8);

  // Zero tokens: no pages kept.
  auto empty = cache->reserve_pages(2);
  REQUIRE(empty.ok());
  REQUIRE(cache->adopt_sequence(SequenceId(8), *empty, 0).ok());
  CHECK(cache->pages(SequenceId(8))->empty());
  CHECK(cache->free_pages() == 8);
  CHECK(cache->reserved_pages() == 0);
}
