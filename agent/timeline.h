// A transfer's timeline (TransferState.timeline: the stages it reached and when) and
// the label every log line about a transfer starts with (its id and, when the engine
// gave one, its request id). Used by the TransferEngine (outgoing) and
// IncomingTransfers (the receiver's view).
#pragma once

#include <cstdint>
#include <string>

#include "proto/kvagent.pb.h"

namespace kvagent::agent {

// Appends `stage` at `now_us - start_us` (both monotonic) unless `state` reached it
// already, and logs it at debug level with the transfer's label.
void MarkStage(v1::TransferState& state, v1::TransferStage stage, uint64_t start_us,
               uint64_t now_us);
bool ReachedStage(const v1::TransferState& state, v1::TransferStage stage);

// "transfer 'ID'" or "transfer 'ID' (request 'R')", both escaped and bounded.
std::string TransferLabel(const std::string& transfer_id, const std::string& request_id);
inline std::string TransferLabel(const v1::TransferState& state) {
  return TransferLabel(state.transfer_id(), state.request_id());
}

}  // namespace kvagent::agent
