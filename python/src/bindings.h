// bindings.h: what every file of the extension laminar._laminar shares.
//
// Each bound area has its own file with one init function, called once by module.cc in the order
// listed here (later areas use the types and exceptions of earlier ones). The rules every area
// follows:
//   - a failed Status becomes the Python exception of its code: call check() / unwrap(), which
//     throw StatusError, translated by bind_status's translator;
//   - a call that can block (waits, locks, IO) runs under py::gil_scoped_release, and everything it
//     needs from Python objects is copied out before the GIL is dropped;
//   - no Python runs on a thread of laminar's: a part's background callback (on_event) only
//     appends to an EventBuffer (event_buffer.h), which Python drains from its own calls;
//   - ids and versions are Python ints, durations float seconds (None or math.inf: no deadline),
//     arrays NumPy arrays.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <algorithm>
#include <exception>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "laminar/clock.h"
#include "laminar/status.h"
#include "laminar/trajectory_queue.h"
#include "laminar/types.h"

namespace laminar::python {

namespace py = pybind11;

void bind_status(py::module_& m);
void bind_clock(py::module_& m);
void bind_trajectory(py::module_& m);
void bind_queue(py::module_& m);
void bind_transport(py::module_& m);
void bind_remote_queue(py::module_& m);
void bind_relay(py::module_& m);
void bind_kv_cache(py::module_& m);
void bind_kv_migrator(py::module_& m);
void bind_kernels(py::module_& m);
void bind_repack(py::module_& m);
void bind_dispatch(py::module_& m);

// Carries a non-OK Status from C++ to bind_status's translator.
class StatusError : public std::exception {
 public:
  explicit StatusError(Status status) : status_(std::move(status)), what_(status_.to_string()) {}
  const Status& status() const noexcept { return status_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  Status status_;
  std::string what_;
};

inline void check(Status status) {
  if (!status.ok()) throw StatusError(std::move(status));
}

template <class T>
T unwrap(Result<T>&& r) {
  if (!r.ok()) throw StatusError(r.status());
  return std::move(*r);
}

[[noreturn]] inline void throw_invalid(std::string message) {
  throw StatusError(invalid_argument(std::move(message)));
}

// The exception object (not raised) for a non-OK status, None for OK: what calls that report one
// status per item (push_many) or a background error return.
py::object status_to_exception(const Status& status);

// A Python int in [0, max]; kInvalidArgument naming `what` otherwise.
std::uint64_t to_uint(py::handle value, std::string_view what,
                      std::uint64_t max = std::numeric_limits<std::uint64_t>::max());
// A Python int in int64's range; kInvalidArgument naming `what` otherwise.
std::int64_t to_int64(py::handle value, std::string_view what);

// Seconds (int or float, >= 0), a datetime.timedelta, or None / math.inf for kForever.
// kInvalidArgument naming `what` for anything else.
Duration to_duration(py::handle seconds, std::string_view what);
// Seconds as a float; kForever is math.inf.
double from_duration(Duration d);

// A 1-D sequence of integer token ids: a list or tuple of ints, or a NumPy array / anything with
// __dlpack__ (a torch tensor on the CPU) of an integer dtype. kInvalidArgument naming `what` for
// another dtype, another number of dimensions, or a value outside int32.
std::vector<std::int32_t> to_int32_vector(py::handle values, std::string_view what);
// The same for real numbers: a list or tuple of ints and floats, or an array of a floating dtype.
std::vector<float> to_float_vector(py::handle values, std::string_view what);

// A tensor borrowed through the DLPack protocol (`__dlpack__`: torch tensors, NumPy arrays, ...),
// without a copy: view() points into the producer's memory, kept alive (with the producer's
// object) as long as this lives. CUDA tensors are exported for the legacy default stream, which is
// where the kernels bound here run them.
class DlpackTensor {
 public:
  // kInvalidArgument naming `what` for an object without __dlpack__, one whose export fails (a
  // torch tensor that requires grad, a read-only NumPy array), or a tensor TensorView::from_dlpack
  // refuses (dtype, negative strides, device). A CUDA tensor is exported for `cuda_stream`, the
  // stream its consumer runs on (0: the legacy default), so the producer orders its work before it.
  static DlpackTensor borrow(py::handle obj, std::string_view what, std::uintptr_t cuda_stream = 0);
  const TensorView& view() const noexcept { return view_; }

 private:
  py::capsule capsule_;  // owns the DLManagedTensor; its destructor calls the producer's deleter
  TensorView view_;
};

// A tensor in host memory that laminar owns, lent to Python through the DLPack protocol
// (torch.from_dlpack, numpy.from_dlpack) without a copy. Every capsule it makes holds `owner`,
// released by the capsule's deleter, so the memory lives as long as the last tensor made from it,
// whatever happens to this object. Precondition: `view` is on the host, valid while `owner` lives.
class DlpackExport {
 public:
  DlpackExport(TensorView view, std::shared_ptr<const void> owner, std::string name)
      : view_(view), owner_(std::move(owner)), name_(std::move(name)) {}
  // __dlpack__ of the array API standard, a DLPack 0.x "dltensor" capsule whatever max_version
  // asks. kInvalidArgument naming the argument for a stream other than None (host memory has none)
  // or a malformed max_version, dl_device or copy; BufferError for a dl_device other than the
  // host or copy=True (it lends the memory itself, never a copy).
  py::capsule dlpack(py::handle stream, py::handle max_version, py::handle dl_device, py::handle copy) const;
  // __dlpack_device__: (DLDeviceType, device id), (1, 0) for the host.
  std::pair<int, int> dlpack_device() const;
  // A writable NumPy array over the memory, holding `owner` (NumPy marks what numpy.from_dlpack
  // imports read-only: DLPack 0.x cannot say whether the producer allows writes). kInvalidArgument
  // for bf16, which NumPy has no dtype for.
  py::array numpy() const;
  const TensorView& view() const noexcept { return view_; }
  py::tuple shape() const;

 private:
  TensorView view_;
  std::shared_ptr<const void> owner_;
  std::string name_;  // in error messages
};

// A new NumPy array holding a copy of `values`.
template <class T>
py::array_t<T> to_numpy(std::span<const T> values) {
  py::array_t<T> out(static_cast<py::ssize_t>(values.size()));
  if (!values.empty()) std::copy(values.begin(), values.end(), out.mutable_data());
  return out;
}

// "TypeName: message" of a Python exception, without the traceback error_already_set::what() adds.
std::string describe_error(const py::error_already_set& e);

// The dict of a stats struct's to_json().
py::object json_to_dict(const std::string& json);

// What push(block=, timeout=) means, as in queue.Queue.put: block=False fails at once (timeout
// ignored), block=True waits for `timeout` seconds, or without a deadline when it is None.
PushOptions push_options(bool block, py::handle timeout);

// push and push_many of a TrajectoryQueue or a RemoteProducer: each pushes copies (the caller's
// trajectories stay usable) with the GIL released. push raises the failure; push_many returns, per
// trajectory, None or the Error push would have raised.
template <class Sink>
void push_copy(Sink& sink, const Trajectory& t, bool block, py::handle timeout) {
  PushOptions o = push_options(block, timeout);
  Trajectory copy = t;
  Status st;
  {
    py::gil_scoped_release unlocked;
    st = sink.push(std::move(copy), o);
  }
  check(st);
}
template <class Sink>
py::list push_many_copies(Sink& sink, const std::vector<Trajectory>& ts, bool block, py::handle timeout) {
  PushOptions o = push_options(block, timeout);
  std::vector<Trajectory> copies = ts;
  std::vector<Status> statuses;
  {
    py::gil_scoped_release unlocked;
    statuses = sink.push_many(copies, o);
  }
  py::list out;
  for (const Status& st : statuses) out.append(status_to_exception(st));
  return out;
}

// Properties whose setters check their Python value (ints in range, seconds), for the options
// structs; `name` is also the name in the error message.
template <class C, class M>
void def_uint(py::class_<C>& cls, const char* name, M C::*member, const char* doc) {
  cls.def_property(
      name, [member](const C& c) { return c.*member; },
      [member, name](C& c, py::handle v) {
        c.*member = static_cast<M>(to_uint(v, name, std::numeric_limits<M>::max()));
      },
      doc);
}

template <class C>
void def_seconds(py::class_<C>& cls, const char* name, Duration C::*member, const char* doc) {
  cls.def_property(
      name, [member](const C& c) { return from_duration(c.*member); },
      [member, name](C& c, py::handle v) { c.*member = to_duration(v, name); }, doc);
}

// C(**kwargs): each keyword goes through the property of its name (and its checks).
template <class C>
void def_kwargs_init(py::class_<C>& cls) {
  cls.def(py::init([](py::kwargs kwargs) {
    py::object obj = py::cast(C{});
    py::object type = py::type::of(obj);
    py::object property = py::module_::import("builtins").attr("property");
    for (auto [key, value] : kwargs) {
      py::object attr = py::getattr(type, key, py::none());
      if (!py::isinstance(attr, property)) {
        throw_invalid(std::string(py::str(type.attr("__name__"))) + " has no field '" +
                      std::string(py::str(key)) + "'");
      }
      obj.attr(key) = value;
    }
    return obj.cast<C>();
  }));
}

}  // namespace laminar::python

namespace pybind11::detail {

// Version, TrajectoryId, BatchId, ... are plain Python ints; a negative or too large one is
// InvalidArgumentError naming the id's kind.
template <class Tag, class Rep>
struct type_caster<laminar::StrongId<Tag, Rep>> {
  using Id = laminar::StrongId<Tag, Rep>;
  PYBIND11_TYPE_CASTER(Id, const_name("int"));

  bool load(handle src, bool /*convert*/) {
    if (!src || !PyLong_Check(src.ptr()) || PyBool_Check(src.ptr())) return false;
    int overflow = 0;
    long long as_signed = PyLong_AsLongLongAndOverflow(src.ptr(), &overflow);
    if (overflow == 0 && as_signed < 0) reject(src);
    unsigned long long v = PyLong_AsUnsignedLongLong(src.ptr());
    if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
      PyErr_Clear();
      reject(src);
    }
    if (v > std::numeric_limits<Rep>::max()) reject(src);
    value = Id(static_cast<Rep>(v));
    return true;
  }

  static handle cast(Id id, return_value_policy, handle) {
    return PyLong_FromUnsignedLongLong(static_cast<unsigned long long>(id.value()));
  }

 private:
  [[noreturn]] static void reject(handle src) {
    laminar::python::throw_invalid(std::string(id_name()) + " " + std::string(pybind11::str(src)) +
                                   " is out of range [0, " +
                                   std::to_string(std::numeric_limits<Rep>::max()) + "]");
  }
  static std::string_view id_name() {
    if constexpr (std::is_same_v<Tag, laminar::VersionTag>) return "version";
    if constexpr (std::is_same_v<Tag, laminar::TrajectoryIdTag>) return "trajectory id";
    if constexpr (std::is_same_v<Tag, laminar::PromptIdTag>) return "prompt id";
    if constexpr (std::is_same_v<Tag, laminar::GroupIdTag>) return "group id";
    if constexpr (std::is_same_v<Tag, laminar::BatchIdTag>) return "batch id";
    if constexpr (std::is_same_v<Tag, laminar::SequenceIdTag>) return "sequence id";
    if constexpr (std::is_same_v<Tag, laminar::WorkerIdTag>) return "worker id";
    if constexpr (std::is_same_v<Tag, laminar::MigrationIdTag>) return "migration id";
    return "id";
  }
};

}  // namespace pybind11::detail
