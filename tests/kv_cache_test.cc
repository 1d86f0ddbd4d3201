// PagedKvCache: page accounting, per-sequence page lists, CSR page tables, and validation of
// layouts and page tables given from outside.
#include "laminar/kv_cache.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <random>
#include <vector>

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
