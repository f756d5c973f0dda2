#include "registry/region_registry.h"

#include <sys/resource.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "base/format.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "base/text.h"
#include "fmt/format.h"
#include "registry/remote_catalog.h"

namespace kvagent::registry {
namespace {

constexpr log::Logger kLog("registry");

// How messages and lower layers name a region: its name as an escaped, bounded prefix
// (names are the client's bytes).
std::string Label(const v1::RegionSpec& spec) { return Printable(spec.name()); }

// At most this many names are listed in one Deregister error; the rest are counted.
constexpr size_t kMaxListedNames = 32;

std::string ListNames(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size() && i < kMaxListedNames; ++i) {
    out += fmt::format("{}{}", i == 0 ? "" : ", ", items[i]);
  }
  if (items.size() > kMaxListedNames) {
    out += fmt::format(" and {} more", items.size() - kMaxListedNames);
  }
  return out;
}

uint32_t LoadPosition(const Region& region) {
  return __atomic_load_n(&region.group_position, __ATOMIC_RELAXED);
}
// Regions are handed out as shared_ptr<const Region> but created non-const, so the
// registry may renumber positions (see the header).
void StorePosition(const RegionPtr& region, uint32_t position) {
  __atomic_store_n(&const_cast<Region*>(region.get())->group_position, position,
                   __ATOMIC_RELAXED);
}

// Errors of one batch, keyed by entry so that lines come out in request order and the
// first error found for an entry is the one reported.
class BatchErrors {
 public:
  explicit BatchErrors(const std::vector<v1::RegionSpec>& specs) : specs_(specs) {}

  bool Has(int entry) const { return lines_.count(entry) > 0; }
  bool empty() const { return lines_.empty(); }

  void Add(int entry, absl::StatusCode code, const std::string& cause_and_fix) {
    if (Has(entry)) return;
    lines_.emplace(
        entry, absl::Status(code, fmt::format("region '{}' (entry {}): {}", Label(specs_[entry]),
                                              entry, cause_and_fix)));
  }
  // Re-labels a status from a lower layer ("region 'x': ...", x being Label(spec))
  // with the entry number.
  void Add(int entry, const absl::Status& status) {
    std::string message(status.message());
    const std::string prefix = fmt::format("region '{}': ", Label(specs_[entry]));
    if (absl::StartsWith(message, prefix)) message.erase(0, prefix.size());
    Add(entry, status.code(), message);
  }

  absl::Status ToStatus() const {
    if (lines_.size() == 1) return lines_.begin()->second;
    std::string message = fmt::format(
        "{} of {} regions rejected; nothing was registered:", lines_.size(), specs_.size());
    for (const auto& [entry, status] : lines_) {
      message += "\n";
      message.append(status.message().data(), status.message().size());
    }
    return absl::Status(lines_.begin()->second.code(), message);
  }

 private:
  const std::vector<v1::RegionSpec>& specs_;
  std::map<int, absl::Status> lines_;
};

// Checks and normalizes one entry's layout; returns "" or the cause and fix.
std::string NormalizeLayout(v1::RegionSpec* spec) {
  v1::ItemLayout* layout = spec->mutable_layout();
  if (spec->kind() == v1::AUX && layout->num_items() == 0 && layout->item_bytes() == 0 &&
      layout->item_stride() == 0) {
    layout->set_num_items(1);  // AUX without a layout: one item, the whole region
    layout->set_item_bytes(spec->length());
  }
  if (layout->item_stride() == 0) layout->set_item_stride(layout->item_bytes());
  if (layout->num_items() == 0 || layout->item_bytes() == 0) {
    return fmt::format(
        "layout has num_items {} and item_bytes {}; both must be > 0 (set layout, or "
        "use kind AUX to move the region as one item)",
        layout->num_items(), layout->item_bytes());
  }
  if (layout->item_stride() < layout->item_bytes()) {
    return fmt::format(
        "item_stride {} is smaller than item_bytes {}, so items would overlap; set "
        "item_stride >= item_bytes (0 means packed)",
        layout->item_stride(), layout->item_bytes());
  }
  uint64_t end = 0;
  if (__builtin_mul_overflow(layout->num_items() - 1, layout->item_stride(), &end) ||
      __builtin_add_overflow(end, layout->item_bytes(), &end) || end > spec->length()) {
    return fmt::format(
        "layout ({} items of {} bytes, {} apart) ends beyond the region's length {}; "
        "fix num_items/item_stride or the length",
        layout->num_items(), layout->item_bytes(), layout->item_stride(), spec->length());
  }
  return "";
}

struct Candidate {
  int entry = 0;
  v1::RegionSpec spec;
  ShmMapping mapping;                  // DRAM
  std::optional<CudaIpcMapping> cuda;  // VRAM by cuda_ipc
  // VRAM by cuda_vmm: the resolved object (set before the import, so overlaps within
  // the batch are found without a driver) and its import.
  std::shared_ptr<const DeviceMemoryObject> device_memory;
  std::shared_ptr<const CudaVmmMapping> vmm;
  std::string memory_path;
  transport::MemoryRegistration registration;

  bool vram() const { return cuda.has_value() || vmm != nullptr; }
  uint64_t DevicePointer() const {
    return cuda.has_value() ? cuda->device_pointer() : vmm->address() + spec.cuda_vmm().offset();
  }
};

// Registered host byte ranges by object (device, inode), ordered by offset. Ranges
// in it never overlap (that is what it checks), so the only candidate that can
// overlap [b, e) is the first range ending after b.
struct ShmRange {
  uint64_t end = 0;
  std::string name;
  const ShmMapping* mapping = nullptr;
};
class HostRangeIndex {
 public:
  // The registered range that `m` overlaps, or null.
  const ShmRange* Overlapping(const ShmMapping& m) const {
    auto object = by_object_.find(Key(m));
    if (object == by_object_.end()) return nullptr;
    const auto& ranges = object->second;
    // The last range starting before m's end; ranges are disjoint, so it is the only one
    // that may still end after m's start.
    auto it = ranges.lower_bound(m.offset() + m.length());
    if (it == ranges.begin()) return nullptr;
    --it;
    return it->second.end > m.offset() ? &it->second : nullptr;
  }
  void Insert(const ShmMapping& m, const std::string& name) {
    by_object_[Key(m)].emplace(m.offset(), ShmRange{m.offset() + m.length(), name, &m});
  }

 private:
  static std::pair<uint64_t, uint64_t> Key(const ShmMapping& m) {
    return {static_cast<uint64_t>(m.device()), static_cast<uint64_t>(m.inode())};
  }
  absl::flat_hash_map<std::pair<uint64_t, uint64_t>, std::map<uint64_t, ShmRange>> by_object_;
};

// Device pointers are unique across devices (UVA), and opening one handle twice
// returns the same base, so overlapping VRAM regions overlap as pointer ranges.
bool Overlaps(const std::optional<CudaIpcMapping>& a, const std::optional<CudaIpcMapping>& b) {
  return a.has_value() && b.has_value() &&
         a->device_pointer() < b->device_pointer() + b->length() &&
         b->device_pointer() < a->device_pointer() + a->length();
}

// Regions of one shared VMM object, by their byte ranges in it.
bool VmmOverlaps(const v1::RegionSpec& a, uint64_t a_object, const v1::RegionSpec& b,
                 uint64_t b_object) {
  return a_object != 0 && a_object == b_object &&
         a.cuda_vmm().offset() < b.cuda_vmm().offset() + b.length() &&
         b.cuda_vmm().offset() < a.cuda_vmm().offset() + a.length();
}

std::string UcxDetail(const transport::UcxCapabilities& caps) {
  auto list = [](const std::vector<std::string>& items) {
    return items.empty() ? std::string("none") : absl::StrJoin(items, ",");
  };
  return fmt::format("{} (transports {}; memory types {})", caps.version, list(caps.transports),
                     list(caps.memory_types));
}

}  // namespace

bool HasIpcLockCapability() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (!absl::StartsWith(line, "CapEff:")) continue;
    const uint64_t caps = std::strtoull(line.c_str() + 7, nullptr, 16);
    constexpr int kCapIpcLock = 14;
    return (caps >> kCapIpcLock) & 1;
  }
  return false;
}

namespace {

uint64_t MemlockLimit() {
  struct rlimit limit {};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0 || HasIpcLockCapability()) return RLIM_INFINITY;
  return limit.rlim_cur;
}

}  // namespace

absl::StatusOr<std::string> MemoryPathFor(v1::MemoryKind kind, bool ucx_cuda,
                                          bool staging_allowed, std::string_view ucx_detail) {
  if (kind == v1::DRAM || kind == v1::MEMORY_KIND_UNSPECIFIED) return std::string("host");
  if (kind != v1::VRAM) {
    return absl::InvalidArgumentError(
        fmt::format("unknown memory kind {}; use DRAM or VRAM", static_cast<int>(kind)));
  }
  if (ucx_cuda) return std::string("zero-copy");
  if (staging_allowed) return std::string("staged");
  return absl::FailedPreconditionError(fmt::format(
      "UCX{}{} cannot register CUDA memory and VRAM staging is off (--vram-staging=off); run "
      "the agent on a CUDA-enabled UCX build (UCX_MODULE_DIR pointing at its ucx/ modules "
      "directory, the one with libuct_cuda.so, and UCX_TLS including cuda_copy,cuda_ipc), "
      "or allow host staging with --vram-staging=auto",
      ucx_detail.empty() ? "" : " ", ucx_detail));
}

absl::Status CheckMemlock(uint64_t bytes_to_pin, uint64_t limit, std::string_view entry) {
  if (limit == RLIM_INFINITY || bytes_to_pin <= limit) return absl::OkStatus();
  return absl::FailedPreconditionError(fmt::format(
      "region '{}': needs {} bytes of locked memory (with the regions this agent already "
      "pins) but RLIMIT_MEMLOCK is {} bytes; raise it (`ulimit -l unlimited`, systemd "
      "LimitMEMLOCK=infinity, Kubernetes: the IPC_LOCK capability; no privileged container)",
      entry, bytes_to_pin, limit));
}

bool PinsRegisteredMemory(const std::vector<std::string>& transports) {
  return std::any_of(transports.begin(), transports.end(), [](const std::string& name) {
    return absl::StartsWith(name, "rc") || absl::StartsWith(name, "ud") ||
           absl::StartsWith(name, "dc") || absl::StartsWith(name, "ib");
  });
}

v1::RegionInfo Region::Info() const {
  v1::RegionInfo info;
  *info.mutable_spec() = spec;
  info.set_group_position(LoadPosition(*this));
  info.set_base_address(base_address);
  info.set_memory_path(memory_path);
  info.set_owner(owner);
  info.set_broken(mapping.broken());
  return info;
}

absl::StatusOr<RegisterResult> RegionRegistry::Register(const std::vector<v1::RegionSpec>& specs,
                                                        bool skip_empty,
                                                        const RegisterContext& context) {
  ASSIGN_OR_RETURN(RegisterResult result, RegisterUnpopulated(specs, skip_empty, context));
  // The new regions' host pages are faulted in after the writer lock is let go: for a
  // large pool that takes seconds (about 0.2 s a GiB on this project's VMs), and every
  // other registration, deregistration and session end waited for it. They are in the
  // catalog already; a transfer that reaches a page first faults it in itself.
  for (const RegionPtr& region : result.regions) region->mapping.FaultIn();
  return result;
}

absl::StatusOr<RegisterResult> RegionRegistry::RegisterUnpopulated(
    const std::vector<v1::RegionSpec>& specs, bool skip_empty, const RegisterContext& context) {
  absl::MutexLock write_lock(&write_mu_);
  // The owner ended (its local session closed) before this call could commit: its
  // regions would outlive it, owned by a principal nobody can act as any more, since
  // the session's end already took (DeregisterOwner) what it held. Asked before the
  // imports (a call that waited behind other writers) and again right before the
  // commit, under write_mu_, which DeregisterOwner takes too.
  const OwnerEnded& ended = owner_ended_;
  auto check_owner = [&]() -> absl::Status {
    if (!ended || !ended(context.owner)) return absl::OkStatus();
    kLog.Info("refused registering {} regions for {}: it ended during the call", specs.size(),
              Printable(context.owner));
    return absl::UnauthenticatedError(fmt::format(
        "{} ended while its RegisterRegions ran, and a session's regions end with it, so "
        "nothing was registered; keep the session open until the call returns, or attach "
        "again and register from the new session",
        Printable(context.owner)));
  };
  if (absl::Status live = check_owner(); !live.ok()) return live;
  // Writers are serialized by write_mu_, so this snapshot stays current until commit.
  const std::vector<RegionPtr> existing = List();
  absl::flat_hash_set<std::string> existing_names;
  for (const RegionPtr& region : existing) existing_names.insert(region->spec.name());

  BatchErrors errors(specs);
  RegisterResult result;
  std::vector<Candidate> candidates;
  absl::flat_hash_map<std::string, int> batch_names;
  const auto kInvalid = absl::StatusCode::kInvalidArgument;

  // 1. Checks that need no import, each entry on its own.
  for (int i = 0; i < static_cast<int>(specs.size()); ++i) {
    v1::RegionSpec spec = specs[i];
    if (spec.name().empty()) {
      errors.Add(i, kInvalid, "name is empty; give every region a unique name such as \"k.L0\"");
      continue;
    }
    if (spec.length() == 0 && skip_empty) {
      result.skipped.push_back(spec.name());
      continue;
    }
    // Peers refuse metadata with longer strings (CatalogLimits::max_name_bytes), so
    // one such region would break every peer's connection to this agent.
    if (const uint64_t limit = CatalogLimits{}.max_name_bytes;
        spec.name().size() > limit || spec.group().size() > limit ||
        (spec.has_shm() && spec.shm().name().size() > limit)) {
      errors.Add(i, kInvalid,
                 fmt::format("name, group or shm.name is over {} bytes (they are {}, {} and {}), "
                             "which peers refuse in metadata; use shorter ones",
                             limit, spec.name().size(), spec.group().size(),
                             spec.has_shm() ? spec.shm().name().size() : 0));
      continue;
    }
    // Names travel into logs, peers' metadata and other tools' output.
    if (HasControlCharacter(spec.name()) || HasControlCharacter(spec.group()) ||
        (spec.has_shm() && HasControlCharacter(spec.shm().name()))) {
      std::vector<std::string> fields;
      if (HasControlCharacter(spec.name())) fields.push_back("name");
      if (HasControlCharacter(spec.group()))
        fields.push_back("group '" + Printable(spec.group()) + "'");
      if (spec.has_shm() && HasControlCharacter(spec.shm().name())) {
        fields.push_back("shm.name '" + Printable(spec.shm().name()) + "'");
      }
      errors.Add(
          i, kInvalid,
          fmt::format("{} {} a NUL or control character; use printable names",
                      absl::StrJoin(fields, " and "), fields.size() == 1 ? "contains" : "contain"));
      continue;
    }
    // Roles travel to peers too, which refuse longer ones (CatalogLimits::max_role_bytes).
    if (const uint64_t limit = CatalogLimits{}.max_role_bytes; spec.role().size() > limit) {
      errors.Add(i, kInvalid,
                 fmt::format("role is {} bytes (at most {}, which peers accept); use a short "
                             "role such as \"L0.K\"",
                             spec.role().size(), limit));
      continue;
    }
    if (HasControlCharacter(spec.role())) {
      errors.Add(i, kInvalid,
                 fmt::format("role '{}' contains a NUL or control character; use a printable "
                             "role such as \"L0.K\"",
                             Printable(spec.role())));
      continue;
    }
    if (spec.kind() != v1::KV && spec.kind() != v1::STATE && spec.kind() != v1::AUX &&
        spec.kind() != v1::REGION_KIND_UNSPECIFIED) {
      errors.Add(i, kInvalid,
                 fmt::format("kind {} is not a region kind; use KV, STATE or AUX",
                             static_cast<int>(spec.kind())));
      continue;
    }
    auto [it, inserted] = batch_names.emplace(spec.name(), i);
    if (!inserted) {
      errors.Add(i, kInvalid, fmt::format("name repeats entry {}; give every region a unique name",
                                          it->second));
      continue;
    }
    if (existing_names.contains(spec.name())) {
      errors.Add(i, kInvalid,
                 "name is already registered; deregister it first or pick another name");
      continue;
    }
    if (spec.memory() != v1::DRAM && spec.memory() != v1::VRAM &&
        spec.memory() != v1::MEMORY_KIND_UNSPECIFIED) {
      errors.Add(i, kInvalid, fmt::format("unknown memory kind {}; use DRAM or VRAM",
                                          static_cast<int>(spec.memory())));
      continue;
    }
    if (spec.memory() == v1::MEMORY_KIND_UNSPECIFIED) spec.set_memory(v1::DRAM);
    if (spec.length() == 0) {
      errors.Add(i, kInvalid,
                 "length is 0; give the region's size in bytes, or set skip_empty to skip "
                 "empty regions");
      continue;
    }
    uint64_t end = 0;
    if (spec.memory() == v1::VRAM && spec.has_cuda_vmm()) {
      if (spec.cuda_vmm().memory_handle() == 0) {
        errors.Add(i, kInvalid,
                   "cuda_vmm.memory_handle is 0; set it to the handle that ShareDeviceMemory "
                   "returned on the agent's session socket");
        continue;
      }
      if (__builtin_add_overflow(spec.cuda_vmm().offset(), spec.length(), &end)) {
        errors.Add(i, kInvalid, fmt::format("cuda_vmm.offset {} + length {} overflows; fix both",
                                            spec.cuda_vmm().offset(), spec.length()));
        continue;
      }
    } else if (spec.memory() == v1::VRAM) {
      if (!spec.has_cuda_ipc()) {
        errors.Add(i, kInvalid,
                   spec.has_shm()
                       ? "VRAM region has a shm source, but VRAM comes from a CUDA VMM or IPC "
                         "handle; set cuda_vmm (memory_handle from ShareDeviceMemory, offset) "
                         "or cuda_ipc (ipc_handle, device, offset) instead of shm, or set "
                         "memory DRAM for host memory"
                       : "VRAM region has no cuda_vmm or cuda_ipc source; set "
                         "cuda_vmm.memory_handle (a handle from ShareDeviceMemory on the "
                         "session socket) and cuda_vmm.offset, or cuda_ipc.ipc_handle (the 64 "
                         "bytes of cudaIpcGetMemHandle), cuda_ipc.device and cuda_ipc.offset");
        continue;
      }
      if (absl::Status s = cuda::CudaDriver::ValidateIpcSource(
              Label(spec), spec.cuda_ipc().ipc_handle().size(), spec.cuda_ipc().device(), -1);
          !s.ok()) {
        errors.Add(i, s);
        continue;
      }
      if (__builtin_add_overflow(spec.cuda_ipc().offset(), spec.length(), &end)) {
        errors.Add(i, kInvalid, fmt::format("cuda_ipc.offset {} + length {} overflows; fix both",
                                            spec.cuda_ipc().offset(), spec.length()));
        continue;
      }
    } else {
      if (spec.has_cuda_ipc() || spec.has_cuda_vmm()) {
        errors.Add(i, kInvalid,
                   fmt::format("DRAM region has a {} source; set memory VRAM for device memory, "
                               "or give a shm source for host memory",
                               spec.has_cuda_ipc() ? "cuda_ipc" : "cuda_vmm"));
        continue;
      }
      if (!spec.has_shm() || (spec.shm().memory_handle() == 0 && spec.shm().name().empty())) {
        errors.Add(i, kInvalid,
                   "DRAM region has no shm source; set shm.memory_handle (a handle from "
                   "ShareMemory or AllocateMemory on the session socket) or, for "
                   "compatibility, shm.name (a \"/name\" shm object or a path under an allowed "
                   "directory), and shm.offset");
        continue;
      }
      if (__builtin_add_overflow(spec.shm().offset(), spec.length(), &end)) {
        errors.Add(i, kInvalid, fmt::format("shm.offset {} + length {} overflows; fix both",
                                            spec.shm().offset(), spec.length()));
        continue;
      }
    }
    if (std::string cause = NormalizeLayout(&spec); !cause.empty()) {
      errors.Add(i, kInvalid, cause);
      continue;
    }
    Candidate candidate;
    candidate.entry = i;
    candidate.spec = std::move(spec);
    candidates.push_back(std::move(candidate));
  }

  // 2. Groups: a group belongs to the owner of its regions (another owner's transfers
  // and notifications address it by name), every region of a group (registered or
  // in this batch) has the same num_items, since one index list addresses all of them,
  // and a role names one region of its group (peers pair groups by role).
  absl::flat_hash_map<std::string, std::pair<std::string, uint64_t>> group_items;
  absl::flat_hash_map<std::string, std::string> group_owners;
  // (group, role) -> the region that declares it.
  absl::flat_hash_map<std::pair<std::string, std::string>, std::string> group_roles;
  for (const RegionPtr& region : existing) {
    if (!region->spec.group().empty()) {
      group_items.try_emplace(region->spec.group(), region->spec.name(), region->num_items());
      group_owners.try_emplace(region->spec.group(), region->owner);
      if (!region->spec.role().empty()) {
        group_roles.try_emplace(std::pair(region->spec.group(), region->spec.role()),
                                region->spec.name());
      }
    }
  }
  for (const Candidate& c : candidates) {
    if (c.spec.group().empty()) continue;
    if (auto owner = group_owners.find(c.spec.group());
        owner != group_owners.end() && owner->second != context.owner) {
      errors.Add(c.entry, absl::StatusCode::kPermissionDenied,
                 fmt::format("group '{}' belongs to {}; use another group name",
                             Printable(c.spec.group()), Printable(owner->second)));
      continue;
    }
    auto [it, inserted] =
        group_items.try_emplace(c.spec.group(), c.spec.name(), c.spec.layout().num_items());
    if (!inserted && it->second.second != c.spec.layout().num_items()) {
      errors.Add(c.entry, kInvalid,
                 fmt::format("has {} items but region '{}' of group '{}' has {}; every region "
                             "of a group needs the same num_items (one index list addresses "
                             "them all)",
                             c.spec.layout().num_items(), Printable(it->second.first),
                             Printable(c.spec.group()), it->second.second));
      continue;
    }
    if (c.spec.role().empty()) continue;
    auto [role, role_inserted] =
        group_roles.try_emplace(std::pair(c.spec.group(), c.spec.role()), c.spec.name());
    if (!role_inserted) {
      errors.Add(c.entry, kInvalid,
                 fmt::format("role '{}' is already declared by region '{}' of group '{}'; a "
                             "role names one region of its group, so give each its own (such "
                             "as \"L0.K\" and \"L0.V\")",
                             Printable(c.spec.role()), Printable(role->second),
                             Printable(c.spec.group())));
    }
  }

  // The agent's limits, before anything is imported: the batch as it stands (entries
  // refused above are not counted; the whole batch fails anyway). New regions' rkeys
  // are not packed yet, so the catalog's size is checked here as a lower bound (no
  // rkey) and again, exactly, once they are.
  RegisterUsage usage;
  auto admit = [&](bool packed) -> absl::Status {
    usage.new_metadata_bytes = 0;
    for (const Candidate& c : candidates) {
      usage.new_metadata_bytes +=
          ExportBytes(c.spec, packed ? c.registration.packed_rkey().size() : 0);
    }
    return context.admit(usage);
  };
  if (context.admit && errors.empty()) {
    {
      // Current: writers are serialized by write_mu_, and the totals are kept per commit.
      absl::ReaderMutexLock lock(&mu_);
      usage.regions = usage_.regions;
      usage.metadata_bytes = usage_.metadata_bytes;
      if (auto owner = by_owner_.find(context.owner); owner != by_owner_.end()) {
        usage.owner_regions = owner->second.regions;
        usage.owner_bytes = owner->second.bytes;
      }
    }
    for (const Candidate& c : candidates) {
      ++usage.new_regions;
      usage.new_bytes += c.spec.length();
    }
    if (usage.new_regions > 0) {
      if (absl::Status admitted = admit(/*packed=*/false); !admitted.ok()) return admitted;
    }
  }

  // Host byte ranges already registered, by object, so that each entry's overlap
  // check is a lookup, not a scan of every region (100,000 regions register in
  // batches).
  HostRangeIndex host_ranges;
  for (const RegionPtr& region : existing) {
    if (region->mapping.data() != nullptr) host_ranges.Insert(region->mapping, region->spec.name());
  }

  // 3. Import the memory (shm mapping, CUDA VMM or IPC handle); 4. reject overlaps
  // with registered or batch regions.
  for (Candidate& c : candidates) {
    if (errors.Has(c.entry)) continue;
    if (c.spec.has_cuda_vmm()) {
      const v1::CudaVmmSource& source = c.spec.cuda_vmm();
      if (!context.resolve_device_handle) {
        errors.Add(c.entry, absl::StatusCode::kFailedPrecondition,
                   fmt::format("cuda_vmm.memory_handle {} given, but device memory handles need "
                               "a local session (ShareDeviceMemory on the agent's session "
                               "socket); register from that session",
                               source.memory_handle()));
        continue;
      }
      auto object = context.resolve_device_handle(source.memory_handle());
      if (!object.ok()) {
        errors.Add(c.entry, object.status());
        continue;
      }
      if (*object == nullptr) {
        errors.Add(c.entry, absl::StatusCode::kNotFound,
                   fmt::format("cuda_vmm.memory_handle {} is not one of this session's device "
                               "memory handles; use a handle from ShareDeviceMemory",
                               source.memory_handle()));
        continue;
      }
      const DeviceMemoryObject& memory = **object;
      const uint64_t end = source.offset() + c.spec.length();  // checked in step 1
      if (end > memory.bytes()) {
        errors.Add(c.entry, kInvalid,
                   fmt::format("cuda_vmm.offset {} + length {} = {} bytes, but device memory "
                               "'{}' (handle {}) was shared with {} bytes; fix offset/length, "
                               "or share the allocation with its whole size",
                               source.offset(), c.spec.length(), end, memory.label(),
                               source.memory_handle(), memory.bytes()));
        continue;
      }
      c.device_memory = *std::move(object);
      // Overlaps need no driver: byte ranges of the same shared object.
      auto overlap = [&](const std::string& other, const v1::RegionSpec& spec) {
        errors.Add(c.entry, kInvalid,
                   fmt::format("bytes [{}, {}) of device memory '{}' overlap region '{}' (bytes "
                               "[{}, {})); give each region its own byte range",
                               source.offset(), end, memory.label(), Printable(other),
                               spec.cuda_vmm().offset(),
                               spec.cuda_vmm().offset() + spec.length()));
      };
      for (const RegionPtr& region : existing) {
        if (region->vmm != nullptr &&
            VmmOverlaps(c.spec, memory.id(), region->spec, region->vmm->memory()->id())) {
          overlap(region->spec.name(), region->spec);
        }
      }
      for (const Candidate& other : candidates) {
        if (&other == &c) break;
        if (other.device_memory != nullptr &&
            VmmOverlaps(c.spec, memory.id(), other.spec, other.device_memory->id())) {
          overlap(other.spec.name(), other.spec);
        }
      }
      if (errors.Has(c.entry)) continue;
      // One import per object: regions of it registered before or earlier in this
      // batch share theirs.
      for (const RegionPtr& region : existing) {
        if (c.vmm == nullptr && region->vmm != nullptr &&
            region->vmm->memory()->id() == memory.id()) {
          c.vmm = region->vmm;
        }
      }
      for (const Candidate& other : candidates) {
        if (&other == &c || c.vmm != nullptr) break;
        if (other.vmm != nullptr && other.vmm->memory()->id() == memory.id()) c.vmm = other.vmm;
      }
      if (c.vmm == nullptr) {
        auto imported = CudaVmmMapping::Import(c.device_memory, Label(c.spec));
        if (!imported.ok()) {
          errors.Add(c.entry, imported.status());
          continue;
        }
        c.vmm = *std::move(imported);
      }
      continue;
    }
    if (c.spec.memory() == v1::VRAM) {
      auto cuda = CudaIpcMapping::Open(c.spec.cuda_ipc(), c.spec.length(), Label(c.spec));
      if (!cuda.ok()) {
        errors.Add(c.entry, cuda.status());
        continue;
      }
      c.cuda = std::move(cuda).value();
      auto overlap = [&](const std::string& other, const CudaIpcMapping& m) {
        errors.Add(
            c.entry, kInvalid,
            fmt::format("device bytes [{:#x}, {:#x}) on device {} overlap region '{}' "
                        "([{:#x}, {:#x})); give each region its own byte range",
                        c.cuda->device_pointer(), c.cuda->device_pointer() + c.cuda->length(),
                        c.cuda->device(), Printable(other), m.device_pointer(),
                        m.device_pointer() + m.length()));
      };
      for (const RegionPtr& region : existing) {
        if (Overlaps(c.cuda, region->cuda)) overlap(region->spec.name(), *region->cuda);
      }
      for (const Candidate& other : candidates) {
        if (&other == &c) break;
        if (Overlaps(c.cuda, other.cuda)) overlap(other.spec.name(), *other.cuda);
      }
      continue;
    }
    absl::StatusOr<ShmMapping> mapping;
    const v1::SharedMemorySource& shm = c.spec.shm();
    if (shm.memory_handle() != 0) {
      if (!context.resolve_handle) {
        errors.Add(c.entry, absl::StatusCode::kFailedPrecondition,
                   fmt::format("shm.memory_handle {} given, but memory handles need a local "
                               "session (ShareMemory / AllocateMemory on the agent's session "
                               "socket); register from that session, or give shm.name",
                               shm.memory_handle()));
        continue;
      }
      auto object = context.resolve_handle(shm.memory_handle());
      if (!object.ok()) {
        errors.Add(c.entry, object.status());
        continue;
      }
      if (*object == nullptr) {
        errors.Add(c.entry, absl::StatusCode::kNotFound,
                   fmt::format("shm.memory_handle {} is not one of this session's memory "
                               "handles; use a handle from ShareMemory or AllocateMemory",
                               shm.memory_handle()));
        continue;
      }
      mapping = ShmMapping::Map(*std::move(object), shm.offset(), c.spec.length(), Label(c.spec),
                                ShmMapping::Populate::kLater);
    } else {
      mapping = ShmMapping::OpenPath(shm.name(), shm.offset(), c.spec.length(), Label(c.spec),
                                     context.path_policy, ShmMapping::Populate::kLater);
    }
    if (!mapping.ok()) {
      errors.Add(c.entry, mapping.status());
      continue;
    }
    c.mapping = std::move(mapping).value();
    auto overlap = [&](const std::string& other, const ShmMapping& m) {
      errors.Add(c.entry, kInvalid,
                 fmt::format("bytes [{}, {}) of memory '{}' overlap region '{}' (bytes [{}, "
                             "{})); give each region its own byte range",
                             c.mapping.offset(), c.mapping.offset() + c.mapping.length(),
                             c.mapping.memory()->label(), Printable(other), m.offset(),
                             m.offset() + m.length()));
    };
    if (const ShmRange* other = host_ranges.Overlapping(c.mapping)) {
      overlap(other->name, *other->mapping);
    } else {
      host_ranges.Insert(c.mapping, c.spec.name());
    }
  }
  if (!errors.empty()) return errors.ToStatus();

  // 5. Choose each region's memory path, and check the locked-memory limit for host
  // memory that an RDMA transport will pin (staging buffers are not allocated here).
  const transport::UcxCapabilities& caps = context_->capabilities();
  const bool pins = PinsRegisteredMemory(caps.transports);
  const uint64_t memlock_limit = pins ? MemlockLimit() : RLIM_INFINITY;
  uint64_t pinned = 0;
  for (const RegionPtr& region : existing) {
    if (region->spec.memory() == v1::DRAM) pinned += region->spec.length();
  }
  for (Candidate& c : candidates) {
    auto path = MemoryPathFor(c.spec.memory(), caps.cuda_memory, options_.vram_staging,
                              UcxDetail(caps));
    if (!path.ok()) {
      errors.Add(c.entry, path.status());
      continue;
    }
    c.memory_path = *std::move(path);
    if (options_.stage_host_regions && c.memory_path == "host") c.memory_path = "staged";
    if (pins && c.spec.memory() == v1::DRAM) {
      pinned += c.spec.length();
      if (absl::Status s = CheckMemlock(pinned, memlock_limit, Label(c.spec)); !s.ok()) {
        errors.Add(c.entry, s);
      }
    }
  }
  if (!errors.empty()) return errors.ToStatus();

  if (absl::Status live = check_owner(); !live.ok()) return live;  // before pinning

  // 6. Register with UCX (staged VRAM is not registered: UCX cannot touch device
  // memory, transfers copy it through host buffers). On any failure the whole batch
  // unwinds through RAII.
  for (Candidate& c : candidates) {
    if (c.memory_path == "staged" && c.vram()) continue;
    const bool vram = c.vram();
    auto registration = transport::MemoryRegistration::Map(
        *context_, vram ? reinterpret_cast<void*>(c.DevicePointer()) : c.mapping.data(),
        c.spec.length(), vram ? transport::MemoryType::kCuda : transport::MemoryType::kHost,
        Label(c.spec), transport::PeerAccess::kPeers);
    if (!registration.ok()) {
      errors.Add(c.entry, registration.status());
      continue;
    }
    c.registration = std::move(registration).value();
  }
  if (!errors.empty()) return errors.ToStatus();
  if (context.admit && usage.new_regions > 0) {
    if (absl::Status admitted = admit(/*packed=*/true); !admitted.ok()) return admitted;
  }

  // 7. Commit, unless the owner ended meanwhile (the imports and pinning take long for
  // large regions: a session closing then must not leave them behind).
  if (absl::Status live = check_owner(); !live.ok()) return live;
  absl::MutexLock lock(&mu_);
  absl::flat_hash_map<std::string, uint32_t> group_sizes;
  for (const auto& [group, members] : groups_) group_sizes[group] = members.size();
  uint64_t bytes = 0;
  for (Candidate& c : candidates) {
    auto region = std::make_shared<Region>();
    // Before the spec moves: a VMM region's pointer is the mapping plus its offset in
    // the spec (read from a moved-from spec, every region of an allocation got offset
    // 0; found by tests/gpu/vram_test on the stand-in driver).
    region->base_address =
        c.vram() ? c.DevicePointer() : reinterpret_cast<uint64_t>(c.mapping.data());
    region->spec = std::move(c.spec);
    if (!region->spec.group().empty()) region->group_position = group_sizes[region->spec.group()]++;
    region->memory_path = std::move(c.memory_path);
    region->owner = context.owner;
    region->mapping = std::move(c.mapping);
    region->cuda = std::move(c.cuda);
    region->vmm = std::move(c.vmm);
    region->registration = std::move(c.registration);
    bytes += region->spec.length();
    CountLocked(region, +1);
    regions_.emplace(region->spec.name(), Entry{next_sequence_++, region});
    result.regions.push_back(std::move(region));
  }
  // A batch of only skipped entries changes nothing, so peers need not refetch.
  if (!result.regions.empty()) {
    ++version_;
    Change change;
    change.version = version_;
    change.added.reserve(result.regions.size());
    for (const RegionPtr& region : result.regions) change.added.push_back(region->spec.name());
    LogChange(std::move(change));
  }
  result.version = version_;
  kLog.Info("registered {} regions ({} bytes, {} skipped) for {}; version {}",
            result.regions.size(), bytes, result.skipped.size(), Printable(context.owner),
            version_);
  return result;
}

absl::StatusOr<uint64_t> RegionRegistry::Deregister(const std::vector<std::string>& names,
                                                    std::vector<RegionPtr>* retired,
                                                    const std::string& owner, bool any_owner) {
  absl::MutexLock write_lock(&write_mu_);
  std::vector<RegionPtr> removed;  // released after mu_ is dropped (munmap, ucp_mem_unmap)
  uint64_t version = 0;
  {
    absl::MutexLock lock(&mu_);
    std::vector<std::string> unknown;
    std::vector<std::string> foreign;
    absl::flat_hash_set<std::string> seen;
    for (const std::string& name : names) {
      if (!seen.insert(name).second) continue;  // named twice
      auto it = regions_.find(name);
      if (it == regions_.end()) {
        unknown.push_back(fmt::format("'{}'", Printable(name)));
      } else if (!any_owner && it->second.region->owner != owner) {
        foreign.push_back(fmt::format("'{}' (owned by {})", Printable(name),
                                      Printable(it->second.region->owner)));
      }
    }
    if (!unknown.empty() || !foreign.empty()) {
      std::vector<std::string> causes;
      std::vector<std::string> fixes;
      if (!unknown.empty()) {
        causes.push_back(fmt::format("regions {} are not registered", ListNames(unknown)));
        fixes.push_back("list regions with `kvagentctl regions`");
      }
      if (!foreign.empty()) {
        causes.push_back(fmt::format("regions {} belong to another owner, not to {}",
                                     ListNames(foreign), Printable(owner)));
        fixes.push_back("deregister only regions you registered (or ask their owner)");
      }
      return absl::Status(
          unknown.empty() ? absl::StatusCode::kPermissionDenied : absl::StatusCode::kNotFound,
          fmt::format("{}, so nothing was deregistered; {}", absl::StrJoin(causes, "; and "),
                      absl::StrJoin(fixes, "; ")));
    }
    removed = RemoveLocked(names);  // a name given twice goes once
    version = version_;
  }
  kLog.Info("deregistered {} regions for {}; version {}", removed.size(), Printable(owner),
            version);
  if (retired != nullptr) {
    for (auto& region : removed) retired->push_back(std::move(region));
  }
  return version;
}

uint64_t RegionRegistry::DeregisterOwner(const std::string& owner,
                                         std::vector<RegionPtr>* retired,
                                         std::vector<std::string>* removed_names) {
  // Under the writer lock: no registration is between its checks and its commit, so
  // what the owner holds is exactly what regions_ says (a registration of it that
  // runs later fails the owner check, see SetOwnerCheck).
  absl::MutexLock write_lock(&write_mu_);
  std::vector<RegionPtr> removed;  // released after mu_ is dropped (munmap, ucp_mem_unmap)
  uint64_t version = 0;
  {
    absl::MutexLock lock(&mu_);
    std::vector<std::pair<uint64_t, std::string>> mine;
    if (by_owner_.contains(owner)) {
      for (const auto& [name, entry] : regions_) {
        if (entry.region->owner == owner) mine.emplace_back(entry.sequence, name);
      }
    }
    std::sort(mine.begin(), mine.end());
    std::vector<std::string> names;
    names.reserve(mine.size());
    for (auto& [sequence, name] : mine) names.push_back(std::move(name));
    removed = RemoveLocked(names);
    version = version_;
    if (removed_names != nullptr) {
      for (auto& name : names) removed_names->push_back(std::move(name));
    }
  }
  if (!removed.empty()) {
    kLog.Info("deregistered the {} regions of {} (it ended); version {}", removed.size(),
              Printable(owner), version);
  }
  if (retired != nullptr) {
    for (auto& region : removed) retired->push_back(std::move(region));
  }
  return version;
}

void RegionRegistry::SetOwnerCheck(OwnerEnded ended) {
  absl::MutexLock write_lock(&write_mu_);
  owner_ended_ = std::move(ended);
}

std::vector<RegionPtr> RegionRegistry::RemoveLocked(const std::vector<std::string>& names) {
  std::vector<RegionPtr> removed;
  absl::flat_hash_set<std::string> groups;
  Change change;
  for (const std::string& name : names) {
    auto it = regions_.find(name);
    if (it == regions_.end()) continue;  // named twice
    if (!it->second.region->spec.group().empty()) groups.insert(it->second.region->spec.group());
    change.removed.push_back(name);
    CountLocked(it->second.region, -1);
    removed.push_back(std::move(it->second.region));
    regions_.erase(it);
  }
  // Renumber the remaining regions of touched groups 0..n-1 in registration order
  // (one pass over the catalog for all of them).
  if (!groups.empty()) {
    absl::flat_hash_map<std::string, std::vector<const Entry*>> members;
    for (const auto& [name, entry] : regions_) {
      if (groups.contains(entry.region->spec.group())) {
        members[entry.region->spec.group()].push_back(&entry);
      }
    }
    for (auto& [group, entries] : members) {
      std::sort(entries.begin(), entries.end(),
                [](const Entry* a, const Entry* b) { return a->sequence < b->sequence; });
      for (size_t p = 0; p < entries.size(); ++p) {
        StorePosition(entries[p]->region, static_cast<uint32_t>(p));
        // Peers get every region of a touched group again (positions changed).
        change.renumbered.push_back(entries[p]->region->spec.name());
      }
    }
  }
  if (!removed.empty()) {
    ++version_;
    change.version = version_;
    LogChange(std::move(change));
  }
  return removed;
}

RegionPtr RegionRegistry::Find(const std::string& name) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = regions_.find(name);
  return it == regions_.end() ? nullptr : it->second.region;
}

std::vector<RegionPtr> RegionRegistry::FindGroup(const std::string& group) const {
  std::vector<RegionPtr> out;
  if (group.empty()) return out;
  {
    absl::ReaderMutexLock lock(&mu_);
    auto it = groups_.find(group);
    if (it == groups_.end()) return out;
    out = it->second;  // in position order (see groups_)
  }
  return out;
}

bool RegionRegistry::VisitGroup(const std::string& group,
                                absl::FunctionRef<void(const Region&)> visit) const {
  if (group.empty()) return false;
  absl::ReaderMutexLock lock(&mu_);
  auto it = groups_.find(group);
  if (it == groups_.end()) return false;
  for (const RegionPtr& region : it->second) visit(*region);
  return true;
}

std::vector<std::string> RegionRegistry::GroupNames() const {
  absl::flat_hash_set<std::string> groups;
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [group, members] : groups_) groups.insert(group);
  }
  std::vector<std::string> out(groups.begin(), groups.end());
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<RegionPtr> RegionRegistry::List() const {
  std::vector<std::pair<uint64_t, RegionPtr>> entries;
  {
    absl::ReaderMutexLock lock(&mu_);
    entries.reserve(regions_.size());
    for (const auto& [name, entry] : regions_) entries.emplace_back(entry.sequence, entry.region);
  }
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<RegionPtr> out;
  out.reserve(entries.size());
  for (auto& [sequence, region] : entries) out.push_back(std::move(region));
  return out;
}

uint64_t RegionRegistry::version() const {
  absl::ReaderMutexLock lock(&mu_);
  return version_;
}

uint64_t RegionRegistry::registered_bytes() const {
  absl::ReaderMutexLock lock(&mu_);
  return usage_.bytes;
}

void RegionRegistry::CountLocked(const RegionPtr& ptr, int sign) {
  const Region& region = *ptr;
  if (!region.spec.group().empty()) {
    std::vector<RegionPtr>& members = groups_[region.spec.group()];
    if (sign > 0) {
      members.push_back(ptr);
    } else {
      members.erase(std::remove(members.begin(), members.end(), ptr), members.end());
      if (members.empty()) groups_.erase(region.spec.group());
    }
  }
  const uint64_t bytes = region.spec.length();
  const uint64_t exported = ExportBytes(region.spec, region.registration.packed_rkey().size());
  OwnerUsage& owner = by_owner_[region.owner];
  if (sign > 0) {
    ++usage_.regions;
    usage_.bytes += bytes;
    usage_.metadata_bytes += exported;
    ++owner.regions;
    owner.bytes += bytes;
  } else {
    --usage_.regions;
    usage_.bytes -= bytes;
    usage_.metadata_bytes -= exported;
    --owner.regions;
    owner.bytes -= bytes;
    if (owner.regions == 0) by_owner_.erase(region.owner);
  }
}

RegistryUsage RegionRegistry::Usage() const {
  absl::ReaderMutexLock lock(&mu_);
  RegistryUsage usage = usage_;
  for (const auto& [owner, counts] : by_owner_) {
    usage.largest_owner_regions = std::max(usage.largest_owner_regions, counts.regions);
    usage.largest_owner_bytes = std::max(usage.largest_owner_bytes, counts.bytes);
  }
  return usage;
}

uint64_t ExportBytes(const v1::RegionSpec& spec, uint64_t rkey_bytes) {
  // Each string with a tag and a length prefix, the layout and the fixed-size fields
  // (addresses, ids, kinds, path) with theirs: an upper bound for this proto.
  constexpr uint64_t kFixed = 96;
  return spec.name().size() + spec.group().size() + spec.role().size() + rkey_bytes +
         4 * 3 + 3 + kFixed;
}

void RegionRegistry::ExportRegion(const Region& region, bool same_host,
                                  v1::ExportedRegion* out) const {
  out->set_name(region.spec.name());
  out->set_kind(region.spec.kind());
  out->set_group(region.spec.group());
  out->set_group_position(region.group_position);
  out->set_role(region.spec.role());
  out->set_memory(region.spec.memory());
  out->set_base_address(region.base_address);
  out->set_length(region.spec.length());
  *out->mutable_layout() = region.spec.layout();
  out->set_rkey(region.registration.packed_rkey());
  out->set_memory_path(region.memory_path);
  // Where the memory is, only to a peer on this host (it can map it itself): by the
  // object's id, whose descriptor it fetches over the session socket.
  if (!same_host) return;
  if (region.mapping.memory() != nullptr) {
    out->set_memory_id(region.mapping.memory()->id());
    out->set_memory_offset(region.mapping.offset());
  }
  if (region.spec.has_cuda_ipc()) {
    out->set_cuda_ipc_handle(region.spec.cuda_ipc().ipc_handle());
    out->set_cuda_device(region.spec.cuda_ipc().device());
    out->set_cuda_offset(region.spec.cuda_ipc().offset());
  }
  // VRAM by cuda_vmm: the allocation's id (the peer fetches its descriptor over the
  // session socket, FindDeviceMemory), its size and device, and the region's offset.
  if (region.vmm != nullptr) {
    const DeviceMemoryObject& memory = *region.vmm->memory();
    out->set_cuda_vmm_id(memory.id());
    out->set_cuda_vmm_bytes(memory.bytes());
    out->set_cuda_vmm_offset(region.spec.cuda_vmm().offset());
    out->set_cuda_device(memory.device());
  }
}

void RegionRegistry::Export(v1::AgentMetadata* metadata, bool same_host) const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<const Entry*> entries;
  entries.reserve(regions_.size());
  for (const auto& [name, entry] : regions_) entries.push_back(&entry);
  std::sort(entries.begin(), entries.end(),
            [](const Entry* a, const Entry* b) { return a->sequence < b->sequence; });
  metadata->clear_regions();
  metadata->mutable_regions()->Reserve(static_cast<int>(entries.size()));
  for (const Entry* entry : entries) {
    ExportRegion(*entry->region, same_host, metadata->add_regions());
  }
  metadata->set_version(version_);
}

void RegionRegistry::LogChange(Change change) {
  for (const auto* names : {&change.added, &change.removed, &change.renumbered}) {
    for (const std::string& name : *names) change.bytes += name.size() + 32;
  }
  if (change.bytes > kChangeLogBytes) {
    // Too big to keep: nobody gets a delta across it.
    changes_.clear();
    change_bytes_ = 0;
    log_base_ = change.version;
    return;
  }
  change_bytes_ += change.bytes;
  changes_.push_back(std::move(change));
  while (changes_.size() > kChangeLogVersions || change_bytes_ > kChangeLogBytes) {
    change_bytes_ -= changes_.front().bytes;
    log_base_ = changes_.front().version;
    changes_.pop_front();
  }
}

bool RegionRegistry::ExportDelta(uint64_t known_version, v1::AgentMetadata* metadata,
                                 bool same_host) const {
  absl::ReaderMutexLock lock(&mu_);
  if (known_version < log_base_ || known_version > version_) return false;
  // Each name's state at known_version is what its first change after it tells:
  // "added" means it did not exist then; "removed" or "renumbered" that it did.
  absl::flat_hash_map<absl::string_view, bool> existed;
  auto first_seen = [&](const std::vector<std::string>& names, bool existed_before) {
    for (const std::string& name : names) existed.try_emplace(name, existed_before);
  };
  // Versions are consecutive, so the entries after known_version are the last ones.
  const size_t newer = static_cast<size_t>(version_ - known_version);
  for (size_t i = changes_.size() - newer; i < changes_.size(); ++i) {
    first_seen(changes_[i].added, false);
    first_seen(changes_[i].removed, true);
    first_seen(changes_[i].renumbered, true);
  }
  std::vector<const Entry*> upserts;
  std::vector<absl::string_view> removed;
  for (const auto& [name, existed_before] : existed) {
    auto it = regions_.find(name);
    if (it != regions_.end()) {
      upserts.push_back(&it->second);
    } else if (existed_before) {
      removed.push_back(name);
    }
  }
  std::sort(upserts.begin(), upserts.end(),
            [](const Entry* a, const Entry* b) { return a->sequence < b->sequence; });
  std::sort(removed.begin(), removed.end());
  metadata->clear_regions();
  metadata->mutable_regions()->Reserve(static_cast<int>(upserts.size()));
  for (const Entry* entry : upserts) {
    ExportRegion(*entry->region, same_host, metadata->add_regions());
  }
  for (absl::string_view name : removed) metadata->add_removed_regions(std::string(name));
  metadata->set_delta(true);
  metadata->set_base_version(known_version);
  metadata->set_version(version_);
  return true;
}

std::shared_ptr<const MemoryObject> RegionRegistry::FindMemory(uint64_t memory_id) const {
  if (memory_id == 0) return nullptr;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [name, entry] : regions_) {
    const std::shared_ptr<const MemoryObject>& memory = entry.region->mapping.memory();
    if (memory != nullptr && memory->id() == memory_id) return memory;
  }
  return nullptr;
}

std::shared_ptr<const DeviceMemoryObject> RegionRegistry::FindDeviceMemory(
    uint64_t device_memory_id) const {
  if (device_memory_id == 0) return nullptr;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [name, entry] : regions_) {
    const std::shared_ptr<const CudaVmmMapping>& vmm = entry.region->vmm;
    if (vmm != nullptr && vmm->memory()->id() == device_memory_id) return vmm->memory();
  }
  return nullptr;
}

}  // namespace kvagent::registry
