// listen_socket.h: the kernel side of a UCX listener, for shutting it down safely (transport.cc).
//
// UCX 1.13's tcp connection manager frees a listener while connections it already accepted may not
// have delivered their request; when such a request arrives it is handed to the freed listener and
// the process crashes. UCX offers no way to stop accepting short of destroying the listener, so
// the transport finds the listener's socket among its own file descriptors, stops new handshakes
// there, and waits for (or cuts short) the connections already accepted before UCX frees it.
// Linux only: descriptors are found through /proc/self/fd.
#pragma once

#include <sys/socket.h>

#include <set>
#include <string>

namespace laminar::internal {

// This process's listening TCP socket bound to `bound` (family, address, port), or -1 if none.
int find_listening_socket(const sockaddr_storage& bound);

// Makes a listening socket drop every packet of a new connection (a socket filter): no further
// handshake completes, so its accept queue only shrinks from now on. False if the kernel refused.
bool stop_new_connections(int listen_fd);

// Connections completed but not yet taken from a listening socket's accept queue (0 on error).
int accept_queue_length(int listen_fd);

// Shuts down, both ways, each connected TCP socket of this process on `bound`'s family and port
// whose peer ("host:port") is not in `spare`: the connections its listener accepted (an outgoing
// connection never gets a port a listener holds). Each socket is checked and shut down in one
// step, so a descriptor reused meanwhile is never touched. Returns how many there were.
int cut_accepted_connections(const sockaddr_storage& bound, const std::set<std::string>& spare);

// "host:port" of an IPv4 or IPv6 address ("[v6]:port" for v6).
std::string sockaddr_text(const sockaddr_storage& ss);

}  // namespace laminar::internal
