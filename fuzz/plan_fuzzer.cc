// Fuzz target: a SubmitTransfer request, as bytes, through PlanTransfer against a fixed
// small local registry (real shm, real UCX registrations) and a fixed remote catalog,
// both built once. Every planned operation must lie inside one local region the plan
// pins and inside the remote region its rkey slot names; item segments must pair
// regions of the same role; no destination byte (the peer's for WRITE, ours for READ)
// may be written twice; the byte count must match an independent count, and so must
// the destination ranges a DestinationLedger would claim; rejections must name the
// segment.

#include <unistd.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "base/format.h"
#include "fuzz/fuzz_check.h"
#include "fuzz/fuzz_target.h"
#include "planning/destination_ledger.h"
#include "planning/transfer_plan.h"
#include "proto/kvagent.pb.h"
#include "registry/region_registry.h"
#include "registry/remote_catalog.h"
#include "registry/shm_mapping.h"
#include "transport/ucx_context.h"

namespace kvagent::fuzz {
namespace {

using registry::RegionPtr;
using registry::RemoteRegion;

v1::RegionSpec LocalSpec(const std::string& name, const std::string& group, uint64_t offset,
                         uint64_t num_items, uint64_t item_bytes, uint64_t stride,
                         const std::string& shm, const std::string& role = "") {
  v1::RegionSpec spec;
  spec.set_name(name);
  spec.set_role(role);
  spec.set_kind(group.empty() ? v1::AUX : v1::KV);
  spec.set_group(group);
  spec.set_memory(v1::DRAM);
  spec.set_length((num_items - 1) * (stride ? stride : item_bytes) + item_bytes);
  spec.mutable_layout()->set_num_items(num_items);
  spec.mutable_layout()->set_item_bytes(item_bytes);
  spec.mutable_layout()->set_item_stride(stride);
  spec.mutable_shm()->set_name(shm);
  spec.mutable_shm()->set_offset(offset);
  return spec;
}

void AddRemote(v1::AgentMetadata* md, const std::string& name, const std::string& group,
               uint32_t position, uint64_t base, uint64_t num_items, uint64_t item_bytes,
               uint64_t stride, const std::string& role = "") {
  v1::ExportedRegion* r = md->add_regions();
  r->set_name(name);
  r->set_role(role);
  r->set_group(group);
  r->set_group_position(position);
  r->set_memory(v1::DRAM);
  r->set_base_address(base);
  r->set_length((num_items - 1) * (stride ? stride : item_bytes) + item_bytes);
  r->mutable_layout()->set_num_items(num_items);
  r->mutable_layout()->set_item_bytes(item_bytes);
  r->mutable_layout()->set_item_stride(stride);
  r->set_rkey("rkey-" + name);
}

// The local side (groups kv, state, kv3, wide; byte region aux) and the peer (kv and
// state of other sizes, kv3 of three regions, wide with other item sizes, aux; one
// region near the top of the address space). Roles: kvr declares them on both sides,
// registered V first here and K first on the peer; the peer's kvx has another role
// set; the local kvm declares a role on one region of two, the peer's none.
struct Fixture {
  Fixture() {
    auto created = transport::UcxContext::Create();
    FUZZ_CHECK(created.ok(), "UCX context: {}", created.status().message());
    context = std::move(created).value();
    shm_name = ShmName("plan");
    auto created_shm = registry::ShmMapping::Create(shm_name, 65536);
    FUZZ_CHECK(created_shm.ok(), "shm: {}", created_shm.status().message());
    shm = std::move(created_shm).value();
    UnlinkOnFailure(shm_name);
    registry = std::make_unique<registry::RegionRegistry>(context.get());
    const std::vector<v1::RegionSpec> specs = {
        LocalSpec("k.L0", "kv", 0, 16, 256, 0, shm_name),
        LocalSpec("v.L0", "kv", 4096, 16, 256, 512, shm_name),
        LocalSpec("state", "state", 16384, 4, 1024, 2048, shm_name),
        LocalSpec("aux", "", 32768, 1, 4096, 0, shm_name),
        LocalSpec("a3", "kv3", 40960, 8, 128, 0, shm_name),
        LocalSpec("b3", "kv3", 41984, 8, 128, 0, shm_name),
        LocalSpec("wide", "wide", 43008, 4, 512, 0, shm_name),
        LocalSpec("v.r", "kvr", 45056, 8, 128, 0, shm_name, "L0.V"),
        LocalSpec("k.r", "kvr", 46080, 8, 128, 0, shm_name, "L0.K"),
        LocalSpec("k.m", "kvm", 47104, 8, 128, 0, shm_name, "L0.K"),
        LocalSpec("v.m", "kvm", 48128, 8, 128, 0, shm_name),
    };
    registry::RegisterContext registrant;  // by name: the object this process created
    registrant.owner = "plan-fuzzer";
    registrant.path_policy.required_uid = geteuid();
    auto result = registry->Register(specs, false, registrant);
    FUZZ_CHECK(result.ok(), "local regions: {}", result.status().message());

    v1::AgentMetadata md;
    md.set_name("peer");
    md.set_worker_address("worker-address");
    AddRemote(&md, "k.L0", "kv", 0, 0x100000, 32, 256, 0);
    AddRemote(&md, "v.L0", "kv", 1, 0x100000 + 32 * 256, 32, 256, 0);  // adjacent to k.L0
    AddRemote(&md, "state", "state", 0, 0x200000, 8, 1024, 0);
    AddRemote(&md, "aux", "", 0, 0xffffffffffffe000ULL, 1, 4096, 0);  // ends 4 KiB below 2^64
    AddRemote(&md, "a3", "kv3", 0, 0x300000, 8, 128, 0);
    AddRemote(&md, "b3", "kv3", 1, 0x310000, 8, 128, 0);
    AddRemote(&md, "c3", "kv3", 2, 0x320000, 8, 128, 0);
    AddRemote(&md, "wide", "wide", 0, 0x400000, 4, 256, 0);
    AddRemote(&md, "k.r", "kvr", 0, 0x500000, 8, 128, 0, "L0.K");
    AddRemote(&md, "v.r", "kvr", 1, 0x500000 + 8 * 128, 8, 128, 0, "L0.V");  // adjacent
    AddRemote(&md, "k.x", "kvx", 0, 0x510000, 8, 128, 0, "L0.K");
    AddRemote(&md, "x.x", "kvx", 1, 0x520000, 8, 128, 0, "L0.X");
    AddRemote(&md, "k.m", "kvm", 0, 0x530000, 8, 128, 0);
    AddRemote(&md, "v.m", "kvm", 1, 0x540000, 8, 128, 0);
    auto built = registry::RemoteCatalog::FromMetadata(md);
    FUZZ_CHECK(built.ok(), "remote catalog: {}", built.status().message());
    catalog = std::make_unique<registry::RemoteCatalog>(*std::move(built));
  }
  std::unique_ptr<transport::UcxContext> context;
  std::string shm_name;
  registry::ShmMapping shm;
  std::unique_ptr<registry::RegionRegistry> registry;
  std::unique_ptr<registry::RemoteCatalog> catalog;
};

const Fixture& GetFixture() {
  static Fixture fixture;
  return fixture;
}

bool Inside(uint64_t address, uint64_t length, uint64_t base, uint64_t region_length) {
  const unsigned __int128 end = static_cast<unsigned __int128>(address) + length;
  return address >= base && end <= static_cast<unsigned __int128>(base) + region_length;
}

// Bytes and items the request names when it is valid, counted without the planner.
void CountExpected(const Fixture& f, const v1::SubmitTransferRequest& request, uint64_t* bytes,
                   uint64_t* items) {
  *bytes = 0;
  *items = 0;
  for (const v1::Segment& segment : request.segments()) {
    if (segment.has_bytes()) {
      *bytes += segment.bytes().length();
      continue;
    }
    const auto& seg = segment.items();
    for (const RegionPtr& region : f.registry->FindGroup(seg.local_group())) {
      *bytes += region->item_bytes() * static_cast<uint64_t>(seg.local_indices_size());
    }
    *items += static_cast<uint64_t>(seg.local_indices_size());
  }
}

// The pinned local region holding [address, +length), or null.
const registry::Region* LocalRegion(const planning::TransferPlan& plan, uint64_t address,
                                    uint64_t length) {
  for (const RegionPtr& region : plan.local_regions) {
    if (Inside(address, length, region->base_address, region->spec.length())) return region.get();
  }
  return nullptr;
}

void Run(const v1::SubmitTransferRequest& request) {
  const Fixture& f = GetFixture();
  const uint32_t first_segment = request.chunk() & 0xffff;  // as a later chunk numbers them
  // The engine refuses other ops before planning; any other value plans as a WRITE.
  const v1::TransferOp op = request.op() == v1::READ ? v1::READ : v1::WRITE;
  auto plan =
      planning::PlanTransfer(*f.registry, *f.catalog, request.segments(), first_segment, op);
  if (!plan.ok()) {
    const absl::Status& status = plan.status();
    FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument ||
                   status.code() == absl::StatusCode::kNotFound,
               "rejection with code {}: {}", static_cast<int>(status.code()), status.message());
    FUZZ_CHECK(absl::StartsWith(status.message(), "segment "),
               "rejection does not name the segment: {}", status.message());
    return;
  }
  const std::vector<const RemoteRegion*> remote = [&] {
    std::vector<const RemoteRegion*> out;
    for (const RemoteRegion& r : f.catalog->regions()) out.push_back(&r);
    return out;
  }();
  uint64_t total = 0;
  uint32_t last_segment = first_segment;
  for (const planning::PlanOp& op : plan->ops) {
    FUZZ_CHECK(op.length > 0, "empty op in segment {}", op.segment);
    FUZZ_CHECK(op.segment >= last_segment &&
                   op.segment < first_segment + static_cast<uint32_t>(request.segments_size()),
               "op segment {} out of order or range", op.segment);
    last_segment = op.segment;
    const registry::Region* l = LocalRegion(*plan, op.local_address, op.length);
    FUZZ_CHECK(l != nullptr, "op [{:#x}, +{}) of segment {} is outside every pinned local region",
               op.local_address, op.length, op.segment);
    FUZZ_CHECK(op.rkey_slot < remote.size(), "rkey slot {} of {}", op.rkey_slot, remote.size());
    const RemoteRegion& r = *remote[op.rkey_slot];
    FUZZ_CHECK(Inside(op.remote_address, op.length, r.base_address, r.length),
               "op remote [{:#x}, +{}) of segment {} is outside peer region '{}' [{:#x}, +{})",
               op.remote_address, op.length, op.segment, r.name, r.base_address, r.length);
    FUZZ_CHECK(!op.local_device && !op.remote_device, "device flag on host memory");
    // Item segments pair regions that say they hold the same thing (or, without roles
    // on either side, by position).
    if (request.segments(static_cast<int>(op.segment - first_segment)).has_items()) {
      FUZZ_CHECK(l->spec.role() == r.role,
                 "segment {} pairs local region '{}' (role '{}') with peer region '{}' (role "
                 "'{}')",
                 op.segment, l->spec.name(), l->spec.role(), r.name, r.role);
    }
    total += op.length;
  }
  // No destination byte is written twice: the peer's for WRITE, ours for READ.
  std::vector<std::pair<uint64_t, uint64_t>> destinations;
  for (const planning::PlanOp& o : plan->ops) {
    destinations.emplace_back(op == v1::READ ? o.local_address : o.remote_address, o.length);
  }
  std::sort(destinations.begin(), destinations.end());
  for (size_t i = 1; i < destinations.size(); ++i) {
    FUZZ_CHECK(destinations[i - 1].first + destinations[i - 1].second <= destinations[i].first,
               "destination bytes [{:#x}, +{}) and [{:#x}, +{}) overlap", destinations[i - 1].first,
               destinations[i - 1].second, destinations[i].first, destinations[i].second);
  }
  // What the engine would claim covers the same bytes, by region name, and a ledger
  // holding nothing else accepts it.
  const planning::DestinationRangeList ranges =
      planning::DestinationRanges(*plan, op, *f.catalog);
  uint64_t claimed = 0;
  for (const planning::DestinationRange& range : ranges) {
    uint64_t region_length = 0;
    if (op == v1::READ) {
      const RegionPtr region = f.registry->Find(std::string(range.region));
      FUZZ_CHECK(region != nullptr, "destination range names no local region '{}'", range.region);
      region_length = region->spec.length();
    } else {
      const RemoteRegion* region = f.catalog->Find(std::string(range.region));
      FUZZ_CHECK(region != nullptr, "destination range names no peer region '{}'", range.region);
      region_length = region->length;
    }
    FUZZ_CHECK(range.begin < range.end && range.end <= region_length,
               "destination range [{}, {}) of '{}' ({} bytes)", range.begin, range.end,
               range.region, region_length);
    claimed += range.end - range.begin;
  }
  FUZZ_CHECK(claimed == plan->bytes, "destination ranges cover {} bytes, the plan moves {}",
             claimed, plan->bytes);
  planning::DestinationLedger ledger;
  const absl::Status claim =
      ledger.Claim("fuzz", planning::DestinationKey(op, f.catalog->peer()), ranges);
  FUZZ_CHECK(claim.ok(), "a fresh ledger refuses the plan's destinations: {}", claim.message());
  FUZZ_CHECK(total == plan->bytes, "ops move {} bytes, plan says {}", total, plan->bytes);
  uint64_t bytes = 0;
  uint64_t items = 0;
  CountExpected(f, request, &bytes, &items);
  FUZZ_CHECK(bytes == plan->bytes && items == plan->items,
             "plan has {} bytes / {} items, the request names {} / {}", plan->bytes, plan->items,
             bytes, items);
  for (size_t i = 0; i < plan->local_regions.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      FUZZ_CHECK(plan->local_regions[i] != plan->local_regions[j], "region '{}' pinned twice",
                 plan->local_regions[i]->spec.name());
    }
  }
}

}  // namespace

const google::protobuf::Message& InputPrototype() {
  return v1::SubmitTransferRequest::default_instance();
}
const char* TargetName() { return "plan"; }

}  // namespace kvagent::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvagent::v1::SubmitTransferRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  kvagent::fuzz::Run(request);
  return 0;
}
