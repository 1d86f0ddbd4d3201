// Put and get between processes of one host by cross-memory copy (see same_host.h).
#include "transport/same_host.h"

#include <dirent.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sodium.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

namespace laminar::internal {

namespace {

// How /proc/net/tcp{,6} prints an address: each 32-bit word of the address as stored, then the port.
std::optional<std::string> proc_net_text(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) {
    const auto& v4 = reinterpret_cast<const sockaddr_in&>(a);
    return fmt::format("{:08X}:{:04X}", v4.sin_addr.s_addr, ntohs(v4.sin_port));
  }
  if (a.ss_family == AF_INET6) {
    const auto& v6 = reinterpret_cast<const sockaddr_in6&>(a);
    std::uint32_t words[4];
    std::memcpy(words, &v6.sin6_addr, sizeof(words));
    return fmt::format("{:08X}{:08X}{:08X}{:08X}:{:04X}", words[0], words[1], words[2], words[3],
                       ntohs(v6.sin6_port));
  }
  return std::nullopt;
}

// The inode of the socket whose local end is `local` and remote end `remote`, in this namespace.
std::optional<std::string> socket_inode(const sockaddr_storage& local, const sockaddr_storage& remote) {
  const auto l = proc_net_text(local);
  const auto r = proc_net_text(remote);
  if (!l || !r) return std::nullopt;
  std::ifstream table(local.ss_family == AF_INET ? "/proc/net/tcp" : "/proc/net/tcp6");
  std::string line;
  std::getline(table, line);  // header
  while (std::getline(table, line)) {
    std::istringstream in(line);
    std::string slot, here, there, state, queues, timer, retransmits, uid, timeout, inode;
    in >> slot >> here >> there >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode;
    if (here == *l && there == *r) return inode;
  }
  return std::nullopt;
}

}  // namespace

std::uint64_t same_host_key() {
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  std::getline(boot, boot_id);
  struct stat ns {};
  if (boot_id.empty() || stat("/proc/self/ns/pid", &ns) != 0) return 0;
  const std::string text = fmt::format("{} {} {}", boot_id, ns.st_dev, ns.st_ino);
  unsigned char digest[crypto_generichash_BYTES_MIN];
  crypto_generichash(digest, sizeof(digest), reinterpret_cast<const unsigned char*>(text.data()), text.size(),
                     nullptr, 0);
  std::uint64_t key = 0;
  std::memcpy(&key, digest, sizeof(key));
  return key == 0 ? 1 : key;
}

bool holds_other_end(int fd, pid_t pid) {
  sockaddr_storage ours{}, theirs{};
  socklen_t len = sizeof(ours);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&ours), &len) != 0) return false;
  len = sizeof(theirs);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&theirs), &len) != 0) return false;
  // The other end's row: its local address is our remote one.
  const auto inode = socket_inode(theirs, ours);
  if (!inode) return false;
  const std::string want = "socket:[" + *inode + "]";
  const std::string fds = fmt::format("/proc/{}/fd", pid);
  DIR* dir = opendir(fds.c_str());
  if (dir == nullptr) return false;
  bool found = false;
  while (const dirent* d = readdir(dir)) {
    char target[64] = {};
    const std::string link = fds + "/" + d->d_name;
    if (readlink(link.c_str(), target, sizeof(target) - 1) > 0 && want == target) {
      found = true;
      break;
    }
  }
  closedir(dir);
  return found;
}

Result<bool> copy_with_process(pid_t pid, bool is_put, std::byte* local, std::uint64_t remote, std::size_t length,
                               const std::string& peer) {
  std::size_t done = 0;
  while (done < length) {
    iovec here{local + done, length - done};
    iovec there{reinterpret_cast<void*>(remote + done), length - done};
    const ssize_t n = is_put ? process_vm_writev(pid, &here, 1, &there, 1, 0)
                             : process_vm_readv(pid, &here, 1, &there, 1, 0);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
      continue;
    }
    const int error = n < 0 ? errno : EFAULT;  // no progress at all: the next byte is not mapped
    if (error == EINTR) continue;
    if (error == EPERM || error == EACCES || error == ENOSYS) {
      if (done == 0) return false;
      // Allowed a moment ago: the process changed (exec of a setuid program) and is not ours now.
    }
    if (error == ESRCH) return unavailable(fmt::format("peer {}: its process {} is gone", peer, pid));
    return unavailable(fmt::format("peer {}: {} bytes at {:#x} in its process {} cannot be {}: {}", peer,
                                   length - done, remote + done, pid, is_put ? "written" : "read",
                                   std::strerror(error)));
  }
  return true;
}

}  // namespace laminar::internal
