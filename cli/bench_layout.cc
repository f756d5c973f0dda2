#include "cli/bench_layout.h"

#include <algorithm>
#include <chrono>
#include <numeric>

#include "base/status_macros.h"
#include "fmt/format.h"

namespace kvagent::cli {
namespace {

// The one KV region of `layout` (the whole pool as items of one block size); the
// caller names where its memory is.
v1::RegionSpec LayoutSpec(const Layout& layout, v1::MemoryKind memory) {
  v1::RegionSpec spec;
  spec.set_name(layout.region);
  spec.set_kind(v1::KV);
  spec.set_group(layout.group);
  spec.set_memory(memory);
  spec.set_length(layout.items * layout.block);
  spec.mutable_layout()->set_num_items(layout.items);
  spec.mutable_layout()->set_item_bytes(layout.block);
  return spec;
}

}  // namespace

std::string SizeName(uint64_t bytes) {
  if (bytes >= (1 << 20) && bytes % (1 << 20) == 0) return fmt::format("{}M", bytes >> 20);
  if (bytes >= (1 << 10) && bytes % (1 << 10) == 0) return fmt::format("{}K", bytes >> 10);
  return fmt::format("{}", bytes);
}

void Indices(const Layout& layout, const Cell& cell, uint64_t i, std::vector<uint64_t>* local,
             std::vector<uint64_t>* remote) {
  local->clear();
  remote->clear();
  if (!cell.scattered) {
    const uint64_t slots = layout.items / cell.batch;
    const uint64_t start = (i % slots) * cell.batch;
    for (uint64_t k = 0; k < cell.batch; ++k) {
      local->push_back(start + k);
      remote->push_back(start + k);
    }
    return;
  }
  for (uint64_t k = 0; k < cell.batch; ++k) {
    const uint64_t at = (i * cell.batch + k) % layout.items;
    local->push_back(layout.local_order[at]);
    remote->push_back(layout.remote_order[at]);
  }
}

v1::SubmitTransferRequest LayoutRequest(const Layout& layout, v1::TransferOp op,
                                        const std::string& peer, uint32_t timeout_ms,
                                        absl::Span<const uint64_t> local,
                                        absl::Span<const uint64_t> remote) {
  v1::SubmitTransferRequest request;
  request.set_peer(peer);
  request.set_op(op);
  request.set_timeout_ms(timeout_ms);
  auto* segment = request.add_segments()->mutable_items();
  segment->set_local_group(layout.group);
  segment->set_remote_group(layout.group);
  for (uint64_t i : local) segment->add_local_indices(i);
  for (uint64_t i : remote) segment->add_remote_indices(i);
  return request;
}

absl::Status MakePools(AgentClient& initiator, AgentClient& target, uint64_t bytes,
                       const std::string& label, Pools* pools) {
  pools->bytes = bytes;
  auto a = initiator.AllocateMemory(label + "i", bytes);
  if (!a.ok()) return a.status();
  auto b = target.AllocateMemory(label + "t", bytes);
  if (!b.ok()) return b.status();
  pools->initiator_handle = a->info.handle();
  pools->target_handle = b->info.handle();
  pools->initiator_mapping = std::move(a->mapping);
  pools->target_mapping = std::move(b->mapping);
  pools->initiator = static_cast<uint8_t*>(pools->initiator_mapping.data());
  pools->target = static_cast<uint8_t*>(pools->target_mapping.data());
  pools->shared = true;
  FillPools(pools);
  return absl::OkStatus();
}

void FillPools(Pools* pools) {
  if (pools->vram || !pools->shared) return;
  // Distinct contents on the two sides, so a copy that did not happen shows.
  auto* wi = reinterpret_cast<uint64_t*>(pools->initiator);
  auto* wt = reinterpret_cast<uint64_t*>(pools->target);
  for (uint64_t w = 0; w < pools->bytes / 8; ++w) {
    wi[w] = w * 0x9E3779B97F4A7C15ull;
    wt[w] = ~w * 0xBF58476D1CE4E5B9ull;
  }
}

absl::StatusOr<Warmup> WarmMappings(AgentClient& initiator, const std::string& peer,
                                    const Layout& layout, uint32_t timeout_ms, Pools* pools) {
  // At most 4,096 items and 64 MiB a transfer.
  const uint64_t per = std::max<uint64_t>(
      1, std::min<uint64_t>(4096, (uint64_t{64} << 20) / std::max<uint64_t>(1, layout.block)));
  Warmup warm;
  warm.pages = layout.items * layout.block / 4096;
  const auto start = std::chrono::steady_clock::now();
  for (v1::TransferOp op : {v1::READ, v1::WRITE}) {
    for (uint64_t first = 0; first < layout.items; first += per) {
      std::vector<uint64_t> items(std::min(layout.items, first + per) - first);
      std::iota(items.begin(), items.end(), first);
      v1::SubmitTransferRequest request =
          LayoutRequest(layout, op, peer, timeout_ms, items, items);
      request.set_transfer_id(fmt::format("{}.warm.{}.{}", layout.group,
                                          op == v1::READ ? "r" : "w", first));
      request.set_wait(true);
      auto state = initiator.Submit(request);
      if (!state.ok()) return state.status();
      if (state->phase() != v1::COMPLETED) {
        return absl::InternalError(fmt::format(
            "warming the mappings: transfer '{}' ended {}: {}", request.transfer_id(),
            v1::TransferPhase_Name(state->phase()), state->error_message()));
      }
      ++warm.transfers;
    }
  }
  warm.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  FillPools(pools);
  return warm;
}

absl::Status MakeVramPools(cuda::CudaDriver* cuda, int device, uint64_t bytes,
                           const std::string& label, VramMemory* memory, Pools* pools) {
  ASSIGN_OR_RETURN(memory->initiator,
                   DeviceAllocation::Allocate(cuda, device, bytes, label + " initiator pool"));
  ASSIGN_OR_RETURN(memory->target,
                   DeviceAllocation::Allocate(cuda, device, bytes, label + " target pool"));
  pools->vram = true;
  pools->shared = true;
  pools->bytes = bytes;
  pools->initiator_device = &memory->initiator;
  pools->target_device = &memory->target;
  const uint64_t step = std::min<uint64_t>(bytes, 64ull << 20);
  std::vector<uint64_t> words(step / 8 + 1);
  for (int side = 0; side < 2; ++side) {
    const uint64_t dptr = side == 0 ? memory->initiator.dptr() : memory->target.dptr();
    for (uint64_t at = 0; at < bytes; at += step) {
      const uint64_t n = std::min(step, bytes - at);
      for (uint64_t w = 0; w < (n + 7) / 8; ++w) {
        const uint64_t g = at / 8 + w;
        words[w] = side == 0 ? g * 0x9E3779B97F4A7C15ull : ~g * 0xBF58476D1CE4E5B9ull;
      }
      RETURN_IF_ERROR(cuda->Copy(dptr + at, reinterpret_cast<uint64_t>(words.data()), n));
    }
  }
  return absl::OkStatus();
}

Layout MakeLayout(uint64_t block, uint64_t pool_bytes, std::string group, std::mt19937_64& rng) {
  Layout layout;
  layout.block = block;
  layout.items = pool_bytes / block;
  layout.group = std::move(group);
  layout.region = layout.group + ".r";
  layout.local_order.resize(layout.items);
  std::iota(layout.local_order.begin(), layout.local_order.end(), 0);
  layout.remote_order = layout.local_order;
  std::shuffle(layout.local_order.begin(), layout.local_order.end(), rng);
  std::shuffle(layout.remote_order.begin(), layout.remote_order.end(), rng);
  return layout;
}

absl::Status RegisterVramLayout(AgentClient& agent, const DeviceAllocation& pool,
                                const Layout& layout) {
  v1::RegisterRegionsRequest request;
  auto* spec = request.add_regions();
  *spec = LayoutSpec(layout, v1::VRAM);
  spec->mutable_cuda_ipc()->set_ipc_handle(pool.ipc_handle());
  spec->mutable_cuda_ipc()->set_device(pool.device());
  spec->mutable_cuda_ipc()->set_offset(0);
  return agent.Register(request).status();
}

absl::Status RegisterLayout(AgentClient& agent, uint64_t memory_handle, const Layout& layout) {
  v1::RegisterRegionsRequest request;
  auto* spec = request.add_regions();
  *spec = LayoutSpec(layout, v1::DRAM);
  spec->mutable_shm()->set_memory_handle(memory_handle);
  spec->mutable_shm()->set_offset(0);
  return agent.Register(request).status();
}

}  // namespace kvagent::cli
