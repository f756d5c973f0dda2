// Framing of the local session protocol (proto/kvagent.proto, "Local session
// protocol"): one protobuf message per SOCK_SEQPACKET datagram, descriptors as
// SCM_RIGHTS. Shared by the agent's side (agent/session_server) and the client's
// (client/local_session); no policy lives here.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/unique_fd.h"
#include "google/protobuf/message_lite.h"
#include "proto/kvagent.pb.h"

namespace kvagent::client {

// The largest datagram either side sends or accepts, and the most descriptors one
// datagram carries. A larger datagram or more descriptors is a protocol error.
inline constexpr size_t kMaxSessionMessageBytes = 64 * 1024;
inline constexpr size_t kMaxSessionFds = 64;
// sizeof(sockaddr_un::sun_path) less its terminating NUL.
inline constexpr size_t kMaxUnixSocketPathBytes = sizeof(sockaddr_un::sun_path) - 1;

// Who is at the other end of a Unix socket, as the kernel says (SO_PEERCRED): the
// credentials of the process that connected (or, seen by a client, that listened).
struct ProcessCredentials {
  uid_t uid = static_cast<uid_t>(-1);
  gid_t gid = static_cast<gid_t>(-1);
  pid_t pid = 0;
};

// SO_PEERCRED of a connected Unix socket.
absl::StatusOr<ProcessCredentials> PeerCredentialsOf(int fd);

// A filled sockaddr_un for `path`. INVALID_ARGUMENT when the path is empty, holds a
// NUL byte or is longer than kMaxUnixSocketPathBytes (the message gives its length,
// the limit and the fix: a shorter path).
struct UnixAddress {
  sockaddr_un address{};
  socklen_t length = 0;
};
absl::StatusOr<UnixAddress> MakeUnixAddress(const std::string& path);

// Sends `message` as one datagram with `fds` attached (the caller keeps them; the
// receiver gets duplicates). Never raises SIGPIPE. INVALID_ARGUMENT when the message
// is over kMaxSessionMessageBytes or there are more than kMaxSessionFds descriptors.
// When the peer's queue is full: with timeout_ms == 0, RESOURCE_EXHAUSTED at once
// (the peer is not reading); with timeout_ms > 0, waits for room that long, then
// DEADLINE_EXCEEDED. UNAVAILABLE when the peer closed the connection.
// Why `bytes` did not parse as a `type` message: protobuf's parser only says no, so
// this walks the wire format to say where it breaks, or that it is sound and a
// field's content is not (a string that is not UTF-8, a malformed nested message).
// Also used by the agent's gRPC methods for unparseable requests.
std::string DescribeParseFailure(std::string_view bytes, const std::string& type);

// "hello", "share", "allocate", "free", "peer_memory" or "request" (no known body).
const char* SessionRequestName(const v1::SessionRequest& request);

absl::Status SendMessage(int fd, const google::protobuf::MessageLite& message,
                         const std::vector<int>& fds, int timeout_ms = 0);

// Receives one datagram into `message` and the descriptors that came with it into
// `fds` (replaced; owned, close-on-exec). Waits up to timeout_ms for it (0: only what
// is queued now; negative: no limit): DEADLINE_EXCEEDED when none came.
// UNAVAILABLE "the peer closed the session" at end of stream. A truncated datagram
// (over kMaxSessionMessageBytes), truncated control data (over kMaxSessionFds
// descriptors) or bytes that do not parse are INVALID_ARGUMENT, and every descriptor
// that arrived is closed. On any error `fds` is empty.
absl::Status ReceiveMessage(int fd, google::protobuf::MessageLite* message,
                            std::vector<UniqueFd>* fds, int timeout_ms);

}  // namespace kvagent::client
