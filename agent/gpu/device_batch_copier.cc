#include "agent/gpu/device_batch_copier.h"

#include <string>

#include "agent/gpu/gather_kernel.h"
#include "base/format.h"
#include "base/status_macros.h"
#include "fmt/format.h"

namespace kvagent::agent {

DeviceBatchCopier::~DeviceBatchCopier() {
  if (cuda_ == nullptr || !cuda_->MakeCurrent(0).ok()) return;
  if (module_ != nullptr) (void)cuda_->UnloadModule(module_);
  if (device_descriptors_ != 0) (void)cuda_->MemFree(device_descriptors_);
  if (host_descriptors_ != nullptr) (void)cuda_->HostFree(host_descriptors_);
  if (stream_ != nullptr) (void)cuda_->DestroyStream(stream_);
}

absl::Status DeviceBatchCopier::Copy(const std::vector<DeviceCopy>& copies,
                                DeviceCopyMechanism mechanism, uint32_t* failed_op) {
  *failed_op = copies.empty() ? 0 : copies.front().op;
  absl::Status queued = Queue(copies, mechanism, failed_op);
  // What was queued must finish before the batch ends, whatever failed.
  absl::Status synced = Sync();
  return queued.ok() ? synced : queued;
}

absl::Status DeviceBatchCopier::Queue(const std::vector<DeviceCopy>& copies,
                                 DeviceCopyMechanism mechanism, uint32_t* failed_op) {
  if (stream_ == nullptr) {
    ASSIGN_OR_RETURN(cuda_, cuda::CudaDriver::Load());
    ASSIGN_OR_RETURN(stream_, cuda_->CreateStream(0));
  }
  if (mechanism == DeviceCopyMechanism::kKernel && !EnsureKernel().ok()) {
    mechanism = DeviceCopyMechanism::kPerPage;
  }
  if (mechanism == DeviceCopyMechanism::kBatchApi) {
    PlanDeviceCopies(copies, kBatchApiLimits, &plan_);
    return CopyBatched(failed_op);
  }
  if (mechanism == DeviceCopyMechanism::kKernel) {
    PlanDeviceCopies(copies, kKernelLimits, &plan_);
    return Launch(failed_op);
  }
  for (const DeviceCopy& c : copies) {
    *failed_op = c.op;
    RETURN_IF_ERROR(cuda_->CopyAsync(c.dst, c.src, c.bytes, stream_));
  }
  return absl::OkStatus();
}

absl::Status DeviceBatchCopier::CopyBatched(uint32_t* failed_op) {
  size_t begin = 0;
  for (size_t end : plan_.call_ends) {
    dsts_.clear();
    srcs_.clear();
    sizes_.clear();
    for (size_t i = begin; i < end; ++i) {
      dsts_.push_back(plan_.copies[i].dst);
      srcs_.push_back(plan_.copies[i].src);
      sizes_.push_back(plan_.copies[i].bytes);
    }
    const size_t count = end - begin;
    size_t failed = count;
    if (absl::Status s = cuda_->CopyBatchAsync(dsts_.data(), srcs_.data(), sizes_.data(), count,
                                               stream_, &failed);
        !s.ok()) {
      // CUDA 13's form names no copy: the call's first stands for it.
      const size_t at = failed < count ? failed : 0;
      *failed_op = plan_.copies[begin + at].op;
      return absl::Status(s.code(), fmt::format("{} (copy {} of {} in one call{})", s.message(),
                                                at, count,
                                                failed < count ? "" : "; the driver names none"));
    }
    begin = end;
  }
  return absl::OkStatus();
}

// One launch per call of the plan: its descriptors go up from pinned host memory on
// the stream, then the kernel reads them there. A batch of several calls waits for the
// previous one before the buffers are reused (rare: 16384 pieces per call).
absl::Status DeviceBatchCopier::Launch(uint32_t* failed_op) {
  size_t begin = 0;
  for (size_t end : plan_.call_ends) {
    *failed_op = plan_.copies[begin].op;
    if (begin > 0) RETURN_IF_ERROR(Sync());
    auto* descriptors = static_cast<GatherCopy*>(host_descriptors_);
    for (size_t i = begin; i < end; ++i) {
      const DeviceCopy& c = plan_.copies[i];
      descriptors[i - begin] = GatherCopy{c.src, c.dst, c.bytes};
    }
    unsigned long long count = end - begin;
    RETURN_IF_ERROR(cuda_->CopyAsync(device_descriptors_,
                                     reinterpret_cast<uint64_t>(host_descriptors_),
                                     count * sizeof(GatherCopy), stream_));
    void* params[] = {&device_descriptors_, &count};
    RETURN_IF_ERROR(cuda_->LaunchKernel(kernel_, static_cast<unsigned>(count), kGatherThreads,
                                        stream_, params));
    begin = end;
  }
  return absl::OkStatus();
}

// Loads the kernel and its descriptor buffers on first use; a failure moves the
// process to per-page copies (CurrentDeviceCopy says why) and is not retried.
absl::Status DeviceBatchCopier::EnsureKernel() {
  if (kernel_ != nullptr || !kernel_failed_.ok()) return kernel_failed_;
  kernel_failed_ = [this]() -> absl::Status {
    ASSIGN_OR_RETURN(module_, cuda_->LoadModule(GatherKernelImage()));
    const uint64_t bytes = kKernelLimits.max_copies_per_call * sizeof(GatherCopy);
    ASSIGN_OR_RETURN(device_descriptors_, cuda_->MemAlloc(bytes));
    ASSIGN_OR_RETURN(host_descriptors_, cuda_->HostAlloc(bytes, "gather kernel descriptors"));
    ASSIGN_OR_RETURN(kernel_, cuda_->ModuleFunction(module_, kGatherKernelName));
    return absl::OkStatus();
  }();
  if (!kernel_failed_.ok()) KernelUnavailable(std::string(kernel_failed_.message()));
  return kernel_failed_;
}

absl::Status DeviceBatchCopier::Sync() {
  return stream_ == nullptr ? absl::OkStatus() : cuda_->SynchronizeStream(stream_);
}

}  // namespace kvagent::agent
