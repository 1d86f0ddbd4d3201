// async_grpo: asynchronous GRPO end to end on real processes. A libtorch actor trains the policy of
// policy_config.h on DigitTask, rollout worker processes decode it over laminar's paged KV cache,
// weights travel actor -> relay process -> each worker's store, trajectories travel back through the
// actor's TrajectoryQueue, and prompts reach the workers through the PromptServer.
//
//   async_grpo                        # sync, then laminar on the same seed, and the comparison
//   async_grpo --schedule all         # sync, one-step, then laminar, the same way
//   async_grpo --schedule laminar --workers 3 --steps 40 --out runs/a
//   async_grpo --short                # the CI configuration: checks what the run must guarantee
//   async_grpo --schedule laminar --repack false --device cuda   # rollouts on a GPU (a CUDA build)
//
// One binary, several roles: the launcher (no --role) warms the policy up, then for each schedule
// re-executes itself as the actor, the relays and the rollout workers, reads their records and
// writes the report. Children write their addresses into the schedule's directory; the launcher
// stops only the processes it started and reaps every one of them.
#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "engine.h"
#include "held_out.h"
#include "laminar/kv_migrator.h"
#include "laminar/relay_node.h"
#include "laminar/repack_coordinator.h"
#include "laminar/repack_driver.h"
#include "laminar/relay_store.h"
#include "laminar/remote_trajectory_queue.h"
#include "laminar/trajectory_queue.h"
#include "laminar/transport.h"
#include "laminar/weight_puller.h"
#include "child_process.h"
#include "prompt_dispatch.h"
#include "records.h"
#include "report.h"
#include "task.h"
#include "trainer.h"

namespace {

namespace fs = std::filesystem;
using laminar::Result;
using laminar::Status;
using namespace std::chrono_literals;

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
  int eval_prompts = 128;  // held-out prompts each published version is evaluated on
  // GRPO steps over which the actor's learning rate ramps up: the actor's Adam starts without the
  // warm-up's moments, and at the full rate its first steps cost up to 0.06 of held-out reward
  // (bench/README.md, Asynchronous GRPO).
  int lr_warmup_steps = 10;
  // > 0: each rollout decode or prefill step takes at least this long. 20 ms: the order of a 7-13B
  // model's decode step at batch 16-64 on one GPU; unpaced, this model's step takes under 1 ms.
  double decode_step_ms = 20;
  int max_live = 16;  // sequences one rollout worker decodes at once
  int max_staleness = 1;
  double in_flight_batches = 1;  // laminar: samples out at once, in training batches
  bool repack = true;        // laminar: RepackCoordinator + a RepackDriver per worker
  int kill_rollout_at = 0;  // > 0: SIGKILL rollout 0 once the actor reports this step (laminar only)
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
struct RoleArgs {
  std::string role;
  int index = 0;
  std::string dir;
  std::string token;
  std::string actor;                // actor's address
  std::vector<std::string> relays;  // relay addresses, preferred first
  std::string warm;                 // warmed-up weights file
  std::string run_schedule;         // sync, one-step or laminar
};

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int fail(std::string_view who, std::string_view what, const Status& st) {
  std::fprintf(stderr, "async_grpo %.*s: %.*s: %s\n", int(who.size()), who.data(), int(what.size()), what.data(),
               st.to_string().c_str());
  return 1;
}

// FNV-1a over the weight bytes: both sides hash the same flat manifest layout.
std::uint64_t weight_hash(std::span<const std::byte> bytes) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::byte b : bytes) h = (h ^ std::uint64_t(b)) * 1099511628211ull;
  return h;
}

// Appends one line and flushes it, so a killed process leaves whole lines behind.
class LineFile {
 public:
  explicit LineFile(const fs::path& path) : out_(path, std::ios::trunc) {}
  void write(const std::string& line) { out_ << line << '\n' << std::flush; }

 private:
  std::ofstream out_;
};

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

bool stop_requested(const fs::path& dir) { return path_exists(dir / "stop"); }

// The actor's last published version, once training is over (0 before).
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

// ---------------------------------------------------------------------------------------------
// The actor: queue server, head relay, prompt server and the trainer.

int run_actor(const Settings& s, const RoleArgs& a) {
  const fs::path dir = a.dir;
  auto writer = async_grpo::RecordWriter::open(dir / "records" / "actor.jsonl");
  if (!writer.ok()) return fail("actor", "records", writer.status());
  LineFile published(dir / "published.txt");
  auto transport = make_transport(a.token);
  if (!transport.ok()) return fail("actor", "transport", transport.status());
  auto address = (*transport)->listen("127.0.0.1", 0);
  if (!address.ok()) return fail("actor", "listen", address.status());

  const std::uint32_t G = std::uint32_t(s.group_size);
  const std::size_t batch_size = std::size_t(s.groups_per_step) * G;
  laminar::TrajectoryQueueOptions qo;
  qo.group_timeout = laminar::kForever;  // a lost worker's samples are generated again elsewhere
  auto queue = laminar::TrajectoryQueue::create(qo);
  if (!queue.ok()) return fail("actor", "queue", queue.status());
  std::shared_ptr<laminar::TrajectoryQueue> q = std::move(*queue);
  auto qserver = laminar::TrajectoryQueueServer::create(*transport, q);
  if (!qserver.ok()) return fail("actor", "queue server", qserver.status());
  auto store = laminar::RelayStore::create();
  if (!store.ok()) return fail("actor", "relay store", store.status());
  std::shared_ptr<laminar::RelayStore> relay = std::move(*store);
  auto head = laminar::RelayNode::create(*transport, relay, {});
  if (!head.ok()) return fail("actor", "relay node", head.status());
  async_grpo::PromptServerOptions po;
  po.group_size = G;
  po.seed = s.seed;
  po.lease = std::chrono::seconds(10);
  auto dispatch = async_grpo::PromptServer::create(*transport, po);
  if (!dispatch.ok()) return fail("actor", "prompt server", dispatch.status());
  async_grpo::PromptServer& server = **dispatch;

  std::unique_ptr<laminar::RepackCoordinator> coordinator;
  if (a.run_schedule == "laminar" && s.repack) {
    laminar::RepackCoordinatorOptions co;
    co.tokens_per_page = Settings::kPageSize;
    // Decode steps take 20-250 us here, so a batch's tail is over within a few ms: reports every
    // 1 ms (the driver's) and a plan every 2 ms see it; a report 100 ms old is of no use.
    co.interval = 2ms;
    co.stale_after = 100ms;
    // One page over every layer, K and V, f32; workers share one host.
    const async_grpo::PolicyConfig pc;
    co.policy.page_bytes = std::uint64_t(pc.num_layers) * 2 * pc.num_kv_heads * pc.head_dim * Settings::kPageSize * 4;
    co.policy.link_bytes_per_s = 1e9;
    co.policy.growth_horizon_steps = pc.max_positions;
    // The paper's rule: empty every old-version worker whose sequences fit elsewhere, so that it
    // pulls the newest weights. The cost-aware rule weighs the decode time a move frees against
    // the move, and here both are about a millisecond (a tail of a few 100 us steps; one migration
    // between processes on a shared host), so it refuses nearly every plan.
    co.policy.strategy = laminar::RepackStrategy::kPaperBestFit;
    auto c = laminar::RepackCoordinator::create(*transport, co);
    if (!c.ok()) return fail("actor", "repack coordinator", c.status());
    coordinator = std::move(*c);
  }

  async_grpo::TrainerOptions to;
  to.seed = s.seed;
  to.intra_op_threads = 1;
  to.learning_rate_warmup_steps = s.lr_warmup_steps;
  auto trainer_or = async_grpo::Trainer::create(to);
  if (!trainer_or.ok()) return fail("actor", "trainer", trainer_or.status());
  async_grpo::Trainer& trainer = **trainer_or;
  {
    std::ifstream f(a.warm, std::ios::binary);
    std::vector<std::byte> flat(trainer.manifest().total_bytes());
    f.read(reinterpret_cast<char*>(flat.data()), std::streamsize(flat.size()));
    if (!f) return fail("actor", "warm-up weights", laminar::not_found("cannot read " + a.warm));
    if (Status st = trainer.load_weights(flat); !st.ok()) return fail("actor", "warm-up weights", st);
  }

  // laminar's prefill re-scoring of every trained sample under the version it names: equal bit for
  // bit to the rollout's log-probs unless the sample mixes versions or the weights differ. On the
  // rollouts' device: the host's bits are not the device's (engine.h).
  auto scorer = async_grpo::Engine::create(async_grpo::PolicyConfig{}, s.engine_options());
  if (!scorer.ok()) return fail("actor", "scoring engine", scorer.status());
  auto score_cache = scorer->make_cache(16, 16);
  if (!score_cache.ok()) return fail("actor", "scoring cache", score_cache.status());
  std::map<std::uint64_t, std::vector<std::byte>> recent;  // the newest published versions' bytes
  std::uint64_t scorer_version = 0;

  std::vector<std::byte> flat(trainer.manifest().total_bytes());
  auto publish = [&](laminar::Version v) -> Status {
    const std::int64_t t0 = now_ns();
    LAMINAR_RETURN_IF_ERROR(q->publish_version(v));  // first, so the queue accepts what v generates
    auto views = trainer.weights();
    if (!views.ok()) return views.status();
    LAMINAR_RETURN_IF_ERROR(relay->publish(v, trainer.manifest(), *views));
    LAMINAR_RETURN_IF_ERROR(server.set_newest_version(v));
    if (coordinator) LAMINAR_RETURN_IF_ERROR(coordinator->set_newest_version(v));
    LAMINAR_RETURN_IF_ERROR(trainer.save_weights(flat));
    published.write(fmt::format("{} {:016x}", v.value(), weight_hash(flat)));
    recent[v.value()] = flat;
    // Kept for the launcher's held-out evaluation after the run (it removes them).
    {
      std::ofstream f(dir / "versions" / fmt::format("{}.bin", v.value()), std::ios::binary | std::ios::trunc);
      f.write(reinterpret_cast<const char*>(flat.data()), std::streamsize(flat.size()));
      if (!f) return laminar::unavailable(fmt::format("cannot write version {} into {}", v.value(), dir.string()));
    }
    while (recent.size() > 8) recent.erase(recent.begin());
    return writer->write(async_grpo::Span{.process = "actor", .kind = async_grpo::SpanKind::kPublish,
                                          .start_ns = t0, .end_ns = now_ns(), .version = v.value(),
                                          .bytes = flat.size()});
  };

  laminar::Version v(1);
  if (Status st = publish(v); !st.ok()) return fail("actor", "publish", st);
  if (Status st = write_address(dir, "actor", *address); !st.ok()) return fail("actor", "address", st);

  const std::string& sched = a.run_schedule;
  if (sched == "sync") {
    if (auto r = server.open(v, v, std::uint64_t(s.groups_per_step)); !r.ok()) return fail("actor", "open", r.status());
  } else if (sched == "one-step") {
    if (auto r = server.open(v, async_grpo::kAnyNewer, std::uint64_t(s.groups_per_step)); !r.ok())
      return fail("actor", "open", r.status());
  } else {
    const auto in_flight = std::max<std::uint64_t>(G, std::uint64_t(s.in_flight_batches * double(batch_size)));
    async_grpo::StreamWindow w{.max_staleness = std::uint64_t(s.max_staleness), .max_in_flight = in_flight};
    if (Status st = server.set_stream(w); !st.ok()) return fail("actor", "stream", st);
  }

  std::unordered_set<std::uint64_t> trained_ids;
  std::uint64_t duplicate_trained = 0, partial_groups = 0, on_policy = 0;
  double max_lp_diff = 0, sum_lp_diff = 0;
  std::uint64_t lp_tokens = 0, rescored = 0, rescore_differs = 0, not_rescored = 0;
  auto rescore = [&](std::span<const laminar::Trajectory> ts) -> Status {
    std::vector<const laminar::Trajectory*> order;
    for (const laminar::Trajectory& t : ts) order.push_back(&t);
    std::sort(order.begin(), order.end(), [](auto* x, auto* y) { return x->version < y->version; });
    for (const laminar::Trajectory* t : order) {
      auto bytes = recent.find(t->version.value());
      if (bytes == recent.end()) {
        ++not_rescored;
        continue;
      }
      if (scorer_version != t->version.value()) {
        LAMINAR_RETURN_IF_ERROR(scorer->load_weights(bytes->second));
        scorer_version = t->version.value();
      }
      auto lp = scorer->score(**score_cache, laminar::SequenceId(1), t->prompt_tokens, t->response_tokens);
      if (!lp.ok()) return lp.status();
      ++rescored;
      if (lp->size() != t->logprobs.size() ||
          std::memcmp(lp->data(), t->logprobs.data(), lp->size() * sizeof(float)) != 0)
        ++rescore_differs;
    }
    return laminar::ok_status();
  };
  const std::int64_t train_start = now_ns();
  const auto deadline_ns = s.minutes > 0 ? train_start + std::int64_t(s.minutes * 60e9) : INT64_MAX;
  int step = 0;
  for (; step < s.steps && now_ns() < deadline_ns; ++step) {
    laminar::BatchSpec spec;
    spec.max_trajectories = spec.min_trajectories = batch_size;
    spec.wait = std::chrono::seconds(120);
    spec.consumer_version = v;
    const std::int64_t wait0 = now_ns();
    Result<laminar::Batch> batch = q->pop_batch(spec);
    if (!batch.ok()) return fail("actor", "pop_batch", batch.status());
    (void)writer->write(async_grpo::Span{.process = "actor", .kind = async_grpo::SpanKind::kIdleWait,
                                         .start_ns = wait0, .end_ns = now_ns(), .version = v.value()});
    const auto ts = batch->trajectories();
    std::map<std::uint64_t, std::uint32_t> group_count;
    std::vector<laminar::Trajectory> current;
    double reward = 0;
    for (const laminar::Trajectory& t : ts) {
      auto c = server.completed(t.id);
      if (!c.ok()) return fail("actor", "completed", c.status());
      if (!trained_ids.insert(t.id.value()).second) ++duplicate_trained;
      ++group_count[t.group_id];
      reward += t.rewards[0] / double(ts.size());
      if (t.version == v) current.push_back(t);
      (void)writer->write(async_grpo::TrajectoryFact{.behaviour_version = t.version.value(),
                                                     .trained_version = v.value(),
                                                     .length = t.response_tokens.size()});
    }
    for (const auto& [group, n] : group_count) partial_groups += n != G ? 1 : 0;
    if (Status st = rescore(ts); !st.ok()) return fail("actor", "rescore", st);
    // The actor's recompute of on-policy samples: same weights, so only arithmetic order differs.
    // One batch's worth per run: every schedule's first batch is on-policy, and a recompute of
    // every sync batch would cost sync a third of a training step each step, and laminar nothing.
    if (!current.empty() && on_policy < batch_size) {
      auto lp = trainer.log_probs(current);
      if (!lp.ok()) return fail("actor", "log_probs", lp.status());
      for (std::size_t i = 0; i < current.size(); ++i)
        for (std::size_t k = 0; k < current[i].logprobs.size(); ++k) {
          const double d = std::fabs(double((*lp)[i][k]) - double(current[i].logprobs[k]));
          max_lp_diff = std::max(max_lp_diff, d);
          sum_lp_diff += d;
          ++lp_tokens;
        }
      on_policy += current.size();
    }
    if (sched == "one-step" && step + 1 < s.steps)
      if (auto r = server.open(v, async_grpo::kAnyNewer, std::uint64_t(s.groups_per_step)); !r.ok())
        return fail("actor", "open", r.status());
    const std::int64_t t0 = now_ns();
    auto stats = trainer.train_step(ts);
    if (!stats.ok()) return fail("actor", "train_step", stats.status());
    (void)writer->write(async_grpo::Span{.process = "actor", .kind = async_grpo::SpanKind::kTrain, .start_ns = t0,
                                         .end_ns = now_ns(), .version = v.value(), .sequences = ts.size(),
                                         .tokens = std::uint64_t(stats->tokens)});
    if (Status st = q->ack(batch->id()); !st.ok()) return fail("actor", "ack", st);
    (void)writer->write(async_grpo::RewardPoint{.time_ns = now_ns(), .version = v.value(), .mean_reward = reward,
                                                .samples = ts.size()});
    v = laminar::Version(v.value() + 1);
    if (Status st = publish(v); !st.ok()) return fail("actor", "publish", st);
    if (sched == "sync" && step + 1 < s.steps)
      if (auto r = server.open(v, v, std::uint64_t(s.groups_per_step)); !r.ok()) return fail("actor", "open", r.status());
    std::printf("progress %d reward %.3f\n", step + 1, reward);
    std::fflush(stdout);
  }

  // The stream's groups still out: let them finish so every sample made reaches the queue once.
  server.stop_stream();
  std::uint64_t drained = 0;
  const std::int64_t drain_deadline = now_ns() + std::int64_t(60e9);
  while (server.stats().groups_done < server.stats().groups_made && now_ns() < drain_deadline) {
    laminar::BatchSpec spec;
    spec.max_trajectories = batch_size;
    spec.min_trajectories = 1;
    spec.wait = std::chrono::seconds(1);
    spec.consumer_version = v;
    Result<laminar::Batch> batch = q->pop_batch(spec);
    if (!batch.ok()) {
      if (batch.status().code() == laminar::StatusCode::kDeadlineExceeded) continue;
      return fail("actor", "drain", batch.status());
    }
    for (const laminar::Trajectory& t : batch->trajectories()) {
      auto c = server.completed(t.id);
      if (!c.ok()) return fail("actor", "completed", c.status());
      if (!trained_ids.insert(t.id.value()).second) ++duplicate_trained;
      ++drained;
    }
    if (Status st = q->ack(batch->id()); !st.ok()) return fail("actor", "ack", st);
  }
  // The last version is published: workers leave once their stores hold it, so no relay is still
  // writing into their memory when they free it.
  if (Status st = write_address(dir, "final", std::to_string(v.value())); !st.ok()) return fail("actor", "final", st);

  const async_grpo::PromptServerStats ds = server.stats();
  auto check = [](const char* name, bool ok, const std::string& detail) {
    std::printf("check %s %s %s\n", name, ok ? "ok" : "FAIL", detail.c_str());
  };
  check("trained_once", duplicate_trained == 0 && ds.duplicates == 0,
        fmt::format("{} samples reached the trainer, {} twice; dispatch duplicates {}", trained_ids.size(),
                    duplicate_trained, ds.duplicates));
  check("all_completed", ds.groups_done == ds.groups_made && ds.completed == ds.groups_made * G,
        fmt::format("groups made {} done {}, samples completed {}, drained after the last step {}, reissued {}, "
                    "lost workers {}",
                    ds.groups_made, ds.groups_done, ds.completed, drained, ds.reissued, ds.lost_workers));
  check("whole_groups", partial_groups == 0, fmt::format("{} groups trained without all {} samples", partial_groups, G));
  check("rescore_bit_equal", rescored > 0 && rescore_differs == 0,
        fmt::format("{} trained samples re-scored by laminar's prefill under their version, {} differ, {} "
                    "not re-scored (version no longer kept)",
                    rescored, rescore_differs, not_rescored));
  check("behaviour_logprobs", on_policy == 0 || max_lp_diff < 1e-2,
        fmt::format("{} on-policy samples recomputed, {} tokens: |rollout - actor recompute| max {:.3g} mean {:.3g}", on_policy,
                    lp_tokens, max_lp_diff, lp_tokens ? sum_lp_diff / double(lp_tokens) : 0.0));
  std::printf("dispatch %s\n", ds.to_json().c_str());
  if (coordinator) std::printf("repack %s\n", coordinator->stats().to_json().c_str());
  std::printf("steps %d\n", step);
  std::fflush(stdout);
  // The launcher says stop once every rollout worker has left.
  const std::int64_t stop_deadline = now_ns() + std::int64_t(60e9);
  while (!stop_requested(dir) && now_ns() < stop_deadline) std::this_thread::sleep_for(20ms);
  q->close();
  return 0;
}

// ---------------------------------------------------------------------------------------------
// A relay: a RelayNode between the actor and the workers.

int run_relay(const RoleArgs& a) {
  const std::string who = fmt::format("relay-{}", a.index);
  auto transport = make_transport(a.token);
  if (!transport.ok()) return fail(who, "transport", transport.status());
  auto address = (*transport)->listen("127.0.0.1", 0);
  if (!address.ok()) return fail(who, "listen", address.status());
  auto store = laminar::RelayStore::create();
  if (!store.ok()) return fail(who, "relay store", store.status());
  laminar::RelayNodeOptions o;
  o.upstreams = {a.actor};
  auto node = laminar::RelayNode::create(*transport, std::move(*store), o);
  if (!node.ok()) return fail(who, "relay node", node.status());
  if (Status st = write_address(a.dir, who, *address); !st.ok()) return fail(who, "address", st);
  while (!stop_requested(a.dir)) std::this_thread::sleep_for(50ms);
  return 0;
}

// ---------------------------------------------------------------------------------------------
// A rollout worker: engine, cache, worker-local store, puller, prompt client, queue producer.

struct Live {
  bool paused = false;  // a migration out of this worker holds it
  laminar::SequenceState seq;
  async_grpo::DigitPrompt prompt;
  std::int32_t max_tokens = 0;
  std::int64_t start_ns = 0;
};

class Rollout {
 public:
  Rollout(const Settings& s, const RoleArgs& a) : s_(s), a_(a), who_(fmt::format("rollout-{}", a.index)) {}

  int run() {
    auto task = make_task(s_);
    if (!task.ok()) return fail(who_, "task", task.status());
    task_.emplace(std::move(*task));
    auto engine = async_grpo::Engine::create(async_grpo::PolicyConfig{}, s_.engine_options());
    if (!engine.ok()) return fail(who_, "engine", engine.status());
    engine_.emplace(std::move(*engine));
    destinations_ = engine_->weight_tensors();
    auto writer = async_grpo::RecordWriter::open(fs::path(a_.dir) / "records" / (who_ + ".jsonl"));
    if (!writer.ok()) return fail(who_, "records", writer.status());
    writer_.emplace(std::move(*writer));
    hashes_.emplace(fs::path(a_.dir) / ("weights-" + who_ + ".txt"));
    moved_log_.emplace(fs::path(a_.dir) / ("moved-" + who_ + ".txt"));

    auto transport = make_transport(a_.token);
    if (!transport.ok()) return fail(who_, "transport", transport.status());
    transport_ = *transport;
    const std::int32_t page_size = Settings::kPageSize;
    pages_ = s_.max_live * (engine_->config().max_positions / page_size + 1) + 8;
    auto pools = laminar::KvMigrator::allocate_cache(*transport_, engine_->kv_layout(pages_, page_size));
    if (!pools.ok()) return fail(who_, "cache", pools.status());
    cache_ = pools->cache;
    // Device workers decode in device pools; they run without repack (the launcher refuses it), so
    // the host pools above stay unused.
    if (s_.device == "cuda") {
      auto device_cache = engine_->make_cache(pages_, page_size);
      if (!device_cache.ok()) return fail(who_, "cache", device_cache.status());
      cache_ = *device_cache;
    }
    if (a_.run_schedule == "laminar" && s_.repack) {
      // Migrations arrive at this worker's own address.
      if (auto address = transport_->listen("127.0.0.1", 0); !address.ok()) return fail(who_, "listen", address.status());
      laminar::KvMigratorOptions mo;
      mo.k_pool_region = pools->k_pool;
      mo.v_pool_region = pools->v_pool;
      mo.max_sequences = std::uint32_t(s_.max_live);
      auto migrator = laminar::KvMigrator::create(transport_, cache_, mo);
      if (!migrator.ok()) return fail(who_, "migrator", migrator.status());
      migrator_ = std::move(*migrator);
      migrator_->set_version(laminar::Version(0));
      laminar::RepackDriverOptions dopt;
      dopt.worker = laminar::WorkerId(std::uint32_t(a_.index));
      dopt.coordinator = a_.actor;
      dopt.report_interval = 1ms;
      auto driver = laminar::RepackDriver::create(transport_, migrator_, dopt);
      if (!driver.ok()) return fail(who_, "repack driver", driver.status());
      driver_ = std::move(*driver);
    }
    auto store = laminar::RelayStore::create();
    if (!store.ok()) return fail(who_, "relay store", store.status());
    store_ = std::move(*store);
    laminar::RelayNodeOptions o;
    o.upstreams = a_.relays;
    o.upstreams.push_back(a_.actor);  // the chain re-forms around a dead relay
    auto node = laminar::RelayNode::create(transport_, store_, o);
    if (!node.ok()) return fail(who_, "relay node", node.status());
    node_ = std::move(*node);
    auto puller = laminar::WeightPuller::create(store_);
    if (!puller.ok()) return fail(who_, "puller", puller.status());
    puller_ = std::move(*puller);
    auto client = async_grpo::PromptClient::create(
        transport_, {.worker = laminar::WorkerId(std::uint32_t(a_.index)), .server = a_.actor});
    if (!client.ok()) return fail(who_, "prompt client", client.status());
    client_ = std::move(*client);
    auto producer = laminar::RemoteProducer::create(transport_, a_.actor);
    if (!producer.ok()) return fail(who_, "producer", producer.status());
    producer_ = std::move(*producer);

    Status st = loop();
    flush_decode();
    if (!st.ok()) return fail(who_, "loop", st);
    // Leaving with the final version still arriving would free memory its relay writes into.
    if (Status w = store_->wait_for_version(laminar::Version(final_version(a_.dir)), 30s); !w.ok())
      return fail(who_, "final version", w);
    std::printf("%s finished: %llu trajectories pushed, %llu pulls\n", who_.c_str(),
                static_cast<unsigned long long>(pushed_), static_cast<unsigned long long>(pulls_));
    return 0;
  }

 private:
  std::uint64_t current() const { return puller_->current_version() ? puller_->current_version()->value() : 0; }

  Status loop() {
    laminar::Version want{0};  // the server asked for this version or newer (0: it did not)
    while (final_version(a_.dir) == 0) {
      if (driver_) {
        Result<std::vector<laminar::MigrationEvent>> events = driver_->step(snapshot());
        if (!events.ok()) return events.status();
        for (laminar::MigrationEvent& e : *events) LAMINAR_RETURN_IF_ERROR(handle(e));
      }
      if (idle()) {
        const std::optional<laminar::Version> newest = puller_->newest_version();
        if (newest && newest->value() > current() && *newest >= want) {
          LAMINAR_RETURN_IF_ERROR(pull(*newest));
          want = laminar::Version(0);
        }
      }
      std::vector<laminar::TrajectoryId> held;
      for (const Live& l : live_) held.push_back(l.seq.trajectory);
      // No work before the first pull: the engine's weights are zeros until then.
      const bool take = want.value() == 0 && current() > 0;
      taking_ = take;
      const std::uint32_t free_slots = take ? std::uint32_t(s_.max_live - int(live_.size())) : 0;
      Result<async_grpo::Grant> grant = client_->request(laminar::Version(current()), free_slots, held);
      if (!grant.ok()) return grant.status();  // after the run: the actor left
      for (laminar::TrajectoryId id : grant->drop) drop(id);
      if (grant->kind == async_grpo::GrantKind::kPullNewer) want = grant->pull_version;
      if (grant->kind == async_grpo::GrantKind::kWork) LAMINAR_RETURN_IF_ERROR(start(grant->samples));
      if (!idle()) {
        LAMINAR_RETURN_IF_ERROR(step());
      } else {
        flush_decode();
        const std::int64_t t0 = now_ns();
        if (want.value() > 0) (void)store_->wait_for_version(want, 20ms);
        else std::this_thread::sleep_for(2ms);
        LAMINAR_RETURN_IF_ERROR(writer_->write(async_grpo::Span{.process = who_,
                                                                .kind = async_grpo::SpanKind::kIdleWait,
                                                                .start_ns = t0, .end_ns = now_ns(),
                                                                .version = current()}));
      }
    }
    return laminar::ok_status();
  }

  // Nothing live and nothing moving: the only time weights may change.
  bool idle() const { return live_.empty() && (!migrator_ || migrator_->moving().empty()); }

  laminar::WorkerSnapshot snapshot() {
    laminar::WorkerSnapshot w;
    w.id = laminar::WorkerId(std::uint32_t(a_.index));
    w.version = migrator_->version();
    w.pages_total = pages_;
    w.pages_used = cache_->used_pages();
    w.slots_total = s_.max_live;
    w.slots_used = std::int32_t(live_.size());
    w.step_time = live_.empty() ? laminar::Duration(0) : step_time_;
    // Taking no new samples (it waits for newer weights) or past its peak: its KV only shrinks now.
    w.kv_stopped_growing = w.pages_used < peak_pages_ || !taking_;
    for (const Live& l : live_) {
      auto pages = cache_->pages(l.seq.sequence);
      // The answer's length is the prompt's digit count plus EOS: the task's own length predictor.
      // A response already past it runs on to EOS or its token limit, which it does not tell: the
      // policy's own estimate then.
      const std::int64_t expected = std::int64_t(l.prompt.answer.size()) - std::int64_t(l.seq.response_tokens.size());
      w.sequences.push_back({l.seq.sequence, std::int64_t(l.seq.kv_length), pages.ok() ? std::int64_t(pages->size()) : 0,
                             expected > 0 ? std::optional<std::int64_t>(expected) : std::nullopt});
    }
    return w;
  }

  Status handle(laminar::MigrationEvent& e) {
    using Kind = laminar::MigrationEvent::Kind;
    auto find = [&](laminar::SequenceId id) {
      return std::find_if(live_.begin(), live_.end(), [&](const Live& l) { return l.seq.sequence == id; });
    };
    switch (e.kind) {
      case Kind::kPauseRequested: {
        std::vector<laminar::SequenceState> states;
        for (laminar::SequenceId id : e.sequences) {
          auto it = find(id);
          if (it == live_.end()) return laminar::internal_error(fmt::format("pause of sequence {}, not live", id.value()));
          it->paused = true;
          states.push_back(it->seq);
        }
        paused_at_[e.id] = now_ns();
        const Status st = migrator_->finish(e.id, std::move(states));
        // These two abort the migration (a kAborted event follows).
        if (!st.ok() && st.code() != laminar::StatusCode::kFailedPrecondition &&
            st.code() != laminar::StatusCode::kResourceExhausted)
          return st;
        return laminar::ok_status();
      }
      case Kind::kDone: {
        const std::int64_t end = now_ns();
        const std::int64_t start = paused_at_.contains(e.id) ? paused_at_[e.id] : end;
        paused_at_.erase(e.id);
        std::uint64_t pages = 0;
        for (laminar::SequenceId id : e.sequences) {
          auto it = find(id);
          if (it == live_.end()) continue;
          pages += (it->seq.kv_length + Settings::kPageSize - 1) / Settings::kPageSize;
          moved_log_->write(fmt::format("out {}", it->seq.trajectory.value()));
          moved_.insert(it->seq.trajectory.value());
          live_.erase(it);  // the migrator released it from the cache
        }
        const std::uint64_t bytes = pages * std::uint64_t(engine_->config().num_layers) * 2 *
                                    std::uint64_t(engine_->config().num_kv_heads) * std::uint64_t(engine_->config().head_dim) *
                                    Settings::kPageSize * sizeof(float);
        LAMINAR_RETURN_IF_ERROR(writer_->write(async_grpo::Span{.process = who_,
                                                                .kind = async_grpo::SpanKind::kMigrateOut,
                                                                .start_ns = start, .end_ns = end, .version = current(),
                                                                .sequences = e.sequences.size(), .bytes = bytes}));
        return writer_->write(async_grpo::RepackEvent{.time_ns = end, .moved_sequences = e.sequences.size(),
                                                      .bytes = bytes});
      }
      case Kind::kAborted:
        if (e.outgoing) {
          paused_at_.erase(e.id);
          for (laminar::SequenceId id : e.sequences)
            if (auto it = find(id); it != live_.end()) it->paused = false;
        }
        return laminar::ok_status();
      case Kind::kArrived: {
        const std::int64_t t = now_ns();
        for (laminar::SequenceState& st : e.states) {
          moved_log_->write(fmt::format("in {}", st.trajectory.value()));
          moved_.insert(st.trajectory.value());
          Live l;
          l.prompt = task_->prompt(st.prompt_id);
          l.max_tokens = task_->max_response_tokens(l.prompt);
          l.start_ns = t;
          l.seq = std::move(st);
          live_.push_back(std::move(l));
        }
        return writer_->write(async_grpo::Span{.process = who_, .kind = async_grpo::SpanKind::kMigrateIn,
                                               .start_ns = t, .end_ns = now_ns(), .version = current(),
                                               .sequences = e.states.size()});
      }
    }
    return laminar::ok_status();
  }

  Status pull(laminar::Version v) {
    const std::int64_t seen = now_ns();
    LAMINAR_RETURN_IF_ERROR(puller_->pull(v, destinations_, /*has_live_trajectory=*/false));
    LAMINAR_RETURN_IF_ERROR(engine_->check_weights());
    if (migrator_) migrator_->set_version(v);
    const std::int64_t end = now_ns();
    ++pulls_;
    hashes_->write(fmt::format("{} {:016x}", v.value(), weight_hash(engine_->weight_bytes())));
    LAMINAR_RETURN_IF_ERROR(writer_->write(async_grpo::Span{.process = who_, .kind = async_grpo::SpanKind::kPull,
                                                            .start_ns = seen, .end_ns = end, .version = v.value(),
                                                            .bytes = engine_->weight_bytes().size()}));
    return writer_->write(async_grpo::WeightSync{.process = who_, .version = v.value(), .start_ns = seen,
                                                 .end_ns = end});
  }

  void drop(laminar::TrajectoryId id) {
    auto it = std::find_if(live_.begin(), live_.end(), [&](const Live& l) { return l.seq.trajectory == id; });
    if (it == live_.end() || it->paused || moving(it->seq.sequence)) return;  // the migration's until it ends
    (void)cache_->release(it->seq.sequence);
    live_.erase(it);
  }

  Status start(const std::vector<async_grpo::Sample>& samples) {
    const std::size_t first = live_.size();
    peak_pages_ = 0;  // new samples: the KV grows again
    for (const async_grpo::Sample& x : samples) {
      Live l;
      l.prompt = task_->prompt(x.prompt_index);
      l.max_tokens = task_->max_response_tokens(l.prompt);
      l.start_ns = now_ns();
      l.seq.sequence = laminar::SequenceId(x.id.value());
      l.seq.trajectory = x.id;
      l.seq.prompt_id = l.seq.group_id = x.prompt_index;
      l.seq.group_size = std::uint32_t(s_.group_size);
      l.seq.sample_index = x.sample_index;
      l.seq.version = laminar::Version(current());
      l.seq.seed = x.seed;
      l.seq.prompt_tokens = l.prompt.tokens;
      live_.push_back(std::move(l));
    }
    std::vector<laminar::SequenceState*> batch;
    std::uint64_t tokens = 0;
    for (std::size_t i = first; i < live_.size(); ++i) {
      batch.push_back(&live_[i].seq);
      tokens += live_[i].seq.prompt_tokens.size();
    }
    const std::int64_t t0 = now_ns();
    if (Status st = engine_->prefill(*cache_, batch); !st.ok()) {
      live_.resize(first);
      return st;
    }
    pace(t0);
    // The launcher's kill test waits for this line, so the worker dies holding samples.
    if (s_.kill_rollout_at > 0 && a_.index == 0) {
      std::printf("granted %zu\n", batch.size());
      std::fflush(stdout);
    }
    LAMINAR_RETURN_IF_ERROR(writer_->write(async_grpo::Span{.process = who_, .kind = async_grpo::SpanKind::kPrefill,
                                                            .start_ns = t0, .end_ns = now_ns(), .version = current(),
                                                            .sequences = batch.size(), .tokens = tokens}));
    return finish_done();
  }

  // At EOS or its token limit: pushed by finish_done, or held while a migration moves it.
  static bool ended(const Live& l) {
    return (!l.seq.response_tokens.empty() && l.seq.response_tokens.back() == async_grpo::kEos) ||
           std::int32_t(l.seq.response_tokens.size()) >= l.max_tokens;
  }

  bool moving(laminar::SequenceId id) const {
    if (!migrator_) return false;
    const std::vector<laminar::SequenceId> m = migrator_->moving();
    return std::find(m.begin(), m.end(), id) != m.end();
  }

  Status step() {
    std::vector<laminar::SequenceState*> batch;
    for (Live& l : live_)
      if (!l.paused && !ended(l)) batch.push_back(&l.seq);
    // What ended while it was moving, and was then handed back or arrived here.
    if (batch.empty()) return finish_done();
    if (decode_start_ == 0) decode_start_ = now_ns();
    const std::int64_t t0 = now_ns();
    LAMINAR_RETURN_IF_ERROR(engine_->step(*cache_, batch));
    pace(t0);
    step_time_ = std::chrono::nanoseconds(now_ns() - t0);
    peak_pages_ = std::max(peak_pages_, std::int64_t(cache_->used_pages()));
    decode_tokens_ += batch.size();
    decode_max_seqs_ = std::max<std::uint64_t>(decode_max_seqs_, batch.size());
    if (now_ns() - decode_start_ > 50'000'000) flush_decode();  // one span per 50 ms of decoding
    return finish_done();
  }

  // --decode-step-ms: a step that began at t0 lasts at least that long, as on an accelerator whose
  // step latency hardly depends on the batch.
  void pace(std::int64_t t0) const {
    const std::int64_t until = t0 + std::int64_t(s_.decode_step_ms * 1e6);
    const std::int64_t left = until - now_ns();
    if (left > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(left));
  }

  void flush_decode() {
    if (decode_start_ == 0) return;
    (void)writer_->write(async_grpo::Span{.process = who_, .kind = async_grpo::SpanKind::kDecode,
                                          .start_ns = decode_start_, .end_ns = now_ns(), .version = current(),
                                          .sequences = decode_max_seqs_, .tokens = decode_tokens_});
    decode_start_ = 0;
    decode_tokens_ = decode_max_seqs_ = 0;
  }

  // Pushes every live sequence that ended (EOS or its token limit), rewarded by the verifier. One
  // a migration moves stays until the migration ends: its destination pushes it, or it comes back.
  Status finish_done() {
    std::vector<laminar::SequenceId> in_flight;
    if (migrator_) in_flight = migrator_->moving();
    for (std::size_t i = 0; i < live_.size();) {
      Live& l = live_[i];
      if (l.paused || !ended(l) ||
          std::find(in_flight.begin(), in_flight.end(), l.seq.sequence) != in_flight.end()) {
        ++i;
        continue;
      }
      const bool eos = !l.seq.response_tokens.empty() && l.seq.response_tokens.back() == async_grpo::kEos;
      if (l.seq.version.value() != current())
        return laminar::internal_error(fmt::format("{}: trajectory {} mixes versions {} and {}", who_,
                                                   l.seq.trajectory.value(), l.seq.version.value(), current()));
      laminar::Trajectory t;
      t.id = l.seq.trajectory;
      t.prompt_id = l.seq.prompt_id;
      t.group_id = l.seq.group_id;
      t.group_size = l.seq.group_size;
      t.sample_index = l.seq.sample_index;
      t.version = l.seq.version;
      t.prompt_tokens = l.seq.prompt_tokens;
      t.response_tokens = l.seq.response_tokens;
      t.logprobs = l.seq.logprobs;
      t.rewards = {task_->reward(l.prompt, t.response_tokens)};
      t.finish_reason = eos ? laminar::FinishReason::kStop : laminar::FinishReason::kLength;
      t.timings = {.generation_start_ns = l.start_ns, .generation_end_ns = now_ns()};
      LAMINAR_RETURN_IF_ERROR(cache_->release(l.seq.sequence));
      live_.erase(live_.begin() + std::ptrdiff_t(i));
      const std::uint64_t id = t.id.value();
      Status st = producer_->push(std::move(t));
      // A sample handed out again after this worker looked lost is already in the queue.
      if (!st.ok() && st.code() != laminar::StatusCode::kAlreadyExists) return st;
      if (moved_.contains(id)) moved_log_->write(fmt::format("push {}", id));
      ++pushed_;
    }
    return laminar::ok_status();
  }

  const Settings& s_;
  const RoleArgs& a_;
  std::string who_;
  std::optional<async_grpo::DigitTask> task_;
  std::optional<async_grpo::Engine> engine_;
  std::vector<laminar::NamedTensor> destinations_;
  std::optional<async_grpo::RecordWriter> writer_;
  std::optional<LineFile> hashes_;
  // Trajectories a migration moved out of or into this worker: each one's out, in and push lines.
  std::optional<LineFile> moved_log_;
  std::unordered_set<std::uint64_t> moved_;
  std::shared_ptr<laminar::Transport> transport_;
  std::shared_ptr<laminar::PagedKvCache> cache_;
  std::shared_ptr<laminar::KvMigrator> migrator_;
  std::unique_ptr<laminar::RepackDriver> driver_;
  std::map<laminar::MigrationId, std::int64_t> paused_at_;
  std::int32_t pages_ = 0;
  std::int64_t peak_pages_ = 0;
  laminar::Duration step_time_{0};
  bool taking_ = false;
  std::shared_ptr<laminar::RelayStore> store_;
  std::unique_ptr<laminar::RelayNode> node_;
  std::unique_ptr<laminar::WeightPuller> puller_;
  std::unique_ptr<async_grpo::PromptClient> client_;
  std::unique_ptr<laminar::RemoteProducer> producer_;
  std::vector<Live> live_;
  std::int64_t decode_start_ = 0;
  std::uint64_t decode_tokens_ = 0, decode_max_seqs_ = 0;
  std::uint64_t pushed_ = 0, pulls_ = 0;
};

// ---------------------------------------------------------------------------------------------
// The launcher.

using Child = examples::ChildProcess;

std::vector<std::string> settings_args(const Settings& s) {
  return {"--seed",          std::to_string(s.seed),          "--group-size", std::to_string(s.group_size),
          "--groups-per-step", std::to_string(s.groups_per_step), "--steps",      std::to_string(s.steps),
          "--minutes",       fmt::format("{}", s.minutes),    "--max-live",   std::to_string(s.max_live),
          "--max-staleness", std::to_string(s.max_staleness), "--kill-rollout-at", std::to_string(s.kill_rollout_at), "--in-flight-batches",
          fmt::format("{}", s.in_flight_batches), "--repack", s.repack ? "true" : "false", "--device", s.device,
          "--decode-step-ms", fmt::format("{}", s.decode_step_ms), "--lr-warmup-steps",
          std::to_string(s.lr_warmup_steps)};
}

Result<std::string> wait_address(const fs::path& file, Child& child) {
  const auto deadline = std::chrono::steady_clock::now() + 120s;
  while (std::chrono::steady_clock::now() < deadline) {
    if (path_exists(file)) {
      std::ifstream f(file);
      std::string address;
      std::getline(f, address);
      if (!address.empty()) return address;
    }
    if (child.exited()) return laminar::unavailable(fmt::format("{} exited with {}", child.name(), child.wait()));
    std::this_thread::sleep_for(20ms);
  }
  return laminar::deadline_exceeded(fmt::format("{} wrote no address in 120 s", child.name()));
}

// Reads each process's records; a killed worker's file may end in a torn line, which is dropped.
Result<async_grpo::Records> read_records_lenient(const fs::path& dir) {
  async_grpo::Records all;
  std::vector<fs::path> files;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == ".jsonl") files.push_back(e.path());
  if (ec) return laminar::not_found(fmt::format("cannot read {}: {}", dir.string(), ec.message()));
  std::sort(files.begin(), files.end());
  for (const fs::path& p : files) {
    std::ifstream f(p, std::ios::binary);
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    text.erase(text.find_last_of('\n') == std::string::npos ? 0 : text.find_last_of('\n') + 1);
    auto r = async_grpo::parse_records(text, p.string());
    if (!r.ok()) return r.status();
    all.append(std::move(*r));
  }
  return all;
}

std::map<std::uint64_t, std::string> read_hashes(const fs::path& file) {
  std::map<std::uint64_t, std::string> out;
  std::ifstream f(file);
  std::uint64_t v;
  std::string h;
  while (f >> v >> h) out[v] = h;
  return out;
}

struct CheckResult {
  std::string name;
  bool ok = false;
  std::string detail;
};

// Every migrated trajectory, from the rollouts' moved-*.txt: each migration that completed left its
// source once ("out") and arrived once ("in"), and the trajectory was pushed once, by the worker
// holding it at the end ("push"). With a worker killed, what it held goes out again from the
// PromptServer to workers that never saw it move, so only "at most once" holds then.
CheckResult check_moved(const fs::path& dir, int workers, bool killed) {
  struct Counts {
    int out = 0, in = 0, push = 0;
  };
  std::map<std::uint64_t, Counts> moved;
  for (int w = 0; w < workers; ++w) {
    std::ifstream f(dir / fmt::format("moved-rollout-{}.txt", w));
    std::string what;
    std::uint64_t id;
    while (f >> what >> id) {
      Counts& c = moved[id];
      (what == "out" ? c.out : what == "in" ? c.in : c.push) += 1;
    }
  }
  std::uint64_t migrations = 0, bad = 0;
  for (const auto& [id, c] : moved) {
    migrations += std::uint64_t(c.in);
    const bool ok = killed ? c.out <= c.in && c.push <= 1 : c.out == c.in && c.push == 1;
    bad += ok ? 0 : 1;
  }
  return {"moved_once", bad == 0,
          fmt::format("{} trajectories moved ({} arrivals); {} not moved out once, in once and pushed once{}",
                      moved.size(), migrations, bad, killed ? " (at most once: a worker was killed)" : "")};
}

// Every version the actor kept (<dir>/versions/<v>.bin), evaluated on the held-out prompts at its
// publish time (the end of its publish span); each file is removed once evaluated.
Result<std::vector<async_grpo::HeldOutPoint>> evaluate_versions(const Settings& s, const std::string& schedule,
                                                                const fs::path& dir, const async_grpo::Records& records) {
  std::map<std::uint64_t, std::int64_t> published_at;
  for (const async_grpo::Span& span : records.spans)
    if (span.process == "actor" && span.kind == async_grpo::SpanKind::kPublish) published_at[span.version] = span.end_ns;
  std::map<std::uint64_t, fs::path> files;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir / "versions", ec)) {
    const std::string stem = e.path().stem().string();
    if (e.path().extension() != ".bin" || stem.empty() || stem.find_first_not_of("0123456789") != std::string::npos)
      continue;
    files[std::stoull(stem)] = e.path();
  }
  if (ec) return laminar::not_found(fmt::format("cannot read {}: {}", (dir / "versions").string(), ec.message()));
  auto task = make_task(s);
  if (!task.ok()) return task.status();
  auto engine = async_grpo::Engine::create(async_grpo::PolicyConfig{});
  if (!engine.ok()) return engine.status();
  const std::vector<async_grpo::DigitPrompt> prompts = task->held_out_prompts(std::size_t(s.eval_prompts));
  async_grpo::Progress progress(laminar::Clock::steady(), std::cout, async_grpo::Progress::mode_for_stdout());
  LAMINAR_RETURN_IF_ERROR(progress.begin(schedule + " held-out eval", std::max<std::size_t>(files.size(), 1), "versions"));
  std::vector<async_grpo::HeldOutPoint> points;
  std::vector<std::byte> flat(engine->manifest().total_bytes());
  for (const auto& [version, file] : files) {
    auto at = published_at.find(version);
    if (at == published_at.end())
      return laminar::internal_error(fmt::format("version {} was kept but has no publish record", version));
    std::ifstream f(file, std::ios::binary);
    f.read(reinterpret_cast<char*>(flat.data()), std::streamsize(flat.size()));
    if (!f) return laminar::data_loss(fmt::format("{}: shorter than {} bytes", file.string(), flat.size()));
    LAMINAR_RETURN_IF_ERROR(engine->load_weights(flat));
    // One seed for every version and schedule: the versions differ only in their weights.
    auto r = async_grpo::evaluate_held_out(*engine, *task, prompts, {.seed = s.seed * 1000003 + 12345});
    if (!r.ok()) return r.status();
    points.push_back({.version = version, .time_ns = at->second, .reward = r->reward});
    fs::remove(file, ec);
    LAMINAR_RETURN_IF_ERROR(progress.update(points.size()));
  }
  LAMINAR_RETURN_IF_ERROR(progress.finish());
  return points;
}

struct ScheduleOutcome {
  async_grpo::ScheduleRun run;
  std::vector<CheckResult> checks;
};

// Versions from which reward_rises compares held-out reward rather than training reward.
constexpr std::size_t kHeldOutRiseVersions = 20;

Result<ScheduleOutcome> run_schedule(const Settings& s, const std::string& schedule, const fs::path& warm,
                                     const std::string& token) {
  const fs::path dir = fs::absolute(fs::path(s.out) / schedule);
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directories(dir / "records", ec);
  if (!ec) fs::create_directories(dir / "versions", ec);
  if (ec) return laminar::unavailable("cannot create " + dir.string());
  ScheduleOutcome outcome;
  outcome.run.schedule = schedule;
  outcome.run.rollout_workers = std::uint32_t(s.workers);
  outcome.run.start_ns = now_ns();
  std::vector<std::string> common = settings_args(s);
  common.insert(common.end(), {"--dir", dir.string(), "--token", token, "--run-schedule", schedule});
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), common.begin(), common.end());
    return extra;
  };
  std::vector<std::unique_ptr<Child>> children;
  auto actor = Child::spawn("actor", with({"--role", "actor", "--warm", warm.string()}));
  if (!actor.ok()) return actor.status();
  children.push_back(std::move(*actor));
  auto actor_address = wait_address(dir / "actor.addr", *children[0]);
  if (!actor_address.ok()) return actor_address.status();
  std::vector<std::string> relay_args;
  for (int r = 0; r < s.relays; ++r) {
    auto relay = Child::spawn(fmt::format("relay-{}", r), with({"--role", "relay", "--index", std::to_string(r),
                                                                "--actor", *actor_address}));
    if (!relay.ok()) return relay.status();
    children.push_back(std::move(*relay));
    auto address = wait_address(dir / fmt::format("relay-{}.addr", r), *children.back());
    if (!address.ok()) return address.status();
    relay_args.insert(relay_args.end(), {"--relay", *address});
  }
  const std::size_t first_rollout = children.size();
  for (int w = 0; w < s.workers; ++w) {
    std::vector<std::string> args = {"--role", "rollout", "--index", std::to_string(w), "--actor", *actor_address};
    args.insert(args.end(), relay_args.begin(), relay_args.end());
    auto rollout = Child::spawn(fmt::format("rollout-{}", w), with(args));
    if (!rollout.ok()) return rollout.status();
    children.push_back(std::move(*rollout));
  }

  async_grpo::Progress progress(laminar::Clock::steady(), std::cout, async_grpo::Progress::mode_for_stdout());
  // By steps, or by seconds under --minutes.
  const bool timed = s.minutes > 0;
  const std::uint64_t total = timed ? std::uint64_t(std::ceil(s.minutes * 60)) : std::uint64_t(s.steps);
  LAMINAR_RETURN_IF_ERROR(progress.begin(schedule, total, timed ? "s" : "steps"));
  const bool kill_one = s.kill_rollout_at > 0 && schedule == "laminar";
  bool killed = false;
  int actor_step = 0;
  std::vector<std::string> actor_lines;
  std::int64_t final_at = 0;  // when the actor's training ended
  bool stop_written = false;
  while (children[0]->fd() >= 0) {
    // After training: rollout workers leave on their own, then the actor and relays are told to stop.
    if (!stop_written && final_version(dir) > 0) {
      if (final_at == 0) final_at = now_ns();
      bool rollouts_left = true;
      for (std::size_t i = first_rollout; i < children.size(); ++i) rollouts_left = rollouts_left && children[i]->exited();
      if (!rollouts_left && now_ns() - final_at > std::int64_t(30e9)) {
        for (std::size_t i = first_rollout; i < children.size(); ++i)
          if (!children[i]->exited()) {
            std::cout << fmt::format("{} still running 30 s after training ended: SIGKILL\n", children[i]->name());
            children[i]->kill_now();
          }
        rollouts_left = true;
      }
      if (rollouts_left) {
        std::ofstream(dir / "stop") << "done\n";
        stop_written = true;
      }
    }
    std::vector<pollfd> fds;
    std::vector<Child*> who;
    for (auto& c : children)
      if (c->fd() >= 0) {
        fds.push_back({c->fd(), POLLIN, 0});
        who.push_back(c.get());
      }
    if (poll(fds.data(), fds.size(), 50) < 0 && errno != EINTR)
      return laminar::unavailable(fmt::format("poll: {}", std::strerror(errno)));
    if (timed)
      (void)progress.update(std::min<std::uint64_t>(std::uint64_t((now_ns() - outcome.run.start_ns) / 1'000'000'000), total));
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      std::vector<std::string> lines;
      who[i]->read_lines(lines);
      for (const std::string& line : lines) {
        // rollout-0 says when it starts samples: killed then, it dies holding them.
        if (kill_one && !killed && who[i] == children[first_rollout].get() && actor_step >= s.kill_rollout_at &&
            line.rfind("granted ", 0) == 0) {
          children[first_rollout]->kill_now();
          killed = true;
          std::cout << fmt::format("killed rollout-0 (pid {}) with SIGKILL after step {}, right after it was {}\n",
                                   children[first_rollout]->pid(), actor_step, line);
        }
        if (who[i] != children[0].get()) continue;
        actor_lines.push_back(line);
        if (std::sscanf(line.c_str(), "progress %d", &actor_step) == 1 && !timed)
          (void)progress.update(std::min<std::uint64_t>(std::uint64_t(actor_step), total));
      }
    }
  }
  const int actor_code = children[0]->wait();
  (void)progress.finish();
  outcome.run.end_ns = final_at > 0 ? final_at : now_ns();
  std::ofstream(dir / "stop") << "done\n";
  const auto grace = std::chrono::steady_clock::now() + 15s;
  std::vector<int> codes(children.size(), 0);
  for (std::size_t i = 1; i < children.size(); ++i) {
    while (!children[i]->exited() && std::chrono::steady_clock::now() < grace) std::this_thread::sleep_for(20ms);
    if (!children[i]->exited()) {
      std::cout << fmt::format("{} still running after the stop: SIGKILL\n", children[i]->name());
      children[i]->kill_now();
    }
    codes[i] = children[i]->wait();
  }
  if (actor_code != 0) return laminar::internal_error(fmt::format("the actor exited with {}", actor_code));

  for (const std::string& line : actor_lines) {
    char name[64], verdict[16];
    int consumed = 0;
    if (std::sscanf(line.c_str(), "check %63s %15s %n", name, verdict, &consumed) >= 2)
      outcome.checks.push_back({name, std::string(verdict) == "ok", line.substr(std::size_t(consumed))});
    else if (line.rfind("dispatch ", 0) == 0 || line.rfind("repack ", 0) == 0)
      std::cout << schedule << " " << line << "\n";
  }
  std::uint64_t reissued = 0, lost = 0;
  for (const std::string& line : actor_lines)
    if (line.rfind("dispatch ", 0) == 0) {
      auto field = [&](const std::string& key) -> std::uint64_t {
        const std::size_t at = line.find("\"" + key + "\":");
        return at == std::string::npos ? 0 : std::strtoull(line.c_str() + at + key.size() + 3, nullptr, 10);
      };
      reissued = field("reissued");
      lost = field("lost_workers");
    }
  bool exits_ok = true;
  std::string exits;
  for (std::size_t i = 1; i < children.size(); ++i) {
    const bool expected_kill = killed && i == first_rollout;
    exits_ok = exits_ok && (expected_kill ? codes[i] == 128 + SIGKILL : codes[i] == 0);
    exits += fmt::format("{}={} ", children[i]->name(), codes[i]);
  }
  outcome.checks.push_back({"exits", exits_ok, exits});
  if (kill_one)
    outcome.checks.push_back(
        {"killed_worker", killed && lost >= 1 && reissued >= 1,
         killed ? fmt::format("rollout-0 killed holding samples: {} lost worker(s), {} samples handed out again "
                              "(all_completed: none lost)",
                              lost, reissued)
                : "the run ended before the kill"});

  const auto published = read_hashes(dir / "published.txt");
  std::uint64_t pulls = 0, mismatches = 0;
  for (int w = 0; w < s.workers; ++w)
    for (const auto& [v, h] : read_hashes(dir / fmt::format("weights-rollout-{}.txt", w))) {
      ++pulls;
      auto it = published.find(v);
      if (it == published.end() || it->second != h) ++mismatches;
    }
  outcome.checks.push_back({"weights_bit_equal", pulls > 0 && mismatches == 0,
                            fmt::format("{} pulls hashed, {} differ from the actor's published bytes", pulls,
                                        mismatches)});

  if (schedule == "laminar" && s.repack) outcome.checks.push_back(check_moved(dir, s.workers, killed));

  auto records = read_records_lenient(dir / "records");
  if (!records.ok()) return records.status();
  outcome.run.records = std::move(*records);
  auto held_out = evaluate_versions(s, schedule, dir, outcome.run.records);
  if (!held_out.ok()) return held_out.status();
  outcome.run.held_out = std::move(*held_out);
  {
    const auto& h = outcome.run.held_out;
    const bool in_range =
        std::all_of(h.begin(), h.end(), [](const async_grpo::HeldOutPoint& p) { return p.reward >= 0 && p.reward <= 1; });
    std::string detail = fmt::format("{} of {} published versions evaluated on {} held-out prompts", h.size(),
                                     published.size(), s.eval_prompts);
    if (!h.empty()) detail += fmt::format(": version {} {:.3f}, version {} {:.3f}", h.front().version,
                                          h.front().reward, h.back().version, h.back().reward);
    outcome.checks.push_back({"held_out_eval", !h.empty() && h.size() == published.size() && in_range, detail});
  }
  const auto& h = outcome.run.held_out;
  const auto& rw = outcome.run.records.rewards;
  if (h.size() >= kHeldOutRiseVersions) {
    // Held-out reward scores every version on the same prompts and seed; a training step's reward
    // is one batch's and too noisy to compare two points of.
    double last = 0;
    for (std::size_t i = h.size() - 3; i < h.size(); ++i) last += h[i].reward / 3;
    outcome.checks.push_back({"reward_rises", last > h.front().reward,
                              fmt::format("held-out reward: version {} {:.3f}, mean of the last 3 versions {:.3f}",
                                          h.front().version, h.front().reward, last)});
  } else if (rw.size() >= 2) {
    // Too few versions for a held-out mean to stand out of its noise: the mean of the last third
    // of the training steps against the first.
    const std::size_t tail = std::max<std::size_t>(1, rw.size() / 3);
    double last = 0;
    for (std::size_t i = rw.size() - tail; i < rw.size(); ++i) last += rw[i].mean_reward / double(tail);
    outcome.checks.push_back({"reward_rises", last > rw.front().mean_reward,
                              fmt::format("training reward: first step {:.3f}, mean of the last {} steps {:.3f}",
                                          rw.front().mean_reward, tail, last)});
  }
  return outcome;
}

Status warm_up(const Settings& s, const fs::path& file) {
  auto task = make_task(s);
  if (!task.ok()) return task.status();
  async_grpo::TrainerOptions to;
  to.seed = s.seed;
  to.intra_op_threads = 1;
  auto trainer = async_grpo::Trainer::create(to);
  if (!trainer.ok()) return trainer.status();
  async_grpo::Progress progress(laminar::Clock::steady(), std::cout, async_grpo::Progress::mode_for_stdout());
  LAMINAR_RETURN_IF_ERROR(progress.begin("warm-up", std::uint64_t(s.warmup_steps), "steps"));
  // Prompts far past the ones the schedules deal, so RL sees prompts the warm-up did not.
  std::uint64_t next = async_grpo::kWarmupFirstPrompt;
  for (int i = 0; i < s.warmup_steps; ++i) {
    std::vector<async_grpo::DigitPrompt> prompts;
    for (int k = 0; k < s.warmup_batch; ++k) prompts.push_back(task->prompt(next++));
    auto st = (*trainer)->warmup_step(prompts);
    if (!st.ok()) return st.status();
    LAMINAR_RETURN_IF_ERROR(progress.update(std::uint64_t(i + 1)));
  }
  LAMINAR_RETURN_IF_ERROR(progress.finish());
  std::vector<std::byte> flat((*trainer)->manifest().total_bytes());
  LAMINAR_RETURN_IF_ERROR((*trainer)->save_weights(flat));
  std::ofstream f(file, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(flat.data()), std::streamsize(flat.size()));
  return f ? laminar::ok_status() : laminar::unavailable("cannot write " + file.string());
}

int run_launcher(Settings s) {
  if (s.short_run) {
    s.workers = 3;
    s.steps = 10;
    s.warmup_steps = 20;
    s.groups_per_step = 4;
    s.group_size = 8;
    s.kill_rollout_at = 3;
    if (s.schedule == "compare" || s.schedule == "all") s.schedule = "laminar";
  }
  if (s.device == "cuda" && s.repack && s.schedule != "sync" && s.schedule != "one-step") {
    std::fprintf(stderr, "async_grpo: --device cuda needs --repack false: the repack migrates host KV pools\n");
    return 2;
  }
  std::error_code ec;
  fs::create_directories(s.out, ec);
  if (ec) return fail("launcher", "out", laminar::unavailable("cannot create " + s.out));
  std::random_device rd;
  const std::string token = fmt::format("async-grpo-{:08x}{:08x}{:08x}{:08x}", rd(), rd(), rd(), rd());
  const fs::path warm = fs::absolute(fs::path(s.out) / "warmup.bin");
  if (Status st = warm_up(s, warm); !st.ok()) return fail("launcher", "warm-up", st);

  const bool several = s.schedule == "compare" || s.schedule == "all";
  std::vector<std::string> schedules = {s.schedule};
  if (s.schedule == "compare") schedules = {"sync", "laminar"};
  if (s.schedule == "all") schedules = {"sync", "one-step", "laminar"};
  std::vector<async_grpo::ScheduleRun> runs;
  bool all_ok = true;
  for (const std::string& schedule : schedules) {
    Settings run = s;
    // Each contender trains for as long as the baseline took, not for as many steps: time to the
    // target is the comparison, and a schedule that steps faster must get to use that time.
    if (several && s.minutes == 0 && !runs.empty()) {
      run.minutes = double(runs.front().end_ns - runs.front().start_ns) / 60e9;
      run.steps = 4 * s.steps;
    }
    auto outcome = run_schedule(run, schedule, warm, token);
    if (!outcome.ok()) return fail("launcher", schedule, outcome.status());
    std::cout << fmt::format("{}: {:.1f} s wall\n", schedule,
                             double(outcome->run.end_ns - outcome->run.start_ns) / 1e9);
    for (const CheckResult& c : outcome->checks) {
      std::cout << fmt::format("  check {:<20} {}  {}\n", c.name, c.ok ? "ok  " : "FAIL", c.detail);
      all_ok = all_ok && c.ok;
    }
    runs.push_back(std::move(outcome->run));
  }
  async_grpo::ReportOptions ro;
  ro.decode_step_ms = s.decode_step_ms;
  if (schedules.size() == 1) ro.baseline = ro.contender = schedules[0];
  auto files = async_grpo::write_report(runs, ro, s.out);
  if (!files.ok()) return fail("launcher", "report", files.status());
  std::cout << "\n" << files->table;
  if (!files->plot_note.empty()) std::cout << files->plot_note << "\n";
  std::cout << fmt::format("report in {}: table.txt, metrics.json, trace_<schedule>.json, plots\n", s.out);
  std::cout << (all_ok ? "all checks passed\n" : "some checks FAILED\n");
  return all_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Asynchronous GRPO end to end: a libtorch actor, relay processes and rollout workers"};
  Settings s;
  RoleArgs a;
  app.add_option("--schedule", s.schedule,
                 "sync, one-step, laminar, compare (sync then laminar) or all (sync, one-step, then laminar)")
      ->check(CLI::IsMember({"sync", "one-step", "laminar", "compare", "all"}));
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
  app.add_option("--eval-prompts", s.eval_prompts, "held-out prompts each published version is evaluated on")
      ->check(CLI::Range(1, 100000));
  app.add_option("--decode-step-ms", s.decode_step_ms,
                 "each rollout decode or prefill step takes at least this long (emulates an accelerator's step latency)")
      ->check(CLI::Range(0.0, 10000.0));
  app.add_option("--max-live", s.max_live, "sequences one rollout worker decodes at once")->check(CLI::Range(1, 256));
  app.add_option("--max-staleness", s.max_staleness, "laminar: versions a worker's weights may lag")
      ->check(CLI::Range(0, 16));
  app.add_option("--in-flight-batches", s.in_flight_batches,
                 "laminar: samples handed out and not yet trained, in batches (1: the next batch is "
                 "generated while the current one trains)")
      ->check(CLI::Range(0.1, 64.0));
  app.add_option("--repack", s.repack, "laminar: repack sequences across rollout workers (KvMigrator)");
  app.add_option("--kill-rollout-at", s.kill_rollout_at, "laminar: SIGKILL rollout 0 after this step (0: never)")
      ->check(CLI::Range(0, 100000));
  app.add_option("--out", s.out, "directory of the report and each schedule's records");
  app.add_option("--device", s.device, "where rollout engines run: cpu, or cuda (a build with CUDA)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_flag("--short", s.short_run, "the CI configuration: laminar, small, one worker killed, under a minute");
  app.add_option("--role", a.role, "")->group("")->check(CLI::IsMember({"actor", "relay", "rollout"}));
  app.add_option("--index", a.index, "")->group("");
  app.add_option("--dir", a.dir, "")->group("");
  app.add_option("--token", a.token, "")->group("");
  app.add_option("--actor", a.actor, "")->group("");
  app.add_option("--relay", a.relays, "")->group("");
  app.add_option("--warm", a.warm, "")->group("");
  app.add_option("--run-schedule", a.run_schedule, "")->group("");
  CLI11_PARSE(app, argc, argv);

  if (a.role == "actor") return run_actor(s, a);
  if (a.role == "relay") return run_relay(a);
  if (a.role == "rollout") return Rollout(s, a).run();
  return run_launcher(s);
}
