// KvDeviceLink and KvDeviceWork (kv_migrator_device.h): NCCL send/recv and the page checksum kernel
// on a stream of the link's own. Without CUDA every call says that this build has no device path.
#include "kv_migrator_device.h"

#include <fmt/format.h>

#include "host_buffer.h"
#include "kv_migration_wire.h"

#if defined(LAMINAR_HAVE_CUDA)
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <deque>

#include "../cuda/kv_page_checksum.cuh"

namespace laminar::kernels::cuda_detail {
Status launch_kv_page_checksums(const KvChecksumParams& p, void* stream);
}  // namespace laminar::kernels::cuda_detail
#endif

namespace laminar::internal {

#if !defined(LAMINAR_HAVE_CUDA)

Status kv_device_pools_usable(Device device) {
  return unimplemented(fmt::format("kv migrator: the cache's pools are on {}, and laminar was built without CUDA "
                                   "(LAMINAR_CUDA=OFF): only host pools move in this build",
                                   to_string(device)));
}

Result<std::vector<std::byte>> KvDeviceLink::new_token() { return kv_device_pools_usable(Device::cuda(0)); }

Result<std::shared_ptr<KvDeviceLink>> KvDeviceLink::join(std::span<const std::byte>, int, Device device) {
  return kv_device_pools_usable(device);
}

#else

static_assert(sizeof(ncclUniqueId) == kMigrationLinkTokenBytes);

Status kv_device_pools_usable(Device device) {
  const std::string what = fmt::format("kv migrator: the cache's pools are on {}", to_string(device));
  LAMINAR_RETURN_IF_ERROR(cuda_device_usable().with_context(what));
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device.id < 0 || device.id >= count) {
    return failed_precondition(fmt::format("{}: this process sees {} CUDA devices", what, count));
  }
  return ok_status();
}

namespace {

Status cuda_status(const char* call, cudaError_t e) {
  if (e == cudaSuccess) return ok_status();
  return internal_error(fmt::format("kv migrator: {} failed: {} ({})", call, cudaGetErrorName(e),
                                    cudaGetErrorString(e)));
}

// A peer that vanished or a link that broke is kUnavailable; a setup NCCL refuses (two ranks on one
// GPU) is for the caller to change; an argument NCCL refuses is our bug. NCCL's own text of the
// last error (`comm`'s, or the process's) says which.
Status nccl_status(const char* call, ncclResult_t r, ncclComm_t comm = nullptr) {
  if (r == ncclSuccess || r == ncclInProgress) return ok_status();
  const char* last = ncclGetLastError(comm);
  std::string m = fmt::format("kv migrator: {} failed: {}{}{}", call, ncclGetErrorString(r),
                              last != nullptr && *last != 0 ? ": " : "", last != nullptr ? last : "");
  if (r == ncclInvalidArgument) return internal_error(std::move(m));
  if (r == ncclInvalidUsage) return failed_precondition(std::move(m));
  return unavailable(std::move(m));
}

// Page ids in, checksums out: page-locked on the host (the copies are asynchronous), and on the device.
struct Buffers {
  std::size_t capacity = 0;     // pages
  void* host = nullptr;         // int32 ids [capacity], then u64 checksums [capacity]
  void* device = nullptr;       // the same
  cudaEvent_t event = nullptr;  // recorded after the work's last part

  std::int32_t* host_ids() const { return static_cast<std::int32_t*>(host); }
  std::uint64_t* host_sums() const {
    return reinterpret_cast<std::uint64_t*>(static_cast<char*>(host) + 8 * ((4 * capacity + 7) / 8));
  }
  std::int32_t* device_ids() const { return static_cast<std::int32_t*>(device); }
  std::uint64_t* device_sums() const {
    return reinterpret_cast<std::uint64_t*>(static_cast<char*>(device) + 8 * ((4 * capacity + 7) / 8));
  }
  static std::size_t bytes(std::size_t capacity) { return 8 * ((4 * capacity + 7) / 8) + 8 * capacity; }
};

class Work;

// What a link and its works share: the communicator, the stream, spare buffers, and the works not
// yet on the stream (a non-blocking communicator takes the next group only once the last is in).
struct LinkState {
  Device device;
  int rank = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  bool joined = false;
  Status failure;                  // once set, every call returns it
  std::vector<Buffers> spare;
  std::vector<Buffers> retired;    // of works dropped before they finished: freed with the stream
  std::deque<Work*> queued;

  ~LinkState();
  void set_device() const { (void)cudaSetDevice(device.id); }
  void fail(Status why) {
    if (!failure.ok()) return;
    failure = std::move(why);
    if (comm != nullptr) (void)ncclCommAbort(comm);
    comm = nullptr;
  }
  // true when the communicator is idle, false while a non-blocking call of it still runs; its
  // failure otherwise.
  Result<bool> idle() {
    if (!failure.ok()) return failure;
    ncclResult_t async = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &async);
    if (r != ncclSuccess) {
      fail(nccl_status("ncclCommGetAsyncError", r, comm));
      return failure;
    }
    if (async == ncclInProgress) return false;
    if (async != ncclSuccess) {
      fail(nccl_status("the NCCL link", async, comm));
      return failure;
    }
    return true;
  }
  Result<Buffers> acquire(std::size_t pages);
  void give_back(Buffers b, bool finished) { (finished ? spare : retired).push_back(b); }
  // Puts queued works on the stream, in order, as far as the communicator takes them.
  Status pump();
};

class Work final : public KvDeviceWork {
 public:
  Work(std::shared_ptr<LinkState> st, Buffers buf, std::vector<KvDeviceSpan> spans, const KvDevicePools& pools,
       std::size_t pages)
      : st_(std::move(st)), buf_(buf), spans_(std::move(spans)), pools_(pools), pages_(pages) {}
  ~Work() override {
    std::erase(st_->queued, this);
    // A work dropped while its stream may still use the buffers leaves them to the link's end.
    const bool idle = finished_ || !on_stream_ || (st_->failure.ok() && cudaEventQuery(buf_.event) == cudaSuccess);
    st_->give_back(buf_, idle);
  }

  Result<bool> done() override {
    if (finished_) return true;
    st_->set_device();
    LAMINAR_RETURN_IF_ERROR(st_->pump());
    if (!on_stream_) return false;
    const cudaError_t e = cudaEventQuery(buf_.event);
    if (e == cudaErrorNotReady) {
      // A peer that failed shows on the communicator while our stream waits for it.
      if (!spans_.empty()) {
        auto idle = st_->idle();
        if (!idle.ok()) return idle.status();
      }
      return false;
    }
    if (e != cudaSuccess) {
      st_->fail(cuda_status("cudaEventQuery", e));
      return st_->failure;
    }
    sums_.assign(buf_.host_sums(), buf_.host_sums() + pages_);
    finished_ = true;
    return true;
  }
  const std::vector<std::uint64_t>& checksums() const override { return sums_; }

  // Enqueues this work on the stream; false when the communicator is still busy with the last group.
  Result<bool> enqueue() {
    LinkState& s = *st_;
    if (!spans_.empty()) {
      if (!grouped_) {
        auto idle = s.idle();
        if (!idle.ok()) return idle.status();
        if (!*idle) return false;
        Status st = nccl_status("ncclGroupStart", ncclGroupStart());
        for (const KvDeviceSpan& span : spans_) {
          if (!st.ok()) break;
          st = s.rank == 0 ? nccl_status("ncclSend", ncclSend(span.data, span.bytes, ncclUint8, 1, s.comm, s.stream))
                           : nccl_status("ncclRecv", ncclRecv(span.data, span.bytes, ncclUint8, 0, s.comm, s.stream));
        }
        const Status end = nccl_status("ncclGroupEnd", ncclGroupEnd());
        if (!st.ok() || !end.ok()) {
          s.fail(st.ok() ? end : st);
          return s.failure;
        }
        grouped_ = true;
      }
      // The group is on the stream once the communicator is idle again.
      auto idle = s.idle();
      if (!idle.ok()) return idle.status();
      if (!*idle) return false;
    }
    if (pages_ > 0) {
      kernels::cuda_detail::KvChecksumParams p;
      p.k_pool = pools_.k;
      p.v_pool = pools_.v;
      p.num_pages = pools_.num_pages;
      p.page_bytes = pools_.page_bytes;
      p.num_layers = pools_.num_layers;
      p.pages = buf_.device_ids();
      p.count = std::int64_t(pages_);
      p.out = buf_.device_sums();
      Status st = cuda_status("cudaMemcpyAsync (page ids)",
                              cudaMemcpyAsync(buf_.device_ids(), buf_.host_ids(), 4 * pages_, cudaMemcpyHostToDevice,
                                              s.stream));
      if (st.ok()) st = kernels::cuda_detail::launch_kv_page_checksums(p, s.stream);
      if (st.ok()) {
        st = cuda_status("cudaMemcpyAsync (checksums)", cudaMemcpyAsync(buf_.host_sums(), buf_.device_sums(),
                                                                        8 * pages_, cudaMemcpyDeviceToHost, s.stream));
      }
      if (!st.ok()) {
        s.fail(st);
        return s.failure;
      }
    }
    if (Status st = cuda_status("cudaEventRecord", cudaEventRecord(buf_.event, s.stream)); !st.ok()) {
      s.fail(st);
      return s.failure;
    }
    on_stream_ = true;
    return true;
  }

 private:
  std::shared_ptr<LinkState> st_;
  Buffers buf_;
  std::vector<KvDeviceSpan> spans_;
  KvDevicePools pools_;
  std::size_t pages_ = 0;
  bool grouped_ = false;    // the NCCL group was issued (maybe still being enqueued)
  bool on_stream_ = false;  // everything is on the stream, the event last
  bool finished_ = false;
  std::vector<std::uint64_t> sums_;
};

LinkState::~LinkState() {
  set_device();
  if (comm != nullptr) (void)ncclCommAbort(comm);
  if (stream != nullptr) (void)cudaStreamSynchronize(stream);
  for (auto* list : {&spare, &retired}) {
    for (Buffers& b : *list) {
      (void)cudaFreeHost(b.host);
      (void)cudaFree(b.device);
      (void)cudaEventDestroy(b.event);
    }
  }
  if (stream != nullptr) (void)cudaStreamDestroy(stream);
}

Result<Buffers> LinkState::acquire(std::size_t pages) {
  auto it = std::ranges::find_if(spare, [&](const Buffers& b) { return b.capacity >= pages; });
  if (it != spare.end()) {
    Buffers b = *it;
    spare.erase(it);
    return b;
  }
  Buffers b;
  b.capacity = std::max<std::size_t>(64, std::bit_ceil(pages));
  Status st = cuda_status("cudaHostAlloc", cudaHostAlloc(&b.host, Buffers::bytes(b.capacity), cudaHostAllocDefault));
  if (st.ok()) st = cuda_status("cudaMalloc", cudaMalloc(&b.device, Buffers::bytes(b.capacity)));
  if (st.ok()) st = cuda_status("cudaEventCreate", cudaEventCreateWithFlags(&b.event, cudaEventDisableTiming));
  if (!st.ok()) {
    retired.push_back(b);
    return st;
  }
  return b;
}

Status LinkState::pump() {
  while (!queued.empty()) {
    auto in = queued.front()->enqueue();
    if (!in.ok()) return in.status();
    if (!*in) return ok_status();
    queued.pop_front();
  }
  return failure;
}

class Link final : public KvDeviceLink {
 public:
  explicit Link(std::shared_ptr<LinkState> st) : st_(std::move(st)) {}
  ~Link() override {
    st_->set_device();
    st_->fail(cancelled("kv migrator: the link was closed"));
  }

  Result<bool> joined() override {
    if (st_->joined || !st_->failure.ok()) return st_->failure.ok() ? Result<bool>(true) : st_->failure;
    st_->set_device();
    auto idle = st_->idle();
    if (!idle.ok()) return idle.status();
    st_->joined = *idle;
    return st_->joined;
  }

  Result<std::unique_ptr<KvDeviceWork>> post(std::span<const KvDeviceSpan> spans, const KvDevicePools& pools,
                                             std::span<const std::int32_t> pages) override {
    LAMINAR_RETURN_IF_ERROR(st_->failure);
    if (!spans.empty() && !st_->joined) {
      return failed_precondition("kv migrator: transfers posted on a link not joined yet");
    }
    st_->set_device();
    auto buf = st_->acquire(pages.size());
    LAMINAR_RETURN_IF_ERROR(buf.status());
    if (!pages.empty()) std::memcpy(buf->host_ids(), pages.data(), 4 * pages.size());
    auto w = std::make_unique<Work>(st_, *buf, std::vector<KvDeviceSpan>(spans.begin(), spans.end()), pools,
                                    pages.size());
    st_->queued.push_back(w.get());
    LAMINAR_RETURN_IF_ERROR(st_->pump());
    return std::unique_ptr<KvDeviceWork>(std::move(w));
  }

  void abort() override {
    st_->set_device();
    st_->fail(aborted("kv migrator: the link was aborted"));
  }

 private:
  std::shared_ptr<LinkState> st_;
};

}  // namespace

Result<std::vector<std::byte>> KvDeviceLink::new_token() {
  ncclUniqueId id;
  LAMINAR_RETURN_IF_ERROR(nccl_status("ncclGetUniqueId", ncclGetUniqueId(&id)));
  std::vector<std::byte> token(sizeof id);
  std::memcpy(token.data(), &id, sizeof id);
  return token;
}

Result<std::shared_ptr<KvDeviceLink>> KvDeviceLink::join(std::span<const std::byte> token, int rank, Device device) {
  if (token.size() != sizeof(ncclUniqueId) || (rank != 0 && rank != 1)) {
    return invalid_argument(fmt::format("kv migrator: a link token of {} bytes, rank {}", token.size(), rank));
  }
  auto st = std::make_shared<LinkState>();
  st->device = device;
  st->rank = rank;
  st->set_device();
  LAMINAR_RETURN_IF_ERROR(cuda_status("cudaStreamCreate", cudaStreamCreateWithFlags(&st->stream, cudaStreamNonBlocking)));
  ncclUniqueId id;
  std::memcpy(&id, token.data(), sizeof id);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  // Joining waits for the peer: in the background, so the decode loop only polls.
  config.blocking = 0;
  LAMINAR_RETURN_IF_ERROR(nccl_status("ncclCommInitRankConfig", ncclCommInitRankConfig(&st->comm, 2, id, rank, &config)));
  return std::shared_ptr<KvDeviceLink>(std::make_shared<Link>(std::move(st)));
}

#endif

}  // namespace laminar::internal
