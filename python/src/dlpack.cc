// DlpackTensor: tensors borrowed from Python through the DLPack protocol.
#include <dlpack/dlpack.h>

#include <string>

#include "bindings.h"

namespace laminar::python {

DlpackTensor DlpackTensor::borrow(py::handle obj, std::string_view what, std::uintptr_t cuda_stream) {
  std::string type = py::str(py::type::of(obj).attr("__name__"));
  if (!py::hasattr(obj, "__dlpack__") || !py::hasattr(obj, "__dlpack_device__")) {
    throw_invalid(std::string(what) + " must be a tensor with __dlpack__ (a torch tensor or NumPy array), got " +
                  type);
  }
  DlpackTensor t;
  try {
    auto device = obj.attr("__dlpack_device__")().cast<std::pair<int, int>>();
    // The protocol's stream is the cudaStream_t as an int, except that the legacy default stream is
    // 1 (0 is not allowed); host tensors take None.
    py::object stream = device.first == kDLCUDA ? py::object(py::int_(cuda_stream == 0 ? 1 : cuda_stream))
                                                : py::object(py::none());
    t.capsule_ = py::reinterpret_borrow<py::capsule>(obj.attr("__dlpack__")(py::arg("stream") = stream));
  } catch (py::error_already_set& e) {
    throw_invalid(std::string(what) + ": this " + type + " cannot be exported through DLPack (" + describe_error(e) + ")");
  }
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(t.capsule_.ptr(), "dltensor"));
  if (!managed) {
    PyErr_Clear();
    throw_invalid(std::string(what) + ": __dlpack__ of this " + type + " returned no unconsumed \"dltensor\" capsule");
  }
  Result<TensorView> view = TensorView::from_dlpack(managed->dl_tensor);
  if (!view.ok()) throw StatusError(view.status().with_context(what));
  t.view_ = *view;
  return t;
}

}  // namespace laminar::python
