// relay_server: runs one node of laminar's relay chain (or the actor at its head, or a rollout
// that pulls from it), printing what happens one line at a time so a script or test can follow.
//
//   relay_server --token T --actor --mib 64 --versions 3          # head: publishes v1..v3
//   relay_server --token T --upstream 127.0.0.1:4000              # a relay below it
//   relay_server --token T --pull --mib 64 --upstream 127.0.0.1:4001 --upstream 127.0.0.1:4000
//   relay_server --token T --actor --mib 64 --shm /tmp/relay0.sock     # also serves same-host pullers
//   relay_server --pull --mib 64 --local /tmp/relay0.sock --local /tmp/relay1.sock   # such a puller
//
// Lines: "listening ADDR", "published V DIGEST", "committed V DIGEST", "pulled V ok|MISMATCH ...",
// "upstream ADDR", "lost ADDR", "unreachable ADDR" (connecting failed), "stalled ADDR" (the upstream
// said nothing for --stall-timeout-ms), "dropped ADDR" (a subscriber left a message unanswered that
// long), "rejected V CHUNK", with --report-chunks "stored V CHUNK" for every chunk stored from
// upstream, and at exit "stats received N sent N resent N stalled N dropped N failovers N" (chunks
// stored from upstream, accepted by subscribers, resent after a refusal; upstreams and subscribers
// given up as stalled; upstreams lost, stalled ones included). DIGEST is the xxh3 of the
// version's whole buffer, so every process's bytes can be compared with the actor's. Ends on
// SIGTERM / SIGINT, or after --exit-after-version V is committed (relays) or pulled (rollouts).
//
// The process makes one Transport, listens on it, and hosts its RelayNode on it. Run with --help
// for every option.
//
// With --shm PATH a LocalRelayServer serves the store on that socket too, printing "serving PATH",
// "lease V PID", "released V PID HOW held N" (HOW: released or disconnected; N: versions the store
// holds afterwards), "refused PID WHY" (a malformed request) and "closed PID WHY" (idle, evicted or
// turned away; --shm-idle-timeout-ms, --shm-max-clients and --shm-client-buffer-bytes set the
// limits). An actor given --publish-on-usr1 publishes one more version on every SIGUSR1. A --local
// puller (no UCX, no --token needed) prints "pulled V ok|..." and "relay PATH" for the relay it read
// from; with --hold it instead prefetches the newest version, prints "holding V" and keeps the lease
// until it is stopped.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <CLI/CLI.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "laminar/local_relay.h"
#include "laminar/relay_node.h"
#include "laminar/transport.h"
#include "laminar/weight_puller.h"

// How this program makes its relay node: RelayNode::create. The relay chain tests build it again
// as relay_server_faults with LAMINAR_RELAY_SERVER_FAULTS defined, and link the definitions of
// these from tests/relay_server_faults.cc: options that make the node misbehave on purpose (a
// corrupt chunk, a hang, a slow link). That file reaches laminar's test-only library; this one
// uses laminar's public API alone.
#ifdef LAMINAR_RELAY_SERVER_FAULTS
void add_fault_options(CLI::App& app);
bool parse_fault_options();  // false after printing why the options are wrong
laminar::Result<std::unique_ptr<laminar::RelayNode>> create_relay_node(std::shared_ptr<laminar::Transport> transport,
                                                                       std::shared_ptr<laminar::RelayStore> store,
                                                                       laminar::RelayNodeOptions options);
#else
laminar::Result<std::unique_ptr<laminar::RelayNode>> create_relay_node(std::shared_ptr<laminar::Transport> transport,
                                                                       std::shared_ptr<laminar::RelayStore> store,
                                                                       laminar::RelayNodeOptions options) {
  return laminar::RelayNode::create(std::move(transport), std::move(store), std::move(options));
}
#endif

namespace {

std::atomic<bool> g_stop{false};
std::atomic<bool> g_publish{false};
std::mutex g_out;

void say(const std::string& line) {
  std::lock_guard lock(g_out);
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The workload: 8 f32 tensors sharing `mib` MiB plus a small odd one (so padding exists), each
// element a function of (seed, version, tensor, index).
laminar::WeightManifest make_manifest(std::size_t mib) {
  laminar::WeightManifest m;
  const std::int64_t rows = std::max<std::int64_t>(1, std::int64_t(mib) * (1 << 20) / 8 / 4 / 1024);
  for (int i = 0; i < 8; ++i) {
    if (!m.add("layer" + std::to_string(i) + ".w", laminar::DType::kF32, {rows, 1024}).ok()) std::abort();
  }
  if (!m.add("norm.b", laminar::DType::kF32, {37}).ok()) std::abort();
  return m;
}

std::uint64_t element(std::uint64_t seed, std::uint64_t version, std::size_t tensor, std::size_t i) {
  return mix(seed ^ mix(version * 1000003 + tensor) ^ i);
}

void fill(std::vector<std::vector<std::uint32_t>>& t, std::uint64_t seed, std::uint64_t version) {
  for (std::size_t k = 0; k < t.size(); ++k) {
    for (std::size_t i = 0; i < t[k].size(); ++i) t[k][i] = std::uint32_t(element(seed, version, k, i));
  }
}

struct Buffers {
  std::vector<std::vector<std::uint32_t>> data;
  std::vector<laminar::TensorView> views;
  std::vector<laminar::NamedTensor> named;
  explicit Buffers(const laminar::WeightManifest& m) {
    for (const auto& e : m.entries()) data.emplace_back(e.nbytes / 4);
    for (std::size_t k = 0; k < data.size(); ++k) {
      const auto& e = m.entries()[k];
      views.push_back(laminar::TensorView::contiguous(data[k].data(), e.dtype, e.shape).value());
    }
    for (std::size_t k = 0; k < data.size(); ++k) named.push_back({m.entries()[k].name, views[k]});
  }
};

std::string digest(const laminar::ReadHandle& h) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016llx",
                static_cast<unsigned long long>(XXH3_64bits(h.bytes().data(), h.bytes().size())));
  return buf;
}

// "ok", or where the pulled bytes first differ from (seed, version).
std::string check_pulled(const Buffers& b, std::uint64_t seed, std::uint64_t version) {
  for (std::size_t k = 0; k < b.data.size(); ++k) {
    for (std::size_t i = 0; i < b.data[k].size(); ++i) {
      if (b.data[k][i] != std::uint32_t(element(seed, version, k, i))) {
        return "MISMATCH tensor " + std::to_string(k) + " element " + std::to_string(i);
      }
    }
  }
  return "ok";
}

// A rollout on the same host as its relays, reading them through shared memory.
int run_local_puller(std::vector<std::string> paths, std::size_t mib, std::uint64_t seed, std::uint64_t exit_after,
                     bool hold) {
  laminar::WeightPullerOptions po;
  if (hold) po.policy = laminar::PullPolicy::kPrefetchThenSwap;
  auto puller = laminar::WeightPuller::create_local(std::move(paths), po);
  if (!puller.ok()) {
    std::fprintf(stderr, "relay_server: %s\n", puller.status().to_string().c_str());
    return 1;
  }
  const laminar::WeightManifest manifest = make_manifest(mib);
  Buffers engine(manifest);
  bool held = false;
  while (!g_stop) {
    const std::optional<laminar::Version> latest = (*puller)->newest_version();
    if (hold && !held && latest) {
      laminar::Status st = (*puller)->prefetch(*latest);
      if (!st.ok()) {
        say("prefetch " + std::to_string(latest->value()) + " failed: " + st.to_string());
        return 1;
      }
      held = true;
      say("holding " + std::to_string(latest->value()));
    }
    if (!hold && latest && (!(*puller)->current_version() || *(*puller)->current_version() < *latest)) {
      laminar::Status st = (*puller)->pull(*latest, engine.named, false);
      if (!st.ok()) {
        say("pull " + std::to_string(latest->value()) + " failed: " + st.to_string());
      } else {
        say("relay " + (*puller)->relay());
        say("pulled " + std::to_string(latest->value()) + " " + check_pulled(engine, seed, latest->value()));
        if (exit_after != 0 && latest->value() >= exit_after) break;
      }
      continue;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return 0;
}

int fail(const std::string& what, const laminar::Status& st) {
  std::fprintf(stderr, "relay_server: %s: %s\n", what.c_str(), st.to_string().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"One node of laminar's relay chain: the actor at its head, a relay, or a rollout that pulls."};
  std::string token;
  std::uint16_t port = 0;
  std::vector<std::string> upstreams, local;
  std::string shm;
  bool actor = false, pull = false, hold = false, publish_on_usr1 = false, report_chunks = false;
  std::size_t mib = 16;
  std::uint64_t chunk_kib = 0, versions = 1, interval_ms = 0, seed = 1, exit_after = 0, stall_timeout_ms = 10'000;
  app.add_option("--token", token, "cluster token shared by every peer (not needed with --local)");
  app.add_option("--port", port, "port to listen on (0: any free one)");
  app.add_option("--upstream", upstreams, "upstream relay host:port, preferred first; repeat to list fallbacks");
  app.add_option("--stall-timeout-ms", stall_timeout_ms,
                 "a relay link quiet this long counts as failed: fail over from the upstream, drop the subscriber")
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{86'400'000}));
  app.add_flag("--actor", actor, "head of the chain: publishes --versions versions");
  app.add_option("--versions", versions, "versions the actor publishes");
  app.add_option("--interval-ms", interval_ms, "pause between the actor's versions");
  app.add_flag("--publish-on-usr1", publish_on_usr1, "the actor publishes one more version on every SIGUSR1");
  app.add_flag("--pull", pull, "a rollout: pulls every new version into engine buffers and checks it");
  app.add_option("--local", local, "pull from the local relay serving this socket instead (repeatable)");
  app.add_flag("--hold", hold, "with --local: prefetch the newest version and hold its lease");
  app.add_option("--shm", shm, "also serve same-host pullers on this Unix socket");
  laminar::LocalRelayServerOptions lo;
  std::uint64_t shm_idle_ms = std::chrono::duration_cast<std::chrono::milliseconds>(lo.idle_timeout).count();
  app.add_option("--shm-idle-timeout-ms", shm_idle_ms, "with --shm: close a connection idle this long (0: never)")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t(0), std::uint64_t(365) * 24 * 3600 * 1000));
  app.add_option("--shm-max-clients", lo.max_clients, "with --shm: connections served at once")->capture_default_str();
  app.add_option("--shm-client-buffer-bytes", lo.max_client_buffer_bytes,
                 "with --shm: reply bytes queued per client before its requests wait")
      ->capture_default_str();
  app.add_option("--mib", mib, "MiB of weights per version");
  app.add_option("--chunk-kib", chunk_kib, "chunk size of published versions (default: the store's)");
  app.add_option("--seed", seed, "seed of the weights' contents");
  app.add_option("--exit-after-version", exit_after, "exit once this version is committed or pulled");
  app.add_flag("--report-chunks", report_chunks, "print a line for every chunk stored from upstream");
#ifdef LAMINAR_RELAY_SERVER_FAULTS
  add_fault_options(app);
#endif
  CLI11_PARSE(app, argc, argv);
#ifdef LAMINAR_RELAY_SERVER_FAULTS
  if (!parse_fault_options()) return 2;
#endif

  std::signal(SIGTERM, [](int) { g_stop = true; });
  std::signal(SIGINT, [](int) { g_stop = true; });
  std::signal(SIGUSR1, [](int) { g_publish = true; });
  if (!local.empty()) {
    if (!pull || actor || !upstreams.empty() || !shm.empty()) {
      std::fprintf(stderr, "relay_server: --local goes with --pull only\n");
      return 2;
    }
    return run_local_puller(local, mib, seed, exit_after, hold);
  }
  if (actor == !upstreams.empty()) {
    std::fprintf(stderr, "relay_server: give --actor or at least one --upstream, not both\n");
    return 2;
  }
  laminar::RelayStoreOptions so;
  if (chunk_kib != 0) so.chunk_bytes = chunk_kib << 10;
  so.shareable = !shm.empty();
  auto created = laminar::RelayStore::create(so);
  if (!created.ok()) return fail("store", created.status());
  std::shared_ptr<laminar::RelayStore> store = std::move(*created);

  laminar::TransportOptions to;
  to.cluster_token = token;
  to.max_inbox_bytes = 0;  // only laminar's handlers run here: nothing waits for receive()
  auto transport = laminar::Transport::create(to);
  if (!transport.ok()) return fail("transport", transport.status());
  std::shared_ptr<laminar::Transport> shared_transport = std::move(*transport);
  auto listened = shared_transport->listen("127.0.0.1", port);
  if (!listened.ok()) return fail("listen", listened.status());
  // Said before the node starts, so that its events (an upstream reached, say) follow this line.
  say("listening " + *listened);

  std::atomic<std::uint64_t> committed{0};
  laminar::RelayNodeOptions o;
  o.upstreams = upstreams;
  o.stall_timeout = std::chrono::milliseconds(stall_timeout_ms);
  o.on_event = [&](const laminar::RelayEvent& e) {
    using K = laminar::RelayEvent::Kind;
    switch (e.kind) {
      case K::kUpstream: say("upstream " + e.upstream); break;
      case K::kUpstreamLost: say("lost " + e.upstream); break;
      case K::kUpstreamStalled: say("stalled " + e.upstream); break;
      case K::kSubscriberStalled: say("dropped " + e.subscriber); break;
      case K::kUpstreamUnreachable: say("unreachable " + e.upstream); break;
      case K::kChunkStored:
        if (report_chunks) say("stored " + std::to_string(e.version.value()) + " " + std::to_string(e.chunk));
        break;
      case K::kChunkRejected:
        say("rejected " + std::to_string(e.version.value()) + " " + std::to_string(e.chunk));
        break;
      case K::kCommitted: {
        auto h = store->acquire(e.version);
        if (h.ok() && !pull) say("committed " + std::to_string(e.version.value()) + " " + digest(*h));
        committed = e.version.value();
        break;
      }
    }
  };
  auto node = create_relay_node(shared_transport, store, o);
  if (!node.ok()) return fail("relay node", node.status());

  std::unique_ptr<laminar::LocalRelayServer> local_server;
  if (!shm.empty()) {
    lo.idle_timeout = shm_idle_ms == 0 ? laminar::kForever : laminar::Duration(std::chrono::milliseconds(shm_idle_ms));
    lo.on_event = [&](const laminar::LocalRelayEvent& e) {
      using K = laminar::LocalRelayEvent::Kind;
      const std::string pid = std::to_string(e.client_pid);
      switch (e.kind) {
        case K::kGranted: say("lease " + std::to_string(e.version.value()) + " " + pid); break;
        case K::kReleased:
          say("released " + std::to_string(e.version.value()) + " " + pid +
              (e.disconnected ? " disconnected" : " released") + " held " +
              std::to_string(store->stats().versions_held));
          break;
        case K::kRefused: say("refused " + pid + " " + e.detail); break;
        case K::kClosed: say("closed " + pid + " " + e.detail); break;
      }
    };
    auto server = laminar::LocalRelayServer::create(store, shm, lo);
    if (!server.ok()) return fail("local relay server", server.status());
    local_server = std::move(*server);
    say("serving " + shm);
  }

  const laminar::WeightManifest manifest = make_manifest(mib);
  std::unique_ptr<Buffers> weights;
  std::uint64_t published = 0;
  const auto publish_next = [&]() -> bool {
    const std::uint64_t v = ++published;
    fill(weights->data, seed, v);
    laminar::Status st = store->publish(laminar::Version(v), manifest, weights->named);
    if (st.ok()) st = store->wait_for_version(laminar::Version(v), std::chrono::seconds(60));
    if (!st.ok()) {
      std::fprintf(stderr, "relay_server: publish %llu: %s\n", static_cast<unsigned long long>(v),
                   st.to_string().c_str());
      return false;
    }
    say("published " + std::to_string(v) + " " + digest(store->acquire(laminar::Version(v)).value()));
    committed = v;
    return true;
  };
  if (actor) {
    weights = std::make_unique<Buffers>(manifest);
    for (std::uint64_t v = 1; v <= versions && !g_stop; ++v) {
      if (!publish_next()) return 1;
      std::this_thread::sleep_for(std::chrono::milliseconds(interval_ms));
    }
  }

  std::unique_ptr<laminar::WeightPuller> puller;
  std::unique_ptr<Buffers> engine;
  if (pull) {
    puller = laminar::WeightPuller::create(store).value();
    engine = std::make_unique<Buffers>(manifest);
  }
  while (!g_stop) {
    if (actor && publish_on_usr1 && g_publish.exchange(false)) {
      if (!publish_next()) return 1;
      continue;
    }
    if (pull) {
      auto d = puller->next_action(/*has_live_trajectory=*/false);
      if (d.action == laminar::PullAction::kPull) {
        laminar::Status st = puller->pull(d.version, engine->named, false);
        if (!st.ok()) {
          say("pull " + std::to_string(d.version.value()) + " failed: " + st.to_string());
        } else {
          say("pulled " + std::to_string(d.version.value()) + " " + check_pulled(*engine, seed, d.version.value()));
          if (exit_after != 0 && d.version.value() >= exit_after) break;
        }
        continue;
      }
    } else if (exit_after != 0 && committed.load() >= exit_after) {
      break;
    }
    // Signals only set flags; look at them again shortly.
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const laminar::RelayNodeStats st = (*node)->stats();
  say("stats received " + std::to_string(st.chunks_received) + " sent " + std::to_string(st.chunks_sent) +
      " resent " + std::to_string(st.chunks_resent) + " stalled " + std::to_string(st.upstream_stalls) + " dropped " +
      std::to_string(st.subscribers_stalled) + " failovers " + std::to_string(st.failovers));
  return 0;
}
