// LocalSession: an engine's (or a same-host peer agent's) session with the agent on
// its node, over the session socket (proto "Local session protocol"). It identifies
// the caller to the agent, gives the token for gRPC calls and moves memory as file
// descriptors. Used by engine integrations, cli/ tools and agents reaching peers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "base/unique_fd.h"
#include "client/session_wire.h"
#include "proto/kvagent.pb.h"

namespace kvagent::client {

// Thread-safe: one request at a time (a mutex serializes calls). The session lasts
// while this object lives; destroying it (or the process dying) ends the session and
// the agent frees what it held for it.
class LocalSession {
 public:
  // Connects to the agent's session socket and says hello. Errors: no socket at the
  // path (UNAVAILABLE, with the fix), no access (PERMISSION_DENIED: the operator's
  // --local-socket-group), refused by the agent (its status), no answer within
  // timeout_ms (DEADLINE_EXCEEDED). Every later call has the same timeout.
  static absl::StatusOr<std::unique_ptr<LocalSession>> Attach(
      const std::string& session_socket_path, const std::string& client_name,
      uint32_t timeout_ms = 10000);
  LocalSession(const LocalSession&) = delete;
  LocalSession& operator=(const LocalSession&) = delete;

  const v1::SessionWelcome& welcome() const { return welcome_; }
  // Send as gRPC metadata "kvagent-session" on the agent's local socket.
  const std::string& token() const { return welcome_.token(); }
  // Who listens on the socket (SO_PEERCRED): the agent's uid, gid and pid.
  ProcessCredentials agent_credentials() const { return agent_credentials_; }
  const std::string& path() const { return path_; }

  // Hands the agent a descriptor of host memory (memfd, shm, hugetlbfs file, opened
  // read-write). `fd` stays the caller's; the agent keeps its own duplicate.
  absl::StatusOr<v1::MemoryHandleInfo> ShareMemory(int fd, const std::string& label);
  // Hands the agent a CUDA VMM allocation of `bytes` on `device` (the ordinal as the
  // agent numbers devices): `fd` is the POSIX descriptor of
  // cuMemExportToShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), and stays
  // the caller's. The handle (kind "cuda-vmm") goes in CudaVmmSource.memory_handle of
  // VRAM regions; the agent imports the allocation when they are registered.
  absl::StatusOr<v1::MemoryHandleInfo> ShareDeviceMemory(int fd, int device, uint64_t bytes,
                                                         const std::string& label);
  // Has the agent allocate `bytes` of shared memory; returns its handle and a
  // descriptor of it for the caller to map.
  absl::StatusOr<std::pair<v1::MemoryHandleInfo, UniqueFd>> AllocateMemory(
      const std::string& label, uint64_t bytes);
  absl::Status FreeMemory(uint64_t handle);
  // Same-host peer agents: descriptors of exported memory (ExportedRegion.memory_id),
  // in the order asked. Lists longer than kMaxSessionFds go as several requests.
  absl::StatusOr<std::vector<std::pair<uint64_t, UniqueFd>>> PeerMemory(
      const std::vector<uint64_t>& memory_ids);
  // Same-host peer agents: descriptors of exported CUDA VMM allocations
  // (ExportedRegion.cuda_vmm_id), in the order asked, each with the size and device
  // the exporting agent holds for it (the importer compares them with the catalog).
  struct PeerDeviceMemory {
    uint64_t id = 0;
    UniqueFd fd;
    uint64_t bytes = 0;
    int device = 0;
  };
  absl::StatusOr<std::vector<PeerDeviceMemory>> PeerDeviceMemories(
      const std::vector<uint64_t>& device_memory_ids);

  // Opens the session's local fast path (proto OpenFastPathRequest): the ring info and
  // its three descriptors (ring file, submission doorbell, completion doorbell).
  // client/fast_path's FastPath::Open calls it and maps the ring.
  absl::StatusOr<std::pair<v1::FastPathInfo, std::vector<UniqueFd>>> OpenFastPath(
      const v1::OpenFastPathRequest& request);

  // Closes the session's fast path ring, keeping the session (proto CloseFastPathRequest).
  // FastPath::Close calls it. UNIMPLEMENTED from an agent that does not know the request.
  // `timeout_ms` (0: the session's) bounds this call alone: FastPath's destructor sends it
  // with a short one.
  absl::StatusOr<v1::FastPathClosed> CloseFastPath(uint32_t timeout_ms = 0);
  // The session's per-call timeout (Attach's timeout_ms).
  uint32_t timeout_ms() const { return timeout_ms_; }

  // The session socket, to watch for the agent going away (POLLHUP, or POLLIN with a
  // read at end of stream). Do not read or write it.
  int fd() const { return fd_.get(); }

 private:
  LocalSession(std::string path, UniqueFd fd, uint32_t timeout_ms);

  // Sends `request` (seq filled in) with `fds` and waits for its reply, up to
  // `timeout_ms` (0: the session's). A reply with an error becomes that status; a
  // connection error breaks the session.
  absl::StatusOr<v1::SessionReply> Call(v1::SessionRequest request, const std::vector<int>& fds,
                                        std::vector<UniqueFd>* reply_fds,
                                        uint32_t timeout_ms = 0);
  absl::StatusOr<v1::SessionReply> CallLocked(v1::SessionRequest request,
                                              const std::vector<int>& fds,
                                              std::vector<UniqueFd>* reply_fds,
                                              uint32_t timeout_ms = 0)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Broken(const absl::Status& cause) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  const UniqueFd fd_;
  const uint32_t timeout_ms_;
  v1::SessionWelcome welcome_;
  ProcessCredentials agent_credentials_;

  absl::Mutex mu_;
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);  // OK while the connection is usable
};

}  // namespace kvagent::client
