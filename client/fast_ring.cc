#include "client/fast_ring.h"

#include <unistd.h>

#include "absl/status/status.h"
#include "fmt/format.h"

namespace kvagent::client::fastring {
namespace {

absl::StatusOr<uint32_t> CheckCount(uint32_t value, uint32_t fallback, const char* field) {
  if (value == 0) value = fallback;
  if (value < kMinEntries || value > kMaxEntries || (value & (value - 1)) != 0) {
    return absl::InvalidArgumentError(fmt::format(
        "OpenFastPathRequest.{} is {}; it must be a power of two from {} to {} (0 picks {})",
        field, value, kMinEntries, kMaxEntries, fallback));
  }
  return value;
}

uint64_t RoundUp(uint64_t value, uint64_t to) { return (value + to - 1) / to * to; }

}  // namespace

absl::StatusOr<Geometry> Layout(uint32_t submission_slots, uint32_t completion_entries) {
  Geometry g;
  absl::StatusOr<uint32_t> sq = CheckCount(submission_slots, kDefaultEntries, "submission_slots");
  if (!sq.ok()) return sq.status();
  absl::StatusOr<uint32_t> cq = CheckCount(completion_entries, *sq, "completion_entries");
  if (!cq.ok()) return cq.status();
  g.submission_slots = *sq;
  g.completion_entries = *cq;
  g.submission_offset = RoundUp(sizeof(RingHeader), 4096);
  g.completion_offset = g.submission_offset + RoundUp(uint64_t{*sq} * kSlotBytes, 4096);
  g.ring_bytes = g.completion_offset + RoundUp(uint64_t{*cq} * kCompletionBytes, 4096);
  return g;
}

absl::Status CheckNotifications(uint32_t features) {
  if ((features & kFeatureNotifications) != 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "this agent's fast path does not deliver notifications (it is older than this client: "
      "FastPathInfo.features lacks notifications); take them with gRPC WatchNotifications, "
      "or upgrade the agent");
}

absl::Status CheckDurableNotifications(uint32_t features, std::string_view what) {
  if ((features & kFeatureDurableNotifications) != 0) return absl::OkStatus();
  return absl::FailedPreconditionError(fmt::format(
      "{}: this agent's fast path has no durable subscriptions (it is older than this client: "
      "FastPathInfo.features lacks durable notifications); use gRPC WatchNotifications / "
      "AckNotifications with the subscription, or upgrade the agent",
      what));
}

void RingDoorbell(int fd) {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(fd, &one, sizeof(one));
}

void DrainDoorbell(int fd) {
  uint64_t value;
  [[maybe_unused]] ssize_t n = ::read(fd, &value, sizeof(value));
}

const char* OpcodeName(uint16_t opcode) {
  switch (opcode) {
    case kPad: return "pad";
    case kSubmit: return "submit";
    case kCancel: return "cancel";
    case kPing: return "ping";
    case kWatchNotifications: return "watch-notifications";
    case kNotification: return "notification";
    case kAckNotifications: return "ack-notifications";
  }
  return "unknown";
}

absl::Status CheckEntry(const SubmissionHeader& header, uint32_t index, uint32_t available,
                        uint32_t slots, uint32_t features) {
  const char* name = OpcodeName(header.opcode);
  if (header.slots == 0 || header.slots > available) {
    return absl::InvalidArgumentError(fmt::format(
        "entry at slot {} spans {} slots but {} are published (sq_tail - sq_head); write the "
        "whole entry before storing sq_tail, and count its header's slot",
        index, header.slots, available));
  }
  if (uint64_t{index} + header.slots > slots) {
    return absl::InvalidArgumentError(fmt::format(
        "entry at slot {} spans {} slots past the ring's end ({} slots); entries never wrap: "
        "pad to the end (opcode pad) and start at slot 0",
        index, header.slots, slots));
  }
  if (header.opcode == kPad) {
    if (header.length != 0) {
      return absl::InvalidArgumentError(fmt::format(
          "pad entry at slot {} has a {}-byte payload; a pad carries none", index, header.length));
    }
  } else if (header.opcode != kSubmit && header.opcode != kCancel && header.opcode != kPing &&
             !(header.opcode == kWatchNotifications && (features & kFeatureNotifications)) &&
             !(header.opcode == kAckNotifications &&
               (features & kFeatureDurableNotifications))) {
    return absl::InvalidArgumentError(fmt::format(
        "entry at slot {} has opcode {}, which this agent does not take in a submission (pad "
        "0, submit 1, cancel 2, ping 3{}{}; notification 5 only comes in completions); use a "
        "client that checks FastPathInfo.features (this ring's: {:#x}) and matches the agent "
        "(ring version {})",
        index, header.opcode,
        (features & kFeatureNotifications) ? ", watch-notifications 4" : "",
        (features & kFeatureDurableNotifications) ? ", ack-notifications 6" : "", features,
        kVersion));
  } else if (header.slots != SlotsFor(header.length) || header.length > MaxPayload(slots)) {
    return absl::InvalidArgumentError(fmt::format(
        "{} entry at slot {} carries {} payload bytes in {} slots (it needs exactly {}, and "
        "at most {} bytes fit one entry of this ring); the slot count is "
        "ceil((24 + length) / {})",
        name, index, header.length, header.slots, SlotsFor(header.length), MaxPayload(slots),
        kSlotBytes));
  }
  if (header.flags != 0 || header.reserved != 0) {
    return absl::InvalidArgumentError(fmt::format(
        "{} entry at slot {} sets flags {:#x} and reserved {:#x}; both must be 0 in ring "
        "version {}",
        name, index, header.flags, header.reserved, kVersion));
  }
  return absl::OkStatus();
}

}  // namespace kvagent::client::fastring
