// The asynchronous GRPO rollout engine (examples/async_grpo/engine.h) on one thread, at the
// policy's shape (policy_config.h) with seeded random weights (examples/tiny_model):
//   prefill: prompts of 64 tokens through the paged kernel's prefill form, 8 per call, against
//     feeding the same prompts token by token with step() (the baseline);
//   decode (the headline, last line): 64 decode steps of 32 sequences together, against 64 steps
//     of one sequence alone (the baseline): what batching buys a rollout worker.
// Tokens/s are fed tokens over this thread's CPU time, median of the repeats.
#include <algorithm>
#include <ctime>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "harness.h"
#include "tiny_model.h"

namespace {

using laminar::PagedKvCache;
using laminar::SequenceId;
using laminar::SequenceState;

constexpr std::int32_t kPageSize = 16;
constexpr int kRepeats = 7;

[[noreturn]] void fail(const laminar::Status& st) {
  std::fprintf(stderr, "async_grpo_engine_bench: %s\n", st.to_string().c_str());
  std::exit(1);
}

std::vector<SequenceState> sequences(int n, std::size_t prompt) {
  std::vector<SequenceState> out;
  for (int i = 0; i < n; ++i) {
    std::vector<std::int32_t> tokens;
    for (std::size_t t = 0; t < prompt; ++t) tokens.push_back(std::int32_t((7 * t + 3 * std::size_t(i)) % 16));
    out.push_back(tiny_model::start_sequence(SequenceId(std::uint64_t(i) + 1), tokens, 1000 + std::uint64_t(i)));
  }
  return out;
}

// CPU seconds of this thread: the machine these run on is shared, and a run that other processes
// preempt would otherwise count their time as ours (the engine runs on this one thread).
double cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
}

// Median tokens/s of `steps` decode steps of `batch` sequences with 16-token prompts.
double decode_rate(const async_grpo::Engine& engine, int batch, int steps, std::vector<double>* times) {
  for (int r = 0; r < kRepeats + 1; ++r) {
    PagedKvCache cache = PagedKvCache::create(engine.kv_layout(batch * 8, kPageSize)).value();
    std::vector<SequenceState> seqs = sequences(batch, 16);
    std::vector<SequenceState*> ptrs;
    for (SequenceState& s : seqs) ptrs.push_back(&s);
    if (laminar::Status st = engine.prefill(cache, ptrs); !st.ok()) fail(st);
    const double start = cpu_seconds();
    for (int i = 0; i < steps; ++i) {
      if (laminar::Status st = engine.step(cache, ptrs); !st.ok()) fail(st);
    }
    if (r > 0) times->push_back(cpu_seconds() - start);  // the first is warm-up
  }
  std::vector<double> sorted = *times;
  std::sort(sorted.begin(), sorted.end());
  return double(batch) * steps / sorted[sorted.size() / 2];
}

// Median tokens/s of feeding 8 prompts of 64 tokens, in one prefill() call or token by token.
double prefill_rate(const async_grpo::Engine& engine, bool one_pass, std::vector<double>* times) {
  constexpr int kPrompts = 8;
  constexpr std::size_t kPrompt = 64;
  for (int r = 0; r < kRepeats + 1; ++r) {
    PagedKvCache cache = PagedKvCache::create(engine.kv_layout(kPrompts * 8, kPageSize)).value();
    std::vector<SequenceState> seqs = sequences(kPrompts, kPrompt);
    std::vector<SequenceState*> ptrs;
    for (SequenceState& s : seqs) ptrs.push_back(&s);
    const double start = cpu_seconds();
    if (one_pass) {
      if (laminar::Status st = engine.prefill(cache, ptrs); !st.ok()) fail(st);
    } else {
      for (SequenceState* s : ptrs) {
        if (laminar::Status st = cache.add_sequence(s->sequence); !st.ok()) fail(st);
      }
      for (std::size_t i = 0; i < kPrompt; ++i) {
        if (laminar::Status st = engine.step(cache, ptrs); !st.ok()) fail(st);
      }
    }
    if (r > 0) times->push_back(cpu_seconds() - start);
  }
  std::vector<double> sorted = *times;
  std::sort(sorted.begin(), sorted.end());
  return double(kPrompts) * kPrompt / sorted[sorted.size() / 2];
}

}  // namespace

int main() {
  // The policy's shape: vocab 16, 2 layers, d_model 128, 2 query heads on 1 KV head of 64, d_ff 256.
  const async_grpo::PolicyConfig p;
  auto model = tiny_model::TinyModel::create({.seed = 1,
                                              .vocab = p.vocab,
                                              .num_layers = p.num_layers,
                                              .d_model = p.d_model,
                                              .num_qo_heads = p.num_qo_heads,
                                              .num_kv_heads = p.num_kv_heads,
                                              .head_dim = p.head_dim,
                                              .d_ff = p.d_ff,
                                              .max_positions = p.max_positions,
                                              .cpu_threads = 1});
  if (!model.ok()) fail(model.status());
  const async_grpo::Engine& engine = model->engine();

  std::vector<double> prefill_times, stepped_times, b1_times, b32_times;
  const double prefill = prefill_rate(engine, true, &prefill_times);
  const double stepped = prefill_rate(engine, false, &stepped_times);
  laminar::bench::require_stable_baseline("prompt fed token by token", stepped_times);
  std::printf("prefill: %.0f tokens/s in one pass, %.0f tokens/s token by token\n", prefill, stepped);
  laminar::bench::report_throughput("grpo_engine_prefill", "tokens/s", prefill, "token_by_token_step", stepped);

  const double b1 = decode_rate(engine, 1, 64, &b1_times);
  const double b32 = decode_rate(engine, 32, 64, &b32_times);
  laminar::bench::require_stable_baseline("decode batch 1", b1_times);
  std::printf("decode: %.0f tokens/s at batch 1, %.0f tokens/s at batch 32\n", b1, b32);
  laminar::bench::report_throughput("grpo_engine_decode_batch32", "tokens/s", b32, "decode_batch1", b1);
  return 0;
}
