// DeviceMemoryObject is a CUDA VMM allocation an engine shared with the agent: the
// POSIX descriptor of cuMemExportToShareableHandle with the device and size the engine
// declared, checked without a driver when it arrives. Kept by the local door as a
// session handle; imported by CudaVmmMapping when a region names it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "base/unique_fd.h"

namespace kvagent::registry {

class DeviceMemoryObject {
 public:
  // More than any GPU holds; bounds what reaches the driver (address reservation).
  static constexpr uint64_t kMaxBytes = uint64_t{1} << 44;  // 16 TiB

  // Takes a descriptor a caller passed (SCM_RIGHTS) for `bytes` of device memory on
  // device ordinal `device`. INVALID_ARGUMENT naming `label`, the cause and the fix
  // for: no descriptor; 0 bytes or over kMaxBytes; a negative device; a regular file
  // on tmpfs or hugetlbfs (host memory: that goes through share). Whether it really
  // is a CUDA VMM handle, and on that device, only the driver can tell (at import).
  static absl::StatusOr<std::shared_ptr<const DeviceMemoryObject>> FromDescriptor(
      UniqueFd fd, int device, uint64_t bytes, std::string_view label);

  DeviceMemoryObject(const DeviceMemoryObject&) = delete;
  DeviceMemoryObject& operator=(const DeviceMemoryObject&) = delete;
  ~DeviceMemoryObject() = default;  // closes the descriptor; imports of it stay valid

  int fd() const { return fd_.get(); }
  // Unique in this process, from 1.
  uint64_t id() const { return id_; }
  int device() const { return device_; }
  uint64_t bytes() const { return bytes_; }
  // The caller's label, escaped and bounded.
  const std::string& label() const { return label_; }
  static constexpr std::string_view kind() { return "cuda-vmm"; }

 private:
  DeviceMemoryObject() = default;

  UniqueFd fd_;
  uint64_t id_ = 0;
  int device_ = 0;
  uint64_t bytes_ = 0;
  std::string label_;
};

}  // namespace kvagent::registry
