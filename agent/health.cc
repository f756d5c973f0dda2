#include "agent/health.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>

#include "base/log.h"
#include "fmt/format.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/security/server_credentials.h"
#include "proto/health.pb.h"

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

// The heartbeat's clock and what wakes the monitor's thread. Closures queued on the
// worker hold a reference, so they may run after the monitor is gone.
struct HealthMonitor::Heartbeat {
  // Monotonic microseconds, 0 for none.
  std::atomic<uint64_t> posted_us{0};       // when the unanswered heartbeat was posted
  std::atomic<uint64_t> last_post_us{0};    // when the last heartbeat was posted
  std::atomic<bool> ever_answered{false};   // the worker has run one
  std::atomic<bool> stalled{false};         // reported stalled: the next answer wakes the thread
  std::atomic<bool> check_due{false};       // an asked-for heartbeat's check is scheduled
  absl::Mutex mu;
  absl::CondVar cv;
  bool wake ABSL_GUARDED_BY(mu) = false;      // check the conditions now
  bool asked ABSL_GUARDED_BY(mu) = false;     // a reader wants a fresh heartbeat
  bool stopping ABSL_GUARDED_BY(mu) = false;  // the thread leaves

  void Wake(bool ask) {
    absl::MutexLock lock(&mu);
    (ask ? asked : wake) = true;
    cv.Signal();
  }
  void Answered() {
    ever_answered.store(true);
    posted_us.store(0);
    // Paired with the thread's store of `stalled` and then load of `posted_us`: one of
    // the two sees the other, so a recovery is never left for the next round.
    if (stalled.load()) Wake(/*ask=*/false);
  }
};

namespace {
uint64_t Micros(absl::Duration d) {
  return static_cast<uint64_t>(std::max<int64_t>(absl::ToInt64Microseconds(d), 0));
}
}  // namespace

HealthMonitor::HealthMonitor(transport::UcxWorker* worker, Options options)
    : worker_(worker), options_(options), heartbeat_(std::make_shared<Heartbeat>()) {
  // Links health.pb.cc into the binary, so its descriptor is in the generated pool and
  // reflection can describe grpc.health.v1.Health.
  (void)grpc::health::v1::HealthCheckResponse::descriptor();
  // Every server built from now on gets gRPC's default health service.
  grpc::EnableDefaultHealthCheckService(true);
  AddCondition("ucx", [this]() -> absl::Status {
    Heartbeat& beat = *heartbeat_;
    const bool never = !beat.ever_answered.load();
    const uint64_t posted = beat.posted_us.load();
    const uint64_t age = posted == 0 ? 0 : NowMicros() - posted;
    if (!never && age <= Micros(options_.ucx_stall)) {
      beat.stalled.store(false);
      return absl::OkStatus();
    }
    beat.stalled.store(true);
    return absl::UnavailableError(fmt::format(
        "the UCX progress thread has not run a posted task for {}; transfers cannot move "
        "(see the agent's log; restart it if this lasts)",
        never ? std::string("ever") : fmt::format("{} ms", age / 1000)));
  });
}

HealthMonitor::~HealthMonitor() { Stop(); }

void HealthMonitor::AddCondition(std::string name, std::function<absl::Status()> check,
                                 bool readiness_only) {
  conditions_.push_back(Condition{std::move(name), std::move(check), readiness_only});
}

void HealthMonitor::Recheck() { heartbeat_->Wake(/*ask=*/false); }

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

void HealthMonitor::PostHeartbeat(uint64_t now) {
  uint64_t none = 0;
  if (!heartbeat_->posted_us.compare_exchange_strong(none, now)) return;  // one unanswered
  heartbeat_->last_post_us.store(now);
  worker_->Post([beat = heartbeat_] { beat->Answered(); });
}

void HealthMonitor::SetWatchdog(absl::Duration every,
                                std::function<void(bool live, const std::string& status)> ping) {
  options_.interval = std::min(options_.interval, every);
  watchdog_ = std::move(ping);
}

void HealthMonitor::Start() {
  std::shared_ptr<Heartbeat> beat = heartbeat_;
  const uint64_t now = NowMicros();
  beat->posted_us.store(now);
  beat->last_post_us.store(now);
  worker_->RunSync([beat] { beat->Answered(); });
  Apply(Evaluate());
  thread_ = std::thread([this] { Loop(); });
}

void HealthMonitor::Loop() {
  pthread_setname_np(pthread_self(), "health");
  Heartbeat& beat = *heartbeat_;
  const uint64_t interval = std::max<uint64_t>(Micros(options_.interval), 1000);
  uint64_t next_round = NowMicros() + interval;
  uint64_t check_at = 0;  // when an asked-for heartbeat is late; 0: none
  for (;;) {
    bool asked = false;
    {
      absl::MutexLock lock(&beat.mu);
      for (;;) {
        if (beat.stopping) return;
        if (beat.wake || beat.asked) break;
        const uint64_t now = NowMicros();
        const uint64_t due = check_at != 0 ? std::min(next_round, check_at) : next_round;
        if (now >= due) break;
        beat.cv.WaitWithTimeout(&beat.mu, absl::Microseconds(due - now));
      }
      asked = beat.asked;
      beat.asked = beat.wake = false;
    }
    const uint64_t now = NowMicros();
    if (check_at != 0 && now >= check_at) {
      check_at = 0;
      beat.check_due.store(false);
    }
    Apply(Evaluate());
    if (beat.stalled.load() && beat.posted_us.load() == 0) {
      beat.Wake(/*ask=*/false);  // answered while being judged late: judge again
    }
    if (now >= next_round) {
      // Judged at a later round (or when asked): unanswered longer than ucx_stall fails.
      PostHeartbeat(now);
      next_round = now + interval;
    }
    if (asked) {
      // A heartbeat for the reader, unless one is unanswered or was posted just now;
      // then judged as soon as it is late (not at the next round).
      const bool fresh = beat.posted_us.load() == 0 &&
                         now - beat.last_post_us.load() >= Micros(options_.ask_gap);
      if (fresh) PostHeartbeat(now);
      const uint64_t posted = beat.posted_us.load();
      if (posted != 0 && (fresh || check_at == 0) && !beat.stalled.load()) {
        check_at = posted + Micros(options_.ucx_stall) + 1000;
        beat.check_due.store(true);
      }
    }
  }
}

void HealthMonitor::Ask() const {
  Heartbeat& beat = *heartbeat_;
  const uint64_t posted = beat.posted_us.load();
  if (posted == 0) {
    // The worker answered one posted within ask_gap: nothing newer to learn yet.
    if (NowMicros() - beat.last_post_us.load() < Micros(options_.ask_gap)) return;
  } else if (beat.check_due.load() || beat.stalled.load()) {
    return;  // its check is already scheduled, or it is already reported
  }
  beat.Wake(/*ask=*/true);
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
  bool live = false;
  std::string status;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    ApplyLocked(std::move(verdict));
    if (!watchdog_) return;
    live = live_;
    status = DescribeLocked();
    if (!status_.ok() && live_) status += " (kvagent.liveness stays SERVING)";
  }
  watchdog_(live, status);  // outside mu_: it sends a datagram
}

void HealthMonitor::ApplyLocked(Verdict verdict) {
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
    }
  }
  {
    absl::MutexLock lock(&heartbeat_->mu);
    heartbeat_->stopping = true;
    heartbeat_->cv.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
}

bool HealthMonitor::serving() const {
  Ask();
  absl::MutexLock lock(&mu_);
  return status_.ok();
}

std::string HealthMonitor::Describe() const {
  Ask();
  absl::MutexLock lock(&mu_);
  return DescribeLocked();
}

std::string HealthMonitor::DescribeLocked() const {
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
