// settings.h: what every process of an async GRPO run agrees on (Settings), the arguments only a
// role's process takes (RoleArgs), and the command line that carries both. The launcher parses it
// and passes settings_args(s) on to each child it starts, which parses it the same way.
//
//   CLI::App app{"..."};
//   async_grpo::Settings s;
//   async_grpo::RoleArgs a;
//   async_grpo::add_options(app, s, a);
//   CLI11_PARSE(app, argc, argv);
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine.h"
#include "pacing.h"

namespace CLI {
class App;
}  // namespace CLI

namespace async_grpo {

// Everything every role needs to agree on; the launcher passes it on to each child.
struct Settings {
  std::string schedule = "compare";
  int workers = 3;
  int relays = 1;
  std::uint64_t seed = 1;
  int group_size = 8;
  int groups_per_step = 8;
  int steps = 90;
  double minutes = 0;  // > 0: stop training after this long, whatever `steps` says
  int warmup_steps = 30;
  int warmup_batch = 32;  // prompts per warm-up step
  // Held-out prompts each published version is evaluated on: at 512 a version's reward has a
  // standard error of about 0.015, small beside the rise that the time to target reads.
  int eval_prompts = 512;
  int seeds = 1;  // seeds run one after another from `seed`, each with every schedule
  // GRPO steps over which the actor's learning rate ramps up: the actor's Adam starts without the
  // warm-up's moments, and at the full rate its first steps cost up to 0.06 of held-out reward
  // (bench/README.md, Asynchronous GRPO).
  int lr_warmup_steps = 10;
  // How long each rollout decode and prefill step takes (pacing.h): the simulator's cost model of
  // a 7B model on an H100, each token here standing for 256 of its tokens, time 128x faster. A
  // decode step then takes 17-30 ms, as the batch and its contexts grow; unpaced, this model's
  // step takes under 1 ms whatever the batch.
  PacingOptions pacing;
  int max_live = 16;  // sequences one rollout worker decodes at once
  int max_staleness = 0;
  double in_flight_batches = 1;  // laminar: samples being generated at once, in training batches
  bool repack = true;        // laminar: RepackCoordinator + a RepackDriver per worker
  int kill_rollout_at = 0;  // > 0: SIGKILL rollout 0 once the actor reports this step (laminar only)
  // > 0: the actor saves its whole training state (Trainer::save_checkpoint) into <dir>/checkpoint
  // after publishing every this many versions.
  int checkpoint_every = 0;
  std::string out = "async_grpo_out";
  static constexpr std::int32_t kPageSize = 16;  // tokens per KV page of every worker's cache
  bool short_run = false;
  // Where the rollout workers' engines (and the actor's re-scoring one) run: cpu or cuda. The
  // actor trains on the CPU either way.
  std::string device = "cpu";

  async_grpo::EngineOptions engine_options() const {
    return {.device = device == "cuda" ? async_grpo::EngineDevice::kCuda : async_grpo::EngineDevice::kCpu};
  }
};

// Role-only arguments.
// How one process of the run finds its role and the others. Every role meets the others in `dir`,
// the run's directory (each writes <name>.addr there and reads the addresses it needs), unless
// --actor and --relay name them.
struct RoleArgs {
  std::string role;  // actor, relay, rollout, or auto: from rank (assign_role in roles.h)
  int index = 0;     // relay-<index> or rollout-<index>
  int rank = -1;     // --role auto: this process's rank; -1: $SLURM_PROCID, else $RANK
  int world = -1;    // --role auto: the processes of the run; -1: $SLURM_NTASKS, else $WORLD_SIZE
  std::string dir;
  std::string token_file;           // the cluster token; empty: $LAMINAR_TOKEN
  std::string token;                // read from token_file or the environment, never the command line
  std::string host = "127.0.0.1";   // where this process listens; auto: its first non-loopback IPv4 address
  std::string actor;                // actor's address; empty: <dir>/actor.addr
  std::vector<std::string> relays;  // relay addresses, preferred first; empty: <dir>/relay-<i>.addr
  std::string warm;                 // warmed-up weights file; empty: the actor warms up itself
  bool resume = false;              // the actor: go on from <dir>/checkpoint after its process ended
  std::string run_schedule;         // sync, one-step, areal or laminar; empty: --schedule
};

// Every setting as an option of `app`, and the role-only arguments as options --help leaves out.
void add_options(CLI::App& app, Settings& s, RoleArgs& a);

// The settings the roles' processes read, as the arguments the launcher starts each one with (the
// launcher's own, such as --out and --seeds, stay out).
std::vector<std::string> settings_args(const Settings& s);

}  // namespace async_grpo
