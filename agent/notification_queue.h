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
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/status/status.h"
#include "agent/limits.h"
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
  // `limits` (may be null: unbounded, for tests) bounds what waits in the queue:
  // queued_notifications and queued_notification_bytes.
  explicit NotificationQueue(const Limits* limits = nullptr) : limits_(limits) {}

  // Returns false when the subscriber does not take `n` (filter mismatch).
  using Subscriber = std::function<bool(const QueuedNotification& n)>;

  // Hands `notification` to a subscriber, else queues it. With `reserved_bytes`
  // (Reserve's bytes) it uses that reservation and is always kept. Without one, a
  // queue at its limits keeps nothing more: the notification is counted in
  // overflowed() and false returned (the transfer's record still holds its outcome).
  bool Push(QueuedNotification notification, uint64_t reserved_bytes = 0);
  // Reserves room for one notification of `bytes` (Size), counted with what is queued:
  // the receiver reserves before it acknowledges a transfer, so a success is refused
  // back to its sender (RESOURCE_EXHAUSTED naming the limit, counted), never
  // acknowledged and then dropped.
  absl::Status Reserve(std::string_view what, uint64_t bytes);
  // What a notification costs the queue: its strings plus a fixed overhead.
  static uint64_t Size(const v1::Notification& n);
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
  // Offers what is queued to subscriber `token` again (it refused some while its
  // backlog was full and has caught up). Must not be called under the subscriber's lock.
  void OfferQueued(uint64_t token);

  uint64_t queued() const;
  uint64_t queued_bytes() const;
  uint64_t delivered() const;
  uint64_t overflowed() const;

 private:
  bool OfferLocked(const QueuedNotification& n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandOverLocked(const Subscriber& subscriber) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const Limits* limits_;
  mutable absl::Mutex mu_;
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;  // Reserve'd and not yet pushed
  uint64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t overflowed_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<QueuedNotification> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<uint64_t, Subscriber>> subscribers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_token_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_subscriber_ ABSL_GUARDED_BY(mu_) = 0;  // round-robin start
  uint64_t delivered_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvagent::agent
