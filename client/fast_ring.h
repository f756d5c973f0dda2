// The local fast path's shared-memory layout (proto OpenFastPathRequest): one file
// the agent creates per session, mapped by both sides, holding a submission ring (the
// client produces, the agent consumes) and a completion ring (the agent produces, the
// client consumes), and two eventfd doorbells beside it. Shared by the agent
// (agent/fast_path) and the client (client/fast_path); no policy lives here.
//
// Layout of the file:
//   [0, 64)                 RingHeader: sizes and offsets, written once by the agent
//   [64, 64 * 8)            seven counters, one cache line each (see RingHeader)
//   [1024, 4096)            why the agent closed the ring, when it did (kReasonOffset)
//   [submission_offset, +)  submission_slots slots of kSlotBytes
//   [completion_offset, +)  completion_entries entries of kCompletionBytes
//
// A submission entry is a SubmissionHeader and its payload, spanning `slots`
// consecutive slots; it never wraps: a client that has too few slots before the end
// of the ring fills them with one kPad entry and starts over at slot 0. Counters are
// free-running uint32 (they wrap; compare differences). The client publishes entries
// by storing sq_tail (release) and, when the agent says it sleeps, writes 1 to the
// submission doorbell; the agent publishes completions by storing cq_tail and, when
// the client says it waits (kWaiting), clears that flag and rings the completion
// doorbell: one ring per sleep, however many completions follow, so a client sets
// kWaiting again (then looks at cq_tail) before each sleep. A client that wants several
// completions per wake-up (kFeatureWakeCount) also stores wake_at, the cq_tail it waits
// for, and sets kWaitCount beside kWaiting: the agent then rings only once cq_tail has
// reached wake_at (or when it closes the ring), so a client with many transfers in
// flight sleeps once per batch of completions instead of once per completion.
//
// Notifications (opt-in: a kWatchNotifications entry): the agent also posts each
// notification the session may take as a kNotification completion, which spans
// `span` consecutive completion entries (its serialized v1::Notification follows the
// header). A completion never wraps: with fewer entries left before the ring's end,
// the agent first posts a kPad completion spanning them. Every other completion spans
// 1, so a ring that does not watch never sees a pad. cq_tail and cq_head count entries.
//
// Trust: the client can write every byte of the file at any time. The agent keeps its
// own copies of the sizes and of the counters it owns (sq_head, cq_tail), reads only
// sq_tail, cq_head, client_flags and wake_at from the file (and only clears kWaiting in the
// latter, which a client may set again at any time), copies an entry out before it
// looks at it, and closes the ring (counted, logged) when the client breaks these
// rules; the client's damage stays in its own ring.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvagent::client::fastring {

inline constexpr uint32_t kMagic = 0x5246564b;  // "KVFR" little-endian
inline constexpr uint32_t kVersion = 1;
inline constexpr uint32_t kSlotBytes = 256;
inline constexpr uint32_t kCompletionBytes = 512;
inline constexpr uint32_t kMinEntries = 8;
inline constexpr uint32_t kMaxEntries = 4096;
inline constexpr uint32_t kDefaultEntries = 1024;

// What a submission entry asks.
enum Opcode : uint16_t {
  kPad = 0,     // fills the slots up to the ring's end; no completion
  // payload: a serialized v1::SubmitTransferRequest. Completes when the transfer ends
  // (COMPLETED, FAILED, CANCELLED, TIMED_OUT) or is refused; a chunk with more_chunks
  // completes once it is taken (as gRPC's `wait`, which only the last chunk honours).
  kSubmit = 1,
  kCancel = 2,  // payload: the transfer id; completes with the state after the cancel
  kPing = 3,    // no payload; completes at once (round-trip probes, tests)
  // payload: a serialized v1::WatchNotificationsRequest (transfer_ids: empty = any, at
  // most agent/notification_queue.h kMaxFilterTransferIds). Completes at once (OK) once
  // the watch is in place; from then on the session's notifications come as
  // kNotification completions carrying this entry's user_data. One per ring. With
  // `subscription` (kFeatureDurableNotifications): the ring attaches to that durable
  // subscription of the session's durable identity, as gRPC WatchNotifications does:
  // the unacknowledged ones first, in order, then new ones, each with its `sequence`;
  // acknowledge them with kAckNotifications (or gRPC AckNotifications).
  kWatchNotifications = 4,
  // Completions only (a submission entry with it is refused as unknown): one
  // notification. phase: its v1::NotificationKind; bytes_done: notification.bytes();
  // message_length: the serialized v1::Notification's size, its bytes running from
  // after the header through the completion's `span` entries. On a durable watch, one
  // spanning more than half the ring comes as a 1-entry kNotification with code
  // RESOURCE_EXHAUSTED and a message naming its sequence (it stays held: take it with
  // gRPC PollNotifications on the subscription).
  kNotification = 5,
  // payload: a serialized v1::AckNotificationsRequest (kFeatureDurableNotifications).
  // Acknowledges as gRPC AckNotifications does, as the session's durable identity;
  // completes at once: code and message as gRPC's (NOT_FOUND for an unknown
  // subscription), bytes_done reused for AckNotificationsResponse.released.
  kAckNotifications = 6,
};

// Bits of FastPathInfo.features: what the agent's ring takes beyond version 1's
// kSubmit, kCancel and kPing. An agent older than a feature lacks its bit, and closes
// the whole ring on an entry with an opcode it does not know, so a client checks the
// bit before it writes such an entry.
// The agent takes kWatchNotifications and posts kNotification completions.
inline constexpr uint32_t kFeatureNotifications = 1;
// The agent takes kWatchNotifications with a subscription, and kAckNotifications.
inline constexpr uint32_t kFeatureDurableNotifications = 2;
// The agent honours kWaitCount and wake_at: it rings the completion doorbell of a
// client waiting for a count only once cq_tail reaches wake_at. An agent without it
// rings at the first completion (the client finds too few, and waits again).
inline constexpr uint32_t kFeatureWakeCount = 4;
// All this build offers.
inline constexpr uint32_t kFeatures =
    kFeatureNotifications | kFeatureDurableNotifications | kFeatureWakeCount;

// OK when `features` (FastPathInfo.features) has kFeatureNotifications; else
// FAILED_PRECONDITION saying the agent is older and what to use instead.
absl::Status CheckNotifications(uint32_t features);
// The same for kFeatureDurableNotifications (`what`: the call refused, for the text).
absl::Status CheckDurableNotifications(uint32_t features, std::string_view what);

// Flags of a submission entry.
inline constexpr uint32_t kFlagNone = 0;

struct SubmissionHeader {
  uint32_t length;     // payload bytes after this header
  uint16_t opcode;     // Opcode
  uint16_t slots;      // slots the entry spans, this header's included (>= 1)
  uint32_t flags;      // 0
  uint32_t reserved;   // 0
  uint64_t user_data;  // echoed in the completion
};
static_assert(sizeof(SubmissionHeader) == 24);
inline constexpr uint32_t kSubmissionHeaderBytes = sizeof(SubmissionHeader);

// What a completion reports.
struct CompletionHeader {
  uint64_t user_data;       // the entry's
  uint16_t opcode;          // the entry's; kNotification, or kPad (spans to the end)
  // Consecutive completion entries this completion occupies, this one included (>= 1):
  // more only for a kNotification (and a kPad); cq_head moves on by span.
  uint16_t span;
  int32_t code;             // absl::StatusCode: the refusal, or the transfer's error
  uint32_t phase;           // v1::TransferPhase (kSubmit, kCancel), v1::NotificationKind
                            // (kNotification); 0 otherwise
  // Bytes of message that follow: cut at kMaxMessage, except a kNotification's
  // serialized Notification, which runs on through its span.
  uint32_t message_length;
  uint64_t bytes_done;
  uint64_t latency_us;      // the transfer's first submit to its end
};
static_assert(sizeof(CompletionHeader) == 40);
inline constexpr uint32_t kMaxMessage = kCompletionBytes - sizeof(CompletionHeader);

// Completion entries a kNotification carrying `bytes` of serialized Notification spans.
inline uint32_t SpanFor(uint64_t bytes) {
  return static_cast<uint32_t>((sizeof(CompletionHeader) + bytes + kCompletionBytes - 1) /
                               kCompletionBytes);
}
// The largest span the agent posts on a ring of `entries` completion entries: half the
// ring, so that one always fits an emptied ring after at most one pad. Larger
// notifications are left to gRPC's takers.
inline uint32_t MaxSpan(uint32_t entries) { return entries / 2; }

struct alignas(64) Counter {
  std::atomic<uint32_t> value{0};
};
static_assert(sizeof(Counter) == 64);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

// Bits of agent_flags and client_flags.
inline constexpr uint32_t kSleeping = 1;  // agent: ring the submission doorbell
inline constexpr uint32_t kWaiting = 1;   // client: ring the completion doorbell (once)
// client, with kWaiting: ring it only once cq_tail reaches wake_at (kFeatureWakeCount)
inline constexpr uint32_t kWaitCount = 2;
inline constexpr uint32_t kClosed = 2;    // agent: this ring is closed (reason in the log)
// agent: notifications wait for room on the completion ring: a client that reaps while
// the agent sleeps (kSleeping) rings the submission doorbell.
inline constexpr uint32_t kRoomWanted = 4;

struct alignas(64) RingHeader {
  uint32_t magic;
  uint32_t version;
  uint32_t submission_slots;
  uint32_t slot_bytes;
  uint32_t completion_entries;
  uint32_t completion_bytes;
  uint64_t submission_offset;
  uint64_t completion_offset;
  uint64_t ring_bytes;
  Counter sq_tail;       // client: slots published
  Counter sq_head;       // agent: slots taken
  Counter cq_tail;       // agent: completions published
  Counter cq_head;       // client: completions reaped
  Counter agent_flags;   // agent: kSleeping, kClosed
  Counter client_flags;  // client: kWaiting, kWaitCount
  // client: with kWaitCount, the cq_tail to ring the completion doorbell at (a
  // free-running count like the others: reached when cq_tail - wake_at, as int32, is
  // not negative). The agent only reads it; a wrong value only delays the client's
  // own wake-up (its wait's timeout still ends it).
  Counter wake_at;
};
static_assert(sizeof(RingHeader) == 64 * 8);

// Where the agent writes why it closed a ring (NUL-terminated), between the header's
// counters and the first slot.
inline constexpr uint32_t kReasonOffset = 1024;
inline constexpr uint32_t kReasonBytes = 3072;
static_assert(sizeof(RingHeader) <= kReasonOffset);

// Sizes and offsets of a ring file.
struct Geometry {
  uint32_t submission_slots = 0;
  uint32_t completion_entries = 0;
  uint64_t submission_offset = 0;
  uint64_t completion_offset = 0;
  uint64_t ring_bytes = 0;
};

// Checks an OpenFastPathRequest's sizes (0 picks the defaults) and lays the file out.
// INVALID_ARGUMENT naming the field, the value and the allowed range.
absl::StatusOr<Geometry> Layout(uint32_t submission_slots, uint32_t completion_entries);

// Slots an entry with `payload` bytes spans.
inline uint32_t SlotsFor(uint64_t payload) {
  return static_cast<uint32_t>((kSubmissionHeaderBytes + payload + kSlotBytes - 1) / kSlotBytes);
}
// The largest payload one entry can carry in a ring of `slots` slots: half the ring,
// so that an entry always fits after at most one pad.
inline uint64_t MaxPayload(uint32_t slots) {
  return static_cast<uint64_t>(slots / 2) * kSlotBytes - kSubmissionHeaderBytes;
}

// The agent's check of the entry at slot `index` (head modulo slots), given a copy of
// its header and `available` published slots from there: the entry must span 1 to
// `available` slots, end at or before the ring's end, carry a payload that fits its
// slots and stay under MaxPayload, use a known opcode (of those `features` offers: an
// agent run with fewer behaves as one built before them), and set flags and reserved
// to 0. A violation is INVALID_ARGUMENT naming it: the agent cannot find the next entry
// after a bad header, so it closes the ring.
absl::Status CheckEntry(const SubmissionHeader& header, uint32_t index, uint32_t available,
                        uint32_t slots, uint32_t features = kFeatures);

const char* OpcodeName(uint16_t opcode);

// The doorbells are eventfds: a ring adds 1 (a full counter, 2^64 - 2 unread rings,
// cannot happen), a drain reads the count back to 0 (nothing to read is fine: they
// are non-blocking).
void RingDoorbell(int fd);
void DrainDoorbell(int fd);

// One pause of a polling loop (both sides poll the rings for a while before sleeping).
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace kvagent::client::fastring
