// NotificationWaiter: takes an agent's notifications on a thread of its own, as a
// decode worker would, and keeps those of interest: how many, and when each came.
// Either on one WatchNotifications stream, until an end notification, a count or its
// deadline, or by PollNotifications in batches (a run of 100,000s of WRITEs a second
// would fill the agent's queue behind one stream message per notification), or on a
// fast path ring whose notification watch is in place (no gRPC thread per
// notification, as a decode engine on the node takes them). Its owner waits for one
// transfer id or for a count. kvagentctl's demo, bench (grid cells, rate
// phase, fast path phase) and the agent-memory phase all take notifications this way.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/fast_path.h"
#include "proto/kvagent.pb.h"

namespace kvagent::cli {

struct NotificationWaiterOptions {
  std::string address;  // the agent whose notifications are taken
  // The stream's deadline; with `poll`, each PollNotifications call's.
  uint32_t timeout_ms = 30 * 60 * 1000;
  // PollNotifications in batches of up to `poll_max` (0: the agent's bound) instead of
  // a stream: polls again at once while batches are large, after 1 ms while they are
  // small, after 5 ms when none came.
  bool poll = false;
  uint32_t poll_max = 0;
  // Instead of gRPC (`address` unused): reap this ring, whose WatchNotifications entry
  // has completed, in batches, until Finish; a notification completion with an error
  // ends taking with it. Counted only, as a poller. The waiter owns the ring (its
  // session must outlive the waiter) and closes it when destroyed.
  std::shared_ptr<client::FastPath> ring;
  // With `ring`: each reap sleeps until this many notifications have come (bounded by
  // its 5 ms wait, so the last ones of a run are taken too); 1: wakes for each.
  uint32_t ring_batch = 1;
  // Which notifications are kept (null: every one); called on the waiter's thread. A
  // stream keeps one per transfer id.
  std::function<bool(const v1::Notification&)> keep;
  // Stream only: the transfer ids asked for (empty: all); the id whose notification
  // ends the stream (not kept); a count of kept ones that ends it (0: none).
  std::vector<std::string> ids;
  std::string end_id;
  uint64_t stop_after = 0;
  // Called (on the waiter's thread) with the count after each kept notification.
  std::function<void(uint64_t kept)> on_kept;
};

// A stream of `address`'s notifications keeping those whose transfer id starts with
// `prefix`, until `end_id`'s (a bench run's transfers, closed by a last one).
NotificationWaiterOptions StreamUntil(std::string address, std::string prefix, std::string end_id);

class NotificationWaiter {
 public:
  using Clock = std::chrono::steady_clock;

  explicit NotificationWaiter(NotificationWaiterOptions options);
  ~NotificationWaiter() { Finish(absl::ZeroDuration()); }
  NotificationWaiter(const NotificationWaiter&) = delete;
  NotificationWaiter& operator=(const NotificationWaiter&) = delete;

  // Waits up to `timeout` for `id`'s notification: OK when it came, else why not.
  absl::Status WaitForId(const std::string& id, absl::Duration timeout);
  // Waits up to `timeout` until `count` were kept: how many were, or why taking ended
  // (a failed poll).
  absl::StatusOr<uint64_t> WaitForCount(uint64_t count, absl::Duration timeout);
  // Waits up to `timeout` for the stream to end (a poller is told to stop first), then
  // lets the thread go: joined when it ended, else detached (it owns its state and
  // ends with the stream).
  void Finish(absl::Duration timeout);

  // The kept notifications so far: transfer id -> when it came (a stream's; a poller
  // only counts them).
  std::map<std::string, Clock::time_point> Kept() const;
  uint64_t kept() const;
  // How taking ended: the stream's status or a poll's failure; OK while it runs.
  absl::Status status() const;
  // The CPU time the taking thread used, user and system, once it ended (after a
  // Finish that joined it); 0 before.
  double cpu_seconds() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
  std::thread thread_;
};

}  // namespace kvagent::cli
