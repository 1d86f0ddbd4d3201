// relay_node.h: RelayNode, one relay of the chain that spreads weight versions across processes.
//
// A RelayNode serves a RelayStore over the process's Transport and, unless it is the head (the
// actor's node), feeds that store from an upstream relay. Downstream nodes subscribe; the upstream
// pushes each version to each subscriber chunk by chunk, and forwards a chunk as soon as its own
// store has verified it (read_chunk), so the chain is pipelined: reaching N relays costs about one
// transfer plus N chunk latencies. Every chunk travels with its xxh3 checksum; the receiver's
// put_chunk refuses a bad one (kDataLoss) and the sender resends it. When the upstream vanishes (or
// hangs: see below) the node subscribes to the next address of its list (the chain re-forms around
// the dead relay) and the new upstream sends only the chunks still missing (the transfer resumes).
// A node that joins late is sent the newest version. A rollout process runs a node on a transport
// that does not listen (a leaf: it only subscribes upstream) and a WeightPuller on its store.
//
// Hung peers. A relay that stops (SIGSTOP, a wedged process, a link that holds its connection but
// carries nothing) keeps its connections open, so it is judged by what it says, not by whether its
// socket answers. While an upstream sends, its begins and chunks speak for it; while it waits (for
// a newer version, or for a chunk from its own upstream) it sends an idle message every quarter of
// the subscriber's stall_timeout, but only while it is itself fed: it is the head, or it heard from
// its own upstream within its own stall_timeout. A subscriber that hears nothing from its upstream
// for stall_timeout closes the link and fails over as for a dead one. A relay waiting on a hung one
// above it goes quiet only when it fails over itself, so (as long as it finds a new upstream
// promptly) only the relay right below the hung one moves. The other way, a subscriber that leaves
// a begin, a chunk or an idle message unanswered (or not taken by the link) for the upstream's
// stall_timeout is dropped, so it holds no more than its own sender thread meanwhile.
//
// The node never makes a transport of its own: it installs its handlers (laminar's reserved
// message types) on the host's Transport, which the host makes listen if the node is to have
// subscribers, and removes them when destroyed.
//
// Threads: the handlers run on the transport's callback thread. The node runs one thread that
// subscribes upstream (connecting, waiting for the link to close, failing over) and one thread per
// subscriber that sends it versions. on_event is called from any of these; keep it short. A
// sender sleeps in the store (RelayStore::wait_for_newer, read_chunk) until a version or chunk
// arrives, its subscriber's next idle message falls due, its subscriber's link closes, or the node
// stops. Destruction ends those waits and closes the subscribers' links at once, whatever the
// store's clock does meanwhile.
//
//   std::shared_ptr<laminar::Transport> transport = laminar::Transport::create(to).value();
//   std::string me = transport->listen("10.0.0.3", 4000).value();   // give this to the next relay
//   std::shared_ptr<laminar::RelayStore> store = laminar::RelayStore::create().value();
//   laminar::RelayNodeOptions o;
//   o.upstreams = {"10.0.0.2:4000", "10.0.0.1:4000"};   // preferred first; fall back down the list
//   auto node = laminar::RelayNode::create(transport, store, o).value();
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "laminar/clock.h"
#include "laminar/relay_store.h"
#include "laminar/status.h"
#include "laminar/transport.h"

namespace laminar {

// Things a node reports as they happen (from the node's threads; keep the callback short).
struct RelayEvent {
  enum class Kind : std::uint8_t {
    kUpstream,             // subscribed to `upstream`
    kUpstreamLost,         // the connection to `upstream` broke
    kUpstreamUnreachable,  // connecting or subscribing to `upstream` failed; the next one is tried
    kCommitted,            // `version` is complete here
    kChunkStored,          // chunk `chunk` of `version` arrived from upstream and passed its check
    kChunkRejected,        // chunk `chunk` of `version` failed its check and will be resent
    kUpstreamStalled,      // nothing came from `upstream` for stall_timeout: dropped, the next one is tried
    kSubscriberStalled,    // `subscriber` left a message unanswered for stall_timeout and was dropped
  };
  Kind kind = Kind::kUpstream;
  Version version;
  std::uint32_t chunk = 0;
  std::string upstream;
  std::string subscriber;  // kSubscriberStalled: the subscriber's address
};

struct RelayNodeOptions {
  // Upstream relays in order of preference; empty for the head of the chain.
  std::vector<std::string> upstreams;
  // Chunks sent to each subscriber and not yet confirmed checked by it (the bytes of one chunk are
  // in flight at a time; see relay_node.cc).
  std::uint32_t window = 4;
  // How long a subscriber waits to connect before trying the next upstream.
  Duration connect_timeout = std::chrono::seconds(2);
  // After every upstream of the list failed to connect, the node waits this long before going
  // round again.
  Duration retry_interval = std::chrono::milliseconds(50);
  // How long a link may stay quiet before its peer counts as failed (positive, or kForever to
  // never judge by it); see Hung peers above. The upstream's silence is timed on `clock`; a
  // subscriber's unanswered messages are timed by the transport, on its clock. It measures progress,
  // not liveness: a slow link is not a failure as long as every chunk lands within it, so it must
  // exceed one chunk's transfer on the slowest link (chunk_bytes / bandwidth: 4 MiB at 10 MB/s is
  // 0.4 s) and a subscriber's setting up of a new version (allocating and registering its buffer).
  Duration stall_timeout = std::chrono::seconds(10);
  std::function<void(const RelayEvent&)> on_event;
  // Time of the node's own waits (null: Clock::steady()).
  std::shared_ptr<Clock> clock;
};

struct RelayNodeStats {
  std::uint64_t chunks_received = 0;      // stored from upstream
  std::uint64_t chunks_sent = 0;          // accepted by subscribers
  std::uint64_t chunks_resent = 0;        // refused by a subscriber and sent again
  std::uint64_t failovers = 0;            // upstream connections lost, stalled ones included
  std::uint64_t upstream_stalls = 0;      // upstreams dropped for staying quiet past stall_timeout
  std::uint64_t subscribers_stalled = 0;  // subscribers dropped for not answering within stall_timeout
  std::uint32_t subscribers = 0;

  std::string to_json() const;
};

namespace internal {
struct RelayNodeAccess;
}  // namespace internal

class RelayNode {
 public:
  // Installs the node's handlers on `transport` and, with upstreams, starts subscribing.
  // kInvalidArgument for a null transport or store, window 0, a non-positive connect_timeout or
  // stall_timeout, or a negative retry_interval; kAlreadyExists when another RelayNode already
  // serves on `transport`.
  static Result<std::unique_ptr<RelayNode>> create(std::shared_ptr<Transport> transport,
                                                   std::shared_ptr<RelayStore> store, RelayNodeOptions options = {});
  // Stops the node's threads and removes its handlers from the transport.
  ~RelayNode();
  RelayNode(const RelayNode&) = delete;
  RelayNode& operator=(const RelayNode&) = delete;

  // "host:port" subscribers connect to: the transport's listen address; none when the host did not
  // make the transport listen (a leaf).
  std::optional<std::string> address() const;
  // The upstream currently subscribed to, if any.
  std::optional<std::string> upstream() const;
  RelayNodeStats stats() const;
  // First error of background work that cannot be retried (e.g. a subscriber sent garbage); OK
  // otherwise. Lost peers are not errors: they are retried or dropped.
  Status background_error() const;

 private:
  friend struct internal::RelayNodeAccess;
  struct Impl;
  explicit RelayNode(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace laminar
