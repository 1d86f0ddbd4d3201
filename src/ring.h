// ring.h (private to src/): Ring, a growable ring buffer, the TrajectoryQueue's ready queue.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace laminar::internal {

// A growable ring: unlike std::deque, which takes a node for every two trajectories, it
// allocates nothing once grown.
template <class T>
class Ring {
 public:
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  T& operator[](std::size_t i) { return buf_[(head_ + i) & (buf_.size() - 1)]; }
  const T& operator[](std::size_t i) const { return buf_[(head_ + i) & (buf_.size() - 1)]; }
  void push_back(T&& v) {
    grow_if_full();
    (*this)[size_++] = std::move(v);
  }
  void push_front(T&& v) {
    grow_if_full();
    head_ = (head_ + buf_.size() - 1) & (buf_.size() - 1);
    ++size_;
    (*this)[0] = std::move(v);
  }
  T pop_front() {
    T v = std::move((*this)[0]);
    head_ = (head_ + 1) & (buf_.size() - 1);
    --size_;
    return v;
  }

 private:
  void grow_if_full() {
    if (size_ < buf_.size()) return;
    std::vector<T> bigger(std::max<std::size_t>(16, 2 * buf_.size()));
    for (std::size_t i = 0; i < size_; ++i) bigger[i] = std::move((*this)[i]);
    buf_ = std::move(bigger);
    head_ = 0;
  }
  std::vector<T> buf_;
  std::size_t head_ = 0;
  std::size_t size_ = 0;
};

}  // namespace laminar::internal
