#include "laminar/local_relay.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
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
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "clock_wait.h"
#include "local_relay_wire.h"

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

// Sends the whole of `parts` (with `fd` attached to the first byte when >= 0). Blocking: the socket
// carries a send timeout.
Status send_all(int sock, std::span<const std::span<const std::byte>> parts, int fd) {
  std::vector<iovec> iov;
  for (auto p : parts) {
    if (!p.empty()) iov.push_back({const_cast<std::byte*>(p.data()), p.size()});
  }
  std::size_t first = 0;
  bool attach = fd >= 0;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  while (first < iov.size()) {
    msghdr msg{};
    msg.msg_iov = iov.data() + first;
    msg.msg_iovlen = iov.size() - first;
    if (attach) {
      std::memset(control, 0, sizeof control);
      msg.msg_control = control;
      msg.msg_controllen = sizeof control;
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    const ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return unavailable(fmt::format("send failed: {}", std::strerror(errno)));
    }
    attach = false;
    auto left = std::size_t(n);
    while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (first < iov.size()) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
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
  const std::span<const std::byte> parts[] = {req};
  Status st = send_all(fd_.get(), parts, -1);
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

Result<std::optional<Version>> LocalRelayConnection::latest(Duration timeout) {
  LAMINAR_RETURN_IF_ERROR(send_request({LocalRequest::kLatest, std::nullopt, 0}));
  LocalReply type{};
  std::vector<std::byte> payload;
  UniqueFd fd;
  LAMINAR_RETURN_IF_ERROR(read_reply(timeout, &type, &payload, &fd));
  if (type == LocalReply::kError) return error_reply(payload);
  if (type != LocalReply::kLatestIs) {
    return fail(data_loss(fmt::format("answer to 'latest' is of type {}, not {}", std::uint32_t(type),
                                      std::uint32_t(LocalReply::kLatestIs))));
  }
  auto newest = decode_local_latest(payload);
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

// A client's send buffer may be full of replies it does not read; past this the server gives up on it
// rather than stalling every other client.
constexpr int kSendTimeoutMs = 2000;

}  // namespace

struct LocalRelayServer::Impl {
  struct Client {
    UniqueFd fd;
    pid_t pid = 0;
    std::array<std::byte, internal::kLocalRequestBytes> in{};
    std::size_t have = 0;
    std::map<std::uint64_t, ReadHandle> leases;
  };

  std::shared_ptr<RelayStore> store;
  std::string path;
  ino_t inode = 0;
  LocalRelayServerOptions options;
  UniqueFd listen_fd;
  UniqueFd wake_fd;
  std::thread thread;
  std::vector<std::unique_ptr<Client>> clients;  // the server thread's alone
  std::uint64_t next_lease = 1;
  mutable std::mutex stats_mu;  // guards stats and first_error
  LocalRelayServerStats stats;
  Status first_error;

  void emit(LocalRelayEvent e) {
    if (options.on_event) options.on_event(e);
  }

  void update_stats() {
    std::size_t leases = 0;
    for (const auto& c : clients) leases += c->leases.size();
    std::lock_guard lock(stats_mu);
    stats.clients = clients.size();
    stats.leases = leases;
  }

  Status reply(Client& c, internal::LocalReply type, std::span<const std::byte> payload, int fd) {
    const auto header = internal::encode_local_reply_header({type, payload.size()});
    const std::span<const std::byte> parts[] = {header, payload};
    return internal::send_all(c.fd.get(), parts, fd);
  }

  Status reply_error(Client& c, const Status& st) {
    return reply(c, internal::LocalReply::kError, internal::encode_local_error(st), -1);
  }

  // Answers one request; an error means the client must be dropped (`refused` says whether it
  // misbehaved rather than vanished).
  Status handle(Client& c, bool* refused) {
    // The client sent it wrong: it is told so (kInvalidArgument, its input to fix) and dropped.
    const auto refuse = [&](std::string why) {
      *refused = true;
      (void)reply_error(c, invalid_argument(why));
      return invalid_argument(std::move(why));
    };
    auto request = internal::decode_local_request(c.in);
    if (!request.ok()) return refuse(request.status().message());
    switch (request->type) {
      case internal::LocalRequest::kLatest:
        return reply(c, internal::LocalReply::kLatestIs, internal::encode_local_latest(store->newest_version()), -1);
      case internal::LocalRequest::kAcquire: {
        if (c.leases.size() >= options.max_leases_per_client) {
          return reply_error(c, resource_exhausted(fmt::format("this client holds {} leases already, the most allowed",
                                                               c.leases.size())));
        }
        auto h = request->version ? store->acquire(*request->version) : store->acquire();
        if (!h.ok()) return reply_error(c, h.status());
        const ChunkPlan& plan = h->plan();
        const std::uint64_t lease = next_lease++;
        internal::LocalGrantPayload grant{lease, h->version(), plan.total_bytes(), plan.chunk_bytes(), {},
                                          h->manifest().to_json()};
        grant.checksums.reserve(plan.num_chunks());
        for (std::uint32_t i = 0; i < plan.num_chunks(); ++i) grant.checksums.push_back(h->checksum(i).value());
        const std::vector<std::byte> payload = internal::encode_local_grant(grant);
        // Leased before the reply goes out: the client may release it the moment it arrives.
        const Version v = h->version();
        const int fd = h->shared_fd();
        c.leases.emplace(lease, std::move(*h));
        LAMINAR_RETURN_IF_ERROR(reply(c, internal::LocalReply::kGrant, payload, fd));
        {
          std::lock_guard lock(stats_mu);
          ++stats.grants;
        }
        emit({LocalRelayEvent::Kind::kGranted, v, c.pid, false, ""});
        return ok_status();
      }
      case internal::LocalRequest::kRelease: {
        auto it = c.leases.find(request->lease);
        if (it == c.leases.end()) {
          return refuse(fmt::format("release of lease {}, which this client does not hold", request->lease));
        }
        const Version v = it->second.version();
        c.leases.erase(it);
        emit({LocalRelayEvent::Kind::kReleased, v, c.pid, false, ""});
        return ok_status();
      }
    }
    LAMINAR_CHECK(false);  // decode_local_request accepts the three types only
  }

  void drop(std::size_t k, bool refused, const std::string& why) {
    std::unique_ptr<Client> c = std::move(clients[k]);
    clients.erase(clients.begin() + std::ptrdiff_t(k));
    if (refused) {
      {
        std::lock_guard lock(stats_mu);
        ++stats.refused_clients;
      }
      emit({LocalRelayEvent::Kind::kRefused, Version(0), c->pid, true, why});
    }
    for (auto& [lease, h] : c->leases) {
      const Version v = h.version();
      h = ReadHandle();
      emit({LocalRelayEvent::Kind::kReleased, v, c->pid, true, ""});
    }
  }

  void accept_clients() {
    for (;;) {
      UniqueFd fd(accept4(listen_fd.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (fd.get() < 0) return;  // EAGAIN, or a client that went away while queued
      if (clients.size() >= options.max_clients) continue;
      const int flags = fcntl(fd.get(), F_GETFL);
      if (flags < 0 || fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) continue;
      const timeval tv{kSendTimeoutMs / 1000, (kSendTimeoutMs % 1000) * 1000};
      (void)setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
      auto c = std::make_unique<Client>();
      ucred cred{};
      socklen_t len = sizeof cred;
      if (getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) c->pid = cred.pid;
      c->fd = std::move(fd);
      clients.push_back(std::move(c));
    }
  }

  // Reads what client k sent and answers every whole request; false when the client was dropped.
  bool serve(std::size_t k) {
    Client& c = *clients[k];
    for (;;) {
      const ssize_t n = recv(c.fd.get(), c.in.data() + c.have, c.in.size() - c.have, MSG_DONTWAIT);
      if (n < 0 && (errno == EINTR)) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      if (n <= 0) {
        const bool mid_request = n == 0 && c.have != 0;
        drop(k, mid_request, mid_request ? fmt::format("closed mid-request ({} of {} bytes)", c.have, c.in.size())
                                         : std::string());
        return false;
      }
      c.have += std::size_t(n);
      if (c.have < c.in.size()) continue;
      c.have = 0;
      bool refused = false;
      Status st = handle(c, &refused);
      if (!st.ok()) {
        drop(k, refused, st.message());
        return false;
      }
    }
  }

  void run() {
    for (;;) {
      std::vector<pollfd> fds{{wake_fd.get(), POLLIN, 0}, {listen_fd.get(), POLLIN, 0}};
      for (const auto& c : clients) fds.push_back({c->fd.get(), POLLIN, 0});
      if (poll(fds.data(), fds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        std::lock_guard lock(stats_mu);
        first_error = unavailable(fmt::format("local relay server '{}': poll failed: {}", path, std::strerror(errno)));
        return;
      }
      if (fds[0].revents != 0) return;
      // Back to front, so dropping a client does not shift the ones still to serve.
      for (std::size_t k = clients.size(); k-- > 0;) {
        if (fds[k + 2].revents != 0) serve(k);
      }
      if (fds[1].revents != 0) accept_clients();
      update_stats();
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

std::string LocalRelayServerStats::to_json() const {
  return fmt::format(R"({{"clients":{},"leases":{},"grants":{},"refused_clients":{}}})", clients, leases, grants,
                     refused_clients);
}

Result<std::unique_ptr<LocalRelayServer>> LocalRelayServer::create(std::shared_ptr<RelayStore> store,
                                                                  std::string socket_path,
                                                                  LocalRelayServerOptions options) {
  if (!store) return invalid_argument("local relay server: the store is null");
  if (!store->options().shareable) {
    return failed_precondition(
        "local relay server: the store was created without RelayStoreOptions::shareable, so other processes "
        "cannot map its versions");
  }
  if (options.max_clients == 0 || options.max_leases_per_client == 0) {
    return invalid_argument(fmt::format("local relay server: max_clients {} and max_leases_per_client {} must be "
                                        "above 0", options.max_clients, options.max_leases_per_client));
  }
  auto addr = internal::socket_address(socket_path);
  LAMINAR_RETURN_IF_ERROR(addr.status().with_context("local relay server"));
  struct stat existing{};
  if (lstat(socket_path.c_str(), &existing) == 0) {
    if (!S_ISSOCK(existing.st_mode)) {
      return already_exists(fmt::format("local relay server: '{}' exists and is not a socket", socket_path));
    }
    auto waker = internal::ClockWaker::create(Clock::steady());
    LAMINAR_RETURN_IF_ERROR(waker.status().with_context("local relay server"));
    auto probe = internal::LocalRelayConnection::connect(socket_path, std::move(*waker));
    if (probe.ok()) {
      return already_exists(fmt::format("local relay server: a server is already listening on '{}'", socket_path));
    }
    unlink(socket_path.c_str());  // stale: its server is gone
  }
  auto impl = std::make_unique<Impl>();
  impl->store = std::move(store);
  impl->path = socket_path;
  impl->options = std::move(options);
  impl->listen_fd = UniqueFd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (impl->listen_fd.get() < 0) {
    return unavailable(fmt::format("local relay server: socket failed: {}", std::strerror(errno)));
  }
  if (bind(impl->listen_fd.get(), reinterpret_cast<const sockaddr*>(&*addr), sizeof(sockaddr_un)) != 0) {
    return unavailable(fmt::format("local relay server: bind to '{}' failed: {}", socket_path, std::strerror(errno)));
  }
  struct stat bound{};
  if (stat(socket_path.c_str(), &bound) == 0) impl->inode = bound.st_ino;
  if (listen(impl->listen_fd.get(), 64) != 0) {
    const int err = errno;
    unlink(socket_path.c_str());
    return unavailable(fmt::format("local relay server: listen on '{}' failed: {}", socket_path, std::strerror(err)));
  }
  impl->wake_fd = UniqueFd(eventfd(0, EFD_CLOEXEC));
  if (impl->wake_fd.get() < 0) {
    const int err = errno;
    unlink(socket_path.c_str());
    return unavailable(fmt::format("local relay server: eventfd failed: {}", std::strerror(err)));
  }
  impl->thread = std::thread([p = impl.get()] { p->run(); });
  return std::unique_ptr<LocalRelayServer>(new LocalRelayServer(std::move(impl)));
}

}  // namespace laminar
