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

}  // namespace
}  // namespace kvagent::agent
