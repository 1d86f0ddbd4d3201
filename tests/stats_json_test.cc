// Every component's <Component>Stats::to_json() (and the queue's RecoveryReport's) is one JSON object
// written from the struct's field list (src/stats_fields.h), which names every member: a list that
// misses a member does not compile. Here each listed member is set to a value no other member has,
// and the JSON must hold exactly the listed keys, in list order, each with its own member's value.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "laminar/kv_migrator.h"
#include "laminar/local_relay.h"
#include "laminar/migration_host.h"
#include "laminar/relay_node.h"
#include "laminar/relay_store.h"
#include "laminar/remote_trajectory_queue.h"
#include "laminar/repack_coordinator.h"
#include "laminar/repack_driver.h"
#include "laminar/rollout_dispatcher.h"
#include "laminar/trajectory_queue.h"
#include "laminar/transport.h"
#include "stats_fields.h"

namespace {

using Json = nlohmann::ordered_json;

// Sets `v` to values no other member has (`next` counts them); bools are set to true.
template <class M>
void set_distinct(M& v, std::uint64_t& next) {
  if constexpr (std::is_same_v<M, bool>) {
    v = true;
  } else {
    static_assert(std::is_integral_v<M>, "set_distinct: add an overload for this member's type");
    v = M(next++);
  }
}
template <class M>
void set_distinct(std::optional<M>& v, std::uint64_t& next) {
  v.emplace();
  set_distinct(*v, next);
}
void set_distinct(laminar::Version& v, std::uint64_t& next) { v = laminar::Version(next++); }
void set_distinct(laminar::Status& v, std::uint64_t& next) {
  v = laminar::data_loss("tail " + std::to_string(next++));
}
template <std::size_t N>
void set_distinct(std::uint64_t (&buckets)[N], std::uint64_t& next) {
  for (std::uint64_t& b : buckets) b = next++;
}
void set_distinct(laminar::WaitHistogram& h, std::uint64_t& next) {
  h.count = next++;
  h.sum_ms = double(next++);
  h.max_ms = double(next++);
  set_distinct(h.buckets, next);
}

// Sets every listed member of a T to its own values (counting from `first`) and checks its
// to_json(): one JSON object with exactly the listed keys (nested in their objects), in list order,
// each holding the value its member had when it was set. A member listed twice (and so another left
// out) holds its second value under its first key, and fails. Returns the struct.
template <class T>
T check_every_field(std::uint64_t first) {
  T s{};
  struct Expected {
    const char* group;
    const char* key;
    Json value;
  };
  std::vector<Expected> expected;
  std::uint64_t next = first;
  std::apply(
      [&](const auto&... f) {
        ((set_distinct(s.*(f.member), next),
          expected.push_back({f.group, f.key, laminar::internal::json_value(s.*(f.member))})),
         ...);
      },
      laminar::internal::kStatsFields<T>);
  const std::string text = s.to_json();
  INFO(text);
  Json j;
  REQUIRE_NOTHROW(j = Json::parse(text));
  REQUIRE(j.is_object());

  std::vector<std::string> top_level;  // the list's top-level keys and objects, in order
  std::size_t leaves = 0;
  for (const Expected& e : expected) {
    const std::string top = e.group ? e.group : e.key;
    if (top_level.empty() || top_level.back() != top) top_level.push_back(top);
    INFO("key " << (e.group ? std::string(e.group) + "." : std::string()) << e.key);
    const Json* at = e.group ? (j.contains(e.group) ? &j.at(e.group) : nullptr) : &j;
    REQUIRE(at != nullptr);
    REQUIRE(at->contains(e.key));
    CHECK(at->at(e.key) == e.value);
  }
  std::vector<std::string> keys;
  for (const auto& [key, value] : j.items()) {
    keys.push_back(key);
    const bool nested = std::any_of(expected.begin(), expected.end(),
                                    [&](const Expected& e) { return e.group && key == e.group; });
    leaves += nested ? value.size() : 1;
  }
  CHECK(keys == top_level);
  CHECK(leaves == expected.size());
  return s;
}

}  // namespace

TEST_CASE("transport stats: to_json is a JSON object with every field") {
  check_every_field<laminar::TransportStats>(101);
}

TEST_CASE("relay store stats: to_json is a JSON object with every field") {
  const laminar::RelayStoreStats s = check_every_field<laminar::RelayStoreStats>(201);
  CHECK(Json::parse(s.to_json()).at("pinned") == true);
}

TEST_CASE("relay node stats: to_json is a JSON object with every field") {
  check_every_field<laminar::RelayNodeStats>(301);
}

TEST_CASE("local relay stats: to_json is a JSON object with every field") {
  check_every_field<laminar::LocalRelayServerStats>(401);
}

TEST_CASE("remote push stats: TrajectoryQueueServerStats::to_json is a JSON object with every field") {
  check_every_field<laminar::TrajectoryQueueServerStats>(501);
}

TEST_CASE("kv migrator stats: to_json is a JSON object with every field") {
  check_every_field<laminar::KvMigratorStats>(601);
}

TEST_CASE("repack coordinator stats: to_json is a JSON object with every field") {
  laminar::RepackCoordinatorStats s = check_every_field<laminar::RepackCoordinatorStats>(701);
  CHECK(Json::parse(s.to_json()).at("prompts_waiting") == *s.prompts_waiting);
  s.prompts_waiting.reset();
  CHECK(Json::parse(s.to_json()).at("prompts_waiting").is_null());
}

TEST_CASE("repack driver stats: to_json is a JSON object with every field") {
  check_every_field<laminar::RepackDriverStats>(801);
}

TEST_CASE("migration host stats: to_json is a JSON object with every field") {
  check_every_field<laminar::MigrationHostStats>(1001);
}

TEST_CASE("rollout dispatcher stats: to_json is a JSON object with every field") {
  check_every_field<laminar::RolloutDispatcherStats>(901);
}

TEST_CASE("trajectory queue stats: to_json is a JSON object with every field") {
  const laminar::TrajectoryQueueStats s = check_every_field<laminar::TrajectoryQueueStats>(1001);
  const Json j = Json::parse(s.to_json());
  // The histograms' own shapes: staleness buckets "0" ... "16+", wait buckets with their bounds.
  CHECK(j.at("staleness_histogram").size() == std::size_t(laminar::TrajectoryQueueStats::kStalenessBuckets));
  CHECK(j.at("staleness_histogram").contains("16+"));
  CHECK(j.at("group_wait_ms").at("buckets").size() == std::size_t(laminar::WaitHistogram::kBuckets));
  CHECK(j.at("group_wait_ms").at("buckets").at(0).at("lt_ms") == 1);
  CHECK(j.at("group_wait_ms").at("buckets").back().at("lt_ms").is_null());
  CHECK(j.at("group_wait_ms").at("mean") == s.group_wait.sum_ms / double(s.group_wait.count));
}

TEST_CASE("recovery report: to_json is a JSON object with every field") {
  const laminar::RecoveryReport r = check_every_field<laminar::RecoveryReport>(1101);
  CHECK(Json::parse(r.to_json()).at("tail") == r.tail.to_string());
}
