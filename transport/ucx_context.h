// UcxContext owns the process's ucp_context and says what the running UCX can do
// (version, transports, memory types). MemoryRegistration is one ucp_mem_map'ed
// range with its packed rkey. Used by registry/ (registration) and agent/ (status).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "ucp/api/ucp.h"

namespace kvagent::transport {

enum class MemoryType { kHost, kCuda };

std::string_view MemoryTypeName(MemoryType type);

// "ucx status <name>: <ucs_status_string>" for messages (also declared in ucx_worker.h).
std::string UcsStatusText(ucs_status_t status);

// What the running UCX library offers; all of it comes from UCX itself at run time.
struct UcxCapabilities {
  std::string version;                  // ucp_get_version_string(), e.g. "1.13.1"
  std::vector<std::string> transports;  // transport names, e.g. {"self","tcp","posix","sysv","cma"}
  std::vector<std::string> memory_types;// ucs memory type names UCX supports, e.g. {"host"}
  bool cuda_memory = false;             // UCX can register/transfer CUDA memory
};

// Requests UCX took and has not completed yet (sends, flushes, rendezvous receives),
// in this process, over every worker. One with a peer that died or stopped may never
// complete (without peer error handling UCX neither finishes nor cancels it), and
// UCX 1.13 aborts in ucp_cleanup on the memory such a request still holds ("rcache.c:
// Assertion `region->refcount == 0'"): ~UcxContext skips ucp_cleanup while any is
// left (the process is exiting; the kernel takes the rest back).
std::atomic<int64_t>& RequestsInFlight();

class UcxContext {
 public:
  // Features: RMA, AM, WAKEUP (and TAG once hardened); mt_workers_shared so memory can
  // be mapped from any thread while a worker progresses on its own thread.
  static absl::StatusOr<std::unique_ptr<UcxContext>> Create();
  ~UcxContext();
  UcxContext(const UcxContext&) = delete;
  UcxContext& operator=(const UcxContext&) = delete;

  ucp_context_h get() const { return context_; }
  const UcxCapabilities& capabilities() const { return capabilities_; }
  // True when created after HardenUcxForPeers (transport/ucx_hardening.h): the context
  // has UCP_FEATURE_TAG, and each worker discards every tagged message.
  bool takes_tags() const { return takes_tags_; }

 private:
  explicit UcxContext(ucp_context_h context) : context_(context) {}
  ucp_context_h context_;
  bool takes_tags_ = false;
  UcxCapabilities capabilities_;
};

// Who may reach a registered range by RMA. kPeers: memory whose key goes to peers (the
// registry's regions); in a hardened process (ucx_hardening.h) UCX's software RMA is
// served only inside such ranges. kLocal: this agent's own buffers, whose key never
// leaves it.
enum class PeerAccess { kLocal, kPeers };

// One registered range. Move-only; unmaps on destruction. Thread-safe to create and
// destroy from any thread (the context is created with mt_workers_shared).
class MemoryRegistration {
 public:
  // ucp_mem_map of [address, address+length) declared as `type`, then ucp_mem_query
  // to confirm UCX sees that memory type. `entry` names the caller's region in every
  // error message. Errors keep UCX's own status string:
  //  FAILED_PRECONDITION when UCX lacks the memory type or the locked-memory limit
  //  is too low; INVALID_ARGUMENT for null/zero; INTERNAL otherwise.
  static absl::StatusOr<MemoryRegistration> Map(const UcxContext& context, void* address,
                                                uint64_t length, MemoryType type,
                                                std::string_view entry,
                                                PeerAccess access = PeerAccess::kLocal);
  MemoryRegistration() = default;
  MemoryRegistration(MemoryRegistration&& other) noexcept;
  MemoryRegistration& operator=(MemoryRegistration&& other) noexcept;
  MemoryRegistration(const MemoryRegistration&) = delete;
  MemoryRegistration& operator=(const MemoryRegistration&) = delete;
  ~MemoryRegistration();

  void* address() const { return address_; }
  uint64_t length() const { return length_; }
  MemoryType type() const { return type_; }
  ucp_mem_h handle() const { return memh_; }
  // ucp_rkey_pack output; what peers unpack with Endpoint::UnpackRkey.
  const std::string& packed_rkey() const { return packed_rkey_; }

 private:
  void Reset();
  ucp_context_h context_ = nullptr;
  ucp_mem_h memh_ = nullptr;
  void* address_ = nullptr;
  uint64_t length_ = 0;
  MemoryType type_ = MemoryType::kHost;
  PeerAccess access_ = PeerAccess::kLocal;
  std::string packed_rkey_;
};

}  // namespace kvagent::transport
