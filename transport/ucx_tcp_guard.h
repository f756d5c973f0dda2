// Who may connect to UCX's TCP transport in this process.
//
// UCT's tcp interface listens on the data interface (loopback for an agent without a
// network door) and takes a connection from anyone who reaches the port: no worker
// address, key or secret is asked for at that level. What a connection may then send
// includes UCT's own put request, which UCX 1.13 serves by copying its payload to the
// address it names, anywhere in this process, with no handler kvagent could check
// (UCX_TCP_PUT_ENABLE=n does not stop it). A process of any local user, given the
// port, wrote 16 bytes into a root kvagentd's stack that way.
//
// The guard stands in front of UCX's accept(): a connection from this host (a
// loopback address or one of this host's) is kept only when the socket that made it
// belongs to an allowed uid (the agent's own and --peer-uids, as for same-host peers
// on the local door); any other is closed before UCX reads a byte of it, counted and
// logged. Connections from other hosts pass: the data network is trusted
// (docs/SECURITY.md, "Out of scope"; firewall UCX's ports to the fleet).
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace kvagent::transport {

// Turns the guard on for every later accept() in this process (UCX's libucs is the
// only caller of accept() in kvagentd: gRPC and kvagent's own doors call accept4),
// letting local connections only from `allowed_uids`. Call before any UCX worker.
// Needs transport:ucx_tcp_guard_accept linked into the binary (kvagentd does).
void GuardUcxTcpAccepts(std::set<uid_t> allowed_uids);

// Whether the guard is on and its accept() stands in front of UCX's (false when the
// binary was linked without it: then nothing is checked).
bool UcxTcpGuarded();

// Connections the guard closed.
uint64_t UcxTcpRefusedConnections();

// What the guard decides for an accepted TCP connection `fd` (called by the accept()
// stand-in; exposed for tests): true to keep it.
bool UcxTcpAdmit(int fd);

// Called once by the accept() stand-in (transport/ucx_tcp_guard_accept.cc) when the
// binary holds it.
void NoteUcxTcpAcceptStandIn();

namespace internal {

// One socket as /proc/net/tcp or tcp6 lists it: addresses in the kernel's hex form
// ("0100007F:DF35"), the state in hex ("0A": listening), the owner's uid and the
// socket's inode (0 once no process holds it).
struct ProcTcpEntry {
  std::string local;
  std::string remote;
  std::string state;
  uid_t uid = 0;
  unsigned long long inode = 0;
};

// Every socket line of the text of /proc/net/tcp or tcp6 (the header skipped, lines
// that do not parse left out).
std::vector<ProcTcpEntry> ProcNetTcpEntries(std::string_view text);

// The owner (uid) of the live socket on this host whose local address is `peer` and
// whose remote address is `local`, from the text of /proc/net/tcp or /proc/net/tcp6;
// nullopt when none is listed or its owner is gone (inode 0: a closed socket waiting
// out its state, whose uid no longer says who sent).
std::optional<uid_t> ConnectorUid(std::string_view proc_net_tcp, const sockaddr_storage& peer,
                                  const sockaddr_storage& local);

}  // namespace internal
}  // namespace kvagent::transport
