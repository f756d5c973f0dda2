// IncomingTransfers keeps the last max_finished ended incoming transfers for Get and
// List, and prunes older ones as new ones end (a ring of ended keys; a pruned record's
// node is reused for the next transfer). Without daemons: what Get and List show
// through many ends is exactly what a fresh record would show (nothing left over from
// the record whose node was reused: error text, timeline stages, owners), the count
// stays bounded, the newest are kept in order, and an id a sender uses again (after
// its record was pruned, or from a new incarnation while the old one is kept) is its
// own record; Get, which finds records through an index by id, answers what List holds.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_join.h"
#include "agent/access.h"
#include "agent/incoming.h"
#include "agent/notification_queue.h"
#include "agent/status_util.h"
#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "proto/kvagent.pb.h"
#include "proto/wire.pb.h"
#include "registry/region_registry.h"
#include "tests/unit/registry/test_util.h"

namespace kvagent::agent {
namespace {

constexpr uint32_t kKept = 3;

v1::Notification Notice(const std::string& id, v1::NotificationKind kind, uint64_t incarnation,
                        const std::string& target, const std::string& from = "sender") {
  v1::Notification n;
  n.set_from_agent(from);
  n.set_sender_incarnation(incarnation);
  n.set_transfer_id(id);
  n.set_kind(kind);
  n.set_op(v1::WRITE);
  n.set_timeout_ms(60000);
  n.set_bytes(4096);
  n.add_targets(target);
  return n;
}

struct Receiver {
  registry::RegionRegistry regions{&registry::testing::Context()};
  registry::ShmMapping shm = registry::testing::MakeShm(2 * 4096);
  NotificationQueue queue;
  IncomingTransfers incoming;
  Caller scheduler;
  Caller owner_a;
  uint32_t acks = 0;

  explicit Receiver(uint32_t kept = kKept)
      : incoming(
            [kept] {
              IncomingOptions options;
              options.self_name = "receiver";
              options.max_finished = kept;
              return options;
            }(),
            &regions, &queue,
            [this](const transport::ReplyEndpoint&, const wire::TransferAck&) { ++acks; }) {
    REQUIRE(regions
                .Register({registry::testing::Spec("ra", shm.name(), 0, 4096, 1, 4096)}, false,
                          registry::testing::Registrant("owner-a-with-a-long-principal"))
                .ok());
    REQUIRE(regions
                .Register({registry::testing::Spec("rb", shm.name(), 4096, 4096, 1, 4096)}, false,
                          registry::testing::Registrant("owner-b"))
                .ok());
    scheduler.scheduler = true;
    scheduler.principal = "cert:scheduler";
    owner_a.principal = "owner-a-with-a-long-principal";
  }

  // Open, DATA_READY (acknowledged), commit: COMPLETED.
  void Complete(const std::string& id, const std::string& target, uint64_t incarnation = 7,
                const std::string& from = "sender") {
    NextMicrosecond();
    incoming.OnNotice(Notice(id, v1::PEER_TRANSFER_OPEN, incarnation, target, from), {});
    static int endpoint;
    incoming.OnDataReady(Notice(id, v1::DATA_READY, incarnation, target, from),
                         transport::ReplyEndpoint{&endpoint}, absl::OkStatus());
    incoming.OnNotice(Notice(id, v1::PEER_DATA_COMMIT, incarnation, target, from), {});
  }
  // Open, then the sender's failure: FAILED with its message.
  void Fail(const std::string& id, const std::string& target, uint64_t incarnation = 7,
            const std::string& from = "sender") {
    NextMicrosecond();
    incoming.OnNotice(Notice(id, v1::PEER_TRANSFER_OPEN, incarnation, target, from), {});
    v1::Notification failed = Notice(id, v1::TRANSFER_FAILED, incarnation, target, from);
    failed.set_error_code(static_cast<int32_t>(absl::StatusCode::kInternal));
    failed.set_error_message(fmt::format("the sender's copy of {} broke", id));
    incoming.OnNotice(failed, {});
  }

  // List orders by submission time (microseconds) and Get answers the newest: each
  // transfer opens in a later microsecond than the one before, so the order is defined.
  void NextMicrosecond() {
    const uint64_t now = UnixMicros();
    while (UnixMicros() == now) {
    }
  }

  std::vector<std::string> Ids(const Caller& caller) {
    std::vector<std::string> ids;
    for (const auto& s : incoming.List(false, caller)) ids.push_back(s.transfer_id());
    return ids;
  }
};

// What a completed incoming record shows, whatever record its node held before.
void CheckCompleted(const v1::TransferState& s, const std::string& id) {
  CHECK(s.transfer_id() == id);
  CHECK(s.peer() == "sender");
  CHECK(s.direction() == v1::INCOMING);
  CHECK(s.op() == v1::WRITE);
  CHECK(s.phase() == v1::COMPLETED);
  CHECK(s.error_code() == 0);
  CHECK(s.error_message().empty());
  CHECK(s.bytes_total() == 4096);
  CHECK(s.bytes_done() == 4096);
  CHECK(s.drained());
  CHECK(s.failed_segment() == -1);
  CHECK(s.owner() == "owner-a-with-a-long-principal");
  // Its own stages once each: submitted, notification received, acknowledged, ended.
  REQUIRE(s.timeline_size() == 4);
  CHECK(s.timeline(0).stage() == v1::STAGE_SUBMITTED);
  CHECK(s.timeline(1).stage() == v1::STAGE_NOTIFICATION_RECEIVED);
  CHECK(s.timeline(2).stage() == v1::STAGE_ACKNOWLEDGED);
  CHECK(s.timeline(3).stage() == v1::STAGE_ENDED);
}

TEST_CASE("ended incoming transfers: the last max_finished kept, in order, bounded") {
  // 3: every one kept whole. 100: the newest 64 whole, the 36 before them compact
  // (agent/ended_log.h).
  const uint32_t kept = GENERATE(3u, 100u);  // kKept, and more
  INFO("kept " << kept);
  Receiver r(kept);
  const int ends = static_cast<int>(kept) * 2 + 10;
  for (int i = 0; i < ends; ++i) {
    r.Complete(fmt::format("t{}", i), "ra");
    std::vector<std::string> ids = r.Ids(r.scheduler);
    REQUIRE(ids.size() == std::min<size_t>(i + 1, kept));
    // The newest, oldest first (List sorts by submission).
    CHECK(ids.back() == fmt::format("t{}", i));
    CHECK(ids.front() == fmt::format("t{}", std::max(0, i + 1 - static_cast<int>(kept))));
  }
  CHECK(r.acks == static_cast<uint32_t>(ends));
  CHECK(r.incoming.active() == 0);
  CHECK(r.incoming.sources() == 1);
  const int oldest = ends - static_cast<int>(kept);
  CHECK(r.incoming.Get("", fmt::format("t{}", oldest - 1), r.scheduler).status().code() ==
        absl::StatusCode::kNotFound);
  for (int i = oldest; i < ends; ++i) {
    const std::string id = fmt::format("t{}", i);
    INFO(id);
    auto got = r.incoming.Get("sender", id, r.owner_a);
    REQUIRE(got.ok());
    CheckCompleted(*got, id);
    Caller owner_b;
    owner_b.principal = "owner-b";
    CHECK(r.incoming.Get("", id, owner_b).status().code() == absl::StatusCode::kNotFound);
  }
}

TEST_CASE("a late notice of an ended transfer kept compact makes nothing") {
  // 100 kept: the first of 80 completed is kept compact by the end. Notices for it
  // now (a repeated DATA_READY, open, commit, outcome) are late, as they are for a
  // record kept whole: no new record, no acknowledgement, no notification.
  Receiver r(100);
  std::vector<QueuedNotification> taken;
  r.queue.Subscribe([&taken](const QueuedNotification& q) {
    taken.push_back(q);
    return true;
  });
  for (int i = 0; i < 80; ++i) r.Complete(fmt::format("t{}", i), "ra");
  REQUIRE(taken.size() == 80);
  REQUIRE(r.acks == 80);
  static int endpoint;
  r.incoming.OnNotice(Notice("t0", v1::PEER_TRANSFER_OPEN, 7, "ra"), {});
  r.incoming.OnDataReady(Notice("t0", v1::DATA_READY, 7, "ra"), transport::ReplyEndpoint{&endpoint},
                         absl::OkStatus());
  r.incoming.OnNotice(Notice("t0", v1::PEER_DATA_COMMIT, 7, "ra"), {});
  r.incoming.OnNotice(Notice("t0", v1::TRANSFER_FAILED, 7, "ra"), {});
  CHECK(taken.size() == 80);
  CHECK(r.acks == 80);
  CHECK(r.incoming.active() == 0);
  CHECK(r.Ids(r.scheduler).size() == 80);
  auto got = r.incoming.Get("sender", "t0", r.scheduler);
  REQUIRE(got.ok());
  CheckCompleted(*got, "t0");
  // The same id from the sender's next incarnation is a new transfer.
  r.Complete("t0", "ra", /*incarnation=*/8);
  CHECK(taken.size() == 81);
  CHECK(r.acks == 81);
  CHECK(r.incoming.Get("sender", "t0", r.scheduler)->submitted_unix_us() >
        got->submitted_unix_us());
}

TEST_CASE("a record made in a pruned one's place shows nothing of the old one") {
  Receiver r;
  // Failed ones owned by owner-b, then completed ones owned by owner-a take their
  // places (their nodes): no error text, no extra stages, no old owner.
  for (int i = 0; i < 10; ++i) r.Fail(fmt::format("failed-with-a-long-id-{}", i), "rb");
  for (const auto& s : r.incoming.List(false, r.scheduler)) {
    CHECK(s.phase() == v1::FAILED);
    CHECK(s.owner() == "owner-b");
    CHECK_FALSE(s.error_message().empty());
  }
  for (int i = 0; i < 10; ++i) r.Complete(fmt::format("ok{}", i), "ra");
  std::vector<v1::TransferState> listed = r.incoming.List(false, r.scheduler);
  REQUIRE(listed.size() == kKept);
  for (size_t i = 0; i < listed.size(); ++i) CheckCompleted(listed[i], fmt::format("ok{}", 7 + i));
  // owner-b sees none of them; owner-a sees all three.
  Caller owner_b;
  owner_b.principal = "owner-b";
  CHECK(r.incoming.List(false, owner_b).empty());
  CHECK(r.incoming.List(false, r.owner_a).size() == kKept);
  // And back: a failure in a completed one's place has its own error and stages.
  r.Fail("late-failure", "rb");
  auto failed = r.incoming.Get("", "late-failure", owner_b);
  REQUIRE(failed.ok());
  CHECK(failed->phase() == v1::FAILED);
  CHECK(failed->error_code() == static_cast<int32_t>(absl::StatusCode::kInternal));
  CHECK(failed->error_message() == "the sender's copy of late-failure broke");
  CHECK(failed->bytes_done() == 0);
  CHECK_FALSE(failed->drained());
  CHECK(failed->owner() == "owner-b");
  REQUIRE(failed->timeline_size() == 2);  // submitted, ended
  CHECK(failed->timeline(1).stage() == v1::STAGE_ENDED);
}

TEST_CASE("an id used again is its own record") {
  Receiver r;
  SECTION("after the first was pruned") {
    r.Fail("again", "rb");
    for (int i = 0; i < 5; ++i) r.Complete(fmt::format("filler{}", i), "ra");
    CHECK(r.incoming.Get("", "again", r.scheduler).status().code() ==
          absl::StatusCode::kNotFound);
    r.Complete("again", "ra");
    auto got = r.incoming.Get("sender", "again", r.owner_a);
    REQUIRE(got.ok());
    CheckCompleted(*got, "again");
  }
  SECTION("by the sender's next incarnation while the first is kept") {
    r.Fail("again", "rb", /*incarnation=*/7);
    r.Complete("again", "ra", /*incarnation=*/8);
    std::vector<v1::TransferState> listed = r.incoming.List(false, r.scheduler);
    REQUIRE(listed.size() == 2);
    CHECK(listed[0].phase() == v1::FAILED);
    CHECK(listed[1].phase() == v1::COMPLETED);
    // Get answers the newer.
    auto got = r.incoming.Get("sender", "again", r.scheduler);
    REQUIRE(got.ok());
    CheckCompleted(*got, "again");
    // Both end and are pruned in turn like any other.
    for (int i = 0; i < 5; ++i) r.Complete(fmt::format("filler{}", i), "ra");
    CHECK(r.incoming.Get("", "again", r.scheduler).status().code() ==
          absl::StatusCode::kNotFound);
    CHECK(r.Ids(r.scheduler) == std::vector<std::string>{"filler2", "filler3", "filler4"});
  }
}

// Get looks up the id under each (sender, incarnation) that has records, counted as
// records are made and pruned (and their nodes reused). Checked against List, which
// reads every record:
// through a random mix of senders, incarnations, ids used again, completions (owner a)
// and failures (owner b), open ones among them, with pruning all along, Get answers
// for every id, with and without a sender, for each caller, exactly what the newest
// matching record in List is (or NOT_FOUND when List has none).
TEST_CASE("Get answers what List holds: the newest record of the id, through pruning") {
  // 24: all kept whole; 96: the newest 64 whole, 32 compact.
  const uint32_t kept = GENERATE(24u, 96u);
  INFO("kept " << kept);
  Receiver r(kept);
  Caller owner_b;
  owner_b.principal = "owner-b";
  // "s" is the start of "s0" and "s1": asked for by name, only its own records count.
  const std::vector<std::string> senders = {"s0", "s1", "prefill-node-with-a-long-name", "s"};
  std::vector<std::string> ids;
  for (int i = 0; i < 12; ++i) ids.push_back(fmt::format("req-{}-layer-with-a-long-suffix", i));
  uint64_t state = 88172645463325252ull;  // xorshift: the same mix every run
  auto next = [&state](uint64_t n) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state % n;
  };
  size_t checked = 0, found = 0;
  for (int step = 0; step < 400; ++step) {
    const std::string& id = ids[next(ids.size())];
    const std::string& from = senders[next(senders.size())];
    const uint64_t incarnation = 7 + next(2);
    switch (next(3)) {
      case 0:
        r.Complete(id, "ra", incarnation, from);
        break;
      case 1:
        r.Fail(id, "rb", incarnation, from);
        break;
      default:  // left open (until a later step ends the same key)
        r.NextMicrosecond();
        r.incoming.OnNotice(Notice(id, v1::PEER_TRANSFER_OPEN, incarnation, "ra", from), {});
    }
    // Asked from step 105 on, when records have been made and pruned.
    if (step < 105 || (step % 7 != 0 && step < 390)) continue;
    if (kept > 24 && step % 3 != 0 && step < 390) continue;  // fewer: List is longer
    for (const Caller* caller : std::vector<const Caller*>{&r.scheduler, &r.owner_a, &owner_b}) {
      const std::vector<v1::TransferState> listed = r.incoming.List(false, *caller);
      for (const std::string& want : ids) {
        for (const std::string& peer :
             {std::string(), senders[0], senders[1], senders[2], senders[3]}) {
          const v1::TransferState* newest = nullptr;
          for (const auto& s : listed) {
            if (s.transfer_id() != want || (!peer.empty() && s.peer() != peer)) continue;
            if (newest == nullptr || s.submitted_unix_us() > newest->submitted_unix_us()) {
              newest = &s;
            }
          }
          auto got = r.incoming.Get(peer, want, *caller);
          INFO("step " << step << ", caller " << caller->principal << ", id " << want
                       << ", sender '" << peer << "'");
          ++checked;
          if (newest == nullptr) {
            CHECK(got.status().code() == absl::StatusCode::kNotFound);
            continue;
          }
          REQUIRE(got.ok());
          ++found;
          CHECK(got->peer() == newest->peer());
          CHECK(got->submitted_unix_us() == newest->submitted_unix_us());
          CHECK(got->phase() == newest->phase());
        }
      }
    }
  }
  INFO(checked << " lookups, " << found << " found");
  CHECK(found > checked / 4);  // the mix keeps many ids found, and many not
  CHECK(found < checked);
  CHECK(r.incoming.Get("", "never-sent", r.scheduler).status().code() ==
        absl::StatusCode::kNotFound);
  // Get looks up the id once per sender's incarnation with records here: at most the
  // 4 senders x 2 incarnations, never more.
  CHECK(r.incoming.sources() <= senders.size() * 2);
  CHECK(r.incoming.sources() >= 2);
}

TEST_CASE("a sender's incarnation is forgotten with its last record") {
  // A sender restarting again and again (a new incarnation each time) leaves nothing
  // behind once its records are pruned: Get's per-incarnation lookups stay bounded.
  // 24: all kept whole; 96: the newest 64 whole, 32 compact (counted alike).
  const uint32_t kept = GENERATE(24u, 96u);
  INFO("kept " << kept);
  Receiver r(kept);
  for (uint64_t incarnation = 1; incarnation <= 200; ++incarnation) {
    r.Complete(fmt::format("t{}", incarnation), "ra", incarnation, "restarting");
    r.Complete(fmt::format("u{}", incarnation), "ra", 1000, "steady");
  }
  // Those kept: half of "restarting" (one incarnation each), half of "steady" (one).
  CHECK(r.incoming.sources() == kept / 2 + 1);
  for (uint64_t incarnation = 201 - kept / 2; incarnation <= 200; ++incarnation) {
    auto got = r.incoming.Get("restarting", fmt::format("t{}", incarnation), r.scheduler);
    REQUIRE(got.ok());
    CHECK(got->phase() == v1::COMPLETED);
  }
  CHECK(r.incoming.Get("restarting", fmt::format("t{}", 200 - kept / 2), r.scheduler)
            .status()
            .code() == absl::StatusCode::kNotFound);
  CHECK(r.incoming.Get("", "u200", r.scheduler)->peer() == "steady");
  CHECK(r.incoming.Get("restarting", "u200", r.scheduler).status().code() ==
        absl::StatusCode::kNotFound);
}

// The receiver keeps the notices it parses and the DATA_READYs its records hold, and
// swaps strings between them instead of copying (the inbox's kept notice, a spare held
// one, the notification delivered). Delivered one by one to a taker that takes each at
// once, as a fast path ring does: every notification carries its own names, payload,
// targets and owners, nothing of the transfer whose storage it reuses, whatever the
// order of long and short ids, payloads present and absent, and failures between.
TEST_CASE("each delivered notification carries its own names, payload, targets and owners") {
  Receiver r;
  std::vector<QueuedNotification> taken;
  r.queue.Subscribe([&taken](const QueuedNotification& q) {
    taken.push_back(q);
    return true;
  });
  struct Expected {
    std::string id;
    v1::NotificationKind kind;
    std::string payload;
    std::vector<std::string> targets;
    std::vector<std::string> owners;
  };
  std::vector<Expected> expected;
  // One notice object parsed into again and again, as the inbox's kept one is.
  v1::Notification kept;
  static int endpoint;
  for (int i = 0; i < 40; ++i) {
    const bool long_id = i % 3 == 0;
    const std::string id =
        long_id ? fmt::format("a-transfer-id-long-enough-to-need-its-own-buffer-{}", i)
                : fmt::format("t{}", i);
    std::vector<std::string> targets;
    std::vector<std::string> owners;
    if (i % 4 != 1) {
      targets.push_back("ra");
      owners.push_back("owner-a-with-a-long-principal");
    }
    if (i % 4 != 0) {
      targets.push_back("rb");
      owners.push_back("owner-b");
    }
    if (i % 7 == 5) {
      r.Fail(id, targets[0]);
      expected.push_back({id, v1::TRANSFER_FAILED, "", {targets[0]}, {owners[0]}});
      continue;
    }
    const std::string payload =
        i % 5 == 0 ? std::string() : std::string(static_cast<size_t>(20 + 37 * (i % 4)), 'a' + i % 26);
    // The open names the targets too: the owners are those when it began.
    v1::Notification open = Notice(id, v1::PEER_TRANSFER_OPEN, 7, targets[0]);
    v1::Notification ready = Notice(id, v1::DATA_READY, 7, targets[0]);
    for (size_t t = 1; t < targets.size(); ++t) {
      open.add_targets(targets[t]);
      ready.add_targets(targets[t]);
    }
    ready.set_payload(payload);
    ready.set_ack_token(100 + i);
    r.NextMicrosecond();
    kept.ParseFromString(open.SerializeAsString());
    r.incoming.OnNotice(kept, {});
    kept.ParseFromString(ready.SerializeAsString());
    r.incoming.OnDataReady(std::move(kept), transport::ReplyEndpoint{&endpoint}, absl::OkStatus());
    kept.ParseFromString(Notice(id, v1::PEER_DATA_COMMIT, 7, targets[0]).SerializeAsString());
    r.incoming.OnNotice(kept, {});
    expected.push_back({id, v1::DATA_READY, payload, targets, owners});
  }
  REQUIRE(taken.size() == expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    INFO("notification " << i << ", transfer " << expected[i].id);
    const v1::Notification& n = taken[i].notification;
    CHECK(n.from_agent() == "sender");
    CHECK(n.transfer_id() == expected[i].id);
    CHECK(n.kind() == expected[i].kind);
    CHECK(n.sender_incarnation() == 7);
    CHECK(n.payload() == expected[i].payload);
    CHECK(std::vector<std::string>(n.targets().begin(), n.targets().end()) == expected[i].targets);
    CHECK(n.bytes() == 4096);
    CHECK(n.ack_token() == 0);  // the sender's token is not handed to clients
    CHECK(taken[i].owners == expected[i].owners);
    if (expected[i].kind == v1::DATA_READY) {
      CHECK(n.error_code() == 0);
      CHECK(n.error_message().empty());
    } else {
      CHECK(n.error_message() == fmt::format("the sender's copy of {} broke", expected[i].id));
    }
    auto state = r.incoming.Get("sender", expected[i].id, r.scheduler);
    if (i + kKept >= expected.size()) {
      REQUIRE(state.ok());
      CHECK(state->owner() == absl::StrJoin(expected[i].owners, ","));
    }
  }
}

}  // namespace
}  // namespace kvagent::agent
