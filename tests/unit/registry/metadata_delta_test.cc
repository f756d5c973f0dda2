// Metadata deltas: RegionRegistry::ExportDelta (the agent's change log) and
// RemoteCatalog::ApplyDelta (the peer's side). A delta applied to the view at its base
// must give the view a whole catalog gives; a delta that does not apply is refused
// with the reason; a base older than the change log keeps gets no delta.
#include <algorithm>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "registry/region_registry.h"
#include "registry/remote_catalog.h"
#include "tests/unit/registry/test_util.h"

namespace kvagent::registry {
namespace {

using testing::Context;
using testing::MakeShm;
using testing::Registrant;
using testing::Spec;

v1::AgentMetadata Full(const RegionRegistry& registry) {
  v1::AgentMetadata md;
  md.set_name("decode-0");
  md.set_worker_address("worker");
  registry.Export(&md, /*same_host=*/false);
  return md;
}

RemoteCatalog View(const RegionRegistry& registry) {
  auto catalog = RemoteCatalog::FromMetadata(Full(registry));
  REQUIRE(catalog.ok());
  return *std::move(catalog);
}

v1::AgentMetadata Delta(const RegionRegistry& registry, uint64_t since) {
  v1::AgentMetadata md;
  md.set_name("decode-0");
  md.set_worker_address("worker");
  REQUIRE(registry.ExportDelta(since, &md, /*same_host=*/false));
  CHECK(md.delta());
  CHECK(md.base_version() == since);
  return md;
}

// name -> "group:position:role:base:length" for every region: what a peer plans with.
std::vector<std::string> Summary(const RemoteCatalog& catalog) {
  std::vector<std::string> out;
  for (const RemoteRegion& r : catalog.regions()) {
    out.push_back(fmt::format("{}={}:{}:{}:{:#x}:{}", r.name, r.group, r.group_position, r.role,
                              r.base_address, r.length));
    // Slots are the view's own indices.
    CHECK(&catalog.regions()[r.rkey_slot] == &r);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Applies the delta since `base` to `view` and checks the result against a whole
// catalog of the registry now; returns the new view.
RemoteCatalog ApplyAndCompare(const RemoteCatalog& view, const RegionRegistry& registry) {
  auto applied = view.ApplyDelta(Delta(registry, view.version()));
  REQUIRE(applied.ok());
  const RemoteCatalog whole = View(registry);
  CHECK(applied->catalog.version() == whole.version());
  CHECK(Summary(applied->catalog) == Summary(whole));
  for (const std::string& group : whole.GroupNames()) {
    std::vector<std::string> a, b;
    for (const RemoteRegion* r : applied->catalog.FindGroup(group)) a.push_back(r->name);
    for (const RemoteRegion* r : whole.FindGroup(group)) b.push_back(r->name);
    CHECK(a == b);
  }
  // Kept regions point at their old slot (their rkey is reused); new ones say kNew.
  REQUIRE(applied->base_slots.size() == applied->catalog.regions().size());
  for (size_t i = 0; i < applied->base_slots.size(); ++i) {
    const uint32_t base = applied->base_slots[i];
    if (base == AppliedDelta::kNew) continue;
    CHECK(view.regions()[base].name == applied->catalog.regions()[i].name);
  }
  return std::move(applied->catalog);
}

v1::RegionSpec RoleSpec(const std::string& name, const std::string& shm, uint64_t offset,
                        const std::string& group, const std::string& role) {
  v1::RegionSpec spec = Spec(name, shm, offset, 4096, 4, 1024, group);
  spec.set_role(role);
  return spec;
}

TEST_CASE("Deltas round trip: add, remove, group positions and roles") {
  ShmMapping shm = MakeShm(1 << 20);
  RegionRegistry registry(&Context());
  REQUIRE(registry
              .Register({RoleSpec("a", shm.name(), 0, "g", "L0.K"),
                         RoleSpec("b", shm.name(), 4096, "g", "L0.V"),
                         RoleSpec("c", shm.name(), 8192, "g", "L1.K"),
                         Spec("solo", shm.name(), 12288, 4096, 1, 4096)},
                        false, Registrant())
              .ok());
  RemoteCatalog view = View(registry);
  const uint64_t v1 = view.version();

  SECTION("a region added") {
    REQUIRE(registry.Register({RoleSpec("d", shm.name(), 16384, "g", "L1.V")}, false, Registrant())
                .ok());
    auto delta = Delta(registry, v1);
    CHECK(delta.regions_size() == 1);
    CHECK(delta.removed_regions_size() == 0);
    ApplyAndCompare(view, registry);
  }
  SECTION("a region removed renumbers its group, and the delta carries the group") {
    REQUIRE(registry.Deregister({"a"}, nullptr, "test-owner", false).ok());
    auto delta = Delta(registry, v1);
    CHECK(delta.removed_regions_size() == 1);
    CHECK(delta.regions_size() == 2);  // b and c, renumbered 0 and 1
    RemoteCatalog next = ApplyAndCompare(view, registry);
    CHECK(next.FindGroup("g")[0]->name == "b");
    CHECK(next.Find("a") == nullptr);
  }
  SECTION("a role moves to a new region after its holder left") {
    REQUIRE(registry.Deregister({"b"}, nullptr, "test-owner", false).ok());
    REQUIRE(registry.Register({RoleSpec("b2", shm.name(), 20480, "g", "L0.V")}, false,
                              Registrant())
                .ok());
    RemoteCatalog next = ApplyAndCompare(view, registry);
    CHECK(next.Find("b2")->role == "L0.V");
  }
  SECTION("a name removed and registered again is replaced, not removed") {
    REQUIRE(registry.Deregister({"solo"}, nullptr, "test-owner", false).ok());
    REQUIRE(registry.Register({Spec("solo", shm.name(), 32768, 8192, 1, 8192)}, false,
                              Registrant())
                .ok());
    auto delta = Delta(registry, v1);
    CHECK(delta.removed_regions_size() == 0);
    RemoteCatalog next = ApplyAndCompare(view, registry);
    CHECK(next.Find("solo")->length == 8192);
  }
  SECTION("a region added then removed after the base is not mentioned") {
    REQUIRE(registry.Register({Spec("tmp", shm.name(), 65536, 4096, 1, 4096)}, false,
                              Registrant())
                .ok());
    REQUIRE(registry.Deregister({"tmp"}, nullptr, "test-owner", false).ok());
    auto delta = Delta(registry, v1);
    CHECK(delta.regions_size() == 0);
    CHECK(delta.removed_regions_size() == 0);
    ApplyAndCompare(view, registry);
  }
  SECTION("deltas chain") {
    for (int i = 0; i < 5; ++i) {
      REQUIRE(registry
                  .Register({Spec(fmt::format("x{}", i), shm.name(), 65536 + i * 4096, 4096, 1,
                                  4096)},
                            false, Registrant())
                  .ok());
      view = ApplyAndCompare(view, registry);
      if (i % 2 == 1) {
        REQUIRE(registry.Deregister({fmt::format("x{}", i - 1)}, nullptr, "test-owner", false)
                    .ok());
        view = ApplyAndCompare(view, registry);
      }
    }
    CHECK(view.regions().size() == 4 + 5 - 2);
  }
}

TEST_CASE("Bad deltas are refused, naming why") {
  ShmMapping shm = MakeShm(1 << 20);
  RegionRegistry registry(&Context());
  REQUIRE(registry
              .Register({RoleSpec("a", shm.name(), 0, "g", "L0.K"),
                         RoleSpec("b", shm.name(), 4096, "g", "L0.V")},
                        false, Registrant())
              .ok());
  const RemoteCatalog view = View(registry);
  REQUIRE(registry.Register({RoleSpec("c", shm.name(), 8192, "g", "L1.K")}, false, Registrant())
              .ok());
  v1::AgentMetadata good = Delta(registry, view.version());
  auto refused = [&](const v1::AgentMetadata& delta, const std::string& why) {
    auto applied = view.ApplyDelta(delta);
    REQUIRE_FALSE(applied.ok());
    CHECK(applied.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(applied.status().message()),
               Catch::Contains("peer 'decode-0': delta from version") && Catch::Contains(why));
  };
  SECTION("another base version") {
    v1::AgentMetadata bad = good;
    bad.set_base_version(view.version() - 1);
    refused(bad, "its base is another version");
  }
  SECTION("not a delta, or another peer's") {
    v1::AgentMetadata bad = good;
    bad.set_delta(false);
    refused(bad, "it is not a delta");
    bad = good;
    bad.set_name("impostor");
    refused(bad, "it comes from 'impostor'");
  }
  SECTION("a removed name this view lacks") {
    v1::AgentMetadata bad = good;
    bad.add_removed_regions("nope");
    refused(bad, "it removes region 'nope', which this view does not hold");
  }
  SECTION("a name both removed and added") {
    v1::AgentMetadata bad = good;
    *bad.add_regions() = bad.regions(0);
    bad.mutable_regions(1)->set_name("a");
    bad.add_removed_regions("a");
    refused(bad, "region 'a' is both removed and added");
  }
  SECTION("a name this view holds added twice") {
    v1::AgentMetadata bad = good;
    *bad.add_regions() = bad.regions(0);
    bad.mutable_regions(0)->set_name("a");
    bad.mutable_regions(1)->set_name("a");
    refused(bad, "region 'a' is added twice");
  }
  SECTION("an added region that FromMetadata would refuse") {
    v1::AgentMetadata bad = good;
    bad.mutable_regions(0)->mutable_layout()->set_item_bytes(0);
    refused(bad, "item_bytes 0 is zero");
  }
  SECTION("group positions that no longer hold") {
    v1::AgentMetadata bad = good;
    bad.mutable_regions(0)->set_group_position(0);  // a holds 0
    refused(bad, "out of range or taken twice");
  }
  SECTION("a role declared twice in a group") {
    v1::AgentMetadata bad = good;
    bad.mutable_regions(0)->set_role("L0.K");  // a's
    refused(bad, "both declare role 'L0.K'");
  }
  SECTION("more regions than the limit") {
    CatalogLimits limits;
    limits.max_regions = 2;
    auto applied = view.ApplyDelta(good, limits);
    REQUIRE_FALSE(applied.ok());
    CHECK_THAT(std::string(applied.status().message()),
               Catch::Contains("the result has 3 regions (at most 2)"));
  }
  SECTION("a delta is not a catalog") {
    auto catalog = RemoteCatalog::FromMetadata(good);
    REQUIRE_FALSE(catalog.ok());
    CHECK_THAT(std::string(catalog.status().message()), Catch::Contains("sent a delta"));
  }
}

TEST_CASE("A base older than the change log gets the whole catalog") {
  ShmMapping shm = MakeShm(1 << 20);
  RegionRegistry registry(&Context());
  REQUIRE(registry.Register({Spec("keep", shm.name(), 0, 4096, 1, 4096)}, false, Registrant())
              .ok());
  const uint64_t old_version = registry.version();
  v1::AgentMetadata md;
  CHECK(registry.ExportDelta(old_version, &md, false));  // nothing changed: an empty delta
  CHECK(md.regions_size() == 0);
  CHECK_FALSE(registry.ExportDelta(old_version + 1, &md, false));  // from the future
  // Each register/deregister is one version; the log keeps 4096.
  for (int i = 0; i < 2100; ++i) {
    REQUIRE(registry.Register({Spec("churn", shm.name(), 4096, 4096, 1, 4096)}, false,
                              Registrant())
                .ok());
    REQUIRE(registry.Deregister({"churn"}, nullptr, "test-owner", false).ok());
  }
  md.Clear();
  CHECK_FALSE(registry.ExportDelta(old_version, &md, false));
  CHECK(md.regions_size() == 0);
  CHECK(registry.ExportDelta(registry.version() - 4000, &md, false));
  CHECK(md.regions_size() == 0);
  CHECK(md.removed_regions_size() == 0);
}

}  // namespace
}  // namespace kvagent::registry
