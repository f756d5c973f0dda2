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
// logged. A connection from another host is kept only when it comes from an address
// of an authenticated peer: the source address of its metadata calls to this agent, or
// a data address it announced (GetMetadataRequest/AgentMetadata.data_addresses), or
// one this agent dialled; with RemoteUcxTcp::kAny (--ucx-tcp-remote any) every other
// host passes, for a data network fenced by other means.
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvagent::transport {

// Whom connections from other hosts are kept from.
enum class RemoteUcxTcp {
  kPeers,  // addresses of authenticated peers only (AllowUcxTcpHosts)
  kAny,    // every host (the data network is fenced by other means)
};

// Turns the guard on for every later accept() in this process (UCX's libucs is the
// only caller of accept() in kvagentd: gRPC and kvagent's own doors call accept4),
// letting local connections only from `allowed_uids`, and remote ones as `remote`
// says. Call before any UCX worker. Needs transport:ucx_tcp_guard_accept linked into
// the binary (kvagentd does).
void GuardUcxTcpAccepts(std::set<uid_t> allowed_uids,
                        RemoteUcxTcp remote = RemoteUcxTcp::kPeers);

// The hosts a peer's UCX may connect from, under `owner` (who vouched for them: the
// peer's authenticated identity): IP literals ("10.0.0.7", "fd00::7", "[fd00::7]");
// anything else is ignored. Replaces what `owner` had. At most kMaxHostsPerOwner are
// kept (the first ones; no more than 4 x kMaxHostsPerOwner entries are read) and
// kMaxOwners owners are held: a new owner past that drops
// the one allowed longest ago. Returns how many addresses it kept.
inline constexpr size_t kMaxHostsPerOwner = 16;
inline constexpr size_t kMaxOwners = 16384;  // two a peer: as caller and as dialled
size_t AllowUcxTcpHosts(const std::string& owner, const std::vector<std::string>& addresses);

// Drops what `owner` vouched for (a peer that went: this agent disconnected from it, or
// it stopped watching and polling this agent). Its hosts stay allowed only as long as
// another owner vouches for them. True when `owner` had a list.
bool ForgetUcxTcpHosts(const std::string& owner);

// The owners kvagent's two sources use: a peer calling this agent's metadata door,
// under its authenticated identity, and a peer this agent dialled, under its name.
std::string UcxTcpCallerOwner(std::string_view identity);
std::string UcxTcpDialledOwner(std::string_view peer_name);

// Whether connections from other hosts are checked (kPeers), and the distinct hosts
// allowed now.
bool UcxTcpRemoteChecked();
size_t UcxTcpAllowedHosts();

// Whether the guard is on and its accept() stands in front of UCX's (false when the
// binary was linked without it: then nothing is checked).
bool UcxTcpGuarded();

// Connections the guard closed.
uint64_t UcxTcpRefusedConnections();
// Of those, the ones this process's UCX dialled, closed at what the peer answered.
uint64_t UcxTcpRefusedDialledConnections();

// Where a connection to `to` would land on this host: the sockets listening on its port
// at its address or a wildcard one (tcp_diag.h's DiagListeners; /proc/net/tcp and tcp6
// where netlink cannot be asked), each as its inode and its
// owner's uid; an empty list when none listens there, nullopt when `to` is not an
// address of this host (nor loopback) or not IPv4 or IPv6. For the same-host guard
// (ucx_hardening.h), which asks who holds them.
std::optional<std::vector<std::pair<unsigned long long, uid_t>>> UcxTcpLocalListeners(
    const sockaddr* to, socklen_t length);
// `to` as "host:port" ("[host]:port" for IPv6), for messages.
std::string UcxTcpAddressText(const sockaddr* to, socklen_t length);

// What the guard decides for an accepted TCP connection `fd` (called by the accept()
// stand-in; exposed for tests): true to keep it. A kept connection's stream is watched
// (below).
bool UcxTcpAdmit(int fd);

// What comes in on a connection the guard kept is checked as UCT reads it, before UCT
// parses it: the recv() stand-in (transport/ucx_tcp_guard_accept.cc) hands each read
// of a watched descriptor to UcxTcpRecv. UCT's tcp stream there is an 8-byte magic
// number, then frames of a 1-byte id, a 4-byte length and that many bytes (a put
// request's frame is followed by its payload, unframed). UCT 1.13 aborts the process
// (a failed assertion) on a frame body longer than its receive buffer
// (UCX_TCP_RX_SEG_SIZE: UCT adds the header to it), on an id it does not know (past the
// active messages': 32 connection manager, 33 put request, 34 put acknowledgement, 35
// keepalive, whose body UCT skips), on a put request or acknowledgement of another
// length than its own, on a connection-manager frame shorter than its 4-byte event, on
// a connection request (event 1) of another length than its own, naming an address
// of a family other than IPv4 or IPv6, or asking for UCT's connect-to-endpoint mode
// (flag 1: it names an endpoint by an id the guard cannot check, and UCT aborts on
// one it does not have; kvagent's agents send flags 0), on a second request on one
// connection in some states (UCT sends one), and on a put request before the
// connection's request (it answers on a connection not yet its own): any process
// that connects could end the agent with a few bytes. These rules are held to the
// installed libuct by tests/security:uct_frames_test. The
// connection is closed at such a frame instead (the read says end of stream, the
// socket is shut down), before UCT sees it. A put request's address is not checked:
// kvagent's own agents send put requests over tcp (with a large staged chunk, most
// likely UCP's rendezvous into a receive buffer UCP registered itself) although they
// start UCX with UCX_TCP_PUT_ENABLE=n.
// Counted in UcxTcpRefusedConnections and logged. Descriptors from 65,536 up cannot
// be watched: such a connection is refused.
// The connections this process's UCX dials are watched too (WatchDialledUcxTcpStream):
// the peer answers on them with UCT frames, and a dialling UCT 1.13 aborts on the same
// bad frames (a body past its receive buffer, an unknown id, a short connection-manager
// frame, a put request or acknowledgement of another length, a connection request
// formed otherwise than above or not naming its own endpoint, below); a put request it
// serves at any point.
// No magic number comes that way. A peer is chosen by whoever asks this agent to
// connect, and its worker address names where UCX dials: one answer of a few bytes
// ended the dialling agent. A connection request there is passed only as UCT 1.13
// takes one (a peer's UCT sends one when both sides connected at once): after the
// peer acknowledged UCT's own request, naming UCT's own connection (the sequence
// number UCT sent in its request, which the send() stand-in reads: UcxTcpSend) and the
// address UCT dialled; UCT aborts on any other.
using RecvFn = ssize_t (*)(int, void*, size_t, int);
ssize_t UcxTcpRecv(int fd, void* buffer, size_t length, int flags, RecvFn next);
// What this process's UCX sends on a connection it dialled is read as it goes (the
// send() stand-in, transport/ucx_tcp_guard_accept.cc, hands each send to UcxTcpSend),
// as far as UCT's own connection request: the connection a peer's request there must
// name. Other descriptors go straight to `next`.
using SendFn = ssize_t (*)(int, const void*, size_t, int);
ssize_t UcxTcpSend(int fd, const void* buffer, size_t length, int flags, SendFn next);
// A watched descriptor is closed (the close() stand-in): no longer watched.
void ForgetUcxTcpStream(int fd);
// Watches TCP connection `fd`, which this process's UCX is dialling to `to` (called by
// the connect() stand-in for UCX's calls, transport/same_host_stand_in.cc), from its
// first byte. False when it cannot be watched (past the table; counted and logged): the
// stand-in then refuses the connect. True, watching nothing, while the guard is off.
bool WatchDialledUcxTcpStream(int fd, const sockaddr* to, socklen_t length);
// Called once by the recv()/close() stand-ins when the binary holds them.
void NoteUcxTcpRecvStandIn();

// Called once by the accept() stand-in (transport/ucx_tcp_guard_accept.cc) when the
// binary holds it.
void NoteUcxTcpAcceptStandIn();

// The host of a gRPC peer string (grpc::ServerContext::peer(): "ipv4:10.0.0.7:5000",
// "ipv6:[fd00::7]:5000", "ipv6:%5Bfd00::7%5D:5000"); "" for a Unix socket or a form
// it does not know.
std::string HostOfGrpcPeer(std::string_view peer);

namespace internal {

// The checks UcxTcpRecv makes, and where it is in one stream.
struct StreamRules {
  // The longest frame body UCT takes: UCX_TCP_RX_SEG_SIZE (UCT's receive buffer is that
  // and a frame header).
  uint64_t max_frame = 65536;
};
// Rules for UCX_TCP_RX_SEG_SIZE=`rx_seg_size` (null: unset, UCX's 64 KiB); nullopt when
// the text is not a size this agent reads.
std::optional<StreamRules> RulesForRxSegSize(const char* rx_seg_size);
struct StreamCheck {
  enum Phase : uint8_t {
    kMagic = 0,
    kHeader,
    kBody,
    kCmEvent,  // a connection-manager frame's event (or whole request), `left` its body
    kPutHeader,
    kPutData,
    kRefused
  };
  Phase phase = kMagic;
  uint8_t have = 0;       // bytes of a frame header, event, request or put request collected
  uint8_t bytes[48] = {};
  uint64_t left = 8;      // bytes of the magic number, a body or a put's payload to pass
  bool requested = false;  // a connection request came (put requests may follow)
  bool dialled = false;    // this process's UCX dialled it: put requests at any point
  // A connection request's body: its event, flags and endpoint id (13 bytes), then the
  // sender's address as UCT's interface that accepted the connection holds one
  // (sockaddr_in, or sockaddr_in6 on an IPv6 interface: ConnectionRequestBytes).
  uint8_t request_bytes = 13 + 16;
  // A dialled connection only. Whether the peer acknowledged UCT's request (event 2 or
  // 3: UCT's endpoint is connected).
  bool acknowledged = false;
  // The address UCT dialled (family 0: neither IPv4 nor IPv6).
  sockaddr_storage to{};
  // What UCT sent first (NoteSent): its magic number, a frame header and its request.
  uint8_t sent_have = 0;
  uint8_t sent[8 + 5 + 13 + 28] = {};
};
// The check of a connection this process's UCX dialled to `to` (IPv4 or IPv6; another
// family leaves the address unset, and a peer's request is then refused): frames from
// the first byte, put requests at any point.
StreamCheck DialledStreamCheck(const sockaddr* to, socklen_t length);
// Notes `n` bytes this process's UCX sent on the dialled connection of `check` (only
// its first ones are kept: UCT's magic number and connection request).
void NoteSent(StreamCheck* check, const uint8_t* data, size_t n);
// StreamCheck::request_bytes for a connection accepted at a local address of `family`.
uint8_t ConnectionRequestBytes(int family);
// Feeds `n` bytes read from the stream: "" while it is fine, else why it is refused
// (and it stays refused).
std::string FeedStream(StreamCheck* check, const uint8_t* data, size_t n,
                       const StreamRules& rules);
// UCX_TCP_RX_SEG_SIZE's text ("64K", "65536", "1m") in bytes; nullopt for another form.
std::optional<uint64_t> ParseUcxSize(std::string_view text);

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

// Watches descriptors below `slots` only (at most 65,536), so that a test reaches the
// refusal past the table without an open-file limit over 65,536.
void LimitStreamSlotsForTest(int slots);

// `a` with an IPv4-mapped IPv6 address (::ffff:a.b.c.d) as the IPv4 address it maps,
// else `a`: the connecting socket of such a peer is an IPv4 one.
sockaddr_storage Unmapped(const sockaddr_storage& a);

// Every socket line of the text of /proc/net/tcp or tcp6 (the header skipped, lines
// that do not parse left out).
std::vector<ProcTcpEntry> ProcNetTcpEntries(std::string_view text);

// The owner (uid) of the live socket on this host whose local address is `peer` and
// whose remote address is `local`, from the text of /proc/net/tcp or /proc/net/tcp6;
// nullopt when none is listed or its owner is gone (inode 0: a closed socket waiting
// out its state, whose uid no longer says who sent).
std::optional<uid_t> ConnectorUid(std::string_view proc_net_tcp, const sockaddr_storage& peer,
                                  const sockaddr_storage& local);

// The live sockets listening (state 0A) at `to`'s port on its address, on the wildcard
// address of its family, or (for IPv4, in tcp6's text) on its IPv4-mapped form, from
// the text of /proc/net/tcp or tcp6: each one's inode and owner's uid.
std::vector<std::pair<unsigned long long, uid_t>> Listeners(std::string_view proc_net_tcp,
                                                            const sockaddr_storage& to);

}  // namespace internal
}  // namespace kvagent::transport
