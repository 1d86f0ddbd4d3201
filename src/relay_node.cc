#include "laminar/relay_node.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <stop_token>
#include <thread>

#include "clock_wait.h"
#include "laminar/handler_gate.h"
#include "relay_node_hooks.h"
#include "relay_node_wire.h"
#include "transport/protocol.h"
#include "transport_claim.h"
#include "stats_fields.h"

namespace laminar {

namespace {

// Message types of the relay protocol (reserved range, transport/protocol.h); their bodies are in
// relay_node_wire.h. A begin's reply names the chunks the downstream lacks and its RemoteRegion for
// v's buffer: the upstream puts those chunks straight into it.
constexpr MessageType kSubscribe = internal::kRelaySubscribeMessage;
constexpr MessageType kBegin = internal::kRelayBeginMessage;
constexpr MessageType kChunk = internal::kRelayChunkMessage;
constexpr MessageType kIdle = internal::kRelayIdleMessage;

// A subscriber gets idle messages at most this often, whatever it asks for.
constexpr Duration kMinIdleEvery = std::chrono::milliseconds(10);


}  // namespace

struct RelayNode::Impl {
  Impl(std::shared_ptr<Transport> t, std::shared_ptr<RelayStore> st, RelayNodeOptions o, internal::RelayNodeHooks h)
      : transport(std::move(t)),
        store(std::move(st)),
        options(std::move(o)),
        clock(internal::clock_or_steady(options.clock)),
        hooks(std::move(h)) {}

  const std::shared_ptr<Transport> transport;
  internal::TransportClaim claim;  // the one of its kind on the transport, until shutdown
  const std::shared_ptr<RelayStore> store;
  const RelayNodeOptions options;
  const std::shared_ptr<Clock> clock;
  const internal::RelayNodeHooks hooks;

  // Ends one sender's wait in the store. A sender arms it (arm()) before it checks what it waits
  // for, so an event between the check and the wait still ends the wait.
  struct SenderWake {
    std::stop_source source;  // guarded by mu; a fresh one once stopped
  };

  std::atomic<bool> stopping{false};
  mutable std::mutex mu;  // guards everything below
  // Wakes the subscriber thread: stop, a jump of a virtual clock.
  std::condition_variable cv;
  // One per sender: ended by stop, by its subscriber's link closing, by a jump of the node's clock
  // (its idle messages fall due on it), and by the node being fed again (an idle may be overdue).
  std::vector<std::shared_ptr<SenderWake>> sender_wakes;
  ClockSubscription clock_wake;
  HandlerGate gate;
  std::vector<std::thread> senders;
  std::vector<Endpoint> downstreams;
  std::optional<std::string> upstream;
  Endpoint upstream_ep;
  // When the current upstream last said something (on the clock): how its silence is timed.
  Duration last_heard = Duration::zero();
  RelayNodeStats stats;
  Status first_error;
  std::thread subscriber;
  // Registered version buffers, one registration per version for all peers.
  struct Registered {
    RelayStore::VersionMemory memory;
    MemoryRegion region;
  };
  std::map<Version, Registered> registered;

  void emit(RelayEvent::Kind kind, Version version = {}, std::uint32_t chunk = 0, std::string upstream = {},
            std::string subscriber = {}) const {
    if (options.on_event) options.on_event({kind, version, chunk, std::move(upstream), std::move(subscriber)});
  }

  void record_error(const Status& s) {
    std::lock_guard lock(mu);
    if (first_error.ok()) first_error = s;
  }

  // A stop token for the next wait of the sender that owns `w`.
  std::stop_token arm(SenderWake& w) {
    std::lock_guard lock(mu);
    if (w.source.stop_requested()) w.source = std::stop_source();
    return w.source.get_token();
  }

  // Preconditions: mu is held.
  void wake_senders_locked() {
    for (const auto& w : sender_wakes) w->source.request_stop();
  }

  // Waits on the node's clock until `deadline` or stop; true when stopping.
  bool wait_for_stop(Duration deadline) {
    std::unique_lock lock(mu);
    return internal::wait_until(*clock, cv, lock, deadline, [&] { return stopping.load(); });
  }

  // The transport registration of version v's buffer; versions no longer held are unregistered.
  Result<MemoryRegion> region_for(Version v) {
    std::lock_guard lock(mu);
    for (auto it = registered.begin(); it != registered.end();) {
      it = store->version_info(it->first).ok() ? std::next(it) : registered.erase(it);
    }
    auto it = registered.find(v);
    if (it != registered.end()) return it->second.region;
    auto mem = store->version_memory(v);
    LAMINAR_RETURN_IF_ERROR(mem.status());
    auto region = transport->register_memory(mem->bytes.data(), mem->bytes.size());
    LAMINAR_RETURN_IF_ERROR(region.status().with_context(fmt::format("registering version {}", v.value())));
    registered.emplace(v, Registered{std::move(*mem), *region});
    return *region;
  }

  // ---- hung peers: the silence of the upstream, the pace of idle messages ----

  // Preconditions: mu is held.
  // When the current upstream counts as stalled, on the clock (kForever: never).
  Duration stall_deadline_locked() const {
    if (options.stall_timeout >= kForever - last_heard) return kForever;
    return last_heard + options.stall_timeout;
  }

  // A message came from `from`: when that is the current upstream, it is not quiet.
  void heard(const Endpoint& from) {
    std::lock_guard lock(mu);
    if (!upstream_ep.valid() || from.id() != upstream_ep.id()) return;
    const Duration now = clock->now();
    // Fed again: a subscriber's idle message, held back meanwhile, may be overdue.
    if (now >= stall_deadline_locked()) wake_senders_locked();
    last_heard = now;
  }

  // The head, or a node whose upstream spoke within stall_timeout. Only a fed node tells its
  // subscribers it is idle: while its own upstream is quiet, theirs (this node) goes quiet too, so
  // a hung relay is noticed below it even when the node right below it forwards nothing.
  bool fed() {
    if (options.upstreams.empty()) return true;
    std::lock_guard lock(mu);
    return upstream.has_value() && clock->now() < stall_deadline_locked();
  }

  // ---- upstream side: push versions to one subscriber ----

  // One subscriber, as its sender thread sees it.
  struct Downstream {
    Endpoint ep;
    Duration idle_every;  // the pace of idle messages it asked for; kForever: none
    Duration last_sent;   // on the clock: when it was last sent a message
    std::shared_ptr<SenderWake> wake;
  };

  static Message chunk_done(Version v, std::uint32_t i, std::uint64_t checksum) {
    return Message{kChunk, internal::encode_relay_chunk({v, i, checksum})};
  }

  // After an exchange with the subscriber failed with `st`: false when it is gone, or stalled (no
  // answer within stall_timeout; it is then dropped); true when it answered with an error.
  bool still_there(Downstream& d, const Status& st) {
    if (!d.ep.status().ok()) return false;
    if (st.code() != StatusCode::kDeadlineExceeded) return true;
    d.ep.close();
    {
      std::lock_guard lock(mu);
      ++stats.subscribers_stalled;
    }
    emit(RelayEvent::Kind::kSubscriberStalled, {}, 0, {}, d.ep.peer_address());
    return false;
  }

  // Sends the subscriber an idle message when one is due and this node is fed. False when the
  // subscriber is gone or stalled.
  bool idle_if_due(Downstream& d) {
    if (d.idle_every == kForever || clock->now() - d.last_sent < d.idle_every || !fed()) return true;
    d.last_sent = clock->now();
    Status st = internal::send_protocol(d.ep, Message{kIdle, internal::encode_relay_idle({})}, options.stall_timeout);
    return st.ok() || still_there(d, st);
  }

  // How long a sender may wait in its store before the subscriber's next idle message falls due.
  // Preconditions: the sender's wake is armed (an overdue idle waits for the node to be fed, which
  // ends the wait).
  Duration until_idle(const Downstream& d) {
    if (d.idle_every == kForever) return kForever;
    const Duration left = d.idle_every - (clock->now() - d.last_sent);  // no overflow: a pace may be huge
    if (left > Duration::zero()) return left;
    return fed() ? Duration::zero() : kForever;
  }

  // Sends version v's missing chunks with up to `window` in flight. Returns false when the
  // subscriber is gone or stalled (stop serving it), true when v is done with: sent, refused, or
  // dropped here.
  bool send_version(Downstream& d, Version v) {
    Endpoint& ep = d.ep;
    auto info = store->version_info(v);
    if (!info.ok()) return true;  // dropped meanwhile; the caller moves on to the newest
    const ChunkPlan& plan = info->plan;
    const internal::RelayBegin begin{v, plan.chunk_bytes(), info->manifest.to_json()};
    d.last_sent = clock->now();
    auto reply =
        internal::request_protocol(ep, Message{kBegin, internal::encode_relay_begin(begin)}, options.stall_timeout);
    // An error answer (e.g. it holds something newer): skip v.
    if (!reply.ok()) return still_there(d, reply.status());
    // A subscriber that answers nonsense is dropped: nothing it says about v can be trusted.
    const auto malformed = [&](const Status& why) {
      record_error(why.with_context(fmt::format("relay: subscriber {}", ep.peer_address())));
      return false;
    };
    auto answer = internal::decode_relay_begin_reply(reply->body);
    if (!answer.ok()) return malformed(answer.status());
    auto remote = RemoteRegion::deserialize(answer->region);
    if (!remote.ok()) return malformed(remote.status().with_context("relay begin reply"));
    if (!answer->missing.empty() && answer->missing.back() >= plan.num_chunks()) {
      return malformed(data_loss(fmt::format("relay begin reply: missing chunk {} of version {}, which has {} chunks",
                                             answer->missing.back(), v.value(), plan.num_chunks())));
    }
    std::deque<std::uint32_t> todo(answer->missing.begin(), answer->missing.end());
    auto local = region_for(v);
    if (!local.ok()) return true;  // dropped meanwhile

    // Chunk i goes out as a one-sided put straight into the subscriber's buffer; once the put has
    // landed, a small message asks the subscriber to check it in place.
    struct Put {
      std::uint32_t i;
      std::uint64_t checksum;
      std::future<Status> done;
      MemoryRegion scratch;  // bytes a test hook put in the chunk's place
    };
    struct Confirm {
      std::uint32_t i;
      std::future<Result<Message>> reply;
    };
    std::deque<Put> puts;
    std::deque<Confirm> confirms;
    auto settle_put = [&]() -> bool {
      Put p = std::move(puts.front());
      puts.pop_front();
      const Status put = p.done.get();
      if (!put.ok()) {
        if (!still_there(d, put)) return false;
        todo.push_front(p.i);
        return true;
      }
      d.last_sent = clock->now();
      confirms.push_back(
          {p.i, internal::request_protocol_async(ep, chunk_done(v, p.i, p.checksum), options.stall_timeout)});
      return true;
    };
    auto settle_confirm = [&]() -> bool {
      Confirm c = std::move(confirms.front());
      confirms.pop_front();
      auto res = c.reply.get();
      if (res.ok()) {
        std::lock_guard lock(mu);
        ++stats.chunks_sent;
        return true;
      }
      if (!still_there(d, res.status())) return false;
      if (res.status().code() == StatusCode::kDataLoss) {
        std::lock_guard lock(mu);
        ++stats.chunks_resent;
        todo.push_front(c.i);
      }
      return true;
    };
    while (!todo.empty() || !puts.empty() || !confirms.empty()) {
      if (stopping.load()) return false;
      const bool nothing_to_start = todo.empty() && puts.empty();
      if (!confirms.empty() && (confirms.size() >= options.window || nothing_to_start)) {
        if (!settle_confirm()) return false;
        continue;
      }
      // One put in flight: its completion is a flush of the endpoint, which waits for every put
      // issued before it lands, so with more in flight chunk i would be confirmed (and forwarded
      // by the subscriber) only once the later ones had landed too: a lag of the whole window at
      // every relay of the chain. Confirms, small messages, still overlap up to `window`.
      if (!puts.empty()) {
        if (!settle_put()) return false;
        continue;
      }
      const std::uint32_t i = todo.front();
      const std::stop_token stop = arm(*d.wake);
      if (stopping.load() || !ep.status().ok()) return false;
      // Forward as soon as this store has the chunk: this is what pipelines the chain.
      auto c = store->read_chunk(v, i, until_idle(d), stop);
      if (!c.ok()) {
        const StatusCode code = c.status().code();
        if (code == StatusCode::kDeadlineExceeded || code == StatusCode::kCancelled) {
          // Our own upstream has not delivered it yet; an idle may be due, or the loop ends.
          if (!idle_if_due(d)) return false;
          continue;
        }
        return true;  // v was dropped (a newer version committed here): stop sending it
      }
      todo.pop_front();
      if (hooks.before_outgoing_chunk) hooks.before_outgoing_chunk(v, i);
      const std::uint64_t off = plan.chunk_offset(i);
      const std::size_t len = c->bytes.size();
      Put p{i, c->checksum, {}, {}};
      std::optional<std::vector<std::byte>> replaced;
      if (hooks.replace_outgoing_chunk) replaced = hooks.replace_outgoing_chunk(v, i, c->bytes);
      if (replaced && replaced->size() == len) {
        auto scratch = transport->allocate(len);
        if (!scratch.ok()) return true;
        std::memcpy(scratch->data(), replaced->data(), len);
        p.scratch = *scratch;
        p.done = ep.put(p.scratch, 0, *remote, off, len, options.stall_timeout);
      } else {
        p.done = ep.put(*local, off, *remote, off, len, options.stall_timeout);
      }
      puts.push_back(std::move(p));
    }
    return true;
  }

  void serve(Downstream d, std::optional<Version> have) {
    // Reset when serve returns, before `d.wake` can go; it takes mu, which is then not held.
    auto closed = d.ep.on_close([this, w = d.wake](const Status&) {
      std::lock_guard lock(mu);
      w->source.request_stop();
    });
    if (!closed.ok()) return;  // already closed
    for (;;) {
      const std::stop_token stop = arm(*d.wake);
      if (stopping.load() || !d.ep.status().ok()) break;
      if (!store->wait_for_newer(have, until_idle(d), stop)) {
        if (!idle_if_due(d)) break;
        continue;
      }
      const std::optional<Version> v = store->newest_held();
      if (!v) continue;
      if (!send_version(d, *v)) break;
      // Sent in full, refused (the subscriber holds something newer) or dropped here for a newer
      // version: in every case nothing older than the newest is worth sending any more.
      have = v;
    }
  }

  void on_subscribe(Incoming in) {
    auto m = internal::decode_relay_subscribe(in.message.body);
    if (!m.ok()) {
      (void)in.from.reply_error(in, m.status());
      return;
    }
    const std::optional<Version> have = m->have;
    // A pace past what a Duration holds is no pace: the subscriber does not time our silence.
    const Duration idle_every =
        m->idle_every_ns == 0 || m->idle_every_ns > std::uint64_t(kForever.count())
            ? kForever
            : std::max(kMinIdleEvery, Duration(std::int64_t(m->idle_every_ns)));
    (void)in.from.reply(in, Message{kSubscribe, {}});
    std::lock_guard lock(mu);
    if (stopping.load()) return;
    downstreams.push_back(in.from);
    ++stats.subscribers;
    auto wake = sender_wakes.emplace_back(std::make_shared<SenderWake>());
    senders.emplace_back([this, d = Downstream{in.from, idle_every, clock->now(), std::move(wake)}, have]() mutable {
      serve(std::move(d), have);
    });
  }

  // ---- downstream side: take versions from the upstream ----

  void on_begin(Incoming in) {
    auto m = internal::decode_relay_begin(in.message.body);
    if (!m.ok()) {
      (void)in.from.reply_error(in, m.status());
      return;
    }
    heard(in.from);
    auto manifest = WeightManifest::from_json(m->manifest_json);
    if (!manifest.ok()) {
      (void)in.from.reply_error(in, manifest.status());
      return;
    }
    const Version ver = m->version;
    auto missing = store->missing_chunks(ver);
    if (!missing.ok()) {
      auto plan = ChunkPlan::make(manifest->total_bytes(), m->chunk_bytes);
      Status st = plan.ok() ? store->begin_version(ver, *manifest, *plan) : plan.status();
      if (!st.ok()) {
        (void)in.from.reply_error(in, st);
        return;
      }
      missing = store->missing_chunks(ver);
    }
    if (!missing.ok()) {
      (void)in.from.reply_error(in, missing.status());
      return;
    }
    auto region = region_for(ver);
    if (!region.ok()) {
      (void)in.from.reply_error(in, region.status());
      return;
    }
    const internal::RelayBeginReply answer{std::move(*missing), region->remote().serialize()};
    // Setting up the version's buffer may have taken a while; none of it was the upstream's silence.
    heard(in.from);
    (void)in.from.reply(in, Message{kBegin, internal::encode_relay_begin_reply(answer)});
  }

  void on_chunk(Incoming in) {
    auto m = internal::decode_relay_chunk(in.message.body);
    if (!m.ok()) {
      (void)in.from.reply_error(in, m.status());
      return;
    }
    const Version ver = m->version;
    const std::uint32_t i = m->index;
    if (hooks.ignore_incoming_chunk) {
      std::uint64_t received = 0;
      {
        std::lock_guard lock(mu);
        received = stats.chunks_received;
      }
      // Hung: the chunk is neither stored nor answered. The callback thread stays free, so
      // subscribers are still served what is already here.
      if (hooks.ignore_incoming_chunk(ver, i, received)) return;
    }
    heard(in.from);
    const bool had = store->newest_version() == ver;
    Status st = store->seal_in_place(ver, i, m->checksum);
    if (st.code() == StatusCode::kDataLoss) emit(RelayEvent::Kind::kChunkRejected, ver, i);
    if (!st.ok()) {
      (void)in.from.reply_error(in, st);
      return;
    }
    {
      std::lock_guard lock(mu);
      ++stats.chunks_received;
    }
    emit(RelayEvent::Kind::kChunkStored, ver, i);
    (void)in.from.reply(in, Message{kChunk, {}});
    if (!had && store->newest_version() == ver) emit(RelayEvent::Kind::kCommitted, ver);
  }

  // The upstream has nothing to send (idle message, whose body is empty).
  void on_idle(Incoming in) {
    if (internal::decode_relay_idle(in.message.body).ok()) heard(in.from);
  }

  enum class LinkEnd { kStopping, kClosed, kStalled };

  // Waits until the upstream link closes (the transport reports it), the upstream stays quiet for
  // stall_timeout, or the node stops.
  LinkEnd wait_while_linked(const Endpoint& ep) {
    auto closed = std::make_shared<bool>(false);  // guarded by mu
    auto watch = ep.on_close([this, closed](const Status&) {
      std::lock_guard lock(mu);
      *closed = true;
      cv.notify_all();
    });
    if (!watch.ok()) return stopping.load() ? LinkEnd::kStopping : LinkEnd::kClosed;
    std::unique_lock lock(mu);
    LinkEnd end = LinkEnd::kClosed;
    while (true) {
      if (stopping.load()) {
        end = LinkEnd::kStopping;
        break;
      }
      if (*closed) break;
      // Each message moves the deadline on without waking this thread: it wakes at the old
      // deadline and finds the new one.
      const Duration deadline = stall_deadline_locked();
      if (deadline != kForever && clock->now() >= deadline) {
        end = LinkEnd::kStalled;
        break;
      }
      clock->wait_until(cv, lock, deadline);
    }
    lock.unlock();
    watch->reset();  // waits for a running callback, which takes mu: not under the lock
    return end;
  }

  // The pace of idle messages this node asks of its upstream: four per stall_timeout, so one late
  // or lost message is not taken for a stall.
  std::uint64_t idle_every_ns() const {
    if (options.stall_timeout == kForever) return 0;
    return std::uint64_t(std::max<std::int64_t>(1, (options.stall_timeout / 4).count()));
  }

  void subscribe_loop() {
    std::size_t k = 0;
    while (!stopping.load()) {
      const std::string addr = options.upstreams[k % options.upstreams.size()];
      ++k;
      auto ep = transport->connect(addr, options.connect_timeout);
      Status subscribed = ep.status();
      if (ep.ok()) {
        const internal::RelaySubscribe m{store->newest_version(), idle_every_ns()};
        subscribed = internal::request_protocol(*ep, Message{kSubscribe, internal::encode_relay_subscribe(m)}).status();
        if (!subscribed.ok()) ep->close();
      }
      if (!subscribed.ok()) {
        // The pause is timed from the failure, read before the event goes out: whoever reacts to
        // the event by moving the clock then always moves it past this deadline.
        const Duration retry_at = deadline_after(*clock, options.retry_interval);
        emit(RelayEvent::Kind::kUpstreamUnreachable, {}, 0, addr);
        // Once round the whole list without a link: pause before the next round.
        if (k % options.upstreams.size() == 0 && wait_for_stop(retry_at)) break;
        continue;
      }
      {
        std::lock_guard lock(mu);
        upstream = addr;
        upstream_ep = *ep;
        last_heard = clock->now();
        wake_senders_locked();  // fed again: see heard()
      }
      emit(RelayEvent::Kind::kUpstream, {}, 0, addr);
      const LinkEnd end = wait_while_linked(*ep);
      if (end == LinkEnd::kStopping) break;
      // A quiet upstream keeps its connection: closing it here is what drops it.
      if (end == LinkEnd::kStalled) ep->close();
      {
        std::lock_guard lock(mu);
        upstream.reset();
        upstream_ep = Endpoint();
        ++stats.failovers;
        if (end == LinkEnd::kStalled) ++stats.upstream_stalls;
      }
      const auto lost = end == LinkEnd::kStalled ? RelayEvent::Kind::kUpstreamStalled : RelayEvent::Kind::kUpstreamLost;
      emit(lost, {}, 0, addr);
      // The next round starts after the lost relay: the chain re-forms around it.
    }
  }
};

namespace internal {

struct RelayNodeAccess {
  static Result<std::unique_ptr<RelayNode>> create(std::shared_ptr<Transport> transport,
                                                   std::shared_ptr<RelayStore> store, RelayNodeOptions options,
                                                   RelayNodeHooks hooks) {
    if (!transport) return invalid_argument("relay node: the transport is null");
    if (!store) return invalid_argument("relay node: the store is null");
    if (options.window == 0) return invalid_argument("relay node: window is 0");
    if (options.connect_timeout <= Duration::zero()) {
      return invalid_argument(fmt::format("relay node: connect_timeout is {} ns", options.connect_timeout.count()));
    }
    if (options.retry_interval < Duration::zero()) {
      return invalid_argument(fmt::format("relay node: retry_interval is {} ns", options.retry_interval.count()));
    }
    if (options.stall_timeout <= Duration::zero()) {
      return invalid_argument(fmt::format("relay node: stall_timeout is {} ns", options.stall_timeout.count()));
    }
    Result<internal::TransportClaim> claim = internal::TransportClaim::take(*transport, "relay node");
    if (!claim.ok()) return claim.status();
    auto impl = std::make_unique<RelayNode::Impl>(std::move(transport), std::move(store), std::move(options),
                                                  std::move(hooks));
    impl->claim = std::move(*claim);
    impl->clock_wake = impl->clock->subscribe([raw = impl.get()] {
      std::lock_guard lock(raw->mu);
      raw->cv.notify_all();
      raw->wake_senders_locked();
    });
    Transport& t = *impl->transport;
    // The types are laminar's own, in the reserved range: registering them cannot fail.
    RelayNode::Impl* p = impl.get();
    LAMINAR_CHECK(on_protocol_message(t, kSubscribe, p->gate.wrap([p](Incoming in) { p->on_subscribe(std::move(in)); }))
                      .ok());
    LAMINAR_CHECK(on_protocol_message(t, kBegin, p->gate.wrap([p](Incoming in) { p->on_begin(std::move(in)); })).ok());
    LAMINAR_CHECK(on_protocol_message(t, kChunk, p->gate.wrap([p](Incoming in) { p->on_chunk(std::move(in)); })).ok());
    LAMINAR_CHECK(on_protocol_message(t, kIdle, p->gate.wrap([p](Incoming in) { p->on_idle(std::move(in)); })).ok());
    if (!impl->options.upstreams.empty()) impl->subscriber = std::thread([p = impl.get()] { p->subscribe_loop(); });
    return std::unique_ptr<RelayNode>(new RelayNode(std::move(impl)));
  }
};

Result<std::unique_ptr<RelayNode>> create_relay_node(std::shared_ptr<Transport> transport,
                                                     std::shared_ptr<RelayStore> store, RelayNodeOptions options,
                                                     RelayNodeHooks hooks) {
  return RelayNodeAccess::create(std::move(transport), std::move(store), std::move(options), std::move(hooks));
}

}  // namespace internal

Result<std::unique_ptr<RelayNode>> RelayNode::create(std::shared_ptr<Transport> transport,
                                                     std::shared_ptr<RelayStore> store, RelayNodeOptions options) {
  return internal::RelayNodeAccess::create(std::move(transport), std::move(store), std::move(options), {});
}

RelayNode::RelayNode(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RelayNode::~RelayNode() {
  Transport& t = *impl_->transport;
  (void)internal::on_protocol_message(t, kSubscribe, {});
  (void)internal::on_protocol_message(t, kBegin, {});
  (void)internal::on_protocol_message(t, kChunk, {});
  (void)internal::on_protocol_message(t, kIdle, {});
  // A handler that started before its removal finishes before anything it uses goes.
  impl_->gate.close();
  {
    std::lock_guard lock(impl_->mu);
    impl_->stopping = true;
    impl_->cv.notify_all();
    impl_->wake_senders_locked();
  }
  if (impl_->subscriber.joinable()) impl_->subscriber.join();
  std::vector<std::thread> senders;
  {
    std::lock_guard lock(impl_->mu);
    for (Endpoint& ep : impl_->downstreams) ep.close();
    if (impl_->upstream_ep.valid()) impl_->upstream_ep.close();
    senders.swap(impl_->senders);
  }
  for (auto& th : senders) th.join();
  {
    std::lock_guard lock(impl_->mu);
    impl_->registered.clear();
  }
  impl_->clock_wake.reset();
  impl_->claim.release();
}

std::optional<std::string> RelayNode::address() const { return impl_->transport->listen_address(); }

std::optional<std::string> RelayNode::upstream() const {
  std::lock_guard lock(impl_->mu);
  return impl_->upstream;
}

RelayNodeStats RelayNode::stats() const {
  std::lock_guard lock(impl_->mu);
  return impl_->stats;
}

Status RelayNode::background_error() const {
  std::lock_guard lock(impl_->mu);
  return impl_->first_error;
}

std::string RelayNodeStats::to_json() const { return internal::stats_json(*this); }

}  // namespace laminar
