// IncomingTransfers is the receiving side of the transfer contract: every transfer a
// peer runs into (WRITE) or out of (READ) this agent's regions, from the peer's OPEN to
// its one outcome. It acknowledges DATA_READY once the data is in place, holds the
// client notification until the sender commits (so the sender's state is final
// first), turns the sender's outcome notices, or a deadline that passes without one,
// into exactly one notification for the owners of the regions involved, and lists
// incoming transfers. Used by the transfer engine (notices, on the worker thread)
// and the gRPC service (queries).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/node_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "agent/access.h"
#include "agent/ended_log.h"
#include "agent/kept_messages.h"
#include "agent/notification_queue.h"
#include "proto/kvagent.pb.h"
#include "proto/wire.pb.h"
#include "registry/region_registry.h"
#include "transport/reply_endpoint.h"

namespace kvagent::agent {

struct IncomingOptions {
  std::string self_name;
  // Past the sender's deadline (as its OPEN gave it) before an incoming transfer
  // without an outcome ends TIMED_OUT here.
  uint32_t grace_ms = 2000;
  uint32_t max_finished = 10000;  // ended incoming transfers kept for queries
  uint32_t max_active = 65536;    // open incoming transfers tracked at once
  // Of them, from one sending agent (all its incarnations): a quarter, so that one
  // peer cannot take every slot. Past it (or max_active) a transfer is not tracked:
  // its DATA_READY is delivered once its data is in place, without waiting for the
  // commit, and it is not listed.
  uint32_t max_active_per_sender = 16384;
  // A peer's PEER_TRANSFER_OPEN timeout_ms is taken up to this (10 minutes), counted
  // from the transfer's first notice here: a record waits no longer than this plus
  // grace for its sender's outcome, however often it is opened.
  uint32_t max_peer_timeout_ms = 600000;
  // A transfer whose first notice here is not an open (a DATA_READY) has no deadline
  // from its sender: it gets this one from when it was first heard of (plus grace),
  // twice the sender's default (--transfer-timeout-ms, 30 s) and the Stager's hold.
  uint32_t unopened_timeout_ms = 60000;
  // Called once with each tracked record's final state (its outcome, bytes and
  // timeline), under this object's lock: the metrics count it. Null: nothing.
  std::function<void(const v1::TransferState&)> on_ended;
};

class IncomingTransfers {
 public:
  // Sends `ack` over `reply_ep` (worker thread).
  using SendAck =
      std::function<void(const transport::ReplyEndpoint& reply_ep, const wire::TransferAck& ack)>;

  IncomingTransfers(IncomingOptions options, const registry::RegionRegistry* registry,
                    NotificationQueue* queue, SendAck send_ack);

  // Worker thread, for notices that passed authentication. A DATA_READY records its
  // reply endpoint; it is acknowledged by DataInPlace (at once, or once its staged
  // bytes arrived).
  void OnNotice(const v1::Notification& notice, const transport::ReplyEndpoint& reply_ep);
  // Worker thread: the data of DATA_READY `notice` is in place (`status` OK), or never
  // will be (the status says why: the sender's transfer fails with it). Acknowledges.
  void DataInPlace(const v1::Notification& notice, const absl::Status& status);
  // Worker thread: OnNotice then DataInPlace for a DATA_READY with nothing staged,
  // under one lock, the record keeping `notice`'s contents (swapped out of it, not
  // copied: `notice` is left holding other strings' storage, for the next parse). One
  // with `committed` (kWireCommitInDataReady) is then delivered, once acknowledged, as
  // its PEER_DATA_COMMIT would deliver it.
  void OnDataReady(v1::Notification&& notice, const transport::ReplyEndpoint& reply_ep,
                   const absl::Status& status);
  // Ends incoming transfers whose deadline plus grace passed without an outcome
  // (TRANSFER_TIMED_OUT to their owners). Any thread; call it by NextExpiry.
  void Expire();
  // When Expire next has something to end (monotonic us; UINT64_MAX: nothing can
  // expire). May be early (a record ended since): Expire then finds nothing and
  // recomputes it. Any thread.
  uint64_t NextExpiry() const;

  // An incoming transfer by id (and sending agent, when not empty) that `caller` may
  // see (it owns regions it targets, or is a scheduler); NOT_FOUND otherwise. It looks
  // up the record's key once per (sender, incarnation) that has records here (a few),
  // not every kept record, so a scheduler polling it does not hold up the receiving
  // path.
  absl::StatusOr<v1::TransferState> Get(const std::string& peer, const std::string& id,
                                        const Caller& caller) const;
  std::vector<v1::TransferState> List(bool active_only, const Caller& caller) const;
  uint64_t active() const;
  // Transfers not tracked because max_active or their sender's share was reached.
  uint64_t untracked() const;
  // The (sender, incarnation) pairs with tracked records here: Get looks up an id once
  // per pair.
  size_t sources() const;

 private:
  // Tracked records per (sender, incarnation), by their key prefix (sources_).
  using Sources = absl::node_hash_map<std::string, uint64_t>;
  struct Record {
    v1::TransferState state;
    std::vector<std::string> owners;  // principals owning its targets
    uint64_t start_us = 0;            // monotonic, when first heard of
    // Monotonic: its sender's deadline (PEER_TRANSFER_OPEN's, capped), or
    // unopened_timeout_ms from start_us, plus grace. 0 only for untracked records
    // (they end when acknowledged; the Stager bounds the wait of a staged one).
    uint64_t expires_us = 0;
    uint32_t deadline_ms = 0;         // what expires_us was set from (without grace)
    bool opened = false;              // by a PEER_TRANSFER_OPEN
    bool capped = false;              // its open asked for more than max_peer_timeout_ms
    transport::ReplyEndpoint reply_ep;  // of DATA_READY, until acknowledged
    uint64_t ack_token = 0;
    std::unique_ptr<v1::Notification> held;  // DATA_READY, until the commit
    // Room reserved in the notification queue when DATA_READY was acknowledged: its
    // one outcome is always kept.
    uint64_t reserved_bytes = 0;
    bool ended = false;                      // its one outcome was delivered
    // Its (sender, incarnation) in sources_, which counts it; null: untracked.
    Sources::value_type* source = nullptr;
    // Its sender's count of open records (senders_) while it is open; null otherwise.
    uint32_t* sender_open = nullptr;
  };
  using Key = std::string;  // sender, incarnation, transfer id
  // Node-based: a record never moves, and a pruned record's node (key and record)
  // goes to spare_ and back into the map without its key being copied (a flat map
  // copies a string key when it moves a slot holding a record).
  using Records = absl::node_hash_map<Key, Record>;
  static void KeyInto(const v1::Notification& n, Key* key);
  static Key KeyOf(const v1::Notification& n);
  // `n`'s key in lookup_key_ (reused: a lookup allocates nothing); valid until the next.
  const Key& LookupKey(const v1::Notification& n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Calls `visit` with each local region a notification target names: a group's (under
  // the registry's lock, without copying the group), else the one region.
  void ForEachRegionOf(const std::string& target,
                       absl::FunctionRef<void(const registry::Region&)> visit) const;
  // DATA_LOSS naming the region when a region `n` targets was broken by a caught
  // fault (registry/fault_guard.h); `op` (the transfer's, from its open) says whether
  // the bytes were written there or read from there.
  absl::Status CheckTargetsIntact(const v1::Notification& n, v1::TransferOp op) const;

  // The record of `n` (made when missing and there is room; null otherwise).
  Record* FindOrMake(const v1::Notification& n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The principals owning the regions `n` targets, into `owners` (replacing what it
  // held; its strings' storage is kept).
  void OwnersOf(const v1::Notification& n, std::vector<std::string>* owners) const;
  // A new record under `key` (not in records_): a pruned one's node when one is spare,
  // reset to a new record's values but keeping its storage, else a new one.
  Record& AddRecordLocked(const Key& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Delivers `kind` to the record's owners, once, and ends the record.
  // `from`'s names, payload and targets are swapped into the notification delivered
  // (`from` may be the record's held DATA_READY, which goes back to spare_held_ after).
  void EndLocked(const Key& key, Record& r, v1::TransferPhase phase, v1::NotificationKind kind,
                 v1::Notification* from, const absl::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PruneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts tracked record `r` (its transfer id set), whose key is `key`, under its
  // (sender, incarnation); Uncount takes it off when it is pruned.
  void CountLocked(Record& r, const Key& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UncountLocked(Record& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes one off the count of the (sender, incarnation) whose key prefix is `prefix`
  // (an entry of ended_ went).
  void UncountPrefixLocked(absl::string_view prefix) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ended_'s extra bytes for record `r`: the length of its key's (sender, incarnation)
  // prefix (4 bytes), then its owners, each ended by a NUL.
  void EndedExtraInto(const Record& r, std::string* extra) const;
  static size_t EndedPrefixBytes(absl::string_view extra);
  // Whether `caller` may see an ended_ entry whose extra bytes are `extra`.
  static bool VisibleEnded(absl::string_view extra, const Caller& caller);
  // What a PEER_TRANSFER_OPEN does to the record of its transfer (also done by a
  // DATA_READY carrying timeout_ms, kWireOpenInDataReady): the op, and the sender's
  // deadline within max_peer_timeout_ms.
  void OpenLocked(Record& r, const v1::Notification& n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What PEER_DATA_COMMIT does (also a committed DATA_READY once acknowledged,
  // kWireCommitInDataReady): the held DATA_READY goes to the owners and the record ends
  // COMPLETED, unless it ended already or holds none.
  void CommitLocked(Records::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Clears what a DATA_READY carries between agents only (an open's timeout_ms and op,
  // committed) before it is held for delivery to clients.
  static void ClearBetweenAgents(v1::Notification& n);
  // A DATA_READY's record (made when missing; untracked when there is no room) holds
  // `n` and its reply endpoint, unless the record ended already.
  void HoldLocked(v1::Notification&& n, const transport::ReplyEndpoint& reply_ep)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // DataInPlace for the record at `it`, which holds a reply endpoint (`n` is its
  // DATA_READY): fills `ack` and returns the endpoint to send it on.
  transport::ReplyEndpoint AcknowledgeLocked(Records::iterator it, const v1::Notification& n,
                                             const absl::Status& status, wire::TransferAck* ack)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Visible(const Record& r, const Caller& caller) const;

  const IncomingOptions options_;
  const registry::RegionRegistry* registry_;
  NotificationQueue* queue_;
  SendAck send_ack_;
  mutable absl::Mutex mu_;
  Records records_ ABSL_GUARDED_BY(mu_);
  // How many tracked records (direction INCOMING: the ones Get may answer) each
  // sender's incarnation has, by the key prefix "sender\nincarnation\n": Get looks up
  // prefix + id for each, so it reads a few records, not every kept one. Node-based:
  // a record points at its entry. An entry goes with its last record, so there are at
  // most as many as tracked records, and usually a handful. Per transfer: one compare
  // with the last entry used (a steady stream comes from few senders), no allocation.
  Sources sources_ ABSL_GUARDED_BY(mu_);
  Sources::value_type* last_source_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t active_ ABSL_GUARDED_BY(mu_) = 0;
  // Open tracked records per sending agent (max_active_per_sender). Node-based: a
  // record points at its count. An entry at zero stays (a sender's next transfer then
  // allocates nothing) until there are more than kSenderEntries, when they go.
  static constexpr size_t kSenderEntries = 1024;
  absl::node_hash_map<std::string, uint32_t> senders_ ABSL_GUARDED_BY(mu_);
  // Transfers not tracked for want of room (max_active or the sender's share): the
  // first and every 1,024th after are logged.
  uint64_t untracked_ ABSL_GUARDED_BY(mu_) = 0;
  // The earliest expires_us of an open record, or earlier (NextExpiry).
  uint64_t next_expiry_us_ ABSL_GUARDED_BY(mu_) = UINT64_MAX;
  // The ended records kept whole in records_, by key, oldest first: a ring
  // (ended_keys_[ended_head_] is the oldest of ended_count_) whose strings are reused
  // as the newest replace the oldest, so ending one allocates no key once live_ended_
  // have ended. Past live_ended_ (64, or max_finished when that is fewer), the oldest
  // goes into ended_ and its node is reused while it is still in cache.
  std::vector<Key> ended_keys_ ABSL_GUARDED_BY(mu_);
  size_t ended_head_ ABSL_GUARDED_BY(mu_) = 0;
  size_t ended_count_ ABSL_GUARDED_BY(mu_) = 0;
  const size_t live_ended_;
  // The older ended records, up to max_finished - live_ended_, compact (a serialized
  // state, the owners and the key's prefix length): Get and List look here too, and a
  // late notice of a transfer found here is one of an ended transfer, as a whole
  // record's would be. Its entries stay counted in sources_ until they go.
  EndedLog ended_ ABSL_GUARDED_BY(mu_);
  std::string ended_extra_ ABSL_GUARDED_BY(mu_);  // storage for PruneLocked's
  // What FindOrMake returns for a transfer that ended here and is kept in ended_: ended,
  // so every caller leaves it alone.
  Record ended_here_ ABSL_GUARDED_BY(mu_);
  // Pruned records' nodes, for AddRecordLocked: a record's key, state (strings, timeline
  // entries) and owners keep their storage, so a steady stream of transfers neither
  // frees the oldest record nor allocates the new one. At most kSpareRecords.
  static constexpr size_t kSpareRecords = 8;
  std::vector<Records::node_type> spare_ ABSL_GUARDED_BY(mu_);
  // Held DATA_READYs of ended records, for the next ones to be swapped into (a few, of
  // bounded size: KeptMessages' policy; used under mu_ only, so by one thread at a time).
  KeptMessages<v1::Notification> spare_held_ ABSL_GUARDED_BY(mu_);
  Key lookup_key_ ABSL_GUARDED_BY(mu_);
  // EndLocked's notification, reused (NotificationQueue::PushOrKeep).
  QueuedNotification end_out_ ABSL_GUARDED_BY(mu_);
  // OnDataReady's and DataInPlace's acknowledgement (worker thread only), reused: its
  // strings keep their storage. Filled under mu_, sent after it.
  wire::TransferAck ack_;
};

}  // namespace kvagent::agent
