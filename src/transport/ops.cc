// Operations of a Transport: ops and deadlines, frames in and out, requests, put/get, failures.
#include <fmt/format.h>
#include <ucp/api/ucp.h>

#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "byte_codec.h"
#include "laminar/transport.h"
#include "transport/core.h"
#include "transport/same_host.h"
#include "transport/wire.h"

namespace laminar::internal {

// ---------------------------------------------------------------------------------------------
// Operations (progress thread)

Op& TransportCore::new_op(Op::Kind kind, std::uint64_t ep_id, Duration timeout, std::string what) {
  note_activity(ep_id);
  auto op = std::make_unique<Op>();
  op->kind = kind;
  op->id = next_op_id_++;
  op->ep_id = ep_id;
  op->core = this;
  op->what = std::move(what);
  op->timeout = timeout;
  if (timeout != kForever) {
    const Duration now = clock_->now();
    // A deadline past the clock's range is no deadline.
    if (timeout < kForever - now) {
      op->deadline_it = deadlines_.emplace(now + timeout, op->id).first;
      op->has_deadline = true;
    }
  }
  Op& ref = *op;
  ops_.emplace(ref.id, std::move(op));
  return ref;
}

void TransportCore::maybe_release(Op& op) {
  // Erased later by sweep(), from the loop's top level: callers up the stack may still use `op`.
  if (op.resolved && op.ucx_inflight == 0) release_candidates_.push_back(op.id);
}

void TransportCore::sweep() {
  for (std::uint64_t id : std::exchange(release_candidates_, {})) {
    auto it = ops_.find(id);
    if (it != ops_.end() && it->second->resolved && it->second->ucx_inflight == 0) ops_.erase(it);
  }
}

void TransportCore::note_activity(EndpointState& e) {
  if (options_.idle_timeout != kForever) e.last_active = clock_->now();
}

void TransportCore::note_activity(std::uint64_t ep_id) {
  if (options_.idle_timeout == kForever) return;
  if (auto e = find(ep_id)) note_activity(*e);
}

void TransportCore::resolve(Op& op, const Status& s) {
  if (op.resolved) return;
  op.resolved = true;
  note_activity(op.ep_id);
  if (op.has_deadline) deadlines_.erase(op.deadline_it);
  op.has_deadline = false;
  switch (op.kind) {
    case Op::Kind::kSend:
      op.status_promise.set_value(s);
      break;
    case Op::Kind::kRma:
      op.status_promise.set_value(s);
      if (op.done) post_callback([done = std::move(op.done), s] { done(s); });
      break;
    case Op::Kind::kConnect:
      op.connect_promise.set_value(s.ok()
                                       ? Result<Endpoint>(internal_error("connect resolved without endpoint"))
                                       : Result<Endpoint>(s));
      break;
    case Op::Kind::kRequest:
      op.reply_promise.set_value(s.ok() ? Result<Message>(internal_error("request resolved without reply"))
                                        : Result<Message>(s));
      if (op.answered) op.answered();
      break;
    case Op::Kind::kHandshake:
    case Op::Kind::kReceive:
    case Op::Kind::kLanding:
      break;
  }
  maybe_release(op);
}

void TransportCore::resolve_connect(Op& op, std::shared_ptr<EndpointState> e) {
  if (op.resolved) return;
  op.resolved = true;
  if (op.has_deadline) deadlines_.erase(op.deadline_it);
  op.has_deadline = false;
  op.connect_promise.set_value(make_endpoint(std::move(e)));
  maybe_release(op);
}

void TransportCore::resolve_reply(Op& op, Result<Message> r) {
  if (op.resolved) return;
  if (!r.ok()) {
    resolve(op, r.status());
    return;
  }
  op.resolved = true;
  if (op.has_deadline) deadlines_.erase(op.deadline_it);
  op.has_deadline = false;
  op.reply_promise.set_value(std::move(r));
  if (op.answered) op.answered();
  maybe_release(op);
}

void TransportCore::expire_deadlines() {
  const Duration now = clock_->now();
  while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
    const std::uint64_t id = deadlines_.begin()->second;
    auto it = ops_.find(id);
    LAMINAR_CHECK(it != ops_.end());
    Op& op = *it->second;
    const Status late =
        deadline_exceeded(fmt::format("{} took longer than {}", op.what, duration_text(op.timeout)));
    auto e = (op.kind == Op::Kind::kConnect || op.kind == Op::Kind::kHandshake) ? find(op.ep_id) : nullptr;
    if (e != nullptr) {
      // A half-open connection is useless; failing the endpoint resolves its handshake op too.
      fail_endpoint(*e, late);
    }
    resolve(op, late);
  }
}

void TransportCore::close_idle_connections() {
  if (options_.idle_timeout == kForever) return;
  const Duration now = clock_->now();
  if (now < next_idle_check_) return;
  next_idle_check_ = now + std::min<Duration>(options_.idle_timeout / 4, std::chrono::seconds(1));
  std::set<std::uint64_t> busy;
  for (const auto& [id, op] : ops_) {
    if (!op->resolved) busy.insert(op->ep_id);
  }
  std::vector<std::shared_ptr<EndpointState>> idle;
  for (const auto& [id, e] : endpoints_) {
    if (e->phase == Phase::kReady && e->unanswered == 0 && !busy.contains(id) &&
        now - e->last_active >= options_.idle_timeout) {
      idle.push_back(e);
    }
  }
  for (const auto& e : idle) {
    fail_endpoint(*e, unavailable(fmt::format("connection with {} closed after {} without traffic (idle_timeout)",
                                              e->peer, duration_text(options_.idle_timeout))));
  }
}

void TransportCore::on_ucx_done(Op& op, ucs_status_t status) {
  --op.ucx_inflight;
  --ucx_inflight_;
  switch (op.kind) {
    case Op::Kind::kSend:
      resolve(op, status == UCS_OK ? ok_status()
                                   : unavailable(fmt::format("{} failed: {}", op.what, ucs_text(status))));
      break;
    case Op::Kind::kRequest:
      // The frame left; the answer resolves the op.
      if (status != UCS_OK) resolve(op, unavailable(fmt::format("{} failed: {}", op.what, ucs_text(status))));
      break;
    case Op::Kind::kConnect:
      // The flush of a new UCP endpoint: UCX has connected the two workers, or cannot.
      if (auto e = find(op.ep_id); e != nullptr && e->phase == Phase::kWireup) {
        if (status == UCS_OK) {
          finish_connect(*e);
        } else {
          fail_endpoint(*e, unavailable(fmt::format("cannot connect to {}: {}", e->peer, ucs_text(status))));
        }
      }
      break;
    case Op::Kind::kHandshake:
      break;
    case Op::Kind::kRma:
      if (op.receiving) {
        on_landed(op, status);
      } else if (status != UCS_OK && op.rma_error.ok()) {
        op.rma_error = unavailable(fmt::format("{} failed: {}", op.what, ucs_text(status)));
      }
      // Over active messages, a put or get ends with its peer's answer or bytes, unless it failed.
      if (op.ucx_inflight == 0 && (!op.awaits_peer || op.peer_done || !op.rma_error.ok())) {
        release_rkey(op);
        resolve(op, op.rma_error);
      }
      break;
    case Op::Kind::kLanding:
      on_landed(op, status);
      break;
    case Op::Kind::kReceive:
      if (status == UCS_OK) {
        if (auto e = find(op.ep_id)) handle_frame(*e, op.buffer);
      } else if (auto e = find(op.ep_id)) {
        fail_endpoint(*e, unavailable(fmt::format("receiving a message from {} failed: {}", e->peer,
                                                  ucs_text(status))));
      }
      resolve(op, ok_status());
      break;
  }
  maybe_release(op);
}

void TransportCore::am_send_cb(void* request, ucs_status_t status, void* user) {
  Op& op = *static_cast<Op*>(user);
  op.core->on_ucx_done(op, status);
  ucp_request_free(request);
}

void TransportCore::am_recv_data_cb(void* request, ucs_status_t status, std::size_t, void* user) {
  Op& op = *static_cast<Op*>(user);
  op.core->on_ucx_done(op, status);
  ucp_request_free(request);
}

void TransportCore::start_send(EndpointState& e, Op& op) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = &TransportCore::am_send_cb;
  p.user_data = &op;
  // The header is the receiver's token for this connection (op.header, set by the caller).
  void* req =
      ucp_am_send_nbx(e.ep(), kAmId, &op.header, sizeof(op.header), op.buffer.data(), op.buffer.size(), &p);
  if (req == nullptr) {
    if (op.kind == Op::Kind::kSend) resolve(op, ok_status());
    return;
  }
  if (UCS_PTR_IS_ERR(req)) {
    resolve(op, unavailable(fmt::format("{} failed: {}", op.what, ucs_text(UCS_PTR_STATUS(req)))));
    return;
  }
  ++op.ucx_inflight;
  ++ucx_inflight_;
}

std::shared_ptr<EndpointState> TransportCore::find(std::uint64_t id) {
  auto it = endpoints_.find(id);
  return it == endpoints_.end() ? nullptr : it->second;
}

Result<ucp_rkey_h> TransportCore::acquire_rkey(EndpointState& e, Op& op,
                                               const std::vector<std::byte>& packed) {
  constexpr std::size_t kMaxCachedRkeys = 256;
  std::string key(reinterpret_cast<const char*>(packed.data()), packed.size());
  auto it = e.rkeys.find(key);
  if (it == e.rkeys.end()) {
    if (e.rkeys.size() >= kMaxCachedRkeys) {
      for (auto c = e.rkeys.begin(); c != e.rkeys.end();) {
        if (c->second.users == 0) {
          ucp_rkey_destroy(c->second.handle);
          c = e.rkeys.erase(c);
        } else {
          ++c;
        }
      }
    }
    ucp_rkey_h handle = nullptr;
    const ucs_status_t s = ucp_ep_rkey_unpack(e.ep(), packed.data(), &handle);
    if (s != UCS_OK) {
      // A malformed key is the caller's; a well-formed one that cannot be attached (shared memory of
      // a peer that died or freed the region) is the peer's state, like any vanished peer.
      const bool malformed = s == UCS_ERR_INVALID_PARAM || s == UCS_ERR_UNSUPPORTED;
      const std::string msg =
          fmt::format("{}: remote region of {} does not attach: {}", op.what, e.peer, ucs_text(s));
      return malformed ? invalid_argument(msg) : unavailable(msg);
    }
    it = e.rkeys.emplace(std::move(key), EndpointState::CachedRkey{handle, 0}).first;
  }
  ++it->second.users;
  op.rkey_bytes = it->first;
  return it->second.handle;
}

void TransportCore::release_rkey(Op& op) {
  if (op.rkey_bytes.empty()) return;
  if (auto e = find(op.ep_id)) {
    auto it = e->rkeys.find(op.rkey_bytes);
    if (it != e->rkeys.end()) --it->second.users;
  }
  op.rkey_bytes.clear();
}

void TransportCore::destroy_rkeys(EndpointState& e) {
  // UCX requests of this endpoint may still point at these until its close completes.
  for (auto& [bytes, c] : e.rkeys) dead_rkeys_.push_back(c.handle);
  e.rkeys.clear();
}

void TransportCore::fail_endpoint(EndpointState& e, const Status& s) {
  auto keep = find(e.id);  // e may be erased below
  set_endpoint_error(e, s);
  const Status err = e.status();
  e.phase = Phase::kClosed;
  std::vector<Op*> pending;
  for (auto& [id, op] : ops_) {
    if (op->ep_id == e.id && !op->resolved) pending.push_back(op.get());
  }
  for (Op* op : pending) resolve(*op, err);
  destroy_rkeys(e);
  close_connection(e);
  endpoints_.erase(e.id);
}

void TransportCore::set_endpoint_error(EndpointState& e, const Status& s) {
  if (!e.set_error(s)) return;
  post_callback([keep = e.shared_from_this()] { keep->fire_close_watchers(); });
}

void TransportCore::handle_frame(EndpointState& e, std::span<const std::byte> wire) {
  if (e.phase != Phase::kReady) return;
  note_activity(e);
  Result<Frame> decoded = decode_frame(wire, options_.max_message_bytes);
  if (!decoded.ok()) {
    fail_endpoint(e, decoded.status().with_context(fmt::format("message from {}", e.peer)));
    return;
  }
  Frame f = std::move(*decoded);
  switch (f.kind) {
    case FrameKind::kMessage:
    case FrameKind::kRequest: {
      if (f.kind == FrameKind::kRequest) ++e.unanswered;
      Incoming in{make_endpoint(find(e.id)), Message{f.type, std::move(f.body)},
                  RequestId(f.kind == FrameKind::kRequest ? f.id : 0)};
      post_callback([this, in = std::move(in)]() mutable {
        MessageHandler handler;
        {
          std::lock_guard lock(handlers_mu_);
          auto it = handlers_.find(in.message.type);
          if (it != handlers_.end()) handler = it->second;
        }
        if (handler) {
          handler(std::move(in));
          return;
        }
        if (is_reserved(in.message.type)) {
          // A laminar protocol this process does not run: receive() is the application's, so the
          // message goes nowhere, and a requester learns why at once rather than at its deadline.
          if (in.request_id != RequestId()) {
            (void)in.from.reply_error(
                in, unimplemented(fmt::format("no laminar protocol serves message type {:#x} here",
                                              in.message.type)));
          }
          return;
        }
        if (Status refused = enqueue(std::move(in)); !refused.ok() && in.request_id != RequestId()) {
          (void)in.from.reply_error(in, refused);
        }
      });
      return;
    }
    case FrameKind::kReply:
    case FrameKind::kErrorReply: {
      auto it = ops_.find(f.id);
      // A reply to a request that already timed out, or an id this side never issued: drop it.
      if (it == ops_.end() || it->second->kind != Op::Kind::kRequest || it->second->ep_id != e.id) return;
      if (f.kind == FrameKind::kReply) {
        resolve_reply(*it->second, Message{f.type, std::move(f.body)});
      } else {
        resolve_reply(*it->second, Status(f.code, fmt::format("peer {}: {}", e.peer, f.error)));
      }
      return;
    }
    default:
      // The handshake runs on the bootstrap socket; over UCX a peer sends messages and replies only.
      fail_endpoint(e, data_loss(fmt::format("peer {} sent frame kind {} over UCX, which carries only "
                                             "messages, requests and replies",
                                             e.peer, static_cast<int>(f.kind))));
  }
}

std::shared_ptr<EndpointState> TransportCore::ready_by_token(std::uint64_t token) {
  const auto by_token = token == 0 ? by_token_.end() : by_token_.find(token);
  auto e = by_token == by_token_.end() ? nullptr : find(by_token->second);
  // The client's first frame may overtake its ready on the bootstrap socket; either one opens it.
  if (e != nullptr && e->phase == Phase::kAwaitReady) open_accepted(*e);
  return e != nullptr && e->phase == Phase::kReady ? e : nullptr;
}

ucs_status_t TransportCore::am_recv_cb(void* arg, const void* header, std::size_t header_length, void* data,
                                       std::size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<TransportCore*>(arg);
  // The header names the connection by the token this side gave it in the handshake; a frame
  // without a token of an open connection is dropped before a byte of it is read.
  ByteReader h(std::span(static_cast<const std::byte*>(header), header_length), "frame header");
  std::uint64_t token = h.u64("token");
  if (!h.finish().ok()) token = 0;
  auto e = self->ready_by_token(token);
  if (e == nullptr) {
    self->dropped_frames_.fetch_add(1, std::memory_order_relaxed);
    return UCS_OK;
  }
  const std::size_t limit = self->options_.max_message_bytes + kFrameOverheadBytes;
  if (length > limit) {
    self->fail_endpoint(*e, invalid_argument(fmt::format("peer {} sent a frame of {} bytes, over the limit of {}",
                                                         e->peer, length, limit)));
    return UCS_OK;
  }
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    self->handle_frame(*e, {static_cast<const std::byte*>(data), length});
    return UCS_OK;
  }
  Op& op = self->new_op(Op::Kind::kReceive, e->id, kForever, fmt::format("message from {}", e->peer));
  op.buffer.resize(length);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = &TransportCore::am_recv_data_cb;
  p.user_data = &op;
  void* req = ucp_am_recv_data_nbx(self->worker_, data, op.buffer.data(), length, &p);
  if (req == nullptr) {
    self->handle_frame(*e, op.buffer);
    self->resolve(op, ok_status());
  } else if (UCS_PTR_IS_ERR(req)) {
    self->fail_endpoint(*e, unavailable(fmt::format("receiving a message from {} failed: {}", e->peer,
                                                    ucs_text(UCS_PTR_STATUS(req)))));
    self->resolve(op, ok_status());
  } else {
    ++op.ucx_inflight;
    ++self->ucx_inflight_;
  }
  return UCS_OK;
}

void TransportCore::ep_error_cb(void* arg, ucp_ep_h ep, ucs_status_t status) {
  // UCX calls this from inside whichever of its calls noticed the failure: progress, but also a
  // get, a send or a flush of ours, halfway through an operation that still holds the endpoint.
  // So it is only noted here, and handled from the loop's top level (fail_peer_workers).
  static_cast<TransportCore*>(arg)->failed_peers_.emplace_back(ep, status);
}

void TransportCore::fail_peer_workers() {
  for (const auto& [ep, status] : std::exchange(failed_peers_, {})) {
    auto it = by_handle_.find(ep);
    if (it == by_handle_.end()) continue;
    // Every connection to that worker rode on this endpoint.
    const std::shared_ptr<PeerWorker> w = it->second;
    for (const std::uint64_t id : std::set<std::uint64_t>(w->endpoints)) {
      // A client sends its ready and may exit at once; UCX can notice the exit before we read the
      // ready. Read it first, so that a connect the client saw succeed is also accepted here.
      if (auto e = find(id); e != nullptr && e->phase == Phase::kAwaitReady && e->socket) read_socket(*e);
      if (auto e = find(id)) {
        const std::string what = e->phase == Phase::kWireup ? fmt::format("cannot connect to {}", e->peer)
                                                            : fmt::format("peer {} vanished", e->peer);
        fail_endpoint(*e, unavailable(fmt::format("{}: {}", what, ucs_text(status))));
      }
    }
    by_handle_.erase(ep);
    peers_.erase(w->address);
    to_close_.push_back(std::exchange(w->ep, nullptr));
  }
}

// ---------------------------------------------------------------------------------------------
// Public operations (any thread -> progress thread)

bool TransportCore::wait_queue(std::unique_lock<std::mutex>& lock, Duration timeout,
                               const std::function<bool()>& ready) {
  const Duration now = clock_->now();
  const Duration deadline = timeout < kForever - now ? now + timeout : kForever;
  while (!ready()) {
    if (deadline != kForever && clock_->now() >= deadline) return false;
    clock_->wait_until(queues_cv_, lock, deadline);
  }
  return true;
}

void TransportCore::on_message(MessageType type, MessageHandler handler) {
  std::lock_guard lock(handlers_mu_);
  if (handler) {
    handlers_[type] = std::move(handler);
  } else {
    handlers_.erase(type);
  }
}

Result<Incoming> TransportCore::receive(Duration timeout) {
  if (timeout.count() < 0) return invalid_argument(fmt::format("receive timeout of {} ns is negative", timeout.count()));
  if (options_.max_inbox_bytes == 0 || options_.max_inbox_bytes_per_connection == 0) {
    return failed_precondition("receive() is off: TransportOptions gives its queue no room");
  }
  std::unique_lock lock(queues_mu_);
  if (!wait_queue(lock, timeout, [&] { return shut_down_ || !inbox_.empty(); })) {
    return deadline_exceeded(fmt::format("no message arrived within {}", duration_text(timeout)));
  }
  if (shut_down_) return cancelled("transport shut down");
  Incoming in = std::move(inbox_.front());
  inbox_.pop_front();
  const std::size_t bytes = inbox_cost(in);
  inbox_bytes_ -= bytes;
  auto it = inbox_bytes_by_endpoint_.find(in.from.id().value());
  if ((it->second -= bytes) == 0) inbox_bytes_by_endpoint_.erase(it);
  return in;
}

std::size_t TransportCore::inbox_cost(const Incoming& in) {
  return in.message.body.size() + TransportOptions::kInboxOverheadBytes;
}

// Callback thread. On refusal `in` is left intact, so the caller can still answer the request.
Status TransportCore::enqueue(Incoming&& in) {
  const std::size_t bytes = inbox_cost(in);
  {
    std::lock_guard lock(queues_mu_);
    if (shut_down_) return ok_status();
    std::size_t& mine = inbox_bytes_by_endpoint_[in.from.id().value()];
    const bool over_connection = mine + bytes > options_.max_inbox_bytes_per_connection;
    if (over_connection || inbox_bytes_ + bytes > options_.max_inbox_bytes) {
      if (mine == 0) inbox_bytes_by_endpoint_.erase(in.from.id().value());
      ++inbox_refused_;
      return resource_exhausted(fmt::format(
          "message type {} has no handler here and the receive() queue of {} is full ({} of {} bytes{})",
          in.message.type, over_connection ? "this connection" : "this process",
          over_connection ? mine : inbox_bytes_,
          over_connection ? options_.max_inbox_bytes_per_connection : options_.max_inbox_bytes,
          over_connection ? " from this connection" : ""));
    }
    mine += bytes;
    inbox_bytes_ += bytes;
    inbox_.push_back(std::move(in));
  }
  queues_cv_.notify_all();
  return ok_status();
}

TransportStats TransportCore::stats() {
  TransportStats s;
  {
    std::lock_guard lock(queues_mu_);
    s.inbox_messages = inbox_.size();
    s.inbox_bytes = inbox_bytes_;
    s.inbox_refused = inbox_refused_;
  }
  s.dropped_frames = dropped_frames_.load(std::memory_order_relaxed);
  s.workers_replaced = workers_replaced_.load(std::memory_order_relaxed);
  s.direct_copies = direct_copies_.load(std::memory_order_relaxed);
  return s;
}

Result<MemoryRegion> TransportCore::map_memory(void* data, std::size_t size, bool allocate) {
  if (size == 0) return invalid_argument("memory region of 0 bytes");
  if (!allocate && data == nullptr)
    return invalid_argument(fmt::format("memory region of {} bytes at null", size));
  ucp_mem_map_params_t mp{};
  mp.field_mask =
      UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  mp.address = allocate ? nullptr : data;
  mp.length = size;
  mp.flags = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
  ucp_mem_h memh = nullptr;
  ucs_status_t s = ucp_mem_map(context_, &mp, &memh);
  if (s != UCS_OK) {
    return allocate ? resource_exhausted(
                          fmt::format("cannot allocate {} bytes of registered memory: {}", size, ucs_text(s)))
                    : unavailable(fmt::format("cannot register {} bytes at {}: {}", size, data, ucs_text(s)));
  }
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH | UCP_MEM_ATTR_FIELD_MEM_TYPE;
  s = ucp_mem_query(memh, &attr);
  void* packed = nullptr;
  std::size_t packed_size = 0;
  if (s == UCS_OK) s = ucp_rkey_pack(context_, memh, &packed, &packed_size);
  if (s != UCS_OK) {
    ucp_mem_unmap(context_, memh);
    return unavailable(fmt::format("cannot describe registered memory of {} bytes: {}", size, ucs_text(s)));
  }
  std::vector<std::byte> rkey(static_cast<std::byte*>(packed), static_cast<std::byte*>(packed) + packed_size);
  ucp_rkey_buffer_release(packed);
  auto region = std::make_shared<RegionState>(shared_from_this(), memh, static_cast<std::byte*>(attr.address), size,
                                              std::move(rkey), attr.mem_type == UCS_MEMORY_TYPE_HOST);
  remember_region(region);
  return MemoryRegion(std::move(region));
}

RegionState::~RegionState() {
  core->forget_region(this);
  ucp_mem_unmap(core->context(), memh);
}

void TransportCore::remember_region(const std::shared_ptr<RegionState>& region) {
  std::lock_guard l(regions_mu_);
  regions_.emplace(region.get(), region);
}

void TransportCore::forget_region(const RegionState* region) {
  std::lock_guard l(regions_mu_);
  regions_.erase(region);
}

std::shared_ptr<RegionState> TransportCore::host_region_holding(std::uint64_t address, std::size_t length) {
  std::lock_guard l(regions_mu_);
  for (const auto& [raw, weak] : regions_) {
    const auto start = reinterpret_cast<std::uintptr_t>(raw->data);
    if (!raw->host_memory || address < start || address - start > raw->size || length > raw->size - (address - start))
      continue;
    if (auto region = weak.lock()) return region;
  }
  return nullptr;
}

namespace {

// The header of every message on kRmaAmId, little-endian: u64 the receiver's token for the
// connection, u8 kind, u64 the initiator's op id, u64 address, u64 length, u8 status code
// (kAnswer). The bytes carry no checksum of their own, as with UCX's puts: the link's (TCP's) is
// theirs, and the parts above check what they move (the relay's chunks, the KV migration's pages).
enum class RmaAm : std::uint8_t {
  kWrite = 1,        // the bytes, to land at `address` in the receiver's memory; answered
  kReadRequest = 2,  // send back `length` bytes from `address`
  kReadData = 3,     // the bytes of a kReadRequest, to land where its op reads into
  kAnswer = 4,       // the end of a kWrite or kReadRequest: `code`, and an error text as data
};
struct RmaHeader {
  std::uint64_t token = 0;
  RmaAm kind = RmaAm::kWrite;
  std::uint64_t op = 0;
  std::uint64_t address = 0;
  std::uint64_t length = 0;
  StatusCode code = StatusCode::kOk;
};
constexpr std::size_t kRmaHeaderBytes = 8 + 1 + 8 + 8 + 8 + 1;

std::vector<std::byte> encode_rma_header(const RmaHeader& h) {
  std::vector<std::byte> out;
  ByteWriter w(out);
  w.reserve(kRmaHeaderBytes);
  w.u64(h.token);
  w.u8(std::uint8_t(h.kind));
  w.u64(h.op);
  w.u64(h.address);
  w.u64(h.length);
  w.u8(std::uint8_t(h.code));
  return out;
}

Result<RmaHeader> decode_rma_header(std::span<const std::byte> bytes) {
  ByteReader r(bytes, "put/get header");
  RmaHeader h;
  h.token = r.u64("token");
  const std::uint8_t kind = r.u8("kind");
  h.op = r.u64("op");
  h.address = r.u64("address");
  h.length = r.u64("length");
  const std::uint8_t code = r.u8("status code");
  LAMINAR_RETURN_IF_ERROR(r.finish());
  if (kind < std::uint8_t(RmaAm::kWrite) || kind > std::uint8_t(RmaAm::kAnswer) ||
      code > std::uint8_t(StatusCode::kInternal)) {
    return data_loss(fmt::format("put/get header: kind {}, status code {}", kind, code));
  }
  h.kind = RmaAm(kind);
  h.code = StatusCode(code);
  return h;
}

}  // namespace

void TransportCore::rma_over_am(EndpointState& e, Op& op, bool is_put, std::byte* local, std::uint64_t raddr,
                                std::size_t length) {
  op.awaits_peer = true;
  op.is_get = !is_put;
  op.landing = local;
  op.landing_bytes = length;
  op.buffer = encode_rma_header(
      {e.peer_token, is_put ? RmaAm::kWrite : RmaAm::kReadRequest, op.id, raddr, length, StatusCode::kOk});
  send_rma_am(e, op, is_put ? std::span<const std::byte>(local, length) : std::span<const std::byte>());
}

void TransportCore::send_rma_am(EndpointState& e, Op& op, std::span<const std::byte> data) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = &TransportCore::am_send_cb;
  p.user_data = &op;
  if (op.region && !data.empty()) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = op.region->memh;
  }
  // The header is op.buffer's first kRmaHeaderBytes (UCX reads it until the send completes); an
  // answer's error text follows it there.
  void* req = ucp_am_send_nbx(e.ep(), kRmaAmId, op.buffer.data(), kRmaHeaderBytes, data.data(), data.size(), &p);
  if (UCS_PTR_IS_ERR(req)) {
    resolve(op, unavailable(fmt::format("{} failed: {}", op.what, ucs_text(UCS_PTR_STATUS(req)))));
  } else if (req != nullptr) {
    ++op.ucx_inflight;
    ++ucx_inflight_;
  } else if (op.kind == Op::Kind::kSend) {
    resolve(op, ok_status());
  }
}

void TransportCore::answer_rma(std::uint64_t ep_id, std::uint64_t peer_op, const Status& st) {
  // Sent from the command queue, not from inside the UCX callback that landed the bytes.
  (void)post([this, ep_id, peer_op, st] {
    auto e = find(ep_id);
    if (e == nullptr || e->phase != Phase::kReady) return;
    Op& op = new_op(Op::Kind::kSend, e->id, options_.operation_timeout, fmt::format("answer to a put of {}", e->peer));
    op.buffer = encode_rma_header({e->peer_token, RmaAm::kAnswer, peer_op, 0, 0, st.code()});
    const std::string text = st.message().substr(0, kMaxErrorTextBytes);
    const auto* t = reinterpret_cast<const std::byte*>(text.data());
    op.buffer.insert(op.buffer.end(), t, t + text.size());
    send_rma_am(*e, op, std::span<const std::byte>(op.buffer).subspan(kRmaHeaderBytes));
  });
}

bool TransportCore::land(Op& op, void* data, std::byte* to, std::size_t length, const ucp_am_recv_param_t* param) {
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    std::memcpy(to, data, length);
    return true;
  }
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = &TransportCore::am_recv_data_cb;
  p.user_data = &op;
  if (op.region) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = op.region->memh;
  }
  void* req = ucp_am_recv_data_nbx(worker_, data, to, length, &p);
  if (UCS_PTR_IS_ERR(req)) return false;
  if (req != nullptr) {
    op.receiving = true;
    ++op.ucx_inflight;
    ++ucx_inflight_;
  }
  return true;
}

ucs_status_t TransportCore::rma_recv_cb(void* arg, const void* header, std::size_t header_length, void* data,
                                        std::size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<TransportCore*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  // Bytes nobody takes: a rendezvous sender waits for them until they are released.
  const auto drop = [&] {
    self->dropped_frames_.fetch_add(1, std::memory_order_relaxed);
    if (rndv) ucp_am_data_release(self->worker_, data);
    return UCS_OK;
  };
  Result<RmaHeader> h = decode_rma_header(std::span(static_cast<const std::byte*>(header), header_length));
  if (!h.ok()) return drop();
  auto e = self->ready_by_token(h->token);
  if (e == nullptr) return drop();
  self->note_activity(*e);
  const bool carries = h->kind == RmaAm::kWrite || h->kind == RmaAm::kReadData;
  if (carries ? length != h->length : (h->kind == RmaAm::kReadRequest && length != 0)) {
    self->fail_endpoint(*e, data_loss(fmt::format("peer {} sent a put/get message of {} bytes for {}", e->peer, length,
                                                  h->length)));
    return drop();
  }
  switch (h->kind) {
    case RmaAm::kWrite:
    case RmaAm::kReadRequest: {
      const bool is_put = h->kind == RmaAm::kWrite;
      std::shared_ptr<RegionState> region = self->host_region_holding(h->address, h->length);
      if (region == nullptr) {
        self->answer_rma(e->id, h->op,
                         invalid_argument(fmt::format("{} of {} bytes at {:#x}: no host memory registered with the "
                                                      "peer's transport holds them",
                                                      is_put ? "put" : "get", h->length, h->address)));
        return drop();
      }
      std::byte* at = region->data + (h->address - reinterpret_cast<std::uintptr_t>(region->data));
      if (!is_put) {
        // The bytes go back as one message, straight from the region, which the op keeps alive.
        (void)self->post([self, ep_id = e->id, region, at, n = h->length, peer_op = h->op] {
          auto ep = self->find(ep_id);
          if (ep == nullptr || ep->phase != Phase::kReady) return;
          Op& op = self->new_op(Op::Kind::kSend, ep_id, self->options_.operation_timeout,
                                fmt::format("get of {} bytes by {}", n, ep->peer));
          op.region = region;
          op.buffer = encode_rma_header({ep->peer_token, RmaAm::kReadData, peer_op, 0, n, StatusCode::kOk});
          self->send_rma_am(*ep, op, std::span<const std::byte>(at, n));
        });
        return UCS_OK;
      }
      Op& op = self->new_op(Op::Kind::kLanding, e->id, kForever, fmt::format("put of {} bytes by {}", h->length, e->peer));
      op.region = std::move(region);
      op.landing = at;
      op.landing_bytes = h->length;
      op.peer_op = h->op;
      if (!self->land(op, data, at, h->length, param)) {
        self->resolve(op, ok_status());
        return drop();
      }
      if (op.ucx_inflight == 0) self->on_landed(op, UCS_OK);
      return UCS_OK;
    }
    case RmaAm::kReadData:
    case RmaAm::kAnswer: {
      auto it = self->ops_.find(h->op);
      Op* op = it == self->ops_.end() ? nullptr : it->second.get();
      // An op of this connection still waiting for its peer (not one that timed out meanwhile).
      if (op == nullptr || op->kind != Op::Kind::kRma || op->ep_id != e->id || !op->awaits_peer || op->resolved ||
          op->peer_done || op->receiving || (h->kind == RmaAm::kReadData && (!op->is_get || h->length != op->landing_bytes))) {
        return drop();
      }
      if (h->kind == RmaAm::kAnswer) {
        if (h->code != StatusCode::kOk) {
          std::string text(rndv ? 0 : std::min<std::size_t>(length, kMaxErrorTextBytes), '\0');
          if (!text.empty()) std::memcpy(text.data(), data, text.size());
          op->rma_error = Status(h->code, fmt::format("peer {}: {}", e->peer, text));
        }
        op->peer_done = true;
        if (rndv) ucp_am_data_release(self->worker_, data);
      } else {
        if (!self->land(*op, data, op->landing, h->length, param)) {
          op->rma_error = unavailable(fmt::format("{}: receiving the bytes failed", op->what));
          op->peer_done = true;
        } else if (!op->receiving) {
          self->on_landed(*op, UCS_OK);
        }
      }
      if (op->peer_done && op->ucx_inflight == 0) {
        self->release_rkey(*op);
        self->resolve(*op, op->rma_error);
      }
      return UCS_OK;
    }
  }
  return drop();
}

void TransportCore::on_landed(Op& op, ucs_status_t status) {
  op.receiving = false;
  const Status st = status == UCS_OK
                        ? ok_status()
                        : unavailable(fmt::format("{}: receiving the bytes failed: {}", op.what, ucs_text(status)));
  if (op.kind == Op::Kind::kLanding) {
    // A sender gone mid-transfer is not answered.
    if (status == UCS_OK) answer_rma(op.ep_id, op.peer_op, st);
    resolve(op, ok_status());
    return;
  }
  if (!st.ok() && op.rma_error.ok()) op.rma_error = st;
  op.peer_done = true;
}

std::future<Status> TransportCore::send_frame(const std::shared_ptr<EndpointState>& ep, Frame frame,
                                              Duration timeout, std::string what) {
  const bool answer = frame.kind == FrameKind::kReply || frame.kind == FrameKind::kErrorReply;
  return send_wire(ep, encode_frame(frame), timeout, std::move(what), answer);
}

std::future<Status> TransportCore::send_wire(const std::shared_ptr<EndpointState>& ep,
                                             std::vector<std::byte> wire, Duration timeout,
                                             std::string what, bool answer) {
  auto promise = std::make_shared<std::promise<Status>>();
  auto future = promise->get_future();
  const bool posted =
      post([this, ep, promise, wire = std::move(wire), timeout, what = std::move(what), answer]() mutable {
        auto e = find(ep->id);
        if (e == nullptr || e->phase != Phase::kReady) {
          Status st = ep->status();
          promise->set_value(st.ok() ? unavailable(fmt::format("endpoint to {} is closed", ep->peer)) : st);
          return;
        }
        if (answer && e->unanswered > 0) --e->unanswered;
        Op& op = new_op(Op::Kind::kSend, e->id, timeout, std::move(what));
        op.status_promise = std::move(*promise);
        op.buffer = std::move(wire);
        op.header = e->peer_token;
        start_send(*e, op);
      });
  if (!posted) promise->set_value(cancelled("transport shut down"));
  return future;
}

std::future<Result<Message>> TransportCore::request(const std::shared_ptr<EndpointState>& ep,
                                                    const Message& m, Duration timeout,
                                                    std::function<void()> answered) {
  auto promise = std::make_shared<std::promise<Result<Message>>>();
  auto future = promise->get_future();
  Frame f;
  f.kind = FrameKind::kRequest;
  f.type = m.type;
  f.body = m.body;
  // Shared with the posted command: whichever of it and a refused post answers runs it.
  auto answer_cb = std::make_shared<std::function<void()>>(std::move(answered));
  const bool posted = post([this, ep, promise, answer_cb, f = std::move(f), timeout]() mutable {
    auto e = find(ep->id);
    if (e == nullptr || e->phase != Phase::kReady) {
      Status st = ep->status();
      promise->set_value(st.ok() ? unavailable(fmt::format("endpoint to {} is closed", ep->peer)) : st);
      if (*answer_cb) (*answer_cb)();
      return;
    }
    Op& op =
        new_op(Op::Kind::kRequest, e->id, timeout, fmt::format("request of type {} to {}", f.type, e->peer));
    op.reply_promise = std::move(*promise);
    op.answered = std::move(*answer_cb);
    f.id = op.id;
    op.buffer = encode_frame(f);
    op.header = e->peer_token;
    start_send(*e, op);
  });
  if (!posted) {
    promise->set_value(cancelled("transport shut down"));
    if (*answer_cb) (*answer_cb)();
  }
  return future;
}

std::future<Status> TransportCore::rma(const std::shared_ptr<EndpointState>& ep, bool is_put,
                                       const MemoryRegion& local, std::size_t local_offset,
                                       const RemoteRegion& remote, std::uint64_t remote_offset,
                                       std::size_t length, std::optional<Duration> requested,
                                       CompletionCallback done) {
  auto promise = std::make_shared<std::promise<Status>>();
  auto future = promise->get_future();
  const auto fail_now = [&](const Status& st) {
    promise->set_value(st);
    if (done) post_callback([done = std::move(done), st] { done(st); });
    return std::move(future);
  };
  const char* verb = is_put ? "put" : "get";
  const Result<Duration> resolved = operation_timeout(requested, verb);
  if (!resolved.ok()) return fail_now(resolved.status());
  const Duration timeout = *resolved;
  if (!local.valid())
    return fail_now(invalid_argument(fmt::format("{}: local memory region is empty", verb)));
  const auto& region = local.state_;
  if (region->core.get() != this) {
    return fail_now(
        invalid_argument(fmt::format("{}: local memory region belongs to another transport", verb)));
  }
  if (local_offset > region->size || length > region->size - local_offset) {
    return fail_now(
        invalid_argument(fmt::format("{}: local range [{}, {}+{}) is outside the region of {} bytes", verb,
                                     local_offset, local_offset, length, region->size)));
  }
  if (remote_offset > remote.size || length > remote.size - remote_offset) {
    return fail_now(
        invalid_argument(fmt::format("{}: remote range [{}, {}+{}) is outside the region of {} bytes", verb,
                                     remote_offset, remote_offset, length, remote.size)));
  }
  if (remote.rkey.empty())
    return fail_now(invalid_argument(fmt::format("{}: remote region has no key", verb)));
  if (length == 0) return fail_now(ok_status());
  const bool posted = post([this, ep, promise, is_put, region, local_offset, remote,
                            raddr = remote.address + remote_offset, length, timeout, done, verb]() mutable {
    auto e = find(ep->id);
    if (e == nullptr || e->phase != Phase::kReady) {
      Status st = ep->status();
      if (st.ok()) st = unavailable(fmt::format("endpoint to {} is closed", ep->peer));
      promise->set_value(st);
      if (done) post_callback([done = std::move(done), st] { done(st); });
      return;
    }
    Op& op =
        new_op(Op::Kind::kRma, e->id, timeout, fmt::format("{} of {} bytes with {}", verb, length, e->peer));
    op.status_promise = std::move(*promise);
    op.done = std::move(done);
    op.region = region;
    std::byte* local_ptr = region->data + local_offset;
    if (try_direct_copy(*e, op, is_put, local_ptr, remote, raddr, length)) return;
    auto rkey_handle = acquire_rkey(*e, op, remote.rkey);
    if (!rkey_handle.ok()) {
      resolve(op, rkey_handle.status());
      return;
    }
    void* direct = nullptr;
    const bool mapped = ucp_rkey_ptr(*rkey_handle, raddr, &direct) == UCS_OK;
    if (!mapped && !native_rma_ && region->host_memory) {
      release_rkey(op);
      rma_over_am(*e, op, is_put, local_ptr, raddr, length);
      return;
    }
    if (mapped) {
      // The peer's memory is mapped here (shared memory on one host): one memcpy is the whole
      // transfer, done and visible when it returns.
      if (is_put) {
        std::memcpy(direct, local_ptr, length);
      } else {
        std::memcpy(local_ptr, direct, length);
      }
      release_rkey(op);
      resolve(op, ok_status());
      return;
    }
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
    p.cb.send = &TransportCore::am_send_cb;
    p.user_data = &op;
    p.memh = region->memh;
    void* req = is_put ? ucp_put_nbx(e->ep(), local_ptr, length, raddr, *rkey_handle, &p)
                       : ucp_get_nbx(e->ep(), local_ptr, length, raddr, *rkey_handle, &p);
    const auto track = [&](void* r) {
      if (UCS_PTR_IS_ERR(r)) {
        if (op.rma_error.ok())
          op.rma_error = unavailable(fmt::format("{} failed: {}", op.what, ucs_text(UCS_PTR_STATUS(r))));
      } else if (r != nullptr) {
        ++op.ucx_inflight;
        ++ucx_inflight_;
      }
    };
    track(req);
    if (is_put && op.rma_error.ok()) {
      // A put completes locally; only a flush says the bytes reached the peer's memory.
      ucp_request_param_t fp{};
      fp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      fp.cb.send = &TransportCore::am_send_cb;
      fp.user_data = &op;
      track(ucp_ep_flush_nbx(e->ep(), &fp));
    }
    if (op.ucx_inflight == 0) {
      release_rkey(op);
      resolve(op, op.rma_error);
    }
  });
  if (!posted) {
    Status st = cancelled("transport shut down");
    promise->set_value(st);
    if (done) post_callback([done = std::move(done), st] { done(st); });
  }
  return future;
}

bool TransportCore::try_direct_copy(EndpointState& e, Op& op, bool is_put, std::byte* local,
                                    const RemoteRegion& remote, std::uint64_t raddr, std::size_t length) {
  if (!direct_copy_allowed_ || !op.region->host_memory || remote.pid <= 0 || remote.host == 0 ||
      remote.host != host_key_ || !e.socket) {
    return false;
  }
  const auto pid = static_cast<pid_t>(remote.pid);
  if (e.claimed_pid != pid) {
    e.claimed_pid = pid;
    e.claim_proven = holds_other_end(e.socket.get(), pid);
  }
  if (!e.claim_proven) return false;
  // Like the memcpy through a mapped segment below, a copy done here on the progress thread.
  auto copied = copy_with_process(pid, is_put, local, raddr, length, e.peer);
  if (copied.ok() && !*copied) {
    direct_copy_allowed_ = false;
    return false;
  }
  if (copied.ok()) direct_copies_.fetch_add(1, std::memory_order_relaxed);
  resolve(op, copied.status());
  return true;
}

void TransportCore::close_endpoint(const std::shared_ptr<EndpointState>& ep) {
  post([this, ep] {
    auto e = find(ep->id);
    if (e == nullptr) return;
    fail_endpoint(*e, cancelled(fmt::format("endpoint to {} closed", e->peer)));
  });
}

}  // namespace laminar::internal
