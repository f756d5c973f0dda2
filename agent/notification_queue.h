// NotificationQueue holds the notifications peers sent to this agent until a local
// client takes them, by poll or by watch stream. Each notification goes to exactly
// one taker, and only to a client allowed to hear it: an owner of the regions the
// transfer addressed, or a scheduler. A watcher that goes away hands back what it
// had not written. A taker that names a subscription gets each notification with a
// sequence number, and the queue holds it (in flight) until the taker acknowledges
// it: a restarted client reattaching to the subscription gets the unacknowledged
// ones again, in order, before new ones.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
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

// Which notifications a subscription's taker gets: those `reader` may take, of
// `ids` (empty: any).
struct NotificationFilter {
  NotificationReader reader;
  absl::flat_hash_set<std::string> ids;
  bool Matches(const QueuedNotification& q) const;
};

// A durable subscription: `owner` is the caller's identity that survives its restart
// (Caller::durable_identity: uid and client name, or certificate), `name` what the
// client called it. Another owner naming the same `name` gets a different one.
struct SubscriptionKey {
  std::string owner;
  std::string name;
};

// INVALID_ARGUMENT unless `name` is 1..64 bytes of [A-Za-z0-9._:-].
absl::Status CheckSubscriptionName(std::string_view name);

// Transfer ids one watch or poll may filter on (gRPC WatchNotifications and
// PollNotifications, the fast path's watch entry): the transfers one engine waits for
// at once; the filter is a hash set the agent keeps for the watch's life.
inline constexpr int kMaxFilterTransferIds = 4096;
// Sequences one AckNotifications may list (gRPC's and the fast path's).
inline constexpr int kMaxAckSequences = 65536;
// INVALID_ARGUMENT, "<what>: <count> transfer_ids, at most <limit>; ...", past
// kMaxFilterTransferIds.
absl::Status CheckFilterTransferIds(std::string_view what, int count);
// The same for an acknowledgement's listed sequences.
absl::Status CheckAckSequences(std::string_view what, int count);

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
  // Push that moves from `notification` only when it is queued: when a subscriber
  // (a fast path ring, a stream) takes it at once, the caller keeps it, and its storage
  // serves the next one (the receiver's one notification per transfer allocates
  // nothing then).
  bool PushOrKeep(QueuedNotification& notification, uint64_t reserved_bytes = 0);
  // Reserves room for one notification of `bytes` (Size), counted with what is queued:
  // the receiver reserves before it acknowledges a transfer, so a success is refused
  // back to its sender (RESOURCE_EXHAUSTED naming the limit, counted), never
  // acknowledged and then dropped.
  absl::Status Reserve(std::string_view what, uint64_t bytes);
  // The same, with `what` made only for a refusal (no text per reservation granted).
  absl::Status Reserve(absl::FunctionRef<std::string()> what, uint64_t bytes);
  // What a notification costs the queue: every string it holds (payload, ids, names,
  // error text, each target) plus a fixed overhead, and each target's own (a string
  // object and its pointer in the repeated field: 256 empty targets still cost).
  static constexpr uint64_t kNotificationOverhead = 128;
  static constexpr uint64_t kTargetOverhead = sizeof(std::string) + sizeof(void*);
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
  // Ends a subscriber, or an attachment (Attach; a newer one may have replaced it):
  // then the subscription's idle time starts and its held notifications stay held.
  void Unsubscribe(uint64_t token);
  // Offers what is queued to subscriber `token` again (it refused some while its
  // backlog was full and has caught up). Must not be called under the subscriber's lock.
  void OfferQueued(uint64_t token);

  // Durable subscriptions. Each notification handed to one gets the next sequence
  // number (increasing, never reused in this agent's life, so a subscription made
  // again after it expired continues above) and stays held, counted against the
  // queue's limits, until acknowledged. At most in_flight_per_subscription are held
  // per subscription; the rest wait in the queue until acknowledgements make room.
  //
  // Attaches a watch stream: `deliver` gets (under the queue's lock; it must accept
  // every one and not call back) first every held notification, in order, then each
  // new one `filter` matches. A newer attachment replaces an older one, which gets no
  // more: its `on_replaced` (if set) runs then, under the queue's lock (it must not call
  // back), so that it drops what it was handed and has not delivered yet (the
  // subscription still holds those, and hands them to the newer attachment). Makes the
  // subscription if new (RESOURCE_EXHAUSTED at the subscriptions limit).
  absl::StatusOr<uint64_t> Attach(const SubscriptionKey& key, NotificationFilter filter,
                                  Subscriber deliver,
                                  std::function<void()> on_replaced = nullptr);
  // A poll through a subscription: the held ones first (up to `max`, 0 = all), then
  // queued ones `filter` matches, which become held. Makes the subscription if new.
  absl::StatusOr<std::vector<v1::Notification>> PollSubscription(const SubscriptionKey& key,
                                                                 uint32_t max,
                                                                 const NotificationFilter& filter);
  // Acknowledges every held notification with a sequence up to `through` (0: none)
  // and those in `sequences`; returns how many were released. NOT_FOUND when the
  // subscription does not exist (never made, or expired). Sequences no longer held
  // (acknowledged before) are ignored.
  absl::StatusOr<uint64_t> Ack(const SubscriptionKey& key, uint64_t through,
                               const std::vector<uint64_t>& sequences);
  // Subscriptions without an attachment, poll or ack for `ttl_ms` are dropped, their
  // held notifications put back at the front of the queue (taken once again, by
  // anyone allowed). Checked on the queue's calls (at most every 100 ms) and by
  // ExpireIdle. Default 10 minutes.
  void set_subscription_ttl_ms(uint64_t ttl_ms);
  // Tests: a clock in milliseconds (default: steady clock).
  void set_clock(std::function<uint64_t()> now_ms);
  // Drops the subscriptions idle past the TTL now; returns how many.
  uint64_t ExpireIdle();

  // The most one subscription holds unacknowledged (in_flight_per_subscription; no
  // limits: unbounded).
  uint64_t in_flight_per_subscription() const;
  uint64_t queued() const;        // waiting for a taker (not in flight)
  uint64_t in_flight() const;     // held by subscriptions, not yet acknowledged
  uint64_t subscriptions() const;
  uint64_t largest_subscription() const;  // the most one subscription holds
  uint64_t queued_bytes() const;  // bytes queued and in flight
  uint64_t delivered() const;
  uint64_t overflowed() const;
  uint64_t expired_subscriptions() const;

 private:
  struct Held {
    uint64_t sequence;
    QueuedNotification notification;
  };
  struct Subscription {
    std::deque<Held> held;  // increasing sequence
    uint64_t attached = 0;  // the attachment's token, 0: none
    NotificationFilter filter;
    uint64_t idle_since_ms = 0;
  };
  struct Entry {
    uint64_t token;
    Subscriber subscriber;
    std::string subscription;  // empty: a plain subscriber
    std::function<void()> on_replaced;  // an attachment's (Attach)
  };
  // Who holds a subscription of `owner` for the per-holder share: a local uid
  // ("uid:N"), else the owner itself.
  static std::string_view HolderOf(std::string_view owner);
  static std::string KeyOf(const SubscriptionKey& key);
  // Hands `n` to a plain subscriber, or (when `may_hold`: it fits the limits) to an
  // attached subscription that then holds it.
  bool OfferLocked(const QueuedNotification& n, bool may_hold) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandOverLocked(const Subscriber& subscriber) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves `n` into `sub`'s held ones if it has room; hands it to `deliver` if set.
  bool HoldLocked(Subscription& sub, const QueuedNotification& n, const Subscriber* deliver)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves queued notifications `filter` matches into `sub` (up to `max`, 0 = all,
  // while it has room), handing each to `deliver` when set.
  void HandOverToSubscriptionLocked(Subscription& sub, const NotificationFilter& filter,
                                    const Subscriber* deliver, uint32_t max)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Subscription*> FindOrMakeLocked(const SubscriptionKey& key, std::string_view call)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const Subscriber* AttachedLocked(const Subscription& sub) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t HeldLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return queue_.size() + in_flight_;
  }
  void MaybeExpireLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t ExpireLocked(uint64_t now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t NowMs() const;
  const Limits* limits_;
  mutable absl::Mutex mu_;
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;  // Reserve'd and not yet pushed
  uint64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t overflowed_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<QueuedNotification> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<Entry> subscribers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::unique_ptr<Subscription>> subscriptions_
      ABSL_GUARDED_BY(mu_);
  uint64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t ttl_ms_ ABSL_GUARDED_BY(mu_) = 10 * 60 * 1000;
  uint64_t last_expiry_check_ms_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t expired_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<uint64_t()> clock_;
  uint64_t next_token_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_subscriber_ ABSL_GUARDED_BY(mu_) = 0;  // round-robin start
  uint64_t delivered_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvagent::agent
