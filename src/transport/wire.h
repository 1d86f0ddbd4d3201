// wire.h (internal): the frames laminar's transport exchanges, and their CBOR encoding.
//
// Every UCP active message laminar sends carries exactly one frame: a CBOR map (RFC 8949, written
// and read by wire.cc itself) with a format version, a kind, and the fields that kind needs. Message bodies carry an
// XXH3 checksum so a corrupted body is caught even when the CBOR around it still parses. The
// decoder is the one place untrusted bytes from a peer are parsed; it is fuzzed
// (tests/fuzz/transport_wire_fuzz.cc) and never throws.
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

inline constexpr std::uint32_t kWireVersion = 1;
inline constexpr std::size_t kNonceBytes = 32;
inline constexpr std::size_t kMacBytes = 32;
// Longest error text a peer may send in an error reply or refusal.
inline constexpr std::size_t kMaxErrorTextBytes = 1024;
// Bytes a frame may carry beyond its body (map keys, integers, checksum, error text).
inline constexpr std::size_t kFrameOverheadBytes = 256 + kMaxErrorTextBytes;

enum class FrameKind : std::uint8_t {
  kHello = 1,   // client -> server: client nonce
  kChallenge,   // server -> client: server nonce + server's proof
  kProof,       // client -> server: client's proof
  kWelcome,     // server -> client: authenticated
  kRefused,     // server -> client: authentication failed (error text)
  kMessage,     // one-way application message
  kRequest,     // application message awaiting a reply (id)
  kReply,       // answer to request id
  kErrorReply,  // request id failed with a Status (code + error text)
};
inline constexpr std::uint8_t kMaxFrameKind = static_cast<std::uint8_t>(FrameKind::kErrorReply);

struct Frame {
  FrameKind kind = FrameKind::kMessage;
  MessageType type = 0;               // kMessage, kRequest, kReply
  std::uint64_t id = 0;               // kRequest, kReply, kErrorReply: non-zero request id
  std::vector<std::byte> body;        // message body; nonce (kHello, kChallenge); proof (kProof)
  std::vector<std::byte> mac;         // kChallenge: the server's proof
  StatusCode code = StatusCode::kOk;  // kErrorReply: not kOk
  std::string error;                  // kErrorReply, kRefused
};

std::vector<std::byte> encode_frame(const Frame& frame);

// Validates everything: kInvalidArgument when the frame or its body is larger than allowed
// (max_body_bytes), kDataLoss for anything truncated, corrupt, of another version, missing a
// field, with a field of the wrong type or size, or failing its checksum. Messages name the field.
Result<Frame> decode_frame(std::span<const std::byte> wire, std::size_t max_body_bytes);

}  // namespace laminar::internal
