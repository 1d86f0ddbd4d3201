// gnuplot.h: running gnuplot from the examples' reports (examples/async_grpo, examples/simulator):
// find the program, quote strings for its scripts, run one script with a time limit.
//
//   std::optional<std::filesystem::path> gp = examples::find_program("gnuplot");
//   if (!gp) return note("gnuplot not found: plots skipped");
//   std::string script = "set terminal pngcairo\nset output " + examples::gp_quote(png) + "\nplot x\n";
//   LAMINAR_RETURN_IF_ERROR(write(dir / "plots.gp", script));
//   LAMINAR_RETURN_IF_ERROR(examples::run_gnuplot(*gp, dir / "plots.gp", dir / "gnuplot.log"));
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>

#include "laminar/clock.h"
#include "laminar/status.h"

extern char** environ;

namespace examples {

// A single-quoted gnuplot string: inside one, '' stands for a quote.
inline std::string gp_quote(std::string_view s) {
  std::string out = "'";
  for (char c : s) {
    out += c;
    if (c == '\'') out += '\'';
  }
  return out + "'";
}

// `name` looked up in PATH, or taken as it is when it holds a '/'; none unless executable.
inline std::optional<std::filesystem::path> find_program(const std::string& name) {
  if (name.find('/') != std::string::npos) {
    return access(name.c_str(), X_OK) == 0 ? std::optional<std::filesystem::path>(name) : std::nullopt;
  }
  const char* path = std::getenv("PATH");
  std::string_view dirs = path ? path : "";
  while (true) {
    std::size_t colon = dirs.find(':');
    std::string_view dir = dirs.substr(0, colon);
    if (!dir.empty()) {
      std::filesystem::path candidate = std::filesystem::path(dir) / name;
      if (access(candidate.c_str(), X_OK) == 0) return candidate;
    }
    if (colon == std::string_view::npos) return std::nullopt;
    dirs.remove_prefix(colon + 1);
  }
}

// Runs `program script` with its output in `log`; kills it (only the pid started here) if it takes
// longer than a minute. kInternal with the tail of its output when it fails.
inline laminar::Status run_gnuplot(const std::filesystem::path& program, const std::filesystem::path& script,
                                   const std::filesystem::path& log) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  std::string prog = program.string(), arg = script.string();
  char* argv[] = {prog.data(), arg.data(), nullptr};
  pid_t pid = -1;
  int err = posix_spawn(&pid, prog.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  if (err != 0) return laminar::internal_error(fmt::format("cannot start {}: {}", prog, std::strerror(err)));

  std::shared_ptr<laminar::Clock> clock = laminar::Clock::steady();
  const laminar::Duration deadline = clock->now() + std::chrono::seconds(60);
  int wstatus = 0;
  while (true) {
    pid_t r = waitpid(pid, &wstatus, WNOHANG);
    if (r == pid) break;
    if (r < 0 && errno != EINTR) return laminar::internal_error(fmt::format("waiting for {} failed", prog));
    if (clock->now() >= deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &wstatus, 0);
      return laminar::deadline_exceeded(fmt::format("{} {} ran over 60 s and was killed", prog, arg));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) return laminar::ok_status();
  std::ifstream in(log);
  std::stringstream output;
  output << in.rdbuf();
  std::string text = output.str();
  if (text.size() > 2000) text = "..." + text.substr(text.size() - 2000);
  return laminar::internal_error(fmt::format("{} {} failed (wait status {}): {}", prog, arg, wstatus, text));
}

}  // namespace examples
