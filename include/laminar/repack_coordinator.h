// repack_coordinator.h: RepackCoordinator, which turns the rollout fleet's reports into repack
// plans (plan_repack) and sends each source worker its part.
//
// One per fleet, on a process's shared Transport (the trainer's, say), which must listen: every
// rollout worker's RepackDriver connects to it and reports its WorkerSnapshot and its KvMigrator's
// address when they change, and the same report again as a keep-alive when they do not. The
// coordinator keeps each worker's newest report and plans on events, never on a timer: when a
// report changes what a plan reads (a new worker, a changed snapshot, a worker back from sitting
// out or from being stale), when told of a newer published version, and when the count of waiting
// prompts changes. Events that come faster than min_plan_interval are served by one plan, that
// long after the last; with no event there is no plan. Each plan sends each source worker its
// orders: the moves whose `from` is that worker, grouped by destination with each destination's
// migrator address. Workers carry the orders out themselves
// (KvMigrator, driven by RepackDriver); the coordinator moves nothing and hears no outcome but
// the workers' later reports.
//
// Left out of a plan, neither source nor destination:
//   - a worker whose newest report is older than stale_after (its process may be gone);
//   - a worker whose report says one of its migrations runs (its numbers are about to change);
//   - a worker named in a plan (either way) since its newest report: it sits out until it reports
//     again (a new report: a keep-alive is the old one), so no plan double-books a destination or
//     orders a source twice from one report;
//   - a worker on a version newer than the newest the coordinator knows;
//   - both workers when two report one sequence (a migration committed between their reports).
// Plans are independent: a sequence that arrived in one may move again in a later one, when the
// tails it joined have thinned out and moving them all frees its new worker too (the cost-aware
// strategy weighs its bytes again each time).
// Reports are checked when they arrive (the wire's bounds, then plan_repack's preconditions for
// that one worker) and refused whole; so a bad report leaves out only its worker, never the plan.
//
// The scheduler's queue. Under the cost-aware policy's only_for_waiting_prompts rule (both
// defaults), a plan frees workers only while prompts wait for them: an emptied worker with no
// prompt to start gains nothing, and the sequences it sheds slow the workers that take them. Only
// the host knows its queue, so it tells the coordinator with set_prompts_waiting() whenever the
// queue changes; a new count plans, and every plan reads the newest count. Until the first call the
// count is not known and the rule stays off: plans free every worker that fits.
//
// Threads. The coordinator's own thread makes the plans and sends the orders (one-way sends, at
// most send_timeout each). Reports are taken on the transport's callback thread. Every method is
// thread-safe.
//
//   laminar::RepackCoordinatorOptions opt;
//   opt.tokens_per_page = 16;
//   auto coordinator = laminar::RepackCoordinator::create(transport, opt).value();
//   // on every trainer update:
//   (void)coordinator->set_newest_version(published);        // plans at once
//   // whenever the scheduler's queue changes:
//   (void)coordinator->set_prompts_waiting(queue_size);       // plans, read by every later plan
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "laminar/clock.h"
#include "laminar/repack_policy.h"
#include "laminar/status.h"
#include "laminar/transport.h"
#include "laminar/types.h"

namespace laminar {

struct RepackCoordinatorOptions {
  // Page size of every worker's KV cache (positive).
  std::int32_t tokens_per_page = 0;
  // The least time between two plans (zero: none), which bounds the planning CPU when reports,
  // versions and prompt counts come fast: what arrives meanwhile waits for one plan.
  Duration min_plan_interval = std::chrono::milliseconds(10);
  // A worker whose newest report (keep-alives included) is older than this is left out of plans
  // (positive): a few of the drivers' keepalive_interval.
  Duration stale_after = std::chrono::seconds(15);
  // Workers whose reports are kept (positive). A report from one more is refused, unless the
  // stalest kept report is stale: that one is forgotten.
  std::uint32_t max_workers = 1024;
  // One orders message's send (positive, or kForever).
  Duration send_timeout = std::chrono::seconds(1);
  // What plan_repack is given (checked by create()).
  RepackPolicyOptions policy;
  // Time of plan spacing and staleness (null: Clock::steady()).
  std::shared_ptr<Clock> clock;
};

struct RepackCoordinatorStats {
  std::uint64_t reports = 0;           // reports taken, keep-alives not counted
  std::uint64_t keepalives = 0;        // a worker's kept report again, on its connection
  std::uint64_t reports_refused = 0;   // malformed, invalid, older than the kept one, or no room
  std::uint64_t workers = 0;           // workers whose report is kept now
  std::uint64_t plans = 0;             // plans made
  std::uint64_t plans_failed = 0;      // plans plan_repack refused (background_error() has the first)
  std::uint64_t planned_workers = 0;   // workers in the last plan's fleet
  std::uint64_t left_out = 0;          // workers with a kept report left out of the last plan
  std::uint64_t moves = 0;             // moves ordered, over all plans
  std::uint64_t workers_freed = 0;     // freed workers, over all plans
  std::uint64_t orders_sent = 0;       // orders messages sent
  std::uint64_t orders_failed = 0;     // orders messages that could not be sent (worker gone)
  std::optional<std::int64_t> prompts_waiting;  // what the last plan was given (nullopt: not known)

  std::string to_json() const;
};

class RepackCoordinator {
 public:
  // Installs the report handler on `transport` and starts the planning thread. kInvalidArgument
  // for a null transport, non-positive tokens_per_page, stale_after or send_timeout, negative
  // min_plan_interval, zero max_workers, or policy options plan_repack refuses; kAlreadyExists
  // when another coordinator serves on `transport`.
  static Result<std::unique_ptr<RepackCoordinator>> create(std::shared_ptr<Transport> transport,
                                                           RepackCoordinatorOptions options);
  // Removes the handler (waiting for a call in progress) and stops the thread.
  ~RepackCoordinator();
  RepackCoordinator(const RepackCoordinator&) = delete;
  RepackCoordinator& operator=(const RepackCoordinator&) = delete;

  // The newest version the relays publish (at first 0). A newer one plans at once; the same one
  // does nothing. kInvalidArgument for an older one: published versions only increase.
  Status set_newest_version(Version v);
  Version newest_version() const;

  // How many prompts wait for a worker, none holding them yet (the scheduler's queue, counted in
  // sequences: each takes one batch slot); every later plan's FleetSnapshot::prompts_waiting.
  // kInvalidArgument outside [0, 2^40]. A new count plans (no sooner than min_plan_interval after
  // the last plan: the queue moves with every prompt handed out); the same count does nothing. It
  // takes only the coordinator's own lock and calls nothing, so a scheduler may call it holding
  // its own.
  Status set_prompts_waiting(std::int64_t n);
  // The newest count set; nullopt before the first set_prompts_waiting().
  std::optional<std::int64_t> prompts_waiting() const;

  RepackCoordinatorStats stats() const;
  // The first plan plan_repack refused (a fleet the per-report checks let through: a bug of ours);
  // OK otherwise.
  Status background_error() const;

 private:
  struct Impl;
  explicit RepackCoordinator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace laminar
