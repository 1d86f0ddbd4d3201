// id_window.h (private to src/): IdWindow, the set of ids a TrajectoryQueue refuses.
//
// An id is refused while it is live (in the queue) and, once retired, until `capacity` later
// retirements have pushed it out of the window: exactly, with no false positives. The queue keeps
// three: trajectory ids (live and retired), closed group ids and expired batch ids (retired only).
// Not thread-safe: its owner's lock guards it.
//
//   laminar::internal::IdWindow w(2);
//   w.admit(7);     // true: 7 is live
//   w.admit(7);     // false
//   w.retire(7);    // still refused ...
//   w.retire(8);
//   w.retire(9);    // ... until two more retirements push it out
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace laminar::internal {

class IdWindow {
 public:
  // Preconditions:
  //   capacity >= 1.
  explicit IdWindow(std::size_t capacity);

  // Makes `id` live; false (and nothing changes) when it is live or retired within the window.
  bool admit(std::uint64_t id);
  // Makes `id` live whatever the window says of it (replaying a log).
  void set_live(std::uint64_t id);
  // `id` stops being live and enters the window as its newest retirement; the oldest leaves once
  // the window is full. An id already retired within the window keeps its place.
  void retire(std::uint64_t id);

  bool contains(std::uint64_t id) const;  // live or retired within the window
  bool retired(std::uint64_t id) const;
  std::size_t retired_count() const noexcept { return ring_.size(); }
  std::size_t capacity() const noexcept { return capacity_; }

  // f(id) for each retired id in the window, oldest first.
  template <class F>
  void for_each_retired(F f) const {
    for (std::size_t i = next_; i < ring_.size(); ++i) f(ring_[i]);
    for (std::size_t i = 0; i < next_; ++i) f(ring_[i]);
  }

 private:
  // Ids mostly come from counters, so the table keeps blocks of 64 consecutive ids with one bit
  // mask of each kind: 24 bytes for up to 64 ids, which keeps the default window's table in the
  // core's caches where a node per id would make every lookup a cache miss. Measured under the
  // queue's use (admit each of 4 M sequential ids, retire it 8,192 later, window 65,536; -O2 on the
  // 2-core build VM, 2026-11-27): 27-45 ns an id, against 190-250 ns for two std::unordered_sets
  // and a std::deque of the retired, time the queue would spend under its one lock.
  static constexpr std::uint64_t kBlockIds = 64;
  static constexpr std::uint64_t kEmpty = ~std::uint64_t(0);  // no id / 64 is this
  struct Block {
    std::uint64_t run = kEmpty;  // id / 64, or kEmpty in a free slot
    std::uint64_t live = 0;
    std::uint64_t retired = 0;
  };

  static std::uint64_t bit_of(std::uint64_t id) { return std::uint64_t(1) << (id % kBlockIds); }
  std::size_t mask() const { return blocks_.size() - 1; }
  std::size_t home(std::uint64_t run) const;
  std::size_t probe(std::uint64_t run) const;  // the slot of `run`, or the free one it would take
  const Block* find(std::uint64_t id) const;
  Block& block_for(std::uint64_t id);  // taken for it if absent
  void clear_bits(std::uint64_t id, std::uint64_t Block::*bits);
  void remove_at(std::size_t i);
  void grow();

  std::size_t capacity_;
  std::vector<Block> blocks_;
  std::size_t used_ = 0;
  std::vector<std::uint64_t> ring_;  // retired ids; grows to capacity_, then wraps
  std::size_t next_ = 0;             // the oldest, once full
};

}  // namespace laminar::internal
