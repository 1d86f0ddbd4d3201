// relay_node_hooks.h (internal): the seams through which fault-injection tests (the laminar_testing
// library) make a RelayNode misbehave as a bad link or a wedged relay would. A node made by
// RelayNode::create has none.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "laminar/relay_node.h"

namespace laminar::internal {

struct RelayNodeHooks {
  // Before chunk i of v is put to a subscriber (after its checksum is taken): bytes to put in its
  // place, as a corrupting link would deliver them, or nullopt to send the chunk as it is.
  std::function<std::optional<std::vector<std::byte>>(Version v, std::uint32_t i, std::span<const std::byte> chunk)>
      replace_outgoing_chunk;
  // Before chunk i of v is put to a subscriber: runs (and may sleep) on the sender's thread, as a
  // slow link would hold each chunk back.
  std::function<void(Version v, std::uint32_t i)> before_outgoing_chunk;
  // When chunk i of v arrives from upstream, given how many chunks this node has stored so far: true
  // to neither store nor answer it (the node hangs for that chunk; it still serves what it has).
  std::function<bool(Version v, std::uint32_t i, std::uint64_t chunks_received)> ignore_incoming_chunk;
};

// RelayNode::create with hooks installed before any traffic flows.
Result<std::unique_ptr<RelayNode>> create_relay_node(std::shared_ptr<Transport> transport,
                                                     std::shared_ptr<RelayStore> store, RelayNodeOptions options,
                                                     RelayNodeHooks hooks);

}  // namespace laminar::internal
