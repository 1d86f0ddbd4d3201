// kv_migrator_bench: KvMigrator moving one live sequence, shaped like a 7B GQA model's (28 layers,
// 4 KV heads, head_dim 128, bf16, pages of 16 tokens: 56 KiB of K+V a token), between two
// processes on this host, each with its Transport (UCX chooses: shared memory), PagedKvCache and
// KvMigrator. Against baselines measured in the same run:
//   throughput: a blocking copy (max_live_stages 0) of the longest sequence, bytes of KV over the
//     time from migrate() to kDone, against one Endpoint::put of as many bytes from memory the
//     transport allocated into the peer's (median of the repeats, put and migration taking turns).
//     Beside it, where a copy's time goes: the same bytes put as a copy cuts them and into
//     registered host memory, the copy's parts measured alone (the put, one side's checksums, a
//     stage's round trip) and both processes' time on a CPU and waiting for one.
//   downtime: the time a sequence is paused, from kPauseRequested to kDone, of the staged copy
//     (default options) against the blocking copy, at each length. The source "decodes" the
//     sequence until it is paused: a step appends one token, writes its K/V rows in every layer and
//     lasts --step-ms, as a loaded 7B worker's step does; the migrator is polled between steps.
//     Once paused, the source has nothing to decode and polls every --poll-us, as the destination
//     always does.
// The destination is this binary re-executed (`kv_migrator_bench dest MAX_TOKENS POOLS`); after every
// migration it checks every K/V row that arrived against the pattern the source wrote, outside
// the timings, and releases the sequence. Prints a table on stderr and one JSON line per metric,
// the one --headline names last.
//
//   kv_migrator_bench [--lengths 256,1024,4096,8192] [--repeats 7] [--step-ms 25] [--poll-us 100]
//                    [--headline downtime|throughput] [--pools allocated|registered]
// --pools: the caches' pools in memory the transport allocated (KvMigrator::allocate_cache, the
// default), or the caches' own, which the migrators register.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#define XXH_INLINE_ALL  // as the migrator includes it, so its checksums cost the same here
#include <xxhash.h>

#include "cli.h"
#include "harness.h"
#include "laminar/kv_cache.h"
#include "laminar/kv_migrator.h"
#include "laminar/transport.h"
#include "process.h"

using namespace std::chrono_literals;
using namespace laminar;

namespace {

using SteadyClock = std::chrono::steady_clock;

constexpr MessageType kRegion = 1;  // dest answers with its baseline region
constexpr MessageType kCheck = 2;   // "ID LENGTH": dest checks and releases an arrived sequence
constexpr MessageType kPing = 3;    // answered from dest's poll loop, as its migrator answers stages
constexpr MessageType kExit = 4;
const char* const kToken = "kv-migrate-bench-token-0123456789";
const Version kVersion(1);

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "kv_migrator_bench: %s\n", what.c_str());
  std::exit(1);
}

void check(const Status& s, const char* what) {
  if (!s.ok()) die(std::string(what) + ": " + s.to_string());
}

double seconds_since(SteadyClock::time_point t) {
  return std::chrono::duration<double>(SteadyClock::now() - t).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A 7B GQA model's KV (Qwen2-7B's shape), with pages for max_tokens plus room to grow while staged.
KvLayout model_layout(std::int64_t max_tokens) {
  constexpr std::int32_t kPageSize = 16;
  constexpr std::int32_t kGrowthRoomPages = 32;
  return {.num_pages = std::int32_t((max_tokens + kPageSize - 1) / kPageSize) + kGrowthRoomPages,
          .page_size = kPageSize,
          .num_kv_heads = 4,
          .head_dim = 128,
          .dtype = DType::kBF16,
          .num_layers = 28};
}

std::size_t token_bytes(const KvLayout& l) {
  return std::size_t(l.token_elems()) * dtype_size(l.dtype) * 2 * std::size_t(l.num_layers);
}

// The bytes every K/V row gets: a slice of a fixed random table chosen by (sequence, layer, pool,
// position), so rows differ and the destination can check each one without being told.
class RowPattern {
 public:
  explicit RowPattern(std::size_t row_bytes) : row_bytes_(row_bytes), table_(std::size_t{4} << 20) {
    std::mt19937_64 rng(20);
    for (std::size_t i = 0; i < table_.size(); i += 8) {
      const std::uint64_t x = rng();
      std::memcpy(table_.data() + i, &x, 8);
    }
  }

  const unsigned char* row(SequenceId seq, std::int32_t layer, int pool, std::int64_t pos) const {
    std::uint64_t x = seq.value() * 0x9E3779B97F4A7C15ull ^ std::uint64_t(layer) << 40 ^ std::uint64_t(pool) << 39 ^
                      std::uint64_t(pos);
    x ^= x >> 31;  // splitmix64's finaliser: neighbouring positions land far apart
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    return table_.data() + x % (table_.size() - row_bytes_);
  }

  // Writes tokens [from, to) of `seq` in every layer.
  void write(PagedKvCache& cache, SequenceId seq, std::int64_t from, std::int64_t to) const {
    for (std::int32_t layer = 0; layer < cache.layout().num_layers; ++layer) {
      for (std::int64_t pos = from; pos < to; ++pos) {
        auto slot = cache.token_slot(seq, pos, layer);
        check(slot.status(), "token_slot");
        std::memcpy(slot->k, row(seq, layer, 0, pos), row_bytes_);
        std::memcpy(slot->v, row(seq, layer, 1, pos), row_bytes_);
      }
    }
  }

  // OK when every row of `seq` holds its pattern; kDataLoss naming the first that does not.
  Status verify(PagedKvCache& cache, SequenceId seq) const {
    const auto length = cache.length(seq);
    if (!length.ok()) return length.status();
    for (std::int32_t layer = 0; layer < cache.layout().num_layers; ++layer) {
      for (std::int64_t pos = 0; pos < *length; ++pos) {
        auto slot = cache.token_slot(seq, pos, layer);
        if (!slot.ok()) return slot.status();
        if (std::memcmp(slot->k, row(seq, layer, 0, pos), row_bytes_) != 0 ||
            std::memcmp(slot->v, row(seq, layer, 1, pos), row_bytes_) != 0) {
          return Status(StatusCode::kDataLoss, "sequence " + std::to_string(seq.value()) + " layer " +
                                                   std::to_string(layer) + " token " + std::to_string(pos) +
                                                   " differs from what the source wrote");
        }
      }
    }
    return Status::ok_status();
  }

 private:
  std::size_t row_bytes_;
  std::vector<unsigned char> table_;
};

TransportOptions transport_options() {
  TransportOptions o;
  o.cluster_token = kToken;
  o.operation_timeout = 60s;
  return o;
}

// Where the caches' pools live (--pools): memory the transport allocated, which a peer on this
// host puts into with one copy, or the cache's own, which KvMigrator::create registers.
enum class Pools { kAllocated, kRegistered };

KvMigrator::AllocatedCache make_cache(Transport& transport, const KvLayout& layout, Pools where) {
  if (where == Pools::kRegistered) {
    auto cache = PagedKvCache::create(layout);
    check(cache.status(), "cache");
    return {std::make_shared<PagedKvCache>(std::move(cache).value()), {}, {}};
  }
  auto pools = KvMigrator::allocate_cache(transport, layout);
  check(pools.status(), "cache");
  return std::move(pools).value();
}

KvMigratorOptions migrator_options(const KvMigrator::AllocatedCache& pools) {
  KvMigratorOptions o;
  o.k_pool_region = pools.k_pool;
  o.v_pool_region = pools.v_pool;
  return o;
}

// The destination: answers offers, and on kCheck checks and releases what arrived. Runs until kExit.
int run_dest(std::int64_t max_tokens, Pools where) {
  const KvLayout layout = model_layout(max_tokens);
  const RowPattern pattern(std::size_t(layout.token_elems()) * dtype_size(layout.dtype));
  auto created = Transport::create(transport_options());
  check(created.status(), "transport");
  std::shared_ptr<Transport> transport = std::move(created).value();
  const KvMigrator::AllocatedCache pools = make_cache(*transport, layout, where);
  const std::shared_ptr<PagedKvCache> cache = pools.cache;
  auto mig = KvMigrator::create(transport, cache, migrator_options(pools));
  check(mig.status(), "migrator");
  (*mig)->set_version(kVersion);

  // The baselines' targets: memory the transport allocated, and host memory it registered.
  const std::size_t baseline_bytes = std::size_t(max_tokens) * token_bytes(layout);
  auto region = transport->allocate(baseline_bytes);
  check(region.status(), "baseline region");
  std::memset(region->data(), 0, region->size());  // touched, so the puts pay no page faults
  std::vector<std::byte> host(baseline_bytes);
  std::memset(host.data(), 0, host.size());
  auto registered = transport->register_memory(host.data(), host.size());
  check(registered.status(), "registered baseline region");

  std::mutex mu;
  std::deque<Incoming> requests;  // kCheck and kPing, answered by the loop below, which owns the cache
  bool done = false;
  check(transport->on_message(
            kRegion,
            [&](Incoming in) {
              const MemoryRegion& r = in.message.text() == "registered" ? *registered : *region;
              (void)in.from.reply(in, Message::from_bytes(kRegion, r.remote().serialize()));
            }),
        "handler");
  for (const MessageType type : {kCheck, kPing}) {
    check(transport->on_message(type,
                                [&](Incoming in) {
                                  std::lock_guard lock(mu);
                                  requests.push_back(std::move(in));
                                }),
          "handler");
  }
  check(transport->on_message(kExit,
                              [&](Incoming in) {
                                (void)in.from.reply(in, in.message);
                                std::lock_guard lock(mu);
                                done = true;
                              }),
        "handler");
  auto address = transport->listen("127.0.0.1", 0);
  check(address.status(), "listen");
  std::printf("%s\n", address->c_str());
  std::fflush(stdout);

  std::unordered_map<std::uint64_t, SequenceState> arrived;
  for (;;) {
    for (MigrationEvent& e : (*mig)->poll()) {
      if (e.kind == MigrationEvent::Kind::kArrived) {
        for (SequenceState& s : e.states) arrived[s.sequence.value()] = std::move(s);
      } else if (e.kind == MigrationEvent::Kind::kAborted) {
        std::fprintf(stderr, "kv_migrator_bench dest: migration aborted: %s\n", e.reason.to_string().c_str());
      }
    }
    std::optional<Incoming> request;
    {
      std::lock_guard lock(mu);
      if (done) return 0;
      if (!requests.empty()) {
        request = std::move(requests.front());
        requests.pop_front();
      }
    }
    if (request && request->message.type == kPing) {
      (void)request->from.reply(*request, request->message);
    } else if (request) {
      unsigned long long id = 0, length = 0;
      std::sscanf(std::string(request->message.text()).c_str(), "%llu %llu", &id, &length);
      const SequenceId seq(id);
      const auto it = arrived.find(id);
      Status s = Status::ok_status();
      if (it == arrived.end()) {
        s = Status(StatusCode::kNotFound, "sequence " + std::to_string(id) + " has not arrived");
      } else if (it->second.kv_length != length || cache->length(seq).value_or(-1) != std::int64_t(length)) {
        s = Status(StatusCode::kDataLoss, "sequence " + std::to_string(id) + " arrived with another length");
      } else {
        s = pattern.verify(*cache, seq);
      }
      if (it != arrived.end()) {
        arrived.erase(it);
        check(cache->release(seq), "release");
      }
      if (s.ok()) {
        (void)request->from.reply(*request, Message::from_string(kCheck, "ok"));
      } else {
        (void)request->from.reply_error(*request, s);
      }
    }
    std::this_thread::sleep_for(100us);
  }
}

// Seconds the threads of a process spent on a CPU, and runnable but waiting for one
// (/proc/PID/task/*/schedstat), summed over its threads.
struct SchedTimes {
  double on_cpu_s = 0;
  double waiting_s = 0;
};

SchedTimes sched_times(pid_t pid) {
  SchedTimes t;
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::ifstream in(task.path() / "schedstat");
    unsigned long long on_cpu_ns = 0, waiting_ns = 0;
    if (in >> on_cpu_ns >> waiting_ns) {
      t.on_cpu_s += double(on_cpu_ns) * 1e-9;
      t.waiting_s += double(waiting_ns) * 1e-9;
    }
  }
  return t;
}

struct MigrationTiming {
  double total_s = 0;         // migrate() to kDone
  double downtime_s = 0;      // kPauseRequested to kDone
  double longest_poll_s = 0;  // of the poll() calls between decode steps: what staging adds to a step
  SchedTimes sched;           // of both processes, migrate() to kDone
};

// The source: this process. Owns the transport and cache; a KvMigrator is made per mode.
class Source {
 public:
  Source(std::int64_t max_tokens, Pools where, pid_t dest_pid, const std::string& dest_address, Duration step,
         Duration poll_interval)
      : layout_(model_layout(max_tokens)),
        pattern_(std::size_t(layout_.token_elems()) * dtype_size(layout_.dtype)),
        dest_pid_(dest_pid),
        dest_address_(dest_address),
        step_(step),
        poll_interval_(poll_interval) {
    auto created = Transport::create(transport_options());
    check(created.status(), "transport");
    transport_ = std::move(created).value();
    pools_ = make_cache(*transport_, layout_, where);
    cache_ = pools_.cache;
    auto ep = transport_->connect(dest_address_);
    check(ep.status(), "connect");
    dest_ = *ep;
  }

  const KvLayout& layout() const { return layout_; }
  std::string lanes() const { return dest_.transport_info(); }

  std::unique_ptr<KvMigrator> migrator(std::uint32_t max_live_stages) {
    KvMigratorOptions o = migrator_options(pools_);
    o.max_live_stages = max_live_stages;
    auto mig = KvMigrator::create(transport_, cache_, o);
    check(mig.status(), "migrator");
    (*mig)->set_version(kVersion);
    return std::move(mig).value();
  }

  // Moves a fresh sequence of `tokens` to the destination, has the destination check every row
  // of it, and returns the timings. With `decode`, the sequence grows a token a step until paused.
  MigrationTiming migrate(KvMigrator& mig, std::int64_t tokens, bool decode) {
    const SequenceId seq = fresh_sequence(tokens);
    std::int64_t decoded = 0;

    const SchedTimes sched_start = both_sched_times();
    const auto start = SteadyClock::now();
    auto id = mig.migrate(dest_address_, std::span<const SequenceId>(&seq, 1));
    check(id.status(), "migrate");
    std::optional<SteadyClock::time_point> paused;
    double longest_poll_s = 0;
    for (;;) {
      const auto step_start = SteadyClock::now();
      std::vector<MigrationEvent> events = mig.poll();
      if (!paused) longest_poll_s = std::max(longest_poll_s, seconds_since(step_start));
      for (MigrationEvent& e : events) {
        if (e.kind == MigrationEvent::Kind::kPauseRequested) {
          paused = SteadyClock::now();
          std::vector<SequenceState> states;
          states.push_back(state_of(seq, tokens, decoded));
          check(mig.finish(e.id, std::move(states)), "finish");
        } else if (e.kind == MigrationEvent::Kind::kDone) {
          const auto end = SteadyClock::now();
          const SchedTimes sched_end = both_sched_times();
          if (!paused) die("kDone before kPauseRequested");
          check_at_dest(seq, tokens + decoded);
          return {std::chrono::duration<double>(end - start).count(),
                  std::chrono::duration<double>(end - *paused).count(),
                  longest_poll_s,
                  {sched_end.on_cpu_s - sched_start.on_cpu_s, sched_end.waiting_s - sched_start.waiting_s}};
        } else if (e.kind == MigrationEvent::Kind::kAborted) {
          die("migration aborted: " + e.reason.to_string());
        }
      }
      if (decode && !paused) {
        check(cache_->append_tokens(seq, 1), "append_tokens");
        pattern_.write(*cache_, seq, tokens + decoded, tokens + decoded + 1);
        ++decoded;
        std::this_thread::sleep_until(step_start + step_);
      } else {
        std::this_thread::sleep_for(poll_interval_);
      }
    }
  }

  // Where a baseline puts: memory the destination's transport allocated (on one host, shared
  // memory this process maps: a put is one memcpy) or host memory it registered (as the pools of
  // a cache that PagedKvCache::create allocated: UCX emulates the put in software).
  enum class Target { kAllocated, kRegistered };
  // How a baseline cuts the bytes: one put, or the puts a blocking copy of `tokens` makes (a
  // stage of pages at a time, one put per layer and pool for the stage's run of pages, two
  // stages in flight, as build_stage in src/kv_migrator.cc).
  enum class Pattern { kOne, kStages };

  // Puts `bytes` (the K+V of `tokens`) from a region this transport allocated into the
  // destination's: seconds, and both processes' scheduling times over it.
  std::pair<double, SchedTimes> put_baseline(std::int64_t tokens, std::size_t bytes, Target target,
                                             Pattern pattern) {
    if (!put_src_.valid()) {
      for (const Target t : {Target::kAllocated, Target::kRegistered}) {
        auto desc = dest_.request(Message::from_string(kRegion, t == Target::kRegistered ? "registered" : ""));
        check(desc.status(), "region request");
        auto remote = RemoteRegion::deserialize(desc->body);
        check(remote.status(), "region");
        put_dst_[int(t)] = *remote;
      }
      auto local = transport_->allocate(bytes);
      check(local.status(), "allocate");
      put_src_ = *local;
      std::mt19937_64 rng(7);
      for (std::size_t i = 0; i + 8 <= bytes; i += 8) {
        const std::uint64_t x = rng();
        std::memcpy(put_src_.data() + i, &x, 8);
      }
    }
    const RemoteRegion& dst = put_dst_[int(target)];
    const SchedTimes sched_start = both_sched_times();
    const auto start = SteadyClock::now();
    if (pattern == Pattern::kOne) {
      check(dest_.put(put_src_, 0, dst, 0, bytes).get(), "put");
    } else {
      // The bytes as [pool][layer][page]: a page's bytes in one layer and pool are contiguous.
      const std::size_t page_bytes = std::size_t(layout_.page_bytes());
      const std::size_t layers = std::size_t(layout_.num_layers);
      const std::size_t pages = std::size_t((tokens + layout_.page_size - 1) / layout_.page_size);
      const std::size_t per_stage =
          std::max<std::size_t>(1, KvMigratorOptions{}.stage_bytes / (2 * layers * page_bytes));
      std::deque<std::vector<std::future<Status>>> in_flight;
      const auto wait_oldest = [&] {
        for (auto& f : in_flight.front()) check(f.get(), "put");
        in_flight.pop_front();
      };
      for (std::size_t first = 0; first < pages; first += per_stage) {
        if (in_flight.size() == 2) wait_oldest();
        const std::size_t run = std::min(per_stage, pages - first);
        std::vector<std::future<Status>> puts;
        for (std::size_t layer = 0; layer < layers; ++layer) {
          for (std::size_t pool = 0; pool < 2; ++pool) {
            const std::size_t offset = ((pool * layers + layer) * pages + first) * page_bytes;
            puts.push_back(dest_.put(put_src_, offset, dst, offset, run * page_bytes));
          }
        }
        in_flight.push_back(std::move(puts));
      }
      while (!in_flight.empty()) wait_oldest();
    }
    const double seconds = seconds_since(start);
    const SchedTimes sched_end = both_sched_times();
    return {seconds, {sched_end.on_cpu_s - sched_start.on_cpu_s, sched_end.waiting_s - sched_start.waiting_s}};
  }

  // Seconds to checksum a sequence of `tokens` as the migrator does on each side
  // (src/kv_migrator.cc, page_checksum): one xxh3 per page over its K then V rows in every layer.
  double checksum_s(std::int64_t tokens) {
    const SequenceId seq = fresh_sequence(tokens);
    const std::size_t page_bytes = std::size_t(layout_.page_bytes());
    const auto* k = static_cast<const unsigned char*>(cache_->k_pool().data());
    const auto* v = static_cast<const unsigned char*>(cache_->v_pool().data());
    const auto pages = cache_->pages(seq);
    check(pages.status(), "pages");
    const auto start = SteadyClock::now();
    for (const std::int32_t page : *pages) {
      XXH3_state_t state;
      XXH3_64bits_reset(&state);
      for (const unsigned char* pool : {k, v}) {
        for (std::int32_t layer = 0; layer < layout_.num_layers; ++layer) {
          XXH3_64bits_update(
              &state, pool + (std::size_t(layer) * std::size_t(layout_.num_pages) + std::size_t(page)) * page_bytes,
              page_bytes);
        }
      }
      checksums_ ^= XXH3_64bits_digest(&state);  // kept, so the hashing is not optimised away
    }
    const double seconds = seconds_since(start);
    check(cache_->release(seq), "release");
    return seconds;
  }

  // Seconds of a request answered from the destination's poll loop, as a stage is.
  double round_trip_s() {
    const auto start = SteadyClock::now();
    check(dest_.request(Message::from_string(kPing, "")).status(), "ping");
    return seconds_since(start);
  }

  void stop_dest() { (void)dest_.request(Message::from_string(kExit, ""), 10s); }

 private:
  SchedTimes both_sched_times() const {
    const SchedTimes here = sched_times(getpid()), there = sched_times(dest_pid_);
    return {here.on_cpu_s + there.on_cpu_s, here.waiting_s + there.waiting_s};
  }

  SequenceId fresh_sequence(std::int64_t tokens) {
    const SequenceId seq(++last_sequence_);
    check(cache_->add_sequence(seq), "add_sequence");
    check(cache_->append_tokens(seq, tokens), "append_tokens");
    pattern_.write(*cache_, seq, 0, tokens);
    return seq;
  }

  SequenceState state_of(SequenceId seq, std::int64_t prompt, std::int64_t decoded) const {
    SequenceState s;
    s.sequence = seq;
    s.trajectory = TrajectoryId(seq.value());
    s.version = kVersion;
    s.seed = seq.value();
    s.rng_position = std::uint64_t(decoded);
    s.kv_length = std::uint64_t(prompt + decoded);
    for (std::int64_t i = 0; i < prompt; ++i) s.prompt_tokens.push_back(std::int32_t(i % 32000));
    for (std::int64_t i = 0; i < decoded; ++i) s.response_tokens.push_back(std::int32_t(i % 32000));
    s.logprobs.assign(std::size_t(decoded), -0.5f);
    return s;
  }

  void check_at_dest(SequenceId seq, std::int64_t tokens) {
    const auto answer =
        dest_.request(Message::from_string(kCheck, std::to_string(seq.value()) + " " + std::to_string(tokens)), 60s);
    check(answer.status(), "destination's check");
  }

  KvLayout layout_;
  RowPattern pattern_;
  pid_t dest_pid_;
  std::string dest_address_;
  Duration step_;
  Duration poll_interval_;
  std::shared_ptr<Transport> transport_;
  KvMigrator::AllocatedCache pools_;
  std::shared_ptr<PagedKvCache> cache_;
  Endpoint dest_;
  MemoryRegion put_src_;
  RemoteRegion put_dst_[2];  // by Target
  std::uint64_t last_sequence_ = 0;
  std::uint64_t checksums_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"KvMigrator moving one live sequence between two processes on this host"};
  app.option_defaults()->always_capture_default();
  std::vector<std::int64_t> lengths = {256, 1024, 4096, 8192};
  int repeats = 7;
  long step_ms = 25, poll_us = 100;
  std::string headline = "downtime";
  std::string pools = "allocated";
  app.add_option("--lengths", lengths, "sequence lengths in tokens, comma-separated")
      ->delimiter(',')
      ->check(laminar::bench::positive());
  app.add_option("--repeats", repeats, "timed rounds of each measurement")->check(laminar::bench::positive());
  app.add_option("--step-ms", step_ms, "the source's decode step")->check(laminar::bench::positive());
  app.add_option("--poll-us", poll_us, "time between the migrator's polls")->check(laminar::bench::positive());
  app.add_option("--headline", headline, "which result the last line reports")
      ->check(CLI::IsMember({"downtime", "throughput"}));
  app.add_option("--pools", pools, "where the destination's KV pools live")
      ->check(CLI::IsMember({"allocated", "registered"}));
  // The destination process this bench starts as "dest LONGEST POOLS"; the empty group keeps it out of --help.
  CLI::App* dest = app.add_subcommand("dest", "the destination process")->group("");
  std::int64_t dest_tokens = 0;
  std::string dest_pools;
  dest->add_option("tokens", dest_tokens)->required()->check(laminar::bench::positive());
  dest->add_option("pools", dest_pools)->required()->check(CLI::IsMember({"allocated", "registered"}));
  CLI11_PARSE(app, argc, argv);
  if (dest->parsed()) {
    return run_dest(dest_tokens, dest_pools == "registered" ? Pools::kRegistered : Pools::kAllocated);
  }
  const Pools where = pools == "registered" ? Pools::kRegistered : Pools::kAllocated;
  const std::int64_t longest = *std::max_element(lengths.begin(), lengths.end());

  laminar::testing::ChildOptions spawn_options;
  spawn_options.program = "/proc/self/exe";
  spawn_options.args = {"dest", std::to_string(longest), pools};
  auto child = laminar::testing::ChildProcess::spawn(std::move(spawn_options));
  check(child.status(), "starting the destination");
  auto dest_address = child->read_line(60s);
  check(dest_address.status(), "the destination's address");

  Source source(longest, where, child->pid(), *dest_address, std::chrono::milliseconds(step_ms),
                std::chrono::microseconds(poll_us));
  const std::size_t bytes = std::size_t(longest) * token_bytes(source.layout());
  // The migrators connect through the same transports, so they use these lanes too.
  std::fprintf(stderr, "kv_migrator_bench: %lld tokens = %.1f MB of K+V; UCX lanes:\n%s", (long long)longest,
               double(bytes) / 1e6, source.lanes().c_str());

  // Throughput: blocking copy against one put, taking turns; one warm-up round each. Beside them,
  // the parts of a copy's work measured alone: one side's checksums, and a stage's round trip.
  std::vector<double> put_s, copy_s, checksum_s, round_trip_s;
  std::vector<double> variant_s[3];  // the put's bytes as a copy's puts, into registered memory, both
  std::vector<double> put_on_cpu_s, put_waiting_s, copy_on_cpu_s, copy_waiting_s;
  {
    auto mig = source.migrator(0);
    for (int r = 0; r < repeats + 1; ++r) {
      const auto [put, put_sched] = source.put_baseline(longest, bytes, Source::Target::kAllocated, Source::Pattern::kOne);
      const double staged_put =
          source.put_baseline(longest, bytes, Source::Target::kAllocated, Source::Pattern::kStages).first;
      const double registered_put =
          source.put_baseline(longest, bytes, Source::Target::kRegistered, Source::Pattern::kOne).first;
      const double registered_staged_put =
          source.put_baseline(longest, bytes, Source::Target::kRegistered, Source::Pattern::kStages).first;
      const MigrationTiming copy = source.migrate(*mig, longest, false);
      const double sums = source.checksum_s(longest);
      const double trip = source.round_trip_s();
      if (r > 0) {
        put_s.push_back(put);
        variant_s[0].push_back(staged_put);
        variant_s[1].push_back(registered_put);
        variant_s[2].push_back(registered_staged_put);
        put_on_cpu_s.push_back(put_sched.on_cpu_s);
        put_waiting_s.push_back(put_sched.waiting_s);
        copy_s.push_back(copy.total_s);
        copy_on_cpu_s.push_back(copy.sched.on_cpu_s);
        copy_waiting_s.push_back(copy.sched.waiting_s);
        checksum_s.push_back(sums);
        round_trip_s.push_back(trip);
      }
    }
    std::fprintf(stderr, "kv_migrator_bench: source stats %s\n", mig->stats().to_json().c_str());
  }
  bench::require_stable_baseline("bulk put", put_s);
  const double put_gbps = double(bytes) / median(put_s) / 1e9;
  const double copy_gbps = double(bytes) / median(copy_s) / 1e9;
  std::fprintf(stderr, "\n%-10s %14s %14s %8s\n", "tokens", "bulk put GB/s", "migrate GB/s", "ratio");
  std::fprintf(stderr, "%-10lld %14.2f %14.2f %8.2f\n\n", (long long)longest, put_gbps, copy_gbps,
               copy_gbps / put_gbps);
  std::fprintf(stderr,
               "the baseline's bytes put other ways (medians, ms): into allocated memory, one put %.2f, a copy's "
               "puts %.2f;\n  into registered host memory, one put %.2f, a copy's puts %.2f\n\n",
               median(put_s) * 1e3, median(variant_s[0]) * 1e3, median(variant_s[1]) * 1e3,
               median(variant_s[2]) * 1e3);
  // Stages as the migrator cuts them (kv_migrator.h, stage_bytes), plus the offer.
  const KvLayout& layout = source.layout();
  const std::int64_t pages_per_stage = std::max<std::int64_t>(
      1, std::int64_t(KvMigratorOptions{}.stage_bytes) / (2 * layout.num_layers * layout.page_bytes()));
  const std::int64_t pages = (longest + layout.page_size - 1) / layout.page_size;
  const std::int64_t round_trips = (pages + pages_per_stage - 1) / pages_per_stage + 1;
  const double put_ms = median(put_s) * 1e3, sums_ms = median(checksum_s) * 1e3,
               trips_ms = double(round_trips) * median(round_trip_s) * 1e3;
  std::fprintf(stderr,
               "a blocking copy's work, each part alone (medians):\n"
               "  put of the bytes                         %8.2f ms\n"
               "  checksums, source and destination, 2 x   %8.2f ms\n"
               "  round trips, offer and %3lld stages, %lld x %8.3f ms\n"
               "  sum                                      %8.2f ms   the migration: %.2f ms\n"
               "both processes' threads, on a CPU / runnable but waiting for one (medians):\n"
               "  during the put        %8.2f / %8.2f ms\n"
               "  during the migration  %8.2f / %8.2f ms\n\n",
               put_ms, sums_ms, (long long)(round_trips - 1), (long long)round_trips, median(round_trip_s) * 1e3,
               put_ms + 2 * sums_ms + trips_ms, median(copy_s) * 1e3, median(put_on_cpu_s) * 1e3,
               median(put_waiting_s) * 1e3, median(copy_on_cpu_s) * 1e3, median(copy_waiting_s) * 1e3);

  // Downtime: blocking and staged copies of each length, taking turns; one warm-up round. Beside
  // it, a staged copy's whole time and its longest poll() while the sequence still decoded.
  std::fprintf(stderr, "%-7s %24s %24s %7s %14s %18s\n", "tokens", "blocking downtime ms", "staged downtime ms",
               "ratio", "staged copy s", "longest poll ms");
  double blocking_longest = 0, staged_longest = 0;
  for (const std::int64_t tokens : lengths) {
    std::vector<double> blocking_s, staged_s, staged_total_s, staged_poll_s;
    for (int r = 0; r < repeats + 1; ++r) {
      const double blocking = source.migrate(*source.migrator(0), tokens, true).downtime_s;
      const MigrationTiming staged =
          source.migrate(*source.migrator(KvMigratorOptions{}.max_live_stages), tokens, true);
      if (r > 0) {
        blocking_s.push_back(blocking);
        staged_s.push_back(staged.downtime_s);
        staged_total_s.push_back(staged.total_s);
        staged_poll_s.push_back(staged.longest_poll_s);
      }
    }
    const double b = median(blocking_s) * 1e3, s = median(staged_s) * 1e3;
    std::fprintf(stderr, "%-7lld %8.2f (%6.2f-%7.2f) %8.2f (%6.2f-%7.2f) %7.1f %14.2f %18.2f\n", (long long)tokens, b,
                 *std::min_element(blocking_s.begin(), blocking_s.end()) * 1e3,
                 *std::max_element(blocking_s.begin(), blocking_s.end()) * 1e3, s,
                 *std::min_element(staged_s.begin(), staged_s.end()) * 1e3,
                 *std::max_element(staged_s.begin(), staged_s.end()) * 1e3, b / s, median(staged_total_s),
                 median(staged_poll_s) * 1e3);
    if (tokens == longest) {
      bench::require_stable_baseline("blocking copy", blocking_s);
      blocking_longest = b;
      staged_longest = s;
    }
  }
  std::fprintf(stderr, "\n");
  source.stop_dest();
  check(child->wait(10s).status(), "the destination's exit");

  const std::string at = "_" + std::to_string(longest) + "_tokens";
  auto throughput = [&] {
    bench::report_throughput("kv_migrate_throughput" + at, "GB/s", copy_gbps, "bulk_put", put_gbps);
  };
  auto downtime = [&] {
    bench::report_time("kv_migrate_downtime" + at, "ms", staged_longest, "blocking_copy", blocking_longest);
  };
  if (headline == "downtime") {
    throughput();
    downtime();
  } else {
    downtime();
    throughput();
  }
  return 0;
}
