// transport_claim.h: TransportClaim, at most one component of a kind per Transport.
//
// A component whose protocol handlers are registered per transport (a relay node, a queue server,
// a KV migrator, a repack coordinator or driver) claims its transport for as long as it serves on it: a second one
// of the same kind would replace the first one's handlers.
#pragma once

#include <string_view>

#include "laminar/status.h"
#include "laminar/transport.h"

namespace laminar::internal {

class TransportClaim {
 public:
  // kAlreadyExists naming `kind` when a component of that kind holds the transport. `kind` is a
  // literal: the claim keeps the view.
  static Result<TransportClaim> take(const Transport& transport, std::string_view kind);

  TransportClaim() = default;
  TransportClaim(TransportClaim&& other) noexcept;
  TransportClaim& operator=(TransportClaim&& other) noexcept;
  ~TransportClaim() { release(); }

  // Lets another component of the kind serve on the transport; idempotent.
  void release() noexcept;

 private:
  TransportClaim(const Transport* transport, std::string_view kind) : transport_(transport), kind_(kind) {}

  const Transport* transport_ = nullptr;
  std::string_view kind_;
};

}  // namespace laminar::internal
