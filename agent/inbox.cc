#include "agent/inbox.h"

#include <memory>
#include <type_traits>
#include <string>
#include <utility>

#include "agent/staging.h"
#include "agent/transfer_engine.h"
#include "agent/wire_encoding.h"
#include "base/format.h"
#include "base/log.h"
#include "fmt/format.h"

namespace kvagent::agent {
namespace {
constexpr log::Logger kLog("inbox");
}  // namespace

Inbox::Inbox(transport::UcxWorker* worker, const PeerSecrets* secrets, SecurityCounters* counters,
             std::string self_name, InboxLimits limits)
    : worker_(worker),
      secrets_(secrets),
      counters_(counters),
      self_name_(std::move(self_name)),
      limits_(limits) {}

// The table: every id this agent answers, its header, what is checked here and who
// takes it. Senders: notifications from TransferEngine::SendNotice, acknowledgements
// from IncomingTransfers (over DATA_READY's reply endpoint), the staged messages from
// the Stager.
void Inbox::Install(TransferEngine* engine, Stager* stager, EndpointPings* pings) {
  engine_ = engine;
  stager_ = stager;
  if (pings != nullptr) InstallPings(pings);
  // 1: PeerMessageAuth (bounded, parsed, its secret verified) + Notification (bounded
  // before a rendezvous body is fetched, parsed, sender and limits checked).
  worker_->SetAmDataHandler(Wire(AmId::kNotification), [this](const transport::AmMessage& m) {
    return OnNotificationMessage(m, /*batch=*/false);
  });
  // 5: TransferAck (bounded, parsed); the engine matches it to a DATA_READY of ours.
  worker_->SetAmHandler(
      Wire(AmId::kTransferAck),
      [this](std::string_view header, std::string_view /*data*/) { OnAck(header); },
      /*max_data_bytes=*/0);
  // 6: PeerMessageAuth as for 1 (the batch's bytes bounded before a rendezvous body is
  // fetched) + NoticeBatch (entries bounded; each entry checked as 1's body is).
  worker_->SetAmDataHandler(Wire(AmId::kNoticeBatch), [this](const transport::AmMessage& m) {
    return OnNotificationMessage(m, /*batch=*/true);
  });
  // 7: TransferAckBatch as data (bounded by the worker before it is received, parsed,
  // entries bounded); the engine matches each acknowledgement as it does 5.
  worker_->SetAmHandler(
      Wire(AmId::kAckBatch),
      [this](std::string_view /*header*/, std::string_view data) { OnAckBatch(data); },
      limits_.max_batch_bytes);
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

void Inbox::InstallPings(EndpointPings* pings) {
  // 8: EndpointPing (bounded, parsed) with a reply endpoint, answered over it with 9.
  // Data, if any, is never fetched (the handler keeps nothing).
  worker_->SetAmDataHandler(
      Wire(AmId::kPing),
      [this, pings](const transport::AmMessage& m) {
        wire::EndpointPing ping;
        if (!ParseHeader(m.header, limits_.max_auth_header_bytes, &ping)) {
          pings->Drop(fmt::format("a ping whose {}-byte header does not parse (or is over {} "
                                  "bytes)",
                                  m.header.size(), limits_.max_auth_header_bytes));
        } else if (!m.reply_ep) {
          pings->Drop("a ping without a reply endpoint (it cannot be answered)");
        } else {
          pings->Answer(ping, m.reply_ep);
        }
        return false;
      });
  // 9: EndpointPing (bounded, parsed); it ends the ping of its token.
  worker_->SetAmHandler(
      Wire(AmId::kPong),
      [this, pings](std::string_view header, std::string_view /*data*/) {
        wire::EndpointPing pong;
        if (!ParseHeader(header, limits_.max_auth_header_bytes, &pong)) {
          pings->Drop(fmt::format("a pong whose {}-byte header does not parse (or is over {} "
                                  "bytes)",
                                  header.size(), limits_.max_auth_header_bytes));
          return;
        }
        pings->OnPong(pong);
      },
      /*max_data_bytes=*/0);
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

bool Inbox::OnNotificationMessage(const transport::AmMessage& message, bool batch) {
  auto handle = [this, batch](std::string_view header, std::string_view data,
                              const transport::ReplyEndpoint& reply_ep) {
    if (batch) {
      OnNoticeBatch(header, data, reply_ep);
    } else {
      OnNotification(header, data, reply_ep);
    }
  };
  if (!message.rendezvous) {
    handle(message.header, message.data, message.reply_ep);
    return false;
  }
  // The body is still on the sender: nothing is allocated or received for it before
  // the header authenticates and the announced length is within the limit.
  wire::PeerMessageAuth auth;
  const uint64_t max_data =
      batch ? limits_.max_batch_bytes : limits_.max_notification_message_bytes;
  if (!AdmitNotification(message.header, message.length, max_data, &auth)) return false;
  const std::string& from = auth.from_agent();
  if (eager_only_from_ && eager_only_from_(from)) {
    DropNotification(fmt::format("a {} of {} bytes sent by rendezvous over an endpoint without "
                                 "native RMA (tcp), where this agent fetches nothing: an agent "
                                 "sends its notifications eager there",
                                 batch ? "notification batch" : "notification", message.length),
                     from);
    return false;
  }
  // Bounded before anything is allocated: in all and per sender (a sender that lets
  // its fetches hang cannot pile up bodies here).
  uint64_t& mine = rendezvous_by_sender_[from];
  if (rendezvous_bytes_ + message.length > limits_.max_rendezvous_bytes ||
      mine + message.length > limits_.max_rendezvous_bytes_per_sender) {
    const uint64_t held_by_sender = mine;
    if (mine == 0) rendezvous_by_sender_.erase(from);
    DropNotification(fmt::format("a {} of {} bytes by rendezvous while {} bytes of this sender's "
                                 "and {} in all are being fetched (bounds {} and {})",
                                 batch ? "notification batch" : "notification", message.length,
                                 held_by_sender, rendezvous_bytes_,
                                 limits_.max_rendezvous_bytes_per_sender,
                                 limits_.max_rendezvous_bytes),
                     from);
    return false;
  }
  mine += message.length;
  rendezvous_bytes_ += message.length;
  auto header = std::make_shared<std::string>(message.header);
  auto data = std::make_shared<std::string>(message.length, '\0');
  transport::ReplyEndpoint reply_ep = message.reply_ep;
  worker_->ReceiveAmData(
      message.descriptor, data->data(), data->size(),
      [this, from = std::string(from), header, data, reply_ep, handle](absl::Status received) {
        rendezvous_bytes_ -= data->size();
        auto it = rendezvous_by_sender_.find(from);
        if (it != rendezvous_by_sender_.end() && (it->second -= data->size()) == 0) {
          rendezvous_by_sender_.erase(it);
        }
        if (!received.ok()) {
          kLog.Warn("dropped a notification: {}", received.message());
          return;
        }
        handle(*header, *data, reply_ep);
      });
  return true;
}

void Inbox::DropNotification(std::string_view why, std::string_view from) {
  counters_->dropped_peer_messages.fetch_add(1);
  LogRefusal(fmt::format("'{}' (UCX active message)", Printable(from)), "a notification",
             absl::PermissionDeniedError(std::string(why)));
}

bool Inbox::AdmitNotification(std::string_view header, uint64_t data_bytes,
                              uint64_t max_data_bytes, wire::PeerMessageAuth* auth) {
  // Untrusted until the secret checks: bound, then parse, then verify, then use.
  if (header.size() > limits_.max_auth_header_bytes || data_bytes > max_data_bytes) {
    DropNotification(fmt::format("oversized: header {} bytes, data {} bytes (limits {} and {})",
                                 header.size(), data_bytes, limits_.max_auth_header_bytes,
                                 max_data_bytes),
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

absl::Status Inbox::CheckBody(std::string_view data, std::string_view from_agent,
                              const InboxLimits& limits, v1::Notification* n) {
  // A batch entry is bounded as a notification alone (a single one was, before its
  // body was fetched): a batch may carry 1 MiB, one notification no more than this.
  if (data.size() > limits.max_notification_message_bytes) {
    n->Clear();  // nothing of it is used, not even to answer
    return absl::InvalidArgumentError(
        fmt::format("its {} bytes are over the {}-byte bound of one notification", data.size(),
                    limits.max_notification_message_bytes));
  }
  if (!n->ParseFromArray(data.data(), static_cast<int>(data.size()))) {
    n->Clear();  // nothing of it is used, not even to answer
    return absl::InvalidArgumentError(fmt::format("its {} bytes do not parse", data.size()));
  }
  if (n->from_agent() != from_agent) {
    return absl::PermissionDeniedError(fmt::format(
        "it names another sender than its header ('{}')", Printable(n->from_agent())));
  }
  if (n->payload().size() > limits.max_notification_payload_bytes ||
      n->targets_size() > static_cast<int>(limits.max_notification_targets)) {
    return absl::InvalidArgumentError(fmt::format(
        "transfer '{}': its notification has {} payload bytes and {} targets, over this "
        "agent's limits of {} and {}; send a shorter notification (bulk data as an AUX "
        "segment) and fewer targets",
        Printable(n->transfer_id(), 256), n->payload().size(), n->targets_size(),
        limits.max_notification_payload_bytes, limits.max_notification_targets));
  }
  // Every string it carries is bounded as this agent bounds its own: each is kept with
  // the transfer's record and in the notification its owners take.
  auto over = [&](std::string_view field, uint64_t bytes, uint64_t bound) {
    return absl::InvalidArgumentError(fmt::format(
        "transfer '{}': its notification's {} is {} bytes, over this agent's limit of {}",
        Printable(n->transfer_id(), 64), field, bytes, bound));
  };
  if (n->transfer_id().size() > limits.max_notification_id_bytes) {
    return over("transfer_id", n->transfer_id().size(), limits.max_notification_id_bytes);
  }
  if (n->request_id().size() > limits.max_notification_id_bytes) {
    return over("request_id", n->request_id().size(), limits.max_notification_id_bytes);
  }
  for (int i = 0; i < n->targets_size(); ++i) {
    if (n->targets(i).size() > limits.max_notification_target_bytes) {
      return over(fmt::format("target {} of {}", i, n->targets_size()), n->targets(i).size(),
                  limits.max_notification_target_bytes);
    }
  }
  if (n->error_message().size() > limits.max_notification_error_bytes) {
    const std::string marker =
        fmt::format(" [cut by the receiving agent: {} bytes, at most {} kept]",
                    n->error_message().size(), limits.max_notification_error_bytes);
    std::string& text = *n->mutable_error_message();
    size_t keep = limits.max_notification_error_bytes > marker.size()
                      ? limits.max_notification_error_bytes - marker.size()
                      : 0;
    // Not inside a UTF-8 sequence (the field is a proto3 string: it stays valid).
    while (keep > 0 && (static_cast<unsigned char>(text[keep]) & 0xC0) == 0x80) --keep;
    text.resize(keep);
    text.append(marker);
  }
  return absl::OkStatus();
}

template <typename Batch>
absl::Status Inbox::ParseBatch(std::string_view data, const InboxLimits& limits, Batch* out) {
  if (data.size() > limits.max_batch_bytes ||
      !out->ParseFromArray(data.data(), static_cast<int>(data.size()))) {
    return absl::InvalidArgumentError(
        fmt::format("its {} bytes do not parse (or are over {})", data.size(),
                    limits.max_batch_bytes));
  }
  int entries = 0;
  if constexpr (std::is_same_v<Batch, wire::NoticeBatch>) {
    entries = out->notices_size();
  } else {
    entries = out->acks_size();
  }
  if (entries > static_cast<int>(limits.max_batch_entries)) {
    return absl::InvalidArgumentError(fmt::format("it has {} entries, over the limit of {}",
                                                  entries, limits.max_batch_entries));
  }
  return absl::OkStatus();
}
template absl::Status Inbox::ParseBatch(std::string_view, const InboxLimits&, wire::NoticeBatch*);
template absl::Status Inbox::ParseBatch(std::string_view, const InboxLimits&,
                                        wire::TransferAckBatch*);

bool Inbox::AdmitBody(std::string_view data, const wire::PeerMessageAuth& auth, int entry,
                      int entries, const transport::ReplyEndpoint& reply_ep, v1::Notification* n) {
  const absl::Status checked = CheckBody(data, auth.from_agent(), limits_, n);
  if (checked.ok()) return true;
  const std::string why =
      entry < 0 ? std::string(checked.message())
                : fmt::format("entry {} of a batch of {}: {}", entry, entries, checked.message());
  DropNotification(why, auth.from_agent());
  // The sender is authenticated: a DATA_READY of its own that it waits on, refused
  // only for its size, is answered at once, so its transfer fails with the reason
  // instead of at its deadline.
  // Not when its transfer_id is itself over the bound: no sender of ours waits on
  // such an id, and the acknowledgement would carry it back.
  if (checked.code() == absl::StatusCode::kInvalidArgument &&
      n->from_agent() == auth.from_agent() && n->kind() == v1::DATA_READY && n->ack_token() != 0 &&
      reply_ep && n->transfer_id().size() <= limits_.max_notification_id_bytes) {
    wire::TransferAck refusal;
    refusal.set_from_agent(self_name_);
    refusal.set_transfer_id(n->transfer_id());
    refusal.set_sender_incarnation(n->sender_incarnation());
    refusal.set_ack_token(n->ack_token());
    refusal.set_error_code(static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
    refusal.set_error_message(why);
    SendAck(reply_ep, refusal);
  }
  return false;
}

void Inbox::OnNotification(std::string_view header, std::string_view data,
                           const transport::ReplyEndpoint& reply_ep) {
  const auto auth = auths_.Take();
  if (!AdmitNotification(header, data.size(), limits_.max_notification_message_bytes,
                         auth.get())) {
    return;
  }
  const auto n = notices_.Take();
  if (!AdmitBody(data, *auth, /*entry=*/-1, /*entries=*/0, reply_ep, n.get())) return;
  engine_->OnAuthenticatedNotice(*n, reply_ep);
}

void Inbox::OnNoticeBatch(std::string_view header, std::string_view data,
                          const transport::ReplyEndpoint& reply_ep) {
  const auto kept_auth = auths_.Take();
  const wire::PeerMessageAuth& auth = *kept_auth;
  if (!AdmitNotification(header, data.size(), limits_.max_batch_bytes, kept_auth.get())) return;
  // Parsed into a kept batch, whose entries' strings keep their storage from batch to
  // batch (parsing a batch then allocates nothing for them); a batch handled inside
  // another (a send that progressed the worker) takes a second one.
  const auto kept_batch = batches_.Take();
  wire::NoticeBatch& batch = *kept_batch;
  if (absl::Status parsed = ParseBatch(data, limits_, &batch); !parsed.ok()) {
    DropNotification(fmt::format("a notification batch: {}", parsed.message()),
                     auth.from_agent());
    return;
  }
  holding_acks_ = true;
  const auto n = notices_.Take();
  for (int i = 0; i < batch.notices_size(); ++i) {
    if (!AdmitBody(batch.notices(i), auth, i, batch.notices_size(), reply_ep, n.get())) continue;
    engine_->OnAuthenticatedNotice(*n, reply_ep);
  }
  holding_acks_ = false;
  FlushAcks();
}

void Inbox::SendAck(const transport::ReplyEndpoint& reply_ep, const wire::TransferAck& ack) {
  if (!holding_acks_) {
    SendAckBytes(reply_ep, ack.SerializeAsString());
    return;
  }
  if (held_count_ == held_acks_.size()) held_acks_.emplace_back();
  HeldAck& held = held_acks_[held_count_++];
  held.reply_ep = reply_ep;
  ack.SerializeToString(&held.bytes);  // reuses the string's storage
}

void Inbox::SendAckBytes(const transport::ReplyEndpoint& reply_ep, std::string_view ack) {
  worker_->SendAmReply(reply_ep, Wire(AmId::kTransferAck), ack, nullptr, 0,
                       [](absl::Status sent) {
                         if (!sent.ok()) {
                           kLog.Warn("a transfer acknowledgement was not sent: {}", sent.message());
                         }
                       });
}

void Inbox::FlushAcks() {
  // Taken out first: a send may progress the worker into another batch, which holds
  // its own. The storage comes back afterwards unless that happened.
  std::vector<HeldAck> acks;
  acks.swap(held_acks_);
  const size_t count = std::exchange(held_count_, 0);
  // A batch came on one reply endpoint; group by endpoint anyway, in order.
  for (size_t i = 0; i < count;) {
    const transport::ReplyEndpoint reply_ep = acks[i].reply_ep;
    size_t end = i;
    size_t bytes_total = 0;
    for (; end < count && acks[end].reply_ep == reply_ep; ++end) {
      bytes_total += acks[end].bytes.size() + 6;
    }
    if (end - i == 1) {
      SendAckBytes(reply_ep, acks[i].bytes);
      i = end;
      continue;
    }
    // TransferAckBatch's encoding, written directly (each entry is field 1, a
    // length-delimited TransferAck: the bytes SerializeAsString gives for the batch).
    // The reply's data is referenced, not copied: it lives until the send completes.
    auto bytes = std::make_shared<std::string>();
    bytes->reserve(bytes_total);
    const size_t entries = end - i;
    for (; i < end; ++i) {
      AppendLengthDelimited(wire::TransferAckBatch::kAcksFieldNumber, acks[i].bytes, bytes.get());
    }
    worker_->SendAmReply(reply_ep, Wire(AmId::kAckBatch), "", bytes->data(), bytes->size(),
                         [bytes, entries](absl::Status sent) {
                           if (!sent.ok()) {
                             kLog.Warn("a batch of {} transfer acknowledgements was not sent: {}",
                                       entries, sent.message());
                           }
                         },
                         // Never rendezvous: the sender may be a peer without native
                         // RMA (Endpoint::NativeRma), and a batch is bounded anyway.
                         /*eager=*/true);
  }
  if (held_acks_.empty()) held_acks_.swap(acks);
}

void Inbox::OnAck(std::string_view header) {
  const auto ack = acks_.Take();
  if (!ParseHeader(header, limits_.max_auth_header_bytes, ack.get())) {
    counters_->dropped_peer_messages.fetch_add(1);
    LogRefusal("? (UCX active message)", "a transfer acknowledgement",
               absl::InvalidArgumentError(
                   fmt::format("its {}-byte header does not parse or is too long", header.size())));
    return;
  }
  engine_->OnAck(*ack);
}

void Inbox::OnAckBatch(std::string_view data) {
  const auto batch = ack_batches_.Take();
  if (absl::Status parsed = ParseBatch(data, limits_, batch.get()); !parsed.ok()) {
    counters_->dropped_peer_messages.fetch_add(1);
    LogRefusal("? (UCX active message)", "a batch of transfer acknowledgements", parsed);
    return;
  }
  // Matched one by one; the commits they lead to go out together.
  engine_->OnAcks(absl::MakeConstSpan(batch->acks().data(), batch->acks_size()));
}

}  // namespace kvagent::agent
