#include "planning/transfer_plan.h"

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "base/text.h"
#include "fmt/format.h"

namespace kvagent::planning {

using registry::Region;
using registry::RegionPtr;
using registry::RegionRegistry;
using registry::RemoteCatalog;
using registry::RemoteRegion;
namespace {

// At most this many names in one list: enough to spot a typo without flooding the
// message when a peer exports thousands of regions.
constexpr size_t kShown = 16;

// "'a', 'b', 'c'" (escaped, bounded; then "and N more"), or "none".
std::string QuotedList(const std::vector<std::string>& names) {
  if (names.empty()) return "none";
  std::string out;
  for (size_t i = 0; i < names.size() && i < kShown; ++i) {
    if (i > 0) out += ", ";
    out += "'" + Printable(names[i]) + "'";
  }
  if (names.size() > kShown) out += fmt::format(" and {} more", names.size() - kShown);
  return out;
}

// [offset, offset+length) inside a region of `size` bytes, without overflow.
bool RangeFits(uint64_t offset, uint64_t length, uint64_t size) {
  return offset <= size && length <= size - offset;
}

struct RegionPair {
  RegionPtr local;
  const RemoteRegion* remote = nullptr;
};

// How the regions of one local group pair with those of one remote group; the same
// for every segment that names both, so planned once per transfer chunk.
struct GroupPairing {
  absl::InlinedVector<RegionPair, 2> pairs;  // in the local group's order
  // The region with the fewest items on each side: indices are checked against it.
  const Region* local_bound = nullptr;
  const RemoteRegion* remote_bound = nullptr;
};

// A destination item that an item segment writes (in every region of the group).
struct ItemWrite {
  uint64_t index = 0;
  uint32_t segment = 0;
  uint32_t position = 0;  // in the segment's index list
};

// A destination byte range that a byte segment writes.
struct ByteWrite {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint32_t segment = 0;
};

// Byte segments' writes into one destination region, with its layout, so they can
// be checked against the items that item segments write into it. (The names here and
// in the planner's keys view the request's, the registry's and the catalog's strings,
// which outlive the planner: planning copies no name.)
struct RegionWrites {
  std::string_view group;
  uint64_t item_bytes = 0;
  uint64_t item_stride = 0;
  std::vector<ByteWrite> writes;
};

// The first region of a destination group (named in messages) and the group. A
// one-page segment's writes fit inline (no allocation).
struct GroupWrites {
  std::string_view first_region;
  absl::InlinedVector<ItemWrite, 4> writes;
};

constexpr char kItemFix[] =
    "name each destination item once per transfer: drop the repeated index, or move it to "
    "a later transfer that starts after this one ends";
constexpr char kByteFix[] =
    "write each destination byte once per transfer: trim or merge the ranges, or move one "
    "to a later transfer that starts after this one ends";

class Planner {
 public:
  Planner(const RegionRegistry& local, const RemoteCatalog& remote, v1::TransferOp op,
          uint64_t max_ops)
      : local_(local), remote_(remote), read_(op == v1::READ), max_ops_(max_ops) {}

  absl::Status Items(const v1::ItemSegment& seg, uint32_t number);
  absl::Status Bytes(const v1::ByteSegment& seg, uint32_t number);
  // Refuses a plan that writes a destination byte twice (see PlanTransfer).
  absl::Status CheckDestinations();

  TransferPlan& plan() { return plan_; }

 private:
  absl::StatusOr<GroupPairing> PairGroups(const std::string& local_group,
                                          const std::string& remote_group) const;
  void Pin(RegionPtr region) {
    // A few regions (the usual plan) are looked up in the plan's list, without a set.
    if (pinned_.empty()) {
      for (const RegionPtr& held : plan_.local_regions) {
        if (held == region) return;
      }
      if (plan_.local_regions.size() < kPinnedListed) {
        plan_.local_regions.push_back(std::move(region));
        return;
      }
      for (const RegionPtr& held : plan_.local_regions) pinned_.insert(held.get());
    }
    if (pinned_.insert(region.get()).second) plan_.local_regions.push_back(std::move(region));
  }
  // The pairing of a (local group, remote group), made once per plan: the first pair
  // inline (a request usually names one), the others in pairings_.
  const absl::StatusOr<GroupPairing>& Pairing(const std::string& local_group,
                                              const std::string& remote_group);
  // How messages name the destination side's index and region.
  const char* DestinationIndex() const { return read_ ? "local index" : "remote index"; }
  std::string DestinationRegion(std::string_view region) const {
    return read_
               ? fmt::format("local region '{}'", Printable(region))
               : fmt::format("peer '{}' region '{}'", Printable(remote_.peer()), Printable(region));
  }

  const RegionRegistry& local_;
  const RemoteCatalog& remote_;
  // Refuses, before building them, operations past max_ops_ (RESOURCE_EXHAUSTED).
  // `how` says what expands to `more` operations; called only when refusing (the
  // success path formats nothing).
  absl::Status Room(uint64_t more, uint32_t number,
                    absl::FunctionRef<std::string()> how) const;

  const bool read_;  // READ: the local side is written; WRITE: the peer's
  const uint64_t max_ops_;
  TransferPlan plan_;
  // Past kPinnedListed regions, the ones in plan_.local_regions (else empty).
  static constexpr size_t kPinnedListed = 8;
  absl::flat_hash_set<const Region*> pinned_;
  struct FirstPairing {
    std::string_view local_group;
    std::string_view remote_group;
    absl::StatusOr<GroupPairing> pairing;
  };
  std::optional<FirstPairing> first_pairing_;
  absl::flat_hash_map<std::pair<std::string_view, std::string_view>, absl::StatusOr<GroupPairing>>
      pairings_;
  // Destinations written, by group (item segments) and by region (byte segments);
  // ordered maps so that the reported duplicate does not depend on hashing.
  std::map<std::string_view, GroupWrites> item_writes_;
  std::map<std::string_view, RegionWrites> byte_writes_;
};

const absl::StatusOr<GroupPairing>& Planner::Pairing(const std::string& local_group,
                                                     const std::string& remote_group) {
  if (!first_pairing_) {
    first_pairing_.emplace(FirstPairing{local_group, remote_group,
                                        PairGroups(local_group, remote_group)});
    return first_pairing_->pairing;
  }
  if (first_pairing_->local_group == local_group && first_pairing_->remote_group == remote_group) {
    return first_pairing_->pairing;
  }
  auto [cached, inserted] = pairings_.try_emplace(
      std::pair<std::string_view, std::string_view>(local_group, remote_group),
      absl::UnknownError(""));
  if (inserted) cached->second = PairGroups(local_group, remote_group);
  return cached->second;
}

absl::StatusOr<GroupPairing> Planner::PairGroups(const std::string& local_group,
                                                 const std::string& remote_group) const {
  const std::vector<RegionPtr> lgroup = local_.FindGroup(local_group);
  if (lgroup.empty()) {
    return absl::NotFoundError(
        fmt::format("local group '{}' is not registered (known groups: {}); register it or fix "
                    "local_group",
                    Printable(local_group), QuotedList(local_.GroupNames())));
  }
  absl::InlinedVector<const RemoteRegion*, 8> rgroup;
  for (uint32_t slot : remote_.GroupSlots(remote_group)) rgroup.push_back(&remote_.regions()[slot]);
  if (rgroup.empty()) {
    return absl::NotFoundError(fmt::format(
        "peer '{}' exports no group '{}' (known groups: {}); fix remote_group or register it "
        "on the peer",
        Printable(remote_.peer()), Printable(remote_group), QuotedList(remote_.GroupNames())));
  }
  // The groups' names and the regions without a role are formatted only for an error
  // (PairGroups runs for every transfer).
  auto lname = [&] { return fmt::format("local group '{}'", Printable(local_group)); };
  auto rname = [&] {
    return fmt::format("peer '{}' group '{}'", Printable(remote_.peer()), Printable(remote_group));
  };
  size_t local_unroled = 0;
  size_t remote_unroled = 0;
  for (const RegionPtr& l : lgroup) local_unroled += l->spec.role().empty() ? 1 : 0;
  for (const RemoteRegion* r : rgroup) remote_unroled += r->role.empty() ? 1 : 0;
  const bool local_roles = local_unroled == 0;
  const bool remote_roles = remote_unroled == 0;
  const bool no_roles = local_unroled == lgroup.size() && remote_unroled == rgroup.size();

  GroupPairing pairing;
  pairing.pairs.reserve(lgroup.size());
  if (no_roles) {
    // Neither side says what its regions hold: position by position.
    if (lgroup.size() != rgroup.size()) {
      return absl::InvalidArgumentError(fmt::format(
          "{} has {} regions but {} has {}; groups without roles pair position by "
          "position, so register the same regions on both sides (or set RegionSpec.role on "
          "every region of both to pair them by role)",
          lname(), lgroup.size(), rname(), rgroup.size()));
    }
    for (size_t p = 0; p < lgroup.size(); ++p) pairing.pairs.push_back({lgroup[p], rgroup[p]});
  } else if (local_roles && remote_roles) {
    absl::flat_hash_map<std::string, const RemoteRegion*> by_role;
    for (const RemoteRegion* r : rgroup) by_role.emplace(r->role, r);  // unique: RemoteCatalog
    absl::flat_hash_map<std::string, const Region*> local_by_role;
    std::vector<std::string> only_local;
    for (const RegionPtr& l : lgroup) {
      const std::string& role = l->spec.role();
      if (auto [it, inserted] = local_by_role.emplace(role, l.get()); !inserted) {
        // RegionRegistry refuses this; checked so that a pairing is never ambiguous.
        return absl::InvalidArgumentError(fmt::format(
            "{} declares role '{}' on regions '{}' and '{}'; deregister one and register it "
            "with its own role",
            lname(), Printable(role), Printable(it->second->spec.name()),
            Printable(l->spec.name())));
      }
      auto it = by_role.find(role);
      if (it == by_role.end()) {
        only_local.push_back(role);
      } else {
        pairing.pairs.push_back({l, it->second});
      }
    }
    std::vector<std::string> only_remote;
    for (const RemoteRegion* r : rgroup) {
      if (!local_by_role.contains(r->role)) only_remote.push_back(r->role);
    }
    if (!only_local.empty() || !only_remote.empty()) {
      return absl::InvalidArgumentError(
          fmt::format("{} and {} declare different roles (only local: {}; only on the peer: {}); "
                      "regions pair by role, so register the same roles on both sides",
                      lname(), rname(), QuotedList(only_local), QuotedList(only_remote)));
    }
  } else {
    // Some regions say what they hold and others do not: pairing by position could
    // silently swap layers, pairing by role cannot name them all.
    std::vector<std::string> local_names;
    std::vector<std::string> remote_names;
    for (const RegionPtr& l : lgroup) {
      if (l->spec.role().empty()) local_names.push_back(l->spec.name());
    }
    for (const RemoteRegion* r : rgroup) {
      if (r->role.empty()) remote_names.push_back(r->name);
    }
    std::vector<std::string> lacking;
    if (!local_roles) {
      lacking.push_back(fmt::format("{} (no role on {})", lname(), QuotedList(local_names)));
    }
    if (!remote_roles) {
      lacking.push_back(fmt::format("{} (no role on {})", rname(), QuotedList(remote_names)));
    }
    return absl::InvalidArgumentError(fmt::format(
        "{} declares a role on {} of its {} regions and {} on {} of {}; both sides must "
        "declare roles to pair regions by role: set RegionSpec.role on every region of {}, "
        "or on no region of either group to pair them by position",
        lname(), lgroup.size() - local_unroled, lgroup.size(), rname(),
        rgroup.size() - remote_unroled, rgroup.size(), fmt::join(lacking, " and of ")));
  }

  for (size_t p = 0; p < pairing.pairs.size(); ++p) {
    const Region& l = *pairing.pairs[p].local;
    const RemoteRegion& r = *pairing.pairs[p].remote;
    if (l.item_bytes() != r.item_bytes) {
      return absl::InvalidArgumentError(fmt::format(
          "{}: local region '{}' has {}-byte items but peer '{}' region '{}' has {}-byte "
          "items; pair groups whose layouts match",
          no_roles ? fmt::format("group position {}", p)
                   : fmt::format("role '{}'", Printable(l.spec.role())),
          Printable(l.spec.name()), l.item_bytes(), Printable(remote_.peer()), Printable(r.name),
          r.item_bytes));
    }
    if (pairing.local_bound == nullptr || l.num_items() < pairing.local_bound->num_items()) {
      pairing.local_bound = &l;
    }
    if (pairing.remote_bound == nullptr || r.num_items < pairing.remote_bound->num_items) {
      pairing.remote_bound = &r;
    }
  }
  return pairing;
}

absl::Status Planner::Items(const v1::ItemSegment& seg, uint32_t number) {
  const absl::StatusOr<GroupPairing>& cached = Pairing(seg.local_group(), seg.remote_group());
  if (!cached.ok()) {
    const absl::Status& status = cached.status();
    return absl::Status(status.code(),
                        fmt::format("segment {}: {}", number, std::string(status.message())));
  }
  const GroupPairing& pairing = *cached;
  const auto& li = seg.local_indices();
  const auto& ri = seg.remote_indices();
  if (li.empty() || li.size() != ri.size()) {
    return absl::InvalidArgumentError(fmt::format(
        "segment {}: {} local indices and {} remote indices; give equal, non-empty lists", number,
        li.size(), ri.size()));
  }
  // Regions of a local group share num_items (RegionRegistry); a peer's may not, so
  // every index is checked against the smallest region of each side.
  const Region& lb = *pairing.local_bound;
  const RemoteRegion& rb = *pairing.remote_bound;
  for (int k = 0; k < li.size(); ++k) {
    if (li[k] >= lb.num_items()) {
      return absl::InvalidArgumentError(
          fmt::format("segment {}: local index {} at position {} is out of range for region '{}' "
                      "(num_items {}); use indices below num_items",
                      number, li[k], k, Printable(lb.spec.name()), lb.num_items()));
    }
  }
  for (int k = 0; k < ri.size(); ++k) {
    if (ri[k] >= rb.num_items) {
      return absl::InvalidArgumentError(fmt::format(
          "segment {}: remote index {} at position {} is out of range for peer '{}' region "
          "'{}' (num_items {}); use indices below num_items",
          number, ri[k], k, Printable(remote_.peer()), Printable(rb.name), rb.num_items));
    }
  }
  // Each destination index is written in every region of the destination group, so
  // duplicates are found per group (CheckDestinations), not per operation.
  const std::string& destination = read_ ? seg.local_group() : seg.remote_group();
  GroupWrites& group = item_writes_[destination];
  if (group.first_region.empty()) {
    group.first_region =
        read_ ? pairing.pairs[0].local->spec.name() : pairing.pairs[0].remote->name;
  }
  const auto& di = read_ ? li : ri;
  group.writes.reserve(group.writes.size() + di.size());
  for (int k = 0; k < di.size(); ++k) {
    group.writes.push_back(ItemWrite{di[k], number, static_cast<uint32_t>(k)});
  }
  // Region-major order so that consecutive indices of one region end up adjacent
  // and Coalesce can merge them.
  const uint64_t more = static_cast<uint64_t>(pairing.pairs.size()) * li.size();
  if (absl::Status room = Room(more, number,
                               [&] {
                                 return fmt::format("{} regions x {} indices",
                                                    pairing.pairs.size(), li.size());
                               });
      !room.ok()) {
    return room;
  }
  plan_.ops.reserve(plan_.ops.size() + more);
  for (const RegionPair& pair : pairing.pairs) {
    const Region& l = *pair.local;
    const RemoteRegion& r = *pair.remote;
    const bool local_device = l.spec.memory() == v1::VRAM;
    const bool remote_device = r.memory == v1::VRAM;
    for (int k = 0; k < li.size(); ++k) {
      plan_.ops.push_back(PlanOp{l.ItemAddress(li[k]), r.ItemAddress(ri[k]), l.item_bytes(),
                                 r.rkey_slot, number, local_device, remote_device});
    }
    plan_.bytes += l.item_bytes() * static_cast<uint64_t>(li.size());
    Pin(pair.local);
  }
  plan_.items += static_cast<uint64_t>(li.size());
  return absl::OkStatus();
}

absl::Status Planner::Room(uint64_t more, uint32_t number,
                           absl::FunctionRef<std::string()> how) const {
  if (plan_.ops.size() <= max_ops_ && more <= max_ops_ - plan_.ops.size()) return absl::OkStatus();
  return absl::ResourceExhaustedError(fmt::format(
      "segment {}: the chunk expands to {} operations ({} in the segments before it, {} "
      "here: {}), over the limit ops_per_chunk ({} operations); split the transfer into "
      "chunks (more_chunks) or raise --max-ops-per-chunk on the agent (docs/LIMITS.md)",
      number, plan_.ops.size() + more, plan_.ops.size(), more, how(), max_ops_));
}

absl::Status Planner::Bytes(const v1::ByteSegment& seg, uint32_t number) {
  if (absl::Status room = Room(1, number, [] { return std::string("a byte segment"); });
      !room.ok()) {
    return room;
  }
  RegionPtr l = local_.Find(seg.local_region());
  if (l == nullptr) {
    std::vector<std::string> names;
    for (const RegionPtr& region : local_.List()) names.push_back(region->spec.name());
    return absl::NotFoundError(fmt::format(
        "segment {}: local region '{}' is not registered (known regions: {}); register it "
        "or fix local_region",
        number, Printable(seg.local_region()), QuotedList(names)));
  }
  const RemoteRegion* r = remote_.Find(seg.remote_region());
  if (r == nullptr) {
    std::vector<std::string> names;
    for (const RemoteRegion& region : remote_.regions()) names.push_back(region.name);
    return absl::NotFoundError(fmt::format(
        "segment {}: peer '{}' exports no region '{}' (known regions: {}); fix "
        "remote_region or register it on the peer",
        number, Printable(remote_.peer()), Printable(seg.remote_region()), QuotedList(names)));
  }
  if (seg.length() == 0) {
    return absl::InvalidArgumentError(fmt::format(
        "segment {}: byte segment has length 0; give the number of bytes to move", number));
  }
  if (!RangeFits(seg.local_offset(), seg.length(), l->spec.length())) {
    return absl::InvalidArgumentError(fmt::format(
        "segment {}: bytes [{}, +{}) are outside local region '{}' of {} bytes; keep "
        "offset + length within the region",
        number, seg.local_offset(), seg.length(), Printable(seg.local_region()), l->spec.length()));
  }
  if (!RangeFits(seg.remote_offset(), seg.length(), r->length)) {
    return absl::InvalidArgumentError(fmt::format(
        "segment {}: bytes [{}, +{}) are outside peer '{}' region '{}' of {} bytes; keep "
        "offset + length within the region",
        number, seg.remote_offset(), seg.length(), Printable(remote_.peer()), Printable(r->name),
        r->length));
  }
  RegionWrites& writes = byte_writes_[read_ ? l->spec.name() : r->name];
  if (writes.writes.empty()) {
    writes.group = read_ ? l->spec.group() : r->group;
    writes.item_bytes = read_ ? l->item_bytes() : r->item_bytes;
    writes.item_stride = read_ ? l->item_stride() : r->item_stride;
  }
  const uint64_t offset = read_ ? seg.local_offset() : seg.remote_offset();
  writes.writes.push_back(ByteWrite{offset, offset + seg.length(), number});

  plan_.ops.push_back(PlanOp{l->base_address + seg.local_offset(),
                             r->base_address + seg.remote_offset(), seg.length(), r->rkey_slot,
                             number, l->spec.memory() == v1::VRAM, r->memory == v1::VRAM});
  plan_.bytes += seg.length();
  Pin(std::move(l));
  return absl::OkStatus();
}

absl::Status Planner::CheckDestinations() {
  // Of all the bytes written twice, the one whose later write comes first in the
  // request is reported; the message is formatted for that one only.
  struct Finding {
    uint32_t segment = UINT32_MAX;  // of the later write
    uint32_t position = UINT32_MAX;
    std::function<std::string()> message;
  } first;
  auto found = [&first](uint32_t segment, uint32_t position, std::function<std::string()> message) {
    if (std::pair(segment, position) < std::pair(first.segment, first.position)) {
      first = Finding{segment, position, std::move(message)};
    }
  };
  // Items: every region of the destination group receives each index it names.
  for (auto& entry : item_writes_) {
    const std::string_view group = entry.first;
    GroupWrites& writes = entry.second;
    std::sort(writes.writes.begin(), writes.writes.end(),
              [](const ItemWrite& a, const ItemWrite& b) {
                return std::tie(a.index, a.segment, a.position) <
                       std::tie(b.index, b.segment, b.position);
              });
    for (size_t i = 1; i < writes.writes.size(); ++i) {
      const ItemWrite& earlier = writes.writes[i - 1];
      const ItemWrite& later = writes.writes[i];
      if (earlier.index != later.index) continue;
      found(later.segment, later.position, [this, group, &writes, earlier, later] {
        const std::string where =
            later.segment == earlier.segment
                ? fmt::format("appears at positions {} and {}", earlier.position, later.position)
                : fmt::format("(position {}) repeats segment {}'s {} {} (position {})",
                              later.position, earlier.segment, DestinationIndex(), earlier.index,
                              earlier.position);
        return fmt::format(
            "segment {}: {} {} {}: item {} of {} (and of every region of its group '{}') would "
            "be written twice in one transfer, and which write lands is undefined; {}",
            later.segment, DestinationIndex(), later.index, where, later.index,
            DestinationRegion(writes.first_region), Printable(group), kItemFix);
      });
    }
  }

  for (auto& entry : byte_writes_) {
    const std::string_view region = entry.first;
    RegionWrites& writes = entry.second;
    std::sort(writes.writes.begin(), writes.writes.end(),
              [](const ByteWrite& a, const ByteWrite& b) {
                return std::tie(a.begin, a.segment) < std::tie(b.begin, b.segment);
              });
    // Byte segments among themselves: the range reaching furthest so far is the one a
    // later range can overlap.
    const ByteWrite* widest = nullptr;
    for (const ByteWrite& write : writes.writes) {
      if (widest != nullptr && write.begin < widest->end) {
        const ByteWrite& earlier = widest->segment < write.segment ? *widest : write;
        const ByteWrite& later = widest->segment < write.segment ? write : *widest;
        const uint64_t end = std::min(widest->end, write.end);
        found(later.segment, 0, [this, region, earlier, later, begin = write.begin, end] {
          return fmt::format(
              "segment {}: bytes [{}, {}) of {} overlap bytes [{}, {}) that segment {} writes: "
              "bytes [{}, {}) would be written twice in one transfer, and which write lands is "
              "undefined; {}",
              later.segment, later.begin, later.end, DestinationRegion(region), earlier.begin,
              earlier.end, earlier.segment, begin, end, kByteFix);
        });
      }
      if (widest == nullptr || write.end > widest->end) widest = &write;
    }
    // Byte segments against the items that item segments write into this region.
    if (writes.group.empty()) continue;
    auto group = item_writes_.find(writes.group);
    if (group == item_writes_.end()) continue;
    const auto& items = group->second.writes;  // sorted by index above
    const uint64_t stride = writes.item_stride;
    const uint64_t item_bytes = writes.item_bytes;
    for (const ByteWrite& write : writes.writes) {
      // Item i covers [i * stride, i * stride + item_bytes): it meets [begin, end) when
      // lo <= i <= hi.
      const uint64_t lo = write.begin < item_bytes ? 0 : (write.begin - item_bytes) / stride + 1;
      const uint64_t hi = (write.end - 1) / stride;
      if (lo > hi) continue;
      auto it =
          std::lower_bound(items.begin(), items.end(), lo,
                           [](const ItemWrite& w, uint64_t index) { return w.index < index; });
      if (it == items.end() || it->index > hi) continue;
      const ItemWrite item = *it;
      const uint64_t item_begin = item.index * stride;
      const uint64_t item_end = item_begin + item_bytes;
      const uint64_t begin = std::max(item_begin, write.begin);
      const uint64_t end = std::min(item_end, write.end);
      const bool item_later = item.segment > write.segment;
      found(item_later ? item.segment : write.segment, item_later ? item.position : 0,
            [this, region, item, write, item_begin, item_end, begin, end, item_later] {
              const std::string item_text =
                  fmt::format("item {} (bytes [{}, {}), {} {} at position {})", item.index,
                              item_begin, item_end, DestinationIndex(), item.index, item.position);
              const std::string bytes_text = fmt::format("bytes [{}, {})", write.begin, write.end);
              return fmt::format(
                  "segment {}: {} of {} overlaps {} that segment {} writes: bytes [{}, {}) would "
                  "be written twice in one transfer, and which write lands is undefined; {}",
                  item_later ? item.segment : write.segment, item_later ? item_text : bytes_text,
                  DestinationRegion(region), item_later ? bytes_text : item_text,
                  item_later ? write.segment : item.segment, begin, end, kByteFix);
            });
    }
  }
  if (first.message) return absl::InvalidArgumentError(first.message());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TransferPlan> PlanTransfer(
    const RegionRegistry& local, const RemoteCatalog& remote,
    const google::protobuf::RepeatedPtrField<v1::Segment>& segments, uint32_t first_segment,
    v1::TransferOp op, uint64_t max_ops) {
  if (op != v1::WRITE && op != v1::READ) {
    return absl::InvalidArgumentError(fmt::format(
        "transfer op {} is neither WRITE nor READ; set op to WRITE (push local items into the "
        "peer's) or READ (pull the peer's items into local ones)",
        static_cast<int>(op)));
  }
  Planner planner(local, remote, op, max_ops);
  for (int i = 0; i < segments.size(); ++i) {
    const uint32_t number = first_segment + static_cast<uint32_t>(i);
    const v1::Segment& segment = segments[i];
    absl::Status status;
    switch (segment.kind_case()) {
      case v1::Segment::kItems:
        status = planner.Items(segment.items(), number);
        break;
      case v1::Segment::kBytes:
        status = planner.Bytes(segment.bytes(), number);
        break;
      default:
        status = absl::InvalidArgumentError(
            fmt::format("segment {}: empty segment; set either items or bytes", number));
    }
    if (!status.ok()) return status;
  }
  if (absl::Status status = planner.CheckDestinations(); !status.ok()) return status;
  TransferPlan plan = std::move(planner.plan());
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

}  // namespace kvagent::planning
