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
  static Result<Endpoint> connect_without_handshake(Transport& transport, std::string_view address) {
    TransportCore& core = TransportCore::of(transport);
    auto ss = parse_address(address);
    if (!ss.ok()) return ss.status();
    auto e = std::make_shared<EndpointState>(core.shared_from_this(), core.next_ep_id_++, std::string(address));
    std::promise<Result<Endpoint>> opened;
    auto future = opened.get_future();
    const bool posted = core.post([&core, e, addr = *ss, &opened] {
      if (Status st = core.open_client_endpoint(*e, addr); !st.ok()) {
        opened.set_value(st);
        return;
      }
      e->phase = Phase::kReady;  // the hello, challenge and proof are skipped
      opened.set_value(TransportCore::make_endpoint(e));
    });
    if (!posted) return cancelled("transport shut down");
    return future.get();
  }
};

}  // namespace laminar::internal

namespace laminar::testing {

Status send_raw_frame(const Endpoint& endpoint, std::vector<std::byte> wire) {
  const auto& state = internal::TransportCore::state_of(endpoint);
  if (!state) return failed_precondition("send_raw_frame: empty Endpoint handle");
  return state->core->send_wire(state, std::move(wire), state->core->options().operation_timeout, "raw frame")
      .get();
}

Result<Endpoint> connect_without_handshake(Transport& transport, std::string_view address) {
  return internal::TransportTestingAccess::connect_without_handshake(transport, address);
}

}  // namespace laminar::testing
