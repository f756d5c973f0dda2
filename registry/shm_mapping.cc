#include "registry/shm_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "fmt/format.h"
#include "transport/base/status_macros.h"

namespace kvagent::registry {
namespace {

// "/x" is a POSIX shm name (shm_open).
bool IsShmName(const std::string& name) {
  return name.size() > 1 && name[0] == '/' && name.find('/', 1) == std::string::npos;
}

uint64_t AlignDown(uint64_t value, uint64_t alignment) { return value - value % alignment; }

}  // namespace

absl::StatusOr<ShmMapping> ShmMapping::Map(std::shared_ptr<const MemoryObject> object,
                                           uint64_t offset, uint64_t length,
                                           std::string_view entry) {
  return MapRange(std::move(object), offset, length, entry, /*populate=*/true);
}

absl::StatusOr<ShmMapping> ShmMapping::MapRange(std::shared_ptr<const MemoryObject> object,
                                                uint64_t offset, uint64_t length,
                                                std::string_view entry, bool populate) {
  if (object == nullptr) {
    return absl::InvalidArgumentError(
        fmt::format("region '{}': no memory object to map; share the memory first", entry));
  }
  if (length == 0) {
    return absl::InvalidArgumentError(
        fmt::format("region '{}': length is 0; give the region's size in bytes", entry));
  }
  // The size now, not at open: an unsealed object may have shrunk since.
  ASSIGN_OR_RETURN(const uint64_t size, object->CurrentSize(entry));
  uint64_t end = 0;
  if (__builtin_add_overflow(offset, length, &end) || end > size) {
    return absl::InvalidArgumentError(
        fmt::format("region '{}': memory '{}' is {} bytes, smaller than offset {} + length {} = {} "
                    "bytes; grow the object or fix offset/length",
                    entry, object->label(), size, offset, length,
                    end < offset ? std::string("overflow") : std::to_string(end)));
  }

  // mmap offsets must be page aligned (huge-page aligned on hugetlbfs).
  const uint64_t alignment = object->page_alignment();
  const uint64_t map_offset = AlignDown(offset, alignment);
  const uint64_t delta = offset - map_offset;
  const uint64_t map_length = AlignDown(delta + length + alignment - 1, alignment);

  void* base =
      mmap(nullptr, map_length, PROT_READ | PROT_WRITE, MAP_SHARED | (populate ? MAP_POPULATE : 0),
           object->fd(), static_cast<off_t>(map_offset));
  if (base == MAP_FAILED) {
    const int err = errno;
    if (err == EACCES || err == EPERM) {
      return absl::FailedPreconditionError(fmt::format(
          "region '{}': memory '{}' cannot be mapped read-write ({}); share memory opened "
          "O_RDWR and not sealed against writes",
          entry, object->label(), std::strerror(err)));
    }
    return absl::ResourceExhaustedError(fmt::format(
        "region '{}': mmap of {} bytes at offset {} of memory '{}' failed ({}); check the "
        "address-space limit (ulimit -v), vm.max_map_count and, for hugetlbfs, free huge "
        "pages",
        entry, map_length, map_offset, object->label(), std::strerror(err)));
  }

  auto guard = FaultGuard::Guard(base, map_length, alignment, entry);
  if (!guard.ok()) {
    munmap(base, map_length);
    return guard.status();
  }

  ShmMapping mapping;
  mapping.guard_ = *std::move(guard);
  mapping.memory_ = std::move(object);
  mapping.map_base_ = base;
  mapping.map_length_ = map_length;
  mapping.data_ = static_cast<char*>(base) + delta;
  mapping.length_ = length;
  mapping.offset_ = offset;
  return mapping;
}

absl::StatusOr<ShmMapping> ShmMapping::OpenPath(const std::string& name, uint64_t offset,
                                                uint64_t length, std::string_view entry,
                                                const PathPolicy& policy) {
  if (length == 0) {
    return absl::InvalidArgumentError(
        fmt::format("region '{}': length is 0; give the region's size in bytes", entry));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<const MemoryObject> object,
                   MemoryObject::OpenPath(name, policy, entry));
  return Map(std::move(object), offset, length, entry);
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
  UniqueFd fd(shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600));
  if (!fd.valid()) {
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
    fd.reset();
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
  if (ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    return fail_unlink(no_room(std::strerror(errno)));
  }
  auto object = MemoryObject::FromDescriptor(std::move(fd), name);
  if (!object.ok()) return fail_unlink(object.status());
  // Not populated: the creator touches the pages it uses.
  auto mapping = MapRange(*std::move(object), 0, bytes, name, /*populate=*/false);
  if (!mapping.ok()) return fail_unlink(mapping.status());
  mapping->name_ = name;
  mapping->owner_ = true;
  return mapping;
}

ShmMapping::ShmMapping(ShmMapping&& other) noexcept { *this = std::move(other); }

ShmMapping& ShmMapping::operator=(ShmMapping&& other) noexcept {
  if (this != &other) {
    Reset();
    name_ = std::move(other.name_);
    memory_ = std::move(other.memory_);
    map_base_ = std::exchange(other.map_base_, nullptr);
    map_length_ = std::exchange(other.map_length_, 0);
    data_ = std::exchange(other.data_, nullptr);
    length_ = std::exchange(other.length_, 0);
    offset_ = std::exchange(other.offset_, 0);
    owner_ = std::exchange(other.owner_, false);
    guard_ = std::move(other.guard_);
    other.name_.clear();
    other.memory_.reset();
  }
  return *this;
}

ShmMapping::~ShmMapping() { Reset(); }

void ShmMapping::Reset() {
  guard_.Reset();  // first: nothing may touch the range once it is unmapped
  if (map_base_ != nullptr) munmap(map_base_, map_length_);
  if (owner_) shm_unlink(name_.c_str());
  name_.clear();
  memory_.reset();
  map_base_ = data_ = nullptr;
  map_length_ = length_ = offset_ = 0;
  owner_ = false;
}

}  // namespace kvagent::registry
