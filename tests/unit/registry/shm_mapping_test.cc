#include "registry/shm_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "catch2/catch.hpp"
#include "tests/unit/registry/test_util.h"

namespace kvagent::registry {
namespace {

using testing::MakeShm;

std::string Message(const absl::Status& status) { return std::string(status.message()); }

TEST_CASE("Open of a missing object is NOT_FOUND and names it") {
  auto shm = ShmMapping::Open("/kvagent-test-does-not-exist", 0, 4096, "k.L0");
  REQUIRE(shm.status().code() == absl::StatusCode::kNotFound);
  CHECK_THAT(Message(shm.status()), Catch::Contains("/kvagent-test-does-not-exist"));
  CHECK_THAT(Message(shm.status()), Catch::Contains("k.L0"));
}

TEST_CASE("Open of a too small object gives both sizes") {
  ShmMapping owner = MakeShm(8192);
  auto shm = ShmMapping::Open(owner.name(), 4096, 8192, "v.L3");
  REQUIRE(shm.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(shm.status()), Catch::Contains("8192 bytes"));
  CHECK_THAT(Message(shm.status()), Catch::Contains("12288"));
  CHECK_THAT(Message(shm.status()), Catch::Contains("v.L3"));
  // offset + length overflowing uint64 is rejected, not wrapped.
  auto wrapped = ShmMapping::Open(owner.name(), UINT64_MAX - 10, 100, "v.L3");
  CHECK(wrapped.status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Open rejects zero length and relative names") {
  ShmMapping owner = MakeShm(4096);
  CHECK(ShmMapping::Open(owner.name(), 0, 0, "a").status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(ShmMapping::Open("relative", 0, 1, "a").status().code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Create makes a shared object that Open sees, and unlinks it on destruction") {
  std::string name;
  {
    ShmMapping owner = MakeShm(3 * 4096);
    name = owner.name();
    REQUIRE(owner.length() == 3 * 4096);
    std::memset(owner.data(), 0x5a, owner.length());
    auto view = ShmMapping::Open(name, 4096, 4096, "view");
    REQUIRE(view.ok());
    CHECK(view->device() == owner.device());
    CHECK(view->inode() == owner.inode());
    CHECK(static_cast<unsigned char*>(view->data())[0] == 0x5a);
    static_cast<unsigned char*>(view->data())[1] = 0x11;  // MAP_SHARED both ways
    CHECK(static_cast<unsigned char*>(owner.data())[4097] == 0x11);

    auto again = ShmMapping::Create(name, 4096);
    CHECK(again.status().code() == absl::StatusCode::kAlreadyExists);
  }
  CHECK(ShmMapping::Open(name, 0, 1, "gone").status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("Create reports free bytes when /dev/shm has no room") {
  const std::string name = "/kvagent-test-huge-" + std::to_string(getpid());
  auto shm = ShmMapping::Create(name, uint64_t{1} << 62);
  REQUIRE(shm.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(Message(shm.status()), Catch::Contains("bytes free"));
  CHECK(ShmMapping::Open(name, 0, 1, "x").status().code() ==
        absl::StatusCode::kNotFound);
}

TEST_CASE("Move transfers ownership") {
  ShmMapping a = MakeShm(4096);
  const std::string name = a.name();
  void* data = a.data();
  ShmMapping b(std::move(a));
  CHECK(a.data() == nullptr);
  CHECK(b.data() == data);
  ShmMapping c;
  c = std::move(b);
  CHECK(b.data() == nullptr);
  CHECK(c.name() == name);
  static_cast<char*>(c.data())[0] = 1;  // still mapped
  CHECK(ShmMapping::Open(name, 0, 1, "x").ok());  // not unlinked by the moved-from ones
}

TEST_CASE("A file path with unaligned offsets maps the right bytes") {
  const char* tmp = std::getenv("TEST_TMPDIR");
  REQUIRE(tmp != nullptr);
  const std::string path = std::string(tmp) + "/pool.bin";
  const size_t size = 3 * 4096 + 123;
  int fd = open(path.c_str(), O_CREAT | O_TRUNC | O_RDWR, 0600);
  REQUIRE(fd >= 0);
  std::string bytes(size, '\0');
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>(i * 7 + 3);
  REQUIRE(write(fd, bytes.data(), size) == static_cast<ssize_t>(size));
  close(fd);

  for (uint64_t offset : {uint64_t{1}, uint64_t{4095}, uint64_t{4097}, uint64_t{8200}}) {
    const uint64_t length = size - offset;
    auto shm = ShmMapping::Open(path, offset, length, "file");
    REQUIRE(shm.ok());
    CHECK(shm->offset() == offset);
    CHECK(shm->length() == length);
    CHECK(std::memcmp(shm->data(), bytes.data() + offset, length) == 0);
  }
  auto missing = ShmMapping::Open(std::string(tmp) + "/none.bin", 0, 1, "file");
  CHECK(missing.status().code() == absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvagent::registry
