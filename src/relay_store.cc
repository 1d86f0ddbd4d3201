#include "laminar/relay_store.h"

#include <fmt/format.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_set>

#include "clock_wait.h"
#include "host_buffer.h"
#include "relay_chunks.h"
#include "stats_fields.h"

namespace laminar {

namespace internal {

namespace {
// Freed buffers kept for the next version: reusing one skips the mapping, page faults and CUDA
// registration, which would otherwise land on the actor's publish.
constexpr std::size_t kMaxRecycled = 2;
}  // namespace

// Freed version buffers waiting for reuse. Its own lock, taken last, because a slot may die (and
// hand its buffer back) while the store's lock is held.
struct BufferPool {
  std::mutex mu;
  std::vector<HostBuffer> free;
  std::uint64_t free_bytes = 0;
  // Budget minus the bytes the ledger holds: what recycled buffers may occupy.
  std::atomic<std::uint64_t> room{0};

  void put(HostBuffer b) {
    std::lock_guard lock(mu);
    if (free.size() >= kMaxRecycled || free_bytes + b.size() > room.load()) return;
    free_bytes += b.size();
    free.push_back(std::move(b));
  }

  // A recycled buffer of exactly n bytes, or an empty one. Drops recycled buffers that no longer fit
  // the room left.
  HostBuffer take(std::size_t n) {
    std::lock_guard lock(mu);
    HostBuffer out;
    for (auto it = free.begin(); it != free.end(); ++it) {
      if (it->size() == n) {
        free_bytes -= n;
        out = std::move(*it);
        free.erase(it);
        break;
      }
    }
    while (!free.empty() && free_bytes > room.load()) {
      free_bytes -= free.back().size();
      free.pop_back();
    }
    return out;
  }

  std::uint64_t bytes() {
    std::lock_guard lock(mu);
    return free_bytes;
  }
};

struct VersionSlot {
  enum class ChunkState : std::uint8_t { kMissing, kWriting, kStored };

  Version version;
  WeightManifest manifest;
  ChunkPlan plan;
  HostBuffer buffer;                     // [plan.total_bytes()]
  std::vector<std::uint64_t> checksums;  // [num_chunks], final once the version commits
  std::vector<ChunkState> state;         // [num_chunks], guarded by RelayCore::mu
  std::shared_ptr<BufferPool> pool;

  ~VersionSlot() {
    if (pool && buffer.data() != nullptr) pool->put(std::move(buffer));
  }
};

struct RelayCore {
  explicit RelayCore(RelayStoreOptions o)
      : options(std::move(o)),
        clock(clock_or_steady(options.clock)),
        ledger(options.memory_budget_bytes),
        pool(std::make_shared<BufferPool>()) {
    pool->room = options.memory_budget_bytes;
  }

  Result<std::shared_ptr<VersionSlot>> begin_slot(Version v, const WeightManifest& manifest, const ChunkPlan& plan);
  Result<std::shared_ptr<VersionSlot>> claim_chunk(Version v, std::uint32_t i, std::uint64_t nbytes,
                                                   std::uint64_t checksum, bool* already);
  Status finish_chunk(VersionSlot& slot, std::uint32_t i, std::uint64_t checksum);

  // Applies what the ledger decided: drops the slots of freed versions, which ends the waits for
  // their chunks. Caller holds mu.
  void drop(const std::vector<Version>& freed) {
    for (Version v : freed) slots.erase(v);
    if (!freed.empty()) changed.notify_all();
    pool->room = ledger.memory_budget() - ledger.bytes_held();
  }

  void release(Version v) {
    std::shared_ptr<VersionSlot> keep;  // dies after the lock, so the pool is not touched under it
    std::lock_guard lock(mu);
    auto it = slots.find(v);
    if (it != slots.end()) keep = it->second;
    auto freed = ledger.release(v);
    LAMINAR_CHECK_MSG(freed.ok(), freed.status().to_string());
    drop(*freed);
  }

  // Records chunk i of slot as sealed with checksum h; commits the version with its last chunk.
  // Caller holds mu. kAborted when the version was abandoned meanwhile.
  Status seal(VersionSlot& slot, std::uint32_t i, std::uint64_t h) {
    slot.checksums[i] = h;
    slot.state[i] = VersionSlot::ChunkState::kStored;
    auto r = ledger.chunk_verified(slot.version, i);
    if (!r.ok()) {
      return aborted(fmt::format("version {} was given up while chunk {} arrived", slot.version.value(), i));
    }
    changed.notify_all();
    drop(r->second);
    return ok_status();
  }

  void seal_loop() {
    for (;;) {
      std::pair<std::shared_ptr<VersionSlot>, std::uint32_t> task;
      {
        std::unique_lock lock(seal_mu);
        seal_cv.wait(lock, [&] { return stopping || !seal_queue.empty(); });
        if (seal_queue.empty()) return;
        task = std::move(seal_queue.front());
        seal_queue.pop_front();
      }
      VersionSlot& s = *task.first;
      const std::uint32_t i = task.second;
      const std::uint64_t h = internal::chunk_checksum(s.plan, s.buffer.data(), i);
      std::lock_guard lock(mu);
      // An abandoned version (its publish failed half way) has nothing left to commit.
      (void)seal(s, i, h);
    }
  }

  void enqueue_seal(const std::shared_ptr<VersionSlot>& slot) {
    {
      std::lock_guard lock(seal_mu);
      for (std::uint32_t i = 0; i < slot->plan.num_chunks(); ++i) seal_queue.emplace_back(slot, i);
    }
    seal_cv.notify_one();
  }

  // Ends every wait on `changed`, which then re-checks its condition (a stop_token's request).
  void wake_all() {
    std::lock_guard lock(mu);
    changed.notify_all();
  }

  void stop() {
    {
      std::lock_guard lock(seal_mu);
      stopping = true;
    }
    seal_cv.notify_all();
    if (sealer.joinable()) sealer.join();
  }

  const RelayStoreOptions options;
  const std::shared_ptr<Clock> clock;
  mutable std::mutex mu;
  // Signalled on every chunk stored, version begun, committed or dropped, on every jump of a
  // virtual clock (clock_wake), and when a waiter's stop_token is stopped.
  mutable std::condition_variable changed;
  ClockSubscription clock_wake;
  VersionLedger ledger;
  std::map<Version, std::shared_ptr<VersionSlot>> slots;
  std::shared_ptr<BufferPool> pool;
  std::uint64_t chunks_rejected = 0;

  std::mutex seal_mu;
  std::condition_variable seal_cv;
  std::deque<std::pair<std::shared_ptr<VersionSlot>, std::uint32_t>> seal_queue;
  bool stopping = false;
  std::thread sealer;
};

namespace {

// Holds one ledger reference for every copy of a ReadHandle.
struct RefToken {
  std::shared_ptr<RelayCore> core;
  Version version;
  ~RefToken() { core->release(version); }
};

std::string held_versions(const VersionLedger& ledger) {
  std::string s;
  for (Version v : ledger.versions()) {
    s += fmt::format("{}{}{}", s.empty() ? "" : ", ", v.value(), ledger.is_committed(v) ? "" : " (arriving)");
  }
  return s.empty() ? "none" : s;
}

}  // namespace

}  // namespace internal

using internal::RelayCore;
using internal::VersionSlot;

// ---------------------------------------------------------------------------------------------
// ReadHandle

ReadHandle::ReadHandle(std::shared_ptr<RelayCore> core, std::shared_ptr<VersionSlot> slot)
    : ref_(std::make_shared<internal::RefToken>(std::move(core), slot->version)),
      slot_(std::move(slot)) {}

Version ReadHandle::version() const noexcept { return slot_->version; }
const WeightManifest& ReadHandle::manifest() const noexcept { return slot_->manifest; }
const ChunkPlan& ReadHandle::plan() const noexcept { return slot_->plan; }
bool ReadHandle::pinned() const noexcept { return slot_->buffer.pinned(); }

std::span<const std::byte> ReadHandle::bytes() const noexcept {
  return {slot_->buffer.data(), std::size_t(slot_->plan.total_bytes())};
}

int ReadHandle::shared_fd() const noexcept { return slot_->buffer.fd(); }

Result<std::span<const std::byte>> ReadHandle::chunk(std::uint32_t i) const {
  if (i >= slot_->plan.num_chunks()) {
    return out_of_range(fmt::format("version {}: chunk {} does not exist (it has {})", slot_->version.value(), i,
                                    slot_->plan.num_chunks()));
  }
  return std::span<const std::byte>(slot_->buffer.data() + slot_->plan.chunk_offset(i),
                                    std::size_t(slot_->plan.chunk_size(i)));
}

Result<std::uint64_t> ReadHandle::checksum(std::uint32_t i) const {
  if (i >= slot_->plan.num_chunks()) {
    return out_of_range(fmt::format("version {}: chunk {} does not exist (it has {})", slot_->version.value(), i,
                                    slot_->plan.num_chunks()));
  }
  return slot_->checksums[i];
}

Result<std::span<const std::byte>> ReadHandle::tensor(std::string_view name) const {
  auto e = slot_->manifest.find(name);
  if (!e.ok()) return e.status().with_context(fmt::format("version {}", slot_->version.value()));
  return std::span<const std::byte>(slot_->buffer.data() + (*e)->offset, std::size_t((*e)->nbytes));
}

Result<std::vector<ReadHandle::TensorBytes>> ReadHandle::shard(std::span<const std::string> names) const {
  std::vector<TensorBytes> out;
  std::unordered_set<std::string_view> seen;
  for (const std::string& n : names) {
    if (!seen.insert(n).second) {
      return invalid_argument(fmt::format("shard asks for tensor '{}' twice", n));
    }
    auto e = slot_->manifest.find(n);
    if (!e.ok()) return e.status().with_context(fmt::format("version {}", slot_->version.value()));
    out.push_back({*e, {slot_->buffer.data() + (*e)->offset, std::size_t((*e)->nbytes)}});
  }
  return out;
}

namespace internal {

std::uint64_t chunk_checksum(const ChunkPlan& plan, const std::byte* buffer, std::uint32_t i) {
  return XXH3_64bits(buffer + plan.chunk_offset(i), plan.chunk_size(i));
}

Status verify_chunks(Version v, const ChunkPlan& plan, const std::byte* buffer,
                     std::span<const std::uint64_t> checksums, std::uint32_t first, std::uint32_t last) {
  for (std::uint32_t i = first; i < last; ++i) {
    const std::uint64_t h = chunk_checksum(plan, buffer, i);
    if (h != checksums[i]) {
      return data_loss(
          fmt::format("version {}: chunk {} hashes to {:016x}, its checksum is {:016x}", v.value(), i, h, checksums[i]));
    }
  }
  return ok_status();
}

}  // namespace internal

Status ReadHandle::verify(std::uint32_t first, std::uint32_t last) const {
  if (first > last || last > slot_->plan.num_chunks()) {
    return out_of_range(fmt::format("version {}: chunk range [{}, {}) is not within [0, {})",
                                    slot_->version.value(), first, last, slot_->plan.num_chunks()));
  }
  return internal::verify_chunks(slot_->version, slot_->plan, slot_->buffer.data(), slot_->checksums, first, last);
}

Result<std::shared_ptr<VersionSlot>> internal::RelayCore::begin_slot(Version v, const WeightManifest& manifest,
                                                            const ChunkPlan& plan) {
  if (manifest.empty()) return invalid_argument(fmt::format("version {}: the manifest is empty", v.value()));
  if (plan.total_bytes() != manifest.total_bytes()) {
    return invalid_argument(fmt::format("version {}: chunk plan covers {} bytes, the manifest {}", v.value(),
                                        plan.total_bytes(), manifest.total_bytes()));
  }
  {
    std::lock_guard lock(mu);
    LAMINAR_RETURN_IF_ERROR(ledger.begin(v, plan));
    pool->room = ledger.memory_budget() - ledger.bytes_held();
  }
  HostBuffer buf = pool->take(plan.total_bytes());
  if (buf.data() == nullptr) {
    auto fresh = HostBuffer::allocate(plan.total_bytes(), options.pin_memory, options.shareable);
    if (!fresh.ok()) {
      std::lock_guard lock(mu);
      (void)ledger.abandon(v);
      pool->room = ledger.memory_budget() - ledger.bytes_held();
      return fresh.status().with_context(fmt::format("version {}", v.value()));
    }
    buf = std::move(*fresh);
  }
  auto slot = std::make_shared<VersionSlot>();
  slot->version = v;
  slot->manifest = manifest;
  slot->plan = plan;
  slot->buffer = std::move(buf);
  slot->checksums.assign(plan.num_chunks(), 0);
  slot->state.assign(plan.num_chunks(), VersionSlot::ChunkState::kMissing);
  slot->pool = pool;
  std::lock_guard lock(mu);
  slots.emplace(v, slot);
  changed.notify_all();
  return slot;
}

Result<std::shared_ptr<VersionSlot>> internal::RelayCore::claim_chunk(Version v, std::uint32_t i, std::uint64_t nbytes,
                                                             std::uint64_t checksum, bool* already) {
  *already = false;
  std::lock_guard lock(mu);
  auto it = slots.find(v);
  if (it == slots.end()) {
    return not_found(fmt::format("chunk {} of version {}: that version is not being received (held: {})", i,
                                 v.value(), held_versions(ledger)));
  }
  const std::shared_ptr<VersionSlot>& slot = it->second;
  if (i >= slot->plan.num_chunks()) {
    return out_of_range(
        fmt::format("chunk {} of version {}: the version has {} chunks", i, v.value(), slot->plan.num_chunks()));
  }
  if (ledger.is_committed(v)) {
    // A late duplicate (e.g. resent after a reconnect) of a version already complete.
    if (slot->checksums[i] == checksum) {
      *already = true;
      return slot;
    }
    return failed_precondition(fmt::format(
        "chunk {} of version {}: the version is committed and this chunk does not match it", i, v.value()));
  }
  if (nbytes != slot->plan.chunk_size(i)) {
    ++chunks_rejected;
    return data_loss(fmt::format("chunk {} of version {}: {} bytes arrived, {} expected", i, v.value(), nbytes,
                                 slot->plan.chunk_size(i)));
  }
  switch (slot->state[i]) {
    case VersionSlot::ChunkState::kStored: *already = true; break;
    case VersionSlot::ChunkState::kWriting:
      return unavailable(fmt::format("chunk {} of version {} is being written by another call", i, v.value()));
    case VersionSlot::ChunkState::kMissing: slot->state[i] = VersionSlot::ChunkState::kWriting; break;
  }
  return slot;
}

Status internal::RelayCore::finish_chunk(VersionSlot& slot, std::uint32_t i, std::uint64_t checksum) {
  // Hash what was stored, not what was handed in, so the check also covers the copy.
  const std::uint64_t h = internal::chunk_checksum(slot.plan, slot.buffer.data(), i);
  std::lock_guard lock(mu);
  if (h != checksum) {
    slot.state[i] = VersionSlot::ChunkState::kMissing;
    ++chunks_rejected;
    return data_loss(fmt::format("chunk {} of version {}: bytes hash to {:016x}, the sender's checksum is {:016x}; "
                                 "fetch it again",
                                 i, slot.version.value(), h, checksum));
  }
  return seal(slot, i, h);
}

// ---------------------------------------------------------------------------------------------
// RelayStore

RelayStore::RelayStore(std::shared_ptr<RelayCore> core) : core_(std::move(core)) {
  core_->clock_wake = core_->clock->subscribe([core = core_.get()] { core->wake_all(); });
  core_->sealer = std::thread([core = core_.get()] { core->seal_loop(); });
}

RelayStore::~RelayStore() {
  core_->clock_wake.reset();
  core_->stop();
}

const RelayStoreOptions& RelayStore::options() const noexcept { return core_->options; }

Result<std::unique_ptr<RelayStore>> RelayStore::create(RelayStoreOptions options) {
  if (options.chunk_bytes < ChunkPlan::kMinChunkBytes || options.chunk_bytes % WeightManifest::kAlignment != 0) {
    return invalid_argument(fmt::format("relay store: chunk_bytes is {}; it must be at least {} and a multiple of {}",
                                        options.chunk_bytes, ChunkPlan::kMinChunkBytes, WeightManifest::kAlignment));
  }
  if (options.memory_budget_bytes == 0) return invalid_argument("relay store: memory_budget_bytes is 0");
  return std::unique_ptr<RelayStore>(new RelayStore(std::make_shared<RelayCore>(std::move(options))));
}

namespace {

Status check_publish(Version v, const WeightManifest& manifest, std::span<const NamedTensor> tensors,
                     std::vector<const NamedTensor*>* by_entry) {
  if (manifest.empty()) return invalid_argument(fmt::format("publish version {}: the manifest is empty", v.value()));
  by_entry->assign(manifest.size(), nullptr);
  for (const NamedTensor& t : tensors) {
    auto e = manifest.find(t.name);
    if (!e.ok()) {
      return invalid_argument(
          fmt::format("publish version {}: tensor '{}' is not in the manifest", v.value(), t.name));
    }
    const auto idx = std::size_t(*e - manifest.entries().data());
    if ((*by_entry)[idx] != nullptr) {
      return invalid_argument(fmt::format("publish version {}: tensor '{}' is given twice", v.value(), t.name));
    }
    LAMINAR_RETURN_IF_ERROR(manifest.check_view(t.name, t.view).with_context(fmt::format("publish version {}", v.value())));
    if (!t.view.is_contiguous()) {
      return invalid_argument(fmt::format("publish version {}: tensor '{}' is not dense row-major ({})", v.value(),
                                          t.name, t.view.describe()));
    }
    if (!t.view.device().is_host()) LAMINAR_RETURN_IF_ERROR(internal::cuda_device_usable());
    (*by_entry)[idx] = &t;
  }
  for (std::size_t i = 0; i < manifest.size(); ++i) {
    if ((*by_entry)[i] == nullptr) {
      return invalid_argument(fmt::format("publish version {}: no tensor given for manifest entry '{}'", v.value(),
                                          manifest.entries()[i].name));
    }
  }
  return ok_status();
}

}  // namespace

Status RelayStore::publish(Version v, const WeightManifest& manifest, std::span<const NamedTensor> tensors) {
  std::vector<const NamedTensor*> by_entry;
  LAMINAR_RETURN_IF_ERROR(check_publish(v, manifest, tensors, &by_entry));
  auto plan = ChunkPlan::make(manifest.total_bytes(), core_->options.chunk_bytes);
  LAMINAR_RETURN_IF_ERROR(plan.status());
  auto begun = core_->begin_slot(v, manifest, *plan);
  LAMINAR_RETURN_IF_ERROR(begun.status());
  std::shared_ptr<VersionSlot> slot = std::move(*begun);
  // Whole tensors at a time: large copies let memcpy stream past the caches. Padding between
  // tensors is zeroed: it is part of the checksummed bytes every relay compares.
  std::byte* base = slot->buffer.data();
  std::uint64_t pos = 0;
  const auto entries = manifest.entries();
  for (std::size_t k = 0; k < entries.size(); ++k) {
    const auto& e = entries[k];
    if (e.offset > pos) std::memset(base + pos, 0, e.offset - pos);
    const TensorView& view = by_entry[k]->view;
    if (view.device().is_host()) {
      std::memcpy(base + e.offset, view.data(), e.nbytes);
    } else {
      Status st = internal::copy_device_to_host(base + e.offset, view.data(), e.nbytes, core_->options.device_stream,
                                                core_->options.chunk_bytes);
      if (!st.ok()) {
        (void)abandon(v);
        return st.with_context(fmt::format("publish version {}: copying tensor '{}' from {}", v.value(), e.name,
                                           to_string(view.device())));
      }
    }
    pos = e.offset + e.nbytes;
  }
  if (pos < plan->total_bytes()) std::memset(base + pos, 0, plan->total_bytes() - pos);
  // Sealing starts only now: hashing next to the copy would compete with it for memory bandwidth
  // and cores, and the copy is the only part the actor waits for.
  core_->enqueue_seal(slot);
  return ok_status();
}

Status RelayStore::begin_version(Version v, const WeightManifest& manifest, const ChunkPlan& plan) {
  return core_->begin_slot(v, manifest, plan).status();
}




Status RelayStore::put_chunk(Version v, std::uint32_t i, std::span<const std::byte> bytes, std::uint64_t checksum) {
  bool already = false;
  auto slot = core_->claim_chunk(v, i, bytes.size(), checksum, &already);
  LAMINAR_RETURN_IF_ERROR(slot.status());
  if (already) return ok_status();
  std::memcpy((*slot)->buffer.data() + (*slot)->plan.chunk_offset(i), bytes.data(), bytes.size());
  return core_->finish_chunk(**slot, i, checksum);
}

Status RelayStore::seal_in_place(Version v, std::uint32_t i, std::uint64_t checksum) {
  std::uint64_t size = 0;
  {
    std::lock_guard lock(core_->mu);
    auto it = core_->slots.find(v);
    if (it != core_->slots.end() && i < it->second->plan.num_chunks()) size = it->second->plan.chunk_size(i);
  }
  bool already = false;
  auto slot = core_->claim_chunk(v, i, size, checksum, &already);
  LAMINAR_RETURN_IF_ERROR(slot.status());
  if (already) return ok_status();
  return core_->finish_chunk(**slot, i, checksum);
}

Result<RelayStore::VersionMemory> RelayStore::version_memory(Version v) const {
  std::lock_guard lock(core_->mu);
  auto it = core_->slots.find(v);
  if (it == core_->slots.end()) {
    return not_found(fmt::format("relay store: version {} is not held (held: {})", v.value(),
                                 internal::held_versions(core_->ledger)));
  }
  return VersionMemory{it->second, {it->second->buffer.data(), std::size_t(it->second->plan.total_bytes())}};
}

Result<std::uint32_t> RelayStore::resume_point(Version v) const {
  std::lock_guard lock(core_->mu);
  return core_->ledger.resume_point(v);
}

Result<std::vector<std::uint32_t>> RelayStore::missing_chunks(Version v) const {
  std::lock_guard lock(core_->mu);
  return core_->ledger.missing_chunks(v);
}

Status RelayStore::abandon(Version v) {
  std::shared_ptr<VersionSlot> keep;
  std::lock_guard lock(core_->mu);
  LAMINAR_RETURN_IF_ERROR(core_->ledger.abandon(v));
  auto it = core_->slots.find(v);
  if (it != core_->slots.end()) {
    keep = std::move(it->second);
    core_->slots.erase(it);
    core_->changed.notify_all();  // a wait for one of its chunks ends: kNotFound
  }
  core_->pool->room = core_->ledger.memory_budget() - core_->ledger.bytes_held();
  return ok_status();
}

std::optional<Version> RelayStore::newest_version() const {
  std::lock_guard lock(core_->mu);
  return core_->ledger.newest_committed();
}

Result<ReadHandle> RelayStore::acquire() const {
  std::optional<Version> v = newest_version();
  if (!v) return not_found("relay store: no version is committed yet");
  // A newer version may commit (and free v) between the two locks; take whatever is newest then.
  for (;;) {
    auto h = acquire(*v);
    if (h.ok() || h.status().code() != StatusCode::kNotFound) return h;
    v = newest_version();
  }
}

Result<ReadHandle> RelayStore::acquire(Version v) const {
  std::lock_guard lock(core_->mu);
  auto it = core_->slots.find(v);
  if (it == core_->slots.end()) {
    return not_found(fmt::format("relay store: version {} is not held (held: {})", v.value(),
                                 internal::held_versions(core_->ledger)));
  }
  if (!core_->ledger.is_committed(v)) {
    return unavailable(fmt::format("relay store: version {} is still arriving", v.value()));
  }
  LAMINAR_RETURN_IF_ERROR(core_->ledger.add_ref(v));
  return ReadHandle(core_, it->second);
}

Status RelayStore::wait_for_version(Version v, Duration timeout) const {
  if (timeout < Duration::zero()) {
    return invalid_argument(fmt::format("relay store: wait_for_version timeout is negative ({} ns)", timeout.count()));
  }
  const Duration deadline = deadline_after(*core_->clock, timeout);
  std::unique_lock lock(core_->mu);
  const bool ok = internal::wait_until(*core_->clock, core_->changed, lock, deadline, [&] {
    auto n = core_->ledger.newest_committed();
    return n && *n >= v;
  });
  if (ok) return ok_status();
  auto n = core_->ledger.newest_committed();
  return deadline_exceeded(fmt::format("relay store: version {} not committed after {} ns (newest committed: {})",
                                       v.value(), timeout.count(), n ? std::to_string(n->value()) : "none"));
}

std::optional<Version> RelayStore::newest_held() const {
  std::lock_guard lock(core_->mu);
  if (core_->slots.empty()) return std::nullopt;
  return core_->slots.rbegin()->first;
}

Result<RelayStore::VersionInfo> RelayStore::version_info(Version v) const {
  std::lock_guard lock(core_->mu);
  auto it = core_->slots.find(v);
  if (it == core_->slots.end()) {
    return not_found(fmt::format("relay store: version {} is not held (held: {})", v.value(),
                                 internal::held_versions(core_->ledger)));
  }
  return VersionInfo{it->second->manifest, it->second->plan, core_->ledger.is_committed(v)};
}

Result<RelayStore::ChunkRef> RelayStore::read_chunk(Version v, std::uint32_t i, Duration timeout,
                                                    std::stop_token stop) const {
  if (timeout < Duration::zero()) {
    return invalid_argument(fmt::format("relay store: read_chunk timeout is negative ({} ns)", timeout.count()));
  }
  const Duration deadline = deadline_after(*core_->clock, timeout);
  const std::stop_callback wake(stop, [core = core_.get()] { core->wake_all(); });  // before the lock it takes
  std::unique_lock lock(core_->mu);
  std::shared_ptr<VersionSlot> slot;
  Status why;
  const bool ready = internal::wait_until(*core_->clock, core_->changed, lock, deadline, [&] {
    auto it = core_->slots.find(v);
    if (it == core_->slots.end()) {
      why = not_found(fmt::format("relay store: version {} is not held (held: {})", v.value(),
                                  internal::held_versions(core_->ledger)));
      return true;
    }
    if (i >= it->second->plan.num_chunks()) {
      why = out_of_range(fmt::format("version {}: chunk {} does not exist (it has {})", v.value(), i,
                                     it->second->plan.num_chunks()));
      return true;
    }
    if (it->second->state[i] != VersionSlot::ChunkState::kStored && !core_->ledger.is_committed(v)) {
      if (!stop.stop_requested()) return false;
      why = cancelled(fmt::format("relay store: stopped waiting for chunk {} of version {}", i, v.value()));
      return true;
    }
    slot = it->second;
    return true;
  });
  if (!ready) {
    return deadline_exceeded(fmt::format("relay store: chunk {} of version {} did not arrive in {} ns", i,
                                         v.value(), timeout.count()));
  }
  if (!why.ok()) return why;
  ChunkRef ref;
  ref.bytes = {slot->buffer.data() + slot->plan.chunk_offset(i), std::size_t(slot->plan.chunk_size(i))};
  ref.checksum = slot->checksums[i];
  ref.keep = std::move(slot);
  return ref;
}

bool RelayStore::wait_for_newer(std::optional<Version> than, Duration timeout, std::stop_token stop) const {
  const Duration deadline = deadline_after(*core_->clock, std::max(timeout, Duration::zero()));
  const std::stop_callback wake(stop, [core = core_.get()] { core->wake_all(); });  // before the lock it takes
  std::unique_lock lock(core_->mu);
  const auto newer = [&] { return !core_->slots.empty() && (!than || core_->slots.rbegin()->first > *than); };
  internal::wait_until(*core_->clock, core_->changed, lock, deadline, [&] { return newer() || stop.stop_requested(); });
  return newer();
}

RelayStoreStats RelayStore::stats() const {
  RelayStoreStats s;
  {
    std::lock_guard lock(core_->mu);
    s.bytes_held = core_->ledger.bytes_held();
    s.versions_held = core_->ledger.versions().size();
    s.chunks_rejected = core_->chunks_rejected;
    if (!core_->slots.empty()) s.pinned = core_->slots.rbegin()->second->buffer.pinned();
  }
  s.bytes_recycled = core_->pool->bytes();
  return s;
}

std::string RelayStoreStats::to_json() const { return internal::stats_json(*this); }

}  // namespace laminar
