#include "held_out.h"

#include <algorithm>
#include <string>
#include <vector>

#include "laminar/kv_cache.h"
#include "laminar/kv_migrator.h"

namespace async_grpo {

laminar::Result<HeldOutReward> evaluate_held_out(const Engine& engine, const DigitTask& task,
                                                 std::span<const DigitPrompt> prompts, const HeldOutOptions& o) {
  if (prompts.empty()) return laminar::invalid_argument("evaluate_held_out: no prompts");
  if (o.samples_per_prompt < 1) {
    return laminar::invalid_argument("evaluate_held_out: samples_per_prompt " + std::to_string(o.samples_per_prompt) +
                                     " < 1");
  }
  if (o.max_live < 1) return laminar::invalid_argument("evaluate_held_out: max_live " + std::to_string(o.max_live) + " < 1");
  const std::int32_t max_positions = engine.config().max_positions;
  for (const DigitPrompt& p : prompts) {
    if (p.tokens.empty() || std::int64_t(p.tokens.size()) + task.max_response_tokens(p) > max_positions) {
      return laminar::invalid_argument("evaluate_held_out: prompt " + std::to_string(p.index) +
                                       " and its response budget do not fit max_positions " +
                                       std::to_string(max_positions));
    }
  }
  constexpr std::int32_t kPageSize = 16;
  auto cache = laminar::PagedKvCache::create(engine.kv_layout(o.max_live * (max_positions / kPageSize + 1), kPageSize));
  if (!cache.ok()) return cache.status();

  struct Live {
    laminar::SequenceState seq;
    const DigitPrompt* prompt = nullptr;
    std::int32_t budget = 0;
  };
  const std::size_t total = prompts.size() * std::size_t(o.samples_per_prompt);
  HeldOutReward r;
  std::vector<Live> live;
  std::size_t next = 0;
  while (next < total || !live.empty()) {
    // Fill the free slots, prefill the newcomers together.
    std::vector<laminar::SequenceState*> fresh;
    const std::size_t first = live.size();
    while (next < total && live.size() < std::size_t(o.max_live)) {
      Live l;
      l.prompt = &prompts[next / std::size_t(o.samples_per_prompt)];
      l.budget = task.max_response_tokens(*l.prompt);
      l.seq.sequence = laminar::SequenceId(next + 1);
      l.seq.seed = o.seed ^ (0x9e3779b97f4a7c15ull * (next + 1));
      l.seq.prompt_tokens = l.prompt->tokens;
      live.push_back(std::move(l));
      ++next;
    }
    for (std::size_t i = first; i < live.size(); ++i) fresh.push_back(&live[i].seq);
    if (!fresh.empty()) LAMINAR_RETURN_IF_ERROR(engine.prefill(*cache, fresh));
    // Score and release what ended (EOS or its budget).
    for (std::size_t i = 0; i < live.size();) {
      const auto& resp = live[i].seq.response_tokens;
      if (resp.back() != kEos && std::int32_t(resp.size()) < live[i].budget) {
        ++i;
        continue;
      }
      const float reward = task.reward(*live[i].prompt, resp);
      r.reward += reward;
      r.exact += reward == 1.0f ? 1 : 0;
      r.tokens += resp.size();
      ++r.samples;
      LAMINAR_RETURN_IF_ERROR(cache->release(live[i].seq.sequence));
      live.erase(live.begin() + std::ptrdiff_t(i));
    }
    if (live.empty()) continue;
    std::vector<laminar::SequenceState*> batch;
    for (Live& l : live) batch.push_back(&l.seq);
    LAMINAR_RETURN_IF_ERROR(engine.step(*cache, batch));
  }
  r.reward /= double(r.samples);
  r.exact /= double(r.samples);
  return r;
}

}  // namespace async_grpo
