#include "agent/metadata_watchers.h"

#include <pthread.h>

#include <utility>

#include "absl/container/flat_hash_map.h"
#include "agent/status_util.h"
#include "base/text.h"

namespace kvagent::agent {

MetadataWatchers::MetadataWatchers(uint32_t recent_ms, uint32_t forget_ms, Forgotten forgotten)
    : recent_ms_(recent_ms),
      forget_ms_(forget_ms),
      forgotten_(std::move(forgotten)),
      thread_([this] { Loop(); }) {}

MetadataWatchers::~MetadataWatchers() {
  std::vector<Waiter> left;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
  {
    absl::MutexLock lock(&mu_);
    left.swap(waiters_);
  }
  for (auto& w : left) w.done({});
}

template <typename Gone>
void MetadataWatchers::DropLocked(Gone gone) {
  for (auto it = watchers_.begin(); it != watchers_.end();) {
    if (!gone(it->second)) {
      ++it;
      continue;
    }
    if (forgotten_) forgotten_(it->first);
    watchers_.erase(it++);
  }
}

absl::StatusOr<MetadataWatchers::Watcher*> MetadataWatchers::FindOrAddLocked(
    const std::string& caller, const Limits* limits, std::string_view what) {
  auto found = watchers_.find(caller);
  if (found != watchers_.end()) return &found->second;
  if (limits != nullptr && !limits->Fits(Limit::kPeerCallers, watchers_.size(), 1)) {
    // Those that stopped watching count for nothing: make room by dropping them.
    const uint64_t now = MonotonicMicros();
    DropLocked([&](const Watcher& w) ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return !CountsLocked(w, now);
    });
    if (!limits->Fits(Limit::kPeerCallers, watchers_.size(), 1)) {
      return limits->Refuse(Limit::kPeerCallers,
                            std::string(what) + " from new peer '" + Printable(caller) + "'",
                            watchers_.size(), 1,
                            "peers that watch this agent (a stream open, or a poll in the last "
                            "seconds) fill the table");
    }
  }
  return &watchers_[caller];
}

absl::Status MetadataWatchers::Polled(const std::string& caller, uint64_t known_version,
                                      uint64_t incarnation_match, const Limits* limits) {
  if (caller.empty()) return absl::OkStatus();
  {
    absl::MutexLock lock(&mu_);
    auto w = FindOrAddLocked(caller, limits, "GetMetadata");
    if (!w.ok()) return w.status();
    // A caller that knows another incarnation holds none of our versions.
    (*w)->known_version = incarnation_match ? known_version : 0;
    (*w)->last_poll_us = (*w)->last_seen_us = MonotonicMicros();
  }
  CheckWaiters();
  return absl::OkStatus();
}

absl::Status MetadataWatchers::StreamOpened(const std::string& caller, const Limits* limits) {
  absl::MutexLock lock(&mu_);
  auto w = FindOrAddLocked(caller, limits, "WatchMetadata");
  if (!w.ok()) return w.status();
  if ((*w)->streams >= kStreamsPerWatcher) {
    return absl::ResourceExhaustedError(
        "WatchMetadata: peer '" + caller + "' already holds " +
        std::to_string(kStreamsPerWatcher) +
        " metadata streams here, the most one peer identity may hold open at once; an agent "
        "needs one: close the others (streams opened and never used count too), and give "
        "each agent its own name and certificate");
  }
  if ((*w)->streams++ == 0) ++streaming_;
  ++streams_;
  (*w)->last_seen_us = MonotonicMicros();
  return absl::OkStatus();
}

void MetadataWatchers::StreamAcked(const std::string& caller, uint64_t known_version,
                                   bool incarnation_match) {
  {
    absl::MutexLock lock(&mu_);
    auto found = watchers_.find(caller);
    if (found == watchers_.end()) return;
    found->second.known_version = incarnation_match ? known_version : 0;
    found->second.last_poll_us = found->second.last_seen_us = MonotonicMicros();
  }
  CheckWaiters();
}

void MetadataWatchers::StreamClosed(const std::string& caller) {
  {
    absl::MutexLock lock(&mu_);
    auto found = watchers_.find(caller);
    if (found == watchers_.end() || found->second.streams == 0) return;
    --streams_;
    // Its view may be stale from here on: it is not waited for (it polls, or opens
    // a stream, again before it plans anything new).
    if (--found->second.streams == 0) {
      found->second.last_poll_us = 0;
      --streaming_;
    }
    found->second.last_seen_us = MonotonicMicros();
  }
  CheckWaiters();
}

size_t MetadataWatchers::streams() const {
  absl::MutexLock lock(&mu_);
  return streams_;
}

size_t MetadataWatchers::size() const {
  absl::MutexLock lock(&mu_);
  return watchers_.size();
}

std::vector<std::string> MetadataWatchers::PendingLocked(uint64_t version) const {
  std::vector<std::string> pending;
  const uint64_t now = MonotonicMicros();
  for (const auto& [name, w] : watchers_) {
    if (CountsLocked(w, now) && w.known_version < version) pending.push_back(name);
  }
  return pending;
}

void MetadataWatchers::WaitForVersion(uint64_t version, uint32_t timeout_ms,
                                      std::function<void(std::vector<std::string>)> done) {
  {
    absl::MutexLock lock(&mu_);
    if (!PendingLocked(version).empty()) {
      waiters_.push_back(Waiter{version, MonotonicMicros() + uint64_t{timeout_ms} * 1000,
                                std::move(done)});
      return;
    }
  }
  done({});
}

void MetadataWatchers::CheckWaiters() {
  std::vector<std::pair<std::function<void(std::vector<std::string>)>, std::vector<std::string>>>
      ready;
  {
    absl::MutexLock lock(&mu_);
    const uint64_t now = MonotonicMicros();
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      auto pending = PendingLocked(it->version);
      if (pending.empty() || now >= it->deadline_us) {
        ready.emplace_back(std::move(it->done), std::move(pending));
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& [done, pending] : ready) done(std::move(pending));
}

void MetadataWatchers::Loop() {
  pthread_setname_np(pthread_self(), "meta-watchers");
  for (;;) {
    bool check = false;
    {
      absl::MutexLock lock(&mu_);
      // Idle (nobody waits for a version, and every peer held has a stream open: none
      // can be forgotten), the thread sleeps until that changes.
      auto busy = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !waiters_.empty() || watchers_.size() > streaming_;
      };
      mu_.Await(absl::Condition(&busy));
      // Waiters are looked at every 20 ms (their deadlines), the table once a second.
      const bool waiting = !waiters_.empty();
      auto wake = [this, waiting]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || (!waiting && !waiters_.empty());
      };
      mu_.AwaitWithTimeout(absl::Condition(&wake), absl::Milliseconds(waiting ? 20 : 1000));
      if (stopping_) return;
      const uint64_t now = MonotonicMicros();
      if (now - swept_us_ >= 1000000) {
        swept_us_ = now;
        const uint64_t forget_us = uint64_t{forget_ms_} * 1000;
        DropLocked([&](const Watcher& w) {
          return w.streams == 0 && now - w.last_seen_us >= forget_us;
        });
      }
      check = !waiters_.empty();
    }
    if (check) CheckWaiters();
  }
}

MetadataPush::MetadataPush() : thread_([this] { Loop(); }) {}

MetadataPush::~MetadataPush() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void MetadataPush::Add(Stream* stream) {
  absl::MutexLock lock(&mu_);
  streams_.insert(stream);
}

void MetadataPush::Remove(Stream* stream) {
  absl::MutexLock lock(&mu_);  // the pusher holds it while it pushes
  streams_.erase(stream);
}

void MetadataPush::Changed() {
  absl::MutexLock lock(&mu_);
  changed_ = true;
}

size_t MetadataPush::size() const {
  absl::MutexLock lock(&mu_);
  return streams_.size();
}

void MetadataPush::Loop() {
  pthread_setname_np(pthread_self(), "meta-push");
  absl::MutexLock lock(&mu_);
  for (;;) {
    auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || changed_; };
    mu_.Await(absl::Condition(&woken));
    if (stopping_) return;
    changed_ = false;
    // Versions that move while this runs set changed_ again: the next round sends them.
    for (Stream* stream : streams_) stream->Push();
  }
}

}  // namespace kvagent::agent
