// Repack: plan_repack, the pure decision of which live sequences move where over a snapshot of the
// fleet built in Python, and the RepackCoordinator and RepackDriver that carry plans out.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "laminar/repack_coordinator.h"
#include "laminar/repack_driver.h"
#include "laminar/repack_policy.h"

namespace laminar::python {

void bind_repack(py::module_& m) {
  py::class_<SequenceSnapshot> sequence_class(m, "SequenceSnapshot",
                                        "One live sequence of a rollout worker (keywords too).");
  def_kwargs_init(sequence_class);
  sequence_class.def_readwrite("id", &SequenceSnapshot::id, "Sequence id (int), unique in the fleet.")
      .def_readwrite("tokens", &SequenceSnapshot::tokens, "Tokens in its KV so far (prompt and generated).")
      .def_readwrite("pages", &SequenceSnapshot::pages, "KV pages it holds.")
      .def_readwrite("expected_remaining_tokens", &SequenceSnapshot::expected_remaining_tokens,
                     "The engine's guess of the tokens it has left, or None.");

  py::class_<WorkerSnapshot> worker_class(m, "WorkerSnapshot", R"doc(
One rollout worker as the policy sees it (keywords too). `sequences` is a list read and assigned
whole: appending to the list it returns changes a copy.)doc");
  def_kwargs_init(worker_class);
  worker_class.def_readwrite("id", &WorkerSnapshot::id, "Worker id (int).")
      .def_readwrite("version", &WorkerSnapshot::version, "The weights it decodes with.")
      .def_readwrite("sequences", &WorkerSnapshot::sequences, "Every live sequence it holds.")
      .def_readwrite("pages_total", &WorkerSnapshot::pages_total, "KV pages of its cache.")
      .def_readwrite("pages_used", &WorkerSnapshot::pages_used, "Every page in use.")
      .def_readwrite("slots_total", &WorkerSnapshot::slots_total, "Most sequences one decode batch holds.")
      .def_readwrite("slots_used", &WorkerSnapshot::slots_used, "Slots in use (sequences, and prompts in prefill).")
      .def_readwrite("waiting_prompts", &WorkerSnapshot::waiting_prompts, "Prompts queued for it.")
      .def_readwrite("kv_stopped_growing", &WorkerSnapshot::kv_stopped_growing,
                     "pages_used has not risen over its recent steps.");
  def_seconds(worker_class, "step_time", &WorkerSnapshot::step_time,
              "Recent decode step time, seconds; positive when it holds a sequence.");

  py::class_<FleetSnapshot> fleet_class(m, "FleetSnapshot", "Every rollout worker (keywords too).");
  def_kwargs_init(fleet_class);
  fleet_class.def_readwrite("tokens_per_page", &FleetSnapshot::tokens_per_page, "Page size of every worker's KV cache.")
      .def_readwrite("workers", &FleetSnapshot::workers, "The workers, a list read and assigned whole.")
      .def_readwrite("prompts_waiting", &FleetSnapshot::prompts_waiting,
                     "Prompts only a newest-version worker may start, none held yet; None: not known.");

  py::enum_<RepackStrategy>(m, "RepackStrategy", "Which rule plans the moves.")
      .value("PAPER_BEST_FIT", RepackStrategy::kPaperBestFit, "the Laminar paper's rule")
      .value("COST_AWARE", RepackStrategy::kCostAware,
             "the paper's rule plus expected lengths, move cost and decode slowdown");

  py::class_<RepackPolicyOptions> options_class(m, "RepackPolicyOptions",
                                          "Options of plan_repack (keywords too); see repack_policy.h.");
  def_kwargs_init(options_class);
  options_class.def_readwrite("strategy", &RepackPolicyOptions::strategy)
      .def_readwrite("growth_horizon_steps", &RepackPolicyOptions::growth_horizon_steps,
                     "Decode steps of KV growth a destination keeps room for.")
      .def_readwrite("page_bytes", &RepackPolicyOptions::page_bytes, "Bytes of one KV page, all layers.")
      .def_readwrite("link_bytes_per_s", &RepackPolicyOptions::link_bytes_per_s, "What one worker sends.")
      .def_readwrite("step_seconds_per_token", &RepackPolicyOptions::step_seconds_per_token,
                     "Decode step time per token in the batch, or None to estimate it.")
      .def_readwrite("max_tail_growth", &RepackPolicyOptions::max_tail_growth,
                     "How much longer the version's tail may get.")
      .def_readwrite("default_remaining_ratio", &RepackPolicyOptions::default_remaining_ratio,
                     "Remaining tokens guessed per token so far when a sequence has no estimate.")
      .def_readwrite("max_step_slowdown", &RepackPolicyOptions::max_step_slowdown,
                     "How much slower a destination's step may get than one reading no KV.")
      .def_readwrite("only_for_waiting_prompts", &RepackPolicyOptions::only_for_waiting_prompts,
                     "Free workers only while FleetSnapshot.prompts_waiting outnumbers free slots.");
  def_seconds(options_class, "move_overhead", &RepackPolicyOptions::move_overhead, "Fixed cost of each move.");
  def_seconds(options_class, "min_gain", &RepackPolicyOptions::min_gain, "A freed worker must gain at least this.");

  py::class_<Move>(m, "Move", "One sequence to migrate.")
      .def_readonly("sequence", &Move::sequence)
      .def_property_readonly("from_worker", [](const Move& mv) { return mv.from; }, "The source worker.")
      .def_property_readonly("to_worker", [](const Move& mv) { return mv.to; }, "The destination worker.")
      .def_readonly("pages", &Move::pages, "Pages the migrator copies.");

  py::class_<FreedWorker>(m, "FreedWorker", "A worker the plan empties, so it can pull the newest version.")
      .def_readonly("worker", &FreedWorker::worker)
      .def_property_readonly("busy_left", [](const FreedWorker& f) { return from_duration(f.busy_left); },
                             "Seconds it was expected to stay busy without the plan.")
      .def_property_readonly("move_time", [](const FreedWorker& f) { return from_duration(f.move_time); },
                             "Seconds of sending its pages, plus move_overhead per sequence.")
      .def_property_readonly("gain", [](const FreedWorker& f) { return from_duration(f.gain); }, "Seconds gained.");

  py::class_<MigrationPlan>(m, "MigrationPlan", "What plan_repack decided.")
      .def_readonly("moves", &MigrationPlan::moves)
      .def_readonly("freed", &MigrationPlan::freed)
      .def_readonly("pages_moved", &MigrationPlan::pages_moved)
      .def_property_readonly("gain", [](const MigrationPlan& p) { return from_duration(p.gain); },
                             "Seconds: the sum of the freed workers' gains.")
      .def_readonly("tail_growth", &MigrationPlan::tail_growth);

  m.def(
      "plan_repack",
      [](const FleetSnapshot& fleet, Version newest, std::optional<RepackPolicyOptions> options) {
        std::optional<Result<MigrationPlan>> plan;
        {
          py::gil_scoped_release unlocked;
          plan.emplace(plan_repack(fleet, newest, options.value_or(RepackPolicyOptions{})));
        }
        return unwrap(std::move(*plan));
      },
      py::arg("fleet"), py::arg("newest"), py::arg("options") = py::none(), R"doc(
Which live sequences move where so that whole workers of older versions empty out and can pull
`newest`. A pure function: never mixes versions, never overfills a worker, never moves a sequence
twice, never moves onto a worker it empties. InvalidArgumentError names the worker, sequence or
option that is wrong.)doc");

  py::class_<RepackCoordinatorOptions> coordinator_options(m, "RepackCoordinatorOptions",
                                                           "Options of a RepackCoordinator (keywords too).");
  def_kwargs_init(coordinator_options);
  coordinator_options.def_readwrite("tokens_per_page", &RepackCoordinatorOptions::tokens_per_page,
                                    "Page size of every worker's KV cache.")
      .def_readwrite("policy", &RepackCoordinatorOptions::policy, "The plan_repack options it plans with.")
      .def_readwrite("clock", &RepackCoordinatorOptions::clock, "The Clock of plan spacing and staleness.");
  def_seconds(coordinator_options, "min_plan_interval", &RepackCoordinatorOptions::min_plan_interval,
              "The least time between two plans (0: none).");
  def_seconds(coordinator_options, "stale_after", &RepackCoordinatorOptions::stale_after,
              "A worker whose last report is older is left out of plans.");
  def_uint(coordinator_options, "max_workers", &RepackCoordinatorOptions::max_workers, "Workers it keeps reports of.");
  def_seconds(coordinator_options, "send_timeout", &RepackCoordinatorOptions::send_timeout, "One order's send.");

  py::class_<RepackCoordinator>(m, "RepackCoordinator", R"doc(
Plans repacks for the fleet: takes every RepackDriver's reports on its transport, plans on events
(a changed report, a newer version, a new count of waiting prompts), never on a timer, and sends
each source its moves. Its thread runs no Python.)doc")
      .def(py::init([](std::shared_ptr<Transport> transport, std::optional<RepackCoordinatorOptions> options) {
             if (!transport) throw_invalid("transport must be a Transport, not None");
             return unwrap(RepackCoordinator::create(std::move(transport), options.value_or(RepackCoordinatorOptions{})));
           }),
           py::arg("transport"), py::arg("options") = py::none(),
           "InvalidArgumentError for bad options (tokens_per_page must be set); AlreadyExistsError when "
           "another coordinator serves the transport.")
      .def(
          "set_newest_version",
          [](RepackCoordinator& c, Version v) {
            Status st;
            {
              py::gil_scoped_release unlocked;
              st = c.set_newest_version(v);
            }
            check(st);
          },
          py::arg("version"), "The newest version the relays publish; a newer one plans at once. "
          "InvalidArgumentError for an older one.")
      .def("newest_version", &RepackCoordinator::newest_version)
      .def(
          "set_prompts_waiting",
          [](RepackCoordinator& c, py::handle n) {
            const std::int64_t count = to_int64(n, "n");
            Status st;
            {
              py::gil_scoped_release unlocked;
              st = c.set_prompts_waiting(count);
            }
            check(st);
          },
          py::arg("n"), R"doc(
How many prompts wait for a worker, none holding them yet (the scheduler's queue, one per batch
slot); every later plan reads the newest count. Under the cost-aware policy with
only_for_waiting_prompts (the defaults), plans then free workers only while the prompts outnumber
the newest version's free slots; never set, the count is not known and that rule stays off. Plans
nothing at once. InvalidArgumentError outside [0, 2**40].)doc")
      .def("prompts_waiting", &RepackCoordinator::prompts_waiting,
           "The newest count set_prompts_waiting gave, or None before the first.")
      .def(
          "stats", [](const RepackCoordinator& c) { return json_to_dict(c.stats().to_json()); },
          "Reports, plans, moves, freed workers and orders, as a dict.")
      .def(
          "background_error", [](const RepackCoordinator& c) { return status_to_exception(c.background_error()); },
          "The first plan plan_repack refused (an Error, not raised), or None.");

  py::class_<RepackDriverOptions> driver_options(m, "RepackDriverOptions",
                                                 "Options of a RepackDriver (keywords too).");
  def_kwargs_init(driver_options);
  driver_options.def_readwrite("worker", &RepackDriverOptions::worker, "This worker's id.")
      .def_readwrite("coordinator", &RepackDriverOptions::coordinator, "The coordinator's \"host:port\".")
      .def_readwrite("clock", &RepackDriverOptions::clock, "The Clock of report intervals and retries.");
  def_seconds(driver_options, "min_report_interval", &RepackDriverOptions::min_report_interval,
              "The least time between two reports (a report goes only on change).");
  def_seconds(driver_options, "keepalive_interval", &RepackDriverOptions::keepalive_interval,
              "With no change, step() sends the last report again this long after it.");
  def_seconds(driver_options, "connect_timeout", &RepackDriverOptions::connect_timeout, "Connecting to the coordinator.");
  def_seconds(driver_options, "retry_interval", &RepackDriverOptions::retry_interval, "Between connection attempts.");
  def_seconds(driver_options, "send_timeout", &RepackDriverOptions::send_timeout, "One report's send.");

  py::class_<RepackDriver>(m, "RepackDriver", R"doc(
The worker side of repacking, wrapping its KvMigrator: call step(snapshot) between decode steps. It
starts the moves the coordinator ordered, reports the snapshot when it changes (its own thread
sends, running no Python) and returns the migrator's events, to handle as KvMigrator.poll's.)doc")
      .def(py::init([](std::shared_ptr<Transport> transport, std::shared_ptr<KvMigrator> migrator,
                       const RepackDriverOptions& options) {
             if (!transport) throw_invalid("transport must be a Transport, not None");
             if (!migrator) throw_invalid("migrator must be a KvMigrator, not None");
             return unwrap(RepackDriver::create(std::move(transport), std::move(migrator), options));
           }),
           py::arg("transport"), py::arg("migrator"), py::arg("options"),
           "InvalidArgumentError for bad options (an empty coordinator address, ...).")
      .def(
          "step",
          [](RepackDriver& d, const WorkerSnapshot& snapshot) {
            std::optional<Result<std::vector<MigrationEvent>>> events;
            {
              py::gil_scoped_release unlocked;  // may connect to a destination
              events.emplace(d.step(snapshot));
            }
            return unwrap(std::move(*events));
          },
          py::arg("snapshot"),
          "Starts ordered migrations, reports when due, returns the migrator's events. InvalidArgumentError for "
          "a snapshot of another worker; FailedPreconditionError for a version other than the migrator's.")
      .def(
          "stats", [](const RepackDriver& d) { return json_to_dict(d.stats().to_json()); },
          "Reports, orders and migrations started or refused, as a dict.");
}

}  // namespace laminar::python
