// KVAGENT_CUDA_DRIVER replaces libcuda.so.1; a path that does not exist is named in
// the error. Its own binary: the driver is loaded once per process.
#include <cstdlib>
#include <string>

#include "catch2/catch.hpp"
#include "cuda/driver.h"

namespace kvagent::cuda {
namespace {

TEST_CASE("Load names the library path set by KVAGENT_CUDA_DRIVER") {
  REQUIRE(setenv(CudaDriver::kLibraryEnv, "/nonexistent/libcuda.so.1", 1) == 0);
  auto driver = CudaDriver::Load();
  REQUIRE_FALSE(driver.ok());
  CHECK(driver.status().code() == absl::StatusCode::kFailedPrecondition);
  const std::string message(driver.status().message());
  CHECK_THAT(message, Catch::StartsWith("CUDA driver not available: "
                                        "dlopen(/nonexistent/libcuda.so.1) failed: "
                                        "/nonexistent/libcuda.so.1: cannot open shared object "
                                        "file"));
  CHECK_THAT(message, Catch::Contains("at /nonexistent/libcuda.so.1 (set by KVAGENT_CUDA_DRIVER)"));
  CHECK_THAT(message, Catch::Contains("register host memory (shm) instead"));
  // Loaded once: changing the variable later changes nothing.
  REQUIRE(setenv(CudaDriver::kLibraryEnv, "/elsewhere/libcuda.so.1", 1) == 0);
  CHECK(CudaDriver::Load().status() == driver.status());
}

}  // namespace
}  // namespace kvagent::cuda
