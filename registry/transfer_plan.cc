#include "registry/transfer_plan.h"

#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "fmt/format.h"

namespace kvagent::registry {
namespace {

// "a, b, c" (at most 16 names, then "and N more"): enough to spot a typo without
// flooding the message when a peer exports thousands of regions.
std::string KnownNames(const std::vector<std::string>& names) {
  if (names.empty()) return "none";
  constexpr size_t kShown = 16;
  std::string out;
  for (size_t i = 0; i < names.size() && i < kShown; ++i) {
    if (i > 0) out += ", ";
    out += "'" + names[i] + "'";
  }
  if (names.size() > kShown) out += fmt::format(" and {} more", names.size() - kShown);
  return out;
}

// [offset, offset+length) inside a region of `size` bytes, without overflow.
bool RangeFits(uint64_t offset, uint64_t length, uint64_t size) {
  return offset <= size && length <= size - offset;
}

absl::Status PlanItems(const RegionRegistry& local, const RemoteCatalog& remote,
                       const v1::ItemSegment& seg, uint32_t number, TransferPlan* plan,
                       absl::flat_hash_set<const Region*>* pinned) {
  const std::vector<RegionPtr> lgroup = local.FindGroup(seg.local_group());
  if (lgroup.empty()) {
    return absl::NotFoundError(fmt::format(
        "segment {}: local group '{}' is not registered (known groups: {}); register it "
        "or fix local_group",
        number, seg.local_group(), KnownNames(local.GroupNames())));
  }
  const std::vector<const RemoteRegion*> rgroup = remote.FindGroup(seg.remote_group());
  if (rgroup.empty()) {
    return absl::NotFoundError(fmt::format(
        "segment {}: peer '{}' exports no group '{}' (known groups: {}); fix remote_group "
        "or register it on the peer",
        number, remote.peer(), seg.remote_group(), KnownNames(remote.GroupNames())));
  }
  if (lgroup.size() != rgroup.size()) {
    return absl::InvalidArgumentError(fmt::format(
        "segment {}: local group '{}' has {} regions but peer '{}' group '{}' has {}; groups "
        "pair position by position, so register the same regions on both sides",
        number, seg.local_group(), lgroup.size(), remote.peer(), seg.remote_group(),
        rgroup.size()));
  }
  const auto& li = seg.local_indices();
  const auto& ri = seg.remote_indices();
  if (li.empty() || li.size() != ri.size()) {
    return absl::InvalidArgumentError(fmt::format(
        "segment {}: {} local indices and {} remote indices; give equal, non-empty lists",
        number, li.size(), ri.size()));
  }
  // Region-major order so that consecutive indices of one region end up adjacent
  // and Coalesce can merge them.
  for (size_t p = 0; p < lgroup.size(); ++p) {
    const Region& l = *lgroup[p];
    const RemoteRegion& r = *rgroup[p];
    if (l.item_bytes() != r.item_bytes) {
      return absl::InvalidArgumentError(fmt::format(
          "segment {}: group position {}: local region '{}' has {}-byte items but peer "
          "'{}' region '{}' has {}-byte items; pair groups whose layouts match",
          number, p, l.spec.name(), l.item_bytes(), remote.peer(), r.name, r.item_bytes));
    }
    for (int k = 0; k < li.size(); ++k) {
      if (li[k] >= l.num_items()) {
        return absl::InvalidArgumentError(fmt::format(
            "segment {}: local index {} at position {} is out of range for region '{}' "
            "(num_items {}); use indices below num_items",
            number, li[k], k, l.spec.name(), l.num_items()));
      }
      if (ri[k] >= r.num_items) {
        return absl::InvalidArgumentError(fmt::format(
            "segment {}: remote index {} at position {} is out of range for peer '{}' "
            "region '{}' (num_items {}); use indices below num_items",
            number, ri[k], k, remote.peer(), r.name, r.num_items));
      }
      plan->ops.push_back(PlanOp{l.ItemAddress(li[k]), r.ItemAddress(ri[k]), l.item_bytes(),
                                 r.rkey_slot, number, l.spec.memory() == v1::VRAM,
                                 r.memory == v1::VRAM});
      plan->bytes += l.item_bytes();
    }
    if (pinned->insert(lgroup[p].get()).second) plan->local_regions.push_back(lgroup[p]);
  }
  plan->items += static_cast<uint64_t>(li.size());
  return absl::OkStatus();
}

absl::Status PlanBytes(const RegionRegistry& local, const RemoteCatalog& remote,
                       const v1::ByteSegment& seg, uint32_t number, TransferPlan* plan,
                       absl::flat_hash_set<const Region*>* pinned) {
  RegionPtr l = local.Find(seg.local_region());
  if (l == nullptr) {
    std::vector<std::string> names;
    for (const RegionPtr& region : local.List()) names.push_back(region->spec.name());
    return absl::NotFoundError(fmt::format(
        "segment {}: local region '{}' is not registered (known regions: {}); register it "
        "or fix local_region",
        number, seg.local_region(), KnownNames(names)));
  }
  const RemoteRegion* r = remote.Find(seg.remote_region());
  if (r == nullptr) {
    std::vector<std::string> names;
    for (const RemoteRegion& region : remote.regions()) names.push_back(region.name);
    return absl::NotFoundError(fmt::format(
        "segment {}: peer '{}' exports no region '{}' (known regions: {}); fix "
        "remote_region or register it on the peer",
        number, remote.peer(), seg.remote_region(), KnownNames(names)));
  }
  if (seg.length() == 0) {
    return absl::InvalidArgumentError(fmt::format(
        "segment {}: byte segment has length 0; give the number of bytes to move", number));
  }
  if (!RangeFits(seg.local_offset(), seg.length(), l->spec.length())) {
    return absl::InvalidArgumentError(fmt::format(
        "segment {}: bytes [{}, +{}) are outside local region '{}' of {} bytes; keep "
        "offset + length within the region",
        number, seg.local_offset(), seg.length(), seg.local_region(), l->spec.length()));
  }
  if (!RangeFits(seg.remote_offset(), seg.length(), r->length)) {
    return absl::InvalidArgumentError(fmt::format(
        "segment {}: bytes [{}, +{}) are outside peer '{}' region '{}' of {} bytes; keep "
        "offset + length within the region",
        number, seg.remote_offset(), seg.length(), remote.peer(), r->name, r->length));
  }
  plan->ops.push_back(PlanOp{l->base_address + seg.local_offset(),
                             r->base_address + seg.remote_offset(), seg.length(), r->rkey_slot,
                             number, l->spec.memory() == v1::VRAM, r->memory == v1::VRAM});
  plan->bytes += seg.length();
  if (pinned->insert(l.get()).second) plan->local_regions.push_back(std::move(l));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TransferPlan> PlanTransfer(
    const RegionRegistry& local, const RemoteCatalog& remote,
    const google::protobuf::RepeatedPtrField<v1::Segment>& segments, uint32_t first_segment) {
  TransferPlan plan;
  absl::flat_hash_set<const Region*> pinned;
  for (int i = 0; i < segments.size(); ++i) {
    const uint32_t number = first_segment + static_cast<uint32_t>(i);
    const v1::Segment& segment = segments[i];
    absl::Status status;
    switch (segment.kind_case()) {
      case v1::Segment::kItems:
        status = PlanItems(local, remote, segment.items(), number, &plan, &pinned);
        break;
      case v1::Segment::kBytes:
        status = PlanBytes(local, remote, segment.bytes(), number, &plan, &pinned);
        break;
      default:
        status = absl::InvalidArgumentError(fmt::format(
            "segment {}: empty segment; set either items or bytes", number));
    }
    if (!status.ok()) return status;
  }
  Coalesce(&plan.ops);
  return plan;
}

void Coalesce(std::vector<PlanOp>* ops) {
  if (ops->empty()) return;
  size_t out = 0;
  for (size_t i = 1; i < ops->size(); ++i) {
    PlanOp& last = (*ops)[out];
    const PlanOp& next = (*ops)[i];
    // Equal device flags: a host and a device address can be numerically adjacent.
    if (next.segment == last.segment && next.rkey_slot == last.rkey_slot &&
        next.local_device == last.local_device &&
        last.local_address + last.length == next.local_address &&
        last.remote_address + last.length == next.remote_address) {
      last.length += next.length;
    } else {
      (*ops)[++out] = next;
    }
  }
  ops->resize(out + 1);
}

}  // namespace kvagent::registry
