// relay_node.h: RelayNode, one relay of the chain that spreads weight versions across processes.
//
// A RelayNode serves a RelayStore over laminar's transport and, unless it is the head (the actor's
// node), feeds that store from an upstream relay. Downstream nodes subscribe; the upstream pushes
// each version to each subscriber chunk by chunk, and forwards a chunk as soon as its own store
// has verified it (read_chunk), so the chain is pipelined: reaching N relays costs about one
// transfer plus N chunk latencies. Every chunk travels with its xxh3 checksum; the receiver's
// put_chunk refuses a bad one (kDataLoss) and the sender resends it. When the upstream vanishes the
// node subscribes to the next address of its list (the chain re-forms around the dead relay) and
// the new upstream sends only the chunks still missing (the transfer resumes). A node that joins
// late is sent the newest version. A rollout process runs a node with no subscribers of its own
// and a WeightPuller on its store.
//
//   auto store = laminar::RelayStore::create({}).value();
//   laminar::RelayChainOptions o;
//   o.transport.cluster_token = token;
//   o.upstreams = {"10.0.0.2:4000", "10.0.0.1:4000"};   // preferred first; fall back down the list
//   auto node = laminar::RelayNode::start(store, o).value();
//   std::string me = node->address();                    // give this to the next relay
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "laminar/relay_store.h"
#include "laminar/status.h"
#include "laminar/transport.h"

namespace laminar {

// Things a node reports as they happen (from its transport's threads; keep the callback short).
struct RelayEvent {
  enum class Kind : std::uint8_t {
    kUpstream,        // subscribed to `upstream`
    kUpstreamLost,    // the connection to `upstream` broke
    kCommitted,       // `version` is complete here
    kChunkRejected,   // chunk `chunk` of `version` failed its check and will be resent
  };
  Kind kind = Kind::kUpstream;
  Version version;
  std::uint32_t chunk = 0;
  std::string upstream;
};

struct RelayChainOptions {
  TransportOptions transport;
  // Where downstream nodes reach this one.
  std::string listen_host = "127.0.0.1";
  std::uint16_t listen_port = 0;
  // Upstream relays in order of preference; empty for the head of the chain.
  std::vector<std::string> upstreams;
  // Chunks sent to each subscriber and not yet confirmed checked by it (the bytes of one chunk are
  // in flight at a time; see relay_node.cc).
  std::uint32_t window = 4;
  // How long a subscriber waits to connect before trying the next upstream.
  std::chrono::milliseconds connect_timeout{2000};
  std::function<void(const RelayEvent&)> on_event;

  // Fault injection for tests: corrupt the bytes of this chunk the first time it is sent
  // downstream (after its checksum is taken), as a bad link would.
  std::optional<std::pair<Version, std::uint32_t>> corrupt_chunk_once;
  // Fault injection for tests: after storing this many chunks from upstream, store and answer no
  // more (a relay that hangs mid-broadcast; it still serves what it has). 0 = never.
  std::uint64_t stall_after_chunks = 0;
};

struct RelayNodeStats {
  std::uint64_t chunks_received = 0;  // stored from upstream
  std::uint64_t chunks_sent = 0;      // accepted by subscribers
  std::uint64_t chunks_resent = 0;    // refused by a subscriber and sent again
  std::uint64_t failovers = 0;        // upstream connections lost
  std::uint32_t subscribers = 0;
};

class RelayNode {
 public:
  // kInvalidArgument for a null store or window 0; transport errors (bad token, cannot listen) as
  // Transport::create / listen report them.
  static Result<std::unique_ptr<RelayNode>> start(std::shared_ptr<RelayStore> store, RelayChainOptions options);
  ~RelayNode();
  RelayNode(const RelayNode&) = delete;
  RelayNode& operator=(const RelayNode&) = delete;

  // "host:port" subscribers connect to.
  const std::string& address() const noexcept { return address_; }
  // The upstream currently subscribed to, if any.
  std::optional<std::string> upstream() const;
  RelayNodeStats stats() const;
  // First error of background work that cannot be retried (e.g. a subscriber sent garbage); OK
  // otherwise. Lost peers are not errors: they are retried or dropped.
  Status error() const;

 private:
  struct Impl;
  explicit RelayNode(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  std::string address_;
};

}  // namespace laminar
