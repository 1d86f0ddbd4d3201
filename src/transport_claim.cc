#include "transport_claim.h"

#include <fmt/format.h>

#include <mutex>
#include <set>
#include <utility>

namespace laminar::internal {
namespace {

std::mutex g_claims_mu;
std::set<std::pair<const Transport*, std::string_view>> g_claims;

}  // namespace

Result<TransportClaim> TransportClaim::take(const Transport& transport, std::string_view kind) {
  std::lock_guard lock(g_claims_mu);
  if (!g_claims.emplace(&transport, kind).second) {
    return already_exists(fmt::format("{}: another {} already serves on this transport", kind, kind));
  }
  return TransportClaim(&transport, kind);
}

TransportClaim::TransportClaim(TransportClaim&& other) noexcept
    : transport_(std::exchange(other.transport_, nullptr)), kind_(other.kind_) {}

TransportClaim& TransportClaim::operator=(TransportClaim&& other) noexcept {
  if (this != &other) {
    release();
    transport_ = std::exchange(other.transport_, nullptr);
    kind_ = other.kind_;
  }
  return *this;
}

void TransportClaim::release() noexcept {
  if (transport_ == nullptr) return;
  std::lock_guard lock(g_claims_mu);
  g_claims.erase(std::pair(transport_, kind_));
  transport_ = nullptr;
}

}  // namespace laminar::internal
