#include "laminar/trajectory_queue.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <deque>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <numeric>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "eventually.h"
#include "expect_code.h"

using laminar::Batch;
using laminar::BatchSpec;
using laminar::Clock;
using laminar::ManualClock;
using laminar::PartialGroupPolicy;
using laminar::PushOptions;
using laminar::TrajectoryQueueOptions;
using laminar::StalenessRule;
using laminar::StatusCode;
using laminar::Trajectory;
using laminar::TrajectoryId;
using laminar::TrajectoryQueue;
using laminar::Version;
using laminar::testing::eventually;
using laminar::testing::expect_code;
using namespace std::chrono_literals;

namespace {

// Waits until `producers` and `consumers` threads are blocked in the queue, so that a jump of
// virtual time is sure to land while they wait. Fails after a minute of real time.
void await_blocked(const TrajectoryQueue& q, std::size_t producers, std::size_t consumers) {
  const bool blocked = eventually(
      [&] {
        const auto s = q.stats();
        return s.blocked_producers == producers && s.blocked_consumers == consumers;
      },
      60s);
  if (!blocked) FAIL("threads never blocked in the queue");
}

// Another clock with each wait_until counted: every wait after the first of a pop_batch is a
// wake that did not end its wait.
class CountingClock final : public Clock {
 public:
  explicit CountingClock(std::shared_ptr<Clock> inner) : inner_(std::move(inner)) {}
  Duration now() const noexcept override { return inner_->now(); }
  void wait_until(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                  Duration deadline) const override {
    waits.fetch_add(1);
    inner_->wait_until(cv, lock, deadline);
  }
  [[nodiscard]] laminar::ClockSubscription subscribe(std::function<void()> wake) override {
    return inner_->subscribe(std::move(wake));
  }
  mutable std::atomic<int> waits{0};

 private:
  std::shared_ptr<Clock> inner_;
};

// Waits until `clock` has seen `n` waits.
void await_waits(const CountingClock& clock, int n) {
  if (!eventually([&] { return clock.waits.load() >= n; }, 60s)) FAIL("the queue never waited " << n << " times");
}

Trajectory make_traj(std::uint64_t id, std::uint64_t version = 0, std::size_t response = 4,
                     std::size_t prompt = 2) {
  Trajectory t;
  t.id = TrajectoryId(id);
  t.prompt_id = laminar::PromptId(id);
  t.version = Version(version);
  t.prompt_tokens.assign(prompt, 7);
  for (std::size_t i = 0; i < response; ++i) {
    t.response_tokens.push_back(std::int32_t(100 + i));
    t.logprobs.push_back(-0.5f - float(i));
  }
  t.rewards = {1.0f};
  t.timings = {10, 20};
  return t;
}

Trajectory make_member(std::uint64_t id, std::uint64_t group, std::uint32_t n, std::uint32_t index,
                       std::uint64_t version = 0) {
  Trajectory t = make_traj(id, version);
  t.prompt_id = laminar::PromptId(group * 1000);
  t.group_id = laminar::GroupId(group);
  t.group_size = n;
  t.sample_index = index;
  return t;
}

std::unique_ptr<TrajectoryQueue> make_queue(TrajectoryQueueOptions opt = {}) {
  auto q = TrajectoryQueue::create(std::move(opt));
  REQUIRE(q.ok());
  return std::move(q).value();
}

BatchSpec count_spec(std::size_t n) {
  BatchSpec s;
  s.max_trajectories = n;
  return s;
}

std::vector<std::uint64_t> ids_of(const Batch& b) {
  std::vector<std::uint64_t> ids;
  for (const Trajectory& t : b.trajectories()) ids.push_back(t.id.value());
  return ids;
}

std::string temp_path(const char* name) {
  return (std::filesystem::temp_directory_path() /
          (std::string("laminar_tq_") + name + "_" + std::to_string(::getpid())))
      .string();
}

}  // namespace

TEST_CASE("the usage example of trajectory_queue.h compiles and runs", "[queue]") {
  // Verbatim from the header.
  auto q = laminar::TrajectoryQueue::create(laminar::TrajectoryQueueOptions{}).value();
  laminar::Trajectory t;
  t.id = laminar::TrajectoryId(1);
  t.response_tokens = {5, 6};
  t.logprobs = {-0.1f, -0.2f};
  t.rewards = {1.0f};
  laminar::Status st = q->push(std::move(t));
  laminar::BatchSpec spec;
  spec.max_trajectories = 32;
  laminar::Result<laminar::Batch> b = q->pop_batch(spec);   // train on b->trajectories() ...
  st = q->ack(b->id());                                      // ... then commit
  // End of the example.
  REQUIRE(st.ok());
  REQUIRE(b->size() == 1);
  CHECK(b->trajectories()[0].response_tokens == std::vector<std::int32_t>{5, 6});
  CHECK(q->stats().acked == 1);
}

TEST_CASE("the usage example of clock.h compiles and wakes a waiter", "[clock]") {
  auto clock = std::make_shared<laminar::ManualClock>();
  std::mutex mu;
  std::condition_variable cv;
  auto sub = clock->subscribe([&] { std::lock_guard<std::mutex> l(mu); cv.notify_all(); });
  const Clock::Duration t = std::chrono::seconds(30);
  std::thread waiter([&] {
    std::unique_lock l(mu);
    while (clock->now() < t) clock->wait_until(cv, l, t);
  });
  auto st = clock->advance(std::chrono::seconds(30));  // the waiter wakes and sees the new time
  waiter.join();
  REQUIRE(st.ok());
  CHECK(clock->now() == 30s);
  expect_code(clock->advance(-1ns), StatusCode::kInvalidArgument, "negative");
  expect_code(clock->set(10s), StatusCode::kInvalidArgument, "before the current time");
  CHECK(clock->set(40s).ok());
  CHECK(clock->coarse_now() == clock->now());
  CHECK(clock->coarse_slack() == Clock::Duration::zero());
}

TEST_CASE("the steady clock's coarse reading is never ahead and keeps up", "[clock]") {
  const std::shared_ptr<Clock> clock = Clock::steady();
  const Clock::Duration slack = clock->coarse_slack();
  CHECK(slack > Clock::Duration::zero());
  CHECK(slack <= 100ms);
  const Clock::Duration first = clock->coarse_now();
  while (clock->now() < first + 3 * slack) std::this_thread::yield();
  for (int i = 0; i < 1000; ++i) {
    const Clock::Duration coarse = clock->coarse_now();
    const Clock::Duration exact = clock->now();
    REQUIRE(coarse <= exact);
    REQUIRE(coarse > first);
  }
}

TEST_CASE("validation names the field and value that are wrong", "[queue][bad-input]") {
  auto q = make_queue();
  struct Case {
    const char* what;
    void (*mutate)(Trajectory&);
    const char* needle;
  };
  const Case cases[] = {
      {"logprob count", [](Trajectory& t) { t.logprobs.pop_back(); }, "3 logprobs for 4 response tokens"},
      {"negative token", [](Trajectory& t) { t.response_tokens[2] = -5; }, "response_tokens[2] = -5"},
      {"negative prompt token", [](Trajectory& t) { t.prompt_tokens[1] = -1; }, "prompt_tokens[1] = -1"},
      {"nan logprob", [](Trajectory& t) { t.logprobs[1] = NAN; }, "logprobs[1] = nan"},
      {"-inf logprob", [](Trajectory& t) { t.logprobs[0] = -INFINITY; }, "logprobs[0] = -inf"},
      {"positive logprob", [](Trajectory& t) { t.logprobs[3] = 0.5f; }, "logprobs[3] = 0.5"},
      {"no reward", [](Trajectory& t) { t.rewards.clear(); }, "no reward"},
      {"inf reward", [](Trajectory& t) { t.rewards = {1, INFINITY}; }, "rewards[1] = inf"},
      {"group size 0", [](Trajectory& t) { t.group_size = 0; }, "group_size is 0"},
      {"sample index", [](Trajectory& t) { t.group_size = 4; t.sample_index = 4; }, "sample_index 4"},
      {"timings", [](Trajectory& t) { t.timings = {50, 40}; }, "ends at 40 ns"},
      {"finish reason", [](Trajectory& t) { t.finish_reason = laminar::FinishReason(9); }, "finish_reason 9"},
      {"metadata not json", [](Trajectory& t) { t.metadata = "{oops"; }, "not a JSON object"},
      {"metadata array", [](Trajectory& t) { t.metadata = "[1,2]"; }, "not a JSON object"},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    Trajectory t = make_traj(1);
    c.mutate(t);
    std::string before, after;  // compared as bytes: NaN != NaN
    laminar::encode_trajectory(t, before);
    expect_code(q->push(std::move(t)), StatusCode::kInvalidArgument, c.needle);
    laminar::encode_trajectory(t, after);
    CHECK(before == after);  // a refused trajectory is left with the caller
  }
  Trajectory ok = make_traj(1);
  ok.metadata = R"({"task": "math", "n": [1, 2]})";
  CHECK(q->push(std::move(ok)).ok());
  auto s = q->stats();
  CHECK(s.pushed == 1);
  CHECK(s.rejected_invalid == std::size(cases));
}

TEST_CASE("versions: push must not be ahead, publish must not go back", "[queue][bad-input]") {
  TrajectoryQueueOptions opt;
  opt.initial_version = Version(3);
  auto q = make_queue(opt);
  expect_code(q->push(make_traj(1, 4)), StatusCode::kInvalidArgument,
              "version 4 is ahead of the newest published version 3");
  CHECK(q->push(make_traj(1, 3)).ok());
  expect_code(q->publish_version(Version(2)), StatusCode::kInvalidArgument,
              "version 2 is older than the newest published 3");
  CHECK(q->publish_version(Version(3)).ok());
  CHECK(q->publish_version(Version(5)).ok());
  CHECK(q->newest_version() == Version(5));
  CHECK(q->push(make_traj(2, 5)).ok());
  BatchSpec spec = count_spec(4);
  spec.consumer_version = Version(6);
  expect_code(q->pop_batch(spec).status(), StatusCode::kInvalidArgument, "consumer_version 6 is ahead");
}

TEST_CASE("ids are unique while queued and for a window after ack", "[queue][bad-input]") {
  TrajectoryQueueOptions opt;
  opt.id_dedup_window = 2;
  auto q = make_queue(opt);
  CHECK(q->push(make_traj(1)).ok());
  expect_code(q->push(make_traj(1)), StatusCode::kAlreadyExists, "trajectory 1: id already pushed");
  auto b = q->pop_batch(count_spec(1));
  REQUIRE(b.ok());
  REQUIRE(q->ack(b->id()).ok());
  expect_code(q->push(make_traj(1)), StatusCode::kAlreadyExists, "id already pushed");
  // Two more retirements push id 1 out of the window of 2.
  for (std::uint64_t id : {2, 3}) {
    REQUIRE(q->push(make_traj(id)).ok());
    auto bb = q->pop_batch(count_spec(1));
    REQUIRE(bb.ok());
    REQUIRE(q->ack(bb->id()).ok());
  }
  CHECK(q->push(make_traj(1)).ok());
  // The largest ids are ids like any other.
  for (std::uint64_t id : {~std::uint64_t(0), ~std::uint64_t(0) - 1}) {
    CHECK(q->push(make_traj(id)).ok());
    expect_code(q->push(make_traj(id)), StatusCode::kAlreadyExists, "id already pushed");
  }
}

TEST_CASE("options and batch specs are validated", "[queue][bad-input]") {
  TrajectoryQueueOptions bad;
  bad.capacity_trajectories = 0;
  expect_code(TrajectoryQueue::create(bad).status(), StatusCode::kInvalidArgument, "capacity_trajectories");
  bad = {};
  bad.capacity_tokens = std::size_t(1) << 40;
  expect_code(TrajectoryQueue::create(bad).status(), StatusCode::kInvalidArgument, "above the limit");
  bad = {};
  bad.capacity_trajectories = std::size_t(1) << 24;
  expect_code(TrajectoryQueue::create(bad).status(), StatusCode::kInvalidArgument, "above the limit");
  bad = {};
  bad.default_lease = -1s;
  expect_code(TrajectoryQueue::create(bad).status(), StatusCode::kInvalidArgument, "default_lease");
  bad = {};
  bad.group_timeout = 0s;
  expect_code(TrajectoryQueue::create(bad).status(), StatusCode::kInvalidArgument, "group_timeout");
  bad = {};
  bad.id_dedup_window = (std::size_t(1) << 29) + 1;
  expect_code(TrajectoryQueue::create(bad).status(), StatusCode::kInvalidArgument, "id_dedup_window 536870913");
  bad = {};
  bad.wal_path = "/nonexistent-dir/x/wal";
  expect_code(TrajectoryQueue::create(bad).status(), StatusCode::kInvalidArgument, "cannot open");

  auto q = make_queue();
  expect_code(q->pop_batch(BatchSpec{}).status(), StatusCode::kInvalidArgument, "neither max_trajectories");
  BatchSpec s = count_spec(2);
  s.min_trajectories = 3;
  expect_code(q->pop_batch(s).status(), StatusCode::kInvalidArgument, "min_trajectories 3 exceeds");
  expect_code(q->pop_batch(count_spec(2)).status(), StatusCode::kUnavailable, "0 trajectories ready");
  expect_code(q->ack(laminar::BatchId(42)), StatusCode::kNotFound, "batch 42");
  expect_code(q->nack(laminar::BatchId(42)), StatusCode::kNotFound, "batch 42");
  TrajectoryQueueOptions small;
  small.capacity_tokens = 10;
  auto q2 = make_queue(small);
  expect_code(q2->push(make_traj(1, 0, 20)), StatusCode::kInvalidArgument, "22 tokens exceed");
}

TEST_CASE("push_many answers each trajectory as push would, and takes only the accepted ones", "[queue][wal]") {
  enum Mode { kNoLog, kLog, kLogFsync };
  for (Mode mode : {kNoLog, kLog, kLogFsync}) {
    INFO("mode " << int(mode));
    TrajectoryQueueOptions opt;
    const std::string path = temp_path("push_many");
    std::filesystem::remove(path);
    if (mode != kNoLog) opt.wal_path = path;
    opt.wal_fsync = mode == kLogFsync;
    auto q = make_queue(opt);
    REQUIRE(q->push(make_member(90, 9, 2, 0)).ok());
    REQUIRE(q->push(make_member(91, 9, 2, 1)).ok());  // group 9 is closed
    REQUIRE(q->push(make_traj(50)).ok());
    std::vector<Trajectory> ts;
    ts.push_back(make_traj(1));
    ts.push_back(make_traj(2));
    ts.back().rewards.clear();                       // invalid
    ts.push_back(make_traj(50));                     // id already in the queue
    ts.push_back(make_member(10, 3, 3, 0));
    ts.push_back(make_traj(1));                      // repeats an id of this call
    ts.push_back(make_member(11, 3, 3, 2));
    ts.push_back(make_member(12, 3, 3, 2));          // repeats a sample_index
    ts.push_back(make_member(13, 9, 2, 0));          // its group is closed
    ts.push_back(make_traj(14, /*version=*/5));      // ahead of the newest version
    ts.push_back(make_member(15, 3, 3, 1));          // completes group 3
    ts.push_back(make_member(16, 3, 3, 0));          // its group was completed by this call
    ts.push_back(make_member(17, 5, 2, 0));
    ts.push_back(make_member(18, 5, 3, 1));          // disagrees with the group this call opened
    const std::vector<Trajectory> before = ts;
    std::vector<laminar::Status> st = q->push_many(ts);
    REQUIRE(st.size() == ts.size());
    CHECK(st[0].ok());
    expect_code(st[1], StatusCode::kInvalidArgument, "trajectory 2: no reward");
    expect_code(st[2], StatusCode::kAlreadyExists, "trajectory 50: id already pushed");
    CHECK(st[3].ok());
    expect_code(st[4], StatusCode::kAlreadyExists, "trajectory 1: id already pushed");
    CHECK(st[5].ok());
    expect_code(st[6], StatusCode::kInvalidArgument, "group 3 already has sample_index 2");
    expect_code(st[7], StatusCode::kFailedPrecondition, "group 9 is already closed");
    expect_code(st[8], StatusCode::kInvalidArgument, "version 5 is ahead");
    CHECK(st[9].ok());
    expect_code(st[10], StatusCode::kFailedPrecondition, "group 3 is already closed");
    CHECK(st[11].ok());
    expect_code(st[12], StatusCode::kInvalidArgument, "group 5 has group_size 2");
    // A refused trajectory is untouched; an accepted one was moved from.
    for (std::size_t i = 0; i < ts.size(); ++i) {
      if (st[i].ok()) {
        CHECK(ts[i].response_tokens.empty());
      } else {
        CHECK(ts[i] == before[i]);
      }
    }
    // Ids a refusal gave back are free again; the accepted ones are not.
    CHECK(q->push(make_member(12, 4, 2, 0)).ok());
    expect_code(q->push(make_traj(10)), StatusCode::kAlreadyExists, "id already pushed");
    auto b = q->pop_batch(count_spec(100));
    REQUIRE(b.ok());
    const std::vector<std::uint64_t> ready{90, 91, 50, 1, 10, 15, 11};
    CHECK(ids_of(*b) == ready);
    auto s = q->stats();
    CHECK(s.pushed == 9);  // 3 before, 5 here, then 12
    CHECK(s.pending_groups == 2);
    CHECK(s.rejected_invalid == 7);
    CHECK(s.dropped_late_for_group == 2);
    CHECK(s.held_tokens == 9 * 6);
    if (mode == kNoLog) continue;
    // The log holds exactly what went in: the unacked batch and the two pending groups' members.
    q.reset();
    auto again = make_queue(opt);
    CHECK(again->recovery().recovered == 9);
    auto redelivered = again->pop_batch(count_spec(100));
    REQUIRE(redelivered.ok());
    std::vector<std::uint64_t> got = ids_of(*redelivered);
    std::sort(got.begin(), got.end());
    CHECK(got == std::vector<std::uint64_t>{1, 10, 11, 15, 50, 90, 91});
    CHECK(again->stats().pending_group_trajectories == 2);
    again.reset();
    std::filesystem::remove(path);
  }
}

TEST_CASE("push_many waits, fails fast or is cancelled like push when the queue is full", "[queue]") {
  TrajectoryQueueOptions opt;
  opt.capacity_trajectories = 3;
  auto q = make_queue(opt);
  std::vector<Trajectory> ts;
  for (std::uint64_t id = 1; id <= 5; ++id) ts.push_back(make_traj(id));
  std::vector<laminar::Status> st = q->push_many(ts, PushOptions::fail_fast());
  CHECK(st[0].ok());
  CHECK(st[1].ok());
  CHECK(st[2].ok());
  expect_code(st[3], StatusCode::kUnavailable, "queue full (3 of 3 trajectories");
  expect_code(st[4], StatusCode::kUnavailable, "push of trajectory 5: queue full");
  CHECK(q->stats().rejected_full == 2);
  // The two refused ones, pushed again while a consumer frees room.
  std::vector<Trajectory> rest(std::make_move_iterator(ts.begin() + 3), std::make_move_iterator(ts.end()));
  std::thread consumer([&] {
    for (int acked = 0; acked < 2;) {
      BatchSpec s = count_spec(1);
      s.wait = 10s;
      auto b = q->pop_batch(s);
      REQUIRE(b.ok());
      REQUIRE(q->ack(b->id()).ok());
      ++acked;
    }
  });
  st = q->push_many(rest, PushOptions::with_timeout(10s));
  consumer.join();
  CHECK(st[0].ok());
  CHECK(st[1].ok());
  CHECK(q->stats().ready == 3);
  q->close();
  std::vector<Trajectory> late;
  late.push_back(make_traj(6));
  late.push_back(make_traj(7));
  for (const laminar::Status& s : q->push_many(late)) expect_code(s, StatusCode::kCancelled, "closed");
  CHECK(q->push_many({}).empty());
}

TEST_CASE("push_many takes a span longer than its chunk, in order", "[queue]") {
  auto q = make_queue();
  std::vector<Trajectory> ts;
  for (std::uint64_t id = 1; id <= 2500; ++id) ts.push_back(make_member(id, (id - 1) / 5, 5, std::uint32_t((id - 1) % 5)));
  ts[2049] = make_traj(7);  // a duplicate, in the third chunk
  std::vector<laminar::Status> st = q->push_many(ts);
  REQUIRE(st.size() == 2500);
  for (std::size_t i = 0; i < st.size(); ++i) {
    if (i == 2049) {
      expect_code(st[i], StatusCode::kAlreadyExists, "trajectory 7: id already pushed");
    } else {
      REQUIRE(st[i].ok());
    }
  }
  auto s = q->stats();
  CHECK(s.pushed == 2499);
  CHECK(s.ready == 2495);  // group 409 misses its member 2050
  CHECK(s.pending_groups == 1);
}

TEST_CASE("pop_batch by count and by token budget, never splitting a unit", "[queue]") {
  auto q = make_queue();
  for (std::uint64_t id = 1; id <= 5; ++id) REQUIRE(q->push(make_traj(id, 0, 8 * id)).ok());
  auto b = q->pop_batch(count_spec(2));
  REQUIRE(b.ok());
  CHECK(ids_of(*b) == std::vector<std::uint64_t>{1, 2});
  BatchSpec tok;
  tok.max_tokens = 60;  // id 3 has 26 tokens, id 4 has 34, id 5 has 42
  auto b2 = q->pop_batch(tok);
  REQUIRE(b2.ok());
  CHECK(ids_of(*b2) == std::vector<std::uint64_t>{3, 4});
  CHECK(b2->num_tokens() == 60);
  tok.max_tokens = 10;  // id 5 alone exceeds the budget: delivered alone rather than never
  auto b3 = q->pop_batch(tok);
  REQUIRE(b3.ok());
  CHECK(ids_of(*b3) == std::vector<std::uint64_t>{5});
  auto s = q->stats();
  CHECK(s.leases == 3);
  CHECK(s.leased_trajectories == 5);
  CHECK(s.ready == 0);
}

TEST_CASE("pop_batch waits for min_trajectories in virtual time", "[queue]") {
  auto manual = std::make_shared<ManualClock>();
  auto clock = std::make_shared<CountingClock>(manual);
  TrajectoryQueueOptions opt;
  opt.clock = clock;
  auto q = make_queue(opt);
  REQUIRE(q->push(make_traj(1)).ok());
  BatchSpec s = count_spec(4);
  s.min_trajectories = 3;
  s.wait = 5s;
  laminar::Status result;
  std::atomic<bool> done{false};
  std::thread consumer([&] {
    result = q->pop_batch(s).status();
    done = true;
  });
  await_waits(*clock, 1);
  REQUIRE(manual->advance(4s).ok());
  await_waits(*clock, 2);    // woken by the jump, it looked at the time and waits again
  CHECK_FALSE(done.load());  // 4 s of the 5 s wait have passed
  REQUIRE(manual->advance(1s).ok());
  consumer.join();
  expect_code(result, StatusCode::kDeadlineExceeded, "only 1 of 3");

  std::vector<std::uint64_t> got;
  std::thread consumer2([&] {
    auto b = q->pop_batch(s);
    if (b.ok()) got = ids_of(*b);
  });
  REQUIRE(q->push(make_traj(2)).ok());
  REQUIRE(q->push(make_traj(3)).ok());
  consumer2.join();
  CHECK(got == std::vector<std::uint64_t>{1, 2, 3});
}

TEST_CASE("a consumer waiting for min_trajectories is woken once they are ready, not by each push", "[queue]") {
  auto clock = std::make_shared<CountingClock>(Clock::steady());
  TrajectoryQueueOptions opt;
  opt.clock = clock;
  auto q = make_queue(opt);
  BatchSpec full = count_spec(16);
  full.min_trajectories = 16;
  full.wait = 60s;
  std::vector<std::uint64_t> got;
  std::thread consumer([&] {
    auto b = q->pop_batch(full);
    if (b.ok()) got = ids_of(*b);
  });
  await_blocked(*q, 0, 1);
  for (std::uint64_t id = 1; id < 16; ++id) {
    REQUIRE(q->push(make_traj(id)).ok());
    std::this_thread::yield();  // a needlessly woken consumer gets to run and wait again
  }
  REQUIRE(q->push(make_traj(16)).ok());
  consumer.join();
  CHECK(got.size() == 16);
  // Woken by every push, it would have waited once per push it saw (a spurious wake-up aside).
  CHECK(clock->waits.load() <= 3);

  // Two waiters: the smaller min_trajectories is served first, then the larger one still wakes.
  BatchSpec two = count_spec(2);
  two.min_trajectories = 2;
  two.wait = 60s;
  BatchSpec eight = count_spec(8);
  eight.min_trajectories = 8;
  eight.wait = 60s;
  laminar::Status small_result, large_result;
  std::size_t small_size = 0, large_size = 0;
  std::thread large([&] {
    auto b = q->pop_batch(eight);
    large_result = b.status();
    if (b.ok()) large_size = b->size();
  });
  await_blocked(*q, 0, 1);
  std::thread small([&] {
    auto b = q->pop_batch(two);
    small_result = b.status();
    if (b.ok()) small_size = b->size();
  });
  await_blocked(*q, 0, 2);
  REQUIRE(q->push(make_traj(17)).ok());
  REQUIRE(q->push(make_traj(18)).ok());
  small.join();
  CHECK(small_result.ok());
  CHECK(small_size == 2);
  for (std::uint64_t id = 19; id < 27; ++id) REQUIRE(q->push(make_traj(id)).ok());
  large.join();
  CHECK(large_result.ok());
  CHECK(large_size == 8);
}

TEST_CASE("watch_room wakes its watcher when room frees, a group timeout is due or the queue closes, no more",
          "[queue][groups]") {
  auto clock = std::make_shared<ManualClock>();
  TrajectoryQueueOptions opt;
  opt.clock = clock;
  opt.capacity_trajectories = 3;
  opt.group_timeout = 10s;
  opt.partial_group_policy = PartialGroupPolicy::kDrop;
  auto q = make_queue(opt);
  std::atomic<int> wakes{0};
  laminar::RoomWatch watch = q->watch_room([&] { wakes.fetch_add(1); });
  CHECK(q->until_group_timeout() == laminar::kForever);

  // Pushes and pops free no room: no wake.
  REQUIRE(q->push(make_traj(1)).ok());
  REQUIRE(q->push(make_member(2, 9, 3, 0)).ok());
  REQUIRE(q->push(make_traj(5)).ok());  // full: two ready, one member of an open group
  expect_code(q->push(make_traj(3), PushOptions::fail_fast()), StatusCode::kUnavailable, "queue full");
  auto b = q->pop_batch(count_spec(1));
  REQUIRE(b.ok());
  CHECK(wakes.load() == 0);
  CHECK(q->until_group_timeout() == 10s);

  REQUIRE(q->ack(b->id()).ok());  // room frees
  CHECK(wakes.load() == 1);
  REQUIRE(q->push(make_traj(3)).ok());  // full again

  // The group's timeout falls due with no call to run it: the jump wakes the watcher, whose call
  // runs the timeout (the member is dropped) and so frees room.
  REQUIRE(clock->advance(4s).ok());
  CHECK(q->until_group_timeout() == 6s);
  REQUIRE(clock->advance(6s).ok());
  CHECK(wakes.load() == 3);
  CHECK(q->until_group_timeout() == 0s);
  REQUIRE(q->push(make_traj(4)).ok());
  CHECK(q->stats().dropped_group_timeout == 1);
  CHECK(wakes.load() == 4);  // the drop itself freed room
  CHECK(q->until_group_timeout() == laminar::kForever);

  q->close();
  CHECK(wakes.load() == 5);
  watch.reset();  // once it returns the callback never runs again
  REQUIRE(clock->advance(1s).ok());
  CHECK(wakes.load() == 5);
}

TEST_CASE("push backpressure: fail fast, timeout and block", "[queue]") {
  auto clock = std::make_shared<ManualClock>();
  TrajectoryQueueOptions opt;
  opt.clock = clock;
  opt.capacity_trajectories = 2;
  opt.capacity_tokens = 1000;
  auto q = make_queue(opt);
  REQUIRE(q->push(make_traj(1)).ok());
  REQUIRE(q->push(make_traj(2)).ok());
  Trajectory t3 = make_traj(3);
  expect_code(q->push(std::move(t3), PushOptions::fail_fast()), StatusCode::kUnavailable,
              "queue full (2 of 2 trajectories");
  CHECK(t3.id == TrajectoryId(3));  // still the caller's, to retry
  CHECK(t3.response_tokens.size() == 4);

  laminar::Status timed;
  std::thread producer([&] { timed = q->push(make_traj(3), PushOptions::with_timeout(2s)); });
  await_blocked(*q, 1, 0);
  REQUIRE(clock->advance(2s).ok());
  producer.join();
  expect_code(timed, StatusCode::kDeadlineExceeded, "still full");

  // Leased trajectories still count: only the ack frees space.
  auto b = q->pop_batch(count_spec(1));
  REQUIRE(b.ok());
  std::atomic<bool> pushed{false};
  laminar::Status blocked;
  std::thread producer2([&] {
    blocked = q->push(make_traj(3));
    pushed = true;
  });
  await_blocked(*q, 1, 0);
  CHECK_FALSE(pushed.load());
  REQUIRE(q->ack(b->id()).ok());
  producer2.join();
  CHECK(blocked.ok());

  // Token capacity binds too.
  TrajectoryQueueOptions tok;
  tok.capacity_tokens = 10;
  auto q2 = make_queue(tok);
  REQUIRE(q2->push(make_traj(1)).ok());  // 6 tokens
  expect_code(q2->push(make_traj(2), PushOptions::fail_fast()), StatusCode::kUnavailable, "6 of 10 tokens");

  // close() releases a blocked producer.
  laminar::Status closed;
  std::thread producer3([&] { closed = q->push(make_traj(9)); });
  await_blocked(*q, 1, 0);
  q->close();
  producer3.join();
  expect_code(closed, StatusCode::kCancelled, "closed");
  expect_code(q->pop_batch(count_spec(1)).status(), StatusCode::kCancelled, "closed");
}

namespace {

// Pushes trajectories of 6 tokens with ids from `first` until one is refused: how many went in,
// and the refusal. No Catch2 macro here: threads call it.
struct Filled {
  std::size_t count = 0;
  laminar::Status refusal;
};
Filled fill_until_full(TrajectoryQueue& q, std::uint64_t first) {
  for (std::uint64_t id = first;; ++id) {
    laminar::Status st = q.push(make_traj(id), PushOptions::fail_fast());
    if (!st.ok()) return {std::size_t(id - first), std::move(st)};
  }
}

// The count of a fill that must have stopped for want of room.
std::size_t filled_until_full(const Filled& f) {
  expect_code(f.refusal, StatusCode::kUnavailable, "queue full");
  return f.count;
}

bool pin_to_cpu(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return ::sched_setaffinity(0, sizeof(set), &set) == 0 && ::sched_getcpu() == cpu;
}

}  // namespace

// A queue takes exactly its capacity, by count and by tokens, whichever threads and CPUs push.
TEST_CASE("a queue takes exactly its capacity when pushed from many threads and CPUs", "[queue]") {
  for (const bool by_tokens : {false, true}) {
    INFO("bound by " << (by_tokens ? "tokens" : "count"));
    TrajectoryQueueOptions opt;
    opt.capacity_trajectories = by_tokens ? 8192 : 2048;
    opt.capacity_tokens = by_tokens ? 6 * 1500 : std::size_t(1) << 20;
    const std::size_t capacity = by_tokens ? 1500 : 2048;
    auto q = make_queue(opt);
    std::vector<Filled> fills(4);
    std::vector<std::thread> producers;
    for (std::uint64_t p = 0; p < 4; ++p) {
      producers.emplace_back([&, p] { fills[p] = fill_until_full(*q, 1 + p * 1000000); });
    }
    for (auto& t : producers) t.join();
    std::size_t accepted = 0;
    for (const Filled& f : fills) accepted += filled_until_full(f);
    CHECK(accepted == capacity);
    CHECK(q->stats().held_tokens == 6 * capacity);

    // Emptied, it takes exactly as many again.
    for (;;) {
      auto b = q->pop_batch(count_spec(256));
      if (!b.ok()) break;
      REQUIRE(q->ack(b->id()).ok());
    }
    CHECK(q->stats().held_tokens == 0);
    CHECK(filled_until_full(fill_until_full(*q, 10000000)) == capacity);
  }

  // A push from one CPU and a fill from another still take exactly the capacity.
  cpu_set_t saved;
  REQUIRE(::sched_getaffinity(0, sizeof(saved), &saved) == 0);
  if (CPU_COUNT(&saved) < 2 || !CPU_ISSET(0, &saved) || !CPU_ISSET(1, &saved)) {
    WARN("CPUs 0 and 1 are not both available: the two-CPU part is skipped");
    return;
  }
  TrajectoryQueueOptions opt;
  opt.capacity_trajectories = 2048;
  auto q = make_queue(opt);
  const bool pinned = pin_to_cpu(0) && q->push(make_traj(1)).ok() && pin_to_cpu(1);
  const std::size_t more = pinned ? filled_until_full(fill_until_full(*q, 2)) : 0;
  REQUIRE(::sched_setaffinity(0, sizeof(saved), &saved) == 0);
  REQUIRE(pinned);
  CHECK(more == 2047);
}

TEST_CASE("staleness rules: drop, keep, keep and mark", "[queue][staleness]") {
  TrajectoryQueueOptions opt;
  opt.initial_version = Version(10);
  auto fill = [&](TrajectoryQueue& q) {
    for (std::uint64_t v : {10, 9, 7, 4}) REQUIRE(q.push(make_traj(v, v)).ok());
  };
  BatchSpec s = count_spec(10);
  s.consumer_version = Version(10);
  s.max_staleness = 2;

  auto q = make_queue(opt);
  fill(*q);
  s.staleness_rule = StalenessRule::kDrop;
  auto b = q->pop_batch(s);
  REQUIRE(b.ok());
  CHECK(ids_of(*b) == std::vector<std::uint64_t>{10, 9});
  CHECK(b->info()[1].staleness == 1);
  auto st = q->stats();
  CHECK(st.dropped_stale == 2);
  CHECK(st.staleness[0] == 1);
  CHECK(st.staleness[1] == 1);
  expect_code(q->push(make_traj(7, 7)), StatusCode::kAlreadyExists, "already pushed");  // dropped = retired

  auto q2 = make_queue(opt);
  fill(*q2);
  s.staleness_rule = StalenessRule::kKeep;
  auto b2 = q2->pop_batch(s);
  REQUIRE(b2.ok());
  CHECK(b2->size() == 4);
  for (const auto& info : b2->info()) CHECK_FALSE(info.over_limit);
  CHECK(b2->info()[3].staleness == 6);

  auto q3 = make_queue(opt);
  fill(*q3);
  s.staleness_rule = StalenessRule::kKeepAndMark;
  auto b3 = q3->pop_batch(s);
  REQUIRE(b3.ok());
  REQUIRE(b3->size() == 4);
  std::vector<bool> marks;
  for (const auto& info : b3->info()) marks.push_back(info.over_limit);
  CHECK(marks == std::vector<bool>{false, false, true, true});
  CHECK(b3->info()[2].staleness == 3);
  CHECK(q3->stats().staleness[6] == 1);

  // Drop leaves too few for min_trajectories: the fresh ones wait for company.
  auto q4 = make_queue(opt);
  fill(*q4);
  s.staleness_rule = StalenessRule::kDrop;
  s.min_trajectories = 3;
  expect_code(q4->pop_batch(s).status(), StatusCode::kUnavailable, "2 trajectories ready, 3 wanted");
  REQUIRE(q4->push(make_traj(11, 10)).ok());
  auto b4 = q4->pop_batch(s);
  REQUIRE(b4.ok());
  CHECK(ids_of(*b4) == std::vector<std::uint64_t>{10, 9, 11});
}

TEST_CASE("GRPO groups are released only whole", "[queue][groups]") {
  auto q = make_queue();
  REQUIRE(q->push(make_member(1, 7, 3, 2)).ok());
  REQUIRE(q->push(make_traj(100)).ok());
  REQUIRE(q->push(make_member(2, 7, 3, 0)).ok());
  expect_code(q->push(make_member(9, 7, 3, 0)), StatusCode::kInvalidArgument, "already has sample_index 0");
  expect_code(q->push(make_member(9, 7, 4, 1)), StatusCode::kInvalidArgument, "group 7 has group_size 3");
  auto st = q->stats();
  CHECK(st.pending_groups == 1);
  CHECK(st.pending_group_trajectories == 2);
  auto b = q->pop_batch(count_spec(10));
  REQUIRE(b.ok());
  CHECK(ids_of(*b) == std::vector<std::uint64_t>{100});
  REQUIRE(q->push(make_member(3, 7, 3, 1)).ok());
  // A batch with room for 2 does not take part of the group of 3 ... unless it is empty.
  auto g = q->pop_batch(count_spec(2));
  REQUIRE(g.ok());
  CHECK(ids_of(*g) == std::vector<std::uint64_t>{2, 3, 1});  // sample order
  for (const auto& info : g->info()) CHECK_FALSE(info.partial_group);
  expect_code(q->push(make_member(4, 7, 3, 1)), StatusCode::kFailedPrecondition, "group 7 is already closed");
  CHECK(q->stats().group_wait.count == 1);
  CHECK(q->stats().dropped_late_for_group == 1);

  // Two groups of 2 and a batch limit of 3: the second group waits for the next batch.
  REQUIRE(q->push(make_member(10, 8, 2, 0)).ok());
  REQUIRE(q->push(make_member(11, 8, 2, 1)).ok());
  REQUIRE(q->push(make_member(12, 9, 2, 1)).ok());
  REQUIRE(q->push(make_member(13, 9, 2, 0)).ok());
  auto b1 = q->pop_batch(count_spec(3));
  REQUIRE(b1.ok());
  CHECK(ids_of(*b1) == std::vector<std::uint64_t>{10, 11});
  auto b2 = q->pop_batch(count_spec(3));
  REQUIRE(b2.ok());
  CHECK(ids_of(*b2) == std::vector<std::uint64_t>{13, 12});
}

TEST_CASE("group timeout releases or drops a partial group", "[queue][groups]") {
  for (auto policy : {PartialGroupPolicy::kRelease, PartialGroupPolicy::kDrop}) {
    INFO((policy == PartialGroupPolicy::kRelease ? "release" : "drop"));
    auto clock = std::make_shared<ManualClock>();
    TrajectoryQueueOptions opt;
    opt.clock = clock;
    opt.group_timeout = 10s;
    opt.partial_group_policy = policy;
    auto q = make_queue(opt);
    REQUIRE(q->push(make_member(1, 5, 4, 0)).ok());
    REQUIRE(clock->advance(6s).ok());
    REQUIRE(q->push(make_member(2, 5, 4, 3)).ok());
    expect_code(q->pop_batch(count_spec(8)).status(), StatusCode::kUnavailable, "0 trajectories");
    REQUIRE(clock->advance(4s).ok());  // 10 s after the first member
    auto b = q->pop_batch(count_spec(8));
    auto st = q->stats();
    CHECK(st.group_wait.count == 1);
    CHECK(st.group_wait.max_ms == Approx(10000));
    if (policy == PartialGroupPolicy::kRelease) {
      REQUIRE(b.ok());
      CHECK(ids_of(*b) == std::vector<std::uint64_t>{1, 2});
      CHECK(b->info()[0].partial_group);
      CHECK(b->info()[1].partial_group);
    } else {
      CHECK(b.status().code() == StatusCode::kUnavailable);
      CHECK(st.dropped_group_timeout == 2);
      CHECK(st.held_tokens == 0);
    }
    expect_code(q->push(make_member(3, 5, 4, 1)), StatusCode::kFailedPrecondition, "group 5 is already closed");
  }
}

TEST_CASE("a member arriving at its group's deadline is refused, with no pop in between", "[queue][groups]") {
  auto clock = std::make_shared<ManualClock>();
  TrajectoryQueueOptions opt;
  opt.clock = clock;
  opt.group_timeout = 10s;
  auto q = make_queue(opt);
  REQUIRE(q->push(make_member(1, 7, 4, 0)).ok());
  REQUIRE(clock->advance(9s).ok());
  REQUIRE(q->push(make_member(2, 7, 4, 1)).ok());  // neither opens nor completes the group
  REQUIRE(clock->advance(1s).ok());
  expect_code(q->push(make_member(3, 7, 4, 2)), StatusCode::kFailedPrecondition, "group 7 is already closed");
  auto b = q->pop_batch(count_spec(8));
  REQUIRE(b.ok());
  CHECK(ids_of(*b) == std::vector<std::uint64_t>{1, 2});
  CHECK(b->info()[0].partial_group);
  CHECK(q->stats().group_wait.max_ms == Approx(10000));
}

TEST_CASE("timers of finished groups and leases are dropped, the live ones still fire", "[queue][groups][lease]") {
  auto clock = std::make_shared<ManualClock>();
  TrajectoryQueueOptions opt;
  opt.clock = clock;
  opt.group_timeout = 10s;
  opt.default_lease = 30s;
  auto q = make_queue(opt);
  REQUIRE(q->push(make_member(1, 1, 2, 0)).ok());  // stays pending
  // Far more finished groups (in every one of the queue's 16 shards) and acked batches than the
  // lazy pruning lets pile up.
  laminar::BatchId kept;
  for (std::uint64_t g = 100; g < 30100; ++g) {
    REQUIRE(q->push(make_member(2 * g, g, 2, 0)).ok());
    REQUIRE(q->push(make_member(2 * g + 1, g, 2, 1)).ok());
    auto b = q->pop_batch(count_spec(2));
    REQUIRE(b.ok());
    REQUIRE(b->size() == 2);
    if (g == 15000) {
      kept = b->id();
    } else {
      REQUIRE(q->ack(b->id()).ok());
    }
  }
  REQUIRE(clock->advance(10s).ok());
  auto partial = q->pop_batch(count_spec(8));
  REQUIRE(partial.ok());
  CHECK(ids_of(*partial) == std::vector<std::uint64_t>{1});
  CHECK(partial->info()[0].partial_group);
  REQUIRE(q->ack(partial->id()).ok());
  REQUIRE(clock->advance(20s).ok());
  auto again = q->pop_batch(count_spec(8));
  REQUIRE(again.ok());
  CHECK(ids_of(*again) == std::vector<std::uint64_t>{30000, 30001});
  CHECK(again->info()[0].delivery == 2);
  expect_code(q->ack(kept), StatusCode::kAborted, "expired");
  REQUIRE(q->ack(again->id()).ok());
  CHECK(q->stats().leases == 0);
}

TEST_CASE("leases: ack commits, nack and expiry redeliver, late ack is refused", "[queue][lease]") {
  auto clock = std::make_shared<ManualClock>();
  TrajectoryQueueOptions opt;
  opt.clock = clock;
  opt.default_lease = 30s;
  auto q = make_queue(opt);
  for (std::uint64_t id = 1; id <= 6; ++id) REQUIRE(q->push(make_traj(id)).ok());
  auto a = q->pop_batch(count_spec(2));
  auto b = q->pop_batch(count_spec(2));
  REQUIRE((a.ok() && b.ok()));
  REQUIRE(q->ack(a->id()).ok());
  expect_code(q->ack(a->id()), StatusCode::kNotFound, "already acked");
  REQUIRE(q->nack(b->id()).ok());
  // nacked ones come back first, marked as a second delivery
  auto c = q->pop_batch(count_spec(3));
  REQUIRE(c.ok());
  CHECK(ids_of(*c) == std::vector<std::uint64_t>{3, 4, 5});
  CHECK(c->info()[0].delivery == 2);
  CHECK(c->info()[2].delivery == 1);
  REQUIRE(clock->advance(29s).ok());
  BatchSpec longer = count_spec(1);
  longer.lease = 100s;
  auto d = q->pop_batch(longer);
  REQUIRE(d.ok());
  CHECK(ids_of(*d) == std::vector<std::uint64_t>{6});
  REQUIRE(clock->advance(1s).ok());  // c's lease runs out; d's does not
  expect_code(q->ack(c->id()), StatusCode::kAborted, "expired");
  auto e = q->pop_batch(count_spec(10));
  REQUIRE(e.ok());
  CHECK(ids_of(*e) == std::vector<std::uint64_t>{3, 4, 5});
  CHECK(e->info()[0].delivery == 3);
  REQUIRE(q->ack(e->id()).ok());
  REQUIRE(q->ack(d->id()).ok());
  auto st = q->stats();
  CHECK(st.acked == 6);
  CHECK(st.expired_leases == 1);
  CHECK(st.nacked_batches == 1);
  CHECK(st.redelivered == 5);
  CHECK(st.held_tokens == 0);
  // The consumer still reads an acked batch, and takes it over.
  std::vector<Trajectory> taken = e->release();
  CHECK(taken.size() == 3);
  CHECK(e->size() == 0);
}

TEST_CASE("statistics come out as JSON", "[queue][stats]") {
  auto clock = std::make_shared<ManualClock>();
  TrajectoryQueueOptions opt;
  opt.clock = clock;
  opt.initial_version = Version(3);
  auto q = make_queue(opt);
  REQUIRE(q->push(make_traj(1, 1)).ok());
  REQUIRE(q->push(make_member(2, 4, 2, 0, 3)).ok());
  REQUIRE(clock->advance(3ms).ok());
  REQUIRE(q->push(make_member(3, 4, 2, 1, 3)).ok());
  REQUIRE(q->push(make_member(5, 6, 2, 1, 3)).ok());
  BatchSpec s = count_spec(1);
  s.consumer_version = Version(3);
  auto b = q->pop_batch(s);
  REQUIRE(b.ok());
  auto j = nlohmann::json::parse(q->stats().to_json());
  CHECK(j["depth"]["ready"] == 2);
  CHECK(j["depth"]["pending_groups"] == 1);
  CHECK(j["depth"]["leased_trajectories"] == 1);
  CHECK(j["depth"]["newest_version"] == 3);
  CHECK(j["flow"]["pushed"] == 4);
  CHECK(j["staleness_histogram"]["2"] == 1);
  CHECK(j["staleness_histogram"]["16+"] == 0);
  CHECK(j["drops"]["stale"] == 0);
  CHECK(j["group_wait_ms"]["count"] == 1);
  CHECK(j["group_wait_ms"]["max"] == Approx(3.0));
  CHECK(j["group_wait_ms"]["buckets"][2]["n"] == 1);  // [2, 4) ms
  CHECK(j["wal"]["enabled"] == false);
}

TEST_CASE("multi-threaded stress: every trajectory acked exactly once", "[queue][stress]") {
  const unsigned seed = std::random_device{}();
  std::printf("stress seed %u\n", seed);
  constexpr int kProducers = 4, kConsumers = 3, kPerProducer = 3000;
  TrajectoryQueueOptions opt;
  opt.capacity_trajectories = 64;  // small, so producers block and wake a lot
  // Long enough that no member blocked waiting for room finds its group timed out: it would be
  // refused (rightly) and break the count below, and at 50 ms a slow run under TSan on a loaded
  // machine can wait that long. The ManualClock test further down races timeouts against pushes.
  opt.group_timeout = 10s;
  auto q = make_queue(opt);
  std::atomic<int> producers_left{kProducers};
  std::vector<std::vector<std::uint64_t>> acked(kConsumers);
  std::vector<int> errors(kProducers + kConsumers, 0);
  std::vector<std::thread> threads;
  for (int p = 0; p < kProducers; ++p) {
    threads.emplace_back([&, p] {
      std::mt19937 rng(seed + unsigned(p));
      std::vector<Trajectory> chunk;
      for (int i = 0; i < kPerProducer; ++i) {
        const std::uint64_t id = std::uint64_t(p) * kPerProducer + std::uint64_t(i) + 1;
        // Every other run of 4 consecutive ids of a producer forms a group.
        Trajectory t = make_traj(id, 0, 1 + rng() % 16);
        if ((i / 4) % 2) {
          t.group_id = laminar::GroupId((std::uint64_t(p) << 32) | std::uint64_t(i / 4));
          t.prompt_id = laminar::PromptId(t.group_id.value());
          t.group_size = 4;
          t.sample_index = std::uint32_t(i % 4);
        }
        const PushOptions mode = rng() % 3 ? PushOptions::block() : PushOptions::with_timeout(10s);
        // Odd producers push each 4 ids together.
        if (p % 2 == 0) {
          if (!q->push(std::move(t), mode).ok()) ++errors[std::size_t(p)];
          continue;
        }
        chunk.push_back(std::move(t));
        if (chunk.size() < 4) continue;
        for (const laminar::Status& st : q->push_many(chunk, mode)) {
          if (!st.ok()) ++errors[std::size_t(p)];
        }
        chunk.clear();
      }
      --producers_left;
    });
  }
  for (int c = 0; c < kConsumers; ++c) {
    threads.emplace_back([&, c] {
      std::mt19937 rng(seed * 7 + unsigned(c));
      for (;;) {
        BatchSpec s = count_spec(1 + rng() % 32);
        s.wait = 20ms;
        auto b = q->pop_batch(s);
        if (!b.ok()) {
          if (producers_left == 0 && q->stats().held_tokens == 0) return;
          continue;
        }
        if (rng() % 10 == 0) {
          if (!q->nack(b->id()).ok()) ++errors[std::size_t(kProducers + c)];
          continue;
        }
        if (!q->ack(b->id()).ok()) {
          ++errors[std::size_t(kProducers + c)];
          continue;
        }
        for (const Trajectory& t : b->trajectories()) acked[std::size_t(c)].push_back(t.id.value());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int e : errors) CHECK(e == 0);
  std::vector<std::uint64_t> all;
  for (auto& v : acked) all.insert(all.end(), v.begin(), v.end());
  std::sort(all.begin(), all.end());
  REQUIRE(all.size() == std::size_t(kProducers * kPerProducer));
  for (std::size_t i = 0; i < all.size(); ++i) REQUIRE(all[i] == i + 1);
  auto st = q->stats();
  CHECK(st.acked == std::uint64_t(kProducers * kPerProducer));
  CHECK(st.leases == 0);
  CHECK(q->background_error().ok());
}

// Producers share ids and groups: every group gets one member from each producer, every
// contended id is pushed by all of them at once, and the capacity bound must hold while all of it
// races.
TEST_CASE("a group's members from different threads, one id from many, capacity never exceeded",
          "[queue][stress]") {
  const unsigned seed = std::random_device{}();
  std::printf("shards seed %u\n", seed);
  constexpr int kProducers = 4, kConsumers = 2, kRounds = 300, kGroupsPerRound = 4;
  constexpr std::uint64_t kContendedBase = 1'000'000;
  TrajectoryQueueOptions opt;
  opt.capacity_trajectories = 24;
  opt.capacity_tokens = 400;
  auto q = make_queue(opt);
  // Rounds keep the pending groups within capacity: groups wait for members that producers
  // blocked on space would otherwise never push.
  std::barrier round(kProducers);
  std::atomic<int> producers_left{kProducers};
  std::atomic<bool> over{false};
  std::vector<int> errors(kProducers + kConsumers, 0);
  std::vector<int> contended_won(kProducers, 0);
  std::vector<std::vector<std::uint64_t>> acked(kConsumers);
  std::vector<std::thread> threads;
  for (int p = 0; p < kProducers; ++p) {
    threads.emplace_back([&, p] {
      std::mt19937 rng(seed + unsigned(p));
      for (int r = 0; r < kRounds; ++r) {
        for (int k = 0; k < kGroupsPerRound; ++k) {
          const std::uint64_t group = std::uint64_t(r * kGroupsPerRound + k);
          const std::uint32_t index = std::uint32_t((group + std::uint64_t(p)) % kProducers);
          Trajectory t = make_member(group * kProducers + index + 1, group, kProducers, index);
          t.prompt_tokens.assign(1 + rng() % 12, 7);
          if (!q->push(std::move(t)).ok()) ++errors[std::size_t(p)];
        }
        // All producers push the same id; exactly one may win.
        laminar::Status st = q->push(make_traj(kContendedBase + std::uint64_t(r)));
        if (st.ok()) {
          ++contended_won[std::size_t(p)];
        } else if (st.code() != StatusCode::kAlreadyExists) {
          ++errors[std::size_t(p)];
        }
        round.arrive_and_wait();
      }
      --producers_left;
    });
  }
  std::thread monitor([&] {
    while (producers_left > 0) {
      const auto st = q->stats();
      if (st.held_tokens > opt.capacity_tokens ||
          st.ready + st.pending_group_trajectories + st.leased_trajectories > opt.capacity_trajectories) {
        over = true;
      }
    }
  });
  for (int c = 0; c < kConsumers; ++c) {
    threads.emplace_back([&, c] {
      std::mt19937 rng(seed * 7 + unsigned(c));
      for (;;) {
        BatchSpec s = count_spec(1 + rng() % 16);
        s.wait = 20ms;
        auto b = q->pop_batch(s);
        if (!b.ok()) {
          if (producers_left == 0 && q->stats().held_tokens == 0) return;
          continue;
        }
        if (!q->ack(b->id()).ok()) ++errors[std::size_t(kProducers + c)];
        for (const Trajectory& t : b->trajectories()) acked[std::size_t(c)].push_back(t.id.value());
      }
    });
  }
  for (auto& t : threads) t.join();
  monitor.join();
  for (int e : errors) CHECK(e == 0);
  CHECK_FALSE(over);
  CHECK(std::accumulate(contended_won.begin(), contended_won.end(), 0) == kRounds);
  std::vector<std::uint64_t> all;
  for (auto& v : acked) all.insert(all.end(), v.begin(), v.end());
  std::sort(all.begin(), all.end());
  constexpr std::size_t kMembers = std::size_t(kRounds) * kGroupsPerRound * kProducers;
  REQUIRE(all.size() == kMembers + kRounds);
  for (std::size_t i = 0; i < kMembers; ++i) REQUIRE(all[i] == i + 1);
  for (std::size_t r = 0; r < std::size_t(kRounds); ++r) REQUIRE(all[kMembers + r] == kContendedBase + r);
  CHECK(q->stats().pushed == kMembers + kRounds);
}

TEST_CASE("exactly-once under random consumer death", "[queue][stress][lease]") {
  const unsigned seed = std::random_device{}();
  std::printf("consumer-death seed %u\n", seed);
  constexpr std::uint64_t kTotal = 4000;
  constexpr int kConsumers = 4;
  auto clock = std::make_shared<ManualClock>();
  TrajectoryQueueOptions opt;
  opt.clock = clock;
  opt.default_lease = 5s;
  auto q = make_queue(opt);
  for (std::uint64_t id = 1; id <= kTotal; ++id) REQUIRE(q->push(make_traj(id)).ok());

  std::atomic<bool> stop{false};
  std::atomic<int> finished{0};
  std::vector<std::vector<std::uint64_t>> acked(kConsumers);
  std::vector<int> unexpected(kConsumers, 0);
  std::vector<std::thread> threads;
  for (int c = 0; c < kConsumers; ++c) {
    threads.emplace_back([&, c] {
      std::mt19937 rng(seed + unsigned(c));
      while (!stop) {
        BatchSpec s = count_spec(1 + rng() % 16);
        s.wait = 1s;  // virtual: the clock driver below moves time
        auto b = q->pop_batch(s);
        if (!b.ok()) continue;
        const unsigned fate = rng() % 8;
        if (fate == 0) continue;  // dies holding the lease: expiry must bring the batch back
        if (fate == 1) {
          // dies after its lease ran out, then tries to commit: must be refused
          while (!stop && clock->now() < b->lease_deadline()) std::this_thread::yield();
          laminar::Status st = q->ack(b->id());
          if (st.code() != StatusCode::kAborted && !stop) ++unexpected[std::size_t(c)];
          continue;
        }
        laminar::Status st = q->ack(b->id());
        if (st.ok()) {
          for (const Trajectory& t : b->trajectories()) acked[std::size_t(c)].push_back(t.id.value());
        } else if (st.code() != StatusCode::kAborted) {
          ++unexpected[std::size_t(c)];
        }
      }
      ++finished;
    });
  }
  // Drive virtual time until everything is acked.
  for (int step = 0; step < 200000 && q->stats().acked < kTotal; ++step) {
    REQUIRE(clock->advance(100ms).ok());
    std::this_thread::yield();
  }
  stop = true;
  q->close();  // wakes a consumer waiting in virtual time; acks are still taken
  for (auto& t : threads) t.join();
  CHECK(finished == kConsumers);
  for (int u : unexpected) CHECK(u == 0);
  std::vector<std::uint64_t> all;
  for (auto& v : acked) all.insert(all.end(), v.begin(), v.end());
  std::sort(all.begin(), all.end());
  REQUIRE(all.size() == kTotal);
  for (std::size_t i = 0; i < all.size(); ++i) REQUIRE(all[i] == i + 1);
  auto st = q->stats();
  CHECK(st.acked == kTotal);
  CHECK(st.expired_leases > 0);
  CHECK(st.delivered > kTotal);
}

TEST_CASE("WAL: push and push_many from many threads while consumers ack, then a restart", "[queue][wal][stress]") {
  const std::string path = temp_path("threads");
  std::filesystem::remove(path);
  TrajectoryQueueOptions opt;
  opt.wal_path = path;
  opt.capacity_trajectories = 32;  // producers wait for acks
  constexpr std::uint64_t kEach = 600;
  std::vector<int> errors(4, 0);
  {
    auto q = make_queue(opt);
    std::atomic<std::uint64_t> acked{0};
    std::vector<std::thread> threads;
    // Producer 0 pushes one at a time; producer 1 each group of 4 with one push_many.
    for (int p = 0; p < 2; ++p) {
      threads.emplace_back([&, p] {
        std::vector<Trajectory> group;
        for (std::uint64_t i = 0; i < kEach; ++i) {
          const std::uint64_t id = 1 + std::uint64_t(p) * kEach + i;
          if (p == 0) {
            if (!q->push(make_traj(id)).ok()) ++errors[std::size_t(p)];
            continue;
          }
          group.push_back(make_member(id, 1000 + i / 4, 4, std::uint32_t(i % 4)));
          if (group.size() < 4) continue;
          for (const laminar::Status& st : q->push_many(group)) {
            if (!st.ok()) ++errors[std::size_t(p)];
          }
          group.clear();
        }
      });
    }
    for (int c = 2; c < 4; ++c) {
      threads.emplace_back([&, c] {
        BatchSpec spec = count_spec(8);
        spec.wait = 10ms;
        while (acked.load() < 2 * kEach) {
          laminar::Result<Batch> b = q->pop_batch(spec);
          if (!b.ok()) {
            if (b.status().code() != StatusCode::kDeadlineExceeded) ++errors[std::size_t(c)];
            continue;
          }
          if (!q->ack(b->id()).ok()) ++errors[std::size_t(c)];
          acked += b->size();
        }
      });
    }
    for (auto& t : threads) t.join();
    CHECK(acked.load() == 2 * kEach);
  }
  CHECK(std::accumulate(errors.begin(), errors.end(), 0) == 0);
  // Everything was acked: nothing comes back, and the acked ids stay refused.
  auto q = make_queue(opt);
  CHECK(q->recovery().recovered == 0);
  CHECK(q->recovery().retired == 2 * kEach);
  expect_code(q->push(make_traj(1)), StatusCode::kAlreadyExists, "id already pushed");
  expect_code(q->push(make_member(kEach + 1, 1000, 4, 0)), StatusCode::kAlreadyExists, "id already pushed");
  q.reset();
  std::filesystem::remove(path);
}

TEST_CASE("WAL: a reopened queue redelivers exactly the unacked trajectories", "[queue][wal]") {
  const std::string path = temp_path("reopen");
  std::filesystem::remove(path);
  TrajectoryQueueOptions opt;
  opt.wal_path = path;
  opt.group_timeout = 1h;
  {
    auto q = make_queue(opt);
    CHECK_FALSE(q->recovery().replayed);
    REQUIRE(q->publish_version(Version(4)).ok());
    for (std::uint64_t id = 1; id <= 10; ++id) REQUIRE(q->push(make_traj(id, id % 5)).ok());
    REQUIRE(q->push(make_member(20, 3, 3, 0)).ok());  // a pending group of 3 ...
    REQUIRE(q->push(make_member(21, 3, 3, 2)).ok());
    REQUIRE(q->push(make_member(30, 4, 2, 0)).ok());  // ... and a complete one
    REQUIRE(q->push(make_member(31, 4, 2, 1)).ok());
    auto a = q->pop_batch(count_spec(4));  // 1..4 acked
    REQUIRE(a.ok());
    REQUIRE(q->ack(a->id()).ok());
    auto leased = q->pop_batch(count_spec(2));  // 5, 6 leased, never acked
    REQUIRE(leased.ok());
    BatchSpec drop = count_spec(1);
    drop.consumer_version = Version(4);
    drop.staleness_rule = StalenessRule::kDrop;
    drop.max_staleness = 3;
    auto d = q->pop_batch(drop);  // drops 10 (version 0, staleness 4), leases 7
    REQUIRE(d.ok());
    CHECK(ids_of(*d) == std::vector<std::uint64_t>{7});
  }
  auto q = make_queue(opt);
  const auto& r = q->recovery();
  CHECK(r.replayed);
  CHECK(r.tail.ok());
  CHECK(r.retired == 4);  // 1..4 acked; 10 was not dropped: 7 sat in front of it
  CHECK(q->newest_version() == Version(4));
  CHECK(r.recovered == 6 + 2 + 2);
  const auto rj = nlohmann::json::parse(r.to_json());
  CHECK(rj["recovered"] == 10);
  CHECK(rj["retired"] == 4);
  CHECK(rj["tail"] == "OK");
  auto b = q->pop_batch(count_spec(100));
  REQUIRE(b.ok());
  CHECK(ids_of(*b) == std::vector<std::uint64_t>{5, 6, 7, 8, 9, 10, 30, 31});
  CHECK(q->stats().pending_groups == 1);
  expect_code(q->push(make_traj(2)), StatusCode::kAlreadyExists, "already pushed");  // acked before restart
  expect_code(q->push(make_member(32, 4, 2, 0)), StatusCode::kFailedPrecondition, "already closed");
  REQUIRE(q->push(make_member(22, 3, 3, 1)).ok());
  auto g = q->pop_batch(count_spec(100));
  REQUIRE(g.ok());
  CHECK(ids_of(*g) == std::vector<std::uint64_t>{20, 22, 21});
  std::filesystem::remove(path);
}

TEST_CASE("WAL: torn and corrupt tails are cut and reported, a damaged middle refuses to open",
          "[queue][wal][bad-input]") {
  const std::string path = temp_path("torn");
  TrajectoryQueueOptions opt;
  opt.wal_path = path;
  auto write_log = [&] {
    std::filesystem::remove(path);
    auto q = make_queue(opt);
    for (std::uint64_t id = 1; id <= 5; ++id) REQUIRE(q->push(make_traj(id)).ok());
  };
  const std::uintmax_t record = 32 + 80 + 4 * (2 + 4 + 4) + 4;  // one push record
  write_log();
  const std::uintmax_t full = std::filesystem::file_size(path);
  REQUIRE(full == 16 + 5 * record);

  SECTION("torn in the last record's payload") {
    std::filesystem::resize_file(path, full - 7);
    auto q = make_queue(opt);
    expect_code(q->recovery().tail, StatusCode::kDataLoss, "payload cut short");
    CHECK(q->recovery().recovered == 4);
    CHECK(q->recovery().discarded_bytes == record - 7);
    CHECK(std::filesystem::file_size(path) == 16 + 4 * record);
    REQUIRE(q->push(make_traj(6)).ok());  // appends after the good prefix
  }
  SECTION("torn in the last record's header") {
    std::filesystem::resize_file(path, 16 + 4 * record + 10);
    auto q = make_queue(opt);
    expect_code(q->recovery().tail, StatusCode::kDataLoss, "header cut short");
    CHECK(q->recovery().recovered == 4);
  }
  SECTION("checksum mismatch in the last record") {
    {
      std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(std::streamoff(full - 3));
      f.put('\x5a');
    }
    auto q = make_queue(opt);
    expect_code(q->recovery().tail, StatusCode::kDataLoss, "checksum mismatch");
    CHECK(q->recovery().recovered == 4);
    auto b = q->pop_batch(count_spec(10));
    REQUIRE(b.ok());
    CHECK(ids_of(*b) == std::vector<std::uint64_t>{1, 2, 3, 4});
  }
  SECTION("damage in the middle") {
    {
      std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(std::streamoff(16 + record + 60));
      f.put('\x5a');
    }
    expect_code(TrajectoryQueue::create(opt).status(), StatusCode::kDataLoss, "that are not all zero follow it");
  }
  SECTION("not a WAL") {
    std::ofstream(path, std::ios::trunc) << "this is not a log at all";
    expect_code(TrajectoryQueue::create(opt).status(), StatusCode::kFailedPrecondition,
                "not a laminar write-ahead log");
    std::ifstream f(path);
    CHECK(std::string(std::istreambuf_iterator<char>(f), {}) == "this is not a log at all");  // left as it was
  }
  std::filesystem::remove(path);
}

TEST_CASE("WAL: a second queue on the same log is refused while the first is open", "[queue][wal][bad-input]") {
  const std::string path = temp_path("two_queues");
  std::filesystem::remove(path);
  TrajectoryQueueOptions opt;
  opt.wal_path = path;
  auto q = make_queue(opt);
  REQUIRE(q->push(make_traj(1)).ok());
  expect_code(TrajectoryQueue::create(opt).status(), StatusCode::kFailedPrecondition, "in use by another queue");
  q.reset();
  auto again = make_queue(opt);
  CHECK(again->recovery().recovered == 1);
  again.reset();
  std::filesystem::remove(path);
}

TEST_CASE("WAL: compaction keeps the log small and the state intact", "[queue][wal]") {
  const std::string path = temp_path("compact");
  std::filesystem::remove(path);
  TrajectoryQueueOptions opt;
  opt.wal_path = path;
  opt.wal_compact_bytes = 64 << 10;
  {
    auto q = make_queue(opt);
    for (std::uint64_t id = 1; id <= 2000; ++id) {
      REQUIRE(q->push(make_traj(id, 0, 32)).ok());
      if (id % 10 != 0) {
        auto b = q->pop_batch(count_spec(1));
        REQUIRE(b.ok());
        REQUIRE(q->ack(b->id()).ok());
      }
    }
    auto st = q->stats();
    CHECK(st.wal_compactions > 0);
    CHECK(st.wal_bytes < 3 * (64u << 10));
    CHECK(q->background_error().ok());
  }
  auto q = make_queue(opt);
  CHECK(q->recovery().tail.ok());
  CHECK(q->recovery().recovered == 200);
  expect_code(q->push(make_traj(5)), StatusCode::kAlreadyExists, "already pushed");  // acked
  auto b = q->pop_batch(count_spec(1000));
  REQUIRE(b.ok());
  std::vector<std::uint64_t> want;
  for (std::uint64_t id = 1801; id <= 2000; ++id) want.push_back(id);  // FIFO: the last 200 stay
  CHECK(ids_of(*b) == want);
  std::filesystem::remove(path);
}

TEST_CASE("validate_contents off keeps the O(1) checks only", "[queue][bad-input]") {
  TrajectoryQueueOptions opt;
  opt.validate_contents = false;
  auto q = make_queue(opt);
  Trajectory odd = make_traj(1);
  odd.response_tokens[0] = -3;  // not scanned
  odd.rewards[0] = NAN;  // values are contents too
  CHECK(q->push(std::move(odd)).ok());
  Trajectory short_lp = make_traj(2);
  short_lp.logprobs.pop_back();  // lengths are still checked
  expect_code(q->push(std::move(short_lp)), StatusCode::kInvalidArgument, "3 logprobs for 4 response tokens");
  expect_code(q->push(make_traj(3, 1)), StatusCode::kInvalidArgument, "ahead of the newest");
  CHECK(laminar::validate_trajectory(make_traj(4), false).ok());
}

// The log brings back what the queue took, as it took it: contents it did not check do not
// stop a restart.
TEST_CASE("WAL: with validate_contents off, what the queue took comes back after a restart", "[queue][wal]") {
  const std::string path = temp_path("unchecked");
  std::filesystem::remove(path);
  TrajectoryQueueOptions opt;
  opt.validate_contents = false;
  opt.wal_path = path;
  Trajectory odd = make_traj(1);
  odd.response_tokens[0] = -3;
  odd.rewards[0] = INFINITY;
  odd.metadata = "not JSON";
  REQUIRE(make_queue(opt)->push(Trajectory(odd)).ok());
  auto q = TrajectoryQueue::create(opt);
  INFO(q.status().to_string());
  REQUIRE(q.ok());
  CHECK((*q)->recovery().recovered == 1);
  auto b = (*q)->pop_batch(count_spec(1));
  REQUIRE(b.ok());
  CHECK(b->trajectories()[0] == odd);
  q->reset();
  std::filesystem::remove(path);
}

TEST_CASE("Batch::release copies while the queue still holds the lease", "[queue][lease]") {
  auto q = make_queue();
  REQUIRE(q->push(make_traj(1)).ok());
  auto b = q->pop_batch(count_spec(1));
  REQUIRE(b.ok());
  Batch copy = *b;
  std::vector<Trajectory> taken = copy.release();  // leased: the queue keeps its own
  REQUIRE(taken.size() == 1);
  REQUIRE(q->nack(b->id()).ok());
  auto again = q->pop_batch(count_spec(1));
  REQUIRE(again.ok());
  CHECK(again->trajectories()[0] == taken[0]);
  CHECK(again->info()[0].delivery == 2);
}

TEST_CASE("the id dedup window stays exact through heavy churn", "[queue][bad-input]") {
  const unsigned seed = std::random_device{}();
  std::printf("dedup seed %u\n", seed);
  std::mt19937_64 rng(seed);
  TrajectoryQueueOptions opt;
  opt.id_dedup_window = 97;
  auto q = make_queue(opt);
  std::deque<std::uint64_t> window;  // model: the last 97 retired ids
  for (int i = 0; i < 5000; ++i) {
    // Random ids collide in the hash table's probe runs; some are retired ids coming back.
    std::uint64_t id = rng() % 4 == 0 && !window.empty() ? window[rng() % window.size()] : rng() % 100000;
    const bool in_window = std::find(window.begin(), window.end(), id) != window.end();
    laminar::Status st = q->push(make_traj(id));
    if (in_window) {
      REQUIRE(st.code() == StatusCode::kAlreadyExists);
      continue;
    }
    REQUIRE(st.ok());
    auto b = q->pop_batch(count_spec(1));
    REQUIRE(b.ok());
    REQUIRE(q->ack(b->id()).ok());
    window.push_back(id);
    if (window.size() > 97) window.pop_front();
  }
}

TEST_CASE("after acks from many threads the window holds exactly the last ids retired", "[queue][stress]") {
  TrajectoryQueueOptions opt;
  opt.id_dedup_window = 3;
  auto q = make_queue(opt);
  constexpr std::uint64_t kThreads = 4, kEach = 3000;
  std::vector<int> errors(kThreads, 0);
  std::vector<std::thread> threads;
  for (std::uint64_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (std::uint64_t i = 0; i < kEach; ++i) {
        // Interleaved ids: the threads' ids share the id table's blocks.
        const std::uint64_t id = 1 + i * kThreads + t;
        if (!q->push(make_traj(id)).ok()) ++errors[t];
        laminar::Result<Batch> b = q->pop_batch(count_spec(1));
        if (!b.ok() || !q->ack(b->id()).ok()) ++errors[t];
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(std::accumulate(errors.begin(), errors.end(), 0) == 0);
  // Every id but the last 3 retired has left the window, whatever order the acks' changes to the
  // id table were made in.
  std::size_t refused = 0;
  for (std::uint64_t id = 1; id <= kThreads * kEach; ++id) {
    const laminar::Status st = q->push(make_traj(id));
    if (!st.ok()) {
      CHECK(st.code() == StatusCode::kAlreadyExists);
      ++refused;
    }
  }
  CHECK(refused == 3);
}

TEST_CASE("a closed group is remembered for exactly id_dedup_window group closings", "[queue][groups]") {
  TrajectoryQueueOptions opt;
  opt.id_dedup_window = 3;
  auto q = make_queue(opt);
  std::uint64_t id = 1;
  auto close_group = [&](std::uint64_t g) {
    REQUIRE(q->push(make_member(id++, g, 2, 0)).ok());
    REQUIRE(q->push(make_member(id++, g, 2, 1)).ok());
  };
  for (std::uint64_t g : {10, 11, 12}) close_group(g);
  expect_code(q->push(make_member(id++, 10, 2, 0)), StatusCode::kFailedPrecondition, "group 10 is already closed");
  close_group(13);  // group 10 leaves the window
  CHECK(q->push(make_member(id++, 10, 2, 0)).ok());
  expect_code(q->push(make_member(id++, 11, 2, 0)), StatusCode::kFailedPrecondition, "group 11 is already closed");
}

TEST_CASE("an id a refused push gave back can be pushed again, its neighbours stay refused", "[queue][bad-input]") {
  // Consecutive ids share blocks of the id table; forgetting one must not hide the others.
  auto q = make_queue();
  REQUIRE(q->push(make_member(5000, 7, 2, 0)).ok());
  REQUIRE(q->push(make_member(5001, 7, 2, 1)).ok());  // group 7 is now closed
  for (std::uint64_t id = 1; id <= 300; ++id) {
    if (id % 3 == 0) {
      expect_code(q->push(make_member(id, 7, 2, 0)), StatusCode::kFailedPrecondition, "already closed");
    } else {
      REQUIRE(q->push(make_traj(id)).ok());
    }
  }
  for (std::uint64_t id = 1; id <= 300; ++id) {
    if (id % 3 == 0) {
      REQUIRE(q->push(make_traj(id)).ok());
    } else {
      expect_code(q->push(make_traj(id)), StatusCode::kAlreadyExists, "id already pushed");
    }
  }
  for (std::uint64_t id = 1; id <= 300; ++id) {
    expect_code(q->push(make_traj(id)), StatusCode::kAlreadyExists, "id already pushed");
  }
}

// Races what crosses between producers and consumers: acks against lease expiry, stale drops
// against pushes waiting for the space they free, and group timeouts fired by consumers while
// producers push.
TEST_CASE("exactly-once while expiry, stale drops and group timeouts race pushes and acks",
          "[queue][stress][lease]") {
  const unsigned seed = std::random_device{}();
  std::printf("race seed %u\n", seed);
  const PartialGroupPolicy policy = GENERATE(PartialGroupPolicy::kRelease, PartialGroupPolicy::kDrop);
  constexpr int kProducers = 2, kConsumers = 3, kGroupsPerProducer = 300;
  auto clock = std::make_shared<ManualClock>();
  TrajectoryQueueOptions opt;
  opt.clock = clock;
  opt.capacity_trajectories = 48;  // small, so producers block on the space acks and drops free
  opt.default_lease = 2s;
  opt.group_timeout = 3s;
  opt.partial_group_policy = policy;
  opt.id_dedup_window = 64;
  auto q = make_queue(opt);

  std::atomic<int> producers_left{kProducers};
  std::atomic<bool> stop{false};
  std::atomic<int> consumers_done{0};
  std::atomic<std::uint64_t> late{0};
  std::vector<int> errors(kProducers + kConsumers, 0);
  std::vector<std::vector<std::uint64_t>> acked(kConsumers);
  std::vector<std::thread> threads;
  for (int p = 0; p < kProducers; ++p) {
    threads.emplace_back([&, p] {
      std::mt19937 rng(seed + unsigned(p));
      for (int g = 0; g < kGroupsPerProducer; ++g) {
        const std::uint64_t group = std::uint64_t(p) * kGroupsPerProducer + std::uint64_t(g) + 1;
        // One group in five never gets its last member: only its timeout closes it.
        const std::uint32_t members = rng() % 5 == 0 ? 3 : 4;
        for (std::uint32_t i = 0; i < members; ++i) {
          Trajectory t = make_member(group * 4 + i, group, 4, i, q->newest_version().value());
          laminar::Status st = q->push(std::move(t));
          // A member that waited for space longer than its group's timeout comes too late.
          if (st.code() == StatusCode::kFailedPrecondition) {
            ++late;
          } else if (!st.ok()) {
            ++errors[std::size_t(p)];
          }
        }
      }
      --producers_left;
    });
  }
  for (int c = 0; c < kConsumers; ++c) {
    threads.emplace_back([&, c] {
      std::mt19937 rng(seed * 7 + unsigned(c));
      while (!stop) {
        BatchSpec s = count_spec(4 + rng() % 16);
        s.wait = 1s;  // virtual
        s.consumer_version = q->newest_version();
        s.staleness_rule = StalenessRule::kDrop;
        s.max_staleness = 1;
        auto b = q->pop_batch(s);
        if (!b.ok()) continue;
        const unsigned fate = rng() % 6;
        if (fate == 0) continue;  // lets the lease run out
        if (fate == 1) {
          if (!q->nack(b->id()).ok() && q->ack(b->id()).code() != StatusCode::kAborted) {
            ++errors[std::size_t(kProducers + c)];
          }
          continue;
        }
        laminar::Status st = q->ack(b->id());
        if (st.ok()) {
          for (const Trajectory& t : b->trajectories()) acked[std::size_t(c)].push_back(t.id.value());
        } else if (st.code() != StatusCode::kAborted) {
          ++errors[std::size_t(kProducers + c)];
        }
      }
      ++consumers_done;
    });
  }
  // Virtual time and versions move while everyone works.
  std::uint64_t version = 0;
  for (int step = 0; step < 400000; ++step) {
    const auto s = q->stats();
    if (producers_left == 0 && s.held_tokens == 0 && s.pending_groups == 0) break;
    REQUIRE(clock->advance(100ms).ok());
    if (step % 50 == 0) REQUIRE(q->publish_version(Version(++version)).ok());
    std::this_thread::yield();
  }
  stop = true;
  q->close();  // wakes a consumer waiting in virtual time; acks are still taken
  for (auto& t : threads) t.join();
  CHECK(consumers_done == kConsumers);
  for (int e : errors) CHECK(e == 0);

  std::vector<std::uint64_t> all;
  for (auto& v : acked) all.insert(all.end(), v.begin(), v.end());
  std::sort(all.begin(), all.end());
  CHECK(std::adjacent_find(all.begin(), all.end()) == all.end());  // no trajectory acked twice
  const auto st = q->stats();
  CHECK(st.acked == all.size());
  // Every pushed trajectory ended exactly one way, and nothing is held any more.
  CHECK(st.pushed == st.acked + st.dropped_stale + st.dropped_group_timeout);
  CHECK(st.dropped_late_for_group == late);
  CHECK(st.held_tokens == 0);
  CHECK(st.ready == 0);
  CHECK(st.leases == 0);
  CHECK(st.pending_groups == 0);
  CHECK(st.group_wait.count > 0);
  CHECK(st.expired_leases > 0);
  if (policy == PartialGroupPolicy::kDrop) CHECK(st.dropped_group_timeout > 0);
  CHECK(q->background_error().ok());
}
