// DlpackTensor and DlpackExport: tensors borrowed from Python, and lent to it, through the DLPack
// protocol.
#include <dlpack/dlpack.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"

namespace laminar::python {
namespace {

constexpr const char* kCapsuleName = "dltensor";

// What one exported capsule owns; the DLTensor's shape and strides point into `view`, so it is
// allocated once and never moved.
struct Lent {
  TensorView view;
  std::shared_ptr<const void> owner;
  DLManagedTensor managed{};
};

// Called by the consumer when its tensor goes, on any thread, with or without the GIL: it only
// drops C++ references.
void delete_lent(DLManagedTensor* managed) { delete static_cast<Lent*>(managed->manager_ctx); }

// A consumer renames the capsule it takes ("used_dltensor") and calls the deleter itself, so only
// one nobody took still has its name and its tensor to delete.
void delete_unconsumed_capsule(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, kCapsuleName)) return;
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
  managed->deleter(managed);
}

// None, or a tuple of two ints; kInvalidArgument naming `what` otherwise.
std::optional<std::pair<std::int64_t, std::int64_t>> int_pair(py::handle v, const std::string& what) {
  if (v.is_none()) return std::nullopt;
  if (PyTuple_Check(v.ptr()) && PyTuple_Size(v.ptr()) == 2) {
    py::tuple t = py::reinterpret_borrow<py::tuple>(v);
    return std::pair<std::int64_t, std::int64_t>{to_int64(t[0], what + "[0]"), to_int64(t[1], what + "[1]")};
  }
  throw_invalid(what + " must be None or a tuple of two ints, got " + std::string(py::repr(v)));
}

}  // namespace

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

std::pair<int, int> DlpackExport::dlpack_device() const {
  DLDevice device = view_.to_dlpack().device;
  return {int(device.device_type), int(device.device_id)};
}

py::array DlpackExport::numpy() const {
  const char* typestr = nullptr;
  switch (view_.dtype()) {
    case DType::kF32: typestr = "<f4"; break;
    case DType::kF16: typestr = "<f2"; break;
    case DType::kI32: typestr = "<i4"; break;
    case DType::kI64: typestr = "<i8"; break;
    case DType::kU8: typestr = "|u1"; break;
    case DType::kBF16:
      throw_invalid(name_ + " is bf16, which NumPy has no dtype for: use torch.from_dlpack(" + name_ + ")");
  }
  std::vector<py::ssize_t> shape, strides;
  for (int i = 0; i < view_.ndim(); ++i) {
    shape.push_back(py::ssize_t(view_.dim(i)));
    strides.push_back(py::ssize_t(view_.stride(i) * std::int64_t(dtype_size(view_.dtype()))));
  }
  // The array's base: a capsule holding the owner, dropped with the last array that views it.
  py::capsule base(new std::shared_ptr<const void>(owner_),
                   [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); });
  return py::array(py::dtype(typestr), std::move(shape), std::move(strides), view_.data(), base);
}

py::tuple DlpackExport::shape() const {
  py::tuple out(view_.ndim());
  for (int i = 0; i < view_.ndim(); ++i) out[std::size_t(i)] = py::int_(view_.dim(i));
  return out;
}

py::capsule DlpackExport::dlpack(py::handle stream, py::handle max_version, py::handle dl_device,
                                 py::handle copy) const {
  if (!stream.is_none()) {
    throw_invalid(name_ + ".__dlpack__: stream must be None for host memory, got " + std::string(py::repr(stream)));
  }
  // Any version is answered with DLPack 0.x, which the standard lets a producer do.
  int_pair(max_version, name_ + ".__dlpack__: max_version");
  if (auto device = int_pair(dl_device, name_ + ".__dlpack__: dl_device");
      device && *device != std::pair<std::int64_t, std::int64_t>(dlpack_device())) {
    throw py::buffer_error(name_ + " is host memory and is lent in place: it cannot go to dl_device " +
                           std::string(py::repr(dl_device)));
  }
  if (!copy.is_none() && !PyBool_Check(copy.ptr())) {
    throw_invalid(name_ + ".__dlpack__: copy must be None or a bool, got " + std::string(py::repr(copy)));
  }
  if (copy.ptr() == Py_True) {
    throw py::buffer_error(name_ + " is lent in place, never copied: import it, then copy the tensor");
  }
  auto lent = std::make_unique<Lent>(Lent{view_, owner_, {}});
  lent->managed.dl_tensor = lent->view.to_dlpack();
  lent->managed.manager_ctx = lent.get();
  lent->managed.deleter = &delete_lent;
  PyObject* capsule = PyCapsule_New(&lent->managed, kCapsuleName, &delete_unconsumed_capsule);
  if (!capsule) throw py::error_already_set();
  lent.release();
  return py::reinterpret_steal<py::capsule>(capsule);
}

}  // namespace laminar::python
