#include "transport/ucx_hardening.h"

#include <dirent.h>
#include <dlfcn.h>
#include <link.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <ucp/api/ucp.h>
#include <uct/api/uct.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "base/log.h"
#include "fmt/format.h"

namespace kvagent::transport {
namespace {

constexpr log::Logger kLog("transport");

// UCP's description of one of its protocols' active messages (ucp_am_handler_t in
// UCX 1.13's ucp_context.h; its size is checked against the library's symbol).
struct UcpAmHandler {
  uint64_t features;     // UCP_FEATURE_* under which a worker installs it
  uct_am_callback_t cb;  // what UCT calls with each message
  void* tracer;
  uint32_t flags;
  uct_am_callback_t proxy_cb;  // the same behind a counting proxy (wakeup ifaces)
};

// The protocols whose receive side is changed.
// - kRange: UCP's software RMA, which kvagent's own ucx data path uses where UCX
//   emulates puts and gets (same-host agents without shm-direct, in UCX 1.13): each
//   message is served only when the range it names lies inside memory registered for
//   peers (PeerAccess::kPeers), as native RMA with that memory's key would reach; else
//   dropped.
// - kId: messages that name one of this process's own endpoints or requests by id,
//   which UCP looks up: replies, acknowledgements, rendezvous and synchronous tagged
//   messages, fragments and replies of active messages, wireup (the range-checked ones
//   carry one too). UCX 1.13 takes an id without its indirect bit (bit 0) as a pointer
//   and dereferences it, whatever UCX_PROTO_INDIRECT_ID says, and asserts that an id is
//   not 0 (Debian's build keeps assertions: the process aborts). HardenUcxForPeers sets
//   UCX_PROTO_INDIRECT_ID=on, so every id this process gives out is indirect; a message
//   naming any other is dropped unread. Where each id lies was found by feeding each
//   handler a forged pointer at each place (transport/ucx_hardening_test feeds every
//   one).
// - kDrop: protocols kvagent never uses: every message is dropped.
// - kShape: the active message protocol kvagent itself uses, which names no id: only its
//   shape is checked (below).
// `features`: what the library declares for it (checked, so a table whose meaning
// changed is not patched).
// `shape`: for the active message protocols (kvagent's own), how the lengths a message
// gives must fit it. UCX 1.13 trusts them: a user header longer than the message it
// came in, a message shorter than its header or footer, or a first fragment longer
// than the whole message it starts made the process abort on an assertion (an 8-byte
// message of id AM_SINGLE, from any peer) or copy past the buffer it allocated. A
// message that does not fit is dropped unread.
enum class Kind { kRange, kId, kDrop, kShape };
enum class Shape {
  kAny,
  kAmSingle,  // ucp_am_hdr_t (8: id, flags, user header length), data, user header
  kAmReply,   // the same, then the reply footer (8: the sender's endpoint id)
  kAmFirst,   // the same, then the first fragment's footer (24: message id, endpoint
              // id, the whole message's size)
  kAmMiddle,  // its offset (8), data, then its footer (16: message id, endpoint id)
  kRndvRts,   // ucp_rndv_rts_hdr_t (41: a tag or ucp_am_hdr_t, endpoint and request ids,
              // address, size, kind), the packed key, then an active message's user header
  kWireup,    // ucp_wireup_msg_t (20: type, error mode, connection number, source and
              // destination endpoint ids), then the sender's packed worker address
};
struct IdPlace {
  int at = -1;            // byte offset of the id UCP looks up (-1: none)
  bool from_end = false;  // counted back from the message's end (a footer)
  bool zero_ok = false;   // 0 means "none yet" there (a wireup request's)
  int sender_at = -1;     // a sender's own request id, which UCP asserts is not 0
};
struct Protocol {
  const char* symbol;  // ucp_am_handler_UCP_AM_ID_<symbol>
  const char* name;
  uint64_t features;
  Kind kind;
  IdPlace id;
  Shape shape = Shape::kAny;
};
constexpr uint64_t kTagAm = UCP_FEATURE_TAG | UCP_FEATURE_AM;
constexpr uint64_t kAmo = UCP_FEATURE_AMO32 | UCP_FEATURE_AMO64;
constexpr std::array<Protocol, 22> kProtocols = {{
    {"PUT", "put (software RMA)", UCP_FEATURE_RMA, Kind::kRange, {8}},
    {"GET_REQ", "get request (software RMA)", UCP_FEATURE_RMA, Kind::kRange, {16}},
    {"GET_REP", "get reply (software RMA)", UCP_FEATURE_RMA, Kind::kId, {0}},
    {"CMPL", "put completion (software RMA)", UCP_FEATURE_RMA | kAmo, Kind::kId, {0}},
    {"EAGER_SYNC_ONLY", "synchronous tagged send", UCP_FEATURE_TAG, Kind::kId,
     {8, false, false, 16}},
    {"EAGER_SYNC_ACK", "synchronous tagged send acknowledgement", UCP_FEATURE_TAG, Kind::kId,
     {0}},
    {"RNDV_RTS", "rendezvous request", kTagAm, Kind::kId, {8}, Shape::kRndvRts},
    {"RNDV_ATS", "rendezvous acknowledgement", kTagAm, Kind::kId, {0}},
    {"RNDV_ATP", "rendezvous put acknowledgement", kTagAm, Kind::kId, {0}},
    {"RNDV_RTR", "rendezvous ready-to-receive", kTagAm, Kind::kId, {0}},
    {"RNDV_DATA", "rendezvous data", kTagAm, Kind::kId, {0}},
    {"AM_FIRST", "active message's first fragment", UCP_FEATURE_AM, Kind::kId, {16, true},
     Shape::kAmFirst},
    {"AM_MIDDLE", "active message's later fragment", UCP_FEATURE_AM, Kind::kId, {8, true},
     Shape::kAmMiddle},
    {"AM_SINGLE_REPLY", "active message with reply", UCP_FEATURE_AM, Kind::kId, {8, true},
     Shape::kAmReply},
    {"AM_SINGLE", "active message", UCP_FEATURE_AM, Kind::kShape, {}, Shape::kAmSingle},
    {"WIREUP", "wireup", ~uint64_t{0}, Kind::kId, {12, false, true}, Shape::kWireup},
    {"ATOMIC_REQ", "atomic request", kAmo, Kind::kDrop, {}},
    {"ATOMIC_REP", "atomic reply", kAmo, Kind::kDrop, {}},
    {"STREAM_DATA", "stream data", UCP_FEATURE_STREAM, Kind::kDrop, {}},
    // Tagged sends of several fragments: kvagent sends no tagged message (a peer's
    // single-fragment ones are taken and discarded, UcxWorker); UCX 1.13 aborts on a
    // first fragment shorter than its header.
    {"EAGER_FIRST", "tagged send's first fragment", UCP_FEATURE_TAG, Kind::kDrop, {}},
    {"EAGER_MIDDLE", "tagged send's later fragment", UCP_FEATURE_TAG, Kind::kDrop, {}},
    // Its later fragments are EAGER_MIDDLE, dropped above: it could never complete.
    {"EAGER_SYNC_FIRST", "synchronous tagged send's first fragment", UCP_FEATURE_TAG,
     Kind::kDrop, {}},
}};
constexpr size_t kPut = 0;  // the other range-checked one is the get request

// The headers of the two range-checked protocols (UCX 1.13's ucp_put_hdr_t and
// ucp_get_req_hdr_t, packed): the address first, a get request's length second, the
// memory type (a 4-byte ucs_memory_type_t) last.
constexpr size_t kPutHeaderBytes = 8 + 8 + 4;           // address, ep id, memory type
constexpr size_t kGetRequestBytes = 8 + 8 + 8 + 8 + 4;  // address, length, request, type

// The originals of the checked protocols (kRange, kId), called for what passes.
std::array<uct_am_callback_t, kProtocols.size()> g_original_cb{};
std::array<uct_am_callback_t, kProtocols.size()> g_original_proxy{};

// Memory registered for peers: begin -> its length and memory type (several
// registrations may share a begin). `g_longest` bounds how far back a lookup walks.
struct PeerRange {
  PeerRange(uint64_t l, uint32_t t) : length(l), memory_type(t) {}
  uint64_t length;
  uint32_t memory_type;  // ucs_memory_type_t
  // A software get was served from it: its reply may still be sent from it after the
  // range is forbidden, until the workers flushed.
  mutable std::atomic<bool> read{false};
};
absl::Mutex g_ranges_mu;
std::multimap<uintptr_t, PeerRange>* g_ranges ABSL_GUARDED_BY(g_ranges_mu) =
    new std::multimap<uintptr_t, PeerRange>();
uint64_t g_longest ABSL_GUARDED_BY(g_ranges_mu) = 0;

// Ranges a get reply may still read: forbidden after a software get was served from
// them (g_read), and those of them unmapped meanwhile and mapped to zero pages instead
// (g_retired, RetireMapping). Each waits for a flush of every joined worker begun after
// its sequence number.
struct Retired {
  void* base;
  uint64_t length;
  uint64_t sequence;
};
struct Flusher {
  void (*wake)(const void*);
  uint64_t flushed_through;  // every retirement up to here is flushed by this worker
};
absl::Mutex g_retire_mu;
std::vector<Retired>* g_read ABSL_GUARDED_BY(g_retire_mu) = new std::vector<Retired>();
std::vector<Retired>* g_retired ABSL_GUARDED_BY(g_retire_mu) = new std::vector<Retired>();
std::map<const void*, Flusher>* g_flushers ABSL_GUARDED_BY(g_retire_mu) =
    new std::map<const void*, Flusher>();
uint64_t g_retire_sequence ABSL_GUARDED_BY(g_retire_mu) = 0;
uint64_t g_retired_bytes ABSL_GUARDED_BY(g_retire_mu) = 0;
uint64_t g_retired_released ABSL_GUARDED_BY(g_retire_mu) = 0;
std::atomic<uint64_t> g_retire_sequence_now{0};  // g_retire_sequence, read without the lock

// A new sequence number, which every joined worker is woken to flush past.
uint64_t NextSequenceLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_retire_mu) {
  const uint64_t sequence = ++g_retire_sequence;
  g_retire_sequence_now.store(sequence, std::memory_order_release);
  for (const auto& [worker, flusher] : *g_flushers) flusher.wake(worker);
  return sequence;
}

// Forgets the read ranges and unmaps the retired ones every joined worker flushed past.
void ReleaseFlushedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_retire_mu) {
  uint64_t through = UINT64_MAX;
  for (const auto& [worker, flusher] : *g_flushers) {
    through = std::min(through, flusher.flushed_through);
  }
  g_read->erase(std::remove_if(g_read->begin(), g_read->end(),
                               [through](const Retired& r) { return r.sequence <= through; }),
                g_read->end());
  auto kept = g_retired->begin();
  for (auto it = g_retired->begin(); it != g_retired->end(); ++it) {
    if (it->sequence > through) {
      *kept++ = *it;
      continue;
    }
    munmap(it->base, it->length);
    g_retired_bytes -= it->length;
    ++g_retired_released;
  }
  g_retired->erase(kept, g_retired->end());
}

std::array<std::atomic<uint64_t>, kProtocols.size()> g_refused{};
std::atomic<uint64_t> g_refused_total{0};
std::atomic<bool> g_hardened{false};

// Counts one refusal in `count` (its count so far in `*mine`) and in the total; true
// for the first few and then every 1,024th, the ones to log (a flood does not flood the
// log).
bool CountRefusalIn(std::atomic<uint64_t>& count, uint64_t* mine) {
  *mine = count.fetch_add(1, std::memory_order_relaxed) + 1;
  g_refused_total.fetch_add(1, std::memory_order_relaxed);
  return log::Sampled(*mine);
}

// Counts one dropped message of protocol `k` (the count of its kind so far in `*mine`);
// true for the ones to log.
bool CountDropped(size_t k, uint64_t* mine) {
  return CountRefusalIn(g_refused[k], mine);
}

// Counts one dropped message of protocol `k`, and logs it as CountDropped says. `bytes`
// of `memory_type` at `address`: what a range-checked one named (ignored for the
// others); `short_header`: a checked one too short to name anything.
void CountRefused(size_t k, size_t length, uint64_t address = 0, uint64_t bytes = 0,
                  uint32_t memory_type = 0, bool short_header = false) {
  uint64_t mine = 0;
  if (!CountDropped(k, &mine)) return;
  if (short_header) {
    kLog.Warn("UCX: dropped a peer's {} message of {} bytes ({} so far): too short for its "
              "header, so the sender is not UCX 1.13 or is hostile",
              kProtocols[k].name, length, mine);
  } else if (kProtocols[k].kind == Kind::kRange) {
    kLog.Warn(
        "UCX: dropped a peer's {} message ({} bytes; {} so far): it names {} bytes of memory "
        "type {} at {:#x}, outside the memory this agent registered for peers (UCX would "
        "have served it at any address)",
        kProtocols[k].name, length, mine, bytes, memory_type, address);
  } else {
    kLog.Warn(
        "UCX: dropped a peer's {} message ({} bytes; {} so far): this agent does not "
        "serve this UCX protocol, so the peer runs something other than kvagent or is "
        "hostile",
        kProtocols[k].name, length, mine);
  }
}

// Counts one dropped message of protocol `k` that names `id`, which this process did not
// give out, or (`senders`) whose sender's own request id is 0; logs it as CountDropped
// says.
void CountRefusedId(size_t k, size_t length, uint64_t id, bool senders = false) {
  uint64_t mine = 0;
  if (!CountDropped(k, &mine)) return;
  if (senders) {
    kLog.Warn("UCX: dropped a peer's {} message ({} bytes; {} so far): its own request id is "
              "0, which UCX would have aborted on",
              kProtocols[k].name, length, mine);
    return;
  }
  kLog.Warn("UCX: dropped a peer's {} message ({} bytes; {} so far): it names endpoint or "
            "request id {:#x}, which this agent's UCX did not give out (its ids are "
            "indirect, odd); UCX would have {}",
            kProtocols[k].name, length, mine, id,
            id == 0 ? "aborted on it" : "dereferenced it as a pointer");
}

// Drops one message of protocol K: nothing in it is read, nothing is answered (a
// sender's get or atomic waits until its own error handling or timeout gives up).
template <size_t K>
ucs_status_t Refuse(void*, void*, size_t length, unsigned) {
  CountRefused(K, length);
  return UCS_OK;
}

// The allowed range holding all of [address, address + length) of `memory_type`, or null.
const PeerRange* RangeAdmitsLocked(uint64_t address, uint64_t length, uint32_t memory_type)
    ABSL_SHARED_LOCKS_REQUIRED(g_ranges_mu) {
  if (length > UINT64_MAX - address) return nullptr;
  auto it = g_ranges->upper_bound(static_cast<uintptr_t>(address));
  while (it != g_ranges->begin()) {
    --it;
    if (address - it->first > g_longest) break;  // none further back is long enough
    if (address + length <= it->first + it->second.length &&
        memory_type == it->second.memory_type) {
      return &it->second;
    }
  }
  return nullptr;
}

// True when the put or get request in `data` names only memory registered for peers.
template <size_t K>
bool Admit(const void* data, size_t length) ABSL_SHARED_LOCKS_REQUIRED(g_ranges_mu) {
  const auto* header = static_cast<const char*>(data);
  uint64_t address = 0, bytes = 0;
  uint32_t memory_type = 0;
  const size_t need = K == kPut ? kPutHeaderBytes : kGetRequestBytes;
  if (length < need) {
    CountRefused(K, length, 0, 0, 0, /*short_header=*/true);
    return false;
  }
  std::memcpy(&address, header, 8);
  std::memcpy(&memory_type, header + need - 4, 4);
  if (K == kPut) {
    bytes = length - kPutHeaderBytes;
  } else {
    std::memcpy(&bytes, header + 8, 8);
  }
  if (const PeerRange* range = RangeAdmitsLocked(address, bytes, memory_type)) {
    if (K != kPut) range->read.store(true, std::memory_order_relaxed);  // a get request
    return true;
  }
  CountRefused(K, length, address, bytes, memory_type);
  return false;
}

// The active message protocols' headers and footers (UCX 1.13's ucp_am_hdr_t,
// ucp_am_reply_ftr_t, ucp_am_first_ftr_t, ucp_am_mid_hdr_t and ucp_am_mid_ftr_t).
constexpr size_t kAmHeaderBytes = 8;             // id (2), flags (2), user header length (4)
constexpr size_t kAmUserHeaderLengthAt = 4;
constexpr size_t kAmReplyFooterBytes = 8;        // the sender's endpoint id
constexpr size_t kAmFirstFooterBytes = 8 + 8 + 8;  // message id, endpoint id, whole size
constexpr size_t kAmMiddleBytes = 8 + 8 + 8;     // offset; message id, endpoint id
// A rendezvous request's header (UCX 1.13's ucp_rndv_rts_hdr_t, packed): a tag or an
// active message's ucp_am_hdr_t, endpoint and request ids, address, size, then its kind.
constexpr size_t kRndvRtsBytes = 8 + 8 + 8 + 8 + 8 + 1;
constexpr uint8_t kRndvRtsTagged = 0;         // UCP_RNDV_RTS_TAG_OK
constexpr uint8_t kRndvRtsActiveMessage = 1;  // UCP_RNDV_RTS_AM
// A wireup message's header (UCX 1.13's ucp_wireup_msg_t, packed): type, error mode,
// connection number (2), source and destination endpoint ids; the sender's packed worker
// address follows, its version in the low 4 bits of its first byte.
constexpr size_t kWireupHeaderBytes = 1 + 1 + 2 + 8 + 8;
constexpr size_t kWireupSenderAt = 4;
constexpr size_t kWireupDestinationAt = 12;
// UCP_WIREUP_MSG_*: pre-request (0), request, reply, acknowledgement, endpoint check (a
// peer's UCX keepalive), endpoint removed (5).
constexpr uint8_t kWireupPreRequest = 0;
constexpr uint8_t kWireupRequest = 1;
constexpr uint8_t kWireupReply = 2;
constexpr uint8_t kWireupAck = 3;
constexpr uint8_t kWireupEndpointCheck = 4;
// A worker address (UCX 1.13's, version 1) with no transport: its header (a worker
// uuid follows), the uuid (0), then the end of its devices.
constexpr char kEmptyAddress[] = {0x20, 0, 0, 0, 0, 0, 0, 0, 0, static_cast<char>(0xff)};
constexpr uint8_t kWireupLastType = 5;
constexpr uint8_t kAddressVersionMask = 0x0f;
constexpr uint8_t kAddressVersionLatest = 1;  // UCP_OBJECT_VERSION_V2 (V1 is 0)

// Why a peer's worker address of `length` bytes, as a wireup message carries it, would
// have UCX 1.13 read past its end ("" when it would not). UCP's unpacking trusts the
// lengths and flags the address gives and reads on past the message: the walk here
// follows it (its non-unified layout, and the flags a wireup message is unpacked with:
// worker uuid, name, device, interface and endpoint addresses, resource index) and
// needs each byte it reads inside the address. More than 64 transport entries, or 6
// endpoint addresses for one, UCP refuses itself (before it reads on): so does the walk.
std::string AddressRefusal(const uint8_t* address, size_t length) {
  constexpr uint8_t kVersion2 = 1;           // UCP_OBJECT_VERSION_V2
  constexpr uint8_t kHasUuid = 0x02;         // UCP_ADDRESS_HEADER_FLAG_WORKER_UUID
  constexpr uint8_t kHasClientId = 0x04;     // UCP_ADDRESS_HEADER_FLAG_CLIENT_ID
  constexpr uint8_t kHasName = 0x01;         // UCP_ADDRESS_HEADER_FLAG_DEBUG_INFO
  constexpr uint8_t kNoDevice = 0xff;        // UCP_NULL_RESOURCE
  constexpr uint8_t kLast = 0x80;            // UCP_ADDRESS_FLAG_LAST
  constexpr uint8_t kHasEndpoints = 0x40;    // UCP_ADDRESS_FLAG_HAS_EP_ADDR
  constexpr uint8_t kNumPaths = 0x40;        // UCP_ADDRESS_FLAG_NUM_PATHS
  constexpr uint8_t kSystemDevice = 0x20;    // UCP_ADDRESS_FLAG_SYS_DEVICE
  constexpr uint8_t kDeviceLength = 0x1f;    // UCP_ADDRESS_DEVICE_LEN_MASK
  constexpr uint8_t kInterfaceLength = 0x3f;  // UCP_ADDRESS_IFACE_LEN_MASK
  constexpr uint8_t kEmptyDevice = 0x80;     // UCP_ADDRESS_FLAG_MD_EMPTY_DEV
  constexpr uint8_t kMdExtended = 0x7f;      // a version 2 md index continued
  constexpr size_t kAttributesV1 = 16;       // ucp_address_packed_iface_attr_t
  constexpr size_t kAttributesV2 = 8;        // ucp_address_v2_packed_iface_attr_t
  constexpr size_t kMostEntries = 64;        // UCP_MAX_RESOURCES
  constexpr size_t kMostEndpoints = 6;       // UCP_MAX_LANES
  size_t at = 0;
  std::string short_at;
  // The next byte, or false (noting where) when the address has no more.
  auto next = [&](const char* what, uint8_t* out) {
    if (at >= length) {
      short_at = fmt::format("{} at byte {}", what, at);
      return false;
    }
    *out = address[at++];
    return true;
  };
  // Skips `n` bytes that UCP reads (or hands on as an address).
  auto skip = [&](const char* what, size_t n) {
    if (n > length - std::min(at, length)) {
      short_at = fmt::format("{} of {} bytes at byte {}", what, n, at);
      return false;
    }
    at += n;
    return true;
  };
  auto refusal = [&] {
    return fmt::format("its worker address of {} bytes ends before its {} (UCX 1.13 reads on "
                       "past the message)",
                       length, short_at);
  };
  uint8_t header = 0;
  if (!next("header", &header)) return refusal();
  const bool v2 = (header & kAddressVersionMask) == kVersion2;
  uint8_t flags = static_cast<uint8_t>(header >> 4);
  if (v2 && !next("header flags", &flags)) return refusal();
  if ((!v2 || (flags & kHasUuid) != 0) && !skip("worker uuid", 8)) return refusal();
  if ((flags & kHasClientId) != 0 && !skip("client id", 8)) return refusal();
  if ((flags & kHasName) != 0) {
    uint8_t name = 0;
    if (!next("worker name's length", &name) || !skip("worker name", name)) return refusal();
  }
  if (at >= length) {
    short_at = fmt::format("first device at byte {}", at);
    return refusal();
  }
  if (address[at] == kNoDevice) return "";
  size_t entries = 0;
  for (bool last_device = false; !last_device;) {
    uint8_t md = 0, device = 0, extended = 0;
    if (!next("device's memory domain", &md)) return refusal();
    if (v2 && (md & kMdExtended) == kMdExtended && !next("device's memory domain", &extended)) {
      return refusal();
    }
    if (!next("device address length", &device)) return refusal();
    last_device = (device & kLast) != 0;
    size_t device_length = device & kDeviceLength;
    if (v2 && device_length == kDeviceLength) {
      if (!next("device address length", &extended)) return refusal();
      device_length = extended;
    }
    if ((device & kNumPaths) != 0 && !skip("device's path count", 1)) return refusal();
    if ((device & kSystemDevice) != 0 && !skip("device's system device", 1)) return refusal();
    if (!skip("device address", device_length)) return refusal();
    for (bool last_entry = (md & kEmptyDevice) != 0; !last_entry;) {
      if (++entries > kMostEntries) {
        return fmt::format("its worker address lists more than {} transports (UCX 1.13 takes "
                           "no more)",
                           kMostEntries);
      }
      if (!skip("transport entry", 2 + (v2 ? kAttributesV2 : kAttributesV1) + 1)) {
        return refusal();
      }
      uint8_t entry = 0;
      if (!next("interface address length", &entry)) return refusal();
      last_entry = (entry & kLast) != 0;
      size_t interface_length = entry & kInterfaceLength;
      if (v2 && interface_length == kInterfaceLength) {
        if (!next("interface address length", &extended)) return refusal();
        interface_length = extended;
      }
      if (!skip("interface address", interface_length)) return refusal();
      if ((entry & kHasEndpoints) == 0) continue;
      for (size_t endpoints = 0;; ++endpoints) {
        if (endpoints >= kMostEndpoints) {
          return fmt::format("its worker address gives a transport more than {} endpoint "
                             "addresses (UCX 1.13 takes no more)",
                             kMostEndpoints);
        }
        uint8_t endpoint = 0, lane = 0;
        if (!next("endpoint address length", &endpoint) ||
            !skip("endpoint address", endpoint) || !next("endpoint's lane", &lane)) {
          return refusal();
        }
        if ((lane & kLast) != 0) break;
      }
    }
  }
  return "";
}

// Why message `data` of `length` bytes does not fit `shape` ("" when it does).
std::string ShapeRefusal(Shape shape, const void* data, size_t length) {
  if (shape == Shape::kAny) return "";
  const auto* bytes = static_cast<const char*>(data);
  if (shape == Shape::kWireup) {
    if (length < kWireupHeaderBytes + 1) {
      return fmt::format("it is {} bytes, shorter than its header and an address ({}; UCX "
                         "1.13 reads past it)",
                         length, kWireupHeaderBytes + 1);
    }
    const auto type = static_cast<uint8_t>(bytes[0]);
    if (type > kWireupLastType) {
      return fmt::format("its type {} is none of UCX 1.13's (it stops the process on it)", type);
    }
    if (type == kWireupPreRequest) {
      return "it is a pre-request, which only UCX's client-server (connection manager) wireup "
             "sends and this agent does not use (UCX 1.13 aborts on one naming an endpoint "
             "without it)";
    }
    uint64_t sender = 0;
    std::memcpy(&sender, bytes + kWireupSenderAt, 8);
    if (sender == 0) {
      return "its sender names no endpoint of its own (id 0), which UCX 1.13 aborts on as it "
             "notes it";
    }
    uint64_t destination = 0;
    std::memcpy(&destination, bytes + kWireupDestinationAt, 8);
    if (destination == 0 && type != kWireupRequest) {
      return "it names no endpoint (id 0), which only a request may (UCX 1.13 aborts on it)";
    }
    if (destination != 0 && type == kWireupRequest) {
      return fmt::format("it is a request naming endpoint {:#x}, which only UCX's client-server "
                         "wireup sends (UCX 1.13 aborts on one whose sender is not that "
                         "endpoint's peer)",
                         destination);
    }
    const uint8_t version = static_cast<uint8_t>(bytes[kWireupHeaderBytes]) & kAddressVersionMask;
    if (version > kAddressVersionLatest) {
      return fmt::format("its worker address is of version {}, past the {} UCX 1.13 packs (it "
                         "aborts on it)",
                         version, kAddressVersionLatest);
    }
    return AddressRefusal(reinterpret_cast<const uint8_t*>(bytes) + kWireupHeaderBytes,
                          length - kWireupHeaderBytes);
  }
  if (shape == Shape::kRndvRts) {
    if (length < kRndvRtsBytes) {
      return fmt::format("it is {} bytes, shorter than its header ({}; UCX 1.13 reads its kind "
                         "past the message and aborts on what it finds)",
                         length, kRndvRtsBytes);
    }
    const auto kind = static_cast<uint8_t>(bytes[kRndvRtsBytes - 1]);
    if (kind != kRndvRtsTagged && kind != kRndvRtsActiveMessage) {
      return fmt::format("its kind is {}, neither a tagged send's ({}) nor an active "
                         "message's ({}) (UCX 1.13 aborts on it)",
                         kind, kRndvRtsTagged, kRndvRtsActiveMessage);
    }
    uint32_t user_header = 0;
    std::memcpy(&user_header, bytes + kAmUserHeaderLengthAt, 4);
    if (kind == kRndvRtsActiveMessage && user_header > length - kRndvRtsBytes) {
      return fmt::format("its user header of {} bytes runs past the {} bytes it came in (UCX "
                         "1.13 aborts on it)",
                         user_header, length);
    }
    return "";
  }
  if (shape == Shape::kAmMiddle) {
    if (length > kAmMiddleBytes) return "";
    return fmt::format("it is {} bytes, no more than its offset and footer ({}; UCX 1.13 "
                       "aborts on it)",
                       length, kAmMiddleBytes);
  }
  const size_t around = kAmHeaderBytes + (shape == Shape::kAmReply   ? kAmReplyFooterBytes
                                          : shape == Shape::kAmFirst ? kAmFirstFooterBytes
                                                                     : 0);
  if (length < around) {
    return fmt::format("it is {} bytes, shorter than its header and footer ({}; UCX 1.13 "
                       "aborts on it)",
                       length, around);
  }
  uint32_t user_header = 0;
  std::memcpy(&user_header, bytes + kAmUserHeaderLengthAt, 4);
  if (user_header > length - around) {
    return fmt::format("its user header of {} bytes runs past the {} bytes it came in (UCX "
                       "1.13 aborts on it, or reads and copies past the message)",
                       user_header, length);
  }
  if (shape == Shape::kAmFirst) {
    uint64_t whole = 0;
    std::memcpy(&whole, bytes + length - 8, 8);
    const uint64_t fragment = length - around - user_header;
    if (fragment > whole) {
      return fmt::format("its {} bytes of data are more than the {} it says its whole "
                         "message holds (UCX 1.13 copies them past the buffer it allocates)",
                         fragment, whole);
    }
  }
  return "";
}

// Counts one dropped message of protocol `k` that does not fit its shape, or (a
// fragment) its message (`why`), and logs it as CountDropped says.
void CountMisshapen(size_t k, size_t length, const std::string& why) {
  uint64_t mine = 0;
  if (!CountDropped(k, &mine)) return;
  kLog.Warn("UCX: dropped a peer's {} message of {} bytes ({} so far): {}; the sender is not "
            "UCX 1.13 or is hostile",
            kProtocols[k].name, length, mine, why);
}

// True when the id in message `data` of protocol K is indirect (odd): one UCP looks up in
// its table instead of dereferencing (and the sender's own id, where UCP asserts on
// it, is not 0).
template <size_t K>
bool IdAdmits(const void* data, size_t length) {
  constexpr IdPlace place = kProtocols[K].id;
  if constexpr (place.at < 0) {
    return true;  // names no id
  } else {
    constexpr size_t at = static_cast<size_t>(place.at);
    constexpr size_t need =
        place.from_end ? at
                       : std::max(at, static_cast<size_t>(std::max(place.sender_at, 0))) + 8;
    if (length < need) {
      CountRefused(K, length, 0, 0, 0, /*short_header=*/true);
      return false;
    }
    const auto* bytes = static_cast<const char*>(data);
    uint64_t id = 0;
    std::memcpy(&id, bytes + (place.from_end ? length - at : at), 8);
    if ((id & 1) == 0 && !(id == 0 && place.zero_ok)) {
      CountRefusedId(K, length, id);
      return false;
    }
    if constexpr (place.sender_at >= 0) {
      uint64_t sender = 0;
      std::memcpy(&sender, bytes + place.sender_at, 8);
      if (sender == 0) {
        CountRefusedId(K, length, sender, /*senders=*/true);
        return false;
      }
    }
    return true;
  }
}

// Active messages of several fragments (AM_FIRST, AM_MIDDLE) are assembled here: UCP's
// own handlers for them never run. UCX 1.13 copies a later fragment to the offset it
// gives in the buffer its first fragment allocated, unchecked (a peer naming one of
// this process's endpoint ids wrote wherever it liked past that buffer), stops the
// process on an assertion when a first fragment comes again for a message being
// assembled, queues later fragments that come before their first without bound, and
// allocates whatever size a first fragment names. Here each message is kept by the
// worker, endpoint id and message id its fragments name. A later fragment must start
// where the data so far ends (a peer's UCX sends a message's fragments on one lane, in
// order: HardenUcxForPeers sets UCX_MAX_EAGER_LANES=1) and end inside the message. A
// whole message goes to UCP's handler of single active messages (with reply when its
// flags ask), as UCP hands an assembled one over. Messages are bounded in bytes each
// and in all, in number, and in time without a fragment (AmAssemblyLimits). A worker's
// messages arrive on the thread that progresses it, so each thread keeps its own table
// and the data path takes no lock; the budgets are shared.
constexpr size_t IndexOf(std::string_view symbol) {
  for (size_t k = 0; k < kProtocols.size(); ++k) {
    if (std::string_view(kProtocols[k].symbol) == symbol) return k;
  }
  return kProtocols.size();
}
constexpr size_t kAmSingleIndex = IndexOf("AM_SINGLE");
constexpr size_t kAmSingleReplyIndex = IndexOf("AM_SINGLE_REPLY");
constexpr size_t kWireupIndex = IndexOf("WIREUP");
constexpr size_t kCmplIndex = IndexOf("CMPL");
static_assert(kAmSingleIndex < kProtocols.size() && kAmSingleReplyIndex < kProtocols.size() &&
              kWireupIndex < kProtocols.size() && kCmplIndex < kProtocols.size());

std::atomic<uint64_t> g_assembly_max_message{AmAssemblyLimits{}.max_message_bytes};
std::atomic<uint64_t> g_assembly_max_bytes{AmAssemblyLimits{}.max_bytes};
std::atomic<uint64_t> g_assembly_max_messages{AmAssemblyLimits{}.max_messages};
std::atomic<int64_t> g_assembly_idle_ms{AmAssemblyLimits{}.idle.count()};
std::atomic<uint64_t> g_assembly_bytes{0};
std::atomic<uint64_t> g_assembly_messages{0};
std::atomic<uint64_t> g_assembly_peak{0};
std::atomic<uint64_t> g_assembly_assembled{0};
std::atomic<uint64_t> g_assembly_refused{0};
std::atomic<uint64_t> g_assembly_abandoned{0};

struct Assembly {
  std::unique_ptr<char[]> message;  // ucp_am_hdr_t, the data, the user header, (reply footer)
  uint64_t total = 0;               // bytes of data
  uint32_t user_header = 0;
  uint64_t received = 0;  // data so far: where the next fragment starts
  bool reply = false;
  std::chrono::steady_clock::time_point last;  // its latest fragment
  // Bytes of `message`, counted in g_assembly_bytes.
  size_t length() const { return kAmHeaderBytes + total + user_header + (reply ? 8 : 0); }
};
using AssemblyKey = std::tuple<const void*, uint64_t, uint64_t>;  // worker, endpoint id, message id

void ReleaseAssembly(const Assembly& assembly) {
  g_assembly_bytes.fetch_sub(assembly.length(), std::memory_order_relaxed);
  g_assembly_messages.fetch_sub(1, std::memory_order_relaxed);
}

// The messages being assembled on this thread; those left when it ends are freed.
struct AssemblyTable {
  std::map<AssemblyKey, Assembly> messages;
  std::chrono::steady_clock::time_point swept;
  ~AssemblyTable() {
    for (const auto& [key, assembly] : messages) ReleaseAssembly(assembly);
  }
};
thread_local AssemblyTable t_assemblies;

// Counts one fragment of protocol `k` dropped (`why`) in the assembly's refusals too.
void CountAssemblyRefused(size_t k, size_t length, const std::string& why) {
  g_assembly_refused.fetch_add(1, std::memory_order_relaxed);
  CountMisshapen(k, length, why);
}

// Drops this thread's messages that had no fragment for the idle time (their sender
// stopped or died mid-message), at most once a second.
void SweepIdleAssemblies(std::chrono::steady_clock::time_point now) {
  AssemblyTable& table = t_assemblies;
  if (table.messages.empty() || now - table.swept < std::chrono::seconds(1)) return;
  table.swept = now;
  const std::chrono::milliseconds idle(g_assembly_idle_ms.load(std::memory_order_relaxed));
  for (auto it = table.messages.begin(); it != table.messages.end();) {
    if (now - it->second.last < idle) {
      ++it;
      continue;
    }
    const uint64_t abandoned = g_assembly_abandoned.fetch_add(1, std::memory_order_relaxed) + 1;
    if (log::Sampled(abandoned)) {
      kLog.Warn("UCX: dropped a peer's active message of {} bytes after {} of them arrived: "
                "no fragment for {} ms (its sender stopped mid-message; {} so far)",
                it->second.total, it->second.received, idle.count(), abandoned);
    }
    ReleaseAssembly(it->second);
    it = table.messages.erase(it);
  }
}

// Hands a whole message to UCP's handler of single active messages (or of those with
// reply), which calls the application's handler with it.
ucs_status_t DeliverAssembled(void* worker, const Assembly& assembly) {
  g_assembly_assembled.fetch_add(1, std::memory_order_relaxed);
  const size_t k = assembly.reply ? kAmSingleReplyIndex : kAmSingleIndex;
  return g_original_cb[k](worker, assembly.message.get(), assembly.length(), 0);
}

// A first fragment that fits its shape and names an indirect endpoint id.
ucs_status_t AssembleFirst(size_t k, void* worker, const void* data, size_t length) {
  const auto* bytes = static_cast<const char*>(data);
  uint16_t flags = 0;
  uint32_t user_header = 0;
  uint64_t message_id = 0, endpoint = 0, total = 0;
  std::memcpy(&flags, bytes + 2, 2);
  std::memcpy(&user_header, bytes + kAmUserHeaderLengthAt, 4);
  std::memcpy(&message_id, bytes + length - 24, 8);
  std::memcpy(&endpoint, bytes + length - 16, 8);
  std::memcpy(&total, bytes + length - 8, 8);
  const uint64_t fragment = length - kAmHeaderBytes - kAmFirstFooterBytes - user_header;
  const uint64_t most = g_assembly_max_message.load(std::memory_order_relaxed);
  if (total > most || user_header > most - total) {
    CountAssemblyRefused(k, length,
                         fmt::format("it starts a message of {} bytes of data and {} of user "
                                     "header, more than the {} this agent assembles one from",
                                     total, user_header, most));
    return UCS_OK;
  }
  const auto now = std::chrono::steady_clock::now();
  SweepIdleAssemblies(now);
  AssemblyTable& table = t_assemblies;
  const AssemblyKey key{worker, endpoint, message_id};
  if (auto it = table.messages.find(key); it != table.messages.end()) {
    CountAssemblyRefused(
        k, length,
        fmt::format("message {:#x} of endpoint {:#x} is being assembled ({} of its {} bytes "
                    "arrived), and this is its first fragment again (UCX 1.13 stops the "
                    "process on it)",
                    message_id, endpoint, it->second.received, it->second.total));
    return UCS_OK;
  }
  Assembly assembly;
  assembly.total = total;
  assembly.user_header = user_header;
  assembly.reply = (flags & UCP_AM_SEND_FLAG_REPLY) != 0;
  assembly.received = fragment;
  assembly.last = now;
  const uint64_t held = assembly.length();
  const uint64_t held_before = g_assembly_bytes.fetch_add(held, std::memory_order_relaxed);
  const uint64_t count_before = g_assembly_messages.fetch_add(1, std::memory_order_relaxed);
  const uint64_t max_bytes = g_assembly_max_bytes.load(std::memory_order_relaxed);
  const uint64_t max_messages = g_assembly_max_messages.load(std::memory_order_relaxed);
  std::string why;
  if (held_before + held > max_bytes) {
    why = fmt::format("it starts a message of {} bytes while {} bytes of messages are being "
                      "assembled, the most this agent holds for them being {}",
                      held, held_before, max_bytes);
  } else if (count_before >= max_messages) {
    why = fmt::format("{} messages are being assembled, the most this agent holds at once",
                      count_before);
  } else {
    assembly.message.reset(new (std::nothrow) char[held]);
    if (assembly.message == nullptr) {
      why = fmt::format("{} bytes to assemble it could not be allocated", held);
    }
  }
  if (!why.empty()) {
    ReleaseAssembly(assembly);
    CountAssemblyRefused(k, length, why);
    return UCS_OK;
  }
  uint64_t peak = g_assembly_peak.load(std::memory_order_relaxed);
  while (held_before + held > peak &&
         !g_assembly_peak.compare_exchange_weak(peak, held_before + held)) {
  }
  char* out = assembly.message.get();
  std::memcpy(out, bytes, kAmHeaderBytes);
  std::memcpy(out + kAmHeaderBytes, bytes + kAmHeaderBytes, fragment);
  std::memcpy(out + kAmHeaderBytes + total, bytes + kAmHeaderBytes + fragment, user_header);
  if (assembly.reply) std::memcpy(out + kAmHeaderBytes + total + user_header, &endpoint, 8);
  if (fragment == total) {  // all of it (UCX sends such a one over an endpoint not yet wired)
    const ucs_status_t status = DeliverAssembled(worker, assembly);
    ReleaseAssembly(assembly);
    return status;
  }
  table.messages.emplace(key, std::move(assembly));
  return UCS_OK;
}

// A later fragment that fits its shape and names an indirect endpoint id.
ucs_status_t AssembleMiddle(size_t k, void* worker, const void* data, size_t length) {
  const auto* bytes = static_cast<const char*>(data);
  uint64_t offset = 0, message_id = 0, endpoint = 0;
  std::memcpy(&offset, bytes, 8);
  std::memcpy(&message_id, bytes + length - 16, 8);
  std::memcpy(&endpoint, bytes + length - 8, 8);
  const uint64_t fragment = length - kAmMiddleBytes;
  AssemblyTable& table = t_assemblies;
  auto it = table.messages.find(AssemblyKey{worker, endpoint, message_id});
  if (it == table.messages.end()) {
    CountAssemblyRefused(k, length,
                         fmt::format("it carries bytes {} to {} of message {:#x} of endpoint "
                                     "{:#x}, whose first fragment did not come (or the message "
                                     "is whole, or was dropped)",
                                     offset, offset + fragment, message_id, endpoint));
    return UCS_OK;
  }
  Assembly& assembly = it->second;
  if (offset != assembly.received || fragment > assembly.total - assembly.received) {
    CountAssemblyRefused(
        k, length,
        fmt::format("it carries bytes {} to {} of message {:#x} of endpoint {:#x}, whose next "
                    "fragment starts at byte {} of {} (UCX 1.13 copies it there unchecked); the "
                    "message is dropped",
                    offset, offset + fragment, message_id, endpoint, assembly.received,
                    assembly.total));
    ReleaseAssembly(assembly);
    table.messages.erase(it);
    return UCS_OK;
  }
  std::memcpy(assembly.message.get() + kAmHeaderBytes + offset, bytes + 8, fragment);
  assembly.received += fragment;
  assembly.last = std::chrono::steady_clock::now();
  if (assembly.received < assembly.total) return UCS_OK;
  Assembly whole = std::move(assembly);
  table.messages.erase(it);
  const ucs_status_t status = DeliverAssembled(worker, whole);
  ReleaseAssembly(whole);
  return status;
}

// Replies held for requesters that do not read. Serving a software put or get leaves
// one reply (the put's completion, the get's data) that UCP sends on the requester's
// endpoint; what the socket or FIFO does not take waits in that UCT endpoint's pending
// queue as a UCP request (about 350 bytes of this process's memory each) until the
// requester reads on. Held counts them per UCT endpoint, through UCT's own operations
// (WatchHeldReplies): a reply that went pending while a checked handler served its
// request is added, with a get's bytes still to send; one is taken off when UCT sends
// it (a completion, or a get's last bytes), and all when the endpoint's queue is purged
// or the endpoint destroyed. Replies that went pending elsewhere (behind UCP's wireup)
// are not counted, and a send of one takes a counted one of its kind off (a get's, the
// oldest: UCT sends its pending queue in order): the count may run low, never high, so
// an honest requester is never refused by it.
// The endpoint a request names (its id in this worker) is matched to its UCT endpoint
// when its first reply goes pending.
using EndpointKey = std::pair<const void*, uint64_t>;  // UCP worker, endpoint id
struct HeldQueue {
  uint64_t completions = 0;  // puts' completions
  std::deque<uint64_t> gets;  // each get's bytes still to send, the oldest first
  std::vector<EndpointKey> keys;  // the endpoint ids that named it
  uint64_t size() const { return completions + gets.size(); }
};
absl::Mutex g_held_mu;
std::map<const void*, HeldQueue>* g_held ABSL_GUARDED_BY(g_held_mu) =
    new std::map<const void*, HeldQueue>();
std::map<EndpointKey, const void*>* g_endpoint_of ABSL_GUARDED_BY(g_held_mu) =
    new std::map<EndpointKey, const void*>();
uint64_t g_held_total ABSL_GUARDED_BY(g_held_mu) = 0;
uint64_t g_held_peak ABSL_GUARDED_BY(g_held_mu) = 0;  // the most one endpoint ever had
std::atomic<uint64_t> g_held_cap{kDefaultHeldRepliesPerEndpoint};
std::atomic<uint64_t> g_held_refused{0};
// Endpoints UCP may make for peers' messages, per worker (SetPeerEndpointCap).
std::atomic<uint64_t> g_peer_made_cap{kDefaultPeerEndpoints};
// The UCT active message ids of a put's completion and a get's reply (their places in
// ucp_am_handlers; -1 until hardened).
std::atomic<int> g_cmpl_id{-1};
std::atomic<int> g_get_reply_id{-1};
// The UCT active message id of a put (software RMA) this process sends (-1 until
// hardened), and for each worker that sends through a watched interface, its puts whose
// completion has not come; which worker each watched interface is of.
std::atomic<int> g_put_id{-1};
absl::Mutex g_puts_mu;
absl::flat_hash_map<const void*, const void*>* g_iface_worker ABSL_GUARDED_BY(g_puts_mu) =
    new absl::flat_hash_map<const void*, const void*>();
struct PutsInFlight {
  uint64_t count = 0;
  bool unchecked = false;  // one of its interfaces' sends is not watched
};
absl::flat_hash_map<const void*, PutsInFlight>* g_puts_in_flight ABSL_GUARDED_BY(g_puts_mu) =
    new absl::flat_hash_map<const void*, PutsInFlight>();
std::atomic<uint64_t> g_completions_refused{0};

// A put went out on an interface: one more completion its worker may take.
void NotePutSent(const void* iface) {
  absl::MutexLock lock(&g_puts_mu);
  auto it = g_iface_worker->find(iface);
  if (it != g_iface_worker->end()) ++(*g_puts_in_flight)[it->second].count;
}

// True when `worker` may take a put's completion now (one of its puts is in flight, or
// its interfaces are not watched), and counts it taken.
bool TakePutCompletion(const void* worker) {
  absl::MutexLock lock(&g_puts_mu);
  auto it = g_puts_in_flight->find(worker);
  if (it == g_puts_in_flight->end() || it->second.unchecked) return true;
  if (it->second.count == 0) return false;
  --it->second.count;
  return true;
}

// The request a checked handler serves on this thread, while UCP's handler runs.
struct Serving {
  bool active = false;
  bool get = false;
  uint64_t remaining = 0;  // a get's bytes not yet sent
  bool added = false;      // its reply went pending (and was counted)
  EndpointKey key;
};
thread_local Serving t_serving;

// True when the replies held for the endpoint `key` names reach the cap; or (`*all`)
// when those held for every endpoint reach kHeldRepliesAllEndpoints times it (a peer may
// open many endpoints) and this endpoint has one waiting too: one with none is still
// served, so a requester that reads is not refused for another's unread replies, and
// all together hold at most that bound plus one per endpoint.
bool HeldFull(const EndpointKey& key, uint64_t* held, bool* all) {
  absl::MutexLock lock(&g_held_mu);
  const uint64_t cap = g_held_cap.load(std::memory_order_relaxed);
  auto endpoint = g_endpoint_of->find(key);
  if (endpoint == g_endpoint_of->end()) return false;
  auto queue = g_held->find(endpoint->second);
  *held = queue == g_held->end() ? 0 : queue->second.size();
  if (*held > 0 && g_held_total >= kHeldRepliesAllEndpoints * cap) {
    *held = g_held_total;
    *all = true;
    return true;
  }
  return *held >= cap;
}

// A reply of the request being served went pending on UCT endpoint `ep`.
void NoteReplyHeld(const void* ep) {
  t_serving.added = true;
  absl::MutexLock lock(&g_held_mu);
  HeldQueue& queue = (*g_held)[ep];
  if (t_serving.get) {
    queue.gets.push_back(t_serving.remaining);
  } else {
    ++queue.completions;
  }
  ++g_held_total;
  g_held_peak = std::max<uint64_t>(g_held_peak, queue.size());
  auto [it, added] = g_endpoint_of->emplace(t_serving.key, ep);
  if (added) {
    queue.keys.push_back(t_serving.key);
  } else if (it->second != ep) {  // the id's endpoint now sends on another UCT endpoint
    auto was = g_held->find(it->second);
    if (was != g_held->end()) {
      auto& keys = was->second.keys;
      keys.erase(std::remove(keys.begin(), keys.end(), t_serving.key), keys.end());
    }
    it->second = ep;
    queue.keys.push_back(t_serving.key);
  }
}

// UCT sent `packed` bytes of a reply (`get`: a get's data, after its 8-byte header) on
// `ep`: while its request is served, of that reply; else of the oldest held one.
void NoteReplySent(const void* ep, bool get, ssize_t packed) {
  const uint64_t payload = get && packed > 8 ? static_cast<uint64_t>(packed) - 8 : 0;
  if (t_serving.active) {
    if (get) t_serving.remaining -= std::min(t_serving.remaining, payload);
    return;
  }
  absl::MutexLock lock(&g_held_mu);
  auto queue = g_held->find(ep);
  if (queue == g_held->end()) return;
  if (!get) {
    if (queue->second.completions == 0) return;
    --queue->second.completions;
  } else {
    auto& gets = queue->second.gets;
    if (gets.empty()) return;
    if (gets.front() > payload) {
      gets.front() -= payload;
      return;
    }
    gets.pop_front();
  }
  --g_held_total;
}

// `ep`'s pending queue was purged (`destroyed`: the endpoint is going).
void ForgetHeld(const void* ep, bool destroyed) {
  absl::MutexLock lock(&g_held_mu);
  auto queue = g_held->find(ep);
  if (queue == g_held->end()) return;
  g_held_total -= queue->second.size();
  queue->second.completions = 0;
  queue->second.gets.clear();
  if (!destroyed) return;
  for (const EndpointKey& key : queue->second.keys) {
    auto it = g_endpoint_of->find(key);
    if (it != g_endpoint_of->end() && it->second == ep) g_endpoint_of->erase(it);
  }
  g_held->erase(queue);
}

// Counts and logs a request of protocol K dropped because `held` replies to its
// endpoint (`all`: to every endpoint) wait unread.
void CountHeldRefused(size_t k, size_t length, uint64_t held, bool all) {
  g_held_refused.fetch_add(1, std::memory_order_relaxed);
  uint64_t mine = 0;
  if (!CountDropped(k, &mine)) return;
  if (all) {
    kLog.Warn("UCX: dropped a peer's {} message ({} bytes; {} so far): {} replies to peers' "
              "software puts and gets wait unread, the most held for all endpoints ({} x "
              "--ucx-held-replies), and its endpoint has some too; requesters do not read "
              "what this agent sends them (an endpoint with none waiting is still served)",
              kProtocols[k].name, length, mine, held, kHeldRepliesAllEndpoints);
    return;
  }
  kLog.Warn("UCX: dropped a peer's {} message ({} bytes; {} so far): {} replies to its "
            "endpoint wait unread, the most held for one (--ucx-held-replies); the requester "
            "does not read what this agent sends it",
            kProtocols[k].name, length, mine, held);
}

// The wireup message UCP handles on this thread now: its type, sender's endpoint id and
// worker uuid (the 8 bytes after its address's header, of 1 byte in version 1 and 2 in
// version 2; 0 when the message is shorter), and (a reply) the copy UCP reads, whose
// sender id ReplyNames may rewrite.
struct WireupInFlight {
  uint8_t type = 0;
  uint64_t sender = 0;
  uint64_t uuid = 0;
  char* copy = nullptr;
};
thread_local WireupInFlight* t_wireup = nullptr;

bool AdmitPeerEndpoint(const void* worker, MadeFor made_for, uint64_t uuid);

// Hands a wireup message that passed to UCP's handler `original`, with the message in
// flight noted for the endpoint stand-ins; a reply as a copy (UCT's buffer may be
// shared memory its sender writes). An endpoint check that comes while `worker` (null:
// UCP's proxy, which calls the handler again with the worker) holds the cap of
// endpoints made for peers is dropped.
ucs_status_t ServeWireup(uct_am_callback_t original, void* arg, const void* worker, void* data,
                         size_t length, unsigned flags) {
  WireupInFlight in;
  const auto* bytes = static_cast<const char*>(data);
  in.type = static_cast<uint8_t>(bytes[0]);
  std::memcpy(&in.sender, bytes + kWireupSenderAt, 8);
  // The sender's uuid, for the log only (ShapeRefusal passed at least the address's
  // first byte, and its whole walk).
  const size_t uuid_at =
      kWireupHeaderBytes + ((bytes[kWireupHeaderBytes] & kAddressVersionMask) == 0 ? 1 : 2);
  if (length >= uuid_at + 8) std::memcpy(&in.uuid, bytes + uuid_at, 8);
  if (in.type == kWireupEndpointCheck && worker != nullptr &&
      !AdmitPeerEndpoint(worker, MadeFor::kCheckReply, in.uuid)) {
    return UCS_OK;
  }
  std::string copy;
  if (in.type == kWireupReply) {
    copy.assign(bytes, length);
  } else if (in.type == kWireupAck) {
    // UCP reads nothing of an acknowledgement's address but asserts that it lists no
    // transport (an honest one lists none): it gets an address that lists none.
    copy.assign(bytes, kWireupHeaderBytes);
    copy.append(kEmptyAddress, sizeof kEmptyAddress);
    length = copy.size();
  }
  if (!copy.empty()) {
    in.copy = copy.data();
    data = copy.data();
  }
  WireupInFlight* const was = t_wireup;
  t_wireup = &in;
  const ucs_status_t status = original(arg, data, length, flags);
  t_wireup = was;
  return status;
}

// Serves one message of checked protocol K that passes, with UCP's own handler or
// (`kProxy`) its counting proxy. A range-checked one under the reader lock: a put is
// copied in before ForbidPeerRange can return (a get's reply may outlive it:
// RetireMapping); and only while fewer than the cap of replies to its endpoint wait.
template <size_t K, bool kProxy>
ucs_status_t Checked(void* arg, void* data, size_t length, unsigned flags) {
  if (std::string why = ShapeRefusal(kProtocols[K].shape, data, length); !why.empty()) {
    CountMisshapen(K, length, why);
    return UCS_OK;
  }
  if (!IdAdmits<K>(data, length)) return UCS_OK;
  // Fragments are assembled here (the proxy calls this with the worker).
  if constexpr (!kProxy && kProtocols[K].shape == Shape::kAmFirst) {
    return AssembleFirst(K, arg, data, length);
  } else if constexpr (!kProxy && kProtocols[K].shape == Shape::kAmMiddle) {
    return AssembleMiddle(K, arg, data, length);
  }
  if constexpr (K == kCmplIndex) {
    if (!TakePutCompletion(arg)) {
      g_completions_refused.fetch_add(1, std::memory_order_relaxed);
      uint64_t mine = 0;
      if (CountDropped(K, &mine)) {
        kLog.Warn("UCX: dropped a peer's put completion ({} so far): this worker has no put "
                  "in flight (UCX 1.13 aborts on one naming an endpoint with none)",
                  mine);
      }
      return UCS_OK;
    }
  }
  const uct_am_callback_t original = kProxy ? g_original_proxy[K] : g_original_cb[K];
  if constexpr (kProtocols[K].kind == Kind::kRange) {
    absl::ReaderMutexLock lock(&g_ranges_mu);
    if (!Admit<K>(data, length)) return UCS_OK;
    Serving serving;
    serving.active = true;
    serving.get = K != kPut;
    std::memcpy(&serving.key.second, static_cast<const char*>(data) + kProtocols[K].id.at, 8);
    serving.key.first = arg;
    if (serving.get) std::memcpy(&serving.remaining, static_cast<const char*>(data) + 8, 8);
    uint64_t held = 0;
    bool all = false;
    if (HeldFull(serving.key, &held, &all)) {
      CountHeldRefused(K, length, held, all);
      return UCS_OK;
    }
    t_serving = serving;
    const ucs_status_t status = original(arg, data, length, flags);
    t_serving.active = false;
    return status;
  } else if constexpr (K == kWireupIndex) {
    return ServeWireup(original, arg, kProxy ? nullptr : arg, data, length, flags);
  } else {
    return original(arg, data, length, flags);
  }
}

// What replaces protocol K's handler (or its proxy): Checked for the checked ones,
// Refuse for the dropped ones.
template <size_t K, bool kProxy>
constexpr uct_am_callback_t ReplacementOf() {
  if constexpr (kProtocols[K].kind != Kind::kDrop) {
    return &Checked<K, kProxy>;
  } else {
    return &Refuse<K>;
  }
}
template <bool kProxy, size_t... K>
constexpr std::array<uct_am_callback_t, sizeof...(K)> ReplacementsOf(std::index_sequence<K...>) {
  return {ReplacementOf<K, kProxy>()...};
}
constexpr auto kHandlers =
    ReplacementsOf</*kProxy=*/false>(std::make_index_sequence<kProtocols.size()>());
constexpr auto kProxies =
    ReplacementsOf</*kProxy=*/true>(std::make_index_sequence<kProtocols.size()>());

// The size of the ELF symbol at `address` (0 when unknown).
size_t SymbolSize(const void* address) {
  Dl_info info{};
  void* entry = nullptr;  // dladdr1 stores a const ElfW(Sym)* here
  if (dladdr1(address, &info, &entry, RTLD_DL_SYMENT) == 0 || entry == nullptr) return 0;
  return static_cast<const ElfW(Sym)*>(entry)->st_size;
}

// True when [address, address + length) lies in one writable mapping of this process.
bool Writable(const void* address, size_t length) {
  FILE* maps = std::fopen("/proc/self/maps", "r");
  if (maps == nullptr) return false;
  const auto begin = reinterpret_cast<uintptr_t>(address);
  bool writable = false;
  char line[512];
  while (std::fgets(line, sizeof line, maps) != nullptr) {
    uintptr_t low = 0, high = 0;
    char perms[5] = {};
    if (std::sscanf(line, "%" SCNxPTR "-%" SCNxPTR " %4s", &low, &high, perms) != 3) continue;
    if (begin >= low && begin + length <= high) {
      writable = perms[1] == 'w';
      break;
    }
  }
  std::fclose(maps);
  return writable;
}

absl::Status Patch() {
  const std::string fix =
      "kvagent checks UCP's handler table before changing it and this library's differs: "
      "run kvagentd with the UCX it was built for (Debian 12's libucx0 1.13), or set "
      "KVAGENT_UCX_UNHARDENED=1 to serve peers without this (any authenticated peer can "
      "then read and write all of the agent's memory through UCX's software RMA)";
  // By name in the global scope (the only library that defines these is libucp; the
  // address of one of its functions could be this executable's PLT entry instead).
  auto* table = static_cast<UcpAmHandler**>(dlsym(RTLD_DEFAULT, "ucp_am_handlers"));
  Dl_info where{};
  const std::string library =
      table != nullptr && dladdr(table, &where) != 0 && where.dli_fname != nullptr ? where.dli_fname
                                                                                   : "libucp";
  const size_t table_size = table == nullptr ? 0 : SymbolSize(table) / sizeof(void*);
  // The message shapes checked here, and the internal functions kvagentd's
  // ucp_endpoint_stand_in stands in for, are UCX 1.13's.
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  if (major != 1 || minor != 13) {
    return absl::FailedPreconditionError(fmt::format(
        "UCX hardening: {} is UCX {}.{}.{}, whose messages and internal functions kvagent "
        "does not know; {}",
        library, major, minor, release, fix));
  }
  std::array<UcpAmHandler*, kProtocols.size()> handlers{};
  std::array<int, kProtocols.size()> ids{};
  absl::Status result = absl::OkStatus();
  for (size_t k = 0; k < kProtocols.size() && result.ok(); ++k) {
    const Protocol& p = kProtocols[k];
    const std::string symbol = fmt::format("ucp_am_handler_UCP_AM_ID_{}", p.symbol);
    auto* handler = static_cast<UcpAmHandler*>(dlsym(RTLD_DEFAULT, symbol.c_str()));
    bool in_table = false;
    for (size_t i = 0; i < table_size && handler != nullptr; ++i) {
      if (table[i] != handler) continue;
      in_table = true;
      ids[k] = static_cast<int>(i);  // the table is indexed by active message id
    }
    if (table_size == 0) {
      result = absl::FailedPreconditionError(
          fmt::format("UCX hardening: {} has no sized symbol ucp_am_handlers; {}", library, fix));
    } else if (handler == nullptr) {
      result = absl::FailedPreconditionError(
          fmt::format("UCX hardening: {} lacks the symbol {}; {}", library, symbol, fix));
    } else if (SymbolSize(handler) != sizeof(UcpAmHandler)) {
      result = absl::FailedPreconditionError(fmt::format(
          "UCX hardening: {} is {} bytes in {}, not the {} of UCX 1.13's ucp_am_handler_t; {}",
          symbol, SymbolSize(handler), library, sizeof(UcpAmHandler), fix));
    } else if (!in_table) {
      result = absl::FailedPreconditionError(
          fmt::format("UCX hardening: {} is not in {}'s ucp_am_handlers table ({} entries); {}",
                      symbol, library, table_size, fix));
    } else if (handler->features != p.features || handler->cb == nullptr) {
      result = absl::FailedPreconditionError(fmt::format(
          "UCX hardening: {} serves features {:#x} (expected {:#x}){}; {}", symbol,
          handler->features, p.features, handler->cb == nullptr ? " with no callback" : "", fix));
    } else if (!Writable(handler, sizeof(UcpAmHandler))) {
      result = absl::FailedPreconditionError(
          fmt::format("UCX hardening: {} lies in read-only memory; {}", symbol, fix));
    }
    handlers[k] = handler;
  }
  if (!result.ok()) return result;
  // All checked: now change them. A worker installs each handler whose features meet
  // its context's; RMA and AM are in every kvagent context, so every worker created
  // from here on checks or drops these messages instead of serving them blindly or
  // handing them to UCT's stub.
  for (size_t k = 0; k < kProtocols.size(); ++k) {
    g_original_cb[k] = handlers[k]->cb;
    g_original_proxy[k] = handlers[k]->proxy_cb;
    handlers[k]->cb = kHandlers[k];
    if (handlers[k]->proxy_cb != nullptr) handlers[k]->proxy_cb = kProxies[k];
    // Installed in every kvagent context (RMA and AM): the dropped ones too.
    if (kProtocols[k].kind == Kind::kRange || kProtocols[k].kind == Kind::kDrop) {
      handlers[k]->features |= UCP_FEATURE_RMA | UCP_FEATURE_AM;
    }
    if (std::string_view(kProtocols[k].symbol) == "CMPL") g_cmpl_id.store(ids[k]);
    if (std::string_view(kProtocols[k].symbol) == "PUT") g_put_id.store(ids[k]);
    if (std::string_view(kProtocols[k].symbol) == "GET_REP") g_get_reply_id.store(ids[k]);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status HardenUcxForPeers() {
  static std::once_flag once;
  static absl::Status outcome;
  std::call_once(once, [] {
    outcome = Patch();
    if (outcome.ok()) {
      // Every endpoint and request id this process's UCX gives out indirect (odd), which
      // the kId handlers rely on: contexts read this when they are created.
      const char* was = std::getenv("UCX_PROTO_INDIRECT_ID");
      if (was != nullptr && std::string_view(was) != "on") {
        kLog.Warn("UCX: UCX_PROTO_INDIRECT_ID={} overridden with on: a hardened agent gives "
                  "peers only indirect endpoint and request ids, and drops messages naming "
                  "any other",
                  was);
      }
      setenv("UCX_PROTO_INDIRECT_ID", "on", /*overwrite=*/1);
      // A message's fragments on one lane, in order, which assembling them relies on.
      was = std::getenv("UCX_MAX_EAGER_LANES");
      if (was != nullptr && std::string_view(was) != "1") {
        kLog.Warn("UCX: UCX_MAX_EAGER_LANES={} overridden with 1: a hardened agent takes a "
                  "peer's fragmented active message only in order, on one lane",
                  was);
      }
      setenv("UCX_MAX_EAGER_LANES", "1", /*overwrite=*/1);
      g_hardened.store(true);
      kLog.Info(
          "UCX: peers' software RMA reaches only memory registered for them; their "
          "messages naming an endpoint or request id this agent did not give out, active "
          "messages, rendezvous requests and wireup messages that do not fit their shape, "
          "atomic, stream and fragmented tagged messages are dropped, other tagged ones "
          "discarded, and fragmented active messages assembled here, each fragment checked");
    }
  });
  return outcome;
}

bool UcxHardenedForPeers() { return g_hardened.load(); }

std::vector<std::string> UcxRefusedProtocols() {
  std::vector<std::string> names;
  if (!UcxHardenedForPeers()) return names;
  size_t by_id = 0;
  for (const Protocol& p : kProtocols) {
    if (p.kind == Kind::kRange) names.push_back(fmt::format("{} outside peer memory", p.name));
    if (p.kind == Kind::kDrop) names.push_back(p.name);
    by_id += p.id.at >= 0 ? 1 : 0;
  }
  names.push_back(fmt::format(
      "any of {} protocols naming an endpoint or request id this agent did not give out", by_id));
  names.push_back(
      "active message or rendezvous request whose user header, data, fragment or kind does "
      "not fit the message it came in (UCX 1.13 would abort or copy past its buffer)");
  names.push_back(
      "wireup message of a type UCX 1.13 does not know, naming no endpoint where it needs "
      "one, from sender id 0, with a worker address of a version it does not pack, a "
      "pre-request, or a request naming an endpoint (it would abort), or whose worker "
      "address it would read past its end");
  names.push_back(
      "wireup request whose address lists no transport this agent reaches, or that would "
      "give an endpoint a second configuration, and (made a repeat of the peer's own) a "
      "reply whose sender contradicts the endpoint's peer (UCX 1.13 would abort)");
  names.push_back(
      "worker address entry without the device or interface address its transport reads "
      "(taken as unreachable; UCX 1.13's tcp would read through it)");
  names.push_back(
      "put completion (software RMA) that comes while the worker has no put in flight (UCX "
      "1.13 would abort)");
  names.push_back(
      "fragment of an active message that does not follow the data so far, or first fragment "
      "of one past what this agent assembles (UCX 1.13 would copy it past its buffer or "
      "abort)");
  names.push_back(fmt::format(
      "put or get (software RMA) whose endpoint has {} replies waiting unread "
      "(--ucx-held-replies)",
      g_held_cap.load()));
  names.push_back(fmt::format(
      "wireup request or endpoint check that would have UCX make an endpoint past the {} it "
      "holds for peers (--ucx-peer-endpoints)",
      g_peer_made_cap.load()));
  names.push_back(
      "remote key whose entry names a shared memory segment to attach (UCX's posix or sysv "
      "domain)");
  names.push_back("remote key whose entry UCX cannot unpack (UCX 1.13 would crash releasing it)");
  names.push_back(
      "shared memory attach, TCP connection or cma read or write to a process of this host "
      "no door proved (a peer's worker address naming another process)");
  names.push_back(
      "peer's posix FIFO in a directory this agent's UCX cannot attach (UCX 1.13 would "
      "abort)");
  return names;
}

void AllowPeerRange(const void* address, uint64_t length, uint32_t memory_type) {
  absl::MutexLock lock(&g_ranges_mu);
  g_ranges->emplace(std::piecewise_construct,
                    std::forward_as_tuple(reinterpret_cast<uintptr_t>(address)),
                    std::forward_as_tuple(length, memory_type));
  g_longest = std::max(g_longest, length);
}

void ForbidPeerRange(const void* address, uint64_t length) {
  bool read = false;
  {
    absl::MutexLock lock(&g_ranges_mu);
    auto [first, last] = g_ranges->equal_range(reinterpret_cast<uintptr_t>(address));
    for (auto it = first; it != last; ++it) {
      if (it->second.length == length) {
        read = it->second.read.load(std::memory_order_relaxed);
        g_ranges->erase(it);
        break;
      }
    }
  }
  if (!read) return;
  // A reply from it may wait in UCX: until the workers flushed, unmapping it retires it.
  absl::MutexLock lock(&g_retire_mu);
  if (g_flushers->empty()) return;
  const uint64_t sequence = NextSequenceLocked();
  g_read->push_back(Retired{const_cast<void*>(address), length, sequence});
}

bool UcxPeerRangeAdmits(uint64_t address, uint64_t length, uint32_t memory_type) {
  absl::ReaderMutexLock lock(&g_ranges_mu);
  return RangeAdmitsLocked(address, length, memory_type) != nullptr;
}

bool RetireMapping(void* base, uint64_t length) {
  if (!g_hardened.load() || base == nullptr || length == 0) return false;
  absl::MutexLock lock(&g_retire_mu);
  // Only memory a reply may still read from: a range forbidden after a get was served
  // from it, not yet flushed by every worker (none: nothing waits).
  const auto begin = reinterpret_cast<uintptr_t>(base);
  const bool read = std::any_of(g_read->begin(), g_read->end(), [&](const Retired& r) {
    const auto from = reinterpret_cast<uintptr_t>(r.base);
    return from < begin + length && begin < from + r.length;
  });
  if (!read) return false;
  void* again = mmap(base, length, PROT_READ | PROT_WRITE,
                     MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (again == MAP_FAILED) {
    kLog.Error("UCX: mapping {} bytes at {} to zero pages for a peer's late software read "
               "failed ({}); unmapping them now",
               length, base, std::strerror(errno));
    return false;
  }
  g_retired->push_back(Retired{base, length, NextSequenceLocked()});
  g_retired_bytes += length;
  return true;
}

RetiredMappings RetiredMappingsNow() {
  absl::MutexLock lock(&g_retire_mu);
  return RetiredMappings{g_retired->size(), g_retired_bytes, g_retired_released,
                         g_read->size()};
}

void JoinRetireFlushes(const void* worker, void (*wake)(const void*)) {
  absl::MutexLock lock(&g_retire_mu);
  // A worker made now holds no reply into memory retired before: the ranges were
  // forbidden first, so no request naming them is served any more.
  (*g_flushers)[worker] = Flusher{wake, g_retire_sequence};
}

uint64_t RetireSequence() { return g_retire_sequence_now.load(std::memory_order_acquire); }

void RetireFlushCompleted(const void* worker, uint64_t sequence) {
  absl::MutexLock lock(&g_retire_mu);
  auto it = g_flushers->find(worker);
  if (it == g_flushers->end()) return;
  it->second.flushed_through = std::max(it->second.flushed_through, sequence);
  ReleaseFlushedLocked();
}

void LeaveRetireFlushes(const void* worker) {
  absl::MutexLock lock(&g_retire_mu);
  g_flushers->erase(worker);
  ReleaseFlushedLocked();
}

uint64_t UcxRefusedMessages() { return g_refused_total.load(std::memory_order_relaxed); }

namespace {
// One refusal of a kind: counted in `count`, logged (the first few and every 1,024th)
// as "UCX: refused WHAT: WHY", and kept in the thread's `note` unless one is there
// already (its caller takes it to say why an operation failed).
void NoteRefusal(std::atomic<uint64_t>& count, std::string& note, std::string_view what,
                 std::string why) {
  const uint64_t n = count.fetch_add(1, std::memory_order_relaxed) + 1;
  if (log::Sampled(n)) kLog.Warn("UCX: refused {}: {} ({} such so far)", what, why, n);
  if (note.empty()) note = std::move(why);
}

std::atomic<uint64_t> g_rkey_entries_refused{0};
// The first refusal since the calling thread last took it (Endpoint::UnpackRkey).
thread_local std::string t_rkey_refusal;

// A component's name as UCX reports it ("posix", "sysv", "tcp", ...). Components are
// libuct's statics, a handful per process: each thread keeps the few it met (a deque:
// a name handed out stays where it is).
const std::string& ComponentName(uct_component_h component) {
  thread_local std::deque<std::pair<uct_component_h, std::string>> known;
  for (const auto& [c, name] : known) {
    if (c == component) return name;
  }
  uct_component_attr_t attr{};
  attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME;
  std::string name = "unnamed";
  if (uct_component_query(component, &attr) == UCS_OK) {
    name.assign(attr.name, strnlen(attr.name, sizeof(attr.name)));
  }
  return known.emplace_back(component, std::move(name)).second;
}

// UCX's domains whose key entry names a shared memory segment to attach: they give one
// only for memory UCX allocated (ucp_mem_map with UCP_MEM_MAP_ALLOCATE), never for
// memory registered as kvagent registers its regions.
bool AttachesSegment(std::string_view component) {
  return component == "posix" || component == "sysv";
}
}  // namespace

ucs_status_t UnpackRkeyEntry(uct_component_h component, const void* entry,
                             uct_rkey_bundle_t* unpacked, RkeyUnpackFn next) {
  if (!UcxHardenedForPeers()) return next(component, entry, unpacked);
  const std::string& name = ComponentName(component);
  std::string why;
  if (AttachesSegment(name)) {
    why = fmt::format(
        "its entry for UCX's {} domain names a shared memory segment for this agent to "
        "attach as the peer's memory (not attached); an honest agent's key has none, as "
        "kvagent exports no memory UCX allocated",
        name);
  } else {
    const ucs_status_t status = next(component, entry, unpacked);
    if (status == UCS_OK || status == UCS_ERR_UNREACHABLE) return status;
    why = fmt::format("UCX's {} domain could not unpack its entry ({})", name,
                      ucs_status_string(status));
  }
  // UCX leaves a domain out of the key on "unreachable", and releases only those in it.
  unpacked->rkey = UCT_INVALID_RKEY;
  unpacked->handle = nullptr;
  unpacked->type = nullptr;
  NoteRefusal(g_rkey_entries_refused, t_rkey_refusal, "an entry of a peer's remote key",
              std::move(why));
  return UCS_ERR_UNREACHABLE;
}

std::string TakeRkeyRefusal() { return std::exchange(t_rkey_refusal, std::string()); }

uint64_t UcxRefusedRkeyEntries() {
  return g_rkey_entries_refused.load(std::memory_order_relaxed);
}

namespace {
std::atomic<bool> g_same_host_armed{false};
absl::Mutex g_same_host_mu;
// A pid a door proved: how many holds keep it now, the process's start time (so that
// another process given the same pid later is not taken for it), and, once no hold
// is left, until when it stays admitted (SetSameHostGrace).
struct HeldPid {
  int holds = 0;
  uint64_t start_ticks = 0;  // 0: unknown (its /proc/PID/stat was unreadable)
  std::chrono::steady_clock::time_point until{};
};
std::map<int, HeldPid>* g_same_host_pids ABSL_GUARDED_BY(g_same_host_mu) =
    new std::map<int, HeldPid>();
std::chrono::steady_clock::duration g_same_host_grace ABSL_GUARDED_BY(g_same_host_mu) =
    std::chrono::seconds(10);
// Pids kept in their grace at most (each a peer-role session that closed within the
// grace: more only from a flood of short sessions by as many processes).
constexpr size_t kMaxGracePids = 1024;
std::atomic<uint64_t> g_same_host_refused{0};
thread_local std::string t_same_host_refusal;
// UCX connects an endpoint for a peer proven at the local door (SameHostTcpCheck).
thread_local bool t_tcp_checked = false;
constexpr std::string_view kSameHostReach = "a reach of another process of this host";
}  // namespace

void ArmSameHostGuard() { g_same_host_armed.store(true); }

namespace {
// Field 22 of /proc/PID/stat: when the process started, in clock ticks after boot; 0
// when it cannot be read (no such process). `state` (when given) gets field 3, the
// process's state ('Z': it ended and waits to be reaped), or 0.
uint64_t ProcessStartTicks(int pid, char* state = nullptr) {
  if (state != nullptr) *state = 0;
  const std::string path = fmt::format("/proc/{}/stat", pid);
  std::FILE* file = std::fopen(path.c_str(), "re");
  if (file == nullptr) return 0;
  char line[1024];
  const bool read = std::fgets(line, sizeof(line), file) != nullptr;
  std::fclose(file);
  if (!read) return 0;
  // After the command name, which may hold spaces and parentheses: its last ')'.
  const char* rest = std::strrchr(line, ')');
  if (rest == nullptr) return 0;
  char field3 = 0;
  unsigned long long ticks = 0;
  // Field 3 read, 4 to 21 skipped, 22 read.
  if (std::sscanf(rest + 1,
                  " %c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d "
                  "%*d %llu",
                  &field3, &ticks) != 2) {
    return 0;
  }
  if (state != nullptr) *state = field3;
  return ticks;
}

// The same-host endpoints: an admission of proven pid `pid` made while UCP sets up an
// endpoint's lanes ties the endpoint to that process (defined below, with the followed
// endpoints).
void NoteSameHostReach(int pid);

// Drops the entries whose grace ended.
void PruneHeldLocked(std::chrono::steady_clock::time_point now)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_same_host_mu) {
  for (auto it = g_same_host_pids->begin(); it != g_same_host_pids->end();) {
    if (it->second.holds <= 0 && it->second.until <= now) {
      it = g_same_host_pids->erase(it);
    } else {
      ++it;
    }
  }
}

// Whether `pid`, as `held` (a copy of its entry, taken under the lock) says, is admitted
// now: held, or within its grace and still the process that was proven (its
// /proc/PID/stat, read without the lock).
bool Admitted(int pid, const HeldPid& held, std::chrono::steady_clock::time_point now) {
  if (held.holds > 0) return true;
  if (held.until <= now) return false;
  return held.start_ticks != 0 && ProcessStartTicks(pid) == held.start_ticks;
}

bool PidAdmitted(int pid) {
  HeldPid held;
  {
    absl::MutexLock lock(&g_same_host_mu);
    auto it = g_same_host_pids->find(pid);
    if (it == g_same_host_pids->end()) return false;
    held = it->second;
  }
  return Admitted(pid, held, std::chrono::steady_clock::now());
}
}  // namespace

void SetSameHostGrace(std::chrono::steady_clock::duration grace) {
  absl::MutexLock lock(&g_same_host_mu);
  g_same_host_grace = grace;
}

void AllowSameHostPeer(int pid) {
  const uint64_t start_ticks = ProcessStartTicks(pid);
  absl::MutexLock lock(&g_same_host_mu);
  PruneHeldLocked(std::chrono::steady_clock::now());
  HeldPid& held = (*g_same_host_pids)[pid];
  // New, or in its grace: the process proven now is the one admitted.
  if (held.holds <= 0) {
    held.holds = 0;
    held.start_ticks = start_ticks;
  }
  ++held.holds;
}

void ForgetSameHostPeer(int pid) {
  absl::MutexLock lock(&g_same_host_mu);
  auto it = g_same_host_pids->find(pid);
  if (it == g_same_host_pids->end() || --it->second.holds > 0) return;
  it->second.holds = 0;
  const auto now = std::chrono::steady_clock::now();
  it->second.until = now + g_same_host_grace;
  PruneHeldLocked(now);
  // Bounded: past kMaxGracePids in their grace, the one whose grace ends first goes.
  size_t in_grace = 0;
  auto first = g_same_host_pids->end();
  for (auto e = g_same_host_pids->begin(); e != g_same_host_pids->end(); ++e) {
    if (e->second.holds > 0) continue;
    ++in_grace;
    if (first == g_same_host_pids->end() || e->second.until < first->second.until) first = e;
  }
  if (in_grace > kMaxGracePids) g_same_host_pids->erase(first);
}

bool SameHostTargetAdmitted(int pid, SameHostUse use) {
  if (!g_same_host_armed.load(std::memory_order_relaxed)) return true;
  const bool own = pid == ::getpid();
  if (own && use == SameHostUse::kAttach) return true;
  if (!own && PidAdmitted(pid)) {
    NoteSameHostReach(pid);
    return true;
  }
  NoteRefusal(g_same_host_refused, t_same_host_refusal, kSameHostReach,
              use == SameHostUse::kCma
                  ? fmt::format("UCX's cma transport was to read or write the memory of pid "
                                "{}, {}",
                                pid, own ? "this agent itself" : "no peer proven on this host")
                  : fmt::format("UCX was to attach shared memory of pid {}, no peer proven on "
                                "this host (a same-host peer's worker address names its own "
                                "process)",
                                pid));
  return false;
}

std::string TakeSameHostRefusal() {
  return std::exchange(t_same_host_refusal, std::string());
}

uint64_t SameHostRefusals() { return g_same_host_refused.load(std::memory_order_relaxed); }

namespace {
// The pids admitted now (held by AllowSameHostPeer, or in their grace and still the
// same process), this process's own left out: a snapshot, so that /proc is read
// without the lock.
std::vector<int> HeldPeerPids() {
  std::vector<std::pair<int, HeldPid>> entries;
  {
    absl::MutexLock lock(&g_same_host_mu);
    for (const auto& [pid, held] : *g_same_host_pids) {
      if (pid != ::getpid()) entries.emplace_back(pid, held);
    }
  }
  const auto now = std::chrono::steady_clock::now();
  std::vector<int> pids;
  for (const auto& [pid, held] : entries) {
    if (Admitted(pid, held, now)) pids.push_back(pid);
  }
  return pids;
}
}  // namespace

namespace {
constexpr char kPosixSegmentPrefix[] = "ucx_shm_posix_";
// The bits of a posix segment id (UCX's mm_posix.c) that say how it is named.
constexpr uint64_t kPosixProcfs = uint64_t{1} << 63;   // a /proc/PID/fd/N link
constexpr uint64_t kPosixShmOpen = uint64_t{1} << 62;  // /dev/shm, with shm_open

// True when /proc/PID/maps lists a mapping of the file (device, inode); false when it
// does not or cannot be read (the process is gone).
bool MapsFile(int pid, dev_t device, ino_t inode) {
  const std::string maps = fmt::format("/proc/{}/maps", pid);
  std::FILE* file = std::fopen(maps.c_str(), "re");
  if (file == nullptr) return false;
  bool found = false;
  char line[512];
  while (!found && std::fgets(line, sizeof(line), file) != nullptr) {
    unsigned major_id = 0, minor_id = 0;
    unsigned long long mapped_inode = 0;
    // "START-END PERMS OFFSET MAJOR:MINOR INODE [PATH]"
    if (std::sscanf(line, "%*x-%*x %*s %*x %x:%x %llu", &major_id, &minor_id,
                    &mapped_inode) == 3) {
      found = mapped_inode == inode && makedev(major_id, minor_id) == device;
    }
    // A line longer than the buffer (a long path) continues in the next read.
    while (std::strchr(line, '\n') == nullptr &&
           std::fgets(line, sizeof(line), file) != nullptr) {
    }
  }
  std::fclose(file);
  return found;
}
}  // namespace

bool IsUcxPosixSegmentName(const char* path) {
  if (path == nullptr) return false;
  const char* slash = std::strrchr(path, '/');
  const char* name = slash == nullptr ? path : slash + 1;
  return std::strncmp(name, kPosixSegmentPrefix, sizeof(kPosixSegmentPrefix) - 1) == 0;
}

bool SameHostFileAdmitted(int fd, const char* path) {
  if (!g_same_host_armed.load(std::memory_order_relaxed)) return true;
  struct stat file {};
  std::string why;
  if (::fstat(fd, &file) != 0 || !S_ISREG(file.st_mode)) {
    why = fmt::format("UCX was to open {} as a peer's shared memory, and it is not a regular "
                      "file (a same-host peer's worker address names a file of its choice)",
                      path);
  } else {
    std::vector<int> pids = HeldPeerPids();
    pids.insert(pids.begin(), ::getpid());  // its own segments
    for (const int pid : pids) {
      if (!MapsFile(pid, file.st_dev, file.st_ino)) continue;
      if (pid != ::getpid()) NoteSameHostReach(pid);
      return true;
    }
    why = fmt::format("UCX was to open the shared memory file {}, which neither this agent nor "
                      "a peer proven on this host has mapped (a same-host peer's worker "
                      "address names another process's segment)",
                      path);
  }
  NoteRefusal(g_same_host_refused, t_same_host_refusal, kSameHostReach,
              std::move(why));
  return false;
}

SameHostTcpCheck::SameHostTcpCheck() : was_(t_tcp_checked) { t_tcp_checked = true; }
SameHostTcpCheck::~SameHostTcpCheck() { t_tcp_checked = was_; }
bool SameHostTcpChecked() { return t_tcp_checked; }

namespace {
// Whether process `pid` holds one of `listeners` (by inode): kUnreadable where this
// process may not read its descriptors (another uid's process).
enum class Holds { kYes, kNo, kUnreadable };
Holds HoldsSocket(int pid, const std::vector<std::pair<unsigned long long, uid_t>>& listeners) {
  const std::string folder = fmt::format("/proc/{}/fd", pid);
  DIR* fds = ::opendir(folder.c_str());
  if (fds == nullptr) return errno == EACCES ? Holds::kUnreadable : Holds::kNo;
  Holds holds = Holds::kNo;
  while (holds == Holds::kNo) {
    const dirent* entry = ::readdir(fds);
    if (entry == nullptr) break;
    char target[64];
    const std::string link = folder + "/" + entry->d_name;
    const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    unsigned long long inode = 0;
    if (std::sscanf(target, "socket:[%llu]", &inode) != 1) continue;
    for (const auto& [listener, owner] : listeners) {
      if (listener == inode) holds = Holds::kYes;
    }
  }
  ::closedir(fds);
  return holds;
}

// The uid that owns process `pid`, when it can be read.
std::optional<uid_t> ProcessUid(int pid) {
  struct stat process {};
  if (::stat(fmt::format("/proc/{}", pid).c_str(), &process) != 0) return std::nullopt;
  return process.st_uid;
}
}  // namespace

std::optional<int> ProcessListeningOn(
    const std::vector<std::pair<unsigned long long, uid_t>>& listeners) {
  DIR* processes = ::opendir("/proc");
  if (processes == nullptr) return std::nullopt;
  std::optional<int> found;
  while (!found.has_value()) {
    const dirent* entry = ::readdir(processes);
    if (entry == nullptr) break;
    char* end = nullptr;
    const long pid = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || pid <= 0) continue;
    const std::optional<uid_t> uid = ProcessUid(static_cast<int>(pid));
    bool of_uid = false;
    for (const auto& [listener, owner] : listeners) of_uid = of_uid || (uid && owner == *uid);
    if (of_uid && HoldsSocket(static_cast<int>(pid), listeners) == Holds::kYes) {
      found = static_cast<int>(pid);
    }
  }
  ::closedir(processes);
  return found;
}

bool SameHostListenerAdmitted(const std::vector<std::pair<unsigned long long, uid_t>>& listeners,
                              const std::string& where) {
  if (!g_same_host_armed.load(std::memory_order_relaxed) || listeners.empty()) return true;
  for (const int pid : HeldPeerPids()) {
    const Holds holds = HoldsSocket(pid, listeners);
    if (holds == Holds::kYes) {
      NoteSameHostReach(pid);
      return true;
    }
    if (holds == Holds::kUnreadable) {
      const std::optional<uid_t> uid = ProcessUid(pid);
      for (const auto& [listener, owner] : listeners) {
        if (!uid.has_value() || owner != *uid) continue;
        NoteSameHostReach(pid);
        return true;
      }
    }
  }
  NoteRefusal(g_same_host_refused, t_same_host_refusal, kSameHostReach,
              fmt::format("UCX was to connect to {}, a TCP port on this host that no peer "
                          "proven on this host listens on (a same-host peer's worker address "
                          "names another process's port)",
                          where));
  return false;
}

bool PosixPeerFifoAdmitted(const void* peer_iface_address, size_t own_address_bytes) {
  if (peer_iface_address == nullptr) return true;
  uint64_t id = 0;
  std::memcpy(&id, peer_iface_address, sizeof(id));
  if ((id & (kPosixProcfs | kPosixShmOpen)) != 0 || own_address_bytes > sizeof(id)) {
    return true;
  }
  NoteRefusal(g_same_host_refused, t_same_host_refusal, kSameHostReach,
              "the peer's posix receive FIFO is a file in a directory its worker address "
              "names (its UCX runs with UCX_POSIX_USE_PROC_LINK=n and UCX_POSIX_DIR), which "
              "this agent's UCX 1.13 cannot attach: it would stop on an assertion; run every "
              "agent of this host with UCX's default, UCX_POSIX_USE_PROC_LINK=y");
  return false;
}

namespace {
// The posix interface's own ep_create (every posix interface of the process shares it),
// and the shortest interface address among those watched.
std::atomic<uct_ep_create_func_t> g_posix_ep_create{nullptr};
std::atomic<size_t> g_posix_own_address_bytes{0};

// The check stands at ep_create, not in the interface's reachability probe: UCP,
// answering a peer's wireup request, fails an endpoint it found no lane for, and UCX
// 1.13 asserts on its missing configuration, while a lane that fails to connect fails
// the endpoint cleanly.
ucs_status_t CheckedPosixEpCreate(const uct_ep_params_t* params, uct_ep_h* ep) {
  if ((params->field_mask & UCT_EP_PARAM_FIELD_IFACE_ADDR) != 0 &&
      !PosixPeerFifoAdmitted(params->iface_addr, g_posix_own_address_bytes.load())) {
    return UCS_ERR_UNREACHABLE;
  }
  return g_posix_ep_create.load()(params, ep);
}
}  // namespace

void WatchPosixInterface(void* uct_iface) {
  auto* iface = static_cast<uct_iface_h>(uct_iface);
  uct_iface_attr_t attr{};
  if (uct_iface_query(iface, &attr) != UCS_OK) {
    kLog.Warn("UCX: a posix interface could not be queried; its peers' FIFOs named in a "
              "directory are not checked");
    return;
  }
  // Where interfaces disagree, the shortest address decides: the check is then strictest.
  size_t seen = g_posix_own_address_bytes.load();
  while ((seen == 0 || attr.iface_addr_len < seen) &&
         !g_posix_own_address_bytes.compare_exchange_weak(seen, attr.iface_addr_len)) {
  }
  uct_ep_create_func_t create = nullptr;
  if (iface->ops.ep_create != &CheckedPosixEpCreate) {
    g_posix_ep_create.compare_exchange_strong(create, iface->ops.ep_create);
    iface->ops.ep_create = &CheckedPosixEpCreate;
  }
}

namespace {
// A shared-memory interface UCP opened on this thread (NoteSharedMemoryInterface): the
// worker it is for, and UCP's object holding it.
struct SharedMemoryInterface {
  uct_iface_h iface;
  const void* worker;
  void* ucp_iface;
};
thread_local std::vector<SharedMemoryInterface> t_shm_interfaces;
// An interface was not where UCP's object holding it should hold it (not UCX 1.13).
thread_local bool t_shm_layout_unknown = false;
// Each noted interface's own close, which its stand-in calls.
absl::Mutex g_shm_close_mu;
absl::flat_hash_map<const void*, uct_iface_close_func_t>* g_shm_close
    ABSL_GUARDED_BY(g_shm_close_mu) = new absl::flat_hash_map<const void*, uct_iface_close_func_t>;

void CloseSharedMemoryInterface(uct_iface_h iface) {
  uct_iface_close_func_t close = nullptr;
  {
    absl::MutexLock lock(&g_shm_close_mu);
    auto it = g_shm_close->find(iface);
    if (it != g_shm_close->end()) {
      close = it->second;
      g_shm_close->erase(it);
    }
  }
  auto& noted = t_shm_interfaces;
  noted.erase(std::remove_if(noted.begin(), noted.end(),
                             [iface](const SharedMemoryInterface& n) { return n.iface == iface; }),
              noted.end());
  if (close != nullptr) close(iface);
}
}  // namespace

void NoteSharedMemoryInterface(void* uct_iface, void* ucp_worker, void* ucp_iface,
                               void* const* iface_out) {
  auto* iface = static_cast<uct_iface_h>(uct_iface);
  // UCP has uct_iface_open write the interface into the first field of its object for
  // it (UCX 1.13's ucp_worker_iface_t), which it gives as the async event argument.
  if (static_cast<const void*>(iface_out) != ucp_iface) {
    t_shm_layout_unknown = true;
    return;
  }
  {
    absl::MutexLock lock(&g_shm_close_mu);
    if (iface->ops.iface_close != &CloseSharedMemoryInterface) {
      (*g_shm_close)[iface] = iface->ops.iface_close;
      iface->ops.iface_close = &CloseSharedMemoryInterface;
    }
  }
  t_shm_interfaces.push_back({iface, ucp_worker, ucp_iface});
}

void CollectSharedMemoryInterfaces() {
  t_shm_interfaces.clear();
  t_shm_layout_unknown = false;
}

std::vector<void*> KeepSharedMemoryInterfacesArmed(const void* ucp_worker, std::string* error) {
  error->clear();
  // UCX 1.13's: activates the interface once more, as each endpoint lane on it does.
  using ProgressEp = void (*)(void*);
  static const auto progress_ep =
      reinterpret_cast<ProgressEp>(dlsym(RTLD_DEFAULT, "ucp_worker_iface_progress_ep"));
  std::vector<SharedMemoryInterface> mine;
  for (const SharedMemoryInterface& n : t_shm_interfaces) {
    if (n.worker == ucp_worker) mine.push_back(n);
  }
  t_shm_interfaces.clear();
  if (t_shm_layout_unknown) {
    *error =
        "UCP opened a shared-memory interface without giving its own object for it the "
        "way UCX 1.13 does";
  } else if (!mine.empty() && progress_ep == nullptr) {
    *error = "libucp has no ucp_worker_iface_progress_ep (not UCX 1.13)";
    return {};
  }
  std::vector<void*> kept;
  for (const SharedMemoryInterface& n : mine) {
    progress_ep(n.ucp_iface);
    kept.push_back(n.iface);
  }
  return kept;
}

namespace {
// An interface's own reachability probe, and which of a peer's addresses it reads: the
// device address where this interface has one, the interface address where it connects
// to interfaces and has one.
struct Reachability {
  uct_iface_is_reachable_func_t probe;
  bool device;
  bool iface;
};
absl::Mutex g_reach_mu;
absl::flat_hash_map<const void*, Reachability>* g_reach ABSL_GUARDED_BY(g_reach_mu) =
    new absl::flat_hash_map<const void*, Reachability>();
std::atomic<uint64_t> g_reach_refused{0};

int CheckedIsReachable(const uct_iface_h iface, const uct_device_addr_t* device,
                       const uct_iface_addr_t* address) {
  Reachability r{};
  {
    absl::MutexLock lock(&g_reach_mu);
    auto it = g_reach->find(iface);
    if (it == g_reach->end()) return 0;  // cannot happen: kept before the probe is replaced
    r = it->second;
  }
  if ((r.device && device == nullptr) || (r.iface && address == nullptr)) {
    uint64_t n = 0;
    if (CountRefusalIn(g_reach_refused, &n)) {
      kLog.Warn("UCX: a peer's worker address lists a transport without the {} address it "
                "needs ({} such so far); taken as unreachable (UCX 1.13's tcp reads through "
                "the missing address and dies of SIGSEGV)",
                device == nullptr ? "device" : "interface", n);
    }
    return 0;
  }
  return r.probe(iface, device, address);
}
}  // namespace

void GuardReachability(void* uct_iface) {
  if (!UcxHardenedForPeers()) return;
  auto* iface = static_cast<uct_iface_h>(uct_iface);
  if (iface->ops.iface_is_reachable == nullptr ||
      iface->ops.iface_is_reachable == &CheckedIsReachable) {
    return;
  }
  uct_iface_attr_t attr{};
  if (uct_iface_query(iface, &attr) != UCS_OK) {
    kLog.Warn("UCX: an interface could not be queried; its reachability probe reads peers' "
              "addresses unchecked");
    return;
  }
  Reachability r{iface->ops.iface_is_reachable, attr.device_addr_len > 0,
                 (attr.cap.flags & UCT_IFACE_FLAG_CONNECT_TO_IFACE) != 0 &&
                     attr.iface_addr_len > 0};
  {
    absl::MutexLock lock(&g_reach_mu);
    (*g_reach)[iface] = r;
  }
  iface->ops.iface_is_reachable = &CheckedIsReachable;
}

uint64_t UnreachableAddressEntries() { return g_reach_refused.load(std::memory_order_relaxed); }

namespace {
std::atomic<uint64_t> g_unused_id_messages{0};

ucs_status_t DropUnusedUctId(void* arg, void*, size_t length, unsigned) {
  const auto id = static_cast<unsigned>(reinterpret_cast<uintptr_t>(arg));
  uint64_t n = 0;
  if (CountRefusalIn(g_unused_id_messages, &n)) {
    kLog.Warn("UCX: dropped a message of UCT active message id {} ({} bytes), for which UCX "
              "has no handler ({} such so far): the sender runs something other than "
              "kvagent's UCX or is hostile",
              id, length, n);
  }
  return UCS_OK;
}
}  // namespace

void QuietUnusedUctIds(void* uct_iface) {
  auto* iface = static_cast<uct_iface_h>(uct_iface);
  for (unsigned id = 0; id < UCT_AM_ID_MAX; ++id) {
    // Async-safe (a counter and the logger), as some transports require.
    const ucs_status_t status = uct_iface_set_am_handler(
        iface, static_cast<uint8_t>(id), &DropUnusedUctId,
        reinterpret_cast<void*>(static_cast<uintptr_t>(id)), UCT_CB_FLAG_ASYNC);
    if (status != UCS_OK) {
      kLog.Warn("UCX: cannot give UCT active message id {} a dropping handler ({}): a peer's "
                "message of that id reaches UCT's stub, which logs it with a backtrace",
                id, ucs_status_string(status));
    }
  }
}

namespace {
// The UCT operations WatchHeldReplies stands in front of, one set per kind of interface
// (every interface of one transport shares them): each class gets its own instance of
// the stand-ins, which call that class's originals with no lookup.
struct UctOps {
  uct_ep_am_bcopy_func_t am_bcopy;
  uct_ep_pending_add_func_t pending_add;
  uct_ep_pending_purge_func_t pending_purge;
  uct_ep_destroy_func_t destroy;
  bool operator==(const UctOps& o) const {
    return am_bcopy == o.am_bcopy && pending_add == o.pending_add &&
           pending_purge == o.pending_purge && destroy == o.destroy;
  }
};
constexpr size_t kOpsClasses = 16;
absl::Mutex g_ops_mu;
// Written under g_ops_mu before the first interface of the class is changed; read
// without it after (the worker thread is handed the interface after its creation).
std::array<UctOps, kOpsClasses> g_ops{};
size_t g_ops_count ABSL_GUARDED_BY(g_ops_mu) = 0;

template <size_t I>
ssize_t HeldAmBcopy(uct_ep_h ep, uint8_t id, uct_pack_callback_t pack, void* arg,
                    unsigned flags) {
  const ssize_t packed = g_ops[I].am_bcopy(ep, id, pack, arg, flags);
  if (packed > 0) {
    if (id == g_put_id.load(std::memory_order_relaxed)) NotePutSent(ep->iface);
    const int get = g_get_reply_id.load(std::memory_order_relaxed);
    if (id == get || id == g_cmpl_id.load(std::memory_order_relaxed)) {
      NoteReplySent(ep, id == get, packed);
    }
  }
  return packed;
}
template <size_t I>
ucs_status_t HeldPendingAdd(uct_ep_h ep, uct_pending_req_t* request, unsigned flags) {
  const ucs_status_t status = g_ops[I].pending_add(ep, request, flags);
  if (status == UCS_OK && t_serving.active && !t_serving.added) NoteReplyHeld(ep);
  return status;
}
template <size_t I>
void HeldPendingPurge(uct_ep_h ep, uct_pending_purge_callback_t cb, void* arg) {
  g_ops[I].pending_purge(ep, cb, arg);
  ForgetHeld(ep, /*destroyed=*/false);
}
template <size_t I>
void HeldDestroy(uct_ep_h ep) {
  ForgetHeld(ep, /*destroyed=*/true);
  g_ops[I].destroy(ep);
}
template <size_t... I>
constexpr std::array<UctOps, sizeof...(I)> StandInsOf(std::index_sequence<I...>) {
  return {UctOps{&HeldAmBcopy<I>, &HeldPendingAdd<I>, &HeldPendingPurge<I>, &HeldDestroy<I>}...};
}
constexpr auto kOpsStandIns = StandInsOf(std::make_index_sequence<kOpsClasses>());
}  // namespace

void WatchHeldReplies(void* uct_iface) {
  if (!UcxHardenedForPeers()) return;  // no checked handler: nothing to count or bound
  auto* iface = static_cast<uct_iface_h>(uct_iface);
  const UctOps ops{iface->ops.ep_am_bcopy, iface->ops.ep_pending_add,
                   iface->ops.ep_pending_purge, iface->ops.ep_destroy};
  // A transport without these (no active messages, no pending queue) sends no reply.
  if (ops.am_bcopy == nullptr || ops.pending_add == nullptr || ops.pending_purge == nullptr ||
      ops.destroy == nullptr) {
    return;
  }
  size_t k = 0;
  {
    absl::MutexLock lock(&g_ops_mu);
    while (k < g_ops_count && !(g_ops[k] == ops)) ++k;
    if (k == g_ops_count) {
      if (k == kOpsClasses) {
        kLog.Warn("UCX: more than {} kinds of UCT interface; replies held for requesters "
                  "that do not read are not counted on this one",
                  kOpsClasses);
        return;
      }
      g_ops[k] = ops;
      ++g_ops_count;
    }
  }
  iface->ops.ep_am_bcopy = kOpsStandIns[k].am_bcopy;
  iface->ops.ep_pending_add = kOpsStandIns[k].pending_add;
  iface->ops.ep_pending_purge = kOpsStandIns[k].pending_purge;
  iface->ops.ep_destroy = kOpsStandIns[k].destroy;
}

void SetHeldRepliesPerEndpoint(uint64_t cap) { g_held_cap.store(cap); }

void SetAmAssemblyLimits(const AmAssemblyLimits& limits) {
  g_assembly_max_message.store(limits.max_message_bytes);
  g_assembly_max_bytes.store(limits.max_bytes);
  g_assembly_max_messages.store(limits.max_messages);
  g_assembly_idle_ms.store(limits.idle.count());
}

AmAssemblyLimits AmAssemblyLimitsNow() {
  AmAssemblyLimits limits;
  limits.max_message_bytes = g_assembly_max_message.load();
  limits.max_bytes = g_assembly_max_bytes.load();
  limits.max_messages = g_assembly_max_messages.load();
  limits.idle = std::chrono::milliseconds(g_assembly_idle_ms.load());
  return limits;
}

AmAssembly AmAssemblyNow() {
  AmAssembly now;
  now.messages = g_assembly_messages.load();
  now.bytes = g_assembly_bytes.load();
  now.peak_bytes = g_assembly_peak.load();
  now.assembled = g_assembly_assembled.load();
  now.refused = g_assembly_refused.load();
  now.abandoned = g_assembly_abandoned.load();
  return now;
}

void WatchPutsOf(void* uct_iface, const void* worker) {
  if (!UcxHardenedForPeers() || worker == nullptr) return;
  // Its puts are seen where WatchHeldReplies stands in front of its sends; one whose
  // sends are not watched leaves its worker's completions unchecked.
  const auto sends = static_cast<uct_iface_h>(uct_iface)->ops.ep_am_bcopy;
  if (sends == nullptr) return;  // no active messages: no put goes through it
  if (std::none_of(kOpsStandIns.begin(), kOpsStandIns.end(),
                   [sends](const UctOps& ops) { return ops.am_bcopy == sends; })) {
    absl::MutexLock lock(&g_puts_mu);
    (*g_puts_in_flight)[worker].unchecked = true;
    return;
  }
  absl::MutexLock lock(&g_puts_mu);
  (*g_iface_worker)[uct_iface] = worker;
  g_puts_in_flight->try_emplace(worker, PutsInFlight{});
}

void ForgetPutsOf(const void* worker) {
  absl::MutexLock lock(&g_puts_mu);
  g_puts_in_flight->erase(worker);
  for (auto it = g_iface_worker->begin(); it != g_iface_worker->end();) {
    auto here = it++;
    if (here->second == worker) g_iface_worker->erase(here);
  }
}

uint64_t PutCompletionsRefused() {
  return g_completions_refused.load(std::memory_order_relaxed);
}

HeldReplies HeldRepliesNow() {
  HeldReplies now;
  now.cap = g_held_cap.load();
  now.refused = g_held_refused.load(std::memory_order_relaxed);
  absl::MutexLock lock(&g_held_mu);
  now.held = g_held_total;
  now.peak = g_held_peak;
  for (const auto& [ep, queue] : *g_held) {
    now.most = std::max<uint64_t>(now.most, queue.size());
  }
  return now;
}

namespace {
// An endpoint UCP created: its worker, what UCP made it for, its configuration's index
// once UCP found one for its lanes (-1 before), its peer's endpoint id once a wireup
// message gave it (0 before), and whether it holds a place of its worker's peer-made
// endpoints (made for a peer's message and not adopted by the agent).
struct Followed {
  const void* worker = nullptr;
  MadeFor made_for = MadeFor::kAgent;
  int configuration = -1;
  uint64_t peer = 0;
  bool counted = false;
  uint64_t serial = 0;  // EndpointSerial
  // The same-host process its lanes reach (0: none proven), that process's start time
  // (0: unknown), and whether UCP is to destroy it when it is closed (ReclaimEndpoint).
  int reach_pid = 0;
  uint64_t reach_ticks = 0;
  bool reclaim = false;
};
absl::Mutex g_endpoints_mu;
absl::flat_hash_map<const void*, Followed>* g_endpoints ABSL_GUARDED_BY(g_endpoints_mu) =
    new absl::flat_hash_map<const void*, Followed>();
// Each worker's endpoints made for peers' messages, held now (PeerEndpointAdmitted).
absl::flat_hash_map<const void*, uint64_t>* g_peer_made ABSL_GUARDED_BY(g_endpoints_mu) =
    new absl::flat_hash_map<const void*, uint64_t>();
uint64_t g_peer_made_total ABSL_GUARDED_BY(g_endpoints_mu) = 0;
uint64_t g_peer_made_peak ABSL_GUARDED_BY(g_endpoints_mu) = 0;
std::atomic<uint64_t> g_peer_made_refused{0};
uint64_t g_last_serial ABSL_GUARDED_BY(g_endpoints_mu) = 0;
std::atomic<uint64_t> g_replies_to_gone{0};
// Endpoints to same-host processes that ended, destroyed by UCP (ReclaimEndpoint).
std::atomic<uint64_t> g_reclaimed{0};

// Gives up `followed`'s place among its worker's peer-made endpoints, if it holds one.
void ReleasePlace(Followed& followed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_endpoints_mu) {
  if (!followed.counted) return;
  followed.counted = false;
  --g_peer_made_total;
  auto it = g_peer_made->find(followed.worker);
  if (it != g_peer_made->end() && --it->second == 0) g_peer_made->erase(it);
}

// Counts and logs a peer's request or check that `worker` has no room for.
void CountPeerEndpointRefused(MadeFor made_for, uint64_t uuid, uint64_t held) {
  g_peer_made_refused.fetch_add(1, std::memory_order_relaxed);
  uint64_t mine = 0;
  if (!CountDropped(kWireupIndex, &mine)) return;
  kLog.Warn("UCX: refused a peer's wireup {} from worker {:#x} ({} so far): this worker holds "
            "{} endpoints UCX made for peers' requests and checks, the most it keeps "
            "(--ucx-peer-endpoints); UCX answers nothing. Each peer agent connected to this "
            "one holds one: raise the flag if more connect, or stop the sender",
            made_for == MadeFor::kRequest ? "request" : "endpoint check", uuid, mine, held);
}
// The endpoint whose lanes UCP sets up on this thread now, and the last one whose new
// configuration was refused here (its failure is not UCP's to carry out).
thread_local const void* t_lanes_for = nullptr;
thread_local const void* t_refused_for = nullptr;

void CountWireupRefused(const std::string& why) {
  uint64_t mine = 0;
  if (!CountDropped(kWireupIndex, &mine)) return;
  kLog.Warn("UCX: refused a peer's wireup message ({} so far): {}", mine, why);
}

// The endpoints made for peers' messages that `worker` holds now.
uint64_t PeerMadeBy(const void* worker) {
  absl::MutexLock lock(&g_endpoints_mu);
  auto it = g_peer_made->find(worker);
  return it == g_peer_made->end() ? 0 : it->second;
}

// True while `worker` holds fewer than the cap of peer-made endpoints; else false, the
// refusal of a message from worker `uuid` that would make one counted and logged.
bool AdmitPeerEndpoint(const void* worker, MadeFor made_for, uint64_t uuid) {
  const uint64_t held = PeerMadeBy(worker);
  if (held < g_peer_made_cap.load()) return true;
  CountPeerEndpointRefused(made_for, uuid, held);
  return false;
}
}  // namespace

void NoteEndpointCreated(const void* worker, const void* ep, MadeFor made_for) {
  if (!UcxHardenedForPeers()) return;
  // Made while a wireup message is handled (for a request, or to answer an endpoint
  // check), it takes the message's sender as its peer.
  const uint64_t peer = t_wireup != nullptr ? t_wireup->sender : 0;
  absl::MutexLock lock(&g_endpoints_mu);
  Followed& followed = (*g_endpoints)[ep];
  ReleasePlace(followed);  // an address UCP reuses: the old endpoint was not forgotten
  followed = Followed{};
  followed.worker = worker;
  followed.made_for = made_for;
  followed.peer = peer;
  followed.counted = made_for != MadeFor::kAgent;
  followed.serial = ++g_last_serial;
  if (!followed.counted) return;
  ++g_peer_made_total;
  g_peer_made_peak = std::max(g_peer_made_peak, ++(*g_peer_made)[worker]);
}

void SetPeerEndpointCap(uint64_t cap) { g_peer_made_cap.store(std::max<uint64_t>(cap, 1)); }

bool PeerEndpointAdmitted(const void* worker, MadeFor made_for) {
  if (!UcxHardenedForPeers() || made_for == MadeFor::kAgent) return true;
  return AdmitPeerEndpoint(worker, made_for, t_wireup != nullptr ? t_wireup->uuid : 0);
}

void EndpointAdopted(const void* ep) {
  if (ep == nullptr) return;
  absl::MutexLock lock(&g_endpoints_mu);
  if (auto it = g_endpoints->find(ep); it != g_endpoints->end()) ReleasePlace(it->second);
}

PeerEndpoints PeerEndpointsNow() {
  PeerEndpoints now;
  now.cap = g_peer_made_cap.load();
  now.refused = g_peer_made_refused.load(std::memory_order_relaxed);
  absl::MutexLock lock(&g_endpoints_mu);
  now.live = g_peer_made_total;
  now.peak = g_peer_made_peak;
  now.all = g_endpoints->size();
  for (const auto& [worker, held] : *g_peer_made) now.most = std::max(now.most, held);
  return now;
}

void EndpointMatched(const void* ep) {
  if (t_wireup == nullptr || t_wireup->type != kWireupRequest || ep == nullptr) return;
  absl::MutexLock lock(&g_endpoints_mu);
  if (auto it = g_endpoints->find(ep); it != g_endpoints->end()) {
    it->second.peer = t_wireup->sender;
  }
}

void ReplyNames(const void* ep) {
  WireupInFlight* in = t_wireup;
  if (in == nullptr || in->type != kWireupReply || in->copy == nullptr) return;
  uint64_t had = 0;
  {
    absl::MutexLock lock(&g_endpoints_mu);
    auto it = g_endpoints->find(ep);
    if (it == g_endpoints->end()) return;
    had = it->second.peer;
    if (had == 0) it->second.peer = in->sender;
  }
  if (had == 0 || had == in->sender) return;
  std::memcpy(in->copy + kWireupSenderAt, &had, 8);
  CountWireupRefused(fmt::format(
      "a reply naming endpoint id {:#x} as its sender, for an endpoint whose peer is {:#x} "
      "already; UCP takes it as a repeat of that peer's answer (UCX 1.13 aborts on it)",
      in->sender, had));
  in->sender = had;
}

LanesSetUp::LanesSetUp(const void* ep) : was_(t_lanes_for) {
  t_lanes_for = ep;
  if (t_refused_for == ep) t_refused_for = nullptr;
}
LanesSetUp::~LanesSetUp() { t_lanes_for = was_; }

bool ConfigurationFound(unsigned index) {
  const void* ep = t_lanes_for;  // set only for endpoints followed (hardened)
  if (ep == nullptr) return true;  // not an endpoint's lanes (UCP's other uses)
  int had = -1;
  {
    absl::MutexLock lock(&g_endpoints_mu);
    auto it = g_endpoints->find(ep);
    if (it == g_endpoints->end()) return true;
    had = it->second.configuration;
    if (had < 0) it->second.configuration = static_cast<int>(index);
  }
  if (had < 0 || had == static_cast<int>(index)) return true;
  t_refused_for = ep;
  CountWireupRefused(fmt::format(
      "a request whose address gives the endpoint it matches lanes of another configuration "
      "({} for {}); the endpoint keeps its own and the request goes unanswered (UCX 1.13 "
      "stops the process on it)",
      index, had));
  return false;
}

EndpointFailure EndpointFailing(const void* ep, const void** worker) {
  if (t_refused_for == ep) {
    t_refused_for = nullptr;
    return EndpointFailure::kKeep;
  }
  {
    absl::MutexLock lock(&g_endpoints_mu);
    auto it = g_endpoints->find(ep);
    if (it == g_endpoints->end() || it->second.made_for != MadeFor::kRequest ||
        it->second.configuration >= 0) {
      return EndpointFailure::kFail;
    }
    *worker = it->second.worker;
  }
  CountWireupRefused(
      "a request whose address lists no transport this agent reaches; the endpoint UCX made "
      "for it is removed (UCX 1.13 stops the process on failing it)");
  return EndpointFailure::kRemove;
}

void ForgetEndpoint(const void* ep) {
  absl::MutexLock lock(&g_endpoints_mu);
  auto it = g_endpoints->find(ep);
  if (it == g_endpoints->end()) return;
  ReleasePlace(it->second);
  if (it->second.reclaim) g_reclaimed.fetch_add(1, std::memory_order_relaxed);
  g_endpoints->erase(it);
}

size_t EndpointsFollowed() {
  absl::MutexLock lock(&g_endpoints_mu);
  return g_endpoints->size();
}

uint64_t EndpointSerial(const void* ep) {
  absl::MutexLock lock(&g_endpoints_mu);
  auto it = g_endpoints->find(ep);
  return it == g_endpoints->end() ? 0 : it->second.serial;
}

bool EndpointStillIs(const void* ep, uint64_t serial) {
  if (serial == 0) return true;
  absl::MutexLock lock(&g_endpoints_mu);
  auto it = g_endpoints->find(ep);
  return it != g_endpoints->end() && it->second.serial == serial;
}

void NoteReplyToGoneEndpoint() { g_replies_to_gone.fetch_add(1, std::memory_order_relaxed); }

uint64_t RepliesToGoneEndpoints() { return g_replies_to_gone.load(std::memory_order_relaxed); }
namespace {
// Whether the process `pid` that started at `ticks` (0: unknown) has ended: no such
// process, another one under its pid, or one that ended and waits to be reaped.
bool ProcessEnded(int pid, uint64_t ticks) {
  char state = 0;
  const uint64_t now = ProcessStartTicks(pid, &state);
  if (now == 0) return true;
  if (ticks != 0 && now != ticks) return true;
  return state == 'Z' || state == 'X';
}

void NoteSameHostReach(int pid) {
  const void* ep = t_lanes_for;
  if (ep == nullptr || pid <= 0) return;
  const uint64_t ticks = ProcessStartTicks(pid);  // without the lock
  absl::MutexLock lock(&g_endpoints_mu);
  auto it = g_endpoints->find(ep);
  // The first process reached: an honest peer's lanes all reach its own.
  if (it == g_endpoints->end() || it->second.reach_pid != 0) return;
  it->second.reach_pid = pid;
  it->second.reach_ticks = ticks;
}
}  // namespace

PeerProcess EndpointPeerProcess(const void* ep) {
  int pid = 0;
  uint64_t ticks = 0;
  {
    absl::MutexLock lock(&g_endpoints_mu);
    auto it = g_endpoints->find(ep);
    // Without its peer's endpoint id UCP has no connection from the peer on it, and
    // destroys it when it is closed.
    if (it == g_endpoints->end() || it->second.reach_pid == 0 || it->second.peer == 0) {
      return PeerProcess::kNone;
    }
    pid = it->second.reach_pid;
    ticks = it->second.reach_ticks;
  }
  return ProcessEnded(pid, ticks) ? PeerProcess::kEnded : PeerProcess::kRunning;
}

std::vector<const void*> PeerMadeOfEndedProcesses(const void* worker) {
  struct Reach {
    const void* ep;
    int pid;
    uint64_t ticks;
  };
  std::vector<Reach> reaches;
  {
    absl::MutexLock lock(&g_endpoints_mu);
    if (g_peer_made->find(worker) == g_peer_made->end()) return {};
    for (const auto& [ep, followed] : *g_endpoints) {
      // Made for a request (one made to answer a check, UCP closes itself).
      if (followed.worker != worker || !followed.counted ||
          followed.made_for != MadeFor::kRequest || followed.reach_pid == 0 || followed.reclaim) {
        continue;
      }
      reaches.push_back({ep, followed.reach_pid, followed.reach_ticks});
    }
  }
  std::vector<const void*> ended;
  std::map<int, bool> looked;  // one look at /proc per process
  for (const Reach& reach : reaches) {
    auto [it, added] = looked.emplace(reach.pid, false);
    if (added) it->second = ProcessEnded(reach.pid, reach.ticks);
    if (it->second) ended.push_back(reach.ep);
  }
  return ended;
}

void ReclaimEndpoint(const void* ep) {
  absl::MutexLock lock(&g_endpoints_mu);
  if (auto it = g_endpoints->find(ep); it != g_endpoints->end()) it->second.reclaim = true;
}

bool ReclaimedOnDisconnect(const void* ep) {
  absl::MutexLock lock(&g_endpoints_mu);
  auto it = g_endpoints->find(ep);
  return it != g_endpoints->end() && it->second.reclaim;
}

uint64_t EndpointsReclaimed() { return g_reclaimed.load(std::memory_order_relaxed); }

}  // namespace kvagent::transport
