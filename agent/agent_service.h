// The gRPC services of kvagentd: `Agent` (engine workers and schedulers) and `Peer`
// (other agents). Handlers use the callback API and never block on UCX: transfers
// run on the worker thread and streams are fed from engine callbacks.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "agent/metadata_watchers.h"
#include "agent/notification_queue.h"
#include "agent/peer_manager.h"
#include "agent/transfer_engine.h"
#include "proto/kvagent.grpc.pb.h"
#include "registry/region_registry.h"
#include "registry/shm_mapping.h"
#include "transport/ucx_context.h"
#include "transport/ucx_worker.h"

namespace kvagent::agent {

// What the services read about the agent itself.
struct AgentIdentity {
  std::string name;
  uint64_t incarnation = 0;
  std::string host_id;
  std::string listen_address;
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
  MetadataWatchers* watchers;
  uint32_t deregister_wait_ms = 2000;
};

class AgentService final : public v1::Agent::CallbackService {
 public:
  explicit AgentService(ServiceDeps deps) : deps_(deps) {}

  grpc::ServerUnaryReactor* AllocateSharedMemory(grpc::CallbackServerContext* context,
                                                 const v1::AllocateSharedMemoryRequest* request,
                                                 v1::AllocateSharedMemoryResponse* response) override;
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
  void Submit(const v1::SubmitTransferRequest& request, bool wait, SubmitDone done);

  ServiceDeps deps_;
  // WatchTransfer and WatchNotifications streams whose reactor still exists.
  std::atomic<int64_t> open_streams_{0};
  absl::Mutex shm_mu_;
  uint64_t shm_counter_ ABSL_GUARDED_BY(shm_mu_) = 0;
  // Objects this agent created; unlinked when the agent exits.
  absl::flat_hash_map<std::string, registry::ShmMapping> allocations_ ABSL_GUARDED_BY(shm_mu_);
};

class PeerService final : public v1::Peer::CallbackService {
 public:
  explicit PeerService(ServiceDeps deps) : deps_(deps) {}
  grpc::ServerUnaryReactor* GetMetadata(grpc::CallbackServerContext* context,
                                        const v1::GetMetadataRequest* request,
                                        v1::AgentMetadata* response) override;

 private:
  ServiceDeps deps_;
};

}  // namespace kvagent::agent
