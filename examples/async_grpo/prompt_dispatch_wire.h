// prompt_dispatch_wire.h: the two message bodies a PromptClient and a PromptServer exchange
// (prompt_dispatch.h), kept apart so the decoders, which read bytes from a peer, are tested
// without a transport.
//
// Layouts, all little-endian, with no padding:
//   request: u32 magic "GPQ1", u32 worker, u64 version, u32 free_slots, u32 held count; then
//            `held count` u64 trajectory ids
//   grant:   u32 magic "GPG1", u8 GrantKind, u64 pull_version, u32 sample count; then per sample
//            u64 trajectory id, u64 prompt_index, u32 sample_index, u64 seed; then u32 count and
//            that many u64 ids the worker may drop (completed already)
// Decoders answer kDataLoss for bytes that are truncated, left over or of another magic, and
// kInvalidArgument for a count above the caller's limit or a kind no server sends; they check a
// count against the bytes left before allocating for it.
//
//   std::vector<std::byte> body = encode_prompt_request(request);
//   laminar::Result<PromptRequest> back = decode_prompt_request(body, /*max_held=*/1024);
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "laminar/status.h"
#include "laminar/transport.h"
#include "laminar/types.h"

namespace async_grpo {

// The one application message type of the dispatch protocol: a request, answered with a grant.
// Below laminar::kLaminarMessageTypeFirst, as every application type is.
inline constexpr laminar::MessageType kPromptRequestMessage = 0x4750'0001u;

struct PromptRequest {
  laminar::WorkerId worker;
  laminar::Version version;  // the weights the worker decodes with
  std::uint32_t free_slots = 0;
  std::vector<laminar::TrajectoryId> held;  // the samples the worker decodes now
};

// One sample of one group: prompt `prompt_index` of the task's prompt stream, sample
// `sample_index` of its group, decoded with sampling seed `seed`.
struct Sample {
  laminar::TrajectoryId id;
  std::uint64_t prompt_index = 0;
  std::uint32_t sample_index = 0;
  std::uint64_t seed = 0;

  friend bool operator==(const Sample&, const Sample&) = default;
};

enum class GrantKind : std::uint8_t {
  kWork = 0,       // `samples` holds the work (at least one sample)
  kPullNewer = 1,  // there is work, for weights of pull_version or newer: pull them, then ask again
  kNothing = 2,    // no work this worker may take now; ask again later
};

struct Grant {
  GrantKind kind = GrantKind::kNothing;
  laminar::Version pull_version;  // kPullNewer only
  std::vector<Sample> samples;    // kWork only
  // Ids of the request's held list that are completed already (another worker finished them):
  // decoding them further is wasted.
  std::vector<laminar::TrajectoryId> drop;
};

inline constexpr std::size_t kPromptRequestHeaderBytes = 24;
inline constexpr std::size_t kGrantHeaderBytes = 17;
inline constexpr std::size_t kGrantSampleBytes = 28;

std::vector<std::byte> encode_prompt_request(const PromptRequest& request);
laminar::Result<PromptRequest> decode_prompt_request(std::span<const std::byte> body, std::size_t max_held);

std::vector<std::byte> encode_grant(const Grant& grant);
// max_samples: the free slots asked for; max_drop: the ids held.
laminar::Result<Grant> decode_grant(std::span<const std::byte> body, std::size_t max_samples,
                                    std::size_t max_drop);

}  // namespace async_grpo
