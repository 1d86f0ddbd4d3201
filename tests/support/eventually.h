// eventually.h: waiting, in tests, for a condition another thread or process brings about.
//
// Prefer waiting on the event itself (a future, a child's line, Endpoint::on_close, a ManualClock
// step). Where only a state can be read (a counter a handler bumps, a peer's view of a connection),
// eventually() reads it until it holds: the condition is the synchronisation, never a fixed delay.
//
//   REQUIRE(laminar::testing::eventually([&] { return served.load() == 1; }));
#pragma once

#include <algorithm>
#include <chrono>
#include <thread>

namespace laminar::testing {

// Evaluates `pred` until it returns true (then true) or `timeout` has passed (then false, after
// one last evaluation). Between evaluations it pauses from 10 us growing to 2 ms, only so the poll
// does not take a core from the threads it waits for: the result never depends on the pause.
template <class Pred>
bool eventually(Pred&& pred, std::chrono::nanoseconds timeout = std::chrono::seconds(10)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::chrono::microseconds pause(10);
  for (;;) {
    if (pred()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return pred();
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(2));
  }
}

}  // namespace laminar::testing
