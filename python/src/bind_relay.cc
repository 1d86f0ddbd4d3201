// RelayStore (publish from tensors given through DLPack, acquire) and WeightPuller (pull into
// tensors in place): the in-process relay tier.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "event_buffer.h"
#include "laminar/local_relay.h"
#include "laminar/relay_node.h"
#include "laminar/relay_store.h"
#include "laminar/weight_manifest.h"
#include "laminar/weight_puller.h"

namespace laminar::python {
namespace {

// A {name: tensor} mapping, borrowed through DLPack, as the NamedTensor span the C++ calls take.
// Built with the GIL held; the views stay valid while it lives, without it.
class NamedTensors {
 public:
  NamedTensors(py::handle mapping, std::string_view what) {
    if (!PyDict_Check(mapping.ptr())) {
      throw_invalid(std::string(what) + " must be a dict {name: tensor}, got " +
                    std::string(py::str(py::type::of(mapping).attr("__name__"))));
    }
    py::dict d = py::reinterpret_borrow<py::dict>(mapping);
    for (auto [key, value] : d) {
      if (!PyUnicode_Check(key.ptr())) throw_invalid(std::string(what) + ": tensor names must be str");
      names_.push_back(key.cast<std::string>());
      tensors_.push_back(DlpackTensor::borrow(value, std::string(what) + "['" + names_.back() + "']"));
    }
    for (std::size_t i = 0; i < names_.size(); ++i) named_.push_back({names_[i], tensors_[i].view()});
  }
  std::span<const NamedTensor> span() const noexcept { return named_; }

 private:
  std::vector<std::string> names_;
  std::vector<DlpackTensor> tensors_;
  std::vector<NamedTensor> named_;
};

// A LocalRelayServer or RelayNode with the buffer its on_event fills.
struct LocalRelayServerHolder {
  std::shared_ptr<EventBuffer<LocalRelayEvent>> events;
  std::unique_ptr<LocalRelayServer> server;
};
struct RelayNodeHolder {
  std::shared_ptr<EventBuffer<RelayEvent>> events;
  std::unique_ptr<RelayNode> node;
};

py::object optional_version(std::optional<Version> v) {
  if (!v) return py::none();
  return py::cast(*v);
}

// A read-only uint8 NumPy array over `bytes`, keeping `handle` (and so the version) alive.
py::array read_only_bytes(const ReadHandle& handle, std::span<const std::byte> bytes) {
  auto* keep = new ReadHandle(handle);
  py::capsule owner(keep, [](void* p) { delete static_cast<ReadHandle*>(p); });
  py::array_t<std::uint8_t> a({static_cast<py::ssize_t>(bytes.size())}, {py::ssize_t(1)},
                              reinterpret_cast<const std::uint8_t*>(bytes.data()), owner);
  a.attr("setflags")(py::arg("write") = false);
  return a;
}

}  // namespace

void bind_relay(py::module_& m) {
  py::class_<RelayStoreOptions> store_options(m, "RelayStoreOptions", "Options of a RelayStore (keywords too).");
  def_kwargs_init(store_options);
  def_uint(store_options, "chunk_bytes", &RelayStoreOptions::chunk_bytes,
           "Chunk size of published versions (>= 4096, a multiple of 256).");
  def_uint(store_options, "memory_budget_bytes", &RelayStoreOptions::memory_budget_bytes,
           "Bytes of version buffers the store may hold.");
  store_options.def_readwrite("pin_memory", &RelayStoreOptions::pin_memory,
                              "Page-lock version buffers through CUDA when a device is present.");
  store_options.def_readwrite("shareable", &RelayStoreOptions::shareable,
                              "Keep versions in sealed memfds, for a LocalRelayServer.");
  store_options.def_readwrite("clock", &RelayStoreOptions::clock, "The Clock of every wait (None: Clock.steady()).");

  py::class_<ReadHandle>(m, "ReadHandle", R"doc(
A reference on one committed version of a RelayStore: its bytes stay valid and unchanged while the
handle (or an array it returned) lives.)doc")
      .def_property_readonly("version", &ReadHandle::version)
      .def_property_readonly(
          "manifest", [](const ReadHandle& h) { return json_to_dict(h.manifest().to_json()); },
          "The version's manifest: {\"total_bytes\", \"tensors\": [{\"name\", \"dtype\", \"shape\", \"nbytes\", "
          "\"offset\"}, ...]}.")
      .def(
          "tensor_bytes",
          [](const ReadHandle& h, const std::string& name) {
            return read_only_bytes(h, unwrap(h.tensor(name)));
          },
          py::arg("name"),
          "The stored bytes of one tensor, as a read-only uint8 array over the store's memory (no copy). "
          "NotFoundError naming the tensor when the manifest lacks it.")
      .def(
          "verify",
          [](const ReadHandle& h) {
            Status st;
            {
              py::gil_scoped_release unlocked;
              st = h.verify(0, h.plan().num_chunks());
            }
            check(st);
          },
          "Re-hashes every chunk against its checksum; DataLossError naming the first that differs.");

  py::class_<RelayStore, std::shared_ptr<RelayStore>>(m, "RelayStore", R"doc(
The versioned weight store: publish copies a version out of the caller's tensors and returns
without waiting for readers; the version commits once every chunk is checksummed (in the
background). Readers acquire the newest committed version, or pull it with a WeightPuller.)doc")
      .def(py::init([](std::optional<RelayStoreOptions> options) {
             return std::shared_ptr<RelayStore>(unwrap(RelayStore::create(options.value_or(RelayStoreOptions{}))));
           }),
           py::arg("options") = py::none(), "InvalidArgumentError for a bad chunk size or a zero budget.")
      .def(
          "publish",
          [](RelayStore& s, Version v, py::handle tensors) {
            NamedTensors named(tensors, "tensors");
            WeightManifest manifest;
            for (const NamedTensor& t : named.span()) check(manifest.add(t.name, t.view.dtype(), t.view.shape()));
            Status st;
            {
              py::gil_scoped_release unlocked;
              st = s.publish(v, manifest, named.span());
            }
            check(st);
          },
          py::arg("version"), py::arg("tensors"), R"doc(
Publishes version `version` from {name: tensor} (torch tensors or NumPy arrays, through DLPack, read
in place), laid out in the dict's order. Returns once the bytes are copied into the store.
InvalidArgumentError when the version does not increase, the dict is empty, a name is empty, or a
tensor is not dense row-major or has an unsupported dtype; ResourceExhaustedError past the memory
budget.)doc")
      .def(
          "wait_for_version",
          [](const RelayStore& s, Version v, py::handle timeout) {
            Duration d = to_duration(timeout, "timeout");
            Status st;
            {
              py::gil_scoped_release unlocked;
              st = s.wait_for_version(v, d);
            }
            check(st);
          },
          py::arg("version"), py::arg("timeout") = py::none(),
          "Waits until a version >= `version` is committed; DeadlineExceededError after `timeout` seconds "
          "(None: no deadline).")
      .def(
          "newest_version", [](const RelayStore& s) { return optional_version(s.newest_version()); },
          "Newest committed version, or None.")
      .def(
          "acquire",
          [](const RelayStore& s, std::optional<Version> v) { return unwrap(v ? s.acquire(*v) : s.acquire()); },
          py::arg("version") = py::none(),
          "A ReadHandle on `version` (None: the newest committed). NotFoundError when it is not held, "
          "UnavailableError while it is still arriving.")
      .def(
          "stats", [](const RelayStore& s) { return json_to_dict(s.stats().to_json()); },
          "Bytes and versions held, chunks rejected, as a dict.");

  py::class_<LocalRelayServerOptions> local_options(m, "LocalRelayServerOptions",
                                                   "Options of a LocalRelayServer (keywords too).");
  def_kwargs_init(local_options);
  def_uint(local_options, "max_clients", &LocalRelayServerOptions::max_clients, "Connections served at once.");
  def_uint(local_options, "max_leases_per_client", &LocalRelayServerOptions::max_leases_per_client,
           "Leases one connection may hold.");
  def_uint(local_options, "max_client_buffer_bytes", &LocalRelayServerOptions::max_client_buffer_bytes,
           "Replies queued for one client before its requests stop being read.");
  def_seconds(local_options, "idle_timeout", &LocalRelayServerOptions::idle_timeout,
              "An idle connection holding no lease is closed after this long (None: never).");
  local_options.def_readwrite("clock", &LocalRelayServerOptions::clock, "The Clock of idle_timeout.");

  py::class_<LocalRelayEvent> local_event(m, "LocalRelayEvent", "What a LocalRelayServer reports (events()).");
  py::enum_<LocalRelayEvent::Kind>(local_event, "Kind")
      .value("GRANTED", LocalRelayEvent::Kind::kGranted, "a client took a lease on `version`")
      .value("RELEASED", LocalRelayEvent::Kind::kReleased, "a lease ended (`disconnected`: its connection closed)")
      .value("REFUSED", LocalRelayEvent::Kind::kRefused, "a client sent something malformed (`detail`)")
      .value("CLOSED", LocalRelayEvent::Kind::kClosed, "a connection was closed: idle, evicted or turned away");
  local_event.def_readonly("kind", &LocalRelayEvent::kind)
      .def_readonly("version", &LocalRelayEvent::version)
      .def_readonly("client_pid", &LocalRelayEvent::client_pid)
      .def_readonly("disconnected", &LocalRelayEvent::disconnected)
      .def_readonly("detail", &LocalRelayEvent::detail);

  py::class_<LocalRelayServerHolder>(m, "LocalRelayServer", R"doc(
Serves a shareable RelayStore's committed versions to WeightPuller.local in other processes of this
host, over a Unix domain socket: they map a version's memory read-only and copy from it in place.
Runs one thread of its own, which runs no Python: its events wait in a bounded buffer for
events(). Dropping the last reference stops it, drops every lease and removes the socket file.)doc")
      .def(py::init([](std::shared_ptr<RelayStore> store, std::string socket_path,
                       std::optional<LocalRelayServerOptions> options) {
             if (!store) throw_invalid("store must be a RelayStore, not None");
             auto h = std::make_unique<LocalRelayServerHolder>();
             h->events = std::make_shared<EventBuffer<LocalRelayEvent>>();
             LocalRelayServerOptions o = options.value_or(LocalRelayServerOptions{});
             o.on_event = EventBuffer<LocalRelayEvent>::sink(h->events);
             h->server = unwrap(LocalRelayServer::create(std::move(store), std::move(socket_path), std::move(o)));
             return h;
           }),
           py::arg("store"), py::arg("socket_path"), py::arg("options") = py::none(),
           "FailedPreconditionError for a store that is not shareable; AlreadyExistsError when a live server "
           "owns the path; InvalidArgumentError for a bad path or options.")
      .def_property_readonly("socket_path", [](const LocalRelayServerHolder& h) { return h.server->socket_path(); })
      .def(
          "stats", [](const LocalRelayServerHolder& h) { return json_to_dict(h.server->stats().to_json()); },
          "Clients, leases and closed connections, as a dict.")
      .def(
          "events", [](LocalRelayServerHolder& h) { return h.events->drain(); },
          "The events since the last call, oldest first (at most 4096 kept; events_dropped counts the rest).")
      .def_property_readonly("events_dropped", [](const LocalRelayServerHolder& h) { return h.events->dropped(); })
      .def(
          "background_error",
          [](const LocalRelayServerHolder& h) { return status_to_exception(h.server->background_error()); },
          "The failure that stopped the server's thread (an Error, not raised), or None.");

  py::class_<RelayNodeOptions> node_options(m, "RelayNodeOptions", "Options of a RelayNode (keywords too).");
  def_kwargs_init(node_options);
  node_options.def_readwrite("upstreams", &RelayNodeOptions::upstreams,
                             "Relays to subscribe to, \"host:port\", preferred first; empty: the chain's head.");
  def_uint(node_options, "window", &RelayNodeOptions::window, "Chunks in flight to each subscriber.");
  def_seconds(node_options, "connect_timeout", &RelayNodeOptions::connect_timeout,
              "Connecting and subscribing to one upstream.");
  def_seconds(node_options, "retry_interval", &RelayNodeOptions::retry_interval,
              "Pause before trying the upstream list again once every one failed.");
  def_seconds(node_options, "stall_timeout", &RelayNodeOptions::stall_timeout,
              "An upstream or subscriber silent this long is dropped.");
  node_options.def_readwrite("clock", &RelayNodeOptions::clock, "The Clock of every timeout.");

  py::class_<RelayEvent> relay_event(m, "RelayEvent", "What a RelayNode reports (events()).");
  py::enum_<RelayEvent::Kind>(relay_event, "Kind")
      .value("UPSTREAM", RelayEvent::Kind::kUpstream, "subscribed to `upstream`")
      .value("UPSTREAM_LOST", RelayEvent::Kind::kUpstreamLost, "the connection to `upstream` broke")
      .value("UPSTREAM_UNREACHABLE", RelayEvent::Kind::kUpstreamUnreachable, "`upstream` failed; the next is tried")
      .value("COMMITTED", RelayEvent::Kind::kCommitted, "`version` is complete here")
      .value("CHUNK_STORED", RelayEvent::Kind::kChunkStored, "`chunk` of `version` arrived and passed its check")
      .value("CHUNK_REJECTED", RelayEvent::Kind::kChunkRejected, "`chunk` of `version` failed its check")
      .value("UPSTREAM_STALLED", RelayEvent::Kind::kUpstreamStalled, "`upstream` went quiet and was dropped")
      .value("SUBSCRIBER_STALLED", RelayEvent::Kind::kSubscriberStalled, "`subscriber` went quiet and was dropped");
  relay_event.def_readonly("kind", &RelayEvent::kind)
      .def_readonly("version", &RelayEvent::version)
      .def_readonly("chunk", &RelayEvent::chunk)
      .def_readonly("upstream", &RelayEvent::upstream)
      .def_readonly("subscriber", &RelayEvent::subscriber);

  py::class_<RelayNodeHolder>(m, "RelayNode", R"doc(
One relay of the chain that spreads versions across processes and hosts: it serves its RelayStore
to subscribers on the process's Transport (which the host makes listen) and, unless it is the head,
feeds the store from the first upstream that answers, chunk by chunk, checked, failing over and
resuming when one dies or hangs. Its threads run no Python: their events wait in a bounded buffer
for events(). Dropping the last reference removes its handlers.)doc")
      .def(py::init([](std::shared_ptr<Transport> transport, std::shared_ptr<RelayStore> store,
                       std::optional<RelayNodeOptions> options) {
             if (!transport) throw_invalid("transport must be a Transport, not None");
             if (!store) throw_invalid("store must be a RelayStore, not None");
             auto h = std::make_unique<RelayNodeHolder>();
             h->events = std::make_shared<EventBuffer<RelayEvent>>();
             RelayNodeOptions o = options.value_or(RelayNodeOptions{});
             o.on_event = EventBuffer<RelayEvent>::sink(h->events);
             h->node = unwrap(RelayNode::create(std::move(transport), std::move(store), std::move(o)));
             return h;
           }),
           py::arg("transport"), py::arg("store"), py::arg("options") = py::none(),
           "InvalidArgumentError for bad options; AlreadyExistsError when another RelayNode serves on the "
           "transport.")
      .def("address", [](const RelayNodeHolder& h) { return h.node->address(); },
           "Where subscribers reach this node (the transport's listen address), or None.")
      .def("upstream", [](const RelayNodeHolder& h) { return h.node->upstream(); },
           "The upstream it is subscribed to now, or None.")
      .def(
          "stats", [](const RelayNodeHolder& h) { return json_to_dict(h.node->stats().to_json()); },
          "Chunks received, sent and resent, failovers, stalls and subscribers, as a dict.")
      .def(
          "events", [](RelayNodeHolder& h) { return h.events->drain(); },
          "The events since the last call, oldest first (at most 4096 kept; events_dropped counts the rest).")
      .def_property_readonly("events_dropped", [](const RelayNodeHolder& h) { return h.events->dropped(); })
      .def(
          "background_error", [](const RelayNodeHolder& h) { return status_to_exception(h.node->background_error()); },
          "The first failure of its background work (an Error, not raised), or None.");

  py::enum_<PullPolicy>(m, "PullPolicy", "When a WeightPuller may take a newer version.")
      .value("WHEN_IDLE", PullPolicy::kWhenIdle, "pull only with no live trajectory (one version each)")
      .value("PREFETCH_THEN_SWAP", PullPolicy::kPrefetchThenSwap,
             "fetch while generating, swap in when idle");
  py::enum_<PullAction>(m, "PullAction", "What WeightPuller.next_action says to do.")
      .value("NONE", PullAction::kNone)
      .value("PULL", PullAction::kPull)
      .value("PREFETCH", PullAction::kPrefetch)
      .value("SWAP", PullAction::kSwap);

  py::class_<WeightPullerOptions> puller_options(m, "WeightPullerOptions",
                                                 "Options of a WeightPuller (keywords too).");
  def_kwargs_init(puller_options);
  puller_options.def_readwrite("policy", &WeightPullerOptions::policy);
  puller_options.def_readwrite("verify_checksums", &WeightPullerOptions::verify_checksums,
                               "Re-hash every chunk a pull reads before copying it out.");
  def_uint(puller_options, "copy_chunk_bytes", &WeightPullerOptions::copy_chunk_bytes,
           "Granularity of copies and of cancel / resume (>= 4096).");
  def_seconds(puller_options, "relay_timeout", &WeightPullerOptions::relay_timeout,
              "How long one answer from a local relay may take.");
  puller_options.def_readwrite("clock", &WeightPullerOptions::clock, "The Clock of relay_timeout.");

  py::class_<WeightPuller>(m, "WeightPuller", R"doc(
The rollout side of the relay tier: takes the newest version when the worker has no live
trajectory, copying it straight from the relay's memory into the engine's tensors (in place,
through DLPack). One thread at a time uses a puller, except cancel(). pull, prefetch and swap
release the GIL.)doc")
      .def(py::init([](std::shared_ptr<RelayStore> relay, std::optional<WeightPullerOptions> options) {
             if (!relay) throw_invalid("relay must be a RelayStore, not None");
             return unwrap(WeightPuller::create(std::move(relay), options.value_or(WeightPullerOptions{})));
           }),
           py::arg("relay"), py::arg("options") = py::none(),
           "Pulls from a RelayStore in this process. InvalidArgumentError for bad options.")
      .def_static(
          "local",
          [](std::vector<std::string> socket_paths, std::optional<WeightPullerOptions> options) {
            return unwrap(WeightPuller::create_local(std::move(socket_paths), options.value_or(WeightPullerOptions{})));
          },
          py::arg("socket_paths"), py::arg("options") = py::none(),
          "Pulls from the LocalRelayServers at these socket paths, the first that answers, in order (connecting "
          "on first use). InvalidArgumentError for an empty list or a path too long for a socket.")
      .def("relay", &WeightPuller::relay, "Where requests go now: \"this process\" or a local relay's socket path.")
      .def(
          "newest_version",
          [](const WeightPuller& p) {
            std::optional<Version> v;
            {
              // A local relay is asked over its socket.
              py::gil_scoped_release unlocked;
              v = p.newest_version();
            }
            return optional_version(v);
          },
          "Newest version the relay has committed, or None (also when no local relay answers).")
      .def("current_version", [](const WeightPuller& p) { return optional_version(p.current_version()); },
           "Version the destinations hold after the last pull or swap, or None.")
      .def("prefetched_version", [](const WeightPuller& p) { return optional_version(p.prefetched_version()); },
           "Version reserved by prefetch and not swapped in yet, or None.")
      .def(
          "next_action",
          [](const WeightPuller& p, bool has_live_trajectory) {
            PullDecision d;
            {
              py::gil_scoped_release unlocked;
              d = p.next_action(has_live_trajectory);
            }
            return py::make_tuple(d.action, d.action == PullAction::kNone ? py::none() : py::cast(d.version));
          },
          py::arg("has_live_trajectory"),
          "(PullAction, version or None): what to do next. Never PULL or SWAP with a live trajectory.")
      .def(
          "pull",
          [](WeightPuller& p, Version v, py::handle destinations, bool has_live_trajectory) {
            NamedTensors named(destinations, "destinations");
            Status st;
            {
              py::gil_scoped_release unlocked;
              st = p.pull(v, named.span(), has_live_trajectory);
            }
            check(st);
          },
          py::arg("version"), py::arg("destinations"), py::arg("has_live_trajectory") = false, R"doc(
Copies version `version`'s tensors named by {name: tensor} into those tensors, in place.
FailedPreconditionError with a live trajectory; NotFoundError for a version or tensor name the relay
lacks (UnavailableError while the version arrives); InvalidArgumentError for a tensor whose dtype or
shape differs from the manifest's, or that is not dense; DataLossError when verify_checksums finds a
bad chunk; CancelledError when cancel() stopped it (pulling again resumes).)doc")
      .def(
          "prefetch",
          [](WeightPuller& p, Version v) {
            Status st;
            {
              py::gil_scoped_release unlocked;
              st = p.prefetch(v);
            }
            check(st);
          },
          py::arg("version"),
          "Reserves `version` for a later swap (PREFETCH_THEN_SWAP only: FailedPreconditionError otherwise).")
      .def(
          "swap",
          [](WeightPuller& p, py::handle destinations, bool has_live_trajectory) {
            NamedTensors named(destinations, "destinations");
            Status st;
            {
              py::gil_scoped_release unlocked;
              st = p.swap(named.span(), has_live_trajectory);
            }
            check(st);
          },
          py::arg("destinations"), py::arg("has_live_trajectory") = false,
          "Copies the prefetched version into the destinations; errors as pull.")
      .def("cancel", &WeightPuller::cancel,
           "Stops a pull running on another thread at its next chunk; the one call that may run concurrently.")
      .def(
          "stopped_pull",
          [](const WeightPuller& p) -> py::object {
            std::optional<WeightPuller::StoppedPull> s = p.stopped_pull();
            if (!s) return py::none();
            return py::make_tuple(s->version, s->bytes_done);
          },
          "(version, bytes_done) of the last cancelled pull until a pull completes, or None.");
}

}  // namespace laminar::python
