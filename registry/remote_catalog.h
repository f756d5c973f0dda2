// RemoteCatalog is a validated view of a peer's exported regions, built from the
// AgentMetadata a peer sent. Peer bytes are untrusted: every count and size is
// bounded and checked before use. Used by the transfer planner and the agent.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "proto/kvagent.pb.h"

namespace kvagent::registry {

struct RemoteRegion {
  std::string name;
  std::string group;
  uint32_t group_position = 0;
  // ExportedRegion.role: what the region holds in its group ("L0.K"), unique within
  // the group; empty when the peer declares none. The planner pairs groups by it.
  std::string role;
  v1::MemoryKind memory = v1::DRAM;  // DRAM or VRAM (any other value reads as DRAM)
  uint64_t base_address = 0;
  uint64_t length = 0;
  uint64_t num_items = 0;
  uint64_t item_bytes = 0;
  uint64_t item_stride = 0;
  uint32_t rkey_slot = 0;  // index into the peer's unpacked rkey table (= region index)
  std::string cuda_ipc_handle;  // VRAM: 64 bytes, empty otherwise
  int32_t cuda_device = 0;
  uint64_t cuda_offset = 0;
  // Same-host peers only: the peer's memory object (fetch its descriptor by this id
  // over the peer's session socket) and the region's offset inside it. 0 when none.
  uint64_t memory_id = 0;
  uint64_t memory_offset = 0;
  // Same-host peers only, VRAM by CUDA VMM: the shared allocation (fetch its descriptor
  // by this id over the peer's session socket), its size as shared, and the region's
  // offset in it (on cuda_device). 0 when none. Not checked here: the importer checks
  // offset + length against the size before it maps anything (else host staging).
  uint64_t cuda_vmm_id = 0;
  uint64_t cuda_vmm_bytes = 0;
  uint64_t cuda_vmm_offset = 0;
  // The peer moves this region's bytes through host staging: data goes to it as
  // staged chunks (active messages), never by RMA. Its memory_path "staged", or VRAM
  // without an rkey from a peer that does not say.
  bool staged = false;
  uint64_t ItemAddress(uint64_t index) const { return base_address + index * item_stride; }
};

struct CatalogLimits {
  // 100,000 regions fit (one per KV block of a large pool); the agent's --max-regions
  // default matches.
  uint32_t max_regions = 131072;
  uint64_t max_rkey_bytes = 4096;
  uint64_t max_name_bytes = 256;
  // Also what this agent's registry accepts for RegionSpec.role.
  uint64_t max_role_bytes = 128;
  uint64_t max_worker_address_bytes = 16384;
};

struct AppliedDelta;

class RemoteCatalog {
 public:
  // INVALID_ARGUMENT naming the peer, the region and the field for: too many
  // regions, empty/oversized names, duplicate names, oversized rkey or an empty one
  // for DRAM (staged VRAM has none), zero
  // item size, stride < item size, layout beyond length, base+length overflow, a
  // group whose positions are not 0..n-1, empty or oversized worker address,
  // memory_offset + length overflowing, a role over max_role_bytes or holding a
  // control character, a role declared twice in one group (naming the group and both
  // regions).
  static absl::StatusOr<RemoteCatalog> FromMetadata(const v1::AgentMetadata& metadata,
                                                    const CatalogLimits& limits = {});

  // The view at delta.version(), from this one (its version must be
  // delta.base_version()): without delta.removed_regions, with delta.regions added or
  // replaced by name. The added regions are checked as FromMetadata checks them, and
  // so is the result (names, group positions, roles). INVALID_ARGUMENT saying why the
  // delta does not apply (not a delta, another peer, another base version, a removed
  // name this view lacks, a name both removed and added, too many regions, a bad
  // region or group); the caller then fetches the whole catalog.
  absl::StatusOr<AppliedDelta> ApplyDelta(const v1::AgentMetadata& delta,
                                          const CatalogLimits& limits = {}) const;

  const std::string& peer() const { return peer_; }
  uint64_t version() const { return version_; }
  const std::vector<RemoteRegion>& regions() const { return regions_; }
  const RemoteRegion* Find(const std::string& name) const;
  // By position; empty when the peer has no such group.
  std::vector<const RemoteRegion*> FindGroup(const std::string& group) const;
  // The same members as indices into regions(), without copying them (the planner's
  // per-transfer lookup); empty when the peer has no such group.
  absl::Span<const uint32_t> GroupSlots(const std::string& group) const;
  std::vector<std::string> GroupNames() const;

 private:
  std::string peer_;
  uint64_t version_ = 0;
  std::vector<RemoteRegion> regions_;
  absl::flat_hash_map<std::string, uint32_t> by_name_;
  absl::flat_hash_map<std::string, std::vector<uint32_t>> groups_;

  // Numbers slots 0..n-1 in order, indexes names and groups and checks them.
  absl::Status Index();
};

struct AppliedDelta {
  static constexpr uint32_t kNew = UINT32_MAX;
  // Regions kept from the base view (in its order), then the delta's in its order.
  RemoteCatalog catalog;
  // For each region of `catalog`, its slot in the base view (its rkey and mapping may
  // be reused), or kNew for one the delta brought (the delta's regions(i) is
  // catalog.regions()[first kNew + i]).
  std::vector<uint32_t> base_slots;
};

}  // namespace kvagent::registry
