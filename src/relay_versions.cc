#include "laminar/relay_versions.h"

#include <fmt/format.h>

#include <algorithm>

namespace laminar {

Result<ChunkPlan> ChunkPlan::make(std::uint64_t total_bytes, std::uint64_t chunk_bytes) {
  if (total_bytes == 0) return invalid_argument("chunk plan: total_bytes is 0; nothing to send");
  if (chunk_bytes < kMinChunkBytes) {
    return invalid_argument(
        fmt::format("chunk plan: chunk_bytes is {}, at least {} is needed", chunk_bytes, kMinChunkBytes));
  }
  const std::uint64_t n = total_bytes / chunk_bytes + (total_bytes % chunk_bytes != 0 ? 1 : 0);
  if (n > std::numeric_limits<std::uint32_t>::max()) {
    return invalid_argument(fmt::format("chunk plan: {} bytes in chunks of {} makes {} chunks, more than 2^32 - 1",
                                        total_bytes, chunk_bytes, n));
  }
  ChunkPlan p;
  p.total_bytes_ = total_bytes;
  p.chunk_bytes_ = chunk_bytes;
  p.num_chunks_ = static_cast<std::uint32_t>(n);
  return p;
}

std::uint64_t ChunkPlan::chunk_size(std::uint32_t i) const noexcept {
  return std::min(chunk_bytes_, total_bytes_ - chunk_offset(i));
}

std::pair<std::uint32_t, std::uint32_t> ChunkPlan::chunks_covering(std::uint64_t offset,
                                                                   std::uint64_t nbytes) const noexcept {
  if (nbytes == 0) return {0, 0};
  const auto first = static_cast<std::uint32_t>(offset / chunk_bytes_);
  const auto last = static_cast<std::uint32_t>((offset + nbytes - 1) / chunk_bytes_) + 1;
  return {first, last};
}

namespace {

// The ledger's helpers, over its map of versions (whose entry type is the ledger's own).
// A version no one needs any more: no reader holds it, and it is neither the newest committed one
// nor one still arriving while nothing newer has committed.
template <class Entry>
bool freeable(Version v, const Entry& e, std::optional<Version> newest_committed) {
  if (e.refs != 0) return false;
  if (!newest_committed) return false;
  if (e.state == VersionLedger::State::kCommitted) return v != *newest_committed;
  // Still receiving: worth finishing only while nothing newer is complete.
  return v < *newest_committed;
}

// Forgets every freeable version, returning them.
template <class Versions>
std::vector<Version> collect(Versions& versions, std::uint64_t& bytes_held, std::optional<Version> newest_committed) {
  std::vector<Version> out;
  for (auto it = versions.begin(); it != versions.end();) {
    if (freeable(it->first, it->second, newest_committed)) {
      out.push_back(it->first);
      bytes_held -= it->second.plan.total_bytes();
      it = versions.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

template <class Versions>
std::string describe_held(const Versions& versions) {
  std::string s;
  for (const auto& [v, e] : versions) {
    if (!s.empty()) s += ", ";
    s += fmt::format("v{} ({} bytes, {}, {} refs)", v.value(), e.plan.total_bytes(),
                     e.state == VersionLedger::State::kCommitted ? "committed" : "receiving", e.refs);
  }
  return s.empty() ? "nothing" : s;
}

}  // namespace

Status VersionLedger::begin(Version v, const ChunkPlan& plan) {
  if (newest_begun_ && v <= *newest_begun_) {
    return invalid_argument(fmt::format("version {} is not above version {}, the newest already begun; "
                                        "versions must strictly increase",
                                        v.value(), newest_begun_->value()));
  }
  if (plan.num_chunks() == 0) return invalid_argument(fmt::format("version {}: empty chunk plan", v.value()));
  if (plan.total_bytes() > budget_ || bytes_held_ > budget_ - plan.total_bytes()) {
    return resource_exhausted(fmt::format(
        "version {} needs {} bytes but {} of the {}-byte budget are held by {}; release read handles "
        "or raise the budget",
        v.value(), plan.total_bytes(), bytes_held_, budget_, describe_held(versions_)));
  }
  Entry e;
  e.plan = plan;
  e.verified.assign(plan.num_chunks(), false);
  versions_.emplace(v, std::move(e));
  bytes_held_ += plan.total_bytes();
  newest_begun_ = v;
  return ok_status();
}

Result<std::pair<bool, std::vector<Version>>> VersionLedger::chunk_verified(Version v, std::uint32_t i) {
  auto it = versions_.find(v);
  if (it == versions_.end()) {
    return not_found(fmt::format("version {} is not being received (held: {})", v.value(), describe_held(versions_)));
  }
  Entry& e = it->second;
  if (i >= e.plan.num_chunks()) {
    return out_of_range(
        fmt::format("version {}: chunk {} does not exist (it has {})", v.value(), i, e.plan.num_chunks()));
  }
  if (e.verified[i]) return std::pair<bool, std::vector<Version>>{false, {}};
  e.verified[i] = true;
  ++e.num_verified;
  if (e.num_verified < e.plan.num_chunks()) return std::pair<bool, std::vector<Version>>{false, {}};
  e.state = State::kCommitted;
  if (!newest_committed_ || v > *newest_committed_) newest_committed_ = v;
  return std::pair<bool, std::vector<Version>>{true, collect(versions_, bytes_held_, newest_committed_)};
}

Status VersionLedger::abandon(Version v) {
  auto it = versions_.find(v);
  if (it == versions_.end()) return not_found(fmt::format("version {} is not held", v.value()));
  if (it->second.state == State::kCommitted) {
    return failed_precondition(fmt::format("version {} is committed; only incomplete versions are abandoned",
                                           v.value()));
  }
  bytes_held_ -= it->second.plan.total_bytes();
  versions_.erase(it);
  return ok_status();
}

Status VersionLedger::add_ref(Version v) {
  auto it = versions_.find(v);
  if (it == versions_.end()) return not_found(fmt::format("version {} is not held (held: {})", v.value(), describe_held(versions_)));
  if (it->second.state != State::kCommitted) {
    return failed_precondition(fmt::format("version {} is not committed yet", v.value()));
  }
  ++it->second.refs;
  return ok_status();
}

Result<std::vector<Version>> VersionLedger::release(Version v) {
  auto it = versions_.find(v);
  if (it == versions_.end()) return not_found(fmt::format("version {} is not held", v.value()));
  if (it->second.refs == 0) {
    return failed_precondition(fmt::format("version {} has no reference to release", v.value()));
  }
  --it->second.refs;
  return collect(versions_, bytes_held_, newest_committed_);
}

bool VersionLedger::is_committed(Version v) const {
  auto it = versions_.find(v);
  return it != versions_.end() && it->second.state == State::kCommitted;
}

Result<std::uint32_t> VersionLedger::resume_point(Version v) const {
  auto it = versions_.find(v);
  if (it == versions_.end()) return not_found(fmt::format("version {} is not held", v.value()));
  const auto& ver = it->second.verified;
  return static_cast<std::uint32_t>(std::find(ver.begin(), ver.end(), false) - ver.begin());
}

Result<std::vector<std::uint32_t>> VersionLedger::missing_chunks(Version v) const {
  auto it = versions_.find(v);
  if (it == versions_.end()) return not_found(fmt::format("version {} is not held", v.value()));
  std::vector<std::uint32_t> out;
  for (std::uint32_t i = 0; i < it->second.plan.num_chunks(); ++i) {
    if (!it->second.verified[i]) out.push_back(i);
  }
  return out;
}

Result<std::uint32_t> VersionLedger::refs(Version v) const {
  auto it = versions_.find(v);
  if (it == versions_.end()) return not_found(fmt::format("version {} is not held", v.value()));
  return it->second.refs;
}

Result<ChunkPlan> VersionLedger::plan(Version v) const {
  auto it = versions_.find(v);
  if (it == versions_.end()) return not_found(fmt::format("version {} is not held", v.value()));
  return it->second.plan;
}

std::vector<Version> VersionLedger::versions() const {
  std::vector<Version> out;
  for (const auto& kv : versions_) out.push_back(kv.first);
  return out;
}

PullDecision next_pull(const PullerView& w, std::optional<Version> newest, PullPolicy policy) noexcept {
  const auto newer = [](std::optional<Version> a, std::optional<Version> b) {
    return a && (!b || *a > *b);
  };
  const bool prefetch_useful = newer(w.prefetched, w.held);
  if (!w.has_live_trajectory) {
    if (newer(newest, w.held) && (!prefetch_useful || *newest > *w.prefetched)) {
      return {PullAction::kPull, *newest};
    }
    if (prefetch_useful) return {PullAction::kSwap, *w.prefetched};
    return {};
  }
  if (policy == PullPolicy::kPrefetchThenSwap && newer(newest, w.held) &&
      (!w.prefetched || *newest > *w.prefetched)) {
    return {PullAction::kPrefetch, *newest};
  }
  return {};
}

std::string_view pull_action_name(PullAction a) noexcept {
  switch (a) {
    case PullAction::kNone: return "none";
    case PullAction::kPull: return "pull";
    case PullAction::kPrefetch: return "prefetch";
    case PullAction::kSwap: return "swap";
  }
  return "?";
}

Status FleetVersions::set_held(std::uint32_t node, Role role, Version v) {
  auto it = nodes_.find(node);
  if (it == nodes_.end()) {
    nodes_.emplace(node, Node{role, v});
    return ok_status();
  }
  if (it->second.role != role) {
    return invalid_argument(fmt::format("node {} is registered as a {}, not a {}", node,
                                        it->second.role == Role::kRelay ? "relay" : "puller",
                                        role == Role::kRelay ? "relay" : "puller"));
  }
  if (v < it->second.held) {
    return invalid_argument(fmt::format("node {} held version {}; version {} would go backwards", node,
                                        it->second.held.value(), v.value()));
  }
  it->second.held = v;
  return ok_status();
}

Status FleetVersions::remove(std::uint32_t node) {
  if (nodes_.erase(node) == 0) return not_found(fmt::format("node {} is not in the fleet", node));
  return ok_status();
}

std::optional<Version> FleetVersions::held(std::uint32_t node) const {
  auto it = nodes_.find(node);
  if (it == nodes_.end()) return std::nullopt;
  return it->second.held;
}

std::vector<std::uint32_t> FleetVersions::lacking(Version v, Role role) const {
  std::vector<std::uint32_t> out;
  for (const auto& [id, n] : nodes_) {
    if (n.role == role && n.held < v) out.push_back(id);
  }
  return out;
}

std::optional<Version> FleetVersions::oldest_held(Role role) const {
  std::optional<Version> out;
  for (const auto& [id, n] : nodes_) {
    if (n.role == role && (!out || n.held < *out)) out = n.held;
  }
  return out;
}

}  // namespace laminar
