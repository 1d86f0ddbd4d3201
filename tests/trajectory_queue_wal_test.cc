// Kill-and-restart test of TrajectoryQueue's write-ahead log with real processes: a child
// (trajectory_queue_wal_child) pushes and acks until it is killed with SIGKILL mid-stream; the next
// child recovers from the log and goes on; finally this process recovers and drains what is left.
// Every trajectory must then have been acked exactly once: none lost, none delivered after an ack.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "laminar/trajectory_queue.h"

namespace {

// A child we started; killed (by its pid, and only it) if the test leaves early.
class Child {
 public:
  Child(const std::vector<std::string>& argv) {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      ::dup2(fds[1], 1);
      ::close(fds[0]);
      ::close(fds[1]);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      std::_Exit(127);
    }
    ::close(fds[1]);
    out_ = ::fdopen(fds[0], "r");
    REQUIRE(out_ != nullptr);
  }
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (out_) std::fclose(out_);
  }
  // The next line without its newline; false at end of output.
  bool read_line(std::string& line) {
    char buf[4096];
    if (!std::fgets(buf, sizeof(buf), out_)) return false;
    line = buf;
    if (!line.empty() && line.back() == '\n') line.pop_back();
    return true;
  }
  void kill_now() { REQUIRE(::kill(pid_, SIGKILL) == 0); }
  // Waits for the exit; returns the raw wait status.
  int reap() {
    int status = 0;
    REQUIRE(::waitpid(pid_, &status, 0) == pid_);
    pid_ = -1;
    return status;
  }

 private:
  pid_t pid_ = -1;
  std::FILE* out_ = nullptr;
};

}  // namespace

TEST_CASE("WAL survives SIGKILL mid-stream: every trajectory acked exactly once", "[queue][wal][process]") {
  const unsigned seed = std::random_device{}();
  std::printf("wal kill seed %u\n", seed);
  std::mt19937 rng(seed);
  const std::string wal = (std::filesystem::temp_directory_path() /
                           ("laminar_tq_kill_" + std::to_string(::getpid())))
                              .string();
  std::filesystem::remove(wal);

  std::set<std::uint64_t> pushed, in_flight, ambiguous;
  std::map<std::uint64_t, int> acked;  // id -> times a successful ack covered it
  std::uint64_t next_id = 1;
  constexpr int kRounds = 4;
  for (int round = 0; round < kRounds; ++round) {
    const std::uint64_t first = next_id;
    Child child({LAMINAR_WAL_CHILD, wal, std::to_string(first), "100000"});
    const int kill_after = 50 + int(rng() % 600);
    std::map<std::uint64_t, std::vector<std::uint64_t>> leased;  // batch -> ids, not yet confirmed
    std::uint64_t last_pushed = first - 1;
    std::string line;
    for (int n = 0; child.read_line(line); ++n) {
      if (n == kill_after) child.kill_now();
      std::istringstream in(line);
      std::string kind;
      in >> kind;
      if (kind == "P") {
        std::uint64_t id;
        in >> id;
        REQUIRE(pushed.insert(id).second);
        last_pushed = id;
      } else if (kind == "L") {
        std::uint64_t batch, id;
        in >> batch;
        while (in >> id) leased[batch].push_back(id);
      } else if (kind == "A") {
        std::uint64_t batch;
        in >> batch;
        REQUIRE(leased.count(batch) == 1);
        for (std::uint64_t id : leased[batch]) ++acked[id];
        leased.erase(batch);
      } else {
        FAIL("unexpected line from the child: " << line);
      }
    }
    const int status = child.reap();
    REQUIRE(WIFSIGNALED(status));
    REQUIRE(WTERMSIG(status) == SIGKILL);  // killed mid-stream, not finished
    // The kill may land after the log took a push (or a push_many of up to 4) or an ack but
    // before the child said so.
    for (std::uint64_t k = 1; k <= 4; ++k) in_flight.insert(last_pushed + k);
    REQUIRE(leased.size() <= 1);
    for (const auto& [batch, ids] : leased) ambiguous.insert(ids.begin(), ids.end());
    next_id = last_pushed + 5;
    INFO("round " << round << ": killed after " << kill_after << " lines, " << pushed.size()
                  << " pushed so far");
  }

  // Recover in this process and drain everything the log still holds.
  laminar::TrajectoryQueueOptions opt;
  opt.wal_path = wal;
  opt.group_timeout = std::chrono::milliseconds(30);
  auto q = laminar::TrajectoryQueue::create(opt);
  REQUIRE(q.ok());
  INFO("recovery tail: " << (*q)->recovery().tail.to_string());
  const std::uint64_t recovered = (*q)->recovery().recovered;
  const std::span<const laminar::TrajectoryId> recovered_ids = (*q)->recovered_ids();
  CHECK(recovered_ids.size() == recovered);
  std::set<std::uint64_t> drained_ids;
  std::uint64_t drained = 0;
  for (;;) {
    laminar::BatchSpec spec;
    spec.max_trajectories = 64;
    spec.wait = std::chrono::milliseconds(200);
    auto b = (*q)->pop_batch(spec);
    if (!b.ok()) {
      REQUIRE(b.status().code() == laminar::StatusCode::kDeadlineExceeded);
      break;
    }
    REQUIRE((*q)->ack(b->id()).ok());
    for (const auto& t : b->trajectories()) {
      ++acked[t.id.value()];
      drained_ids.insert(t.id.value());
    }
    drained += b->size();
  }
  CHECK(drained == recovered);
  std::set<std::uint64_t> told;
  for (laminar::TrajectoryId id : recovered_ids) told.insert(id.value());
  CHECK(told == drained_ids);
  CHECK((*q)->stats().held_tokens == 0);

  std::uint64_t lost = 0, twice = 0, unknown = 0;
  for (std::uint64_t id : pushed) {
    const int n = acked.count(id) ? acked[id] : 0;
    if (n > 1) ++twice;
    // An ambiguous id may have had its ack logged just before the kill: then it is rightly gone.
    if (n == 0 && ambiguous.count(id) == 0) ++lost;
  }
  for (const auto& [id, n] : acked) {
    if (pushed.count(id) == 0 && in_flight.count(id) == 0) ++unknown;
    if (n > 1 && pushed.count(id) == 0) ++twice;
  }
  INFO(pushed.size() << " pushed, " << acked.size() << " acked, " << recovered << " recovered at the end");
  CHECK(pushed.size() > 200);
  CHECK(lost == 0);
  CHECK(twice == 0);
  CHECK(unknown == 0);
  std::filesystem::remove(wal);
}
