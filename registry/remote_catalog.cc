#include "registry/remote_catalog.h"

#include <algorithm>
#include <string_view>

#include "absl/status/status.h"
#include "fmt/format.h"
#include "transport/base/text.h"

namespace kvagent::registry {
namespace {

constexpr char kFix[] = "the peer sent malformed metadata; upgrade or restart that agent";

}  // namespace

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

  RemoteCatalog catalog;
  catalog.peer_ = metadata.name();
  catalog.version_ = metadata.version();
  catalog.regions_.reserve(metadata.regions_size());
  for (int i = 0; i < metadata.regions_size(); ++i) {
    const v1::ExportedRegion& in = metadata.regions(i);
    auto bad = [&](const std::string& cause) {
      return absl::InvalidArgumentError(fmt::format("peer '{}' region '{}' (index {}): {}; {}",
                                                    peer, Printable(in.name()), i, cause, kFix));
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
    if (!catalog.by_name_.emplace(in.name(), static_cast<uint32_t>(i)).second) {
      return bad("name is exported twice");
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
    region.rkey_slot = static_cast<uint32_t>(i);
    region.cuda_ipc_handle = in.cuda_ipc_handle();
    region.cuda_device = in.cuda_device();
    region.cuda_offset = in.cuda_offset();
    region.memory_id = in.memory_id();
    region.memory_offset = in.memory_offset();
    region.staged = in.memory_path() == "staged" ||
                    (region.memory == v1::VRAM && in.rkey().empty());
    if (!region.group.empty()) catalog.groups_[region.group].push_back(region.rkey_slot);
    catalog.regions_.push_back(std::move(region));
  }

  // Order each group by position; positions must be exactly 0..n-1.
  for (auto& [group, members] : catalog.groups_) {
    std::vector<uint32_t> by_position(members.size(), UINT32_MAX);
    for (uint32_t index : members) {
      const RemoteRegion& region = catalog.regions_[index];
      if (region.group_position >= members.size() || by_position[region.group_position] != UINT32_MAX) {
        return absl::InvalidArgumentError(fmt::format(
            "peer '{}' region '{}': group_position {} in group '{}' of {} regions is out of "
            "range or taken twice (positions must be 0..{}); {}",
            peer, Printable(region.name), region.group_position, Printable(group), members.size(),
            members.size() - 1, kFix));
      }
      by_position[region.group_position] = index;
    }
    members = std::move(by_position);
    // Roles pair groups across agents, so one role names one region of the group.
    absl::flat_hash_map<std::string_view, uint32_t> roles;
    for (uint32_t index : members) {
      const RemoteRegion& region = catalog.regions_[index];
      if (region.role.empty()) continue;
      auto [it, inserted] = roles.emplace(region.role, index);
      if (!inserted) {
        return absl::InvalidArgumentError(fmt::format(
            "peer '{}' group '{}': regions '{}' and '{}' both declare role '{}' (a role names "
            "one region of its group); {}",
            peer, Printable(group), Printable(catalog.regions_[it->second].name),
            Printable(region.name), Printable(region.role), kFix));
      }
    }
  }
  return catalog;
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

std::vector<std::string> RemoteCatalog::GroupNames() const {
  std::vector<std::string> names;
  names.reserve(groups_.size());
  for (const auto& [group, members] : groups_) names.push_back(group);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace kvagent::registry
