// CudaVmmMapping imports an engine's CUDA VMM allocation (a DeviceMemoryObject) into
// the agent: mapped once in a fresh address range, read-write for its device; on
// destruction unmapped, its addresses freed and its handle released. The region
// registry shares one mapping among the VRAM regions of one object.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "cuda/driver.h"
#include "registry/device_memory_object.h"

namespace kvagent::registry {

class CudaVmmMapping {
 public:
  // Loads the CUDA driver (FAILED_PRECONDITION naming libcuda.so.1 when there is
  // none) and imports `memory` whole (CudaDriver::ImportVmm: its errors, naming
  // `entry`, pass through).
  static absl::StatusOr<std::shared_ptr<const CudaVmmMapping>> Import(
      std::shared_ptr<const DeviceMemoryObject> memory, std::string_view entry);

  CudaVmmMapping(const CudaVmmMapping&) = delete;
  CudaVmmMapping& operator=(const CudaVmmMapping&) = delete;
  ~CudaVmmMapping();

  // The object's first byte in this process (UVA): never dereference it on the host.
  uint64_t address() const { return range_.address; }
  uint64_t bytes() const { return memory_->bytes(); }  // as shared (mapped: rounded up)
  int device() const { return range_.device; }
  const std::shared_ptr<const DeviceMemoryObject>& memory() const { return memory_; }

 private:
  CudaVmmMapping() = default;

  cuda::CudaDriver* driver_ = nullptr;
  std::shared_ptr<const DeviceMemoryObject> memory_;
  std::string entry_;
  cuda::CudaVmmRange range_;
};

}  // namespace kvagent::registry
