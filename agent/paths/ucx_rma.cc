// Route::kUcxRma: UCX put (WRITE) or get (READ) of each op with the peer region's
// unpacked rkey, then one flush of the endpoint: the batch is done when the flush
// completes (every put complete at the peer, every get here), or at once when an op
// could not be posted (what was posted before it is flushed first).
#include "agent/data_path.h"
#include "base/format.h"
#include "fmt/format.h"

namespace kvagent::agent {
namespace {

class UcxRmaPath final : public DataPath {
 public:
  void Run(const DataBatch& batch, BatchDone done) override {
    const PeerSnapshot& peer = *batch.peer;
    const RkeyTable& keys = *peer.keys;
    transport::Endpoint& endpoint = *peer.endpoint;
    absl::Status posted;
    int32_t failed_segment = -1;
    for (const auto& o : batch.ops) {
      posted = batch.op == v1::WRITE
                   ? endpoint.Put(reinterpret_cast<const void*>(o.local_address), o.length,
                                  o.remote_address, keys.at(o.rkey_slot))
                   : endpoint.Get(reinterpret_cast<void*>(o.local_address), o.length,
                                  o.remote_address, keys.at(o.rkey_slot));
      if (!posted.ok()) {
        failed_segment = static_cast<int32_t>(o.segment);
        break;
      }
    }
    const int32_t first = static_cast<int32_t>(batch.ops.front().segment);
    // Flushed even after a failed post: `done` means nothing posted is in flight.
    endpoint.Flush([&batch, done = std::move(done), posted, failed_segment,
                    first](absl::Status flushed) {
      if (!posted.ok()) return done(BatchOutcome{PostingFailed(batch, failed_segment, posted),
                                                 failed_segment});
      if (!flushed.ok()) {
        return done(BatchOutcome{
            absl::UnavailableError(fmt::format(
                "transfer '{}' segment {}: peer '{}' did not complete the operations: {}",
                batch.transfer_id, first, batch.peer_name, flushed.message())),
            first});
      }
      done(BatchOutcome{});
    });
  }
};

}  // namespace

std::unique_ptr<DataPath> MakeUcxRmaPath() { return std::make_unique<UcxRmaPath>(); }

}  // namespace kvagent::agent
