#include "registry/remote_catalog.h"

#include <string>

#include "catch2/catch.hpp"

namespace kvagent::registry {
namespace {

v1::ExportedRegion* AddRegion(v1::AgentMetadata* md, const std::string& name,
                              const std::string& group, uint32_t position, uint64_t base,
                              uint64_t items, uint64_t item_bytes, uint64_t stride = 0) {
  v1::ExportedRegion* r = md->add_regions();
  r->set_name(name);
  r->set_group(group);
  r->set_group_position(position);
  r->set_base_address(base);
  r->set_length(items * (stride == 0 ? item_bytes : stride));
  r->mutable_layout()->set_num_items(items);
  r->mutable_layout()->set_item_bytes(item_bytes);
  r->mutable_layout()->set_item_stride(stride);
  r->set_rkey("rkey-" + name);
  return r;
}

v1::AgentMetadata Valid() {
  v1::AgentMetadata md;
  md.set_name("decode-0");
  md.set_worker_address("worker-address-bytes");
  md.set_version(7);
  // Registered out of position order on purpose: FindGroup must sort by position.
  AddRegion(&md, "v.L0", "kv", 1, 0x20000, 16, 256);
  AddRegion(&md, "k.L0", "kv", 0, 0x10000, 16, 256, 512);
  AddRegion(&md, "aux", "", 0, 0x30000, 1, 64);
  return md;
}

std::string Error(const v1::AgentMetadata& md, const CatalogLimits& limits = {}) {
  auto catalog = RemoteCatalog::FromMetadata(md, limits);
  REQUIRE_FALSE(catalog.ok());
  CHECK(catalog.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(catalog.status().message()), Catch::Contains("peer 'decode-0'"));
  return std::string(catalog.status().message());
}

TEST_CASE("A valid catalog exposes regions, groups by position and rkey slots") {
  auto catalog = RemoteCatalog::FromMetadata(Valid());
  REQUIRE(catalog.ok());
  CHECK(catalog->peer() == "decode-0");
  CHECK(catalog->version() == 7);
  REQUIRE(catalog->regions().size() == 3);
  auto group = catalog->FindGroup("kv");
  REQUIRE(group.size() == 2);
  CHECK(group[0]->name == "k.L0");
  CHECK(group[0]->rkey_slot == 1);
  CHECK(group[0]->item_stride == 512);
  CHECK(group[0]->ItemAddress(3) == 0x10000 + 3 * 512);
  CHECK(group[1]->name == "v.L0");
  CHECK(group[1]->rkey_slot == 0);
  CHECK(group[1]->item_stride == 256);  // 0 normalized to item_bytes
  CHECK(catalog->FindGroup("nope").empty());
  CHECK(catalog->GroupNames() == std::vector<std::string>{"kv"});
  REQUIRE(catalog->Find("aux") != nullptr);
  CHECK(catalog->Find("aux")->rkey_slot == 2);
  CHECK(catalog->Find("missing") == nullptr);
}

TEST_CASE("Staged VRAM regions come without an rkey; DRAM ones never do") {
  v1::AgentMetadata md = Valid();
  md.mutable_regions(2)->set_memory(v1::VRAM);
  md.mutable_regions(2)->clear_rkey();
  auto catalog = RemoteCatalog::FromMetadata(md);
  REQUIRE(catalog.ok());
  CHECK(catalog->Find("aux")->memory == v1::VRAM);
  CHECK(catalog->Find("k.L0")->memory == v1::DRAM);  // UNSPECIFIED reads as DRAM
  md.mutable_regions(1)->clear_rkey();               // k.L0, DRAM
  CHECK_THAT(Error(md), Catch::Contains("region 'k.L0' (index 1): rkey is 0 bytes"));
}

TEST_CASE("Malformed metadata is rejected naming the field") {
  SECTION("too many regions") {
    CatalogLimits limits;
    limits.max_regions = 2;
    CHECK_THAT(Error(Valid(), limits), Catch::Contains("3 regions"));
  }
  SECTION("worker address") {
    v1::AgentMetadata md = Valid();
    md.clear_worker_address();
    CHECK_THAT(Error(md), Catch::Contains("worker_address"));
    md.set_worker_address(std::string(20000, 'x'));
    CHECK_THAT(Error(md), Catch::Contains("worker_address is 20000 bytes"));
  }
  SECTION("group positions that are not 0..n-1") {
    v1::AgentMetadata md = Valid();
    md.mutable_regions(0)->set_group_position(0);  // duplicate 0
    CHECK_THAT(Error(md), Catch::Contains("group_position 0"));
    md.mutable_regions(0)->set_group_position(5);  // gap
    std::string message = Error(md);
    CHECK_THAT(message, Catch::Contains("group_position 5"));
    CHECK_THAT(message, Catch::Contains("group 'kv'"));
  }
  SECTION("zero item size") {
    v1::AgentMetadata md = Valid();
    md.mutable_regions(1)->mutable_layout()->set_item_bytes(0);
    std::string message = Error(md);
    CHECK_THAT(message, Catch::Contains("region 'k.L0'"));
    CHECK_THAT(message, Catch::Contains("item_bytes 0"));
  }
  SECTION("stride smaller than item size") {
    v1::AgentMetadata md = Valid();
    md.mutable_regions(1)->mutable_layout()->set_item_stride(100);
    CHECK_THAT(Error(md), Catch::Contains("item_stride 100"));
  }
  SECTION("duplicate names") {
    v1::AgentMetadata md = Valid();
    md.mutable_regions(2)->set_name("k.L0");
    md.mutable_regions(2)->set_group("");
    std::string message = Error(md);
    CHECK_THAT(message, Catch::Contains("region 'k.L0'"));
    CHECK_THAT(message, Catch::Contains("twice"));
  }
  SECTION("empty and oversized names") {
    v1::AgentMetadata md = Valid();
    md.mutable_regions(2)->set_name("");
    CHECK_THAT(Error(md), Catch::Contains("name is 0 bytes"));
    md.mutable_regions(2)->set_name(std::string(300, 'n'));
    CHECK_THAT(Error(md), Catch::Contains("name is 300 bytes"));
  }
  SECTION("rkey empty or oversized") {
    v1::AgentMetadata md = Valid();
    md.mutable_regions(0)->clear_rkey();
    CHECK_THAT(Error(md), Catch::Contains("rkey is 0 bytes (allowed 1..4096)"));
    md.mutable_regions(0)->set_memory(v1::DRAM);
    CHECK_THAT(Error(md), Catch::Contains("rkey is 0 bytes (allowed 1..4096)"));
    md.mutable_regions(0)->set_rkey(std::string(5000, 'r'));
    CHECK_THAT(Error(md), Catch::Contains("rkey is 5000 bytes"));
    md.mutable_regions(0)->set_memory(v1::VRAM);
    CHECK_THAT(Error(md), Catch::Contains("rkey is 5000 bytes (allowed 0..4096)"));
  }
  SECTION("control characters in a name or group") {
    v1::AgentMetadata md = Valid();
    md.mutable_regions(2)->set_name("aux\nFAKE LOG LINE");
    CHECK_THAT(Error(md), Catch::Contains("NUL or control character"));
    md.mutable_regions(2)->set_name("aux");
    md.mutable_regions(2)->set_group(std::string("g\0", 2));
    CHECK_THAT(Error(md), Catch::Contains("NUL or control character"));
  }
  SECTION("a VRAM region naming a host memory object") {
    v1::AgentMetadata md = Valid();
    md.mutable_regions(2)->set_memory(v1::VRAM);
    md.mutable_regions(2)->set_memory_id(42);
    std::string message = Error(md);
    CHECK_THAT(message, Catch::Contains("region 'aux'"));
    CHECK_THAT(message, Catch::Contains("host memory object 42"));
    md.mutable_regions(2)->set_memory(v1::DRAM);  // the same object as DRAM is fine
    CHECK(RemoteCatalog::FromMetadata(md, {}).ok());
  }
  SECTION("base + length overflow") {
    v1::AgentMetadata md = Valid();
    md.mutable_regions(0)->set_base_address(UINT64_MAX - 100);
    std::string message = Error(md);
    CHECK_THAT(message, Catch::Contains("region 'v.L0'"));
    CHECK_THAT(message, Catch::Contains("overflows"));
  }
  SECTION("layout beyond length, including a num_items*stride overflow") {
    v1::AgentMetadata md = Valid();
    md.mutable_regions(0)->mutable_layout()->set_num_items(17);
    CHECK_THAT(Error(md), Catch::Contains("beyond length 4096"));
    md.mutable_regions(0)->mutable_layout()->set_num_items(uint64_t{1} << 60);
    CHECK_THAT(Error(md), Catch::Contains("beyond length"));
  }
}

TEST_CASE("Roles are parsed, bounded and unique within a peer's group") {
  v1::AgentMetadata md = Valid();
  md.mutable_regions(0)->set_role("L0.V");
  md.mutable_regions(1)->set_role("L0.K");
  md.mutable_regions(2)->set_role("L0.K");  // aux: not in group kv
  auto catalog = RemoteCatalog::FromMetadata(md);
  REQUIRE(catalog.ok());
  CHECK(catalog->FindGroup("kv")[0]->role == "L0.K");
  CHECK(catalog->FindGroup("kv")[1]->role == "L0.V");

  SECTION("a role twice in one group names the peer, the group and both regions") {
    md.mutable_regions(0)->set_role("L0.K");
    std::string message = Error(md);
    CHECK_THAT(message, Catch::Contains("peer 'decode-0' group 'kv': regions 'k.L0' and 'v.L0' "
                                        "both declare role 'L0.K'"));
    CHECK_THAT(message, Catch::Contains("upgrade or restart that agent"));
  }
  SECTION("oversized, or with control characters (echoed escaped)") {
    md.mutable_regions(0)->set_role(std::string(129, 'r'));
    CHECK_THAT(Error(md), Catch::Contains("region 'v.L0' (index 0): role is 129 bytes (at most "
                                          "128)"));
    CatalogLimits limits;
    limits.max_role_bytes = 3;
    md.mutable_regions(0)->set_role("L0.V");
    CHECK_THAT(Error(md, limits), Catch::Contains("role is 4 bytes (at most 3)"));
    md.mutable_regions(0)->set_role(std::string("L0\x1b[2J", 6));
    std::string message = Error(md);
    CHECK_THAT(message, Catch::Contains("role 'L0\\x1b[2J' holds a NUL or control character"));
  }
}

}  // namespace
}  // namespace kvagent::registry
