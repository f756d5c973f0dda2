// AgentClient is a blocking client for one kvagentd's Agent service, every call
// with a deadline. Used by kvagentctl (status, demo, bench) and by the integration
// tests, which drive real agents through it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/kvagent.grpc.pb.h"

namespace kvagent::cli {

class AgentClient {
 public:
  explicit AgentClient(const std::string& address, uint32_t timeout_ms = 10000);

  const std::string& address() const { return address_; }

  absl::StatusOr<v1::AgentStatus> Status();
  absl::StatusOr<v1::AllocateSharedMemoryResponse> Allocate(const std::string& name, uint64_t bytes);
  absl::StatusOr<v1::RegisterRegionsResponse> Register(const v1::RegisterRegionsRequest& request);
  absl::StatusOr<v1::DeregisterRegionsResponse> Deregister(const std::vector<std::string>& names);
  absl::StatusOr<v1::ListRegionsResponse> Regions();
  absl::StatusOr<v1::PeerInfo> Connect(const std::string& peer_address);
  absl::StatusOr<v1::ListPeersResponse> Peers();
  // With request.wait the answer comes when the transfer has ended.
  absl::StatusOr<v1::TransferState> Submit(const v1::SubmitTransferRequest& request);
  // Many transfers in one call; each entry's result (state or error) in order.
  absl::StatusOr<v1::SubmitTransfersResponse> SubmitBatch(const v1::SubmitTransfersRequest& request);
  absl::StatusOr<v1::TransferState> Get(const std::string& transfer_id);
  absl::StatusOr<v1::TransferState> Cancel(const std::string& transfer_id);
  absl::StatusOr<v1::ListTransfersResponse> Transfers(bool active_only);
  absl::StatusOr<v1::PollNotificationsResponse> Poll(uint32_t max,
                                                     const std::vector<std::string>& ids = {});
  // Streams states until the transfer ends; returns the last one.
  absl::StatusOr<v1::TransferState> WaitTransfer(const std::string& transfer_id,
                                                 uint32_t timeout_ms);
  // Streams notifications to `on_notification` until it returns false or the
  // timeout passes (then DEADLINE_EXCEEDED).
  absl::Status WatchNotifications(const std::vector<std::string>& ids, uint32_t timeout_ms,
                                  const std::function<bool(const v1::Notification&)>& on_notification);
  // Waits until the agent answers GetStatus, up to `timeout_ms`.
  absl::Status WaitReady(uint32_t timeout_ms);

  v1::Agent::Stub* stub() { return stub_.get(); }

 private:
  std::string address_;
  uint32_t timeout_ms_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Agent::Stub> stub_;
};

}  // namespace kvagent::cli
