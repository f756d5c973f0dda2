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
#include "agent/am_ids.h"
#include "agent/directory.h"
#include "agent/fast_path.h"
#include "agent/health.h"
#include "agent/incoming.h"
#include "agent/limits.h"
#include "agent/local_door.h"
#include "agent/metadata_watchers.h"
#include "agent/notification_queue.h"
#include "agent/peer_manager.h"
#include "agent/peer_secrets.h"
#include "agent/session_releases.h"
#include "agent/session_server.h"
#include "agent/transfer_engine.h"
#include "agent/transfer_metrics.h"
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
  std::string health_address;  // --health-listen as bound, "" when off
  std::string metrics_address;  // --metrics-listen as bound, "" when off
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
  const Limits* limits;
  // Open Watch* streams per principal (the streams_per_caller limit).
  StreamTable* streams;
  std::atomic<uint64_t>* pending_connects;  // ConnectPeer calls in progress
  uint32_t deregister_wait_ms = 2000;
  // AgentMetadata.wire_features announced (kWireFeatures, masked by --wire-features).
  uint32_t wire_features = kWireFeatures;
  // AgentMetadata.data_addresses: this agent's data interface addresses.
  std::vector<std::string> data_addresses = {};
  FastPathServer* fast_path = nullptr;  // AgentStatus.fast_path_*; null: none
  const HealthMonitor* health = nullptr;  // AgentStatus.health; null: not reported
  // Ended transfers by op, data path, peer and outcome (Prometheus); null: not counted.
  TransferMetrics* transfer_metrics = nullptr;
  Directory* directory = nullptr;  // ListAgents, ConnectPeer "agent:NAME"; null: none
  // WatchMetadata streams (woken when the registry's version moves); null: the Peer
  // service answers WatchMetadata with UNIMPLEMENTED.
  MetadataPush* push = nullptr;
  // Announced in AgentMetadata.liveness_address, its keys admitted as secrets are
  // issued; null: none (--liveness off).
  LivenessDoor* liveness = nullptr;
  // Local sessions ended and not released yet (AgentStatus.sessions_releasing,
  // oldest_release_wait_ms); null: not reported.
  const SessionReleases* releases = nullptr;
  // The session socket (AgentStatus.sessions_refused_releasing, sessions_hello_timeouts,
  // sessions_refused_waiting, sessions_refused_connecting); null: not reported.
  const SessionServer* session_server = nullptr;
};

// Identifies the caller of a call that came through `door`: UNAUTHENTICATED when it
// cannot be (no or unknown session token, no verified certificate).
absl::StatusOr<Caller> IdentifyCaller(Door door, const ServiceDeps& deps,
                                      grpc::CallbackServerContext* context);

// Everything GetStatus reports but who asked (caller, caller_roles): the numbers
// GetStatus and the Prometheus endpoint (agent/metrics) both read.
void FillAgentStatus(const ServiceDeps& deps, v1::AgentStatus* status);

// Deregisters `names` (owned by `caller` unless it is a scheduler) and calls `done`
// once every polling peer holds the new version or the wait passed, with the new
// version and the peers that had not confirmed. The memory stays mapped until then.
void DeregisterAndWait(const ServiceDeps& deps, const std::vector<std::string>& names,
                       const Caller& caller,
                       std::function<void(absl::StatusOr<uint64_t> version,
                                          std::vector<std::string> unconfirmed)> done);

// Submits `request` as `caller` (refreshing the peer first when it names a remote group
// or region the peer's catalog lacks) and calls `done` once: with the accepted state,
// or with the final state when `wait`; or with the refusal (`refused` not OK, `state`
// empty). `request` must outlive the call of `done`. The gRPC methods and the fast path
// (agent/fast_path) both submit through it. `state` is lent for the call only (the final
// one is the engine's own, under its lock): `done` copies what it keeps, so the fast
// path, which keeps five fields, copies no whole state.
using SubmitDone =
    std::function<void(const absl::Status& refused, const v1::TransferState& state)>;
void SubmitTransfer(const ServiceDeps& deps, const v1::SubmitTransferRequest& request,
                    const Caller& caller, bool wait, SubmitDone done);

// Every method raw (bytes in, bytes out), so that the service parses requests itself.
using AgentServiceBase =
    v1::Agent::WithRawCallbackMethod_RegisterRegions<
    v1::Agent::WithRawCallbackMethod_DeregisterRegions<
    v1::Agent::WithRawCallbackMethod_ListRegions<
    v1::Agent::WithRawCallbackMethod_GetStatus<
    v1::Agent::WithRawCallbackMethod_ConnectPeer<
    v1::Agent::WithRawCallbackMethod_DisconnectPeer<
    v1::Agent::WithRawCallbackMethod_ListPeers<
    v1::Agent::WithRawCallbackMethod_ListAgents<
    v1::Agent::WithRawCallbackMethod_SubmitTransfer<
    v1::Agent::WithRawCallbackMethod_SubmitTransfers<
    v1::Agent::WithRawCallbackMethod_GetTransfer<
    v1::Agent::WithRawCallbackMethod_WatchTransfer<
    v1::Agent::WithRawCallbackMethod_ListTransfers<
    v1::Agent::WithRawCallbackMethod_CancelTransfer<
    v1::Agent::WithRawCallbackMethod_PollNotifications<
    v1::Agent::WithRawCallbackMethod_WatchNotifications<
    v1::Agent::WithRawCallbackMethod_AckNotifications<
    v1::Agent::WithRawCallbackMethod_Doctor<
    v1::Agent::Service>>>>>>>>>>>>>>>>>>;

class AgentService final : public AgentServiceBase {
 public:
  AgentService(Door door, ServiceDeps deps) : door_(door), deps_(deps) {}
  using Reply = std::function<void(absl::Status)>;

  // The handlers: plain C++ with the parsed request; each calls `reply` exactly once
  // (the response is sent when the status is OK). The raw methods below adapt them.
  void HandleRegisterRegions(grpc::CallbackServerContext* context, const v1::RegisterRegionsRequest* request,
      v1::RegisterRegionsResponse* response, Reply reply);
  void HandleDeregisterRegions(grpc::CallbackServerContext* context, const v1::DeregisterRegionsRequest* request,
      v1::DeregisterRegionsResponse* response, Reply reply);
  void HandleListRegions(grpc::CallbackServerContext* context, const v1::ListRegionsRequest* request,
      v1::ListRegionsResponse* response, Reply reply);
  void HandleGetStatus(grpc::CallbackServerContext* context, const v1::GetStatusRequest* request,
      v1::AgentStatus* response, Reply reply);
  void HandleConnectPeer(grpc::CallbackServerContext* context, const v1::ConnectPeerRequest* request,
      v1::PeerInfo* response, Reply reply);
  void HandleDisconnectPeer(grpc::CallbackServerContext* context, const v1::DisconnectPeerRequest* request,
      v1::DisconnectPeerResponse* response, Reply reply);
  void HandleListPeers(grpc::CallbackServerContext* context, const v1::ListPeersRequest* request,
      v1::ListPeersResponse* response, Reply reply);
  // PeerManager's list with each same-host (shm-direct) peer's device copy mode.
  std::vector<v1::PeerInfo> ListPeersWithPaths() const;
  // "agent:NAME" in ConnectPeer: NAME's address from the directory.
  static constexpr std::string_view kAgentPrefix = "agent:";
  absl::StatusOr<std::string> ResolveAgent(const std::string& name) const;
  void HandleListAgents(grpc::CallbackServerContext* context, const v1::ListAgentsRequest* request,
      v1::ListAgentsResponse* response, Reply reply);
  void HandleSubmitTransfer(grpc::CallbackServerContext* context, const v1::SubmitTransferRequest* request,
      v1::TransferState* response, Reply reply);
  void HandleSubmitTransfers(grpc::CallbackServerContext* context, const v1::SubmitTransfersRequest* request,
      v1::SubmitTransfersResponse* response, Reply reply);
  void HandleGetTransfer(grpc::CallbackServerContext* context, const v1::GetTransferRequest* request,
      v1::TransferState* response, Reply reply);
  void HandleListTransfers(grpc::CallbackServerContext* context, const v1::ListTransfersRequest* request,
      v1::ListTransfersResponse* response, Reply reply);
  void HandleCancelTransfer(grpc::CallbackServerContext* context, const v1::CancelTransferRequest* request,
      v1::TransferState* response, Reply reply);
  void HandlePollNotifications(grpc::CallbackServerContext* context, const v1::PollNotificationsRequest* request,
      v1::PollNotificationsResponse* response, Reply reply);
  void HandleAckNotifications(grpc::CallbackServerContext* context,
      const v1::AckNotificationsRequest* request, v1::AckNotificationsResponse* response,
      Reply reply);
  void HandleDoctor(grpc::CallbackServerContext* context, const v1::DoctorRequest* request,
      v1::DoctorReport* response, Reply reply);

  // gRPC entry points: parse the request (INVALID_ARGUMENT with the reason when it
  // does not), then run the handler.
  grpc::ServerUnaryReactor* RegisterRegions(grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* DeregisterRegions(grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListRegions(grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ConnectPeer(grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* DisconnectPeer(grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListPeers(grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListAgents(grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* SubmitTransfer(grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* SubmitTransfers(grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetTransfer(grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListTransfers(grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* CancelTransfer(grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* PollNotifications(grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* AckNotifications(grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Doctor(grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* WatchTransfer(grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* WatchNotifications(grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request) override;

 private:
  // A Watch* stream's lease against the stream limits (an empty one for a refused
  // caller, whose reactor reports the refusal).
  absl::StatusOr<StreamTable::Lease> OpenStream(const absl::StatusOr<Caller>& caller,
                                                std::string_view call);
  // Identifies the caller and checks it has what `call` needs; a refusal is counted
  // and logged with the caller and the reason.
  absl::StatusOr<Caller> Authorize(grpc::CallbackServerContext* context, Need need,
                                   std::string_view call);

  const Door door_;
  ServiceDeps deps_;
};

// Fills `response` for a peer `identity` that holds `request.known_version` (as
// GetMetadata answers; a WatchMetadata stream asks it for each push): the unchanged
// form when that is current, else a delta when it can, else the whole catalog. The
// caller has authorized the peer and bounded `identity`.
void ExportMetadataFor(const ServiceDeps& deps, Door door, const std::string& identity,
                       const std::string& principal, const v1::GetMetadataRequest& request,
                       v1::AgentMetadata* response);

class PeerService final
    : public v1::Peer::WithCallbackMethod_WatchMetadata<
          v1::Peer::WithRawCallbackMethod_GetMetadata<v1::Peer::Service>> {
 public:
  PeerService(Door door, ServiceDeps deps) : door_(door), deps_(deps) {}
  using Reply = std::function<void(absl::Status)>;
  void HandleGetMetadata(grpc::CallbackServerContext* context, const v1::GetMetadataRequest* request,
                         v1::AgentMetadata* response, Reply reply);
  grpc::ServerUnaryReactor* GetMetadata(grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<v1::GetMetadataRequest, v1::AgentMetadata>* WatchMetadata(
      grpc::CallbackServerContext* context) override;

 private:
  // Identifies the caller and checks its peer role; a refusal is counted and logged.
  absl::StatusOr<Caller> AuthorizePeer(grpc::CallbackServerContext* context,
                                       std::string_view call);

  const Door door_;
  ServiceDeps deps_;
};

}  // namespace kvagent::agent
