// transport_bench: bulk bandwidth of Endpoint::put between two processes, over tcp and on one host,
// each against a baseline measured in the same run:
//   tcp: a plain TCP socket loop between the same two kinds of process (write N bytes, read an ack);
//   same host (the default transports: the bytes are copied process to process): one memcpy of the
//   same N bytes inside one process.
// And what a same-host request/reply round trip costs on the default transports (tcp loopback),
// against the same round trip with UCX's shared-memory transports named ("sm,tcp"), which the
// default leaves out (docs/design.md, "What a dying peer can do").
// Prints one JSON line per measurement, the same-host put last (the headline).
//
//   transport_bench [--bytes N] [--repeats R] [--help]
// The benchmark starts its own peer by re-executing itself (`transport_bench serve <tls>` and
// `transport_bench sink <port>`), and stops it before exiting.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cli.h"
#include "harness.h"
#include "laminar/transport.h"
#include "process.h"

using namespace std::chrono_literals;
using namespace laminar;


namespace {

constexpr MessageType kRegion = 1;
constexpr MessageType kExit = 2;
constexpr MessageType kEcho = 3;
// Round trips in one timed repeat of the round-trip row.
constexpr int kRoundTrips = 2000;
const char* const kToken = "transport-bench-token-0123456789";

TransportOptions options(const std::string& tls) {
  TransportOptions o;
  o.cluster_token = kToken;
  o.ucx_transports = tls;
  o.operation_timeout = 60s;
  return o;
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "transport_bench: %s\n", what.c_str());
  std::exit(1);
}

// A child process of this binary (tests/support/process.h), its stdout read line by line; killed and
// reaped on destruction.
class Peer {
 public:
  explicit Peer(const std::vector<std::string>& args) {
    laminar::testing::ChildOptions spawn_options;
    spawn_options.program = "/proc/self/exe";
    spawn_options.args = args;
    auto child = laminar::testing::ChildProcess::spawn(std::move(spawn_options));
    if (!child.ok()) die(child.status().to_string());
    child_.emplace(std::move(child).value());
  }

  std::string line() {
    auto l = child_->read_line(60s);
    if (!l.ok()) die("peer did not answer: " + l.status().to_string());
    return *l;
  }

 private:
  std::optional<laminar::testing::ChildProcess> child_;
};

int serve(const std::string& tls, std::size_t bytes) {
  auto created = Transport::create(options(tls));
  if (!created.ok()) die(created.status().to_string());
  std::unique_ptr<Transport> t = std::move(created).value();
  auto region = t->allocate(bytes);
  if (!region.ok()) die(region.status().to_string());
  std::memset(region->data(), 0, bytes);
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::vector<Status> installed;
  installed.push_back(t->on_message(kRegion, [&](Incoming in) {
    (void)in.from.reply(in, Message::from_bytes(kRegion, region->remote().serialize()));
  }));
  installed.push_back(t->on_message(kEcho, [](Incoming in) { (void)in.from.reply(in, in.message); }));
  installed.push_back(t->on_message(kExit, [&](Incoming in) {
    (void)in.from.reply(in, in.message);
    std::lock_guard lock(mu);
    done = true;
    cv.notify_all();
  }));
  for (const Status& st : installed) {
    if (!st.ok()) die(st.to_string());
  }
  auto address = t->listen("127.0.0.1", 0);
  if (!address.ok()) die(address.status().to_string());
  std::printf("%s\n", address->c_str());
  std::fflush(stdout);
  std::unique_lock lock(mu);
  cv.wait(lock, [&] { return done; });
  return 0;
}

// Plain TCP baseline peer: reads `bytes` per round, answers one byte.
int sink(std::size_t bytes) {
  const int ls = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (bind(ls, reinterpret_cast<sockaddr*>(&a), len) != 0 || listen(ls, 1) != 0) die("sink: bind/listen");
  getsockname(ls, reinterpret_cast<sockaddr*>(&a), &len);
  std::printf("%d\n", ntohs(a.sin_port));
  std::fflush(stdout);
  const int s = accept(ls, nullptr, nullptr);
  std::vector<char> buf(std::size_t{4} << 20);
  for (;;) {
    std::size_t got = 0;
    while (got < bytes) {
      const ssize_t n = read(s, buf.data(), std::min(buf.size(), bytes - got));
      if (n <= 0) return 0;
      got += static_cast<std::size_t>(n);
    }
    const char ack = 1;
    if (write(s, &ack, 1) != 1) return 0;
  }
}

// A transport of this process connected to a `serve` peer.
struct Connected {
  std::unique_ptr<Transport> t;
  std::optional<Endpoint> ep;
};

Connected connect_to(Peer& peer, const std::string& tls) {
  const std::string address = peer.line();
  auto created = Transport::create(options(tls));
  if (!created.ok()) die(created.status().to_string());
  Connected c{std::move(created).value(), std::nullopt};
  auto ep = c.t->connect(address);
  if (!ep.ok()) die(ep.status().to_string());
  c.ep = std::move(*ep);
  return c;
}

double transport_put_gbps(const std::string& tls, std::size_t bytes, int repeats) {
  Peer peer({"serve", tls, std::to_string(bytes)});
  auto [t, ep] = connect_to(peer, tls);
  auto desc = ep->request(Message::from_string(kRegion, ""));
  if (!desc.ok()) die(desc.status().to_string());
  auto remote = RemoteRegion::deserialize(desc->body);
  if (!remote.ok()) die(remote.status().to_string());
  auto local = t->allocate(bytes);
  if (!local.ok()) die(local.status().to_string());
  std::memset(local->data(), 0x5a, bytes);
  std::fprintf(stderr, "transport_bench: %s lanes:\n%s", tls.empty() ? "default" : tls.c_str(),
               ep->transport_info().c_str());
  const auto timing = bench::measure(
      [&] {
        const Status s = ep->put(*local, 0, *remote, 0, bytes).get();
        if (!s.ok()) die(s.to_string());
      },
      {.warmup = 2, .repeats = repeats});
  (void)ep->request(Message::from_string(kExit, ""));
  return static_cast<double>(bytes) / timing.median_s / 1e9;
}

// Microseconds per request/reply of a 64-byte message to a peer process on this host.
double round_trip_us(const std::string& tls, int repeats) {
  Peer peer({"serve", tls, "4096"});
  auto [t, ep] = connect_to(peer, tls);
  const Message ping = Message::from_string(kEcho, std::string(64, 'p'));
  const auto timing = bench::measure(
      [&] {
        for (int i = 0; i < kRoundTrips; ++i) {
          auto r = ep->request(ping);
          if (!r.ok()) die(r.status().to_string());
        }
      },
      {.warmup = 1, .repeats = repeats});
  (void)ep->request(Message::from_string(kExit, ""));
  return timing.median_s / kRoundTrips * 1e6;
}

double socket_loop_gbps(std::size_t bytes, int repeats) {
  Peer peer({"sink", std::to_string(bytes)});
  const int port = std::atoi(peer.line().c_str());
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  if (connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) die("socket baseline: connect");
  std::vector<char> buf(bytes, 0x5a);
  const auto timing = bench::measure(
      [&] {
        std::size_t sent = 0;
        while (sent < bytes) {
          const ssize_t n = write(s, buf.data() + sent, bytes - sent);
          if (n <= 0) die("socket baseline: write");
          sent += static_cast<std::size_t>(n);
        }
        char ack;
        if (read(s, &ack, 1) != 1) die("socket baseline: ack");
      },
      {.warmup = 2, .repeats = repeats});
  close(s);
  bench::require_stable_baseline("tcp_socket_loop", timing);
  return static_cast<double>(bytes) / timing.median_s / 1e9;
}

double memcpy_gbps(std::size_t bytes, int repeats) {
  std::vector<char> src(bytes, 0x5a);
  std::vector<char> dst(bytes, 0);
  const auto timing =
      bench::measure([&] { std::memcpy(dst.data(), src.data(), bytes); }, {.warmup = 2, .repeats = repeats});
  if (dst[bytes / 2] != 0x5a) die("memcpy baseline did not copy");
  bench::require_stable_baseline("memcpy", timing);
  return static_cast<double>(bytes) / timing.median_s / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Endpoint::put between two processes over tcp and on one host, against a socket loop and memcpy"};
  app.option_defaults()->always_capture_default();
  std::size_t bytes = std::size_t{256} << 20;
  int repeats = 9;
  app.add_option("--bytes", bytes, "bytes a put")->check(bench::positive());
  app.add_option("--repeats", repeats, "timed puts of each")->check(bench::positive());
  // The peers this bench starts of itself; the empty group keeps them out of --help.
  std::string tls;
  std::size_t peer_bytes = 0;
  CLI::App* serve_mode = app.add_subcommand("serve", "the put's target: TLS (\"\" for any) and BYTES")->group("");
  serve_mode->add_option("tls", tls)->required();
  serve_mode->add_option("bytes", peer_bytes)->required()->check(bench::positive());
  CLI::App* sink_mode = app.add_subcommand("sink", "the socket loop's reader of BYTES")->group("");
  sink_mode->add_option("bytes", peer_bytes)->required()->check(bench::positive());
  CLI11_PARSE(app, argc, argv);
  if (serve_mode->parsed()) return serve(tls, peer_bytes);
  if (sink_mode->parsed()) return sink(peer_bytes);
  signal(SIGPIPE, SIG_IGN);

  const double tcp = transport_put_gbps("tcp", bytes, repeats);
  const double sock = socket_loop_gbps(bytes, repeats);
  bench::report_throughput("transport_put_tcp", "GB/s", tcp, "tcp_socket_loop", sock);
  const double rtt = round_trip_us("", repeats);
  const double rtt_shm = round_trip_us("sm,tcp", repeats);
  bench::report_time("transport_round_trip_same_host", "us", rtt, "shared_memory_named", rtt_shm);
  const double same_host = transport_put_gbps("", bytes, repeats);
  const double copy = memcpy_gbps(bytes, repeats);
  bench::report_throughput("transport_put_same_host", "GB/s", same_host, "memcpy", copy);
  return 0;
}
