// Fuzz target: a peer's GetMetadata reply, as bytes, through the validation the peer
// manager applies before using anything in it (RemoteCatalog::FromMetadata), with the
// default limits and with tight ones. Accepted catalogs must satisfy every invariant
// the planner relies on (bounded printable roles, unique within a group, among them);
// rejections must be INVALID_ARGUMENT naming the peer. A message marked as a delta is
// also applied to a valid view of its sender at its base version (ApplyDelta, what a
// pushed change goes through), with the same checks on the result.
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "base/format.h"
#include "base/text.h"
#include "fuzz/fuzz_check.h"
#include "fuzz/fuzz_target.h"
#include "proto/kvagent.pb.h"
#include "registry/remote_catalog.h"

namespace kvagent::fuzz {
namespace {

using registry::CatalogLimits;
using registry::RemoteCatalog;
using registry::RemoteRegion;

void CheckRejection(const absl::Status& status) {
  FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument,
             "rejection has code {} (want INVALID_ARGUMENT): {}", static_cast<int>(status.code()),
             status.message());
  FUZZ_CHECK(absl::StartsWith(status.message(), "peer '"),
             "rejection does not name the peer: {}", status.message());
}

void CheckRegions(const RemoteCatalog& catalog, const CatalogLimits& limits,
                  const std::function<const v1::ExportedRegion&(size_t)>& exported);

void CheckCatalog(const v1::AgentMetadata& metadata, const RemoteCatalog& catalog,
                  const CatalogLimits& limits) {
  FUZZ_CHECK(catalog.peer() == metadata.name(), "peer '{}' vs metadata name", catalog.peer());
  FUZZ_CHECK(!catalog.peer().empty() && catalog.peer().size() <= limits.max_name_bytes,
             "peer name of {} bytes accepted", catalog.peer().size());
  FUZZ_CHECK(!metadata.worker_address().empty() &&
                 metadata.worker_address().size() <= limits.max_worker_address_bytes,
             "worker address of {} bytes accepted", metadata.worker_address().size());
  const std::vector<RemoteRegion>& regions = catalog.regions();
  FUZZ_CHECK(static_cast<int>(regions.size()) == metadata.regions_size(),
             "{} regions from {} exported", regions.size(), metadata.regions_size());
  for (size_t i = 0; i < regions.size(); ++i) {
    const RemoteRegion& r = regions[i];
    const v1::ExportedRegion& in = metadata.regions(static_cast<int>(i));
    FUZZ_CHECK(r.name == in.name() && r.rkey_slot == i, "region {} is '{}' slot {}", i, r.name,
               r.rkey_slot);
  }
  CheckRegions(catalog, limits, [&](size_t i) -> const v1::ExportedRegion& {
    return metadata.regions(static_cast<int>(i));
  });
}

// What every accepted catalog must hold, whole catalog or delta result: `exported(i)`
// is what region i was parsed from.
void CheckRegions(const RemoteCatalog& catalog, const CatalogLimits& limits,
                  const std::function<const v1::ExportedRegion&(size_t)>& exported) {
  const std::vector<RemoteRegion>& regions = catalog.regions();
  FUZZ_CHECK(regions.size() <= limits.max_regions, "{} regions accepted", regions.size());
  size_t grouped = 0;
  for (size_t i = 0; i < regions.size(); ++i) {
    const RemoteRegion& r = regions[i];
    const v1::ExportedRegion& in = exported(i);
    FUZZ_CHECK(r.name == in.name(), "region {} is '{}', parsed from '{}'", i, r.name, in.name());
    FUZZ_CHECK(!r.name.empty() && r.name.size() <= limits.max_name_bytes &&
                   r.group.size() <= limits.max_name_bytes,
               "region {}: name/group sizes {}/{}", i, r.name.size(), r.group.size());
    // A same-host peer maps [memory_offset, memory_offset + length) of the object.
    FUZZ_CHECK(static_cast<unsigned __int128>(r.memory_offset) + r.length <= ~uint64_t{0},
               "region '{}' memory_offset {} + length {} wraps", r.name, r.memory_offset, r.length);
    FUZZ_CHECK(r.memory == v1::DRAM || r.memory == v1::VRAM, "region '{}' memory {}", r.name,
               static_cast<int>(r.memory));
    FUZZ_CHECK((r.memory == v1::VRAM || !in.rkey().empty()) &&
                   in.rkey().size() <= limits.max_rkey_bytes,
               "region '{}' rkey of {} bytes accepted", r.name, in.rkey().size());
    FUZZ_CHECK(r.cuda_ipc_handle.empty() || (r.cuda_ipc_handle.size() == 64 && r.cuda_device >= 0),
               "region '{}' cuda handle {} bytes device {}", r.name, r.cuda_ipc_handle.size(),
               r.cuda_device);
    // The planner computes ItemAddress(index) + item_bytes for index < num_items and
    // base + offset + length for byte ranges: all of it must stay inside the region
    // without wrapping.
    FUZZ_CHECK(r.num_items > 0 && r.item_bytes > 0 && r.item_stride >= r.item_bytes &&
                   r.length > 0,
               "region '{}' layout {}x{} stride {} length {}", r.name, r.num_items, r.item_bytes,
               r.item_stride, r.length);
    const unsigned __int128 end = static_cast<unsigned __int128>(r.base_address) + r.length;
    FUZZ_CHECK(end <= ~uint64_t{0}, "region '{}' base {:#x} + length {} wraps", r.name,
               r.base_address, r.length);
    const unsigned __int128 last_end =
        static_cast<unsigned __int128>(r.num_items - 1) * r.item_stride + r.item_bytes;
    FUZZ_CHECK(last_end <= r.length, "region '{}' last item ends at {} beyond length {}", r.name,
               static_cast<uint64_t>(last_end), r.length);
    FUZZ_CHECK(r.ItemAddress(r.num_items - 1) + r.item_bytes == r.base_address + last_end,
               "region '{}' ItemAddress wraps", r.name);
    FUZZ_CHECK(r.role == in.role() && r.role.size() <= limits.max_role_bytes &&
                   !HasControlCharacter(r.role),
               "region '{}': role of {} bytes accepted", r.name, r.role.size());
    FUZZ_CHECK(!HasControlCharacter(r.name) && !HasControlCharacter(r.group),
               "region {}: a name or group with a control character accepted", i);
    FUZZ_CHECK(r.memory != v1::VRAM || r.memory_id == 0,
               "region '{}': VRAM naming host memory object {} accepted", r.name, r.memory_id);
    FUZZ_CHECK(catalog.Find(r.name) == &r, "Find('{}') is not region {}", r.name, i);
    if (!r.group.empty()) ++grouped;
  }
  size_t in_groups = 0;
  for (const std::string& group : catalog.GroupNames()) {
    FUZZ_CHECK(!group.empty(), "empty group name listed");
    const std::vector<const RemoteRegion*> members = catalog.FindGroup(group);
    FUZZ_CHECK(!members.empty(), "group '{}' listed but empty", group);
    std::set<std::string> roles;
    for (size_t p = 0; p < members.size(); ++p) {
      FUZZ_CHECK(members[p]->role.empty() || roles.insert(members[p]->role).second,
                 "group '{}' has role '{}' twice", group, members[p]->role);
      FUZZ_CHECK(members[p] != nullptr && members[p]->group == group &&
                     members[p]->group_position == p,
                 "group '{}' position {} holds the wrong region", group, p);
    }
    in_groups += members.size();
  }
  FUZZ_CHECK(in_groups == grouped, "{} grouped regions but groups hold {}", grouped, in_groups);
  FUZZ_CHECK(catalog.FindGroup("").empty(), "the empty group name finds regions");
}

// The view a delta applies to: a valid catalog of the delta's sender at its base
// version (two KV regions in group kv, one AUX), as the peer manager would hold it.
v1::AgentMetadata Base(const v1::AgentMetadata& delta) {
  v1::AgentMetadata base;
  base.set_name(delta.name());
  base.set_version(delta.base_version());
  base.set_worker_address("w");
  const char* names[] = {"k.L0", "v.L0", "aux"};
  for (int i = 0; i < 3; ++i) {
    v1::ExportedRegion* r = base.add_regions();
    r->set_name(names[i]);
    if (i < 2) {
      r->set_group("kv");
      r->set_group_position(static_cast<uint32_t>(i));
    }
    r->set_base_address(0x10000 * (i + 1));
    r->set_length(4096);
    r->mutable_layout()->set_num_items(16);
    r->mutable_layout()->set_item_bytes(256);
    r->set_rkey("k");
  }
  return base;
}

// A pushed delta against Base: refused with the reason, or a catalog that holds every
// invariant, whose base_slots name each kept region's slot in the base (same region)
// and mark the delta's own, in its order.
void RunDelta(const v1::AgentMetadata& delta, const CatalogLimits& limits) {
  const v1::AgentMetadata base_metadata = Base(delta);
  auto base = RemoteCatalog::FromMetadata(base_metadata, CatalogLimits{});
  if (!base.ok()) return;  // a sender name no catalog may have
  auto applied = base->ApplyDelta(delta, limits);
  if (!applied.ok()) {
    CheckRejection(applied.status());
    return;
  }
  const RemoteCatalog& result = applied->catalog;
  FUZZ_CHECK(result.version() == delta.version() && delta.version() > delta.base_version(),
             "delta to version {} from {} gave version {}", delta.version(), delta.base_version(),
             result.version());
  FUZZ_CHECK(applied->base_slots.size() == result.regions().size(), "{} base slots for {} regions",
             applied->base_slots.size(), result.regions().size());
  int added = 0;
  for (size_t i = 0; i < applied->base_slots.size(); ++i) {
    const uint32_t slot = applied->base_slots[i];
    if (slot == registry::AppliedDelta::kNew) {
      FUZZ_CHECK(added < delta.regions_size() &&
                     result.regions()[i].name == delta.regions(added).name(),
                 "region {} is not the delta's region {}", i, added);
      ++added;
      continue;
    }
    FUZZ_CHECK(added == 0 && slot < base->regions().size() &&
                   result.regions()[i].name == base->regions()[slot].name,
               "region {} claims base slot {} after {} new ones", i, slot, added);
  }
  FUZZ_CHECK(added == delta.regions_size(), "{} of the delta's {} regions kept", added,
             delta.regions_size());
  CheckRegions(result, limits, [&](size_t i) -> const v1::ExportedRegion& {
    const uint32_t slot = applied->base_slots[i];
    if (slot != registry::AppliedDelta::kNew) return base_metadata.regions(static_cast<int>(slot));
    return delta.regions(static_cast<int>(i - (applied->base_slots.size() - delta.regions_size())));
  });
}

void Run(const v1::AgentMetadata& metadata, const CatalogLimits& limits) {
  if (metadata.delta()) RunDelta(metadata, limits);
  auto catalog = RemoteCatalog::FromMetadata(metadata, limits);
  if (!catalog.ok()) {
    CheckRejection(catalog.status());
    return;
  }
  CheckCatalog(metadata, *catalog, limits);
}

}  // namespace

const google::protobuf::Message& InputPrototype() { return v1::AgentMetadata::default_instance(); }
const char* TargetName() { return "metadata"; }

}  // namespace kvagent::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvagent::v1::AgentMetadata metadata;
  if (!metadata.ParseFromArray(data, static_cast<int>(size))) return 0;
  kvagent::fuzz::Run(metadata, kvagent::registry::CatalogLimits{});  // what the agent uses
  kvagent::registry::CatalogLimits tight;
  tight.max_regions = 4;
  tight.max_rkey_bytes = 8;
  tight.max_name_bytes = 8;
  tight.max_worker_address_bytes = 8;
  tight.max_role_bytes = 4;
  kvagent::fuzz::Run(metadata, tight);
  return 0;
}
