// Engine-shaped memory pools on an agent. A Pool is one block of memory holding
// several groups of regions (KV pages, Mamba STATE slots, AUX bytes), all registered
// in one batch: a sealed memfd the agent allocated for this session and passed here
// as a descriptor, mapped into this process (DRAM), or one device allocation exported by a CUDA IPC handle, as an
// engine does, with a host image here (VRAM). KvPool is the one-group DRAM KV case
// (one region per layer per K/V, SGLang's layout). Used by the demo, the benchmark
// and the integration and GPU tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cli/agent_client.h"
#include "cuda/driver.h"
#include "proto/kvagent.pb.h"
#include "registry/shm_mapping.h"

namespace kvagent::cli {

// One group of a pool: one region per entry of `region_suffixes` (named
// "<label>.<suffix>", registered in this order, so that is the group order), each
// `items` items of `item_bytes`, packed.
struct PoolGroupShape {
  std::string group;
  v1::RegionKind kind = v1::KV;
  std::vector<std::string> region_suffixes;
  uint64_t items = 0;
  uint64_t item_bytes = 0;

  uint32_t regions() const { return static_cast<uint32_t>(region_suffixes.size()); }
  uint64_t region_bytes() const { return items * item_bytes; }
  uint64_t bytes() const { return regions() * region_bytes(); }
};

struct PoolGroup {
  PoolGroupShape shape;
  uint64_t offset = 0;  // of its first region in the shm object; 4 KiB aligned
  std::vector<std::string> region_names;
};

// Device memory this process allocated with cuMemAlloc (playing the engine), and its
// exported CUDA IPC handle. Move-only; frees on destruction, but owners that care
// about the order (after the agents let go of it) call Free themselves.
class DeviceAllocation {
 public:
  // MakeCurrent(device), cuMemAlloc(bytes), cuIpcGetMemHandle. `label` names the
  // pool in errors.
  static absl::StatusOr<DeviceAllocation> Allocate(cuda::CudaDriver* driver, int device,
                                                   uint64_t bytes, const std::string& label);
  DeviceAllocation() = default;
  DeviceAllocation(DeviceAllocation&& other) noexcept;
  DeviceAllocation& operator=(DeviceAllocation&& other) noexcept;
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;
  ~DeviceAllocation();

  absl::Status Free();  // no-op when empty
  uint64_t dptr() const { return dptr_; }
  int device() const { return device_; }
  const std::string& ipc_handle() const { return ipc_handle_; }
  cuda::CudaDriver* driver() const { return driver_; }

 private:
  cuda::CudaDriver* driver_ = nullptr;
  uint64_t dptr_ = 0;
  int device_ = 0;
  std::string ipc_handle_;
};

// Where CreatePool puts a pool.
struct PoolMemory {
  v1::MemoryKind kind = v1::DRAM;
  int device = 0;  // VRAM: CUDA device ordinal
};

struct Pool {
  v1::MemoryKind memory = v1::DRAM;
  uint64_t memory_handle = 0;    // DRAM: the session's handle of the memfd
  registry::ShmMapping mapping;  // DRAM: this process's view of the whole object
  DeviceAllocation device;       // VRAM: the pool itself
  // VRAM: this process's image of the device bytes; Upload/Download move it.
  std::unique_ptr<uint8_t[]> host_image;
  uint64_t size = 0;
  std::string memory_path;  // the agent's path for the first region: host, zero-copy, staged
  std::vector<PoolGroup> groups;
  std::vector<std::string> region_names;  // every region, in registration order

  // The bytes this process fills and checks: the shared mapping itself (DRAM) or
  // the host image of the device memory (VRAM).
  uint8_t* data() const {
    return memory == v1::VRAM ? host_image.get() : static_cast<uint8_t*>(mapping.data());
  }
  // Item `item` of region `region` (position in the group) of groups[group].
  uint8_t* Item(size_t group, uint32_t region, uint64_t item) const {
    const PoolGroup& g = groups[group];
    return data() + g.offset + (uint64_t{region} * g.shape.items + item) * g.shape.item_bytes;
  }
  // Start of region `region` of groups[group] (byte segments address regions).
  uint8_t* Region(size_t group, uint32_t region) const { return Item(group, region, 0); }
  uint64_t bytes() const { return size; }

  // VRAM: copy the host image to the device (after filling it) and the device back
  // into the image (before checking it). DRAM: nothing to do, the mapping is the pool.
  absl::Status Upload();
  absl::Status Download();
};

// Lays the groups out back to back (each group's start aligned to 4 KiB, its
// regions packed) and registers every region in one all-or-nothing batch. DRAM:
// one shared-memory object named after `label`, mapped here. VRAM: one device
// allocation on `memory.device` with one IPC handle (CudaDriver::Load must
// succeed), its regions `memory VRAM` with cuda_ipc sources, and a zeroed host image.
absl::StatusOr<Pool> CreatePool(AgentClient& agent, const std::string& label,
                                const std::vector<PoolGroupShape>& groups,
                                const PoolMemory& memory = {});

struct KvPoolShape {
  std::string group = "kv";
  uint32_t layers = 32;
  uint32_t tensors_per_layer = 2;  // K and V
  uint64_t pages = 128;
  uint64_t page_bytes = 32 << 10;
};

// The group of a KV pool: regions "L<layer>.<K|V>" (or "L<layer>.T<t>" when a layer
// has other than two tensors), layer-major.
PoolGroupShape KvGroupShape(const KvPoolShape& shape);

struct KvPool {
  KvPoolShape shape;
  uint64_t memory_handle = 0;    // the session's handle of the pool's memfd
  registry::ShmMapping mapping;  // this process's view of the whole pool
  std::vector<std::string> region_names;

  uint32_t regions() const { return shape.layers * shape.tensors_per_layer; }
  // Page `page` of region `region` in this process.
  uint8_t* Page(uint32_t region, uint64_t page) const {
    return static_cast<uint8_t*>(mapping.data()) +
           (uint64_t{region} * shape.pages + page) * shape.page_bytes;
  }
  uint64_t bytes() const { return uint64_t{regions()} * shape.pages * shape.page_bytes; }
};

// CreatePool with the one KvGroupShape group. Region names are "<label>.L<layer>.<K|V>".
absl::StatusOr<KvPool> CreateKvPool(AgentClient& agent, const std::string& label,
                                    const KvPoolShape& shape);

// Deterministic item contents: every 8-byte word depends on (seed, region, item,
// word); a tail shorter than 8 bytes is left as it was.
void FillPage(uint8_t* page, uint64_t bytes, uint64_t seed, uint32_t region, uint64_t page_index);

}  // namespace kvagent::cli
