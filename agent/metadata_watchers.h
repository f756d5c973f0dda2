// MetadataWatchers tracks which peers poll this agent's metadata and which version
// each has installed (the known_version of its latest GetMetadata). Deregistration
// waits on it: once every recent watcher has installed the new version, no peer can
// plan a new transfer into the removed regions. Used by the gRPC services.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/status/status.h"
#include "agent/limits.h"

namespace kvagent::agent {

class MetadataWatchers {
 public:
  // `recent_ms`: a peer that polled within this window counts as a watcher.
  explicit MetadataWatchers(uint32_t recent_ms = 5000);
  ~MetadataWatchers();

  // Records a poll by `caller` that already holds `known_version`. A caller not seen
  // before when the table is full (limits' peer_callers, after dropping those that
  // stopped polling) is refused with RESOURCE_EXHAUSTED; `limits` may be null.
  absl::Status Polled(const std::string& caller, uint64_t known_version,
                      uint64_t incarnation_match, const Limits* limits = nullptr);
  size_t size() const;
  // Calls `done(unconfirmed)` once every recent watcher holds `version`, or after
  // `timeout_ms` with the names of those that did not. Never calls inline under a lock.
  void WaitForVersion(uint64_t version, uint32_t timeout_ms,
                      std::function<void(std::vector<std::string> unconfirmed)> done);

 private:
  struct Watcher {
    uint64_t known_version = 0;
    uint64_t last_poll_us = 0;
  };
  struct Waiter {
    uint64_t version;
    uint64_t deadline_us;
    std::function<void(std::vector<std::string>)> done;
  };
  std::vector<std::string> PendingLocked(uint64_t version) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void CheckWaiters();
  void Loop();

  const uint32_t recent_ms_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Watcher> watchers_ ABSL_GUARDED_BY(mu_);
  std::vector<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvagent::agent
