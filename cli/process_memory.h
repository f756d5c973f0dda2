// ProcessMemory reads how much memory a process holds, from /proc/<pid>/status and
// /proc/<pid>/smaps_rollup, split so that an agent's shared-memory pools (RssShmem)
// are told apart from its own memory. Used by the memory benchmark (bench_memory)
// and the soak test, which check that an agent's own memory stays flat.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace kvagent::cli {

struct ProcessMemory {
  pid_t pid = 0;
  // From /proc/<pid>/status, in bytes (the kernel reports kB).
  uint64_t vm_rss = 0;     // resident: anon + file + shmem
  uint64_t rss_anon = 0;   // heap, stacks, private mappings
  uint64_t rss_file = 0;   // the binary and its libraries
  uint64_t rss_shmem = 0;  // shared memory: the registered pools live here
  uint64_t vm_hwm = 0;     // peak resident (all three kinds)
  // From /proc/<pid>/smaps_rollup, in bytes: proportional shares, so memory that two
  // processes map (a pool, libc) counts half to each. Zero when the kernel has no
  // smaps_rollup (before 4.14); `has_rollup` says which.
  bool has_rollup = false;
  uint64_t pss = 0;
  uint64_t pss_anon = 0;
  uint64_t pss_file = 0;
  uint64_t pss_shmem = 0;

  // What the agent costs on top of the memory it was given to move: everything
  // resident except shared memory. Pool pages are shmem (POSIX shm / tmpfs /
  // hugetlbfs), so registering a 1 GiB pool does not move this figure; a leak does.
  uint64_t beyond_pools() const { return rss_anon + rss_file; }
};

// Reads both files. NOT_FOUND naming the pid and the file when the process is gone;
// PERMISSION_DENIED when /proc hides it (another user, hidepid, ptrace rules);
// INTERNAL when the status file lacks a field (a kernel without RssAnon, before 4.5).
absl::StatusOr<ProcessMemory> ReadProcessMemory(pid_t pid);

// Parses the text of /proc/<pid>/status and smaps_rollup (empty: no rollup).
// `pid` only names the process in errors. Split out so a test can feed it text.
absl::StatusOr<ProcessMemory> ParseProcessMemory(pid_t pid, const std::string& status_text,
                                                 const std::string& rollup_text);

// "12.3 MiB" for figures in reports.
std::string FormatMiB(uint64_t bytes);
// "+1.2 MiB" / "-0.4 MiB" for a change between two readings.
std::string FormatDeltaMiB(uint64_t before, uint64_t after);

}  // namespace kvagent::cli
