// ShmMapping maps host memory that an engine shares with the agent: a POSIX
// shared-memory object or a /dev/shm / hugetlbfs file, MAP_SHARED. Used by the
// region registry (import) and by AllocateSharedMemory (create).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvagent::registry {

class ShmMapping {
 public:
  // Maps [offset, offset+length) of an existing object. `name` is a POSIX shm name
  // ("/x", opened with shm_open) or an absolute file path (opened with open).
  // `entry` names the caller's region in errors. NOT_FOUND when the object does not
  // exist; INVALID_ARGUMENT when it is smaller than offset+length (message gives
  // both sizes) or length is 0; PERMISSION_DENIED when it cannot be opened.
  static absl::StatusOr<ShmMapping> Open(const std::string& name, uint64_t offset,
                                         uint64_t length, std::string_view entry);
  // Creates a new POSIX shm object of `bytes` (O_EXCL), maps it whole, and unlinks
  // the name when this mapping is destroyed. RESOURCE_EXHAUSTED when /dev/shm has no
  // room (the message gives free bytes).
  static absl::StatusOr<ShmMapping> Create(const std::string& name, uint64_t bytes);

  ShmMapping() = default;
  ShmMapping(ShmMapping&& other) noexcept;
  ShmMapping& operator=(ShmMapping&& other) noexcept;
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;
  ~ShmMapping();

  // First byte of the requested range (offset applied).
  void* data() const { return data_; }
  uint64_t length() const { return length_; }
  const std::string& name() const { return name_; }
  // Identity of the underlying object, to detect overlapping registrations.
  dev_t device() const { return device_; }
  ino_t inode() const { return inode_; }
  uint64_t offset() const { return offset_; }

 private:
  void Reset();
  std::string name_;
  void* map_base_ = nullptr;  // page-aligned mapping start
  uint64_t map_length_ = 0;
  void* data_ = nullptr;
  uint64_t length_ = 0;
  uint64_t offset_ = 0;
  dev_t device_ = 0;
  ino_t inode_ = 0;
  bool owner_ = false;  // unlink on destruction
};

}  // namespace kvagent::registry
