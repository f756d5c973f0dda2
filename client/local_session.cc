#include "client/local_session.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "base/format.h"
#include "base/status_macros.h"
#include "fmt/format.h"

namespace kvagent::client {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kSessionProtocol = 1;
constexpr std::string_view kSessionSuffix = ".session";

std::string ErrnoText(int err) { return fmt::format("{} ({})", std::strerror(err), err); }

// The --local-socket an agent was started with, from its session socket's path.
std::string LocalSocketOf(const std::string& session_path) {
  if (session_path.size() > kSessionSuffix.size() &&
      session_path.compare(session_path.size() - kSessionSuffix.size(), kSessionSuffix.size(),
                           kSessionSuffix) == 0) {
    return session_path.substr(0, session_path.size() - kSessionSuffix.size());
  }
  return "PATH";
}

absl::Status ConnectError(int err, const std::string& path) {
  switch (err) {
    case ENOENT:
      return absl::UnavailableError(fmt::format(
          "no agent listens at {} (is kvagentd running with --local-socket {}?); start it, or "
          "pass the session socket of its --local-socket (<local-socket>.session)",
          path, LocalSocketOf(path)));
    case ECONNREFUSED:
      return absl::UnavailableError(fmt::format(
          "no agent listens at {}: the socket file is left from an agent that exited; start "
          "kvagentd (it replaces the file)",
          path));
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(fmt::format(
          "{} is not accessible to uid {}; the operator grants access with "
          "--local-socket-group (mode 0660) and adds this user to that group",
          path, getuid()));
    case EPROTOTYPE:
      return absl::FailedPreconditionError(fmt::format(
          "{} is not a session socket (a socket of another type listens there: the agent's "
          "gRPC socket?); pass <local-socket>.session",
          path));
    case ENOTDIR:
      return absl::UnavailableError(fmt::format(
          "no agent listens at {}: a component of the path is not a directory; check the path",
          path));
    default:
      return absl::UnavailableError(fmt::format(
          "cannot connect to the agent's session socket {}: {}", path, ErrnoText(err)));
  }
}

absl::Status StatusFromReply(const v1::SessionReply& reply) {
  const int32_t code = reply.error_code();
  std::string message =
      reply.error_message().empty() ? "the agent gave no reason" : reply.error_message();
  if (code < 1 || code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::UnknownError(fmt::format("{} (the agent's error code {})", message, code));
  }
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}


}  // namespace

LocalSession::LocalSession(std::string path, UniqueFd fd, uint32_t timeout_ms)
    : path_(std::move(path)), fd_(std::move(fd)), timeout_ms_(timeout_ms) {}

absl::StatusOr<std::unique_ptr<LocalSession>> LocalSession::Attach(
    const std::string& session_socket_path, const std::string& client_name,
    uint32_t timeout_ms) {
  if (timeout_ms == 0 || timeout_ms > static_cast<uint32_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(fmt::format(
        "session timeout {} ms is out of range; give 1 to {} ms", timeout_ms, INT32_MAX));
  }
  ASSIGN_OR_RETURN(const UnixAddress address, MakeUnixAddress(session_socket_path));
  UniqueFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) {
    return absl::ResourceExhaustedError(fmt::format(
        "cannot create a socket to attach to {}: {}", session_socket_path, ErrnoText(errno)));
  }
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (connect(fd.get(), reinterpret_cast<const sockaddr*>(&address.address),
                 address.length) != 0) {
    const int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN) {  // the agent's backlog is full: it is busy accepting
      if (Clock::now() >= deadline) {
        return absl::DeadlineExceededError(fmt::format(
            "the agent at {} did not accept the connection within {} ms (its backlog is "
            "full); it may be overloaded or hung",
            session_socket_path, timeout_ms));
      }
      poll(nullptr, 0, 5);
      continue;
    }
    return ConnectError(err, session_socket_path);
  }
  ASSIGN_OR_RETURN(const ProcessCredentials agent, PeerCredentialsOf(fd.get()));

  std::unique_ptr<LocalSession> session(
      new LocalSession(session_socket_path, std::move(fd), timeout_ms));
  session->agent_credentials_ = agent;
  v1::SessionRequest request;
  request.mutable_hello()->set_client_name(client_name);
  request.mutable_hello()->set_protocol(kSessionProtocol);
  std::vector<UniqueFd> reply_fds;
  absl::StatusOr<v1::SessionReply> reply = session->Call(std::move(request), {}, &reply_fds);
  if (!reply.ok()) {
    return absl::Status(reply.status().code(),
                        fmt::format("attaching to the agent at {} as '{}': {}", session_socket_path,
                                    client_name, reply.status().message()));
  }
  if (!reply->has_welcome()) {
    return absl::InternalError(fmt::format(
        "the agent at {} answered hello without a welcome; the agent and this client speak "
        "different protocol versions: use a matching client library",
        session_socket_path));
  }
  session->welcome_ = std::move(*reply->mutable_welcome());
  return session;
}

absl::StatusOr<v1::SessionReply> LocalSession::Call(v1::SessionRequest request,
                                                    const std::vector<int>& fds,
                                                    std::vector<UniqueFd>* reply_fds,
                                                    uint32_t timeout_ms) {
  absl::MutexLock lock(&mu_);
  return CallLocked(std::move(request), fds, reply_fds, timeout_ms);
}

absl::Status LocalSession::Broken(const absl::Status& cause) {
  if (broken_.ok()) broken_ = cause;
  return absl::UnavailableError(fmt::format(
      "the session with the agent at {} ended: {}; attach again (LocalSession::Attach)", path_,
      cause.message()));
}

absl::StatusOr<v1::SessionReply> LocalSession::CallLocked(v1::SessionRequest request,
                                                          const std::vector<int>& fds,
                                                          std::vector<UniqueFd>* reply_fds,
                                                          uint32_t timeout_ms) {
  reply_fds->clear();
  const uint32_t timeout = timeout_ms == 0 ? timeout_ms_ : timeout_ms;
  if (!broken_.ok()) {
    return absl::UnavailableError(fmt::format(
        "the session with the agent at {} is broken ({}); attach again (LocalSession::Attach)",
        path_, broken_.message()));
  }
  const uint64_t seq = next_seq_++;
  request.set_seq(seq);
  const char* what = SessionRequestName(request);
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout);

  absl::Status sent = SendMessage(fd_.get(), request, fds, static_cast<int>(timeout));
  if (!sent.ok()) {
    if (absl::IsInvalidArgument(sent)) return sent;  // nothing was sent; still usable
    if (absl::IsDeadlineExceeded(sent)) {
      return absl::DeadlineExceededError(fmt::format(
          "the agent at {} did not take the {} request within {} ms (it is not reading: "
          "overloaded or hung)",
          path_, what, timeout));
    }
    // The agent may have closed after saying why (a refused connection): read it.
    v1::SessionReply last;
    std::vector<UniqueFd> ignored;
    if (ReceiveMessage(fd_.get(), &last, &ignored, 0).ok() && last.error_code() != 0) {
      absl::Status refused = StatusFromReply(last);
      if (broken_.ok()) broken_ = refused;
      return refused;
    }
    return Broken(sent);
  }

  while (true) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    v1::SessionReply reply;
    std::vector<UniqueFd> received_fds;
    absl::Status received =
        left <= 0 ? absl::DeadlineExceededError("")
                  : ReceiveMessage(fd_.get(), &reply, &received_fds, static_cast<int>(left));
    if (absl::IsDeadlineExceeded(received)) {
      return absl::DeadlineExceededError(fmt::format(
          "no reply from the agent at {} to the {} request within {} ms; it may be overloaded "
          "or hung (a late reply is discarded)",
          path_, what, timeout));
    }
    if (!received.ok()) return Broken(received);
    if (reply.seq() != 0 && reply.seq() < seq) continue;  // late reply to a timed-out call
    if (reply.seq() == 0 && reply.error_code() != 0) {
      // The agent refused the connection, or a datagram before reading it, and closes.
      absl::Status refused = StatusFromReply(reply);
      if (broken_.ok()) broken_ = refused;
      return refused;
    }
    if (reply.seq() != seq) {
      return Broken(absl::InternalError(fmt::format(
          "the agent answered seq {} to request seq {}; the stream is out of step", reply.seq(),
          seq)));
    }
    if (reply.error_code() != 0) return StatusFromReply(reply);
    *reply_fds = std::move(received_fds);
    return reply;
  }
}

absl::StatusOr<v1::MemoryHandleInfo> LocalSession::ShareMemory(int fd, const std::string& label) {
  if (fd < 0) {
    return absl::InvalidArgumentError(fmt::format(
        "ShareMemory '{}': descriptor {} is not valid; pass an open memfd, shm or hugetlbfs "
        "file descriptor",
        label, fd));
  }
  v1::SessionRequest request;
  request.mutable_share()->set_label(label);
  std::vector<UniqueFd> reply_fds;
  ASSIGN_OR_RETURN(v1::SessionReply reply, Call(std::move(request), {fd}, &reply_fds));
  if (!reply.has_memory()) {
    return absl::InternalError(fmt::format(
        "the agent at {} answered share '{}' without memory info; use a client library that "
        "matches the agent",
        path_, label));
  }
  return std::move(*reply.mutable_memory());
}

absl::StatusOr<v1::MemoryHandleInfo> LocalSession::ShareDeviceMemory(int fd, int device,
                                                                     uint64_t bytes,
                                                                     const std::string& label) {
  if (fd < 0) {
    return absl::InvalidArgumentError(fmt::format(
        "ShareDeviceMemory '{}': descriptor {} is not valid; pass the POSIX descriptor of "
        "cuMemExportToShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)",
        label, fd));
  }
  v1::SessionRequest request;
  request.mutable_share_device()->set_label(label);
  request.mutable_share_device()->set_device(device);
  request.mutable_share_device()->set_bytes(bytes);
  std::vector<UniqueFd> reply_fds;
  ASSIGN_OR_RETURN(v1::SessionReply reply, Call(std::move(request), {fd}, &reply_fds));
  if (!reply.has_memory()) {
    return absl::InternalError(fmt::format(
        "the agent at {} answered share_device '{}' without memory info; use a client library "
        "that matches the agent",
        path_, label));
  }
  return std::move(*reply.mutable_memory());
}

absl::StatusOr<std::pair<v1::MemoryHandleInfo, UniqueFd>> LocalSession::AllocateMemory(
    const std::string& label, uint64_t bytes) {
  v1::SessionRequest request;
  request.mutable_allocate()->set_label(label);
  request.mutable_allocate()->set_bytes(bytes);
  std::vector<UniqueFd> reply_fds;
  ASSIGN_OR_RETURN(v1::SessionReply reply, Call(std::move(request), {}, &reply_fds));
  if (!reply.has_memory() || reply_fds.size() != 1) {
    return absl::InternalError(fmt::format(
        "the agent at {} answered allocate '{}' with {} and {} descriptors (expected memory "
        "info and 1); use a client library that matches the agent",
        path_, label, reply.has_memory() ? "memory info" : "no memory info", reply_fds.size()));
  }
  return std::make_pair(std::move(*reply.mutable_memory()), std::move(reply_fds[0]));
}

absl::StatusOr<std::pair<v1::FastPathInfo, std::vector<UniqueFd>>> LocalSession::OpenFastPath(
    const v1::OpenFastPathRequest& open) {
  v1::SessionRequest request;
  *request.mutable_open_fast_path() = open;
  std::vector<UniqueFd> reply_fds;
  ASSIGN_OR_RETURN(v1::SessionReply reply, Call(std::move(request), {}, &reply_fds));
  if (!reply.has_fast_path() || reply_fds.size() != 3) {
    return absl::InternalError(fmt::format(
        "the agent at {} answered open_fast_path with {} and {} descriptors (expected fast "
        "path info and 3); use a client library that matches the agent",
        path_, reply.has_fast_path() ? "fast path info" : "no fast path info", reply_fds.size()));
  }
  return std::make_pair(std::move(*reply.mutable_fast_path()), std::move(reply_fds));
}

absl::StatusOr<v1::FastPathClosed> LocalSession::CloseFastPath(uint32_t timeout_ms) {
  v1::SessionRequest request;
  request.mutable_close_fast_path();
  std::vector<UniqueFd> reply_fds;
  ASSIGN_OR_RETURN(v1::SessionReply reply,
                   Call(std::move(request), {}, &reply_fds, timeout_ms));
  if (!reply.has_fast_path_closed()) {
    // An agent that parsed the request as an unknown field answers an error, not this.
    return absl::InternalError(fmt::format(
        "the agent at {} answered close_fast_path without FastPathClosed; use a client "
        "library that matches the agent",
        path_));
  }
  return std::move(*reply.mutable_fast_path_closed());
}

absl::Status LocalSession::FreeMemory(uint64_t handle) {
  v1::SessionRequest request;
  request.mutable_free()->set_handle(handle);
  std::vector<UniqueFd> reply_fds;
  return Call(std::move(request), {}, &reply_fds).status();
}

absl::StatusOr<std::vector<std::pair<uint64_t, UniqueFd>>> LocalSession::PeerMemory(
    const std::vector<uint64_t>& memory_ids) {
  std::vector<std::pair<uint64_t, UniqueFd>> result;
  result.reserve(memory_ids.size());
  for (size_t begin = 0; begin < memory_ids.size(); begin += kMaxSessionFds) {
    const size_t end = std::min(memory_ids.size(), begin + kMaxSessionFds);
    v1::SessionRequest request;
    for (size_t i = begin; i < end; ++i) {
      request.mutable_peer_memory()->add_memory_ids(memory_ids[i]);
    }
    std::vector<UniqueFd> reply_fds;
    ASSIGN_OR_RETURN(v1::SessionReply reply, Call(std::move(request), {}, &reply_fds));
    const size_t asked = end - begin;
    const auto& ids = reply.peer_memory().memory_ids();
    bool in_order = reply.has_peer_memory() && static_cast<size_t>(ids.size()) == asked &&
                    reply_fds.size() == asked;
    for (size_t i = 0; in_order && i < asked; ++i) {
      in_order = ids[static_cast<int>(i)] == memory_ids[begin + i];
    }
    if (!in_order) {
      return absl::InternalError(fmt::format(
          "the agent at {} answered peer_memory for {} ids with {} ids and {} descriptors, not "
          "one per id in the order asked; use a client library that matches the agent",
          path_, asked, ids.size(), reply_fds.size()));
    }
    for (size_t i = 0; i < asked; ++i) {
      result.emplace_back(memory_ids[begin + i], std::move(reply_fds[i]));
    }
  }
  return result;
}

absl::StatusOr<std::vector<LocalSession::PeerDeviceMemory>> LocalSession::PeerDeviceMemories(
    const std::vector<uint64_t>& device_memory_ids) {
  std::vector<PeerDeviceMemory> result;
  result.reserve(device_memory_ids.size());
  for (size_t begin = 0; begin < device_memory_ids.size(); begin += kMaxSessionFds) {
    const size_t end = std::min(device_memory_ids.size(), begin + kMaxSessionFds);
    v1::SessionRequest request;
    for (size_t i = begin; i < end; ++i) {
      request.mutable_peer_memory()->add_device_memory_ids(device_memory_ids[i]);
    }
    std::vector<UniqueFd> reply_fds;
    ASSIGN_OR_RETURN(v1::SessionReply reply, Call(std::move(request), {}, &reply_fds));
    const size_t asked = end - begin;
    const v1::PeerMemoryReply& out = reply.peer_memory();
    const auto n = static_cast<int>(asked);
    bool in_order = reply.has_peer_memory() && out.memory_ids_size() == 0 &&
                    out.device_memory_ids_size() == n && out.device_bytes_size() == n &&
                    out.devices_size() == n && reply_fds.size() == asked;
    for (size_t i = 0; in_order && i < asked; ++i) {
      in_order = out.device_memory_ids(static_cast<int>(i)) == device_memory_ids[begin + i];
    }
    if (!in_order) {
      return absl::InternalError(fmt::format(
          "the agent at {} answered peer_memory for {} device memory ids with {} ids and {} "
          "descriptors, not one per id in the order asked; use an agent that shares CUDA VMM "
          "memory with same-host peers (or one that matches this agent)",
          path_, asked, out.device_memory_ids_size(), reply_fds.size()));
    }
    for (size_t i = 0; i < asked; ++i) {
      const int j = static_cast<int>(i);
      result.push_back(PeerDeviceMemory{device_memory_ids[begin + i], std::move(reply_fds[i]),
                                        out.device_bytes(j), out.devices(j)});
    }
  }
  return result;
}

}  // namespace kvagent::client
