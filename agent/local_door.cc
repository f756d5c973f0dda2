#include "agent/local_door.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "agent/peer_secrets.h"
#include "base/format.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "fmt/format.h"

namespace kvagent::agent {
namespace {
constexpr log::Logger kLog("session");
constexpr size_t kMaxClientNameBytes = 128;
constexpr int kMaxPeerMemoryIds = 64;

void SetError(v1::SessionReply* reply, const absl::Status& status) {
  reply->set_error_code(static_cast<int32_t>(status.code()));
  reply->set_error_message(std::string(status.message()));
}

absl::StatusOr<UniqueFd> Dup(int fd) {
  int copy = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (copy < 0) {
    return absl::ResourceExhaustedError(fmt::format(
        "cannot duplicate a descriptor to send ({}); raise the agent's open-file limit "
        "(LimitNOFILE)",
        std::strerror(errno)));
  }
  return UniqueFd(copy);
}
}  // namespace

LocalDoor::LocalDoor(LocalDoorOptions options, const registry::RegionRegistry* registry,
                     SecurityCounters* counters, SessionEnded on_end)
    : options_(std::move(options)),
      registry_(registry),
      counters_(counters),
      on_end_(std::move(on_end)) {}

absl::StatusOr<v1::SessionWelcome> LocalDoor::OnHello(uint64_t session_id,
                                                      const PeerCredentials& credentials,
                                                      const v1::SessionHello& hello) {
  if (hello.protocol() > 1) {
    return absl::FailedPreconditionError(fmt::format(
        "session protocol {} is newer than this agent's (1); use a client of this agent's "
        "version",
        hello.protocol()));
  }
  if (hello.client_name().size() > kMaxClientNameBytes) {
    return absl::InvalidArgumentError(fmt::format(
        "client_name is {} bytes, over {}; give a short label (the engine or tool name)",
        hello.client_name().size(), kMaxClientNameBytes));
  }
  Caller caller = options_.policy.LocalCaller(session_id, credentials.uid, credentials.pid,
                                              hello.client_name());
  if (!caller.engine && !caller.scheduler && !caller.peer) {
    counters_->refused_calls.fetch_add(1);
    kLog.Warn("refused session of uid {} pid {} ('{}'): no role for this uid", credentials.uid,
              credentials.pid, Printable(hello.client_name()));
    return absl::PermissionDeniedError(fmt::format(
        "uid {} has no role on agent '{}'; the operator grants local uids roles with "
        "--engine-uids, --scheduler-uids and --peer-uids",
        credentials.uid, options_.agent_name));
  }
  const std::string token = absl::BytesToHexString(RandomBytes(16));
  v1::SessionWelcome welcome;
  welcome.set_agent(options_.agent_name);
  welcome.set_incarnation(options_.incarnation);
  welcome.set_session_id(session_id);
  welcome.set_token(token);
  welcome.set_uid(credentials.uid);
  welcome.set_gid(credentials.gid);
  welcome.set_pid(static_cast<uint32_t>(credentials.pid));
  welcome.set_principal(caller.principal);
  for (const auto& role : caller.Roles()) welcome.add_roles(role);
  absl::MutexLock lock(&mu_);
  Session& session = sessions_[session_id];
  open_principals_.insert(caller.principal);
  session.caller = std::move(caller);
  session.token = token;
  session.client_name = hello.client_name();
  by_token_[token] = session_id;
  return welcome;
}

void LocalDoor::OnRequest(uint64_t session_id, const v1::SessionRequest& request,
                          std::vector<UniqueFd> fds, v1::SessionReply* reply,
                          std::vector<UniqueFd>* reply_fds) {
  absl::Status status;
  switch (request.body_case()) {
    case v1::SessionRequest::kShare:
      status = Share(session_id, request.share(), std::move(fds), reply);
      break;
    case v1::SessionRequest::kShareDevice:
      status = ShareDevice(session_id, request.share_device(), std::move(fds), reply);
      break;
    case v1::SessionRequest::kAllocate:
      status = Allocate(session_id, request.allocate(), reply, reply_fds);
      break;
    case v1::SessionRequest::kFree:
      status = Free(session_id, request.free());
      break;
    case v1::SessionRequest::kPeerMemory:
      status = PeerMemory(session_id, request.peer_memory(), reply, reply_fds);
      break;
    case v1::SessionRequest::kOpenFastPath:
      status = OpenFastPath(session_id, request.open_fast_path(), reply, reply_fds);
      break;
    case v1::SessionRequest::kCloseFastPath:
      status = CloseFastPath(session_id, reply);
      break;
    default:
      status = absl::InvalidArgumentError(fmt::format(
          "session request has no known body (field {}); this agent takes share, "
          "share_device, allocate, free, peer_memory, open_fast_path and close_fast_path",
          static_cast<int>(request.body_case())));
  }
  if (!status.ok()) {
    reply_fds->clear();
    reply->clear_body();
    SetError(reply, status);
  }
}

absl::StatusOr<const LocalDoor::Session*> LocalDoor::SessionLocked(uint64_t session_id) const {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return absl::UnauthenticatedError(fmt::format("session {} is not open", session_id));
  }
  return &it->second;
}

absl::StatusOr<LocalDoor::Session*> LocalDoor::SessionLocked(uint64_t session_id) {
  ASSIGN_OR_RETURN(const Session* session,
                   static_cast<const LocalDoor*>(this)->SessionLocked(session_id));
  return const_cast<Session*>(session);
}

absl::Status LocalDoor::OpenFastPath(uint64_t session_id, const v1::OpenFastPathRequest& request,
                                     v1::SessionReply* reply, std::vector<UniqueFd>* reply_fds) {
  if (options_.fast_path == nullptr) {
    return absl::UnimplementedError("this agent serves no fast path; submit through gRPC");
  }
  ASSIGN_OR_RETURN(Caller caller, CallerOf(session_id));
  auto info = options_.fast_path->Open(session_id, caller, request, reply_fds);
  if (!info.ok()) {
    if (absl::IsPermissionDenied(info.status())) {
      counters_->refused_calls.fetch_add(1);
      LogRefusal(caller.principal, "open_fast_path", info.status());
    }
    return info.status();
  }
  *reply->mutable_fast_path() = *std::move(info);
  return absl::OkStatus();
}

absl::Status LocalDoor::CloseFastPath(uint64_t session_id, v1::SessionReply* reply) {
  if (options_.fast_path == nullptr) {
    return absl::UnimplementedError(
        "close_fast_path: this agent serves no fast path, so the session has none to close");
  }
  RETURN_IF_ERROR(CallerOf(session_id).status());  // the session is open
  ASSIGN_OR_RETURN(*reply->mutable_fast_path_closed(),
                   options_.fast_path->CloseOnRequest(session_id));
  return absl::OkStatus();
}

absl::StatusOr<Caller> LocalDoor::CallerOf(uint64_t session_id) const {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(const Session* session, SessionLocked(session_id));
  return session->caller;
}

uint64_t LocalDoor::memory_handles() const {
  absl::MutexLock lock(&mu_);
  return handles_;
}

uint64_t LocalDoor::largest_session_handles() const {
  absl::MutexLock lock(&mu_);
  uint64_t most = 0;
  for (const auto& [id, session] : sessions_) {
    most = std::max<uint64_t>(most, session.memory.size() + session.device_memory.size());
  }
  return most;
}

absl::Status LocalDoor::AdmitHandleLocked(uint64_t session_id, const Session& session,
                                          std::string_view what) const {
  if (options_.limits == nullptr) return absl::OkStatus();
  const std::string asking =
      fmt::format("{} for session {} ({})", what, session_id, session.caller.principal);
  constexpr std::string_view kFix =
      "free handles no longer needed (free), and share a pool's descriptor once: its "
      "regions are registered from that one handle";
  RETURN_IF_ERROR(options_.limits->Check(Limit::kMemoryHandlesPerSession, asking,
                                         session.memory.size() + session.device_memory.size(),
                                         1, kFix));
  return options_.limits->Check(Limit::kMemoryHandles, asking, handles_, 1, kFix);
}

absl::Status LocalDoor::Keep(uint64_t session_id,
                             std::shared_ptr<const registry::MemoryObject> object,
                             v1::SessionReply* reply) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Session* session, SessionLocked(session_id));
  RETURN_IF_ERROR(AdmitHandleLocked(session_id, *session,
                                    fmt::format("memory '{}'", Printable(object->label(), 128))));
  ++handles_;
  const uint64_t handle = session->next_handle++;
  v1::MemoryHandleInfo* info = reply->mutable_memory();
  info->set_handle(handle);
  info->set_bytes(object->size());
  info->set_kind(std::string(object->kind()));
  info->set_sealed(object->sealed());
  info->set_label(std::string(object->label()));
  session->memory.emplace(handle, std::move(object));
  return absl::OkStatus();
}

absl::Status LocalDoor::Keep(uint64_t session_id,
                             std::shared_ptr<const registry::DeviceMemoryObject> object,
                             v1::SessionReply* reply) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Session* session, SessionLocked(session_id));
  RETURN_IF_ERROR(AdmitHandleLocked(
      session_id, *session, fmt::format("device memory '{}'", Printable(object->label(), 128))));
  ++handles_;
  const uint64_t handle = session->next_handle++;
  v1::MemoryHandleInfo* info = reply->mutable_memory();
  info->set_handle(handle);
  info->set_bytes(object->bytes());
  info->set_kind(std::string(object->kind()));
  info->set_label(object->label());
  session->device_memory.emplace(handle, std::move(object));
  return absl::OkStatus();
}

absl::Status LocalDoor::Share(uint64_t session_id, const v1::ShareMemoryRequest& request,
                              std::vector<UniqueFd> fds, v1::SessionReply* reply) {
  ASSIGN_OR_RETURN(Caller caller, CallerOf(session_id));
  const std::string label = Printable(request.label(), 128);
  if (!caller.engine) {
    counters_->refused_calls.fetch_add(1);
    return absl::PermissionDeniedError(fmt::format(
        "share '{}': {} is not an engine here, so it cannot register memory; the operator "
        "grants it with --engine-uids",
        label, caller.principal));
  }
  if (fds.size() != 1) {
    return absl::InvalidArgumentError(fmt::format(
        "share '{}': {} descriptors came with the request; attach exactly one (SCM_RIGHTS)",
        label, fds.size()));
  }
  ASSIGN_OR_RETURN(auto object, registry::MemoryObject::FromDescriptor(std::move(fds[0]), label));
  kLog.Info("session {}: shared memory '{}' ({} bytes, {}{})", session_id, label, object->size(),
            object->kind(), object->sealed() ? ", sealed" : "");
  return Keep(session_id, std::move(object), reply);
}

absl::Status LocalDoor::ShareDevice(uint64_t session_id,
                                    const v1::ShareDeviceMemoryRequest& request,
                                    std::vector<UniqueFd> fds, v1::SessionReply* reply) {
  ASSIGN_OR_RETURN(Caller caller, CallerOf(session_id));
  const std::string label = Printable(request.label(), 128);
  if (!caller.engine) {
    counters_->refused_calls.fetch_add(1);
    return absl::PermissionDeniedError(fmt::format(
        "share_device '{}': {} is not an engine here, so it cannot register memory; the "
        "operator grants it with --engine-uids",
        label, caller.principal));
  }
  if (fds.size() != 1) {
    return absl::InvalidArgumentError(fmt::format(
        "share_device '{}': {} descriptors came with the request; attach exactly one, the "
        "POSIX descriptor of cuMemExportToShareableHandle (SCM_RIGHTS)",
        label, fds.size()));
  }
  // What needs no driver is checked here (not host memory, a size, an ordinal); the
  // driver checks the rest when a region imports it.
  ASSIGN_OR_RETURN(auto object,
                   registry::DeviceMemoryObject::FromDescriptor(
                       std::move(fds[0]), request.device(), request.bytes(), request.label()));
  kLog.Info("session {}: shared device memory '{}' ({} bytes on device {}, CUDA VMM)", session_id,
            label, object->bytes(), object->device());
  return Keep(session_id, std::move(object), reply);
}

absl::Status AllocationLedger::Take(const Limits* limits, const std::string& owner,
                                    uint64_t bytes, std::string_view what) {
  absl::MutexLock lock(&mu_);
  uint64_t& mine = by_owner_[owner];
  if (limits != nullptr) {
    constexpr std::string_view kFix = "free allocations no longer used (FreeMemory)";
    absl::Status fits = limits->Check(Limit::kAllocatedBytes, what, total_, bytes, kFix);
    if (fits.ok()) fits = limits->Check(Limit::kAllocatedBytesPerOwner, what, mine, bytes, kFix);
    if (!fits.ok()) {
      if (mine == 0) by_owner_.erase(owner);
      return fits;
    }
  }
  mine += bytes;
  total_ += bytes;
  return absl::OkStatus();
}

void AllocationLedger::Give(const std::string& owner, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  total_ -= std::min(total_, bytes);
  auto it = by_owner_.find(owner);
  if (it == by_owner_.end()) return;
  it->second -= std::min(it->second, bytes);
  if (it->second == 0) by_owner_.erase(it);
}

uint64_t AllocationLedger::largest_owner() const {
  absl::MutexLock lock(&mu_);
  uint64_t most = 0;
  for (const auto& [owner, bytes] : by_owner_) most = std::max(most, bytes);
  return most;
}

uint64_t AllocationLedger::total() const {
  absl::MutexLock lock(&mu_);
  return total_;
}

absl::Status LocalDoor::Allocate(uint64_t session_id, const v1::AllocateMemoryRequest& request,
                                 v1::SessionReply* reply, std::vector<UniqueFd>* reply_fds) {
  ASSIGN_OR_RETURN(Caller caller, CallerOf(session_id));
  const std::string label = Printable(request.label(), 128);
  if (!caller.engine) {
    counters_->refused_calls.fetch_add(1);
    return absl::PermissionDeniedError(fmt::format(
        "allocate '{}': {} is not an engine here; the operator grants it with --engine-uids",
        label, caller.principal));
  }
  if (request.bytes() == 0 || request.bytes() > options_.max_allocation_bytes) {
    return absl::InvalidArgumentError(fmt::format(
        "allocate '{}': {} bytes asked; ask for 1 byte to {} bytes", label, request.bytes(),
        options_.max_allocation_bytes));
  }
  RETURN_IF_ERROR(allocations_->Take(options_.limits, caller.principal, request.bytes(),
                                     fmt::format("allocate '{}' ({} bytes) for {}", label,
                                                 request.bytes(), caller.principal)));
  auto created = registry::MemoryObject::CreateMemfd(label, request.bytes());
  if (!created.ok()) {
    allocations_->Give(caller.principal, request.bytes());
    return created.status();
  }
  // The object gives its bytes back to the ledger when its last holder lets go.
  struct Held {
    Held(std::shared_ptr<const registry::MemoryObject> o, std::shared_ptr<AllocationLedger> l,
         std::string w, uint64_t b)
        : object(std::move(o)), ledger(std::move(l)), owner(std::move(w)), bytes(b) {}
    Held(const Held&) = delete;
    Held& operator=(const Held&) = delete;
    ~Held() { ledger->Give(owner, bytes); }
    std::shared_ptr<const registry::MemoryObject> object;
    std::shared_ptr<AllocationLedger> ledger;
    std::string owner;
    uint64_t bytes;
  };
  auto held = std::make_shared<Held>(*std::move(created), allocations_, caller.principal,
                                     request.bytes());
  std::shared_ptr<const registry::MemoryObject> object(held, held->object.get());
  ASSIGN_OR_RETURN(UniqueFd copy, Dup(object->fd()));
  RETURN_IF_ERROR(Keep(session_id, std::move(object), reply));
  reply_fds->push_back(std::move(copy));
  kLog.Info("session {}: allocated '{}' ({} bytes, sealed memfd)", session_id, label,
            request.bytes());
  return absl::OkStatus();
}

absl::Status LocalDoor::Free(uint64_t session_id, const v1::FreeMemoryRequest& request) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Session* session, SessionLocked(session_id));
  if (session->memory.erase(request.handle()) == 0 &&
      session->device_memory.erase(request.handle()) == 0) {
    return absl::NotFoundError(fmt::format(
        "free: memory handle {} is not one of this session's; free only handles that share, "
        "share_device or allocate returned",
        request.handle()));
  }
  --handles_;
  // Regions registered from it keep their own mapping until they are deregistered.
  return absl::OkStatus();
}

absl::Status LocalDoor::PeerMemory(uint64_t session_id, const v1::PeerMemoryRequest& request,
                                   v1::SessionReply* reply, std::vector<UniqueFd>* reply_fds) {
  ASSIGN_OR_RETURN(Caller caller, CallerOf(session_id));
  if (!caller.peer) {
    counters_->refused_calls.fetch_add(1);
    kLog.Warn("refused peer memory to {}: not a peer", caller.principal);
    return absl::PermissionDeniedError(fmt::format(
        "peer_memory: {} is not a peer agent here; same-host agents must run as a uid in "
        "--peer-uids",
        caller.principal));
  }
  if (request.memory_ids_size() + request.device_memory_ids_size() > kMaxPeerMemoryIds) {
    return absl::InvalidArgumentError(fmt::format(
        "peer_memory: {} memory ids and {} device memory ids asked; ask for at most {} in "
        "all per request",
        request.memory_ids_size(), request.device_memory_ids_size(), kMaxPeerMemoryIds));
  }
  v1::PeerMemoryReply* out = reply->mutable_peer_memory();
  for (uint64_t id : request.memory_ids()) {
    auto object = registry_->FindMemory(id);
    if (object == nullptr) {
      return absl::NotFoundError(fmt::format(
          "peer_memory: memory {} is not exported by any registered region (deregistered "
          "meanwhile?); fetch the metadata again",
          id));
    }
    ASSIGN_OR_RETURN(UniqueFd copy, Dup(object->fd()));
    out->add_memory_ids(id);
    out->add_bytes(object->size());
    reply_fds->push_back(std::move(copy));
  }
  // CUDA VMM allocations: only those a registered region was imported from (and so
  // announced to same-host peers by ExportedRegion.cuda_vmm_id).
  for (uint64_t id : request.device_memory_ids()) {
    auto object = registry_->FindDeviceMemory(id);
    if (object == nullptr) {
      return absl::NotFoundError(fmt::format(
          "peer_memory: device memory {} is not exported by any registered region "
          "(deregistered meanwhile?); fetch the metadata again",
          id));
    }
    ASSIGN_OR_RETURN(UniqueFd copy, Dup(object->fd()));
    out->add_device_memory_ids(id);
    out->add_device_bytes(object->bytes());
    out->add_devices(object->device());
    reply_fds->push_back(std::move(copy));
  }
  return absl::OkStatus();
}

void LocalDoor::OnClose(uint64_t session_id) {
  Caller caller;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) return;
    caller = it->second.caller;
    by_token_.erase(it->second.token);
    open_principals_.erase(caller.principal);  // before on_end_ (see Ended)
    handles_ -= it->second.memory.size() + it->second.device_memory.size();
    sessions_.erase(it);
  }
  if (options_.fast_path != nullptr) options_.fast_path->Close(session_id);
  if (on_end_) on_end_(caller);
}

absl::StatusOr<Caller> LocalDoor::FindToken(std::string_view token) const {
  absl::MutexLock lock(&mu_);
  auto it = by_token_.find(std::string(token));
  if (it == by_token_.end()) {
    return absl::UnauthenticatedError(
        "no open session has this token (the session ended, or the token is wrong); attach "
        "over the session socket (<local-socket>.session) and send its token as gRPC "
        "metadata 'kvagent-session'");
  }
  return sessions_.at(it->second).caller;
}

absl::StatusOr<std::shared_ptr<const registry::MemoryObject>> LocalDoor::ResolveHandle(
    uint64_t session_id, uint64_t handle) const {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(const Session* session, SessionLocked(session_id));
  auto m = session->memory.find(handle);
  if (m == session->memory.end()) {
    if (session->device_memory.contains(handle)) {
      return absl::InvalidArgumentError(fmt::format(
          "memory handle {} is device memory (share_device), not host memory; name it in "
          "cuda_vmm.memory_handle of a VRAM region",
          handle));
    }
    return absl::NotFoundError(fmt::format(
        "memory handle {} is not one of this session's (handles belong to the session that "
        "shared or allocated them); share the memory first",
        handle));
  }
  return m->second;
}

absl::StatusOr<std::shared_ptr<const registry::DeviceMemoryObject>>
LocalDoor::ResolveDeviceHandle(uint64_t session_id, uint64_t handle) const {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(const Session* session, SessionLocked(session_id));
  auto m = session->device_memory.find(handle);
  if (m == session->device_memory.end()) {
    if (session->memory.contains(handle)) {
      return absl::InvalidArgumentError(fmt::format(
          "memory handle {} is host memory (share or allocate), not device memory; name it "
          "in shm.memory_handle of a DRAM region, and share VRAM with share_device",
          handle));
    }
    return absl::NotFoundError(fmt::format(
        "device memory handle {} is not one of this session's (handles belong to the "
        "session that shared them); share the device memory first (ShareDeviceMemory)",
        handle));
  }
  return m->second;
}

bool LocalDoor::Ended(const std::string& principal) const {
  if (!absl::StartsWith(principal, "session:")) return false;  // not a local session's
  absl::MutexLock lock(&mu_);
  return !open_principals_.contains(principal);
}

size_t LocalDoor::sessions() const {
  absl::MutexLock lock(&mu_);
  return sessions_.size();
}

}  // namespace kvagent::agent
