// clocked_thread.h (internal): the background thread of a component that sleeps on its own mutex
// and condition variable until deadlines of a laminar::Clock. start() subscribes to the clock, so a
// jump of a virtual clock wakes the thread, and runs it; stop() raises the flag the thread loops on
// (under the component's mutex, so no wake-up is lost), wakes it, joins it, and only then drops the
// subscription. Not part of the public API.
//
//   struct Impl {
//     std::mutex mu;                     // before the thread: it must outlive it
//     std::condition_variable cv;
//     laminar::internal::ClockedThread thread;
//     void run() { std::unique_lock l(mu); while (!thread.stopping()) clock->wait_until(cv, l, next()); }
//   };
//   impl->thread.start(impl->mu, impl->cv, *clock, [p = impl.get()] { p->run(); });
//   impl->thread.stop();                 // or its destructor
#pragma once

#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>

#include "laminar/clock.h"

namespace laminar::internal {

class ClockedThread {
 public:
  ClockedThread() = default;
  ClockedThread(const ClockedThread&) = delete;
  ClockedThread& operator=(const ClockedThread&) = delete;
  ~ClockedThread() { stop(); }

  // Preconditions:
  //   start has not been called before;
  //   `mu`, `cv` and `clock` outlive this object;
  //   `body` reads stopping() holding `mu`, waits on `cv`, and returns once it is true.
  template <class Body>
  void start(std::mutex& mu, std::condition_variable& cv, Clock& clock, Body body) {
    mu_ = &mu;
    cv_ = &cv;
    wake_ = clock.subscribe([&mu, &cv] {
      std::lock_guard l(mu);
      cv.notify_all();
    });
    thread_ = std::thread(std::move(body));
  }

  // Whether stop() has begun. Read holding the mutex given to start().
  bool stopping() const { return stopping_; }

  // Returns once the thread has ended; a no-op when it never started or has stopped.
  void stop() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard l(*mu_);
      stopping_ = true;
    }
    cv_->notify_all();
    thread_.join();
    wake_.reset();
  }

 private:
  std::mutex* mu_ = nullptr;
  std::condition_variable* cv_ = nullptr;
  bool stopping_ = false;
  ClockSubscription wake_;
  std::thread thread_;
};

}  // namespace laminar::internal
