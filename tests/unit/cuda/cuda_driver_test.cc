#include "cuda/driver.h"

#include <dlfcn.h>

#include <string>

#include "catch2/catch.hpp"

namespace kvagent::cuda {
namespace {

using absl::StatusCode;

bool DriverInstalled() {
  void* handle = dlopen(CudaDriver::kLibraryName, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return false;
  dlclose(handle);
  return true;
}

std::string Message(const absl::Status& status) { return std::string(status.message()); }

TEST_CASE("Load fails with the cause and fix when libcuda.so.1 is absent") {
  auto driver = CudaDriver::Load();
  if (DriverInstalled()) {
    // A GPU machine: the driver loads (or cuInit says why not), devices are listed.
    WARN("libcuda.so.1 is installed here; checking the loaded driver instead");
    if (!driver.ok()) {
      CHECK(driver.status().code() == StatusCode::kFailedPrecondition);
      CHECK_THAT(Message(driver.status()), Catch::Contains("cuInit"));
      return;
    }
    CHECK((*driver)->driver_version() > 0);
    auto devices = (*driver)->Devices();
    REQUIRE(devices.ok());
    CHECK(static_cast<int>(devices->size()) == (*driver)->device_count());
    return;
  }
  REQUIRE_FALSE(driver.ok());
  CHECK(driver.status().code() == StatusCode::kFailedPrecondition);
  const std::string message = Message(driver.status());
  CHECK_THAT(message, Catch::StartsWith("CUDA driver not available: dlopen(libcuda.so.1) failed: "));
  CHECK_THAT(message, Catch::Contains("libcuda.so.1: cannot open shared object file"));
  CHECK_THAT(message, Catch::Contains("this machine has no NVIDIA driver. Install the NVIDIA "
                                      "driver to register VRAM, or register host memory (shm) "
                                      "instead"));
  CHECK_THAT(message, !Catch::Contains("KVAGENT_CUDA_DRIVER"));
  // Cached: the same answer without another dlopen.
  auto again = CudaDriver::Load();
  REQUIRE_FALSE(again.ok());
  CHECK(again.status() == driver.status());
}

TEST_CASE("ValidateIpcSource checks the handle size and the device ordinal") {
  CHECK(CudaDriver::ValidateIpcSource("k.L0", 64, 0, 1).ok());
  CHECK(CudaDriver::ValidateIpcSource("k.L0", 64, 7, 8).ok());
  CHECK(CudaDriver::ValidateIpcSource("k.L0", 64, 3, -1).ok());  // count unknown: not checked

  SECTION("wrong handle size") {
    for (size_t bytes : {0, 63, 65, 128}) {
      absl::Status s = CudaDriver::ValidateIpcSource("k.L0", bytes, 0, 1);
      CHECK(s.code() == StatusCode::kInvalidArgument);
      CHECK_THAT(Message(s), Catch::StartsWith(
                                 "region 'k.L0': cuda_ipc.ipc_handle is " + std::to_string(bytes) +
                                 " bytes; a CUDA IPC memory handle is 64 bytes "
                                 "(cudaIpcGetMemHandle)"));
    }
  }
  SECTION("negative ordinal") {
    absl::Status s = CudaDriver::ValidateIpcSource("v.L3", 64, -1, 4);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(s), Catch::StartsWith("region 'v.L3': device ordinal -1 is negative"));
    CHECK(CudaDriver::ValidateIpcSource("v.L3", 64, -1, -1).code() ==
          StatusCode::kInvalidArgument);
  }
  SECTION("ordinal out of range") {
    absl::Status s = CudaDriver::ValidateIpcSource("x", 64, 7, 4);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(s), Catch::StartsWith("region 'x': device ordinal 7 is out of range; this "
                                             "machine has 4 CUDA devices (0..3)"));
    s = CudaDriver::ValidateIpcSource("x", 64, 4, 4);
    CHECK_THAT(Message(s), Catch::Contains("device ordinal 4 is out of range"));
    s = CudaDriver::ValidateIpcSource("x", 64, 0, 0);
    CHECK(s.code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(s), Catch::Contains("this machine has no CUDA devices"));
  }
  SECTION("the size is checked before the ordinal") {
    absl::Status s = CudaDriver::ValidateIpcSource("x", 10, -5, 1);
    CHECK_THAT(Message(s), Catch::Contains("ipc_handle is 10 bytes"));
  }
}

}  // namespace
}  // namespace kvagent::cuda
