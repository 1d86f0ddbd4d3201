#include "id_window.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <random>
#include <set>
#include <vector>

using laminar::internal::IdWindow;

TEST_CASE("the usage example of id_window.h runs as its comments say", "[id_window]") {
  IdWindow w(2);
  CHECK(w.admit(7));
  CHECK_FALSE(w.admit(7));
  w.retire(7);
  CHECK(w.contains(7));
  w.retire(8);
  CHECK(w.contains(7));
  w.retire(9);
  CHECK_FALSE(w.contains(7));
  CHECK(w.admit(7));
}

TEST_CASE("an id is refused while live and for exactly `capacity` retirements after", "[id_window]") {
  IdWindow w(3);
  CHECK(w.admit(1));
  CHECK(w.contains(1));
  CHECK_FALSE(w.retired(1));
  w.retire(1);
  CHECK(w.retired(1));
  CHECK_FALSE(w.admit(1));
  for (std::uint64_t id : {2, 3}) {
    REQUIRE(w.admit(id));
    w.retire(id);
    CHECK(w.contains(1));
  }
  REQUIRE(w.admit(4));
  w.retire(4);  // the fourth retirement pushes 1 out
  CHECK_FALSE(w.contains(1));
  CHECK(w.retired_count() == 3);
  std::vector<std::uint64_t> order;
  w.for_each_retired([&](std::uint64_t id) { order.push_back(id); });
  CHECK(order == std::vector<std::uint64_t>{2, 3, 4});
}

TEST_CASE("retiring an id already in the window keeps its place; set_live overrides", "[id_window]") {
  IdWindow w(2);
  w.retire(10);  // retired without being live (replaying a log, a closed group)
  w.retire(10);
  CHECK(w.retired_count() == 1);
  w.set_live(10);  // live and retired at once: refused either way
  CHECK_FALSE(w.admit(10));
  w.retire(10);  // its ack: still at the oldest place in the window
  w.retire(11);
  w.retire(12);
  CHECK_FALSE(w.contains(10));
  CHECK(w.admit(10));
}

TEST_CASE("the extreme ids and neighbours sharing a block stay apart", "[id_window]") {
  IdWindow w(4);
  const std::uint64_t top = ~std::uint64_t(0);
  CHECK(w.admit(top));
  CHECK(w.admit(top - 1));
  CHECK(w.admit(0));
  CHECK_FALSE(w.admit(top));
  CHECK_FALSE(w.contains(top - 2));
  for (std::uint64_t id = 64; id < 128; ++id) REQUIRE(w.admit(id));
  w.retire(100);
  CHECK(w.retired(100));
  CHECK_FALSE(w.retired(101));
  CHECK(w.contains(101));
}

TEST_CASE("random admits and retirements match a plain model exactly", "[id_window]") {
  const unsigned seed = std::random_device{}();
  std::printf("id window seed %u\n", seed);
  std::mt19937_64 rng(seed);
  for (std::size_t capacity : {std::size_t(1), std::size_t(5), std::size_t(97), std::size_t(1000)}) {
    INFO("capacity " << capacity);
    IdWindow w(capacity);
    std::set<std::uint64_t> live;
    std::deque<std::uint64_t> window;  // the model: the last `capacity` retired
    // Ids from a small range collide in probe runs and share blocks; some come back.
    for (int step = 0; step < 40000; ++step) {
      const std::uint64_t id = rng() % 3 == 0 ? rng() % 200 : rng() % 20000;
      const bool refused =
          live.count(id) != 0 || std::find(window.begin(), window.end(), id) != window.end();
      if (rng() % 2 == 0 || live.empty()) {
        REQUIRE(w.contains(id) == refused);
        REQUIRE(w.admit(id) == !refused);
        if (!refused) live.insert(id);
        continue;
      }
      auto it = live.lower_bound(id);
      if (it == live.end()) it = live.begin();
      const std::uint64_t gone = *it;
      live.erase(it);
      w.retire(gone);
      window.push_back(gone);
      if (window.size() > capacity) window.pop_front();
      REQUIRE(w.retired(gone));
    }
    std::vector<std::uint64_t> order;
    w.for_each_retired([&](std::uint64_t id) { order.push_back(id); });
    CHECK(order == std::vector<std::uint64_t>(window.begin(), window.end()));
    for (std::uint64_t id : live) CHECK(w.contains(id));
  }
}
