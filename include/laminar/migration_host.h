// migration_host.h: MigrationHost, the one place that turns a KvMigrator's MigrationEvents (from
// poll(), wait_event() or RepackDriver::step()) into calls on the host's engine.
//
// KvMigrator's header says what a host does with each event; this class does it, so that no host
// reads finish()'s status codes. The host hands over four handlers that speak to its engine:
//   pause   (kPauseRequested) stop decoding these sequences and return their states;
//   adopt   (kArrived)        these states arrived with their KV in the cache: decode them;
//   resume  (kAborted, outgoing) these sequences stayed here: decode them again;
//   forget  (kDone)           these sequences live at the destination, the cache released them.
// On kPauseRequested it calls pause and hands the states to finish(). When the migration cannot go
// on (a sequence left the cache or outgrew its reserved pages, or pause failed), the migration is
// aborted and a kAborted event follows, whose resume() decodes the sequences again: whatever went
// wrong, each paused sequence is either forgotten (kDone) or resumed (kAborted), exactly once.
// finish() refusing the states while the migration still waits (a state that does not match the
// cache: a bug of the host's pause) aborts it the same way, and handle() returns that error.
//
// Threads: none of its own. handle() runs on the decode loop, like poll(); so do the handlers.
//
//   laminar::MigrationHandlers h;
//   h.pause = [&](const laminar::MigrationEvent& e) { return engine.pause(e.sequences); };
//   h.adopt = [&](laminar::MigrationEvent& e) { return engine.adopt(std::move(e.states)); };
//   h.resume = [&](const laminar::MigrationEvent& e) { return engine.resume(e.sequences); };
//   h.forget = [&](const laminar::MigrationEvent& e) { return engine.forget(e.sequences); };
//   auto host = laminar::MigrationHost::create(migrator, std::move(h)).value();
//   for (laminar::MigrationEvent& e : migrator->wait_event(timeout)) (void)host->handle(e);
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "laminar/kv_migrator.h"
#include "laminar/status.h"

namespace laminar {

struct MigrationHandlers {
  // kPauseRequested: stop decoding e.sequences and return their states, one each, in any order. An
  // error aborts the migration (its kAborted event resumes them).
  std::function<Result<std::vector<SequenceState>>(const MigrationEvent& e)> pause;
  // kArrived: decode e.states (in e.sequences' order; their KV is in the cache) from now on.
  std::function<Status(MigrationEvent& e)> adopt;
  // Outgoing kAborted: e.sequences are still here, in the cache; decode them again. e.reason says
  // why the migration ended.
  std::function<Status(const MigrationEvent& e)> resume;
  // kDone: e.sequences live at the destination and left this cache; drop them.
  std::function<Status(const MigrationEvent& e)> forget;
  // Incoming kAborted (may be empty): nothing arrived and the reserved pages are free again.
  std::function<void(const MigrationEvent& e)> gave_up;
};

struct MigrationHostStats {
  std::uint64_t paused = 0;           // kPauseRequested events whose states went to finish()
  std::uint64_t pauses_failed = 0;    // pause handler errors (the migration was aborted)
  std::uint64_t finishes_failed = 0;  // finish() calls that ended the migration, or were refused
  std::uint64_t adopted = 0;          // sequences adopted
  std::uint64_t resumed = 0;          // sequences resumed
  std::uint64_t forgotten = 0;        // sequences forgotten
  std::uint64_t gave_up = 0;          // incoming migrations aborted

  std::string to_json() const;
};

class MigrationHost {
 public:
  // kInvalidArgument for a null migrator or an empty pause, adopt, resume or forget.
  static Result<std::unique_ptr<MigrationHost>> create(std::shared_ptr<KvMigrator> migrator,
                                                       MigrationHandlers handlers);
  MigrationHost(const MigrationHost&) = delete;
  MigrationHost& operator=(const MigrationHost&) = delete;

  // Preconditions:
  //   `e` came from this host's migrator, and each event is handled once, in the order given;
  //   the caller is the decode loop.
  // Acts on `e` as the header says. Returns the first error of a handler (with the migration's id),
  // or finish()'s refusal of states the pause handler returned (the migration is aborted then; see
  // the header); OK otherwise, including for a migration that finish() ended.
  Status handle(MigrationEvent& e);
  // Each event in order; stops at the first error.
  Status handle(std::vector<MigrationEvent>& events);

  MigrationHostStats stats() const { return st_; }

 private:
  MigrationHost(std::shared_ptr<KvMigrator> migrator, MigrationHandlers handlers)
      : migrator_(std::move(migrator)), h_(std::move(handlers)) {}
  Status pause(const MigrationEvent& e);

  std::shared_ptr<KvMigrator> migrator_;
  MigrationHandlers h_;
  MigrationHostStats st_;
};

}  // namespace laminar
