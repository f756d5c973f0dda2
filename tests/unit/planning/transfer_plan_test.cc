#include "planning/transfer_plan.h"

#include <memory>
#include <string>

#include "catch2/catch.hpp"
#include "tests/unit/planning/catalog_util.h"
#include "tests/unit/registry/test_util.h"

namespace kvagent::planning {
namespace {

using registry::Region;
using registry::RegionPtr;
using registry::RegionRegistry;
using registry::RemoteCatalog;
using registry::RemoteRegion;
using registry::ShmMapping;
using registry::testing::Context;
using registry::testing::MakeShm;
using testing::DecodeCatalog;
using registry::testing::Registrant;
using registry::testing::Spec;

// Two agents' registries in one process: local "prefill" and a catalog of "decode".
// Both have group "kv" (k, v: 16 items of 256 bytes) and region "aux" (100 bytes);
// decode also has "kv512" (2 regions of 512-byte items) and "kv3" (3 regions).
struct Fixture {
  ShmMapping local_shm = MakeShm(65536);
  ShmMapping remote_shm = MakeShm(65536);
  RegionRegistry local{&Context()};
  RegionRegistry remote_registry{&Context()};
  RemoteCatalog remote;

  Fixture() {
    const std::string l = local_shm.name();
    const std::string r = remote_shm.name();
    REQUIRE(
        local
            .Register({Spec("k", l, 0, 4096, 16, 256, "kv"),
                       Spec("v", l, 4096, 4096, 16, 256, "kv"), Spec("aux", l, 8192, 100, 1, 100),
                       Spec("kvs", l, 12288, 8192, 16, 256, "strided", 512)},
                      false, Registrant())
            .ok());
    REQUIRE(remote_registry
                .Register({Spec("aux", r, 0, 100, 1, 100), Spec("k", r, 4096, 4096, 16, 256, "kv"),
                           Spec("v", r, 8192, 4096, 16, 256, "kv"),
                           Spec("k5", r, 12288, 8192, 16, 512, "kv512"),
                           Spec("v5", r, 20480, 8192, 16, 512, "kv512"),
                           Spec("a3", r, 28672, 256, 1, 256, "kv3"),
                           Spec("b3", r, 28928, 256, 1, 256, "kv3"),
                           Spec("c3", r, 29184, 256, 1, 256, "kv3"),
                           Spec("s", r, 32768, 4096, 16, 256, "single")},
                          false, Registrant())
                .ok());
    remote = DecodeCatalog(remote_registry).value();
  }

  absl::StatusOr<TransferPlan> Plan(const std::vector<v1::Segment>& segments,
                                    uint32_t first = 0, v1::TransferOp op = v1::WRITE) {
    google::protobuf::RepeatedPtrField<v1::Segment> field(segments.begin(), segments.end());
    return PlanTransfer(local, remote, field, first, op);
  }
};

v1::Segment Items(const std::string& local, const std::string& remote,
                  std::vector<uint64_t> li, std::vector<uint64_t> ri) {
  v1::Segment s;
  s.mutable_items()->set_local_group(local);
  s.mutable_items()->set_remote_group(remote);
  for (uint64_t i : li) s.mutable_items()->add_local_indices(i);
  for (uint64_t i : ri) s.mutable_items()->add_remote_indices(i);
  return s;
}

v1::Segment Bytes(const std::string& local, uint64_t lo, const std::string& remote, uint64_t ro,
                  uint64_t length) {
  v1::Segment s;
  s.mutable_bytes()->set_local_region(local);
  s.mutable_bytes()->set_local_offset(lo);
  s.mutable_bytes()->set_remote_region(remote);
  s.mutable_bytes()->set_remote_offset(ro);
  s.mutable_bytes()->set_length(length);
  return s;
}

std::string Error(const absl::StatusOr<TransferPlan>& plan, absl::StatusCode code) {
  REQUIRE_FALSE(plan.ok());
  CHECK(plan.status().code() == code);
  return std::string(plan.status().message());
}

TEST_CASE("Contiguous pages coalesce into one op per region") {
  Fixture f;
  auto plan = f.Plan({Items("kv", "kv", {3, 4, 5}, {7, 8, 9})});
  REQUIRE(plan.ok());
  REQUIRE(plan->ops.size() == 2);
  const RegionPtr k = f.local.Find("k");
  const RegionPtr v = f.local.Find("v");
  const RemoteRegion* rk = f.remote.Find("k");
  const RemoteRegion* rv = f.remote.Find("v");
  CHECK(plan->ops[0].local_address == k->ItemAddress(3));
  CHECK(plan->ops[0].remote_address == rk->ItemAddress(7));
  CHECK(plan->ops[0].length == 3 * 256);
  CHECK(plan->ops[0].rkey_slot == rk->rkey_slot);
  CHECK(plan->ops[0].rkey_slot == 1);
  CHECK(plan->ops[1].local_address == v->ItemAddress(3));
  CHECK(plan->ops[1].remote_address == rv->ItemAddress(7));
  CHECK(plan->ops[1].rkey_slot == 2);
  CHECK(plan->items == 3);
  CHECK(plan->bytes == 2 * 3 * 256);
  CHECK(plan->local_regions.size() == 2);
}

TEST_CASE("Scattered pages, or pages contiguous on one side only, do not coalesce") {
  Fixture f;
  auto plan = f.Plan({Items("kv", "kv", {1, 3, 5}, {2, 4, 6})});
  REQUIRE(plan.ok());
  CHECK(plan->ops.size() == 6);
  CHECK(plan->bytes == 6 * 256);
  plan = f.Plan({Items("kv", "kv", {1, 2, 3}, {9, 4, 5})});  // local run, remote not
  REQUIRE(plan.ok());
  CHECK(plan->ops.size() == 4);  // {1}->{9}, {2,3}->{4,5} per region
  CHECK(plan->ops[1].length == 512);
  // Strided items have gaps between them: neighbours never merge.
  plan = f.Plan({Items("strided", "single", {0, 1, 2}, {0, 1, 2})});
  REQUIRE(plan.ok());
  CHECK(plan->ops.size() == 3);
}

TEST_CASE("Segments are numbered from first_segment and never merge with each other") {
  Fixture f;
  auto plan = f.Plan({Items("kv", "kv", {0}, {0}), Items("kv", "kv", {1}, {1}),
                      Bytes("aux", 0, "aux", 0, 100)},
                     10);
  REQUIRE(plan.ok());
  REQUIRE(plan->ops.size() == 5);
  CHECK(plan->ops[0].segment == 10);
  CHECK(plan->ops[2].segment == 11);
  CHECK(plan->ops[4].segment == 12);
  CHECK(plan->items == 2);
  CHECK(plan->bytes == 4 * 256 + 100);
  CHECK(plan->local_regions.size() == 3);  // k, v, aux: deduplicated
}

TEST_CASE("Item segments are checked") {
  Fixture f;
  using absl::StatusCode;
  SECTION("item size mismatch") {
    std::string m = Error(f.Plan({Items("kv", "kv512", {0}, {0})}), StatusCode::kInvalidArgument);
    CHECK_THAT(m, Catch::Contains("local region 'k' has 256-byte items"));
    CHECK_THAT(m, Catch::Contains("region 'k5' has 512-byte items"));
  }
  SECTION("index out of range") {
    std::string m = Error(f.Plan({Items("kv", "kv", {0, 16}, {0, 1})}, 4),
                          StatusCode::kInvalidArgument);
    CHECK_THAT(m, Catch::Contains("segment 4: local index 16 at position 1"));
    CHECK_THAT(m, Catch::Contains("num_items 16"));
    m = Error(f.Plan({Items("kv", "kv", {0}, {99})}), StatusCode::kInvalidArgument);
    CHECK_THAT(m, Catch::Contains("remote index 99 at position 0"));
  }
  SECTION("unequal or empty index lists") {
    std::string m = Error(f.Plan({Items("kv", "kv", {0, 1}, {0})}), StatusCode::kInvalidArgument);
    CHECK_THAT(m, Catch::Contains("2 local indices and 1 remote indices"));
    Error(f.Plan({Items("kv", "kv", {}, {})}), StatusCode::kInvalidArgument);
  }
  SECTION("groups of different sizes") {
    std::string m = Error(f.Plan({Items("kv", "kv3", {0}, {0})}), StatusCode::kInvalidArgument);
    CHECK_THAT(m, Catch::Contains("has 2 regions but peer 'decode' group 'kv3' has 3"));
  }
  SECTION("unknown groups list the known ones") {
    std::string m = Error(f.Plan({Items("kvx", "kv", {0}, {0})}), StatusCode::kNotFound);
    CHECK_THAT(m, Catch::Contains("local group 'kvx'"));
    CHECK_THAT(m, Catch::Contains("'kv', 'strided'"));
    m = Error(f.Plan({Items("kv", "nope", {0}, {0})}), StatusCode::kNotFound);
    CHECK_THAT(m, Catch::Contains("peer 'decode' exports no group 'nope'"));
    CHECK_THAT(m, Catch::Contains("'kv', 'kv3', 'kv512', 'single'"));
  }
  SECTION("a segment with neither kind") {
    std::string m = Error(f.Plan({v1::Segment()}, 2), StatusCode::kInvalidArgument);
    CHECK_THAT(m, Catch::Contains("segment 2: empty segment"));
  }
}

TEST_CASE("Byte segments are checked") {
  Fixture f;
  using absl::StatusCode;
  auto plan = f.Plan({Bytes("aux", 10, "aux", 20, 80)});
  REQUIRE(plan.ok());
  REQUIRE(plan->ops.size() == 1);
  CHECK(plan->ops[0].local_address == f.local.Find("aux")->base_address + 10);
  CHECK(plan->ops[0].remote_address == f.remote.Find("aux")->base_address + 20);
  CHECK(plan->ops[0].rkey_slot == 0);
  CHECK(plan->items == 0);
  CHECK(plan->bytes == 80);

  std::string m = Error(f.Plan({Bytes("aux", 50, "aux", 0, 51)}), StatusCode::kInvalidArgument);
  CHECK_THAT(m, Catch::Contains("outside local region 'aux' of 100 bytes"));
  m = Error(f.Plan({Bytes("aux", 0, "aux", 90, 11)}), StatusCode::kInvalidArgument);
  CHECK_THAT(m, Catch::Contains("outside peer 'decode' region 'aux'"));
  m = Error(f.Plan({Bytes("aux", UINT64_MAX, "aux", 0, 2)}), StatusCode::kInvalidArgument);
  CHECK_THAT(m, Catch::Contains("outside local region"));
  m = Error(f.Plan({Bytes("aux", 0, "aux", 0, 0)}), StatusCode::kInvalidArgument);
  CHECK_THAT(m, Catch::Contains("length 0"));
  m = Error(f.Plan({Bytes("nope", 0, "aux", 0, 1)}), StatusCode::kNotFound);
  CHECK_THAT(m, Catch::Contains("local region 'nope'"));
  CHECK_THAT(m, Catch::Contains("'k', 'v', 'aux'"));
  m = Error(f.Plan({Bytes("aux", 0, "nope", 0, 1)}), StatusCode::kNotFound);
  CHECK_THAT(m, Catch::Contains("peer 'decode' exports no region 'nope'"));
}

TEST_CASE("Coalesce merges only same-segment, same-rkey, two-sided runs") {
  std::vector<PlanOp> ops = {
      {100, 1000, 10, 1, 0}, {110, 1010, 10, 1, 0},  // merge
      {120, 1020, 10, 2, 0},                         // other rkey
      {130, 1030, 10, 2, 1},                         // other segment
      {140, 1050, 10, 2, 1},                         // remote gap
      {150, 1060, 10, 2, 1},                         // merges with previous
  };
  Coalesce(&ops);
  REQUIRE(ops.size() == 4);
  CHECK(ops[0].length == 20);
  CHECK(ops[1].local_address == 120);
  CHECK(ops[2].local_address == 130);
  CHECK(ops[3].local_address == 140);
  CHECK(ops[3].length == 20);
  std::vector<PlanOp> empty;
  Coalesce(&empty);
  CHECK(empty.empty());
}

v1::RegionSpec WithRole(v1::RegionSpec spec, const std::string& role) {
  spec.set_role(role);
  return spec;
}

// An engine that registers V before K (local "prefill") and one that registers K
// before V (the peer "decode"), both declaring roles in group "kvr"; groups without
// roles ("kvn", V before K locally, K before V on the peer); a local group where only
// some regions declare roles ("kvm"); peer groups with another role set ("kvx") and
// with a K of other item size ("kv5").
struct RoleFixture {
  ShmMapping local_shm = MakeShm(65536);
  ShmMapping remote_shm = MakeShm(65536);
  RegionRegistry local{&Context()};
  RegionRegistry remote_registry{&Context()};
  RemoteCatalog remote;

  RoleFixture() {
    const std::string l = local_shm.name();
    const std::string r = remote_shm.name();
    REQUIRE(local
                .Register({WithRole(Spec("v.r", l, 0, 4096, 16, 256, "kvr"), "L0.V"),
                           WithRole(Spec("k.r", l, 4096, 4096, 16, 256, "kvr"), "L0.K"),
                           Spec("v.n", l, 8192, 4096, 16, 256, "kvn"),
                           Spec("k.n", l, 12288, 4096, 16, 256, "kvn"),
                           WithRole(Spec("k.m", l, 16384, 4096, 16, 256, "kvm"), "L0.K"),
                           Spec("v.m", l, 20480, 4096, 16, 256, "kvm")},
                          false, Registrant())
                .ok());
    REQUIRE(remote_registry
                .Register({WithRole(Spec("k.r", r, 0, 4096, 16, 256, "kvr"), "L0.K"),
                           WithRole(Spec("v.r", r, 4096, 4096, 16, 256, "kvr"), "L0.V"),
                           Spec("k.n", r, 8192, 4096, 16, 256, "kvn"),
                           Spec("v.n", r, 12288, 4096, 16, 256, "kvn"),
                           WithRole(Spec("k.x", r, 16384, 4096, 16, 256, "kvx"), "L0.K"),
                           WithRole(Spec("x.x", r, 20480, 4096, 16, 256, "kvx"), "L0.X"),
                           WithRole(Spec("v5", r, 24576, 4096, 16, 256, "kv5"), "L0.V"),
                           WithRole(Spec("k5", r, 28672, 8192, 16, 512, "kv5"), "L0.K")},
                          false, Registrant())
                .ok());
    remote = DecodeCatalog(remote_registry).value();
  }

  absl::StatusOr<TransferPlan> Plan(const std::vector<v1::Segment>& segments,
                                    v1::TransferOp op = v1::WRITE) {
    google::protobuf::RepeatedPtrField<v1::Segment> field(segments.begin(), segments.end());
    return PlanTransfer(local, remote, field, 0, op);
  }
};

TEST_CASE("Regions pair by role whatever order each side registered them in") {
  RoleFixture f;
  const RegionPtr lk = f.local.Find("k.r");
  const RegionPtr lv = f.local.Find("v.r");
  const RemoteRegion* rk = f.remote.Find("k.r");
  const RemoteRegion* rv = f.remote.Find("v.r");
  REQUIRE(lv->group_position == 0);  // V first here, K first on the peer
  REQUIRE(rk->group_position == 0);
  CHECK(rk->role == "L0.K");
  for (v1::TransferOp op : {v1::WRITE, v1::READ}) {
    auto plan = f.Plan({Items("kvr", "kvr", {0, 1}, {2, 3})}, op);
    REQUIRE(plan.ok());
    REQUIRE(plan->ops.size() == 2);  // region-major in the local order, coalesced
    // V -> V
    CHECK(plan->ops[0].local_address == lv->ItemAddress(0));
    CHECK(plan->ops[0].remote_address == rv->ItemAddress(2));
    CHECK(plan->ops[0].rkey_slot == rv->rkey_slot);
    CHECK(plan->ops[0].length == 512);
    // K -> K
    CHECK(plan->ops[1].local_address == lk->ItemAddress(0));
    CHECK(plan->ops[1].remote_address == rk->ItemAddress(2));
    CHECK(plan->ops[1].rkey_slot == rk->rkey_slot);
  }
}

TEST_CASE("Without roles on either side, regions pair by position as before") {
  RoleFixture f;
  auto plan = f.Plan({Items("kvn", "kvn", {0}, {1})});
  REQUIRE(plan.ok());
  REQUIRE(plan->ops.size() == 2);
  // Position 0 with position 0: the local V (registered first) into the peer's K.
  // Roles are how an engine that registers in another order says what is what.
  CHECK(plan->ops[0].local_address == f.local.Find("v.n")->ItemAddress(0));
  CHECK(plan->ops[0].remote_address == f.remote.Find("k.n")->ItemAddress(1));
  CHECK(plan->ops[1].local_address == f.local.Find("k.n")->ItemAddress(0));
  CHECK(plan->ops[1].remote_address == f.remote.Find("v.n")->ItemAddress(1));
}

TEST_CASE("Groups that declare different roles are refused, naming both and the roles") {
  RoleFixture f;
  std::string m = Error(f.Plan({Items("kvr", "kvr", {0}, {0}), Items("kvr", "kvx", {1}, {1})}),
            absl::StatusCode::kInvalidArgument);
  CHECK_THAT(m, Catch::StartsWith("segment 1: local group 'kvr' and peer 'decode' group 'kvx' "
                                  "declare different roles"));
  CHECK_THAT(m, Catch::Contains("only local: 'L0.V'; only on the peer: 'L0.X'"));
  CHECK_THAT(m, Catch::Contains("register the same roles on both sides"));
}

TEST_CASE("Roles on one side only, or on some regions only, are refused") {
  RoleFixture f;
  using absl::StatusCode;
  std::string m = Error(f.Plan({Items("kvr", "kvn", {0}, {0})}), StatusCode::kInvalidArgument);
  CHECK_THAT(m, Catch::Contains("local group 'kvr' declares a role on 2 of its 2 regions and "
                                "peer 'decode' group 'kvn' on 0 of 2"));
  CHECK_THAT(m, Catch::Contains("both sides must declare roles"));
  CHECK_THAT(m, Catch::Contains("set RegionSpec.role on every region of peer 'decode' group "
                                "'kvn' (no role on 'k.n', 'v.n')"));
  m = Error(f.Plan({Items("kvn", "kvr", {0}, {0})}), StatusCode::kInvalidArgument);
  CHECK_THAT(m, Catch::Contains("every region of local group 'kvn' (no role on 'v.n', 'k.n')"));
  m = Error(f.Plan({Items("kvm", "kvr", {0}, {0})}), StatusCode::kInvalidArgument);
  CHECK_THAT(m, Catch::Contains("local group 'kvm' declares a role on 1 of its 2 regions"));
  CHECK_THAT(m, Catch::Contains("(no role on 'v.m')"));
}

TEST_CASE("Role-paired regions must still agree on item size, named with the role") {
  RoleFixture f;
  std::string m =
      Error(f.Plan({Items("kvr", "kv5", {0}, {0})}), absl::StatusCode::kInvalidArgument);
  CHECK_THAT(m, Catch::Contains("segment 0: role 'L0.K': local region 'k.r' has 256-byte items "
                                "but peer 'decode' region 'k5' has 512-byte items"));
}

TEST_CASE("An op other than WRITE or READ is refused") {
  Fixture f;
  std::string m = Error(f.Plan({Items("kv", "kv", {0}, {0})}, 0, v1::TRANSFER_OP_UNSPECIFIED),
                        absl::StatusCode::kInvalidArgument);
  CHECK_THAT(m, Catch::Contains("transfer op 0 is neither WRITE nor READ"));
}

TEST_CASE("A WRITE that writes a remote item twice is refused") {
  Fixture f;
  using absl::StatusCode;
  SECTION("the same remote index twice in one segment") {
    std::string m = Error(f.Plan({Items("kv", "kv", {1, 2}, {7, 7})}, 3),
                          StatusCode::kInvalidArgument);
    CHECK_THAT(m, Catch::StartsWith("segment 3: remote index 7 appears at positions 0 and 1"));
    CHECK_THAT(m, Catch::Contains("item 7 of peer 'decode' region 'k' (and of every region of "
                                  "its group 'kv') would be written twice"));
    CHECK_THAT(m, Catch::Contains("drop the repeated index"));
  }
  SECTION("across two segments") {
    std::string m = Error(f.Plan({Items("kv", "kv", {1, 2}, {6, 7}), Bytes("aux", 0, "aux", 0, 1),
                                  Items("kv", "kv", {3}, {7})}),
                          StatusCode::kInvalidArgument);
    CHECK_THAT(m, Catch::StartsWith("segment 2: remote index 7 (position 0) repeats segment 0's "
                                    "remote index 7 (position 1)"));
    CHECK_THAT(m, Catch::Contains("peer 'decode' region 'k'"));
  }
  SECTION("reading one local item twice is fine: only destinations count") {
    auto plan = f.Plan({Items("kv", "kv", {5, 5}, {1, 2}), Items("kv", "kv", {5}, {3})});
    REQUIRE(plan.ok());
    CHECK(plan->items == 3);
  }
}

TEST_CASE("Byte segments may not overlap each other or items written in the same region") {
  Fixture f;
  using absl::StatusCode;
  SECTION("two byte segments") {
    std::string m = Error(f.Plan({Bytes("aux", 0, "aux", 0, 50), Bytes("aux", 50, "aux", 40, 20)}),
                          StatusCode::kInvalidArgument);
    CHECK_THAT(m, Catch::StartsWith("segment 1: bytes [40, 60) of peer 'decode' region 'aux' "
                                    "overlap bytes [0, 50) that segment 0 writes: bytes [40, 50) "
                                    "would be written twice"));
    CHECK_THAT(m, Catch::Contains("trim or merge the ranges"));
    // A range inside a longer earlier one, past a short one in between.
    m = Error(f.Plan({Bytes("aux", 0, "aux", 0, 90), Bytes("aux", 0, "aux", 10, 5),
                      Bytes("aux", 0, "aux", 60, 10)}),
              StatusCode::kInvalidArgument);
    CHECK_THAT(m, Catch::StartsWith("segment 1: bytes [10, 15)"));
  }
  SECTION("an item segment, then a byte segment into one of its items") {
    std::string m = Error(f.Plan({Items("kv", "kv", {0}, {1}), Bytes("aux", 0, "k", 300, 100)}),
                          StatusCode::kInvalidArgument);
    CHECK_THAT(m, Catch::StartsWith("segment 1: bytes [300, 400) of peer 'decode' region 'k' "
                                    "overlaps item 1 (bytes [256, 512), remote index 1 at "
                                    "position 0) that segment 0 writes: bytes [300, 400)"));
  }
  SECTION("a byte segment, then an item segment over it") {
    std::string m =
        Error(f.Plan({Bytes("aux", 0, "v", 500, 20), Items("kv", "kv", {0, 1}, {3, 2})}),
              StatusCode::kInvalidArgument);
    CHECK_THAT(m, Catch::StartsWith("segment 1: item 2 (bytes [512, 768), remote index 2 at "
                                    "position 1) of peer 'decode' region 'v' overlaps bytes "
                                    "[500, 520) that segment 0 writes: bytes [512, 520)"));
  }
  SECTION("adjacent ranges and items are fine") {
    auto plan = f.Plan({Items("kv", "kv", {0}, {1}), Bytes("aux", 0, "k", 0, 100),
                        Bytes("aux", 0, "k", 156, 100), Bytes("aux", 0, "k", 512, 100)});
    REQUIRE(plan.ok());
  }
}

TEST_CASE("A READ checks its destinations on the local side") {
  Fixture f;
  using absl::StatusCode;
  std::string m = Error(f.Plan({Items("kv", "kv", {7, 7}, {1, 2})}, 0, v1::READ),
                        StatusCode::kInvalidArgument);
  CHECK_THAT(m, Catch::StartsWith("segment 0: local index 7 appears at positions 0 and 1"));
  CHECK_THAT(m, Catch::Contains("item 7 of local region 'k' (and of every region of its group "
                                "'kv')"));
  m = Error(f.Plan({Bytes("aux", 0, "aux", 0, 10), Bytes("aux", 5, "aux", 50, 10)}, 0, v1::READ),
            StatusCode::kInvalidArgument);
  CHECK_THAT(m, Catch::StartsWith("segment 1: bytes [5, 15) of local region 'aux' overlap"));
  // Reading one remote item into two local ones is fine.
  auto plan = f.Plan({Items("kv", "kv", {1, 2}, {7, 7})}, 0, v1::READ);
  REQUIRE(plan.ok());
  CHECK(plan->ops.size() == 2 * 2);
}

TEST_CASE("A plan with many distinct destination pages is accepted") {
  ShmMapping local_shm = MakeShm(2 * 4096 * 16);
  ShmMapping remote_shm = MakeShm(2 * 4096 * 16);
  RegionRegistry local{&Context()};
  RegionRegistry remote_registry{&Context()};
  for (auto [registry, shm] : {std::pair{&local, &local_shm}, {&remote_registry, &remote_shm}}) {
    REQUIRE(registry
                ->Register({Spec("k", shm->name(), 0, 4096 * 16, 4096, 16, "kv"),
                            Spec("v", shm->name(), 4096 * 16, 4096 * 16, 4096, 16, "kv")},
                           false, Registrant())
                .ok());
  }
  auto remote = DecodeCatalog(remote_registry);
  // Every page once: half scattered in one segment, the other half one page per segment.
  google::protobuf::RepeatedPtrField<v1::Segment> segments;
  v1::ItemSegment* items = segments.Add()->mutable_items();
  items->set_local_group("kv");
  items->set_remote_group("kv");
  for (uint64_t i = 0; i < 2048; ++i) {
    items->add_local_indices(i);
    items->add_remote_indices((i * 7) % 4096);  // distinct: 7 is odd
  }
  // The rest of the pages, one segment each.
  std::vector<bool> used(4096, false);
  for (uint64_t index : items->remote_indices()) used[index] = true;
  for (uint64_t page = 0; page < 4096; ++page) {
    if (used[page]) continue;
    *segments.Add() = Items("kv", "kv", {page}, {page});
  }
  auto plan = PlanTransfer(local, *remote, segments, 0, v1::WRITE);
  REQUIRE(plan.ok());
  CHECK(plan->items == 4096);
  CHECK(plan->bytes == 2 * 4096 * 16);
  // The same pages again in a READ: all distinct on the local side too.
  plan = PlanTransfer(local, *remote, segments, 0, v1::READ);
  CHECK(plan.status().code() == absl::StatusCode::kInvalidArgument);  // locals 0..2047 twice
  CHECK_THAT(std::string(plan.status().message()), Catch::Contains("local index"));
}

// The planner looks a few regions up in the plan's own list and more in a set, and
// keeps the first group pair's pairing inline and the others in a map: every way
// through those gives the same plan.
TEST_CASE("Pinning and pairing past the first few regions and the first pair") {
  Fixture f;
  ShmMapping wide_local = MakeShm(65536);
  ShmMapping wide_remote = MakeShm(65536);
  std::vector<v1::RegionSpec> local_specs;
  std::vector<v1::RegionSpec> remote_specs;
  for (int i = 0; i < 12; ++i) {
    const std::string n = "w" + std::to_string(i);
    local_specs.push_back(Spec(n, wide_local.name(), i * 4096, 4096, 16, 256, "wide"));
    remote_specs.push_back(Spec(n, wide_remote.name(), i * 4096, 4096, 16, 256, "wide"));
  }
  REQUIRE(f.local.Register(local_specs, false, Registrant()).ok());
  REQUIRE(f.remote_registry.Register(remote_specs, false, Registrant()).ok());
  f.remote = DecodeCatalog(f.remote_registry).value();

  // kv (2 regions), wide (12: past the listed few), kv again, wide again, a byte
  // segment into a region already pinned: each region pinned once, in first-use order.
  auto plan = f.Plan({Items("kv", "kv", {0}, {0}), Items("wide", "wide", {1}, {2}),
                      Items("kv", "kv", {3}, {3}), Items("wide", "wide", {4}, {5}),
                      Bytes("w7", 0, "w7", 4096 - 256, 256), Bytes("aux", 0, "aux", 0, 100)});
  REQUIRE(plan.ok());
  REQUIRE(plan->local_regions.size() == 15);  // k, v, w0..w11, aux
  CHECK(plan->local_regions[0]->spec.name() == "k");
  CHECK(plan->local_regions[1]->spec.name() == "v");
  for (int i = 0; i < 12; ++i) {
    CHECK(plan->local_regions[2 + i]->spec.name() == "w" + std::to_string(i));
  }
  CHECK(plan->local_regions[14]->spec.name() == "aux");
  CHECK(plan->ops.size() == 2 + 12 + 2 + 12 + 1 + 1);
  CHECK(plan->items == 4);
  // Segment 3 pairs wide with wide again (from the map): remote index 5 of w0.
  const RegionPtr w0 = f.local.Find("w0");
  const auto& remote_w0 = *f.remote.Find("w0");
  bool found = false;
  for (const PlanOp& op : plan->ops) {
    if (op.segment != 3 || op.local_address != w0->ItemAddress(4)) continue;
    found = true;
    CHECK(op.remote_address == remote_w0.ItemAddress(5));
  }
  CHECK(found);

  // A pair that does not pair, named second and fourth: each refusal names its own
  // segment, whether the pairing was made for it or found made.
  CHECK_THAT(Error(f.Plan({Items("kv", "kv", {0}, {0}), Items("kv", "kv3", {0}, {0})}),
                   absl::StatusCode::kInvalidArgument),
             Catch::StartsWith("segment 1: local group 'kv' has 2 regions but peer"));
  CHECK_THAT(Error(f.Plan({Items("kv", "kv", {0}, {0}), Items("wide", "wide", {0}, {0}),
                           Items("kv", "kv", {1}, {1}), Items("kv", "kv3", {0}, {0})},
                          7),
                   absl::StatusCode::kInvalidArgument),
             Catch::StartsWith("segment 10: local group 'kv' has 2 regions but peer"));
  // The first pair failing: refused at its first segment.
  CHECK_THAT(Error(f.Plan({Items("kv", "nope", {0}, {0}), Items("kv", "kv", {0}, {0})}),
                   absl::StatusCode::kNotFound),
             Catch::StartsWith("segment 0: peer 'decode' exports no group 'nope'"));
}

// GroupSlots is FindGroup's members as indices, without copying them.
TEST_CASE("A catalog's group slots name the same regions as FindGroup") {
  Fixture f;
  for (const std::string group : {"kv", "kv512", "kv3", "single", "nope", ""}) {
    const std::vector<const RemoteRegion*> members = f.remote.FindGroup(group);
    const absl::Span<const uint32_t> slots = f.remote.GroupSlots(group);
    REQUIRE(slots.size() == members.size());
    for (size_t i = 0; i < slots.size(); ++i) {
      REQUIRE(slots[i] < f.remote.regions().size());
      CHECK(&f.remote.regions()[slots[i]] == members[i]);
    }
  }
  CHECK(f.remote.GroupSlots("kv3").size() == 3);
  CHECK(f.remote.GroupSlots("nope").empty());
}

}  // namespace
}  // namespace kvagent::planning
