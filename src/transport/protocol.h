// protocol.h (internal): the message types of laminar's own protocols and the entry points through
// which laminar's components use them.
//
// The public Transport and Endpoint calls refuse types at or above kLaminarMessageTypeFirst, so an
// application cannot collide with a protocol laminar runs on the same Transport. laminar's
// components register and send their types through these functions instead, which in turn accept
// reserved types only. Every protocol's types are listed here, so no two protocols share one.
#pragma once

#include <functional>
#include <future>
#include <optional>

#include "laminar/clock.h"
#include "laminar/status.h"
#include "laminar/transport.h"

namespace laminar::internal {

// Relay chain (relay_node.cc): 0xF000'01xx.
inline constexpr MessageType kRelaySubscribeMessage = kLaminarMessageTypeFirst + 0x0101;
inline constexpr MessageType kRelayBeginMessage = kLaminarMessageTypeFirst + 0x0102;
inline constexpr MessageType kRelayChunkMessage = kLaminarMessageTypeFirst + 0x0103;
inline constexpr MessageType kRelayIdleMessage = kLaminarMessageTypeFirst + 0x0104;
// Remote trajectory queue (remote_trajectory_queue.cc): 0xF000'02xx.
inline constexpr MessageType kQueueHelloMessage = kLaminarMessageTypeFirst + 0x0201;
inline constexpr MessageType kQueuePushMessage = kLaminarMessageTypeFirst + 0x0202;
inline constexpr MessageType kQueuePushManyMessage = kLaminarMessageTypeFirst + 0x0203;
inline constexpr MessageType kQueuePingMessage = kLaminarMessageTypeFirst + 0x0204;
// KV migration (kv_migration_wire.h): 0xF000'03xx.
// Source offers sequences; the answer is the destination's reservation.
inline constexpr MessageType kMigrationOfferMessage = kLaminarMessageTypeFirst + 0x0301;
// Source sends the checksums of pages it put, and with the final stage the sequences' states; the
// answer to the final stage is the destination's commit.
inline constexpr MessageType kMigrationStageMessage = kLaminarMessageTypeFirst + 0x0302;
// Either side gives the migration up.
inline constexpr MessageType kMigrationAbortMessage = kLaminarMessageTypeFirst + 0x0303;
// Repack (repack_wire.h): 0xF000'04xx, both one-way.
// A worker's snapshot, to the coordinator.
inline constexpr MessageType kRepackReportMessage = kLaminarMessageTypeFirst + 0x0401;
// A source worker's part of a plan, to that worker.
inline constexpr MessageType kRepackOrdersMessage = kLaminarMessageTypeFirst + 0x0402;
// Rollout dispatch (rollout_dispatch_wire.h): 0xF000'05xx.
// A worker's request; the answer is its grant, at once or when there is work for it.
inline constexpr MessageType kDispatchRequestMessage = kLaminarMessageTypeFirst + 0x0501;

// As Transport::on_message, for a type in the reserved range (else kInvalidArgument).
[[nodiscard]] Status on_protocol_message(Transport& transport, MessageType type, MessageHandler handler);
// As Endpoint::send / request / request_async, for a type in the reserved range (else
// kInvalidArgument).
[[nodiscard]] Status send_protocol(Endpoint& endpoint, const Message& message,
                                   std::optional<Duration> timeout = std::nullopt);
Result<Message> request_protocol(Endpoint& endpoint, const Message& message,
                                 std::optional<Duration> timeout = std::nullopt);
std::future<Result<Message>> request_protocol_async(Endpoint& endpoint, const Message& message,
                                                    std::optional<Duration> timeout = std::nullopt);
// As above, and runs `answered` once the future is ready, so that a waiter can block on its own
// condition variable (and its Clock) instead of on the future. It runs on the transport's progress
// thread, or on the calling one for a request refused at once, and may only wake a waiter.
std::future<Result<Message>> request_protocol_async(Endpoint& endpoint, const Message& message,
                                                    std::optional<Duration> timeout,
                                                    std::function<void()> answered);

}  // namespace laminar::internal
