// roles.h: the roles of the async_grpo binary, one function each, and what they share. main()
// (async_grpo.cc) picks a role by --role; the launcher (launcher.cc) re-executes the binary as the
// actor (actor.cc), the relays and the rollout workers (rollout.cc). The processes of a schedule
// meet in its directory: each writes its address there (write_address), the actor marks the end
// of training (final_version) and the launcher tells those that stay to leave with SIGTERM
// (wait_for_stop).
//
//   async_grpo::add_options(app, s, a);   // settings.h
//   CLI11_PARSE(app, argc, argv);
//   if (a.role == "actor") return async_grpo::run_actor(s, a);
//   if (a.role == "rollout") return async_grpo::run_rollout(s, a);
//   return async_grpo::run_launcher(s);
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
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
int run_relay(const RoleArgs& a);
int run_rollout(const Settings& s, const RoleArgs& a);
int run_launcher(Settings s);

std::int64_t now_ns();

// Prints which role failed at what to stderr; returns the exit code 1.
int fail(std::string_view who, std::string_view what, const laminar::Status& st);

// FNV-1a over the weight bytes: both sides hash the same flat manifest layout.
std::uint64_t weight_hash(std::span<const std::byte> bytes);

// Appends one line and flushes it, so a killed process leaves whole lines behind.
class LineFile {
 public:
  explicit LineFile(const std::filesystem::path& path) : out_(path, std::ios::trunc) {}
  void write(const std::string& line) { out_ << line << '\n' << std::flush; }

 private:
  std::ofstream out_;
};

// Writes <dir>/<name>.addr whole (through a rename), so a reader never sees half an address.
laminar::Status write_address(const std::filesystem::path& dir, const std::string& name, const std::string& address);

bool path_exists(const std::filesystem::path& p);

// Blocks SIGTERM and SIGINT in the calling thread and every thread it starts later, so that
// wait_for_stop takes them. main() calls it before any role starts a thread.
void block_stop_signals();
// Sleeps until SIGTERM or SIGINT arrives (true) or `timeout` passes (false; never by default).
bool wait_for_stop(std::chrono::seconds timeout = std::chrono::seconds::max());

// The actor's last published version, once training is over (0 before).
std::uint64_t final_version(const std::filesystem::path& dir);

laminar::Result<async_grpo::DigitTask> make_task(const Settings& s);

laminar::Result<std::shared_ptr<laminar::Transport>> make_transport(const std::string& token);

}  // namespace async_grpo
