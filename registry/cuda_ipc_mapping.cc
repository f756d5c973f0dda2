#include "registry/cuda_ipc_mapping.h"

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

absl::StatusOr<CudaIpcMapping> CudaIpcMapping::Open(const v1::CudaIpcSource& source,
                                                    uint64_t length, std::string_view entry) {
  ASSIGN_OR_RETURN(cuda::CudaDriver * driver, cuda::CudaDriver::Load());
  RETURN_IF_ERROR(driver->CheckDevice(source.device(), entry));
  uint64_t end = 0;
  if (length == 0 || __builtin_add_overflow(source.offset(), length, &end)) {
    return absl::InvalidArgumentError(fmt::format(
        "region '{}': cuda_ipc.offset {} + length {} is empty or overflows; fix both", entry,
        source.offset(), length));
  }
  ASSIGN_OR_RETURN(uint64_t base,
                   driver->OpenIpcHandle(source.ipc_handle(), source.device(), entry));
  CudaIpcMapping mapping;  // from here on the handle closes on every return
  mapping.driver_ = driver;
  mapping.entry_ = std::string(entry);
  mapping.base_ = base;
  mapping.offset_ = source.offset();
  mapping.length_ = length;
  mapping.device_ = source.device();
  auto size = driver->AllocationSize(base);
  if (!size.ok()) {
    return absl::InternalError(fmt::format(
        "region '{}': cannot read the size of the opened allocation: {}; report this with "
        "the driver version ({})",
        entry, size.status().message(), driver->driver_version()));
  }
  mapping.allocation_bytes_ = *size;
  if (end > mapping.allocation_bytes_) {
    return absl::InvalidArgumentError(fmt::format(
        "region '{}': cuda_ipc.offset {} + length {} = {} bytes, but the allocation behind "
        "the handle has {} bytes (cuMemGetAddressRange); fix offset/length, or export the "
        "allocation that holds the whole region",
        entry, source.offset(), length, end, mapping.allocation_bytes_));
  }
  return mapping;
}

CudaIpcMapping::CudaIpcMapping(CudaIpcMapping&& other) noexcept { *this = std::move(other); }

CudaIpcMapping& CudaIpcMapping::operator=(CudaIpcMapping&& other) noexcept {
  if (this != &other) {
    Reset();
    driver_ = std::exchange(other.driver_, nullptr);
    entry_ = std::move(other.entry_);
    base_ = std::exchange(other.base_, 0);
    offset_ = std::exchange(other.offset_, 0);
    length_ = std::exchange(other.length_, 0);
    allocation_bytes_ = std::exchange(other.allocation_bytes_, 0);
    device_ = std::exchange(other.device_, 0);
  }
  return *this;
}

CudaIpcMapping::~CudaIpcMapping() { Reset(); }

void CudaIpcMapping::Reset() {
  if (driver_ == nullptr) return;
  if (absl::Status s = driver_->CloseIpcHandle(base_, device_); !s.ok()) {
    kLog.Warn("region '{}': closing its CUDA IPC handle on device {} failed: {}", entry_,
              device_, s.message());
  }
  driver_ = nullptr;
  base_ = 0;
}

}  // namespace kvagent::registry
