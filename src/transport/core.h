// core.h (internal): the state behind Transport, Endpoint and MemoryRegion (transport.cc and transport/).
//
// Threading: every UCP worker call happens on one progress thread. Other threads hand it commands
// through a queue and an eventfd; it answers through promises. While UCX operations are in flight it
// polls the worker (full bandwidth); once idle it arms the worker and sleeps in epoll on the worker's
// wakeup fd, the command eventfd, the bootstrap sockets and the nearest deadline.
//
// Connections: a peer first reaches laminar's own TCP listening socket (listen()). On that bootstrap
// socket the two sides authenticate each other (HMAC over fresh nonces), then exchange their UCP
// worker addresses and one random 64-bit token each; only then does either side create a UCP
// endpoint. Every frame laminar sends over UCX carries the receiver's token as its active-message
// header, and a frame whose token names no open connection is dropped unread. The bootstrap socket
// stays open for the connection's life: its end is the end of the connection (handshake.cc).
//
// User callbacks (message handlers, put/get completions, close watchers) run on a second, callback
// thread, so a slow handler never stalls the wire and a handler may itself block on transport calls.
// Context-level calls (memory registration) are made from any thread: the context is created with
// mt_workers_shared for that.
//
// Time: every deadline (connect, handshake, request, send, put/get, accept, receive) reads the
// options' Clock, and the core subscribes to it, so a jump of a ManualClock wakes the progress thread
// and every waiter at once. UCX's own progress runs in real time whatever that clock says: the
// polling window after activity and the grace given to closing endpoints read the steady clock.
#pragma once

#include <fmt/format.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

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
#include "transport/bootstrap_wire.h"
#include "transport/listen_socket.h"
#include "transport/wire.h"

namespace laminar::internal {

class TransportTestingAccess;  // laminar_testing's hooks (tests/support), never part of the shipped library

inline constexpr std::size_t kKeyBytes = 32;  // crypto_auth_hmacsha256_KEYBYTES
using Key = std::array<unsigned char, kKeyBytes>;
using Nonce = std::array<std::byte, kBootstrapNonceBytes>;

// The UCP active-message id every frame travels on.
inline constexpr unsigned kAmId = 0x1a;
// The one put and get travel on where UCX has no one-sided path to the peer (rma_over_am).
inline constexpr unsigned kRmaAmId = 0x1b;

inline std::string ucs_text(ucs_status_t s) { return ucs_status_string(s); }

// "250 ms", or "1500 ns" below a millisecond, for error messages.
inline std::string duration_text(Duration d) {
  using std::chrono::milliseconds;
  if (d == kForever) return "forever";
  if (d >= milliseconds(1)) return fmt::format("{} ms", std::chrono::duration_cast<milliseconds>(d).count());
  return fmt::format("{} ns", d.count());
}

inline bool is_reserved(MessageType type) { return type >= kLaminarMessageTypeFirst; }

// epoll tags of the progress thread's own descriptors; a bootstrap socket's tag is its endpoint's id.
inline constexpr std::uint64_t kEventFdTag = ~std::uint64_t{0};
inline constexpr std::uint64_t kWorkerFdTag = kEventFdTag - 1;
inline constexpr std::uint64_t kListenTag = kEventFdTag - 2;

// "host:port" or "[v6]:port" -> sockaddr. kInvalidArgument names what is wrong.
Result<sockaddr_storage> parse_address(std::string_view address);

class RegionState {
 public:
  RegionState(std::shared_ptr<TransportCore> core, ucp_mem_h memh, std::byte* data, std::size_t size,
              std::vector<std::byte> rkey, bool host_memory)
      : core(std::move(core)),
        memh(memh),
        data(data),
        size(size),
        packed_rkey(std::move(rkey)),
        host_memory(host_memory) {}
  ~RegionState();
  RegionState(const RegionState&) = delete;
  RegionState& operator=(const RegionState&) = delete;

  std::shared_ptr<TransportCore> core;  // keeps the UCP context alive while registered
  ucp_mem_h memh;
  std::byte* data;  // [size]
  std::size_t size;
  std::vector<std::byte> packed_rkey;
  bool host_memory;  // a peer on this host may copy it with process_vm_writev/readv (same_host.h)
};

// Handshake and life of one connection, seen from this side (frames: bootstrap_wire.h).
enum class Phase {
  kConnecting,      // client: TCP connection to the peer's bootstrap socket in progress
  kAwaitChallenge,  // client: hello sent
  kAwaitWelcome,    // client: proof sent
  kWireup,          // client: UCP endpoint created, waiting for UCX to connect it
  kAwaitHello,      // server: connection accepted, waiting for the client's nonce
  kAwaitProof,      // server: challenge sent
  kAwaitReady,      // server: welcome sent; the client's ready, or its first frame, opens it
  kRefused,         // server: refusal being written; closed once it has left
  kReady,
  kClosed,
};

// The UCP endpoint to one peer worker, shared by every connection between the two transports. UCX
// pairs the endpoints two workers create to each other by how many each created before (connection
// matching); endpoints made and closed per connection would be paired with the wrong partner once
// one side created one the other did not (a handshake that failed halfway, or two that crossed).
// So each side keeps one per peer worker, until UCX reports it failed or the transport shuts down.
struct PeerWorker {
  ucp_ep_h ep = nullptr;
  std::string address;                // the peer's worker address; key of TransportCore::peers_
  std::set<std::uint64_t> endpoints;  // ids of the connections it carries
};

class EndpointState : public std::enable_shared_from_this<EndpointState> {
 public:
  EndpointState(std::shared_ptr<TransportCore> c, std::uint64_t id, std::string peer)
      : core(std::move(c)), id(id), peer(std::move(peer)) {}

  std::shared_ptr<TransportCore> core;
  const std::uint64_t id;
  const std::string peer;

  // Progress thread only.
  Phase phase = Phase::kClosed;
  std::shared_ptr<PeerWorker> worker;  // set once the peer's worker address is known
  ucp_ep_h ep() const { return worker ? worker->ep : nullptr; }
  // The bootstrap connection: the handshake's frames, then only its end.
  UniqueFd socket;
  bool outgoing = false;             // we connected (client side)
  std::uint32_t watching = 0;        // the epoll events asked for; 0: not yet registered
  std::vector<std::byte> in;         // bytes read, not yet a whole frame
  std::vector<std::byte> out;        // bytes not yet written
  std::optional<IpAddress> peer_ip;  // the bootstrap connection's remote address
  std::vector<IpAddress> admitted;   // what this connection added to the filter (admit_peer)
  std::uint64_t token = 0;           // ours: the peer sends it in the header of every frame to us
  std::uint64_t peer_token = 0;      // the peer's: we send it in ours
  // Unpacked remote keys by packed bytes. Unpacking attaches the peer's shared-memory segment (a
  // fresh mapping that faults in page by page), so doing it once per region rather than once per
  // put/get is what makes repeated transfers run at memory speed. `users` counts operations in
  // flight on an entry; only unused entries are evicted.
  struct CachedRkey {
    ucp_rkey_h handle = nullptr;
    int users = 0;
  };
  std::unordered_map<std::string, CachedRkey> rkeys;
  // The process a same-host peer said it is (RemoteRegion::pid), and whether it proved it
  // (holds_other_end on `socket`); checked once per claimed pid.
  pid_t claimed_pid = 0;
  bool claim_proven = false;
  Nonce client_nonce{};
  Nonce server_nonce{};
  std::uint64_t handshake_op = 0;
  // For TransportOptions::idle_timeout: when a frame last went either way or an operation on this
  // connection started or ended (clock time), and requests received and not yet answered.
  Duration last_active{};
  int unanswered = 0;

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
  // kLanding: a peer's put arriving in a region here (rma_over_am).
  enum class Kind { kSend, kRequest, kRma, kConnect, kHandshake, kReceive, kLanding };
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
  std::function<void()> answered;                  // kRequest: run once reply_promise is set
  std::promise<Result<Endpoint>> connect_promise;  // kConnect
  CompletionCallback done;                         // kRma
  std::vector<std::byte> buffer;                   // frame being sent / received
  std::shared_ptr<RegionState> region;             // kRma: keeps the registration alive
  std::string rkey_bytes;                          // kRma: entry of the endpoint's rkey cache in use
  Status rma_error;                                // kRma: first failure of put + flush
  // kRma over active messages (rma_over_am): it ends with the peer's answer (put) or the bytes it
  // sends back (get), which land at `landing`; kLanding: a peer's put landing there, to answer.
  bool awaits_peer = false;
  bool peer_done = false;
  bool is_get = false;
  bool receiving = false;          // the bytes are arriving (ucp_am_recv_data_nbx)
  std::byte* landing = nullptr;
  std::size_t landing_bytes = 0;
  std::uint64_t peer_op = 0;       // kLanding: the initiator's op, which the answer names
  std::uint64_t header = 0;                        // the receiver's token, read by UCX until sent
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
  // What this process's regions tell a peer (RemoteRegion::pid, ::host); constant once created.
  pid_t pid() const { return pid_; }
  std::uint64_t host_key() const { return host_key_; }

  Result<std::string> listen(std::string_view host, std::uint16_t port);
  std::optional<std::string> listen_address() const;
  Result<Endpoint> connect(std::string_view address, std::optional<Duration> timeout);
  static TransportCore& of(Transport& t) { return *t.core_; }
  Result<Endpoint> accept(Duration timeout);
  void on_message(MessageType type, MessageHandler handler);
  Result<Incoming> receive(Duration timeout);
  TransportStats stats();
  Status enqueue(Incoming&& in);
  static std::size_t inbox_cost(const Incoming& in);
  Result<MemoryRegion> map_memory(void* data, std::size_t size, bool allocate);
  // Regions by address, for serve_rma_frame (any thread; ~RegionState forgets its own).
  void forget_region(const RegionState* region);

  std::future<Status> send_frame(const std::shared_ptr<EndpointState>& ep, Frame frame, Duration timeout,
                                 std::string what);
  // `answered` (may be empty) runs once the future is ready, on the progress thread or, for a
  // request refused at once, on the calling one: it may only wake a waiter.
  std::future<Result<Message>> request(const std::shared_ptr<EndpointState>& ep, const Message& m,
                                       Duration timeout, std::function<void()> answered = {});
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
  // `answer`: the frame is a reply or error reply (see EndpointState::unanswered).
  std::future<Status> send_wire(const std::shared_ptr<EndpointState>& ep, std::vector<std::byte> wire,
                                Duration timeout, std::string what, bool answer = false);

 private:
  Status start();
  friend class TransportTestingAccess;

  // A UCP worker and what laminar keeps of it.
  struct Worker {
    ucp_worker_h handle = nullptr;
    std::vector<std::byte> address;  // from which peers create their endpoint to it
    std::vector<int> listeners;      // UCX's listening tcp sockets (UCX owns them), filtered shut
    int fd = -1;                     // its wakeup fd
  };
  // A new worker with laminar's message handler; on failure nothing is left of it.
  Result<Worker> create_worker();
  void install_worker(Worker w);
  // Progress thread: closes every connection and moves to a new worker (the old one is wedged: see
  // kWedgedAfter in setup.cc). On failure, logs it and keeps the old one.
  void replace_worker();

  // Runs fn on the progress thread; false once shutting down (fn is then dropped).
  bool post(std::function<void()> fn);
  void progress_loop();
  // Force-closes the endpoints queued in to_close_ (progress thread).
  void close_queued_endpoints();
  // Frees the close requests in closing_ that have finished (progress thread).
  void reap_closed_requests();
  // Force-closes the endpoint to every peer worker and gives UCX up to kCloseGrace to finish the
  // closes and the operations in flight; then frees what is left, remote keys included.
  void close_peer_workers();
  void callback_loop();
  void run_commands();
  void expire_deadlines();
  void close_idle_connections();
  int epoll_timeout_ms() const;
  // Handles what epoll reports within timeout_ms (0: only what is ready now).
  void poll_events(int timeout_ms);
  void teardown_on_progress_thread();

  // Progress thread only from here on.
  Op& new_op(Op::Kind kind, std::uint64_t ep_id, Duration timeout, std::string what);
  void resolve(Op& op, const Status& s);
  // Stamps the endpoint's last_active for idle_timeout (nothing to do when it is kForever).
  void note_activity(EndpointState& e);
  void note_activity(std::uint64_t ep_id);
  void resolve_reply(Op& op, Result<Message> r);
  void resolve_connect(Op& op, std::shared_ptr<EndpointState> e);
  void maybe_release(Op& op);
  void sweep();
  void on_ucx_done(Op& op, ucs_status_t status);
  void start_send(EndpointState& e, Op& op);
  void fail_endpoint(EndpointState& e, const Status& s);
  // Keeps the endpoint's first error and, the first time, schedules its close watchers.
  void set_endpoint_error(EndpointState& e, const Status& s);
  // Until now >= deadline on clock_, or ready(); the caller holds `lock` on queues_mu_.
  bool wait_queue(std::unique_lock<std::mutex>& lock, Duration timeout, const std::function<bool()>& ready);
  void handle_frame(EndpointState& e, std::span<const std::byte> wire);
  std::shared_ptr<EndpointState> find(std::uint64_t id);
  Result<ucp_rkey_h> acquire_rkey(EndpointState& e, Op& op, const std::vector<std::byte>& packed);
  void release_rkey(Op& op);
  void destroy_rkeys(EndpointState& e);
  // A put or get copied by this process itself, when the region is in a process on this host that
  // proved to be the peer: resolved then and true; false to go through UCX instead.
  // put/get as active messages on kRmaAmId, where UCX has no one-sided path to the peer
  // (native_rma_ false): UCX would emulate them with messages the target answers from inside UCX,
  // and that answer, sent to a peer that died first, aborts the target's process (UCX 1.13's
  // software RMA). Here the bytes land straight in the target's region (or, for a get, in `local`),
  // the target's transport answers, and a dead peer fails only the operation.
  void rma_over_am(EndpointState& e, Op& op, bool is_put, std::byte* local, std::uint64_t raddr, std::size_t length);
  void send_rma_am(EndpointState& e, Op& op, std::span<const std::byte> data);
  // The open connection a frame's token names (opening an accepted one whose ready it overtook),
  // or null: the frame is dropped.
  std::shared_ptr<EndpointState> ready_by_token(std::uint64_t token);
  static ucs_status_t rma_recv_cb(void* arg, const void* header, std::size_t header_length, void* data,
                                  std::size_t length, const ucp_am_recv_param_t* param);
  void answer_rma(std::uint64_t ep_id, std::uint64_t peer_op, const Status& st);
  // Takes the bytes of a kRmaAmId message into `to`: copied at once, or received (rendezvous) for
  // `op`. False when the receive could not start.
  bool land(Op& op, void* data, std::byte* to, std::size_t length, const ucp_am_recv_param_t* param);
  // The bytes of `op` have landed (or failed to, `status`): a kLanding is answered, a get's op
  // learns it is done.
  void on_landed(Op& op, ucs_status_t status);
  void remember_region(const std::shared_ptr<RegionState>& region);
  std::shared_ptr<RegionState> host_region_holding(std::uint64_t address, std::size_t length);
  bool try_direct_copy(EndpointState& e, Op& op, bool is_put, std::byte* local, const RemoteRegion& remote,
                       std::uint64_t raddr, std::size_t length);

  // Bootstrap connections and the handshake (handshake.cc).
  void accept_connections();
  // Asks epoll for what e's socket waits for now (to connect, to read, to write what is queued).
  Status watch_socket(EndpointState& e);
  void on_socket_event(std::uint64_t id, std::uint32_t events);
  void read_socket(EndpointState& e);
  void write_socket(EndpointState& e);
  void send_bootstrap(EndpointState& e, const BootstrapFrame& f);
  void handle_server_frame(EndpointState& e, BootstrapFrame f);
  void handle_client_frame(EndpointState& e, BootstrapFrame f);
  void refuse(EndpointState& e, const std::string& why, StatusCode code = StatusCode::kFailedPrecondition);
  // Server: the client is authenticated and wired up; accept() may hand the endpoint out.
  void open_accepted(EndpointState& e);
  // Client: UCX connected the endpoint; connect() returns it.
  void finish_connect(EndpointState& e);
  // Releases what a connection holds besides its ops: socket, token, filter addresses, worker.
  void close_connection(EndpointState& e);
  // Lets the peer's addresses (the bootstrap connection's and those it listed) through the filter of
  // UCX's listening sockets, before the peer learns anything that makes its UCX connect to ours.
  Status admit_peer(EndpointState& e, const std::vector<IpAddress>& listed);
  // False if the kernel refused a filter (the old one stays).
  bool update_filters();
  // The UCP endpoint to the worker at `address`, created on first use.
  Result<std::shared_ptr<PeerWorker>> peer_worker(const std::vector<std::byte>& address);
  std::uint64_t new_token();

  static void am_send_cb(void* request, ucs_status_t status, void* user);
  static void am_recv_data_cb(void* request, ucs_status_t status, std::size_t length, void* user);
  static ucs_status_t am_recv_cb(void* arg, const void* header, std::size_t header_length, void* data,
                                 std::size_t length, const ucp_am_recv_param_t* param);
  static void ep_error_cb(void* arg, ucp_ep_h ep, ucs_status_t status);
  void fail_peer_workers();

  TransportOptions options_;
  std::shared_ptr<Clock> clock_;  // options_.clock, or the steady clock: every deadline reads it
  // What UCX's own progress reads: it runs in real time whatever clock_ says.
  std::shared_ptr<Clock> real_time_ = Clock::steady();
  // Wakes the progress thread and the accept/receive waiters when a virtual clock_ jumps.
  ClockSubscription clock_wake_;
  Key key_{};
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<std::byte> worker_address_;  // ours, from which peers create their endpoint to us
  std::vector<IpAddress> own_addresses_;   // this host's, listed to peers for their filters
  std::vector<int> ucx_listeners_;         // UCX's listening tcp sockets (UCX owns them)
  int epoll_fd_ = -1;
  int event_fd_ = -1;
  int worker_fd_ = -1;
  std::thread progress_thread_;
  std::thread callback_thread_;
  std::atomic<std::uint64_t> next_ep_id_{1};
  // Frames that named no open connection (unauthenticated senders, or late ones of closed connections).
  std::atomic<std::uint64_t> dropped_frames_{0};
  std::atomic<std::uint64_t> workers_replaced_{0};
  std::atomic<std::uint64_t> direct_copies_{0};
  // Every registered region, for a peer's put or get in frames to find by address.
  std::mutex regions_mu_;
  std::unordered_map<const RegionState*, std::weak_ptr<RegionState>> regions_;
  const pid_t pid_ = getpid();
  std::uint64_t host_key_ = 0;  // set by start()

  mutable std::mutex cmd_mu_;
  std::vector<std::function<void()>> commands_;
  bool accepting_commands_ = true;
  std::atomic<bool> has_commands_{false};
  std::atomic<bool> stop_{false};

  // Progress thread only.
  // Whether put/get copy directly to same-host peers (start(), from the transports asked for);
  // false from the first time the kernel refuses such a copy.
  bool direct_copy_allowed_ = false;
  // Whether UCX may use its mm transports, the only ones a dying peer can wedge: the watchdog
  // (kWedgedAfter in setup.cc) runs only then.
  bool mm_possible_ = false;
  // Whether UCX may move put/get bytes between hosts itself (RDMA hardware the transports allow;
  // start()); otherwise they travel in frames (rma_over_frames).
  bool native_rma_ = false;
  UniqueFd listen_socket_;
  bool tearing_down_ = false;  // connections are refused from then on
  std::set<std::uint64_t> unauthenticated_;  // accepted, not yet proven the token; oldest first
  std::unordered_map<std::uint64_t, std::shared_ptr<EndpointState>> endpoints_;
  std::unordered_map<std::uint64_t, std::uint64_t> by_token_;  // our token -> endpoint id
  std::map<std::string, std::shared_ptr<PeerWorker>> peers_;  // by worker address bytes
  std::unordered_map<ucp_ep_h, std::shared_ptr<PeerWorker>> by_handle_;
  std::map<IpAddress, int> admitted_;  // what the filter lets through, with its connection counts
  std::unordered_map<std::uint64_t, std::unique_ptr<Op>> ops_;
  std::set<std::pair<Duration, std::uint64_t>> deadlines_;  // (clock_ time, op id)
  std::vector<std::pair<ucp_ep_h, ucs_status_t>> failed_peers_;  // noted by ep_error_cb
  std::vector<ucp_ep_h> to_close_;                 // failed endpoints, closed outside UCX callbacks
  std::vector<void*> closing_;                     // ucp_ep_close_nbx requests in flight
  std::vector<ucp_rkey_h> dead_rkeys_;             // of closed endpoints; destroyed once UCX is idle
  std::vector<std::uint64_t> release_candidates_;  // ops that may be finished; see maybe_release
  std::uint64_t next_op_id_ = 1;
  int ucx_inflight_ = 0;
  Duration next_idle_check_{};  // clock time
  Duration last_socket_poll_{};  // real time; sockets are polled now and then while UCX keeps it busy

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
  std::unordered_map<std::uint64_t, std::size_t> inbox_bytes_by_endpoint_;  // queued from each connection
  std::size_t inbox_bytes_ = 0;
  std::uint64_t inbox_refused_ = 0;
  std::deque<Endpoint> accepted_;
  bool shut_down_ = false;
  bool listening_ = false;  // guarded by cmd_mu_
  std::string listen_address_;  // guarded by cmd_mu_; set once listening
};
}  // namespace laminar::internal
