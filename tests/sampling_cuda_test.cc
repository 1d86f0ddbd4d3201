// Runs the sampling and token-log-prob kernels on a real GPU and compares them with the host path
// bit for bit; exits with the skip code when there is no CUDA device.
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <random>
#include <vector>

#include "laminar/kernels/sampling.h"

namespace {

// Copies host vectors to the device and frees them at scope exit.
struct DeviceBuffers {
  std::vector<void*> ptrs;
  template <class T>
  T* copy(const std::vector<T>& v) {
    void* d = nullptr;
    REQUIRE(cudaMalloc(&d, v.size() * sizeof(T) + 1) == cudaSuccess);
    REQUIRE(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
    ptrs.push_back(d);
    return static_cast<T*>(d);
  }
  ~DeviceBuffers() {
    for (void* p : ptrs) cudaFree(p);
  }
};

template <class T>
std::vector<T> back(const T* d, std::size_t n) {
  std::vector<T> h(n);
  REQUIRE(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
  return h;
}

}  // namespace

TEST_CASE("CUDA sampling equals the host kernel bit for bit", "[sampling][gpu]") {
  std::mt19937 rng(99);
  for (std::int64_t vocab : {1, 1000, 152064}) {
    const std::int64_t batch = 24;
    std::normal_distribution<float> nd(0.0f, vocab == 1000 ? 1.0f : 3.0f);
    std::vector<float> logits(std::size_t(batch * vocab));
    for (auto& x : logits) x = nd(rng);
    std::vector<float> temp(batch), top_p(batch), min_p(batch);
    std::vector<std::int32_t> top_k(batch);
    std::vector<std::uint64_t> seed(batch);
    std::vector<std::int64_t> pos(batch);
    for (std::int64_t r = 0; r < batch; ++r) {
      temp[r] = r % 5 == 0 ? 0.0f : 0.5f + 0.1f * float(r % 7);
      top_k[r] = r % 2 ? 50 : 0;
      top_p[r] = r % 3 ? 0.9f : 1.0f;
      min_p[r] = r % 4 == 1 ? 0.05f : 0.0f;
      seed[r] = rng();
      pos[r] = r * 13;
    }
    std::vector<std::int32_t> tok(batch);
    std::vector<float> raw(batch), proc(batch), kept(batch);
    laminar::kernels::SamplingParams p;
    p.logits = logits.data();
    p.batch = batch;
    p.vocab = vocab;
    p.temperature = temp.data();
    p.top_k = top_k.data();
    p.top_p = top_p.data();
    p.min_p = min_p.data();
    p.seed = seed.data();
    p.position = pos.data();
    p.token = tok.data();
    p.raw_logprob = raw.data();
    p.processed_logprob = proc.data();
    p.kept_mass = kept.data();
    REQUIRE(laminar::kernels::run(p, laminar::Stream::host()).ok());
    DeviceBuffers d;
    laminar::kernels::SamplingParams q = p;
    q.logits = d.copy(logits);
    q.temperature = d.copy(temp);
    q.top_k = d.copy(top_k);
    q.top_p = d.copy(top_p);
    q.min_p = d.copy(min_p);
    q.seed = d.copy(seed);
    q.position = d.copy(pos);
    q.token = d.copy(tok);
    q.raw_logprob = d.copy(raw);
    q.processed_logprob = d.copy(proc);
    q.kept_mass = d.copy(kept);
    REQUIRE(laminar::kernels::run(q, laminar::Stream::cuda(nullptr)).ok());
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    INFO("vocab " << vocab);
    CHECK(back(q.token, batch) == tok);
    CHECK(std::memcmp(back(q.raw_logprob, batch).data(), raw.data(), batch * 4) == 0);
    CHECK(std::memcmp(back(q.processed_logprob, batch).data(), proc.data(), batch * 4) == 0);
    CHECK(std::memcmp(back(q.kept_mass, batch).data(), kept.data(), batch * 4) == 0);

    std::vector<float> lp(batch);
    laminar::kernels::TokenLogprobParams t{logits.data(), laminar::DType::kF32, batch, vocab, 0, tok.data(), lp.data(), 0};
    REQUIRE(laminar::kernels::run(t, laminar::Stream::host()).ok());
    laminar::kernels::TokenLogprobParams u = t;
    u.logits = q.logits;
    u.token = q.token;
    u.logprob = d.copy(lp);
    REQUIRE(laminar::kernels::run(u, laminar::Stream::cuda(nullptr)).ok());
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(std::memcmp(back(u.logprob, batch).data(), lp.data(), batch * 4) == 0);
  }
}

TEST_CASE("CUDA sampling from device tensors equals the host kernel bit for bit", "[sampling][gpu][tensors]") {
  std::mt19937 rng(7);
  const std::int64_t batch = 8, vocab = 5000;
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> logits(std::size_t(batch * vocab));
  for (auto& x : logits) x = nd(rng);
  std::vector<float> temp(batch, 0.8f);
  std::vector<std::int64_t> seed(batch), pos(batch);
  for (std::int64_t r = 0; r < batch; ++r) {
    seed[std::size_t(r)] = std::int64_t(rng()) << 20;
    pos[std::size_t(r)] = r * 7;
  }
  std::vector<std::int32_t> tok(batch);
  std::vector<float> raw(batch);
  laminar::kernels::SamplingParams p;
  p.logits = logits.data();
  p.batch = batch;
  p.vocab = vocab;
  p.temperature = temp.data();
  p.seed = reinterpret_cast<const std::uint64_t*>(seed.data());
  p.position = pos.data();
  p.token = tok.data();
  p.raw_logprob = raw.data();
  REQUIRE(laminar::kernels::run(p, laminar::Stream::host()).ok());

  int device = 0;
  REQUIRE(cudaGetDevice(&device) == cudaSuccess);
  const auto gpu = laminar::Device::cuda(device);
  DeviceBuffers d;
  const auto view = [&](void* data, laminar::DType t, std::vector<std::int64_t> shape) {
    return laminar::TensorView::contiguous(data, t, shape, gpu).value();
  };
  laminar::kernels::SamplingTensors t;
  t.logits = view(d.copy(logits), laminar::DType::kF32, {batch, vocab});
  t.temperature = view(d.copy(temp), laminar::DType::kF32, {batch});
  t.seed = view(d.copy(seed), laminar::DType::kI64, {batch});
  t.position = view(d.copy(pos), laminar::DType::kI64, {batch});
  t.token = view(d.copy(std::vector<std::int32_t>(batch)), laminar::DType::kI32, {batch});
  t.raw_logprob = view(d.copy(std::vector<float>(batch)), laminar::DType::kF32, {batch});
  auto q = laminar::kernels::SamplingParams::from_tensors(t);
  REQUIRE(q.ok());
  REQUIRE(laminar::kernels::run(*q, laminar::Stream::cuda(nullptr)).ok());
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(back(q->token, batch) == tok);
  CHECK(std::memcmp(back(q->raw_logprob, batch).data(), raw.data(), batch * 4) == 0);
}
