// Route::kDeviceCopy: same host, VRAM on either side, the peer's memory mapped or
// opened here (CUDA IPC). A batch goes to the GPU by the mechanism chosen for this
// process (agent/gpu/device_batch.h: one cuMemcpyBatchAsync or one gather kernel
// launch per batch, else one cuMemcpyAsync per op) on one stream, then one stream sync
// (agent/gpu/device_batch_copier.h). CUDA's unified addressing tells host from device
// pointers; the kernel reaches device memory only, so a batch with a host side goes
// per page when the kernel is the mechanism.
#include <atomic>

#include "agent/data_path.h"
#include "agent/gpu/device_batch.h"
#include "agent/gpu/device_batch_copier.h"

namespace kvagent::agent {
namespace {

class DeviceCopyPath final : public DataPath {
 public:
  explicit DeviceCopyPath(uint32_t lanes) : copier_(lanes) {}

  void Run(const DataBatch& batch, BatchDone done) override {
    const PeerSnapshot& peer = *batch.peer;
    const auto& remote_regions = peer.catalog->regions();
    copies_.clear();
    bool all_device = true;
    for (size_t i = 0; i < batch.ops.size(); ++i) {
      const auto& o = batch.ops[i];
      const uint64_t remote = reinterpret_cast<uint64_t>(peer.direct->base_by_slot[o.rkey_slot]) +
                              (o.remote_address - remote_regions[o.rkey_slot].base_address);
      const bool write = batch.op == v1::WRITE;
      copies_.push_back(DeviceCopy{write ? remote : o.local_address,
                                   write ? o.local_address : remote, o.length,
                                   static_cast<uint32_t>(i)});
      all_device = all_device && o.local_device && o.remote_device;
    }
    DeviceCopyMechanism mechanism = CurrentDeviceCopy().mechanism;
    if (mechanism == DeviceCopyMechanism::kKernel && !all_device) {
      mechanism = DeviceCopyMechanism::kPerPage;
    }
    uint32_t failed_op = 0;
    absl::Status copied = copier_.Copy(copies_, mechanism, &failed_op);
    // Every copy is visible before anything the notification path sends after them.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (!copied.ok()) {
      const int32_t segment = static_cast<int32_t>(batch.ops[failed_op].segment);
      return done(BatchOutcome{PostingFailed(batch, segment, copied), segment});
    }
    done(BatchOutcome{});
  }

 private:
  // Worker-thread-only; CUDA state created on the first copy.
  DeviceBatchCopier copier_;
  std::vector<DeviceCopy> copies_;  // reused per batch
};

}  // namespace

std::unique_ptr<DataPath> MakeDeviceCopyPath(uint32_t lanes) {
  return std::make_unique<DeviceCopyPath>(lanes);
}

std::string DeviceCopyMode(bool /*cuda_driver*/) { return CurrentDeviceCopy().mode; }

}  // namespace kvagent::agent
