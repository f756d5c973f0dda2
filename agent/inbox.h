// Inbox: everything that reaches this agent from its peers as UCX active messages, in
// one place. The table of message ids and who handles each, the bound on each header,
// and the first steps every message takes (bound, parse, and for notifications
// authenticate and fetch the body) live here; the components get parsed messages.
// The Agent installs it once the engine and the Stager exist, and silences it first
// thing at shutdown (nothing reaches them after that).
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>

#include "agent/access.h"
#include "agent/am_ids.h"
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
};

class Inbox {
 public:
  // `secrets` authenticate notifications; `counters` count what was dropped. Both
  // outlive the Inbox (the Agent owns them).
  Inbox(transport::UcxWorker* worker, const PeerSecrets* secrets, SecurityCounters* counters,
        InboxLimits limits = {});
  Inbox(const Inbox&) = delete;
  Inbox& operator=(const Inbox&) = delete;

  // Registers every id with the worker (before peers can reach us), each handled by
  // `engine` or `stager` (null: staged messages stay unanswered). Once.
  void Install(TransferEngine* engine, Stager* stager);
  // Shutdown: every handler inert (UcxWorker::SilenceAmHandlers); nothing installed
  // here runs again.
  void Silence();

  // Parsers, shared with tests: false when `header` is over `max_bytes` or does not parse.
  template <typename Message>
  static bool ParseHeader(std::string_view header, uint64_t max_bytes, Message* out) {
    return header.size() <= max_bytes &&
           out->ParseFromArray(header.data(), static_cast<int>(header.size()));
  }

 private:
  // Notification (1): an eager one is handled at once; a rendezvous one is fetched only
  // after its header authenticates and its announced length is in bounds.
  bool OnNotificationMessage(const transport::AmMessage& message);
  void OnNotification(std::string_view header, std::string_view data, void* reply_ep);
  // Bounds, parses and verifies a notification's header for `data_bytes` of body;
  // false (counted and logged) when the message is to be dropped.
  bool AdmitNotification(std::string_view header, uint64_t data_bytes, wire::PeerMessageAuth* auth);
  void DropNotification(std::string_view why, std::string_view from);
  void OnAck(std::string_view header);
  // Registers a staged id whose header is `Header` (parsed here, then `handler`).
  template <typename Header>
  void InstallStaged(AmId id,
                     std::function<bool(const Header&, const transport::AmMessage&)> handler);

  transport::UcxWorker* worker_;
  const PeerSecrets* secrets_;
  SecurityCounters* counters_;
  const InboxLimits limits_;
  TransferEngine* engine_ = nullptr;
  Stager* stager_ = nullptr;
};

}  // namespace kvagent::agent
