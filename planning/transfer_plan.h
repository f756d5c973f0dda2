// Transfer planning: expands a transfer's segments (group x index lists, byte
// ranges) into (local address, remote address, bytes) operations and merges runs
// that are contiguous on both sides. Used by the agent's transfer engine.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "google/protobuf/repeated_field.h"
#include "proto/kvagent.pb.h"
#include "registry/region_registry.h"
#include "registry/remote_catalog.h"

namespace kvagent::planning {

struct PlanOp {
  uint64_t local_address = 0;
  uint64_t remote_address = 0;
  uint64_t length = 0;
  uint32_t rkey_slot = 0;  // RemoteRegion::rkey_slot of the remote side
  uint32_t segment = 0;    // segment number across the whole transfer
  bool local_device = false;   // local_address is VRAM (a CUDA device pointer)
  bool remote_device = false;  // remote_address is the peer's VRAM
};

struct TransferPlan {
  std::vector<PlanOp> ops;               // coalesced, in segment order
  uint64_t bytes = 0;
  uint64_t items = 0;                    // items named by item segments (pages, slots)
  std::vector<registry::RegionPtr> local_regions;  // pinned for the life of the transfer
};

// Plans `segments` of a transfer whose direction is `op` (WRITE or READ, else
// INVALID_ARGUMENT), numbering them from `first_segment`. Errors name the segment
// number, the cause and the fix: unknown local or remote group/region (NOT_FOUND,
// listing the known names), index lists of unequal length, an index out of range (the
// index, its position and num_items), paired regions with different item sizes, a
// byte range outside its region, an empty segment (INVALID_ARGUMENT).
//
// Size: a chunk that would expand to more than `max_ops` operations (before runs
// merge) is refused with RESOURCE_EXHAUSTED naming the segment and the count, before
// they are built.
//
// Pairing: an item segment pairs the regions of its local group with those of its
// remote group. When every region of both groups declares a role (RegionSpec.role),
// regions pair by role, whatever their positions; both groups must then declare the
// same roles (else INVALID_ARGUMENT listing the roles found on one side only). When
// only one side, or only some regions, declare roles, INVALID_ARGUMENT naming the side
// that lacks them. When neither declares any, regions pair position by position and
// the groups must have the same size. Operations come region-major (the local group's
// order), so consecutive indices of one region coalesce.
//
// Destinations: the remote side for WRITE, the local side for READ. A plan in which
// any destination byte would be written twice is refused (INVALID_ARGUMENT naming
// the segment(s), the region, the index or byte range, and the fix): an index
// repeated in one item segment's destination list or across item segments of the
// same destination group, byte segments overlapping each other or an item that an
// item segment writes in the same region. O(n log n) in the indices and byte ranges
// named. Writes across chunks and concurrent transfers are the DestinationLedger's
// (planning/destination_ledger.h).
absl::StatusOr<TransferPlan> PlanTransfer(
    const registry::RegionRegistry& local, const registry::RemoteCatalog& remote,
    const google::protobuf::RepeatedPtrField<v1::Segment>& segments, uint32_t first_segment,
    v1::TransferOp op, uint64_t max_ops = UINT64_MAX);

// Merges neighbours within one segment when both the local and the remote ranges
// continue each other and they use the same rkey slot. Keeps order.
void Coalesce(std::vector<PlanOp>* ops);

}  // namespace kvagent::planning
