// CUDA VMM descriptors at an exporting agent's local door (PeerMemoryRequest
// .device_memory_ids, how a same-host peer agent imports an engine's VRAM): only a peer
// agent gets one (a session of the agent's uid or one in --peer-uids), only for an
// allocation a registered region announced (ExportedRegion.cuda_vmm_id), and every
// refusal names the id or the caller, the cause and the fix. The device-memory
// counterparts of the host-memory descriptor cases in unprivileged_test. Real kvagentd
// processes against the stand-in CUDA driver (tests/unit/gpu/standin_cuda.cc, through
// KVAGENT_CUDA_DRIVER): its VMM allocations are memfds shared as POSIX descriptors.
// The other-uid case needs root and setpriv (skipped otherwise, saying why).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "cli/agent_client.h"
#include "cli/daemon_process.h"
#include "cuda/driver.h"
#include "fmt/format.h"
#include "grpcpp/grpcpp.h"
#include "proto/kvagent.grpc.pb.h"
#include "tests/security/run_as.h"
#include "tests/unit/catch_main.h"

namespace kvagent::testing {
namespace {

using Catch::Matchers::Contains;
using cuda::CudaDriver;

constexpr uint64_t kRegionBytes = 256 << 10;
constexpr int kRegions = 4;
constexpr uint64_t kPoolBytes = kRegions * kRegionBytes;

// Why no CUDA driver (the stand-in through KVAGENT_CUDA_DRIVER, or a real one) loads
// here; "" when one does.
std::string DriverMissing() {
  auto driver = CudaDriver::Load();
  return driver.ok() ? "" : std::string(driver.status().message());
}

// A CUDA VMM allocation shared with an agent's session (its handle there), with
// kRegions VRAM regions "vmm.N" registered in it.
struct SharedPool {
  cuda::CudaVmmExportable vmm;
  uint64_t handle = 0;
  ~SharedPool() {
    if (vmm.range.address != 0) (void)(*CudaDriver::Load())->ReleaseVmm(vmm.range);
  }
};

void ShareAndRegister(cli::AgentClient& agent, SharedPool* pool) {
  CudaDriver* driver = *CudaDriver::Load();
  REQUIRE(driver->MakeCurrent(0).ok());
  auto created = driver->CreateVmmExportable(0, kPoolBytes);
  INFO(created.status().ToString());
  REQUIRE(created.ok());
  pool->vmm = *std::move(created);
  auto session = agent.Session();
  INFO(session.status().ToString());
  REQUIRE(session.ok());
  auto shared = (*session)->ShareDeviceMemory(pool->vmm.fd.get(), 0, kPoolBytes, "vmm-pool");
  INFO(shared.status().ToString());
  REQUIRE(shared.ok());
  pool->handle = shared->handle();
  v1::RegisterRegionsRequest request;
  for (int r = 0; r < kRegions; ++r) {
    auto* spec = request.add_regions();
    spec->set_name(fmt::format("vmm.{}", r));
    spec->set_kind(v1::KV);
    spec->set_group("kv");
    spec->set_memory(v1::VRAM);
    spec->set_length(kRegionBytes);
    spec->mutable_layout()->set_num_items(kRegionBytes / 4096);
    spec->mutable_layout()->set_item_bytes(4096);
    spec->mutable_cuda_vmm()->set_memory_handle(pool->handle);
    spec->mutable_cuda_vmm()->set_offset(r * kRegionBytes);
  }
  auto registered = agent.Register(request);
  INFO(registered.status().ToString());
  REQUIRE(registered.ok());
}

// The CUDA VMM allocation ids `agent` announces to same-host peers, from its metadata
// (Peer.GetMetadata on its local door, as this test's session: a peer there).
std::vector<uint64_t> AnnouncedVmmIds(cli::AgentClient& agent, const std::string& address) {
  auto session = agent.Session();
  REQUIRE(session.ok());
  auto stub = v1::Peer::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  context.AddMetadata("kvagent-session", (*session)->token());
  v1::GetMetadataRequest request;
  request.set_caller("device-descriptors-test");
  v1::AgentMetadata metadata;
  const grpc::Status status = stub->GetMetadata(&context, request, &metadata);
  INFO(status.error_message());
  REQUIRE(status.ok());
  std::vector<uint64_t> ids;
  for (const auto& region : metadata.regions()) {
    if (region.cuda_vmm_id() == 0) continue;
    if (ids.empty() || ids.back() != region.cuda_vmm_id()) ids.push_back(region.cuda_vmm_id());
  }
  return ids;
}

cli::DaemonProcess StartAgent(const std::string& name, const std::string& work_dir,
                              std::vector<std::string> extra_args,
                              const std::string& local_socket = "") {
  auto binary = cli::FindKvagentd("");
  REQUIRE(binary.ok());
  cli::DaemonOptions options;
  options.binary = *binary;
  options.name = name;
  options.work_dir = work_dir;
  options.local_socket = local_socket;
  options.extra_args = std::move(extra_args);
  auto started = cli::DaemonProcess::Start(options);
  INFO(started.status().ToString());
  REQUIRE(started.ok());
  return *std::move(started);
}

std::string WorkDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return tmp != nullptr ? tmp : "/tmp";
}

uint64_t RefusedCalls(cli::AgentClient& agent) {
  auto status = agent.Status();
  REQUIRE(status.ok());
  return status->refused_calls();
}

TEST_CASE("a peer agent gets an announced CUDA VMM allocation's descriptor, NOT_FOUND naming "
          "any other") {
  if (auto why = DriverMissing(); !why.empty()) KVAGENT_SKIP("needs a CUDA driver: " + why);
  cli::DaemonProcess exporter = StartAgent("exporter", WorkDir(), {});
  cli::AgentClient agent(exporter.address());
  SharedPool pool;
  ShareAndRegister(agent, &pool);
  const std::vector<uint64_t> ids = AnnouncedVmmIds(agent, exporter.address());
  REQUIRE(ids.size() == 1);  // one allocation behind the four regions
  const uint64_t id = ids[0];
  // The next case relies on it: the first allocation shared with a fresh agent.
  CHECK(id == 1);
  auto session = agent.Session();
  REQUIRE(session.ok());

  // The positive control: this test's session runs as the agent's uid, a peer.
  auto given = (*session)->PeerDeviceMemories({id});
  INFO(given.status().ToString());
  REQUIRE(given.ok());
  REQUIRE(given->size() == 1);
  CHECK((*given)[0].id == id);
  CHECK((*given)[0].bytes >= kPoolBytes);
  CHECK((*given)[0].device == 0);
  {
    // It is the engine's allocation: imported here, it holds what the engine wrote.
    CudaDriver* driver = *CudaDriver::Load();
    std::vector<uint8_t> pattern(kPoolBytes);
    for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint8_t>(i * 131 + 7);
    REQUIRE(driver->Copy(pool.vmm.range.address, reinterpret_cast<uint64_t>(pattern.data()),
                         kPoolBytes)
                .ok());
    auto imported = driver->ImportVmm((*given)[0].fd.get(), 0, kPoolBytes, "test import");
    INFO(imported.status().ToString());
    REQUIRE(imported.ok());
    std::vector<uint8_t> seen(kPoolBytes);
    CHECK(driver->Copy(reinterpret_cast<uint64_t>(seen.data()), imported->address, kPoolBytes)
              .ok());
    CHECK(driver->ReleaseVmm(*imported).ok());
    CHECK(seen == pattern);
  }

  auto not_found = [&](const std::vector<uint64_t>& asked, uint64_t named) {
    auto refused = (*session)->PeerDeviceMemories(asked);
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == absl::StatusCode::kNotFound);
    CHECK_THAT(std::string(refused.status().message()),
               Contains(fmt::format("device memory {} is not exported by any registered region",
                                    named)) &&
                   Contains("fetch the metadata again"));
  };
  SECTION("an id no region announced") { not_found({id + 1000}, id + 1000); }
  SECTION("an announced id with an unknown one: the whole request is refused") {
    not_found({id, id + 7}, id + 7);
  }
  SECTION("id 0") { not_found({0}, 0); }
  SECTION("the allocation is still shared, but no registered region is in it") {
    std::vector<std::string> names;
    for (int r = 0; r < kRegions; ++r) names.push_back(fmt::format("vmm.{}", r));
    auto deregistered = agent.Deregister(names);
    INFO(deregistered.status().ToString());
    REQUIRE(deregistered.ok());
    CHECK(AnnouncedVmmIds(agent, exporter.address()).empty());
    not_found({id}, id);
  }
}

TEST_CASE("a session without the peer role gets no CUDA VMM descriptor") {
  if (auto why = DriverMissing(); !why.empty()) KVAGENT_SKIP("needs a CUDA driver: " + why);
  // Peers are uid 65534 only: this test's session (another uid) is an engine, no peer.
  cli::DaemonProcess exporter = StartAgent("exporter", WorkDir(), {"--peer-uids", "65534"});
  cli::AgentClient agent(exporter.address());
  auto status = agent.Status();
  REQUIRE(status.ok());
  const auto& roles = status->caller_roles();
  CHECK(std::find(roles.begin(), roles.end(), "engine") != roles.end());
  CHECK(std::find(roles.begin(), roles.end(), "peer") == roles.end());
  SharedPool pool;
  ShareAndRegister(agent, &pool);
  auto session = agent.Session();
  REQUIRE(session.ok());
  const uint64_t before = RefusedCalls(agent);
  // Id 1: the allocation its regions announce (the case above checks the numbering).
  auto refused = (*session)->PeerDeviceMemories({1});
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK_THAT(std::string(refused.status().message()),
             Contains("peer_memory") && Contains("is not a peer agent here") &&
                 Contains(fmt::format("uid:{}", geteuid())) && Contains("--peer-uids"));
  CHECK(RefusedCalls(agent) == before + 1);
  // The engine's own use of its allocation is unaffected.
  auto regions = agent.Regions();
  REQUIRE(regions.ok());
  CHECK(regions->regions_size() == kRegions);
}

TEST_CASE("another uid gets no CUDA VMM descriptor") {
  if (geteuid() != 0) KVAGENT_SKIP("needs root: the test runs the asker as uid 65534");
  if (access("/usr/bin/setpriv", X_OK) != 0) KVAGENT_SKIP("needs setpriv (util-linux)");
  if (auto why = DriverMissing(); !why.empty()) KVAGENT_SKIP("needs a CUDA driver: " + why);
  OpenDir dir;
  const std::string probe = CopyProbe(dir);
  // uid 65534 may open the socket (an engine there), not act as a peer.
  cli::DaemonProcess exporter = StartAgent("exporter", dir.path(),
                                           {"--local-socket-group", "65534"},
                                           dir.path() + "/exporter.sock");
  cli::AgentClient agent(exporter.address());
  SharedPool pool;
  ShareAndRegister(agent, &pool);
  const std::vector<uint64_t> ids = AnnouncedVmmIds(agent, exporter.address());
  REQUIRE(ids.size() == 1);
  const std::string id = std::to_string(ids[0]);
  const uint64_t before = RefusedCalls(agent);

  Outcome who = RunAs(65534, 65534, probe, exporter.address(), "status");
  CHECK(who.code == "OK");
  CHECK_THAT(who.message, Contains("uid:65534") && Contains("[engine]"));
  Outcome asked = RunAs(65534, 65534, probe, exporter.address(), "peer-device-memory", id);
  CHECK(asked.code == "PERMISSION_DENIED");
  CHECK_THAT(asked.message, Contains("uid:65534") && Contains("is not a peer agent here") &&
                                Contains("--peer-uids"));
  CHECK(RefusedCalls(agent) == before + 1);
  // The same request from the agent's own uid (a peer) is answered.
  Outcome own = RunAs(0, 0, probe, exporter.address(), "peer-device-memory", id);
  CHECK(own.code == "OK");
}

}  // namespace
}  // namespace kvagent::testing
