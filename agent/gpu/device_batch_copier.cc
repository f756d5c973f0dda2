#include "agent/gpu/device_batch_copier.h"

#include <algorithm>
#include <string>

#include "agent/gpu/gather_kernel.h"
#include "base/format.h"
#include "base/status_macros.h"
#include "fmt/format.h"

namespace kvagent::agent {

DeviceBatchCopier::DeviceBatchCopier(uint32_t lanes) : lanes_(std::max<uint32_t>(lanes, 1)) {}

DeviceBatchCopier::~DeviceBatchCopier() {
  if (cuda_ == nullptr || !cuda_->MakeCurrent(0).ok()) return;
  if (module_ != nullptr) (void)cuda_->UnloadModule(module_);
  for (Lane& lane : lanes_) {
    if (lane.device_descriptors != 0) (void)cuda_->MemFree(lane.device_descriptors);
    if (lane.host_descriptors != nullptr) (void)cuda_->HostFree(lane.host_descriptors);
    if (lane.stream != nullptr) (void)cuda_->DestroyStream(lane.stream);
  }
}

absl::Status DeviceBatchCopier::Copy(const std::vector<DeviceCopy>& copies,
                                     DeviceCopyMechanism mechanism, uint32_t* failed_op) {
  *failed_op = copies.empty() ? 0 : copies.front().op;
  uint64_t total = 0;
  for (const DeviceCopy& c : copies) total += c.bytes;
  const uint32_t parts = DeviceLanesFor(total, lanes());
  absl::Status queued = EnsureStreams();
  if (queued.ok() && mechanism == DeviceCopyMechanism::kKernel && !EnsureKernel().ok()) {
    mechanism = DeviceCopyMechanism::kPerPage;
  }
  uint32_t used = 0;
  if (queued.ok()) {
    SplitDeviceCopies(copies, parts, &shares_);
    for (uint32_t i = 0; i < parts && queued.ok(); ++i) {
      if (shares_[i].empty()) continue;
      ++used;
      queued = Queue(lanes_[i], shares_[i], mechanism, failed_op);
    }
  }
  // What was queued must finish before the batch ends, whatever failed: every stream
  // is waited for (one that queued nothing returns at once).
  absl::Status synced = absl::OkStatus();
  if (streams_ready_) {
    for (Lane& lane : lanes_) {
      absl::Status s = Sync(lane);
      if (synced.ok()) synced = s;
    }
  }
  ++counters_.batches;
  if (used > 1) ++counters_.split_batches;
  counters_.bytes += total;
  CountDeviceBatch(total, used > 1);
  return queued.ok() ? synced : queued;
}

absl::Status DeviceBatchCopier::EnsureStreams() {
  if (streams_ready_) return absl::OkStatus();
  if (cuda_ == nullptr) {
    ASSIGN_OR_RETURN(cuda_, cuda::CudaDriver::Load());
  }
  for (Lane& lane : lanes_) {
    if (lane.stream == nullptr) {
      ASSIGN_OR_RETURN(lane.stream, cuda_->CreateStream(0));
    }
  }
  streams_ready_ = true;
  return absl::OkStatus();
}

absl::Status DeviceBatchCopier::Queue(Lane& lane, const std::vector<DeviceCopy>& copies,
                                      DeviceCopyMechanism mechanism, uint32_t* failed_op) {
  if (mechanism == DeviceCopyMechanism::kBatchApi) {
    PlanDeviceCopies(copies, kBatchApiLimits, &lane.plan);
    return CopyBatched(lane, failed_op);
  }
  if (mechanism == DeviceCopyMechanism::kKernel) {
    PlanDeviceCopies(copies, kKernelLimits, &lane.plan);
    return Launch(lane, failed_op);
  }
  for (const DeviceCopy& c : copies) {
    *failed_op = c.op;
    RETURN_IF_ERROR(cuda_->CopyAsync(c.dst, c.src, c.bytes, lane.stream));
  }
  return absl::OkStatus();
}

absl::Status DeviceBatchCopier::CopyBatched(Lane& lane, uint32_t* failed_op) {
  size_t begin = 0;
  for (size_t end : lane.plan.call_ends) {
    lane.dsts.clear();
    lane.srcs.clear();
    lane.sizes.clear();
    for (size_t i = begin; i < end; ++i) {
      lane.dsts.push_back(lane.plan.copies[i].dst);
      lane.srcs.push_back(lane.plan.copies[i].src);
      lane.sizes.push_back(lane.plan.copies[i].bytes);
    }
    const size_t count = end - begin;
    size_t failed = count;
    if (absl::Status s = cuda_->CopyBatchAsync(lane.dsts.data(), lane.srcs.data(),
                                               lane.sizes.data(), count, lane.stream, &failed);
        !s.ok()) {
      // CUDA 13's form names no copy: the call's first stands for it.
      const size_t at = failed < count ? failed : 0;
      *failed_op = lane.plan.copies[begin + at].op;
      return absl::Status(s.code(), fmt::format("{} (copy {} of {} in one call{})", s.message(),
                                                at, count,
                                                failed < count ? "" : "; the driver names none"));
    }
    begin = end;
  }
  return absl::OkStatus();
}

// One launch per call of the plan: its descriptors go up from the lane's pinned host
// memory on the lane's stream, then the kernel reads them there. A lane's batch of
// several calls waits for its previous one before the buffers are reused (rare: 16384
// pieces per call).
absl::Status DeviceBatchCopier::Launch(Lane& lane, uint32_t* failed_op) {
  size_t begin = 0;
  for (size_t end : lane.plan.call_ends) {
    *failed_op = lane.plan.copies[begin].op;
    if (begin > 0) RETURN_IF_ERROR(Sync(lane));
    auto* descriptors = static_cast<GatherCopy*>(lane.host_descriptors);
    for (size_t i = begin; i < end; ++i) {
      const DeviceCopy& c = lane.plan.copies[i];
      descriptors[i - begin] = GatherCopy{c.src, c.dst, c.bytes};
    }
    unsigned long long count = end - begin;
    RETURN_IF_ERROR(cuda_->CopyAsync(lane.device_descriptors,
                                     reinterpret_cast<uint64_t>(lane.host_descriptors),
                                     count * sizeof(GatherCopy), lane.stream));
    void* params[] = {&lane.device_descriptors, &count};
    RETURN_IF_ERROR(cuda_->LaunchKernel(kernel_, static_cast<unsigned>(count), kGatherThreads,
                                        lane.stream, params));
    begin = end;
  }
  return absl::OkStatus();
}

// Loads the kernel and each lane's descriptor buffers on first use; a failure moves
// the process to per-page copies (CurrentDeviceCopy says why) and is not retried.
absl::Status DeviceBatchCopier::EnsureKernel() {
  if (kernel_ != nullptr || !kernel_failed_.ok()) return kernel_failed_;
  kernel_failed_ = [this]() -> absl::Status {
    ASSIGN_OR_RETURN(module_, cuda_->LoadModule(GatherKernelImage()));
    const uint64_t bytes = kKernelLimits.max_copies_per_call * sizeof(GatherCopy);
    for (Lane& lane : lanes_) {
      ASSIGN_OR_RETURN(lane.device_descriptors, cuda_->MemAlloc(bytes));
      ASSIGN_OR_RETURN(lane.host_descriptors,
                       cuda_->HostAlloc(bytes, "gather kernel descriptors"));
    }
    ASSIGN_OR_RETURN(kernel_, cuda_->ModuleFunction(module_, kGatherKernelName));
    return absl::OkStatus();
  }();
  if (!kernel_failed_.ok()) KernelUnavailable(std::string(kernel_failed_.message()));
  return kernel_failed_;
}

absl::Status DeviceBatchCopier::Sync(Lane& lane) {
  return lane.stream == nullptr ? absl::OkStatus() : cuda_->SynchronizeStream(lane.stream);
}

}  // namespace kvagent::agent
