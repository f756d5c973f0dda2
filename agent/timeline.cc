#include "agent/timeline.h"

#include "base/log.h"
#include "base/text.h"
#include "fmt/format.h"

namespace kvagent::agent {
namespace {
constexpr log::Logger kLog("transfers");
constexpr size_t kMaxLabelIdBytes = 256;
}  // namespace

bool ReachedStage(const v1::TransferState& state, v1::TransferStage stage) {
  for (const auto& event : state.timeline()) {
    if (event.stage() == stage) return true;
  }
  return false;
}

void MarkStage(v1::TransferState& state, v1::TransferStage stage, uint64_t start_us,
               uint64_t now_us) {
  if (ReachedStage(state, stage)) return;
  const uint64_t at_us = now_us > start_us ? now_us - start_us : 0;
  v1::TransferEvent* event = state.add_timeline();
  event->set_stage(stage);
  event->set_at_us(at_us);
  if (log::GetLevel() <= log::Level::kDebug) {
    kLog.Debug("{} ({}, peer '{}'): {} at {} us", TransferLabel(state),
               state.direction() == v1::INCOMING ? "incoming" : "outgoing",
               Printable(state.peer(), kMaxLabelIdBytes), v1::TransferStage_Name(stage), at_us);
  }
}

std::string TransferLabel(const std::string& transfer_id, const std::string& request_id) {
  if (request_id.empty()) return fmt::format("transfer '{}'", Printable(transfer_id, kMaxLabelIdBytes));
  return fmt::format("transfer '{}' (request '{}')", Printable(transfer_id, kMaxLabelIdBytes),
                     Printable(request_id, kMaxLabelIdBytes));
}

}  // namespace kvagent::agent
