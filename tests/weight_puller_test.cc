// WeightPuller on the CPU path against a same-process relay: pulls, the idle rule, shards,
// prefetch-then-swap, cancel and resume, checksum failures, bad destinations.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <random>
#include <thread>

#include "cuda_absent.h"
#include "laminar/weight_puller.h"
#include "stop_half_way.h"
#include "relay_test_util.h"

using laminar::NamedTensor;
using laminar::PullAction;
using laminar::PullPolicy;
using laminar::RelayStore;
using laminar::StatusCode;
using laminar::TensorView;
using laminar::Version;
using laminar::WeightPuller;
using laminar::WeightPullerOptions;
using laminar::testing::first_mismatch;
using laminar::testing::WeightSet;

namespace {

constexpr std::uint64_t kSeed = 0xbeef;

std::shared_ptr<RelayStore> make_relay() {
  laminar::RelayStoreOptions o;
  o.chunk_bytes = 4096;
  return RelayStore::create(o).value();
}

void publish(RelayStore& s, std::uint64_t v, std::int64_t scale = 1) {
  WeightSet w = WeightSet::make(kSeed, v, scale);
  REQUIRE(s.publish(Version(v), w.manifest, w.named).ok());
  REQUIRE(s.wait_for_version(Version(v), std::chrono::seconds(10)).ok());
}

// Engine-side weight buffers with the same layout, filled with a marker so untouched bytes show.
WeightSet engine_buffers(std::int64_t scale = 1) {
  WeightSet w = WeightSet::make(kSeed, 0, scale);
  for (auto& t : w.storage) std::fill(t.begin(), t.end(), std::byte{0xAB});
  return w;
}

bool untouched(const std::vector<std::byte>& t) {
  return std::all_of(t.begin(), t.end(), [](std::byte b) { return b == std::byte{0xAB}; });
}

}  // namespace

TEST_CASE("pull copies a version into host destinations, byte for byte", "[weight_puller]") {
  auto relay = make_relay();
  auto puller = WeightPuller::create(relay).value();
  CHECK_FALSE(puller->newest_version());
  CHECK(puller->next_action(false).action == PullAction::kNone);
  publish(*relay, 1);
  publish(*relay, 2);
  CHECK(puller->newest_version() == Version(2));
  auto d = puller->next_action(false);
  CHECK(d.action == PullAction::kPull);
  CHECK(d.version == Version(2));
  WeightSet dst = engine_buffers();
  REQUIRE(puller->pull(d.version, dst.named, false).ok());
  CHECK(puller->current_version() == Version(2));
  for (std::size_t i = 0; i < dst.storage.size(); ++i) CHECK(first_mismatch(dst.storage[i], kSeed, 2, i) == -1);
  CHECK(puller->next_action(false).action == PullAction::kNone);
}

TEST_CASE("pull refuses while a trajectory is live and leaves the weights alone", "[weight_puller]") {
  auto relay = make_relay();
  publish(*relay, 1);
  auto puller = WeightPuller::create(relay).value();
  WeightSet dst = engine_buffers();
  REQUIRE(puller->pull(Version(1), dst.named, false).ok());
  publish(*relay, 2);
  CHECK(puller->next_action(true).action == PullAction::kNone);
  auto st = puller->pull(Version(2), dst.named, true);
  CHECK(st.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(st.message(), Catch::Contains("live trajectory"));
  CHECK(puller->current_version() == Version(1));
  for (std::size_t i = 0; i < dst.storage.size(); ++i) CHECK(first_mismatch(dst.storage[i], kSeed, 1, i) == -1);
  CHECK(puller->prefetch(Version(2)).code() == StatusCode::kFailedPrecondition);
}

TEST_CASE("bad destinations and versions are clear errors and copy nothing", "[weight_puller]") {
  auto relay = make_relay();
  publish(*relay, 3);
  auto puller = WeightPuller::create(relay).value();
  WeightSet dst = engine_buffers();
  auto expect = [&](Version v, std::vector<NamedTensor> named, StatusCode code, const std::string& needle) {
    auto st = puller->pull(v, named, false);
    INFO(st.to_string());
    CHECK(st.code() == code);
    CHECK_THAT(st.message(), Catch::Contains(needle));
    for (const auto& t : dst.storage) CHECK(untouched(t));
    CHECK_FALSE(puller->current_version());
  };
  expect(Version(9), dst.named, StatusCode::kNotFound, "version 9");
  expect(Version(3), {}, StatusCode::kInvalidArgument, "no destination");
  auto named = dst.named;
  named[4].name = "lm_head";
  expect(Version(3), named, StatusCode::kNotFound, "lm_head");
  named = dst.named;
  named.push_back(dst.named[1]);
  expect(Version(3), named, StatusCode::kInvalidArgument, "'layer0.w' is given twice");
  named = dst.named;
  const std::int64_t shape[] = {61, 46};
  std::vector<float> other(61 * 46);
  named[1].view = TensorView::contiguous(other.data(), laminar::DType::kF32, shape).value();
  expect(Version(3), named, StatusCode::kInvalidArgument, "layer0.w");
  named = dst.named;
  const std::int64_t b_shape[] = {45};
  named[2].view = TensorView::contiguous(dst.storage[2].data(), laminar::DType::kI32, b_shape).value();
  expect(Version(3), named, StatusCode::kInvalidArgument, "layer0.b");
  named = dst.named;
  const auto& e0 = dst.manifest.entries()[0];
  named[0].view =
      TensorView::contiguous(dst.storage[0].data(), e0.dtype, e0.shape, laminar::Device::cuda(0)).value();
  // Without a device: not compiled in, or no device to copy to (not retryable).
  if (const auto code = laminar::testing::code_without_device()) {
    CHECK(puller->pull(Version(3), named, false).code() == *code);
    for (const auto& t : dst.storage) CHECK(untouched(t));
  }
  CHECK(WeightPuller::create(nullptr).status().code() == StatusCode::kInvalidArgument);
  WeightPullerOptions o;
  o.copy_chunk_bytes = 16;
  CHECK(WeightPuller::create(relay, o).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("a sharded pull fetches only its tensors", "[weight_puller]") {
  auto relay = make_relay();
  publish(*relay, 5);
  auto puller = WeightPuller::create(relay).value();
  WeightSet dst = engine_buffers();
  std::vector<NamedTensor> shard = {dst.named[3], dst.named[1]};
  REQUIRE(puller->pull(Version(5), shard, false).ok());
  CHECK(first_mismatch(dst.storage[3], kSeed, 5, 3) == -1);
  CHECK(first_mismatch(dst.storage[1], kSeed, 5, 1) == -1);
  CHECK(untouched(dst.storage[0]));
  CHECK(untouched(dst.storage[2]));
  CHECK(untouched(dst.storage[4]));
}

TEST_CASE("prefetch reserves a version while generating; swap installs it when idle", "[weight_puller]") {
  auto relay = make_relay();
  publish(*relay, 1);
  WeightPullerOptions o;
  o.policy = PullPolicy::kPrefetchThenSwap;
  o.verify_checksums = true;
  auto puller = WeightPuller::create(relay, o).value();
  WeightSet dst = engine_buffers();
  REQUIRE(puller->pull(Version(1), dst.named, false).ok());
  publish(*relay, 2);
  auto d = puller->next_action(true);
  REQUIRE(d.action == PullAction::kPrefetch);
  REQUIRE(puller->prefetch(d.version).ok());
  CHECK(puller->prefetched_version() == Version(2));
  CHECK(puller->next_action(true).action == PullAction::kNone);
  // Newer versions arrive; the reserved one is not freed under the puller.
  publish(*relay, 3);
  publish(*relay, 4);
  CHECK(relay->acquire(Version(3)).status().code() == StatusCode::kNotFound);
  CHECK(relay->acquire(Version(2)).ok());
  CHECK(puller->swap(dst.named, true).code() == StatusCode::kFailedPrecondition);
  CHECK(puller->current_version() == Version(1));
  REQUIRE(puller->swap(dst.named, false).ok());
  CHECK(puller->current_version() == Version(2));
  CHECK_FALSE(puller->prefetched_version());
  for (std::size_t i = 0; i < dst.storage.size(); ++i) CHECK(first_mismatch(dst.storage[i], kSeed, 2, i) == -1);
  CHECK(relay->acquire(Version(2)).status().code() == StatusCode::kNotFound);  // reservation dropped
  CHECK(puller->swap(dst.named, false).code() == StatusCode::kFailedPrecondition);
  CHECK(puller->next_action(false).version == Version(4));
}

TEST_CASE("a cancelled pull resumes where it stopped", "[weight_puller]") {
  const std::uint64_t seed = std::random_device{}();
  std::printf("weight_puller_test cancel seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937 rng(std::uint32_t(seed & 0xffffffffu));
  auto relay = make_relay();
  publish(*relay, 1, /*scale=*/96);  // a few MB, so the pull takes long enough to stop half way
  WeightPullerOptions o;
  o.copy_chunk_bytes = 4096;
  auto puller = WeightPuller::create(relay, o).value();
  WeightSet dst = engine_buffers(96);
  std::uint64_t total = 0;
  for (const auto& t : dst.storage) total += t.size();

  const laminar::testing::HalfWay half =
      laminar::testing::stop_half_way(*puller, [&] { return puller->pull(Version(1), dst.named, false); }, rng);
  INFO(half.error.to_string());
  REQUIRE(half.error.ok());
  CHECK_FALSE(puller->current_version());
  const std::optional<WeightPuller::StoppedPull> stop = half.stopped;
  REQUIRE(stop);
  CHECK(stop->version == Version(1));
  REQUIRE(stop->bytes_done < total);
  // Mark everything already copied; a resumed pull must not copy it again.
  std::uint64_t left = stop->bytes_done;
  for (auto& t : dst.storage) {
    const std::uint64_t k = std::min<std::uint64_t>(left, t.size());
    std::fill(t.begin(), t.begin() + std::ptrdiff_t(k), std::byte{0xCD});
    left -= k;
  }
  REQUIRE(puller->pull(Version(1), dst.named, false).ok());
  CHECK(puller->current_version() == Version(1));
  CHECK_FALSE(puller->stopped_pull());
  left = stop->bytes_done;
  for (std::size_t i = 0; i < dst.storage.size(); ++i) {
    auto& t = dst.storage[i];
    const std::uint64_t k = std::min<std::uint64_t>(left, t.size());
    left -= k;
    CHECK(std::all_of(t.begin(), t.begin() + std::ptrdiff_t(k), [](std::byte b) { return b == std::byte{0xCD}; }));
    const std::span<const std::byte> rest(t.data() + k, t.size() - k);
    std::vector<std::byte> want(t.size());
    laminar::testing::fill_pattern(want, kSeed, 1, i);
    CHECK(std::equal(rest.begin(), rest.end(), want.begin() + std::ptrdiff_t(k)));
  }
  // A full pull afterwards starts from scratch.
  REQUIRE(puller->pull(Version(1), dst.named, false).ok());
  for (std::size_t i = 0; i < dst.storage.size(); ++i) CHECK(first_mismatch(dst.storage[i], kSeed, 1, i) == -1);
}

TEST_CASE("with verification on, a damaged chunk is never served", "[weight_puller]") {
  auto relay = make_relay();
  publish(*relay, 1);
  WeightPullerOptions o;
  o.verify_checksums = true;
  auto puller = WeightPuller::create(relay, o).value();
  {
    // Flip a bit in the relay's memory behind its back, inside tensor 'layer1.w'.
    auto h = relay->acquire().value();
    auto t = h.tensor("layer1.w").value();
    auto* p = const_cast<std::byte*>(t.data() + t.size() / 2);
    *p ^= std::byte{0x01};
  }
  WeightSet dst = engine_buffers();
  auto st = puller->pull(Version(1), dst.named, false);
  CHECK(st.code() == StatusCode::kDataLoss);
  CHECK_THAT(st.message(), Catch::Contains("layer1.w") && Catch::Contains("chunk"));
  for (const auto& t : dst.storage) CHECK(untouched(t));
  // A shard that does not touch the damaged chunk still pulls.
  std::vector<NamedTensor> shard = {dst.named[0]};
  CHECK(puller->pull(Version(1), shard, false).ok());
  CHECK(first_mismatch(dst.storage[0], kSeed, 1, 0) == -1);
}
