// laminar._laminar: the extension under the Python package laminar (python/laminar/__init__.py).
#include "bindings.h"

PYBIND11_MODULE(_laminar, m) {
  m.doc() = "laminar's C++ components, bound with pybind11; import them from the package laminar.";
  m.attr("__version__") = LAMINAR_VERSION;
  laminar::python::bind_status(m);
  laminar::python::bind_clock(m);
  laminar::python::bind_trajectory(m);
  laminar::python::bind_queue(m);
  laminar::python::bind_transport(m);
  laminar::python::bind_remote_queue(m);
  laminar::python::bind_relay(m);
  laminar::python::bind_kv_cache(m);
  laminar::python::bind_kv_migrator(m);
  laminar::python::bind_kernels(m);
  laminar::python::bind_repack(m);
  laminar::python::bind_dispatch(m);
}
