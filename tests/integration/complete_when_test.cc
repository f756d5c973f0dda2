// complete_when (issue 15): a transfer that asks for COMPLETE_WHEN_PLACED is COMPLETED as
// soon as its bytes are in place, before the peer's acknowledgement, which is recorded
// afterwards. Two real kvagentd processes, the bytes compared, the peer's notifications
// counted; each case runs through gRPC and through the fast path (submit_paths_test).
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "tests/integration/agent_pair.h"

namespace kvagent::testing {
namespace {

v1::TransferState WaitDone(cli::AgentClient& client, const std::string& id) {
  auto state = client.WaitTransfer(id, 20000);
  INFO(id << ": " << state.status().ToString());
  REQUIRE(state.ok());
  return *state;
}

// Where `stage` is in the state's timeline; -1 when absent.
int StageIndex(const v1::TransferState& state, v1::TransferStage stage) {
  for (int i = 0; i < state.timeline_size(); ++i) {
    if (state.timeline(i).stage() == stage) return i;
  }
  return -1;
}

v1::AgentStatus Status(cli::AgentClient& client) {
  auto status = client.Status();
  REQUIRE(status.ok());
  return *std::move(status);
}

// The checks every successful placed transfer passes, once it ended on the sender:
// COMPLETED with the completion point it asked for, then the peer's acknowledgement
// recorded after ENDED.
void CheckPlacedAndAcknowledged(cli::AgentClient& sender, const std::string& id) {
  const v1::TransferState done = WaitDone(sender, id);
  INFO(id << ": " << done.error_message());
  REQUIRE(done.phase() == v1::COMPLETED);
  CHECK(done.complete_when() == v1::COMPLETE_WHEN_PLACED);
  CHECK(done.drained());
  const v1::TransferState later =
      WaitForState(sender, id, [](const v1::TransferState& s) { return s.peer_acknowledged(); });
  CHECK(later.peer_acknowledged());
  CHECK(later.peer_note().empty());
  CHECK(later.phase() == v1::COMPLETED);  // the end is final as first reported
  const int ended = StageIndex(later, v1::STAGE_ENDED);
  const int acked = StageIndex(later, v1::STAGE_ACKNOWLEDGED);
  CHECK(ended >= 0);
  CHECK(acked > ended);  // recorded after COMPLETED, not waited for
}

TEST_CASE("a WRITE that completes when placed: COMPLETED before the peer's acknowledgement, "
          "which is recorded after; the bytes and exactly one DATA_READY reach the peer") {
  AgentPair pair;
  pair.ResetContents();
  auto submitted = SubmitThrough(pair.prefill(), Placed(KvWrite("placed-w", {1, 2, 3}, {7, 5, 9},
                                                                "first-token:1")));
  INFO(submitted.status().ToString());
  REQUIRE(submitted.ok());
  CHECK(submitted->complete_when() == v1::COMPLETE_WHEN_PLACED);
  CheckPlacedAndAcknowledged(pair.prefill(), "placed-w");
  CHECK(pair.PageEqual(1, 7));
  CHECK(pair.PageEqual(2, 5));
  CHECK(pair.PageEqual(3, 9));
  CHECK(pair.PageUntouched(8));

  // The peer's view: one DATA_READY with the payload, and its incoming record COMPLETED.
  auto notes = PollNotifications(pair.decode(), 1);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].kind() == v1::DATA_READY);
  CHECK(notes[0].transfer_id() == "placed-w");
  CHECK(notes[0].payload() == "first-token:1");
  const v1::TransferState incoming = WaitForState(
      pair.decode(), "placed-w", [](const v1::TransferState& s) { return s.phase() == v1::COMPLETED; },
      "prefill");
  CHECK(incoming.phase() == v1::COMPLETED);
  CHECK(incoming.direction() == v1::INCOMING);

  // Many in a row, each through its own submit (distinct destinations: two transfers
  // may not write one page at once): every one notifies exactly once and every byte
  // lands; none waits for the one before's acknowledgement.
  constexpr int kMany = 32;
  for (int i = 0; i < kMany; ++i) {
    const uint64_t src = static_cast<uint64_t>(i % 32), dst = static_cast<uint64_t>((i * 7 + 3) % 32);
    auto state = SubmitThrough(
        pair.prefill(), Placed(KvWrite(fmt::format("placed-many{}", i), {src}, {dst}, "m")));
    INFO(state.status().ToString());
    REQUIRE(state.ok());
  }
  for (int i = 0; i < kMany; ++i) {
    CheckPlacedAndAcknowledged(pair.prefill(), fmt::format("placed-many{}", i));
  }
  for (int i = 0; i < kMany; ++i) {
    CHECK(pair.PageEqual(static_cast<uint64_t>(i % 32), static_cast<uint64_t>((i * 7 + 3) % 32)));
  }
  notes = PollNotifications(pair.decode(), kMany);
  CHECK(notes.size() == kMany);
  std::vector<std::string> ids;
  for (const auto& n : notes) ids.push_back(n.transfer_id());
  std::sort(ids.begin(), ids.end());
  CHECK(std::unique(ids.begin(), ids.end()) == ids.end());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  auto polled = pair.decode().Poll(0);
  REQUIRE(polled.ok());
  CHECK(polled->notifications_size() == 0);  // no duplicate came later

  const v1::AgentStatus status = Status(pair.prefill());
  CHECK(status.completed_when_placed() == kMany + 1);
  CHECK(status.placed_not_taken() == 0);
  CHECK(status.transfers_completed() == kMany + 1);
}

TEST_CASE("a READ that completes when placed: our pages hold the peer's bytes at COMPLETED") {
  AgentPair pair;
  pair.ResetContents();
  // Decode page 6 gets prefill page 4's bytes, then prefill page 11 reads them back.
  REQUIRE(SubmitThrough(pair.prefill(), KvWrite("seed", {4}, {6})).ok());
  REQUIRE(WaitDone(pair.prefill(), "seed").phase() == v1::COMPLETED);
  REQUIRE(PollNotifications(pair.decode(), 1).size() == 1);
  v1::SubmitTransferRequest read = Placed(KvWrite("placed-r", {11}, {6}, "read-done"));
  read.set_op(v1::READ);
  auto submitted = SubmitThrough(pair.prefill(), read);
  INFO(submitted.status().ToString());
  REQUIRE(submitted.ok());
  CheckPlacedAndAcknowledged(pair.prefill(), "placed-r");
  CHECK(pair.PageEqual(4, 6));
  for (uint32_t r = 0; r < pair.prefill_pool().regions(); ++r) {
    INFO("region " << r);
    CHECK(std::equal(pair.prefill_pool().Page(r, 11),
                     pair.prefill_pool().Page(r, 11) + pair.prefill_pool().shape.page_bytes,
                     pair.prefill_pool().Page(r, 4)));
  }
  auto notes = PollNotifications(pair.decode(), 1);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].transfer_id() == "placed-r");
  CHECK(notes[0].payload() == "read-done");
}

// Over tcp UCX has no RMA of its own, and the agents move the data as their own
// messages (data path "ucx-am"): the sender's batch is done once its messages are
// sent, not once they are in place, so only the peer's acknowledgement says they are.
// The transfer completes then, as a staged one does, and says so.
TEST_CASE("completing when placed over tcp (no native RMA, data as the agents' messages): "
          "COMPLETED when acknowledged, and the transfer says so") {
  AgentPairOptions options;
  options.env["UCX_TLS"] = "tcp,self";
  options.extra_args = {"--shm-direct", "off"};
  AgentPair pair(options);
  pair.ResetContents();
  auto peers = pair.prefill().Peers();
  REQUIRE(peers.ok());
  REQUIRE(peers->peers_size() == 1);
  REQUIRE(peers->peers(0).data_path() == "ucx-am");
  auto submitted =
      SubmitThrough(pair.prefill(), Placed(KvWrite("placed-tcp", {1, 2, 3}, {9, 4, 5}, "tcp")));
  INFO(submitted.status().ToString());
  REQUIRE(submitted.ok());
  const v1::TransferState done = WaitDone(pair.prefill(), "placed-tcp");
  INFO(done.error_message());
  REQUIRE(done.phase() == v1::COMPLETED);
  CHECK(done.complete_when() == v1::COMPLETE_WHEN_ACKNOWLEDGED);
  CHECK(done.drained());
  const int ended = StageIndex(done, v1::STAGE_ENDED);
  const int acked = StageIndex(done, v1::STAGE_ACKNOWLEDGED);
  CHECK(acked >= 0);
  CHECK(acked < ended);  // waited for, not recorded after
  CHECK(pair.PageEqual(1, 9));
  CHECK(pair.PageEqual(2, 4));
  CHECK(pair.PageEqual(3, 5));
  auto notes = PollNotifications(pair.decode(), 1);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].transfer_id() == "placed-tcp");
}

TEST_CASE("a peer that refuses the notification of a transfer completed when placed: the "
          "COMPLETED stands, peer_note says why, it is counted, and the peer's record says "
          "FAILED: its owners get no DATA_READY") {
  AgentPairOptions options;
  options.extra_args = {"--max-queued-notifications", "2"};
  AgentPair pair(options);
  pair.ResetContents();
  // Two notifications the decode engine does not take fill its queue.
  for (const char* id : {"fill-a", "fill-b"}) {
    REQUIRE(SubmitThrough(pair.prefill(), KvWrite(id, {1}, {1}, id)).ok());
    REQUIRE(WaitDone(pair.prefill(), id).phase() == v1::COMPLETED);
  }
  // Acknowledged (the default), the third is refused to its sender: FAILED, naming why.
  REQUIRE(SubmitThrough(pair.prefill(), KvWrite("refused-ack", {2}, {2}, "x")).ok());
  const v1::TransferState refused = WaitDone(pair.prefill(), "refused-ack");
  CHECK(refused.phase() == v1::FAILED);
  CHECK_THAT(refused.error_message(), Catch::Contains("queued_notifications"));
  // Placed, the sender reported COMPLETED before the peer answered: that stands, and
  // the refusal is recorded beside it.
  REQUIRE(SubmitThrough(pair.prefill(), Placed(KvWrite("refused-placed", {3}, {3}, "y"))).ok());
  const v1::TransferState done = WaitDone(pair.prefill(), "refused-placed");
  CHECK(done.phase() == v1::COMPLETED);
  const v1::TransferState noted = WaitForState(pair.prefill(), "refused-placed",
                                          [](const v1::TransferState& s) { return !s.peer_note().empty(); });
  CHECK(noted.phase() == v1::COMPLETED);
  CHECK_FALSE(noted.peer_acknowledged());
  CHECK_THAT(noted.peer_note(), Catch::Contains("refused the notification"));
  CHECK_THAT(noted.peer_note(), Catch::Contains("queued_notifications"));
  CHECK(pair.PageEqual(3, 3));  // the bytes are there all the same
  const v1::AgentStatus status = Status(pair.prefill());
  CHECK(status.completed_when_placed() == 1);
  CHECK(status.placed_not_taken() == 1);
  // The peer's record says FAILED: its owners never see a DATA_READY for it.
  const v1::TransferState incoming = WaitForState(
      pair.decode(), "refused-placed",
      [](const v1::TransferState& s) { return s.phase() != v1::TRANSFERRING; }, "prefill");
  CHECK(incoming.phase() == v1::FAILED);
  auto notes = PollNotifications(pair.decode(), 2);
  for (const auto& n : notes) {
    INFO(n.transfer_id());
    CHECK_FALSE((n.transfer_id() == "refused-placed" && n.kind() == v1::DATA_READY));
  }
}

// Prefill's first transfer maps decode's pool (contents reset before); then every
// thread of decode is stopped (SIGSTOP) until this goes (SIGCONT).
struct HungDecode {
  explicit HungDecode(AgentPair& pair) : pid(pair.decode_process().pid()) {
    pair.ResetContents();
    REQUIRE(SubmitThrough(pair.prefill(), KvWrite("warm", {1}, {1})).ok());
    REQUIRE(WaitDone(pair.prefill(), "warm").phase() == v1::COMPLETED);
    REQUIRE(SuspendAgent(pid) == "");
  }
  HungDecode(const HungDecode&) = delete;
  HungDecode& operator=(const HungDecode&) = delete;
  ~HungDecode() { ::kill(pid, SIGCONT); }
  const pid_t pid;
};

TEST_CASE("a WRITE completed when placed to a hung peer: COMPLETED at once (the bytes are in "
          "its memory), and once the peer is lost peer_note says its notification's fate "
          "is unknown") {
  AgentPair pair;
  const HungDecode hung(pair);
  REQUIRE(SubmitThrough(pair.prefill(), Placed(KvWrite("hung-placed", {5}, {6}, "z"))).ok());
  const v1::TransferState done = WaitDone(pair.prefill(), "hung-placed");
  CHECK(done.phase() == v1::COMPLETED);
  CHECK_FALSE(done.peer_acknowledged());
  CHECK(pair.PageEqual(5, 6));  // written while the peer's every thread was stopped
  const v1::TransferState noted = WaitForState(
      pair.prefill(), "hung-placed", [](const v1::TransferState& s) { return !s.peer_note().empty(); });
  CHECK(noted.phase() == v1::COMPLETED);
  CHECK_FALSE(noted.peer_acknowledged());
  CHECK_THAT(noted.peer_note(), Catch::Contains("lost before it answered"));
  CHECK(Status(pair.prefill()).placed_not_taken() == 1);
}

TEST_CASE("transfers completed when placed whose peer answers late stay whole until the "
          "answer is recorded, then are kept compact with it") {
  // The sender keeps its newest 256 ended transfers whole and older ones compact. With
  // the peer hung, 260 placed WRITEs complete (their bytes are in its memory) and the
  // oldest 4 reach their turn to be compacted still awaiting the peer's answer: they
  // stay whole (parked) instead, and once the peer resumes and answers, each is
  // compacted with its answer recorded.
  AgentPairOptions options;
  // 300 kept (256 whole, 44 compact). The peer must not be declared lost while it is
  // hung, however slow the submits (a sanitizer build): no liveness door (its pings
  // would see it hung within about 1 s), so it is polled, every 5 s (lost after about
  // 30 s).
  options.extra_args = {"--ended-transfers-kept", "300", "--liveness", "off",
                        "--peer-refresh-ms", "5000"};
  AgentPair pair(options);
  const HungDecode hung(pair);
  constexpr int kPlaced = 260;
  for (int i = 0; i < kPlaced; ++i) {
    const uint64_t page = static_cast<uint64_t>(i % 32);
    auto done = SubmitThrough(pair.prefill(),
                              Placed(KvWrite(fmt::format("late-{}", i), {page}, {page}, "n")));
    INFO(i << ": " << done.status().ToString());
    REQUIRE(done.ok());
    REQUIRE(WaitDone(pair.prefill(), fmt::format("late-{}", i)).phase() == v1::COMPLETED);
  }
  auto early = pair.prefill().Get("late-0");
  REQUIRE(early.ok());
  CHECK_FALSE(early->peer_acknowledged());  // the peer is still hung
  REQUIRE(::kill(hung.pid, SIGCONT) == 0);
  // One more transfer ends after the answers: whatever passes it makes are done.
  REQUIRE(SubmitThrough(pair.prefill(), KvWrite("after", {2}, {2})).ok());
  REQUIRE(WaitDone(pair.prefill(), "after").phase() == v1::COMPLETED);
  for (int i = 0; i < kPlaced; i += (i < 8 ? 1 : 37)) {
    const std::string id = fmt::format("late-{}", i);
    INFO(id);
    const v1::TransferState later = WaitForState(
        pair.prefill(), id, [](const v1::TransferState& s) { return s.peer_acknowledged(); });
    CHECK(later.phase() == v1::COMPLETED);
    CHECK(later.peer_acknowledged());
    CHECK(later.peer_note().empty());
    CHECK(StageIndex(later, v1::STAGE_ACKNOWLEDGED) > StageIndex(later, v1::STAGE_ENDED));
  }
  CHECK(Status(pair.prefill()).placed_not_taken() == 0);
}

TEST_CASE("complete_when: an unknown value is refused naming it, and a later chunk may leave "
          "it unset or repeat it but not change it") {
  AgentPair pair;
  pair.ResetContents();
  v1::SubmitTransferRequest bad = KvWrite("bad-point", {1}, {1});
  bad.set_complete_when(static_cast<v1::CompletionPoint>(7));
  auto refused = SubmitThrough(pair.prefill(), bad);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.status().message()),
             Catch::Contains("complete_when 7 is not a completion point"));
  CHECK(pair.PageUntouched(1));

  // Chunk 0 acknowledged (unset), chunk 1 asks for placed: refused; the transfer goes
  // on with a correct chunk 1 and completes when acknowledged.
  v1::SubmitTransferRequest first = KvWrite("chunks-ack", {1}, {1});
  first.set_more_chunks(true);
  REQUIRE(SubmitThrough(pair.prefill(), first).ok());
  v1::SubmitTransferRequest second = KvWrite("chunks-ack", {2}, {2}, "c");
  second.set_chunk(1);
  auto changed = SubmitThrough(pair.prefill(), Placed(second));
  REQUIRE_FALSE(changed.ok());
  CHECK(changed.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(changed.status().message()),
             Catch::Contains("differs from chunk 0's (COMPLETE_WHEN_ACKNOWLEDGED)"));
  REQUIRE(SubmitThrough(pair.prefill(), second).ok());
  const v1::TransferState acked = WaitDone(pair.prefill(), "chunks-ack");
  CHECK(acked.phase() == v1::COMPLETED);
  CHECK(acked.complete_when() == v1::COMPLETE_WHEN_ACKNOWLEDGED);
  CHECK(StageIndex(acked, v1::STAGE_ACKNOWLEDGED) < StageIndex(acked, v1::STAGE_ENDED));
  CHECK(pair.PageEqual(1, 1));
  CHECK(pair.PageEqual(2, 2));

  // Chunk 0 placed, chunk 1 unset: placed.
  first = Placed(KvWrite("chunks-placed", {3}, {3}));
  first.set_more_chunks(true);
  REQUIRE(SubmitThrough(pair.prefill(), first).ok());
  second = KvWrite("chunks-placed", {4}, {4}, "d");
  second.set_chunk(1);
  REQUIRE(SubmitThrough(pair.prefill(), second).ok());
  CheckPlacedAndAcknowledged(pair.prefill(), "chunks-placed");
  CHECK(pair.PageEqual(3, 3));
  CHECK(pair.PageEqual(4, 4));
  auto notes = PollNotifications(pair.decode(), 2);
  CHECK(notes.size() == 2);
}

}  // namespace
}  // namespace kvagent::testing
