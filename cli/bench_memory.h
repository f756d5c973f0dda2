// The memory check of issue 6: an agent's memory beyond its registered pools, with
// 1,000 regions registered and 100,000 transfers completed, must stay under 64 MiB.
// RunMemoryBench drives two running agents through that load and reads their
// memory (/proc, so both must run on this host). Called by `kvagentctl bench` and
// by tests/integration/bench_memory_test.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "cli/agent_client.h"
#include "cli/process_memory.h"

namespace kvagent::cli {

struct MemoryBenchOptions {
  // Registered on each agent, from one AllocateSharedMemory object per agent, in
  // groups of `regions_per_group` (a group is what one item index addresses: think
  // of 10 layers' K and V). `regions` must be a multiple of `regions_per_group`.
  uint32_t regions = 1000;
  uint32_t regions_per_group = 10;
  uint64_t items_per_region = 16;
  uint64_t item_bytes = 4096;
  // One-item WRITEs (each moving one item of every region of a group), each with a
  // notification; submitted by `threads` threads, each waiting for its transfer.
  uint64_t transfers = 100000;
  uint32_t threads = 4;
  // The target of issue 6, per agent; 0: none (the 100,000-region scale line).
  uint64_t limit_bytes = 64ull << 20;
  // Called now and then with the transfers completed so far (e.g. cli::Progress), from
  // one submitting thread, never two calls at once; may be empty.
  std::function<void(uint64_t done, uint64_t total)> progress;
};

// Both agents read at one moment.
struct MemorySample {
  ProcessMemory initiator;
  ProcessMemory target;
};

struct MemoryBenchResult {
  MemorySample before_regions;   // connected, nothing of ours registered
  MemorySample after_regions;    // both agents hold `regions` regions
  MemorySample after_transfers;  // `transfers` completed and their notifications taken
  uint32_t regions = 0;          // per agent
  uint64_t pool_bytes = 0;       // per agent: the shared memory the regions cover
  uint64_t transfers = 0;
  uint64_t notifications = 0;    // DATA_READY the target received for them
  double seconds = 0;            // the transfers' wall time
  double transfers_per_second = 0;
  uint64_t limit_bytes = 0;
  // after_transfers: beyond_pools() < limit_bytes for both agents.
  bool meets_target = false;
};

// `initiator` must already be connected to `target` under `peer_name`. Registers,
// transfers, reads memory, and deregisters what it registered before returning (the
// shared-memory objects stay with the agents, which unlink them when they exit). The
// target's notifications are taken by PollNotifications while it runs, every one,
// so run it where no other client waits for notifications on that agent. Fails on
// the first transfer that does not complete, naming it.
absl::StatusOr<MemoryBenchResult> RunMemoryBench(const MemoryBenchOptions& options,
                                                 AgentClient& initiator, AgentClient& target,
                                                 const std::string& peer_name, pid_t initiator_pid,
                                                 pid_t target_pid);

// A few lines for a terminal: each agent's figures at the three moments and the verdict.
std::string FormatMemoryBench(const MemoryBenchResult& result);
// One JSON object (one line) with the same figures, in bytes.
std::string MemoryBenchJson(const MemoryBenchResult& result);

}  // namespace kvagent::cli
