// ReadProcessMemory on this very process: anonymous memory shows in RssAnon, shared
// memory in RssShmem and not in beyond_pools(), a process that is gone is named.
#include "cli/process_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "base/format.h"
#include "catch2/catch.hpp"

namespace kvagent::cli {
namespace {

constexpr uint64_t kMiB = 1 << 20;

ProcessMemory ReadSelf() {
  auto m = ReadProcessMemory(getpid());
  INFO(m.status().ToString());
  REQUIRE(m.ok());
  return *m;
}

// Writes one byte per page so every page becomes resident.
void Touch(void* data, uint64_t bytes) {
  auto* p = static_cast<volatile uint8_t*>(data);
  for (uint64_t i = 0; i < bytes; i += 4096) p[i] = static_cast<uint8_t>(i >> 12 | 1);
}

TEST_CASE("32 MiB of touched anonymous memory shows in RssAnon and goes when unmapped") {
  const ProcessMemory before = ReadSelf();
  CHECK(before.pid == getpid());
  CHECK(before.rss_anon > 0);
  CHECK(before.rss_file > 0);  // this binary and libc
  CHECK(before.vm_rss >= before.rss_anon + before.rss_file);
  CHECK(before.vm_hwm >= before.vm_rss);

  constexpr uint64_t kBytes = 32 * kMiB;
  void* data = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(data != MAP_FAILED);
  Touch(data, kBytes);
  const ProcessMemory touched = ReadSelf();
  const int64_t grown = static_cast<int64_t>(touched.rss_anon) - static_cast<int64_t>(before.rss_anon);
  INFO("RssAnon " << before.rss_anon << " -> " << touched.rss_anon << " (" << grown << " bytes)");
  // 32 MiB, give or take what Catch2 and the reading itself allocate.
  CHECK(grown >= static_cast<int64_t>(31 * kMiB));
  CHECK(grown <= static_cast<int64_t>(36 * kMiB));
  CHECK(touched.beyond_pools() >= before.beyond_pools() + 31 * kMiB);
  CHECK(touched.vm_hwm >= touched.vm_rss);
  if (touched.has_rollup) {
    // Private pages count whole in Pss.
    CHECK(touched.pss_anon >= 31 * kMiB);
  }

  REQUIRE(munmap(data, kBytes) == 0);
  const ProcessMemory unmapped = ReadSelf();
  INFO("RssAnon after munmap " << unmapped.rss_anon);
  CHECK(unmapped.rss_anon + 28 * kMiB <= touched.rss_anon);
  // The peak remembers it.
  CHECK(unmapped.vm_hwm >= before.rss_anon + 31 * kMiB);
}

TEST_CASE("touched shared memory is RssShmem, not memory beyond the pools") {
  const std::string name = "/kvagent-process-memory-test." + std::to_string(getpid());
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  REQUIRE(fd >= 0);
  shm_unlink(name.c_str());
  constexpr uint64_t kBytes = 16 * kMiB;
  REQUIRE(ftruncate(fd, kBytes) == 0);
  void* data = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  REQUIRE(data != MAP_FAILED);

  const ProcessMemory before = ReadSelf();
  Touch(data, kBytes);
  const ProcessMemory touched = ReadSelf();
  INFO("RssShmem " << before.rss_shmem << " -> " << touched.rss_shmem << ", beyond pools "
                   << before.beyond_pools() << " -> " << touched.beyond_pools());
  CHECK(touched.rss_shmem >= before.rss_shmem + 15 * kMiB);
  CHECK(touched.beyond_pools() < before.beyond_pools() + 2 * kMiB);
  munmap(data, kBytes);
}

TEST_CASE("a process that is gone: NOT_FOUND naming the pid and the file") {
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) _exit(0);
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);  // reaped: /proc/<child> is gone

  auto m = ReadProcessMemory(child);
  REQUIRE_FALSE(m.ok());
  CHECK(m.status().code() == absl::StatusCode::kNotFound);
  const std::string message(m.status().message());
  CHECK_THAT(message, Catch::Contains("pid " + std::to_string(child)) &&
                          Catch::Contains("/proc/" + std::to_string(child) + "/status") &&
                          Catch::Contains("still running"));

  auto bad = ReadProcessMemory(0);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("status text without RssAnon is refused with the field and the kernel needed") {
  const std::string old_kernel = "Name:\tx\nVmHWM:\t  100 kB\nVmRSS:\t  90 kB\n";
  auto m = ParseProcessMemory(42, old_kernel, "");
  REQUIRE_FALSE(m.ok());
  CHECK_THAT(std::string(m.status().message()),
             Catch::Contains("pid 42") && Catch::Contains("RssAnon") && Catch::Contains("4.5"));

  const std::string status =
      "VmHWM:\t    2048 kB\nVmRSS:\t    1024 kB\nRssAnon:\t     512 kB\nRssFile:\t     256 kB\n"
      "RssShmem:\t     256 kB\n";
  const std::string rollup =
      "5556-7ffd ---p 00000000 00:00 0  [rollup]\nRss:  1024 kB\nPss:  700 kB\n"
      "Pss_Anon:  512 kB\nPss_File:  60 kB\nPss_Shmem:  128 kB\n";
  auto parsed = ParseProcessMemory(42, status, rollup);
  REQUIRE(parsed.ok());
  CHECK(parsed->rss_anon == 512 * 1024);
  CHECK(parsed->rss_file == 256 * 1024);
  CHECK(parsed->rss_shmem == 256 * 1024);
  CHECK(parsed->vm_hwm == 2048 * 1024);
  CHECK(parsed->beyond_pools() == 768 * 1024);
  CHECK(parsed->has_rollup);
  CHECK(parsed->pss == 700 * 1024);  // not Pss_Anon's line
  CHECK(parsed->pss_shmem == 128 * 1024);
}

}  // namespace
}  // namespace kvagent::cli
