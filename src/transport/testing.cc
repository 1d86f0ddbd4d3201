// Test hooks of the transport (testing.h), built into laminar_testing only. They reach the core
// through TransportTestingAccess, a friend the shipped library declares but never defines.
#include "transport/testing.h"

#include <fmt/format.h>

#include <future>
#include <memory>
#include <string>

#include "transport/core.h"

namespace laminar::internal {

class TransportTestingAccess {
 public:
  static Status send_raw_frame(const Endpoint& endpoint, std::vector<std::byte> wire,
                               std::optional<std::uint64_t> token) {
    const auto& state = TransportCore::state_of(endpoint);
    if (!state) return failed_precondition("send_raw_frame: empty Endpoint handle");
    TransportCore& core = *state->core;
    if (!token) return core.send_wire(state, std::move(wire), core.options().operation_timeout, "raw frame").get();
    std::promise<Status> sent;
    auto future = sent.get_future();
    const bool posted = core.post([&core, &state, &wire, &sent, token] {
      auto e = core.find(state->id);
      if (e == nullptr || e->phase != Phase::kReady) {
        sent.set_value(unavailable("send_raw_frame: endpoint is closed"));
        return;
      }
      Op& op = core.new_op(Op::Kind::kSend, e->id, core.options().operation_timeout, "raw frame");
      op.status_promise = std::move(sent);
      op.buffer = std::move(wire);
      op.header = *token;
      core.start_send(*e, op);
    });
    if (!posted) return cancelled("transport shut down");
    return future.get();
  }

  static Result<Endpoint> connect_ucx_only(Transport& from, Transport& to, std::uint64_t token) {
    TransportCore& core = TransportCore::of(from);
    const std::vector<std::byte> address = TransportCore::of(to).worker_address_;
    auto e = std::make_shared<EndpointState>(core.shared_from_this(), core.next_ep_id_++, "ucx-only peer");
    std::promise<Result<Endpoint>> opened;
    auto future = opened.get_future();
    const bool posted = core.post([&core, e, &address, token, &opened] {
      auto w = core.peer_worker(address);
      if (!w.ok()) {
        opened.set_value(w.status());
        return;
      }
      e->worker = *w;
      e->worker->endpoints.insert(e->id);
      e->peer_token = token;
      e->phase = Phase::kReady;  // the bootstrap connection and its handshake are skipped
      core.endpoints_.emplace(e->id, e);
      opened.set_value(TransportCore::make_endpoint(e));
    });
    if (!posted) return cancelled("transport shut down");
    return future.get();
  }
};

}  // namespace laminar::internal

namespace laminar::testing {

Status send_raw_frame(const Endpoint& endpoint, std::vector<std::byte> wire, std::optional<std::uint64_t> token) {
  return internal::TransportTestingAccess::send_raw_frame(endpoint, std::move(wire), token);
}

Result<Endpoint> connect_ucx_only(Transport& from, Transport& to, std::uint64_t token) {
  return internal::TransportTestingAccess::connect_ucx_only(from, to, token);
}

}  // namespace laminar::testing
