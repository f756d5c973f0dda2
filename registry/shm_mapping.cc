#include "registry/shm_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "fmt/format.h"

namespace kvagent::registry {
namespace {

constexpr long kHugetlbfsMagic = 0x958458f6;  // linux/magic.h HUGETLBFS_MAGIC

// "/x" is a POSIX shm name (shm_open); any other absolute path is a file.
bool IsShmName(const std::string& name) {
  return name.size() > 1 && name[0] == '/' && name.find('/', 1) == std::string::npos;
}

absl::Status OpenError(int err, std::string_view entry, const std::string& name) {
  std::string cause = std::strerror(err);
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(fmt::format(
          "region '{}': shm object '{}' does not exist ({}); create it first (shm_open, "
          "a file under /dev/shm, or AllocateSharedMemory) or fix the name",
          entry, name, cause));
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(fmt::format(
          "region '{}': cannot open shm object '{}' read-write ({}); run the agent as "
          "the engine's user or make the object readable and writable by it",
          entry, name, cause));
    default:
      return absl::InternalError(fmt::format(
          "region '{}': cannot open shm object '{}' ({}); check the name and the object",
          entry, name, cause));
  }
}

uint64_t AlignDown(uint64_t value, uint64_t alignment) { return value - value % alignment; }

}  // namespace

absl::StatusOr<ShmMapping> ShmMapping::Open(const std::string& name, uint64_t offset,
                                           uint64_t length, std::string_view entry) {
  if (length == 0) {
    return absl::InvalidArgumentError(fmt::format(
        "region '{}': length is 0; give the region's size in bytes", entry));
  }
  if (name.empty() || name[0] != '/') {
    return absl::InvalidArgumentError(fmt::format(
        "region '{}': shm name '{}' is neither a POSIX shm name (\"/x\") nor an absolute "
        "path; pass \"/name\" or a /dev/shm or hugetlbfs file path",
        entry, name));
  }
  int fd = IsShmName(name) ? shm_open(name.c_str(), O_RDWR, 0)
                           : open(name.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return OpenError(errno, entry, name);

  struct stat st {};
  if (fstat(fd, &st) != 0) {
    int err = errno;
    close(fd);
    return OpenError(err, entry, name);
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  uint64_t end = 0;
  if (__builtin_add_overflow(offset, length, &end) || end > size) {
    close(fd);
    return absl::InvalidArgumentError(fmt::format(
        "region '{}': shm object '{}' is {} bytes, smaller than offset {} + length {} = "
        "{} bytes; grow the object or fix offset/length",
        entry, name, size, offset, length,
        end < offset ? std::string("overflow") : std::to_string(end)));
  }

  // mmap offsets must be page aligned (huge-page aligned on hugetlbfs).
  uint64_t alignment = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  struct statfs fs {};
  if (fstatfs(fd, &fs) == 0 && static_cast<long>(fs.f_type) == kHugetlbfsMagic) {
    alignment = static_cast<uint64_t>(fs.f_bsize);
  }
  const uint64_t map_offset = AlignDown(offset, alignment);
  const uint64_t delta = offset - map_offset;
  uint64_t map_length = delta + length;
  map_length = AlignDown(map_length + alignment - 1, alignment);

  // MAP_POPULATE: fault the pages in now, at registration, not in the transfer path.
  void* base = mmap(nullptr, map_length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                    static_cast<off_t>(map_offset));
  int err = errno;
  close(fd);  // the mapping keeps the object alive
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(fmt::format(
        "region '{}': mmap of {} bytes at offset {} of '{}' failed ({}); check the "
        "address-space limit (ulimit -v) and vm.max_map_count",
        entry, map_length, map_offset, name, std::strerror(err)));
  }

  ShmMapping mapping;
  mapping.name_ = name;
  mapping.map_base_ = base;
  mapping.map_length_ = map_length;
  mapping.data_ = static_cast<char*>(base) + delta;
  mapping.length_ = length;
  mapping.offset_ = offset;
  mapping.device_ = st.st_dev;
  mapping.inode_ = st.st_ino;
  return mapping;
}

absl::StatusOr<ShmMapping> ShmMapping::Create(const std::string& name, uint64_t bytes) {
  if (!IsShmName(name)) {
    return absl::InvalidArgumentError(fmt::format(
        "shm object '{}': not a POSIX shm name; use \"/name\" with no other '/'", name));
  }
  if (bytes == 0) {
    return absl::InvalidArgumentError(
        fmt::format("shm object '{}': size is 0; ask for at least one byte", name));
  }
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    int err = errno;
    if (err == EEXIST) {
      return absl::AlreadyExistsError(fmt::format(
          "shm object '{}': already exists; pick another name or remove /dev/shm{}", name,
          name));
    }
    return absl::InternalError(fmt::format(
        "shm object '{}': shm_open(O_CREAT) failed ({}); check that /dev/shm is mounted "
        "and writable",
        name, std::strerror(err)));
  }
  auto fail_unlink = [&](absl::Status status) {
    close(fd);
    shm_unlink(name.c_str());
    return status;
  };
  auto no_room = [&](const char* cause) {
    struct statvfs vfs {};
    uint64_t free_bytes = 0;
    if (statvfs("/dev/shm", &vfs) == 0) {
      free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    }
    return absl::ResourceExhaustedError(fmt::format(
        "shm object '{}': cannot size it to {} bytes ({}); /dev/shm has {} bytes free; "
        "free space there or enlarge it (mount -o remount,size=... /dev/shm, or the "
        "container's shm size)",
        name, bytes, cause, free_bytes));
  };
  // tmpfs accepts a sparse ftruncate beyond its free space and SIGBUSes on first
  // touch; check the room first so the failure is a status, not a crash later.
  struct statvfs vfs {};
  if (statvfs("/dev/shm", &vfs) == 0 &&
      bytes > static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize) {
    return fail_unlink(no_room("not enough free space"));
  }
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    return fail_unlink(no_room(std::strerror(errno)));
  }
  struct stat st {};
  fstat(fd, &st);
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    int err = errno;
    return fail_unlink(absl::ResourceExhaustedError(fmt::format(
        "shm object '{}': mmap of {} bytes failed ({}); check ulimit -v and "
        "vm.max_map_count",
        name, bytes, std::strerror(err))));
  }
  close(fd);

  ShmMapping mapping;
  mapping.name_ = name;
  mapping.map_base_ = base;
  mapping.map_length_ = bytes;
  mapping.data_ = base;
  mapping.length_ = bytes;
  mapping.device_ = st.st_dev;
  mapping.inode_ = st.st_ino;
  mapping.owner_ = true;
  return mapping;
}

ShmMapping::ShmMapping(ShmMapping&& other) noexcept { *this = std::move(other); }

ShmMapping& ShmMapping::operator=(ShmMapping&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    map_base_ = std::exchange(other.map_base_, nullptr);
    map_length_ = std::exchange(other.map_length_, 0);
    data_ = std::exchange(other.data_, nullptr);
    length_ = std::exchange(other.length_, 0);
    offset_ = std::exchange(other.offset_, 0);
    device_ = std::exchange(other.device_, 0);
    inode_ = std::exchange(other.inode_, 0);
    owner_ = std::exchange(other.owner_, false);
    other.name_.clear();
  }
  return *this;
}

ShmMapping::~ShmMapping() { Reset(); }

void ShmMapping::Reset() {
  if (map_base_ != nullptr) munmap(map_base_, map_length_);
  if (owner_) shm_unlink(name_.c_str());
  name_.clear();
  map_base_ = data_ = nullptr;
  map_length_ = length_ = offset_ = 0;
  device_ = 0;
  inode_ = 0;
  owner_ = false;
}

}  // namespace kvagent::registry
