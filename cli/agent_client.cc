#include "cli/agent_client.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/strings/match.h"
#include "agent/status_util.h"
#include "base/format.h"
#include "base/status_macros.h"
#include "fmt/format.h"
#include "grpcpp/grpcpp.h"
#include "registry/memory_object.h"

namespace kvagent::cli {
namespace {

void SetDeadline(grpc::ClientContext* context, uint32_t ms) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms));
}

constexpr char kSessionTokenKey[] = "kvagent-session";

}  // namespace

AgentClient::AgentClient(const std::string& address, uint32_t timeout_ms)
    : AgentClient(address, [timeout_ms] {
        AgentClientOptions options;
        options.timeout_ms = timeout_ms;
        return options;
      }()) {}

AgentClient::AgentClient(const std::string& address, AgentClientOptions options)
    : address_(address), options_(std::move(options)), timeout_ms_(options_.timeout_ms) {
  grpc::ChannelArguments args;
  // Our own connections: gRPC's process-wide subchannel pool would hand a new channel
  // the broken connection of an old one to the same address (an agent restarted on
  // the same socket path), and its first call would fail.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(64 << 20);
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (absl::StartsWith(address, "unix:")) {
    session_path_ = address.substr(5) + ".session";
  } else if (!options_.tls.empty()) {
    auto tls = agent::MakeChannelCredentials(options_.tls);
    if (tls.ok()) {
      credentials = *std::move(tls);
    } else {
      channel_error_ = tls.status();
    }
  }
  channel_ = grpc::CreateCustomChannel(address, credentials, args);
  stub_ = v1::Agent::NewStub(channel_);
}

absl::StatusOr<client::LocalSession*> AgentClient::Session() {
  if (session_path_.empty()) {
    return absl::FailedPreconditionError(fmt::format(
        "{} is a network address: memory is shared only through the local door; connect to "
        "the agent's unix:PATH on its host",
        address_));
  }
  absl::MutexLock lock(&mu_);
  if (session_ == nullptr) {
    auto attached = client::LocalSession::Attach(session_path_, options_.client_name, timeout_ms_);
    if (!attached.ok()) return attached.status();
    session_ = *std::move(attached);
  }
  return session_.get();
}

absl::Status AgentClient::Prepare(grpc::ClientContext* context, uint32_t timeout_ms) {
  SetDeadline(context, timeout_ms);
  if (!channel_error_.ok()) return channel_error_;
  if (session_path_.empty()) return absl::OkStatus();
  auto session = Session();
  if (!session.ok()) return session.status();
  context->AddMetadata(kSessionTokenKey, (*session)->token());
  return absl::OkStatus();
}

template <typename Request, typename Response, typename Method>
absl::StatusOr<Response> AgentClient::Unary(Method method, const Request& request,
                                            uint32_t timeout_ms) {
  grpc::ClientContext context;
  if (absl::Status prepared = Prepare(&context, timeout_ms); !prepared.ok()) return prepared;
  Response response;
  grpc::Status status = (stub_.get()->*method)(&context, request, &response);
  if (!status.ok()) return agent::FromGrpcStatus(status);
  return response;
}

absl::StatusOr<SharedMemory> AgentClient::AllocateMemory(const std::string& label,
                                                         uint64_t bytes) {
  ASSIGN_OR_RETURN(client::LocalSession * session, Session());
  ASSIGN_OR_RETURN(auto allocated, session->AllocateMemory(label, bytes));
  ASSIGN_OR_RETURN(auto object,
                   registry::MemoryObject::FromDescriptor(std::move(allocated.second), label));
  SharedMemory memory;
  memory.info = allocated.first;
  ASSIGN_OR_RETURN(memory.mapping, registry::ShmMapping::Map(std::move(object), 0, bytes, label));
  return memory;
}

absl::StatusOr<v1::MemoryHandleInfo> AgentClient::ShareMemory(int fd, const std::string& label) {
  ASSIGN_OR_RETURN(client::LocalSession * session, Session());
  return session->ShareMemory(fd, label);
}

absl::StatusOr<v1::AgentStatus> AgentClient::Status() {
  return Unary<v1::GetStatusRequest, v1::AgentStatus>(&v1::Agent::Stub::GetStatus,
                                                      v1::GetStatusRequest(), timeout_ms_);
}

absl::StatusOr<v1::RegisterRegionsResponse> AgentClient::Register(
    const v1::RegisterRegionsRequest& request) {
  return Unary<v1::RegisterRegionsRequest, v1::RegisterRegionsResponse>(
      &v1::Agent::Stub::RegisterRegions, request, timeout_ms_);
}

absl::StatusOr<v1::DeregisterRegionsResponse> AgentClient::Deregister(
    const std::vector<std::string>& names) {
  v1::DeregisterRegionsRequest request;
  for (const auto& n : names) request.add_names(n);
  return Unary<v1::DeregisterRegionsRequest, v1::DeregisterRegionsResponse>(
      &v1::Agent::Stub::DeregisterRegions, request, timeout_ms_);
}

absl::StatusOr<v1::ListRegionsResponse> AgentClient::Regions() {
  return Unary<v1::ListRegionsRequest, v1::ListRegionsResponse>(
      &v1::Agent::Stub::ListRegions, v1::ListRegionsRequest(), timeout_ms_);
}

absl::StatusOr<v1::PeerInfo> AgentClient::Connect(const std::string& peer_address) {
  v1::ConnectPeerRequest request;
  request.set_address(peer_address);
  return Unary<v1::ConnectPeerRequest, v1::PeerInfo>(&v1::Agent::Stub::ConnectPeer,
                                                     request, timeout_ms_);
}

absl::StatusOr<v1::ListAgentsResponse> AgentClient::Agents() {
  return Unary<v1::ListAgentsRequest, v1::ListAgentsResponse>(
      &v1::Agent::Stub::ListAgents, v1::ListAgentsRequest(), timeout_ms_);
}

absl::StatusOr<v1::ListPeersResponse> AgentClient::Peers() {
  return Unary<v1::ListPeersRequest, v1::ListPeersResponse>(
      &v1::Agent::Stub::ListPeers, v1::ListPeersRequest(), timeout_ms_);
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
      &v1::Agent::Stub::SubmitTransfer, request,
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
      &v1::Agent::Stub::SubmitTransfers, request,
      WaitingTimeout(timeout_ms_, wait, longest));
}

absl::StatusOr<v1::TransferState> AgentClient::Get(const std::string& transfer_id,
                                                   const std::string& peer) {
  v1::GetTransferRequest request;
  request.set_transfer_id(transfer_id);
  request.set_peer(peer);
  return Unary<v1::GetTransferRequest, v1::TransferState>(
      &v1::Agent::Stub::GetTransfer, request, timeout_ms_);
}

absl::StatusOr<v1::TransferState> AgentClient::Cancel(const std::string& transfer_id) {
  v1::CancelTransferRequest request;
  request.set_transfer_id(transfer_id);
  return Unary<v1::CancelTransferRequest, v1::TransferState>(
      &v1::Agent::Stub::CancelTransfer, request, timeout_ms_);
}

absl::StatusOr<v1::ListTransfersResponse> AgentClient::Transfers(bool active_only,
                                                                  bool incoming) {
  v1::ListTransfersRequest request;
  request.set_active_only(active_only);
  request.set_incoming(incoming);
  v1::ListTransfersResponse all;
  while (true) {
    auto page = Unary<v1::ListTransfersRequest, v1::ListTransfersResponse>(
        &v1::Agent::Stub::ListTransfers, request, timeout_ms_);
    if (!page.ok()) return page.status();
    for (auto& t : *page->mutable_transfers()) *all.add_transfers() = std::move(t);
    if (page->next_page_token().empty()) return all;
    request.set_page_token(page->next_page_token());
  }
}

absl::StatusOr<v1::DisconnectPeerResponse> AgentClient::Disconnect(const std::string& peer_name) {
  v1::DisconnectPeerRequest request;
  request.set_name(peer_name);
  return Unary<v1::DisconnectPeerRequest, v1::DisconnectPeerResponse>(
      &v1::Agent::Stub::DisconnectPeer, request, timeout_ms_);
}

absl::StatusOr<v1::PollNotificationsResponse> AgentClient::Poll(
    uint32_t max, const std::vector<std::string>& ids, const std::string& subscription) {
  v1::PollNotificationsRequest request;
  request.set_max(max);
  for (const auto& id : ids) request.add_transfer_ids(id);
  request.set_subscription(subscription);
  return Unary<v1::PollNotificationsRequest, v1::PollNotificationsResponse>(
      &v1::Agent::Stub::PollNotifications, request, timeout_ms_);
}

absl::StatusOr<uint64_t> AgentClient::Ack(const std::string& subscription, uint64_t through,
                                          const std::vector<uint64_t>& sequences) {
  v1::AckNotificationsRequest request;
  request.set_subscription(subscription);
  request.set_through_sequence(through);
  for (uint64_t s : sequences) request.add_sequences(s);
  auto response = Unary<v1::AckNotificationsRequest, v1::AckNotificationsResponse>(
      &v1::Agent::Stub::AckNotifications, request, timeout_ms_);
  if (!response.ok()) return response.status();
  return response->released();
}

absl::StatusOr<v1::TransferState> AgentClient::WaitTransfer(const std::string& transfer_id,
                                                            uint32_t timeout_ms) {
  grpc::ClientContext context;
  if (absl::Status prepared = Prepare(&context, timeout_ms); !prepared.ok()) return prepared;
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
    const std::function<bool(const v1::Notification&)>& on_notification,
    const std::string& subscription) {
  grpc::ClientContext context;
  if (absl::Status prepared = Prepare(&context, timeout_ms); !prepared.ok()) return prepared;
  v1::WatchNotificationsRequest request;
  for (const auto& id : ids) request.add_transfer_ids(id);
  request.set_subscription(subscription);
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

absl::StatusOr<v1::DoctorReport> AgentClient::Doctor() {
  return Unary<v1::DoctorRequest, v1::DoctorReport>(&v1::Agent::Stub::Doctor, v1::DoctorRequest(),
                                                   timeout_ms_);
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
