// AgentClient is a blocking client for one kvagentd's Agent service, every call
// with a deadline. On the local door ("unix:PATH") it attaches a session first (the
// kernel identifies this process) and sends its token with every call; on the
// network door it authenticates with a client certificate. Used by kvagentctl
// (status, demo, bench) and by the integration tests, which drive real agents
// through it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "agent/tls.h"
#include "client/local_session.h"
#include "proto/kvagent.grpc.pb.h"
#include "registry/shm_mapping.h"

namespace kvagent::cli {

struct AgentClientOptions {
  uint32_t timeout_ms = 10000;
  std::string client_name = "kvagentctl";  // how the agent's logs name this session
  // A network address ("HOST:PORT"): mutual TLS with this certificate; without one,
  // plain TCP (only an agent's --insecure-listen door answers that).
  agent::TlsFiles tls;
};

// Memory the agent allocated for this session: its handle (for RegionSpec's
// shm.memory_handle) and this process's mapping of it.
struct SharedMemory {
  v1::MemoryHandleInfo info;
  registry::ShmMapping mapping;
};

class AgentClient {
 public:
  explicit AgentClient(const std::string& address, AgentClientOptions options = {});
  AgentClient(const std::string& address, uint32_t timeout_ms);

  const std::string& address() const { return address_; }
  bool local() const { return !session_path_.empty(); }

  // The local session (attached on first use); an error on the network door.
  absl::StatusOr<client::LocalSession*> Session();
  // A sealed memfd the agent allocates for this session, mapped here too.
  absl::StatusOr<SharedMemory> AllocateMemory(const std::string& label, uint64_t bytes);
  // Hands the agent a descriptor of memory this process owns (memfd, shm, hugetlbfs).
  absl::StatusOr<v1::MemoryHandleInfo> ShareMemory(int fd, const std::string& label);

  absl::StatusOr<v1::AgentStatus> Status();
  absl::StatusOr<v1::RegisterRegionsResponse> Register(const v1::RegisterRegionsRequest& request);
  absl::StatusOr<v1::DeregisterRegionsResponse> Deregister(const std::vector<std::string>& names);
  absl::StatusOr<v1::ListRegionsResponse> Regions();
  absl::StatusOr<v1::PeerInfo> Connect(const std::string& peer_address);
  absl::StatusOr<v1::ListPeersResponse> Peers();
  // The fleet in the agent's directory (FAILED_PRECONDITION without --directory).
  absl::StatusOr<v1::ListAgentsResponse> Agents();
  // With request.wait the answer comes when the transfer has ended.
  absl::StatusOr<v1::TransferState> Submit(const v1::SubmitTransferRequest& request);
  // Many transfers in one call; each entry's result (state or error) in order.
  absl::StatusOr<v1::SubmitTransfersResponse> SubmitBatch(const v1::SubmitTransfersRequest& request);
  // This agent's transfer by id, else an incoming one by that id (from `peer` when given).
  absl::StatusOr<v1::TransferState> Get(const std::string& transfer_id,
                                        const std::string& peer = "");
  absl::StatusOr<v1::TransferState> Cancel(const std::string& transfer_id);
  // Every page of ListTransfers (outgoing, or incoming), in one response.
  absl::StatusOr<v1::ListTransfersResponse> Transfers(bool active_only, bool incoming = false);
  absl::StatusOr<v1::DisconnectPeerResponse> Disconnect(const std::string& peer_name);
  // With `subscription`: its unacknowledged notifications first, then queued ones,
  // each with a sequence, held by the agent until Ack.
  absl::StatusOr<v1::PollNotificationsResponse> Poll(uint32_t max,
                                                     const std::vector<std::string>& ids = {},
                                                     const std::string& subscription = "");
  // Releases subscription's notifications up to `through` and those in `sequences`;
  // returns how many were released.
  absl::StatusOr<uint64_t> Ack(const std::string& subscription, uint64_t through,
                               const std::vector<uint64_t>& sequences = {});
  // Streams states until the transfer ends; returns the last one.
  absl::StatusOr<v1::TransferState> WaitTransfer(const std::string& transfer_id,
                                                 uint32_t timeout_ms);
  // Streams notifications to `on_notification` until it returns false or the
  // timeout passes (then DEADLINE_EXCEEDED). With `subscription`, the unacknowledged
  // ones come first, again; acknowledge with Ack after processing each.
  absl::Status WatchNotifications(const std::vector<std::string>& ids, uint32_t timeout_ms,
                                  const std::function<bool(const v1::Notification&)>& on_notification,
                                  const std::string& subscription = "");
  absl::StatusOr<v1::DoctorReport> Doctor();
  // Waits until the agent answers GetStatus, up to `timeout_ms`.
  absl::Status WaitReady(uint32_t timeout_ms);

  v1::Agent::Stub* stub() { return stub_.get(); }
  // Prepares a call on stub(): deadline and, on the local door, the session token
  // (attaching first). Errors when the session cannot be attached.
  absl::Status Prepare(grpc::ClientContext* context, uint32_t timeout_ms);

 private:
  template <typename Request, typename Response, typename Method>
  absl::StatusOr<Response> Unary(Method method, const Request& request, uint32_t timeout_ms);

  std::string address_;
  AgentClientOptions options_;
  uint32_t timeout_ms_;
  std::string session_path_;  // local door: PATH.session; empty on the network door
  absl::Status channel_error_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Agent::Stub> stub_;
  absl::Mutex mu_;
  std::unique_ptr<client::LocalSession> session_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvagent::cli
