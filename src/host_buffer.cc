#include "host_buffer.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#if defined(LAMINAR_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace laminar::internal {

HostBuffer::HostBuffer(HostBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      pinned_(std::exchange(o.pinned_, false)),
      fd_(std::exchange(o.fd_, -1)) {}

HostBuffer& HostBuffer::operator=(HostBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    pinned_ = std::exchange(o.pinned_, false);
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

HostBuffer::~HostBuffer() { reset(); }

void HostBuffer::reset() noexcept {
  if (data_ == nullptr) return;
#if defined(LAMINAR_HAVE_CUDA)
  if (pinned_) cudaHostUnregister(data_);
#endif
  munmap(data_, size_);
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  data_ = nullptr;
  size_ = 0;
  pinned_ = false;
}

namespace {

// Maps `bytes` of a fresh memfd read-write and seals it; the descriptor goes to *fd.
Result<void*> map_memfd(std::size_t bytes, int* fd_out) {
  const int fd = memfd_create("laminar-relay-version", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return resource_exhausted(fmt::format("host buffer: memfd_create failed: {}", std::strerror(errno)));
  if (ftruncate(fd, off_t(bytes)) != 0) {
    const int err = errno;
    close(fd);
    return resource_exhausted(fmt::format("host buffer: sizing a memfd to {} bytes failed: {}", bytes,
                                          std::strerror(err)));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return resource_exhausted(fmt::format("host buffer: mapping {} bytes failed: {}", bytes, std::strerror(err)));
  }
  // The size can never change (a reader's mapping cannot fault past the end: no SIGBUS) and nobody
  // else can write: later writable mappings and write() through any copy of the descriptor are
  // refused; only this mapping, made before the seal, writes.
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) != 0) {
    const int err = errno;
    munmap(p, bytes);
    close(fd);
    return resource_exhausted(fmt::format("host buffer: sealing a memfd failed: {}", std::strerror(err)));
  }
  *fd_out = fd;
  return p;
}

}  // namespace

Result<HostBuffer> HostBuffer::allocate(std::size_t bytes, bool pin, bool shareable) {
  if (bytes == 0) return invalid_argument("host buffer: 0 bytes requested");
  void* p = nullptr;
  int fd = -1;
  if (shareable) {
    auto m = map_memfd(bytes, &fd);
    LAMINAR_RETURN_IF_ERROR(m.status());
    p = *m;
  } else {
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return resource_exhausted(fmt::format("host buffer: mapping {} bytes failed: {}", bytes, std::strerror(errno)));
    }
  }
  // Weight buffers are large and read front to back: huge pages cut TLB misses on every copy (and
  // page pinning in UCX's shared-memory copies). Only a hint; the kernel may say no (for a memfd it
  // does unless shmem huge pages are enabled).
  (void)madvise(p, bytes, MADV_HUGEPAGE);
  // Fault every page in now, at allocation, not during the first publish into it.
  for (std::size_t off = 0; off < bytes; off += 4096) static_cast<volatile char*>(p)[off] = 0;
  HostBuffer b;
  b.data_ = static_cast<std::byte*>(p);
  b.size_ = bytes;
  b.fd_ = fd;
#if defined(LAMINAR_HAVE_CUDA)
  if (pin && cuda_device_usable().ok()) {
    b.pinned_ = cudaHostRegister(p, bytes, cudaHostRegisterDefault) == cudaSuccess;
  }
#else
  (void)pin;
#endif
  return b;
}

#if defined(LAMINAR_HAVE_CUDA)

namespace {

Status cuda_error(const char* call, cudaError_t e) {
  return internal_error(fmt::format("{} failed: {} ({})", call, cudaGetErrorName(e), cudaGetErrorString(e)));
}

// Two page-locked bounce buffers and the events that say when the device is done reading each.
struct Bounce {
  void* buf[2] = {nullptr, nullptr};   // [chunk_bytes] each
  cudaEvent_t done[2] = {nullptr, nullptr};
  ~Bounce() {
    for (int i = 0; i < 2; ++i) {
      if (buf[i] != nullptr) cudaFreeHost(buf[i]);
      if (done[i] != nullptr) cudaEventDestroy(done[i]);
    }
  }
};

}  // namespace

Status cuda_device_usable() {
  static const Status cached = [] {
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
      return failed_precondition(fmt::format("no usable CUDA device: cudaGetDeviceCount returned {} ({})",
                                             cudaGetErrorName(e), cudaGetErrorString(e)));
    }
    if (count == 0) return failed_precondition("no usable CUDA device: cudaGetDeviceCount found 0 devices");
    return ok_status();
  }();
  return cached;
}

Status copy_device_to_host(void* dst, const void* src, std::size_t n, Stream stream, std::size_t chunk_bytes) {
  LAMINAR_RETURN_IF_ERROR(cuda_device_usable());
  auto s = static_cast<cudaStream_t>(stream.handle);
  for (std::size_t off = 0; off < n; off += chunk_bytes) {
    const std::size_t len = std::min(chunk_bytes, n - off);
    const cudaError_t e = cudaMemcpyAsync(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off,
                                          len, cudaMemcpyDeviceToHost, s);
    if (e != cudaSuccess) return cuda_error("cudaMemcpyAsync (device to host)", e);
  }
  const cudaError_t e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) return cuda_error("cudaStreamSynchronize", e);
  return ok_status();
}

Status copy_host_to_device(void* dst, const void* src, std::size_t n, bool src_pinned, Stream stream,
                           std::size_t chunk_bytes) {
  LAMINAR_RETURN_IF_ERROR(cuda_device_usable());
  auto s = static_cast<cudaStream_t>(stream.handle);
  auto* d = static_cast<char*>(dst);
  const auto* h = static_cast<const char*>(src);
  if (src_pinned) {
    for (std::size_t off = 0; off < n; off += chunk_bytes) {
      const cudaError_t e = cudaMemcpyAsync(d + off, h + off, std::min(chunk_bytes, n - off),
                                            cudaMemcpyHostToDevice, s);
      if (e != cudaSuccess) return cuda_error("cudaMemcpyAsync (host to device)", e);
    }
  } else {
    Bounce b;
    for (int i = 0; i < 2; ++i) {
      cudaError_t e = cudaHostAlloc(&b.buf[i], chunk_bytes, cudaHostAllocDefault);
      if (e != cudaSuccess) return cuda_error("cudaHostAlloc (bounce buffer)", e);
      e = cudaEventCreateWithFlags(&b.done[i], cudaEventDisableTiming);
      if (e != cudaSuccess) return cuda_error("cudaEventCreateWithFlags", e);
    }
    std::size_t k = 0;
    for (std::size_t off = 0; off < n; off += chunk_bytes, ++k) {
      const std::size_t len = std::min(chunk_bytes, n - off);
      const std::size_t slot = k % 2;
      // The device may still be reading this bounce buffer from two chunks ago.
      if (k >= 2) {
        const cudaError_t e = cudaEventSynchronize(b.done[slot]);
        if (e != cudaSuccess) return cuda_error("cudaEventSynchronize", e);
      }
      std::memcpy(b.buf[slot], h + off, len);
      cudaError_t e = cudaMemcpyAsync(d + off, b.buf[slot], len, cudaMemcpyHostToDevice, s);
      if (e != cudaSuccess) return cuda_error("cudaMemcpyAsync (host to device)", e);
      e = cudaEventRecord(b.done[slot], s);
      if (e != cudaSuccess) return cuda_error("cudaEventRecord", e);
    }
  }
  const cudaError_t e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) return cuda_error("cudaStreamSynchronize", e);
  return ok_status();
}

#else

Status cuda_device_usable() {
  return unimplemented("device copies: laminar was built without CUDA (LAMINAR_CUDA=OFF)");
}

Status copy_device_to_host(void*, const void*, std::size_t, Stream, std::size_t) { return cuda_device_usable(); }

Status copy_host_to_device(void*, const void*, std::size_t, bool, Stream, std::size_t) {
  return cuda_device_usable();
}

#endif

}  // namespace laminar::internal
