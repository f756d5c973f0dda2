// Creating the agent's listening Unix sockets safely: path checks, stale-socket
// replacement, file mode and group. Used by agent/session_server (the session socket)
// and usable for the local gRPC socket (PrepareUnixSocketPath + SetUnixSocketAccess).
#pragma once

#include <sys/types.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/unique_fd.h"

namespace kvagent::agent {

// Makes `path` ready for bind(): it fits in sun_path (at most 107 bytes), its parent
// directory exists (missing directories are created with mode 0755), and nothing is
// there, or only a stale socket that nobody answers on (connect refused), which is
// removed. A live socket is FAILED_PRECONDITION "another agent is listening at PATH";
// anything else at the path (a file, a directory, a symlink) is FAILED_PRECONDITION
// and left alone.
absl::Status PrepareUnixSocketPath(const std::string& path);

// The path check and stale-socket removal of PrepareUnixSocketPath alone (no directory
// is made): OK when nothing is at `path` or a stale socket was removed; the same
// FAILED_PRECONDITION for a live socket or anything else, which stays. Also used by
// cli/daemon_process to clear a reaped agent's sockets.
absl::Status RemoveStaleUnixSocket(const std::string& path);

// Gives the socket file at `path` its mode and, when `group` is not empty, its group
// (a group name or a numeric gid). Errors name --local-socket-group and the fix.
absl::Status SetUnixSocketAccess(const std::string& path, mode_t mode, const std::string& group);

// PrepareUnixSocketPath, then a listening socket of `type` (SOCK_SEQPACKET or
// SOCK_STREAM; non-blocking, close-on-exec) bound at `path` with SetUnixSocketAccess
// applied before listen(), so no client connects before the access is in place.
absl::StatusOr<UniqueFd> ListenOnUnixSocket(const std::string& path, int type, mode_t mode,
                                            const std::string& group, int backlog = 128);

}  // namespace kvagent::agent
