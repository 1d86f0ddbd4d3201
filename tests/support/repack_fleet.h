// repack_fleet.h: random rollout fleets for the RepackPolicy tests and benchmark, shaped like the long
// tail of an RL rollout.
//
// A worker took a batch of 256-token prompts when it last pulled, some steps ago (uniform up to
// max_age), and still holds the responses not yet ended: response lengths are log-normal (median
// 2,048 tokens, sigma 1: p99 about 10x the median) up to a 32,768-token cap, so young workers are
// full and old ones hold a few long survivors. A length predictor's estimate of the remaining
// tokens is the truth times a log-normal error (sigma estimate_error), and some sequences have none.
// Workers of the newest version and of older ones; among the older ones some drain (no waiting
// prompt, KV no longer growing) and the rest still take prompts. Step time grows with the tokens a
// worker holds (decode reads every token's KV each step).
//
//   std::mt19937_64 rng(seed);
//   laminar::testing::RandomFleet f = laminar::testing::random_fleet(rng, {.workers = 1024});
//   auto plan = laminar::plan_repack(f.fleet, f.newest);
//   // f.remaining[w][s]: what sequence s of worker w really generates before it ends
//   laminar::testing::Outcome after = laminar::testing::simulate(f, shape, &*plan, options);
//
// simulate() then plays the fleet's older versions forward with the true lengths, which a plan only
// estimates, and a step time that follows the tokens each worker holds as its batch shrinks, which
// a plan models only as a fixed slowdown per received sequence: how long each worker stays busy,
// when each version's last sequence ends, and which workers run out of KV pages on the way.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <unordered_map>
#include <random>
#include <vector>

#include "laminar/repack_policy.h"

namespace laminar::testing {

struct FleetShape {
  int workers = 64;
  int batch = 192;         // prompts a worker takes when it pulls
  int max_age = 8192;      // steps since a worker took its batch: uniform in [0, max_age]
  int versions = 3;         // the newest and versions - 1 older ones
  std::int32_t tokens_per_page = 16;
  std::int32_t slots_total = 256;
  std::int64_t pages_total = 32768;
  double draining = 0.7;   // fraction of older-version workers that drain
  double estimated = 0.8;  // fraction of sequences with expected_remaining_tokens
  double estimate_error = 0.5;  // sigma of the estimate's log-normal error
  // Decode step model: fixed part plus a cost per token of KV read.
  double step_fixed_s = 0.015;
  double step_per_token_s = 1.5e-7;
};

struct RandomFleet {
  FleetSnapshot fleet;
  Version newest;
  std::vector<std::vector<std::int64_t>> remaining;  // [worker][sequence]: true remaining tokens
};

inline double step_seconds(const FleetShape& shape, double tokens) {
  return shape.step_fixed_s + shape.step_per_token_s * tokens;
}

inline RandomFleet random_fleet(std::mt19937_64& rng, const FleetShape& shape) {
  std::lognormal_distribution<double> length(std::log(2048.0), 1.0);
  std::lognormal_distribution<double> estimate_error(0.0, shape.estimate_error);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  RandomFleet out;
  out.newest = Version(100);
  out.fleet.tokens_per_page = shape.tokens_per_page;
  std::vector<std::uint32_t> ids(std::size_t(shape.workers));
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = std::uint32_t(i * 7 + 3);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::uint64_t next_sequence = rng() % 1000;
  for (int wi = 0; wi < shape.workers; ++wi) {
    WorkerSnapshot w;
    w.id = WorkerId(ids[std::size_t(wi)]);
    w.version = Version(out.newest.value() - rng() % std::uint64_t(std::max(1, shape.versions)));
    w.pages_total = shape.pages_total;
    w.slots_total = shape.slots_total;
    w.pages_used = unit(rng) < 0.2 ? std::int64_t(rng() % std::uint64_t(std::max<std::int64_t>(1, w.pages_total / 64)))
                                   : 0;  // a prefix cache the policy leaves alone
    const bool drains = w.version < out.newest && unit(rng) < shape.draining;
    const auto age = std::int64_t(rng() % std::uint64_t(shape.max_age + 1));
    std::vector<std::int64_t> remaining;
    double tokens_held = 0;
    for (int k = 0; k < shape.batch && int(w.sequences.size()) < w.slots_total; ++k) {
      const auto response = std::int64_t(std::clamp(length(rng), 16.0, 32768.0));
      if (response <= age) continue;  // it has ended
      SequenceSnapshot s;
      s.id = SequenceId(next_sequence++);
      s.tokens = 256 + age;
      s.pages = (s.tokens + shape.tokens_per_page - 1) / shape.tokens_per_page + std::int64_t(rng() % 2);
      if (w.pages_used + s.pages > w.pages_total) break;  // the cache is full: the rest wait
      const std::int64_t left = response - age;
      if (unit(rng) < shape.estimated) {
        s.expected_remaining_tokens = std::int64_t(std::llround(double(left) * estimate_error(rng)));
      }
      w.pages_used += s.pages;
      tokens_held += double(s.tokens);
      w.sequences.push_back(s);
      remaining.push_back(left);
    }
    w.slots_used = std::int32_t(w.sequences.size());
    if (w.version == out.newest) {
      w.waiting_prompts = std::int64_t(rng() % 3);
      w.kv_stopped_growing = unit(rng) < 0.5;
    } else if (drains) {
      w.kv_stopped_growing = true;
    } else {
      // Still taking prompts: some queued, KV still growing, or a prompt in prefill.
      const auto why = rng() % 3;
      w.waiting_prompts = why == 0 ? 1 + std::int64_t(rng() % 8) : 0;
      w.kv_stopped_growing = why != 1 && unit(rng) < 0.5;
      if (why == 2) {
        if (w.slots_used < w.slots_total) {
          w.slots_used += 1;
        } else {
          w.kv_stopped_growing = false;
        }
      }
    }
    if (!w.sequences.empty()) {
      const double noise = 0.9 + 0.2 * unit(rng);
      w.step_time = std::chrono::duration_cast<Duration>(
          std::chrono::duration<double>(step_seconds(shape, tokens_held) * noise));
    }
    out.fleet.workers.push_back(std::move(w));
    out.remaining.push_back(std::move(remaining));
  }
  return out;
}

struct Outcome {
  double busy_worker_s = 0;  // over older-version workers: the sum of the times until each is empty
  std::map<Version, double> finish_s;  // per older version: when its last sequence ends
  int out_of_pages = 0;  // workers whose sequences outgrow their KV cache before they end
};

// Plays the older versions of f forward, after plan (or as they are, for nullptr). A source is empty
// once its pages are sent (options' page_bytes and link_bytes_per_s, plus move_overhead per
// sequence) or its sequences end, whichever is first; a moved sequence decodes on at its destination
// from the start, as staged migration lets it.
inline Outcome simulate(const RandomFleet& f, const FleetShape& shape, const MigrationPlan* plan,
                        const RepackPolicyOptions& options) {
  struct Live {
    std::int64_t tokens;
    std::int64_t remaining;
  };
  const auto& workers = f.fleet.workers;
  std::unordered_map<std::uint32_t, std::size_t> index_of;
  std::unordered_map<std::uint64_t, std::pair<std::size_t, std::size_t>> where;  // sequence -> worker, slot
  for (std::size_t w = 0; w < workers.size(); ++w) {
    index_of[workers[w].id.value()] = w;
    for (std::size_t s = 0; s < workers[w].sequences.size(); ++s) where[workers[w].sequences[s].id.value()] = {w, s};
  }
  std::vector<std::vector<Live>> live(workers.size());
  for (std::size_t w = 0; w < workers.size(); ++w) {
    for (std::size_t s = 0; s < workers[w].sequences.size(); ++s) {
      live[w].push_back({workers[w].sequences[s].tokens, f.remaining[w][s]});
    }
  }
  std::vector<double> send_s(workers.size(), -1);  // sources: when their last page is sent
  if (plan != nullptr) {
    for (const Move& m : plan->moves) {
      const auto [w, s] = where.at(m.sequence.value());
      live[index_of.at(m.to.value())].push_back({workers[w].sequences[s].tokens, f.remaining[w][s]});
      send_s[w] = std::max(send_s[w], 0.0) + double(m.pages) * double(options.page_bytes) / options.link_bytes_per_s +
                  std::chrono::duration<double>(options.move_overhead).count();
    }
    for (std::size_t w = 0; w < workers.size(); ++w) {
      if (send_s[w] >= 0) live[w].clear();
    }
  }
  // Time until seqs end on a worker of this speed, and whether they outgrow `room` pages first.
  auto play = [&](std::vector<Live> seqs, double speed, std::int64_t room) {
    std::sort(seqs.begin(), seqs.end(), [](const Live& x, const Live& y) { return x.remaining < y.remaining; });
    double tokens = 0;
    for (const Live& l : seqs) tokens += double(l.tokens);
    double t = 0;
    std::int64_t step = 0;
    bool overflow = false;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      const auto alive = double(seqs.size() - i);
      const std::int64_t n = seqs[i].remaining - step;  // steps until sequence i ends
      if (n > 0) {
        // Steps step .. step + n - 1 with `alive` sequences, each one token longer every step.
        t += speed * (double(n) * shape.step_fixed_s +
                      shape.step_per_token_s * (double(n) * tokens + alive * double(n) * double(n - 1) / 2));
        tokens += alive * double(n);
        step += n;
      }
      if (!overflow) {  // pages peak just before a sequence ends
        std::int64_t pages = 0;
        for (std::size_t j = i; j < seqs.size(); ++j) {
          pages += (seqs[j].tokens + step + shape.tokens_per_page - 1) / shape.tokens_per_page;
        }
        overflow = pages > room;
      }
      tokens -= double(seqs[i].tokens + step);
    }
    return std::pair<double, bool>{t, overflow};
  };
  Outcome out;
  for (std::size_t w = 0; w < workers.size(); ++w) {
    const WorkerSnapshot& ws = workers[w];
    if (!(ws.version < f.newest)) continue;
    // The worker's own speed against the model, kept for what it receives.
    double held = 0;
    std::int64_t own_pages = 0;
    std::vector<Live> own;
    for (std::size_t s = 0; s < ws.sequences.size(); ++s) {
      held += double(ws.sequences[s].tokens);
      own_pages += ws.sequences[s].pages;
      own.push_back({ws.sequences[s].tokens, f.remaining[w][s]});
    }
    const double speed =
        ws.sequences.empty() ? 1.0 : std::chrono::duration<double>(ws.step_time).count() / step_seconds(shape, held);
    const std::int64_t room = ws.pages_total - (ws.pages_used - own_pages);
    auto [t, overflow] = play(send_s[w] >= 0 ? std::move(own) : live[w], speed, room);
    if (send_s[w] >= 0) {
      t = std::min(t, send_s[w]);
      overflow = false;
    }
    out.busy_worker_s += t;
    out.finish_s[ws.version] = std::max(out.finish_s[ws.version], t);
    out.out_of_pages += overflow ? 1 : 0;
  }
  return out;
}

}  // namespace laminar::testing
