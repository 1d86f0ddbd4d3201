// Child processes and network namespaces for tests (see process.h).
#include "process.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "eventually.h"

extern char** environ;

namespace laminar::testing {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<char*> c_strings(std::vector<std::string>& v) {
  std::vector<char*> out;
  out.reserve(v.size() + 1);
  for (auto& s : v) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

int decode_wait_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// Runs a command to completion with stdout/stderr discarded; the exit code, or -1 if it did not start.
int run_quiet(std::vector<std::string> argv) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
  auto args = c_strings(argv);
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return -1;
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return decode_wait_status(status);
}

Status run_ip(std::vector<std::string> args) {
  args.insert(args.begin(), "ip");
  std::string text;
  for (const auto& a : args) text += (text.empty() ? "" : " ") + a;
  const int rc = run_quiet(args);
  if (rc != 0) return unavailable(fmt::format("'{}' exited with {}", text, rc));
  return ok_status();
}

// True when `dev` in namespace `ns` has carrier (LOWER_UP) and its operational state is up. The
// kernel sets the state (and with it IFF_RUNNING) after the carrier, from a work item that waits
// for the rtnl lock, long while deleted namespaces are being cleaned up; UCX skips an interface
// without IFF_RUNNING, and a process started then has no address on the network.
bool is_running(const std::string& ns, const std::string& dev) {
  const std::string cmd = fmt::format("ip -n {} -o link show dev {} 2>/dev/null", ns, dev);
  std::string out;
  if (FILE* f = popen(cmd.c_str(), "r")) {
    char buf[512];
    while (std::fgets(buf, sizeof(buf), f) != nullptr) out += buf;
    pclose(f);
  }
  return out.find("LOWER_UP") != std::string::npos && out.find(" state UP ") != std::string::npos;
}

}  // namespace

Result<ChildProcess> ChildProcess::spawn(ChildOptions options) {
  if (options.program.empty()) return invalid_argument("ChildProcess: empty program path");
  // Everything the child needs is built before fork: after fork in a threaded parent only
  // async-signal-safe calls are allowed.
  std::vector<std::string> argv{options.program};
  argv.insert(argv.end(), options.args.begin(), options.args.end());
  if (options.force_tcp) options.env.emplace_back("UCX_TLS", "tcp");
  std::vector<std::string> envs;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const std::string name = entry.substr(0, entry.find('='));
    bool overridden = false;
    for (const auto& [k, v] : options.env) overridden = overridden || k == name;
    if (!overridden) envs.push_back(entry);
  }
  for (const auto& [k, v] : options.env) envs.push_back(k + "=" + v);
  auto c_argv = c_strings(argv);
  auto c_env = c_strings(envs);

  int ns_fd = -1;
  const char* ns_name = options.netns.c_str();
  if (!options.netns.empty()) {
    const std::string path = "/var/run/netns/" + options.netns;
    ns_fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (ns_fd < 0) {
      return unavailable(fmt::format("network namespace '{}': {}", options.netns, std::strerror(errno)));
    }
  }
  int out_pipe[2];
  int err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0) {
    if (ns_fd >= 0) close(ns_fd);
    return unavailable(fmt::format("pipe: {}", std::strerror(errno)));
  }
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    close(out_pipe[0]);
    close(out_pipe[1]);
    if (ns_fd >= 0) close(ns_fd);
    return unavailable(fmt::format("pipe: {}", std::strerror(errno)));
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    // Child: die with the parent, even if the test crashes before its destructors run.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    int err = 0;
    if (ns_fd >= 0 && setns(ns_fd, CLONE_NEWNET) != 0) err = errno;
    // As `ip netns exec` does: a private mount namespace with /sys remounted, so /sys/class/net lists
    // the namespace's interfaces. UCX finds its tcp devices there; with the host's view it would
    // have no route to the namespace's addresses.
    if (err == 0 && ns_fd >= 0) {
      if (unshare(CLONE_NEWNS) != 0 || mount("", "/", nullptr, MS_SLAVE | MS_REC, nullptr) != 0) {
        err = errno;
      } else {
        umount2("/sys", MNT_DETACH);
        if (mount(ns_name, "/sys", "sysfs", 0, nullptr) != 0) err = errno;
      }
    }
    if (err == 0 && dup2(out_pipe[1], STDOUT_FILENO) < 0) err = errno;
    // The test's own descriptors (its UCX sockets, a listening port) stay with the test.
    if (err == 0 && close_range(STDERR_FILENO + 1, ~0U, CLOSE_RANGE_CLOEXEC) != 0) err = errno;
    if (err == 0) {
      execve(c_argv[0], c_argv.data(), c_env.data());
      err = errno;
    }
    [[maybe_unused]] auto n = write(err_pipe[1], &err, sizeof(err));
    _exit(127);
  }
  const int fork_errno = errno;
  close(out_pipe[1]);
  close(err_pipe[1]);
  if (ns_fd >= 0) close(ns_fd);
  if (pid < 0) {
    close(out_pipe[0]);
    close(err_pipe[0]);
    return unavailable(fmt::format("fork: {}", std::strerror(fork_errno)));
  }
  int child_errno = 0;
  ssize_t got;
  while ((got = read(err_pipe[0], &child_errno, sizeof(child_errno))) < 0 && errno == EINTR) {
  }
  close(err_pipe[0]);
  if (got > 0) {
    int status = 0;
    waitpid(pid, &status, 0);
    close(out_pipe[0]);
    return unavailable(fmt::format("cannot start '{}'{}: {}", options.program,
                                   options.netns.empty() ? "" : " in namespace " + options.netns,
                                   std::strerror(child_errno)));
  }
  return ChildProcess(pid, out_pipe[0]);
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)),
      stdout_fd_(std::exchange(other.stdout_fd_, -1)),
      reaped_(other.reaped_),
      exit_code_(other.exit_code_),
      buffered_(std::move(other.buffered_)) {}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    release();
    pid_ = std::exchange(other.pid_, -1);
    stdout_fd_ = std::exchange(other.stdout_fd_, -1);
    reaped_ = other.reaped_;
    exit_code_ = other.exit_code_;
    buffered_ = std::move(other.buffered_);
  }
  return *this;
}

ChildProcess::~ChildProcess() { release(); }

void ChildProcess::release() noexcept {
  if (running()) {
    ::kill(pid_, SIGKILL);
    int status = 0;
    while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    reaped_ = true;
  }
  if (stdout_fd_ >= 0) close(stdout_fd_);
  stdout_fd_ = -1;
  pid_ = -1;
}

Result<std::string> ChildProcess::read_line(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    const auto nl = buffered_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffered_.substr(0, nl);
      buffered_.erase(0, nl + 1);
      return line;
    }
    if (stdout_fd_ < 0) return unavailable(fmt::format("child {} has no stdout", pid_));
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      return deadline_exceeded(fmt::format("child {} printed no line within {} ms", pid_, timeout.count()));
    }
    pollfd p{stdout_fd_, POLLIN, 0};
    const int rc = poll(&p, 1, static_cast<int>(left));
    if (rc < 0 && errno != EINTR) return unavailable(fmt::format("poll: {}", std::strerror(errno)));
    if (rc <= 0) continue;
    char chunk[4096];
    const ssize_t n = read(stdout_fd_, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return unavailable(fmt::format("child {} closed stdout{}", pid_,
                                     buffered_.empty() ? "" : " after a partial line: " + buffered_));
    }
    buffered_.append(chunk, static_cast<std::size_t>(n));
  }
}

Result<int> ChildProcess::wait(std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return invalid_argument("wait on an empty ChildProcess");
  if (reaped_) return exit_code_;
  // The child's pidfd becomes readable when it exits: the wait is for that event.
  struct PidFd {
    int fd;
    ~PidFd() {
      if (fd >= 0) close(fd);
    }
  } pidfd{static_cast<int>(syscall(SYS_pidfd_open, pid_, 0))};
  if (pidfd.fd < 0) return unavailable(fmt::format("pidfd_open {}: {}", pid_, std::strerror(errno)));
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      reaped_ = true;
      exit_code_ = decode_wait_status(status);
      return exit_code_;
    }
    if (r < 0 && errno != EINTR)
      return unavailable(fmt::format("waitpid {}: {}", pid_, std::strerror(errno)));
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      return deadline_exceeded(fmt::format("child {} still running after {} ms", pid_, timeout.count()));
    }
    pollfd p{pidfd.fd, POLLIN, 0};
    [[maybe_unused]] const int n = poll(&p, 1, static_cast<int>(left));
  }
}

void ChildProcess::kill(int signal) {
  if (running()) ::kill(pid_, signal);
}

Status ChildProcess::stop(std::chrono::milliseconds timeout) {
  if (!running()) return failed_precondition(fmt::format("child {} is not running", pid_));
  if (::kill(pid_, SIGSTOP) != 0) return unavailable(fmt::format("SIGSTOP {}: {}", pid_, std::strerror(errno)));
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WUNTRACED | WNOHANG);
    if (r == pid_ && WIFSTOPPED(status)) return ok_status();
    if (r == pid_) {
      reaped_ = true;
      return unavailable(fmt::format("child {} ended instead of stopping", pid_));
    }
    if (r < 0 && errno != EINTR) return unavailable(fmt::format("waitpid {}: {}", pid_, std::strerror(errno)));
    if (Clock::now() >= deadline) {
      return deadline_exceeded(fmt::format("child {} not stopped after {} ms", pid_, timeout.count()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

Result<NetnsPair> NetnsPair::create(const std::string& prefix) {
  if (geteuid() != 0) return unavailable("network namespaces need root");
  if (prefix.empty() || prefix.size() > 6) {
    return invalid_argument(
        fmt::format("netns prefix '{}' must be 1..6 characters (veth names are short)", prefix));
  }
  const int id = static_cast<int>(getpid()) % 100000;
  NetnsPair pair;
  pair.names_[0] = fmt::format("{}-a-{}", prefix, id);
  pair.names_[1] = fmt::format("{}-b-{}", prefix, id);
  pair.veth_[0] = fmt::format("{}a{}", prefix, id);
  pair.veth_[1] = fmt::format("{}b{}", prefix, id);
  // Each pair lives in its own namespaces, so the same addresses never collide between tests.
  pair.addresses_[0] = "10.77.0.1";
  pair.addresses_[1] = "10.77.0.2";
  const std::vector<std::vector<std::string>> steps = {
      {"netns", "add", pair.names_[0]},
      {"netns", "add", pair.names_[1]},
      {"link", "add", pair.veth_[0], "netns", pair.names_[0], "type", "veth", "peer", "name", pair.veth_[1],
       "netns", pair.names_[1]},
      {"-n", pair.names_[0], "addr", "add", pair.addresses_[0] + "/24", "dev", pair.veth_[0]},
      {"-n", pair.names_[1], "addr", "add", pair.addresses_[1] + "/24", "dev", pair.veth_[1]},
      {"-n", pair.names_[0], "link", "set", "lo", "up"},
      {"-n", pair.names_[1], "link", "set", "lo", "up"},
      {"-n", pair.names_[0], "link", "set", pair.veth_[0], "up"},
      {"-n", pair.names_[1], "link", "set", pair.veth_[1], "up"},
  };
  for (const auto& step : steps) {
    Status st = run_ip(step);
    if (!st.ok()) return st;  // pair's destructor removes what was made
  }
  // A veth end runs a moment after both ends are up; connecting before then fails with
  // "destination unreachable".
  LAMINAR_RETURN_IF_ERROR(pair.wait_until_running(std::chrono::seconds(10)));
  return pair;
}

NetnsPair::NetnsPair(NetnsPair&& other) noexcept {
  for (int i = 0; i < 2; ++i) {
    names_[i] = std::exchange(other.names_[i], {});
    addresses_[i] = std::exchange(other.addresses_[i], {});
    veth_[i] = std::exchange(other.veth_[i], {});
  }
}

NetnsPair& NetnsPair::operator=(NetnsPair&& other) noexcept {
  if (this != &other) {
    destroy();
    for (int i = 0; i < 2; ++i) {
      names_[i] = std::exchange(other.names_[i], {});
      addresses_[i] = std::exchange(other.addresses_[i], {});
      veth_[i] = std::exchange(other.veth_[i], {});
    }
  }
  return *this;
}

NetnsPair::~NetnsPair() { destroy(); }

void NetnsPair::destroy() noexcept {
  for (auto& name : names_) {
    if (!name.empty()) run_quiet({"ip", "netns", "del", name});
    name.clear();
  }
}

Status NetnsPair::wait_until_running(std::chrono::milliseconds timeout) {
  const auto up = [&] {
    for (int side = 0; side < 2; ++side) {
      if (!is_running(names_[side], veth_[side])) return false;
    }
    return true;
  };
  if (eventually(up, timeout)) return ok_status();
  return unavailable(fmt::format("veth {}/{} is not running after {} ms", veth_[0], veth_[1], timeout.count()));
}

Status NetnsPair::link_down() { return run_ip({"-n", names_[0], "link", "set", veth_[0], "down"}); }
Status NetnsPair::link_up() {
  LAMINAR_RETURN_IF_ERROR(run_ip({"-n", names_[0], "link", "set", veth_[0], "up"}));
  return wait_until_running(std::chrono::seconds(10));
}

Result<NetnsSwitch> NetnsSwitch::create(const std::string& prefix, int hosts, std::uint32_t mbit_per_s) {
  if (geteuid() != 0) return unavailable("network namespaces need root");
  if (prefix.empty() || prefix.size() > 4) {
    return invalid_argument(fmt::format("netns prefix '{}' must be 1..4 characters (veth names are short)", prefix));
  }
  if (hosts < 1 || hosts > 9) return invalid_argument(fmt::format("NetnsSwitch: {} hosts, want 1..9", hosts));
  const int id = static_cast<int>(getpid()) % 100000;
  NetnsSwitch net;
  net.switch_ = fmt::format("{}-s-{}", prefix, id);
  LAMINAR_RETURN_IF_ERROR(run_ip({"netns", "add", net.switch_}));
  LAMINAR_RETURN_IF_ERROR(run_ip({"-n", net.switch_, "link", "add", "br0", "type", "bridge"}));
  LAMINAR_RETURN_IF_ERROR(run_ip({"-n", net.switch_, "link", "set", "br0", "up"}));
  // tbf's burst must hold at least one full-size segment burst at this rate; latency bounds its queue.
  const std::string rate = fmt::format("{}mbit", mbit_per_s);
  auto limit = [&](const std::string& ns, const std::string& dev) -> Status {
    if (mbit_per_s == 0) return ok_status();
    const int rc = run_quiet({"tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst",
                              "256kb", "latency", "20ms"});
    if (rc != 0) return unavailable(fmt::format("tc tbf on {} in {} exited with {}", dev, ns, rc));
    return ok_status();
  };
  auto host_end_of = [&](int h) { return fmt::format("{}{}h{}", prefix, h, id); };
  for (int h = 0; h < hosts; ++h) {
    const std::string ns = fmt::format("{}-{}-{}", prefix, h, id);
    const std::string host_end = host_end_of(h);
    const std::string switch_end = fmt::format("{}{}s{}", prefix, h, id);
    LAMINAR_RETURN_IF_ERROR(run_ip({"netns", "add", ns}));
    net.hosts_.push_back(ns);
    net.host_ends_.push_back(host_end);
    LAMINAR_RETURN_IF_ERROR(run_ip({"link", "add", host_end, "netns", ns, "type", "veth", "peer", "name",
                                    switch_end, "netns", net.switch_}));
    LAMINAR_RETURN_IF_ERROR(run_ip({"-n", ns, "addr", "add", net.address(h) + "/24", "dev", host_end}));
    LAMINAR_RETURN_IF_ERROR(run_ip({"-n", ns, "link", "set", "lo", "up"}));
    LAMINAR_RETURN_IF_ERROR(run_ip({"-n", ns, "link", "set", host_end, "up"}));
    LAMINAR_RETURN_IF_ERROR(run_ip({"-n", net.switch_, "link", "set", switch_end, "master", "br0"}));
    LAMINAR_RETURN_IF_ERROR(run_ip({"-n", net.switch_, "link", "set", switch_end, "up"}));
    LAMINAR_RETURN_IF_ERROR(limit(ns, host_end));
    LAMINAR_RETURN_IF_ERROR(limit(net.switch_, switch_end));
  }
  // A veth end runs a moment after both ends are up; a process started before then has no address
  // on the network.
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  for (int h = 0; h < hosts; ++h) {
    const std::string host_end = host_end_of(h);
    if (!eventually([&] { return is_running(net.hosts_[h], host_end); }, deadline - Clock::now())) {
      return unavailable(fmt::format("veth {} is not running after 10 s", host_end));
    }
  }
  return net;
}

NetnsSwitch& NetnsSwitch::operator=(NetnsSwitch&& other) noexcept {
  if (this != &other) {
    destroy();
    switch_ = std::exchange(other.switch_, {});
    hosts_ = std::exchange(other.hosts_, {});
    host_ends_ = std::exchange(other.host_ends_, {});
  }
  return *this;
}

Status NetnsSwitch::link_down(int host) {
  if (host < 0 || host >= hosts()) return invalid_argument(fmt::format("link_down: no host {}", host));
  return run_ip({"-n", hosts_[host], "link", "set", host_ends_[host], "down"});
}

Status NetnsSwitch::link_up(int host) {
  if (host < 0 || host >= hosts()) return invalid_argument(fmt::format("link_up: no host {}", host));
  LAMINAR_RETURN_IF_ERROR(run_ip({"-n", hosts_[host], "link", "set", host_ends_[host], "up"}));
  if (!eventually([&] { return is_running(hosts_[host], host_ends_[host]); }, std::chrono::seconds(10)))
    return unavailable(fmt::format("veth {} is not running 10 s after link_up", host_ends_[host]));
  return ok_status();
}

NetnsSwitch::~NetnsSwitch() { destroy(); }

void NetnsSwitch::destroy() noexcept {
  for (const auto& name : hosts_) run_quiet({"ip", "netns", "del", name});
  hosts_.clear();
  if (!switch_.empty()) run_quiet({"ip", "netns", "del", switch_});
  switch_.clear();
}

std::string NetnsSwitch::address(int host) const { return fmt::format("10.78.0.{}", host + 1); }

bool can_use_netns() {
  if (geteuid() != 0) return false;
  const std::string probe = fmt::format("lmprobe-{}", getpid());
  if (run_quiet({"ip", "netns", "add", probe}) != 0) return false;
  run_quiet({"ip", "netns", "del", probe});
  return true;
}

}  // namespace laminar::testing
