// RegionRegistry holds the memory regions engines registered with this agent:
// validated layout, imported mapping, UCX registration, packed rkey and the owner
// that registered it. Groups order regions by registration order, may name each
// region's role in the group, and belong to one owner. Used by the agent's service
// (register, deregister, list, export to peers) and by the transfer planner (lookups).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "proto/kvagent.pb.h"
#include "registry/cuda_ipc_mapping.h"
#include "registry/cuda_vmm_mapping.h"
#include "registry/device_memory_object.h"
#include "registry/memory_object.h"
#include "registry/shm_mapping.h"
#include "transport/ucx_context.h"

namespace kvagent::registry {

// An immutable registered region. Transfers hold a shared_ptr, so the memory stays
// mapped and registered until the last transfer using it lets go, even after
// deregistration.
struct Region {
  v1::RegionSpec spec;       // as registered, item_stride normalized (never 0)
  // Position in its group. The one field that changes: when a region of the group is
  // deregistered, the remaining ones are renumbered 0..n-1 in registration order.
  // Written atomically under the registry's lock; read it through Info() (atomic
  // load) or under the registry's lock (FindGroup/Export order by it).
  uint32_t group_position = 0;
  // First byte in this process. For VRAM a device pointer (UVA): never dereference
  // it on the host.
  uint64_t base_address = 0;
  // How transfers reach the memory: "host" (DRAM), "zero-copy" (VRAM registered with
  // UCX as CUDA memory) or "staged" (VRAM moved through host buffers; no UCX
  // registration, so no rkey).
  std::string memory_path;
  // The principal that registered it (RegisterContext::owner): only it may remove it.
  std::string owner;
  ShmMapping mapping;                  // DRAM; mapping.memory() is the object
  std::optional<CudaIpcMapping> cuda;  // VRAM by CUDA IPC handle (cuda_ipc)
  // VRAM by CUDA VMM (cuda_vmm): the object's one import, shared by its regions;
  // base_address is its address() plus spec.cuda_vmm().offset().
  std::shared_ptr<const CudaVmmMapping> vmm;
  transport::MemoryRegistration registration;  // empty for staged VRAM

  uint64_t num_items() const { return spec.layout().num_items(); }
  uint64_t item_bytes() const { return spec.layout().item_bytes(); }
  uint64_t item_stride() const { return spec.layout().item_stride(); }
  uint64_t ItemAddress(uint64_t index) const { return base_address + index * item_stride(); }
  v1::RegionInfo Info() const;
};

using RegionPtr = std::shared_ptr<const Region>;

struct RegisterResult {
  std::vector<RegionPtr> regions;     // in request order, skipped ones left out
  std::vector<std::string> skipped;   // names skipped under skip_empty
  uint64_t version = 0;
};

struct RegistryOptions {
  // VRAM when UCX cannot register CUDA memory: true moves it through host staging
  // buffers (memory_path "staged"); false rejects such regions (FAILED_PRECONDITION).
  bool vram_staging = true;
  // For tests only (kvagentd --stage-host-regions): host regions take the "staged"
  // path too (still registered with UCX), so machines without a GPU run every byte
  // through the staging protocol.
  bool stage_host_regions = false;
};

// How a region's memory is moved: "host" for DRAM; for VRAM "zero-copy" when UCX has
// CUDA memory support, else "staged" when staging is allowed, else
// FAILED_PRECONDITION whose cause and fix mention `ucx_detail` (UCX's version,
// transports and memory types) when given.
absl::StatusOr<std::string> MemoryPathFor(v1::MemoryKind kind, bool ucx_cuda,
                                          bool staging_allowed,
                                          std::string_view ucx_detail = "");

// FAILED_PRECONDITION when pinning `bytes_to_pin` bytes in total exceeds the
// locked-memory `limit` (RLIM_INFINITY means none), naming `entry` and the ways to
// raise the limit.
absl::Status CheckMemlock(uint64_t bytes_to_pin, uint64_t limit, std::string_view entry);

// True when this process holds CAP_IPC_LOCK (its effective set, /proc/self/status):
// RLIMIT_MEMLOCK does not bind it (mlock and RDMA registration both check it).
bool HasIpcLockCapability();

// True when one of UCX's transports is RDMA (rc*, ud*, dc*, ib*), which pins
// registered host memory and so counts against RLIMIT_MEMLOCK.
bool PinsRegisteredMemory(const std::vector<std::string>& transports);

// What a batch would add to what is registered, for RegisterContext::admit.
struct RegisterUsage {
  uint64_t regions = 0;         // registered now, all owners
  uint64_t owner_regions = 0;   // registered now by the batch's owner
  uint64_t owner_bytes = 0;     // their bytes
  uint64_t metadata_bytes = 0;  // the catalog peers fetch, estimated (ExportBytes)
  uint64_t new_regions = 0;     // the batch's
  uint64_t new_bytes = 0;
  uint64_t new_metadata_bytes = 0;
};

// What is registered, kept current (RegionRegistry::Usage): for GetStatus.
struct RegistryUsage {
  uint64_t regions = 0;
  uint64_t bytes = 0;
  uint64_t metadata_bytes = 0;  // sum of ExportBytes
  uint64_t largest_owner_regions = 0;
  uint64_t largest_owner_bytes = 0;
};

// Who registers, and how their memory is reached.
struct RegisterContext {
  // The caller's principal ("session:7 uid:1000 (engine-a)"); regions and groups it
  // registers belong to it.
  std::string owner;
  // Where shm.name may point (compatibility registration by name).
  PathPolicy path_policy;
  // Resolves shm.memory_handle to the caller's shared memory (its session's
  // ShareMemory / AllocateMemory handles). Null: the caller has no local session, so
  // handles are refused.
  std::function<absl::StatusOr<std::shared_ptr<const MemoryObject>>(uint64_t handle)>
      resolve_handle;
  // Resolves cuda_vmm.memory_handle to the caller's shared device memory (its
  // session's ShareDeviceMemory handles). Null: no local session, handles refused.
  std::function<absl::StatusOr<std::shared_ptr<const DeviceMemoryObject>>(uint64_t handle)>
      resolve_device_handle;
  // Decides whether a batch that passed the per-entry checks fits the agent's limits
  // (regions, bytes, catalog size); a refusal is returned as is and nothing is
  // imported. Called under the registry's writer lock, so the usage it sees is
  // exact. Null: no limit.
  std::function<absl::Status(const RegisterUsage& usage)> admit;
};

// Bytes a region adds to the metadata peers fetch: its strings, its packed rkey
// (`rkey_bytes`) and the fixed fields, with protobuf framing (an upper estimate).
uint64_t ExportBytes(const v1::RegionSpec& spec, uint64_t rkey_bytes);

class RegionRegistry {
 public:
  explicit RegionRegistry(const transport::UcxContext* context, RegistryOptions options = {})
      : context_(context), options_(options) {}

  // Registers `specs` for context.owner. All-or-nothing. Every bad entry is
  // reported in one status (the code of the first), one line per entry naming it (an
  // escaped, bounded prefix of every echoed input), the cause and the fix. Checks:
  // name empty or duplicate agent-wide (in the batch or already registered); name,
  // group or shm.name over the 256 bytes peers accept (CatalogLimits) or holding NUL
  // or control characters; kind not KV/STATE/AUX (unspecified is accepted); memory
  // not DRAM/VRAM; zero length (or skipped with skip_empty); layout (num_items,
  // item_bytes > 0; stride >= item_bytes; last item inside length, overflow-safe);
  // memory: shm.memory_handle through context.resolve_handle (FAILED_PRECONDITION
  // without a resolver; its errors pass through), else shm.name through
  // MemoryObject::OpenPath with context.path_policy (NOT_FOUND, PERMISSION_DENIED,
  // INVALID_ARGUMENT); object too small; overlap with another region of the same
  // object (device, inode) or device range; a group that another owner's regions use
  // (PERMISSION_DENIED) or whose regions disagree in num_items; a role over 128 bytes
  // (CatalogLimits::max_role_bytes) or holding a control character, or one that
  // another region of the same group (registered or in the batch) declares, naming
  // that region (ungrouped regions may carry any role); VRAM without a
  // cuda_vmm or cuda_ipc source, DRAM without shm, or DRAM with a CUDA source
  // (INVALID_ARGUMENT); cuda_vmm: memory_handle 0 (INVALID_ARGUMENT), resolved through
  // context.resolve_device_handle (FAILED_PRECONDITION without one; its errors pass
  // through; NOT_FOUND when it yields nothing), offset + length beyond the bytes
  // shared or overlapping another region of the same object (INVALID_ARGUMENT), then
  // imported once per object (CudaVmmMapping: the device ordinal and the allocation
  // checked by the driver); no CUDA driver, UCX
  // without CUDA and staging off, or RLIMIT_MEMLOCK too low for memory RDMA pins
  // (FAILED_PRECONDITION); the owner ended before the commit (SetOwnerCheck:
  // UNAUTHENTICATED). Nothing registered before is touched.
  absl::StatusOr<RegisterResult> Register(const std::vector<v1::RegionSpec>& specs, bool skip_empty,
                                          const RegisterContext& context);
  // Removes `names` on behalf of `owner`. All-or-nothing: NOT_FOUND naming every
  // unknown name; else PERMISSION_DENIED naming every region another owner holds and
  // that owner (unless `any_owner`: a role the operator grants). Returns the new
  // version. The regions leave the catalog at once; their memory (UCX registration,
  // mapping) is released when the last RegionPtr goes: with `retired` (may be null),
  // the caller holds them until peers no longer write there (a put that UCX tcp still
  // delivers into an unmapped region would crash this process).
  absl::StatusOr<uint64_t> Deregister(const std::vector<std::string>& names,
                                      std::vector<RegionPtr>* retired, const std::string& owner,
                                      bool any_owner);
  // Removes every region `owner` holds (its local session ended), gathered under the
  // writer lock: a registration of `owner` still running when it is called either
  // committed before (and goes now) or fails (see SetOwnerCheck), and a region of it
  // deregistered meanwhile is simply no longer there (it does not stop the rest). The
  // names removed go to `removed` (may be null), the regions to `retired` as with
  // Deregister. Returns the new version (unchanged when the owner held nothing).
  uint64_t DeregisterOwner(const std::string& owner, std::vector<RegionPtr>* retired,
                           std::vector<std::string>* removed = nullptr);
  // Whether an owner may still gain regions: `ended(owner)` true means its principal
  // has ended (a local session closed), and a registration for it fails
  // UNAUTHENTICATED instead of committing. Asked under the writer lock right before a
  // registration commits (and before its memory is imported), so an owner that ends
  // and then has DeregisterOwner called leaves nothing behind. Set once, before
  // registrations; null (the default): no owner ends.
  using OwnerEnded = std::function<bool(const std::string& owner)>;
  void SetOwnerCheck(OwnerEnded ended);

  RegionPtr Find(const std::string& name) const;
  // Regions of `group` by position; empty when there is none.
  std::vector<RegionPtr> FindGroup(const std::string& group) const;
  // Calls `visit` with each region of `group` by position, under the registry's
  // reader lock: no vector is made and no reference count touched (the receiving
  // side's owners lookup, once per incoming transfer). `visit` must not call into the
  // registry. False when the group has no region.
  bool VisitGroup(const std::string& group, absl::FunctionRef<void(const Region&)> visit) const;
  std::vector<std::string> GroupNames() const;
  std::vector<RegionPtr> List() const;  // by registration order
  uint64_t version() const;
  uint64_t registered_bytes() const;
  // Counts, bytes, the catalog's size as peers fetch it (the sum of ExportBytes) and
  // the largest owner's share, in O(owners).
  RegistryUsage Usage() const;

  // The regions as peers see them (addresses, layouts, packed rkeys; staged VRAM
  // regions have no UCX registration and go out with an empty rkey). Only for a peer
  // on the same host (`same_host`: reached through its local door) also where the
  // memory is: memory_id/memory_offset of DRAM regions (the peer fetches the
  // descriptor by id, see FindMemory) and the CUDA IPC fields of VRAM ones by
  // cuda_ipc, and of VRAM by cuda_vmm the allocation's id, size and device and the
  // region's offset (the peer fetches the descriptor by id, see FindDeviceMemory).
  // Never names of files.
  void Export(v1::AgentMetadata* metadata, bool same_host) const;
  // What changed since `known_version`, as a delta (AgentMetadata.delta: the regions
  // added, replaced or renumbered in their group, and the names removed), exported as
  // Export does. False, leaving `metadata` alone, when the change log no longer
  // reaches back to `known_version` (or it is newer than the catalog): then send the
  // whole catalog.
  bool ExportDelta(uint64_t known_version, v1::AgentMetadata* metadata, bool same_host) const;

  // The memory object with this id (MemoryObject::id) when a registered region uses
  // it, else null: what a same-host peer may ask for by ExportedRegion.memory_id.
  std::shared_ptr<const MemoryObject> FindMemory(uint64_t memory_id) const;
  // The CUDA VMM allocation a registered region was imported from, by its id, else
  // null: what a same-host peer may ask for by ExportedRegion.cuda_vmm_id.
  std::shared_ptr<const DeviceMemoryObject> FindDeviceMemory(uint64_t device_memory_id) const;

 private:
  // Register without faulting the host pages in (Register does that after the writer
  // lock is let go).
  absl::StatusOr<RegisterResult> RegisterUnpopulated(const std::vector<v1::RegionSpec>& specs,
                                                     bool skip_empty,
                                                     const RegisterContext& context);
  const transport::UcxContext* context_;
  const RegistryOptions options_;
  // Serializes Register/Deregister so that validation, import and UCX registration
  // run without holding mu_ (lookups by transfers never wait on memory pinning).
  absl::Mutex write_mu_;
  OwnerEnded owner_ended_ ABSL_GUARDED_BY(write_mu_);
  mutable absl::Mutex mu_;
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  struct Entry {
    uint64_t sequence;
    RegionPtr region;
  };
  absl::flat_hash_map<std::string, Entry> regions_ ABSL_GUARDED_BY(mu_);
  // Kept as regions come and go, so that GetStatus costs O(owners), not O(regions).
  struct OwnerUsage {
    uint64_t regions = 0;
    uint64_t bytes = 0;
  };
  void CountLocked(const RegionPtr& region, int sign) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes `names` (one not registered, or named again, is skipped): counts, groups
  // renumbered, the change logged. Returns the regions removed.
  std::vector<RegionPtr> RemoveLocked(const std::vector<std::string>& names)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_, mu_);
  // Regions by group (FindGroup is on every transfer's path: O(group), not O(regions)).
  // Each vector is in position order, so readers need not sort: a commit numbers new
  // members in the order it appends them, a removal keeps the others' order, and a
  // renumbering numbers them by registration sequence, which is the order they were
  // appended in.
  absl::flat_hash_map<std::string, std::vector<RegionPtr>> groups_ ABSL_GUARDED_BY(mu_);
  RegistryUsage usage_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, OwnerUsage> by_owner_ ABSL_GUARDED_BY(mu_);

  // The change log behind ExportDelta: one entry per version, the oldest dropped
  // past kChangeLogVersions entries or kChangeLogBytes of names. A delta from
  // version v needs every entry after v, so it can be answered for v >= log_base_.
  static constexpr size_t kChangeLogVersions = 4096;
  static constexpr uint64_t kChangeLogBytes = 16 << 20;
  struct Change {
    uint64_t version = 0;
    std::vector<std::string> added;        // registered at this version
    std::vector<std::string> removed;      // deregistered
    std::vector<std::string> renumbered;   // kept, with a new group_position
    uint64_t bytes = 0;                    // names' bytes, plus 32 per name
  };
  void LogChange(Change change) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExportRegion(const Region& region, bool same_host, v1::ExportedRegion* out) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  std::deque<Change> changes_ ABSL_GUARDED_BY(mu_);
  uint64_t change_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t log_base_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvagent::registry
