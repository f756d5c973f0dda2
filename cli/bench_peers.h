// `kvagentctl bench-peers`: what connected peers cost one agent (issue 17 part 6).
// Starts a hub agent and two real peers here, measures the hub's CPU idle (no peers)
// and with N lightweight fake peers watching it (one process: N local-door sessions
// with distinct peer names, N gRPC connections, each a WatchMetadata stream with
// slow HTTP/2 keepalive and a signed liveness ping to the hub's door every 600 ms,
// spread over the period; or, with --metadata-push off, a GetMetadata poll every
// 200 ms as a polling agent sends), how long one change takes to reach all N, and how long
// the hub takes to see a real peer killed (SIGKILL) and hung (SIGSTOP).
// docs/BENCHMARKS.md ("Peers at scale") shows its output.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvagent::cli {

struct BenchPeersOptions {
  std::string argv0;
  std::string kvagentd;  // empty: next to kvagentctl
  uint32_t peers = 1000;
  double window_s = 10;  // the CPU reading with peers
  double idle_s = 30;    // the idle one (a 10 ms tick is 0.03 % of 30 s)
  // "on", "off" or both (push first, then the polling baseline, in one run).
  std::vector<std::string> modes = {"on", "off"};
  uint32_t poll_ms = 200;  // the polling baseline's period (a polling agent's default)
};

int RunBenchPeers(const BenchPeersOptions& options);

}  // namespace kvagent::cli
