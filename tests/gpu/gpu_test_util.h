// What the GPU tests share: whether this host can run them, and copies between a
// host vector and device memory (bytes compared by the tests). Needs a CUDA driver
// only when called past GpuMissing().
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvagent::testing {

// True when KVAGENT_CUDA_DRIVER names the stand-in driver (tests/unit/gpu/standin_cuda.cc:
// host memory as device memory), as the *_standin targets do.
bool StandinDriver();
// Why GPU tests cannot run here (no libcuda, a driver error, no device), or "".
std::string GpuMissing();
// Synchronous copies through the driver; a failure fails the current test case.
void ToDevice(uint64_t dptr, const std::vector<uint8_t>& host);
std::vector<uint8_t> FromDevice(uint64_t dptr, uint64_t bytes);

}  // namespace kvagent::testing
