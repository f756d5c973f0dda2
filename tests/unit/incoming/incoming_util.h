// What the receiving side's unit tests share: every notification the queue holds, taken
// as anyone may, and a sleep until a monotonic time (the deadlines they wait out).
#pragma once

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "agent/notification_queue.h"
#include "agent/status_util.h"
#include "proto/kvagent.pb.h"

namespace kvagent::agent::testing {

inline std::vector<v1::Notification> Delivered(NotificationQueue& queue) {
  NotificationReader everyone;
  everyone.any = true;
  return queue.Poll(0, {}, everyone);
}

inline void SleepUntil(uint64_t monotonic_us) {
  const uint64_t now = MonotonicMicros();
  if (monotonic_us > now) {
    std::this_thread::sleep_for(std::chrono::microseconds(monotonic_us - now));
  }
}

}  // namespace kvagent::agent::testing
