#include "tests/gpu/gpu_test_util.h"

#include <unistd.h>

#include <cstdlib>

#include "catch2/catch.hpp"
#include "cuda/driver.h"

namespace kvagent::testing {

using cuda::CudaDriver;

namespace {
// The *_standin targets name the stand-in driver by its runfiles path; the agents these
// tests start run elsewhere, so make it absolute before anything loads it.
const bool kDriverPathAbsolute = [] {
  const char* path = std::getenv(CudaDriver::kLibraryEnv);
  if (path == nullptr || path[0] == '\0' || path[0] == '/') return true;
  char cwd[4096];
  if (getcwd(cwd, sizeof cwd) == nullptr) return false;
  setenv(CudaDriver::kLibraryEnv, (std::string(cwd) + "/" + path).c_str(), 1);
  return true;
}();
}  // namespace

bool StandinDriver() {
  const char* path = std::getenv(CudaDriver::kLibraryEnv);
  return kDriverPathAbsolute && path != nullptr &&
         std::string(path).find("libcuda_standin") != std::string::npos;
}

std::string GpuMissing() {
  auto driver = CudaDriver::Load();
  if (!driver.ok()) return std::string(driver.status().message());
  auto devices = (*driver)->Devices();
  if (!devices.ok()) return std::string(devices.status().message());
  if (devices->empty()) return "the CUDA driver reports no devices";
  return "";
}

void ToDevice(uint64_t dptr, const std::vector<uint8_t>& host) {
  REQUIRE((*CudaDriver::Load())->Copy(dptr, reinterpret_cast<uint64_t>(host.data()), host.size()).ok());
}

std::vector<uint8_t> FromDevice(uint64_t dptr, uint64_t bytes) {
  std::vector<uint8_t> host(bytes);
  REQUIRE((*CudaDriver::Load())->Copy(reinterpret_cast<uint64_t>(host.data()), dptr, bytes).ok());
  return host;
}

}  // namespace kvagent::testing
