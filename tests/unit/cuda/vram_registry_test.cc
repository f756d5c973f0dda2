// The registry's VRAM flow on a machine without a CUDA driver, and its pure
// decisions (memory path, locked-memory limit). Real UCX, real shm.
#include <dlfcn.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "registry/cuda_ipc_mapping.h"
#include "registry/region_registry.h"
#include "registry/shm_mapping.h"
#include "tests/unit/registry/test_util.h"
#include "transport/ucx_context.h"

namespace kvagent::registry {
namespace {

using absl::StatusCode;

std::string Message(const absl::Status& status) { return std::string(status.message()); }

bool DriverInstalled() {
  void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return false;
  dlclose(handle);
  return true;
}

using testing::Context;

ShmMapping MakeShm(uint64_t bytes) {
  static std::atomic<int> counter{0};
  auto shm = ShmMapping::Create(fmt::format("/kvagent-cuda-test-{}-{}", getpid(), counter++), bytes);
  REQUIRE(shm.ok());
  return std::move(shm).value();
}

v1::RegionSpec Dram(const std::string& name, const std::string& shm, uint64_t offset,
                    uint64_t length) {
  v1::RegionSpec spec;
  spec.set_name(name);
  spec.set_kind(v1::KV);
  spec.set_memory(v1::DRAM);
  spec.set_length(length);
  spec.mutable_layout()->set_num_items(1);
  spec.mutable_layout()->set_item_bytes(length);
  spec.mutable_shm()->set_name(shm);
  spec.mutable_shm()->set_offset(offset);
  return spec;
}

v1::RegionSpec Vram(const std::string& name, uint64_t length, size_t handle_bytes = 64,
                    int device = 0) {
  v1::RegionSpec spec;
  spec.set_name(name);
  spec.set_kind(v1::KV);
  spec.set_memory(v1::VRAM);
  spec.set_length(length);
  spec.mutable_layout()->set_num_items(4);
  spec.mutable_layout()->set_item_bytes(length / 4);
  spec.mutable_cuda_ipc()->set_ipc_handle(std::string(handle_bytes, '\x5a'));
  spec.mutable_cuda_ipc()->set_device(device);
  spec.mutable_cuda_ipc()->set_offset(0);
  return spec;
}

TEST_CASE("MemoryPathFor: host for DRAM; zero-copy, staged or refused for VRAM") {
  struct Row {
    v1::MemoryKind kind;
    bool ucx_cuda;
    bool staging;
    const char* path;  // nullptr: FAILED_PRECONDITION
  };
  const Row rows[] = {
      {v1::DRAM, false, false, "host"},      {v1::DRAM, true, true, "host"},
      {v1::MEMORY_KIND_UNSPECIFIED, false, false, "host"},
      {v1::VRAM, true, false, "zero-copy"},  {v1::VRAM, true, true, "zero-copy"},
      {v1::VRAM, false, true, "staged"},     {v1::VRAM, false, false, nullptr},
  };
  for (const Row& row : rows) {
    INFO("kind " << row.kind << " ucx_cuda " << row.ucx_cuda << " staging " << row.staging);
    auto path = MemoryPathFor(row.kind, row.ucx_cuda, row.staging);
    if (row.path != nullptr) {
      REQUIRE(path.ok());
      CHECK(*path == row.path);
    } else {
      REQUIRE_FALSE(path.ok());
      CHECK(path.status().code() == StatusCode::kFailedPrecondition);
    }
  }
  auto refused = MemoryPathFor(v1::VRAM, false, false,
                               "1.13.1 (transports self,tcp,posix; memory types host)");
  const std::string message = Message(refused.status());
  CHECK_THAT(message, Catch::StartsWith("UCX 1.13.1 (transports self,tcp,posix; memory types "
                                        "host) cannot register CUDA memory and VRAM staging is "
                                        "off (--vram-staging=off)"));
  CHECK_THAT(message, Catch::Contains("UCX_MODULE_DIR"));
  CHECK_THAT(message, Catch::Contains("libuct_cuda.so"));
  CHECK_THAT(message, Catch::Contains("UCX_TLS including cuda_copy,cuda_ipc"));
  CHECK_THAT(message, Catch::Contains("--vram-staging=auto"));
  CHECK(MemoryPathFor(static_cast<v1::MemoryKind>(9), false, true).status().code() ==
        StatusCode::kInvalidArgument);
}

TEST_CASE("CheckMemlock refuses to pin more than RLIMIT_MEMLOCK allows") {
  CHECK(CheckMemlock(1 << 20, RLIM_INFINITY, "k.L0").ok());
  CHECK(CheckMemlock(65536, 65536, "k.L0").ok());
  CHECK(CheckMemlock(0, 0, "k.L0").ok());
  absl::Status s = CheckMemlock(65537, 65536, "k.L0");
  CHECK(s.code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(Message(s), Catch::StartsWith("region 'k.L0': needs 65537 bytes of locked memory"));
  CHECK_THAT(Message(s), Catch::Contains("RLIMIT_MEMLOCK is 65536 bytes"));
  CHECK_THAT(Message(s), Catch::Contains("`ulimit -l unlimited`, systemd LimitMEMLOCK=infinity, "
                                         "Kubernetes: the IPC_LOCK "
                                         "capability"));
}

TEST_CASE("Only RDMA transports pin registered host memory") {
  CHECK_FALSE(PinsRegisteredMemory({"self", "tcp", "posix", "sysv", "cma"}));
  CHECK_FALSE(PinsRegisteredMemory({}));
  CHECK(PinsRegisteredMemory({"tcp", "rc_mlx5"}));
  CHECK(PinsRegisteredMemory({"ud_verbs"}));
  CHECK(PinsRegisteredMemory({"dc_mlx5"}));
  CHECK(PinsRegisteredMemory({"ib"}));
  // This machine's UCX: no RDMA, so DRAM registration never checks the limit here.
  CHECK_FALSE(PinsRegisteredMemory(Context().capabilities().transports));
}

TEST_CASE("CudaIpcMapping::Open without a driver names libcuda.so.1") {
  if (DriverInstalled()) {
    WARN("libcuda.so.1 is installed here; a bogus handle must be refused instead");
  }
  v1::CudaIpcSource source;
  source.set_ipc_handle(std::string(64, '\x01'));
  source.set_device(0);
  auto mapping = CudaIpcMapping::Open(source, 4096, "k.L0");
  REQUIRE_FALSE(mapping.ok());
  if (!DriverInstalled()) {
    CHECK(mapping.status().code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(Message(mapping.status()), Catch::Contains("dlopen(libcuda.so.1) failed"));
  } else {
    CHECK_THAT(Message(mapping.status()), Catch::Contains("region 'k.L0'"));
  }
}

TEST_CASE("VRAM registration fails whole batches and leaves registered regions alone") {
  ShmMapping shm = MakeShm(3 * 4096);
  RegionRegistry registry(&Context());
  auto before = registry.Register({Dram("pre", shm.name(), 0, 4096)}, false, testing::Registrant());
  REQUIRE(before.ok());
  const uint64_t version = registry.version();

  SECTION("one VRAM region") {
    auto result = registry.Register({Vram("gpu.k", 65536)}, false, testing::Registrant());
    REQUIRE_FALSE(result.ok());
    const std::string message = Message(result.status());
    CHECK_THAT(message, Catch::StartsWith("region 'gpu.k' (entry 0): "));
    if (!DriverInstalled()) {
      CHECK(result.status().code() == StatusCode::kFailedPrecondition);
      CHECK_THAT(message, Catch::Contains("CUDA driver not available: dlopen(libcuda.so.1) failed"));
      CHECK_THAT(message, Catch::Contains("register host memory (shm) instead"));
    }
  }
  SECTION("a good DRAM region with a VRAM region registers nothing") {
    auto result = registry.Register(
        {Dram("fine", shm.name(), 4096, 4096), Vram("gpu.v", 65536)}, false, testing::Registrant());
    REQUIRE_FALSE(result.ok());
    const std::string message = Message(result.status());
    CHECK_THAT(message, Catch::StartsWith("region 'gpu.v' (entry 1): "));
    CHECK_THAT(message, !Catch::Contains("'fine'"));
    if (!DriverInstalled()) CHECK_THAT(message, Catch::Contains("libcuda.so.1"));
    CHECK(registry.Find("fine") == nullptr);
    CHECK(registry.Find("gpu.v") == nullptr);
  }
  SECTION("staging off changes nothing before the driver is there") {
    RegionRegistry strict(&Context(), RegistryOptions{false});
    auto result = strict.Register({Vram("gpu.s", 65536)}, false, testing::Registrant());
    REQUIRE_FALSE(result.ok());
    CHECK(result.status().code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(Message(result.status()), Catch::StartsWith("region 'gpu.s' (entry 0): "));
  }

  // Whatever failed, the registry is as it was, and "pre" still works.
  CHECK(registry.version() == version);
  REQUIRE(registry.List().size() == 1);
  RegionPtr pre = registry.Find("pre");
  REQUIRE(pre != nullptr);
  CHECK(pre->Info().memory_path() == "host");
  CHECK_FALSE(pre->cuda.has_value());
  std::memset(reinterpret_cast<void*>(pre->base_address), 0x7e, 4096);
  CHECK(static_cast<const unsigned char*>(shm.data())[4095] == 0x7e);
  v1::AgentMetadata metadata;
  registry.Export(&metadata, /*same_host=*/true);
  REQUIRE(metadata.regions_size() == 1);
  CHECK_FALSE(metadata.regions(0).rkey().empty());
  auto after = registry.Register({Dram("fine", shm.name(), 4096, 4096)}, false, testing::Registrant());
  REQUIRE(after.ok());
  CHECK(registry.version() == version + 1);
}

TEST_CASE("Memory kind and source must agree") {
  ShmMapping shm = MakeShm(4096);
  RegionRegistry registry(&Context());
  SECTION("VRAM with a shm source") {
    v1::RegionSpec spec = Dram("gpu", shm.name(), 0, 4096);
    spec.set_memory(v1::VRAM);
    auto result = registry.Register({spec}, false, testing::Registrant());
    REQUIRE_FALSE(result.ok());
    CHECK(result.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(result.status()),
               Catch::StartsWith("region 'gpu' (entry 0): VRAM region has a shm source"));
    CHECK_THAT(Message(result.status()), Catch::Contains("set cuda_ipc"));
  }
  SECTION("VRAM with no source") {
    v1::RegionSpec spec = Vram("gpu", 4096);
    spec.clear_cuda_ipc();
    auto result = registry.Register({spec}, false, testing::Registrant());
    REQUIRE_FALSE(result.ok());
    CHECK(result.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(result.status()),
               Catch::StartsWith("region 'gpu' (entry 0): VRAM region has no cuda_ipc source"));
  }
  SECTION("DRAM with a cuda_ipc source") {
    v1::RegionSpec spec = Vram("host", 4096);
    spec.set_memory(v1::DRAM);
    auto result = registry.Register({spec}, false, testing::Registrant());
    REQUIRE_FALSE(result.ok());
    CHECK(result.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(result.status()),
               Catch::StartsWith("region 'host' (entry 0): DRAM region has a cuda_ipc source"));
  }
  SECTION("a handle of the wrong size, a negative device") {
    auto result = registry.Register({Vram("short", 4096, 16), Vram("neg", 4096, 64, -2)}, false, testing::Registrant());
    REQUIRE_FALSE(result.ok());
    CHECK(result.status().code() == StatusCode::kInvalidArgument);
    const std::string message = Message(result.status());
    CHECK_THAT(message, Catch::Contains("2 of 2 regions rejected; nothing was registered"));
    CHECK_THAT(message, Catch::Contains("region 'short' (entry 0): cuda_ipc.ipc_handle is 16 "
                                        "bytes; a CUDA IPC memory handle is 64 bytes"));
    CHECK_THAT(message, Catch::Contains("region 'neg' (entry 1): device ordinal -2 is negative"));
  }
  CHECK(registry.List().empty());
  CHECK(registry.version() == 0);
}

}  // namespace
}  // namespace kvagent::registry
