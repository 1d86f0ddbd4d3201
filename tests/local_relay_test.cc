// Same-host pulls through shared memory across real processes: relays are examples/relay_server
// with --shm (a LocalRelayServer), the puller is WeightPuller::create_local in this process, or a
// relay_server --local child where the test needs a puller it can kill. Every pulled byte is checked
// against the relay's workload; fault cases: a relay killed mid-pull and after a stopped pull
// (failover, resume), a client killed holding a lease, malformed requests, and a fake relay in this
// process that answers with truncated, corrupt or unsafe replies (no descriptor or mapping may leak).
// A server in this process, on a ManualClock where time matters, checks its limits: idle
// connections closed, a full table evicting or turning away, clients that never read their answers
// beside a good one, and a puller whose kept connection the server closed.
#include <catch2/catch.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "laminar/local_relay.h"
#include "laminar/weight_puller.h"
#include "stop_half_way.h"
#include "eventually.h"
#include "local_relay_wire.h"
#include "expect_line.h"
#include "process.h"
#include "relay_test_util.h"

using namespace std::chrono_literals;
using laminar::NamedTensor;
using laminar::StatusCode;
using laminar::Version;
using laminar::WeightPuller;
using laminar::WeightPullerOptions;
using laminar::testing::ChildOptions;
using laminar::testing::ChildProcess;
using laminar::testing::eventually;

namespace {

const std::string kToken = "relay-local-test-token-0123456789";
constexpr int kMib = 32;
constexpr std::uint64_t kSeed = 1;  // relay_server's default

// relay_server's workload (make_manifest / element in examples/relay_server/relay_server.cc).
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::uint32_t element(std::uint64_t version, std::size_t tensor, std::size_t i) {
  return std::uint32_t(mix(kSeed ^ mix(version * 1000003 + tensor) ^ i));
}

laminar::WeightManifest make_manifest(std::size_t mib) {
  laminar::WeightManifest m;
  const std::int64_t rows = std::int64_t(mib) * (1 << 20) / 8 / 4 / 1024;
  for (int i = 0; i < 8; ++i) REQUIRE(m.add("layer" + std::to_string(i) + ".w", laminar::DType::kF32, {rows, 1024}).ok());
  REQUIRE(m.add("norm.b", laminar::DType::kF32, {37}).ok());
  return m;
}

// Engine-side buffers for relay_server's workload.
struct Engine {
  laminar::WeightManifest manifest = make_manifest(kMib);
  std::vector<std::vector<std::uint32_t>> data;
  std::vector<laminar::TensorView> views;
  std::vector<NamedTensor> named;

  Engine() {
    for (const auto& e : manifest.entries()) data.emplace_back(e.nbytes / 4, 0xABABABABu);
    for (std::size_t k = 0; k < data.size(); ++k) {
      const auto& e = manifest.entries()[k];
      views.push_back(laminar::TensorView::contiguous(data[k].data(), e.dtype, e.shape).value());
      named.push_back({e.name, views.back()});
    }
  }

  // Index of the first element of tensor k that is not version v's, or -1.
  std::int64_t mismatch(std::size_t k, std::uint64_t v, std::size_t from = 0) const {
    for (std::size_t i = from; i < data[k].size(); ++i) {
      if (data[k][i] != element(v, k, i)) return std::int64_t(i);
    }
    return -1;
  }

  bool holds(std::uint64_t v) const {
    for (std::size_t k = 0; k < data.size(); ++k) {
      if (mismatch(k, v) != -1) return false;
    }
    return true;
  }
};

// A private directory for the sockets, removed with everything in it.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/laminar-relay-local-XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    if (DIR* d = opendir(path.c_str())) {
      while (dirent* e = readdir(d)) {
        if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
          unlink((path + "/" + e->d_name).c_str());
        }
      }
      closedir(d);
    }
    rmdir(path.c_str());
  }
  std::string socket(const std::string& name) const { return path + "/" + name + ".sock"; }
};

ChildProcess start(std::vector<std::string> args) {
  ChildOptions o;
  o.program = LAMINAR_RELAY_SERVER;
  o.args = {"--mib", std::to_string(kMib)};
  o.args.insert(o.args.end(), args.begin(), args.end());
  auto child = ChildProcess::spawn(std::move(o));
  INFO(child.status().to_string());
  REQUIRE(child.ok());
  return std::move(*child);
}

std::string expect_line(ChildProcess& child, const std::string& prefix) {
  return laminar::testing::expect_line(child, prefix, 60s);
}

// A relay process that publishes `versions` versions and serves them on `socket`.
ChildProcess start_relay(const std::string& socket, int versions, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--token", kToken, "--actor", "--versions", std::to_string(versions), "--shm",
                                   socket};
  args.insert(args.end(), extra.begin(), extra.end());
  ChildProcess r = start(args);
  expect_line(r, "serving ");
  for (int v = 1; v <= versions; ++v) expect_line(r, "published " + std::to_string(v) + " ");
  return r;
}

void stop(ChildProcess& c) {
  c.kill(SIGTERM);
  auto code = c.wait(20s);
  REQUIRE(code.ok());
  CHECK(*code == 0);
}

std::size_t open_fds() {
  std::size_t n = 0;
  DIR* d = opendir("/proc/self/fd");
  REQUIRE(d != nullptr);
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n;
}

std::size_t memfd_mappings() {
  std::ifstream maps("/proc/self/maps");
  std::size_t n = 0;
  for (std::string line; std::getline(maps, line);) n += line.find("/memfd:") != std::string::npos;
  return n;
}

}  // namespace

TEST_CASE("local relay: a puller in another process gets every byte through shared memory", "[relay_local]") {
  TempDir dir;
  const std::string sock = dir.socket("r");
  ChildProcess relay = start_relay(sock, 2);
  WeightPullerOptions o;
  o.verify_checksums = true;
  auto puller = WeightPuller::create_local({sock}, o).value();
  CHECK(puller->newest_version() == Version(2));
  auto d = puller->next_action(false);
  REQUIRE(d.action == laminar::PullAction::kPull);
  CHECK(d.version == Version(2));
  Engine engine;
  REQUIRE(puller->pull(Version(2), engine.named, false).ok());
  CHECK(expect_line(relay, "lease 2 ") == std::to_string(getpid()));
  CHECK(expect_line(relay, "released 2 ") == std::to_string(getpid()) + " released held 1");
  CHECK(puller->current_version() == Version(2));
  CHECK(puller->relay() == sock);
  for (std::size_t k = 0; k < engine.data.size(); ++k) CHECK(engine.mismatch(k, 2) == -1);
  CHECK(puller->next_action(false).action == laminar::PullAction::kNone);

  // v1 was freed when v2 committed: the relay's own error comes back.
  auto st = puller->pull(Version(1), engine.named, false);
  CHECK(st.code() == StatusCode::kNotFound);
  CHECK_THAT(st.message(), Catch::Contains("version 1"));
  // Destinations are checked against the relay's manifest.
  std::vector<NamedTensor> bad = {engine.named[0], engine.named[0]};
  CHECK(puller->pull(Version(2), bad, false).code() == StatusCode::kInvalidArgument);
  CHECK(puller->pull(Version(2), engine.named, true).code() == StatusCode::kFailedPrecondition);

  // A shard: only its tensor changes.
  Engine shard;
  std::vector<NamedTensor> one = {shard.named[3]};
  REQUIRE(puller->pull(Version(2), one, false).ok());
  CHECK(shard.mismatch(3, 2) == -1);
  CHECK(shard.data[2][0] == 0xABABABABu);
  stop(relay);
}

TEST_CASE("local relay: successive versions, written into recycled relay buffers, arrive intact", "[relay_local]") {
  TempDir dir;
  const std::string sock = dir.socket("r");
  ChildProcess relay = start_relay(sock, 1, {"--publish-on-usr1"});
  auto puller = WeightPuller::create_local({sock}).value();
  Engine engine;
  const std::size_t maps_before = memfd_mappings();
  for (std::uint64_t v = 1; v <= 5; ++v) {
    if (v > 1) {
      relay.kill(SIGUSR1);
      expect_line(relay, "published " + std::to_string(v) + " ");
    }
    REQUIRE(puller->pull(Version(v), engine.named, false).ok());
    INFO("version " << v);
    CHECK(engine.holds(v));
  }
  // The puller keeps a few relay buffers mapped for reuse, not one per version.
  CHECK(memfd_mappings() - maps_before <= 3);
  stop(relay);
}

TEST_CASE("local relay: prefetch holds a lease across newer versions and swap releases it", "[relay_local]") {
  TempDir dir;
  const std::string sock = dir.socket("r");
  ChildProcess relay = start_relay(sock, 1, {"--publish-on-usr1"});
  WeightPullerOptions o;
  o.policy = laminar::PullPolicy::kPrefetchThenSwap;
  auto puller = WeightPuller::create_local({sock}, o).value();
  auto d = puller->next_action(/*has_live_trajectory=*/true);
  REQUIRE(d.action == laminar::PullAction::kPrefetch);
  REQUIRE(puller->prefetch(d.version).ok());
  expect_line(relay, "lease 1 ");
  relay.kill(SIGUSR1);
  expect_line(relay, "published 2 ");
  Engine engine;
  REQUIRE(puller->swap(engine.named, false).ok());
  // The relay kept v1 for the lease until now: two versions held before, one after.
  CHECK(expect_line(relay, "released 1 ") == std::to_string(getpid()) + " released held 1");
  CHECK(engine.holds(1));
  CHECK(puller->current_version() == Version(1));
  CHECK(puller->next_action(false).version == Version(2));
  stop(relay);
}

TEST_CASE("local relay killed mid-pull: the copy completes, later pulls fail over, a stopped pull resumes there",
          "[relay_local]") {
  TempDir dir;
  const std::string s1 = dir.socket("r1"), s2 = dir.socket("r2"), s3 = dir.socket("r3");
  ChildProcess r1 = start_relay(s1, 1);
  ChildProcess r2 = start_relay(s2, 1);
  ChildProcess r3 = start_relay(s3, 1);
  WeightPullerOptions o;
  o.copy_chunk_bytes = 4096;  // many chunk boundaries where a cancel can land
  auto puller = WeightPuller::create_local({s1, s2, s3}, o).value();

  // The relay dies once it has granted the lease, while its memory is being copied: the mapping
  // keeps the pages, so the pull still delivers every byte.
  {
    Engine engine;
    laminar::Status st;
    std::thread t([&] { st = puller->pull(Version(1), engine.named, false); });
    expect_line(r1, "lease 1 ");
    r1.kill(SIGKILL);
    t.join();
    REQUIRE(st.ok());
    CHECK(engine.holds(1));
    CHECK(r1.wait(10s).ok());
  }
  CHECK(puller->newest_version() == Version(1));
  CHECK(puller->relay() == s2);

  // A pull stopped half way, then its relay dies: pulling again resumes on the next relay at the
  // byte it stopped at (bytes already copied are marked, and must stay marked).
  const std::uint64_t seed = std::random_device{}();
  std::printf("local_relay_test cancel seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937 rng(std::uint32_t(seed & 0xffffffffu));
  Engine engine;
  const laminar::testing::HalfWay half =
      laminar::testing::stop_half_way(*puller, [&] { return puller->pull(Version(1), engine.named, false); }, rng);
  INFO(half.error.to_string());
  REQUIRE(half.error.ok());
  const std::optional<WeightPuller::StoppedPull> stopped = half.stopped;
  REQUIRE(stopped);
  std::uint64_t left = stopped->bytes_done;
  for (auto& t : engine.data) {
    const std::uint64_t k = std::min<std::uint64_t>(left, t.size() * 4) / 4;
    std::fill(t.begin(), t.begin() + std::ptrdiff_t(k), 0xCDCDCDCDu);
    left -= std::min<std::uint64_t>(left, t.size() * 4);
  }
  r2.kill(SIGKILL);
  CHECK(r2.wait(10s).ok());
  REQUIRE(puller->pull(Version(1), engine.named, false).ok());
  CHECK(puller->relay() == s3);
  left = stopped->bytes_done;
  for (std::size_t k = 0; k < engine.data.size(); ++k) {
    const std::uint64_t done = std::min<std::uint64_t>(left, engine.data[k].size() * 4) / 4;
    left -= std::min<std::uint64_t>(left, engine.data[k].size() * 4);
    CHECK(std::all_of(engine.data[k].begin(), engine.data[k].begin() + std::ptrdiff_t(done),
                      [](std::uint32_t x) { return x == 0xCDCDCDCDu; }));
    CHECK(engine.mismatch(k, 1, done) == -1);
  }
  stop(r3);
  // No relay left: a clear error naming each one.
  auto st = puller->pull(Version(1), engine.named, false);
  CHECK(st.code() == StatusCode::kUnavailable);
  CHECK_THAT(st.message(), Catch::Contains(s1) && Catch::Contains(s3));
  CHECK_FALSE(puller->newest_version());
}

TEST_CASE("local relay: a client killed while holding a lease has it released and the version freed",
          "[relay_local]") {
  TempDir dir;
  const std::string sock = dir.socket("r");
  ChildProcess relay = start_relay(sock, 1, {"--publish-on-usr1"});
  ChildProcess client = start({"--pull", "--local", sock, "--hold"});
  CHECK(expect_line(client, "holding ") == "1");
  CHECK(expect_line(relay, "lease 1 ") == std::to_string(client.pid()));
  relay.kill(SIGUSR1);
  expect_line(relay, "published 2 ");
  // v1 is still held for the client, so a pull of it works.
  Engine engine;
  auto puller = WeightPuller::create_local({sock}).value();
  REQUIRE(puller->pull(Version(1), engine.named, false).ok());
  CHECK(engine.holds(1));
  CHECK_THAT(expect_line(relay, "released 1 "), Catch::EndsWith("released held 2"));
  client.kill(SIGKILL);
  CHECK(client.wait(10s).ok());
  CHECK(expect_line(relay, "released 1 ") == std::to_string(client.pid()) + " disconnected held 1");
  CHECK(puller->pull(Version(1), engine.named, false).code() == StatusCode::kNotFound);
  stop(relay);
}

namespace {

// A raw client of a LocalRelayServer: sends bytes, reads whatever comes back until EOF.
struct RawClient {
  int fd = -1;
  explicit RawClient(const std::string& path) {
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path, path.c_str(), path.size());
    REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    const timeval tv{10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  ~RawClient() { close(fd); }
  void send_words(std::uint32_t magic, std::uint32_t type, std::uint64_t a, std::uint64_t b) {
    char buf[24];
    std::memcpy(buf, &magic, 4);
    std::memcpy(buf + 4, &type, 4);
    std::memcpy(buf + 8, &a, 8);
    std::memcpy(buf + 16, &b, 8);
    REQUIRE(send(fd, buf, sizeof buf, MSG_NOSIGNAL) == 24);
  }
  void send_request(laminar::internal::LocalRequest type, std::uint64_t a = 0) {
    send_words(laminar::internal::kLocalRelayMagic, std::uint32_t(type), a, 0);
  }
  // Everything the server sends until it closes the connection.
  std::string read_to_eof() {
    std::string out;
    char buf[4096];
    for (;;) {
      const ssize_t n = recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      out.append(buf, std::size_t(n));
    }
    return out;
  }
  // n bytes, fewer if the connection ends first; descriptors that come with them are closed.
  std::string read_exact(std::size_t n) {
    std::string out(n, '\0');
    std::size_t got = 0;
    while (got < n) {
      iovec iov{out.data() + got, n - got};
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof control;
      const ssize_t k = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
      if (k <= 0) break;
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        for (std::size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); ++i) {
          int received;
          std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          close(received);
        }
      }
      got += std::size_t(k);
    }
    out.resize(got);
    return out;
  }
  // One reply's type (0 when the connection ended first) and payload.
  std::uint32_t read_reply(std::string* payload = nullptr) {
    const std::string h = read_exact(16);
    if (h.size() < 16) return 0;
    std::uint32_t type = 0;
    std::uint64_t len = 0;
    std::memcpy(&type, h.data() + 4, 4);
    std::memcpy(&len, h.data() + 8, 8);
    std::string p = read_exact(std::size_t(len));
    if (p.size() < len) return 0;
    if (payload != nullptr) *payload = std::move(p);
    return type;
  }
  // Takes the newest version and returns the lease's id.
  std::uint64_t acquire() {
    send_request(laminar::internal::LocalRequest::kAcquire);
    std::string grant;
    REQUIRE(read_reply(&grant) == std::uint32_t(laminar::internal::LocalReply::kGrant));
    std::uint64_t lease = 0;
    std::memcpy(&lease, grant.data(), 8);
    return lease;
  }
  // Whether the server still answers on this connection.
  bool answers() {
    send_request(laminar::internal::LocalRequest::kNewest);
    return read_reply() == std::uint32_t(laminar::internal::LocalReply::kNewestIs);
  }
  // Whether the server closes the connection within `within` (of real time); replies still unread
  // are read and dropped.
  bool closed_by_server(std::chrono::milliseconds within) {
    const auto end = std::chrono::steady_clock::now() + within;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
      pollfd p{fd, POLLIN, 0};
      if (left.count() <= 0 || poll(&p, 1, int(left.count())) <= 0) return false;
      char buf[4096];
      const ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n == 0) return true;
    }
  }
};

}  // namespace

TEST_CASE("local relay: malformed requests are refused and the relay keeps serving", "[relay_local]") {
  using laminar::internal::kLocalRelayMagic;
  TempDir dir;
  const std::string sock = dir.socket("r");
  ChildProcess relay = start_relay(sock, 1);
  {
    RawClient c(sock);
    c.send_words(0xdeadbeef, 1, 0, 0);
    const std::string reply = c.read_to_eof();
    REQUIRE(reply.size() > 20);
    std::uint32_t code = 0;
    std::memcpy(&code, reply.data() + 16, 4);
    CHECK(code == std::uint32_t(StatusCode::kInvalidArgument));
    CHECK_THAT(reply, Catch::Contains("0xdeadbeef"));
    CHECK_THAT(expect_line(relay, "refused "), Catch::Contains("0xdeadbeef"));
  }
  {
    RawClient c(sock);
    c.send_words(kLocalRelayMagic, 99, 0, 0);
    CHECK_THAT(c.read_to_eof(), Catch::Contains("unknown type 99"));
    CHECK_THAT(expect_line(relay, "refused "), Catch::Contains("unknown type 99"));
  }
  {
    RawClient c(sock);
    c.send_words(kLocalRelayMagic, std::uint32_t(laminar::internal::LocalRequest::kRelease), 12345, 0);
    CHECK_THAT(c.read_to_eof(), Catch::Contains("lease 12345"));
    CHECK_THAT(expect_line(relay, "refused "), Catch::Contains("lease 12345"));
  }
  {
    RawClient c(sock);
    c.send_words(kLocalRelayMagic, std::uint32_t(laminar::internal::LocalRequest::kAcquire), 7, 1);
    CHECK_THAT(c.read_to_eof(), Catch::Contains("flag 7"));
    expect_line(relay, "refused ");
  }
  {
    // Half a request, then gone; and a lease taken by a raw client that then hangs up.
    RawClient c(sock);
    REQUIRE(send(c.fd, "LMR1", 4, MSG_NOSIGNAL) == 4);
  }
  CHECK_THAT(expect_line(relay, "refused "), Catch::Contains("mid-request"));
  {
    RawClient c(sock);
    c.send_words(kLocalRelayMagic, std::uint32_t(laminar::internal::LocalRequest::kAcquire), 0, 0);
    expect_line(relay, "lease 1 ");
  }
  CHECK_THAT(expect_line(relay, "released 1 "), Catch::Contains("disconnected"));
  // Still serving.
  Engine engine;
  auto puller = WeightPuller::create_local({sock}).value();
  REQUIRE(puller->pull(Version(1), engine.named, false).ok());
  CHECK(engine.holds(1));
  stop(relay);
}

namespace {

// A fake relay in this process: accepts one connection, reads one request, answers with `reply`,
// then closes.
class FakeRelay {
 public:
  using Reply = std::function<void(int client)>;
  FakeRelay(const std::string& path, Reply reply) {
    fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd_ >= 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path, path.c_str(), path.size());
    REQUIRE(bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(listen(fd_, 4) == 0);
    path_ = path;
    thread_ = std::thread([this, reply = std::move(reply)] {
      const int c = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) return;
      char req[24];
      std::size_t got = 0;
      while (got < sizeof req) {
        const ssize_t n = recv(c, req + got, sizeof req - got, 0);
        if (n <= 0) break;
        got += std::size_t(n);
      }
      reply(c);
      close(c);
    });
  }
  ~FakeRelay() {
    thread_.join();
    close(fd_);
    unlink(path_.c_str());
  }

 private:
  int fd_ = -1;
  std::string path_;
  std::thread thread_;
};

void put64(std::string& s, std::uint64_t x) { s.append(reinterpret_cast<const char*>(&x), 8); }
void put32(std::string& s, std::uint32_t x) { s.append(reinterpret_cast<const char*>(&x), 4); }

std::string header(laminar::internal::LocalReply type, std::uint64_t len,
                   std::uint32_t magic = laminar::internal::kLocalRelayMagic) {
  std::string s;
  put32(s, magic);
  put32(s, std::uint32_t(type));
  put64(s, len);
  return s;
}

// A well-formed grant payload for `m` in chunks of 64 KiB (checksums all zero).
std::string grant_payload(const laminar::WeightManifest& m, std::uint64_t version = 1) {
  const std::uint64_t chunk = 64 << 10;
  const std::uint64_t n = (m.total_bytes() + chunk - 1) / chunk;
  const std::string json = m.to_json();
  std::string p;
  put64(p, 7);
  put64(p, version);
  put64(p, m.total_bytes());
  put64(p, chunk);
  put64(p, n);
  put64(p, json.size());
  for (std::uint64_t i = 0; i < n; ++i) put64(p, 0);
  return p + json;
}

void send_with_fd(int sock, const std::string& bytes, int fd) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  (void)sendmsg(sock, &msg, MSG_NOSIGNAL);
}

// A memfd of `bytes`, with the given seals.
int make_memfd(std::uint64_t bytes, int seals) {
  const int fd = memfd_create("fake-relay", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  REQUIRE(fd >= 0);
  REQUIRE(ftruncate(fd, off_t(bytes)) == 0);
  if (seals != 0) REQUIRE(fcntl(fd, F_ADD_SEALS, seals) == 0);
  return fd;
}

}  // namespace

TEST_CASE("local relay frames: each decoder takes what its encoder writes and refuses the rest, naming field and "
          "offset", "[relay_local][bad-input]") {
  namespace in = laminar::internal;
  using laminar::internal::LocalReply;
  using laminar::internal::LocalRequest;
  const auto refused = [](const laminar::Status& st, const char* needle) {
    INFO(st.to_string());
    CHECK(st.code() == StatusCode::kDataLoss);
    CHECK_THAT(st.message(), Catch::Contains(needle) && Catch::Contains("at offset"));
  };
  for (const in::LocalRequestFrame& r :
       {in::LocalRequestFrame{LocalRequest::kNewest, std::nullopt, 0}, {LocalRequest::kAcquire, std::nullopt, 0},
        {LocalRequest::kAcquire, Version(0), 0}, {LocalRequest::kAcquire, Version(9), 0},
        {LocalRequest::kRelease, std::nullopt, 42}}) {
    CHECK(in::decode_local_request(in::encode_local_request(r)).value() == r);
  }
  const in::LocalReplyHeader header{LocalReply::kGrant, 100};
  CHECK(in::decode_local_reply_header(in::encode_local_reply_header(header)).value() == header);
  CHECK(in::decode_local_newest(in::encode_local_newest(Version(4))).value() == Version(4));
  CHECK(in::decode_local_newest(in::encode_local_newest(std::nullopt)).value() == std::nullopt);
  const in::LocalGrantPayload grant{7, Version(2), 100000, 65536, {11, 22}, R"({"tensors":[]})"};
  CHECK(in::decode_local_grant(in::encode_local_grant(grant)).value() == grant);
  const in::LocalErrorPayload error{StatusCode::kNotFound, "no version 3"};
  CHECK(in::decode_local_error(in::encode_local_error(laminar::Status(error.code, error.message))).value() == error);

  auto req = in::encode_local_request({LocalRequest::kRelease, std::nullopt, 42});
  req[16] = std::byte{5};
  refused(in::decode_local_request(req).status(), "b is 5, but a release request leaves it 0 at offset 16");
  refused(in::decode_local_request(std::span(req).first(20)).status(), "b cut short at offset 16");
  auto newest = in::encode_local_newest(std::nullopt);
  newest[8] = std::byte{1};
  refused(in::decode_local_newest(newest).status(), "version is 1 without has at offset 8");
  newest[0] = std::byte{2};
  refused(in::decode_local_newest(newest).status(), "has is 2, not 0 or 1 at offset 0");
  auto g = in::encode_local_grant(grant);
  refused(in::decode_local_grant(std::span(g).first(47)).status(), "json_bytes cut short at offset 40");
  g.pop_back();
  refused(in::decode_local_grant(g).status(),
          "2 checksums and 14 manifest bytes announced, 29 bytes follow at offset 32");
  // A count far beyond the bytes there is refused before anything is allocated for it.
  g = in::encode_local_grant(grant);
  std::fill(g.begin() + 32, g.begin() + 40, std::byte{0xff});
  refused(in::decode_local_grant(g).status(), "18446744073709551615 checksums");
  // The relay cuts a long message to the limit; a longer one is refused.
  auto e = in::encode_local_error(laminar::Status(StatusCode::kNotFound, std::string(2000, 'x')));
  CHECK(in::decode_local_error(e).value().message.size() == in::kLocalMaxErrorTextBytes);
  e.push_back(std::byte{'x'});
  refused(in::decode_local_error(e).status(), "message of 1025 bytes is over the limit of 1024 at offset 4");
  refused(in::decode_local_error(std::vector<std::byte>(4)).status(), "status code 0 (OK) in an error reply");
}

TEST_CASE("local relay: truncated, corrupt or unsafe replies are clear errors and leak nothing", "[relay_local]") {
  using laminar::internal::LocalReply;
  TempDir dir;
  const std::string sock = dir.socket("fake");
  Engine engine;
  const std::string grant = grant_payload(engine.manifest);
  const int full_seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE;
  struct Case {
    const char* what;
    FakeRelay::Reply reply;
    StatusCode code;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"hangs up at once", [](int) {}, StatusCode::kUnavailable, "closed the connection"},
      {"half a header", [](int c) { (void)send(c, "LMR1\x0c", 5, MSG_NOSIGNAL); }, StatusCode::kUnavailable,
       "5 of 16 bytes"},
      {"bad magic", [](int c) { auto h = header(LocalReply::kGrant, 0, 0x12345678); (void)send(c, h.data(), h.size(), MSG_NOSIGNAL); },
       StatusCode::kDataLoss, "magic"},
      {"unknown reply type",
       [](int c) { auto h = header(LocalReply(77), 0); (void)send(c, h.data(), h.size(), MSG_NOSIGNAL); },
       StatusCode::kDataLoss, "unknown type 77"},
      {"huge payload",
       [](int c) { auto h = header(LocalReply::kGrant, 1ull << 40); (void)send(c, h.data(), h.size(), MSG_NOSIGNAL); },
       StatusCode::kDataLoss, "over the limit"},
      {"truncated grant",
       [&](int c) {
         const int fd = make_memfd(engine.manifest.total_bytes(), full_seals);
         send_with_fd(c, header(LocalReply::kGrant, grant.size()) + grant.substr(0, 40), fd);
         close(fd);
       },
       StatusCode::kUnavailable, "closed the connection"},
      {"grant without a descriptor",
       [&](int c) { send_with_fd(c, header(LocalReply::kGrant, grant.size()) + grant, -1); }, StatusCode::kDataLoss,
       "0 descriptors"},
      {"grant whose counts do not add up",
       [&](int c) {
         std::string g = grant;
         const std::uint64_t bad = 3;
         std::memcpy(g.data() + 32, &bad, 8);
         const int fd = make_memfd(engine.manifest.total_bytes(), full_seals);
         send_with_fd(c, header(LocalReply::kGrant, g.size()) + g, fd);
         close(fd);
       },
       StatusCode::kDataLoss, "3 checksums"},
      {"grant with a corrupt manifest",
       [&](int c) {
         std::string g = grant;
         g[g.size() - 2] = '#';
         const int fd = make_memfd(engine.manifest.total_bytes(), full_seals);
         send_with_fd(c, header(LocalReply::kGrant, g.size()) + g, fd);
         close(fd);
       },
       StatusCode::kDataLoss, "manifest"},
      {"grant for another version",
       [&](int c) {
         const std::string g = grant_payload(engine.manifest, 9);
         const int fd = make_memfd(engine.manifest.total_bytes(), full_seals);
         send_with_fd(c, header(LocalReply::kGrant, g.size()) + g, fd);
         close(fd);
       },
       StatusCode::kDataLoss, "version 9"},
      {"a pipe instead of a memfd",
       [&](int c) {
         int p[2];
         REQUIRE(pipe2(p, O_CLOEXEC) == 0);
         send_with_fd(c, header(LocalReply::kGrant, grant.size()) + grant, p[0]);
         close(p[0]);
         close(p[1]);
       },
       StatusCode::kDataLoss, "not a sealable memfd"},
      {"an unsealed memfd",
       [&](int c) {
         const int fd = make_memfd(engine.manifest.total_bytes(), 0);
         send_with_fd(c, header(LocalReply::kGrant, grant.size()) + grant, fd);
         close(fd);
       },
       StatusCode::kDataLoss, "seals"},
      {"a memfd shorter than the version",
       [&](int c) {
         const int fd = make_memfd(4096, full_seals);
         send_with_fd(c, header(LocalReply::kGrant, grant.size()) + grant, fd);
         close(fd);
       },
       StatusCode::kDataLoss, "holds 4096 bytes"},
      {"an error reply with an unknown code",
       [](int c) {
         std::string p;
         put32(p, 200);
         p += "bogus";
         const std::string h = header(LocalReply::kError, p.size()) + p;
         (void)send(c, h.data(), h.size(), MSG_NOSIGNAL);
       },
       StatusCode::kDataLoss, "unknown status code 200"},
  };
  WeightPullerOptions o;
  o.relay_timeout = 500ms;
  for (const Case& k : cases) {
    SECTION(k.what) {
      const std::size_t fds_before = open_fds();
      const std::size_t maps_before = memfd_mappings();
      {
        auto puller = WeightPuller::create_local({sock}, o).value();
        laminar::Status st;
        {
          FakeRelay fake(sock, k.reply);
          st = puller->pull(Version(1), engine.named, false);
        }
        INFO(st.to_string());
        CHECK(st.code() == k.code);
        CHECK_THAT(st.message(), Catch::Contains(k.needle) && Catch::Contains(sock));
        CHECK_FALSE(puller->current_version());
      }
      CHECK(open_fds() == fds_before);
      CHECK(memfd_mappings() == maps_before);
      for (const auto& t : engine.data) CHECK(t[0] == 0xABABABABu);
    }
  }
}

TEST_CASE("local relay: a silent relay is given up after relay_timeout on the puller's clock", "[relay_local]") {
  TempDir dir;
  const std::string sock = dir.socket("silent");
  Engine engine;
  auto clock = std::make_shared<laminar::ManualClock>();
  WeightPullerOptions o;
  o.relay_timeout = 500ms;
  o.clock = clock;
  auto puller = WeightPuller::create_local({sock}, o).value();
  std::promise<void> hang_up;
  auto hang_up_f = hang_up.get_future().share();
  FakeRelay fake(sock, [hang_up_f](int) { hang_up_f.wait(); });  // reads the request, answers nothing
  auto pulled = std::async(std::launch::async, [&] {
    const laminar::Duration start = clock->now();
    laminar::Status st = puller->pull(Version(1), engine.named, false);
    return std::make_pair(st, clock->now() - start);
  });
  const bool ended = laminar::testing::advance_until_ready(*clock, pulled, 50ms, 10000);
  hang_up.set_value();
  REQUIRE(ended);
  const auto [st, took] = pulled.get();
  INFO(st.to_string());
  CHECK(st.code() == StatusCode::kDeadlineExceeded);
  CHECK_THAT(st.message(), Catch::Contains("in time") && Catch::Contains(sock));
  CHECK(took >= 500ms);
  CHECK_FALSE(puller->current_version());
}

TEST_CASE("local relay: bad socket paths and options are refused up front", "[relay_local]") {
  CHECK(WeightPuller::create_local({}).status().code() == StatusCode::kInvalidArgument);
  CHECK(WeightPuller::create_local({""}).status().code() == StatusCode::kInvalidArgument);
  auto st = WeightPuller::create_local({std::string(200, 'x')}).status();
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(st.message(), Catch::Contains("socket path"));
  WeightPullerOptions o;
  o.relay_timeout = 0ms;
  CHECK(WeightPuller::create_local({"/tmp/x.sock"}, o).status().code() == StatusCode::kInvalidArgument);
  // Nothing listens: a clear error on use, not at creation.
  auto puller = WeightPuller::create_local({"/tmp/laminar-no-such-relay.sock"}).value();
  CHECK_FALSE(puller->newest_version());
  Engine engine;
  auto pst = puller->pull(Version(1), engine.named, false);
  CHECK(pst.code() == StatusCode::kUnavailable);
  CHECK_THAT(pst.message(), Catch::Contains("/tmp/laminar-no-such-relay.sock"));

  std::shared_ptr<laminar::RelayStore> plain = laminar::RelayStore::create({}).value();
  auto refused = laminar::LocalRelayServer::create(plain, "/tmp/x.sock").status();
  CHECK(refused.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(refused.message(), Catch::Contains("shareable"));
  laminar::RelayStoreOptions so;
  so.shareable = true;
  std::shared_ptr<laminar::RelayStore> store = laminar::RelayStore::create(so).value();
  CHECK(laminar::LocalRelayServer::create(nullptr, "/tmp/x.sock").status().code() == StatusCode::kInvalidArgument);
  CHECK(laminar::LocalRelayServer::create(store, std::string(200, 'y')).status().code() ==
        StatusCode::kInvalidArgument);
  for (auto [field, spoil] : std::initializer_list<std::pair<const char*, void (*)(laminar::LocalRelayServerOptions&)>>{
           {"max_clients", [](laminar::LocalRelayServerOptions& lo) { lo.max_clients = 0; }},
           {"max_client_buffer_bytes", [](laminar::LocalRelayServerOptions& lo) { lo.max_client_buffer_bytes = 0; }},
           {"idle_timeout", [](laminar::LocalRelayServerOptions& lo) { lo.idle_timeout = 0s; }},
           {"idle_timeout", [](laminar::LocalRelayServerOptions& lo) { lo.idle_timeout = -1s; }}}) {
    laminar::LocalRelayServerOptions lo;
    spoil(lo);
    auto bad = laminar::LocalRelayServer::create(store, "/tmp/x.sock", lo).status();
    CHECK(bad.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(bad.message(), Catch::Contains(field));
  }
  TempDir dir;
  const std::string sock = dir.socket("s");
  auto server = laminar::LocalRelayServer::create(store, sock).value();
  auto again = laminar::LocalRelayServer::create(store, sock);
  CHECK(again.status().code() == StatusCode::kAlreadyExists);
  server.reset();
  CHECK(access(sock.c_str(), F_OK) != 0);  // removed on stop
}

namespace {

// relay_server's workload, version v, published into `store`.
void publish_workload(laminar::RelayStore& store, std::uint64_t v) {
  Engine w;
  for (std::size_t k = 0; k < w.data.size(); ++k) {
    for (std::size_t i = 0; i < w.data[k].size(); ++i) w.data[k][i] = element(v, k, i);
  }
  REQUIRE(store.publish(Version(v), w.manifest, w.named).ok());
  REQUIRE(store.wait_for_version(Version(v), 10s).ok());
}

// A LocalRelayServer in this process serving version 1 of the workload, recording its events.
struct InProcessRelay {
  TempDir dir;
  std::string sock = dir.socket("r");
  std::shared_ptr<laminar::RelayStore> store;
  std::mutex mu;
  std::vector<laminar::LocalRelayEvent> events;
  // Last, so its thread stops before the members its on_event touches go.
  std::unique_ptr<laminar::LocalRelayServer> server;

  explicit InProcessRelay(laminar::LocalRelayServerOptions o) {
    laminar::RelayStoreOptions so;
    so.shareable = true;
    store = laminar::RelayStore::create(so).value();
    publish_workload(*store, 1);
    o.on_event = [this](const laminar::LocalRelayEvent& e) {
      std::lock_guard lock(mu);
      events.push_back(e);
    };
    server = laminar::LocalRelayServer::create(store, sock, std::move(o)).value();
  }
  laminar::LocalRelayServerStats stats() const { return server->stats(); }
  // Details of the kClosed events so far.
  std::vector<std::string> closed() {
    std::lock_guard lock(mu);
    std::vector<std::string> out;
    for (const auto& e : events) {
      if (e.kind == laminar::LocalRelayEvent::Kind::kClosed) out.push_back(e.detail);
    }
    return out;
  }
};

}  // namespace

TEST_CASE("local relay server: connections idle past idle_timeout on its clock are closed, lease holders are not",
          "[relay_local]") {
  auto clock = std::make_shared<laminar::ManualClock>();
  laminar::LocalRelayServerOptions o;
  o.idle_timeout = 10s;
  o.clock = clock;
  o.max_client_buffer_bytes = 4096;
  InProcessRelay relay(o);
  RawClient active(relay.sock), idle(relay.sock), holder(relay.sock), stalled(relay.sock);
  REQUIRE(eventually([&] { return relay.stats().clients == 4; }));
  const std::uint64_t lease = holder.acquire();
  // Holds a lease and then sends requests without reading the answers until the server stops
  // reading it: not copying, so closed like an idle one.
  stalled.acquire();
  REQUIRE(fcntl(stalled.fd, F_SETFL, O_NONBLOCK) == 0);
  REQUIRE(eventually([&] {
    for (int i = 0; i < 64; ++i) {
      const auto newest = laminar::internal::encode_local_request({laminar::internal::LocalRequest::kNewest, {}, 0});
      if (send(stalled.fd, newest.data(), newest.size(), MSG_NOSIGNAL) < 0) break;
    }
    return relay.stats().read_pauses == 1;
  }));

  REQUIRE(clock->advance(6s).ok());
  REQUIRE(active.answers());  // active at 6 s
  REQUIRE(clock->advance(5s).ok());
  CHECK(idle.closed_by_server(5s));
  CHECK(stalled.closed_by_server(5s));
  CHECK(eventually([&] { return relay.stats().idle_closed == 1 && relay.stats().stalled_closed == 1; }));
  CHECK_FALSE(active.closed_by_server(50ms));
  CHECK(relay.stats().leases == 1);  // the stalled client's lease ended with its connection

  REQUIRE(clock->advance(6s).ok());
  CHECK(active.closed_by_server(5s));
  CHECK(eventually([&] { return relay.stats().idle_closed == 2; }));
  // A lease holder that has read its grant may copy for as long as it needs.
  REQUIRE(clock->advance(1h).ok());
  CHECK_FALSE(holder.closed_by_server(200ms));
  CHECK(holder.answers());
  holder.send_request(laminar::internal::LocalRequest::kRelease, lease);
  REQUIRE(eventually([&] { return relay.stats().leases == 0; }));
  REQUIRE(clock->advance(11s).ok());
  CHECK(holder.closed_by_server(5s));
  CHECK(eventually([&] { return relay.stats().idle_closed == 3 && relay.stats().clients == 0; }));
  const auto closed = relay.closed();
  REQUIRE(closed.size() == 4);
  CHECK(closed[0] == "idle for 11000 ms");
  CHECK_THAT(closed[1], Catch::StartsWith("left ") && Catch::EndsWith(" reply bytes unread for 11000 ms"));
  CHECK(closed[2] == "idle for 11000 ms");
  CHECK(closed[3] == "idle for 11000 ms");
  CHECK_THAT(relay.stats().to_json(), Catch::Contains(R"("idle_closed":3,"stalled_closed":1)"));
}

TEST_CASE("local relay server: a full table evicts the longest-idle connection without a lease, and turns a new "
          "one away when every connection holds a lease", "[relay_local]") {
  auto clock = std::make_shared<laminar::ManualClock>();
  laminar::LocalRelayServerOptions o;
  o.max_clients = 3;
  o.clock = clock;
  InProcessRelay relay(o);
  // a is the longest idle, but holds a lease; b is the longest idle without one.
  RawClient a(relay.sock);
  a.acquire();
  REQUIRE(clock->advance(1s).ok());
  RawClient b(relay.sock);
  REQUIRE(eventually([&] { return relay.stats().clients == 2; }));
  REQUIRE(clock->advance(1s).ok());
  RawClient c(relay.sock);
  REQUIRE(eventually([&] { return relay.stats().clients == 3; }));
  REQUIRE(clock->advance(1s).ok());

  RawClient d(relay.sock);
  CHECK(b.closed_by_server(5s));
  CHECK(eventually([&] { return relay.stats().evicted == 1; }));
  CHECK(a.answers());
  CHECK(c.answers());
  CHECK(d.answers());
  CHECK(relay.stats().clients == 3);

  c.acquire();
  d.acquire();
  RawClient e(relay.sock);
  CHECK(e.closed_by_server(5s));
  CHECK(eventually([&] { return relay.stats().refused_full == 1; }));
  CHECK(a.answers());
  CHECK(c.answers());
  CHECK(d.answers());
  const auto s = relay.stats();
  CHECK(s.clients == 3);
  CHECK(s.leases == 3);
  CHECK(s.evicted == 1);
  const auto closed = relay.closed();
  REQUIRE(closed.size() == 2);
  CHECK_THAT(closed[0], Catch::Contains("evicted") && Catch::Contains("2000 ms idle"));
  CHECK_THAT(closed[1], Catch::Contains("turned away: all 3 connections hold leases"));
}

TEST_CASE("local relay server: clients that send requests and never read the answers do not delay a good client",
          "[relay_local]") {
  InProcessRelay relay({});
  WeightPullerOptions po;
  po.verify_checksums = true;
  auto puller = WeightPuller::create_local({relay.sock}, po).value();
  Engine engine;
  const auto timed_pull = [&](WeightPuller& p) {
    std::fill(engine.data[0].begin(), engine.data[0].end(), 0u);
    const auto start = std::chrono::steady_clock::now();
    const laminar::Status st = p.pull(Version(1), engine.named, false);
    const auto took = std::chrono::steady_clock::now() - start;
    INFO(st.to_string());
    REQUIRE(st.ok());
    CHECK(engine.holds(1));
    return took;
  };
  // The slowest of three pulls on a kept connection and one by a new puller (which maps the
  // relay's memory first).
  const auto slowest_pull = [&] {
    std::chrono::steady_clock::duration slowest{0};
    for (int i = 0; i < 3; ++i) slowest = std::max(slowest, timed_pull(*puller));
    auto fresh = WeightPuller::create_local({relay.sock}, po).value();
    return std::max(slowest, timed_pull(*fresh));
  };
  timed_pull(*puller);  // warm
  const auto baseline = slowest_pull();

  // Each sends acquire requests as fast as its socket takes them and reads nothing.
  constexpr int kFlooders = 6;
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> requests_sent{0};
  std::vector<std::unique_ptr<RawClient>> flooders;
  std::vector<std::thread> threads;
  for (int k = 0; k < kFlooders; ++k) {
    flooders.push_back(std::make_unique<RawClient>(relay.sock));
    threads.emplace_back([&, fd = flooders.back()->fd] {
      const auto acquire = laminar::internal::encode_local_request({laminar::internal::LocalRequest::kAcquire, {}, 0});
      std::string batch;
      for (int i = 0; i < 256; ++i) batch.append(reinterpret_cast<const char*>(acquire.data()), acquire.size());
      std::size_t at = 0;
      while (!stop) {
        pollfd p{fd, POLLOUT, 0};
        if (poll(&p, 1, 20) <= 0) continue;
        const ssize_t n = send(fd, batch.data() + at, batch.size() - at, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n <= 0) continue;
        at = (at + std::size_t(n)) % batch.size();
        requests_sent += std::uint64_t(n) / acquire.size();
      }
    });
  }
  // Every flooder has filled its socket and its buffer at the server, which stopped reading it.
  const bool all_paused = eventually([&] { return relay.stats().read_pauses >= kFlooders; }, 60s);
  const auto during = relay.stats();
  std::chrono::steady_clock::duration slowest{0};
  if (all_paused) slowest = slowest_pull();
  stop = true;
  for (auto& t : threads) t.join();
  REQUIRE(all_paused);
  const auto ms = [](auto d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); };
  std::printf("local_relay_test: %d non-reading clients sent %llu requests; good pull %lld ms beside them, "
              "%lld ms before; %zu reply bytes queued\n",
              kFlooders, static_cast<unsigned long long>(requests_sent.load()), static_cast<long long>(ms(slowest)),
              static_cast<long long>(ms(baseline)), during.queued_bytes);
  // Far below the puller's 10 s relay_timeout; the old one-reply-at-a-time server took about 2 s per
  // non-reading client.
  CHECK(slowest < std::max(4 * baseline, baseline + std::chrono::seconds(1)));
  // Each flooder's buffer overshoots its bound by one reply at most.
  CHECK(during.queued_bytes <= kFlooders * (laminar::LocalRelayServerOptions{}.max_client_buffer_bytes + 64 * 1024));
  CHECK(during.leases >= std::size_t(kFlooders) * 16);

  flooders.clear();
  CHECK(eventually([&] {
    const auto s = relay.stats();
    return s.clients == 1 && s.leases == 0 && s.queued_bytes == 0;
  }));
}

TEST_CASE("local relay: a puller whose kept connection the server closed pulls again on a new one",
          "[relay_local]") {
  auto clock = std::make_shared<laminar::ManualClock>();
  laminar::LocalRelayServerOptions o;
  o.idle_timeout = 10s;
  o.max_clients = 1;
  o.clock = clock;
  InProcessRelay relay(o);
  auto puller = WeightPuller::create_local({relay.sock}).value();
  Engine engine;
  REQUIRE(puller->pull(Version(1), engine.named, false).ok());
  REQUIRE(eventually([&] { return relay.stats().clients == 1 && relay.stats().leases == 0; }));

  // Closed for idleness.
  REQUIRE(clock->advance(11s).ok());
  REQUIRE(eventually([&] { return relay.stats().idle_closed == 1 && relay.stats().clients == 0; }));
  CHECK(puller->newest_version() == Version(1));
  {
    Engine again;
    laminar::Status st = puller->pull(Version(1), again.named, false);
    INFO(st.to_string());
    REQUIRE(st.ok());
    CHECK(again.holds(1));
  }

  // Evicted for another client; the puller's new connection evicts that one in turn.
  RawClient other(relay.sock);
  REQUIRE(eventually([&] { return relay.stats().evicted == 1; }));
  Engine again;
  laminar::Status st = puller->pull(Version(1), again.named, false);
  INFO(st.to_string());
  REQUIRE(st.ok());
  CHECK(again.holds(1));
  CHECK(other.closed_by_server(5s));
  CHECK(relay.stats().grants == 3);
}
