// CPU lists as the kernel writes them ("3", "2,3", "4-7,12"), and the CPUs a process
// or thread may run on: parsed for --worker-cpus and the bench's --agent-cpus, checked
// against the CPUs this process may use, applied to a thread, and written back for logs,
// GetStatus and the bench. Used by agent/ (flags, main, agent, doctor, copy lanes),
// transport/ucx_worker and cli/ (the bench, child processes).
#pragma once

#include <pthread.h>
#include <sys/types.h>

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvagent {

// Numbers and ranges separated by commas; "" is the empty list. Sorted, each CPU once.
// INVALID_ARGUMENT naming the item that is not a number or range, a range that runs
// backwards, or a CPU past CPU_SETSIZE, and what to give instead.
absl::StatusOr<std::vector<int>> ParseCpuList(std::string_view text);
// `cpus` (sorted) as the kernel writes a list ("0-3,6"); "" for none.
std::string FormatCpuList(const std::vector<int>& cpus);
// The CPUs this process may run on (sched_getaffinity: taskset, the cgroup's cpuset);
// empty when they cannot be read.
std::vector<int> AllowedCpus();
// The CPUs process `pid`'s main thread may run on (sched_getaffinity); empty when they
// cannot be read (no such process, or not ours to look at).
std::vector<int> ProcessCpus(pid_t pid);
// The CPUs `thread` may run on now (pthread_getaffinity_np); empty when they cannot be
// read.
std::vector<int> ThreadCpus(pthread_t thread);
// Keeps `thread` on `cpus` (pthread_setaffinity_np; CPUs outside 0..CPU_SETSIZE-1 are
// left out): 0, or the error number the kernel gave.
int PinThread(pthread_t thread, const std::vector<int>& cpus);
// OK when every CPU of `cpus` is one this process may run on; else INVALID_ARGUMENT
// naming `flag`, the CPUs that are not, the ones that are, and the fix.
absl::Status CheckCpusAllowed(const std::vector<int>& cpus, std::string_view flag);

}  // namespace kvagent
