#include "laminar/rollout_dispatcher.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <utility>

#include "clocked_thread.h"
#include "laminar/handler_gate.h"
#include "rollout_dispatch_wire.h"
#include "transport/protocol.h"
#include "stats_fields.h"

namespace laminar {

using internal::DispatchRequestMessage;
using internal::kDispatchRequestMessage;

namespace {

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

enum class SampleState : std::uint8_t { kWaiting, kHeld, kReleased, kCompleted };

struct SampleRec {
  SampleState state = SampleState::kWaiting;
  WorkerId owner;
};

struct Group {
  bool stream = false;
  Version version_min;  // window groups only
  Version version_max;
  std::string payload;
  std::vector<SampleRec> samples;
  std::uint32_t waiting = 0;
  std::uint32_t done = 0;
};

// A request held until there is work for it (or its wait ends).
struct Parked {
  Incoming in;
  DispatchRequestMessage q;
  Duration until{0};
};

struct WorkerRec {
  Endpoint from;
  CloseSubscription on_close;
  Duration last_request{0};
  std::set<TrajectoryId> held;
  std::optional<Parked> parked;
};

// An answer the dispatcher's thread sends.
struct Answer {
  Incoming in;
  Result<Grant> grant;
};

// The transports a RolloutDispatcher serves on: one each, since a second handler would replace
// the first's.
std::mutex served_mu;
std::set<const Transport*> served;

// Subscriptions taken out under the lock and destroyed after it: resetting one waits for its
// callback, which takes the lock.
using Graveyard = std::vector<CloseSubscription>;

Status check_rule(const AdmissionRule& rule, std::uint32_t group_size) {
  if (rule.kind > AdmissionRule::Kind::kInterruptible) {
    return invalid_argument(fmt::format("AdmissionRule: kind {} is unknown", int(rule.kind)));
  }
  if (rule.is_stream() && rule.max_in_flight < group_size) {
    return invalid_argument(fmt::format("AdmissionRule: max_in_flight {} is below one group of {}",
                                        rule.max_in_flight, group_size));
  }
  return ok_status();
}

}  // namespace

struct RolloutDispatcher::Impl {
  Impl(std::shared_ptr<Transport> t, RolloutDispatcherOptions o)
      : transport(std::move(t)), opt(std::move(o)), clock(opt.clock ? opt.clock : Clock::steady()),
        rule(opt.rule) {}

  const std::shared_ptr<Transport> transport;
  const RolloutDispatcherOptions opt;
  const std::shared_ptr<Clock> clock;
  HandlerGate gate;

  mutable std::mutex mu;
  // The thread waits on it for answers to send and for its next deadline; wait_done waits on it
  // for groups done.
  std::condition_variable cv;
  AdmissionRule rule;
  std::uint64_t next_group = 0;
  std::map<std::uint64_t, Group> groups;  // made and not done
  std::set<std::uint64_t> with_waiting;   // groups with a sample waiting, oldest first
  std::map<TrajectoryId, Duration> released;  // and when each is handed out again
  std::map<WorkerId, WorkerRec> workers;
  std::vector<Answer> outbox;
  Version newest{0};
  bool stream_broken = false;  // a payload the stream refused
  std::uint64_t waiting_total = 0;
  std::optional<std::uint64_t> told_available;  // what on_available heard last
  // When the thread wakes next (kForever: only when notified); an earlier deadline must wake it.
  Duration planned_wake = kForever;
  RolloutDispatcherStats st;
  Status first_error;
  internal::ClockedThread thread;

  std::uint64_t max_prompt() const { return std::numeric_limits<std::uint64_t>::max() / opt.group_size - 1; }

  TrajectoryId id_of(std::uint64_t g, std::uint32_t s) const {
    return TrajectoryId((opt.first_prompt + g) * opt.group_size + s);
  }
  Sample sample_of(std::uint64_t g, const Group& grp, std::uint32_t s) const {
    const TrajectoryId id = id_of(g, s);
    return {id, opt.first_prompt + g, s, splitmix64(opt.seed ^ splitmix64(id.value())), grp.payload};
  }
  // The group index and sample index of `id`, when its group has been made.
  bool locate(TrajectoryId id, std::uint64_t& g, std::uint32_t& s) const {
    const std::uint64_t prompt = id.value() / opt.group_size;
    if (prompt < opt.first_prompt || prompt - opt.first_prompt >= next_group) return false;
    g = prompt - opt.first_prompt;
    s = std::uint32_t(id.value() % opt.group_size);
    return true;
  }
  std::uint64_t oldest_open() const { return groups.empty() ? next_group : groups.begin()->first; }
  // Groups that may still be made: within max_open_groups of the oldest open one, and with ids.
  std::uint64_t group_room() const {
    return std::min(opt.max_open_groups - (next_group - oldest_open()),
                    max_prompt() - opt.first_prompt - next_group + 1);
  }

  Result<std::string> payload_of(std::uint64_t prompt) const {
    if (!opt.payload) return std::string();
    std::string p = opt.payload(prompt);
    if (p.size() > opt.max_payload_bytes) {
      return invalid_argument(fmt::format("rollout dispatcher: the payload of prompt {} is {} bytes, above "
                                          "max_payload_bytes {}",
                                          prompt, p.size(), opt.max_payload_bytes));
    }
    return p;
  }

  void make_group(bool is_stream, Version vmin, Version vmax, std::string payload) {
    groups.emplace(next_group, Group{is_stream, vmin, vmax, std::move(payload),
                                     std::vector<SampleRec>(opt.group_size), opt.group_size, 0});
    with_waiting.insert(next_group);
    ++next_group;
    waiting_total += opt.group_size;
    ++st.groups_made;
  }

  // Takes sample (g, s) out of whatever state it is in, ahead of its next one.
  void leave_state(std::uint64_t g, Group& grp, std::uint32_t s) {
    SampleRec& rec = grp.samples[s];
    switch (rec.state) {
      case SampleState::kWaiting:
        --waiting_total;
        if (--grp.waiting == 0) with_waiting.erase(g);
        break;
      case SampleState::kHeld:
        if (auto w = workers.find(rec.owner); w != workers.end()) w->second.held.erase(id_of(g, s));
        break;
      case SampleState::kReleased:
        released.erase(id_of(g, s));
        break;
      case SampleState::kCompleted:
        LAMINAR_CHECK(false);
    }
  }

  void put_back(std::uint64_t g, std::uint32_t s) {
    Group& grp = groups.at(g);
    leave_state(g, grp, s);
    grp.samples[s].state = SampleState::kWaiting;
    if (grp.waiting++ == 0) with_waiting.insert(g);
    ++waiting_total;
    ++st.reissued;
  }

  // Sample (g, s) is out of its worker's hands: handed out again at `due` unless completed or
  // claimed before.
  void release(std::uint64_t g, std::uint32_t s, Duration due) {
    Group& grp = groups.at(g);
    if (grp.samples[s].state != SampleState::kHeld) leave_state(g, grp, s);
    grp.samples[s].state = SampleState::kReleased;
    released.emplace(id_of(g, s), due);
    wake_by(due + Duration(1));
  }

  // Resumed only: whether `id` is of a group the predecessor may have made after its snapshot,
  // which adopt() can make again here.
  bool adoptable(TrajectoryId id) const {
    const std::uint64_t prompt = id.value() / opt.group_size;
    return opt.resume && prompt >= opt.first_prompt + next_group &&
           prompt - opt.first_prompt - next_group < group_room();
  }
  // Makes the groups up to the one of `id` (adoptable), every sample out: the predecessor made
  // and handed them out after its snapshot.
  Status adopt(TrajectoryId id) {
    const std::uint64_t last = id.value() / opt.group_size - opt.first_prompt;
    const Duration due = deadline_after(clock->now(), opt.claim_window);
    while (next_group <= last) {
      Result<std::string> payload = payload_of(opt.first_prompt + next_group);
      if (!payload.ok()) return payload.status();
      const std::uint64_t g = next_group;
      make_group(rule.is_stream(), Version(0), rule.is_stream() ? Version(0) : kAnyNewerVersion, std::move(*payload));
      for (std::uint32_t s = 0; s < opt.group_size; ++s) release(g, s, due);
      ++st.adopted_groups;
    }
    return ok_status();
  }

  // The predecessor's state (RolloutDispatcherOptions::resume), before any request.
  Status restore(const DispatcherSnapshot& snap) {
    const Duration due = deadline_after(clock->now(), opt.claim_window);
    for (const DispatcherSnapshot::Group& sg : snap.open) {
      Result<std::string> payload = payload_of(opt.first_prompt + sg.index);
      if (!payload.ok()) return payload.status();
      next_group = sg.index;
      make_group(sg.stream, sg.stream ? Version(0) : sg.version_min, sg.stream ? Version(0) : sg.version_max,
                 std::move(*payload));
      Group& grp = groups.at(sg.index);
      for (std::uint32_t s = 0; s < opt.group_size; ++s) {
        if (sg.samples[s] == DispatcherSnapshot::SampleState::kOut) release(sg.index, s, due);
        if (sg.samples[s] != DispatcherSnapshot::SampleState::kCompleted) continue;
        leave_state(sg.index, grp, s);
        grp.samples[s].state = SampleState::kCompleted;
        ++grp.done;
      }
    }
    next_group = snap.groups_made;
    st = {};
    st.groups_made = snap.groups_made;
    st.groups_done = snap.groups_made - snap.open.size();
    st.completed = st.groups_done * opt.group_size;
    for (const auto& [g, grp] : groups) st.completed += grp.done;
    return ok_status();
  }

  // The worker is gone: a request of its that waits has nobody to answer.
  void lose(std::map<WorkerId, WorkerRec>::iterator it, Graveyard& graveyard) {
    const std::set<TrajectoryId> held = std::move(it->second.held);
    graveyard.push_back(std::move(it->second.on_close));
    workers.erase(it);
    for (TrajectoryId id : held) {
      std::uint64_t g = 0;
      std::uint32_t s = 0;
      LAMINAR_CHECK(locate(id, g, s));
      put_back(g, s);
    }
    ++st.lost_workers;
  }

  void answer_later(Parked p, Result<Grant> g) {
    outbox.push_back({std::move(p.in), std::move(g)});
    cv.notify_all();
  }

  // Finds silent workers, waits that ended and released samples nobody claimed; returns the next
  // time to look.
  Duration sweep(Graveyard& graveyard) {
    const Duration now = clock->now();
    Duration next = kForever;
    for (auto it = workers.begin(); it != workers.end();) {
      WorkerRec& w = it->second;
      if (w.parked) {
        if (now >= w.parked->until) {
          w.last_request = now;
          Grant nothing;
          nothing.newest = newest;
          answer_later(*std::exchange(w.parked, std::nullopt), std::move(nothing));
        } else {
          next = std::min(next, w.parked->until);
          ++it;
          continue;
        }
      }
      const Duration due = deadline_after(w.last_request, opt.lease);
      if (now > due) {
        lose(it++, graveyard);
      } else {
        next = std::min(next, due + Duration(1));
        ++it;
      }
    }
    std::vector<TrajectoryId> expired;
    for (const auto& [id, due] : released) {
      if (now > due) {
        expired.push_back(id);
      } else {
        next = std::min(next, due + Duration(1));
      }
    }
    for (TrajectoryId id : expired) {
      std::uint64_t g = 0;
      std::uint32_t s = 0;
      LAMINAR_CHECK(locate(id, g, s));
      put_back(g, s);
    }
    return next;
  }

  // A deadline the thread must not sleep past.
  void wake_by(Duration due) {
    if (due < planned_wake) {
      planned_wake = due;
      cv.notify_all();
    }
  }

  // Weights the stream may hand work to.
  bool fresh_enough(Version v) const { return v >= newest || newest.value() - v.value() <= rule.max_staleness; }
  bool eligible(const Group& grp, Version v) const {
    if (grp.stream) return fresh_enough(v);
    return grp.version_min <= v && v <= grp.version_max;
  }
  Version stream_floor() const {
    return Version(newest.value() > rule.max_staleness ? newest.value() - rule.max_staleness : 0);
  }
  // The oldest weights that may take the group's samples, for a worker whose weights are older.
  Version needed(const Group& grp) const { return grp.stream ? stream_floor() : grp.version_min; }

  void hand_out(std::uint64_t g, Group& grp, WorkerRec& w, WorkerId worker, std::uint32_t n, Grant& out) {
    for (std::uint32_t s = 0; s < opt.group_size && n > 0; ++s) {
      SampleRec& rec = grp.samples[s];
      if (rec.state != SampleState::kWaiting) continue;
      leave_state(g, grp, s);
      rec.state = SampleState::kHeld;
      rec.owner = worker;
      w.held.insert(id_of(g, s));
      out.samples.push_back(sample_of(g, grp, s));
      ++st.handed_out;
      --n;
    }
  }

  std::uint64_t in_flight() const { return st.groups_made * opt.group_size - st.completed; }

  // Makes stream groups until `want` samples of the stream wait, or the rule's room ends.
  void grow_stream(std::uint64_t want) {
    if (!rule.is_stream() || stream_broken) return;
    std::uint64_t stream_waiting = 0;
    for (std::uint64_t g : with_waiting) {
      const Group& grp = groups.at(g);
      if (grp.stream) stream_waiting += grp.waiting;
    }
    while (stream_waiting < want && in_flight() + opt.group_size <= rule.max_in_flight && group_room() > 0) {
      Result<std::string> payload = payload_of(opt.first_prompt + next_group);
      if (!payload.ok()) {
        stream_broken = true;
        if (first_error.ok()) first_error = payload.status();
        return;
      }
      make_group(true, Version(0), Version(0), std::move(*payload));
      stream_waiting += opt.group_size;
    }
  }

  // The grant for a request whose held list has been taken in (its drop list is filled already).
  void grant(const DispatchRequestMessage& m, WorkerRec& w, Grant& out) {
    const DispatchRequest& q = m.request;
    const Version v = q.version;
    out.newest = newest;
    out.interrupt = rule.kind == AdmissionRule::Kind::kInterruptible && v < newest;
    if (q.free_slots == 0) return;
    if (q.idle_pull && w.held.empty() && v < newest) {
      out.kind = GrantKind::kPullNewer;
      out.pull_version = newest;
      return;
    }
    if (fresh_enough(v)) grow_stream(q.free_slots);
    // Whole groups first, the oldest first; then, if none fitted, part of the oldest.
    std::uint32_t left = q.free_slots;
    std::optional<std::uint64_t> first_eligible;
    std::vector<std::uint64_t> fitting;
    for (std::uint64_t g : with_waiting) {
      const Group& grp = groups.at(g);
      if (!eligible(grp, v)) continue;
      if (!first_eligible) first_eligible = g;
      if (grp.waiting <= left) {
        fitting.push_back(g);
        left -= grp.waiting;
      }
      if (left == 0) break;
    }
    for (std::uint64_t g : fitting) hand_out(g, groups.at(g), w, m.worker, groups.at(g).waiting, out);
    if (out.samples.empty() && first_eligible) {
      hand_out(*first_eligible, groups.at(*first_eligible), w, m.worker, left, out);
    }
    if (!out.samples.empty()) {
      out.kind = GrantKind::kWork;
      return;
    }
    // Nothing for these weights: is there work for newer ones?
    std::optional<Version> pull;
    for (std::uint64_t g : with_waiting) {
      const Version need = needed(groups.at(g));
      if (need > v && (!pull || need < *pull)) pull = need;
    }
    if (!pull && rule.is_stream() && !fresh_enough(v)) pull = stream_floor();
    if (pull) {
      out.kind = GrantKind::kPullNewer;
      out.pull_version = *pull;
    }
  }

  // Answers the waiting requests that a change gave something to.
  void serve_parked() {
    const Duration now = clock->now();
    for (auto& [id, w] : workers) {
      if (!w.parked) continue;
      Grant out;
      grant(w.parked->q, w, out);
      if (out.kind == GrantKind::kNothing && !out.interrupt) continue;
      w.last_request = now;
      answer_later(*std::exchange(w.parked, std::nullopt), std::move(out));
    }
  }

  // RolloutDispatcherStats::available.
  std::uint64_t available() const {
    std::uint64_t n = 0;
    for (std::uint64_t g : with_waiting) {
      const Group& grp = groups.at(g);
      if (eligible(grp, newest)) n += grp.waiting;
    }
    if (rule.is_stream() && !stream_broken) {
      const std::uint64_t flight = in_flight();
      const std::uint64_t fit = flight < rule.max_in_flight ? (rule.max_in_flight - flight) / opt.group_size : 0;
      n += std::min(fit, group_room()) * opt.group_size;
    }
    return n;
  }

  // Preconditions: mu is held.
  void tell_available() {
    if (!opt.on_available) return;
    const std::uint64_t n = available();
    if (told_available == n) return;
    told_available = n;
    opt.on_available(n);
  }

  // The lock of a change to what may be handed out: the waiting requests get what it gave them,
  // and on_available hears of it, before the lock goes.
  class Changing {
   public:
    explicit Changing(Impl& m) : m_(m), l_(m.mu) {}
    Changing(const Changing&) = delete;
    Changing& operator=(const Changing&) = delete;
    ~Changing() {
      m_.serve_parked();
      m_.tell_available();
    }

   private:
    Impl& m_;
    std::lock_guard<std::mutex> l_;
  };

  // What a request gets: its grant now, or nothing yet (it waits, parked on its worker).
  using Outcome = std::optional<Result<Grant>>;

  // Checks the request and takes it in (the worker's lease, its held list); then the grant, or the
  // wait. `known`: the worker this connection served already, if any; `sub`: the connection's
  // close callback otherwise.
  Outcome serve(const Incoming& in, std::optional<WorkerId> known, CloseSubscription& sub, Graveyard& graveyard) {
    Result<DispatchRequestMessage> decoded = internal::decode_dispatch_request(in.message.body, opt.max_held);
    if (!decoded.ok()) return Result<Grant>(decoded.status());
    const DispatchRequestMessage& m = *decoded;
    const DispatchRequest& q = m.request;
    if (std::uint64_t(q.free_slots) + q.held.size() + q.returned.size() > opt.max_held) {
      return Result<Grant>(invalid_argument(
          fmt::format("dispatch request: {} free slots, {} held and {} returned ids, above max_held {}", q.free_slots,
                      q.held.size(), q.returned.size(), opt.max_held)));
    }
    const std::set<TrajectoryId> held(q.held.begin(), q.held.end());
    const std::set<TrajectoryId> returned(q.returned.begin(), q.returned.end());
    std::optional<TrajectoryId> newest_unknown;  // resumed: adopt its group and those before
    for (const auto& [ids, verb] : {std::pair{&held, "holds"}, std::pair{&returned, "returns"}}) {
      for (TrajectoryId id : *ids) {
        std::uint64_t g = 0;
        std::uint32_t s = 0;
        if (!locate(id, g, s) && adoptable(id)) {
          if (!newest_unknown || *newest_unknown < id) newest_unknown = id;
        } else if (!locate(id, g, s)) {
          return Result<Grant>(invalid_argument(fmt::format("dispatch request: worker {} {} trajectory {}, of no "
                                                            "group made",
                                                            m.worker.value(), verb, id.value())));
        }
        if (ids == &returned && held.count(id) != 0) {
          return Result<Grant>(invalid_argument(fmt::format(
              "dispatch request: worker {} lists trajectory {} both held and returned", m.worker.value(), id.value())));
        }
      }
    }
    if (known && *known != m.worker) {
      return Result<Grant>(invalid_argument(fmt::format("dispatch request: worker {} asks on the connection of "
                                                        "worker {}",
                                                        m.worker.value(), known->value())));
    }
    if (newest_unknown) {
      if (Status a = adopt(*newest_unknown); !a.ok()) return Result<Grant>(a);
    }
    (void)sweep(graveyard);
    auto it = workers.find(m.worker);
    if (it != workers.end() && it->second.from.id() != in.from.id()) {
      // The worker's id on a new connection: its process started again.
      lose(it, graveyard);
      it = workers.end();
    }
    if (it == workers.end()) {
      if (workers.size() >= opt.max_workers) {
        return Result<Grant>(resource_exhausted(
            fmt::format("rollout dispatcher: {} workers known, max_workers {}", workers.size(), opt.max_workers)));
      }
      it = workers.emplace(m.worker, WorkerRec{in.from, std::move(sub), Duration(0), {}, std::nullopt}).first;
    }
    WorkerRec& w = it->second;
    const Duration now = clock->now();
    w.last_request = now;
    wake_by(deadline_after(now, opt.lease) + Duration(1));
    if (w.parked) {
      // A new request replaces the one waiting: the worker has stopped waiting for its answer.
      Grant nothing;
      nothing.newest = newest;
      answer_later(*std::exchange(w.parked, std::nullopt), std::move(nothing));
    }
    Grant out;
    // What it stopped listing is released (in flight to the queue, migrating, or dropped), or put
    // back at once when it says it returns it.
    for (auto h = w.held.begin(); h != w.held.end();) {
      if (held.count(*h) != 0) {
        ++h;
        continue;
      }
      std::uint64_t g = 0;
      std::uint32_t s = 0;
      LAMINAR_CHECK(locate(*h, g, s));
      const TrajectoryId id = *h;
      h = w.held.erase(h);
      if (returned.count(id) != 0) {
        put_back(g, s);
        ++st.returned;
        continue;
      }
      release(g, s, deadline_after(now, opt.lease));
    }
    for (TrajectoryId id : held) {
      std::uint64_t g = 0;
      std::uint32_t s = 0;
      LAMINAR_CHECK(locate(id, g, s));
      auto grp = groups.find(g);
      if (grp == groups.end() || grp->second.samples[s].state == SampleState::kCompleted) {
        out.drop.push_back(id);
        continue;
      }
      SampleRec& rec = grp->second.samples[s];
      if (rec.state == SampleState::kHeld && rec.owner == m.worker) continue;
      leave_state(g, grp->second, s);
      rec.state = SampleState::kHeld;
      rec.owner = m.worker;
      w.held.insert(id);
      ++st.claimed;
    }
    grant(m, w, out);
    ++st.requests;
    if (out.kind == GrantKind::kNothing && !out.interrupt && out.drop.empty() && q.free_slots > 0 &&
        q.wait > Duration::zero()) {
      const Duration until = deadline_after(now, std::min(q.wait, opt.max_wait));
      w.parked = Parked{in, m, until};
      ++st.waited;
      wake_by(until);
      return std::nullopt;
    }
    return Result<Grant>(std::move(out));
  }

  void record_send_error(const Status& sent) {
    if (sent.ok() || sent.code() == StatusCode::kUnavailable || sent.code() == StatusCode::kCancelled) return;
    std::lock_guard l(mu);
    if (first_error.ok()) first_error = sent.with_context("rollout dispatcher: answering a request");
  }

  void send(const Incoming& in, const Result<Grant>& g) {
    Endpoint from = in.from;
    record_send_error(g.ok() ? from.reply(in, Message{kDispatchRequestMessage, internal::encode_grant(*g)})
                             : from.reply_error(in, g.status()));
  }

  void on_request(const Incoming& in) {
    // A new connection's close callback is registered before the lock: registering may run it at
    // once on this thread.
    std::optional<WorkerId> known;
    {
      std::lock_guard l(mu);
      for (const auto& [id, w] : workers) {
        if (w.from.id() == in.from.id()) known = id;
      }
    }
    CloseSubscription sub;
    if (!known) {
      const EndpointId endpoint = in.from.id();
      Result<CloseSubscription> s = in.from.on_close(gate.wrap([this, endpoint](Status) { on_closed(endpoint); }));
      if (s.ok()) sub = std::move(*s);
    }
    Graveyard graveyard;
    Outcome g = [&]() -> Outcome {
      Changing l(*this);
      Outcome r = serve(in, known, sub, graveyard);
      if (r && !r->ok()) ++st.refused;
      return r;
    }();
    graveyard.clear();
    if (g) send(in, *g);
  }

  void on_closed(EndpointId endpoint) {
    Graveyard graveyard;
    Changing l(*this);
    for (auto it = workers.begin(); it != workers.end(); ++it) {
      if (it->second.from.id() == endpoint) {
        // This very callback's subscription: resetting it from inside is allowed.
        lose(it, graveyard);
        break;
      }
    }
  }

  void run() {
    std::unique_lock l(mu);
    while (!thread.stopping()) {
      Graveyard graveyard;
      const Duration next = sweep(graveyard);
      serve_parked();
      tell_available();
      if (!graveyard.empty() || !outbox.empty()) {
        std::vector<Answer> answers = std::exchange(outbox, {});
        l.unlock();
        graveyard.clear();
        for (const Answer& a : answers) send(a.in, a.grant);
        l.lock();
        continue;
      }
      planned_wake = next;
      clock->wait_until(cv, l, next);
      planned_wake = Duration(0);  // awake: a deadline set meanwhile is seen by the next sweep
    }
  }
};

Result<std::unique_ptr<RolloutDispatcher>> RolloutDispatcher::create(std::shared_ptr<Transport> transport,
                                                                     RolloutDispatcherOptions options) {
  if (!transport) return invalid_argument("rollout dispatcher: the transport is null");
  if (options.group_size == 0 || options.max_workers == 0 || options.max_held == 0 || options.max_open_groups == 0) {
    return invalid_argument(fmt::format("RolloutDispatcherOptions: group_size {}, max_workers {}, max_held {}, "
                                        "max_open_groups {} (each must be positive)",
                                        options.group_size, options.max_workers, options.max_held,
                                        options.max_open_groups));
  }
  if (options.lease <= Duration::zero() || options.max_wait <= Duration::zero() || options.max_wait > options.lease) {
    return invalid_argument(fmt::format("RolloutDispatcherOptions: lease {} ns, max_wait {} ns (each positive, "
                                        "max_wait at most the lease)",
                                        options.lease.count(), options.max_wait.count()));
  }
  if (options.first_prompt >= std::numeric_limits<std::uint64_t>::max() / options.group_size - 1) {
    return invalid_argument(fmt::format("RolloutDispatcherOptions: first_prompt {} overflows trajectory ids of "
                                        "groups of {}",
                                        options.first_prompt, options.group_size));
  }
  LAMINAR_RETURN_IF_ERROR(check_rule(options.rule, options.group_size));
  if (options.resume) {
    const DispatcherSnapshot& snap = *options.resume;
    if (options.claim_window <= Duration::zero() || options.claim_window > options.lease) {
      return invalid_argument(fmt::format("RolloutDispatcherOptions: claim_window {} ns (positive, at most the "
                                          "lease {} ns)",
                                          options.claim_window.count(), options.lease.count()));
    }
    if (snap.group_size != options.group_size || snap.first_prompt != options.first_prompt) {
      return invalid_argument(fmt::format("RolloutDispatcherOptions: resume is of groups of {} from prompt {}, these "
                                          "options of groups of {} from prompt {}",
                                          snap.group_size, snap.first_prompt, options.group_size,
                                          options.first_prompt));
    }
    LAMINAR_RETURN_IF_ERROR(internal::check_snapshot(snap));
    const std::uint64_t oldest = snap.open.empty() ? snap.groups_made : snap.open.front().index;
    if (snap.groups_made - oldest > options.max_open_groups) {
      return invalid_argument(fmt::format("RolloutDispatcherOptions: resume has groups {} to {} open, above "
                                          "max_open_groups {}",
                                          oldest, snap.groups_made, options.max_open_groups));
    }
  }
  {
    std::lock_guard l(served_mu);
    if (!served.insert(transport.get()).second) {
      return already_exists("rollout dispatcher: another one serves on this transport");
    }
  }
  auto impl = std::make_unique<Impl>(std::move(transport), std::move(options));
  Impl* p = impl.get();
  if (p->opt.resume) {
    std::lock_guard l(p->mu);
    if (Status st = p->restore(*p->opt.resume); !st.ok()) {
      std::lock_guard s(served_mu);
      served.erase(p->transport.get());
      return st;
    }
  }
  // The type is a laminar protocol one: registering it cannot fail.
  LAMINAR_CHECK(internal::on_protocol_message(*p->transport, kDispatchRequestMessage,
                                              p->gate.wrap([p](Incoming in) { p->on_request(in); }))
                    .ok());
  p->thread.start(p->mu, p->cv, *p->clock, [p] { p->run(); });
  return std::unique_ptr<RolloutDispatcher>(new RolloutDispatcher(std::move(impl)));
}

RolloutDispatcher::RolloutDispatcher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RolloutDispatcher::~RolloutDispatcher() {
  (void)internal::on_protocol_message(*impl_->transport, kDispatchRequestMessage, {});
  impl_->gate.close();
  impl_->thread.stop();
  Graveyard graveyard;
  std::vector<Answer> answers;
  {
    std::lock_guard l(impl_->mu);
    answers = std::exchange(impl_->outbox, {});
    for (auto& [id, w] : impl_->workers) {
      graveyard.push_back(std::move(w.on_close));
      if (w.parked) answers.push_back({std::move(w.parked->in), cancelled("rollout dispatcher: shut down")});
    }
  }
  for (const Answer& a : answers) impl_->send(a.in, a.grant);
  graveyard.clear();
  std::lock_guard l(served_mu);
  served.erase(impl_->transport.get());
}

Status RolloutDispatcher::set_rule(AdmissionRule rule) {
  LAMINAR_RETURN_IF_ERROR(check_rule(rule, impl_->opt.group_size));
  Impl::Changing l(*impl_);
  impl_->rule = rule;
  return ok_status();
}

Status RolloutDispatcher::publish(Version v) {
  Impl::Changing l(*impl_);
  if (v < impl_->newest) {
    return invalid_argument(
        fmt::format("rollout dispatcher: version {} is older than the newest, {}", v.value(), impl_->newest.value()));
  }
  impl_->newest = v;
  return ok_status();
}

Result<std::uint64_t> RolloutDispatcher::open(std::uint64_t groups) {
  Version vmin;
  Version vmax;
  {
    std::lock_guard l(impl_->mu);
    if (impl_->rule.is_stream()) {
      return failed_precondition("rollout dispatcher: open(groups) under a stream rule, which makes its own groups");
    }
    vmin = impl_->newest;
    vmax = impl_->rule.kind == AdmissionRule::Kind::kSync ? vmin : kAnyNewerVersion;
  }
  return open(vmin, vmax, groups);
}

Result<std::uint64_t> RolloutDispatcher::open(Version version_min, Version version_max, std::uint64_t groups) {
  if (groups == 0) return invalid_argument("rollout dispatcher: open of 0 groups");
  if (version_min > version_max) {
    return invalid_argument(
        fmt::format("rollout dispatcher: open for versions [{}, {}]", version_min.value(), version_max.value()));
  }
  Impl::Changing l(*impl_);
  Impl& m = *impl_;
  if (groups > m.group_room()) {
    return resource_exhausted(fmt::format("rollout dispatcher: {} more groups pass max_open_groups {} (groups {} "
                                          "to {} are open)",
                                          groups, m.opt.max_open_groups, m.oldest_open(), m.next_group));
  }
  std::vector<std::string> payloads;
  for (std::uint64_t i = 0; i < groups; ++i) {
    Result<std::string> p = m.payload_of(m.opt.first_prompt + m.next_group + i);
    if (!p.ok()) return p.status();
    payloads.push_back(std::move(*p));
  }
  const std::uint64_t first = m.opt.first_prompt + m.next_group;
  for (std::string& p : payloads) m.make_group(false, version_min, version_max, std::move(p));
  return first;
}

Result<Completion> RolloutDispatcher::completed(TrajectoryId id) {
  Impl::Changing l(*impl_);
  Impl& m = *impl_;
  std::uint64_t g = 0;
  std::uint32_t s = 0;
  if (!m.locate(id, g, s) && m.adoptable(id)) LAMINAR_RETURN_IF_ERROR(m.adopt(id));
  if (!m.locate(id, g, s)) {
    return not_found(fmt::format("rollout dispatcher: trajectory {} is of no group made", id.value()));
  }
  Completion c{m.opt.first_prompt + g, false, false};
  auto grp = m.groups.find(g);
  if (grp == m.groups.end() || grp->second.samples[s].state == SampleState::kCompleted) {
    c.duplicate = true;
    ++m.st.duplicates;
    return c;
  }
  m.leave_state(g, grp->second, s);
  grp->second.samples[s].state = SampleState::kCompleted;
  ++m.st.completed;
  if (++grp->second.done == m.opt.group_size) {
    m.groups.erase(grp);
    ++m.st.groups_done;
    c.group_done = true;
    m.cv.notify_all();
  }
  return c;
}

Status RolloutDispatcher::wait_done(std::uint64_t groups, Duration timeout) {
  if (timeout < Duration::zero()) {
    return invalid_argument(fmt::format("rollout dispatcher: wait_done timeout {} ns", timeout.count()));
  }
  std::unique_lock l(impl_->mu);
  const Duration deadline = deadline_after(impl_->clock->now(), timeout);
  while (impl_->st.groups_done < groups) {
    if (impl_->clock->now() >= deadline) {
      return deadline_exceeded(
          fmt::format("rollout dispatcher: {} of {} groups done", impl_->st.groups_done, groups));
    }
    impl_->clock->wait_until(impl_->cv, l, deadline);
  }
  return ok_status();
}

RolloutDispatcherStats RolloutDispatcher::stats() const {
  std::lock_guard l(impl_->mu);
  RolloutDispatcherStats s = impl_->st;
  s.workers = impl_->workers.size();
  s.waiting_requests = 0;
  for (const auto& [id, w] : impl_->workers) s.waiting_requests += w.parked ? 1 : 0;
  s.in_flight = impl_->in_flight();
  s.waiting = impl_->waiting_total;
  s.available = impl_->available();
  return s;
}

DispatcherSnapshot RolloutDispatcher::snapshot() const {
  std::lock_guard l(impl_->mu);
  const Impl& m = *impl_;
  DispatcherSnapshot snap{.group_size = m.opt.group_size, .first_prompt = m.opt.first_prompt,
                          .groups_made = m.next_group, .open = {}};
  for (const auto& [g, grp] : m.groups) {
    DispatcherSnapshot::Group& out = snap.open.emplace_back();
    out.index = g;
    out.stream = grp.stream;
    out.version_min = grp.stream ? Version(0) : grp.version_min;
    out.version_max = grp.stream ? Version(0) : grp.version_max;
    for (const SampleRec& rec : grp.samples) {
      out.samples.push_back(rec.state == SampleState::kWaiting     ? DispatcherSnapshot::SampleState::kWaiting
                            : rec.state == SampleState::kCompleted ? DispatcherSnapshot::SampleState::kCompleted
                                                                   : DispatcherSnapshot::SampleState::kOut);
    }
  }
  return snap;
}

std::vector<std::byte> DispatcherSnapshot::encode() const { return internal::encode_snapshot(*this); }

Result<DispatcherSnapshot> DispatcherSnapshot::decode(std::span<const std::byte> bytes) {
  return internal::decode_snapshot(bytes);
}

Status RolloutDispatcher::background_error() const {
  std::lock_guard l(impl_->mu);
  return impl_->first_error;
}

std::string RolloutDispatcherStats::to_json() const { return internal::stats_json(*this); }

bool PendingGrant::ready() const {
  return taken_ || !error_.ok() || reply_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

Result<Grant> PendingGrant::get() {
  if (taken_) return failed_precondition("dispatch grant: taken already, or never asked for");
  taken_ = true;
  if (!error_.ok()) return error_;
  Result<Message> reply = reply_.get();
  if (!reply.ok()) return reply.status();
  return internal::decode_grant(reply->body, max_samples_, max_drop_, max_payload_);
}

struct DispatchClient::Impl {
  std::shared_ptr<Transport> transport;
  DispatchClientOptions opt;
  std::mutex mu;
  Endpoint ep;

  Result<Endpoint> endpoint() {
    std::lock_guard l(mu);
    if (ep.valid() && ep.status().ok()) return ep;
    Result<Endpoint> e = transport->connect(opt.server, opt.connect_timeout);
    if (!e.ok()) return e.status();
    ep = *e;
    return ep;
  }
};

Result<std::unique_ptr<DispatchClient>> DispatchClient::create(std::shared_ptr<Transport> transport,
                                                               DispatchClientOptions options) {
  if (!transport) return invalid_argument("dispatch client: the transport is null");
  if (options.connect_timeout <= Duration::zero() || options.retry_interval <= Duration::zero() ||
      options.request_timeout <= Duration::zero()) {
    return invalid_argument(fmt::format("DispatchClientOptions: connect_timeout {} ns, retry_interval {} ns, "
                                        "request_timeout {} ns (each must be positive)",
                                        options.connect_timeout.count(), options.retry_interval.count(),
                                        options.request_timeout.count()));
  }
  // The transport's clock, so that a test moving virtual time moves the retries too.
  const std::shared_ptr<Clock> clock = transport->options().clock ? transport->options().clock : Clock::steady();
  const Duration deadline = deadline_after(clock->now(), options.connect_timeout);
  for (;;) {
    const Duration left = deadline == kForever ? kForever : deadline - clock->now();
    Result<Endpoint> e = transport->connect(options.server, std::max(left, Duration(1)));
    if (e.ok()) {
      auto impl = std::make_unique<Impl>();
      impl->transport = std::move(transport);
      impl->opt = std::move(options);
      impl->ep = *e;
      return std::unique_ptr<DispatchClient>(new DispatchClient(std::move(impl)));
    }
    // A server not listening yet is worth waiting for; a wrong token or address is not.
    if (e.status().code() != StatusCode::kUnavailable) return e.status();
    std::mutex m;
    std::condition_variable cv;
    std::unique_lock l(m);
    const Duration wake = std::min(deadline, deadline_after(clock->now(), options.retry_interval));
    while (clock->now() < wake) clock->wait_until(cv, l, wake);
    if (clock->now() >= deadline) return e.status().with_context("dispatch client: connecting");
  }
}

DispatchClient::DispatchClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DispatchClient::~DispatchClient() = default;

PendingGrant DispatchClient::request_async(const DispatchRequest& request) {
  const auto refuse = [&](Status st) {
    if (impl_->opt.on_answer) impl_->opt.on_answer();
    return PendingGrant(std::move(st));
  };
  if (request.wait < Duration::zero()) {
    return refuse(invalid_argument(fmt::format("dispatch client: wait {} ns", request.wait.count())));
  }
  Result<Endpoint> ep = impl_->endpoint();
  if (!ep.ok()) return refuse(ep.status());
  const Duration timeout = deadline_after(request.wait, impl_->opt.request_timeout);
  const Message m{kDispatchRequestMessage, internal::encode_dispatch_request({impl_->opt.worker, request})};
  return PendingGrant(internal::request_protocol_async(*ep, m, timeout, impl_->opt.on_answer), request.free_slots,
                      request.held.size(), impl_->transport->options().max_message_bytes);
}

Result<Grant> DispatchClient::request(const DispatchRequest& request) { return request_async(request).get(); }

void DispatchClient::close() {
  std::lock_guard l(impl_->mu);
  if (impl_->ep.valid()) impl_->ep.close();
}

Result<DispatchAsker> DispatchAsker::create(DispatchClient* client, DispatchAskerOptions options) {
  if (client == nullptr) return invalid_argument("dispatch asker: the client is null");
  if (options.wait <= Duration::zero() || options.renew_after <= Duration::zero()) {
    return invalid_argument(fmt::format("DispatchAskerOptions: wait {} ns, renew_after {} ns (each must be positive)",
                                        options.wait.count(), options.renew_after.count()));
  }
  if (!options.clock) options.clock = Clock::steady();
  DispatchAsker asker(client, std::move(options));
  asker.asked_at_ = asker.opt_.clock->now();
  return asker;
}

Result<std::vector<Grant>> DispatchAsker::answers() {
  std::vector<Grant> out;
  for (std::optional<PendingGrant>* p : {&replaced_, &asking_}) {
    if (!failed_.ok()) break;
    if (!*p || !(*p)->ready()) continue;
    Result<Grant> g = (*p)->get();
    p->reset();
    if (p == &asking_) asked_slots_ = 0;
    if (g.ok()) {
      // The dispatcher knows this worker holds what it granted.
      for (const Sample& s : g->samples) told_.push_back(s.id);
      std::sort(told_.begin(), told_.end());
      out.push_back(std::move(g).value());
    } else {
      failed_ = g.status();
    }
  }
  if (!out.empty() || failed_.ok()) return out;
  return std::exchange(failed_, ok_status());
}

void DispatchAsker::give_back(std::vector<TrajectoryId> ids) {
  returned_.insert(returned_.end(), ids.begin(), ids.end());
}

bool DispatchAsker::ask(WorkerState state) {
  const std::uint32_t free_slots = state.taking ? state.room : 0;
  std::sort(state.held.begin(), state.held.end());
  // A sample the dispatcher has not heard this worker hold: claim it before its lease runs out.
  const bool untold = !std::includes(told_.begin(), told_.end(), state.held.begin(), state.held.end());
  const bool reask = asking_ && !replaced_ &&
                     ((state.idle && !asking_idle_ && state.taking) || asked_slots_ > state.room ||
                      !returned_.empty() || untold);
  if (reask) replaced_ = std::exchange(asking_, std::nullopt);
  const Duration now = opt_.clock->now();
  const bool renew = now - asked_at_ >= opt_.renew_after;
  if (asking_ || (free_slots == 0 && !reask && returned_.empty() && !untold && !renew)) return false;
  asking_idle_ = state.idle;
  asked_slots_ = free_slots;
  told_ = state.held;
  asked_at_ = now;
  ++questions_;
  asking_ = client_->request_async({.version = state.version,
                                    .free_slots = free_slots,
                                    .held = std::move(state.held),
                                    .wait = opt_.wait,
                                    .idle_pull = state.idle,
                                    .returned = std::exchange(returned_, {})});
  return true;
}

}  // namespace laminar
