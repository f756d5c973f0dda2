// The UCX active-message ids agents send each other (both ends of a connection must
// agree). Senders use them directly; agent/inbox is the one place that registers a
// handler for each, and says who handles it.
#pragma once

#include <cstdint>
#include <string_view>

namespace kvagent::agent {

// The active-message ids between agents (both ends of a connection must agree).
enum class AmId : uint16_t {
  kNotification = 1,       // PeerMessageAuth + Notification: TransferEngine
  kStagedChunk = 2,        // StagedChunkHeader + the chunk's bytes: Stager
  kStagedReadRequest = 3,  // StagedReadRequest, header only, with a reply endpoint: Stager
  kStagedReadReply = 4,    // StagedReadReply + bytes, on the request's reply endpoint: Stager
  kTransferAck = 5,        // TransferAck, on DATA_READY's reply endpoint: TransferEngine
  kNoticeBatch = 6,        // PeerMessageAuth + NoticeBatch: TransferEngine, per entry
  kAckBatch = 7,           // TransferAckBatch, on a NoticeBatch's reply endpoint: TransferEngine
  kPing = 8,               // EndpointPing, header only, with a reply endpoint: EndpointPings
  kPong = 9,               // EndpointPing echoed, on the ping's reply endpoint: EndpointPings
};
inline constexpr uint16_t kMaxAmId = 9;
inline constexpr uint16_t Wire(AmId id) { return static_cast<uint16_t>(id); }
inline std::string_view AmName(AmId id) {
  switch (id) {
    case AmId::kNotification: return "notification";
    case AmId::kStagedChunk: return "staged chunk";
    case AmId::kStagedReadRequest: return "staged read request";
    case AmId::kStagedReadReply: return "staged read reply";
    case AmId::kTransferAck: return "transfer acknowledgement";
    case AmId::kNoticeBatch: return "notification batch";
    case AmId::kAckBatch: return "acknowledgement batch";
    case AmId::kPing: return "ping";
    case AmId::kPong: return "pong";
  }
  return "unknown message";
}

// AgentMetadata.wire_features: what this agent's inbox takes beyond ids 1-5. A sender
// uses a feature only with a peer whose metadata announces it, so agents of different
// builds still meet (an older one announces nothing and gets single messages).
inline constexpr uint32_t kWireBatches = 1u << 0;  // ids 6 and 7
// Staged chunks (id 2) and read requests (id 3) for any region of this agent, not only
// its staged ones, and read replies sent eager when the request asks: the data path
// over active messages for endpoints without native RMA (Route::kAmWrite, kAmRead).
inline constexpr uint32_t kWireAmData = 1u << 1;
// A DATA_READY carrying timeout_ms (and op) also opens its transfer, as the
// PEER_TRANSFER_OPEN it replaces would: a same-host copy's open, due after the copy, goes
// inside the DATA_READY that follows it in the same round (one notice fewer).
inline constexpr uint32_t kWireOpenInDataReady = 1u << 2;
// A DATA_READY with `committed` (a transfer completed when placed) is delivered once it is
// acknowledged, without the PEER_DATA_COMMIT that went beside it (one notice fewer).
inline constexpr uint32_t kWireCommitInDataReady = 1u << 3;
// Ids 8 and 9: a ping over a new endpoint is answered by a pong over the ping's reply
// endpoint, so the connecting agent learns that the peer's UCX reaches it back before
// it calls the peer connected (EndpointPings).
inline constexpr uint32_t kWirePing = 1u << 4;
inline constexpr uint32_t kWireFeatures = kWireBatches | kWireAmData | kWireOpenInDataReady |
                                          kWireCommitInDataReady | kWirePing;
// The bounds of a batch (both the sender's and the receiver's): entries, and bytes of
// the NoticeBatch. A notification larger than kMaxBatchedNoticeBytes goes alone (id 1).
inline constexpr uint32_t kMaxBatchEntries = 1024;
inline constexpr uint64_t kMaxBatchBytes = 1 << 20;
inline constexpr uint64_t kMaxBatchedNoticeBytes = 16 << 10;

}  // namespace kvagent::agent
