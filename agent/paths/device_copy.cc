// Route::kDeviceCopy: same host, VRAM on either side, the peer's memory mapped or
// opened here (CUDA IPC). One cuMemcpyAsync per op on one stream (CUDA's unified
// addressing tells host from device pointers), then one stream sync per batch.
#include <atomic>

#include "agent/data_path.h"
#include "transport/base/status_macros.h"
#include "transport/cuda_driver.h"

namespace kvagent::agent {
namespace {

class DeviceCopyPath final : public DataPath {
 public:
  void Run(const DataBatch& batch, BatchDone done) override {
    const PeerSnapshot& peer = *batch.peer;
    const auto& remote_regions = peer.catalog->regions();
    for (const auto& o : batch.ops) {
      const uint64_t remote = reinterpret_cast<uint64_t>(peer.direct->base_by_slot[o.rkey_slot]) +
                              (o.remote_address - remote_regions[o.rkey_slot].base_address);
      const uint64_t dst = batch.op == v1::WRITE ? remote : o.local_address;
      const uint64_t src = batch.op == v1::WRITE ? o.local_address : remote;
      if (absl::Status copied = Copy(dst, src, o.length); !copied.ok()) {
        const int32_t segment = static_cast<int32_t>(o.segment);
        // What was queued before must finish before the batch ends.
        (void)Sync();
        return done(BatchOutcome{PostingFailed(batch, segment, copied), segment});
      }
    }
    // Device copies complete, and every copy is visible, before anything the
    // notification path sends after them.
    absl::Status synced = Sync();
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (!synced.ok()) {
      const int32_t segment = static_cast<int32_t>(batch.ops.front().segment);
      return done(BatchOutcome{PostingFailed(batch, segment, synced), segment});
    }
    done(BatchOutcome{});
  }

 private:
  absl::Status Copy(uint64_t dst, uint64_t src, uint64_t bytes) {
    if (cuda_stream_ == nullptr) {
      ASSIGN_OR_RETURN(cuda_, transport::CudaDriver::Load());
      ASSIGN_OR_RETURN(cuda_stream_, cuda_->CreateStream(0));
    }
    return cuda_->CopyAsync(dst, src, bytes, cuda_stream_);
  }
  absl::Status Sync() {
    return cuda_stream_ == nullptr ? absl::OkStatus() : cuda_->SynchronizeStream(cuda_stream_);
  }

  // Worker-thread-only CUDA state, created on the first copy.
  transport::CudaDriver* cuda_ = nullptr;
  CUstream_st* cuda_stream_ = nullptr;
};

}  // namespace

std::unique_ptr<DataPath> MakeDeviceCopyPath() { return std::make_unique<DeviceCopyPath>(); }

std::string DeviceCopyMode(bool cuda_driver) {
  return cuda_driver ? "cuMemcpyAsync per page" : "none (no CUDA driver)";
}

}  // namespace kvagent::agent
