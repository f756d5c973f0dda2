// DestinationLedger: the destination byte ranges each active transfer writes, per peer
// (or this agent's memory) and region, so that neither two transfers nor two chunks of
// one write the same bytes (PlanTransfer refuses them within one call). For the engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/inlined_vector.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "absl/synchronization/mutex.h"
#include "planning/transfer_plan.h"
#include "proto/kvagent.pb.h"
#include "registry/remote_catalog.h"

namespace kvagent::planning {

// Bytes [begin, end) of the destination region named `region` (by name, as transfers
// address regions; offsets from the region's start). The name is a view: of the
// catalog's or registry's name for DestinationRanges' ranges (use them while the plan
// and the catalog live), of the caller's strings otherwise.
struct DestinationRange {
  std::string_view region;
  uint64_t begin = 0;
  uint64_t end = 0;
};
// A one-page plan's ranges (one or two regions) fit inline: no allocation.
using DestinationRangeList = absl::InlinedVector<DestinationRange, 2>;

// The ranges `plan` writes: in the peer's regions for WRITE (named through
// `remote`, which must be the catalog the plan was made with: ops name regions by
// rkey slot), in this agent's regions for READ (plan.local_regions). Grouped by
// region, by offset within one; touching ranges are merged, so a run of pages that
// is contiguous on the destination side is one range. About linear in the plan's ops
// (a radix sort per region): ~20 ms for 1M scattered pages (transfer_plan_benchmark).
DestinationRangeList DestinationRanges(const TransferPlan& plan, v1::TransferOp op,
                                       const registry::RemoteCatalog& remote);

// The ledger key of a transfer's destination: "peer:<name>" for WRITE (the peer's
// memory), "local" for READ (this agent's memory, whichever peer it is read from).
std::string DestinationKey(v1::TransferOp op, const std::string& peer);
// The same, for WRITE with the peer's incarnation: "peer:<name>#<incarnation in hex>" (a
// restarted peer's memory is new); READ's is "local". Written into `key`, replacing
// what it held (a caller that keeps the string allocates nothing once warm: it is on
// every submit's path).
void DestinationKeyInto(v1::TransferOp op, const std::string& peer, uint64_t incarnation,
                        std::string* key);
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
  absl::Status Claim(const std::string& transfer_id, std::string_view key,
                     absl::Span<const DestinationRange> ranges);

  // Forgets every range `transfer_id` claimed, under every key; no-op when none.
  void Release(const std::string& transfer_id);

  // Ranges claimed now, over all transfers and keys.
  size_t claimed_ranges() const;
  // Regions (under any key) the ledger has an entry for: those holding a claimed
  // range, and at most kKeptEmptyRegions that hold none (kept for the next claim).
  size_t region_entries() const;

  // A steady stream of transfers to the same destinations claims and releases without
  // allocating: up to this many regions that no transfer holds keep their entry (key,
  // name and all), and released ranges' and transfers' entries are kept spare (up to
  // kSpare of each) for the next claims.
  static constexpr size_t kKeptEmptyRegions = 256;
  static constexpr size_t kSpare = 64;  // a burst of transfers in flight

 private:
  struct Holder;
  struct Claimed {
    uint64_t end = 0;
    const Holder* holder = nullptr;
  };
  // By begin; the ranges of one region never overlap.
  using Intervals = std::map<uint64_t, Claimed>;
  using Regions = absl::node_hash_map<std::string, Intervals>;
  // What one transfer holds in one region, to release it without a search:
  // `intervals` points into keys_' region map (a node map: stable while the region's
  // entry lives, which is at least while it holds a range); a transfer usually holds
  // one region and a few ranges, kept inline.
  struct Held {
    Intervals* intervals = nullptr;
    absl::InlinedVector<uint64_t, 2> begins;
  };
  struct Holder {
    const std::string* transfer_id = nullptr;  // holders_' node key
    absl::InlinedVector<Held, 1> held;
  };

  using Holders = absl::node_hash_map<std::string, Holder>;
  // Erases every region entry that holds no range, but `keep`'s, and the keys left
  // with none.
  void DropEmptyRegionsLocked(const Intervals* keep) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  // key -> region -> claimed ranges. Node maps: Held keeps pointers into them.
  absl::node_hash_map<std::string, Regions> keys_ ABSL_GUARDED_BY(mu_);
  Holders holders_ ABSL_GUARDED_BY(mu_);
  size_t claimed_ ABSL_GUARDED_BY(mu_) = 0;
  size_t regions_ ABSL_GUARDED_BY(mu_) = 0;        // entries in keys_' region maps
  size_t empty_regions_ ABSL_GUARDED_BY(mu_) = 0;  // of those, holding no range
  // Released ranges' map nodes and released transfers' holder nodes (their key
  // strings keep their storage), for the next claims.
  std::vector<Intervals::node_type> spare_ranges_ ABSL_GUARDED_BY(mu_);
  std::vector<Holders::node_type> spare_holders_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvagent::planning
