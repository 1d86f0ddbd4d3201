#include "laminar/repack_policy.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <span>

namespace laminar {

std::string_view repack_strategy_name(RepackStrategy s) noexcept {
  switch (s) {
    case RepackStrategy::kPaperBestFit: return "paper_best_fit";
    case RepackStrategy::kCostAware: return "cost_aware";
  }
  return "?";
}

namespace {

constexpr std::int64_t kMaxCount = std::int64_t(1) << 40;
constexpr std::int32_t kMaxSlots = std::int32_t(1) << 20;
// Destinations a cost-aware placement looks at past the densest ones that fail its tail check;
// keeps a plan's time bounded when most destinations are too slow for a long sequence.
constexpr int kMaxProbes = 64;

double seconds(Duration d) { return std::chrono::duration<double>(d).count(); }

Duration to_duration(double s) {
  constexpr double kMax = double(std::numeric_limits<Duration::rep>::max()) / 1e9;
  if (!(s < kMax)) return Duration::max();
  if (!(s > -kMax)) return Duration::min();
  return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(s));
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Duplicate detection over ids, run on every plan: a bitmap when the ids are dense (counters, the
// usual case), else a flat open-addressing table. A node-based set over tens of thousands of
// sequences would cost more than the plan itself.
class IdSet {
 public:
  // For n ids, all within [lo, hi].
  IdSet(std::size_t n, std::uint64_t lo, std::uint64_t hi) : lo_(lo) {
    if (hi - lo < 16 * std::uint64_t(n) + 64) {
      bits_.assign(std::size_t((hi - lo) / 64) + 1, 0);
      return;
    }
    const std::size_t cap = std::bit_ceil(std::max<std::size_t>(16, 2 * n));
    keys_.resize(cap);
    used_.assign(cap, 0);
    mask_ = cap - 1;
  }

  // False when id was there already.
  bool insert(std::uint64_t id) {
    if (!bits_.empty()) {
      std::uint64_t& word = bits_[std::size_t((id - lo_) / 64)];
      const std::uint64_t bit = std::uint64_t(1) << ((id - lo_) % 64);
      if (word & bit) return false;
      word |= bit;
      return true;
    }
    std::uint64_t h = id;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    for (std::size_t i = h & mask_;; i = (i + 1) & mask_) {
      if (!used_[i]) {
        used_[i] = 1;
        keys_[i] = id;
        return true;
      }
      if (keys_[i] == id) return false;
    }
  }

 private:
  std::uint64_t lo_ = 0;
  std::vector<std::uint64_t> bits_;
  std::vector<std::uint64_t> keys_;
  std::vector<std::uint8_t> used_;
  std::size_t mask_ = 0;
};

Status validate_options(const RepackPolicyOptions& o) {
  if (o.strategy != RepackStrategy::kPaperBestFit && o.strategy != RepackStrategy::kCostAware) {
    return invalid_argument(fmt::format("repack options: unknown strategy {}", int(o.strategy)));
  }
  if (o.growth_horizon_steps < 0 || o.growth_horizon_steps > kMaxCount) {
    return invalid_argument(
        fmt::format("repack options: growth_horizon_steps is {}, not in [0, 2^40]", o.growth_horizon_steps));
  }
  if (o.page_bytes > std::uint64_t(kMaxCount)) {
    return invalid_argument(fmt::format("repack options: page_bytes is {}, above 2^40", o.page_bytes));
  }
  if (!(o.link_bytes_per_s > 0) || !std::isfinite(o.link_bytes_per_s)) {
    return invalid_argument(
        fmt::format("repack options: link_bytes_per_s is {}, not positive and finite", o.link_bytes_per_s));
  }
  if (o.move_overhead < Duration::zero()) {
    return invalid_argument(
        fmt::format("repack options: move_overhead is {} ns, negative", o.move_overhead.count()));
  }
  if (o.step_seconds_per_token && (!(*o.step_seconds_per_token >= 0) || !std::isfinite(*o.step_seconds_per_token))) {
    return invalid_argument(fmt::format("repack options: step_seconds_per_token is {}, not >= 0 and finite",
                                        *o.step_seconds_per_token));
  }
  if (!(o.max_tail_growth >= 0)) {
    return invalid_argument(fmt::format("repack options: max_tail_growth is {}, not >= 0", o.max_tail_growth));
  }
  if (!(o.max_step_slowdown >= 0)) {
    return invalid_argument(fmt::format("repack options: max_step_slowdown is {}, not >= 0", o.max_step_slowdown));
  }
  if (!(o.default_remaining_ratio >= 0) || !std::isfinite(o.default_remaining_ratio)) {
    return invalid_argument(fmt::format("repack options: default_remaining_ratio is {}, not >= 0 and finite",
                                        o.default_remaining_ratio));
  }
  return ok_status();
}

Status validate_worker(const WorkerSnapshot& w, std::int32_t tokens_per_page, Version newest, IdSet& sequence_ids) {
  const auto id = w.id.value();
  if (w.version > newest) {
    return invalid_argument(fmt::format("worker {}: version {} is newer than the newest published version {}", id,
                                        w.version.value(), newest.value()));
  }
  if (w.pages_total <= 0 || w.pages_total > kMaxCount) {
    return invalid_argument(fmt::format("worker {}: pages_total is {}, not in (0, 2^40]", id, w.pages_total));
  }
  if (w.pages_used < 0 || w.pages_used > w.pages_total) {
    return invalid_argument(
        fmt::format("worker {}: pages_used is {}, not in [0, pages_total = {}]", id, w.pages_used, w.pages_total));
  }
  if (w.slots_total <= 0 || w.slots_total > kMaxSlots) {
    return invalid_argument(fmt::format("worker {}: slots_total is {}, not in (0, 2^20]", id, w.slots_total));
  }
  if (w.slots_used < 0 || w.slots_used > w.slots_total) {
    return invalid_argument(
        fmt::format("worker {}: slots_used is {}, not in [0, slots_total = {}]", id, w.slots_used, w.slots_total));
  }
  if (w.sequences.size() > std::size_t(w.slots_used)) {
    return invalid_argument(fmt::format("worker {}: {} sequences listed but slots_used is {}", id,
                                        w.sequences.size(), w.slots_used));
  }
  if (w.step_time < Duration::zero() || (w.step_time == Duration::zero() && !w.sequences.empty())) {
    return invalid_argument(fmt::format("worker {}: step_time is {} ns with {} live sequences; it must be positive",
                                        id, w.step_time.count(), w.sequences.size()));
  }
  if (w.waiting_prompts < 0) {
    return invalid_argument(fmt::format("worker {}: waiting_prompts is {}, negative", id, w.waiting_prompts));
  }
  std::int64_t pages = 0;
  for (const SequenceSnapshot& s : w.sequences) {
    const auto sid = s.id.value();
    if (!sequence_ids.insert(sid)) {
      return invalid_argument(fmt::format("worker {}: sequence {} is listed twice in the fleet", id, sid));
    }
    if (s.tokens < 0 || s.tokens > kMaxCount) {
      return invalid_argument(
          fmt::format("worker {}, sequence {}: tokens is {}, not in [0, 2^40]", id, sid, s.tokens));
    }
    if (s.pages < ceil_div(s.tokens, tokens_per_page) || s.pages > w.pages_total) {
      return invalid_argument(fmt::format(
          "worker {}, sequence {}: {} pages cannot hold its {} tokens at {} per page within the worker's {} pages",
          id, sid, s.pages, s.tokens, tokens_per_page, w.pages_total));
    }
    if (s.expected_remaining_tokens && (*s.expected_remaining_tokens < 0 || *s.expected_remaining_tokens > kMaxCount)) {
      return invalid_argument(fmt::format("worker {}, sequence {}: expected_remaining_tokens is {}, not in [0, 2^40]",
                                          id, sid, *s.expected_remaining_tokens));
    }
    pages += s.pages;
  }
  if (pages > w.pages_used) {
    return invalid_argument(
        fmt::format("worker {}: its sequences hold {} pages but pages_used is {}", id, pages, w.pages_used));
  }
  return ok_status();
}

Status validate(const FleetSnapshot& fleet, Version newest, const RepackPolicyOptions& options) {
  LAMINAR_RETURN_IF_ERROR(validate_options(options));
  if (fleet.tokens_per_page <= 0) {
    return invalid_argument(fmt::format("fleet: tokens_per_page is {}, not positive", fleet.tokens_per_page));
  }
  if (fleet.prompts_waiting && (*fleet.prompts_waiting < 0 || *fleet.prompts_waiting > kMaxCount)) {
    return invalid_argument(
        fmt::format("fleet: prompts_waiting is {}, not in [0, 2^40]", *fleet.prompts_waiting));
  }
  std::size_t sequences = 0;
  std::uint64_t seq_lo = ~std::uint64_t(0), seq_hi = 0, worker_lo = ~std::uint64_t(0), worker_hi = 0;
  for (const WorkerSnapshot& w : fleet.workers) {
    worker_lo = std::min<std::uint64_t>(worker_lo, w.id.value());
    worker_hi = std::max<std::uint64_t>(worker_hi, w.id.value());
    sequences += w.sequences.size();
    for (const SequenceSnapshot& s : w.sequences) {
      seq_lo = std::min(seq_lo, s.id.value());
      seq_hi = std::max(seq_hi, s.id.value());
    }
  }
  IdSet worker_ids(fleet.workers.size(), std::min(worker_lo, worker_hi), worker_hi);
  IdSet sequence_ids(sequences, std::min(seq_lo, seq_hi), seq_hi);
  for (const WorkerSnapshot& w : fleet.workers) {
    if (!worker_ids.insert(w.id.value())) {
      return invalid_argument(fmt::format("fleet: worker {} is listed twice", w.id.value()));
    }
    LAMINAR_RETURN_IF_ERROR(validate_worker(w, fleet.tokens_per_page, newest, sequence_ids));
  }
  return ok_status();
}

// The destinations of one version, ordered by free pages so that the densest one a sequence fits is
// found without a scan: free pages are bucketed (exactly, up to 2^16 distinct values; coarser above,
// and a bucket is then scanned for the best fit), each bucket an intrusive list, and a two-level
// bitmap finds the next non-empty bucket.
class FitIndex {
 public:
  void reset(std::int64_t max_key, std::size_t bins) {
    shift_ = 0;
    while ((max_key >> shift_) >= kBuckets) ++shift_;
    const std::size_t buckets = std::size_t(max_key >> shift_) + 1;
    head_.assign(buckets, -1);
    low_.assign((buckets + 63) / 64, 0);
    high_.assign((low_.size() + 63) / 64, 0);
    next_.assign(bins, -1);
    prev_.assign(bins, -1);
    key_.assign(bins, -1);
  }

  bool contains(int bin) const { return key_[std::size_t(bin)] >= 0; }

  void insert(int bin, std::int64_t key) {
    const std::size_t b = std::size_t(key >> shift_);
    const auto i = std::size_t(bin);
    key_[i] = key;
    prev_[i] = -1;
    next_[i] = head_[b];
    if (head_[b] >= 0) prev_[std::size_t(head_[b])] = bin;
    head_[b] = bin;
    low_[b / 64] |= std::uint64_t(1) << (b % 64);
    high_[b / 4096] |= std::uint64_t(1) << (b / 64 % 64);
  }

  void erase(int bin) {
    const auto i = std::size_t(bin);
    const std::size_t b = std::size_t(key_[i] >> shift_);
    if (prev_[i] >= 0) {
      next_[std::size_t(prev_[i])] = next_[i];
    } else {
      head_[b] = next_[i];
    }
    if (next_[i] >= 0) prev_[std::size_t(next_[i])] = prev_[i];
    key_[i] = -1;
    if (head_[b] < 0) {
      low_[b / 64] &= ~(std::uint64_t(1) << (b % 64));
      if (low_[b / 64] == 0) high_[b / 4096] &= ~(std::uint64_t(1) << (b / 64 % 64));
    }
  }

  // The bin with the fewest keys >= need among those `fits` accepts, or -1. With probe_limit, gives
  // up after looking at that many bins that were big enough but refused.
  template <class Fits>
  int best_fit(std::int64_t need, Fits&& fits, int probe_limit) const {
    int probes = 0;
    for (std::int64_t b = next_bucket(std::size_t(need >> shift_)); b >= 0; b = next_bucket(std::size_t(b) + 1)) {
      int best = -1;
      for (int i = head_[std::size_t(b)]; i >= 0; i = next_[std::size_t(i)]) {
        const std::int64_t k = key_[std::size_t(i)];
        if (k < need || (best >= 0 && k >= key_[std::size_t(best)])) continue;
        if (fits(i)) {
          best = i;
        } else if (++probes >= probe_limit) {
          return best;
        }
      }
      if (best >= 0) return best;
    }
    return -1;
  }

 private:
  static constexpr std::int64_t kBuckets = std::int64_t(1) << 16;

  // The first non-empty bucket at or after b, or -1.
  std::int64_t next_bucket(std::size_t b) const {
    std::size_t w = b / 64;
    if (w >= low_.size()) return -1;
    const std::uint64_t here = low_[w] & (~std::uint64_t(0) << (b % 64));
    if (here != 0) return std::int64_t(w * 64 + std::size_t(std::countr_zero(here)));
    std::size_t hw = (w + 1) / 64;
    if (hw >= high_.size()) return -1;
    std::uint64_t bits = high_[hw] & (~std::uint64_t(0) << ((w + 1) % 64));
    while (bits == 0) {
      if (++hw >= high_.size()) return -1;
      bits = high_[hw];
    }
    w = hw * 64 + std::size_t(std::countr_zero(bits));
    return std::int64_t(w * 64 + std::size_t(std::countr_zero(low_[w])));
  }

  int shift_ = 0;
  std::vector<int> head_;
  std::vector<std::uint64_t> low_;   // bit b: bucket b is not empty
  std::vector<std::uint64_t> high_;  // bit w: low_[w] is not zero
  std::vector<int> next_;
  std::vector<int> prev_;
  std::vector<std::int64_t> key_;  // the bin's free pages while indexed, else -1
};

// A sequence of a draining worker, as the packing needs it.
struct Item {
  std::int64_t need;    // pages it takes on a destination: what it holds plus its growth reserve
  std::int64_t tokens;  // of KV it holds
  double remaining;     // expected remaining tokens (= decode steps)
  double work;          // token-steps of KV it reads until it ends: tokens * remaining + remaining^2 / 2
  std::uint32_t index;  // into its worker's sequences
};

// Decode time on one worker: each step costs a fixed part (weights, launch) plus a part per token of
// KV its live sequences hold, and sequences leave the batch as they end. So a worker holding
// sequences whose longest has R steps left, and which read W token-steps of KV between them until
// they end, stays busy for fixed * R + per_token * W.
struct Busy {
  double fixed = 0;      // seconds per step apart from KV reads
  double remaining = 0;  // R
  double work = 0;       // W
};

// A draining worker of one version: a possible source and a possible destination.
struct Bin {
  std::uint32_t worker = 0;  // into fleet.workers
  std::uint32_t first = 0;   // its items: [first, first + count)
  std::uint32_t count = 0;
  std::int64_t pages = 0;  // pages its sequences hold
  std::int32_t slots_total = 0;
  double own_busy = 0;     // expected busy time with only its own sequences
  // What the packing changes.
  Busy busy;
  std::int64_t tokens = 0;  // of KV its sequences hold
  std::int64_t free = 0;  // pages left after every growth reserve
  std::int32_t slots = 0;
  bool source = false;
  bool received = false;
  std::uint32_t touched = 0;  // the attempt that last saved it for undo
};

struct Placement {
  std::uint32_t item;
  std::uint32_t bin;
};

struct Freed {
  std::uint32_t bin;
  std::uint32_t first_placement;  // its placements run to the next freed bin's first
  double busy_left;
  double move_time;
  double gain;
};

// One packing of one version's draining workers.
struct Packing {
  std::vector<Placement> placements;
  std::vector<Freed> freed;
  double gain = 0;
  double finish = 0;  // the latest expected finish among the draining workers left busy
};

class VersionPacker {
 public:
  VersionPacker(const RepackPolicyOptions& o, double per_token, std::vector<Bin> bins, std::vector<Item> items,
                double tail_limit, std::int64_t& slots_wanted)
      : o_(o),
        cost_aware_(o.strategy == RepackStrategy::kCostAware),
        per_token_(per_token),
        bins_(std::move(bins)),
        items_(std::move(items)),
        tail_limit_(tail_limit),
        slots_wanted_(slots_wanted) {
    std::int64_t max_free = 0;
    for (const Bin& b : bins_) max_free = std::max(max_free, b.free);
    index_.reset(max_free, bins_.size());
    for (std::uint32_t i = 0; i < bins_.size(); ++i) reindex(i);
    order_.resize(bins_.size());
    std::iota(order_.begin(), order_.end(), 0u);
    // Smallest sources first; ties by fewer sequences, then by position, so plans are reproducible.
    std::sort(order_.begin(), order_.end(), [&](std::uint32_t a, std::uint32_t b) {
      if (bins_[a].pages != bins_[b].pages) return bins_[a].pages < bins_[b].pages;
      if (bins_[a].count != bins_[b].count) return bins_[a].count < bins_[b].count;
      return a < b;
    });
  }

  double time(const Busy& b) const { return b.fixed * b.remaining + per_token_ * b.work; }

  Packing pack() {
    Packing out;
    std::uint32_t attempt = 0;
    for (const std::uint32_t s : order_) {
      if (slots_wanted_ <= 0) break;
      if (bins_[s].received) continue;
      ++attempt;
      bins_[s].source = true;
      reindex(s);
      const std::size_t mark = out.placements.size();
      undo_.clear();
      const bool placed_all = place_all(s, attempt, out.placements);
      const Bin& src = bins_[s];
      double move_time = 0, gain = 0;
      if (placed_all) {
        move_time = double(src.pages) * double(o_.page_bytes) / o_.link_bytes_per_s +
                    double(src.count) * seconds(o_.move_overhead);
        double later = 0;
        for (const Saved& u : undo_) later += time(bins_[u.bin].busy) - time(u.before.busy);
        gain = src.own_busy - move_time - later;
      }
      if (!placed_all || (cost_aware_ && !(gain > seconds(o_.min_gain)))) {
        for (auto u = undo_.rbegin(); u != undo_.rend(); ++u) {
          bins_[u->bin] = u->before;
          reindex(u->bin);
        }
        out.placements.resize(mark);
        bins_[s].source = false;
        reindex(s);
        continue;
      }
      out.freed.push_back({s, std::uint32_t(mark), src.own_busy, move_time, gain});
      out.gain += gain;
      slots_wanted_ -= src.slots_total;
    }
    for (const Bin& b : bins_) {
      if (!b.source) out.finish = std::max(out.finish, time(b.busy));
    }
    return out;
  }

  const std::vector<Bin>& bins() const { return bins_; }
  const std::vector<Item>& items() const { return items_; }

 private:
  struct Saved {
    std::uint32_t bin;
    Bin before;
  };

  Busy with(const Busy& b, const Item& item) const {
    return {b.fixed, std::max(b.remaining, item.remaining), b.work + item.work};
  }

  // The destination's step with this sequence too, against max_step_slowdown.
  bool step_fits(const Bin& dst, const Item& item) const {
    if (std::isinf(o_.max_step_slowdown)) return true;
    return per_token_ * double(dst.tokens + item.tokens) <= o_.max_step_slowdown * dst.busy.fixed;
  }

  // Places every sequence of source s, or stops at the first that fits nowhere (false).
  bool place_all(std::uint32_t s, std::uint32_t attempt, std::vector<Placement>& placements) {
    const Bin& src = bins_[s];
    for (std::uint32_t it = src.first; it < src.first + src.count; ++it) {
      const Item& item = items_[it];
      // The destination, with this sequence too, must still finish within the version's limit.
      auto fits = [&](int b) {
        const Bin& dst = bins_[std::size_t(b)];
        return time(with(dst.busy, item)) <= tail_limit_ && step_fits(dst, item);
      };
      const int d = cost_aware_ ? index_.best_fit(item.need, fits, kMaxProbes)
                                : index_.best_fit(item.need, [](int) { return true; }, 1);
      if (d < 0) return false;
      Bin& dst = bins_[std::size_t(d)];
      if (dst.touched != attempt) {
        dst.touched = attempt;
        undo_.push_back({std::uint32_t(d), dst});
      }
      dst.free -= item.need;
      dst.slots -= 1;
      dst.busy = with(dst.busy, item);
      dst.tokens += item.tokens;
      dst.received = true;
      reindex(std::uint32_t(d));
      placements.push_back({it, std::uint32_t(d)});
    }
    return true;
  }

  // A bin is a destination while it is not a source and has a free slot and room.
  void reindex(std::uint32_t i) {
    const Bin& b = bins_[i];
    if (index_.contains(int(i))) index_.erase(int(i));
    if (!b.source && b.slots > 0 && b.free >= 0) index_.insert(int(i), b.free);
  }

  const RepackPolicyOptions& o_;
  bool cost_aware_;
  double per_token_;
  std::vector<Bin> bins_;
  std::vector<Item> items_;
  double tail_limit_;
  std::int64_t& slots_wanted_;  // free slots the waiting prompts still need; a plan stops at 0
  std::vector<std::uint32_t> order_;  // sources in the order they are tried
  std::vector<Saved> undo_;
  FitIndex index_;
};

// Expected remaining tokens of a sequence.
double remaining_of(const SequenceSnapshot& s, const RepackPolicyOptions& o) {
  return s.expected_remaining_tokens ? double(*s.expected_remaining_tokens)
                                     : o.default_remaining_ratio * double(s.tokens);
}

std::int64_t tokens_held(const WorkerSnapshot& w) {
  std::int64_t t = 0;
  for (const SequenceSnapshot& s : w.sequences) t += s.tokens;
  return t;
}

// Seconds of decode step per token of KV held: the options' value, else the least-squares slope of
// step time against tokens held over the fleet's busy workers (0 when it cannot be told).
double per_token_cost(const FleetSnapshot& fleet, const RepackPolicyOptions& o) {
  if (o.step_seconds_per_token) return *o.step_seconds_per_token;
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const WorkerSnapshot& w : fleet.workers) {
    if (w.sequences.empty()) continue;
    const double x = double(tokens_held(w)), y = seconds(w.step_time);
    n += 1;
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  const double var = n * sxx - sx * sx;
  if (n < 2 || !(var > 0)) return 0;
  return std::max(0.0, (n * sxy - sx * sy) / var);
}

// A worker's expected busy time, as Busy describes it.
Busy busy_of(const WorkerSnapshot& w, double per_token, const RepackPolicyOptions& o) {
  Busy b;
  double tokens = 0;
  for (const SequenceSnapshot& s : w.sequences) {
    const double rem = remaining_of(s, o);
    b.remaining = std::max(b.remaining, rem);
    b.work += double(s.tokens) * rem + rem * rem / 2;
    tokens += double(s.tokens);
  }
  b.fixed = std::max(0.0, seconds(w.step_time) - per_token * tokens);
  return b;
}

bool draining(const WorkerSnapshot& w) {
  return w.waiting_prompts == 0 && w.kv_stopped_growing && !w.sequences.empty() &&
         std::size_t(w.slots_used) == w.sequences.size();
}

// Plans one version's workers (indices into fleet.workers) into plan; returns that version's
// expected finish after the plan over the one before.
double plan_version(const FleetSnapshot& fleet, std::span<const std::uint32_t> workers, double per_token,
                    const RepackPolicyOptions& o, std::int64_t& slots_wanted, MigrationPlan& plan) {
  auto time = [&](const Busy& b) { return b.fixed * b.remaining + per_token * b.work; };
  double finish_before = 0, finish_others = 0;
  std::vector<Bin> bins;
  std::vector<Item> items;
  for (const std::uint32_t wi : workers) {
    const WorkerSnapshot& w = fleet.workers[wi];
    const Busy busy = busy_of(w, per_token, o);
    finish_before = std::max(finish_before, time(busy));
    if (!draining(w)) {
      finish_others = std::max(finish_others, time(busy));
      continue;
    }
    Bin b;
    b.worker = wi;
    b.first = std::uint32_t(items.size());
    b.count = std::uint32_t(w.sequences.size());
    b.busy = busy;
    b.own_busy = time(busy);
    b.slots_total = w.slots_total;
    std::int64_t reserve = 0;
    for (std::uint32_t i = 0; i < b.count; ++i) {
      const SequenceSnapshot& s = w.sequences[i];
      const double rem = remaining_of(s, o);
      // The paper's rule knows no lengths; a sequence expected to end sooner needs less room.
      const std::int64_t grow = o.strategy == RepackStrategy::kCostAware
                                    ? std::int64_t(std::min(double(o.growth_horizon_steps), std::ceil(rem)))
                                    : o.growth_horizon_steps;
      const std::int64_t extra = std::max<std::int64_t>(0, ceil_div(s.tokens + grow, fleet.tokens_per_page) - s.pages);
      items.push_back({s.pages + extra, s.tokens, rem, double(s.tokens) * rem + rem * rem / 2, i});
      b.pages += s.pages;
      b.tokens += s.tokens;
      reserve += extra;
    }
    b.free = w.pages_total - w.pages_used - reserve;
    b.slots = w.slots_total - w.slots_used;
    bins.push_back(b);
  }
  if (bins.size() < 2) return 1.0;

  // Infinity turns the check off, also for a version expected to end now (0 * inf is NaN).
  const double tail_limit = std::isinf(o.max_tail_growth) ? o.max_tail_growth
                                                           : finish_before * (1.0 + o.max_tail_growth);
  VersionPacker packer(o, per_token, std::move(bins), std::move(items), tail_limit, slots_wanted);
  const Packing best = packer.pack();

  const std::vector<Bin>& b = packer.bins();
  const std::vector<Item>& it = packer.items();
  for (std::size_t f = 0; f < best.freed.size(); ++f) {
    const Freed& fr = best.freed[f];
    const WorkerSnapshot& src = fleet.workers[b[fr.bin].worker];
    const std::size_t end = f + 1 < best.freed.size() ? best.freed[f + 1].first_placement : best.placements.size();
    for (std::size_t p = fr.first_placement; p < end; ++p) {
      const SequenceSnapshot& s = src.sequences[it[best.placements[p].item].index];
      plan.moves.push_back({s.id, src.id, fleet.workers[b[best.placements[p].bin].worker].id, s.pages});
      plan.pages_moved += s.pages;
    }
    plan.freed.push_back({src.id, to_duration(fr.busy_left), to_duration(fr.move_time), to_duration(fr.gain)});
  }
  plan.gain = to_duration(seconds(plan.gain) + best.gain);
  const double finish_after = std::max(finish_others, best.finish);
  return finish_before > 0 ? finish_after / finish_before : 1.0;
}

}  // namespace

Result<MigrationPlan> plan_repack(const FleetSnapshot& fleet, Version newest, const RepackPolicyOptions& options) {
  LAMINAR_RETURN_IF_ERROR(validate(fleet, newest, options));
  const double per_token = per_token_cost(fleet, options);
  // Older versions only, grouped by version, each group in fleet order.
  std::vector<std::uint32_t> order;
  order.reserve(fleet.workers.size());
  for (std::uint32_t i = 0; i < fleet.workers.size(); ++i) {
    if (fleet.workers[i].version < newest) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
    return fleet.workers[a].version < fleet.workers[b].version;
  });
  // Slots the waiting prompts still need, past the newest version's free ones.
  std::int64_t slots_wanted = std::numeric_limits<std::int64_t>::max();
  if (fleet.prompts_waiting && options.only_for_waiting_prompts && options.strategy == RepackStrategy::kCostAware) {
    slots_wanted = *fleet.prompts_waiting;
    for (const WorkerSnapshot& w : fleet.workers) {
      if (w.version == newest) slots_wanted -= w.slots_total - w.slots_used;
    }
  }
  MigrationPlan plan;
  for (std::size_t begin = 0; begin < order.size();) {
    std::size_t end = begin + 1;
    while (end < order.size() && fleet.workers[order[end]].version == fleet.workers[order[begin]].version) ++end;
    const double growth =
        plan_version(fleet, std::span(order).subspan(begin, end - begin), per_token, options, slots_wanted, plan);
    plan.tail_growth = std::max(plan.tail_growth, growth);
    begin = end;
  }
  return plan;
}

}  // namespace laminar
