// VRAM through two real kvagentd processes: the test allocates device memory with the
// CUDA driver API, shares it as CUDA IPC handles or as CUDA VMM POSIX descriptors
// (ShareDeviceMemory over each agent's session socket), registers it with the agents
// and moves KV pages and a Mamba state slot VRAM to VRAM, host to VRAM and VRAM to
// host, then compares every byte. Without a GPU and driver it skips with the reason.
// tests/gpu:vram_standin_test runs it everywhere against the stand-in driver
// (tests/unit/gpu/standin_cuda.cc), which found VMM regions at a nonzero offset all
// mapped at their allocation's start.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "cli/agent_client.h"
#include "cli/daemon_process.h"
#include "cli/kv_pool.h"
#include "cuda/driver.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/integration/metrics_scrape.h"
#include "tests/unit/catch_main.h"

namespace kvagent::testing {
namespace {

using cuda::CudaDriver;

constexpr uint32_t kLayers = 4;           // 4 layers x K,V
constexpr uint64_t kPages = 16;
constexpr uint64_t kPageBytes = 32 << 10;  // Llama-3.1-8B page, one layer, K or V
constexpr uint64_t kSlots = 4;
constexpr uint64_t kConvBytes = 32256;     // Mamba2-2.7B conv state, one layer
constexpr uint64_t kSsmBytes = 2621440;    // Mamba2-2.7B SSM state, one layer
constexpr uint64_t kKvBytes = 2 * kLayers * kPages * kPageBytes;
constexpr uint64_t kStateBytes = kSlots * (kConvBytes + kSsmBytes);
constexpr uint64_t kPoolBytes = kKvBytes + kStateBytes;

// How the engine (this test) hands a pool to its agent.
enum class Share {
  kIpc,  // cuMemAlloc + a legacy CUDA IPC handle in each region (cuda_ipc)
  kVmm,  // cuMemCreate + a POSIX descriptor over the session socket (cuda_vmm)
};

struct DevicePool {
  Share share = Share::kIpc;
  uint64_t dptr = 0;
  std::string handle;                 // kIpc: the 64 bytes of cuIpcGetMemHandle
  cuda::CudaVmmExportable vmm;   // kVmm: the allocation and its descriptor
  uint64_t memory_handle = 0;         // kVmm: the agent session's handle for it
  ~DevicePool() {
    CudaDriver* driver = *CudaDriver::Load();
    if (share == Share::kVmm && vmm.range.address != 0) {
      (void)driver->ReleaseVmm(vmm.range);
    } else if (share == Share::kIpc && dptr != 0) {
      (void)driver->MemFree(dptr);
    }
  }
};

// kVmm also shares the descriptor with `agent` (its session: the one that registers).
void AllocatePool(DevicePool* pool, Share share = Share::kIpc, cli::AgentClient* agent = nullptr) {
  CudaDriver* driver = *CudaDriver::Load();
  REQUIRE(driver->MakeCurrent(0).ok());
  pool->share = share;
  if (share == Share::kVmm) {
    REQUIRE(agent != nullptr);
    auto created = driver->CreateVmmExportable(0, kPoolBytes);
    INFO(created.status().ToString());
    REQUIRE(created.ok());
    pool->vmm = *std::move(created);
    pool->dptr = pool->vmm.range.address;
    auto session = agent->Session();
    INFO(session.status().ToString());
    REQUIRE(session.ok());
    // Not a multiple of the granularity: the agent rounds up as cuMemCreate did.
    auto info = (*session)->ShareDeviceMemory(pool->vmm.fd.get(), 0, kPoolBytes, "vram-pool");
    INFO(info.status().ToString());
    REQUIRE(info.ok());
    CHECK(info->kind() == "cuda-vmm");
    CHECK(info->bytes() == kPoolBytes);
    pool->memory_handle = info->handle();
    return;
  }
  auto dptr = driver->MemAlloc(kPoolBytes);
  REQUIRE(dptr.ok());
  pool->dptr = *dptr;
  auto handle = driver->IpcGetHandle(pool->dptr);
  REQUIRE(handle.ok());
  pool->handle = *handle;
}

// KV regions (group `kv_group`) then conv and ssm state regions, all in one allocation.
v1::RegisterRegionsRequest VramRegions(const std::string& prefix, const DevicePool& pool,
                                       const std::string& kv_group) {
  v1::RegisterRegionsRequest request;
  auto add = [&](const std::string& name, v1::RegionKind kind, const std::string& group,
                 uint64_t offset, uint64_t items, uint64_t item_bytes) {
    auto* spec = request.add_regions();
    spec->set_name(prefix + name);
    spec->set_kind(kind);
    spec->set_group(group);
    spec->set_memory(v1::VRAM);
    spec->set_length(items * item_bytes);
    spec->mutable_layout()->set_num_items(items);
    spec->mutable_layout()->set_item_bytes(item_bytes);
    if (pool.share == Share::kVmm) {
      spec->mutable_cuda_vmm()->set_memory_handle(pool.memory_handle);
      spec->mutable_cuda_vmm()->set_offset(offset);
      return;
    }
    spec->mutable_cuda_ipc()->set_ipc_handle(pool.handle);
    spec->mutable_cuda_ipc()->set_device(0);
    spec->mutable_cuda_ipc()->set_offset(offset);
  };
  for (uint32_t r = 0; r < 2 * kLayers; ++r) {
    add(".kv" + std::to_string(r), v1::KV, kv_group, r * kPages * kPageBytes, kPages, kPageBytes);
  }
  add(".conv", v1::STATE, "conv", kKvBytes, kSlots, kConvBytes);
  add(".ssm", v1::STATE, "ssm", kKvBytes + kSlots * kConvBytes, kSlots, kSsmBytes);
  return request;
}

std::vector<uint8_t> PatternPool(uint64_t seed) {
  std::vector<uint8_t> host(kPoolBytes);
  for (uint64_t off = 0; off < kPoolBytes; off += kPageBytes) {
    cli::FillPage(host.data() + off, std::min(kPageBytes, kPoolBytes - off), seed, 0, off / kPageBytes);
  }
  return host;
}

struct Agents {
  std::string work = [] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    return std::string(tmp ? tmp : "/tmp");
  }();
  cli::DaemonProcess prefill, decode;
  // `prefill_env`: added to the prefill agent's environment only.
  explicit Agents(const std::vector<std::string>& extra_args = {},
                  const std::map<std::string, std::string>& prefill_env = {}) {
    auto binary = cli::FindKvagentd("");
    REQUIRE(binary.ok());
    for (auto [name, process] : {std::pair{"gpu-prefill", &prefill}, {"gpu-decode", &decode}}) {
      cli::DaemonOptions d;
      d.binary = *binary;
      d.name = name;
      d.work_dir = work;
      d.extra_args = extra_args;
      if (process == &prefill) d.env = prefill_env;
      auto started = cli::DaemonProcess::Start(d);
      INFO(started.status().ToString());
      REQUIRE(started.ok());
      *process = *std::move(started);
    }
  }
};

v1::SubmitTransferRequest Write(const std::string& id, const std::string& local_group,
                                const std::string& remote_group, std::vector<uint64_t> local,
                                std::vector<uint64_t> remote) {
  v1::SubmitTransferRequest request;
  request.set_transfer_id(id);
  request.set_peer("gpu-decode");
  request.set_op(v1::WRITE);
  request.set_notification(id);
  auto* items = request.add_segments()->mutable_items();
  items->set_local_group(local_group);
  items->set_remote_group(remote_group);
  for (auto i : local) items->add_local_indices(i);
  for (auto i : remote) items->add_remote_indices(i);
  return request;
}

// `extra_args` for both agents; `expect_data_path` is the peer's data path; each side's
// pool shared as `prefill_share` / `decode_share`; `expect_device_copy`, when given, is
// how prefill's GetStatus.device_copy starts.
void VramToVram(const std::vector<std::string>& extra_args, const std::string& expect_data_path,
                Share prefill_share = Share::kIpc, Share decode_share = Share::kIpc,
                const std::string& expect_device_copy = "") {
  Agents agents(extra_args);
  cli::AgentClient prefill(agents.prefill.address()), decode(agents.decode.address());
  DevicePool src, dst;
  AllocatePool(&src, prefill_share, &prefill);
  AllocatePool(&dst, decode_share, &decode);
  const auto pattern = PatternPool(11);
  ToDevice(src.dptr, pattern);
  ToDevice(dst.dptr, std::vector<uint8_t>(kPoolBytes, 0xEE));

  auto registered = prefill.Register(VramRegions("p", src, "kv"));
  INFO(registered.status().ToString());
  REQUIRE(registered.ok());
  std::printf("prefill VRAM region path: %s\n", registered->regions(0).memory_path().c_str());
  if (prefill_share == Share::kVmm) {
    // Imported by VMM, the regions' path is as for any VRAM: zero-copy with a CUDA UCX.
    for (const auto& region : registered->regions()) {
      CHECK((region.memory_path() == "staged" || region.memory_path() == "zero-copy"));
      CHECK(region.spec().has_cuda_vmm());
    }
  }
  auto decode_registered = decode.Register(VramRegions("d", dst, "kv"));
  INFO(decode_registered.status().ToString());
  REQUIRE(decode_registered.ok());
  auto peer = prefill.Connect(agents.decode.address());
  INFO(peer.status().ToString());
  REQUIRE(peer.ok());
  std::printf("data path %s, UCX transports %s\n", peer->data_path().c_str(), peer->transports().c_str());
  CHECK(peer->data_path() == expect_data_path);

  auto request = Write("vram-1", "kv", "kv", {1, 2, 3, 7}, {9, 4, 5, 15});
  for (const char* group : {"conv", "ssm"}) {
    auto* state = request.add_segments()->mutable_items();
    state->set_local_group(group);
    state->set_remote_group(group);
    state->add_local_indices(1);
    state->add_remote_indices(3);
  }
  auto submitted = prefill.Submit(request);
  INFO(submitted.status().ToString());
  REQUIRE(submitted.ok());
  const uint64_t request_bytes = 2 * kLayers * 4 * kPageBytes + kConvBytes + kSsmBytes;
  auto done = prefill.WaitTransfer("vram-1", 30000);
  REQUIRE(done.ok());
  INFO(done->error_message());
  REQUIRE(done->phase() == v1::COMPLETED);

  auto status = prefill.Status();
  REQUIRE(status.ok());
  const v1::CopyLaneStatus& lanes = status->copy_lanes();
  std::printf("device copy: %s; %lu batches (%lu split across %u streams), %lu bytes\n",
              status->device_copy().c_str(), static_cast<unsigned long>(lanes.device_batches()),
              static_cast<unsigned long>(lanes.device_split_batches()), lanes.lanes(),
              static_cast<unsigned long>(lanes.device_bytes()));
  if (expect_data_path == "shm-direct") {
    // Every byte moved by the device copy path; the state slot alone (2.5 MiB) makes a
    // batch that more than one stream copies when there are lanes to split it.
    CHECK(lanes.device_bytes() == request_bytes);
    CHECK(lanes.device_batches() >= 1);
    if (lanes.lanes() > 1) CHECK(lanes.device_split_batches() >= 1);
  }
  if (!expect_device_copy.empty()) {
    // A forced mechanism this driver lacks goes per page and says why (printed above).
    CHECK((status->device_copy().rfind(expect_device_copy, 0) == 0 ||
           status->device_copy().find(", but ") != std::string::npos));
  }
  const auto got = FromDevice(dst.dptr, kPoolBytes);
  auto page = [](uint32_t region, uint64_t page) { return region * kPages * kPageBytes + page * kPageBytes; };
  const std::vector<std::pair<uint64_t, uint64_t>> moved = {{1, 9}, {2, 4}, {3, 5}, {7, 15}};
  for (uint32_t r = 0; r < 2 * kLayers; ++r) {
    for (auto [s, d] : moved) {
      CHECK(std::memcmp(got.data() + page(r, d), pattern.data() + page(r, s), kPageBytes) == 0);
    }
    CHECK(got[page(r, 0)] == 0xEE);  // untouched page
  }
  const uint64_t conv = kKvBytes, ssm = kKvBytes + kSlots * kConvBytes;
  CHECK(std::memcmp(got.data() + conv + 3 * kConvBytes, pattern.data() + conv + 1 * kConvBytes, kConvBytes) == 0);
  CHECK(std::memcmp(got.data() + ssm + 3 * kSsmBytes, pattern.data() + ssm + 1 * kSsmBytes, kSsmBytes) == 0);
  CHECK(got[conv] == 0xEE);
  CHECK(got[ssm + 2 * kSsmBytes] == 0xEE);
  // Staged: the notification is released once the decode agent copied the last chunk
  // in, which can be a moment after the sender completed.
  int notifications = 0;
  for (int i = 0; i < 500 && notifications == 0; ++i) {
    auto notes = decode.Poll(0);
    REQUIRE(notes.ok());
    notifications += notes->notifications_size();
    if (notifications == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(notifications == 1);
}

TEST_CASE("VRAM to VRAM: KV pages and a Mamba state slot between two agents") {
  if (auto why = GpuMissing(); !why.empty()) KVAGENT_SKIP("needs an NVIDIA GPU and driver: " + why);
  VramToVram({}, "shm-direct");
}

// Each device copy mechanism, forced through KVAGENT_DEVICE_COPY (the agents inherit
// it): the same pages and state slot, every byte compared.
TEST_CASE("VRAM to VRAM by each device copy mechanism (KVAGENT_DEVICE_COPY)") {
  if (auto why = GpuMissing(); !why.empty()) KVAGENT_SKIP("needs an NVIDIA GPU and driver: " + why);
  for (auto [choice, mode] : {std::pair{"batch", "cuMemcpyBatchAsync per batch"},
                              {"kernel", "gather kernel per batch"},
                              {"per-page", "cuMemcpyAsync per page"}}) {
    DYNAMIC_SECTION(choice) {
      struct ForcedMechanism {  // unset again however the section ends
        explicit ForcedMechanism(const char* value) { setenv("KVAGENT_DEVICE_COPY", value, 1); }
        ~ForcedMechanism() { unsetenv("KVAGENT_DEVICE_COPY"); }
      } forced(choice);
      VramToVram({}, "shm-direct", Share::kIpc, Share::kIpc, mode);
    }
  }
}

// The cross-host path on one host: no CUDA IPC shortcut, so without a CUDA-enabled UCX
// every byte goes through pinned host staging (1 MiB chunks: the SSM slot splits).
TEST_CASE("VRAM to VRAM through host staging (--shm-direct off)") {
  if (auto why = GpuMissing(); !why.empty()) KVAGENT_SKIP("needs an NVIDIA GPU and driver: " + why);
  VramToVram({"--shm-direct", "off", "--staging-chunk-bytes", "1048576", "--staging-buffers", "4"},
             "ucx");
}

// The engine shares its pool as a CUDA VMM allocation (cuMemCreate, exported as a POSIX
// descriptor over the session socket); the decode agent's pool is a legacy CUDA IPC
// one, which the prefill agent opens itself: device to device on this host.
TEST_CASE("VRAM by CUDA VMM descriptor to VRAM by CUDA IPC handle") {
  if (auto why = GpuMissing(); !why.empty()) KVAGENT_SKIP("needs an NVIDIA GPU and driver: " + why);
  VramToVram({}, "shm-direct", Share::kVmm, Share::kIpc);
}

// Both pools by VMM: the decode agent announces its allocation to the same-host
// prefill agent, which fetches the descriptor over decode's session socket, imports it
// and copies device to device (before, such regions always went through host staging:
// data path "ucx", no device bytes).
TEST_CASE("VRAM by CUDA VMM descriptor on both sides") {
  if (auto why = GpuMissing(); !why.empty()) KVAGENT_SKIP("needs an NVIDIA GPU and driver: " + why);
  VramToVram({"--staging-chunk-bytes", "1048576", "--staging-buffers", "4"}, "shm-direct",
             Share::kVmm, Share::kVmm);
}

// The peer's pool by VMM, ours by a legacy IPC handle: imported from the peer.
TEST_CASE("VRAM by CUDA IPC handle to VRAM by CUDA VMM descriptor") {
  if (auto why = GpuMissing(); !why.empty()) KVAGENT_SKIP("needs an NVIDIA GPU and driver: " + why);
  VramToVram({}, "shm-direct", Share::kIpc, Share::kVmm);
}

// What an engine sees when it shares VRAM wrongly: each refusal names the region, the
// cause and the fix; nothing of a refused batch is registered; a good batch after works.
TEST_CASE("VRAM registrations that cannot work are refused with the reason") {
  if (auto why = GpuMissing(); !why.empty()) KVAGENT_SKIP("needs an NVIDIA GPU and driver: " + why);
  Agents agents;
  cli::AgentClient prefill(agents.prefill.address());
  DevicePool pool;
  AllocatePool(&pool);
  auto refused = [&](v1::RegisterRegionsRequest request, const std::vector<std::string>& says) {
    auto registered = prefill.Register(request);
    INFO(registered.status().ToString());
    REQUIRE_FALSE(registered.ok());
    CHECK(registered.status().code() == absl::StatusCode::kInvalidArgument);
    for (const auto& text : says) CHECK_THAT(std::string(registered.status().message()), Catch::Contains(text));
    auto listed = prefill.Regions();
    REQUIRE(listed.ok());
    CHECK(listed->regions_size() == 0);  // nothing of the batch stayed
  };
  SECTION("bytes that are no CUDA IPC handle") {
    auto request = VramRegions("p", pool, "kv");
    request.mutable_regions(3)->mutable_cuda_ipc()->set_ipc_handle(std::string(64, '\x5a'));
    refused(request, {"region 'p.kv3'", "cuIpcOpenMemHandle", "cudaIpcGetMemHandle"});
  }
  SECTION("a region past the end of the allocation") {
    auto request = VramRegions("p", pool, "kv");
    auto* last = request.mutable_regions(request.regions_size() - 1);
    last->mutable_cuda_ipc()->set_offset(kPoolBytes - last->length() / 2);
    refused(request, {"region '" + last->name() + "'", "the allocation behind the handle has",
                      "fix offset/length"});
  }
  SECTION("a device this host does not have") {
    auto request = VramRegions("p", pool, "kv");
    request.mutable_regions(0)->mutable_cuda_ipc()->set_device(64);
    refused(request, {"region 'p.kv0'", "64"});
  }
  auto good = prefill.Register(VramRegions("p", pool, "kv"));
  INFO(good.status().ToString());
  CHECK(good.ok());
}

TEST_CASE("host to VRAM and VRAM to host") {
  if (auto why = GpuMissing(); !why.empty()) KVAGENT_SKIP("needs an NVIDIA GPU and driver: " + why);
  Agents agents;
  cli::AgentClient prefill(agents.prefill.address()), decode(agents.decode.address());
  cli::KvPoolShape shape;
  shape.group = "kvh";
  shape.layers = kLayers;
  shape.pages = kPages;
  shape.page_bytes = kPageBytes;
  auto host_src = cli::CreateKvPool(prefill, "ph", shape);
  REQUIRE(host_src.ok());
  auto host_dst = cli::CreateKvPool(decode, "dh", shape);
  REQUIRE(host_dst.ok());
  for (uint32_t r = 0; r < host_src->regions(); ++r) {
    for (uint64_t p = 0; p < kPages; ++p) cli::FillPage(host_src->Page(r, p), kPageBytes, 5, r, p);
  }
  std::memset(host_dst->mapping.data(), 0xEE, host_dst->bytes());
  DevicePool src, dst;
  AllocatePool(&src);
  AllocatePool(&dst);
  const auto pattern = PatternPool(13);
  ToDevice(src.dptr, pattern);
  ToDevice(dst.dptr, std::vector<uint8_t>(kPoolBytes, 0xEE));
  REQUIRE(prefill.Register(VramRegions("p", src, "kvd")).ok());
  REQUIRE(decode.Register(VramRegions("d", dst, "kvd")).ok());
  REQUIRE(prefill.Connect(agents.decode.address()).ok());

  // host (prefill) -> VRAM (decode)
  REQUIRE(prefill.Submit(Write("h2d", "kvh", "kvd", {0, 5}, {6, 2})).ok());
  auto h2d = prefill.WaitTransfer("h2d", 30000);
  REQUIRE(h2d.ok());
  INFO(h2d->error_message());
  REQUIRE(h2d->phase() == v1::COMPLETED);
  const auto got = FromDevice(dst.dptr, kKvBytes);
  for (uint32_t r = 0; r < 2 * kLayers; ++r) {
    CHECK(std::memcmp(got.data() + (r * kPages + 6) * kPageBytes, host_src->Page(r, 0), kPageBytes) == 0);
    CHECK(std::memcmp(got.data() + (r * kPages + 2) * kPageBytes, host_src->Page(r, 5), kPageBytes) == 0);
  }

  // VRAM (prefill) -> host (decode)
  REQUIRE(prefill.Submit(Write("d2h", "kvd", "kvh", {4, 8}, {1, 3})).ok());
  auto d2h = prefill.WaitTransfer("d2h", 30000);
  REQUIRE(d2h.ok());
  INFO(d2h->error_message());
  REQUIRE(d2h->phase() == v1::COMPLETED);
  for (uint32_t r = 0; r < 2 * kLayers; ++r) {
    CHECK(std::memcmp(host_dst->Page(r, 1), pattern.data() + (r * kPages + 4) * kPageBytes, kPageBytes) == 0);
    CHECK(std::memcmp(host_dst->Page(r, 3), pattern.data() + (r * kPages + 8) * kPageBytes, kPageBytes) == 0);
    CHECK(host_dst->Page(r, 0)[0] == 0xEE);
  }
}

// The stand-in driver's VMM imports held by process `pid`: each keeps the exporter's
// memfd open (tests/unit/gpu/standin_cuda.cc) until cuMemRelease.
int StandinVmmImports(pid_t pid) {
  int n = 0;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    std::error_code error;
    const auto target = std::filesystem::read_symlink(entry.path(), error);
    if (!error && target.string().find("kvagent-standin-vmm") != std::string::npos) ++n;
  }
  return n;
}

// Waits (up to 20 s) until `ready` holds; false if it never did.
bool WaitFor(const std::function<bool()>& ready) {
  for (int i = 0; i < 2000; ++i) {
    if (ready()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return ready();
}

cli::KvPoolShape HostShape() {
  cli::KvPoolShape shape;
  shape.group = "kvh";
  shape.layers = kLayers;
  shape.pages = kPages;
  shape.page_bytes = kPageBytes;
  return shape;
}

// Host memory on the prefill agent, a CUDA VMM pool on the decode agent: a WRITE into
// it and a READ out of it, scattered pages of regions at nonzero offsets of the
// allocation, every byte compared. Directly (the prefill agent imports decode's
// allocation: shm-direct, every byte by the device copy path), or with `refuse` the
// prefill agent's driver refuses the import (the stand-in's
// KVAGENT_STANDIN_REFUSE_VMM_IMPORT): the regions fall back to host staging, `peers`
// says why and counts the failed import, so do the metrics and doctor, and the bytes
// still arrive.
void HostAndPeerVmm(bool refuse) {
  std::map<std::string, std::string> env;
  if (refuse) env["KVAGENT_STANDIN_REFUSE_VMM_IMPORT"] = "1";
  Agents agents({"--staging-chunk-bytes", "1048576", "--staging-buffers", "4",
                 "--metrics-listen", "127.0.0.1:0"},
                env);
  cli::AgentClient prefill(agents.prefill.address()), decode(agents.decode.address());
  auto host = cli::CreateKvPool(prefill, "ph", HostShape());
  REQUIRE(host.ok());
  for (uint32_t r = 0; r < host->regions(); ++r) {
    for (uint64_t p = 0; p < kPages; ++p) cli::FillPage(host->Page(r, p), kPageBytes, 5, r, p);
  }
  DevicePool pool;
  AllocatePool(&pool, Share::kVmm, &decode);
  const auto pattern = PatternPool(17);
  ToDevice(pool.dptr, pattern);
  auto registered = decode.Register(VramRegions("d", pool, "kvd"));
  INFO(registered.status().ToString());
  REQUIRE(registered.ok());
  auto peer = prefill.Connect(agents.decode.address());
  INFO(peer.status().ToString());
  REQUIRE(peer.ok());
  for (const auto& why : peer->direct_fallbacks()) std::printf("fallback: %s\n", why.c_str());
  // The prefill agent's totals over its peers, and doctor's check of the peer.
  const std::string metrics = Scrape(MetricsAddress(prefill));
  CHECK_THAT(metrics, Catch::Contains("# TYPE kvagent_peer_direct_fallbacks gauge") &&
                          Catch::Contains("# TYPE kvagent_peer_vmm_import_failures gauge"));
  CHECK(Value(metrics, "kvagent_peer_direct_fallbacks") == (refuse ? 2 * kLayers + 2 : 0));
  CHECK(Value(metrics, "kvagent_peer_vmm_import_failures") == (refuse ? 1 : 0));
  CHECK_THAT(metrics, Catch::Contains("# TYPE kvagent_vmm_import_failures_total counter"));
  CHECK(Value(metrics, "kvagent_vmm_import_failures_total") == (refuse ? 1 : 0));
  auto report = prefill.Doctor();
  INFO(report.status().ToString());
  REQUIRE(report.ok());
  const v1::DoctorCheck* check = nullptr;
  for (const auto& c : report->checks()) {
    if (c.name() == "peer:gpu-decode") check = &c;
  }
  REQUIRE(check != nullptr);
  std::printf("doctor: %s %s\n  fix: %s\n", v1::DoctorCheck::Result_Name(check->result()).c_str(),
              check->detail().c_str(), check->fix().c_str());
  if (refuse) {
    CHECK(check->result() == v1::DoctorCheck::WARN);
    CHECK_THAT(check->detail(),
               Catch::Contains(std::to_string(2 * kLayers + 2) +
                               " of its regions are not mapped here") &&
                   Catch::Contains("1 of its CUDA VMM allocations could not be imported") &&
                   Catch::Contains("first: region 'd.kv0': cannot import its CUDA VMM memory"));
    CHECK_THAT(check->fix(), Catch::Contains("host staging") &&
                                 Catch::Contains("CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR") &&
                                 Catch::Contains("same NVIDIA driver") &&
                                 Catch::Contains("same uid") && Catch::Contains("--shm-direct"));
  } else {
    CHECK(check->result() == v1::DoctorCheck::PASS);
  }
  if (refuse) {
    CHECK(peer->data_path() == "ucx");  // nothing of decode's could be mapped
    CHECK(peer->vmm_import_failures() == 1);  // one allocation
    REQUIRE(peer->direct_fallbacks_size() == 2 * kLayers + 2);
    CHECK(peer->direct_fallback_regions() == 2 * kLayers + 2);
    CHECK_THAT(peer->direct_fallbacks(0),
               Catch::Contains("region 'd.kv0'") &&
                   Catch::Contains("cannot import its CUDA VMM memory") &&
                   Catch::Contains("cuMemImportFromShareableHandle") &&
                   Catch::Contains("moves through host staging"));
  } else {
    CHECK(peer->data_path() == "shm-direct");
    CHECK(peer->direct_fallbacks_size() == 0);
    CHECK(peer->direct_fallback_regions() == 0);
    CHECK(peer->vmm_import_failures() == 0);
    if (StandinDriver()) CHECK(StandinVmmImports(agents.prefill.pid()) == 1);  // one for 10 regions
    // Only allocations a registered region announced are handed out.
    auto session = decode.Session();
    REQUIRE(session.ok());
    auto unknown = (*session)->PeerDeviceMemories({9999});
    REQUIRE_FALSE(unknown.ok());
    CHECK(unknown.status().code() == absl::StatusCode::kNotFound);
    CHECK_THAT(std::string(unknown.status().message()),
               Catch::Contains("device memory 9999 is not exported by any registered region"));
  }

  // host (prefill) -> VMM (decode)
  REQUIRE(prefill.Submit(Write("h2v", "kvh", "kvd", {0, 5, 6}, {6, 2, 13})).ok());
  auto written = prefill.WaitTransfer("h2v", 30000);
  REQUIRE(written.ok());
  INFO(written->error_message());
  REQUIRE(written->phase() == v1::COMPLETED);
  const auto got = FromDevice(pool.dptr, kPoolBytes);
  auto page = [](uint32_t r, uint64_t p) { return (r * kPages + p) * kPageBytes; };
  for (uint32_t r = 0; r < 2 * kLayers; ++r) {
    for (auto [s, d] : std::vector<std::pair<uint64_t, uint64_t>>{{0, 6}, {5, 2}, {6, 13}}) {
      CHECK(std::memcmp(got.data() + page(r, d), host->Page(r, s), kPageBytes) == 0);
    }
    CHECK(std::memcmp(got.data() + page(r, 1), pattern.data() + page(r, 1), kPageBytes) == 0);
  }

  // VMM (decode) -> host (prefill), by READ
  v1::SubmitTransferRequest read = Write("v2h", "kvh", "kvd", {1, 3}, {4, 8});
  read.set_op(v1::READ);
  REQUIRE(prefill.Submit(read).ok());
  auto read_done = prefill.WaitTransfer("v2h", 30000);
  REQUIRE(read_done.ok());
  INFO(read_done->error_message());
  REQUIRE(read_done->phase() == v1::COMPLETED);
  std::vector<uint8_t> untouched(kPageBytes);
  for (uint32_t r = 0; r < 2 * kLayers; ++r) {
    CHECK(std::memcmp(host->Page(r, 1), pattern.data() + page(r, 4), kPageBytes) == 0);
    CHECK(std::memcmp(host->Page(r, 3), pattern.data() + page(r, 8), kPageBytes) == 0);
    cli::FillPage(untouched.data(), kPageBytes, 5, r, 2);
    CHECK(std::memcmp(host->Page(r, 2), untouched.data(), kPageBytes) == 0);
  }

  auto status = prefill.Status();
  REQUIRE(status.ok());
  // Directly, every byte of both went by the device copy path; staged, none.
  const uint64_t moved = 2 * kLayers * (3 + 2) * kPageBytes;
  CHECK(status->copy_lanes().device_bytes() == (refuse ? 0 : moved));

  // A metadata change of decode (a host pool registered) rebuilds prefill's view of it,
  // which retries the import that failed: the counter of failed attempts rises by one,
  // the gauge (the view in use) stays 1. A direct import is reused: both stay 0.
  cli::KvPoolShape more = HostShape();
  more.group = "kvx";
  auto added = cli::CreateKvPool(decode, "dx", more);
  REQUIRE(added.ok());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  uint32_t seen = peer->regions();
  while (seen <= peer->regions() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    auto peers = prefill.Peers();
    REQUIRE(peers.ok());
    for (const auto& p : peers->peers()) {
      if (p.name() == peer->name()) seen = p.regions();
    }
  }
  INFO("decode's regions in prefill's view: " << peer->regions() << " before, " << seen
                                              << " after registering " << added->regions());
  REQUIRE(seen == peer->regions() + added->regions());
  const std::string rebuilt = Scrape(MetricsAddress(prefill));
  CHECK(Value(rebuilt, "kvagent_vmm_import_failures_total") == (refuse ? 2 : 0));
  CHECK(Value(rebuilt, "kvagent_peer_vmm_import_failures") == (refuse ? 1 : 0));
}

TEST_CASE("host memory to and from a same-host peer's VRAM by CUDA VMM, directly") {
  if (auto why = GpuMissing(); !why.empty()) KVAGENT_SKIP("needs an NVIDIA GPU and driver: " + why);
  HostAndPeerVmm(false);
}

TEST_CASE("a CUDA VMM import the driver refuses falls back to host staging with the reason") {
  if (auto why = GpuMissing(); !why.empty()) KVAGENT_SKIP("needs an NVIDIA GPU and driver: " + why);
  if (!StandinDriver()) KVAGENT_SKIP("the refusal is the stand-in driver's test hook");
  HostAndPeerVmm(true);
}

// The decode engine's session ends (its VMM regions are deregistered) while the prefill
// agent writes into them: each transfer ends COMPLETED or FAILED, both agents stay up,
// the prefill agent releases its import of the allocation once its view of decode has
// no region left (the stand-in's open descriptors of it), and a new pool works.
TEST_CASE("a same-host peer's CUDA VMM pool going away during transfers") {
  if (auto why = GpuMissing(); !why.empty()) KVAGENT_SKIP("needs an NVIDIA GPU and driver: " + why);
  Agents agents;
  cli::AgentClient prefill(agents.prefill.address());
  auto decode = std::make_unique<cli::AgentClient>(agents.decode.address());
  auto host = cli::CreateKvPool(prefill, "ph", HostShape());
  REQUIRE(host.ok());
  for (uint32_t r = 0; r < host->regions(); ++r) {
    for (uint64_t p = 0; p < kPages; ++p) cli::FillPage(host->Page(r, p), kPageBytes, 7, r, p);
  }
  DevicePool pool;
  AllocatePool(&pool, Share::kVmm, decode.get());
  REQUIRE(decode->Register(VramRegions("d", pool, "kvd")).ok());
  auto peer = prefill.Connect(agents.decode.address());
  REQUIRE(peer.ok());
  REQUIRE(peer->data_path() == "shm-direct");
  if (StandinDriver()) CHECK(StandinVmmImports(agents.prefill.pid()) == 1);
  // One page of each region per transfer (transfers may not write the same pages).
  constexpr int kTransfers = kPages;
  for (int i = 0; i < kTransfers; ++i) {
    const uint64_t p = static_cast<uint64_t>(i);
    auto submitted = prefill.Submit(Write("gone-" + std::to_string(i), "kvh", "kvd", {p}, {p}));
    INFO(submitted.status().ToString());
    REQUIRE(submitted.ok());
  }
  decode.reset();  // the session's end deregisters its regions
  int completed = 0, failed = 0;
  for (int i = 0; i < kTransfers; ++i) {
    auto done = prefill.WaitTransfer("gone-" + std::to_string(i), 30000);
    REQUIRE(done.ok());
    INFO(done->error_message());
    REQUIRE((done->phase() == v1::COMPLETED || done->phase() == v1::FAILED));
    if (done->phase() == v1::FAILED) CHECK_FALSE(done->error_message().empty());
    ++(done->phase() == v1::COMPLETED ? completed : failed);
  }
  std::printf("%d transfers completed, %d failed\n", completed, failed);
  CHECK(WaitFor([&] {
    auto peers = prefill.Peers();
    return peers.ok() && peers->peers_size() == 1 && peers->peers(0).regions() == 0;
  }));
  if (StandinDriver()) {
    CHECK(WaitFor([&] { return StandinVmmImports(agents.prefill.pid()) == 0; }));
  }
  // Both agents up; a new session's pool moves bytes directly again.
  cli::AgentClient again(agents.decode.address());
  DevicePool fresh;
  AllocatePool(&fresh, Share::kVmm, &again);
  ToDevice(fresh.dptr, std::vector<uint8_t>(kPoolBytes, 0xEE));
  REQUIRE(again.Register(VramRegions("e", fresh, "kve")).ok());
  CHECK(WaitFor([&] {
    auto peers = prefill.Peers();
    return peers.ok() && peers->peers(0).regions() == 2 * kLayers + 2 &&
           peers->peers(0).data_path() == "shm-direct";
  }));
  REQUIRE(prefill.Submit(Write("fresh", "kvh", "kve", {3}, {11})).ok());
  auto fresh_done = prefill.WaitTransfer("fresh", 30000);
  REQUIRE(fresh_done.ok());
  INFO(fresh_done->error_message());
  REQUIRE(fresh_done->phase() == v1::COMPLETED);
  const auto got = FromDevice(fresh.dptr, kKvBytes);
  for (uint32_t r = 0; r < 2 * kLayers; ++r) {
    CHECK(std::memcmp(got.data() + (r * kPages + 11) * kPageBytes, host->Page(r, 3),
                      kPageBytes) == 0);
  }
}

}  // namespace
}  // namespace kvagent::testing
