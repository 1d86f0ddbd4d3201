// same_host.h (internal): put and get between two processes of one host without UCX, by the kernel's
// cross-memory copy (process_vm_writev / process_vm_readv), once the peer has proven which process it
// is. UCX's own same-host path for this (its shared-memory transports) shares a message FIFO that a
// dying peer can wedge (docs/design.md, "What a dying peer can do"), so laminar leaves it out and
// copies bulk bytes itself.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "laminar/status.h"

namespace laminar::internal {

// Names this host and this process's pid namespace (boot id and the namespace's inode), so that a
// pid a peer on "the same host" gives means the same process here; 0 when they cannot be read.
std::uint64_t same_host_key();

// Whether process `pid` holds the other end of the TCP connection `fd`, as this network namespace
// sees it: what proves that a peer connected over `fd` is process `pid`, rather than merely says so.
bool holds_other_end(int fd, pid_t pid);

// Copies `length` bytes from `local` to address `remote` of process `pid` (put), or back (get).
// true: copied; false: this host does not let this process copy (permissions, seccomp: use UCX);
// kUnavailable: the process is gone or the range is not mapped in it. `peer` names it in errors.
Result<bool> copy_with_process(pid_t pid, bool is_put, std::byte* local, std::uint64_t remote, std::size_t length,
                               const std::string& peer);

}  // namespace laminar::internal
