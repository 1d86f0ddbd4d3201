#include "laminar/migration_host.h"

#include <fmt/format.h>

#include <utility>

#include "stats_fields.h"

namespace laminar {

namespace {

std::string context(std::string_view what, const MigrationEvent& e) {
  return fmt::format("migration host: {} of migration {:#x}", what, e.id.value());
}

}  // namespace

Result<std::unique_ptr<MigrationHost>> MigrationHost::create(std::shared_ptr<KvMigrator> migrator,
                                                             MigrationHandlers handlers) {
  if (!migrator) return invalid_argument("migration host: the migrator is null");
  for (const auto& [name, set] : {std::pair{"pause", bool(handlers.pause)}, std::pair{"adopt", bool(handlers.adopt)},
                                  std::pair{"resume", bool(handlers.resume)},
                                  std::pair{"forget", bool(handlers.forget)}}) {
    if (!set) return invalid_argument(fmt::format("migration host: no {} handler", name));
  }
  return std::unique_ptr<MigrationHost>(new MigrationHost(std::move(migrator), std::move(handlers)));
}

Status MigrationHost::pause(const MigrationEvent& e) {
  Result<std::vector<SequenceState>> states = h_.pause(e);
  if (!states.ok()) {
    ++st_.pauses_failed;
    // The sequences come back through the kAborted event this abort brings.
    return migrator_->abort(e.id, states.status().with_context(context("pause", e)).to_string());
  }
  ++st_.paused;
  const Status finished = migrator_->finish(e.id, std::move(*states));
  if (finished.ok()) return finished;
  ++st_.finishes_failed;
  // finish() ended the migration itself (its sequences cannot move): its kAborted event is queued.
  Result<MigrationState> state = migrator_->state(e.id);
  if (!state.ok() || *state != MigrationState::kRunning) return ok_status();
  // It still waits for states: those the pause handler gave were refused. Nothing was sent, so the
  // abort cannot fail short of a bug; the kAborted event resumes the sequences.
  const Status refused = finished.with_context(context("finish()", e));
  LAMINAR_RETURN_IF_ERROR(migrator_->abort(e.id, refused.to_string()));
  return refused;
}

Status MigrationHost::handle(MigrationEvent& e) {
  using Kind = MigrationEvent::Kind;
  switch (e.kind) {
    case Kind::kPauseRequested:
      return pause(e);
    case Kind::kArrived:
      st_.adopted += e.states.size();
      return h_.adopt(e).with_context(context("adopt", e));
    case Kind::kAborted:
      if (!e.outgoing) {
        ++st_.gave_up;
        if (h_.gave_up) h_.gave_up(e);
        return ok_status();
      }
      st_.resumed += e.sequences.size();
      return h_.resume(e).with_context(context("resume", e));
    case Kind::kDone:
      st_.forgotten += e.sequences.size();
      return h_.forget(e).with_context(context("forget", e));
  }
  return internal_error(fmt::format("migration host: event of unknown kind {}", int(e.kind)));
}

Status MigrationHost::handle(std::vector<MigrationEvent>& events) {
  for (MigrationEvent& e : events) LAMINAR_RETURN_IF_ERROR(handle(e));
  return ok_status();
}

std::string MigrationHostStats::to_json() const { return internal::stats_json(*this); }

}  // namespace laminar
