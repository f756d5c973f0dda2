// IncomingTransfers::Expire and NextExpiry without daemons: an opened incoming
// transfer is due at its sender's deadline plus the grace; before then Expire ends
// nothing, after it the transfer ends TIMED_OUT once (its owners get
// TRANSFER_TIMED_OUT); the earliest open transfer sets NextExpiry, and once nothing can
// expire it is UINT64_MAX (the deadline thread then sleeps until woken).
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "agent/incoming.h"
#include "agent/notification_queue.h"
#include "agent/status_util.h"
#include "catch2/catch.hpp"
#include "proto/kvagent.pb.h"
#include "proto/wire.pb.h"
#include "registry/region_registry.h"
#include "tests/unit/incoming/incoming_util.h"
#include "tests/unit/registry/test_util.h"

namespace kvagent::agent {
namespace {

constexpr uint64_t kNever = UINT64_MAX;

v1::Notification Notice(const std::string& id, v1::NotificationKind kind, uint32_t timeout_ms) {
  v1::Notification n;
  n.set_from_agent("sender");
  n.set_sender_incarnation(7);
  n.set_transfer_id(id);
  n.set_kind(kind);
  n.set_op(v1::WRITE);
  n.set_timeout_ms(timeout_ms);
  return n;
}

using testing::Delivered;
using testing::SleepUntil;

TEST_CASE("an incoming transfer expires at its deadline plus grace, and NextExpiry says when") {
  registry::RegionRegistry regions(&registry::testing::Context());
  NotificationQueue queue;
  IncomingOptions options;
  options.self_name = "receiver";
  options.grace_ms = 20;
  IncomingTransfers incoming(options, &regions, &queue,
                             [](const transport::ReplyEndpoint&, const wire::TransferAck&) {});

  CHECK(incoming.NextExpiry() == kNever);  // nothing open: nothing to wake for
  incoming.Expire();
  CHECK(Delivered(queue).empty());

  const uint64_t opened_us = MonotonicMicros();
  incoming.OnNotice(Notice("early", v1::PEER_TRANSFER_OPEN, 80), {});
  const uint64_t due = incoming.NextExpiry();
  CHECK(due >= opened_us + 100 * 1000);              // 80 ms deadline + 20 ms grace
  CHECK(due <= MonotonicMicros() + 100 * 1000);
  // A later one does not move the earliest.
  incoming.OnNotice(Notice("late", v1::PEER_TRANSFER_OPEN, 300), {});
  CHECK(incoming.NextExpiry() == due);
  CHECK(incoming.active() == 2);

  incoming.Expire();  // before it is due: nothing ends
  CHECK(Delivered(queue).empty());
  CHECK(incoming.active() == 2);

  SleepUntil(due);
  incoming.Expire();
  std::vector<v1::Notification> out = Delivered(queue);
  REQUIRE(out.size() == 1);
  CHECK(out[0].transfer_id() == "early");
  CHECK(out[0].kind() == v1::TRANSFER_TIMED_OUT);
  CHECK(incoming.active() == 1);
  // Now the later one is the earliest.
  const uint64_t late_due = incoming.NextExpiry();
  CHECK(late_due > due);
  CHECK(late_due != kNever);

  // It ends by its sender's outcome first: NextExpiry may still name it (early is
  // allowed); the Expire then ends nothing and finds nothing left to wait for.
  incoming.OnNotice(Notice("late", v1::CANCELLED_BY_PEER, 0), {});
  out = Delivered(queue);
  REQUIRE(out.size() == 1);
  CHECK(out[0].kind() == v1::CANCELLED_BY_PEER);
  SleepUntil(incoming.NextExpiry());
  incoming.Expire();
  CHECK(Delivered(queue).empty());
  CHECK(incoming.NextExpiry() == kNever);
  CHECK(incoming.active() == 0);
}

}  // namespace
}  // namespace kvagent::agent
