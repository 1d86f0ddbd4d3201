#include "laminar/trajectory.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <span>

#include "byte_codec.h"

namespace laminar {

std::string_view finish_reason_name(FinishReason r) noexcept {
  switch (r) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
    case FinishReason::kError: return "error";
  }
  return "unknown";
}

namespace {

// A log-probability above 0 is a probability above 1; this much is allowed for rounding in
// the engine's softmax.
constexpr float kMaxLogprob = 1e-3f;

Status check_tokens(const std::vector<std::int32_t>& tokens, std::string_view field,
                    TrajectoryId id) {
  // Branch-free scan (vectorises); the slow path only runs to name the culprit.
  std::int32_t min_token = 0;
  for (std::int32_t tok : tokens) min_token = std::min(min_token, tok);
  if (min_token >= 0) return ok_status();
  const auto it = std::find_if(tokens.begin(), tokens.end(), [](std::int32_t x) { return x < 0; });
  return invalid_argument(fmt::format("trajectory {}: {}[{}] = {} is a negative token id", id.value(),
                                      field, it - tokens.begin(), *it));
}

}  // namespace

namespace {

// The O(tokens) part of validate_trajectory.
Status validate_contents(const Trajectory& t) {
  const std::uint64_t id = t.id.value();
  LAMINAR_RETURN_IF_ERROR(check_tokens(t.prompt_tokens, "prompt_tokens", t.id));
  LAMINAR_RETURN_IF_ERROR(check_tokens(t.response_tokens, "response_tokens", t.id));
  // One branch-free pass; the slow pass only runs to name the culprit.
  // On the bits, so it vectorises: an exponent of all ones is inf or NaN; as signed integers,
  // positive floats order like their values and negative ones are all below kMaxLogprob's.
  std::int32_t max_bits;
  std::memcpy(&max_bits, &kMaxLogprob, 4);
  std::uint32_t bad = 0;
  for (float lp : t.logprobs) {
    std::uint32_t b;
    std::memcpy(&b, &lp, 4);
    bad |= std::uint32_t((b & 0x7f800000u) == 0x7f800000u) | std::uint32_t(std::int32_t(b) > max_bits);
  }
  if (bad != 0) {
    for (std::size_t i = 0; i < t.logprobs.size(); ++i) {
      const float lp = t.logprobs[i];
      if (!std::isfinite(lp) || lp > kMaxLogprob) {
        return invalid_argument(fmt::format("trajectory {}: logprobs[{}] = {} is not a log-probability",
                                            id, i, lp));
      }
    }
  }
  if (!t.metadata.empty()) {
    const auto first = t.metadata.find_first_not_of(" \t\r\n");
    if (first == std::string::npos || t.metadata[first] != '{' ||
        !nlohmann::json::accept(t.metadata)) {
      return invalid_argument(fmt::format("trajectory {}: metadata is not a JSON object: '{}'", id,
                                          t.metadata.substr(0, 64)));
    }
  }
  return ok_status();
}

}  // namespace

namespace {

// validate_trajectory's checks that read only the Trajectory itself, not the arrays it points to.
Status validate_fields(const Trajectory& t) {
  const std::uint64_t id = t.id.value();
  if (t.logprobs.size() != t.response_tokens.size()) {
    return invalid_argument(fmt::format("trajectory {}: {} logprobs for {} response tokens", id,
                                        t.logprobs.size(), t.response_tokens.size()));
  }
  if (t.rewards.empty()) return invalid_argument(fmt::format("trajectory {}: no reward", id));
  if (t.group_size == 0) return invalid_argument(fmt::format("trajectory {}: group_size is 0", id));
  if (t.sample_index >= t.group_size) {
    return invalid_argument(fmt::format("trajectory {}: sample_index {} is not below group_size {}", id,
                                        t.sample_index, t.group_size));
  }
  if (t.timings.generation_end_ns < t.timings.generation_start_ns) {
    return invalid_argument(fmt::format("trajectory {}: generation ends at {} ns, before it starts at {} ns",
                                        id, t.timings.generation_end_ns,
                                        t.timings.generation_start_ns));
  }
  if (std::uint8_t(t.finish_reason) > std::uint8_t(FinishReason::kError)) {
    return invalid_argument(fmt::format("trajectory {}: finish_reason {} is not a FinishReason", id,
                                        int(t.finish_reason)));
  }
  return ok_status();
}

Status check_rewards(const Trajectory& t) {
  for (std::size_t i = 0; i < t.rewards.size(); ++i) {
    if (!std::isfinite(t.rewards[i])) {
      return invalid_argument(fmt::format("trajectory {}: rewards[{}] = {} is not finite", t.id.value(), i,
                                          t.rewards[i]));
    }
  }
  return ok_status();
}

}  // namespace

Status validate_trajectory(const Trajectory& t, bool contents) {
  LAMINAR_RETURN_IF_ERROR(validate_fields(t));
  if (!contents) return ok_status();
  LAMINAR_RETURN_IF_ERROR(validate_contents(t));
  return check_rewards(t);
}

// ---------------------------------------------------------------------------------------------
// Encoding.

namespace {

constexpr std::uint32_t kEncodingFormat = 1;
// format .. num_metadata, the fields before the arrays.
constexpr std::size_t kHeaderBytes = 80;

}  // namespace

std::size_t encoded_trajectory_size(const Trajectory& t) noexcept {
  return kHeaderBytes + 4 * (t.prompt_tokens.size() + 2 * t.response_tokens.size()) +
         4 * t.rewards.size() + t.metadata.size();
}

void encode_trajectory(const Trajectory& t, std::string& out) {
  internal::ByteWriter w(out);
  w.reserve(encoded_trajectory_size(t));
  w.u32(kEncodingFormat);
  w.u32(t.group_size);
  w.u64(t.id.value());
  w.u64(t.prompt_id.value());
  w.u64(t.group_id.value());
  w.u64(t.version.value());
  w.u32(t.sample_index);
  w.u8(std::uint8_t(t.finish_reason));
  w.bytes(std::string_view("\0\0\0", 3));  // aligns the timings to 8 bytes
  w.i64(t.timings.generation_start_ns);
  w.i64(t.timings.generation_end_ns);
  w.u32(std::uint32_t(t.prompt_tokens.size()));
  w.u32(std::uint32_t(t.response_tokens.size()));
  w.u32(std::uint32_t(t.rewards.size()));
  w.u32(std::uint32_t(t.metadata.size()));
  w.array(std::span(t.prompt_tokens));
  w.array(std::span(t.response_tokens));
  w.array(std::span(t.logprobs));
  w.array(std::span(t.rewards));
  w.bytes(t.metadata);
}

Result<Trajectory> decode_trajectory(std::string_view bytes, bool contents) {
  internal::ByteReader r(bytes, "encoded trajectory");
  const std::uint32_t format = r.u32("format");
  if (format != kEncodingFormat) r.fail(0, fmt::format("format {} (expected {})", format, kEncodingFormat));
  Trajectory t;
  t.group_size = r.u32("group_size");
  t.id = TrajectoryId(r.u64("id"));
  t.prompt_id = PromptId(r.u64("prompt_id"));
  t.group_id = GroupId(r.u64("group_id"));
  t.version = Version(r.u64("version"));
  t.sample_index = r.u32("sample_index");
  t.finish_reason = FinishReason(r.u8("finish_reason"));
  const std::size_t padding_at = r.offset();
  if (r.bytes("padding", 3) != std::string_view("\0\0\0", 3)) r.fail(padding_at, "nonzero padding");
  t.timings.generation_start_ns = r.i64("generation_start_ns");
  t.timings.generation_end_ns = r.i64("generation_end_ns");
  const std::uint32_t num_prompt = r.u32("num_prompt");
  const std::uint32_t num_response = r.u32("num_response");
  const std::uint32_t num_rewards = r.u32("num_rewards");
  const std::uint32_t num_metadata = r.u32("num_metadata");
  r.array("prompt_tokens", num_prompt, t.prompt_tokens);
  r.array("response_tokens", num_response, t.response_tokens);
  r.array("logprobs", num_response, t.logprobs);
  r.array("rewards", num_rewards, t.rewards);
  t.metadata = r.bytes("metadata", num_metadata);
  LAMINAR_RETURN_IF_ERROR(r.finish());
  Status st = validate_trajectory(t, contents);
  if (!st.ok()) return st.with_context("decoded trajectory");
  return t;
}

}  // namespace laminar
