// The lines `kvagentctl bench` prints for one grid cell: a table row under
// TableHeader(), or one JSON object (--json); ratios to the ucx_perftest and memcpy
// baselines of the same run, and the fast path's columns.
#pragma once

#include <string>

#include "cli/bench_sweep.h"

namespace kvagent::cli {

std::string TableHeader();
std::string TableLine(const CellResult& r);
std::string JsonLine(const CellResult& r);

}  // namespace kvagent::cli
