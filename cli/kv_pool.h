// KvPool builds an engine-shaped KV pool on an agent: one shared-memory object from
// AllocateSharedMemory, one region per layer per K/V (SGLang's layout) in one
// group, also mapped into this process so the caller can fill and check bytes.
// Used by the demo, the benchmark and the integration tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cli/agent_client.h"
#include "registry/shm_mapping.h"

namespace kvagent::cli {

struct KvPoolShape {
  std::string group = "kv";
  uint32_t layers = 32;
  uint32_t tensors_per_layer = 2;  // K and V
  uint64_t pages = 128;
  uint64_t page_bytes = 32 << 10;
};

struct KvPool {
  KvPoolShape shape;
  std::string shm_name;
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

// Allocates, registers and maps. Region names are "<label>.L<layer>.<K|V>".
absl::StatusOr<KvPool> CreateKvPool(AgentClient& agent, const std::string& label,
                                    const KvPoolShape& shape);

// Deterministic page contents: every 8-byte word depends on (seed, region, page, word).
void FillPage(uint8_t* page, uint64_t bytes, uint64_t seed, uint32_t region, uint64_t page_index);

}  // namespace kvagent::cli
