// The device copy path's logic that needs no GPU: the batching of a batch's copies
// (merge, split, calls), the mechanism chosen from what the driver resolved (a table of
// symbols stands in for dlsym at CudaDriver::FindCopyEntryPoints, the one seam), the
// KVAGENT_DEVICE_COPY values, and the gather kernel image nvcc built into the binary.
// tests/gpu/device_copy_test runs the mechanisms on a GPU.
#include "agent/gpu/device_batch.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "agent/gpu/gather_kernel.h"
#include "catch2/catch.hpp"
#include "cuda/driver.h"

namespace kvagent::agent {
namespace {

constexpr uint64_t kPage = 32 << 10;

std::vector<size_t> Ends(const DeviceCopyPlan& plan) { return plan.call_ends; }

TEST_CASE("PlanDeviceCopies merges copies that continue on both sides") {
  // Pages 2,3 -> 4,5 continue each other; 7 -> 9 after 3 -> 5 does not; 8 -> 8 follows
  // 7 on the source side only.
  const uint64_t s = 0x10000000, d = 0x20000000;
  std::vector<DeviceCopy> copies = {
      {d + 4 * kPage, s + 2 * kPage, kPage, 0}, {d + 5 * kPage, s + 3 * kPage, kPage, 1},
      {d + 9 * kPage, s + 7 * kPage, kPage, 2}, {d + 8 * kPage, s + 8 * kPage, kPage, 3},
      {d + 20 * kPage, s + 20 * kPage, 0, 4},  // empty: dropped
  };
  DeviceCopyPlan plan;
  PlanDeviceCopies(copies, kBatchApiLimits, &plan);
  REQUIRE(plan.copies.size() == 3);
  CHECK(plan.copies[0].dst == d + 4 * kPage);
  CHECK(plan.copies[0].src == s + 2 * kPage);
  CHECK(plan.copies[0].bytes == 2 * kPage);
  CHECK(plan.copies[0].op == 0);  // the first op it came from, for errors
  CHECK(plan.copies[1].op == 2);
  CHECK(plan.copies[2].op == 3);
  CHECK(plan.copies[2].bytes == kPage);
  CHECK(Ends(plan) == std::vector<size_t>{3});

  // Reused: a second plan replaces the first.
  PlanDeviceCopies({}, kBatchApiLimits, &plan);
  CHECK(plan.copies.empty());
  CHECK(plan.call_ends.empty());
}

TEST_CASE("PlanDeviceCopies splits long copies and bounds the copies per call") {
  // A 2.5 MiB Mamba SSM slot and 8 contiguous pages (merged to 256 KiB), for the
  // kernel's 128 KiB pieces: 20 + 2 pieces.
  const uint64_t ssm = 2621440;
  std::vector<DeviceCopy> copies = {{0x1000000, 0x9000000, ssm, 0}};
  for (uint32_t i = 0; i < 8; ++i) {
    copies.push_back({0x4000000 + i * kPage, 0x5000000 + i * kPage, kPage, 1 + i});
  }
  DeviceCopyPlan plan;
  PlanDeviceCopies(copies, kKernelLimits, &plan);
  REQUIRE(plan.copies.size() == 22);
  uint64_t total = 0;
  for (size_t i = 0; i < plan.copies.size(); ++i) {
    const auto& c = plan.copies[i];
    CHECK(c.bytes == kKernelLimits.max_copy_bytes);
    total += c.bytes;
    if (i < 20) {
      CHECK(c.dst == 0x1000000 + i * c.bytes);
      CHECK(c.src == 0x9000000 + i * c.bytes);
      CHECK(c.op == 0);
    } else {
      CHECK(c.dst == 0x4000000 + (i - 20) * c.bytes);
      CHECK(c.op == 1);
    }
  }
  CHECK(total == ssm + 8 * kPage);
  CHECK(Ends(plan) == std::vector<size_t>{22});

  // A remainder piece, and calls of at most 4 copies.
  PlanDeviceCopies({{0, 1 << 20, 10000, 7}}, DeviceCopyLimits{4096, 2}, &plan);
  REQUIRE(plan.copies.size() == 3);
  CHECK(plan.copies[2].bytes == 10000 - 2 * 4096);
  CHECK(plan.copies[2].dst == 2 * 4096);
  CHECK(plan.copies[2].src == (1 << 20) + 2 * 4096);
  CHECK(Ends(plan) == std::vector<size_t>{2, 3});

  std::vector<DeviceCopy> scattered;
  for (uint32_t i = 0; i < 9000; ++i) {
    scattered.push_back({0x100000000 + 2 * i * kPage, 0x900000000 + 3 * i * kPage, kPage, i});
  }
  PlanDeviceCopies(scattered, kBatchApiLimits, &plan);
  CHECK(plan.copies.size() == 9000);
  CHECK(Ends(plan) == std::vector<size_t>{4096, 8192, 9000});
}

TEST_CASE("KVAGENT_DEVICE_COPY values; a bad one names the variable and the choices") {
  CHECK(*ParseDeviceCopyChoice("auto", kDeviceCopyEnv) == DeviceCopyChoice::kAuto);
  CHECK(*ParseDeviceCopyChoice("batch", kDeviceCopyEnv) == DeviceCopyChoice::kBatchApi);
  CHECK(*ParseDeviceCopyChoice("kernel", kDeviceCopyEnv) == DeviceCopyChoice::kKernel);
  CHECK(*ParseDeviceCopyChoice("per-page", kDeviceCopyEnv) == DeviceCopyChoice::kPerPage);
  auto bad = ParseDeviceCopyChoice("cuMemcpyBatchAsync", kDeviceCopyEnv);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(bad.status().message()) ==
        "KVAGENT_DEVICE_COPY='cuMemcpyBatchAsync' is not a device copy mechanism; use auto (the "
        "best this host has), batch (cuMemcpyBatchAsync), kernel (the gather kernel) or "
        "per-page (cuMemcpyAsync per page)");
}

// What FindCopyEntryPoints finds in a driver where the symbols in `table` resolve.
cuda::CudaCopyEntryPoints Find(const std::vector<std::string>& table) {
  return cuda::CudaDriver::FindCopyEntryPoints([&](const char* symbol) -> void* {
    for (const auto& t : table) {
      if (t == symbol) return reinterpret_cast<void*>(0x1);
    }
    return nullptr;
  });
}

DeviceCopyAbilities Host(const std::vector<std::string>& table, int capability,
                         int version = 12080) {
  const auto found = Find(table);
  DeviceCopyAbilities host;
  host.driver = true;
  host.driver_version = version;
  host.batch_copy = found.batch_copy;
  host.kernel_launch = found.kernel_launch;
  host.compute_capability = capability;
  host.kernel_images = *ParseFatbin(GatherKernelImage(), GatherKernelImageBytes());
  return host;
}

const std::vector<std::string> kKernelSymbols = {"cuModuleLoadData", "cuModuleGetFunction",
                                                 "cuModuleUnload", "cuLaunchKernel",
                                                 "cuDeviceGetAttribute"};
std::vector<std::string> With(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST_CASE("FindCopyEntryPoints: CUDA 13's cuMemcpyBatchAsync_v2 first, then 12.8's form") {
  CHECK(Find({"cuMemcpyBatchAsync", "cuMemcpyBatchAsync_v2"}).batch_copy ==
        "cuMemcpyBatchAsync_v2");
  CHECK(Find({"cuMemcpyBatchAsync"}).batch_copy == "cuMemcpyBatchAsync");
  CHECK(Find({"cuMemcpyBatchAsync_ptsz"}).batch_copy.empty());  // per-thread stream: not used
  CHECK(Find({}).batch_copy.empty());
  CHECK(Find(kKernelSymbols).kernel_launch);
  for (size_t missing = 0; missing < kKernelSymbols.size(); ++missing) {
    auto table = kKernelSymbols;
    table.erase(table.begin() + static_cast<long>(missing));
    INFO(kKernelSymbols[missing] << " missing");
    CHECK_FALSE(Find(table).kernel_launch);
  }
}

TEST_CASE("SelectDeviceCopy: cuMemcpyBatchAsync, else the gather kernel, else per page") {
  const auto a = DeviceCopyChoice::kAuto;
  CHECK(SelectDeviceCopy(a, DeviceCopyAbilities{}).mode == "none (no CUDA driver)");
  CHECK(SelectDeviceCopy(a, DeviceCopyAbilities{}).mechanism == DeviceCopyMechanism::kNone);

  auto batch = SelectDeviceCopy(a, Host(With({"cuMemcpyBatchAsync_v2"}, kKernelSymbols), 90));
  CHECK(batch.mechanism == DeviceCopyMechanism::kBatchApi);
  CHECK(batch.mode == "cuMemcpyBatchAsync per batch");

  // A 12.4 driver: no batch call; the kernel image chosen as the driver would.
  const std::vector<std::pair<int, std::string>> images = {
      {80, "sm_80 cubin"}, {86, "sm_86 cubin"},   {87, "sm_86 cubin"}, {89, "sm_89 cubin"},
      {90, "sm_90 cubin"}, {100, "sm_100 cubin"}, {103, "sm_100 cubin"},
      {110, "compute_80 PTX"},  // no Thor cubin: the PTX, compiled by the driver
      {120, "sm_120 cubin"},    {121, "sm_120 cubin"}};
  for (const auto& [capability, image] : images) {
    auto kernel = SelectDeviceCopy(a, Host(kKernelSymbols, capability, 12040));
    INFO("compute capability " << capability);
    CHECK(kernel.mechanism == DeviceCopyMechanism::kKernel);
    CHECK(kernel.mode == "gather kernel per batch (" + image + ")");
  }

  auto turing = SelectDeviceCopy(a, Host(kKernelSymbols, 75, 12040));
  CHECK(turing.mechanism == DeviceCopyMechanism::kPerPage);
  CHECK(turing.mode ==
        "cuMemcpyAsync per page (driver 12.4 has no cuMemcpyBatchAsync (CUDA 12.8+); the "
        "gather kernel has no image for sm_75 (built for compute_80 PTX, sm_80 cubin, sm_86 "
        "cubin, sm_89 cubin, sm_90 cubin, sm_100 cubin, sm_120 cubin))");
  auto no_device = SelectDeviceCopy(a, Host(kKernelSymbols, 0, 12040));
  CHECK(no_device.mode == "cuMemcpyAsync per page (driver 12.4 has no cuMemcpyBatchAsync "
                          "(CUDA 12.8+); no CUDA device to run the gather kernel on)");
  auto no_modules = SelectDeviceCopy(a, Host({"cuModuleLoadData"}, 90, 11080));
  CHECK(no_modules.mode == "cuMemcpyAsync per page (driver 11.8 has no cuMemcpyBatchAsync "
                           "(CUDA 12.8+); the driver cannot load kernels (cuModuleLoadData))");
}

TEST_CASE("SelectDeviceCopy honours a forced mechanism, or says why it cannot") {
  const auto full = Host(With({"cuMemcpyBatchAsync"}, kKernelSymbols), 90);
  auto kernel = SelectDeviceCopy(DeviceCopyChoice::kKernel, full);
  CHECK(kernel.mechanism == DeviceCopyMechanism::kKernel);
  CHECK(kernel.mode == "gather kernel per batch (sm_90 cubin) (KVAGENT_DEVICE_COPY=kernel)");
  auto per_page = SelectDeviceCopy(DeviceCopyChoice::kPerPage, full);
  CHECK(per_page.mechanism == DeviceCopyMechanism::kPerPage);
  CHECK(per_page.mode == "cuMemcpyAsync per page (KVAGENT_DEVICE_COPY=per-page)");
  auto batch = SelectDeviceCopy(DeviceCopyChoice::kBatchApi, full);
  CHECK(batch.mode == "cuMemcpyBatchAsync per batch (KVAGENT_DEVICE_COPY=batch)");

  auto old = SelectDeviceCopy(DeviceCopyChoice::kBatchApi, Host(kKernelSymbols, 90, 12060));
  CHECK(old.mechanism == DeviceCopyMechanism::kPerPage);
  CHECK(old.mode == "cuMemcpyAsync per page (KVAGENT_DEVICE_COPY=batch, but the driver 12.6 "
                    "has no cuMemcpyBatchAsync (CUDA 12.8+))");
  auto no_kernel = SelectDeviceCopy(DeviceCopyChoice::kKernel, Host({"cuMemcpyBatchAsync_v2"}, 90));
  CHECK(no_kernel.mechanism == DeviceCopyMechanism::kPerPage);
  CHECK(no_kernel.mode == "cuMemcpyAsync per page (KVAGENT_DEVICE_COPY=kernel, but the driver "
                          "cannot load kernels (cuModuleLoadData))");
  // Forced by kvagentd's flag instead of the variable: the mode names the flag.
  CHECK(SelectDeviceCopy(DeviceCopyChoice::kBatchApi, full, kDeviceCopyFlag).mode ==
        "cuMemcpyBatchAsync per batch (--device-copy=batch)");
  CHECK(SelectDeviceCopy(DeviceCopyChoice::kKernel, Host({}, 90, 12060), kDeviceCopyFlag).mode ==
        "cuMemcpyAsync per page (--device-copy=kernel, but the driver cannot load kernels "
        "(cuModuleLoadData))");
  // Forcing never makes a driver appear; the mode still names what was forced.
  auto no_driver = SelectDeviceCopy(DeviceCopyChoice::kKernel, DeviceCopyAbilities{});
  CHECK(no_driver.mechanism == DeviceCopyMechanism::kNone);
  CHECK(no_driver.mode ==
        "none (no CUDA driver; KVAGENT_DEVICE_COPY=kernel applies on a host with a GPU)");
  CHECK(SelectDeviceCopy(DeviceCopyChoice::kPerPage, DeviceCopyAbilities{}, kDeviceCopyFlag)
            .mode == "none (no CUDA driver; --device-copy=per-page applies on a host with a GPU)");
}

TEST_CASE("The gather kernel image: a fatbin nvcc built, with the kernel for every target") {
  // The build ran nvcc (the genrule wrote its release line beside the bytes).
  const std::string compiler = GatherKernelCompiler();
  CHECK_THAT(compiler, Catch::Matches("nvcc release [0-9]+\\.[0-9]+, V[0-9.]+"));
  const unsigned char* image = GatherKernelImage();
  const size_t bytes = GatherKernelImageBytes();
  REQUIRE(bytes > 1024);
  CHECK(reinterpret_cast<uintptr_t>(image) % 8 == 0);  // cuModuleLoadData reads it in place
  uint32_t magic = 0;
  std::memcpy(&magic, image, sizeof(magic));
  CHECK(magic == 0xBA55ED50);

  auto entries = ParseFatbin(image, bytes);
  INFO(entries.status().ToString());
  REQUIRE(entries.ok());
  std::vector<std::string> names;
  for (const auto& e : *entries) names.push_back(FatbinEntryName(e));
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"compute_80 PTX", "sm_100 cubin", "sm_120 cubin",
                                          "sm_80 cubin", "sm_86 cubin", "sm_89 cubin",
                                          "sm_90 cubin"});
  // Each cubin's symbol table names the kernel the device copy path looks up.
  const std::string text(reinterpret_cast<const char*>(image), bytes);
  size_t found = 0;
  for (size_t at = text.find(kGatherKernelName); at != std::string::npos;
       at = text.find(kGatherKernelName, at + 1)) {
    ++found;
  }
  CHECK(found >= 6);
}

TEST_CASE("ParseFatbin refuses what is not a whole fatbin") {
  const unsigned char* image = GatherKernelImage();
  std::vector<unsigned char> copy(image, image + GatherKernelImageBytes());
  auto short_one = ParseFatbin(copy.data(), 8);
  REQUIRE_FALSE(short_one.ok());
  CHECK_THAT(std::string(short_one.status().message()), Catch::StartsWith("not a fatbin: 8 bytes"));
  auto cut = ParseFatbin(copy.data(), copy.size() / 2);
  REQUIRE_FALSE(cut.ok());
  CHECK_THAT(std::string(cut.status().message()), Catch::StartsWith("truncated fatbin"));
  copy[0] ^= 0xFF;
  auto magic = ParseFatbin(copy.data(), copy.size());
  REQUIRE_FALSE(magic.ok());
  CHECK_THAT(std::string(magic.status().message()), Catch::Contains("magic 0xBA55ED50"));
  copy[0] ^= 0xFF;
  // The first image's payload size made larger than what follows it.
  const uint64_t huge = uint64_t{1} << 40;
  std::memcpy(copy.data() + 16 + 8, &huge, sizeof(huge));
  auto overrun = ParseFatbin(copy.data(), copy.size());
  REQUIRE_FALSE(overrun.ok());
  CHECK_THAT(std::string(overrun.status().message()),
             Catch::StartsWith("fatbin image 0 at byte 16 overruns the fatbin"));
}

TEST_CASE("This process: without a CUDA driver, nothing is selected and status says so") {
  if (cuda::CudaDriver::Load().ok()) {
    // On a GPU host the selection is whatever the driver offers: one of the three.
    const auto selection = CurrentDeviceCopy();
    CHECK(selection.mechanism != DeviceCopyMechanism::kNone);
    return;
  }
  CHECK_FALSE(ProbeDeviceCopyAbilities().driver);
  CHECK(CurrentDeviceCopy().mechanism == DeviceCopyMechanism::kNone);
  CHECK(CurrentDeviceCopy().mode == "none (no CUDA driver)");
  SetDeviceCopyChoice(DeviceCopyChoice::kKernel);  // re-selects: still nothing to copy with
  CHECK(CurrentDeviceCopy().mechanism == DeviceCopyMechanism::kNone);
  CHECK(CurrentDeviceCopy().mode ==
        "none (no CUDA driver; --device-copy=kernel applies on a host with a GPU)");
}

}  // namespace
}  // namespace kvagent::agent
