// repack_driver.h: RepackDriver, the worker side of repacking: what a rollout loop calls between
// decode steps to report its snapshot to the fleet's RepackCoordinator, take its part of a plan
// and run the migrations in and out.
//
// One per rollout worker, wrapping that worker's KvMigrator (on the same Transport, which must
// listen: destinations are reached at the migrator's address). step() does three things:
//   1. orders that arrived since the last step become migrations: one KvMigrator::migrate() per
//      destination with all of its sequences, less those no longer live (not in the snapshot) or
//      already moving. Orders for a version other than the snapshot's are dropped. Orders planned
//      from an older report are still taken: what they name is checked against this step's
//      snapshot, and a destination refuses what no longer fits (dropping them instead starves a
//      worker whose reports go out faster than a plan comes back). Orders come only from the
//      coordinator's connection; anything else on that message type is refused.
//   2. when the snapshot changed in a way a plan can use since the last report, the snapshot, the
//      migrator's address and whether a migration runs go to the coordinator: one-way, and never
//      waited for (the driver's thread sends, at most one report every min_report_interval; a
//      report not sent yet is replaced by the newer one). A change is any of: the version,
//      pages_total or pages_used, slots_total or slots_used, waiting_prompts, kv_stopped_growing,
//      whether a migration runs, the set of live sequences, a sequence's pages, a sequence's
//      expected_remaining_tokens appearing, going, reaching zero or moving by more than a quarter
//      of its reported value, or step_time doubling or halving. Tokens within a page and step-time
//      jitter are not: a decode loop that steps without such a change sends nothing. A snapshot with
//      live sequences but no step time yet (before the worker's first decode step) is held back,
//      since plan_repack refuses it; the next changed step's snapshot goes instead. The first
//      step() keepalive_interval after the last report with nothing new sends that report again,
//      same number and all (a keep-alive), so that the coordinator's stale_after does not drop a
//      quiet worker; a loop that stops calling step() goes stale, as it should, and one that
//      waits (wait_event, or its own wait bounded by poll_deadline()) steps at least that often;
//   3. the migrator is polled, and its events are returned to the loop, which acts on them as
//      KvMigrator's header describes (MigrationHost does it for a host's engine).
// A loop with nothing to decode waits with wait_event() until step() has something to do, instead
// of calling it in a spin.
//
// Threads. step() and wait_event() run on the host's decode loop (the one that owns the cache and
// calls the migrator); stats() and background_error() are thread-safe. The driver's own thread
// connects to the coordinator (retrying every retry_interval) and sends the reports. Orders are
// taken on the transport's callback thread and wait, the newest only, for the next step(). The
// driver holds the migrator's notify hook (KvMigrator::set_notify) while it lives.
//
//   laminar::RepackDriverOptions opt{.worker = id, .coordinator = "10.0.0.1:7000"};
//   auto driver = laminar::RepackDriver::create(transport, migrator, opt).value();
//   for (;;) {                                                     // the decode loop
//     laminar::Result<std::vector<laminar::MigrationEvent>> events = driver->step(snapshot_now());
//     if (events.ok()) for (laminar::MigrationEvent& e : *events) (void)host.handle(e);
//     if (nothing_to_decode()) (void)driver->wait_event(std::chrono::milliseconds(100));
//     else decode_one_step();
//   }
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "laminar/clock.h"
#include "laminar/kv_migrator.h"
#include "laminar/repack_policy.h"
#include "laminar/status.h"
#include "laminar/transport.h"
#include "laminar/types.h"

namespace laminar {

struct RepackDriverOptions {
  // This worker: every snapshot's id.
  WorkerId worker;
  // "host:port" of the coordinator's transport.
  std::string coordinator;
  // The least time between two reports (positive): a snapshot that changes faster is reported at
  // this rate, its newest state each time.
  Duration min_report_interval = std::chrono::milliseconds(100);
  // With no change, the first step() this long after the last report sends it again (positive).
  // Below the coordinator's stale_after, which leaves out a worker it has not heard from for that
  // long: a third of it lets two keep-alives go astray.
  Duration keepalive_interval = std::chrono::seconds(5);
  // Connecting to the coordinator, and the wait before trying again after a failure (positive).
  Duration connect_timeout = std::chrono::seconds(5);
  Duration retry_interval = std::chrono::seconds(1);
  // One report's send (positive, or kForever).
  Duration send_timeout = std::chrono::seconds(1);
  // Time of report intervals and retries (null: Clock::steady()).
  std::shared_ptr<Clock> clock;
};

struct RepackDriverStats {
  std::uint64_t reports_sent = 0;        // reports of a changed snapshot
  std::uint64_t keepalives_sent = 0;     // the last report sent again, nothing having changed
  std::uint64_t reports_held = 0;        // changed, but the snapshot had live sequences and step_time 0
  std::uint64_t reports_failed = 0;      // sends that failed (the connection is then made again)
  std::uint64_t connects_failed = 0;
  std::uint64_t orders = 0;              // orders taken by step()
  std::uint64_t orders_refused = 0;      // malformed, or not from the coordinator's connection
  std::uint64_t orders_dropped = 0;      // for another version, or replaced by newer orders before a
                                         //   step took them
  std::uint64_t migrations_started = 0;  // migrate() calls that succeeded
  std::uint64_t migrations_refused = 0;  // migrate() calls that failed (their sequences stay here)
  std::uint64_t sequences_skipped = 0;   // ordered sequences no longer live, or already moving
  std::uint64_t reports_queued = 0;      // now: 1 while a report waits for min_report_interval or
                                         //   a connection, or is being sent; else 0

  std::string to_json() const;
};

class RepackDriver {
 public:
  // Installs the orders handler and starts the reporting thread (which connects on its own; create
  // does not wait for the coordinator). kInvalidArgument for a null transport or migrator, an
  // empty coordinator address, non-positive min_report_interval, keepalive_interval,
  // connect_timeout, retry_interval or send_timeout; kFailedPrecondition when the migrator has no address (its transport does not
  // listen) or one longer than 256 bytes; kAlreadyExists when another driver serves on
  // `transport`.
  static Result<std::unique_ptr<RepackDriver>> create(std::shared_ptr<Transport> transport,
                                                      std::shared_ptr<KvMigrator> migrator,
                                                      RepackDriverOptions options);
  // Removes the handler (waiting for a call in progress), closes the connection to the coordinator
  // and stops the thread (after a connect in progress: at most connect_timeout). Migrations keep
  // running in the migrator.
  ~RepackDriver();
  RepackDriver(const RepackDriver&) = delete;
  RepackDriver& operator=(const RepackDriver&) = delete;

  // Preconditions:
  //   `snapshot` is this worker's now: every live sequence, with the migrator's version;
  //   the caller is the decode loop (see Threads).
  // Starts ordered migrations, hands the snapshot to the reporting thread when it changed (see
  // above), and returns the migrator's events. May block while the migrator connects to a destination it has no connection to yet
  // (KvMigratorOptions::connect_timeout). kInvalidArgument for a snapshot of more than 1,024
  // sequences or of another worker than options.worker; kFailedPrecondition for a version other
  // than the migrator's. Nothing is started, sent or polled then.
  Result<std::vector<MigrationEvent>> step(const WorkerSnapshot& snapshot);

  // Preconditions:
  //   the caller is the decode loop;
  //   the driver's clock is the migrator's (poll_deadline() is read on it).
  // Blocks until step() has something to do: orders arrived, the migrator may have events (its
  // notify ran since the last step(), or its poll_deadline() came), or a keep-alive is due; true
  // then. False once
  // `timeout` passed on the driver's clock (a ManualClock's jump wakes it). Sends nothing itself:
  // reports go from the driver's thread, keep-alives from step().
  bool wait_event(Duration timeout);
  // For a host that waits for several things at once on its own condition variable (the
  // dispatcher's answer, say): `notify` runs each time orders arrive or the migrator may have
  // events, on whichever thread learnt it, so it must only wake a waiter, never call the driver.
  // Such a waiter also wakes by poll_deadline(), which includes the next keep-alive: an idle
  // worker (a destination for others' sequences) stays in plans while its loop waits. Replaces
  // the previous hook (empty: none); once this returns the previous one is not running.
  void set_notify(std::function<void()> notify);
  // Precondition: the caller is the decode loop.
  // The instant (on the driver's clock) by which step() should run even if no notify comes: the
  // migrator's poll_deadline(), or the next keep-alive's if that is sooner.
  Duration poll_deadline() const;

  RepackDriverStats stats() const;
  // The first failure of the reporting thread that retrying cannot mend: a coordinator address
  // that does not parse (kInvalidArgument) or a coordinator that refuses this worker's cluster
  // token (kFailedPrecondition). The thread keeps retrying meanwhile, so a coordinator restarted
  // with the right token is still reached. OK otherwise: a coordinator that is not up yet, a lost
  // connection or a failed send is retried, and counted in stats().
  Status background_error() const;

 private:
  struct Impl;
  explicit RepackDriver(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace laminar
