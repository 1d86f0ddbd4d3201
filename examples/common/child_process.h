// child_process.h: the launchers' child processes (examples/repack, examples/async_grpo): this
// binary re-executed with a role's arguments, its stdout read line by line, killed (SIGKILL, by
// pid) and reaped when its handle goes, and killed by the kernel if the launcher dies first, so a
// run never leaves a busy-polling UCX process behind.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "laminar/status.h"

namespace examples {

class ChildProcess {
 public:
  // Runs /proc/self/exe with `args`, its stdout a pipe to this process. kUnavailable when the
  // pipe or the fork fails.
  static laminar::Result<std::unique_ptr<ChildProcess>> spawn(std::string name, std::vector<std::string> args) {
    args.insert(args.begin(), "/proc/self/exe");
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int out[2];
    if (pipe2(out, O_CLOEXEC) != 0) return laminar::unavailable(fmt::format("pipe: {}", std::strerror(errno)));
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid == 0) {
      // Only async-signal-safe calls from here: the parent has threads (its transport's).
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
      if (dup2(out[1], STDOUT_FILENO) < 0) _exit(127);
      // The parent's descriptors (its UCX sockets, its listening port) stay with the parent.
      if (close_range(STDERR_FILENO + 1, ~0U, CLOSE_RANGE_CLOEXEC) != 0) _exit(127);
      execv(argv[0], argv.data());
      _exit(127);
    }
    const int fork_errno = errno;
    close(out[1]);
    if (pid < 0) {
      close(out[0]);
      return laminar::unavailable(fmt::format("fork: {}", std::strerror(fork_errno)));
    }
    return std::unique_ptr<ChildProcess>(new ChildProcess(std::move(name), pid, out[0]));
  }
  ~ChildProcess() {
    if (!reaped_) {
      kill(pid_, SIGKILL);
      (void)wait();
    }
    if (fd_ >= 0) close(fd_);
  }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  const std::string& name() const noexcept { return name_; }
  pid_t pid() const noexcept { return pid_; }
  int fd() const noexcept { return fd_; }
  // Appends the whole lines that can be read now to `lines`. At the end of its stdout the pipe
  // closes, and fd() is -1.
  void read_lines(std::vector<std::string>& lines) {
    char chunk[65536];
    const ssize_t n = read(fd_, chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) return;
    if (n <= 0) {
      close(fd_);
      fd_ = -1;
      return;
    }
    buffered_.append(chunk, std::size_t(n));
    for (std::size_t nl; (nl = buffered_.find('\n')) != std::string::npos;) {
      lines.push_back(buffered_.substr(0, nl));
      buffered_.erase(0, nl + 1);
    }
  }
  // Whether it has ended (reaping it if so), without waiting.
  bool exited() {
    if (reaped_) return true;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) record(status);
    return reaped_;
  }
  void kill_now() {
    if (!reaped_) kill(pid_, SIGKILL);
  }
  // Asks it to leave (SIGTERM).
  void terminate() {
    if (!reaped_) kill(pid_, SIGTERM);
  }
  // Its exit code, or 128 + the signal that ended it.
  int wait() {
    if (!reaped_) {
      int status = 0;
      while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
      record(status);
    }
    return exit_code_;
  }

 private:
  ChildProcess(std::string name, pid_t pid, int fd) : name_(std::move(name)), pid_(pid), fd_(fd) {}
  void record(int status) {
    reaped_ = true;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

  std::string name_;
  pid_t pid_;
  int fd_;
  std::string buffered_;
  bool reaped_ = false;
  int exit_code_ = -1;
};

}  // namespace examples
