#include "registry/transfer_plan.h"

#include <memory>
#include <string>

#include "catch2/catch.hpp"
#include "tests/unit/registry/test_util.h"

namespace kvagent::registry {
namespace {

using testing::MakeShm;
using testing::Spec;

using testing::Context;
using testing::Registrant;

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
    v1::AgentMetadata md;
    remote_registry.Export(&md, /*same_host=*/false);
    md.set_name("decode");
    md.set_worker_address("w");
    auto catalog = RemoteCatalog::FromMetadata(md);
    REQUIRE(catalog.ok());
    remote = std::move(catalog).value();
  }

  absl::StatusOr<TransferPlan> Plan(const std::vector<v1::Segment>& segments,
                                    uint32_t first = 0) {
    google::protobuf::RepeatedPtrField<v1::Segment> field(segments.begin(), segments.end());
    return PlanTransfer(local, remote, field, first);
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

}  // namespace
}  // namespace kvagent::registry
