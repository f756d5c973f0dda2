#include "agent/data_path.h"

#include "base/format.h"
#include "base/status_macros.h"
#include "fmt/format.h"

namespace kvagent::agent {

std::string_view RouteName(Route route) {
  switch (route) {
    case Route::kHostCopy:
      return "host-copy";
    case Route::kDeviceCopy:
      return "device-copy";
    case Route::kUcxRma:
      return "ucx-rma";
    case Route::kStagedChunks:
      return "staged-chunks";
    case Route::kStagedBounce:
      return "staged-bounce";
    case Route::kStagedRemoteRead:
      return "staged-remote-read";
    case Route::kAmWrite:
      return "am-write";
    case Route::kAmRead:
      return "am-read";
  }
  return "?";
}

bool IsStaged(Route route) {
  return route == Route::kStagedChunks || route == Route::kStagedBounce ||
         route == Route::kStagedRemoteRead || route == Route::kAmWrite ||
         route == Route::kAmRead;
}

// The route table, per op, first row that applies:
//   the peer's region is `staged` (VRAM UCX cannot reach)               -> staged chunks
//                                                                           or remote read
//   the peer's region is mapped here (same host, shm-direct), a side VRAM -> device copy
//   the peer's region is mapped here, both sides host memory            -> host copy
//   the endpoint has no native RMA and the peer takes our messages      -> am write/read
//   our region is `staged`                                              -> staged bounce
//   a side is VRAM and the running UCX cannot move CUDA memory          -> refused
//   otherwise                                                           -> UCX RMA
absl::StatusOr<std::vector<Route>> RouteOps(const std::string& transfer_id, v1::TransferOp op,
                                            const planning::TransferPlan& plan,
                                            const PeerSnapshot& peer, bool stager, bool ucx_cuda) {
  std::vector<StagedRoute> staged;
  if (stager) {
    ASSIGN_OR_RETURN(staged, Stager::Route(transfer_id, op, plan, peer));
  }
  const bool am = stager && peer.am_data;
  std::vector<Route> routes(plan.ops.size(), Route::kUcxRma);
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const auto& o = plan.ops[i];
    const StagedRoute s = staged.empty() ? StagedRoute::kNone : staged[i];
    const bool device = o.local_device || o.remote_device;
    if (s == StagedRoute::kChunks) {
      routes[i] = Route::kStagedChunks;
    } else if (s == StagedRoute::kRemoteRead) {
      routes[i] = Route::kStagedRemoteRead;
    } else if (peer.direct != nullptr && peer.direct->base_by_slot[o.rkey_slot] != nullptr) {
      routes[i] = device ? Route::kDeviceCopy : Route::kHostCopy;
    } else if (am) {
      routes[i] = op == v1::READ ? Route::kAmRead : Route::kAmWrite;
    } else if (s == StagedRoute::kBounce) {
      routes[i] = Route::kStagedBounce;
    } else if (device && !ucx_cuda) {
      const auto& r = peer.catalog->regions()[o.rkey_slot];
      return absl::FailedPreconditionError(fmt::format(
          "transfer '{}' segment {}: {} VRAM, and the running UCX cannot move CUDA memory while "
          "peer '{}' region '{}' cannot be reached directly (same-host CUDA IPC or shared "
          "memory) nor through host staging{}. Use a CUDA-enabled UCX, or place both agents on "
          "one host",
          transfer_id, o.segment, o.local_device ? "the local side is" : "the peer's side is",
          peer.name, r.name,
          !stager ? " (this engine has none)" : " (the peer's region is registered for zero-copy)"));
    }
  }
  return routes;
}

absl::Status PostingFailed(const DataBatch& batch, int32_t segment, const absl::Status& cause) {
  return absl::Status(cause.code(),
                      fmt::format("transfer '{}' segment {}: posting to peer '{}' failed: {}",
                                  batch.transfer_id, segment, batch.peer_name, cause.message()));
}

}  // namespace kvagent::agent
