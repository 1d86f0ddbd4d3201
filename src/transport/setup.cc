// Starting and stopping a Transport: UCX context and worker, progress and callback threads, teardown.
#include <fmt/format.h>
#include <sodium.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "transport/core.h"
#include "transport/listen_socket.h"
#include "transport/same_host.h"

namespace laminar::internal {

using std::chrono::milliseconds;

namespace {

// After the last UCX event, keep polling this long before arming the wakeup fd: a transfer that
// continues within it never pays a sleep/wake round trip.
constexpr auto kSpinAfterActivity = std::chrono::microseconds(50);
// How long shutdown waits for endpoints to close before the worker is destroyed anyway.
constexpr auto kCloseGrace = milliseconds(1000);
// While UCX keeps the progress thread busy it never sleeps in epoll; it looks at the sockets this often.
constexpr auto kSocketPollInterval = milliseconds(1);
// UCX refuses to arm the worker while it has something to finish. A message a peer is writing is
// whole within microseconds; once nothing has progressed for this long the thread polls UCX at most
// once a millisecond instead of spinning.
constexpr auto kArmRefusedSpin = milliseconds(1);
// A worker that has refused every arm, with nothing progressing when it refused, for this long is
// wedged (a same-host sender died mid-message into its FIFO: see names_mm) and is replaced. Only
// refusals the thread saw count: at least kWedgedRefusals of them, so that a thread the scheduler
// kept off the cores for this long does not take its own absence for a wedge.
constexpr auto kWedgedAfter = milliseconds(1000);
constexpr unsigned kWedgedRefusals = 100;

// UCX's listening sockets are told apart as the ones that appear while a worker is created, so two
// transports must not create their workers at once. (A TCP listener another thread of the
// application opens in those milliseconds would be taken for UCX's, and filtered too.)
std::mutex worker_creation_mu;

// Whether a UCX_TLS value names one of `names` among its transports ("posix" and "posix:aux" both
// name posix).
bool names_any(const std::string& tls, std::initializer_list<std::string_view> names) {
  std::size_t start = !tls.empty() && tls.front() == '^' ? 1 : 0;
  while (start < tls.size()) {
    const std::size_t comma = std::min(tls.find(',', start), tls.size());
    const std::string_view item(tls.data() + start, comma - start);
    const std::string_view name = item.substr(0, item.find(':'));
    for (std::string_view n : names) {
      if (name == n) return true;
    }
    start = comma + 1;
  }
  return false;
}

// UCX's "mm" transports (posix, sysv) carry messages through one FIFO in the receiver's shared memory
// that every sender on the host writes into: a sender takes a slot (an atomic add on the head),
// copies its message in, then marks the slot written. A sender killed between the two leaves a slot
// that is never marked. The receiver reads strictly in order, so it never reads another message from
// anyone, and UCX answers every ucp_worker_arm with busy (the head is past what it read). UCX has no
// way out of that state (docs/design.md, "What a dying peer can do"). They are what "sm", "shm" and
// "mm" bring in.
bool names_mm(const std::string& tls) { return names_any(tls, {"sm", "shm", "mm", "posix", "sysv"}); }

// The transports UCX may use: what the caller asked for, where that is a list of transports to use;
// otherwise UCX's choice (or the caller's exclusion list) without the mm transports. Messages between
// processes on one host then go over tcp, and put/get between them is copied by the transport itself
// (same_host.h).
std::string transports_to_use(const std::string& asked) {
  if (asked.empty() || asked == "all") return "^posix,sysv";
  if (asked.front() != '^') return asked;
  std::string tls = asked;
  for (const char* mm : {"posix", "sysv"}) {
    if (!names_any(tls, {mm})) tls += std::string(tls.size() > 1 ? "," : "") + mm;
  }
  return tls;
}

// Whether a UCX_TLS value from transports_to_use lets UCX pick an mm transport.
bool may_use_mm(const std::string& tls) { return tls.front() != '^' && names_mm(tls); }

// Whether put/get may bypass UCX between processes of one host (same_host.h): unless the list keeps
// UCX off shared memory ("tcp" alone: the caller wants the network) or excludes cma, the kernel
// mechanism the copy uses.
bool may_copy_directly(const std::string& tls) {
  if (tls.front() == '^') return !names_any(tls, {"cma"});
  return names_mm(tls) || names_any(tls, {"cma"});
}

// Whether UCX may move put/get bytes between hosts itself: only with RDMA hardware (the kernel
// lists it, RoCE included, under /sys/class/infiniband) and transports that may use it. Otherwise
// UCX emulates put and get with messages the target answers from inside UCX, and an answer to a
// peer that died first aborts the target's process; the transport then carries them itself.
bool may_use_rdma(const std::string& tls) {
  std::error_code ec;
  if (std::filesystem::is_empty("/sys/class/infiniband", ec) || ec) return false;
  const std::initializer_list<std::string_view> rdma = {"ib", "rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5",
                                                        "dc", "dc_x", "dc_mlx5"};
  return tls.front() == '^' ? !names_any(tls, rdma) : names_any(tls, rdma);
}

// Whether a UCX_TLS value lets UCX pick tcp.
bool may_use_tcp(const std::string& tls) {
  if (tls.empty() || tls == "all") return true;
  return (tls.front() == '^') != names_any(tls, {"tcp"});
}

}  // namespace

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
  if (options.handshake_timeout.count() <= 0) {
    return invalid_argument(
        fmt::format("handshake_timeout of {} ns is not positive", options.handshake_timeout.count()));
  }
  if (options.idle_timeout.count() <= 0) {
    return invalid_argument(fmt::format("idle_timeout of {} ns is not positive", options.idle_timeout.count()));
  }
  if (options.max_unauthenticated_connections == 0) return invalid_argument("max_unauthenticated_connections is 0");
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
  host_key_ = same_host_key();
  crypto_generichash(key_.data(), key_.size(),
                     reinterpret_cast<const unsigned char*>(options_.cluster_token.data()),
                     options_.cluster_token.size(), nullptr, 0);

  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return unavailable("UCX configuration could not be read: " + ucs_text(s));
  std::string asked = options_.ucx_transports;
  if (asked.empty()) {
    const char* env = std::getenv("UCX_TLS");
    asked = env != nullptr ? env : "";
  }
  const std::string tls = transports_to_use(asked);
  s = ucp_config_modify(config, "TLS", tls.c_str());
  // Endpoints use peer error handling (to learn that a peer vanished). UCX then drops the mm
  // transports unless they are told to support it, silently falling back to tcp. The name is the mm
  // base table's ("MM_"), which UCX applies to both posix and sysv; "POSIX_..." set this way is
  // ignored with a warning.
  mm_possible_ = may_use_mm(tls);
  if (s == UCS_OK && mm_possible_) s = ucp_config_modify(config, "MM_ERROR_HANDLING", "y");
  direct_copy_allowed_ = may_copy_directly(tls);
  native_rma_ = may_use_rdma(tls);
  // UCX's tcp defaults (8 KiB send segments) cost about half the bandwidth of a plain socket loop on
  // bulk puts (transport_bench); bigger segments close most of the gap. UCX_TCP_* in the environment
  // still wins. Keys are given without the "TCP_" component prefix, as UCX matches them; without
  // tcp among the transports UCX would warn that nobody reads them.
  for (const auto& [name, value] : {std::pair{"TX_SEG_SIZE", "64K"}, std::pair{"RX_SEG_SIZE", "256K"}}) {
    if (s == UCS_OK && may_use_tcp(tls) && std::getenv((std::string("UCX_TCP_") + name).c_str()) == nullptr) {
      s = ucp_config_modify(config, name, value);
    }
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
  auto worker = create_worker();
  if (!worker.ok()) return worker.status();
  install_worker(std::move(*worker));
  own_addresses_ = local_addresses(kMaxPeerAddresses);

  event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (event_fd_ < 0 || epoll_fd_ < 0)
    return unavailable(fmt::format("eventfd/epoll: {}", std::strerror(errno)));
  for (const auto& [fd, tag] : {std::pair{event_fd_, kEventFdTag}, std::pair{worker_fd_, kWorkerFdTag}}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = tag;
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

Result<TransportCore::Worker> TransportCore::create_worker() {
  Worker w;
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  {
    std::lock_guard lock(worker_creation_mu);
    const auto before = listening_tcp_sockets();
    const ucs_status_t s = ucp_worker_create(context_, &wp, &w.handle);
    if (s != UCS_OK) return unavailable("UCX worker creation failed: " + ucs_text(s));
    for (const auto& socket : listening_tcp_sockets()) {
      if (before.count(socket) == 0) w.listeners.push_back(socket.first);
    }
  }
  auto fail = [&](Status st) {
    ucp_worker_destroy(w.handle);
    return st;
  };
  // Nobody has authenticated yet: UCX's sockets admit no one (see listen_socket.h).
  for (int fd : w.listeners) {
    if (!admit_only(fd, {})) {
      return fail(
          unavailable(fmt::format("cannot filter UCX's listening socket {}: {}", fd, std::strerror(errno))));
    }
  }
  ucp_address_t* address = nullptr;
  std::size_t address_bytes = 0;
  ucs_status_t s = ucp_worker_get_address(w.handle, &address, &address_bytes);
  if (s != UCS_OK) return fail(unavailable("UCX worker address: " + ucs_text(s)));
  const auto* first = reinterpret_cast<const std::byte*>(address);
  w.address.assign(first, first + address_bytes);
  ucp_worker_release_address(w.handle, address);
  if (w.address.size() > kMaxWorkerAddressBytes) {
    return fail(unavailable(fmt::format("UCX worker address of {} bytes is over the {} a handshake carries",
                                        w.address.size(), kMaxWorkerAddressBytes)));
  }
  s = ucp_worker_get_efd(w.handle, &w.fd);
  if (s != UCS_OK) return fail(unavailable("UCX worker has no wakeup fd: " + ucs_text(s)));
  ucp_am_handler_param_t ap{};
  ap.field_mask =
      UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  ap.id = kAmId;
  ap.cb = &TransportCore::am_recv_cb;
  ap.arg = this;
  s = ucp_worker_set_am_recv_handler(w.handle, &ap);
  if (s == UCS_OK) {
    ap.id = kRmaAmId;
    ap.cb = &TransportCore::rma_recv_cb;
    s = ucp_worker_set_am_recv_handler(w.handle, &ap);
  }
  if (s != UCS_OK) return fail(unavailable("UCX active-message handler: " + ucs_text(s)));
  return w;
}

void TransportCore::install_worker(Worker w) {
  worker_ = w.handle;
  worker_address_ = std::move(w.address);
  ucx_listeners_ = std::move(w.listeners);
  worker_fd_ = w.fd;
}

void TransportCore::replace_worker() {
  auto fresh = create_worker();
  if (fresh.ok()) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kWorkerFdTag;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fresh->fd, &ev) != 0) {
      ucp_worker_destroy(fresh->handle);
      fresh = unavailable(fmt::format("epoll_ctl: {}", std::strerror(errno)));
    }
  }
  if (!fresh.ok()) {
    // The wedged worker stays; the watchdog tries again after another kWedgedAfter.
    std::fprintf(stderr, "laminar transport: cannot replace the wedged UCX worker: %s\n",
                 fresh.status().to_string().c_str());
    return;
  }
  const Status wedged = unavailable(
      "this process stopped receiving over UCX's shared memory (a peer on this host died in the middle of a "
      "message to it), so its UCX worker was replaced and every connection closed: connect again");
  std::vector<std::shared_ptr<EndpointState>> all;
  for (const auto& [id, e] : endpoints_) all.push_back(e);
  for (const auto& e : all) fail_endpoint(*e, wedged);
  close_peer_workers();
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, worker_fd_, nullptr);
  ucp_worker_destroy(worker_);
  // Every op was resolved with its endpoint; what UCX still held of them went with the worker.
  for (auto& [id, op] : ops_) {
    if (op->ucx_inflight == 0) continue;
    op->ucx_inflight = 0;
    maybe_release(*op);
  }
  ucx_inflight_ = 0;
  failed_peers_.clear();  // handles of the old worker, which a new endpoint may reuse
  install_worker(std::move(*fresh));
  workers_replaced_.fetch_add(1, std::memory_order_relaxed);
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
    inbox_bytes_by_endpoint_.clear();
    inbox_bytes_ = 0;
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

// Until the nearest deadline, or the next idle_timeout check where there is one; -1 (for ever)
// without either. On a virtual clock this is only an upper bound in real time: a jump of the clock
// wakes the thread through the command eventfd (clock_wake_).
int TransportCore::epoll_timeout_ms() const {
  Duration next = deadlines_.empty() ? kForever : deadlines_.begin()->first;
  if (options_.idle_timeout != kForever) next = std::min(next, next_idle_check_);
  if (next == kForever) return -1;
  const auto wait = std::chrono::ceil<milliseconds>(next - clock_->now()).count();
  return static_cast<int>(std::clamp<long long>(wait, 0, std::numeric_limits<int>::max()));
}

void TransportCore::close_queued_endpoints() {
  for (ucp_ep_h ep : std::exchange(to_close_, {})) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* req = ucp_ep_close_nbx(ep, &p);
    if (UCS_PTR_IS_PTR(req)) closing_.push_back(req);
  }
}

void TransportCore::reap_closed_requests() {
  std::erase_if(closing_, [](void* r) {
    if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
    ucp_request_free(r);
    return true;
  });
}

void TransportCore::progress_loop() {
  Duration last_activity = real_time_->now();
  // Since when every arm was refused with nothing progressing (real time), and how many refusals;
  // kForever: an arm was granted.
  Duration stuck_since = kForever;
  unsigned refusals = 0;
  while (!stop_.load(std::memory_order_acquire)) {
    run_commands();
    unsigned progressed = 0;
    while (unsigned n = ucp_worker_progress(worker_)) progressed += n;
    fail_peer_workers();
    close_queued_endpoints();
    reap_closed_requests();
    const Duration now = real_time_->now();
    if (now - last_socket_poll_ >= kSocketPollInterval) poll_events(0);
    expire_deadlines();
    close_idle_connections();
    sweep();
    if (!dead_rkeys_.empty() && closing_.empty() && ucx_inflight_ == 0) {
      for (ucp_rkey_h k : std::exchange(dead_rkeys_, {})) ucp_rkey_destroy(k);
    }
    if (progressed > 0) {
      last_activity = now;
      continue;
    }
    // Keep polling briefly after any activity: data tends to come in bursts (a receiver of a bulk
    // transfer has nothing in flight itself), and a sleep/wake round trip per segment halves tcp
    // bandwidth. Idle longer than that, and the thread sleeps.
    const bool busy = ucx_inflight_ > 0 || !closing_.empty();
    if (now - last_activity < kSpinAfterActivity) continue;
    // The socket poll above may have drained the eventfd that posted these: look before sleeping.
    if (has_commands_.load(std::memory_order_acquire) || stop_.load(std::memory_order_acquire)) continue;
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) {
      if (now - last_activity < kArmRefusedSpin) continue;
      if (stuck_since == kForever) stuck_since = now;
      if (mm_possible_ && ++refusals >= kWedgedRefusals && now - stuck_since >= kWedgedAfter) {
        replace_worker();
        stuck_since = kForever;
        refusals = 0;
        continue;
      }
      poll_events(1);
      continue;
    }
    stuck_since = kForever;
    refusals = 0;
    // With operations in flight, a transport without reliable wakeups must not stall them: nap 1 ms.
    poll_events(busy ? 1 : epoll_timeout_ms());
  }
  teardown_on_progress_thread();
}

void TransportCore::poll_events(int timeout_ms) {
  epoll_event events[16];
  const int n = epoll_wait(epoll_fd_, events, 16, timeout_ms);
  for (int i = 0; i < n; ++i) {
    const std::uint64_t tag = events[i].data.u64;
    if (tag == kEventFdTag) {
      std::uint64_t v;
      [[maybe_unused]] auto r = read(event_fd_, &v, sizeof(v));
    } else if (tag == kListenTag) {
      accept_connections();
    } else if (tag != kWorkerFdTag) {  // the worker is progressed at the top of the loop
      on_socket_event(tag, events[i].events);
    }
  }
  last_socket_poll_ = real_time_->now();
}

void TransportCore::close_peer_workers() {
  for (auto& [address, w] : peers_) to_close_.push_back(std::exchange(w->ep, nullptr));
  peers_.clear();
  by_handle_.clear();
  close_queued_endpoints();
  const Duration give_up = real_time_->now() + kCloseGrace;
  while ((!closing_.empty() || ucx_inflight_ > 0) && real_time_->now() < give_up) {
    ucp_worker_progress(worker_);
    reap_closed_requests();
  }
  for (void* r : std::exchange(closing_, {})) ucp_request_free(r);
  for (ucp_rkey_h k : std::exchange(dead_rkeys_, {})) ucp_rkey_destroy(k);
}

void TransportCore::teardown_on_progress_thread() {
  // Commands posted before accepting_commands_ went false still run, so their callers get answers.
  has_commands_.store(true);
  run_commands();
  tearing_down_ = true;
  listen_socket_.reset();
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
    close_connection(*e);
  }
  endpoints_.clear();
  close_peer_workers();
  // Ops UCX never completed keep their buffers until here; the worker is destroyed next.
  release_candidates_.clear();
  ops_.clear();
  deadlines_.clear();
}

}  // namespace laminar::internal
