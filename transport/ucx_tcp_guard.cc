#include "transport/ucx_tcp_guard.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <uct/api/uct_def.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <sstream>

#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "base/file_text.h"
#include "base/interfaces.h"
#include "base/log.h"
#include "fmt/format.h"
#include "transport/tcp_diag.h"

namespace kvagent::transport {
namespace {

constexpr log::Logger kLog("transport");

using Host = std::array<uint8_t, 16>;  // IPv6, or IPv4 as ::ffff:a.b.c.d

// The hosts one owner vouched for, and when (a tick of AllowUcxTcpHosts calls).
struct Allowed {
  std::vector<Host> hosts;
  uint64_t tick = 0;
};

absl::Mutex g_mu;
std::set<uid_t>* g_allowed ABSL_GUARDED_BY(g_mu) = new std::set<uid_t>();
std::map<std::string, Allowed>* g_hosts ABSL_GUARDED_BY(g_mu) =
    new std::map<std::string, Allowed>();
// The owners by when they were last heard from (the oldest first), and how many owners
// vouch for each host: both kept beside g_hosts, for a lookup and an eviction that do
// not walk every owner.
std::map<uint64_t, std::string>* g_by_tick ABSL_GUARDED_BY(g_mu) =
    new std::map<uint64_t, std::string>();
std::map<Host, uint32_t>* g_host_owners ABSL_GUARDED_BY(g_mu) = new std::map<Host, uint32_t>();
uint64_t g_tick ABSL_GUARDED_BY(g_mu) = 0;

// Forgets what `allowed` vouched for in g_host_owners.
void ReleaseHostsLocked(const Allowed& allowed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_mu) {
  for (const Host& host : allowed.hosts) {
    auto it = g_host_owners->find(host);
    if (it != g_host_owners->end() && --it->second == 0) g_host_owners->erase(it);
  }
}

// Drops owner `it` from g_hosts and the tables kept beside it.
void DropOwnerLocked(std::map<std::string, Allowed>::iterator it)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_mu) {
  ReleaseHostsLocked(it->second);
  g_by_tick->erase(it->second.tick);
  g_hosts->erase(it);
}

std::atomic<bool> g_on{false};
std::atomic<bool> g_remote_checked{true};
std::atomic<uint64_t> g_refused{0};
std::atomic<uint64_t> g_refused_dialled{0};  // of g_refused: streams UCX dialled

// `a` (unmapped) as a Host.
Host HostOf(const sockaddr_storage& a) {
  Host host{};
  const void* address = InAddressOf(reinterpret_cast<const sockaddr*>(&a));
  if (a.ss_family == AF_INET) {
    host[10] = host[11] = 0xff;
    std::memcpy(&host[12], address, 4);
  } else {
    std::memcpy(host.data(), address, 16);
  }
  return host;
}

// An IP literal (IPv6 possibly in brackets) as a Host; nullopt for anything else.
std::optional<Host> ParseHost(std::string text) {
  if (text.size() >= 2 && text.front() == '[' && text.back() == ']') {
    text = text.substr(1, text.size() - 2);
  }
  Host host{};
  in_addr four{};
  if (inet_pton(AF_INET, text.c_str(), &four) == 1) {
    host[10] = host[11] = 0xff;
    std::memcpy(&host[12], &four, 4);
    return host;
  }
  if (inet_pton(AF_INET6, text.c_str(), host.data()) == 1) return host;
  return std::nullopt;
}

bool HostAllowed(const Host& host) {
  absl::MutexLock lock(&g_mu);
  return g_host_owners->count(host) > 0;
}

// The address as /proc/net/tcp{,6} prints it: each 32-bit word of the address as the
// kernel holds it, in %08X, then ':' and the port in %04X.
std::string ProcForm(const sockaddr_storage& a) {
  std::string out;
  uint16_t port = 0;
  if (a.ss_family == AF_INET) {
    const auto& four = reinterpret_cast<const sockaddr_in&>(a);
    uint32_t word = 0;
    std::memcpy(&word, &four.sin_addr, 4);
    out = fmt::format("{:08X}", word);
    port = ntohs(four.sin_port);
  } else {
    const auto& six = reinterpret_cast<const sockaddr_in6&>(a);
    for (int i = 0; i < 4; ++i) {
      uint32_t word = 0;
      std::memcpy(&word, &six.sin6_addr.s6_addr[4 * i], 4);
      out += fmt::format("{:08X}", word);
    }
    port = ntohs(six.sin6_port);
  }
  return fmt::format("{}:{:04X}", out, port);
}

// Whether `a` (unmapped) is an address of this host: loopback, or one of its
// interfaces' addresses.
bool OfThisHost(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) {
    const auto& four = reinterpret_cast<const sockaddr_in&>(a);
    if ((ntohl(four.sin_addr.s_addr) >> 24) == 127) return true;
  } else if (a.ss_family == AF_INET6) {
    const auto& six = reinterpret_cast<const sockaddr_in6&>(a);
    if (IN6_IS_ADDR_LOOPBACK(&six.sin6_addr)) return true;
  }
  const std::optional<std::string> holder =
      InterfaceHolding(a.ss_family, InAddressOf(reinterpret_cast<const sockaddr*>(&a)));
  return !holder.has_value() || !holder->empty();  // cannot tell: treat as local (checked)
}

std::string Text(const sockaddr_storage& a) {
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (a.ss_family == AF_INET) {
    const auto& four = reinterpret_cast<const sockaddr_in&>(a);
    inet_ntop(AF_INET, &four.sin_addr, host, sizeof host);
    port = ntohs(four.sin_port);
    return fmt::format("{}:{}", host, port);
  }
  const auto& six = reinterpret_cast<const sockaddr_in6&>(a);
  inet_ntop(AF_INET6, &six.sin6_addr, host, sizeof host);
  port = ntohs(six.sin6_port);
  return fmt::format("[{}]:{}", host, port);
}

std::atomic<bool> g_stand_in{false};

// The two ends of socket `fd`: false when it has none (not connected).
bool Ends(int fd, sockaddr_storage* peer, sockaddr_storage* local) {
  socklen_t peer_length = sizeof *peer, local_length = sizeof *local;
  return getpeername(fd, reinterpret_cast<sockaddr*>(peer), &peer_length) == 0 &&
         getsockname(fd, reinterpret_cast<sockaddr*>(local), &local_length) == 0;
}

}  // namespace

namespace internal {

sockaddr_storage Unmapped(const sockaddr_storage& a) {
  if (a.ss_family != AF_INET6) return a;
  const auto& six = reinterpret_cast<const sockaddr_in6&>(a);
  if (!IN6_IS_ADDR_V4MAPPED(&six.sin6_addr)) return a;
  sockaddr_storage out{};
  auto& four = reinterpret_cast<sockaddr_in&>(out);
  four.sin_family = AF_INET;
  four.sin_port = six.sin6_port;
  std::memcpy(&four.sin_addr, &six.sin6_addr.s6_addr[12], 4);
  return out;
}

std::vector<ProcTcpEntry> ProcNetTcpEntries(std::string_view text) {
  std::vector<ProcTcpEntry> entries;
  size_t start = text.find('\n');  // the header line
  while (start != std::string_view::npos && start < text.size()) {
    const size_t end = text.find('\n', start + 1);
    const std::string line(
        text.substr(start + 1, end == std::string_view::npos ? std::string_view::npos
                                                              : end - start - 1));
    start = end;
    std::istringstream fields(line);
    ProcTcpEntry entry;
    std::string slot, queues, timer, retransmits;
    unsigned long long uid = 0, timeout = 0;
    if (fields >> slot >> entry.local >> entry.remote >> entry.state >> queues >> timer >>
        retransmits >> uid >> timeout >> entry.inode) {
      entry.uid = static_cast<uid_t>(uid);
      entries.push_back(std::move(entry));
    }
  }
  return entries;
}

std::optional<uid_t> ConnectorUid(std::string_view proc_net_tcp, const sockaddr_storage& peer,
                                  const sockaddr_storage& local) {
  const std::string want_local = ProcForm(peer);
  const std::string want_remote = ProcForm(local);
  for (const ProcTcpEntry& entry : ProcNetTcpEntries(proc_net_tcp)) {
    if (entry.local != want_local || entry.remote != want_remote) continue;
    if (entry.inode == 0) return std::nullopt;  // closed: its uid no longer says who sent
    return entry.uid;
  }
  return std::nullopt;
}

std::vector<std::pair<unsigned long long, uid_t>> Listeners(std::string_view proc_net_tcp,
                                                            const sockaddr_storage& to) {
  const std::string exact = ProcForm(to);
  const std::string port = exact.substr(exact.find(':'));
  std::vector<std::string> forms{exact, std::string(32, '0') + port};
  if (to.ss_family == AF_INET) {
    forms.push_back("00000000" + port);
    // A dual-stack listener lists an IPv4 address as ::ffff:a.b.c.d (the kernel's words).
    forms.push_back("0000000000000000FFFF0000" + exact);
  }
  std::vector<std::pair<unsigned long long, uid_t>> listeners;
  for (const ProcTcpEntry& entry : ProcNetTcpEntries(proc_net_tcp)) {
    if (entry.state != "0A" || entry.inode == 0) continue;
    if (std::find(forms.begin(), forms.end(), entry.local) != forms.end()) {
      listeners.emplace_back(entry.inode, entry.uid);
    }
  }
  return listeners;
}

}  // namespace internal

std::optional<std::vector<std::pair<unsigned long long, uid_t>>> UcxTcpLocalListeners(
    const sockaddr* to, socklen_t length) {
  if (to == nullptr || (to->sa_family != AF_INET && to->sa_family != AF_INET6) ||
      length > sizeof(sockaddr_storage)) {
    return std::nullopt;
  }
  sockaddr_storage address{};
  std::memcpy(&address, to, length);
  address = internal::Unmapped(address);
  if (!OfThisHost(address)) return std::nullopt;
  // Each family's listening sockets, asked of the kernel's socket diagnostics, else
  // read from /proc (each file costs milliseconds: the kernel prints its whole table).
  auto of_family = [&address](int family) {
    if (auto asked = DiagListeners(address, family); asked.has_value()) return *std::move(asked);
    return internal::Listeners(
        ReadFileText(family == AF_INET ? "/proc/net/tcp" : "/proc/net/tcp6").value_or(""),
        address);
  };
  // An IPv4 address is looked for among IPv6 sockets (a dual-stack listener) only when
  // no IPv4 one listens there.
  std::vector<std::pair<unsigned long long, uid_t>> listeners;
  if (address.ss_family == AF_INET) listeners = of_family(AF_INET);
  if (listeners.empty()) listeners = of_family(AF_INET6);
  return listeners;
}

std::string UcxTcpAddressText(const sockaddr* to, socklen_t length) {
  if (to == nullptr || length > sizeof(sockaddr_storage)) return "?";
  sockaddr_storage address{};
  std::memcpy(&address, to, length);
  return Text(address);
}

void InstallStreamWatch();  // below

void GuardUcxTcpAccepts(std::set<uid_t> allowed_uids, RemoteUcxTcp remote) {
  InstallStreamWatch();
  {
    absl::MutexLock lock(&g_mu);
    *g_allowed = std::move(allowed_uids);
  }
  g_remote_checked.store(remote == RemoteUcxTcp::kPeers);
  g_on.store(true);
  if (!g_stand_in.load()) {
    kLog.Warn("UCX TCP: this binary lacks the accept() guard (transport:ucx_tcp_guard_accept): "
              "any local user who reaches UCX's TCP port can write this process's memory");
  }
}

size_t AllowUcxTcpHosts(const std::string& owner, const std::vector<std::string>& addresses) {
  std::vector<Host> hosts;
  size_t looked = 0;
  for (const std::string& address : addresses) {
    // A peer's list is its own to fill: past a few times the cap, the rest is not read.
    if (hosts.size() == kMaxHostsPerOwner || ++looked > 4 * kMaxHostsPerOwner) break;
    const std::optional<Host> host = ParseHost(address);
    if (host && std::find(hosts.begin(), hosts.end(), *host) == hosts.end()) {
      hosts.push_back(*host);
    }
  }
  absl::MutexLock lock(&g_mu);
  auto it = g_hosts->find(owner);
  if (it == g_hosts->end()) {
    if (g_hosts->size() >= kMaxOwners) {
      const std::string& oldest = g_by_tick->begin()->second;
      kLog.Warn("UCX TCP: {} peers vouch for hosts, the most kept: '{}', the one heard from "
                "longest ago, no longer does (its hosts connect again once it fetches this "
                "agent's metadata)",
                kMaxOwners, oldest);
      DropOwnerLocked(g_hosts->find(oldest));
    }
    it = g_hosts->emplace(owner, Allowed{}).first;
  } else {
    ReleaseHostsLocked(it->second);
    g_by_tick->erase(it->second.tick);
  }
  for (const Host& host : hosts) ++(*g_host_owners)[host];
  it->second.hosts = std::move(hosts);
  it->second.tick = ++g_tick;
  g_by_tick->emplace(it->second.tick, owner);
  return it->second.hosts.size();
}

bool ForgetUcxTcpHosts(const std::string& owner) {
  absl::MutexLock lock(&g_mu);
  auto it = g_hosts->find(owner);
  if (it == g_hosts->end()) return false;
  DropOwnerLocked(it);
  return true;
}

std::string UcxTcpCallerOwner(std::string_view identity) {
  return fmt::format("caller {}", identity);
}

std::string UcxTcpDialledOwner(std::string_view peer_name) {
  return fmt::format("dialled {}", peer_name);
}

bool UcxTcpRemoteChecked() { return g_remote_checked.load(); }

size_t UcxTcpAllowedHosts() {
  absl::MutexLock lock(&g_mu);
  return g_host_owners->size();
}

std::string HostOfGrpcPeer(std::string_view peer) {
  const std::string_view scheme = peer.substr(0, 5);
  if (scheme != "ipv4:" && scheme != "ipv6:") return "";
  // gRPC percent-encodes an IPv6 address's brackets (and a zone's '%').
  bool had_port = false;
  const std::string host = HostOfDialled(
      absl::StrReplaceAll(std::string(peer), {{"%5B", "["}, {"%5D", "]"}, {"%5b", "["},
                                              {"%5d", "]"}, {"%25", "%"}}),
      &had_port);
  return had_port && ParseHost(host) ? host : "";
}

bool UcxTcpGuarded() { return g_on.load() && g_stand_in.load(); }

uint64_t UcxTcpRefusedConnections() { return g_refused.load(std::memory_order_relaxed); }

uint64_t UcxTcpRefusedDialledConnections() {
  return g_refused_dialled.load(std::memory_order_relaxed);
}

void NoteUcxTcpAcceptStandIn() { g_stand_in.store(true); }

namespace {
bool AdmitPeer(int fd);
bool WatchStream(int fd, bool dialled, const sockaddr* to = nullptr, socklen_t length = 0);
}  // namespace

bool UcxTcpAdmit(int fd) {
  if (!g_on.load(std::memory_order_relaxed)) return true;
  return AdmitPeer(fd) && WatchStream(fd, /*dialled=*/false);
}

bool WatchDialledUcxTcpStream(int fd, const sockaddr* to, socklen_t length) {
  if (!g_on.load(std::memory_order_relaxed)) return true;
  return WatchStream(fd, /*dialled=*/true, to, length);
}

namespace {
bool AdmitPeer(int fd) {
  sockaddr_storage peer{}, local{};
  if (!Ends(fd, &peer, &local)) {
    return true;  // not a connected socket: nothing to check (UCX fails it itself)
  }
  if (peer.ss_family != AF_INET && peer.ss_family != AF_INET6) return true;
  const sockaddr_storage from = internal::Unmapped(peer);
  const sockaddr_storage to = internal::Unmapped(local);
  if (!OfThisHost(from)) {
    if (!g_remote_checked.load(std::memory_order_relaxed) || HostAllowed(HostOf(from))) {
      return true;
    }
    const uint64_t n = g_refused.fetch_add(1, std::memory_order_relaxed) + 1;
    if (log::Sampled(n)) {
      kLog.Warn("UCX TCP: refused a connection from {} to {} ({} so far): that host is no "
                "authenticated peer's (none fetched this agent's metadata from it or announced "
                "it as a data address), and UCX lets whoever connects write anywhere in this "
                "process; a peer's UCX connects once it has fetched this agent's metadata, or "
                "start kvagentd with --ucx-tcp-remote any where only the fleet reaches UCX's "
                "ports",
                Text(peer), Text(local), n);
    }
    return false;
  }
  // The connecting socket, asked of the kernel by its two ends (one lookup); without
  // socket diagnostics, found in /proc (the whole table printed).
  std::optional<uid_t> uid;
  if (std::optional<DiagOwner> owner = DiagSocketOwner(from, to); owner.has_value()) {
    uid = owner->uid;
  } else {
    const std::string table =
        ReadFileText(from.ss_family == AF_INET ? "/proc/net/tcp" : "/proc/net/tcp6")
            .value_or("");
    uid = internal::ConnectorUid(table, from, to);
  }
  bool allowed = false;
  {
    absl::MutexLock lock(&g_mu);
    allowed = uid.has_value() && g_allowed->count(*uid) > 0;
  }
  if (allowed) return true;
  const uint64_t n = g_refused.fetch_add(1, std::memory_order_relaxed) + 1;
  if (log::Sampled(n)) {
    kLog.Warn("UCX TCP: refused a connection from {} to {} ({} so far): {}; a local process "
              "reaches UCX's TCP transport only as a peer uid (--peer-uids), since UCX lets "
              "whoever connects write anywhere in this process",
              Text(peer), Text(local), n,
              uid.has_value() ? fmt::format("its socket belongs to uid {}", *uid)
                              : std::string("no live socket on this host owns its end"));
  }
  return false;
}

}  // namespace

// UCT 1.13's tcp frame ids past the active message ids (uct/tcp/tcp.h).
namespace {
constexpr uint8_t kConnectionManager = UCT_AM_ID_MAX;
constexpr uint8_t kPutRequest = UCT_AM_ID_MAX + 1;  // address, length, sequence number
constexpr uint8_t kPutAck = UCT_AM_ID_MAX + 2;      // sequence number
// uct_tcp_ep_check's keepalive (UCP checks each peer-error-handling endpoint with it,
// every UCX_KEEPALIVE_INTERVAL, 20 s by default): UCT 1.13 skips its body, of any length.
constexpr uint8_t kKeepalive = UCT_AM_ID_MAX + 3;
constexpr uint32_t kPutRequestBytes = 8 + 8 + 4;
constexpr uint32_t kPutAckBytes = 4;
constexpr size_t kFrameHeaderBytes = 1 + 4;
// A connection-manager frame's body: a 4-byte event first. The connection request
// (event 1): the event, flags (1 byte), the endpoint's id (8) and the sender's
// interface address, as long as the accepting interface's own (a sockaddr_in, or a
// sockaddr_in6 on an IPv6 interface); UCT aborts on one of another length.
constexpr uint32_t kCmEventBytes = 4;
constexpr uint32_t kCmConnectionRequest = 1;
constexpr size_t kCmRequestFlagsAt = 4;
constexpr uint8_t kCmFlagConnectToEndpoint = 1;
constexpr size_t kCmRequestEndpointAt = 4 + 1;     // the endpoint's id (8 bytes)
constexpr size_t kCmRequestFamilyAt = 4 + 1 + 8;  // the sockaddr_in's sa_family_t
constexpr uint32_t kCmAcknowledgement = 2;
constexpr uint32_t kCmAcknowledgementWithRequest = 3;
constexpr uint8_t kMagicBytes[8] = {0x78, 0x56, 0x34, 0x12, 0xbe, 0xba, 0xfe, 0xca};

// The address a connection request's body names (its family, host and port), family 0
// when it is neither IPv4 nor IPv6.
sockaddr_storage RequestAddress(const uint8_t* body) {
  sockaddr_storage a{};
  sa_family_t family = 0;
  std::memcpy(&family, body + kCmRequestFamilyAt, sizeof family);
  if (family == AF_INET || family == AF_INET6) {
    std::memcpy(&a, body + kCmRequestFamilyAt,
                family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6));
  }
  return a;
}

// Whether `a` and `b` are one address as UCT compares them: family, host and port.
bool SameAddress(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family || (a.ss_family != AF_INET && a.ss_family != AF_INET6)) {
    return false;
  }
  auto port = [](const sockaddr_storage& x) {
    return x.ss_family == AF_INET ? reinterpret_cast<const sockaddr_in&>(x).sin_port
                                  : reinterpret_cast<const sockaddr_in6&>(x).sin6_port;
  };
  return port(a) == port(b) && HostOf(a) == HostOf(b);
}

// `a` as text, or what it is not (family 0: neither IPv4 nor IPv6).
std::string AddressText(const sockaddr_storage& a) {
  return a.ss_family == 0 ? "an address of another family" : Text(a);
}

// Why a well-formed connection request (`body`) on a connection this process's UCX
// dialled is refused ("" when UCT takes it). UCT 1.13 takes one there only on a
// connected endpoint, and only naming that endpoint: its connection's sequence number
// (as UCT sent it in its own request) and the address it dialled; it aborts on any
// other (a peer's UCT sends one there when both sides connected at once).
std::string DialledRequestRefusal(const internal::StreamCheck& check, const uint8_t* body) {
  const size_t own_at = sizeof kMagicBytes + kFrameHeaderBytes;
  uint32_t own_length = 0, own_event = 0;
  if (check.sent_have >= own_at + check.request_bytes) {
    std::memcpy(&own_length, check.sent + sizeof kMagicBytes + 1, 4);
    std::memcpy(&own_event, check.sent + own_at, 4);
  }
  if (check.sent_have < own_at + check.request_bytes ||
      std::memcmp(check.sent, kMagicBytes, sizeof kMagicBytes) != 0 ||
      check.sent[sizeof kMagicBytes] != kConnectionManager ||
      own_length != check.request_bytes || own_event != kCmConnectionRequest) {
    return "a connection request before this agent's UCX sent its own on the connection "
           "it dialled (UCT aborts on a request it cannot match to its own)";
  }
  const uint8_t* own = check.sent + own_at;
  const bool connected =
      (own[kCmRequestFlagsAt] & kCmFlagConnectToEndpoint) != 0 || check.acknowledged;
  if (!connected) {
    return "a connection request before the peer acknowledged this agent's (UCT waits for "
           "the acknowledgement and aborts on a request)";
  }
  uint64_t named = 0, mine = 0;
  std::memcpy(&named, body + kCmRequestEndpointAt, 8);
  std::memcpy(&mine, own + kCmRequestEndpointAt, 8);
  if (named != mine) {
    return fmt::format("a connection request naming connection {} on a connection this "
                       "agent's UCX dialled as connection {} (UCT aborts on it)",
                       named, mine);
  }
  const sockaddr_storage from = RequestAddress(body);
  if (!SameAddress(from, check.to)) {
    return fmt::format("a connection request from interface {} on a connection this agent's "
                       "UCX dialled to {} (UCT aborts on it)",
                       AddressText(from), AddressText(check.to));
  }
  return "";
}

// Why the connection request (event 1) `check` is reading is refused ("" if not): its
// body is check.left long, and check.bytes holds it whole when that is the interface's
// length (StreamCheck::request_bytes).
std::string ConnectionRequestRefusal(const internal::StreamCheck& check) {
  if (check.requested && !check.dialled) {
    return "a second connection request on one connection (UCT sends one, and aborts on "
           "another in some states)";
  }
  if (check.left != check.request_bytes) {
    return fmt::format("a connection request of {} bytes (UCT aborts on any but {} here)",
                       check.left, check.request_bytes);
  }
  const uint8_t* body = check.bytes;
  if ((body[kCmRequestFlagsAt] & kCmFlagConnectToEndpoint) != 0) {
    return "a connection request for UCT's connect-to-endpoint mode (flag 1: it names an "
           "endpoint by an id this agent cannot check, and UCT aborts on one it does not "
           "have; kvagent's agents never send it)";
  }
  sa_family_t family = 0;
  std::memcpy(&family, body + kCmRequestFamilyAt, sizeof family);
  if (family != AF_INET && family != AF_INET6) {
    return fmt::format("a connection request naming an address of family {} (UCT aborts on "
                       "any but IPv4 and IPv6)",
                       family);
  }
  return check.dialled ? DialledRequestRefusal(check, body) : "";
}

// Why a frame of `id` and `length` is refused ("" when it is not); `requested`: the
// stream's connection request came.
std::string FrameRefusal(uint8_t id, uint32_t length, bool requested,
                         const internal::StreamRules& rules) {
  if (length > rules.max_frame) {
    return fmt::format("a frame of {} bytes (id {}), more than UCT's receive buffer takes "
                       "({}; UCT aborts the process on it)",
                       length, id, rules.max_frame);
  }
  if (id < UCT_AM_ID_MAX || id == kKeepalive) return "";
  if (id == kConnectionManager) {
    if (length < kCmEventBytes) {
      return fmt::format("a connection-manager frame of {} bytes, short of its {}-byte event "
                         "(UCT aborts on it)",
                         length, kCmEventBytes);
    }
    return "";
  }
  if (id == kPutRequest) {
    if (length != kPutRequestBytes) {
      return fmt::format("a put request of {} bytes (UCT aborts on any but {})", length,
                         kPutRequestBytes);
    }
    if (!requested) {
      return "a put request before the connection's request (UCT aborts answering it on a "
             "connection it has not taken yet)";
    }
    return "";
  }
  if (id == kPutAck) {
    if (length != kPutAckBytes) {
      return fmt::format("a put acknowledgement of {} bytes (UCT aborts on any but {})", length,
                         kPutAckBytes);
    }
    return "";
  }
  return fmt::format("frame id {}, which UCT's tcp transport does not know (it aborts the "
                     "process on it)",
                     id);
}
}  // namespace

namespace internal {

std::string FeedStream(StreamCheck* check, const uint8_t* data, size_t n,
                       const StreamRules& rules) {
  auto collect = [&](size_t want) {
    const size_t take = std::min(want - check->have, n);
    std::memcpy(check->bytes + check->have, data, take);
    check->have = static_cast<uint8_t>(check->have + take);
    data += take;
    n -= take;
    return check->have == want;
  };
  while (n > 0) {
    switch (check->phase) {
      case StreamCheck::kRefused:
        return "the stream was refused before";
      case StreamCheck::kMagic:
      case StreamCheck::kBody:
      case StreamCheck::kPutData: {
        const uint64_t take = std::min<uint64_t>(check->left, n);
        data += take;
        n -= take;
        check->left -= take;
        if (check->left == 0) {
          check->phase = StreamCheck::kHeader;
          check->have = 0;
        }
        break;
      }
      case StreamCheck::kHeader: {
        if (!collect(kFrameHeaderBytes)) break;
        const uint8_t id = check->bytes[0];
        uint32_t length = 0;
        std::memcpy(&length, check->bytes + 1, 4);
        if (std::string why =
                FrameRefusal(id, length, check->requested || check->dialled, rules);
            !why.empty()) {
          check->phase = StreamCheck::kRefused;
          return why;
        }
        check->have = 0;
        if (id == kPutRequest) {
          check->phase = StreamCheck::kPutHeader;
        } else if (id == kConnectionManager) {
          check->left = length;  // at least the event (FrameRefusal)
          check->phase = StreamCheck::kCmEvent;
        } else {
          check->left = length;
          check->phase = length == 0 ? StreamCheck::kHeader : StreamCheck::kBody;
        }
        break;
      }
      case StreamCheck::kCmEvent: {
        // The whole body when it is as long as a request (it may be one), else the event.
        const size_t want =
            check->left == check->request_bytes ? check->request_bytes : kCmEventBytes;
        if (!collect(want)) break;
        uint32_t event = 0;
        std::memcpy(&event, check->bytes, sizeof event);
        if (event == kCmConnectionRequest) {
          if (std::string why = ConnectionRequestRefusal(*check); !why.empty()) {
            check->phase = StreamCheck::kRefused;
            return why;
          }
          check->requested = true;
        } else if (event == kCmAcknowledgement || event == kCmAcknowledgementWithRequest) {
          check->acknowledged = true;
        }
        check->have = 0;
        check->left -= want;
        check->phase = check->left == 0 ? StreamCheck::kHeader : StreamCheck::kBody;
        break;
      }
      case StreamCheck::kPutHeader: {
        // Its payload follows unframed. (Where it goes is not checked: honest agents put
        // too, into buffers kvagent does not list; ucx_tcp_guard.h.)
        if (!collect(kPutRequestBytes)) break;
        uint64_t length = 0;
        std::memcpy(&length, check->bytes + 8, 8);
        check->have = 0;
        check->left = length;
        check->phase = length == 0 ? StreamCheck::kHeader : StreamCheck::kPutData;
        break;
      }
    }
  }
  return "";
}

StreamCheck DialledStreamCheck(const sockaddr* to, socklen_t length) {
  StreamCheck check;
  check.phase = StreamCheck::kHeader;
  check.left = 0;
  check.dialled = true;  // UCT serves a put request on it at any point (measured)
  if (to != nullptr && ((to->sa_family == AF_INET && length >= sizeof(sockaddr_in)) ||
                        (to->sa_family == AF_INET6 && length >= sizeof(sockaddr_in6)))) {
    std::memcpy(&check.to, to,
                to->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6));
  }
  return check;
}

void NoteSent(StreamCheck* check, const uint8_t* data, size_t n) {
  const size_t take = std::min(sizeof check->sent - check->sent_have, n);
  std::memcpy(check->sent + check->sent_have, data, take);
  check->sent_have = static_cast<uint8_t>(check->sent_have + take);
}

uint8_t ConnectionRequestBytes(int family) {
  // The address is last, where its family begins.
  return static_cast<uint8_t>(kCmRequestFamilyAt + (family == AF_INET6 ? sizeof(sockaddr_in6)
                                                                        : sizeof(sockaddr_in)));
}

std::optional<StreamRules> RulesForRxSegSize(const char* rx_seg_size) {
  StreamRules rules;
  if (rx_seg_size == nullptr) return rules;
  const std::optional<uint64_t> bytes = ParseUcxSize(rx_seg_size);
  if (!bytes || *bytes == 0) return std::nullopt;
  rules.max_frame = *bytes;  // UCT's buffer is this and a header (measured: uct_frames_test)
  return rules;
}

std::optional<uint64_t> ParseUcxSize(std::string_view text) {
  uint64_t value = 0;
  size_t i = 0;
  for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) {
    if (value > (UINT64_MAX - 9) / 10) return std::nullopt;
    value = value * 10 + static_cast<uint64_t>(text[i] - '0');
  }
  if (i == 0) return std::nullopt;
  std::string_view unit = text.substr(i);
  if (!unit.empty() && (unit.back() == 'b' || unit.back() == 'B')) unit.remove_suffix(1);
  int shift = 0;
  if (unit.size() == 1) {
    switch (unit[0]) {
      case 'k': case 'K': shift = 10; break;
      case 'm': case 'M': shift = 20; break;
      case 'g': case 'G': shift = 30; break;
      default: return std::nullopt;
    }
  } else if (!unit.empty()) {
    return std::nullopt;
  }
  if (shift > 0 && value > (UINT64_MAX >> shift)) return std::nullopt;
  return value << shift;
}

}  // namespace internal

namespace {

// One watched descriptor: on while the accepted connection it names is UCX's. The
// table is mapped (zero pages until used) when the guard goes on; a descriptor's
// reads come from one thread at a time (UCT's), its watch and forget from accept()
// and close().
constexpr int kStreamSlots = 1 << 16;
// The descriptors watched: kStreamSlots, fewer in a test (LimitStreamSlotsForTest).
std::atomic<int> g_stream_limit{kStreamSlots};
struct StreamSlot {
  std::atomic<bool> on;
  internal::StreamCheck check;
};
std::atomic<StreamSlot*> g_streams{nullptr};
internal::StreamRules g_rules;  // set before the guard goes on
std::atomic<uint64_t> g_refused_streams{0};
std::atomic<bool> g_recv_stand_in{false};

}  // namespace

namespace internal {
void LimitStreamSlotsForTest(int slots) {
  g_stream_limit.store(std::min(slots, kStreamSlots), std::memory_order_relaxed);
}
}  // namespace internal

namespace {
// The slot of descriptor `fd`; null before the table is mapped or past it.
StreamSlot* SlotOf(int fd) {
  StreamSlot* slots = g_streams.load(std::memory_order_acquire);
  return slots == nullptr || fd < 0 || fd >= g_stream_limit.load(std::memory_order_relaxed)
             ? nullptr
             : &slots[fd];
}

// The rules from this process's environment, before UCX reads it.
internal::StreamRules RulesFromEnvironment() {
  const char* size = std::getenv("UCX_TCP_RX_SEG_SIZE");
  if (std::optional<internal::StreamRules> rules = internal::RulesForRxSegSize(size)) {
    return *rules;
  }
  kLog.Warn("UCX TCP: UCX_TCP_RX_SEG_SIZE={} is not a size this agent reads; frames "
            "longer than UCT's receive buffer (on which UCT aborts) are not refused",
            size);
  internal::StreamRules rules;
  rules.max_frame = UINT64_MAX;
  return rules;
}

bool WatchStream(int fd, bool dialled, const sockaddr* to, socklen_t length) {
  if (g_streams.load(std::memory_order_acquire) == nullptr ||
      !g_recv_stand_in.load(std::memory_order_relaxed)) {
    return true;
  }
  StreamSlot* slot = SlotOf(fd);
  if (slot == nullptr) {
    const uint64_t n = g_refused.fetch_add(1, std::memory_order_relaxed) + 1;
    kLog.Warn("UCX TCP: refused a connection {} descriptor {} ({} so far): its stream cannot "
              "be watched past descriptor {}; lower the agent's open-file limit or its load",
              dialled ? "dialled on" : "on", fd, n,
              g_stream_limit.load(std::memory_order_relaxed) - 1);
    return false;
  }
  slot->check = dialled ? internal::DialledStreamCheck(to, length) : internal::StreamCheck{};
  // UCT sizes a connection request by its interface's address family: the connection's.
  sockaddr_storage local{};
  socklen_t local_length = sizeof local;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_length) == 0) {
    slot->check.request_bytes = internal::ConnectionRequestBytes(local.ss_family);
  }
  slot->on.store(true, std::memory_order_release);
  return true;
}

}  // namespace

ssize_t UcxTcpRecv(int fd, void* buffer, size_t length, int flags, RecvFn next) {
  StreamSlot* watched = SlotOf(fd);
  if (watched == nullptr || !watched->on.load(std::memory_order_acquire)) {
    return next(fd, buffer, length, flags);
  }
  StreamSlot& slot = *watched;
  if (slot.check.phase == internal::StreamCheck::kRefused) return 0;
  const ssize_t got = next(fd, buffer, length, flags);
  if (got <= 0 || (flags & MSG_PEEK) != 0) return got;
  const std::string why = internal::FeedStream(
      &slot.check, static_cast<const uint8_t*>(buffer), static_cast<size_t>(got), g_rules);
  if (why.empty()) return got;
  shutdown(fd, SHUT_RDWR);
  const uint64_t n = g_refused.fetch_add(1, std::memory_order_relaxed) + 1;
  const uint64_t mine = g_refused_streams.fetch_add(1, std::memory_order_relaxed) + 1;
  if (slot.check.dialled) g_refused_dialled.fetch_add(1, std::memory_order_relaxed);
  if (log::Sampled(mine)) {
    sockaddr_storage peer{}, local{};
    Ends(fd, &peer, &local);
    kLog.Warn("UCX TCP: closed a connection {} {} {} {} at {} ({} such so far, {} "
              "connections refused in all): UCT would have served it before any check of "
              "kvagent's",
              slot.check.dialled ? "this agent's UCX dialled, to" : "from",
              Text(internal::Unmapped(peer)), slot.check.dialled ? "from" : "to",
              Text(internal::Unmapped(local)), why, mine, n);
  }
  return 0;  // end of stream: UCT closes its endpoint
}

ssize_t UcxTcpSend(int fd, const void* buffer, size_t length, int flags, SendFn next) {
  const ssize_t sent = next(fd, buffer, length, flags);
  StreamSlot* watched = SlotOf(fd);
  if (sent <= 0 || watched == nullptr || !watched->on.load(std::memory_order_acquire) ||
      !watched->check.dialled || watched->check.sent_have == sizeof watched->check.sent) {
    return sent;
  }
  // UCT sends and reads a connection on its worker's thread: no other writer.
  internal::NoteSent(&watched->check, static_cast<const uint8_t*>(buffer),
                     static_cast<size_t>(sent));
  return sent;
}

void ForgetUcxTcpStream(int fd) {
  if (StreamSlot* slot = SlotOf(fd)) slot->on.store(false, std::memory_order_release);
}

void NoteUcxTcpRecvStandIn() { g_recv_stand_in.store(true); }

void InstallStreamWatch() {
  if (g_streams.load() != nullptr) return;
  g_rules = RulesFromEnvironment();
  void* table = mmap(nullptr, sizeof(StreamSlot) * kStreamSlots, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (table == MAP_FAILED) {
    kLog.Error("UCX TCP: cannot map the stream table ({}); streams on UCX's TCP port are not "
               "checked",
               std::strerror(errno));
    return;
  }
  g_streams.store(static_cast<StreamSlot*>(table), std::memory_order_release);
}

}  // namespace kvagent::transport
