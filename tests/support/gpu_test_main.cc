// main() of every GPU test (laminar_add_gpu_test): exits with the skip code when there is no CUDA
// device, so CTest shows the test as skipped rather than passed.
#define CATCH_CONFIG_RUNNER
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cstdio>

int main(int argc, char** argv) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("no CUDA device: skipping\n");
    return LAMINAR_SKIP_CODE;
  }
  return Catch::Session().run(argc, argv);
}
