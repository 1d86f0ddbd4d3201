// relay_store.h: RelayStore, the versioned weight store of the relay tier, and ReadHandle.
//
// The actor publish()es version v (a WeightManifest plus one view per tensor, in host or device
// memory) and goes straight back to training: publish copies the bytes into the store's
// (page-locked when CUDA is present) host memory and returns; it never waits for a reader. The
// bytes are cut into chunks (RelayStoreOptions::chunk_bytes) and each chunk gets an xxh3 checksum on
// a background thread; the version becomes visible only once every chunk is sealed (atomic commit).
// A relay fed by an upstream relay uses begin_version() / put_chunk() instead: each chunk is checked
// against the sender's checksum, a bad one is refused (kDataLoss) so it can be refetched, and
// resume_point() tells a cut transfer where to restart. Readers (WeightPuller, a downstream
// relay) acquire() the newest committed version, or a given one, as a ref-counted ReadHandle; a
// version no handle holds is freed as soon as a newer one commits, within memory_budget_bytes.
// With RelayStoreOptions::shareable, version buffers are sealed memfds, so a LocalRelayServer
// (local_relay.h) can hand a committed version to pullers in other processes on this host, which
// read it in place.
//
// Threads: one sealer thread per store hashes published chunks. Every other call runs on the
// caller's thread; the waits (wait_for_version, read_chunk, wait_for_newer) read
// RelayStoreOptions::clock, so a virtual clock's jump ends them, and the forwarding ones
// (read_chunk, wait_for_newer) take a std::stop_token, so a thread that must also stop for events
// of its own (a RelayNode's sender) waits here until one of them, with no period. Hashing a chunk cannot fail, so
// the store has no background_error(): every failure is the answer of the call that met it.
//
//   auto store = laminar::RelayStore::create({}).value();
//   laminar::NamedTensor w{"w", view};                          // view: f32[1024, 1024]
//   laminar::Status st = store->publish(laminar::Version(1), manifest, {&w, 1});
//   st = store->wait_for_version(laminar::Version(1), std::chrono::seconds(5));
//   auto h = store->acquire();                                  // newest committed
//   auto bytes = h->tensor("w");                                // span over the store's copy
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <vector>

#include "laminar/clock.h"
#include "laminar/relay_versions.h"
#include "laminar/status.h"
#include "laminar/types.h"
#include "laminar/weight_manifest.h"

namespace laminar {

// A tensor handed to publish or pull: the manifest name and a view of its memory.
struct NamedTensor {
  std::string_view name;
  TensorView view;
};

struct RelayStoreOptions {
  // Chunk size of versions this store publishes (received versions keep their sender's plan).
  std::uint64_t chunk_bytes = 4ull << 20;
  // Bytes of version buffers the store may hold, kept ones and recycled ones together.
  std::uint64_t memory_budget_bytes = VersionLedger::kUnlimited;
  // Page-lock version buffers through CUDA when a device is present.
  bool pin_memory = true;
  // Keep version buffers in sealed memfds, so a LocalRelayServer can hand versions to pullers in
  // other processes on this host. Off by default: anonymous memory gets transparent huge pages
  // where memfds (shmem) usually do not, and the chain's same-host UCX copies run about twice as
  // fast from it.
  bool shareable = false;
  // Stream for copies out of device memory during publish (the legacy default stream when null).
  Stream device_stream = Stream::cuda(nullptr);
  // Time of every wait (null: Clock::steady()).
  std::shared_ptr<Clock> clock;
};

struct RelayStoreStats {
  std::uint64_t bytes_held = 0;      // buffers of versions the ledger keeps
  std::uint64_t bytes_recycled = 0;  // freed buffers kept for reuse by the next version
  std::size_t versions_held = 0;
  std::uint64_t chunks_rejected = 0;  // put_chunk calls refused for a checksum or size mismatch
  bool pinned = false;                // the newest buffer is page-locked

  std::string to_json() const;
};

namespace internal {
struct RelayCore;
struct VersionSlot;
}  // namespace internal

// A reference on one committed version; the version's bytes stay valid and unchanged while any
// copy of the handle lives. Cheap to copy. A default-constructed handle holds nothing.
class ReadHandle {
 public:
  struct TensorBytes {
    const WeightManifest::Entry* entry = nullptr;
    std::span<const std::byte> bytes;  // [entry->nbytes]
  };

  ReadHandle() = default;

  bool valid() const noexcept { return slot_ != nullptr; }
  // Preconditions for everything below: valid().
  Version version() const noexcept;
  const WeightManifest& manifest() const noexcept;
  const ChunkPlan& plan() const noexcept;
  // The bytes are page-locked, so device copies can read them directly.
  bool pinned() const noexcept;
  // The whole flat buffer [plan().total_bytes()], laid out as the manifest says.
  std::span<const std::byte> bytes() const noexcept;
  // The sealed memfd holding bytes() from offset 0 (at least that long; writable only through the
  // store's own mapping), for handing the version to a reader in another process
  // (LocalRelayServer); -1 unless the store is RelayStoreOptions::shareable. Valid while the handle
  // lives.
  int shared_fd() const noexcept;
  // Chunk i [plan().chunk_size(i)] and its xxh3 checksum. kOutOfRange for i >= num_chunks.
  Result<std::span<const std::byte>> chunk(std::uint32_t i) const;
  Result<std::uint64_t> checksum(std::uint32_t i) const;
  // The bytes of one tensor. kNotFound naming the tensor when the manifest lacks it.
  Result<std::span<const std::byte>> tensor(std::string_view name) const;
  // A tensor-parallel shard: just the named tensors, in the order asked. kNotFound naming the
  // first unknown name, kInvalidArgument for a name asked twice.
  Result<std::vector<TensorBytes>> shard(std::span<const std::string> names) const;
  // Re-hashes the chunks [first, last) and compares with their checksums: kDataLoss naming the first
  // chunk that differs.
  Status verify(std::uint32_t first, std::uint32_t last) const;

 private:
  friend class RelayStore;
  ReadHandle(std::shared_ptr<internal::RelayCore> core, std::shared_ptr<internal::VersionSlot> slot);

  // Releases the ledger reference when the last copy goes.
  std::shared_ptr<void> ref_;
  std::shared_ptr<internal::VersionSlot> slot_;
};

class RelayStore {
 public:
  // kInvalidArgument for chunk_bytes below ChunkPlan::kMinChunkBytes or not a multiple of 256, or a
  // zero memory budget. Callers that share the store (a RelayNode, a LocalRelayServer, a
  // WeightPuller) hold it as a std::shared_ptr.
  static Result<std::unique_ptr<RelayStore>> create(RelayStoreOptions options = {});
  ~RelayStore();
  RelayStore(const RelayStore&) = delete;
  RelayStore& operator=(const RelayStore&) = delete;

  // Copies a whole version into the store and returns; the chunks are sealed in the background and
  // the version commits when all are sealed. Preconditions, each answered with kInvalidArgument
  // (nothing stored changes):
  //   v above every version this store has begun;
  //   a non-empty manifest;
  //   exactly one tensor per manifest entry, by name (unknown or repeated names rejected);
  //   each view with the manifest's dtype and shape, dense row-major, on the host or a CUDA device.
  // kResourceExhausted when the memory budget cannot hold the version next to those readers hold, or
  // the memory cannot be mapped (v is then spent); kUnimplemented / kFailedPrecondition for device views without CUDA / without a device.
  Status publish(Version v, const WeightManifest& manifest, std::span<const NamedTensor> tensors);

  // Starts receiving v from upstream, laid out as manifest and cut as plan (the sender's).
  // kInvalidArgument when v does not increase, the manifest is empty or plan does not cover
  // manifest.total_bytes(); kResourceExhausted as for publish.
  Status begin_version(Version v, const WeightManifest& manifest, const ChunkPlan& plan);
  // Stores chunk i of v if its xxh3 matches `checksum` and its size matches the plan; the version
  // commits with its last chunk. A chunk already stored is accepted again without change.
  // kDataLoss (the chunk is not kept: fetch it again) on a checksum or size mismatch, kNotFound for
  // a version not being received, kOutOfRange for a chunk index past the plan, kUnavailable while
  // another call is writing the same chunk.
  Status put_chunk(Version v, std::uint32_t i, std::span<const std::byte> bytes, std::uint64_t checksum);
  // The first chunk of v not yet stored, where a cut transfer resumes. kNotFound when v is not held.
  Result<std::uint32_t> resume_point(Version v) const;
  // Every chunk of v not yet stored, in order (empty once committed). kNotFound when v is not held.
  Result<std::vector<std::uint32_t>> missing_chunks(Version v) const;
  // Gives up an incomplete version (its sender is gone for good). kNotFound / kFailedPrecondition
  // for an unknown / committed version.
  Status abandon(Version v);

  // Newest committed version, if any.
  std::optional<Version> newest_version() const;
  // kNotFound when nothing is committed yet.
  Result<ReadHandle> acquire() const;
  // kNotFound when v is not held; kUnavailable when v is still arriving.
  Result<ReadHandle> acquire(Version v) const;
  // Waits until a version >= v is committed (kForever: no deadline). kDeadlineExceeded naming v and
  // the newest committed version when the timeout passes first; kInvalidArgument for a negative
  // timeout.
  Status wait_for_version(Version v, Duration timeout) const;

  RelayStoreStats stats() const;
  const RelayStoreOptions& options() const noexcept;

  // For forwarding down a relay chain before a version is complete.
  //
  // Newest version held, committed or still arriving.
  std::optional<Version> newest_held() const;
  struct VersionInfo {
    WeightManifest manifest;
    ChunkPlan plan;
    bool committed = false;
  };
  // kNotFound when v is not held.
  Result<VersionInfo> version_info(Version v) const;
  // One stored chunk; `keep` holds its memory valid even if the version is dropped meanwhile.
  struct ChunkRef {
    std::shared_ptr<const void> keep;
    std::span<const std::byte> bytes;  // [plan.chunk_size(i)]
    std::uint64_t checksum = 0;
  };
  // Chunk i of v once it is stored and verified, waiting up to timeout for it to arrive, or until
  // stop is requested. kNotFound when v is not held (or is dropped while waiting), kOutOfRange for
  // a bad index, kDeadlineExceeded when it does not arrive in time, kCancelled when stop was
  // requested first, kInvalidArgument for a negative timeout.
  Result<ChunkRef> read_chunk(Version v, std::uint32_t i, Duration timeout, std::stop_token stop = {}) const;
  // The whole buffer of a held version [plan.total_bytes()], for a transport to register: the
  // sender reads verified chunks from it, the receiver has missing chunks written straight into it
  // and then calls seal_in_place. `keep` holds the memory valid even if the version is dropped.
  struct VersionMemory {
    std::shared_ptr<void> keep;
    std::span<std::byte> bytes;
  };
  // kNotFound when v is not held.
  Result<VersionMemory> version_memory(Version v) const;
  // Chunk i of v was written into version_memory(v) by someone else: checks it against `checksum`
  // where it lies and stores it (the version commits with its last chunk). Errors as put_chunk.
  Status seal_in_place(Version v, std::uint32_t i, std::uint64_t checksum);
  // Waits until some version newer than `than` is held (any version when `than` is empty), the
  // timeout passes (a negative one is none) or stop is requested; returns whether one is held.
  bool wait_for_newer(std::optional<Version> than, Duration timeout, std::stop_token stop = {}) const;

 private:
  explicit RelayStore(std::shared_ptr<internal::RelayCore> core);
  std::shared_ptr<internal::RelayCore> core_;
};

}  // namespace laminar
