// KvMigrator: live sequences move with their KV pages to another rollout worker. Everything runs
// inside poll() and the other calls, on the caller's thread; events come back as Python objects.
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "laminar/kv_migrator.h"

namespace laminar::python {
namespace {

// What KvMigrator.allocate_cache returns: the cache, its pools' regions for the migrator, and the
// pools lent to Python (each holding the cache, which owns the memory).
struct AllocatedKvCache {
  KvMigrator::AllocatedCache allocated;
  DlpackExport k_pool;
  DlpackExport v_pool;
};

std::shared_ptr<AllocatedKvCache> allocate_cache(const std::shared_ptr<Transport>& transport,
                                                 const std::optional<KvLayout>& layout) {
  if (!transport) throw_invalid("allocate_cache: transport must be a Transport, not None");
  if (!layout) throw_invalid("allocate_cache: layout must be a KvLayout, not None");
  std::optional<Result<KvMigrator::AllocatedCache>> allocated;
  {
    py::gil_scoped_release unlocked;  // zero-fills both pools
    allocated.emplace(KvMigrator::allocate_cache(*transport, *layout));
  }
  KvMigrator::AllocatedCache a = unwrap(std::move(*allocated));
  std::shared_ptr<const void> owner = a.cache;
  DlpackExport k(a.cache->k_pool(), owner, "k_pool");
  DlpackExport v(a.cache->v_pool(), owner, "v_pool");
  return std::make_shared<AllocatedKvCache>(AllocatedKvCache{std::move(a), std::move(k), std::move(v)});
}

// KvMigrator(transport, cache, options): `cache` is a PagedKvCache, or an AllocatedKvCache whose
// regions the migrator then puts into and reads from without registering the pools again.
std::shared_ptr<KvMigrator> make_migrator(std::shared_ptr<Transport> transport, py::handle cache,
                                          std::optional<KvMigratorOptions> options) {
  if (!transport) throw_invalid("transport must be a Transport, not None");
  KvMigratorOptions o = options.value_or(KvMigratorOptions{});
  std::shared_ptr<PagedKvCache> c;
  if (py::isinstance<AllocatedKvCache>(cache)) {
    const auto& a = cache.cast<const AllocatedKvCache&>().allocated;
    c = a.cache;
    o.k_pool_region = a.k_pool;
    o.v_pool_region = a.v_pool;
  } else if (py::isinstance<PagedKvCache>(cache)) {
    c = cache.cast<std::shared_ptr<PagedKvCache>>();
  } else {
    throw_invalid("cache must be a PagedKvCache or what KvMigrator.allocate_cache returned, got " +
                  std::string(py::str(py::type::of(cache).attr("__name__"))));
  }
  return std::shared_ptr<KvMigrator>(unwrap(KvMigrator::create(std::move(transport), std::move(c), std::move(o))));
}

void bind_allocated_cache(py::module_& m) {
  py::class_<DlpackExport>(m, "KvPool", R"doc(
One pool (K or V) of a cache KvMigrator.allocate_cache made, lent through DLPack without a copy:
torch.from_dlpack(pool) and numpy.from_dlpack(pool) give the tensor
[num_layers, num_pages, page_size, num_kv_heads, head_dim] of the layout's dtype over the
transport's own memory (NumPy 1.x marks its import read-only: numpy() is the writable array). Each
tensor keeps the memory alive as long as it lives, after the cache and the migrator are gone.)doc")
      .def("__dlpack__", &DlpackExport::dlpack, py::kw_only(), py::arg("stream") = py::none(),
           py::arg("max_version") = py::none(), py::arg("dl_device") = py::none(), py::arg("copy") = py::none(),
           "A DLPack capsule of the pool (the array API's __dlpack__). stream must be None (host memory); "
           "BufferError for copy=True or a dl_device other than the host's.")
      .def("__dlpack_device__", &DlpackExport::dlpack_device, "(1, 0): host memory.")
      .def("numpy", &DlpackExport::numpy,
           "A writable NumPy array over the pool, no copy (numpy.from_dlpack's is read-only in NumPy 1.x); "
           "it keeps the memory alive too. InvalidArgumentError for bf16, which NumPy has no dtype for.")
      .def_property_readonly("shape", &DlpackExport::shape, "(num_layers, num_pages, page_size, num_kv_heads, head_dim).")
      .def_property_readonly(
          "dtype", [](const DlpackExport& e) { return std::string(dtype_name(e.view().dtype())); },
          "\"f32\", \"f16\" or \"bf16\".");

  py::class_<AllocatedKvCache, std::shared_ptr<AllocatedKvCache>>(m, "AllocatedKvCache", R"doc(
A PagedKvCache whose pools the transport allocated (KvMigrator.allocate_cache): give it to
KvMigrator in place of the cache, and peers put pages straight into its pools. Python reads and
writes the pools through k_pool and v_pool (torch.from_dlpack(k_pool), k_pool.numpy()), without a
copy.)doc")
      .def_property_readonly(
          "cache", [](const AllocatedKvCache& a) { return a.allocated.cache; },
          "The PagedKvCache: sequences, pages and token slots.")
      .def_property_readonly(
          "layout", [](const AllocatedKvCache& a) { return a.allocated.cache->layout(); })
      .def_property_readonly(
          "k_pool", [](const AllocatedKvCache& a) { return a.k_pool; }, "The K pool, lent through DLPack.")
      .def_property_readonly(
          "v_pool", [](const AllocatedKvCache& a) { return a.v_pool; }, "The V pool, lent through DLPack.");
}

}  // namespace

void bind_kv_migrator(py::module_& m) {
  py::class_<SequenceState> state_class(m, "SequenceState", R"doc(
What a sequence's decoding resumes from on the destination (keywords too): the host fills it when
the source pauses the sequence (KvMigrator.finish) and gets it back in an ARRIVED event. Token and
log-prob fields take lists or 1-D arrays and read back as NumPy arrays, as in Trajectory.)doc");
  def_kwargs_init(state_class);
  state_class.def_readwrite("sequence", &SequenceState::sequence)
      .def_readwrite("trajectory", &SequenceState::trajectory)
      .def_readwrite("prompt_id", &SequenceState::prompt_id)
      .def_readwrite("group_id", &SequenceState::group_id)
      .def_readwrite("group_size", &SequenceState::group_size)
      .def_readwrite("sample_index", &SequenceState::sample_index)
      .def_readwrite("version", &SequenceState::version)
      .def_readwrite("temperature", &SequenceState::temperature)
      .def_readwrite("top_p", &SequenceState::top_p)
      .def_readwrite("top_k", &SequenceState::top_k)
      .def_readwrite("seed", &SequenceState::seed)
      .def_readwrite("rng_position", &SequenceState::rng_position)
      .def_readwrite("kv_length", &SequenceState::kv_length, "Tokens whose K and V are in the pages.")
      .def_property(
          "prompt_tokens", [](const SequenceState& s) { return to_numpy<std::int32_t>(s.prompt_tokens); },
          [](SequenceState& s, py::handle v) { s.prompt_tokens = to_int32_vector(v, "prompt_tokens"); })
      .def_property(
          "response_tokens", [](const SequenceState& s) { return to_numpy<std::int32_t>(s.response_tokens); },
          [](SequenceState& s, py::handle v) { s.response_tokens = to_int32_vector(v, "response_tokens"); })
      .def_property(
          "logprobs", [](const SequenceState& s) { return to_numpy<float>(s.logprobs); },
          [](SequenceState& s, py::handle v) { s.logprobs = to_float_vector(v, "logprobs"); })
      .def_property(
          "engine_state", [](const SequenceState& s) { return py::bytes(s.engine_state); },
          [](SequenceState& s, const py::bytes& v) { s.engine_state = std::string(v); },
          "Opaque to laminar (bytes), at most 1 MiB.")
      .def("__eq__", [](const SequenceState& a, const SequenceState& b) { return a == b; }, py::is_operator());

  py::enum_<MigrationState>(m, "MigrationState", "Where a migration stands, as either side sees it.")
      .value("RUNNING", MigrationState::kRunning)
      .value("ABORTED_BY_SOURCE", MigrationState::kAbortedBySource)
      .value("ABORTED_BY_DESTINATION", MigrationState::kAbortedByDestination)
      .value("DONE", MigrationState::kDone);

  py::class_<MigrationEvent> event_class(m, "MigrationEvent", "What poll() reports.");
  py::enum_<MigrationEvent::Kind>(event_class, "Kind")
      .value("PAUSE_REQUESTED", MigrationEvent::Kind::kPauseRequested,
             "source: stop decoding `sequences` and call finish() with their states")
      .value("DONE", MigrationEvent::Kind::kDone, "source: `sequences` live at the destination now")
      .value("ABORTED", MigrationEvent::Kind::kAborted, "outgoing: resume `sequences`; incoming: nothing arrived")
      .value("ARRIVED", MigrationEvent::Kind::kArrived, "destination: decode `sequences` from `states`");
  event_class.def_readonly("kind", &MigrationEvent::kind)
      .def_readonly("id", &MigrationEvent::id, "Migration id (int).")
      .def_readonly("outgoing", &MigrationEvent::outgoing, "This worker is the migration's source.")
      .def_readonly("state", &MigrationEvent::state)
      .def_readonly("sequences", &MigrationEvent::sequences)
      .def_readonly("states", &MigrationEvent::states, "ARRIVED only, in the order of `sequences`.")
      .def_property_readonly(
          "reason", [](const MigrationEvent& e) { return status_to_exception(e.reason); },
          "ABORTED: why (an Error, not raised); otherwise None.");

  py::class_<KvMigratorOptions> options_class(m, "KvMigratorOptions",
                                              "Options of a KvMigrator (keywords too); durations in seconds.");
  def_kwargs_init(options_class);
  def_seconds(options_class, "lease", &KvMigratorOptions::lease,
              "A destination returns reserved pages after hearing nothing from the source this long.");
  def_seconds(options_class, "stall_timeout", &KvMigratorOptions::stall_timeout,
              "A source aborts when its destination leaves a message unanswered this long.");
  def_seconds(options_class, "connect_timeout", &KvMigratorOptions::connect_timeout, "Connecting to a destination.");
  def_uint(options_class, "max_live_stages", &KvMigratorOptions::max_live_stages,
           "Live stages before the source asks to pause; 0 is the blocking copy.");
  def_uint(options_class, "pause_after_pages", &KvMigratorOptions::pause_after_pages,
           "Pause once a live stage copied at most this many pages per sequence.");
  def_uint(options_class, "growth_pages", &KvMigratorOptions::growth_pages,
           "Pages a sequence may still fill while it is copied.");
  def_uint(options_class, "stage_bytes", &KvMigratorOptions::stage_bytes, "Bytes of pages behind one stage.");
  def_uint(options_class, "max_sequences", &KvMigratorOptions::max_sequences, "Batch slots of this worker.");
  def_uint(options_class, "max_migrations", &KvMigratorOptions::max_migrations, "Migrations at once, each way.");
  options_class.def_readwrite("clock", &KvMigratorOptions::clock, "The Clock of leases and stalls.");

  bind_allocated_cache(m);
  py::class_<KvMigrator, std::shared_ptr<KvMigrator>>(m, "KvMigrator", R"doc(
Moves live sequences with their KV pages to the KvMigrator of another rollout worker holding the
same version: pages are copied while the source keeps decoding, only the last stage pauses the
sequences, every page is checked, and an abort or a lost peer leaves each sequence whole at
exactly one worker. Drive it from the decode loop: poll() between steps and act on its events.
Its pools are the PagedKvCache's, registered with the transport (which must listen to receive), or
those of an AllocatedKvCache, which the transport allocated: on one host, peers put into those
with one memcpy, more than ten times faster than into pools it registers (bench/README.md).)doc")
      .def(py::init(&make_migrator), py::arg("transport"), py::arg("cache"), py::arg("options") = py::none(),
           "cache: a PagedKvCache or an AllocatedKvCache of this transport. InvalidArgumentError for bad "
           "options or an AllocatedKvCache of another transport; AlreadyExistsError when another migrator "
           "serves the transport.")
      .def_static("allocate_cache", &allocate_cache, py::arg("transport"), py::arg("layout"),
                  "A cache whose zero-filled pools `transport` allocates, for a KvMigrator on the same transport. "
                  "InvalidArgumentError naming the field for a bad layout; ResourceExhaustedError when the "
                  "memory is not there.")
      .def("set_version", &KvMigrator::set_version, py::arg("version"),
           "The weights this worker decodes with; migrations only go between workers of one version.")
      .def("version", &KvMigrator::version)
      .def(
          "migrate",
          [](KvMigrator& k, const std::string& destination, const std::vector<SequenceId>& sequences) {
            std::optional<Result<MigrationId>> id;
            {
              py::gil_scoped_release unlocked;  // connects first when not connected
              id.emplace(k.migrate(destination, sequences));
            }
            return unwrap(std::move(*id));
          },
          py::arg("destination"), py::arg("sequences"),
          "Starts moving `sequences` to the migrator at \"host:port\"; the migration's id. NotFoundError for an "
          "id not in the cache, FailedPreconditionError for one already moving, ResourceExhaustedError past "
          "max_migrations, the transport's errors from connecting.")
      .def(
          "poll",
          [](KvMigrator& k) {
            std::vector<MigrationEvent> events;
            {
              py::gil_scoped_release unlocked;
              events = k.poll();
            }
            return events;
          },
          "Advances every migration both ways and returns what happened since the last call, in order. "
          "Never blocks on a peer.")
      .def(
          "finish",
          [](KvMigrator& k, MigrationId id, std::vector<SequenceState> states) {
            Status st;
            {
              py::gil_scoped_release unlocked;
              st = k.finish(id, std::move(states));
            }
            check(st);
          },
          py::arg("id"), py::arg("states"),
          "After PAUSE_REQUESTED: the paused sequences' states; starts the final stage. InvalidArgumentError "
          "naming the sequence for a missing, repeated or inconsistent state.")
      .def(
          "abort", [](KvMigrator& k, MigrationId id, const std::string& reason) { check(k.abort(id, reason)); },
          py::arg("id"), py::arg("reason"), "Gives a running migration up; its sequences stay or return here.")
      .def("state", [](const KvMigrator& k, MigrationId id) { return unwrap(k.state(id)); }, py::arg("id"))
      .def("moving", &KvMigrator::moving, "Sequences of this worker in outgoing migrations.")
      .def("address", &KvMigrator::address, "Where peers reach this migrator, or None.")
      .def(
          "stats", [](const KvMigrator& k) { return json_to_dict(k.stats().to_json()); },
          "Migrations, pages and bytes moved, checksum failures, as a dict.")
      .def(
          "background_error", [](const KvMigrator& k) { return status_to_exception(k.background_error()); },
          "The first failure of its background work (an Error, not raised), or None.");
}

}  // namespace laminar::python
