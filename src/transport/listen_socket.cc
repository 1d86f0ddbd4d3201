// Finding UCX's listening sockets and filtering who may reach them (listen_socket.h).
#include "transport/listen_socket.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fmt/format.h>
#include <ifaddrs.h>
#include <linux/filter.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace laminar::internal {

namespace {

bool is_listening(int fd) {
  int v = 0;
  socklen_t len = sizeof(v);
  return getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &v, &len) == 0 && v != 0;
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

// A 32-bit word of an address as BPF loads it from a packet (network order, read big-endian).
std::uint32_t word_of(const IpAddress& a, std::size_t i) {
  std::uint32_t w = 0;
  std::memcpy(&w, a.bytes.data() + 4 * i, 4);
  return ntohl(w);
}

sock_filter load_word(int offset) {
  return BPF_STMT(BPF_LD | BPF_W | BPF_ABS, static_cast<std::uint32_t>(SKF_NET_OFF + offset));
}

constexpr std::uint32_t kAccept = 0xFFFFFFFFu;  // keep the whole packet
constexpr std::uint32_t kDrop = 0;

}  // namespace

std::optional<IpAddress> ip_of(const sockaddr_storage& ss) {
  IpAddress a;
  if (ss.ss_family == AF_INET) {
    std::memcpy(a.bytes.data(), &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, 4);
    return a;
  }
  if (ss.ss_family == AF_INET6) {
    const in6_addr& v6 = reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr;
    if (IN6_IS_ADDR_V4MAPPED(&v6)) {
      std::memcpy(a.bytes.data(), v6.s6_addr + 12, 4);
      return a;
    }
    a.family = 6;
    std::memcpy(a.bytes.data(), v6.s6_addr, 16);
    return a;
  }
  return std::nullopt;
}

std::string ip_text(const IpAddress& a) {
  char text[INET6_ADDRSTRLEN] = {};
  inet_ntop(a.family == 4 ? AF_INET : AF_INET6, a.bytes.data(), text, sizeof(text));
  return text;
}

std::set<std::pair<int, unsigned long>> listening_tcp_sockets() {
  std::set<std::pair<int, unsigned long>> found;
  for_each_tcp_socket([&](int fd) {
    struct stat st {};
    if (is_listening(fd) && fstat(fd, &st) == 0) found.emplace(fd, static_cast<unsigned long>(st.st_ino));
  });
  return found;
}

std::vector<IpAddress> local_addresses(std::size_t limit) {
  std::vector<IpAddress> out;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  for (const ifaddrs* i = list; i != nullptr && out.size() < limit; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || (i->ifa_flags & IFF_UP) == 0) continue;
    sockaddr_storage ss{};
    if (i->ifa_addr->sa_family == AF_INET) {
      std::memcpy(&ss, i->ifa_addr, sizeof(sockaddr_in));
    } else if (i->ifa_addr->sa_family == AF_INET6) {
      std::memcpy(&ss, i->ifa_addr, sizeof(sockaddr_in6));
    } else {
      continue;
    }
    const auto a = ip_of(ss);
    if (a && std::find(out.begin(), out.end(), *a) == out.end()) out.push_back(*a);
  }
  freeifaddrs(list);
  return out;
}

bool admit_only(int fd, const std::set<IpAddress>& allowed) {
  // Every jump is short (to the next instruction or past one block), so the program has no limit
  // but the kernel's length.
  std::vector<sock_filter> p;
  if (!allowed.empty()) {
    p.push_back(BPF_STMT(BPF_LD | BPF_B | BPF_ABS, static_cast<std::uint32_t>(SKF_NET_OFF)));
    p.push_back(BPF_STMT(BPF_ALU | BPF_AND | BPF_K, 0xF0));  // the IP version nibble
    p.push_back(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0x40, 1, 0));
    const std::size_t to_v6 = p.size();
    p.push_back(BPF_STMT(BPF_JMP | BPF_JA, 0));  // patched below: to the IPv6 block
    p.push_back(load_word(12));                   // IPv4 source address
    for (const IpAddress& a : allowed) {
      if (a.family != 4) continue;
      p.push_back(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, word_of(a, 0), 0, 1));
      p.push_back(BPF_STMT(BPF_RET | BPF_K, kAccept));
    }
    p.push_back(BPF_STMT(BPF_RET | BPF_K, kDrop));
    p[to_v6].k = static_cast<std::uint32_t>(p.size() - to_v6 - 1);
    // The accumulator still holds the version nibble here.
    p.push_back(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, 0x60, 1, 0));
    p.push_back(BPF_STMT(BPF_RET | BPF_K, kDrop));
    for (const IpAddress& a : allowed) {
      if (a.family != 6) continue;
      // The source address is bytes 8..24 of the IPv6 header; a mismatch skips to the next address.
      for (std::size_t i = 0; i < 4; ++i) {
        p.push_back(load_word(static_cast<int>(8 + 4 * i)));
        p.push_back(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, word_of(a, i), 0, static_cast<std::uint8_t>(7 - 2 * i)));
      }
      p.push_back(BPF_STMT(BPF_RET | BPF_K, kAccept));
    }
  }
  p.push_back(BPF_STMT(BPF_RET | BPF_K, kDrop));
  if (p.size() > BPF_MAXINSNS) return false;
  const sock_fprog program{static_cast<unsigned short>(p.size()), p.data()};
  return setsockopt(fd, SOL_SOCKET, SO_ATTACH_FILTER, &program, sizeof(program)) == 0;
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
