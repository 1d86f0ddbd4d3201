#include "laminar/clock.h"

#include <fmt/format.h>
#include <time.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
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

Duration SteadyClock::coarse_now() const noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return std::chrono::seconds(ts.tv_sec) + Duration(ts.tv_nsec);
}

Duration SteadyClock::now() const noexcept {
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

struct ManualClock::State {
  explicit State(Duration start) : now_ns(start.count()) {}

  void wake_all() {
    std::lock_guard<std::mutex> l(mu);
    for (auto& [id, wake] : subscribers) wake();
  }

  std::atomic<std::int64_t> now_ns;
  // Serialises advance() against subscribe/unsubscribe so a callback never runs after its
  // subscription is gone. Lock order: this mutex, then whatever the callback locks.
  std::mutex mu;
  std::map<std::uint64_t, std::function<void()>> subscribers;
  std::uint64_t next_id = 1;
};

ManualClock::ManualClock(Duration start) : s_(std::make_unique<State>(start)) {}
ManualClock::~ManualClock() = default;

Duration ManualClock::now() const noexcept { return Duration(s_->now_ns.load(std::memory_order_acquire)); }

void ManualClock::wait_until(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                             Duration deadline) const {
  // The caller checked now() under `lock`; advance() takes that same lock before notifying (through
  // the subscriber), so a jump past `deadline` cannot slip in between the check and this wait.
  if (now() < deadline) cv.wait(lock);
}

ClockSubscription ManualClock::subscribe(std::function<void()> wake) {
  std::lock_guard<std::mutex> l(s_->mu);
  const std::uint64_t id = s_->next_id++;
  s_->subscribers.emplace(id, std::move(wake));
  return make_subscription(id);
}

void ManualClock::unsubscribe(std::uint64_t id) noexcept {
  std::lock_guard<std::mutex> l(s_->mu);
  s_->subscribers.erase(id);
}

Status ManualClock::advance(Duration d) {
  if (d < Duration::zero()) {
    return invalid_argument(fmt::format("ManualClock::advance: negative step {} ns", d.count()));
  }
  std::int64_t cur = s_->now_ns.load(std::memory_order_acquire);
  do {
    // Time stops short of kForever, which means "no deadline" to every waiter.
    if (d.count() >= kForever.count() - cur) {
      return invalid_argument(
          fmt::format("ManualClock::advance: a step of {} ns from {} ns passes kForever", d.count(), cur));
    }
  } while (!s_->now_ns.compare_exchange_weak(cur, cur + d.count(), std::memory_order_acq_rel));
  s_->wake_all();
  return ok_status();
}

Status ManualClock::set(Duration t) {
  if (t >= kForever) return invalid_argument("ManualClock::set: kForever is not a time");
  std::int64_t cur = s_->now_ns.load(std::memory_order_acquire);
  do {
    if (t.count() < cur) {
      return invalid_argument(
          fmt::format("ManualClock::set: {} ns is before the current time {} ns", t.count(), cur));
    }
  } while (!s_->now_ns.compare_exchange_weak(cur, t.count(), std::memory_order_acq_rel));
  s_->wake_all();
  return ok_status();
}

}  // namespace laminar
