// Engine's device path in a build without CUDA: create() refuses kCuda with kUnimplemented, so no
// engine reaches the other calls, which say the same.
#include <string>

#include "engine.h"

namespace async_grpo {
namespace {

laminar::Status not_built() {
  return laminar::unimplemented(
      "device kCuda: this build has no CUDA (configure with -DLAMINAR_CUDA=ON on a machine with nvcc)");
}

}  // namespace

struct Engine::Cuda {};

void Engine::CudaDeleter::operator()(Cuda* cuda) const noexcept { delete cuda; }

laminar::Result<std::unique_ptr<Engine::Cuda, Engine::CudaDeleter>> Engine::create_cuda(std::int32_t,
                                                                                          std::size_t) {
  return not_built();
}

laminar::Status Engine::upload_weights() { return not_built(); }

laminar::Status Engine::forward_cuda(laminar::PagedKvCache&, const Pass&, const LogitsUse&) const {
  return not_built();
}

laminar::Result<std::shared_ptr<laminar::PagedKvCache>> Engine::make_device_cache(const laminar::KvLayout&) const {
  return not_built();
}

}  // namespace async_grpo
