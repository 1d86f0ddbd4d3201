#include "relay_node/testing.h"

#include <atomic>
#include <thread>

#include "relay_node_hooks.h"

namespace laminar::testing {

Result<std::unique_ptr<RelayNode>> create_faulty_relay_node(std::shared_ptr<Transport> transport,
                                                            std::shared_ptr<RelayStore> store,
                                                            RelayNodeOptions options, RelayNodeFaults faults) {
  internal::RelayNodeHooks hooks;
  if (faults.corrupt_chunk_once) {
    auto done = std::make_shared<std::atomic<bool>>(false);
    hooks.replace_outgoing_chunk = [target = *faults.corrupt_chunk_once, done](
                                       Version v, std::uint32_t i,
                                       std::span<const std::byte> chunk) -> std::optional<std::vector<std::byte>> {
      if (v != target.first || i != target.second || done->exchange(true)) return std::nullopt;
      std::vector<std::byte> bad(chunk.begin(), chunk.end());
      bad[bad.size() / 2] ^= std::byte{0x40};
      return bad;
    };
  }
  if (faults.stall_after_chunks != 0) {
    hooks.ignore_incoming_chunk = [n = faults.stall_after_chunks](Version, std::uint32_t, std::uint64_t received) {
      return received >= n;
    };
  }
  if (faults.delay_each_chunk.count() > 0) {
    hooks.before_outgoing_chunk = [d = faults.delay_each_chunk](Version, std::uint32_t) {
      std::this_thread::sleep_for(d);
    };
  }
  return internal::create_relay_node(std::move(transport), std::move(store), std::move(options), std::move(hooks));
}

}  // namespace laminar::testing
