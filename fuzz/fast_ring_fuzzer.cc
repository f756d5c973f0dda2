// Fuzz target: the local fast path's ring (client/fast_ring.h) as the hostile input it
// is. A real FastPathServer (agent/fast_path.h) opens a ring for session 1 (an engine
// caller); the input (fuzz/fast_ring_input.proto) picks the ring's sizes and then acts
// as the client: entries honest or not, any bytes anywhere in the slots, any sq_tail,
// cq_head or client_flags, publishes with or without the doorbell, reaps. The backend
// parses nothing: it answers a submit at once, or holds its Done (a `wait` request)
// until a Release step or the end, so reservations of completion room stay taken. Its
// NotificationQueue is real (with a small in_flight_per_subscription and subscriptions
// limit): Notify steps push notifications (the session's or a stranger's, up to past
// half the largest ring) that a watching ring takes, once or through a durable
// subscription (a watch entry naming one; ack entries acknowledge).
//
// Whatever the input, the agent never crashes, and:
//   - with an honest cq_head, cq_tail is never more than completion_entries past it,
//     counting the completions the backend still holds (their room is reserved);
//   - every completion the agent wrote is well formed (message_length <= kMaxMessage,
//     a known opcode, span 1, codes and phases the backend can give); a notification
//     spans SpanFor(its bytes) <= MaxSpan entries without wrapping, parses, is the
//     session's (never a stranger's), carries its kind and bytes and a watch entry's
//     user_data, and a sequence only when a durable watch was written; on a durable
//     watch, one too large is a 1-entry RESOURCE_EXHAUSTED notification completion with
//     a message; an ack entry completes OK (released at most what was pushed),
//     NOT_FOUND or INVALID_ARGUMENT; a pad runs exactly to the ring's end, on a ring
//     that watches;
//   - once kClosed is set, the reason at kReasonOffset is NUL-terminated within
//     kReasonBytes and names the protocol break, protocol_errors is 1, and the agent
//     writes nothing more (cq_tail and sq_head stay where they were);
//   - an open ring never stalls: once the client reaps everything and the backend
//     answers, every published entry is taken (unless held completions reserve the
//     whole completion ring) and every taken entry completed
//     (completions of entries + completions still held == entries taken), and, when
//     the client was honest throughout, it read every notification posted by Close;
//   - Close(1) (or, when the input says so, CloseOnRequest(1): OK with the backend's
//     held completions as transfers_running, cq_tail as completion_tail and its reason
//     in the ring, or FAILED_PRECONDITION for a ring the client broke; a second one is
//     FAILED_PRECONDITION), a second Open of the session, and the server's destruction
//     succeed, and completions given and notifications pushed after them write nothing.
// Each input runs in milliseconds: the server polls every millisecond (idle_poll_ms 1,
// spin_us 5) and the harness waits only until the agent settles.

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "agent/access.h"
#include "agent/fast_path.h"
#include "agent/notification_queue.h"
#include "base/log.h"
#include "base/unique_fd.h"
#include "client/fast_ring.h"
#include "fuzz/fast_ring_input.pb.h"
#include "fuzz/fuzz_check.h"
#include "fuzz/fuzz_target.h"
#include "proto/kvagent.pb.h"

namespace kvagent::fuzz {
namespace {

namespace fr = client::fastring;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kSession = 1;
constexpr char kPrincipal[] = "session:1 uid:1000 pid:4242";
constexpr char kStranger[] = "session:2 uid:1001 pid:4343";
// Notifications' payloads: up to 24 KiB (49 entries: past half of even 64).
constexpr uint32_t kMaxNotifyPayload = 24 << 10;
// Ring sizes the input picks from: the default, powers of two, and refused sizes.
constexpr uint32_t kSizes[] = {0, 8, 16, 32, 64, 1024, 4096, 4, 12, 8192};
constexpr int kMaxSteps = 256;
// Steps after this are skipped (the final checks always run).
constexpr auto kInputBudget = std::chrono::milliseconds(300);
// The agent settled when nothing moved for this long (it polls every millisecond).
constexpr auto kQuiet = std::chrono::microseconds(3000);
constexpr auto kSettleMax = std::chrono::milliseconds(50);
// An open ring whose client reaps everything must drain within this: else a stall.
constexpr auto kDrainMax = std::chrono::seconds(5);

uint32_t PickSize(uint32_t index) { return kSizes[index % std::size(kSizes)]; }

agent::Caller EngineCaller() {
  agent::Caller caller;
  caller.door = agent::Door::kLocal;
  caller.principal = kPrincipal;
  caller.session_id = kSession;
  caller.uid = 1000;
  caller.durable_identity = "uid:1000 client:fuzz";
  caller.engine = true;
  return caller;
}

// What the backend answers for a submit: outcome (mod 4) completed, failed with the
// request's peer as the message, refused with its transfer_id as the message, or
// cancelled. Messages of any length and bytes reach the completion's cut.
absl::StatusOr<v1::TransferState> Outcome(const v1::SubmitTransferRequest& request,
                                          uint32_t outcome) {
  v1::TransferState state;
  state.set_transfer_id(request.transfer_id());
  switch (outcome % 4) {
    case 0:
      state.set_phase(v1::COMPLETED);
      state.set_bytes_done(request.ByteSizeLong());
      state.set_latency_us(request.timeout_ms());
      return state;
    case 1:
      state.set_phase(v1::FAILED);
      state.set_error_code(static_cast<int32_t>(absl::StatusCode::kInternal));
      state.set_error_message(request.peer());
      return state;
    case 2:
      return absl::InvalidArgumentError(request.transfer_id());
    default:
      state.set_phase(v1::CANCELLED);
      state.set_error_code(static_cast<int32_t>(absl::StatusCode::kCancelled));
      state.set_error_message("cancelled");
      return state;
  }
}

// Calls `done` with `outcome` (the refusal, or the state it lends).
void Answer(const agent::FastPathBackend::Done& done,
            const absl::StatusOr<v1::TransferState>& outcome) {
  done(outcome.status(), outcome.ok() ? *outcome : v1::TransferState::default_instance());
}

// The FastPathBackend: submits answered at once (by the request's chunk number) or,
// for `wait` requests, held until Release; cancels answered at once. Called on the
// server's thread; Release runs on the fuzzer's.
class Backend {
 public:
  Backend() {
    // Small, so that durable subscriptions hit their cap (the ring's pending list with
    // them) and the subscriptions limit.
    limits_.set(agent::Limit::kInFlightPerSubscription, 8);
    limits_.set(agent::Limit::kSubscriptions, 2);
  }

  agent::FastPathBackend Make() {
    agent::FastPathBackend backend;
    backend.submit = [this](const v1::SubmitTransferRequest& request, const agent::Caller& caller,
                            agent::FastPathBackend::Done done) {
      CheckCaller(caller, "submit");
      {
        absl::MutexLock lock(&mu_);
        if (request.wait() && !answer_all_) {
          held_.push_back({request, std::move(done)});
          return;
        }
      }
      Answer(done, Outcome(request, request.chunk()));
    };
    backend.notifications = &queue_;
    backend.cancel = [this](const std::string& transfer_id,
                            const agent::Caller& caller) -> absl::StatusOr<v1::TransferState> {
      CheckCaller(caller, "cancel");
      if (transfer_id.empty()) return absl::InvalidArgumentError("cancel: no transfer id");
      return absl::NotFoundError("cancel: no transfer '" + transfer_id + "'");
    };
    return backend;
  }

  // Gives `count` held completions (0: all), oldest first.
  void Release(uint32_t count, uint32_t outcome) {
    std::vector<Held> taken;
    {
      absl::MutexLock lock(&mu_);
      while (!held_.empty() && (count == 0 || taken.size() < count)) {
        taken.push_back(std::move(held_.front()));
        held_.pop_front();
      }
    }
    for (Held& h : taken) Answer(h.done, Outcome(h.request, outcome));
  }

  // From now on every submit is answered at once.
  void AnswerAll() {
    absl::MutexLock lock(&mu_);
    answer_all_ = true;
  }

  size_t held() {
    absl::MutexLock lock(&mu_);
    return held_.size();
  }

  uint64_t pushed() const { return pushed_; }

  // Pushes notifications as peers' transfers do; from_agent says whose they are.
  void Push(const Notify& n) {
    const uint32_t count = n.count() % 8 == 0 ? 1 : n.count() % 8;
    for (uint32_t i = 0; i < count; ++i) {
      agent::QueuedNotification q;
      q.notification.set_from_agent(n.stranger() ? "stranger" : "mine");
      q.notification.set_transfer_id(n.transfer_id().substr(0, 64));
      q.notification.set_kind(static_cast<v1::NotificationKind>(n.kind() % 8));
      q.notification.set_payload(std::string(n.payload_bytes() % kMaxNotifyPayload,
                                             static_cast<char>('a' + pushed_ % 26)));
      q.notification.set_bytes(pushed_++);
      q.owners.push_back(n.stranger() ? kStranger : kPrincipal);
      queue_.Push(std::move(q));
    }
  }

 private:
  struct Held {
    v1::SubmitTransferRequest request;
    agent::FastPathBackend::Done done;
  };

  static void CheckCaller(const agent::Caller& caller, const char* call) {
    FUZZ_CHECK(caller.engine && caller.session_id == kSession && caller.principal == kPrincipal,
               "{} came as '{}' (session {}), not as the ring's caller", call, caller.principal,
               caller.session_id);
  }

  absl::Mutex mu_;
  std::deque<Held> held_ ABSL_GUARDED_BY(mu_);
  bool answer_all_ ABSL_GUARDED_BY(mu_) = false;
  // Declared last: the server (made after the backend) is gone before it.
  agent::Limits limits_;
  agent::NotificationQueue queue_{&limits_};
  uint64_t pushed_ = 0;  // the fuzzer's thread's
};

// The client's side of one ring: its own mapping of the ring file.
class Client {
 public:
  Client(agent::FastPathServer* server, Backend* backend, const v1::FastPathInfo& info,
         std::vector<UniqueFd> fds)
      : server_(server),
        backend_(backend),
        info_(info),
        memfd_(std::move(fds[0])),
        submit_fd_(std::move(fds[1])),
        complete_fd_(std::move(fds[2])),
        slots_(info.submission_slots()),
        completions_(info.completion_entries()) {
    struct stat st {};
    FUZZ_CHECK(
        fstat(memfd_.get(), &st) == 0 && static_cast<uint64_t>(st.st_size) == info.ring_bytes(),
        "the ring file is not {} bytes", info.ring_bytes());
    void* base =
        mmap(nullptr, info.ring_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, memfd_.get(), 0);
    FUZZ_CHECK(base != MAP_FAILED, "mmap of the ring file: {}", std::strerror(errno));
    base_ = static_cast<char*>(base);
    header_ = reinterpret_cast<fr::RingHeader*>(base_);
    FUZZ_CHECK(header_->magic == fr::kMagic && header_->version == fr::kVersion &&
                   header_->submission_slots == slots_ &&
                   header_->completion_entries == completions_ &&
                   header_->slot_bytes == fr::kSlotBytes &&
                   header_->completion_bytes == fr::kCompletionBytes &&
                   header_->submission_offset == info.submission_offset() &&
                   header_->completion_offset == info.completion_offset() &&
                   header_->ring_bytes == info.ring_bytes(),
               "the ring's header does not match OpenFastPath's answer");
  }
  ~Client() { munmap(base_, info_.ring_bytes()); }

  void Do(const Step& step) {
    switch (step.step_case()) {
      case Step::kEntry:
        WriteEntry(step.entry());
        break;
      case Step::kBytes:
        WriteBytes(step.bytes());
        break;
      case Step::kSqTail:
        header_->sq_tail.value.store(Apply(step.sq_tail(), header_->sq_tail.value.load()),
                                     std::memory_order_release);
        break;
      case Step::kCqHead:
        cq_head_ = Apply(step.cq_head(), cq_head_);
        honest_ = always_honest_ = false;
        header_->cq_head.value.store(cq_head_, std::memory_order_release);
        break;
      case Step::kClientFlags:
        header_->client_flags.value.store(
            Apply(step.client_flags(), header_->client_flags.value.load()),
            std::memory_order_release);
        break;
      case Step::kWakeAt:
        header_->wake_at.value.store(Apply(step.wake_at(), header_->wake_at.value.load()),
                                     std::memory_order_release);
        break;
      case Step::kCursor:
        cursor_ = Apply(step.cursor(), cursor_);
        break;
      case Step::kPublish:
        header_->sq_tail.value.store(cursor_, std::memory_order_release);
        std::atomic_thread_fence(std::memory_order_seq_cst);
        if (step.publish().doorbell()) {
          const uint64_t one = 1;
          [[maybe_unused]] ssize_t n = ::write(submit_fd_.get(), &one, sizeof(one));
        }
        if (!step.publish().no_wait()) Settle();
        break;
      case Step::kReap:
        Reap(step.reap().max());
        break;
      case Step::kRelease:
        backend_->Release(step.release().count(), step.release().outcome());
        break;
      case Step::kNotify:
        backend_->Push(step.notify());
        break;
      case Step::STEP_NOT_SET:
        break;
    }
    Observe();
  }

  // The end of the input: the backend answers everything, the client reaps
  // everything; an open ring must then drain completely.
  void Finish(bool release_held) {
    backend_->AnswerAll();
    const auto deadline = Clock::now() + kDrainMax;
    for (;;) {
      if (release_held) backend_->Release(0, 0);
      const uint32_t flags = Observe();
      if (flags & fr::kClosed) break;
      // Reap all (an honest client again from here: see ResyncHead).
      ResyncHead();
      const uint32_t sq_tail = header_->sq_tail.value.load(std::memory_order_acquire);
      const uint32_t sq_head = header_->sq_head.value.load(std::memory_order_acquire);
      const uint32_t cq_tail = header_->cq_tail.value.load(std::memory_order_acquire);
      const uint64_t entries = server_->counters().entries;
      const size_t held = backend_->held();
      // Held transfers that reserve every completion entry (held_until 1 or 2 keeps
      // them past this point) leave the rest of the published entries untaken: the
      // agent takes an entry only when its completion has room.
      const bool room_reserved = held >= completions_;
      if ((sq_head == sq_tail || room_reserved) && Answered(cq_tail, held, entries) &&
          (flags & fr::kSleeping)) {
        break;
      }
      FUZZ_CHECK(Clock::now() < deadline,
                 "the ring stalled: sq_head {} sq_tail {} cq_tail {} cq_head {}, {} entries taken, "
                 "{} completions held, agent_flags {:#x}, protocol_errors {}",
                 sq_head, sq_tail, cq_tail, cq_head_, entries, held, flags,
                 server_->counters().protocol_errors);
      std::this_thread::yield();
    }
    const agent::FastPathCounters counters = server_->counters();
    const uint32_t flags = Observe();
    if (flags & fr::kClosed) {
      FUZZ_CHECK(counters.protocol_errors == 1, "closed ring, {} protocol errors",
                 counters.protocol_errors);
    } else {
      FUZZ_CHECK(counters.protocol_errors == 0 && counters.rings == 1,
                 "open ring, {} protocol errors, {} rings", counters.protocol_errors,
                 counters.rings);
      FUZZ_CHECK(Answered(header_->cq_tail.value.load(), backend_->held(), counters.entries),
                 "{} entries taken, {} completion entries posted ({} read of entries, {} "
                 "notifications, {} posted), {} held",
                 counters.entries, header_->cq_tail.value.load(), entry_completions_,
                 notifications_read_, counters.notifications, backend_->held());
    }
    CheckAllCompletions();
  }

  // The session ended (Close): the ring must say closed and the agent writes nothing
  // more into it, even when held completions come now.
  void AfterClose() {
    const uint32_t flags = header_->agent_flags.value.load(std::memory_order_acquire);
    FUZZ_CHECK(flags & fr::kClosed, "Close(1) left agent_flags {:#x}", flags);
    if (always_honest_) {
      // Nothing is posted after Close: an honest client reads every notification that
      // was (some may have come after Finish: offered again once it reaped).
      ResyncHead();
      FUZZ_CHECK(notifications_read_ == server_->counters().notifications,
                 "{} notifications posted, {} read by an honest client",
                 server_->counters().notifications, notifications_read_);
    }
    frozen_cq_tail_ = header_->cq_tail.value.load(std::memory_order_acquire);
    frozen_sq_head_ = header_->sq_head.value.load(std::memory_order_acquire);
    frozen_ = true;
  }

  // The session's close_fast_path request answered `closed`: the ring says why, and
  // the answer's completion_tail is where the agent stopped writing.
  void ClosedByRequest(const v1::FastPathClosed& closed) {
    const uint32_t cq_tail = header_->cq_tail.value.load(std::memory_order_acquire);
    FUZZ_CHECK(closed.completion_tail() == cq_tail,
               "close_fast_path answered completion_tail {}, the ring's cq_tail is {}",
               closed.completion_tail(), cq_tail);
    const char* reason = base_ + fr::kReasonOffset;
    FUZZ_CHECK(std::memchr(reason, '\0', fr::kReasonBytes) != nullptr &&
                   std::string(reason) ==
                       "the agent closed this fast path: closed by the session's "
                       "close_fast_path request",
               "the close reason after close_fast_path is '{}'",
               std::string(reason, strnlen(reason, fr::kReasonBytes)));
  }

  // The server is about to be destroyed.
  void ServerGone() {
    notifications_posted_ = server_->counters().notifications;
    server_ = nullptr;
  }

  // What the run came to (KVAGENT_FUZZ_TRACE=1): for writing seeds that reach what
  // they mean to.
  void Trace(int steps) {
    const agent::FastPathCounters c = server_->counters();
    const uint32_t flags = header_->agent_flags.value.load();
    std::fprintf(
        stderr,
        "fast_ring: %u slots, %u completions, %d steps: sq_tail %u sq_head %u cq_tail %u "
        "cq_head %u, %llu entries, %zu held, %llu protocol errors, %llu notifications (%llu "
        "read, %llu too large)%s%s\n",
        slots_, completions_, steps, header_->sq_tail.value.load(), header_->sq_head.value.load(),
        header_->cq_tail.value.load(), cq_head_, static_cast<unsigned long long>(c.entries),
        backend_->held(), static_cast<unsigned long long>(c.protocol_errors),
        static_cast<unsigned long long>(c.notifications),
        static_cast<unsigned long long>(notifications_read_),
        static_cast<unsigned long long>(c.notifications_too_large),
        (flags & fr::kClosed) ? ": " : "", (flags & fr::kClosed) ? base_ + fr::kReasonOffset : "");
  }

  void CheckFrozen(bool completions = true) {
    const uint32_t cq_tail = header_->cq_tail.value.load(std::memory_order_acquire);
    const uint32_t sq_head = header_->sq_head.value.load(std::memory_order_acquire);
    FUZZ_CHECK(cq_tail == frozen_cq_tail_ && sq_head == frozen_sq_head_,
               "the agent wrote into a closed ring: cq_tail {} -> {}, sq_head {} -> {}",
               frozen_cq_tail_, cq_tail, frozen_sq_head_, sq_head);
    if (completions) CheckAllCompletions();
  }

 private:
  static uint32_t Apply(const SetCounter& set, uint32_t current) {
    return set.relative() ? current + set.value() : set.value();
  }

  uint64_t area() const { return uint64_t{slots_} * fr::kSlotBytes; }
  char* slots_base() const { return base_ + info_.submission_offset(); }

  // Copies `bytes` to `offset` of the submission slots, cut at their end: the client
  // may write anything there, but not the header, the reason or the completions (the
  // checks read those).
  void Put(uint64_t offset, const void* bytes, size_t size) {
    if (offset >= area()) return;
    const size_t n = static_cast<size_t>(std::min<uint64_t>(size, area() - offset));
    std::memcpy(slots_base() + offset, bytes, n);
  }

  uint64_t NotificationsPosted() const {
    return server_ != nullptr ? server_->counters().notifications : notifications_posted_;
  }

  // Every taken entry answered: without notifications each completion is one entry's;
  // with them, an honest client counted the completions of entries it read.
  bool Answered(uint32_t cq_tail, size_t held, uint64_t entries) {
    const agent::FastPathCounters counters = server_->counters();
    if (counters.notifications == 0 && counters.notifications_too_large == 0) {
      return cq_tail + held == entries;
    }
    if (always_honest_) return entry_completions_ + held == entries;
    return uint64_t{cq_tail} + held >= entries;
  }

  void WriteEntry(const Entry& e) {
    std::string payload = e.has_request() ? e.request().SerializeAsString()
                          : e.has_watch() ? e.watch().SerializeAsString()
                          : e.has_ack()   ? e.ack().SerializeAsString()
                                          : e.raw();
    if (static_cast<uint16_t>(e.opcode()) == fr::kWatchNotifications) {
      watches_.push_back(e.user_data());
      // (Raw bytes may parse as a watch naming a subscription too.)
      v1::WatchNotificationsRequest watch;
      if (watch.ParseFromString(payload) && !watch.subscription().empty()) durable_ = true;
    }
    if (payload.size() > area() - fr::kSubmissionHeaderBytes) {
      payload.resize(area() - fr::kSubmissionHeaderBytes);
    }
    fr::SubmissionHeader h{};
    h.length = e.has_length() ? e.length() : static_cast<uint32_t>(payload.size());
    h.opcode = static_cast<uint16_t>(e.opcode());
    const uint32_t need = fr::SlotsFor(payload.size());
    h.slots = static_cast<uint16_t>(e.has_slots() ? e.slots() : need);
    h.flags = e.flags();
    h.reserved = e.reserved();
    h.user_data = e.user_data();
    uint32_t index = cursor_ & (slots_ - 1);
    if (!e.no_pad() && need > slots_ - index && need <= slots_) {
      fr::SubmissionHeader pad{};
      pad.opcode = fr::kPad;
      pad.slots = static_cast<uint16_t>(slots_ - index);
      Put(uint64_t{index} * fr::kSlotBytes, &pad, sizeof(pad));
      cursor_ += pad.slots;
      index = 0;
    }
    Put(uint64_t{index} * fr::kSlotBytes, &h, sizeof(h));
    Put(uint64_t{index} * fr::kSlotBytes + sizeof(h), payload.data(), payload.size());
    cursor_ += h.slots;
  }

  void WriteBytes(const RawBytes& b) { Put(b.offset() % area(), b.data().data(), b.data().size()); }

  // Reads the completions from cq_head_ to `tail` an honest client reads, each by its
  // span; stops after `max` (0: all). Returns the entries they took.
  uint32_t Walk(uint32_t tail, uint32_t max) {
    const uint32_t n = tail - cq_head_;
    FUZZ_CHECK(n <= completions_, "cq_tail {} is {} past an honest cq_head {}", tail, n, cq_head_);
    uint32_t done = 0, count = 0;
    while (done < n && (max == 0 || count < max)) {
      const uint32_t index = (cq_head_ + done) & (completions_ - 1);
      const uint32_t span = CheckCompletion(index, true);
      FUZZ_CHECK(done + span <= n, "completion {} spans {} entries, {} are posted", index, span,
                 n - done);
      done += span;
      ++count;
    }
    return done;
  }

  void Reap(uint32_t max) {
    const uint32_t tail = header_->cq_tail.value.load(std::memory_order_acquire);
    uint32_t n = tail - cq_head_;
    if (honest_) {
      n = Walk(tail, max);
    } else {
      if (n > completions_) n = completions_;  // after a dishonest cq_head
      if (max != 0 && n > max) n = max;
      // After a dishonest cq_head the slots read may never have been posted.
      for (uint32_t i = 0; i < n; ++i) CheckCompletion((cq_head_ + i) & (completions_ - 1), false);
    }
    cq_head_ += n;
    header_->cq_head.value.store(cq_head_, std::memory_order_release);
    uint64_t rung;  // the completion doorbell (non-blocking), as a client that waited
    [[maybe_unused]] ssize_t r = ::read(complete_fd_.get(), &rung, sizeof(rung));
  }

  // An honest client's cq_head: everything posted is reaped. Honest from here on:
  // reservations taken before it are under completion_entries, so cq_tail cannot
  // run further than that past it.
  void ResyncHead() {
    const uint32_t tail = header_->cq_tail.value.load(std::memory_order_acquire);
    uint32_t n = tail - cq_head_;
    if (honest_) {
      Walk(tail, 0);
    } else if (n <= completions_) {
      for (uint32_t i = 0; i < n; ++i) CheckCompletion((cq_head_ + i) & (completions_ - 1), false);
    }
    cq_head_ = tail;
    honest_ = true;
    header_->cq_head.value.store(cq_head_, std::memory_order_release);
  }

  // Checks the completion at `index` (`posted`: an honest client reads it as the next
  // completion; else any entry, maybe never posted, maybe inside a notification);
  // returns the entries it spans.
  uint32_t CheckCompletion(uint32_t index, bool posted) {
    const char* at = base_ + info_.completion_offset() + uint64_t{index} * fr::kCompletionBytes;
    fr::CompletionHeader c;
    std::memcpy(&c, at, sizeof(c));
    // Entries inside a notification hold its bytes: only completions read in order can
    // be told from them. Once a watch entry was written, the taking thread may be
    // writing a notification into any free entry at this moment (one offered again after
    // a reap), before the count says so: such an entry is read only in order either.
    if (!posted && (NotificationsPosted() != 0 || !watches_.empty())) return 1;
    if (!posted && c.opcode == 0 && c.user_data == 0 && c.message_length == 0) return 1;  // unused
    if (c.opcode == fr::kNotification) {
      CheckNotification(index, c, at);
      return c.span;
    }
    if (c.opcode == fr::kPad) {
      FUZZ_CHECK(!watches_.empty() && c.span >= 1 && index + c.span == completions_ &&
                     c.message_length == 0 && c.code == 0,
                 "pad completion {}: span {} of {} entries, message {} bytes, code {} ({} watch "
                 "entries written)",
                 index, c.span, completions_, c.message_length, c.code, watches_.size());
      return c.span;
    }
    FUZZ_CHECK(c.message_length <= fr::kMaxMessage,
               "completion {} has a {}-byte message (at most {})", index, c.message_length,
               fr::kMaxMessage);
    FUZZ_CHECK(c.span == 1, "completion {} spans {} entries", index, c.span);
    if (posted) ++entry_completions_;
    switch (c.opcode) {
      case fr::kPing:
        FUZZ_CHECK(c.code == 0 && c.phase == 0 && c.message_length == 0 && c.bytes_done == 0,
                   "ping completion {}: code {} phase {} message {} bytes", index, c.code, c.phase,
                   c.message_length);
        break;
      case fr::kCancel:
        FUZZ_CHECK((c.code == static_cast<int32_t>(absl::StatusCode::kNotFound) ||
                    c.code == static_cast<int32_t>(absl::StatusCode::kInvalidArgument)) &&
                       c.phase == 0 && c.message_length > 0,
                   "cancel completion {}: code {} phase {} message {} bytes (the backend only "
                   "refuses)",
                   index, c.code, c.phase, c.message_length);
        break;
      case fr::kSubmit:
        // The backend's outcomes: completed, failed, cancelled, or a refusal (phase 0).
        FUZZ_CHECK(c.phase == v1::COMPLETED ? c.code == 0
                   : c.phase == 0
                       ? c.code != 0
                       : (c.phase == v1::FAILED || c.phase == v1::CANCELLED) && c.code != 0,
                   "submit completion {}: code {} phase {}", index, c.code, c.phase);
        break;
      case fr::kWatchNotifications:
        FUZZ_CHECK(c.phase == 0 && c.bytes_done == 0 &&
                       (c.code == 0 ? c.message_length == 0
                                    : (c.code == static_cast<int32_t>(
                                                     absl::StatusCode::kInvalidArgument) ||
                                       c.code == static_cast<int32_t>(
                                                     absl::StatusCode::kFailedPrecondition) ||
                                       c.code == static_cast<int32_t>(
                                                     absl::StatusCode::kResourceExhausted)) &&
                                          c.message_length > 0),
                   "watch completion {}: code {} phase {} message {} bytes", index, c.code,
                   c.phase, c.message_length);
        break;
      case fr::kAckNotifications:
        // Released: at most every notification pushed (a subscription holds no more).
        FUZZ_CHECK(c.phase == 0 &&
                       (c.code == 0 ? c.message_length == 0 && c.bytes_done <= backend_->pushed()
                                    : (c.code == static_cast<int32_t>(
                                                     absl::StatusCode::kInvalidArgument) ||
                                       c.code == static_cast<int32_t>(
                                                     absl::StatusCode::kNotFound)) &&
                                          c.message_length > 0 && c.bytes_done == 0),
                   "ack completion {}: code {} phase {} message {} bytes, {} released ({} "
                   "pushed)",
                   index, c.code, c.phase, c.message_length, c.bytes_done, backend_->pushed());
        break;
      default:
        Fail(__FILE__, __LINE__, "known opcode",
             fmt::format("completion {} has opcode {}: the agent completed a pad or an unknown "
                         "entry",
                         index, c.opcode));
    }
    return 1;
  }

  void CheckNotification(uint32_t index, const fr::CompletionHeader& c, const char* at) {
    FUZZ_CHECK(std::find(watches_.begin(), watches_.end(), c.user_data) != watches_.end(),
               "notification completion {} carries user_data {}, no watch entry's", index,
               c.user_data);
    if (c.code != 0) {
      // A durable watch's notification too large for the ring: a message in its place.
      FUZZ_CHECK(durable_ && c.code == static_cast<int32_t>(absl::StatusCode::kResourceExhausted) &&
                     c.span == 1 && c.phase == 0 && c.message_length > 0 &&
                     c.message_length <= fr::kMaxMessage &&
                     absl::StartsWith(absl::string_view(at + sizeof(c), c.message_length),
                                      "notification sequence "),
                 "notification completion {}: code {} span {} phase {} message {} bytes "
                 "(durable watch written: {})",
                 index, c.code, c.span, c.phase, c.message_length, durable_);
      return;
    }
    FUZZ_CHECK(c.span >= 1 && c.span <= fr::MaxSpan(completions_) &&
                   index + c.span <= completions_ && c.span == fr::SpanFor(c.message_length),
               "notification completion {}: {} bytes in {} entries (ring of {}, at most {})",
               index, c.message_length, c.span, completions_, fr::MaxSpan(completions_));
    v1::Notification n;
    FUZZ_CHECK(n.ParseFromArray(at + sizeof(c), static_cast<int>(c.message_length)),
               "notification completion {} ({} bytes) does not parse", index, c.message_length);
    FUZZ_CHECK(n.from_agent() == "mine", "notification completion {} is {}'s", index,
               n.from_agent());
    FUZZ_CHECK(c.code == 0 && c.phase == static_cast<uint32_t>(n.kind()) &&
                   c.bytes_done == n.bytes() && c.latency_us == 0,
               "notification completion {}: code {} phase {} (kind {}) bytes {} ({})", index,
               c.code, c.phase, static_cast<int>(n.kind()), c.bytes_done, n.bytes());
    FUZZ_CHECK(n.sequence() == 0 || durable_,
               "notification completion {} has sequence {}, and no durable watch was written",
               index, n.sequence());
    ++notifications_read_;
  }

  void CheckAllCompletions() {
    for (uint32_t i = 0; i < completions_; ++i) CheckCompletion(i, false);
  }

  // Checks what must hold at any moment; returns agent_flags.
  uint32_t Observe() {
    // agent_flags first: once kClosed is seen, every write the agent made to the ring
    // happened before it (it sets the flag after it closed the ring under its lock).
    const uint32_t flags = header_->agent_flags.value.load(std::memory_order_acquire);
    const uint32_t cq_tail = header_->cq_tail.value.load(std::memory_order_acquire);
    const uint32_t sq_head = header_->sq_head.value.load(std::memory_order_acquire);
    if (honest_) {
      // Each held completion has its room reserved: posted and held together fit.
      // (Held ones are given only on this thread, so none is posted meanwhile.)
      const size_t held = backend_->held();
      FUZZ_CHECK(cq_tail - cq_head_ <= completions_ && cq_tail - cq_head_ + held <= completions_,
                 "cq_tail {} is {} past the client's honest cq_head {}, {} more completions are "
                 "held; the ring has {} completions",
                 cq_tail, cq_tail - cq_head_, cq_head_, held, completions_);
    }
    if ((flags & fr::kClosed) && !closed_seen_) {
      closed_seen_ = true;
      const char* reason = base_ + fr::kReasonOffset;
      const void* nul = std::memchr(reason, '\0', fr::kReasonBytes);
      FUZZ_CHECK(nul != nullptr, "the close reason is not NUL-terminated within {} bytes",
                 fr::kReasonBytes);
      const std::string text(reason);
      FUZZ_CHECK(absl::StartsWith(text,
                                  "the agent closed this fast path: the client broke the "
                                  "ring protocol: ") &&
                     text.size() > 70,
                 "the close reason is '{}'", text);
      const uint64_t errors = server_->counters().protocol_errors;
      FUZZ_CHECK(errors == 1, "the ring is closed ({}) and protocol_errors is {}", text, errors);
      frozen_cq_tail_ = cq_tail;
      frozen_sq_head_ = sq_head;
      frozen_ = true;
    } else if (frozen_) {
      CheckFrozen(/*completions=*/false);
    }
    return flags;
  }

  // Waits until the agent took what is published (and went idle), closed the ring, or
  // stopped moving (no completion room): bounded, the server polls every millisecond.
  void Settle() {
    const auto start = Clock::now();
    auto last_change = start;
    uint32_t last_head = header_->sq_head.value.load();
    uint32_t last_tail = header_->cq_tail.value.load();
    for (;;) {
      const uint32_t flags = Observe();
      if (flags & fr::kClosed) return;
      const uint32_t sq_head = header_->sq_head.value.load(std::memory_order_acquire);
      const uint32_t cq_tail = header_->cq_tail.value.load(std::memory_order_acquire);
      if (sq_head == header_->sq_tail.value.load(std::memory_order_acquire) &&
          (flags & fr::kSleeping)) {
        return;
      }
      const auto now = Clock::now();
      if (sq_head != last_head || cq_tail != last_tail) {
        last_head = sq_head;
        last_tail = cq_tail;
        last_change = now;
      } else if (now - last_change > kQuiet) {
        return;
      }
      if (now - start > kSettleMax) return;
      std::this_thread::yield();
    }
  }

  agent::FastPathServer* server_;  // null once destroyed
  uint64_t notifications_posted_ = 0;  // its count when it went
  Backend* const backend_;
  const v1::FastPathInfo info_;
  UniqueFd memfd_;
  UniqueFd submit_fd_;
  UniqueFd complete_fd_;
  const uint32_t slots_;
  const uint32_t completions_;
  char* base_ = nullptr;
  fr::RingHeader* header_ = nullptr;

  uint32_t cursor_ = 0;   // where the next entry goes (the client's own sq_tail)
  uint32_t cq_head_ = 0;  // what the client stored last
  bool honest_ = true;    // cq_head was only ever moved by reaping
  bool always_honest_ = true;  // ... from the start (then every completion was read)
  std::vector<uint64_t> watches_;  // user_data of the watch entries written
  bool durable_ = false;           // one of them named a subscription
  uint64_t entry_completions_ = 0;   // read in order: completions of entries
  uint64_t notifications_read_ = 0;  // read in order: notifications
  bool closed_seen_ = false;
  bool frozen_ = false;  // closed: cq_tail and sq_head must stay as they were
  uint32_t frozen_cq_tail_ = 0;
  uint32_t frozen_sq_head_ = 0;
};

void Run(const FastRingInput& input) {
  Backend backend;
  // The server's destruction is the last check: held completions may outlive it.
  auto server = std::make_unique<agent::FastPathServer>(
      agent::FastPathOptions{/*spin_us=*/5, /*idle_poll_ms=*/1}, backend.Make());
  server->Start();

  v1::OpenFastPathRequest request;
  request.set_submission_slots(PickSize(input.submission_slots()));
  request.set_completion_entries(PickSize(input.completion_entries()));
  const absl::StatusOr<fr::Geometry> layout =
      fr::Layout(request.submission_slots(), request.completion_entries());
  std::vector<UniqueFd> fds;
  absl::StatusOr<v1::FastPathInfo> info = server->Open(kSession, EngineCaller(), request, &fds);
  if (!layout.ok()) {
    FUZZ_CHECK(!info.ok() && info.status().code() == absl::StatusCode::kInvalidArgument &&
                   absl::StartsWith(info.status().message(), "OpenFastPathRequest."),
               "Open of sizes {}/{} that Layout refuses ({}): {}", request.submission_slots(),
               request.completion_entries(), layout.status().message(),
               info.ok() ? "accepted" : info.status().ToString());
    FUZZ_CHECK(server->counters().rings == 0, "a refused Open left a ring");
    return;
  }
  FUZZ_CHECK(info.ok(), "Open of sizes {}/{}: {}", request.submission_slots(),
             request.completion_entries(), info.status().ToString());
  FUZZ_CHECK(fds.size() == 3, "Open returned {} descriptors", fds.size());
  FUZZ_CHECK(info->submission_slots() == layout->submission_slots &&
                 info->completion_entries() == layout->completion_entries &&
                 info->ring_bytes() == layout->ring_bytes,
             "Open's sizes differ from Layout's");
  {
    std::vector<UniqueFd> again;
    const auto second = server->Open(kSession, EngineCaller(), request, &again);
    FUZZ_CHECK(second.status().code() == absl::StatusCode::kFailedPrecondition,
               "a second Open of the session: {}", second.status().ToString());
  }

  Client client(server.get(), &backend, *info, std::move(fds));
  const auto start = Clock::now();
  int steps = 0;
  for (const Step& step : input.steps()) {
    if (++steps > kMaxSteps || Clock::now() - start > kInputBudget) break;
    client.Do(step);
  }
  const uint32_t held_until = input.held_until() % 3;
  client.Finish(/*release_held=*/held_until == 0);
  if (std::getenv("KVAGENT_FUZZ_TRACE") != nullptr) client.Trace(steps);

  if (input.close_by_request()) {
    // Entries taken and not answered are the backend's held ones (the agent settled).
    const size_t held = backend.held();
    const absl::StatusOr<v1::FastPathClosed> closed = server->CloseOnRequest(kSession);
    const agent::FastPathCounters c = server->counters();
    if (closed.ok()) {
      FUZZ_CHECK(c.protocol_errors == 0 && c.closed_by_request == 1 && c.rings == 0,
                 "close_fast_path answered OK: {} protocol errors, {} closed by request, {} "
                 "rings", c.protocol_errors, c.closed_by_request, c.rings);
      FUZZ_CHECK(closed->transfers_running() == held,
                 "close_fast_path: {} transfers running, the backend holds {}",
                 closed->transfers_running(), held);
      client.ClosedByRequest(*closed);
    } else {  // the client broke the ring first: that close stands
      FUZZ_CHECK(closed.status().code() == absl::StatusCode::kFailedPrecondition &&
                     c.protocol_errors == 1 && c.closed_by_request == 0,
                 "close_fast_path of a ring with {} protocol errors: {}", c.protocol_errors,
                 closed.status().ToString());
    }
    const auto again = server->CloseOnRequest(kSession);
    FUZZ_CHECK(again.status().code() == absl::StatusCode::kFailedPrecondition,
               "a second close_fast_path: {}", again.status().ToString());
  } else {
    server->Close(kSession);
  }
  client.AfterClose();
  server->Close(kSession);  // idempotent
  FUZZ_CHECK(server->counters().rings == 0, "Close left {} rings", server->counters().rings);
  if (held_until == 1) backend.Release(0, 1);
  Notify late;
  late.set_count(3);
  backend.Push(late);  // the watch ended with the session
  client.CheckFrozen();
  {
    // The session's ring is gone: it may open another.
    std::vector<UniqueFd> fds2;
    const auto reopened = server->Open(kSession, EngineCaller(), request, &fds2);
    FUZZ_CHECK(reopened.ok(), "Open after Close: {}", reopened.status().ToString());
    server->Close(kSession);
  }
  client.ServerGone();
  server.reset();
  backend.Release(0, 2);  // completions after the server is gone write nothing
  backend.Push(late);     // nor notifications (no subscriber is left)
  client.CheckFrozen();
}

}  // namespace

const google::protobuf::Message& InputPrototype() { return FastRingInput::default_instance(); }
const char* TargetName() { return "fast_ring"; }

}  // namespace kvagent::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool quiet = [] {
    // A break is logged as a warning, every Open as info: thousands per second here.
    kvagent::log::SetLevel(kvagent::log::Level::kError);
    return true;
  }();
  (void)quiet;
  kvagent::fuzz::FastRingInput input;
  if (!input.ParseFromArray(data, static_cast<int>(size))) return 0;
  kvagent::fuzz::Run(input);
  return 0;
}
