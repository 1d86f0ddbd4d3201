// clock_wait.h: condition-variable waits read from a laminar::Clock, shared by the relay tier and
// the remote queue.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>

#include "laminar/clock.h"

namespace laminar::internal {

// The clock of an options struct: the steady clock when none is given.
inline std::shared_ptr<Clock> clock_or_steady(std::shared_ptr<Clock> clock) {
  return clock ? std::move(clock) : Clock::steady();
}

// Preconditions:
//   `lock` holds the mutex `cv` is used with;
//   whoever makes `done` true notifies `cv`, and a subscription to `clock` does too (so a jump of a
//   virtual clock wakes the wait).
// Waits until done() or the clock reaches `deadline`; returns done().
template <class Pred>
bool wait_until(const Clock& clock, std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                Duration deadline, Pred done) {
  while (!done()) {
    if (deadline != kForever && clock.now() >= deadline) return false;
    clock.wait_until(cv, lock, deadline);
  }
  return true;
}

}  // namespace laminar::internal
