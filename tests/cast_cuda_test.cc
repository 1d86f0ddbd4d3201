// Runs the cast kernel on a real GPU and compares it with the host path; exits with the skip code
// when there is no CUDA device.
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <random>
#include <vector>

#include "laminar/kernels/cast.h"

TEST_CASE("CUDA cast equals the host cast bit for bit", "[cast][gpu]") {
  using laminar::DType;
  const std::int64_t n = (1 << 20) + 17;
  std::mt19937 rng(7);
  std::vector<std::uint32_t> src(n);
  for (auto& x : src) x = rng();
  const DType outs[] = {DType::kF16, DType::kBF16};
  for (DType dst_t : outs) {
    std::vector<std::uint16_t> host(n), dev_out(n);
    laminar::kernels::CastParams p{src.data(), host.data(), n, DType::kF32, dst_t};
    REQUIRE(laminar::kernels::run(p, laminar::Stream::host()).ok());
    void *d_src = nullptr, *d_dst = nullptr;
    REQUIRE(cudaMalloc(&d_src, n * 4) == cudaSuccess);
    REQUIRE(cudaMalloc(&d_dst, n * 2) == cudaSuccess);
    REQUIRE(cudaMemcpy(d_src, src.data(), n * 4, cudaMemcpyHostToDevice) == cudaSuccess);
    laminar::kernels::CastParams d{d_src, d_dst, n, DType::kF32, dst_t};
    REQUIRE(laminar::kernels::run(d, laminar::Stream::cuda(nullptr)).ok());
    REQUIRE(cudaMemcpy(dev_out.data(), d_dst, n * 2, cudaMemcpyDeviceToHost) == cudaSuccess);
    cudaFree(d_src);
    cudaFree(d_dst);
    CHECK(std::memcmp(host.data(), dev_out.data(), n * 2) == 0);
  }
}
