// The public API of the UCX-backed transport (laminar/transport.h); its internals: transport/core.h.
#include <fmt/format.h>

#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "laminar/transport.h"
#include "transport/core.h"
#include "transport/protocol.h"
#include "transport/wire.h"
#include "stats_fields.h"

namespace laminar::internal {

namespace {

Status check_application_type(MessageType type, const char* what) {
  if (!is_reserved(type)) return ok_status();
  return invalid_argument(fmt::format("{}: message type {:#x} is in laminar's reserved range (>= {:#x})", what,
                                      type, kLaminarMessageTypeFirst));
}

Status check_protocol_type(MessageType type, const char* what) {
  if (is_reserved(type)) return ok_status();
  return invalid_argument(fmt::format("{}: message type {:#x} is not in laminar's reserved range (>= {:#x})",
                                      what, type, kLaminarMessageTypeFirst));
}

}  // namespace

std::uint64_t EndpointState::watch(std::function<void(Status)> fn) {
  std::uint64_t id = 0;
  bool closed = false;
  {
    std::lock_guard lock(mu);
    id = next_watcher++;
    watchers.emplace(id, std::move(fn));
    closed = !error.ok();
  }
  // The firing scheduled when the endpoint closed may already have run.
  if (closed) core->post_callback([keep = shared_from_this()] { keep->fire_close_watchers(); });
  return id;
}

void EndpointState::unwatch(std::uint64_t id) noexcept {
  std::unique_lock lock(mu);
  watchers.erase(id);
  if (firing_thread == std::this_thread::get_id()) return;  // called from inside a watcher
  watcher_done.wait(lock, [&] { return firing_watcher != id; });
}

void EndpointState::fire_close_watchers() {
  std::unique_lock lock(mu);
  // Another thread already runs them (possible only once the callback thread has stopped); it
  // loops until none is left, this one's included.
  if (error.ok() || firing_watcher != 0) return;
  const Status reason = error;
  const auto done_firing = [&] {
    firing_watcher = 0;
    firing_thread = {};
    watcher_done.notify_all();
  };
  while (!watchers.empty()) {
    auto it = watchers.begin();
    auto fn = std::move(it->second);
    firing_watcher = it->first;
    firing_thread = std::this_thread::get_id();
    watchers.erase(it);
    lock.unlock();
    try {
      fn(reason);
    } catch (...) {
      lock.lock();
      done_firing();
      throw;  // reported by the callback thread
    }
    lock.lock();
    done_firing();
  }
}

}  // namespace laminar::internal

// -----------------------------------------------------------------------------------------------
// Public API

namespace laminar {

using internal::EndpointState;
using internal::Frame;
using internal::FrameKind;

namespace {
Status no_endpoint() { return failed_precondition("empty Endpoint handle"); }
}  // namespace

namespace internal {
namespace {
std::future<Result<Message>> ready_future(const Status& st) {
  std::promise<Result<Message>> p;
  p.set_value(st);
  return p.get_future();
}
}  // namespace
}  // namespace internal

Message Message::from_string(MessageType type, std::string_view text) {
  const auto* p = reinterpret_cast<const std::byte*>(text.data());
  return Message{type, std::vector<std::byte>(p, p + text.size())};
}

Message Message::from_bytes(MessageType type, std::span<const std::byte> bytes) {
  return Message{type, std::vector<std::byte>(bytes.begin(), bytes.end())};
}

std::byte* MemoryRegion::data() const noexcept { return state_ ? state_->data : nullptr; }
std::size_t MemoryRegion::size() const noexcept { return state_ ? state_->size : 0; }
RemoteRegion MemoryRegion::remote() const {
  if (!state_) return {};
  RemoteRegion r{reinterpret_cast<std::uint64_t>(state_->data), state_->size, state_->packed_rkey};
  if (state_->host_memory) {
    r.pid = static_cast<std::uint32_t>(state_->core->pid());
    r.host = state_->core->host_key();
  }
  return r;
}

EndpointId Endpoint::id() const noexcept { return EndpointId(state_ ? state_->id : 0); }
std::string Endpoint::peer_address() const { return state_ ? state_->peer : std::string(); }
Status Endpoint::status() const { return state_ ? state_->status() : no_endpoint(); }
std::string Endpoint::transport_info() const { return state_ ? state_->info() : std::string(); }

Result<CloseSubscription> Endpoint::on_close(std::function<void(Status)> callback) const {
  if (!state_) return no_endpoint();
  if (!callback) return invalid_argument("on_close: the callback is empty");
  const std::uint64_t id = state_->watch(std::move(callback));
  return CloseSubscription(state_, id);
}

CloseSubscription& CloseSubscription::operator=(CloseSubscription&& other) noexcept {
  if (this != &other) {
    reset();
    endpoint_ = std::move(other.endpoint_);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

void CloseSubscription::reset() noexcept {
  if (auto state = endpoint_.lock()) state->unwatch(id_);
  endpoint_.reset();
  id_ = 0;
}

namespace internal {

// The paths behind Endpoint's send and request, and the protocol entry points of protocol.h; the
// message type has been checked by then.
Status send_message(const std::shared_ptr<EndpointState>& state, const Message& message,
                    std::optional<Duration> timeout) {
  if (!state) return no_endpoint();
  auto& core = *state->core;
  LAMINAR_RETURN_IF_ERROR(core.check_body(message.body.size()));
  auto t = core.operation_timeout(timeout, "send");
  if (!t.ok()) return t.status();
  Frame f;
  f.kind = FrameKind::kMessage;
  f.type = message.type;
  f.body = message.body;
  return core
      .send_frame(state, std::move(f), *t, fmt::format("message of type {:#x} to {}", message.type, state->peer))
      .get();
}

std::future<Result<Message>> request_message(const std::shared_ptr<EndpointState>& state,
                                             const Message& message, std::optional<Duration> timeout,
                                             std::function<void()> answered = {}) {
  const auto refuse = [&](const Status& st) {
    auto f = ready_future(st);
    if (answered) answered();
    return f;
  };
  if (!state) return refuse(no_endpoint());
  auto& core = *state->core;
  if (Status st = core.check_body(message.body.size()); !st.ok()) return refuse(st);
  auto t = core.operation_timeout(timeout, "request");
  if (!t.ok()) return refuse(t.status());
  return core.request(state, message, *t, std::move(answered));
}

Status on_protocol_message(Transport& transport, MessageType type, MessageHandler handler) {
  LAMINAR_RETURN_IF_ERROR(check_protocol_type(type, "on_protocol_message"));
  TransportCore::of(transport).on_message(type, std::move(handler));
  return ok_status();
}

Status send_protocol(Endpoint& endpoint, const Message& message, std::optional<Duration> timeout) {
  LAMINAR_RETURN_IF_ERROR(check_protocol_type(message.type, "send_protocol"));
  return send_message(TransportCore::state_of(endpoint), message, timeout);
}

std::future<Result<Message>> request_protocol_async(Endpoint& endpoint, const Message& message,
                                                    std::optional<Duration> timeout) {
  return request_protocol_async(endpoint, message, timeout, {});
}

std::future<Result<Message>> request_protocol_async(Endpoint& endpoint, const Message& message,
                                                    std::optional<Duration> timeout,
                                                    std::function<void()> answered) {
  if (Status st = check_protocol_type(message.type, "request_protocol"); !st.ok()) {
    auto f = ready_future(st);
    if (answered) answered();
    return f;
  }
  return request_message(TransportCore::state_of(endpoint), message, timeout, std::move(answered));
}

Result<Message> request_protocol(Endpoint& endpoint, const Message& message, std::optional<Duration> timeout) {
  return request_protocol_async(endpoint, message, timeout).get();
}

}  // namespace internal

Status Endpoint::send(const Message& message, std::optional<Duration> timeout) {
  LAMINAR_RETURN_IF_ERROR(internal::check_application_type(message.type, "send"));
  return internal::send_message(state_, message, timeout);
}

std::future<Result<Message>> Endpoint::request_async(const Message& message, std::optional<Duration> timeout) {
  if (Status st = internal::check_application_type(message.type, "request"); !st.ok()) {
    return internal::ready_future(st);
  }
  return internal::request_message(state_, message, timeout);
}

Result<Message> Endpoint::request(const Message& message, std::optional<Duration> timeout) {
  return request_async(message, timeout).get();
}

Status Endpoint::reply(const Incoming& to, const Message& message) {
  if (!state_) return no_endpoint();
  if (to.request_id == RequestId()) {
    return invalid_argument("reply to a message that is not a request (request_id 0)");
  }
  auto& core = *state_->core;
  LAMINAR_RETURN_IF_ERROR(core.check_body(message.body.size()));
  Frame f;
  f.kind = FrameKind::kReply;
  f.id = to.request_id.value();
  f.type = message.type;
  f.body = message.body;
  return core
      .send_frame(state_, std::move(f), core.options().operation_timeout,
                  fmt::format("reply to request {} from {}", to.request_id.value(), state_->peer))
      .get();
}

Status Endpoint::reply_error(const Incoming& to, const Status& error) {
  if (!state_) return no_endpoint();
  if (to.request_id == RequestId())
    return invalid_argument("reply_error to a message that is not a request (request_id 0)");
  if (error.ok()) return invalid_argument("reply_error with an OK status");
  auto& core = *state_->core;
  Frame f;
  f.kind = FrameKind::kErrorReply;
  f.id = to.request_id.value();
  f.code = error.code();
  f.error = error.message();
  return core
      .send_frame(state_, std::move(f), core.options().operation_timeout,
                  fmt::format("error reply to request {} from {}", to.request_id.value(), state_->peer))
      .get();
}

namespace {
std::future<Status> rma(const std::shared_ptr<EndpointState>& state, bool is_put, const MemoryRegion& local,
                        std::size_t local_offset, const RemoteRegion& remote, std::uint64_t remote_offset,
                        std::size_t length, std::optional<Duration> timeout, CompletionCallback done) {
  if (!state) {
    // No transport, so no callback thread: `done` runs here.
    if (done) done(no_endpoint());
    std::promise<Status> p;
    p.set_value(no_endpoint());
    return p.get_future();
  }
  return state->core->rma(state, is_put, local, local_offset, remote, remote_offset, length, timeout,
                          std::move(done));
}
}  // namespace

std::future<Status> Endpoint::put(const MemoryRegion& local, std::size_t local_offset,
                                  const RemoteRegion& remote, std::uint64_t remote_offset, std::size_t length,
                                  std::optional<Duration> timeout, CompletionCallback done) {
  return rma(state_, true, local, local_offset, remote, remote_offset, length, timeout, std::move(done));
}

std::future<Status> Endpoint::get(const MemoryRegion& local, std::size_t local_offset,
                                  const RemoteRegion& remote, std::uint64_t remote_offset, std::size_t length,
                                  std::optional<Duration> timeout, CompletionCallback done) {
  return rma(state_, false, local, local_offset, remote, remote_offset, length, timeout, std::move(done));
}

void Endpoint::close() {
  if (state_) state_->core->close_endpoint(state_);
}

Result<std::unique_ptr<Transport>> Transport::create(TransportOptions options) {
  auto core = internal::TransportCore::create(std::move(options));
  if (!core.ok()) return core.status();
  return std::unique_ptr<Transport>(new Transport(std::move(*core)));
}

Transport::Transport(std::shared_ptr<internal::TransportCore> core) : core_(std::move(core)) {}
Transport::~Transport() { core_->shutdown(); }

Result<std::string> Transport::listen(std::string_view host, std::uint16_t port) {
  return core_->listen(host, port);
}
Result<Endpoint> Transport::connect(std::string_view address, std::optional<Duration> timeout) {
  return core_->connect(address, timeout);
}
Result<Endpoint> Transport::accept(Duration timeout) { return core_->accept(timeout); }
Status Transport::on_message(MessageType type, MessageHandler handler) {
  LAMINAR_RETURN_IF_ERROR(internal::check_application_type(type, "on_message"));
  core_->on_message(type, std::move(handler));
  return ok_status();
}
Result<Incoming> Transport::receive(Duration timeout) { return core_->receive(timeout); }
Result<MemoryRegion> Transport::register_memory(void* data, std::size_t size) {
  return core_->map_memory(data, size, false);
}
Result<MemoryRegion> Transport::allocate(std::size_t size) { return core_->map_memory(nullptr, size, true); }
bool Transport::owns(const MemoryRegion& region) const noexcept {
  return region.state_ != nullptr && region.state_->core == core_;
}
const TransportOptions& Transport::options() const noexcept { return core_->options(); }
TransportStats Transport::stats() const { return core_->stats(); }

std::string TransportStats::to_json() const { return internal::stats_json(*this); }
std::optional<std::string> Transport::listen_address() const { return core_->listen_address(); }

}  // namespace laminar
