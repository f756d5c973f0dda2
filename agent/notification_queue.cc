#include "agent/notification_queue.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "base/text.h"
#include "fmt/format.h"

namespace kvagent::agent {
namespace {
constexpr size_t kMaxSubscriptionName = 64;
constexpr uint64_t kExpiryCheckMs = 100;
}  // namespace

bool NotificationFilter::Matches(const QueuedNotification& q) const {
  return (ids.empty() || ids.contains(q.notification.transfer_id())) && reader.Takes(q);
}

absl::Status CheckSubscriptionName(std::string_view name) {
  bool ok = !name.empty() && name.size() <= kMaxSubscriptionName;
  for (char c : name) {
    ok = ok && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                c == '.' || c == '_' || c == ':' || c == '-');
  }
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(fmt::format(
      "subscription '{}' ({} bytes): name it with 1 to {} of A-Z a-z 0-9 . _ : -",
      Printable(name, 80), name.size(), kMaxSubscriptionName));
}

absl::Status CheckFilterTransferIds(std::string_view what, int count) {
  if (count <= kMaxFilterTransferIds) return absl::OkStatus();
  return absl::InvalidArgumentError(fmt::format(
      "{}: {} transfer_ids to filter on, at most {}; watch the transfers in flight only, or "
      "leave transfer_ids empty (every notification this caller may take) and filter on the "
      "notifications' transfer_id",
      what, count, kMaxFilterTransferIds));
}

absl::Status CheckAckSequences(std::string_view what, int count) {
  if (count <= kMaxAckSequences) return absl::OkStatus();
  return absl::InvalidArgumentError(fmt::format(
      "{}: {} sequences listed, at most {}; acknowledge a prefix with through_sequence", what,
      count, kMaxAckSequences));
}

bool NotificationReader::Takes(const QueuedNotification& q) const {
  if (any) return true;
  for (const auto& owner : q.owners) {
    if (owner == principal) return true;
  }
  return false;
}

bool NotificationQueue::OfferLocked(const QueuedNotification& n, bool may_hold) {
  const size_t count = subscribers_.size();
  for (size_t i = 0; i < count; ++i) {
    Entry& entry = subscribers_[(next_subscriber_ + i) % count];
    bool taken = false;
    if (entry.subscription.empty()) {
      taken = entry.subscriber(n);
    } else if (may_hold) {
      // Held, so counted: bytes_ grows here, not on the plain path (the taker has it).
      auto it = subscriptions_.find(entry.subscription);
      if (it != subscriptions_.end() && it->second->filter.Matches(n) &&
          HoldLocked(*it->second, n, &entry.subscriber)) {
        bytes_ += Size(n.notification);
        taken = true;
      }
    }
    if (taken) {
      next_subscriber_ = (next_subscriber_ + i + 1) % count;
      ++delivered_;
      return true;
    }
  }
  return false;
}

uint64_t NotificationQueue::Size(const v1::Notification& n) {
  uint64_t bytes = n.payload().size() + n.error_message().size() + n.transfer_id().size() +
                   n.from_agent().size() + n.request_id().size() + kNotificationOverhead;
  for (const auto& target : n.targets()) bytes += target.size() + kTargetOverhead;
  return bytes;
}

absl::Status NotificationQueue::Reserve(std::string_view what, uint64_t bytes) {
  return Reserve([what] { return std::string(what); }, bytes);
}

absl::Status NotificationQueue::Reserve(absl::FunctionRef<std::string()> what, uint64_t bytes) {
  if (limits_ == nullptr) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  constexpr std::string_view kFix =
      "the clients of this agent's regions are not taking their notifications "
      "(PollNotifications or WatchNotifications)";
  MaybeExpireLocked();
  const uint64_t held = HeldLocked() + reserved_;
  if (!limits_->Fits(Limit::kQueuedNotifications, held, 1)) {
    return limits_->Refuse(Limit::kQueuedNotifications, what(), held, 1, kFix);
  }
  if (!limits_->Fits(Limit::kQueuedNotificationBytes, bytes_ + reserved_bytes_, bytes)) {
    return limits_->Refuse(Limit::kQueuedNotificationBytes, what(), bytes_ + reserved_bytes_,
                           bytes, kFix);
  }
  ++reserved_;
  reserved_bytes_ += bytes;
  return absl::OkStatus();
}

bool NotificationQueue::Push(QueuedNotification notification, uint64_t reserved_bytes) {
  return PushOrKeep(notification, reserved_bytes);
}

bool NotificationQueue::PushOrKeep(QueuedNotification& notification, uint64_t reserved_bytes) {
  absl::MutexLock lock(&mu_);
  const bool reserved = reserved_bytes > 0 && reserved_ > 0;
  if (reserved) {
    --reserved_;
    reserved_bytes_ -= std::min(reserved_bytes_, reserved_bytes);
  }
  MaybeExpireLocked();
  const uint64_t bytes = Size(notification.notification);
  const bool fits =
      reserved || limits_ == nullptr ||
      (limits_->Fits(Limit::kQueuedNotifications, HeldLocked() + reserved_, 1) &&
       limits_->Fits(Limit::kQueuedNotificationBytes, bytes_ + reserved_bytes_, bytes));
  if (OfferLocked(notification, fits)) return true;
  if (!fits) {
    ++overflowed_;
    return false;
  }
  bytes_ += bytes;
  queue_.push_back(std::move(notification));
  return true;
}

std::vector<v1::Notification> NotificationQueue::Poll(
    uint32_t max, const absl::flat_hash_set<std::string>& ids, const NotificationReader& reader) {
  absl::MutexLock lock(&mu_);
  MaybeExpireLocked();
  std::vector<v1::Notification> out;
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (max != 0 && out.size() >= max) break;
    if ((ids.empty() || ids.contains(it->notification.transfer_id())) && reader.Takes(*it)) {
      bytes_ -= std::min(bytes_, Size(it->notification));
      out.push_back(std::move(it->notification));
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
  delivered_ += out.size();
  return out;
}

void NotificationQueue::Requeue(std::vector<QueuedNotification> notifications) {
  absl::MutexLock lock(&mu_);
  delivered_ -= std::min<uint64_t>(delivered_, notifications.size());
  // Handed back, not new: kept even over the limits (they were taken from the queue).
  for (auto it = notifications.rbegin(); it != notifications.rend(); ++it) {
    bytes_ += Size(it->notification);
    queue_.push_front(std::move(*it));
  }
}

void NotificationQueue::HandOverLocked(const Subscriber& subscriber) {
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (subscriber(*it)) {
      ++delivered_;
      bytes_ -= std::min(bytes_, Size(it->notification));
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
}

uint64_t NotificationQueue::Subscribe(Subscriber subscriber) {
  absl::MutexLock lock(&mu_);
  const uint64_t token = next_token_++;
  HandOverLocked(subscriber);
  subscribers_.push_back(Entry{token, std::move(subscriber), "", nullptr});
  return token;
}

void NotificationQueue::OfferQueued(uint64_t token) {
  absl::MutexLock lock(&mu_);
  for (const Entry& entry : subscribers_) {
    if (entry.token == token) {
      if (entry.subscription.empty()) HandOverLocked(entry.subscriber);
      return;
    }
  }
}

void NotificationQueue::Unsubscribe(uint64_t token) {
  absl::MutexLock lock(&mu_);
  for (auto it = subscribers_.begin(); it != subscribers_.end(); ++it) {
    if (it->token == token) {
      if (!it->subscription.empty()) {
        auto sub = subscriptions_.find(it->subscription);
        if (sub != subscriptions_.end() && sub->second->attached == token) {
          sub->second->attached = 0;
          sub->second->idle_since_ms = NowMs();
        }
      }
      subscribers_.erase(it);
      break;
    }
  }
  next_subscriber_ = 0;
}

std::string_view NotificationQueue::HolderOf(std::string_view owner) {
  // "uid:1000 client:NAME" (a local session: its uid is what the kernel vouches for);
  // anything else ("cert:NAME", "insecure") is its own holder.
  if (owner.substr(0, 4) == "uid:") return owner.substr(0, owner.find(' '));
  return owner;
}

std::string NotificationQueue::KeyOf(const SubscriptionKey& key) {
  // The owner never holds a newline (escaped by Printable), so the key is unambiguous.
  return key.owner + "\n" + key.name;
}

uint64_t NotificationQueue::NowMs() const {
  if (clock_) return clock_();
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

bool NotificationQueue::HoldLocked(Subscription& sub, const QueuedNotification& n,
                                   const Subscriber* deliver) {
  if (limits_ != nullptr && !limits_->Fits(Limit::kInFlightPerSubscription, sub.held.size(), 1)) {
    return false;  // back-pressure: it waits in the queue until acknowledgements make room
  }
  Held held{next_sequence_++, n};
  held.notification.notification.set_sequence(held.sequence);
  if (deliver != nullptr) (*deliver)(held.notification);
  sub.held.push_back(std::move(held));
  ++in_flight_;
  return true;
}

void NotificationQueue::HandOverToSubscriptionLocked(Subscription& sub,
                                                     const NotificationFilter& filter,
                                                     const Subscriber* deliver, uint32_t max) {
  uint32_t moved = 0;
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (max != 0 && moved >= max) break;
    if (!filter.Matches(*it)) {
      ++it;
      continue;
    }
    if (!HoldLocked(sub, *it, deliver)) break;  // full
    ++delivered_;
    ++moved;
    it = queue_.erase(it);  // its bytes stay counted: now held
  }
}

const NotificationQueue::Subscriber* NotificationQueue::AttachedLocked(
    const Subscription& sub) const {
  if (sub.attached == 0) return nullptr;
  for (const Entry& entry : subscribers_) {
    if (entry.token == sub.attached) return &entry.subscriber;
  }
  return nullptr;
}

absl::StatusOr<NotificationQueue::Subscription*> NotificationQueue::FindOrMakeLocked(
    const SubscriptionKey& key, std::string_view call) {
  if (absl::Status named = CheckSubscriptionName(key.name); !named.ok()) {
    return absl::InvalidArgumentError(fmt::format("{}: {}", call, std::string(named.message())));
  }
  const std::string k = KeyOf(key);
  auto it = subscriptions_.find(k);
  if (it != subscriptions_.end()) return it->second.get();
  if (limits_ != nullptr) {
    absl::Status fits = limits_->Check(
        Limit::kSubscriptions, fmt::format("{}: new subscription '{}' for {}", call, key.name,
                                           key.owner),
        subscriptions_.size(), 1,
        "reuse subscription names (one per decode worker), or shorten --subscription-ttl-ms so "
        "abandoned ones expire sooner");
    if (!fits.ok()) return fits;
    // One holder (a local uid, whatever client names its sessions take; a certificate)
    // may make a quarter of them: any identified caller may subscribe, and one must not
    // take every decode engine's room.
    const std::string_view holder = HolderOf(key.owner);
    uint64_t held = 0;
    for (const auto& [other, s] : subscriptions_) {
      held += HolderOf(std::string_view(other).substr(0, other.find('\n'))) == holder;
    }
    const uint64_t share = std::max<uint64_t>(1, limits_->value(Limit::kSubscriptions) / 4);
    if (held >= share) {
      return limits_->Refuse(
          Limit::kSubscriptions,
          fmt::format("{}: new subscription '{}' for {}, whose {} holds {} already (a quarter "
                      "of the limit may be one holder's)",
                      call, key.name, key.owner, holder, held),
          held, 1,
          "reuse subscription names (one per decode worker), or shorten --subscription-ttl-ms "
          "so abandoned ones expire sooner");
    }
  }
  auto sub = std::make_unique<Subscription>();
  sub->idle_since_ms = NowMs();
  Subscription* made = sub.get();
  subscriptions_.emplace(k, std::move(sub));
  return made;
}

absl::StatusOr<uint64_t> NotificationQueue::Attach(const SubscriptionKey& key,
                                                   NotificationFilter filter,
                                                   Subscriber deliver,
                                                   std::function<void()> on_replaced) {
  absl::MutexLock lock(&mu_);
  MaybeExpireLocked();
  auto sub = FindOrMakeLocked(key, "WatchNotifications");
  if (!sub.ok()) return sub.status();
  Subscription& s = **sub;
  if (s.attached != 0) {
    // The newer attachment wins (the older client is most likely gone, unnoticed yet).
    auto replaced = std::find_if(subscribers_.begin(), subscribers_.end(),
                                 [&](const Entry& e) { return e.token == s.attached; });
    if (replaced != subscribers_.end()) {
      if (replaced->on_replaced) replaced->on_replaced();
      subscribers_.erase(replaced);
    }
    next_subscriber_ = 0;
  }
  const uint64_t token = next_token_++;
  s.attached = token;
  s.filter = std::move(filter);
  for (const Held& held : s.held) deliver(held.notification);  // again, in order
  HandOverToSubscriptionLocked(s, s.filter, &deliver, 0);
  subscribers_.push_back(Entry{token, std::move(deliver), KeyOf(key), std::move(on_replaced)});
  return token;
}

absl::StatusOr<std::vector<v1::Notification>> NotificationQueue::PollSubscription(
    const SubscriptionKey& key, uint32_t max, const NotificationFilter& filter) {
  absl::MutexLock lock(&mu_);
  MaybeExpireLocked();
  auto sub = FindOrMakeLocked(key, "PollNotifications");
  if (!sub.ok()) return sub.status();
  Subscription& s = **sub;
  if (s.attached == 0) s.idle_since_ms = NowMs();
  std::vector<v1::Notification> out;
  for (const Held& held : s.held) {
    if (max != 0 && out.size() >= max) return out;
    out.push_back(held.notification.notification);
  }
  const size_t before = s.held.size();
  HandOverToSubscriptionLocked(s, filter, nullptr,
                               max == 0 ? 0 : max - static_cast<uint32_t>(out.size()));
  for (size_t i = before; i < s.held.size(); ++i) {
    out.push_back(s.held[i].notification.notification);
  }
  return out;
}

absl::StatusOr<uint64_t> NotificationQueue::Ack(const SubscriptionKey& key, uint64_t through,
                                                const std::vector<uint64_t>& sequences) {
  absl::MutexLock lock(&mu_);
  MaybeExpireLocked();
  auto it = subscriptions_.find(KeyOf(key));
  if (it == subscriptions_.end()) {
    return absl::NotFoundError(fmt::format(
        "AckNotifications: no subscription '{}' for {} (never made by this caller, or idle past "
        "--subscription-ttl-ms, when what it held went back to the queue)",
        Printable(key.name, 80), key.owner));
  }
  Subscription& s = *it->second;
  const absl::flat_hash_set<uint64_t> listed(sequences.begin(), sequences.end());
  uint64_t released = 0;
  for (auto h = s.held.begin(); h != s.held.end();) {
    if (h->sequence <= through || listed.contains(h->sequence)) {
      bytes_ -= std::min(bytes_, Size(h->notification.notification));
      h = s.held.erase(h);
      ++released;
    } else {
      ++h;
    }
  }
  in_flight_ -= std::min(in_flight_, released);
  if (s.attached == 0) s.idle_since_ms = NowMs();
  // Room made: what waited for it goes to the attached stream now.
  if (released > 0) {
    if (const Subscriber* deliver = AttachedLocked(s)) {
      HandOverToSubscriptionLocked(s, s.filter, deliver, 0);
    }
  }
  return released;
}

void NotificationQueue::set_subscription_ttl_ms(uint64_t ttl_ms) {
  absl::MutexLock lock(&mu_);
  ttl_ms_ = ttl_ms;
}

void NotificationQueue::set_clock(std::function<uint64_t()> now_ms) {
  absl::MutexLock lock(&mu_);
  clock_ = std::move(now_ms);
}

uint64_t NotificationQueue::ExpireIdle() {
  absl::MutexLock lock(&mu_);
  return ExpireLocked(NowMs());
}

void NotificationQueue::MaybeExpireLocked() {
  if (subscriptions_.empty()) return;
  const uint64_t now = NowMs();
  if (now - last_expiry_check_ms_ < std::min(kExpiryCheckMs, ttl_ms_)) return;
  ExpireLocked(now);
}

uint64_t NotificationQueue::ExpireLocked(uint64_t now) {
  last_expiry_check_ms_ = now;
  uint64_t dropped = 0;
  for (auto it = subscriptions_.begin(); it != subscriptions_.end();) {
    Subscription& s = *it->second;
    if (s.attached != 0 || now < s.idle_since_ms || now - s.idle_since_ms < ttl_ms_) {
      ++it;
      continue;
    }
    // Back to the front, in order, taken once again; they were counted all along, so
    // they fit.
    for (auto h = s.held.rbegin(); h != s.held.rend(); ++h) {
      h->notification.notification.clear_sequence();
      queue_.push_front(std::move(h->notification));
    }
    in_flight_ -= std::min<uint64_t>(in_flight_, s.held.size());
    delivered_ -= std::min<uint64_t>(delivered_, s.held.size());
    subscriptions_.erase(it++);
    ++dropped;
  }
  expired_ += dropped;
  if (dropped > 0) {
    for (Entry& entry : subscribers_) {
      if (entry.subscription.empty()) {
        HandOverLocked(entry.subscriber);
      } else if (auto sub = subscriptions_.find(entry.subscription); sub != subscriptions_.end()) {
        HandOverToSubscriptionLocked(*sub->second, sub->second->filter, &entry.subscriber, 0);
      }
    }
  }
  return dropped;
}

uint64_t NotificationQueue::in_flight_per_subscription() const {
  return limits_ != nullptr ? limits_->value(Limit::kInFlightPerSubscription) : ~uint64_t{0};
}

uint64_t NotificationQueue::queued() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

uint64_t NotificationQueue::in_flight() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

uint64_t NotificationQueue::subscriptions() const {
  absl::MutexLock lock(&mu_);
  return subscriptions_.size();
}

uint64_t NotificationQueue::largest_subscription() const {
  absl::MutexLock lock(&mu_);
  uint64_t largest = 0;
  for (const auto& [key, sub] : subscriptions_) largest = std::max<uint64_t>(largest, sub->held.size());
  return largest;
}

uint64_t NotificationQueue::expired_subscriptions() const {
  absl::MutexLock lock(&mu_);
  return expired_;
}

uint64_t NotificationQueue::queued_bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

uint64_t NotificationQueue::overflowed() const {
  absl::MutexLock lock(&mu_);
  return overflowed_;
}

uint64_t NotificationQueue::delivered() const {
  absl::MutexLock lock(&mu_);
  return delivered_;
}

}  // namespace kvagent::agent
