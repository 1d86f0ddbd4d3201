#include "laminar/relay_node.h"

#include <fmt/format.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "clock_wait.h"
#include "handler_gate.h"
#include "relay_node_hooks.h"
#include "transport/protocol.h"

namespace laminar {

namespace {

// Message types of the relay protocol (reserved range, transport/protocol.h).
// downstream -> upstream: u8 has, u64 newest committed.
constexpr MessageType kSubscribe = internal::kRelaySubscribeMessage;
// upstream -> downstream: u64 v, u64 chunk_bytes, manifest JSON. Reply: u32 n, u32 missing[n], the
// downstream's RemoteRegion for v's buffer (the upstream puts the missing chunks straight into it).
constexpr MessageType kBegin = internal::kRelayBeginMessage;
// upstream -> downstream, after the put of chunk i completed: u64 v, u32 i, u64 xxh3.
constexpr MessageType kChunk = internal::kRelayChunkMessage;

// A sender waiting for a newer version, or for a chunk its own upstream has not delivered yet,
// re-checks for stop this often (on the store's clock).
constexpr Duration kSenderPoll = std::chrono::milliseconds(100);
constexpr Duration kChunkPoll = std::chrono::milliseconds(200);

// The relay protocol's handlers are per transport, so a transport hosts at most one node.
std::mutex g_hosts_mu;
std::set<const Transport*> g_hosts;

// Little-endian packing of the few integers the protocol carries.
class Writer {
 public:
  explicit Writer(std::size_t reserve = 0) { out_.reserve(reserve); }
  template <class T>
  void put(T x) {
    // resize + memcpy rather than insert: GCC 12 under -fsanitize=thread (-O2) sees insert's
    // move into a fresh vector as an overflow of a zero-size region (-Wstringop-overflow).
    const std::size_t at = out_.size();
    out_.resize(at + sizeof(T));
    std::memcpy(out_.data() + at, &x, sizeof(T));
  }
  void put_bytes(std::span<const std::byte> b) { out_.insert(out_.end(), b.begin(), b.end()); }
  std::vector<std::byte> take() { return std::move(out_); }

 private:
  std::vector<std::byte> out_;
};

class Reader {
 public:
  Reader(std::span<const std::byte> in, const char* what) : in_(in), what_(what) {}
  template <class T>
  Result<T> get() {
    if (in_.size() - pos_ < sizeof(T)) {
      return data_loss(fmt::format("relay {} message truncated: {} bytes, needed {} more at offset {}", what_,
                                   in_.size(), sizeof(T), pos_));
    }
    T x;
    std::memcpy(&x, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return x;
  }
  std::span<const std::byte> rest() const { return in_.subspan(pos_); }

 private:
  std::span<const std::byte> in_;
  const char* what_;
  std::size_t pos_ = 0;
};

}  // namespace

struct RelayNode::Impl {
  Impl(std::shared_ptr<Transport> t, std::shared_ptr<RelayStore> st, RelayNodeOptions o, internal::RelayNodeHooks h)
      : transport(std::move(t)),
        store(std::move(st)),
        options(std::move(o)),
        clock(internal::clock_or_steady(options.clock)),
        hooks(std::move(h)) {}

  const std::shared_ptr<Transport> transport;
  const std::shared_ptr<RelayStore> store;
  const RelayNodeOptions options;
  const std::shared_ptr<Clock> clock;
  const internal::RelayNodeHooks hooks;

  std::atomic<bool> stopping{false};
  mutable std::mutex mu;  // guards everything below
  // Wakes the subscriber thread: stop, a jump of a virtual clock.
  std::condition_variable cv;
  ClockSubscription clock_wake;
  internal::HandlerGate gate;
  std::vector<std::thread> senders;
  std::vector<Endpoint> downstreams;
  std::optional<std::string> upstream;
  Endpoint upstream_ep;
  RelayNodeStats stats;
  Status first_error;
  std::thread subscriber;
  // Registered version buffers, one registration per version for all peers.
  struct Registered {
    RelayStore::VersionMemory memory;
    MemoryRegion region;
  };
  std::map<Version, Registered> registered;

  void emit(RelayEvent e) const {
    if (options.on_event) options.on_event(e);
  }

  void record_error(const Status& s) {
    std::lock_guard lock(mu);
    if (first_error.ok()) first_error = s;
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

  // ---- upstream side: push versions to one subscriber ----

  static Message chunk_done(Version v, std::uint32_t i, std::uint64_t checksum) {
    Writer w;
    w.put<std::uint64_t>(v.value());
    w.put<std::uint32_t>(i);
    w.put<std::uint64_t>(checksum);
    return Message{kChunk, w.take()};
  }

  // Sends version v's missing chunks with up to `window` in flight. Returns false when the
  // subscriber is gone (stop serving it), true when v is done with: sent, refused, or dropped here.
  bool send_version(Endpoint& ep, Version v) {
    auto info = store->version_info(v);
    if (!info.ok()) return true;  // dropped meanwhile; the caller moves on to the newest
    Writer w;
    w.put<std::uint64_t>(v.value());
    w.put<std::uint64_t>(info->plan.chunk_bytes());
    const std::string json = info->manifest.to_json();
    w.put_bytes(std::as_bytes(std::span(json)));
    auto reply = internal::request_protocol(ep, Message{kBegin, w.take()});
    if (!reply.ok()) return ep.status().ok();  // refused (e.g. it holds something newer): skip v
    Reader r(reply->body, "begin reply");
    auto count = r.get<std::uint32_t>();
    std::deque<std::uint32_t> todo;
    for (std::uint32_t k = 0; count.ok() && k < *count; ++k) {
      auto i = r.get<std::uint32_t>();
      if (!i.ok()) break;
      todo.push_back(*i);
    }
    auto remote = RemoteRegion::deserialize(r.rest());
    if (!count.ok() || todo.size() != *count || !remote.ok()) {
      record_error(data_loss(fmt::format("relay: subscriber {} sent a malformed begin reply", ep.peer_address())));
      return false;
    }
    auto local = region_for(v);
    if (!local.ok()) return true;  // dropped meanwhile
    const ChunkPlan& plan = info->plan;

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
      if (!p.done.get().ok()) {
        if (!ep.status().ok()) return false;
        todo.push_front(p.i);
        return true;
      }
      confirms.push_back({p.i, internal::request_protocol_async(ep, chunk_done(v, p.i, p.checksum))});
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
      if (!ep.status().ok()) return false;
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
      // Forward as soon as this store has the chunk: this is what pipelines the chain.
      auto c = store->read_chunk(v, i, kChunkPoll);
      if (!c.ok()) {
        if (c.status().code() == StatusCode::kDeadlineExceeded) continue;  // upstream of ours is slow
        return true;  // v was dropped (a newer version committed here): stop sending it
      }
      todo.pop_front();
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
        p.done = ep.put(p.scratch, 0, *remote, off, len);
      } else {
        p.done = ep.put(*local, off, *remote, off, len);
      }
      puts.push_back(std::move(p));
    }
    return true;
  }

  void serve(Endpoint ep, std::optional<Version> have) {
    while (!stopping.load() && ep.status().ok()) {
      if (!store->wait_for_newer(have, kSenderPoll)) continue;
      const std::optional<Version> v = store->newest_held();
      if (!v) continue;
      if (!send_version(ep, *v)) break;
      // Sent in full, refused (the subscriber holds something newer) or dropped here for a newer
      // version: in every case nothing older than the newest is worth sending any more.
      have = v;
    }
  }

  void on_subscribe(Incoming in) {
    Reader r(in.message.body, "subscribe");
    auto has = r.get<std::uint8_t>();
    auto newest = r.get<std::uint64_t>();
    if (!has.ok() || !newest.ok()) {
      (void)in.from.reply_error(in, data_loss("relay: malformed subscribe message"));
      return;
    }
    std::optional<Version> have;
    if (*has != 0) have = Version(*newest);
    (void)in.from.reply(in, Message{kSubscribe, {}});
    std::lock_guard lock(mu);
    if (stopping.load()) return;
    downstreams.push_back(in.from);
    ++stats.subscribers;
    senders.emplace_back([this, ep = in.from, have]() mutable { serve(ep, have); });
  }

  // ---- downstream side: take versions from the upstream ----

  void on_begin(Incoming in) {
    Reader r(in.message.body, "begin");
    auto v = r.get<std::uint64_t>();
    auto chunk_bytes = r.get<std::uint64_t>();
    if (!v.ok() || !chunk_bytes.ok()) {
      (void)in.from.reply_error(in, v.ok() ? chunk_bytes.status() : v.status());
      return;
    }
    const auto rest = r.rest();
    auto manifest = WeightManifest::from_json({reinterpret_cast<const char*>(rest.data()), rest.size()});
    if (!manifest.ok()) {
      (void)in.from.reply_error(in, manifest.status());
      return;
    }
    const Version ver(*v);
    auto missing = store->missing_chunks(ver);
    if (!missing.ok()) {
      auto plan = ChunkPlan::make(manifest->total_bytes(), *chunk_bytes);
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
    Writer w(4 + missing->size() * 4);
    w.put<std::uint32_t>(std::uint32_t(missing->size()));
    for (std::uint32_t i : *missing) w.put<std::uint32_t>(i);
    w.put_bytes(region->remote().serialize());
    (void)in.from.reply(in, Message{kBegin, w.take()});
  }

  void on_chunk(Incoming in) {
    Reader r(in.message.body, "chunk");
    auto v = r.get<std::uint64_t>();
    auto i = r.get<std::uint32_t>();
    auto h = r.get<std::uint64_t>();
    if (!v.ok() || !i.ok() || !h.ok() || !r.rest().empty()) {
      (void)in.from.reply_error(in, data_loss(fmt::format("relay: chunk message of {} bytes, 20 expected",
                                                          in.message.body.size())));
      return;
    }
    const Version ver(*v);
    if (hooks.ignore_incoming_chunk) {
      std::uint64_t received = 0;
      {
        std::lock_guard lock(mu);
        received = stats.chunks_received;
      }
      // Hung: the chunk is neither stored nor answered. The callback thread stays free, so
      // subscribers are still served what is already here.
      if (hooks.ignore_incoming_chunk(ver, *i, received)) return;
    }
    const bool had = store->newest_version() == ver;
    Status st = store->seal_in_place(ver, *i, *h);
    if (st.code() == StatusCode::kDataLoss) emit({RelayEvent::Kind::kChunkRejected, ver, *i, {}});
    if (!st.ok()) {
      (void)in.from.reply_error(in, st);
      return;
    }
    {
      std::lock_guard lock(mu);
      ++stats.chunks_received;
    }
    emit({RelayEvent::Kind::kChunkStored, ver, *i, {}});
    (void)in.from.reply(in, Message{kChunk, {}});
    if (!had && store->newest_version() == ver) emit({RelayEvent::Kind::kCommitted, ver, 0, {}});
  }

  // Waits until the upstream link closes (the transport reports it) or the node stops; true when
  // stopping.
  bool wait_while_linked(const Endpoint& ep) {
    auto closed = std::make_shared<bool>(false);  // guarded by mu
    auto watch = ep.on_close([this, closed](const Status&) {
      std::lock_guard lock(mu);
      *closed = true;
      cv.notify_all();
    });
    if (!watch.ok()) return stopping.load();
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return stopping.load() || *closed; });
    const bool stop = stopping.load();
    lock.unlock();
    watch->reset();  // waits for a running callback, which takes mu: not under the lock
    return stop;
  }

  void subscribe_loop() {
    std::size_t k = 0;
    while (!stopping.load()) {
      const std::string addr = options.upstreams[k % options.upstreams.size()];
      ++k;
      auto ep = transport->connect(addr, options.connect_timeout);
      Status subscribed = ep.status();
      if (ep.ok()) {
        const std::optional<Version> have = store->newest_version();
        Writer w;
        w.put<std::uint8_t>(have ? 1 : 0);
        w.put<std::uint64_t>(have ? have->value() : 0);
        subscribed = internal::request_protocol(*ep, Message{kSubscribe, w.take()}).status();
        if (!subscribed.ok()) ep->close();
      }
      if (!subscribed.ok()) {
        // The pause is timed from the failure, read before the event goes out: whoever reacts to
        // the event by moving the clock then always moves it past this deadline.
        const Duration retry_at = internal::deadline_after(*clock, options.retry_interval);
        emit({RelayEvent::Kind::kUpstreamUnreachable, Version(), 0, addr});
        // Once round the whole list without a link: pause before the next round.
        if (k % options.upstreams.size() == 0 && wait_for_stop(retry_at)) break;
        continue;
      }
      {
        std::lock_guard lock(mu);
        upstream = addr;
        upstream_ep = *ep;
      }
      emit({RelayEvent::Kind::kUpstream, Version(), 0, addr});
      if (wait_while_linked(*ep)) break;
      {
        std::lock_guard lock(mu);
        upstream.reset();
        ++stats.failovers;
      }
      emit({RelayEvent::Kind::kUpstreamLost, Version(), 0, addr});
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
    {
      std::lock_guard lock(g_hosts_mu);
      if (!g_hosts.insert(transport.get()).second) {
        return already_exists("relay node: another relay node already serves on this transport");
      }
    }
    auto impl = std::make_unique<RelayNode::Impl>(std::move(transport), std::move(store), std::move(options),
                                                  std::move(hooks));
    impl->clock_wake = impl->clock->subscribe([raw = impl.get()] {
      std::lock_guard lock(raw->mu);
      raw->cv.notify_all();
    });
    Transport& t = *impl->transport;
    // The types are laminar's own, in the reserved range: registering them cannot fail.
    RelayNode::Impl* p = impl.get();
    LAMINAR_CHECK(on_protocol_message(t, kSubscribe, p->gate.wrap([p](Incoming in) { p->on_subscribe(std::move(in)); }))
                      .ok());
    LAMINAR_CHECK(on_protocol_message(t, kBegin, p->gate.wrap([p](Incoming in) { p->on_begin(std::move(in)); })).ok());
    LAMINAR_CHECK(on_protocol_message(t, kChunk, p->gate.wrap([p](Incoming in) { p->on_chunk(std::move(in)); })).ok());
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
  // A handler that started before its removal finishes before anything it uses goes.
  impl_->gate.close();
  {
    std::lock_guard lock(impl_->mu);
    impl_->stopping = true;
    impl_->cv.notify_all();
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
  std::lock_guard lock(g_hosts_mu);
  g_hosts.erase(impl_->transport.get());
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

std::string RelayNodeStats::to_json() const {
  return fmt::format(R"({{"chunks_received":{},"chunks_sent":{},"chunks_resent":{},"failovers":{},"subscribers":{}}})",
                     chunks_received, chunks_sent, chunks_resent, failovers, subscribers);
}

}  // namespace laminar
