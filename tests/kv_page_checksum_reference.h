// kv_page_checksum_reference.h: the KV page checksum of cuda/kv_page_checksum.cuh written from its
// definition, one word after another, on the host: what the emulated and the device kernel are
// checked against.
#pragma once

#include <cstddef>
#include <cstdint>

namespace laminar::testing {

inline std::uint64_t reference_mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// k and v: host copies of the pools, [layers, num_pages, page_bytes] bytes.
inline std::uint64_t reference_page_checksum(const unsigned char* k, const unsigned char* v, std::int64_t num_pages,
                                             std::int64_t page_bytes, std::int32_t layers, std::int32_t page) {
  const std::int64_t words = (page_bytes + 3) / 4;
  std::uint64_t sum = 0;
  for (std::int64_t seg = 0; seg < 2 * layers; ++seg) {
    const unsigned char* pool = seg < layers ? k : v;
    const std::size_t base = std::size_t(((seg % layers) * num_pages + page) * page_bytes);
    for (std::int64_t j = 0; j < words; ++j) {
      std::uint32_t w = 0;
      for (std::int64_t b = 0; b < 4 && 4 * j + b < page_bytes; ++b) {
        w |= std::uint32_t(pool[base + std::size_t(4 * j + b)]) << (8 * b);
      }
      sum += reference_mix64(reference_mix64(std::uint64_t(seg * words + j)) ^ w);
    }
  }
  return reference_mix64(sum ^ std::uint64_t(2 * layers * words));
}

}  // namespace laminar::testing
