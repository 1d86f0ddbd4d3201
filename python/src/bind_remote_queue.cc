// TrajectoryQueueServer and RemoteProducer: rollouts in other processes push into a queue.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "laminar/remote_trajectory_queue.h"

namespace laminar::python {
namespace {

std::shared_ptr<Transport> required(std::shared_ptr<Transport> t) {
  if (!t) throw_invalid("transport must be a Transport, not None");
  return t;
}

}  // namespace

void bind_remote_queue(py::module_& m) {
  py::class_<TrajectoryQueueServerOptions> server_options(m, "TrajectoryQueueServerOptions",
                                                          "Options of a TrajectoryQueueServer (keywords too).");
  def_kwargs_init(server_options);
  def_uint(server_options, "credits_per_producer", &TrajectoryQueueServerOptions::credits_per_producer,
           "Push messages one producer may have in flight.");
  server_options.def_readwrite("clock", &TrajectoryQueueServerOptions::clock,
                               "The Clock of producers' push timeouts and of retries (None: Clock.steady()).");

  py::class_<TrajectoryQueueServer>(m, "TrajectoryQueueServer", R"doc(
Serves a TrajectoryQueue on a Transport, for RemoteProducers in other processes. Its handlers run
on the transport's callback thread and push in C++; no Python runs there. Dropping the
last reference (del server) removes them and answers every held push with CancelledError.)doc")
      .def(py::init([](std::shared_ptr<Transport> transport, std::shared_ptr<TrajectoryQueue> queue,
                       std::optional<TrajectoryQueueServerOptions> options) {
             if (!queue) throw_invalid("queue must be a TrajectoryQueue, not None");
             return unwrap(TrajectoryQueueServer::create(required(std::move(transport)), std::move(queue),
                                                         options.value_or(TrajectoryQueueServerOptions{})));
           }),
           py::arg("transport"), py::arg("queue"), py::arg("options") = py::none(),
           "InvalidArgumentError for zero credits; AlreadyExistsError while another server serves on the transport.")
      .def(
          "stats",
          [](const TrajectoryQueueServer& s) {
            std::string json;
            {
              py::gil_scoped_release unlocked;
              json = s.stats().to_json();
            }
            return json_to_dict(json);
          },
          "Producers, messages received, trajectories accepted and refused, malformed and held messages.");

  py::class_<RemoteProducerOptions> producer_options(m, "RemoteProducerOptions",
                                                     "Options of a RemoteProducer (keywords too); seconds.");
  def_kwargs_init(producer_options);
  def_seconds(producer_options, "connect_timeout", &RemoteProducerOptions::connect_timeout,
              "Connecting plus the handshake.");
  def_seconds(producer_options, "stall_timeout", &RemoteProducerOptions::stall_timeout,
              "A server leaving a ping unanswered this long counts as hung (None: never ping).");
  producer_options.def_readwrite("clock", &RemoteProducerOptions::clock,
                                 "The Clock of push timeouts (None: Clock.steady()).");

  py::class_<RemoteProducer>(m, "RemoteProducer", R"doc(
Pushes into the TrajectoryQueue a TrajectoryQueueServer serves at "host:port", with the queue's own
answers, over this process's Transport. Thread-safe: threads share its credits. push and push_many
release the GIL while they wait.)doc")
      .def(py::init([](std::shared_ptr<Transport> transport, const std::string& address,
                       std::optional<RemoteProducerOptions> options) {
             auto t = required(std::move(transport));
             RemoteProducerOptions o = options.value_or(RemoteProducerOptions{});
             std::optional<Result<std::unique_ptr<RemoteProducer>>> p;
             {
               py::gil_scoped_release unlocked;
               p.emplace(RemoteProducer::create(std::move(t), address, std::move(o)));
             }
             return unwrap(std::move(*p));
           }),
           py::arg("transport"), py::arg("address"), py::arg("options") = py::none(),
           "Connects and handshakes. InvalidArgumentError for bad options; UnavailableError or "
           "DeadlineExceededError when the server cannot be reached.")
      .def(
          "push",
          &push_copy<RemoteProducer>,
          py::arg("trajectory"), py::kw_only(), py::arg("block") = true, py::arg("timeout") = py::none(),
          "TrajectoryQueue.push across the wire: the queue's errors, or UnavailableError when the server "
          "vanished (pushing again is safe: a duplicate is AlreadyExistsError). block and timeout govern "
          "the wait for a credit.")
      .def(
          "push_many",
          &push_many_copies<RemoteProducer>,
          py::arg("trajectories"), py::kw_only(), py::arg("block") = true, py::arg("timeout") = py::none(),
          "TrajectoryQueue.push_many across the wire: None or the Error (not raised) per trajectory.")
      .def_property_readonly("credits_granted", &RemoteProducer::credits_granted,
                             "Pushes in flight the server allows this producer.")
      .def_property_readonly("credits_free", &RemoteProducer::credits_free, "Credits not in use now.");
}

}  // namespace laminar::python
