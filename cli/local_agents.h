// What `kvagentctl demo` and `kvagentctl bench` share: starting two kvagentd
// processes here (in a work folder under $TEST_TMPDIR or /tmp), showing their logs
// when a run fails, percentiles and a terminal progress bar.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cli/daemon_process.h"

namespace kvagent::cli {

struct LocalAgentsOptions {
  std::string argv0;                    // to find kvagentd next to kvagentctl
  std::string kvagentd;                 // empty: FindKvagentd(argv0)
  std::string label;                    // work folder "<label>.<pid>" / "kvagent-<label>.XXXXXX"
  std::string first_name, second_name;  // agent names
  std::vector<std::string> extra_args;  // for both agents
  std::vector<std::string> first_args;  // for the first only, after extra_args
  std::vector<int> cpus;                // both agents' CPUs (DaemonOptions::cpus)
};

struct LocalAgents {
  std::string work_dir;
  std::optional<DaemonProcess> first, second;
  std::vector<std::string> log_paths;

  bool started() const { return first.has_value(); }
  // SIGTERM to both, then removes the work folder (its logs with it).
  void StopAndClean();
};

// Starts both agents; on failure, the agents started so far are in `agents` (their
// logs too) and the status says which step failed.
absl::Status StartLocalAgents(const LocalAgentsOptions& options, LocalAgents* agents);

// The last `tail_bytes` of each log on stderr, for a run that failed.
void PrintAgentLogs(const std::vector<std::string>& paths, size_t tail_bytes = 4000);

double Percentile(std::vector<double> values, double p);
// A steady-clock span in microseconds and in seconds, as the measurements report them.
inline double Micros(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}
inline double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// "[####      ] done/total what" on stderr when it is a terminal; nothing otherwise.
void Progress(size_t done, size_t total, const std::string& what);

// A loopback TCP port the kernel just handed out (bound and closed), for a server
// that must be told its port before it starts (ucx_perftest, etcd).
absl::StatusOr<int> FreePort();

}  // namespace kvagent::cli
