#include "prompt_dispatch.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "laminar/handler_gate.h"

namespace async_grpo {

using laminar::Clock;
using laminar::deadline_after;
using laminar::Duration;
using laminar::Endpoint;
using laminar::Incoming;
using laminar::kForever;
using laminar::Message;
using laminar::Result;
using laminar::Status;
using laminar::TrajectoryId;
using laminar::Version;
using laminar::WorkerId;

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
  Version version_min;  // batch groups only
  Version version_max;
  std::vector<SampleRec> samples;
  std::uint32_t waiting = 0;
  std::uint32_t done = 0;
};

struct WorkerRec {
  Endpoint from;
  laminar::CloseSubscription on_close;
  Duration last_request{0};
  std::set<TrajectoryId> held;
};

// The transports a PromptServer serves on: one each, since a second handler would replace the
// first's.
std::mutex served_mu;
std::set<const laminar::Transport*> served;

// Subscriptions taken out under the lock and destroyed after it: resetting one waits for its
// callback, which takes the lock.
using Graveyard = std::vector<laminar::CloseSubscription>;

}  // namespace

struct PromptServer::Impl {
  Impl(std::shared_ptr<laminar::Transport> t, PromptServerOptions o)
      : transport(std::move(t)), opt(std::move(o)), clock(opt.clock ? opt.clock : Clock::steady()) {}

  const std::shared_ptr<laminar::Transport> transport;
  const PromptServerOptions opt;
  const std::shared_ptr<Clock> clock;
  laminar::HandlerGate gate;

  mutable std::mutex mu;
  // Signalled on requests (a new lease to watch), completions, stopping and clock jumps.
  std::condition_variable cv;
  std::uint64_t next_group = 0;
  std::map<std::uint64_t, Group> groups;  // made and not done
  std::set<std::uint64_t> with_waiting;   // groups with a sample waiting, oldest first
  std::map<TrajectoryId, Duration> released;
  std::map<WorkerId, WorkerRec> workers;
  Version newest{0};
  bool stream_on = false;
  StreamWindow stream;
  std::uint64_t waiting_total = 0;
  std::optional<std::uint64_t> told_available;  // what on_available heard last
  PromptServerStats st;
  Status first_error;
  // The sweeping thread: it waits on `cv`, and `wake` notifies `cv` on every jump of a virtual clock.
  bool stopping = false;
  laminar::ClockSubscription wake;
  std::thread sweeper;

  std::uint64_t max_prompt() const { return std::numeric_limits<std::uint64_t>::max() / opt.group_size - 1; }

  TrajectoryId id_of(std::uint64_t g, std::uint32_t s) const {
    return TrajectoryId((opt.first_prompt + g) * opt.group_size + s);
  }
  Sample sample_of(std::uint64_t g, std::uint32_t s) const {
    const TrajectoryId id = id_of(g, s);
    return {id, opt.first_prompt + g, s, splitmix64(opt.seed ^ splitmix64(id.value()))};
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
  bool room_for_groups(std::uint64_t n) const { return n <= group_room(); }

  void make_group(bool is_stream, Version vmin, Version vmax) {
    Group grp{is_stream, vmin, vmax, std::vector<SampleRec>(opt.group_size), opt.group_size, 0};
    groups.emplace(next_group, std::move(grp));
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

  // Finds silent workers and released samples nobody claimed; returns the next time to look.
  Duration sweep(Graveyard& graveyard) {
    const Duration now = clock->now();
    Duration next = kForever;
    for (auto it = workers.begin(); it != workers.end();) {
      const Duration due = deadline_after(it->second.last_request, opt.lease);
      if (now > due) {
        lose(it++, graveyard);
      } else {
        next = std::min(next, due + Duration(1));
        ++it;
      }
    }
    std::vector<TrajectoryId> expired;
    for (const auto& [id, since] : released) {
      const Duration due = deadline_after(since, opt.lease);
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

  // Weights the stream may hand work to.
  bool fresh_enough(Version v) const { return v >= newest || newest.value() - v.value() <= stream.max_staleness; }
  bool eligible(const Group& grp, Version v) const {
    if (grp.stream) return fresh_enough(v);
    return grp.version_min <= v && v <= grp.version_max;
  }
  Version stream_floor() const {
    return Version(newest.value() > stream.max_staleness ? newest.value() - stream.max_staleness : 0);
  }
  // The oldest weights that may take the group's samples, for a worker whose weights are older.
  Version needed(const Group& grp) const {
    return grp.stream ? stream_floor() : grp.version_min;
  }

  void hand_out(std::uint64_t g, Group& grp, WorkerRec& w, WorkerId worker, std::uint32_t n, Grant& out) {
    for (std::uint32_t s = 0; s < opt.group_size && n > 0; ++s) {
      SampleRec& rec = grp.samples[s];
      if (rec.state != SampleState::kWaiting) continue;
      leave_state(g, grp, s);
      rec.state = SampleState::kHeld;
      rec.owner = worker;
      w.held.insert(id_of(g, s));
      out.samples.push_back(sample_of(g, s));
      ++st.handed_out;
      --n;
    }
  }

  // The grant for a request whose held list has been taken in.
  void grant(const PromptRequest& q, WorkerRec& w, Grant& out) {
    if (q.free_slots == 0) return;
    const Version v = q.version;
    if (stream_on && fresh_enough(v)) {
      std::uint64_t stream_waiting = 0;
      for (std::uint64_t g : with_waiting) {
        const Group& grp = groups.at(g);
        if (grp.stream) stream_waiting += grp.waiting;
      }
      while (stream_waiting < q.free_slots && in_flight() + opt.group_size <= stream.max_in_flight &&
             room_for_groups(1)) {
        make_group(true, Version(0), Version(0));
        stream_waiting += opt.group_size;
      }
    }
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
    for (std::uint64_t g : fitting) hand_out(g, groups.at(g), w, q.worker, groups.at(g).waiting, out);
    if (out.samples.empty() && first_eligible) hand_out(*first_eligible, groups.at(*first_eligible), w, q.worker, left, out);
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
    if (!pull && stream_on && !fresh_enough(v)) pull = stream_floor();
    if (pull) {
      out.kind = GrantKind::kPullNewer;
      out.pull_version = *pull;
    }
  }

  std::uint64_t in_flight() const { return st.groups_made * opt.group_size - st.completed; }

  // PromptServerStats::available.
  std::uint64_t available() const {
    std::uint64_t n = 0;
    for (std::uint64_t g : with_waiting) {
      const Group& grp = groups.at(g);
      if (eligible(grp, newest)) n += grp.waiting;
    }
    if (stream_on) {
      const std::uint64_t flight = in_flight();
      const std::uint64_t fit = flight < stream.max_in_flight ? (stream.max_in_flight - flight) / opt.group_size : 0;
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

  // The lock of a change to what may be handed out: on_available hears of it before the lock goes.
  class Changing {
   public:
    explicit Changing(Impl& m) : m_(m), l_(m.mu) {}
    Changing(const Changing&) = delete;
    Changing& operator=(const Changing&) = delete;
    ~Changing() { m_.tell_available(); }

   private:
    Impl& m_;
    std::lock_guard<std::mutex> l_;
  };

  // Checks the request and takes it in (the worker's lease, its held list); then the grant.
  // `known`: the worker this connection served already, if any; `sub`: the connection's close
  // callback otherwise.
  Result<Grant> serve(const Incoming& in, std::optional<WorkerId> known, laminar::CloseSubscription& sub,
                      Graveyard& graveyard) {
    Result<PromptRequest> decoded = decode_prompt_request(in.message.body, opt.max_held);
    if (!decoded.ok()) return decoded.status();
    const PromptRequest& q = *decoded;
    if (std::uint64_t(q.free_slots) + q.held.size() > opt.max_held) {
      return laminar::invalid_argument(fmt::format("prompt request: {} free slots and {} held ids, above max_held {}",
                                                   q.free_slots, q.held.size(), opt.max_held));
    }
    std::set<TrajectoryId> held(q.held.begin(), q.held.end());
    for (TrajectoryId id : held) {
      std::uint64_t g = 0;
      std::uint32_t s = 0;
      if (!locate(id, g, s)) {
        return laminar::invalid_argument(
            fmt::format("prompt request: worker {} holds trajectory {}, of no group made", q.worker.value(), id.value()));
      }
    }
    if (known && *known != q.worker) {
      return laminar::invalid_argument(fmt::format("prompt request: worker {} asks on the connection of worker {}",
                                                   q.worker.value(), known->value()));
    }
    (void)sweep(graveyard);
    auto it = workers.find(q.worker);
    if (it != workers.end() && it->second.from.id() != in.from.id()) {
      // The worker's id on a new connection: its process started again.
      lose(it, graveyard);
      it = workers.end();
    }
    if (it == workers.end()) {
      if (workers.size() >= opt.max_workers) {
        return laminar::resource_exhausted(
            fmt::format("prompt server: {} workers known, max_workers {}", workers.size(), opt.max_workers));
      }
      it = workers.emplace(q.worker, WorkerRec{in.from, std::move(sub), Duration(0), {}}).first;
    }
    WorkerRec& w = it->second;
    const Duration now = clock->now();
    w.last_request = now;
    Grant out;
    // What it stopped listing is released: in flight to the queue, migrating, or dropped.
    for (auto h = w.held.begin(); h != w.held.end();) {
      if (held.count(*h) != 0) {
        ++h;
        continue;
      }
      std::uint64_t g = 0;
      std::uint32_t s = 0;
      LAMINAR_CHECK(locate(*h, g, s));
      groups.at(g).samples[s].state = SampleState::kReleased;
      released.emplace(*h, now);
      h = w.held.erase(h);
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
      if (rec.state == SampleState::kHeld && rec.owner == q.worker) continue;
      leave_state(g, grp->second, s);
      rec.state = SampleState::kHeld;
      rec.owner = q.worker;
      w.held.insert(id);
      ++st.claimed;
    }
    grant(q, w, out);
    ++st.requests;
    cv.notify_all();
    return out;
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
    laminar::CloseSubscription sub;
    if (!known) {
      const laminar::EndpointId endpoint = in.from.id();
      Result<laminar::CloseSubscription> s =
          in.from.on_close(gate.wrap([this, endpoint](Status) { on_closed(endpoint); }));
      if (s.ok()) sub = std::move(*s);
    }
    Graveyard graveyard;
    Result<Grant> g = [&]() -> Result<Grant> {
      Changing l(*this);
      Result<Grant> r = serve(in, known, sub, graveyard);
      if (!r.ok()) ++st.refused;
      return r;
    }();
    graveyard.clear();
    Endpoint from = in.from;
    const Status sent = g.ok() ? from.reply(in, Message{kPromptRequestMessage, encode_grant(*g)})
                               : from.reply_error(in, g.status());
    if (!sent.ok() && sent.code() != laminar::StatusCode::kUnavailable &&
        sent.code() != laminar::StatusCode::kCancelled) {
      std::lock_guard l(mu);
      if (first_error.ok()) first_error = sent.with_context("prompt server: answering a request");
    }
  }

  void on_closed(laminar::EndpointId endpoint) {
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
    while (!stopping) {
      Graveyard graveyard;
      const Duration next = sweep(graveyard);
      tell_available();
      if (!graveyard.empty()) {
        l.unlock();
        graveyard.clear();
        l.lock();
        continue;
      }
      clock->wait_until(cv, l, next);
    }
  }
};

Result<std::unique_ptr<PromptServer>> PromptServer::create(std::shared_ptr<laminar::Transport> transport,
                                                           PromptServerOptions options) {
  if (!transport) return laminar::invalid_argument("prompt server: the transport is null");
  if (options.group_size == 0 || options.max_workers == 0 || options.max_held == 0 ||
      options.max_open_groups == 0) {
    return laminar::invalid_argument(
        fmt::format("PromptServerOptions: group_size {}, max_workers {}, max_held {}, max_open_groups {} (each "
                    "must be positive)",
                    options.group_size, options.max_workers, options.max_held, options.max_open_groups));
  }
  if (options.lease <= Duration::zero()) {
    return laminar::invalid_argument(fmt::format("PromptServerOptions: lease {} ns", options.lease.count()));
  }
  if (options.first_prompt >= std::numeric_limits<std::uint64_t>::max() / options.group_size - 1) {
    return laminar::invalid_argument(fmt::format("PromptServerOptions: first_prompt {} overflows trajectory ids of "
                                                 "groups of {}",
                                                 options.first_prompt, options.group_size));
  }
  {
    std::lock_guard l(served_mu);
    if (!served.insert(transport.get()).second) {
      return laminar::already_exists("prompt server: another one serves on this transport");
    }
  }
  auto impl = std::make_unique<Impl>(std::move(transport), std::move(options));
  Impl* p = impl.get();
  // The type is an application one: registering it cannot fail.
  LAMINAR_CHECK(p->transport->on_message(kPromptRequestMessage, p->gate.wrap([p](Incoming in) { p->on_request(in); }))
                    .ok());
  p->wake = p->clock->subscribe([p] {
    std::lock_guard l(p->mu);
    p->cv.notify_all();
  });
  p->sweeper = std::thread([p] { p->run(); });
  return std::unique_ptr<PromptServer>(new PromptServer(std::move(impl)));
}

PromptServer::PromptServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

PromptServer::~PromptServer() {
  (void)impl_->transport->on_message(kPromptRequestMessage, {});
  impl_->gate.close();
  {
    std::lock_guard l(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  impl_->sweeper.join();
  impl_->wake.reset();
  Graveyard graveyard;
  {
    std::lock_guard l(impl_->mu);
    for (auto& [id, w] : impl_->workers) graveyard.push_back(std::move(w.on_close));
  }
  graveyard.clear();
  std::lock_guard l(served_mu);
  served.erase(impl_->transport.get());
}

Result<std::uint64_t> PromptServer::open(Version version_min, Version version_max, std::uint64_t groups) {
  if (groups == 0) return laminar::invalid_argument("prompt server: open of 0 groups");
  if (version_min > version_max) {
    return laminar::invalid_argument(fmt::format("prompt server: open for versions [{}, {}]", version_min.value(),
                                                 version_max.value()));
  }
  Impl::Changing l(*impl_);
  if (!impl_->room_for_groups(groups)) {
    return laminar::resource_exhausted(
        fmt::format("prompt server: {} more groups pass max_open_groups {} (groups {} to {} are open)", groups,
                    impl_->opt.max_open_groups, impl_->oldest_open(), impl_->next_group));
  }
  const std::uint64_t first = impl_->opt.first_prompt + impl_->next_group;
  for (std::uint64_t i = 0; i < groups; ++i) impl_->make_group(false, version_min, version_max);
  return first;
}

Status PromptServer::set_stream(StreamWindow window) {
  if (window.max_in_flight < impl_->opt.group_size) {
    return laminar::invalid_argument(fmt::format("StreamWindow: max_in_flight {} is below one group of {}",
                                                 window.max_in_flight, impl_->opt.group_size));
  }
  Impl::Changing l(*impl_);
  impl_->stream = window;
  impl_->stream_on = true;
  return laminar::ok_status();
}

void PromptServer::stop_stream() {
  Impl::Changing l(*impl_);
  impl_->stream_on = false;
}

Status PromptServer::set_newest_version(Version v) {
  Impl::Changing l(*impl_);
  if (v < impl_->newest) {
    return laminar::invalid_argument(fmt::format("prompt server: version {} is older than the newest, {}", v.value(),
                                                 impl_->newest.value()));
  }
  impl_->newest = v;
  return laminar::ok_status();
}

Result<Completion> PromptServer::completed(TrajectoryId id) {
  Impl::Changing l(*impl_);
  Impl& m = *impl_;
  std::uint64_t g = 0;
  std::uint32_t s = 0;
  if (!m.locate(id, g, s)) {
    return laminar::not_found(fmt::format("prompt server: trajectory {} is of no group made", id.value()));
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

Status PromptServer::wait_done(std::uint64_t groups, Duration timeout) {
  if (timeout < Duration::zero()) {
    return laminar::invalid_argument(fmt::format("prompt server: wait_done timeout {} ns", timeout.count()));
  }
  std::unique_lock l(impl_->mu);
  const Duration deadline = deadline_after(impl_->clock->now(), timeout);
  while (impl_->st.groups_done < groups) {
    if (impl_->clock->now() >= deadline) {
      return laminar::deadline_exceeded(
          fmt::format("prompt server: {} of {} groups done", impl_->st.groups_done, groups));
    }
    impl_->clock->wait_until(impl_->cv, l, deadline);
  }
  return laminar::ok_status();
}

PromptServerStats PromptServer::stats() const {
  std::lock_guard l(impl_->mu);
  PromptServerStats s = impl_->st;
  s.workers = impl_->workers.size();
  s.in_flight = impl_->in_flight();
  s.waiting = impl_->waiting_total;
  s.available = impl_->available();
  return s;
}

Status PromptServer::background_error() const {
  std::lock_guard l(impl_->mu);
  return impl_->first_error;
}

std::string PromptServerStats::to_json() const {
  return fmt::format(
      R"({{"requests":{},"refused":{},"groups_made":{},"groups_done":{},"handed_out":{},"reissued":{},)"
      R"("claimed":{},"completed":{},"duplicates":{},"lost_workers":{},"workers":{},"in_flight":{},"waiting":{},)"
      R"("available":{}}})",
      requests, refused, groups_made, groups_done, handed_out, reissued, claimed, completed, duplicates, lost_workers,
      workers, in_flight, waiting, available);
}

bool PendingGrant::ready() const {
  return !error_.ok() || !reply_.valid() || reply_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

Result<Grant> PendingGrant::get() {
  if (!error_.ok()) return std::exchange(error_, laminar::failed_precondition("prompt grant: taken already"));
  if (!reply_.valid()) return laminar::failed_precondition("prompt grant: taken already");
  Result<Message> reply = reply_.get();
  if (!reply.ok()) return reply.status();
  return decode_grant(reply->body, max_samples_, max_drop_);
}

struct PromptClient::Impl {
  std::shared_ptr<laminar::Transport> transport;
  PromptClientOptions opt;
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

Result<std::unique_ptr<PromptClient>> PromptClient::create(std::shared_ptr<laminar::Transport> transport,
                                                           PromptClientOptions options) {
  if (!transport) return laminar::invalid_argument("prompt client: the transport is null");
  if (options.connect_timeout <= Duration::zero() || options.retry_interval <= Duration::zero() ||
      options.request_timeout <= Duration::zero()) {
    return laminar::invalid_argument(fmt::format(
        "PromptClientOptions: connect_timeout {} ns, retry_interval {} ns, request_timeout {} ns (each must be "
        "positive)",
        options.connect_timeout.count(), options.retry_interval.count(), options.request_timeout.count()));
  }
  // The transport's clock, so that a test moving virtual time moves the retries too.
  const std::shared_ptr<Clock> clock = transport->options().clock ? transport->options().clock : Clock::steady();
  const Duration deadline = deadline_after(clock->now(), options.connect_timeout);
  Status last;
  for (;;) {
    const Duration left = deadline == kForever ? kForever : deadline - clock->now();
    Result<Endpoint> e = transport->connect(options.server, std::max(left, Duration(1)));
    if (e.ok()) {
      auto impl = std::make_unique<Impl>();
      impl->transport = std::move(transport);
      impl->opt = std::move(options);
      impl->ep = *e;
      return std::unique_ptr<PromptClient>(new PromptClient(std::move(impl)));
    }
    last = e.status();
    // A server not listening yet is worth waiting for; a wrong token or address is not.
    if (last.code() != laminar::StatusCode::kUnavailable) return last;
    std::mutex m;
    std::condition_variable cv;
    std::unique_lock l(m);
    const Duration wake = std::min(deadline, deadline_after(clock->now(), options.retry_interval));
    while (clock->now() < wake) clock->wait_until(cv, l, wake);
    if (clock->now() >= deadline) return last.with_context("prompt client: connecting");
  }
}

PromptClient::PromptClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PromptClient::~PromptClient() = default;

PendingGrant PromptClient::request_async(Version version, std::uint32_t free_slots,
                                         std::span<const TrajectoryId> held, std::optional<Duration> timeout) {
  const Duration t = timeout.value_or(impl_->opt.request_timeout);
  if (t <= Duration::zero()) {
    return PendingGrant(laminar::invalid_argument(fmt::format("prompt client: request timeout {} ns", t.count())));
  }
  Result<Endpoint> ep = impl_->endpoint();
  if (!ep.ok()) return PendingGrant(ep.status());
  PromptRequest q{impl_->opt.worker, version, free_slots, {held.begin(), held.end()}};
  return PendingGrant(ep->request_async(Message{kPromptRequestMessage, encode_prompt_request(q)}, t), free_slots,
                      held.size());
}

Result<Grant> PromptClient::request(Version version, std::uint32_t free_slots, std::span<const TrajectoryId> held,
                                    std::optional<Duration> timeout) {
  return request_async(version, free_slots, held, timeout).get();
}

void PromptClient::close() {
  std::lock_guard l(impl_->mu);
  if (impl_->ep.valid()) impl_->ep.close();
}

}  // namespace async_grpo
