#include "client/session_wire.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "base/format.h"
#include "fmt/format.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace kvagent::client {
namespace {

using Clock = std::chrono::steady_clock;

std::string ErrnoText(int err) { return fmt::format("{} ({})", std::strerror(err), err); }

// Waits for `events` on fd for up to timeout_ms (negative: no limit), through
// EINTR. Returns revents, 0 on timeout, or -errno.
int PollFor(int fd, short events, int timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms < 0 ? 0 : timeout_ms);
  while (true) {
    int wait_ms = -1;
    if (timeout_ms >= 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      wait_ms = left.count() < 0 ? 0 : static_cast<int>(left.count());
    }
    pollfd p{fd, events, 0};
    int n = poll(&p, 1, wait_ms);
    if (n > 0) return p.revents;
    if (n == 0) return 0;
    if (errno != EINTR) return -errno;
  }
}


}  // namespace

// Why bytes did not parse as `type`: protobuf's parser only says "no", so walk the
// wire format to say where it breaks, or that the wire format is sound and a field's
// content is not (a string that is not UTF-8, a malformed nested message).
std::string DescribeParseFailure(std::string_view bytes, const std::string& type) {
  const char* data = bytes.data();
  const size_t size = bytes.size();
  namespace wire = google::protobuf::internal;
  google::protobuf::io::CodedInputStream input(reinterpret_cast<const uint8_t*>(data),
                                               static_cast<int>(size));
  while (true) {
    const int offset = input.CurrentPosition();
    const uint32_t tag = input.ReadTag();
    if (tag == 0) {
      if (input.ConsumedEntireMessage()) break;
      return fmt::format("malformed protobuf wire format at byte {} of {} (not a {})",
                         offset, size, type);
    }
    if (!wire::WireFormatLite::SkipField(&input, tag)) {
      return fmt::format(
          "malformed protobuf wire format at byte {} of {} (field {}, wire type {}; not a {})",
          offset, size, tag >> 3, tag & 7, type);
    }
  }
  return fmt::format(
      "{} bytes of sound wire format whose fields are not a valid {} (a string that is "
      "not UTF-8, or a malformed nested message)",
      size, type);
}

absl::StatusOr<ProcessCredentials> PeerCredentialsOf(int fd) {
  ucred cred{};
  socklen_t length = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &length) != 0) {
    return absl::InternalError(fmt::format(
        "SO_PEERCRED on socket {} failed: {}; the socket must be a connected Unix socket",
        fd, ErrnoText(errno)));
  }
  return ProcessCredentials{cred.uid, cred.gid, cred.pid};
}

absl::StatusOr<UnixAddress> MakeUnixAddress(const std::string& path) {
  if (path.empty()) {
    return absl::InvalidArgumentError("Unix socket path is empty; give an absolute path");
  }
  if (path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(
        "Unix socket path holds a NUL byte; give a plain file system path");
  }
  if (path.size() > kMaxUnixSocketPathBytes) {
    return absl::InvalidArgumentError(fmt::format(
        "Unix socket path '{}' is {} bytes, over the limit of {} bytes (sun_path); use a "
        "shorter path (for example under /run or /tmp)",
        path, path.size(), kMaxUnixSocketPathBytes));
  }
  UnixAddress result;
  result.address.sun_family = AF_UNIX;
  std::memcpy(result.address.sun_path, path.data(), path.size());
  result.length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size() + 1);
  return result;
}

const char* SessionRequestName(const v1::SessionRequest& request) {
  switch (request.body_case()) {
    case v1::SessionRequest::kHello: return "hello";
    case v1::SessionRequest::kShare: return "share";
    case v1::SessionRequest::kShareDevice: return "share_device";
    case v1::SessionRequest::kAllocate: return "allocate";
    case v1::SessionRequest::kFree: return "free";
    case v1::SessionRequest::kPeerMemory: return "peer_memory";
    case v1::SessionRequest::kOpenFastPath: return "open_fast_path";
    case v1::SessionRequest::kCloseFastPath: return "close_fast_path";
    case v1::SessionRequest::BODY_NOT_SET: break;
  }
  return "request";
}

absl::Status SendMessage(int fd, const google::protobuf::MessageLite& message,
                         const std::vector<int>& fds, int timeout_ms) {
  const size_t size = message.ByteSizeLong();
  if (size > kMaxSessionMessageBytes) {
    return absl::InvalidArgumentError(fmt::format(
        "session message {} is {} bytes, over the limit of {} bytes per datagram; send "
        "less per request (split it)",
        message.GetTypeName(), size, kMaxSessionMessageBytes));
  }
  if (fds.size() > kMaxSessionFds) {
    return absl::InvalidArgumentError(fmt::format(
        "session message {} carries {} descriptors, over the limit of {} per datagram; "
        "split it into several requests",
        message.GetTypeName(), fds.size(), kMaxSessionFds));
  }
  std::string bytes;
  if (!message.SerializeToString(&bytes)) {
    return absl::InternalError(fmt::format(
        "cannot serialize session message {}; this is a bug", message.GetTypeName()));
  }

  iovec iov{bytes.data(), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(kMaxSessionFds * sizeof(int))];
  if (!fds.empty()) {
    const size_t data_bytes = fds.size() * sizeof(int);
    std::memset(control, 0, sizeof(control));
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(data_bytes);
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(data_bytes);
    std::memcpy(CMSG_DATA(cmsg), fds.data(), data_bytes);
  }

  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) return absl::OkStatus();
    const int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) {
      if (timeout_ms <= 0) {
        return absl::ResourceExhaustedError(
            "the peer's receive queue is full (it is not reading its session socket)");
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0 || PollFor(fd, POLLOUT, static_cast<int>(left.count())) == 0) {
        return absl::DeadlineExceededError(fmt::format(
            "the peer did not take a session message within {} ms (its queue is full)",
            timeout_ms));
      }
      continue;  // room, an error or a hang-up: sendmsg says which
    }
    if (err == EPIPE || err == ECONNRESET || err == ENOTCONN) {
      return absl::UnavailableError(
          fmt::format("the peer closed the session ({})", ErrnoText(err)));
    }
    if (err == EBADF || err == ENOTSOCK || err == EINVAL || err == EFAULT) {
      return absl::InternalError(fmt::format(
          "sendmsg on session socket {} failed: {}; this is a bug", fd, ErrnoText(err)));
    }
    return absl::UnavailableError(
        fmt::format("sendmsg on the session socket failed: {}", ErrnoText(err)));
  }
}

absl::Status ReceiveMessage(int fd, google::protobuf::MessageLite* message,
                            std::vector<UniqueFd>* fds, int timeout_ms) {
  fds->clear();
  if (timeout_ms != 0) {
    int revents = PollFor(fd, POLLIN, timeout_ms);
    if (revents < 0) {
      return absl::InternalError(
          fmt::format("poll on session socket {} failed: {}", fd, ErrnoText(-revents)));
    }
    if (revents == 0) {
      return absl::DeadlineExceededError(
          fmt::format("no session message within {} ms", timeout_ms));
    }
    // POLLHUP/POLLERR: recvmsg reports what is left, then the end or the error.
  }

  // One byte more than the limit is not needed: MSG_TRUNC says the datagram was longer.
  std::unique_ptr<char[]> buffer(new char[kMaxSessionMessageBytes]);
  alignas(cmsghdr) char control[CMSG_SPACE(kMaxSessionFds * sizeof(int))];
  iovec iov{buffer.get(), kMaxSessionMessageBytes};
  msghdr msg{};
  ssize_t n = -1;
  bool retried_reset = false;
  while (true) {
    msg = msghdr{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n >= 0) break;
    const int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) {
      return absl::DeadlineExceededError(
          fmt::format("no session message within {} ms", timeout_ms));
    }
    if (err == ECONNRESET && !retried_reset) {
      // The peer closed with our datagrams unread. Linux reports that before what the
      // peer sent last (an error reply, say), which is still queued: read it first.
      retried_reset = true;
      continue;
    }
    if (err == ECONNRESET || err == ENOTCONN || err == EPIPE) {
      return absl::UnavailableError(
          fmt::format("the peer closed the session ({})", ErrnoText(err)));
    }
    return absl::InternalError(
        fmt::format("recvmsg on session socket {} failed: {}", fd, ErrnoText(err)));
  }

  // Take ownership of every descriptor before looking at anything else.
  for (cmsghdr* cmsg = CMSG_FIRSTHDR(&msg); cmsg != nullptr; cmsg = CMSG_NXTHDR(&msg, cmsg)) {
    if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char* data = CMSG_DATA(cmsg);
    for (size_t i = 0; i < count; ++i) {
      int received = -1;
      std::memcpy(&received, data + i * sizeof(int), sizeof(int));
      if (received >= 0) fds->emplace_back(received);
    }
  }

  if (msg.msg_flags & MSG_CTRUNC) {
    const size_t arrived = fds->size();
    fds->clear();
    return absl::InvalidArgumentError(fmt::format(
        "session datagram carried more than {} descriptors (control data truncated, {} "
        "arrived and were closed); send at most {} per request",
        kMaxSessionFds, arrived, kMaxSessionFds));
  }
  if (msg.msg_flags & MSG_TRUNC) {
    fds->clear();
    return absl::InvalidArgumentError(fmt::format(
        "session datagram is over the limit of {} bytes (truncated and dropped); send less "
        "per request",
        kMaxSessionMessageBytes));
  }
  if (n == 0 && fds->empty()) {
    // SOCK_SEQPACKET returns 0 both for an empty datagram (a default message) and at
    // the end of the stream: a hung-up peer tells them apart.
    pollfd p{fd, POLLRDHUP, 0};
    if (poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP))) {
      return absl::UnavailableError("the peer closed the session");
    }
  }
  if (!message->ParseFromArray(buffer.get(), static_cast<int>(n))) {
    fds->clear();
    return absl::InvalidArgumentError(fmt::format(
        "session datagram does not parse: {}",
        DescribeParseFailure(std::string_view(buffer.get(), static_cast<size_t>(n)), message->GetTypeName())));
  }
  return absl::OkStatus();
}

}  // namespace kvagent::client
