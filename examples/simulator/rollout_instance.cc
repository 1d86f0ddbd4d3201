#include "rollout_instance.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace laminar::sim::internal {
namespace {

double decode_s(const CostModel& cost, std::int64_t batch, std::int64_t kv) {
  return static_cast<double>(cost.decode_step(batch, kv).value().count()) * 1e-9;
}

// Sum of a + s j over j in [p, q).
double line_sum(double a, double s, std::int64_t p, std::int64_t q) {
  if (q <= p) return 0;
  const double n = static_cast<double>(q - p);
  return n * a + s * static_cast<double>(p + q - 1) * n / 2;
}

}  // namespace

void Sample::restart() {
  stage = Stage::kPooled;
  turn = 0;
  turn_left = (*turns)[0].generate_tokens;
  context = kv_missing = prompt_tokens;
  synced = stop_step = 0;
  slot = -1;
  iteration_tokens = 0;
  oldest_version = last_version = -1;
  mixed = false;
  instance = -1;
  ++incarnation;
}

DecodeCurve DecodeCurve::fit(const CostModel& cost, std::int64_t batch, std::int64_t kv_tokens, std::int64_t steps) {
  DecodeCurve c;
  const std::int64_t last = std::max<std::int64_t>(steps, 2) - 1;
  const double f0 = decode_s(cost, batch, kv_tokens);
  c.a0 = f0;
  c.s0 = decode_s(cost, batch, kv_tokens + batch) - f0;
  const double fl = decode_s(cost, batch, kv_tokens + batch * last);
  c.s1 = fl - decode_s(cost, batch, kv_tokens + batch * (last - 1));
  c.a1 = fl - c.s1 * static_cast<double>(last);
  return c;
}

double DecodeCurve::seconds_for(std::int64_t k) const {
  if (k <= 0) return 0;
  // The two lines cross once at most: sum each where it is the larger.
  const bool first_leads = a0 >= a1;
  std::int64_t cross = k;
  if (s0 != s1) {
    const double x = (a1 - a0) / (s0 - s1);
    if (x > 0 && x < static_cast<double>(k)) cross = static_cast<std::int64_t>(std::ceil(x));
  }
  const double lead_a = first_leads ? a0 : a1, lead_s = first_leads ? s0 : s1;
  const double tail_a = first_leads ? a1 : a0, tail_s = first_leads ? s1 : s0;
  return line_sum(lead_a, lead_s, 0, cross) + line_sum(tail_a, tail_s, cross, k);
}

std::int64_t DecodeCurve::steps_within(double s, std::int64_t max_steps) const {
  std::int64_t lo = 0, hi = max_steps;
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo + 1) / 2;
    if (seconds_for(mid) <= s) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

void sync(const RolloutInstance& in, Sample& s) {
  const std::int64_t k = in.decoded - s.synced;
  s.context += k;
  s.turn_left -= k;
  s.iteration_tokens += k;
  s.synced = in.decoded;
}

void enter_decoding(RolloutInstance& in, Sample& s, std::int64_t budget) {
  s.stage = Sample::Stage::kDecoding;
  s.synced = in.decoded;
  // A turn of no tokens still takes one step: the engine emits at least one token per turn.
  std::int64_t left = std::max<std::int64_t>(s.turn_left, 1);
  if (budget > 0) left = std::min(left, std::max<std::int64_t>(budget - s.iteration_tokens, 1));
  s.stop_step = in.decoded + left;
  if (in.free_slots.empty()) {
    in.free_slots.push_back(static_cast<std::int32_t>(in.slot_sample.size()));
    in.slot_sample.push_back(-1);
    in.slot_generation.push_back(0);
  }
  s.slot = in.free_slots.back();
  in.free_slots.pop_back();
  const auto slot = static_cast<std::size_t>(s.slot);
  in.slot_sample[slot] = s.id;
  in.stops.push({s.stop_step, s.slot, in.slot_generation[slot]});
  ++in.decoding;
  in.kv_decoding += s.context;
  if (s.kv_missing > 0) in.prefilling.push_back(s.id);
}

void leave_decoding(RolloutInstance& in, Sample& s) {
  sync(in, s);
  ++in.slot_generation[static_cast<std::size_t>(s.slot)];
  in.free_slots.push_back(s.slot);
  s.slot = -1;
  if (s.kv_missing > 0) std::erase(in.prefilling, s.id);
  s.stage = Sample::Stage::kToolWait;
  --in.decoding;
  in.kv_decoding -= s.context;
}

namespace {

// Drops the heap's entries of samples that left their slot.
void prune_stops(RolloutInstance& in) {
  while (!in.stops.empty() &&
         in.stops.top().generation != in.slot_generation[static_cast<std::size_t>(in.stops.top().slot)]) {
    in.stops.pop();
  }
}

}  // namespace

void clear(RolloutInstance& in) {
  in.live.clear();
  in.waiting.clear();
  in.decoding = in.kv_decoding = in.kv_parked = 0;
  in.stops = {};
  in.slot_sample.clear();
  in.slot_generation.clear();
  in.free_slots.clear();
  in.prefilling.clear();
}

void settle(RolloutInstance& in, Duration now, SampleTable& samples, std::int64_t budget,
            std::vector<std::int64_t>& stopped) {
  stopped.clear();
  if (in.state != RolloutInstance::State::kRunning) return;
  const Duration end = std::min(now, in.seg_end);
  std::int64_t k = in.seg_steps;
  if (now < in.seg_end) {
    const double decode_time = static_cast<double>((now - in.seg_start).count()) * 1e-9 - in.seg_prefill_s;
    k = decode_time <= 0 ? 0 : in.seg_curve.steps_within(decode_time, in.seg_steps);
  }
  in.busy_generating += end - in.seg_start;
  in.tokens_generated += k * in.seg_batch;
  in.decoded += k;
  in.kv_decoding += k * in.seg_batch;
  // The segment began with these samples' prefill, which is done even when cut short.
  for (std::int64_t id : in.prefilling) samples.sample(id).kv_missing = 0;
  in.prefilling.clear();
  for (prune_stops(in); !in.stops.empty() && in.stops.top().step <= in.decoded; prune_stops(in)) {
    Sample& s = samples.sample(in.slot_sample[static_cast<std::size_t>(in.stops.top().slot)]);
    in.stops.pop();
    sync(in, s);
    if (s.turn_left <= 0 || (budget > 0 && s.iteration_tokens >= budget)) stopped.push_back(s.id);
  }
  in.state = RolloutInstance::State::kIdle;
  in.state_since = now;
  ++in.epoch;
}

bool start_segment(RolloutInstance& in, Duration now, const CostModel& cost, SampleTable& samples) {
  if (in.decoding == 0) return false;
  prune_stops(in);
  std::int64_t steps = in.stops.top().step - in.decoded;
  double prefill_s = 0;
  for (std::int64_t id : in.prefilling) {
    const Sample& s = samples.sample(id);
    prefill_s += static_cast<double>(cost.prefill(s.kv_missing, s.context - s.kv_missing).value().count()) * 1e-9;
  }
  // KV grows by `decoding` tokens a step; stop where the free pages would run out.
  const std::int64_t page_tokens = cost.config().rollout.page_tokens;
  const std::int64_t free_tokens = (cost.kv_capacity_pages() - in.pages_used(page_tokens)) * page_tokens;
  steps = std::max<std::int64_t>(1, std::min(steps, free_tokens / in.decoding));
  in.state = RolloutInstance::State::kRunning;
  ++in.epoch;
  in.seg_start = now;
  in.seg_prefill_s = prefill_s;
  in.seg_batch = in.decoding;
  in.seg_steps = steps;
  in.seg_curve = DecodeCurve::fit(cost, in.decoding, in.kv_decoding, steps);
  in.seg_end = now + seconds(prefill_s + in.seg_curve.seconds_for(steps));
  in.state_since = now;
  return true;
}

}  // namespace laminar::sim::internal
