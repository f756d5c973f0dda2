// How much CPU a process, or each of its threads, has spent: utime + stime from
// /proc/<pid>/stat and /proc/<pid>/task/<tid>/stat; and how often its threads slept
// and were woken (/proc/<pid>/task/<tid>/status). Used with DaemonProcess's pid by
// the fast path phase of `kvagentctl bench` (per thread) and `bench-peers` (whole
// process); ProcessMemory (process_memory.h) is the memory side.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"

namespace kvagent::cli {

// A process's or thread's name, state and utime + stime in clock ticks.
struct CpuTicks {
  std::string name;
  char state = '?';  // field 3: R running, S sleeping, D disk wait, T/t stopped, ...
  uint64_t ticks = 0;
};

// One stat file ("PID (NAME) STATE ...": utime is field 14, stime 15, counted after
// the parenthesized name, which may hold spaces). NOT_FOUND when it is unreadable
// (the process is gone).
absl::StatusOr<CpuTicks> ReadCpuTicks(const std::string& stat_path);

// Every thread of `pid`: tid -> its name and ticks (threads that ended are missing;
// empty when the process is gone).
std::map<std::string, CpuTicks> ThreadCpuTicks(pid_t pid);

// Each thread's voluntary context switches (/proc/PID/task/TID/status): the times it
// slept and was woken. By thread name, threads of one name summed; empty when the
// process is gone. The benches and tests count an agent's wake-ups per transfer so.
std::map<std::string, uint64_t> ThreadWakeups(pid_t pid);

// The whole process's utime + stime in seconds.
absl::StatusOr<double> ProcessCpuSeconds(pid_t pid);

// The calling thread's CPU time so far, user and system (CLOCK_THREAD_CPUTIME_ID), in
// seconds; 0 when the clock cannot be read. The bench's own threads (its clients, its
// notification taker) measure themselves so.
double ThreadCpuSeconds();

}  // namespace kvagent::cli
