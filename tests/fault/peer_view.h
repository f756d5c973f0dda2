// What the fault tests of peer liveness share: a pair whose metadata polls are a minute
// apart (so that only streams and liveness doors can see a peer go), one agent's view
// of a peer, and the time until that view reaches a state.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "cli/agent_client.h"
#include "cli/daemon_process.h"
#include "tests/integration/agent_pair.h"

namespace kvagent::testing {

inline AgentPairOptions LongPolls() {
  AgentPairOptions options;
  options.extra_args = {"--peer-refresh-ms", "60000"};
  return options;
}

// `agent`'s view of `peer` (fails the test when `agent` lists no such peer).
inline v1::PeerInfo PeerView(cli::AgentClient& agent, const std::string& peer) {
  auto peers = agent.Peers();
  REQUIRE(peers.ok());
  for (const auto& p : peers->peers()) {
    if (p.name() == peer) return p;
  }
  FAIL("peer " << peer << " not listed");
  return {};
}

// Milliseconds until `done(view of peer)` holds, or -1 after `limit_ms`.
inline int64_t MillisUntil(cli::AgentClient& agent, const std::string& peer, int64_t limit_ms,
                           const std::function<bool(const v1::PeerInfo&)>& done) {
  const auto start = std::chrono::steady_clock::now();
  while (MillisSince(start) < limit_ms) {
    if (done(PeerView(agent, peer))) return MillisSince(start);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return -1;
}

// A third agent, "oldpeer", started with `args` beside `pair` (an older kind of peer)
// and connected from prefill.
inline cli::DaemonProcess StartOldPeer(AgentPair& pair, std::vector<std::string> args) {
  cli::DaemonOptions d;
  d.binary = *cli::FindKvagentd("");
  d.name = "oldpeer";
  d.work_dir = pair.work_dir();
  d.extra_args = std::move(args);
  auto old = cli::DaemonProcess::Start(d);
  REQUIRE(old.ok());
  REQUIRE(pair.prefill().Connect(old->address()).ok());
  return *std::move(old);
}

// Decode's liveness door has answered prefill's pings twice since this was called, so
// prefill's prober has had an answer (a door that never answered proves nothing, and
// its peer is judged by slow polls instead): call it before hanging decode.
inline void RequireDoorAnswering(AgentPair& pair) {
  auto answered = [&] {
    auto status = pair.decode().Status();
    REQUIRE(status.ok());
    return status->liveness_answered();
  };
  const uint64_t before = answered();
  const auto start = std::chrono::steady_clock::now();
  while (answered() < before + 2 && MillisSince(start) < 20000) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  REQUIRE(answered() >= before + 2);
}

// Hangs decode (SIGSTOP, every thread stopped) and returns the milliseconds until
// prefill lists it unreachable, printed after `label` and checked against the 2 s bound.
inline int64_t HangDecode(AgentPair& pair, const char* label) {
  REQUIRE(SuspendAgent(pair.decode_process().pid()) == "");
  const int64_t ms = MillisUntil(pair.prefill(), "decode", 5000, [](const v1::PeerInfo& p) {
    return p.state() == "unreachable";
  });
  std::printf("%s: SIGSTOP seen after %lld ms\n", label, static_cast<long long>(ms));
  CHECK(ms >= 0);
  CHECK(ms <= 2000);
  return ms;
}

}  // namespace kvagent::testing
