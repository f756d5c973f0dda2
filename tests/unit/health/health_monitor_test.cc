#include <atomic>
#include <map>
#include <string>

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
  bool All(bool serving) {
    auto s = status();
    if (s.size() != HealthServiceNames().size()) return false;
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
