#include "tests/gpu/gpu_test_util.h"

#include "catch2/catch.hpp"
#include "cuda/driver.h"

namespace kvagent::testing {

using cuda::CudaDriver;

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
