// relay_node/testing.h: fault injection for relay chain tests: a RelayNode that misbehaves as a bad
// link or a wedged relay would. Compiled into the laminar_testing library, which only tests link;
// the shipped laminar library holds none of it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>

#include "laminar/relay_node.h"

namespace laminar::testing {

struct RelayNodeFaults {
  // Corrupt the bytes of this chunk the first time it is sent downstream (after its checksum is
  // taken), as a bad link would.
  std::optional<std::pair<Version, std::uint32_t>> corrupt_chunk_once;
  // After storing this many chunks from upstream, store and answer no more (a relay that hangs
  // mid-broadcast; it still serves what it has). 0: never.
  std::uint64_t stall_after_chunks = 0;
  // Wait this long before sending each chunk downstream (a slow link that still delivers). 0: never.
  std::chrono::milliseconds delay_each_chunk{0};
};

// RelayNode::create, with `faults` in force from the start.
Result<std::unique_ptr<RelayNode>> create_faulty_relay_node(std::shared_ptr<Transport> transport,
                                                            std::shared_ptr<RelayStore> store,
                                                            RelayNodeOptions options, RelayNodeFaults faults);

}  // namespace laminar::testing
