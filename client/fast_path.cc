#include "client/fast_path.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "base/format.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "fmt/format.h"

namespace kvagent::client {
namespace {

namespace fr = fastring;
using Clock = std::chrono::steady_clock;
constexpr log::Logger kLog("fast-path-client");
// The most the destructor waits for close_fast_path's answer.
constexpr uint32_t kCloseOnDestroyMs = 1000;

absl::Status Mismatch(const std::string& what) {
  return absl::FailedPreconditionError(fmt::format(
      "the agent's fast path ring does not match this client ({}); use a client library "
      "that matches the agent (ring version {})",
      what, fr::kVersion));
}

}  // namespace

absl::StatusOr<std::unique_ptr<FastPath>> FastPath::Open(LocalSession* session,
                                                         FastPathOptions options) {
  v1::OpenFastPathRequest request;
  request.set_submission_slots(options.submission_slots);
  request.set_completion_entries(options.completion_entries);
  ASSIGN_OR_RETURN(auto opened, session->OpenFastPath(request));
  v1::FastPathInfo& info = opened.first;
  if (info.version() != fr::kVersion || info.slot_bytes() != fr::kSlotBytes ||
      info.completion_bytes() != fr::kCompletionBytes) {
    return Mismatch(fmt::format("version {}, slots of {} bytes, completions of {} bytes",
                                info.version(), info.slot_bytes(), info.completion_bytes()));
  }
  absl::StatusOr<fr::Geometry> geometry =
      fr::Layout(info.submission_slots(), info.completion_entries());
  if (!geometry.ok() || geometry->ring_bytes != info.ring_bytes() ||
      geometry->submission_offset != info.submission_offset() ||
      geometry->completion_offset != info.completion_offset()) {
    return Mismatch("its sizes and offsets are not this client's layout");
  }
  UniqueFd memfd = std::move(opened.second[0]);
  struct stat st {};
  if (fstat(memfd.get(), &st) != 0 || static_cast<uint64_t>(st.st_size) < info.ring_bytes()) {
    return Mismatch(fmt::format("the ring file is shorter than {} bytes", info.ring_bytes()));
  }
  void* base = mmap(nullptr, info.ring_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                    memfd.get(), 0);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        fmt::format("mapping the fast path ring ({} bytes) failed: {}", info.ring_bytes(),
                    std::strerror(errno)));
  }
  auto* header = static_cast<fr::RingHeader*>(base);
  if (header->magic != fr::kMagic || header->version != fr::kVersion) {
    munmap(base, info.ring_bytes());
    return Mismatch("the ring file's header");
  }
  return std::unique_ptr<FastPath>(new FastPath(
      session, std::move(info), std::move(memfd), std::move(opened.second[1]),
      std::move(opened.second[2]), static_cast<char*>(base), options));
}

FastPath::FastPath(LocalSession* session, v1::FastPathInfo info, UniqueFd memfd,
                   UniqueFd submit_fd, UniqueFd complete_fd, char* base, FastPathOptions options)
    : session_(session),
      info_(std::move(info)),
      memfd_(std::move(memfd)),
      submit_fd_(std::move(submit_fd)),
      complete_fd_(std::move(complete_fd)),
      base_(base),
      options_(options),
      slots_(info_.submission_slots()),
      completions_(info_.completion_entries()) {}

FastPath::~FastPath() {
  // A ring left open keeps its notification watch, which takes notifications no one
  // reads, until the session ends: close it, best effort and briefly. Not when Close()
  // was called (the agent answered, or it is older, or the session is gone) or the
  // agent closed the ring itself (a newer ring of the session may be open by now).
  const bool agent_closed =
      (header()->agent_flags.value.load(std::memory_order_acquire) & fr::kClosed) != 0;
  if (!close_sent_.load(std::memory_order_relaxed) && !agent_closed) {
    const uint32_t timeout_ms = std::min(session_->timeout_ms(), kCloseOnDestroyMs);
    absl::StatusOr<v1::FastPathClosed> closed = session_->CloseFastPath(timeout_ms);
    if (closed.ok()) {
      kLog.Debug("fast path of session {} closed by its destructor ({} transfers still "
                 "running; completions not reaped were dropped: call Close() to get them)",
                 session_->path(), closed->transfers_running());
    } else if (absl::IsDeadlineExceeded(closed.status())) {
      kLog.Warn("fast path destructor: {}; the agent closes the ring if it still reads the "
                "request, else when the session ends",
                closed.status().message());
    } else {
      // The session is gone (its end closed the ring), or the agent is older.
      kLog.Debug("fast path destructor: close_fast_path: {}", closed.status().ToString());
    }
  }
  munmap(base_, info_.ring_bytes());
}

std::string FastPath::closed_reason() const {
  if ((header()->agent_flags.value.load(std::memory_order_acquire) & fr::kClosed) == 0) return "";
  const char* text = base_ + fr::kReasonOffset;
  std::string reason(text, strnlen(text, fr::kReasonBytes - 1));
  if (reason.empty()) reason = "the agent closed this fast path (the session ended)";
  return reason;
}

absl::Status FastPath::Put(uint16_t opcode, uint64_t user_data, size_t length,
                           const std::function<void(char*)>& fill, bool publish) {
  if (length > fr::MaxPayload(slots_)) {
    return absl::InvalidArgumentError(fmt::format(
        "a {} entry of {} bytes does not fit this fast path ring (at most {} bytes with {} "
        "slots); open the ring with more submission_slots, split the transfer into chunks, "
        "or submit it through gRPC",
        fr::OpcodeName(opcode), length, fr::MaxPayload(slots_), slots_));
  }
  if (std::string reason = closed_reason(); !reason.empty()) {
    return absl::FailedPreconditionError(reason);
  }
  const uint32_t need = fr::SlotsFor(length);
  const uint32_t head = header()->sq_head.value.load(std::memory_order_acquire);
  const uint32_t used = sq_tail_ - head;
  const uint32_t free_slots = used > slots_ ? 0 : slots_ - used;
  const uint32_t index = sq_tail_ & (slots_ - 1);
  const uint32_t to_end = slots_ - index;
  const uint32_t pad = need > to_end ? to_end : 0;
  if (pad + need > free_slots) {
    if (publish) PublishLocked();
    return absl::ResourceExhaustedError(fmt::format(
        "the fast path's submission ring is full ({} of {} slots wait for the agent, which "
        "takes an entry only when its completion has room): reap completions, then submit "
        "again",
        used, slots_));
  }
  char* slots = base_ + info_.submission_offset();
  if (pad != 0) {
    fr::SubmissionHeader h{};
    h.opcode = fr::kPad;
    h.slots = static_cast<uint16_t>(pad);
    std::memcpy(slots + uint64_t{index} * fr::kSlotBytes, &h, sizeof(h));
    sq_tail_ += pad;
  }
  char* at = slots + uint64_t{sq_tail_ & (slots_ - 1)} * fr::kSlotBytes;
  fr::SubmissionHeader h{};
  h.length = static_cast<uint32_t>(length);
  h.opcode = opcode;
  h.slots = static_cast<uint16_t>(need);
  h.user_data = user_data;
  std::memcpy(at, &h, sizeof(h));
  if (length != 0) fill(at + sizeof(h));
  sq_tail_ += need;
  submitted_.fetch_add(1, std::memory_order_relaxed);
  if (publish) PublishLocked();
  return absl::OkStatus();
}

absl::Status FastPath::PutMessage(uint16_t opcode, const google::protobuf::MessageLite& message,
                                  uint64_t user_data, bool publish) {
  absl::MutexLock lock(&submit_mu_);
  const size_t length = message.ByteSizeLong();
  return Put(
      opcode, user_data, length,
      [&](char* out) { message.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(out)); },
      publish);
}

absl::Status FastPath::Submit(const v1::SubmitTransferRequest& request, uint64_t user_data,
                              bool publish) {
  return PutMessage(fr::kSubmit, request, user_data, publish);
}

absl::Status FastPath::SubmitOrReap(const v1::SubmitTransferRequest& request, uint64_t user_data,
                                    std::vector<FastCompletion>* reaped, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    absl::Status put = Submit(request, user_data);
    if (!absl::IsResourceExhausted(put)) return put;
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(fmt::format(
          "the fast path's submission ring stayed full for {} (the agent takes entries only "
          "as their completions find room): {}",
          absl::FormatDuration(timeout), put.message()));
    }
    absl::StatusOr<size_t> got = Reap(reaped, completions_, std::min(left, absl::Milliseconds(10)));
    if (!got.ok()) return got.status();
  }
}

absl::Status FastPath::Cancel(std::string_view transfer_id, uint64_t user_data, bool publish) {
  absl::MutexLock lock(&submit_mu_);
  return Put(
      fr::kCancel, user_data, transfer_id.size(),
      [&](char* out) { std::memcpy(out, transfer_id.data(), transfer_id.size()); }, publish);
}

absl::Status FastPath::Ping(uint64_t user_data, bool publish) {
  absl::MutexLock lock(&submit_mu_);
  return Put(fr::kPing, user_data, 0, [](char*) {}, publish);
}

absl::Status FastPath::WatchNotifications(const std::vector<std::string>& transfer_ids,
                                          uint64_t user_data, bool publish) {
  // An older agent closes the whole ring on an opcode it does not know.
  if (absl::Status s = fr::CheckNotifications(info_.features()); !s.ok()) return s;
  v1::WatchNotificationsRequest request;
  for (const std::string& id : transfer_ids) request.add_transfer_ids(id);
  return PutMessage(fr::kWatchNotifications, request, user_data, publish);
}

absl::Status FastPath::WatchNotifications(const std::vector<std::string>& transfer_ids,
                                          const std::string& subscription, uint64_t user_data,
                                          bool publish) {
  if (subscription.empty()) return WatchNotifications(transfer_ids, user_data, publish);
  RETURN_IF_ERROR(fr::CheckDurableNotifications(
      info_.features(), fmt::format("WatchNotifications with subscription '{}'", subscription)));
  v1::WatchNotificationsRequest request;
  for (const std::string& id : transfer_ids) request.add_transfer_ids(id);
  request.set_subscription(subscription);
  return PutMessage(fr::kWatchNotifications, request, user_data, publish);
}

absl::Status FastPath::AckNotifications(const std::string& subscription, uint64_t through,
                                        const std::vector<uint64_t>& sequences,
                                        uint64_t user_data, bool publish) {
  // An older agent closes the whole ring on an opcode it does not know.
  RETURN_IF_ERROR(fr::CheckDurableNotifications(
      info_.features(), fmt::format("AckNotifications of subscription '{}'", subscription)));
  v1::AckNotificationsRequest request;
  request.set_subscription(subscription);
  request.set_through_sequence(through);
  for (uint64_t sequence : sequences) request.add_sequences(sequence);
  return PutMessage(fr::kAckNotifications, request, user_data, publish);
}

void FastPath::Publish() {
  absl::MutexLock lock(&submit_mu_);
  PublishLocked();
}

void FastPath::PublishLocked() {
  if (published_ == sq_tail_) return;
  // seq_cst store, then seq_cst load (see agent/fast_path's sleep): the agent sees
  // the entries or this side sees it sleeping and rings.
  header()->sq_tail.value.store(sq_tail_, std::memory_order_seq_cst);
  published_ = sq_tail_;
  WakeAgentIfAsleep();
}

void FastPath::WakeAgentIfAsleep() {
  if (header()->agent_flags.value.load(std::memory_order_seq_cst) & fr::kSleeping) {
    fr::RingDoorbell(submit_fd_.get());
  }
}

void FastPath::NudgeAgent() {
  fr::RingHeader* h = header();
  if (h->sq_tail.value.load(std::memory_order_relaxed) ==
      h->sq_head.value.load(std::memory_order_acquire)) {
    return;
  }
  WakeAgentIfAsleep();
}

size_t FastPath::TakeCompletions(std::vector<FastCompletion>* out, size_t max) {
  const uint32_t tail = header()->cq_tail.value.load(std::memory_order_seq_cst);
  size_t n = 0;
  uint64_t answered = 0;  // completions of submitted entries
  const uint32_t start = cq_head_;
  const char* entries = base_ + info_.completion_offset();
  while (cq_head_ != tail && n < max) {
    const uint32_t index = cq_head_ & (completions_ - 1);
    const char* at = entries + uint64_t{index} * fr::kCompletionBytes;
    fr::CompletionHeader h;
    std::memcpy(&h, at, sizeof(h));
    // A completion never wraps nor runs past what is published (a span out of range
    // is the agent's bug: taken as 1, so the ring is still read).
    uint32_t span = h.span;
    if (span == 0 || span > completions_ - index || span > tail - cq_head_) span = 1;
    if (h.opcode == fr::kPad) {
      cq_head_ += span;
      continue;
    }
    FastCompletion c;
    c.user_data = h.user_data;
    c.opcode = h.opcode;
    c.code = static_cast<absl::StatusCode>(h.code);
    c.phase = static_cast<v1::TransferPhase>(h.phase);
    c.bytes_done = h.bytes_done;
    c.latency_us = h.latency_us;
    if (h.opcode == fr::kNotification && h.code != 0) {
      // One the agent could not fit (durable watch): its text says which.
      c.phase = v1::TRANSFER_PHASE_UNSPECIFIED;
      c.message.assign(at + sizeof(h), std::min<uint32_t>(h.message_length, fr::kMaxMessage));
    } else if (h.opcode == fr::kNotification) {
      c.phase = v1::TRANSFER_PHASE_UNSPECIFIED;  // the wire's phase is the kind
      const uint64_t room = uint64_t{span} * fr::kCompletionBytes - sizeof(h);
      c.notification.emplace();
      if (h.message_length > room ||
          !c.notification->ParseFromArray(at + sizeof(h), static_cast<int>(h.message_length))) {
        c.notification.reset();
        c.code = absl::StatusCode::kInternal;
        c.message = fmt::format(
            "a notification completion of {} bytes in {} entries does not parse as a "
            "Notification; the agent and this client disagree on the ring (version {})",
            h.message_length, span, fr::kVersion);
      }
    } else {
      c.message.assign(at + sizeof(h), std::min<uint32_t>(h.message_length, fr::kMaxMessage));
      ++answered;
    }
    out->push_back(std::move(c));
    cq_head_ += span;
    ++n;
  }
  if (cq_head_ != start) {
    header()->cq_head.value.store(cq_head_, std::memory_order_seq_cst);
    reaped_.fetch_add(answered, std::memory_order_relaxed);
    // Notifications wait for the room just made: wake the agent if it sleeps.
    const uint32_t flags = header()->agent_flags.value.load(std::memory_order_seq_cst);
    if ((flags & fr::kRoomWanted) && (flags & fr::kSleeping)) fr::RingDoorbell(submit_fd_.get());
  }
  return n;
}

absl::StatusOr<size_t> FastPath::Reap(std::vector<FastCompletion>* out, size_t max,
                                      absl::Duration timeout, size_t min) {
  absl::MutexLock lock(&reap_mu_);
  min = std::clamp<size_t>(min, 1, std::max<size_t>(max, 1));
  size_t n = 0;
  // Takes what has come (up to max in all); true once `min` have.
  auto take = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(reap_mu_) {
    const size_t took = TakeCompletions(out, max - n);
    n += took;
    if (took != 0) NudgeAgent();  // entries may wait for the room just made
    return n >= min;
  };
  if (take()) return n;
  const auto start = Clock::now();
  const auto limit = start + absl::ToChronoNanoseconds(timeout);
  fr::RingHeader* h = header();
  const bool counts = (info_.features() & fr::kFeatureWakeCount) != 0;
  if (min == 1 || !counts) {
    // Poll a while (the next one is likely near) before sleeping. A wait for several
    // sleeps at once where the agent rings for the count: holding a CPU for them is
    // what it is meant to avoid. An older agent would ring at the first, so there the
    // wait polls as for one.
    const auto spin_end = start + std::chrono::microseconds(options_.spin_us);
    while (Clock::now() < std::min(spin_end, limit)) {
      if (take()) return n;
      fr::CpuRelax();
    }
  }
  for (;;) {
    // Ring when `want` more have come (an agent without kFeatureWakeCount rings at the
    // first, and this waits again). wake_at is stored before the flags (the agent reads
    // it after them). At most a completion ring's worth: the agent posts no more than
    // fit before this side reaps, so a larger count would never be reached.
    const size_t want = std::min<size_t>(min - n, completions_);
    if (counts && want > 1) {
      h->wake_at.value.store(cq_head_ + static_cast<uint32_t>(want), std::memory_order_relaxed);
      h->client_flags.value.store(fr::kWaiting | fr::kWaitCount, std::memory_order_seq_cst);
    } else {
      // seq_cst store, then TakeCompletions' seq_cst load of cq_tail: the agent's
      // completion is seen, or the agent sees the flag and rings.
      h->client_flags.value.store(fr::kWaiting, std::memory_order_seq_cst);
    }
    if (take()) break;
    if (std::string reason = closed_reason(); !reason.empty()) {
      h->client_flags.value.store(0, std::memory_order_relaxed);
      if (n != 0) return n;
      return absl::FailedPreconditionError(reason);
    }
    const auto now = Clock::now();
    if (now >= limit) break;
    NudgeAgent();
    pollfd fds[2] = {{complete_fd_.get(), POLLIN, 0}, {session_->fd(), POLLRDHUP, 0}};
    const auto wait = std::chrono::duration_cast<std::chrono::nanoseconds>(limit - now);
    timespec ts{static_cast<time_t>(wait.count() / 1000000000),
                static_cast<long>(wait.count() % 1000000000)};
    sleeps_.fetch_add(1, std::memory_order_relaxed);
    const int ready = ppoll(fds, 2, &ts, nullptr);
    if (ready > 0 && (fds[0].revents & POLLIN)) fr::DrainDoorbell(complete_fd_.get());
    if (ready > 0 && (fds[1].revents & (POLLHUP | POLLRDHUP | POLLERR))) {
      n += TakeCompletions(out, max - n);
      h->client_flags.value.store(0, std::memory_order_relaxed);
      if (n != 0) return n;
      return absl::UnavailableError(fmt::format(
          "the agent at {} closed the session; its fast path is gone (attach again)",
          session_->path()));
    }
  }
  h->client_flags.value.store(0, std::memory_order_relaxed);
  return n;
}

absl::StatusOr<FastPathClose> FastPath::Close() {
  FastPathClose result;
  close_sent_.store(true, std::memory_order_relaxed);
  absl::StatusOr<v1::FastPathClosed> closed = session_->CloseFastPath();
  if (absl::IsUnimplemented(closed.status()) || absl::IsInvalidArgument(closed.status())) {
    // An older agent: the ring stays open on its side until the session ends.
    return result;
  }
  if (!closed.ok()) return closed.status();
  result.closed_by_agent = true;
  result.transfers_running = closed->transfers_running();
  absl::MutexLock lock(&reap_mu_);
  // The agent wrote nothing after completion_tail: this takes all that is left.
  while (TakeCompletions(&result.left, SIZE_MAX) != 0) {
  }
  return result;
}

uint64_t FastPath::outstanding() const {
  return submitted_.load(std::memory_order_relaxed) - reaped_.load(std::memory_order_relaxed);
}

}  // namespace kvagent::client
