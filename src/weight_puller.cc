#include "laminar/weight_puller.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <unordered_set>

#include <sys/un.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "clock_wait.h"
#include "host_buffer.h"
#include "local_relay_wire.h"
#include "relay_chunks.h"

namespace laminar {

namespace internal {

// One version a pull reads: its layout, checksums and bytes, held (the relay keeps it) while this
// lives.
struct PulledVersion {
  Version version;
  WeightManifest manifest;
  ChunkPlan plan;
  std::vector<std::uint64_t> checksums;  // [plan.num_chunks()]
  std::span<const std::byte> bytes;      // [plan.total_bytes()]
  bool pinned = false;
  std::shared_ptr<void> keep;
};

// Where a puller's versions come from.
class PullSource {
 public:
  virtual ~PullSource() = default;
  virtual std::optional<Version> newest_version() = 0;
  virtual Result<std::shared_ptr<PulledVersion>> acquire(Version v) = 0;
  virtual std::string name() const = 0;
};

namespace {

// A RelayStore in this process: the handle is the lease.
class StoreSource final : public PullSource {
 public:
  explicit StoreSource(std::shared_ptr<RelayStore> store) : store_(std::move(store)) {}
  std::optional<Version> newest_version() override { return store_->newest_version(); }
  Result<std::shared_ptr<PulledVersion>> acquire(Version v) override {
    auto h = store_->acquire(v);
    LAMINAR_RETURN_IF_ERROR(h.status());
    auto out = std::make_shared<PulledVersion>();
    out->version = v;
    out->manifest = h->manifest();
    out->plan = h->plan();
    out->checksums.resize(out->plan.num_chunks());
    for (std::uint32_t i = 0; i < out->plan.num_chunks(); ++i) out->checksums[i] = h->checksum(i).value();
    out->bytes = h->bytes();
    out->pinned = h->pinned();
    out->keep = std::make_shared<ReadHandle>(std::move(*h));
    return out;
  }
  std::string name() const override { return "this process"; }

 private:
  std::shared_ptr<RelayStore> store_;
};

// A lease on a local relay's version and the mapping of its memory, released once the pull is done
// with it (the mapping may live on in LocalSource's cache).
struct LocalLease {
  std::shared_ptr<SharedMapping> mapping;
  std::shared_ptr<LocalRelayConnection> connection;
  std::uint64_t lease = 0;
  ~LocalLease() {
    mapping.reset();
    connection->release(lease);
  }
};

// Relays in other processes on this host, over their LocalRelayServer sockets, in order of
// preference; a relay that fails is left for the next.
class LocalSource final : public PullSource {
 public:
  LocalSource(std::vector<std::string> paths, Duration timeout, std::shared_ptr<const ClockWaker> waker)
      : paths_(std::move(paths)), timeout_(timeout), waker_(std::move(waker)) {}

  std::optional<Version> newest_version() override {
    auto r = with_relay<std::optional<Version>>(
        [&](LocalRelayConnection& c) { return c.newest_version(timeout_); });
    return r.ok() ? *r : std::nullopt;
  }

  Result<std::shared_ptr<PulledVersion>> acquire(Version v) override {
    return with_relay<std::shared_ptr<PulledVersion>>(
        [&](LocalRelayConnection& c) -> Result<std::shared_ptr<PulledVersion>> {
          auto g = c.acquire(v, timeout_);
          LAMINAR_RETURN_IF_ERROR(g.status());
          auto m = mapping_for(g->fd.get(), g->plan.total_bytes());
          if (!m.ok()) {
            // A relay that hands out memory we cannot trust is treated as gone; closing the
            // connection ends its lease.
            c.mark_broken();
            return m.status().with_context(fmt::format("local relay '{}', version {}", c.path(), v.value()));
          }
          auto lease = std::make_shared<LocalLease>();
          lease->mapping = std::move(*m);
          const std::size_t size = std::size_t(g->plan.total_bytes());
          lease->connection = conn_;
          lease->lease = g->lease;
          auto out = std::make_shared<PulledVersion>();
          out->version = g->version;
          out->manifest = std::move(g->manifest);
          out->plan = g->plan;
          out->checksums = std::move(g->checksums);
          out->bytes = lease->mapping->bytes().first(size);
          out->keep = std::move(lease);
          return out;
        });
  }

  std::string name() const override { return paths_[current_]; }

 private:
  // Mappings of the relay buffers read last. A relay writes later versions into the buffers of
  // freed ones, so in steady state a grant names a memfd mapped already and the pull skips the
  // mapping (populating page tables costs about half as much as the copy itself). The cost: these
  // buffers' pages stay allocated while mapped here, even once the relay drops them.
  static constexpr std::size_t kCachedMappings = 3;

  // A read-only mapping of the granted memfd, reused when it is one of the cached ones.
  Result<std::shared_ptr<SharedMapping>> mapping_for(int fd, std::uint64_t bytes) {
    auto id = SharedMapping::check(fd, bytes);
    LAMINAR_RETURN_IF_ERROR(id.status());
    for (std::size_t i = 0; i < mappings_.size(); ++i) {
      if (mappings_[i]->id() == *id && mappings_[i]->bytes().size() >= bytes) {
        std::rotate(mappings_.begin(), mappings_.begin() + std::ptrdiff_t(i), mappings_.begin() + std::ptrdiff_t(i) + 1);
        return mappings_.front();
      }
    }
    auto m = SharedMapping::map(fd, bytes, *id);
    LAMINAR_RETURN_IF_ERROR(m.status());
    mappings_.insert(mappings_.begin(), *m);
    if (mappings_.size() > kCachedMappings) mappings_.pop_back();
    return m;
  }

  // Runs f against the current relay, moving on to the next (once round the list) while the
  // connection fails; an answer from a relay, error or not, is final.
  template <class T, class F>
  Result<T> with_relay(F&& f) {
    std::string why;
    StatusCode code = StatusCode::kUnavailable;
    for (std::size_t attempt = 0; attempt < paths_.size(); ++attempt) {
      const bool kept = conn_ != nullptr;
      if (!conn_) {
        auto c = LocalRelayConnection::connect(paths_[current_], waker_);
        if (!c.ok()) {
          why += fmt::format("{}{}", why.empty() ? "" : "; ", c.status().message());
          current_ = (current_ + 1) % paths_.size();
          continue;
        }
        conn_ = std::move(*c);
      }
      Result<T> r = f(*conn_);
      // The relay closes connections left idle, or evicts them for new clients: a kept connection
      // found closed is opened afresh once before the relay counts as failed.
      if (kept && conn_->broken() && r.status().code() == StatusCode::kUnavailable) {
        auto c = LocalRelayConnection::connect(paths_[current_], waker_);
        if (c.ok()) {
          conn_ = std::move(*c);
          r = f(*conn_);
        }
      }
      if (r.ok() || !conn_->broken()) return r;
      why += fmt::format("{}{}", why.empty() ? "" : "; ", r.status().message());
      code = r.status().code();
      conn_.reset();
      current_ = (current_ + 1) % paths_.size();
    }
    return Status(code, fmt::format("no local relay answered: {}", why));
  }

  std::vector<std::string> paths_;
  Duration timeout_;
  std::shared_ptr<const ClockWaker> waker_;
  std::size_t current_ = 0;
  std::shared_ptr<LocalRelayConnection> conn_;
  std::vector<std::shared_ptr<SharedMapping>> mappings_;  // most recently used first
};

std::uint64_t fingerprint(const PulledVersion& h) {
  return XXH3_64bits(h.checksums.data(), h.checksums.size() * sizeof(std::uint64_t)) ^ h.plan.total_bytes();
}

}  // namespace

}  // namespace internal

using internal::PulledVersion;

struct WeightPuller::Impl {
  struct Target {
    const WeightManifest::Entry* entry;
    TensorView view;
  };
  // Where a cancelled pull stopped: the version (and a digest of its checksums, so a pull resumed
  // on another relay only continues over the same bytes), the destinations, and how far it got.
  struct Progress {
    Version version;
    std::uint64_t fingerprint = 0;
    std::vector<std::pair<std::string, void*>> destinations;
    std::size_t target = 0;
    std::uint64_t offset = 0;
    std::uint64_t bytes_done = 0;
  };

  Impl(std::unique_ptr<internal::PullSource> s, WeightPullerOptions o) : source(std::move(s)), options(std::move(o)) {}

  Result<std::vector<Target>> check_destinations(const PulledVersion& h,
                                                 std::span<const NamedTensor> destinations) const;
  Status verify(const PulledVersion& h, const std::vector<Target>& targets) const;
  Status copy_into(const PulledVersion& h, std::span<const NamedTensor> destinations,
                   const std::vector<Target>& targets);

  std::unique_ptr<internal::PullSource> source;
  WeightPullerOptions options;
  std::optional<Version> current;
  std::shared_ptr<PulledVersion> prefetched;
  std::optional<Progress> progress;
  std::atomic<bool> cancel_requested{false};
};

namespace {

Status check_options(const WeightPullerOptions& options) {
  if (options.copy_chunk_bytes < ChunkPlan::kMinChunkBytes) {
    return invalid_argument(fmt::format("weight puller: copy_chunk_bytes is {}, at least {} is needed",
                                        options.copy_chunk_bytes, ChunkPlan::kMinChunkBytes));
  }
  return ok_status();
}

}  // namespace

WeightPuller::WeightPuller(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

WeightPuller::~WeightPuller() = default;

Result<std::unique_ptr<WeightPuller>> WeightPuller::create(std::shared_ptr<RelayStore> relay,
                                                           WeightPullerOptions options) {
  if (!relay) return invalid_argument("weight puller: the relay is null");
  LAMINAR_RETURN_IF_ERROR(check_options(options));
  auto source = std::make_unique<internal::StoreSource>(std::move(relay));
  return std::unique_ptr<WeightPuller>(new WeightPuller(std::make_unique<Impl>(std::move(source), std::move(options))));
}

Result<std::unique_ptr<WeightPuller>> WeightPuller::create_local(std::vector<std::string> socket_paths,
                                                                 WeightPullerOptions options) {
  if (socket_paths.empty()) return invalid_argument("weight puller: no local relay socket given");
  for (const std::string& p : socket_paths) {
    sockaddr_un addr;
    if (p.empty() || p.size() >= sizeof(addr.sun_path) || p.find('\0') != std::string::npos) {
      return invalid_argument(fmt::format("weight puller: local relay socket '{}' is not a usable socket path "
                                          "(1 to {} bytes, no NUL)", p, sizeof(addr.sun_path) - 1));
    }
  }
  if (options.relay_timeout <= Duration::zero()) {
    return invalid_argument(fmt::format("weight puller: relay_timeout is {} ns", options.relay_timeout.count()));
  }
  LAMINAR_RETURN_IF_ERROR(check_options(options));
  auto waker = internal::ClockWaker::create(internal::clock_or_steady(options.clock));
  LAMINAR_RETURN_IF_ERROR(waker.status().with_context("weight puller"));
  auto source = std::make_unique<internal::LocalSource>(std::move(socket_paths), options.relay_timeout,
                                                        std::move(*waker));
  return std::unique_ptr<WeightPuller>(new WeightPuller(std::make_unique<Impl>(std::move(source), std::move(options))));
}

std::optional<Version> WeightPuller::newest_version() const { return impl_->source->newest_version(); }

std::string WeightPuller::relay() const { return impl_->source->name(); }

std::optional<Version> WeightPuller::current_version() const noexcept { return impl_->current; }

std::optional<Version> WeightPuller::prefetched_version() const {
  if (!impl_->prefetched) return std::nullopt;
  return impl_->prefetched->version;
}

void WeightPuller::cancel() noexcept { impl_->cancel_requested.store(true); }

std::optional<WeightPuller::StoppedPull> WeightPuller::stopped_pull() const {
  if (!impl_->progress) return std::nullopt;
  return StoppedPull{impl_->progress->version, impl_->progress->bytes_done};
}

PullDecision WeightPuller::next_action(bool has_live_trajectory) const {
  return next_pull({impl_->current, prefetched_version(), has_live_trajectory}, newest_version(),
                   impl_->options.policy);
}

Result<std::vector<WeightPuller::Impl::Target>> WeightPuller::Impl::check_destinations(
    const PulledVersion& h, std::span<const NamedTensor> destinations) const {
  const Version v = h.version;
  if (destinations.empty()) {
    return invalid_argument(fmt::format("pull of version {}: no destination tensors given", v.value()));
  }
  std::vector<Target> out;
  std::unordered_set<std::string_view> seen;
  for (const NamedTensor& d : destinations) {
    if (!seen.insert(d.name).second) {
      return invalid_argument(fmt::format("pull of version {}: destination '{}' is given twice", v.value(), d.name));
    }
    auto e = h.manifest.find(d.name);
    if (!e.ok()) return e.status().with_context(fmt::format("pull of version {}", v.value()));
    LAMINAR_RETURN_IF_ERROR(h.manifest.check_view(d.name, d.view).with_context(
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

Status WeightPuller::Impl::verify(const PulledVersion& h, const std::vector<Target>& targets) const {
  if (!options.verify_checksums) return ok_status();
  for (const Target& t : targets) {
    auto [first, last] = h.plan.chunks_covering(t.entry->offset, t.entry->nbytes);
    LAMINAR_RETURN_IF_ERROR(internal::verify_chunks(h.version, h.plan, h.bytes.data(), h.checksums, first, last)
                                .with_context(fmt::format("pull of tensor '{}'", t.entry->name)));
  }
  return ok_status();
}

Status WeightPuller::Impl::copy_into(const PulledVersion& h, std::span<const NamedTensor> destinations,
                               const std::vector<Target>& targets) {
  std::vector<std::pair<std::string, void*>> dst_ids;
  for (const NamedTensor& d : destinations) dst_ids.emplace_back(std::string(d.name), d.view.data());
  std::size_t start_target = 0;
  std::uint64_t start_offset = 0;
  const std::uint64_t print = internal::fingerprint(h);
  if (progress && progress->version == h.version && progress->fingerprint == print &&
      progress->destinations == dst_ids) {
    start_target = progress->target;
    start_offset = progress->offset;
  }
  progress.reset();
  current.reset();  // the destinations hold a mix of versions until the copy completes
  cancel_requested.store(false);
  std::uint64_t done_before = 0;
  for (std::size_t k = 0; k < start_target; ++k) done_before += targets[k].entry->nbytes;

  const std::uint64_t step = options.copy_chunk_bytes;
  for (std::size_t k = start_target; k < targets.size(); ++k) {
    const Target& t = targets[k];
    const std::byte* src = h.bytes.data() + t.entry->offset;
    auto* dst = static_cast<std::byte*>(t.view.data());
    std::uint64_t off = k == start_target ? start_offset : 0;
    const auto stop_here = [&] {
      progress = Progress{h.version, print, std::move(dst_ids), k, off, done_before + off};
      return cancelled(fmt::format("pull of version {} stopped at tensor '{}' byte {}; pull again to resume",
                                   h.version.value(), t.entry->name, off));
    };
    if (!t.view.device().is_host()) {
      if (cancel_requested.exchange(false)) return stop_here();
      // One call per tensor so consecutive chunks overlap in the double-buffered device copy.
      LAMINAR_RETURN_IF_ERROR(internal::copy_host_to_device(dst + off, src + off, t.entry->nbytes - off, h.pinned,
                                                            options.device_stream, step)
                                  .with_context(fmt::format("pull of tensor '{}' into {}", t.entry->name,
                                                            to_string(t.view.device()))));
      done_before += t.entry->nbytes;
      continue;
    }
    for (; off < t.entry->nbytes; off += step) {
      if (cancel_requested.exchange(false)) return stop_here();
      std::memcpy(dst + off, src + off, std::min(step, t.entry->nbytes - off));
    }
    done_before += t.entry->nbytes;
  }
  current = h.version;
  return ok_status();
}

Status WeightPuller::pull(Version v, std::span<const NamedTensor> destinations, bool has_live_trajectory) {
  if (has_live_trajectory) {
    return failed_precondition(fmt::format(
        "pull of version {}: the worker has a live trajectory (on version {}); pull only when idle so each "
        "trajectory is generated by one version",
        v.value(), impl_->current ? std::to_string(impl_->current->value()) : "none"));
  }
  auto h = impl_->source->acquire(v);
  LAMINAR_RETURN_IF_ERROR(h.status().with_context("pull"));
  auto targets = impl_->check_destinations(**h, destinations);
  LAMINAR_RETURN_IF_ERROR(targets.status());
  LAMINAR_RETURN_IF_ERROR(impl_->verify(**h, *targets));
  return impl_->copy_into(**h, destinations, *targets);
}

Status WeightPuller::prefetch(Version v) {
  if (impl_->options.policy != PullPolicy::kPrefetchThenSwap) {
    return failed_precondition(fmt::format("prefetch of version {}: the puller's policy is pull-when-idle",
                                           v.value()));
  }
  auto h = impl_->source->acquire(v);
  LAMINAR_RETURN_IF_ERROR(h.status().with_context("prefetch"));
  if (impl_->options.verify_checksums) {
    std::vector<Impl::Target> all;
    for (const auto& e : (*h)->manifest.entries()) all.push_back({&e, TensorView()});
    LAMINAR_RETURN_IF_ERROR(impl_->verify(**h, all).with_context("prefetch"));
  }
  impl_->prefetched = std::move(*h);
  return ok_status();
}

Status WeightPuller::swap(std::span<const NamedTensor> destinations, bool has_live_trajectory) {
  if (!impl_->prefetched) return failed_precondition("swap: no version is prefetched");
  if (has_live_trajectory) {
    return failed_precondition(fmt::format("swap to version {}: the worker has a live trajectory; swap only when idle",
                                           impl_->prefetched->version.value()));
  }
  auto targets = impl_->check_destinations(*impl_->prefetched, destinations);
  LAMINAR_RETURN_IF_ERROR(targets.status());
  LAMINAR_RETURN_IF_ERROR(impl_->copy_into(*impl_->prefetched, destinations, *targets));
  impl_->prefetched.reset();
  return ok_status();
}

}  // namespace laminar
