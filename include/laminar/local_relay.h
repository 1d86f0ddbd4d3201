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
// on_event; the calls below may come from any thread.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "laminar/relay_store.h"
#include "laminar/status.h"
#include "laminar/types.h"

namespace laminar {

struct LocalRelayEvent {
  enum class Kind : std::uint8_t {
    kGranted,   // a client took a lease on `version`
    kReleased,  // a lease ended: released, or the client's connection closed (`disconnected`)
    kRefused,   // a client sent something malformed and was disconnected (`detail` says what)
  };
  Kind kind = Kind::kGranted;
  Version version;
  pid_t client_pid = 0;  // from SO_PEERCRED
  bool disconnected = false;
  std::string detail;
};

struct LocalRelayServerOptions {
  // Connections served at once; more are closed at once.
  std::size_t max_clients = 64;
  // Leases one connection may hold; past this an acquire is refused with kResourceExhausted.
  std::size_t max_leases_per_client = 16;
  // Called on the server's thread; must not call back into the server.
  std::function<void(const LocalRelayEvent&)> on_event;
};

struct LocalRelayServerStats {
  std::size_t clients = 0;
  std::size_t leases = 0;            // held now, over all clients
  std::uint64_t grants = 0;          // leases ever granted
  std::uint64_t refused_clients = 0; // disconnected for a malformed request

  std::string to_json() const;
};

class LocalRelayServer {
 public:
  // Listens on `socket_path` and serves `store` on a thread of its own. A stale socket file (nothing
  // accepts on it) is replaced. kInvalidArgument for a null store, an empty path or one longer than
  // a socket address holds, or zero limits; kFailedPrecondition for a store that is not shareable; kAlreadyExists when a live server owns the path;
  // kUnavailable when the socket cannot be created or bound.
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
