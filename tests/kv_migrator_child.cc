// A rollout worker for kv_migrator_test's kill tests, which SIGKILL it at some stage of a
// migration. The cluster token comes from LAMINAR_TEST_TOKEN.
//
//   kv_migrator_child dest
//     listens, prints "listening ADDRESS", then polls its migrator for ever, printing
//     "arrived ID" / "aborted ID" for incoming migrations.
//   kv_migrator_child source ADDRESS TOKENS
//     moves one sequence of TOKENS tokens (id 1) to ADDRESS, one page a stage, decoding a token
//     between polls until asked to pause; prints "done" or "aborted CODE", then polls for ever.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "laminar/kv_migrator.h"

namespace {

using laminar::MigrationEvent;

int fail(const laminar::Status& s) {
  std::fprintf(stderr, "kv_migrator_child: %s\n", s.to_string().c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const bool dest = argc == 2 && std::strcmp(argv[1], "dest") == 0;
  const bool source = argc == 4 && std::strcmp(argv[1], "source") == 0;
  if (!dest && !source) {
    std::fprintf(stderr, "usage: %s dest | source ADDRESS TOKENS\n", argv[0]);
    return 2;
  }
  laminar::TransportOptions to;
  const char* token = std::getenv("LAMINAR_TEST_TOKEN");
  to.cluster_token = token != nullptr ? token : "";
  auto transport = laminar::Transport::create(to);
  if (!transport.ok()) return fail(transport.status());
  std::shared_ptr<laminar::Transport> t = std::move(*transport);
  auto cache = laminar::PagedKvCache::create({64, 4, 2, 8, laminar::DType::kF32, 3});
  if (!cache.ok()) return fail(cache.status());
  auto kv = std::make_shared<laminar::PagedKvCache>(std::move(*cache));
  laminar::KvMigratorOptions o;
  o.stage_bytes = 1;
  o.growth_pages = 16;
  auto migrator = laminar::KvMigrator::create(t, kv, o);
  if (!migrator.ok()) return fail(migrator.status());
  laminar::KvMigrator& m = **migrator;

  bool paused = !source;
  if (dest) {
    auto addr = t->listen("127.0.0.1", 0);
    if (!addr.ok()) return fail(addr.status());
    std::printf("listening %s\n", addr->c_str());
  } else {
    const laminar::SequenceId seq(1);
    if (!kv->add_sequence(seq).ok() || !kv->append_tokens(seq, std::atoll(argv[3])).ok()) return 2;
    const std::vector<laminar::SequenceId> seqs = {seq};
    auto id = m.migrate(argv[2], seqs);
    if (!id.ok()) return fail(id.status());
  }
  std::fflush(stdout);
  for (;;) {
    for (const MigrationEvent& e : m.poll()) {
      switch (e.kind) {
        case MigrationEvent::Kind::kPauseRequested: {
          paused = true;
          laminar::SequenceState s;
          s.sequence = e.sequences[0];
          s.kv_length = std::uint64_t(kv->length(s.sequence).value());
          s.prompt_tokens.assign(std::size_t(s.kv_length), 1);
          if (!m.finish(e.id, {s}).ok()) return 2;
          break;
        }
        case MigrationEvent::Kind::kDone: std::printf("done\n"); break;
        case MigrationEvent::Kind::kArrived: std::printf("arrived %llu\n", (unsigned long long)e.id.value()); break;
        case MigrationEvent::Kind::kAborted:
          if (e.outgoing) {
            std::printf("aborted %s\n", std::string(laminar::status_code_name(e.reason.code())).c_str());
          } else {
            std::printf("aborted %llu\n", (unsigned long long)e.id.value());
          }
          break;
      }
      std::fflush(stdout);
    }
    // The decode step: a token of the moving sequence until it is paused.
    if (!paused && kv->length(laminar::SequenceId(1)).ok()) (void)kv->append_tokens(laminar::SequenceId(1), 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}
