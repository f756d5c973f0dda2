#include "agent/metadata_watchers.h"

#include <pthread.h>

#include <utility>

#include "absl/container/flat_hash_map.h"
#include "agent/status_util.h"
#include "base/text.h"

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

absl::StatusOr<MetadataWatchers::Watcher*> MetadataWatchers::FindOrAddLocked(
    const std::string& caller, const Limits* limits, std::string_view what) {
  auto found = watchers_.find(caller);
  if (found != watchers_.end()) return &found->second;
  if (limits != nullptr && !limits->Fits(Limit::kPeerCallers, watchers_.size(), 1)) {
    // Those that stopped watching count for nothing: make room by dropping them.
    const uint64_t now = MonotonicMicros();
    absl::erase_if(watchers_,
                   [&](const auto& entry) { return !CountsLocked(entry.second, now); });
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
    (*w)->last_poll_us = MonotonicMicros();
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
  ++(*w)->streams;
  ++streams_;
  return absl::OkStatus();
}

void MetadataWatchers::StreamAcked(const std::string& caller, uint64_t known_version,
                                   bool incarnation_match) {
  {
    absl::MutexLock lock(&mu_);
    auto found = watchers_.find(caller);
    if (found == watchers_.end()) return;
    found->second.known_version = incarnation_match ? known_version : 0;
    found->second.last_poll_us = MonotonicMicros();
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
    if (--found->second.streams == 0) found->second.last_poll_us = 0;
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
