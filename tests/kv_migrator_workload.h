// kv_migrator_workload.h: what kv_migrator_multiprocess_test and its child kv_migrator_peer agree
// on: the model, the cache layout, the sequences and how long they decode, the migrator's options,
// and a Worker (transport, cache, migrator, test model and the sequences it decodes) that either
// process runs as the source or the destination of a migration.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "laminar/clock.h"
#include "laminar/kv_cache.h"
#include "laminar/kv_migrator.h"
#include "laminar/status.h"
#include "laminar/transport.h"
#include "test_model.h"

namespace kv_migrator_workload {

using namespace std::chrono_literals;

// The child reads the cluster token from the environment (never argv, which `ps` shows).
inline constexpr const char* kTokenVariable = "LAMINAR_TEST_TOKEN";

inline constexpr std::int32_t kPageSize = 16;
inline constexpr std::int32_t kNumPages = 192;
inline constexpr laminar::DType kDType = laminar::DType::kBF16;
// Response tokens each sequence ends with.
inline constexpr std::size_t kResponse = 120;
// Decode steps the source runs before it starts the migration.
inline constexpr int kStepsBeforeMigration = 16;

inline laminar::testing::TestModelConfig model_config() { return {.seed = 2026, .num_layers = 2}; }

// The sequences that move: prompts of 5, 16, 47 and 80 tokens. After kStepsBeforeMigration steps
// the second holds exactly two full pages (its next token opens a page), the others end mid-page.
inline std::vector<laminar::SequenceState> sequences() {
  const std::size_t prompt_lengths[] = {5, 16, 47, 80};
  std::vector<laminar::SequenceState> out;
  for (std::size_t i = 0; i < std::size(prompt_lengths); ++i) {
    std::vector<std::int32_t> prompt;
    for (std::size_t t = 0; t < prompt_lengths[i]; ++t) prompt.push_back(std::int32_t((7 * t + 13 * i + 1) % 64));
    laminar::SequenceState s = laminar::testing::start_sequence(laminar::SequenceId(100 + i), prompt, 9000 + i);
    s.group_id = laminar::GroupId(7);
    s.group_size = 4;
    s.sample_index = std::uint32_t(i);
    s.engine_state = "engine state of sequence " + std::to_string(100 + i);
    out.push_back(std::move(s));
  }
  return out;
}

// The destination's own sequences, prompts of 9 and 33 tokens: they decode while pages are
// reserved for the incoming ones, and beside them once they arrived (if not finished by then).
inline std::vector<laminar::SequenceState> home_sequences() {
  const std::size_t prompt_lengths[] = {9, 33};
  std::vector<laminar::SequenceState> out;
  for (std::size_t i = 0; i < std::size(prompt_lengths); ++i) {
    std::vector<std::int32_t> prompt;
    for (std::size_t t = 0; t < prompt_lengths[i]; ++t) prompt.push_back(std::int32_t((5 * t + 3 * i + 2) % 64));
    out.push_back(laminar::testing::start_sequence(laminar::SequenceId(900 + i), prompt, 7000 + i));
  }
  return out;
}

// Pages a set of sequences fills once prefilled (kv_length = prompt length).
inline std::int32_t prefilled_pages(const std::vector<laminar::SequenceState>& seqs) {
  std::int32_t pages = 0;
  for (const laminar::SequenceState& s : seqs) {
    pages += std::int32_t((s.prompt_tokens.size() + kPageSize - 1) / kPageSize);
  }
  return pages;
}

// Small stage pieces (one page of every layer and both pools), so a live stage is many messages
// and the source decodes between them. Room reserved for each sequence to decode to its end while
// it is copied: the source decodes as fast as it can, and a destination slowed by a loaded machine
// must not make a sequence outgrow its reservation. Short lease and stall, so that a vanished peer
// is noticed soon.
inline laminar::KvMigratorOptions migrator_options() {
  laminar::KvMigratorOptions o;
  o.lease = 5s;
  o.stall_timeout = 5s;
  o.connect_timeout = 10s;
  o.max_live_stages = 4;
  o.growth_pages = std::uint32_t(kResponse / kPageSize + 1);
  const laminar::testing::TestModelConfig m = model_config();
  o.stage_bytes = std::size_t(kPageSize) * std::size_t(m.num_kv_heads * m.head_dim) * laminar::dtype_size(kDType) *
                  2 * std::size_t(m.num_layers);
  return o;
}

// One process's rollout worker: the sequences it decodes live here; paused ones (handed to
// finish()) and finished ones are not stepped.
class Worker {
 public:
  // A worker whose transport listens on 127.0.0.1 (a destination) or not (a source).
  static laminar::Result<std::unique_ptr<Worker>> create(const std::string& token, bool listen) {
    laminar::TransportOptions to;
    to.cluster_token = token;
    to.connect_timeout = 10s;
    to.operation_timeout = 10s;
    auto transport = laminar::Transport::create(to);
    if (!transport.ok()) return transport.status();
    auto w = std::unique_ptr<Worker>(new Worker(laminar::testing::TestModel::create(model_config()).value()));
    w->transport_ = std::move(*transport);
    if (listen) {
      auto address = w->transport_->listen("127.0.0.1", 0);
      if (!address.ok()) return address.status();
    }
    // Pools the transport allocates, as a worker should have them: a put into them on this host
    // is a memcpy into the peer's mapping, which must survive the peer being killed mid-put.
    auto pools = laminar::KvMigrator::allocate_cache(*w->transport_, w->model_.kv_layout(kNumPages, kPageSize, kDType));
    if (!pools.ok()) return pools.status();
    w->cache_ = pools->cache;
    laminar::KvMigratorOptions o = migrator_options();
    o.k_pool_region = pools->k_pool;
    o.v_pool_region = pools->v_pool;
    auto migrator = laminar::KvMigrator::create(w->transport_, w->cache_, o);
    if (!migrator.ok()) return migrator.status();
    w->migrator_ = std::move(*migrator);
    w->migrator_->set_notify([wake = w->wake_] {
      {
        std::lock_guard l(wake->mu);
        wake->woken = true;
      }
      wake->cv.notify_all();
    });
    return w;
  }
  ~Worker() {
    if (migrator_) migrator_->set_notify({});
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  laminar::PagedKvCache& cache() { return *cache_; }
  laminar::KvMigrator& migrator() { return *migrator_; }
  std::map<laminar::SequenceId, laminar::SequenceState>& live() { return live_; }

  // Adds `seqs` to the cache and feeds each its prompt.
  laminar::Status prefill(std::vector<laminar::SequenceState> seqs) {
    for (laminar::SequenceState& s : seqs) {
      LAMINAR_RETURN_IF_ERROR(model_.prefill(*cache_, s));
      live_.emplace(s.sequence, std::move(s));
    }
    return laminar::ok_status();
  }
  // The source's start: the sequences that will move, decoded kStepsBeforeMigration steps.
  laminar::Status start_workload() {
    LAMINAR_RETURN_IF_ERROR(prefill(sequences()));
    for (int i = 0; i < kStepsBeforeMigration; ++i) LAMINAR_RETURN_IF_ERROR(step().status());
    return laminar::ok_status();
  }

  // Takes sequences that arrived: they are in the cache with their states' kv_length.
  void adopt(std::vector<laminar::SequenceState> states) {
    for (laminar::SequenceState& s : states) live_.insert_or_assign(s.sequence, std::move(s));
  }
  // Stops decoding `ids` and returns their states, for finish().
  std::vector<laminar::SequenceState> pause(const std::vector<laminar::SequenceId>& ids) {
    std::vector<laminar::SequenceState> states;
    for (laminar::SequenceId id : ids) {
      paused_.insert(id);
      states.push_back(live_.at(id));
    }
    return states;
  }
  // Decodes `ids` again (their migration was aborted).
  void resume(const std::vector<laminar::SequenceId>& ids) {
    for (laminar::SequenceId id : ids) paused_.erase(id);
  }
  // Forgets `ids` (they now live at the destination).
  void forget(const std::vector<laminar::SequenceId>& ids) {
    for (laminar::SequenceId id : ids) {
      paused_.erase(id);
      live_.erase(id);
    }
  }

  // One decode step of every live sequence that is not paused and not finished; false when there
  // was none.
  laminar::Result<bool> step() {
    std::vector<laminar::SequenceState*> batch;
    for (auto& [id, s] : live_) {
      if (!paused_.contains(id) && s.response_tokens.size() < kResponse) batch.push_back(&s);
    }
    if (batch.empty()) return false;
    LAMINAR_RETURN_IF_ERROR(model_.step(*cache_, batch));
    return true;
  }

  // For a loop whose poll found nothing and which decoded nothing: waits until the migrator may
  // have something new (its notify), its poll_deadline() comes, or `bound` passes. The loop then
  // polls once, where wait_event() would poll until events came, running several stages between
  // two of the loop's decode steps.
  void idle(laminar::Duration bound) {
    const std::shared_ptr<laminar::Clock> clock = laminar::Clock::steady();
    const laminar::Duration until = std::min(migrator_->poll_deadline(), laminar::deadline_after(*clock, bound));
    std::unique_lock l(wake_->mu);
    while (!wake_->woken && clock->now() < until) clock->wait_until(wake_->cv, l, until);
    wake_->woken = false;
  }

  bool all_finished() const {
    return std::all_of(live_.begin(), live_.end(),
                       [](const auto& e) { return e.second.response_tokens.size() >= kResponse; });
  }

  // Pages of the sequences in the cache: what free_pages() must leave over when nothing is reserved.
  std::int32_t pages_in_use() const {
    std::int32_t pages = 0;
    for (const auto& [id, s] : live_) pages += std::int32_t((s.kv_length + kPageSize - 1) / kPageSize);
    return pages;
  }

 private:
  explicit Worker(laminar::testing::TestModel model) : model_(std::move(model)) {}

  laminar::testing::TestModel model_;
  std::shared_ptr<laminar::Transport> transport_;
  std::shared_ptr<laminar::PagedKvCache> cache_;
  std::unique_ptr<laminar::KvMigrator> migrator_;
  std::map<laminar::SequenceId, laminar::SequenceState> live_;
  std::set<laminar::SequenceId> paused_;
  // The migrator's notify, shared with its hook.
  struct Wake {
    std::mutex mu;
    std::condition_variable cv;
    bool woken = false;
  };
  std::shared_ptr<Wake> wake_ = std::make_shared<Wake>();
};

// `seqs` decoded in one process without any migration: what every migrated run must match.
inline std::map<laminar::SequenceId, laminar::SequenceState> reference(std::vector<laminar::SequenceState> seqs) {
  const auto model = laminar::testing::TestModel::create(model_config()).value();
  auto cache = laminar::PagedKvCache::create(model.kv_layout(kNumPages, kPageSize, kDType)).value();
  std::map<laminar::SequenceId, laminar::SequenceState> out;
  std::vector<laminar::SequenceState*> batch;
  for (laminar::SequenceState& s : seqs) {
    LAMINAR_CHECK(model.prefill(cache, s).ok());
    out.emplace(s.sequence, std::move(s));
  }
  for (auto& [id, s] : out) batch.push_back(&s);
  while (batch.front()->response_tokens.size() < kResponse) LAMINAR_CHECK(model.step(cache, batch).ok());
  return out;
}

// "ID TOKENS LOGPROB_BITS": tokens and the bits of each log-prob as comma-separated hex, so the
// test compares them exactly.
inline std::string format_result(const laminar::SequenceState& s) {
  std::string tokens, logprobs;
  for (std::size_t i = 0; i < s.response_tokens.size(); ++i) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%s%x", i ? "," : "", unsigned(s.response_tokens[i]));
    tokens += buf;
    std::uint32_t bits;
    std::memcpy(&bits, &s.logprobs[i], sizeof bits);
    std::snprintf(buf, sizeof buf, "%s%08x", i ? "," : "", bits);
    logprobs += buf;
  }
  return std::to_string(s.sequence.value()) + " " + tokens + " " + logprobs;
}

}  // namespace kv_migrator_workload
