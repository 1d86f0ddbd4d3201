// clock.h: Clock, the one source of time for every laminar timeout, lease and deadline.
//
// Components never read std::chrono clocks directly; they take a Clock. In production that is the
// steady clock (Clock::steady()). Tests and the cluster simulator pass a ManualClock instead and
// move time themselves, so a lease expiry or a group timeout happens exactly when they say, in
// virtual time, with no sleeps. A component that blocks on a condition variable waits through
// Clock::wait_until and subscribes to the clock, so a jump of virtual time wakes it up.
//
// Threads: a clock runs none. Every call is thread-safe; a ManualClock calls its subscribers'
// wake-ups on the thread that advances it.
//
//   auto clock = std::make_shared<laminar::ManualClock>();
//   std::mutex mu;
//   std::condition_variable cv;
//   auto sub = clock->subscribe([&] { std::lock_guard<std::mutex> l(mu); cv.notify_all(); });
//   // waiter: std::unique_lock l(mu); while (clock->now() < t) clock->wait_until(cv, l, t);
//   auto st = clock->advance(std::chrono::seconds(30));  // the waiter wakes and sees the new time
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "laminar/status.h"

namespace laminar {

// The one duration type of laminar: every timeout, lease, deadline and instant is one of these.
// Calls accept any std::chrono duration that converts without loss (500ms, 2s, ...).
using Duration = std::chrono::nanoseconds;
// "No deadline", wherever a Duration is a timeout.
inline constexpr Duration kForever = Duration::max();

// The instant `timeout` after `from`, saturating: a timeout of kForever, or one that would reach
// the end of Duration's range, is no deadline (kForever); a negative one that would pass its start
// is Duration::min().
constexpr Duration deadline_after(Duration from, Duration timeout) noexcept {
  if (timeout == kForever) return kForever;
  if (timeout > Duration::zero() && from >= kForever - timeout) return kForever;
  if (timeout < Duration::zero() && from < Duration::min() - timeout) return Duration::min();
  return from + timeout;
}

class Clock;

// Keeps a wake-up callback registered with a clock; unregisters it on destruction. Once the
// destructor returns the callback is not running and will not run again.
class ClockSubscription {
 public:
  ClockSubscription() = default;
  ClockSubscription(const ClockSubscription&) = delete;
  ClockSubscription& operator=(const ClockSubscription&) = delete;
  ClockSubscription(ClockSubscription&& o) noexcept : clock_(o.clock_), id_(o.id_) { o.clock_ = nullptr; }
  ClockSubscription& operator=(ClockSubscription&& o) noexcept;
  ~ClockSubscription() { reset(); }
  void reset() noexcept;

 private:
  friend class Clock;
  ClockSubscription(Clock* clock, std::uint64_t id) : clock_(clock), id_(id) {}
  Clock* clock_ = nullptr;
  std::uint64_t id_ = 0;
};

class Clock {
 public:
  // laminar::Duration itself, so an implementation outside the namespace can name it plainly.
  using Duration = laminar::Duration;

  virtual ~Clock() = default;

  // Time since the clock's own epoch (durations and instants share the one type, Duration). Never
  // decreases.
  virtual Duration now() const noexcept = 0;

  // A cheaper reading, for a caller that only asks whether a deadline may have come: never after
  // now(), and normally no more than coarse_slack() before it. By default now() itself, with no
  // slack.
  virtual Duration coarse_now() const noexcept { return now(); }
  virtual Duration coarse_slack() const noexcept { return Duration::zero(); }

  // Preconditions:
  //   `lock` holds the mutex `cv` is used with.
  // Blocks until `cv` is notified or now() >= deadline (kForever: no deadline). May return early;
  // callers re-check their condition and the time in a loop.
  virtual void wait_until(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                          Duration deadline) const = 0;

  // Registers `wake`, called after every jump of a virtual clock so that threads blocked in
  // wait_until re-check (wake typically locks the waiter's mutex and notifies its condition
  // variables). A real clock never calls it. `wake` must not call back into this clock.
  [[nodiscard]] virtual ClockSubscription subscribe(std::function<void()> wake);

  // The process-wide steady (monotonic, real-time) clock.
  static std::shared_ptr<Clock> steady();

 protected:
  ClockSubscription make_subscription(std::uint64_t id) { return ClockSubscription(this, id); }

 private:
  friend class ClockSubscription;
  virtual void unsubscribe(std::uint64_t /*id*/) noexcept {}
};

// The instant `timeout` after clock.now(), saturating as above.
inline Duration deadline_after(const Clock& clock, Duration timeout) noexcept {
  return deadline_after(clock.now(), timeout);
}

// std::chrono::steady_clock behind the Clock interface.
class SteadyClock final : public Clock {
 public:
  SteadyClock();
  Duration now() const noexcept override;
  // CLOCK_MONOTONIC_COARSE, the time of the last timer tick: about a quarter of now()'s cost.
  Duration coarse_now() const noexcept override;
  // Two of its ticks (4 ms each at the usual 250 Hz): one it may lag by, one for a late tick.
  Duration coarse_slack() const noexcept override { return slack_; }
  void wait_until(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                  Duration deadline) const override;

 private:
  Duration slack_;
};

// Virtual time that only moves when told to. Starts at `start`. Thread-safe: any thread may read
// it while one thread (the test or the simulator) advances it.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(Duration start = Duration::zero());
  ~ManualClock() override;

  Duration now() const noexcept override;
  // Waits for a notification only: time cannot pass here unless someone advances it, and
  // advance() wakes every subscriber.
  void wait_until(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                  Duration deadline) const override;
  [[nodiscard]] ClockSubscription subscribe(std::function<void()> wake) override;

  // Moves time forward by `d`, then wakes every subscriber. kInvalidArgument for a negative `d`, or
  // one that would reach kForever.
  Status advance(Duration d);
  // Jumps to `t`. kInvalidArgument when `t` is before now() (time never goes backwards) or is
  // kForever.
  Status set(Duration t);

 private:
  struct State;
  void unsubscribe(std::uint64_t id) noexcept override;
  std::unique_ptr<State> s_;
};

}  // namespace laminar
