// listen_socket.h (internal): the sockets UCX listens on, and who may reach them.
//
// A UCP worker with tcp among its transports opens a listening socket on every network device, and
// UCX 1.13 parses what arrives there with assertions, not checks: one bad packet aborts the process.
// laminar cannot stop UCX from listening, so it narrows who can talk to those sockets: it finds them
// (the listening TCP sockets that appear while the worker is created) and attaches a classic-BPF
// socket filter that admits packets only from the IP addresses of peers that have authenticated
// (admit_only). The kernel runs the filter before TCP sees the packet, so nobody else even completes
// a TCP handshake; a connection the listener accepts inherits the filter of that moment.
// Linux only (/proc/self/fd, SO_ATTACH_FILTER).
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace laminar::internal {

// An IPv4 or IPv6 address, as the filter compares it and bootstrap frames carry it.
struct IpAddress {
  std::uint8_t family = 4;            // 4 or 6
  std::array<std::byte, 16> bytes{};  // network order; IPv4 uses the first 4
  std::size_t size() const noexcept { return family == 4 ? 4 : 16; }
  auto operator<=>(const IpAddress&) const = default;
};

// The IP address of a socket address, IPv4-mapped IPv6 as IPv4; nullopt for other families.
std::optional<IpAddress> ip_of(const sockaddr_storage& address);
std::string ip_text(const IpAddress& address);

// Owns a file descriptor; closes it on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// This process's listening TCP sockets, as (descriptor, inode) pairs: a descriptor closed and
// reused between two snapshots shows up as a different pair.
std::set<std::pair<int, unsigned long>> listening_tcp_sockets();

// The addresses of this host's network interfaces that are up, loopback included, at most `limit`.
std::vector<IpAddress> local_addresses(std::size_t limit);

// Replaces the socket filter of `fd` with one that admits only packets whose IPv4 or IPv6 source
// address is in `allowed` (empty: none at all). False if the kernel refused it (or the program
// would be longer than the kernel allows: about 2000 IPv4 or 450 IPv6 addresses).
bool admit_only(int fd, const std::set<IpAddress>& allowed);

// "host:port" of an IPv4 or IPv6 address ("[v6]:port" for v6).
std::string sockaddr_text(const sockaddr_storage& ss);

}  // namespace laminar::internal
