#include <algorithm>
#include <atomic>
#include <map>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "agent/health.h"
#include "catch2/catch.hpp"
#include "transport/ucx_context.h"
#include "transport/ucx_worker.h"

namespace kvagent::agent {
namespace {

// Records what the monitor tells a server's health service.
class RecordingHealth final : public grpc::HealthCheckServiceInterface {
 public:
  void SetServingStatus(const std::string& name, bool serving) override {
    absl::MutexLock lock(&mu_);
    if (!shut_down_) status_[name] = serving;
  }
  void SetServingStatus(bool serving) override {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    for (auto& [name, s] : status_) s = serving;
  }
  void Shutdown() override {
    absl::MutexLock lock(&mu_);
    for (auto& [name, s] : status_) s = false;
    shut_down_ = true;
  }
  std::map<std::string, bool> status() {
    absl::MutexLock lock(&mu_);
    return status_;
  }
  bool Is(const std::string& name, bool serving) {
    auto s = status();
    auto it = s.find(name);
    return it != s.end() && it->second == serving;
  }
  bool All(bool serving) {
    auto s = status();
    // The overall names and kvagent.liveness.
    if (s.size() != HealthServiceNames().size() + 1) return false;
    for (const auto& [name, v] : s) {
      if (v != serving) return false;
    }
    return true;
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, bool> status_;
  bool shut_down_ = false;
};

bool Eventually(const std::function<bool()>& condition) {
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (absl::Now() < deadline) {
    if (condition()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return condition();
}

}  // namespace

TEST_CASE("HealthMonitor follows its conditions and the UCX worker", "[health]") {
  auto context = transport::UcxContext::Create();
  REQUIRE(context.ok());
  auto worker = transport::UcxWorker::Create(**context, "health-test");
  REQUIRE(worker.ok());
  // Followers outlive the monitor (the Agent stops it before its servers go).
  RecordingHealth early, late, after;
  HealthMonitor::Options options;
  options.interval = absl::Milliseconds(10);
  options.ucx_stall = absl::Milliseconds(300);
  HealthMonitor monitor(worker->get(), options);
  std::atomic<bool> lease_held{false};
  // What the directory will plug in: serving only while its lease is held.
  monitor.AddCondition("directory", [&lease_held]() -> absl::Status {
    if (lease_held.load()) return absl::OkStatus();
    return absl::UnavailableError("lease not held");
  });
  monitor.Follow(&early);
  CHECK(early.All(false));  // NOT_SERVING before Start
  monitor.Start();
  CHECK(!monitor.serving());
  CHECK(monitor.Describe() == "NOT_SERVING: directory: lease not held");

  lease_held = true;
  REQUIRE(Eventually([&] { return monitor.serving() && early.All(true); }));
  CHECK(monitor.Describe() == "SERVING");
  monitor.Follow(&late);  // a server built later starts at the current status
  CHECK(late.All(true));

  SECTION("a worker that stops running posted tasks is NOT_SERVING, and recovers") {
    absl::Notification release;
    (*worker)->Post([&release] { release.WaitForNotification(); });
    REQUIRE(Eventually([&] { return !monitor.serving() && early.All(false) && late.All(false); }));
    CHECK(monitor.Describe().find("NOT_SERVING: ucx: the UCX progress thread has not run") == 0);
    release.Notify();
    REQUIRE(Eventually([&] { return monitor.serving() && early.All(true); }));
  }
  SECTION("a readiness-only condition leaves kvagent.liveness SERVING") {
    std::atomic<bool> etcd_up{true};
    HealthMonitor ready(worker->get(), options);
    ready.AddCondition(
        "directory",
        [&etcd_up]() -> absl::Status {
          return etcd_up.load() ? absl::OkStatus() : absl::UnavailableError("etcd down");
        },
        /*readiness_only=*/true);
    RecordingHealth probe;
    ready.Follow(&probe);
    ready.Start();
    REQUIRE(Eventually([&] { return ready.serving() && probe.All(true); }));
    etcd_up = false;
    REQUIRE(Eventually([&] { return !ready.serving() && probe.Is("", false); }));
    CHECK(probe.Is(HealthMonitor::kLivenessService, true));
    CHECK(ready.Describe() == "NOT_SERVING: directory: etcd down");
    // A stuck worker is not live either.
    absl::Notification release;
    (*worker)->Post([&release] { release.WaitForNotification(); });
    REQUIRE(Eventually([&] { return probe.Is(HealthMonitor::kLivenessService, false); }));
    release.Notify();
    etcd_up = true;
    REQUIRE(Eventually([&] { return ready.serving() && probe.All(true); }));
    ready.Stop();
  }
  SECTION("Stop is NOT_SERVING for good") {
    monitor.Stop();
    CHECK(!monitor.serving());
    CHECK(early.All(false));
    CHECK(late.All(false));
    monitor.Follow(&after);
    CHECK(after.All(false));
    CHECK(monitor.Describe() == "NOT_SERVING: the agent is shutting down");
  }
}

}  // namespace kvagent::agent

namespace kvagent::agent {

// No round for an hour: only Recheck (a condition's owner telling) and asking
// (Describe, serving()) can change the status, and they do.
TEST_CASE("HealthMonitor without rounds: Recheck and asking keep it true", "[health]") {
  auto context = transport::UcxContext::Create();
  REQUIRE(context.ok());
  auto worker = transport::UcxWorker::Create(**context, "health-ask");
  REQUIRE(worker.ok());
  HealthMonitor::Options options;
  options.interval = absl::Hours(1);
  options.ucx_stall = absl::Milliseconds(300);
  options.ask_gap = absl::Milliseconds(50);
  HealthMonitor monitor(worker->get(), options);
  std::atomic<bool> lease_held{true};
  monitor.AddCondition("directory", [&lease_held]() -> absl::Status {
    return lease_held.load() ? absl::OkStatus() : absl::UnavailableError("lease lost");
  });
  RecordingHealth probe;
  monitor.Follow(&probe);
  monitor.Start();
  REQUIRE(probe.All(true));

  lease_held = false;
  monitor.Recheck();
  REQUIRE(Eventually([&] { return probe.Is("", false); }));
  lease_held = true;
  monitor.Recheck();
  REQUIRE(Eventually([&] { return probe.All(true); }));

  // A stuck worker: followers see it only because a reader keeps asking.
  absl::Notification release;
  (*worker)->Post([&release] { release.WaitForNotification(); });
  REQUIRE(Eventually([&] { return !monitor.serving(); }));
  CHECK(probe.All(false));
  CHECK(monitor.Describe().find("NOT_SERVING: ucx: the UCX progress thread has not run") == 0);
  release.Notify();
  // The late answer wakes the monitor; nobody asks.
  REQUIRE(Eventually([&] { return probe.All(true); }));
  monitor.Stop();
  monitor.Recheck();  // after Stop: nothing to wake, no harm
  CHECK(!monitor.serving());
}

// What systemd's watchdog gets (SystemdNotifier::Health): a verdict after every round,
// rounds at the watchdog's pace though the monitor's own interval is an hour, live
// while only a readiness condition fails, not live while the worker is stuck; nothing
// after Stop.
TEST_CASE("HealthMonitor::SetWatchdog: a verdict every round, live unless a liveness "
          "condition fails", "[health]") {
  auto context = transport::UcxContext::Create();
  REQUIRE(context.ok());
  auto worker = transport::UcxWorker::Create(**context, "health-watchdog");
  REQUIRE(worker.ok());
  HealthMonitor::Options options;
  options.interval = absl::Hours(1);
  options.ucx_stall = absl::Milliseconds(300);
  HealthMonitor monitor(worker->get(), options);
  std::atomic<bool> etcd_up{true};
  monitor.AddCondition(
      "directory",
      [&etcd_up]() -> absl::Status {
        return etcd_up.load() ? absl::OkStatus() : absl::UnavailableError("etcd down");
      },
      /*readiness_only=*/true);
  struct Ping {
    bool live;
    std::string status;
    absl::Time at;
  };
  absl::Mutex mu;
  std::vector<Ping> pings;
  monitor.SetWatchdog(absl::Milliseconds(50), [&](bool live, const std::string& status) {
    absl::MutexLock lock(&mu);
    pings.push_back(Ping{live, status, absl::Now()});
  });
  auto since = [&](size_t first) {
    absl::MutexLock lock(&mu);
    return std::vector<Ping>(pings.begin() + std::min(first, pings.size()), pings.end());
  };
  auto count = [&] {
    absl::MutexLock lock(&mu);
    return pings.size();
  };
  monitor.Start();
  REQUIRE(count() >= 1);  // Start's verdict
  CHECK(since(0)[0].live);
  CHECK(since(0)[0].status == "SERVING");
  REQUIRE(Eventually([&] { return count() >= 6; }));  // rounds every 50 ms, not every hour
  for (const Ping& p : since(0)) CHECK(p.live);

  etcd_up = false;
  monitor.Recheck();
  REQUIRE(Eventually([&] {
    auto all = since(0);
    return !all.empty() && all.back().status.find("etcd down") != std::string::npos;
  }));
  CHECK(since(0).back().live);  // only readiness: the watchdog is still fed
  CHECK(since(0).back().status ==
        "NOT_SERVING: directory: etcd down (kvagent.liveness stays SERVING)");
  etcd_up = true;

  absl::Notification release;
  (*worker)->Post([&release] { release.WaitForNotification(); });
  REQUIRE(Eventually([&] {
    auto all = since(0);
    return !all.empty() && !all.back().live;
  }));
  const size_t stuck_from = count();
  absl::SleepFor(absl::Milliseconds(300));
  const auto stuck = since(stuck_from - 1);
  REQUIRE(stuck.size() >= 3);  // still rounds, every one not live
  for (const Ping& p : stuck) {
    CHECK_FALSE(p.live);
    CHECK(p.status.find("NOT_SERVING: ucx: the UCX progress thread has not run") == 0);
  }
  release.Notify();
  REQUIRE(Eventually([&] {
    auto all = since(0);
    return !all.empty() && all.back().live && all.back().status == "SERVING";
  }));
  monitor.Stop();
  const size_t stopped = count();
  absl::SleepFor(absl::Milliseconds(200));
  CHECK(count() == stopped);
}

}  // namespace kvagent::agent
