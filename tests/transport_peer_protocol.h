// transport_peer_protocol.h: what transport_multiprocess_test and its child transport_peer agree on:
// message types, the region content pattern, and the verify request.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

#include "laminar/status.h"
#include "laminar/transport.h"

namespace laminar::test_peer {

enum : MessageType {
  kEcho = 1,       // replies with the same message
  kRegion = 2,     // replies with the serialized RemoteRegion of the server's region
  kVerify = 3,     // body "seed offset length": replies "ok" or an error reply naming the first bad word
  kHang = 4,       // never replies
  kPeers = 5,      // replies with the number of distinct peers that sent kEcho
  kExit = 6,       // replies, then the server exits 0
  kDropped = 7,    // replies with the number of frames the server dropped for naming no connection
  kSpray = 8,      // replies, then sends the requester kSprayed messages until the connection ends
  kSprayed = 9,    // one-way, kSprayBytes, handled by nobody
  kReplaced = 10,  // replies with how many times the server's UCX worker was replaced
};

// What a spraying peer sends: one-way messages just under UCX's shared-memory segment (8 KiB), so
// most of a send is the copy into the receiver's FIFO slot, from kSprayThreads threads at once.
inline constexpr std::size_t kSprayBytes = 7000;
inline constexpr int kSprayThreads = 4;
// A spraying peer prints "SENT <n>" every this many messages: the test kills it between two lines.
inline constexpr int kSprayLineEvery = 500;

inline constexpr std::uint64_t kServerSeed = 0x5eed;
inline constexpr std::uint64_t kClientSeedBase = 0xc11e47;
inline constexpr std::size_t kClientSliceBytes = std::size_t{16} << 20;

inline std::uint64_t pattern_word(std::uint64_t seed, std::size_t word) {
  return seed ^ (word * 0x9e3779b97f4a7c15ull);
}

// Fills bytes (a multiple of 8, starting at byte `offset` of the pattern, a multiple of 8).
inline void fill_pattern(std::span<std::byte> bytes, std::uint64_t seed, std::size_t offset = 0) {
  const std::size_t words = bytes.size() / 8;
  for (std::size_t i = 0; i < words; ++i) {
    const std::uint64_t w = pattern_word(seed, offset / 8 + i);
    std::memcpy(bytes.data() + i * 8, &w, 8);
  }
}

inline Status check_pattern(std::span<const std::byte> bytes, std::uint64_t seed, std::size_t offset = 0) {
  const std::size_t words = bytes.size() / 8;
  for (std::size_t i = 0; i < words; ++i) {
    std::uint64_t w;
    std::memcpy(&w, bytes.data() + i * 8, 8);
    if (w != pattern_word(seed, offset / 8 + i)) {
      return data_loss("pattern mismatch at byte " + std::to_string(offset + i * 8) + " of seed " +
                       std::to_string(seed));
    }
  }
  return ok_status();
}

struct VerifyRequest {
  std::uint64_t seed = 0;
  std::size_t offset = 0;
  std::size_t length = 0;

  std::string to_string() const {
    return std::to_string(seed) + " " + std::to_string(offset) + " " + std::to_string(length);
  }
  static Result<VerifyRequest> parse(std::string_view text) {
    VerifyRequest v;
    unsigned long long s = 0, o = 0, l = 0;
    const std::string t(text);
    if (std::sscanf(t.c_str(), "%llu %llu %llu", &s, &o, &l) != 3) {
      return invalid_argument("verify request '" + t + "' is not 'seed offset length'");
    }
    v.seed = s;
    v.offset = o;
    v.length = l;
    return v;
  }
};

}  // namespace laminar::test_peer
