// A producer-and-consumer process for trajectory_queue_wal_test: it opens a TrajectoryQueue with a
// write-ahead log, pushes trajectories and acks small batches, and reports each step on stdout the
// moment it is done, until the test kills it with SIGKILL.
//
//   trajectory_queue_wal_child WAL_PATH FIRST_ID COUNT
//
// Lines: "P id" after a push (or the push_many of its group) returned OK; "L batch id..." after a pop, before its ack; "A batch"
// after the ack returned OK; "DONE" when everything pushed was acked.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "laminar/trajectory_queue.h"

namespace {

void say(std::string l) {
  l.push_back('\n');
  // One write per line: a pipe write this small is atomic, so a kill never leaves half a line.
  if (::write(1, l.data(), l.size()) != ssize_t(l.size())) std::_Exit(3);
}

int fail(const laminar::Status& st) {
  std::fprintf(stderr, "wal child: %s\n", st.to_string().c_str());
  return 2;
}

int drain_one(laminar::TrajectoryQueue& q, std::chrono::milliseconds wait) {
  laminar::BatchSpec spec;
  spec.max_trajectories = 3;
  spec.wait = wait;
  auto b = q.pop_batch(spec);
  if (!b.ok()) {
    const auto c = b.status().code();
    return c == laminar::StatusCode::kUnavailable || c == laminar::StatusCode::kDeadlineExceeded ? 0 : -1;
  }
  std::string line = "L";
  line.append(" ").append(std::to_string(b->id().value()));
  for (const auto& t : b->trajectories()) line.append(" ").append(std::to_string(t.id.value()));
  say(std::move(line));
  if (!q.ack(b->id()).ok()) return -1;
  say(std::string("A ").append(std::to_string(b->id().value())));
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s WAL_PATH FIRST_ID COUNT\n", argv[0]);
    return 2;
  }
  const std::uint64_t first = std::strtoull(argv[2], nullptr, 10);
  const std::uint64_t count = std::strtoull(argv[3], nullptr, 10);
  laminar::TrajectoryQueueOptions opt;
  opt.wal_path = argv[1];
  opt.group_timeout = std::chrono::milliseconds(30);
  opt.partial_group_policy = laminar::PartialGroupPolicy::kRelease;
  auto q = laminar::TrajectoryQueue::create(opt);
  if (!q.ok()) return fail(q.status());
  std::mt19937 rng{static_cast<unsigned>(first)};
  std::vector<laminar::Trajectory> group;  // members going in with one push_many
  for (std::uint64_t id = first; id < first + count; ++id) {
    laminar::Trajectory t;
    t.id = laminar::TrajectoryId(id);
    t.prompt_id = laminar::PromptId(id);
    // Every third run of four ids is a GRPO group of 4, pushed with one push_many call (one may
    // be cut by a kill and then released partial by the group timeout after the restart).
    const bool grouped = (id / 4) % 3 == 0;
    if (grouped) {
      t.group_id = laminar::GroupId(id / 4);
      t.prompt_id = laminar::PromptId(id / 4);
      t.group_size = 4;
      t.sample_index = std::uint32_t(id % 4);
    }
    t.prompt_tokens.assign(16, 3);
    const std::size_t n = 50 + rng() % 250;
    t.response_tokens.assign(n, 11);
    t.logprobs.assign(n, -0.25f);
    t.rewards = {float(id % 2)};
    if (grouped) {
      group.push_back(std::move(t));
      if (id % 4 != 3 && id + 1 < first + count) continue;
      std::vector<std::uint64_t> ids;
      for (const laminar::Trajectory& m : group) ids.push_back(m.id.value());
      for (const laminar::Status& st : (*q)->push_many(group)) {
        if (!st.ok()) return fail(st);
      }
      for (std::uint64_t m : ids) say(std::string("P ").append(std::to_string(m)));
      group.clear();
    } else {
      laminar::Status st = (*q)->push(std::move(t));
      if (!st.ok()) return fail(st);
      say(std::string("P ").append(std::to_string(id)));
    }
    if (drain_one(**q, std::chrono::milliseconds(0)) < 0) return 4;
  }
  for (;;) {
    const int r = drain_one(**q, std::chrono::milliseconds(100));
    if (r < 0) return 4;
    if (r == 0 && (*q)->stats().held_tokens == 0) break;
  }
  say("DONE");
  return 0;
}
