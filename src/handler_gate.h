// handler_gate.h: lets a component remove its message handlers from a shared Transport and then
// know that none of them is still running (removing a handler does not wait for a call in
// progress on the transport's callback thread).
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <utility>

#include "laminar/transport.h"

namespace laminar::internal {

class HandlerGate {
 public:
  // A handler that calls `f` while the gate is open. It holds only the gate, never the component,
  // so the last reference to the component (and to the transport it holds) is never dropped on
  // the transport's own callback thread.
  template <class F>
  MessageHandler wrap(F f) const {
    return [state = state_, f = std::move(f)](Incoming in) {
      {
        std::lock_guard lock(state->mu);
        if (!state->open) return;
        ++state->running;
      }
      f(std::move(in));
      std::lock_guard lock(state->mu);
      if (--state->running == 0) state->cv.notify_all();
    };
  }

  // Refuses every later call and waits for the running ones to return.
  void close() const {
    std::unique_lock lock(state_->mu);
    state_->open = false;
    state_->cv.wait(lock, [&] { return state_->running == 0; });
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool open = true;
    int running = 0;
  };
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace laminar::internal
