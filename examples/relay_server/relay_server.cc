// relay_server: runs one node of laminar's relay chain (or the actor at its head, or a rollout
// that pulls from it), printing what happens one line at a time so a script or test can follow.
//
//   relay_server --token T --actor --mib 64 --versions 3          # head: publishes v1..v3
//   relay_server --token T --upstream 127.0.0.1:4000              # a relay below it
//   relay_server --token T --pull --mib 64 --upstream 127.0.0.1:4001 --upstream 127.0.0.1:4000
//
// Lines: "listening ADDR", "published V DIGEST", "committed V DIGEST", "pulled V ok|MISMATCH ...",
// "upstream ADDR", "lost ADDR", "rejected V CHUNK", and at exit "stats received N sent N resent N
// failovers N" (chunks stored from upstream, accepted by subscribers, resent after a refusal). DIGEST is the xxh3 of the version's whole
// buffer, so every process's bytes can be compared with the actor's. Ends on SIGTERM / SIGINT, or
// after --exit-after-version V is committed (relays) or pulled (rollouts).
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "laminar/relay_chain.h"
#include "laminar/weight_puller.h"

namespace {

std::atomic<bool> g_stop{false};
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

int usage() {
  std::fprintf(stderr,
               "usage: relay_server --token T [--port P] [--upstream ADDR]... [--chunk-kib K]\n"
               "  [--actor --versions N --interval-ms T] [--pull] [--mib M] [--seed S]\n"
               "  [--exit-after-version V] [--corrupt V:CHUNK] [--stall-after CHUNKS]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  laminar::RelayChainOptions o;
  laminar::RelayStoreOptions so;
  bool actor = false, pull = false;
  std::size_t mib = 16;
  std::uint64_t versions = 1, interval_ms = 0, seed = 1, exit_after = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    const char* v = nullptr;
    if (a == "--actor") actor = true;
    else if (a == "--pull") pull = true;
    else if ((a == "--token") && (v = next())) o.transport.cluster_token = v;
    else if ((a == "--port") && (v = next())) o.listen_port = std::uint16_t(std::atoi(v));
    else if ((a == "--upstream") && (v = next())) o.upstreams.push_back(v);
    else if ((a == "--chunk-kib") && (v = next())) so.chunk_bytes = std::strtoull(v, nullptr, 10) << 10;
    else if ((a == "--mib") && (v = next())) mib = std::strtoull(v, nullptr, 10);
    else if ((a == "--versions") && (v = next())) versions = std::strtoull(v, nullptr, 10);
    else if ((a == "--interval-ms") && (v = next())) interval_ms = std::strtoull(v, nullptr, 10);
    else if ((a == "--seed") && (v = next())) seed = std::strtoull(v, nullptr, 10);
    else if ((a == "--exit-after-version") && (v = next())) exit_after = std::strtoull(v, nullptr, 10);
    else if ((a == "--stall-after") && (v = next())) o.stall_after_chunks = std::strtoull(v, nullptr, 10);
    else if ((a == "--corrupt") && (v = next())) {
      unsigned long long ver = 0, chunk = 0;
      if (std::sscanf(v, "%llu:%llu", &ver, &chunk) != 2) return usage();
      o.corrupt_chunk_once = std::pair{laminar::Version(ver), std::uint32_t(chunk)};
    } else {
      return usage();
    }
  }
  if (actor == !o.upstreams.empty()) {
    std::fprintf(stderr, "relay_server: give --actor or at least one --upstream, not both\n");
    return usage();
  }
  std::signal(SIGTERM, [](int) { g_stop = true; });
  std::signal(SIGINT, [](int) { g_stop = true; });

  auto store = laminar::RelayStore::create(so);
  if (!store.ok()) {
    std::fprintf(stderr, "relay_server: %s\n", store.status().to_string().c_str());
    return 1;
  }
  std::atomic<std::uint64_t> committed{0};
  o.on_event = [&](const laminar::RelayEvent& e) {
    using K = laminar::RelayEvent::Kind;
    switch (e.kind) {
      case K::kUpstream: say("upstream " + e.upstream); break;
      case K::kUpstreamLost: say("lost " + e.upstream); break;
      case K::kChunkRejected:
        say("rejected " + std::to_string(e.version.value()) + " " + std::to_string(e.chunk));
        break;
      case K::kCommitted: {
        auto h = (*store)->acquire(e.version);
        if (h.ok() && !pull) say("committed " + std::to_string(e.version.value()) + " " + digest(*h));
        committed = e.version.value();
        break;
      }
    }
  };
  auto node = laminar::RelayNode::start(*store, o);
  if (!node.ok()) {
    std::fprintf(stderr, "relay_server: %s\n", node.status().to_string().c_str());
    return 1;
  }
  say("listening " + (*node)->address());

  const laminar::WeightManifest manifest = make_manifest(mib);
  if (actor) {
    Buffers w(manifest);
    for (std::uint64_t v = 1; v <= versions && !g_stop; ++v) {
      fill(w.data, seed, v);
      laminar::Status st = (*store)->publish(laminar::Version(v), manifest, w.named);
      if (st.ok()) st = (*store)->wait_for_version(laminar::Version(v), std::chrono::seconds(60));
      if (!st.ok()) {
        std::fprintf(stderr, "relay_server: publish %llu: %s\n", static_cast<unsigned long long>(v),
                     st.to_string().c_str());
        return 1;
      }
      say("published " + std::to_string(v) + " " + digest((*store)->acquire(laminar::Version(v)).value()));
      committed = v;
      std::this_thread::sleep_for(std::chrono::milliseconds(interval_ms));
    }
  }

  std::unique_ptr<laminar::WeightPuller> puller;
  std::unique_ptr<Buffers> engine;
  if (pull) {
    puller = laminar::WeightPuller::create(*store).value();
    engine = std::make_unique<Buffers>(manifest);
  }
  while (!g_stop) {
    if (pull) {
      auto d = puller->next_action(/*has_live_trajectory=*/false);
      if (d.action == laminar::PullAction::kPull) {
        laminar::Status st = puller->pull(d.version, engine->named, false);
        if (!st.ok()) {
          say("pull " + std::to_string(d.version.value()) + " failed: " + st.to_string());
        } else {
          std::string verdict = "ok";
          for (std::size_t k = 0; k < engine->data.size() && verdict == "ok"; ++k) {
            for (std::size_t i = 0; i < engine->data[k].size(); ++i) {
              if (engine->data[k][i] != std::uint32_t(element(seed, d.version.value(), k, i))) {
                verdict = "MISMATCH tensor " + std::to_string(k) + " element " + std::to_string(i);
                break;
              }
            }
          }
          say("pulled " + std::to_string(d.version.value()) + " " + verdict);
          if (exit_after != 0 && d.version.value() >= exit_after) break;
        }
        continue;
      }
    } else if (exit_after != 0 && committed.load() >= exit_after) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const laminar::RelayNodeStats st = (*node)->stats();
  say("stats received " + std::to_string(st.chunks_received) + " sent " + std::to_string(st.chunks_sent) +
      " resent " + std::to_string(st.chunks_resent) + " failovers " + std::to_string(st.failovers));
  return 0;
}
