// shmat(), open(), shm_open(), connect() and process_vm_readv()/process_vm_writev() in
// front of libc's, for kvagentd: the calls by which UCX reaches another process of this
// host (attaching its System V or posix receive FIFO, connecting to its TCP port,
// reading and writing its memory with cma) go only to the processes a local door
// proved (SameHostTargetAdmitted, ucx_hardening.h). Each looks only at UCX's own calls:
// open() at /proc/PID/fd/... paths, how UCX's posix transport attaches another
// process's segment by default, and with shm_open() at UCX's posix segments opened by
// name, which must be mapped by such a process (SameHostFileAdmitted); connect() at
// connections to this host while UCX connects a peer's endpoint
// (SameHostListenerAdmitted); every TCP connection UCX dials is also watched, wherever
// it goes, for what the peer answers on it (WatchDialledUcxTcpStream, ucx_tcp_guard.h).
// Every other call goes straight to libc.
// kvagentd links this object and exports the symbols (-Wl,--export-dynamic-symbol in
// BUILD), so libucs's, libuct's and libuct_cma's calls bind to them; the next
// definitions (libc's) do the work.
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/shm.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstdarg>
#include <cstdlib>
#include <cstring>
#include <string>

#include "transport/ucx_hardening.h"
#include "transport/ucx_tcp_guard.h"

namespace {

using kvagent::transport::IsUcxPosixSegmentName;
using kvagent::transport::SameHostTargetAdmitted;
using kvagent::transport::SameHostUse;

template <typename Fn>
Fn Next(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_NEXT, name));
}

// True when `code` lies in UCX's libucs or libuct (with libuct's modules): the checks
// are UCX's, not every library's (a CUDA driver opens descriptors of the engines it
// imports memory from).
bool CalledByUcx(const void* code) {
  Dl_info info{};
  return dladdr(code, &info) != 0 && info.dli_fname != nullptr &&
         (std::strstr(info.dli_fname, "/libuct") != nullptr ||
          std::strstr(info.dli_fname, "/libucs") != nullptr);
}

// The pid of a "/proc/PID/fd/..." path, or 0 for any other path.
int ProcFdOwner(const char* path) {
  constexpr char kProc[] = "/proc/";
  if (path == nullptr || std::strncmp(path, kProc, sizeof(kProc) - 1) != 0) return 0;
  const char* digits = path + sizeof(kProc) - 1;
  char* end = nullptr;
  const long pid = std::strtol(digits, &end, 10);
  if (end == digits || pid <= 0 || std::strncmp(end, "/fd/", 4) != 0) return 0;
  return static_cast<int>(pid);
}

using VmFn = ssize_t (*)(pid_t, const iovec*, unsigned long, const iovec*, unsigned long,
                         unsigned long);

template <const char* kName>
ssize_t CmaAdmitted(pid_t pid, const iovec* local, unsigned long local_count,
                    const iovec* remote, unsigned long remote_count, unsigned long flags) {
  static const auto next = Next<VmFn>(kName);
  if (next == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  if (!SameHostTargetAdmitted(pid, SameHostUse::kCma)) {
    errno = EPERM;
    return -1;
  }
  return next(pid, local, local_count, remote, remote_count, flags);
}

// `fd` (an open's result) when SameHostFileAdmitted admits it; else -1 with EPERM.
int AdmittedFile(int fd, const char* path) {
  if (fd < 0 || kvagent::transport::SameHostFileAdmitted(fd, path)) return fd;
  ::close(fd);
  errno = EPERM;
  return -1;
}

constexpr char kRead[] = "process_vm_readv";
constexpr char kWrite[] = "process_vm_writev";

}  // namespace

extern "C" ssize_t process_vm_readv(pid_t pid, const iovec* local, unsigned long local_count,
                                    const iovec* remote, unsigned long remote_count,
                                    unsigned long flags) {
  return CmaAdmitted<kRead>(pid, local, local_count, remote, remote_count, flags);
}

extern "C" ssize_t process_vm_writev(pid_t pid, const iovec* local, unsigned long local_count,
                                     const iovec* remote, unsigned long remote_count,
                                     unsigned long flags) {
  return CmaAdmitted<kWrite>(pid, local, local_count, remote, remote_count, flags);
}

extern "C" void* shmat(int shmid, const void* address, int flags) {
  using ShmatFn = void* (*)(int, const void*, int);
  static const auto next = Next<ShmatFn>("shmat");
  if (next == nullptr) {
    errno = ENOSYS;
    return reinterpret_cast<void*>(-1);
  }
  // The segment's creator: a FIFO or segment of UCX's is created by the process it
  // belongs to. One that cannot be looked at is left to shmat to refuse.
  shmid_ds segment{};
  if (CalledByUcx(__builtin_return_address(0)) && ::shmctl(shmid, IPC_STAT, &segment) == 0 &&
      !SameHostTargetAdmitted(segment.shm_cpid, SameHostUse::kAttach)) {
    errno = EPERM;
    return reinterpret_cast<void*>(-1);
  }
  return next(shmid, address, flags);
}

extern "C" int open(const char* path, int flags, ...) {
  using OpenFn = int (*)(const char*, int, ...);
  static const auto next = Next<OpenFn>("open");
  mode_t mode = 0;
  if ((flags & O_CREAT) != 0 || (flags & O_TMPFILE) == O_TMPFILE) {
    va_list arguments;
    va_start(arguments, flags);
    mode = static_cast<mode_t>(va_arg(arguments, int));
    va_end(arguments);
  }
  if (next == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  const int pid = ProcFdOwner(path);
  const bool named = pid == 0 && (flags & O_CREAT) == 0 && IsUcxPosixSegmentName(path);
  if ((pid == 0 && !named) || !CalledByUcx(__builtin_return_address(0))) {
    return next(path, flags, mode);
  }
  if (pid != 0) {
    if (!SameHostTargetAdmitted(pid, SameHostUse::kAttach)) {
      errno = EPERM;
      return -1;
    }
    return next(path, flags, mode);
  }
  // A segment by name, in a directory the peer's address names: no link followed, no
  // wait on a special file, and opened before it is looked at, so that what is checked
  // is what UCX maps.
  return AdmittedFile(next(path, flags | O_NOFOLLOW | O_NONBLOCK, mode), path);
}

// UCX's TCP connections to this host, for a peer's endpoint (SameHostTcpChecked): the
// port must be one a proven peer's process listens on. Every TCP connection UCX dials
// is watched (above).
extern "C" int connect(int fd, const sockaddr* to, socklen_t length) {
  using ConnectFn = int (*)(int, const sockaddr*, socklen_t);
  static const auto next = Next<ConnectFn>("connect");
  if (next == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  const bool tcp = to != nullptr && length >= sizeof(sa_family_t) &&
                   (to->sa_family == AF_INET || to->sa_family == AF_INET6);
  const bool ucx = tcp && CalledByUcx(__builtin_return_address(0));
  if (ucx && kvagent::transport::SameHostTcpChecked()) {
    const auto listeners = kvagent::transport::UcxTcpLocalListeners(to, length);
    if (listeners.has_value() &&
        !kvagent::transport::SameHostListenerAdmitted(
            *listeners, kvagent::transport::UcxTcpAddressText(to, length))) {
      errno = EPERM;
      return -1;
    }
  }
  const int result = next(fd, to, length);
  // What the peer answers on a connection UCX dialled is checked before UCT reads it
  // (WatchDialledUcxTcpStream): from before its first byte can be read.
  if (ucx && (result == 0 || errno == EINPROGRESS)) {
    const int saved = errno;
    if (!kvagent::transport::WatchDialledUcxTcpStream(fd, to, length)) {
      shutdown(fd, SHUT_RDWR);
      errno = EPERM;
      return -1;
    }
    errno = saved;
  }
  return result;
}

extern "C" int shm_open(const char* name, int flags, mode_t mode) {
  using ShmOpenFn = int (*)(const char*, int, mode_t);
  static const auto next = Next<ShmOpenFn>("shm_open");
  if (next == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  if (name == nullptr || (flags & O_CREAT) != 0 || !CalledByUcx(__builtin_return_address(0))) {
    return next(name, flags, mode);
  }
  const std::string path = std::string("/dev/shm") + (name[0] == '/' ? "" : "/") + name;
  return AdmittedFile(next(name, flags, mode), path.c_str());
}
