// The relay tier's pure bookkeeping: chunk plans, one store's ledger, the pull decision, the fleet map.
#include <catch2/catch.hpp>

#include "laminar/relay_versions.h"

using laminar::ChunkPlan;
using laminar::FleetVersions;
using laminar::PullAction;
using laminar::PullDecision;
using laminar::PullPolicy;
using laminar::StatusCode;
using laminar::Version;
using laminar::VersionLedger;

namespace {
ChunkPlan plan(std::uint64_t total, std::uint64_t chunk) { return ChunkPlan::make(total, chunk).value(); }

std::vector<Version> commit_all(VersionLedger& l, Version v) {
  std::vector<Version> freed;
  const auto n = l.plan(v).value().num_chunks();
  for (std::uint32_t i = 0; i < n; ++i) {
    auto r = l.chunk_verified(v, i);
    REQUIRE(r.ok());
    CHECK(r->first == (i + 1 == n));
    freed.insert(freed.end(), r->second.begin(), r->second.end());
  }
  return freed;
}
}  // namespace

TEST_CASE("ChunkPlan cuts a buffer into chunks and finds the chunks of a byte range", "[relay_versions]") {
  const ChunkPlan p = plan(10000, 4096);
  CHECK(p.num_chunks() == 3);
  CHECK(p.chunk_offset(2) == 8192);
  CHECK(p.chunk_size(0) == 4096);
  CHECK(p.chunk_size(2) == 10000 - 8192);
  CHECK(p.chunks_covering(0, 1) == std::pair<std::uint32_t, std::uint32_t>{0, 1});
  CHECK(p.chunks_covering(4095, 2) == std::pair<std::uint32_t, std::uint32_t>{0, 2});
  CHECK(p.chunks_covering(4096, 4096) == std::pair<std::uint32_t, std::uint32_t>{1, 2});
  CHECK(p.chunks_covering(9000, 1000) == std::pair<std::uint32_t, std::uint32_t>{2, 3});
  CHECK(p.chunks_covering(5, 0).first == p.chunks_covering(5, 0).second);
  CHECK(plan(8192, 4096).num_chunks() == 2);

  CHECK(ChunkPlan::make(0, 4096).status().code() == StatusCode::kInvalidArgument);
  auto small = ChunkPlan::make(100, 100);
  CHECK(small.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(small.status().message(), Catch::Contains("100"));
  CHECK(ChunkPlan::make(~0ull, 4096).status().code() == StatusCode::kInvalidArgument);
}

TEST_CASE("VersionLedger commits a version only when every chunk is verified", "[relay_versions]") {
  VersionLedger l;
  REQUIRE(l.begin(Version(1), plan(20000, 4096)).ok());
  CHECK_FALSE(l.newest_committed());
  CHECK(l.resume_point(Version(1)).value() == 0);
  REQUIRE(l.chunk_verified(Version(1), 0).ok());
  REQUIRE(l.chunk_verified(Version(1), 2).ok());
  CHECK(l.resume_point(Version(1)).value() == 1);
  CHECK(l.missing_chunks(Version(1)).value() == std::vector<std::uint32_t>{1, 3, 4});
  auto dup = l.chunk_verified(Version(1), 2);
  REQUIRE(dup.ok());
  CHECK_FALSE(dup->first);
  CHECK(l.chunk_verified(Version(1), 5).status().code() == StatusCode::kOutOfRange);
  CHECK(l.chunk_verified(Version(9), 0).status().code() == StatusCode::kNotFound);
  CHECK(l.add_ref(Version(1)).code() == StatusCode::kFailedPrecondition);
  for (std::uint32_t i : {1u, 3u}) REQUIRE_FALSE(l.chunk_verified(Version(1), i)->first);
  CHECK_FALSE(l.is_committed(Version(1)));
  auto last = l.chunk_verified(Version(1), 4);
  REQUIRE(last.ok());
  CHECK(last->first);
  CHECK(l.is_committed(Version(1)));
  CHECK(l.newest_committed() == Version(1));
  CHECK(l.resume_point(Version(1)).value() == 5);
}

TEST_CASE("VersionLedger: versions strictly increase and errors change nothing", "[relay_versions]") {
  VersionLedger l;
  REQUIRE(l.begin(Version(5), plan(8192, 4096)).ok());
  for (Version v : {Version(5), Version(4), Version(0)}) {
    auto st = l.begin(v, plan(8192, 4096));
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(st.message(), Catch::Contains("strictly increase"));
  }
  CHECK(l.versions() == std::vector<Version>{Version(5)});
  CHECK(l.bytes_held() == 8192);
  CHECK(l.begin(Version(6), plan(8192, 4096)).ok());
}

TEST_CASE("VersionLedger frees a version once nobody references it and a newer one committed",
          "[relay_versions]") {
  VersionLedger l;
  REQUIRE(l.begin(Version(1), plan(4096, 4096)).ok());
  CHECK(commit_all(l, Version(1)).empty());
  REQUIRE(l.add_ref(Version(1)).ok());
  REQUIRE(l.add_ref(Version(1)).ok());
  REQUIRE(l.begin(Version(2), plan(4096, 4096)).ok());
  CHECK(commit_all(l, Version(2)).empty());  // v1 is still referenced
  CHECK(l.release(Version(1)).value().empty());
  CHECK(l.release(Version(1)).value() == std::vector<Version>{Version(1)});
  CHECK_FALSE(l.contains(Version(1)));
  CHECK(l.release(Version(2)).status().code() == StatusCode::kFailedPrecondition);
  CHECK(l.release(Version(1)).status().code() == StatusCode::kNotFound);
  // The newest committed version stays even without references.
  CHECK(l.versions() == std::vector<Version>{Version(2)});
  CHECK(l.bytes_held() == 4096);
}

TEST_CASE("VersionLedger drops an unfinished older version when a newer one commits", "[relay_versions]") {
  VersionLedger l;
  REQUIRE(l.begin(Version(1), plan(8192, 4096)).ok());
  REQUIRE(l.chunk_verified(Version(1), 0).ok());
  REQUIRE(l.begin(Version(2), plan(4096, 4096)).ok());
  CHECK(commit_all(l, Version(2)) == std::vector<Version>{Version(1)});
  CHECK(l.versions() == std::vector<Version>{Version(2)});
  CHECK(l.abandon(Version(2)).code() == StatusCode::kFailedPrecondition);
  REQUIRE(l.begin(Version(3), plan(4096, 4096)).ok());
  CHECK(l.abandon(Version(3)).ok());
  CHECK(l.abandon(Version(3)).code() == StatusCode::kNotFound);
  CHECK(l.bytes_held() == 4096);
}

TEST_CASE("VersionLedger refuses a version the memory budget cannot hold", "[relay_versions]") {
  VersionLedger l(3 * 4096);
  REQUIRE(l.begin(Version(1), plan(4096, 4096)).ok());
  commit_all(l, Version(1));
  REQUIRE(l.add_ref(Version(1)).ok());
  REQUIRE(l.begin(Version(2), plan(4096, 4096)).ok());
  commit_all(l, Version(2));
  auto st = l.begin(Version(3), plan(8192, 4096));
  CHECK(st.code() == StatusCode::kResourceExhausted);
  CHECK_THAT(st.message(), Catch::Contains("v1") && Catch::Contains("1 refs"));
  CHECK(l.bytes_held() == 8192);
  REQUIRE(l.release(Version(1)).value() == std::vector<Version>{Version(1)});
  CHECK(l.begin(Version(3), plan(8192, 4096)).ok());
  CHECK(l.begin(Version(4), plan(1ull << 40, 1 << 20)).code() == StatusCode::kResourceExhausted);
}

TEST_CASE("next_pull keeps one version per trajectory and prefers the newest", "[relay_versions]") {
  using W = laminar::PullerView;
  const auto idle = PullPolicy::kWhenIdle;
  const auto pre = PullPolicy::kPrefetchThenSwap;
  CHECK(next_pull(W{std::nullopt, std::nullopt, false}, std::nullopt, idle).action == PullAction::kNone);
  CHECK(next_pull(W{std::nullopt, std::nullopt, false}, Version(0), idle) == PullDecision{PullAction::kPull, Version(0)});
  CHECK(next_pull(W{Version(3), std::nullopt, false}, Version(3), idle).action == PullAction::kNone);
  CHECK(next_pull(W{Version(3), std::nullopt, false}, Version(5), idle) == PullDecision{PullAction::kPull, Version(5)});
  // A live trajectory never gets its weights changed under it.
  CHECK(next_pull(W{Version(3), std::nullopt, true}, Version(5), idle).action == PullAction::kNone);
  CHECK(next_pull(W{Version(3), std::nullopt, true}, Version(5), pre) == PullDecision{PullAction::kPrefetch, Version(5)});
  CHECK(next_pull(W{Version(3), Version(5), true}, Version(5), pre).action == PullAction::kNone);
  CHECK(next_pull(W{Version(3), Version(5), true}, Version(6), pre) == PullDecision{PullAction::kPrefetch, Version(6)});
  CHECK(next_pull(W{Version(3), Version(5), false}, Version(5), pre) == PullDecision{PullAction::kSwap, Version(5)});
  // Idle with something newer than the prefetch: fetch the newest directly.
  CHECK(next_pull(W{Version(3), Version(5), false}, Version(7), pre) == PullDecision{PullAction::kPull, Version(7)});
  CHECK(laminar::pull_action_name(PullAction::kSwap) == "swap");
}

TEST_CASE("FleetVersions tracks who holds what and who still lacks a version", "[relay_versions]") {
  FleetVersions f;
  const auto relay = FleetVersions::Role::kRelay;
  const auto puller = FleetVersions::Role::kPuller;
  REQUIRE(f.set_held(1, relay, Version(4)).ok());
  REQUIRE(f.set_held(2, relay, Version(3)).ok());
  REQUIRE(f.set_held(10, puller, Version(2)).ok());
  REQUIRE(f.set_held(11, puller, Version(4)).ok());
  CHECK(f.lacking(Version(4), relay) == std::vector<std::uint32_t>{2});
  CHECK(f.lacking(Version(4), puller) == std::vector<std::uint32_t>{10});
  CHECK(f.oldest_held(puller) == Version(2));
  auto back = f.set_held(1, relay, Version(2));
  CHECK(back.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(back.message(), Catch::Contains("backwards"));
  CHECK(f.held(1) == Version(4));
  CHECK(f.set_held(1, puller, Version(9)).code() == StatusCode::kInvalidArgument);
  REQUIRE(f.remove(2).ok());
  CHECK(f.remove(2).code() == StatusCode::kNotFound);
  CHECK(f.lacking(Version(4), relay).empty());
  CHECK(f.size() == 3);
  CHECK_FALSE(f.held(2));
}
