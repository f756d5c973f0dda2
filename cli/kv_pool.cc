#include "cli/kv_pool.h"

#include <cstring>
#include <utility>

#include "base/format.h"
#include "base/status_macros.h"
#include "fmt/format.h"

namespace kvagent::cli {
namespace {

constexpr uint64_t kGroupAlignment = 4096;

uint64_t AlignUp(uint64_t n, uint64_t alignment) { return (n + alignment - 1) / alignment * alignment; }

}  // namespace

absl::StatusOr<DeviceAllocation> DeviceAllocation::Allocate(cuda::CudaDriver* driver,
                                                            int device, uint64_t bytes,
                                                            const std::string& label) {
  if (absl::Status s = driver->MakeCurrent(device); !s.ok()) {
    return absl::Status(s.code(), fmt::format("pool '{}': cannot use CUDA device {}: {}; pick "
                                              "another device (--device N)",
                                              label, device, s.message()));
  }
  auto dptr = driver->MemAlloc(bytes);
  if (!dptr.ok()) {
    return absl::Status(dptr.status().code(),
                        fmt::format("pool '{}': cuMemAlloc of {} bytes on CUDA device {} failed: "
                                    "{}; free GPU memory or lower --pool-mib",
                                    label, bytes, device, dptr.status().message()));
  }
  DeviceAllocation allocation;
  allocation.driver_ = driver;
  allocation.dptr_ = *dptr;
  allocation.device_ = device;
  auto handle = driver->IpcGetHandle(*dptr);
  if (!handle.ok()) {
    return absl::Status(handle.status().code(),
                        fmt::format("pool '{}': cannot export a CUDA IPC handle for its {} bytes "
                                    "on device {}: {}",
                                    label, bytes, device, handle.status().message()));
  }
  allocation.ipc_handle_ = *std::move(handle);
  return allocation;
}

DeviceAllocation::DeviceAllocation(DeviceAllocation&& other) noexcept
    : driver_(std::exchange(other.driver_, nullptr)),
      dptr_(std::exchange(other.dptr_, 0)),
      device_(other.device_),
      ipc_handle_(std::move(other.ipc_handle_)) {}

DeviceAllocation& DeviceAllocation::operator=(DeviceAllocation&& other) noexcept {
  if (this != &other) {
    (void)Free();  // the destructor's case: nobody is left to report to
    driver_ = std::exchange(other.driver_, nullptr);
    dptr_ = std::exchange(other.dptr_, 0);
    device_ = other.device_;
    ipc_handle_ = std::move(other.ipc_handle_);
  }
  return *this;
}

DeviceAllocation::~DeviceAllocation() { (void)Free(); }

absl::Status DeviceAllocation::Free() {
  if (dptr_ == 0) return absl::OkStatus();
  const uint64_t dptr = std::exchange(dptr_, 0);
  RETURN_IF_ERROR(driver_->MakeCurrent(device_));
  return driver_->MemFree(dptr);
}

absl::Status Pool::Upload() {
  if (memory != v1::VRAM) return absl::OkStatus();
  return device.driver()->Copy(device.dptr(), reinterpret_cast<uint64_t>(host_image.get()), size);
}

absl::Status Pool::Download() {
  if (memory != v1::VRAM) return absl::OkStatus();
  return device.driver()->Copy(reinterpret_cast<uint64_t>(host_image.get()), device.dptr(), size);
}

absl::StatusOr<Pool> CreatePool(AgentClient& agent, const std::string& label,
                                const std::vector<PoolGroupShape>& groups,
                                const PoolMemory& memory) {
  Pool pool;
  pool.memory = memory.kind == v1::VRAM ? v1::VRAM : v1::DRAM;
  uint64_t end = 0;
  for (const PoolGroupShape& shape : groups) {
    if (shape.regions() == 0 || shape.items == 0 || shape.item_bytes == 0) {
      return absl::InvalidArgumentError(fmt::format(
          "pool '{}' group '{}': {} regions of {} items of {} bytes; every count must be > 0",
          label, shape.group, shape.regions(), shape.items, shape.item_bytes));
    }
    PoolGroup group;
    group.shape = shape;
    group.offset = AlignUp(end, kGroupAlignment);
    end = group.offset + shape.bytes();
    pool.groups.push_back(std::move(group));
  }
  if (end == 0) {
    return absl::InvalidArgumentError(
        fmt::format("pool '{}' has no groups; give at least one group shape", label));
  }
  pool.size = end;
  if (pool.memory == v1::VRAM) {
    ASSIGN_OR_RETURN(cuda::CudaDriver * driver, cuda::CudaDriver::Load());
    ASSIGN_OR_RETURN(pool.device, DeviceAllocation::Allocate(driver, memory.device, end, label));
    pool.host_image.reset(new uint8_t[end]());
  } else {
    ASSIGN_OR_RETURN(SharedMemory allocation, agent.AllocateMemory(label, end));
    pool.memory_handle = allocation.info.handle();
    pool.mapping = std::move(allocation.mapping);
  }

  v1::RegisterRegionsRequest request;
  for (PoolGroup& group : pool.groups) {
    const PoolGroupShape& shape = group.shape;
    for (uint32_t r = 0; r < shape.regions(); ++r) {
      const std::string name = fmt::format("{}.{}", label, shape.region_suffixes[r]);
      auto* spec = request.add_regions();
      spec->set_name(name);
      spec->set_kind(shape.kind);
      spec->set_group(shape.group);
      spec->set_memory(pool.memory);
      spec->set_length(shape.region_bytes());
      spec->mutable_layout()->set_num_items(shape.items);
      spec->mutable_layout()->set_item_bytes(shape.item_bytes);
      const uint64_t offset = group.offset + uint64_t{r} * shape.region_bytes();
      if (pool.memory == v1::VRAM) {
        spec->mutable_cuda_ipc()->set_ipc_handle(pool.device.ipc_handle());
        spec->mutable_cuda_ipc()->set_device(pool.device.device());
        spec->mutable_cuda_ipc()->set_offset(offset);
      } else {
        spec->mutable_shm()->set_memory_handle(pool.memory_handle);
        spec->mutable_shm()->set_offset(offset);
      }
      group.region_names.push_back(name);
      pool.region_names.push_back(name);
    }
  }
  ASSIGN_OR_RETURN(auto registered, agent.Register(request));
  if (registered.regions_size() > 0) pool.memory_path = registered.regions(0).memory_path();
  return pool;
}

PoolGroupShape KvGroupShape(const KvPoolShape& shape) {
  PoolGroupShape group;
  group.group = shape.group;
  group.kind = v1::KV;
  group.items = shape.pages;
  group.item_bytes = shape.page_bytes;
  for (uint32_t layer = 0; layer < shape.layers; ++layer) {
    for (uint32_t t = 0; t < shape.tensors_per_layer; ++t) {
      group.region_suffixes.push_back(shape.tensors_per_layer == 2
                                          ? fmt::format("L{}.{}", layer, t == 0 ? "K" : "V")
                                          : fmt::format("L{}.T{}", layer, t));
    }
  }
  return group;
}

absl::StatusOr<KvPool> CreateKvPool(AgentClient& agent, const std::string& label,
                                    const KvPoolShape& shape) {
  // One group starts at offset 0 with its regions packed, so KvPool::Page's
  // arithmetic addresses exactly what CreatePool registered.
  ASSIGN_OR_RETURN(Pool pool, CreatePool(agent, label, {KvGroupShape(shape)}));
  KvPool kv;
  kv.shape = shape;
  kv.memory_handle = pool.memory_handle;
  kv.mapping = std::move(pool.mapping);
  kv.region_names = std::move(pool.region_names);
  return kv;
}

void FillPage(uint8_t* page, uint64_t bytes, uint64_t seed, uint32_t region, uint64_t page_index) {
  uint64_t state = seed ^ (uint64_t{region} << 40) ^ (page_index << 8) ^ 0x9E3779B97F4A7C15ull;
  for (uint64_t offset = 0; offset + 8 <= bytes; offset += 8) {
    // splitmix64
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    std::memcpy(page + offset, &z, 8);
  }
}

}  // namespace kvagent::cli
