#include "laminar/local_relay.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "clock_wait.h"
#include "local_relay_wire.h"
#include "stats_fields.h"

namespace laminar {

namespace internal {

namespace {

// Descriptors one read may bring; more are refused (the kernel drops what does not fit).
constexpr std::size_t kMaxFdsPerRead = 4;

Result<sockaddr_un> socket_address(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty()) return invalid_argument("local relay: the socket path is empty");
  if (path.size() >= sizeof(addr.sun_path)) {
    return invalid_argument(fmt::format("local relay: socket path '{}' is {} bytes; at most {} fit", path,
                                        path.size(), sizeof(addr.sun_path) - 1));
  }
  if (path.find('\0') != std::string::npos) {
    return invalid_argument("local relay: the socket path contains a NUL byte");
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

// Sends all of `bytes` on a blocking socket.
Status send_all(int sock, std::span<const std::byte> bytes) {
  while (!bytes.empty()) {
    const ssize_t n = send(sock, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return unavailable(fmt::format("send failed: {}", std::strerror(errno)));
    }
    bytes = bytes.subspan(std::size_t(n));
  }
  return ok_status();
}

// poll() timeout for the time left to `deadline` on `clock`, rounded up to whole milliseconds. A
// virtual clock's time left is only an upper bound on the real wait: its jumps wake poll() early.
int poll_timeout_ms(const Clock& clock, Duration deadline) {
  if (deadline == kForever) return -1;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - clock.now()).count();
  return int(std::clamp<long long>(left, 0, 1 << 30));
}

// Reads exactly n bytes by `deadline` on the waker's clock, collecting any descriptors that arrive
// with them in `fds`.
Status recv_exact(int sock, std::byte* dst, std::size_t n, const ClockWaker& waker, Duration deadline,
                  std::vector<UniqueFd>* fds, bool* ctrunc) {
  std::size_t got = 0;
  while (got < n) {
    if (deadline != kForever && waker.clock().now() >= deadline) {
      return deadline_exceeded(fmt::format("no reply in time ({} of {} bytes read)", got, n));
    }
    pollfd p[2] = {{sock, POLLIN, 0}, {waker.fd(), POLLIN, 0}};
    const int r = poll(p, 2, poll_timeout_ms(waker.clock(), deadline));
    if (r < 0) {
      if (errno == EINTR) continue;
      return unavailable(fmt::format("poll failed: {}", std::strerror(errno)));
    }
    if ((p[1].revents & POLLIN) != 0) waker.drain();
    if ((p[0].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
    iovec iov{dst + got, n - got};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerRead)];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    const ssize_t k = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return unavailable(fmt::format("receive failed: {}", std::strerror(errno)));
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds->emplace_back(fd);
      }
    }
    if ((msg.msg_flags & MSG_CTRUNC) != 0) *ctrunc = true;
    if (k == 0) {
      return unavailable(fmt::format("the relay closed the connection ({} of {} bytes of a reply read)", got, n));
    }
    got += std::size_t(k);
  }
  return ok_status();
}

}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) {
    reset();
    fd_ = o.release();
  }
  return *this;
}

int UniqueFd::release() noexcept { return std::exchange(fd_, -1); }

void UniqueFd::reset() noexcept {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

Result<SharedMapping::FileId> SharedMapping::check(int fd, std::uint64_t bytes) {
  if (bytes == 0) return data_loss("shared memory: the relay granted an empty version");
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    return data_loss(fmt::format("shared memory: the relay's descriptor is not a sealable memfd ({})",
                                 std::strerror(errno)));
  }
  // Without these seals the relay (or anyone holding the descriptor) could shrink the file under
  // the mapping (a read would then die of SIGBUS) or rewrite bytes being copied.
  if ((seals & F_SEAL_SHRINK) == 0 || (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) == 0) {
    return data_loss(fmt::format("shared memory: the relay's memfd lacks the shrink and write seals (seals {:#x})",
                                 unsigned(seals)));
  }
  struct stat st{};
  if (fstat(fd, &st) != 0) return data_loss(fmt::format("shared memory: fstat failed: {}", std::strerror(errno)));
  if (std::uint64_t(st.st_size) < bytes) {
    return data_loss(fmt::format("shared memory: the relay's memfd holds {} bytes, the version needs {}",
                                 std::uint64_t(st.st_size), bytes));
  }
  return FileId{st.st_dev, st.st_ino};
}

Result<std::shared_ptr<SharedMapping>> SharedMapping::map(int fd, std::uint64_t bytes, FileId id) {
  // Populated up front: one pass over the page tables is cheaper than a fault per page mid-copy.
  void* p = mmap(nullptr, bytes, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    return resource_exhausted(fmt::format("shared memory: mapping {} bytes failed: {}", bytes, std::strerror(errno)));
  }
  return std::shared_ptr<SharedMapping>(new SharedMapping(static_cast<const std::byte*>(p), bytes, id));
}

SharedMapping::~SharedMapping() { munmap(const_cast<std::byte*>(data_), size_); }

Result<std::shared_ptr<ClockWaker>> ClockWaker::create(std::shared_ptr<Clock> clock) {
  UniqueFd fd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (fd.get() < 0) return unavailable(fmt::format("eventfd failed: {}", std::strerror(errno)));
  std::shared_ptr<ClockWaker> w(new ClockWaker(std::move(clock), std::move(fd)));
  w->wake_ = w->clock_->subscribe([raw = w.get()] {
    const std::uint64_t one = 1;
    (void)!write(raw->fd_.get(), &one, sizeof one);
  });
  return w;
}

ClockWaker::~ClockWaker() { wake_.reset(); }

void ClockWaker::drain() const noexcept {
  std::uint64_t n = 0;
  (void)!read(fd_.get(), &n, sizeof n);
}

Result<std::shared_ptr<LocalRelayConnection>> LocalRelayConnection::connect(
    const std::string& path, std::shared_ptr<const ClockWaker> waker) {
  auto addr = socket_address(path);
  LAMINAR_RETURN_IF_ERROR(addr.status());
  UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return unavailable(fmt::format("local relay '{}': socket failed: {}", path, std::strerror(errno)));
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(sockaddr_un)) != 0) {
    return unavailable(fmt::format("local relay '{}': connect failed: {}", path, std::strerror(errno)));
  }
  return std::shared_ptr<LocalRelayConnection>(new LocalRelayConnection(std::move(fd), path, std::move(waker)));
}

void LocalRelayConnection::mark_broken() noexcept {
  broken_ = true;
  fd_.reset();
}

Status LocalRelayConnection::fail(Status why) {
  mark_broken();
  return why.with_context(fmt::format("local relay '{}'", path_));
}

Status LocalRelayConnection::error_reply(std::span<const std::byte> payload) {
  auto e = decode_local_error(payload);
  if (!e.ok()) return fail(e.status());
  return Status(e->code, std::move(e->message)).with_context(fmt::format("local relay '{}'", path_));
}

Status LocalRelayConnection::send_request(const LocalRequestFrame& request) {
  if (broken_) return unavailable(fmt::format("local relay '{}': the connection is closed", path_));
  const auto req = encode_local_request(request);
  Status st = send_all(fd_.get(), req);
  if (!st.ok()) return fail(st);
  return ok_status();
}

Status LocalRelayConnection::read_reply(Duration timeout, LocalReply* type, std::vector<std::byte>* payload,
                                        UniqueFd* fd) {
  const Duration deadline = deadline_after(waker_->clock(), timeout);
  std::vector<UniqueFd> fds;
  bool ctrunc = false;
  std::array<std::byte, kLocalReplyHeaderBytes> header;
  Status st = recv_exact(fd_.get(), header.data(), header.size(), *waker_, deadline, &fds, &ctrunc);
  if (!st.ok()) return fail(st);
  auto h = decode_local_reply_header(header);
  if (!h.ok()) return fail(h.status());
  // The header's decoder bounded the length by kLocalMaxPayloadBytes.
  payload->resize(std::size_t(h->payload_bytes));
  st = recv_exact(fd_.get(), payload->data(), payload->size(), *waker_, deadline, &fds, &ctrunc);
  if (!st.ok()) return fail(st);
  if (ctrunc) return fail(data_loss("reply carried more descriptors than the protocol allows"));
  *type = h->type;
  const std::size_t want_fds = *type == LocalReply::kGrant ? 1 : 0;
  if (fds.size() != want_fds) {
    return fail(data_loss(fmt::format("reply of type {} carried {} descriptors, {} expected", std::uint32_t(*type),
                                      fds.size(), want_fds)));
  }
  if (want_fds == 1) *fd = std::move(fds[0]);
  return ok_status();
}

Result<std::optional<Version>> LocalRelayConnection::newest_version(Duration timeout) {
  LAMINAR_RETURN_IF_ERROR(send_request({LocalRequest::kNewest, std::nullopt, 0}));
  LocalReply type{};
  std::vector<std::byte> payload;
  UniqueFd fd;
  LAMINAR_RETURN_IF_ERROR(read_reply(timeout, &type, &payload, &fd));
  if (type == LocalReply::kError) return error_reply(payload);
  if (type != LocalReply::kNewestIs) {
    return fail(data_loss(fmt::format("answer to 'newest' is of type {}, not {}", std::uint32_t(type),
                                      std::uint32_t(LocalReply::kNewestIs))));
  }
  auto newest = decode_local_newest(payload);
  if (!newest.ok()) return fail(newest.status());
  return *newest;
}

Result<LocalGrant> LocalRelayConnection::acquire(std::optional<Version> v, Duration timeout) {
  LAMINAR_RETURN_IF_ERROR(send_request({LocalRequest::kAcquire, v, 0}));
  LocalReply type{};
  std::vector<std::byte> payload;
  UniqueFd fd;
  LAMINAR_RETURN_IF_ERROR(read_reply(timeout, &type, &payload, &fd));
  if (type == LocalReply::kError) {
    // A relay that reports its own bytes damaged is left for the next one.
    Status relay_error = error_reply(payload);
    if (relay_error.code() == StatusCode::kDataLoss) mark_broken();
    return relay_error;
  }
  if (type != LocalReply::kGrant) {
    return fail(data_loss(fmt::format("answer to 'acquire' is of type {}", std::uint32_t(type))));
  }
  auto wire = decode_local_grant(payload);
  if (!wire.ok()) return fail(wire.status());
  if (v && wire->version != *v) {
    return fail(data_loss(fmt::format("asked for version {}, the grant is for version {}", v->value(),
                                      wire->version.value())));
  }
  auto manifest = WeightManifest::from_json(wire->manifest_json);
  if (!manifest.ok()) return fail(data_loss("grant's manifest: " + manifest.status().message()));
  auto plan = ChunkPlan::make(wire->total_bytes, wire->chunk_bytes);
  if (!plan.ok()) return fail(data_loss("grant's chunk plan: " + plan.status().message()));
  if (plan->num_chunks() != wire->checksums.size() || manifest->total_bytes() != wire->total_bytes) {
    return fail(data_loss(fmt::format("grant of version {}: {} bytes in {} chunks of {} do not fit its manifest "
                                      "({} bytes)", wire->version.value(), wire->total_bytes, wire->checksums.size(),
                                      wire->chunk_bytes, manifest->total_bytes())));
  }
  LocalGrant g;
  g.lease = wire->lease;
  g.version = wire->version;
  g.manifest = std::move(*manifest);
  g.plan = *plan;
  g.checksums = std::move(wire->checksums);
  g.fd = std::move(fd);
  return g;
}

void LocalRelayConnection::release(std::uint64_t lease) noexcept {
  if (!broken_) (void)send_request({LocalRequest::kRelease, std::nullopt, lease});
}

}  // namespace internal

using internal::UniqueFd;

// ---------------------------------------------------------------------------------------------
// LocalRelayServer

namespace {

// Requests answered for one client before the loop turns to the others, so a client that pipelines
// requests waits its turn.
constexpr int kRequestsPerTurn = 16;
// Connections accepted per turn, so a connect flood does not starve the clients already served.
constexpr int kAcceptsPerTurn = 16;
// While accept() fails for want of descriptors the listening socket stays readable; it is left
// unwatched (else the loop would spin) and tried again after this long or the next event. Real
// time, not the clock's: nothing announces a descriptor freed elsewhere in the process, and a
// virtual clock that stands still must not stop the server from accepting again.
constexpr int kAcceptRetryMs = 100;
// An outbox that has drained keeps at most this much memory for the next replies.
constexpr std::size_t kOutboxKeepBytes = 64 << 10;

// epoll tags of the server's own descriptors; a client's tag is its id.
constexpr std::uint64_t kWakeTag = 0;
constexpr std::uint64_t kClockTag = 1;
constexpr std::uint64_t kListenTag = 2;
constexpr std::uint64_t kFirstClientId = 3;

Duration saturating_add(Duration t, Duration d) { return d >= kForever - t ? kForever : t + d; }

long long whole_ms(Duration d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); }

}  // namespace

struct LocalRelayServer::Impl {
  // Reply bytes a client's socket has not taken yet, in order. `sent` counts every byte sent so
  // far, so positions in the stream stay valid as sent bytes are discarded.
  struct Outbox {
    std::vector<std::byte> bytes;  // queued: [head, bytes.size())
    std::size_t head = 0;
    std::uint64_t sent = 0;
    // Each queued grant's first byte in the stream, where its memfd rides. The handle keeps the
    // memfd open until then, even if the client releases the lease early.
    std::deque<std::pair<std::uint64_t, ReadHandle>> fds;
    std::size_t queued() const { return bytes.size() - head; }
  };

  struct Client {
    std::uint64_t id = 0;
    UniqueFd fd;
    pid_t pid = 0;
    std::array<std::byte, internal::kLocalRequestBytes> in{};  // a partial request
    std::size_t have = 0;
    std::map<std::uint64_t, ReadHandle> leases;
    Outbox out;
    Duration last_active{0};     // the last byte read from or sent to it
    std::uint32_t watching = 0;  // the epoll events asked for
  };

  // Why a connection ends.
  enum class Close : std::uint8_t { kGone, kRefused, kIdle, kStalled, kEvicted };

  std::shared_ptr<RelayStore> store;
  std::string path;
  ino_t inode = 0;
  LocalRelayServerOptions options;
  std::shared_ptr<internal::ClockWaker> waker;  // options.clock, and its jumps as an eventfd
  UniqueFd listen_fd;
  UniqueFd wake_fd;
  UniqueFd epoll_fd;
  std::thread thread;
  // The server thread's alone, from here on.
  std::map<std::uint64_t, std::unique_ptr<Client>> clients;  // by id: oldest connection first
  std::uint64_t next_id = kFirstClientId;
  std::uint64_t next_lease = 1;
  bool accept_paused = false;
  mutable std::mutex stats_mu;  // guards stats and first_error
  LocalRelayServerStats stats;
  Status first_error;

  const Clock& clock() const { return waker->clock(); }

  void emit(LocalRelayEvent e) {
    if (options.on_event) options.on_event(e);
  }

  void count(std::uint64_t LocalRelayServerStats::*counter) {
    std::lock_guard lock(stats_mu);
    ++(stats.*counter);
  }

  void update_stats() {
    std::size_t leases = 0;
    std::size_t queued = 0;
    for (const auto& [id, c] : clients) {
      leases += c->leases.size();
      queued += c->out.queued();
    }
    std::lock_guard lock(stats_mu);
    stats.clients = clients.size();
    stats.leases = leases;
    stats.queued_bytes = queued;
  }

  // `grant`: the version whose memfd goes with the reply's first byte.
  void queue_reply(Client& c, internal::LocalReply type, std::span<const std::byte> payload,
                   const ReadHandle* grant = nullptr) {
    Outbox& o = c.out;
    if (grant != nullptr) o.fds.emplace_back(o.sent + o.queued(), *grant);
    const auto header = internal::encode_local_reply_header({type, payload.size()});
    o.bytes.insert(o.bytes.end(), header.begin(), header.end());
    o.bytes.insert(o.bytes.end(), payload.begin(), payload.end());
  }

  void queue_error(Client& c, const Status& st) {
    queue_reply(c, internal::LocalReply::kError, internal::encode_local_error(st));
  }

  // Answers the request in c.in by queueing its reply; a request that is malformed, or releases a
  // lease the client does not hold, is refused: the reason comes back.
  std::optional<std::string> handle(Client& c) {
    auto request = internal::decode_local_request(c.in);
    if (!request.ok()) return request.status().message();
    switch (request->type) {
      case internal::LocalRequest::kNewest:
        queue_reply(c, internal::LocalReply::kNewestIs, internal::encode_local_newest(store->newest_version()));
        return std::nullopt;
      case internal::LocalRequest::kAcquire: {
        if (c.leases.size() >= options.max_leases_per_client) {
          queue_error(c, resource_exhausted(fmt::format("this client holds {} leases already, the most allowed",
                                                        c.leases.size())));
          return std::nullopt;
        }
        auto h = request->version ? store->acquire(*request->version) : store->acquire();
        if (!h.ok()) {
          queue_error(c, h.status());
          return std::nullopt;
        }
        const ChunkPlan& plan = h->plan();
        const std::uint64_t lease = next_lease++;
        internal::LocalGrantPayload grant{lease, h->version(), plan.total_bytes(), plan.chunk_bytes(), {},
                                          h->manifest().to_json()};
        grant.checksums.reserve(plan.num_chunks());
        for (std::uint32_t i = 0; i < plan.num_chunks(); ++i) grant.checksums.push_back(h->checksum(i).value());
        queue_reply(c, internal::LocalReply::kGrant, internal::encode_local_grant(grant), &*h);
        const Version v = h->version();
        c.leases.emplace(lease, std::move(*h));
        count(&LocalRelayServerStats::grants);
        emit({LocalRelayEvent::Kind::kGranted, v, c.pid, false, ""});
        return std::nullopt;
      }
      case internal::LocalRequest::kRelease: {
        auto it = c.leases.find(request->lease);
        if (it == c.leases.end()) {
          return fmt::format("release of lease {}, which this client does not hold", request->lease);
        }
        const Version v = it->second.version();
        c.leases.erase(it);
        emit({LocalRelayEvent::Kind::kReleased, v, c.pid, false, ""});
        return std::nullopt;
      }
    }
    LAMINAR_CHECK(false);  // decode_local_request accepts the three types only
  }

  // Closes client `id`, ending its leases.
  void drop(std::uint64_t id, Close why, const std::string& detail) {
    auto it = clients.find(id);
    LAMINAR_CHECK(it != clients.end());
    std::unique_ptr<Client> c = std::move(it->second);
    clients.erase(it);
    c->fd.reset();   // which also takes it out of the epoll set
    c->out = {};     // queued grants hold their versions too
    const auto closed = [&](std::uint64_t LocalRelayServerStats::*counter) {
      count(counter);
      emit({LocalRelayEvent::Kind::kClosed, Version(0), c->pid, true, detail});
    };
    switch (why) {
      case Close::kGone: break;
      case Close::kRefused:
        count(&LocalRelayServerStats::refused_clients);
        emit({LocalRelayEvent::Kind::kRefused, Version(0), c->pid, true, detail});
        break;
      case Close::kIdle: closed(&LocalRelayServerStats::idle_closed); break;
      case Close::kStalled: closed(&LocalRelayServerStats::stalled_closed); break;
      case Close::kEvicted: closed(&LocalRelayServerStats::evicted); break;
    }
    for (auto& [lease, h] : c->leases) {
      const Version v = h.version();
      h = ReadHandle();
      emit({LocalRelayEvent::Kind::kReleased, v, c->pid, true, ""});
    }
  }

  // Asks epoll for what c waits for now: requests while its outbox has room, room in its socket
  // while replies are queued. False when c had to be dropped.
  bool watch(Client& c) {
    std::uint32_t want = 0;
    if (c.out.queued() < options.max_client_buffer_bytes) want |= EPOLLIN;
    if (c.out.queued() > 0) want |= EPOLLOUT;
    if (want == c.watching) return true;
    epoll_event ev{};
    ev.events = want;
    ev.data.u64 = c.id;
    if (epoll_ctl(epoll_fd.get(), EPOLL_CTL_MOD, c.fd.get(), &ev) != 0) {
      drop(c.id, Close::kGone, "");
      return false;
    }
    if ((c.watching & EPOLLIN) != 0 && (want & EPOLLIN) == 0) count(&LocalRelayServerStats::read_pauses);
    c.watching = want;
    return true;
  }

  // Sends what c's socket takes now. False when the client is gone.
  bool flush(Client& c, Duration now) {
    Outbox& o = c.out;
    while (o.queued() > 0) {
      // A grant's memfd rides on its first byte: a send starts there or stops short of it.
      std::size_t len = o.queued();
      const ReadHandle* attach = nullptr;
      if (!o.fds.empty()) {
        if (o.fds.front().first == o.sent) {
          attach = &o.fds.front().second;
          if (o.fds.size() > 1) len = std::size_t(o.fds[1].first - o.sent);
        } else {
          len = std::size_t(o.fds.front().first - o.sent);
        }
      }
      iovec iov{o.bytes.data() + o.head, len};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
      if (attach != nullptr) {
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
        cmsghdr* cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        const int fd = attach->shared_fd();
        std::memcpy(CMSG_DATA(cm), &fd, sizeof(int));
      }
      const ssize_t n = sendmsg(c.fd.get(), &msg, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        return false;
      }
      if (attach != nullptr) o.fds.pop_front();  // in flight: the kernel holds the file now
      o.head += std::size_t(n);
      o.sent += std::uint64_t(n);
      c.last_active = now;
    }
    if (o.queued() == 0) {
      o.bytes.clear();
      o.head = 0;
      if (o.bytes.capacity() > kOutboxKeepBytes) o.bytes.shrink_to_fit();
    } else if (o.head > o.bytes.size() / 2) {
      o.bytes.erase(o.bytes.begin(), o.bytes.begin() + std::ptrdiff_t(o.head));
      o.head = 0;
    }
    return true;
  }

  // Reads and answers up to kRequestsPerTurn of c's requests while its outbox has room, then sends
  // what its socket takes. False when c was dropped.
  bool serve(Client& c, Duration now) {
    for (int answered = 0; answered < kRequestsPerTurn && c.out.queued() < options.max_client_buffer_bytes;) {
      const ssize_t n = recv(c.fd.get(), c.in.data() + c.have, c.in.size() - c.have, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (n <= 0) {
        if (n == 0 && c.have != 0) {
          drop(c.id, Close::kRefused, fmt::format("closed mid-request ({} of {} bytes)", c.have, c.in.size()));
        } else {
          drop(c.id, Close::kGone, "");
        }
        return false;
      }
      c.last_active = now;
      c.have += std::size_t(n);
      if (c.have < c.in.size()) continue;
      c.have = 0;
      ++answered;
      if (std::optional<std::string> why = handle(c)) {
        // Told why (kInvalidArgument: its input to fix) as far as its socket takes it now, then dropped.
        queue_error(c, invalid_argument(*why));
        (void)flush(c, now);
        drop(c.id, Close::kRefused, *why);
        return false;
      }
    }
    if (!flush(c, now)) {
      drop(c.id, Close::kGone, "");
      return false;
    }
    return watch(c);
  }

  // Closes the longest-idle connection holding no lease; false when every one holds a lease.
  bool evict(Duration now) {
    const Client* oldest = nullptr;
    for (const auto& [id, c] : clients) {
      if (c->leases.empty() && (oldest == nullptr || c->last_active < oldest->last_active)) oldest = c.get();
    }
    if (oldest == nullptr) return false;
    drop(oldest->id, Close::kEvicted,
         fmt::format("evicted for a new connection after {} ms idle", whole_ms(now - oldest->last_active)));
    return true;
  }

  Status listen_for_clients(bool on) {
    epoll_event ev{};
    ev.events = on ? std::uint32_t(EPOLLIN) : 0;
    ev.data.u64 = kListenTag;
    if (epoll_ctl(epoll_fd.get(), EPOLL_CTL_MOD, listen_fd.get(), &ev) != 0) {
      return unavailable(fmt::format("local relay server '{}': epoll on the listening socket failed: {}", path,
                                     std::strerror(errno)));
    }
    accept_paused = !on;
    return ok_status();
  }

  Status accept_clients(Duration now) {
    for (int k = 0; k < kAcceptsPerTurn; ++k) {
      UniqueFd fd(accept4(listen_fd.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (fd.get() < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) return listen_for_clients(false);
        return ok_status();  // EAGAIN: none left
      }
      ucred cred{};
      socklen_t len = sizeof cred;
      const pid_t pid = getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 ? cred.pid : 0;
      if (clients.size() >= options.max_clients && !evict(now)) {
        count(&LocalRelayServerStats::refused_full);
        emit({LocalRelayEvent::Kind::kClosed, Version(0), pid, true,
              fmt::format("turned away: all {} connections hold leases", clients.size())});
        continue;
      }
      auto c = std::make_unique<Client>();
      c->id = next_id++;
      c->fd = std::move(fd);
      c->pid = pid;
      c->last_active = now;
      c->watching = EPOLLIN;
      epoll_event ev{};
      ev.events = c->watching;
      ev.data.u64 = c->id;
      if (epoll_ctl(epoll_fd.get(), EPOLL_CTL_ADD, c->fd.get(), &ev) != 0) continue;  // closed, as if refused
      clients.emplace(c->id, std::move(c));
    }
    return ok_status();
  }

  // Closes the connections idle past idle_timeout; returns when the next one will be.
  Duration close_idle(Duration now) {
    Duration next = kForever;
    std::vector<std::uint64_t> expired;
    for (const auto& [id, c] : clients) {
      // A lease holder that has read every reply may be copying from its version.
      if (!c->leases.empty() && c->out.queued() == 0) continue;
      const Duration at = saturating_add(c->last_active, options.idle_timeout);
      if (at <= now) {
        expired.push_back(id);
      } else {
        next = std::min(next, at);
      }
    }
    for (std::uint64_t id : expired) {
      const Client& c = *clients.at(id);
      const long long ms = whole_ms(now - c.last_active);
      if (c.out.queued() > 0) {
        drop(id, Close::kStalled, fmt::format("left {} reply bytes unread for {} ms", c.out.queued(), ms));
      } else {
        drop(id, Close::kIdle, fmt::format("idle for {} ms", ms));
      }
    }
    return next;
  }

  void fail(Status st) {
    std::lock_guard lock(stats_mu);
    first_error = std::move(st);
  }

  void run() {
    std::array<epoll_event, 64> events;
    for (;;) {
      const Duration next_close = close_idle(clock().now());
      update_stats();
      int timeout_ms = internal::poll_timeout_ms(clock(), next_close);
      if (accept_paused && (timeout_ms < 0 || timeout_ms > kAcceptRetryMs)) timeout_ms = kAcceptRetryMs;
      const int n = epoll_wait(epoll_fd.get(), events.data(), int(events.size()), timeout_ms);
      if (n < 0) {
        if (errno == EINTR) continue;
        return fail(unavailable(fmt::format("local relay server '{}': epoll_wait failed: {}", path,
                                            std::strerror(errno))));
      }
      if (accept_paused) {
        Status st = listen_for_clients(true);
        if (!st.ok()) return fail(std::move(st));
      }
      const Duration now = clock().now();
      for (int i = 0; i < n; ++i) {
        const std::uint64_t tag = events[std::size_t(i)].data.u64;
        const std::uint32_t ev = events[std::size_t(i)].events;
        if (tag == kWakeTag) return;
        if (tag == kClockTag) {
          waker->drain();
          continue;
        }
        if (tag == kListenTag) {
          Status st = accept_clients(now);
          if (!st.ok()) return fail(std::move(st));
          continue;
        }
        auto it = clients.find(tag);
        if (it == clients.end()) continue;  // dropped earlier in this batch
        Client& c = *it->second;
        // Hung up with its reads paused: nothing more will come from it.
        if ((ev & (EPOLLHUP | EPOLLERR)) != 0 && (ev & EPOLLIN) == 0) {
          drop(tag, Close::kGone, "");
          continue;
        }
        if ((ev & EPOLLOUT) != 0 && !flush(c, now)) {
          drop(tag, Close::kGone, "");
          continue;
        }
        if ((ev & EPOLLIN) != 0) {
          serve(c, now);
        } else {
          watch(c);  // drained enough to read again, or nothing left to send
        }
      }
    }
  }
};

LocalRelayServer::LocalRelayServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

LocalRelayServer::~LocalRelayServer() {
  const std::uint64_t one = 1;
  [[maybe_unused]] auto n = write(impl_->wake_fd.get(), &one, sizeof one);
  impl_->thread.join();
  impl_->clients.clear();
  struct stat st{};
  if (stat(impl_->path.c_str(), &st) == 0 && st.st_ino == impl_->inode) unlink(impl_->path.c_str());
}

const std::string& LocalRelayServer::socket_path() const noexcept { return impl_->path; }

LocalRelayServerStats LocalRelayServer::stats() const {
  std::lock_guard lock(impl_->stats_mu);
  return impl_->stats;
}

Status LocalRelayServer::background_error() const {
  std::lock_guard lock(impl_->stats_mu);
  return impl_->first_error;
}

std::string LocalRelayServerStats::to_json() const { return internal::stats_json(*this); }

Result<std::unique_ptr<LocalRelayServer>> LocalRelayServer::create(std::shared_ptr<RelayStore> store,
                                                                  std::string socket_path,
                                                                  LocalRelayServerOptions options) {
  if (!store) return invalid_argument("local relay server: the store is null");
  if (!store->options().shareable) {
    return failed_precondition(
        "local relay server: the store was created without RelayStoreOptions::shareable, so other processes "
        "cannot map its versions");
  }
  for (const auto& [name, value] : {std::pair{"max_clients", options.max_clients},
                                    std::pair{"max_leases_per_client", options.max_leases_per_client},
                                    std::pair{"max_client_buffer_bytes", options.max_client_buffer_bytes}}) {
    if (value == 0) return invalid_argument(fmt::format("local relay server: {} is 0; it must be above 0", name));
  }
  if (options.idle_timeout <= Duration::zero()) {
    return invalid_argument(fmt::format("local relay server: idle_timeout is {} ns; it must be positive (kForever: "
                                        "never)", options.idle_timeout.count()));
  }
  auto addr = internal::socket_address(socket_path);
  LAMINAR_RETURN_IF_ERROR(addr.status().with_context("local relay server"));
  auto waker = internal::ClockWaker::create(internal::clock_or_steady(options.clock));
  LAMINAR_RETURN_IF_ERROR(waker.status().with_context("local relay server"));
  struct stat existing{};
  if (lstat(socket_path.c_str(), &existing) == 0) {
    if (!S_ISSOCK(existing.st_mode)) {
      return already_exists(fmt::format("local relay server: '{}' exists and is not a socket", socket_path));
    }
    auto probe = internal::LocalRelayConnection::connect(socket_path, *waker);
    if (probe.ok()) {
      return already_exists(fmt::format("local relay server: a server is already listening on '{}'", socket_path));
    }
    unlink(socket_path.c_str());  // stale: its server is gone
  }
  auto impl = std::make_unique<Impl>();
  impl->store = std::move(store);
  impl->path = socket_path;
  impl->options = std::move(options);
  impl->waker = std::move(*waker);
  impl->listen_fd = UniqueFd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (impl->listen_fd.get() < 0) {
    return unavailable(fmt::format("local relay server: socket failed: {}", std::strerror(errno)));
  }
  if (bind(impl->listen_fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(sockaddr_un)) != 0) {
    return unavailable(fmt::format("local relay server: bind to '{}' failed: {}", socket_path, std::strerror(errno)));
  }
  // From here a failure removes the socket file it bound.
  const auto failed = [&](std::string_view what) {
    const int err = errno;
    unlink(socket_path.c_str());
    return unavailable(fmt::format("local relay server '{}': {} failed: {}", socket_path, what, std::strerror(err)));
  };
  struct stat bound{};
  if (stat(socket_path.c_str(), &bound) == 0) impl->inode = bound.st_ino;
  if (listen(impl->listen_fd.get(), 64) != 0) return failed("listen");
  impl->wake_fd = UniqueFd(eventfd(0, EFD_CLOEXEC));
  if (impl->wake_fd.get() < 0) return failed("eventfd");
  impl->epoll_fd = UniqueFd(epoll_create1(EPOLL_CLOEXEC));
  if (impl->epoll_fd.get() < 0) return failed("epoll_create1");
  for (const auto& [fd, tag] : {std::pair{impl->wake_fd.get(), kWakeTag}, std::pair{impl->waker->fd(), kClockTag},
                               std::pair{impl->listen_fd.get(), kListenTag}}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = tag;
    if (epoll_ctl(impl->epoll_fd.get(), EPOLL_CTL_ADD, fd, &ev) != 0) return failed("epoll_ctl");
  }
  impl->thread = std::thread([p = impl.get()] { p->run(); });
  return std::unique_ptr<LocalRelayServer>(new LocalRelayServer(std::move(impl)));
}

}  // namespace laminar
