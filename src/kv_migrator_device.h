// kv_migrator_device.h (private to src/): what a KvMigrator needs of CUDA and NCCL to move pages
// between device pools, behind host types, so the migrator builds the same with and without CUDA
// (without it, kv_device_pools_usable() says so and nothing else is reached).
//
// A KvDeviceLink is one NCCL communicator of two ranks between two migrators, source rank 0 and
// destination rank 1, created by the destination (new_kv_link_token()) and joined by both
// (join(): non-blocking, NCCL connects in the background; joined() polls). It runs everything on
// a stream of its own, in the order posted: the receiver posts its receives in the order the
// sender posted its sends (KvMigrator numbers them), as NCCL matches point-to-point operations
// between two ranks in order. abort() (ncclCommAbort) ends whatever is in flight on it; a link
// that failed or was aborted is never used again.
//
// Threads: the decode-loop thread that calls the migrator, only. No call blocks on the peer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "laminar/status.h"
#include "laminar/types.h"

namespace laminar::internal {

// Whether pools on `device` can move: OK; kUnimplemented in a build without CUDA; kFailedPrecondition
// naming why the runtime cannot use the device.
Status kv_device_pools_usable(Device device);

// The pools of a cache in device memory, as the checksum kernel reads them.
struct KvDevicePools {
  const void* k = nullptr;  // [num_layers, num_pages, page_bytes] bytes
  const void* v = nullptr;
  std::int64_t num_pages = 0;
  std::int64_t page_bytes = 0;
  std::int32_t num_layers = 0;
};

// Bytes of a pool to send (rank 0) or receive into (rank 1).
struct KvDeviceSpan {
  std::byte* data = nullptr;
  std::size_t bytes = 0;
};

// Work posted on a link: transfers, then checksums of pages as they are once the transfers are done.
class KvDeviceWork {
 public:
  virtual ~KvDeviceWork() = default;
  // true once every part finished (checksums() holds the results); false while it runs; the
  // link's error if it failed.
  virtual Result<bool> done() = 0;
  virtual const std::vector<std::uint64_t>& checksums() const = 0;
};

class KvDeviceLink {
 public:
  // A fresh NCCL unique id, [kMigrationLinkTokenBytes].
  static Result<std::vector<std::byte>> new_token();
  // Starts joining the communicator `token` names as `rank` (0 sends, 1 receives) on `device`.
  static Result<std::shared_ptr<KvDeviceLink>> join(std::span<const std::byte> token, int rank, Device device);
  virtual ~KvDeviceLink() = default;

  // true once both ranks joined; false while joining; the error once it failed or was aborted.
  virtual Result<bool> joined() = 0;
  // Posts, after everything posted before: one NCCL group sending (rank 0) or receiving (rank 1)
  // the spans in order, then the checksums (cuda/kv_page_checksum.cuh) of `pages` in `pools`.
  // Either part may be empty; a checksum-only work needs no joined link.
  virtual Result<std::unique_ptr<KvDeviceWork>> post(std::span<const KvDeviceSpan> spans, const KvDevicePools& pools,
                                                     std::span<const std::int32_t> pages) = 0;
  // Ends the communicator (ncclCommAbort): work in flight fails, the link is unusable after.
  virtual void abort() = 0;
};

}  // namespace laminar::internal
