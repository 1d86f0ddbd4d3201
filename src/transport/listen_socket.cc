#include "transport/listen_socket.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fmt/format.h>
#include <linux/filter.h>
#include <netinet/in.h>
#include <netinet/tcp.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace laminar::internal {

namespace {

std::uint16_t port_of(const sockaddr_storage& ss) {
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_port);
  return 0;
}

bool same_address(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family || port_of(a) != port_of(b)) return false;
  if (a.ss_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(&a)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in*>(&b)->sin_addr.s_addr;
  }
  return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(&a)->sin6_addr,
                     &reinterpret_cast<const sockaddr_in6*>(&b)->sin6_addr, sizeof(in6_addr)) == 0;
}

bool is_listening(int fd) {
  int v = 0;
  socklen_t len = sizeof(v);
  return getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &v, &len) == 0 && v != 0;
}

bool address_of(int fd, bool peer, sockaddr_storage& out) {
  socklen_t len = sizeof(out);
  auto* sa = reinterpret_cast<sockaddr*>(&out);
  return (peer ? getpeername(fd, sa, &len) : getsockname(fd, sa, &len)) == 0;
}

// Calls fn(fd) for each TCP socket this process has open.
template <class Fn>
void for_each_tcp_socket(Fn fn) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return;
  const int own = dirfd(dir);
  while (const dirent* d = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(d->d_name, &end, 10);
    if (end == d->d_name || *end != '\0' || fd == own) continue;
    int protocol = 0;
    socklen_t len = sizeof(protocol);
    if (getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_PROTOCOL, &protocol, &len) != 0) continue;
    if (protocol == IPPROTO_TCP) fn(static_cast<int>(fd));
  }
  closedir(dir);
}

}  // namespace

int find_listening_socket(const sockaddr_storage& bound) {
  int found = -1;
  for_each_tcp_socket([&](int fd) {
    sockaddr_storage local{};
    if (found < 0 && is_listening(fd) && address_of(fd, false, local) && same_address(local, bound)) found = fd;
  });
  return found;
}

bool stop_new_connections(int listen_fd) {
  sock_filter drop_all[] = {BPF_STMT(BPF_RET | BPF_K, 0)};
  const sock_fprog program{1, drop_all};
  return setsockopt(listen_fd, SOL_SOCKET, SO_ATTACH_FILTER, &program, sizeof(program)) == 0;
}

int accept_queue_length(int listen_fd) {
  tcp_info info{};
  socklen_t len = sizeof(info);
  // For a listening socket the kernel reports its accept queue's length as tcpi_unacked.
  if (getsockopt(listen_fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return 0;
  return static_cast<int>(info.tcpi_unacked);
}

int cut_accepted_connections(const sockaddr_storage& bound, const std::set<std::string>& spare) {
  int cut = 0;
  for_each_tcp_socket([&](int fd) {
    sockaddr_storage local{};
    sockaddr_storage peer{};
    if (is_listening(fd) || !address_of(fd, false, local) || local.ss_family != bound.ss_family ||
        port_of(local) != port_of(bound) || !address_of(fd, true, peer) || spare.count(sockaddr_text(peer)) != 0) {
      return;
    }
    ::shutdown(fd, SHUT_RDWR);
    ++cut;
  });
  return cut;
}

std::string sockaddr_text(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    return fmt::format("{}:{}", host, ntohs(a->sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    return fmt::format("[{}]:{}", host, ntohs(a->sin6_port));
  }
  return "<unknown address>";
}

}  // namespace laminar::internal
