// A peer deregisters the regions a transfer is writing while the transfer runs (over
// UCX tcp, so it takes long enough to catch in flight). The transfer must fail with
// the region named, and once DeregisterRegions has answered not one more byte may
// land in the released memory: the decode agent may hand those pages to other
// requests the moment it answers.
#include <chrono>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <string_view>
#include <thread>

#include "base/format.h"
#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "tests/integration/agent_pair.h"

namespace kvagent::testing {
namespace {

using Clock = std::chrono::steady_clock;

size_t PoolHash(const cli::KvPool& pool) {
  return std::hash<std::string_view>{}(
      std::string_view(static_cast<const char*>(pool.mapping.data()), pool.bytes()));
}

TEST_CASE("a region deregistered mid-transfer fails the transfer; nothing lands after") {
  AgentPairOptions options;
  options.shape.layers = 8;  // 16 regions of 1024 x 32 KiB pages: 512 MiB per agent
  options.shape.pages = 1024;
  options.shape.page_bytes = 32 << 10;
  options.env["UCX_TLS"] = "tcp,self";
  options.extra_args = {"--shm-direct", "off"};
  AgentPair pair(options);

  std::vector<uint64_t> pages(options.shape.pages);
  std::iota(pages.begin(), pages.end(), 0);
  REQUIRE(pair.prefill().Submit(KvWrite("dereg-mid", pages, pages, "never-complete")).ok());

  // Wait until the first batch is in place, so the transfer is really moving.
  const auto start = Clock::now();
  v1::TransferState state;
  do {
    auto got = pair.prefill().Get("dereg-mid");
    REQUIRE(got.ok());
    state = *got;
    if (state.bytes_done() > 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  } while (Clock::now() - start < std::chrono::seconds(20));
  INFO(fmt::format("{} of {} bytes in place, phase {}", state.bytes_done(), state.bytes_total(),
                   v1::TransferPhase_Name(state.phase())));
  // If UCX tcp ever moved 512 MiB before the first poll, this test could not see the
  // transfer in flight; say so instead of passing.
  REQUIRE(state.phase() == v1::TRANSFERRING);
  REQUIRE(state.bytes_done() < state.bytes_total());

  const auto dereg_start = Clock::now();
  auto dereg = pair.decode().Deregister(pair.decode_pool().region_names);
  const double dereg_ms =
      std::chrono::duration<double, std::milli>(Clock::now() - dereg_start).count();
  INFO(dereg.status().ToString());
  REQUIRE(dereg.ok());
  // From here on the decode pool is released memory: it must not change.
  const size_t released = PoolHash(pair.decode_pool());

  auto done = pair.prefill().WaitTransfer("dereg-mid", 20000);
  REQUIRE(done.ok());
  INFO(done->error_message());
  CHECK(done->phase() == v1::FAILED);
  CHECK(done->error_code() == static_cast<int>(absl::StatusCode::kAborted));
  CHECK_THAT(done->error_message(), Catch::Contains("dereg-mid") &&
                                        Catch::Contains("deregistered region") &&
                                        Catch::Contains("'decode'"));
  CHECK(done->bytes_done() < done->bytes_total());
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  CHECK(PoolHash(pair.decode_pool()) == released);
  // No DATA_READY for a transfer that did not complete.
  auto notes = pair.decode().Poll(0);
  REQUIRE(notes.ok());
  for (const auto& n : notes->notifications()) CHECK(n.kind() != v1::DATA_READY);
  std::printf("deregistered mid-transfer after %lu of %lu bytes: DeregisterRegions answered in "
              "%.0f ms, transfer %s with %lu bytes in place\n",
              static_cast<unsigned long>(state.bytes_done()),
              static_cast<unsigned long>(state.bytes_total()), dereg_ms,
              v1::TransferPhase_Name(done->phase()).c_str(),
              static_cast<unsigned long>(done->bytes_done()));
}

}  // namespace
}  // namespace kvagent::testing
