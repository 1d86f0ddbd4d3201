#include "laminar/trajectory.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

namespace laminar {

static_assert(std::endian::native == std::endian::little,
              "the trajectory encoding is little-endian and copied as is");

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

struct EncodedHeader {
  std::uint32_t format;
  std::uint32_t group_size;
  std::uint64_t id;
  std::uint64_t prompt_id;
  std::uint64_t group_id;
  std::uint64_t version;
  std::uint32_t sample_index;
  std::uint8_t finish_reason;
  std::uint8_t pad[3];
  std::int64_t generation_start_ns;
  std::int64_t generation_end_ns;
  std::uint32_t num_prompt;
  std::uint32_t num_response;
  std::uint32_t num_rewards;
  std::uint32_t num_metadata;
};
static_assert(sizeof(EncodedHeader) == 80);

template <class T>
void append_array(std::string& out, const std::vector<T>& v) {
  out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

template <class T>
void read_array(const char*& p, std::size_t n, std::vector<T>& v) {
  v.resize(n);
  std::memcpy(v.data(), p, n * sizeof(T));
  p += n * sizeof(T);
}

}  // namespace

std::size_t encoded_trajectory_size(const Trajectory& t) noexcept {
  return sizeof(EncodedHeader) + 4 * (t.prompt_tokens.size() + 2 * t.response_tokens.size()) +
         4 * t.rewards.size() + t.metadata.size();
}

void encode_trajectory(const Trajectory& t, std::string& out) {
  EncodedHeader h{};
  h.format = kEncodingFormat;
  h.group_size = t.group_size;
  h.id = t.id.value();
  h.prompt_id = t.prompt_id;
  h.group_id = t.group_id;
  h.version = t.version.value();
  h.sample_index = t.sample_index;
  h.finish_reason = std::uint8_t(t.finish_reason);
  h.generation_start_ns = t.timings.generation_start_ns;
  h.generation_end_ns = t.timings.generation_end_ns;
  h.num_prompt = std::uint32_t(t.prompt_tokens.size());
  h.num_response = std::uint32_t(t.response_tokens.size());
  h.num_rewards = std::uint32_t(t.rewards.size());
  h.num_metadata = std::uint32_t(t.metadata.size());
  out.reserve(out.size() + encoded_trajectory_size(t));
  out.append(reinterpret_cast<const char*>(&h), sizeof(h));
  append_array(out, t.prompt_tokens);
  append_array(out, t.response_tokens);
  append_array(out, t.logprobs);
  append_array(out, t.rewards);
  out.append(t.metadata);
}

Result<Trajectory> decode_trajectory(std::string_view bytes) {
  if (bytes.size() < sizeof(EncodedHeader)) {
    return data_loss(fmt::format("encoded trajectory: {} bytes, shorter than its {}-byte header",
                                 bytes.size(), sizeof(EncodedHeader)));
  }
  EncodedHeader h;
  std::memcpy(&h, bytes.data(), sizeof(h));
  if (h.format != kEncodingFormat) {
    return data_loss(fmt::format("encoded trajectory: format {} (expected {})", h.format, kEncodingFormat));
  }
  if (h.pad[0] != 0 || h.pad[1] != 0 || h.pad[2] != 0) {
    return data_loss("encoded trajectory: nonzero padding bytes in the header");
  }
  const std::uint64_t want = sizeof(EncodedHeader) +
                             4 * (std::uint64_t(h.num_prompt) + 2 * std::uint64_t(h.num_response)) +
                             4 * std::uint64_t(h.num_rewards) + std::uint64_t(h.num_metadata);
  if (want != bytes.size()) {
    return data_loss(fmt::format("encoded trajectory {}: header describes {} bytes, buffer has {}", h.id,
                                 want, bytes.size()));
  }
  Trajectory t;
  t.id = TrajectoryId(h.id);
  t.prompt_id = h.prompt_id;
  t.group_id = h.group_id;
  t.group_size = h.group_size;
  t.sample_index = h.sample_index;
  t.version = Version(h.version);
  t.finish_reason = FinishReason(h.finish_reason);
  t.timings.generation_start_ns = h.generation_start_ns;
  t.timings.generation_end_ns = h.generation_end_ns;
  const char* p = bytes.data() + sizeof(EncodedHeader);
  read_array(p, h.num_prompt, t.prompt_tokens);
  read_array(p, h.num_response, t.response_tokens);
  read_array(p, h.num_response, t.logprobs);
  read_array(p, h.num_rewards, t.rewards);
  t.metadata.assign(p, h.num_metadata);
  Status st = validate_trajectory(t);
  if (!st.ok()) return st.with_context("decoded trajectory");
  return t;
}

}  // namespace laminar
