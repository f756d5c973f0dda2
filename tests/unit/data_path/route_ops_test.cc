// The route table (agent/data_path RouteOps) on a peer view built from real metadata:
// which way each planned operation moves, the active-message routes for an endpoint
// without native RMA (and not to a peer that does not take them, nor without a
// Stager), the rows that come before them (the peer's staged region, a region mapped
// here), and VRAM that nothing can reach refused with the region named.
#include <memory>
#include <string>
#include <vector>

#include "agent/data_path.h"
#include "catch2/catch.hpp"
#include "registry/remote_catalog.h"

namespace kvagent::agent {
namespace {

// Two host regions of peer "decode": slot 0 plain, slot 1 staged (memory_path
// "staged", as under the peer's --stage-host-regions).
std::shared_ptr<const registry::RemoteCatalog> Catalog() {
  v1::AgentMetadata metadata;
  metadata.set_name("decode");
  metadata.set_incarnation(7);
  metadata.set_worker_address("ucx-address");
  metadata.set_version(1);
  for (int i = 0; i < 2; ++i) {
    v1::ExportedRegion* r = metadata.add_regions();
    r->set_name(i == 0 ? "decode.kv" : "decode.staged");
    r->set_group(i == 0 ? "kv" : "staged");
    r->set_base_address(0x100000 + uint64_t(i) * 0x100000);
    r->set_length(0x10000);
    r->mutable_layout()->set_num_items(16);
    r->mutable_layout()->set_item_bytes(4096);
    r->mutable_layout()->set_item_stride(4096);
    r->set_rkey("rkey");
    if (i == 1) r->set_memory_path("staged");
  }
  auto catalog = registry::RemoteCatalog::FromMetadata(metadata);
  INFO(catalog.status().ToString());
  REQUIRE(catalog.ok());
  return std::make_shared<const registry::RemoteCatalog>(*std::move(catalog));
}

planning::TransferPlan Plan(uint32_t slot, bool local_device = false) {
  planning::TransferPlan plan;
  planning::PlanOp op;
  op.local_address = 0x7000000;
  op.remote_address = 0x100000 + uint64_t(slot) * 0x100000;
  op.length = 4096;
  op.rkey_slot = slot;
  op.local_device = local_device;
  plan.ops.push_back(op);
  plan.bytes = op.length;
  return plan;
}

PeerSnapshot Peer(bool am_data) {
  PeerSnapshot peer;
  peer.name = "decode";
  peer.catalog = Catalog();
  peer.am_data = am_data;
  return peer;
}

Route RouteOf(v1::TransferOp op, const planning::TransferPlan& plan, const PeerSnapshot& peer,
              bool stager = true, bool ucx_cuda = false) {
  auto routes = RouteOps("t", op, plan, peer, stager, ucx_cuda);
  INFO(routes.status().ToString());
  REQUIRE(routes.ok());
  REQUIRE(routes->size() == plan.ops.size());
  return routes->front();
}

TEST_CASE("an endpoint without native RMA: host memory moves as active messages, only to a "
          "peer that takes them and with a Stager") {
  CHECK(RouteOf(v1::WRITE, Plan(0), Peer(true)) == Route::kAmWrite);
  CHECK(RouteOf(v1::READ, Plan(0), Peer(true)) == Route::kAmRead);
  CHECK(RouteName(Route::kAmWrite) == "am-write");
  CHECK(RouteName(Route::kAmRead) == "am-read");
  CHECK(IsStaged(Route::kAmWrite));
  CHECK(IsStaged(Route::kAmRead));
  // A peer that does not announce kWireAmData (an older agent), or no Stager here:
  // UCX's RMA, as before.
  CHECK(RouteOf(v1::WRITE, Plan(0), Peer(false)) == Route::kUcxRma);
  CHECK(RouteOf(v1::READ, Plan(0), Peer(false)) == Route::kUcxRma);
  CHECK(RouteOf(v1::WRITE, Plan(0), Peer(true), /*stager=*/false) == Route::kUcxRma);
}

TEST_CASE("the peer's staged region and a region mapped here come before the active-message "
          "routes") {
  CHECK(RouteOf(v1::WRITE, Plan(1), Peer(true)) == Route::kStagedChunks);
  CHECK(RouteOf(v1::READ, Plan(1), Peer(true)) == Route::kStagedRemoteRead);
  CHECK(RouteOf(v1::WRITE, Plan(1), Peer(false)) == Route::kStagedChunks);

  PeerSnapshot mapped = Peer(true);
  auto direct = std::make_shared<DirectMappings>();
  static uint8_t page[4096];
  direct->base_by_slot = {page, nullptr};
  mapped.direct = direct;
  CHECK(RouteOf(v1::WRITE, Plan(0), mapped) == Route::kHostCopy);
  CHECK(RouteOf(v1::READ, Plan(0), mapped) == Route::kHostCopy);
  CHECK(RouteOf(v1::WRITE, Plan(1), mapped) == Route::kStagedChunks);
}

TEST_CASE("local VRAM that UCX cannot move: through active messages when the peer takes "
          "them, else refused naming the segment, the peer's region and the fix") {
  CHECK(RouteOf(v1::WRITE, Plan(0, /*local_device=*/true), Peer(true)) == Route::kAmWrite);
  auto refused = RouteOps("vram-w", v1::WRITE, Plan(0, true), Peer(false), true, false);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  const std::string message(refused.status().message());
  CHECK_THAT(message, Catch::Contains("transfer 'vram-w' segment 0") &&
                          Catch::Contains("region 'decode.kv'") &&
                          Catch::Contains("CUDA-enabled UCX"));
  // With a CUDA-capable UCX it is plain RMA.
  CHECK(RouteOf(v1::WRITE, Plan(0, true), Peer(false), true, /*ucx_cuda=*/true) == Route::kUcxRma);
}

}  // namespace
}  // namespace kvagent::agent
