// DeviceBatchCopier: moves a list of copies between UVA addresses (VRAM, or host memory
// for the batch call and per page) on one CUDA stream by one mechanism of
// agent/gpu/device_batch.h, then waits for them. The device copy path
// (agent/paths/device_copy.cc) runs one per engine on the worker thread;
// tests/gpu/device_copy_test runs each mechanism on a GPU.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "agent/gpu/device_batch.h"
#include "cuda/driver.h"

namespace kvagent::agent {

class DeviceBatchCopier {
 public:
  DeviceBatchCopier() = default;
  DeviceBatchCopier(const DeviceBatchCopier&) = delete;
  DeviceBatchCopier& operator=(const DeviceBatchCopier&) = delete;
  ~DeviceBatchCopier();  // frees the stream, the kernel module and its buffers

  // Queues `copies` (planned here: merged, split, in calls) by `mechanism` on the
  // stream (device 0's primary context, created on first use), then waits for the
  // stream, whatever failed. kKernel needs every address to be device memory; when
  // the kernel will not load, the copies go per page and KernelUnavailable records
  // why. On failure `*failed_op` is DeviceCopy::op of the copy the error is about.
  absl::Status Copy(const std::vector<DeviceCopy>& copies, DeviceCopyMechanism mechanism,
                    uint32_t* failed_op);

 private:
  absl::Status Queue(const std::vector<DeviceCopy>& copies, DeviceCopyMechanism mechanism,
                     uint32_t* failed_op);
  absl::Status CopyBatched(uint32_t* failed_op);
  absl::Status Launch(uint32_t* failed_op);
  absl::Status EnsureKernel();
  absl::Status Sync();

  cuda::CudaDriver* cuda_ = nullptr;
  CUstream_st* stream_ = nullptr;
  CUmod_st* module_ = nullptr;
  CUfunc_st* kernel_ = nullptr;
  uint64_t device_descriptors_ = 0;     // kKernelLimits.max_copies_per_call GatherCopy
  void* host_descriptors_ = nullptr;    // pinned, as many
  absl::Status kernel_failed_;
  // Reused per call.
  DeviceCopyPlan plan_;
  std::vector<uint64_t> dsts_, srcs_, sizes_;
};

}  // namespace kvagent::agent
