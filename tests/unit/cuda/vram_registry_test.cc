// The registry's VRAM flow on a machine without a CUDA driver, and its pure
// decisions (memory path, locked-memory limit). Real UCX, real shm.
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <random>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "registry/cuda_ipc_mapping.h"
#include "registry/cuda_vmm_mapping.h"
#include "registry/device_memory_object.h"
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
using testing::VmmSpec;

ShmMapping MakeShm(uint64_t bytes) {
  static std::atomic<int> counter{0};
  // Random per run: tests run in PID namespaces (the same pid every run), and a run
  // that was killed leaves its objects behind, which O_EXCL would refuse.
  static const uint64_t run = (uint64_t{std::random_device{}()} << 32) | std::random_device{}();
  auto shm = ShmMapping::Create(
      fmt::format("/kvagent-cuda-test-{}-{:x}-{}", getpid(), run, counter++), bytes);
  INFO(shm.status().ToString());
  REQUIRE(shm.ok());
  return std::move(shm).value();
}

// A one-item DRAM region by shm name.
v1::RegionSpec Dram(const std::string& name, const std::string& shm, uint64_t offset,
                    uint64_t length) {
  return testing::Spec(name, shm, offset, length, /*num_items=*/1, /*item_bytes=*/length);
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
    CHECK_THAT(Message(result.status()), Catch::Contains("set cuda_vmm"));
    CHECK_THAT(Message(result.status()), Catch::Contains("or cuda_ipc"));
  }
  SECTION("VRAM with no source") {
    v1::RegionSpec spec = Vram("gpu", 4096);
    spec.clear_cuda_ipc();
    auto result = registry.Register({spec}, false, testing::Registrant());
    REQUIRE_FALSE(result.ok());
    CHECK(result.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(result.status()),
               Catch::StartsWith("region 'gpu' (entry 0): VRAM region has no cuda_vmm or "
                                 "cuda_ipc source"));
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

// ---- CUDA VMM sources (cuda_vmm): every check that needs no driver, then the driver.

// Shared device memory for the registry: a pipe stands in for the VMM descriptor
// (only the driver could tell it is not one).
std::shared_ptr<const DeviceMemoryObject> DeviceMemory(uint64_t bytes, int device = 0) {
  int ends[2];
  REQUIRE(pipe2(ends, O_CLOEXEC) == 0);
  close(ends[0]);
  auto object = DeviceMemoryObject::FromDescriptor(UniqueFd(ends[1]), device, bytes, "kv-vram");
  REQUIRE(object.ok());
  return *std::move(object);
}

// A registrant whose device memory handles are the ids of `objects`, as a session's are.
RegisterContext VmmRegistrant(std::vector<std::shared_ptr<const DeviceMemoryObject>> objects) {
  RegisterContext context = testing::Registrant();
  context.resolve_device_handle =
      [objects = std::move(objects)](
          uint64_t handle) -> absl::StatusOr<std::shared_ptr<const DeviceMemoryObject>> {
    for (const auto& object : objects) {
      if (object->id() == handle) return object;
    }
    if (handle == 404) {
      return std::shared_ptr<const DeviceMemoryObject>();  // nothing found, no error
    }
    return absl::NotFoundError(fmt::format(
        "device memory handle {} is not one of this session's; share it first", handle));
  };
  return context;
}


TEST_CASE("CudaVmmMapping::Import without a driver names libcuda.so.1 and keeps nothing") {
  auto memory = DeviceMemory(1 << 20);
  auto mapping = CudaVmmMapping::Import(memory, "k.L0");
  REQUIRE_FALSE(mapping.ok());
  if (!DriverInstalled()) {
    CHECK(mapping.status().code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(Message(mapping.status()), Catch::Contains("dlopen(libcuda.so.1) failed"));
  } else {
    WARN("libcuda.so.1 is installed here; a pipe must be refused by the driver instead");
    CHECK_THAT(Message(mapping.status()), Catch::StartsWith("region 'k.L0': "));
  }
  CHECK(memory.use_count() == 1);
}

TEST_CASE("VRAM by cuda_vmm: registration without a driver fails and keeps nothing") {
  ShmMapping shm = MakeShm(4096);
  RegionRegistry registry(&Context());
  REQUIRE(registry.Register({Dram("pre", shm.name(), 0, 4096)}, false, testing::Registrant()).ok());
  const uint64_t version = registry.version();
  auto memory = DeviceMemory(1 << 20);
  RegisterContext context = VmmRegistrant({memory});

  auto result = registry.Register({VmmSpec("vmm.k", memory->id(), 0, 65536),
                                   VmmSpec("vmm.v", memory->id(), 65536, 65536)},
                                  false, context);
  REQUIRE_FALSE(result.ok());
  const std::string message = Message(result.status());
  CHECK_THAT(message, Catch::Contains("region 'vmm.k' (entry 0): "));
  CHECK_THAT(message, Catch::Contains("region 'vmm.v' (entry 1): "));
  if (!DriverInstalled()) {
    CHECK(result.status().code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(message, Catch::Contains("CUDA driver not available: dlopen(libcuda.so.1) failed"));
    CHECK_THAT(message, Catch::Contains("register host memory (shm) instead"));
  }
  // Nothing registered, nothing held: the object is the test's (and the resolver's) again.
  CHECK(registry.version() == version);
  CHECK(registry.List().size() == 1);
  CHECK(registry.Find("vmm.k") == nullptr);
  context = RegisterContext{};
  CHECK(memory.use_count() == 1);

  SECTION("staging off changes nothing before the driver is there") {
    RegionRegistry strict(&Context(), RegistryOptions{false});
    auto refused = strict.Register({VmmSpec("vmm.s", memory->id(), 0, 4096)}, false,
                                   VmmRegistrant({memory}));
    REQUIRE_FALSE(refused.ok());
    if (!DriverInstalled()) CHECK(refused.status().code() == StatusCode::kFailedPrecondition);
  }
}

TEST_CASE("VRAM by cuda_vmm: handles, bounds and overlaps are checked without a driver") {
  RegionRegistry registry(&Context());
  auto memory = DeviceMemory(1 << 20);
  auto other = DeviceMemory(1 << 20);
  auto expect = [&](const std::vector<v1::RegionSpec>& specs, const RegisterContext& context,
                    StatusCode code, const std::string& start) {
    auto result = registry.Register(specs, false, context);
    REQUIRE_FALSE(result.ok());
    CHECK(result.status().code() == code);
    CHECK_THAT(Message(result.status()), Catch::StartsWith(start));
    CHECK(registry.List().empty());
  };
  SECTION("an unknown handle") {
    expect({VmmSpec("x", 77, 0, 4096)}, VmmRegistrant({memory}), StatusCode::kNotFound,
           "region 'x' (entry 0): device memory handle 77 is not one of this session's");
    expect({VmmSpec("x", 404, 0, 4096)}, VmmRegistrant({memory}), StatusCode::kNotFound,
           "region 'x' (entry 0): cuda_vmm.memory_handle 404 is not one of this session's "
           "device memory handles; use a handle from ShareDeviceMemory");
  }
  SECTION("no local session") {
    expect({VmmSpec("x", memory->id(), 0, 4096)}, testing::Registrant(),
           StatusCode::kFailedPrecondition,
           "region 'x' (entry 0): cuda_vmm.memory_handle " + std::to_string(memory->id()) +
               " given, but device memory handles need a local session (ShareDeviceMemory");
  }
  SECTION("handle 0, an overflowing range, DRAM with a cuda_vmm source") {
    expect({VmmSpec("x", 0, 0, 4096)}, VmmRegistrant({memory}), StatusCode::kInvalidArgument,
           "region 'x' (entry 0): cuda_vmm.memory_handle is 0; set it to the handle that "
           "ShareDeviceMemory returned");
    expect({VmmSpec("x", memory->id(), ~uint64_t{0} - 100, 4096)}, VmmRegistrant({memory}),
           StatusCode::kInvalidArgument, "region 'x' (entry 0): cuda_vmm.offset ");
    v1::RegionSpec dram = VmmSpec("x", memory->id(), 0, 4096);
    dram.set_memory(v1::DRAM);
    expect({dram}, VmmRegistrant({memory}), StatusCode::kInvalidArgument,
           "region 'x' (entry 0): DRAM region has a cuda_vmm source; set memory VRAM");
  }
  SECTION("beyond the bytes shared") {
    expect({VmmSpec("x", memory->id(), (1 << 20) - 4096, 8192)}, VmmRegistrant({memory}),
           StatusCode::kInvalidArgument,
           "region 'x' (entry 0): cuda_vmm.offset 1044480 + length 8192 = 1052672 bytes, but "
           "device memory 'kv-vram' (handle " +
               std::to_string(memory->id()) + ") was shared with 1048576 bytes");
  }
  SECTION("overlapping regions of one object; other objects' ranges are their own") {
    auto result = registry.Register(
        {VmmSpec("a", memory->id(), 0, 8192), VmmSpec("b", memory->id(), 4096, 8192),
         VmmSpec("c", other->id(), 0, 8192), VmmSpec("d", memory->id(), 12288, 4096)},
        false, VmmRegistrant({memory, other}));
    REQUIRE_FALSE(result.ok());
    const std::string message = Message(result.status());
    CHECK_THAT(message, Catch::Contains("4 of 4 regions rejected; nothing was registered"));
    CHECK_THAT(message, Catch::Contains(
                            "region 'b' (entry 1): bytes [4096, 12288) of device memory "
                            "'kv-vram' overlap region 'a' (bytes [0, 8192)); give each region "
                            "its own byte range"));
    // c (another object) and d (after b's end) do not overlap: they get only what the
    // import says (no driver here, or a pipe the driver refuses).
    CHECK_THAT(message, !Catch::Contains("region 'c' (entry 2): bytes"));
    CHECK_THAT(message, !Catch::Contains("region 'd' (entry 3): bytes"));
    if (!DriverInstalled()) {
      CHECK(result.status().code() == StatusCode::kFailedPrecondition);  // entry 0's
      CHECK_THAT(message, Catch::Contains("region 'd' (entry 3): CUDA driver not available"));
    }
  }
}

}  // namespace
}  // namespace kvagent::registry
