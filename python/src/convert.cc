// Conversions between Python values and laminar's: durations and 1-D arrays.
#include <cmath>
#include <string>

#include "bindings.h"

namespace laminar::python {
namespace {

std::string describe(py::handle v) { return std::string(py::str(py::type::of(v).attr("__name__"))); }

std::string shape_of(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// A NumPy array of `values`, read in place through __dlpack__ for torch tensors; null when
// `values` is neither an array nor a DLPack producer.
py::object as_array(py::handle values, std::string_view what) {
  if (py::isinstance<py::array>(values)) return py::reinterpret_borrow<py::object>(values);
  if (!py::hasattr(values, "__dlpack__")) return py::object();
  try {
    return py::module_::import("numpy").attr("from_dlpack")(values);
  } catch (py::error_already_set& e) {
    throw_invalid(std::string(what) + ": cannot read this " + describe(values) + " through DLPack (" +
                  describe_error(e) + ")");
  }
}

py::array checked_1d(py::object obj, std::string_view what, std::string_view kinds,
                     std::string_view wanted) {
  py::array a = py::reinterpret_borrow<py::array>(obj);
  char kind = a.dtype().kind();
  if (kinds.find(kind) == std::string_view::npos) {
    throw_invalid(std::string(what) + " must have " + std::string(wanted) + " dtype, got " +
                  std::string(py::str(a.dtype())));
  }
  if (a.ndim() != 1) throw_invalid(std::string(what) + " must be 1-D, got shape " + shape_of(a));
  return a;
}

// Lists and tuples are read item by item; anything else must be an array.
bool is_sequence(py::handle v) { return PyList_Check(v.ptr()) || PyTuple_Check(v.ptr()); }

template <class Wide>
void append_checked(std::vector<std::int32_t>& out, const Wide* data, py::ssize_t n, std::string_view what) {
  out.reserve(static_cast<std::size_t>(n));
  for (py::ssize_t i = 0; i < n; ++i) {
    Wide v = data[i];
    if (v > Wide(std::numeric_limits<std::int32_t>::max()) ||
        (std::is_signed_v<Wide> && v < Wide(std::numeric_limits<std::int32_t>::min()))) {
      throw_invalid(std::string(what) + "[" + std::to_string(i) + "] = " + std::to_string(v) +
                    " does not fit int32");
    }
    out.push_back(static_cast<std::int32_t>(v));
  }
}

}  // namespace

std::uint64_t to_uint(py::handle value, std::string_view what, std::uint64_t max) {
  if (!PyIndex_Check(value.ptr()) || PyBool_Check(value.ptr())) {
    throw_invalid(std::string(what) + " must be an int, got " + describe(value));
  }
  py::int_ index = py::reinterpret_steal<py::int_>(PyNumber_Index(value.ptr()));
  unsigned long long v = PyLong_AsUnsignedLongLong(index.ptr());
  bool failed = v == static_cast<unsigned long long>(-1) && PyErr_Occurred();
  if (failed) PyErr_Clear();
  if (failed || v > max) {
    throw_invalid(std::string(what) + " = " + std::string(py::str(value)) + " is out of range [0, " +
                  std::to_string(max) + "]");
  }
  return v;
}

std::int64_t to_int64(py::handle value, std::string_view what) {
  if (!PyIndex_Check(value.ptr()) || PyBool_Check(value.ptr())) {
    throw_invalid(std::string(what) + " must be an int, got " + describe(value));
  }
  py::int_ index = py::reinterpret_steal<py::int_>(PyNumber_Index(value.ptr()));
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0) throw_invalid(std::string(what) + " = " + std::string(py::str(value)) + " does not fit int64");
  return v;
}

std::string describe_error(const py::error_already_set& e) {
  return std::string(py::str(e.type().attr("__name__"))) + ": " + std::string(py::str(e.value()));
}

py::object json_to_dict(const std::string& json) { return py::module_::import("json").attr("loads")(json); }

PushOptions push_options(bool block, py::handle timeout) {
  if (!block) return PushOptions::fail_fast();
  if (timeout.is_none()) return PushOptions::block();
  return PushOptions::with_timeout(to_duration(timeout, "timeout"));
}

Duration to_duration(py::handle seconds, std::string_view what) {
  if (seconds.is_none()) return kForever;
  double s = 0;
  py::module_ datetime = py::module_::import("datetime");
  if (py::isinstance(seconds, datetime.attr("timedelta"))) {
    s = seconds.attr("total_seconds")().cast<double>();
  } else if ((PyLong_Check(seconds.ptr()) && !PyBool_Check(seconds.ptr())) || PyFloat_Check(seconds.ptr())) {
    s = PyFloat_AsDouble(seconds.ptr());
  } else {
    throw_invalid(std::string(what) + " must be seconds (int or float), a timedelta or None, got " +
                  describe(seconds));
  }
  if (std::isnan(s) || s < 0) {
    throw_invalid(std::string(what) + " must be >= 0 seconds, got " + std::string(py::repr(seconds)));
  }
  // Beyond Duration's range (292 years) there is no deadline to speak of.
  if (s * 1e9 >= static_cast<double>(kForever.count())) return kForever;
  return Duration(static_cast<Duration::rep>(std::llround(s * 1e9)));
}

double from_duration(Duration d) {
  if (d == kForever) return std::numeric_limits<double>::infinity();
  return static_cast<double>(d.count()) / 1e9;
}

std::vector<std::int32_t> to_int32_vector(py::handle values, std::string_view what) {
  std::vector<std::int32_t> out;
  if (is_sequence(values)) {
    py::sequence seq = py::reinterpret_borrow<py::sequence>(values);
    out.reserve(seq.size());
    for (std::size_t i = 0; i < seq.size(); ++i) {
      py::object item = seq[i];
      if (!PyIndex_Check(item.ptr())) {
        throw_invalid(std::string(what) + "[" + std::to_string(i) + "] must be an int, got " + describe(item));
      }
      py::int_ index = py::reinterpret_steal<py::int_>(PyNumber_Index(item.ptr()));
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
      if (overflow != 0 || v > std::numeric_limits<std::int32_t>::max() ||
          v < std::numeric_limits<std::int32_t>::min()) {
        throw_invalid(std::string(what) + "[" + std::to_string(i) + "] = " + std::string(py::str(item)) +
                      " does not fit int32");
      }
      out.push_back(static_cast<std::int32_t>(v));
    }
    return out;
  }
  py::object obj = as_array(values, what);
  if (!obj) {
    throw_invalid(std::string(what) + " must be a list, tuple, NumPy array or torch tensor of ints, got " +
                  describe(values));
  }
  py::array a = checked_1d(obj, what, "iu", "an integer");
  if (a.dtype().kind() == 'u') {
    auto u = py::array_t<std::uint64_t, py::array::c_style | py::array::forcecast>::ensure(a);
    append_checked(out, u.data(), u.size(), what);
  } else {
    auto s = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>::ensure(a);
    append_checked(out, s.data(), s.size(), what);
  }
  return out;
}

std::vector<float> to_float_vector(py::handle values, std::string_view what) {
  std::vector<float> out;
  if (is_sequence(values)) {
    py::sequence seq = py::reinterpret_borrow<py::sequence>(values);
    out.reserve(seq.size());
    for (std::size_t i = 0; i < seq.size(); ++i) {
      py::object item = seq[i];
      double v = PyFloat_AsDouble(item.ptr());
      if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        throw_invalid(std::string(what) + "[" + std::to_string(i) + "] must be a number, got " + describe(item));
      }
      out.push_back(static_cast<float>(v));
    }
    return out;
  }
  py::object obj = as_array(values, what);
  if (!obj) {
    throw_invalid(std::string(what) + " must be a list, tuple, NumPy array or torch tensor of floats, got " +
                  describe(values));
  }
  py::array a = checked_1d(obj, what, "f", "a floating");
  auto f = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(a);
  out.assign(f.data(), f.data() + f.size());
  return out;
}

}  // namespace laminar::python
