// grpc.health.v1 and server reflection on a real kvagentd: the doors a probe or a
// standard tool (grpcurl, grpc_health_probe, Kubernetes' gRPC probes) would use.
#include <signal.h>
#include <sys/ptrace.h>
#include <sys/wait.h>

#include <cerrno>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "cli/agent_client.h"
#include "cli/daemon_process.h"
#include "cli/process_cpu.h"
#include "google/protobuf/descriptor.pb.h"
#include "grpcpp/grpcpp.h"
#include "proto/health.grpc.pb.h"
#include "tests/integration/agent_pair.h"
#include "tests/integration/reflection_client.grpc.pb.h"
#include "tests/unit/catch_main.h"
#include "tests/unit/health/notify_listener.h"

namespace kvagent::testing {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;
using grpc::reflection::v1alpha::ServerReflection;
using grpc::reflection::v1alpha::ServerReflectionRequest;
using grpc::reflection::v1alpha::ServerReflectionResponse;

std::shared_ptr<grpc::Channel> Plain(const std::string& address) {
  return grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
}

void Deadline(grpc::ClientContext* context, int ms = 5000) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms));
}

// Health.Check with no session token, no certificate: the status, or the gRPC error.
grpc::Status Check(const std::string& address, const std::string& service,
                   HealthCheckResponse* response) {
  auto stub = Health::NewStub(Plain(address));
  grpc::ClientContext context;
  Deadline(&context);
  HealthCheckRequest request;
  request.set_service(service);
  return stub->Check(&context, request, response);
}

// One reflection request on a fresh stream; the response, or the stream's error.
grpc::Status Reflect(const std::string& address, const ServerReflectionRequest& request,
                     ServerReflectionResponse* response) {
  auto stub = ServerReflection::NewStub(Plain(address));
  grpc::ClientContext context;
  Deadline(&context);
  auto stream = stub->ServerReflectionInfo(&context);
  stream->Write(request);
  stream->WritesDone();
  const bool got = stream->Read(response);
  grpc::Status status = stream->Finish();
  if (status.ok() && !got) return grpc::Status(grpc::StatusCode::INTERNAL, "no response");
  return status;
}

cli::DaemonProcess StartAgent(const std::string& dir) {
  cli::DaemonOptions d;
  auto binary = cli::FindKvagentd("");
  REQUIRE(binary.ok());
  d.binary = *binary;
  d.name = "probed";
  d.work_dir = dir;
  d.network = cli::NetworkDoor::kInsecure;
  d.extra_args = {"--health-listen", "127.0.0.1:0"};
  std::filesystem::create_directories(dir);
  auto process = cli::DaemonProcess::Start(d);
  INFO(process.status().ToString());
  REQUIRE(process.ok());
  return *std::move(process);
}

std::string WorkDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return std::string(tmp ? tmp : "/tmp");
}

// The agent's liveness-only service name (HealthMonitor::kLivenessService).
constexpr const char* kLiveness = "kvagent.liveness";

// The thread of `pid` named `name`, or -1.
pid_t FindThread(pid_t pid, const std::string& name) {
  for (const auto& [tid, thread] : cli::ThreadCpuTicks(pid)) {
    if (thread.name == name) return std::stoi(tid);
  }
  return -1;
}

// One thread of a real kvagentd stopped with ptrace, and only it: the UCX progress
// thread, stalled as by a UCX call that never returns. Thawed when destroyed.
class FrozenThread {
 public:
  explicit FrozenThread(pid_t tid) {
    if (ptrace(PTRACE_SEIZE, tid, nullptr, nullptr) != 0) {
      error_ = "ptrace(PTRACE_SEIZE) of thread " + std::to_string(tid) + ": " + std::strerror(errno);
      return;
    }
    int status = 0;
    if (ptrace(PTRACE_INTERRUPT, tid, nullptr, nullptr) != 0 ||
        waitpid(tid, &status, __WALL) != tid || !WIFSTOPPED(status)) {
      error_ = "ptrace(PTRACE_INTERRUPT) of thread " + std::to_string(tid) + ": " +
               std::strerror(errno);
      ptrace(PTRACE_DETACH, tid, nullptr, nullptr);
      return;
    }
    tid_ = tid;
  }
  ~FrozenThread() { Thaw(); }
  FrozenThread(const FrozenThread&) = delete;
  FrozenThread& operator=(const FrozenThread&) = delete;
  const std::string& error() const { return error_; }
  void Thaw() {
    if (tid_ > 0) ptrace(PTRACE_DETACH, tid_, nullptr, nullptr);
    tid_ = -1;
  }

 private:
  pid_t tid_ = -1;
  std::string error_;
};

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Polls `done` every 200 ms for up to `limit_s`; the seconds it took, or -1.
double SecondsUntil(const std::function<bool()>& done, double limit_s) {
  const auto start = std::chrono::steady_clock::now();
  while (SecondsSince(start) < limit_s) {
    if (done()) return SecondsSince(start);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return -1;
}

bool Serving(const std::string& door, const std::string& service) {
  HealthCheckResponse response;
  return Check(door, service, &response).ok() &&
         response.status() == HealthCheckResponse::SERVING;
}

}  // namespace

TEST_CASE("Health answers SERVING on every door, without a session or a certificate",
          "[health]") {
  cli::DaemonProcess agent = StartAgent(WorkDir() + "/serving");
  cli::AgentClient client(agent.address());
  auto status = client.Status();
  REQUIRE(status.ok());
  CHECK(status->health() == "SERVING");
  const std::string health_door = status->health_address();
  REQUIRE(health_door.rfind("127.0.0.1:", 0) == 0);
  REQUIRE(health_door != "127.0.0.1:0");

  for (const std::string& door : {agent.address(), agent.network_address(), health_door}) {
    for (const char* service : {"", "kvagent.v1.Agent", "kvagent.v1.Peer"}) {
      INFO(door << " service '" << service << "'");
      HealthCheckResponse response;
      grpc::Status checked = Check(door, service, &response);
      REQUIRE(checked.error_message() == "");
      CHECK(response.status() == HealthCheckResponse::SERVING);
    }
    HealthCheckResponse response;
    CHECK(Check(door, "no.such.Service", &response).error_code() == grpc::StatusCode::NOT_FOUND);
  }

  // The health-only door serves nothing else: no agent API, no reflection.
  v1::GetStatusRequest request;
  v1::AgentStatus reply;
  grpc::ClientContext context;
  Deadline(&context);
  auto stub = v1::Agent::NewStub(Plain(health_door));
  CHECK(stub->GetStatus(&context, request, &reply).error_code() ==
        grpc::StatusCode::UNIMPLEMENTED);
  ServerReflectionRequest list;
  list.set_list_services("*");
  ServerReflectionResponse listed;
  CHECK(Reflect(health_door, list, &listed).error_code() == grpc::StatusCode::UNIMPLEMENTED);

  // The local door still refuses the agent API without a session token.
  grpc::ClientContext bare;
  Deadline(&bare);
  CHECK(v1::Agent::NewStub(Plain(agent.address()))->GetStatus(&bare, request, &reply).error_code() ==
        grpc::StatusCode::UNAUTHENTICATED);
}

TEST_CASE("Health.Watch sees NOT_SERVING as soon as the agent begins to shut down", "[health]") {
  cli::DaemonProcess agent = StartAgent(WorkDir() + "/watch");
  auto stub = Health::NewStub(Plain(agent.address()));
  grpc::ClientContext context;
  Deadline(&context, 15000);
  HealthCheckRequest request;
  auto stream = stub->Watch(&context, request);
  HealthCheckResponse response;
  REQUIRE(stream->Read(&response));
  CHECK(response.status() == HealthCheckResponse::SERVING);
  REQUIRE(kill(agent.pid(), SIGTERM) == 0);
  // Shutdown flips health before it stops anything else, so the change is written
  // before the door closes.
  REQUIRE(stream->Read(&response));
  CHECK(response.status() == HealthCheckResponse::NOT_SERVING);
  context.TryCancel();
  auto exit = agent.Stop();
  REQUIRE(exit.ok());
  CHECK(*exit == 0);
}

// The monitor has no timer of its own beyond a round every 10 s (one heartbeat to the
// worker, issue 17 part 6), so a stalled worker is reported within
// interval + max(interval, ucx_stall) = 20 s when nobody asks, and within
// ask_gap + ucx_stall (6 s) when a GetStatus keeps asking: each posts a heartbeat of
// its own when the last is over a second old. The limits waited for here add 10 s for
// a loaded machine.
TEST_CASE("A stalled UCX worker is reported NOT_SERVING within the stated bounds, and "
          "recovers", "[health]") {
  cli::DaemonProcess agent = StartAgent(WorkDir() + "/stall");
  cli::AgentClient client(agent.address());
  auto status = client.Status();
  REQUIRE(status.ok());
  const std::string door = status->health_address();
  REQUIRE(Serving(door, ""));
  const pid_t ucx = FindThread(agent.pid(), "ucx-probed");
  REQUIRE(ucx > 0);
  {
    FrozenThread probe(ucx);
    if (!probe.error().empty()) {
      KVAGENT_SKIP("cannot stop one thread of the agent here (" + probe.error() +
                   "); the stall is covered in-process by health_monitor_test");
    }
  }

  SECTION("probes alone (Health.Check) see it within 20 s") {
    const auto start = std::chrono::steady_clock::now();
    FrozenThread frozen(ucx);
    REQUIRE(frozen.error() == "");
    const double seen = SecondsUntil([&] { return !Serving(door, ""); }, 30);
    INFO("NOT_SERVING after " << seen << " s");
    REQUIRE(seen >= 0);
    CHECK(!Serving(door, kLiveness));
    CHECK(!Serving(agent.address(), "kvagent.v1.Agent"));
    std::printf("stalled worker, probes only: NOT_SERVING after %.1f s (bound 20 s)\n",
                SecondsSince(start));
    frozen.Thaw();
    // The late heartbeat's answer wakes the monitor: SERVING at once, not next round.
    const double back = SecondsUntil([&] { return Serving(door, ""); }, 8);
    INFO("SERVING again after " << back << " s");
    CHECK(back >= 0);
    CHECK(Serving(door, kLiveness));
  }
  SECTION("GetStatus asking sees it within 6 s, and so do probes") {
    const auto start = std::chrono::steady_clock::now();
    FrozenThread frozen(ucx);
    REQUIRE(frozen.error() == "");
    std::string health;
    const double seen = SecondsUntil(
        [&] {
          auto s = client.Status();
          health = s.ok() ? s->health() : s.status().ToString();
          return health.rfind("NOT_SERVING", 0) == 0;
        },
        16);
    INFO(health << " after " << seen << " s");
    REQUIRE(seen >= 0);
    CHECK(health.rfind("NOT_SERVING: ucx: the UCX progress thread has not run a posted task for",
                       0) == 0);
    CHECK(!Serving(door, ""));
    std::printf("stalled worker, GetStatus asking: NOT_SERVING after %.1f s (bound 6 s)\n",
                SecondsSince(start));
    frozen.Thaw();
    const double back = SecondsUntil([&] { return Serving(door, ""); }, 8);
    CHECK(back >= 0);
    auto after = client.Status();
    REQUIRE(after.ok());
    CHECK(after->health() == "SERVING");
  }
  auto exit = agent.Stop();
  REQUIRE(exit.ok());
  CHECK(*exit == 0);
}

// kvagentd under systemd with Type=notify and WatchdogSec=, systemd played by a
// datagram socket: READY=1 once it serves, WATCHDOG=1 from every health round (a third
// of the watchdog apart), none while its UCX worker is stuck (so systemd would restart
// it), again once the worker runs, STOPPING=1 at SIGTERM.
TEST_CASE("Under systemd: READY=1, a watchdog fed only while the agent is live, STOPPING=1",
          "[health]") {
  NotifyListener systemd(testing::UniqueSocketName("/tmp/kvagent-notify-health"));
  cli::DaemonOptions d;
  auto binary = cli::FindKvagentd("");
  REQUIRE(binary.ok());
  d.binary = *binary;
  d.name = "notified";
  d.work_dir = WorkDir() + "/notified";
  std::filesystem::create_directories(d.work_dir);
  // Rounds every second; the heartbeat may go unanswered for 5 s before it is judged.
  d.env = {{"NOTIFY_SOCKET", systemd.name()}, {"WATCHDOG_USEC", "3000000"}};
  const auto started = std::chrono::steady_clock::now();
  auto process = cli::DaemonProcess::Start(d);
  INFO(process.status().ToString());
  REQUIRE(process.ok());
  cli::DaemonProcess& agent = *process;
  const NotifyListener::Message ready = systemd.WaitFor("READY=1", 10000);
  REQUIRE(ready.text == "READY=1\n");
  std::printf("under systemd: READY=1 %.2f s after the start\n",
              std::chrono::duration<double>(ready.at - started).count());
  cli::AgentClient client(agent.address());
  REQUIRE(client.Status().ok());  // READY came when it serves

  // Fed: a ping every round (a second), never the watchdog's 3 s apart; 4.5 s leaves a
  // loaded machine's late rounds room.
  auto fed = systemd.Receive(4500);
  std::vector<std::chrono::steady_clock::time_point> pings;
  for (const auto& m : fed) {
    if (m.text.find("WATCHDOG=1") != std::string::npos) pings.push_back(m.at);
  }
  INFO(pings.size() << " pings in 4.5 s");
  REQUIRE(pings.size() >= 3);
  double widest = 0;
  for (size_t i = 1; i < pings.size(); ++i) {
    widest = std::max(widest, std::chrono::duration<double>(pings[i] - pings[i - 1]).count());
  }
  CHECK(widest < 3.0);  // within the watchdog

  const pid_t ucx = FindThread(agent.pid(), "ucx-notified");
  REQUIRE(ucx > 0);
  {
    FrozenThread frozen(ucx);
    if (!frozen.error().empty()) {
      KVAGENT_SKIP("cannot stop one thread of the agent here (" + frozen.error() +
                   "); a stuck worker's verdicts are covered in-process by health_monitor_test");
    }
    // Not live within ucx_stall (5 s) and a round: the reason as STATUS, then no ping.
    const auto stuck = std::chrono::steady_clock::now();
    const NotifyListener::Message down = systemd.WaitFor("STATUS=NOT_SERVING", 10000);
    INFO(down.text);
    REQUIRE(down.text.find("STATUS=NOT_SERVING: ucx: the UCX progress thread has not run") == 0);
    CHECK(down.text.find("WATCHDOG=1") == std::string::npos);
    std::printf("under systemd: the worker stuck, the watchdog unfed after %.2f s\n",
                std::chrono::duration<double>(down.at - stuck).count());
    // Past the watchdog's 3 s: systemd would have restarted it.
    auto unfed = systemd.Receive(3500);
    for (const auto& m : unfed) CHECK(m.text.find("WATCHDOG=1") == std::string::npos);
    frozen.Thaw();
    const NotifyListener::Message back = systemd.WaitFor("WATCHDOG=1", 5000);
    INFO(back.text);
    CHECK(back.text == "STATUS=SERVING\nWATCHDOG=1\n");
  }
  REQUIRE(kill(agent.pid(), SIGTERM) == 0);
  const NotifyListener::Message stopping = systemd.WaitFor("STOPPING=1", 10000);
  CHECK(stopping.text == "STOPPING=1\nSTATUS=shutting down\n");
  auto exit = agent.Stop();
  REQUIRE(exit.ok());
  CHECK(*exit == 0);
}

TEST_CASE("Server reflection lists and describes the agent's services", "[reflection]") {
  cli::DaemonProcess agent = StartAgent(WorkDir() + "/reflection");
  for (const std::string& door : {agent.address(), agent.network_address()}) {
    INFO(door);
    ServerReflectionRequest list;
    list.set_list_services("*");
    ServerReflectionResponse listed;
    grpc::Status status = Reflect(door, list, &listed);
    REQUIRE(status.error_message() == "");
    std::set<std::string> names;
    for (const auto& service : listed.list_services_response().service()) {
      names.insert(service.name());
    }
    CHECK(names == std::set<std::string>{"kvagent.v1.Agent", "kvagent.v1.Peer",
                                         "grpc.health.v1.Health",
                                         "grpc.reflection.v1alpha.ServerReflection"});

    // A tool that calls the agent by reflection needs each service's descriptor.
    for (const auto& [symbol, method] :
         std::vector<std::pair<std::string, std::string>>{{"kvagent.v1.Agent", "SubmitTransfer"},
                                                          {"grpc.health.v1.Health", "Watch"}}) {
      INFO(symbol);
      ServerReflectionRequest describe;
      describe.set_file_containing_symbol(symbol);
      ServerReflectionResponse described;
      REQUIRE(Reflect(door, describe, &described).ok());
      REQUIRE(described.has_file_descriptor_response());
      bool found = false;
      for (const std::string& bytes : described.file_descriptor_response().file_descriptor_proto()) {
        google::protobuf::FileDescriptorProto file;
        REQUIRE(file.ParseFromString(bytes));
        for (const auto& service : file.service()) {
          if (file.package() + "." + service.name() != symbol) continue;
          for (const auto& m : service.method()) found = found || m.name() == method;
        }
      }
      CHECK(found);
    }
    ServerReflectionRequest unknown;
    unknown.set_file_containing_symbol("kvagent.v1.NoSuchThing");
    ServerReflectionResponse refused;
    REQUIRE(Reflect(door, unknown, &refused).ok());
    CHECK(refused.error_response().error_code() == static_cast<int>(grpc::StatusCode::NOT_FOUND));
  }
}

}  // namespace kvagent::testing
