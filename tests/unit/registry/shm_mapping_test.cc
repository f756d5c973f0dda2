#include "registry/shm_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "base/unique_fd.h"
#include "catch2/catch.hpp"
#include "tests/unit/registry/test_util.h"

namespace kvagent::registry {
namespace {

using testing::MakeShm;

std::string Message(const absl::Status& status) { return std::string(status.message()); }

PathPolicy Policy() {
  PathPolicy policy;
  policy.required_uid = geteuid();
  return policy;
}

TEST_CASE("OpenPath of a missing object is NOT_FOUND and names it") {
  auto shm = ShmMapping::OpenPath("/kvagent-test-does-not-exist", 0, 4096, "k.L0", Policy());
  REQUIRE(shm.status().code() == absl::StatusCode::kNotFound);
  CHECK_THAT(Message(shm.status()), Catch::Contains("/kvagent-test-does-not-exist"));
  CHECK_THAT(Message(shm.status()), Catch::Contains("k.L0"));
}

TEST_CASE("OpenPath of a too small object gives both sizes") {
  ShmMapping owner = MakeShm(8192);
  auto shm = ShmMapping::OpenPath(owner.name(), 4096, 8192, "v.L3", Policy());
  REQUIRE(shm.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(shm.status()), Catch::Contains("8192 bytes"));
  CHECK_THAT(Message(shm.status()), Catch::Contains("12288"));
  CHECK_THAT(Message(shm.status()), Catch::Contains("v.L3"));
  // offset + length overflowing uint64 is rejected, not wrapped.
  auto wrapped = ShmMapping::OpenPath(owner.name(), UINT64_MAX - 10, 100, "v.L3", Policy());
  CHECK(wrapped.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(wrapped.status()), Catch::Contains("overflow"));
}

TEST_CASE("OpenPath rejects zero length, relative names and paths outside /dev/shm") {
  ShmMapping owner = MakeShm(4096);
  CHECK(ShmMapping::OpenPath(owner.name(), 0, 0, "a", Policy()).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(ShmMapping::OpenPath("relative", 0, 1, "a", Policy()).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(ShmMapping::OpenPath("/etc/passwd", 0, 1, "a", Policy()).status().code() ==
        absl::StatusCode::kPermissionDenied);
}

TEST_CASE("Create makes a shared object that OpenPath sees, and unlinks it on destruction") {
  std::string name;
  {
    ShmMapping owner = MakeShm(3 * 4096);
    name = owner.name();
    REQUIRE(owner.length() == 3 * 4096);
    REQUIRE(owner.memory() != nullptr);
    std::memset(owner.data(), 0x5a, owner.length());
    auto view = ShmMapping::OpenPath(name, 4096, 4096, "view", Policy());
    REQUIRE(view.ok());
    CHECK(view->name().empty());  // only Create's mappings own a name
    CHECK(view->device() == owner.device());
    CHECK(view->inode() == owner.inode());
    CHECK(view->memory()->id() != owner.memory()->id());
    CHECK(static_cast<unsigned char*>(view->data())[0] == 0x5a);
    static_cast<unsigned char*>(view->data())[1] = 0x11;  // MAP_SHARED both ways
    CHECK(static_cast<unsigned char*>(owner.data())[4097] == 0x11);

    auto again = ShmMapping::Create(name, 4096);
    CHECK(again.status().code() == absl::StatusCode::kAlreadyExists);
  }
  CHECK(ShmMapping::OpenPath(name, 0, 1, "gone", Policy()).status().code() ==
        absl::StatusCode::kNotFound);
}

TEST_CASE("Create reports free bytes when /dev/shm has no room") {
  const std::string name = "/" + testing::UniqueName("huge");
  auto shm = ShmMapping::Create(name, uint64_t{1} << 62);
  REQUIRE(shm.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(Message(shm.status()), Catch::Contains("bytes free"));
  CHECK(ShmMapping::OpenPath(name, 0, 1, "x", Policy()).status().code() ==
        absl::StatusCode::kNotFound);
}

// What SetRetire's hook saw (this test's only).
std::vector<std::pair<void*, uint64_t>> g_retired;
bool g_retire_takes = false;
bool RecordRetire(void* base, uint64_t length) {
  g_retired.emplace_back(base, length);
  return g_retire_takes;
}

TEST_CASE("the retire hook is asked before a mapping is unmapped, and what it takes stays mapped") {
  ShmMapping::SetRetire(&RecordRetire);
  g_retired.clear();
  void* kept = nullptr;
  void* freed = nullptr;
  {
    g_retire_takes = true;
    ShmMapping taken = MakeShm(2 * 4096);
    kept = taken.data();
  }
  REQUIRE(g_retired.size() == 1);
  CHECK(g_retired[0] == std::make_pair(kept, uint64_t{2 * 4096}));
  unsigned char page = 0;
  CHECK(mincore(kept, 4096, &page) == 0);  // the hook owns it now
  munmap(kept, 2 * 4096);
  {
    g_retire_takes = false;
    ShmMapping refused = MakeShm(4096);
    freed = refused.data();
  }
  REQUIRE(g_retired.size() == 2);
  CHECK(g_retired[1].first == freed);
  CHECK(mincore(freed, 4096, &page) != 0);  // unmapped as before
  ShmMapping::SetRetire(nullptr);
  {
    ShmMapping plain = MakeShm(4096);
  }
  CHECK(g_retired.size() == 2);
}

TEST_CASE("Move transfers ownership") {
  ShmMapping a = MakeShm(4096);
  const std::string name = a.name();
  void* data = a.data();
  ShmMapping b(std::move(a));
  CHECK(a.data() == nullptr);
  CHECK(a.memory() == nullptr);
  CHECK(b.data() == data);
  ShmMapping c;
  c = std::move(b);
  CHECK(b.data() == nullptr);
  CHECK(c.name() == name);
  static_cast<char*>(c.data())[0] = 1;  // still mapped
  CHECK(ShmMapping::OpenPath(name, 0, 1, "x", Policy()).ok());  // not unlinked by moved-from ones
}

TEST_CASE("Map of a memfd with unaligned offsets maps the right bytes and keeps the object") {
  const size_t size = 3 * 4096 + 123;
  UniqueFd fd(memfd_create("pool", MFD_CLOEXEC));
  REQUIRE(fd.valid());
  std::string bytes(size, '\0');
  for (size_t i = 0; i < size; ++i) bytes[i] = static_cast<char>(i * 7 + 3);
  REQUIRE(write(fd.get(), bytes.data(), size) == static_cast<ssize_t>(size));
  auto object = MemoryObject::FromDescriptor(std::move(fd), "pool");
  REQUIRE(object.ok());
  std::weak_ptr<const MemoryObject> weak = *object;

  for (uint64_t offset :
       {uint64_t{0}, uint64_t{1}, uint64_t{4095}, uint64_t{4097}, uint64_t{8200}}) {
    const uint64_t length = size - offset;
    auto shm = ShmMapping::Map(*object, offset, length, "file");
    REQUIRE(shm.ok());
    CHECK(shm->offset() == offset);
    CHECK(shm->length() == length);
    CHECK(shm->memory() == *object);
    CHECK(shm->device() == (*object)->device());
    CHECK(shm->inode() == (*object)->inode());
    CHECK(std::memcmp(shm->data(), bytes.data() + offset, length) == 0);
  }
  auto held = ShmMapping::Map(*std::move(object), 4096, 100, "held");
  REQUIRE(held.ok());
  CHECK_FALSE(weak.expired());  // the mapping holds the object (and its descriptor) open
  held = ShmMapping();
  CHECK(weak.expired());
}

TEST_CASE("Map checks the size the object has now, not at open") {
  auto file = std::make_unique<testing::ScopedPath>("/dev/shm/" + testing::UniqueName("shrink"));
  UniqueFd fd(open(file->path().c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600));
  REQUIRE(ftruncate(fd.get(), 16384) == 0);
  auto object = MemoryObject::OpenPath(file->path(), Policy(), "s");
  REQUIRE(object.ok());
  CHECK((*object)->size() == 16384);
  CHECK_FALSE((*object)->sealed());
  REQUIRE(ftruncate(fd.get(), 4096) == 0);  // the engine shrinks it (not sealed)
  auto shm = ShmMapping::Map(*object, 4096, 8192, "s.L0");
  REQUIRE(shm.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(Message(shm.status()), Catch::Contains("region 's.L0'"));
  CHECK_THAT(Message(shm.status()), Catch::Contains("is 4096 bytes, smaller than offset 4096 + "
                                                    "length 8192 = 12288 bytes"));
  CHECK(ShmMapping::Map(nullptr, 0, 1, "n").status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(ShmMapping::Map(*object, 0, 0, "z").status().code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvagent::registry

namespace kvagent::registry {
namespace {

TEST_CASE("mappings of one object share one whole-object mapping until it breaks or is outgrown") {
  constexpr uint64_t kPage = 4096;
  UniqueFd fd(memfd_create("shared-pool", MFD_CLOEXEC));
  REQUIRE(fd.valid());
  REQUIRE(ftruncate(fd.get(), 16 * kPage) == 0);
  auto object = MemoryObject::FromDescriptor(UniqueFd(dup(fd.get())), "shared-pool");
  REQUIRE(object.ok());
  const size_t before = ShmMapping::shared_mappings();
  std::vector<ShmMapping> regions;
  for (uint64_t i = 0; i < 16; ++i) {
    auto mapping = ShmMapping::Map(*object, i * kPage, kPage, "item");
    REQUIRE(mapping.ok());
    regions.push_back(*std::move(mapping));
  }
  // One mapping for all sixteen: consecutive regions are consecutive addresses.
  CHECK(ShmMapping::shared_mappings() == before + 1);
  for (uint64_t i = 1; i < 16; ++i) {
    CHECK(static_cast<char*>(regions[i].data()) - static_cast<char*>(regions[0].data()) ==
          static_cast<std::ptrdiff_t>(i * kPage));
  }
  // Another descriptor of the same memfd (as a second engine handle would be) shares it too.
  auto other = MemoryObject::FromDescriptor(UniqueFd(dup(fd.get())), "same-pool");
  REQUIRE(other.ok());
  auto again = ShmMapping::Map(*other, 3 * kPage, 10, "again");
  REQUIRE(again.ok());
  CHECK(again->data() == static_cast<char*>(regions[3].data()));
  CHECK(again->memory() == *other);

  // Grown past the shared mapping: a new one for the new range, the old one stays.
  REQUIRE(ftruncate(fd.get(), 32 * kPage) == 0);
  auto grown = ShmMapping::Map(*object, 20 * kPage, kPage, "grown");
  REQUIRE(grown.ok());
  CHECK(ShmMapping::shared_mappings() == before + 2);

  // Broken (truncated under it): all its users are broken, and a new mapping is made.
  REQUIRE(ftruncate(fd.get(), 2 * kPage) == 0);
  const volatile char* lost = static_cast<const char*>(regions[15].data());
  CHECK(*lost == 0);
  CHECK(regions[0].broken());
  CHECK(regions[15].broken());
  CHECK(again->broken());
  auto fresh = ShmMapping::Map(*object, 0, kPage, "fresh");
  REQUIRE(fresh.ok());
  CHECK_FALSE(fresh->broken());
  CHECK(fresh->data() != regions[0].data());

  // Unmapped with the last user.
  regions.clear();
  *again = ShmMapping();
  *grown = ShmMapping();
  *fresh = ShmMapping();
  CHECK(ShmMapping::shared_mappings() == before);
}

}  // namespace
}  // namespace kvagent::registry

namespace kvagent::registry {
namespace {

// Waits up to 20 s for the map-warm thread to have nothing queued.
bool WarmingDrained() {
  for (int i = 0; i < 2000; ++i) {
    if (ShmMapping::warming().pages_queued == 0) return true;
    usleep(10000);
  }
  return false;
}

std::shared_ptr<const MemoryObject> Memfd(uint64_t bytes, const char* label) {
  UniqueFd fd(memfd_create(label, MFD_CLOEXEC));
  REQUIRE(fd.valid());
  REQUIRE(ftruncate(fd.get(), static_cast<off_t>(bytes)) == 0);
  auto object = MemoryObject::FromDescriptor(std::move(fd), label);
  REQUIRE(object.ok());
  return *object;
}

TEST_CASE("warming: off by default; on, each mapped range is read once per page in the background") {
  constexpr uint64_t kPage = 4096;
  REQUIRE(WarmingDrained());
  const auto before = ShmMapping::warming();
  auto object = Memfd(64 * kPage, "warm-off");
  {
    auto cold = ShmMapping::Map(object, 0, 64 * kPage, "cold");
    REQUIRE(cold.ok());
    CHECK(ShmMapping::warming().pages_touched == before.pages_touched);
    CHECK(ShmMapping::warming().pages_queued == 0);
  }

  ShmMapping::SetWarming(true);
  // 1,000 pages at an unaligned offset: pages 3..1003 of the object's 1,100, which holds
  // all its pages (an engine's pool it wrote).
  auto pool = Memfd(1100 * kPage, "warm-on");
  REQUIRE(fallocate(pool->fd(), 0, 0, 1100 * kPage) == 0);
  auto mapping = ShmMapping::Map(pool, 3 * kPage + 100, 1000 * kPage, "warm");
  REQUIRE(mapping.ok());
  // A sparse object: neither the mapping nor the warmer gives it pages (they would be
  // charged to this process's memory cgroup).
  auto sparse = Memfd(256 * kPage, "warm-sparse");
  auto sparse_mapping = ShmMapping::Map(sparse, 0, 256 * kPage, "sparse");
  REQUIRE(sparse_mapping.ok());
  // Held in runs, holes between and around them (pages 0-9, 20-29 and 63 of 64,
  // written as an engine writes its pool: mincore does not count fallocated shmem pages
  // it holds until they are written): the mapping's fault-in and the warmer take the
  // runs and leave every hole a hole.
  auto patchy = Memfd(64 * kPage, "warm-patchy");
  {
    void* engine = mmap(nullptr, 64 * kPage, PROT_READ | PROT_WRITE, MAP_SHARED, patchy->fd(), 0);
    REQUIRE(engine != MAP_FAILED);
    for (const auto& [first, count] : {std::pair{0, 10}, {20, 10}, {63, 1}}) {
      std::memset(static_cast<char*>(engine) + first * kPage, 0, count * kPage);
    }
    REQUIRE(munmap(engine, 64 * kPage) == 0);
  }
  auto patchy_mapping = ShmMapping::Map(patchy, 0, 64 * kPage, "patchy");
  REQUIRE(patchy_mapping.ok());
  REQUIRE(WarmingDrained());
  struct stat st {};
  REQUIRE(fstat(patchy->fd(), &st) == 0);
  CHECK(static_cast<uint64_t>(st.st_blocks) * 512 == 21 * kPage);
  REQUIRE(fstat(sparse->fd(), &st) == 0);
  CHECK(st.st_blocks == 0);
  REQUIRE(fstat(pool->fd(), &st) == 0);
  CHECK(static_cast<uint64_t>(st.st_blocks) * 512 == 1100 * kPage);
  const auto after = ShmMapping::warming();
  CHECK(after.pages_touched - before.pages_touched == 1001 + 256 + 64);
  CHECK(after.ranges_skipped == before.ranges_skipped);
  // Nothing the warmer did changed a byte.
  const auto* bytes = static_cast<const unsigned char*>(mapping->data());
  CHECK(std::all_of(bytes, bytes + 1000 * kPage, [](unsigned char b) { return b == 0; }));
  CHECK_FALSE(mapping->broken());
  ShmMapping::SetWarming(false);
}

TEST_CASE("warming: a range released before its turn is skipped; one truncated under it is read where it still has pages") {
  constexpr uint64_t kPage = 4096;
  REQUIRE(WarmingDrained());
  ShmMapping::SetWarming(true);
  ShmMapping::HoldWarmingForTest(true);
  const auto before = ShmMapping::warming();

  // Released: the job holds only a weak reference, so the memory is unmapped now.
  const size_t mappings = ShmMapping::shared_mappings();
  {
    auto gone = ShmMapping::Map(Memfd(512 * kPage, "warm-gone"), 0, 512 * kPage, "gone");
    REQUIRE(gone.ok());
    CHECK(ShmMapping::warming().pages_queued == before.pages_queued + 512);
  }
  CHECK(ShmMapping::shared_mappings() == mappings);

  // Truncated (an unsealed object an engine shrinks): 4 MiB mapped, then cut to one page.
  UniqueFd fd(memfd_create("warm-cut", MFD_CLOEXEC));
  REQUIRE(fd.valid());
  REQUIRE(ftruncate(fd.get(), 1024 * kPage) == 0);
  auto object = MemoryObject::FromDescriptor(UniqueFd(dup(fd.get())), "warm-cut");
  REQUIRE(object.ok());
  REQUIRE(fallocate(fd.get(), 0, 0, 1024 * kPage) == 0);  // its pages held
  auto cut = ShmMapping::Map(*object, 0, 1024 * kPage, "cut");
  REQUIRE(cut.ok());
  REQUIRE(ftruncate(fd.get(), kPage) == 0);

  ShmMapping::HoldWarmingForTest(false);
  REQUIRE(WarmingDrained());
  const auto after = ShmMapping::warming();
  // The released range: skipped whole. The cut one: gone past its first page, so read
  // only there (the warmer reads the pages the object holds; a read past its end would
  // SIGBUS, which the fault guard would catch and mark the mapping broken).
  CHECK(after.ranges_skipped - before.ranges_skipped == 1);
  CHECK(after.pages_touched - before.pages_touched == 1024);
  CHECK_FALSE(cut->broken());
  ShmMapping::SetWarming(false);
}

}  // namespace
}  // namespace kvagent::registry
