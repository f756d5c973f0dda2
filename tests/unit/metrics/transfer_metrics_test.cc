// TransferMetrics counts ended transfers on both sides: outgoing ones by op, data path,
// peer and outcome with their latency, the receiver's records by op, peer and outcome,
// and each timeline stage's share of the time, so that the stage sums of a direction
// equal its whole time.
#include <string>
#include <utility>
#include <vector>

#include "agent/transfer_metrics.h"
#include "catch2/catch.hpp"
#include "proto/kvagent.pb.h"

namespace kvagent::agent {
namespace {

v1::TransferState Ended(const std::string& id, const std::string& peer, v1::TransferPhase phase,
                        uint64_t bytes,
                        const std::vector<std::pair<v1::TransferStage, uint64_t>>& stages) {
  v1::TransferState s;
  s.set_transfer_id(id);
  s.set_peer(peer);
  s.set_op(v1::WRITE);
  s.set_phase(phase);
  s.set_bytes_done(bytes);
  for (const auto& [stage, at] : stages) {
    auto* e = s.add_timeline();
    e->set_stage(stage);
    e->set_at_us(at);
  }
  s.set_latency_us(stages.empty() ? 0 : stages.back().second);
  return s;
}

const StageHistogram* Find(const std::vector<StageHistogram>& all, const std::string& direction,
                           const std::string& stage) {
  for (const auto& h : all) {
    if (h.direction == direction && h.stage == stage) return &h;
  }
  return nullptr;
}

TEST_CASE("stage histograms add up to the latency, on both sides") {
  TransferMetrics m;
  m.Ended(Ended("t1", "beta", v1::COMPLETED, 4096,
                {{v1::STAGE_SUBMITTED, 0}, {v1::STAGE_PLANNED, 10}, {v1::STAGE_FIRST_POSTED, 60},
                 {v1::STAGE_DATA_FLUSHED, 900}, {v1::STAGE_NOTIFICATION_SENT, 950},
                 {v1::STAGE_ACKNOWLEDGED, 1400}, {v1::STAGE_ENDED, 1401}}),
          "ucx");
  m.IncomingEnded(Ended("t9", "alpha", v1::COMPLETED, 8192,
                        {{v1::STAGE_SUBMITTED, 0}, {v1::STAGE_NOTIFICATION_RECEIVED, 300},
                         {v1::STAGE_ACKNOWLEDGED, 320}, {v1::STAGE_ENDED, 700}}));
  m.IncomingEnded(Ended("t8", "alpha", v1::FAILED, 0,
                        {{v1::STAGE_SUBMITTED, 0}, {v1::STAGE_ENDED, 50}}));

  const auto series = m.Series();
  REQUIRE(series.size() == 1);
  CHECK(series[0].data_path == "ucx");
  CHECK(series[0].transfers == 1);
  CHECK(series[0].bytes == 4096);
  const auto latency = m.Latency();
  REQUIRE(latency.size() == 1);
  CHECK(latency[0].sum_us == 1401);

  const auto stages = m.Stages();
  uint64_t outgoing = 0, incoming = 0;
  for (const auto& h : stages) (h.direction == "outgoing" ? outgoing : incoming) += h.sum_us;
  CHECK(outgoing == 1401);
  CHECK(incoming == 700 + 50);
  const StageHistogram* flushed = Find(stages, "outgoing", "STAGE_DATA_FLUSHED");
  REQUIRE(flushed != nullptr);
  CHECK(flushed->sum_us == 840);
  CHECK(flushed->count == 1);
  CHECK(flushed->buckets[3] == 1);  // 840 us: in (500 us, 1 ms]
  CHECK(Find(stages, "outgoing", "STAGE_SUBMITTED") == nullptr);  // always 0: not a stage's time
  const StageHistogram* ended = Find(stages, "incoming", "STAGE_ENDED");
  REQUIRE(ended != nullptr);
  CHECK(ended->count == 2);
  CHECK(ended->sum_us == 380 + 50);

  const auto in = m.Incoming();
  REQUIRE(in.size() == 2);
  for (const auto& s : in) {
    CHECK(s.peer == "alpha");
    CHECK(s.transfers == 1);
    CHECK(s.bytes == (s.outcome == "COMPLETED" ? 8192u : 0u));
  }
}

TEST_CASE("incoming series are bounded: past the bound new peers count as _other") {
  TransferMetrics m;
  for (size_t i = 0; i < TransferMetrics::kMaxSeries + 3; ++i) {
    m.IncomingEnded(Ended("t", "peer-" + std::to_string(i), v1::COMPLETED, 1,
                          {{v1::STAGE_SUBMITTED, 0}, {v1::STAGE_ENDED, 1}}));
  }
  const auto in = m.Incoming();
  CHECK(in.size() == TransferMetrics::kMaxSeries + 1);
  uint64_t other = 0, total = 0;
  for (const auto& s : in) {
    total += s.transfers;
    if (s.peer == "_other") other = s.transfers;
  }
  CHECK(other == 3);
  CHECK(total == TransferMetrics::kMaxSeries + 3);
}

TEST_CASE("outgoing series: each ended transfer counts under its own labels, in any order") {
  // Ended keeps the last series at hand: transfers that alternate between peers,
  // outcomes, ops and data paths must still each land in their own series.
  TransferMetrics m;
  struct Case {
    const char* peer;
    v1::TransferOp op;
    v1::TransferPhase phase;
    const char* path;
  };
  const Case cases[] = {{"a", v1::WRITE, v1::COMPLETED, "ucx"},
                        {"a", v1::WRITE, v1::COMPLETED, "ucx"},
                        {"b", v1::WRITE, v1::COMPLETED, "ucx"},
                        {"a", v1::WRITE, v1::FAILED, "ucx"},
                        {"a", v1::READ, v1::COMPLETED, "ucx"},
                        {"a", v1::WRITE, v1::COMPLETED, "shm-direct"},
                        {"a", v1::WRITE, v1::COMPLETED, "ucx"},
                        {"ab", v1::WRITE, v1::COMPLETED, "ucx"}};
  for (const Case& c : cases) {
    v1::TransferState s = Ended("t", c.peer, c.phase, 10, {{v1::STAGE_SUBMITTED, 0}, {v1::STAGE_ENDED, 300}});
    s.set_op(c.op);
    if (c.phase != v1::COMPLETED) s.set_error_code(14);
    m.Ended(s, c.path);
  }
  std::vector<std::string> got;
  for (const auto& s : m.Series()) {
    got.push_back(s.op + "," + s.data_path + "," + s.peer + "," + s.outcome + "=" +
                  std::to_string(s.transfers) + "/" + std::to_string(s.bytes) + "/" +
                  std::to_string(s.errors_by_code[14]));
  }
  CHECK(got == std::vector<std::string>{
                   "READ,ucx,a,COMPLETED=1/10/0", "WRITE,shm-direct,a,COMPLETED=1/10/0",
                   "WRITE,ucx,a,COMPLETED=3/30/0", "WRITE,ucx,a,FAILED=1/10/1",
                   "WRITE,ucx,ab,COMPLETED=1/10/0", "WRITE,ucx,b,COMPLETED=1/10/0"});
  // The latency histograms by op and outcome, with the bucket bounds inclusive.
  uint64_t observed = 0;
  for (const auto& h : m.Latency()) {
    observed += h.count;
    CHECK(h.buckets[2] == h.count);  // 300 us: the (250, 500] bucket
  }
  CHECK(observed == 8);
}

TEST_CASE("latency buckets: a bound belongs to its own bucket, past the last is +Inf") {
  Histogram h;
  h.Observe(0);
  h.Observe(100);
  h.Observe(101);
  h.Observe(60000000);
  h.Observe(60000001);
  CHECK(h.buckets[0] == 2);
  CHECK(h.buckets[1] == 1);
  CHECK(h.buckets[kLatencyBucketsUs.size() - 1] == 1);
  CHECK(h.buckets[kLatencyBucketsUs.size()] == 1);
  CHECK(h.count == 5);
}

}  // namespace
}  // namespace kvagent::agent
