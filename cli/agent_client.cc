#include "cli/agent_client.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "agent/status_util.h"
#include "fmt/format.h"
#include "grpcpp/grpcpp.h"
#include "transport/base/format.h"

namespace kvagent::cli {
namespace {

void SetDeadline(grpc::ClientContext* context, uint32_t ms) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms));
}

template <typename Request, typename Response, typename Method>
absl::StatusOr<Response> Unary(v1::Agent::Stub* stub, Method method, const Request& request,
                               uint32_t timeout_ms) {
  grpc::ClientContext context;
  SetDeadline(&context, timeout_ms);
  Response response;
  grpc::Status status = (stub->*method)(&context, request, &response);
  if (!status.ok()) return agent::FromGrpcStatus(status);
  return response;
}

}  // namespace

AgentClient::AgentClient(const std::string& address, uint32_t timeout_ms)
    : address_(address), timeout_ms_(timeout_ms) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  channel_ = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  stub_ = v1::Agent::NewStub(channel_);
}

absl::StatusOr<v1::AgentStatus> AgentClient::Status() {
  return Unary<v1::GetStatusRequest, v1::AgentStatus>(stub_.get(), &v1::Agent::Stub::GetStatus,
                                                      v1::GetStatusRequest(), timeout_ms_);
}

absl::StatusOr<v1::AllocateSharedMemoryResponse> AgentClient::Allocate(const std::string& name,
                                                                       uint64_t bytes) {
  v1::AllocateSharedMemoryRequest request;
  request.set_name(name);
  request.set_bytes(bytes);
  return Unary<v1::AllocateSharedMemoryRequest, v1::AllocateSharedMemoryResponse>(
      stub_.get(), &v1::Agent::Stub::AllocateSharedMemory, request, timeout_ms_);
}

absl::StatusOr<v1::RegisterRegionsResponse> AgentClient::Register(
    const v1::RegisterRegionsRequest& request) {
  return Unary<v1::RegisterRegionsRequest, v1::RegisterRegionsResponse>(
      stub_.get(), &v1::Agent::Stub::RegisterRegions, request, timeout_ms_);
}

absl::StatusOr<v1::DeregisterRegionsResponse> AgentClient::Deregister(
    const std::vector<std::string>& names) {
  v1::DeregisterRegionsRequest request;
  for (const auto& n : names) request.add_names(n);
  return Unary<v1::DeregisterRegionsRequest, v1::DeregisterRegionsResponse>(
      stub_.get(), &v1::Agent::Stub::DeregisterRegions, request, timeout_ms_);
}

absl::StatusOr<v1::ListRegionsResponse> AgentClient::Regions() {
  return Unary<v1::ListRegionsRequest, v1::ListRegionsResponse>(
      stub_.get(), &v1::Agent::Stub::ListRegions, v1::ListRegionsRequest(), timeout_ms_);
}

absl::StatusOr<v1::PeerInfo> AgentClient::Connect(const std::string& peer_address) {
  v1::ConnectPeerRequest request;
  request.set_address(peer_address);
  return Unary<v1::ConnectPeerRequest, v1::PeerInfo>(stub_.get(), &v1::Agent::Stub::ConnectPeer,
                                                     request, timeout_ms_);
}

absl::StatusOr<v1::ListPeersResponse> AgentClient::Peers() {
  return Unary<v1::ListPeersRequest, v1::ListPeersResponse>(
      stub_.get(), &v1::Agent::Stub::ListPeers, v1::ListPeersRequest(), timeout_ms_);
}

namespace {
// A call that waits for the transfer to end needs the transfer's deadline on top of
// the usual one (60 s stands in for an agent default this client cannot see).
uint32_t WaitingTimeout(uint32_t base_ms, bool wait, uint32_t transfer_timeout_ms) {
  if (!wait) return base_ms;
  return base_ms + (transfer_timeout_ms != 0 ? transfer_timeout_ms : 60000);
}
}  // namespace

absl::StatusOr<v1::TransferState> AgentClient::Submit(const v1::SubmitTransferRequest& request) {
  return Unary<v1::SubmitTransferRequest, v1::TransferState>(
      stub_.get(), &v1::Agent::Stub::SubmitTransfer, request,
      WaitingTimeout(timeout_ms_, request.wait(), request.timeout_ms()));
}

absl::StatusOr<v1::SubmitTransfersResponse> AgentClient::SubmitBatch(
    const v1::SubmitTransfersRequest& request) {
  uint32_t longest = 0;
  bool wait = request.wait();
  for (const auto& t : request.transfers()) {
    wait = wait || t.wait();
    longest = std::max(longest, t.timeout_ms() != 0 ? t.timeout_ms() : 60000u);
  }
  return Unary<v1::SubmitTransfersRequest, v1::SubmitTransfersResponse>(
      stub_.get(), &v1::Agent::Stub::SubmitTransfers, request,
      WaitingTimeout(timeout_ms_, wait, longest));
}

absl::StatusOr<v1::TransferState> AgentClient::Get(const std::string& transfer_id) {
  v1::GetTransferRequest request;
  request.set_transfer_id(transfer_id);
  return Unary<v1::GetTransferRequest, v1::TransferState>(
      stub_.get(), &v1::Agent::Stub::GetTransfer, request, timeout_ms_);
}

absl::StatusOr<v1::TransferState> AgentClient::Cancel(const std::string& transfer_id) {
  v1::CancelTransferRequest request;
  request.set_transfer_id(transfer_id);
  return Unary<v1::CancelTransferRequest, v1::TransferState>(
      stub_.get(), &v1::Agent::Stub::CancelTransfer, request, timeout_ms_);
}

absl::StatusOr<v1::ListTransfersResponse> AgentClient::Transfers(bool active_only) {
  v1::ListTransfersRequest request;
  request.set_active_only(active_only);
  return Unary<v1::ListTransfersRequest, v1::ListTransfersResponse>(
      stub_.get(), &v1::Agent::Stub::ListTransfers, request, timeout_ms_);
}

absl::StatusOr<v1::PollNotificationsResponse> AgentClient::Poll(
    uint32_t max, const std::vector<std::string>& ids) {
  v1::PollNotificationsRequest request;
  request.set_max(max);
  for (const auto& id : ids) request.add_transfer_ids(id);
  return Unary<v1::PollNotificationsRequest, v1::PollNotificationsResponse>(
      stub_.get(), &v1::Agent::Stub::PollNotifications, request, timeout_ms_);
}

absl::StatusOr<v1::TransferState> AgentClient::WaitTransfer(const std::string& transfer_id,
                                                            uint32_t timeout_ms) {
  grpc::ClientContext context;
  SetDeadline(&context, timeout_ms);
  v1::GetTransferRequest request;
  request.set_transfer_id(transfer_id);
  auto reader = stub_->WatchTransfer(&context, request);
  v1::TransferState state;
  bool any = false;
  while (reader->Read(&state)) any = true;
  grpc::Status status = reader->Finish();
  if (!status.ok()) return agent::FromGrpcStatus(status);
  if (!any) {
    return absl::InternalError(
        fmt::format("WatchTransfer('{}') on {} ended without a state", transfer_id, address_));
  }
  return state;
}

absl::Status AgentClient::WatchNotifications(
    const std::vector<std::string>& ids, uint32_t timeout_ms,
    const std::function<bool(const v1::Notification&)>& on_notification) {
  grpc::ClientContext context;
  SetDeadline(&context, timeout_ms);
  v1::WatchNotificationsRequest request;
  for (const auto& id : ids) request.add_transfer_ids(id);
  auto reader = stub_->WatchNotifications(&context, request);
  v1::Notification n;
  while (reader->Read(&n)) {
    if (!on_notification(n)) {
      context.TryCancel();
      reader->Finish();
      return absl::OkStatus();
    }
  }
  return agent::FromGrpcStatus(reader->Finish());
}

absl::Status AgentClient::WaitReady(uint32_t timeout_ms) {
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  absl::Status last;
  while (std::chrono::steady_clock::now() < until) {
    auto status = Status();
    if (status.ok()) return absl::OkStatus();
    last = status.status();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return absl::UnavailableError(fmt::format("agent at {} did not answer within {} ms: {}",
                                            address_, timeout_ms, last.message()));
}

}  // namespace kvagent::cli
