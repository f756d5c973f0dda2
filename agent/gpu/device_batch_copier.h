// DeviceBatchCopier: moves a list of copies between UVA addresses (VRAM, or host memory
// for the batch call and per page) on its CUDA streams, one per copy lane, by one
// mechanism of agent/gpu/device_batch.h, then waits for them. A batch of at least
// kMinDeviceLaneBytes per lane is split across the lanes (SplitDeviceCopies: each
// lane one run of the batch, queued on its own stream), so one batch can keep more
// than one copy engine or set of SMs busy. The device copy path
// (agent/paths/device_copy.cc) runs one per engine on the worker thread;
// tests/gpu/device_copy_test runs each mechanism on a GPU, and
// tests/unit/gpu:device_lanes_test runs the lanes over a stand-in driver.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "agent/gpu/device_batch.h"
#include "cuda/driver.h"

namespace kvagent::agent {

class DeviceBatchCopier {
 public:
  // `lanes` streams (at least 1), created on the first copy.
  explicit DeviceBatchCopier(uint32_t lanes = 1);
  DeviceBatchCopier(const DeviceBatchCopier&) = delete;
  DeviceBatchCopier& operator=(const DeviceBatchCopier&) = delete;
  ~DeviceBatchCopier();  // frees the streams, the kernel module and its buffers

  // Queues `copies` (split across the lanes, then planned per lane: merged, split, in
  // calls) by `mechanism` on the lanes' streams (device 0's primary context, created
  // on first use), then waits for every stream, whatever failed. kKernel needs every
  // address to be device memory; when the kernel will not load, the copies go per page
  // and KernelUnavailable records why. On failure `*failed_op` is DeviceCopy::op of the
  // copy the error is about; lanes after a failed one queue nothing.
  absl::Status Copy(const std::vector<DeviceCopy>& copies, DeviceCopyMechanism mechanism,
                    uint32_t* failed_op);

  uint32_t lanes() const { return static_cast<uint32_t>(lanes_.size()); }
  const DeviceLaneCounters& counters() const { return counters_; }

 private:
  struct Lane {
    CUstream_st* stream = nullptr;
    uint64_t device_descriptors = 0;  // kKernelLimits.max_copies_per_call GatherCopy
    void* host_descriptors = nullptr;  // pinned, as many
    // Reused per call.
    DeviceCopyPlan plan;
    std::vector<uint64_t> dsts, srcs, sizes;
  };
  absl::Status Queue(Lane& lane, const std::vector<DeviceCopy>& copies,
                     DeviceCopyMechanism mechanism, uint32_t* failed_op);
  absl::Status CopyBatched(Lane& lane, uint32_t* failed_op);
  absl::Status Launch(Lane& lane, uint32_t* failed_op);
  absl::Status EnsureStreams();
  absl::Status EnsureKernel();
  absl::Status Sync(Lane& lane);

  cuda::CudaDriver* cuda_ = nullptr;
  std::vector<Lane> lanes_;
  bool streams_ready_ = false;
  CUmod_st* module_ = nullptr;
  CUfunc_st* kernel_ = nullptr;
  absl::Status kernel_failed_;
  DeviceLaneCounters counters_;
  std::vector<std::vector<DeviceCopy>> shares_;  // reused per batch
};

}  // namespace kvagent::agent
