#include "laminar/relay_node.h"

#include <fmt/format.h>

#include <cstring>
#include <deque>
#include <map>
#include <future>
#include <mutex>
#include <thread>

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

// Little-endian packing of the few integers the protocol carries.
class Writer {
 public:
  explicit Writer(std::size_t reserve = 0) { out_.reserve(reserve); }
  template <class T>
  void put(T x) {
    const auto* p = reinterpret_cast<const std::byte*>(&x);
    out_.insert(out_.end(), p, p + sizeof(T));
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
  std::shared_ptr<RelayStore> store;
  RelayChainOptions options;
  std::unique_ptr<Transport> transport;

  std::atomic<bool> stopping{false};
  mutable std::mutex mu;  // guards everything below
  std::vector<std::thread> senders;
  std::vector<Endpoint> downstreams;
  std::optional<std::string> upstream;
  Endpoint upstream_ep;
  RelayNodeStats stats;
  Status first_error;
  bool corrupt_done = false;
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

  bool corrupt_now(Version v, std::uint32_t i) {
    std::lock_guard lock(mu);
    if (!options.corrupt_chunk_once || corrupt_done || options.corrupt_chunk_once->first != v ||
        options.corrupt_chunk_once->second != i) {
      return false;
    }
    corrupt_done = true;
    return true;
  }

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
      MemoryRegion scratch;  // the corrupted copy a fault-injection put reads from
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
      auto c = store->read_chunk(v, i, std::chrono::milliseconds(200));
      if (!c.ok()) {
        if (c.status().code() == StatusCode::kDeadlineExceeded) continue;  // upstream of ours is slow
        return true;  // v was dropped (a newer version committed here): stop sending it
      }
      todo.pop_front();
      const std::uint64_t off = plan.chunk_offset(i);
      const std::size_t len = c->bytes.size();
      Put p{i, c->checksum, {}, {}};
      if (corrupt_now(v, i)) {
        auto scratch = transport->allocate(len);
        if (!scratch.ok()) return true;
        std::memcpy(scratch->data(), c->bytes.data(), len);
        scratch->data()[len / 2] ^= std::byte{0x40};
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
      if (!store->wait_for_newer(have, std::chrono::milliseconds(100))) continue;
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
    if (options.stall_after_chunks != 0) {
      std::lock_guard lock(mu);
      // Hung: the chunk is neither stored nor answered. The callback thread stays free, so
      // subscribers are still served what is already here.
      if (stats.chunks_received >= options.stall_after_chunks) return;
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
    (void)in.from.reply(in, Message{kChunk, {}});
    if (!had && store->newest_version() == ver) emit({RelayEvent::Kind::kCommitted, ver, 0, {}});
  }

  void subscribe_loop() {
    std::size_t k = 0;
    while (!stopping.load()) {
      const std::string addr = options.upstreams[k % options.upstreams.size()];
      auto ep = transport->connect(addr, options.connect_timeout);
      if (!ep.ok()) {
        ++k;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        continue;
      }
      const std::optional<Version> have = store->newest_version();
      Writer w;
      w.put<std::uint8_t>(have ? 1 : 0);
      w.put<std::uint64_t>(have ? have->value() : 0);
      if (!internal::request_protocol(*ep, Message{kSubscribe, w.take()}).ok()) {
        ep->close();
        ++k;
        continue;
      }
      {
        std::lock_guard lock(mu);
        upstream = addr;
        upstream_ep = *ep;
      }
      emit({RelayEvent::Kind::kUpstream, Version(), 0, addr});
      while (!stopping.load() && ep->status().ok()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      if (stopping.load()) break;
      {
        std::lock_guard lock(mu);
        upstream.reset();
        ++stats.failovers;
      }
      emit({RelayEvent::Kind::kUpstreamLost, Version(), 0, addr});
      ++k;  // re-form around the lost relay: try the next one up the list
    }
  }
};

RelayNode::RelayNode(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<RelayNode>> RelayNode::start(std::shared_ptr<RelayStore> store, RelayChainOptions options) {
  if (!store) return invalid_argument("relay node: the store is null");
  if (options.window == 0) return invalid_argument("relay node: window is 0");
  auto impl = std::make_unique<Impl>();
  impl->store = std::move(store);
  impl->options = std::move(options);
  auto t = Transport::create(impl->options.transport);
  LAMINAR_RETURN_IF_ERROR(t.status().with_context("relay node"));
  impl->transport = std::move(*t);
  Impl* p = impl.get();
  // The types are laminar's own, in the reserved range: registering them cannot fail.
  LAMINAR_CHECK(
      internal::on_protocol_message(*impl->transport, kSubscribe, [p](Incoming in) { p->on_subscribe(std::move(in)); })
          .ok());
  LAMINAR_CHECK(
      internal::on_protocol_message(*impl->transport, kBegin, [p](Incoming in) { p->on_begin(std::move(in)); })
          .ok());
  LAMINAR_CHECK(
      internal::on_protocol_message(*impl->transport, kChunk, [p](Incoming in) { p->on_chunk(std::move(in)); })
          .ok());
  auto addr = impl->transport->listen(impl->options.listen_host, impl->options.listen_port);
  LAMINAR_RETURN_IF_ERROR(addr.status().with_context("relay node"));
  std::unique_ptr<RelayNode> node(new RelayNode(std::move(impl)));
  node->address_ = *addr;
  if (!p->options.upstreams.empty()) p->subscriber = std::thread([p] { p->subscribe_loop(); });
  return node;
}

RelayNode::~RelayNode() {
  impl_->stopping = true;
  if (impl_->subscriber.joinable()) impl_->subscriber.join();
  std::vector<std::thread> senders;
  {
    std::lock_guard lock(impl_->mu);
    for (Endpoint& ep : impl_->downstreams) ep.close();
    if (impl_->upstream_ep.valid()) impl_->upstream_ep.close();
    senders.swap(impl_->senders);
  }
  for (auto& t : senders) t.join();
  // Handlers reference impl_: the transport (and its callback thread) goes first.
  impl_->transport.reset();
}

std::optional<std::string> RelayNode::upstream() const {
  std::lock_guard lock(impl_->mu);
  return impl_->upstream;
}

RelayNodeStats RelayNode::stats() const {
  std::lock_guard lock(impl_->mu);
  return impl_->stats;
}

Status RelayNode::error() const {
  std::lock_guard lock(impl_->mu);
  return impl_->first_error;
}

}  // namespace laminar
