// One cell of `kvagentctl bench`'s grid (op x pattern x block x batch) through the
// gRPC API: latency one at a time and throughput with 4 in flight, the target client's
// notification latency (WRITE), the last transfer's bytes checked, the same cell
// through the fast path ring, and the memcpy and ucx_perftest baselines of the same
// pages.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "cli/agent_client.h"
#include "cli/bench_fast.h"
#include "cli/bench_layout.h"
#include "cli/bench_options.h"
#include "cli/bench_perftest.h"

namespace kvagent::cli {

struct CellResult {
  Cell cell;
  uint64_t transfers = 0;
  double gbps = 0, transfers_per_s = 0, avg_us = 0, p50_us = 0, p99_us = 0;
  std::optional<double> notify_p50_us, notify_p99_us;
  uint64_t notifications_missing = 0;
  std::optional<double> perftest_gbps, memcpy_gbps;
  double gbps_inflight = 0;  // with 4 transfers in flight at once
  uint64_t runs = 0;  // UCX/memcpy operations per transfer after coalescing
  std::string data_path;  // the initiator's path to the target when the cell ran
  bool verified = false;
  std::optional<FastCell> fast;  // the same cell through the fast path ring
};

class CellBench {
 public:
  CellBench(const BenchOptions& options, AgentClient& initiator, std::string target_address,
            std::string peer, Pools& pools, Perftest& perftest, FastRing* fast);
  ~CellBench();
  CellBench(const CellBench&) = delete;
  CellBench& operator=(const CellBench&) = delete;

  absl::StatusOr<CellResult> Run(const Layout& layout, const Cell& cell);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvagent::cli
