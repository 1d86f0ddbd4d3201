// Clock, the steady clock and ManualClock: the time every laminar timeout reads, in seconds.
#include <memory>

#include "bindings.h"
#include "laminar/clock.h"

namespace laminar::python {

void bind_clock(py::module_& m) {
  py::class_<Clock, std::shared_ptr<Clock>>(m, "Clock", R"doc(
The time every laminar timeout, lease and deadline reads. Options take one (their `clock` field;
None: the steady clock). Clock.steady() is real time; a ManualClock moves only when told, so a test
or a simulation makes leases and timeouts expire exactly when it says.)doc")
      .def("now", [](const Clock& c) { return from_duration(c.now()); }, "Seconds since the clock's epoch.")
      .def_static("steady", &Clock::steady, "The process-wide steady (monotonic, real-time) clock.");

  py::class_<ManualClock, Clock, std::shared_ptr<ManualClock>>(m, "ManualClock",
                                                                 "Virtual time that only moves when told to.")
      .def(py::init([](py::handle start) { return std::make_shared<ManualClock>(to_duration(start, "start")); }),
           py::arg("start") = 0, "Starts at `start` seconds.")
      .def(
          "advance",
          [](ManualClock& c, py::handle seconds) {
            Duration d = to_duration(seconds, "seconds");
            Status st;
            {
              // Waking the waiters locks their components' mutexes.
              py::gil_scoped_release unlocked;
              st = c.advance(d);
            }
            check(st);
          },
          py::arg("seconds"),
          "Moves time forward, then wakes every call waiting on this clock (they re-check their deadlines). "
          "InvalidArgumentError for a negative step or one reaching infinity.")
      .def(
          "set",
          [](ManualClock& c, py::handle seconds) {
            Duration t = to_duration(seconds, "seconds");
            Status st;
            {
              py::gil_scoped_release unlocked;
              st = c.set(t);
            }
            check(st);
          },
          py::arg("seconds"), "Jumps to `seconds`. InvalidArgumentError when that is before now().");
}

}  // namespace laminar::python
