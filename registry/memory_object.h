// MemoryObject is an open descriptor of host memory an engine shares with the agent
// (memfd, POSIX shm / tmpfs file, hugetlbfs file), checked once when it is opened.
// Used by ShmMapping (mmap), the region registry and the agent's session handles.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "base/unique_fd.h"

namespace kvagent::registry {

// Where registration by name (compatibility) may open memory, and whose it must be.
struct PathPolicy {
  // Directories (absolute, real directories: none of their components may be a
  // symbolic link) under which a name may point. A POSIX shm name "/x" is
  // /dev/shm/x, so it needs "/dev/shm" here.
  std::vector<std::string> allowed_dirs = {"/dev/shm", "/dev/hugepages"};
  // When set, the file must be owned by this uid (the caller's, from SO_PEERCRED).
  std::optional<uid_t> required_uid;
};

class MemoryObject {
 public:
  // Takes a descriptor a caller passed (SCM_RIGHTS). Accepts only a regular file on
  // tmpfs (memfds and POSIX shm report it) or hugetlbfs, opened read-write, of at
  // least one byte, not sealed against writes. INVALID_ARGUMENT (FAILED_PRECONDITION
  // for a write seal) naming `label`, the cause and the fix otherwise.
  static absl::StatusOr<std::shared_ptr<const MemoryObject>> FromDescriptor(UniqueFd fd,
                                                                            std::string_view label);

  // Opens memory by name, for compatibility. `name` is a POSIX shm name ("/x", one
  // leading slash and no other: /dev/shm/x) or an absolute path under one of
  // policy.allowed_dirs. Refused (the message names `entry`, an escaped prefix of the
  // name, the cause and the fix):
  //   INVALID_ARGUMENT: empty, too long, control characters, "." / ".." / empty
  //     components; not a regular file (directory, FIFO, socket, device) or not on
  //     tmpfs/hugetlbfs;
  //   PERMISSION_DENIED: not under an allowed directory (compared by components); a
  //     symbolic link anywhere on the way (never followed); owned by another uid than
  //     policy.required_uid; or the kernel refuses to open it;
  //   NOT_FOUND: it does not exist.
  // Opens nothing but directories (O_PATH) on the way and the final regular file
  // (O_RDWR|O_NOFOLLOW|O_NONBLOCK, so a FIFO swapped in cannot hang it).
  static absl::StatusOr<std::shared_ptr<const MemoryObject>> OpenPath(const std::string& name,
                                                                      const PathPolicy& policy,
                                                                      std::string_view entry);

  // Allocates `bytes` of memory in a new memfd (its pages come on first touch) and
  // seals it so that nobody can shrink or grow it (F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL).
  // INVALID_ARGUMENT for 0 bytes; RESOURCE_EXHAUSTED when `bytes` is above the
  // memory available (MemAvailable) or cannot be reserved: tmpfs would accept a sparse
  // size and SIGBUS on first touch, so it is checked first.
  static absl::StatusOr<std::shared_ptr<const MemoryObject>> CreateMemfd(std::string_view label,
                                                                         uint64_t bytes);

  MemoryObject(const MemoryObject&) = delete;
  MemoryObject& operator=(const MemoryObject&) = delete;
  ~MemoryObject() = default;  // closes the descriptor; mappings of it stay valid

  int fd() const { return fd_.get(); }
  // Unique in this process, from 1; what peers on the same host name it by.
  uint64_t id() const { return id_; }
  // Bytes when it was opened. Unless sealed() it can change: see CurrentSize().
  uint64_t size() const { return size_; }
  // "memfd", "tmpfs" or "hugetlbfs".
  std::string_view kind() const { return kind_; }
  // It cannot shrink (F_SEAL_SHRINK), so a mapping of it never SIGBUSes.
  bool sealed() const { return sealed_; }
  // Made by CreateMemfd (AllocateMemory): the agent's own memory, whose pages it may
  // fault in (bounded by --max-allocated-bytes); not an engine's.
  bool allocated() const { return allocated_; }
  dev_t device() const { return device_; }
  ino_t inode() const { return inode_; }
  // The caller's label (or the name it was opened by), escaped and bounded.
  const std::string& label() const { return label_; }
  // mmap offsets must be multiples of this: the page size, or hugetlbfs's page size.
  uint64_t page_alignment() const { return page_alignment_; }

  // The size now (fstat); `entry` names the caller's region in errors.
  absl::StatusOr<uint64_t> CurrentSize(std::string_view entry) const;

 private:
  MemoryObject() = default;
  // The checks of FromDescriptor; `subject` starts every error message, `fix` ends the
  // ones about what kind of object it is.
  static absl::StatusOr<std::shared_ptr<const MemoryObject>> Inspect(UniqueFd fd, std::string label,
                                                                     const std::string& subject,
                                                                     std::string_view fix,
                                                                     bool allocated = false);

  UniqueFd fd_;
  uint64_t id_ = 0;
  uint64_t size_ = 0;
  std::string_view kind_;
  bool sealed_ = false;
  bool allocated_ = false;
  dev_t device_ = 0;
  ino_t inode_ = 0;
  std::string label_;
  uint64_t page_alignment_ = 0;
};

}  // namespace kvagent::registry
