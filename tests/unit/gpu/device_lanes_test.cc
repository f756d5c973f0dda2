// Device copy lanes without a GPU: DeviceBatchCopier's batch split across CUDA streams
// (SplitDeviceCopies), queued by each mechanism (per page, cuMemcpyBatchAsync, the
// gather kernel's descriptors) and waited for on every stream, run against the
// stand-in driver (standin_cuda.cc, loaded through KVAGENT_CUDA_DRIVER): its "device"
// memory is host memory and its streams run their work only when synchronized, so a
// copy that was not waited for, or a descriptor buffer reused too early, shows here as
// wrong bytes; and its device memory faults on host access, as a GPU's does (checked
// last). tests/gpu/device_copy_test runs the same copier on a real GPU.
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "agent/gpu/device_batch.h"
#include "agent/gpu/device_batch_copier.h"
#include "agent/gpu/gather_kernel.h"
#include "catch2/catch.hpp"
#include "cuda/driver.h"

namespace kvagent::agent {
namespace {

constexpr uint64_t kPage = 64 << 10;

// The stand-in's test hooks, from the library the copier's driver loaded.
struct Standin {
  void (*fail_sources)(uint64_t, uint64_t);
  size_t (*take_ran)(int*, uint64_t*, size_t);
  size_t (*pending)();
  size_t (*live_streams)();
};

const Standin& Hooks() {
  static const Standin hooks = [] {
    const char* srcdir = std::getenv("TEST_SRCDIR");
    const char* workspace = std::getenv("TEST_WORKSPACE");
    REQUIRE(srcdir != nullptr);
    const std::string path = std::string(srcdir) + "/" + (workspace ? workspace : "__main__") +
                             "/tests/unit/gpu/libcuda_standin.so";
    setenv(cuda::CudaDriver::kLibraryEnv, path.c_str(), 1);
    auto driver = cuda::CudaDriver::Load();
    REQUIRE(driver.ok());
    REQUIRE((*driver)->library() == path);
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    REQUIRE(handle != nullptr);
    Standin h;
    h.fail_sources = reinterpret_cast<decltype(h.fail_sources)>(
        dlsym(handle, "kvagent_standin_fail_sources"));
    h.take_ran = reinterpret_cast<decltype(h.take_ran)>(dlsym(handle, "kvagent_standin_take_ran"));
    h.pending = reinterpret_cast<decltype(h.pending)>(dlsym(handle, "kvagent_standin_pending"));
    h.live_streams =
        reinterpret_cast<decltype(h.live_streams)>(dlsym(handle, "kvagent_standin_live_streams"));
    REQUIRE(h.fail_sources != nullptr);
    REQUIRE(h.take_ran != nullptr);
    REQUIRE(h.pending != nullptr);
    REQUIRE(h.live_streams != nullptr);
    return h;
  }();
  return hooks;
}

// Bytes each stream ran since the last call, by stream id.
std::map<int, uint64_t> TakeRan() {
  std::vector<int> streams(1 << 16);
  std::vector<uint64_t> bytes(1 << 16);
  const size_t n = Hooks().take_ran(streams.data(), bytes.data(), streams.size());
  REQUIRE(n <= streams.size());
  std::map<int, uint64_t> by_stream;
  for (size_t i = 0; i < n; ++i) by_stream[streams[i]] += bytes[i];
  return by_stream;
}

// `pages` pages of a source pool, each to a shuffled page of a destination pool.
struct Pools {
  std::vector<uint8_t> src, dst;
  std::vector<DeviceCopy> copies;
  explicit Pools(size_t pages, uint32_t seed = 7) : src(pages * kPage), dst(pages * kPage, 0) {
    std::mt19937 rng(seed);
    for (auto& b : src) b = static_cast<uint8_t>(rng());
    std::vector<size_t> to(pages);
    std::iota(to.begin(), to.end(), 0);
    std::shuffle(to.begin(), to.end(), rng);
    for (size_t i = 0; i < pages; ++i) {
      copies.push_back(DeviceCopy{reinterpret_cast<uint64_t>(dst.data() + to[i] * kPage),
                                  reinterpret_cast<uint64_t>(src.data() + i * kPage), kPage,
                                  static_cast<uint32_t>(i)});
    }
  }
  // True when page i of the source is where copy i put it.
  bool Landed(size_t i) const {
    return std::memcmp(reinterpret_cast<const void*>(copies[i].dst),
                       reinterpret_cast<const void*>(copies[i].src), kPage) == 0;
  }
};

TEST_CASE("SplitDeviceCopies gives each lane one run of about equal bytes, cutting copies at the edges") {
  std::vector<DeviceCopy> copies = {{1000, 5000, 300, 0}, {2000, 6000, 0, 1}, {3000, 7000, 500, 2}};
  std::vector<std::vector<DeviceCopy>> out;
  SplitDeviceCopies(copies, 2, &out);
  REQUIRE(out.size() == 2);
  // 800 bytes, 400 each: copy 0 whole and 100 of copy 2, then copy 2's other 400.
  REQUIRE(out[0].size() == 2);
  CHECK(out[0][0].bytes == 300);
  CHECK(out[0][1].dst == 3000);
  CHECK(out[0][1].src == 7000);
  CHECK(out[0][1].bytes == 100);
  CHECK(out[0][1].op == 2);
  REQUIRE(out[1].size() == 1);
  CHECK(out[1][0].dst == 3100);
  CHECK(out[1][0].src == 7100);
  CHECK(out[1][0].bytes == 400);
  CHECK(out[1][0].op == 2);
  // More parts than bytes: the last lanes get nothing, nothing is lost.
  SplitDeviceCopies({{0, 0, 3, 0}}, 4, &out);
  REQUIRE(out.size() == 4);
  uint64_t total = 0;
  for (const auto& lane : out) {
    for (const auto& c : lane) total += c.bytes;
  }
  CHECK(total == 3);
}

TEST_CASE("DeviceLanesFor uses one lane per MiB, within the lanes there are") {
  CHECK(DeviceLanesFor(0, 4) == 1);
  CHECK(DeviceLanesFor(kMinDeviceLaneBytes - 1, 4) == 1);
  CHECK(DeviceLanesFor(2 * kMinDeviceLaneBytes, 4) == 2);
  CHECK(DeviceLanesFor(64 * kMinDeviceLaneBytes, 4) == 4);
  CHECK(DeviceLanesFor(64 * kMinDeviceLaneBytes, 0) == 1);
}

TEST_CASE("A large batch is split across every lane's stream and each mechanism waits for all") {
  const auto [mechanism, name] = GENERATE(
      std::make_pair(DeviceCopyMechanism::kPerPage, "per page"),
      std::make_pair(DeviceCopyMechanism::kBatchApi, "cuMemcpyBatchAsync"),
      std::make_pair(DeviceCopyMechanism::kKernel, "gather kernel"));
  INFO(name);
  (void)Hooks();
  const size_t streams_before = Hooks().live_streams();
  {
    DeviceBatchCopier copier(4);
    Pools pools(128);  // 8 MiB: 2 MiB per lane
    uint32_t failed_op = 99;
    absl::Status s = copier.Copy(pools.copies, mechanism, &failed_op);
    REQUIRE(s.ok());
    CHECK(Hooks().pending() == 0);  // every stream was waited for
    for (size_t i = 0; i < pools.copies.size(); ++i) {
      INFO("page " << i);
      REQUIRE(pools.Landed(i));
    }
    const std::map<int, uint64_t> ran = TakeRan();
    REQUIRE(ran.size() == 4);
    for (const auto& [stream, bytes] : ran) {
      if (mechanism != DeviceCopyMechanism::kKernel) {
        CHECK(bytes == 2 * kMinDeviceLaneBytes);
        continue;
      }
      // The kernel's stream also carried its descriptors up (24 bytes per piece, one
      // piece per page here, fewer where shuffled pages happened to stay adjacent).
      CHECK(bytes > 2 * kMinDeviceLaneBytes);
      CHECK(bytes <= 2 * kMinDeviceLaneBytes + 32 * sizeof(GatherCopy));
      CHECK((bytes - 2 * kMinDeviceLaneBytes) % sizeof(GatherCopy) == 0);
    }
    CHECK(copier.counters().batches == 1);
    CHECK(copier.counters().split_batches == 1);
    CHECK(copier.counters().bytes == 128 * kPage);
    CHECK(Hooks().live_streams() == streams_before + 4);

    // A second batch reuses the same streams (and the kernel's per-lane descriptors).
    Pools again(64, 11);
    REQUIRE(copier.Copy(again.copies, mechanism, &failed_op).ok());
    for (size_t i = 0; i < again.copies.size(); ++i) REQUIRE(again.Landed(i));
    CHECK(TakeRan().size() == 4);
    CHECK(Hooks().live_streams() == streams_before + 4);
  }
  CHECK(Hooks().live_streams() == streams_before);  // the copier destroyed its streams
}

TEST_CASE("A small batch stays on one stream") {
  (void)Hooks();
  DeviceBatchCopier copier(4);
  Pools pools(8);  // 512 KiB, under one lane's minimum
  uint32_t failed_op = 0;
  REQUIRE(copier.Copy(pools.copies, DeviceCopyMechanism::kBatchApi, &failed_op).ok());
  for (size_t i = 0; i < pools.copies.size(); ++i) REQUIRE(pools.Landed(i));
  CHECK(TakeRan().size() == 1);
  CHECK(copier.counters().split_batches == 0);
}

TEST_CASE("A copy that fails names its op, lanes before it finish, lanes after it queue nothing") {
  const auto mechanism =
      GENERATE(DeviceCopyMechanism::kPerPage, DeviceCopyMechanism::kBatchApi);
  (void)Hooks();
  DeviceBatchCopier copier(4);
  Pools pools(64);  // 4 MiB: 16 pages per lane
  // Page 40's source (lane 2's share: pages 32-47) is an illegal address.
  const uint64_t bad = pools.copies[40].src;
  Hooks().fail_sources(bad, bad + kPage);
  uint32_t failed_op = 0;
  absl::Status s = copier.Copy(pools.copies, mechanism, &failed_op);
  Hooks().fail_sources(0, 0);
  REQUIRE_FALSE(s.ok());
  CHECK_THAT(std::string(s.message()), Catch::Contains("CUDA_ERROR_ILLEGAL_ADDRESS"));
  CHECK(failed_op == 40);
  CHECK(Hooks().pending() == 0);  // what was queued ran before Copy returned
  for (size_t i = 0; i < 32; ++i) {
    INFO("page " << i);
    CHECK(pools.Landed(i));  // lanes 0 and 1
  }
  for (size_t i = 48; i < 64; ++i) {
    INFO("page " << i);
    CHECK_FALSE(pools.Landed(i));  // lane 3 never queued
  }
  (void)TakeRan();
  // The copier still works after the failure.
  Pools again(64, 3);
  REQUIRE(copier.Copy(again.copies, mechanism, &failed_op).ok());
  for (size_t i = 0; i < again.copies.size(); ++i) REQUIRE(again.Landed(i));
  (void)TakeRan();
}

// The stand-in's own promise, on which the tests above and the *_standin tests rest:
// its device memory is not host-accessible where the process sees it (a host access
// faults, as on a GPU), yet the driver's copies reach it.
TEST_CASE("The stand-in's device memory faults on host access; driver copies reach it") {
  (void)Hooks();
  cuda::CudaDriver* driver = *cuda::CudaDriver::Load();
  auto dptr = driver->MemAlloc(3 * kPage);
  REQUIRE(dptr.ok());
  std::ifstream maps("/proc/self/maps");
  std::string line, perms;
  while (std::getline(maps, line)) {
    const uint64_t begin = std::stoull(line.substr(0, line.find('-')), nullptr, 16);
    if (begin == *dptr) perms = line.substr(line.find(' ') + 1, 4);
  }
  CHECK(perms == "---s");
  std::vector<uint8_t> in(3 * kPage), out(3 * kPage, 0);
  std::iota(in.begin(), in.end(), 0);
  REQUIRE(driver->Copy(*dptr, reinterpret_cast<uint64_t>(in.data()), in.size()).ok());
  REQUIRE(driver->Copy(reinterpret_cast<uint64_t>(out.data()), *dptr, out.size()).ok());
  CHECK(in == out);
  // A copy running past the allocation is an illegal address, not a host overrun.
  CHECK_FALSE(driver->Copy(*dptr + 2 * kPage, reinterpret_cast<uint64_t>(in.data()), 2 * kPage).ok());
  CHECK(driver->MemFree(*dptr).ok());
}

}  // namespace
}  // namespace kvagent::agent
