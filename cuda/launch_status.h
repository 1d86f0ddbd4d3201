// launch_status.h: the Status of a kernel launch (nvcc translation units only).
//
// The code says what the caller does next: no device or driver, or a build without code for this
// device, cannot be fixed by retrying, so kFailedPrecondition; no memory is kResourceExhausted;
// anything else from a launch laminar configured is a bug of ours, kInternal.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "laminar/status.h"

namespace laminar::kernels::cuda_detail {

inline Status launch_status(const char* kernel, cudaError_t err) {
  if (err == cudaSuccess) return ok_status();
  std::string m = std::string(kernel) + " kernel launch failed: " + cudaGetErrorName(err) + " (" +
                  cudaGetErrorString(err) + ")";
  switch (err) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorStubLibrary:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorInitializationError:
      return failed_precondition(std::move(m));
    case cudaErrorMemoryAllocation:
      return resource_exhausted(std::move(m));
    default:
      return internal_error(std::move(m));
  }
}

}  // namespace laminar::kernels::cuda_detail
