// FastPathServer: the agent's side of the local fast path (proto OpenFastPathRequest,
// layout in client/fast_ring.h). A session opens one ring pair over the session
// socket; one thread takes submission entries from every open ring, hands them to the
// same submit and cancel paths as the gRPC API (as the session's caller), and posts
// each transfer's outcome on the completion ring when it ends. In the agent that
// thread is the UCX worker's (a WorkerPoller: a submission's plan, data and messages
// then run on the thread that sends them, with no wake-up between), else its own. It
// polls for spin_us after the last entry it took, then sleeps on the rings' doorbells
// (and wakes every idle_poll_ms regardless, so a lost doorbell costs at most that).
// A ring that watches notifications (kWatchNotifications) is a subscriber of the
// agent's NotificationQueue: the thread that pushes a notification the session may take
// posts it on the completion ring, when it fits beside the room every taken entry keeps;
// otherwise it waits in the queue, and the taking thread offers it again once the client
// reaped. A watch naming a subscription attaches the ring to that durable subscription
// instead (as gRPC WatchNotifications): the queue hands it every notification, which
// the ring writes at once or keeps, serialized, in its pending list until the client
// reaps; kAckNotifications entries acknowledge them. Everything the client can write is untrusted (see client/fast_ring.h). Used by
// agent/agent (LocalDoor opens and closes rings for sessions).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "agent/access.h"
#include "agent/notification_queue.h"
#include "base/unique_fd.h"
#include "proto/kvagent.pb.h"
#include "transport/ucx_worker.h"

namespace kvagent::agent {

struct FastPathOptions {
  uint32_t spin_us = 50;         // --fast-path-spin-us: poll this long after work
  uint32_t idle_poll_ms = 100;   // look at every ring this often while asleep
  // --fast-path-features: FastPathInfo.features this agent announces and takes, masked
  // with what the build offers (client/fast_ring.h kFeatures). Fewer make the rings
  // behave as an older agent's (an opcode of a missing feature closes the ring): for
  // testing clients against older agents.
  uint32_t features = ~0u;
};

// What the rings' entries become: the agent's submit (with wait: `done` gets the
// final state, or the refusal; the state is lent for the call, as SubmitTransfer's in
// agent/agent_service.h) and cancel, exactly as gRPC's.
struct FastPathBackend {
  using Done = std::function<void(const absl::Status& refused, const v1::TransferState& state)>;
  std::function<void(const v1::SubmitTransferRequest& request, const Caller& caller, Done done)>
      submit;
  std::function<absl::StatusOr<v1::TransferState>(const std::string& transfer_id,
                                                  const Caller& caller)>
      cancel;
  // Where kWatchNotifications entries take notifications from (the agent's queue, which
  // must outlive the server); null: those entries are refused (UNIMPLEMENTED).
  NotificationQueue* notifications = nullptr;
};

struct FastPathCounters {
  uint64_t rings = 0;            // open now
  uint64_t entries = 0;          // submission entries taken (pads not counted)
  uint64_t protocol_errors = 0;  // rings closed because their client broke the protocol
  uint64_t notifications = 0;    // notifications posted on watching rings
  // Offers to a watching ring of notifications it could take but that span more than
  // half its completion ring: left to gRPC's takers (one offered again counts again).
  uint64_t notifications_too_large = 0;
  uint64_t acks = 0;             // kAckNotifications entries answered OK
  // Notifications a ring attached to a subscription dropped from its pending list at
  // in_flight_per_subscription (possible only when sequences it had not written yet were
  // acknowledged, e.g. through gRPC).
  uint64_t pending_dropped = 0;
  uint64_t closed_by_request = 0;  // rings closed by their session's close_fast_path
};

class FastPathServer final : public transport::WorkerPoller {
 public:
  FastPathServer(FastPathOptions options, FastPathBackend backend);
  ~FastPathServer();
  FastPathServer(const FastPathServer&) = delete;
  FastPathServer& operator=(const FastPathServer&) = delete;

  // Takes entries on `worker`'s thread (its poller), or on a thread of its own when
  // null (tests, fuzzers).
  void Start(transport::UcxWorker* worker = nullptr);
  // Stops taking entries (idempotent; before the worker goes). Completions of
  // transfers still running are posted when they end, as long as their ring's session
  // is open.
  void Stop();

  // transport::WorkerPoller, on the taking thread.
  bool Poll() override;
  bool PrepareSleep() override;
  void Woke(bool rang) override;
  int fd() const override;
  int SleepTimeoutMs() const override;
  uint32_t spin_us() const override;

  // Opens the ring pair of `session_id` for `caller` (engine or scheduler role; one
  // per session). Fills `fds` with the ring file, the submission doorbell and the
  // completion doorbell.
  absl::StatusOr<v1::FastPathInfo> Open(uint64_t session_id, const Caller& caller,
                                        const v1::OpenFastPathRequest& request,
                                        std::vector<UniqueFd>* fds);
  // The session ended: its ring takes nothing more; its transfers go on (their
  // completions are dropped) and the ring's memory goes with the last of them. Its
  // notification watch ends: notifications posted on the ring and not reaped are gone
  // with it (each is taken once, as by a gRPC watch stream whose client died); those
  // still queued go to other takers.
  void Close(uint64_t session_id);
  // The session's close_fast_path request: ends the ring's notification watch first
  // (notifications not yet written stay queued for other takers, or held by the durable
  // subscription for its next attachment), then closes the ring as Close does, with the
  // reason in the ring file. The session stays and may open a new ring. What the ring
  // holds up to the answer's completion_tail stays for the client to reap.
  // FAILED_PRECONDITION when the session has no ring.
  absl::StatusOr<v1::FastPathClosed> CloseOnRequest(uint64_t session_id);

  FastPathCounters counters() const;

  struct Ring;  // defined in fast_path.cc

 private:
  void Run();
  // Takes what `ring` has published; true when it took anything.
  bool Drain(const std::shared_ptr<Ring>& ring);
  void Handle(const std::shared_ptr<Ring>& ring, uint16_t opcode, uint64_t user_data,
              std::string_view payload);
  // A kWatchNotifications entry: subscribes `ring` to the notification queue, or
  // attaches it to a durable subscription.
  void Watch(const std::shared_ptr<Ring>& ring, uint64_t user_data, std::string_view payload);
  // Watch's durable half: attaches `ring` to `subscription`; the refusal, else OK once
  // the watch's answer is posted.
  absl::Status AttachDurable(const std::shared_ptr<Ring>& ring, uint64_t user_data,
                             const std::string& subscription, NotificationFilter filter);
  // The deliver of a durable watch (under the queue's lock, on the pushing thread):
  // takes `n`, writes it if it fits, else keeps it in the ring's pending list.
  void DeliverDurable(Ring& ring, const QueuedNotification& n, uint64_t user_data);
  // A kAckNotifications entry.
  void Ack(const std::shared_ptr<Ring>& ring, uint64_t user_data, std::string_view payload);
  // The subscriber of a watching ring (under the queue's lock, on the pushing thread):
  // posts `n` if the ring's session may take it and it has room.
  bool OfferNotification(Ring& ring, const QueuedNotification& n, uint64_t user_data);
  // The ring refused notifications for room: once the client has reaped enough, offers
  // it the queued ones again (the taking thread, outside every lock). True when it did.
  bool OfferAgain(Ring& ring);
  // Ends `ring`'s watch, if any (outside its cq_mu and the queue's lock).
  void Unwatch(Ring& ring);
  // The client broke the ring protocol: closes the ring, logs why, counts it.
  void Break(Ring& ring, const absl::Status& why);
  std::vector<std::shared_ptr<Ring>> Snapshot();

  const FastPathOptions options_;
  const FastPathBackend backend_;
  const uint32_t features_;  // FastPathInfo.features: options' mask of the build's
  UniqueFd epoll_fd_;
  UniqueFd wake_fd_;  // eventfd: Stop() and Open() wake the thread
  std::thread thread_;        // without a worker
  transport::UcxWorker* worker_ = nullptr;  // whose thread takes the entries, else null
  // The taking thread's: the rings as of generation seen_.
  std::vector<std::shared_ptr<Ring>> polled_;
  std::string payload_;  // the entry being handled, copied out of its slots
  uint64_t seen_ = ~uint64_t{0};
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> entries_{0};
  std::atomic<uint64_t> protocol_errors_{0};
  std::atomic<uint64_t> notifications_{0};
  std::atomic<uint64_t> notifications_too_large_{0};
  std::atomic<uint64_t> acks_{0};
  std::atomic<uint64_t> pending_dropped_{0};
  std::atomic<uint64_t> closed_by_request_{0};
  std::atomic<uint64_t> generation_{0};  // bumped when rings come and go

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Ring>> rings_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvagent::agent
