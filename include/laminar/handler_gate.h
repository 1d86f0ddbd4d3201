// handler_gate.h: HandlerGate, for a part that registers callbacks on a shared Transport and must
// know, before its state goes away, that none of them is still running.
//
// Removing a handler (on_message(type, {})) or an on_close subscription does not wait for a call
// already in progress on the transport's callback thread. A part that shares its process's
// Transport therefore wraps each callback in its gate: close() makes every later call do nothing
// and waits for the running ones to return, after which the part may free what they touch.
//
//   auto part = std::make_shared<Part>();
//   laminar::HandlerGate gate;
//   auto st = transport->on_message(kPartMessage, gate.wrap([p = part.get()](laminar::Incoming in) {
//     p->handle(std::move(in));
//   }));
//   // ... later, tearing the part down:
//   st = transport->on_message(kPartMessage, {});  // no new calls
//   gate.close();                                  // and none still running: `part` may go
//
// Threads. wrap() and close() may be called from any thread, and a wrapped callback runs on
// whichever thread the transport calls it from. A wrapped callback holds only the gate's shared
// state, never the part, so the last reference to the part (and to the Transport it holds) is never
// dropped on the transport's own callback thread. close() must not be called from inside a callback
// of the same gate: it would wait for itself.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <utility>

namespace laminar {

class HandlerGate {
 public:
  // A callback of one argument (a MessageHandler's Incoming, an on_close callback's Status) that
  // calls `f` with it while the gate is open, and does nothing once it is closed.
  template <class F>
  auto wrap(F f) const {
    return [state = state_, f = std::move(f)](auto arg) {
      {
        std::lock_guard lock(state->mu);
        if (!state->open) return;
        ++state->running;
      }
      f(std::move(arg));
      std::lock_guard lock(state->mu);
      if (--state->running == 0) state->cv.notify_all();
    };
  }

  // Refuses every later call and waits for the running ones to return. Calling it again returns at
  // once.
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

}  // namespace laminar
