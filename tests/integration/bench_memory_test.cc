// RunMemoryBench (issue 6's memory check) against two real kvagentd with a small
// count: the regions are really registered while it runs and gone afterwards, every
// transfer completed and notified, and the figures are real readings (the pools show
// as shared memory, not as memory beyond the pools). BENCH_MEMORY_TRANSFERS=100000
// runs the full issue-6 check by hand (then the counts below follow it).
#include "cli/bench_memory.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "base/format.h"
#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "tests/integration/agent_pair.h"

namespace kvagent::testing {
namespace {

constexpr uint64_t kMiB = 1 << 20;

TEST_CASE("memory bench: 1,000 regions per agent and 2,000 transfers, with real figures") {
  AgentPair pair;
  auto regions_before = pair.prefill().Regions();
  REQUIRE(regions_before.ok());
  const int base_regions = regions_before->regions_size();  // the pair's own KV pool
  auto completed_before = pair.prefill().Status();
  REQUIRE(completed_before.ok());

  cli::MemoryBenchOptions options;
  options.regions = 1000;
  const char* transfers_env = std::getenv("BENCH_MEMORY_TRANSFERS");
  options.transfers = transfers_env ? std::strtoull(transfers_env, nullptr, 10) : 2000;
  const uint64_t n = options.transfers;
  // Seen from inside the run: ListRegions on both agents while the transfers go.
  int initiator_regions_during = -1, target_regions_during = -1;
  uint64_t last_progress = 0;
  options.progress = [&](uint64_t done, uint64_t total) {
    last_progress = done;
    if (initiator_regions_during >= 0) return;
    auto a = pair.prefill().Regions();
    auto b = pair.decode().Regions();
    if (a.ok()) initiator_regions_during = a->regions_size();
    if (b.ok()) target_regions_during = b->regions_size();
  };

  auto result = cli::RunMemoryBench(options, pair.prefill(), pair.decode(), "decode",
                                    pair.prefill_process().pid(), pair.decode_process().pid());
  INFO(result.status().ToString());
  REQUIRE(result.ok());
  std::printf("%s%s\n", cli::FormatMemoryBench(*result).c_str(), cli::MemoryBenchJson(*result).c_str());

  CHECK(initiator_regions_during == base_regions + 1000);
  CHECK(target_regions_during == base_regions + 1000);
  CHECK(last_progress == n);
  // Deregistered afterwards.
  auto regions_after = pair.prefill().Regions();
  REQUIRE(regions_after.ok());
  CHECK(regions_after->regions_size() == base_regions);
  auto target_after = pair.decode().Regions();
  REQUIRE(target_after.ok());
  CHECK(target_after->regions_size() == base_regions);

  CHECK(result->regions == 1000);
  CHECK(result->pool_bytes == 1000ull * 16 * 4096);
  CHECK(result->transfers == n);
  CHECK(result->notifications == n);
  CHECK(result->seconds > 0);
  CHECK(result->transfers_per_second > 0);
  auto completed_after = pair.prefill().Status();
  REQUIRE(completed_after.ok());
  CHECK(completed_after->transfers_completed() == completed_before->transfers_completed() + n);

  // Readings of the right processes, non-zero at every moment.
  for (const cli::MemorySample* s :
       {&result->before_regions, &result->after_regions, &result->after_transfers}) {
    CHECK(s->initiator.pid == pair.prefill_process().pid());
    CHECK(s->target.pid == pair.decode_process().pid());
    CHECK(s->initiator.rss_anon > 0);
    CHECK(s->target.rss_anon > 0);
    CHECK(s->initiator.rss_file > 0);
    CHECK(s->initiator.vm_hwm >= s->initiator.vm_rss);
  }
  // The agent maps its new pool (62.5 MiB of shared memory): RssShmem grows by it,
  // and it is not counted as memory beyond the pools.
  for (auto [before, after] :
       {std::pair{&result->before_regions.initiator, &result->after_regions.initiator},
        std::pair{&result->before_regions.target, &result->after_regions.target}}) {
    INFO("pid " << after->pid << ": RssShmem " << before->rss_shmem << " -> " << after->rss_shmem
                << ", beyond pools " << before->beyond_pools() << " -> " << after->beyond_pools());
    CHECK(after->rss_shmem >= before->rss_shmem + result->pool_bytes - 2 * kMiB);
    CHECK(after->beyond_pools() < before->beyond_pools() + result->pool_bytes / 2);
  }
  CHECK(result->meets_target ==
        (result->after_transfers.initiator.beyond_pools() < options.limit_bytes &&
         result->after_transfers.target.beyond_pools() < options.limit_bytes));
  CHECK_THAT(cli::MemoryBenchJson(*result),
             Catch::Contains(fmt::format("\"transfers\":{}", n)) && Catch::Contains("\"meets_target\":"));
}

TEST_CASE("memory bench: options that cannot be laid out are refused before anything runs") {
  AgentPair pair;
  cli::MemoryBenchOptions options;
  options.regions = 1000;
  options.regions_per_group = 7;
  auto result = cli::RunMemoryBench(options, pair.prefill(), pair.decode(), "decode",
                                    pair.prefill_process().pid(), pair.decode_process().pid());
  REQUIRE_FALSE(result.ok());
  CHECK(result.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(result.status().message()),
             Catch::Contains("1000 regions in groups of 7") && Catch::Contains("multiple"));
  auto regions = pair.prefill().Regions();
  REQUIRE(regions.ok());
  CHECK(regions->regions_size() == 8);  // only the pair's own pool
}

}  // namespace
}  // namespace kvagent::testing
