// One cell of `kvagentctl bench`'s grid (op x pattern x block x batch) through the
// gRPC API: latency one at a time and throughput with 4 in flight, the target client's
// notification latency (WRITE), the last transfer's bytes checked, the same cell
// through the fast path ring, and the memcpy and ucx_perftest baselines of the same
// pages; and issue 14's ratios in paired rounds (CellBench::Pair).
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

// A ratio of two medians of paired rounds, with the interquartile range of the
// rounds' own ratios (how far load moved it).
struct PairedRatio {
  double of_medians = 0, q1 = 0, q3 = 0;
};

// Where a paired transfer's time went: medians over the rounds whose initiator
// timeline was read (`timelines` of them, 0: none). In the agent, accepted to ended; of
// that, before the copy (accepted to the first batch posted: planning, the ledger,
// the posting of the operations), the copy (first batch posted to data flushed) and
// the wait for the receiver (notification sent to acknowledged); the rest of the
// client's time (`ring`) lies between the client and the agent: the ring's pick-up of
// the entry and its completion, with the thread wake-ups between them.
struct TimeSplit {
  uint64_t timelines = 0;
  double agent_p50_us = 0, before_copy_p50_us = 0, copy_p50_us = 0, receiver_p50_us = 0,
         ring_p50_us = 0;
};

// Issue 14's two ratios for one op x block x batch, measured in paired rounds: the
// sweep's columns are each timed in their own window, and on a shared machine load
// moves one window 2-10x against another, so their ratios swing as much. Each round
// times, one after another and each from a cold cache as the memcpy column's copies
// (64 MiB written first, untimed): (a) one thread's memcpy of one contiguous
// transfer's pages, (b) that transfer through the fast path ring, (c) the scattered
// transfer of the same shape (b and c in turn first); before (b) and (c) an untimed
// ring ping wakes the agent, asleep after the pause. Load then hits all three alike.
// Each round also times (d): (b)'s transfer completing when placed
// (COMPLETE_WHEN_PLACED: the sender's COMPLETED does not wait for the receiver's
// acknowledgement), unless the transfer completes when acknowledged anyway (a data
// path that confirms placement only by the peer, ucx-am or staging, or an agent older
// than complete_when); (b), (c) and (d)
// take turns going first. After (a), each round also times (e): the same memcpy of
// (c)'s scattered pieces, so that (c) against (b) can be read beside what scattering the
// same pieces costs the bench's own copy in the same rounds (shown, not judged: on a
// host where memory idle for seconds is slow to touch, which process touched the pages
// last, and when, moves both; docs/BENCHMARKS.md, "Scattered pieces, again").
struct PairedCell {
  Cell cell;  // its op, block and batch (pattern: both)
  uint64_t rounds = 0;
  double memcpy_p50_us = 0, contiguous_p50_us = 0, scattered_p50_us = 0;
  // As speeds (the reference's time over the measured one's): > 1 means the first
  // named is the faster.
  PairedRatio fast_over_memcpy;           // (b) against (a): the `fx_mc` of the pair
  PairedRatio scattered_over_contiguous;  // (c) against (b)
  // (e): its p50, and against (a): the memcpy's own scattered/contiguous.
  double memcpy_scattered_p50_us = 0;
  PairedRatio memcpy_scattered_over_contiguous;
  // (d): rounds (0: not measured, the agent completed it when acknowledged), p50, and
  // against (a).
  uint64_t placed_rounds = 0;
  double placed_p50_us = 0;
  PairedRatio placed_over_memcpy;
  // Where (b)'s and (c)'s time went, from the initiator's timelines (read after the
  // rounds).
  TimeSplit contiguous_split, scattered_split;
};

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
  std::optional<PairedCell> paired;  // this op x block x batch's paired rounds, if run
};

class CellBench {
 public:
  CellBench(const BenchOptions& options, AgentClient& initiator, std::string target_address,
            std::string peer, Pools& pools, Perftest& perftest, FastRing* fast);
  ~CellBench();
  CellBench(const CellBench&) = delete;
  CellBench& operator=(const CellBench&) = delete;

  absl::StatusOr<CellResult> Run(const Layout& layout, const Cell& cell);
  // The paired rounds of `cell`'s op, block and batch (its pattern is ignored);
  // nullopt without a fast path ring.
  absl::StatusOr<std::optional<PairedCell>> Pair(const Layout& layout, const Cell& cell);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvagent::cli
