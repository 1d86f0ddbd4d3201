// wire.h (internal): the frames laminar's transport exchanges, and their encoding.
//
// Every UCP active message laminar sends carries exactly one frame, written with ByteWriter and
// read with ByteReader (byte_codec.h), all little-endian: a u8 format version (kWireVersion), a u8
// FrameKind, then that kind's fields:
//   kMessage:         u32 message type, u64 XXH3 of the body, u64 length, body
//   kRequest, kReply: u64 request id (not 0), then as kMessage
//   kErrorReply:      u64 request id (not 0), u8 StatusCode (not kOk), u32 length, error text
// The body's checksum catches a corrupted body even where the fields around it still read. A
// RemoteRegion (serialize / deserialize) is a u8 version, u64 address, u64 size, u32 length and the
// packed remote key. The decoders are where the transport parses untrusted bytes from a peer; they
// are fuzzed (tests/fuzz/transport_wire_fuzz.cc) and never throw.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "laminar/status.h"
#include "laminar/transport.h"

namespace laminar::internal {

// 1 was a CBOR map, 2 also carried the handshake (now on the bootstrap socket); a peer of another
// version is refused at its first frame.
inline constexpr std::uint8_t kWireVersion = 3;
// Longest error text a peer may send in an error reply.
inline constexpr std::size_t kMaxErrorTextBytes = 1024;
// Bytes a frame may carry beyond its body (its fields and error text), with room to spare.
inline constexpr std::size_t kFrameOverheadBytes = 256 + kMaxErrorTextBytes;

enum class FrameKind : std::uint8_t {
  kMessage = 1,  // one-way application message
  kRequest,     // application message awaiting a reply (id)
  kReply,       // answer to request id
  kErrorReply,  // request id failed with a Status (code + error text)
};
inline constexpr std::uint8_t kMaxFrameKind = static_cast<std::uint8_t>(FrameKind::kErrorReply);

struct Frame {
  FrameKind kind = FrameKind::kMessage;
  MessageType type = 0;               // kMessage, kRequest, kReply
  std::uint64_t id = 0;               // kRequest, kReply, kErrorReply: non-zero request id
  std::vector<std::byte> body;        // message body
  StatusCode code = StatusCode::kOk;  // kErrorReply: not kOk
  std::string error;                  // kErrorReply
};

std::vector<std::byte> encode_frame(const Frame& frame);

// Validates everything: kInvalidArgument when the frame or its body is larger than allowed
// (max_body_bytes), kDataLoss for anything truncated, of another version or kind, with a field out
// of range, failing its checksum, or with bytes left over. Messages name the field and its offset.
Result<Frame> decode_frame(std::span<const std::byte> wire, std::size_t max_body_bytes);

}  // namespace laminar::internal
