#include "laminar/clock.h"

#include <fmt/format.h>
#include <time.h>

#include <utility>
#include <vector>

namespace laminar {

ClockSubscription& ClockSubscription::operator=(ClockSubscription&& o) noexcept {
  if (this != &o) {
    reset();
    clock_ = o.clock_;
    id_ = o.id_;
    o.clock_ = nullptr;
  }
  return *this;
}

void ClockSubscription::reset() noexcept {
  if (clock_ != nullptr) {
    clock_->unsubscribe(id_);
    clock_ = nullptr;
  }
}

ClockSubscription Clock::subscribe(std::function<void()> /*wake*/) {
  // A real clock's waits time out by themselves, so nobody needs waking.
  return ClockSubscription();
}

std::shared_ptr<Clock> Clock::steady() {
  static const std::shared_ptr<Clock> clock = std::make_shared<SteadyClock>();
  return clock;
}

SteadyClock::SteadyClock() {
  timespec res{};
  ::clock_getres(CLOCK_MONOTONIC_COARSE, &res);
  slack_ = 2 * (std::chrono::seconds(res.tv_sec) + Duration(res.tv_nsec));
}

Clock::Duration SteadyClock::coarse_now() const noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return std::chrono::seconds(ts.tv_sec) + Duration(ts.tv_nsec);
}

Clock::Duration SteadyClock::now() const noexcept {
  return std::chrono::duration_cast<Duration>(std::chrono::steady_clock::now().time_since_epoch());
}

void SteadyClock::wait_until(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                             Duration deadline) const {
  if (deadline == kForever) {
    cv.wait(lock);
    return;
  }
  cv.wait_until(lock, std::chrono::steady_clock::time_point(
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(deadline)));
}

void ManualClock::wait_until(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                             Duration deadline) const {
  // The caller checked now() under `lock`; advance() takes that same lock before notifying (through
  // the subscriber), so a jump past `deadline` cannot slip in between the check and this wait.
  if (now() < deadline) cv.wait(lock);
}

ClockSubscription ManualClock::subscribe(std::function<void()> wake) {
  std::lock_guard<std::mutex> l(mu_);
  const std::uint64_t id = next_id_++;
  subscribers_.emplace(id, std::move(wake));
  return make_subscription(id);
}

void ManualClock::unsubscribe(std::uint64_t id) noexcept {
  std::lock_guard<std::mutex> l(mu_);
  subscribers_.erase(id);
}

void ManualClock::wake_all() {
  std::lock_guard<std::mutex> l(mu_);
  for (auto& [id, wake] : subscribers_) wake();
}

Status ManualClock::advance(Duration d) {
  if (d < Duration::zero()) {
    return invalid_argument(fmt::format("ManualClock::advance: negative step {} ns", d.count()));
  }
  std::int64_t cur = now_ns_.load(std::memory_order_acquire);
  do {
    // Time stops short of kForever, which means "no deadline" to every waiter.
    if (d.count() >= kForever.count() - cur) {
      return invalid_argument(
          fmt::format("ManualClock::advance: a step of {} ns from {} ns passes kForever", d.count(), cur));
    }
  } while (!now_ns_.compare_exchange_weak(cur, cur + d.count(), std::memory_order_acq_rel));
  wake_all();
  return ok_status();
}

Status ManualClock::set(Duration t) {
  if (t >= kForever) return invalid_argument("ManualClock::set: kForever is not a time");
  std::int64_t cur = now_ns_.load(std::memory_order_acquire);
  do {
    if (t.count() < cur) {
      return invalid_argument(
          fmt::format("ManualClock::set: {} ns is before the current time {} ns", t.count(), cur));
    }
  } while (!now_ns_.compare_exchange_weak(cur, t.count(), std::memory_order_acq_rel));
  wake_all();
  return ok_status();
}

}  // namespace laminar
