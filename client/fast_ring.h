// The local fast path's shared-memory layout (proto OpenFastPathRequest): one file
// the agent creates per session, mapped by both sides, holding a submission ring (the
// client produces, the agent consumes) and a completion ring (the agent produces, the
// client consumes), and two eventfd doorbells beside it. Shared by the agent
// (agent/fast_path) and the client (client/fast_path); no policy lives here.
//
// Layout of the file:
//   [0, 64)                 RingHeader: sizes and offsets, written once by the agent
//   [64, 64 * 7)            six counters, one cache line each (see RingHeader)
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
// kWaiting again (then looks at cq_tail) before each sleep.
//
// Trust: the client can write every byte of the file at any time. The agent keeps its
// own copies of the sizes and of the counters it owns (sq_head, cq_tail), reads only
// sq_tail, cq_head and client_flags from the file (and only clears kWaiting in the
// latter, which a client may set again at any time), copies an entry out before it
// looks at it, and closes the ring (counted, logged) when the client breaks these
// rules; the client's damage stays in its own ring.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

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
};

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
  uint16_t opcode;          // the entry's
  uint16_t reserved;
  int32_t code;             // absl::StatusCode: the refusal, or the transfer's error
  uint32_t phase;           // v1::TransferPhase (kSubmit, kCancel); 0 otherwise
  uint32_t message_length;  // bytes of message that follow (cut at kMaxMessage)
  uint64_t bytes_done;
  uint64_t latency_us;      // the transfer's first submit to its end
};
static_assert(sizeof(CompletionHeader) == 40);
inline constexpr uint32_t kMaxMessage = kCompletionBytes - sizeof(CompletionHeader);

struct alignas(64) Counter {
  std::atomic<uint32_t> value{0};
};
static_assert(sizeof(Counter) == 64);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

// Bits of agent_flags and client_flags.
inline constexpr uint32_t kSleeping = 1;  // agent: ring the submission doorbell
inline constexpr uint32_t kWaiting = 1;   // client: ring the completion doorbell (once)
inline constexpr uint32_t kClosed = 2;    // agent: this ring is closed (reason in the log)

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
  Counter client_flags;  // client: kWaiting
};
static_assert(sizeof(RingHeader) == 64 * 7);

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
// slots and stay under MaxPayload, use a known opcode, and set flags and reserved to 0.
// A violation is INVALID_ARGUMENT naming it: the agent cannot find the next entry
// after a bad header, so it closes the ring.
absl::Status CheckEntry(const SubmissionHeader& header, uint32_t index, uint32_t available,
                        uint32_t slots);

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
