#include "roles.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/signalfd.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <system_error>
#include <vector>

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

std::map<std::uint64_t, std::string> read_hashes(const fs::path& file) {
  std::map<std::uint64_t, std::string> out;
  std::ifstream f(file);
  std::uint64_t v;
  std::string h;
  while (f >> v >> h) out[v] = h;
  return out;
}

namespace {

// Writes <dir>/<file> whole, through a rename: a reader never sees half of it.
Status write_whole(const fs::path& dir, const std::string& file, const std::string& content) {
  const fs::path tmp = dir / (file + ".tmp"), final_path = dir / file;
  {
    std::ofstream f(tmp);
    f << content;
    if (!f) return laminar::unavailable("cannot write " + tmp.string());
  }
  std::error_code ec;
  fs::rename(tmp, final_path, ec);
  return ec ? laminar::unavailable("cannot rename " + tmp.string()) : laminar::ok_status();
}

}  // namespace

Status write_address(const fs::path& dir, const std::string& name, const std::string& address) {
  return write_whole(dir, name + ".addr", address);
}

Status mark_left(const fs::path& dir, const std::string& name) {
  return write_whole(dir, name + ".left", std::to_string(now_ns()));
}

namespace {

sigset_t stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}

// A whole non-negative number, or nothing.
std::optional<int> parse_count(const char* text) {
  if (text == nullptr || *text == '\0') return std::nullopt;
  int v = 0;
  const char* end = text + std::strlen(text);
  auto [p, ec] = std::from_chars(text, end, v);
  if (ec != std::errc() || p != end || v < 0) return std::nullopt;
  return v;
}

// --rank or --world as given, else the first of `vars` that is set.
Status from_env(int& value, const char* flag, std::initializer_list<const char*> vars,
                const std::function<const char*(const char*)>& env) {
  if (value >= 0) return laminar::ok_status();
  for (const char* var : vars) {
    const char* text = env(var);
    if (text == nullptr) continue;
    const std::optional<int> v = parse_count(text);
    if (!v) return laminar::invalid_argument(fmt::format("${} is '{}', not a whole number", var, text));
    value = *v;
    return laminar::ok_status();
  }
  std::string names;
  for (const char* var : vars) names += fmt::format("{}${}", names.empty() ? "" : " or ", var);
  return laminar::invalid_argument(fmt::format("--role auto needs {} or {}", flag, names));
}

}  // namespace

Status assign_role(const Settings& s, RoleArgs& a, const std::function<const char*(const char*)>& env) {
  if (a.role == "auto") {
    LAMINAR_RETURN_IF_ERROR(from_env(a.rank, "--rank", {"SLURM_PROCID", "RANK"}, env));
    LAMINAR_RETURN_IF_ERROR(from_env(a.world, "--world", {"SLURM_NTASKS", "WORLD_SIZE"}, env));
    const int world = 1 + s.relays + s.workers;
    if (a.world != world) {
      return laminar::invalid_argument(fmt::format(
          "the run has {} processes (an actor, --relays {}, --workers {}), but the world is {}", world, s.relays,
          s.workers, a.world));
    }
    if (a.rank >= world) return laminar::invalid_argument(fmt::format("rank {} is outside a world of {}", a.rank, world));
    if (a.rank == 0) {
      a.role = "actor";
    } else if (a.rank <= s.relays) {
      a.role = "relay";
      a.index = a.rank - 1;
    } else {
      a.role = "rollout";
      a.index = a.rank - 1 - s.relays;
    }
  }
  if (a.role == "relay" && a.index >= s.relays)
    return laminar::invalid_argument(fmt::format("relay index {} with --relays {}", a.index, s.relays));
  if (a.role == "rollout" && a.index >= s.workers)
    return laminar::invalid_argument(fmt::format("rollout index {} with --workers {}", a.index, s.workers));
  if (a.resume && a.role != "actor")
    return laminar::invalid_argument("--resume restarts the actor, and this process is a " + a.role);
  if (a.dir.empty()) return laminar::invalid_argument("--role " + a.role + " needs --dir, the run's directory");
  if (a.run_schedule.empty()) a.run_schedule = s.schedule;
  if (a.run_schedule != "sync" && a.run_schedule != "one-step" && a.run_schedule != "areal" &&
      a.run_schedule != "laminar") {
    return laminar::invalid_argument(fmt::format(
        "a role runs one schedule: --schedule sync, one-step, areal or laminar, not '{}'", a.run_schedule));
  }
  if (!a.token_file.empty()) {
    std::ifstream f(a.token_file);
    if (!std::getline(f, a.token)) return laminar::invalid_argument("--token-file " + a.token_file + " cannot be read");
  } else if (const char* t = env("LAMINAR_TOKEN"); t != nullptr) {
    a.token = t;
  }
  if (a.token.empty()) return laminar::invalid_argument("no cluster token: --token-file, or $LAMINAR_TOKEN");
  return laminar::ok_status();
}

Result<std::string> listen_host(const std::string& host) {
  if (host != "auto") return host;
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return laminar::unavailable(fmt::format("getifaddrs: {}", std::strerror(errno)));
  std::string found;
  for (const ifaddrs* i = all; i != nullptr && found.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    // Running, as UCX wants an interface it uses: up, with its carrier.
    if ((i->ifa_flags & IFF_UP) == 0 || (i->ifa_flags & IFF_RUNNING) == 0 || (i->ifa_flags & IFF_LOOPBACK) != 0)
      continue;
    std::array<char, INET_ADDRSTRLEN> text{};
    const auto* in = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
    if (inet_ntop(AF_INET, &in->sin_addr, text.data(), text.size()) != nullptr) found = text.data();
  }
  freeifaddrs(all);
  if (found.empty()) return laminar::not_found("--host auto: no interface that is up has a non-loopback IPv4 address");
  return found;
}

namespace {

// Filesystems whose other clients' writes reach no inotify watch here.
bool network_filesystem(const fs::path& dir) {
  struct statfs st {};
  if (statfs(dir.c_str(), &st) != 0) return true;
  constexpr std::array<unsigned long, 9> kNetwork = {
      0x6969,      // NFS
      0xFF534D42,  // CIFS
      0xFE534D42,  // SMB2
      0x517B,      // SMB
      0x0BD00BD0,  // Lustre
      0x47504653,  // GPFS
      0x01021997,  // 9P
      0x65735546,  // FUSE
      0x00C36400,  // Ceph
  };
  return std::find(kNetwork.begin(), kNetwork.end(), static_cast<unsigned long>(st.f_type)) != kNetwork.end();
}

// Closes a descriptor when it leaves scope.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

Woke wait_for_files(const fs::path& dir, std::span<const std::string> names, std::chrono::milliseconds timeout,
                    bool on_signal) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  auto all_there = [&] {
    return std::all_of(names.begin(), names.end(), [&](const std::string& n) { return path_exists(dir / n); });
  };
  // The watch comes first, so that a file made between the look and the sleep still wakes it.
  Fd watch{inotify_init1(IN_CLOEXEC | IN_NONBLOCK)};
  const bool watched =
      watch.fd >= 0 && inotify_add_watch(watch.fd, dir.c_str(), IN_CREATE | IN_MOVED_TO | IN_CLOSE_WRITE) >= 0;
  Fd signals;
  if (on_signal) {
    const sigset_t set = stop_signals();
    signals.fd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
  }
  const bool look_again = !watched || network_filesystem(dir);
  std::chrono::milliseconds again(100);
  for (;;) {
    if (all_there()) return Woke::kFiles;
    const auto now = Clock::now();
    if (now >= deadline) return Woke::kTimeout;
    auto sleep = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now) + std::chrono::milliseconds(1);
    if (look_again) sleep = std::min(sleep, again);
    std::vector<pollfd> fds;
    if (watched) fds.push_back({watch.fd, POLLIN, 0});
    if (signals.fd >= 0) fds.push_back({signals.fd, POLLIN, 0});
    const int n = poll(fds.data(), fds.size(), int(std::min<std::int64_t>(sleep.count(), INT32_MAX)));
    if (n < 0 && errno != EINTR) return Woke::kTimeout;
    if (n == 0 && look_again) again = std::min(again * 2, std::chrono::milliseconds(2000));
    for (const pollfd& p : fds) {
      if ((p.revents & POLLIN) == 0) continue;
      if (p.fd == signals.fd) return Woke::kStopSignal;
      std::array<char, 4096> events;
      while (read(p.fd, events.data(), events.size()) > 0) {
      }
    }
  }
}

Status find_peers(const Settings& s, RoleArgs& a, std::chrono::milliseconds timeout) {
  std::vector<std::string> names;
  if (a.actor.empty()) names.push_back("actor.addr");
  const bool rollout = a.role == "rollout";
  if (rollout && a.relays.empty())
    for (int r = 0; r < s.relays; ++r) names.push_back(fmt::format("relay-{}.addr", r));
  const Woke woke = wait_for_files(a.dir, names, timeout, /*on_signal=*/true);
  if (woke == Woke::kStopSignal) return laminar::cancelled("stopped by a signal");
  if (woke != Woke::kFiles) {
    std::string missing;
    for (const std::string& n : names)
      if (!path_exists(fs::path(a.dir) / n)) missing += (missing.empty() ? "" : ", ") + n;
    return laminar::deadline_exceeded(fmt::format("{} not in {} after {} s", missing, a.dir,
                                                  std::chrono::duration_cast<std::chrono::seconds>(timeout).count()));
  }
  auto read = [&](const std::string& n) {
    std::ifstream f(fs::path(a.dir) / n);
    std::string address;
    std::getline(f, address);
    return address;
  };
  if (a.actor.empty()) a.actor = read("actor.addr");
  if (rollout && a.relays.empty())
    for (int r = 0; r < s.relays; ++r) a.relays.push_back(read(fmt::format("relay-{}.addr", r)));
  return laminar::ok_status();
}

bool path_exists(const fs::path& p) {
  std::error_code ec;  // the non-throwing form: an unreadable path counts as absent
  return fs::exists(p, ec);
}

void block_stop_signals() {
  const sigset_t set = stop_signals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
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
