#include "laminar/repack_coordinator.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "clock_wait.h"
#include "clocked_thread.h"
#include "laminar/handler_gate.h"
#include "repack_wire.h"
#include "transport/protocol.h"
#include "transport_claim.h"
#include "stats_fields.h"

namespace laminar {
using internal::kRepackOrdersMessage;
using internal::kRepackReportMessage;

namespace {

// A worker's newest report and where to send its orders.
struct Kept {
  internal::RepackReport report;
  Endpoint from;
  Duration received_at{0};
  // The report number the worker was last named in a plan from (0: never).
  std::uint64_t planned_report = 0;
};


// One worker of a plan's fleet, as the orders need it.
struct Planned {
  Endpoint from;
  std::string migrator_address;
  std::uint64_t report = 0;
};

}  // namespace

struct RepackCoordinator::Impl {
  Impl(std::shared_ptr<Transport> t, RepackCoordinatorOptions o)
      : transport(std::move(t)), opt(std::move(o)), clock(internal::clock_or_steady(opt.clock)) {}

  const std::shared_ptr<Transport> transport;
  internal::TransportClaim claim;  // the one of its kind on the transport, until shutdown
  const RepackCoordinatorOptions opt;
  const std::shared_ptr<Clock> clock;

  mutable std::mutex mu;
  // Signalled on a plan requested, on stopping and on every jump of a virtual clock.
  std::condition_variable cv;
  std::map<WorkerId, Kept> workers;
  Version newest{0};
  std::optional<std::int64_t> prompts_waiting;
  bool plan_requested = false;
  std::uint64_t plans = 0;
  RepackCoordinatorStats st;
  Status first_error;
  internal::ClockedThread thread;
  HandlerGate gate;

  bool stale(const Kept& k, Duration now) const { return now - k.received_at > opt.stale_after; }

  void refuse() {
    std::lock_guard l(mu);
    ++st.reports_refused;
  }

  void on_report(const Incoming& in) {
    Result<internal::RepackReport> r = internal::decode_repack_report(in.message.body);
    if (!r.ok()) return refuse();
    // One worker, checked as plan_repack checks every worker of a fleet.
    const FleetSnapshot one{opt.tokens_per_page, {r->snapshot}, std::nullopt};
    if (!plan_repack(one, r->snapshot.version, opt.policy).ok()) return refuse();
    const WorkerId id = r->snapshot.id;
    const Duration now = clock->now();
    std::lock_guard l(mu);
    auto it = workers.find(id);
    if (it != workers.end()) {
      Kept& k = it->second;
      // Same connection: reports come in order. The same number again is a keep-alive when it is
      // the kept report itself; anything else older is a duplicate or a replay. A new connection is
      // the worker restarted, counting from 1 again.
      if (k.from.id() == in.from.id()) {
        if (r->report == k.report.report && *r == k.report) {
          // A stale worker that is heard from again is back in plans.
          if (stale(k, now)) request_plan();
          k.received_at = now;
          ++st.keepalives;
          return;
        }
        if (r->report <= k.report.report) {
          ++st.reports_refused;
          return;
        }
      } else {
        k.planned_report = 0;
      }
      // What a plan reads changed, or the worker comes back into plans: it sat out since one, or
      // was stale.
      internal::RepackReport same = *r;
      same.report = k.report.report;
      if (!(same == k.report) || k.planned_report >= k.report.report || stale(k, now)) request_plan();
      k.report = std::move(*r);
      k.from = in.from;
      k.received_at = now;
      ++st.reports;
      return;
    }
    if (workers.size() >= opt.max_workers) {
      auto oldest = workers.begin();
      for (auto w = workers.begin(); w != workers.end(); ++w) {
        if (w->second.received_at < oldest->second.received_at) oldest = w;
      }
      if (!stale(oldest->second, now)) {
        ++st.reports_refused;
        return;
      }
      workers.erase(oldest);
    }
    workers.emplace(id, Kept{std::move(*r), in.from, now, 0});
    st.workers = workers.size();
    ++st.reports;
    request_plan();
  }

  // Under mu.
  void request_plan() {
    plan_requested = true;
    cv.notify_all();
  }

  // Reads the kept reports into a fleet (under mu), leaving out those the header lists.
  FleetSnapshot collect(std::map<WorkerId, Planned>& planned) {
    FleetSnapshot fleet{opt.tokens_per_page, {}, prompts_waiting};
    const Duration now = clock->now();
    std::map<SequenceId, int> holders;
    std::vector<const Kept*> eligible;
    for (const auto& [id, k] : workers) {
      if (stale(k, now) || k.report.migrating || k.planned_report >= k.report.report ||
          k.report.snapshot.version > newest) {
        continue;
      }
      eligible.push_back(&k);
      for (const SequenceSnapshot& s : k.report.snapshot.sequences) ++holders[s.id];
    }
    for (const Kept* k : eligible) {
      const auto& seqs = k->report.snapshot.sequences;
      if (std::any_of(seqs.begin(), seqs.end(), [&](const SequenceSnapshot& s) { return holders[s.id] > 1; })) {
        continue;
      }
      fleet.workers.push_back(k->report.snapshot);
      planned[k->report.snapshot.id] = {k->from, k->report.migrator_address, k->report.report};
    }
    st.planned_workers = fleet.workers.size();
    st.left_out = workers.size() - fleet.workers.size();
    st.prompts_waiting = prompts_waiting;
    return fleet;
  }

  void plan_once() {
    std::map<WorkerId, Planned> planned;
    FleetSnapshot fleet;
    Version version;
    std::uint64_t number = 0;
    {
      std::lock_guard l(mu);
      fleet = collect(planned);
      version = newest;
      number = ++plans;
    }
    Result<MigrationPlan> plan = plan_repack(fleet, version, opt.policy);
    if (!plan.ok()) {
      std::lock_guard l(mu);
      ++st.plans_failed;
      if (first_error.ok()) {
        first_error = internal_error(fmt::format("repack plan {}: {}", number, plan.status().to_string()));
      }
      return;
    }
    // Each source's moves, by destination.
    std::map<WorkerId, std::map<WorkerId, std::vector<SequenceId>>> by_source;
    for (const Move& m : plan->moves) by_source[m.from][m.to].push_back(m.sequence);
    std::map<WorkerId, Version> versions;
    for (const WorkerSnapshot& w : fleet.workers) versions[w.id] = w.version;
    std::vector<std::pair<Endpoint, internal::RepackOrders>> orders;
    for (auto& [source, dests] : by_source) {
      const Planned& from = planned.at(source);
      internal::RepackOrders o{number, from.report, versions.at(source), {}};
      for (auto& [dest, seqs] : dests) {
        o.destinations.push_back({dest, planned.at(dest).migrator_address, std::move(seqs)});
      }
      orders.emplace_back(from.from, std::move(o));
    }
    {
      std::lock_guard l(mu);
      ++st.plans;
      st.moves += plan->moves.size();
      st.workers_freed += plan->freed.size();
      // Sources and destinations sit out until they report again.
      for (const Move& m : plan->moves) {
        for (WorkerId w : {m.from, m.to}) {
          auto it = workers.find(w);
          if (it == workers.end()) continue;
          it->second.planned_report = std::max(it->second.planned_report, planned.at(w).report);
        }
      }
    }
    for (auto& [to, o] : orders) {
      Endpoint ep = to;
      const Status s = internal::send_protocol(ep, Message{kRepackOrdersMessage, internal::encode_repack_orders(o)},
                                               opt.send_timeout);
      std::lock_guard l(mu);
      ++(s.ok() ? st.orders_sent : st.orders_failed);
    }
  }

  void run() {
    std::unique_lock l(mu);
    std::optional<Duration> last_plan;
    while (!thread.stopping()) {
      const Duration at = last_plan ? deadline_after(*last_plan, opt.min_plan_interval) : Duration::min();
      if (!plan_requested || clock->now() < at) {
        clock->wait_until(cv, l, plan_requested ? at : kForever);
        continue;
      }
      plan_requested = false;
      last_plan = clock->now();
      l.unlock();
      plan_once();
      l.lock();
    }
  }
};

Result<std::unique_ptr<RepackCoordinator>> RepackCoordinator::create(std::shared_ptr<Transport> transport,
                                                                     RepackCoordinatorOptions options) {
  if (!transport) return invalid_argument("repack coordinator: the transport is null");
  if (options.tokens_per_page <= 0) {
    return invalid_argument(fmt::format("RepackCoordinatorOptions: tokens_per_page {}", options.tokens_per_page));
  }
  if (options.min_plan_interval < Duration::zero() || options.stale_after <= Duration::zero() ||
      options.send_timeout <= Duration::zero()) {
    return invalid_argument(
        fmt::format("RepackCoordinatorOptions: min_plan_interval {} ns, stale_after {} ns, send_timeout {} ns",
                    options.min_plan_interval.count(), options.stale_after.count(), options.send_timeout.count()));
  }
  if (options.max_workers == 0) return invalid_argument("RepackCoordinatorOptions: max_workers 0");
  // An empty fleet checks the policy options alone.
  if (Result<MigrationPlan> p = plan_repack({options.tokens_per_page, {}, std::nullopt}, Version(0), options.policy); !p.ok()) {
    return invalid_argument(fmt::format("RepackCoordinatorOptions: policy: {}", p.status().message()));
  }
  Result<internal::TransportClaim> claim = internal::TransportClaim::take(*transport, "repack coordinator");
  if (!claim.ok()) return claim.status();
  auto impl = std::make_unique<Impl>(std::move(transport), std::move(options));
  impl->claim = std::move(*claim);
  Impl* p = impl.get();
  impl->thread.start(p->mu, p->cv, *p->clock, [p] { p->run(); });
  // The type is laminar's own, in the reserved range: registering it cannot fail.
  LAMINAR_CHECK(internal::on_protocol_message(*p->transport, kRepackReportMessage,
                                              p->gate.wrap([p](Incoming in) { p->on_report(in); }))
                    .ok());
  return std::unique_ptr<RepackCoordinator>(new RepackCoordinator(std::move(impl)));
}

RepackCoordinator::RepackCoordinator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RepackCoordinator::~RepackCoordinator() {
  (void)internal::on_protocol_message(*impl_->transport, kRepackReportMessage, {});
  impl_->gate.close();
  impl_->thread.stop();
  impl_->claim.release();
}

Status RepackCoordinator::set_newest_version(Version v) {
  std::lock_guard l(impl_->mu);
  if (v < impl_->newest) {
    return invalid_argument(fmt::format("repack coordinator: version {} is older than the newest, {}", v.value(),
                                        impl_->newest.value()));
  }
  if (v == impl_->newest) return ok_status();
  impl_->newest = v;
  impl_->request_plan();
  return ok_status();
}

Version RepackCoordinator::newest_version() const {
  std::lock_guard l(impl_->mu);
  return impl_->newest;
}

Status RepackCoordinator::set_prompts_waiting(std::int64_t n) {
  // An empty fleet checks the count against plan_repack's own bounds.
  const FleetSnapshot none{impl_->opt.tokens_per_page, {}, n};
  if (Result<MigrationPlan> p = plan_repack(none, Version(0), impl_->opt.policy); !p.ok()) {
    return invalid_argument(fmt::format("repack coordinator: {}", p.status().message()));
  }
  std::lock_guard l(impl_->mu);
  if (impl_->prompts_waiting == n) return ok_status();
  impl_->prompts_waiting = n;
  impl_->request_plan();
  return ok_status();
}

std::optional<std::int64_t> RepackCoordinator::prompts_waiting() const {
  std::lock_guard l(impl_->mu);
  return impl_->prompts_waiting;
}

RepackCoordinatorStats RepackCoordinator::stats() const {
  std::lock_guard l(impl_->mu);
  return impl_->st;
}

Status RepackCoordinator::background_error() const {
  std::lock_guard l(impl_->mu);
  return impl_->first_error;
}

std::string RepackCoordinatorStats::to_json() const { return internal::stats_json(*this); }

}  // namespace laminar
