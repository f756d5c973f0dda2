#include "registry/cuda_vmm_mapping.h"

#include <utility>

#include "absl/status/status.h"
#include "base/format.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "fmt/format.h"

namespace kvagent::registry {
namespace {

constexpr log::Logger kLog("registry");

}  // namespace

absl::StatusOr<std::shared_ptr<const CudaVmmMapping>> CudaVmmMapping::Import(
    std::shared_ptr<const DeviceMemoryObject> memory, std::string_view entry) {
  ASSIGN_OR_RETURN(cuda::CudaDriver * driver, cuda::CudaDriver::Load());
  ASSIGN_OR_RETURN(cuda::CudaVmmRange range,
                   driver->ImportVmm(memory->fd(), memory->device(), memory->bytes(), entry));
  std::shared_ptr<CudaVmmMapping> mapping(new CudaVmmMapping());
  mapping->driver_ = driver;
  mapping->memory_ = std::move(memory);
  mapping->entry_ = std::string(entry);
  mapping->range_ = range;
  kLog.Info("region '{}': imported CUDA VMM memory '{}' ({} bytes on device {}, {} mapped)",
            mapping->entry_, mapping->memory_->label(), mapping->memory_->bytes(), range.device,
            range.mapped_bytes);
  return std::shared_ptr<const CudaVmmMapping>(std::move(mapping));
}

CudaVmmMapping::~CudaVmmMapping() {
  if (driver_ == nullptr) return;
  if (absl::Status s = driver_->ReleaseVmm(range_); !s.ok()) {
    kLog.Warn("CUDA VMM memory '{}' (imported for region '{}'): releasing it on device {} "
              "failed: {}",
              memory_->label(), entry_, range_.device, s.message());
  }
}

}  // namespace kvagent::registry
