#include "registry/device_memory_object.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "base/text.h"
#include "fmt/format.h"

namespace kvagent::registry {
namespace {

constexpr char kHandleFix[] =
    "pass the descriptor of cuMemExportToShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_"
    "DESCRIPTOR)";

std::atomic<uint64_t> next_id{1};

}  // namespace

absl::StatusOr<std::shared_ptr<const DeviceMemoryObject>> DeviceMemoryObject::FromDescriptor(
    UniqueFd fd, int device, uint64_t bytes, std::string_view label) {
  std::string printable = Printable(label);
  auto refuse = [&](const std::string& cause, std::string_view fix) {
    return absl::InvalidArgumentError(
        fmt::format("device memory '{}': {}; {}", printable, cause, fix));
  };
  if (bytes == 0 || bytes > kMaxBytes) {
    return refuse(fmt::format("{} bytes declared", bytes),
                  fmt::format("give the allocation's size (the size passed to cuMemCreate), "
                              "1 byte to {} bytes",
                              kMaxBytes));
  }
  if (device < 0) {
    return refuse(fmt::format("device ordinal {} is negative", device),
                  "give the CUDA device ordinal of the allocation, as the agent numbers devices");
  }
  if (!fd.valid()) return refuse("no descriptor was given", kHandleFix);
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) {
    return refuse(fmt::format("cannot inspect the descriptor ({})", std::strerror(errno)),
                  kHandleFix);
  }
  if (S_ISREG(st.st_mode)) {
    struct statfs fs {};
    if (fstatfs(fd.get(), &fs) != 0) {
      return refuse(fmt::format("cannot inspect its filesystem ({})", std::strerror(errno)),
                    kHandleFix);
    }
    const auto type = static_cast<unsigned long>(fs.f_type);
    if (type == TMPFS_MAGIC || type == HUGETLBFS_MAGIC) {
      return refuse(
          fmt::format("the descriptor is a file of host memory on {} (a memfd, POSIX shm or "
                      "{} file), not a CUDA VMM handle",
                      type == TMPFS_MAGIC ? "tmpfs" : "hugetlbfs",
                      type == TMPFS_MAGIC ? "tmpfs" : "hugetlbfs"),
          fmt::format("use share for host memory; for device memory {}", kHandleFix));
    }
  }
  // The agent may start helper processes; a caller's memory must not leak into them.
  (void)fcntl(fd.get(), F_SETFD, FD_CLOEXEC);
  std::shared_ptr<DeviceMemoryObject> object(new DeviceMemoryObject());
  object->fd_ = std::move(fd);
  object->device_ = device;
  object->bytes_ = bytes;
  object->label_ = std::move(printable);
  object->id_ = next_id.fetch_add(1, std::memory_order_relaxed);
  return std::shared_ptr<const DeviceMemoryObject>(std::move(object));
}

}  // namespace kvagent::registry
