// KvMigrator across two real processes (the child is tests/kv_migrator_peer, the workload they share
// is in kv_migrator_workload.h, its tiny model in support/test_model.h): sequences moved mid-decode
// continue in the other process, beside its own, with exactly the tokens and log-probs they would have had
// unmoved; a destination killed (SIGKILL) at the offer, during the live stages or after the final
// stage leaves them running at the source, still bit-exact; a source killed at the same points
// leaves no page reserved at the destination, and a destination that took the sequences has them
// whole.
#include <catch2/catch.hpp>

#include <signal.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "expect_line.h"
#include "kv_migrator_workload.h"
#include "process.h"

using namespace std::chrono_literals;
using kv_migrator_workload::Worker;
using laminar::MigrationEvent;
using laminar::MigrationState;
using laminar::SequenceId;
using laminar::testing::ChildProcess;
using laminar::testing::expect_line;

namespace {

const std::string kToken = "kv-migrator-multiprocess-token-0123456789";

// Bounds on how long a broken run may hold the test; the events themselves are what is waited for.
constexpr auto kLineTimeout = 60s;
constexpr auto kMigrationTimeout = 120s;

ChildProcess start_peer(std::vector<std::string> args) {
  laminar::testing::ChildOptions o;
  o.program = LAMINAR_KV_MIGRATOR_PEER;
  o.args = std::move(args);
  o.env = {{kv_migrator_workload::kTokenVariable, kToken}};
  auto child = ChildProcess::spawn(std::move(o));
  REQUIRE(child.ok());
  return std::move(*child);
}

std::unique_ptr<Worker> make_worker(bool listen) {
  auto w = Worker::create(kToken, listen);
  INFO(w.status().to_string());
  REQUIRE(w.ok());
  return std::move(*w);
}

void require_ok(const laminar::Status& s) {
  INFO(s.to_string());
  REQUIRE(s.ok());
}

// The longest a loop that found nothing to do waits for the migrator before it checks its own
// deadline.
constexpr laminar::Duration kIdleWait = 100ms;

// Decodes every sequence of `w` to its end and checks each against the unmoved reference, bit for bit.
void finish_and_compare(Worker& w) {
  const auto deadline = std::chrono::steady_clock::now() + kMigrationTimeout;
  for (;;) {
    laminar::Result<bool> stepped = w.step();
    require_ok(stepped.status());
    if (!*stepped) break;
    REQUIRE(std::chrono::steady_clock::now() < deadline);
  }
  const auto reference = kv_migrator_workload::reference(kv_migrator_workload::sequences());
  REQUIRE(w.live().size() == reference.size());
  for (const auto& [id, s] : reference) {
    INFO("sequence " << id.value());
    CHECK(kv_migrator_workload::format_result(w.live().at(id)) == kv_migrator_workload::format_result(s));
  }
}

std::vector<SequenceId> all_ids(Worker& w) {
  std::vector<SequenceId> ids;
  for (const auto& [id, s] : w.live()) ids.push_back(id);
  return ids;
}

}  // namespace

TEST_CASE("kv migrator multiprocess: sequences moved mid-decode continue bit for bit in another process",
          "[kv_migrator]") {
  ChildProcess peer = start_peer({"destination"});
  const std::string address = expect_line(peer, "listening ", kLineTimeout);
  const int peer_free = std::stoi(expect_line(peer, "free ", kLineTimeout));
  CHECK(peer_free == kv_migrator_workload::kNumPages -
                         kv_migrator_workload::prefilled_pages(kv_migrator_workload::home_sequences()));

  std::unique_ptr<Worker> w = make_worker(false);
  require_ok(w->start_workload());
  const laminar::Result<laminar::MigrationId> id = w->migrator().migrate(address, all_ids(*w));
  INFO(id.status().to_string());
  REQUIRE(id.ok());

  // The source decodes between polls until it is asked to pause: the live, staged copy, whose
  // stages go out over several polls with decode steps between them.
  int steps_while_live = 0, steps_between_stages = 0, polls_that_sent = 0;
  std::uint64_t pages_sent_live = 0;
  bool paused = false, done = false;
  const auto deadline = std::chrono::steady_clock::now() + kMigrationTimeout;
  while (!done) {
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    std::vector<MigrationEvent> events = w->migrator().poll();
    if (!paused && w->migrator().stats().pages_sent > pages_sent_live) {
      pages_sent_live = w->migrator().stats().pages_sent;
      ++polls_that_sent;
    }
    for (MigrationEvent& e : events) {
      INFO("event " << int(e.kind) << ": " << e.reason.to_string());
      REQUIRE(e.id == *id);
      REQUIRE(e.kind != MigrationEvent::Kind::kAborted);
      if (e.kind == MigrationEvent::Kind::kPauseRequested) {
        paused = true;
        require_ok(w->migrator().finish(e.id, w->pause(e.sequences)));
      } else if (e.kind == MigrationEvent::Kind::kDone) {
        CHECK(e.sequences.size() == 4);
        w->forget(e.sequences);
        done = true;
      }
    }
    // Decoding waits for the first stage: on a loaded machine the destination's answer can take
    // longer than the whole response, and the steps between stages are what this test is about.
    laminar::Result<bool> stepped = pages_sent_live > 0 || paused ? w->step() : laminar::Result<bool>(false);
    require_ok(stepped.status());
    if (*stepped && !paused) {
      ++steps_while_live;
      if (pages_sent_live > 0) ++steps_between_stages;
    }
    if (events.empty() && !*stepped) w->idle(kIdleWait);
  }
  CHECK(w->migrator().state(*id).value() == MigrationState::kDone);
  std::printf("kv migrator multiprocess: %d decode steps while live, %d of them after the first stage; %llu pages "
              "sent live in %d polls, %llu in all\n",
              steps_while_live, steps_between_stages, static_cast<unsigned long long>(pages_sent_live),
              polls_that_sent, static_cast<unsigned long long>(w->migrator().stats().pages_sent));
  CHECK(polls_that_sent >= 2);
  CHECK(steps_between_stages > 0);
  // Every page went back to the source's free list.
  CHECK(w->cache().num_sequences() == 0);
  CHECK(w->cache().free_pages() == kv_migrator_workload::kNumPages);
  CHECK(w->cache().reserved_pages() == 0);

  expect_line(peer, "arrived ", kLineTimeout);
  // The destination's own sequences grew while pages were reserved there (and decoded beside the
  // arrived ones if they had not finished by then): neither may change the other's bits.
  CHECK(std::stoi(expect_line(peer, "home-steps ", kLineTimeout)) > 0);
  auto reference = kv_migrator_workload::reference(kv_migrator_workload::sequences());
  reference.merge(kv_migrator_workload::reference(kv_migrator_workload::home_sequences()));
  REQUIRE(reference.size() == 6);
  std::map<std::string, std::string> results;  // by sequence id
  for (std::size_t i = 0; i < reference.size(); ++i) {
    const std::string line = expect_line(peer, "result ", kLineTimeout);
    results[line.substr(0, line.find(' '))] = line;
  }
  for (const auto& [seq, s] : reference) {
    INFO("sequence " << seq.value());
    CHECK(results[std::to_string(seq.value())] == kv_migrator_workload::format_result(s));
  }
  expect_line(peer, "finished", kLineTimeout);
  peer.kill(SIGTERM);
  CHECK(peer.wait(kLineTimeout).value() == 0);
}

TEST_CASE("kv migrator multiprocess: a destination killed in any stage leaves the sequences running at the source",
          "[kv_migrator]") {
  const std::string stage = GENERATE("offer", "live", "final");
  INFO("destination killed at the " << stage << " stage");
  ChildProcess peer = start_peer({"destination"});
  const std::string address = expect_line(peer, "listening ", kLineTimeout);

  std::unique_ptr<Worker> w = make_worker(false);
  require_ok(w->start_workload());
  const laminar::Result<laminar::MigrationId> id = w->migrator().migrate(address, all_ids(*w));
  INFO(id.status().to_string());
  REQUIRE(id.ok());
  bool killed = false;
  if (stage == "offer") {
    peer.kill(SIGKILL);
    killed = true;
  }

  bool aborted = false;
  const auto deadline = std::chrono::steady_clock::now() + kMigrationTimeout;
  while (!aborted) {
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    std::vector<MigrationEvent> events = w->migrator().poll();
    if (stage == "live" && !killed && w->migrator().stats().pages_sent > 0) {
      peer.kill(SIGKILL);
      killed = true;
    }
    for (MigrationEvent& e : events) {
      INFO("event " << int(e.kind) << ": " << e.reason.to_string());
      REQUIRE(e.kind != MigrationEvent::Kind::kDone);
      if (e.kind == MigrationEvent::Kind::kPauseRequested) {
        // Stopped first, so the final stage is surely sent before the destination could take it.
        if (stage == "final") peer.kill(SIGSTOP);
        require_ok(w->migrator().finish(e.id, w->pause(e.sequences)));
        if (stage == "final") {
          peer.kill(SIGKILL);
          killed = true;
        }
      } else if (e.kind == MigrationEvent::Kind::kAborted) {
        std::printf("kv migrator multiprocess: destination killed at the %s stage: %s\n", stage.c_str(),
                    e.reason.to_string().c_str());
        CHECK(e.outgoing);
        CHECK(e.state == MigrationState::kAbortedByDestination);
        CHECK(e.sequences.size() == 4);
        w->resume(e.sequences);
        aborted = true;
      }
    }
    laminar::Result<bool> stepped = w->step();
    require_ok(stepped.status());
    if (events.empty() && !*stepped) w->idle(kIdleWait);
  }
  REQUIRE(killed);
  CHECK(peer.wait(kLineTimeout).value() == 128 + SIGKILL);
  CHECK(w->migrator().state(*id).value() == MigrationState::kAbortedByDestination);
  CHECK(w->migrator().moving().empty());
  CHECK(w->cache().num_sequences() == 4);
  CHECK(w->cache().reserved_pages() == 0);
  CHECK(w->cache().free_pages() == kv_migrator_workload::kNumPages - w->pages_in_use());
  finish_and_compare(*w);
  CHECK(w->cache().free_pages() == kv_migrator_workload::kNumPages - w->pages_in_use());
}

TEST_CASE("kv migrator multiprocess: a source killed in any stage leaves no page reserved at the destination",
          "[kv_migrator]") {
  const std::string stage = GENERATE("offer", "live", "final");
  INFO("source killed at the " << stage << " stage");
  std::unique_ptr<Worker> w = make_worker(true);
  const std::int32_t free_before = w->cache().free_pages();
  ChildProcess peer = start_peer({"source", w->migrator().address().value()});

  // The destination's own view places the first two kills: after the poll that reserved the pages
  // (offer) or checked the first pages (live), it polls no more until the source is dead, so the
  // source cannot get further. The final stage shows only in the source's lines: the destination
  // stops polling once it read "paused" and kills at "final-sent". The lines lag a little behind
  // the source, so the destination may have taken the final stage by then: a race this case allows.
  bool paused = false, final_sent = false, killed = false;
  std::optional<MigrationEvent> outcome;
  const auto kill_source = [&] {
    peer.kill(SIGKILL);
    killed = true;
    const laminar::Result<int> code = peer.wait(kLineTimeout);
    REQUIRE(code.ok());
    // A source that got its kDone (the race above) has exited on its own.
    CHECK((*code == 128 + SIGKILL || (outcome && *code == 0)));
  };
  const auto deadline = std::chrono::steady_clock::now() + kMigrationTimeout;
  while (!killed || !outcome) {
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    // Every line the source printed so far, waiting a little for one when there is none.
    for (auto wait = 2ms; !killed; wait = 0ms) {
      laminar::Result<std::string> line = peer.read_line(wait);
      if (!line.ok()) {
        INFO(line.status().to_string());
        REQUIRE(line.status().code() == laminar::StatusCode::kDeadlineExceeded);
        break;
      }
      INFO("source: " << *line);
      REQUIRE(line->rfind("aborted", 0) != 0);
      REQUIRE((line->rfind("done", 0) != 0 || outcome));
      paused = paused || *line == "paused";
      final_sent = final_sent || *line == "final-sent";
    }
    if (!killed && stage == "final" && final_sent) kill_source();
    if (killed || !paused) {
      std::vector<MigrationEvent> events = w->migrator().poll();
      // Once the source is dead nothing else paces this loop.
      if (killed && events.empty()) w->idle(kIdleWait);
      for (MigrationEvent& e : events) {
        INFO("event " << int(e.kind) << ": " << e.reason.to_string());
        REQUIRE(!outcome);
        REQUIRE((e.kind == MigrationEvent::Kind::kArrived || e.kind == MigrationEvent::Kind::kAborted));
        outcome = std::move(e);
      }
      if (!killed && stage == "offer" && w->cache().reserved_pages() > 0) kill_source();
      if (!killed && stage == "live" && w->migrator().stats().pages_received > 0) kill_source();
    }
    if (outcome && !killed) {
      INFO("event " << int(outcome->kind) << ": " << outcome->reason.to_string());
      REQUIRE(stage == "final");
      REQUIRE(outcome->kind == MigrationEvent::Kind::kArrived);
    }
  }
  const MigrationEvent& e = *outcome;
  INFO("outcome " << int(e.kind) << ": " << e.reason.to_string());
  std::printf("kv migrator multiprocess: source killed at the %s stage: %s %s\n", stage.c_str(),
              e.kind == MigrationEvent::Kind::kArrived ? "arrived" : "aborted", e.reason.to_string().c_str());
  CHECK_FALSE(e.outgoing);
  CHECK(w->cache().reserved_pages() == 0);
  CHECK(w->migrator().moving().empty());
  if (e.kind == MigrationEvent::Kind::kAborted) {
    // The source vanished, or the destination's lease ran out: either way it was not done.
    CHECK((e.state == MigrationState::kAbortedBySource || e.state == MigrationState::kAbortedByDestination));
    CHECK(w->cache().num_sequences() == 0);
    CHECK(w->cache().free_pages() == free_before);
    return;
  }
  // Taken: only a final stage whose pages all checked out is, and the sequences are whole here.
  REQUIRE(final_sent);
  REQUIRE(e.states.size() == 4);
  for (const laminar::SequenceState& s : e.states) {
    INFO("sequence " << s.sequence.value());
    CHECK(w->cache().length(s.sequence).value() == std::int64_t(s.kv_length));
    CHECK(s.kv_length + 1 == s.prompt_tokens.size() + s.response_tokens.size());
  }
  w->adopt(e.states);
  CHECK(w->cache().free_pages() == kv_migrator_workload::kNumPages - w->pages_in_use());
  finish_and_compare(*w);
}
