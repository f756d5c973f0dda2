// Engine-shaped memory pools on an agent. A Pool is one shared-memory object from
// AllocateSharedMemory holding several groups of regions (KV pages, Mamba STATE
// slots, AUX bytes), all registered in one batch and also mapped into this process
// so the caller can fill and check bytes. KvPool is the one-group KV case (one
// region per layer per K/V, SGLang's layout). Used by the demo, the benchmark and
// the integration tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cli/agent_client.h"
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

struct Pool {
  std::string shm_name;
  registry::ShmMapping mapping;  // this process's view of the whole object
  std::vector<PoolGroup> groups;
  std::vector<std::string> region_names;  // every region, in registration order

  // Item `item` of region `region` (position in the group) of groups[group].
  uint8_t* Item(size_t group, uint32_t region, uint64_t item) const {
    const PoolGroup& g = groups[group];
    return static_cast<uint8_t*>(mapping.data()) + g.offset +
           (uint64_t{region} * g.shape.items + item) * g.shape.item_bytes;
  }
  // Start of region `region` of groups[group] (byte segments address regions).
  uint8_t* Region(size_t group, uint32_t region) const { return Item(group, region, 0); }
  uint64_t bytes() const { return mapping.length(); }
};

// Lays the groups out back to back (each group's start aligned to 4 KiB, its
// regions packed), allocates one object named after `label`, maps it here and
// registers every region in one all-or-nothing batch.
absl::StatusOr<Pool> CreatePool(AgentClient& agent, const std::string& label,
                                const std::vector<PoolGroupShape>& groups);

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

// CreatePool with the one KvGroupShape group. Region names are "<label>.L<layer>.<K|V>".
absl::StatusOr<KvPool> CreateKvPool(AgentClient& agent, const std::string& label,
                                    const KvPoolShape& shape);

// Deterministic item contents: every 8-byte word depends on (seed, region, item,
// word); a tail shorter than 8 bytes is left as it was.
void FillPage(uint8_t* page, uint64_t bytes, uint64_t seed, uint32_t region, uint64_t page_index);

}  // namespace kvagent::cli
