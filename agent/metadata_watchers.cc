#include "agent/metadata_watchers.h"

#include <utility>

#include "absl/container/flat_hash_map.h"

#include "agent/status_util.h"

namespace kvagent::agent {

MetadataWatchers::MetadataWatchers(uint32_t recent_ms)
    : recent_ms_(recent_ms), thread_([this] { Loop(); }) {}

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

absl::Status MetadataWatchers::Polled(const std::string& caller, uint64_t known_version,
                                      uint64_t incarnation_match, const Limits* limits) {
  if (caller.empty()) return absl::OkStatus();
  {
    absl::MutexLock lock(&mu_);
    auto found = watchers_.find(caller);
    if (found == watchers_.end() && limits != nullptr &&
        !limits->Fits(Limit::kPeerCallers, watchers_.size(), 1)) {
      // Those that stopped polling count for nothing: make room by dropping them.
      const uint64_t now = MonotonicMicros();
      absl::erase_if(watchers_, [&](const auto& entry) {
        return now - entry.second.last_poll_us > uint64_t{recent_ms_} * 1000;
      });
      if (!limits->Fits(Limit::kPeerCallers, watchers_.size(), 1)) {
        return limits->Refuse(Limit::kPeerCallers, "GetMetadata from a new peer",
                              watchers_.size(), 1,
                              "peers that polled in the last seconds fill the table");
      }
    }
    Watcher& w = watchers_[caller];
    // A caller that knows another incarnation holds none of our versions.
    w.known_version = incarnation_match ? known_version : 0;
    w.last_poll_us = MonotonicMicros();
  }
  CheckWaiters();
  return absl::OkStatus();
}

size_t MetadataWatchers::size() const {
  absl::MutexLock lock(&mu_);
  return watchers_.size();
}

std::vector<std::string> MetadataWatchers::PendingLocked(uint64_t version) const {
  std::vector<std::string> pending;
  const uint64_t now = MonotonicMicros();
  for (const auto& [name, w] : watchers_) {
    if (now - w.last_poll_us > uint64_t{recent_ms_} * 1000) continue;
    if (w.known_version < version) pending.push_back(name);
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
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      // Idle (nobody waits for a version), the thread sleeps until a waiter comes.
      auto has_waiters = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !waiters_.empty();
      };
      mu_.Await(absl::Condition(&has_waiters));
      auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; };
      mu_.AwaitWithTimeout(absl::Condition(&stop), absl::Milliseconds(20));
      if (stopping_) return;
      if (waiters_.empty()) continue;
    }
    CheckWaiters();
  }
}

}  // namespace kvagent::agent
