// roles.h: the roles of the async_grpo binary, one function each, and what they share. main()
// (async_grpo.cc) picks a role by --role; the launcher (launcher.cc) re-executes the binary as the
// actor (actor.cc), the relays and the rollout workers (rollout.cc). The processes of a schedule
// meet in its directory: each writes its address there (write_address), the actor marks the end
// of training (final_version), and each marks its leaving (mark_left), which the actor and the
// relays wait for (wait_for_files), as they do for the launcher's SIGTERM.
//
//   async_grpo::add_options(app, s, a);   // settings.h
//   CLI11_PARSE(app, argc, argv);
//   if (a.role == "actor") return async_grpo::run_actor(s, a);
//   if (a.role == "rollout") return async_grpo::run_rollout(s, a);
//   return async_grpo::run_launcher(s);
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "laminar/status.h"
#include "laminar/transport.h"
#include "settings.h"
#include "task.h"

namespace async_grpo {

// Each returns the process's exit code.
int run_actor(const Settings& s, const RoleArgs& a);
int run_relay(const Settings& s, const RoleArgs& a);
int run_rollout(const Settings& s, const RoleArgs& a);
int run_launcher(Settings s);

std::int64_t now_ns();

// Prints which role failed at what to stderr; returns the exit code 1.
int fail(std::string_view who, std::string_view what, const laminar::Status& st);

// FNV-1a over the weight bytes: both sides hash the same flat manifest layout.
std::uint64_t weight_hash(std::span<const std::byte> bytes);
// The "version hash" lines of the actor's published.txt or a worker's weights-rollout-<i>.txt, by
// version (empty when the file is missing).
std::map<std::uint64_t, std::string> read_hashes(const std::filesystem::path& file);

// Appends one line and flushes it, so a killed process leaves whole lines behind.
class LineFile {
 public:
  explicit LineFile(const std::filesystem::path& path, bool append = false)
      : out_(path, append ? std::ios::app : std::ios::trunc) {}
  void write(const std::string& line) { out_ << line << '\n' << std::flush; }

 private:
  std::ofstream out_;
};

// Writes <dir>/<name>.addr whole (through a rename), so a reader never sees half an address.
laminar::Status write_address(const std::filesystem::path& dir, const std::string& name, const std::string& address);
// Writes <dir>/<name>.left: the process has left the run (the actor waits for its rollout
// workers', the relays for the actor's).
laminar::Status mark_left(const std::filesystem::path& dir, const std::string& name);

// Fills in what a process started on its own leaves out, and checks it. Under --role auto the
// role and index come from the rank: rank 0 is the actor, ranks 1 to relays the relays, the rest
// the rollout workers; rank and world default to $SLURM_PROCID and $SLURM_NTASKS, else $RANK and
// $WORLD_SIZE, and world must be 1 + relays + workers. The cluster token comes from --token-file,
// else $LAMINAR_TOKEN; the schedule from --schedule when --run-schedule is not given.
// kInvalidArgument naming what is missing or does not fit. `env` reads the environment.
laminar::Status assign_role(const Settings& s, RoleArgs& a,
                            const std::function<const char*(const char*)>& env = std::getenv);

// The address to listen on: `host` itself, or for "auto" the first non-loopback IPv4 address of an
// interface that runs (up, with carrier). kNotFound when there is none.
laminar::Result<std::string> listen_host(const std::string& host);

// How long a process started on its own waits for the others' addresses: under a scheduler the
// processes of one job may start minutes apart.
inline constexpr std::chrono::minutes kRendezvousTimeout{10};
// A wait bounded only by what ends it (a file or a signal), as a deadline the clock can add.
inline constexpr std::chrono::hours kForeverish{24 * 365};

// What wait_for_files returned on.
enum class Woke : std::uint8_t { kFiles, kStopSignal, kTimeout };
// Sleeps until every file of `names` exists in `dir`, a stop signal arrives (with `on_signal`: the
// caller has blocked them, block_stop_signals) or `timeout` passes. inotify wakes it on a local
// filesystem. Writes from other hosts to a network filesystem reach no inotify watch, so there it
// also looks again after 0.1 s, then at doubling intervals up to every 2 s.
Woke wait_for_files(const std::filesystem::path& dir, std::span<const std::string> names,
                    std::chrono::milliseconds timeout, bool on_signal = false);

// The addresses a relay or a rollout worker needs: --actor and --relay as given, else
// <dir>/actor.addr and (a rollout worker) <dir>/relay-<i>.addr for each of the run's relays, waited
// for up to `timeout`. kDeadlineExceeded naming the files still missing; kCancelled on a stop signal.
laminar::Status find_peers(const Settings& s, RoleArgs& a, std::chrono::milliseconds timeout);

bool path_exists(const std::filesystem::path& p);

// Blocks SIGTERM and SIGINT in the calling thread and every thread it starts later, so that
// wait_for_files(..., on_signal) takes them. main() calls it before any role starts a thread.
void block_stop_signals();

// The actor's last published version, once training is over (0 before).
std::uint64_t final_version(const std::filesystem::path& dir);

laminar::Result<async_grpo::DigitTask> make_task(const Settings& s);

laminar::Result<std::shared_ptr<laminar::Transport>> make_transport(const std::string& token);

// The launcher's warm-up, which the actor runs itself when started without --warm: warmup_steps
// supervised steps of warmup_batch prompts from the seeded initial weights, written to `file` in the
// manifest's flat layout.
laminar::Status warm_up(const Settings& s, const std::filesystem::path& file);

}  // namespace async_grpo
