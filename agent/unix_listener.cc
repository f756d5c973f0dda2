#include "agent/unix_listener.h"

#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "base/format.h"
#include "base/status_macros.h"
#include "client/session_wire.h"
#include "fmt/format.h"

namespace kvagent::agent {
namespace {

std::string ErrnoText(int err) { return fmt::format("{} ({})", std::strerror(err), err); }

std::string ParentOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// mkdir -p with mode 0755 for the directories it creates (umask aside).
absl::Status MakeDirectories(const std::string& dir, const std::string& socket_path) {
  struct stat st {};
  if (stat(dir.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return absl::OkStatus();
    return absl::FailedPreconditionError(fmt::format(
        "cannot create the socket {}: '{}' is not a directory; choose a path in a directory",
        socket_path, dir));
  }
  if (dir != "/" && dir != ".") {
    RETURN_IF_ERROR(MakeDirectories(ParentOf(dir), socket_path));
  }
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    const int err = errno;
    return absl::FailedPreconditionError(fmt::format(
        "cannot create directory '{}' for the socket {}: {}; create it (mode 0755) or choose "
        "a path in a directory the agent's user can write",
        dir, socket_path, ErrnoText(err)));
  }
  if (chmod(dir.c_str(), 0755) != 0) {
    const int err = errno;
    return absl::FailedPreconditionError(fmt::format(
        "cannot set mode 0755 on the new directory '{}' for the socket {}: {}", dir,
        socket_path, ErrnoText(err)));
  }
  return absl::OkStatus();
}

// Whether a process holds a socket bound at `path`. Only "connection refused" (no
// socket behind the file, or one that does not listen) counts as dead; a socket of
// another type (EPROTOTYPE) or a full backlog (EAGAIN) is somebody's live socket.
absl::StatusOr<bool> SocketIsLive(const std::string& path, const client::UnixAddress& address) {
  UniqueFd probe(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!probe) {
    return absl::ResourceExhaustedError(fmt::format(
        "cannot create a socket to probe {}: {}", path, ErrnoText(errno)));
  }
  if (connect(probe.get(), reinterpret_cast<const sockaddr*>(&address.address),
              address.length) == 0) {
    return true;
  }
  const int err = errno;
  switch (err) {
    case ECONNREFUSED:
      return false;
    case ENOENT:  // removed meanwhile
      return false;
    case EPROTOTYPE:
    case EAGAIN:
    case EINPROGRESS:
      return true;
    default:
      return absl::FailedPreconditionError(fmt::format(
          "cannot tell whether the socket {} is in use: connect failed with {}; remove it "
          "if no agent runs, or choose another path",
          path, ErrnoText(err)));
  }
}

absl::StatusOr<gid_t> LookUpGroup(const std::string& group) {
  if (group.find_first_not_of("0123456789") == std::string::npos) {
    char* end = nullptr;
    errno = 0;
    const unsigned long value = std::strtoul(group.c_str(), &end, 10);
    if (errno != 0 || *end != '\0' || value >= static_cast<unsigned long>(static_cast<gid_t>(-1))) {
      return absl::InvalidArgumentError(fmt::format(
          "--local-socket-group '{}' is not a valid gid; give a group name or a gid below {}",
          group, static_cast<gid_t>(-1)));
    }
    return static_cast<gid_t>(value);
  }
  long hint = sysconf(_SC_GETGR_R_SIZE_MAX);
  std::vector<char> buffer(hint > 0 ? static_cast<size_t>(hint) : 4096);
  while (true) {
    struct group entry {};
    struct group* found = nullptr;
    const int err = getgrnam_r(group.c_str(), &entry, buffer.data(), buffer.size(), &found);
    if (err == ERANGE && buffer.size() < (1u << 20)) {
      buffer.resize(buffer.size() * 2);
      continue;
    }
    if (err != 0) {
      return absl::FailedPreconditionError(fmt::format(
          "--local-socket-group '{}': looking up the group failed: {}; check /etc/group and "
          "nsswitch, or give a numeric gid",
          group, ErrnoText(err)));
    }
    if (found == nullptr) {
      return absl::InvalidArgumentError(fmt::format(
          "--local-socket-group '{}': no such group on this host; create it (groupadd {}) or "
          "give a numeric gid",
          group, group));
    }
    return found->gr_gid;
  }
}

// RemoveStaleUnixSocket with `path`'s address made.
absl::Status RemoveStale(const std::string& path, const client::UnixAddress& address) {
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) return absl::OkStatus();
    return absl::FailedPreconditionError(fmt::format(
        "cannot inspect the socket path {}: {}; check the directory's permissions",
        path, ErrnoText(err)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    const char* what = S_ISDIR(st.st_mode)   ? "a directory"
                       : S_ISLNK(st.st_mode) ? "a symbolic link"
                       : S_ISREG(st.st_mode) ? "a regular file"
                                             : "not a socket";
    return absl::FailedPreconditionError(fmt::format(
        "{} is {}, not a socket; the agent does not remove it: remove it yourself or choose "
        "another socket path",
        path, what));
  }
  ASSIGN_OR_RETURN(const bool live, SocketIsLive(path, address));
  if (live) {
    return absl::FailedPreconditionError(fmt::format(
        "another agent is listening at {}; stop it first, or give this agent another socket "
        "path",
        path));
  }
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    const int err = errno;
    return absl::FailedPreconditionError(fmt::format(
        "cannot remove the stale socket {}: {}; remove it yourself or choose another path",
        path, ErrnoText(err)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status PrepareUnixSocketPath(const std::string& path) {
  ASSIGN_OR_RETURN(const client::UnixAddress address, client::MakeUnixAddress(path));
  RETURN_IF_ERROR(MakeDirectories(ParentOf(path), path));
  return RemoveStale(path, address);
}

absl::Status RemoveStaleUnixSocket(const std::string& path) {
  ASSIGN_OR_RETURN(const client::UnixAddress address, client::MakeUnixAddress(path));
  return RemoveStale(path, address);
}

absl::Status SetUnixSocketAccess(const std::string& path, mode_t mode, const std::string& group) {
  if (chmod(path.c_str(), mode) != 0) {
    const int err = errno;
    return absl::FailedPreconditionError(fmt::format(
        "cannot set mode {:04o} on the socket {}: {}; check the file system (it must allow "
        "chmod)",
        static_cast<unsigned>(mode), path, ErrnoText(err)));
  }
  if (group.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const gid_t gid, LookUpGroup(group));
  if (chown(path.c_str(), static_cast<uid_t>(-1), gid) != 0) {
    const int err = errno;
    if (err == EPERM) {
      return absl::PermissionDeniedError(fmt::format(
          "--local-socket-group '{}': cannot give the socket {} to gid {}: {}; run the agent "
          "as a member of that group (or with CAP_CHOWN), or pick one of its groups",
          group, path, gid, ErrnoText(err)));
    }
    return absl::FailedPreconditionError(fmt::format(
        "--local-socket-group '{}': cannot give the socket {} to gid {}: {}", group, path, gid,
        ErrnoText(err)));
  }
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> ListenOnUnixSocket(const std::string& path, int type, mode_t mode,
                                            const std::string& group, int backlog) {
  RETURN_IF_ERROR(PrepareUnixSocketPath(path));
  ASSIGN_OR_RETURN(const client::UnixAddress address, client::MakeUnixAddress(path));
  UniqueFd fd(socket(AF_UNIX, type | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) {
    return absl::ResourceExhaustedError(fmt::format(
        "cannot create the socket for {}: {}; check the agent's descriptor limit", path,
        ErrnoText(errno)));
  }
  if (bind(fd.get(), reinterpret_cast<const sockaddr*>(&address.address), address.length) != 0) {
    const int err = errno;
    if (err == EADDRINUSE) {
      return absl::FailedPreconditionError(fmt::format(
          "another agent took {} while this one started; stop it first, or choose another "
          "socket path",
          path));
    }
    return absl::FailedPreconditionError(fmt::format(
        "cannot bind the socket {}: {}; the agent's user must be able to write its directory",
        path, ErrnoText(err)));
  }
  // Nobody can connect before listen(), so the file's access is in place first.
  if (absl::Status access = SetUnixSocketAccess(path, mode, group); !access.ok()) {
    unlink(path.c_str());
    return access;
  }
  if (listen(fd.get(), backlog) != 0) {
    const int err = errno;
    unlink(path.c_str());
    return absl::InternalError(
        fmt::format("cannot listen on the socket {}: {}", path, ErrnoText(err)));
  }
  return fd;
}

}  // namespace kvagent::agent
