// Rollout dispatch: the RolloutDispatcher an actor runs and the DispatchClient each rollout worker
// asks it through. The options' callbacks (payload, on_available, on_answer) are not bound: they
// would run Python on laminar's threads.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "laminar/rollout_dispatcher.h"
#include "laminar/transport.h"

namespace laminar::python {

void bind_dispatch(py::module_& m) {
  py::enum_<AdmissionRule::Kind>(m, "AdmissionKind", "Which admission rule.")
      .value("SYNC", AdmissionRule::Kind::kSync, "open() makes groups for exactly the newest version")
      .value("ONE_STEP_AHEAD", AdmissionRule::Kind::kOneStepAhead, "open() makes groups for the newest or newer")
      .value("STREAM", AdmissionRule::Kind::kStream, "groups on demand, bounded by staleness and samples in flight")
      .value("INTERRUPTIBLE", AdmissionRule::Kind::kInterruptible,
             "the stream, and workers behind the newest version are told to pull at once");

  py::class_<AdmissionRule>(m, "AdmissionRule", R"doc(
Which groups exist and which workers may take them; make one with sync(), one_step_ahead(),
stream(max_staleness, max_in_flight) or interruptible(max_staleness, max_in_flight).)doc")
      .def_static("sync", &AdmissionRule::sync)
      .def_static("one_step_ahead", &AdmissionRule::one_step_ahead)
      .def_static(
          "stream",
          [](py::handle max_staleness, py::handle max_in_flight) {
            return AdmissionRule::stream(to_uint(max_staleness, "max_staleness"),
                                         to_uint(max_in_flight, "max_in_flight"));
          },
          py::arg("max_staleness"), py::arg("max_in_flight"))
      .def_static(
          "interruptible",
          [](py::handle max_staleness, py::handle max_in_flight) {
            return AdmissionRule::interruptible(to_uint(max_staleness, "max_staleness"),
                                                to_uint(max_in_flight, "max_in_flight"));
          },
          py::arg("max_staleness"), py::arg("max_in_flight"))
      .def_readonly("kind", &AdmissionRule::kind)
      .def_readonly("max_staleness", &AdmissionRule::max_staleness)
      .def_readonly("max_in_flight", &AdmissionRule::max_in_flight)
      .def("__eq__", [](const AdmissionRule& a, const AdmissionRule& b) { return a == b; });

  py::class_<RolloutDispatcherOptions> options(m, "RolloutDispatcherOptions",
                                               "Options of a RolloutDispatcher (keywords too).");
  def_kwargs_init(options);
  options.def_readwrite("rule", &RolloutDispatcherOptions::rule, "The admission rule at the start.")
      .def_readwrite("clock", &RolloutDispatcherOptions::clock, "The Clock of leases and waits.");
  def_uint(options, "group_size", &RolloutDispatcherOptions::group_size, "Samples per group (positive).");
  def_uint(options, "seed", &RolloutDispatcherOptions::seed, "Base of every sample's sampling seed.");
  def_uint(options, "first_prompt", &RolloutDispatcherOptions::first_prompt, "Prompt index of group 0.");
  def_seconds(options, "lease", &RolloutDispatcherOptions::lease,
              "A worker silent this long is lost; a released sample unclaimed this long goes out again.");
  def_seconds(options, "max_wait", &RolloutDispatcherOptions::max_wait,
              "The longest a request may wait for work (at most the lease).");
  def_uint(options, "max_workers", &RolloutDispatcherOptions::max_workers, "Workers known at once.");
  def_uint(options, "max_held", &RolloutDispatcherOptions::max_held, "Ids one worker may hold.");
  def_uint(options, "max_open_groups", &RolloutDispatcherOptions::max_open_groups,
           "Groups from the oldest not done to the newest.");

  py::class_<Completion>(m, "Completion", "What RolloutDispatcher.completed found.")
      .def_readonly("prompt_index", &Completion::prompt_index)
      .def_readonly("duplicate", &Completion::duplicate, "Completed before: nothing changed.")
      .def_readonly("group_done", &Completion::group_done, "This completion finished its group.");

  py::class_<RolloutDispatcher>(m, "RolloutDispatcher", R"doc(
The actor's side of rollout dispatch, on its (listening) transport: makes groups of samples under
the admission rule, hands them to the workers' DispatchClients, and completes each exactly once.
Its thread runs no Python.)doc")
      .def(py::init([](std::shared_ptr<Transport> transport, const RolloutDispatcherOptions& o) {
             if (!transport) throw_invalid("transport must be a Transport, not None");
             return unwrap(RolloutDispatcher::create(std::move(transport), o));
           }),
           py::arg("transport"), py::arg("options"),
           "InvalidArgumentError for bad options (group_size must be set); AlreadyExistsError when another "
           "dispatcher serves the transport.")
      .def(
          "set_rule", [](RolloutDispatcher& d, const AdmissionRule& rule) { check(d.set_rule(rule)); },
          py::arg("rule"), "Changes the rule. InvalidArgumentError for a stream whose max_in_flight is below a group.")
      .def(
          "publish", [](RolloutDispatcher& d, Version v) { check(d.publish(v)); }, py::arg("version"),
          "The newest published version. InvalidArgumentError for an older one.")
      .def(
          "open",
          [](RolloutDispatcher& d, py::handle groups, std::optional<Version> version_min,
             std::optional<Version> version_max) {
            const std::uint64_t n = to_uint(groups, "groups");
            if (version_min.has_value() != version_max.has_value()) {
              throw_invalid("open: give both version_min and version_max, or neither");
            }
            return version_min ? unwrap(d.open(*version_min, *version_max, n)) : unwrap(d.open(n));
          },
          py::arg("groups"), py::arg("version_min") = py::none(), py::arg("version_max") = py::none(), R"doc(
Makes `groups` groups, for the rule's window (sync, one step ahead) or for [version_min,
version_max]; returns the first one's prompt index. FailedPreconditionError under a stream rule
without versions; ResourceExhaustedError past max_open_groups.)doc")
      .def(
          "completed", [](RolloutDispatcher& d, TrajectoryId id) { return unwrap(d.completed(id)); }, py::arg("id"),
          "The trajectory reached the trainer's queue. NotFoundError for an id of no group made.")
      .def(
          "wait_done",
          [](RolloutDispatcher& d, py::handle groups, py::handle timeout) {
            const std::uint64_t n = to_uint(groups, "groups");
            const Duration t = to_duration(timeout, "timeout");
            Status st;
            {
              py::gil_scoped_release unlocked;
              st = d.wait_done(n, t);
            }
            check(st);
          },
          py::arg("groups"), py::arg("timeout") = py::none(),
          "Blocks until `groups` groups are done in all. DeadlineExceededError after `timeout` seconds.")
      .def(
          "stats", [](const RolloutDispatcher& d) { return json_to_dict(d.stats().to_json()); },
          "Requests, groups, samples handed out, reissued and completed, workers, as a dict.")
      .def(
          "background_error", [](const RolloutDispatcher& d) { return status_to_exception(d.background_error()); },
          "The first answer that could not be sent (an Error, not raised), or None.");

  py::enum_<GrantKind>(m, "GrantKind", "What a Grant says.")
      .value("WORK", GrantKind::kWork, "samples to decode")
      .value("PULL_NEWER", GrantKind::kPullNewer, "pull pull_version or newer first")
      .value("NOTHING", GrantKind::kNothing, "no work for this worker now");

  py::class_<Sample>(m, "Sample", "One sample of one group.")
      .def_readonly("id", &Sample::id, "Its trajectory id.")
      .def_readonly("prompt_index", &Sample::prompt_index)
      .def_readonly("sample_index", &Sample::sample_index)
      .def_readonly("seed", &Sample::seed, "Its sampling seed.")
      .def_property_readonly(
          "payload", [](const Sample& s) { return py::bytes(s.payload); }, "The group's payload bytes.");

  py::class_<Grant>(m, "Grant", "The dispatcher's answer to a request.")
      .def_readonly("kind", &Grant::kind)
      .def_readonly("pull_version", &Grant::pull_version, "PULL_NEWER only.")
      .def_readonly("samples", &Grant::samples, "WORK only.")
      .def_readonly("drop", &Grant::drop, "Held ids completed already elsewhere.")
      .def_readonly("newest", &Grant::newest, "The newest published version.")
      .def_readonly("interrupt", &Grant::interrupt, "Interruptible rule: pull `newest` now, keeping live sequences.");

  py::class_<DispatchClientOptions> client_options(m, "DispatchClientOptions",
                                                   "Options of a DispatchClient (keywords too).");
  def_kwargs_init(client_options);
  client_options.def_readwrite("worker", &DispatchClientOptions::worker, "This worker's id.")
      .def_readwrite("server", &DispatchClientOptions::server, "The dispatcher's \"host:port\".");
  def_seconds(client_options, "connect_timeout", &DispatchClientOptions::connect_timeout, "Connecting in all.");
  def_seconds(client_options, "retry_interval", &DispatchClientOptions::retry_interval, "Between connection attempts.");
  def_seconds(client_options, "request_timeout", &DispatchClientOptions::request_timeout,
              "How long an answer may take beyond the request's wait.");

  py::class_<DispatchClient>(m, "DispatchClient", R"doc(
A rollout worker's side of dispatch: asks the dispatcher for samples, saying which it decodes now.)doc")
      .def(py::init([](std::shared_ptr<Transport> transport, const DispatchClientOptions& o) {
             if (!transport) throw_invalid("transport must be a Transport, not None");
             std::optional<Result<std::unique_ptr<DispatchClient>>> c;
             {
               py::gil_scoped_release unlocked;  // connects, retrying
               c.emplace(DispatchClient::create(std::move(transport), o));
             }
             return unwrap(std::move(*c));
           }),
           py::arg("transport"), py::arg("options"),
           "Connects, retrying until connect_timeout. InvalidArgumentError for bad options.")
      .def(
          "request",
          [](DispatchClient& c, Version version, py::handle free_slots, const std::vector<TrajectoryId>& held,
             py::handle wait, bool idle_pull, const std::vector<TrajectoryId>& returned) {
            DispatchRequest q{version,   static_cast<std::uint32_t>(to_uint(free_slots, "free_slots", UINT32_MAX)),
                              held,      to_duration(wait, "wait"),
                              idle_pull, returned};
            if (q.wait == kForever) throw_invalid("wait must be finite seconds");
            std::optional<Result<Grant>> g;
            {
              py::gil_scoped_release unlocked;
              g.emplace(c.request(q));
            }
            return unwrap(std::move(*g));
          },
          py::arg("version"), py::arg("free_slots"), py::arg("held") = std::vector<TrajectoryId>{},
          py::arg("wait") = 0.0, py::arg("idle_pull") = false, py::arg("returned") = std::vector<TrajectoryId>{},
          R"doc(
Asks for up to `free_slots` samples for weights `version`, listing the ids it decodes now (`held`)
and those granted that it gives back unstarted (`returned`, handed out again at once); the
dispatcher may hold the request `wait` seconds while it has nothing for it. Returns the Grant.)doc")
      .def("close", &DispatchClient::close, "Closes the connection: the dispatcher hands this worker's samples out again.");
}

}  // namespace laminar::python
