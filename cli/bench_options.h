// `kvagentctl bench`'s options (its command line), shared by the bench's phases.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kvagent::cli {

struct BenchOptions {
  std::string argv0;
  std::string kvagentd;           // empty: FindKvagentd
  std::string initiator_address;  // both empty: start two agents here
  std::string target_address;
  bool quick = false;             // fewer sizes, batches and transfers (under a minute)
  // --fast-only: the fast path phase alone (no grid, gRPC rate or memory phase), its
  // quick sizes: a short A/B of the fast path's figures.
  bool fast_only = false;
  // Regions per agent in the memory phase (--memory-regions): 1,000 by default; past
  // 1,000 each region holds one 4 KiB item (100,000 regions: 400 MiB of pool per agent)
  // and the phase runs a tenth of the transfers.
  uint32_t memory_regions = 1000;
  bool json = false;              // one JSON object per cell per line instead of a table
  // How long the fast path rings' Reap polls before sleeping on the doorbell
  // (--fast-spin-us; 0: the client library's default, 20 us).
  uint32_t fast_spin_us = 0;
  // How many completions the rate phase's clients (and its notification taker) wait for
  // per wake-up (--fast-reap-batch; 1: wake for each, as before kFeatureWakeCount).
  uint32_t fast_reap_batch = 16;
  uint64_t pool_mib = 1024;       // per agent; every block size reuses the whole pool
  bool shm_direct = true;         // agents started here copy same-host data directly
  uint32_t timeout_ms = 60000;    // per transfer
  std::string perftest = "ucx_perftest";  // empty: skip the UCX baseline
  uint64_t seed = 42;
  // "dram" (shared memory) or "vram": each pool is device memory this process
  // allocates (playing the engine) on CUDA device `device` and registers with the
  // agents by IPC handle; the memcpy column is then a device-to-device cuMemcpy of the
  // same pages. Without a CUDA driver or device the run fails before starting agents.
  std::string memory = "dram";
  int device = 0;
  // --cells 64K:16,1M:16: only these block x batch cells of the grid, and none of the
  // later phases (a short targeted run).
  std::vector<std::pair<uint64_t, uint32_t>> cells;
  // --copy-lanes N for agents started here (0: their default); printed either way.
  uint32_t copy_lanes = 0;
  // --worker-cpus LIST for agents started here: the CPUs of their UCX progress threads
  // ("" : the kernel places them).
  std::string worker_cpus;
  // --agent-cpus LIST for agents started here: the CPUs every thread of theirs may run
  // on (as `taskset -c LIST kvagentd`); empty: this process's.
  std::vector<int> agent_cpus;
};

}  // namespace kvagent::cli
