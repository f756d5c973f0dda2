// What one peer's notification may carry and what it costs the queue, without daemons.
// Inbox::CheckBody bounds every string of a notification as this agent bounds its own
// (ids 256 bytes as SubmitTransfer, target names 256 as the registry and catalog), a
// batch entry as a notification alone (256 KiB), and cuts an error text past 4 KiB.
// NotificationQueue::Size counts every string a notification holds: a queued one
// whose targets and request id were left out once cost ~1 MiB while counted ~128 B.
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "agent/inbox.h"
#include "agent/limits.h"
#include "agent/notification_queue.h"
#include "catch2/catch.hpp"
#include "proto/kvagent.pb.h"
#include "registry/remote_catalog.h"

namespace kvagent::agent {
namespace {

using Catch::Matchers::Contains;
using Catch::Matchers::EndsWith;

v1::Notification Eve(const std::string& id) {
  v1::Notification n;
  n.set_from_agent("eve");
  n.set_transfer_id(id);
  n.set_kind(v1::DATA_READY);
  n.set_ack_token(9);
  n.set_payload("p");
  n.add_targets("kv");
  return n;
}

absl::Status Check(const v1::Notification& sent, v1::Notification* parsed) {
  return Inbox::CheckBody(sent.SerializeAsString(), "eve", InboxLimits{}, parsed);
}

TEST_CASE("NotificationQueue Size counts targets and request_id") {
  v1::Notification n = Eve("t");
  const uint64_t base = NotificationQueue::Size(n);
  n.set_request_id(std::string(200, 'r'));
  CHECK(NotificationQueue::Size(n) == base + 200);
  for (int i = 0; i < 255; ++i) n.add_targets(std::string(1024, 't'));
  const uint64_t size = NotificationQueue::Size(n);
  std::printf("a notification with 256 targets (255 of 1 KiB) and a 200-byte request id: "
              "Size %lu\n", static_cast<unsigned long>(size));
  CHECK(size >= base + 200 + 255 * 1024);
  // Empty targets cost too (their string objects).
  v1::Notification empty = Eve("t");
  for (int i = 0; i < 255; ++i) empty.add_targets("");
  CHECK(NotificationQueue::Size(empty) >= NotificationQueue::Size(Eve("t")) + 255 * 32);

  // The queue's byte limit sees them: 64 KiB holds one such notification's ids, not
  // its targets.
  Limits limits;
  limits.set(Limit::kQueuedNotificationBytes, 64 << 10);
  NotificationQueue queue(&limits);
  CHECK(!queue.Push(QueuedNotification{n, {"engine"}}));
  CHECK(queue.overflowed() == 1);
  CHECK(queue.Reserve("a 256-target notification", size).code() ==
        absl::StatusCode::kResourceExhausted);
  CHECK(queue.Push(QueuedNotification{Eve("small"), {"engine"}}));
  CHECK(queue.queued_bytes() == NotificationQueue::Size(Eve("small")));
}

TEST_CASE("CheckBody bounds a peer notification's ids and target names") {
  const InboxLimits limits;
  CHECK(limits.max_notification_id_bytes == 256);  // SubmitTransfer's kMaxTransferIdBytes
  CHECK(limits.max_notification_target_bytes == registry::CatalogLimits{}.max_name_bytes);
  v1::Notification parsed;

  // At the bounds: taken.
  v1::Notification n = Eve(std::string(256, 'i'));
  n.set_request_id(std::string(256, 'r'));
  n.add_targets(std::string(256, 't'));
  CHECK(Check(n, &parsed).ok());

  n = Eve(std::string(64 << 10, 'i'));
  absl::Status refused = Check(n, &parsed);
  CHECK(refused.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.message()),
             Contains("transfer_id is 65536 bytes") && Contains("limit of 256"));

  n = Eve("ok");
  n.set_request_id(std::string(257, 'r'));
  refused = Check(n, &parsed);
  CHECK(refused.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.message()),
             Contains("request_id is 257 bytes") && Contains("limit of 256"));

  n = Eve("ok");
  n.clear_targets();
  for (int i = 0; i < 200; ++i) n.add_targets(std::string(1000, 't'));
  refused = Check(n, &parsed);
  CHECK(refused.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.message()),
             Contains("target 0 of 200 is 1000 bytes") && Contains("limit of 256"));
}

TEST_CASE("CheckBody bounds a batch entry as one notification") {
  // 300 KiB: a batch (1 MiB) may carry it, one notification (256 KiB) may not.
  v1::Notification n = Eve("big");
  n.set_error_message(std::string(300 << 10, 'e'));
  const std::string bytes = n.SerializeAsString();
  v1::Notification parsed = Eve("stale");  // a kept message: cleared, nothing answers
  const absl::Status refused = Inbox::CheckBody(bytes, "eve", InboxLimits{}, &parsed);
  CHECK(refused.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.message()),
             Contains(std::to_string(bytes.size()) + " bytes") && Contains("262144"));
  CHECK(parsed.transfer_id().empty());
}

TEST_CASE("CheckBody cuts a long error message at a UTF-8 boundary and marks it") {
  v1::Notification n = Eve("failed");
  n.set_kind(v1::TRANSFER_FAILED);
  // Two-byte characters, so a cut at an odd byte would split one.
  std::string text;
  while (text.size() < (200 << 10)) text += "\xc3\xa9";
  n.set_error_message(text);
  v1::Notification parsed;
  REQUIRE(Check(n, &parsed).ok());
  CHECK(parsed.error_message().size() <= InboxLimits{}.max_notification_error_bytes);
  CHECK(parsed.error_message().size() > 3000);
  CHECK_THAT(parsed.error_message(), EndsWith("[cut by the receiving agent: 204800 bytes, at "
                                              "most 4096 kept]"));
  // Still valid UTF-8: it serializes and parses back as a proto3 string.
  v1::Notification again;
  CHECK(again.ParseFromString(parsed.SerializeAsString()));
  // A short one is untouched.
  n.set_error_message("the sender's copy broke");
  REQUIRE(Check(n, &parsed).ok());
  CHECK(parsed.error_message() == "the sender's copy broke");
}

}  // namespace
}  // namespace kvagent::agent
