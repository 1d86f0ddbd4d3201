#include "laminar/repack_driver.h"

#include <fmt/format.h>

#include <algorithm>
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
  // Signalled on a new report, on stopping and on every jump of a virtual clock.
  std::condition_variable cv;
  std::optional<internal::RepackReport> outbox;  // the newest report not sent yet
  Endpoint coordinator;                          // invalid while not connected
  EndpointId coordinator_id;                     // its id, which orders must arrive on (0: none)
  std::optional<internal::RepackOrders> pending;
  RepackDriverStats st;
  Status first_error;  // see background_error()
  internal::ClockedThread thread;
  HandlerGate gate;

  // The decode loop's own.
  std::uint64_t next_report = 1;
  Duration report_at{0};

  void on_orders(const Incoming& in) {
    Result<internal::RepackOrders> o = internal::decode_repack_orders(in.message.body);
    std::lock_guard l(mu);
    if (!o.ok() || coordinator_id == EndpointId() || in.from.id() != coordinator_id) {
      ++st.orders_refused;
      return;
    }
    if (pending) ++st.orders_dropped;
    pending = std::move(*o);
  }

  // The reporting thread: connects when it must and sends what is in the outbox.
  void run() {
    std::unique_lock l(mu);
    Duration retry_at{0};
    while (!thread.stopping()) {
      if (!outbox) {
        clock->wait_until(cv, l, kForever);
        continue;
      }
      if (!coordinator.valid()) {
        if (clock->now() < retry_at) {
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
      Endpoint ep = coordinator;
      l.unlock();
      const Status s = internal::send_protocol(
          ep, Message{kRepackReportMessage, internal::encode_repack_report(r)}, opt.send_timeout);
      l.lock();
      if (s.ok()) {
        ++st.reports_sent;
      } else {
        ++st.reports_failed;
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
  if (options.report_interval <= Duration::zero() || options.connect_timeout <= Duration::zero() ||
      options.retry_interval <= Duration::zero() || options.send_timeout <= Duration::zero()) {
    return invalid_argument(fmt::format(
        "RepackDriverOptions: report_interval {} ns, connect_timeout {} ns, retry_interval {} ns, send_timeout {} ns",
        options.report_interval.count(), options.connect_timeout.count(), options.retry_interval.count(),
        options.send_timeout.count()));
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
  // The type is laminar's own, in the reserved range: registering it cannot fail.
  LAMINAR_CHECK(internal::on_protocol_message(*p->transport, kRepackOrdersMessage,
                                              p->gate.wrap([p](Incoming in) { p->on_orders(in); }))
                    .ok());
  return std::unique_ptr<RepackDriver>(new RepackDriver(std::move(impl)));
}

RepackDriver::RepackDriver(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RepackDriver::~RepackDriver() {
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
  }
  if (orders) {
    if (orders->version != snapshot.version) {
      std::lock_guard l(d.mu);
      ++d.st.orders_dropped;
    } else {
      d.carry_out(*orders, snapshot);
    }
  }
  const Duration now = d.clock->now();
  if (now >= d.report_at && snapshot.step_time == Duration::zero() && !snapshot.sequences.empty()) {
    std::lock_guard l(d.mu);
    ++d.st.reports_held;
  } else if (now >= d.report_at) {
    internal::RepackReport r{d.next_report++, !d.migrator->moving().empty(), d.address, snapshot};
    d.report_at = deadline_after(*d.clock, d.opt.report_interval);
    std::lock_guard l(d.mu);
    d.outbox = std::move(r);
    d.cv.notify_all();
  }
  return d.migrator->poll();
}

Status RepackDriver::background_error() const {
  std::lock_guard l(impl_->mu);
  return impl_->first_error;
}

RepackDriverStats RepackDriver::stats() const {
  std::lock_guard l(impl_->mu);
  return impl_->st;
}

std::string RepackDriverStats::to_json() const { return internal::stats_json(*this); }

}  // namespace laminar
