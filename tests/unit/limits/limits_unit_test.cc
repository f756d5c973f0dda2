#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "agent/limits.h"
#include "agent/local_door.h"
#include "agent/metadata_watchers.h"
#include "agent/notification_queue.h"
#include "catch2/catch.hpp"

namespace kvagent::agent {
namespace {

using Catch::Matchers::Contains;

std::string Message(const absl::Status& status) { return std::string(status.message()); }

TEST_CASE("limit flags parse values, byte suffixes and refuse garbage") {
  Limits limits;
  CHECK(limits.value(Limit::kRegions) == 131072);
  CHECK(limits.value(Limit::kAllocatedBytes) > 0);  // derived from MemTotal
  REQUIRE(limits.SetFromFlag("--max-regions", "12").ok());
  CHECK(limits.value(Limit::kRegions) == 12);
  REQUIRE(limits.SetFromFlag("--max-allocated-bytes", "3G").ok());
  CHECK(limits.value(Limit::kAllocatedBytes) == (3ull << 30));
  REQUIRE(limits.SetFromFlag("--max-queued-notification-bytes", "64k").ok());
  CHECK(limits.value(Limit::kQueuedNotificationBytes) == 64 * 1024);
  // A suffix only for byte limits; never negative, never an overflow.
  absl::Status suffix = limits.SetFromFlag("--max-regions", "3G");
  CHECK(suffix.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(suffix), Contains("--max-regions") && Contains("3G"));
  CHECK(limits.SetFromFlag("--max-regions", "-1").code() == absl::StatusCode::kInvalidArgument);
  CHECK(limits.SetFromFlag("--max-allocated-bytes", "99999999999999999T").code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(limits.SetFromFlag("--max-nothing", "1").code() == absl::StatusCode::kNotFound);
  // Every limit has a flag that sets it and a line in --help.
  const std::string usage = Limits::Usage();
  for (int i = 0; i < kLimitCount; ++i) {
    const LimitInfo& info = InfoOf(static_cast<Limit>(i));
    CHECK(limits.SetFromFlag(info.flag, "7").ok());
    CHECK(limits.value(static_cast<Limit>(i)) == 7);
    CHECK_THAT(usage, Contains(std::string(info.flag)));
  }
}

TEST_CASE("a refusal names the limit, its value, the use, the fix and the flag, and is counted") {
  Limits limits;
  REQUIRE(limits.SetFromFlag("--max-regions-per-owner", "10").ok());
  CHECK(limits.Check(Limit::kRegionsPerOwner, "x", 4, 6, "fix").ok());
  absl::Status refused = limits.Check(Limit::kRegionsPerOwner, "RegisterRegions: 7 regions", 4, 7,
                                      "register fewer");
  CHECK(refused.code() == absl::StatusCode::kResourceExhausted);
  CHECK(Message(refused) ==
        "RegisterRegions: 7 regions: limit regions_per_owner (10 regions) reached: 4 in use, 7 "
        "more asked; register fewer; or raise --max-regions-per-owner on the agent "
        "(docs/LIMITS.md)");
  CHECK(limits.refused(Limit::kRegionsPerOwner) == 1);
  CHECK(limits.refused(Limit::kRegions) == 0);
  // Overflow-safe: a use over the limit and a huge ask both refuse.
  CHECK(!limits.Fits(Limit::kRegionsPerOwner, 11, 0));
  CHECK(!limits.Fits(Limit::kRegionsPerOwner, 1, UINT64_MAX));
  // Slots: taken up to the limit, refused after, from many threads at once.
  REQUIRE(limits.SetFromFlag("--max-pending-connects", "100").ok());
  std::atomic<uint64_t> in_use{0};
  std::atomic<int> taken{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 100; ++i) {
        if (limits.TakeSlot(Limit::kPendingConnects, &in_use, "c", "f").ok()) taken.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(taken.load() == 100);
  CHECK(in_use.load() == 100);
  CHECK(limits.refused(Limit::kPendingConnects) == 300);
}

TEST_CASE("error texts are bounded for gRPC's trailer, saying how much was cut") {
  CHECK(BoundedErrorText("short") == "short");
  const std::string long_text(10000, 'x');
  const std::string cut = BoundedErrorText(long_text);
  CHECK(cut.size() <= kMaxErrorBytes);
  CHECK_THAT(cut, Contains("more bytes cut") && Contains("agent's log"));
  // A fast path completion says where its whole text is instead.
  const std::string completion = BoundedErrorText(long_text, 472, "GetTransfer");
  CHECK(completion.size() <= 472);
  CHECK_THAT(completion, Contains("GetTransfer has the whole text"));
  // A multi-byte character is never split.
  std::string utf8;
  while (utf8.size() < 5000) utf8 += "\xc3\xa9";  // é
  const std::string bounded = BoundedErrorText(utf8, 101);
  const size_t body = bounded.find(" ...");
  REQUIRE(body != std::string::npos);
  CHECK(body % 2 == 0);
}

TEST_CASE("streams are leased per caller and given back when the lease goes") {
  Limits limits;
  REQUIRE(limits.SetFromFlag("--max-streams-per-caller", "2").ok());
  REQUIRE(limits.SetFromFlag("--max-streams", "3").ok());
  StreamTable table(&limits);
  auto a1 = table.Open("a", "WatchTransfer");
  auto a2 = table.Open("a", "WatchTransfer");
  REQUIRE(a1.ok());
  REQUIRE(a2.ok());
  auto a3 = table.Open("a", "WatchNotifications");
  CHECK(a3.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(Message(a3.status()), Contains("streams_per_caller") && Contains("for a"));
  auto b1 = table.Open("b", "WatchTransfer");
  REQUIRE(b1.ok());
  auto c1 = table.Open("c", "WatchTransfer");  // the total is full
  CHECK_THAT(Message(c1.status()), Contains("limit streams (3"));
  CHECK(table.open() == 3);
  CHECK(table.largest_caller() == 2);
  StreamTable::Lease moved = *std::move(a1);
  { StreamTable::Lease gone = *std::move(a2); }
  CHECK(table.open() == 2);
  CHECK(table.Open("a", "WatchTransfer").ok());  // opened and given back at once
  CHECK(table.open() == 2);
}

QueuedNotification Note(const std::string& id, size_t payload = 10) {
  QueuedNotification q;
  q.notification.set_transfer_id(id);
  q.notification.set_payload(std::string(payload, 'p'));
  q.owners = {"engine"};
  return q;
}

TEST_CASE("the notification queue keeps what it reserved and refuses past its limits") {
  Limits limits;
  REQUIRE(limits.SetFromFlag("--max-queued-notifications", "3").ok());
  NotificationQueue queue(&limits);
  const uint64_t size = NotificationQueue::Size(Note("r").notification);
  // Two reservations and one plain push fill it.
  REQUIRE(queue.Reserve("t1", size).ok());
  REQUIRE(queue.Reserve("t2", size).ok());
  CHECK(queue.Push(Note("plain")));
  absl::Status full = queue.Reserve("t3", size);
  CHECK(full.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(Message(full), Contains("queued_notifications") && Contains("PollNotifications"));
  // Without a reservation a full queue keeps nothing more, and counts it.
  CHECK(!queue.Push(Note("overflow")));
  CHECK(queue.overflowed() == 1);
  // Reserved ones are always kept.
  CHECK(queue.Push(Note("r1"), size));
  CHECK(queue.Push(Note("r2"), size));
  CHECK(queue.queued() == 3);
  CHECK(queue.queued_bytes() == NotificationQueue::Size(Note("plain").notification) +
                                    2 * NotificationQueue::Size(Note("r1").notification));
  auto taken = queue.Poll(0, {}, NotificationReader{"engine", false});
  CHECK(taken.size() == 3);
  CHECK(queue.queued() == 0);
  CHECK(queue.queued_bytes() == 0);
  CHECK(queue.Reserve("t4", size).ok());

  // The byte limit too.
  Limits small;
  REQUIRE(small.SetFromFlag("--max-queued-notification-bytes", "1000").ok());
  NotificationQueue bytes(&small);
  CHECK(bytes.Push(Note("a", 500)));
  CHECK(!bytes.Push(Note("b", 500)));
  CHECK_THAT(Message(bytes.Reserve("c", 600)), Contains("queued_notification_bytes"));
}

TEST_CASE("a watcher that does not keep up leaves notifications queued until it asks again") {
  NotificationQueue queue;
  int accepted = 0;
  bool full = true;
  const uint64_t token = queue.Subscribe([&](const QueuedNotification&) {
    if (full) return false;
    ++accepted;
    return true;
  });
  queue.Push(Note("1"));
  queue.Push(Note("2"));
  CHECK(queue.queued() == 2);
  full = false;
  queue.OfferQueued(token);
  CHECK(accepted == 2);
  CHECK(queue.queued() == 0);
  queue.Unsubscribe(token);
}

TEST_CASE("the metadata watcher table is bounded; peers that stopped polling make room") {
  Limits limits;
  REQUIRE(limits.SetFromFlag("--max-peer-callers", "2").ok());
  MetadataWatchers watchers(/*recent_ms=*/100);
  CHECK(watchers.Polled("a", 1, true, &limits).ok());
  CHECK(watchers.Polled("b", 1, true, &limits).ok());
  CHECK(watchers.Polled("a", 2, true, &limits).ok());  // known: always
  absl::Status full = watchers.Polled("c", 1, true, &limits);
  CHECK(full.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(Message(full), Contains("peer_callers") && Contains("--max-peer-callers"));
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  CHECK(watchers.Polled("c", 1, true, &limits).ok());  // a and b went quiet
  CHECK(watchers.size() == 1);
}

TEST_CASE("a metadata stream keeps its watcher counted; acks free a waiting deregistration") {
  Limits limits;
  REQUIRE(limits.SetFromFlag("--max-peer-callers", "2").ok());
  MetadataWatchers watchers(/*recent_ms=*/50);
  REQUIRE(watchers.StreamOpened("a", &limits).ok());
  watchers.StreamAcked("a", 3, true);
  CHECK(watchers.streams() == 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // past recent_ms
  // Still a watcher (its stream is open): a deregistration at version 4 waits for it.
  std::atomic<int> calls{0};
  std::vector<std::string> pending;
  watchers.WaitForVersion(4, 5000, [&](std::vector<std::string> unconfirmed) {
    pending = std::move(unconfirmed);
    calls.fetch_add(1);
  });
  CHECK(calls.load() == 0);
  watchers.StreamAcked("a", 4, true);
  CHECK(calls.load() == 1);
  CHECK(pending.empty());
  // A fifth stream of one identity is refused, naming why.
  for (int i = 0; i < 3; ++i) REQUIRE(watchers.StreamOpened("a", &limits).ok());
  absl::Status fifth = watchers.StreamOpened("a", &limits);
  CHECK(fifth.code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(Message(fifth), Contains("peer 'a'") && Contains("metadata streams"));
  for (int i = 0; i < 4; ++i) watchers.StreamClosed("a");
  CHECK(watchers.streams() == 0);
  // Its streams closed, it no longer counts: a new version waits for nobody.
  watchers.WaitForVersion(5, 5000, [&](std::vector<std::string>) { calls.fetch_add(1); });
  CHECK(calls.load() == 2);
}

TEST_CASE("a peer that stops watching and polling is forgotten after forget_ms, one with a "
          "stream open is not, and one dropped to make room is forgotten too") {
  Limits limits;
  REQUIRE(limits.SetFromFlag("--max-peer-callers", "3").ok());
  absl::Mutex mu;
  std::vector<std::string> forgotten;
  auto forgotten_now = [&] {
    absl::MutexLock lock(&mu);
    std::vector<std::string> sorted = forgotten;
    std::sort(sorted.begin(), sorted.end());
    return sorted;
  };
  MetadataWatchers watchers(/*recent_ms=*/50, /*forget_ms=*/300, [&](const std::string& caller) {
    absl::MutexLock lock(&mu);
    forgotten.push_back(caller);
  });
  CHECK(watchers.Polled("poller", 1, true, &limits).ok());
  REQUIRE(watchers.StreamOpened("streamer", &limits).ok());
  REQUIRE(watchers.StreamOpened("closer", &limits).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  CHECK(forgotten_now().empty());  // within forget_ms
  watchers.StreamClosed("closer");  // its 300 ms start now
  // The poller goes first (300 ms after its poll; the thread looks once a second), the
  // closer next; the streamer never, however long it stays quiet.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (forgotten_now().size() < 2 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(forgotten_now() == std::vector<std::string>{"closer", "poller"});
  CHECK(watchers.size() == 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  CHECK(forgotten_now().size() == 2);
  // A full table drops the quiet ones to make room, and forgets them too.
  MetadataWatchers small(/*recent_ms=*/50, /*forget_ms=*/600000, [&](const std::string& caller) {
    absl::MutexLock lock(&mu);
    forgotten.push_back("small " + caller);
  });
  REQUIRE(limits.SetFromFlag("--max-peer-callers", "1").ok());
  CHECK(small.Polled("a", 1, true, &limits).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // quiet past recent_ms
  CHECK(small.Polled("b", 1, true, &limits).ok());
  CHECK(forgotten_now() == std::vector<std::string>{"closer", "poller", "small a"});
}

TEST_CASE("MetadataPush calls every stream on a change, none once removed") {
  struct Counted : MetadataPush::Stream {
    std::atomic<int> pushes{0};
    void Push() override { pushes.fetch_add(1); }
  };
  MetadataPush push;
  Counted a, b;
  push.Add(&a);
  push.Add(&b);
  push.Changed();
  auto wait = [](Counted& s, int n) {
    for (int i = 0; i < 500 && s.pushes.load() < n; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return s.pushes.load();
  };
  CHECK(wait(a, 1) == 1);
  CHECK(wait(b, 1) == 1);
  push.Remove(&a);  // returns once no Push on `a` runs
  push.Changed();
  CHECK(wait(b, 2) == 2);
  CHECK(a.pushes.load() == 1);
  CHECK(push.size() == 1);
}

TEST_CASE("the allocation ledger counts per owner and in all, and gives back") {
  Limits limits;
  REQUIRE(limits.SetFromFlag("--max-allocated-bytes", "100").ok());
  REQUIRE(limits.SetFromFlag("--max-allocated-bytes-per-owner", "60").ok());
  AllocationLedger ledger;
  CHECK(ledger.Take(&limits, "a", 50, "a1").ok());
  CHECK_THAT(Message(ledger.Take(&limits, "a", 20, "a2")), Contains("allocated_bytes_per_owner"));
  CHECK(ledger.Take(&limits, "b", 40, "b1").ok());
  CHECK_THAT(Message(ledger.Take(&limits, "c", 20, "c1")), Contains("limit allocated_bytes ("));
  CHECK(ledger.total() == 90);
  CHECK(ledger.largest_owner() == 50);
  ledger.Give("a", 50);
  CHECK(ledger.Take(&limits, "c", 20, "c1").ok());
  CHECK(ledger.total() == 60);
}

}  // namespace
}  // namespace kvagent::agent
