// async_grpo: asynchronous GRPO end to end on real processes. A libtorch actor trains the policy of
// policy_config.h on DigitTask, rollout worker processes decode it over laminar's paged KV cache,
// weights travel actor -> relay process -> each worker's store, trajectories travel back through the
// actor's TrajectoryQueue, and prompts reach the workers through the RolloutDispatcher.
//
//   async_grpo                        # sync, then laminar on the same seed, and the comparison
//   async_grpo --schedule all         # sync, one-step, then laminar, the same way
//   async_grpo --schedule laminar --workers 3 --steps 40 --out runs/a
//   async_grpo --short                # the CI configuration: checks what the run must guarantee
//   async_grpo --schedule laminar --repack false --device cuda   # rollouts on a GPU (a CUDA build)
//
// One binary, several roles: the launcher (no --role, launcher.cc) warms the policy up, then for
// each schedule re-executes itself as the actor (actor.cc), the relays and the rollout workers
// (rollout.cc), reads their records and writes the report. Children write their addresses into the
// schedule's directory; the launcher stops only the processes it started (SIGTERM, by pid) and reaps
// every one of them.
#include <CLI/CLI.hpp>

#include <cstdlib>

#include "blas.h"
#include "roles.h"
#include "settings.h"

int main(int argc, char** argv) {
  // One BLAS thread in every process the launcher starts: the actor trains on one core, the others
  // never call BLAS, and a thread pool OpenBLAS starts when it loads (before main) would take the
  // SIGTERM that the actor and the relays block and wait for.
  setenv("OPENBLAS_NUM_THREADS", "1", 1);
  setenv("BLIS_NUM_THREADS", "1", 1);
  // Before libtorch runs anything: children inherit the environment it may set.
  async_grpo::use_right_blas_kernels(argv);
  CLI::App app{"Asynchronous GRPO end to end: a libtorch actor, relay processes and rollout workers"};
  async_grpo::Settings s;
  async_grpo::RoleArgs a;
  async_grpo::add_options(app, s, a);
  CLI11_PARSE(app, argc, argv);

  if (a.role.empty() && a.resume)
    return async_grpo::fail("setup", "arguments", laminar::invalid_argument("--resume restarts the actor: add --role actor"));
  if (a.role.empty()) return async_grpo::run_launcher(s);
  if (laminar::Status st = async_grpo::assign_role(s, a); !st.ok()) return async_grpo::fail("setup", "arguments", st);
  // The actor and the relays leave on a stop signal too (the launcher's SIGTERM), which they wait for.
  if (a.role == "actor" || a.role == "relay") async_grpo::block_stop_signals();
  if (a.role == "actor") return async_grpo::run_actor(s, a);
  if (a.role == "relay") return async_grpo::run_relay(s, a);
  return async_grpo::run_rollout(s, a);
}
