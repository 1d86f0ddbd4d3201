// Every component's <Component>Stats::to_json() is JSON that carries every field: each field is
// set to a value no other field has, and the parsed document must hold each of them.
#include <catch2/catch.hpp>
#include <cstdint>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "laminar/kv_migrator.h"
#include "laminar/local_relay.h"
#include "laminar/relay_node.h"
#include "laminar/relay_store.h"
#include "laminar/remote_trajectory_queue.h"
#include "laminar/repack_coordinator.h"
#include "laminar/repack_driver.h"
#include "laminar/rollout_dispatcher.h"
#include "laminar/transport.h"

namespace {

// Every number in `j`, at any depth.
void numbers_in(const nlohmann::json& j, std::multiset<std::uint64_t>& out) {
  if (j.is_number_unsigned() || j.is_number_integer()) out.insert(j.get<std::uint64_t>());
  if (j.is_structured()) {
    for (const auto& v : j) numbers_in(v, out);
  }
}

// Parses `text` as one JSON object and checks it holds every value of `fields`.
void check_json(const std::string& text, std::initializer_list<std::uint64_t> fields) {
  INFO(text);
  nlohmann::json j;
  REQUIRE_NOTHROW(j = nlohmann::json::parse(text));
  REQUIRE(j.is_object());
  std::multiset<std::uint64_t> found;
  numbers_in(j, found);
  for (std::uint64_t v : fields) {
    INFO("field set to " << v);
    CHECK(found.count(v) == 1);
  }
}

}  // namespace

TEST_CASE("transport stats: to_json is a JSON object with every field") {
  laminar::TransportStats s;
  s.inbox_messages = 101;
  s.inbox_bytes = 102;
  s.inbox_refused = 103;
  s.dropped_frames = 104;
  s.workers_replaced = 105;
  s.direct_copies = 106;
  check_json(s.to_json(), {101, 102, 103, 104, 105, 106});
}

TEST_CASE("relay store stats: to_json is a JSON object with every field") {
  laminar::RelayStoreStats s;
  s.bytes_held = 201;
  s.bytes_recycled = 202;
  s.versions_held = 203;
  s.chunks_rejected = 204;
  s.pinned = true;
  check_json(s.to_json(), {201, 202, 203, 204});
  CHECK(nlohmann::json::parse(s.to_json()).dump().find("true") != std::string::npos);
}

TEST_CASE("relay node stats: to_json is a JSON object with every field") {
  laminar::RelayNodeStats s;
  s.chunks_received = 301;
  s.chunks_sent = 302;
  s.chunks_resent = 303;
  s.failovers = 304;
  s.upstream_stalls = 305;
  s.subscribers_stalled = 306;
  s.subscribers = 307;
  check_json(s.to_json(), {301, 302, 303, 304, 305, 306, 307});
}

TEST_CASE("local relay stats: to_json is a JSON object with every field") {
  laminar::LocalRelayServerStats s;
  s.clients = 401;
  s.leases = 402;
  s.grants = 403;
  s.refused_clients = 404;
  s.idle_closed = 405;
  s.stalled_closed = 406;
  s.evicted = 407;
  s.refused_full = 408;
  s.read_pauses = 409;
  s.queued_bytes = 410;
  check_json(s.to_json(), {401, 402, 403, 404, 405, 406, 407, 408, 409, 410});
}

TEST_CASE("remote push stats: TrajectoryQueueServerStats::to_json is a JSON object with every field") {
  laminar::TrajectoryQueueServerStats s;
  s.producers = 501;
  s.received = 502;
  s.accepted = 503;
  s.refused = 504;
  s.malformed = 505;
  s.held = 506;
  check_json(s.to_json(), {501, 502, 503, 504, 505, 506});
}

TEST_CASE("kv migrator stats: to_json is a JSON object with every field") {
  laminar::KvMigratorStats s;
  s.migrations_out = 601;
  s.migrations_in = 602;
  s.done_out = 603;
  s.done_in = 604;
  s.aborted_out = 605;
  s.aborted_in = 606;
  s.offers_refused = 607;
  s.lease_expiries = 608;
  s.pages_sent = 609;
  s.pages_received = 610;
  s.bytes_sent = 611;
  s.checksum_failures = 612;
  check_json(s.to_json(), {601, 602, 603, 604, 605, 606, 607, 608, 609, 610, 611, 612});
}

TEST_CASE("repack coordinator stats: to_json is a JSON object with every field") {
  laminar::RepackCoordinatorStats s;
  s.reports = 701;
  s.reports_refused = 702;
  s.workers = 703;
  s.plans = 704;
  s.plans_failed = 705;
  s.planned_workers = 706;
  s.left_out = 707;
  s.moves = 708;
  s.workers_freed = 709;
  s.orders_sent = 710;
  s.orders_failed = 711;
  s.prompts_waiting = 712;
  check_json(s.to_json(), {701, 702, 703, 704, 705, 706, 707, 708, 709, 710, 711, 712});
  s.prompts_waiting.reset();
  CHECK(nlohmann::json::parse(s.to_json()).at("prompts_waiting").is_null());
}

TEST_CASE("repack driver stats: to_json is a JSON object with every field") {
  laminar::RepackDriverStats s;
  s.reports_sent = 801;
  s.reports_held = 802;
  s.reports_failed = 803;
  s.connects_failed = 804;
  s.orders = 805;
  s.orders_refused = 806;
  s.orders_dropped = 807;
  s.migrations_started = 808;
  s.migrations_refused = 809;
  s.sequences_skipped = 810;
  check_json(s.to_json(), {801, 802, 803, 804, 805, 806, 807, 808, 809, 810});
}

TEST_CASE("rollout dispatcher stats: to_json is a JSON object with every field") {
  laminar::RolloutDispatcherStats s;
  s.requests = 901;
  s.refused = 902;
  s.waited = 903;
  s.groups_made = 904;
  s.groups_done = 905;
  s.handed_out = 906;
  s.reissued = 907;
  s.claimed = 908;
  s.completed = 909;
  s.duplicates = 910;
  s.lost_workers = 911;
  s.workers = 912;
  s.waiting_requests = 913;
  s.in_flight = 914;
  s.waiting = 915;
  s.available = 916;
  check_json(s.to_json(), {901, 902, 903, 904, 905, 906, 907, 908, 909, 910, 911, 912, 913, 914, 915, 916});
}
