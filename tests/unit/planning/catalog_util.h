// The planning tests' peer: the catalog an agent named "decode" exports with the regions
// of a test's registry (not same-host), as PlanTransfer and DestinationRanges see it.
#pragma once

#include "catch2/catch.hpp"
#include "proto/kvagent.pb.h"
#include "registry/region_registry.h"
#include "registry/remote_catalog.h"

namespace kvagent::planning::testing {

inline auto DecodeCatalog(registry::RegionRegistry& registry) {
  v1::AgentMetadata md;
  registry.Export(&md, /*same_host=*/false);
  md.set_name("decode");
  md.set_worker_address("w");
  auto catalog = registry::RemoteCatalog::FromMetadata(md);
  REQUIRE(catalog.ok());
  return catalog;
}

}  // namespace kvagent::planning::testing
