// transport_peer: the other process of transport_multiprocess_test (and a small example of a
// transport server). The cluster token comes from LAMINAR_TEST_TOKEN (never argv, which `ps` shows);
// LAMINAR_TEST_HANDSHAKE_MS and LAMINAR_TEST_MAX_UNAUTHENTICATED, when set, override those options;
// LAMINAR_TEST_NO_INBOX=1 sets max_inbox_bytes to 0 (messages nobody handles are dropped).
//
//   transport_peer serve <region_bytes> [host]    prints "ADDRESS host:port", serves until told to exit
//   transport_peer client <address> exchange <k>  echo requests + get/put slice k of the server region
//   transport_peer client <address> auth          prints "STATUS <code>" of connecting
//   transport_peer client <address> probe         an echo request every 100 ms: prints "OK" or "ERR <code>"
//   transport_peer client <address> storm         connects and closes in a loop for a minute, whether
//                                                 or not anyone listens; prints "CONNECTED <n>" per 10
//   transport_peer client <address> flood <k>     an authenticated peer sending what nobody handles:
//                                                 k one-way messages of 64 KiB of an application type,
//                                                 then requests of it and of an unserved laminar type;
//                                                 prints "FLOOD <code>=<count> ..." of the answers
//   transport_peer client <address> spray         sends kSprayed messages from kSprayThreads threads
//                                                 until killed, printing "SENT <n>" as it goes
//   transport_peer client <address> putter        puts the whole server region from kSprayThreads
//                                                 threads until killed, printing "PUT <n>" per put
// A server asked kSpray sprays the asker the same way.
//
// Region contents follow pattern(seed): 64-bit word i holds seed ^ (i * golden ratio constant).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "laminar/transport.h"
#include "transport/protocol.h"
#include "transport/testing.h"
#include "transport_peer_protocol.h"

using namespace std::chrono_literals;
using namespace laminar;
using namespace laminar::test_peer;

namespace {

TransportOptions options_from_env() {
  TransportOptions o;
  const char* token = std::getenv("LAMINAR_TEST_TOKEN");
  o.cluster_token = token != nullptr ? token : "";
  o.connect_timeout = 10s;
  o.operation_timeout = 10s;
  if (const char* ms = std::getenv("LAMINAR_TEST_HANDSHAKE_MS")) {
    o.handshake_timeout = std::chrono::milliseconds(std::strtoll(ms, nullptr, 10));
  }
  if (const char* n = std::getenv("LAMINAR_TEST_MAX_UNAUTHENTICATED")) {
    o.max_unauthenticated_connections = std::strtoull(n, nullptr, 10);
  }
  if (const char* off = std::getenv("LAMINAR_TEST_NO_INBOX"); off != nullptr && std::string(off) == "1") {
    o.max_inbox_bytes = 0;
  }
  return o;
}

int fail(const char* what, const Status& s) {
  std::fprintf(stderr, "transport_peer: %s: %s\n", what, s.to_string().c_str());
  return 2;
}

// Sends kSprayed messages to `ep` from kSprayThreads threads until a send fails (the connection
// ended) or `stop` is set, printing "SENT <n>" every kSprayLineEvery messages. Returns at once; the
// threads are joined by the caller.
void spray(Endpoint ep, std::atomic<bool>& stop, std::vector<std::thread>& threads) {
  static std::atomic<std::uint64_t> sent{0};
  static std::mutex print_mu;
  for (int i = 0; i < kSprayThreads; ++i) {
    threads.emplace_back([ep, &stop]() mutable {
      const Message m = Message::from_bytes(kSprayed, std::vector<std::byte>(kSprayBytes, std::byte{0x5a}));
      while (!stop.load() && ep.send(m).ok()) {
        const std::uint64_t n = sent.fetch_add(1) + 1;
        if (n % kSprayLineEvery == 0) {
          std::lock_guard lock(print_mu);
          std::printf("SENT %llu\n", static_cast<unsigned long long>(n));
          std::fflush(stdout);
        }
      }
    });
  }
}

int serve(std::size_t region_bytes, const std::string& host) {
  auto created = Transport::create(options_from_env());
  if (!created.ok()) return fail("create", created.status());
  std::unique_ptr<Transport> t = std::move(created).value();
  auto region = t->allocate(region_bytes);
  if (!region.ok()) return fail("allocate", region.status());
  fill_pattern(region->bytes(), kServerSeed);

  std::mutex mu;
  std::condition_variable cv;
  bool exit_now = false;
  std::set<laminar::EndpointId> peers;
  std::atomic<bool> stop_spraying{false};
  std::vector<std::thread> sprayers;  // guarded by mu
  std::vector<Status> installed;
  installed.push_back(t->on_message(kEcho, [&](Incoming in) {
    {
      std::lock_guard lock(mu);
      peers.insert(in.from.id());
    }
    (void)in.from.reply(in, in.message);
  }));
  installed.push_back(t->on_message(kRegion, [&](Incoming in) {
    (void)in.from.reply(in, Message::from_bytes(kRegion, region->remote().serialize()));
  }));
  installed.push_back(t->on_message(kVerify, [&](Incoming in) {
    auto v = VerifyRequest::parse(in.message.text());
    if (!v.ok()) {
      (void)in.from.reply_error(in, v.status());
      return;
    }
    if (v->offset + v->length > region->size()) {
      (void)in.from.reply_error(in, invalid_argument("verify range outside the region"));
      return;
    }
    const Status s = check_pattern(region->bytes().subspan(v->offset, v->length), v->seed, v->offset);
    (void)(s.ok() ? in.from.reply(in, Message::from_string(kVerify, "ok")) : in.from.reply_error(in, s));
  }));
  installed.push_back(t->on_message(kHang, [](Incoming) {}));
  installed.push_back(t->on_message(kPeers, [&](Incoming in) {
    std::size_t n;
    {
      std::lock_guard lock(mu);
      n = peers.size();
    }
    (void)in.from.reply(in, Message::from_string(kPeers, std::to_string(n)));
  }));
  installed.push_back(t->on_message(kDropped, [&](Incoming in) {
    const std::uint64_t n = t->stats().dropped_frames;
    (void)in.from.reply(in, Message::from_string(kDropped, std::to_string(n)));
  }));
  installed.push_back(t->on_message(kReplaced, [&](Incoming in) {
    const std::uint64_t n = t->stats().workers_replaced;
    (void)in.from.reply(in, Message::from_string(kReplaced, std::to_string(n)));
  }));
  installed.push_back(t->on_message(kSpray, [&](Incoming in) {
    (void)in.from.reply(in, Message::from_string(kSpray, "spraying"));
    std::lock_guard lock(mu);
    spray(in.from, stop_spraying, sprayers);
  }));
  installed.push_back(t->on_message(kExit, [&](Incoming in) {
    (void)in.from.reply(in, Message::from_string(kExit, "bye"));
    std::lock_guard lock(mu);
    exit_now = true;
    cv.notify_all();
  }));
  for (const Status& st : installed) {
    if (!st.ok()) return fail("on_message", st);
  }

  auto address = t->listen(host, 0);
  if (!address.ok()) return fail("listen", address.status());
  std::printf("ADDRESS %s\n", address->c_str());
  std::fflush(stdout);
  std::unique_lock lock(mu);
  cv.wait(lock, [&] { return exit_now; });
  stop_spraying = true;
  for (auto& th : sprayers) th.join();
  return 0;
}

int exchange(Endpoint& ep, Transport& t, int k) {
  for (int i = 0; i < 100; ++i) {
    const std::string text = "client " + std::to_string(k) + " message " + std::to_string(i);
    auto r = ep.request(Message::from_string(kEcho, text));
    if (!r.ok()) return fail("echo", r.status());
    if (r->text() != text)
      return fail("echo", data_loss("echo came back different: " + std::string(r->text())));
  }
  auto desc = ep.request(Message::from_string(kRegion, ""));
  if (!desc.ok()) return fail("region", desc.status());
  auto remote = RemoteRegion::deserialize(desc->body);
  if (!remote.ok()) return fail("region", remote.status());
  const std::size_t slice = kClientSliceBytes;
  const std::size_t offset = static_cast<std::size_t>(k) * slice;
  auto local = t.allocate(slice);
  if (!local.ok()) return fail("allocate", local.status());
  Status s = ep.get(*local, 0, *remote, offset, slice).get();
  if (!s.ok()) return fail("get", s);
  s = check_pattern(local->bytes(), kServerSeed, offset);
  if (!s.ok()) return fail("get content", s);
  const std::uint64_t seed = kClientSeedBase + static_cast<std::uint64_t>(k);
  fill_pattern(local->bytes(), seed, offset);
  s = ep.put(*local, 0, *remote, offset, slice).get();
  if (!s.ok()) return fail("put", s);
  auto verified = ep.request(Message::from_string(kVerify, VerifyRequest{seed, offset, slice}.to_string()));
  if (!verified.ok()) return fail("verify", verified.status());
  std::printf("DONE\n");
  std::fflush(stdout);
  return 0;
}

// Keeps connecting to an address that comes and goes (see "a transport shut down while clients keep
// connecting" in transport_multiprocess_test), until the test kills it.
int storm(Transport& t, const std::string& address) {
  int connected = 0;
  for (;;) {
    auto ep = t.connect(address, 500ms);
    if (!ep.ok()) {
      // Nobody listens between two rounds: connecting again at once would only spin a core.
      std::this_thread::sleep_for(1ms);
      continue;
    }
    ep->close();
    if (++connected % 10 == 0) {
      std::printf("CONNECTED %d\n", connected);
      std::fflush(stdout);
    }
  }
}

int flood(Endpoint& ep, int k) {
  constexpr MessageType kNobodys = 0x0BAD;
  const std::vector<std::byte> body(64 << 10, std::byte{0x5a});
  for (int i = 0; i < k; ++i) {
    if (Status s = ep.send(Message::from_bytes(kNobodys, body)); !s.ok()) return fail("send", s);
  }
  std::map<std::string, int> answers;
  for (int i = 0; i < 64; ++i) {
    const bool reserved = i % 2 == 1;
    const Message m = Message::from_bytes(reserved ? kLaminarMessageTypeFirst + 0xBAD : kNobodys, body);
    auto r = reserved ? internal::request_protocol(ep, m, 10s) : ep.request(m, 10s);
    ++answers[std::string(status_code_name(r.status().code()))];
  }
  std::printf("FLOOD");
  for (const auto& [code, n] : answers) std::printf(" %s=%d", code.c_str(), n);
  std::printf("\n");
  std::fflush(stdout);
  return 0;
}

int client(const std::string& address, const std::string& mode, int k) {
  auto created = Transport::create(options_from_env());
  if (!created.ok()) return fail("create", created.status());
  std::unique_ptr<Transport> t = std::move(created).value();
  if (mode == "storm") return storm(*t, address);
  auto ep = t->connect(address);
  if (mode == "auth") {
    std::printf("STATUS %s\n", std::string(status_code_name(ep.status().code())).c_str());
    std::fflush(stdout);
    return 0;
  }
  if (!ep.ok()) return fail("connect", ep.status());
  if (mode == "exchange") return exchange(*ep, *t, k);
  if (mode == "flood") return flood(*ep, k);
  if (mode == "spray") {
    std::atomic<bool> never{false};
    std::vector<std::thread> threads;
    spray(*ep, never, threads);
    for (auto& th : threads) th.join();
    return fail("spray", ep->status());
  }
  if (mode == "putter") {
    auto desc = ep->request(Message::from_string(kRegion, ""));
    if (!desc.ok()) return fail("region", desc.status());
    auto remote = RemoteRegion::deserialize(desc->body);
    if (!remote.ok()) return fail("region", remote.status());
    std::atomic<std::uint64_t> puts{0};
    std::vector<std::thread> threads;
    for (int i = 0; i < kSprayThreads; ++i) {
      threads.emplace_back([&] {
        auto local = t->allocate(remote->size);
        if (!local.ok()) return;
        while (ep->put(*local, 0, *remote, 0, remote->size).get().ok()) {
          std::printf("PUT %llu\n", static_cast<unsigned long long>(++puts));
          std::fflush(stdout);
        }
      });
    }
    for (auto& th : threads) th.join();
    return fail("put", ep->status());
  }
  if (mode == "probe") {
    for (int i = 0; i < 600; ++i) {
      auto r = ep->request(Message::from_string(kEcho, "probe"), 500ms);
      if (r.ok()) {
        std::printf("OK\n");
      } else {
        std::printf("ERR %s %s\n", std::string(status_code_name(r.status().code())).c_str(),
                    r.status().message().c_str());
      }
      std::fflush(stdout);
      // Paces the probes (10 a second): the test reads their results, never their timing.
      std::this_thread::sleep_for(100ms);
    }
    return 0;
  }
  std::fprintf(stderr, "transport_peer: unknown client mode '%s'\n", mode.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() >= 2 && args[0] == "serve") {
    return serve(std::strtoull(args[1].c_str(), nullptr, 10), args.size() >= 3 ? args[2] : "127.0.0.1");
  }
  if (args.size() >= 3 && args[0] == "client") {
    return client(args[1], args[2], args.size() >= 4 ? std::atoi(args[3].c_str()) : 0);
  }
  std::fprintf(stderr, "usage: transport_peer serve <bytes> [host] | client <address> <mode> [k]\n");
  return 2;
}
