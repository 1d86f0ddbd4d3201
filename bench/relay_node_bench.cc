// relay_node_bench: the relay tier against plain memory copies of the same bytes, in the same run.
//   relay_publish_stall: time publish() keeps the actor (copy out of its memory; hashing and commit
//     happen behind it) vs memcpy of the weight set into an already-touched buffer of the store's
//     own kind (anonymous mapping, transparent huge pages), so both copy into the same memory.
//   relay_pull_host_cross_process: WeightPuller::pull (create_local) from a relay in another process
//     on this host, through its LocalRelayServer and shared memory, into host destinations, vs
//     memcpy of the same bytes into the same kind of tensors. Each pull pays the whole path:
//     request, grant, mapping, copy, unmapping and release.
//   relay_star_4_relays / relay_chain_4_relays: time from the head's publish until the last of 4
//     relays has committed the version, the head sending to each relay itself (star) or down a
//     pipelined chain, vs the same version sent over one link to one relay. The head and each relay
//     are RelayNodes in processes of their own (this binary re-executed as `relay_node_bench head ...` /
//     `relay_node_bench relay UPSTREAM HOST`). Twice: `_same_host` (same-host copies; five processes on
//     this machine's cores, so CPU-bound, reported) and, the headline and last line, `_Mbit_links`:
//     every process in its own network namespace on a bridge, each behind a link limited to
//     --link-mbit each way (tc tbf, UCX over tcp), the regime of a cluster where the network, not
//     the copies, bounds a transfer. Needs root; without it that pair is left out (said on stderr).
// Usage: relay_node_bench [--mib N] [--chain-mib N] [--net-mib N] [--link-mbit M] [--chunk-kib K]
//   (defaults 1024, 64, 128, 1000, 4096; --help)
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cli.h"
#include "harness.h"
#include "laminar/local_relay.h"
#include "laminar/relay_node.h"
#include "laminar/relay_store.h"
#include "laminar/weight_puller.h"
#include "process.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A weight set of `mib` MiB in 16 tensors, like the layers of a model.
struct Weights {
  laminar::WeightManifest manifest;
  std::vector<std::vector<float>> data;
  std::vector<laminar::TensorView> views;
  std::vector<laminar::NamedTensor> named;
  std::vector<std::string> names;

  explicit Weights(std::size_t mib) {
    const std::int64_t rows = std::int64_t(mib) * (1 << 20) / 16 / 4 / 1024;
    for (int i = 0; i < 16; ++i) {
      names.push_back("layer" + std::to_string(i) + ".w");
      if (!manifest.add(names.back(), laminar::DType::kF32, {rows, 1024}).ok()) std::abort();
    }
    for (const auto& e : manifest.entries()) {
      data.emplace_back(std::size_t(e.nbytes / 4));
      for (std::size_t k = 0; k < data.back().size(); k += 1024) data.back()[k] = float(k);
      views.push_back(laminar::TensorView::contiguous(data.back().data(), e.dtype, e.shape).value());
    }
    for (std::size_t i = 0; i < views.size(); ++i) named.push_back({manifest.entries()[i].name, views[i]});
  }

  // Makes the bytes differ from version to version: the first element of each tensor is v.
  void tag_version(std::uint64_t v) {
    for (auto& d : data) d[0] = float(v);
  }

  // The same bytes packed back to back, as a memcpy baseline would see them.
  void copy_to(std::byte* dst) const {
    for (std::size_t i = 0; i < data.size(); ++i) {
      std::memcpy(dst + manifest.entries()[i].offset, data[i].data(), data[i].size() * 4);
    }
  }

  // The same bytes into another set of tensors, as a pull writes them.
  void copy_to(Weights& dst) const {
    for (std::size_t i = 0; i < data.size(); ++i) std::memcpy(dst.data[i].data(), data[i].data(), data[i].size() * 4);
  }
};

// Memory of the kind RelayStore copies a publish into (host_buffer.cc): an anonymous mapping with
// transparent huge pages, every page touched. With THP in "madvise" mode a std::vector gets 4 KiB
// pages, and a memcpy into it would be slower for the TLB misses alone, not for the copy.
class StoreLikeBuffer {
 public:
  explicit StoreLikeBuffer(std::size_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      std::perror("relay_node_bench: mmap");
      std::exit(1);
    }
    (void)madvise(p, bytes, MADV_HUGEPAGE);
    std::memset(p, 1, bytes);
    data_ = static_cast<std::byte*>(p);
  }
  StoreLikeBuffer(const StoreLikeBuffer&) = delete;
  StoreLikeBuffer& operator=(const StoreLikeBuffer&) = delete;
  ~StoreLikeBuffer() { munmap(data_, bytes_); }
  std::byte* data() const { return data_; }

 private:
  std::size_t bytes_;
  std::byte* data_ = nullptr;
};

void check(const laminar::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "relay_node_bench: %s: %s\n", what, s.to_string().c_str());
    std::exit(1);
  }
}

const char* const kToken = "relay-bench-token-0123456789";

// A relay in a child process of this binary, its stdout read line by line; killed and reaped on
// destruction. `relay_node_bench relay UPSTREAM HOST` prints "listening ADDR", "upstream ADDR" once
// subscribed, and "committed V" for every version it completes; `relay_node_bench head HOST MIB
// CHUNK_BYTES` prints "listening ADDR" and publishes like shm-relay; `relay_node_bench shm-relay SOCKET MIB`
// serves a store of Weights(MIB) versions on SOCKET ("serving SOCKET") and publishes the next
// version, tagged by tag_version, on every SIGUSR1 ("published V").
class Peer {
 public:
  explicit Peer(std::vector<std::string> args, std::string netns = {}) {
    laminar::testing::ChildOptions spawn_options;
    spawn_options.program = "/proc/self/exe";
    spawn_options.args = std::move(args);
    spawn_options.force_tcp = !netns.empty();
    spawn_options.netns = std::move(netns);
    auto child = laminar::testing::ChildProcess::spawn(std::move(spawn_options));
    check(child.status(), "starting a relay");
    child_.emplace(std::move(child).value());
  }

  void signal(int sig) { child_->kill(sig); }

  // The rest of the next line starting with `prefix`.
  std::string expect(const std::string& prefix) {
    for (;;) {
      auto line = child_->read_line(std::chrono::seconds(120));
      check(line.status(), "reading a relay's output");
      if (line->rfind(prefix, 0) == 0) return line->substr(prefix.size());
    }
  }

 private:
  std::optional<laminar::testing::ChildProcess> child_;
};

// The process's transport, listening at `listen_host`: 127.0.0.1, or its NetnsSwitch host's address
// (Peer then sets UCX_TLS=tcp, so UCX really uses the link).
std::shared_ptr<laminar::Transport> listening_transport(const std::string& listen_host) {
  laminar::TransportOptions o;
  o.cluster_token = kToken;
  auto t = laminar::Transport::create(o);
  check(t.status(), "transport");
  std::shared_ptr<laminar::Transport> shared = std::move(*t);
  check(shared->listen(listen_host, 0).status(), "listen");
  return shared;
}

int run_relay(const std::string& upstream, const std::string& listen_host) {
  std::shared_ptr<laminar::RelayStore> store = laminar::RelayStore::create({}).value();
  std::shared_ptr<laminar::Transport> transport = listening_transport(listen_host);
  // Said before the node starts, so that "upstream" always follows it.
  std::printf("listening %s\n", transport->listen_address().value_or("none").c_str());
  std::fflush(stdout);
  std::mutex out;
  laminar::RelayNodeOptions o;
  o.upstreams = {upstream};
  o.on_event = [&](const laminar::RelayEvent& e) {
    std::lock_guard lock(out);
    if (e.kind == laminar::RelayEvent::Kind::kUpstream) std::printf("upstream %s\n", e.upstream.c_str());
    if (e.kind == laminar::RelayEvent::Kind::kCommitted) {
      std::printf("committed %llu\n", static_cast<unsigned long long>(e.version.value()));
    }
    std::fflush(stdout);
  };
  auto node = laminar::RelayNode::create(transport, store, o);
  check(node.status(), "relay node");
  for (;;) ::pause();  // until the parent's SIGKILL
}

// The set holding SIGUSR1 alone: the signal a head or shm-relay child publishes on.
sigset_t usr1_set() {
  sigset_t usr1;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  return usr1;
}

// Publishes the next version of a Weights(mib) set, tagged by tag_version, on every SIGUSR1 and
// prints "published V" once it is committed here. main() blocks SIGUSR1 before any thread starts,
// so that every thread inherits the mask and a signal sent early waits here, pending.
[[noreturn]] void publish_on_signal(laminar::RelayStore& store, std::size_t mib) {
  Weights w(mib);
  const sigset_t usr1 = usr1_set();
  for (std::uint64_t v = 1;;) {
    int sig = 0;
    if (sigwait(&usr1, &sig) != 0) continue;
    w.tag_version(v);
    check(store.publish(laminar::Version(v), w.manifest, w.named), "publish");
    check(store.wait_for_version(laminar::Version(v), std::chrono::seconds(60)), "commit");
    std::printf("published %llu\n", static_cast<unsigned long long>(v++));
    std::fflush(stdout);
  }
}

// The head of a chain: the actor's node, serving its store on `listen_host` and publishing on SIGUSR1.
int run_head(const std::string& listen_host, std::size_t mib, std::uint64_t chunk_bytes) {
  laminar::RelayStoreOptions so;
  so.chunk_bytes = chunk_bytes;
  std::shared_ptr<laminar::RelayStore> store = laminar::RelayStore::create(so).value();
  auto node = laminar::RelayNode::create(listening_transport(listen_host), store);
  check(node.status(), "head node");
  std::printf("listening %s\n", (*node)->address().value_or("none").c_str());
  std::fflush(stdout);
  publish_on_signal(*store, mib);
}

int run_shm_relay(const std::string& socket, std::size_t mib) {
  laminar::RelayStoreOptions so;
  so.shareable = true;
  std::shared_ptr<laminar::RelayStore> store = laminar::RelayStore::create(so).value();
  auto server = laminar::LocalRelayServer::create(store, socket);
  check(server.status(), "local relay server");
  std::printf("serving %s\n", socket.c_str());
  std::fflush(stdout);
  publish_on_signal(*store, mib);
}

enum class Shape { kOneLink, kStar, kChain };

// Seconds from the head's publish until every relay of the shape (each its own process) has
// committed the version, one per repeat. With `net`, the head and the relays are its hosts 0..4, every transfer
// crosses their rate-limited links; otherwise they share this host (UCX over shared memory).
std::vector<double> broadcast_seconds(std::size_t mib, Shape shape, int repeats, std::uint64_t chunk_bytes,
                                      const laminar::testing::NetnsSwitch* net) {
  const int relays = shape == Shape::kOneLink ? 1 : 4;
  auto host = [&](int h) { return net != nullptr ? net->address(h) : std::string("127.0.0.1"); };
  auto netns = [&](int h) { return net != nullptr ? net->name(h) : std::string(); };
  Peer head({"head", host(0), std::to_string(mib), std::to_string(chunk_bytes)}, netns(0));
  std::vector<std::unique_ptr<Peer>> peers;
  std::string up = head.expect("listening ");
  for (int k = 0; k < relays; ++k) {
    peers.push_back(std::make_unique<Peer>(std::vector<std::string>{"relay", up, host(k + 1)}, netns(k + 1)));
    const std::string addr = peers.back()->expect("listening ");
    peers.back()->expect("upstream ");
    if (shape == Shape::kChain) up = addr;
  }
  std::vector<double> t;
  // Two warm-up versions: afterwards every relay publishes into recycled buffers, as in steady state.
  for (int r = 0; r < repeats + 2; ++r) {
    const std::uint64_t v = std::uint64_t(r) + 1;
    const auto t0 = Clock::now();
    head.signal(SIGUSR1);
    for (auto& p : peers) {
      while (std::strtoull(p->expect("committed ").c_str(), nullptr, 10) < v) {
      }
    }
    if (r >= 2) t.push_back(seconds_since(t0));
  }
  return t;
}

// Star and chain to 4 relays against one link, each the median of 3 versions, as two JSON lines.
// `link_mbit` is the links' rate when `net` limits them.
void report_shapes(std::size_t mib, std::uint64_t chunk_bytes, const laminar::testing::NetnsSwitch* net,
                   std::uint32_t link_mbit, const std::string& suffix) {
  // The baseline runs before and after the two shapes, so that it sees the load they saw.
  std::vector<double> one_link_s = broadcast_seconds(mib, Shape::kOneLink, 3, chunk_bytes, net);
  const double star = median(broadcast_seconds(mib, Shape::kStar, 3, chunk_bytes, net));
  const double chain = median(broadcast_seconds(mib, Shape::kChain, 3, chunk_bytes, net));
  for (double t : broadcast_seconds(mib, Shape::kOneLink, 3, chunk_bytes, net)) one_link_s.push_back(t);
  laminar::bench::require_stable_baseline("one_link_transfer", one_link_s);
  const double one_link = median(one_link_s);
  if (net != nullptr) {
    // Over a rate-limited link the transfer has a floor: its bytes at the link's rate.
    const double floor_s = double(mib << 20) * 8 / (double(link_mbit) * 1e6);
    laminar::bench::require_baseline_near_floor("one_link_transfer", one_link, floor_s);
  }
  laminar::bench::report_time("relay_star_4_relays" + suffix, "s", star, "one_link_transfer", one_link);
  laminar::bench::report_time("relay_chain_4_relays" + suffix, "s", chain, "one_link_transfer", one_link);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The relay tier against plain memory copies of the same bytes"};
  app.option_defaults()->always_capture_default();
  std::size_t mib = 1024, chain_mib = 64, net_mib = 128, chunk_kib = 4096;
  std::uint32_t link_mbit = 1000;
  const CLI::Validator at_least_16_mib = laminar::bench::at_least(16);
  app.add_option("--mib", mib, "MiB of weights published and pulled")->check(at_least_16_mib);
  app.add_option("--chain-mib", chain_mib, "MiB of the version sent to the relays on this host")
      ->check(at_least_16_mib);
  app.add_option("--net-mib", net_mib, "MiB of the version sent over the limited links")->check(at_least_16_mib);
  app.add_option("--link-mbit", link_mbit, "each link's limit, Mbit/s each way")
      ->check(laminar::bench::at_least(10));
  app.add_option("--chunk-kib", chunk_kib, "KiB a chunk the head sends")->check(laminar::bench::positive());
  // The processes this bench starts of itself; the empty group keeps them out of --help.
  std::string child_upstream, child_host, child_socket;
  std::size_t child_mib = 0;
  std::uint64_t child_chunk_bytes = 0;
  CLI::App* relay_mode =
      app.add_subcommand("relay", "a relay: RelayNode fed from UPSTREAM, listening on HOST")->group("");
  relay_mode->add_option("upstream", child_upstream)->required();
  relay_mode->add_option("host", child_host)->required();
  CLI::App* head_mode =
      app.add_subcommand("head", "the head: RelayNode publishing MIB in chunks of CHUNK bytes")->group("");
  head_mode->add_option("host", child_host)->required();
  head_mode->add_option("mib", child_mib)->required()->check(laminar::bench::positive());
  head_mode->add_option("chunk", child_chunk_bytes)->required()->check(laminar::bench::positive());
  CLI::App* shm_relay_mode = app.add_subcommand("shm-relay", "a relay serving MIB over its local SOCKET")->group("");
  shm_relay_mode->add_option("socket", child_socket)->required();
  shm_relay_mode->add_option("mib", child_mib)->required()->check(laminar::bench::positive());
  CLI11_PARSE(app, argc, argv);
  if (relay_mode->parsed()) return run_relay(child_upstream, child_host);
  const sigset_t usr1 = usr1_set();
  pthread_sigmask(SIG_BLOCK, &usr1, nullptr);
  if (head_mode->parsed()) return run_head(child_host, child_mib, child_chunk_bytes);
  if (shm_relay_mode->parsed()) return run_shm_relay(child_socket, child_mib);

  constexpr int kRepeats = 7;
  Weights w(mib);
  const std::size_t bytes = w.manifest.total_bytes();
  StoreLikeBuffer publish_scratch(bytes);

  auto store = laminar::RelayStore::create({}).value();
  std::uint64_t version = 0;
  std::vector<double> publish_s, memcpy_s;
  for (int r = 0; r < kRepeats + 2; ++r) {
    const auto t0 = Clock::now();
    check(store->publish(laminar::Version(++version), w.manifest, w.named), "publish");
    const double ours = seconds_since(t0);
    // Not timed: the sealer finishes hashing before the next round, as it would while the actor trains.
    check(store->wait_for_version(laminar::Version(version), std::chrono::seconds(60)), "commit");
    const auto t1 = Clock::now();
    w.copy_to(publish_scratch.data());
    const double base = seconds_since(t1);
    if (r >= 2) {
      publish_s.push_back(ours);
      memcpy_s.push_back(base);
    }
  }
  laminar::bench::require_stable_baseline("memcpy", memcpy_s);
  laminar::bench::report_time("relay_publish_stall_" + std::to_string(mib) + "MiB", "s", median(publish_s),
                              "memcpy", median(memcpy_s));

  store.reset();  // its buffers would only crowd the pull's memory

  // Pull into host destinations, the engine's weight buffers, from a relay process on this host.
  char dir_template[] = "/tmp/relay-bench-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) {
    std::perror("relay_node_bench: mkdtemp");
    return 1;
  }
  const std::string socket = std::string(dir_template) + "/relay.sock";
  Weights dst(mib);
  Weights copy_dst(mib);  // the baseline's destination: the same kind of tensors as the pull's
  std::vector<double> pull_s, copy_s;
  {
    Peer relay({"shm-relay", socket, std::to_string(mib)});
    relay.expect("serving ");
    auto puller = laminar::WeightPuller::create_local({socket}).value();
    // A fresh version every round, published (outside the timing) while no pull runs, as a relay
    // does between a rollout's pulls. Two warm-up rounds: afterwards the relay writes each version
    // into the buffer of a freed one, as in steady state.
    for (int r = 0; r < kRepeats + 2; ++r) {
      const std::uint64_t v = std::uint64_t(r) + 1;
      relay.signal(SIGUSR1);
      while (std::strtoull(relay.expect("published ").c_str(), nullptr, 10) < v) {
      }
      w.tag_version(v);
      const auto t0 = Clock::now();
      check(puller->pull(laminar::Version(v), dst.named, false), "pull");
      const double ours = seconds_since(t0);
      const auto t1 = Clock::now();
      w.copy_to(copy_dst);
      const double base = seconds_since(t1);
      if (r >= 2) {
        pull_s.push_back(ours);
        copy_s.push_back(base);
      }
    }
  }
  unlink(socket.c_str());  // the relay was killed, so its server did not remove it
  rmdir(dir_template);
  for (std::size_t i = 0; i < dst.data.size(); ++i) {
    if (std::memcmp(dst.data[i].data(), w.data[i].data(), dst.data[i].size() * 4) != 0) {
      std::fprintf(stderr, "relay_node_bench: pulled bytes of tensor %zu differ\n", i);
      return 1;
    }
  }
  laminar::bench::require_stable_baseline("memcpy", copy_s);
  laminar::bench::report_throughput("relay_pull_host_cross_process_" + std::to_string(mib) + "MiB", "GB/s",
                                    double(bytes) / median(pull_s) / 1e9, "memcpy",
                                    double(bytes) / median(copy_s) / 1e9);

  // Four relays on this host: five busy processes on this machine's cores, so the copies, not the
  // links, bound it (reported). The headline runs the same shapes across namespaces whose links
  // carry `link_mbit` each way, where, as in a cluster, the links bound a transfer.
  const std::uint64_t chunk_bytes = std::uint64_t(chunk_kib) << 10;
  report_shapes(chain_mib, chunk_bytes, nullptr, 0, "_" + std::to_string(chain_mib) + "MiB_same_host");
  auto net = laminar::testing::NetnsSwitch::create("lmrb", 5, link_mbit);
  if (!net.ok()) {
    std::fprintf(stderr, "relay_node_bench: no rate-limited links (%s); chain over links not measured\n",
                 net.status().to_string().c_str());
    return 0;
  }
  report_shapes(net_mib, chunk_bytes, &*net, link_mbit,
                "_" + std::to_string(net_mib) + "MiB_" + std::to_string(link_mbit) + "Mbit_links");
  return 0;
}
