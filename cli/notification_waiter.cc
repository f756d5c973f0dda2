#include "cli/notification_waiter.h"

#include <atomic>

#include "client/fast_ring.h"
#include "fmt/format.h"

#include "absl/synchronization/mutex.h"
#include "cli/agent_client.h"
#include "cli/process_cpu.h"

namespace kvagent::cli {

struct NotificationWaiter::State {
  NotificationWaiterOptions options;
  std::atomic<bool> stop{false};
  mutable absl::Mutex mu;
  std::map<std::string, Clock::time_point> kept ABSL_GUARDED_BY(mu);
  uint64_t count ABSL_GUARDED_BY(mu) = 0;
  bool ended ABSL_GUARDED_BY(mu) = false;
  double cpu_seconds ABSL_GUARDED_BY(mu) = 0;  // the thread's, when it ended
  absl::Status status ABSL_GUARDED_BY(mu);

  // A poller and a ring only count what they keep.
  bool Counting() const { return options.poll || options.ring != nullptr; }

  // Keeps `n` when it is of interest; false once the stream has what it waits for.
  bool Take(const v1::Notification& n) {
    if (!options.end_id.empty() && n.transfer_id() == options.end_id) return false;
    if (options.keep && !options.keep(n)) return true;
    uint64_t now_kept;
    {
      absl::MutexLock lock(&mu);
      // A stream's notification is kept once per transfer id, with its time; a poller
      // only counts (at 100,000s a second the map would cost the run).
      if (!Counting() && !kept.emplace(n.transfer_id(), Clock::now()).second) return true;
      now_kept = ++count;
    }
    if (options.on_kept) options.on_kept(now_kept);
    return options.stop_after == 0 || now_kept < options.stop_after;
  }

  absl::Status Stream() {
    AgentClient client(options.address);
    return client.WatchNotifications(options.ids, options.timeout_ms,
                                     [this](const v1::Notification& n) { return Take(n); });
  }

  absl::Status Poll() {
    AgentClient client(options.address, options.timeout_ms);
    while (!stop.load()) {
      auto polled = client.Poll(options.poll_max);
      if (!polled.ok()) return polled.status();
      for (const auto& n : polled->notifications()) Take(n);
      const int got = polled->notifications_size();
      if (got < 256) std::this_thread::sleep_for(std::chrono::milliseconds(got == 0 ? 5 : 1));
    }
    return absl::OkStatus();
  }

  absl::Status Ring() {
    std::vector<client::FastCompletion> got;
    while (!stop.load()) {
      got.clear();
      auto reaped = options.ring->Reap(&got, 1024, absl::Milliseconds(5), options.ring_batch);
      if (!reaped.ok()) return reaped.status();
      for (const auto& c : got) {
        if (c.opcode != client::fastring::kNotification) continue;
        if (!c.notification) {
          return absl::Status(c.code, fmt::format("a notification on the ring: {}", c.message));
        }
        Take(*c.notification);
      }
    }
    return absl::OkStatus();
  }
};

NotificationWaiterOptions StreamUntil(std::string address, std::string prefix,
                                      std::string end_id) {
  NotificationWaiterOptions options;
  options.address = std::move(address);
  options.keep = [prefix = std::move(prefix)](const v1::Notification& n) {
    return n.transfer_id().rfind(prefix, 0) == 0;
  };
  options.end_id = std::move(end_id);
  return options;
}

NotificationWaiter::NotificationWaiter(NotificationWaiterOptions options)
    : state_(std::make_shared<State>()) {
  state_->options = std::move(options);
  thread_ = std::thread([state = state_] {
    absl::Status status = state->options.ring ? state->Ring()
                          : state->options.poll ? state->Poll()
                                                : state->Stream();
    const double cpu = ThreadCpuSeconds();
    absl::MutexLock lock(&state->mu);
    state->ended = true;
    state->status = std::move(status);
    state->cpu_seconds = cpu;
  });
}

absl::Status NotificationWaiter::WaitForId(const std::string& id, absl::Duration timeout) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  auto came = [&s, &id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
    return s.ended || s.kept.count(id) > 0;
  };
  s.mu.AwaitWithTimeout(absl::Condition(&came), timeout);
  if (s.kept.count(id) > 0) return absl::OkStatus();
  return s.status.ok() ? absl::DeadlineExceededError("not delivered in time") : s.status;
}

absl::StatusOr<uint64_t> NotificationWaiter::WaitForCount(uint64_t count, absl::Duration timeout) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  auto enough = [&s, count]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
    return s.count >= count || !s.status.ok();
  };
  s.mu.AwaitWithTimeout(absl::Condition(&enough), timeout);
  if (!s.status.ok()) return s.status;
  return s.count;
}

void NotificationWaiter::Finish(absl::Duration timeout) {
  if (!thread_.joinable()) return;
  state_->stop.store(true);
  bool ended;
  {
    absl::MutexLock lock(&state_->mu);
    // A poller (a ring) stops within one poll (reap): always waited for.
    if (state_->Counting()) timeout = absl::InfiniteDuration();
    state_->mu.AwaitWithTimeout(absl::Condition(&state_->ended), timeout);
    ended = state_->ended;
  }
  if (ended) {
    thread_.join();
  } else {
    thread_.detach();
  }
}

std::map<std::string, NotificationWaiter::Clock::time_point> NotificationWaiter::Kept() const {
  absl::MutexLock lock(&state_->mu);
  return state_->kept;
}

uint64_t NotificationWaiter::kept() const {
  absl::MutexLock lock(&state_->mu);
  return state_->count;
}

absl::Status NotificationWaiter::status() const {
  absl::MutexLock lock(&state_->mu);
  return state_->status;
}

double NotificationWaiter::cpu_seconds() const {
  absl::MutexLock lock(&state_->mu);
  return state_->cpu_seconds;
}

}  // namespace kvagent::cli
