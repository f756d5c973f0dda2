// CudaIpcMapping imports an engine's VRAM into the agent: a CUDA IPC handle opened
// on its device, checked against the allocation's size, closed on destruction. Used
// by the region registry for VRAM regions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "cuda/driver.h"
#include "proto/kvagent.pb.h"

namespace kvagent::registry {

class CudaIpcMapping {
 public:
  // Loads the CUDA driver (FAILED_PRECONDITION naming libcuda.so.1 when there is
  // none), checks the device ordinal and handle size (INVALID_ARGUMENT), opens the
  // handle, and checks that offset + length fits in the exporter's allocation
  // (INVALID_ARGUMENT with both sizes). `entry` names the region in every error.
  static absl::StatusOr<CudaIpcMapping> Open(const v1::CudaIpcSource& source, uint64_t length,
                                             std::string_view entry);

  CudaIpcMapping() = default;
  CudaIpcMapping(CudaIpcMapping&& other) noexcept;
  CudaIpcMapping& operator=(CudaIpcMapping&& other) noexcept;
  CudaIpcMapping(const CudaIpcMapping&) = delete;
  CudaIpcMapping& operator=(const CudaIpcMapping&) = delete;
  ~CudaIpcMapping();

  // The region's first byte in this process (UVA): the opened base plus the offset.
  uint64_t device_pointer() const { return base_ + offset_; }
  uint64_t base() const { return base_; }  // the allocation's first byte
  uint64_t offset() const { return offset_; }
  uint64_t length() const { return length_; }
  uint64_t allocation_bytes() const { return allocation_bytes_; }
  int device() const { return device_; }

 private:
  void Reset();
  cuda::CudaDriver* driver_ = nullptr;  // null when nothing is open
  std::string entry_;
  uint64_t base_ = 0;
  uint64_t offset_ = 0;
  uint64_t length_ = 0;
  uint64_t allocation_bytes_ = 0;
  int device_ = 0;
};

}  // namespace kvagent::registry
