#include "laminar/weight_puller.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "laminar/internal/host_buffer.h"

namespace laminar {

Result<std::unique_ptr<WeightPuller>> WeightPuller::create(std::shared_ptr<RelayStore> relay,
                                                           WeightPullerOptions options) {
  if (!relay) return invalid_argument("weight puller: the relay is null");
  if (options.copy_chunk_bytes < ChunkPlan::kMinChunkBytes) {
    return invalid_argument(fmt::format("weight puller: copy_chunk_bytes is {}, at least {} is needed",
                                        options.copy_chunk_bytes, ChunkPlan::kMinChunkBytes));
  }
  return std::unique_ptr<WeightPuller>(new WeightPuller(std::move(relay), options));
}

std::optional<Version> WeightPuller::latest_version() const { return relay_->latest_version(); }

std::optional<Version> WeightPuller::prefetched_version() const {
  if (!prefetched_.valid()) return std::nullopt;
  return prefetched_.version();
}

std::optional<WeightPuller::StoppedPull> WeightPuller::stopped_pull() const {
  if (!progress_) return std::nullopt;
  return StoppedPull{progress_->version, progress_->bytes_done};
}

PullDecision WeightPuller::next_action(bool has_live_trajectory) const {
  return next_pull({current_, prefetched_version(), has_live_trajectory}, latest_version(), options_.policy);
}

Result<std::vector<WeightPuller::Target>> WeightPuller::check_destinations(
    const ReadHandle& h, std::span<const NamedTensor> destinations) const {
  const Version v = h.version();
  if (destinations.empty()) {
    return invalid_argument(fmt::format("pull of version {}: no destination tensors given", v.value()));
  }
  std::vector<Target> out;
  std::unordered_set<std::string_view> seen;
  for (const NamedTensor& d : destinations) {
    if (!seen.insert(d.name).second) {
      return invalid_argument(fmt::format("pull of version {}: destination '{}' is given twice", v.value(), d.name));
    }
    auto e = h.manifest().find(d.name);
    if (!e.ok()) return e.status().with_context(fmt::format("pull of version {}", v.value()));
    LAMINAR_RETURN_IF_ERROR(h.manifest().check_view(d.name, d.view).with_context(
        fmt::format("pull of version {}: destination does not match the relay's manifest", v.value())));
    if (!d.view.is_contiguous()) {
      return invalid_argument(fmt::format("pull of version {}: destination '{}' is not dense row-major ({})",
                                          v.value(), d.name, d.view.describe()));
    }
    if (!d.view.device().is_host()) {
      LAMINAR_RETURN_IF_ERROR(internal::cuda_device_usable().with_context(
          fmt::format("pull of version {}: destination '{}' is on {}", v.value(), d.name,
                      to_string(d.view.device()))));
    }
    out.push_back({*e, d.view});
  }
  return out;
}

Status WeightPuller::verify(const ReadHandle& h, const std::vector<Target>& targets) const {
  if (!options_.verify_checksums) return ok_status();
  for (const Target& t : targets) {
    auto [first, last] = h.plan().chunks_covering(t.entry->offset, t.entry->nbytes);
    LAMINAR_RETURN_IF_ERROR(h.verify(first, last).with_context(
        fmt::format("pull of tensor '{}'", t.entry->name)));
  }
  return ok_status();
}

Status WeightPuller::copy_into(const ReadHandle& h, std::span<const NamedTensor> destinations,
                               const std::vector<Target>& targets) {
  std::vector<std::pair<std::string, void*>> dst_ids;
  for (const NamedTensor& d : destinations) dst_ids.emplace_back(std::string(d.name), d.view.data());
  std::size_t start_target = 0;
  std::uint64_t start_offset = 0;
  if (progress_ && progress_->version == h.version() && progress_->destinations == dst_ids) {
    start_target = progress_->target;
    start_offset = progress_->offset;
  }
  progress_.reset();
  current_.reset();  // the destinations hold a mix of versions until the copy completes
  cancel_requested_.store(false);
  std::uint64_t done_before = 0;
  for (std::size_t k = 0; k < start_target; ++k) done_before += targets[k].entry->nbytes;

  const std::uint64_t step = options_.copy_chunk_bytes;
  for (std::size_t k = start_target; k < targets.size(); ++k) {
    const Target& t = targets[k];
    const std::byte* src = h.bytes().data() + t.entry->offset;
    auto* dst = static_cast<std::byte*>(t.view.data());
    std::uint64_t off = k == start_target ? start_offset : 0;
    const auto stop_here = [&] {
      progress_ = Progress{h.version(), std::move(dst_ids), k, off, done_before + off};
      return cancelled(fmt::format("pull of version {} stopped at tensor '{}' byte {}; pull again to resume",
                                   h.version().value(), t.entry->name, off));
    };
    if (!t.view.device().is_host()) {
      if (cancel_requested_.exchange(false)) return stop_here();
      // One call per tensor so consecutive chunks overlap in the double-buffered device copy.
      LAMINAR_RETURN_IF_ERROR(internal::copy_host_to_device(dst + off, src + off, t.entry->nbytes - off, h.pinned(),
                                                            options_.device_stream, step)
                                  .with_context(fmt::format("pull of tensor '{}' into {}", t.entry->name,
                                                            to_string(t.view.device()))));
      done_before += t.entry->nbytes;
      continue;
    }
    for (; off < t.entry->nbytes; off += step) {
      if (cancel_requested_.exchange(false)) return stop_here();
      std::memcpy(dst + off, src + off, std::min(step, t.entry->nbytes - off));
    }
    done_before += t.entry->nbytes;
  }
  current_ = h.version();
  return ok_status();
}

Status WeightPuller::pull(Version v, std::span<const NamedTensor> destinations, bool has_live_trajectory) {
  if (has_live_trajectory) {
    return failed_precondition(fmt::format(
        "pull of version {}: the worker has a live trajectory (on version {}); pull only when idle so each "
        "trajectory is generated by one version",
        v.value(), current_ ? std::to_string(current_->value()) : "none"));
  }
  auto h = relay_->acquire(v);
  LAMINAR_RETURN_IF_ERROR(h.status().with_context("pull"));
  auto targets = check_destinations(*h, destinations);
  LAMINAR_RETURN_IF_ERROR(targets.status());
  LAMINAR_RETURN_IF_ERROR(verify(*h, *targets));
  return copy_into(*h, destinations, *targets);
}

Status WeightPuller::prefetch(Version v) {
  if (options_.policy != PullPolicy::kPrefetchThenSwap) {
    return failed_precondition(fmt::format("prefetch of version {}: the puller's policy is pull-when-idle",
                                           v.value()));
  }
  auto h = relay_->acquire(v);
  LAMINAR_RETURN_IF_ERROR(h.status().with_context("prefetch"));
  if (options_.verify_checksums) LAMINAR_RETURN_IF_ERROR(h->verify(0, h->plan().num_chunks()));
  prefetched_ = std::move(*h);
  return ok_status();
}

Status WeightPuller::swap(std::span<const NamedTensor> destinations, bool has_live_trajectory) {
  if (!prefetched_.valid()) return failed_precondition("swap: no version is prefetched");
  if (has_live_trajectory) {
    return failed_precondition(fmt::format("swap to version {}: the worker has a live trajectory; swap only when idle",
                                           prefetched_.version().value()));
  }
  auto targets = check_destinations(prefetched_, destinations);
  LAMINAR_RETURN_IF_ERROR(targets.status());
  LAMINAR_RETURN_IF_ERROR(copy_into(prefetched_, destinations, *targets));
  prefetched_ = ReadHandle();
  return ok_status();
}

}  // namespace laminar
