// DestinationLedger: the destination byte ranges each active transfer writes, per peer
// (or this agent's memory) and region, so that neither two transfers nor two chunks of
// one write the same bytes (PlanTransfer refuses them within one call). For the engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/inlined_vector.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "planning/transfer_plan.h"
#include "proto/kvagent.pb.h"
#include "registry/remote_catalog.h"

namespace kvagent::planning {

// Bytes [begin, end) of the destination region named `region` (by name, as transfers
// address regions; offsets from the region's start).
struct DestinationRange {
  std::string region;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// The ranges `plan` writes: in the peer's regions for WRITE (named through
// `remote`, which must be the catalog the plan was made with: ops name regions by
// rkey slot), in this agent's regions for READ (plan.local_regions). Grouped by
// region, by offset within one; touching ranges are merged, so a run of pages that
// is contiguous on the destination side is one range. About linear in the plan's ops
// (a radix sort per region): ~20 ms for 1M scattered pages (transfer_plan_benchmark).
std::vector<DestinationRange> DestinationRanges(const TransferPlan& plan, v1::TransferOp op,
                                                const registry::RemoteCatalog& remote);

// The ledger key of a transfer's destination: "peer:<name>" for WRITE (the peer's
// memory), "local" for READ (this agent's memory, whichever peer it is read from).
std::string DestinationKey(v1::TransferOp op, const std::string& peer);
// The same, for WRITE with the peer's incarnation: "peer:<name>#<incarnation in hex>" (a
// restarted peer's memory is new); READ's is "local". Built in one allocation (it is
// on every submit's path).
std::string DestinationKey(v1::TransferOp op, const std::string& peer, uint64_t incarnation);

// How the transfer engine uses it:
//  - Claim(transfer_id, DestinationKey(op, peer), DestinationRanges(plan, op, catalog))
//    for every accepted chunk, right after PlanTransfer and as the last check that can
//    refuse the chunk (a Claim cannot be undone for one chunk alone): an error refuses
//    the chunk, with the ledger's message (FAILED_PRECONDITION). A resubmitted chunk
//    (an idempotent retry the engine recognizes) must not be claimed again: it would
//    overlap its own first claim.
//  - Release(transfer_id) once none of the transfer's operations can still write its
//    destination: when it ended and is drained (or the engine stopped waiting for a
//    drain that cannot be known). A refused Claim claimed nothing.
// Writes by other agents into this agent's memory are not seen here (their agent
// holds them). Thread-safe.
class DestinationLedger {
 public:
  DestinationLedger() = default;
  DestinationLedger(const DestinationLedger&) = delete;
  DestinationLedger& operator=(const DestinationLedger&) = delete;

  // Records `ranges` as written by `transfer_id` under `key`, all or nothing.
  // FAILED_PRECONDITION naming the transfer, the region, both ranges and the fix when
  // a range overlaps one that another transfer claimed under `key` (it is still
  // writing there), or one that `transfer_id` claimed before (an earlier chunk) or
  // names twice itself. Empty ranges are ignored; INVALID_ARGUMENT for end < begin.
  // O(r log n) for r ranges against n claimed.
  absl::Status Claim(const std::string& transfer_id, const std::string& key,
                     const std::vector<DestinationRange>& ranges);

  // Forgets every range `transfer_id` claimed, under every key; no-op when none.
  void Release(const std::string& transfer_id);

  // Ranges claimed now, over all transfers and keys.
  size_t claimed_ranges() const;

 private:
  struct Holder;
  struct Claimed {
    uint64_t end = 0;
    const Holder* holder = nullptr;
  };
  // By begin; the ranges of one region never overlap.
  using Intervals = std::map<uint64_t, Claimed>;
  using Regions = absl::node_hash_map<std::string, Intervals>;
  // What one transfer holds in one region, to release it without a search. The key
  // and the region point at keys_' node keys (node maps: stable while the region
  // holds a range, as `intervals` is), so a claim copies no strings; a transfer
  // usually holds one region and a few ranges, kept inline.
  struct Held {
    const std::string* key = nullptr;
    const std::string* region = nullptr;
    Intervals* intervals = nullptr;
    absl::InlinedVector<uint64_t, 2> begins;
  };
  struct Holder {
    const std::string* transfer_id = nullptr;  // holders_' node key
    absl::InlinedVector<Held, 1> held;
  };

  mutable absl::Mutex mu_;
  // key -> region -> claimed ranges. Node maps: Held keeps pointers into them.
  absl::node_hash_map<std::string, Regions> keys_ ABSL_GUARDED_BY(mu_);
  absl::node_hash_map<std::string, Holder> holders_ ABSL_GUARDED_BY(mu_);
  size_t claimed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvagent::planning
