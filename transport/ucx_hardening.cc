#include "transport/ucx_hardening.h"

#include <dlfcn.h>
#include <link.h>
#include <sys/mman.h>
#include <ucp/api/ucp.h>
#include <uct/api/uct.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
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

// The protocols whose receive side is changed. `checked`: UCP's software RMA, which
// kvagent's own ucx data path uses where UCX emulates puts and gets (same-host agents
// without shm-direct, in UCX 1.13): each message is served only when the range it
// names lies inside memory registered for peers (PeerAccess::kPeers), as native RMA
// with that memory's key would reach; else dropped. The others kvagent
// never uses: every message is dropped. `features`: what the library declares for it
// (checked, so a table whose meaning changed is not patched).
struct Protocol {
  const char* symbol;  // ucp_am_handler_UCP_AM_ID_<symbol>
  const char* name;
  uint64_t features;
  bool checked;
};
constexpr std::array<Protocol, 5> kProtocols = {{
    {"PUT", "put (software RMA)", UCP_FEATURE_RMA, true},
    {"GET_REQ", "get request (software RMA)", UCP_FEATURE_RMA, true},
    {"ATOMIC_REQ", "atomic request", UCP_FEATURE_AMO32 | UCP_FEATURE_AMO64, false},
    {"ATOMIC_REP", "atomic reply", UCP_FEATURE_AMO32 | UCP_FEATURE_AMO64, false},
    {"STREAM_DATA", "stream data", UCP_FEATURE_STREAM, false},
}};
constexpr size_t kPut = 0;  // the other checked one is the get request

// The headers of the two checked protocols (UCX 1.13's ucp_put_hdr_t and
// ucp_get_req_hdr_t, packed): the address first, a get request's length second, the
// memory type (a 4-byte ucs_memory_type_t) last.
constexpr size_t kPutHeaderBytes = 8 + 8 + 4;           // address, ep id, memory type
constexpr size_t kGetRequestBytes = 8 + 8 + 8 + 8 + 4;  // address, length, request, type

// The originals of the checked protocols, called for what passes.
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

// Counts one dropped message of protocol `k`; logs the first few and then every
// 1,024th (a flood does not flood the log). `bytes` of `memory_type` at `address`:
// what a checked one named (ignored for the others); `short_header`: a checked one too
// short to name anything.
void CountRefused(size_t k, size_t length, uint64_t address = 0, uint64_t bytes = 0,
                  uint32_t memory_type = 0, bool short_header = false) {
  const uint64_t mine = g_refused[k].fetch_add(1, std::memory_order_relaxed) + 1;
  g_refused_total.fetch_add(1, std::memory_order_relaxed);
  if (mine > 4 && mine % 1024 != 0) return;
  if (short_header) {
    kLog.Warn("UCX: dropped a peer's {} message of {} bytes ({} so far): too short for its "
              "header, so the sender is not UCX 1.13 or is hostile",
              kProtocols[k].name, length, mine);
  } else if (kProtocols[k].checked) {
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

// Serves one message of checked protocol K that Admit lets through, with UCP's own
// handler or (`kProxy`) its counting proxy, under the reader lock: a put is copied in
// before ForbidPeerRange can return (a get's reply may outlive it: RetireMapping).
template <size_t K, bool kProxy>
ucs_status_t Checked(void* arg, void* data, size_t length, unsigned flags) {
  absl::ReaderMutexLock lock(&g_ranges_mu);
  if (!Admit<K>(data, length)) return UCS_OK;
  return (kProxy ? g_original_proxy[K] : g_original_cb[K])(arg, data, length, flags);
}

// What replaces protocol K's handler (or its proxy): Checked for the checked ones,
// Refuse for the others.
template <size_t K, bool kProxy>
constexpr uct_am_callback_t ReplacementOf() {
  if constexpr (kProtocols[K].checked) {
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
  std::array<UcpAmHandler*, kProtocols.size()> handlers{};
  absl::Status result = absl::OkStatus();
  for (size_t k = 0; k < kProtocols.size() && result.ok(); ++k) {
    const Protocol& p = kProtocols[k];
    const std::string symbol = fmt::format("ucp_am_handler_UCP_AM_ID_{}", p.symbol);
    auto* handler = static_cast<UcpAmHandler*>(dlsym(RTLD_DEFAULT, symbol.c_str()));
    bool in_table = false;
    for (size_t i = 0; i < table_size && handler != nullptr; ++i) in_table |= table[i] == handler;
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
    handlers[k]->features |= UCP_FEATURE_RMA | UCP_FEATURE_AM;
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
      g_hardened.store(true);
      kLog.Info(
          "UCX: peers' software RMA reaches only memory registered for them; their "
          "atomic and stream messages are dropped, and tagged ones discarded");
    }
  });
  return outcome;
}

bool UcxHardenedForPeers() { return g_hardened.load(); }

std::vector<std::string> UcxRefusedProtocols() {
  std::vector<std::string> names;
  if (!UcxHardenedForPeers()) return names;
  for (const Protocol& p : kProtocols) {
    names.push_back(p.checked ? fmt::format("{} outside peer memory", p.name) : p.name);
  }
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

}  // namespace kvagent::transport
