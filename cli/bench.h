// `kvagentctl bench`: moves blocks between two kvagentd through the real gRPC API,
// sweeping block size x batch x op x pattern, beside ucx_perftest and a plain memcpy
// of the same pages measured in the same run. docs/BENCHMARKS.md shows its output.
// RunBench runs the phases in order: the grid (bench_sweep), the gRPC rate
// (bench_rate), the fast path (bench_fast), the agents' memory (bench_memory); the
// grid's lines come from bench_report.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "cli/bench_options.h"

namespace kvagent::cli {


// Parses --cells: BLOCK:BATCH pairs, comma-separated, BLOCK as 4K, 64K, 1M or 4M (or
// bytes). INVALID_ARGUMENT naming the bad entry.
absl::StatusOr<std::vector<std::pair<uint64_t, uint32_t>>> ParseCells(std::string_view text);

// Returns the process exit code: 0 when every cell ran and its last transfer's bytes
// checked out.
int RunBench(const BenchOptions& options);

}  // namespace kvagent::cli
