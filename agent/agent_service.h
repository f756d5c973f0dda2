// The gRPC services of kvagentd: `Agent` (engine workers and schedulers) and `Peer`
// (other agents), one pair per door (local socket, mutual TLS, insecure). Every call
// first identifies its caller (agent/access.h) and is refused unless the caller has
// the role and owns what it names. Handlers use the callback API and never block on
// UCX: transfers run on the worker thread and streams are fed from engine callbacks.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "agent/access.h"
#include "agent/incoming.h"
#include "agent/local_door.h"
#include "agent/metadata_watchers.h"
#include "agent/notification_queue.h"
#include "agent/peer_manager.h"
#include "agent/peer_secrets.h"
#include "agent/transfer_engine.h"
#include "proto/kvagent.grpc.pb.h"
#include "registry/region_registry.h"
#include "registry/memory_object.h"
#include "transport/ucx_context.h"
#include "transport/ucx_worker.h"

namespace kvagent::agent {

// What the services read about the agent itself.
struct AgentIdentity {
  std::string name;
  uint64_t incarnation = 0;
  std::string host_id;
  std::string listen_address;  // the network door, "" when there is none
  std::string network_door;    // "mtls HOST:PORT", "insecure HOST:PORT" or "none"
  std::string local_socket;    // the local door's gRPC socket
  uint64_t start_us = 0;  // monotonic
};

struct ServiceDeps {
  const AgentIdentity* identity;
  const transport::UcxContext* context;
  transport::UcxWorker* worker;
  registry::RegionRegistry* registry;
  PeerManager* peers;
  TransferEngine* engine;
  NotificationQueue* notifications;
  IncomingTransfers* incoming;
  MetadataWatchers* watchers;
  LocalDoor* local_door;
  const AccessPolicy* policy;
  const registry::PathPolicy* path_policy;  // registration by name
  PeerSecrets* secrets;
  SecurityCounters* counters;
  // WatchTransfer and WatchNotifications streams whose reactor still exists, on all
  // doors (AgentStatus.open_streams).
  std::atomic<int64_t>* open_streams;
  uint32_t deregister_wait_ms = 2000;
};

// Identifies the caller of a call that came through `door`: UNAUTHENTICATED when it
// cannot be (no or unknown session token, no verified certificate).
absl::StatusOr<Caller> IdentifyCaller(Door door, const ServiceDeps& deps,
                                      grpc::CallbackServerContext* context);

// Deregisters `names` (owned by `caller` unless it is a scheduler) and calls `done`
// once every polling peer holds the new version or the wait passed, with the new
// version and the peers that had not confirmed. The memory stays mapped until then.
void DeregisterAndWait(const ServiceDeps& deps, const std::vector<std::string>& names,
                       const Caller& caller,
                       std::function<void(absl::StatusOr<uint64_t> version,
                                          std::vector<std::string> unconfirmed)> done);

class AgentService final : public v1::Agent::CallbackService {
 public:
  AgentService(Door door, ServiceDeps deps) : door_(door), deps_(deps) {}
  grpc::ServerUnaryReactor* RegisterRegions(grpc::CallbackServerContext* context,
                                            const v1::RegisterRegionsRequest* request,
                                            v1::RegisterRegionsResponse* response) override;
  grpc::ServerUnaryReactor* DeregisterRegions(grpc::CallbackServerContext* context,
                                              const v1::DeregisterRegionsRequest* request,
                                              v1::DeregisterRegionsResponse* response) override;
  grpc::ServerUnaryReactor* ListRegions(grpc::CallbackServerContext* context,
                                        const v1::ListRegionsRequest* request,
                                        v1::ListRegionsResponse* response) override;
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* context,
                                      const v1::GetStatusRequest* request,
                                      v1::AgentStatus* response) override;
  grpc::ServerUnaryReactor* ConnectPeer(grpc::CallbackServerContext* context,
                                        const v1::ConnectPeerRequest* request,
                                        v1::PeerInfo* response) override;
  grpc::ServerUnaryReactor* DisconnectPeer(grpc::CallbackServerContext* context,
                                           const v1::DisconnectPeerRequest* request,
                                           v1::DisconnectPeerResponse* response) override;
  grpc::ServerUnaryReactor* ListPeers(grpc::CallbackServerContext* context,
                                      const v1::ListPeersRequest* request,
                                      v1::ListPeersResponse* response) override;
  grpc::ServerUnaryReactor* SubmitTransfer(grpc::CallbackServerContext* context,
                                           const v1::SubmitTransferRequest* request,
                                           v1::TransferState* response) override;
  // Each entry is submitted on its own; with `wait` the call answers when all ended.
  grpc::ServerUnaryReactor* SubmitTransfers(grpc::CallbackServerContext* context,
                                            const v1::SubmitTransfersRequest* request,
                                            v1::SubmitTransfersResponse* response) override;
  grpc::ServerUnaryReactor* GetTransfer(grpc::CallbackServerContext* context,
                                        const v1::GetTransferRequest* request,
                                        v1::TransferState* response) override;
  grpc::ServerWriteReactor<v1::TransferState>* WatchTransfer(
      grpc::CallbackServerContext* context, const v1::GetTransferRequest* request) override;
  grpc::ServerUnaryReactor* ListTransfers(grpc::CallbackServerContext* context,
                                          const v1::ListTransfersRequest* request,
                                          v1::ListTransfersResponse* response) override;
  grpc::ServerUnaryReactor* CancelTransfer(grpc::CallbackServerContext* context,
                                           const v1::CancelTransferRequest* request,
                                           v1::TransferState* response) override;
  grpc::ServerUnaryReactor* PollNotifications(grpc::CallbackServerContext* context,
                                              const v1::PollNotificationsRequest* request,
                                              v1::PollNotificationsResponse* response) override;
  grpc::ServerWriteReactor<v1::Notification>* WatchNotifications(
      grpc::CallbackServerContext* context, const v1::WatchNotificationsRequest* request) override;
  // Host checks are local reads and the CUDA driver is probed once at start-up, so
  // this answers inline.
  grpc::ServerUnaryReactor* Doctor(grpc::CallbackServerContext* context,
                                   const v1::DoctorRequest* request,
                                   v1::DoctorReport* response) override;

 private:
  using SubmitDone = std::function<void(absl::StatusOr<v1::TransferState>)>;
  // Submits `request` (refreshing the peer first when it names a remote group or
  // region the peer's catalog lacks) and calls `done` once: with the accepted state,
  // or with the final state when `wait`. `request` must outlive the call of `done`.
  void Submit(const v1::SubmitTransferRequest& request, const Caller& caller, bool wait,
              SubmitDone done);
  // Identifies the caller and checks it has what `call` needs; a refusal is counted
  // and logged with the caller and the reason.
  absl::StatusOr<Caller> Authorize(grpc::CallbackServerContext* context, Need need,
                                   std::string_view call);

  const Door door_;
  ServiceDeps deps_;
};

class PeerService final : public v1::Peer::CallbackService {
 public:
  PeerService(Door door, ServiceDeps deps) : door_(door), deps_(deps) {}
  grpc::ServerUnaryReactor* GetMetadata(grpc::CallbackServerContext* context,
                                        const v1::GetMetadataRequest* request,
                                        v1::AgentMetadata* response) override;

 private:
  const Door door_;
  ServiceDeps deps_;
};

}  // namespace kvagent::agent
