#include "registry/fault_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "base/unique_fd.h"
#include "catch2/catch.hpp"
#include "registry/memory_object.h"
#include "registry/shm_mapping.h"

namespace kvagent::registry {
namespace {

constexpr uint64_t kPage = 4096;

// An unsealed memfd of `bytes`, as an engine's own memory: it can shrink.
UniqueFd MakeMemfd(uint64_t bytes) {
  UniqueFd fd(memfd_create("kvagent-fault-guard-test", MFD_CLOEXEC));
  REQUIRE(fd.valid());
  REQUIRE(ftruncate(fd.get(), static_cast<off_t>(bytes)) == 0);
  return fd;
}

// Maps the memfd through ShmMapping (guarded); returns it and keeps `fd` to truncate.
ShmMapping MapThrough(const UniqueFd& fd, uint64_t bytes) {
  UniqueFd copy(dup(fd.get()));
  REQUIRE(copy.valid());
  auto object = MemoryObject::FromDescriptor(std::move(copy), "engine memfd");
  REQUIRE(object.ok());
  auto mapping = ShmMapping::Map(*std::move(object), 0, bytes, "k.L0");
  REQUIRE(mapping.ok());
  return *std::move(mapping);
}

TEST_CASE("a truncated mapping reads zeros and takes writes instead of killing the process") {
  UniqueFd fd = MakeMemfd(8 * kPage);
  ShmMapping mapping = MapThrough(fd, 8 * kPage);
  auto* bytes = static_cast<uint8_t*>(mapping.data());
  std::memset(bytes, 0x5A, 8 * kPage);
  CHECK_FALSE(mapping.broken());

  const uint64_t before = FaultGuard::faults_caught();
  REQUIRE(ftruncate(fd.get(), static_cast<off_t>(2 * kPage)) == 0);
  // Pages 2..7 have no file behind them now: each access would be a SIGBUS.
  std::vector<uint8_t> out(6 * kPage, 0xFF);
  std::memcpy(out.data(), bytes + 2 * kPage, out.size());  // read the lost pages
  std::memset(bytes + 3 * kPage, 0x11, 2 * kPage);        // and write them

  CHECK(mapping.broken());
  // One fault: the handler maps zero pages from the faulting page to the range's end.
  CHECK(FaultGuard::faults_caught() == before + 1);
  CHECK(out[0] == 0);
  CHECK(out[out.size() - 1] == 0);
  CHECK(bytes[3 * kPage] == 0x11);  // throwaway memory, but it is there
  // The pages before the fault are still the object's.
  CHECK(bytes[0] == 0x5A);
  CHECK(bytes[2 * kPage - 1] == 0x5A);
}

TEST_CASE("a fault in one mapping marks only that one, and the flag follows a move") {
  UniqueFd fd_a = MakeMemfd(4 * kPage);
  UniqueFd fd_b = MakeMemfd(4 * kPage);
  ShmMapping a = MapThrough(fd_a, 4 * kPage);
  ShmMapping b = MapThrough(fd_b, 4 * kPage);
  ShmMapping moved = std::move(a);
  REQUIRE(ftruncate(fd_a.get(), 0) == 0);
  const volatile uint8_t* lost = static_cast<const uint8_t*>(moved.data()) + kPage;
  CHECK(*lost == 0);
  CHECK(moved.broken());
  CHECK_FALSE(b.broken());
  CHECK_FALSE(a.broken());  // moved from: no range any more
}

TEST_CASE("unmapping unguards the range") {
  const size_t before = FaultGuard::guarded_ranges();
  {
    UniqueFd fd = MakeMemfd(kPage);
    ShmMapping mapping = MapThrough(fd, kPage);
    CHECK(FaultGuard::guarded_ranges() == before + 1);
  }
  CHECK(FaultGuard::guarded_ranges() == before);
}

TEST_CASE("a full guard table refuses the mapping with RESOURCE_EXHAUSTED naming the limit") {
  void* page = mmap(nullptr, kPage, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(page != MAP_FAILED);
  std::vector<GuardedRange> held;
  while (FaultGuard::guarded_ranges() < FaultGuard::kCapacity) {
    auto guard = FaultGuard::Guard(page, kPage, kPage, "filler");
    REQUIRE(guard.ok());
    held.push_back(*std::move(guard));
  }
  UniqueFd fd = MakeMemfd(kPage);
  UniqueFd copy(dup(fd.get()));
  auto object = MemoryObject::FromDescriptor(std::move(copy), "engine memfd");
  REQUIRE(object.ok());
  auto refused = ShmMapping::Map(*std::move(object), 0, kPage, "v.L9");
  REQUIRE(refused.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(refused.status().message()), Catch::Contains("v.L9"));
  CHECK_THAT(std::string(refused.status().message()), Catch::Contains("65536"));
  held.clear();
  CHECK(ShmMapping::Map(MemoryObject::FromDescriptor(UniqueFd(dup(fd.get())), "again").value(),
                        0, kPage, "v.L9")
            .ok());
  munmap(page, kPage);
}

TEST_CASE("a fault outside every guarded range still kills the process with SIGBUS") {
  // The guard is installed (a mapping exists) before the child runs.
  UniqueFd guarded_fd = MakeMemfd(kPage);
  ShmMapping guarded = MapThrough(guarded_fd, kPage);
  UniqueFd fd = MakeMemfd(2 * kPage);
  void* plain = mmap(nullptr, 2 * kPage, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  REQUIRE(plain != MAP_FAILED);
  REQUIRE(ftruncate(fd.get(), 0) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    static_cast<volatile uint8_t*>(plain)[kPage] = 1;  // not guarded: must die here
    _exit(0);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  if (WIFSIGNALED(status)) CHECK(WTERMSIG(status) == SIGBUS);
  munmap(plain, 2 * kPage);
}

}  // namespace
}  // namespace kvagent::registry
