// kv_migrator_peer: the other process of kv_migrator_multiprocess_test, a rollout worker decoding
// the workload of kv_migrator_workload.h that is the destination or the source of one migration.
// The cluster token comes from LAMINAR_TEST_TOKEN. One line per event on stdout:
//
//   kv_migrator_peer destination      feeds its own (home) sequences their prompts, prints
//                                     "listening HOST:PORT" and "free N"; "reserved N" once an offer
//                                     took pages. Its home sequences decode while pages are reserved
//                                     and beside the arrived ones (until they finish). On arrival
//                                     "arrived ID,ID,..." and "home-steps N" (their steps while pages
//                                     were reserved), then it
//                                     decodes every sequence to its end, prints "result ID TOKENS
//                                     LOGPROB_BITS" for each and "finished", and serves on until
//                                     SIGTERM, then exits 0. An incoming migration aborted prints
//                                     "aborted REASON" and "free N", and the peer serves on.
//   kv_migrator_peer source HOST:PORT  runs the workload, then moves every sequence to HOST:PORT
//                                     while it decodes: "offered ID", "pages-sent N" whenever more
//                                     pages were put, "paused", "final-sent", then "done" or
//                                     "aborted REASON", and exits 0.
// Exits 2 after printing an unexpected error to stderr.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "kv_migrator_workload.h"

using namespace std::chrono_literals;
using kv_migrator_workload::Worker;
using laminar::MigrationEvent;

namespace {

int fail(const char* what, const laminar::Status& s) {
  std::fprintf(stderr, "kv_migrator_peer: %s: %s\n", what, s.to_string().c_str());
  return 2;
}

std::string join(const std::vector<laminar::SequenceId>& ids) {
  std::string out;
  for (laminar::SequenceId id : ids) {
    if (!out.empty()) out += ',';
    out += std::to_string(id.value());
  }
  return out;
}

volatile std::sig_atomic_t terminate_requested = 0;
void on_sigterm(int) { terminate_requested = 1; }

// Nothing arrived and nothing to decode: the loop waits this long at most for the migrator, so
// that a SIGTERM is seen.
constexpr laminar::Duration kIdleWait = 100ms;

int destination(Worker& w) {
  if (laminar::Status st = w.prefill(kv_migrator_workload::home_sequences()); !st.ok()) return fail("home", st);
  std::printf("listening %s\n", w.migrator().address().value_or("").c_str());
  std::printf("free %d\n", w.cache().free_pages());
  bool reported_reservation = false;
  bool arrived = false, reported_results = false;
  int home_steps = 0;
  for (;;) {
    std::vector<MigrationEvent> events = w.migrator().poll();
    for (MigrationEvent& e : events) {
      if (e.kind == MigrationEvent::Kind::kArrived) {
        std::printf("arrived %s\n", join(e.sequences).c_str());
        std::printf("home-steps %d\n", home_steps);
        w.adopt(std::move(e.states));
        arrived = true;
      } else if (e.kind == MigrationEvent::Kind::kAborted) {
        std::printf("aborted %s\n", e.reason.to_string().c_str());
        std::printf("free %d\n", w.cache().free_pages());
        reported_reservation = false;
      }
    }
    if (!reported_reservation && w.cache().reserved_pages() > 0) {
      std::printf("reserved %d\n", w.cache().reserved_pages());
      reported_reservation = true;
    }
    if (laminar::Status st = w.migrator().background_error(); !st.ok()) return fail("migrator", st);
    // Before any offer and after an abort the home sequences wait, so that they are still running
    // when sequences arrive.
    const bool reserved = w.cache().reserved_pages() > 0;
    laminar::Result<bool> stepped = arrived || reserved ? w.step() : laminar::Result<bool>(false);
    if (!stepped.ok()) return fail("decode", stepped.status());
    if (*stepped && reserved && !arrived) ++home_steps;
    // Results once, then on serving: exiting at once could close the connection before the
    // source has taken the final stage's answer.
    if (arrived && !reported_results && w.all_finished()) {
      for (const auto& [id, s] : w.live()) std::printf("result %s\n", kv_migrator_workload::format_result(s).c_str());
      std::printf("finished\n");
      reported_results = true;
    }
    if (terminate_requested) return 0;
    if (events.empty() && !*stepped) w.idle(kIdleWait);
  }
}

int source(Worker& w, std::string_view destination_address) {
  if (laminar::Status st = w.start_workload(); !st.ok()) return fail("workload", st);
  std::vector<laminar::SequenceId> ids;
  for (const auto& [id, s] : w.live()) ids.push_back(id);
  laminar::Result<laminar::MigrationId> migration = w.migrator().migrate(destination_address, ids);
  if (!migration.ok()) return fail("migrate", migration.status());
  std::printf("offered %llu\n", static_cast<unsigned long long>(migration->value()));
  std::uint64_t pages_reported = 0;
  for (;;) {
    std::vector<MigrationEvent> events = w.migrator().poll();
    for (MigrationEvent& e : events) {
      if (e.kind == MigrationEvent::Kind::kPauseRequested) {
        std::printf("paused\n");
        if (laminar::Status st = w.migrator().finish(e.id, w.pause(e.sequences)); !st.ok()) return fail("finish", st);
        std::printf("final-sent\n");
      } else if (e.kind == MigrationEvent::Kind::kDone) {
        w.forget(e.sequences);
        std::printf("done\n");
        return 0;
      } else if (e.kind == MigrationEvent::Kind::kAborted) {
        std::printf("aborted %s\n", e.reason.to_string().c_str());
        return 0;
      }
    }
    if (const std::uint64_t sent = w.migrator().stats().pages_sent; sent > pages_reported) {
      std::printf("pages-sent %llu\n", static_cast<unsigned long long>(sent));
      pages_reported = sent;
    }
    laminar::Result<bool> stepped = w.step();
    if (!stepped.ok()) return fail("decode", stepped.status());
    if (events.empty() && !*stepped) w.idle(kIdleWait);
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Line-buffered: the test reads each line as the event happens.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::signal(SIGTERM, on_sigterm);
  const std::vector<std::string> args(argv + 1, argv + argc);
  const char* token = std::getenv(kv_migrator_workload::kTokenVariable);
  const bool is_destination = args.size() == 1 && args[0] == "destination";
  const bool is_source = args.size() == 2 && args[0] == "source";
  if (token == nullptr || !(is_destination || is_source)) {
    std::fprintf(stderr, "usage: %s=TOKEN kv_migrator_peer destination | source HOST:PORT\n",
                 kv_migrator_workload::kTokenVariable);
    return 2;
  }
  laminar::Result<std::unique_ptr<Worker>> w = Worker::create(token, is_destination);
  if (!w.ok()) return fail("worker", w.status());
  return is_destination ? destination(**w) : source(**w, args[1]);
}
