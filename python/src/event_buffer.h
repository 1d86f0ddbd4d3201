// event_buffer.h: how a background callback of a C++ part reaches Python without running Python.
//
// The part's on_event runs on one of its own threads, which does not hold the GIL, so it only
// appends a copy of the event here; the Python object drains the buffer from its own calls (with
// the GIL). Bounded: past kCapacity the oldest event goes and is counted, so a host that never
// drains loses old events, not memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace laminar::python {

template <class Event>
class EventBuffer {
 public:
  static constexpr std::size_t kCapacity = 4096;

  // The callback to hand the part; it keeps the buffer alive as long as the part keeps it.
  static std::function<void(const Event&)> sink(const std::shared_ptr<EventBuffer>& buffer) {
    return [buffer](const Event& e) { buffer->push(e); };
  }

  std::vector<Event> drain() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Event> out(events_.begin(), events_.end());
    events_.clear();
    return out;
  }

  std::uint64_t dropped() const {
    std::lock_guard<std::mutex> lock(mu_);
    return dropped_;
  }

 private:
  void push(const Event& e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (events_.size() == kCapacity) {
      events_.pop_front();
      ++dropped_;
    }
    events_.push_back(e);
  }

  mutable std::mutex mu_;
  std::deque<Event> events_;
  std::uint64_t dropped_ = 0;
};

}  // namespace laminar::python
