#include "laminar/trajectory_queue.h"

#include <fmt/format.h>
#include <sched.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <iterator>
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

namespace {

// validate_trajectory's checks that read only the Trajectory itself, not the arrays it points to.
Status validate_fields(const Trajectory& t) {
  const std::uint64_t id = t.id.value();
  if (t.logprobs.size() != t.response_tokens.size()) {
    return invalid_argument(fmt::format("trajectory {}: {} logprobs for {} response tokens", id,
                                        t.logprobs.size(), t.response_tokens.size()));
  }
  if (t.rewards.empty()) return invalid_argument(fmt::format("trajectory {}: no reward", id));
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

Status check_rewards(const Trajectory& t) {
  for (std::size_t i = 0; i < t.rewards.size(); ++i) {
    if (!std::isfinite(t.rewards[i])) {
      return invalid_argument(fmt::format("trajectory {}: rewards[{}] = {} is not finite", t.id.value(), i,
                                          t.rewards[i]));
    }
  }
  return ok_status();
}

}  // namespace

Status validate_trajectory(const Trajectory& t, bool contents) {
  LAMINAR_RETURN_IF_ERROR(validate_fields(t));
  if (!contents) return ok_status();
  LAMINAR_RETURN_IF_ERROR(validate_contents(t));
  return check_rewards(t);
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

std::uint64_t mix64(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x;
}

// Consecutive ids kept together in one shard: an IdTable block's worth.
constexpr std::uint64_t kRunIds = 64;

// The largest id_dedup_window: the windows keep 8 bytes per id (a ring entry), and no more
// than 4 GiB of them.
constexpr std::uint64_t kMaxWindow = std::uint64_t(1) << 29;

// The trajectory ids a shard refuses: live ones (pending, ready or leased) and retired ones still
// in the dedup window. Which retired ids are still in the window is the retirement ring's
// business (Impl::retired_ring), which takes an id out here once it leaves; so the table holds
// only two bits per id, and no event numbers to sweep.
//
// Ids usually come from counters, so the table holds blocks of 64 consecutive ids: the block's
// number and a bit mask of each kind, 24 bytes for up to 64 ids. A queue's tables then stay in
// the core's caches (the default window's 65536 ids of a run take about 50 KB, the tables being
// at most half full), where larger ones made every push and every retirement a cache miss. An id
// with no neighbours takes a block to itself.
class IdTable {
 public:
  IdTable() : blocks_(16, Block{}) { publish_blocks(); }

  // Starts loading the block where a lookup of `id` begins; safe without the lock that guards the
  // table (a prefetch of a stale address, during a rehash, is harmless).
  void prefetch(std::uint64_t id) const {
    const Block* base = blocks_base_.load(std::memory_order_relaxed);
    __builtin_prefetch(base + home(id / kBlockIds, blocks_mask_.load(std::memory_order_relaxed)));
  }
  // Makes `id` live unless it is live or retired (then false).
  bool admit(std::uint64_t id) {
    Block& b = block_for(id);
    const std::uint64_t bit = bit_of(id);
    if ((b.live | b.retired) & bit) return false;
    b.live |= bit;
    return true;
  }
  // Live `id` (or, replaying a log, any id) becomes retired.
  void retire(std::uint64_t id) { retire_block(id / kBlockIds, bit_of(id)); }
  // retire() for the ids of block `run` (id / 64) whose bits `mask` sets: a burst of retirements
  // touches each block once, not once per id.
  void retire_block(std::uint64_t run, std::uint64_t mask) {
    Block& b = block_of_run(run);
    b.live &= ~mask;
    b.retired |= mask;
  }
  // forget_retired() for the ids of block `run` whose bits `mask` sets.
  void forget_retired_block(std::uint64_t run, std::uint64_t mask) { clear_block(run, mask, &Block::retired); }
  // Replaying a log: `id` is live, whatever else the log said of it.
  void set_live(std::uint64_t id) { block_for(id).live |= bit_of(id); }
  bool retired(std::uint64_t id) const {
    const Block& b = blocks_[probe(id / kBlockIds)];
    return b.run == id / kBlockIds && (b.retired & bit_of(id)) != 0;
  }
  // Clears the live (a push that failed) or the retired bit (out of the window) of `id`.
  void forget_live(std::uint64_t id) { clear(id, &Block::live); }
  void forget_retired(std::uint64_t id) { clear(id, &Block::retired); }

 private:
  static constexpr std::uint64_t kBlockIds = 64;
  static constexpr std::uint64_t kEmptyRun = ~std::uint64_t(0);  // no id / kBlockIds is this
  struct Block {
    std::uint64_t run = kEmptyRun;  // id / kBlockIds, or kEmptyRun in a free slot
    std::uint64_t live = 0;
    std::uint64_t retired = 0;
  };

  static std::uint64_t bit_of(std::uint64_t id) { return std::uint64_t(1) << (id % kBlockIds); }
  std::size_t mask() const { return blocks_.size() - 1; }
  static std::size_t home(std::uint64_t run, std::size_t mask) { return std::size_t(mix64(run)) & mask; }
  // The slot holding `run`, or the free one where it would go (linear probing).
  std::size_t probe(std::uint64_t run) const {
    std::size_t i = home(run, mask());
    while (blocks_[i].run != run && blocks_[i].run != kEmptyRun) i = (i + 1) & mask();
    return i;
  }
  // The block of `id`, taken for it if there was none.
  Block& block_for(std::uint64_t id) { return block_of_run(id / kBlockIds); }
  Block& block_of_run(std::uint64_t run) {
    std::size_t i = probe(run);
    if (blocks_[i].run == run) return blocks_[i];
    if (2 * (size_ + 1) > blocks_.size()) {
      grow();
      i = probe(run);
    }
    ++size_;
    blocks_[i] = Block{run, 0, 0};
    return blocks_[i];
  }
  void clear(std::uint64_t id, std::uint64_t Block::*bits) { clear_block(id / kBlockIds, bit_of(id), bits); }
  void clear_block(std::uint64_t run, std::uint64_t mask, std::uint64_t Block::*bits) {
    const std::size_t i = probe(run);
    Block& b = blocks_[i];
    if (b.run != run) return;
    b.*bits &= ~mask;
    if ((b.live | b.retired) == 0) remove_at(i);
  }
  // Empties slot `i`, moving later blocks of its probe run back so that every block stays
  // reachable from its home (no tombstones to sweep).
  void remove_at(std::size_t i) {
    for (std::size_t j = (i + 1) & mask(); blocks_[j].run != kEmptyRun; j = (j + 1) & mask()) {
      const std::size_t k = home(blocks_[j].run, mask());
      // The block at j may move to i unless its home lies cyclically in (i, j].
      const bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
      if (stays) continue;
      blocks_[i] = blocks_[j];
      i = j;
    }
    blocks_[i] = Block{};
    --size_;
  }
  void grow() {
    std::vector<Block> old(2 * blocks_.size());
    old.swap(blocks_);
    for (const Block& b : old) {
      if (b.run != kEmptyRun) blocks_[probe(b.run)] = b;
    }
    publish_blocks();
  }
  void publish_blocks() {
    blocks_base_.store(blocks_.data(), std::memory_order_relaxed);
    blocks_mask_.store(mask(), std::memory_order_relaxed);
  }

  std::vector<Block> blocks_;
  // Read by prefetch() without the lock.
  std::atomic<const Block*> blocks_base_{nullptr};
  std::atomic<std::size_t> blocks_mask_{0};
  std::size_t size_ = 0;  // blocks taken
};

// The last `capacity` ids pushed, in order: a dedup window. Grows to `capacity`, then each push
// replaces the oldest.
class IdRing {
 public:
  explicit IdRing(std::size_t capacity) : capacity_(capacity) {}
  // Adds `id` as the newest; returns the oldest, when the ring was full and `id` took its place.
  std::optional<std::uint64_t> push(std::uint64_t id) {
    if (ring_.size() < capacity_) {
      ring_.push_back(id);
      return std::nullopt;
    }
    const std::uint64_t oldest = ring_[next_];
    ring_[next_] = id;
    if (++next_ == ring_.size()) next_ = 0;
    return oldest;
  }
  std::size_t size() const { return ring_.size(); }
  // f(id) for each id, oldest first.
  template <class F>
  void for_each(F f) const {
    for (std::size_t i = next_; i < ring_.size(); ++i) f(ring_[i]);
    for (std::size_t i = 0; i < next_; ++i) f(ring_[i]);
  }

 private:
  std::size_t capacity_;
  std::vector<std::uint64_t> ring_;
  std::size_t next_ = 0;  // the oldest, once full
};

// The last `capacity` ids added (groups closed, leases expired), exactly: an IdRing of them, and
// an IdTable of the same ids for lookups. Guarded by its user.
class RecentIds {
 public:
  explicit RecentIds(std::size_t capacity) : ring_(capacity) {}
  // `id`, not in the window (the callers add an id only once while it is), becomes its newest.
  void add(std::uint64_t id) {
    ids_.retire(id);
    if (std::optional<std::uint64_t> oldest = ring_.push(id)) ids_.forget_retired(*oldest);
  }
  bool contains(std::uint64_t id) const { return ids_.retired(id); }
  // f(id) for each id of the window, oldest first.
  template <class F>
  void for_each(F f) const {
    ring_.for_each(f);
  }

 private:
  IdRing ring_;
  IdTable ids_;
};

// The vectors of units go round instead of being freed: a producer allocates one per unit and a
// consumer empties it, and freeing it there takes glibc's lock of the producer's arena, which the
// producers' own allocations hold at the same time; that lock then sleeps (it made most of the
// queue's futex calls). Emptied ones wait in Impl::spare_items; producers take a few at a time,
// while they hold mu anyway, into their thread's stack.
thread_local std::vector<std::vector<Trajectory>> t_spare_items;
constexpr std::size_t kThreadSpareItems = 16;
constexpr std::size_t kSpareItems = 4096;

std::vector<Trajectory> new_items(std::size_t n) {
  std::vector<Trajectory> v;
  if (!t_spare_items.empty()) {
    v = std::move(t_spare_items.back());
    t_spare_items.pop_back();
  }
  v.reserve(n);
  return v;
}

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
  // An ungrouped trajectory's unit.
  static Unit lone(Trajectory&& t) {
    Unit u;
    u.items = new_items(1);
    u.add(std::move(t));
    return u;
  }
};

// The sample indices of a group that have arrived: a bit mask, for groups of up to 64.
class SampleSet {
 public:
  explicit SampleSet(std::uint32_t group_size = 0) {
    if (group_size > 64) more_.assign(group_size, false);
  }
  bool test(std::uint32_t i) const { return more_.empty() ? (bits_ >> i) & 1 : bool(more_[i]); }
  void set(std::uint32_t i) {
    if (more_.empty()) {
      bits_ |= std::uint64_t(1) << i;
    } else {
      more_[i] = true;
    }
  }

 private:
  std::uint64_t bits_ = 0;
  std::vector<bool> more_;
};

struct PendingGroup {
  std::uint32_t group_size = 0;
  std::uint64_t prompt_id = 0;
  Clock::Duration first_arrival{0};
  Unit unit;
  SampleSet seen;

  // A group opened by its first member `t`, arriving at `now`.
  void open(const Trajectory& t, Clock::Duration now) {
    group_size = t.group_size;
    prompt_id = t.prompt_id;
    first_arrival = now;
    seen = SampleSet(t.group_size);
    unit.items = new_items(t.group_size);
  }
};

using Deadline = std::pair<Clock::Duration, std::uint64_t>;

// The lock of the id and group shards and of the retirement log, whose critical sections take a
// few hundred nanoseconds: taken and let go inline with one atomic operation each, where
// std::mutex calls into pthread for both. Blocks on the word itself (a futex) once
// lock_spinning() has given up spinning. 0: free; 1: held; 2: held, and someone may sleep on it.
class SpinMutex {
 public:
  bool try_lock() noexcept {
    std::uint32_t expected = 0;
    return state_.load(std::memory_order_relaxed) == 0 &&
           state_.compare_exchange_strong(expected, 1, std::memory_order_acquire, std::memory_order_relaxed);
  }
  void lock() noexcept {
    if (try_lock()) return;
    while (state_.exchange(2, std::memory_order_acquire) != 0) state_.wait(2, std::memory_order_relaxed);
  }
  void unlock() noexcept {
    if (state_.exchange(0, std::memory_order_release) == 2) state_.notify_one();
  }

 private:
  std::atomic<std::uint32_t> state_{0};
};

// Ids are spread over kIdShards and groups over kGroupShards by hash, each shard under its own
// lock, so producers pushing different groups rarely meet.
constexpr std::size_t kIdShards = 16;
constexpr std::size_t kRetireBurst = 512;
constexpr std::size_t kGroupShards = 16;

struct IdShard {
  alignas(64) SpinMutex mu;
  IdTable ids;
  std::uint64_t pushed = 0;
};

struct GroupShard {
  alignas(64) SpinMutex mu;
  std::unordered_map<std::uint64_t, PendingGroup> groups;
  std::size_t pending_trajectories = 0;
  std::deque<Deadline> deadlines;  // FIFO: one timeout for all
  // deadlines.front() (or kForever), read without the lock to decide whether timers are due:
  // by every pop, for all shards, so on a line of its own that pushes do not write.
  alignas(64) std::atomic<Clock::Duration::rep> next_deadline{Clock::kForever.count()};
  alignas(64) std::uint64_t dropped_group_timeout = 0;
  std::uint64_t dropped_late_for_group = 0;
  WaitHistogram group_wait;

  void set_deadline_hint() {
    next_deadline.store(deadlines.empty() ? Clock::kForever.count() : deadlines.front().first.count(),
                        std::memory_order_release);
  }
};

std::size_t wal_record_bytes(const Trajectory& t) { return 24 + encoded_size(t); }

// Moves whole units into a batch, with what each trajectory's info says; their vectors are left
// empty, for keep_spare_items().
void fill_batch(internal::BatchData& d, std::vector<Unit>& units, std::uint64_t consumer_version, bool mark_stale,
                std::uint64_t max_staleness) {
  std::size_t n = 0;
  for (const Unit& u : units) n += u.items.size();
  d.items.reserve(n);
  d.info.reserve(n);
  d.unit_len.reserve(n);
  for (Unit& u : units) {
    const std::size_t len = u.items.size();
    for (std::size_t i = 0; i < len; ++i) {
      Trajectory& t = u.items[i];
      const std::uint64_t s = consumer_version > t.version.value() ? consumer_version - t.version.value() : 0;
      d.info.push_back(TrajectoryInfo{s, mark_stale && s > max_staleness, u.partial_group, u.deliveries + 1});
      d.unit_len.push_back(i == 0 ? std::uint32_t(len) : 0u);
      d.items.push_back(std::move(t));
    }
    u.items.clear();
  }
}

constexpr std::size_t kExpiredBatchMemory = 1 << 16;
// Timers of groups or leases that ended are dropped lazily once they outnumber the live ones
// twice over and by this many.
constexpr std::size_t kStaleTimers = 1024;
// Capacity credit (Impl::try_reserve): per-CPU slots, each refilled with 1/kCreditShare of the
// capacity at a time (at most kCreditRefillTrajectories), only for queues of at least
// kCreditShare * 4 trajectories.
constexpr std::size_t kCreditSlots = 16;
constexpr std::size_t kCreditShare = 256;
constexpr std::size_t kCreditRefillTrajectories = 32;
struct alignas(64) CreditSlot {
  std::atomic<std::uint64_t> word{0};  // held_word() of the room idle in the slot
};
// push_many's encoding buffer is freed after a call that grew it past this.
constexpr std::size_t kKeptEncodedBytes = std::size_t(4) << 20;
// Held capacity packs the trajectory count and the token count into one 64-bit word.
constexpr int kTokenBits = 40;
constexpr std::uint64_t kMaxCapacityTokens = (std::uint64_t(1) << kTokenBits) - 1;
constexpr std::uint64_t kMaxCapacityTrajectories = (std::uint64_t(1) << (64 - kTokenBits)) - 1;
// Yields a consumer makes before sleeping on data_cv: a sleeper costs the producer a wake and
// itself a trip through the scheduler, but a consumer that keeps yielding keeps its core busy. With
// 2 producers and 2 consumers on 2 cores, runs then often went about 30% slower, the producers
// together getting one core's time and the yielding consumers the other's. Measured there, runs of one queue: that state in 17 of
// 32 runs with 32 yields, 3 of 10 with 4 or 8, 2 of 32 with 1, every run with 0; the runs that
// avoided it were equally fast for all.
constexpr int kSpinRounds = 1;

// Locks `mu`, spinning first: critical sections here are a few hundred nanoseconds, far less
// than putting a thread to sleep on the futex and waking it again. The spin is short (a pause
// takes about 27 ns here) and then yields: with more threads than cores a holder that stays
// longer has usually been preempted, and yielding lets it run.
template <class Mutex>
std::unique_lock<Mutex> lock_spinning(Mutex& mu) {
  for (int i = 0; i < 256; ++i) {
    if (mu.try_lock()) return std::unique_lock<Mutex>(mu, std::adopt_lock);
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  for (int i = 0; i < 16; ++i) {
    std::this_thread::yield();
    if (mu.try_lock()) return std::unique_lock<Mutex>(mu, std::adopt_lock);
  }
  return std::unique_lock<Mutex>(mu);
}
using ShardLock = std::unique_lock<SpinMutex>;

void add_wait(WaitHistogram& h, Clock::Duration waited) {
  const double ms = std::chrono::duration<double, std::milli>(waited).count();
  ++h.count;
  h.sum_ms += ms;
  h.max_ms = std::max(h.max_ms, ms);
  int b = 0;
  while (b + 1 < WaitHistogram::kBuckets && ms >= double(1ull << b)) ++b;
  ++h.buckets[b];
}

}  // namespace

// Locks, so that producers pushing different groups, and producers and consumers, run side by
// side:
//   wmu: with a write-ahead log, every change the log records (push, ack, drop, group closed,
//     version) is made under it, so the log and the state move together; also serialises
//     publish_version;
//   GroupShard::mu: pending groups and their timeouts;
//   apply_mu: making the retirement log's changes in the id shards, one burst at a time;
//   IdShard::mu: the ids of the shard, live and recently retired;
//   mu: the consumer side: the ready queue, leases and their expiry;
//   retire_mu, closed_mu, space_mu, bg_mu: leaves (no other queue lock is taken under them):
//     the dedup window and the retirement log, the closed groups, producers waiting for space,
//     the background error.
// Order: wmu, then a group shard, then apply_mu, then an id shard, then mu; never two shards of
// a kind except all of them in order (stats(), compaction). Capacity is one atomic word (`held`).
struct TrajectoryQueue::Impl {
  explicit Impl(QueueOptions o)
      : opt(std::move(o)),
        clock(opt.clock ? opt.clock : Clock::steady()),
        closed_groups(opt.id_dedup_window),
        retired_ring(opt.id_dedup_window) {}

  QueueOptions opt;
  std::shared_ptr<Clock> clock;
  // Set by open(); appends are under wmu.
  std::unique_ptr<internal::TrajectoryWal> wal;

  std::atomic<bool> closed{false};
  std::atomic<std::uint64_t> newest{0};

  alignas(64) std::mutex wmu;
  std::uint64_t wal_live_bytes = 0;  // under wmu
  std::string wal_buf;               // under wmu
  RecoveryReport recovery;
  std::mutex bg_mu;
  Status bg_error;  // under bg_mu

  // Capacity: what the queue holds, pending, ready and leased: trajectories above kTokenBits,
  // tokens below, so that one compare-and-swap takes room for both.
  alignas(64) std::atomic<std::uint64_t> held{0};
  // Room taken from `held` ahead of pushes, per CPU (see try_reserve); counted in `held`.
  CreditSlot credit[kCreditSlots];
  // Room a slot takes from `held` at a time; 0 for a queue too small to leave room idle in slots.
  std::size_t refill_count = 0;
  std::size_t refill_tokens = 0;
  alignas(64) std::mutex space_mu;
  std::condition_variable space_cv;  // producers wait for capacity
  std::atomic<int> space_waiters{0};

  // The last id_dedup_window groups closed (complete, released or dropped), across all shards;
  // taken under a group shard's lock.
  alignas(64) SpinMutex closed_mu;
  RecentIds closed_groups;
  alignas(64) std::atomic<std::uint64_t> rejected_invalid{0};
  std::atomic<std::uint64_t> rejected_full{0};

  IdShard id_shards[kIdShards];
  // Under retire_mu: the last id_dedup_window ids retired (acked or dropped), across all shards;
  // and the changes to the id shards not yet made:
  // ids retired, and ids that left the window. The acks hand those over in bursts, so they touch
  // each shard once per run of ids in it, not once per batch. Until then a retired id is refused
  // as if live (its window does that anyway), and one that left the window as if still in it
  // until a push of it makes the changes (flush_retirements).
  alignas(64) SpinMutex retire_mu;
  IdRing retired_ring;
  std::vector<std::uint64_t> retired_log;
  std::vector<std::uint64_t> left_log;
  // Held while a burst is applied, so that bursts apply in order: an id's retirement before its
  // leaving the window.
  SpinMutex apply_mu;
  GroupShard group_shards[kGroupShards];

  // --- consumer side, under mu ---
  alignas(64) mutable std::mutex mu;
  std::condition_variable data_cv;  // consumers wait for ready trajectories
  // The min_trajectories of each consumer waiting for trajectories, and the smallest of them:
  // fewer ready cannot end any wait (pop_batch takes nothing below its min_trajectories), so a
  // producer wakes no one until that many are ready. A trainer waiting for a full batch is then
  // woken once per batch, not once per group published, and each wake costs the producer a futex
  // call.
  std::vector<std::size_t> waiter_mins;
  std::size_t wake_at = SIZE_MAX;
  // Consumers were woken since the last of them started waiting: one notify_all reaches every
  // waiter, and another would only take the condition variable's lock away from them again.
  bool waiters_woken = false;
  Ring<Unit> ready;
  std::vector<std::vector<Trajectory>> spare_items;  // see new_items()
  std::size_t ready_count = 0;
  // ready_count as of the last change, read without the lock by consumers spinning before they
  // sleep (sleeping and waking costs more than a whole push).
  std::atomic<std::size_t> ready_hint{0};
  std::size_t ready_tokens = 0;
  std::unordered_map<std::uint64_t, std::shared_ptr<internal::BatchData>> leases;
  std::size_t leased_trajectories = 0;
  std::priority_queue<Deadline, std::vector<Deadline>, std::greater<>> lease_deadlines;
  std::uint64_t next_batch_id = 1;
  // The last kExpiredBatchMemory batches whose lease expired.
  RecentIds expired_batches{kExpiredBatchMemory};
  // Counters of the consumer side; the producer side's live in the shards.
  std::uint64_t delivered = 0, acked = 0, nacked_batches = 0, expired_leases = 0, redelivered = 0;
  std::uint64_t dropped_stale = 0;
  std::uint64_t staleness[QueueStats::kStalenessBuckets] = {};

  ClockSubscription clock_sub;

  // A run of consecutive ids stays in one shard, with its IdTable block.
  static std::size_t id_shard_index(std::uint64_t id) {
    return mix64((id / kRunIds) ^ 0x9e3779b97f4a7c15ull) >> 60;
  }
  IdShard& id_shard(std::uint64_t id) { return id_shards[id_shard_index(id)]; }
  GroupShard& group_shard(std::uint64_t gid) {
    return group_shards[mix64(gid ^ 0x6a09e667f3bcc909ull) >> 60];
  }
  static_assert(kIdShards == 16 && kGroupShards == 16, "shard picked by the hash's top 4 bits");

  void note_bg(Status s) {
    if (s.ok()) return;
    std::lock_guard<std::mutex> l(bg_mu);
    if (bg_error.ok()) bg_error = std::move(s);
  }

  // --- write-ahead log, with wmu held ---

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

  Status wal_u64(internal::WalRecordType type, std::uint64_t v, bool sync = true) {
    if (!wal) return ok_status();
    const std::string_view payload(reinterpret_cast<const char*>(&v), 8);
    const internal::TrajectoryWal::Record r{type, payload, internal::TrajectoryWal::checksum(type, payload)};
    return wal->append_all(std::span<const internal::TrajectoryWal::Record>(&r, 1), sync);
  }

  // --- capacity ---

  static std::uint64_t held_word(std::size_t count, std::size_t tokens) {
    return (std::uint64_t(count) << kTokenBits) + tokens;
  }
  static std::size_t count_of(std::uint64_t word) { return std::size_t(word >> kTokenBits); }
  static std::size_t tokens_of(std::uint64_t word) { return std::size_t(word & kMaxCapacityTokens); }
  bool fits(std::uint64_t word, std::size_t count, std::size_t tokens) const {
    return count_of(word) + count <= opt.capacity_trajectories && tokens_of(word) + tokens <= opt.capacity_tokens;
  }
  // Whether a trajectory of `tokens` would fit, the slots' idle room counted as free.
  bool fits(std::size_t tokens) const { return fits(in_use(), 1, tokens); }

  // Takes room for `count` trajectories of `tokens` tokens in all, or nothing.
  //
  // `held` is written by every producer and consumer, and reading it was a cache miss on every
  // push. So a single trajectory takes its room from its CPU's slot, which takes a refill from
  // `held` when it runs short. Only a push that finds no room in `held` takes the slots' idle
  // room back first: a full queue stays exactly full, and the room idle in slots is at most
  // kCreditSlots / kCreditShare of the capacity.
  bool try_reserve(std::size_t count, std::size_t tokens) {
    if (refill_count != 0 && count == 1 && tokens <= refill_tokens) {
      const int cpu = ::sched_getcpu();
      std::atomic<std::uint64_t>& slot = credit[std::size_t(cpu < 0 ? 0 : cpu) % kCreditSlots].word;
      std::uint64_t c = slot.load(std::memory_order_relaxed);
      while (count_of(c) >= 1 && tokens_of(c) >= tokens) {
        if (slot.compare_exchange_weak(c, c - held_word(1, tokens), std::memory_order_relaxed)) return true;
      }
      // A refill replaces what is left, which goes back: a slot never holds more than one.
      if (take_held(1 + refill_count, tokens + refill_tokens)) {
        if (const std::uint64_t left = slot.exchange(held_word(refill_count, refill_tokens)); left != 0) {
          held.fetch_sub(left);
        }
        return true;
      }
    }
    if (take_held(count, tokens)) return true;
    return refill_count != 0 && reclaim_credit() && take_held(count, tokens);
  }

  bool take_held(std::size_t count, std::size_t tokens) {
    std::uint64_t h = held.load(std::memory_order_relaxed);
    do {
      if (!fits(h, count, tokens)) return false;
    } while (!held.compare_exchange_weak(h, h + held_word(count, tokens)));
    return true;
  }

  // Gives every slot's idle room back to `held`; true if there was any.
  bool reclaim_credit() {
    bool any = false;
    for (CreditSlot& s : credit) {
      if (const std::uint64_t c = s.word.exchange(0); c != 0) {
        held.fetch_sub(c);
        any = true;
      }
    }
    return any;
  }

  // `held` less the slots' idle room: what the queue holds. Read while others push, each field
  // may be off by what moved meanwhile, never below zero.
  std::uint64_t in_use() const {
    std::size_t idle_count = 0, idle_tokens = 0;
    for (const CreditSlot& s : credit) {
      const std::uint64_t c = s.word.load(std::memory_order_relaxed);
      idle_count += count_of(c);
      idle_tokens += tokens_of(c);
    }
    const std::uint64_t h = held.load();
    return held_word(count_of(h) - std::min(count_of(h), idle_count), tokens_of(h) - std::min(tokens_of(h), idle_tokens));
  }

  void release_space(std::size_t count, std::size_t tokens) {
    held.fetch_sub(held_word(count, tokens));
    // Pairs with the waiter's increment before its last look at the counters (both seq_cst):
    // either it sees this space or this sees it waiting; locking space_mu makes sure it waits
    // before the notification.
    if (space_waiters.load() > 0) {
      { std::lock_guard<std::mutex> l(space_mu); }
      space_cv.notify_all();
    }
  }

  // --- ids ---

  // Forgets trajectories for good (acked or dropped): frees their room; their ids stay refused
  // for the next id_dedup_window retirements. Takes the id shards' locks one at a time (so it
  // may run with a group shard held).
  template <class It>
  void retire(It begin, It end) {
    const std::size_t n = std::size_t(end - begin);
    if (n == 0) return;
    std::size_t tokens = 0;
    for (It it = begin; it != end; ++it) {
      tokens += it->num_tokens();
      if (wal) wal_live_bytes -= wal_record_bytes(*it);
    }
    bool burst = false;
    {
      ShardLock l = lock_spinning(retire_mu);
      for (It it = begin; it != end; ++it) enter_window(it->id.value());
      burst = retired_log.size() >= kRetireBurst;
    }
    release_space(n, tokens);
    // A burst already being applied will take this one too.
    if (burst && apply_mu.try_lock()) {
      ShardLock al(apply_mu, std::adopt_lock);
      apply_retirements();
    }
  }

  // With retire_mu held: `id` retires into the window, and, once the window is full, pushes the
  // oldest one out of it.
  void enter_window(std::uint64_t id) {
    retired_log.push_back(id);
    if (std::optional<std::uint64_t> oldest = retired_ring.push(id)) left_log.push_back(*oldest);
  }

  // Makes every logged change to the id shards, waiting for a burst another thread applies.
  void flush_retirements() {
    ShardLock al = lock_spinning(apply_mu);
    apply_retirements();
  }

  // With apply_mu held: makes the logged changes, until the log is empty. All retirements of a
  // burst go before its ids that left the window: an id leaves after it retired, and cannot
  // retire again before its leaving is made (until then a push of it is refused).
  void apply_retirements() {
    thread_local std::vector<std::uint64_t> retired, left;
    for (;;) {
      retired.clear();
      left.clear();
      {
        ShardLock l = lock_spinning(retire_mu);
        retired.swap(retired_log);
        left.swap(left_log);
      }
      if (retired.empty() && left.empty()) return;
      in_id_blocks(retired, [](IdTable& t, std::uint64_t run, std::uint64_t mask) { t.retire_block(run, mask); });
      in_id_blocks(left, [](IdTable& t, std::uint64_t run, std::uint64_t mask) { t.forget_retired_block(run, mask); });
    }
  }

  // Makes `l` hold the lock of `s`, letting go of `locked`'s first when that is another shard.
  static void hold_shard(IdShard& s, IdShard*& locked, ShardLock& l) {
    if (&s == locked) return;
    if (l.owns_lock()) l.unlock();
    l = lock_spinning(s.mu);
    locked = &s;
  }

  // f(table, run, mask) for each stretch of `ids` in one 64-id block (run: id / 64), with the bit
  // mask of its ids, under the block's shard lock, taken once per stretch of shards. Acked batches
  // hold their ids mostly in counter order, so a burst takes a few block lookups, not one per id.
  template <class F>
  void in_id_blocks(const std::vector<std::uint64_t>& ids, F f) {
    static_assert(kRunIds == 64, "a run of ids is one 64-bit mask");
    IdShard* locked = nullptr;
    ShardLock l;
    for (std::size_t i = 0; i < ids.size();) {
      const std::uint64_t run = ids[i] / kRunIds;
      std::uint64_t mask = 0;
      for (; i < ids.size() && ids[i] / kRunIds == run; ++i) mask |= std::uint64_t(1) << (ids[i] % kRunIds);
      IdShard& s = id_shard(run * kRunIds);
      hold_shard(s, locked, l);
      f(s.ids, run, mask);
    }
  }

  // f(shard, its lock, x) for each x of `xs`, in order, locking the shard of id_of(x) once per
  // run of them in it (ids from a counter stay in one for kRunIds).
  template <class Range, class IdOf, class F>
  void in_id_runs(const Range& xs, IdOf id_of, F f) {
    IdShard* locked = nullptr;
    ShardLock l;
    for (const auto& x : xs) {
      IdShard& s = id_shard(id_of(x));
      hold_shard(s, locked, l);
      f(s, l, x);
    }
  }

  // Gives back an id reserved by a push that then failed.
  void unreserve(std::uint64_t id) {
    IdShard& s = id_shard(id);
    ShardLock l = lock_spinning(s.mu);
    s.ids.forget_live(id);
    --s.pushed;
  }

  // push()'s checks against the queue's settings and newest version; counts a refusal.
  Status check_fits(const Trajectory& t) {
    const std::uint64_t id = t.id.value();
    auto reject_invalid = [&](std::string m) {
      rejected_invalid.fetch_add(1, std::memory_order_relaxed);
      return invalid_argument(std::move(m));
    };
    if (const std::uint64_t v = newest.load(std::memory_order_acquire); t.version.value() > v) {
      return reject_invalid(fmt::format("trajectory {}: version {} is ahead of the newest published version {}", id,
                                        t.version.value(), v));
    }
    if (t.num_tokens() > opt.capacity_tokens) {
      return reject_invalid(fmt::format("trajectory {}: {} tokens exceed the queue's capacity of {} tokens", id,
                                        t.num_tokens(), opt.capacity_tokens));
    }
    if (t.group_size > opt.capacity_trajectories) {
      return reject_invalid(fmt::format("trajectory {}: group_size {} exceeds capacity_trajectories {}", id,
                                        t.group_size, opt.capacity_trajectories));
    }
    return ok_status();
  }

  // Makes `id` live in its shard `is`, whose lock `il` holds (and holds again on return). False,
  // counted, if it is live or retired within the window.
  bool admit_id(IdShard& is, ShardLock& il, std::uint64_t id) {
    if (!is.ids.admit(id)) {
      // Its leaving the window may still be in the log: look again with every logged change made.
      il.unlock();
      flush_retirements();
      il = lock_spinning(is.mu);
      if (!is.ids.admit(id)) {
        rejected_invalid.fetch_add(1, std::memory_order_relaxed);
        return false;
      }
    }
    ++is.pushed;
    return true;
  }

  // --- groups, with the group shard's lock held ---

  void close_group_id(std::uint64_t gid) {
    ShardLock l = lock_spinning(closed_mu);
    closed_groups.add(gid);
  }

  bool group_closed(std::uint64_t gid) {
    ShardLock l = lock_spinning(closed_mu);
    return closed_groups.contains(gid);
  }

  // What refuses `t` as a member of its group (`group`: the pending one, or end()); counted.
  Status refuse_member(GroupShard& gs, const Trajectory& t,
                       std::unordered_map<std::uint64_t, PendingGroup>::const_iterator group) {
    if (group != gs.groups.end()) return refuse_joining(t, group->second.group_size, group->second.prompt_id, group->second.seen);
    // Only a group not pending can be closed: a closed group leaves the pending ones for good.
    if (group_closed(t.group_id)) return refuse_closed(gs, t);
    return ok_status();
  }
  Status refuse_closed(GroupShard& gs, const Trajectory& t) {
    ++gs.dropped_late_for_group;
    return failed_precondition(fmt::format("trajectory {}: group {} is already closed (complete, released or dropped)",
                                           t.id.value(), t.group_id));
  }
  // What refuses `t` joining a group of `group_size` for `prompt_id` that has the samples `seen`.
  Status refuse_joining(const Trajectory& t, std::uint32_t group_size, std::uint64_t prompt_id, const SampleSet& seen) {
    const std::uint64_t id = t.id.value();
    if (group_size != t.group_size || prompt_id != t.prompt_id) {
      rejected_invalid.fetch_add(1, std::memory_order_relaxed);
      return invalid_argument(fmt::format(
          "trajectory {}: group {} has group_size {} and prompt {}, this member says {} and {}", id, t.group_id,
          group_size, prompt_id, t.group_size, t.prompt_id));
    }
    if (seen.test(t.sample_index)) {
      rejected_invalid.fetch_add(1, std::memory_order_relaxed);
      return invalid_argument(fmt::format("trajectory {}: group {} already has sample_index {}", id, t.group_id,
                                          t.sample_index));
    }
    return ok_status();
  }

  // Adds `t`, which refuse_member let through, to its group (`group`: the pending one, or end()
  // to open it) at `now`. True when that completed the group: it is closed, and moved to `done`.
  bool add_member(GroupShard& gs, std::unordered_map<std::uint64_t, PendingGroup>::iterator group,
                  Trajectory&& t, Clock::Duration now, Unit& done) {
    const std::uint64_t gid = t.group_id;
    const bool fresh = group == gs.groups.end();
    if (fresh) group = gs.groups.try_emplace(gid).first;
    PendingGroup& g = group->second;
    if (fresh) {
      g.open(t, now);
      if (opt.group_timeout != Clock::kForever) {
        gs.deadlines.emplace_back(g.first_arrival + opt.group_timeout, gid);
        if (gs.deadlines.size() == 1) gs.set_deadline_hint();
        if (gs.deadlines.size() > 2 * gs.groups.size() + kStaleTimers) prune_group_timers(gs);
      }
    }
    g.seen.set(t.sample_index);
    g.unit.add(std::move(t));
    ++gs.pending_trajectories;
    if (g.unit.items.size() < g.group_size) return false;
    add_wait(gs.group_wait, now - g.first_arrival);
    close_group_id(gid);
    // The trajectory is in the queue either way; a failed group record only means a late
    // duplicate member could be accepted after a restart, so it is reported, not undone. Nor is
    // it synced on its own: a replay closes a complete group anyway, and the ack of its members
    // comes later in the log, so syncing that carries this record too.
    note_bg(wal_u64(internal::WalRecordType::kGroupClosed, gid, /*sync=*/false));
    done = take_group(gs, g, /*partial=*/false);
    gs.groups.erase(group);
    return true;
  }

  // Takes a group's members out as one unit, in sample order.
  Unit take_group(GroupShard& gs, PendingGroup& g, bool partial) {
    auto by_index = [](const Trajectory& a, const Trajectory& b) { return a.sample_index < b.sample_index; };
    // Members mostly arrive in order; sorting sorted input would still move every one twice.
    if (!std::is_sorted(g.unit.items.begin(), g.unit.items.end(), by_index)) {
      std::sort(g.unit.items.begin(), g.unit.items.end(), by_index);
    }
    g.unit.partial_group = partial;
    gs.pending_trajectories -= g.unit.items.size();
    return std::move(g.unit);
  }

  Status time_out_group(GroupShard& gs, std::unordered_map<std::uint64_t, PendingGroup>::iterator it,
                        Clock::Duration now, bool& data) {
    PendingGroup& g = it->second;
    const std::uint64_t gid = it->first;
    add_wait(gs.group_wait, now - g.first_arrival);
    close_group_id(gid);
    Status s = wal_u64(internal::WalRecordType::kGroupClosed, gid);
    if (opt.partial_group_policy == PartialGroupPolicy::kRelease) {
      data |= publish(take_group(gs, g, /*partial=*/true));
    } else {
      std::vector<std::uint64_t> ids;
      for (const Trajectory& t : g.unit.items) ids.push_back(t.id.value());
      Status wr = wal_retire(internal::WalRetireReason::kGroupTimeout, ids);
      if (s.ok()) s = wr;
      gs.dropped_group_timeout += g.unit.items.size();
      gs.pending_trajectories -= g.unit.items.size();
      retire(g.unit.items.begin(), g.unit.items.end());
    }
    gs.groups.erase(it);
    return s;
  }

  // Drops the timers of groups no longer pending: completed groups leave theirs behind, which
  // would otherwise pile up for a whole group_timeout at the push rate.
  void prune_group_timers(GroupShard& gs) {
    std::erase_if(gs.deadlines, [&](const Deadline& d) {
      auto it = gs.groups.find(d.second);
      return it == gs.groups.end() || it->second.first_arrival + opt.group_timeout != d.first;
    });
    gs.set_deadline_hint();
  }

  // The shard's group timeouts due by `now`; with a WAL, wmu is held.
  void process_group_timers(GroupShard& gs, Clock::Duration now, bool& data) {
    if (gs.next_deadline.load(std::memory_order_relaxed) > now.count()) return;
    while (!gs.deadlines.empty() && gs.deadlines.front().first <= now) {
      const auto [deadline, gid] = gs.deadlines.front();
      gs.deadlines.pop_front();
      auto it = gs.groups.find(gid);
      if (it == gs.groups.end() || it->second.first_arrival + opt.group_timeout != deadline) continue;
      note_bg(time_out_group(gs, it, now, data));
    }
    gs.set_deadline_hint();
  }

  Clock::Duration next_group_deadline() const {
    Clock::Duration::rep t = Clock::kForever.count();
    for (const GroupShard& gs : group_shards) t = std::min(t, gs.next_deadline.load(std::memory_order_acquire));
    return Clock::Duration(t);
  }

  // Every shard's due group timeouts, from a thread holding no lock but, with a WAL and
  // `wal_held`, wmu: group timeouts must fire while no producer pushes into their shard.
  void run_group_timers_if_due(Clock::Duration now, bool wal_held = false) {
    bool data = false;
    std::unique_lock<std::mutex> wl;
    for (GroupShard& gs : group_shards) {
      if (gs.next_deadline.load(std::memory_order_acquire) > now.count()) continue;
      if (wal && !wal_held && !wl.owns_lock()) wl = lock_spinning(wmu);
      ShardLock l = lock_spinning(gs.mu);
      process_group_timers(gs, now, data);
    }
    if (data) data_cv.notify_all();
  }

  // --- consumer side ---

  // Hands a unit to the consumers; takes mu. True if a consumer waits for it (the caller
  // notifies data_cv once its locks are let go).
  bool publish(Unit&& u) {
    std::unique_lock<std::mutex> l = lock_spinning(mu);
    append_ready(std::move(u));
    return published();
  }

  // With mu held: the emptied vectors of `units` wait for producers; empties `units`.
  void keep_spare_items(std::vector<Unit>& units) {
    for (Unit& u : units) {
      if (spare_items.size() == kSpareItems) break;
      spare_items.push_back(std::move(u.items));
    }
    units.clear();
  }
  // With mu held: tops up this thread's spare vectors.
  void take_spare_items() {
    while (t_spare_items.size() < kThreadSpareItems && !spare_items.empty()) {
      t_spare_items.push_back(std::move(spare_items.back()));
      spare_items.pop_back();
    }
  }

  // publish() for every unit of `units`, taking mu once; empties `units`.
  bool publish_all(std::vector<Unit>& units) {
    std::unique_lock<std::mutex> l = lock_spinning(mu);
    for (Unit& u : units) append_ready(std::move(u));
    units.clear();
    return published();
  }

  // With mu held: `u` joins the ready queue.
  void append_ready(Unit&& u) {
    ready_count += u.items.size();
    ready_tokens += u.tokens;
    ready.push_back(std::move(u));
  }
  // With mu held, after append_ready(): what a producer does once its units are ready; true if it
  // must notify data_cv.
  bool published() {
    ready_hint.store(ready_count, std::memory_order_relaxed);
    take_spare_items();
    return should_wake();
  }

  // With mu held: whether the caller, having made data, must notify data_cv.
  bool should_wake() {
    if (waiters_woken || ready_count < wake_at) return false;
    waiters_woken = true;
    return true;
  }

  // With mu held: a consumer waits until `min_count` trajectories are ready, or stops waiting.
  void start_waiting(std::size_t min_count) {
    waiters_woken = false;
    waiter_mins.push_back(min_count);
    wake_at = std::min(wake_at, min_count);
  }
  void stop_waiting(std::size_t min_count) {
    waiter_mins.erase(std::find(waiter_mins.begin(), waiter_mins.end(), min_count));
    wake_at = waiter_mins.empty() ? SIZE_MAX : *std::min_element(waiter_mins.begin(), waiter_mins.end());
  }

  // Retires units pop_batch dropped as stale (called with no lock held).
  void retire_stale(std::vector<Unit>& dropped) {
    std::unique_lock<std::mutex> wl;
    if (wal) {
      wl = lock_spinning(wmu);
      std::vector<std::uint64_t> ids;
      for (const Unit& u : dropped) {
        for (const Trajectory& t : u.items) ids.push_back(t.id.value());
      }
      note_bg(wal_retire(internal::WalRetireReason::kStale, ids));
    }
    for (const Unit& u : dropped) retire(u.items.begin(), u.items.end());
    dropped.clear();
  }

  // With mu held. Puts a batch's units back at the front of the ready queue, in their original
  // order. `move`: nobody else holds the items.
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

  // With mu held. Returns a leased batch to the ready queue (nack or expiry).
  void requeue(std::unordered_map<std::uint64_t, std::shared_ptr<internal::BatchData>>::iterator it, bool& data) {
    std::shared_ptr<internal::BatchData> d = std::move(it->second);
    leases.erase(it);
    const bool sole = d.use_count() == 1;  // the consumer let go: move instead of copy
    leased_trajectories -= d->items.size();
    redelivered += d->items.size();
    unpop(*d, sole, 0);
    if (should_wake()) data = true;
  }

  void remember_expired(std::uint64_t batch_id) {
    expired_batches.add(batch_id);
  }
  bool lease_expired(std::uint64_t batch_id) {
    return expired_batches.contains(batch_id);
  }

  // With mu held.
  void process_lease_timers(Clock::Duration now, bool& data) {
    while (!lease_deadlines.empty() && lease_deadlines.top().first <= now) {
      const auto [deadline, id] = lease_deadlines.top();
      lease_deadlines.pop();
      auto it = leases.find(id);
      if (it == leases.end() || it->second->deadline != deadline) continue;
      ++expired_leases;
      remember_expired(id);
      requeue(it, data);
    }
  }

  // With mu held: `d`, filled, is leased out until its deadline.
  void lease_out(const std::shared_ptr<internal::BatchData>& d) {
    leased_trajectories += d->items.size();
    delivered += d->items.size();
    for (const TrajectoryInfo& info : d->info) {
      ++staleness[std::min<std::uint64_t>(info.staleness, QueueStats::kStalenessBuckets - 1)];
    }
    if (d->deadline != Clock::kForever) lease_deadlines.emplace(d->deadline, d->id);
    leases.emplace(d->id, d);
    if (lease_deadlines.size() > 2 * leases.size() + kStaleTimers) prune_lease_timers();
  }

  // With mu held: keeps only the timers of batches still leased. Acked and nacked ones leave
  // theirs behind, which would otherwise pile up for a whole lease at the pop rate.
  void prune_lease_timers() {
    std::vector<Deadline> live;
    live.reserve(leases.size());
    for (const auto& [id, d] : leases) {
      if (d->deadline != Clock::kForever) live.emplace_back(d->deadline, id);
    }
    lease_deadlines = decltype(lease_deadlines)(std::greater<>(), std::move(live));
  }

  // With mu held.
  Clock::Duration next_consumer_timer() const {
    Clock::Duration t = next_group_deadline();
    if (!lease_deadlines.empty()) t = std::min(t, lease_deadlines.top().first);
    return t;
  }

  // Every lock but wmu (which the caller holds, or needs not), in order.
  struct AllLocks {
    std::vector<ShardLock> shards;
    std::unique_lock<std::mutex> consumers;
    explicit AllLocks(Impl& q) {
      shards.reserve(kGroupShards + kIdShards);
      for (GroupShard& gs : q.group_shards) shards.emplace_back(gs.mu);
      for (IdShard& s : q.id_shards) shards.emplace_back(s.mu);
      consumers = std::unique_lock<std::mutex>(q.mu);
    }
  };

  // With wmu held and no other lock.
  Status maybe_compact() {
    if (!wal || wal->bytes() < opt.wal_compact_bytes || wal_live_bytes * 2 > wal->bytes()) {
      return ok_status();
    }
    flush_retirements();
    AllLocks all(*this);
    Status s = wal->rewrite([this](internal::TrajectoryWal& w) -> Status {
      std::uint64_t v = newest.load();
      LAMINAR_RETURN_IF_ERROR(
          w.append(internal::WalRecordType::kVersion, std::string_view(reinterpret_cast<const char*>(&v), 8)));
      // The dedup windows survive a restart too, oldest first.
      std::string buf;
      {
        ShardLock l = lock_spinning(retire_mu);
        const std::uint64_t head = std::uint64_t(internal::WalRetireReason::kWindow);
        const std::uint64_t n = retired_ring.size();
        buf.append(reinterpret_cast<const char*>(&head), 8);
        buf.append(reinterpret_cast<const char*>(&n), 8);
        retired_ring.for_each([&](std::uint64_t id) { buf.append(reinterpret_cast<const char*>(&id), 8); });
      }
      LAMINAR_RETURN_IF_ERROR(w.append(internal::WalRecordType::kRetire, buf));
      std::vector<std::uint64_t> closed;
      {
        ShardLock l = lock_spinning(closed_mu);
        closed_groups.for_each([&](std::uint64_t gid) { closed.push_back(gid); });
      }
      for (const std::uint64_t& gid : closed) {
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
      for (GroupShard& gs : group_shards) {
        for (const auto& [gid, g] : gs.groups) {
          for (const Trajectory& t : g.unit.items) LAMINAR_RETURN_IF_ERROR(put(t));
        }
      }
      return ok_status();
    });
    if (s.ok()) ++compactions;
    return s;
  }
  std::uint64_t compactions = 0;  // under wmu

  Status replay(const std::string& path);
};

// ---------------------------------------------------------------------------------------------

Status TrajectoryQueue::Impl::replay(const std::string& path) {
  // Live trajectories in log order (tombstoned when retired), then rebuilt into groups and units.
  std::vector<std::optional<Trajectory>> order;
  std::unordered_map<std::uint64_t, std::size_t> index;
  std::unordered_set<std::uint64_t> closed_in_log;
  std::uint64_t retired = 0;
  std::uint64_t max_version = newest.load();

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
          if (!id_shard(id).ids.retired(id)) {
            ShardLock l = lock_spinning(retire_mu);
            enter_window(id);
          }
          auto it = index.find(id);
          if (it != index.end()) {
            order[it->second].reset();
            index.erase(it);
            ++retired;
          }
        }
        flush_retirements();
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
          if (!group_closed(v)) close_group_id(v);
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
  newest.store(max_version);

  const Clock::Duration now = clock->now();
  std::vector<std::uint64_t> group_order;
  for (std::optional<Trajectory>& slot : order) {
    if (!slot) continue;
    Trajectory t = std::move(*slot);
    ++recovery.recovered;
    IdShard& is = id_shard(t.id.value());
    // A live id the log also lists as retired stays refused either way.
    is.ids.set_live(t.id.value());
    ++is.pushed;
    held += held_word(1, t.num_tokens());
    wal_live_bytes += wal_record_bytes(t);
    if (t.group_size == 1) {
      publish(Unit::lone(std::move(t)));
      continue;
    }
    GroupShard& gs = group_shard(t.group_id);
    auto [it, fresh] = gs.groups.try_emplace(t.group_id);
    PendingGroup& g = it->second;
    if (fresh) {
      g.open(t, now);
      group_order.push_back(t.group_id);
    }
    if (t.group_size != g.group_size || t.sample_index >= g.group_size || g.seen.test(t.sample_index)) {
      return data_loss(fmt::format("WAL {}: trajectory {} does not fit its group {}", path, t.id.value(),
                                   t.group_id));
    }
    g.seen.set(t.sample_index);
    g.unit.add(std::move(t));
    ++gs.pending_trajectories;
  }
  for (std::uint64_t gid : group_order) {
    GroupShard& gs = group_shard(gid);
    auto it = gs.groups.find(gid);
    PendingGroup& g = it->second;
    const bool complete = g.unit.items.size() == g.group_size;
    if (complete || closed_in_log.count(gid) != 0) {
      if (!group_closed(gid)) close_group_id(gid);
      publish(take_group(gs, g, /*partial=*/!complete));
      gs.groups.erase(it);
    } else if (opt.group_timeout != Clock::kForever) {
      // The timer restarts: how long the group waited before the restart is not in the log.
      gs.deadlines.emplace_back(now + opt.group_timeout, gid);
    }
  }
  for (GroupShard& gs : group_shards) gs.set_deadline_hint();
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
  if (options.capacity_trajectories > kMaxCapacityTrajectories || options.capacity_tokens > kMaxCapacityTokens) {
    return invalid_argument(fmt::format(
        "QueueOptions: capacity of {} trajectories and {} tokens is above the limit of {} and {}",
        options.capacity_trajectories, options.capacity_tokens, kMaxCapacityTrajectories, kMaxCapacityTokens));
  }
  if (options.default_lease <= Clock::Duration::zero()) {
    return invalid_argument(
        fmt::format("QueueOptions: default_lease {} ns is not positive", options.default_lease.count()));
  }
  if (options.group_timeout <= Clock::Duration::zero()) {
    return invalid_argument(
        fmt::format("QueueOptions: group_timeout {} ns is not positive", options.group_timeout.count()));
  }
  if (options.id_dedup_window == 0 || options.id_dedup_window > kMaxWindow) {
    return invalid_argument(fmt::format("QueueOptions: id_dedup_window {} is not in [1, {}]",
                                        options.id_dedup_window, kMaxWindow));
  }
  auto impl = std::make_unique<Impl>(std::move(options));
  if (const std::size_t refill = std::min(impl->opt.capacity_trajectories / kCreditShare, kCreditRefillTrajectories);
      refill >= 4) {
    impl->refill_count = refill;
    impl->refill_tokens = impl->opt.capacity_tokens / kCreditShare;
  }
  impl->newest.store(impl->opt.initial_version.value());
  if (!impl->opt.wal_path.empty()) {
    LAMINAR_RETURN_IF_ERROR(impl->replay(impl->opt.wal_path));
  }
  Impl* raw = impl.get();
  impl->clock_sub = impl->clock->subscribe([raw] {
    {
      std::lock_guard<std::mutex> l(raw->space_mu);
      raw->space_cv.notify_all();
    }
    std::lock_guard<std::mutex> l(raw->mu);
    raw->data_cv.notify_all();
  });
  return std::unique_ptr<TrajectoryQueue>(new TrajectoryQueue(std::move(impl)));
}

Status TrajectoryQueue::publish_version(Version v) {
  Impl& q = *impl_;
  std::lock_guard<std::mutex> wl(q.wmu);
  const Version newest(q.newest.load());
  if (v < newest) {
    return invalid_argument(fmt::format("publish_version: version {} is older than the newest published {}",
                                        v.value(), newest.value()));
  }
  if (v == newest) return ok_status();
  LAMINAR_RETURN_IF_ERROR(q.wal_u64(internal::WalRecordType::kVersion, v.value()));
  q.newest.store(v.value(), std::memory_order_release);
  return ok_status();
}

Version TrajectoryQueue::newest_version() const noexcept {
  return Version(impl_->newest.load(std::memory_order_acquire));
}

Status TrajectoryQueue::push(Trajectory&& t, PushOptions options) {
  Impl& q = *impl_;
  const std::uint64_t id = t.id.value();
  IdShard& is = q.id_shard(id);
  // The id's slot is a cache miss; loaded now, it overlaps the checks below instead of stalling
  // under the shard's lock.
  is.ids.prefetch(id);
  if (Status valid = validate_trajectory(t, q.opt.validate_contents); !valid.ok()) {
    q.rejected_invalid.fetch_add(1, std::memory_order_relaxed);
    return valid;
  }
  if (options.mode == PushMode::kTimeout && options.timeout < Clock::Duration::zero()) {
    return invalid_argument(fmt::format("push: negative timeout {} ns", options.timeout.count()));
  }
  const std::size_t tokens = t.num_tokens();
  // With a WAL, the record is encoded and checksummed before wmu is taken (the costly part of
  // logging, after the write itself), into this thread's buffer: reaching a thread_local from a
  // shared library is a call, which a push without a WAL does not make.
  std::string* encoded = nullptr;
  std::uint64_t checksum = 0;
  std::unique_lock<std::mutex> wl;
  if (q.wal) {
    thread_local std::string buf;
    encoded = &buf;
    encoded->clear();
    encode_trajectory(t, *encoded);
    checksum = internal::TrajectoryWal::checksum(internal::WalRecordType::kPush, *encoded);
    wl = lock_spinning(q.wmu);
  }

  if (q.closed.load()) {
    q.rejected_full.fetch_add(1, std::memory_order_relaxed);
    return cancelled(fmt::format("push of trajectory {}: the queue is closed", id));
  }
  LAMINAR_RETURN_IF_ERROR(q.check_fits(t));
  // Only groups (their timeouts) and waiting for room need the time, read when first needed: a
  // clock read is a good part of a push.
  const bool grouped = t.group_size > 1;
  Clock::Duration now{0};
  bool have_now = false;
  auto read_now = [&] {
    now = q.clock->now();
    have_now = true;
  };
  // Room is taken first when there is some, which also gives the id's slot, prefetched above,
  // time to arrive.
  const bool have_room = q.try_reserve(1, tokens);
  // Then the id: from here a second push of it is refused, whatever becomes of this one.
  {
    ShardLock il = lock_spinning(is.mu);
    if (!q.admit_id(is, il, id)) {
      il.unlock();
      if (have_room) q.release_space(1, tokens);
      return invalid_argument(fmt::format("trajectory {}: id already pushed", id));
    }
  }
  GroupShard* gs = grouped ? &q.group_shard(t.group_id) : nullptr;

  if (!have_room) {
    read_now();
    const Clock::Duration deadline = options.mode != PushMode::kTimeout ? Clock::kForever
                                     : options.timeout >= Clock::kForever - now ? Clock::kForever
                                                                                : now + options.timeout;
    auto fail_full = [&](Status s) {
      q.rejected_full.fetch_add(1, std::memory_order_relaxed);
      q.unreserve(id);
      return s;
    };
    for (;;) {
      if (q.closed.load()) return fail_full(cancelled(fmt::format("push of trajectory {}: the queue is closed", id)));
      q.run_group_timers_if_due(now, /*wal_held=*/true);
      if (gs != nullptr) {
        // A member its group would refuse is refused now, not after waiting for space.
        ShardLock gl = lock_spinning(gs->mu);
        if (Status s = q.refuse_member(*gs, t, gs->groups.find(t.group_id)); !s.ok()) {
          gl.unlock();
          q.unreserve(id);
          return s;
        }
      }
      if (q.try_reserve(1, tokens)) break;
      if (options.mode == PushMode::kFailFast) {
        return fail_full(unavailable(fmt::format(
            "push of trajectory {}: queue full ({} of {} trajectories, {} of {} tokens)", id, Impl::count_of(q.in_use()),
            q.opt.capacity_trajectories, Impl::tokens_of(q.in_use()), q.opt.capacity_tokens)));
      }
      if (now >= deadline) {
        return fail_full(deadline_exceeded(
            fmt::format("push of trajectory {}: queue still full after {} ns", id, options.timeout.count())));
      }
      // wmu is let go while waiting: the acks that free space take it.
      if (wl.owns_lock()) wl.unlock();
      {
        std::unique_lock<std::mutex> sl(q.space_mu);
        q.space_waiters.fetch_add(1);
        if (!q.fits(tokens) && !q.closed.load()) {
          q.clock->wait_until(q.space_cv, sl, std::min(deadline, q.next_group_deadline()));
        }
        q.space_waiters.fetch_sub(1);
      }
      if (q.wal) wl = lock_spinning(q.wmu);
      now = q.clock->now();
    }
  }
  // Room and id are this push's; a refusal from here gives both back.
  auto undo = [&](Status s) {
    q.release_space(1, tokens);
    q.unreserve(id);
    return s;
  };
  bool data = false;
  Unit done;  // a unit this push completed
  bool complete = false;
  {
    ShardLock gl;
    std::unordered_map<std::uint64_t, PendingGroup>::iterator group;  // with gs only
    if (gs != nullptr) {
      gl = lock_spinning(gs->mu);
      // The exact time only when a timeout of the shard may be due, or for a member that opens or
      // completes its group (its arrival and wait times); the coarse one tells the rest apart.
      if (!have_now && gs->next_deadline.load(std::memory_order_relaxed) <=
                           (q.clock->coarse_now() + q.clock->coarse_slack()).count()) {
        read_now();
      }
      if (have_now) q.process_group_timers(*gs, now, data);
      group = gs->groups.find(t.group_id);
      if (Status s = q.refuse_member(*gs, t, group); !s.ok()) {
        gl.unlock();
        if (data) q.data_cv.notify_all();
        return undo(std::move(s));
      }
      if (!have_now && (group == gs->groups.end() || group->second.unit.items.size() + 1 == group->second.group_size)) {
        read_now();
      }
    }
    if (q.wal) {
      if (Status s = q.wal->append(internal::WalRecordType::kPush, *encoded, checksum); !s.ok()) {
        if (gl.owns_lock()) gl.unlock();
        if (data) q.data_cv.notify_all();
        return undo(std::move(s));
      }
      q.wal_live_bytes += wal_record_bytes(t);
    }
    if (gs == nullptr) {
      done = Unit::lone(std::move(t));
      complete = true;
    } else {
      complete = q.add_member(*gs, group, std::move(t), now, done);
    }
    // Without a WAL the unit goes to the consumers after the group shard is let go; with one,
    // before wmu is: a compaction (under wmu) must find every live trajectory.
    if (complete && q.wal) data |= q.publish(std::move(done));
  }
  if (complete && !q.wal) data |= q.publish(std::move(done));
  if (wl.owns_lock()) wl.unlock();
  if (data) q.data_cv.notify_all();
  return ok_status();
}

std::vector<Status> TrajectoryQueue::push_many(std::span<Trajectory> ts, PushOptions options) {
  Impl& q = *impl_;
  // Longer spans go in chunks: sharing the locks gains nothing beyond a few groups, and the
  // per-thread scratch below stays small.
  constexpr std::size_t kChunk = 1024;
  if (ts.size() > kChunk) {
    std::vector<Status> out;
    out.reserve(ts.size());
    for (std::size_t at = 0; at < ts.size(); at += kChunk) {
      std::vector<Status> part = push_many(ts.subspan(at, std::min(kChunk, ts.size() - at)), options);
      std::move(part.begin(), part.end(), std::back_inserter(out));
    }
    return out;
  }
  std::vector<Status> out(ts.size());
  auto one_by_one = [&](std::span<const std::uint32_t> which) {
    for (std::uint32_t i : which) out[i] = push(std::move(ts[i]), options);
  };
  thread_local std::vector<std::uint32_t> in;  // indices of the trajectories still going in
  in.clear();
  for (std::uint32_t i = 0; i < ts.size(); ++i) in.push_back(i);
  if (ts.size() < 2) {
    one_by_one(in);
    return out;
  }
  if (options.mode == PushMode::kTimeout && options.timeout < Clock::Duration::zero()) {
    for (Status& s : out) s = invalid_argument(fmt::format("push: negative timeout {} ns", options.timeout.count()));
    return out;
  }
  std::size_t tokens = 0;
  std::size_t n = 0;
  for (std::uint32_t i : in) {
    const Trajectory& t = ts[i];
    q.id_shard(t.id.value()).ids.prefetch(t.id.value());
    if (Status valid = validate_trajectory(t, q.opt.validate_contents); !valid.ok()) {
      q.rejected_invalid.fetch_add(1, std::memory_order_relaxed);
      out[i] = std::move(valid);
      continue;
    }
    if (q.closed.load()) {
      q.rejected_full.fetch_add(1, std::memory_order_relaxed);
      out[i] = cancelled(fmt::format("push of trajectory {}: the queue is closed", t.id.value()));
      continue;
    }
    if (Status s = q.check_fits(t); !s.ok()) {
      out[i] = std::move(s);
      continue;
    }
    tokens += t.num_tokens();
    in[n++] = i;
  }
  in.resize(n);
  if (in.empty()) return out;
  // With a log, each trajectory's record, encoded and checksummed before wmu is taken; they go in
  // together, with one fdatasync for all (wal_fsync) where push() syncs each.
  // All of them in one buffer: trajectory i's record is encoded[at[i], at[i + 1]).
  thread_local std::string encoded;
  thread_local std::vector<std::size_t> at;
  thread_local std::vector<std::uint64_t> checksums;
  thread_local std::vector<internal::TrajectoryWal::Record> records;
  auto record_of = [&](std::uint32_t i) { return std::string_view(encoded).substr(at[i], at[i + 1] - at[i]); };
  // A call of many long trajectories would otherwise leave its thread holding their bytes.
  auto free_if_big = [&] {
    if (encoded.capacity() > kKeptEncodedBytes) std::string().swap(encoded);
  };
  std::unique_lock<std::mutex> wl;
  if (q.wal) {
    encoded.clear();
    at.assign(ts.size() + 1, 0);
    checksums.resize(ts.size());
    std::size_t k = 0;  // `in` is in order
    for (std::uint32_t i = 0; i < ts.size(); ++i) {
      if (k < in.size() && in[k] == i) {
        encode_trajectory(ts[i], encoded);
        ++k;
      }
      at[i + 1] = encoded.size();
    }
    for (std::uint32_t i : in) {
      checksums[i] = internal::TrajectoryWal::checksum(internal::WalRecordType::kPush, record_of(i));
    }
    wl = lock_spinning(q.wmu);
  }
  // Room for all at once, or each waits for (or fails to find) its own as push() does.
  if (!q.try_reserve(in.size(), tokens)) {
    if (wl.owns_lock()) wl.unlock();
    free_if_big();
    one_by_one(in);
    return out;
  }
  std::size_t refused = 0, refused_tokens = 0;
  auto refuse = [&](std::uint32_t i, Status s) {
    out[i] = std::move(s);
    ++refused;
    refused_tokens += ts[i].num_tokens();
  };
  // Ids, each shard locked once for a run of trajectories in it.
  q.in_id_runs(in, [&](std::uint32_t i) { return ts[i].id.value(); },
               [&](IdShard& is, ShardLock& il, std::uint32_t i) {
                 const std::uint64_t id = ts[i].id.value();
                 if (!q.admit_id(is, il, id)) refuse(i, invalid_argument(fmt::format("trajectory {}: id already pushed", id)));
               });
  // Refused ones have their Status; the others are still OK.
  auto drop_refused = [&] { std::erase_if(in, [&](std::uint32_t i) { return !out[i].ok(); }); };
  drop_refused();
  // Then the groups, each shard locked once for a run of members in it: f(shard, i) for each
  // trajectory, in order, with a null shard for an ungrouped one.
  const bool grouped = std::any_of(in.begin(), in.end(), [&](std::uint32_t i) { return ts[i].group_size > 1; });
  const Clock::Duration now = grouped ? q.clock->now() : Clock::Duration(0);
  bool data = false;
  auto in_group_runs = [&](auto f) {
    GroupShard* locked = nullptr;
    ShardLock gl;
    for (std::uint32_t i : in) {
      if (ts[i].group_size == 1) {
        f(nullptr, i);
        continue;
      }
      GroupShard& gs = q.group_shard(ts[i].group_id);
      if (&gs != locked) {
        if (gl.owns_lock()) gl.unlock();
        gl = lock_spinning(gs.mu);
        locked = &gs;
        q.process_group_timers(gs, now, data);
      }
      f(&gs, i);
    }
  };
  auto refuse_member = [&](std::uint32_t i, Status s) {
    q.unreserve(ts[i].id.value());
    refuse(i, std::move(s));
  };
  thread_local std::vector<Unit> done;
  done.clear();
  if (q.wal) {
    // Checked first, against the groups as they will be after this call's earlier members (the
    // groups cannot change meanwhile: every other change to them takes wmu), so that the log
    // gets only the members that will go in.
    struct SoFar {
      std::uint32_t group_size;
      std::uint64_t prompt_id;
      SampleSet seen;
      std::size_t count;
    };
    thread_local std::unordered_map<std::uint64_t, SoFar> so_far;
    so_far.clear();
    in_group_runs([&](GroupShard* shard, std::uint32_t i) {
      if (shard == nullptr) return;
      GroupShard& gs = *shard;
      const Trajectory& t = ts[i];
      Status s;
      auto it = so_far.find(t.group_id);
      if (it == so_far.end()) {
        auto group = gs.groups.find(t.group_id);
        s = q.refuse_member(gs, t, group);
        if (s.ok()) {
          it = so_far.emplace(t.group_id, group == gs.groups.end()
                                              ? SoFar{t.group_size, t.prompt_id, SampleSet(t.group_size), 0}
                                              : SoFar{group->second.group_size, group->second.prompt_id,
                                                      group->second.seen, group->second.unit.items.size()})
                   .first;
        }
      } else if (it->second.count == it->second.group_size) {
        s = q.refuse_closed(gs, t);
      } else {
        s = q.refuse_joining(t, it->second.group_size, it->second.prompt_id, it->second.seen);
      }
      if (!s.ok()) return refuse_member(i, std::move(s));
      it->second.seen.set(t.sample_index);
      ++it->second.count;
    });
    drop_refused();
    records.clear();
    std::size_t bytes = 0;
    for (std::uint32_t i : in) {
      records.push_back({internal::WalRecordType::kPush, record_of(i), checksums[i]});
      bytes += wal_record_bytes(ts[i]);
    }
    Status appended = q.wal->append_all(records);
    free_if_big();
    if (appended.ok()) {
      q.wal_live_bytes += bytes;
    } else {
      for (std::uint32_t i : in) {
        q.unreserve(ts[i].id.value());
        refuse(i, appended);
      }
      in.clear();
    }
  }
  in_group_runs([&](GroupShard* gs, std::uint32_t i) {
    Trajectory& t = ts[i];
    if (gs == nullptr) return done.push_back(Unit::lone(std::move(t)));
    auto group = gs->groups.find(t.group_id);
    if (!q.wal) {
      if (Status s = q.refuse_member(*gs, t, group); !s.ok()) return refuse_member(i, std::move(s));
    }
    Unit u;
    if (q.add_member(*gs, group, std::move(t), now, u)) done.push_back(std::move(u));
  });
  if (refused > 0) q.release_space(refused, refused_tokens);
  // With a log, before wmu is let go: a compaction must find every live trajectory.
  if (!done.empty()) data |= q.publish_all(done);
  if (wl.owns_lock()) wl.unlock();
  if (data) q.data_cv.notify_all();
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
  if (spec.wait < Clock::Duration::zero() || spec.lease < Clock::Duration::zero()) {
    return invalid_argument(fmt::format("BatchSpec: negative wait ({} ns) or lease ({} ns)", spec.wait.count(),
                                        spec.lease.count()));
  }
  if (const std::uint64_t newest = q.newest.load(std::memory_order_acquire); spec.consumer_version.value() > newest) {
    return invalid_argument(fmt::format("BatchSpec: consumer_version {} is ahead of the newest published {}",
                                        spec.consumer_version.value(), newest));
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
  bool data = false;
  std::unique_lock<std::mutex> l = lock_spinning(q.mu);
  // Every exit wakes whoever expired leases made data for.
  auto leave = [&](auto result) {
    l.unlock();
    if (data) q.data_cv.notify_all();
    return result;
  };
  const Clock::Duration deadline = spec.wait >= Clock::kForever - start ? Clock::kForever : start + spec.wait;
  auto d = std::make_shared<internal::BatchData>();
  // Reused across calls: a fresh vector would grow through several allocations every pop.
  thread_local std::vector<Unit> taken;
  std::vector<Unit> dropped;
  Clock::Duration now = start;
  for (;;) {
    if (q.closed.load()) return leave(Result<Batch>(cancelled("pop_batch: the queue is closed")));
    q.process_lease_timers(now, data);
    if (q.ready_count >= min_count) {
      std::size_t count = 0;
      std::size_t tokens = 0;
      bool full = false;
      taken.clear();
      while (!q.ready.empty()) {
        Unit& u = q.ready.front();
        const std::size_t len = u.items.size();
        const std::uint64_t unit_staleness = consumer_version > u.min_version ? consumer_version - u.min_version : 0;
        if (drop_stale && unit_staleness > spec.max_staleness) {
          // A group is judged by its stalest member and dropped whole: a partial GRPO group
          // would bias the advantage baseline.
          q.ready_count -= len;
          q.ready_tokens -= u.tokens;
          q.dropped_stale += len;
          dropped.push_back(q.ready.pop_front());
          continue;
        }
        if (count > 0 && (count + len > max_count || tokens + u.tokens > max_tokens)) {
          full = true;
          break;
        }
        count += len;
        tokens += u.tokens;
        q.ready_count -= len;
        q.ready_tokens -= u.tokens;
        taken.push_back(q.ready.pop_front());
        if (count >= max_count || tokens >= max_tokens) {
          full = true;
          break;
        }
      }
      if (count >= min_count || (full && count > 0)) {
        q.ready_hint.store(q.ready_count, std::memory_order_relaxed);
        d->id = q.next_batch_id++;
        d->tokens = tokens;
        d->deadline = lease >= Clock::kForever - now ? Clock::kForever : now + lease;
        // Without a WAL the trajectories move into the batch with mu let go, so producers
        // handing over units need not wait for it; with one, under mu: a compaction must find
        // every live trajectory.
        if (!q.wal) l.unlock();
        fill_batch(*d, taken, consumer_version, mark_stale, spec.max_staleness);
        if (!q.wal) l.lock();
        q.keep_spare_items(taken);
        q.lease_out(d);
        l.unlock();
        if (data) q.data_cv.notify_all();
        if (!dropped.empty()) q.retire_stale(dropped);
        return Batch(std::move(d));
      }
      // Too few left after dropping stale ones: put back what was taken and wait for more.
      for (auto it = taken.rbegin(); it != taken.rend(); ++it) {
        q.ready_count += it->items.size();
        q.ready_tokens += it->tokens;
        q.ready.push_front(std::move(*it));
      }
      q.ready_hint.store(q.ready_count, std::memory_order_relaxed);
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
    if (data) q.data_cv.notify_all();
    data = false;
    for (int i = 0; i < kSpinRounds && !arrived; ++i) {
      std::this_thread::yield();
      arrived = q.ready_hint.load(std::memory_order_relaxed) >= min_count;
    }
    l.lock();
    if (q.ready_count < min_count && !q.closed.load()) {
      q.start_waiting(min_count);
      q.clock->wait_until(q.data_cv, l, std::min(deadline, q.next_consumer_timer()));
      q.stop_waiting(min_count);
    }
    now = q.clock->now();
    if (q.next_group_deadline() <= now) {
      l.unlock();
      q.run_group_timers_if_due(now);
      l.lock();
    }
  }
}

Status TrajectoryQueue::ack(std::uint64_t batch_id) {
  Impl& q = *impl_;
  bool data = false;
  // With a WAL, wmu is held throughout, so the ack record, the retired ids and a compaction see
  // one state.
  std::unique_lock<std::mutex> wl;
  if (q.wal) wl = lock_spinning(q.wmu);
  std::unique_lock<std::mutex> l = lock_spinning(q.mu);
  q.process_lease_timers(q.clock->now(), data);
  auto leave = [&](Status s) {
    if (l.owns_lock()) l.unlock();
    if (wl.owns_lock()) wl.unlock();
    if (data) q.data_cv.notify_all();
    return s;
  };
  auto it = q.leases.find(batch_id);
  if (it == q.leases.end()) {
    if (q.lease_expired(batch_id)) {
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
  q.acked += d->items.size();
  q.leases.erase(it);
  // Gone from the leases, so no one else reaches these trajectories: retiring them can wait for
  // the id shards without holding up the consumers.
  l.unlock();
  q.retire(d->items.begin(), d->items.end());
  if (q.wal) q.note_bg(q.maybe_compact());
  return leave(ok_status());
}

Status TrajectoryQueue::nack(std::uint64_t batch_id) {
  Impl& q = *impl_;
  bool data = false;
  std::unique_lock<std::mutex> l = lock_spinning(q.mu);
  q.process_lease_timers(q.clock->now(), data);
  auto leave = [&](Status s) {
    l.unlock();
    if (data) q.data_cv.notify_all();
    return s;
  };
  auto it = q.leases.find(batch_id);
  if (it == q.leases.end()) {
    if (q.lease_expired(batch_id)) {
      return leave(aborted(
          fmt::format("nack: the lease of batch {} expired; its trajectories were requeued", batch_id)));
    }
    return leave(not_found(fmt::format("nack: batch {} is not leased (unknown or already acked)", batch_id)));
  }
  ++q.nacked_batches;
  q.requeue(it, data);
  return leave(ok_status());
}

void TrajectoryQueue::close() {
  Impl& q = *impl_;
  q.closed.store(true);
  { std::lock_guard<std::mutex> sl(q.space_mu); }
  q.space_cv.notify_all();
  { std::lock_guard<std::mutex> l(q.mu); }
  q.data_cv.notify_all();
}

QueueStats TrajectoryQueue::stats() const {
  Impl& q = *impl_;
  std::lock_guard<std::mutex> wl(q.wmu);
  Impl::AllLocks all(q);
  QueueStats s;
  for (const IdShard& is : q.id_shards) s.pushed += is.pushed;
  for (const GroupShard& gs : q.group_shards) {
    s.pending_groups += gs.groups.size();
    s.pending_group_trajectories += gs.pending_trajectories;
    s.dropped_group_timeout += gs.dropped_group_timeout;
    s.dropped_late_for_group += gs.dropped_late_for_group;
    const WaitHistogram& h = gs.group_wait;
    s.group_wait.count += h.count;
    s.group_wait.sum_ms += h.sum_ms;
    s.group_wait.max_ms = std::max(s.group_wait.max_ms, h.max_ms);
    for (int b = 0; b < WaitHistogram::kBuckets; ++b) s.group_wait.buckets[b] += h.buckets[b];
  }
  s.ready = q.ready_count;
  s.ready_tokens = q.ready_tokens;
  s.leases = q.leases.size();
  s.leased_trajectories = q.leased_trajectories;
  s.held_tokens = Impl::tokens_of(q.in_use());
  s.blocked_producers = std::size_t(q.space_waiters.load());
  s.blocked_consumers = q.waiter_mins.size();
  s.newest_version = Version(q.newest.load());
  s.delivered = q.delivered;
  s.acked = q.acked;
  s.nacked_batches = q.nacked_batches;
  s.expired_leases = q.expired_leases;
  s.redelivered = q.redelivered;
  s.rejected_invalid = q.rejected_invalid.load();
  s.rejected_full = q.rejected_full.load();
  s.dropped_stale = q.dropped_stale;
  std::copy(std::begin(q.staleness), std::end(q.staleness), s.staleness);
  s.wal = q.wal != nullptr;
  if (q.wal) {
    s.wal_bytes = q.wal->bytes();
    s.wal_records = q.wal->records();
    s.wal_compactions = q.compactions;
  }
  return s;
}

const RecoveryReport& TrajectoryQueue::recovery() const noexcept { return impl_->recovery; }

Status TrajectoryQueue::background_error() const {
  std::lock_guard<std::mutex> l(impl_->bg_mu);
  return impl_->bg_error;
}

}  // namespace laminar
