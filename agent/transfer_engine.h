// TransferEngine runs transfers: it validates and plans each chunk on the caller's
// thread, then posts the planned operations on the UCX worker thread in bounded
// batches (put/get, one flush per batch), and after the final chunk's data is in
// place sends the notification as an active message. It also receives peers'
// notifications into the NotificationQueue. Used by the gRPC service.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "agent/access.h"
#include "agent/am_ids.h"
#include "agent/copy_lanes.h"
#include "agent/data_path.h"
#include "agent/ended_log.h"
#include "agent/finished_order.h"
#include "agent/incoming.h"
#include "agent/kept_messages.h"
#include "agent/limits.h"
#include "agent/notification_queue.h"
#include "agent/peer_manager.h"
#include "agent/peer_secrets.h"
#include "agent/staging.h"
#include "agent/transfer_metrics.h"
#include "planning/transfer_plan.h"
#include "proto/kvagent.pb.h"
#include "proto/wire.pb.h"
#include "planning/destination_ledger.h"
#include "registry/region_registry.h"
#include "transport/ucx_worker.h"

namespace kvagent::agent {

struct TransferEngineOptions {
  std::string self_name;
  uint32_t default_timeout_ms = 30000;
  uint64_t batch_bytes = 64ull << 20;  // bytes posted before each flush
  uint32_t batch_ops = 8192;           // operations posted before each flush
  uint64_t max_notification_bytes = 64 << 10;
  uint32_t max_finished = 10000;       // finished transfers kept for queries
  bool ucx_cuda = false;               // the running UCX can move CUDA memory itself
  uint64_t incarnation = 0;            // this agent's, sent with staged notifications
  // Moves ops that need host staging (VRAM UCX cannot reach); owned by the Agent,
  // outlives the engine. Null: such transfers are refused at submit.
  Stager* stager = nullptr;
  // Secrets this agent issued to peers (checked on every notification received) and
  // the counters of what was dropped. Owned by the Agent; required.
  const PeerSecrets* secrets = nullptr;
  SecurityCounters* counters = nullptr;
  // The receiving side (notices from peers); owned by the Agent, required.
  IncomingTransfers* incoming = nullptr;
  // A transfer that ended with operations still posted is given this long to drain;
  // then it says drain_unknown (the operations went to a peer that stopped answering).
  uint32_t drain_timeout_ms = 5000;
  // Threads that copy one batch of same-host host memory side by side (--copy-lanes;
  // agent/copy_lanes.h).
  uint32_t copy_lanes = 1;
  // Active transfers (total, per owner), operations per chunk and planned in all.
  // Owned by the Agent; null: unbounded (tests).
  const Limits* limits = nullptr;
  // Counts each transfer once, when it ends (Finish; its data path as the peer's was at
  // chunk 0). A retry of an accepted chunk, or a later one, finds the transfer's record
  // and is not a new transfer. Owned by the Agent; null: not counted (tests).
  TransferMetrics* metrics = nullptr;
};

struct TransferCounters {
  uint64_t active = 0;
  uint64_t planned_ops = 0;  // operations planned and not yet posted or dropped
  uint64_t largest_owner_active = 0;  // the most active transfers one owner has
  uint64_t completed = 0;
  // Of those, completed when placed (complete_when), and of these the ones whose peer
  // then did not take the notification.
  uint64_t completed_when_placed = 0;
  uint64_t placed_not_taken = 0;
  uint64_t failed = 0;  // failed, cancelled or timed out
  uint64_t notifications_received = 0;
  CopyLaneCounters copy_lanes;  // the host copy path's
  uint32_t lanes = 1;
};

class TransferEngine {
 public:
  using Watcher = std::function<void(const v1::TransferState&)>;

  TransferEngine(transport::UcxWorker* worker, registry::RegionRegistry* registry,
                 PeerManager* peers, NotificationQueue* notifications,
                 TransferEngineOptions options);
  ~TransferEngine();

  // Starts the deadline thread (peers' messages reach the engine through agent/inbox).
  void Start();
  // Fails what is still running with `reason` and waits up to `grace` for posted
  // operations to drain.
  void Stop(absl::Duration grace);
  // Shutdown, after Stop: every transfer lets go of the peer views it holds (their
  // endpoints and keys must die on the worker thread, so before the worker does; the
  // engine itself outlives the worker, whose last closures and completions call it).
  void ReleasePeers();

  // `caller` must own every local region the request names, unless it is a
  // scheduler (PERMISSION_DENIED naming the region and its owner otherwise); the
  // transfer is then owned by the caller. The accepted state is copied into `*accepted`
  // only when it is not null: a caller that answers with the final state later
  // (SubmitTransfer with wait, the fast path's last chunk) passes null and pays for no
  // copy of the state's strings and timeline (issue 15).
  // `when_terminal`, when not null and the chunk is accepted, is taken as WhenTerminal
  // would take it, under the same lock as the acceptance (no second lookup, and no
  // window in which pruning could lose the transfer); on a refusal it is left as it was.
  // `unknown_remote`, when not null: set when the chunk is refused because it names a
  // remote group or region that the peer's current catalog lacks (checked only once its
  // plan failed: an accepted chunk pays nothing for it). The caller then refreshes the
  // peer once and submits again, so a region the peer registered a moment ago is found;
  // the refusal it got is not the answer, and was not counted.
  absl::Status Submit(const v1::SubmitTransferRequest& request, const Caller& caller,
                      v1::TransferState* accepted, Watcher* when_terminal = nullptr,
                      bool* unknown_remote = nullptr);
  // Get, Cancel, List and Watch see only the caller's own transfers (a scheduler's:
  // all); another's transfer reads as NOT_FOUND, as one that does not exist.
  absl::StatusOr<v1::TransferState> Get(const std::string& transfer_id, const Caller& caller) const;
  absl::StatusOr<v1::TransferState> Cancel(const std::string& transfer_id, const Caller& caller);
  std::vector<v1::TransferState> List(bool active_only, const Caller& caller) const;
  TransferCounters counters() const;
  // The Inbox's handlers (worker thread). A notice from a peer that passed
  // authentication and the bounds (agent/inbox): the receiving side takes it.
  // `n` is the Inbox's kept storage: what is read stays there, and only what is held
  // (a DATA_READY, until its commit) is moved out.
  void OnAuthenticatedNotice(v1::Notification& n, const transport::ReplyEndpoint& reply_ep);
  // Receivers acknowledged DATA_READYs of ours (AmId::kTransferAck, one; kAckBatch,
  // several): each is matched on its own; the commits they lead to go out together.
  void OnAcks(absl::Span<const wire::TransferAck* const> acks);
  void OnAck(const wire::TransferAck& ack) {  // one (AmId::kTransferAck)
    const wire::TransferAck* one = &ack;
    OnAcks(absl::MakeConstSpan(&one, 1));
  }
  // The device copy path's mode on this host (DeviceCopyMode; loads the CUDA driver
  // once per process to know).
  static std::string device_copy_mode();

  // Local regions are being deregistered: fails (ABORTED, naming the region and
  // `who`) every active transfer that uses one of them, and calls `done` once each of
  // them drained (or reports drain_unknown), or after `timeout`; `done` gets the ids
  // still draining then. With a Stager, `done` runs on the worker thread once the
  // Stager's index let go of them; without one it may run at once, on this thread.
  void StopUsersOf(const std::vector<registry::RegionPtr>& regions, const std::string& who,
                   absl::Duration timeout, std::function<void(std::vector<std::string>)> done);
  // Fails every active transfer to peer `name` with `cause` (DisconnectPeer); returns
  // how many.
  uint32_t FailTransfersTo(const std::string& name, const absl::Status& cause);

  // The peer was lost (PeerManager's loss listener): fails, under the engine's lock,
  // every active transfer to it (or, on a restart, those planned against another
  // incarnation) with UNAVAILABLE. Posted operations are not waited for: `drained`
  // turns true when their flush completes. Must not be called under PeerManager's lock.
  void FailPeer(const PeerLoss& loss);

  // Calls `watcher` now with the current state and after every change, under the
  // engine's lock (it must not call back into the engine). Returns a token.
  absl::StatusOr<uint64_t> Watch(const std::string& transfer_id, const Caller& caller,
                                 Watcher watcher);
  void Unwatch(const std::string& transfer_id, uint64_t token);
  // Calls `done` once with the final state when the transfer ends (at once if it has
  // ended), under the engine's lock; it must not call back into the engine. Unlike a
  // watcher it is dropped after that call, so it never holds a finished transfer.
  absl::Status WhenTerminal(const std::string& transfer_id, Watcher done);

 private:
  struct Chunk {
    planning::TransferPlan plan;
    std::shared_ptr<const PeerSnapshot> peer;  // the catalog and keys the plan used
    size_t next_op = 0;
    std::vector<Route> routes;  // per op, chosen at submit (RouteOps)
    // The newer catalog of the same peer that was found to still hold every region
    // this chunk's remaining ops use (CheckRegionsCurrent), so it is checked once.
    std::shared_ptr<const registry::RemoteCatalog> checked_catalog;
  };
  struct Transfer {
    v1::TransferState state;
    std::vector<uint64_t> chunk_digests;
    std::string notification;
    // Planned, not yet fully posted. A list, not a deque: libstdc++'s deque allocates
    // ~600 bytes even when empty, and every ended transfer kept for queries (up to
    // max_finished) would hold them (docs/BENCHMARKS.md, Agent memory).
    std::list<Chunk> chunks;
    uint64_t planned_ops = 0;  // ops of `chunks` (the planned_ops limit)
    std::shared_ptr<const PeerSnapshot> last_peer;
    // Local regions of every chunk, held until nothing posted can touch them any more
    // (drained): a deregistration meanwhile cannot unmap memory a batch still reads or
    // writes.
    std::vector<registry::RegionPtr> pinned;
    // The peer's groups and regions this transfer addresses (Notification.targets).
    std::vector<std::string> targets;
    uint32_t segments = 0;
    bool inflight = false;     // a batch or the notification is posted
    int32_t inflight_segment = -1;  // first segment of the batch posted last
    bool notified = false;      // DATA_READY posted (cancel no longer possible)
    bool opened = false;        // PEER_TRANSFER_OPEN made (sent, or due as late_open)
    // A same-host copy's PEER_TRANSFER_OPEN, due since its first batch and sent by the
    // Pump after it (with DATA_READY, for a one-batch transfer: one message, one wake-up
    // of the peer, instead of two). Sent by the transfer's next Pump, whatever it does,
    // which builds it then (from the record, and late_open_bytes: bytes_total when its
    // first batch was posted), so no message waits in the record meanwhile.
    bool late_open = false;
    uint64_t late_open_bytes = 0;
    bool awaiting_ack = false;  // DATA_READY sent, its TransferAck not yet here
    // Ended and awaiting_ack when its turn to leave the whole records came: in parked_,
    // not finished_order_, until the answer (or the loss of its peer) is recorded.
    bool parked = false;
    uint64_t ack_token = 0;
    bool outcome_sent = false;  // the peer was told how it ended (cancel, failure)
    uint64_t stopped_us = 0;    // when it ended with operations still posted
    uint64_t staged_bytes = 0;  // bytes sent as staged chunks (the peer waits for them)
    uint64_t start_us = 0;     // monotonic
    uint64_t deadline_us = 0;  // monotonic
    std::vector<std::pair<uint64_t, Watcher>> watchers;
    std::vector<Watcher> on_terminal;  // WhenTerminal callbacks, run once by Finish
    // The peer's data path at chunk 0, for the metrics (a static string); null when
    // there are none.
    const char* metrics_path = nullptr;

    // Back to a new record's values for a pruned record that NewRecordLocked hands out
    // again, keeping the storage its state's strings, timeline, vectors and notification
    // grew (a reused record's submit then allocates none of it). A field added above
    // must be reset here: a static_assert on the struct's size says so.
    void Reset();
  };
  using TransferPtr = std::shared_ptr<Transfer>;
  using Transfers = absl::flat_hash_map<std::string, TransferPtr>;

  static bool Terminal(v1::TransferPhase phase);
  // COMPLETED when placed (complete_when): its DATA_READY's acknowledgement, while
  // awaiting_ack, is only recorded. (A staged transfer's complete_when turned to
  // ACKNOWLEDGED before it completed.)
  static bool CompletedPlaced(const Transfer& t) {
    return t.state.phase() == v1::COMPLETED && t.state.complete_when() == v1::COMPLETE_WHEN_PLACED;
  }
  // The limits a new transfer (`is_new`) or chunk of `ops` operations must fit:
  // RESOURCE_EXHAUSTED naming the one it does not.
  absl::Status AdmitLocked(const std::string& id, const std::string& owner, bool is_new,
                           uint64_t ops) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Publish(Transfer& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Finish(Transfer& t, v1::TransferPhase phase, absl::Status status, int32_t segment)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the oldest ended records past the newest live_ended_ into ended_ (or lets
  // them go, past ended_'s share of max_finished), and reuses their records.
  void PruneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the ended record at `it` into ended_ (when it has room) and out of transfers_,
  // keeping the record for reuse when nothing else holds it; one still draining or
  // watched goes back into finished_order_ instead.
  void CompactLocked(Transfers::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A parked record's answer was recorded (or will never come): it leaves parked_.
  void UnparkLocked(Transfers::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The newest ended transfers kept whole, of max_finished: the rest are kept compact.
  static size_t LiveEnded(uint32_t max_finished);
  // Ended transfer `id` from ended_, when it is there and `caller` may see it;
  // NOT_FOUND (NotKnown) otherwise.
  absl::StatusOr<v1::TransferState> FindEndedVisible(const std::string& id,
                                                     const Caller& caller) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status NotKnown(const std::string& id) const;
  // A record for a new transfer: a pruned one whose state keeps its strings' and
  // timeline's storage (reset to a new Transfer's values), else a new one.
  TransferPtr NewRecordLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The segment being moved: the posted batch's, else the next to post; -1 if none.
  static int32_t SegmentInProgress(const Transfer& t);
  // Worker thread: posts the next batch, the notification, or records the drain.
  void Pump(const TransferPtr& t);
  // Pump's Transfer::late_open, built from the record: sent by Send(), else as Pump
  // returns (after its lock is released), so no way out of Pump loses it. Its message
  // comes from, and goes back to, the engine's kept notices.
  struct LateOpen {
    explicit LateOpen(TransferEngine& e) : engine(e) {}
    LateOpen(const LateOpen&) = delete;
    LateOpen& operator=(const LateOpen&) = delete;
    ~LateOpen() { Send(); }
    void Send();
    void Drop();  // not sent (it went inside the DATA_READY)
    TransferEngine& engine;
    std::shared_ptr<const PeerSnapshot> peer;
    std::unique_ptr<v1::Notification> notice;
  };
  // Any thread: has the worker Pump `t` soon, in the order scheduled (one posted
  // closure for all the Pumps scheduled before the worker takes them).
  void SchedulePump(const TransferPtr& t);
  // Worker thread: runs the scheduled Pumps.
  void PumpQueued();
  // ABORTED when the peer, since `chunk` was planned, deregistered (or moved) a region
  // that the chunk's remaining ops write or read: nothing more may be posted to it.
  static absl::Status CheckRegionsCurrent(const std::string& id, Chunk& chunk,
                                          const PeerSnapshot& current);
  // Sends `notice` to `peer` with this agent's name and the secret the peer issued us
  // (`want_reply`: the peer gets a reply endpoint, for DATA_READY's TransferAck). Inside
  // a worker round (outbox_ set) it is held and goes out with the round's others.
  // `done` may be empty (nothing to do when it is sent).
  void SendNotice(const std::shared_ptr<const PeerSnapshot>& peer, const v1::Notification& notice,
                  transport::Completion done, bool want_reply = false);
  // What one worker round (PumpQueued, OnAcks) sends: notices are held until the round
  // ends, then each peer's go out in order, as few messages as its wire features allow
  // (NoticeBatch); the data batches the round started run after that, so a transfer's
  // PEER_TRANSFER_OPEN is still sent before its first operation is posted.
  struct HeldNotice {
    // Whose endpoint, secret and wire features it goes with (held, not copied).
    std::shared_ptr<const PeerSnapshot> peer;
    std::string body;  // the serialized Notification
    transport::Completion done;
    bool want_reply = false;
  };
  struct Outbox {
    std::vector<HeldNotice> notices;
    // Sent notices' serialized bodies, kept for the next ones (SendNotice serializes
    // into one: no allocation per notice once warm); at most kKeptBodies, of at most
    // kKeptBodyBytes each.
    std::vector<std::string> bodies;
    std::vector<std::function<void()>> runs;  // data batches, started after the notices
    // FlushOutbox's scratch (which notices went, the batch being filled), kept with
    // the storage rounds reuse.
    std::vector<bool> sent;
    std::vector<HeldNotice*> batch;
  };
  // Worker thread: sends what `outbox` holds (the notices, then the runs).
  void FlushOutbox(Outbox& outbox);
  // Worker thread: an empty Outbox with the storage of earlier rounds, and back (a
  // round inside a round gets fresh storage).
  Outbox TakeOutbox();
  void GiveBackOutbox(Outbox outbox);
  // Worker thread: sends `notices` (all to one endpoint) as one message.
  void SendBatch(std::vector<HeldNotice*>& notices);
  // OnAcks, for one acknowledgement (under mu_): true when `commit` was filled with the
  // commit to send.
  bool OnAckLocked(const wire::TransferAck& ack, TransferPtr* t, v1::Notification* commit)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `t`'s PEER_DATA_COMMIT (the peer hands DATA_READY to its owners when it takes it).
  void MakeCommit(const Transfer& t, v1::Notification* commit) const;
  // A transfer COMPLETED when placed whose peer did not take the notification: `why`
  // goes to its peer_note, counted and logged.
  void NotTakenLocked(Transfer& t, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the transfers that ended with operations posted longer than the drain
  // timeout ago as drain_unknown (deadline thread).
  void ExpireDrains() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks `t` drained and releases its pinned regions (under the lock).
  void SetDrained(Transfer& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // NOT_FOUND unless `caller` may see transfer `id` (it exists and is the caller's, or
  // the caller is a scheduler).
  absl::StatusOr<TransferPtr> FindVisible(const std::string& id, const Caller& caller) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
 public:
  // The Stager's answer for a DATA_READY it held: its staged data is in place, or never
  // will be (worker thread).
  void StagedDataInPlace(v1::Notification n, absl::Status data);

 private:
  // Routes every op of `plan` (RouteOps): each op that touches VRAM needs a way to
  // reach it (a same-host direct mapping, a UCX with CUDA support, or host staging).
  // Also refuses (FAILED_PRECONDITION) a plan that uses memory a caught SIGBUS broke
  // (MemoryLost), until it is re-registered.
  absl::Status RouteChunk(const std::string& id, v1::TransferOp op,
                          const planning::TransferPlan& plan, const PeerSnapshot& peer,
                          std::vector<Route>* routes) const;
  // DATA_LOSS naming the memory when a SIGBUS caught by registry::FaultGuard broke a
  // local region `t` pins, or a region of the peer mapped here directly that `ops`
  // reach: the batch just moved read zeros or wrote into throwaway pages.
  absl::Status MemoryLost(const Transfer& t, const PeerSnapshot& peer,
                          const std::vector<planning::PlanOp>& ops, int32_t segment) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A failed batch's error, or ABORTED naming the local region when one `t` pins was
  // deregistered meanwhile (the outcome was ABORTED).
  absl::Status LocalRegionGone(const Transfer& t, const BatchOutcome& outcome) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DeadlineLoop();

  transport::UcxWorker* worker_;
  registry::RegionRegistry* registry_;
  PeerManager* peers_;
  NotificationQueue* notifications_;
  TransferEngineOptions options_;
  // The ways bytes move, by Route (the staged routes share one path; null without a
  // Stager, when RouteOps never picks them).
  CopyLanes lanes_;
  std::array<std::shared_ptr<DataPath>, kRouteCount> paths_;

  mutable absl::Mutex mu_;
  Transfers transfers_ ABSL_GUARDED_BY(mu_);
  // The records of the transfers not ended yet, by address (Abseil hashes and finds a
  // shared_ptr by its pointer): an insert and an erase per transfer hash no id string
  // and copy none. Only ended records are pruned from transfers_, so each is there too.
  absl::flat_hash_set<TransferPtr> active_ ABSL_GUARDED_BY(mu_);
  // Active transfers per owner and operations planned in all (the limits).
  absl::flat_hash_map<std::string, uint64_t> active_by_owner_ ABSL_GUARDED_BY(mu_);
  uint64_t planned_ops_ ABSL_GUARDED_BY(mu_) = 0;
  // The ended records still whole in transfers_, oldest first: the newest live_ended_
  // (256, or max_finished when that is fewer) stay there, so a late change (an
  // acknowledgement, a drain, a watcher) finds the record, and a submit reuses a pruned
  // record while it is still in cache.
  FinishedOrder finished_order_ ABSL_GUARDED_BY(mu_);
  const size_t live_ended_;
  // Ended placed transfers still awaiting their peer's answer when their turn came, by
  // id, oldest first (ids of ones answered since stay until they come to the front). At
  // most live_ended_: past it, the oldest is kept compact without its answer (a late
  // one is then dropped quietly, as for any ended transfer), so a peer that never
  // answers costs no more than that.
  std::deque<std::string> parked_ ABSL_GUARDED_BY(mu_);
  // The older ended transfers, up to max_finished - live_ended_, compact: each its
  // state serialized, then its acknowledgement token and chunk digests (an idempotent
  // retry's check), 8 bytes each. Queries and retries look here when transfers_ does
  // not have the id. Kept this way, 10,000 ended cost a transfer no more CPU than 1,000
  // (measured alike), and a few hundred bytes each (docs/BENCHMARKS.md).
  EndedLog ended_ ABSL_GUARDED_BY(mu_);
  std::string ended_extra_ ABSL_GUARDED_BY(mu_);  // CompactLocked's, reused
  // Ended transfer `id` rebuilt from ended_ (its state, acknowledgement token and chunk
  // digests; nothing else) for the checks of a retry or a late acknowledgement (rare),
  // or null when ended_ does not have it.
  TransferPtr EndedRecordLocked(const std::string& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Pruned records nothing else held, reset, for NewRecordLocked: a transfer ending and
  // one starting then free and allocate no record, state strings or timeline events
  // (issue 15). At most kSpareRecords; each holds a few hundred bytes.
  static constexpr size_t kSpareRecords = 64;
  static constexpr size_t kKeptBodies = 256;
  static constexpr size_t kKeptBodyBytes = 1024;
  std::vector<TransferPtr> spare_records_ ABSL_GUARDED_BY(mu_);
  // Destination bytes each active transfer writes, per peer incarnation (WRITE) or here
  // (READ): overlapping writes, by two transfers or two chunks, are refused at submit.
  // Released when the transfer drained.
  planning::DestinationLedger destinations_;
  // Ended with operations still posted: waiting for their drain (ExpireDrains).
  absl::flat_hash_set<std::string> draining_ ABSL_GUARDED_BY(mu_);
  // StopUsersOf waits: ids still draining and the callback.
  struct DrainWait {
    absl::flat_hash_set<std::string> ids;
    uint64_t deadline_us = 0;
    std::function<void(std::vector<std::string>)> done;
  };
  std::vector<std::shared_ptr<DrainWait>> drain_waits_ ABSL_GUARDED_BY(mu_);
  uint64_t next_token_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t completed_when_placed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t placed_not_taken_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t failed_ ABSL_GUARDED_BY(mu_) = 0;
  // The incarnation of each peer that FailPeer last saw restart: a chunk planned
  // against an older one (a submit racing the restart) is refused.
  absl::flat_hash_map<std::string, uint64_t> peer_incarnation_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> notifications_received_{0};
  // Transfers whose Pump is scheduled and not yet run (SchedulePump). Taken after mu_
  // (SchedulePump runs under it), never before.
  absl::Mutex pump_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::vector<TransferPtr> pump_queue_ ABSL_GUARDED_BY(pump_mu_);
  // Empty, with the storage of an earlier round's batch: the next round's queue.
  std::vector<TransferPtr> pump_spare_ ABSL_GUARDED_BY(pump_mu_);
  // Worker thread only: the round in progress (SendNotice holds into it), else null;
  // the storage rounds reuse (TakeOutbox).
  Outbox* outbox_ = nullptr;
  Outbox spare_outbox_;
  // Worker thread only: the notices Pump and OnAcks build (serialized as they are sent),
  // with their strings' storage kept from notice to notice.
  KeptMessages<v1::Notification> notices_;

  std::atomic<bool> stopping_{false};
  absl::Mutex deadline_mu_;
  absl::CondVar deadline_cv_;
  // The deadline thread sleeps until the earliest thing it acts on: a transfer's
  // deadline, a drain's timeout, a drain wait's deadline, the incoming table's next
  // expiry; with none, until woken. deadline_next_us_ is when it next looks
  // (monotonic us; UINT64_MAX while it is awake or has nothing to wait for): whoever
  // adds something due earlier, or settles a drain wait, wakes it (WakeDeadlinesBy).
  bool deadline_wake_ ABSL_GUARDED_BY(deadline_mu_) = false;
  std::atomic<uint64_t> deadline_next_us_{UINT64_MAX};
  // Wakes the deadline thread if `due_us` (monotonic) comes before it next looks.
  void WakeDeadlinesBy(uint64_t due_us);
  // When the deadline thread must next look at draining_ and drain_waits_ (active_'s
  // deadlines it takes in the same pass that expires them).
  uint64_t NextDrainDeadlineLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::thread deadline_thread_;
};

}  // namespace kvagent::agent
