// What kvagentctl shows of a transfer that completes when placed (complete_when,
// issue 15), against two real kvagentd processes: `transfers` and `transfers
// --timeline ID` say it completed when placed and whether the peer then took its
// notification (acknowledged, or the peer_note of its refusal), and `status` counts
// them; a transfer completing when acknowledged shows none of it.
#include <chrono>
#include <string>
#include <thread>

#include "catch2/catch.hpp"
#include "tests/integration/agent_pair.h"

namespace kvagent::testing {
namespace {

// `kvagentctl --agent ADDRESS ARGS...`'s output; the test fails when it did not exit 0.
std::string Ctl(AgentPair& pair, std::vector<std::string> args, const std::string& name) {
  args.insert(args.begin(), {"--agent", pair.prefill_process().address()});
  auto out = KvagentctlOutput(args, pair.work_dir() + "/" + name + ".txt");
  INFO(name << ": " << out.status().ToString());
  REQUIRE(out.ok());
  return *out;
}

// The line of `listing` that starts with `id`.
std::string LineOf(const std::string& listing, const std::string& id) {
  size_t at = 0;
  while (at < listing.size()) {
    const size_t end = std::min(listing.find('\n', at), listing.size());
    const std::string line = listing.substr(at, end - at);
    if (line.rfind(id + " ", 0) == 0) return line;
    at = end + 1;
  }
  return "";
}

TEST_CASE("kvagentctl shows a transfer completed when placed, and whether its peer took the "
          "notification") {
  AgentPair pair;
  pair.ResetContents();
  REQUIRE(SubmitThrough(pair.prefill(), KvWrite("shown-acked", {1}, {1}, "a")).ok());
  REQUIRE(SubmitThrough(pair.prefill(), Placed(KvWrite("shown-placed", {2}, {2}, "b"))).ok());
  const v1::TransferState placed = WaitForState(pair.prefill(), "shown-placed",
                                           [](const v1::TransferState& s) {
                                             return s.peer_acknowledged();
                                           });
  REQUIRE(placed.phase() == v1::COMPLETED);
  REQUIRE(placed.peer_acknowledged());
  REQUIRE(WaitForState(pair.prefill(), "shown-acked", [](const v1::TransferState& s) {
            return s.phase() == v1::COMPLETED;
          }).phase() == v1::COMPLETED);
  CHECK(pair.PageEqual(2, 2));

  const std::string timeline = Ctl(pair, {"transfers", "--timeline", "shown-placed"}, "placed");
  INFO(timeline);
  CHECK_THAT(timeline, Catch::Contains("complete_when COMPLETE_WHEN_PLACED: placed, peer "
                                       "acknowledged"));
  CHECK_THAT(timeline, Catch::Contains("STAGE_ACKNOWLEDGED"));
  const std::string acked = Ctl(pair, {"transfers", "--timeline", "shown-acked"}, "acked");
  INFO(acked);
  CHECK_THAT(acked, !Catch::Contains("COMPLETE_WHEN_PLACED"));

  const std::string listing = Ctl(pair, {"transfers"}, "list");
  INFO(listing);
  CHECK_THAT(LineOf(listing, "shown-placed"), Catch::EndsWith("[placed, peer acknowledged]"));
  CHECK_THAT(LineOf(listing, "shown-acked"), !Catch::Contains("placed"));
  CHECK_THAT(LineOf(listing, "shown-acked"), Catch::Contains("COMPLETED"));

  const std::string status = Ctl(pair, {"status"}, "status");
  INFO(status);
  CHECK_THAT(status, Catch::Contains("(1 completed when placed, 0 of them not taken by the peer)"));
}

TEST_CASE("kvagentctl shows the peer's refusal of a transfer completed when placed") {
  AgentPairOptions options;
  options.extra_args = {"--max-queued-notifications", "1"};
  AgentPair pair(options);
  pair.ResetContents();
  // A notification the decode engine does not take fills its queue; the next is refused.
  REQUIRE(SubmitThrough(pair.prefill(), KvWrite("fill", {1}, {1}, "f")).ok());
  REQUIRE(WaitForState(pair.prefill(), "fill", [](const v1::TransferState& s) {
            return s.phase() == v1::COMPLETED;
          }).phase() == v1::COMPLETED);
  REQUIRE(SubmitThrough(pair.prefill(), Placed(KvWrite("shown-refused", {2}, {2}, "r"))).ok());
  const v1::TransferState refused = WaitForState(pair.prefill(), "shown-refused",
                                            [](const v1::TransferState& s) {
                                              return !s.peer_note().empty();
                                            });
  REQUIRE(refused.phase() == v1::COMPLETED);
  REQUIRE_FALSE(refused.peer_note().empty());

  const std::string timeline = Ctl(pair, {"transfers", "--timeline", "shown-refused"}, "refused");
  INFO(timeline);
  CHECK_THAT(timeline, Catch::Contains("complete_when COMPLETE_WHEN_PLACED: placed, NOT taken by "
                                       "the peer: " + refused.peer_note()));
  const std::string listing = Ctl(pair, {"transfers"}, "list");
  INFO(listing);
  CHECK_THAT(LineOf(listing, "shown-refused"),
             Catch::EndsWith("[placed, NOT taken by the peer: " + refused.peer_note() + "]"));
  const std::string status = Ctl(pair, {"status"}, "status");
  INFO(status);
  CHECK_THAT(status, Catch::Contains("(1 completed when placed, 1 of them not taken by the peer)"));
}

}  // namespace
}  // namespace kvagent::testing
