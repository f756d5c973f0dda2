#include "agent/fast_path.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "google/protobuf/arena.h"
#include "agent/limits.h"
#include "base/log.h"
#include "base/text.h"
#include "client/fast_ring.h"
#include "client/session_wire.h"
#include "fmt/format.h"

namespace kvagent::agent {
namespace {

constexpr log::Logger kLog("fast-path");
namespace fr = client::fastring;
using Clock = std::chrono::steady_clock;
constexpr uint32_t kSpinsPerClockRead = 16;
// Entries taken from one ring per look: the taking thread is the UCX worker's, whose
// messages (acknowledgements among them) wait while it plans; a burst is taken over
// several looks, each one round of the engine (its notices still batched).
constexpr uint32_t kEntriesPerLook = 256;

absl::Status Errno(const char* what) {
  return absl::ResourceExhaustedError(
      fmt::format("fast path: {} failed: {}; the agent is short of memory or descriptors",
                  what, std::strerror(errno)));
}


// A submit entry's request, parsed into an arena whose first block is inline: its
// strings, segments and items take no allocations of their own (one for the whole,
// under malloc's 1 KiB large-request threshold). Lives until the transfer's answer is
// posted (the submit may keep referring to the request until then).
struct ParsedSubmit {
  static constexpr size_t kInlineBytes = 768;
  alignas(16) char block[kInlineBytes];
  google::protobuf::Arena arena{block, sizeof block};
  v1::SubmitTransferRequest* request =
      google::protobuf::Arena::CreateMessage<v1::SubmitTransferRequest>(&arena);
};

// The reason a ring closed by close_fast_path gives in its file.
constexpr char kClosedByRequest[] =
    "the agent closed this fast path: closed by the session's close_fast_path request";

}  // namespace

struct FastPathServer::Ring {
  uint64_t session_id = 0;
  Caller caller;
  fr::Geometry geometry;
  UniqueFd memfd;
  UniqueFd submit_fd;    // the client rings it
  UniqueFd complete_fd;  // the agent rings it
  char* base = nullptr;
  fr::RingHeader* header = nullptr;
  // Whether this agent honours a client's kWaitCount (kFeatureWakeCount among its
  // features); set at Open.
  bool wake_count = false;
  // The poller thread's own.
  uint32_t sq_head = 0;
  std::atomic<bool> closed{false};

  // kWatchNotifications: the taking thread's (one watch per ring).
  bool watching = false;
  uint64_t watch_user_data = 0;
  std::string subscription;  // a durable watch's; empty: taken-once (or none)
  // Set when a notification was refused for room (room_wanted), cleared when the
  // taking thread offers the queued ones again: read without cq_mu on each look.
  std::atomic<bool> refused_for_room{false};
  std::atomic<bool> too_large_logged{false};

  absl::Mutex cq_mu;
  uint32_t cq_tail ABSL_GUARDED_BY(cq_mu) = 0;
  // Entries taken whose completion is not posted yet: each has its completion slot.
  uint32_t reserved ABSL_GUARDED_BY(cq_mu) = 0;
  // The queue's token for this ring's watch; 0 while none (or once it ended).
  uint64_t watch_token ABSL_GUARDED_BY(cq_mu) = 0;
  // Entries (pad and span) the notification refused for room needed; 0: none refused.
  // While set, the ring refuses every notification, so that those it takes keep the
  // queue's order.
  uint32_t room_wanted ABSL_GUARDED_BY(cq_mu) = 0;

  // A durable watch: what the subscription delivered (under the queue's lock, which
  // needs every one taken) and the completion ring had no room for yet, in order,
  // serialized, written as the client reaps. Bounded by in_flight_per_subscription:
  // the subscription holds no more than that unacknowledged, and hands each to this
  // attachment once (see DeliverDurable for acknowledgements of unwritten ones). Dropped
  // when the ring closes, or when a newer attachment replaces this one: the
  // subscription still holds those notifications, so the next attachment (ring or
  // gRPC) gets them again.
  struct Pending {
    fr::CompletionHeader header{};  // span and message_length set
    std::string body;             // the serialized Notification, or the refusal's text
    uint64_t sequence = 0;
  };
  bool durable ABSL_GUARDED_BY(cq_mu) = false;
  uint64_t pending_cap ABSL_GUARDED_BY(cq_mu) = 0;  // in_flight_per_subscription
  // Set while the watch's own answer is not posted yet: deliveries only queue up.
  bool holding ABSL_GUARDED_BY(cq_mu) = false;
  std::deque<Pending> pending ABSL_GUARDED_BY(cq_mu);

  ~Ring() {
    if (base != nullptr) munmap(base, geometry.ring_bytes);
  }

  const char* slot(uint32_t index) const {
    return base + geometry.submission_offset + uint64_t{index} * fr::kSlotBytes;
  }

  // Whether `more` completion entries fit beside the unreaped ones and the reserved
  // room of the entries taken. False also when the client's cq_head is impossible (set
  // in *bad).
  bool Fits(uint64_t more, bool* bad) ABSL_EXCLUSIVE_LOCKS_REQUIRED(cq_mu) {
    const uint32_t unreaped = cq_tail - header->cq_head.value.load(std::memory_order_seq_cst);
    if (unreaped > geometry.completion_entries) {
      *bad = true;
      return false;
    }
    return uint64_t{unreaped} + reserved + more <= geometry.completion_entries;
  }

  // Room on the completion ring for one more entry's completion.
  bool HasRoom(bool* bad) ABSL_EXCLUSIVE_LOCKS_REQUIRED(cq_mu) { return Fits(1, bad); }

  char* completion(uint32_t counter) const {
    return base + geometry.completion_offset +
           uint64_t{counter & (geometry.completion_entries - 1)} * fr::kCompletionBytes;
  }

  // Publishes cq_tail and wakes a waiting client.
  void PublishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(cq_mu) {
    // seq_cst store, then seq_cst load (no fence: GCC's TSan does not support
    // atomic_thread_fence): the client, which stores its flag before it reads cq_tail,
    // sees this completion or is woken. One ring per sleep: the flag is taken back
    // before the ring (the client sets it again before it sleeps again), so the
    // completions posted while it wakes up ring no more doorbells.
    // A client waiting for a count (kWaitCount, kFeatureWakeCount) stored wake_at before
    // its flags: seeing the flags, this sees that wake_at. Until cq_tail reaches it the
    // flag stays, and a later completion rings.
    header->cq_tail.value.store(cq_tail, std::memory_order_seq_cst);
    std::atomic<uint32_t>& flags = header->client_flags.value;
    const uint32_t seen = flags.load(std::memory_order_seq_cst);
    if ((seen & fr::kWaiting) == 0) return;
    if ((seen & fr::kWaitCount) != 0 && wake_count &&
        static_cast<int32_t>(cq_tail - header->wake_at.value.load(std::memory_order_relaxed)) <
            0) {
      return;
    }
    if (flags.fetch_and(~fr::kWaiting, std::memory_order_seq_cst) & fr::kWaiting) {
      fr::RingDoorbell(complete_fd.get());
    }
  }

  // Whether the notifications refused for room fit now. False also when the client's
  // cq_head is impossible (set in *bad).
  bool RoomForRefused(bool* bad) ABSL_EXCLUSIVE_LOCKS_REQUIRED(cq_mu) {
    return Fits(room_wanted, bad);
  }

  // Posts the completion of a taken entry (its reservation is given back).
  void Post(const fr::CompletionHeader& completion, absl::string_view message) {
    absl::MutexLock lock(&cq_mu);
    --reserved;
    if (closed.load(std::memory_order_acquire)) return;
    char* at = this->completion(cq_tail);
    fr::CompletionHeader h = completion;
    h.span = 1;
    const std::string text = BoundedErrorText(std::string_view(message.data(), message.size()),
                                              fr::kMaxMessage, "GetTransfer");
    h.message_length = static_cast<uint32_t>(text.size());
    std::memcpy(at, &h, sizeof(h));
    std::memcpy(at + sizeof(h), text.data(), text.size());
    ++cq_tail;
    PublishLocked();
  }

  // Posts the refusal `why` of the entry `completion` answers.
  void Refuse(fr::CompletionHeader completion, const absl::Status& why) {
    completion.code = static_cast<int32_t>(why.code());
    Post(completion, why.message());
  }

  // Posts a submit's or cancel's completion: the refusal, or the transfer's state (read
  // in place: the five fields a completion holds).
  void Finish(fr::CompletionHeader completion, const absl::Status& refused,
              const v1::TransferState& state) {
    if (!refused.ok()) return Refuse(completion, refused);
    completion.code = state.error_code();
    completion.phase = static_cast<uint32_t>(state.phase());
    completion.bytes_done = state.bytes_done();
    completion.latency_us = state.latency_us();
    Post(completion, state.error_message());
  }

  // Published slots not taken yet, and whether the next entry can be taken now.
  bool Ready() {
    const uint32_t available = header->sq_tail.value.load(std::memory_order_seq_cst) - sq_head;
    if (available == 0) return false;
    absl::MutexLock lock(&cq_mu);
    bool bad = false;
    return HasRoom(&bad) || bad || available > geometry.submission_slots;
  }
};

namespace {

// kRoomWanted is set while a ring holds notifications back for room: a client that
// reaps then rings the submission doorbell of a sleeping agent.
void MarkRoomWanted(FastPathServer::Ring& ring, bool wanted) {
  std::atomic<uint32_t>& flags = ring.header->agent_flags.value;
  if (wanted) {
    flags.fetch_or(fr::kRoomWanted, std::memory_order_seq_cst);
  } else {
    flags.fetch_and(~fr::kRoomWanted, std::memory_order_seq_cst);
  }
}

// Where a completion of `span` entries goes: after `*pad` entries of kPad when fewer
// than `span` are left before the ring's end. True when both fit beside the unreaped
// completions and the reserved room (false also for an impossible cq_head: *bad).
bool PlaceLocked(FastPathServer::Ring& ring, uint32_t span, uint32_t* pad, bool* bad)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(ring.cq_mu) {
  const uint32_t entries = ring.geometry.completion_entries;
  const uint32_t to_end = entries - (ring.cq_tail & (entries - 1));
  *pad = to_end < span ? to_end : 0;
  return ring.Fits(uint64_t{*pad} + span, bad);
}

// The ring refuses notifications until `need` entries are free: the taking thread
// offers them again once the client reaped (an impossible cq_head is found there, and
// the ring closed).
void WantRoomLocked(FastPathServer::Ring& ring, uint32_t need)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(ring.cq_mu) {
  ring.room_wanted = need;
  ring.refused_for_room.store(true, std::memory_order_release);
  MarkRoomWanted(ring, true);
}

// Writes `pad` entries of kPad, then `h` (its span and message_length set) with its
// body written by `fill` after the header. Publishing is the caller's.
void WriteSpanLocked(FastPathServer::Ring& ring, const fr::CompletionHeader& h, uint32_t pad,
                     absl::FunctionRef<void(char*)> fill) ABSL_EXCLUSIVE_LOCKS_REQUIRED(ring.cq_mu) {
  if (pad != 0) {
    fr::CompletionHeader p{};
    p.opcode = fr::kPad;
    p.span = static_cast<uint16_t>(pad);
    std::memcpy(ring.completion(ring.cq_tail), &p, sizeof(p));
    ring.cq_tail += pad;
  }
  char* at = ring.completion(ring.cq_tail);
  std::memcpy(at, &h, sizeof(h));
  fill(at + sizeof(h));
  ring.cq_tail += h.span;
}

// Writes a durable watch's pending notifications while they fit, in order, counting
// each in `posted` (refusals of too large ones not) before the lock is let go: Close
// (under the same lock) then finds every written one counted.
void FlushPendingLocked(FastPathServer::Ring& ring, std::atomic<uint64_t>& posted)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(ring.cq_mu) {
  bool wrote = false;
  while (!ring.pending.empty() && !ring.holding && ring.room_wanted == 0) {
    const FastPathServer::Ring::Pending& p = ring.pending.front();
    uint32_t pad = 0;
    bool bad = false;
    if (!PlaceLocked(ring, p.header.span, &pad, &bad)) {
      WantRoomLocked(ring, pad + p.header.span);
      break;
    }
    WriteSpanLocked(ring, p.header, pad,
                    [&](char* at) { std::memcpy(at, p.body.data(), p.body.size()); });
    if (p.header.code == 0) posted.fetch_add(1, std::memory_order_relaxed);
    wrote = true;
    ring.pending.pop_front();
  }
  if (wrote) ring.PublishLocked();
}

// The header of a kNotification completion of `note`, serialized in `bytes`.
fr::CompletionHeader NotificationHeader(const v1::Notification& note, uint64_t user_data,
                                        size_t bytes) {
  fr::CompletionHeader h{};
  h.user_data = user_data;
  h.opcode = fr::kNotification;
  h.span = static_cast<uint16_t>(fr::SpanFor(bytes));
  h.phase = static_cast<uint32_t>(note.kind());
  h.bytes_done = note.bytes();
  h.message_length = static_cast<uint32_t>(bytes);
  return h;
}

// Parses an entry's payload into `out`; INVALID_ARGUMENT "<what>: the payload is not
// <a_type>: <why>" when it does not parse.
absl::Status ParseEntry(std::string_view payload, std::string_view what, std::string_view a_type,
                        google::protobuf::MessageLite* out) {
  if (out->ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
    return absl::OkStatus();
  }
  const std::string_view type = a_type.substr(a_type.find(' ') + 1);
  return absl::InvalidArgumentError(
      fmt::format("{}: the payload is not {}: {}", what, a_type,
                  client::DescribeParseFailure(payload, std::string(type))));
}

// A notification spanning more than half the ring: counted, logged once per ring.
void NoteTooLarge(FastPathServer::Ring& ring, std::atomic<uint64_t>& counter, size_t bytes,
                  uint32_t span, std::string_view fate) {
  counter.fetch_add(1, std::memory_order_relaxed);
  if (!ring.too_large_logged.exchange(true)) {
    kLog.Warn(
        "{}: a notification of {} bytes spans {} completion entries, more than half of this "
        "fast path's {}: {} (logged once per ring; open the ring with more completion_entries, "
        "or take large notifications through gRPC)",
        ring.caller.principal, bytes, span, ring.geometry.completion_entries, fate);
  }
}

}  // namespace

FastPathServer::FastPathServer(FastPathOptions options, FastPathBackend backend)
    : options_(options),
      backend_(std::move(backend)),
      features_(options.features & fr::kFeatures) {
  epoll_fd_.reset(epoll_create1(EPOLL_CLOEXEC));
  wake_fd_.reset(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.u64 = 0;  // session ids start at 1
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, wake_fd_.get(), &event);
}

FastPathServer::~FastPathServer() {
  Stop();
  // The queue outlives the server: no subscriber may call into it after this.
  for (const auto& ring : Snapshot()) Unwatch(*ring);
}

void FastPathServer::Start(transport::UcxWorker* worker) {
  if (worker != nullptr) {
    worker_ = worker;
    worker_->SetPoller(this);
    return;
  }
  thread_ = std::thread([this] { Run(); });
}

void FastPathServer::Stop() {
  if (stopping_.exchange(true)) return;
  fr::RingDoorbell(wake_fd_.get());
  if (thread_.joinable()) thread_.join();
  if (worker_ != nullptr) worker_->SetPoller(nullptr);
}

FastPathCounters FastPathServer::counters() const {
  FastPathCounters c;
  {
    absl::MutexLock lock(&mu_);
    c.rings = rings_.size();
  }
  c.entries = entries_.load(std::memory_order_relaxed);
  c.protocol_errors = protocol_errors_.load(std::memory_order_relaxed);
  c.notifications = notifications_.load(std::memory_order_relaxed);
  c.notifications_too_large = notifications_too_large_.load(std::memory_order_relaxed);
  c.acks = acks_.load(std::memory_order_relaxed);
  c.pending_dropped = pending_dropped_.load(std::memory_order_relaxed);
  c.closed_by_request = closed_by_request_.load(std::memory_order_relaxed);
  return c;
}

absl::StatusOr<v1::FastPathInfo> FastPathServer::Open(uint64_t session_id, const Caller& caller,
                                                      const v1::OpenFastPathRequest& request,
                                                      std::vector<UniqueFd>* fds) {
  if (absl::Status role = CheckRole(caller, Need::kEngineOrScheduler, "OpenFastPath");
      !role.ok()) {
    return role;
  }
  if (stopping_.load()) {
    return absl::UnavailableError("the agent is shutting down; the fast path takes no new rings");
  }
  {
    absl::MutexLock lock(&mu_);
    if (rings_.contains(session_id)) {
      return absl::FailedPreconditionError(fmt::format(
          "session {} already has a fast path open (one per session); use it, or attach "
          "another session for another ring",
          session_id));
    }
  }
  absl::StatusOr<fr::Geometry> geometry =
      fr::Layout(request.submission_slots(), request.completion_entries());
  if (!geometry.ok()) return geometry.status();

  auto ring = std::make_shared<Ring>();
  ring->session_id = session_id;
  ring->caller = caller;
  ring->geometry = *geometry;
  ring->wake_count = (features_ & fr::kFeatureWakeCount) != 0;
  ring->memfd.reset(memfd_create("kvagent-fast-path", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!ring->memfd) return Errno("memfd_create");
  if (ftruncate(ring->memfd.get(), static_cast<off_t>(geometry->ring_bytes)) != 0) {
    return Errno("ftruncate of the ring file");
  }
  // The client maps the same file: it must not be able to shrink it under us (SIGBUS).
  if (fcntl(ring->memfd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return Errno("sealing the ring file");
  }
  void* base = mmap(nullptr, geometry->ring_bytes, PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_POPULATE, ring->memfd.get(), 0);
  if (base == MAP_FAILED) return Errno("mmap of the ring file");
  ring->base = static_cast<char*>(base);
  ring->header = new (base) fr::RingHeader();
  ring->header->magic = fr::kMagic;
  ring->header->version = fr::kVersion;
  ring->header->submission_slots = geometry->submission_slots;
  ring->header->slot_bytes = fr::kSlotBytes;
  ring->header->completion_entries = geometry->completion_entries;
  ring->header->completion_bytes = fr::kCompletionBytes;
  ring->header->submission_offset = geometry->submission_offset;
  ring->header->completion_offset = geometry->completion_offset;
  ring->header->ring_bytes = geometry->ring_bytes;
  ring->submit_fd.reset(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  ring->complete_fd.reset(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!ring->submit_fd || !ring->complete_fd) return Errno("eventfd");

  std::vector<UniqueFd> out;
  for (int fd : {ring->memfd.get(), ring->submit_fd.get(), ring->complete_fd.get()}) {
    UniqueFd copy(fcntl(fd, F_DUPFD_CLOEXEC, 0));
    if (!copy) return Errno("dup of a ring descriptor");
    out.push_back(std::move(copy));
  }
  {
    absl::MutexLock lock(&mu_);
    if (rings_.contains(session_id)) {
      return absl::FailedPreconditionError(
          fmt::format("session {} already has a fast path open (one per session)", session_id));
    }
    epoll_event event{};
    event.events = EPOLLIN;
    event.data.u64 = session_id;
    if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, ring->submit_fd.get(), &event) != 0) {
      return Errno("epoll_ctl");
    }
    rings_[session_id] = ring;
  }
  generation_.fetch_add(1);
  fr::RingDoorbell(wake_fd_.get());
  *fds = std::move(out);

  v1::FastPathInfo info;
  info.set_version(fr::kVersion);
  info.set_ring_bytes(geometry->ring_bytes);
  info.set_submission_slots(geometry->submission_slots);
  info.set_slot_bytes(fr::kSlotBytes);
  info.set_completion_entries(geometry->completion_entries);
  info.set_completion_bytes(fr::kCompletionBytes);
  info.set_submission_offset(geometry->submission_offset);
  info.set_completion_offset(geometry->completion_offset);
  info.set_spin_us(options_.spin_us);
  info.set_features(features_);
  kLog.Info("{}: fast path open ({} submission slots, {} completions, {} bytes)",
            caller.principal, geometry->submission_slots, geometry->completion_entries,
            geometry->ring_bytes);
  return info;
}

void FastPathServer::Close(uint64_t session_id) {
  std::shared_ptr<Ring> ring;
  {
    absl::MutexLock lock(&mu_);
    auto it = rings_.find(session_id);
    if (it == rings_.end()) return;
    ring = std::move(it->second);
    rings_.erase(it);
    epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, ring->submit_fd.get(), nullptr);
  }
  {
    absl::MutexLock lock(&ring->cq_mu);
    ring->closed.store(true, std::memory_order_release);
  }
  Unwatch(*ring);
  ring->header->agent_flags.value.fetch_or(fr::kClosed);
  generation_.fetch_add(1);
  fr::RingDoorbell(wake_fd_.get());
}

absl::StatusOr<v1::FastPathClosed> FastPathServer::CloseOnRequest(uint64_t session_id) {
  std::shared_ptr<Ring> ring;
  {
    absl::MutexLock lock(&mu_);
    auto it = rings_.find(session_id);
    if (it != rings_.end()) ring = it->second;
  }
  if (ring == nullptr) {
    return absl::FailedPreconditionError(fmt::format(
        "close_fast_path: session {} has no fast path open (never opened, already closed, or "
        "closed by the agent); nothing to close: open one with open_fast_path",
        session_id));
  }
  // The watch ends before the ring closes, so that nothing more is written on a ring the
  // client is about to unmap: notifications not yet written stay with the queue (or the
  // subscription). A watch put in place meanwhile is ended by Close below.
  Unwatch(*ring);
  v1::FastPathClosed closed;
  {
    absl::MutexLock lock(&ring->cq_mu);
    if (ring->closed.load(std::memory_order_acquire)) {
      // Broken by the client meanwhile: that close stands, with its reason.
      return absl::FailedPreconditionError(fmt::format(
          "close_fast_path: session {}'s fast path was closed by the agent meanwhile (see the "
          "reason in the ring file); nothing to close: open a new one with open_fast_path",
          session_id));
    }
    ring->closed.store(true, std::memory_order_release);
    static_assert(sizeof(kClosedByRequest) <= fr::kReasonBytes);
    std::memcpy(ring->base + fr::kReasonOffset, kClosedByRequest, sizeof(kClosedByRequest));
    // Posts check `closed` under cq_mu: cq_tail is final from here on.
    closed.set_transfers_running(ring->reserved);
    closed.set_completion_tail(ring->cq_tail);
  }
  closed_by_request_.fetch_add(1, std::memory_order_relaxed);
  Close(session_id);  // sets kClosed; the transfers keep the ring's memory until they end
  fr::RingDoorbell(ring->complete_fd.get());  // a waiting client reads the reason
  kLog.Info("{}: fast path closed by the session's request ({} transfers still running, "
            "their completions dropped)",
            ring->caller.principal, closed.transfers_running());
  return closed;
}

void FastPathServer::Unwatch(Ring& ring) {
  uint64_t token = 0;
  {
    absl::MutexLock lock(&ring.cq_mu);
    std::swap(token, ring.watch_token);
  }
  if (token != 0) backend_.notifications->Unsubscribe(token);
  // No more deliveries: what waited for room is still held by the subscription.
  absl::MutexLock lock(&ring.cq_mu);
  ring.pending.clear();
}

void FastPathServer::Watch(const std::shared_ptr<Ring>& ring, uint64_t user_data,
                           std::string_view payload) {
  fr::CompletionHeader completion{};
  completion.user_data = user_data;
  completion.opcode = fr::kWatchNotifications;
  auto refuse = [&](const absl::Status& why) { ring->Refuse(completion, why); };
  if (backend_.notifications == nullptr) {
    return refuse(absl::UnimplementedError(fmt::format(
        "watch-notifications entry {}: this agent's fast path delivers no notifications; "
        "take them with gRPC WatchNotifications or PollNotifications",
        user_data)));
  }
  const std::string what = fmt::format("watch-notifications entry {}", user_data);
  v1::WatchNotificationsRequest request;
  if (absl::Status parsed = ParseEntry(payload, what, "a WatchNotificationsRequest", &request);
      !parsed.ok()) {
    return refuse(parsed);
  }
  const bool durable = !request.subscription().empty();
  if (durable && (features_ & fr::kFeatureDurableNotifications) == 0) {
    return refuse(absl::InvalidArgumentError(fmt::format(
        "{}: WatchNotificationsRequest.subscription is set ('{}'); this agent's fast path has "
        "no durable subscriptions (FastPathInfo.features lacks them): leave it empty on the "
        "fast path, or use WatchNotifications/PollNotifications with a subscription",
        what, Printable(request.subscription(), 80))));
  }
  if (durable) {
    if (absl::Status named = CheckSubscriptionName(request.subscription()); !named.ok()) {
      return refuse(absl::InvalidArgumentError(fmt::format("{}: {}", what, named.message())));
    }
  }
  if (absl::Status ids = CheckFilterTransferIds(what, request.transfer_ids_size()); !ids.ok()) {
    return refuse(ids);
  }
  if (absl::Status role = CheckRole(ring->caller, Need::kAny, "WatchNotifications"); !role.ok()) {
    return refuse(role);
  }
  if (ring->watching) {
    return refuse(absl::FailedPreconditionError(fmt::format(
        "watch-notifications entry {}: this ring already watches notifications (entry "
        "user_data {}); a ring has one watch: filter on the completions' transfer ids, or "
        "open another session's ring for another watch",
        user_data, ring->watch_user_data)));
  }
  NotificationFilter filter{NotificationReader{ring->caller.principal, ring->caller.scheduler},
                            {request.transfer_ids().begin(), request.transfer_ids().end()}};
  if (durable) {
    absl::Status attached =
        AttachDurable(ring, user_data, request.subscription(), std::move(filter));
    if (!attached.ok()) {
      return refuse(absl::Status(attached.code(), fmt::format("{}: {}", what, attached.message())));
    }
    return;
  }
  ring->watching = true;
  ring->watch_user_data = user_data;
  // In place before the first notification is posted: the answer comes first.
  ring->Post(completion, "");
  const uint64_t token = backend_.notifications->Subscribe(
      [this, ring, filter = std::move(filter), user_data](const QueuedNotification& n) {
        return filter.Matches(n) && OfferNotification(*ring, n, user_data);
      });
  bool closed = false;
  {
    absl::MutexLock lock(&ring->cq_mu);
    closed = ring->closed.load(std::memory_order_acquire);
    if (!closed) ring->watch_token = token;
  }
  // Closed meanwhile: Close found no token to end.
  if (closed) backend_.notifications->Unsubscribe(token);
}

absl::Status FastPathServer::AttachDurable(const std::shared_ptr<Ring>& ring, uint64_t user_data,
                                          const std::string& subscription,
                                          NotificationFilter filter) {
  {
    // Until the watch's answer is posted (it comes first), deliveries only queue up.
    absl::MutexLock lock(&ring->cq_mu);
    ring->durable = true;
    ring->holding = true;
    ring->pending_cap = backend_.notifications->in_flight_per_subscription();
  }
  ring->subscription = subscription;  // read by deliveries, which the Attach orders after
  // gRPC WatchNotifications' rules: the caller's durable identity owns the subscription,
  // the subscriptions limit, the held ones again first, a newer attachment replaces this.
  absl::StatusOr<uint64_t> token = backend_.notifications->Attach(
      SubscriptionKey{ring->caller.durable_identity, subscription}, std::move(filter),
      [this, ring, user_data](const QueuedNotification& n) {
        DeliverDurable(*ring, n, user_data);
        return true;  // taken: the subscription holds it until acknowledged
      },
      [ring] {
        // A newer attachment (ring or gRPC stream) took the subscription over, which
        // hands it every notification held unacknowledged: written here too, the ones
        // not written yet would come twice. (Under the queue's lock, as deliveries.)
        absl::MutexLock lock(&ring->cq_mu);
        if (!ring->pending.empty()) {
          kLog.Info("{}: subscription '{}' was attached again; this fast path ring drops "
                    "the {} notifications it had not written yet (the newer attachment gets "
                    "them)",
                    ring->caller.principal, Printable(ring->subscription, 80),
                    ring->pending.size());
        }
        ring->pending.clear();
      });
  if (!token.ok()) {
    absl::MutexLock lock(&ring->cq_mu);
    ring->durable = false;
    ring->holding = false;
    ring->pending.clear();
    return token.status();
  }
  ring->watching = true;
  ring->watch_user_data = user_data;
  fr::CompletionHeader completion{};
  completion.user_data = user_data;
  completion.opcode = fr::kWatchNotifications;
  ring->Post(completion, "");
  bool closed = false;
  {
    absl::MutexLock lock(&ring->cq_mu);
    ring->holding = false;
    closed = ring->closed.load(std::memory_order_acquire);
    if (!closed) {
      ring->watch_token = *token;
      FlushPendingLocked(*ring, notifications_);
    }
  }
  // Closed meanwhile: Close found no token to end (Unwatch dropped the pending ones).
  if (closed) {
    backend_.notifications->Unsubscribe(*token);
    absl::MutexLock lock(&ring->cq_mu);
    ring->pending.clear();
  }
  return absl::OkStatus();
}

void FastPathServer::DeliverDurable(Ring& ring, const QueuedNotification& n, uint64_t user_data) {
  const v1::Notification& note = n.notification;
  const size_t bytes = note.ByteSizeLong();
  Ring::Pending p;
  p.sequence = note.sequence();
  p.header = NotificationHeader(note, user_data, bytes);
  const uint32_t span = fr::SpanFor(bytes);
  const uint32_t entries = ring.geometry.completion_entries;
  if (span > fr::MaxSpan(entries)) {
    // It cannot come on this ring, and the subscription holds it: the client learns of it
    // in its place, and takes it through gRPC.
    NoteTooLarge(ring, notifications_too_large_, bytes, span,
                 "held by the subscription; the ring says so in its place");
    p.header.code = static_cast<int32_t>(absl::StatusCode::kResourceExhausted);
    p.header.phase = 0;  // no notification follows
    p.header.span = 1;
    p.body = BoundedErrorText(
        fmt::format("notification sequence {} (transfer {}, {} bytes serialized) spans {} "
                    "completion entries, more than half of this ring's {}: subscription '{}' "
                    "holds it unacknowledged; take it with gRPC PollNotifications on the "
                    "subscription (acknowledge it there or here), or open the ring with more "
                    "completion_entries",
                    note.sequence(), Printable(note.transfer_id(), 80), bytes, span, entries,
                    ring.subscription),
        fr::kMaxMessage, "gRPC PollNotifications of the subscription (the notification)");
    p.header.message_length = static_cast<uint32_t>(p.body.size());
  } else {
    p.body.resize(bytes);
    note.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(p.body.data()));
  }
  {
    absl::MutexLock lock(&ring.cq_mu);
    if (ring.closed.load(std::memory_order_acquire) || !ring.durable) return;
    // The subscription hands this attachment each held notification once, and holds at
    // most pending_cap: the list reaches it only when sequences not written yet were
    // acknowledged (gRPC AckNotifications of the same identity; this ring's own acks
    // prune the list). The oldest then goes (acknowledged, most likely; if not, still
    // held for the next attachment).
    if (ring.pending.size() >= ring.pending_cap) {
      ring.pending.pop_front();
      pending_dropped_.fetch_add(1, std::memory_order_relaxed);
    }
    ring.pending.push_back(std::move(p));
    FlushPendingLocked(ring, notifications_);
  }
}

void FastPathServer::Ack(const std::shared_ptr<Ring>& ring, uint64_t user_data,
                         std::string_view payload) {
  fr::CompletionHeader completion{};
  completion.user_data = user_data;
  completion.opcode = fr::kAckNotifications;
  auto refuse = [&](const absl::Status& why) { ring->Refuse(completion, why); };
  const std::string what = fmt::format("ack-notifications entry {}", user_data);
  if (backend_.notifications == nullptr) {
    return refuse(absl::UnimplementedError(fmt::format(
        "{}: this agent's fast path delivers no notifications; acknowledge with gRPC "
        "AckNotifications",
        what)));
  }
  v1::AckNotificationsRequest request;
  if (absl::Status parsed = ParseEntry(payload, what, "an AckNotificationsRequest", &request);
      !parsed.ok()) {
    return refuse(parsed);
  }
  if (absl::Status listed = CheckAckSequences(what, request.sequences_size()); !listed.ok()) {
    return refuse(listed);
  }
  if (absl::Status role = CheckRole(ring->caller, Need::kAny, "AckNotifications"); !role.ok()) {
    return refuse(role);
  }
  const std::vector<uint64_t> sequences(request.sequences().begin(), request.sequences().end());
  // Only the caller's own subscription is found: the key is its durable identity.
  absl::StatusOr<uint64_t> released = backend_.notifications->Ack(
      SubscriptionKey{ring->caller.durable_identity, request.subscription()},
      request.through_sequence(), sequences);
  if (!released.ok()) {
    return refuse(
        absl::Status(released.status().code(),
                     fmt::format("{}: {}", what, released.status().message())));
  }
  if (*released > 0 && request.subscription() == ring->subscription) {
    // Acknowledged before this ring wrote them: they need not come any more.
    const absl::flat_hash_set<uint64_t> listed(sequences.begin(), sequences.end());
    absl::MutexLock lock(&ring->cq_mu);
    ring->pending.erase(std::remove_if(ring->pending.begin(), ring->pending.end(),
                                       [&](const Ring::Pending& p) {
                                         return p.sequence <= request.through_sequence() ||
                                                listed.contains(p.sequence);
                                       }),
                        ring->pending.end());
  }
  acks_.fetch_add(1, std::memory_order_relaxed);
  completion.bytes_done = *released;
  ring->Post(completion, "");
}

bool FastPathServer::OfferNotification(Ring& ring, const QueuedNotification& n,
                                       uint64_t user_data) {
  const v1::Notification& note = n.notification;
  const size_t bytes = note.ByteSizeLong();
  const uint32_t span = fr::SpanFor(bytes);
  const uint32_t entries = ring.geometry.completion_entries;
  if (span > fr::MaxSpan(entries)) {
    NoteTooLarge(ring, notifications_too_large_, bytes, span,
                 "left to gRPC WatchNotifications/PollNotifications");
    return false;
  }
  absl::MutexLock lock(&ring.cq_mu);
  if (ring.closed.load(std::memory_order_acquire) || ring.room_wanted != 0) return false;
  uint32_t pad = 0;
  bool bad = false;
  if (!PlaceLocked(ring, span, &pad, &bad)) {
    // Waits in the queue (for this ring once the client reaps, or another taker).
    WantRoomLocked(ring, pad + span);
    return false;
  }
  WriteSpanLocked(ring, NotificationHeader(note, user_data, bytes), pad, [&](char* at) {
    note.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(at));
  });
  ring.PublishLocked();
  notifications_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool FastPathServer::OfferAgain(Ring& ring) {
  bool room = false, bad = false, durable = false;
  uint64_t token = 0;
  {
    absl::MutexLock lock(&ring.cq_mu);
    room = ring.RoomForRefused(&bad);
    if (room) {
      ring.room_wanted = 0;
      ring.refused_for_room.store(false, std::memory_order_release);
      token = ring.watch_token;
      durable = ring.durable;
      if (durable) {
        // The ring holds what waits: written now, in order, as far as it fits (marked
        // again for the rest).
        MarkRoomWanted(ring, false);
        FlushPendingLocked(ring, notifications_);
      }
    }
  }
  if (bad) {
    Break(ring, absl::InvalidArgumentError(
                    "cq_head is past cq_tail (more completions reaped than posted); store in "
                    "cq_head only the count of completion entries read"));
    return false;
  }
  if (!room) return false;
  if (durable) return true;
  MarkRoomWanted(ring, false);
  // Refused again (not reaped enough yet): marked again, in order.
  if (token != 0) backend_.notifications->OfferQueued(token);
  return true;
}

void FastPathServer::Break(Ring& ring, const absl::Status& why) {
  const std::string reason = fmt::format(
      "the agent closed this fast path: the client broke the ring protocol: {}", why.message());
  {
    absl::MutexLock lock(&ring.cq_mu);
    // Once: a second look may find the same break (the entries' and the notifications'
    // room checks both read cq_head), and a ring the session closed is not broken.
    if (ring.closed.load(std::memory_order_acquire)) return;
    ring.closed.store(true, std::memory_order_release);
    // The reason, for the client to read (the bytes between the header and the slots).
    const std::string text = BoundedErrorText(reason, fr::kReasonBytes - 1);
    std::memcpy(ring.base + fr::kReasonOffset, text.c_str(), text.size() + 1);
  }
  protocol_errors_.fetch_add(1, std::memory_order_relaxed);
  kLog.Warn("{}: {}", ring.caller.principal, reason);
  Close(ring.session_id);  // sets kClosed
  fr::RingDoorbell(ring.complete_fd.get());  // a waiting client reads the reason
}

std::vector<std::shared_ptr<FastPathServer::Ring>> FastPathServer::Snapshot() {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Ring>> rings;
  rings.reserve(rings_.size());
  for (const auto& [id, ring] : rings_) rings.push_back(ring);
  return rings;
}

bool FastPathServer::Drain(const std::shared_ptr<Ring>& ring) {
  const uint32_t slots = ring->geometry.submission_slots;
  uint32_t available = ring->header->sq_tail.value.load(std::memory_order_acquire) - ring->sq_head;
  if (available == 0) return false;
  if (available > slots) {
    Break(*ring, absl::InvalidArgumentError(fmt::format(
                     "sq_tail is {} slots past sq_head, and the ring has {}; publish only "
                     "entries written into free slots",
                     available, slots)));
    return false;
  }
  bool took = false;
  for (uint32_t taken = 0; available > 0 && taken < kEntriesPerLook &&
                           !ring->closed.load(std::memory_order_acquire);
       ++taken) {
    const uint32_t index = ring->sq_head & (slots - 1);
    fr::SubmissionHeader header;
    std::memcpy(&header, ring->slot(index), sizeof(header));
    if (absl::Status ok = fr::CheckEntry(header, index, available, slots, features_); !ok.ok()) {
      Break(*ring, ok);
      return took;
    }
    // The entry's completion slot is reserved as it is taken (a pad has none).
    bool room = false, bad = false;
    {
      absl::MutexLock lock(&ring->cq_mu);
      room = ring->HasRoom(&bad);
      if (room && header.opcode != fr::kPad) ++ring->reserved;
    }
    if (bad) {
      Break(*ring, absl::InvalidArgumentError(
                       "cq_head is past cq_tail (more completions reaped than posted); store "
                       "in cq_head only the count of completions read"));
      return took;
    }
    if (!room) break;  // completions not reaped yet: the rest waits
    // Copied out before it is parsed: the client may change the slots meanwhile (into
    // the taking thread's buffer, whose storage the next entries reuse).
    payload_.assign(ring->slot(index) + sizeof(header), header.length);
    ring->sq_head += header.slots;
    available -= header.slots;
    ring->header->sq_head.value.store(ring->sq_head, std::memory_order_release);
    took = true;
    if (header.opcode == fr::kPad) continue;
    entries_.fetch_add(1, std::memory_order_relaxed);
    Handle(ring, header.opcode, header.user_data, payload_);
  }
  return took;
}

void FastPathServer::Handle(const std::shared_ptr<Ring>& ring, uint16_t opcode,
                            uint64_t user_data, std::string_view payload) {
  fr::CompletionHeader completion{};
  completion.user_data = user_data;
  completion.opcode = opcode;
  switch (opcode) {
    case fr::kPing:
      ring->Post(completion, "");
      return;
    case fr::kWatchNotifications:
      Watch(ring, user_data, payload);
      return;
    case fr::kAckNotifications:
      Ack(ring, user_data, payload);
      return;
    case fr::kCancel:
    {
      const absl::StatusOr<v1::TransferState> cancelled =
          backend_.cancel(std::string(payload), ring->caller);
      ring->Finish(completion, cancelled.status(),
                   cancelled.ok() ? *cancelled : v1::TransferState::default_instance());
      return;
    }
    case fr::kSubmit: {
      auto parsed = std::make_shared<ParsedSubmit>();
      const v1::SubmitTransferRequest& ref = *parsed->request;
      if (!parsed->request->ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
        completion.code = static_cast<int32_t>(absl::StatusCode::kInvalidArgument);
        ring->Post(completion,
                   fmt::format("submit entry {}: the payload is not a SubmitTransferRequest: {}",
                               user_data,
                               client::DescribeParseFailure(payload, "SubmitTransferRequest")));
        return;
      }
      backend_.submit(ref, ring->caller,
                      [ring, completion, parsed = std::move(parsed)](
                          const absl::Status& refused, const v1::TransferState& state) {
                        ring->Finish(completion, refused, state);
                      });
      return;
    }
  }
}

bool FastPathServer::Poll() {
  if (stopping_.load(std::memory_order_relaxed)) return false;
  if (const uint64_t now = generation_.load(); now != seen_) {
    polled_ = Snapshot();
    seen_ = now;
  }
  bool took = false;
  for (const auto& ring : polled_) {
    if (ring->closed.load(std::memory_order_acquire)) continue;
    took |= Drain(ring);
    if (ring->refused_for_room.load(std::memory_order_acquire) &&
        !ring->closed.load(std::memory_order_acquire)) {
      took |= OfferAgain(*ring);
    }
  }
  return took;
}

bool FastPathServer::PrepareSleep() {
  // Asleep: clients ring the doorbell from now on. Look once more after saying so (an
  // entry published just before would otherwise wait for idle_poll_ms). seq_cst RMW,
  // then seq_cst loads of the client's counters in Ready(): a client that stored
  // sq_tail or cq_head (seq_cst) before it read the flag is seen here, or it sees the
  // flag and rings.
  for (const auto& ring : polled_) {
    ring->header->agent_flags.value.fetch_or(fr::kSleeping, std::memory_order_seq_cst);
  }
  for (const auto& ring : polled_) {
    if (ring->closed.load(std::memory_order_acquire)) continue;
    if (ring->Ready()) return false;
    if (ring->refused_for_room.load(std::memory_order_acquire)) {
      absl::MutexLock lock(&ring->cq_mu);
      bool bad = false;
      if (ring->RoomForRefused(&bad) || bad) return false;
    }
  }
  return true;
}

void FastPathServer::Woke(bool rang) {
  // The doorbells that rang (level-triggered: each is read back to zero). Not looked
  // for when none did: the UCX thread wakes for much else, and this is a system call.
  epoll_event events[64];
  const int n = rang ? epoll_wait(epoll_fd_.get(), events, 64, 0) : 0;
  for (int i = 0; i < n; ++i) {
    if (events[i].data.u64 == 0) {
      fr::DrainDoorbell(wake_fd_.get());
      continue;
    }
    for (const auto& ring : polled_) {
      if (ring->session_id == events[i].data.u64) fr::DrainDoorbell(ring->submit_fd.get());
    }
  }
  for (const auto& ring : polled_) {
    ring->header->agent_flags.value.fetch_and(~fr::kSleeping);
  }
}

int FastPathServer::fd() const { return epoll_fd_.get(); }

int FastPathServer::SleepTimeoutMs() const {
  // With no ring open there is nothing to look at: sleep until Open or Stop rings.
  return polled_.empty() ? -1 : static_cast<int>(options_.idle_poll_ms);
}

uint32_t FastPathServer::spin_us() const { return options_.spin_us; }

void FastPathServer::Run() {
  pthread_setname_np(pthread_self(), "fast-path");
  const auto spin = std::chrono::microseconds(options_.spin_us);
  auto last_work = Clock::now();
  uint32_t spins = 0;
  while (!stopping_.load(std::memory_order_relaxed)) {
    if (Poll()) {
      last_work = Clock::now();
      spins = 0;
      continue;
    }
    // The clock is read every kSpinsPerClockRead idle looks, not at each (a vDSO
    // clock_gettime costs more than a look at the rings).
    if (options_.spin_us != 0 &&
        (++spins % kSpinsPerClockRead != 0 || Clock::now() - last_work < spin)) {
      fr::CpuRelax();
      continue;
    }
    bool rang = false;
    if (PrepareSleep()) {
      epoll_event event;
      // Woke() takes the doorbells back; this only waits for one.
      rang = epoll_wait(epoll_fd_.get(), &event, 1, SleepTimeoutMs()) > 0;
    }
    Woke(rang);
    last_work = Clock::now();
  }
}

}  // namespace kvagent::agent
