// The UCX-backed transport (include/laminar/transport.h). Its threads and time: transport/core.h.
#include <fmt/format.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sodium.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "laminar/transport.h"
#include "transport/core.h"
#include "transport/listen_socket.h"
#include "transport/protocol.h"
#include "transport/wire.h"

namespace laminar::internal {

using std::chrono::milliseconds;

static_assert(kKeyBytes == crypto_auth_hmacsha256_KEYBYTES);

namespace {

// The single UCP active-message id laminar registers; every frame travels on it.
constexpr unsigned kAmId = 0x1a;
// After the last UCX event, keep polling this long before arming the wakeup fd: a transfer that
// continues within it never pays a sleep/wake round trip.
constexpr auto kSpinAfterActivity = std::chrono::microseconds(50);
// How long shutdown waits for endpoints to close before the worker is destroyed anyway.
constexpr auto kCloseGrace = milliseconds(1000);

std::string ucs_text(ucs_status_t s) { return ucs_status_string(s); }

// "250 ms", or "1500 ns" below a millisecond, for error messages.
std::string duration_text(Duration d) {
  if (d == kForever) return "forever";
  if (d >= milliseconds(1)) return fmt::format("{} ms", std::chrono::duration_cast<milliseconds>(d).count());
  return fmt::format("{} ns", d.count());
}

bool is_reserved(MessageType type) { return type >= kLaminarMessageTypeFirst; }

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

// UCX_TLS value that keeps the user's choice but always includes tcp, without which UCX cannot set
// up a client/server (sockaddr) connection.
std::string transports_with_tcp(std::string tls) {
  if (tls.empty() || tls == "all") return tls;
  std::vector<std::string> items;
  std::size_t start = 0;
  const bool exclude = tls.front() == '^';
  if (exclude) start = 1;
  while (start <= tls.size()) {
    const auto comma = tls.find(',', start);
    const auto end = comma == std::string::npos ? tls.size() : comma;
    if (end > start) items.push_back(tls.substr(start, end - start));
    start = end + 1;
  }
  const auto is_tcp = [](const std::string& s) { return s == "tcp"; };
  const bool has_tcp = std::any_of(items.begin(), items.end(), is_tcp);
  if (exclude) {
    items.erase(std::remove_if(items.begin(), items.end(), is_tcp), items.end());
    if (items.empty()) return "all";
  } else if (!has_tcp) {
    items.emplace_back("tcp");
  }
  std::string out = exclude ? "^" : "";
  for (std::size_t i = 0; i < items.size(); ++i) out += (i ? "," : "") + items[i];
  return out;
}

// Whether a UCX_TLS value (after transports_with_tcp) lets UCX pick a shared-memory transport.
bool may_use_shared_memory(const std::string& tls) {
  if (tls.empty() || tls == "all" || tls.front() == '^') return true;
  for (const char* name : {"sm", "shm", "mm", "posix", "sysv"}) {
    const std::string n(name);
    std::size_t at = 0;
    while ((at = tls.find(n, at)) != std::string::npos) {
      const bool starts = at == 0 || tls[at - 1] == ',';
      const bool ends = at + n.size() == tls.size() || tls[at + n.size()] == ',' || tls[at + n.size()] == ':';
      if (starts && ends) return true;
      at += n.size();
    }
  }
  return false;
}


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
// Setup and teardown

Result<std::shared_ptr<TransportCore>> TransportCore::create(TransportOptions options) {
  if (options.cluster_token.size() < TransportOptions::kMinTokenBytes) {
    return invalid_argument(fmt::format("cluster_token of {} bytes is shorter than the minimum {}",
                                        options.cluster_token.size(), TransportOptions::kMinTokenBytes));
  }
  if (options.max_message_bytes == 0) return invalid_argument("max_message_bytes is 0");
  if (options.connect_timeout.count() <= 0) {
    return invalid_argument(
        fmt::format("connect_timeout of {} ns is not positive", options.connect_timeout.count()));
  }
  if (options.operation_timeout.count() <= 0) {
    return invalid_argument(
        fmt::format("operation_timeout of {} ns is not positive", options.operation_timeout.count()));
  }
  if (options.clock == nullptr) options.clock = Clock::steady();
  if (sodium_init() < 0) return unavailable("libsodium failed to initialise");
  auto core = std::make_shared<TransportCore>(std::move(options));
  Status st = core->start();
  if (!st.ok()) {
    core->shutdown();
    return st;
  }
  return core;
}

Status TransportCore::start() {
  // The token is hashed into the MAC key so its length and bytes never matter beyond this line.
  crypto_generichash(key_.data(), key_.size(),
                     reinterpret_cast<const unsigned char*>(options_.cluster_token.data()),
                     options_.cluster_token.size(), nullptr, 0);

  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return unavailable("UCX configuration could not be read: " + ucs_text(s));
  std::string tls = options_.ucx_transports;
  if (tls.empty()) {
    const char* env = std::getenv("UCX_TLS");
    tls = env != nullptr ? env : "";
  }
  tls = transports_with_tcp(tls);
  if (!tls.empty()) s = ucp_config_modify(config, "TLS", tls.c_str());
  // Endpoints use peer error handling (to learn that a peer vanished). UCX then drops its shared
  // memory transports unless they are told to support it, silently falling back to tcp. The name
  // is the mm base table's ("MM_"), which UCX applies to both posix and sysv; "POSIX_..." set this
  // way is ignored with a warning.
  if (s == UCS_OK && may_use_shared_memory(tls)) s = ucp_config_modify(config, "MM_ERROR_HANDLING", "y");
  // UCX's tcp defaults (8 KiB send segments) cost about half the bandwidth of a plain socket loop on
  // bulk puts (transport_bench); bigger segments close most of the gap. UCX_TCP_* in the environment
  // still wins. Keys are given without the "TCP_" component prefix, as UCX matches them.
  for (const auto& [name, value] : {std::pair{"TX_SEG_SIZE", "64K"}, std::pair{"RX_SEG_SIZE", "256K"}}) {
    if (s == UCS_OK && std::getenv((std::string("UCX_TCP_") + name).c_str()) == nullptr) {
      s = ucp_config_modify(config, name, value);
    }
  }
  // A listener that restarts on its port must not wait for the last run's connections to leave
  // TIME_WAIT. Two live listeners still cannot share a port (that would need SO_REUSEPORT).
  if (s == UCS_OK && std::getenv("UCX_TCP_CM_REUSEADDR") == nullptr) {
    s = ucp_config_modify(config, "CM_REUSEADDR", "y");
  }
  if (s != UCS_OK) {
    ucp_config_release(config);
    return invalid_argument(fmt::format("UCX rejected transports '{}': {}", tls, ucs_text(s)));
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 1;
  s = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (s != UCS_OK) {
    context_ = nullptr;
    return unavailable(fmt::format("UCX context with transports '{}' failed: {}", tls, ucs_text(s)));
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(context_, &wp, &worker_);
  if (s != UCS_OK) {
    worker_ = nullptr;
    return unavailable("UCX worker creation failed: " + ucs_text(s));
  }
  s = ucp_worker_get_efd(worker_, &worker_fd_);
  if (s != UCS_OK) return unavailable("UCX worker has no wakeup fd: " + ucs_text(s));

  ucp_am_handler_param_t ap{};
  ap.field_mask =
      UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  ap.id = kAmId;
  ap.cb = &TransportCore::am_recv_cb;
  ap.arg = this;
  s = ucp_worker_set_am_recv_handler(worker_, &ap);
  if (s != UCS_OK) return unavailable("UCX active-message handler: " + ucs_text(s));

  event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (event_fd_ < 0 || epoll_fd_ < 0)
    return unavailable(fmt::format("eventfd/epoll: {}", std::strerror(errno)));
  for (int fd : {event_fd_, worker_fd_}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      return unavailable(fmt::format("epoll_ctl: {}", std::strerror(errno)));
    }
  }
  // A jump of a virtual clock wakes whoever waits for a deadline: the progress thread (through the
  // command eventfd) and accept/receive (through their condition variable).
  clock_wake_ = clock_->subscribe([this] {
    const std::uint64_t one = 1;
    [[maybe_unused]] auto n = write(event_fd_, &one, sizeof(one));
    { std::lock_guard lock(queues_mu_); }
    queues_cv_.notify_all();
  });
  progress_thread_ = std::thread([this] { progress_loop(); });
  callback_thread_ = std::thread([this] { callback_loop(); });
  return ok_status();
}

void TransportCore::shutdown() {
  clock_wake_.reset();  // it writes to event_fd_, closed below
  {
    std::lock_guard lock(cmd_mu_);
    accepting_commands_ = false;
  }
  stop_.store(true);
  if (event_fd_ >= 0) {
    const std::uint64_t one = 1;
    [[maybe_unused]] auto n = write(event_fd_, &one, sizeof(one));
  }
  if (progress_thread_.joinable()) progress_thread_.join();
  {
    std::lock_guard lock(cb_mu_);
    cb_stop_ = true;
  }
  cb_cv_.notify_all();
  if (callback_thread_.joinable()) {
    LAMINAR_CHECK_MSG(callback_thread_.get_id() != std::this_thread::get_id(),
                      "a Transport was destroyed from one of its own callbacks");
    callback_thread_.join();
  }
  // From now on post_callback runs its job at once; these came after the thread's last look.
  std::deque<std::function<void()>> late;
  {
    std::lock_guard lock(cb_mu_);
    cb_stopped_ = true;
    late.swap(callbacks_);
  }
  for (auto& job : late) job();
  {
    std::lock_guard lock(queues_mu_);
    shut_down_ = true;
    inbox_.clear();
    accepted_.clear();
  }
  queues_cv_.notify_all();
  {
    std::lock_guard lock(handlers_mu_);
    handlers_.clear();  // handlers may hold Endpoint handles, which hold this core
  }
  if (worker_ != nullptr) {
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
  }
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (event_fd_ >= 0) close(event_fd_);
  epoll_fd_ = event_fd_ = -1;
}

TransportCore::~TransportCore() {
  shutdown();
  if (context_ != nullptr) ucp_cleanup(context_);
}

RegionState::~RegionState() { ucp_mem_unmap(core->context(), memh); }

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

// ---------------------------------------------------------------------------------------------
// Threads

bool TransportCore::post(std::function<void()> fn) {
  // Under the lock: shutdown closes event_fd_ only after it stopped accepting commands.
  std::lock_guard lock(cmd_mu_);
  if (!accepting_commands_) return false;
  commands_.push_back(std::move(fn));
  has_commands_.store(true, std::memory_order_release);
  const std::uint64_t one = 1;
  [[maybe_unused]] auto n = write(event_fd_, &one, sizeof(one));
  return true;
}

void TransportCore::post_callback(std::function<void()> fn) {
  {
    std::lock_guard lock(cb_mu_);
    if (!cb_stopped_) {
      callbacks_.push_back(std::move(fn));
      cb_cv_.notify_one();
      return;
    }
  }
  fn();
}

void TransportCore::callback_loop() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock lock(cb_mu_);
      cb_cv_.wait(lock, [&] { return cb_stop_ || !callbacks_.empty(); });
      if (callbacks_.empty()) return;  // stopping, and every queued job has run
      job = std::move(callbacks_.front());
      callbacks_.pop_front();
    }
    try {
      job();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "laminar transport: a message handler or callback threw: %s\n", e.what());
    } catch (...) {
      std::fprintf(stderr, "laminar transport: a message handler or callback threw\n");
    }
  }
}

void TransportCore::run_commands() {
  if (!has_commands_.load(std::memory_order_acquire)) return;
  std::vector<std::function<void()>> batch;
  {
    std::lock_guard lock(cmd_mu_);
    batch.swap(commands_);
    has_commands_.store(false, std::memory_order_relaxed);
  }
  for (auto& fn : batch) fn();
}

// Until the nearest deadline. On a virtual clock this is only an upper bound in real time: a jump
// of the clock wakes the thread through the command eventfd (clock_wake_).
int TransportCore::epoll_timeout_ms() const {
  constexpr int kMaxSleepMs = 500;
  if (deadlines_.empty()) return kMaxSleepMs;
  const auto wait = std::chrono::ceil<milliseconds>(deadlines_.begin()->first - clock_->now()).count();
  return static_cast<int>(std::clamp<long long>(wait, 0, kMaxSleepMs));
}

void TransportCore::progress_loop() {
  Duration last_activity = real_time_->now();
  while (!stop_.load(std::memory_order_acquire)) {
    run_commands();
    unsigned progressed = 0;
    while (unsigned n = ucp_worker_progress(worker_)) progressed += n;
    for (ucp_ep_h ep : std::exchange(to_close_, {})) {
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
      void* req = ucp_ep_close_nbx(ep, &p);
      if (UCS_PTR_IS_PTR(req)) closing_.push_back(req);
    }
    closing_.erase(std::remove_if(closing_.begin(), closing_.end(),
                                  [](void* r) {
                                    if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
                                    ucp_request_free(r);
                                    return true;
                                  }),
                   closing_.end());
    expire_deadlines();
    sweep();
    if (!dead_rkeys_.empty() && closing_.empty() && ucx_inflight_ == 0) {
      for (ucp_rkey_h k : std::exchange(dead_rkeys_, {})) ucp_rkey_destroy(k);
    }
    const Duration now = real_time_->now();
    if (progressed > 0) {
      last_activity = now;
      continue;
    }
    // Keep polling briefly after any activity: data tends to come in bursts (a receiver of a bulk
    // transfer has nothing in flight itself), and a sleep/wake round trip per segment halves tcp
    // bandwidth. Idle longer than that, and the thread sleeps.
    const bool busy = ucx_inflight_ > 0 || !closing_.empty();
    if (now - last_activity < kSpinAfterActivity) continue;
    if (has_commands_.load(std::memory_order_acquire)) continue;
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
    epoll_event events[4];
    // With operations in flight, a transport without reliable wakeups must not stall them: nap 1 ms.
    const int n = epoll_wait(epoll_fd_, events, 4, busy ? 1 : epoll_timeout_ms());
    for (int i = 0; i < n; ++i) {
      if (events[i].data.fd == event_fd_) {
        std::uint64_t v;
        [[maybe_unused]] auto r = read(event_fd_, &v, sizeof(v));
      }
    }
  }
  teardown_on_progress_thread();
}

void TransportCore::close_listener() {
  if (listener_ == nullptr) return;
  // Every connection the listener accepted must have delivered its request (and been refused) or be
  // cut before UCX frees the listener, and no new one may complete meanwhile; see
  // transport/listen_socket.h. A client whose handshake falls into this window retries it 1 s on.
  if (listen_fd_ >= 0 && stop_new_connections(listen_fd_)) {
    const Duration give_up = real_time_->now() + kCloseGrace;
    while (real_time_->now() < give_up) {
      while (ucp_worker_progress(worker_) != 0) {
      }
      if (accept_queue_length(listen_fd_) == 0 && cut_accepted_connections(listen_addr_, refused_peers_) == 0) {
        break;
      }
      // Until the next connection lands in the accept queue, or 1 ms for UCX to take one.
      pollfd pending{listen_fd_, POLLIN, 0};
      [[maybe_unused]] int n = ::poll(&pending, 1, 1);
    }
  }
  ucp_listener_destroy(listener_);
  listener_ = nullptr;
  listen_fd_ = -1;
}

void TransportCore::teardown_on_progress_thread() {
  // Commands posted before accepting_commands_ went false still run, so their callers get answers.
  has_commands_.store(true);
  run_commands();
  tearing_down_ = true;
  const Status cancelled_st = cancelled("transport shut down");
  for (auto& [id, op] : ops_) {
    if (!op->resolved) {
      if (op->kind == Op::Kind::kRequest) {
        resolve_reply(*op, cancelled_st);
      } else {
        resolve(*op, cancelled_st);
      }
    }
  }
  for (auto& [id, e] : endpoints_) {
    set_endpoint_error(*e, cancelled_st);
    e->phase = Phase::kClosed;
    destroy_rkeys(*e);
    if (e->ep != nullptr) to_close_.push_back(e->ep);
    e->ep = nullptr;
  }
  endpoints_.clear();
  by_handle_.clear();
  for (ucp_ep_h ep : std::exchange(to_close_, {})) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* req = ucp_ep_close_nbx(ep, &p);
    if (UCS_PTR_IS_PTR(req)) closing_.push_back(req);
  }
  const Duration give_up = real_time_->now() + kCloseGrace;
  while ((!closing_.empty() || ucx_inflight_ > 0) && real_time_->now() < give_up) {
    ucp_worker_progress(worker_);
    closing_.erase(std::remove_if(closing_.begin(), closing_.end(),
                                  [](void* r) {
                                    if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
                                    ucp_request_free(r);
                                    return true;
                                  }),
                   closing_.end());
  }
  for (void* r : closing_) ucp_request_free(r);
  closing_.clear();
  for (ucp_rkey_h k : std::exchange(dead_rkeys_, {})) ucp_rkey_destroy(k);
  close_listener();
  // Ops UCX never completed keep their buffers until here; the worker is destroyed next.
  release_candidates_.clear();
  ops_.clear();
  deadlines_.clear();
}

// ---------------------------------------------------------------------------------------------
// Operations (progress thread)

Op& TransportCore::new_op(Op::Kind kind, std::uint64_t ep_id, Duration timeout, std::string what) {
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

void TransportCore::resolve(Op& op, const Status& s) {
  if (op.resolved) return;
  op.resolved = true;
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
      break;
    case Op::Kind::kHandshake:
    case Op::Kind::kReceive:
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

void TransportCore::on_ucx_done(Op& op, ucs_status_t status) {
  --op.ucx_inflight;
  --ucx_inflight_;
  switch (op.kind) {
    case Op::Kind::kSend:
      resolve(op, status == UCS_OK ? ok_status()
                                   : unavailable(fmt::format("{} failed: {}", op.what, ucs_text(status))));
      break;
    case Op::Kind::kRequest:
    case Op::Kind::kConnect:
    case Op::Kind::kHandshake:
      // The frame left; the answer resolves the op. A failed send means the endpoint is failing too.
      if (status != UCS_OK) {
        if (op.kind == Op::Kind::kRequest) {
          resolve(op, unavailable(fmt::format("{} failed: {}", op.what, ucs_text(status))));
        }
      }
      break;
    case Op::Kind::kRma:
      if (status != UCS_OK && op.rma_error.ok()) {
        op.rma_error = unavailable(fmt::format("{} failed: {}", op.what, ucs_text(status)));
      }
      if (op.ucx_inflight == 0) {
        release_rkey(op);
        resolve(op, op.rma_error);
      }
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
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = &TransportCore::am_send_cb;
  p.user_data = &op;
  p.flags = UCP_AM_SEND_FLAG_REPLY;
  void* req = ucp_am_send_nbx(e.ep, kAmId, nullptr, 0, op.buffer.data(), op.buffer.size(), &p);
  if (req == nullptr) {
    if (op.kind == Op::Kind::kSend) resolve(op, ok_status());
    return;
  }
  if (UCS_PTR_IS_ERR(req)) {
    const Status st = unavailable(fmt::format("{} failed: {}", op.what, ucs_text(UCS_PTR_STATUS(req))));
    if (op.kind == Op::Kind::kSend || op.kind == Op::Kind::kRequest) {
      resolve(op, st);
    } else {
      fail_endpoint(e, st);
    }
    return;
  }
  ++op.ucx_inflight;
  ++ucx_inflight_;
}

void TransportCore::send_internal(EndpointState& e, const Frame& f) {
  // Handshake frames: fire and forget. Their op has no deadline; a failure shows as an endpoint error.
  Op& op = new_op(Op::Kind::kHandshake, e.id, kForever, fmt::format("handshake with {}", e.peer));
  op.buffer = encode_frame(f);
  op.resolved = true;
  start_send(e, op);
  maybe_release(op);
}

std::shared_ptr<EndpointState> TransportCore::find(ucp_ep_h ep) {
  auto it = by_handle_.find(ep);
  return it == by_handle_.end() ? nullptr : find(it->second);
}

std::shared_ptr<EndpointState> TransportCore::find(std::uint64_t id) {
  auto it = endpoints_.find(id);
  return it == endpoints_.end() ? nullptr : it->second;
}

void TransportCore::close_ucp_ep(EndpointState& e) {
  if (e.ep == nullptr) return;
  by_handle_.erase(e.ep);
  // Closed from the loop, never from inside the UCX callback that noticed the failure.
  to_close_.push_back(e.ep);
  e.ep = nullptr;
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
    const ucs_status_t s = ucp_ep_rkey_unpack(e.ep, packed.data(), &handle);
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
  close_ucp_ep(e);
  endpoints_.erase(e.id);
}

void TransportCore::set_endpoint_error(EndpointState& e, const Status& s) {
  if (!e.set_error(s)) return;
  post_callback([keep = e.shared_from_this()] { keep->fire_close_watchers(); });
}

void TransportCore::refuse(EndpointState& e, const std::string& why) {
  Frame f;
  f.kind = FrameKind::kRefused;
  f.error = why;
  send_internal(e, f);
  e.phase = Phase::kRefused;
  set_endpoint_error(e, failed_precondition(fmt::format("peer {} refused: {}", e.peer, why)));
  // The client hangs up on reading the refusal; the handshake deadline closes it otherwise.
}

void TransportCore::handle_frame(EndpointState& e, std::span<const std::byte> wire) {
  if (e.phase == Phase::kClosed || e.phase == Phase::kRefused) return;
  Result<Frame> decoded = decode_frame(wire, options_.max_message_bytes);
  if (!decoded.ok()) {
    if (e.phase == Phase::kAwaitHello || e.phase == Phase::kAwaitProof) {
      refuse(e, "malformed handshake: " + decoded.status().message());
      return;
    }
    fail_endpoint(e, decoded.status().with_context(fmt::format("message from {}", e.peer)));
    return;
  }
  Frame f = std::move(*decoded);
  if (e.phase != Phase::kReady) {
    handle_handshake(e, std::move(f));
    return;
  }
  switch (f.kind) {
    case FrameKind::kMessage:
    case FrameKind::kRequest: {
      Incoming in{make_endpoint(find(e.id)), Message{f.type, std::move(f.body)},
                  f.kind == FrameKind::kRequest ? f.id : 0};
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
          if (in.request_id != 0) {
            (void)in.from.reply_error(
                in, unimplemented(fmt::format("no laminar protocol serves message type {:#x} here",
                                              in.message.type)));
          }
          return;
        }
        {
          std::lock_guard lock(queues_mu_);
          if (shut_down_) return;
          inbox_.push_back(std::move(in));
        }
        queues_cv_.notify_all();
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
      fail_endpoint(e, data_loss(fmt::format("peer {} sent handshake frame kind {} after authentication",
                                             e.peer, static_cast<int>(f.kind))));
  }
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

ucs_status_t TransportCore::am_recv_cb(void* arg, const void*, std::size_t, void* data, std::size_t length,
                                       const ucp_am_recv_param_t* param) {
  auto* self = static_cast<TransportCore*>(arg);
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
  auto e = self->find(param->reply_ep);
  if (e == nullptr) return UCS_OK;  // an endpoint already failed or closed
  // Before authentication a peer gets no more than a handshake frame's worth of our memory.
  constexpr std::size_t kHandshakeFrameLimit = 4096;
  const std::size_t limit = e->phase == Phase::kReady ? self->options_.max_message_bytes + kFrameOverheadBytes
                                                      : kHandshakeFrameLimit;
  if (length > limit) {
    const Status st = invalid_argument(
        fmt::format("peer {} sent a frame of {} bytes, over the limit of {}", e->peer, length, limit));
    if (e->phase == Phase::kReady) {
      self->fail_endpoint(*e, st);
    } else {
      self->refuse(*e, st.message());
    }
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
  auto* self = static_cast<TransportCore*>(arg);
  auto e = self->find(ep);
  if (e == nullptr) return;
  const bool connecting = e->phase == Phase::kAwaitChallenge || e->phase == Phase::kAwaitWelcome;
  self->fail_endpoint(
      *e, unavailable(connecting ? fmt::format("cannot connect to {}: {}", e->peer, ucs_text(status))
                                 : fmt::format("peer {} vanished: {}", e->peer, ucs_text(status))));
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
  std::unique_lock lock(queues_mu_);
  if (!wait_queue(lock, timeout, [&] { return shut_down_ || !inbox_.empty(); })) {
    return deadline_exceeded(fmt::format("no message arrived within {}", duration_text(timeout)));
  }
  if (shut_down_) return cancelled("transport shut down");
  Incoming in = std::move(inbox_.front());
  inbox_.pop_front();
  return in;
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
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
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
  return MemoryRegion(std::make_shared<RegionState>(
      shared_from_this(), memh, static_cast<std::byte*>(attr.address), size, std::move(rkey)));
}

std::future<Status> TransportCore::send_frame(const std::shared_ptr<EndpointState>& ep, Frame frame,
                                              Duration timeout, std::string what) {
  return send_wire(ep, encode_frame(frame), timeout, std::move(what));
}

std::future<Status> TransportCore::send_wire(const std::shared_ptr<EndpointState>& ep,
                                             std::vector<std::byte> wire, Duration timeout,
                                             std::string what) {
  auto promise = std::make_shared<std::promise<Status>>();
  auto future = promise->get_future();
  const bool posted =
      post([this, ep, promise, wire = std::move(wire), timeout, what = std::move(what)]() mutable {
        auto e = find(ep->id);
        if (e == nullptr || e->phase != Phase::kReady) {
          Status st = ep->status();
          promise->set_value(st.ok() ? unavailable(fmt::format("endpoint to {} is closed", ep->peer)) : st);
          return;
        }
        Op& op = new_op(Op::Kind::kSend, e->id, timeout, std::move(what));
        op.status_promise = std::move(*promise);
        op.buffer = std::move(wire);
        start_send(*e, op);
      });
  if (!posted) promise->set_value(cancelled("transport shut down"));
  return future;
}

std::future<Result<Message>> TransportCore::request(const std::shared_ptr<EndpointState>& ep,
                                                    const Message& m, Duration timeout) {
  auto promise = std::make_shared<std::promise<Result<Message>>>();
  auto future = promise->get_future();
  Frame f;
  f.kind = FrameKind::kRequest;
  f.type = m.type;
  f.body = m.body;
  const bool posted = post([this, ep, promise, f = std::move(f), timeout]() mutable {
    auto e = find(ep->id);
    if (e == nullptr || e->phase != Phase::kReady) {
      Status st = ep->status();
      promise->set_value(st.ok() ? unavailable(fmt::format("endpoint to {} is closed", ep->peer)) : st);
      return;
    }
    Op& op =
        new_op(Op::Kind::kRequest, e->id, timeout, fmt::format("request of type {} to {}", f.type, e->peer));
    op.reply_promise = std::move(*promise);
    f.id = op.id;
    op.buffer = encode_frame(f);
    start_send(*e, op);
  });
  if (!posted) promise->set_value(cancelled("transport shut down"));
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
  const bool posted = post([this, ep, promise, is_put, region, local_offset, rkey = remote.rkey,
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
    auto rkey_handle = acquire_rkey(*e, op, rkey);
    if (!rkey_handle.ok()) {
      resolve(op, rkey_handle.status());
      return;
    }
    std::byte* local_ptr = region->data + local_offset;
    void* direct = nullptr;
    if (ucp_rkey_ptr(*rkey_handle, raddr, &direct) == UCS_OK) {
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
    void* req = is_put ? ucp_put_nbx(e->ep, local_ptr, length, raddr, *rkey_handle, &p)
                       : ucp_get_nbx(e->ep, local_ptr, length, raddr, *rkey_handle, &p);
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
      track(ucp_ep_flush_nbx(e->ep, &fp));
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

void TransportCore::close_endpoint(const std::shared_ptr<EndpointState>& ep) {
  post([this, ep] {
    auto e = find(ep->id);
    if (e == nullptr) return;
    fail_endpoint(*e, cancelled(fmt::format("endpoint to {} closed", e->peer)));
  });
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
  return RemoteRegion{reinterpret_cast<std::uint64_t>(state_->data), state_->size, state_->packed_rkey};
}

std::uint64_t Endpoint::id() const noexcept { return state_ ? state_->id : 0; }
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
                                             const Message& message, std::optional<Duration> timeout) {
  if (!state) return ready_future(no_endpoint());
  auto& core = *state->core;
  if (Status st = core.check_body(message.body.size()); !st.ok()) return ready_future(st);
  auto t = core.operation_timeout(timeout, "request");
  if (!t.ok()) return ready_future(t.status());
  return core.request(state, message, *t);
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
  if (Status st = check_protocol_type(message.type, "request_protocol"); !st.ok()) return ready_future(st);
  return request_message(TransportCore::state_of(endpoint), message, timeout);
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
  if (to.request_id == 0) return invalid_argument("reply to a message that is not a request (request_id 0)");
  auto& core = *state_->core;
  LAMINAR_RETURN_IF_ERROR(core.check_body(message.body.size()));
  Frame f;
  f.kind = FrameKind::kReply;
  f.id = to.request_id;
  f.type = message.type;
  f.body = message.body;
  return core
      .send_frame(state_, std::move(f), core.options().operation_timeout,
                  fmt::format("reply to request {} from {}", to.request_id, state_->peer))
      .get();
}

Status Endpoint::reply_error(const Incoming& to, const Status& error) {
  if (!state_) return no_endpoint();
  if (to.request_id == 0)
    return invalid_argument("reply_error to a message that is not a request (request_id 0)");
  if (error.ok()) return invalid_argument("reply_error with an OK status");
  auto& core = *state_->core;
  Frame f;
  f.kind = FrameKind::kErrorReply;
  f.id = to.request_id;
  f.code = error.code();
  f.error = error.message();
  return core
      .send_frame(state_, std::move(f), core.options().operation_timeout,
                  fmt::format("error reply to request {} from {}", to.request_id, state_->peer))
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
const TransportOptions& Transport::options() const noexcept { return core_->options(); }
std::optional<std::string> Transport::listen_address() const { return core_->listen_address(); }

}  // namespace laminar
