// Launcher of the KV page checksum kernel (kv_page_checksum.cuh), for device-pool KV migration.
#include "kv_page_checksum.cuh"
#include "launch_status.h"

namespace laminar::kernels::cuda_detail {

Status launch_kv_page_checksums(const KvChecksumParams& p, void* stream) {
  if (p.count == 0) return ok_status();
  // Pages beyond the grid are taken by the blocks' grid-stride loop.
  const unsigned blocks = unsigned(p.count < 65535 ? p.count : 65535);
  kv_page_checksum_kernel<<<blocks, kChecksumThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return launch_status("kv_page_checksum", cudaGetLastError());
}

}  // namespace laminar::kernels::cuda_detail
