// bootstrap_wire.h (internal): the frames of a Transport's bootstrap connection, and their encoding.
//
// A connection starts on a plain TCP socket of laminar's own (handshake.cc): the mutual HMAC
// handshake, then the exchange of UCX worker addresses and connection tokens. These frames are the
// first bytes laminar reads from a peer nobody has authenticated yet, so the decoder is small,
// bounded and fuzzed (tests/fuzz/bootstrap_wire_fuzz.cc): a frame is a u32 length (at most
// kMaxBootstrapFrameBytes) and a body of version, kind and that kind's fields, all read through
// ByteReader.
//
//   client                                        server
//   Hello {nonce}                          ->
//                                          <-     Challenge {nonce, server proof, server addresses}
//   Proof {client proof, token, worker address, client addresses} ->
//                                          <-     Welcome {token, worker address}   (or Refused {code, reason})
//   Ready {}                               ->
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "laminar/status.h"
#include "transport/listen_socket.h"

namespace laminar::internal {

// 2: a refusal says whether the same connection may be accepted later.
inline constexpr std::uint8_t kBootstrapVersion = 2;
// Largest frame body; also the most a connection buffers before it is authenticated.
inline constexpr std::size_t kMaxBootstrapFrameBytes = 4096;
inline constexpr std::size_t kBootstrapNonceBytes = 32;
inline constexpr std::size_t kBootstrapMacBytes = 32;
// Addresses a peer may list as its own (what the filter on UCX's listening sockets admits).
inline constexpr std::size_t kMaxPeerAddresses = 32;
inline constexpr std::size_t kMaxRefusalBytes = 512;
// Largest UCX worker address a frame carries (one with several RDMA devices is under 1 KiB).
inline constexpr std::size_t kMaxWorkerAddressBytes = 3072;

enum class BootstrapKind : std::uint8_t {
  kHello = 1,  // client -> server: client nonce
  kChallenge,  // server -> client: server nonce, server's proof, server's addresses
  kProof,      // client -> server: client's proof, client's token, worker address and addresses
  kWelcome,    // server -> client: server's token and worker address
  kReady,      // client -> server: the client's UCX endpoint exists; the connection is open
  kRefused,    // server -> client: why the connection was refused
};

struct BootstrapFrame {
  BootstrapKind kind = BootstrapKind::kHello;
  std::array<std::byte, kBootstrapNonceBytes> nonce{};  // kHello, kChallenge
  std::array<std::byte, kBootstrapMacBytes> mac{};      // kChallenge, kProof
  // kProof, kWelcome: the token the sender expects in the UCX header of every frame sent to it.
  std::uint64_t token = 0;
  std::vector<std::byte> worker_address;  // kProof, kWelcome: ucp_worker_get_address's bytes
  std::vector<IpAddress> addresses;       // kChallenge, kProof: the sender's own IP addresses
  std::string reason;                     // kRefused
  // kRefused: kUnavailable when the server may accept the same connection later (its UCX could not
  // reach the client's worker yet), kFailedPrecondition otherwise (a wrong token, a malformed
  // handshake); any other code is malformed.
  StatusCode code = StatusCode::kFailedPrecondition;
};

// The frame with its u32 length in front.
// Precondition: the frame fits (worker address and reason within the limits above).
std::vector<std::byte> encode_bootstrap_frame(const BootstrapFrame& frame);

// Takes the first complete frame off the front of `buffer` (bytes read from the socket so far):
// nullopt while the frame is incomplete. kDataLoss names the field and offset of a malformed frame,
// or a length over kMaxBootstrapFrameBytes; the connection cannot continue after an error.
Result<std::optional<BootstrapFrame>> take_bootstrap_frame(std::vector<std::byte>& buffer);

}  // namespace laminar::internal
