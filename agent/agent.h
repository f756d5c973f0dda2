// Agent wires one kvagentd together: UCX context and worker, region registry, peer
// manager, transfer engine, notification queue and the gRPC server. main.cc parses
// flags into AgentOptions; tests and tools can embed an Agent the same way.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "agent/agent_service.h"
#include "agent/metadata_watchers.h"
#include "agent/notification_queue.h"
#include "agent/peer_manager.h"
#include "agent/staging.h"
#include "agent/transfer_engine.h"
#include "grpcpp/server.h"
#include "registry/region_registry.h"
#include "transport/ucx_context.h"
#include "transport/ucx_worker.h"

namespace kvagent::agent {

struct AgentOptions {
  std::string name;
  std::string listen = "127.0.0.1:0";  // HOST:PORT, port 0 picks a free port
  std::string port_file;               // written with the bound port once serving
  uint32_t transfer_timeout_ms = 30000;
  uint32_t peer_refresh_ms = 200;
  ErrorModeChoice error_mode = ErrorModeChoice::kAuto;
  bool shm_direct = true;
  uint32_t deregister_wait_ms = 2000;
  bool vram_staging = true;
  // Host staging pool (--staging-buffers, --staging-chunk-bytes).
  StagingPoolOptions staging;
  // For tests only (--stage-host-regions): host regions take the staged path, so the
  // staging protocol runs end to end on machines without a GPU.
  bool stage_host_regions = false;
};

class Agent {
 public:
  static absl::StatusOr<std::unique_ptr<Agent>> Start(const AgentOptions& options);
  ~Agent();

  int port() const { return port_; }
  const AgentIdentity& identity() const { return identity_; }
  // Stops accepting RPCs, lets transfers finish for up to `grace`, fails the rest,
  // then releases peers, memory and UCX. Idempotent.
  void Shutdown(absl::Duration grace);

 private:
  Agent() = default;

  AgentOptions options_;
  AgentIdentity identity_;
  int port_ = 0;
  std::unique_ptr<transport::UcxContext> context_;
  std::unique_ptr<transport::UcxWorker> worker_;
  std::unique_ptr<registry::RegionRegistry> registry_;
  std::unique_ptr<NotificationQueue> notifications_;
  std::unique_ptr<MetadataWatchers> watchers_;
  std::unique_ptr<PeerManager> peers_;
  std::unique_ptr<Stager> stager_;  // used by the engine; destroyed after the worker
  std::unique_ptr<TransferEngine> engine_;
  std::unique_ptr<AgentService> agent_service_;
  std::unique_ptr<PeerService> peer_service_;
  std::unique_ptr<grpc::Server> server_;
  bool shut_down_ = false;
};

}  // namespace kvagent::agent
