#include "registry/region_registry.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "registry/remote_catalog.h"
#include "tests/unit/registry/test_util.h"

namespace kvagent::registry {
namespace {

using testing::MakeShm;
using testing::Spec;

using testing::Context;
using testing::Registrant;

std::string Message(const absl::Status& status) { return std::string(status.message()); }

std::vector<std::string> Names(const std::vector<RegionPtr>& regions) {
  std::vector<std::string> names;
  for (const RegionPtr& region : regions) names.push_back(region->spec.name());
  return names;
}

v1::RegionSpec Aux(const std::string& name, const std::string& shm, uint64_t offset,
                   uint64_t length) {
  v1::RegionSpec spec;
  spec.set_name(name);
  spec.set_kind(v1::AUX);
  spec.set_length(length);  // memory left UNSPECIFIED: treated as DRAM
  spec.mutable_shm()->set_name(shm);
  spec.mutable_shm()->set_offset(offset);
  return spec;
}

// k.L0 [0, 16K), v.L0 [16K, 32K): 4 items of 4 KiB each; aux [32K, 32K+100).
std::vector<v1::RegionSpec> Batch(const std::string& shm) {
  return {Spec("k.L0", shm, 0, 16384, 4, 4096, "kv"),
          Spec("v.L0", shm, 16384, 16384, 4, 4096, "kv"), Aux("aux", shm, 32768, 100)};
}

TEST_CASE("A valid batch is registered, listed, grouped and exported") {
  ShmMapping shm = MakeShm(65536);
  for (int i = 0; i < 65536; ++i) static_cast<unsigned char*>(shm.data())[i] = i % 251;
  RegionRegistry registry(&Context());
  auto result = registry.Register(Batch(shm.name()), false, Registrant());
  REQUIRE(result.ok());
  CHECK(result->version == 1);
  CHECK(registry.version() == 1);
  CHECK(result->skipped.empty());
  CHECK(Names(result->regions) == std::vector<std::string>{"k.L0", "v.L0", "aux"});
  CHECK(Names(registry.List()) == std::vector<std::string>{"k.L0", "v.L0", "aux"});
  CHECK(registry.registered_bytes() == 16384 + 16384 + 100);
  CHECK(registry.GroupNames() == std::vector<std::string>{"kv"});

  auto group = registry.FindGroup("kv");
  REQUIRE(Names(group) == std::vector<std::string>{"k.L0", "v.L0"});
  CHECK(group[0]->group_position == 0);
  CHECK(group[1]->group_position == 1);
  CHECK(registry.FindGroup("none").empty());

  // The agent's mapping shows the engine's bytes at the region's offset.
  RegionPtr v = registry.Find("v.L0");
  REQUIRE(v != nullptr);
  CHECK(std::memcmp(reinterpret_cast<void*>(v->ItemAddress(1)),
                    static_cast<char*>(shm.data()) + 16384 + 4096, 4096) == 0);
  CHECK(v->item_stride() == 4096);  // 0 normalized
  v1::RegionInfo info = v->Info();
  CHECK(info.group_position() == 1);
  CHECK(info.base_address() == v->base_address);
  CHECK(info.memory_path() == "host");
  CHECK(info.spec().name() == "v.L0");

  RegionPtr aux = registry.Find("aux");
  REQUIRE(aux != nullptr);
  CHECK(aux->num_items() == 1);
  CHECK(aux->item_bytes() == 100);
  CHECK(aux->spec.memory() == v1::DRAM);

  v1::AgentMetadata md;
  registry.Export(&md, /*same_host=*/false);
  CHECK(md.version() == 1);
  REQUIRE(md.regions_size() == 3);
  CHECK(md.regions(1).name() == "v.L0");
  CHECK(md.regions(1).group_position() == 1);
  CHECK(md.regions(1).base_address() == v->base_address);
  CHECK(md.regions(1).length() == 16384);
  CHECK(md.regions(1).layout().item_bytes() == 4096);
  CHECK_FALSE(md.regions(1).rkey().empty());
  CHECK(md.regions(1).rkey() == v->registration.packed_rkey());

  // What peers receive is a valid catalog.
  md.set_name("prefill-0");
  md.set_worker_address("address");
  auto catalog = RemoteCatalog::FromMetadata(md);
  REQUIRE(catalog.ok());
  auto remote = catalog->FindGroup("kv");
  REQUIRE(remote.size() == 2);
  CHECK(remote[1]->name == "v.L0");
  CHECK(remote[1]->rkey_slot == 1);
  CHECK(remote[1]->ItemAddress(2) == v->ItemAddress(2));
  CHECK(catalog->Find("aux")->length == 100);
}

TEST_CASE("Group positions follow registration order across batches and deregistration") {
  ShmMapping shm = MakeShm(65536);
  RegionRegistry registry(&Context());
  REQUIRE(
      registry.Register({Spec("a", shm.name(), 0, 4096, 4, 1024, "g")}, false, Registrant()).ok());
  REQUIRE(registry
              .Register({Spec("b", shm.name(), 4096, 4096, 4, 1024, "g"),
                         Spec("c", shm.name(), 8192, 4096, 4, 1024, "g")},
                        false, Registrant())
              .ok());
  CHECK(registry.version() == 2);
  auto group = registry.FindGroup("g");
  REQUIRE(Names(group) == std::vector<std::string>{"a", "b", "c"});
  CHECK(group[2]->group_position == 2);

  RegionPtr held = registry.Find("a");
  auto version = registry.Deregister({"a"}, nullptr, "test-owner", false);
  REQUIRE(version.ok());
  CHECK(*version == 3);
  CHECK(registry.Find("a") == nullptr);
  group = registry.FindGroup("g");
  REQUIRE(Names(group) == std::vector<std::string>{"b", "c"});
  CHECK(group[0]->Info().group_position() == 0);
  CHECK(group[1]->Info().group_position() == 1);
  v1::AgentMetadata md;
  registry.Export(&md, /*same_host=*/false);
  md.set_name("p");
  md.set_worker_address("w");
  CHECK(RemoteCatalog::FromMetadata(md).ok());  // positions are 0..n-1 again
  // A transfer still holding the region keeps its memory mapped.
  static_cast<char*>(reinterpret_cast<void*>(held->base_address))[0] = 42;
  CHECK(static_cast<char*>(shm.data())[0] == 42);
}

// FindGroup no longer sorts and VisitGroup reads the group in place: both rely on the
// registry keeping each group's members in position order through every change.
TEST_CASE("A group is read in position order after removals from its middle and new members") {
  ShmMapping shm = MakeShm(65536);
  RegionRegistry registry(&Context());
  REQUIRE(registry
              .Register({Spec("a", shm.name(), 0, 4096, 4, 1024, "g"),
                         Spec("b", shm.name(), 4096, 4096, 4, 1024, "g"),
                         Spec("c", shm.name(), 8192, 4096, 4, 1024, "g"),
                         Spec("d", shm.name(), 12288, 4096, 4, 1024, "g")},
                        false, Registrant())
              .ok());
  REQUIRE(registry.Deregister({"c", "a"}, nullptr, "test-owner", false).ok());
  REQUIRE(registry
              .Register({Spec("e", shm.name(), 16384, 4096, 4, 1024, "g"),
                         Spec("f", shm.name(), 20480, 4096, 4, 1024, "g")},
                        false, Registrant())
              .ok());
  REQUIRE(registry.Deregister({"e"}, nullptr, "test-owner", false).ok());
  REQUIRE(registry.Register({Spec("a", shm.name(), 0, 4096, 4, 1024, "g")}, false, Registrant())
              .ok());
  const std::vector<std::string> expected{"b", "d", "f", "a"};
  auto group = registry.FindGroup("g");
  CHECK(Names(group) == expected);
  for (size_t i = 0; i < group.size(); ++i) CHECK(group[i]->Info().group_position() == i);
  std::vector<std::string> visited;
  std::vector<uint32_t> positions;
  CHECK(registry.VisitGroup("g", [&](const Region& region) {
    visited.push_back(region.spec.name());
    positions.push_back(region.Info().group_position());
  }));
  CHECK(visited == expected);
  CHECK(positions == std::vector<uint32_t>{0, 1, 2, 3});
  CHECK_FALSE(registry.VisitGroup("none", [](const Region&) { FAIL("visited an unknown group"); }));
  CHECK_FALSE(registry.VisitGroup("", [](const Region&) { FAIL("visited the empty group"); }));
}

struct Rejected {
  absl::Status status;
  std::string message;
};

// Registers `specs` into a registry that already holds one region and checks that a
// failed batch leaves it exactly as it was.
Rejected RegisterBad(const std::vector<v1::RegionSpec>& specs, const ShmMapping& shm) {
  RegionRegistry registry(&Context());
  REQUIRE(
      registry.Register({Spec("old", shm.name(), 61440, 4096, 1, 4096, "kv2")}, false, Registrant())
          .ok());
  auto result = registry.Register(specs, false, Registrant());
  REQUIRE_FALSE(result.ok());
  CHECK(registry.version() == 1);
  CHECK(Names(registry.List()) == std::vector<std::string>{"old"});
  return {result.status(), Message(result.status())};
}

TEST_CASE("Bad entries are rejected with their name, cause and fix") {
  ShmMapping shm = MakeShm(65536);
  const std::string name = shm.name();
  using absl::StatusCode;

  SECTION("duplicate names, in the batch and already registered") {
    auto r = RegisterBad({Spec("x", name, 0, 4096, 1, 4096), Spec("x", name, 4096, 4096, 1, 4096)},
                         shm);
    CHECK(r.status.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(r.message, Catch::Contains("region 'x' (entry 1): name repeats entry 0"));
    r = RegisterBad({Spec("old", name, 0, 4096, 1, 4096)}, shm);
    CHECK_THAT(r.message, Catch::Contains("region 'old' (entry 0): name is already registered"));
  }
  SECTION("zero length") {
    auto r = RegisterBad({Spec("z", name, 0, 0, 1, 4096)}, shm);
    CHECK(r.status.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(r.message, Catch::Contains("region 'z' (entry 0): length is 0"));
    CHECK_THAT(r.message, Catch::Contains("skip_empty"));
  }
  SECTION("layout beyond length") {
    auto r = RegisterBad({Spec("l", name, 0, 4096, 5, 1024)}, shm);
    CHECK_THAT(r.message, Catch::Contains("region 'l' (entry 0): layout (5 items"));
    r = RegisterBad({Spec("l", name, 0, 4096, uint64_t{1} << 62, 8, "", 8)}, shm);
    CHECK_THAT(r.message, Catch::Contains("ends beyond the region's length 4096"));
  }
  SECTION("stride smaller than item size, zero item size") {
    auto r = RegisterBad({Spec("s", name, 0, 4096, 2, 1024, "", 512)}, shm);
    CHECK_THAT(r.message, Catch::Contains("item_stride 512 is smaller than item_bytes 1024"));
    r = RegisterBad({Spec("s", name, 0, 4096, 2, 0)}, shm);
    CHECK_THAT(r.message, Catch::Contains("item_bytes 0"));
  }
  SECTION("overlap, in the batch and with a registered region") {
    auto r = RegisterBad({Spec("a", name, 0, 8192, 2, 4096), Spec("b", name, 4096, 8192, 2, 4096)},
                         shm);
    CHECK(r.status.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(r.message, Catch::Contains("region 'b' (entry 1): bytes [4096, 12288)"));
    CHECK_THAT(r.message, Catch::Contains("overlap region 'a'"));
    r = RegisterBad({Spec("c", name, 60000, 2000, 1, 2000)}, shm);
    CHECK_THAT(r.message, Catch::Contains("region 'c' (entry 0)"));
    CHECK_THAT(r.message, Catch::Contains("overlap region 'old'"));
  }
  SECTION("group whose regions disagree in num_items") {
    auto r = RegisterBad({Spec("k", name, 0, 8192, 2, 4096, "kv"),
                          Spec("v", name, 8192, 8192, 4, 2048, "kv")},
                         shm);
    CHECK_THAT(r.message, Catch::Contains("region 'v' (entry 1): has 4 items but region 'k' of "
                                          "group 'kv' has 2"));
    r = RegisterBad({Spec("k", name, 0, 8192, 2, 4096, "kv2")}, shm);
    CHECK_THAT(r.message, Catch::Contains("region 'old' of group 'kv2' has 1"));
  }
  SECTION("missing shm object and missing source") {
    auto r = RegisterBad({Spec("m", "/kvagent-test-missing-object", 0, 4096, 1, 4096)}, shm);
    CHECK(r.status.code() == StatusCode::kNotFound);
    CHECK_THAT(r.message, Catch::Contains("region 'm' (entry 0): shm name "
                                          "'/kvagent-test-missing-object' does not exist"));
    v1::RegionSpec no_source = Spec("n", name, 0, 4096, 1, 4096);
    no_source.clear_shm();
    r = RegisterBad({no_source}, shm);
    CHECK(r.status.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(r.message, Catch::Contains("region 'n' (entry 0): DRAM region has no shm source"));
  }
  SECTION("shm object too small") {
    auto r = RegisterBad({Spec("big", name, 4096, 65536, 1, 4096)}, shm);
    CHECK(r.status.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(r.message, Catch::Contains("region 'big' (entry 0)"));
    CHECK_THAT(r.message, Catch::Contains("65536 bytes, smaller than offset 4096 + length 65536"));
  }
  SECTION("VRAM") {
    v1::RegionSpec vram = Spec("gpu", name, 0, 4096, 1, 4096);
    vram.set_memory(v1::VRAM);
    auto r = RegisterBad({vram}, shm);  // a shm source: VRAM needs cuda_ipc
    CHECK(r.status.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(r.message, Catch::Contains("region 'gpu' (entry 0): VRAM region has a shm source"));
  }
  SECTION("two bad entries are both reported; the code is the first one's") {
    v1::RegionSpec vram = Spec("gpu", name, 0, 4096, 1, 4096);
    vram.set_memory(v1::VRAM);
    auto r = RegisterBad({Spec("fine", name, 0, 4096, 1, 4096),
                          Spec("missing", "/kvagent-test-missing-object", 0, 4096, 1, 4096),
                          vram},
                         shm);
    CHECK(r.status.code() == StatusCode::kNotFound);
    CHECK_THAT(r.message, Catch::Contains("2 of 3 regions rejected"));
    CHECK_THAT(r.message, Catch::Contains("region 'missing' (entry 1)"));
    CHECK_THAT(r.message, Catch::Contains("region 'gpu' (entry 2)"));
    CHECK_THAT(r.message, !Catch::Contains("region 'fine'"));
  }
}

TEST_CASE("skip_empty skips zero-length entries and registers the rest") {
  ShmMapping shm = MakeShm(8192);
  RegionRegistry registry(&Context());
  auto result = registry.Register(
      {Spec("empty", shm.name(), 0, 0, 1, 4096), Spec("real", shm.name(), 0, 4096, 1, 4096)}, true,
      Registrant());
  REQUIRE(result.ok());
  CHECK(result->skipped == std::vector<std::string>{"empty"});
  CHECK(Names(result->regions) == std::vector<std::string>{"real"});
  CHECK(registry.Find("empty") == nullptr);
}

TEST_CASE("A failed batch leaves registered regions listed, usable and the version unchanged") {
  ShmMapping shm = MakeShm(65536);
  RegionRegistry registry(&Context());
  REQUIRE(registry.Register(Batch(shm.name()), false, Registrant()).ok());
  auto bad = registry.Register({Spec("new", shm.name(), 40960, 4096, 1, 4096),
                                Spec("k.L0", shm.name(), 45056, 4096, 1, 4096)},
                               false, Registrant());
  REQUIRE_FALSE(bad.ok());
  CHECK(registry.version() == 1);
  CHECK(registry.Find("new") == nullptr);
  CHECK(Names(registry.List()) == std::vector<std::string>{"k.L0", "v.L0", "aux"});
  RegionPtr k = registry.Find("k.L0");
  REQUIRE(k != nullptr);
  static_cast<char*>(reinterpret_cast<void*>(k->ItemAddress(3)))[5] = 7;
  CHECK(static_cast<char*>(shm.data())[3 * 4096 + 5] == 7);
  // The rejected entry's range is free: registering it alone works.
  auto good =
      registry.Register({Spec("new", shm.name(), 40960, 4096, 1, 4096)}, false, Registrant());
  REQUIRE(good.ok());
  CHECK(good->version == 2);
}

TEST_CASE("Deregister is all-or-nothing") {
  ShmMapping shm = MakeShm(65536);
  RegionRegistry registry(&Context());
  REQUIRE(registry.Register(Batch(shm.name()), false, Registrant()).ok());
  auto result = registry.Deregister({"k.L0", "nope", "gone"}, nullptr, "test-owner", false);
  REQUIRE(result.status().code() == absl::StatusCode::kNotFound);
  CHECK_THAT(Message(result.status()), Catch::Contains("'nope', 'gone'"));
  CHECK_THAT(Message(result.status()), Catch::Contains("kvagentctl regions"));
  CHECK_THAT(Message(result.status()), !Catch::Contains("k.L0"));
  CHECK(registry.version() == 1);
  CHECK(registry.List().size() == 3);
  auto ok = registry.Deregister({"k.L0", "aux"}, nullptr, "test-owner", false);
  REQUIRE(ok.ok());
  CHECK(*ok == 2);
  CHECK(Names(registry.List()) == std::vector<std::string>{"v.L0"});
  CHECK(registry.registered_bytes() == 16384);
}

// ---- Memory by descriptor, ownership, hostile input ---------------------------------

using testing::HandleSpec;

std::shared_ptr<const MemoryObject> Memfd(uint64_t bytes, const std::string& label = "pool") {
  auto object = MemoryObject::CreateMemfd(label, bytes);
  REQUIRE(object.ok());
  return *std::move(object);
}

TEST_CASE("Regions register by memory handle and map the session's memory") {
  auto memory = Memfd(65536);
  RegionRegistry registry(&Context());
  const uint64_t handle = memory->id();
  auto result = registry.Register({HandleSpec("k", handle, 0, 16384, 4, 4096, "kv"),
                                   HandleSpec("v", handle, 16384, 16384, 4, 4096, "kv")},
                                  false, Registrant("session:1 uid:0 (engine-a)", {memory}));
  REQUIRE(result.ok());
  RegionPtr v = registry.Find("v");
  REQUIRE(v != nullptr);
  CHECK(v->owner == "session:1 uid:0 (engine-a)");
  CHECK(v->Info().owner() == "session:1 uid:0 (engine-a)");
  CHECK(v->mapping.memory() == memory);
  CHECK(v->mapping.offset() == 16384);
  void* engine_view = mmap(nullptr, 65536, PROT_READ | PROT_WRITE, MAP_SHARED, memory->fd(), 0);
  REQUIRE(engine_view != MAP_FAILED);
  static_cast<char*>(engine_view)[16384 + 4096 + 3] = 77;
  CHECK(reinterpret_cast<const char*>(v->ItemAddress(1))[3] == 77);
  munmap(engine_view, 65536);

  CHECK(registry.FindMemory(memory->id()) == memory);
  CHECK(registry.FindMemory(memory->id() + 1000) == nullptr);
  CHECK(registry.FindMemory(0) == nullptr);
  REQUIRE(registry.Deregister({"k", "v"}, nullptr, "session:1 uid:0 (engine-a)", false).ok());
  CHECK(registry.FindMemory(memory->id()) == nullptr);  // no region uses it any more
}

TEST_CASE("Memory handles need a resolver; its errors are labeled with the entry") {
  auto memory = Memfd(8192);
  SECTION("no local session") {
    RegisterContext remote_caller = Registrant();
    remote_caller.resolve_handle = nullptr;
    RegionRegistry registry(&Context());
    auto r =
        registry.Register({HandleSpec("h", memory->id(), 0, 4096, 1, 4096)}, false, remote_caller);
    REQUIRE(r.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(Message(r.status()), Catch::Contains("region 'h' (entry 0)"));
    CHECK_THAT(Message(r.status()), Catch::Contains("memory handles need a local session"));
  }
  SECTION("a handle of another session") {
    RegionRegistry registry(&Context());
    auto r = registry.Register({HandleSpec("h", memory->id(), 0, 4096, 1, 4096)}, false,
                               Registrant("someone", {}));
    REQUIRE(r.status().code() == absl::StatusCode::kNotFound);
    CHECK_THAT(Message(r.status()), Catch::StartsWith("region 'h' (entry 0): memory handle"));
  }
  SECTION("out of the object") {
    RegionRegistry registry(&Context());
    auto r = registry.Register({HandleSpec("h", memory->id(), 4096, 8192, 1, 8192)}, false,
                               Registrant("someone", {memory}));
    REQUIRE(r.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(Message(r.status()),
               Catch::Contains("region 'h' (entry 0): memory 'pool' is 8192 bytes, smaller than "
                               "offset 4096 + length 8192"));
  }
}

TEST_CASE("Registration by name refuses paths outside /dev/shm, links and other users' files") {
  ShmMapping shm = MakeShm(65536);
  SECTION("/etc/shadow and a path through ..") {
    auto r = RegisterBad(
        {Spec("s", "/etc/shadow", 0, 64, 1, 64), Spec("p", "/dev/shm/../etc/passwd", 0, 64, 1, 64)},
        shm);
    CHECK(r.status.code() == absl::StatusCode::kPermissionDenied);
    CHECK_THAT(r.message, Catch::Contains("region 's' (entry 0): shm name '/etc/shadow' is not "
                                          "under an allowed directory"));
    CHECK_THAT(r.message, Catch::Contains("region 'p' (entry 1): shm name "
                                          "'/dev/shm/../etc/passwd' has a '..' component"));
  }
  SECTION("a /dev/shm link to a root-only file") {
    testing::ScopedPath link("/dev/shm/" + testing::UniqueName("shadow"));
    REQUIRE(symlink("/etc/shadow", link.path().c_str()) == 0);
    auto r = RegisterBad({Spec("s", link.path(), 0, 64, 1, 64)}, shm);
    CHECK(r.status.code() == absl::StatusCode::kPermissionDenied);
    CHECK_THAT(r.message, Catch::Contains("symbolic link"));
  }
  SECTION("a file another uid owns") {
    // The test's file, registered by a caller of another uid.
    RegisterContext stranger = Registrant("stranger");
    stranger.path_policy.required_uid = geteuid() == 65534 ? 65533 : 65534;
    RegionRegistry registry(&Context());
    auto r = registry.Register({Spec("f", shm.name(), 0, 4096, 1, 4096)}, false, stranger);
    REQUIRE(r.status().code() == absl::StatusCode::kPermissionDenied);
    CHECK_THAT(Message(r.status()), Catch::Contains("region 'f' (entry 0): shm name"));
    CHECK_THAT(Message(r.status()), Catch::Contains("not by the caller"));
    CHECK(registry.List().empty());
  }
}

TEST_CASE("Hostile names, kinds and sizes are refused with short, escaped messages") {
  ShmMapping shm = MakeShm(65536);
  const std::string name = shm.name();
  SECTION("NUL and newline in name, group and shm.name") {
    v1::RegionSpec group = Spec("g", name, 0, 4096, 1, 4096, "kv\nINFO forged");
    auto r = RegisterBad({Spec(std::string("a\0b", 3), name, 0, 4096, 1, 4096),
                          Spec("line\nbreak", name, 4096, 4096, 1, 4096), group,
                          Spec("s", name + "\n", 8192, 4096, 1, 4096)},
                         shm);
    CHECK(r.status.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(r.message, Catch::Contains("4 of 4 regions rejected"));
    CHECK_THAT(r.message, Catch::Contains("region 'a\\x00b' (entry 0): name contains a NUL or "
                                          "control character"));
    CHECK_THAT(r.message, Catch::Contains("region 'line\\x0abreak' (entry 1)"));
    CHECK_THAT(r.message, Catch::Contains("region 'g' (entry 2): group 'kv\\x0aINFO forged'"));
    CHECK_THAT(r.message, Catch::Contains("region 's' (entry 3): shm.name"));
    // One line per entry: no byte of the input starts a line of its own.
    CHECK(std::count(r.message.begin(), r.message.end(), '\n') == 4);
    CHECK(r.message.find('\0') == std::string::npos);
  }
  SECTION("a 10 KB name") {
    auto r = RegisterBad({Spec(std::string(10240, 'n'), name, 0, 4096, 1, 4096)}, shm);
    CHECK(r.status.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(r.message, Catch::Contains("(10240 bytes)"));
    CHECK(r.message.size() < 512);
  }
  SECTION("an unknown kind") {
    v1::RegionSpec spec = Spec("k99", name, 0, 4096, 1, 4096);
    spec.set_kind(static_cast<v1::RegionKind>(99));
    auto r = RegisterBad({spec}, shm);
    CHECK(r.status.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(r.message, Catch::Contains("region 'k99' (entry 0): kind 99 is not a region kind; "
                                          "use KV, STATE or AUX"));
    spec.set_kind(v1::REGION_KIND_UNSPECIFIED);  // accepted, as before
    RegionRegistry registry(&Context());
    CHECK(registry.Register({spec}, false, Registrant()).ok());
  }
  SECTION("an unknown memory kind") {
    v1::RegionSpec spec = Spec("m7", name, 0, 4096, 1, 4096);
    spec.set_memory(static_cast<v1::MemoryKind>(7));
    auto r = RegisterBad({spec}, shm);
    CHECK_THAT(r.message, Catch::Contains("region 'm7' (entry 0): unknown memory kind 7; use "
                                          "DRAM or VRAM"));
  }
}

TEST_CASE("A group belongs to the owner of its regions") {
  auto memory = Memfd(65536);
  RegionRegistry registry(&Context());
  REQUIRE(registry
              .Register({HandleSpec("a.k", memory->id(), 0, 4096, 1, 4096, "kv")}, false,
                        Registrant("engine-a", {memory}))
              .ok());
  auto other = Memfd(65536, "b-pool");
  auto r = registry.Register({HandleSpec("b.k", other->id(), 0, 4096, 1, 4096, "kv"),
                              HandleSpec("b.v", other->id(), 4096, 4096, 1, 4096, "kv-b")},
                             false, Registrant("engine-b", {other}));
  REQUIRE(r.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK_THAT(Message(r.status()), Catch::Contains("region 'b.k' (entry 0): group 'kv' belongs to "
                                                  "engine-a; use another group name"));
  CHECK(registry.List().size() == 1);  // all-or-nothing: b.v was not registered either
  // Region names stay unique agent-wide.
  auto same_name = registry.Register({HandleSpec("a.k", other->id(), 0, 4096, 1, 4096, "kv-b")},
                                     false, Registrant("engine-b", {other}));
  CHECK_THAT(Message(same_name.status()), Catch::Contains("name is already registered"));
  // The owner may add to its group; another group name works for the other owner.
  CHECK(registry
            .Register({HandleSpec("a.v", memory->id(), 4096, 4096, 1, 4096, "kv")}, false,
                      Registrant("engine-a", {memory}))
            .ok());
  CHECK(registry
            .Register({HandleSpec("b.k", other->id(), 0, 4096, 1, 4096, "kv-b")}, false,
                      Registrant("engine-b", {other}))
            .ok());
  CHECK(Names(registry.FindGroup("kv")) == std::vector<std::string>{"a.k", "a.v"});
}

TEST_CASE("Only a region's owner, or a caller allowed any owner, deregisters it") {
  auto memory = Memfd(65536);
  auto other = Memfd(65536);
  RegionRegistry registry(&Context());
  REQUIRE(registry
              .Register({HandleSpec("a.k", memory->id(), 0, 4096, 1, 4096, "kv"),
                         HandleSpec("a.v", memory->id(), 4096, 4096, 1, 4096, "kv")},
                        false, Registrant("engine-a", {memory}))
              .ok());
  REQUIRE(registry
              .Register({HandleSpec("b.k", other->id(), 0, 4096, 1, 4096)}, false,
                        Registrant("engine-b", {other}))
              .ok());
  const uint64_t version = registry.version();

  auto refused = registry.Deregister({"b.k", "a.k", "a.v"}, nullptr, "engine-b", false);
  REQUIRE(refused.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK_THAT(Message(refused.status()),
             Catch::Contains("regions 'a.k' (owned by engine-a), 'a.v' (owned by engine-a) "
                             "belong to another owner, not to engine-b"));
  CHECK_THAT(Message(refused.status()), Catch::Contains("nothing was deregistered"));
  CHECK(registry.version() == version);
  CHECK(Names(registry.List()) == std::vector<std::string>{"a.k", "a.v", "b.k"});

  // Unknown names are NOT_FOUND, and reported together with the foreign ones.
  auto mixed = registry.Deregister({"nope", "a.k"}, nullptr, "engine-b", false);
  REQUIRE(mixed.status().code() == absl::StatusCode::kNotFound);
  CHECK_THAT(Message(mixed.status()), Catch::Contains("regions 'nope' are not registered"));
  CHECK_THAT(Message(mixed.status()), Catch::Contains("'a.k' (owned by engine-a)"));
  CHECK(registry.List().size() == 3);

  std::vector<RegionPtr> retired;
  auto own = registry.Deregister({"b.k"}, &retired, "engine-b", false);
  REQUIRE(own.ok());
  CHECK(retired.size() == 1);
  auto admin = registry.Deregister({"a.k"}, nullptr, "scheduler", /*any_owner=*/true);
  REQUIRE(admin.ok());
  CHECK(Names(registry.List()) == std::vector<std::string>{"a.v"});
  CHECK(registry.FindGroup("kv")[0]->Info().group_position() == 0);
}

TEST_CASE("DeregisterOwner removes exactly the owner's regions, some already gone") {
  auto memory = Memfd(65536);
  auto other = Memfd(65536);
  RegionRegistry registry(&Context());
  REQUIRE(registry
              .Register({HandleSpec("a.k", memory->id(), 0, 4096, 1, 4096, "kv"),
                         HandleSpec("a.v", memory->id(), 4096, 4096, 1, 4096, "kv"),
                         HandleSpec("a.x", memory->id(), 8192, 4096, 1, 4096)},
                        false, Registrant("engine-a", {memory}))
              .ok());
  REQUIRE(registry
              .Register({HandleSpec("b.k", other->id(), 0, 4096, 1, 4096, "kv-b")}, false,
                        Registrant("engine-b", {other}))
              .ok());
  // The owner's own deregistration of one of them ran first: the rest still go (a
  // list taken before it, deregistered by name, was refused whole as NOT_FOUND).
  REQUIRE(registry.Deregister({"a.k"}, nullptr, "engine-a", false).ok());
  const uint64_t version = registry.version();
  std::vector<RegionPtr> retired;
  std::vector<std::string> removed;
  CHECK(registry.DeregisterOwner("engine-a", &retired, &removed) == version + 1);
  CHECK(removed == std::vector<std::string>{"a.v", "a.x"});
  CHECK(Names(retired) == removed);
  CHECK(Names(registry.List()) == std::vector<std::string>{"b.k"});
  CHECK(registry.Usage().regions == 1);
  CHECK(registry.FindGroup("kv").empty());
  CHECK(registry.FindGroup("kv-b").size() == 1);
  // Peers get the removal as a delta.
  v1::AgentMetadata delta;
  REQUIRE(registry.ExportDelta(version, &delta, false));
  CHECK(std::vector<std::string>(delta.removed_regions().begin(), delta.removed_regions().end()) ==
        std::vector<std::string>{"a.v", "a.x"});
  // Nothing left: the version stays.
  removed.clear();
  CHECK(registry.DeregisterOwner("engine-a", nullptr, &removed) == version + 1);
  CHECK(removed.empty());
  CHECK(registry.DeregisterOwner("nobody", nullptr) == version + 1);
  // The owner's group name is free again, for anyone.
  CHECK(registry
            .Register({HandleSpec("b.v", other->id(), 4096, 4096, 1, 4096, "kv")}, false,
                      Registrant("engine-b", {other}))
            .ok());
}

TEST_CASE("A registration whose owner ended before it committed fails and leaves nothing") {
  auto memory = Memfd(65536);
  auto other = Memfd(65536);
  RegionRegistry registry(&Context());
  std::atomic<bool> a_ended{false};
  registry.SetOwnerCheck([&](const std::string& owner) { return owner == "engine-a" && a_ended; });
  REQUIRE(registry
              .Register({HandleSpec("a.k", memory->id(), 0, 4096, 1, 4096, "kv")}, false,
                        Registrant("engine-a", {memory}))
              .ok());
  REQUIRE(registry
              .Register({HandleSpec("b.k", other->id(), 0, 4096, 1, 4096)}, false,
                        Registrant("engine-b", {other}))
              .ok());

  // The session ends while its next batch is being imported (the handle resolved, the
  // memory mapped next): the door marks it ended, then the agent releases what it
  // holds, which waits for the registration's writer lock.
  std::thread release;
  uint64_t released_at = 0;
  std::vector<std::string> released;
  RegisterContext context = Registrant("engine-a", {memory});
  auto resolve = context.resolve_handle;
  context.resolve_handle = [&, resolve](uint64_t handle) {
    if (!release.joinable()) {
      a_ended = true;
      release = std::thread(
          [&] { released_at = registry.DeregisterOwner("engine-a", nullptr, &released); });
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // it waits for us
    }
    return resolve(handle);
  };
  auto late = registry.Register({HandleSpec("a.v", memory->id(), 4096, 4096, 1, 4096, "kv"),
                                 HandleSpec("a.x", memory->id(), 8192, 4096, 1, 4096)},
                                false, context);
  REQUIRE(release.joinable());
  release.join();
  REQUIRE(late.status().code() == absl::StatusCode::kUnauthenticated);
  CHECK_THAT(Message(late.status()),
             Catch::Contains("engine-a ended while its RegisterRegions ran") &&
                 Catch::Contains("nothing was registered"));
  CHECK(released == std::vector<std::string>{"a.k"});
  CHECK(released_at == registry.version());
  CHECK(Names(registry.List()) == std::vector<std::string>{"b.k"});
  CHECK(registry.Usage().regions == 1);

  // A call that reaches the registry after the end fails at once.
  auto after = registry.Register({HandleSpec("a.y", memory->id(), 0, 4096, 1, 4096)}, false,
                                 Registrant("engine-a", {memory}));
  CHECK(after.status().code() == absl::StatusCode::kUnauthenticated);
  // Other owners are not affected.
  CHECK(registry
            .Register({HandleSpec("b.v", other->id(), 4096, 4096, 1, 4096)}, false,
                      Registrant("engine-b", {other}))
            .ok());
  CHECK(registry.List().size() == 2);
}

TEST_CASE("Export tells where memory is only to a peer on the same host") {
  auto memory = Memfd(65536);
  ShmMapping shm = MakeShm(8192);
  RegionRegistry registry(&Context());
  REQUIRE(registry
              .Register({HandleSpec("k", memory->id(), 8192, 4096, 1, 4096, "kv"),
                         Spec("byname", shm.name(), 4096, 4096, 1, 4096)},
                        false, Registrant("engine-a", {memory}))
              .ok());
  RegionPtr byname = registry.Find("byname");
  REQUIRE(byname != nullptr);

  v1::AgentMetadata local;
  registry.Export(&local, /*same_host=*/true);
  REQUIRE(local.regions_size() == 2);
  CHECK(local.regions(0).memory_id() == memory->id());
  CHECK(local.regions(0).memory_offset() == 8192);
  CHECK(local.regions(1).memory_id() == byname->mapping.memory()->id());
  CHECK(local.regions(1).memory_offset() == 4096);
  CHECK(registry.FindMemory(local.regions(1).memory_id()) == byname->mapping.memory());
  for (const v1::ExportedRegion& region : local.regions()) CHECK(region.cuda_ipc_handle().empty());
  // No file names: the metadata does not contain the object's name.
  CHECK(local.SerializeAsString().find(shm.name().substr(1)) == std::string::npos);
  local.set_name("a");
  local.set_worker_address("w");
  auto catalog = RemoteCatalog::FromMetadata(local);
  REQUIRE(catalog.ok());
  CHECK(catalog->Find("k")->memory_id == memory->id());
  CHECK(catalog->Find("k")->memory_offset == 8192);

  v1::AgentMetadata remote;
  registry.Export(&remote, /*same_host=*/false);
  REQUIRE(remote.regions_size() == 2);
  for (const v1::ExportedRegion& region : remote.regions()) {
    CHECK(region.memory_id() == 0);
    CHECK(region.memory_offset() == 0);
    CHECK(region.cuda_ipc_handle().empty());
    CHECK_FALSE(region.rkey().empty());
  }
}

v1::RegionSpec WithRole(v1::RegionSpec spec, const std::string& role) {
  spec.set_role(role);
  return spec;
}

TEST_CASE("Roles are bounded, printable and unique within their group, and exported") {
  ShmMapping shm = MakeShm(65536);
  const std::string name = shm.name();
  using absl::StatusCode;

  SECTION("a duplicate role in one batch names the entry, the role and the other region") {
    auto r = RegisterBad({WithRole(Spec("k.L0", name, 0, 4096, 1, 4096, "kv"), "L0.K"),
                          WithRole(Spec("v.L0", name, 4096, 4096, 1, 4096, "kv"), "L0.K")},
                         shm);
    CHECK(r.status.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(r.message, Catch::Contains("region 'v.L0' (entry 1): role 'L0.K' is already "
                                          "declared by region 'k.L0' of group 'kv'"));
    CHECK_THAT(r.message, Catch::Contains("give each its own"));
  }
  SECTION("a role a registered region of the group already declares") {
    RegionRegistry registry(&Context());
    REQUIRE(registry
                .Register({WithRole(Spec("k.L0", name, 0, 4096, 1, 4096, "kv"), "L0.K")}, false,
                          Registrant())
                .ok());
    auto result = registry.Register(
        {WithRole(Spec("v.L0", name, 4096, 4096, 1, 4096, "kv"), "L0.K")}, false, Registrant());
    REQUIRE_FALSE(result.ok());
    CHECK_THAT(Message(result.status()),
               Catch::Contains("region 'v.L0' (entry 0): role 'L0.K' is already declared by "
                               "region 'k.L0' of group 'kv'"));
    // The same role in another group, or on an ungrouped region, is fine; so is the
    // role again once its region is gone.
    REQUIRE(registry
                .Register({WithRole(Spec("k2", name, 8192, 4096, 1, 4096, "kv2"), "L0.K"),
                           WithRole(Spec("aux", name, 12288, 4096, 1, 4096), "L0.K")},
                          false, Registrant())
                .ok());
    REQUIRE(registry.Deregister({"k.L0"}, nullptr, "test-owner", false).ok());
    REQUIRE(registry
                .Register({WithRole(Spec("v.L0", name, 4096, 4096, 1, 4096, "kv"), "L0.K")},
                          false, Registrant())
                .ok());
  }
  SECTION("oversized and control characters") {
    auto r = RegisterBad({WithRole(Spec("k", name, 0, 4096, 1, 4096, "kv"), std::string(129, 'r'))},
                         shm);
    CHECK_THAT(r.message, Catch::Contains("region 'k' (entry 0): role is 129 bytes (at most 128"));
    r = RegisterBad({WithRole(Spec("k", name, 0, 4096, 1, 4096, "kv"), "L0\n.K")}, shm);
    CHECK_THAT(r.message, Catch::Contains("role 'L0\\x0a.K' contains a NUL or control character"));
    CHECK(r.message.find('\n') == std::string::npos);
  }
  SECTION("exported to peers and read back") {
    RegionRegistry registry(&Context());
    REQUIRE(registry
                .Register({WithRole(Spec("v.L0", name, 0, 4096, 1, 4096, "kv"), "L0.V"),
                           WithRole(Spec("k.L0", name, 4096, 4096, 1, 4096, "kv"),
                                    std::string(128, 'k')),
                           Spec("aux", name, 8192, 100, 1, 100)},
                          false, Registrant())
                .ok());
    CHECK(registry.Find("v.L0")->Info().spec().role() == "L0.V");
    v1::AgentMetadata md;
    registry.Export(&md, false);
    md.set_name("a");
    md.set_worker_address("w");
    CHECK(md.regions(0).role() == "L0.V");
    auto catalog = RemoteCatalog::FromMetadata(md);
    REQUIRE(catalog.ok());
    CHECK(catalog->Find("v.L0")->role == "L0.V");
    CHECK(catalog->Find("k.L0")->role == std::string(128, 'k'));
    CHECK(catalog->Find("aux")->role.empty());
  }
}

}  // namespace
}  // namespace kvagent::registry
