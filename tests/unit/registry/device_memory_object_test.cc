// DeviceMemoryObject: what the local door accepts as a CUDA VMM descriptor before any
// driver sees it. Host memory (memfd, POSIX shm, tmpfs files) is refused with the
// fix "use share"; sizes and ordinals are bounded; the descriptor itself is the
// driver's to judge, so a pipe stands in for the NVIDIA descriptor here.
#include "registry/device_memory_object.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "base/unique_fd.h"
#include "catch2/catch.hpp"
#include "tests/unit/registry/test_util.h"

namespace kvagent::registry {
namespace {

using absl::StatusCode;

std::string Message(const absl::Status& status) { return std::string(status.message()); }

// The write end of a pipe (its read end in `read_end`): not host memory, so accepted.
UniqueFd PipeEnd(UniqueFd* read_end) {
  int ends[2];
  REQUIRE(pipe(ends) == 0);  // no O_CLOEXEC: FromDescriptor must set it
  read_end->reset(ends[0]);
  return UniqueFd(ends[1]);
}

TEST_CASE("DeviceMemoryObject keeps a descriptor that is not host memory") {
  UniqueFd read_end;
  UniqueFd fd = PipeEnd(&read_end);
  const int raw = fd.get();
  auto object = DeviceMemoryObject::FromDescriptor(std::move(fd), 2, 1 << 21, "kv\npool");
  REQUIRE(object.ok());
  CHECK((*object)->fd() == raw);
  CHECK((*object)->device() == 2);
  CHECK((*object)->bytes() == (1u << 21));
  CHECK((*object)->label() == "kv\\x0apool");  // escaped
  CHECK((*object)->kind() == "cuda-vmm");
  CHECK((fcntl(raw, F_GETFD) & FD_CLOEXEC) != 0);
  auto other = DeviceMemoryObject::FromDescriptor(UniqueFd(open("/dev/null", O_RDWR)), 0,
                                                  DeviceMemoryObject::kMaxBytes, "x");
  REQUIRE(other.ok());
  CHECK((*other)->id() != (*object)->id());
  CHECK((*object)->id() > 0);
}

TEST_CASE("DeviceMemoryObject refuses host memory, sizes and ordinals it cannot be") {
  SECTION("a memfd: host memory goes through share") {
    UniqueFd memfd(memfd_create("kv", MFD_CLOEXEC));
    REQUIRE(ftruncate(memfd.get(), 4096) == 0);
    auto object = DeviceMemoryObject::FromDescriptor(std::move(memfd), 0, 4096, "kv");
    REQUIRE_FALSE(object.ok());
    CHECK(object.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(object.status()),
               Catch::StartsWith("device memory 'kv': the descriptor is a file of host memory "
                                 "on tmpfs"));
    CHECK_THAT(Message(object.status()), Catch::Contains("not a CUDA VMM handle"));
    CHECK_THAT(Message(object.status()), Catch::Contains("use share for host memory"));
    CHECK_THAT(Message(object.status()), Catch::Contains("cuMemExportToShareableHandle"));
  }
  SECTION("a POSIX shm file") {
    ShmMapping shm = testing::MakeShm(4096);
    UniqueFd fd(dup(shm.memory()->fd()));
    auto object = DeviceMemoryObject::FromDescriptor(std::move(fd), 0, 4096, "shm");
    REQUIRE_FALSE(object.ok());
    CHECK_THAT(Message(object.status()), Catch::Contains("use share for host memory"));
  }
  SECTION("0 bytes, too many bytes") {
    for (uint64_t bytes : {uint64_t{0}, DeviceMemoryObject::kMaxBytes + 1, ~uint64_t{0}}) {
      auto object = DeviceMemoryObject::FromDescriptor(UniqueFd(open("/dev/null", O_RDWR)), 0,
                                                       bytes, "kv");
      REQUIRE_FALSE(object.ok());
      CHECK(object.status().code() == StatusCode::kInvalidArgument);
      CHECK_THAT(Message(object.status()),
                 Catch::StartsWith("device memory 'kv': " + std::to_string(bytes) +
                                   " bytes declared; give the allocation's size"));
    }
  }
  SECTION("a negative ordinal") {
    auto object =
        DeviceMemoryObject::FromDescriptor(UniqueFd(open("/dev/null", O_RDWR)), -1, 4096, "kv");
    REQUIRE_FALSE(object.ok());
    CHECK(object.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(object.status()),
               Catch::StartsWith("device memory 'kv': device ordinal -1 is negative"));
  }
  SECTION("no descriptor, one that is not open") {
    auto none = DeviceMemoryObject::FromDescriptor(UniqueFd(), 0, 4096, "kv");
    REQUIRE_FALSE(none.ok());
    CHECK_THAT(Message(none.status()), Catch::Contains("no descriptor was given"));
    // Far above any open descriptor (and RLIMIT_NOFILE): closing it is a harmless EBADF.
    auto closed = DeviceMemoryObject::FromDescriptor(UniqueFd(1 << 24), 0, 4096, "kv");
    REQUIRE_FALSE(closed.ok());
    CHECK_THAT(Message(closed.status()), Catch::Contains("cannot inspect the descriptor"));
  }
}

}  // namespace
}  // namespace kvagent::registry
