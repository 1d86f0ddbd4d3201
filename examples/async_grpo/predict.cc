#include "predict.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <limits>
#include <optional>
#include <queue>
#include <tuple>

namespace async_grpo {
namespace {

constexpr std::uint64_t kAnyVersion = std::numeric_limits<std::uint64_t>::max();

double seconds(std::chrono::nanoseconds d) { return double(d.count()) / 1e9; }

struct Seq {
  std::int64_t group = 0;
  std::int64_t prompt = 0;     // prompt tokens
  std::int64_t remaining = 0;  // response tokens still to sample
  std::int64_t kv = 0;         // tokens in the cache
};

// What a worker is doing until its step ends.
enum class Step : std::uint8_t { kNone, kPrefill, kDecode, kReprefill };

struct Worker {
  std::uint64_t version = 1;
  std::vector<Seq> live;
  std::vector<Seq> starting;  // granted, in the prefill that runs now
  Step step = Step::kNone;
  double step_start = 0;
  std::uint64_t end_event = 0;  // the event that ends the step
  double busy_s = 0;
};

struct Group {
  std::uint64_t version_min = 0, version_max = kAnyVersion;  // sync and one-step windows
  bool stream = false;
  std::int64_t waiting = 0;  // samples not handed out yet
  std::int64_t done = 0;     // samples in the queue
};

class Model {
 public:
  Model(const PredictConfig& c, const Pacing& pacing, std::span<const PredictGroup> groups)
      : c_(c), pacing_(pacing), workload_(groups), workers_(std::size_t(c.workers)) {
    stream_ = c.schedule == "laminar" || c.schedule == "areal";
    window_ = std::max<std::int64_t>(c.group_size, std::int64_t(c.in_flight_batches * c.group_size * c.groups_per_step));
  }

  laminar::Result<Prediction> run() {
    if (!stream_) open();
    for (std::size_t w = 0; w < workers_.size(); ++w) schedule(0, w);
    while (steps_ < c_.steps) {
      if (events_.empty())
        return laminar::internal_error(fmt::format("predict: nothing left to happen after {} of {} steps", steps_, c_.steps));
      const auto [t, order, who] = events_.top();
      events_.pop();
      if (who == kActor) {
        published(t);
      } else if (who == kOpen) {
        now_ = t;
        open();
      } else if (workers_[who].step == Step::kNone || order == workers_[who].end_event) {
        step_end(t, who);
      } else {
        woken_[who] = false;  // a wake-up for a worker that found work meanwhile
      }
    }
    Prediction p;
    p.time_s = now_;
    p.trained_samples = steps_ * c_.groups_per_step * c_.group_size;
    p.samples_per_s = now_ > 0 ? double(p.trained_samples) / now_ : 0;
    p.actor_waiting_share = waiting_s_ + training_s_ > 0 ? waiting_s_ / (waiting_s_ + training_s_) : 0;
    double busy = 0;
    for (const Worker& w : workers_) busy += w.busy_s;
    p.generation_utilisation = now_ > 0 ? busy / (double(workers_.size()) * now_) : 0;
    return p;
  }

 private:
  static constexpr std::size_t kActor = std::numeric_limits<std::size_t>::max();
  static constexpr std::size_t kOpen = kActor - 1;  // one-step's next batch, once the actor re-scored

  void schedule(double t, std::size_t who) { events_.emplace(t, order_++, who); }

  // The next group; past the workload's end (the groups still in flight when the run stopped),
  // its groups again from the start.
  void make_group(std::uint64_t vmin, std::uint64_t vmax, bool stream) {
    groups_.push_back({vmin, vmax, stream, c_.group_size, 0});
    with_waiting_.push_back(std::int64_t(groups_.size()) - 1);
    in_flight_ += c_.group_size;
  }

  // sync: the batch for exactly the newest weights; one-step: for the newest or any newer.
  void open() {
    for (int i = 0; i < c_.groups_per_step; ++i)
      make_group(newest_, c_.schedule == "sync" ? newest_ : kAnyVersion, false);
    wake_idle();
  }

  bool fresh_enough(std::uint64_t v) const { return v + std::uint64_t(c_.max_staleness) >= newest_; }
  bool eligible(const Group& g, std::uint64_t v) const {
    return g.stream ? fresh_enough(v) : g.version_min <= v && v <= g.version_max;
  }

  // The dispatcher's grant for `room` slots of a worker on version v.
  std::vector<Seq> take(std::uint64_t v, std::int64_t room) {
    if (stream_ && fresh_enough(v)) {
      std::int64_t stream_waiting = 0;
      for (std::int64_t g : with_waiting_) stream_waiting += groups_[std::size_t(g)].stream ? groups_[std::size_t(g)].waiting : 0;
      for (; stream_waiting < room && in_flight_ + c_.group_size <= window_; stream_waiting += c_.group_size)
        make_group(0, kAnyVersion, true);
    }
    std::vector<std::pair<std::int64_t, std::int64_t>> grants;  // group, samples
    std::int64_t left = room;
    std::optional<std::int64_t> first;
    for (std::int64_t g : with_waiting_) {
      const Group& grp = groups_[std::size_t(g)];
      if (!eligible(grp, v)) continue;
      if (!first) first = g;
      if (grp.waiting <= left) {
        grants.emplace_back(g, grp.waiting);
        left -= grp.waiting;
      }
      if (left == 0) break;
    }
    if (grants.empty() && first) grants.emplace_back(*first, std::min(left, groups_[std::size_t(*first)].waiting));
    std::vector<Seq> out;
    for (const auto& [g, n] : grants) {
      Group& grp = groups_[std::size_t(g)];
      const PredictGroup& work = workload_[std::size_t(g) % workload_.size()];
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t sample = c_.group_size - grp.waiting;
        out.push_back({g, work.prompt_tokens, work.response_tokens[std::size_t(sample)], 0});
        --grp.waiting;
      }
    }
    std::erase_if(with_waiting_, [&](std::int64_t g) { return groups_[std::size_t(g)].waiting == 0; });
    return out;
  }

  // A worker with nothing to do is woken when the dispatcher's state changes.
  void wake_idle() {
    for (std::size_t w = 0; w < workers_.size(); ++w)
      if (workers_[w].step == Step::kNone && !woken_[w]) {
        woken_[w] = true;
        schedule(now_, w);
      }
  }

  void pushed(const Seq& s) {
    Group& g = groups_[std::size_t(s.group)];
    --in_flight_;
    if (++g.done == c_.group_size) ready_.push_back(s.group);
    if (stream_) wake_idle();  // the window has room again
  }

  // Worker w's step ended at t (or it was woken): apply it, then start the next.
  void step_end(double t, std::size_t wi) {
    now_ = t;
    woken_[wi] = false;
    Worker& w = workers_[wi];
    if (w.step != Step::kNone) {
      w.busy_s += t - w.step_start;
      if (w.step == Step::kPrefill) {
        for (Seq& s : w.starting) {
          s.kv = s.prompt + 1;
          --s.remaining;
          w.live.push_back(s);
        }
        w.starting.clear();
      } else if (w.step == Step::kDecode) {
        for (Seq& s : w.live) {
          ++s.kv;
          --s.remaining;
        }
      }
      // A re-prefill samples nothing: the next decode step feeds the last token.
      std::vector<Seq> left;
      for (const Seq& s : w.live) {
        if (s.remaining <= 0) {
          pushed(s);
        } else {
          left.push_back(s);
        }
      }
      w.live = std::move(left);
      w.step = Step::kNone;
      try_train(t);
    }
    next_step(t, wi);
  }

  void next_step(double t, std::size_t wi) {
    Worker& w = workers_[wi];
    if (c_.schedule == "areal" && !w.live.empty() && w.version < newest_) {
      w.version = newest_;
      std::int64_t tokens = 0;
      for (Seq& s : w.live) tokens += s.kv - 1;
      return begin(t, wi, Step::kReprefill, seconds(pacing_.prefill(tokens)));
    }
    if (w.live.empty() && w.version < newest_) w.version = newest_;
    const std::int64_t room = c_.slots - std::int64_t(w.live.size());
    if (room > 0) {
      std::vector<Seq> granted = take(w.version, room);
      if (!granted.empty()) {
        std::int64_t tokens = 0;
        for (const Seq& s : granted) tokens += s.prompt;
        w.starting = std::move(granted);
        return begin(t, wi, Step::kPrefill, seconds(pacing_.prefill(tokens)));
      }
    }
    if (!w.live.empty()) {
      std::int64_t kv = 0;
      for (const Seq& s : w.live) kv += s.kv + 1;
      return begin(t, wi, Step::kDecode, seconds(pacing_.decode(std::int64_t(w.live.size()), kv)));
    }
  }

  void begin(double t, std::size_t wi, Step step, double duration) {
    workers_[wi].step = step;
    workers_[wi].step_start = t;
    workers_[wi].end_event = order_;
    schedule(t + duration, wi);
  }

  // The actor pops a batch of whole groups when one is ready and it is not training.
  void try_train(double t) {
    if (training_ || std::int64_t(ready_.size()) < c_.groups_per_step) return;
    ready_.erase(ready_.begin(), ready_.begin() + c_.groups_per_step);
    waiting_s_ += t - wait_start_;
    training_ = true;
    if (c_.schedule == "one-step" && steps_ + 1 < c_.steps) schedule(t + c_.score_s, kOpen);
    training_s_ += c_.train_step_s;
    schedule(t + c_.train_step_s, kActor);
  }

  void published(double t) {
    now_ = t;
    training_ = false;
    ++steps_;
    ++newest_;
    wait_start_ = t;
    if (c_.schedule == "sync" && steps_ < c_.steps) {
      open();
    } else {
      wake_idle();
    }
    try_train(t);
  }

  const PredictConfig& c_;
  const Pacing& pacing_;
  std::span<const PredictGroup> workload_;
  bool stream_ = false;
  std::int64_t window_ = 0;
  std::vector<Worker> workers_;
  std::vector<bool> woken_ = std::vector<bool>(workers_.size(), false);
  std::vector<Group> groups_;
  std::vector<std::int64_t> with_waiting_;  // groups with samples not handed out, oldest first
  std::int64_t in_flight_ = 0;              // samples made and not in the queue
  std::deque<std::int64_t> ready_;          // whole groups in the queue, in arrival order
  std::uint64_t newest_ = 1;
  bool training_ = false;
  std::int64_t steps_ = 0;
  double now_ = 0, wait_start_ = 0, waiting_s_ = 0, training_s_ = 0;
  std::priority_queue<std::tuple<double, std::uint64_t, std::size_t>,
                      std::vector<std::tuple<double, std::uint64_t, std::size_t>>, std::greater<>>
      events_;
  std::uint64_t order_ = 0;
};

}  // namespace

laminar::Result<Prediction> predict(const PredictConfig& c, const Pacing& pacing, std::span<const PredictGroup> groups) {
  if (c.schedule != "sync" && c.schedule != "one-step" && c.schedule != "areal" && c.schedule != "laminar")
    return laminar::invalid_argument(fmt::format("predict: unknown schedule '{}'", c.schedule));
  if (c.workers < 1 || c.slots < 1 || c.group_size < 1 || c.groups_per_step < 1 || c.steps < 1) {
    return laminar::invalid_argument(fmt::format(
        "predict: workers {}, slots {}, group_size {}, groups_per_step {} and steps {} must each be at least 1",
        c.workers, c.slots, c.group_size, c.groups_per_step, c.steps));
  }
  if (c.max_staleness < 0) return laminar::invalid_argument(fmt::format("predict: max_staleness {} is negative", c.max_staleness));
  if (!(c.in_flight_batches * c.groups_per_step >= 1 && std::isfinite(c.in_flight_batches)))
    return laminar::invalid_argument(fmt::format("predict: in_flight_batches {} is below one group", c.in_flight_batches));
  if (!(c.train_step_s > 0 && std::isfinite(c.train_step_s)))
    return laminar::invalid_argument(fmt::format("predict: train_step_s {} is not positive", c.train_step_s));
  if (!(c.score_s >= 0 && c.score_s <= c.train_step_s))
    return laminar::invalid_argument(fmt::format("predict: score_s {} is outside [0, train_step_s {}]", c.score_s, c.train_step_s));
  if (groups.empty()) return laminar::invalid_argument("predict: no groups");
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].response_tokens.size() != std::size_t(c.group_size)) {
      return laminar::invalid_argument(fmt::format("predict: group {} has {} samples, not group_size {}", g,
                                                   groups[g].response_tokens.size(), c.group_size));
    }
    const bool short_sample = std::any_of(groups[g].response_tokens.begin(), groups[g].response_tokens.end(),
                                          [](std::int64_t n) { return n < 1; });
    if (groups[g].prompt_tokens < 1 || short_sample)
      return laminar::invalid_argument(fmt::format("predict: group {} has a prompt or response below 1 token", g));
  }
  return Model(c, pacing, groups).run();
}

}  // namespace async_grpo
