// Kernels on tensors given through DLPack: the cast between f32, f16 and bf16.
#include "bindings.h"
#include "laminar/kernels/cast.h"

namespace laminar::python {

void bind_kernels(py::module_& m) {
  m.def(
      "cast",
      [](py::handle src, py::handle dst) {
        DlpackTensor s = DlpackTensor::borrow(src, "src");
        DlpackTensor d = DlpackTensor::borrow(dst, "dst");
        kernels::CastParams p = unwrap(kernels::CastParams::from_tensors(s.view(), d.view()));
        Stream stream = s.view().device().is_host() ? Stream::host() : Stream::cuda(nullptr);
        Status st;
        {
          py::gil_scoped_release unlocked;
          st = kernels::run(p, stream);
        }
        check(st);
      },
      py::arg("src"), py::arg("dst"), R"doc(
Converts src into dst, element by element, between float32, float16 and bfloat16 (round to nearest
even, NaN kept; the same bits on the CPU and CUDA). Both are tensors given through DLPack (torch
tensors, NumPy arrays) of the same shape, dense, on the host or one CUDA device; dst is written in
place, nothing is copied on the way in. On CUDA the cast is enqueued on the legacy default stream.
InvalidArgumentError names the tensor and what is wrong (dtype, shape, strides, overlap);
UnimplementedError for CUDA tensors in a build without CUDA.)doc");
}

}  // namespace laminar::python
