// cuda_absent.h: what a call that needs a CUDA device answers on a machine that has none, for the
// tests that run on every machine. A build without CUDA answers kUnimplemented (not compiled in); a
// CUDA build where the runtime finds no device or no driver answers kFailedPrecondition, since
// retrying cannot help (never kUnavailable, which tells the caller to retry).
//
//   auto code = laminar::testing::code_without_device();
//   if (!code) return;  // a device is present: the GPU tests cover this machine
//   CHECK(laminar::kernels::run(p, laminar::Stream::cuda(nullptr)).code() == *code);
#pragma once

#include <optional>

#include "host_buffer.h"
#include "laminar/status.h"

// Set by laminar_add_test (tests/CMakeLists.txt) from the build's LAMINAR_WITH_CUDA.
#if !defined(LAMINAR_TEST_WITH_CUDA)
#error "LAMINAR_TEST_WITH_CUDA is not defined: build this test with laminar_add_test"
#endif

namespace laminar::testing {

// The code every CUDA entry point must answer here, or nullopt where a device is usable.
inline std::optional<StatusCode> code_without_device() {
#if LAMINAR_TEST_WITH_CUDA
  if (internal::cuda_device_usable().ok()) return std::nullopt;
  return StatusCode::kFailedPrecondition;
#else
  return StatusCode::kUnimplemented;
#endif
}

}  // namespace laminar::testing
