// Limits: every table, queue and request size that a caller or a peer can grow has a
// bound here, a flag that sets it, a counter of refusals, and one refusal text
// (RESOURCE_EXHAUSTED naming the limit, its value, what was asked and the flag).
// docs/LIMITS.md lists them; GetStatus reports each one's use and refusals.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace kvagent::agent {

enum class Limit : int {
  kRegions = 0,              // regions registered on this agent
  kRegionsPerOwner,          // regions one principal registered
  kRegisteredBytesPerOwner,  // bytes of regions one principal registered
  kMetadataBytes,            // bytes of the catalog peers fetch (under their 64 MiB)
  kAllocatedBytes,           // AllocateMemory bytes held, all sessions
  kAllocatedBytesPerOwner,   // AllocateMemory bytes held by one principal
  kActiveTransfers,          // outgoing transfers not yet ended
  kActiveTransfersPerOwner,  // ... of one principal
  kOpsPerChunk,              // operations one submitted chunk expands to
  kPlannedOps,               // operations planned and not yet posted, all transfers
  kQueuedNotifications,      // notifications waiting for a client
  kQueuedNotificationBytes,  // their bytes
  kStreams,                  // Watch* streams open, all callers
  kStreamsPerCaller,         // ... of one principal
  kPendingConnects,          // ConnectPeer calls in progress
  kPeerCallers,              // peer identities tracked (metadata watchers, secrets)
  kSubscriptions,            // durable notification subscriptions
  kInFlightPerSubscription,  // notifications one subscription holds unacknowledged
  kMemoryHandles,            // memory handles (shared, allocated) held, all sessions
  kMemoryHandlesPerSession,  // ... by one session
  kCount,
};

inline constexpr int kLimitCount = static_cast<int>(Limit::kCount);

struct LimitInfo {
  std::string_view name;   // as GetStatus and docs/LIMITS.md name it
  std::string_view flag;   // kvagentd flag that sets it
  std::string_view unit;   // "regions", "bytes", ...
  uint64_t default_value;  // 0: derived at start (see DefaultLimitValue)
  std::string_view help;   // one line for --help
};

const LimitInfo& InfoOf(Limit limit);

// The values in force, and the refusals counted per limit. Shared by the agent's
// components (they hold a const pointer; counting is atomic).
class Limits {
 public:
  // Defaults: each LimitInfo::default_value; the allocation limits derive from the
  // machine's memory (half of MemTotal).
  Limits();
  // Copies the values (AgentOptions carries them); refusal counts start at zero.
  Limits(const Limits& other) : values_(other.values_) {}
  Limits& operator=(const Limits& other) {
    values_ = other.values_;
    return *this;
  }

  uint64_t value(Limit limit) const { return values_[static_cast<int>(limit)]; }
  void set(Limit limit, uint64_t value) { values_[static_cast<int>(limit)] = value; }
  uint64_t refused(Limit limit) const {
    return refused_[static_cast<int>(limit)].load(std::memory_order_relaxed);
  }

  // True when `in_use + asking` stays within the limit.
  bool Fits(Limit limit, uint64_t in_use, uint64_t asking) const {
    return in_use <= value(limit) && asking <= value(limit) - in_use;
  }
  // Counts a refusal and returns RESOURCE_EXHAUSTED: "<what>: limit <name> (<value>
  // <unit>) reached: <in_use> in use, <asking> more asked; <fix>; or raise <flag>".
  absl::Status Refuse(Limit limit, std::string_view what, uint64_t in_use, uint64_t asking,
                      std::string_view fix) const;
  // Takes one of `limit`'s slots counted by `in_use` (lock-free), or refuses.
  absl::Status TakeSlot(Limit limit, std::atomic<uint64_t>* in_use, std::string_view what,
                        std::string_view fix) const {
    uint64_t now = in_use->load();
    do {
      if (!Fits(limit, now, 1)) return Refuse(limit, what, now, 1, fix);
    } while (!in_use->compare_exchange_weak(now, now + 1));
    return absl::OkStatus();
  }
  // Counts a refusal whose text another layer wrote (the planner's ops_per_chunk).
  void Count(Limit limit) const {
    refused_[static_cast<int>(limit)].fetch_add(1, std::memory_order_relaxed);
  }
  // Checks Fits, else Refuse.
  absl::Status Check(Limit limit, std::string_view what, uint64_t in_use, uint64_t asking,
                     std::string_view fix) const {
    if (Fits(limit, in_use, asking)) return absl::OkStatus();
    return Refuse(limit, what, in_use, asking, fix);
  }

  // main.cc: sets the limit whose flag is `flag` from `value` (a non-negative
  // integer, with an optional K/M/G/T binary suffix for byte limits). NOT_FOUND when
  // no limit has that flag; INVALID_ARGUMENT naming the flag otherwise.
  absl::Status SetFromFlag(std::string_view flag, std::string_view value);
  // The limits' lines for kvagentd --help.
  static std::string Usage();

 private:
  std::array<uint64_t, kLimitCount> values_{};
  mutable std::array<std::atomic<uint64_t>, kLimitCount> refused_{};
};

// Watch* streams open, per principal, against kStreams and kStreamsPerCaller. A
// stream holds a lease for its life.
class StreamTable {
 public:
  explicit StreamTable(const Limits* limits) : limits_(limits) {}

  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept { *this = std::move(other); }
    Lease& operator=(Lease&& other) noexcept {
      std::swap(table_, other.table_);
      std::swap(principal_, other.principal_);
      return *this;
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() {
      if (table_ != nullptr) table_->Close(principal_);
    }

   private:
    friend class StreamTable;
    StreamTable* table_ = nullptr;
    std::string principal_;
  };

  // A lease, or RESOURCE_EXHAUSTED naming the limit (`call`: "WatchTransfer").
  absl::StatusOr<Lease> Open(const std::string& principal, std::string_view call);
  uint64_t open() const;
  uint64_t largest_caller() const;  // the most streams one principal holds

 private:
  void Close(const std::string& principal);
  const Limits* limits_;
  mutable absl::Mutex mu_;
  uint64_t open_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, uint64_t> by_principal_ ABSL_GUARDED_BY(mu_);
};

// Error texts reach the client in gRPC's trailer (8 KiB of metadata by default): a
// longer one would be replaced by a misleading RESOURCE_EXHAUSTED from gRPC itself.
// Keeps the first `max_bytes` of `message` and says how much was cut and where the
// whole text is (`whole_text_at`: "the agent's log", or "GetTransfer" for a fast path
// completion, whose state has it).
inline constexpr size_t kMaxErrorBytes = 4096;
std::string BoundedErrorText(std::string_view message, size_t max_bytes = kMaxErrorBytes,
                             std::string_view whole_text_at = "the agent's log");

}  // namespace kvagent::agent
