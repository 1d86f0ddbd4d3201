#include "roles.h"

#include <pthread.h>
#include <signal.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <system_error>

namespace async_grpo {

namespace fs = std::filesystem;
using laminar::Result;
using laminar::Status;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int fail(std::string_view who, std::string_view what, const Status& st) {
  std::fprintf(stderr, "async_grpo %.*s: %.*s: %s\n", int(who.size()), who.data(), int(what.size()), what.data(),
               st.to_string().c_str());
  return 1;
}

std::uint64_t weight_hash(std::span<const std::byte> bytes) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::byte b : bytes) h = (h ^ std::uint64_t(b)) * 1099511628211ull;
  return h;
}

Status write_address(const fs::path& dir, const std::string& name, const std::string& address) {
  const fs::path tmp = dir / (name + ".tmp"), final_path = dir / (name + ".addr");
  {
    std::ofstream f(tmp);
    f << address;
    if (!f) return laminar::unavailable("cannot write " + tmp.string());
  }
  std::error_code ec;
  fs::rename(tmp, final_path, ec);
  return ec ? laminar::unavailable("cannot rename " + tmp.string()) : laminar::ok_status();
}

bool path_exists(const fs::path& p) {
  std::error_code ec;  // the non-throwing form: an unreadable path counts as absent
  return fs::exists(p, ec);
}

namespace {
sigset_t stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}
}  // namespace

void block_stop_signals() {
  const sigset_t set = stop_signals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

bool wait_for_stop(std::chrono::seconds timeout) {
  const sigset_t set = stop_signals();
  if (timeout == std::chrono::seconds::max()) {
    int signal = 0;
    return sigwait(&set, &signal) == 0;
  }
  timespec t{.tv_sec = static_cast<time_t>(timeout.count()), .tv_nsec = 0};
  for (;;) {
    if (sigtimedwait(&set, nullptr, &t) >= 0) return true;
    if (errno != EINTR) return false;  // EAGAIN: the timeout passed
  }
}

std::uint64_t final_version(const fs::path& dir) {
  std::ifstream f(dir / "final.addr");
  std::uint64_t v = 0;
  return f >> v ? v : 0;
}

Result<async_grpo::DigitTask> make_task(const Settings& s) { return async_grpo::DigitTask::create({}, s.seed); }

Result<std::shared_ptr<laminar::Transport>> make_transport(const std::string& token) {
  laminar::TransportOptions to;
  to.cluster_token = token;
  to.max_inbox_bytes = 0;  // only handlers and request replies: nothing waits for receive()
  auto t = laminar::Transport::create(to);
  if (!t.ok()) return t.status();
  return std::shared_ptr<laminar::Transport>(std::move(*t));
}

}  // namespace async_grpo
