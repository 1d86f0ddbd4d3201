// Runs paged decode and prefill on a real GPU and compares them with the CPU kernel bit for bit;
// exits with the skip code when there is no CUDA device.
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "laminar/internal/numerics.h"
#include "laminar/kernels/paged_decode.h"

namespace {

// A device copy of a host vector, freed on scope exit.
struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(std::size_t bytes, const void* src = nullptr) {
    REQUIRE(cudaMalloc(&ptr, bytes == 0 ? 1 : bytes) == cudaSuccess);
    if (src != nullptr && bytes > 0) REQUIRE(cudaMemcpy(ptr, src, bytes, cudaMemcpyHostToDevice) == cudaSuccess);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr); }
};

void check_gpu_equals_cpu(laminar::DType dtype, int head_dim, int kv_heads, int group, int page,
                          const std::vector<std::int32_t>& lengths, const std::vector<std::int32_t>& queries,
                          std::uint64_t seed) {
  namespace li = laminar::internal;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const std::size_t elem = laminar::dtype_size(dtype);
  auto put = [&](std::vector<std::uint8_t>& buf, std::size_t i, float x) {
    if (elem == 4) {
      std::memcpy(buf.data() + 4 * i, &x, 4);
    } else {
      const std::uint16_t h = dtype == laminar::DType::kF16 ? li::f32_to_f16(x) : li::f32_to_bf16(x);
      std::memcpy(buf.data() + 2 * i, &h, 2);
    }
  };
  std::vector<std::int32_t> indptr{0}, indices, last, qo_indptr{0};
  for (int len : lengths) {
    const int pages = (len + page - 1) / page;
    for (int i = 0; i < pages; ++i) indices.push_back(std::int32_t(indices.size()));
    indptr.push_back(std::int32_t(indices.size()));
    last.push_back(len == 0 ? 0 : len - (pages - 1) * page);
  }
  std::shuffle(indices.begin(), indices.end(), rng);
  const int num_pages = std::max<int>(1, int(indices.size()));
  for (int n : queries) qo_indptr.push_back(qo_indptr.back() + n);
  const bool prefill = !queries.empty();
  const int rows = prefill ? qo_indptr.back() : int(lengths.size());
  const std::size_t pool = std::size_t(num_pages) * page * kv_heads * head_dim;
  const std::size_t qn = std::size_t(rows) * kv_heads * group * head_dim;
  std::vector<std::uint8_t> k(pool * elem), v(pool * elem), q(qn * elem), out_cpu(qn * elem), out_gpu(qn * elem);
  for (std::size_t i = 0; i < pool; ++i) put(k, i, normal(rng)), put(v, i, normal(rng));
  for (std::size_t i = 0; i < qn; ++i) put(q, i, normal(rng));
  std::vector<float> lse_cpu(std::size_t(rows) * kv_heads * group), lse_gpu(lse_cpu.size());

  laminar::kernels::PagedDecodeParams p;
  p.q = q.data();
  p.out = out_cpu.data();
  p.lse = lse_cpu.data();
  p.kv = {k.data(), v.data(), {num_pages, page, kv_heads, head_dim, dtype}};
  p.table = {indptr.data(), indices.data(), last.data(), std::int32_t(lengths.size())};
  p.qo_indptr = prefill ? qo_indptr.data() : nullptr;
  p.num_rows = rows;
  p.num_qo_heads = kv_heads * group;
  p.sm_scale = 1.0f / std::sqrt(float(head_dim));
  p.max_kv_len = *std::max_element(lengths.begin(), lengths.end());
  REQUIRE(laminar::kernels::run(p, laminar::Stream::host()).ok());

  DeviceBuffer dk(k.size(), k.data()), dv(v.size(), v.data()), dq(q.size(), q.data()), dout(out_gpu.size());
  DeviceBuffer dlse(lse_gpu.size() * 4), dindptr(indptr.size() * 4, indptr.data()),
      dindices(indices.size() * 4, indices.data()), dlast(last.size() * 4, last.data()),
      dqo(qo_indptr.size() * 4, qo_indptr.data());
  laminar::kernels::PagedDecodeParams d = p;
  d.q = dq.ptr;
  d.out = dout.ptr;
  d.lse = static_cast<float*>(dlse.ptr);
  d.kv.k_pages = dk.ptr;
  d.kv.v_pages = dv.ptr;
  d.table = {static_cast<std::int32_t*>(dindptr.ptr), static_cast<std::int32_t*>(dindices.ptr),
             static_cast<std::int32_t*>(dlast.ptr), p.table.batch};
  d.qo_indptr = prefill ? static_cast<std::int32_t*>(dqo.ptr) : nullptr;
  d.workspace_bytes = laminar::kernels::workspace_bytes(d);
  DeviceBuffer ws(d.workspace_bytes);
  d.workspace = ws.ptr;
  const laminar::Status st = laminar::kernels::run(d, laminar::Stream::cuda(nullptr));
  INFO(st.to_string());
  REQUIRE(st.ok());
  REQUIRE(cudaMemcpy(out_gpu.data(), dout.ptr, out_gpu.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaMemcpy(lse_gpu.data(), dlse.ptr, lse_gpu.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(out_gpu == out_cpu);
  CHECK(std::memcmp(lse_gpu.data(), lse_cpu.data(), lse_cpu.size() * 4) == 0);
}

}  // namespace

TEST_CASE("GPU paged decode equals the CPU kernel bit for bit", "[paged_decode][gpu]") {
  check_gpu_equals_cpu(laminar::DType::kBF16, 128, 8, 4, 16, {1, 255, 256, 257, 0, 4000}, {}, 1);
  check_gpu_equals_cpu(laminar::DType::kF16, 64, 2, 8, 1, {700, 33}, {}, 2);
  check_gpu_equals_cpu(laminar::DType::kF32, 128, 1, 1, 64, {32768}, {}, 3);
  check_gpu_equals_cpu(laminar::DType::kF32, 64, 4, 2, 16, {1000, 5}, {}, 4);
}

TEST_CASE("GPU causal prefill equals the CPU kernel bit for bit", "[paged_decode][gpu]") {
  check_gpu_equals_cpu(laminar::DType::kBF16, 128, 2, 4, 16, {600, 40}, {600, 3}, 5);
}
