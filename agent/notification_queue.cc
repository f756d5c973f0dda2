#include "agent/notification_queue.h"

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

void NotificationQueue::Push(QueuedNotification notification) {
  absl::MutexLock lock(&mu_);
  if (!OfferLocked(notification)) queue_.push_back(std::move(notification));
}

std::vector<v1::Notification> NotificationQueue::Poll(
    uint32_t max, const absl::flat_hash_set<std::string>& ids, const NotificationReader& reader) {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Notification> out;
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (max != 0 && out.size() >= max) break;
    if ((ids.empty() || ids.contains(it->notification.transfer_id())) && reader.Takes(*it)) {
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
  for (auto it = notifications.rbegin(); it != notifications.rend(); ++it) {
    queue_.push_front(std::move(*it));
  }
}

uint64_t NotificationQueue::Subscribe(Subscriber subscriber) {
  absl::MutexLock lock(&mu_);
  const uint64_t token = next_token_++;
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (subscriber(*it)) {
      ++delivered_;
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
  subscribers_.emplace_back(token, std::move(subscriber));
  return token;
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

uint64_t NotificationQueue::delivered() const {
  absl::MutexLock lock(&mu_);
  return delivered_;
}

}  // namespace kvagent::agent
