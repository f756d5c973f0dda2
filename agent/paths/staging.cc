// Routes kStagedChunks, kStagedBounce and kStagedRemoteRead: VRAM that the running UCX
// cannot reach moves through host bounce buffers, run chunk by chunk by the Stager
// (agent/staging.h, "Host staging" in docs/ARCHITECTURE.md); the batch is done once no
// chunk of it is in flight. kAmWrite and kAmRead (an endpoint without native RMA) run
// the same protocol for any memory.
#include "agent/data_path.h"
#include "base/format.h"
#include "fmt/format.h"

namespace kvagent::agent {
namespace {

StagedRoute StagedRouteOf(Route route) {
  switch (route) {
    case Route::kStagedChunks:
    case Route::kAmWrite:
      return StagedRoute::kChunks;
    case Route::kStagedBounce:
      return StagedRoute::kBounce;
    case Route::kStagedRemoteRead:
    case Route::kAmRead:
      return StagedRoute::kRemoteRead;
    default:
      return StagedRoute::kNone;
  }
}

class StagingPath final : public DataPath {
 public:
  explicit StagingPath(Stager* stager) : stager_(stager) {}

  void Run(const DataBatch& batch, BatchDone done) override {
    const int32_t first = static_cast<int32_t>(batch.ops.front().segment);
    stager_->Run(batch.transfer_id, batch.op, StagedRouteOf(batch.route), batch.ops, batch.peer,
                 batch.stopped,
                 [&batch, done = std::move(done), first](absl::Status status, int32_t failed) {
                   if (status.ok()) return done(BatchOutcome{});
                   const int32_t segment = failed >= 0 ? failed : first;
                   done(BatchOutcome{
                       absl::Status(status.code(),
                                    fmt::format("transfer '{}' segment {}: {} to peer '{}' "
                                                "failed: {}",
                                                batch.transfer_id, segment,
                                                batch.route == Route::kAmWrite ||
                                                        batch.route == Route::kAmRead
                                                    ? "moving data as active messages"
                                                    : "staging through host buffers",
                                                batch.peer_name, status.message())),
                       segment});
                 });
  }

 private:
  Stager* stager_;
};

}  // namespace

std::unique_ptr<DataPath> MakeStagingPath(Stager* stager) {
  return std::make_unique<StagingPath>(stager);
}

}  // namespace kvagent::agent
