// Issue 14's targets block (cli/bench_report): which cells each target judges, the
// verdict at its threshold, and the JSON lines the smoke test and bench_ab read.
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "cli/bench_report.h"
#include "tests/unit/text_count.h"

namespace kvagent::cli {
namespace {

using kvagent::testing::Occurrences;

PairedCell Pair(v1::TransferOp op, uint64_t block, uint32_t batch, double fast, double scattered) {
  PairedCell p;
  p.cell = Cell{op, false, block, batch};
  p.rounds = 9;
  p.fast_over_memcpy = {fast, fast * 0.9, fast * 1.1};
  p.scattered_over_contiguous = {scattered, scattered * 0.9, scattered * 1.1};
  p.memcpy_scattered_p50_us = 140;
  p.memcpy_scattered_over_contiguous = {0.7, 0.63, 0.77};
  return p;
}

// The same with its placed rounds (7 of them) at `placed`.
PairedCell WithPlaced(PairedCell p, double placed) {
  p.placed_rounds = 7;
  p.placed_p50_us = 100;
  p.placed_over_memcpy = {placed, placed * 0.9, placed * 1.1};
  return p;
}

TEST_CASE("targets block: each target judges its own cells at its threshold") {
  const std::vector<PairedCell> pairs = {
      // fast target only: met at exactly 1.0; placed met
      WithPlaced(Pair(v1::WRITE, 64 << 10, 16, 1.0, 0.5), 1.2),
      // fast not met; scattered met at 0.90; placed not met
      WithPlaced(Pair(v1::READ, 64 << 10, 64, 0.999, 0.9), 0.5),
      Pair(v1::WRITE, 1 << 20, 256, 2.0, 0.899),   // fast met; scattered not met; no placed
  };
  const std::string table = TargetsBlock(pairs, false, 1.5, 2.25);
  INFO(table);
  CHECK(table.find("load average 1.50 at the sweep's start, 2.25 now") != std::string::npos);
  CHECK(table.find("from 64K x 16 up (>= 1.00): met in 2 of 3 cells") != std::string::npos);
  CHECK(table.find("from 64K x 64 up (>= 0.90): met in 1 of 2 cells") != std::string::npos);
  CHECK(table.find("READ 64K x 64    1.00 [0.90-1.10], 9 rounds: NOT met") != std::string::npos);
  CHECK(table.find("placed (COMPLETE_WHEN_PLACED), from 64K x 16 up (>= 1.00): met in 1 of 2 "
                   "cells") != std::string::npos);
  CHECK(table.find("READ 64K x 64    0.50 [0.45-0.55], 7 rounds: NOT met") != std::string::npos);
  CHECK(Occurrences(table, "NOT met") == 3);
  // The scattered target's lines, and only they, show the memcpy's own ratio beside.
  CHECK(table.find("WRITE 1M x 256   0.90 [0.81-0.99], 9 rounds: NOT met (memcpy of the same "
                   "pieces 0.70 [0.63-0.77])") != std::string::npos);
  CHECK(Occurrences(table, "(memcpy of the same pieces") == 2);

  const std::string json = TargetsBlock(pairs, true, 1.5, std::nullopt);
  INFO(json);
  CHECK(Occurrences(json, "{\"kind\": \"target\", \"issue\": 14, \"target\": \"fast_over_memcpy\"") == 3);
  CHECK(Occurrences(json, "{\"kind\": \"target\", \"issue\": 14, \"target\": \"scattered_over_contiguous\"") == 2);
  CHECK(json.find("\"target\": \"fast_over_memcpy\", \"threshold\": 1.00, \"cells\": 3, \"met\": 2, "
                  "\"loadavg_1m_start\": 1.50, \"loadavg_1m\": null}") != std::string::npos);
  CHECK(json.find("\"block_bytes\": 1048576, \"batch\": 256, \"rounds\": 9, \"ratio\": 0.899, "
                  "\"q1\": 0.809, \"q3\": 0.989, \"threshold\": 0.90, \"met\": false") !=
        std::string::npos);
  CHECK(Occurrences(json, "{\"kind\": \"target\", \"issue\": 14, \"target\": \"fast_placed_over_memcpy\"") == 2);
  CHECK(json.find("\"target\": \"fast_placed_over_memcpy\", \"threshold\": 1.00, \"cells\": 2, "
                  "\"met\": 1,") != std::string::npos);
  CHECK(Occurrences(json, "\"memcpy_ratio\": 0.700,") == 2);
  CHECK(Occurrences(json, "\"memcpy_ratio\": null,") == 5);
  CHECK(Occurrences(json, "\n") == 10);  // 7 cell lines, 3 summaries
}

TEST_CASE("targets block: a run without paired cells says so") {
  const std::string table = TargetsBlock({}, false, std::nullopt, std::nullopt);
  INFO(table);
  CHECK(Occurrences(table, "no paired cell in this run") == 3);
  CHECK(table.find("load average - at the sweep's start, - now") != std::string::npos);
  CHECK(Occurrences(TargetsBlock({}, true, std::nullopt, std::nullopt), "\"cells\": 0, \"met\": 0") == 3);
}

TEST_CASE("paired line: the placed rounds and where the contiguous transfer's time went") {
  PairedCell p = WithPlaced(Pair(v1::WRITE, 64 << 10, 16, 0.25, 0.9), 0.5);
  p.contiguous_split.timelines = 9;
  p.contiguous_split.agent_p50_us = 300, p.contiguous_split.before_copy_p50_us = 12;
  p.contiguous_split.copy_p50_us = 120, p.contiguous_split.receiver_p50_us = 150;
  p.contiguous_split.ring_p50_us = 200;
  p.scattered_split = p.contiguous_split;
  p.scattered_split.timelines = 8, p.scattered_split.before_copy_p50_us = 95;
  const std::string line = PairedLine(p);
  INFO(line);
  CHECK(line.find("completing when placed: fast/memcpy 0.50 [0.45-0.55] (p50 100 us)") !=
        std::string::npos);
  CHECK(line.find("scattered/contiguous 0.90 [0.81-0.99] (memcpy of the same pieces 0.70 "
                  "[0.63-0.77])") != std::string::npos);
  CHECK(line.find("contiguous, where its time went (p50 us, 9 timelines): in the agent 300 "
                  "(before the copy 12, the copy 120, the receiver's acknowledgement 150), "
                  "between client and agent 200") != std::string::npos);
  CHECK(line.find("scattered, where its time went (p50 us, 8 timelines): in the agent 300 "
                  "(before the copy 95,") != std::string::npos);
  CellResult cell;
  cell.cell = p.cell;
  cell.paired = p;
  const std::string json = JsonLine(cell);
  INFO(json);
  CHECK(json.find("\"paired_timelines\": 9, \"paired_agent_p50_us\": 300.0, "
                  "\"paired_before_copy_p50_us\": 12.0, \"paired_copy_p50_us\": 120.0") !=
        std::string::npos);
  CHECK(json.find("\"paired_scattered_timelines\": 8, \"paired_scattered_agent_p50_us\": "
                  "300.0, \"paired_scattered_before_copy_p50_us\": 95.0") != std::string::npos);
  CHECK(json.find("\"paired_memcpy_scattered_p50_us\": 140.0, "
                  "\"paired_memcpy_scattered_over_contiguous\": 0.700, "
                  "\"paired_memcpy_scattered_over_contiguous_q1\": 0.630, "
                  "\"paired_memcpy_scattered_over_contiguous_q3\": 0.770") != std::string::npos);
  // No timeline read: the figures are null, not zero.
  cell.paired = Pair(v1::WRITE, 64 << 10, 16, 0.25, 0.9);
  const std::string none = JsonLine(cell);
  CHECK(none.find("\"paired_scattered_timelines\": 0, \"paired_scattered_agent_p50_us\": null") !=
        std::string::npos);
  // Completed when acknowledged (a data path that confirms placement only by the
  // peer's acknowledgement, or an agent older than complete_when), timelines not read:
  // said so, nothing made up.
  const std::string old = PairedLine(Pair(v1::WRITE, 64 << 10, 16, 0.25, 0.9));
  INFO(old);
  CHECK(old.find("completing when placed: - (completed when acknowledged: the data path "
                 "confirms placement only by the peer's acknowledgement") != std::string::npos);
  CHECK(old.find("where its time went") == std::string::npos);
}

TEST_CASE("issue 14's cells: fast from 64K x 16 up, scattered from 64K x 64 up") {
  CHECK(FastOverMemcpyTarget(64 << 10, 16));
  CHECK_FALSE(FastOverMemcpyTarget(4 << 10, 256));
  CHECK_FALSE(FastOverMemcpyTarget(4 << 20, 1));
  CHECK(ScatteredTarget(64 << 10, 64));
  CHECK_FALSE(ScatteredTarget(64 << 10, 16));
  CHECK(PairedCellWanted(1 << 20, 16));
  CHECK_FALSE(PairedCellWanted(4 << 10, 64));
}

}  // namespace
}  // namespace kvagent::cli
