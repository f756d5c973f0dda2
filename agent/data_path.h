// DataPath: one way bytes move between this agent's memory and a peer's. The
// transfer engine routes every planned operation once, at submit (RouteOps, the route
// table below), and its Pump hands each batch (consecutive operations of one route)
// to that route's path, which moves it and calls back once nothing of it can still
// touch either side's memory. A new way to move bytes (multi-rail, RDMA, another GPU
// copy engine) is one new file in agent/paths/, one Route and one row in RouteOps.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "agent/copy_lanes.h"
#include "agent/peer_snapshot.h"
#include "agent/staging.h"
#include "planning/transfer_plan.h"
#include "proto/kvagent.pb.h"

namespace kvagent::agent {

enum class Route : uint8_t {
  kHostCopy = 0,      // same host, host memory on both sides: memcpy into the peer's
                      // memory mapped here, split across copy lanes
  kDeviceCopy = 1,    // same host, VRAM on either side mapped here (CUDA IPC or VMM): one
                      // cuMemcpyBatchAsync, gather kernel launch or cuMemcpyAsync per
                      // page on one stream (agent/gpu/device_batch.h), one sync per batch
  kUcxRma = 2,        // UCX put/get, one flush per batch
  kStagedChunks = 3,  // host staging (agent/staging): WRITE into the peer's staged memory
  kStagedBounce = 4,  //   our memory is staged, the peer's is RMA-reachable
  kStagedRemoteRead = 5,  // READ of the peer's staged memory
  // The endpoint has no native RMA (tcp: UCX would emulate put and get with messages
  // whose failure aborts the process, Endpoint::NativeRma) and the peer takes our own
  // (PeerSnapshot::am_data): the Stager's protocol for every op, eager messages only.
  kAmWrite = 6,  // chunks through a bounce buffer; the peer checks and copies them in
  kAmRead = 7,   // read requests; the peer checks, copies out and replies
};
inline constexpr size_t kRouteCount = 8;
std::string_view RouteName(Route route);
bool IsStaged(Route route);

// The route table: how each op of `plan` moves (RouteOps's comment in data_path.cc has
// the rows). FAILED_PRECONDITION, naming the op's segment and the peer's region, when
// an op touches VRAM that nothing here can reach. `stager`: host staging is there (the
// active-message routes need it too).
absl::StatusOr<std::vector<Route>> RouteOps(const std::string& transfer_id, v1::TransferOp op,
                                            const planning::TransferPlan& plan,
                                            const PeerSnapshot& peer, bool stager, bool ucx_cuda);

// One batch of one route.
struct DataBatch {
  std::string transfer_id;
  std::string peer_name;
  v1::TransferOp op = v1::WRITE;
  Route route = Route::kUcxRma;
  std::vector<planning::PlanOp> ops;
  uint64_t bytes = 0;
  std::shared_ptr<const PeerSnapshot> peer;  // the view the ops were planned against
  // True once the transfer stopped (cancel, deadline, lost peer); polled by paths that
  // run a batch in steps (staging): no new step starts after it turns true. A path that
  // is not staging may call it only until the batch's done (what it reads may be gone
  // after); staging's may be called later (it holds the transfer).
  std::function<bool()> stopped;
};

// How a batch ended: OK when every byte moved; else the error, its text naming the
// transfer, the segment, the peer and the cause, and the segment it failed in.
struct BatchOutcome {
  absl::Status status;
  int32_t failed_segment = -1;
};
using BatchDone = std::function<void(BatchOutcome)>;

class DataPath {
 public:
  virtual ~DataPath() = default;
  // Worker thread. `batch` stays valid until `done`, which runs once (possibly before
  // Run returns), when nothing of the batch can still touch either side's memory.
  virtual void Run(const DataBatch& batch, BatchDone done) = 0;
};

// One implementation per way (agent/paths/*.cc).
std::unique_ptr<DataPath> MakeHostCopyPath(CopyLanes* lanes);
std::unique_ptr<DataPath> MakeDeviceCopyPath(uint32_t lanes);
std::unique_ptr<DataPath> MakeUcxRmaPath();
std::unique_ptr<DataPath> MakeStagingPath(Stager* stager);

// How the device copy path moves pages on this host, for GetStatus, ListPeers and
// doctor: the mechanism chosen for this process (agent/gpu/device_batch.h:
// "cuMemcpyBatchAsync per batch", "gather kernel per batch (sm_90 cubin)",
// "cuMemcpyAsync per page", with why when forced or when a better one is missing), or
// "none (no CUDA driver)", naming a forced choice. `cuda_driver` (whether the driver
// loads) is what the selection finds too; kept so callers need not change.
std::string DeviceCopyMode(bool cuda_driver);

// The failure text of a batch that could not be posted or copied (shared by paths).
absl::Status PostingFailed(const DataBatch& batch, int32_t segment, const absl::Status& cause);

}  // namespace kvagent::agent
