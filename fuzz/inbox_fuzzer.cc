// Fuzz target: what a peer's notification batch (active message 6) and acknowledgement
// batch (7) carry, as bytes, through the checks agent/inbox applies before anything
// reaches the engine (Inbox::ParseBatch, then Inbox::CheckBody per entry), with the
// agent's limits and with tight ones. Accepted batches and entries must be within every
// bound; refusals must say why with the codes the inbox counts and logs.
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "agent/inbox.h"
#include "base/format.h"
#include "fuzz/fuzz_check.h"
#include "fuzz/fuzz_target.h"
#include "proto/kvagent.pb.h"
#include "proto/wire.pb.h"

namespace kvagent::fuzz {
namespace {

using agent::Inbox;
using agent::InboxLimits;

constexpr std::string_view kSender = "eve";  // the authenticated header's agent

void CheckRefusal(const absl::Status& status, std::string_view what) {
  FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument ||
                 status.code() == absl::StatusCode::kPermissionDenied,
             "{} refused with code {}: {}", what, static_cast<int>(status.code()),
             status.message());
  FUZZ_CHECK(!status.message().empty(), "{} refused without a reason", what);
}

void RunEntries(const wire::NoticeBatch& batch, const InboxLimits& limits) {
  for (int i = 0; i < batch.notices_size(); ++i) {
    v1::Notification n;
    const absl::Status checked = Inbox::CheckBody(batch.notices(i), kSender, limits, &n);
    if (!checked.ok()) {
      CheckRefusal(checked, "an entry");
      continue;
    }
    FUZZ_CHECK(n.from_agent() == kSender, "entry {} from '{}' accepted", i, n.from_agent());
    FUZZ_CHECK(n.payload().size() <= limits.max_notification_payload_bytes,
               "entry {} with {} payload bytes accepted", i, n.payload().size());
    FUZZ_CHECK(n.targets_size() <= static_cast<int>(limits.max_notification_targets),
               "entry {} with {} targets accepted", i, n.targets_size());
  }
}

void Run(std::string_view bytes, const InboxLimits& limits) {
  wire::NoticeBatch notices;
  const absl::Status parsed = Inbox::ParseBatch(bytes, limits, &notices);
  if (parsed.ok()) {
    FUZZ_CHECK(bytes.size() <= limits.max_batch_bytes, "{}-byte batch accepted", bytes.size());
    FUZZ_CHECK(notices.notices_size() <= static_cast<int>(limits.max_batch_entries),
               "batch of {} entries accepted", notices.notices_size());
    RunEntries(notices, limits);
  } else {
    CheckRefusal(parsed, "a notification batch");
  }
  wire::TransferAckBatch acks;
  const absl::Status acks_parsed = Inbox::ParseBatch(bytes, limits, &acks);
  if (acks_parsed.ok()) {
    FUZZ_CHECK(acks.acks_size() <= static_cast<int>(limits.max_batch_entries),
               "{} acknowledgements accepted", acks.acks_size());
  } else {
    CheckRefusal(acks_parsed, "an acknowledgement batch");
  }
}

}  // namespace

const google::protobuf::Message& InputPrototype() { return wire::NoticeBatch::default_instance(); }
const char* TargetName() { return "inbox"; }

}  // namespace kvagent::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  kvagent::fuzz::Run(bytes, kvagent::agent::InboxLimits{});  // what the agent uses
  kvagent::agent::InboxLimits tight;
  tight.max_batch_entries = 3;
  tight.max_batch_bytes = 256;
  tight.max_notification_payload_bytes = 8;
  tight.max_notification_targets = 2;
  kvagent::fuzz::Run(bytes, tight);
  return 0;
}
