// stats_fields.h: the one field list of every component's stats struct (and of the queue's
// RecoveryReport): each struct's to_json() writes its JSON from it, and stats_json_test checks it
// against the struct.
//
// A list names each member once, with its JSON key and, where the JSON nests (TrajectoryQueueStats),
// the object the key goes in; the JSON holds the keys in list order. stats_json() fails to compile
// unless the list has exactly as many entries as the struct has data members (a structured binding
// must name every member: check_member_count), so a member added to a struct and not to its list
// stops the build. stats_json_test sets every listed member to its own value and finds it under its
// key, so a member listed twice (with another then left out) fails the test.
//
//   template <> inline constexpr auto kStatsFields<FooStats> =
//       std::tuple{field("sent", &FooStats::sent), field("depth", "ready", &FooStats::ready)};
//   std::string FooStats::to_json() const { return internal::stats_json(*this); }
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

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

namespace laminar::internal {

// One member of T and where its value goes in the JSON.
template <class T, class M>
struct StatsField {
  const char* group;  // the object the key goes in; nullptr: the top level
  const char* key;
  M T::*member;
};

template <class T, class M>
constexpr StatsField<T, M> field(const char* key, M T::*member) {
  return {nullptr, key, member};
}
template <class T, class M>
constexpr StatsField<T, M> field(const char* group, const char* key, M T::*member) {
  return {group, key, member};
}

// Specialised below for each struct: a std::tuple of its StatsFields.
template <class T>
inline constexpr std::tuple<> kStatsFields{};

template <>
inline constexpr auto kStatsFields<TransportStats> = std::tuple{
    field("inbox_messages", &TransportStats::inbox_messages),
    field("inbox_bytes", &TransportStats::inbox_bytes),
    field("inbox_refused", &TransportStats::inbox_refused),
    field("dropped_frames", &TransportStats::dropped_frames),
    field("workers_replaced", &TransportStats::workers_replaced),
    field("direct_copies", &TransportStats::direct_copies)};

template <>
inline constexpr auto kStatsFields<RelayStoreStats> = std::tuple{
    field("bytes_held", &RelayStoreStats::bytes_held),
    field("bytes_recycled", &RelayStoreStats::bytes_recycled),
    field("versions_held", &RelayStoreStats::versions_held),
    field("chunks_rejected", &RelayStoreStats::chunks_rejected),
    field("pinned", &RelayStoreStats::pinned)};

template <>
inline constexpr auto kStatsFields<RelayNodeStats> = std::tuple{
    field("chunks_received", &RelayNodeStats::chunks_received),
    field("chunks_sent", &RelayNodeStats::chunks_sent),
    field("chunks_resent", &RelayNodeStats::chunks_resent),
    field("failovers", &RelayNodeStats::failovers),
    field("upstream_stalls", &RelayNodeStats::upstream_stalls),
    field("subscribers_stalled", &RelayNodeStats::subscribers_stalled),
    field("subscribers", &RelayNodeStats::subscribers)};

template <>
inline constexpr auto kStatsFields<LocalRelayServerStats> = std::tuple{
    field("clients", &LocalRelayServerStats::clients),
    field("leases", &LocalRelayServerStats::leases),
    field("grants", &LocalRelayServerStats::grants),
    field("refused_clients", &LocalRelayServerStats::refused_clients),
    field("idle_closed", &LocalRelayServerStats::idle_closed),
    field("stalled_closed", &LocalRelayServerStats::stalled_closed),
    field("evicted", &LocalRelayServerStats::evicted),
    field("refused_full", &LocalRelayServerStats::refused_full),
    field("read_pauses", &LocalRelayServerStats::read_pauses),
    field("queued_bytes", &LocalRelayServerStats::queued_bytes)};

template <>
inline constexpr auto kStatsFields<TrajectoryQueueServerStats> = std::tuple{
    field("producers", &TrajectoryQueueServerStats::producers),
    field("received", &TrajectoryQueueServerStats::received),
    field("accepted", &TrajectoryQueueServerStats::accepted),
    field("refused", &TrajectoryQueueServerStats::refused),
    field("malformed", &TrajectoryQueueServerStats::malformed),
    field("held", &TrajectoryQueueServerStats::held)};

template <>
inline constexpr auto kStatsFields<KvMigratorStats> = std::tuple{
    field("migrations_out", &KvMigratorStats::migrations_out),
    field("migrations_in", &KvMigratorStats::migrations_in),
    field("done_out", &KvMigratorStats::done_out),
    field("done_in", &KvMigratorStats::done_in),
    field("aborted_out", &KvMigratorStats::aborted_out),
    field("aborted_in", &KvMigratorStats::aborted_in),
    field("offers_refused", &KvMigratorStats::offers_refused),
    field("lease_expiries", &KvMigratorStats::lease_expiries),
    field("pages_sent", &KvMigratorStats::pages_sent),
    field("pages_received", &KvMigratorStats::pages_received),
    field("bytes_sent", &KvMigratorStats::bytes_sent),
    field("checksum_failures", &KvMigratorStats::checksum_failures)};

template <>
inline constexpr auto kStatsFields<RepackCoordinatorStats> = std::tuple{
    field("reports", &RepackCoordinatorStats::reports),
    field("keepalives", &RepackCoordinatorStats::keepalives),
    field("reports_refused", &RepackCoordinatorStats::reports_refused),
    field("workers", &RepackCoordinatorStats::workers),
    field("plans", &RepackCoordinatorStats::plans),
    field("plans_failed", &RepackCoordinatorStats::plans_failed),
    field("planned_workers", &RepackCoordinatorStats::planned_workers),
    field("left_out", &RepackCoordinatorStats::left_out),
    field("moves", &RepackCoordinatorStats::moves),
    field("workers_freed", &RepackCoordinatorStats::workers_freed),
    field("orders_sent", &RepackCoordinatorStats::orders_sent),
    field("orders_failed", &RepackCoordinatorStats::orders_failed),
    field("prompts_waiting", &RepackCoordinatorStats::prompts_waiting)};

template <>
inline constexpr auto kStatsFields<RepackDriverStats> = std::tuple{
    field("reports_sent", &RepackDriverStats::reports_sent),
    field("keepalives_sent", &RepackDriverStats::keepalives_sent),
    field("reports_held", &RepackDriverStats::reports_held),
    field("reports_failed", &RepackDriverStats::reports_failed),
    field("connects_failed", &RepackDriverStats::connects_failed),
    field("orders", &RepackDriverStats::orders),
    field("orders_refused", &RepackDriverStats::orders_refused),
    field("orders_dropped", &RepackDriverStats::orders_dropped),
    field("migrations_started", &RepackDriverStats::migrations_started),
    field("migrations_refused", &RepackDriverStats::migrations_refused),
    field("sequences_skipped", &RepackDriverStats::sequences_skipped),
    field("reports_queued", &RepackDriverStats::reports_queued)};

template <>
inline constexpr auto kStatsFields<MigrationHostStats> = std::tuple{
    field("paused", &MigrationHostStats::paused),
    field("pauses_failed", &MigrationHostStats::pauses_failed),
    field("finishes_failed", &MigrationHostStats::finishes_failed),
    field("adopted", &MigrationHostStats::adopted),
    field("resumed", &MigrationHostStats::resumed),
    field("forgotten", &MigrationHostStats::forgotten),
    field("gave_up", &MigrationHostStats::gave_up)};

template <>
inline constexpr auto kStatsFields<RolloutDispatcherStats> = std::tuple{
    field("requests", &RolloutDispatcherStats::requests),
    field("refused", &RolloutDispatcherStats::refused),
    field("waited", &RolloutDispatcherStats::waited),
    field("groups_made", &RolloutDispatcherStats::groups_made),
    field("groups_done", &RolloutDispatcherStats::groups_done),
    field("handed_out", &RolloutDispatcherStats::handed_out),
    field("reissued", &RolloutDispatcherStats::reissued),
    field("returned", &RolloutDispatcherStats::returned),
    field("claimed", &RolloutDispatcherStats::claimed),
    field("completed", &RolloutDispatcherStats::completed),
    field("duplicates", &RolloutDispatcherStats::duplicates),
    field("lost_workers", &RolloutDispatcherStats::lost_workers),
    field("adopted_groups", &RolloutDispatcherStats::adopted_groups),
    field("workers", &RolloutDispatcherStats::workers),
    field("waiting_requests", &RolloutDispatcherStats::waiting_requests),
    field("in_flight", &RolloutDispatcherStats::in_flight),
    field("waiting", &RolloutDispatcherStats::waiting),
    field("available", &RolloutDispatcherStats::available)};

// Nested: {"depth": {...}, "flow": {...}, "rejected": {...}, "drops": {...}, "staleness_histogram",
// "group_wait_ms", "wal": {...}} (trajectory_queue.h).
template <>
inline constexpr auto kStatsFields<TrajectoryQueueStats> = std::tuple{
    field("depth", "ready", &TrajectoryQueueStats::ready),
    field("depth", "ready_tokens", &TrajectoryQueueStats::ready_tokens),
    field("depth", "pending_groups", &TrajectoryQueueStats::pending_groups),
    field("depth", "pending_group_trajectories", &TrajectoryQueueStats::pending_group_trajectories),
    field("depth", "leases", &TrajectoryQueueStats::leases),
    field("depth", "leased_trajectories", &TrajectoryQueueStats::leased_trajectories),
    field("depth", "held_tokens", &TrajectoryQueueStats::held_tokens),
    field("depth", "blocked_producers", &TrajectoryQueueStats::blocked_producers),
    field("depth", "blocked_consumers", &TrajectoryQueueStats::blocked_consumers),
    field("depth", "newest_version", &TrajectoryQueueStats::newest_version),
    field("flow", "pushed", &TrajectoryQueueStats::pushed),
    field("flow", "delivered", &TrajectoryQueueStats::delivered),
    field("flow", "acked", &TrajectoryQueueStats::acked),
    field("flow", "nacked_batches", &TrajectoryQueueStats::nacked_batches),
    field("flow", "expired_leases", &TrajectoryQueueStats::expired_leases),
    field("flow", "redelivered", &TrajectoryQueueStats::redelivered),
    field("rejected", "invalid", &TrajectoryQueueStats::rejected_invalid),
    field("rejected", "full", &TrajectoryQueueStats::rejected_full),
    field("drops", "stale", &TrajectoryQueueStats::dropped_stale),
    field("drops", "group_timeout", &TrajectoryQueueStats::dropped_group_timeout),
    field("drops", "late_for_group", &TrajectoryQueueStats::dropped_late_for_group),
    field("staleness_histogram", &TrajectoryQueueStats::staleness),
    field("group_wait_ms", &TrajectoryQueueStats::group_wait),
    field("wal", "enabled", &TrajectoryQueueStats::wal),
    field("wal", "bytes", &TrajectoryQueueStats::wal_bytes),
    field("wal", "records", &TrajectoryQueueStats::wal_records),
    field("wal", "compactions", &TrajectoryQueueStats::wal_compactions)};

template <>
inline constexpr auto kStatsFields<RecoveryReport> = std::tuple{
    field("replayed", &RecoveryReport::replayed),
    field("records", &RecoveryReport::records),
    field("recovered", &RecoveryReport::recovered),
    field("retired", &RecoveryReport::retired),
    field("discarded_bytes", &RecoveryReport::discarded_bytes),
    field("tail", &RecoveryReport::tail)};

// Compiles only when T has exactly N non-static data members: a structured binding must name every
// one (static members, such as kStalenessBuckets, are not members it binds).
template <std::size_t N, class T>
void check_member_count(const T& object) {
  if constexpr (N == 1) {
    [[maybe_unused]] const auto& [a] = object;
  } else if constexpr (N == 2) {
    [[maybe_unused]] const auto& [a, b] = object;
  } else if constexpr (N == 3) {
    [[maybe_unused]] const auto& [a, b, c] = object;
  } else if constexpr (N == 4) {
    [[maybe_unused]] const auto& [a, b, c, d] = object;
  } else if constexpr (N == 5) {
    [[maybe_unused]] const auto& [a, b, c, d, e] = object;
  } else if constexpr (N == 6) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f] = object;
  } else if constexpr (N == 7) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g] = object;
  } else if constexpr (N == 8) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h] = object;
  } else if constexpr (N == 9) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i] = object;
  } else if constexpr (N == 10) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j] = object;
  } else if constexpr (N == 11) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k] = object;
  } else if constexpr (N == 12) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l] = object;
  } else if constexpr (N == 13) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m] = object;
  } else if constexpr (N == 14) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n] = object;
  } else if constexpr (N == 15) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o] = object;
  } else if constexpr (N == 16) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p] = object;
  } else if constexpr (N == 17) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q] = object;
  } else if constexpr (N == 18) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r] = object;
  } else if constexpr (N == 19) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s] = object;
  } else if constexpr (N == 20) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t] = object;
  } else if constexpr (N == 21) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u] = object;
  } else if constexpr (N == 22) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u, v] = object;
  } else if constexpr (N == 23) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u, v, w] = object;
  } else if constexpr (N == 24) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u, v, w, x] = object;
  } else if constexpr (N == 25) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u, v, w, x, y] = object;
  } else if constexpr (N == 26) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u, v, w, x, y, z] =
        object;
  } else if constexpr (N == 27) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u, v, w, x, y, z, A] =
        object;
  } else if constexpr (N == 28) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u, v, w, x, y, z, A, B]
        = object;
  } else if constexpr (N == 29) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u, v, w, x, y, z, A, B,
        C] = object;
  } else if constexpr (N == 30) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u, v, w, x, y, z, A, B,
        C, D] = object;
  } else if constexpr (N == 31) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u, v, w, x, y, z, A, B,
        C, D, E] = object;
  } else if constexpr (N == 32) {
    [[maybe_unused]] const auto& [a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u, v, w, x, y, z, A, B,
        C, D, E, F] = object;
  } else {
    static_assert(N == 0, "check_member_count: extend the table past 32 members");
  }
}

// The JSON of one member's value.
template <class M>
nlohmann::ordered_json json_value(const M& v) {
  static_assert(std::is_arithmetic_v<M>, "json_value: add an overload for this member's type");
  return v;
}
template <class M>
nlohmann::ordered_json json_value(const std::optional<M>& v) {
  return v ? json_value(*v) : nlohmann::ordered_json();
}
inline nlohmann::ordered_json json_value(const Version& v) { return v.value(); }
inline nlohmann::ordered_json json_value(const Status& v) { return v.to_string(); }
// A histogram of counts, keyed by bucket: "0", "1", ... and "N-1+" for the open-ended last one.
template <std::size_t N>
nlohmann::ordered_json json_value(const std::uint64_t (&buckets)[N]) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (std::size_t i = 0; i < N; ++i) out[i + 1 < N ? std::to_string(i) : std::to_string(i) + "+"] = buckets[i];
  return out;
}
inline nlohmann::ordered_json json_value(const WaitHistogram& h) {
  nlohmann::ordered_json buckets = nlohmann::ordered_json::array();
  for (int i = 0; i < WaitHistogram::kBuckets; ++i) {
    nlohmann::ordered_json b;
    b["lt_ms"] = i + 1 < WaitHistogram::kBuckets ? nlohmann::ordered_json(1ull << i) : nlohmann::ordered_json();
    b["n"] = h.buckets[i];
    buckets.push_back(b);
  }
  return {{"count", h.count},
          {"mean", h.count ? h.sum_ms / double(h.count) : 0.0},
          {"max", h.max_ms},
          {"buckets", buckets}};
}

// `stats` as one JSON object, from kStatsFields<T>.
template <class T>
std::string stats_json(const T& stats) {
  constexpr auto& fields = kStatsFields<T>;
  // A member of T missing from (or extra in) its list stops the build here.
  check_member_count<std::tuple_size_v<std::remove_cvref_t<decltype(fields)>>>(stats);
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  std::apply(
      [&](const auto&... f) {
        (((f.group ? j[f.group][f.key] : j[f.key]) = json_value(stats.*(f.member))), ...);
      },
      fields);
  return j.dump();
}

}  // namespace laminar::internal
