// The deregistration race of tests/fault/contract_test (A) on the device copy path:
// VRAM pools shared by CUDA IPC handle on both sides, two real kvagentd on one host
// (shm-direct: the prefill agent opens decode's handles and copies device to device).
// Each round registers a fresh VRAM pool on prefill, submits a WRITE from it (or a
// READ into it) and deregisters it at once or up to 2 ms later. Every round must end
// COMPLETED with the bytes in place, or FAILED with ABORTED naming the region and
// "deregistered"; DeregisterRegions answers only once the transfer drained; a READ's
// pages do not change after that; both agents stay up and move data afterwards.
// Runs on a GPU, and everywhere as vram_fault_standin_test (the stand-in driver).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "cli/agent_client.h"
#include "cli/daemon_process.h"
#include "cli/kv_pool.h"
#include "cuda/driver.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/unit/catch_main.h"

namespace kvagent::testing {
namespace {

using cuda::CudaDriver;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kRegions = 4;  // 2 layers x K,V
constexpr uint64_t kPages = 32;
constexpr uint64_t kPageBytes = 32 << 10;
constexpr uint64_t kPoolBytes = kRegions * kPages * kPageBytes;

// One cuMemAlloc shared by its IPC handle; freed when it goes.
struct VramPool {
  uint64_t dptr = 0;
  std::string handle;
  VramPool() {
    CudaDriver* driver = *CudaDriver::Load();
    REQUIRE(driver->MakeCurrent(0).ok());
    auto allocated = driver->MemAlloc(kPoolBytes);
    REQUIRE(allocated.ok());
    dptr = *allocated;
    auto h = driver->IpcGetHandle(dptr);
    REQUIRE(h.ok());
    handle = *h;
  }
  ~VramPool() { (void)(*CudaDriver::Load())->MemFree(dptr); }
  VramPool(const VramPool&) = delete;
  VramPool& operator=(const VramPool&) = delete;
  uint64_t Page(uint32_t region, uint64_t page) const {
    return (region * kPages + page) * kPageBytes;
  }
};

v1::RegisterRegionsRequest Regions(const std::string& prefix, const std::string& group,
                                   const VramPool& pool, std::vector<std::string>* names) {
  v1::RegisterRegionsRequest request;
  for (uint32_t r = 0; r < kRegions; ++r) {
    auto* spec = request.add_regions();
    spec->set_name(prefix + ".kv" + std::to_string(r));
    spec->set_kind(v1::KV);
    spec->set_group(group);
    spec->set_memory(v1::VRAM);
    spec->set_length(kPages * kPageBytes);
    spec->mutable_layout()->set_num_items(kPages);
    spec->mutable_layout()->set_item_bytes(kPageBytes);
    spec->mutable_cuda_ipc()->set_ipc_handle(pool.handle);
    spec->mutable_cuda_ipc()->set_device(0);
    spec->mutable_cuda_ipc()->set_offset(r * kPages * kPageBytes);
    if (names != nullptr) names->push_back(spec->name());
  }
  return request;
}

std::vector<uint8_t> Pattern(uint64_t seed) {
  std::vector<uint8_t> host(kPoolBytes);
  for (uint64_t off = 0; off < kPoolBytes; off += kPageBytes) {
    cli::FillPage(host.data() + off, kPageBytes, seed, 0, off / kPageBytes);
  }
  return host;
}

bool Terminal(v1::TransferPhase phase) {
  return phase == v1::COMPLETED || phase == v1::FAILED || phase == v1::CANCELLED ||
         phase == v1::TIMED_OUT;
}

std::string Describe(const v1::TransferState& s) {
  return std::string(v1::TransferPhase_Name(s.phase())) + " code " +
         std::to_string(s.error_code()) + " drained " + std::to_string(s.drained()) + ": " +
         s.error_message();
}

v1::TransferState WaitDrained(cli::AgentClient& client, const std::string& id) {
  const auto until = Clock::now() + std::chrono::seconds(10);
  v1::TransferState state;
  while (Clock::now() < until) {
    auto got = client.Get(id);
    REQUIRE(got.ok());
    state = *got;
    if (Terminal(state.phase()) && state.drained()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return state;
}

v1::SubmitTransferRequest Move(const std::string& id, v1::TransferOp op,
                               const std::string& local_group, uint64_t local_first,
                               uint64_t remote_first, uint64_t n) {
  v1::SubmitTransferRequest request;
  request.set_transfer_id(id);
  request.set_peer("vf-decode");
  request.set_op(op);
  request.set_notification(id);
  auto* items = request.add_segments()->mutable_items();
  items->set_local_group(local_group);
  items->set_remote_group("kv");
  for (uint64_t k = 0; k < n; ++k) {
    items->add_local_indices(local_first + k);
    items->add_remote_indices(remote_first + k);
  }
  return request;
}

TEST_CASE("VRAM regions deregistered while transfers use them (device copy path)") {
  if (auto why = GpuMissing(); !why.empty()) KVAGENT_SKIP("needs an NVIDIA GPU and driver: " + why);
  const char* tmp = std::getenv("TEST_TMPDIR");
  auto binary = cli::FindKvagentd("");
  REQUIRE(binary.ok());
  cli::DaemonProcess prefill_process, decode_process;
  for (auto [name, process] : {std::pair{"vf-prefill", &prefill_process}, {"vf-decode", &decode_process}}) {
    cli::DaemonOptions d;
    d.binary = *binary;
    d.name = name;
    d.work_dir = tmp != nullptr ? tmp : "/tmp";
    auto started = cli::DaemonProcess::Start(d);
    INFO(started.status().ToString());
    REQUIRE(started.ok());
    *process = *std::move(started);
  }
  cli::AgentClient prefill(prefill_process.address()), decode(decode_process.address());
  // Decode's pool: pages 0-15 are written by the WRITE rounds, 16-31 read by the READs.
  VramPool decode_pool;
  const std::vector<uint8_t> decode_pattern = Pattern(21);
  ToDevice(decode_pool.dptr, decode_pattern);
  REQUIRE(decode.Register(Regions("d", "kv", decode_pool, nullptr)).ok());
  auto peer = prefill.Connect(decode_process.address());
  INFO(peer.status().ToString());
  REQUIRE(peer.ok());
  REQUIRE(peer->data_path() == "shm-direct");

  int completed = 0, aborted = 0, rounds = 0;
  std::map<std::string, int> other;
  for (int round = 0; round < 24; ++round) {
    const bool write = round % 2 == 0;
    const uint64_t n = 1 + (uint64_t(round) * 7) % 16;
    const std::string label = "fresh" + std::to_string(round);
    VramPool fresh;
    const std::vector<uint8_t> fresh_pattern = Pattern(100 + round);
    ToDevice(fresh.dptr, write ? fresh_pattern : std::vector<uint8_t>(kPoolBytes, 0xAA));
    std::vector<std::string> names;
    auto registered = prefill.Register(Regions(label, label, fresh, &names));
    INFO(registered.status().ToString());
    REQUIRE(registered.ok());
    const std::string id = "vf-" + std::to_string(round);
    auto submitted = prefill.Submit(Move(id, write ? v1::WRITE : v1::READ, label, 0,
                                         write ? 0 : 16, n));
    INFO("round " << round << ": " << submitted.status().ToString());
    REQUIRE(submitted.ok());
    if (round % 3 == 2) std::this_thread::sleep_for(std::chrono::microseconds(200 * (round % 11)));
    auto dereg = prefill.Deregister(names);
    INFO(dereg.status().ToString());
    REQUIRE(dereg.ok());
    auto at_reply = prefill.Get(id);
    REQUIRE(at_reply.ok());
    CHECK(at_reply->drained());  // the reply waits for the drain
    const v1::TransferState state = WaitDrained(prefill, id);
    INFO(Describe(state));
    REQUIRE(Terminal(state.phase()));
    ++rounds;
    if (state.phase() == v1::COMPLETED) {
      ++completed;
      const auto got = FromDevice(write ? decode_pool.dptr : fresh.dptr, kPoolBytes);
      for (uint32_t r = 0; r < kRegions; ++r) {
        for (uint64_t k = 0; k < n; ++k) {
          INFO("region " << r << " page " << k);
          const uint64_t at = write ? decode_pool.Page(r, k) : fresh.Page(r, k);
          const uint64_t from = write ? fresh.Page(r, k) : decode_pool.Page(r, 16 + k);
          const auto& source = write ? fresh_pattern : decode_pattern;
          CHECK(std::memcmp(got.data() + at, source.data() + from, kPageBytes) == 0);
        }
      }
    } else if (state.phase() == v1::FAILED &&
               state.error_code() == static_cast<int>(absl::StatusCode::kAborted) &&
               state.error_message().find("region '" + label + ".") != std::string::npos &&
               state.error_message().find("deregistered") != std::string::npos) {
      ++aborted;
    } else {
      ++other[Describe(state)];
    }
    if (!write) {
      // Nothing of a READ lands after drained.
      const auto before = FromDevice(fresh.dptr, kPoolBytes);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      CHECK(FromDevice(fresh.dptr, kPoolBytes) == before);
    }
    REQUIRE(prefill.Status().ok());
    REQUIRE(decode.Status().ok());
  }
  std::printf("%d rounds: %d COMPLETED, %d FAILED/ABORTED naming the region, %zu other\n", rounds,
              completed, aborted, other.size());
  for (const auto& [what, count] : other) std::printf("unexpected x%d: %s\n", count, what.c_str());
  CHECK(other.empty());
  CHECK(completed + aborted == rounds);
  // Decode's read-only half is untouched, and the agents still move VRAM.
  const auto decode_now = FromDevice(decode_pool.dptr, kPoolBytes);
  for (uint32_t r = 0; r < kRegions; ++r) {
    INFO("decode region " << r);
    CHECK(std::memcmp(decode_now.data() + decode_pool.Page(r, 16),
                      decode_pattern.data() + decode_pool.Page(r, 16), 16 * kPageBytes) == 0);
  }
  VramPool last;
  ToDevice(last.dptr, Pattern(7));
  REQUIRE(prefill.Register(Regions("last", "last", last, nullptr)).ok());
  REQUIRE(prefill.Submit(Move("vf-after", v1::WRITE, "last", 3, 3, 2)).ok());
  const v1::TransferState after = WaitDrained(prefill, "vf-after");
  INFO(Describe(after));
  CHECK(after.phase() == v1::COMPLETED);
}

}  // namespace
}  // namespace kvagent::testing
