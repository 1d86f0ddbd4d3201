// Clock: ManualClock's virtual time (steps, jumps, bad input), waking subscribed waiters without
// sleeps, subscriptions that end, and the steady clock's readings.
#include "laminar/clock.h"

#include <catch2/catch.hpp>

#include <atomic>
#include <condition_variable>
#include <future>
#include <mutex>

using namespace std::chrono_literals;
using laminar::Clock;
using laminar::Duration;
using laminar::ManualClock;
using laminar::StatusCode;

TEST_CASE("clock: manual time moves only forward, and only when told", "[clock]") {
  ManualClock clock(5s);
  CHECK(clock.now() == 5s);
  REQUIRE(clock.advance(250ms).ok());
  CHECK(clock.now() == 5250ms);
  REQUIRE(clock.set(1min).ok());
  CHECK(clock.now() == 1min);
  REQUIRE(clock.advance(0s).ok());
  CHECK(clock.now() == 1min);

  const auto refused = [&](const laminar::Status& st, const char* needle) {
    INFO(st.to_string());
    CHECK(st.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(st.message(), Catch::Contains(needle));
    CHECK(clock.now() == 1min);  // a refused call moves nothing
  };
  refused(clock.advance(-1ns), "negative");
  refused(clock.set(59s), "before the current time");
  refused(clock.advance(laminar::kForever), "kForever");
  refused(clock.advance(laminar::kForever - 1min), "kForever");
  refused(clock.set(laminar::kForever), "kForever");
  REQUIRE(clock.advance(laminar::kForever - 1min - 1ns).ok());  // the last instant there is
  CHECK(clock.now() == laminar::kForever - 1ns);
}

TEST_CASE("clock: a waiter on a manual clock wakes when time reaches its deadline", "[clock]") {
  auto clock = std::make_shared<ManualClock>();
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<int> wakes{0};
  auto sub = clock->subscribe([&] {
    ++wakes;
    std::lock_guard<std::mutex> l(mu);
    cv.notify_all();
  });
  auto waiter = std::async(std::launch::async, [&] {
    std::unique_lock<std::mutex> l(mu);
    while (clock->now() < 10s) clock->wait_until(cv, l, 10s);
    return clock->now();
  });
  REQUIRE(clock->advance(4s).ok());
  REQUIRE(clock->advance(5s).ok());
  CHECK(waiter.wait_for(0s) != std::future_status::ready);  // 9 s of 10: it cannot have returned
  REQUIRE(clock->advance(1s).ok());
  REQUIRE(waiter.wait_for(10s) == std::future_status::ready);
  CHECK(waiter.get() == 10s);
  CHECK(wakes.load() == 3);  // one wake per step, whoever waits

  // Once the subscription is gone, its callback is never called again.
  sub.reset();
  REQUIRE(clock->advance(1s).ok());
  CHECK(wakes.load() == 3);
  // A moved subscription keeps its callback registered exactly once.
  auto first = clock->subscribe([&] { ++wakes; });
  laminar::ClockSubscription moved = std::move(first);
  REQUIRE(clock->set(20s).ok());
  CHECK(wakes.load() == 4);
  moved = laminar::ClockSubscription();
  REQUIRE(clock->advance(1s).ok());
  CHECK(wakes.load() == 4);
}

TEST_CASE("clock: a deadline after an instant saturates at both ends of the range", "[clock]") {
  using laminar::deadline_after;
  using laminar::kForever;
  constexpr Duration kMin = Duration::min();
  CHECK(deadline_after(5s, 2s) == 7s);
  CHECK(deadline_after(5s, -7s) == -2s);
  CHECK(deadline_after(5s, 0s) == 5s);
  // kForever is no deadline from any instant, a negative one included.
  CHECK(deadline_after(0s, kForever) == kForever);
  CHECK(deadline_after(-5s, kForever) == kForever);
  // A sum that would reach or pass the end of the range is no deadline either.
  CHECK(deadline_after(kForever - 2s, 1s) == kForever - 1s);
  CHECK(deadline_after(kForever - 2s, 2s) == kForever);
  CHECK(deadline_after(kForever - 2s, 3s) == kForever);
  CHECK(deadline_after(kForever, -1s) == kForever - 1s);
  // A negative timeout stops at the start of the range.
  CHECK(deadline_after(kMin + 2s, -2s) == kMin);
  CHECK(deadline_after(kMin + 2s, -3s) == kMin);
  CHECK(deadline_after(kMin + 2s, -1s) == kMin + 1s);

  // From a clock: its reading at the time of the call.
  ManualClock clock(10s);
  CHECK(deadline_after(clock, 5s) == 15s);
  REQUIRE(clock.advance(3s).ok());
  CHECK(deadline_after(clock, 5s) == 18s);
  CHECK(deadline_after(clock, kForever) == kForever);
}

TEST_CASE("clock: the steady clock never goes back and its coarse reading trails by its slack", "[clock]") {
  std::shared_ptr<Clock> clock = Clock::steady();
  REQUIRE(clock != nullptr);
  CHECK(clock == Clock::steady());  // one per process
  Duration last = clock->now();
  int within_slack = 0;
  constexpr int kReadings = 1000;
  for (int i = 0; i < kReadings; ++i) {
    const Duration before = clock->now();
    const Duration coarse = clock->coarse_now();
    const Duration after = clock->now();
    CHECK(before >= last);
    CHECK(coarse <= after);
    within_slack += coarse >= before - clock->coarse_slack();
    last = after;
  }
  // "Normally" within the slack: a timer tick may come late on a loaded machine, now and then.
  CHECK(within_slack >= kReadings * 99 / 100);
  CHECK(clock->coarse_slack() > 0ns);
  CHECK(clock->coarse_slack() < 1s);

  // A deadline already past returns at once; a real clock needs no subscriber to time out.
  std::mutex mu;
  std::condition_variable cv;
  std::unique_lock<std::mutex> l(mu);
  clock->wait_until(cv, l, clock->now() - 1s);
  const Duration deadline = clock->now() + 20ms;
  while (clock->now() < deadline) clock->wait_until(cv, l, deadline);
  CHECK(clock->now() >= deadline);
}
