// ucx_perftest as `kvagentctl bench`'s UCX baseline: UCX's own put/get bandwidth
// between two processes on loopback at a given size, measured once per (test, size)
// and cached; its "Final:" line parsed.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace kvagent::cli {

// The "Final:" line's overall bandwidth: the columns are iterations, overhead
// p50/average/overall (us), bandwidth average/overall (MB/s, where UCX's MB is
// 2^20 bytes), message rate average/overall.
absl::StatusOr<double> ParsePerftestGbps(const std::string& output);

class Perftest {
 public:
  Perftest(std::string binary, bool quick) : binary_(std::move(binary)), quick_(quick) {}
  bool available() const { return !binary_.empty(); }

  // GB/s of `test` (ucp_put_bw or ucp_get) at `size`, cached per (test, size);
  // nullopt (with one line on stderr) when it could not be measured.
  std::optional<double> Gbps(const std::string& test, uint64_t size);

 private:
  absl::StatusOr<double> Measure(const std::string& test, uint64_t size);

  std::string binary_;
  bool quick_;
  std::map<std::pair<std::string, uint64_t>, std::optional<double>> cache_;
};

}  // namespace kvagent::cli
