// Who holds a TCP socket of this host, asked of the kernel over NETLINK_SOCK_DIAG
// (inet_diag) instead of read from /proc/net/tcp{,6}: reading those files makes the
// kernel print every TCP socket of the namespace (about 4.5 ms on an idle test
// machine, and growing with the node's connections), once per UCX TCP connection the
// guard checks (ucx_tcp_guard.h). inet_diag answers one exact socket by its four-tuple
// with a hash lookup, and the listening sockets without walking the established ones.
// Each call answers nullopt when netlink cannot be asked (no sock_diag in the kernel,
// a seccomp filter): the caller reads /proc then.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <optional>
#include <utility>
#include <vector>

namespace kvagent::transport {

// What the kernel says of the live socket whose local address is `local_end` and whose
// remote address is `remote_end` (both IPv4, or both IPv6): its owner's uid, or none
// (no such socket, or one closed and waiting out its state: inode 0, its uid no longer
// says who holds it). nullopt: netlink could not be asked.
struct DiagOwner {
  std::optional<uid_t> uid;
};
std::optional<DiagOwner> DiagSocketOwner(const sockaddr_storage& local_end,
                                         const sockaddr_storage& remote_end);

// The live sockets of `family` (AF_INET or AF_INET6) listening at `to`'s port on its
// address or on the family's wildcard address, and for an IPv4 `to` among IPv6 sockets,
// on its IPv4-mapped form (dual-stack): each one's inode and owner's uid, as
// ucx_tcp_guard's internal::Listeners reads them from /proc/net/tcp or tcp6. nullopt:
// netlink could not be asked (or an IPv6 `to` among IPv4 sockets).
std::optional<std::vector<std::pair<unsigned long long, uid_t>>> DiagListeners(
    const sockaddr_storage& to, int family);

}  // namespace kvagent::transport
