// What a hostile peer can hold on the receiving side, without daemons. A DATA_READY
// that no PEER_TRANSFER_OPEN came before, and no commit after, once had no deadline:
// its record kept an active slot and its room reserved in the notification queue for
// the agent's life. Now it ends TIMED_OUT after unopened_timeout_ms plus grace, like an
// opened transfer after its deadline: its owners hear it once, the slot and the
// reservation come back. A peer's open may not ask for more than max_peer_timeout_ms
// from the transfer's first notice, however often it is sent.
// One sender holds at most max_active_per_sender of the open records; past it its
// transfers go untracked, and another sender's are still tracked.
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "agent/incoming.h"
#include "agent/limits.h"
#include "agent/notification_queue.h"
#include "agent/status_util.h"
#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "proto/kvagent.pb.h"
#include "proto/wire.pb.h"
#include "registry/region_registry.h"
#include "tests/unit/incoming/incoming_util.h"
#include "tests/unit/registry/test_util.h"

namespace kvagent::agent {
namespace {

using Catch::Matchers::Contains;

constexpr uint64_t kNever = UINT64_MAX;
constexpr uint64_t kMaxWaitUs = 5 * 1000 * 1000;  // no step of these tests waits longer

v1::Notification Notice(const std::string& id, v1::NotificationKind kind,
                        const std::string& from = "eve") {
  v1::Notification n;
  n.set_from_agent(from);
  n.set_sender_incarnation(1);
  n.set_transfer_id(id);
  n.set_kind(kind);
  n.set_bytes(4096);
  n.add_targets("dst");  // the decode region
  return n;
}

// Eve's DATA_READY: an ack token, a payload, a region of ours as target. No open before.
v1::Notification DataReady(const std::string& id, const std::string& from = "eve") {
  v1::Notification n = Notice(id, v1::DATA_READY, from);
  n.set_ack_token(1000 + id.size());
  n.set_payload(std::string(512, 'e'));
  return n;
}

using testing::Delivered;
using testing::SleepUntil;

// The receiver: one region "dst" owned by "decode-engine", a queue with room for
// `queue_slots` notifications (reserved or queued), and every acknowledgement kept.
struct Receiver {
  registry::RegionRegistry regions{&registry::testing::Context()};
  registry::ShmMapping shm = registry::testing::MakeShm(4096);
  Limits limits;
  NotificationQueue queue{&limits};
  std::vector<wire::TransferAck> acks;
  IncomingTransfers incoming;

  Receiver(IncomingOptions options, uint64_t queue_slots)
      : incoming(options, &regions, &queue,
                 [this](const transport::ReplyEndpoint&, const wire::TransferAck& ack) {
                   acks.push_back(ack);
                 }) {
    limits.set(Limit::kQueuedNotifications, queue_slots);
    REQUIRE(regions
                .Register({registry::testing::Spec("dst", shm.name(), 0, 4096, 1, 4096)}, false,
                          registry::testing::Registrant("decode-engine"))
                .ok());
  }

  // A DATA_READY with nothing staged (its data "in place" at once), as the engine hands
  // it over; returns its acknowledgement's status.
  absl::Status Ready(v1::Notification n) {
    static int endpoint;
    const size_t before = acks.size();
    incoming.OnDataReady(std::move(n), transport::ReplyEndpoint{&endpoint}, absl::OkStatus());
    REQUIRE(acks.size() == before + 1);
    const wire::TransferAck& ack = acks.back();
    return absl::Status(static_cast<absl::StatusCode>(ack.error_code()), ack.error_message());
  }
};

IncomingOptions Options() {
  IncomingOptions options;
  options.self_name = "decode";
  options.grace_ms = 20;
  options.unopened_timeout_ms = 150;
  return options;
}

TEST_CASE("a DATA_READY never opened nor committed ends by a deadline and gives back its room") {
  Receiver r(Options(), /*queue_slots=*/2);
  const uint64_t first_heard = MonotonicMicros();
  // Two fill the queue's room: each is acknowledged (its data is in place) and waits,
  // holding its reservation, for a commit that never comes.
  CHECK(r.Ready(DataReady("held-1")).ok());
  CHECK(r.Ready(DataReady("held-2")).ok());
  CHECK(r.incoming.active() == 2);
  // A third finds no room: refused back to eve (its transfer fails), not held.
  const absl::Status full = r.Ready(DataReady("held-3"));
  CHECK(full.code() == absl::StatusCode::kResourceExhausted);
  CHECK(r.incoming.active() == 2);
  CHECK(Delivered(r.queue).empty());  // nothing reaches the owner before a commit

  // They are due: unopened_timeout_ms plus grace after they were first heard of.
  const uint64_t due = r.incoming.NextExpiry();
  std::printf("unopened DATA_READY: NextExpiry %s\n",
              due == kNever ? "never" : fmt::format("in {} us", due - first_heard).c_str());
  REQUIRE(due != kNever);
  CHECK(due >= first_heard + (150 + 20) * 1000);
  CHECK(due <= MonotonicMicros() + (150 + 20) * 1000);
  r.incoming.Expire();  // not yet (unless this thread stalled past `due` meanwhile)
  if (MonotonicMicros() < due) CHECK(r.incoming.active() == 2);
  REQUIRE(due < MonotonicMicros() + kMaxWaitUs);
  SleepUntil(due);
  r.incoming.Expire();
  // held-2 was heard a moment after held-1 (milliseconds under load): its deadline may
  // come that much later. Sleep until it as the deadline thread does (NextExpiry).
  for (int i = 0; i < 2 && r.incoming.active() > 0; ++i) {
    const uint64_t next = r.incoming.NextExpiry();
    REQUIRE(next != kNever);
    REQUIRE(next < MonotonicMicros() + kMaxWaitUs);
    SleepUntil(next);
    r.incoming.Expire();
  }

  // Ended as an opened transfer ends at its deadline: the owner hears TIMED_OUT once
  // each, through the reservation each held; the slots are free.
  CHECK(r.incoming.active() == 0);
  std::vector<v1::Notification> out = Delivered(r.queue);
  REQUIRE(out.size() == 2);
  for (const auto& n : out) {
    CHECK(n.kind() == v1::TRANSFER_TIMED_OUT);
    CHECK(n.from_agent() == "eve");
    CHECK(n.error_code() == static_cast<int32_t>(absl::StatusCode::kDeadlineExceeded));
    CHECK_THAT(n.error_message(), Contains("never opened the transfer here") &&
                                      Contains("150 ms"));
  }
  CHECK(r.incoming.NextExpiry() == kNever);
  // The room is back: a new transfer's DATA_READY is acknowledged again, and a late
  // commit of an expired one delivers nothing more.
  r.incoming.OnNotice(Notice("held-1", v1::PEER_DATA_COMMIT), {});
  CHECK(r.Ready(DataReady("after", "prefill")).ok());
  r.incoming.OnNotice(Notice("after", v1::PEER_DATA_COMMIT, "prefill"), {});
  out = Delivered(r.queue);
  REQUIRE(out.size() == 1);
  CHECK(out[0].transfer_id() == "after");
  CHECK(out[0].kind() == v1::DATA_READY);
  Caller owner;
  owner.principal = "decode-engine";
  auto state = r.incoming.Get("eve", "held-2", owner);
  REQUIRE(state.ok());
  CHECK(state->phase() == v1::TIMED_OUT);
}

TEST_CASE("a peer's open may not hold its record past max_peer_timeout_ms") {
  IncomingOptions options = Options();
  options.max_peer_timeout_ms = 100;
  Receiver r(options, /*queue_slots=*/8);
  v1::Notification open = Notice("forever", v1::PEER_TRANSFER_OPEN);
  open.set_op(v1::WRITE);
  open.set_timeout_ms(UINT32_MAX);  // 49.7 days
  const uint64_t opened = MonotonicMicros();
  r.incoming.OnNotice(open, {});
  CHECK(r.Ready(DataReady("forever")).ok());
  const uint64_t due = r.incoming.NextExpiry();
  std::printf("open with timeout_ms UINT32_MAX: due in %.1f s\n",
              static_cast<double>(due - opened) / 1e6);
  REQUIRE(due <= MonotonicMicros() + (100 + 20) * 1000);
  // Opened again halfway: its deadline stays counted from its first notice.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  r.incoming.OnNotice(open, {});
  SleepUntil(due);
  r.incoming.Expire();
  CHECK(r.incoming.active() == 0);
  std::vector<v1::Notification> out = Delivered(r.queue);
  REQUIRE(out.size() == 1);
  CHECK(out[0].kind() == v1::TRANSFER_TIMED_OUT);
  CHECK_THAT(out[0].error_message(),
             Contains("cut to the 100 ms from its first notice this agent allows a peer"));
  // An open within the bound keeps its own deadline.
  open.set_transfer_id("short");
  open.set_timeout_ms(40);
  const uint64_t short_opened = MonotonicMicros();
  r.incoming.OnNotice(open, {});
  CHECK(r.incoming.NextExpiry() <= MonotonicMicros() + (40 + 20) * 1000);
  CHECK(r.incoming.NextExpiry() >= short_opened + (40 + 20) * 1000);
}

TEST_CASE("a DATA_READY carrying the open (kWireOpenInDataReady) opens as the open would") {
  IncomingOptions options = Options();
  options.max_peer_timeout_ms = 100;
  options.max_active = 1;  // the second transfer below goes untracked
  Receiver r(options, /*queue_slots=*/8);
  Caller owner;
  owner.principal = "decode-engine";
  // A same-host copy's DATA_READY with its open inside: the sender's op and deadline.
  v1::Notification folded = DataReady("folded");
  folded.set_op(v1::WRITE);
  folded.set_timeout_ms(40);
  const uint64_t heard = MonotonicMicros();
  CHECK(r.Ready(folded).ok());
  auto state = r.incoming.Get("eve", "folded", owner);
  REQUIRE(state.ok());
  CHECK(state->op() == v1::WRITE);  // a DATA_READY alone leaves it unset
  // Its deadline is the sender's 40 ms (plus grace), not the unopened 150 ms.
  const uint64_t due = r.incoming.NextExpiry();
  REQUIRE(due != kNever);
  CHECK(due >= heard + (40 + 20) * 1000);
  CHECK(due <= MonotonicMicros() + (40 + 20) * 1000);
  CHECK(Delivered(r.queue).empty());  // held for the commit, as before
  // Committed: the owner gets a plain DATA_READY, without the open's fields.
  r.incoming.OnNotice(Notice("folded", v1::PEER_DATA_COMMIT), {});
  std::vector<v1::Notification> out = Delivered(r.queue);
  REQUIRE(out.size() == 1);
  CHECK(out[0].kind() == v1::DATA_READY);
  CHECK(out[0].payload() == std::string(512, 'e'));
  CHECK(out[0].timeout_ms() == 0);
  CHECK(out[0].op() == v1::TRANSFER_OP_UNSPECIFIED);
  // A folded open asks no more than an open may: cut to max_peer_timeout_ms.
  v1::Notification greedy = DataReady("greedy");
  greedy.set_op(v1::WRITE);
  greedy.set_timeout_ms(UINT32_MAX);
  const uint64_t greedy_heard = MonotonicMicros();
  CHECK(r.Ready(greedy).ok());
  state = r.incoming.Get("eve", "greedy", owner);
  REQUIRE(state.ok());
  CHECK(state->op() == v1::WRITE);
  // Untracked (no room: max_active 1, "greedy" holds it): acknowledged and delivered at
  // once, also without the open's fields.
  v1::Notification lone = DataReady("lone");
  lone.set_op(v1::WRITE);
  lone.set_timeout_ms(40);
  CHECK(r.Ready(lone).ok());
  CHECK(r.incoming.untracked() == 1);
  out = Delivered(r.queue);
  REQUIRE(out.size() == 1);
  CHECK(out[0].transfer_id() == "lone");
  CHECK(out[0].timeout_ms() == 0);
  CHECK(out[0].op() == v1::TRANSFER_OP_UNSPECIFIED);
  // "greedy" ends by the bound, not in 49.7 days (nor by the unopened 150 ms: opened).
  while (r.incoming.active() > 0) {
    const uint64_t next = r.incoming.NextExpiry();
    REQUIRE(next != kNever);
    REQUIRE(next < MonotonicMicros() + kMaxWaitUs);
    SleepUntil(next);
    r.incoming.Expire();
  }
  CHECK(MonotonicMicros() >= greedy_heard + (100 + 20) * 1000);
  out = Delivered(r.queue);
  REQUIRE(out.size() == 1);
  CHECK(out[0].transfer_id() == "greedy");
  CHECK(out[0].kind() == v1::TRANSFER_TIMED_OUT);
  CHECK_THAT(out[0].error_message(),
             Contains("cut to the 100 ms from its first notice this agent allows a peer"));
}

TEST_CASE("a committed DATA_READY (kWireCommitInDataReady) is delivered once acknowledged") {
  IncomingOptions options = Options();
  Receiver r(options, /*queue_slots=*/2);
  // Completed when placed, its open inside too: delivered at once, exactly once, as a
  // plain DATA_READY; a commit that still comes (a retry, a forgery) adds nothing.
  v1::Notification placed = DataReady("placed");
  placed.set_op(v1::WRITE);
  placed.set_timeout_ms(30000);
  placed.set_committed(true);
  CHECK(r.Ready(placed).ok());
  std::vector<v1::Notification> out = Delivered(r.queue);
  REQUIRE(out.size() == 1);
  CHECK(out[0].transfer_id() == "placed");
  CHECK(out[0].kind() == v1::DATA_READY);
  CHECK(out[0].payload() == std::string(512, 'e'));
  CHECK_FALSE(out[0].committed());
  CHECK(out[0].timeout_ms() == 0);
  CHECK(out[0].ack_token() == 0);
  CHECK(r.incoming.active() == 0);
  Caller owner;
  owner.principal = "decode-engine";
  auto state = r.incoming.Get("eve", "placed", owner);
  REQUIRE(state.ok());
  CHECK(state->phase() == v1::COMPLETED);
  CHECK(state->op() == v1::WRITE);
  r.incoming.OnNotice(Notice("placed", v1::PEER_DATA_COMMIT), {});
  CHECK(Delivered(r.queue).empty());
  // Without the flag it still waits for its commit.
  CHECK(r.Ready(DataReady("acked")).ok());
  CHECK(Delivered(r.queue).empty());
  CHECK(r.incoming.active() == 1);
  // Refused: the queue's 2 slots are reserved by "acked" and "filler" ("placed" was
  // read). A committed one that finds no room is refused to its sender and ends FAILED
  // here, never delivered as DATA_READY.
  CHECK(r.Ready(DataReady("filler")).ok());
  v1::Notification no_room = DataReady("no-room");
  no_room.set_committed(true);
  CHECK(r.Ready(no_room).code() == absl::StatusCode::kResourceExhausted);
  for (const auto& n : Delivered(r.queue)) {
    INFO(n.transfer_id());
    CHECK(n.kind() != v1::DATA_READY);
  }
  state = r.incoming.Get("eve", "no-room", owner);
  REQUIRE(state.ok());
  CHECK(state->phase() == v1::FAILED);
  r.incoming.OnNotice(Notice("acked", v1::PEER_DATA_COMMIT), {});
  out = Delivered(r.queue);
  REQUIRE(out.size() == 1);
  CHECK(out[0].transfer_id() == "acked");

  // Untracked (max_active 1, held by an open transfer): delivered once, by its
  // acknowledgement, as any untracked one is.
  options.max_active = 1;
  Receiver full(options, /*queue_slots=*/8);
  v1::Notification open = Notice("holder", v1::PEER_TRANSFER_OPEN);
  open.set_timeout_ms(30000);
  full.incoming.OnNotice(open, {});
  v1::Notification untracked = DataReady("untracked");
  untracked.set_committed(true);
  CHECK(full.Ready(untracked).ok());
  CHECK(full.incoming.untracked() == 1);
  out = Delivered(full.queue);
  REQUIRE(out.size() == 1);
  CHECK(out[0].transfer_id() == "untracked");
  CHECK_FALSE(out[0].committed());
  CHECK(Delivered(full.queue).empty());
}

TEST_CASE("one sender holds at most its share of the open incoming records") {
  IncomingOptions options = Options();
  options.max_active = 8;
  options.max_active_per_sender = 2;
  options.unopened_timeout_ms = 60000;  // nothing expires here
  Receiver r(options, /*queue_slots=*/64);
  for (int i = 0; i < 5; ++i) {
    v1::Notification open = Notice(fmt::format("eve-{}", i), v1::PEER_TRANSFER_OPEN);
    open.set_timeout_ms(30000);
    r.incoming.OnNotice(open, {});
  }
  CHECK(r.incoming.active() == 2);
  CHECK(r.incoming.untracked() == 3);
  // Another sender's transfer is still tracked (held until its commit).
  v1::Notification open = Notice("honest", v1::PEER_TRANSFER_OPEN, "prefill");
  open.set_timeout_ms(30000);
  r.incoming.OnNotice(open, {});
  CHECK(r.incoming.active() == 3);
  CHECK(r.Ready(DataReady("honest", "prefill")).ok());
  CHECK(Delivered(r.queue).empty());  // held for the commit
  r.incoming.OnNotice(Notice("honest", v1::PEER_DATA_COMMIT, "prefill"), {});
  CHECK(Delivered(r.queue).size() == 1);
  // Eve's untracked one still reaches the owner, once its data is in place.
  CHECK(r.Ready(DataReady("eve-4")).ok());
  std::vector<v1::Notification> out = Delivered(r.queue);
  REQUIRE(out.size() == 1);
  CHECK(out[0].transfer_id() == "eve-4");
  // Once one of hers ends, her next is tracked again.
  r.incoming.OnNotice(Notice("eve-0", v1::CANCELLED_BY_PEER), {});
  CHECK(r.incoming.active() == 1);
  open = Notice("eve-5", v1::PEER_TRANSFER_OPEN);
  open.set_timeout_ms(30000);
  r.incoming.OnNotice(open, {});
  CHECK(r.incoming.active() == 2);
  CHECK(r.incoming.untracked() == 4);  // eve-2, 3 and 4's opens, eve-4's DATA_READY
}

}  // namespace
}  // namespace kvagent::agent
