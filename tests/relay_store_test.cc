// RelayStore in one process: publish, atomic commit, ref-counted reads, memory budget, sharded reads,
// chunk ingest with corrupt chunks and resume, bad input.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <future>
#include <random>
#include <set>
#include <stop_token>
#include <thread>

#include "cuda_absent.h"
#include "laminar/clock.h"
#include "laminar/relay_store.h"
#include "relay_test_util.h"

using laminar::NamedTensor;
using laminar::ReadHandle;
using laminar::RelayStore;
using laminar::RelayStoreOptions;
using laminar::StatusCode;
using laminar::TensorView;
using laminar::Version;
using laminar::testing::first_mismatch;
using laminar::testing::WeightSet;

namespace {

constexpr std::uint64_t kSeed = 0x5eed;
constexpr auto kWait = std::chrono::seconds(10);

std::shared_ptr<RelayStore> make_store(std::uint64_t chunk = 4096, std::uint64_t budget = ~0ull) {
  RelayStoreOptions o;
  o.chunk_bytes = chunk;
  o.memory_budget_bytes = budget;
  return RelayStore::create(o).value();
}

// Every tensor of h equals the pattern of `version`, and the padding between tensors is zero.
void check_version(const ReadHandle& h, std::uint64_t version) {
  REQUIRE(h.valid());
  CHECK(h.version() == Version(version));
  const auto& m = h.manifest();
  std::uint64_t pos = 0;
  for (std::size_t i = 0; i < m.size(); ++i) {
    const auto& e = m.entries()[i];
    for (std::uint64_t b = pos; b < e.offset; ++b) REQUIRE(h.bytes()[b] == std::byte{0});
    INFO("tensor " << e.name << " of version " << version);
    CHECK(first_mismatch(h.tensor(e.name).value(), kSeed, version, i) == -1);
    pos = e.offset + e.nbytes;
  }
  for (std::uint64_t b = pos; b < h.bytes().size(); ++b) REQUIRE(h.bytes()[b] == std::byte{0});
  CHECK(h.verify(0, h.plan().num_chunks()).ok());
}

void publish_and_wait(RelayStore& s, std::uint64_t v, std::int64_t scale = 1) {
  WeightSet w = WeightSet::make(kSeed, v, scale);
  REQUIRE(s.publish(Version(v), w.manifest, w.named).ok());
  REQUIRE(s.wait_for_version(Version(v), kWait).ok());
}

}  // namespace

TEST_CASE("publish then acquire returns every byte, padding zeroed", "[relay_store]") {
  auto s = make_store();
  CHECK_FALSE(s->newest_version());
  CHECK(s->acquire().status().code() == StatusCode::kNotFound);
  WeightSet w = WeightSet::make(kSeed, 1);
  REQUIRE(w.manifest.total_bytes() > 4 * 4096);  // several chunks, tensors straddling them
  REQUIRE(s->publish(Version(1), w.manifest, w.named).ok());
  // The source can be reused as soon as publish returns: the store owns a copy.
  w.fill(kSeed, 99);
  REQUIRE(s->wait_for_version(Version(1), kWait).ok());
  CHECK(s->newest_version() == Version(1));
  auto h = s->acquire();
  REQUIRE(h.ok());
  check_version(*h, 1);
  CHECK(h->manifest() == w.manifest);
  CHECK(s->acquire(Version(1)).ok());
  auto missing = s->acquire(Version(2));
  CHECK(missing.status().code() == StatusCode::kNotFound);
  CHECK_THAT(missing.status().message(), Catch::Contains("version 2"));
}

TEST_CASE("versions going backwards are refused and the committed one is untouched", "[relay_store]") {
  auto s = make_store();
  publish_and_wait(*s, 3);
  for (std::uint64_t v : {3u, 2u, 0u}) {
    WeightSet w = WeightSet::make(kSeed, 50);
    auto st = s->publish(Version(v), w.manifest, w.named);
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(st.message(), Catch::Contains("version " + std::to_string(v)));
  }
  CHECK(s->newest_version() == Version(3));
  check_version(s->acquire().value(), 3);
  publish_and_wait(*s, 4);
  check_version(s->acquire().value(), 4);
}

TEST_CASE("publish rejects unknown, missing, repeated, mistyped and misshaped tensors", "[relay_store]") {
  auto s = make_store();
  publish_and_wait(*s, 1);
  WeightSet w = WeightSet::make(kSeed, 2);
  auto expect_bad = [&](std::vector<NamedTensor> named, const std::string& needle) {
    auto st = s->publish(Version(2), w.manifest, named);
    INFO(st.to_string());
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(st.message(), Catch::Contains(needle));
  };
  auto named = w.named;
  named[2].name = "layer0.bias";
  expect_bad(named, "'layer0.bias' is not in the manifest");
  named = w.named;
  named.pop_back();
  expect_bad(named, "no tensor given for manifest entry 'steps'");
  named = w.named;
  named.push_back(w.named[0]);
  expect_bad(named, "'embed' is given twice");
  named = w.named;
  const std::int64_t b_shape[] = {45};
  named[2].view = TensorView::contiguous(w.storage[2].data(), laminar::DType::kI32, b_shape).value();
  expect_bad(named, "layer0.b");
  named = w.named;
  const std::int64_t wrong_shape[] = {45, 61};
  named[1].view = TensorView::contiguous(w.storage[1].data(), laminar::DType::kF32, wrong_shape).value();
  expect_bad(named, "layer0.w");
  named = w.named;
  const std::int64_t shape[] = {61, 45};
  const std::int64_t strides[] = {1, 61};  // column-major
  named[1].view = TensorView::strided(w.storage[1].data(), laminar::DType::kF32, shape, strides).value();
  expect_bad(named, "not dense row-major");
  auto empty = s->publish(Version(2), laminar::WeightManifest{}, {});
  CHECK(empty.code() == StatusCode::kInvalidArgument);

  // Nothing above spent version 2 or touched version 1.
  CHECK(s->newest_version() == Version(1));
  check_version(s->acquire().value(), 1);
  publish_and_wait(*s, 2);
  check_version(s->acquire().value(), 2);
}

TEST_CASE("device tensors without a usable device are a clear error", "[relay_store]") {
  const auto code = laminar::testing::code_without_device();
  if (!code) return;  // a device is present: the tensors below would be read on it
  auto s = make_store();
  WeightSet w = WeightSet::make(kSeed, 1);
  auto named = w.named;
  const auto& e = w.manifest.entries()[0];
  named[0].view = TensorView::contiguous(w.storage[0].data(), e.dtype, e.shape, laminar::Device::cuda(0)).value();
  auto st = s->publish(Version(1), w.manifest, named);
  INFO(st.to_string());
  CHECK(st.code() == *code);
  CHECK_FALSE(s->newest_version());
}

TEST_CASE("publish never waits for readers; old versions live while handles hold them", "[relay_store]") {
  auto s = make_store();
  publish_and_wait(*s, 1);
  ReadHandle h1 = s->acquire().value();
  ReadHandle h1_copy = h1;
  for (std::uint64_t v = 2; v <= 5; ++v) publish_and_wait(*s, v);
  CHECK(s->newest_version() == Version(5));
  check_version(h1, 1);  // still intact under four newer publishes
  CHECK(s->acquire(Version(1)).ok());
  CHECK(s->acquire(Version(3)).status().code() == StatusCode::kNotFound);  // freed: nobody held it
  CHECK(s->stats().versions_held == 2);
  h1 = ReadHandle();
  CHECK(s->stats().versions_held == 2);  // the copy still holds it
  h1_copy = ReadHandle();
  CHECK(s->stats().versions_held == 1);
  CHECK(s->acquire(Version(1)).status().code() == StatusCode::kNotFound);
}

TEST_CASE("the memory budget is kept and a full store says who holds what", "[relay_store]") {
  WeightSet probe = WeightSet::make(kSeed, 0);
  const std::uint64_t one = probe.manifest.total_bytes();
  auto s = make_store(4096, 2 * one);
  publish_and_wait(*s, 1);
  ReadHandle h1 = s->acquire().value();
  publish_and_wait(*s, 2);
  WeightSet w = WeightSet::make(kSeed, 3);
  auto st = s->publish(Version(3), w.manifest, w.named);
  CHECK(st.code() == StatusCode::kResourceExhausted);
  CHECK_THAT(st.message(), Catch::Contains("v1") && Catch::Contains("1 refs"));
  check_version(s->acquire().value(), 2);
  h1 = ReadHandle();
  for (std::uint64_t v = 3; v <= 6; ++v) {
    publish_and_wait(*s, v);
    const auto stats = s->stats();
    CHECK(stats.bytes_held + stats.bytes_recycled <= 2 * one);
  }
  check_version(s->acquire().value(), 6);
}

TEST_CASE("sharded reads return only the named tensors", "[relay_store]") {
  auto s = make_store();
  publish_and_wait(*s, 7);
  ReadHandle h = s->acquire().value();
  const std::vector<std::string> names = {"layer1.w", "embed"};
  auto shard = h.shard(names);
  REQUIRE(shard.ok());
  REQUIRE(shard->size() == 2);
  CHECK((*shard)[0].entry->name == "layer1.w");
  CHECK(first_mismatch((*shard)[0].bytes, kSeed, 7, 3) == -1);
  CHECK(first_mismatch((*shard)[1].bytes, kSeed, 7, 0) == -1);
  CHECK((*shard)[1].bytes.size() == 97 * 33 * 2);
  const std::vector<std::string> unknown = {"embed", "lm_head"};
  auto bad = h.shard(unknown);
  CHECK(bad.status().code() == StatusCode::kNotFound);
  CHECK_THAT(bad.status().message(), Catch::Contains("lm_head"));
  const std::vector<std::string> twice = {"embed", "embed"};
  CHECK(h.shard(twice).status().code() == StatusCode::kInvalidArgument);
  CHECK(h.tensor("nope").status().code() == StatusCode::kNotFound);
  CHECK(h.chunk(h.plan().num_chunks()).status().code() == StatusCode::kOutOfRange);
}

TEST_CASE("a relay fed chunk by chunk refuses corrupt chunks, resumes, and commits atomically",
          "[relay_store]") {
  const std::uint64_t seed = std::random_device{}();
  std::printf("relay_store_test ingest seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  auto upstream = make_store();
  publish_and_wait(*upstream, 4);
  ReadHandle src = upstream->acquire().value();
  const auto n = src.plan().num_chunks();
  REQUIRE(n >= 5);

  auto relay = make_store(1 << 16);  // its own chunk size does not matter for received versions
  CHECK(relay->put_chunk(Version(4), 0, src.chunk(0).value(), src.checksum(0).value()).code() ==
        StatusCode::kNotFound);
  REQUIRE(relay->begin_version(Version(4), src.manifest(), src.plan()).ok());
  CHECK(relay->begin_version(Version(4), src.manifest(), src.plan()).code() == StatusCode::kInvalidArgument);

  // First half arrives, one chunk corrupted on the way, then the link is cut.
  const std::uint32_t corrupt = std::uint32_t(rng() % (n / 2));
  for (std::uint32_t i = 0; i < n / 2; ++i) {
    std::vector<std::byte> wire(src.chunk(i)->begin(), src.chunk(i)->end());
    if (i == corrupt) wire[rng() % wire.size()] ^= std::byte{0x10};
    auto st = relay->put_chunk(Version(4), i, wire, src.checksum(i).value());
    CHECK(st.code() == (i == corrupt ? StatusCode::kDataLoss : StatusCode::kOk));
  }
  CHECK_FALSE(relay->newest_version());
  CHECK(relay->acquire(Version(4)).status().code() == StatusCode::kUnavailable);
  CHECK(relay->stats().chunks_rejected == 1);
  CHECK(relay->resume_point(Version(4)).value() == corrupt);

  // Wrong sizes and indices are refused too.
  const auto c0 = src.chunk(0).value();
  CHECK(relay->put_chunk(Version(4), 0, c0.first(c0.size() - 1), src.checksum(0).value()).code() ==
        StatusCode::kDataLoss);
  CHECK(relay->put_chunk(Version(4), n, c0, src.checksum(0).value()).code() == StatusCode::kOutOfRange);

  // Resume: refetch from the resume point, out of order, duplicates allowed.
  std::vector<std::uint32_t> rest;
  for (std::uint32_t i = relay->resume_point(Version(4)).value(); i < n; ++i) rest.push_back(i);
  std::shuffle(rest.begin(), rest.end(), rng);
  // The refetch includes chunks that already arrived, so the version commits when the last MISSING
  // one lands, which need not be the last put.
  std::set<std::uint32_t> missing = {corrupt};
  for (std::uint32_t i = n / 2; i < n; ++i) missing.insert(i);
  for (std::uint32_t i : rest) {
    CHECK(bool(relay->newest_version()) == missing.empty());
    REQUIRE(relay->put_chunk(Version(4), i, src.chunk(i).value(), src.checksum(i).value()).ok());
    missing.erase(i);
  }
  CHECK(relay->newest_version() == Version(4));
  ReadHandle got = relay->acquire().value();
  check_version(got, 4);
  for (std::uint32_t i = 0; i < n; ++i) CHECK(got.checksum(i).value() == src.checksum(i).value());
  // A late duplicate is harmless; a differing chunk for a committed version is refused.
  CHECK(relay->put_chunk(Version(4), 1, src.chunk(1).value(), src.checksum(1).value()).ok());
  CHECK(relay->put_chunk(Version(4), 1, src.chunk(1).value(), src.checksum(1).value() ^ 1).code() ==
        StatusCode::kFailedPrecondition);
  check_version(relay->acquire().value(), 4);
}

TEST_CASE("an abandoned transfer frees its memory and leaves the committed version", "[relay_store]") {
  auto upstream = make_store();
  publish_and_wait(*upstream, 1);
  ReadHandle v1 = upstream->acquire(Version(1)).value();
  publish_and_wait(*upstream, 2);
  auto relay = make_store();
  REQUIRE(relay->begin_version(Version(1), v1.manifest(), v1.plan()).ok());
  for (std::uint32_t i = 0; i < v1.plan().num_chunks(); ++i) {
    REQUIRE(relay->put_chunk(Version(1), i, v1.chunk(i).value(), v1.checksum(i).value()).ok());
  }
  ReadHandle v2 = upstream->acquire(Version(2)).value();
  REQUIRE(relay->begin_version(Version(2), v2.manifest(), v2.plan()).ok());
  REQUIRE(relay->put_chunk(Version(2), 0, v2.chunk(0).value(), v2.checksum(0).value()).ok());
  CHECK(relay->abandon(Version(1)).code() == StatusCode::kFailedPrecondition);
  REQUIRE(relay->abandon(Version(2)).ok());
  CHECK(relay->resume_point(Version(2)).status().code() == StatusCode::kNotFound);
  CHECK(relay->stats().versions_held == 1);
  check_version(relay->acquire().value(), 1);
  auto plan_mismatch = laminar::ChunkPlan::make(v2.plan().total_bytes() + 256, 4096).value();
  CHECK(relay->begin_version(Version(3), v2.manifest(), plan_mismatch).code() == StatusCode::kInvalidArgument);
}

TEST_CASE("readers racing a publisher only ever see complete versions", "[relay_store]") {
  auto s = make_store(4096, ~0ull);
  constexpr std::uint64_t kVersions = 12;
  std::atomic<int> seen{0};
  std::atomic<int> bad{0};
  auto reader = [&] {
    std::uint64_t last = 0;
    while (last < kVersions) {
      auto h = s->acquire();
      if (!h.ok()) continue;
      const std::uint64_t v = h->version().value();
      if (v < last) ++bad;
      last = v;
      const auto& m = h->manifest();
      for (std::size_t i = 0; i < m.size(); ++i) {
        if (first_mismatch(h->tensor(m.entries()[i].name).value(), kSeed, v, i) != -1) ++bad;
      }
      if (!h->verify(0, h->plan().num_chunks()).ok()) ++bad;
      ++seen;
    }
  };
  std::thread r1(reader), r2(reader);
  for (std::uint64_t v = 1; v <= kVersions; ++v) {
    WeightSet w = WeightSet::make(kSeed, v);
    REQUIRE(s->publish(Version(v), w.manifest, w.named).ok());
  }
  REQUIRE(s->wait_for_version(Version(kVersions), kWait).ok());
  r1.join();
  r2.join();
  CHECK(bad.load() == 0);
  CHECK(seen.load() > 0);
  CHECK(s->stats().versions_held == 1);
}

TEST_CASE("the store's waits end when its clock passes their deadline, not before", "[relay_store]") {
  auto clock = std::make_shared<laminar::ManualClock>();
  RelayStoreOptions o;
  o.chunk_bytes = 4096;
  o.clock = clock;
  std::shared_ptr<RelayStore> s = RelayStore::create(o).value();
  auto waited = std::async(std::launch::async, [&] {
    const laminar::Duration start = clock->now();
    laminar::Status st = s->wait_for_version(Version(1), std::chrono::seconds(30));
    return std::make_pair(st, clock->now() - start);
  });
  REQUIRE(laminar::testing::advance_until_ready(*clock, waited, std::chrono::seconds(1), 1000));
  const auto [st, took] = waited.get();
  CHECK(st.code() == StatusCode::kDeadlineExceeded);
  CHECK_THAT(st.message(), Catch::Contains("none"));
  CHECK(took >= std::chrono::seconds(30));
  auto newer = std::async(std::launch::async, [&] { return s->wait_for_newer(std::nullopt, std::chrono::seconds(5)); });
  REQUIRE(laminar::testing::advance_until_ready(*clock, newer, std::chrono::seconds(1), 1000));
  CHECK_FALSE(newer.get());
  CHECK(s->read_chunk(Version(7), 0, laminar::kForever).status().code() == StatusCode::kNotFound);
  CHECK(s->wait_for_version(Version(1), std::chrono::seconds(-1)).code() == StatusCode::kInvalidArgument);
}

TEST_CASE("the forwarding waits end when their stop_token is stopped or their version is abandoned, with the clock "
          "standing still", "[relay_store]") {
  auto clock = std::make_shared<laminar::ManualClock>();
  RelayStoreOptions o;
  o.chunk_bytes = 4096;
  o.clock = clock;
  std::shared_ptr<RelayStore> s = RelayStore::create(o).value();
  std::stop_source stop_newer;
  auto newer = std::async(std::launch::async, [&] {
    return s->wait_for_newer(std::nullopt, std::chrono::seconds(5), stop_newer.get_token());
  });
  stop_newer.request_stop();
  // Real time only bounds a failure: nothing moves the clock these waits read.
  REQUIRE(newer.wait_for(kWait) == std::future_status::ready);
  CHECK_FALSE(newer.get());

  std::shared_ptr<RelayStore> src = make_store();
  publish_and_wait(*src, 1);
  ReadHandle whole = src->acquire(Version(1)).value();
  REQUIRE(s->begin_version(Version(1), whole.manifest(), whole.plan()).ok());
  std::stop_source stop_chunk;
  auto chunk = std::async(std::launch::async, [&] {
    return s->read_chunk(Version(1), 1, laminar::kForever, stop_chunk.get_token()).status();
  });
  stop_chunk.request_stop();
  REQUIRE(chunk.wait_for(kWait) == std::future_status::ready);
  CHECK(chunk.get().code() == StatusCode::kCancelled);
  CHECK(s->read_chunk(Version(1), 1, laminar::kForever, stop_chunk.get_token()).status().code() ==
        StatusCode::kCancelled);  // stopped before it began: no wait at all

  auto abandoned = std::async(std::launch::async, [&] {
    return s->read_chunk(Version(1), 1, laminar::kForever).status();
  });
  REQUIRE(s->abandon(Version(1)).ok());
  REQUIRE(abandoned.wait_for(kWait) == std::future_status::ready);
  CHECK(abandoned.get().code() == StatusCode::kNotFound);
}

TEST_CASE("wait_for_version times out naming what is there; bad options are refused", "[relay_store]") {
  auto s = make_store();
  auto st = s->wait_for_version(Version(1), std::chrono::milliseconds(5));
  CHECK(st.code() == StatusCode::kDeadlineExceeded);
  CHECK_THAT(st.message(), Catch::Contains("none"));
  RelayStoreOptions o;
  o.chunk_bytes = 1000;
  CHECK(RelayStore::create(o).status().code() == StatusCode::kInvalidArgument);
  o.chunk_bytes = 4096 + 100;
  CHECK(RelayStore::create(o).status().code() == StatusCode::kInvalidArgument);
  o = RelayStoreOptions{};
  o.memory_budget_bytes = 0;
  CHECK(RelayStore::create(o).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("handles outlive the store that made them", "[relay_store]") {
  ReadHandle h;
  {
    auto s = make_store();
    publish_and_wait(*s, 1);
    h = s->acquire().value();
  }
  check_version(h, 1);
}

TEST_CASE("a shareable store keeps each version in a sealed memfd others can only read", "[relay_store]") {
  auto plain = make_store();
  publish_and_wait(*plain, 1);
  CHECK(plain->acquire().value().shared_fd() == -1);

  laminar::RelayStoreOptions o;
  o.chunk_bytes = 4096;
  o.shareable = true;
  auto store = RelayStore::create(o).value();
  publish_and_wait(*store, 1);
  const ReadHandle h = store->acquire().value();
  const int fd = h.shared_fd();
  REQUIRE(fd >= 0);
  const int seals = fcntl(fd, F_GET_SEALS);
  CHECK((seals & F_SEAL_SHRINK) != 0);
  CHECK((seals & F_SEAL_GROW) != 0);
  CHECK((seals & F_SEAL_FUTURE_WRITE) != 0);
  CHECK((seals & F_SEAL_SEAL) != 0);
  // A second, read-only view of the same pages holds the version's bytes; writing is refused.
  const std::size_t n = h.bytes().size();
  void* p = mmap(nullptr, n, PROT_READ, MAP_SHARED, fd, 0);
  REQUIRE(p != MAP_FAILED);
  CHECK(std::memcmp(p, h.bytes().data(), n) == 0);
  munmap(p, n);
  CHECK(mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) == MAP_FAILED);
  CHECK(write(fd, "x", 1) == -1);
  CHECK(ftruncate(fd, 0) == -1);
  check_version(h, 1);
}
