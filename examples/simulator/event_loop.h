// event_loop.h: the simulator's discrete-event loop: a binary heap of events ordered by virtual
// time, ties broken by the order they were scheduled, driving a laminar::ManualClock.
//
// Setting a ManualClock wakes its subscribers (a TrajectoryQueue takes its lock and notifies its
// waiters), which would cost more than the heap work of an event; so the clock follows the loop's
// time only when clock() is asked for it, before a call into a component that reads it.
//
//   EventLoop loop;
//   loop.at(seconds(2.5), Event{EventKind::kTrainDone});
//   while (std::optional<Event> e = loop.next()) handle(*e);  // loop.now() is e's time
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <queue>
#include <vector>

#include "laminar/clock.h"

namespace laminar::sim::internal {

enum class EventKind : std::uint8_t {
  kSegmentEnd,     // instance `a` reaches the end of its decode segment `epoch`
  kToolReturn,     // sample `a`'s environment answered (its incarnation `epoch`)
  kInstanceReady,  // instance `a` finished loading weights, migrating or recovering (`epoch`)
  kSampleArrive,   // sample `b` migrated into instance `a` (its incarnation `epoch`)
  kTrainDone,      // the trainer finished step `a`
  kPublish,        // version `a` is published (the trainer is free again)
  kRelayArrive,    // relay `a` holds version `b`
  kRepackTick,     // Laminar: time to plan a repack
  kFailure,        // a rollout node fails
  kDispatch,       // hand pooled samples to instances with room, after this instant's other events
};

struct Event {
  EventKind kind = EventKind::kSegmentEnd;
  std::int64_t a = 0;
  std::int64_t b = 0;
  std::uint64_t epoch = 0;
};

class EventLoop {
 public:
  EventLoop() : clock_(std::make_shared<ManualClock>()) {}

  // The clock, brought up to now().
  const std::shared_ptr<ManualClock>& clock() {
    if (now_ > clock_->now()) (void)clock_->set(now_);
    return clock_;
  }
  Duration now() const { return now_; }

  // Preconditions: t >= now().
  void at(Duration t, Event e) { heap_.push(Entry{t, next_seq_++, e}); }
  void after(Duration d, Event e) { at(now() + d, e); }

  // The earliest event, with now() at its time; nullopt when none is left.
  std::optional<Event> next() {
    if (heap_.empty()) return std::nullopt;
    Entry top = heap_.top();
    heap_.pop();
    now_ = std::max(now_, top.time);
    ++processed_;
    return top.event;
  }

  std::int64_t processed() const { return processed_; }

 private:
  struct Entry {
    Duration time;
    std::uint64_t seq;
    Event event;
    // std::priority_queue is a max-heap: the earliest (then first scheduled) compares greatest.
    bool operator<(const Entry& o) const { return time != o.time ? time > o.time : seq > o.seq; }
  };

  std::shared_ptr<ManualClock> clock_;
  Duration now_{0};
  std::priority_queue<Entry> heap_;
  std::uint64_t next_seq_ = 0;
  std::int64_t processed_ = 0;
};

}  // namespace laminar::sim::internal
