// MemoryObject: what the agent accepts as shared memory, by descriptor and by name,
// and the attacks on registration by name (paths outside the shm directories, "..",
// symbolic links, FIFOs, other users' files, hostile names).
#include "registry/memory_object.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "base/unique_fd.h"
#include "catch2/catch.hpp"
#include "fmt/format.h"
#include "tests/unit/registry/test_util.h"

namespace kvagent::registry {
namespace {

using absl::StatusCode;
using testing::ScopedPath;
using testing::UniqueName;

std::string Message(const absl::Status& status) { return std::string(status.message()); }

// A regular file of `bytes` in /dev/shm, made by the test (so owned by its uid).
std::unique_ptr<ScopedPath> ShmFile(uint64_t bytes, const std::string& suffix = "") {
  auto path = std::make_unique<ScopedPath>("/dev/shm/" + UniqueName(suffix));
  UniqueFd fd(open(path->path().c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600));
  REQUIRE(fd.valid());
  REQUIRE(ftruncate(fd.get(), static_cast<off_t>(bytes)) == 0);
  return path;
}

PathPolicy Policy() {
  PathPolicy policy;
  policy.required_uid = geteuid();
  return policy;
}

bool OnSharedMemory(int fd) {
  struct statfs fs {};
  return fstatfs(fd, &fs) == 0 && (static_cast<unsigned long>(fs.f_type) == TMPFS_MAGIC ||
                                   static_cast<unsigned long>(fs.f_type) == HUGETLBFS_MAGIC);
}

TEST_CASE("CreateMemfd allocates a sealed memfd that cannot shrink or grow") {
  auto object = MemoryObject::CreateMemfd("kv pool", 3 * 4096);
  REQUIRE(object.ok());
  const MemoryObject& memory = **object;
  CHECK(memory.kind() == "memfd");
  CHECK(memory.sealed());
  CHECK(memory.size() == 3 * 4096);
  CHECK(memory.label() == "kv pool");
  CHECK(memory.page_alignment() == static_cast<uint64_t>(sysconf(_SC_PAGESIZE)));
  CHECK(memory.id() >= 1);
  CHECK(memory.inode() != 0);
  CHECK(fcntl(memory.fd(), F_GETFD) & FD_CLOEXEC);

  errno = 0;
  CHECK(ftruncate(memory.fd(), 4096) == -1);
  CHECK(errno == EPERM);
  errno = 0;
  CHECK(ftruncate(memory.fd(), 4 * 4096) == -1);
  CHECK(errno == EPERM);
  CHECK(fcntl(memory.fd(), F_ADD_SEALS, F_SEAL_WRITE) == -1);  // F_SEAL_SEAL: no more seals
  auto size = memory.CurrentSize("x");
  REQUIRE(size.ok());
  CHECK(*size == 3 * 4096);

  auto other = MemoryObject::CreateMemfd("other", 4096);
  REQUIRE(other.ok());
  CHECK((*other)->id() != memory.id());
}

TEST_CASE("CreateMemfd refuses 0 bytes and more than the memory available") {
  auto zero = MemoryObject::CreateMemfd("zero", 0);
  CHECK(zero.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(Message(zero.status()), Catch::Contains("memory 'zero'"));

  const uint64_t huge = uint64_t{1} << 50;  // 1 PiB
  auto big = MemoryObject::CreateMemfd("big", huge);
  REQUIRE(big.status().code() == StatusCode::kResourceExhausted);
  CHECK_THAT(Message(big.status()), Catch::Contains(std::to_string(huge) + " bytes"));
  CHECK_THAT(Message(big.status()), Catch::Contains("bytes available"));
  CHECK_THAT(Message(big.status()), Catch::Contains("ask for less"));
  CHECK(MemoryObject::CreateMemfd("max", UINT64_MAX).status().code() ==
        StatusCode::kResourceExhausted);
}

TEST_CASE("FromDescriptor accepts memfds and POSIX shm objects opened read-write") {
  UniqueFd memfd(memfd_create("plain", MFD_CLOEXEC));
  REQUIRE(memfd.valid());
  REQUIRE(ftruncate(memfd.get(), 8192) == 0);
  auto object = MemoryObject::FromDescriptor(std::move(memfd), "engine pool");
  REQUIRE(object.ok());
  CHECK((*object)->kind() == "memfd");
  CHECK_FALSE((*object)->sealed());
  CHECK((*object)->size() == 8192);

  auto file = ShmFile(4096);
  UniqueFd fd(open(file->path().c_str(), O_RDWR | O_CLOEXEC));
  REQUIRE(fd.valid());
  struct stat st {};
  REQUIRE(fstat(fd.get(), &st) == 0);
  auto shm = MemoryObject::FromDescriptor(std::move(fd), "shm");
  REQUIRE(shm.ok());
  CHECK((*shm)->kind() == "tmpfs");
  CHECK((*shm)->device() == st.st_dev);
  CHECK((*shm)->inode() == st.st_ino);
}

TEST_CASE("FromDescriptor refuses what is not read-write shared memory, saying why") {
  SECTION("a regular file on the disk") {
    const char* tmp = std::getenv("TEST_TMPDIR");
    REQUIRE(tmp != nullptr);
    ScopedPath path(std::string(tmp) + "/" + UniqueName("disk"));
    UniqueFd fd(open(path.path().c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600));
    REQUIRE(fd.valid());
    REQUIRE(ftruncate(fd.get(), 4096) == 0);
    if (OnSharedMemory(fd.get())) fd.reset(open("/proc/self/exe", O_RDONLY | O_CLOEXEC));
    if (!fd.valid() || OnSharedMemory(fd.get())) {
      WARN("skipped: neither TEST_TMPDIR nor the test binary is on a disk filesystem here");
      return;
    }
    auto refused = MemoryObject::FromDescriptor(std::move(fd), "disk");
    REQUIRE(refused.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(refused.status()), Catch::StartsWith("memory 'disk': a regular file on "));
    CHECK_THAT(Message(refused.status()), Catch::Contains("not shared memory"));
    CHECK_THAT(Message(refused.status()),
               Catch::Contains("pass a memfd, a POSIX shm object or a hugetlbfs file opened "
                               "O_RDWR"));
  }
  SECTION("opened read-only") {
    auto file = ShmFile(4096);
    auto refused = MemoryObject::FromDescriptor(
        UniqueFd(open(file->path().c_str(), O_RDONLY | O_CLOEXEC)), "ro");
    REQUIRE(refused.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(refused.status()), Catch::Contains("memory 'ro': opened read-only"));
    CHECK_THAT(Message(refused.status()), Catch::Contains("O_RDWR"));
  }
  SECTION("an O_PATH descriptor") {
    auto file = ShmFile(4096);
    auto refused = MemoryObject::FromDescriptor(
        UniqueFd(open(file->path().c_str(), O_PATH | O_CLOEXEC)), "path");
    CHECK(refused.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(refused.status()), Catch::Contains("O_PATH"));
  }
  SECTION("a directory, a pipe, no descriptor") {
    auto dir = MemoryObject::FromDescriptor(UniqueFd(open("/dev/shm", O_RDONLY | O_CLOEXEC)), "d");
    CHECK(dir.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(dir.status()), Catch::Contains("a directory, not a regular file"));
    int fds[2];
    REQUIRE(pipe(fds) == 0);
    UniqueFd reader(fds[0]);
    auto fifo = MemoryObject::FromDescriptor(UniqueFd(fds[1]), "p");
    CHECK(fifo.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(fifo.status()), Catch::Contains("a FIFO"));
    CHECK(MemoryObject::FromDescriptor(UniqueFd(), "none").status().code() ==
          StatusCode::kInvalidArgument);
  }
  SECTION("empty, or sealed against writes") {
    UniqueFd empty(memfd_create("empty", MFD_CLOEXEC));
    auto refused = MemoryObject::FromDescriptor(std::move(empty), "empty");
    CHECK(refused.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(refused.status()), Catch::Contains("empty (0 bytes)"));

    UniqueFd sealed(memfd_create("sealed", MFD_CLOEXEC | MFD_ALLOW_SEALING));
    REQUIRE(ftruncate(sealed.get(), 4096) == 0);
    REQUIRE(fcntl(sealed.get(), F_ADD_SEALS, F_SEAL_WRITE) == 0);
    auto write_sealed = MemoryObject::FromDescriptor(std::move(sealed), "sealed");
    CHECK(write_sealed.status().code() == StatusCode::kFailedPrecondition);
    CHECK_THAT(Message(write_sealed.status()), Catch::Contains("F_SEAL_WRITE"));
  }
  SECTION("a hostile label is escaped and bounded") {
    auto refused = MemoryObject::FromDescriptor(UniqueFd(), "evil\nlabel" + std::string(5000, 'x'));
    CHECK_THAT(Message(refused.status()), Catch::Contains("evil\\x0alabel"));
    CHECK(Message(refused.status()).size() < 400);
  }
}

TEST_CASE("OpenPath opens a POSIX shm name or a path under /dev/shm owned by the caller") {
  auto file = ShmFile(8192);
  const std::string base = file->path().substr(std::string("/dev/shm").size());  // "/kvagent-..."
  auto by_shm_name = MemoryObject::OpenPath(base, Policy(), "k.L0");
  REQUIRE(by_shm_name.ok());
  CHECK((*by_shm_name)->kind() == "tmpfs");
  CHECK((*by_shm_name)->size() == 8192);
  CHECK((*by_shm_name)->label() == base);
  auto by_path = MemoryObject::OpenPath(file->path(), Policy(), "k.L0");
  REQUIRE(by_path.ok());
  CHECK((*by_path)->inode() == (*by_shm_name)->inode());
  CHECK((*by_path)->id() != (*by_shm_name)->id());

  // A subdirectory of an allowed directory is fine when it is a real directory.
  ScopedPath dir("/dev/shm/" + UniqueName("dir"));
  REQUIRE(mkdir(dir.path().c_str(), 0700) == 0);
  ScopedPath nested(dir.path() + "/pool");
  UniqueFd fd(open(nested.path().c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600));
  REQUIRE(ftruncate(fd.get(), 4096) == 0);
  CHECK(MemoryObject::OpenPath(nested.path(), Policy(), "n").ok());
}

TEST_CASE("OpenPath refuses paths outside the allowed directories and odd names") {
  struct Case {
    std::string name;
    StatusCode code;
    std::string cause;
  };
  const std::vector<Case> cases = {
      {"/etc/shadow", StatusCode::kPermissionDenied, "is not under an allowed directory"},
      {"/etc/passwd", StatusCode::kPermissionDenied, "is not under an allowed directory"},
      {"/dev/shm/../etc/passwd", StatusCode::kInvalidArgument, "has a '..' component"},
      {"/dev/shm/./x", StatusCode::kInvalidArgument, "has a '.' component"},
      {"/..", StatusCode::kInvalidArgument, "has a '..' component"},  // /dev/shm/..
      {"//dev/shm/x", StatusCode::kInvalidArgument, "empty component"},
      {"/dev/shm//x", StatusCode::kInvalidArgument, "empty component"},
      {"/dev/shm/x/", StatusCode::kInvalidArgument, "empty component"},
      {"/dev/shm", StatusCode::kPermissionDenied, "is not under an allowed directory"},
      {"/dev/shmx/pool", StatusCode::kPermissionDenied, "is not under an allowed directory"},
      {"/dev/hugepagesfoo/x", StatusCode::kPermissionDenied, "is not under an allowed directory"},
      {"relative", StatusCode::kInvalidArgument, "neither a POSIX shm name"},
      {"", StatusCode::kInvalidArgument, "is empty"},
      {std::string("/kv\0/../../etc/shadow", 22), StatusCode::kInvalidArgument,
       "NUL or control character"},
      {"/kv\nforged", StatusCode::kInvalidArgument, "NUL or control character"},
  };
  for (const Case& c : cases) {
    INFO("name: " << c.name);
    auto refused = MemoryObject::OpenPath(c.name, Policy(), "k.L0");
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == c.code);
    CHECK_THAT(Message(refused.status()), Catch::StartsWith("region 'k.L0': shm name '"));
    CHECK_THAT(Message(refused.status()), Catch::Contains(c.cause));
    CHECK_THAT(Message(refused.status()), Catch::Contains("descriptor"));  // the fix
    CHECK(Message(refused.status()).find('\n') == std::string::npos);
    CHECK(Message(refused.status()).find('\0') == std::string::npos);
  }
  auto shadow = MemoryObject::OpenPath("/etc/shadow", Policy(), "k.L0");
  CHECK_THAT(Message(shadow.status()), Catch::Contains("'/etc/shadow'"));
  CHECK_THAT(Message(shadow.status()), Catch::Contains("/dev/shm, /dev/hugepages"));
  auto newline = MemoryObject::OpenPath("/kv\nforged", Policy(), "k.L0");
  CHECK_THAT(Message(newline.status()), Catch::Contains("'/kv\\x0aforged'"));

  // A 10 KB name: the message stays short.
  const std::string long_name = "/dev/shm/" + std::string(10240, 'a');
  auto too_long = MemoryObject::OpenPath(long_name, Policy(), "k.L0");
  REQUIRE(too_long.status().code() == StatusCode::kInvalidArgument);
  CHECK(Message(too_long.status()).size() < 600);
  CHECK_THAT(Message(too_long.status()), Catch::Contains("(10249 bytes)"));

  // A missing object is NOT_FOUND, with the fix.
  auto missing = MemoryObject::OpenPath("/" + UniqueName("missing"), Policy(), "k.L0");
  CHECK(missing.status().code() == StatusCode::kNotFound);
  CHECK_THAT(Message(missing.status()), Catch::Contains("does not exist"));
  CHECK_THAT(Message(missing.status()), Catch::Contains("create it first"));
  auto missing_dir =
      MemoryObject::OpenPath("/dev/shm/" + UniqueName("nodir") + "/x", Policy(), "m");
  CHECK(missing_dir.status().code() == StatusCode::kNotFound);
}

TEST_CASE("OpenPath never follows a symbolic link") {
  auto target = ShmFile(4096, "target");
  SECTION("to a root-only file and to a regular shm file") {
    for (const std::string& to : {std::string("/etc/shadow"), target->path()}) {
      INFO("link to " << to);
      ScopedPath link("/dev/shm/" + UniqueName("link"));
      REQUIRE(symlink(to.c_str(), link.path().c_str()) == 0);
      auto refused = MemoryObject::OpenPath(link.path(), Policy(), "k.L0");
      REQUIRE(refused.status().code() == StatusCode::kPermissionDenied);
      CHECK_THAT(Message(refused.status()), Catch::Contains("symbolic link '" + link.path() + "'"));
      CHECK_THAT(Message(refused.status()), Catch::Contains("descriptor"));
      // Also as a POSIX shm name.
      const std::string shm_name = link.path().substr(std::string("/dev/shm").size());
      CHECK(MemoryObject::OpenPath(shm_name, Policy(), "k.L0").status().code() ==
            StatusCode::kPermissionDenied);
    }
  }
  SECTION("a link to a directory on the way") {
    ScopedPath real("/dev/shm/" + UniqueName("real"));
    REQUIRE(mkdir(real.path().c_str(), 0700) == 0);
    ScopedPath file(real.path() + "/pool");
    UniqueFd fd(open(file.path().c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600));
    REQUIRE(ftruncate(fd.get(), 4096) == 0);
    ScopedPath link("/dev/shm/" + UniqueName("dirlink"));
    REQUIRE(symlink(real.path().c_str(), link.path().c_str()) == 0);
    auto through = MemoryObject::OpenPath(link.path() + "/pool", Policy(), "k.L0");
    REQUIRE(through.status().code() == StatusCode::kPermissionDenied);
    CHECK_THAT(Message(through.status()), Catch::Contains("symbolic link '" + link.path() + "'"));
    // An allowed directory that is itself a link is not a real directory either.
    PathPolicy policy = Policy();
    policy.allowed_dirs = {link.path()};
    auto allowed_link = MemoryObject::OpenPath(link.path() + "/pool", policy, "k.L0");
    REQUIRE(allowed_link.status().code() == StatusCode::kPermissionDenied);
    CHECK_THAT(Message(allowed_link.status()), Catch::Contains("symbolic link"));
    // The same file by its real path is fine.
    CHECK(MemoryObject::OpenPath(file.path(), Policy(), "k.L0").ok());
  }
}

TEST_CASE("OpenPath refuses directories, FIFOs and non-shared-memory files, never hanging") {
  ScopedPath dir("/dev/shm/" + UniqueName("adir"));
  REQUIRE(mkdir(dir.path().c_str(), 0700) == 0);
  auto directory = MemoryObject::OpenPath(dir.path(), Policy(), "k.L0");
  REQUIRE(directory.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(Message(directory.status()), Catch::Contains("a directory, not a regular file"));

  ScopedPath fifo("/dev/shm/" + UniqueName("fifo"));
  REQUIRE(mkfifo(fifo.path().c_str(), 0600) == 0);
  auto pipe = MemoryObject::OpenPath(fifo.path(), Policy(), "k.L0");  // would block if opened
  REQUIRE(pipe.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(Message(pipe.status()), Catch::Contains("a FIFO, not a regular file"));

  ScopedPath file_as_dir("/dev/shm/" + UniqueName("notdir"));
  UniqueFd fd(open(file_as_dir.path().c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600));
  auto through_file = MemoryObject::OpenPath(file_as_dir.path() + "/x", Policy(), "k.L0");
  CHECK(through_file.status().code() == StatusCode::kInvalidArgument);
  CHECK_THAT(Message(through_file.status()), Catch::Contains("not a directory"));

  auto empty = ShmFile(0);
  CHECK(MemoryObject::OpenPath(empty->path(), Policy(), "k.L0").status().code() ==
        StatusCode::kInvalidArgument);

  // An operator who allows a directory on the disk still gets shared memory only.
  const char* tmp = std::getenv("TEST_TMPDIR");
  REQUIRE(tmp != nullptr);
  char real_tmp[PATH_MAX];
  REQUIRE(realpath(tmp, real_tmp) != nullptr);
  ScopedPath disk(std::string(real_tmp) + "/" + UniqueName("disk"));
  UniqueFd disk_fd(open(disk.path().c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600));
  REQUIRE(ftruncate(disk_fd.get(), 4096) == 0);
  if (!OnSharedMemory(disk_fd.get())) {
    PathPolicy policy = Policy();
    policy.allowed_dirs = {real_tmp};
    auto on_disk = MemoryObject::OpenPath(disk.path(), policy, "k.L0");
    REQUIRE(on_disk.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(Message(on_disk.status()), Catch::Contains("not shared memory"));
  }
}

TEST_CASE("OpenPath refuses a file another uid owns") {
  auto file = ShmFile(4096, "foreign");
  // The test's own file, for a caller of another uid: refused, with both uids.
  PathPolicy stranger;
  stranger.required_uid = geteuid() == 65534 ? 65533 : 65534;
  auto not_theirs = MemoryObject::OpenPath(file->path(), stranger, "k.L0");
  REQUIRE(not_theirs.status().code() == StatusCode::kPermissionDenied);
  CHECK_THAT(Message(not_theirs.status()),
             Catch::Contains(fmt::format("is owned by uid {}, not by the caller (uid {})",
                                         geteuid(), *stranger.required_uid)));
  CHECK_THAT(Message(not_theirs.status()), Catch::Contains("register memory you own, or pass a "
                                                           "descriptor"));

  // A file chowned away from root, for a root caller (needs root and a mapped uid 65534:
  // Bazel's sandbox maps only the test's own uid).
  if (geteuid() != 0 || chown(file->path().c_str(), 65534, 65534) != 0) {
    WARN(
        "skipped the chown part: cannot chown a test file to uid 65534 here (not root, or "
        "uid 65534 unmapped, as in Bazel's sandbox)");
    return;
  }
  PathPolicy root = Policy();
  root.required_uid = 0;
  auto refused = MemoryObject::OpenPath(file->path(), root, "k.L0");
  REQUIRE(refused.status().code() == StatusCode::kPermissionDenied);
  CHECK_THAT(Message(refused.status()),
             Catch::Contains("is owned by uid 65534, not by the caller (uid 0)"));
  // The owner may; and a policy without an owner rule (the agent's own use) may.
  PathPolicy nobody = Policy();
  nobody.required_uid = 65534;
  CHECK(MemoryObject::OpenPath(file->path(), nobody, "k.L0").ok());
  PathPolicy any;
  CHECK(MemoryObject::OpenPath(file->path(), any, "k.L0").ok());
}

}  // namespace
}  // namespace kvagent::registry
