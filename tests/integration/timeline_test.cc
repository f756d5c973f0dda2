// Where a transfer's time went, against two real kvagentd processes: the timeline of a
// completed WRITE and READ has every stage in order with times that never go back (on
// both agents), a cancelled or timed-out transfer's timeline stops where it stopped,
// the request id travels to the peer and onto the log lines, and `kvagentctl transfers
// --timeline ID` prints the stages.
#include <sys/wait.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "tests/integration/agent_pair.h"

namespace kvagent::testing {
namespace {

using Stages = std::vector<v1::TransferStage>;

v1::TransferState WaitEnded(cli::AgentClient& client, const std::string& id) {
  auto state = client.WaitTransfer(id, 10000);
  INFO(state.status().ToString());
  REQUIRE(state.ok());
  return *state;
}

// The incoming record ends a moment after the sender's COMPLETED (the commit crosses
// the wire): polls the receiver until it has ended.
v1::TransferState WaitIncomingEnded(cli::AgentClient& client, const std::string& id,
                                    const std::string& from) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (true) {
    auto state = client.Get(id, from);
    INFO(state.status().ToString());
    REQUIRE(state.ok());
    if (state->phase() != v1::TRANSFERRING || std::chrono::steady_clock::now() > until) {
      return *state;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

Stages StagesOf(const v1::TransferState& t) {
  Stages out;
  for (const auto& e : t.timeline()) out.push_back(e.stage());
  return out;
}

// Times never go back, start at 0 and end at the transfer's latency.
void CheckMonotonic(const v1::TransferState& t) {
  INFO(t.DebugString());
  REQUIRE(t.timeline_size() > 0);
  CHECK(t.timeline(0).at_us() == 0);
  for (int i = 1; i < t.timeline_size(); ++i) {
    CHECK(t.timeline(i).at_us() >= t.timeline(i - 1).at_us());
  }
  CHECK(t.timeline(t.timeline_size() - 1).at_us() == t.latency_us());
  CHECK(t.submitted_unix_us() > 0);
}

const Stages kOutgoingComplete = {v1::STAGE_SUBMITTED,          v1::STAGE_PLANNED,
                                  v1::STAGE_FIRST_POSTED,       v1::STAGE_DATA_FLUSHED,
                                  v1::STAGE_NOTIFICATION_SENT,  v1::STAGE_ACKNOWLEDGED,
                                  v1::STAGE_ENDED};
const Stages kIncomingComplete = {v1::STAGE_SUBMITTED, v1::STAGE_NOTIFICATION_RECEIVED,
                                  v1::STAGE_ACKNOWLEDGED, v1::STAGE_ENDED};

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST_CASE("a completed WRITE and READ carry every stage, in order, on both agents") {
  AgentPairOptions options;
  options.extra_args = {"--log-level", "debug"};
  AgentPair pair(options);

  auto write = KvWrite("tl-write", {1, 2, 3}, {4, 5, 6}, "w");
  write.set_request_id("engine-req-17");
  REQUIRE(SubmitThrough(pair.prefill(), write).ok());
  const v1::TransferState sent = WaitEnded(pair.prefill(), "tl-write");
  REQUIRE(sent.phase() == v1::COMPLETED);
  CHECK(sent.request_id() == "engine-req-17");
  CHECK(StagesOf(sent) == kOutgoingComplete);
  CheckMonotonic(sent);
  CHECK(pair.PageEqual(1, 4));

  const v1::TransferState received = WaitIncomingEnded(pair.decode(), "tl-write", "prefill");
  CHECK(received.phase() == v1::COMPLETED);
  CHECK(received.direction() == v1::INCOMING);
  CHECK(received.request_id() == "engine-req-17");
  CHECK(StagesOf(received) == kIncomingComplete);
  CheckMonotonic(received);

  REQUIRE(pair.decode().Connect(pair.prefill_process().address()).ok());
  v1::SubmitTransferRequest read;
  read.set_transfer_id("tl-read");
  read.set_request_id("engine-req-18");
  read.set_peer("prefill");
  read.set_op(v1::READ);
  auto* items = read.add_segments()->mutable_items();
  items->set_local_group("kv");
  items->set_remote_group("kv");
  items->add_local_indices(9);
  items->add_remote_indices(7);
  REQUIRE(SubmitThrough(pair.decode(), read).ok());
  const v1::TransferState pulled = WaitEnded(pair.decode(), "tl-read");
  REQUIRE(pulled.phase() == v1::COMPLETED);
  CHECK(StagesOf(pulled) == kOutgoingComplete);
  CheckMonotonic(pulled);
  CHECK(pair.PageEqual(7, 9));
  const v1::TransferState served = WaitIncomingEnded(pair.prefill(), "tl-read", "decode");
  CHECK(StagesOf(served) == kIncomingComplete);
  CHECK(served.request_id() == "engine-req-18");

  // Every stage was logged with the transfer id and the engine's request id, on both
  // sides (debug level).
  const std::string prefill_log = ReadAll(pair.prefill_process().log_path());
  const std::string decode_log = ReadAll(pair.decode_process().log_path());
  for (const char* stage : {"STAGE_SUBMITTED", "STAGE_PLANNED", "STAGE_FIRST_POSTED",
                            "STAGE_DATA_FLUSHED", "STAGE_NOTIFICATION_SENT",
                            "STAGE_ACKNOWLEDGED", "STAGE_ENDED"}) {
    INFO(stage);
    CHECK_THAT(prefill_log, Catch::Contains(std::string("transfer 'tl-write' (request "
                                                        "'engine-req-17') (outgoing, peer "
                                                        "'decode'): ") + stage));
    CHECK_THAT(decode_log, Catch::Contains(std::string("transfer 'tl-read' (request "
                                                       "'engine-req-18') (outgoing, peer "
                                                       "'prefill'): ") + stage));
  }
  CHECK_THAT(decode_log, Catch::Contains("transfer 'tl-write' (request 'engine-req-17') "
                                         "(incoming, peer 'prefill'): STAGE_NOTIFICATION_RECEIVED"));

  // kvagentctl prints the stages with their times since submit.
  const std::string out_path = pair.work_dir() + "/timeline.txt";
  auto pid = SpawnKvagentctl(
      {"--agent", pair.prefill_process().address(), "transfers", "--timeline", "tl-write"},
      out_path);
  REQUIRE(pid.ok());
  int status = 0;
  REQUIRE(waitpid(*pid, &status, 0) == *pid);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  const std::string printed = ReadAll(out_path);
  INFO(printed);
  CHECK_THAT(printed, Catch::Contains("transfer 'tl-write' (request 'engine-req-17') outgoing "
                                      "WRITE peer 'decode': COMPLETED"));
  CHECK_THAT(printed, Catch::Contains("since submit") && Catch::Contains("delta"));
  size_t at = 0;
  for (v1::TransferStage stage : kOutgoingComplete) {
    const size_t found = printed.find(v1::TransferStage_Name(stage), at);
    INFO(v1::TransferStage_Name(stage));
    CHECK(found != std::string::npos);  // each stage, in order
    if (found != std::string::npos) at = found;
  }
}

TEST_CASE("a cancelled or timed-out transfer's timeline stops where it stopped") {
  AgentPair pair;
  // Chunk 0 is posted, the last chunk never comes: no plan is complete, nothing is
  // flushed or notified.
  auto open = KvWrite("tl-cancel", {0}, {0});
  open.set_more_chunks(true);
  REQUIRE(SubmitThrough(pair.prefill(), open).ok());
  REQUIRE(WaitTransferring(pair.prefill(), "tl-cancel").ok());
  REQUIRE(pair.prefill().Cancel("tl-cancel").ok());
  const v1::TransferState cancelled = WaitEnded(pair.prefill(), "tl-cancel");
  CHECK(cancelled.phase() == v1::CANCELLED);
  CHECK(StagesOf(cancelled) ==
        Stages{v1::STAGE_SUBMITTED, v1::STAGE_FIRST_POSTED, v1::STAGE_ENDED});
  CheckMonotonic(cancelled);

  auto late = KvWrite("tl-late", {1}, {1});
  late.set_more_chunks(true);
  late.set_timeout_ms(300);
  REQUIRE(SubmitThrough(pair.prefill(), late).ok());
  const v1::TransferState timed_out = WaitEnded(pair.prefill(), "tl-late");
  CHECK(timed_out.phase() == v1::TIMED_OUT);
  CHECK(StagesOf(timed_out) ==
        Stages{v1::STAGE_SUBMITTED, v1::STAGE_FIRST_POSTED, v1::STAGE_ENDED});
  CheckMonotonic(timed_out);
  CHECK(timed_out.timeline(2).at_us() >= 300000);  // it ended at its deadline
  // The receiver heard of it (open) and of its end, never of data.
  const v1::TransferState incoming = WaitIncomingEnded(pair.decode(), "tl-late", "prefill");
  CHECK(incoming.phase() == v1::TIMED_OUT);
  CHECK(StagesOf(incoming) == Stages{v1::STAGE_SUBMITTED, v1::STAGE_ENDED});
}

TEST_CASE("an oversized request id is refused naming the limit") {
  AgentPair pair;
  auto write = KvWrite("tl-big-request", {0}, {0});
  write.set_request_id(std::string(300, 'r'));
  auto refused = SubmitThrough(pair.prefill(), write);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.status().message()),
             Catch::Contains("request_id") && Catch::Contains("300 bytes") &&
                 Catch::Contains("limit of 256"));
}

}  // namespace
}  // namespace kvagent::testing
