// Issue 17's "done when": a fleet of three real kvagentd processes on one machine,
// started from an etcd directory only (no peer address is given to any of them),
// connects by name (agent:NAME) and moves verified transfers between three pairs: a
// WRITE over shm-direct, a WRITE over UCX (that agent runs --shm-direct off) and a
// READ. Then every agent's Prometheus endpoint and every transfer's timeline, on
// both ends, must account for each byte and each microsecond of that run: the
// counters by op, data path, peer and outcome equal what moved; the per-stage
// histograms add up to the latency histogram; each timeline has every stage, in
// order, within its total, inside the time the client measured, and the receiver's
// record fits between the sender's stages.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "cli/agent_client.h"
#include "cli/kv_pool.h"
#include "tests/integration/agent_pair.h"
#include "tests/integration/etcd_fixture.h"
#include "tests/integration/metrics_scrape.h"
#include "tests/unit/catch_main.h"

namespace kvagent::testing {
namespace {

using Stages = std::vector<v1::TransferStage>;
const Stages kOutgoing = {v1::STAGE_SUBMITTED,         v1::STAGE_PLANNED,
                          v1::STAGE_FIRST_POSTED,      v1::STAGE_DATA_FLUSHED,
                          v1::STAGE_NOTIFICATION_SENT, v1::STAGE_ACKNOWLEDGED,
                          v1::STAGE_ENDED};
const Stages kIncoming = {v1::STAGE_SUBMITTED, v1::STAGE_NOTIFICATION_RECEIVED,
                          v1::STAGE_ACKNOWLEDGED, v1::STAGE_ENDED};

// Two readings of the wall clock and the monotonic clock, taken a moment apart in
// two processes on one host, may disagree by that moment: the slack allowed when
// comparing one agent's stage times with another's.
constexpr int64_t kClockSlackUs = 20000;

// One transfer of the run and what the test saw of it.
struct Moved {
  std::string id, from, to;  // initiator and its peer
  v1::TransferOp op = v1::WRITE;
  std::string data_path;     // expected label on the initiator
  uint64_t bytes = 0;        // expected: pages x regions x page bytes
  int64_t client_us = 0;     // submit to the end seen by the client
  v1::TransferState sent, received;
};

Stages StagesOf(const v1::TransferState& t) {
  Stages out;
  for (const auto& e : t.timeline()) out.push_back(e.stage());
  return out;
}

int64_t At(const v1::TransferState& t, v1::TransferStage stage) {
  for (const auto& e : t.timeline()) {
    if (e.stage() == stage) return static_cast<int64_t>(e.at_us());
  }
  FAIL("stage " << v1::TransferStage_Name(stage) << " missing from " << t.DebugString());
  return -1;
}

// Wall-clock microseconds at which `t` reached `stage`.
int64_t Wall(const v1::TransferState& t, v1::TransferStage stage) {
  return static_cast<int64_t>(t.submitted_unix_us()) + At(t, stage);
}

// Every stage present, in order, at times that start at 0, never go back, stay within
// the total and end at it; the deltas between stages add up to the total.
void CheckAccountsForTime(const v1::TransferState& t, const Stages& expected) {
  INFO(t.DebugString());
  CHECK(StagesOf(t) == expected);
  REQUIRE(t.timeline_size() > 0);
  CHECK(t.timeline(0).at_us() == 0);
  uint64_t deltas = 0;
  for (int i = 1; i < t.timeline_size(); ++i) {
    CHECK(t.timeline(i).at_us() >= t.timeline(i - 1).at_us());
    CHECK(t.timeline(i).at_us() <= t.latency_us());
    deltas += t.timeline(i).at_us() - t.timeline(i - 1).at_us();
  }
  CHECK(deltas == t.latency_us());
  CHECK(t.timeline(t.timeline_size() - 1).at_us() == t.latency_us());
  CHECK(t.latency_us() > 0);
  CHECK(t.submitted_unix_us() > 0);
}

// The receiver's record of a transfer ends a moment after the sender's (the commit
// crosses the wire): polls it until it has ended.
v1::TransferState WaitIncomingEnded(cli::AgentClient& client, const std::string& id,
                                    const std::string& from) {
  v1::TransferState state;
  WaitFor([&] {
    auto got = client.Get(id, from);
    if (!got.ok()) return false;
    state = *got;
    return state.phase() != v1::TRANSFERRING;
  }, 5000);
  return state;
}

class Fleet {
 public:
  explicit Fleet(const std::string& url) : dir_(FleetWorkDir("fleet")) {
    const std::vector<std::string> metrics = {"--metrics-listen", "127.0.0.1:0"};
    std::vector<std::string> ucx_only = metrics;
    ucx_only.insert(ucx_only.end(), {"--shm-direct", "off"});
    agents_.emplace("alpha", std::make_unique<FleetAgent>(dir_, "alpha", url, metrics));
    agents_.emplace("beta", std::make_unique<FleetAgent>(dir_, "beta", url, ucx_only));
    agents_.emplace("gamma", std::make_unique<FleetAgent>(dir_, "gamma", url, metrics));
  }
  FleetAgent& operator[](const std::string& name) { return *agents_.at(name); }
  const std::map<std::string, std::unique_ptr<FleetAgent>>& agents() const { return agents_; }

  // Fills the source pages, submits, waits, compares the bytes and fetches both ends'
  // timelines; `pages` are the same indices on both sides.
  Moved Move(const std::string& id, const std::string& from, const std::string& to,
             v1::TransferOp op, const std::string& data_path, const std::vector<uint64_t>& pages) {
    Moved m;
    m.id = id;
    m.from = from;
    m.to = to;
    m.op = op;
    m.data_path = data_path;
    FleetAgent& initiator = (*this)[from];
    FleetAgent& peer = (*this)[to];
    FleetAgent& source = op == v1::WRITE ? initiator : peer;
    FleetAgent& destination = op == v1::WRITE ? peer : initiator;
    const uint64_t page_bytes = source.pool.shape.page_bytes;
    for (uint64_t page : pages) {
      for (uint32_t r = 0; r < source.pool.regions(); ++r) {
        cli::FillPage(source.pool.Page(r, page), page_bytes, std::hash<std::string>()(id), r,
                      page);
        std::memset(destination.pool.Page(r, page), 0xEE, page_bytes);
      }
    }
    m.bytes = pages.size() * source.pool.regions() * page_bytes;

    auto request = KvWrite(id, pages, pages, "ready:" + id);
    request.set_peer(to);
    request.set_op(op);
    request.set_request_id("req-" + id);
    const auto start = std::chrono::steady_clock::now();
    auto submitted = initiator.client->Submit(request);
    INFO(id << ": " << submitted.status().ToString());
    REQUIRE(submitted.ok());
    auto ended = initiator.client->WaitTransfer(id, 20000);
    m.client_us = std::chrono::duration_cast<std::chrono::microseconds>(
                      std::chrono::steady_clock::now() - start)
                      .count();
    REQUIRE(ended.ok());
    INFO(ended->DebugString());
    REQUIRE(ended->phase() == v1::COMPLETED);
    m.sent = *ended;
    for (uint64_t page : pages) {
      for (uint32_t r = 0; r < source.pool.regions(); ++r) {
        CHECK(std::memcmp(source.pool.Page(r, page), destination.pool.Page(r, page), page_bytes) ==
              0);
      }
    }
    m.received = WaitIncomingEnded(*peer.client, id, from);
    return m;
  }

 private:
  std::string dir_;
  std::map<std::string, std::unique_ptr<FleetAgent>> agents_;
};

// The sender's timeline against the client's clock, and the receiver's against the
// sender's: each stage of the receiver happens when the sender says it should.
void CheckTimelines(const Moved& m) {
  INFO(m.id << " " << m.from << " -> " << m.to);
  CheckAccountsForTime(m.sent, kOutgoing);
  CHECK(m.sent.request_id() == "req-" + m.id);
  CHECK(m.sent.bytes_done() == m.bytes);
  // The agent's submit-to-outcome lies inside the client's submit-to-answer.
  CHECK(static_cast<int64_t>(m.sent.latency_us()) <= m.client_us);

  INFO(m.received.DebugString());
  REQUIRE(m.received.phase() == v1::COMPLETED);
  CHECK(m.received.direction() == v1::INCOMING);
  CHECK(m.received.request_id() == "req-" + m.id);
  CHECK(m.received.bytes_done() == m.bytes);
  CheckAccountsForTime(m.received, kIncoming);
  // The receiver first heard of it after the sender's submit; DATA_READY arrived
  // after the sender posted it and before the sender had its acknowledgement; the
  // receiver ended (the sender's commit) after that acknowledgement.
  CHECK(Wall(m.received, v1::STAGE_SUBMITTED) + kClockSlackUs >=
        Wall(m.sent, v1::STAGE_SUBMITTED));
  CHECK(Wall(m.received, v1::STAGE_NOTIFICATION_RECEIVED) + kClockSlackUs >=
        Wall(m.sent, v1::STAGE_NOTIFICATION_SENT));
  CHECK(Wall(m.received, v1::STAGE_NOTIFICATION_RECEIVED) <=
        Wall(m.sent, v1::STAGE_ACKNOWLEDGED) + kClockSlackUs);
  CHECK(Wall(m.received, v1::STAGE_ENDED) + kClockSlackUs >= Wall(m.sent, v1::STAGE_ACKNOWLEDGED));
}

std::string Label(const char* name, const std::string& value) {
  return std::string(name) + "=\"" + value + "\"";
}

// kvagent_transfer_stage_seconds of one direction: every stage after the first seen
// `transfers` times, the stages' sums adding up to `latency_sum` seconds.
void CheckStageSums(const std::string& body, const std::string& direction, const Stages& stages,
                    double transfers, double latency_sum) {
  const std::string label = Label("direction", direction);
  for (size_t i = 1; i < stages.size(); ++i) {
    const std::string stage = v1::TransferStage_Name(stages[i]);
    INFO(direction << " " << stage);
    CHECK(Value(body, "kvagent_transfer_stage_seconds_count", {label, Label("stage", stage)}) ==
          transfers);
  }
  CHECK(Value(body, "kvagent_transfer_stage_seconds_sum", {label}) ==
        Approx(latency_sum).margin(1e-6));
}

// Every counter of `name`'s metrics that is about transfers equals what the run moved.
void CheckMetrics(const std::string& name, const std::string& body, const std::vector<Moved>& run) {
  INFO("agent " << name);
  double sent = 0, sent_bytes = 0, latency_sum = 0, received = 0, received_bytes = 0;
  double received_latency_sum = 0;
  std::map<std::vector<std::string>, std::pair<double, double>> outgoing, incoming;
  for (const Moved& m : run) {
    const std::string op = v1::TransferOp_Name(m.op);
    if (m.from == name) {
      auto& [n, bytes] = outgoing[{Label("op", op), Label("peer", m.to),
                                   Label("data_path", m.data_path), "outcome=\"COMPLETED\""}];
      ++n;
      bytes += static_cast<double>(m.bytes);
      ++sent;
      sent_bytes += static_cast<double>(m.bytes);
      latency_sum += static_cast<double>(m.sent.latency_us()) / 1e6;
    }
    if (m.to == name) {
      auto& [n, bytes] = incoming[{Label("op", op), Label("peer", m.from), "outcome=\"COMPLETED\""}];
      ++n;
      bytes += static_cast<double>(m.bytes);
      ++received;
      received_bytes += static_cast<double>(m.bytes);
      received_latency_sum += static_cast<double>(m.received.latency_us()) / 1e6;
    }
  }
  for (const auto& [labels, expected] : outgoing) {
    INFO(labels[0] << labels[1] << labels[2]);
    CHECK(Value(body, "kvagent_transfers_total", labels) == expected.first);
    CHECK(Value(body, "kvagent_transfer_bytes_total", labels) == expected.second);
  }
  // Nothing counted that the run did not move.
  CHECK(Value(body, "kvagent_transfers_total") == sent);
  CHECK(Value(body, "kvagent_transfer_bytes_total") == sent_bytes);
  CHECK(Value(body, "kvagent_transfer_errors_total") == 0);
  CHECK(Value(body, "kvagent_transfers_completed_total") == sent);
  CHECK(Value(body, "kvagent_transfers_active") == 0);
  CHECK(Value(body, "kvagent_transfer_latency_seconds_count") == sent);
  CHECK(Value(body, "kvagent_transfer_latency_seconds_sum") == Approx(latency_sum).epsilon(1e-9));
  for (const auto& [labels, expected] : incoming) {
    INFO(labels[0] << labels[1]);
    CHECK(Value(body, "kvagent_incoming_transfers_total", labels) == expected.first);
    CHECK(Value(body, "kvagent_incoming_bytes_total", labels) == expected.second);
  }
  CHECK(Value(body, "kvagent_incoming_transfers_total") == received);
  CHECK(Value(body, "kvagent_incoming_bytes_total") == received_bytes);

  // Where the time went, summed over the run: each stage after SUBMITTED counted once
  // per transfer, and the stages' sums add up to the latency sums.
  CheckStageSums(body, "outgoing", kOutgoing, sent, latency_sum);
  CheckStageSums(body, "incoming", kIncoming, received, received_latency_sum);
}

TEST_CASE("fleet: three agents from a directory only move verified transfers by name, and "
          "their metrics and timelines account for every byte and microsecond") {
  NEEDS_ETCD();
  const auto began = std::chrono::steady_clock::now();
  Etcd etcd(1);
  Fleet fleet(etcd.url());

  // Each agent sees the whole fleet in the directory, and finds its peer by name only.
  for (const auto& [name, agent] : fleet.agents()) {
    INFO(name);
    REQUIRE(WaitFor([&] { return Require(agent->client->Agents(), "ListAgents").agents_size() == 3; },
                    10000));
  }
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"alpha", "beta"}, {"beta", "gamma"}, {"gamma", "alpha"}};
  for (const auto& [from, to] : pairs) {
    auto peer = Require(fleet[from].client->Connect("agent:" + to), from + " connecting agent:" + to);
    CHECK(peer.name() == to);
    // Resolved through the directory: the peer's own local door (same host).
    CHECK(peer.address() == fleet[to].process.address());
  }

  // alpha -> beta: WRITEs over shm-direct; beta -> gamma: WRITEs over UCX (beta runs
  // --shm-direct off); gamma <- alpha: READs over shm-direct. 1 to 3 pages each.
  std::vector<Moved> run;
  for (int i = 0; i < 4; ++i) {
    const uint64_t p = static_cast<uint64_t>(i) * 4;
    std::vector<uint64_t> pages(1 + i % 3);
    for (size_t k = 0; k < pages.size(); ++k) pages[k] = p + k;
    run.push_back(fleet.Move("ab-" + std::to_string(i), "alpha", "beta", v1::WRITE, "shm-direct",
                             pages));
    run.push_back(fleet.Move("bg-" + std::to_string(i), "beta", "gamma", v1::WRITE, "ucx", pages));
    run.push_back(fleet.Move("ga-" + std::to_string(i), "gamma", "alpha", v1::READ, "shm-direct",
                             pages));
  }
  for (const Moved& m : run) CheckTimelines(m);

  for (const auto& [name, agent] : fleet.agents()) {
    const std::string body = Scrape(MetricsAddress(*agent->client));
    CheckMetrics(name, body, run);
    // The peer it connected to by name is up.
    for (const auto& [from, to] : pairs) {
      if (from == name) {
        CHECK(Value(body, "kvagent_peer_up", {Label("peer", to), "state=\"connected\""}) == 1);
      }
    }
  }

  // Where one transfer's time went, as an operator would print it.
  const Moved& sample = run[1];
  std::printf("%s (%s -> %s, %lu bytes): client %ld us, agent %lu us:",
              sample.id.c_str(), sample.from.c_str(), sample.to.c_str(),
              static_cast<unsigned long>(sample.bytes), static_cast<long>(sample.client_us),
              static_cast<unsigned long>(sample.sent.latency_us()));
  for (const auto& e : sample.sent.timeline()) {
    std::printf(" %s@%lu", v1::TransferStage_Name(e.stage()).c_str() + 6,
                static_cast<unsigned long>(e.at_us()));
  }
  std::printf("\nfleet test took %.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count());
}

}  // namespace
}  // namespace kvagent::testing
