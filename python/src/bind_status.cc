// Status as Python exceptions: laminar.Error and one subclass per StatusCode.
#include <array>
#include <string>

#include "bindings.h"

namespace laminar::python {
namespace {

struct ErrorClass {
  StatusCode code;
  const char* name;
  // The builtin a caller would catch for the same situation, or null. NotFound takes LookupError
  // rather than KeyError, whose str() quotes the message.
  PyObject* builtin;
  const char* doc;
};

// Filled by bind_status; index = StatusCode (the base class at kOk). The module holds the classes.
std::array<PyObject*, static_cast<std::size_t>(StatusCode::kInternal) + 1> g_classes{};

PyObject* class_of(StatusCode code) {
  auto i = static_cast<std::size_t>(code);
  return i < g_classes.size() && g_classes[i] ? g_classes[i] : g_classes[0];
}

py::object make_exception(const Status& status) {
  py::object cls = py::reinterpret_borrow<py::object>(class_of(status.code()));
  py::object exc = cls(status.message());
  exc.attr("code") = py::cast(status.code());
  exc.attr("message") = status.message();
  return exc;
}

}  // namespace

py::object status_to_exception(const Status& status) {
  if (status.ok()) return py::none();
  return make_exception(status);
}

void bind_status(py::module_& m) {
  py::enum_<StatusCode>(m, "StatusCode", "What the caller should do next, the code of every laminar error.")
      .value("OK", StatusCode::kOk)
      .value("INVALID_ARGUMENT", StatusCode::kInvalidArgument, "fix the input")
      .value("NOT_FOUND", StatusCode::kNotFound, "the named thing does not exist")
      .value("ALREADY_EXISTS", StatusCode::kAlreadyExists, "the thing being created is there already")
      .value("FAILED_PRECONDITION", StatusCode::kFailedPrecondition, "fix the state first")
      .value("OUT_OF_RANGE", StatusCode::kOutOfRange, "asked past the end of something valid")
      .value("RESOURCE_EXHAUSTED", StatusCode::kResourceExhausted, "out of memory, blocks, credits or capacity")
      .value("UNAVAILABLE", StatusCode::kUnavailable, "retry the same call")
      .value("ABORTED", StatusCode::kAborted, "redo the whole operation")
      .value("DEADLINE_EXCEEDED", StatusCode::kDeadlineExceeded, "too slow")
      .value("CANCELLED", StatusCode::kCancelled, "the caller, or shutdown, stopped it")
      .value("DATA_LOSS", StatusCode::kDataLoss, "data failed its checksum or is truncated")
      .value("UNIMPLEMENTED", StatusCode::kUnimplemented, "not compiled in or not supported")
      .value("INTERNAL", StatusCode::kInternal, "a bug of laminar's");

  PyObject* base = PyErr_NewExceptionWithDoc(
      "laminar.Error",
      "Base of every laminar error. `code` is its StatusCode, `message` names what was wrong.",
      PyExc_Exception, nullptr);
  if (!base) throw py::error_already_set();
  m.add_object("Error", py::reinterpret_steal<py::object>(base));
  g_classes[0] = base;

  const ErrorClass classes[] = {
      {StatusCode::kInvalidArgument, "InvalidArgumentError", PyExc_ValueError, "Fix the input."},
      {StatusCode::kNotFound, "NotFoundError", PyExc_LookupError, "The named thing does not exist."},
      {StatusCode::kAlreadyExists, "AlreadyExistsError", nullptr,
       "The thing being created is there already (e.g. a trajectory id the queue holds or retired)."},
      {StatusCode::kFailedPrecondition, "FailedPreconditionError", nullptr, "Fix the state first."},
      {StatusCode::kOutOfRange, "OutOfRangeError", PyExc_IndexError, "Asked past the end of something valid."},
      {StatusCode::kResourceExhausted, "ResourceExhaustedError", nullptr,
       "Out of memory, KV blocks, credits or capacity."},
      {StatusCode::kUnavailable, "UnavailableError", nullptr,
       "Retry the same call (a peer gone, a queue momentarily full)."},
      {StatusCode::kAborted, "AbortedError", nullptr, "Redo the whole operation (e.g. a lease ran out)."},
      {StatusCode::kDeadlineExceeded, "DeadlineExceededError", PyExc_TimeoutError, "Too slow."},
      {StatusCode::kCancelled, "CancelledError", nullptr, "The caller, or shutdown (close()), stopped it."},
      {StatusCode::kDataLoss, "DataLossError", nullptr, "Data failed its checksum or is truncated."},
      {StatusCode::kUnimplemented, "UnimplementedError", PyExc_NotImplementedError,
       "Not compiled in, or not supported in this build."},
      {StatusCode::kInternal, "InternalError", nullptr, "A bug of laminar's."},
  };
  for (const ErrorClass& c : classes) {
    py::tuple bases = c.builtin ? py::make_tuple(py::handle(base), py::handle(c.builtin))
                                : py::make_tuple(py::handle(base));
    std::string qualified = std::string("laminar.") + c.name;
    PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), c.doc, bases.ptr(), nullptr);
    if (!cls) throw py::error_already_set();
    m.add_object(c.name, py::reinterpret_steal<py::object>(cls));
    g_classes[static_cast<std::size_t>(c.code)] = cls;
  }

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::object exc = make_exception(e.status());
      PyErr_SetObject(class_of(e.status().code()), exc.ptr());
    }
  });
}

}  // namespace laminar::python
