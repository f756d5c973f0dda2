// A peer with stock UCX and every protocol UCX offers (RMA, 64-bit atomics, tag,
// stream, active messages): what an authenticated peer can do to an agent's worker
// with UCX's public API alone. Progress runs on the calling thread.
#pragma once

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvagent::testing {

class StockUcxPeer {
 public:
  // One endpoint to the worker at `address`. `peer_errors`: with UCX's peer error
  // handling, which UCX 1.13 serves over tcp, where it emulates RMA and atomics with
  // active messages that the target's UCX serves by itself, at whatever address the
  // sender names. `rndv_thresh`: UCX_RNDV_THRESH for this context only (empty: UCX's).
  // Fails the test when UCX refuses any step.
  StockUcxPeer(const std::string& address, bool peer_errors, const std::string& rndv_thresh);
  ~StockUcxPeer();
  StockUcxPeer(const StockUcxPeer&) = delete;
  StockUcxPeer& operator=(const StockUcxPeer&) = delete;

  ucp_ep_h ep() const { return ep_; }
  // The peer's worker (to set an active message handler for answers; progressed only
  // by Progress).
  ucp_worker_h worker() const { return worker_; }
  // Opens one more endpoint to the same worker, of the same error mode (closed with the
  // peer; UCP sends its wireup request with its first message that needs the other
  // side's endpoint, such as an active message with reply).
  ucp_ep_h AnotherEndpoint();
  // This peer's worker address (ucp_worker_get_address), for the other side to connect.
  std::string Address() const;
  // True once UCX reported the endpoint failed.
  bool failed() const { return failed_; }
  // Unpacks a packed rkey for the endpoint (destroyed with the peer).
  ucp_rkey_h Unpack(const std::string& packed);
  // Keeps a request (or an immediate status) to look at with Status; returns its index.
  size_t Track(ucs_status_ptr_t request);
  // Progresses for up to `ms`, or until every tracked request completed.
  void Progress(uint32_t ms);
  // Tracked request `i`: UCS_INPROGRESS until it completes, then its status.
  ucs_status_t Status(size_t i) const;
  // Lets go of the tracked requests (UCX frees those still in flight when they end).
  void Forget();

 private:
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  std::vector<ucp_ep_h> more_;
  std::string address_;
  bool peer_errors_ = false;
  bool failed_ = false;
  std::vector<ucp_rkey_h> rkeys_;
  std::vector<ucs_status_ptr_t> tracked_;
};

// Memory UCX allocated in this process (ucp_mem_map with UCP_MEM_MAP_ALLOCATE; UCX's
// first choice of method is sysv): a stand-in for another engine's segment, or this
// agent's own. Its packed remote key's sysv entry names the segment (a 4-byte id, then
// the owner's address, in UCX 1.13): what a peer could forge into its region keys.
// Fails the test when UCX did not allocate with sysv.
class UcxSysvSegment {
 public:
  UcxSysvSegment();
  ~UcxSysvSegment();
  UcxSysvSegment(const UcxSysvSegment&) = delete;
  UcxSysvSegment& operator=(const UcxSysvSegment&) = delete;

  const std::string& key() const { return key_; }
  // The key with its sysv entry naming segment 0, which does not attach.
  std::string KeyNamingSegmentZero() const;
  // How many attach the segment now (shm_nattch): 1 while only this process does.
  uint64_t Attached() const;
  // UCX's context (to register other memory in it).
  ucp_context_h context() const { return context_; }

 private:
  ucp_context_h context_ = nullptr;
  ucp_mem_h memory_ = nullptr;
  std::string key_;
  size_t segment_at_ = 0;  // where the sysv entry's id lies in key_
  int32_t segment_ = 0;
};

}  // namespace kvagent::testing
