// relay_node_wire.h (private to src/): the bodies of the relay protocol's messages between
// RelayNodes (relay_node.cc), encoded and decoded apart from any transport so that a fuzz target
// (tests/fuzz/relay_node_decode_fuzz.cc) can reach every decoder.
//
// Little-endian, on ByteWriter / ByteReader (byte_codec.h):
//   subscribe   downstream -> upstream   u8 has, u64 newest committed (0 unless has), u64 idle_every_ns
//   begin       upstream -> downstream   u64 version, u64 chunk_bytes, manifest JSON (the rest)
//   begin reply downstream -> upstream   u32 n, u32 missing[n] (ascending), RemoteRegion (the rest)
//   chunk       upstream -> downstream   u64 version, u32 index, u64 xxh3 (after chunk index landed)
//   idle        upstream -> downstream   (empty) nothing to send yet; the upstream is still there
//
// A decoder accepts exactly what its encoder writes: anything else is kDataLoss naming the
// message, the field and its offset. What the fields mean (a manifest that parses, a region the
// transport accepts, indices within the version's plan) is for the node to check.
//
//   std::vector<std::byte> body = encode_relay_chunk({Version(3), 7, checksum});
//   Result<RelayChunk> c = decode_relay_chunk(body);   // c->index == 7
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "laminar/status.h"
#include "laminar/types.h"

namespace laminar::internal {

struct RelaySubscribe {
  std::optional<Version> have;  // the subscriber's newest committed version
  // How often the subscriber wants an idle message while the upstream has nothing to send it, in
  // ns; 0: never. The upstream reads it as a request, not an order (relay_node.cc bounds it).
  std::uint64_t idle_every_ns = 0;
  friend bool operator==(const RelaySubscribe&, const RelaySubscribe&) = default;
};

struct RelayBegin {
  Version version;
  std::uint64_t chunk_bytes = 0;
  std::string manifest_json;
  friend bool operator==(const RelayBegin&, const RelayBegin&) = default;
};

struct RelayBeginReply {
  std::vector<std::uint32_t> missing;  // chunks the subscriber lacks, ascending
  std::vector<std::byte> region;       // RemoteRegion::serialize() of the subscriber's buffer
  friend bool operator==(const RelayBeginReply&, const RelayBeginReply&) = default;
};

struct RelayChunk {
  Version version;
  std::uint32_t index = 0;
  std::uint64_t checksum = 0;
  friend bool operator==(const RelayChunk&, const RelayChunk&) = default;
};

// No fields: the body is empty.
struct RelayIdle {
  friend bool operator==(const RelayIdle&, const RelayIdle&) = default;
};

std::vector<std::byte> encode_relay_subscribe(const RelaySubscribe& m);
Result<RelaySubscribe> decode_relay_subscribe(std::span<const std::byte> body);

std::vector<std::byte> encode_relay_begin(const RelayBegin& m);
Result<RelayBegin> decode_relay_begin(std::span<const std::byte> body);

// Precondition: m.missing.size() fits in a u32.
std::vector<std::byte> encode_relay_begin_reply(const RelayBeginReply& m);
Result<RelayBeginReply> decode_relay_begin_reply(std::span<const std::byte> body);

std::vector<std::byte> encode_relay_chunk(const RelayChunk& m);
Result<RelayChunk> decode_relay_chunk(std::span<const std::byte> body);

std::vector<std::byte> encode_relay_idle(const RelayIdle& m);
Result<RelayIdle> decode_relay_idle(std::span<const std::byte> body);

}  // namespace laminar::internal
