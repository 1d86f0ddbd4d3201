#include "laminar/trajectory_queue.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <atomic>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>
#include <unordered_set>
#include <thread>
#include <utility>

#include "trajectory_wal.h"

namespace laminar {

static_assert(std::endian::native == std::endian::little,
              "the trajectory encoding is little-endian and copied as is");

std::string_view finish_reason_name(FinishReason r) noexcept {
  switch (r) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
    case FinishReason::kError: return "error";
  }
  return "unknown";
}

namespace {

// A log-probability above 0 is a probability above 1; this much is allowed for rounding in
// the engine's softmax.
constexpr float kMaxLogprob = 1e-3f;

Status check_tokens(const std::vector<std::int32_t>& tokens, std::string_view field,
                    TrajectoryId id) {
  // Branch-free scan (vectorises); the slow path only runs to name the culprit.
  std::int32_t min_token = 0;
  for (std::int32_t tok : tokens) min_token = std::min(min_token, tok);
  if (min_token >= 0) return ok_status();
  const auto it = std::find_if(tokens.begin(), tokens.end(), [](std::int32_t x) { return x < 0; });
  return invalid_argument(fmt::format("trajectory {}: {}[{}] = {} is a negative token id", id.value(),
                                      field, it - tokens.begin(), *it));
}

}  // namespace

namespace {

// The O(tokens) part of validate_trajectory.
Status validate_contents(const Trajectory& t) {
  const std::uint64_t id = t.id.value();
  LAMINAR_RETURN_IF_ERROR(check_tokens(t.prompt_tokens, "prompt_tokens", t.id));
  LAMINAR_RETURN_IF_ERROR(check_tokens(t.response_tokens, "response_tokens", t.id));
  // One branch-free pass; the slow pass only runs to name the culprit.
  // On the bits, so it vectorises: an exponent of all ones is inf or NaN; as signed integers,
  // positive floats order like their values and negative ones are all below kMaxLogprob's.
  std::int32_t max_bits;
  std::memcpy(&max_bits, &kMaxLogprob, 4);
  std::uint32_t bad = 0;
  for (float lp : t.logprobs) {
    std::uint32_t b;
    std::memcpy(&b, &lp, 4);
    bad |= std::uint32_t((b & 0x7f800000u) == 0x7f800000u) | std::uint32_t(std::int32_t(b) > max_bits);
  }
  if (bad != 0) {
    for (std::size_t i = 0; i < t.logprobs.size(); ++i) {
      const float lp = t.logprobs[i];
      if (!std::isfinite(lp) || lp > kMaxLogprob) {
        return invalid_argument(fmt::format("trajectory {}: logprobs[{}] = {} is not a log-probability",
                                            id, i, lp));
      }
    }
  }
  if (!t.metadata.empty()) {
    const auto first = t.metadata.find_first_not_of(" \t\r\n");
    if (first == std::string::npos || t.metadata[first] != '{' ||
        !nlohmann::json::accept(t.metadata)) {
      return invalid_argument(fmt::format("trajectory {}: metadata is not a JSON object: '{}'", id,
                                          t.metadata.substr(0, 64)));
    }
  }
  return ok_status();
}

}  // namespace

Status validate_trajectory(const Trajectory& t, bool contents) {
  const std::uint64_t id = t.id.value();
  if (t.logprobs.size() != t.response_tokens.size()) {
    return invalid_argument(fmt::format("trajectory {}: {} logprobs for {} response tokens", id,
                                        t.logprobs.size(), t.response_tokens.size()));
  }
  if (contents) LAMINAR_RETURN_IF_ERROR(validate_contents(t));
  if (t.rewards.empty()) return invalid_argument(fmt::format("trajectory {}: no reward", id));
  for (std::size_t i = 0; i < t.rewards.size(); ++i) {
    if (!std::isfinite(t.rewards[i])) {
      return invalid_argument(fmt::format("trajectory {}: rewards[{}] = {} is not finite", id, i,
                                          t.rewards[i]));
    }
  }
  if (t.group_size == 0) return invalid_argument(fmt::format("trajectory {}: group_size is 0", id));
  if (t.sample_index >= t.group_size) {
    return invalid_argument(fmt::format("trajectory {}: sample_index {} is not below group_size {}", id,
                                        t.sample_index, t.group_size));
  }
  if (t.timings.generation_end_ns < t.timings.generation_start_ns) {
    return invalid_argument(fmt::format("trajectory {}: generation ends at {} ns, before it starts at {} ns",
                                        id, t.timings.generation_end_ns,
                                        t.timings.generation_start_ns));
  }
  if (std::uint8_t(t.finish_reason) > std::uint8_t(FinishReason::kError)) {
    return invalid_argument(fmt::format("trajectory {}: finish_reason {} is not a FinishReason", id,
                                        int(t.finish_reason)));
  }
  return ok_status();
}

// ---------------------------------------------------------------------------------------------
// Encoding.

namespace {

constexpr std::uint32_t kEncodingFormat = 1;

struct EncodedHeader {
  std::uint32_t format;
  std::uint32_t group_size;
  std::uint64_t id;
  std::uint64_t prompt_id;
  std::uint64_t group_id;
  std::uint64_t version;
  std::uint32_t sample_index;
  std::uint8_t finish_reason;
  std::uint8_t pad[3];
  std::int64_t generation_start_ns;
  std::int64_t generation_end_ns;
  std::uint32_t num_prompt;
  std::uint32_t num_response;
  std::uint32_t num_rewards;
  std::uint32_t num_metadata;
};
static_assert(sizeof(EncodedHeader) == 80);

template <class T>
void append_array(std::string& out, const std::vector<T>& v) {
  out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

template <class T>
void read_array(const char*& p, std::size_t n, std::vector<T>& v) {
  v.resize(n);
  std::memcpy(v.data(), p, n * sizeof(T));
  p += n * sizeof(T);
}

std::size_t encoded_size(const Trajectory& t) {
  return sizeof(EncodedHeader) + 4 * (t.prompt_tokens.size() + 2 * t.response_tokens.size()) +
         4 * t.rewards.size() + t.metadata.size();
}

}  // namespace

void encode_trajectory(const Trajectory& t, std::string& out) {
  EncodedHeader h{};
  h.format = kEncodingFormat;
  h.group_size = t.group_size;
  h.id = t.id.value();
  h.prompt_id = t.prompt_id;
  h.group_id = t.group_id;
  h.version = t.version.value();
  h.sample_index = t.sample_index;
  h.finish_reason = std::uint8_t(t.finish_reason);
  h.generation_start_ns = t.timings.generation_start_ns;
  h.generation_end_ns = t.timings.generation_end_ns;
  h.num_prompt = std::uint32_t(t.prompt_tokens.size());
  h.num_response = std::uint32_t(t.response_tokens.size());
  h.num_rewards = std::uint32_t(t.rewards.size());
  h.num_metadata = std::uint32_t(t.metadata.size());
  out.reserve(out.size() + encoded_size(t));
  out.append(reinterpret_cast<const char*>(&h), sizeof(h));
  append_array(out, t.prompt_tokens);
  append_array(out, t.response_tokens);
  append_array(out, t.logprobs);
  append_array(out, t.rewards);
  out.append(t.metadata);
}

Result<Trajectory> decode_trajectory(std::string_view bytes) {
  if (bytes.size() < sizeof(EncodedHeader)) {
    return data_loss(fmt::format("encoded trajectory: {} bytes, shorter than its {}-byte header",
                                 bytes.size(), sizeof(EncodedHeader)));
  }
  EncodedHeader h;
  std::memcpy(&h, bytes.data(), sizeof(h));
  if (h.format != kEncodingFormat) {
    return data_loss(fmt::format("encoded trajectory: format {} (expected {})", h.format, kEncodingFormat));
  }
  if (h.pad[0] != 0 || h.pad[1] != 0 || h.pad[2] != 0) {
    return data_loss("encoded trajectory: nonzero padding bytes in the header");
  }
  const std::uint64_t want = sizeof(EncodedHeader) +
                             4 * (std::uint64_t(h.num_prompt) + 2 * std::uint64_t(h.num_response)) +
                             4 * std::uint64_t(h.num_rewards) + std::uint64_t(h.num_metadata);
  if (want != bytes.size()) {
    return data_loss(fmt::format("encoded trajectory {}: header describes {} bytes, buffer has {}", h.id,
                                 want, bytes.size()));
  }
  Trajectory t;
  t.id = TrajectoryId(h.id);
  t.prompt_id = h.prompt_id;
  t.group_id = h.group_id;
  t.group_size = h.group_size;
  t.sample_index = h.sample_index;
  t.version = Version(h.version);
  t.finish_reason = FinishReason(h.finish_reason);
  t.timings.generation_start_ns = h.generation_start_ns;
  t.timings.generation_end_ns = h.generation_end_ns;
  const char* p = bytes.data() + sizeof(EncodedHeader);
  read_array(p, h.num_prompt, t.prompt_tokens);
  read_array(p, h.num_response, t.response_tokens);
  read_array(p, h.num_response, t.logprobs);
  read_array(p, h.num_rewards, t.rewards);
  t.metadata.assign(p, h.num_metadata);
  Status st = validate_trajectory(t);
  if (!st.ok()) return st.with_context("decoded trajectory");
  return t;
}

// ---------------------------------------------------------------------------------------------
// Batch.

namespace internal {
struct BatchData {
  std::uint64_t id = 0;
  std::vector<Trajectory> items;
  std::vector<TrajectoryInfo> info;
  // At the first index of each unit (a group or a lone trajectory): the unit's length; 0 elsewhere.
  std::vector<std::uint32_t> unit_len;
  std::size_t tokens = 0;
  Clock::Duration deadline{0};
};
}  // namespace internal

std::uint64_t Batch::id() const noexcept { return d_ ? d_->id : 0; }
std::span<const Trajectory> Batch::trajectories() const noexcept {
  return d_ ? std::span<const Trajectory>(d_->items) : std::span<const Trajectory>();
}
std::span<const TrajectoryInfo> Batch::info() const noexcept {
  return d_ ? std::span<const TrajectoryInfo>(d_->info) : std::span<const TrajectoryInfo>();
}
std::size_t Batch::num_tokens() const noexcept { return d_ ? d_->tokens : 0; }
Clock::Duration Batch::lease_deadline() const noexcept { return d_ ? d_->deadline : Clock::Duration(0); }

std::vector<Trajectory> Batch::release() {
  std::vector<Trajectory> out;
  if (!d_) return out;
  // use_count 1: the queue dropped its reference for good (ack, or the copy made on requeue), so
  // nobody else can reach these.
  if (d_.use_count() == 1) {
    out = std::move(d_->items);
  } else {
    out = d_->items;
  }
  d_.reset();
  return out;
}

// ---------------------------------------------------------------------------------------------
// Stats.

std::string QueueStats::to_json() const {
  nlohmann::ordered_json j;
  j["depth"] = {{"ready", ready},
                {"ready_tokens", ready_tokens},
                {"pending_groups", pending_groups},
                {"pending_group_trajectories", pending_group_trajectories},
                {"leases", leases},
                {"leased_trajectories", leased_trajectories},
                {"held_tokens", held_tokens},
                {"blocked_producers", blocked_producers},
                {"blocked_consumers", blocked_consumers},
                {"newest_version", newest_version.value()}};
  j["flow"] = {{"pushed", pushed},           {"delivered", delivered},
               {"acked", acked},             {"nacked_batches", nacked_batches},
               {"expired_leases", expired_leases}, {"redelivered", redelivered}};
  j["rejected"] = {{"invalid", rejected_invalid}, {"full", rejected_full}};
  j["drops"] = {{"stale", dropped_stale},
                {"group_timeout", dropped_group_timeout},
                {"late_for_group", dropped_late_for_group}};
  nlohmann::ordered_json hist = nlohmann::ordered_json::object();
  for (int i = 0; i < kStalenessBuckets; ++i) {
    const std::string key =
        i + 1 < kStalenessBuckets ? std::to_string(i) : std::to_string(i) + "+";
    hist[key] = staleness[i];
  }
  j["staleness_histogram"] = hist;
  nlohmann::ordered_json buckets = nlohmann::ordered_json::array();
  for (int i = 0; i < WaitHistogram::kBuckets; ++i) {
    nlohmann::ordered_json b;
    if (i + 1 < WaitHistogram::kBuckets) {
      b["lt_ms"] = 1ull << i;
    } else {
      b["lt_ms"] = nullptr;
    }
    b["n"] = group_wait.buckets[i];
    buckets.push_back(b);
  }
  j["group_wait_ms"] = {{"count", group_wait.count},
                        {"mean", group_wait.count ? group_wait.sum_ms / double(group_wait.count) : 0.0},
                        {"max", group_wait.max_ms},
                        {"buckets", buckets}};
  j["wal"] = {{"enabled", wal}, {"bytes", wal_bytes}, {"records", wal_records},
              {"compactions", wal_compactions}};
  return j.dump();
}

// ---------------------------------------------------------------------------------------------
// The queue.

namespace {

// A growable ring of T, cheaper than std::deque for big elements (no node per two elements).
template <class T>
class Ring {
 public:
  std::size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }
  T& front() { return buf_[head_]; }
  T& operator[](std::size_t i) { return buf_[(head_ + i) & (buf_.size() - 1)]; }
  void push_back(T&& v) {
    grow_if_full();
    buf_[(head_ + size_) & (buf_.size() - 1)] = std::move(v);
    ++size_;
  }
  void push_front(T&& v) {
    grow_if_full();
    head_ = (head_ + buf_.size() - 1) & (buf_.size() - 1);
    buf_[head_] = std::move(v);
    ++size_;
  }
  T pop_front() {
    T v = std::move(buf_[head_]);
    head_ = (head_ + 1) & (buf_.size() - 1);
    --size_;
    return v;
  }

 private:
  void grow_if_full() {
    if (size_ < buf_.size()) return;
    std::vector<T> bigger(std::max<std::size_t>(16, buf_.size() * 2));
    for (std::size_t i = 0; i < size_; ++i) bigger[i] = std::move((*this)[i]);
    buf_ = std::move(bigger);
    head_ = 0;
  }
  std::vector<T> buf_;
  std::size_t head_ = 0;
  std::size_t size_ = 0;
};

// Open-addressing set of 64-bit ids (linear probing, backward-shift deletion): no node per id,
// which the dedup window of 65k ids would otherwise allocate and free on every push and ack.
class IdSet {
 public:
  IdSet() : slots_(64, kEmpty) { publish_slots(); }
  // Starts loading the slot where a lookup of `id` begins; safe without the lock that guards the
  // set (a prefetch of a stale address, during a grow, is harmless), so the miss can be taken
  // before the lock rather than while holding it.
  void prefetch(std::uint64_t id) const {
    const std::uint64_t* base = slots_base_.load(std::memory_order_relaxed);
    const std::size_t mask = slots_mask_.load(std::memory_order_relaxed);
    __builtin_prefetch(base + (home(id, mask)));
  }
  bool contains(std::uint64_t id) const {
    if (id == kEmpty) return has_empty_key_;
    for (std::size_t i = home(id);; i = (i + 1) & mask()) {
      if (slots_[i] == id) return true;
      if (slots_[i] == kEmpty) return false;
    }
  }
  // False if already present.
  bool insert(std::uint64_t id) {
    if (id == kEmpty) return !std::exchange(has_empty_key_, true);
    if (2 * (size_ + 1) > slots_.size()) grow();
    std::size_t i = home(id);
    for (; slots_[i] != kEmpty; i = (i + 1) & mask()) {
      if (slots_[i] == id) return false;
    }
    slots_[i] = id;
    ++size_;
    return true;
  }
  void erase(std::uint64_t id) {
    if (id == kEmpty) {
      has_empty_key_ = false;
      return;
    }
    std::size_t i = home(id);
    for (; slots_[i] != id; i = (i + 1) & mask()) {
      if (slots_[i] == kEmpty) return;
    }
    // Shift later members of the probe run back so no lookup stops early at the hole.
    for (std::size_t j = (i + 1) & mask(); slots_[j] != kEmpty; j = (j + 1) & mask()) {
      const std::size_t h = home(slots_[j]);
      // Movable into the hole unless its home lies cyclically in (i, j].
      if (((j - h) & mask()) >= ((j - i) & mask())) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i] = kEmpty;
    --size_;
  }

 private:
  static constexpr std::uint64_t kEmpty = ~std::uint64_t(0);
  std::size_t mask() const { return slots_.size() - 1; }
  // Ids usually come from counters. Runs of 8 consecutive ids share one cache line (a push then
  // mostly touches the line the previous push just used; a full mix costs a miss per push once the
  // window outgrows the cache), while the runs themselves are scattered, so probe runs stay short
  // (mapping every id to its own slot in order would make one long run that each erase walks).
  std::size_t home(std::uint64_t x) const { return home(x, mask()); }
  static std::size_t home(std::uint64_t x, std::size_t mask) {
    std::uint64_t run = x >> 3;
    run ^= run >> 33;
    run *= 0xff51afd7ed558ccdull;
    run ^= run >> 33;
    return std::size_t((run << 3) | (x & 7)) & mask;
  }
  void publish_slots() {
    slots_base_.store(slots_.data(), std::memory_order_relaxed);
    slots_mask_.store(mask(), std::memory_order_relaxed);
  }
  void grow() {
    std::vector<std::uint64_t> old(slots_.size() * 2, kEmpty);
    old.swap(slots_);
    size_ = 0;
    for (std::uint64_t id : old) {
      if (id != kEmpty) insert(id);
    }
    publish_slots();
  }
  std::vector<std::uint64_t> slots_;
  // On a line of their own: read by prefetch() without the lock while size_ changes.
  alignas(64) std::atomic<const std::uint64_t*> slots_base_{nullptr};
  std::atomic<std::size_t> slots_mask_{0};
  std::size_t size_ = 0;
  bool has_empty_key_ = false;
};

// A set that remembers only the last `window` values added, for duplicate detection in bounded
// memory.
class RecentSet {
 public:
  explicit RecentSet(std::size_t window) : window_(window) {}
  bool contains(std::uint64_t v) const { return set_.contains(v); }
  void add(std::uint64_t v) {
    if (!set_.insert(v)) return;
    order_.push_back(v);
    if (order_.size() > window_) {
      set_.erase(order_.front());
      order_.pop_front();
    }
  }
  const std::deque<std::uint64_t>& values() const { return order_; }

 private:
  std::size_t window_;
  IdSet set_;
  std::deque<std::uint64_t> order_;
};

// What pop_batch hands out whole: a group (complete, or partial after its timeout) in sample
// order, or one ungrouped trajectory. Moved as one vector from group to ready queue, so a
// trajectory is moved only twice on its way through (into the queue, into the batch).
struct Unit {
  std::vector<Trajectory> items;
  std::size_t tokens = 0;
  std::uint64_t min_version = UINT64_MAX;  // the stalest member judges the unit's staleness
  std::uint32_t deliveries = 0;            // times delivered before
  bool partial_group = false;

  void add(Trajectory&& t) {
    tokens += t.num_tokens();
    min_version = std::min(min_version, t.version.value());
    items.push_back(std::move(t));
  }
};

struct PendingGroup {
  std::uint32_t group_size = 0;
  std::uint64_t prompt_id = 0;
  Clock::Duration first_arrival{0};
  Unit unit;
  std::vector<bool> seen;  // [group_size]
};

std::size_t wal_record_bytes(const Trajectory& t) { return 24 + encoded_size(t); }

constexpr std::size_t kExpiredBatchMemory = 1 << 16;
constexpr int kSpinRounds = 64;

// Locks `mu`, spinning briefly first: critical sections here are a few hundred nanoseconds, far
// less than putting a thread to sleep on the futex and waking it again.
std::unique_lock<std::mutex> lock_spinning(std::mutex& mu) {
  for (int i = 0; i < 128; ++i) {
    if (mu.try_lock()) return std::unique_lock<std::mutex>(mu, std::adopt_lock);
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  return std::unique_lock<std::mutex>(mu);
}

// Condition variables to notify once the locks are released: a thread woken while the notifier
// still holds the lock would only block on it again.
struct Wake {
  bool data = false;
  bool space = false;
};

}  // namespace

// Two locks, so producers and consumers mostly run side by side:
//   pmu, the producer side: ids and their dedup window, groups and their timeouts, capacity,
//     the write-ahead log, background errors;
//   mu, the consumer side: the ready queue, leases and their expiry.
// Order: pmu before mu. A push takes mu only to hand over a finished unit, and an ack takes pmu
// only after letting go of mu, each without holding the other lock; with a WAL both hold both, so
// the log and the state move together.
// Counters in `st` are each written under the lock of the side that changes them; stats() takes
// both.
struct TrajectoryQueue::Impl {
  explicit Impl(QueueOptions o)
      : opt(std::move(o)),
        clock(opt.clock ? opt.clock : Clock::steady()),
        newest(opt.initial_version),
        closed_groups(opt.id_dedup_window),
        expired_batches(kExpiredBatchMemory) {}

  QueueOptions opt;
  std::shared_ptr<Clock> clock;
  // Set by open() (the pointer; appends are under pmu), so pushes test it before locking.
  std::unique_ptr<internal::TrajectoryWal> wal;

  // Written under both locks, so either one is enough to read them.
  bool closed = false;
  Version newest;
  std::atomic<std::uint64_t> newest_atomic{0};

  // --- producer side, under pmu ---
  // Each side on cache lines of its own: fields read without a lock (opt, clock, wal) must not
  // share a line with a mutex or counters that other threads write on every push or pop.
  alignas(64) mutable std::mutex pmu;
  std::condition_variable space_cv;  // producers wait for capacity
  int space_waiters = 0;
  // Ids refused on push: those in the queue (pending, ready or leased) and the last
  // id_dedup_window retired, which `retired` lists oldest first.
  IdSet known_ids;
  std::deque<std::uint64_t> retired;
  RecentSet closed_groups;
  std::unordered_map<std::uint64_t, PendingGroup> groups;
  std::size_t pending_trajectories = 0;
  using Deadline = std::pair<Clock::Duration, std::uint64_t>;
  std::deque<Deadline> group_deadlines;  // FIFO: one timeout for all
  // group_deadlines.front() (or kForever), read without pmu by consumers deciding whether to run
  // the group timers.
  std::atomic<Clock::Duration::rep> next_group_deadline{Clock::kForever.count()};
  std::size_t held_count = 0;
  std::size_t held_tokens = 0;
  std::uint64_t wal_live_bytes = 0;
  std::string wal_buf;
  RecoveryReport recovery;
  Status bg_error;

  // --- consumer side, under mu ---
  alignas(64) mutable std::mutex mu;
  std::condition_variable data_cv;  // consumers wait for ready trajectories
  int data_waiters = 0;
  Ring<Unit> ready;
  std::size_t ready_count = 0;
  // ready_count as of the last change, read without the lock by consumers spinning before they
  // sleep (sleeping and waking costs more than a whole push).
  std::atomic<std::size_t> ready_hint{0};
  std::size_t ready_tokens = 0;
  std::unordered_map<std::uint64_t, std::shared_ptr<internal::BatchData>> leases;
  std::size_t leased_trajectories = 0;
  std::priority_queue<Deadline, std::vector<Deadline>, std::greater<>> lease_deadlines;
  std::uint64_t next_batch_id = 1;
  RecentSet expired_batches;

  QueueStats st;  // counters only; depth is filled in by stats()

  ClockSubscription clock_sub;

  void wake(const Wake& w) {
    if (w.data) data_cv.notify_all();
    if (w.space) space_cv.notify_all();
  }

  // --- producer side, with pmu held ---

  void note_bg(Status s) {
    if (!s.ok() && bg_error.ok()) bg_error = std::move(s);
  }

  Status wal_retire(internal::WalRetireReason reason, const std::vector<std::uint64_t>& ids) {
    if (!wal || ids.empty()) return ok_status();
    wal_buf.clear();
    const std::uint64_t head = std::uint64_t(reason);
    const std::uint64_t n = ids.size();
    wal_buf.append(reinterpret_cast<const char*>(&head), 8);
    wal_buf.append(reinterpret_cast<const char*>(&n), 8);
    wal_buf.append(reinterpret_cast<const char*>(ids.data()), ids.size() * 8);
    return wal->append(internal::WalRecordType::kRetire, wal_buf);
  }

  Status wal_u64(internal::WalRecordType type, std::uint64_t v) {
    if (!wal) return ok_status();
    return wal->append(type, std::string_view(reinterpret_cast<const char*>(&v), 8));
  }

  // Forgets trajectories for good (acked or dropped). Their ids stay refused for a while.
  void remember_retired(std::uint64_t id) {
    retired.push_back(id);
    if (retired.size() > opt.id_dedup_window) {
      known_ids.erase(retired.front());
      retired.pop_front();
    }
  }

  void retire(const Trajectory& t) {
    remember_retired(t.id.value());
    held_count -= 1;
    held_tokens -= t.num_tokens();
    if (wal) wal_live_bytes -= wal_record_bytes(t);
  }

  void space_freed(Wake& w) const {
    if (space_waiters > 0) w.space = true;
  }

  void record_group_wait(Clock::Duration waited) {
    const double ms = std::chrono::duration<double, std::milli>(waited).count();
    auto& h = st.group_wait;
    ++h.count;
    h.sum_ms += ms;
    h.max_ms = std::max(h.max_ms, ms);
    int b = 0;
    while (b + 1 < WaitHistogram::kBuckets && ms >= double(1ull << b)) ++b;
    ++h.buckets[b];
  }

  void set_group_deadline_hint() {
    next_group_deadline.store(group_deadlines.empty() ? Clock::kForever.count()
                                                      : group_deadlines.front().first.count(),
                              std::memory_order_release);
  }

  // Hands a unit to the consumers; takes mu.
  void publish(Unit&& u, Wake& w) {
    std::unique_lock<std::mutex> l = lock_spinning(mu);
    ready_count += u.items.size();
    ready_tokens += u.tokens;
    ready.push_back(std::move(u));
    ready_hint.store(ready_count, std::memory_order_relaxed);
    if (data_waiters > 0) w.data = true;
  }

  // Moves a group's members to the ready queue as one unit, in sample order.
  void release_group(PendingGroup& g, bool partial, Wake& w) { publish(close_group(g, partial), w); }

  // Takes a group's members out as one unit, in sample order.
  Unit close_group(PendingGroup& g, bool partial) {
    auto by_index = [](const Trajectory& a, const Trajectory& b) { return a.sample_index < b.sample_index; };
    // Members mostly arrive in order; sorting sorted input would still move every one twice.
    if (!std::is_sorted(g.unit.items.begin(), g.unit.items.end(), by_index)) {
      std::sort(g.unit.items.begin(), g.unit.items.end(), by_index);
    }
    g.unit.partial_group = partial;
    pending_trajectories -= g.unit.items.size();
    return std::move(g.unit);
  }

  Status time_out_group(std::unordered_map<std::uint64_t, PendingGroup>::iterator it, Clock::Duration now,
                        Wake& w) {
    PendingGroup& g = it->second;
    const std::uint64_t gid = it->first;
    record_group_wait(now - g.first_arrival);
    closed_groups.add(gid);
    Status s = wal_u64(internal::WalRecordType::kGroupClosed, gid);
    if (opt.partial_group_policy == PartialGroupPolicy::kRelease) {
      release_group(g, /*partial=*/true, w);
    } else {
      std::vector<std::uint64_t> ids;
      for (const Trajectory& t : g.unit.items) ids.push_back(t.id.value());
      Status wr = wal_retire(internal::WalRetireReason::kGroupTimeout, ids);
      if (s.ok()) s = wr;
      for (const Trajectory& t : g.unit.items) retire(t);
      st.dropped_group_timeout += g.unit.items.size();
      pending_trajectories -= g.unit.items.size();
      space_freed(w);
    }
    groups.erase(it);
    return s;
  }

  // Group timeouts due by `now`.
  void process_group_timers(Clock::Duration now, Wake& w) {
    if (next_group_deadline.load(std::memory_order_relaxed) > now.count()) return;
    while (!group_deadlines.empty() && group_deadlines.front().first <= now) {
      const auto [deadline, gid] = group_deadlines.front();
      group_deadlines.pop_front();
      auto it = groups.find(gid);
      if (it == groups.end() || it->second.first_arrival + opt.group_timeout != deadline) continue;
      note_bg(time_out_group(it, now, w));
    }
    set_group_deadline_hint();
  }

  // From the consumer side, with no lock held: group timeouts live with the producers, but must
  // fire while no producer pushes.
  void run_group_timers_if_due(Clock::Duration now) {
    if (next_group_deadline.load(std::memory_order_acquire) > now.count()) return;
    Wake w;
    {
      std::unique_lock<std::mutex> pl = lock_spinning(pmu);
      process_group_timers(now, w);
    }
    wake(w);
  }

  // Retires units pop_batch dropped as stale; takes pmu (called with no lock held).
  void retire_stale(std::vector<Unit>& dropped) {
    Wake w;
    {
      std::unique_lock<std::mutex> pl = lock_spinning(pmu);
      std::vector<std::uint64_t> ids;
      for (const Unit& u : dropped) {
        for (const Trajectory& t : u.items) {
          if (wal) ids.push_back(t.id.value());
          retire(t);
          ++st.dropped_stale;
        }
      }
      note_bg(wal_retire(internal::WalRetireReason::kStale, ids));
      space_freed(w);
    }
    dropped.clear();
    wake(w);
  }

  // --- consumer side, with mu held ---

  // Puts a batch's units back at the front of the ready queue, in their original order. `move`:
  // nobody else holds the items.
  void unpop(internal::BatchData& d, bool move, std::uint32_t deliveries_back) {
    std::size_t end = d.items.size();
    for (std::size_t i = end; i-- > 0;) {
      if (d.unit_len[i] == 0) continue;
      Unit u;
      u.items.reserve(end - i);
      for (std::size_t k = i; k < end; ++k) u.add(move ? std::move(d.items[k]) : Trajectory(d.items[k]));
      u.partial_group = d.info[i].partial_group;
      u.deliveries = d.info[i].delivery - deliveries_back;
      ready_count += u.items.size();
      ready_tokens += u.tokens;
      ready.push_front(std::move(u));
      end = i;
    }
    ready_hint.store(ready_count, std::memory_order_relaxed);
  }

  // Returns a leased batch to the ready queue (nack or expiry).
  void requeue(std::unordered_map<std::uint64_t, std::shared_ptr<internal::BatchData>>::iterator it, Wake& w) {
    std::shared_ptr<internal::BatchData> d = std::move(it->second);
    leases.erase(it);
    const bool sole = d.use_count() == 1;  // the consumer let go: move instead of copy
    leased_trajectories -= d->items.size();
    st.redelivered += d->items.size();
    unpop(*d, sole, 0);
    if (data_waiters > 0) w.data = true;
  }

  void process_lease_timers(Clock::Duration now, Wake& w) {
    while (!lease_deadlines.empty() && lease_deadlines.top().first <= now) {
      const auto [deadline, id] = lease_deadlines.top();
      lease_deadlines.pop();
      auto it = leases.find(id);
      if (it == leases.end() || it->second->deadline != deadline) continue;
      ++st.expired_leases;
      expired_batches.add(id);
      requeue(it, w);
    }
  }

  Clock::Duration next_consumer_timer() const {
    Clock::Duration t = Clock::Duration(next_group_deadline.load(std::memory_order_acquire));
    if (!lease_deadlines.empty()) t = std::min(t, lease_deadlines.top().first);
    return t;
  }

  // With both locks held.
  Status maybe_compact() {
    if (!wal || wal->bytes() < opt.wal_compact_bytes || wal_live_bytes * 2 > wal->bytes()) {
      return ok_status();
    }
    Status s = wal->rewrite([this](internal::TrajectoryWal& w) -> Status {
      std::uint64_t v = newest.value();
      LAMINAR_RETURN_IF_ERROR(
          w.append(internal::WalRecordType::kVersion, std::string_view(reinterpret_cast<const char*>(&v), 8)));
      // The dedup windows survive a restart too.
      std::string buf;
      const std::uint64_t head = std::uint64_t(internal::WalRetireReason::kWindow);
      const std::uint64_t n = retired.size();
      buf.append(reinterpret_cast<const char*>(&head), 8);
      buf.append(reinterpret_cast<const char*>(&n), 8);
      for (std::uint64_t id : retired) buf.append(reinterpret_cast<const char*>(&id), 8);
      LAMINAR_RETURN_IF_ERROR(w.append(internal::WalRecordType::kRetire, buf));
      for (std::uint64_t gid : closed_groups.values()) {
        LAMINAR_RETURN_IF_ERROR(w.append(internal::WalRecordType::kGroupClosed,
                                         std::string_view(reinterpret_cast<const char*>(&gid), 8)));
      }
      auto put = [&](const Trajectory& t) {
        buf.clear();
        encode_trajectory(t, buf);
        return w.append(internal::WalRecordType::kPush, buf);
      };
      for (std::size_t i = 0; i < ready.size(); ++i) {
        for (const Trajectory& t : ready[i].items) LAMINAR_RETURN_IF_ERROR(put(t));
      }
      for (const auto& [id, d] : leases) {
        for (const Trajectory& t : d->items) LAMINAR_RETURN_IF_ERROR(put(t));
      }
      for (const auto& [gid, g] : groups) {
        for (const Trajectory& t : g.unit.items) LAMINAR_RETURN_IF_ERROR(put(t));
      }
      return ok_status();
    });
    if (s.ok()) ++st.wal_compactions;
    return s;
  }

  Status replay(const std::string& path);
};

// ---------------------------------------------------------------------------------------------

Status TrajectoryQueue::Impl::replay(const std::string& path) {
  // Live trajectories in log order (tombstoned when retired), then rebuilt into groups and units.
  std::vector<std::optional<Trajectory>> order;
  std::unordered_map<std::uint64_t, std::size_t> index;
  std::unordered_set<std::uint64_t> closed_in_log;
  std::uint64_t retired = 0;
  std::uint64_t max_version = newest.value();

  auto on_record = [&](internal::WalRecordType type, std::string_view p, std::uint64_t off) -> Status {
    switch (type) {
      case internal::WalRecordType::kPush: {
        Result<Trajectory> t = decode_trajectory(p);
        if (!t.ok()) return t.status().with_context(fmt::format("WAL {} record at offset {}", path, off));
        const std::uint64_t id = t->id.value();
        if (index.count(id) != 0) {
          return data_loss(fmt::format("WAL {}: trajectory {} pushed twice (offset {})", path, id, off));
        }
        max_version = std::max(max_version, t->version.value());
        index.emplace(id, order.size());
        order.emplace_back(std::move(*t));
        return ok_status();
      }
      case internal::WalRecordType::kRetire: {
        std::uint64_t head = 0, n = 0;
        if (p.size() < 16) return data_loss(fmt::format("WAL {}: short retire record at offset {}", path, off));
        std::memcpy(&head, p.data(), 8);
        std::memcpy(&n, p.data() + 8, 8);
        if (head > std::uint64_t(internal::WalRetireReason::kWindow) || p.size() != 16 + 8 * n) {
          return data_loss(fmt::format("WAL {}: malformed retire record at offset {}", path, off));
        }
        for (std::uint64_t i = 0; i < n; ++i) {
          std::uint64_t id;
          std::memcpy(&id, p.data() + 16 + 8 * i, 8);
          if (known_ids.insert(id)) remember_retired(id);
          auto it = index.find(id);
          if (it != index.end()) {
            order[it->second].reset();
            index.erase(it);
            ++retired;
          }
        }
        return ok_status();
      }
      case internal::WalRecordType::kGroupClosed:
      case internal::WalRecordType::kVersion: {
        if (p.size() != 8) return data_loss(fmt::format("WAL {}: malformed record at offset {}", path, off));
        std::uint64_t v;
        std::memcpy(&v, p.data(), 8);
        if (type == internal::WalRecordType::kVersion) {
          max_version = std::max(max_version, v);
        } else {
          closed_groups.add(v);
          closed_in_log.insert(v);
        }
        return ok_status();
      }
    }
    return internal_error("unreachable WAL record type");
  };

  auto opened = internal::TrajectoryWal::open(path, opt.wal_fsync, on_record, recovery);
  if (!opened.ok()) return opened.status();
  wal = std::move(opened).value();
  recovery.retired = retired;
  newest = Version(max_version);
  newest_atomic.store(max_version, std::memory_order_release);

  const Clock::Duration now = clock->now();
  std::vector<std::uint64_t> group_order;
  Wake ignored;  // no thread waits yet
  for (std::optional<Trajectory>& slot : order) {
    if (!slot) continue;
    Trajectory t = std::move(*slot);
    ++recovery.recovered;
    known_ids.insert(t.id.value());
    held_count += 1;
    held_tokens += t.num_tokens();
    wal_live_bytes += wal_record_bytes(t);
    if (t.group_size == 1) {
      Unit u;
      u.add(std::move(t));
      publish(std::move(u), ignored);
      continue;
    }
    auto [it, fresh] = groups.try_emplace(t.group_id);
    PendingGroup& g = it->second;
    if (fresh) {
      g.group_size = t.group_size;
      g.prompt_id = t.prompt_id;
      g.first_arrival = now;
      g.seen.assign(t.group_size, false);
      group_order.push_back(t.group_id);
    }
    if (t.group_size != g.group_size || t.sample_index >= g.group_size || g.seen[t.sample_index]) {
      return data_loss(fmt::format("WAL {}: trajectory {} does not fit its group {}", path, t.id.value(),
                                   t.group_id));
    }
    g.seen[t.sample_index] = true;
    g.unit.add(std::move(t));
    ++pending_trajectories;
  }
  for (std::uint64_t gid : group_order) {
    auto it = groups.find(gid);
    PendingGroup& g = it->second;
    const bool complete = g.unit.items.size() == g.group_size;
    if (complete || closed_in_log.count(gid) != 0) {
      closed_groups.add(gid);
      release_group(g, /*partial=*/!complete, ignored);
      groups.erase(it);
    } else if (opt.group_timeout != Clock::kForever) {
      // The timer restarts: how long the group waited before the restart is not in the log.
      group_deadlines.emplace_back(now + opt.group_timeout, gid);
    }
  }
  set_group_deadline_hint();
  return ok_status();
}

TrajectoryQueue::TrajectoryQueue(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TrajectoryQueue::~TrajectoryQueue() {
  // Unsubscribe first: afterwards no clock callback can touch the queue.
  impl_->clock_sub.reset();
}

Result<std::unique_ptr<TrajectoryQueue>> TrajectoryQueue::open(QueueOptions options) {
  if (options.capacity_trajectories == 0) return invalid_argument("QueueOptions: capacity_trajectories is 0");
  if (options.capacity_tokens == 0) return invalid_argument("QueueOptions: capacity_tokens is 0");
  if (options.default_lease <= Clock::Duration::zero()) {
    return invalid_argument(
        fmt::format("QueueOptions: default_lease {} ns is not positive", options.default_lease.count()));
  }
  if (options.group_timeout <= Clock::Duration::zero()) {
    return invalid_argument(
        fmt::format("QueueOptions: group_timeout {} ns is not positive", options.group_timeout.count()));
  }
  if (options.id_dedup_window == 0) return invalid_argument("QueueOptions: id_dedup_window is 0");
  auto impl = std::make_unique<Impl>(std::move(options));
  impl->newest_atomic.store(impl->newest.value());
  if (!impl->opt.wal_path.empty()) {
    LAMINAR_RETURN_IF_ERROR(impl->replay(impl->opt.wal_path));
  }
  Impl* raw = impl.get();
  impl->clock_sub = impl->clock->subscribe([raw] {
    {
      std::lock_guard<std::mutex> l(raw->pmu);
      raw->space_cv.notify_all();
    }
    std::lock_guard<std::mutex> l(raw->mu);
    raw->data_cv.notify_all();
  });
  return std::unique_ptr<TrajectoryQueue>(new TrajectoryQueue(std::move(impl)));
}

Status TrajectoryQueue::publish_version(Version v) {
  Impl& q = *impl_;
  std::lock_guard<std::mutex> pl(q.pmu);
  if (v < q.newest) {
    return invalid_argument(fmt::format("publish_version: version {} is older than the newest published {}",
                                        v.value(), q.newest.value()));
  }
  if (v == q.newest) return ok_status();
  LAMINAR_RETURN_IF_ERROR(q.wal_u64(internal::WalRecordType::kVersion, v.value()));
  std::lock_guard<std::mutex> l(q.mu);
  q.newest = v;
  q.newest_atomic.store(v.value(), std::memory_order_release);
  return ok_status();
}

Version TrajectoryQueue::newest_version() const noexcept {
  return Version(impl_->newest_atomic.load(std::memory_order_acquire));
}

Status TrajectoryQueue::push(Trajectory&& t, PushOptions options) {
  Impl& q = *impl_;
  // The id's slot is a cache miss; loaded now, it overlaps validation's own misses instead of
  // stalling under pmu.
  q.known_ids.prefetch(t.id.value());
  if (Status s = validate_trajectory(t, q.opt.validate_contents); !s.ok()) {
    std::lock_guard<std::mutex> l(q.pmu);
    ++q.st.rejected_invalid;
    return s;
  }
  if (options.mode == PushMode::kTimeout && options.timeout < Clock::Duration::zero()) {
    return invalid_argument(fmt::format("push: negative timeout {} ns", options.timeout.count()));
  }
  const std::size_t tokens = t.num_tokens();
  const std::uint64_t id = t.id.value();
  // Encoded and checksummed outside the lock: they are the costly part of logging, after the
  // write itself.
  thread_local std::string encoded;
  std::uint64_t checksum = 0;
  if (q.wal) {
    encoded.clear();
    encode_trajectory(t, encoded);
    checksum = internal::TrajectoryWal::checksum(internal::WalRecordType::kPush, encoded);
  }

  Clock::Duration now = q.clock->now();
  Wake w;
  std::unique_lock<std::mutex> l = lock_spinning(q.pmu);
  Clock::Duration deadline = Clock::kForever;
  if (options.mode == PushMode::kTimeout) {
    deadline = options.timeout >= Clock::kForever - now ? Clock::kForever : now + options.timeout;
  }
  // Every exit wakes whoever this push (or the group timers it ran) made data or space for.
  auto finish = [&](Status s) {
    l.unlock();
    q.wake(w);
    return s;
  };
  auto reject_invalid = [&](std::string m) {
    ++q.st.rejected_invalid;
    return finish(invalid_argument(std::move(m)));
  };
  // The member's group as of the last check (pmu is held from there on, so it stays valid).
  auto group = q.groups.end();
  for (;;) {
    if (q.closed) {
      ++q.st.rejected_full;
      return finish(cancelled(fmt::format("push of trajectory {}: the queue is closed", id)));
    }
    q.process_group_timers(now, w);
    if (t.version > q.newest) {
      return reject_invalid(fmt::format("trajectory {}: version {} is ahead of the newest published version {}",
                                        id, t.version.value(), q.newest.value()));
    }
    if (q.known_ids.contains(id)) {
      return reject_invalid(fmt::format("trajectory {}: id already pushed", id));
    }
    if (tokens > q.opt.capacity_tokens) {
      return reject_invalid(fmt::format("trajectory {}: {} tokens exceed the queue's capacity of {} tokens", id,
                                        tokens, q.opt.capacity_tokens));
    }
    if (t.group_size > 1) {
      if (t.group_size > q.opt.capacity_trajectories) {
        return reject_invalid(fmt::format("trajectory {}: group_size {} exceeds capacity_trajectories {}", id,
                                          t.group_size, q.opt.capacity_trajectories));
      }
      if (q.closed_groups.contains(t.group_id)) {
        ++q.st.dropped_late_for_group;
        return finish(failed_precondition(fmt::format(
            "trajectory {}: group {} is already closed (complete, released or dropped)", id, t.group_id)));
      }
      group = q.groups.find(t.group_id);
      if (group != q.groups.end()) {
        const PendingGroup& g = group->second;
        if (g.group_size != t.group_size || g.prompt_id != t.prompt_id) {
          return reject_invalid(fmt::format(
              "trajectory {}: group {} has group_size {} and prompt {}, this member says {} and {}", id,
              t.group_id, g.group_size, g.prompt_id, t.group_size, t.prompt_id));
        }
        if (g.seen[t.sample_index]) {
          return reject_invalid(fmt::format("trajectory {}: group {} already has sample_index {}", id,
                                            t.group_id, t.sample_index));
        }
      }
    }
    if (q.held_count + 1 <= q.opt.capacity_trajectories && q.held_tokens + tokens <= q.opt.capacity_tokens) {
      break;
    }
    if (options.mode == PushMode::kFailFast) {
      ++q.st.rejected_full;
      return finish(unavailable(fmt::format(
          "push of trajectory {}: queue full ({} of {} trajectories, {} of {} tokens)", id, q.held_count,
          q.opt.capacity_trajectories, q.held_tokens, q.opt.capacity_tokens)));
    }
    if (now >= deadline) {
      ++q.st.rejected_full;
      return finish(deadline_exceeded(fmt::format("push of trajectory {}: queue still full after {} ns", id,
                                                  options.timeout.count())));
    }
    ++q.space_waiters;
    q.clock->wait_until(q.space_cv, l,
                        std::min(deadline, Clock::Duration(q.next_group_deadline.load(std::memory_order_relaxed))));
    --q.space_waiters;
    now = q.clock->now();
  }

  if (q.wal) {
    if (Status s = q.wal->append(internal::WalRecordType::kPush, encoded, checksum); !s.ok()) return finish(std::move(s));
    q.wal_live_bytes += wal_record_bytes(t);
  }
  q.known_ids.insert(id);
  q.held_count += 1;
  q.held_tokens += tokens;
  ++q.st.pushed;
  // A finished unit goes to the consumers after pmu is let go, so the other producers need not
  // wait while this one queues for mu. With a WAL it goes before: a compaction (under both locks)
  // must find every live trajectory.
  auto hand_over = [&](Unit&& u) {
    if (q.wal) {
      q.publish(std::move(u), w);
      return finish(ok_status());
    }
    l.unlock();
    q.publish(std::move(u), w);
    q.wake(w);
    return ok_status();
  };
  if (t.group_size == 1) {
    Unit u;
    u.items.reserve(1);
    u.add(std::move(t));
    return hand_over(std::move(u));
  }
  const std::uint64_t gid = t.group_id;
  const bool fresh = group == q.groups.end();
  if (fresh) group = q.groups.try_emplace(gid).first;
  PendingGroup& g = group->second;
  if (fresh) {
    g.group_size = t.group_size;
    g.prompt_id = t.prompt_id;
    g.first_arrival = now;
    g.seen.assign(t.group_size, false);
    g.unit.items.reserve(t.group_size);
    if (q.opt.group_timeout != Clock::kForever) {
      q.group_deadlines.emplace_back(g.first_arrival + q.opt.group_timeout, gid);
      if (q.group_deadlines.size() == 1) q.set_group_deadline_hint();
    }
  }
  g.seen[t.sample_index] = true;
  g.unit.add(std::move(t));
  ++q.pending_trajectories;
  if (g.unit.items.size() == g.group_size) {
    q.record_group_wait(now - g.first_arrival);
    q.closed_groups.add(gid);
    // The trajectory is in the queue either way; a failed group record only means a late duplicate
    // member could be accepted after a restart, so it is reported, not undone.
    q.note_bg(q.wal_u64(internal::WalRecordType::kGroupClosed, gid));
    Unit u = q.close_group(g, /*partial=*/false);
    q.groups.erase(group);
    return hand_over(std::move(u));
  }
  return finish(ok_status());
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
  if (spec.wait < Clock::Duration::zero() || spec.lease < Clock::Duration::zero()) {
    return invalid_argument(fmt::format("BatchSpec: negative wait ({} ns) or lease ({} ns)", spec.wait.count(),
                                        spec.lease.count()));
  }
  const std::size_t max_count = spec.max_trajectories ? spec.max_trajectories : SIZE_MAX;
  const std::size_t max_tokens = spec.max_tokens ? spec.max_tokens : SIZE_MAX;
  const std::size_t min_count = std::max<std::size_t>(spec.min_trajectories, 1);
  const Clock::Duration lease = spec.lease > Clock::Duration::zero() ? spec.lease : q.opt.default_lease;
  const bool drop_stale = spec.staleness_rule == StalenessRule::kDrop;
  const bool mark_stale = spec.staleness_rule == StalenessRule::kKeepAndMark;
  const std::uint64_t consumer_version = spec.consumer_version.value();

  const Clock::Duration start = q.clock->now();
  q.run_group_timers_if_due(start);
  Wake w;
  std::unique_lock<std::mutex> l = lock_spinning(q.mu);
  // Every exit wakes whoever expired leases made data for.
  auto leave = [&](auto result) {
    l.unlock();
    q.wake(w);
    return result;
  };
  if (spec.consumer_version > q.newest) {
    return leave(Result<Batch>(invalid_argument(fmt::format(
        "BatchSpec: consumer_version {} is ahead of the newest published {}", consumer_version,
        q.newest.value()))));
  }
  const Clock::Duration deadline = spec.wait >= Clock::kForever - start ? Clock::kForever : start + spec.wait;
  auto d = std::make_shared<internal::BatchData>();
  std::vector<Unit> dropped;
  Clock::Duration now = start;
  for (;;) {
    if (q.closed) return leave(Result<Batch>(cancelled("pop_batch: the queue is closed")));
    q.process_lease_timers(now, w);
    if (q.ready_count >= min_count) {
      const std::size_t expect = std::min(q.ready_count, max_count);
      d->items.reserve(expect);
      d->info.reserve(expect);
      d->unit_len.reserve(expect);
      std::size_t tokens = 0;
      bool full = false;
      while (!q.ready.empty()) {
        Unit& u = q.ready.front();
        const std::size_t len = u.items.size();
        const std::uint64_t unit_staleness = consumer_version > u.min_version ? consumer_version - u.min_version : 0;
        if (drop_stale && unit_staleness > spec.max_staleness) {
          // A group is judged by its stalest member and dropped whole: a partial GRPO group
          // would bias the advantage baseline.
          q.ready_count -= len;
          q.ready_tokens -= u.tokens;
          dropped.push_back(q.ready.pop_front());
          continue;
        }
        if (!d->items.empty() && (d->items.size() + len > max_count || tokens + u.tokens > max_tokens)) {
          full = true;
          break;
        }
        for (std::size_t i = 0; i < len; ++i) {
          Trajectory& t = u.items[i];
          const std::uint64_t s = consumer_version > t.version.value() ? consumer_version - t.version.value() : 0;
          d->info.push_back(TrajectoryInfo{s, mark_stale && s > spec.max_staleness, u.partial_group,
                                           u.deliveries + 1});
          d->unit_len.push_back(i == 0 ? std::uint32_t(len) : 0u);
          d->items.push_back(std::move(t));
        }
        q.ready_count -= len;
        q.ready_tokens -= u.tokens;
        tokens += u.tokens;
        q.ready.pop_front();
        if (d->items.size() >= max_count || tokens >= max_tokens) {
          full = true;
          break;
        }
      }
      if (d->items.size() >= min_count || (full && !d->items.empty())) {
        q.ready_hint.store(q.ready_count, std::memory_order_relaxed);
        d->id = q.next_batch_id++;
        d->tokens = tokens;
        d->deadline = lease >= Clock::kForever - now ? Clock::kForever : now + lease;
        const std::size_t n = d->items.size();
        q.leased_trajectories += n;
        q.st.delivered += n;
        for (const TrajectoryInfo& info : d->info) {
          ++q.st.staleness[std::min<std::uint64_t>(info.staleness, QueueStats::kStalenessBuckets - 1)];
        }
        if (d->deadline != Clock::kForever) q.lease_deadlines.emplace(d->deadline, d->id);
        q.leases.emplace(d->id, d);
        l.unlock();
        q.wake(w);
        if (!dropped.empty()) q.retire_stale(dropped);
        return Batch(std::move(d));
      }
      // Too few left after dropping stale ones: put back what was taken and wait for more.
      q.unpop(*d, /*move=*/true, /*deliveries_back=*/1);
      d->items.clear();
      d->info.clear();
      d->unit_len.clear();
    }
    if (!dropped.empty()) {
      l.unlock();
      q.retire_stale(dropped);
      l.lock();
      continue;
    }
    if (spec.wait == Clock::Duration::zero()) {
      return leave(Result<Batch>(
          unavailable(fmt::format("pop_batch: {} trajectories ready, {} wanted", q.ready_count, min_count))));
    }
    if (now >= deadline) {
      return leave(Result<Batch>(deadline_exceeded(fmt::format(
          "pop_batch: only {} of {} trajectories ready after {} ns", q.ready_count, min_count,
          spec.wait.count()))));
    }
    // Spin a little first: a producer is usually about to push.
    bool arrived = false;
    l.unlock();
    q.wake(w);
    w = Wake{};
    for (int i = 0; i < kSpinRounds && !arrived; ++i) {
      std::this_thread::yield();
      arrived = q.ready_hint.load(std::memory_order_relaxed) >= min_count;
    }
    l.lock();
    if (q.ready_count < min_count && !q.closed) {
      ++q.data_waiters;
      q.clock->wait_until(q.data_cv, l, std::min(deadline, q.next_consumer_timer()));
      --q.data_waiters;
    }
    now = q.clock->now();
    if (Clock::Duration(q.next_group_deadline.load(std::memory_order_acquire)) <= now) {
      l.unlock();
      q.run_group_timers_if_due(now);
      l.lock();
    }
  }
}

Status TrajectoryQueue::ack(std::uint64_t batch_id) {
  Impl& q = *impl_;
  Wake w;
  // With a WAL both locks are held throughout, so the ack record, the retired ids and a
  // compaction see one state.
  std::unique_lock<std::mutex> pl;
  if (q.wal) pl = lock_spinning(q.pmu);
  std::unique_lock<std::mutex> l = lock_spinning(q.mu);
  q.process_lease_timers(q.clock->now(), w);
  auto leave = [&](Status s) {
    if (l.owns_lock()) l.unlock();
    if (pl.owns_lock()) pl.unlock();
    q.wake(w);
    return s;
  };
  auto it = q.leases.find(batch_id);
  if (it == q.leases.end()) {
    if (q.expired_batches.contains(batch_id)) {
      return leave(aborted(
          fmt::format("ack: the lease of batch {} expired; its trajectories were requeued", batch_id)));
    }
    return leave(not_found(fmt::format("ack: batch {} is not leased (unknown or already acked)", batch_id)));
  }
  std::shared_ptr<internal::BatchData> d = it->second;
  if (q.wal) {
    std::vector<std::uint64_t> ids;
    ids.reserve(d->items.size());
    for (const Trajectory& t : d->items) ids.push_back(t.id.value());
    // Logged first: if the log cannot take the ack, the batch stays leased and may be acked again.
    if (Status s = q.wal_retire(internal::WalRetireReason::kAck, ids); !s.ok()) return leave(std::move(s));
  }
  q.leased_trajectories -= d->items.size();
  q.st.acked += d->items.size();
  q.leases.erase(it);
  if (!pl.owns_lock()) {
    // Gone from the leases, so no one else reaches these trajectories: retiring them can wait
    // for pmu without holding up the consumers.
    l.unlock();
    pl = lock_spinning(q.pmu);
  }
  for (const Trajectory& t : d->items) q.retire(t);
  q.space_freed(w);
  if (q.wal) q.note_bg(q.maybe_compact());
  return leave(ok_status());
}

Status TrajectoryQueue::nack(std::uint64_t batch_id) {
  Impl& q = *impl_;
  Wake w;
  std::unique_lock<std::mutex> l = lock_spinning(q.mu);
  q.process_lease_timers(q.clock->now(), w);
  auto leave = [&](Status s) {
    l.unlock();
    q.wake(w);
    return s;
  };
  auto it = q.leases.find(batch_id);
  if (it == q.leases.end()) {
    if (q.expired_batches.contains(batch_id)) {
      return leave(aborted(
          fmt::format("nack: the lease of batch {} expired; its trajectories were requeued", batch_id)));
    }
    return leave(not_found(fmt::format("nack: batch {} is not leased (unknown or already acked)", batch_id)));
  }
  ++q.st.nacked_batches;
  q.requeue(it, w);
  return leave(ok_status());
}

void TrajectoryQueue::close() {
  Impl& q = *impl_;
  {
    std::lock_guard<std::mutex> pl(q.pmu);
    std::lock_guard<std::mutex> l(q.mu);
    q.closed = true;
  }
  q.data_cv.notify_all();
  q.space_cv.notify_all();
}

QueueStats TrajectoryQueue::stats() const {
  Impl& q = *impl_;
  std::lock_guard<std::mutex> pl(q.pmu);
  std::lock_guard<std::mutex> l(q.mu);
  QueueStats s = q.st;
  s.ready = q.ready_count;
  s.ready_tokens = q.ready_tokens;
  s.pending_groups = q.groups.size();
  s.pending_group_trajectories = q.pending_trajectories;
  s.leases = q.leases.size();
  s.leased_trajectories = q.leased_trajectories;
  s.held_tokens = q.held_tokens;
  s.blocked_producers = std::size_t(q.space_waiters);
  s.blocked_consumers = std::size_t(q.data_waiters);
  s.newest_version = q.newest;
  s.wal = q.wal != nullptr;
  if (q.wal) {
    s.wal_bytes = q.wal->bytes();
    s.wal_records = q.wal->records();
  }
  return s;
}

const RecoveryReport& TrajectoryQueue::recovery() const noexcept { return impl_->recovery; }

Status TrajectoryQueue::background_error() const {
  std::lock_guard<std::mutex> l(impl_->pmu);
  return impl_->bg_error;
}

}  // namespace laminar
