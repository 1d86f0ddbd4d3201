// Transport and its options: the one UCX transport a process hosts its networked parts on.
#include <memory>
#include <string>

#include "bindings.h"
#include "laminar/transport.h"

namespace laminar::python {

void bind_transport(py::module_& m) {
  py::class_<TransportOptions> options_class(m, "TransportOptions", R"doc(
Options of a Transport; every field is also a keyword of the constructor. Durations are seconds
(None or math.inf: no deadline).)doc");
  def_kwargs_init(options_class);
  options_class.def_property(
      "cluster_token", [](const TransportOptions& o) { return py::bytes(o.cluster_token); },
      [](TransportOptions& o, py::handle v) {
        if (PyUnicode_Check(v.ptr())) {
          o.cluster_token = v.cast<std::string>();
        } else if (PyBytes_Check(v.ptr())) {
          o.cluster_token = std::string(py::reinterpret_borrow<py::bytes>(v));
        } else {
          throw_invalid("cluster_token must be bytes or str, got " +
                        std::string(py::str(py::type::of(v).attr("__name__"))));
        }
      },
      "Shared secret of the cluster (bytes, or str taken as UTF-8), at least 16 bytes; never sent.");
  options_class.def_readwrite("ucx_transports", &TransportOptions::ucx_transports,
                              "UCX transports in UCX_TLS syntax (\"tcp\", \"sm\", ...); empty: UCX_TLS or UCX's "
                              "choice, which leaves out UCX's shared-memory message transports (see transport.h).");
  def_uint(options_class, "max_message_bytes", &TransportOptions::max_message_bytes,
           "Largest control message body.");
  def_seconds(options_class, "connect_timeout", &TransportOptions::connect_timeout, "Default deadline of connect.");
  def_seconds(options_class, "handshake_timeout", &TransportOptions::handshake_timeout,
              "How long a connecting peer has to authenticate.");
  def_uint(options_class, "max_unauthenticated_connections", &TransportOptions::max_unauthenticated_connections,
           "Connections to the listener not yet authenticated, at most.");
  def_seconds(options_class, "operation_timeout", &TransportOptions::operation_timeout,
              "Default deadline of send, request, put and get.");
  def_seconds(options_class, "idle_timeout", &TransportOptions::idle_timeout,
              "An idle connection is closed after this long (None: never).");
  def_uint(options_class, "max_inbox_bytes_per_connection", &TransportOptions::max_inbox_bytes_per_connection,
           "Bytes of unhandled messages kept from one connection.");
  def_uint(options_class, "max_inbox_bytes", &TransportOptions::max_inbox_bytes,
           "Bytes of unhandled messages kept from all connections.");
  options_class.def_readwrite("clock", &TransportOptions::clock,
                              "The Clock every deadline of the transport reads (None: Clock.steady()).");

  py::class_<Transport, std::shared_ptr<Transport>>(m, "Transport", R"doc(
laminar's one way across processes and machines (UCX), with its own progress and callback threads;
a process makes one and hosts every networked part on it (queue server, remote producers). No
Python code runs on its threads.)doc")
      .def(py::init([](std::optional<TransportOptions> options) {
             std::optional<Result<std::unique_ptr<Transport>>> t;
             {
               py::gil_scoped_release unlocked;
               t.emplace(Transport::create(options.value_or(TransportOptions{})));
             }
             return std::shared_ptr<Transport>(unwrap(std::move(*t)));
           }),
           py::arg("options") = py::none(),
           "InvalidArgumentError for bad options (a cluster_token under 16 bytes, ...); UCX's errors as they "
           "come.")
      .def(
          "listen",
          [](Transport& t, const std::string& host, py::handle port) {
            auto p = static_cast<std::uint16_t>(to_uint(port, "port", 65535));
            std::optional<Result<std::string>> address;
            {
              py::gil_scoped_release unlocked;
              address.emplace(t.listen(host, p));
            }
            return unwrap(std::move(*address));
          },
          py::arg("host"), py::arg("port") = 0,
          "Listens on host:port (port 0: any free one) and returns the address peers connect to, \"host:port\".")
      .def("listen_address", &Transport::listen_address, "The address listen() returned, or None.")
      .def_property_readonly(
          "options", [](const Transport& t) { return t.options(); }, "A copy of the options it was made with.")
      .def(
          "stats",
          [](const Transport& t) {
            std::string json;
            {
              py::gil_scoped_release unlocked;
              json = t.stats().to_json();
            }
            return json_to_dict(json);
          },
          "Inbox depth and refusals, as a dict.");
}

}  // namespace laminar::python
