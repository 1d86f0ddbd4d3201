// stop_half_way.h: stopping a WeightPuller's pull part way through, for tests of resuming one.
//
//   auto half = laminar::testing::stop_half_way(*puller, [&] { return puller->pull(v, dst, false); }, rng);
//   REQUIRE(half.stopped);   // half.stopped->bytes_done is in (0, total)
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <random>
#include <thread>

#include "laminar/status.h"
#include "laminar/weight_puller.h"

namespace laminar::testing {

struct HalfWay {
  std::optional<WeightPuller::StoppedPull> stopped;  // none when no attempt stopped half way
  Status error;                                      // an attempt that failed other than by the cancel
};

// Runs `pull` (a call of puller.pull) on a thread and cancels it after a number of yields that
// adapts: fewer after a pull that finished, more after one cancelled before its first byte, so an
// attempt stops half way however loaded the machine is (a fixed range of random points sometimes
// never did). Returns at the first that does.
template <class Pull>
HalfWay stop_half_way(WeightPuller& puller, Pull&& pull, std::mt19937& rng) {
  std::uint32_t wait = rng() % 3000;
  for (int attempt = 0; attempt < 1000; ++attempt) {
    Status st;
    std::atomic<bool> started{false};
    std::thread t([&] {
      started = true;
      st = pull();
    });
    while (!started) std::this_thread::yield();
    for (std::uint32_t k = wait; k > 0; --k) std::this_thread::yield();
    puller.cancel();
    t.join();
    if (st.code() == StatusCode::kCancelled) {
      std::optional<WeightPuller::StoppedPull> stopped = puller.stopped_pull();
      if (!stopped) return {std::nullopt, internal_error("a cancelled pull left no stopped_pull()")};
      if (stopped->bytes_done > 0) return {stopped, ok_status()};
      wait = wait * 2 + 1 + rng() % 16;
    } else if (!st.ok()) {
      return {std::nullopt, st};
    } else {
      wait = std::max<std::uint32_t>(wait / 2, 1) - rng() % 2;
    }
  }
  return {};
}

}  // namespace laminar::testing
