// The tiny model of examples/tiny_model: deterministic weights, batch-invariant decoding, and the
// property the KvMigrator relies on: a sequence whose pages and state are copied into another
// cache continues there with the same bits.
#include "tiny_model.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

using laminar::DType;
using laminar::PagedKvCache;
using laminar::SequenceId;
using laminar::SequenceState;
using laminar::StatusCode;
using tiny_model::TinyModel;

namespace {

constexpr std::int32_t kPageSize = 16;

std::vector<std::uint32_t> bits(const std::vector<float>& v) {
  std::vector<std::uint32_t> out;
  for (float f : v) out.push_back(std::bit_cast<std::uint32_t>(f));
  return out;
}

std::vector<std::int32_t> random_prompt(std::mt19937_64& rng, std::size_t n, std::int32_t vocab) {
  std::vector<std::int32_t> p;
  for (std::size_t i = 0; i < n; ++i) p.push_back(std::int32_t(rng() % std::uint64_t(vocab)));
  return p;
}

PagedKvCache make_cache(const TinyModel& model, DType dtype, std::int32_t num_pages = 64) {
  auto cache = PagedKvCache::create(model.kv_layout(num_pages, kPageSize, dtype));
  REQUIRE(cache.ok());
  return std::move(*cache);
}

// Steps `batch` until every sequence in it has `response` response tokens; a sequence that has
// them leaves the batch.
void decode_to(const TinyModel& model, PagedKvCache& cache, std::vector<SequenceState*> batch, std::size_t response) {
  for (;;) {
    std::erase_if(batch, [&](SequenceState* s) { return s->response_tokens.size() >= response; });
    if (batch.empty()) return;
    REQUIRE(model.step(cache, batch).ok());
  }
}

// Copies sequence `id` (its pages in every layer, K and V) from one cache into another.
void copy_sequence(const PagedKvCache& from, PagedKvCache& to, SequenceId id) {
  const std::int64_t len = *from.length(id);
  REQUIRE(to.add_sequence(id).ok());
  REQUIRE(to.append_tokens(id, len).ok());
  const auto src = *from.pages(id);
  const auto dst = *to.pages(id);
  REQUIRE(src.size() == dst.size());
  const std::size_t bytes = std::size_t(from.layout().page_bytes());
  for (std::int32_t l = 0; l < from.layout().num_layers; ++l) {
    for (std::size_t i = 0; i < src.size(); ++i) {
      std::memcpy(*to.k_page(l, dst[i]), *from.k_page(l, src[i]), bytes);
      std::memcpy(*to.v_page(l, dst[i]), *from.v_page(l, src[i]), bytes);
    }
  }
}

}  // namespace

TEST_CASE("tiny model: the same seed gives the same tokens in two instances, another seed other tokens") {
  const std::uint64_t seed = std::random_device{}();
  std::printf("tiny model same seed: prompt seed %llu\n", static_cast<unsigned long long>(seed));
  INFO("prompt seed " << seed);
  std::mt19937_64 rng(seed);
  const std::vector<std::int32_t> prompt = random_prompt(rng, 7, 64);

  // Decodes the prompt to 24 tokens on a fresh instance of the model of weight seed `weights`.
  auto run = [&](std::uint64_t weights) {
    auto model = TinyModel::create({.seed = weights, .num_layers = 3});
    REQUIRE(model.ok());
    PagedKvCache cache = make_cache(*model, DType::kBF16);
    SequenceState s = tiny_model::start_sequence(SequenceId(1), prompt, 99);
    REQUIRE(model->prefill(cache, s).ok());
    decode_to(*model, cache, {&s}, 24);
    return s;
  };
  const SequenceState a = run(5);
  const SequenceState b = run(5);
  const SequenceState c = run(6);
  REQUIRE(a.response_tokens.size() == 24);
  CHECK(a.response_tokens == b.response_tokens);
  CHECK(bits(a.logprobs) == bits(b.logprobs));
  CHECK(a.kv_length == prompt.size() + 23);
  CHECK(a.rng_position == prompt.size() + 24);
  CHECK(bits(a.logprobs) != bits(c.logprobs));
  // Sampled at temperature 0.8, not collapsed onto one token.
  std::vector<std::int32_t> distinct = a.response_tokens;
  std::sort(distinct.begin(), distinct.end());
  CHECK(std::unique(distinct.begin(), distinct.end()) - distinct.begin() > 3);
  for (float lp : a.logprobs) CHECK(lp <= 0.0f);
}

TEST_CASE("tiny model: a sequence decodes to the same bits alone and in a changing batch") {
  const DType dtype = GENERATE(DType::kF32, DType::kBF16);
  const std::uint64_t seed = std::random_device{}();
  std::printf("tiny model batch invariance: %s, seed %llu\n", laminar::dtype_name(dtype).data(),
              static_cast<unsigned long long>(seed));
  INFO("dtype " << laminar::dtype_name(dtype) << ", seed " << seed);
  std::mt19937_64 rng(seed);
  const std::vector<std::int32_t> prompt = random_prompt(rng, 1 + rng() % 20, 64);
  constexpr std::size_t kResponse = 40;

  auto alone_model = TinyModel::create({.seed = 3});
  REQUIRE(alone_model.ok());
  PagedKvCache alone_cache = make_cache(*alone_model, dtype);
  SequenceState alone = tiny_model::start_sequence(SequenceId(1), prompt, 1234);
  REQUIRE(alone_model->prefill(alone_cache, alone).ok());
  decode_to(*alone_model, alone_cache, {&alone}, kResponse);

  // The same sequence fed its prompt and decoded among mates that join, read their own prompts and
  // leave at other times, in a shuffled order every step, with the kernels on two threads.
  auto batch_model = TinyModel::create({.seed = 3, .cpu_threads = 2});
  REQUIRE(batch_model.ok());
  PagedKvCache cache = make_cache(*batch_model, dtype);
  std::vector<SequenceState> mates;
  for (std::uint64_t m = 0; m < 4; ++m) {
    mates.push_back(tiny_model::start_sequence(SequenceId(10 + m), random_prompt(rng, 1 + rng() % 30, 64), rng()));
  }
  REQUIRE(batch_model->prefill(cache, mates[0]).ok());
  SequenceState s = tiny_model::start_sequence(SequenceId(1), prompt, 1234);
  REQUIRE(cache.add_sequence(s.sequence).ok());
  for (std::size_t step = 0; s.response_tokens.size() < kResponse; ++step) {
    std::vector<SequenceState*> batch = {&s};
    for (std::size_t m = 0; m < mates.size(); ++m) {
      const bool joined = step >= 5 * m;
      const bool left = mates[m].response_tokens.size() >= 10 + 8 * m;
      if (!joined || left) continue;
      if (step == 5 * m && m > 0) REQUIRE(cache.add_sequence(mates[m].sequence).ok());
      batch.push_back(&mates[m]);
    }
    std::shuffle(batch.begin(), batch.end(), rng);
    REQUIRE(batch_model->step(cache, batch).ok());
  }
  CHECK(s.response_tokens == alone.response_tokens);
  CHECK(bits(s.logprobs) == bits(alone.logprobs));
  CHECK(s.kv_length == alone.kv_length);
  CHECK(s.rng_position == alone.rng_position);
}

TEST_CASE("tiny model: a sequence copied into another cache continues with the same bits") {
  const DType dtype = GENERATE(DType::kF32, DType::kBF16);
  // Copied with its last page exactly full (the next token opens a new page), and partly filled.
  const std::uint64_t copy_kv = GENERATE(std::uint64_t(2 * kPageSize), std::uint64_t(2 * kPageSize + 5));
  const std::uint64_t seed = std::random_device{}();
  std::printf("tiny model copy: %s, copied at %llu tokens, seed %llu\n", laminar::dtype_name(dtype).data(),
              static_cast<unsigned long long>(copy_kv), static_cast<unsigned long long>(seed));
  INFO("dtype " << laminar::dtype_name(dtype) << ", copied at " << copy_kv << " tokens, seed " << seed);
  std::mt19937_64 rng(seed);
  auto model = TinyModel::create({.seed = 11, .num_layers = 3});
  REQUIRE(model.ok());

  PagedKvCache here = make_cache(*model, dtype);
  SequenceState s = tiny_model::start_sequence(SequenceId(1), random_prompt(rng, 1 + rng() % 20, 64), rng());
  SequenceState mate = tiny_model::start_sequence(SequenceId(2), random_prompt(rng, 9, 64), rng());
  REQUIRE(model->prefill(here, s).ok());
  REQUIRE(model->prefill(here, mate).ok());
  // kv_length is prompt + response - 1: the last sampled token is not fed yet.
  const std::size_t copy_at = std::size_t(copy_kv) + 1 - s.prompt_tokens.size();
  decode_to(*model, here, {&s, &mate}, copy_at);
  REQUIRE(s.kv_length == copy_kv);

  // The other cache already holds a sequence, so the copy lands in other page ids.
  PagedKvCache there = make_cache(*model, dtype);
  SequenceState filler = tiny_model::start_sequence(SequenceId(3), random_prompt(rng, 2 * kPageSize + 3, 64), rng());
  REQUIRE(model->prefill(there, filler).ok());
  copy_sequence(here, there, s.sequence);
  SequenceState moved = s;
  const auto here_pages = *here.pages(s.sequence);
  const auto there_pages = *there.pages(s.sequence);
  CHECK(std::vector<std::int32_t>(here_pages.begin(), here_pages.end()) !=
        std::vector<std::int32_t>(there_pages.begin(), there_pages.end()));

  constexpr std::size_t kResponse = 60;
  decode_to(*model, here, {&s, &mate}, kResponse);
  decode_to(*model, there, {&moved, &filler}, kResponse);
  CHECK(moved.response_tokens == s.response_tokens);
  CHECK(bits(moved.logprobs) == bits(s.logprobs));

  SECTION("a copy missing one layer's V pages continues with other bits") {
    PagedKvCache broken = make_cache(*model, dtype);
    SequenceState t = tiny_model::start_sequence(SequenceId(1), s.prompt_tokens, s.seed);
    REQUIRE(model->prefill(broken, t).ok());
    decode_to(*model, broken, {&t}, copy_at);
    PagedKvCache other = make_cache(*model, dtype);
    copy_sequence(broken, other, t.sequence);
    const auto pages = *other.pages(t.sequence);
    for (std::int32_t page : pages) std::memset(*other.v_page(1, page), 0, std::size_t(other.layout().page_bytes()));
    SequenceState u = t;
    decode_to(*model, other, {&u}, kResponse);
    CHECK(bits(u.logprobs) != bits(s.logprobs));
  }
}

TEST_CASE("tiny model: bad configurations and steps are refused and change nothing") {
  CHECK(TinyModel::create({.head_dim = 96}).status().code() == StatusCode::kInvalidArgument);
  CHECK(TinyModel::create({.num_qo_heads = 6, .num_kv_heads = 2}).status().code() == StatusCode::kInvalidArgument);
  CHECK(TinyModel::create({.num_qo_heads = 32, .num_kv_heads = 2}).status().code() == StatusCode::kInvalidArgument);
  CHECK(TinyModel::create({.vocab = 0}).status().code() == StatusCode::kInvalidArgument);
  CHECK(TinyModel::create({.num_layers = 0}).status().code() == StatusCode::kInvalidArgument);

  auto model = TinyModel::create({.seed = 1});
  REQUIRE(model.ok());
  // Three pages: the sequence below fills two, so a batch opening two new pages does not fit.
  PagedKvCache cache = make_cache(*model, DType::kF32, 3);
  SequenceState s = tiny_model::start_sequence(SequenceId(1), std::vector<std::int32_t>(kPageSize, 1), 7);
  REQUIRE(model->prefill(cache, s).ok());
  decode_to(*model, cache, {&s}, kPageSize + 1);
  REQUIRE(s.kv_length == 2 * kPageSize);
  const SequenceState before = s;

  auto refused = [&](std::vector<SequenceState*> batch, StatusCode code) {
    const laminar::Status st = model->step(cache, batch);
    INFO(st.to_string());
    CHECK(st.code() == code);
    CHECK(*cache.length(s.sequence) == std::int64_t(before.kv_length));
    CHECK(cache.free_pages() == 1);
  };
  SequenceState t = s;
  SECTION("a state that disagrees with the cache") {
    t.kv_length -= 1;
    refused({&t}, StatusCode::kInvalidArgument);
  }
  SECTION("a sequence not in the cache") {
    t.sequence = SequenceId(9);
    refused({&t}, StatusCode::kNotFound);
  }
  SECTION("a token outside the vocabulary") {
    t.response_tokens.back() = 64;
    refused({&t}, StatusCode::kInvalidArgument);
  }
  SECTION("a sequence twice") { refused({&s, &s}, StatusCode::kInvalidArgument); }
  SECTION("a null sequence") { refused({&s, nullptr}, StatusCode::kInvalidArgument); }
  SECTION("sampling settings the kernel refuses") {
    t.top_p = 1.5f;
    refused({&t}, StatusCode::kInvalidArgument);
  }
  SECTION("no token left to feed") {
    t.kv_length = std::uint64_t(tiny_model::total_tokens(t));
    refused({&t}, StatusCode::kInvalidArgument);
  }
  SECTION("a batch that needs more free pages than there are") {
    SequenceState u = tiny_model::start_sequence(SequenceId(2), {1}, 8);
    REQUIRE(cache.add_sequence(u.sequence).ok());
    refused({&s, &u}, StatusCode::kResourceExhausted);
  }
  SECTION("a cache of another model") {
    auto wider = TinyModel::create({.seed = 1, .head_dim = 128});
    REQUIRE(wider.ok());
    PagedKvCache other = make_cache(*wider, DType::kF32);
    REQUIRE(other.add_sequence(s.sequence).ok());
    REQUIRE(other.append_tokens(s.sequence, std::int64_t(s.kv_length)).ok());
    CHECK(model->step(other, std::vector<SequenceState*>{&t}).code() == StatusCode::kInvalidArgument);
  }
  CHECK(s == before);
  SECTION("prefill of a sequence already fed") {
    CHECK(model->prefill(cache, t).code() == StatusCode::kInvalidArgument);
  }
}
