// LocalDoor is the agent's side of local sessions (the session socket): it opens a
// session per attached process, identified by the kernel, gives it a token for its
// gRPC calls, keeps the memory the session shared or had allocated (descriptors of
// host memory and of CUDA VMM allocations),
// hands same-host peer agents the descriptors of exported memory, and tells the
// agent when a session ends so that its regions are released. Used by the Agent.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "agent/access.h"
#include "agent/fast_path.h"
#include "agent/limits.h"
#include "agent/session_server.h"
#include "registry/device_memory_object.h"
#include "registry/memory_object.h"
#include "registry/region_registry.h"

namespace kvagent::agent {

struct LocalDoorOptions {
  AccessPolicy policy;
  std::string agent_name;
  uint64_t incarnation = 0;
  uint64_t max_allocation_bytes = 1ull << 40;
  // allocated_bytes and allocated_bytes_per_owner; null: unbounded (tests).
  const Limits* limits = nullptr;
  // Opens and closes sessions' fast path rings; null: open_fast_path is refused.
  FastPathServer* fast_path = nullptr;
};

// AllocateMemory bytes held, in all and per principal: an allocation counts from the
// call until the agent lets go of its memfd (FreeMemory or the session's end, and no
// region maps it any more).
class AllocationLedger {
 public:
  // Counts `bytes` for `owner` if they fit `limits` (may be null), else
  // RESOURCE_EXHAUSTED naming the limit.
  absl::Status Take(const Limits* limits, const std::string& owner, uint64_t bytes,
                    std::string_view what);
  void Give(const std::string& owner, uint64_t bytes);
  uint64_t total() const;
  uint64_t largest_owner() const;  // the most one owner holds

 private:
  mutable absl::Mutex mu_;
  uint64_t total_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, uint64_t> by_owner_ ABSL_GUARDED_BY(mu_);
};

class LocalDoor final : public SessionHandler {
 public:
  // Runs on the session server's thread after a session ended, outside LocalDoor's lock.
  using SessionEnded = std::function<void(const Caller& caller)>;

  LocalDoor(LocalDoorOptions options, const registry::RegionRegistry* registry,
            SecurityCounters* counters, SessionEnded on_end);

  // The session behind a gRPC call's token; UNAUTHENTICATED when there is none.
  absl::StatusOr<Caller> FindToken(std::string_view token) const;
  // A memory handle of `session_id` (RegisterRegions: SharedMemorySource.memory_handle).
  // NOT_FOUND for an unknown handle; INVALID_ARGUMENT for one of device memory.
  absl::StatusOr<std::shared_ptr<const registry::MemoryObject>> ResolveHandle(
      uint64_t session_id, uint64_t handle) const;
  // A device memory handle of `session_id` (RegisterRegions: CudaVmmSource.memory_handle).
  // NOT_FOUND for an unknown handle; INVALID_ARGUMENT for one of host memory.
  absl::StatusOr<std::shared_ptr<const registry::DeviceMemoryObject>> ResolveDeviceHandle(
      uint64_t session_id, uint64_t handle) const;
  size_t sessions() const;
  // True when `principal` is a local session's (AccessPolicy::LocalCaller's
  // "session:N uid:U pid:P") and that session is no longer open; false for an open one
  // and for other doors' principals. The registry asks it before committing a
  // registration (RegionRegistry::SetOwnerCheck): a session is closed here before the
  // agent is told it ended, so a registration racing the end either commits first
  // (and the end takes it) or fails.
  bool Ended(const std::string& principal) const;
  // AllocateMemory bytes held now (AllocationLedger).
  uint64_t allocated_bytes() const { return allocations_->total(); }
  uint64_t largest_allocation_owner() const { return allocations_->largest_owner(); }
  // Memory handles held, all sessions, and by the session holding most (status).
  uint64_t memory_handles() const;
  uint64_t largest_session_handles() const;

  absl::StatusOr<v1::SessionWelcome> OnHello(uint64_t session_id,
                                             const PeerCredentials& credentials,
                                             const v1::SessionHello& hello) override;
  void OnRequest(uint64_t session_id, const v1::SessionRequest& request,
                 std::vector<UniqueFd> fds, v1::SessionReply* reply,
                 std::vector<UniqueFd>* reply_fds) override;
  void OnClose(uint64_t session_id) override;

 private:
  struct Session {
    Caller caller;
    std::string token;
    std::string client_name;
    absl::flat_hash_map<uint64_t, std::shared_ptr<const registry::MemoryObject>> memory;
    // ShareDeviceMemory's; numbered with `memory` (a handle names one or the other).
    absl::flat_hash_map<uint64_t, std::shared_ptr<const registry::DeviceMemoryObject>>
        device_memory;
    uint64_t next_handle = 1;
  };
  absl::Status Share(uint64_t session_id, const v1::ShareMemoryRequest& request,
                     std::vector<UniqueFd> fds, v1::SessionReply* reply);
  absl::Status ShareDevice(uint64_t session_id, const v1::ShareDeviceMemoryRequest& request,
                           std::vector<UniqueFd> fds, v1::SessionReply* reply);
  absl::Status Allocate(uint64_t session_id, const v1::AllocateMemoryRequest& request,
                        v1::SessionReply* reply, std::vector<UniqueFd>* reply_fds);
  absl::Status Free(uint64_t session_id, const v1::FreeMemoryRequest& request);
  absl::Status OpenFastPath(uint64_t session_id, const v1::OpenFastPathRequest& request,
                            v1::SessionReply* reply, std::vector<UniqueFd>* reply_fds);
  // close_fast_path: the session's ring closes, the session stays.
  absl::Status CloseFastPath(uint64_t session_id, v1::SessionReply* reply);
  absl::Status PeerMemory(uint64_t session_id, const v1::PeerMemoryRequest& request,
                          v1::SessionReply* reply, std::vector<UniqueFd>* reply_fds);
  // Records `object` as a new handle of the session; fills `reply`.
  absl::Status Keep(uint64_t session_id, std::shared_ptr<const registry::MemoryObject> object,
                    v1::SessionReply* reply);
  absl::Status Keep(uint64_t session_id,
                    std::shared_ptr<const registry::DeviceMemoryObject> object,
                    v1::SessionReply* reply);
  absl::StatusOr<Caller> CallerOf(uint64_t session_id) const;
  // The open session `session_id`, else UNAUTHENTICATED ("session N is not open").
  absl::StatusOr<const Session*> SessionLocked(uint64_t session_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Session*> SessionLocked(uint64_t session_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK when `session` may hold one more memory handle (counted in handles_ once kept).
  absl::Status AdmitHandleLocked(uint64_t session_id, const Session& session,
                                 std::string_view what) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const LocalDoorOptions options_;
  const registry::RegionRegistry* registry_;
  SecurityCounters* counters_;
  SessionEnded on_end_;
  // Shared with every allocated object, which gives its bytes back when it goes.
  std::shared_ptr<AllocationLedger> allocations_ = std::make_shared<AllocationLedger>();
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Session> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint64_t> by_token_ ABSL_GUARDED_BY(mu_);
  // Principals of the open sessions (each names its session id, so one per session).
  absl::flat_hash_set<std::string> open_principals_ ABSL_GUARDED_BY(mu_);
  // Memory handles held by all sessions (each holds one descriptor); limits
  // memory_handles and memory_handles_per_session.
  uint64_t handles_ ABSL_GUARDED_BY(mu_) = 0;
};

// The gRPC metadata key that carries a local session's token.
inline constexpr char kSessionTokenKey[] = "kvagent-session";

}  // namespace kvagent::agent
