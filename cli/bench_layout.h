// What `kvagentctl bench`'s phases share about the memory they move: both agents'
// pools (their shared memory mapped here, or VRAM this process allocated), a pool seen
// as items of one block size (Layout, with the item orders the scattered pattern
// walks), one grid cell's shape and the indices of its transfers, and registering a
// layout with an agent.
#pragma once

#include <sys/mman.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "cli/agent_client.h"
#include "cli/kv_pool.h"
#include "cuda/driver.h"
#include "proto/kvagent.pb.h"
#include "registry/shm_mapping.h"

namespace kvagent::cli {

// "4K", "1M", or bytes when not a whole number of either.
std::string SizeName(uint64_t bytes);

struct Cell {
  v1::TransferOp op = v1::WRITE;
  bool scattered = false;
  uint64_t block = 0;
  uint32_t batch = 0;
};

// What one block size's cells share: the pool viewed as items of `block` bytes, the
// region names, and the item orders the scattered pattern walks.
struct Layout {
  uint64_t block = 0;
  uint64_t items = 0;
  std::string group;
  std::string region;
  std::vector<uint64_t> local_order, remote_order;  // scattered: random permutations
};

// Indices of transfer `i`: contiguous runs of `batch` items at the same place on
// both sides, or `batch` consecutive entries of the two permutations.
void Indices(const Layout& layout, const Cell& cell, uint64_t i, std::vector<uint64_t>* local,
             std::vector<uint64_t>* remote);

// One items request over `layout`: `op` to `peer` with these local and remote indices
// (both in the layout's group) and the per-transfer timeout; no transfer id, wait or
// notification (each caller sets its own). The bench's cells, rate phase and warm-up
// all build their requests here.
v1::SubmitTransferRequest LayoutRequest(const Layout& layout, v1::TransferOp op,
                                        const std::string& peer, uint32_t timeout_ms,
                                        absl::Span<const uint64_t> local,
                                        absl::Span<const uint64_t> remote);

// Memory of both pools as this process sees it: the agents' shm objects mapped here
// when on this host, else private buffers (the memcpy baseline only; nothing verified).
struct Pools {
  // VRAM (--memory vram): device pools, owned by RunBench's VramMemory; the host
  // pointers stay null and every byte check goes through device copies.
  bool vram = false;
  const DeviceAllocation* initiator_device = nullptr;
  const DeviceAllocation* target_device = nullptr;
  uint64_t initiator_handle = 0, target_handle = 0;  // the sessions' memory handles
  registry::ShmMapping initiator_mapping, target_mapping;
  uint8_t* initiator = nullptr;
  uint8_t* target = nullptr;
  bool shared = false;  // the agents' own memory: results can be verified
  std::vector<void*> private_buffers;
  uint64_t bytes = 0;
  ~Pools() {
    for (void* p : private_buffers) munmap(p, bytes);
  }
};

// VRAM: one device pool per agent, with distinct contents (as MakePools), filled
// through a bounded host buffer.
struct VramMemory {
  DeviceAllocation initiator, target;
};

// Has each agent allocate a sealed memfd of `bytes` (over the local door) and maps
// both here.
absl::Status MakePools(AgentClient& initiator, AgentClient& target, uint64_t bytes,
                       const std::string& label, Pools* pools);
absl::Status MakeVramPools(cuda::CudaDriver* cuda, int device, uint64_t bytes,
                           const std::string& label, VramMemory* memory, Pools* pools);

// Writes the two pools' distinct contents through this process's mappings (DRAM pools
// shared with the agents; a no-op otherwise).
void FillPools(Pools* pools);

// What warming a layout's pages took (WarmMappings).
struct Warmup {
  uint64_t pages = 0;      // 4 KiB pages of one pool
  uint32_t transfers = 0;  // READs and WRITEs it took
  double seconds = 0;
};

// Moves every item of `layout` once each way (READs, then WRITEs; untimed, no
// notification) so each agent has touched every page of both pools through the
// mappings the timed transfers use, then refills the pools (FillPools). An agent maps
// a pool when its region is registered, but a page costs its first access through
// each mapping: 7-18 us per 4 KiB page here (a page-table fault, and on this VM type
// the hypervisor's), 35-90x a cached copy of it. A running engine's pool has been
// touched long before; a pool registered a moment ago has not, so without this the
// first cells of each block size would time page faults, not transfers.
absl::StatusOr<Warmup> WarmMappings(AgentClient& initiator, const std::string& peer,
                                    const Layout& layout, uint32_t timeout_ms, Pools* pools);

// The pool as items of `block` bytes, one region in group `group`, with the random
// item orders the scattered pattern walks.
Layout MakeLayout(uint64_t block, uint64_t pool_bytes, std::string group, std::mt19937_64& rng);
// Registers `layout`'s one KV region with `agent`: in the session's shared memory
// `memory_handle`, or (VRAM) in `pool` by its IPC handle.
absl::Status RegisterLayout(AgentClient& agent, uint64_t memory_handle, const Layout& layout);
absl::Status RegisterVramLayout(AgentClient& agent, const DeviceAllocation& pool,
                                const Layout& layout);

}  // namespace kvagent::cli
