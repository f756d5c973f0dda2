#include "agent/notification_queue.h"

#include <algorithm>
#include <utility>

namespace kvagent::agent {

bool NotificationReader::Takes(const QueuedNotification& q) const {
  if (any) return true;
  for (const auto& owner : q.owners) {
    if (owner == principal) return true;
  }
  return false;
}

bool NotificationQueue::OfferLocked(const QueuedNotification& n) {
  const size_t count = subscribers_.size();
  for (size_t i = 0; i < count; ++i) {
    auto& subscriber = subscribers_[(next_subscriber_ + i) % count];
    if (subscriber.second(n)) {
      next_subscriber_ = (next_subscriber_ + i + 1) % count;
      ++delivered_;
      return true;
    }
  }
  return false;
}

uint64_t NotificationQueue::Size(const v1::Notification& n) {
  return n.payload().size() + n.error_message().size() + n.transfer_id().size() +
         n.from_agent().size() + 128;
}

absl::Status NotificationQueue::Reserve(std::string_view what, uint64_t bytes) {
  if (limits_ == nullptr) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  constexpr std::string_view kFix =
      "the clients of this agent's regions are not taking their notifications "
      "(PollNotifications or WatchNotifications)";
  absl::Status fits =
      limits_->Check(Limit::kQueuedNotifications, what, queue_.size() + reserved_, 1, kFix);
  if (fits.ok()) {
    fits = limits_->Check(Limit::kQueuedNotificationBytes, what, bytes_ + reserved_bytes_, bytes,
                          kFix);
  }
  if (!fits.ok()) return fits;
  ++reserved_;
  reserved_bytes_ += bytes;
  return absl::OkStatus();
}

bool NotificationQueue::Push(QueuedNotification notification, uint64_t reserved_bytes) {
  absl::MutexLock lock(&mu_);
  const bool reserved = reserved_bytes > 0 && reserved_ > 0;
  if (reserved) {
    --reserved_;
    reserved_bytes_ -= std::min(reserved_bytes_, reserved_bytes);
  }
  if (OfferLocked(notification)) return true;
  const uint64_t bytes = Size(notification.notification);
  if (!reserved && limits_ != nullptr &&
      (!limits_->Fits(Limit::kQueuedNotifications, queue_.size() + reserved_, 1) ||
       !limits_->Fits(Limit::kQueuedNotificationBytes, bytes_ + reserved_bytes_, bytes))) {
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
  subscribers_.emplace_back(token, std::move(subscriber));
  return token;
}

void NotificationQueue::OfferQueued(uint64_t token) {
  absl::MutexLock lock(&mu_);
  for (const auto& [t, subscriber] : subscribers_) {
    if (t == token) {
      HandOverLocked(subscriber);
      return;
    }
  }
}

void NotificationQueue::Unsubscribe(uint64_t token) {
  absl::MutexLock lock(&mu_);
  for (auto it = subscribers_.begin(); it != subscribers_.end(); ++it) {
    if (it->first == token) {
      subscribers_.erase(it);
      break;
    }
  }
  next_subscriber_ = 0;
}

uint64_t NotificationQueue::queued() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
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
