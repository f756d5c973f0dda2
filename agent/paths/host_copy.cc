// Route::kHostCopy: same host, host memory on both sides. The peer's memory is mapped
// here (PeerManager::MapDirect); each op is one memcpy, and a batch is split across the
// copy lanes. A copy that faults on memory that vanished finishes reading zeros or
// writing into throwaway pages (registry/fault_guard), whichever lane it ran on; the
// engine checks for that after the batch (MemoryLost).
#include <atomic>

#include "agent/data_path.h"

namespace kvagent::agent {
namespace {

class HostCopyPath final : public DataPath {
 public:
  explicit HostCopyPath(CopyLanes* lanes) : lanes_(lanes) {}

  void Run(const DataBatch& batch, BatchDone done) override {
    const PeerSnapshot& peer = *batch.peer;
    const auto& remote_regions = peer.catalog->regions();
    pieces_.clear();
    for (const auto& o : batch.ops) {
      // The planner bounded the range inside the peer's region.
      uint8_t* remote = peer.direct->base_by_slot[o.rkey_slot] +
                        (o.remote_address - remote_regions[o.rkey_slot].base_address);
      uint8_t* local = reinterpret_cast<uint8_t*>(o.local_address);
      pieces_.push_back(batch.op == v1::WRITE ? CopyPiece{remote, local, o.length}
                                              : CopyPiece{local, remote, o.length});
    }
    lanes_->Copy(pieces_);
    // Every copy is visible before anything the notification path sends after it.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    done(BatchOutcome{});
  }

 private:
  CopyLanes* lanes_;
  std::vector<CopyPiece> pieces_;  // reused: worker thread only
};

}  // namespace

std::unique_ptr<DataPath> MakeHostCopyPath(CopyLanes* lanes) {
  return std::make_unique<HostCopyPath>(lanes);
}

}  // namespace kvagent::agent
