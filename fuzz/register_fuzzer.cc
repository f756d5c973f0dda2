// Fuzz target: a RegisterRegions request, as bytes, through RegionRegistry::Register
// on a real UCX context and real shm objects, on top of two regions registered
// beforehand: one of the same owner, one of another owner (group "theirs"). Accepted
// regions must be mapped, inside their objects, owned by the caller, exportable to
// peers (same host or not) and deregistrable; rejected batches must leave the
// registry unchanged and name every bad entry in bounded one-line messages; the other
// owner's region can be neither joined nor removed. Shm names in the input are
// redirected to objects this target created (or to a missing, a malformed or a
// forbidden name, refused before anything is opened) and memory handles to memfds it
// created (or to an unknown handle), so fuzzing never opens other files.

#include <unistd.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/hash/hash.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "base/format.h"
#include "base/text.h"
#include "fuzz/fuzz_check.h"
#include "fuzz/fuzz_target.h"
#include "proto/kvagent.pb.h"
#include "registry/region_registry.h"
#include "registry/remote_catalog.h"
#include "registry/shm_mapping.h"
#include "transport/ucx_context.h"

namespace kvagent::fuzz {
namespace {

using registry::MemoryObject;
using registry::RegionPtr;
using registry::RegionRegistry;

constexpr int kMaxRegions = 64;  // a 4 KiB input holds about that many specs anyway
constexpr uint64_t kObjectBytes[] = {16384, 65536, 4096 + 512};
constexpr uint64_t kMemfdBytes[] = {16384, 8192};
constexpr char kOwner[] = "session:1 uid:1000 (fuzz)";
constexpr char kOtherOwner[] = "session:2 uid:1001 (other)";
constexpr uint64_t kUnknownHandle = ~uint64_t{0};

struct Fixture {
  Fixture() {
    auto created = transport::UcxContext::Create();
    FUZZ_CHECK(created.ok(), "UCX context: {}", created.status().message());
    context = std::move(created).value();
    for (size_t i = 0; i < sizeof(kObjectBytes) / sizeof(kObjectBytes[0]); ++i) {
      const std::string name = ShmName(std::to_string(i));
      auto shm = registry::ShmMapping::Create(name, kObjectBytes[i]);
      FUZZ_CHECK(shm.ok(), "shm object {}: {}", name, shm.status().message());
      objects.push_back(std::move(shm).value());
      names.push_back(name);
      UnlinkOnFailure(name);
    }
    names.push_back(ShmName("missing"));
    names.push_back("not-absolute");
    names.push_back("/etc/passwd");             // outside the allowed directories
    names.push_back("/dev/shm/../etc/passwd");  // through ".."
    for (uint64_t bytes : kMemfdBytes) {
      auto memfd = MemoryObject::CreateMemfd("fuzz", bytes);
      FUZZ_CHECK(memfd.ok(), "memfd: {}", memfd.status().message());
      memfds.push_back(*std::move(memfd));
    }
    auto other = MemoryObject::CreateMemfd("other", 4096);
    FUZZ_CHECK(other.ok(), "memfd: {}", other.status().message());
    other_memory = *std::move(other);
  }
  // The caller's: by name only its own files in /dev/shm; handles are its memfds.
  registry::RegisterContext Caller() const {
    registry::RegisterContext context;
    context.owner = kOwner;
    context.path_policy.required_uid = geteuid();
    context.resolve_handle =
        [this](uint64_t handle) -> absl::StatusOr<std::shared_ptr<const MemoryObject>> {
      for (const auto& memfd : memfds) {
        if (memfd->id() == handle) return memfd;
      }
      return absl::NotFoundError(fmt::format("memory handle {} is not this session's", handle));
    };
    return context;
  }
  std::unique_ptr<transport::UcxContext> context;
  std::vector<registry::ShmMapping> objects;  // unlinked at a normal exit
  std::vector<std::string> names;  // the objects', then a missing, a bad and forbidden ones
  std::vector<std::shared_ptr<const MemoryObject>> memfds;  // the caller's handles
  std::shared_ptr<const MemoryObject> other_memory;         // the other owner's
};

// Destroyed at a normal exit (libFuzzer's time limit, the replay test), which unlinks
// the objects; fuzz/run.sh removes what a crash leaves.
const Fixture& GetFixture() {
  static Fixture fixture;
  return fixture;
}

// "@N" picks object N (seeds use it); any other non-empty name picks one by hash.
// Memory handle N (from 1) picks memfd N-1, or an unknown handle past the memfds.
void RedirectShmName(const Fixture& f, v1::RegionSpec* spec) {
  if (spec->has_shm() && spec->shm().memory_handle() != 0) {
    const uint64_t pick = (spec->shm().memory_handle() - 1) % (f.memfds.size() + 1);
    spec->mutable_shm()->set_memory_handle(pick < f.memfds.size() ? f.memfds[pick]->id()
                                                                  : kUnknownHandle);
  }
  if (!spec->has_shm() || spec->shm().name().empty()) return;
  const std::string& name = spec->shm().name();
  size_t pick = absl::Hash<std::string>{}(name) % f.names.size();
  if (name.size() == 2 && name[0] == '@' && name[1] >= '0' && name[1] <= '9') {
    pick = static_cast<size_t>(name[1] - '0') % f.names.size();
  }
  spec->mutable_shm()->set_name(f.names[pick]);
}

bool AllowedCode(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kPermissionDenied:
      return true;
    default:
      return false;
  }
}

std::vector<std::string> Names(const RegionRegistry& registry) {
  std::vector<std::string> names;
  for (const RegionPtr& region : registry.List()) names.push_back(region->spec.name());
  return names;
}

void CheckGroups(const RegionRegistry& registry) {
  for (const std::string& group : registry.GroupNames()) {
    const std::vector<RegionPtr> members = registry.FindGroup(group);
    FUZZ_CHECK(!members.empty(), "group '{}' listed but empty", group);
    std::set<std::string> roles;  // a role names one region of its group
    for (size_t p = 0; p < members.size(); ++p) {
      const std::string& role = members[p]->spec.role();
      FUZZ_CHECK(role.empty() || roles.insert(role).second, "group '{}' has role '{}' twice",
                 group, role);
      FUZZ_CHECK(members[p]->Info().group_position() == p && members[p]->spec.group() == group,
                 "group '{}' position {} holds '{}' at position {}", group, p,
                 members[p]->spec.name(), members[p]->Info().group_position());
      FUZZ_CHECK(members[p]->num_items() == members[0]->num_items(),
                 "group '{}' mixes {} and {} items", group, members[p]->num_items(),
                 members[0]->num_items());
    }
  }
}

void CheckRegion(const Fixture& f, const registry::Region& region) {
  const v1::RegionSpec& spec = region.spec;
  FUZZ_CHECK(spec.memory() == v1::DRAM, "region '{}' memory {} registered without a GPU",
             spec.name(), static_cast<int>(spec.memory()));
  FUZZ_CHECK(spec.length() > 0 && region.item_bytes() > 0 && region.num_items() > 0 &&
                 region.item_stride() >= region.item_bytes(),
             "region '{}' length {} layout {}x{} stride {}", spec.name(), spec.length(),
             region.num_items(), region.item_bytes(), region.item_stride());
  const unsigned __int128 last_end =
      static_cast<unsigned __int128>(region.num_items() - 1) * region.item_stride() +
      region.item_bytes();
  FUZZ_CHECK(last_end <= spec.length(), "region '{}' items end beyond length {}", spec.name(),
             spec.length());
  // The mapping covers [base, base+length) of one of our objects: read its ends
  // (ASan and the kernel both object otherwise).
  FUZZ_CHECK(region.mapping.data() != nullptr &&
                 reinterpret_cast<uint64_t>(region.mapping.data()) == region.base_address &&
                 region.mapping.length() == spec.length(),
             "region '{}' mapping does not match base/length", spec.name());
  // Inside one of the caller's objects: a memfd it passed by handle, or a file it
  // created, opened by name (another descriptor of the same inode).
  const std::shared_ptr<const MemoryObject>& memory = region.mapping.memory();
  FUZZ_CHECK(memory != nullptr, "region '{}' has no memory object", spec.name());
  bool inside = false;
  auto check_inside = [&](uint64_t bytes) {
    inside = spec.shm().offset() <= bytes && spec.length() <= bytes - spec.shm().offset();
  };
  if (spec.shm().memory_handle() != 0) {
    for (size_t i = 0; i < f.memfds.size(); ++i) {
      if (memory == f.memfds[i]) check_inside(kMemfdBytes[i]);
    }
  } else {
    for (size_t i = 0; i < f.objects.size(); ++i) {
      if (spec.shm().name() == f.names[i] && memory->device() == f.objects[i].device() &&
          memory->inode() == f.objects[i].inode()) {
        check_inside(kObjectBytes[i]);
      }
    }
  }
  FUZZ_CHECK(inside, "region '{}' [{}, +{}) accepted outside object '{}' / handle {}", spec.name(),
             spec.shm().offset(), spec.length(), spec.shm().name(), spec.shm().memory_handle());
  FUZZ_CHECK(region.mapping.offset() == spec.shm().offset(), "region '{}' mapped at offset {}",
             spec.name(), region.mapping.offset());
  FUZZ_CHECK(spec.role().size() <= registry::CatalogLimits{}.max_role_bytes &&
                 !HasControlCharacter(spec.role()),
             "region '{}' accepted with a role of {} bytes or with a control character",
             spec.name(), spec.role().size());
  FUZZ_CHECK(region.owner == kOwner && region.spec.group() != "theirs",
             "region '{}' registered for '{}' in group '{}'", spec.name(), region.owner,
             region.spec.group());
  const volatile char* bytes = static_cast<const volatile char*>(region.mapping.data());
  (void)bytes[0];
  (void)bytes[spec.length() - 1];
  FUZZ_CHECK(!region.registration.packed_rkey().empty(), "region '{}' has no rkey", spec.name());
}

void Run(const v1::RegisterRegionsRequest& request) {
  const Fixture& f = GetFixture();
  RegionRegistry registry(f.context.get());
  // One region registered before, so that names and groups can collide with it.
  v1::RegionSpec base;
  base.set_name("base");
  base.set_kind(v1::KV);
  base.set_group("kv");
  base.set_memory(v1::DRAM);
  base.set_length(4096);
  base.mutable_layout()->set_num_items(16);
  base.mutable_layout()->set_item_bytes(256);
  base.mutable_shm()->set_name(f.names[0]);
  base.mutable_shm()->set_offset(0);
  const registry::RegisterContext caller = f.Caller();
  auto pre = registry.Register({base}, false, caller);
  FUZZ_CHECK(pre.ok(), "baseline region: {}", pre.status().message());
  // And one of another owner, in its own memory, group "theirs".
  v1::RegionSpec theirs = base;
  theirs.set_name("other");
  theirs.set_group("theirs");
  theirs.mutable_shm()->clear_name();
  theirs.mutable_shm()->set_memory_handle(f.other_memory->id());
  registry::RegisterContext other_owner;
  other_owner.owner = kOtherOwner;
  other_owner.resolve_handle = [&f](uint64_t) {
    return absl::StatusOr<std::shared_ptr<const MemoryObject>>(f.other_memory);
  };
  auto other = registry.Register({theirs}, false, other_owner);
  FUZZ_CHECK(other.ok(), "the other owner's region: {}", other.status().message());

  std::vector<v1::RegionSpec> specs(request.regions().begin(), request.regions().end());
  for (v1::RegionSpec& spec : specs) RedirectShmName(f, &spec);
  const std::vector<std::string> names_before = Names(registry);
  const uint64_t version_before = registry.version();

  auto result = registry.Register(specs, request.skip_empty(), caller);
  if (!result.ok()) {
    const absl::Status& status = result.status();
    FUZZ_CHECK(AllowedCode(status.code()), "rejection with code {}: {}",
               static_cast<int>(status.code()), status.message());
    // Client bytes are echoed escaped and bounded: one line per entry (after a count
    // line when there are several), no other control bytes, no huge messages.
    size_t lines = 0;
    for (char c : status.message()) {
      FUZZ_CHECK(static_cast<unsigned char>(c) >= 0x20 || c == '\n',
                 "control byte {:#x} in a rejection: {}", static_cast<unsigned char>(c),
                 status.message());
      lines += c == '\n';
    }
    FUZZ_CHECK(lines <= specs.size() && status.message().size() <= 1024 * (specs.size() + 1),
               "rejection of {} entries has {} line breaks and {} bytes", specs.size(), lines,
               status.message().size());
    // One entry: "region '<name>' (entry N): ..."; several: a count, then one such
    // line each (names are the client's own bytes, so they may hold newlines too).
    FUZZ_CHECK(absl::StartsWith(status.message(), "region '") ||
                   absl::StrContains(status.message(), "regions rejected; nothing was registered"),
               "rejection does not name its entries: {}", status.message());
    FUZZ_CHECK(registry.version() == version_before && Names(registry) == names_before,
               "a rejected batch changed the registry: {}", status.message());
    return;
  }
  FUZZ_CHECK(result->regions.size() + result->skipped.size() == specs.size(),
             "{} registered + {} skipped of {}", result->regions.size(), result->skipped.size(),
             specs.size());
  FUZZ_CHECK(result->skipped.empty() || request.skip_empty(), "skipped without skip_empty");
  FUZZ_CHECK(result->version == registry.version() &&
                 registry.version() == version_before + (result->regions.empty() ? 0 : 1),
             "version {} after {} (result says {})", registry.version(), version_before,
             result->version);
  for (const RegionPtr& region : result->regions) {
    CheckRegion(f, *region);
    FUZZ_CHECK(registry.Find(region->spec.name()) == region, "Find('{}') misses",
               region->spec.name());
  }
  CheckGroups(registry);

  // What we export, peers must accept: otherwise one odd region breaks every peer's
  // connection to this agent.
  // Remote peers learn nothing about where the memory is; same-host peers get each
  // DRAM region's object id, which resolves to that region's object.
  for (const bool same_host : {false, true}) {
    v1::AgentMetadata metadata;
    metadata.set_name("fuzz-agent");
    metadata.set_worker_address("worker-address");
    registry.Export(&metadata, same_host);
    auto catalog = registry::RemoteCatalog::FromMetadata(metadata);
    FUZZ_CHECK(catalog.ok(), "peers would reject our export: {}", catalog.status().message());
    for (const v1::ExportedRegion& exported : metadata.regions()) {
      const RegionPtr region = registry.Find(exported.name());
      FUZZ_CHECK(region != nullptr, "exported '{}' is not registered", exported.name());
      if (!same_host) {
        FUZZ_CHECK(exported.memory_id() == 0 && exported.memory_offset() == 0 &&
                       exported.cuda_ipc_handle().empty(),
                   "region '{}' tells a remote peer where its memory is", exported.name());
        continue;
      }
      FUZZ_CHECK(exported.memory_id() == region->mapping.memory()->id() &&
                     exported.memory_offset() == region->mapping.offset() &&
                     registry.FindMemory(exported.memory_id()) == region->mapping.memory(),
                 "region '{}' exports memory {} at {}", exported.name(), exported.memory_id(),
                 exported.memory_offset());
    }
  }

  // The other owner's region can be neither removed nor joined by the caller.
  auto foreign = registry.Deregister({"other"}, nullptr, kOwner, false);
  FUZZ_CHECK(foreign.status().code() == absl::StatusCode::kPermissionDenied &&
                 registry.Find("other") != nullptr,
             "the caller removed another owner's region: {}", foreign.status().message());

  // Deregister the new regions: groups renumber 0..n-1, the baseline stays.
  std::vector<std::string> added;
  for (const RegionPtr& region : result->regions) added.push_back(region->spec.name());
  if (!added.empty()) {
    auto version = registry.Deregister(added, nullptr, kOwner, false);
    FUZZ_CHECK(version.ok() && *version == registry.version(), "deregister: {}",
               version.status().message());
    FUZZ_CHECK(Names(registry) == names_before, "deregister left {} regions",
               registry.List().size());
    CheckGroups(registry);
  }
}

}  // namespace

const google::protobuf::Message& InputPrototype() {
  return v1::RegisterRegionsRequest::default_instance();
}
const char* TargetName() { return "register"; }

}  // namespace kvagent::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kvagent::v1::RegisterRegionsRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  if (request.regions_size() > kvagent::fuzz::kMaxRegions) return 0;
  kvagent::fuzz::Run(request);
  return 0;
}
