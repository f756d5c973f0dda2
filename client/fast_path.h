// FastPath: an engine's side of the local fast path (proto OpenFastPathRequest,
// layout in client/fast_ring.h). Transfers go into a submission ring in shared memory
// and their outcomes come back on a completion ring: no round trip per transfer, many
// transfers per doorbell, completions reaped in batches. The same requests, checks,
// errors, states, deadlines and cancels as gRPC's SubmitTransfer; the transfers are
// the session's. Used by engines, kvagentctl bench and the tests.
//
// Threads: Submit/Cancel/Ping/Publish may be called from one thread at a time, and
// Reap from one thread at a time (the two sides have separate locks).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/unique_fd.h"
#include "client/fast_ring.h"
#include "client/local_session.h"
#include "proto/kvagent.pb.h"

namespace kvagent::client {

struct FastPathOptions {
  uint32_t submission_slots = 0;    // 0: the agent's default (1024)
  uint32_t completion_entries = 0;  // 0: as many as submission slots
  // How long Reap polls the completion ring before it sleeps on the doorbell.
  uint32_t spin_us = 20;
};

// One entry's outcome.
struct FastCompletion {
  uint64_t user_data = 0;
  uint16_t opcode = 0;  // fastring::Opcode
  // The refusal (the transfer was never accepted), or the transfer's error: OK for a
  // COMPLETED transfer and a ping; a cancel that found its transfer reports that
  // transfer's state after the cancel (CANCELLED, or its end if it had ended).
  absl::StatusCode code = absl::StatusCode::kOk;
  v1::TransferPhase phase = v1::TRANSFER_PHASE_UNSPECIFIED;  // submit and cancel
  uint64_t bytes_done = 0;
  uint64_t latency_us = 0;
  std::string message;
  // opcode kNotification (the watch's user_data; phase unset: the kind is the
  // notification's; bytes_done its bytes): the notification (with its `sequence` on a
  // durable watch). A completion whose bytes do not parse has code INTERNAL and says
  // why in message; one the agent could not fit (durable watch) has code
  // RESOURCE_EXHAUSTED, no notification, and names its sequence in message.
  // opcode kAckNotifications: bytes_done is how many were released.
  std::optional<v1::Notification> notification;

  absl::Status status() const { return absl::Status(code, message); }
};

// What FastPath::Close did.
struct FastPathClose {
  // False when the agent is older than close_fast_path (it answered UNIMPLEMENTED or
  // INVALID_ARGUMENT): its ring stays open until the session ends, as before, and
  // notifications it writes there meanwhile are lost once this object is gone.
  bool closed_by_agent = false;
  // Transfers still running at the close: they run to their end, their completions
  // dropped (look them up with gRPC GetTransfer).
  uint32_t transfers_running = 0;
  // Completions written before the close and not reaped yet (notifications included).
  std::vector<FastCompletion> left;
};

class FastPath {
 public:
  // Asks the agent for a ring pair over `session` (which must outlive this object) and
  // maps it. Errors: the agent's refusal (no engine or scheduler role, one already
  // open for the session, sizes out of range), or a ring that does not match this
  // client (FAILED_PRECONDITION).
  static absl::StatusOr<std::unique_ptr<FastPath>> Open(LocalSession* session,
                                                        FastPathOptions options = {});
  // Unmaps the ring. A ring neither Close()d nor closed by the agent is closed first, as
  // Close() does, best effort: close_fast_path with at most a second's wait (the
  // session's timeout if shorter), nothing thrown, nothing returned; the completions
  // left on the ring are dropped (call Close() to get them). An agent gone or slow only
  // costs that wait (a slow one keeps the ring until the session ends). It waits for
  // another thread's call on the session to finish first.
  ~FastPath();
  FastPath(const FastPath&) = delete;
  FastPath& operator=(const FastPath&) = delete;

  // Puts one entry on the submission ring, and publishes it (and any unpublished
  // before it) unless `publish` is false: then Publish() does, so many entries go with
  // one doorbell. RESOURCE_EXHAUSTED when the ring has no room (the agent takes an
  // entry only when its completion has room: reap, then submit again); INVALID_ARGUMENT
  // for a request too large for one entry (use gRPC or chunks); FAILED_PRECONDITION
  // once the agent closed the ring (with its reason).
  absl::Status Submit(const v1::SubmitTransferRequest& request, uint64_t user_data,
                      bool publish = true);
  // Submit, and while the ring is full, reap completions into `reaped` (which makes
  // room: the agent takes an entry once its completion has one) and try again, until
  // `timeout` passes (then DEADLINE_EXCEEDED). Publishes at once.
  absl::Status SubmitOrReap(const v1::SubmitTransferRequest& request, uint64_t user_data,
                            std::vector<FastCompletion>* reaped, absl::Duration timeout);
  // A cancel entry waits for completion room as any entry does: while transfers in
  // flight reserve every completion entry, the agent takes none until one ends (reaping
  // frees nothing then). Keep fewer transfers in flight than completion_entries, or
  // cancel through gRPC CancelTransfer.
  absl::Status Cancel(std::string_view transfer_id, uint64_t user_data, bool publish = true);
  absl::Status Ping(uint64_t user_data, bool publish = true);
  // Asks the agent to post this session's notifications (of `transfer_ids`, empty: any;
  // those its principal owns, or all for a scheduler) on the completion ring, as
  // kNotification completions carrying `user_data`. The entry itself completes OK once
  // the watch is in place (FAILED_PRECONDITION for a second watch on this ring). Each
  // notification is taken once: one posted here goes to no other taker, and those
  // posted and not reaped when the session ends are lost. A notification spanning more
  // than half the completion ring stays with gRPC's takers. FAILED_PRECONDITION, with
  // nothing written, when the agent is older than notifications on the ring
  // (delivers_notifications() is false): take them with gRPC WatchNotifications.
  absl::Status WatchNotifications(const std::vector<std::string>& transfer_ids,
                                  uint64_t user_data, bool publish = true);
  // The same through durable `subscription` (1 to 64 of A-Z a-z 0-9 . _ : -), as gRPC
  // WatchNotifications with one: the subscription belongs to the session's durable
  // identity (uid and client name), the ones it holds unacknowledged come first, in
  // order, each notification carries its `sequence`, and the agent holds each until it
  // is acknowledged (AckNotifications here, or gRPC's), so those posted and not reaped
  // when the session ends come again to the next attachment (ring or gRPC). A newer
  // attachment of the subscription (another ring, a gRPC stream) replaces this one: this
  // ring then gets nothing more, not even those the agent had not written yet for want
  // of room (the newer attachment gets them). The entry
  // completes with gRPC's refusals (a bad name, the subscriptions limit). A
  // notification spanning more than half the completion ring comes as a kNotification
  // completion with code RESOURCE_EXHAUSTED naming its sequence (take it with gRPC
  // PollNotifications). FAILED_PRECONDITION, with nothing written, when the agent lacks
  // durable subscriptions on the ring (delivers_durable_notifications()).
  absl::Status WatchNotifications(const std::vector<std::string>& transfer_ids,
                                  const std::string& subscription, uint64_t user_data,
                                  bool publish = true);
  // Acknowledges `subscription`'s notifications with a sequence up to `through` (0:
  // none) and those in `sequences`, as gRPC AckNotifications. Completes with gRPC's code
  // and message (NOT_FOUND for a subscription this identity does not have) and
  // bytes_done = how many were released. FAILED_PRECONDITION, with nothing written, as
  // for the durable watch.
  absl::Status AckNotifications(const std::string& subscription, uint64_t through,
                                const std::vector<uint64_t>& sequences, uint64_t user_data,
                                bool publish = true);
  void Publish();

  // Appends up to `max` completions (notifications included; pads skipped) to `out`;
  // waits up to `timeout` until it has `min` of them (1 to max; polling spin_us, then
  // sleeping on the doorbell, when one is wanted or the agent lacks kFeatureWakeCount;
  // sleeping at once when several are).
  // With several wanted, an agent with kFeatureWakeCount rings the doorbell only once
  // they have all come, so a client with many transfers in flight wakes once per batch
  // (an older agent rings at the first; this then waits again). The first ones wait
  // for the rest (or the timeout): for throughput, e.g. a stream of many transfers, not
  // where one completion's latency counts (wait for 1 there). Returns how many it
  // appended: at least `min`, or what had come when `timeout` passed (possibly 0).
  // UNAVAILABLE when the agent closed the session; FAILED_PRECONDITION when it closed
  // the ring (with its reason) and none are left.
  absl::StatusOr<size_t> Reap(std::vector<FastCompletion>* out, size_t max,
                              absl::Duration timeout, size_t min = 1);
  // How many times Reap slept on the completion doorbell, since the ring opened.
  uint64_t sleeps() const { return sleeps_.load(std::memory_order_relaxed); }

  // Closes the ring and keeps the session (proto CloseFastPathRequest): the agent ends
  // the ring's notification watch first (those not yet written stay queued for other
  // takers, e.g. gRPC PollNotifications, or with the durable subscription), takes no
  // more entries, and lets the ring's transfers run to their end, their completions
  // dropped. Returns the completions written before the close and not reaped yet. The
  // session may then open a new FastPath; this one is only good for closed_reason()
  // and for its destructor, which then only unmaps the ring (it does not retry the
  // close, whatever Close() returned). Call it with no Reap running.
  // FAILED_PRECONDITION when the agent had closed the ring already (its reason);
  // UNAVAILABLE when the session is gone.
  absl::StatusOr<FastPathClose> Close();

  // Entries submitted whose completion has not been reaped (pads and notifications not
  // counted).
  uint64_t outstanding() const;
  // Why the agent closed this ring; empty while it is open.
  std::string closed_reason() const;
  const v1::FastPathInfo& info() const { return info_; }
  // Whether the agent takes WatchNotifications on this ring (FastPathInfo.features).
  bool delivers_notifications() const {
    return (info_.features() & fastring::kFeatureNotifications) != 0;
  }
  // Whether it takes a watch with a subscription, and acknowledgements.
  bool delivers_durable_notifications() const {
    return (info_.features() & fastring::kFeatureDurableNotifications) != 0;
  }

 private:
  FastPath(LocalSession* session, v1::FastPathInfo info, UniqueFd memfd, UniqueFd submit_fd,
           UniqueFd complete_fd, char* base, FastPathOptions options);
  absl::Status Put(uint16_t opcode, uint64_t user_data, size_t length,
                   const std::function<void(char*)>& fill, bool publish)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(submit_mu_);
  // Put of a serialized message as the payload.
  absl::Status PutMessage(uint16_t opcode, const google::protobuf::MessageLite& message,
                          uint64_t user_data, bool publish) ABSL_LOCKS_EXCLUDED(submit_mu_);
  void PublishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(submit_mu_);
  // Rings the submission doorbell if the agent sleeps and entries wait.
  void NudgeAgent();
  // Rings the submission doorbell if the agent says it sleeps.
  void WakeAgentIfAsleep();
  size_t TakeCompletions(std::vector<FastCompletion>* out, size_t max)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(reap_mu_);
  fastring::RingHeader* header() const { return reinterpret_cast<fastring::RingHeader*>(base_); }

  LocalSession* const session_;
  const v1::FastPathInfo info_;
  const UniqueFd memfd_;
  const UniqueFd submit_fd_;
  const UniqueFd complete_fd_;
  char* const base_;
  const FastPathOptions options_;
  const uint32_t slots_;
  const uint32_t completions_;

  absl::Mutex submit_mu_;
  uint32_t sq_tail_ ABSL_GUARDED_BY(submit_mu_) = 0;       // written, maybe not published
  uint32_t published_ ABSL_GUARDED_BY(submit_mu_) = 0;
  std::atomic<uint64_t> submitted_{0};

  absl::Mutex reap_mu_;
  uint32_t cq_head_ ABSL_GUARDED_BY(reap_mu_) = 0;
  std::atomic<uint64_t> reaped_{0};
  std::atomic<uint64_t> sleeps_{0};
  // Close() was called: the destructor only unmaps.
  std::atomic<bool> close_sent_{false};
};

}  // namespace kvagent::client
