// kv_migrator_impl.h (private to src/): the state of a KvMigrator, shared by its source side
// (kv_migrator.cc) and its destination side (kv_migrator_destination.cc).
//
// Locks: `mu` guards everything the migrator keeps and is held through every public call; the
// transport's callback thread never takes it. The handlers and on_close callbacks take only the
// inbox's own mutex, to queue what arrived for poll(). Transport calls made under `mu` return
// promptly (sends and replies wait for UCX to take the bytes, never for a peer's answer).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "kv_migration_wire.h"
#include "kv_migrator_device.h"
#include "laminar/handler_gate.h"
#include "laminar/kv_migrator.h"
#include "transport_claim.h"

namespace laminar {

namespace internal {
// How long an abort message may take to go out. The peer finds out anyway, by its lease or its
// stall timeout, and pages fenced for it return after another lease.
inline constexpr Duration kMigrationAbortSendTimeout = std::chrono::milliseconds(200);
}  // namespace internal

struct KvMigrator::Impl {
  // What the transport's threads hand to poll().
  struct Inbound {
    Incoming in;               // a message, unless `closed`
    bool closed = false;       // endpoint `endpoint_id` closed, for `why`
    EndpointId endpoint_id;
    Status why;
  };
  // Also the wake-up of wait_event() and of the host's notify hook: every transport callback that
  // gives poll() something to do (a message, an answer, a landed put, a closed connection) calls
  // wake(), as does a jump of a virtual clock.
  struct Inbox {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Inbound> items;
    std::size_t messages = 0;  // items that are messages (closes are not bounded)
    bool woken = true;         // something happened since poll() last took the inbox
    // Held while the hook runs, so that set_notify() returns only once the old hook is done.
    std::mutex notify_mu;
    std::function<void()> notify;

    void wake() {
      {
        std::lock_guard lock(mu);
        woken = true;
      }
      cv.notify_all();
      std::lock_guard lock(notify_mu);
      if (notify) notify();
    }
  };

  // ---- source side ----
  struct OutSequence {
    SequenceId id;
    std::uint32_t pages_needed = 0;   // reserved at the destination
    std::vector<std::int32_t> dst;    // the destination's page ids, [pages_needed]
    std::uint32_t staged = 0;         // pages queued for a stage or in one so far (from the first)
  };
  // Pages of one sequence waiting for a stage: reserved indices [first, first + src.size()).
  struct Piece {
    std::size_t seq = 0;  // index into OutMigration::seqs
    std::uint32_t first = 0;
    std::vector<std::int32_t> src;  // this cache's page ids, copied from pages()
  };
  struct Stage {
    internal::MigrationStage message;
    std::vector<std::future<Status>> puts;
    std::size_t puts_done = 0;  // puts[0, puts_done) completed OK (and were taken from)
    std::uint64_t pages = 0;
    bool sent = false;
    Duration sent_at{};
    std::future<Result<Message>> answer;
    // Device pools: the checksums of the stage's pages (the message goes once they are in), then
    // the sends, posted as the message goes.
    std::unique_ptr<internal::KvDeviceWork> sums;
    std::vector<internal::KvDeviceSpan> spans;
    std::unique_ptr<internal::KvDeviceWork> sends;
  };
  enum class OutPhase : std::uint8_t {
    kOffered,  // waiting for the reservation, not paused
    kLive,     // live stages while the host decodes
    kPaused,   // kPauseRequested emitted: waiting for finish()
    kFinal,    // finish() called: the last pages, then the final stage
  };
  struct OutMigration {
    MigrationId id;
    std::string destination;
    Endpoint ep;
    Version version;
    OutPhase phase = OutPhase::kOffered;
    bool reserved = false;  // the reservation arrived (a pause may come before it)
    bool ended = false;
    std::future<Result<Message>> offer_answer;
    Duration offer_sent_at{};
    std::vector<OutSequence> seqs;
    RemoteRegion k_remote;
    RemoteRegion v_remote;
    std::uint64_t link = 0;  // device pools: the link its pages go by
    std::int64_t dst_num_pages = 0;
    std::deque<Piece> todo;
    std::deque<Stage> stages;  // built (puts issued), not yet answered, in order
    std::uint32_t next_stage = 0;
    std::uint32_t live_rounds = 0;
    bool final_sent = false;
    std::vector<SequenceState> states;  // kFinal: by index of seqs
  };
  // A migration this source gave up while some of its puts were in flight: the abort goes to the
  // destination only once they landed, so it never returns a page a put of ours still writes.
  struct Draining {
    Endpoint ep;
    std::vector<std::future<Status>> puts;
    internal::MigrationAbort message;
  };

  // ---- destination side ----
  struct InSequence {
    SequenceId id;
    std::vector<std::int32_t> pages;  // reserved here
    std::uint32_t received = 0;       // pages checked so far (from the first)
  };
  // Device pools: a stage whose pages are being received and checksummed here, answered once done.
  struct Receiving {
    Incoming msg;
    internal::MigrationStage stage;
    std::unique_ptr<internal::KvDeviceWork> work;
  };
  struct InMigration {
    MigrationId id;
    Endpoint ep;
    std::vector<InSequence> seqs;
    std::uint32_t next_stage = 0;  // counts stages as they arrive; received, as they are checked
    Duration deadline{};  // of the lease
    bool ended = false;
    std::uint64_t link = 0;         // device pools: the link its pages come by
    std::deque<Receiving> receiving;  // device pools: posted on the link, in order
  };

  // Device pools: one NCCL link per peer and direction (the destination makes it, the source joins),
  // kept for later migrations until the connection closes or something on it fails.
  struct Link {
    std::shared_ptr<internal::KvDeviceLink> link;
    Endpoint ep;
    int rank = 0;                  // 0: this side sends (source), 1: it receives
    std::vector<std::byte> token;  // rank 1: what every reservation hands the source
    Duration join_deadline{};
    bool joined = false;
    // Source: the next batch number to give a stage. Destination: the next batch to post, and the
    // stages that arrived ahead of it (by batch, with their migration's id).
    std::uint64_t next_batch = 1;
    std::map<std::uint64_t, std::pair<std::uint64_t, Receiving>> waiting;
  };

  // An incoming migration this destination ended while its source may still have puts in flight
  // into the reserved pages: they stay reserved until the source confirms with its own abort
  // (which it sends once its puts landed), the connection closes, or a lease passes.
  struct Fenced {
    Endpoint ep;
    std::vector<std::int32_t> pages;
    Duration until{};
    MigrationEvent event;  // kAborted, emitted when the pages return
  };
  struct Finished {
    MigrationState state = MigrationState::kDone;
    bool outgoing = true;
    Status reason;  // an aborted incoming one's: a stage that arrives after the abort is refused with it
  };
  struct Watch {
    Endpoint ep;
    CloseSubscription sub;
  };

  Impl(std::shared_ptr<Transport> t, std::shared_ptr<PagedKvCache> c, KvMigratorOptions o);

  const std::shared_ptr<Transport> transport;
  internal::TransportClaim claim;  // the one of its kind on the transport, until shutdown
  const std::shared_ptr<PagedKvCache> cache;
  const KvMigratorOptions options;
  const std::shared_ptr<Clock> clock;
  const std::shared_ptr<Inbox> inbox = std::make_shared<Inbox>();
  HandlerGate gate;
  ClockSubscription clock_wake;  // a jump of a virtual clock may make a lease or a stall due
  MemoryRegion k_region;  // the cache's pools, whole (host pools)
  MemoryRegion v_region;
  bool device = false;  // the pools are in device memory: pages move by NCCL, not by put
  internal::KvDevicePools device_pools;
  std::byte* k_base = nullptr;  // device pools: the cache's pools, whole
  std::byte* v_base = nullptr;

  mutable std::mutex mu;  // guards everything below
  Version version;
  std::unordered_map<std::uint64_t, OutMigration> out;
  std::unordered_map<std::uint64_t, InMigration> in;
  std::unordered_map<std::uint64_t, Fenced> fenced;
  std::vector<Draining> draining;
  std::map<std::string, Endpoint> connections;  // by destination address
  std::unordered_map<EndpointId, Watch> watches;
  std::unordered_map<std::uint64_t, Finished> finished;
  std::unordered_map<std::uint64_t, Link> links;  // by link id
  std::deque<std::uint64_t> finished_order;
  std::vector<MigrationEvent> events;
  KvMigratorStats stats;
  Status first_error;
  std::mt19937_64 rng{std::random_device{}()};

  // ---- shared (kv_migrator.cc) ----
  void queue(Incoming in);
  // Subscribes to the endpoint's close, once per endpoint.
  void watch(const Endpoint& ep);
  void record_finished(MigrationId id, MigrationState state, bool outgoing, Status reason = {});
  void record_error(const Status& s);
  std::uint64_t page_checksum(std::int32_t page) const;
  // Sends an abort message, best effort, waiting at most `timeout`.
  void send_abort(Endpoint& ep, const internal::MigrationAbort& m, Duration timeout);
  // Drops ended migrations and the watches and connections nothing uses any more.
  void sweep();
  // See KvMigrator::poll_deadline(); under `mu`.
  Duration next_deadline() const;

  // ---- device pools (kv_migrator.cc) ----
  // Aborts a link and ends every running migration on it, both ways, for `why`. Any migration that
  // ends short drops its link, on both sides, so the two never wait on each other's transfers.
  void drop_link(std::uint64_t id, const Status& why);
  // Drops the links this destination receives on from `from`.
  void drop_links_from(const Endpoint& from, const Status& why);
  // Polls the links that are joining (each gets stall_timeout) and posts the receives that wait
  // for their turn.
  void advance_links();
  // The spans of a stage's runs in this side's pools: for each sequence, each run, each layer, K
  // then V. `pages(k, i)`: this side's page id of page i of staged sequence k.
  template <class PageOf>
  std::vector<internal::KvDeviceSpan> device_spans(const internal::MigrationStage& stage, PageOf pages) const;

  // ---- source side (kv_migrator.cc) ----
  void advance_out(OutMigration& m);
  void take_reservation(OutMigration& m, Result<Message> answer);
  // The reserved pages (and, for device pools, the link); kDataLoss for a reservation that makes
  // no sense, the link's error when it cannot be joined.
  Status take_pages(OutMigration& m, const internal::MigrationReservation& r);
  void check_sequences(OutMigration& m);
  bool settle_stages(OutMigration& m);
  void build_stage(OutMigration& m);
  // Device pools: whether a stage can go (its link joined, its checksums in); sets its batch then.
  // Ends the migration when its link failed.
  bool device_stage_ready(OutMigration& m, Stage& s);
  void start_round(OutMigration& m);
  void request_pause(OutMigration& m);
  // Ends an outgoing migration as aborted: the sequences stay here. `tell`: send the destination
  // an abort message (once our puts in flight landed).
  void end_out(OutMigration& m, MigrationState state, Status reason, bool tell);
  void on_abort_for_source(const internal::MigrationAbort& a, const Endpoint& from);
  void on_closed(EndpointId endpoint_id, const Status& why);

  // ---- destination side (kv_migrator_destination.cc) ----
  void on_offer(Incoming& msg);
  Status check_offer(const internal::MigrationOffer& offer) const;
  void on_stage(Incoming& msg);
  Status check_stage(const InMigration& m, const internal::MigrationStage& stage) const;
  Status check_final(const InMigration& m, const internal::MigrationStage& stage) const;
  void commit(InMigration& m, Incoming& msg, internal::MigrationStage& stage);
  void on_abort_for_destination(const internal::MigrationAbort& a, const Endpoint& from);
  // Ends incoming migrations whose lease ran out, and returns fenced pages whose wait did.
  void expire_leases();
  // Ends an incoming migration: its reserved pages return, at once or (`fence`: the source may
  // still be putting into them) once the source confirms. `tell`: send the source an abort.
  void end_in(InMigration& m, MigrationState state, Status reason, bool tell, bool fence);
  // Device pools: posts the stages waiting on a link whose turn came; checks received stages.
  void post_receives(std::uint64_t link_id, Link& l);
  void check_received(InMigration& m);
  // Answers a stage with a refusal and ends its migration (and, for device pools, its link).
  void refuse(InMigration& m, Incoming& msg, const Status& why);
  // The link this destination receives on from `from`: the one it has, or a new one (joining).
  Result<std::uint64_t> receive_link(const Endpoint& from);
  // The rest of a stage once its pages are checked here: their count, then the answer or commit.
  void stage_checked(InMigration& m, Incoming& msg, internal::MigrationStage& stage, std::uint64_t failures,
                     SequenceId first_bad, std::uint32_t first_bad_page);
  // Returns the fenced pages of migrations that match and emits their kAborted events.
  template <class Pred>
  void release_fenced(Pred match) {
    std::erase_if(fenced, [&](auto& kv) {
      if (!match(kv.first, kv.second)) return false;
      LAMINAR_CHECK(cache->unreserve_pages(kv.second.pages).ok());
      events.push_back(std::move(kv.second.event));
      return true;
    });
  }
};

template <class PageOf>
std::vector<internal::KvDeviceSpan> KvMigrator::Impl::device_spans(const internal::MigrationStage& stage,
                                                                   PageOf page_of) const {
  const KvLayout& l = cache->layout();
  const std::size_t page_bytes = std::size_t(l.page_bytes());
  std::vector<internal::KvDeviceSpan> spans;
  for (std::size_t k = 0; k < stage.sequences.size(); ++k) {
    std::uint32_t i = 0;
    for (std::uint32_t run : stage.sequences[k].runs) {
      const std::size_t first = std::size_t(page_of(k, i));
      for (std::int32_t layer = 0; layer < l.num_layers; ++layer) {
        const std::size_t at = (std::size_t(layer) * std::size_t(l.num_pages) + first) * page_bytes;
        spans.push_back({k_base + at, run * page_bytes});
        spans.push_back({v_base + at, run * page_bytes});
      }
      i += run;
    }
  }
  return spans;
}

}  // namespace laminar
