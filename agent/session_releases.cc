#include "agent/session_releases.h"

#include <algorithm>
#include <utility>

namespace kvagent::agent {

bool SessionReleases::Add(std::string principal, absl::Time ended) {
  absl::MutexLock lock(&mu_);
  if (stopped_) return false;
  queued_.push_back(Ended{std::move(principal), ended});
  cv_.Signal();
  return true;
}

std::optional<SessionReleases::Ended> SessionReleases::Take() {
  absl::MutexLock lock(&mu_);
  while (!stopped_ && queued_.empty()) cv_.Wait(&mu_);
  if (stopped_) return std::nullopt;
  Ended next = std::move(queued_.front());
  queued_.pop_front();
  running_ = next.ended;
  return next;
}

void SessionReleases::Done() {
  absl::MutexLock lock(&mu_);
  running_.reset();
}

size_t SessionReleases::Stop() {
  absl::MutexLock lock(&mu_);
  stopped_ = true;
  const size_t dropped = queued_.size();
  queued_.clear();
  cv_.SignalAll();
  return dropped;
}

uint64_t SessionReleases::CountLocked() const {
  return queued_.size() + (running_.has_value() ? 1 : 0);
}

uint64_t SessionReleases::sessions() const {
  absl::MutexLock lock(&mu_);
  return CountLocked();
}

SessionReleases::Backlog SessionReleases::backlog(absl::Time now) const {
  absl::MutexLock lock(&mu_);
  Backlog backlog;
  backlog.sessions = CountLocked();
  // Taken in order, so the one being released ended before every queued one.
  if (running_.has_value()) {
    backlog.oldest_wait = now - *running_;
  } else if (!queued_.empty()) {
    backlog.oldest_wait = now - queued_.front().ended;
  }
  backlog.oldest_wait = std::max(backlog.oldest_wait, absl::ZeroDuration());
  return backlog;
}

}  // namespace kvagent::agent
