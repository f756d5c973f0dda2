// CPU lists as the kernel writes them ("3", "2,3", "4-7,12"): parsed for --worker-cpus,
// checked against the CPUs this process may use, and written back for logs and
// GetStatus. Used by agent/flags, agent/main and agent/agent.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvagent::agent {

// Numbers and ranges separated by commas; "" is the empty list. Sorted, each CPU once.
// INVALID_ARGUMENT naming the item that is not a number or range, a range that runs
// backwards, or a CPU past CPU_SETSIZE, and what to give instead.
absl::StatusOr<std::vector<int>> ParseCpuList(std::string_view text);
// `cpus` (sorted) as the kernel writes a list ("0-3,6"); "" for none.
std::string FormatCpuList(const std::vector<int>& cpus);
// The CPUs this process may run on (sched_getaffinity: taskset, the cgroup's cpuset).
std::vector<int> AllowedCpus();
// OK when every CPU of `cpus` is one this process may run on; else INVALID_ARGUMENT
// naming `flag`, the CPUs that are not, the ones that are, and the fix.
absl::Status CheckCpusAllowed(const std::vector<int>& cpus, std::string_view flag);

}  // namespace kvagent::agent
