// NotificationQueue holds the notifications peers sent to this agent until a local
// client takes them, by poll or by watch stream. Each notification goes to exactly
// one taker, and only to a client allowed to hear it: an owner of the regions the
// transfer addressed, or a scheduler. A watcher that goes away hands back what it
// had not written.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "proto/kvagent.pb.h"

namespace kvagent::agent {

struct QueuedNotification {
  v1::Notification notification;
  // Principals owning the regions it addressed; empty: only schedulers may take it.
  std::vector<std::string> owners;
};

// Who takes notifications: `any` (a scheduler) takes every one, else those owned by
// `principal`.
struct NotificationReader {
  std::string principal;
  bool any = false;
  bool Takes(const QueuedNotification& q) const;
};

class NotificationQueue {
 public:
  // Returns false when the subscriber does not take `n` (filter mismatch).
  using Subscriber = std::function<bool(const QueuedNotification& n)>;

  void Push(QueuedNotification notification);
  // Takes up to `max` (0 = all) queued notifications matching `ids` (empty = any)
  // that `reader` may take.
  std::vector<v1::Notification> Poll(uint32_t max, const absl::flat_hash_set<std::string>& ids,
                                     const NotificationReader& reader);
  // Puts notifications back at the front, in order (a watcher that disconnected).
  void Requeue(std::vector<QueuedNotification> notifications);

  // Subscribes; queued notifications the subscriber takes are handed over at once.
  // The subscriber runs under the queue's lock: it must not call back into the queue.
  uint64_t Subscribe(Subscriber subscriber);
  void Unsubscribe(uint64_t token);

  uint64_t queued() const;
  uint64_t delivered() const;

 private:
  bool OfferLocked(const QueuedNotification& n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  mutable absl::Mutex mu_;
  std::deque<QueuedNotification> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<uint64_t, Subscriber>> subscribers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_token_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_subscriber_ ABSL_GUARDED_BY(mu_) = 0;  // round-robin start
  uint64_t delivered_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvagent::agent
