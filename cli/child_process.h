// Child processes of kvagentctl other than kvagentd (ucx_perftest's server and client):
// found on PATH, started with their output in a file or discarded, reaped with a
// deadline, or run to their exit with the output kept. kvagentd itself starts through
// DaemonProcess (cli/daemon_process.h), which uses SpawnChild too.
#pragma once

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvagent::cli {

// The binary as found on PATH (or as given, when it has a slash); empty when absent.
std::string FindOnPath(const std::string& binary);

// Starts `args` (args[0] a path) with stdout+stderr into `out_fd` (or /dev/null when
// -1), this process's environment with `env` added or replaced, and no signal blocked.
// With `cpus`, the child and every thread it starts may run only on those CPUs (as
// under `taskset -c`): the calling thread takes them for the spawn, which the child
// inherits, and gets its own back after. INVALID_ARGUMENT when one is not a CPU this
// process may use (CheckCpusAllowed's text).
absl::StatusOr<pid_t> SpawnChild(const std::vector<std::string>& args, int out_fd,
                                 const std::map<std::string, std::string>& env = {},
                                 const std::vector<int>& cpus = {});

// Waits for `pid` up to `timeout_ms`, then SIGKILLs it. Returns the wait status.
int ReapChild(pid_t pid, int timeout_ms);

// Stops `pid` with SIGSTOP and waits up to `timeout_ms` until every one of its threads
// is stopped (state T or t in /proc/PID/task/TID/stat). kill() returns once the signal
// is queued, before the kernel has stopped the threads: one still running for a moment
// can answer a peer, so a test or bench that acts on "the process is hung" waits here.
// An error names the threads still running (or why /proc could not be read); the
// process may then be partly stopped, and SIGCONT resumes it either way.
absl::Status SuspendChild(pid_t pid, int timeout_ms = 5000);

// Runs `args` once: its whole output, or an error when it failed or hung.
absl::StatusOr<std::string> RunChild(const std::vector<std::string>& args, int timeout_ms);

}  // namespace kvagent::cli
