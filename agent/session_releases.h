// The queue of local sessions that ended and whose regions are not released yet: the
// session socket's thread adds to it, the agent's releaser thread takes from it in
// order, and GetStatus reads its depth and oldest wait (AgentStatus.sessions_releasing).
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvagent::agent {

class SessionReleases {
 public:
  struct Ended {
    std::string principal;  // names its session id, never reused
    absl::Time ended;
  };
  // Sessions ended and not released yet (those queued and the one being released),
  // and how long the oldest of them has waited since its session ended (zero: none).
  struct Backlog {
    uint64_t sessions = 0;
    absl::Duration oldest_wait;
  };

  // Queues a release; false once Stop was called (what the session held goes with the
  // agent then).
  bool Add(std::string principal, absl::Time ended);
  // The oldest queued release, waiting while there is none; it counts as being
  // released until Done. nullopt once Stop was called.
  std::optional<Ended> Take();
  // The release Take handed out has finished.
  void Done();
  // Take returns nullopt from now on (a release running still finishes). Returns how
  // many queued ones were dropped.
  size_t Stop();

  Backlog backlog(absl::Time now) const;
  // backlog().sessions alone (no clock read): what the session socket counts against
  // --max-sessions at each connection.
  uint64_t sessions() const;

 private:
  // Those queued and the one being released.
  uint64_t CountLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  // Bounded by how fast sessions can be opened and closed while one release waits for
  // the registry's writer lock; each entry is a principal and a time.
  std::deque<Ended> queued_ ABSL_GUARDED_BY(mu_);
  // When the session being released (taken, not Done) ended; nullopt: none.
  std::optional<absl::Time> running_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvagent::agent
