// Connections of a Transport: listen, connect, accept, and the handshake on the bootstrap socket.
//
// The bootstrap socket is laminar's own TCP connection between the two peers. Until the peer has
// proven it holds the cluster token, the only bytes read from it are bootstrap frames (bounded,
// bootstrap_wire.h), and nothing of UCX is involved; a listener holds at most
// max_unauthenticated_connections such connections (the oldest goes when one more comes), each for
// at most handshake_timeout. The socket
// then stays open, unused, for the connection's life: its end is how either side learns of the
// other's close at once, whatever UCX's own failure detection takes.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sodium.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <mutex>
#include <set>
#include <string>

#include "laminar/transport.h"
#include "transport/bootstrap_wire.h"
#include "transport/core.h"
#include "transport/listen_socket.h"

namespace laminar::internal {

static_assert(kKeyBytes == crypto_auth_hmacsha256_KEYBYTES);
static_assert(kBootstrapMacBytes == crypto_auth_hmacsha256_BYTES);

namespace {

using Mac = std::array<std::byte, kBootstrapMacBytes>;

// HMAC-SHA-256 over role || client nonce || server nonce: each side's proof is bound to this
// connection's fresh nonces (no replay) and to its role (a proof cannot be reflected back).
Mac proof(const Key& key, std::string_view role, const Nonce& client, const Nonce& server) {
  crypto_auth_hmacsha256_state st;
  crypto_auth_hmacsha256_init(&st, key.data(), key.size());
  crypto_auth_hmacsha256_update(&st, reinterpret_cast<const unsigned char*>(role.data()), role.size());
  crypto_auth_hmacsha256_update(&st, reinterpret_cast<const unsigned char*>(client.data()), client.size());
  crypto_auth_hmacsha256_update(&st, reinterpret_cast<const unsigned char*>(server.data()), server.size());
  Mac mac;
  crypto_auth_hmacsha256_final(&st, reinterpret_cast<unsigned char*>(mac.data()));
  return mac;
}

bool same_mac(const Mac& a, const Mac& b) { return sodium_memcmp(a.data(), b.data(), a.size()) == 0; }

Nonce fresh_nonce() {
  Nonce n;
  randombytes_buf(n.data(), n.size());
  return n;
}

constexpr std::string_view kServerRole = "laminar-transport-server-v1";
constexpr std::string_view kClientRole = "laminar-transport-client-v1";

socklen_t length_of(const sockaddr_storage& ss) {
  return ss.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
}

// Bootstrap frames are small and each is answered: no Nagle delay.
void no_delay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

bool in_handshake(Phase p) { return p != Phase::kReady && p != Phase::kClosed; }

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
  const auto failed = [&](Status st) {
    std::lock_guard lock(cmd_mu_);
    listening_ = false;
    return st;
  };
  const auto os_error = [&](const char* call) {
    return failed(unavailable(fmt::format("cannot listen on {}:{}: {}: {}", host, port, call, std::strerror(errno))));
  };
  UniqueFd fd(::socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd) return os_error("socket");
  // A listener that restarts on its port must not wait for the last run's connections to leave
  // TIME_WAIT. Two live listeners still cannot share a port (that would need SO_REUSEPORT).
  const int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&ss), length_of(ss)) != 0) return os_error("bind");
  if (::listen(fd.get(), SOMAXCONN) != 0) return os_error("listen");
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len) != 0) return os_error("getsockname");

  std::promise<Status> watched;
  auto future = watched.get_future();
  const bool posted = post([&] {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kListenTag;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd.get(), &ev) != 0) {
      watched.set_value(
          unavailable(fmt::format("cannot listen on {}:{}: epoll: {}", host, port, std::strerror(errno))));
      return;
    }
    listen_socket_ = std::move(fd);
    watched.set_value(ok_status());
  });
  if (!posted) return failed(cancelled("transport shut down"));
  if (Status st = future.get(); !st.ok()) return failed(st);
  std::lock_guard lock(cmd_mu_);
  listen_address_ = sockaddr_text(bound);
  return listen_address_;
}

std::optional<std::string> TransportCore::listen_address() const {
  std::lock_guard lock(cmd_mu_);
  if (listen_address_.empty()) return std::nullopt;
  return listen_address_;
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
    e->outgoing = true;
    e->handshake_op = op.id;
    UniqueFd fd(::socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (fd && ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), length_of(addr)) != 0 &&
        errno != EINPROGRESS) {
      fd.reset();
    }
    if (!fd) {
      resolve(op, unavailable(fmt::format("cannot connect to {}: {}", e->peer, std::strerror(errno))));
      return;
    }
    no_delay(fd.get());
    e->socket = std::move(fd);
    e->peer_ip = ip_of(addr);
    e->phase = Phase::kConnecting;  // the socket turns writable once connected (or failed)
    endpoints_.emplace(e->id, e);
    if (Status st = watch_socket(*e); !st.ok()) fail_endpoint(*e, st);
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

// ---------------------------------------------------------------------------------------------
// Bootstrap sockets (progress thread)

void TransportCore::accept_connections() {
  for (;;) {
    sockaddr_storage from{};
    socklen_t len = sizeof(from);
    UniqueFd fd(::accept4(listen_socket_.get(), reinterpret_cast<sockaddr*>(&from), &len,
                          SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!fd) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      return;  // none left (or out of descriptors: the next event tries again)
    }
    if (tearing_down_) continue;  // closed at once
    // Full: the connection that has had the longest to authenticate makes room. Refusing the newcomer
    // instead would let a few idle connections, renewed at each deadline, keep every client out.
    if (unauthenticated_.size() >= options_.max_unauthenticated_connections) {
      const auto oldest = find(*unauthenticated_.begin());
      LAMINAR_CHECK(oldest != nullptr);
      fail_endpoint(*oldest, unavailable(fmt::format("{} did not authenticate before {} newer connections came",
                                                     oldest->peer, unauthenticated_.size())));
    }
    no_delay(fd.get());
    auto e = std::make_shared<EndpointState>(shared_from_this(), next_ep_id_++, sockaddr_text(from));
    e->socket = std::move(fd);
    e->peer_ip = ip_of(from);
    e->phase = Phase::kAwaitHello;
    unauthenticated_.insert(e->id);
    endpoints_.emplace(e->id, e);
    // A client that never completes the handshake is dropped at the deadline.
    Op& hs = new_op(Op::Kind::kHandshake, e->id, options_.handshake_timeout,
                    fmt::format("handshake with {}", e->peer));
    e->handshake_op = hs.id;
    if (Status st = watch_socket(*e); !st.ok()) fail_endpoint(*e, st);
  }
}

Status TransportCore::watch_socket(EndpointState& e) {
  std::uint32_t want = 0;
  if (e.phase == Phase::kConnecting) {
    want = EPOLLOUT;
  } else {
    if (e.phase != Phase::kRefused) want |= EPOLLIN | EPOLLRDHUP;
    if (!e.out.empty()) want |= EPOLLOUT;
  }
  if (want == e.watching) return ok_status();
  epoll_event ev{};
  ev.events = want;
  ev.data.u64 = e.id;
  if (epoll_ctl(epoll_fd_, e.watching == 0 ? EPOLL_CTL_ADD : EPOLL_CTL_MOD, e.socket.get(), &ev) != 0) {
    return unavailable(fmt::format("connection to {}: epoll: {}", e.peer, std::strerror(errno)));
  }
  e.watching = want;
  return ok_status();
}

void TransportCore::on_socket_event(std::uint64_t id, std::uint32_t events) {
  const auto e = find(id);  // keeps it alive while its handlers run
  if (e == nullptr || !e->socket) return;  // closed by an earlier event of the same batch
  if (e->phase == Phase::kConnecting) {
    int error = 0;
    socklen_t len = sizeof(error);
    if (getsockopt(e->socket.get(), SOL_SOCKET, SO_ERROR, &error, &len) != 0) error = errno;
    if (error != 0) {
      fail_endpoint(*e, unavailable(fmt::format("cannot connect to {}: {}", e->peer, std::strerror(error))));
      return;
    }
    e->phase = Phase::kAwaitChallenge;
    e->client_nonce = fresh_nonce();
    BootstrapFrame hello;
    hello.kind = BootstrapKind::kHello;
    hello.nonce = e->client_nonce;
    send_bootstrap(*e, hello);
    return;
  }
  if (events & EPOLLOUT) write_socket(*e);
  if (!e->socket || !(events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR))) return;
  if (e->phase == Phase::kRefused) {
    // The client hung up (or the socket failed) before the refusal left: nobody is left to read it.
    fail_endpoint(*e, e->status());
    return;
  }
  read_socket(*e);
}

void TransportCore::read_socket(EndpointState& e) {
  const std::uint64_t id = e.id;
  for (;;) {
    // Never more than one whole frame buffered: what an unauthenticated peer can make us hold.
    const std::size_t room = 4 + kMaxBootstrapFrameBytes - e.in.size();
    const std::size_t had = e.in.size();
    e.in.resize(had + room);
    const ssize_t n = ::recv(e.socket.get(), e.in.data() + had, room, 0);
    const int error = errno;
    e.in.resize(had + static_cast<std::size_t>(std::max<ssize_t>(n, 0)));
    if (n < 0 && error == EINTR) continue;
    if (n < 0 && (error == EAGAIN || error == EWOULDBLOCK)) return;
    if (n <= 0) {
      const std::string how = n == 0 ? "closed the connection" : fmt::format("failed: {}", std::strerror(error));
      if (e.phase == Phase::kReady) {
        // The close travels apart from the data and can overtake it: what the peer sent over UCX
        // before closing (a last reply, say) may be waiting in the worker. Deliver that first. The
        // bound only stops other, busy connections from holding this one open.
        for (int i = 0; i < 1024 && ucp_worker_progress(worker_) != 0; ++i) {
        }
        if (find(id) == nullptr) return;
      }
      fail_endpoint(e, unavailable(in_handshake(e.phase)
                                       ? fmt::format("peer {} {} during the handshake", e.peer, how)
                                       : fmt::format("peer {} {}", e.peer, how)));
      return;
    }
    for (;;) {
      auto frame = take_bootstrap_frame(e.in);
      if (!frame.ok()) {
        if (!e.outgoing && (e.phase == Phase::kAwaitHello || e.phase == Phase::kAwaitProof)) {
          refuse(e, "malformed handshake: " + frame.status().message());
        } else {
          fail_endpoint(e, frame.status().with_context(fmt::format("bootstrap connection of {}", e.peer)));
        }
        return;
      }
      if (!frame->has_value()) break;
      if (e.outgoing) {
        handle_client_frame(e, std::move(**frame));
      } else {
        handle_server_frame(e, std::move(**frame));
      }
      if (find(id) == nullptr || e.phase == Phase::kRefused) return;
    }
  }
}

void TransportCore::write_socket(EndpointState& e) {
  std::size_t sent = 0;
  while (sent < e.out.size()) {
    const ssize_t n = ::send(e.socket.get(), e.out.data() + sent, e.out.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n < 0) {
      fail_endpoint(e, unavailable(fmt::format("connection to {} failed: {}", e.peer, std::strerror(errno))));
      return;
    }
    sent += static_cast<std::size_t>(n);
  }
  e.out.erase(e.out.begin(), e.out.begin() + static_cast<std::ptrdiff_t>(sent));
  if (e.phase == Phase::kRefused && e.out.empty()) {
    fail_endpoint(e, e.status());  // the refusal has left
    return;
  }
  if (Status st = watch_socket(e); !st.ok()) fail_endpoint(e, st);
}

void TransportCore::send_bootstrap(EndpointState& e, const BootstrapFrame& f) {
  const std::vector<std::byte> bytes = encode_bootstrap_frame(f);
  e.out.insert(e.out.end(), bytes.begin(), bytes.end());
  write_socket(e);
}

// ---------------------------------------------------------------------------------------------
// Handshake (progress thread)

void TransportCore::refuse(EndpointState& e, const std::string& why, StatusCode code) {
  BootstrapFrame f;
  f.kind = BootstrapKind::kRefused;
  f.code = code;
  f.reason = why.substr(0, kMaxRefusalBytes);
  set_endpoint_error(e, Status(code, fmt::format("peer {} refused: {}", e.peer, why)));
  // Nothing more is read; the socket closes once the refusal has left, or at the deadline.
  e.phase = Phase::kRefused;
  send_bootstrap(e, f);
}

void TransportCore::handle_server_frame(EndpointState& e, BootstrapFrame f) {
  const auto expect = [&](BootstrapKind want, const char* name) {
    if (f.kind == want) return true;
    refuse(e, fmt::format("expected {}, got frame kind {}", name, static_cast<int>(f.kind)));
    return false;
  };
  switch (e.phase) {
    case Phase::kAwaitHello: {
      if (!expect(BootstrapKind::kHello, "a hello")) return;
      e.client_nonce = f.nonce;
      e.server_nonce = fresh_nonce();
      BootstrapFrame c;
      c.kind = BootstrapKind::kChallenge;
      c.nonce = e.server_nonce;
      c.mac = proof(key_, kServerRole, e.client_nonce, e.server_nonce);
      c.addresses = own_addresses_;
      send_bootstrap(e, c);
      if (e.phase == Phase::kAwaitHello) e.phase = Phase::kAwaitProof;
      return;
    }
    case Phase::kAwaitProof: {
      if (!expect(BootstrapKind::kProof, "a proof")) return;
      if (!same_mac(f.mac, proof(key_, kClientRole, e.client_nonce, e.server_nonce))) {
        refuse(e, "cluster token does not match");
        return;
      }
      unauthenticated_.erase(e.id);
      if (f.token == 0 || f.worker_address.empty()) {
        refuse(e, "the proof carries no token or no worker address");
        return;
      }
      // Before the welcome: once the client has our worker address, its UCX may connect to ours.
      if (Status st = admit_peer(e, f.addresses); !st.ok()) {
        refuse(e, st.message());
        return;
      }
      auto w = peer_worker(f.worker_address);
      if (!w.ok()) {
        // UCX may reach the client a moment later (its network coming up): the client may try again.
        refuse(e, w.status().message(), StatusCode::kUnavailable);
        return;
      }
      e.worker = *w;
      e.worker->endpoints.insert(e.id);
      e.peer_token = f.token;
      e.token = new_token();
      by_token_.emplace(e.token, e.id);
      BootstrapFrame welcome;
      welcome.kind = BootstrapKind::kWelcome;
      welcome.token = e.token;
      welcome.worker_address = worker_address_;
      e.phase = Phase::kAwaitReady;
      send_bootstrap(e, welcome);
      return;
    }
    case Phase::kAwaitReady:
    case Phase::kReady:
      // The ready may arrive after the client's first frame over UCX has opened the connection.
      if (f.kind != BootstrapKind::kReady) {
        fail_endpoint(e, data_loss(fmt::format("peer {} sent bootstrap frame kind {} after its proof", e.peer,
                                               static_cast<int>(f.kind))));
        return;
      }
      if (e.phase == Phase::kAwaitReady) open_accepted(e);
      return;
    default:
      return;
  }
}

void TransportCore::handle_client_frame(EndpointState& e, BootstrapFrame f) {
  const auto expect = [&](BootstrapKind want, const char* answered) {
    if (f.kind == BootstrapKind::kRefused) {
      fail_endpoint(e, Status(f.code, fmt::format("peer {} refused the connection: {}", e.peer, f.reason)));
      return false;
    }
    if (f.kind == want) return true;
    fail_endpoint(e, data_loss(fmt::format("peer {} answered the {} with frame kind {}", e.peer, answered,
                                           static_cast<int>(f.kind))));
    return false;
  };
  switch (e.phase) {
    case Phase::kAwaitChallenge: {
      if (!expect(BootstrapKind::kChallenge, "hello")) return;
      e.server_nonce = f.nonce;
      if (!same_mac(f.mac, proof(key_, kServerRole, e.client_nonce, e.server_nonce))) {
        // Reveal nothing (not even our proof) to a server that cannot prove it holds the token.
        fail_endpoint(e, failed_precondition(
                             fmt::format("peer {} could not prove it holds the cluster token", e.peer)));
        return;
      }
      // Before the proof: once the server has our worker address, its UCX may connect to ours.
      if (Status st = admit_peer(e, f.addresses); !st.ok()) {
        fail_endpoint(e, st);
        return;
      }
      e.token = new_token();
      by_token_.emplace(e.token, e.id);
      BootstrapFrame p;
      p.kind = BootstrapKind::kProof;
      p.mac = proof(key_, kClientRole, e.client_nonce, e.server_nonce);
      p.token = e.token;
      p.worker_address = worker_address_;
      p.addresses = own_addresses_;
      e.phase = Phase::kAwaitWelcome;
      send_bootstrap(e, p);
      return;
    }
    case Phase::kAwaitWelcome: {
      if (!expect(BootstrapKind::kWelcome, "proof")) return;
      if (f.token == 0 || f.worker_address.empty()) {
        fail_endpoint(e, data_loss(fmt::format("peer {} welcomed us without a token or worker address", e.peer)));
        return;
      }
      auto w = peer_worker(f.worker_address);
      if (!w.ok()) {
        fail_endpoint(e, unavailable(fmt::format("cannot connect to {}: {}", e.peer, w.status().message())));
        return;
      }
      e.worker = *w;
      e.worker->endpoints.insert(e.id);
      e.peer_token = f.token;
      e.phase = Phase::kWireup;
      // The flush completes once UCX has connected the two workers; the connect deadline covers it.
      auto op = ops_.find(e.handshake_op);
      LAMINAR_CHECK(op != ops_.end());
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      p.cb.send = &TransportCore::am_send_cb;
      p.user_data = op->second.get();
      void* req = ucp_ep_flush_nbx(e.ep(), &p);
      if (req == nullptr) {
        finish_connect(e);
      } else if (UCS_PTR_IS_ERR(req)) {
        fail_endpoint(e, unavailable(fmt::format("cannot connect to {}: {}", e.peer, ucs_text(UCS_PTR_STATUS(req)))));
      } else {
        ++op->second->ucx_inflight;
        ++ucx_inflight_;
      }
      return;
    }
    default:
      fail_endpoint(e, data_loss(fmt::format("peer {} sent bootstrap frame kind {} after its welcome", e.peer,
                                             static_cast<int>(f.kind))));
      return;
  }
}

void TransportCore::open_accepted(EndpointState& e) {
  e.phase = Phase::kReady;
  e.last_active = clock_->now();
  if (auto op = ops_.find(e.handshake_op); op != ops_.end()) resolve(*op->second, ok_status());
  {
    std::lock_guard lock(queues_mu_);
    accepted_.push_back(make_endpoint(find(e.id)));
  }
  queues_cv_.notify_all();
}

void TransportCore::finish_connect(EndpointState& e) {
  e.phase = Phase::kReady;
  e.last_active = clock_->now();
  char* text = nullptr;
  std::size_t len = 0;
  if (FILE* mem = open_memstream(&text, &len)) {
    ucp_ep_print_info(e.ep(), mem);
    std::fclose(mem);
    e.set_info(std::string(text, len));
    std::free(text);
  }
  BootstrapFrame ready;
  ready.kind = BootstrapKind::kReady;
  send_bootstrap(e, ready);
  if (find(e.id) == nullptr) return;  // the socket failed while writing
  if (auto op = ops_.find(e.handshake_op); op != ops_.end()) resolve_connect(*op->second, find(e.id));
}

// ---------------------------------------------------------------------------------------------
// What a connection holds (progress thread)

void TransportCore::close_connection(EndpointState& e) {
  if (e.socket) {
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, e.socket.get(), nullptr);
    e.socket.reset();
  }
  e.watching = 0;
  if (e.token != 0) by_token_.erase(e.token);
  unauthenticated_.erase(e.id);
  bool changed = false;
  for (const IpAddress& a : std::exchange(e.admitted, {})) {
    auto it = admitted_.find(a);
    if (it != admitted_.end() && --it->second == 0) {
      admitted_.erase(it);
      changed = true;
    }
  }
  if (changed) update_filters();
  if (e.worker) e.worker->endpoints.erase(e.id);
  e.worker.reset();
}

Status TransportCore::admit_peer(EndpointState& e, const std::vector<IpAddress>& listed) {
  std::set<IpAddress> theirs(listed.begin(), listed.end());
  if (e.peer_ip) theirs.insert(*e.peer_ip);
  bool changed = false;
  for (const IpAddress& a : theirs) {
    changed |= admitted_[a]++ == 0;
    e.admitted.push_back(a);
  }
  if (changed && !update_filters()) {
    return resource_exhausted(fmt::format("cannot let {} more peer addresses through the filter of UCX's "
                                          "listening sockets ({} admitted already)",
                                          theirs.size(), admitted_.size() - theirs.size()));
  }
  return ok_status();
}

bool TransportCore::update_filters() {
  std::set<IpAddress> allowed;
  for (const auto& [a, connections] : admitted_) allowed.insert(a);
  bool all = true;
  for (int fd : ucx_listeners_) all &= admit_only(fd, allowed);
  return all;
}

Result<std::shared_ptr<PeerWorker>> TransportCore::peer_worker(const std::vector<std::byte>& address) {
  std::string key(reinterpret_cast<const char*>(address.data()), address.size());
  if (auto it = peers_.find(key); it != peers_.end()) return it->second;
  ucp_ep_params_t p{};
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                 UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.address = reinterpret_cast<const ucp_address_t*>(address.data());
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = &TransportCore::ep_error_cb;
  p.err_handler.arg = this;
  ucp_ep_h ep = nullptr;
  const ucs_status_t s = ucp_ep_create(worker_, &p, &ep);
  if (s != UCS_OK) return unavailable("UCX cannot reach the peer's worker: " + ucs_text(s));
  auto w = std::make_shared<PeerWorker>();
  w->ep = ep;
  w->address = key;
  peers_.emplace(std::move(key), w);
  by_handle_.emplace(ep, w);
  return w;
}

std::uint64_t TransportCore::new_token() {
  for (;;) {
    std::uint64_t t = 0;
    randombytes_buf(&t, sizeof(t));
    if (t != 0 && by_token_.count(t) == 0) return t;
  }
}

}  // namespace laminar::internal
