// The lines `kvagentctl bench` prints for one grid cell: a table row under
// TableHeader(), or one JSON object (--json); ratios to the ucx_perftest and memcpy
// baselines of the same run, and the fast path's columns; the paired rounds' line and
// issue 14's targets block that ends the sweep.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "cli/bench_sweep.h"

namespace kvagent::cli {

std::string TableHeader();
std::string TableLine(const CellResult& r);
std::string JsonLine(const CellResult& r);

// Issue 14's targets, judged on paired rounds (PairedCell): the fast path at least the
// cold memcpy of the same pages from 64 KiB x 16 up, scattered at least 0.90x
// contiguous from 64 KiB x 64 up (the issue: "within 10 %"; faster is not a miss); and
// the first again for the transfer completing when placed, on the cells that measured
// it (key fast_placed_over_memcpy).
bool FastOverMemcpyTarget(uint64_t block, uint32_t batch);
bool ScatteredTarget(uint64_t block, uint32_t batch);
// The sweep runs paired rounds for the cells of either target.
inline bool PairedCellWanted(uint64_t block, uint32_t batch) {
  return FastOverMemcpyTarget(block, batch) || ScatteredTarget(block, batch);
}
// The table's line under an op x block x batch's two rows.
std::string PairedLine(const PairedCell& p);
// The block (table) or its JSON lines, one per target and cell and one summary per
// target; with the 1-minute load average at the sweep's start and now.
std::string TargetsBlock(const std::vector<PairedCell>& pairs, bool json,
                         std::optional<double> load_start, std::optional<double> load_now);

}  // namespace kvagent::cli
