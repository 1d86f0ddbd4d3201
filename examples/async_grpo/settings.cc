#include "settings.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

namespace async_grpo {

void add_options(CLI::App& app, Settings& s, RoleArgs& a) {
  app.add_option("--schedule", s.schedule,
                 "sync, one-step, areal (AReaL's interruptible rollouts), laminar, compare (sync then laminar) or "
                 "all (sync, one-step, areal, then laminar)")
      ->check(CLI::IsMember({"sync", "one-step", "areal", "laminar", "compare", "all"}));
  app.add_option("--workers", s.workers, "rollout worker processes")->check(CLI::Range(1, 64));
  app.add_option("--relays", s.relays, "relay processes between the actor and the workers")->check(CLI::Range(0, 8));
  app.add_option("--seed", s.seed, "task, initial weights and sampling seed");
  app.add_option("--group-size", s.group_size, "samples per prompt")->check(CLI::Range(2, 64));
  app.add_option("--groups-per-step", s.groups_per_step, "prompts per training batch")->check(CLI::Range(1, 256));
  app.add_option("--steps", s.steps,
                 "training steps per schedule (compare and all: sync's; each other schedule then trains for "
                 "sync's wall time, up to 4x as many steps)")
      ->check(CLI::Range(1, 100000));
  app.add_option("--minutes", s.minutes, "stop each schedule's training after this long (0: by --steps)")
      ->check(CLI::Range(0.0, 600.0));
  app.add_option("--warmup-steps", s.warmup_steps, "supervised warm-up steps before RL")->check(CLI::Range(0, 100000));
  app.add_option("--warmup-batch", s.warmup_batch, "prompts per warm-up step")->check(CLI::Range(1, 4096));
  app.add_option("--lr-warmup-steps", s.lr_warmup_steps,
                 "GRPO steps over which the actor's learning rate ramps linearly up (0: none)")
      ->check(CLI::Range(0, 100000));
  app.add_option("--eval-prompts", s.eval_prompts,
                 "held-out prompts each published version is evaluated on")
      ->check(CLI::Range(1, 100000));
  app.add_option("--seeds", s.seeds,
                 "run every schedule on this many seeds, from --seed on, and print the median and range over them")
      ->check(CLI::Range(1, 1000));
  app.add_option("--pace-model", s.pacing.model,
                 "rollout steps take what this model's would on --pace-gpu (the simulator's cost model), scaled; "
                 "none: at this CPU's speed")
      ->check(CLI::IsMember({"none", "qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b"}));
  app.add_option("--pace-gpu", s.pacing.gpu, "the GPU --pace-model runs on")->check(CLI::IsMember({"h100", "h800"}));
  app.add_option("--pace-tokens", s.pacing.tokens, "tokens of --pace-model each token of this run stands for")
      ->check(CLI::Range(1.0, 1e6));
  app.add_option("--pace-speedup", s.pacing.speedup, "how much faster than --pace-model's the run's time goes")
      ->check(CLI::Range(1e-3, 1e9));
  app.add_option("--max-live", s.max_live, "sequences one rollout worker decodes at once")->check(CLI::Range(1, 256));
  app.add_option("--max-staleness", s.max_staleness,
                 "laminar and areal: versions a worker's weights may lag the newest when it takes new samples (0: only "
                 "workers on the newest weights take samples, so most are trained at most one version old)")
      ->check(CLI::Range(0, 16));
  app.add_option("--in-flight-batches", s.in_flight_batches,
                 "laminar and areal: samples handed out and not yet in the actor's queue, in training batches")
      ->check(CLI::Range(0.1, 64.0));
  app.add_option("--repack", s.repack, "laminar: repack sequences across rollout workers (KvMigrator)");
  app.add_option("--checkpoint-every", s.checkpoint_every,
                 "the actor saves its training state into <dir>/checkpoint every this many versions (0: never)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--kill-rollout-at", s.kill_rollout_at, "laminar: SIGKILL rollout 0 after this step (0: never)")
      ->check(CLI::Range(0, 100000));
  app.add_option("--out", s.out, "directory of the report and each schedule's records");
  app.add_option("--device", s.device, "where rollout engines run: cpu, or cuda (a build with CUDA)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_flag("--short", s.short_run, "the CI configuration: laminar, small, one worker killed, under a minute");
  const std::string roles = "Roles (each process of a run started on its own: examples/async_grpo/README.md)";
  app.add_option("--role", a.role, "this process's role; auto: from --rank")
      ->check(CLI::IsMember({"actor", "relay", "rollout", "auto"}))
      ->group(roles);
  app.add_option("--index", a.index, "which relay or rollout worker, from 0")->check(CLI::Range(0, 255))->group(roles);
  app.add_option("--rank", a.rank,
                 "--role auto: 0 the actor, 1 to --relays the relays, then the workers (default $SLURM_PROCID, "
                 "else $RANK)")
      ->check(CLI::Range(0, 1 << 20))
      ->group(roles);
  app.add_option("--world", a.world, "--role auto: 1 + --relays + --workers (default $SLURM_NTASKS, else $WORLD_SIZE)")
      ->check(CLI::Range(1, 1 << 20))
      ->group(roles);
  app.add_option("--dir", a.dir, "the run's directory, where its processes meet: shared by every host")->group(roles);
  app.add_option("--token-file", a.token_file, "file holding the cluster token (default: $LAMINAR_TOKEN)")->group(roles);
  app.add_option("--host", a.host, "address this process listens on; auto: the first IPv4 address of a running, non-loopback interface")
      ->group(roles);
  app.add_option("--actor", a.actor, "the actor's address (default: read from --dir)")->group(roles);
  app.add_option("--relay", a.relays, "a relay's address, preferred first (default: read from --dir)")->group(roles);
  app.add_option("--warm", a.warm, "the actor: warmed-up weights (default: it warms up itself)")->group(roles);
  app.add_flag("--resume", a.resume,
               "the actor: go on from <dir>/checkpoint, its queue's log and its address after its process ended "
               "(needs --checkpoint-every)")
      ->group(roles);
  app.add_option("--run-schedule", a.run_schedule, "")->group("");
}

std::vector<std::string> settings_args(const Settings& s) {
  return {"--seed",          std::to_string(s.seed),          "--group-size", std::to_string(s.group_size),
          "--groups-per-step", std::to_string(s.groups_per_step), "--steps",      std::to_string(s.steps),
          "--minutes",       fmt::format("{}", s.minutes),    "--max-live",   std::to_string(s.max_live),
          "--max-staleness", std::to_string(s.max_staleness), "--kill-rollout-at", std::to_string(s.kill_rollout_at), "--checkpoint-every", std::to_string(s.checkpoint_every), "--in-flight-batches",
          fmt::format("{}", s.in_flight_batches), "--repack", s.repack ? "true" : "false", "--device", s.device,
          "--pace-model", s.pacing.model, "--pace-gpu", s.pacing.gpu, "--pace-tokens",
          fmt::format("{}", s.pacing.tokens), "--pace-speedup", fmt::format("{}", s.pacing.speedup),
          "--lr-warmup-steps", std::to_string(s.lr_warmup_steps), "--workers", std::to_string(s.workers),
          "--relays", std::to_string(s.relays), "--warmup-steps", std::to_string(s.warmup_steps),
          "--warmup-batch", std::to_string(s.warmup_batch)};
}

}  // namespace async_grpo
