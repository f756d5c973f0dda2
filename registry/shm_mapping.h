// ShmMapping maps host memory that an engine shares with the agent (a MemoryObject:
// memfd, POSIX shm or hugetlbfs file), MAP_SHARED, and keeps the object open while
// mapped. Every mapping is guarded (registry/fault_guard.h): memory that vanishes
// under it (the file truncated, tmpfs full) marks it broken() instead of killing the
// process. Used by the region registry (import), peers' direct mappings and the
// agent's allocations.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "registry/fault_guard.h"
#include "registry/memory_object.h"

namespace kvagent::registry {

class ShmMapping {
 public:
  // Maps [offset, offset+length) of `object` read-write, MAP_SHARED, and faults the
  // range's pages in now (MADV_POPULATE_WRITE), not in the transfer path. `entry`
  // names the caller's region in errors. Mappings of one object share one mapping of
  // the whole object (one VMA, one guard slot), so 100,000 regions of one pool cost
  // one mapping, not 100,000 (vm.max_map_count is 65,530 by default): a live, intact
  // shared mapping that covers the range is reused (the object grew past it, or it is
  // broken: a new one is made).
  // INVALID_ARGUMENT when there is no object, length is 0, or the object is now (fstat
  // again: unsealed objects change size) smaller than offset+length (the message gives
  // both sizes; an overflowing sum is refused, not wrapped); RESOURCE_EXHAUSTED or
  // FAILED_PRECONDITION when mmap fails; RESOURCE_EXHAUSTED when FaultGuard's table
  // of guarded mappings is full.
  // With Populate::kLater the pages are left for the caller's Populate() (the registry
  // faults them in after it let go of its writer lock).
  enum class Populate { kNow, kLater };
  static absl::StatusOr<ShmMapping> Map(std::shared_ptr<const MemoryObject> object, uint64_t offset,
                                        uint64_t length, std::string_view entry,
                                        Populate populate = Populate::kNow);
  // Compatibility: MemoryObject::OpenPath(name, policy, entry) (see its refusals),
  // then Map.
  static absl::StatusOr<ShmMapping> OpenPath(const std::string& name, uint64_t offset,
                                             uint64_t length, std::string_view entry,
                                             const PathPolicy& policy,
                                             Populate populate = Populate::kNow);
  // Creates a new POSIX shm object of `bytes` (O_EXCL, mode 0600), maps it whole, and
  // unlinks the name when this mapping is destroyed. RESOURCE_EXHAUSTED when /dev/shm
  // has no room (the message gives free bytes).
  static absl::StatusOr<ShmMapping> Create(const std::string& name, uint64_t bytes);

  ShmMapping() = default;
  ShmMapping(ShmMapping&& other) noexcept;
  ShmMapping& operator=(ShmMapping&& other) noexcept;
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;
  ~ShmMapping();

  // Faults in, writable, the range's pages that the object already holds
  // (MADV_POPULATE_WRITE: contents untouched; every page of hugetlbfs and of memory the
  // agent allocated); an engine's holes are left
  // to whoever writes there first, since a page is charged to the memory cgroup of the
  // process that first touches it. Failures are left to the transfer path and the fault
  // guard. Safe while others read and write the range.
  void FaultIn() const;

  // First byte of the requested range (offset applied).
  void* data() const { return data_; }
  uint64_t length() const { return length_; }
  // The POSIX shm name of a mapping made by Create; empty for the others.
  const std::string& name() const { return name_; }
  // The mapped object (null for an empty mapping); it stays open while mapped.
  const std::shared_ptr<const MemoryObject>& memory() const { return memory_; }
  // Identity of the underlying object, to detect overlapping registrations.
  dev_t device() const { return memory_ ? memory_->device() : 0; }
  ino_t inode() const { return memory_ ? memory_->inode() : 0; }
  // Offset of data() inside the object.
  uint64_t offset() const { return offset_; }
  // A SIGBUS was caught in this mapping (FaultGuard): from the faulting page on it
  // holds zeros, not the object's bytes, until unmapped. Bytes moved through it since
  // the fault are not valid. Mappings sharing one whole-object mapping break together.
  bool broken() const;
  // mmaps alive now (each shared by the ShmMappings of one object, or one Create).
  static size_t shared_mappings();
  // Address space those mmaps take, and its bound (kvagentd --max-mapped-bytes,
  // default 16 TiB of the 128 TiB a process has). An object is mapped whole, and an
  // engine can share a sparse memfd of tens of TiB that costs it nothing: past the
  // bound a mapping is refused (RESOURCE_EXHAUSTED, counted) instead of leaving the
  // process no address space for its heap and threads.
  static uint64_t mapped_bytes();
  static uint64_t mapped_refusals();
  static void SetMappedBytesBound(uint64_t bytes);
  static constexpr uint64_t kDefaultMappedBytesBound = uint64_t{16} << 40;

  // First touch in the background. MADV_POPULATE_WRITE (Map) fills the page tables,
  // but on some VMs a page's first CPU access through a new mapping still costs a
  // fault below Linux (5-18 us per 4 KiB page measured here, docs/BENCHMARKS.md), which
  // the first transfer touching it would pay. With warming on, each Map queues its
  // range, and one thread ("map-warm", at nice 19: it takes only CPU nothing else
  // wants) reads one byte per page of it (under the fault guard; a mapping released or
  // broken meanwhile is skipped), so the first transfers find the pages mapped. Where
  // populating sufficed a pass costs ~0.02 us per page.
  // Off by default (kvagentd --warm-mappings on turns it on).
  static void SetWarming(bool on);
  struct WarmingStats {
    uint64_t pages_touched = 0;  // since the process started
    uint64_t pages_queued = 0;   // waiting now (includes the range being touched)
    uint64_t ranges_skipped = 0; // released or broken before they were touched through
  };
  static WarmingStats warming();
  // Tests: while held, the map-warm thread takes no new range (it finishes the one it
  // is in), so a test can release or truncate a mapping before it is touched.
  static void HoldWarmingForTest(bool hold);
  // What unmaps a mapping's memory when its last user goes: `retire(base, length)`
  // is asked first, and a true answer means it took the range (the agent's UCX
  // hardening: a peer's software get reply waiting in UCX may still read it, see
  // transport/ucx_hardening.h, RetireMapping); false, or none set, and it is
  // munmapped. Set once, before any mapping.
  static void SetRetire(bool (*retire)(void* base, uint64_t length));

  struct Segment;  // one mmap of a whole object, guarded; unmapped with its last user

 private:
  static absl::StatusOr<std::shared_ptr<Segment>> MapSegment(
      const std::shared_ptr<const MemoryObject>& object, uint64_t length,
      std::string_view entry);
  void Reset();
  std::string name_;
  std::shared_ptr<const MemoryObject> memory_;
  std::shared_ptr<Segment> segment_;
  void* data_ = nullptr;
  uint64_t length_ = 0;
  uint64_t offset_ = 0;
  bool owner_ = false;  // unlink name_ on destruction
};

}  // namespace kvagent::registry
