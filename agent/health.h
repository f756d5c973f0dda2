// How kvagentd tells standard tools whether it serves and what it serves:
// grpc.health.v1.Health (gRPC's default health service, one per server, whose status
// HealthMonitor sets) and server reflection (the schema of every service on a door).
// The Agent wires them into its doors and the health-only door (--health-listen).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "transport/ucx_worker.h"

namespace kvagent::agent {

// The names Health answers for: "" (the agent as a whole) and each gRPC service.
const std::vector<std::string>& HealthServiceNames();

// SERVING while every condition holds, NOT_SERVING (with the first failing reason)
// otherwise, on every health service it follows. Built in: the UCX worker's progress
// thread runs a posted closure (a heartbeat) within `ucx_stall` (a stuck or dead worker
// moves no bytes). Further conditions plug in with AddCondition: the directory's lease,
// once the agent has a directory (issue 17 part 1), is one.
//
// Nothing wakes on a timer while nothing changes (an idle agent's wakeups, issue 17
// part 6): a condition's owner calls Recheck when its state changes (the directory
// when its lease is won or lost), and the monitor's own round, every `interval`,
// re-checks every condition and posts one heartbeat. A worker that stalls is reported
// within interval + max(interval, ucx_stall) (20 s by default) with no one asking, and
// within ucx_stall of a Describe or serving() (GetStatus, the metrics endpoint), which
// post a heartbeat of their own when the last one is more than a second old.
class HealthMonitor {
 public:
  struct Options {
    // The monitor's own round: every condition re-checked, one heartbeat posted to the
    // UCX worker (which wakes it). Conditions whose owner calls Recheck need no round.
    absl::Duration interval = absl::Seconds(10);
    absl::Duration ucx_stall = absl::Seconds(5);  // a heartbeat unanswered longer fails
    // A Describe or serving() posts a heartbeat when the last was posted longer ago.
    absl::Duration ask_gap = absl::Seconds(1);
  };
  HealthMonitor(transport::UcxWorker* worker, Options options);
  explicit HealthMonitor(transport::UcxWorker* worker) : HealthMonitor(worker, Options{}) {}
  ~HealthMonitor();
  HealthMonitor(const HealthMonitor&) = delete;
  HealthMonitor& operator=(const HealthMonitor&) = delete;

  // The service name whose status leaves out readiness-only conditions: a liveness
  // probe asks for it, so an agent that only lost etcd is not restarted.
  static constexpr const char* kLivenessService = "kvagent.liveness";

  // Before Start. `check` runs on the monitor's thread at each round and after each
  // Recheck; a non-OK status means NOT_SERVING, its message the reason (GetStatus's
  // `health`). A `readiness_only` condition leaves kLivenessService SERVING.
  void AddCondition(std::string name, std::function<absl::Status()> check,
                    bool readiness_only = false);
  // A condition's state may have changed: the monitor checks them all now (on its
  // thread; this only wakes it). Any thread, any time, also after Stop.
  void Recheck();
  // A server's health service (grpc::Server::GetHealthCheckService) now follows this
  // monitor's status, starting with the current one (NOT_SERVING before Start).
  void Follow(grpc::HealthCheckServiceInterface* service);
  // Before Start: `ping` runs on the monitor's thread after every verdict (each round,
  // Recheck or ask, and at Start) with whether kvagent.liveness holds and Describe()'s
  // text; rounds come at least every `every` (systemd's watchdog, SystemdNotifier:
  // WATCHDOG=1 while live). Nothing after Stop.
  void SetWatchdog(absl::Duration every, std::function<void(bool live, const std::string& status)> ping);
  // Waits for one UCX heartbeat, sets the status, and starts the monitor's thread.
  void Start();
  // NOT_SERVING for good on every followed service (shutdown: probes see it at once,
  // before transfers drain), then stops the thread. Idempotent.
  void Stop();

  // The status as last set. Each call also asks for a fresh heartbeat (see above), so
  // a caller that asks again sees a stalled worker within ucx_stall.
  bool serving() const;
  // "SERVING", or "NOT_SERVING: <reason>".
  std::string Describe() const;

 private:
  struct Heartbeat;
  void Loop();
  // Posts a heartbeat unless one is unanswered; `now` in monotonic microseconds.
  void PostHeartbeat(uint64_t now);
  void Ask() const;
  struct Verdict {
    absl::Status ready;  // every condition: OK or the first failure
    bool live = false;   // every condition that is not readiness-only holds
  };
  struct Condition {
    std::string name;
    std::function<absl::Status()> check;
    bool readiness_only = false;
  };
  Verdict Evaluate();
  // Sets the status (and the watchdog's ping, when set).
  void Apply(Verdict verdict);
  void ApplyLocked(Verdict verdict) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string DescribeLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetAll(grpc::HealthCheckServiceInterface* service, bool ready, bool live);

  transport::UcxWorker* worker_;
  Options options_;
  // Shared with closures still queued on the worker; also what wakes the thread.
  std::shared_ptr<Heartbeat> heartbeat_;
  std::vector<Condition> conditions_;
  std::function<void(bool, const std::string&)> watchdog_;  // set before Start
  mutable absl::Mutex mu_;
  std::vector<grpc::HealthCheckServiceInterface*> followed_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_) = absl::UnavailableError("starting");
  bool live_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// Adds server reflection (grpc.reflection.v1alpha.ServerReflection) to this one
// builder's server: it lists that server's services and describes them from the
// compiled-in descriptors. Reflection reveals the schema only, never state.
void AddReflection(grpc::ServerBuilder* builder);

// The health-only door (--health-listen HOST:PORT, plain TCP): grpc.health.v1.Health
// and nothing else (every other method UNIMPLEMENTED, no reflection), for probes that
// cannot present a certificate (Kubernetes' gRPC probes).
struct HealthDoor {
  std::string address;  // HOST:PORT as bound (port 0 picks one)
  std::unique_ptr<grpc::CallbackGenericService> unimplemented;  // outlives `server`
  std::unique_ptr<grpc::Server> server;
};
absl::StatusOr<std::unique_ptr<HealthDoor>> StartHealthDoor(const std::string& address,
                                                            grpc::ResourceQuota* quota);

}  // namespace kvagent::agent
