#include "laminar/trajectory_queue.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <queue>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "id_window.h"
#include "trajectory_wal.h"

namespace laminar {

namespace internal {
struct BatchData {
  BatchId id;
  std::vector<Trajectory> items;
  std::vector<TrajectoryInfo> info;
  // At the first index of each unit (a group or a lone trajectory): the unit's length; 0 elsewhere.
  std::vector<std::uint32_t> unit_len;
  std::size_t tokens = 0;
  Duration deadline{0};
};
}  // namespace internal

BatchId Batch::id() const noexcept { return d_ ? d_->id : BatchId(); }
std::span<const Trajectory> Batch::trajectories() const noexcept {
  return d_ ? std::span<const Trajectory>(d_->items) : std::span<const Trajectory>();
}
std::span<const TrajectoryInfo> Batch::info() const noexcept {
  return d_ ? std::span<const TrajectoryInfo>(d_->info) : std::span<const TrajectoryInfo>();
}
std::size_t Batch::num_tokens() const noexcept { return d_ ? d_->tokens : 0; }
Duration Batch::lease_deadline() const noexcept { return d_ ? d_->deadline : Duration(0); }

std::vector<Trajectory> Batch::release() {
  std::vector<Trajectory> out;
  if (!d_) return out;
  // use_count 1: the queue let go of the batch for good (ack, or the copy made on requeue), so
  // nobody else can reach these.
  out = d_.use_count() == 1 ? std::move(d_->items) : d_->items;
  d_.reset();
  return out;
}

namespace {

using internal::TrajectoryWal;
using internal::WalRecordType;
using internal::WalRetireReason;

constexpr std::size_t kMaxCapacityTrajectories = (std::size_t(1) << 24) - 1;
constexpr std::size_t kMaxCapacityTokens = (std::size_t(1) << 40) - 1;
// The window keeps 8 bytes per id once full: at most 4 GiB.
constexpr std::size_t kMaxWindow = std::size_t(1) << 29;
// Batches whose lease expired are told apart from unknown ones for this many expiries.
constexpr std::size_t kExpiredBatchMemory = 1 << 16;
// Timers of groups or leases that ended early are dropped lazily once they outnumber the live
// ones twice over and by this many.
constexpr std::size_t kStaleTimers = 1024;

void add_wait(WaitHistogram& h, Duration waited) {
  const double ms = std::chrono::duration<double, std::milli>(waited).count();
  ++h.count;
  h.sum_ms += ms;
  h.max_ms = std::max(h.max_ms, ms);
  int b = 0;
  while (b + 1 < WaitHistogram::kBuckets && ms >= double(1ull << b)) ++b;
  ++h.buckets[b];
}

// What pop_batch hands out whole: the next `len` trajectories of the ready queue, a group (in
// sample order) or one ungrouped trajectory.
struct Unit {
  std::uint32_t len = 0;
  std::size_t tokens = 0;
  std::uint64_t min_version = UINT64_MAX;  // the stalest member judges the unit's staleness
  std::uint32_t deliveries = 0;            // times delivered before
  bool partial_group = false;
};

struct PendingGroup {
  std::uint32_t group_size = 0;
  PromptId prompt_id;
  Duration first_arrival{0};
  std::vector<Trajectory> members;
  std::vector<bool> seen;  // [group_size]
};

// A group as the earlier members of one push_many call leave it, so that later members are
// checked against it before anything changes.
struct GroupView {
  std::uint32_t group_size = 0;
  PromptId prompt_id;
  std::vector<bool> seen;
  std::uint32_t count = 0;
};

// The outcome of checking trajectories against the queue's state, which it does not change.
struct Plan {
  std::vector<std::uint32_t> accepted;
  std::vector<std::pair<std::uint32_t, Status>> refused;
  std::size_t tokens = 0;  // of the accepted
};

// Condition variables to notify once the lock is let go.
struct Wake {
  bool data = false;
  bool space = false;
};

using Timer = std::pair<Duration, std::uint64_t>;
using GroupTimer = std::pair<Duration, GroupId>;

std::size_t min_count_of(const BatchSpec& spec) { return std::max<std::size_t>(spec.min_trajectories, 1); }

// How many versions `version` is behind the consumer's.
std::uint64_t staleness_of(const BatchSpec& spec, std::uint64_t version) {
  const std::uint64_t consumer = spec.consumer_version.value();
  return consumer > version ? consumer - version : 0;
}

// Into sample order. Members mostly arrive in order, and sorting sorted input still moves each.
void sort_members(std::vector<Trajectory>& members) {
  auto by_index = [](const Trajectory& a, const Trajectory& b) { return a.sample_index < b.sample_index; };
  if (!std::is_sorted(members.begin(), members.end(), by_index)) std::sort(members.begin(), members.end(), by_index);
}

}  // namespace

// One mutex guards everything, the log's appends included, so that the log and the state move
// together; producers wait on space_cv, consumers on data_cv. The O(tokens) work of a push
// (validation, encoding its log record) is done before the lock is taken.
struct TrajectoryQueue::Impl {
  explicit Impl(TrajectoryQueueOptions o)
      : opt(std::move(o)),
        clock(opt.clock ? opt.clock : Clock::steady()),
        ids(opt.id_dedup_window),
        closed_groups(opt.id_dedup_window),
        expired_batches(kExpiredBatchMemory),
        newest(opt.initial_version) {}

  const TrajectoryQueueOptions opt;
  const std::shared_ptr<Clock> clock;
  std::unique_ptr<TrajectoryWal> wal;  // set by recover()
  RecoveryReport recovery;             // set by recover()
  std::vector<TrajectoryId> recovered_ids;  // set by recover()
  ClockSubscription clock_sub;

  // watch_room's callbacks, which run holding watch_mu (so unwatching waits for a running one)
  // and never mu: a watcher takes locks of its own, and calls into the queue without them.
  std::mutex watch_mu;
  std::map<std::uint64_t, std::function<void()>> watchers;
  std::uint64_t next_watch = 1;

  mutable std::mutex mu;
  std::condition_variable space_cv;
  std::condition_variable data_cv;

  // Everything below is guarded by mu.
  bool closed = false;
  internal::IdWindow ids;              // live trajectory ids and the recently retired
  internal::IdWindow closed_groups;    // recently closed groups
  internal::IdWindow expired_batches;  // recently expired leases
  Version newest;
  std::size_t held = 0, held_tokens = 0;  // pending, ready and leased: what capacity bounds

  std::unordered_map<GroupId, PendingGroup> groups;
  std::size_t pending_trajectories = 0;
  std::deque<GroupTimer> group_timers;  // FIFO: one timeout for all groups

  std::deque<Trajectory> ready;
  std::deque<Unit> units;  // over `ready`, in order
  std::size_t ready_tokens = 0;

  std::unordered_map<std::uint64_t, std::shared_ptr<internal::BatchData>> leases;
  std::size_t leased_trajectories = 0;
  std::priority_queue<Timer, std::vector<Timer>, std::greater<>> lease_timers;
  std::uint64_t next_batch_id = 1;

  std::size_t space_waiters = 0;
  std::size_t room_watches = 0;  // watchers registered: as good as waiters for room
  // The min_trajectories of each waiting consumer, and the smallest: fewer ready ends no wait, so
  // producers notify no one below it, and only once until a consumer waits again (one
  // notify_all reaches them all). A trainer waiting for a full batch is then woken once per
  // batch, not once per push.
  std::vector<std::size_t> waiter_mins;
  std::size_t wake_at = SIZE_MAX;
  bool waiters_woken = false;

  std::uint64_t pushed = 0, delivered = 0, acked = 0, nacked_batches = 0, expired_leases = 0, redelivered = 0;
  std::uint64_t rejected_invalid = 0, rejected_full = 0;
  std::uint64_t dropped_stale = 0, dropped_group_timeout = 0, dropped_late_for_group = 0;
  std::uint64_t staleness[TrajectoryQueueStats::kStalenessBuckets] = {};
  WaitHistogram group_wait;
  std::uint64_t wal_live_bytes = 0, compactions = 0;
  Status bg_error;

  void note_bg(Status s) {
    if (!s.ok() && bg_error.ok()) bg_error = std::move(s);
  }

  // Preconditions: mu is not held.
  void notify(Wake w) {
    if (w.data) data_cv.notify_all();
    if (w.space) {
      space_cv.notify_all();
      wake_watchers();
    }
  }

  // Preconditions: mu is not held.
  void wake_watchers() {
    std::lock_guard<std::mutex> l(watch_mu);
    for (auto& [id, wake] : watchers) wake();
  }

  // --- the ready queue ---

  // Whether, having made trajectories ready, the caller must wake the consumers.
  bool should_wake() {
    if (waiters_woken || ready.size() < wake_at) return false;
    waiters_woken = true;
    return true;
  }

  // A consumer wanting `min_count` ready waits until `until`, the next timer or a wake-up.
  void wait_for_data(std::unique_lock<std::mutex>& l, std::size_t min_count, Duration until) {
    waiters_woken = false;
    waiter_mins.push_back(min_count);
    wake_at = std::min(wake_at, min_count);
    clock->wait_until(data_cv, l, std::min(until, next_timer()));
    waiter_mins.erase(std::find(waiter_mins.begin(), waiter_mins.end(), min_count));
    wake_at = waiter_mins.empty() ? SIZE_MAX : *std::min_element(waiter_mins.begin(), waiter_mins.end());
  }

  // Members [first, last) become one ready unit, at the back or (redelivered) the front.
  template <class It>
  void add_unit(It first, It last, bool partial, std::uint32_t deliveries, bool front, Wake& w) {
    Unit u{std::uint32_t(last - first), 0, UINT64_MAX, deliveries, partial};
    for (It it = first; it != last; ++it) {
      u.tokens += it->num_tokens();
      u.min_version = std::min(u.min_version, it->version.value());
    }
    ready_tokens += u.tokens;
    if (front) {
      for (It it = last; it != first;) ready.push_front(Trajectory(*--it));
      units.push_front(std::move(u));
    } else {
      for (It it = first; it != last; ++it) ready.push_back(Trajectory(*it));
      units.push_back(std::move(u));
    }
    w.data |= should_wake();
  }

  // --- groups ---

  Status refuse_joining(const Trajectory& t, std::uint32_t group_size, PromptId prompt_id,
                        const std::vector<bool>& seen) {
    if (group_size != t.group_size || prompt_id != t.prompt_id) {
      return invalid_argument(fmt::format("trajectory {}: group {} has group_size {} and prompt {}, this member "
                                          "says {} and {}",
                                          t.id.value(), t.group_id.value(), group_size, prompt_id.value(), t.group_size,
                                          t.prompt_id.value()));
    }
    if (seen[t.sample_index]) {
      return invalid_argument(
          fmt::format("trajectory {}: group {} already has sample_index {}", t.id.value(), t.group_id.value(),
                      t.sample_index));
    }
    return ok_status();
  }

  // Closes group `it`: its members go to the consumers as one unit (or, timed out under kDrop,
  // are retired).
  void close_group(std::unordered_map<GroupId, PendingGroup>::iterator it, Duration now, bool complete,
                   Wake& w) {
    const GroupId gid = it->first;
    PendingGroup& g = it->second;
    add_wait(group_wait, now - g.first_arrival);
    closed_groups.retire(gid.value());
    pending_trajectories -= g.members.size();
    // A complete group's record is not synced on its own: a replay closes a complete group anyway,
    // and the acks of its members, later in the log, sync it. A failed write only means a late
    // duplicate member could be taken after a restart, so it is reported, not undone.
    if (wal) note_bg(wal->append_u64(WalRecordType::kGroupClosed, gid.value(), /*sync=*/!complete));
    if (complete || opt.partial_group_policy == PartialGroupPolicy::kRelease) {
      sort_members(g.members);
      add_unit(std::make_move_iterator(g.members.begin()), std::make_move_iterator(g.members.end()), !complete, 0,
               false, w);
    } else {
      dropped_group_timeout += g.members.size();
      retire(g.members, WalRetireReason::kGroupTimeout, w);
    }
    groups.erase(it);
  }

  // The pending group of `t`, opened at `now` if it was not; true if it was opened.
  std::pair<std::unordered_map<GroupId, PendingGroup>::iterator, bool> open_group(const Trajectory& t, Duration now) {
    auto r = groups.try_emplace(t.group_id);
    if (r.second) {
      PendingGroup& g = r.first->second;
      g.group_size = t.group_size;
      g.prompt_id = t.prompt_id;
      g.first_arrival = now;
      g.seen.assign(t.group_size, false);
      g.members.reserve(t.group_size);
    }
    return r;
  }

  // `t`, which check() let through, joins its group (opening it at `now`).
  void add_member(Trajectory&& t, Duration now, Wake& w) {
    auto [it, fresh] = open_group(t, now);
    PendingGroup& g = it->second;
    if (fresh) {
      if (opt.group_timeout != kForever) {
        group_timers.emplace_back(now + opt.group_timeout, t.group_id);
        if (group_timers.size() > 2 * groups.size() + kStaleTimers) prune_group_timers();
      }
    }
    g.seen[t.sample_index] = true;
    g.members.push_back(std::move(t));
    ++pending_trajectories;
    if (g.members.size() == g.group_size) close_group(it, now, /*complete=*/true, w);
  }

  // Drops the timers of groups no longer pending: completed groups leave theirs behind, which
  // would otherwise pile up for a whole group_timeout at the push rate.
  void prune_group_timers() {
    std::erase_if(group_timers, [&](const GroupTimer& d) {
      auto it = groups.find(d.second);
      return it == groups.end() || it->second.first_arrival + opt.group_timeout != d.first;
    });
  }

  // --- timers ---

  void run_timers(Duration now, Wake& w) {
    while (!group_timers.empty() && group_timers.front().first <= now) {
      const auto [deadline, gid] = group_timers.front();
      group_timers.pop_front();
      auto it = groups.find(gid);
      if (it != groups.end() && it->second.first_arrival + opt.group_timeout == deadline) {
        close_group(it, now, /*complete=*/false, w);
      }
    }
    while (!lease_timers.empty() && lease_timers.top().first <= now) {
      const auto [deadline, id] = lease_timers.top();
      lease_timers.pop();
      auto it = leases.find(id);
      if (it == leases.end() || it->second->deadline != deadline) continue;
      ++expired_leases;
      expired_batches.retire(id);
      requeue(it, w);
    }
  }

  Duration next_group_timer() const { return group_timers.empty() ? kForever : group_timers.front().first; }
  Duration next_timer() const {
    return std::min(next_group_timer(), lease_timers.empty() ? kForever : lease_timers.top().first);
  }

  // --- leaving the queue ---

  // Trajectories acked or dropped: their room is freed, their ids stay refused for the window.
  void retire(const std::vector<Trajectory>& ts, WalRetireReason reason, Wake& w) {
    if (ts.empty()) return;
    if (wal) {
      std::vector<std::uint64_t> log_ids;
      log_ids.reserve(ts.size());
      for (const Trajectory& t : ts) log_ids.push_back(t.id.value());
      // Acks are logged by ack() before it changes anything; the rest cannot be refused, so a
      // failed record is reported: the log then still holds them as live, and a restart
      // redelivers them rather than lose them.
      if (reason != WalRetireReason::kAck) note_bg(wal->append_retire(reason, log_ids));
    }
    for (const Trajectory& t : ts) {
      ids.retire(t.id.value());
      held_tokens -= t.num_tokens();
      if (wal) wal_live_bytes -= TrajectoryWal::push_record_bytes(t);
    }
    held -= ts.size();
    w.space |= space_waiters > 0 || room_watches > 0;
  }

  // Returns a leased batch to the front of the ready queue, its units in their order (nack or
  // expiry).
  void requeue(std::unordered_map<std::uint64_t, std::shared_ptr<internal::BatchData>>::iterator it, Wake& w) {
    std::shared_ptr<internal::BatchData> d = std::move(it->second);
    leases.erase(it);
    const bool sole = d.use_count() == 1;  // the consumer let go: move instead of copy
    leased_trajectories -= d->items.size();
    redelivered += d->items.size();
    for (std::size_t end = d->items.size(), i = end; i-- > 0;) {
      if (d->unit_len[i] == 0) continue;
      auto first = d->items.begin() + std::ptrdiff_t(i), last = d->items.begin() + std::ptrdiff_t(end);
      if (sole) {
        add_unit(std::make_move_iterator(first), std::make_move_iterator(last), d->info[i].partial_group,
                 d->info[i].delivery, true, w);
      } else {
        add_unit(first, last, d->info[i].partial_group, d->info[i].delivery, true, w);
      }
      end = i;
    }
  }

  // Why ack or nack (`op`) finds no lease of `batch`.
  Status not_leased(const char* op, BatchId batch) const {
    if (expired_batches.retired(batch.value())) {
      return aborted(fmt::format("{}: the lease of batch {} expired; its trajectories were requeued", op, batch.value()));
    }
    return not_found(fmt::format("{}: batch {} is not leased (unknown or already acked)", op, batch.value()));
  }

  // With a log: rewrites it with only what is live, once it is large and at least half dead.
  void maybe_compact() {
    if (!wal || wal->bytes() < opt.wal_compact_bytes || wal_live_bytes * 2 > wal->bytes()) return;
    TrajectoryWal::Snapshot s;
    s.newest = newest;
    ids.for_each_retired([&](std::uint64_t id) { s.window.push_back(id); });
    closed_groups.for_each_retired([&](std::uint64_t gid) { s.closed_groups.push_back(GroupId(gid)); });
    // Ready first, in order, so that a restart delivers them in the same order.
    for (std::size_t i = 0; i < ready.size(); ++i) s.live.push_back(&ready[i]);
    for (const auto& [id, d] : leases) {
      for (const Trajectory& t : d->items) s.live.push_back(&t);
    }
    for (const auto& [gid, g] : groups) {
      for (const Trajectory& t : g.members) s.live.push_back(&t);
    }
    Status st = wal->compact(s);
    if (st.ok()) ++compactions;
    note_bg(std::move(st));
  }

  // --- taking a batch ---

  // pop_batch's batch, from the front of the ready queue: units leave it dropped as stale (judged
  // by their stalest member, and dropped whole: a partial GRPO group would bias the advantage
  // baseline) or taken, until a limit. Null when too few are left once the stale ones are
  // dropped: those taken go back and wait for company.
  std::shared_ptr<internal::BatchData> take_batch(const BatchSpec& spec, Duration now, Wake& w) {
    const std::size_t max_count = spec.max_trajectories ? spec.max_trajectories : SIZE_MAX;
    const std::size_t max_tokens = spec.max_tokens ? spec.max_tokens : SIZE_MAX;
    std::vector<Trajectory> taken, dropped;
    taken.reserve(std::min(max_count, ready.size()));
    std::vector<Unit> taken_units;
    std::size_t tokens = 0;
    bool full = false;  // a limit stopped the batch
    while (!units.empty()) {
      const Unit u = units.front();
      const bool drop =
          spec.staleness_rule == StalenessRule::kDrop && staleness_of(spec, u.min_version) > spec.max_staleness;
      if (!drop && !taken.empty() && (taken.size() + u.len > max_count || tokens + u.tokens > max_tokens)) {
        full = true;
        break;
      }
      units.pop_front();
      ready_tokens -= u.tokens;
      std::vector<Trajectory>& to = drop ? dropped : taken;
      for (std::uint32_t k = 0; k < u.len; ++k) {
        to.push_back(std::move(ready.front()));
        ready.pop_front();
      }
      if (drop) continue;
      taken_units.push_back(u);
      tokens += u.tokens;
      if (taken.size() >= max_count || tokens >= max_tokens) {
        full = true;
        break;
      }
    }
    if (!dropped.empty()) {
      dropped_stale += dropped.size();
      retire(dropped, WalRetireReason::kStale, w);
    }
    if (taken.size() < min_count_of(spec) && !full) {
      for (std::size_t k = taken_units.size(), end = taken.size(); k-- > 0;) {
        const Unit& u = taken_units[k];
        for (std::size_t k2 = end; k2-- > end - u.len;) ready.push_front(std::move(taken[k2]));
        units.push_front(Unit(u));
        ready_tokens += u.tokens;
        end -= u.len;
      }
      return nullptr;
    }
    return lease_out(std::move(taken), taken_units, tokens, spec, now);
  }

  // `taken`, made of `taken_units`, leased out as a new batch.
  std::shared_ptr<internal::BatchData> lease_out(std::vector<Trajectory> taken, const std::vector<Unit>& taken_units,
                                                 std::size_t tokens, const BatchSpec& spec, Duration now) {
    auto d = std::make_shared<internal::BatchData>();
    d->id = BatchId(next_batch_id++);
    d->tokens = tokens;
    d->deadline = deadline_after(now, spec.lease > Duration::zero() ? spec.lease : opt.default_lease);
    d->info.reserve(taken.size());
    d->unit_len.reserve(taken.size());
    for (const Unit& u : taken_units) {
      for (std::uint32_t k = 0; k < u.len; ++k) {
        const std::uint64_t s = staleness_of(spec, taken[d->info.size()].version.value());
        const bool over = spec.staleness_rule == StalenessRule::kKeepAndMark && s > spec.max_staleness;
        d->info.push_back(TrajectoryInfo{s, over, u.partial_group, u.deliveries + 1});
        d->unit_len.push_back(k == 0 ? u.len : 0);
        ++staleness[std::min<std::uint64_t>(s, TrajectoryQueueStats::kStalenessBuckets - 1)];
      }
    }
    d->items = std::move(taken);
    leased_trajectories += d->items.size();
    delivered += d->items.size();
    if (d->deadline != kForever) lease_timers.emplace(d->deadline, d->id.value());
    leases.emplace(d->id.value(), d);
    if (lease_timers.size() > 2 * leases.size() + kStaleTimers) {
      // Acked and nacked batches leave their timers behind; keep only the live ones.
      std::vector<Timer> live;
      for (const auto& [id, b] : leases) {
        if (b->deadline != kForever) live.emplace_back(b->deadline, id);
      }
      lease_timers = decltype(lease_timers)(std::greater<>(), std::move(live));
    }
    return d;
  }

  // --- restart ---

  // Opens the log at opt.wal_path and takes back what it holds: the dedup windows, the newest
  // version, and each live trajectory, ready or in its pending group as before the restart.
  Status recover() {
    TrajectoryWal::Contents c;
    // Straight into the windows, which keep as many as a queue that never restarted would.
    const TrajectoryWal::Listener listener{[this](std::uint64_t id) { ids.retire(id); },
                                           [this](GroupId g) { closed_groups.retire(g.value()); }};
    Result<std::unique_ptr<TrajectoryWal>> opened =
        TrajectoryWal::open(opt.wal_path, opt.wal_fsync, listener, c, recovery);
    if (!opened.ok()) return opened.status();
    wal = std::move(opened).value();
    recovery.retired = c.retired;
    newest = std::max(newest, c.newest);
    wal_live_bytes = c.live_bytes;
    const Duration now = clock->now();
    Wake w;
    std::vector<GroupId> group_order;
    for (Trajectory& t : c.live) {
      // A live id the log also lists as retired stays refused either way.
      ids.set_live(t.id.value());
      recovered_ids.push_back(t.id);
      ++held;
      held_tokens += t.num_tokens();
      if (t.group_size == 1) {
        add_unit(std::make_move_iterator(&t), std::make_move_iterator(&t + 1), false, 0, false, w);
        continue;
      }
      auto [it, fresh] = open_group(t, now);
      PendingGroup& g = it->second;
      if (fresh) group_order.push_back(t.group_id);
      if (t.group_size != g.group_size || g.seen[t.sample_index]) {
        return data_loss(fmt::format("WAL {}: trajectory {} does not fit its group {}", opt.wal_path, t.id.value(),
                                     t.group_id.value()));
      }
      g.seen[t.sample_index] = true;
      g.members.push_back(std::move(t));
      ++pending_trajectories;
    }
    for (GroupId gid : group_order) {
      auto it = groups.find(gid);
      const bool complete = it->second.members.size() == it->second.group_size;
      if (complete || closed_groups.retired(gid.value())) {
        // Released as they were (or would have been) before the restart; the log already says so.
        PendingGroup& g = it->second;
        if (!closed_groups.retired(gid.value())) closed_groups.retire(gid.value());
        pending_trajectories -= g.members.size();
        sort_members(g.members);
        add_unit(std::make_move_iterator(g.members.begin()), std::make_move_iterator(g.members.end()), !complete, 0,
                 false, w);
        groups.erase(it);
      } else if (opt.group_timeout != kForever) {
        // The timer restarts: how long the group waited before the restart is not in the log.
        group_timers.emplace_back(now + opt.group_timeout, gid);
      }
    }
    return ok_status();
  }

  // --- admission, shared by push and push_many ---

  // Checks ts[in] in order against the state, as the earlier accepted ones would leave it.
  Plan check(std::span<Trajectory> ts, std::span<const std::uint32_t> in) {
    Plan p;
    std::unordered_set<std::uint64_t> call_ids;       // ids accepted earlier in this call
    std::unordered_map<GroupId, GroupView> views;  // groups as this call leaves them
    const bool many = in.size() > 1;
    for (std::uint32_t i : in) {
      const Trajectory& t = ts[i];
      const std::uint64_t id = t.id.value();
      auto refuse = [&](Status s) { p.refused.emplace_back(i, std::move(s)); };
      if (t.version > newest) {
        refuse(invalid_argument(fmt::format("trajectory {}: version {} is ahead of the newest published version {}",
                                            id, t.version.value(), newest.value())));
        continue;
      }
      if (t.num_tokens() > opt.capacity_tokens) {
        refuse(invalid_argument(fmt::format("trajectory {}: {} tokens exceed the queue's capacity of {} tokens", id,
                                            t.num_tokens(), opt.capacity_tokens)));
        continue;
      }
      if (t.group_size > opt.capacity_trajectories) {
        refuse(invalid_argument(fmt::format("trajectory {}: group_size {} exceeds capacity_trajectories {}", id,
                                            t.group_size, opt.capacity_trajectories)));
        continue;
      }
      if (ids.contains(id) || call_ids.count(id) != 0) {
        refuse(already_exists(fmt::format("trajectory {}: id already pushed", id)));
        continue;
      }
      if (t.group_size > 1) {
        Status s;
        bool is_closed = false;
        auto v = views.find(t.group_id);
        if (v != views.end()) {
          is_closed = v->second.count == v->second.group_size;
          if (!is_closed) s = refuse_joining(t, v->second.group_size, v->second.prompt_id, v->second.seen);
        } else if (auto g = groups.find(t.group_id); g != groups.end()) {
          s = refuse_joining(t, g->second.group_size, g->second.prompt_id, g->second.seen);
          if (s.ok() && many) {
            v = views.emplace(t.group_id, GroupView{g->second.group_size, g->second.prompt_id, g->second.seen,
                                                    std::uint32_t(g->second.members.size())})
                    .first;
          }
        } else if (closed_groups.retired(t.group_id.value())) {
          is_closed = true;
        } else if (many) {
          v = views.emplace(t.group_id, GroupView{t.group_size, t.prompt_id, std::vector<bool>(t.group_size), 0})
                  .first;
        }
        if (is_closed) {
          s = failed_precondition(fmt::format(
              "trajectory {}: group {} is already closed (complete, released or dropped)", id, t.group_id.value()));
        }
        if (!s.ok()) {
          refuse(std::move(s));
          continue;
        }
        if (many) {
          v->second.seen[t.sample_index] = true;
          ++v->second.count;
        }
      }
      if (many) call_ids.insert(id);
      p.accepted.push_back(i);
      p.tokens += t.num_tokens();
    }
    return p;
  }

  bool fits(std::size_t count, std::size_t tokens) const {
    return held + count <= opt.capacity_trajectories && held_tokens + tokens <= opt.capacity_tokens;
  }

  // Makes a plan happen: its refusals are answered and counted, its accepted trajectories go in
  // (with their WAL records, which `records` holds by index).
  void commit(Plan& p, std::span<Trajectory> ts, std::span<Status> out,
              std::span<const TrajectoryWal::Record> records, Duration now, Wake& w) {
    for (auto& [i, s] : p.refused) {
      if (s.code() == StatusCode::kFailedPrecondition) {
        ++dropped_late_for_group;
      } else {
        ++rejected_invalid;
      }
      out[i] = std::move(s);
    }
    if (p.accepted.empty()) return;
    if (wal) {
      std::vector<TrajectoryWal::Record> rs;
      rs.reserve(p.accepted.size());
      for (std::uint32_t i : p.accepted) rs.push_back(records[i]);
      if (Status s = wal->append_all(rs); !s.ok()) {
        for (std::uint32_t i : p.accepted) out[i] = s;
        return;
      }
    }
    for (std::uint32_t i : p.accepted) {
      Trajectory& t = ts[i];
      ids.admit(t.id.value());
      ++held;
      held_tokens += t.num_tokens();
      ++pushed;
      if (wal) wal_live_bytes += TrajectoryWal::push_record_bytes(t);
      if (t.group_size == 1) {
        add_unit(std::make_move_iterator(&t), std::make_move_iterator(&t + 1), false, 0, false, w);
      } else {
        add_member(std::move(t), now, w);
      }
    }
  }

  // Admits ts[in], all together or, for several without room for all and `split`, one at a time
  // in order; waits for room as `o` says. Answers out[i] for each of `in`.
  void admit(std::span<Trajectory> ts, std::span<const std::uint32_t> in, const PushOptions& o, bool split,
             std::span<Status> out, std::span<const TrajectoryWal::Record> records, std::unique_lock<std::mutex>& l,
             Wake& w) {
    Duration deadline = kForever;
    bool first = true;
    for (;;) {
      const Duration now = clock->now();
      if (first && o.mode == PushMode::kTimeout) deadline = deadline_after(now, o.timeout);
      first = false;
      auto fail_all = [&](Plan& p, auto status_of) {
        for (std::uint32_t i : p.accepted) out[i] = status_of(ts[i].id.value());
        rejected_full += p.accepted.size();
        p.accepted.clear();
        commit(p, ts, out, records, now, w);
      };
      if (closed) {
        for (std::uint32_t i : in) {
          out[i] = cancelled(fmt::format("push of trajectory {}: the queue is closed", ts[i].id.value()));
        }
        rejected_full += in.size();
        return;
      }
      run_timers(now, w);
      Plan p = check(ts, in);
      if (p.accepted.empty() || fits(p.accepted.size(), p.tokens)) return commit(p, ts, out, records, now, w);
      if (split && in.size() > 1) {
        for (std::size_t k = 0; k < in.size(); ++k) admit(ts, in.subspan(k, 1), o, false, out, records, l, w);
        return;
      }
      if (o.mode == PushMode::kFailFast) {
        return fail_all(p, [&](std::uint64_t id) {
          return unavailable(fmt::format("push of trajectory {}: queue full ({} of {} trajectories, {} of {} tokens)",
                                         id, held, opt.capacity_trajectories, held_tokens, opt.capacity_tokens));
        });
      }
      if (now >= deadline) {
        return fail_all(p, [&](std::uint64_t id) {
          return deadline_exceeded(
              fmt::format("push of trajectory {}: queue still full after {} ns", id, o.timeout.count()));
        });
      }
      if (w.data || w.space) {
        // Wake whom the timers woke before sleeping, then look again: the lock was let go.
        l.unlock();
        notify(std::exchange(w, Wake{}));
        l.lock();
        continue;
      }
      ++space_waiters;
      // A group timeout may drop members and so free room, or close a group a member waits for.
      clock->wait_until(space_cv, l, std::min(deadline, next_group_timer()));
      --space_waiters;
    }
  }

  void push_all(std::span<Trajectory> ts, const PushOptions& o, std::span<Status> out) {
    if (o.mode == PushMode::kTimeout && o.timeout < Duration::zero()) {
      for (Status& s : out) s = invalid_argument(fmt::format("push: negative timeout {} ns", o.timeout.count()));
      return;
    }
    // The O(tokens) work is done before the lock is taken: validation, and with a log, encoding
    // and checksumming each record.
    std::vector<std::uint32_t> in;
    in.reserve(ts.size());
    std::uint64_t invalid = 0;
    for (std::uint32_t i = 0; i < ts.size(); ++i) {
      out[i] = validate_trajectory(ts[i], opt.validate_contents);
      if (out[i].ok()) {
        in.push_back(i);
      } else {
        ++invalid;
      }
    }
    std::string encoded;
    std::vector<TrajectoryWal::Record> records;
    if (wal && !in.empty()) {
      std::vector<std::size_t> at(ts.size() + 1, 0);
      for (std::uint32_t i = 0; i < ts.size(); ++i) {
        if (out[i].ok()) encode_trajectory(ts[i], encoded);
        at[i + 1] = encoded.size();
      }
      records.resize(ts.size());
      for (std::uint32_t i : in) {
        const std::string_view payload = std::string_view(encoded).substr(at[i], at[i + 1] - at[i]);
        records[i] = {WalRecordType::kPush, payload, TrajectoryWal::checksum(WalRecordType::kPush, payload)};
      }
    }
    Wake w;
    std::unique_lock<std::mutex> l(mu);
    rejected_invalid += invalid;
    if (!in.empty()) admit(ts, in, o, /*split=*/true, out, records, l, w);
    l.unlock();
    notify(w);
  }
};

TrajectoryQueue::TrajectoryQueue(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TrajectoryQueue::~TrajectoryQueue() {
  // First: afterwards no clock callback can reach the queue.
  impl_->clock_sub.reset();
}

Result<std::unique_ptr<TrajectoryQueue>> TrajectoryQueue::create(TrajectoryQueueOptions options) {
  if (options.capacity_trajectories == 0) return invalid_argument("TrajectoryQueueOptions: capacity_trajectories is 0");
  if (options.capacity_tokens == 0) return invalid_argument("TrajectoryQueueOptions: capacity_tokens is 0");
  if (options.capacity_trajectories > kMaxCapacityTrajectories || options.capacity_tokens > kMaxCapacityTokens) {
    return invalid_argument(fmt::format(
        "TrajectoryQueueOptions: capacity of {} trajectories and {} tokens is above the limit of {} and {}",
        options.capacity_trajectories, options.capacity_tokens, kMaxCapacityTrajectories, kMaxCapacityTokens));
  }
  if (options.default_lease <= Duration::zero()) {
    return invalid_argument(
        fmt::format("TrajectoryQueueOptions: default_lease {} ns is not positive", options.default_lease.count()));
  }
  if (options.group_timeout <= Duration::zero()) {
    return invalid_argument(
        fmt::format("TrajectoryQueueOptions: group_timeout {} ns is not positive", options.group_timeout.count()));
  }
  if (options.id_dedup_window == 0 || options.id_dedup_window > kMaxWindow) {
    return invalid_argument(
        fmt::format("TrajectoryQueueOptions: id_dedup_window {} is not in [1, {}]", options.id_dedup_window, kMaxWindow));
  }
  auto impl = std::make_unique<Impl>(std::move(options));
  Impl& q = *impl;
  if (!q.opt.wal_path.empty()) LAMINAR_RETURN_IF_ERROR(q.recover());
  Impl* raw = impl.get();
  impl->clock_sub = impl->clock->subscribe([raw] {
    {
      std::lock_guard<std::mutex> l(raw->mu);
      raw->space_cv.notify_all();
      raw->data_cv.notify_all();
    }
    // A group timeout may have fallen due: what only the next call runs, a watcher should make.
    raw->wake_watchers();
  });
  return std::unique_ptr<TrajectoryQueue>(new TrajectoryQueue(std::move(impl)));
}

Status TrajectoryQueue::publish_version(Version v) {
  Impl& q = *impl_;
  std::lock_guard<std::mutex> l(q.mu);
  if (v < q.newest) {
    return invalid_argument(fmt::format("publish_version: version {} is older than the newest published {}",
                                        v.value(), q.newest.value()));
  }
  if (v == q.newest) return ok_status();
  if (q.wal) LAMINAR_RETURN_IF_ERROR(q.wal->append_u64(WalRecordType::kVersion, v.value()));
  q.newest = v;
  return ok_status();
}

Version TrajectoryQueue::newest_version() const noexcept {
  std::lock_guard<std::mutex> l(impl_->mu);
  return impl_->newest;
}

Status TrajectoryQueue::push(Trajectory&& t, PushOptions options) {
  Status out;
  impl_->push_all(std::span<Trajectory>(&t, 1), options, std::span<Status>(&out, 1));
  return out;
}

std::vector<Status> TrajectoryQueue::push_many(std::span<Trajectory> ts, PushOptions options) {
  std::vector<Status> out(ts.size());
  impl_->push_all(ts, options, out);
  return out;
}

Result<Batch> TrajectoryQueue::pop_batch(const BatchSpec& spec) {
  Impl& q = *impl_;
  if (spec.max_trajectories == 0 && spec.max_tokens == 0) {
    return invalid_argument("BatchSpec: neither max_trajectories nor max_tokens is set");
  }
  if (spec.max_trajectories != 0 && spec.min_trajectories > spec.max_trajectories) {
    return invalid_argument(fmt::format("BatchSpec: min_trajectories {} exceeds max_trajectories {}",
                                        spec.min_trajectories, spec.max_trajectories));
  }
  if (spec.wait < Duration::zero() || spec.lease < Duration::zero()) {
    return invalid_argument(fmt::format("BatchSpec: negative wait ({} ns) or lease ({} ns)", spec.wait.count(),
                                        spec.lease.count()));
  }
  const std::size_t min_count = min_count_of(spec);

  Wake w;
  std::unique_lock<std::mutex> l(q.mu);
  auto leave = [&](Result<Batch> r) {
    l.unlock();
    q.notify(w);
    return r;
  };
  if (spec.consumer_version > q.newest) {
    return leave(invalid_argument(fmt::format("BatchSpec: consumer_version {} is ahead of the newest published {}",
                                              spec.consumer_version.value(), q.newest.value())));
  }
  Duration now = q.clock->now();
  const Duration deadline = deadline_after(now, spec.wait);
  for (;;) {
    if (q.closed) return leave(cancelled("pop_batch: the queue is closed"));
    q.run_timers(now, w);
    if (q.ready.size() >= min_count) {
      if (auto d = q.take_batch(spec, now, w)) return leave(Batch(std::move(d)));
    }
    if (spec.wait == Duration::zero()) {
      return leave(unavailable(fmt::format("pop_batch: {} trajectories ready, {} wanted", q.ready.size(), min_count)));
    }
    if (now >= deadline) {
      return leave(deadline_exceeded(fmt::format("pop_batch: only {} of {} trajectories ready after {} ns",
                                                 q.ready.size(), min_count, spec.wait.count())));
    }
    if (w.data || w.space) {
      // Wake whom the timers woke before sleeping, then look again: the lock was let go.
      l.unlock();
      q.notify(std::exchange(w, Wake{}));
      l.lock();
      now = q.clock->now();
      continue;
    }
    q.wait_for_data(l, min_count, deadline);
    now = q.clock->now();
  }
}

Status TrajectoryQueue::ack(BatchId batch) {
  Impl& q = *impl_;
  Wake w;
  std::unique_lock<std::mutex> l(q.mu);
  auto leave = [&](Status s) {
    l.unlock();
    q.notify(w);
    return s;
  };
  q.run_timers(q.clock->now(), w);
  auto it = q.leases.find(batch.value());
  if (it == q.leases.end()) return leave(q.not_leased("ack", batch));
  std::shared_ptr<internal::BatchData> d = std::move(it->second);
  if (q.wal) {
    std::vector<std::uint64_t> ids;
    ids.reserve(d->items.size());
    for (const Trajectory& t : d->items) ids.push_back(t.id.value());
    // Logged first: if the log cannot take the ack, the batch stays leased and may be acked again.
    if (Status s = q.wal->append_retire(WalRetireReason::kAck, ids); !s.ok()) {
      it->second = std::move(d);
      return leave(std::move(s));
    }
  }
  q.leases.erase(it);
  q.leased_trajectories -= d->items.size();
  q.acked += d->items.size();
  q.retire(d->items, WalRetireReason::kAck, w);
  q.maybe_compact();
  return leave(ok_status());
}

Status TrajectoryQueue::nack(BatchId batch) {
  Impl& q = *impl_;
  Wake w;
  std::unique_lock<std::mutex> l(q.mu);
  auto leave = [&](Status s) {
    l.unlock();
    q.notify(w);
    return s;
  };
  q.run_timers(q.clock->now(), w);
  auto it = q.leases.find(batch.value());
  if (it == q.leases.end()) return leave(q.not_leased("nack", batch));
  ++q.nacked_batches;
  q.requeue(it, w);
  return leave(ok_status());
}

void TrajectoryQueue::close() {
  Impl& q = *impl_;
  {
    std::lock_guard<std::mutex> l(q.mu);
    q.closed = true;
  }
  q.notify(Wake{true, true});
}

TrajectoryQueueStats TrajectoryQueue::stats() const {
  const Impl& q = *impl_;
  std::lock_guard<std::mutex> l(q.mu);
  TrajectoryQueueStats s;
  s.ready = q.ready.size();
  s.ready_tokens = q.ready_tokens;
  s.pending_groups = q.groups.size();
  s.pending_group_trajectories = q.pending_trajectories;
  s.leases = q.leases.size();
  s.leased_trajectories = q.leased_trajectories;
  s.held_tokens = q.held_tokens;
  s.blocked_producers = q.space_waiters;
  s.blocked_consumers = q.waiter_mins.size();
  s.newest_version = q.newest;
  s.pushed = q.pushed;
  s.delivered = q.delivered;
  s.acked = q.acked;
  s.nacked_batches = q.nacked_batches;
  s.expired_leases = q.expired_leases;
  s.redelivered = q.redelivered;
  s.rejected_invalid = q.rejected_invalid;
  s.rejected_full = q.rejected_full;
  s.dropped_stale = q.dropped_stale;
  s.dropped_group_timeout = q.dropped_group_timeout;
  s.dropped_late_for_group = q.dropped_late_for_group;
  std::copy(std::begin(q.staleness), std::end(q.staleness), s.staleness);
  s.group_wait = q.group_wait;
  s.wal = q.wal != nullptr;
  if (q.wal) {
    s.wal_bytes = q.wal->bytes();
    s.wal_records = q.wal->records();
    s.wal_compactions = q.compactions;
  }
  return s;
}

RoomWatch TrajectoryQueue::watch_room(std::function<void()> wake) {
  Impl& q = *impl_;
  std::uint64_t id = 0;
  {
    std::lock_guard<std::mutex> l(q.watch_mu);
    id = q.next_watch++;
    q.watchers.emplace(id, std::move(wake));
  }
  std::lock_guard<std::mutex> l(q.mu);
  ++q.room_watches;
  return RoomWatch(this, id);
}

void TrajectoryQueue::unwatch_room(std::uint64_t id) noexcept {
  Impl& q = *impl_;
  {
    std::lock_guard<std::mutex> l(q.watch_mu);
    q.watchers.erase(id);
  }
  std::lock_guard<std::mutex> l(q.mu);
  --q.room_watches;
}

Duration TrajectoryQueue::until_group_timeout() const {
  const Impl& q = *impl_;
  std::lock_guard<std::mutex> l(q.mu);
  const Duration at = q.next_group_timer();
  return at == kForever ? kForever : std::max(at - q.clock->now(), Duration::zero());
}

RoomWatch& RoomWatch::operator=(RoomWatch&& o) noexcept {
  if (this != &o) {
    reset();
    queue_ = std::exchange(o.queue_, nullptr);
    id_ = o.id_;
  }
  return *this;
}

void RoomWatch::reset() noexcept {
  if (queue_ != nullptr) std::exchange(queue_, nullptr)->unwatch_room(id_);
}

const RecoveryReport& TrajectoryQueue::recovery() const noexcept { return impl_->recovery; }
std::span<const TrajectoryId> TrajectoryQueue::recovered_ids() const noexcept { return impl_->recovered_ids; }

Status TrajectoryQueue::background_error() const {
  std::lock_guard<std::mutex> l(impl_->mu);
  return impl_->bg_error;
}

}  // namespace laminar
