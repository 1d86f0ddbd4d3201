// local_relay.h: LocalRelayServer, which lets rollout processes on the same host read a relay's
// versions in place, through shared memory.
//
// Every version a shareable RelayStore (RelayStoreOptions::shareable) holds lives in a sealed memfd (fixed size; only the store's own mapping
// writes to it). The server listens on a Unix domain socket; a client (WeightPuller::create_local)
// asks for the newest or a given committed version and receives its manifest, chunk plan and
// checksums plus the memfd itself (SCM_RIGHTS). It maps the memfd read-only and copies straight into
// its destinations: one copy, relay memory to engine memory. While a client holds a lease on a
// version the server keeps a ReadHandle on it, so the store neither frees nor recycles its memory;
// the lease ends when the client releases it or its connection closes (the client exited or died).
//
//   laminar::RelayStoreOptions so;
//   so.shareable = true;
//   std::shared_ptr<laminar::RelayStore> store = laminar::RelayStore::create(so).value();
//   auto server = laminar::LocalRelayServer::create(store, "/run/laminar/relay0.sock").value();
//   // in a rollout process:
//   auto puller = laminar::WeightPuller::create_local({"/run/laminar/relay0.sock"}).value();
//
// Threads: the server runs one thread of its own, which accepts, answers every client and calls
// on_event; the calls below may come from any thread. That thread runs one epoll loop over the
// listening socket, every client's (nonblocking) socket and a wake-up eventfd, so no client can
// stall another: a client's replies wait in its own bounded buffer and go out as its socket takes
// them, a client that fills it (sends requests, reads no answers) is not read until it drains, and
// requests are answered a few per client in turn. Idle connections are closed (idle_timeout); a
// full table evicts the longest-idle connection that holds no lease (max_clients).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "laminar/clock.h"
#include "laminar/relay_store.h"
#include "laminar/status.h"
#include "laminar/types.h"

namespace laminar {

struct LocalRelayEvent {
  enum class Kind : std::uint8_t {
    kGranted,   // a client took a lease on `version`
    kReleased,  // a lease ended: released, or the client's connection closed (`disconnected`)
    kRefused,   // a client sent something malformed and was disconnected (`detail` says what)
    kClosed,    // the server closed a connection that did nothing wrong: idle, evicted for a new
                // client, or turned away with every slot leased (`detail` says which)
  };
  Kind kind = Kind::kGranted;
  Version version;
  pid_t client_pid = 0;  // from SO_PEERCRED
  bool disconnected = false;
  std::string detail;
};

struct LocalRelayServerOptions {
  // Connections served at once. A new connection beyond this closes the connection that has been
  // idle longest among those holding no lease; when every connection holds a lease, the new one is
  // closed at once (stats: evicted, refused_full).
  std::size_t max_clients = 64;
  // Leases one connection may hold; past this an acquire is refused with kResourceExhausted.
  std::size_t max_leases_per_client = 16;
  // Replies queued for one client and not yet taken by its socket. Once over this (a single reply
  // may overshoot it) the server stops reading that client's requests until the queue drains below
  // it again; the client keeps its connection and leases. Positive.
  std::size_t max_client_buffer_bytes = 1 << 20;
  // A connection holding no lease that sends and receives nothing for this long is closed; so is one
  // that leaves replies unread this long, leases or not (a client that does not read its grant is
  // not copying from it). A lease holder with nothing queued is never closed for idleness: a rollout
  // keeps its lease while it copies. Positive, or kForever.
  Duration idle_timeout = std::chrono::seconds(60);
  // Time of idle_timeout (null: Clock::steady()).
  std::shared_ptr<Clock> clock;
  // Called on the server's thread; must not call back into the server.
  std::function<void(const LocalRelayEvent&)> on_event;
};

struct LocalRelayServerStats {
  std::size_t clients = 0;
  std::size_t leases = 0;            // held now, over all clients
  std::uint64_t grants = 0;          // leases ever granted
  std::uint64_t refused_clients = 0; // disconnected for a malformed request
  std::uint64_t idle_closed = 0;     // closed holding no lease after idle_timeout
  std::uint64_t stalled_closed = 0;  // closed after leaving replies unread for idle_timeout
  std::uint64_t evicted = 0;         // closed to make room for a new connection
  std::uint64_t refused_full = 0;    // new connections closed at once: every slot held a lease
  std::uint64_t read_pauses = 0;     // times a client's reads stopped because its replies filled its buffer
  std::size_t queued_bytes = 0;      // reply bytes waiting for their clients now, over all clients

  std::string to_json() const;
};

class LocalRelayServer {
 public:
  // Listens on `socket_path` and serves `store` on a thread of its own. A stale socket file (nothing
  // accepts on it) is replaced. kInvalidArgument for a null store, an empty path or one longer than
  // a socket address holds, zero limits or a non-positive idle_timeout; kFailedPrecondition for a
  // store that is not shareable; kAlreadyExists when a live server owns the path; kUnavailable when
  // the socket cannot be created or bound.
  static Result<std::unique_ptr<LocalRelayServer>> create(std::shared_ptr<RelayStore> store,
                                                          std::string socket_path,
                                                          LocalRelayServerOptions options = {});
  // Stops serving, drops every lease and removes the socket file.
  ~LocalRelayServer();
  LocalRelayServer(const LocalRelayServer&) = delete;
  LocalRelayServer& operator=(const LocalRelayServer&) = delete;

  const std::string& socket_path() const noexcept;
  LocalRelayServerStats stats() const;
  // The failure that stopped the server's thread (its socket could no longer be polled); OK while it
  // serves. A misbehaving client is not an error: it is disconnected and reported through on_event.
  Status background_error() const;

 private:
  struct Impl;
  explicit LocalRelayServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace laminar
