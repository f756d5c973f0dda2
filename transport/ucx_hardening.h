// What a peer holding this process's UCX worker address may make UCX do here, cut down
// to what kvagent uses. UCX trusts every peer that reaches a worker: its software
// emulation of RMA (used where a transport lacks native put or get for a region, such
// as tcp or same-host memory reached by cma, or where the sender chooses it) writes and
// reads whatever address the peer names, with no memory key checked; a peer's atomics
// and stream messages reach UCT's stub handler, which takes a backtrace (about 60 µs
// here) and logs about 15 lines per message; its tagged rendezvous messages wait in the
// worker's unexpected queue for as long as it likes.
//
// HardenUcxForPeers, called once by a service process (kvagentd's main) before any UCX
// context exists, changes UCP's receive handlers in its handler table: a software put
// or get request is served only when the whole range it names lies in memory
// registered for peers (MemoryRegistration with PeerAccess::kPeers: what native RMA
// with that memory's key reaches; kvagent's own ucx data path relies on this where UCX
// emulates), else dropped; atomic requests and replies and stream data are dropped.
// Replies and acknowledgements that name one of this process's endpoints or requests
// by id (software RMA's, tagged sends', rendezvous') are dropped unless the id is
// indirect: UCX 1.13 dereferences any other as a pointer. HardenUcxForPeers sets
// UCX_PROTO_INDIRECT_ID=on for the contexts created afterwards, so every id they give
// out is. Active messages (kvagent's own protocol: single, with reply, first and later
// fragments) are dropped unless the lengths they give fit them: UCX 1.13 aborts on a
// user header longer than its message or a message shorter than its header and footer
// (one 8-byte message from any peer ended the process), and copies a first fragment
// longer than the whole message it says it starts past the buffer it allocates for
// it; messages of several fragments are assembled here instead of by UCP, each fragment
// checked (AmAssemblyLimits below). Tagged sends of several fragments are dropped
// (kvagent sends no tagged message; UCX 1.13 aborts on a short one).
// Contexts created afterwards take tagged messages (UcxContext adds UCP_FEATURE_TAG,
// and each worker keeps a receive for any tag posted that truncates what it matches to
// nothing). Every message dropped is counted and logged (the first few of each kind).
//
// Process-wide: test processes that play a peer do not call it, so they keep UCX's
// stock behaviour and can try it against a real agent. The table is UCX 1.13's
// internal layout, checked symbol by symbol (each handler's size from the ELF symbol
// table, its place in ucp_am_handlers, the features it serves); a library whose layout
// differs is refused with the reason instead of patched blindly.
#pragma once

#include <sys/types.h>
#include <uct/api/uct.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace kvagent::transport {

// Patches UCP's handler table (once; later calls return the first outcome). Call while
// the process has one thread and no UCX context. An error names what did not match;
// nothing was patched then.
absl::Status HardenUcxForPeers();

// True once HardenUcxForPeers succeeded in this process.
bool UcxHardenedForPeers();

// What peers' messages are dropped (for `doctor`): "put (software RMA) outside peer
// memory", "atomic request", "any of 16 protocols naming an endpoint or request id this
// agent did not give out", a put or get whose endpoint has the cap of replies waiting
// (WatchHeldReplies), ... Empty until hardened.
std::vector<std::string> UcxRefusedProtocols();

// Messages dropped so far in this process (all workers).
uint64_t UcxRefusedMessages();

// A peer's packed remote key holds one entry per UCX memory domain, whose bytes are
// that domain's own. Two things there are not UCX's to trust:
// - UCX's posix and sysv domains give an entry only for memory UCX allocated itself,
//   and unpacking one attaches the shared memory segment it names (a file, a
//   /proc/PID/fd link, a System V id) into this process, as the peer's memory. kvagent
//   exports no memory UCX allocated, so in a peer's key such an entry can only name a
//   segment that is not the peer's to give (another engine's, this agent's own).
// - When a domain fails to unpack its entry (a segment that does not attach), UCX 1.13
//   releases the entries not yet unpacked as if they had been: the process dies of
//   SIGSEGV (one forged sysv or posix entry did it).
// UnpackRkeyEntry, called by the uct_rkey_unpack stand-in (transport:
// uct_rkey_unpack_stand_in, linked into kvagentd only) for each entry UCX unpacks,
// refuses posix and sysv entries without attaching them, and turns any other domain's
// failure into "unreachable", which UCX handles by leaving that domain out of the key.
// Each refusal is counted (UcxRefusedRkeyEntries), logged (the first few and every
// 1,024th) and noted for the calling thread; Endpoint::UnpackRkey then refuses the
// whole key with the note (TakeRkeyRefusal). A key UCX unpacks for itself (a peer's
// rendezvous) just goes without the entry. Before HardenUcxForPeers it only calls
// `next`.
using RkeyUnpackFn = ucs_status_t (*)(uct_component_h, const void*, uct_rkey_bundle_t*);
ucs_status_t UnpackRkeyEntry(uct_component_h component, const void* entry,
                             uct_rkey_bundle_t* unpacked, RkeyUnpackFn next);
// What the calling thread's entries refused since the last call, in words (the first
// refusal), or empty; clears it.
std::string TakeRkeyRefusal();
// Entries refused so far in this process.
uint64_t UcxRefusedRkeyEntries();

// Which processes of this host UCX may reach through shared memory. A same-host peer's
// worker address names, for UCX alone to read, its receive FIFO (a System V segment id,
// or a /proc/PID/fd/N link for posix) that creating an endpoint attaches, and the pid
// its cma transport reads and writes with process_vm_readv/writev: a peer giving
// another process's address would have this agent attach that process's memory and
// talk UCX to it (a stock UCX process serves puts and gets anywhere in itself; another
// agent serves its own peers' regions, to one it never authenticated). Once armed
// (ArmSameHostGuard: UcxContext::Create, after ucp_init, in a hardened process),
// kvagentd's stand-ins for shmat, open of /proc/PID/fd/... and process_vm_readv/writev
// (transport:same_host_stand_in) ask SameHostTargetAdmitted: the pid must be one that
// a local door proved, held with AllowSameHostPeer while a session of the peer role is
// open on either side (this agent's PeerLink to the peer, the peer's to this agent),
// and for a grace after the last of them closed (SetSameHostGrace) while the same
// process (its start time) has that pid, or this process itself for its own segments
// (not for cma: kvagent never moves bytes inside itself through UCX). A refusal is
// counted (SameHostRefusals), logged (the first few and every 1,024th) and noted for
// the thread (TakeSameHostRefusal), and the call fails with EPERM, so UCX fails the
// endpoint or the transfer.
void ArmSameHostGuard();
// Counted: a pid held twice is forgotten twice.
void AllowSameHostPeer(int pid);
void ForgetSameHostPeer(int pid);
// How long a pid stays admitted after its last hold went (10 s unless set): UCX
// connects back to a peer when it takes the peer's wireup request, which waits in
// this worker's shared-memory queue until the worker wakes (up to a second when the
// peer's wake-up signal was lost, longer under load), and a peer that disconnects
// right after connecting has closed its session by then: refused, that reverse
// endpoint left the peer's endpoint unwired and everything it sent after (the
// outcome notices of the transfers the disconnect failed) undelivered. Within the
// grace the pid is admitted only while /proc/PID/stat gives the start time it had
// when it was proven, so a process given the same pid later is not.
void SetSameHostGrace(std::chrono::steady_clock::duration grace);
// Holds a pid allowed (AllowSameHostPeer) for as long as it lives: what a link to a peer
// of this host (its local door, or a network door whose process was found) and a
// peer-role session keep. Empty (no pid) when default-made.
class SameHostPeerHold {
 public:
  SameHostPeerHold() = default;
  explicit SameHostPeerHold(int pid) : pid_(pid) { AllowSameHostPeer(pid); }
  SameHostPeerHold(SameHostPeerHold&& other) noexcept : pid_(other.pid_) { other.pid_ = 0; }
  SameHostPeerHold& operator=(SameHostPeerHold&& other) noexcept {
    if (this != &other) {
      if (pid_ != 0) ForgetSameHostPeer(pid_);
      pid_ = other.pid_;
      other.pid_ = 0;
    }
    return *this;
  }
  ~SameHostPeerHold() {
    if (pid_ != 0) ForgetSameHostPeer(pid_);
  }

 private:
  int pid_ = 0;
};
enum class SameHostUse { kAttach, kCma };
bool SameHostTargetAdmitted(int pid, SameHostUse use);
std::string TakeSameHostRefusal();
uint64_t SameHostRefusals();

// A posix FIFO named by a file. A peer's UCX run with UCX_POSIX_USE_PROC_LINK=n names
// its receive FIFO by file, /dev/shm/ucx_shm_posix_ID (opened with shm_open) or
// DIR/ucx_shm_posix_ID in a directory its address names, not by a /proc/PID/fd link: a
// name says nothing of whose it is. SameHostFileAdmitted admits the open file `fd`
// (`path` names it in the refusal) when it is a regular file that this process or a pid
// SameHostTargetAdmitted admits has mapped (its device and inode in /proc/PID/maps);
// kvagentd's stand-ins for shm_open and open ask it for UCX's opens of such names
// (IsUcxPosixSegmentName) that create nothing. Refusals count, log and note as above.
bool IsUcxPosixSegmentName(const char* path);
bool SameHostFileAdmitted(int fd, const char* path);
// UCX 1.13 attaches a peer's FIFO in a named directory with the directory its own
// posix interface puts in its address, and with none there (UCX's default) it stops the
// process on an assertion: one same-host peer run with UCX_POSIX_USE_PROC_LINK=n and
// UCX_POSIX_DIR, honest or not, took down every agent that connected to it.
// WatchPosixInterface (the uct_iface_open stand-in, for each posix interface) puts a
// check in front of the interface's ep_create: PosixPeerFifoAdmitted, which refuses
// such a FIFO (unreachable; counted, logged and noted as above) where this process's
// posix interface has no directory (`own_address_bytes`, its interface address's
// length, is the 8 bytes of the FIFO's id alone). None of these checks stands in the
// interface's reachability probe (where UCX 1.13 opens no file): UCX 1.13, answering a
// peer's wireup request, asserts on an endpoint it found no lane for, while a lane that
// fails to connect fails that endpoint cleanly.
void WatchPosixInterface(void* uct_iface);
bool PosixPeerFifoAdmitted(const void* peer_iface_address, size_t own_address_bytes);

// A same-host sender that dies between claiming a slot of a worker's shared-memory
// receive queue (posix, sysv) and marking it ready stops that queue for good
// (ReceiveStall, ucx_worker.h); ucp_worker_arm reports it (BUSY) only for an interface on
// UCP's arm list. UCP's adaptive progress keeps an interface off it while no endpoint
// uses it and waits for the interface's wake-up instead, which that sender never sends:
// a peer that died so once the worker had no endpoint on the interface (all reclaimed,
// or a process that outlived the one the endpoint reached) stopped every same-host
// peer's messages unreported, health SERVING. Turning adaptive progress off for the
// whole context keeps TCP's interfaces polled too (2.4 us a progress instead of 3 ns,
// idle, here). NoteSharedMemoryInterface (the uct_iface_open stand-in, for each posix and
// sysv interface UCP opens) notes the interface with the UCP object that holds it (its
// async event argument), for the thread that opens it, and forgets it if UCP closes it
// again (ucp_worker_create closes the ones it finds a better one for).
// CollectSharedMemoryInterfaces starts, for this thread, a new collection for the next
// ucp_worker_create; KeepSharedMemoryInterfacesArmed(worker) then activates each of
// that worker's noted interfaces once, through UCP's own ucp_worker_iface_progress_ep
// (UCX 1.13, as an endpoint's lane does), so it stays on the arm list for the worker's
// life; on the thread that created `worker`, before any other uses it. Returns the UCT
// interfaces it kept armed; "" or a reason in `*error` (UCP's function missing).
void NoteSharedMemoryInterface(void* uct_iface, void* ucp_worker, void* ucp_iface,
                               void* const* iface_out);
void CollectSharedMemoryInterfaces();
std::vector<void*> KeepSharedMemoryInterfacesArmed(const void* ucp_worker, std::string* error);

// UCX's TCP transport between same-host processes. Where the worker address of a peer
// proven at the local door offers no shared memory this agent reaches (or the endpoint
// has peer error handling), UCX takes TCP on loopback; the address's port is read by
// UCX alone, and another agent's port there keeps a connection from any process of a
// peer uid (ucx_tcp_guard.h) and serves its peers' regions to it. While a
// SameHostTcpCheck lives on the thread (PeerManager, around Endpoint::Connect for a
// peer: a network peer's address could name a port here too), kvagentd's connect()
// stand-in asks SameHostListenerAdmitted about UCX's connections to this host: one of
// the listening sockets (`listeners`, each an inode and its owner's uid:
// UcxTcpLocalListeners) must be held by an allowed pid (as SameHostTargetAdmitted: a
// local door's, or a network door's of this host, ProcessListeningOn; never this
// process itself). A proven pid whose descriptors this process may not read (another
// uid's) passes where a listener is of its uid. `where` names the port in the refusal,
// counted, logged and noted as above. With no listener the connection goes on (and
// fails by itself).
class SameHostTcpCheck {
 public:
  SameHostTcpCheck();
  ~SameHostTcpCheck();
  SameHostTcpCheck(const SameHostTcpCheck&) = delete;
  SameHostTcpCheck& operator=(const SameHostTcpCheck&) = delete;

 private:
  bool was_;
};
bool SameHostTcpChecked();
// The process of this host holding one of `listeners` (the sockets listening at a
// network door of this host: UcxTcpLocalListeners), looked for among the processes of
// the listeners' uids whose descriptors this process may read; nullopt when none is
// found. A peer at a network door of this host is then held (SameHostPeerHold) as one
// at its local door is.
std::optional<int> ProcessListeningOn(
    const std::vector<std::pair<unsigned long long, uid_t>>& listeners);
bool SameHostListenerAdmitted(const std::vector<std::pair<unsigned long long, uid_t>>& listeners,
                              const std::string& where);

// A peer's worker address gives, for each transport, a device address and an interface
// address, each of the length it says; one of length 0 reaches the transport's
// reachability probe as a null pointer, and UCX 1.13's tcp probe read through it (one
// wireup message whose address said so ended the process with SIGSEGV). GuardReachability
// (the uct_iface_open stand-in, for each interface UCP opens) puts a check in front of
// `uct_iface`'s probe: an entry without the device address this interface has one of,
// or (an interface peers connect to directly) without the interface address, is
// unreachable; each is counted (UnreachableAddressEntries, and UcxRefusedMessages) and
// logged (the first few and every 1,024th). A no-op before HardenUcxForPeers.
void GuardReachability(void* uct_iface);
uint64_t UnreachableAddressEntries();

// A put's completion (software RMA over a transport without native RMA, tcp in UCX
// 1.13) names the endpoint whose put it completes, and UCX 1.13 counts it against the
// endpoint's and the worker's puts in flight, asserting that there are some: one
// completion naming a real endpoint id (small odd numbers) of a worker with none ended
// the process. WatchPutsOf (the uct_iface_open stand-in, with the worker UCP opens
// `uct_iface` for: its error handler's argument) counts the puts each worker sends
// through its watched interfaces; a completion that comes to a worker with none in
// flight is dropped, counted (PutCompletionsRefused, and UcxRefusedMessages) and
// logged. A worker whose interfaces are not watched takes every completion, as UCX
// does. ForgetPutsOf: the worker is destroyed (UcxWorker). A no-op before
// HardenUcxForPeers. A completion naming another endpoint of the worker than the one
// whose put is in flight still reaches UCX.
void WatchPutsOf(void* uct_iface, const void* worker);
void ForgetPutsOf(const void* worker);
uint64_t PutCompletionsRefused();

// UCT active message ids that UCP registers no handler for (0, 5, 13 and 27-31 in UCX
// 1.13) reach UCT's stub handler, which logs 19 lines with a backtrace for each message
// (a 13-byte message from a peer: about 2 KiB of log). QuietUnusedUctIds gives every id
// of `iface` a handler that drops the message, counts it (UcxRefusedMessages) and logs
// the first few and every 1,024th; UCP then installs its own over the ids it uses.
// Called by the uct_iface_open stand-in (transport:uct_iface_open_stand_in, linked into
// kvagentd only) for each interface UCP opens.
void QuietUnusedUctIds(void* uct_iface);

// Replies held for requesters that do not read: each software put or get served leaves
// one reply (a completion, or the data), and what the socket does not take waits in
// the UCT endpoint's pending queue, about 350 bytes of memory each, until the requester
// reads on. WatchHeldReplies stands in front of `uct_iface`'s sends, pending queue and
// endpoint teardown to count them per UCT endpoint; a request whose endpoint has the
// cap of them waiting, or some while kHeldRepliesAllEndpoints x cap wait for all
// endpoints (a peer may open many), is dropped (counted in UcxRefusedMessages and
// HeldReplies::refused, logged): a peer that posts without reading holds at most
// cap x 350 bytes per endpoint, and all endpoints together 4 x that plus one reply
// each, while an endpoint whose requester reads is still served. Called by the
// uct_iface_open stand-in for each interface UCP opens (after HardenUcxForPeers; a
// no-op before).
inline constexpr uint64_t kDefaultHeldRepliesPerEndpoint = 65536;
inline constexpr uint64_t kHeldRepliesAllEndpoints = 4;
void WatchHeldReplies(void* uct_iface);
void SetHeldRepliesPerEndpoint(uint64_t cap);
struct HeldReplies {
  uint64_t held = 0;     // replies waiting now, all endpoints
  uint64_t most = 0;     // on the endpoint with the most
  uint64_t peak = 0;     // the most one endpoint ever had
  uint64_t refused = 0;  // requests dropped at the cap so far
  uint64_t cap = 0;
};
HeldReplies HeldRepliesNow();

// A peer's active message bigger than its transport's segment (8 KiB on tcp and shared
// memory) comes in fragments: a first, which says how big the whole is, and later ones,
// each giving its offset. UCX 1.13 trusts them: it copied a later fragment to the
// offset it gave, past the buffer it allocated (a peer naming one of this process's
// endpoint ids wrote wherever it liked in the agent's heap), stopped the process on an
// assertion when a first fragment came twice, queued later fragments arriving before
// their first without bound, and allocated whatever size a first fragment named. A
// hardened process assembles them itself (UCP's handlers for them never run): a later
// fragment must start where the data so far ends and end inside its message (a peer's
// UCX sends a message's fragments on one lane, in order: HardenUcxForPeers sets
// UCX_MAX_EAGER_LANES=1), else the message is dropped; a first fragment is refused for a
// message being assembled, over max_message_bytes (data and user header), or while
// max_bytes or max_messages are held for messages being assembled; a message with no
// fragment for `idle` is dropped (checked as first fragments arrive on its worker's
// thread, at most once a second). A whole message reaches the application's handler as
// a single one would. Every fragment dropped is counted (UcxRefusedMessages,
// AmAssembly::refused) and logged (the first few and every 1,024th).
struct AmAssemblyLimits {
  uint64_t max_message_bytes = 80ull << 20;
  uint64_t max_bytes = 1ull << 30;
  uint64_t max_messages = 16384;
  std::chrono::milliseconds idle{30000};
};
void SetAmAssemblyLimits(const AmAssemblyLimits& limits);
AmAssemblyLimits AmAssemblyLimitsNow();
struct AmAssembly {
  uint64_t messages = 0;    // being assembled now
  uint64_t bytes = 0;       // held for them
  uint64_t peak_bytes = 0;  // the most ever held
  uint64_t assembled = 0;   // whole messages handed over so far
  uint64_t refused = 0;     // fragments dropped so far
  uint64_t abandoned = 0;   // messages dropped for idling
};
AmAssembly AmAssemblyNow();

// The ranges a software put or get request may name, with their memory type (a
// ucs_memory_type_t: a request claiming host memory for a range of device memory would
// make UCX memcpy to a device pointer). MemoryRegistration keeps them for
// PeerAccess::kPeers. Any thread. A range allowed twice must be forbidden twice.
void AllowPeerRange(const void* address, uint64_t length, uint32_t memory_type);
void ForbidPeerRange(const void* address, uint64_t length);
// True when [address, address + length) lies inside one allowed range of
// `memory_type`: what the checked handlers serve.
bool UcxPeerRangeAdmits(uint64_t address, uint64_t length, uint32_t memory_type);

// Memory unmapped while a peer's software get may still read it. UCX sends a get reply
// from the memory the request named, and what the socket does not take at once waits
// in UCX and is sent as the requester reads on (a requester that stops reading keeps
// it waiting); nothing tells when it ends. Unmapped then, the agent would die of
// SIGSEGV sending the rest, or send whatever is mapped at that address next: another
// engine's bytes. So a range a software get was served from is noted when
// ForbidPeerRange removes it, and every worker that serves peers is woken to flush
// (UCX sends what waits before a flush completes; an endpoint that fails drops it).
// Memory that held regions goes through RetireMapping instead of munmap: if it
// overlaps such a range that not every worker has flushed past yet, it is mapped again
// at once to fresh zero pages (address space only; what a late reply reads, and no
// other mapping can take the address), and unmapped once every worker completed a
// flush begun after that. A software put is done inside its handler, under the lock
// ForbidPeerRange takes, so none writes once ForbidPeerRange returned.
// True when the range was retired (the caller must not unmap it); false when no reply
// can read it (not hardened, no worker, no get served from it, or flushed since): the
// caller unmaps it. Any thread.
bool RetireMapping(void* base, uint64_t length);
// Retired ranges: mapped to zero pages now (and their bytes), unmapped so far; and the
// ranges gets were served from that are forbidden but not yet flushed past.
struct RetiredMappings {
  uint64_t held = 0;
  uint64_t held_bytes = 0;
  uint64_t released = 0;
  uint64_t read_unflushed = 0;
};
RetiredMappings RetiredMappingsNow();
// For each worker that serves peers (UcxWorker does this): joins with `wake` (called,
// under a lock, when a range is noted or retired: the worker should begin a flush
// soon), reads the newest retirement with RetireSequence when it begins a flush,
// reports each flush it completed with it (`sequence`), and leaves once its UCX worker
// is destroyed.
void JoinRetireFlushes(const void* worker, void (*wake)(const void*));
uint64_t RetireSequence();
void RetireFlushCompleted(const void* worker, uint64_t sequence);
void LeaveRetireFlushes(const void* worker);

// UCP's endpoints, as a peer's wireup messages shape them. A wireup request that names
// no endpoint yet (id 0) has UCP create one for the sender and look for lanes among the
// transports the request's address lists; where it finds none (an address that lists
// no transport, or none this process reaches), UCX 1.13 kept the endpoint without a
// configuration and failed it on its next progress, stopping the process on an
// assertion there. A request matching an endpoint UCP is connecting (only one whose
// lanes connect both ways waits to be matched) whose address gives lanes of another
// configuration stopped it at once ("endpoint reconfiguration not supported yet"; so
// did one naming an endpoint, which the checked handler drops). The stand-ins in
// transport:ucp_endpoint_stand_in (kvagentd only) follow every endpoint from its
// creation (NoteEndpointCreated, with what UCP made it for)
// through each setup of its lanes (a LanesSetUp on the thread around it), in which
// UCP finds the endpoint's configuration (ConfigurationFound, with its index: false
// refuses one that differs from the endpoint's own, which the stand-in then fails as
// unreachable), until UCP destroys it (ForgetEndpoint). When UCP fails an endpoint
// (ucp_ep_set_failed_schedule), EndpointFailing says what to do instead: for one made
// for a request and never configured, remove it at once as UCP removes an endpoint of
// its own that finds no lanes (the worker is returned); for one whose lanes were just
// refused a new configuration, nothing (it keeps its lanes, the request goes
// unanswered); otherwise fail it as UCP would. Each refusal counts as a dropped wireup
// message (UcxRefusedMessages) and is logged (the first few and every 1,024th).
// Unhardened, nothing is followed and the stand-ins only pass UCP's calls on.
enum class EndpointFailure { kFail, kRemove, kKeep };
// Who an endpoint UCP creates is for: the agent (ucp_ep_create), a peer's wireup
// request that matched none of the agent's ("remote-request"), or the reply to a
// peer's endpoint check naming an endpoint this worker does not have ("wireup ep_check
// reply", destroyed once its one message is flushed).
enum class MadeFor { kAgent, kRequest, kCheckReply };
void NoteEndpointCreated(const void* worker, const void* ep, MadeFor made_for);
class LanesSetUp {
 public:
  explicit LanesSetUp(const void* ep);
  ~LanesSetUp();
  LanesSetUp(const LanesSetUp&) = delete;
  LanesSetUp& operator=(const LanesSetUp&) = delete;

 private:
  const void* was_;
};
bool ConfigurationFound(unsigned index);
// A peer's wireup reply names one of this worker's endpoints, and UCX 1.13 stops the
// process when that endpoint has its peer's endpoint id already (from a request it was
// made or matched for, or from an earlier reply) and the reply gives another. The peer
// ids are followed as UCP sets them while it handles a wireup message (the checked
// handler notes the message in flight on the thread): an endpoint made for a request or
// to answer an endpoint check (NoteEndpointCreated), one a request matched
// (EndpointMatched, the ucp_ep_match_retrieve stand-in), and the one a reply names,
// which UCP takes off its matching table before it reads the sender (ReplyNames, the
// ucp_ep_match_remove_ep stand-in). A reply giving another id than the endpoint's is
// made a repeat of the first answer: the handler hands UCP a copy of a reply, whose
// sender id ReplyNames rewrites to the endpoint's peer, and the rewrite is counted and
// logged as a refused wireup message.
void EndpointMatched(const void* ep);
void ReplyNames(const void* ep);
EndpointFailure EndpointFailing(const void* ep, const void** worker);
void ForgetEndpoint(const void* ep);
// Endpoints followed now (for tests: each is forgotten as UCP destroys it).
size_t EndpointsFollowed();
// Each endpoint followed gets a serial at its creation, never given again. UCP may
// destroy an endpoint a message came with once its handler returned (the peer's
// connection failed, the agent closed it, an endpoint check's answer was flushed) and
// give its memory to the next endpoint it makes, so an answer held past the handler
// names the endpoint by address and serial (transport::ReplyEndpoint), and is sent only
// while EndpointStillIs says the address still holds the endpoint of that serial.
// EndpointSerial: the serial of the endpoint at `ep` now, 0 when none is followed there
// (unhardened, or a process without the stand-ins). EndpointStillIs: true for serial 0
// (nothing to check: the caller's risk, as before the serials); else whether `ep` is
// followed with `serial`. RepliesToGoneEndpoints: the answers UcxWorker::SendAmReply
// did not send because EndpointStillIs said no (NoteReplyToGoneEndpoint counts one).
uint64_t EndpointSerial(const void* ep);
bool EndpointStillIs(const void* ep, uint64_t serial);
void NoteReplyToGoneEndpoint();
uint64_t RepliesToGoneEndpoints();

// Endpoints UCP makes for peers' messages. Each wireup request that matches none of the
// agent's own endpoints has UCP create one for its sender, and each endpoint check
// naming an endpoint this worker lacks one for its answer; without peer error handling
// (a same-host peer's, or a request asking for none) one made for a request lasts until
// the worker ends, with lanes to whatever address the request gave. In UCX 1.13 a
// peer's forged requests (the same 139 bytes, each with another sender id) grew the
// process by about 17.5 KiB each, without end. Here each worker holds at most `cap` of
// them (SetPeerEndpointCap; kvagentd's --ucx-peer-endpoints): UCP's endpoint for a
// request or check past it is refused before it is created (the ucp_ep_create_base
// stand-in calls PeerEndpointAdmitted; UCP then answers nothing), and an endpoint check
// that comes while the worker is at its cap is dropped (UCP would only log its
// refusal), each counted in UcxRefusedMessages and PeerEndpoints::refused and logged
// (the first few and every 1,024th) with the sender's worker uuid. One the agent's own
// ucp_ep_create adopts (UCP hands it an unexpected connection's endpoint:
// EndpointAdopted, the ucp_ep_match_retrieve stand-in) is the agent's and counts no
// more; one UCP destroys frees its place. An honest peer agent holds one per endpoint
// it has to this agent that this agent did not also open to it.
inline constexpr uint64_t kDefaultPeerEndpoints = 1024;
void SetPeerEndpointCap(uint64_t cap);
bool PeerEndpointAdmitted(const void* worker, MadeFor made_for);
void EndpointAdopted(const void* ep);
struct PeerEndpoints {
  uint64_t live = 0;     // endpoints UCP made for peers' messages now, all workers
  uint64_t most = 0;     // on the worker with the most
  uint64_t peak = 0;     // the most one worker ever held
  uint64_t refused = 0;  // requests and checks refused at the cap so far
  uint64_t cap = 0;
  uint64_t all = 0;      // every endpoint UCP holds now, the agent's own included
};
PeerEndpoints PeerEndpointsNow();

// Endpoints to a same-host process that ended. Without peer error handling (same-host
// peers have none) UCX 1.13 keeps an endpoint that has a connection from its peer until
// the worker is destroyed: one UCP made for a peer's request, and one the agent closed
// (ucp_ep_close_nbx flushes it and leaves it be). Each restart of a same-host peer left
// one behind in the agent it had connected to (held against --ucx-peer-endpoints) and
// one in each agent that had connected to it, lanes and the peer's receive FIFO
// mapped. An endpoint's lanes name the process they reach: a same-host admission
// (SameHostTargetAdmitted, SameHostFileAdmitted, SameHostListenerAdmitted) made while
// UCP sets up an endpoint's lanes (LanesSetUp) ties the endpoint to that proven pid and
// its start time, and EndpointPeerProcess says whether that process still runs (kNone:
// no same-host process is known, as for another host's peer, or UCP has no connection
// from the peer on the endpoint: it has not learnt the peer's endpoint id, and it
// destroys such an endpoint when it is closed). The worker (UcxWorker)
// closes the endpoints it holds for peers' requests whose process ended
// (PeerMadeOfEndedProcesses), and holds the close of its own while their process runs;
// before closing one whose process ended it marks it (ReclaimEndpoint), and the
// ucp_ep_disconnected stand-in then has UCP destroy it as it destroys an endpoint with
// no connection from its peer (ReclaimedOnDisconnect, counted in EndpointsReclaimed).
// A process that ended sends nothing more, so no peer loses an endpoint it uses.
enum class PeerProcess { kNone, kRunning, kEnded };
PeerProcess EndpointPeerProcess(const void* ep);
std::vector<const void*> PeerMadeOfEndedProcesses(const void* worker);
void ReclaimEndpoint(const void* ep);
bool ReclaimedOnDisconnect(const void* ep);
uint64_t EndpointsReclaimed();

}  // namespace kvagent::transport
