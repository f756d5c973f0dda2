// A library that loads but is not the CUDA driver (libm here) stands for a driver
// too old to have the entry points kvagent needs: the error names the missing
// symbols by their exact ABI names. Its own binary: the driver is loaded once.
#include <cstdlib>
#include <string>

#include "catch2/catch.hpp"
#include "cuda/driver.h"

namespace kvagent::cuda {
namespace {

TEST_CASE("Load names the missing driver symbols and the driver version") {
  REQUIRE(setenv(CudaDriver::kLibraryEnv, "libm.so.6", 1) == 0);
  auto driver = CudaDriver::Load();
  REQUIRE_FALSE(driver.ok());
  CHECK(driver.status().code() == absl::StatusCode::kFailedPrecondition);
  const std::string message(driver.status().message());
  CHECK_THAT(message, Catch::StartsWith("CUDA driver libm.so.6 (driver API version unknown) "
                                        "lacks cuGetErrorName, cuGetErrorString, cuInit, "));
  for (const char* symbol : {"cuDeviceTotalMem_v2", "cuDevicePrimaryCtxRelease_v2",
                             "cuIpcOpenMemHandle_v2", "cuMemGetAddressRange_v2", "cuMemcpy,",
                             "cuStreamDestroy_v2", "cuMemHostRegister_v2",
                             "cuPointerGetAttribute", "cuMemImportFromShareableHandle",
                             "cuMemGetAllocationPropertiesFromHandle",
                             "cuMemGetAllocationGranularity", "cuMemAddressReserve", "cuMemMap,",
                             "cuMemSetAccess", "cuMemUnmap", "cuMemAddressFree", "cuMemRelease",
                             "cuMemCreate", "cuMemExportToShareableHandle"}) {
    CHECK_THAT(message, Catch::Contains(symbol));
  }
  CHECK_THAT(message, !Catch::Contains("_ptds"));
  CHECK_THAT(message, Catch::EndsWith("upgrade the NVIDIA driver (kvagent needs a CUDA 11.0 or "
                                      "newer driver)"));
}

}  // namespace
}  // namespace kvagent::cuda
