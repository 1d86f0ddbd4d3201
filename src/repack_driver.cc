#include "laminar/repack_driver.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <set>
#include <utility>

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

// Whether an expected remaining length moved enough to matter to a plan: by more than a quarter of
// what was reported, or to or from zero. Per-step countdowns of a length predictor then report a
// sequence a few dozen times over its life, not once a token.
bool remaining_moved(const std::optional<std::int64_t>& was, const std::optional<std::int64_t>& now) {
  if (was.has_value() != now.has_value()) return true;
  if (!was) return false;
  if ((*was == 0) != (*now == 0)) return true;
  return 4 * std::abs(*now - *was) > *was;
}

// Whether a plan could decide differently on `now` than on `was` (see the header's list).
bool plan_relevant_change(const WorkerSnapshot& was, const WorkerSnapshot& now) {
  if (was.version != now.version || was.pages_total != now.pages_total || was.pages_used != now.pages_used ||
      was.slots_total != now.slots_total || was.slots_used != now.slots_used ||
      was.waiting_prompts != now.waiting_prompts || was.kv_stopped_growing != now.kv_stopped_growing ||
      was.sequences.size() != now.sequences.size()) {
    return true;
  }
  // Step time: a worker that sped up or slowed down by half, not one step's jitter.
  if ((was.step_time == Duration::zero()) != (now.step_time == Duration::zero()) ||
      now.step_time > 2 * was.step_time || 2 * now.step_time < was.step_time) {
    return true;
  }
  std::map<SequenceId, const SequenceSnapshot*> before;
  for (const SequenceSnapshot& q : was.sequences) before[q.id] = &q;
  for (const SequenceSnapshot& q : now.sequences) {
    auto it = before.find(q.id);
    if (it == before.end() || it->second->pages != q.pages ||
        remaining_moved(it->second->expected_remaining_tokens, q.expected_remaining_tokens)) {
      return true;
    }
  }
  return false;
}

}  // namespace

struct RepackDriver::Impl {
  Impl(std::shared_ptr<Transport> t, std::shared_ptr<KvMigrator> m, RepackDriverOptions o, std::string a)
      : transport(std::move(t)),
        migrator(std::move(m)),
        opt(std::move(o)),
        clock(internal::clock_or_steady(opt.clock)),
        address(std::move(a)) {}

  const std::shared_ptr<Transport> transport;
  internal::TransportClaim claim;  // the one of its kind on the transport, until shutdown
  const std::shared_ptr<KvMigrator> migrator;
  const RepackDriverOptions opt;
  const std::shared_ptr<Clock> clock;
  const std::string address;  // the migrator's, in every report

  mutable std::mutex mu;
  // The reporting thread's: signalled on a new report, on stopping and on every jump of a virtual
  // clock.
  std::condition_variable cv;
  // wait_event()'s: signalled on orders, on the migrator's notify and on every clock jump.
  std::condition_variable step_cv;
  ClockSubscription step_wake;
  std::optional<internal::RepackReport> outbox;  // the newest report not sent yet
  bool sending = false;                          // the thread sends a report taken from outbox
  std::uint64_t last_sent = 0;                   // the number of the last report that went out
  std::optional<Duration> sent_at;               // when it went out
  Endpoint coordinator;                          // invalid while not connected
  EndpointId coordinator_id;                     // its id, which orders must arrive on (0: none)
  std::optional<internal::RepackOrders> pending;
  bool migrator_woke = true;  // the migrator's notify ran since step() last polled it
  // The host's hook (set_notify), and the lock held while it runs, so that replacing it waits.
  std::mutex notify_mu;
  std::function<void()> notify;
  RepackDriverStats st;
  Status first_error;  // see background_error()
  internal::ClockedThread thread;
  HandlerGate gate;

  // The decode loop's own.
  std::uint64_t next_report = 1;
  std::optional<internal::RepackReport> reported;  // the last report put in the outbox
  Duration reported_at{0};                         // when

  void on_orders(const Incoming& in) {
    Result<internal::RepackOrders> o = internal::decode_repack_orders(in.message.body);
    {
      std::lock_guard l(mu);
      if (!o.ok() || coordinator_id == EndpointId() || in.from.id() != coordinator_id) {
        ++st.orders_refused;
        return;
      }
      if (pending) ++st.orders_dropped;
      pending = std::move(*o);
    }
    step_cv.notify_all();
    tell_host();
  }

  void on_migrator() {
    {
      std::lock_guard l(mu);
      migrator_woke = true;
    }
    step_cv.notify_all();
    tell_host();
  }

  void tell_host() {
    std::lock_guard l(notify_mu);
    if (notify) notify();
  }

  // The reporting thread: connects when it must, and sends the outbox once min_report_interval
  // has passed since the last report.
  void run() {
    std::unique_lock l(mu);
    Duration retry_at{0};
    while (!thread.stopping()) {
      const Duration now = clock->now();
      const Duration due = !outbox ? kForever
                           : sent_at ? deadline_after(*sent_at, opt.min_report_interval)
                                     : Duration::min();
      if (now < due) {
        clock->wait_until(cv, l, due);
        continue;
      }
      if (!coordinator.valid()) {
        if (now < retry_at) {
          clock->wait_until(cv, l, retry_at);
          continue;
        }
        l.unlock();
        Result<Endpoint> ep = transport->connect(opt.coordinator, opt.connect_timeout);
        l.lock();
        if (!ep.ok()) {
          ++st.connects_failed;
          const StatusCode code = ep.status().code();
          if (first_error.ok() && (code == StatusCode::kInvalidArgument || code == StatusCode::kFailedPrecondition)) {
            first_error = ep.status().with_context("repack driver: connecting to the coordinator");
          }
          retry_at = deadline_after(*clock, opt.retry_interval);
          continue;
        }
        coordinator = *ep;
        coordinator_id = ep->id();
        continue;
      }
      internal::RepackReport r = std::move(*outbox);
      outbox.reset();
      const bool keepalive = r.report == last_sent;
      Endpoint ep = coordinator;
      sending = true;
      l.unlock();
      const Status s = internal::send_protocol(
          ep, Message{kRepackReportMessage, internal::encode_repack_report(r)}, opt.send_timeout);
      l.lock();
      sending = false;
      if (s.ok()) {
        ++(keepalive ? st.keepalives_sent : st.reports_sent);
        sent_at = clock->now();
        last_sent = r.report;
      } else {
        ++st.reports_failed;
        // Goes again on the next connection, unless a newer one replaced it meanwhile.
        if (!outbox) outbox = std::move(r);
        ep.close();
        coordinator = Endpoint();
        coordinator_id = EndpointId();
      }
    }
  }

  // Starts the migrations of `o` (see the header).
  void carry_out(const internal::RepackOrders& o, const WorkerSnapshot& snapshot) {
    std::set<SequenceId> live;
    for (const SequenceSnapshot& s : snapshot.sequences) live.insert(s.id);
    const std::vector<SequenceId> moving_now = migrator->moving();
    const std::set<SequenceId> moving(moving_now.begin(), moving_now.end());
    std::uint64_t started = 0, refused = 0, skipped = 0;
    for (const internal::RepackDestination& d : o.destinations) {
      std::vector<SequenceId> seqs;
      for (SequenceId q : d.sequences) {
        if (live.contains(q) && !moving.contains(q)) {
          seqs.push_back(q);
        } else {
          ++skipped;
        }
      }
      if (seqs.empty()) continue;
      ++(migrator->migrate(d.migrator_address, seqs).ok() ? started : refused);
    }
    std::lock_guard l(mu);
    ++st.orders;
    st.migrations_started += started;
    st.migrations_refused += refused;
    st.sequences_skipped += skipped;
  }
};

Result<std::unique_ptr<RepackDriver>> RepackDriver::create(std::shared_ptr<Transport> transport,
                                                           std::shared_ptr<KvMigrator> migrator,
                                                           RepackDriverOptions options) {
  if (!transport) return invalid_argument("repack driver: the transport is null");
  if (!migrator) return invalid_argument("repack driver: the migrator is null");
  if (options.coordinator.empty()) return invalid_argument("RepackDriverOptions: empty coordinator address");
  if (options.min_report_interval <= Duration::zero() || options.keepalive_interval <= Duration::zero() ||
      options.connect_timeout <= Duration::zero() || options.retry_interval <= Duration::zero() ||
      options.send_timeout <= Duration::zero()) {
    return invalid_argument(
        fmt::format("RepackDriverOptions: min_report_interval {} ns, keepalive_interval {} ns, connect_timeout {} ns, "
                    "retry_interval {} ns, send_timeout {} ns",
                    options.min_report_interval.count(), options.keepalive_interval.count(),
                    options.connect_timeout.count(), options.retry_interval.count(), options.send_timeout.count()));
  }
  std::optional<std::string> address = migrator->address();
  if (!address || address->empty()) {
    return failed_precondition("repack driver: the migrator has no address (its transport does not listen)");
  }
  if (address->size() > internal::kMaxRepackAddressBytes) {
    return failed_precondition(fmt::format("repack driver: the migrator's address '{}' is longer than {} bytes",
                                           *address, internal::kMaxRepackAddressBytes));
  }
  Result<internal::TransportClaim> claim = internal::TransportClaim::take(*transport, "repack driver");
  if (!claim.ok()) return claim.status();
  auto impl = std::make_unique<Impl>(std::move(transport), std::move(migrator), std::move(options), *address);
  impl->claim = std::move(*claim);
  Impl* p = impl.get();
  impl->thread.start(p->mu, p->cv, *p->clock, [p] { p->run(); });
  p->step_wake = p->clock->subscribe([p] {
    std::lock_guard l(p->mu);
    p->step_cv.notify_all();
  });
  p->migrator->set_notify([p] { p->on_migrator(); });
  // The type is laminar's own, in the reserved range: registering it cannot fail.
  LAMINAR_CHECK(internal::on_protocol_message(*p->transport, kRepackOrdersMessage,
                                              p->gate.wrap([p](Incoming in) { p->on_orders(in); }))
                    .ok());
  return std::unique_ptr<RepackDriver>(new RepackDriver(std::move(impl)));
}

RepackDriver::RepackDriver(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RepackDriver::~RepackDriver() {
  impl_->migrator->set_notify({});
  set_notify({});
  impl_->step_wake.reset();
  (void)internal::on_protocol_message(*impl_->transport, kRepackOrdersMessage, {});
  impl_->gate.close();
  impl_->thread.stop();
  // The thread may have connected up to its last moment: closed once it is gone.
  if (impl_->coordinator.valid()) impl_->coordinator.close();
  impl_->claim.release();
}

Result<std::vector<MigrationEvent>> RepackDriver::step(const WorkerSnapshot& snapshot) {
  Impl& d = *impl_;
  if (snapshot.id != d.opt.worker) {
    return invalid_argument(
        fmt::format("repack driver: snapshot of worker {}, not {}", snapshot.id.value(), d.opt.worker.value()));
  }
  if (snapshot.sequences.size() > internal::kMaxRepackSequences) {
    return invalid_argument(fmt::format("repack driver: snapshot of {} sequences, above {}",
                                        snapshot.sequences.size(), internal::kMaxRepackSequences));
  }
  if (snapshot.version != d.migrator->version()) {
    return failed_precondition(fmt::format("repack driver: snapshot of version {}, the migrator's is {}",
                                           snapshot.version.value(), d.migrator->version().value()));
  }
  std::optional<internal::RepackOrders> orders;
  {
    std::lock_guard l(d.mu);
    orders = std::move(d.pending);
    d.pending.reset();
    // Before the poll below: a notify from here on is for what that poll may miss.
    d.migrator_woke = false;
  }
  if (orders) {
    if (orders->version != snapshot.version) {
      std::lock_guard l(d.mu);
      ++d.st.orders_dropped;
    } else {
      d.carry_out(*orders, snapshot);
    }
  }
  const bool migrating = !d.migrator->moving().empty();
  const bool changed =
      !d.reported || d.reported->migrating != migrating || plan_relevant_change(d.reported->snapshot, snapshot);
  const Duration now = d.clock->now();
  if (changed && snapshot.step_time == Duration::zero() && !snapshot.sequences.empty()) {
    std::lock_guard l(d.mu);
    ++d.st.reports_held;
  } else if (changed || now >= deadline_after(d.reported_at, d.opt.keepalive_interval)) {
    // A keep-alive is the last report again, number and all: the coordinator tells it from a
    // change by that, and it makes a worker that sat out of a plan no fresher. It goes from here,
    // not from the driver's thread, so that a loop that stopped stepping goes stale.
    if (changed) d.reported = internal::RepackReport{d.next_report++, migrating, d.address, snapshot};
    d.reported_at = now;
    std::lock_guard l(d.mu);
    d.outbox = d.reported;
    d.cv.notify_all();
  }
  return d.migrator->poll();
}

void RepackDriver::set_notify(std::function<void()> notify) {
  std::lock_guard l(impl_->notify_mu);
  impl_->notify = std::move(notify);
}

Duration RepackDriver::poll_deadline() const {
  const Impl& d = *impl_;
  // Not under the driver's lock: the migrator calls its notify, which takes that lock, holding its
  // own. reported and reported_at belong to the decode loop, the caller.
  const Duration keepalive = d.reported ? deadline_after(d.reported_at, d.opt.keepalive_interval) : kForever;
  return std::min(d.migrator->poll_deadline(), keepalive);
}

bool RepackDriver::wait_event(Duration timeout) {
  Impl& d = *impl_;
  const Duration deadline = deadline_after(*d.clock, timeout);
  for (;;) {
    const Duration due = poll_deadline();
    std::unique_lock l(d.mu);
    if (d.pending || d.migrator_woke) return true;
    const Duration now = d.clock->now();
    if (now >= due) return true;
    if (now >= deadline) return false;
    d.clock->wait_until(d.step_cv, l, std::min(deadline, due));
  }
}

Status RepackDriver::background_error() const {
  std::lock_guard l(impl_->mu);
  return impl_->first_error;
}

RepackDriverStats RepackDriver::stats() const {
  std::lock_guard l(impl_->mu);
  RepackDriverStats s = impl_->st;
  s.reports_queued = impl_->outbox || impl_->sending ? 1 : 0;
  return s;
}

std::string RepackDriverStats::to_json() const { return internal::stats_json(*this); }

}  // namespace laminar
