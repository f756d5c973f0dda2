// Inbox: everything that reaches this agent from its peers as UCX active messages, in
// one place. The table of message ids and who handles each, the bound on each header,
// and the first steps every message takes (bound, parse, and for notifications
// authenticate and fetch the body) live here; the components get parsed messages.
// The Agent installs it once the engine and the Stager exist, and silences it first
// thing at shutdown (nothing reaches them after that).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "agent/access.h"
#include "agent/am_ids.h"
#include "agent/endpoint_pings.h"
#include "agent/kept_messages.h"
#include "agent/peer_secrets.h"
#include "proto/kvagent.pb.h"
#include "proto/wire.pb.h"
#include "transport/ucx_worker.h"

namespace kvagent::agent {

class Stager;
class TransferEngine;

struct InboxLimits {
  uint64_t max_auth_header_bytes = 1024;           // PeerMessageAuth, TransferAck
  uint64_t max_staged_header_bytes = 1 << 20;      // Staged* headers
  // A notification message larger than this (payload, targets and framing) is dropped
  // unparsed, its rendezvous body never fetched.
  uint64_t max_notification_message_bytes = 256 << 10;
  uint64_t max_notification_payload_bytes = 64 << 10;  // as TransferEngineOptions bounds ours
  uint32_t max_notification_targets = 256;              // as the engine bounds ours
  // Its strings, as this agent bounds its own: transfer_id and request_id as
  // SubmitTransfer does (kMaxTransferIdBytes, agent/transfer_engine.cc), each target as
  // a region or group name (registry::CatalogLimits::max_name_bytes, which the
  // registry applies to our names and peers to our catalog). One over is refused.
  uint64_t max_notification_id_bytes = 256;
  uint64_t max_notification_target_bytes = 256;
  // A longer error_message is cut to this many bytes (at a UTF-8 boundary), the cut
  // marked at its end: the text is only shown, and an honest sender's long reason
  // (a list of regions) is still an outcome the owners must hear.
  uint64_t max_notification_error_bytes = 4 << 10;
  // A notification batch (6) or acknowledgement batch (7): entries and bytes.
  uint32_t max_batch_entries = kMaxBatchEntries;
  uint64_t max_batch_bytes = kMaxBatchBytes;
  // Notifications and batches sent by rendezvous whose bodies are being fetched: each
  // one has its body's bytes allocated here until it arrives. In all, and per sender.
  uint64_t max_rendezvous_bytes = 64 << 20;
  uint64_t max_rendezvous_bytes_per_sender = 16 << 20;
};

class Inbox {
 public:
  // `secrets` authenticate notifications; `counters` count what was dropped. Both
  // outlive the Inbox (the Agent owns them).
  // `self_name`: this agent's, in the refusals it answers.
  Inbox(transport::UcxWorker* worker, const PeerSecrets* secrets, SecurityCounters* counters,
        std::string self_name, InboxLimits limits = {});
  Inbox(const Inbox&) = delete;
  Inbox& operator=(const Inbox&) = delete;

  // Registers every id with the worker (before peers can reach us), each handled by
  // `engine`, `stager` (null: staged messages stay unanswered) or `pings` (null: pings
  // stay unanswered). Once.
  void Install(TransferEngine* engine, Stager* stager, EndpointPings* pings = nullptr);
  // True for a sender whose endpoint here lacks native RMA (tcp): its notifications
  // are refused unfetched when they come by rendezvous (an honest sender sends eager
  // there; fetching one over tcp from a sender that dies aborts UCX 1.13). Set before
  // Install; unset, every sender's are fetched.
  void SetEagerOnlyFrom(std::function<bool(std::string_view from)> eager_only_from) {
    eager_only_from_ = std::move(eager_only_from);
  }
  // Rendezvous notification bytes being fetched now (worker thread).
  uint64_t rendezvous_bytes() const { return rendezvous_bytes_; }
  // Shutdown: every handler inert (UcxWorker::SilenceAmHandlers); nothing installed
  // here runs again.
  void Silence();
  // Worker thread: answers a DATA_READY with `ack` over `reply_ep` (IncomingTransfers
  // calls it). While a notification batch is handled, its acknowledgements are held
  // and go back as one acknowledgement batch (7) when it is done; else at once (5).
  void SendAck(const transport::ReplyEndpoint& reply_ep, const wire::TransferAck& ack);

  // The checks each notification body takes (message 1, and each entry of a batch):
  // it is within max_notification_message_bytes (a batch entry as a notification
  // alone), parses, names `from_agent` (the authenticated header's), and its payload,
  // targets (count and each name), transfer_id and request_id are within `limits`.
  // INVALID_ARGUMENT (naming the field, its size and the bound) or PERMISSION_DENIED
  // (another sender) otherwise; `n` holds what parsed (cleared when nothing did). An
  // error_message over max_notification_error_bytes is cut there, marked, not refused.
  // Pure: fuzz/inbox_fuzzer.
  static absl::Status CheckBody(std::string_view data, std::string_view from_agent,
                                const InboxLimits& limits, v1::Notification* n);
  // A batch's own checks (6's data as NoticeBatch, 7's as TransferAckBatch): within
  // max_batch_bytes, parses, at most max_batch_entries. Pure.
  template <typename Batch>
  static absl::Status ParseBatch(std::string_view data, const InboxLimits& limits, Batch* out);

  // Parsers, shared with tests: false when `header` is over `max_bytes` or does not parse.
  template <typename Message>
  static bool ParseHeader(std::string_view header, uint64_t max_bytes, Message* out) {
    return header.size() <= max_bytes &&
           out->ParseFromArray(header.data(), static_cast<int>(header.size()));
  }

 private:
  // Notification (1): an eager one is handled at once; a rendezvous one is fetched only
  // after its header authenticates and its announced length is in bounds.
  // The same for a notification batch (`batch`: id 6).
  bool OnNotificationMessage(const transport::AmMessage& message, bool batch);
  void OnNotification(std::string_view header, std::string_view data,
                      const transport::ReplyEndpoint& reply_ep);
  // A batch: one header for all, then each entry bounded, parsed, checked and handed
  // on alone (a bad one is dropped and counted, naming its index); the acknowledgements
  // its DATA_READYs get meanwhile go back as one message.
  void OnNoticeBatch(std::string_view header, std::string_view data,
                     const transport::ReplyEndpoint& reply_ep);
  // Parses one notification body and checks it against the header's sender and the
  // limits; false (dropped, counted, logged naming `entry` of `entries` when it came in
  // a batch, entry >= 0) when it fails. A DATA_READY of the authenticated sender over
  // the limits is refused over `reply_ep` (its transfer fails with the reason).
  bool AdmitBody(std::string_view data, const wire::PeerMessageAuth& auth, int entry, int entries,
                 const transport::ReplyEndpoint& reply_ep, v1::Notification* n);
  // Bounds, parses and verifies a notification's header for `data_bytes` of body
  // (at most `max_data_bytes`); false (counted and logged) when the message is dropped.
  bool AdmitNotification(std::string_view header, uint64_t data_bytes, uint64_t max_data_bytes,
                         wire::PeerMessageAuth* auth);
  void DropNotification(std::string_view why, std::string_view from);
  void OnAck(std::string_view header);
  void OnAckBatch(std::string_view data);
  // Sends the acknowledgements held while a batch was handled (one message per reply
  // endpoint, or a single acknowledgement when there is one).
  void FlushAcks();
  // Sends one serialized TransferAck (5) over `reply_ep`.
  void SendAckBytes(const transport::ReplyEndpoint& reply_ep, std::string_view ack);
  // Registers 8 and 9, handled by `pings`.
  void InstallPings(EndpointPings* pings);
  // Registers a staged id whose header is `Header` (parsed here, then `handler`).
  template <typename Header>
  void InstallStaged(AmId id,
                     std::function<bool(const Header&, const transport::AmMessage&)> handler);

  transport::UcxWorker* worker_;
  const PeerSecrets* secrets_;
  SecurityCounters* counters_;
  const std::string self_name_;
  const InboxLimits limits_;
  TransferEngine* engine_ = nullptr;
  Stager* stager_ = nullptr;
  std::function<bool(std::string_view)> eager_only_from_;
  // Worker thread only: rendezvous bodies being fetched, in all and by sender.
  uint64_t rendezvous_bytes_ = 0;
  absl::flat_hash_map<std::string, uint64_t> rendezvous_by_sender_;
  // Worker thread only: acknowledgements held while a notification batch is handled,
  // serialized as they come: the first held_count_ entries of held_acks_, whose strings
  // keep their storage from batch to batch (a held acknowledgement allocates nothing
  // once the batches have reached their size).
  struct HeldAck {
    transport::ReplyEndpoint reply_ep;
    std::string bytes;  // a serialized TransferAck
  };
  bool holding_acks_ = false;
  std::vector<HeldAck> held_acks_;
  // Worker thread only: the notification batches (OnNoticeBatch), the headers,
  // notifications and acknowledgements parsed here. A batch's storage is kept up to
  // 64 KiB (a rendezvous batch may hold up to max_batch_bytes).
  KeptMessages<wire::NoticeBatch, (64 << 10)> batches_;
  KeptMessages<wire::PeerMessageAuth> auths_;
  KeptMessages<v1::Notification> notices_;
  KeptMessages<wire::TransferAck> acks_;
  KeptMessages<wire::TransferAckBatch> ack_batches_;
  size_t held_count_ = 0;
};

}  // namespace kvagent::agent
