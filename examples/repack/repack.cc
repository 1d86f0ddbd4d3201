// repack: laminar's dynamic repack on real rollout worker processes decoding a tiny model.
//
// The parent runs a RepackCoordinator on its own Transport and starts --workers rollout workers
// (this binary again, with --role worker), all on 127.0.0.1 with one cluster token. Each worker
// takes --prompts prompts of version 0 and decodes them step by step with the random-weight model
// of examples/tiny_model on a PagedKvCache. Between steps it calls its RepackDriver, which reports
// the worker's snapshot to the coordinator and turns the coordinator's orders into KvMigrator
// migrations; the worker answers their events: it pauses and hands over the states the migrator
// asks for, adopts what arrives, resumes what stays and drops what left. Response lengths have a
// long tail, so the workers soon hold a few long sequences each. Once --publish-at of the
// sequences finished, the parent tells the coordinator that version 1 is published: it plans, the
// long tails move together, and the workers they leave empty are free to pull the new weights.
//
// At the end each worker prints its trajectories. The parent decodes every prompt again in one
// process, without migration, and exits 0 only if each trajectory finished exactly once with the
// same tokens and log-probs, bit for bit.
//
//   repack                                 # 3 workers x 8 prompts
//   repack --workers 4 --seed 5 --verbose  # every line the workers print, trajectories in full
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "laminar/kv_cache.h"
#include "laminar/kv_migrator.h"
#include "laminar/migration_host.h"
#include "laminar/repack_coordinator.h"
#include "laminar/repack_driver.h"
#include "laminar/transport.h"
#include "child_process.h"
#include "tiny_model.h"

namespace {

using laminar::MigrationEvent;
using laminar::Result;
using laminar::SequenceId;
using laminar::SequenceState;
using laminar::Status;
using Steady = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr std::int32_t kPageSize = 16;
constexpr std::int32_t kPages = 256;  // per worker: room for the whole batch and what arrives
constexpr std::int32_t kSlots = 8;    // sequences one worker's decode batch holds
constexpr std::size_t kPromptTokens = 8;
// The least time between a worker's reports; a worker reports only when its snapshot changes.
constexpr auto kReportInterval = 100ms;
// The coordinator leaves out a worker it has not heard from for this long; a worker whose snapshot
// stands still sends its last report again a quarter of that after the one before.
constexpr auto kStaleAfter = 2000ms;
constexpr auto kKeepalive = kStaleAfter / 4;
// How long an emptied worker keeps stepping before it exits: a few report intervals, so the
// coordinator hears it empty, and any offer planned from its older reports still finds it.
constexpr auto kLinger = 3 * kReportInterval;

// What the parent and the workers agree on; the workers get it on their command line.
struct Settings {
  std::uint32_t workers = 3;
  std::uint32_t prompts = 8;
  std::uint64_t seed = 1;
  std::uint64_t model_seed = 7;
  std::uint32_t step_ms = 10;
};

// splitmix64's finaliser, so prompts and lengths are the same in every process and build.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// One prompt of the run: what a worker decodes and what the parent decodes again to check it.
struct Prompt {
  SequenceId id;
  std::vector<std::int32_t> tokens;
  std::uint64_t seed = 0;
  std::int64_t response_length = 0;  // tokens it generates before it ends
};

// Prompt j (from 0) of worker w (from 1); its sequence id is 100 w + j + 1, so w2's are 201, 202, ...
Prompt prompt_of(const Settings& s, std::uint32_t worker, std::uint32_t j, std::int32_t vocab) {
  Prompt p;
  p.id = SequenceId(100 * std::uint64_t(worker) + j + 1);
  const std::uint64_t h = mix(s.seed ^ mix(p.id.value()));
  p.seed = mix(h ^ 1);
  for (std::size_t i = 0; i < kPromptTokens; ++i) {
    p.tokens.push_back(std::int32_t(mix(h + 2 + i) % std::uint64_t(vocab)));
  }
  // A long tail, as RL response lengths have: one in five runs 160 to 320 tokens, the rest 8 to 48.
  const std::uint64_t r = mix(h ^ 3);
  p.response_length = r % 5 == 0 ? 160 + std::int64_t(r / 5 % 161) : 8 + std::int64_t(r / 5 % 41);
  return p;
}

// The response length travels with a migrated sequence in its engine_state, the engine's own blob.
constexpr std::string_view kKey = "response_length=";

std::string engine_state_of(std::int64_t response_length) {
  return std::string(kKey) + std::to_string(response_length);
}

Result<std::int64_t> response_length_of(const SequenceState& s) {
  const std::string& e = s.engine_state;
  std::int64_t n = 0;
  if (e.starts_with(kKey)) {
    const auto [end, ec] = std::from_chars(e.data() + kKey.size(), e.data() + e.size(), n);
    if (ec == std::errc() && end == e.data() + e.size() && n > 0) return n;
  }
  return laminar::invalid_argument(
      fmt::format("sequence {}: engine_state '{}' holds no response_length", s.sequence.value(), e));
}

std::string seq_list(const std::vector<SequenceId>& ids) {
  std::string out;
  for (SequenceId id : ids) out += (out.empty() ? "" : " ") + std::to_string(id.value());
  return out;
}

void say(const std::string& line) {
  std::fputs((line + "\n").c_str(), stdout);
  std::fflush(stdout);
}

// ---------------------------------------------------------------------------------------------
// The worker: one rollout engine's decode loop with a KvMigrator and a RepackDriver.

// The first word of the worker lines the parent acts on.
constexpr std::string_view kFinished = "finished";
constexpr std::string_view kSent = "sent";
constexpr std::string_view kReceived = "received";
constexpr std::string_view kFree = "free";
constexpr std::string_view kTrajectory = "trajectory";

struct WorkerArgs {
  Settings settings;
  std::uint32_t index = 0;  // from 1
  std::string coordinator;
  std::string token;
};

class RolloutWorker {
 public:
  static Result<std::unique_ptr<RolloutWorker>> create(const WorkerArgs& args) {
    auto model = tiny_model::TinyModel::create({.seed = args.settings.model_seed});
    if (!model.ok()) return model.status();
    std::unique_ptr<RolloutWorker> w(new RolloutWorker(args, std::move(*model)));
    laminar::TransportOptions to;
    to.cluster_token = args.token;
    auto transport = laminar::Transport::create(to);
    if (!transport.ok()) return transport.status();
    w->transport_ = std::move(*transport);
    if (auto a = w->transport_->listen("127.0.0.1", 0); !a.ok()) return a.status();
    // Pools the transport allocates: a peer on this host puts into them with one copy.
    auto pools = laminar::KvMigrator::allocate_cache(*w->transport_,
                                                     w->model_.kv_layout(kPages, kPageSize, laminar::DType::kBF16));
    if (!pools.ok()) return pools.status();
    w->cache_ = pools->cache;
    laminar::KvMigratorOptions mo;
    mo.k_pool_region = pools->k_pool;
    mo.v_pool_region = pools->v_pool;
    mo.max_sequences = kSlots;
    auto migrator = laminar::KvMigrator::create(w->transport_, w->cache_, mo);
    if (!migrator.ok()) return migrator.status();
    w->migrator_ = std::move(*migrator);
    w->migrator_->set_version(laminar::Version(0));
    laminar::RepackDriverOptions dopt;
    dopt.worker = w->id_;
    dopt.coordinator = args.coordinator;
    dopt.min_report_interval = kReportInterval;
    dopt.keepalive_interval = kKeepalive;
    auto driver = laminar::RepackDriver::create(w->transport_, w->migrator_, dopt);
    if (!driver.ok()) return driver.status();
    w->driver_ = std::move(*driver);
    auto host = laminar::MigrationHost::create(w->migrator_, w->handlers());
    if (!host.ok()) return host.status();
    w->host_ = std::move(*host);
    return w;
  }

  Status run() {
    std::string lengths;
    for (std::uint32_t j = 0; j < settings_.prompts; ++j) {
      const Prompt p = prompt_of(settings_, id_.value(), j, model_.config().vocab);
      SequenceState s = tiny_model::start_sequence(p.id, p.tokens, p.seed);
      s.engine_state = engine_state_of(p.response_length);
      LAMINAR_RETURN_IF_ERROR(model_.prefill(*cache_, s));
      live_[p.id] = {std::move(s), p.response_length};
      lengths += " " + std::to_string(p.response_length);
    }
    say(fmt::format("ready at {}: {} prompts of version 0, response lengths{}", migrator_->address().value_or("?"),
                    settings_.prompts, lengths));
    constexpr Steady::time_point kNotEmpty = Steady::time_point::max();
    Steady::time_point empty_since = kNotEmpty;
    for (;;) {
      const Steady::time_point start = Steady::now();
      Result<std::vector<MigrationEvent>> events = driver_->step(snapshot());
      if (!events.ok()) return events.status();
      LAMINAR_RETURN_IF_ERROR(host_->handle(*events));
      LAMINAR_RETURN_IF_ERROR(decode());
      LAMINAR_RETURN_IF_ERROR(retire_finished());
      peak_pages_ = std::max(peak_pages_, cache_->used_pages());
      if (!live_.empty() || !migrator_->moving().empty()) {
        empty_since = kNotEmpty;
      } else if (empty_since == kNotEmpty) {
        empty_since = start;
        say(steps_saved_ > 0 ? fmt::format("{}: its last sequences moved away {} decode steps before their end; it "
                                           "can pull the new weights",
                                           kFree, steps_saved_)
                             : "idle: no sequence left here");
      } else if (start - empty_since >= kLinger) {
        break;
      }
      // The model is tiny: pace the steps to --step-ms, as a real model's decode step would take.
      std::this_thread::sleep_until(start + std::chrono::milliseconds(settings_.step_ms));
      step_time_ = Steady::now() - start;
    }
    LAMINAR_RETURN_IF_ERROR(migrator_->background_error());
    const laminar::KvMigratorStats ms = migrator_->stats();
    say(fmt::format("done: {} trajectories finished here; pages sent {}, received {}", trajectories_.size(),
                    ms.pages_sent, ms.pages_received));
    for (const SequenceState& t : trajectories_) {
      std::string tokens, logprobs;
      for (std::int32_t tok : t.response_tokens) tokens += (tokens.empty() ? "" : ",") + std::to_string(tok);
      for (float lp : t.logprobs) {
        logprobs += fmt::format("{}{:08x}", logprobs.empty() ? "" : ",", std::bit_cast<std::uint32_t>(lp));
      }
      say(fmt::format("{} {} tokens {} logprobs {}", kTrajectory, t.sequence.value(), tokens, logprobs));
    }
    return laminar::ok_status();
  }

 private:
  // A sequence in this worker's cache: its state and where it stops.
  struct Live {
    SequenceState state;
    std::int64_t response_length = 0;
  };
  // An outgoing migration whose sequences are paused: when, and what it carries.
  struct Paused {
    Steady::time_point at;
    std::string what;
    std::int64_t most_left = 0;  // decode steps before its longest sequence ends
  };

  RolloutWorker(const WorkerArgs& args, tiny_model::TinyModel model)
      : settings_(args.settings),
        id_(args.index),
        model_(std::move(model)),
        step_time_(std::chrono::milliseconds(args.settings.step_ms)) {}

  laminar::WorkerSnapshot snapshot() const {
    laminar::WorkerSnapshot w;
    w.id = id_;
    w.version = migrator_->version();
    w.pages_total = kPages;
    w.pages_used = cache_->used_pages();
    w.slots_total = kSlots;
    w.slots_used = std::int32_t(live_.size());
    w.step_time = step_time_;
    // Every prompt was taken at the start: once the batch holds fewer pages than at its peak,
    // sequences end faster than the others grow.
    w.kv_stopped_growing = w.pages_used < peak_pages_;
    for (const auto& [id, s] : live_) {
      // The exact remaining length, as a perfect length predictor would give it.
      const std::int64_t left = s.response_length - std::int64_t(s.state.response_tokens.size());
      w.sequences.push_back({id, std::int64_t(s.state.kv_length), std::int64_t(cache_->pages(id)->size()),
                             std::max<std::int64_t>(0, left)});
    }
    return w;
  }

  // What the migrator's events do to this engine (MigrationHost calls these).
  laminar::MigrationHandlers handlers() {
    laminar::MigrationHandlers h;
    h.pause = [this](const MigrationEvent& e) -> Result<std::vector<SequenceState>> {
      std::vector<SequenceState> states;
      Paused p{Steady::now(), "", 0};
      for (SequenceId s : e.sequences) {
        const auto it = live_.find(s);
        if (it == live_.end()) {
          return laminar::internal_error(fmt::format("pause of sequence {}, not live here", s.value()));
        }
        paused_.insert(s);
        states.push_back(it->second.state);
        p.what += fmt::format("{}seq {} ({} tokens, {} pages)", p.what.empty() ? "" : ", ", s.value(),
                              it->second.state.kv_length, cache_->pages(s)->size());
        p.most_left = std::max(p.most_left, it->second.response_length -
                                                std::int64_t(it->second.state.response_tokens.size()));
      }
      pauses_[e.id] = std::move(p);
      return states;
    };
    h.forget = [this](const MigrationEvent& e) -> Status {
      const auto paused = pauses_.find(e.id);
      if (paused == pauses_.end()) {
        return laminar::internal_error(fmt::format("migration {} done, but it never paused", e.id.value()));
      }
      const Paused p = paused->second;
      pauses_.erase(paused);
      // From the pause to the destination's answer: at most the sequence's downtime, as the
      // destination decodes it from the moment it commits.
      const double ms = std::chrono::duration<double, std::milli>(Steady::now() - p.at).count();
      say(fmt::format("{} {}: paused {:.1f} ms", kSent, p.what, ms));
      for (SequenceId s : e.sequences) {
        live_.erase(s);
        paused_.erase(s);
      }
      if (live_.empty()) steps_saved_ = p.most_left;
      return laminar::ok_status();
    };
    h.resume = [this](const MigrationEvent& e) -> Status {
      pauses_.erase(e.id);
      for (SequenceId s : e.sequences) paused_.erase(s);
      say(fmt::format("kept seq {}: {}", seq_list(e.sequences), e.reason.to_string()));
      return laminar::ok_status();
    };
    h.gave_up = [](const MigrationEvent& e) {
      say(fmt::format("gave up receiving seq {}: {}", seq_list(e.sequences), e.reason.to_string()));
    };
    h.adopt = [this](MigrationEvent& e) -> Status {
      std::string what;
      for (SequenceState& st : e.states) {
        Result<std::int64_t> length = response_length_of(st);
        if (!length.ok()) return length.status();
        what += fmt::format("{}seq {} ({} tokens, {} pages)", what.empty() ? "" : ", ", st.sequence.value(),
                            st.kv_length, cache_->pages(st.sequence)->size());
        const SequenceId id = st.sequence;
        live_[id] = {std::move(st), *length};
      }
      steps_saved_ = 0;
      say(fmt::format("{} {}", kReceived, what));
      return laminar::ok_status();
    };
    return h;
  }

  // One decode step for every live sequence that is neither paused nor at its length.
  Status decode() {
    std::vector<SequenceState*> batch;
    for (auto& [id, s] : live_) {
      if (!paused_.contains(id) && std::int64_t(s.state.response_tokens.size()) < s.response_length) {
        batch.push_back(&s.state);
      }
    }
    return model_.step(*cache_, batch);
  }

  // Sequences at their length leave the cache as trajectories, except those a migration is moving:
  // the migrator owns them until it reports where they ended up.
  Status retire_finished() {
    const std::vector<SequenceId> moving = migrator_->moving();
    const std::unordered_set<SequenceId> busy(moving.begin(), moving.end());
    for (auto it = live_.begin(); it != live_.end();) {
      const SequenceState& s = it->second.state;
      if (std::int64_t(s.response_tokens.size()) < it->second.response_length || busy.contains(it->first)) {
        ++it;
        continue;
      }
      say(fmt::format("{} seq {}: {} tokens", kFinished, s.sequence.value(), s.response_tokens.size()));
      LAMINAR_RETURN_IF_ERROR(cache_->release(it->first));
      trajectories_.push_back(s);
      it = live_.erase(it);
    }
    return laminar::ok_status();
  }

  Settings settings_;
  laminar::WorkerId id_;
  tiny_model::TinyModel model_;
  // Declared in the order they are made, so the driver goes first and the transport last.
  std::shared_ptr<laminar::Transport> transport_;
  std::shared_ptr<laminar::PagedKvCache> cache_;
  std::shared_ptr<laminar::KvMigrator> migrator_;
  std::unique_ptr<laminar::RepackDriver> driver_;
  std::unique_ptr<laminar::MigrationHost> host_;
  std::map<SequenceId, Live> live_;
  std::set<SequenceId> paused_;
  std::map<laminar::MigrationId, Paused> pauses_;
  std::vector<SequenceState> trajectories_;
  std::int32_t peak_pages_ = 0;
  laminar::Duration step_time_;  // of the last step, pacing included
  // Steps the last migration out saved when it left this worker empty; 0 when the worker emptied
  // by finishing its sequences.
  std::int64_t steps_saved_ = 0;
};

int run_worker(const WorkerArgs& args) {
  auto worker = RolloutWorker::create(args);
  Status st = worker.ok() ? (*worker)->run() : worker.status();
  if (!st.ok()) {
    std::fprintf(stderr, "repack worker %u: %s\n", args.index, st.to_string().c_str());
    return 1;
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// The parent: the coordinator, the worker processes, and the check.

using Child = examples::ChildProcess;

struct Trajectory {
  std::uint32_t worker = 0;
  std::vector<std::int32_t> tokens;
  std::vector<std::uint32_t> logprob_bits;
};

// "trajectory ID tokens T,T,... logprobs HEX,HEX,..." as the worker prints it.
std::optional<std::pair<SequenceId, Trajectory>> parse_trajectory(const std::string& line, std::uint32_t worker) {
  std::istringstream in(line);
  std::string word, tokens_word, tokens, logprobs_word, logprobs;
  std::uint64_t id = 0;
  if (!(in >> word >> id >> tokens_word >> tokens >> logprobs_word >> logprobs) || tokens_word != "tokens" ||
      logprobs_word != "logprobs") {
    return std::nullopt;
  }
  Trajectory t;
  t.worker = worker;
  auto each = [](const std::string& list, int base, auto&& take) {
    const char* p = list.data();
    const char* const last = list.data() + list.size();
    while (p < last) {
      std::uint64_t v = 0;
      const auto [end, ec] = std::from_chars(p, last, v, base);
      if (ec != std::errc() || (end < last && *end != ',')) return false;
      take(v);
      p = end < last ? end + 1 : end;
    }
    return true;
  };
  if (!each(tokens, 10, [&](std::uint64_t v) { t.tokens.push_back(std::int32_t(v)); }) ||
      !each(logprobs, 16, [&](std::uint64_t v) { t.logprob_bits.push_back(std::uint32_t(v)); })) {
    return std::nullopt;
  }
  return std::pair{SequenceId(id), std::move(t)};
}

// The sequences a "sent"/"received" line names, "seq ID (TOKENS tokens, ...)" for each, with the
// tokens they held when they moved.
std::vector<std::pair<SequenceId, std::int64_t>> named_sequences(const std::string& line) {
  std::vector<std::pair<SequenceId, std::int64_t>> out;
  std::istringstream in(line);
  std::string word;
  while (in >> word) {
    std::uint64_t id = 0;
    char paren = 0;
    std::int64_t tokens = 0;
    if (word == "seq" && in >> id >> paren >> tokens && paren == '(') out.emplace_back(SequenceId(id), tokens);
  }
  return out;
}

// Every prompt decoded again in one cache, in one batch, nothing migrated: the tokens and log-probs
// each trajectory must have (the kernels are batch-invariant, so batch mates change no bit).
Result<std::map<SequenceId, SequenceState>> decode_without_migration(const Settings& s) {
  auto model = tiny_model::TinyModel::create({.seed = s.model_seed});
  if (!model.ok()) return model.status();
  std::vector<Prompt> prompts;
  std::int32_t pages = 0;
  for (std::uint32_t w = 1; w <= s.workers; ++w) {
    for (std::uint32_t j = 0; j < s.prompts; ++j) {
      prompts.push_back(prompt_of(s, w, j, model->config().vocab));
      pages += std::int32_t((std::int64_t(kPromptTokens) + prompts.back().response_length + kPageSize - 1) / kPageSize);
    }
  }
  auto cache = laminar::PagedKvCache::create(model->kv_layout(pages, kPageSize, laminar::DType::kBF16));
  if (!cache.ok()) return cache.status();
  std::map<SequenceId, SequenceState> out;
  for (const Prompt& p : prompts) {
    SequenceState st = tiny_model::start_sequence(p.id, p.tokens, p.seed);
    LAMINAR_RETURN_IF_ERROR(model->prefill(*cache, st));
    out[p.id] = std::move(st);
  }
  for (;;) {
    std::vector<SequenceState*> batch;
    for (const Prompt& p : prompts) {
      SequenceState& st = out[p.id];
      if (std::int64_t(st.response_tokens.size()) < p.response_length) batch.push_back(&st);
    }
    if (batch.empty()) return out;
    LAMINAR_RETURN_IF_ERROR(model->step(*cache, batch));
  }
}

// "12 40 7 9 13 61 ... 5 33": the first and last few tokens.
std::string abbreviated(const std::vector<std::int32_t>& tokens) {
  std::string out;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    if (tokens.size() > 12 && i == 6) {
      out += " ...";
      i = tokens.size() - 4;
    }
    out += " " + std::to_string(tokens[i]);
  }
  return out;
}

struct ParentArgs {
  Settings settings;
  double publish_at = 0.6;
  std::uint32_t min_moves = 0;
  std::uint32_t timeout_s = 60;
  bool verbose = false;
};

class Parent {
 public:
  explicit Parent(const ParentArgs& args) : args_(args), total_(args.settings.workers * args.settings.prompts) {}

  int run() {
    const Settings& s = args_.settings;
    std::random_device rd;
    const std::string token = fmt::format("repack-example-{:08x}{:08x}{:08x}{:08x}", rd(), rd(), rd(), rd());
    laminar::TransportOptions to;
    to.cluster_token = token;
    to.max_inbox_bytes = 0;  // only the coordinator's handler runs here
    auto transport = laminar::Transport::create(to);
    if (!transport.ok()) return fail("transport", transport.status());
    std::shared_ptr<laminar::Transport> shared = std::move(*transport);
    auto address = shared->listen("127.0.0.1", 0);
    if (!address.ok()) return fail("listen", address.status());
    auto model = tiny_model::TinyModel::create({.seed = s.model_seed});
    if (!model.ok()) return fail("model", model.status());
    const laminar::KvLayout layout = model->kv_layout(kPages, kPageSize, laminar::DType::kBF16);

    laminar::RepackCoordinatorOptions co;
    co.tokens_per_page = kPageSize;
    co.stale_after = kStaleAfter;
    co.policy.page_bytes = 2 * std::uint64_t(layout.num_layers) * std::uint64_t(layout.page_bytes());
    // Steps are paced to --step-ms, by default well above what the tiny model computes in one: more
    // KV does not make them slower here.
    co.policy.step_seconds_per_token = 0.0;
    // Step times on a shared machine jitter by more than the default 5%, which would read as a tail
    // that packing lengthens.
    co.policy.max_tail_growth = 0.25;
    auto coordinator = laminar::RepackCoordinator::create(shared, co);
    if (!coordinator.ok()) return fail("coordinator", coordinator.status());
    coordinator_ = std::move(*coordinator);

    start_ = Steady::now();
    say(fmt::format("repack: {} workers x {} prompts (seed {}) of version 0; tiny model (seed {}, {} layers, d_model "
                    "{}), KV pages of {} tokens; coordinator at {}",
                    s.workers, s.prompts, s.seed, s.model_seed, model->config().num_layers, model->config().d_model,
                    kPageSize, *address));
    std::vector<std::unique_ptr<Child>> children;
    for (std::uint32_t w = 1; w <= s.workers; ++w) {
      auto child = Child::spawn(fmt::format("worker-{}", w),
                                {"--role", "worker", "--index", std::to_string(w), "--coordinator", *address, "--token",
                                 token, "--workers", std::to_string(s.workers), "--prompts", std::to_string(s.prompts),
                                 "--seed", std::to_string(s.seed), "--model-seed", std::to_string(s.model_seed),
                                 "--step-ms", std::to_string(s.step_ms)});
      if (!child.ok()) return fail("start worker", child.status());
      children.push_back(std::move(*child));
    }
    if (!follow(children)) return 1;
    bool ok = true;
    for (std::uint32_t w = 1; w <= s.workers; ++w) {
      if (const int code = children[w - 1]->wait(); code != 0) {
        std::fprintf(stderr, "repack: worker %u exited with %d\n", w, code);
        ok = false;
      }
    }
    const double seconds = std::chrono::duration<double>(Steady::now() - start_).count();
    return summarize(seconds) && ok ? 0 : 1;
  }

 private:
  // One move of a sequence: the worker that said it sent it and the one that said it received it
  // (0 until its line is read).
  struct Hop {
    std::uint32_t from = 0, to = 0;
  };
  // A sequence's moves by the tokens it held then: a sequence only grows, so this is their order.
  using Hops = std::map<std::int64_t, Hop>;

  int fail(const char* what, const Status& st) {
    std::fprintf(stderr, "repack: %s: %s\n", what, st.to_string().c_str());
    return 1;
  }

  void show(const std::string& who, const std::string& line) {
    say(fmt::format("{:6.2f} s  {:<6}  {}", std::chrono::duration<double>(Steady::now() - start_).count(), who, line));
  }

  // Reads every worker's lines until all closed stdout; false past --timeout-s.
  bool follow(std::vector<std::unique_ptr<Child>>& children) {
    const Steady::time_point deadline = start_ + std::chrono::seconds(args_.timeout_s);
    for (;;) {
      std::vector<pollfd> fds;
      std::vector<std::uint32_t> who;
      for (std::uint32_t w = 0; w < children.size(); ++w) {
        if (children[w]->fd() >= 0) {
          fds.push_back({children[w]->fd(), POLLIN, 0});
          who.push_back(w + 1);
        }
      }
      if (fds.empty()) return true;
      if (Steady::now() > deadline) {
        std::fprintf(stderr, "repack: the workers did not finish within %u s\n", args_.timeout_s);
        return false;
      }
      if (poll(fds.data(), fds.size(), 100) < 0 && errno != EINTR) {
        std::fprintf(stderr, "repack: poll: %s\n", std::strerror(errno));
        return false;
      }
      for (std::size_t i = 0; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        std::vector<std::string> lines;
        children[who[i] - 1]->read_lines(lines);
        for (const std::string& line : lines) take(who[i], line);
      }
    }
  }

  void take(std::uint32_t w, const std::string& line) {
    const std::string who = fmt::format("w{}", w);
    const std::string_view first = std::string_view(line).substr(0, line.find_first_of(" :"));
    if (first == kTrajectory) {
      if (auto t = parse_trajectory(line, w)) {
        trajectories_.push_back(std::move(*t));
      } else {
        unparsed_.push_back(line);
      }
      if (args_.verbose) show(who, line);
      return;
    }
    if (first == kFinished) {
      ++finished_;
      if (args_.verbose) show(who, line);
      if (!published_ && double(finished_) >= args_.publish_at * double(total_)) {
        published_ = true;
        const Status st = coordinator_->set_newest_version(laminar::Version(1));
        show("parent", st.ok() ? fmt::format("{} of {} sequences finished: version 1 is published, the coordinator "
                                             "plans a repack of version 0",
                                             finished_, total_)
                               : "publishing version 1 failed: " + st.to_string());
      }
      return;
    }
    if (first == kSent || first == kReceived) {
      for (const auto& [id, tokens] : named_sequences(line)) {
        Hop& h = moves_[id][tokens];
        (first == kSent ? h.from : h.to) = w;
        moves_made_ += first == kSent ? 1 : 0;
      }
    }
    if (first == kFree) freed_.insert(w);
    show(who, line);
  }

  bool summarize(double seconds) {
    bool ok = true;
    const laminar::RepackCoordinatorStats cs = coordinator_->stats();
    std::string freed;
    for (std::uint32_t w : freed_) freed += fmt::format(" w{}", w);
    say(fmt::format("summary: {} moves of {} sequences; workers freed early:{}; coordinator: {} plans, {} moves "
                    "ordered",
                    moves_made_, moves_.size(), freed.empty() ? " none" : freed, cs.plans, cs.moves));
    if (!coordinator_->background_error().ok()) {
      say("coordinator error: " + coordinator_->background_error().to_string());
      ok = false;
    }
    for (const std::string& line : unparsed_) {
      say("unreadable trajectory line: " + line.substr(0, 80));
      ok = false;
    }

    auto reference = decode_without_migration(args_.settings);
    if (!reference.ok()) {
      say("decoding without migration failed: " + reference.status().to_string());
      return false;
    }
    std::map<SequenceId, std::vector<const Trajectory*>> by_id;
    for (const auto& [id, t] : trajectories_) by_id[id].push_back(&t);
    std::size_t exact = 0, once = 0;
    for (const auto& [id, want] : *reference) {
      const auto found = by_id.find(id);
      const std::size_t copies = found == by_id.end() ? 0 : found->second.size();
      if (copies != 1) {
        say(fmt::format("seq {} finished {} times", id.value(), copies));
        ok = false;
        continue;
      }
      ++once;
      const Trajectory& got = *found->second.front();
      std::vector<std::uint32_t> want_bits;
      for (float lp : want.logprobs) want_bits.push_back(std::bit_cast<std::uint32_t>(lp));
      const bool same = got.tokens == want.response_tokens && got.logprob_bits == want_bits;
      exact += same ? 1 : 0;
      if (!same) ok = false;
      const auto moved = moves_.find(id);
      if (moved != moves_.end() || !same) {
        std::string path;
        if (moved != moves_.end()) {
          for (const auto& [tokens, h] : moved->second) {
            path += fmt::format("{} w{} -> w{} at {} tokens", path.empty() ? " moved" : ",", h.from, h.to, tokens);
          }
        }
        say(fmt::format("  seq {}{}; finished on w{}: {} tokens{}: {}", id.value(), path, got.worker,
                        got.tokens.size(), abbreviated(got.tokens),
                        same ? "same bits as without migration" : "DIFFERS from the decode without migration"));
      }
    }
    for (const auto& [id, copies] : by_id) {
      if (!reference->contains(id)) {
        say(fmt::format("seq {} is no prompt of this run", id.value()));
        ok = false;
      }
    }
    say(fmt::format("check: {} of {} sequences finished exactly once; {} of them match a decode without migration "
                    "bit for bit (tokens and log-probs)",
                    once, total_, exact));
    if (moves_made_ < args_.min_moves) {
      say(fmt::format("check: {} moves, --min-moves wants {}", moves_made_, args_.min_moves));
      ok = false;
    }
    for (const auto& [id, hops] : moves_) {
      for (const auto& [tokens, h] : hops) {
        if (h.from == 0 || h.to == 0) {
          say(fmt::format("check: seq {} at {} tokens was {}", id.value(), tokens,
                          h.from == 0 ? "received but never sent" : "sent but never received"));
          ok = false;
        }
      }
    }
    say(fmt::format("repack: {} in {:.1f} s", ok ? "ok" : "FAILED", seconds));
    return ok;
  }

  ParentArgs args_;
  std::uint32_t total_;
  std::unique_ptr<laminar::RepackCoordinator> coordinator_;
  Steady::time_point start_;
  std::uint32_t finished_ = 0;
  bool published_ = false;
  std::vector<std::pair<SequenceId, Trajectory>> trajectories_;
  std::vector<std::string> unparsed_;
  std::map<SequenceId, Hops> moves_;
  std::uint32_t moves_made_ = 0;
  std::set<std::uint32_t> freed_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Dynamic repack of long-tail sequences across real rollout worker processes on a tiny model."};
  ParentArgs p;
  Settings& s = p.settings;
  app.add_option("--workers", s.workers, "rollout worker processes")->capture_default_str()->check(CLI::Range(2, 9));
  app.add_option("--prompts", s.prompts, "prompts each worker decodes")
      ->capture_default_str()
      ->check(CLI::Range(1, kSlots));
  app.add_option("--seed", s.seed, "seed of the prompts and their response lengths")->capture_default_str();
  app.add_option("--model-seed", s.model_seed, "seed of the tiny model's weights")->capture_default_str();
  app.add_option("--step-ms", s.step_ms, "time of one decode step")->capture_default_str()->check(CLI::Range(1, 1000));
  app.add_option("--publish-at", p.publish_at, "fraction of the sequences finished when version 1 is published")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 1.0));
  app.add_option("--min-moves", p.min_moves, "fail unless at least this many sequences moved")->capture_default_str();
  app.add_option("--timeout-s", p.timeout_s, "fail if the workers run longer")
      ->capture_default_str()
      ->check(CLI::Range(1, 3600));
  app.add_flag("--verbose", p.verbose, "print every line of the workers, trajectories in full");
  // The worker processes' own options, set by the parent.
  std::string role = "parent";
  WorkerArgs w;
  app.add_option("--role", role, "parent or worker (the parent starts the workers)")
      ->check(CLI::IsMember({"parent", "worker"}))
      ->group("");
  app.add_option("--index", w.index, "this worker's id, from 1")->group("");
  app.add_option("--coordinator", w.coordinator, "host:port of the coordinator")->group("");
  app.add_option("--token", w.token, "cluster token")->group("");
  CLI11_PARSE(app, argc, argv);

  if (role == "worker") {
    if (w.index < 1 || w.index > s.workers || w.coordinator.empty() || w.token.empty()) {
      std::fprintf(stderr, "repack: a worker needs --index in [1, --workers], --coordinator and --token\n");
      return 2;
    }
    w.settings = s;
    return run_worker(w);
  }
  return Parent(p).run();
}
