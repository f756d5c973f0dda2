#include "agent/inbox.h"

#include <memory>
#include <string>
#include <utility>

#include "agent/staging.h"
#include "agent/transfer_engine.h"
#include "fmt/format.h"
#include "transport/base/format.h"
#include "transport/base/log.h"

namespace kvagent::agent {
namespace {
constexpr log::Logger kLog("inbox");
}  // namespace

Inbox::Inbox(transport::UcxWorker* worker, const PeerSecrets* secrets, SecurityCounters* counters,
             InboxLimits limits)
    : worker_(worker), secrets_(secrets), counters_(counters), limits_(limits) {}

// The table: every id this agent answers, its header, what is checked here and who
// takes it. Senders: notifications from TransferEngine::SendNotice, acknowledgements
// from IncomingTransfers (over DATA_READY's reply endpoint), the staged messages from
// the Stager.
void Inbox::Install(TransferEngine* engine, Stager* stager) {
  engine_ = engine;
  stager_ = stager;
  // 1: PeerMessageAuth (bounded, parsed, its secret verified) + Notification (bounded
  // before a rendezvous body is fetched, parsed, sender and limits checked).
  worker_->SetAmDataHandler(Wire(AmId::kNotification), [this](const transport::AmMessage& m) {
    return OnNotificationMessage(m);
  });
  // 5: TransferAck (bounded, parsed); the engine matches it to a DATA_READY of ours.
  worker_->SetAmHandler(
      Wire(AmId::kTransferAck),
      [this](std::string_view header, std::string_view /*data*/) { OnAck(header); },
      /*max_data_bytes=*/0);
  if (stager_ == nullptr) return;
  // 2-4: headers bounded and parsed here; the Stager verifies the sender's secret (2,
  // 3) or its request id (4), checks every piece against its regions and places data.
  InstallStaged<wire::StagedChunkHeader>(
      AmId::kStagedChunk, [stager](const auto& h, const auto& m) { return stager->OnChunk(h, m); });
  InstallStaged<wire::StagedReadRequest>(AmId::kStagedReadRequest, [stager](const auto& h,
                                                                          const auto& m) {
    return stager->OnReadRequest(h, m);
  });
  InstallStaged<wire::StagedReadReply>(AmId::kStagedReadReply, [stager](const auto& h,
                                                                      const auto& m) {
    return stager->OnReadReply(h, m);
  });
}

void Inbox::Silence() { worker_->SilenceAmHandlers(); }

template <typename Header>
void Inbox::InstallStaged(AmId id,
                          std::function<bool(const Header&, const transport::AmMessage&)> handler) {
  worker_->SetAmDataHandler(Wire(id), [this, id, handler](const transport::AmMessage& m) {
    Header header;
    if (!ParseHeader(m.header, limits_.max_staged_header_bytes, &header)) {
      kLog.Warn("dropped a {} whose {}-byte header does not parse (or is over {} bytes); the "
                "agent that sent it runs an incompatible version",
                AmName(id), m.header.size(), limits_.max_staged_header_bytes);
      stager_->CountUnparsed(id);
      return false;
    }
    return handler(header, m);
  });
}

bool Inbox::OnNotificationMessage(const transport::AmMessage& message) {
  if (!message.rendezvous) {
    OnNotification(message.header, message.data, message.reply_ep);
    return false;
  }
  // The body is still on the sender: nothing is allocated or received for it before
  // the header authenticates and the announced length is within the limit.
  wire::PeerMessageAuth auth;
  if (!AdmitNotification(message.header, message.length, &auth)) return false;
  auto header = std::make_shared<std::string>(message.header);
  auto data = std::make_shared<std::string>(message.length, '\0');
  void* reply_ep = message.reply_ep;
  worker_->ReceiveAmData(message.descriptor, data->data(), data->size(),
                         [this, header, data, reply_ep](absl::Status received) {
                           if (!received.ok()) {
                             kLog.Warn("dropped a notification: {}", received.message());
                             return;
                           }
                           OnNotification(*header, *data, reply_ep);
                         });
  return true;
}

void Inbox::DropNotification(std::string_view why, std::string_view from) {
  counters_->dropped_peer_messages.fetch_add(1);
  LogRefusal(fmt::format("'{}' (UCX active message)", Printable(from)), "a notification",
             absl::PermissionDeniedError(std::string(why)));
}

bool Inbox::AdmitNotification(std::string_view header, uint64_t data_bytes,
                              wire::PeerMessageAuth* auth) {
  // Untrusted until the secret checks: bound, then parse, then verify, then use.
  if (header.size() > limits_.max_auth_header_bytes ||
      data_bytes > limits_.max_notification_message_bytes) {
    DropNotification(fmt::format("oversized: header {} bytes, data {} bytes (limits {} and {})",
                                 header.size(), data_bytes, limits_.max_auth_header_bytes,
                                 limits_.max_notification_message_bytes),
                     "?");
    return false;
  }
  if (!ParseHeader(header, limits_.max_auth_header_bytes, auth)) {
    DropNotification("its header does not parse", "?");
    return false;
  }
  if (secrets_ == nullptr || !secrets_->Verify(auth->from_agent(), auth->secret())) {
    DropNotification("it does not carry the secret this agent issued to the agent it names (not "
                     "a connected, authenticated peer)",
                     auth->from_agent());
    return false;
  }
  return true;
}

void Inbox::OnNotification(std::string_view header, std::string_view data, void* reply_ep) {
  wire::PeerMessageAuth auth;
  if (!AdmitNotification(header, data.size(), &auth)) return;
  v1::Notification n;
  if (!n.ParseFromArray(data.data(), static_cast<int>(data.size()))) {
    DropNotification(fmt::format("its {} bytes do not parse", data.size()), auth.from_agent());
    return;
  }
  if (n.from_agent() != auth.from_agent() ||
      n.payload().size() > limits_.max_notification_payload_bytes ||
      n.targets_size() > static_cast<int>(limits_.max_notification_targets)) {
    DropNotification(
        "it names another sender than its header, or exceeds the payload or target limits",
        auth.from_agent());
    return;
  }
  engine_->OnAuthenticatedNotice(std::move(n), reply_ep);
}

void Inbox::OnAck(std::string_view header) {
  wire::TransferAck ack;
  if (!ParseHeader(header, limits_.max_auth_header_bytes, &ack)) {
    counters_->dropped_peer_messages.fetch_add(1);
    LogRefusal("? (UCX active message)", "a transfer acknowledgement",
               absl::InvalidArgumentError(
                   fmt::format("its {}-byte header does not parse or is too long", header.size())));
    return;
  }
  engine_->OnAck(ack);
}

}  // namespace kvagent::agent
