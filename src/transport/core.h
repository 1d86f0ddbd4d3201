// core.h (internal): the state behind Transport, Endpoint and MemoryRegion (transport.cc and transport/).
//
// Threading: every UCP worker call happens on one progress thread. Other threads hand it commands
// through a queue and an eventfd; it answers through promises. While UCX operations are in flight it
// polls the worker (full bandwidth); once idle it arms the worker and sleeps in epoll on the worker's
// wakeup fd, the command eventfd and the nearest deadline. User callbacks (message handlers, put/get
// completions, close watchers) run on a second, callback thread, so a slow handler never stalls the
// wire and a handler may itself block on transport calls. Context-level calls (memory registration)
// are made from any thread: the context is created with mt_workers_shared for that.
//
// Time: every deadline (connect, handshake, request, send, put/get, accept, receive) reads the
// options' Clock, and the core subscribes to it, so a jump of a ManualClock wakes the progress thread
// and every waiter at once. UCX's own progress runs in real time whatever that clock says: the
// polling window after activity and the grace given to closing endpoints read the steady clock.
#pragma once

#include <fmt/format.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "laminar/clock.h"
#include "laminar/status.h"
#include "laminar/transport.h"
#include "transport/wire.h"

namespace laminar::internal {

class TransportTestingAccess;  // laminar_testing's hooks (tests/support), never part of the shipped library

inline constexpr std::size_t kKeyBytes = 32;  // crypto_auth_hmacsha256_KEYBYTES
using Key = std::array<unsigned char, kKeyBytes>;
using Nonce = std::array<std::byte, kNonceBytes>;

// The single UCP active-message id laminar registers; every frame travels on it.
inline constexpr unsigned kAmId = 0x1a;

inline std::string ucs_text(ucs_status_t s) { return ucs_status_string(s); }

// "250 ms", or "1500 ns" below a millisecond, for error messages.
inline std::string duration_text(Duration d) {
  using std::chrono::milliseconds;
  if (d == kForever) return "forever";
  if (d >= milliseconds(1)) return fmt::format("{} ms", std::chrono::duration_cast<milliseconds>(d).count());
  return fmt::format("{} ns", d.count());
}

inline bool is_reserved(MessageType type) { return type >= kLaminarMessageTypeFirst; }

// "host:port" or "[v6]:port" -> sockaddr. kInvalidArgument names what is wrong.
Result<sockaddr_storage> parse_address(std::string_view address);

class RegionState {
 public:
  RegionState(std::shared_ptr<TransportCore> core, ucp_mem_h memh, std::byte* data, std::size_t size,
              std::vector<std::byte> rkey)
      : core(std::move(core)), memh(memh), data(data), size(size), packed_rkey(std::move(rkey)) {}
  ~RegionState();
  RegionState(const RegionState&) = delete;
  RegionState& operator=(const RegionState&) = delete;

  std::shared_ptr<TransportCore> core;  // keeps the UCP context alive while registered
  ucp_mem_h memh;
  std::byte* data;  // [size]
  std::size_t size;
  std::vector<std::byte> packed_rkey;
};

// Handshake and life of one connection, seen from this side.
enum class Phase {
  kAwaitHello,      // server: connection accepted, waiting for the client's nonce
  kAwaitChallenge,  // client: hello sent
  kAwaitProof,      // server: challenge sent
  kAwaitWelcome,    // client: proof sent
  kRefused,         // server: refused the client, waiting for it to hang up
  kReady,
  kClosed,
};

class EndpointState : public std::enable_shared_from_this<EndpointState> {
 public:
  EndpointState(std::shared_ptr<TransportCore> c, std::uint64_t id, std::string peer)
      : core(std::move(c)), id(id), peer(std::move(peer)) {}

  std::shared_ptr<TransportCore> core;
  const std::uint64_t id;
  const std::string peer;

  // Progress thread only.
  ucp_ep_h ep = nullptr;
  Phase phase = Phase::kClosed;
  // Unpacked remote keys by packed bytes. Unpacking attaches the peer's shared-memory segment (a
  // fresh mapping that faults in page by page), so doing it once per region rather than once per
  // put/get is what makes repeated transfers run at memory speed. `users` counts operations in
  // flight on an entry; only unused entries are evicted.
  struct CachedRkey {
    ucp_rkey_h handle = nullptr;
    int users = 0;
  };
  std::unordered_map<std::string, CachedRkey> rkeys;
  Nonce client_nonce{};
  Nonce server_nonce{};
  std::uint64_t handshake_op = 0;

  Status status() const {
    std::lock_guard lock(mu);
    return error;
  }
  std::string info() const {
    std::lock_guard lock(mu);
    return ucx_info;
  }
  // Keeps the first error.
  bool set_error(const Status& s) {
    std::lock_guard lock(mu);
    if (!error.ok()) return false;
    error = s;
    return true;
  }
  void set_info(std::string s) {
    std::lock_guard lock(mu);
    ucx_info = std::move(s);
  }

  // Close watchers (Endpoint::on_close). watch() registers `fn` and returns its id, to be fired by
  // fire_close_watchers() once the endpoint has an error; unwatch() removes it and, unless called
  // from the thread running it, waits until it is no longer running.
  std::uint64_t watch(std::function<void(Status)> fn);
  void unwatch(std::uint64_t id) noexcept;
  // Callback thread: calls, once each, every watcher registered so far, if the endpoint is closed.
  void fire_close_watchers();

 private:
  mutable std::mutex mu;
  Status error;
  std::string ucx_info;
  std::map<std::uint64_t, std::function<void(Status)>> watchers;
  std::uint64_t next_watcher = 1;
  std::uint64_t firing_watcher = 0;  // 0: none running
  std::thread::id firing_thread;
  std::condition_variable watcher_done;
};

// One operation waiting for UCX and/or the peer. Owned by TransportCore::ops_ and destroyed only
// once it is resolved and UCX holds no request pointing at it.
struct Op {
  enum class Kind { kSend, kRequest, kRma, kConnect, kHandshake, kReceive };
  Kind kind = Kind::kSend;
  std::uint64_t id = 0;
  std::uint64_t ep_id = 0;
  TransportCore* core = nullptr;
  bool resolved = false;
  int ucx_inflight = 0;
  bool has_deadline = false;
  std::set<std::pair<Duration, std::uint64_t>>::iterator deadline_it;
  std::string what;  // "request of type 7 to 10.0.0.2:5000", for timeout messages
  Duration timeout = kForever;

  std::promise<Status> status_promise;             // kSend, kRma
  std::promise<Result<Message>> reply_promise;     // kRequest
  std::promise<Result<Endpoint>> connect_promise;  // kConnect
  CompletionCallback done;                         // kRma
  std::vector<std::byte> buffer;                   // frame being sent / received
  std::shared_ptr<RegionState> region;             // kRma: keeps the registration alive
  std::string rkey_bytes;                          // kRma: entry of the endpoint's rkey cache in use
  Status rma_error;                                // kRma: first failure of put + flush
};

class TransportCore : public std::enable_shared_from_this<TransportCore> {
 public:
  static Result<std::shared_ptr<TransportCore>> create(TransportOptions options);
  explicit TransportCore(TransportOptions options) : options_(std::move(options)), clock_(options_.clock) {}
  ~TransportCore();
  TransportCore(const TransportCore&) = delete;
  TransportCore& operator=(const TransportCore&) = delete;

  void shutdown();
  const TransportOptions& options() const { return options_; }
  ucp_context_h context() const { return context_; }

  Result<std::string> listen(std::string_view host, std::uint16_t port);
  std::optional<std::string> listen_address() const;
  Result<Endpoint> connect(std::string_view address, std::optional<Duration> timeout);
  static TransportCore& of(Transport& t) { return *t.core_; }
  Result<Endpoint> accept(Duration timeout);
  void on_message(MessageType type, MessageHandler handler);
  Result<Incoming> receive(Duration timeout);
  Result<MemoryRegion> map_memory(void* data, std::size_t size, bool allocate);

  std::future<Status> send_frame(const std::shared_ptr<EndpointState>& ep, Frame frame, Duration timeout,
                                 std::string what);
  std::future<Result<Message>> request(const std::shared_ptr<EndpointState>& ep, const Message& m,
                                       Duration timeout);
  std::future<Status> rma(const std::shared_ptr<EndpointState>& ep, bool is_put, const MemoryRegion& local,
                          std::size_t local_offset, const RemoteRegion& remote, std::uint64_t remote_offset,
                          std::size_t length, std::optional<Duration> timeout, CompletionCallback done);
  void close_endpoint(const std::shared_ptr<EndpointState>& ep);
  // Runs fn on the callback thread; at once on the calling thread if that thread has stopped.
  void post_callback(std::function<void()> fn);

  // The deadline of one operation: the options' default, or the caller's (positive, or kForever).
  static Result<Duration> resolve_timeout(std::optional<Duration> t, Duration fallback, const char* what) {
    if (!t) return fallback;
    if (t->count() <= 0) {
      return invalid_argument(fmt::format("{} timeout of {} ns is not positive", what, t->count()));
    }
    return *t;
  }
  Result<Duration> operation_timeout(std::optional<Duration> t, const char* what) const {
    return resolve_timeout(t, options_.operation_timeout, what);
  }
  Status check_body(std::size_t bytes) const {
    if (bytes > options_.max_message_bytes) {
      return invalid_argument(fmt::format("message body of {} bytes is over max_message_bytes {}", bytes,
                                          options_.max_message_bytes));
    }
    return ok_status();
  }
  static Endpoint make_endpoint(std::shared_ptr<EndpointState> s) { return Endpoint(std::move(s)); }
  static const std::shared_ptr<EndpointState>& state_of(const Endpoint& e) { return e.state_; }
  std::future<Status> send_wire(const std::shared_ptr<EndpointState>& ep, std::vector<std::byte> wire,
                                Duration timeout, std::string what);

 private:
  Status start();
  friend class TransportTestingAccess;

  // Runs fn on the progress thread; false once shutting down (fn is then dropped).
  bool post(std::function<void()> fn);
  void progress_loop();
  void callback_loop();
  void run_commands();
  void expire_deadlines();
  int epoll_timeout_ms() const;
  void teardown_on_progress_thread();
  void close_listener();

  // Progress thread only from here on.
  Op& new_op(Op::Kind kind, std::uint64_t ep_id, Duration timeout, std::string what);
  void resolve(Op& op, const Status& s);
  void resolve_reply(Op& op, Result<Message> r);
  void resolve_connect(Op& op, std::shared_ptr<EndpointState> e);
  void maybe_release(Op& op);
  void sweep();
  void on_ucx_done(Op& op, ucs_status_t status);
  void start_send(EndpointState& e, Op& op);
  void send_internal(EndpointState& e, const Frame& f);
  void fail_endpoint(EndpointState& e, const Status& s);
  // Keeps the endpoint's first error and, the first time, schedules its close watchers.
  void set_endpoint_error(EndpointState& e, const Status& s);
  // Creates the UCP endpoint of an outgoing connection and files it under e's id; the handshake is
  // the caller's next step.
  Status open_client_endpoint(EndpointState& e, const sockaddr_storage& address);
  // Until now >= deadline on clock_, or ready(); the caller holds `lock` on queues_mu_.
  bool wait_queue(std::unique_lock<std::mutex>& lock, Duration timeout, const std::function<bool()>& ready);
  void handle_frame(EndpointState& e, std::span<const std::byte> wire);
  void handle_handshake(EndpointState& e, Frame f);
  bool expect_handshake_frame(EndpointState& e, const Frame& f, FrameKind want, const char* answered);
  void refuse(EndpointState& e, const std::string& why);
  std::shared_ptr<EndpointState> find(ucp_ep_h ep);
  std::shared_ptr<EndpointState> find(std::uint64_t id);
  void on_connection_request(ucp_conn_request_h req);
  void close_ucp_ep(EndpointState& e);
  Result<ucp_rkey_h> acquire_rkey(EndpointState& e, Op& op, const std::vector<std::byte>& packed);
  void release_rkey(Op& op);
  void destroy_rkeys(EndpointState& e);

  static void am_send_cb(void* request, ucs_status_t status, void* user);
  static void am_recv_data_cb(void* request, ucs_status_t status, std::size_t length, void* user);
  static ucs_status_t am_recv_cb(void* arg, const void* header, std::size_t header_length, void* data,
                                 std::size_t length, const ucp_am_recv_param_t* param);
  static void ep_error_cb(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void conn_cb(ucp_conn_request_h req, void* arg);

  TransportOptions options_;
  std::shared_ptr<Clock> clock_;  // options_.clock, or the steady clock: every deadline reads it
  // What UCX's own progress reads: it runs in real time whatever clock_ says.
  std::shared_ptr<Clock> real_time_ = Clock::steady();
  // Wakes the progress thread and the accept/receive waiters when a virtual clock_ jumps.
  ClockSubscription clock_wake_;
  Key key_{};
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int epoll_fd_ = -1;
  int event_fd_ = -1;
  int worker_fd_ = -1;
  std::thread progress_thread_;
  std::thread callback_thread_;
  std::atomic<std::uint64_t> next_ep_id_{1};

  mutable std::mutex cmd_mu_;
  std::vector<std::function<void()>> commands_;
  bool accepting_commands_ = true;
  std::atomic<bool> has_commands_{false};
  std::atomic<bool> stop_{false};

  // Progress thread only.
  ucp_listener_h listener_ = nullptr;
  sockaddr_storage listen_addr_{};
  int listen_fd_ = -1;         // the listener's socket (UCX's), -1 if not found
  bool tearing_down_ = false;  // connection requests are refused from then on
  std::set<std::string> refused_peers_;
  std::unordered_map<std::uint64_t, std::shared_ptr<EndpointState>> endpoints_;
  std::unordered_map<ucp_ep_h, std::uint64_t> by_handle_;
  std::unordered_map<std::uint64_t, std::unique_ptr<Op>> ops_;
  std::set<std::pair<Duration, std::uint64_t>> deadlines_;  // (clock_ time, op id)
  std::vector<ucp_ep_h> to_close_;                 // failed endpoints, closed outside UCX callbacks
  std::vector<void*> closing_;                     // ucp_ep_close_nbx requests in flight
  std::vector<ucp_rkey_h> dead_rkeys_;             // of closed endpoints; destroyed once UCX is idle
  std::vector<std::uint64_t> release_candidates_;  // ops that may be finished; see maybe_release
  std::uint64_t next_op_id_ = 1;
  int ucx_inflight_ = 0;

  std::mutex cb_mu_;
  std::condition_variable cb_cv_;
  std::deque<std::function<void()>> callbacks_;
  bool cb_stop_ = false;
  bool cb_stopped_ = false;  // the callback thread has run its last job

  std::mutex handlers_mu_;
  std::unordered_map<MessageType, MessageHandler> handlers_;

  std::mutex queues_mu_;
  std::condition_variable queues_cv_;
  std::deque<Incoming> inbox_;
  std::deque<Endpoint> accepted_;
  bool shut_down_ = false;
  bool listening_ = false;  // guarded by cmd_mu_
  std::string listen_address_;  // guarded by cmd_mu_; set once listening
};
}  // namespace laminar::internal
