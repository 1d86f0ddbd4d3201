// host_buffer.h (internal): page-aligned host memory for relay versions, page-locked through CUDA
// when a device is present (so device copies from it run at full speed), plus the host<->device
// copies the relay tier needs. Not part of the public API.
//
//   auto buf = laminar::internal::HostBuffer::allocate(1 << 20, /*pin=*/true, /*shareable=*/false);
//   std::memcpy(buf->data(), src, 1 << 20);
//   bool fast = buf->pinned();  // false on a machine without CUDA
#pragma once

#include <cstddef>
#include <cstdint>

#include "laminar/status.h"
#include "laminar/types.h"

namespace laminar::internal {

class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  HostBuffer(HostBuffer&& o) noexcept;
  HostBuffer& operator=(HostBuffer&& o) noexcept;
  ~HostBuffer();

  // Maps `bytes` of zeroed, pre-faulted memory; with shareable, backed by a sealed memfd (fd()) that
  // other processes may map read-only, otherwise anonymous (where huge pages are more often granted) (so the first publish into it does not pay page
  // faults on the actor's time). With pin, registers it with CUDA when a device is present; pinned()
  // says whether that happened. kInvalidArgument for 0 bytes, kResourceExhausted when the mapping
  // fails.
  static Result<HostBuffer> allocate(std::size_t bytes, bool pin, bool shareable);

  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  bool pinned() const noexcept { return pinned_; }
  // The memfd behind data() (fixed size, writable only through data()), or -1 when not shareable.
  int fd() const noexcept { return fd_; }

 private:
  void reset() noexcept;

  std::byte* data_ = nullptr;  // [size_]
  std::size_t size_ = 0;
  bool pinned_ = false;
  int fd_ = -1;
};

// Whether a CUDA device can be used by this process: kUnimplemented in a build without CUDA,
// kFailedPrecondition (naming the CUDA error) when the runtime finds no device: not retryable.
Status cuda_device_usable();

// Copies n bytes from device memory to host memory (dst [n] on the host, src [n] on device) in
// chunk-sized cudaMemcpyAsync calls on `stream`, and waits for them. Errors as cuda_device_usable,
// or kInternal naming the failing CUDA call.
Status copy_device_to_host(void* dst, const void* src, std::size_t n, Stream stream,
                           std::size_t chunk_bytes);

// Copies n bytes from host memory to device memory (dst [n] on device, src [n] on the host). With a
// page-locked source the chunks go straight out with cudaMemcpyAsync; otherwise each chunk is first
// staged into one of two page-locked bounce buffers, so filling one overlaps the device copy of the
// other (double buffering). Waits for the copies before returning.
Status copy_host_to_device(void* dst, const void* src, std::size_t n, bool src_pinned, Stream stream,
                           std::size_t chunk_bytes);

}  // namespace laminar::internal
