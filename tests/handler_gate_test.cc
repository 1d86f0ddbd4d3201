// HandlerGate: a wrapped callback runs while the gate is open; close() waits for a call in progress
// and turns every later call into a no-op; message handlers and on_close callbacks of a real
// Transport, gated.
#include "laminar/handler_gate.h"

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "eventually.h"
#include "laminar/transport.h"
#include "make_transport.h"

using laminar::Endpoint;
using laminar::HandlerGate;
using laminar::Incoming;
using laminar::Message;
using laminar::Status;
using laminar::StatusCode;
using laminar::testing::eventually;
using laminar::testing::make_transport;
using namespace std::chrono_literals;

namespace {

const char* kToken = "handler-gate-test-token-0123456789";
// Application message types (below kLaminarMessageTypeFirst).
constexpr laminar::MessageType kGatedMessage = 1;
constexpr laminar::MessageType kMarkerMessage = 2;

}  // namespace

TEST_CASE("handler gate: the usage example of handler_gate.h compiles and runs", "[handler_gate]") {
  struct Part {
    std::atomic<int> handled{0};
    void handle(Incoming) { ++handled; }
  };
  auto transport = make_transport(kToken);
  const std::string address = transport->listen("127.0.0.1", 0).value();
  auto client = make_transport(kToken);
  constexpr laminar::MessageType kPartMessage = kGatedMessage;
  // From the header.
  auto part = std::make_shared<Part>();
  laminar::HandlerGate gate;
  auto st = transport->on_message(kPartMessage, gate.wrap([p = part.get()](laminar::Incoming in) {
    p->handle(std::move(in));
  }));
  // ... (a peer's message is handled)
  REQUIRE(st.ok());
  Endpoint ep = client->connect(address).value();
  REQUIRE(ep.send(Message::from_string(kPartMessage, "hi")).ok());
  REQUIRE(eventually([&] { return part->handled.load() == 1; }));
  // ... later, tearing the part down:
  st = transport->on_message(kPartMessage, {});  // no new calls
  gate.close();                                  // and none still running: `part` may go
  // End of the example.
  CHECK(st.ok());
  CHECK(part->handled.load() == 1);
}

TEST_CASE("handler gate: close waits for a call in progress and turns later calls into no-ops", "[handler_gate]") {
  HandlerGate gate;
  std::atomic<int> sum{0};
  std::atomic<int> probes{0};
  std::atomic<bool> left_f{false};
  std::promise<void> entered;
  std::future<void> inside = entered.get_future();
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  auto call = gate.wrap([&](int x) {
    if (x == 0) {
      ++probes;
      return;
    }
    sum += x;
    if (x == 1) {
      entered.set_value();
      released.wait();
      left_f = true;
    }
  });
  std::thread caller([&] { call(1); });
  REQUIRE(inside.wait_for(10s) == std::future_status::ready);
  // Whether the call in f had returned when close() did.
  auto closed = std::async(std::launch::async, [&] {
    gate.close();
    return left_f.load();
  });
  // Once a probe does nothing, close() has shut the gate and waits: only then is f let go.
  REQUIRE(eventually([&] {
    const int before = probes.load();
    call(0);
    return probes.load() == before;
  }));
  release.set_value();
  REQUIRE(closed.wait_for(10s) == std::future_status::ready);
  CHECK(closed.get());
  caller.join();
  CHECK(sum == 1);

  call(2);
  CHECK(sum == 1);
  // A second close has nothing to wait for.
  gate.close();
  // A gate's copies share it: a callback wrapped by a copy is closed too.
  const HandlerGate copy = gate;
  auto later = copy.wrap([&](int x) { sum += x; });
  later(4);
  CHECK(sum == 1);
}

TEST_CASE("handler gate: a transport's gated handler runs until close, then drops its messages", "[handler_gate]") {
  auto server = make_transport(kToken);
  auto client = make_transport(kToken);
  const std::string address = server->listen("127.0.0.1", 0).value();
  HandlerGate gate;
  std::atomic<int> gated{0};
  std::atomic<int> markers{0};
  REQUIRE(server->on_message(kGatedMessage, gate.wrap([&](Incoming) { ++gated; })).ok());
  REQUIRE(server->on_message(kMarkerMessage, [&](Incoming) { ++markers; }).ok());
  Endpoint ep = client->connect(address).value();

  REQUIRE(ep.send(Message::from_string(kGatedMessage, "open")).ok());
  REQUIRE(eventually([&] { return gated.load() == 1; }));
  gate.close();
  REQUIRE(ep.send(Message::from_string(kGatedMessage, "closed")).ok());
  REQUIRE(ep.send(Message::from_string(kMarkerMessage, "after")).ok());
  // Handlers run one at a time in the order their messages came: once the marker has been
  // handled, so has the message sent before it.
  REQUIRE(eventually([&] { return markers.load() == 1; }));
  CHECK(gated.load() == 1);
  (void)server->on_message(kGatedMessage, {});
  (void)server->on_message(kMarkerMessage, {});
}

TEST_CASE("handler gate: gated on_close callbacks get their Status while the gate is open", "[handler_gate]") {
  auto server = make_transport(kToken);
  auto client = make_transport(kToken);
  const std::string address = server->listen("127.0.0.1", 0).value();
  Endpoint ep = client->connect(address).value();
  HandlerGate gate;
  std::promise<Status> closed;
  auto watch = ep.on_close(gate.wrap([&](Status st) { closed.set_value(st); }));
  REQUIRE(watch.ok());
  ep.close();
  auto reason = closed.get_future();
  REQUIRE(reason.wait_for(10s) == std::future_status::ready);
  CHECK(reason.get().code() == StatusCode::kCancelled);

  // On a closed endpoint a callback registered now is called too. Gated by a closed gate it does
  // nothing, which shows once an ungated one registered after it has run.
  gate.close();
  std::atomic<int> gated_calls{0};
  auto gated = ep.on_close(gate.wrap([&](Status) { ++gated_calls; }));
  REQUIRE(gated.ok());
  std::promise<void> after;
  auto ungated = ep.on_close([&](Status) { after.set_value(); });
  REQUIRE(ungated.ok());
  REQUIRE(after.get_future().wait_for(10s) == std::future_status::ready);
  CHECK(gated_calls.load() == 0);
}
