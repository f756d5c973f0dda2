#include "transport/tcp_diag.h"

#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "absl/functional/function_ref.h"

namespace kvagent::transport {
namespace {

// The kernel's TCP states (include/net/tcp_states.h): listening, and every state.
constexpr uint32_t kTcpListen = 10;
constexpr uint32_t kAllStates = ~0u;

struct DiagRequest {
  nlmsghdr header;
  inet_diag_req_v2 body;
};

// Sends `request` to the kernel and calls `each` for every socket it answers. True
// once the kernel answered in full (`*error` then holds its errno, 0 for none: ENOENT
// for an exact socket it does not have); false when netlink could not be asked or its
// answer broke off (a dump cut short would leave listeners out).
bool Ask(DiagRequest request, absl::FunctionRef<void(const inet_diag_msg&)> each, int* error) {
  *error = 0;
  const int fd = ::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (fd < 0) return false;
  // The kernel answers at once; a second is a bound, not a wait.
  const timeval limit{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
  request.header.nlmsg_len = sizeof request;
  request.header.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  request.header.nlmsg_seq = 1;
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  ssize_t sent = 0;
  do {
    sent = ::sendto(fd, &request, sizeof request, 0, reinterpret_cast<sockaddr*>(&kernel),
                    sizeof kernel);
  } while (sent < 0 && errno == EINTR);
  if (sent != static_cast<ssize_t>(sizeof request)) {
    ::close(fd);
    return false;
  }
  const bool dump = (request.header.nlmsg_flags & NLM_F_DUMP) != 0;
  alignas(nlmsghdr) char buffer[16384];
  bool done = false;
  while (!done) {
    ssize_t n = 0;
    do {
      n = ::recvfrom(fd, buffer, sizeof buffer, 0, nullptr, nullptr);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) break;
    size_t left = static_cast<size_t>(n);
    for (auto* message = reinterpret_cast<nlmsghdr*>(buffer); NLMSG_OK(message, left);
         message = NLMSG_NEXT(message, left)) {
      if (message->nlmsg_seq != request.header.nlmsg_seq) continue;
      if (message->nlmsg_type == NLMSG_DONE) {
        // A dump's end carries its status: 0, or the error that ended it.
        if (message->nlmsg_len >= NLMSG_LENGTH(sizeof(int))) {
          int status = 0;
          std::memcpy(&status, NLMSG_DATA(message), sizeof status);
          if (status < 0) *error = -status;
        }
        done = true;
        break;
      }
      if (message->nlmsg_type == NLMSG_ERROR) {
        if (message->nlmsg_len >= NLMSG_LENGTH(sizeof(nlmsgerr))) {
          *error = -static_cast<const nlmsgerr*>(NLMSG_DATA(message))->error;
        } else {
          *error = EPROTO;
        }
        done = true;
        break;
      }
      if (message->nlmsg_type == SOCK_DIAG_BY_FAMILY &&
          message->nlmsg_len >= NLMSG_LENGTH(sizeof(inet_diag_msg))) {
        each(*static_cast<const inet_diag_msg*>(NLMSG_DATA(message)));
      }
      // An exact request is answered by one message, not ended by NLMSG_DONE.
      if (!dump && (message->nlmsg_flags & NLM_F_MULTI) == 0) {
        done = true;
        break;
      }
    }
  }
  ::close(fd);
  // A request the kernel does not take (no inet_diag for the family or protocol): the
  // caller reads /proc instead.
  return done && *error != EINVAL && *error != EOPNOTSUPP && *error != EPROTONOSUPPORT;
}

DiagRequest Request(uint8_t family, uint32_t states, bool dump) {
  DiagRequest request{};
  request.header.nlmsg_flags = NLM_F_REQUEST | (dump ? NLM_F_DUMP : 0);
  request.body.sdiag_family = family;
  request.body.sdiag_protocol = IPPROTO_TCP;
  request.body.idiag_states = states;
  request.body.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
  request.body.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  return request;
}

// The address and port of `a` in inet_diag's form (four 32-bit words, network order).
void SetEnd(const sockaddr_storage& a, __be32 address[4], __be16* port) {
  if (a.ss_family == AF_INET) {
    const auto& four = reinterpret_cast<const sockaddr_in&>(a);
    std::memcpy(&address[0], &four.sin_addr, 4);
    *port = four.sin_port;
  } else {
    const auto& six = reinterpret_cast<const sockaddr_in6&>(a);
    std::memcpy(address, &six.sin6_addr, 16);
    *port = six.sin6_port;
  }
}

// Whether the kernel answers inet_diag for TCP at all, asked once (a dump of the IPv4
// listening sockets): a kernel without inet_diag or tcp_diag answers every request
// ENOENT, which an exact lookup would take for "no such socket".
bool DiagWorks() {
  static const bool works = [] {
    int error = 0;
    return Ask(Request(AF_INET, 1u << kTcpListen, /*dump=*/true), [](const inet_diag_msg&) {},
               &error) &&
           error == 0;
  }();
  return works;
}

}  // namespace

std::optional<DiagOwner> DiagSocketOwner(const sockaddr_storage& local_end,
                                         const sockaddr_storage& remote_end) {
  if ((local_end.ss_family != AF_INET && local_end.ss_family != AF_INET6) ||
      remote_end.ss_family != local_end.ss_family) {
    return std::nullopt;
  }
  if (!DiagWorks()) return std::nullopt;
  DiagRequest request =
      Request(static_cast<uint8_t>(local_end.ss_family), kAllStates, /*dump=*/false);
  SetEnd(local_end, request.body.id.idiag_src, &request.body.id.idiag_sport);
  SetEnd(remote_end, request.body.id.idiag_dst, &request.body.id.idiag_dport);
  DiagOwner owner;
  int error = 0;
  const __be16 remote_port = request.body.id.idiag_dport;
  const bool asked = Ask(
      request,
      [&](const inet_diag_msg& m) {
        // The kernel's lookup falls back to a listener on the local port when no
        // connection has these ends: only the connection counts.
        if (m.idiag_state == kTcpListen || m.id.idiag_dport != remote_port) return;
        if (m.idiag_inode != 0) owner.uid = static_cast<uid_t>(m.idiag_uid);
      },
      &error);
  if (!asked) return std::nullopt;
  if (error != 0 && error != ENOENT) return std::nullopt;
  return owner;
}

std::optional<std::vector<std::pair<unsigned long long, uid_t>>> DiagListeners(
    const sockaddr_storage& to, int family) {
  if ((to.ss_family != AF_INET && to.ss_family != AF_INET6) ||
      (family != AF_INET && family != AF_INET6) ||
      (family == AF_INET && to.ss_family != AF_INET)) {
    return std::nullopt;
  }
  __be32 want[4] = {};
  __be16 port = 0;
  SetEnd(to, want, &port);
  std::vector<std::pair<unsigned long long, uid_t>> listeners;
  int error = 0;
  const bool asked = Ask(
      Request(static_cast<uint8_t>(family), 1u << kTcpListen, /*dump=*/true),
      [&](const inet_diag_msg& m) {
        if (m.id.idiag_sport != port || m.idiag_inode == 0) return;
        const __be32* at = m.id.idiag_src;
        const bool wildcard = family == AF_INET
                                  ? at[0] == 0
                                  : at[0] == 0 && at[1] == 0 && at[2] == 0 && at[3] == 0;
        bool match = false;
        if (family == AF_INET) {
          match = wildcard || at[0] == want[0];
        } else if (to.ss_family == AF_INET6) {
          match = wildcard || std::memcmp(at, want, 16) == 0;
        } else {
          // An IPv4 `to` on an IPv6 socket: the wildcard, or its IPv4-mapped form.
          match = wildcard ||
                  (at[0] == 0 && at[1] == 0 && at[2] == htonl(0xFFFF) && at[3] == want[0]);
        }
        if (match) listeners.emplace_back(m.idiag_inode, static_cast<uid_t>(m.idiag_uid));
      },
      &error);
  if (!asked || error != 0) return std::nullopt;
  return listeners;
}

}  // namespace kvagent::transport
