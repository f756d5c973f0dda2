// Durable notification subscriptions in the queue, without daemons: sequences, holding
// until acknowledged, redelivery in order to a new attachment (the replaced one told),
// owners kept apart, the per-subscription cap, the subscriptions limit, and idle expiry
// returning what was held to the queue. tests/limits/notification_ack_test runs them end to end.
#include <string>
#include <vector>

#include "agent/limits.h"
#include "agent/notification_queue.h"
#include "catch2/catch.hpp"

namespace kvagent::agent {
namespace {

using Catch::Matchers::Contains;

QueuedNotification Note(const std::string& id) {
  QueuedNotification q;
  q.notification.set_transfer_id(id);
  q.notification.set_payload("p");
  q.owners = {"engine"};
  return q;
}

const SubscriptionKey kKey{"uid:1000 client:decode-0", "s"};
NotificationFilter Engine() { return NotificationFilter{NotificationReader{"engine", false}, {}}; }

std::vector<std::string> Ids(const std::vector<v1::Notification>& notes) {
  std::vector<std::string> ids;
  for (const auto& n : notes) ids.push_back(n.transfer_id());
  return ids;
}

TEST_CASE("a subscription's notifications carry sequences and stay held until acknowledged") {
  Limits limits;
  REQUIRE(limits.SetFromFlag("--max-queued-notifications", "4").ok());
  NotificationQueue queue(&limits);
  for (const char* id : {"a", "b", "c"}) REQUIRE(queue.Push(Note(id)));
  auto first = queue.PollSubscription(kKey, 2, Engine());
  REQUIRE(first.ok());
  CHECK(Ids(*first) == std::vector<std::string>{"a", "b"});
  CHECK((*first)[0].sequence() < (*first)[1].sequence());
  CHECK(queue.in_flight() == 2);
  CHECK(queue.queued() == 1);
  // Held ones count against the queue: one more fits, not two.
  REQUIRE(queue.Push(Note("d")));
  CHECK(!queue.Push(Note("e")));
  CHECK(queue.overflowed() == 1);
  CHECK(queue.Reserve("t", 100).code() == absl::StatusCode::kResourceExhausted);

  // Not acknowledged: the next poll gets them again, first and in order.
  auto again = queue.PollSubscription(kKey, 0, Engine());
  REQUIRE(again.ok());
  CHECK(Ids(*again) == std::vector<std::string>{"a", "b", "c", "d"});
  CHECK((*again)[0].sequence() == (*first)[0].sequence());
  // Acknowledge through b and d by list: a, b, d released; c still held.
  auto released = queue.Ack(kKey, (*first)[1].sequence(), {(*again)[3].sequence()});
  REQUIRE(released.ok());
  CHECK(*released == 3);
  CHECK(queue.in_flight() == 1);
  CHECK(*queue.Ack(kKey, (*first)[1].sequence(), {}) == 0);  // twice: nothing more
  auto rest = queue.PollSubscription(kKey, 0, Engine());
  CHECK(Ids(*rest) == std::vector<std::string>{"c"});
  REQUIRE(queue.Ack(kKey, (*rest)[0].sequence(), {}).ok());
  CHECK(queue.in_flight() == 0);
  CHECK(queue.queued_bytes() == 0);
  // Plain polls never see held ones, and without a subscription nothing changes.
  REQUIRE(queue.Push(Note("plain")));
  CHECK(queue.Poll(0, {}, NotificationReader{"engine", false}).size() == 1);
}

TEST_CASE("a new attachment gets the unacknowledged ones again, in order, then new ones") {
  NotificationQueue queue;
  std::vector<v1::Notification> got1, got2;
  auto first = queue.Attach(kKey, Engine(), [&](const QueuedNotification& n) {
    got1.push_back(n.notification);
    return true;
  });
  REQUIRE(first.ok());
  for (const char* id : {"1", "2", "3"}) queue.Push(Note(id));
  REQUIRE(Ids(got1) == std::vector<std::string>{"1", "2", "3"});
  REQUIRE(queue.Ack(kKey, got1[0].sequence(), {}).ok());
  queue.Unsubscribe(*first);  // the client died
  queue.Push(Note("4"));      // waits in the queue: nobody attached
  CHECK(queue.queued() == 1);
  auto second = queue.Attach(kKey, Engine(), [&](const QueuedNotification& n) {
    got2.push_back(n.notification);
    return true;
  });
  REQUIRE(second.ok());
  CHECK(Ids(got2) == std::vector<std::string>{"2", "3", "4"});
  CHECK(got2[0].sequence() == got1[1].sequence());
  CHECK(got2[2].sequence() > got2[1].sequence());
  // A third attachment replaces the second, which gets nothing more; the second's
  // late Unsubscribe leaves the third attached.
  std::vector<v1::Notification> got3;
  auto third = queue.Attach(kKey, Engine(), [&](const QueuedNotification& n) {
    got3.push_back(n.notification);
    return true;
  });
  REQUIRE(third.ok());
  queue.Unsubscribe(*second);
  queue.Push(Note("5"));
  CHECK(got2.size() == 3);
  CHECK(Ids(got3) == std::vector<std::string>{"2", "3", "4", "5"});
}

TEST_CASE("a replaced attachment is told, once, before the newer one gets anything; an ended one is not") {
  NotificationQueue queue;
  std::vector<std::string> events;
  auto attach = [&](const std::string& who) {
    return queue.Attach(
        kKey, Engine(),
        [&events, who](const QueuedNotification& n) {
          events.push_back(who + " got " + n.notification.transfer_id());
          return true;
        },
        [&events, who] { events.push_back(who + " replaced"); });
  };
  auto first = attach("first");
  REQUIRE(first.ok());
  queue.Push(Note("1"));
  auto second = attach("second");
  REQUIRE(second.ok());
  queue.Push(Note("2"));
  CHECK(events == std::vector<std::string>{"first got 1", "first replaced", "second got 1",
                                           "second got 2"});
  // The first's late end tells no one; the second's end is no replacement, nor is a
  // later attachment one of an ended attachment.
  events.clear();
  queue.Unsubscribe(*first);
  queue.Unsubscribe(*second);
  auto third = attach("third");
  REQUIRE(third.ok());
  CHECK(events == std::vector<std::string>{"third got 1", "third got 2"});
  // Without a hook, replacing works as before.
  auto fourth = queue.Attach(kKey, Engine(), [](const QueuedNotification&) { return true; });
  REQUIRE(fourth.ok());
  CHECK(events.back() == "third replaced");
}

TEST_CASE("another owner's subscription of the same name is another subscription") {
  NotificationQueue queue;
  queue.Push(Note("mine"));
  REQUIRE(queue.PollSubscription(kKey, 0, Engine())->size() == 1);
  const SubscriptionKey other{"uid:1001 client:decode-0", kKey.name};
  CHECK(queue.Ack(other, 100, {}).status().code() == absl::StatusCode::kNotFound);
  CHECK(queue.PollSubscription(other, 0, Engine())->empty());
  CHECK(queue.in_flight() == 1);
  CHECK(queue.subscriptions() == 2);
  // Names are short and printable.
  CHECK(queue.PollSubscription({kKey.owner, ""}, 0, Engine()).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(queue.PollSubscription({kKey.owner, "a b\n"}, 0, Engine()).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(queue.PollSubscription({kKey.owner, std::string(65, 'x')}, 0, Engine()).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("subscriptions are bounded in number and in what each holds") {
  Limits limits;
  REQUIRE(limits.SetFromFlag("--max-subscriptions", "2").ok());
  REQUIRE(limits.SetFromFlag("--max-in-flight-per-subscription", "2").ok());
  NotificationQueue queue(&limits);
  REQUIRE(queue.PollSubscription({"o", "a"}, 0, Engine()).ok());
  REQUIRE(queue.PollSubscription({"p", "b"}, 0, Engine()).ok());
  auto third = queue.PollSubscription({"q", "c"}, 0, Engine());
  CHECK(third.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(third.status().message()),
             Contains("limit subscriptions") && Contains("--max-subscriptions"));
  for (const char* id : {"1", "2", "3"}) queue.Push(Note(id));
  auto held = queue.PollSubscription({"o", "a"}, 0, Engine());
  CHECK(Ids(*held) == std::vector<std::string>{"1", "2"});  // the cap: 3 waits
  CHECK(queue.queued() == 1);
  REQUIRE(queue.Ack({"o", "a"}, (*held)[1].sequence(), {}).ok());
  CHECK(Ids(*queue.PollSubscription({"o", "a"}, 0, Engine())) == std::vector<std::string>{"3"});
}

// Any identified caller may subscribe: one uid, whatever client names its sessions
// take, may hold a quarter of the subscriptions, so it cannot take every decode
// engine's room.
TEST_CASE("one uid or certificate holds at most a quarter of the subscriptions") {
  Limits limits;
  REQUIRE(limits.SetFromFlag("--max-subscriptions", "8").ok());
  NotificationQueue queue(&limits);
  REQUIRE(queue.PollSubscription({"uid:5 client:a", "s1"}, 0, Engine()).ok());
  REQUIRE(queue.PollSubscription({"uid:5 client:b", "s2"}, 0, Engine()).ok());
  auto third = queue.PollSubscription({"uid:5 client:c", "s3"}, 0, Engine());
  CHECK(third.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(third.status().message()),
             Contains("uid:5 holds 2 already") && Contains("a quarter") &&
                 Contains("--max-subscriptions"));
  CHECK(limits.refused(Limit::kSubscriptions) == 1);
  // Its own again is no new one; another uid and a certificate have their shares.
  CHECK(queue.PollSubscription({"uid:5 client:a", "s1"}, 0, Engine()).ok());
  CHECK(queue.PollSubscription({"uid:6 client:a", "s1"}, 0, Engine()).ok());
  CHECK(queue.PollSubscription({"cert:decode-7", "s1"}, 0, Engine()).ok());
  CHECK(queue.PollSubscription({"cert:decode-7", "s2"}, 0, Engine()).ok());
  CHECK(queue.PollSubscription({"cert:decode-7", "s3"}, 0, Engine()).status().code() ==
        absl::StatusCode::kResourceExhausted);
  CHECK(queue.subscriptions() == 5);
}

TEST_CASE("an idle subscription expires and what it held goes back to the queue") {
  uint64_t now = 1000;
  NotificationQueue queue;
  queue.set_clock([&now] { return now; });
  queue.set_subscription_ttl_ms(500);
  for (const char* id : {"x", "y"}) queue.Push(Note(id));
  REQUIRE(queue.PollSubscription(kKey, 0, Engine())->size() == 2);
  // Attached subscriptions never expire.
  auto token = queue.Attach(kKey, Engine(), [](const QueuedNotification&) { return true; });
  REQUIRE(token.ok());
  now += 10000;
  CHECK(queue.ExpireIdle() == 0);
  queue.Unsubscribe(*token);
  now += 499;
  CHECK(queue.ExpireIdle() == 0);
  now += 1;
  CHECK(queue.ExpireIdle() == 1);
  CHECK(queue.subscriptions() == 0);
  CHECK(queue.in_flight() == 0);
  CHECK(queue.expired_subscriptions() == 1);
  // Back in order, without sequences, for anyone allowed.
  auto back = queue.Poll(0, {}, NotificationReader{"engine", false});
  CHECK(Ids(back) == std::vector<std::string>{"x", "y"});
  CHECK(back[0].sequence() == 0);
  CHECK(queue.Ack(kKey, 100, {}).status().code() == absl::StatusCode::kNotFound);
  // Made again, its sequences continue above the old ones (a client's dedupe holds).
  queue.Push(Note("z"));
  auto fresh = queue.PollSubscription(kKey, 0, Engine());
  CHECK((*fresh)[0].sequence() > 2);
}

}  // namespace
}  // namespace kvagent::agent

namespace kvagent::agent {
namespace {

// The receiver reuses one QueuedNotification per ended transfer (IncomingTransfers'
// end_out_): PushOrKeep must hand a subscriber exactly what it holds, leave it with the
// caller then, and queue it whole (moved) when no one takes it.
TEST_CASE("PushOrKeep keeps what a subscriber took with the caller and queues the rest whole") {
  NotificationQueue queue;
  std::vector<std::string> taken;
  bool take = true;
  const uint64_t token = queue.Subscribe([&](const QueuedNotification& q) {
    if (!take) return false;
    taken.push_back(q.notification.transfer_id() + "/" + q.notification.payload());
    return true;
  });
  QueuedNotification q = Note("a");
  REQUIRE(queue.PushOrKeep(q));
  CHECK(taken == std::vector<std::string>{"a/p"});
  CHECK(q.notification.transfer_id() == "a");  // still the caller's
  CHECK(q.owners == std::vector<std::string>{"engine"});
  CHECK(queue.queued() == 0);

  // Reused for the next one, which nobody takes: queued with its own contents.
  take = false;
  q.notification.Clear();
  q.notification.set_transfer_id("b");
  q.notification.set_payload("second");
  REQUIRE(queue.PushOrKeep(q));
  CHECK(queue.queued() == 1);
  queue.Unsubscribe(token);
  auto polled = queue.Poll(0, {}, NotificationReader{"engine", false});
  REQUIRE(polled.size() == 1);
  CHECK(polled[0].transfer_id() == "b");
  CHECK(polled[0].payload() == "second");
  CHECK(taken.size() == 1);
}

}  // namespace
}  // namespace kvagent::agent
