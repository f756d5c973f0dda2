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
};
inline constexpr uint16_t Wire(AmId id) { return static_cast<uint16_t>(id); }
inline std::string_view AmName(AmId id) {
  switch (id) {
    case AmId::kNotification: return "notification";
    case AmId::kStagedChunk: return "staged chunk";
    case AmId::kStagedReadRequest: return "staged read request";
    case AmId::kStagedReadReply: return "staged read reply";
    case AmId::kTransferAck: return "transfer acknowledgement";
  }
  return "unknown message";
}

}  // namespace kvagent::agent
