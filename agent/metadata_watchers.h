// MetadataWatchers tracks which peers watch this agent's metadata and which version
// each has installed (the known_version of its latest GetMetadata, or of its latest
// acknowledgement on a WatchMetadata stream). Deregistration waits on it: once every
// watcher has installed the new version, no peer can plan a new transfer into the
// removed regions. MetadataPush wakes the open WatchMetadata streams when the
// version moves. Used by the gRPC services.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/status/status.h"
#include "agent/limits.h"

namespace kvagent::agent {

class MetadataWatchers {
 public:
  // Streams one peer identity may hold open at once: one, and a few more while a
  // reconnect replaces it.
  static constexpr uint32_t kStreamsPerWatcher = 4;

  // Called with a caller's name when it is dropped from the table (see
  // MetadataWatchers()), with the table's lock held: it must not call back.
  using Forgotten = std::function<void(const std::string& caller)>;

  // `recent_ms`: a peer that polled within this window counts as a watcher.
  // `forget_ms`: a peer with no stream open that has neither polled nor closed a
  // stream for this long is dropped from the table, and `forgotten` called with its
  // name (so is one dropped to make room for a new caller when the table is full);
  // while any such peer is held, a thread looks once a second.
  explicit MetadataWatchers(uint32_t recent_ms = 5000, uint32_t forget_ms = 60000,
                            Forgotten forgotten = {});
  ~MetadataWatchers();

  // Records a poll by `caller` that already holds `known_version`. A caller not seen
  // before when the table is full (limits' peer_callers, after dropping those that
  // stopped polling) is refused with RESOURCE_EXHAUSTED; `limits` may be null.
  absl::Status Polled(const std::string& caller, uint64_t known_version,
                      uint64_t incarnation_match, const Limits* limits = nullptr);
  // A WatchMetadata stream of `caller` opened (refused as Polled refuses a new
  // caller, and past kStreamsPerWatcher of one caller), acknowledged `known_version`,
  // or ended. A caller with a stream open
  // counts as a watcher however long ago it acknowledged; once its last stream ends
  // it stops counting (until it polls again).
  absl::Status StreamOpened(const std::string& caller, const Limits* limits = nullptr);
  void StreamAcked(const std::string& caller, uint64_t known_version, bool incarnation_match);
  void StreamClosed(const std::string& caller);
  size_t size() const;
  size_t streams() const;  // open WatchMetadata streams
  // Calls `done(unconfirmed)` once every recent watcher holds `version`, or after
  // `timeout_ms` with the names of those that did not. Never calls inline under a lock.
  void WaitForVersion(uint64_t version, uint32_t timeout_ms,
                      std::function<void(std::vector<std::string> unconfirmed)> done);

 private:
  struct Watcher {
    uint64_t known_version = 0;
    uint64_t last_poll_us = 0;
    uint64_t last_seen_us = 0;  // its last poll, acknowledgement, stream opened or closed
    uint32_t streams = 0;       // open WatchMetadata streams
  };
  struct Waiter {
    uint64_t version;
    uint64_t deadline_us;
    std::function<void(std::vector<std::string>)> done;
  };
  std::vector<std::string> PendingLocked(uint64_t version) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The entry of `caller`, made (room permitting, see Polled) when new; `what` names
  // the call in a refusal.
  absl::StatusOr<Watcher*> FindOrAddLocked(const std::string& caller, const Limits* limits,
                                           std::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool CountsLocked(const Watcher& w, uint64_t now) const ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return w.streams > 0 || now - w.last_poll_us <= uint64_t{recent_ms_} * 1000;
  }
  // Drops the entries `gone` picks, calling forgotten_ for each.
  template <typename Gone>
  void DropLocked(Gone gone) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CheckWaiters();
  void Loop();

  const uint32_t recent_ms_;
  const uint32_t forget_ms_;
  const Forgotten forgotten_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Watcher> watchers_ ABSL_GUARDED_BY(mu_);
  size_t streaming_ ABSL_GUARDED_BY(mu_) = 0;  // entries with a stream open
  uint64_t swept_us_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  size_t streams_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

// The open WatchMetadata streams of this agent. Changed() (the registry's version
// moved) wakes one pusher thread that calls Push() on every stream; idle, it sleeps.
// Remove() returns only when no Push() on that stream runs, so a stream may be
// deleted right after.
class MetadataPush {
 public:
  class Stream {
   public:
    virtual ~Stream() = default;
    // Sends what changed, or notes that it must once the write in flight is done.
    // Must not block or call back into MetadataPush.
    virtual void Push() = 0;
  };

  MetadataPush();
  ~MetadataPush();
  void Add(Stream* stream);
  void Remove(Stream* stream);
  void Changed();
  size_t size() const;

 private:
  void Loop();

  mutable absl::Mutex mu_;
  absl::flat_hash_set<Stream*> streams_ ABSL_GUARDED_BY(mu_);
  bool changed_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvagent::agent
