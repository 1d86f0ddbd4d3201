// HostBuffer and the device copies of src/host_buffer.h: what they answer on a machine without
// a CUDA device (the GPU tests of the relay tier run the copies on a device).
#include "host_buffer.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstddef>
#include <vector>

#include "cuda_absent.h"
#include "expect_code.h"

using laminar::Stream;
using laminar::StatusCode;
namespace li = laminar::internal;

TEST_CASE("host buffer: zeroed host memory, pinned only where a device takes it", "[host_buffer]") {
  auto b = li::HostBuffer::allocate(3 * 4096 + 5, /*pin=*/true, /*shareable=*/false);
  REQUIRE(b.ok());
  CHECK(b->size() == 3 * 4096 + 5);
  CHECK(std::all_of(b->data(), b->data() + b->size(), [](std::byte x) { return x == std::byte{0}; }));
  CHECK(b->fd() == -1);
  CHECK(b->pinned() == li::cuda_device_usable().ok());
  laminar::testing::expect_code(li::HostBuffer::allocate(0, true, false).status(), StatusCode::kInvalidArgument,
                                "0 bytes");
}

TEST_CASE("host buffer: without a device every CUDA entry answers kFailedPrecondition (kUnimplemented without CUDA)",
          "[host_buffer][cuda]") {
  const auto code = laminar::testing::code_without_device();
  if (!code) return;  // a device is present: the relay tier's GPU tests copy to and from it
  const char* why = *code == StatusCode::kUnimplemented ? "built without CUDA" : "no usable CUDA device";
  laminar::testing::expect_code(li::cuda_device_usable(), *code, why);
  std::vector<std::byte> host(4096, std::byte{7}), other(4096);
  laminar::testing::expect_code(li::copy_device_to_host(other.data(), host.data(), host.size(), Stream::cuda(nullptr),
                                                        1024),
                                *code, why);
  laminar::testing::expect_code(li::copy_host_to_device(other.data(), host.data(), host.size(), false,
                                                        Stream::cuda(nullptr), 1024),
                                *code, why);
  CHECK(std::all_of(other.begin(), other.end(), [](std::byte x) { return x == std::byte{0}; }));
}
