// The relay tier's device path on a real GPU: publish from device memory, pull into device memory
// (double-buffered through bounce buffers when the relay's memory is not page-locked), every byte
// compared. Exits with the skip code when there is no CUDA device.
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <vector>

#include "laminar/weight_puller.h"
#include "relay_test_util.h"

namespace {

// Device copies of a weight set's tensors, freed on scope exit.
struct DeviceTensors {
  std::vector<void*> ptrs;
  std::vector<laminar::NamedTensor> named;
  explicit DeviceTensors(const laminar::testing::WeightSet& w) {
    for (std::size_t i = 0; i < w.manifest.size(); ++i) {
      const auto& e = w.manifest.entries()[i];
      void* p = nullptr;
      REQUIRE(cudaMalloc(&p, e.nbytes) == cudaSuccess);
      REQUIRE(cudaMemset(p, 0, e.nbytes) == cudaSuccess);
      ptrs.push_back(p);
      named.push_back({e.name, laminar::TensorView::contiguous(p, e.dtype, e.shape, laminar::Device::cuda(0)).value()});
    }
  }
  ~DeviceTensors() {
    for (void* p : ptrs) cudaFree(p);
  }
};

}  // namespace

TEST_CASE("publish from device memory and pull into device memory", "[weight_puller][gpu]") {
  for (bool pin : {true, false}) {
    laminar::RelayStoreOptions o;
    o.chunk_bytes = 1 << 16;
    o.pin_memory = pin;
    std::shared_ptr<laminar::RelayStore> relay = laminar::RelayStore::create(o).value();
    auto src = laminar::testing::WeightSet::make(11, 1, 64);
    DeviceTensors dsrc(src);
    for (std::size_t i = 0; i < src.storage.size(); ++i) {
      REQUIRE(cudaMemcpy(dsrc.ptrs[i], src.storage[i].data(), src.storage[i].size(), cudaMemcpyHostToDevice) ==
              cudaSuccess);
    }
    REQUIRE(relay->publish(laminar::Version(1), src.manifest, dsrc.named).ok());
    REQUIRE(relay->wait_for_version(laminar::Version(1), std::chrono::seconds(10)).ok());
    CHECK(relay->stats().pinned == pin);

    laminar::WeightPullerOptions po;
    po.copy_chunk_bytes = 1 << 16;
    auto puller = laminar::WeightPuller::create(relay, po).value();
    DeviceTensors ddst(src);
    REQUIRE(puller->pull(laminar::Version(1), ddst.named, false).ok());
    for (std::size_t i = 0; i < src.storage.size(); ++i) {
      std::vector<std::byte> back(src.storage[i].size());
      REQUIRE(cudaMemcpy(back.data(), ddst.ptrs[i], back.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
      CHECK(laminar::testing::first_mismatch(back, 11, 1, i) == -1);
    }
  }
}
