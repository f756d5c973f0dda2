#include "agent/agent.h"

#include <unistd.h>

#include <fstream>
#include <random>
#include <sstream>

#include "absl/strings/str_join.h"
#include "agent/doctor.h"
#include "agent/status_util.h"
#include "fmt/format.h"
#include "transport/base/format.h"
#include "grpcpp/grpcpp.h"
#include "transport/base/log.h"
#include "transport/base/status_macros.h"

namespace kvagent::agent {
namespace {
constexpr log::Logger kLog("agent");

std::string ReadBootId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << port << "\n";
    if (!out) {
      return absl::FailedPreconditionError(fmt::format(
          "--port-file {}: cannot write {}; choose a writable path", path, tmp));
    }
  }
  // Rename so a reader never sees a half-written file.
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::FailedPreconditionError(
        fmt::format("--port-file {}: cannot rename {} into place", path, tmp));
  }
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<std::unique_ptr<Agent>> Agent::Start(const AgentOptions& options) {
  RETURN_IF_ERROR(ValidateStagingOptions(options.staging));
  if (options.name.empty()) {
    return absl::InvalidArgumentError(
        "--name is empty; give this agent a name unique among its peers (e.g. the host and "
        "GPU: node3-gpu0)");
  }
  std::unique_ptr<Agent> agent(new Agent());
  agent->options_ = options;
  agent->identity_.name = options.name;
  agent->identity_.incarnation = std::random_device{}() | (uint64_t{std::random_device{}()} << 32);
  agent->identity_.host_id = ReadBootId();
  agent->identity_.start_us = MonotonicMicros();

  ASSIGN_OR_RETURN(agent->context_, transport::UcxContext::Create());
  const auto& caps = agent->context_->capabilities();
  kLog.Info("UCX {}: transports [{}], memory types [{}]", caps.version,
            absl::StrJoin(caps.transports, ","), absl::StrJoin(caps.memory_types, ","));
  ASSIGN_OR_RETURN(agent->worker_, transport::UcxWorker::Create(*agent->context_, "ucx-" + options.name));
  registry::RegistryOptions registry_options;
  registry_options.vram_staging = options.vram_staging;
  registry_options.stage_host_regions = options.stage_host_regions;
  agent->registry_ =
      std::make_unique<registry::RegionRegistry>(agent->context_.get(), registry_options);
  agent->notifications_ = std::make_unique<NotificationQueue>();
  agent->watchers_ = std::make_unique<MetadataWatchers>();
  PeerManagerOptions peer_options;
  peer_options.self_name = options.name;
  peer_options.host_id = agent->identity_.host_id;
  peer_options.error_mode = options.error_mode;
  peer_options.refresh_ms = options.peer_refresh_ms;
  peer_options.shm_direct = options.shm_direct;
  agent->peers_ = std::make_unique<PeerManager>(agent->worker_.get(), peer_options);
  StagerOptions stager_options;
  stager_options.self_name = options.name;
  stager_options.incarnation = agent->identity_.incarnation;
  stager_options.pool = options.staging;
  Agent* self = agent.get();
  agent->stager_ = std::make_unique<Stager>(
      agent->worker_.get(), agent->context_.get(), agent->registry_.get(), stager_options,
      [self](v1::Notification n) { self->engine_->DeliverNotification(std::move(n)); });
  TransferEngineOptions engine_options;
  engine_options.self_name = options.name;
  engine_options.default_timeout_ms = options.transfer_timeout_ms;
  engine_options.ucx_cuda = caps.cuda_memory;
  engine_options.incarnation = agent->identity_.incarnation;
  engine_options.stager = agent->stager_.get();
  agent->engine_ = std::make_unique<TransferEngine>(
      agent->worker_.get(), agent->registry_.get(), agent->peers_.get(),
      agent->notifications_.get(), engine_options);
  agent->engine_->Start();
  agent->stager_->Start();
  // A lost peer fails its transfers at once instead of at their deadline. The engine
  // outlives the peer manager's callers: peers stop in Shutdown, before the engine
  // is destroyed.
  agent->peers_->SetLossListener(
      [engine = agent->engine_.get()](const PeerLoss& loss) { engine->FailPeer(loss); });

  ServiceDeps deps{&agent->identity_,      agent->context_.get(),       agent->worker_.get(),
                   agent->registry_.get(), agent->peers_.get(),         agent->engine_.get(),
                   agent->notifications_.get(), agent->watchers_.get(), options.deregister_wait_ms};
  agent->agent_service_ = std::make_unique<AgentService>(deps);
  agent->peer_service_ = std::make_unique<PeerService>(deps);

  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &agent->port_);
  builder.RegisterService(agent->agent_service_.get());
  builder.RegisterService(agent->peer_service_.get());
  builder.SetMaxReceiveMessageSize(64 << 20);
  agent->server_ = builder.BuildAndStart();
  if (!agent->server_ || agent->port_ == 0) {
    return absl::UnavailableError(fmt::format(
        "--listen {}: cannot listen there (address in use, not local, or malformed); use "
        "HOST:PORT with a free port, or port 0 to pick one",
        options.listen));
  }
  const std::string host = options.listen.substr(0, options.listen.rfind(':'));
  agent->identity_.listen_address = fmt::format("{}:{}", host, agent->port_);
  agent->peers_->StartMonitor();
  if (!options.port_file.empty()) RETURN_IF_ERROR(WritePortFile(options.port_file, agent->port_));
  kLog.Info("agent '{}' serving on {} (pid {}, incarnation {:x})", options.name,
            agent->identity_.listen_address, getpid(), agent->identity_.incarnation);
  // The same checks `kvagentctl doctor` runs; also loads the CUDA driver once, off the
  // RPC path.
  DoctorInputs doctor;
  doctor.agent = options.name;
  doctor.ucx = &caps;
  LogDoctorReport(RunDoctor(doctor));
  return agent;
}

void Agent::Shutdown(absl::Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  kLog.Info("agent '{}' shutting down", options_.name);
  // Transfers finish first (their notifications need the worker, not gRPC).
  if (engine_) engine_->Stop(grace);
  if (stager_) stager_->Stop();
  // Transfers had their grace above and handlers never block: 100 ms lets answers in
  // flight go out, then calls still open (watch streams) are cancelled. With 1 s, a
  // SIGTERM during a transfer measured grace + 1.0 s to exit; with 100 ms, grace + 0.12 s.
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  if (peers_) peers_->Stop();
}

Agent::~Agent() {
  Shutdown(absl::ZeroDuration());
  server_.reset();
  agent_service_.reset();
  peer_service_.reset();
  engine_.reset();
  peers_.reset();
  watchers_.reset();
  registry_.reset();
  worker_.reset();
  // After the worker: its last closures may still finish staged chunks.
  stager_.reset();
  context_.reset();
}

}  // namespace kvagent::agent
