// process.h: real child processes and network namespaces for multi-process and fault tests
// (library laminar_test_support, tests/CMakeLists.txt).
//
// ChildProcess starts a program by fork/exec with its own arguments and environment, optionally
// inside a network namespace, and reads its stdout line by line (children announce e.g. the address
// they listen on). A child never outlives its test: the destructor kills (SIGKILL) and reaps it,
// and the kernel kills it too if the test process itself dies (PR_SET_PDEATHSIG). Only the pid the
// test started is ever signalled.
//
// NetnsPair creates two network namespaces joined by a veth pair with one IPv4 address each, where
// links can be cut (link_down) and restored (link_up). It needs root and `ip`; create() says
// kUnavailable otherwise, and the test exits with LAMINAR_SKIP_CODE. Processes in a namespace must
// use UCX_TLS=tcp (ChildOptions::force_tcp): namespaces do not stop UCX from using shared memory.
//
//   auto ns = laminar::testing::NetnsPair::create("lmtr").value();
//   auto server = laminar::testing::ChildProcess::spawn(
//       {.program = exe, .args = {"serve"}, .netns = ns.name(0), .force_tcp = true}).value();
//   std::string addr = server.read_line(std::chrono::seconds(10)).value();  // child printed it
//   ns.link_down();  ...  ns.link_up();
//   REQUIRE(server.wait(std::chrono::seconds(10)).value() == 0);
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "laminar/status.h"

namespace laminar::testing {

struct ChildOptions {
  std::string program;            // path of the executable
  std::vector<std::string> args;  // argv[1..]
  // Added to (or replacing in) the parent's environment.
  std::vector<std::pair<std::string, std::string>> env;
  std::string netns;       // named namespace (ip netns) to run in; "" = the parent's
  bool force_tcp = false;  // sets UCX_TLS=tcp so UCX really uses the network
};

class ChildProcess {
 public:
  // kInvalidArgument: empty program; kUnavailable: fork/exec failed or the namespace does not exist
  // (the exec error is read back from the child, so a bad path fails here, not later).
  static Result<ChildProcess> spawn(ChildOptions options);

  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();  // kill(SIGKILL) and reap if still running

  pid_t pid() const noexcept { return pid_; }
  bool running() const noexcept { return pid_ > 0 && !reaped_; }

  // Next line of the child's stdout, without the newline. kDeadlineExceeded after timeout;
  // kUnavailable when the child closed stdout (exited) first.
  Result<std::string> read_line(std::chrono::milliseconds timeout);

  // Waits for exit: the exit code, or 128 + signal when killed by a signal. kDeadlineExceeded when it
  // is still running after timeout (it keeps running; the destructor or kill() ends it).
  Result<int> wait(std::chrono::milliseconds timeout);

  // Sends `signal` to this child only (no-op once reaped).
  void kill(int signal);
  // Sends SIGSTOP and returns once every thread of the child has stopped: kill() returns before
  // that, and a thread still running may answer a peer meanwhile. kDeadlineExceeded after timeout.
  Status stop(std::chrono::milliseconds timeout);

 private:
  ChildProcess(pid_t pid, int stdout_fd) : pid_(pid), stdout_fd_(stdout_fd) {}
  void release() noexcept;

  pid_t pid_ = -1;
  int stdout_fd_ = -1;
  bool reaped_ = false;
  int exit_code_ = 0;
  std::string buffered_;  // bytes read past the last returned line
};

class NetnsPair {
 public:
  // Namespaces "<prefix>-a-<pid>" and "<prefix>-b-<pid>", veth ends with 10.<k>.<j>.1/24 and .2/24
  // (k, j derived from the pid so parallel tests do not collide). kUnavailable when not root or
  // `ip netns` does not work here; leaves nothing behind on failure.
  static Result<NetnsPair> create(const std::string& prefix);

  NetnsPair(NetnsPair&& other) noexcept;
  NetnsPair& operator=(NetnsPair&& other) noexcept;
  NetnsPair(const NetnsPair&) = delete;
  NetnsPair& operator=(const NetnsPair&) = delete;
  ~NetnsPair();  // deletes both namespaces (and so the veth pair)

  // side 0 or 1.
  const std::string& name(int side) const { return names_[side]; }
  const std::string& address(int side) const { return addresses_[side]; }

  // Cuts / restores the link (ip link set down/up on side 0's veth end). link_up returns once both
  // ends run again.
  Status link_down();
  Status link_up();
  // Waits until both veth ends run (carrier and operational state up). kUnavailable after timeout.
  Status wait_until_running(std::chrono::milliseconds timeout);

 private:
  NetnsPair() = default;
  void destroy() noexcept;
  std::string names_[2];
  std::string addresses_[2];
  std::string veth_[2];
};

// NetnsSwitch puts `hosts` network namespaces on one switch (a bridge in a namespace of its own), one
// IPv4 address each (10.78.0.1, .2, ...), each host behind a link that carries at most `mbit_per_s`
// each way (tbf on both veth ends; 0 = unlimited): hosts with one network card each, on a
// non-blocking switch. Benchmarks use it where the links, not this machine's two cores, should
// bound a transfer. Same requirements and failure modes as NetnsPair.
//
//   auto net = laminar::testing::NetnsSwitch::create("lmrb", 5, 1000).value();
//   ChildProcess::spawn({.program = exe, .args = {net.address(2)}, .netns = net.name(2), .force_tcp = true});
class NetnsSwitch {
 public:
  // kInvalidArgument for a prefix of 0 or more than 4 characters or hosts outside 1..9.
  static Result<NetnsSwitch> create(const std::string& prefix, int hosts, std::uint32_t mbit_per_s);

  NetnsSwitch(NetnsSwitch&& other) noexcept = default;
  NetnsSwitch& operator=(NetnsSwitch&& other) noexcept;
  NetnsSwitch(const NetnsSwitch&) = delete;
  NetnsSwitch& operator=(const NetnsSwitch&) = delete;
  ~NetnsSwitch();  // deletes every namespace (and so the veths and the bridge)

  int hosts() const noexcept { return static_cast<int>(hosts_.size()); }
  const std::string& name(int host) const { return hosts_[host]; }
  std::string address(int host) const;
  // Cuts / restores `host`'s link to the switch (its veth end, down or up): the host is off the
  // network, its processes still run. link_up returns once the link runs again.
  Status link_down(int host);
  Status link_up(int host);

 private:
  NetnsSwitch() = default;
  void destroy() noexcept;
  std::string switch_;
  std::vector<std::string> hosts_;
  std::vector<std::string> host_ends_;  // each host's veth end, in its namespace
};

// True when this process may create network namespaces (root and `ip netns` works).
bool can_use_netns();

}  // namespace laminar::testing
