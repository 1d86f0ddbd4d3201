// TrajectoryQueueStats and RecoveryReport as JSON.
#include <nlohmann/json.hpp>

#include "laminar/trajectory_queue.h"

namespace laminar {

std::string TrajectoryQueueStats::to_json() const {
  nlohmann::ordered_json j;
  j["depth"] = {{"ready", ready},
                {"ready_tokens", ready_tokens},
                {"pending_groups", pending_groups},
                {"pending_group_trajectories", pending_group_trajectories},
                {"leases", leases},
                {"leased_trajectories", leased_trajectories},
                {"held_tokens", held_tokens},
                {"blocked_producers", blocked_producers},
                {"blocked_consumers", blocked_consumers},
                {"newest_version", newest_version.value()}};
  j["flow"] = {{"pushed", pushed},         {"delivered", delivered},           {"acked", acked},
               {"nacked_batches", nacked_batches}, {"expired_leases", expired_leases}, {"redelivered", redelivered}};
  j["rejected"] = {{"invalid", rejected_invalid}, {"full", rejected_full}};
  j["drops"] = {{"stale", dropped_stale}, {"group_timeout", dropped_group_timeout},
                {"late_for_group", dropped_late_for_group}};
  nlohmann::ordered_json hist = nlohmann::ordered_json::object();
  for (int i = 0; i < kStalenessBuckets; ++i) {
    hist[i + 1 < kStalenessBuckets ? std::to_string(i) : std::to_string(i) + "+"] = staleness[i];
  }
  j["staleness_histogram"] = hist;
  nlohmann::ordered_json buckets = nlohmann::ordered_json::array();
  for (int i = 0; i < WaitHistogram::kBuckets; ++i) {
    nlohmann::ordered_json b;
    b["lt_ms"] = i + 1 < WaitHistogram::kBuckets ? nlohmann::ordered_json(1ull << i) : nlohmann::ordered_json();
    b["n"] = group_wait.buckets[i];
    buckets.push_back(b);
  }
  j["group_wait_ms"] = {{"count", group_wait.count},
                        {"mean", group_wait.count ? group_wait.sum_ms / double(group_wait.count) : 0.0},
                        {"max", group_wait.max_ms},
                        {"buckets", buckets}};
  j["wal"] = {{"enabled", wal}, {"bytes", wal_bytes}, {"records", wal_records}, {"compactions", wal_compactions}};
  return j.dump();
}

std::string RecoveryReport::to_json() const {
  nlohmann::ordered_json j = {{"replayed", replayed},   {"records", records},
                              {"recovered", recovered}, {"retired", retired},
                              {"discarded_bytes", discarded_bytes}, {"tail", tail.to_string()}};
  return j.dump();
}

}  // namespace laminar
