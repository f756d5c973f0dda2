#include "agent/health.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>

#include "fmt/format.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/security/server_credentials.h"
#include "proto/health.pb.h"
#include "transport/base/log.h"

namespace kvagent::agent {
namespace {
constexpr log::Logger kLog("health");

uint64_t NowMicros() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

// Server reflection on one builder's server, or not. Linking libgrpc++_reflection
// registers its plugin for every server of the process (a static initializer), so the
// option first takes any copy out, then adds one when asked: each server says for
// itself whether it serves reflection.
class ReflectionOption final : public grpc::ServerBuilderOption {
 public:
  explicit ReflectionOption(bool serve) : serve_(serve) {}
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    auto reflection = std::make_unique<grpc::reflection::ProtoServerReflectionPlugin>();
    const std::string name = reflection->name();
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                  [&name](const auto& p) { return p->name() == name; }),
                   plugins->end());
    if (serve_) plugins->push_back(std::move(reflection));
  }

 private:
  const bool serve_;
};
}  // namespace

const std::vector<std::string>& HealthServiceNames() {
  static const auto* names =
      new std::vector<std::string>{"", "kvagent.v1.Agent", "kvagent.v1.Peer"};
  return *names;
}

struct HealthMonitor::Heartbeat {
  std::atomic<uint64_t> last_us{0};  // monotonic; when the worker last ran our closure
};

HealthMonitor::HealthMonitor(transport::UcxWorker* worker, Options options)
    : worker_(worker), options_(options), heartbeat_(std::make_shared<Heartbeat>()) {
  // Links health.pb.cc into the binary, so its descriptor is in the generated pool and
  // reflection can describe grpc.health.v1.Health.
  (void)grpc::health::v1::HealthCheckResponse::descriptor();
  // Every server built from now on gets gRPC's default health service.
  grpc::EnableDefaultHealthCheckService(true);
  AddCondition("ucx", [this]() -> absl::Status {
    const uint64_t last = heartbeat_->last_us.load();
    const uint64_t age = last == 0 ? UINT64_MAX : NowMicros() - last;
    if (age <= static_cast<uint64_t>(absl::ToInt64Microseconds(options_.ucx_stall))) {
      return absl::OkStatus();
    }
    return absl::UnavailableError(fmt::format(
        "the UCX progress thread has not run a posted task for {}; transfers cannot move "
        "(see the agent's log; restart it if this lasts)",
        last == 0 ? std::string("ever") : fmt::format("{} ms", age / 1000)));
  });
}

HealthMonitor::~HealthMonitor() { Stop(); }

void HealthMonitor::AddCondition(std::string name, std::function<absl::Status()> check,
                                 bool readiness_only) {
  conditions_.push_back(Condition{std::move(name), std::move(check), readiness_only});
}

void HealthMonitor::SetAll(grpc::HealthCheckServiceInterface* service, bool ready, bool live) {
  for (const auto& name : HealthServiceNames()) service->SetServingStatus(name, ready);
  service->SetServingStatus(kLivenessService, live);
}

void HealthMonitor::Follow(grpc::HealthCheckServiceInterface* service) {
  if (service == nullptr) return;
  absl::MutexLock lock(&mu_);
  SetAll(service, status_.ok() && !stopping_, live_ && !stopping_);
  if (stopping_) service->Shutdown();
  followed_.push_back(service);
}

void HealthMonitor::Start() {
  std::shared_ptr<Heartbeat> beat = heartbeat_;
  worker_->RunSync([beat] { beat->last_us.store(NowMicros()); });
  Apply(Evaluate());
  thread_ = std::thread([this] { Loop(); });
}

void HealthMonitor::Loop() {
  pthread_setname_np(pthread_self(), "health");
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (!stopping_) cv_.WaitWithTimeout(&mu_, options_.interval);
      if (stopping_) return;
    }
    Apply(Evaluate());
    // Checked at the next round: a worker that does not run it within ucx_stall fails.
    worker_->Post([beat = heartbeat_] { beat->last_us.store(NowMicros()); });
  }
}

HealthMonitor::Verdict HealthMonitor::Evaluate() {
  Verdict verdict;
  verdict.live = true;
  for (const auto& c : conditions_) {
    absl::Status status = c.check();
    if (status.ok()) continue;
    if (!c.readiness_only) verdict.live = false;
    if (verdict.ready.ok()) {
      verdict.ready = absl::Status(status.code(), fmt::format("{}: {}", c.name, status.message()));
    }
  }
  return verdict;
}

void HealthMonitor::Apply(Verdict verdict) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  const bool changed = verdict.ready.ok() != status_.ok() || verdict.live != live_;
  if (verdict.ready.ok() != status_.ok()) {
    if (verdict.ready.ok()) {
      kLog.Info("SERVING (grpc.health.v1)");
    } else {
      kLog.Warn("NOT_SERVING (grpc.health.v1): {}{}", verdict.ready.message(),
                verdict.live ? " (kvagent.liveness stays SERVING)" : "");
    }
  }
  if (changed) {
    for (auto* service : followed_) SetAll(service, verdict.ready.ok(), verdict.live);
  }
  status_ = std::move(verdict.ready);
  live_ = verdict.live;
}

void HealthMonitor::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      stopping_ = true;
      status_ = absl::UnavailableError("the agent is shutting down");
      for (auto* service : followed_) service->Shutdown();
      cv_.SignalAll();
    }
  }
  if (thread_.joinable()) thread_.join();
}

bool HealthMonitor::serving() const {
  absl::MutexLock lock(&mu_);
  return status_.ok();
}

std::string HealthMonitor::Describe() const {
  absl::MutexLock lock(&mu_);
  return status_.ok() ? "SERVING" : fmt::format("NOT_SERVING: {}", status_.message());
}

void AddReflection(grpc::ServerBuilder* builder) {
  builder->SetOption(std::make_unique<ReflectionOption>(true));
}

absl::StatusOr<std::unique_ptr<HealthDoor>> StartHealthDoor(const std::string& address,
                                                            grpc::ResourceQuota* quota) {
  grpc::EnableDefaultHealthCheckService(true);
  auto door = std::make_unique<HealthDoor>();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
  builder.SetResourceQuota(*quota);
  // Health requests are a few bytes; a probe has no business sending more.
  builder.SetMaxReceiveMessageSize(4 << 10);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 16);
  builder.SetOption(std::make_unique<ReflectionOption>(false));
  // gRPC adds its default health service only to a server that polls for callbacks;
  // a generic callback service answers every other method UNIMPLEMENTED.
  door->unimplemented = std::make_unique<grpc::CallbackGenericService>();
  builder.RegisterCallbackGenericService(door->unimplemented.get());
  door->server = builder.BuildAndStart();
  if (!door->server || port == 0) {
    return absl::UnavailableError(fmt::format(
        "--health-listen {}: cannot listen there (address in use, not local, or malformed); "
        "use HOST:PORT with a free port, or port 0 to pick one",
        address));
  }
  door->address = fmt::format("{}:{}", address.substr(0, address.rfind(':')), port);
  return door;
}

}  // namespace kvagent::agent
