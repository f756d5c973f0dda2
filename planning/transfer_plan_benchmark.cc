// Google Benchmark of PlanTransfer: one segment naming 16384 items of a 64-region
// group on both sides expands to 1M (local, remote, bytes) operations, which
// coalesce to 64 (contiguous indices) or stay 1M (scattered); and of what the engine
// adds per chunk to keep destinations apart (DestinationRanges + a DestinationLedger
// claim and release). A cc_binary, not a test:
// `bazel run -c opt //planning:transfer_plan_benchmark` (docs/BENCHMARKS.md).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "base/format.h"
#include "benchmark/benchmark.h"
#include "fmt/format.h"
#include "planning/destination_ledger.h"
#include "planning/transfer_plan.h"
#include "proto/kvagent.pb.h"
#include "registry/region_registry.h"
#include "registry/remote_catalog.h"
#include "registry/shm_mapping.h"
#include "transport/ucx_context.h"

namespace kvagent::planning {
namespace {

using registry::MemoryObject;
using registry::RegionRegistry;
using registry::RegisterContext;
using registry::RemoteCatalog;
using registry::ShmMapping;

constexpr uint32_t kRegions = 64;
constexpr uint64_t kItems = 16384;   // per region: 64 x 16384 = 1M pages per transfer
constexpr uint64_t kItemBytes = 16;  // small, so both sides fit in 16 MiB of shm

[[noreturn]] void Die(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "transfer_plan_benchmark: %s: %s\n", what.c_str(),
               std::string(status.message()).c_str());
  std::exit(1);
}

// Two real registries in one process, as transfer_plan_test builds them: the local
// one and the peer's, whose Export becomes the RemoteCatalog the planner reads.
struct Agents {
  std::unique_ptr<transport::UcxContext> context;
  ShmMapping local_shm, remote_shm;
  std::unique_ptr<RegionRegistry> local, remote_registry;
  RemoteCatalog remote;

  Agents() {
    auto created = transport::UcxContext::Create();
    if (!created.ok()) Die("creating the UCX context", created.status());
    context = std::move(created).value();
    const uint64_t region_bytes = kItems * kItemBytes;
    const uint64_t bytes = kRegions * region_bytes;
    for (auto [side, shm] : {std::pair{"local", &local_shm}, {"remote", &remote_shm}}) {
      auto made = ShmMapping::Create(fmt::format("/kvagent-planbench-{}-{}", getpid(), side), bytes);
      if (!made.ok()) Die(fmt::format("creating the {} shm object", side), made.status());
      *shm = std::move(made).value();
    }
    local = std::make_unique<RegionRegistry>(context.get());
    remote_registry = std::make_unique<RegionRegistry>(context.get());
    for (auto [registry, shm] : {std::pair{local.get(), &local_shm}, {remote_registry.get(), &remote_shm}}) {
      std::vector<v1::RegionSpec> specs;
      for (uint32_t r = 0; r < kRegions; ++r) {
        v1::RegionSpec spec;
        spec.set_name(fmt::format("L{}", r));
        spec.set_kind(v1::KV);
        spec.set_group("kv");
        spec.set_memory(v1::DRAM);
        spec.set_length(region_bytes);
        spec.mutable_layout()->set_num_items(kItems);
        spec.mutable_layout()->set_item_bytes(kItemBytes);
        spec.mutable_shm()->set_memory_handle(1);
        spec.mutable_shm()->set_offset(r * region_bytes);
        specs.push_back(std::move(spec));
      }
      // Registered by descriptor, as a local session does: handle 1 is this side's object.
      RegisterContext registrant;
      registrant.owner = "benchmark";
      registrant.resolve_handle = [shm = shm](uint64_t) {
        return absl::StatusOr<std::shared_ptr<const MemoryObject>>(shm->memory());
      };
      auto registered = registry->Register(specs, false, registrant);
      if (!registered.ok()) Die("registering 64 regions", registered.status());
    }
    v1::AgentMetadata metadata;
    remote_registry->Export(&metadata, /*same_host=*/false);
    metadata.set_name("decode");
    metadata.set_worker_address("benchmark");
    auto catalog = RemoteCatalog::FromMetadata(metadata);
    if (!catalog.ok()) Die("building the remote catalog", catalog.status());
    remote = std::move(catalog).value();
  }
};

Agents& Shared() {
  static Agents* agents = new Agents();  // lives for the whole run, like an agent's
  return *agents;
}

google::protobuf::RepeatedPtrField<v1::Segment> Segments(bool scattered) {
  std::vector<uint64_t> local(kItems), remote(kItems);
  std::iota(local.begin(), local.end(), 0);
  std::iota(remote.begin(), remote.end(), 0);
  if (scattered) {
    std::mt19937_64 rng(42);
    std::shuffle(local.begin(), local.end(), rng);
    std::shuffle(remote.begin(), remote.end(), rng);
  }
  google::protobuf::RepeatedPtrField<v1::Segment> segments;
  auto* items = segments.Add()->mutable_items();
  items->set_local_group("kv");
  items->set_remote_group("kv");
  for (uint64_t i : local) items->add_local_indices(i);
  for (uint64_t i : remote) items->add_remote_indices(i);
  return segments;
}

void BM_PlanTransfer(benchmark::State& state) {
  const bool scattered = state.range(0) != 0;
  Agents& agents = Shared();
  const auto segments = Segments(scattered);
  size_t ops = 0;
  for (auto _ : state) {
    auto plan = PlanTransfer(*agents.local, agents.remote, segments, 0, v1::WRITE);
    if (!plan.ok()) {
      state.SkipWithError(std::string(plan.status().message()).c_str());
      break;
    }
    ops = plan->ops.size();
    benchmark::DoNotOptimize(plan->ops.data());
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * kRegions * kItems);
  state.counters["ops_after_coalescing"] = static_cast<double>(ops);
  state.SetLabel(scattered ? "scattered" : "contiguous");
}
BENCHMARK(BM_PlanTransfer)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

// The destination ranges of the 1M-page plan, claimed in a ledger that already holds
// another transfer's 64 ranges (other pages of the same regions: none overlap), then
// released.
void BM_DestinationClaim(benchmark::State& state) {
  const bool scattered = state.range(0) != 0;
  Agents& agents = Shared();
  auto plan = PlanTransfer(*agents.local, agents.remote, Segments(scattered), 0, v1::WRITE);
  if (!plan.ok()) {
    state.SkipWithError(std::string(plan.status().message()).c_str());
    return;
  }
  // The plan writes items [0, 16384) of every region: the other transfer's ranges lie
  // past the end of a region (as if regions were longer), so none overlap.
  DestinationLedger ledger;
  std::vector<std::string> names;  // the ranges view them
  for (uint32_t r = 0; r < kRegions; ++r) names.push_back(fmt::format("L{}", r));
  std::vector<DestinationRange> other;
  for (uint32_t r = 0; r < kRegions; ++r) {
    other.push_back({names[r], kItems * kItemBytes, kItems * kItemBytes + 4096});
  }
  if (absl::Status s = ledger.Claim("other", "peer:decode", other); !s.ok()) {
    state.SkipWithError(std::string(s.message()).c_str());
    return;
  }
  size_t ranges = 0;
  for (auto _ : state) {
    const DestinationRangeList claimed = DestinationRanges(*plan, v1::WRITE, agents.remote);
    if (absl::Status s = ledger.Claim("bench", "peer:decode", claimed); !s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      break;
    }
    ranges = claimed.size();
    ledger.Release("bench");
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * kRegions * kItems);
  state.counters["ranges_after_merging"] = static_cast<double>(ranges);
  state.SetLabel(scattered ? "scattered" : "contiguous");
}
BENCHMARK(BM_DestinationClaim)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvagent::planning

BENCHMARK_MAIN();
