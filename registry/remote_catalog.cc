#include "registry/remote_catalog.h"

#include <algorithm>
#include <string_view>

#include "absl/status/status.h"
#include "base/text.h"
#include "fmt/format.h"

namespace kvagent::registry {
namespace {

constexpr char kFix[] = "the peer sent malformed metadata; upgrade or restart that agent";


// Checks one exported region (every field a peer sends is bounded here) and returns
// it at slot `index`. `index` also names it in errors.
absl::StatusOr<RemoteRegion> ParseRegion(const v1::ExportedRegion& in, uint32_t index,
                                         const std::string& peer, const CatalogLimits& limits) {
  auto bad = [&](const std::string& cause) {
    return absl::InvalidArgumentError(fmt::format("peer '{}' region '{}' (index {}): {}; {}",
                                                  peer, Printable(in.name()), index, cause, kFix));
  };
  if (in.name().empty() || in.name().size() > limits.max_name_bytes) {
    return bad(fmt::format("name is {} bytes (allowed 1..{})", in.name().size(),
                           limits.max_name_bytes));
  }
  if (in.group().size() > limits.max_name_bytes) {
    return bad(fmt::format("group is {} bytes (at most {})", in.group().size(),
                           limits.max_name_bytes));
  }
  if (in.role().size() > limits.max_role_bytes) {
    return bad(fmt::format("role is {} bytes (at most {})", in.role().size(),
                           limits.max_role_bytes));
  }
  if (HasControlCharacter(in.role())) {
    return bad(fmt::format("role '{}' holds a NUL or control character", Printable(in.role())));
  }
  // As this agent's own registry refuses them: a name is logged and shown to operators.
  if (HasControlCharacter(in.name()) || HasControlCharacter(in.group())) {
    return bad(fmt::format("name or group '{}' holds a NUL or control character",
                           Printable(in.name() + "' / '" + in.group())));
  }
  // Host memory of a same-host peer is mapped by its memory object's id, device memory
  // by its CUDA IPC or VMM handle; a VRAM region naming a host object would have the
  // GPU copy from a host pointer as if it were device memory.
  if (in.memory() == v1::VRAM && in.memory_id() != 0) {
    return bad(fmt::format("a VRAM region names host memory object {} (memory_id); device "
                           "memory travels by CUDA IPC or VMM handle, host memory as DRAM",
                           in.memory_id()));
  }
  // VRAM that the peer moves through host staging has no UCX registration, so no
  // rkey; every other region must have one.
  const bool rkey_optional = in.memory() == v1::VRAM;
  if ((in.rkey().empty() && !rkey_optional) || in.rkey().size() > limits.max_rkey_bytes) {
    return bad(fmt::format("rkey is {} bytes (allowed {}..{})", in.rkey().size(),
                           rkey_optional ? 0 : 1, limits.max_rkey_bytes));
  }
  const v1::ItemLayout& layout = in.layout();
  const uint64_t stride = layout.item_stride() == 0 ? layout.item_bytes() : layout.item_stride();
  if (layout.num_items() == 0 || layout.item_bytes() == 0) {
    return bad(fmt::format("layout num_items {} / item_bytes {} is zero", layout.num_items(),
                           layout.item_bytes()));
  }
  if (stride < layout.item_bytes()) {
    return bad(fmt::format("item_stride {} is smaller than item_bytes {}", stride,
                           layout.item_bytes()));
  }
  uint64_t end = 0;
  if (__builtin_add_overflow(in.base_address(), in.length(), &end) || in.length() == 0) {
    return bad(fmt::format("base_address {:#x} + length {} overflows or length is 0",
                           in.base_address(), in.length()));
  }
  uint64_t last = 0;
  if (__builtin_mul_overflow(layout.num_items() - 1, stride, &last) ||
      __builtin_add_overflow(last, layout.item_bytes(), &last) || last > in.length()) {
    return bad(fmt::format("layout ({} items of {} bytes, stride {}) extends beyond length {}",
                           layout.num_items(), layout.item_bytes(), stride, in.length()));
  }
  if (!in.cuda_ipc_handle().empty() && (in.cuda_ipc_handle().size() != 64 || in.cuda_device() < 0)) {
    return bad(fmt::format("cuda_ipc_handle is {} bytes on device {} (a CUDA IPC handle is 64 "
                           "bytes, devices count from 0)",
                           in.cuda_ipc_handle().size(), in.cuda_device()));
  }
  if (uint64_t memory_end = 0;
      __builtin_add_overflow(in.memory_offset(), in.length(), &memory_end)) {
    return bad(
        fmt::format("memory_offset {} + length {} overflows", in.memory_offset(), in.length()));
  }
  RemoteRegion region;
  region.name = in.name();
  region.group = in.group();
  region.group_position = in.group_position();
  region.role = in.role();
  region.memory = in.memory() == v1::VRAM ? v1::VRAM : v1::DRAM;
  region.base_address = in.base_address();
  region.length = in.length();
  region.num_items = layout.num_items();
  region.item_bytes = layout.item_bytes();
  region.item_stride = stride;
  region.rkey_slot = index;
  region.cuda_ipc_handle = in.cuda_ipc_handle();
  region.cuda_device = in.cuda_device();
  region.cuda_offset = in.cuda_offset();
  region.memory_id = in.memory_id();
  region.memory_offset = in.memory_offset();
  if (region.memory == v1::VRAM) {
    region.cuda_vmm_id = in.cuda_vmm_id();
    region.cuda_vmm_bytes = in.cuda_vmm_bytes();
    region.cuda_vmm_offset = in.cuda_vmm_offset();
  }
  region.staged = in.memory_path() == "staged" ||
                  (region.memory == v1::VRAM && in.rkey().empty());
  return region;
}

}  // namespace

absl::Status RemoteCatalog::Index() {
  by_name_.clear();
  groups_.clear();
  by_name_.reserve(regions_.size());
  for (uint32_t i = 0; i < regions_.size(); ++i) {
    RemoteRegion& region = regions_[i];
    region.rkey_slot = i;
    if (!by_name_.emplace(region.name, i).second) {
      return absl::InvalidArgumentError(
          fmt::format("peer '{}' region '{}' (index {}): name is exported twice; {}",
                      Printable(peer_), Printable(region.name), i, kFix));
    }
    if (!region.group.empty()) groups_[region.group].push_back(i);
  }
  // Order each group by position; positions must be exactly 0..n-1.
  for (auto& [group, members] : groups_) {
    std::vector<uint32_t> by_position(members.size(), UINT32_MAX);
    for (uint32_t index : members) {
      const RemoteRegion& region = regions_[index];
      if (region.group_position >= members.size() || by_position[region.group_position] != UINT32_MAX) {
        return absl::InvalidArgumentError(fmt::format(
            "peer '{}' region '{}': group_position {} in group '{}' of {} regions is out of "
            "range or taken twice (positions must be 0..{}); {}",
            Printable(peer_), Printable(region.name), region.group_position, Printable(group), members.size(),
            members.size() - 1, kFix));
      }
      by_position[region.group_position] = index;
    }
    members = std::move(by_position);
    // Roles pair groups across agents, so one role names one region of the group.
    absl::flat_hash_map<std::string_view, uint32_t> roles;
    for (uint32_t index : members) {
      const RemoteRegion& region = regions_[index];
      if (region.role.empty()) continue;
      auto [it, inserted] = roles.emplace(region.role, index);
      if (!inserted) {
        return absl::InvalidArgumentError(fmt::format(
            "peer '{}' group '{}': regions '{}' and '{}' both declare role '{}' (a role names "
            "one region of its group); {}",
            Printable(peer_), Printable(group), Printable(regions_[it->second].name),
            Printable(region.name), Printable(region.role), kFix));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<RemoteCatalog> RemoteCatalog::FromMetadata(const v1::AgentMetadata& metadata,
                                                          const CatalogLimits& limits) {
  // Peer bytes go into messages only as bounded, escaped prefixes.
  const std::string peer = Printable(metadata.name());
  auto bad_peer = [&](const std::string& cause) {
    return absl::InvalidArgumentError(fmt::format("peer '{}': {}; {}", peer, cause, kFix));
  };
  if (metadata.name().empty() || metadata.name().size() > limits.max_name_bytes) {
    return bad_peer(fmt::format("name is {} bytes (allowed 1..{})", metadata.name().size(),
                                limits.max_name_bytes));
  }
  const uint64_t address_bytes = metadata.worker_address().size();
  if (address_bytes == 0 || address_bytes > limits.max_worker_address_bytes) {
    return bad_peer(fmt::format("worker_address is {} bytes (allowed 1..{})", address_bytes,
                                limits.max_worker_address_bytes));
  }
  if (static_cast<uint64_t>(metadata.regions_size()) > limits.max_regions) {
    return bad_peer(fmt::format("exports {} regions (at most {})", metadata.regions_size(),
                                limits.max_regions));
  }
  if (metadata.delta()) {
    return bad_peer(fmt::format("sent a delta from version {} where a whole catalog was due",
                                metadata.base_version()));
  }

  RemoteCatalog catalog;
  catalog.peer_ = metadata.name();
  catalog.version_ = metadata.version();
  catalog.regions_.reserve(metadata.regions_size());
  for (int i = 0; i < metadata.regions_size(); ++i) {
    auto region = ParseRegion(metadata.regions(i), static_cast<uint32_t>(i), peer, limits);
    if (!region.ok()) return region.status();
    catalog.regions_.push_back(*std::move(region));
  }
  if (absl::Status indexed = catalog.Index(); !indexed.ok()) return indexed;
  return catalog;
}

absl::StatusOr<AppliedDelta> RemoteCatalog::ApplyDelta(const v1::AgentMetadata& delta,
                                                       const CatalogLimits& limits) const {
  const std::string peer = Printable(peer_);
  auto refuse = [&](const std::string& cause) {
    return absl::InvalidArgumentError(
        fmt::format("peer '{}': delta from version {} to {} does not apply to version {}: {}",
                    peer, delta.base_version(), delta.version(), version_, cause));
  };
  if (!delta.delta()) return refuse("it is not a delta");
  if (delta.name() != peer_) {
    return refuse(fmt::format("it comes from '{}'", Printable(delta.name())));
  }
  if (delta.base_version() != version_) return refuse("its base is another version");
  if (delta.version() <= delta.base_version()) return refuse("its version is not newer");
  const uint64_t address_bytes = delta.worker_address().size();
  if (address_bytes == 0 || address_bytes > limits.max_worker_address_bytes) {
    return refuse(fmt::format("worker_address is {} bytes (allowed 1..{})", address_bytes,
                              limits.max_worker_address_bytes));
  }
  // Bounded before anything is allocated: removing more than we hold, or adding more
  // than a whole catalog may have, cannot be right.
  if (static_cast<uint64_t>(delta.removed_regions_size()) > regions_.size() ||
      static_cast<uint64_t>(delta.regions_size()) > limits.max_regions) {
    return refuse(fmt::format("it removes {} and adds {} regions (this view has {}; at most {})",
                              delta.removed_regions_size(), delta.regions_size(),
                              regions_.size(), limits.max_regions));
  }
  // Removed names must be ones we hold; replaced ones (added under a name we hold)
  // drop out too and come back from the delta.
  // Why each base region drops out: not, removed, or replaced by one the delta adds.
  enum class Dropped : uint8_t { kNo, kRemoved, kReplaced };
  std::vector<Dropped> dropped(regions_.size(), Dropped::kNo);
  for (const std::string& name : delta.removed_regions()) {
    auto it = by_name_.find(name);
    if (it == by_name_.end() || dropped[it->second] != Dropped::kNo) {
      return refuse(fmt::format("it removes region '{}', which this view {}", Printable(name),
                                it == by_name_.end() ? "does not hold" : "already dropped"));
    }
    dropped[it->second] = Dropped::kRemoved;
  }
  std::vector<RemoteRegion> added;
  added.reserve(delta.regions_size());
  for (int i = 0; i < delta.regions_size(); ++i) {
    auto region = ParseRegion(delta.regions(i), static_cast<uint32_t>(i), peer, limits);
    if (!region.ok()) return refuse(std::string(region.status().message()));
    if (auto it = by_name_.find(region->name); it != by_name_.end()) {
      if (dropped[it->second] != Dropped::kNo) {
        return refuse(fmt::format("region '{}' is {}", Printable(region->name),
                                  dropped[it->second] == Dropped::kRemoved
                                      ? "both removed and added"
                                      : "added twice"));
      }
      dropped[it->second] = Dropped::kReplaced;
    }
    added.push_back(*std::move(region));
  }
  const size_t kept = static_cast<size_t>(std::count(dropped.begin(), dropped.end(), Dropped::kNo));
  if (kept + added.size() > limits.max_regions) {
    return refuse(fmt::format("the result has {} regions (at most {})", kept + added.size(),
                              limits.max_regions));
  }

  AppliedDelta out;
  RemoteCatalog& catalog = out.catalog;
  catalog.peer_ = peer_;
  catalog.version_ = delta.version();
  catalog.regions_.reserve(kept + added.size());
  out.base_slots.reserve(kept + added.size());
  for (size_t i = 0; i < regions_.size(); ++i) {
    if (dropped[i] != Dropped::kNo) continue;
    catalog.regions_.push_back(regions_[i]);
    out.base_slots.push_back(static_cast<uint32_t>(i));
  }
  for (RemoteRegion& region : added) {
    catalog.regions_.push_back(std::move(region));
    out.base_slots.push_back(AppliedDelta::kNew);
  }
  // The whole result is checked as FromMetadata checks a catalog: names unique, every
  // group's positions 0..n-1, roles unique per group.
  if (absl::Status indexed = catalog.Index(); !indexed.ok()) {
    return refuse(std::string(indexed.message()));
  }
  return out;
}

const RemoteRegion* RemoteCatalog::Find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &regions_[it->second];
}

std::vector<const RemoteRegion*> RemoteCatalog::FindGroup(const std::string& group) const {
  std::vector<const RemoteRegion*> out;
  auto it = groups_.find(group);
  if (it == groups_.end()) return out;
  out.reserve(it->second.size());
  for (uint32_t index : it->second) out.push_back(&regions_[index]);
  return out;
}

absl::Span<const uint32_t> RemoteCatalog::GroupSlots(const std::string& group) const {
  auto it = groups_.find(group);
  if (it == groups_.end()) return {};
  return it->second;
}

std::vector<std::string> RemoteCatalog::GroupNames() const {
  std::vector<std::string> names;
  names.reserve(groups_.size());
  for (const auto& [group, members] : groups_) names.push_back(group);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace kvagent::registry
