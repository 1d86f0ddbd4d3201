// The actor: queue server, head relay, rollout dispatcher, repack coordinator and the trainer. It
// publishes each version, trains on what the rollout workers push, re-scores what it trained on,
// and prints its checks for the launcher.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "blas.h"
#include "engine.h"
#include "laminar/relay_node.h"
#include "laminar/relay_store.h"
#include "laminar/remote_trajectory_queue.h"
#include "laminar/repack_coordinator.h"
#include "laminar/rollout_dispatcher.h"
#include "laminar/trajectory_queue.h"
#include "policy_config.h"
#include "records.h"
#include "roles.h"
#include "trainer.h"

namespace async_grpo {

namespace fs = std::filesystem;
using laminar::Result;
using laminar::Status;
using namespace std::chrono_literals;

namespace {

// What the actor keeps with each checkpoint besides the trainer's state (Trainer::save_checkpoint's
// host_state): what a restarted actor needs to train every sample exactly once.
struct ActorState {
  std::uint64_t steps = 0;    // training steps in the checkpoint's weights
  std::uint64_t trained = 0;  // samples trained into them
  // Those trained since the checkpoint before: their batches are acked only once this checkpoint
  // is saved, so a restart may find them in the queue's log again.
  std::vector<std::uint64_t> last_trained;
  laminar::DispatcherSnapshot dispatch;
};

struct WorkerCheck {
  bool ok = false;
  std::string detail;
};

// Every version a worker pulled (<dir>/weights-rollout-<w>.txt) is the one published under its
// number (<dir>/published.txt), bit for bit.
WorkerCheck check_weights(const fs::path& dir, int workers) {
  const auto published = read_hashes(dir / "published.txt");
  std::uint64_t pulls = 0, mismatches = 0;
  for (int w = 0; w < workers; ++w)
    for (const auto& [v, h] : read_hashes(dir / fmt::format("weights-rollout-{}.txt", w))) {
      ++pulls;
      auto it = published.find(v);
      if (it == published.end() || it->second != h) ++mismatches;
    }
  return {pulls > 0 && mismatches == 0,
          fmt::format("{} pulls hashed, {} differ from the actor's published bytes", pulls, mismatches)};
}

// Every migrated trajectory, from the workers' moved-rollout-<w>.txt: each migration that completed
// left its source once ("out") and arrived once ("in"), and the trajectory was pushed once, by the
// worker holding it at the end ("push"). Once the dispatcher has handed samples out again (a worker
// killed, cut off or silent past its lease), two workers may decode one, move it and push it (the
// queue refuses the later copy: trained_once), so only "no sample left a worker without arriving
// at another" holds then.
WorkerCheck check_moved(const fs::path& dir, int workers, bool handed_out_again) {
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
  std::string examples;
  for (const auto& [id, c] : moved) {
    migrations += std::uint64_t(c.in);
    const bool ok = handed_out_again ? c.out <= c.in : c.out == c.in && c.push == 1;
    if (!ok && ++bad <= 4) examples += fmt::format("; {}: out {}, in {}, pushed {}", id, c.out, c.in, c.push);
  }
  const std::string rule = handed_out_again ? "samples were handed out again, so a copy may move and be pushed "
                                              "twice; {} moved out more often than they arrived"
                                            : "{} not moved out once, in once and pushed once";
  return {bad == 0, fmt::format("{} trajectories moved ({} arrivals); ", moved.size(), migrations) +
                        fmt::format(fmt::runtime(rule), bad) + examples};
}

// u64 steps, u64 trained, u64 n, n u64 ids, then the dispatcher's snapshot (its own bytes).
std::vector<std::byte> encode_state(const ActorState& st) {
  const std::uint64_t head[3] = {st.steps, st.trained, st.last_trained.size()};
  std::vector<std::byte> out(sizeof(head) + 8 * st.last_trained.size());
  std::memcpy(out.data(), head, sizeof(head));
  if (!st.last_trained.empty()) std::memcpy(out.data() + sizeof(head), st.last_trained.data(), 8 * st.last_trained.size());
  const std::vector<std::byte> d = st.dispatch.encode();
  out.insert(out.end(), d.begin(), d.end());
  return out;
}

Result<ActorState> decode_state(std::span<const std::byte> b) {
  std::uint64_t head[3] = {};
  if (b.size() < sizeof(head))
    return laminar::data_loss(fmt::format("the checkpoint's actor state is {} bytes, short of its header", b.size()));
  std::memcpy(head, b.data(), sizeof(head));
  const std::uint64_t n = head[2];
  if (n > (b.size() - sizeof(head)) / 8)
    return laminar::data_loss(fmt::format("the checkpoint's actor state lists {} ids in {} bytes", n, b.size()));
  ActorState st{head[0], head[1], std::vector<std::uint64_t>(n), {}};
  if (n > 0) std::memcpy(st.last_trained.data(), b.data() + sizeof(head), 8 * n);
  auto d = laminar::DispatcherSnapshot::decode(b.subspan(sizeof(head) + 8 * n));
  if (!d.ok()) return d.status().with_context("the checkpoint's actor state");
  st.dispatch = std::move(*d);
  return st;
}

// The port of the "host:port" the actor listened on before (its actor.addr): a restarted actor
// listens there again, where its relays and workers reconnect.
Result<std::uint16_t> previous_port(const fs::path& dir) {
  std::ifstream f(dir / "actor.addr");
  std::string address;
  std::getline(f, address);
  const auto colon = address.rfind(':');
  const int port = colon == std::string::npos ? 0 : std::atoi(address.c_str() + colon + 1);
  if (port <= 0 || port > 65535)
    return laminar::not_found(fmt::format("no earlier address in {}: '{}'", (dir / "actor.addr").string(), address));
  return std::uint16_t(port);
}

}  // namespace

int run_actor(const Settings& s, const RoleArgs& a) {
  const fs::path dir = a.dir;
  {
    std::error_code ec;
    fs::create_directories(dir / "records", ec);
    if (!ec) fs::create_directories(dir / "versions", ec);
    if (ec) return fail("actor", "directory", laminar::unavailable("cannot create " + dir.string() + ": " + ec.message()));
  }
  // With checkpoints the queue keeps a write-ahead log beside them: a restarted actor (--resume)
  // takes back from it every sample pushed and not yet in a checkpoint.
  const fs::path checkpoint_path = dir / "checkpoint";
  const fs::path wal_path = dir / "queue.wal";
  if (a.resume && s.checkpoint_every <= 0)
    return fail("actor", "resume", laminar::invalid_argument("--resume needs --checkpoint-every: there is no checkpoint"));
  // Killed after its last version went out, the actor had nothing left to train.
  if (const std::uint64_t last = a.resume ? final_version(dir) : 0; last > 0) {
    std::printf("the run had ended before the actor died: version %llu is its last; nothing to resume\n",
                static_cast<unsigned long long>(last));
    return 0;
  }
  if (!a.resume && (path_exists(checkpoint_path) || path_exists(wal_path)))
    return fail("actor", "directory",
                laminar::failed_precondition(dir.string() + " holds an earlier actor's checkpoint or queue log: start "
                                             "with --resume to go on from it, or use a new directory"));
  // Started on its own, without the launcher's warmed-up weights: the same warm-up, here.
  const std::string warm = a.warm.empty() ? (dir / "warmup.bin").string() : a.warm;
  if (a.warm.empty() && !a.resume)
    if (Status st = warm_up(s, warm); !st.ok()) return fail("actor", "warm-up", st);
  fs::path records = dir / "records" / "actor.jsonl";
  for (int k = 1; a.resume && path_exists(records); ++k) records = dir / "records" / fmt::format("actor-resumed-{}.jsonl", k);
  auto writer = async_grpo::RecordWriter::open(records);
  if (!writer.ok()) return fail("actor", "records", writer.status());
  const std::map<std::uint64_t, std::string> published_before =
      a.resume ? read_hashes(dir / "published.txt") : std::map<std::uint64_t, std::string>{};
  LineFile published(dir / "published.txt", /*append=*/a.resume);
  auto transport = make_transport(a.token);
  if (!transport.ok()) return fail("actor", "transport", transport.status());
  auto host = listen_host(a.host);
  if (!host.ok()) return fail("actor", "host", host.status());
  std::uint16_t port = 0;
  if (a.resume) {
    auto p = previous_port(dir);
    if (!p.ok()) return fail("actor", "resume", p.status());
    port = *p;
  }

  const std::uint32_t G = std::uint32_t(s.group_size);
  const std::size_t batch_size = std::size_t(s.groups_per_step) * G;
  laminar::TrajectoryQueueOptions qo;
  qo.group_timeout = laminar::kForever;  // a lost worker's samples are generated again elsewhere
  if (s.checkpoint_every > 0) qo.wal_path = wal_path.string();
  auto queue = laminar::TrajectoryQueue::create(qo);
  if (!queue.ok()) return fail("actor", "queue", queue.status());
  std::shared_ptr<laminar::TrajectoryQueue> q = std::move(*queue);

  async_grpo::TrainerOptions to;
  to.seed = s.seed;
  to.intra_op_threads = 1;
  to.learning_rate_warmup_steps = s.lr_warmup_steps;
  auto trainer_or = async_grpo::Trainer::create(to);
  if (!trainer_or.ok()) return fail("actor", "trainer", trainer_or.status());
  async_grpo::Trainer& trainer = **trainer_or;
  // What the trainer really runs on, for the report; the launcher repeats a warning.
  const async_grpo::BlasInfo blas = async_grpo::loaded_blas();
  std::printf("blas %s\n", blas.describe().c_str());
  if (!blas.warning().empty()) std::printf("blas-warning %s\n", blas.warning().c_str());
  ActorState resumed;
  std::uint64_t resumed_version = 0;
  double load_ms = 0;
  if (a.resume) {
    const std::int64_t t0 = now_ns();
    auto ck = trainer.load_checkpoint(checkpoint_path);
    if (!ck.ok()) return fail("actor", "checkpoint", ck.status());
    auto st = decode_state(ck->host_state);
    if (!st.ok()) return fail("actor", "checkpoint", st.status());
    resumed = std::move(*st);
    resumed_version = ck->version;
    load_ms = double(now_ns() - t0) / 1e6;
  } else {
    std::ifstream f(warm, std::ios::binary);
    std::vector<std::byte> flat(trainer.manifest().total_bytes());
    f.read(reinterpret_cast<char*>(flat.data()), std::streamsize(flat.size()));
    if (!f) return fail("actor", "warm-up weights", laminar::not_found("cannot read " + warm));
    if (Status st = trainer.load_weights(flat); !st.ok()) return fail("actor", "warm-up weights", st);
  }
  auto store = laminar::RelayStore::create();
  if (!store.ok()) return fail("actor", "relay store", store.status());
  std::shared_ptr<laminar::RelayStore> relay = std::move(*store);
  auto head = laminar::RelayNode::create(*transport, relay, {});
  if (!head.ok()) return fail("actor", "relay node", head.status());
  // Before the dispatcher, which tells it the queue until the dispatcher is gone.
  std::unique_ptr<laminar::RepackCoordinator> coordinator;
  if (a.run_schedule == "laminar" && s.repack) {
    laminar::RepackCoordinatorOptions co;
    co.tokens_per_page = Settings::kPageSize;
    // A batch's tail lasts some paced decode steps: the drivers report a change at most every
    // 50 ms, and a plan follows each change, at most one every 2 ms. A worker not heard from for
    // 3 s is left out; the drivers keep alive every second, an idle one (a destination) included.
    co.min_plan_interval = 2ms;
    co.stale_after = 3s;
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

  const std::string& sched = a.run_schedule;
  laminar::RolloutDispatcherOptions po;
  po.group_size = G;
  po.seed = s.seed;
  po.lease = std::chrono::seconds(10);
  if (a.resume) {
    po.resume = resumed.dispatch;
    // The workers try again at most every 2 s while the actor is away.
    po.claim_window = std::chrono::seconds(3);
  }
  if (sched == "one-step") {
    po.rule = laminar::AdmissionRule::one_step_ahead();
  } else if (sched == "laminar" || sched == "areal") {
    const auto in_flight = std::max<std::uint64_t>(G, std::uint64_t(s.in_flight_batches * double(batch_size)));
    po.rule = sched == "laminar" ? laminar::AdmissionRule::stream(std::uint64_t(s.max_staleness), in_flight)
                                 : laminar::AdmissionRule::interruptible(std::uint64_t(s.max_staleness), in_flight);
  }
  if (coordinator) {
    // The prompts a freed worker would start, which the cost-aware rule weighs (the paper's, used
    // here, does not; its stats show the count). Capped at the coordinator's bound, 2^40: already
    // more than any fleet's free slots.
    po.on_available = [c = coordinator.get()](std::uint64_t n) {
      (void)c->set_prompts_waiting(std::int64_t(std::min<std::uint64_t>(n, std::uint64_t(1) << 40)));
    };
  }
  auto dispatch = laminar::RolloutDispatcher::create(*transport, po);
  if (!dispatch.ok()) return fail("actor", "dispatcher", dispatch.status());
  laminar::RolloutDispatcher& server = **dispatch;
  // What the queue's log gave back reached the queue before the restart: completed. The snapshot
  // already has some of them (those in the queue when it was taken), which the dispatcher counts
  // as duplicates.
  std::uint64_t recovered_known = 0;
  for (laminar::TrajectoryId id : q->recovered_ids()) {
    auto c = server.completed(id);
    if (!c.ok()) return fail("actor", "recovered trajectory", c.status());
    recovered_known += c->duplicate ? 1 : 0;
  }
  // A sample is complete once the queue holds it, before its worker hears so: a worker may stop
  // listing it then, and it is not handed out again while it waits for its group or the trainer.
  std::atomic<std::uint64_t> completion_errors{0};
  laminar::TrajectoryQueueServerOptions qso;
  qso.on_accepted = [&server, &completion_errors](std::span<const laminar::TrajectoryId> ids) {
    for (laminar::TrajectoryId id : ids)
      if (!server.completed(id).ok()) completion_errors.fetch_add(1);
  };
  auto qserver = laminar::TrajectoryQueueServer::create(*transport, q, std::move(qso));
  if (!qserver.ok()) return fail("actor", "queue server", qserver.status());


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
    LAMINAR_RETURN_IF_ERROR(server.publish(v));
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
  bool resumed_bit_equal = false;
  if (a.resume) {
    // The dead actor published up to `newest`, and may have trained past the checkpoint: its
    // weights go out again as the checkpoint's own version when that is the newest, or else as a
    // new one, so that no version number names two sets of weights.
    const std::uint64_t newest = published_before.empty() ? 0 : published_before.rbegin()->first;
    if (Status st = trainer.save_weights(flat); !st.ok()) return fail("actor", "checkpoint", st);
    auto it = published_before.find(resumed_version);
    resumed_bit_equal = it != published_before.end() && it->second == fmt::format("{:016x}", weight_hash(flat));
    v = laminar::Version(newest > resumed_version ? newest + 1 : resumed_version);
    // The versions the workers may still push samples of, for the re-scoring.
    for (std::uint64_t u = newest > 7 ? newest - 7 : 1; u <= newest; ++u) {
      std::ifstream f(dir / "versions" / fmt::format("{}.bin", u), std::ios::binary);
      std::vector<std::byte> bytes(flat.size());
      if (f.read(reinterpret_cast<char*>(bytes.data()), std::streamsize(bytes.size()))) recent[u] = std::move(bytes);
    }
  }
  if (Status st = publish(v); !st.ok()) return fail("actor", "publish", st);
  const std::uint64_t resumed_as = v.value();
  // Only now, with every server in place: the workers of a restarted actor connect the moment its
  // port opens, and a question nothing serves yet is refused for good.
  auto address = (*transport)->listen(*host, port);
  if (!address.ok()) return fail("actor", "listen", address.status());
  if (a.resume) {
    std::printf("resumed from version %llu as %llu: checkpoint loaded in %.0f ms, %llu samples back from the "
                "queue's log\n",
                static_cast<unsigned long long>(resumed_version), static_cast<unsigned long long>(resumed_as), load_ms,
                static_cast<unsigned long long>(q->recovery().recovered));
    std::fflush(stdout);
  }
  if (Status st = write_address(dir, "actor", *address); !st.ok()) return fail("actor", "address", st);

  // The sync and one-step rules hand out only what open() made; the streams make their own.
  if (sched != "laminar" && sched != "areal")
    if (auto r = server.open(std::uint64_t(s.groups_per_step)); !r.ok()) return fail("actor", "open", r.status());

  std::unordered_set<std::uint64_t> trained_ids;
  std::uint64_t duplicate_trained = 0, partial_groups = 0, on_policy = 0;
  double max_lp_diff = 0, sum_lp_diff = 0;
  std::uint64_t lp_tokens = 0, rescored = 0, rescore_differs = 0, not_rescored = 0, mixed = 0;
  auto rescore = [&](std::span<const laminar::Trajectory> ts) -> Status {
    std::vector<const laminar::Trajectory*> order;
    for (const laminar::Trajectory& t : ts) order.push_back(&t);
    std::sort(order.begin(), order.end(), [](auto* x, auto* y) { return x->version < y->version; });
    for (const laminar::Trajectory* t : order) {
      // Interrupted under areal: its tokens came from several versions (the metadata says which),
      // so no one version's prefill gives its log-probs back.
      if (!t->metadata.empty()) {
        ++mixed;
        continue;
      }
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
  // The checkpoints saved, their time, and the version and weight hash of the last.
  std::uint64_t checkpoints = 0;
  std::int64_t checkpoint_ns = 0;
  std::pair<std::uint64_t, std::uint64_t> checkpoint_hash{0, 0};
  const std::int64_t train_start = now_ns();
  const auto deadline_ns = s.minutes > 0 ? train_start + std::int64_t(s.minutes * 60e9) : INT64_MAX;
  // With checkpoints a batch is acked once the checkpoint that holds its training is saved: the
  // queue's log keeps it until then, for a restart to train it again.
  std::vector<laminar::BatchId> unacked;
  std::vector<std::uint64_t> since_checkpoint;  // their trajectory ids
  const std::unordered_set<std::uint64_t> in_checkpoint(resumed.last_trained.begin(), resumed.last_trained.end());
  std::uint64_t left_out = 0;  // of those, given back by the log again: not trained twice
  int step = int(resumed.steps);
  for (; step < s.steps && now_ns() < deadline_ns; ++step) {
    laminar::BatchSpec spec;
    spec.max_trajectories = spec.min_trajectories = batch_size;
    spec.wait = std::chrono::seconds(120);
    spec.consumer_version = v;
    if (s.checkpoint_every > 0) spec.lease = laminar::kForever;
    const std::int64_t wait0 = now_ns();
    Result<laminar::Batch> batch = q->pop_batch(spec);
    if (!batch.ok()) return fail("actor", "pop_batch", batch.status());
    (void)writer->write(async_grpo::Span{.process = "actor", .kind = async_grpo::SpanKind::kIdleWait,
                                         .start_ns = wait0, .end_ns = now_ns(), .version = v.value()});
    std::span<const laminar::Trajectory> ts = batch->trajectories();
    std::vector<laminar::Trajectory> kept;
    if (!in_checkpoint.empty()) {
      for (const laminar::Trajectory& t : ts)
        if (in_checkpoint.contains(t.id.value())) ++left_out; else kept.push_back(t);
      ts = kept;
      if (ts.empty()) {
        if (Status st = q->ack(batch->id()); !st.ok()) return fail("actor", "ack", st);
        --step;
        continue;
      }
    }
    std::map<laminar::GroupId, std::uint32_t> group_count;
    std::vector<laminar::Trajectory> current;
    double reward = 0;
    for (const laminar::Trajectory& t : ts) {
      if (!trained_ids.insert(t.id.value()).second) ++duplicate_trained;
      ++group_count[t.group_id];
      reward += t.rewards[0] / double(ts.size());
      if (t.version == v) current.push_back(t);
      (void)writer->write(async_grpo::TrajectoryFact{.behaviour_version = t.version.value(),
                                                     .trained_version = v.value(),
                                                     .length = t.response_tokens.size(),
                                                     .group = t.group_id.value()});
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
      if (auto r = server.open(std::uint64_t(s.groups_per_step)); !r.ok()) return fail("actor", "open", r.status());
    const std::int64_t t0 = now_ns();
    auto stats = trainer.train_step(ts);
    if (!stats.ok()) return fail("actor", "train_step", stats.status());
    (void)writer->write(async_grpo::Span{.process = "actor", .kind = async_grpo::SpanKind::kTrain, .start_ns = t0,
                                         .end_ns = now_ns(), .version = v.value(), .sequences = ts.size(),
                                         .tokens = std::uint64_t(stats->tokens)});
    if (s.checkpoint_every > 0) {
      unacked.push_back(batch->id());
      for (const laminar::Trajectory& t : ts) since_checkpoint.push_back(t.id.value());
    } else if (Status st = q->ack(batch->id()); !st.ok()) {
      return fail("actor", "ack", st);
    }
    (void)writer->write(async_grpo::RewardPoint{.time_ns = now_ns(), .version = v.value(), .mean_reward = reward,
                                                .samples = ts.size()});
    v = laminar::Version(v.value() + 1);
    if (Status st = publish(v); !st.ok()) return fail("actor", "publish", st);
    if (s.checkpoint_every > 0 && v.value() % std::uint64_t(s.checkpoint_every) == 0) {
      const std::int64_t c0 = now_ns();
      const ActorState state{std::uint64_t(step + 1), resumed.trained + trained_ids.size(), since_checkpoint,
                             server.snapshot()};
      if (Status st = trainer.save_checkpoint(checkpoint_path, v.value(), encode_state(state)); !st.ok())
        return fail("actor", "checkpoint", st);
      for (laminar::BatchId id : unacked)
        if (Status st = q->ack(id); !st.ok()) return fail("actor", "ack", st);
      unacked.clear();
      since_checkpoint.clear();
      checkpoint_ns += now_ns() - c0;
      ++checkpoints;
      if (auto it = recent.find(v.value()); it != recent.end()) checkpoint_hash = {v.value(), weight_hash(it->second)};
    }
    if (sched == "sync" && step + 1 < s.steps)
      if (auto r = server.open(std::uint64_t(s.groups_per_step)); !r.ok()) return fail("actor", "open", r.status());
    std::printf("progress %d reward %.3f\n", step + 1, reward);
    std::fflush(stdout);
  }

  // Training is over: nothing more goes into a checkpoint.
  for (laminar::BatchId id : unacked)
    if (Status st = q->ack(id); !st.ok()) return fail("actor", "ack", st);
  // The stream's groups still out: let them finish, and take what the queue holds, so every sample
  // made reaches the queue and leaves it once.
  if (Status st = server.set_rule(laminar::AdmissionRule::sync()); !st.ok()) return fail("actor", "rule", st);
  std::uint64_t drained = 0;
  const std::int64_t drain_deadline = now_ns() + std::int64_t(60e9);
  while (now_ns() < drain_deadline) {
    const bool all_in = server.stats().groups_done == server.stats().groups_made;
    laminar::BatchSpec spec;
    spec.max_trajectories = batch_size;
    spec.min_trajectories = 1;
    spec.wait = all_in ? laminar::Duration(0) : laminar::Duration(std::chrono::seconds(1));
    spec.consumer_version = v;
    Result<laminar::Batch> batch = q->pop_batch(spec);
    if (!batch.ok()) {
      // Nothing ready: kUnavailable without a wait, kDeadlineExceeded after one.
      const laminar::StatusCode code = batch.status().code();
      if (code != laminar::StatusCode::kUnavailable && code != laminar::StatusCode::kDeadlineExceeded)
        return fail("actor", "drain", batch.status());
      if (all_in) break;
      continue;
    }
    for (const laminar::Trajectory& t : batch->trajectories()) {
      if (!trained_ids.insert(t.id.value()).second) ++duplicate_trained;
      ++drained;
    }
    if (Status st = q->ack(batch->id()); !st.ok()) return fail("actor", "ack", st);
  }
  // The last version is published: workers leave once their stores hold it, so no relay is still
  // writing into their memory when they free it.
  if (Status st = write_address(dir, "final", std::to_string(v.value())); !st.ok()) return fail("actor", "final", st);

  const laminar::RolloutDispatcherStats ds = server.stats();
  auto check = [](const char* name, bool ok, const std::string& detail) {
    std::printf("check %s %s %s\n", name, ok ? "ok" : "FAIL", detail.c_str());
  };
  // Counted over the run, the checkpoint this actor resumed from included.
  const std::uint64_t trained_all = resumed.trained + trained_ids.size();
  check("trained_once", duplicate_trained == 0 && ds.duplicates == recovered_known && trained_all == ds.completed,
        fmt::format("{} samples reached the trainer, {} twice, of {} the queue took; dispatch duplicates {}{}",
                    trained_all, duplicate_trained, ds.completed, ds.duplicates,
                    a.resume ? fmt::format(" ({} of them completions the queue's log gave back again)", recovered_known)
                             : std::string()));
  if (a.resume)
    check("resumed", resumed_bit_equal && q->recovery().tail.ok(),
          fmt::format("from the checkpoint of version {} (step {}, loaded in {:.0f} ms), its weights {} the ones "
                      "published as {}, training went on as version {}; the queue's log gave back {} samples ({} "
                      "trained into the checkpoint already, left out), tail {}; the dispatcher adopted {} groups "
                      "made after its snapshot",
                      resumed_version, resumed.steps, load_ms, resumed_bit_equal ? "bit-equal to" : "DIFFERENT from",
                      resumed_version, resumed_as, q->recovery().recovered, left_out,
                      q->recovery().tail.ok() ? "whole" : q->recovery().tail.to_string(), ds.adopted_groups));
  check("all_completed",
        ds.groups_done == ds.groups_made && ds.completed == ds.groups_made * G && completion_errors.load() == 0,
        fmt::format("groups made {} done {}, samples completed {}, drained after the last step {}, reissued {}, "
                    "lost workers {}, completions refused {}",
                    ds.groups_made, ds.groups_done, ds.completed, drained, ds.reissued, ds.lost_workers,
                    completion_errors.load()));
  check("whole_groups", partial_groups == 0, fmt::format("{} groups trained without all {} samples", partial_groups, G));
  check("rescore_bit_equal", rescored > 0 && rescore_differs == 0,
        fmt::format("{} trained samples re-scored by laminar's prefill under their version, {} differ, {} "
                    "not re-scored (version no longer kept), {} mixed-version (interrupted) left out",
                    rescored, rescore_differs, not_rescored, mixed));
  check("behaviour_logprobs", on_policy == 0 || max_lp_diff < 1e-2,
        fmt::format("{} on-policy samples recomputed, {} tokens: |rollout - actor recompute| max {:.3g} mean {:.3g}", on_policy,
                    lp_tokens, max_lp_diff, lp_tokens ? sum_lp_diff / double(lp_tokens) : 0.0));
  if (checkpoints > 0) {
    // What a restarted actor would load: a new trainer from the last checkpoint holds the weights
    // published as its version, bit for bit.
    std::string detail = fmt::format("{} saved, {:.1f} ms each; ", checkpoints, double(checkpoint_ns) / 1e6 / double(checkpoints));
    bool ok = false;
    auto restored = async_grpo::Trainer::create(to);
    if (restored.ok()) {
      auto loaded = (*restored)->load_checkpoint(checkpoint_path);
      std::vector<std::byte> bytes((*restored)->manifest().total_bytes());
      if (loaded.ok() && (*restored)->save_weights(bytes).ok()) {
        ok = loaded->version == checkpoint_hash.first && weight_hash(bytes) == checkpoint_hash.second;
        detail += fmt::format("the last (version {}) loads back {} the published weights", loaded->version,
                              ok ? "bit-equal to" : "DIFFERENT from");
      } else {
        detail += "the last does not load: " + (loaded.ok() ? std::string("no weights") : loaded.status().to_string());
      }
    } else {
      detail += "no trainer to load it into: " + restored.status().to_string();
    }
    check("checkpoint", ok, detail);
  }
  if (sched == "areal")
    check("interrupted", mixed > 0,
          fmt::format("{} trained samples decoded under more than one version (tagged in their metadata)", mixed));
  std::printf("dispatch %s\n", ds.to_json().c_str());
  if (coordinator) std::printf("repack %s\n", coordinator->stats().to_json().c_str());
  std::printf("steps %d\n", step);
  std::fflush(stdout);
  // The dispatcher, the queue and the head relay serve until every rollout worker has left (or a
  // stop signal, or a minute: a killed worker leaves no mark).
  std::vector<std::string> left;
  for (int w = 0; w < s.workers; ++w) left.push_back(fmt::format("rollout-{}.left", w));
  const bool all_left = wait_for_files(dir, left, std::chrono::seconds(60), /*on_signal=*/true) == Woke::kFiles;
  // What the workers pulled and moved, from the files they leave in the run's directory.
  const WorkerCheck weights = check_weights(dir, s.workers);
  check("weights_bit_equal", weights.ok, weights.detail);
  if (sched == "laminar" && s.repack) {
    const WorkerCheck moved = check_moved(dir, s.workers, !all_left || server.stats().reissued > 0);
    check("moved_once", moved.ok, moved.detail);
  }
  std::fflush(stdout);
  q->close();
  if (Status st = mark_left(dir, "actor"); !st.ok()) return fail("actor", "leaving", st);
  return 0;
}

}  // namespace async_grpo
