#include "client/fast_ring.h"

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "catch2/catch.hpp"

namespace kvagent::client::fastring {
namespace {

std::string Message(const absl::Status& status) { return std::string(status.message()); }

SubmissionHeader Entry(uint16_t opcode, uint32_t length, uint16_t slots) {
  SubmissionHeader h{};
  h.opcode = opcode;
  h.length = length;
  h.slots = slots;
  h.user_data = 42;
  return h;
}

// An entry as an honest client writes it.
SubmissionHeader Honest(uint16_t opcode, uint32_t length) {
  return Entry(opcode, length, static_cast<uint16_t>(SlotsFor(length)));
}

TEST_CASE("Layout: 0 picks 1024 submission slots, and completions as many as slots") {
  auto g = Layout(0, 0);
  REQUIRE(g.ok());
  CHECK(g->submission_slots == kDefaultEntries);
  CHECK(g->completion_entries == kDefaultEntries);
  CHECK(g->submission_offset == 4096);  // the header and the reason fill the first page
  CHECK(g->completion_offset == 4096 + 1024 * kSlotBytes);
  CHECK(g->ring_bytes == 4096 + 1024 * kSlotBytes + 1024 * kCompletionBytes);

  auto same = Layout(16, 0);
  REQUIRE(same.ok());
  CHECK(same->submission_slots == 16);
  CHECK(same->completion_entries == 16);

  auto apart = Layout(0, 8);
  REQUIRE(apart.ok());
  CHECK(apart->submission_slots == 1024);
  CHECK(apart->completion_entries == 8);
}

TEST_CASE("Layout: every power of two from 8 to 4096, each area on its own pages") {
  for (uint32_t sq = kMinEntries; sq <= kMaxEntries; sq *= 2) {
    for (uint32_t cq = kMinEntries; cq <= kMaxEntries; cq *= 2) {
      INFO(sq << " slots, " << cq << " completions");
      auto g = Layout(sq, cq);
      REQUIRE(g.ok());
      CHECK(g->submission_slots == sq);
      CHECK(g->completion_entries == cq);
      CHECK(g->submission_offset >= sizeof(RingHeader));
      CHECK(g->submission_offset >= kReasonOffset + kReasonBytes);
      CHECK(g->submission_offset % 4096 == 0);
      CHECK(g->completion_offset % 4096 == 0);
      CHECK(g->ring_bytes % 4096 == 0);
      CHECK(g->completion_offset >= g->submission_offset + uint64_t{sq} * kSlotBytes);
      CHECK(g->ring_bytes >= g->completion_offset + uint64_t{cq} * kCompletionBytes);
    }
  }
  // The smallest ring: 8 slots (2 KiB) and 8 completions (4 KiB), one page each.
  auto small = Layout(8, 8);
  REQUIRE(small.ok());
  CHECK(small->completion_offset == 8192);
  CHECK(small->ring_bytes == 12288);
}

TEST_CASE("Layout refuses sizes that are not powers of two from 8 to 4096, naming the field") {
  struct Case {
    uint32_t sq, cq;
    const char* message;
  };
  const Case cases[] = {
      {4, 0,
       "OpenFastPathRequest.submission_slots is 4; it must be a power of two from 8 to 4096 (0 "
       "picks 1024)"},
      {8192, 0, "OpenFastPathRequest.submission_slots is 8192;"},
      {12, 16, "OpenFastPathRequest.submission_slots is 12;"},
      {1, 8, "OpenFastPathRequest.submission_slots is 1;"},
      {0xffffffffu, 8, "OpenFastPathRequest.submission_slots is 4294967295;"},
      {16, 4,
       "OpenFastPathRequest.completion_entries is 4; it must be a power of two from 8 to 4096 (0 "
       "picks 16)"},
      {16, 24, "OpenFastPathRequest.completion_entries is 24;"},
      {0, 8192,
       "OpenFastPathRequest.completion_entries is 8192; it must be a power of two from 8 to 4096 "
       "(0 picks 1024)"},
  };
  for (const Case& c : cases) {
    INFO(c.sq << " slots, " << c.cq << " completions");
    auto g = Layout(c.sq, c.cq);
    REQUIRE_FALSE(g.ok());
    CHECK(g.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(Message(g.status()), Catch::StartsWith(c.message));
  }
}

TEST_CASE("SlotsFor counts the header; MaxPayload is half the ring less the header") {
  CHECK(SlotsFor(0) == 1);
  CHECK(SlotsFor(kSlotBytes - kSubmissionHeaderBytes) == 1);
  CHECK(SlotsFor(kSlotBytes - kSubmissionHeaderBytes + 1) == 2);
  CHECK(SlotsFor(0xffffffffu) ==
        (uint64_t{0xffffffffu} + kSubmissionHeaderBytes + kSlotBytes - 1) / kSlotBytes);
  CHECK(MaxPayload(8) == 4 * kSlotBytes - kSubmissionHeaderBytes);
  CHECK(MaxPayload(4096) == 2048 * kSlotBytes - kSubmissionHeaderBytes);
  CHECK(SlotsFor(MaxPayload(8)) == 4);
}

TEST_CASE("CheckEntry accepts what an honest client writes") {
  CHECK(CheckEntry(Honest(kPing, 0), 0, 1, 8).ok());
  CHECK(CheckEntry(Honest(kCancel, 5), 3, 1, 8).ok());
  CHECK(CheckEntry(Honest(kSubmit, 300), 6, 2, 8).ok());  // ends at the ring's end
  CHECK(CheckEntry(Honest(kSubmit, MaxPayload(8)), 0, 8, 8).ok());
  CHECK(CheckEntry(Entry(kPad, 0, 3), 5, 3, 8).ok());  // pads to the end
  CHECK(CheckEntry(Entry(kPad, 0, 1), 0, 8, 8).ok());  // a pad may be anywhere
  CHECK(CheckEntry(Honest(kSubmit, MaxPayload(4096)), 0, 4096, 4096).ok());
}

TEST_CASE("CheckEntry: an entry spans 1 to the published slots") {
  auto zero = CheckEntry(Entry(kPing, 0, 0), 2, 5, 8);
  CHECK(zero.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(zero), Catch::StartsWith("entry at slot 2 spans 0 slots but 5 are published"));
  // Two slots written, one published.
  auto beyond = CheckEntry(Honest(kSubmit, 300), 0, 1, 8);
  CHECK(beyond.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(beyond),
             Catch::StartsWith("entry at slot 0 spans 2 slots but 1 are published"));
  CHECK(CheckEntry(Honest(kSubmit, 300), 0, 2, 8).ok());
  auto pad = CheckEntry(Entry(kPad, 0, 4), 4, 3, 8);
  CHECK_THAT(Message(pad), Catch::StartsWith("entry at slot 4 spans 4 slots but 3 are published"));
}

TEST_CASE("CheckEntry: an entry never wraps past the ring's end") {
  auto wraps = CheckEntry(Honest(kSubmit, 300), 7, 8, 8);
  CHECK(wraps.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(wraps),
             Catch::StartsWith("entry at slot 7 spans 2 slots past the ring's end (8 slots)"));
  CHECK_THAT(Message(wraps), Catch::Contains("pad to the end"));
  auto pad = CheckEntry(Entry(kPad, 0, 2), 7, 8, 8);
  CHECK_THAT(Message(pad), Catch::StartsWith("entry at slot 7 spans 2 slots past the ring's end"));
  CHECK(CheckEntry(Entry(kPad, 0, 1), 7, 8, 8).ok());
}

TEST_CASE("CheckEntry: a pad carries no payload") {
  auto pad = CheckEntry(Entry(kPad, 5, 1), 3, 4, 8);
  CHECK(pad.code() == absl::StatusCode::kInvalidArgument);
  CHECK(Message(pad) == "pad entry at slot 3 has a 5-byte payload; a pad carries none");
  CHECK(CheckEntry(Entry(kPad, 0, 1), 3, 4, 8).ok());
}

TEST_CASE("CheckEntry: only opcodes this agent knows") {
  // kNotification (5) is a completion's opcode: in a submission it is as unknown.
  for (uint16_t opcode : {uint16_t{kNotification}, uint16_t{7}, uint16_t{0x100}, uint16_t{0xffff}}) {
    INFO("opcode " << opcode);
    auto unknown = CheckEntry(Entry(opcode, 0, 1), 1, 4, 8);
    CHECK(unknown.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(Message(unknown),
               Catch::StartsWith("entry at slot 1 has opcode " + std::to_string(opcode) +
                                 ", which this agent does not take in a submission (pad 0, "
                                 "submit 1, cancel 2, ping 3, watch-notifications 4, "
                                 "ack-notifications 6; notification 5 only comes in "
                                 "completions)"));
  }
  CHECK(CheckEntry(Honest(kWatchNotifications, 0), 1, 4, 8).ok());
  CHECK(CheckEntry(Honest(kWatchNotifications, 40), 1, 4, 8).ok());
  CHECK(CheckEntry(Honest(kAckNotifications, 0), 1, 4, 8).ok());
  CHECK(CheckEntry(Honest(kAckNotifications, 40), 1, 4, 8).ok());
  // An agent run with fewer features takes their opcodes as an older agent does: as
  // unknown (the ring closes), saying which it takes.
  auto old_ack = CheckEntry(Honest(kAckNotifications, 0), 1, 4, 8, kFeatureNotifications);
  CHECK(old_ack.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(old_ack), Catch::StartsWith(
                                   "entry at slot 1 has opcode 6, which this agent does not "
                                   "take in a submission (pad 0, submit 1, cancel 2, ping 3, "
                                   "watch-notifications 4; notification 5"));
  CHECK_THAT(Message(old_ack), Catch::Contains("FastPathInfo.features (this ring's: 0x1)"));
  auto old_watch = CheckEntry(Honest(kWatchNotifications, 0), 1, 4, 8, 0);
  CHECK_THAT(Message(old_watch), Catch::StartsWith(
                                     "entry at slot 1 has opcode 4, which this agent does not "
                                     "take in a submission (pad 0, submit 1, cancel 2, ping 3; "
                                     "notification 5"));
  CHECK(CheckEntry(Honest(kPing, 0), 1, 4, 8, 0).ok());
  CHECK(std::string(OpcodeName(kPad)) == "pad");
  CHECK(std::string(OpcodeName(kSubmit)) == "submit");
  CHECK(std::string(OpcodeName(kCancel)) == "cancel");
  CHECK(std::string(OpcodeName(kPing)) == "ping");
  CHECK(std::string(OpcodeName(kWatchNotifications)) == "watch-notifications");
  CHECK(std::string(OpcodeName(kNotification)) == "notification");
  CHECK(std::string(OpcodeName(kAckNotifications)) == "ack-notifications");
  CHECK(std::string(OpcodeName(7)) == "unknown");
}

TEST_CASE("CheckNotifications: an agent without the feature bit is not sent a watch") {
  CHECK(kFeatureNotifications == 1);  // FastPathInfo.features' wire value: never changes
  CHECK((kFeatures & kFeatureNotifications) != 0);
  CHECK(CheckNotifications(kFeatureNotifications).ok());
  CHECK(CheckNotifications(kFeatureNotifications | 0x80).ok());  // unknown bits ignored
  for (uint32_t features : {0u, 4u, 0x80000000u}) {
    INFO(features);
    const absl::Status older = CheckNotifications(features);
    CHECK(older.code() == absl::StatusCode::kFailedPrecondition);
    CHECK(Message(older) ==
          "this agent's fast path does not deliver notifications (it is older than this "
          "client: FastPathInfo.features lacks notifications); take them with gRPC "
          "WatchNotifications, or upgrade the agent");
  }
}

TEST_CASE("CheckDurableNotifications: an agent without the bit is sent no subscription watch nor ack") {
  CHECK(kFeatureDurableNotifications == 2);  // FastPathInfo.features' wire value: never changes
  CHECK((kFeatures & kFeatureDurableNotifications) != 0);
  CHECK(CheckDurableNotifications(kFeatureDurableNotifications, "x").ok());
  CHECK(CheckDurableNotifications(kFeatures | 0x80, "x").ok());
  for (uint32_t features : {0u, 1u, 0x80000000u}) {
    INFO(features);
    const absl::Status older = CheckDurableNotifications(features, "AckNotifications");
    CHECK(older.code() == absl::StatusCode::kFailedPrecondition);
    CHECK(Message(older) ==
          "AckNotifications: this agent's fast path has no durable subscriptions (it is older "
          "than this client: FastPathInfo.features lacks durable notifications); use gRPC "
          "WatchNotifications / AckNotifications with the subscription, or upgrade the agent");
  }
}

TEST_CASE("RingHeader: the counters where the Python client reads them, wake_at the last") {
  // python/kvagent/fast_path.py's word indices (x4): SQ_TAIL 16 ... CLIENT_FLAGS 96,
  // WAKE_AT 112; an older agent never touches wake_at's line (its header ended before).
  CHECK(offsetof(RingHeader, sq_tail) == 64);
  CHECK(offsetof(RingHeader, client_flags) == 384);
  CHECK(offsetof(RingHeader, wake_at) == 448);
  CHECK(sizeof(RingHeader) <= kReasonOffset);
  CHECK((kFeatures & kFeatureWakeCount) != 0);
  CHECK((kWaitCount & kWaiting) == 0);
}

TEST_CASE("SpanFor counts the completion header; MaxSpan is half the completion ring") {
  CHECK(sizeof(CompletionHeader) == 40);
  CHECK(offsetof(CompletionHeader, span) == 10);  // the old reserved field: 0 never sent
  CHECK(SpanFor(0) == 1);
  CHECK(SpanFor(kMaxMessage) == 1);
  CHECK(SpanFor(kMaxMessage + 1) == 2);
  CHECK(SpanFor(kCompletionBytes + kMaxMessage) == 2);
  CHECK(SpanFor(16 << 10) == 33);
  CHECK(MaxSpan(8) == 4);
  CHECK(MaxSpan(16) == 8);
  CHECK(MaxSpan(4096) == 2048);
  // A completion of MaxSpan entries and its pad (fewer entries than its span) fit an
  // emptied ring with one completion reserved.
  for (uint32_t entries = kMinEntries; entries <= kMaxEntries; entries *= 2) {
    const uint32_t span = MaxSpan(entries);
    CHECK((span - 1) + span + 1 <= entries);
  }
}

TEST_CASE("CheckEntry: the payload fills exactly its slots and at most half the ring") {
  // 300 bytes need 2 slots: 1 and 3 are refused.
  auto few = CheckEntry(Entry(kSubmit, 300, 1), 0, 8, 8);
  CHECK(few.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(few),
             Catch::StartsWith("submit entry at slot 0 carries 300 payload bytes in 1 "
                               "slots (it needs exactly 2, and at most 1000 bytes fit "
                               "one entry of this ring)"));
  auto many = CheckEntry(Entry(kCancel, 300, 3), 0, 8, 8);
  CHECK_THAT(Message(many),
             Catch::StartsWith("cancel entry at slot 0 carries 300 payload bytes in 3 slots"));
  // A ping's payload is counted too (it has none to carry, but a length is a length).
  auto ping = CheckEntry(Entry(kPing, 233, 1), 0, 8, 8);
  CHECK_THAT(Message(ping),
             Catch::StartsWith("ping entry at slot 0 carries 233 payload bytes in 1 slots"));
  CHECK(CheckEntry(Entry(kPing, 232, 1), 0, 8, 8).ok());
  // One byte over half the ring, in the slots it would take.
  const uint32_t over = static_cast<uint32_t>(MaxPayload(8) + 1);
  auto large = CheckEntry(Honest(kSubmit, over), 0, 8, 8);
  CHECK(large.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(large),
             Catch::StartsWith("submit entry at slot 0 carries 1001 payload bytes in 5 slots"));
  CHECK(CheckEntry(Honest(kSubmit, over - 1), 0, 8, 8).ok());
  // A length far beyond the ring, whatever the slot count says.
  auto huge = CheckEntry(Entry(kSubmit, 0xffffffffu, 8), 0, 8, 8);
  CHECK_THAT(Message(huge),
             Catch::StartsWith("submit entry at slot 0 carries 4294967295 payload bytes"));
}

TEST_CASE("CheckEntry: flags and reserved are 0") {
  SubmissionHeader flags = Honest(kPing, 0);
  flags.flags = 0x10;
  auto f = CheckEntry(flags, 2, 4, 8);
  CHECK(f.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(f), Catch::StartsWith("ping entry at slot 2 sets flags 0x10 and reserved 0x0; "
                                           "both must be 0 in ring version 1"));
  SubmissionHeader reserved = Honest(kSubmit, 10);
  reserved.reserved = 1;
  CHECK_THAT(Message(CheckEntry(reserved, 0, 4, 8)),
             Catch::StartsWith("submit entry at slot 0 sets flags 0x0 and reserved 0x1"));
  SubmissionHeader pad = Entry(kPad, 0, 2);
  pad.flags = 1;
  CHECK_THAT(Message(CheckEntry(pad, 6, 2, 8)),
             Catch::StartsWith("pad entry at slot 6 sets flags 0x1 and reserved 0x0"));
  // user_data is the client's: anything goes.
  SubmissionHeader user = Honest(kPing, 0);
  user.user_data = ~uint64_t{0};
  CHECK(CheckEntry(user, 0, 1, 8).ok());
}

}  // namespace
}  // namespace kvagent::client::fastring
