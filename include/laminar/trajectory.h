// trajectory.h: Trajectory, one finished rollout sample, with its validation and its binary
// encoding.
//
// A rollout worker fills a Trajectory and pushes it into a TrajectoryQueue, locally or through a
// RemoteProducer; the queue's write-ahead log and the remote producers carry it as
// encode_trajectory's bytes, and whoever reads those bytes back (the log's replay, the queue
// server) gets it through decode_trajectory, which validates it. No threads, no state.
//
//   laminar::Trajectory t;
//   t.id = laminar::TrajectoryId(7);
//   t.response_tokens = {5, 6};
//   t.logprobs = {-0.1f, -0.2f};
//   t.rewards = {1.0f};
//   std::string bytes;
//   laminar::encode_trajectory(t, bytes);
//   laminar::Result<laminar::Trajectory> back = laminar::decode_trajectory(bytes);  // == t
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "laminar/status.h"
#include "laminar/types.h"

namespace laminar {

enum class FinishReason : std::uint8_t {
  kStop = 0,    // end-of-sequence or a stop string
  kLength = 1,  // hit the token limit
  kAbort = 2,   // cancelled by the rollout side (e.g. a tool call failed)
  kError = 3,   // the engine failed; rewards are whatever the producer chose to assign
};
// "stop", "length", "abort", "error".
std::string_view finish_reason_name(FinishReason r) noexcept;

// Producer-side wall-clock instants (ns since the Unix epoch, or any epoch the producer uses
// consistently); the queue only checks that generation did not end before it started.
struct TrajectoryTimings {
  std::int64_t generation_start_ns = 0;
  std::int64_t generation_end_ns = 0;
  friend bool operator==(const TrajectoryTimings&, const TrajectoryTimings&) = default;
};

// One finished rollout sample.
struct Trajectory {
  TrajectoryId id;               // unique (see TrajectoryQueueOptions::id_dedup_window)
  PromptId prompt_id;
  GroupId group_id;              // GRPO group; unused when group_size == 1
  std::uint32_t group_size = 1;  // samples in the group (n); 1: not grouped
  std::uint32_t sample_index = 0;  // in [0, group_size), unique within the group
  Version version;               // policy version that generated every response token
  std::vector<std::int32_t> prompt_tokens;    // [num_prompt_tokens], token ids >= 0
  std::vector<std::int32_t> response_tokens;  // [num_response_tokens], token ids >= 0
  std::vector<float> logprobs;   // [num_response_tokens] behaviour log-prob of each response token
  std::vector<float> rewards;    // [num_rewards >= 1], finite
  FinishReason finish_reason = FinishReason::kStop;
  TrajectoryTimings timings;
  std::string metadata;          // a JSON object, or empty

  std::size_t num_tokens() const noexcept { return prompt_tokens.size() + response_tokens.size(); }
  friend bool operator==(const Trajectory&, const Trajectory&) = default;
};

// The checks push() applies that need no queue state. kInvalidArgument naming the field and the
// values when: logprobs and response_tokens differ in length; there is no reward; group_size is 0
// or sample_index >= group_size; generation ends before it starts; finish_reason is not a
// FinishReason. With `contents` (the default) also, reading the arrays the Trajectory points to,
// at O(tokens) cost: a token id is negative; a log-prob is not finite or above 1e-3 (a
// probability above 1, beyond rounding); a reward is not finite; metadata is not empty and not a
// JSON object.
Status validate_trajectory(const Trajectory& t, bool contents = true);

// The binary encoding used by the write-ahead log and by remote producers (little-endian, format
// 1): an 80-byte fixed header then the token, log-prob, reward and metadata arrays. encode appends
// to `out`. decode checks the header, that the arrays fill exactly `bytes` (a truncated or padded
// buffer is kDataLoss naming the field and its offset) and then validate_trajectory(t, contents):
// the log's replay passes false, as it brings back what a queue took, checked as that queue's
// validate_contents said.
void encode_trajectory(const Trajectory& t, std::string& out);
// The bytes encode_trajectory(t, ...) appends.
std::size_t encoded_trajectory_size(const Trajectory& t) noexcept;
Result<Trajectory> decode_trajectory(std::string_view bytes, bool contents = true);

}  // namespace laminar
