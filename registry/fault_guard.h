// FaultGuard turns a SIGBUS in host memory that vanished under the agent (an engine
// truncated the file it shared, or tmpfs had no page to give) into a flag on that
// mapping instead of a dead agent. ShmMapping guards every mapping it makes; the
// transfer engine checks the flags after each batch and fails the transfer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvagent::registry {

// Cause and fix for reports of memory a caught fault broke (transfers name the region).
inline constexpr std::string_view kLostMemoryCause =
    "its memory shrank or could not be faulted in: the file backing it was truncated or its "
    "filesystem is full";
inline constexpr std::string_view kLostMemoryFix =
    "re-register the region from memory that cannot shrink, e.g. AllocateMemory's sealed "
    "memfd; free space in /dev/shm";

// One guarded range; move-only, unguards on destruction. Empty when default-built.
class GuardedRange {
 public:
  GuardedRange() = default;
  GuardedRange(GuardedRange&& other) noexcept;
  GuardedRange& operator=(GuardedRange&& other) noexcept;
  GuardedRange(const GuardedRange&) = delete;
  GuardedRange& operator=(const GuardedRange&) = delete;
  ~GuardedRange();

  // A fault was caught in the range: from the faulting page to its end it now holds
  // private zero pages, not the object's memory, and stays so until unmapped.
  bool broken() const;
  explicit operator bool() const { return slot_ >= 0; }
  // Unguards now (before the caller unmaps the range).
  void Reset();

 private:
  friend class FaultGuard;
  explicit GuardedRange(int32_t slot) : slot_(slot) {}
  int32_t slot_ = -1;
};

class FaultGuard {
 public:
  // Ranges guarded at once (vm.max_map_count's default is 65530 mappings anyway).
  static constexpr size_t kCapacity = size_t{1} << 16;

  // Guards [begin, begin + length), which must be one mapping made by this process
  // whose start and length are multiples of `page` (its page size: 4 KiB, or the huge
  // page size on hugetlbfs). Installs the SIGBUS handler on first use, and again when
  // another handler replaced it since (it chains to that one). RESOURCE_EXHAUSTED
  // naming `entry` and the limit when kCapacity ranges are guarded already.
  static absl::StatusOr<GuardedRange> Guard(void* begin, uint64_t length, uint64_t page,
                                            std::string_view entry);
  // Faults caught in guarded ranges since the process started; it only grows. The
  // transfer engine compares it around each batch, so checking a batch's mappings
  // costs nothing while no fault happens.
  static uint64_t faults_caught();
  // Ranges guarded now.
  static size_t guarded_ranges();
};

}  // namespace kvagent::registry
