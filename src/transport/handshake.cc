// Connections of a Transport: listen, connect, accept, and the mutual HMAC handshake that opens each.
#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sodium.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <mutex>
#include <string>

#include "laminar/transport.h"
#include "transport/core.h"
#include "transport/listen_socket.h"
#include "transport/wire.h"

namespace laminar::internal {

static_assert(kKeyBytes == crypto_auth_hmacsha256_KEYBYTES);

namespace {

// HMAC-SHA-256 over role || client nonce || server nonce: each side's proof is bound to this
// connection's fresh nonces (no replay) and to its role (a proof cannot be reflected back).
std::vector<std::byte> proof(const Key& key, std::string_view role, const Nonce& client,
                             const Nonce& server) {
  crypto_auth_hmacsha256_state st;
  crypto_auth_hmacsha256_init(&st, key.data(), key.size());
  crypto_auth_hmacsha256_update(&st, reinterpret_cast<const unsigned char*>(role.data()), role.size());
  crypto_auth_hmacsha256_update(&st, reinterpret_cast<const unsigned char*>(client.data()), client.size());
  crypto_auth_hmacsha256_update(&st, reinterpret_cast<const unsigned char*>(server.data()), server.size());
  std::vector<std::byte> mac(crypto_auth_hmacsha256_BYTES);
  crypto_auth_hmacsha256_final(&st, reinterpret_cast<unsigned char*>(mac.data()));
  return mac;
}

bool same_mac(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && sodium_memcmp(a.data(), b.data(), a.size()) == 0;
}

Nonce fresh_nonce() {
  Nonce n;
  randombytes_buf(n.data(), n.size());
  return n;
}

Nonce to_nonce(std::span<const std::byte> b) {
  Nonce n{};
  std::copy_n(b.begin(), std::min(b.size(), n.size()), n.begin());
  return n;
}

constexpr std::string_view kServerRole = "laminar-transport-server-v1";
constexpr std::string_view kClientRole = "laminar-transport-client-v1";

}  // namespace

// "host:port" or "[v6]:port" -> sockaddr. kInvalidArgument names what is wrong.
Result<sockaddr_storage> parse_address(std::string_view address) {
  std::string host;
  std::string port_text;
  if (!address.empty() && address.front() == '[') {
    const auto close = address.find(']');
    if (close == std::string_view::npos || close + 1 >= address.size() || address[close + 1] != ':') {
      return invalid_argument(fmt::format("address '{}' is not [ipv6]:port", address));
    }
    host = std::string(address.substr(1, close - 1));
    port_text = std::string(address.substr(close + 2));
  } else {
    const auto colon = address.rfind(':');
    if (colon == std::string_view::npos || colon == 0) {
      return invalid_argument(fmt::format("address '{}' is not host:port", address));
    }
    host = std::string(address.substr(0, colon));
    port_text = std::string(address.substr(colon + 1));
  }
  char* end = nullptr;
  const long port = port_text.empty() ? -1 : std::strtol(port_text.c_str(), &end, 10);
  if (port < 1 || port > 65535 || (end != nullptr && *end != '\0')) {
    return invalid_argument(fmt::format("address '{}': port '{}' is not in 1..65535", address, port_text));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(host.c_str(), port_text.c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    return invalid_argument(
        fmt::format("address '{}': host '{}' does not resolve ({})", address, host, gai_strerror(rc)));
  }
  sockaddr_storage ss{};
  std::memcpy(&ss, found->ai_addr, found->ai_addrlen);
  freeaddrinfo(found);
  return ss;
}

// ---------------------------------------------------------------------------------------------
// Handshake (progress thread)

void TransportCore::refuse(EndpointState& e, const std::string& why) {
  Frame f;
  f.kind = FrameKind::kRefused;
  f.error = why;
  send_internal(e, f);
  e.phase = Phase::kRefused;
  set_endpoint_error(e, failed_precondition(fmt::format("peer {} refused: {}", e.peer, why)));
  // The client hangs up on reading the refusal; the handshake deadline closes it otherwise.
}

// The client's next handshake step needs frame `want`; a refusal or any other frame fails the
// endpoint (false), naming what the peer answered our `answered` with.
bool TransportCore::expect_handshake_frame(EndpointState& e, const Frame& f, FrameKind want,
                                           const char* answered) {
  if (f.kind == FrameKind::kRefused) {
    fail_endpoint(e, failed_precondition(fmt::format("peer {} refused the connection: {}", e.peer, f.error)));
    return false;
  }
  if (f.kind != want) {
    fail_endpoint(e, data_loss(fmt::format("peer {} answered the {} with frame kind {}", e.peer, answered,
                                           static_cast<int>(f.kind))));
    return false;
  }
  return true;
}

void TransportCore::handle_handshake(EndpointState& e, Frame f) {
  auto op_it = ops_.find(e.handshake_op);
  Op* hs = op_it == ops_.end() ? nullptr : op_it->second.get();
  switch (e.phase) {
    case Phase::kAwaitHello: {
      if (f.kind != FrameKind::kHello) {
        refuse(e, fmt::format("expected a hello, got frame kind {}", static_cast<int>(f.kind)));
        return;
      }
      e.client_nonce = to_nonce(f.body);
      e.server_nonce = fresh_nonce();
      Frame c;
      c.kind = FrameKind::kChallenge;
      c.body.assign(e.server_nonce.begin(), e.server_nonce.end());
      c.mac = proof(key_, kServerRole, e.client_nonce, e.server_nonce);
      send_internal(e, c);
      e.phase = Phase::kAwaitProof;
      return;
    }
    case Phase::kAwaitProof: {
      if (f.kind != FrameKind::kProof) {
        refuse(e, fmt::format("expected a proof, got frame kind {}", static_cast<int>(f.kind)));
        return;
      }
      if (!same_mac(f.body, proof(key_, kClientRole, e.client_nonce, e.server_nonce))) {
        refuse(e, "cluster token does not match");
        return;
      }
      Frame w;
      w.kind = FrameKind::kWelcome;
      send_internal(e, w);
      e.phase = Phase::kReady;
      if (hs != nullptr) resolve(*hs, ok_status());
      {
        std::lock_guard lock(queues_mu_);
        accepted_.push_back(make_endpoint(find(e.id)));
      }
      queues_cv_.notify_all();
      return;
    }
    case Phase::kAwaitChallenge: {
      if (!expect_handshake_frame(e, f, FrameKind::kChallenge, "hello")) return;
      e.server_nonce = to_nonce(f.body);
      if (!same_mac(f.mac, proof(key_, kServerRole, e.client_nonce, e.server_nonce))) {
        // Reveal nothing (not even our proof) to a server that cannot prove it holds the token.
        fail_endpoint(e, failed_precondition(
                             fmt::format("peer {} could not prove it holds the cluster token", e.peer)));
        return;
      }
      Frame p;
      p.kind = FrameKind::kProof;
      p.body = proof(key_, kClientRole, e.client_nonce, e.server_nonce);
      send_internal(e, p);
      e.phase = Phase::kAwaitWelcome;
      return;
    }
    case Phase::kAwaitWelcome: {
      if (!expect_handshake_frame(e, f, FrameKind::kWelcome, "proof")) return;
      e.phase = Phase::kReady;
      char* text = nullptr;
      std::size_t len = 0;
      if (FILE* mem = open_memstream(&text, &len)) {
        ucp_ep_print_info(e.ep, mem);
        std::fclose(mem);
        e.set_info(std::string(text, len));
        std::free(text);
      }
      if (hs != nullptr) resolve_connect(*hs, find(e.id));
      return;
    }
    case Phase::kReady:
    case Phase::kRefused:
    case Phase::kClosed:
      return;
  }
}

void TransportCore::conn_cb(ucp_conn_request_h req, void* arg) {
  static_cast<TransportCore*>(arg)->on_connection_request(req);
}

void TransportCore::on_connection_request(ucp_conn_request_h req) {
  ucp_conn_request_attr_t attr{};
  attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
  std::string peer = "<unknown peer>";
  if (ucp_conn_request_query(req, &attr) == UCS_OK) peer = sockaddr_text(attr.client_address);
  if (tearing_down_) {
    refused_peers_.insert(peer);
    ucp_listener_reject(listener_, req);
    return;
  }
  auto e = std::make_shared<EndpointState>(shared_from_this(), next_ep_id_++, peer);
  ucp_ep_params_t ep{};
  ep.field_mask =
      UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.conn_request = req;
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = &TransportCore::ep_error_cb;
  ep.err_handler.arg = this;
  if (ucp_ep_create(worker_, &ep, &e->ep) != UCS_OK) return;  // UCX rejects the request itself
  e->phase = Phase::kAwaitHello;
  endpoints_.emplace(e->id, e);
  by_handle_.emplace(e->ep, e->id);
  // A client that never completes the handshake is dropped at the deadline.
  Op& hs =
      new_op(Op::Kind::kHandshake, e->id, options_.connect_timeout, fmt::format("handshake with {}", peer));
  e->handshake_op = hs.id;
}

// ---------------------------------------------------------------------------------------------
// Public operations (any thread -> progress thread)

Result<std::string> TransportCore::listen(std::string_view host, std::uint16_t port) {
  sockaddr_storage ss{};
  auto* v4 = reinterpret_cast<sockaddr_in*>(&ss);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&ss);
  const std::string h(host);
  if (inet_pton(AF_INET, h.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(port);
  } else if (inet_pton(AF_INET6, h.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(port);
  } else {
    return invalid_argument(fmt::format("listen host '{}' is not an IPv4 or IPv6 address", host));
  }
  {
    std::lock_guard lock(cmd_mu_);
    if (listening_) return failed_precondition("transport is already listening");
    listening_ = true;
  }
  std::promise<Result<std::string>> promise;
  auto future = promise.get_future();
  const bool posted = post([&] {
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
    lp.sockaddr.addrlen = ss.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    lp.conn_handler.cb = &TransportCore::conn_cb;
    lp.conn_handler.arg = this;
    ucs_status_t s = ucp_listener_create(worker_, &lp, &listener_);
    if (s != UCS_OK) {
      listener_ = nullptr;
      promise.set_value(unavailable(fmt::format("cannot listen on {}:{}: {}", host, port, ucs_text(s))));
      return;
    }
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    s = ucp_listener_query(listener_, &attr);
    if (s == UCS_OK) {
      listen_addr_ = attr.sockaddr;
      listen_fd_ = find_listening_socket(listen_addr_);
      // A process this one starts must not hold the port (UCX opens it without close-on-exec).
      if (listen_fd_ >= 0) fcntl(listen_fd_, F_SETFD, fcntl(listen_fd_, F_GETFD) | FD_CLOEXEC);
    }
    promise.set_value(s == UCS_OK ? Result<std::string>(sockaddr_text(attr.sockaddr))
                                  : Result<std::string>(unavailable("listener query: " + ucs_text(s))));
  });
  if (!posted) return cancelled("transport shut down");
  Result<std::string> r = future.get();
  std::lock_guard lock(cmd_mu_);
  if (!r.ok()) {
    listening_ = false;
  } else {
    listen_address_ = *r;
  }
  return r;
}

std::optional<std::string> TransportCore::listen_address() const {
  std::lock_guard lock(cmd_mu_);
  if (listen_address_.empty()) return std::nullopt;
  return listen_address_;
}

Status TransportCore::open_client_endpoint(EndpointState& e, const sockaddr_storage& address) {
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&address);
  ep.sockaddr.addrlen = address.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = &TransportCore::ep_error_cb;
  ep.err_handler.arg = this;
  const ucs_status_t s = ucp_ep_create(worker_, &ep, &e.ep);
  if (s != UCS_OK) {
    e.ep = nullptr;
    return unavailable(fmt::format("cannot connect to {}: {}", e.peer, ucs_text(s)));
  }
  endpoints_.emplace(e.id, e.shared_from_this());
  by_handle_.emplace(e.ep, e.id);
  return ok_status();
}

Result<Endpoint> TransportCore::connect(std::string_view address, std::optional<Duration> requested) {
  auto timeout = resolve_timeout(requested, options_.connect_timeout, "connect");
  if (!timeout.ok()) return timeout.status();
  auto ss = parse_address(address);
  if (!ss.ok()) return ss.status();
  auto e = std::make_shared<EndpointState>(shared_from_this(), next_ep_id_++, std::string(address));
  std::promise<std::future<Result<Endpoint>>> started;
  auto started_future = started.get_future();
  const bool posted = post([this, e, addr = *ss, timeout = *timeout, &started] {
    Op& op = new_op(Op::Kind::kConnect, e->id, timeout, fmt::format("connecting to {}", e->peer));
    started.set_value(op.connect_promise.get_future());
    if (Status st = open_client_endpoint(*e, addr); !st.ok()) {
      resolve(op, st);
      return;
    }
    e->phase = Phase::kAwaitChallenge;
    e->handshake_op = op.id;
    e->client_nonce = fresh_nonce();
    Frame hello;
    hello.kind = FrameKind::kHello;
    hello.body.assign(e->client_nonce.begin(), e->client_nonce.end());
    send_internal(*e, hello);
  });
  if (!posted) return cancelled("transport shut down");
  return started_future.get().get();
}

Result<Endpoint> TransportCore::accept(Duration timeout) {
  if (timeout.count() < 0) return invalid_argument(fmt::format("accept timeout of {} ns is negative", timeout.count()));
  std::unique_lock lock(queues_mu_);
  if (!wait_queue(lock, timeout, [&] { return shut_down_ || !accepted_.empty(); })) {
    return deadline_exceeded(fmt::format("no peer connected within {}", duration_text(timeout)));
  }
  if (shut_down_) return cancelled("transport shut down");
  Endpoint e = std::move(accepted_.front());
  accepted_.pop_front();
  return e;
}

}  // namespace laminar::internal
