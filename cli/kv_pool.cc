#include "cli/kv_pool.h"

#include <cstring>

#include "fmt/format.h"
#include "transport/base/format.h"
#include "transport/base/status_macros.h"

namespace kvagent::cli {

absl::StatusOr<KvPool> CreateKvPool(AgentClient& agent, const std::string& label,
                                    const KvPoolShape& shape) {
  KvPool pool;
  pool.shape = shape;
  ASSIGN_OR_RETURN(auto allocation, agent.Allocate(label, pool.bytes()));
  pool.shm_name = allocation.shm_name();
  ASSIGN_OR_RETURN(pool.mapping,
                   registry::ShmMapping::Open(pool.shm_name, 0, pool.bytes(), label));
  v1::RegisterRegionsRequest request;
  const uint64_t region_bytes = shape.pages * shape.page_bytes;
  for (uint32_t layer = 0; layer < shape.layers; ++layer) {
    for (uint32_t t = 0; t < shape.tensors_per_layer; ++t) {
      const uint32_t index = layer * shape.tensors_per_layer + t;
      const std::string name =
          shape.tensors_per_layer == 2
              ? fmt::format("{}.L{}.{}", label, layer, t == 0 ? "K" : "V")
              : fmt::format("{}.L{}.T{}", label, layer, t);
      auto* spec = request.add_regions();
      spec->set_name(name);
      spec->set_kind(v1::KV);
      spec->set_group(shape.group);
      spec->set_memory(v1::DRAM);
      spec->set_length(region_bytes);
      spec->mutable_layout()->set_num_items(shape.pages);
      spec->mutable_layout()->set_item_bytes(shape.page_bytes);
      spec->mutable_shm()->set_name(pool.shm_name);
      spec->mutable_shm()->set_offset(uint64_t{index} * region_bytes);
      pool.region_names.push_back(name);
    }
  }
  RETURN_IF_ERROR(agent.Register(request).status());
  return pool;
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
