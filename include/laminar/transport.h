// transport.h: Transport, Endpoint and MemoryRegion, laminar's one way across a process or a machine.
//
// Built on UCX (UCP): a Transport owns one UCP context and worker, driven by its own progress thread
// that sleeps on the worker's wakeup fd when idle, so the host application never spins. Peers connect
// by host:port to a plain TCP socket of laminar's own and authenticate with a shared cluster token
// there; only then do they exchange UCX worker addresses, so no UCX code reads a byte from a peer
// that has not authenticated (see Exposure below). Two kinds of traffic flow over an Endpoint:
//   - control messages: small typed messages (UCP active messages) of at most max_message_bytes,
//     one-way (send) or request/reply (request), delivered to per-type handlers or to receive();
//   - bulk bytes: memory registered once (MemoryRegion), then one-sided put/get against a peer's
//     RemoteRegion (zero-copy where the UCX transport allows it, RDMA; between processes of one
//     host, one kernel copy from process to process: RemoteRegion::pid; between hosts without
//     RDMA, active messages of the transport's own that land in the peer's region and that its
//     transport answers, so that a peer dying mid-transfer fails only the transfer:
//     docs/design.md).
// The relay chain, remote queue producers, weight pulls and KV migration all sit on top of this.
//
//   laminar::TransportOptions opt;
//   opt.cluster_token = token;                                   // same secret on every peer
//   std::shared_ptr<laminar::Transport> server = laminar::Transport::create(opt).value();
//   std::string addr = server->listen("127.0.0.1", 0).value();   // "127.0.0.1:41234"
//   auto client = laminar::Transport::create(opt).value();
//   laminar::Endpoint ep = client->connect(addr).value();        // authenticated both ways
//   laminar::Result<laminar::Message> r = ep.request(laminar::Message::from_string(7, "hi"));
//
// A process makes one Transport and shares it (std::shared_ptr) with every laminar part it hosts:
// relay node, queue server, remote producers. Message types from kLaminarMessageTypeFirst up belong
// to those parts' protocols; the application uses the types below it.
//
// Threads. A Transport runs two:
//   - the progress thread makes every UCX worker call and does all the IO of laminar's own sockets;
//     it never runs user code, so a slow handler never stalls the wire. It sleeps in epoll when idle.
//   - the callback thread runs every MessageHandler, put/get CompletionCallback and on_close
//     callback, one at a time, in the order their events happened. A callback may call any
//     Transport or Endpoint method, blocking ones included (a request from inside a handler is
//     fine), but while it blocks no other callback of this transport runs: it must not wait for
//     another callback, and the Transport must not be destroyed from one.
// Every other method is thread-safe and runs on the caller's thread. connect, accept, receive,
// send, request, reply and reply_error block their caller until done or until their deadline;
// request_async, put and get return at once with a std::future. Every failure of the two threads'
// work reaches the operation it belongs to (its Status or future) or its endpoint (status(),
// on_close), so a Transport has no background_error().
//
// Time. Every timeout is a laminar::Duration; an operation without one uses the options' default,
// and kForever is the only way to wait without a deadline. Deadlines read TransportOptions::clock:
// with a ManualClock they expire when the clock is moved, however long UCX itself takes.
//
// Every call returns a Status; a vanished peer, a refused or unauthenticated connection, a timeout,
// or a malformed message is reported to the caller and to every pending operation on that endpoint
// (kUnavailable, kFailedPrecondition, kDeadlineExceeded, kInvalidArgument, kDataLoss).
//
// Exposure. The listen() socket is laminar's: it reads at most max_unauthenticated_connections
// connections at a time (one more closes the oldest), each for at most handshake_timeout, in frames
// of at most 4 KiB, and closes any that fails to prove the token. UCX itself also listens wherever
// tcp is among its transports: one socket per network device, opened when the Transport is
// created, whose parser a single bad packet can abort. laminar attaches a socket filter to those
// sockets that drops every packet whose source address is not one of an authenticated peer's (its
// bootstrap connection's address and the interface addresses it listed), from before the peer
// learns where to connect until its last connection closes. What remains reachable: a process on
// the host of a peer that is connected now (for a peer on this host, any local process, through
// 127.0.0.1) can still reach UCX's tcp sockets. Shared memory and RDMA transports listen on no
// socket. A ucx_transports list without tcp (RDMA's "rc,cma", or "sm" on one host, with what naming
// shared memory costs: see ucx_transports) removes UCX's sockets entirely.
//
// Under ThreadSanitizer, run with UCX_MEM_EVENTS=n in the environment: UCX's memory hooks (libucm)
// and TSan's interceptors crash together at thread exit. tests/CMakeLists.txt's
// laminar_add_transport_test() sets it for tests in the tsan preset.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "laminar/clock.h"
#include "laminar/status.h"
#include "laminar/types.h"

namespace laminar {

namespace internal {
class TransportCore;
class EndpointState;
class RegionState;
}  // namespace internal

// Message kind. [0, kLaminarMessageTypeFirst) is the application's; [kLaminarMessageTypeFirst,
// 2^32) is reserved for laminar's own protocols (relay chain, remote queue, ...), which share the
// process's one Transport with the application. The public on_message, send and request answer
// kInvalidArgument for a reserved type, so an application handler can never take over, or be taken
// over by, a laminar protocol. (The transport's handshake and reply frames are told apart on the
// wire by another field and use no type at all.)
using MessageType = std::uint32_t;
inline constexpr MessageType kLaminarMessageTypeFirst = 0xF000'0000u;

struct TransportOptions {
  // Shared secret of the cluster, at least kMinTokenBytes bytes. Peers prove they hold it with a
  // mutual challenge-response (HMAC-SHA-256 over fresh random nonces, libsodium); the token itself
  // never crosses the wire. A peer that fails is refused before any message or memory is served.
  std::string cluster_token;
  // UCX transports in UCX_TLS syntax ("tcp" forces the network; "" lets UCX choose); empty reads
  // UCX_TLS from the environment. Connection setup needs none in particular (it runs on laminar's
  // own socket), but two peers need one transport in common. UCX's choice, or an exclusion list
  // ("^ib"), never includes UCX's shared-memory message transports (posix, sysv), which a same-host
  // peer killed mid-message can leave deaf to everyone: messages between processes on one host go
  // over tcp, and put/get to a process on the same host is copied by the kernel, process to process
  // (RemoteRegion::pid; off when the list names "tcp" alone or excludes cma). See docs/design.md,
  // "What a dying peer can do".
  // A list that names them ("sm", "posix", ...) gets them, kept usable under peer-failure detection,
  // and a watchdog that replaces a wedged UCX worker, closing every connection
  // (TransportStats::workers_replaced).
  std::string ucx_transports;
  // Largest control message body accepted or sent; bigger ones are kInvalidArgument. Bulk data goes
  // through put/get, which has no such limit.
  std::size_t max_message_bytes = std::size_t{16} << 20;
  // Default deadline of connect(): the TCP connection, authentication, and UCX connecting the two
  // workers (positive, or kForever).
  Duration connect_timeout = std::chrono::seconds(10);
  // How long a peer that connected to our listener has to authenticate before it is disconnected
  // (positive).
  Duration handshake_timeout = std::chrono::seconds(5);
  // Connections to our listener that have not authenticated yet, at most (positive). When one more
  // comes, the oldest of them is closed: idle connections can delay a good client no longer than it
  // takes to open this many new ones, rather than keep it out until their deadline.
  std::size_t max_unauthenticated_connections = 64;
  // Default deadline of send / request / put / get (positive, or kForever).
  Duration operation_timeout = std::chrono::seconds(30);
  // A connection, accepted or made, over which nothing has gone either way for this long, with no
  // operation of its own pending and every request it brought answered, is closed (both ends see
  // kUnavailable). Positive, or kForever (the default: a relay subscription waits idle between
  // versions; set it longer than that).
  Duration idle_timeout = kForever;
  // Bytes of messages without a handler that may wait for receive(): from one connection, and from
  // all together. Each message counts its body plus kInboxOverheadBytes. A message past either
  // bound is not queued: a request is answered kResourceExhausted, a one-way message is dropped
  // (TransportStats::inbox_refused counts both). Messages stay queued after their sender leaves,
  // within the total. Zero in either turns receive() off, as a process that only hosts handlers
  // (a relay, a queue server) should: then nothing a peer sends is kept for it.
  std::size_t max_inbox_bytes_per_connection = std::size_t{64} << 20;
  std::size_t max_inbox_bytes = std::size_t{256} << 20;
  // The time every deadline of this transport reads; null means Clock::steady().
  std::shared_ptr<Clock> clock;

  static constexpr std::size_t kMinTokenBytes = 16;
  static constexpr std::size_t kInboxOverheadBytes = 256;
};

struct TransportStats {
  std::size_t inbox_messages = 0;    // waiting for receive()
  std::size_t inbox_bytes = 0;       // their bodies plus kInboxOverheadBytes each
  std::uint64_t inbox_refused = 0;   // messages without a handler refused by the inbox bounds
  std::uint64_t dropped_frames = 0;  // UCX frames without the token of an open connection
  // UCX workers replaced because one stopped receiving (only with shared-memory transports named in
  // ucx_transports; see there). Each replacement closed every connection of the time.
  std::uint64_t workers_replaced = 0;
  // Puts and gets this process copied itself, to or from a peer process on the same host.
  std::uint64_t direct_copies = 0;

  std::string to_json() const;
};

struct Message {
  MessageType type = 0;
  std::vector<std::byte> body;

  static Message from_string(MessageType type, std::string_view text);
  static Message from_bytes(MessageType type, std::span<const std::byte> bytes);
  std::string_view text() const noexcept { return {reinterpret_cast<const char*>(body.data()), body.size()}; }
};

// Where a peer's registered memory lives, as that peer's MemoryRegion::remote() describes it. Ship it
// in a message (serialize / deserialize) so the other side can put into it or get from it.
struct RemoteRegion {
  std::uint64_t address = 0;
  std::uint64_t size = 0;
  std::vector<std::byte> rkey;  // UCX packed remote key
  // For host memory: the owning process and a key naming its host and pid namespace (0: none). A
  // peer on that host whose connection proves it is talking to that very process (it holds the other
  // end of the connection's TCP socket) copies with process_vm_writev/readv instead of through UCX.
  std::uint32_t pid = 0;
  std::uint64_t host = 0;

  std::vector<std::byte> serialize() const;
  // kDataLoss for truncated or corrupt bytes.
  static Result<RemoteRegion> deserialize(std::span<const std::byte> bytes);
};

// Memory registered with one Transport for put/get (RAII: unregistered when the last copy goes).
// Either the caller's memory (Transport::register_memory; the caller keeps it alive and in place for
// the region's lifetime) or memory the transport allocates (Transport::allocate).
class MemoryRegion {
 public:
  MemoryRegion() = default;
  bool valid() const noexcept { return state_ != nullptr; }
  std::byte* data() const noexcept;  // [size()] bytes
  std::size_t size() const noexcept;
  std::span<std::byte> bytes() const noexcept { return {data(), size()}; }
  // What a peer needs to reach this memory. Anyone holding it (and authenticated on this transport)
  // can read and write the whole region until it is destroyed.
  RemoteRegion remote() const;

 private:
  friend class internal::TransportCore;
  friend class Transport;
  explicit MemoryRegion(std::shared_ptr<internal::RegionState> s) : state_(std::move(s)) {}
  std::shared_ptr<internal::RegionState> state_;
};

struct Incoming;

// Completion callback of put/get. Runs on the transport's callback thread (see MessageHandler).
using CompletionCallback = std::function<void(Status)>;

// Keeps a callback registered by Endpoint::on_close; unregisters it on destruction or reset(). Once
// that returns the callback is not running (unless reset from inside the callback itself) and will
// not run again. Move-only; an empty one holds nothing.
class CloseSubscription {
 public:
  CloseSubscription() = default;
  CloseSubscription(const CloseSubscription&) = delete;
  CloseSubscription& operator=(const CloseSubscription&) = delete;
  CloseSubscription(CloseSubscription&& other) noexcept
      : endpoint_(std::move(other.endpoint_)), id_(std::exchange(other.id_, 0)) {}
  CloseSubscription& operator=(CloseSubscription&& other) noexcept;
  ~CloseSubscription() { reset(); }
  void reset() noexcept;

 private:
  friend class Endpoint;
  CloseSubscription(std::weak_ptr<internal::EndpointState> endpoint, std::uint64_t id)
      : endpoint_(std::move(endpoint)), id_(id) {}
  std::weak_ptr<internal::EndpointState> endpoint_;
  std::uint64_t id_ = 0;
};

// One authenticated connection to a peer. A cheap handle: copies share the connection. All methods
// are thread-safe. Once the peer vanishes, the link breaks or close() is called, every pending and
// later operation fails with the endpoint's error (status()), and on_close callbacks run.
class Endpoint {
 public:
  Endpoint() = default;
  bool valid() const noexcept { return state_ != nullptr; }
  // Unique within its transport; EndpointId() (0) for an empty handle.
  EndpointId id() const noexcept;
  // "host:port" of the peer as given to connect, or as seen by the listener.
  std::string peer_address() const;
  // The connection's state: OK while usable; else the first error, which is why it closed
  // (kUnavailable: peer vanished or closed; kDataLoss or kInvalidArgument: the peer sent a malformed
  // message and was disconnected; kCancelled: closed here or the transport shut down). Named
  // status(), not background_error(): an Endpoint is a handle to one connection, not a component
  // with background work; its status is the connection's own, as a std::future has one.
  Status status() const;
  // Calls `callback` once, on the transport's callback thread, with status() when the endpoint
  // closes for any of those reasons; soon after registration if it is closed already (at once on
  // the calling thread if the transport is gone). It stays registered while the returned
  // subscription lives. kFailedPrecondition for an empty Endpoint, kInvalidArgument for an empty
  // callback.
  [[nodiscard]] Result<CloseSubscription> on_close(std::function<void(Status)> callback) const;
  // The UCX lanes in use ("posix", "cma", "tcp", ...), as UCX prints them; for diagnostics and tests.
  std::string transport_info() const;

  // Every `timeout` below: std::nullopt means TransportOptions::operation_timeout; otherwise
  // positive or kForever (else kInvalidArgument).

  // One-way message. Returns once UCX no longer needs the body (not a delivery receipt).
  // kInvalidArgument: body larger than max_message_bytes, or a type in laminar's reserved range.
  // kUnavailable: endpoint broken.
  [[nodiscard]] Status send(const Message& message, std::optional<Duration> timeout = std::nullopt);

  // Request/reply: the peer's handler answers with reply() or reply_error(). The reply's Status is
  // returned as is for reply_error; kDeadlineExceeded when no answer comes in time (a late answer is
  // dropped); kUnavailable when the endpoint breaks first; kInvalidArgument as for send.
  Result<Message> request(const Message& message, std::optional<Duration> timeout = std::nullopt);
  std::future<Result<Message>> request_async(const Message& message,
                                             std::optional<Duration> timeout = std::nullopt);

  // Answers a request received on this endpoint (to.request_id set, else kInvalidArgument).
  [[nodiscard]] Status reply(const Incoming& to, const Message& message);
  // Makes the requester's request() return `error` (not OK, else kInvalidArgument).
  [[nodiscard]] Status reply_error(const Incoming& to, const Status& error);

  // One-sided bulk copy of `length` bytes from local[local_offset] to the peer's remote[remote_offset]
  // (put) or back (get). The future (and `done`, if given) completes when the bytes have arrived at
  // their destination (put: visible in the peer's memory). kInvalidArgument for a range outside
  // either region or a region of another transport; kUnavailable / kDeadlineExceeded as above.
  // Preconditions (else kInvalidArgument): local.valid(); local_offset + length <= local.size();
  // remote_offset + length <= remote.size.
  std::future<Status> put(const MemoryRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                          std::uint64_t remote_offset, std::size_t length,
                          std::optional<Duration> timeout = std::nullopt, CompletionCallback done = {});
  std::future<Status> get(const MemoryRegion& local, std::size_t local_offset, const RemoteRegion& remote,
                          std::uint64_t remote_offset, std::size_t length,
                          std::optional<Duration> timeout = std::nullopt, CompletionCallback done = {});

  // Disconnects; pending operations fail with kCancelled. Idempotent.
  void close();

 private:
  friend class internal::TransportCore;
  explicit Endpoint(std::shared_ptr<internal::EndpointState> s) : state_(std::move(s)) {}
  std::shared_ptr<internal::EndpointState> state_;
};

// A message as delivered to a handler or by receive().
struct Incoming {
  // The sender; reply through it, or keep it to talk back later.
  Endpoint from;
  Message message;
  // Set (not RequestId()) when the sender waits in request(): answer with from.reply(*this, ...).
  RequestId request_id;
};

// Runs on the transport's callback thread, one message at a time in arrival order (see Threads at
// the top of this file).
using MessageHandler = std::function<void(Incoming)>;

// Owns the UCP context, worker, listening socket, endpoints and the progress and callback threads;
// one per process, shared by whoever talks over it. Destroying it closes every endpoint and fails
// every pending operation (kCancelled); MemoryRegions and Endpoint handles may outlive it (their
// operations then fail). Peers connecting while it shuts down see the connection closed
// (kUnavailable).
class Transport {
 public:
  // kInvalidArgument: token shorter than kMinTokenBytes, zero max_message_bytes or
  // max_unauthenticated_connections, non-positive timeouts.
  // kUnavailable: UCX could not start. (UCX warns about, and skips, unknown names in ucx_transports.)
  static Result<std::unique_ptr<Transport>> create(TransportOptions options = {});

  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;
  ~Transport();

  // Starts accepting connections on host:port (port 0: any free port). Returns the bound
  // "host:port". kInvalidArgument: host is not an IPv4/IPv6 address; kUnavailable: cannot bind;
  // kFailedPrecondition: already listening. A port whose last listener is gone can be taken again
  // at once (SO_REUSEADDR), and processes this one starts do not inherit the listening socket.
  Result<std::string> listen(std::string_view host, std::uint16_t port);
  // The "host:port" listen() bound; none before it succeeded.
  std::optional<std::string> listen_address() const;

  // Connects to "host:port", authenticates both ways and connects the two UCX workers.
  // kInvalidArgument: malformed address;
  // kUnavailable: nobody listens there or the link is down; kFailedPrecondition: the peer refused our
  // token or could not prove it holds the same one; kDeadlineExceeded: no answer within timeout
  // (std::nullopt: connect_timeout; else positive or kForever).
  Result<Endpoint> connect(std::string_view address, std::optional<Duration> timeout = std::nullopt);

  // Next peer that connected to our listener, authenticated and has its UCX endpoint. kDeadlineExceeded after `timeout`
  // (zero: only one already waiting; kForever: until one comes or the transport shuts down);
  // kInvalidArgument for a negative one.
  Result<Endpoint> accept(Duration timeout);

  // Routes messages of `type` to `handler` (replacing any earlier one; an empty function removes it).
  // Messages of application types without a handler queue up for receive(), within the inbox bounds
  // of TransportOptions. kInvalidArgument for a type in laminar's reserved range.
  [[nodiscard]] Status on_message(MessageType type, MessageHandler handler);
  // Next message of a type without a handler. kDeadlineExceeded after `timeout` (as for accept);
  // kCancelled once the transport is shutting down; kFailedPrecondition when the options turned
  // receive() off.
  Result<Incoming> receive(Duration timeout);

  // Registers [data, data + size) for put/get. kInvalidArgument: null or empty.
  Result<MemoryRegion> register_memory(void* data, std::size_t size);
  // Allocates and registers `size` bytes (page aligned). kResourceExhausted when that fails. On
  // one host a peer maps this memory (UCX's shared memory), so a put into it is one memcpy; a put
  // into registered host memory is emulated with messages the owner's side copies out, many times
  // slower (bench/README.md, KV migration).
  Result<MemoryRegion> allocate(std::size_t size);
  // Whether `region` was registered or allocated by this transport (only such regions put and get).
  bool owns(const MemoryRegion& region) const noexcept;

  const TransportOptions& options() const noexcept;
  TransportStats stats() const;

 private:
  friend class internal::TransportCore;
  explicit Transport(std::shared_ptr<internal::TransportCore> core);
  std::shared_ptr<internal::TransportCore> core_;
};

}  // namespace laminar
