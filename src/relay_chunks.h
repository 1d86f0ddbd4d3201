// relay_chunks.h: the check of a version's chunks against their checksums, shared by the relay
// store (ReadHandle::verify, sealing, chunks from upstream) and the puller (verify_checksums).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "laminar/relay_versions.h"
#include "laminar/status.h"
#include "laminar/types.h"

namespace laminar::internal {

// xxh3 of chunk i of `buffer` [plan.total_bytes()].
std::uint64_t chunk_checksum(const ChunkPlan& plan, const std::byte* buffer, std::uint32_t i);

// kDataLoss naming version v and the first chunk of [first, last) whose bytes do not hash to
// checksums[i]. Preconditions: first <= last <= plan.num_chunks() == checksums.size().
Status verify_chunks(Version v, const ChunkPlan& plan, const std::byte* buffer,
                     std::span<const std::uint64_t> checksums, std::uint32_t first, std::uint32_t last);

}  // namespace laminar::internal
