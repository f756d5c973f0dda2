// Host staging: moves VRAM that UCX cannot reach (no CUDA support in the running
// UCX) through a bounded pool of pinned host bounce buffers. StagingPool owns the
// buffers, DeviceCopier copies between them and VRAM, Stager runs the sender side
// (chunks over UCX active messages, or RMA from/into a bounce buffer) and the
// receiver side (checks, copies in, holds DATA_READY until the bytes are in place).
// Used by the transfer engine; the protocol is in docs/ARCHITECTURE.md.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "agent/am_ids.h"
#include "agent/peer_snapshot.h"
#include "cuda/driver.h"
#include "planning/staging_plan.h"
#include "planning/transfer_plan.h"
#include "proto/kvagent.pb.h"
#include "proto/wire.pb.h"
#include "registry/region_registry.h"
#include "transport/ucx_context.h"
#include "transport/ucx_worker.h"

namespace kvagent::agent {

struct StagingPoolOptions {
  uint64_t chunk_bytes = 4ull << 20;  // bytes of one bounce buffer
  uint32_t buffers = 8;               // never more are allocated
  // The chunk (and read reply part) on an endpoint without native RMA (ucx-am: the data
  // as eager messages), at most chunk_bytes. The receiving UCX assembles each such
  // message whole before handing it over, so this is what a receiver buffers for each
  // sender at a time; smaller than a bounce buffer, so many senders at once cost it
  // little (docs/BENCHMARKS.md, "Many senders over tcp").
  uint64_t am_message_bytes = 512ull << 10;
  uint64_t AmMessageBytes() const { return std::min(am_message_bytes, chunk_bytes); }
  // Buffers written off (StagingPool::WriteOff) held at once, in bytes: at least the
  // pool's own buffers' worth, else this much. Each peer that dies mid-transfer may
  // leave up to a pool's worth held for good (UCX never completes those requests).
  uint64_t max_written_off_bytes = 256ull << 20;
};

// INVALID_ARGUMENT naming the flag when a value is 0 or the pool would be huge.
absl::Status ValidateStagingOptions(const StagingPoolOptions& options);

// Buffers a StagingPool wrote off (WriteOff), since it was made.
struct StagingPoolWriteOffs {
  uint64_t total = 0;     // written off and replaced
  uint64_t held = 0;      // of those, still leased by the send that may read them
  uint64_t refused = 0;   // not replaced: `held` was at its bound, or allocation failed
  uint64_t bound = 0;     // the most held at once (max_written_off_bytes' worth)
};

// N bounce buffers of chunk_bytes. Pinned with the CUDA driver when one is given,
// else page-aligned host memory; registered with UCX (ucp_mem_map) when a context is
// given, so rendezvous and RMA use them without registering per message. A chunk
// that finds no free buffer waits for one: the pool never grows.
class StagingPool {
 private:
  struct State;

 public:
  // A held buffer, released to the pool (or straight to a waiter) on destruction.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease();
    uint8_t* data() const { return data_; }
    uint64_t size() const { return size_; }
    explicit operator bool() const { return data_ != nullptr; }

   private:
    friend class StagingPool;
    void Release();
    std::shared_ptr<State> state_;
    uint32_t index_ = 0;
    uint8_t* data_ = nullptr;
    uint64_t size_ = 0;
  };
  using Waiter = std::function<void(Lease)>;

  // `cuda` and `context` may be null (plain memory, no UCX registration).
  static absl::StatusOr<std::unique_ptr<StagingPool>> Create(const StagingPoolOptions& options,
                                                             cuda::CudaDriver* cuda,
                                                             const transport::UcxContext* context);
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // A free buffer, or an empty lease when all are held.
  Lease TryAcquire();
  // Runs `waiter` with a buffer: now, on this thread, when one is free; otherwise on
  // the thread that releases the next one, in the order waiters came.
  void Acquire(Waiter waiter);

  // Writes off the buffer `lease` holds: a send to a peer that stopped answering may
  // hold it for good (UCX without peer error handling never completes or cancels it),
  // and may still read it if the peer resumes, so it cannot be reused. Its slot gets a
  // new buffer at once (to the oldest waiter, or free); the old one is freed when the
  // lease is finally released. At most max_written_off_bytes' worth of buffers (and at
  // least `buffers`) are held written off at once; past that, and when allocating
  // fails, nothing changes and false is returned. False too for a lease written off
  // already or empty.
  bool WriteOff(const Lease& lease);
  StagingPoolWriteOffs write_offs() const;

  uint64_t chunk_bytes() const;
  uint32_t buffers() const;
  uint32_t free_buffers() const;
  size_t waiters() const;
  bool pinned() const;  // cuMemHostAlloc'd

 private:
  explicit StagingPool(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

// Copies between host memory and (device or host) memory; worker thread only.
// Copies may be queued until Sync().
class DeviceCopier {
 public:
  virtual ~DeviceCopier() = default;
  virtual absl::Status Copy(uint64_t dst, uint64_t src, uint64_t bytes) = 0;
  virtual absl::Status Sync() = 0;
};

// cuMemcpyAsync on one stream, then a stream sync (the real VRAM path).
std::unique_ptr<DeviceCopier> MakeCudaCopier();
// memcpy: stands in for the device copy only for host regions staged under
// --stage-host-regions (tests on machines without a GPU).
std::unique_ptr<DeviceCopier> MakeHostCopier();

// How one planned operation moves when it cannot use plain RMA or a direct mapping.
enum class StagedRoute : uint8_t {
  kNone = 0,    // RMA or same-host direct copy, as for host memory
  kChunks = 1,  // WRITE into the peer's staged memory: staged chunks over AM
  kBounce = 2,  // our memory is staged, the peer's is RMA-reachable: via a bounce buffer
  kRemoteRead = 3,  // READ of the peer's staged memory: it copies out and replies
};

struct StagerOptions {
  std::string self_name;
  uint64_t incarnation = 0;
  StagingPoolOptions pool;
  uint32_t max_pieces = 1024;             // pieces per chunk
  uint64_t max_chunk_message = 64 << 20;  // bytes of one incoming chunk, over the pool's too
  uint32_t max_held = 4096;               // notifications held for their data
  uint32_t max_held_per_peer = 1024;      // ... from one sender
  uint32_t max_arrivals = 8192;           // transfers whose staged chunks are being received
  uint32_t max_arrivals_per_peer = 2048;  // ... from one sender
  uint32_t hold_timeout_ms = 60000;       // staged state without progress is dropped after
  // A read reply sent to a reader (the agent whose READ reads our staged memory), or a
  // rendezvous chunk being received, not completed after this long: the receive buffer
  // it holds is written off (StagingPool::WriteOff) so that serving and receiving go
  // on. The agent passes its --drain-timeout-ms.
  uint32_t reply_timeout_ms = 5000;
  uint32_t max_serving = 4096;            // read replies queued for a buffer, all peers
  uint32_t max_serving_per_peer = 1024;   // ... for one reader
  // Staged chunks sent by rendezvous, waiting for a buffer or being fetched: in all,
  // and from one sender (which has at most its --staging-buffers in flight).
  uint32_t max_receiving = 512;
  uint32_t max_receiving_per_peer = 64;
  // True when `secret` is the one this agent issued to agent `from` (PeerSecrets):
  // staged chunks and read requests without it are dropped before anything else is
  // looked at. Required; `on_dropped` counts each drop.
  std::function<bool(std::string_view from, std::string_view secret)> verify_peer;
  std::function<void()> on_dropped;
  // Worker thread: true when this agent's own endpoint to agent `from` has no native
  // RMA (tcp): its chunks come eager there, and a rendezvous one is refused, since
  // fetching it over tcp could make UCX answer by itself (and abort us if that fails).
  std::function<bool(std::string_view from)> eager_only_from;
};

// How many of something each peer holds, by its name (a name with none is dropped):
// the per-peer shares of the Stager's bounds. Worker thread only.
class PerPeer {
 public:
  uint32_t of(std::string_view name) const {
    auto it = counts_.find(absl::string_view(name.data(), name.size()));
    return it == counts_.end() ? 0 : it->second;
  }
  void Add(const std::string& name) { ++counts_[name]; }
  void Remove(const std::string& name) {
    auto it = counts_.find(name);
    if (it != counts_.end() && --it->second == 0) counts_.erase(it);
  }

 private:
  absl::flat_hash_map<std::string, uint32_t> counts_;
};

class Stager {
 public:
  // A held DATA_READY whose staged data is all in place (`data` OK), or never will be
  // (`data` says why: a chunk was rejected, or the bytes stopped coming).
  using Deliver = std::function<void(v1::Notification n, absl::Status data)>;
  // `failed_segment` is -1 when the status is OK.
  using Done = std::function<void(absl::Status status, int32_t failed_segment)>;

  Stager(transport::UcxWorker* worker, const transport::UcxContext* context,
         registry::RegionRegistry* registry, StagerOptions options, Deliver deliver);
  ~Stager();
  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;

  // Starts the sweep of stale receive state (chunks arrive through agent/inbox).
  void Start();
  // Stops the sweep; call before the worker goes away.
  void Stop();

  // Submit-time routing of each op of `plan` (by the local region's and the peer
  // region's memory path).
  static absl::StatusOr<std::vector<StagedRoute>> Route(const std::string& transfer_id,
                                                        v1::TransferOp op,
                                                        const planning::TransferPlan& plan,
                                                        const PeerSnapshot& peer);

  // Worker thread: moves `ops` (all of `route`) and runs `done` once no chunk of
  // them is in flight. `stopped` is polled between chunks (cancel, deadline, lost
  // peer): no new chunk starts after it turns true; the status is then OK. A READ of
  // the peer's staged memory also polls it while waiting for replies (every 10 ms):
  // once it turns true the outstanding requests are abandoned (late replies are
  // dropped, nothing more is written to our memory) and `done` runs.
  void Run(const std::string& transfer_id, v1::TransferOp op, StagedRoute route,
           std::vector<planning::PlanOp> ops, std::shared_ptr<const PeerSnapshot> peer,
           std::function<bool()> stopped, Done done);

  // Worker thread: the transfer's operations went unconfirmed past the drain timeout
  // (drain_unknown: its peer stopped answering). Writes off the bounce buffers its
  // chunks' sends still hold (StagingPool::WriteOff), so that staging goes on for every
  // other transfer and peer instead of waiting for sends that may never complete; the
  // sends keep their buffers, untouched, in case the peer resumes. Returns how many.
  uint32_t WriteOffTransfer(const std::string& transfer_id);

  // Worker thread: holds DATA_READY `n` (staged_bytes > 0) until that many bytes of its
  // transfer arrived, then hands it to `deliver`, with the failure when a chunk of it
  // was rejected or its bytes stopped coming.
  void Hold(v1::Notification n);
  // Worker thread: the transfer of `n` ended without data (cancelled, failed): its
  // arrival state goes, and nothing more is credited to it.
  void Forget(const v1::Notification& n);

  // The Inbox's handlers (worker thread), each with a header that parsed (agent/inbox);
  // true when it kept the rendezvous descriptor. A staged chunk (AmId::kStagedChunk):
  // checked against our regions (Regions), then copied in and credited.
  bool OnChunk(const wire::StagedChunkHeader& header, const transport::AmMessage& message);
  // Serving side of a READ (kStagedReadRequest): checks the request and answers it from
  // our regions.
  bool OnReadRequest(const wire::StagedReadRequest& header, const transport::AmMessage& message);
  // Initiator side (kStagedReadReply): places a reply's bytes.
  bool OnReadReply(const wire::StagedReadReply& header, const transport::AmMessage& message);
  // Worker thread: drops the index of our regions (Regions) if the registry changed
  // since it was built, so that it no longer holds deregistered regions (their memory
  // stays mapped while anything holds them); the next staged message rebuilds it.
  void DropStaleRegions();
  // A staged message whose header did not parse (the Inbox logged it): counted.
  void CountUnparsed(AmId id);

  uint64_t chunks_received() const { return chunks_received_.load(); }
  uint64_t chunks_rejected() const { return chunks_rejected_.load(); }
  // Chunks and read replies taken by rendezvous (fetched): from agents on other hosts
  // with native RMA and peer error handling, or same-host agents of older versions;
  // same-host agents of this version send eager (transport Endpoint::EagerOnly).
  uint64_t rendezvous_received() const { return rendezvous_received_.load(); }
  uint64_t reads_served() const { return reads_served_.load(); }
  uint64_t reads_refused() const { return reads_refused_.load(); }
  // Bounce buffers written off: sending ones (WriteOffTransfer) and receive ones held
  // by read replies or chunk receives past reply_timeout_ms; and those not replaced
  // (the pool held as many written off as it may, or allocating failed).
  uint64_t buffers_written_off() const { return buffers_written_off_.load(); }
  uint64_t write_offs_refused() const { return write_offs_refused_.load(); }

 private:
  struct Job;
  struct Arrival {
    uint64_t bytes = 0;          // staged bytes copied into place
    uint32_t in_flight = 0;      // chunks being received
    std::string failure;         // why a chunk was rejected; empty if none
    uint64_t touched_us = 0;     // monotonic, last progress
    std::optional<v1::Notification> held;
    std::string from;            // the sending agent (arrivals_by_sender_ counts it)
  };
  struct StagedRegion {
    uint64_t base = 0;
    uint64_t length = 0;
    registry::RegionPtr region;
  };
  // One outstanding request of a READ of the peer's staged memory (initiator side);
  // worker thread only.
  struct ReadRequest {
    std::shared_ptr<Job> job;
    size_t chunk = 0;
    std::shared_ptr<StagingPool::Lease> lease;  // lands rendezvous replies
    std::map<uint64_t, uint64_t> received;      // offset -> length, never overlapping
    uint64_t bytes = 0;                         // copied into place
    uint32_t receiving = 0;                     // rendezvous replies being fetched
    bool ended = false;                         // completed, failed or abandoned
  };

  absl::Status EnsurePool();
  DeviceCopier& CopierFor(bool device);
  void Advance(const std::shared_ptr<Job>& job);
  void StartChunk(const std::shared_ptr<Job>& job, size_t index,
                  std::shared_ptr<StagingPool::Lease> lease);
  void ChunkDone(const std::shared_ptr<Job>& job, absl::Status status, int32_t segment);
  // Copies the pieces from `data` into place; the regions are the checked targets.
  absl::Status CopyIn(const wire::StagedChunkHeader& header, const uint8_t* data,
                      const std::vector<const StagedRegion*>& targets);
  void Credit(const std::string& key, uint64_t bytes, const std::string& failure);
  void MaybeDeliver(const std::string& key);
  void Sweep();
  // READ of the peer's staged memory, initiator side.
  void StartRemoteRead(const std::shared_ptr<Job>& job, size_t index,
                       std::shared_ptr<StagingPool::Lease> lease);
  // Copies reply bytes [offset, +length) of the request's chunk into place.
  absl::Status PlaceReply(const ReadRequest& request, uint64_t offset, const uint8_t* data,
                          uint64_t length);
  void EndRead(uint64_t request_id, absl::Status status);
  // Abandons the requests of jobs whose transfer stopped (cancel, deadline, lost peer).
  void CheckReads();
  void ServePart(std::shared_ptr<const wire::StagedReadRequest> request,
                 std::shared_ptr<const std::vector<StagedRegion>> sources,
                 const transport::ReplyEndpoint& reply_ep, uint64_t offset, uint64_t length,
                 std::shared_ptr<StagingPool::Lease> lease);
  void RefuseRead(const transport::ReplyEndpoint& reply_ep, uint64_t request_id,
                  const std::string& why, absl::StatusCode code, bool eager);
  // Every region of ours by base address, rebuilt when the registry version changes:
  // where a peer's chunks may land and its reads may come from. Every region is in the
  // catalog each authenticated peer fetches, with its rkey, so this reaches no further
  // than RMA does; staged regions are those RMA cannot reach.
  const std::vector<StagedRegion>& Regions();
  // The registered region of ours that holds [address, +length), or null.
  const StagedRegion* LocalRegionOf(uint64_t address, uint64_t length);

  transport::UcxWorker* worker_;
  const transport::UcxContext* context_;
  registry::RegionRegistry* registry_;
  StagerOptions options_;
  Deliver deliver_;

  // Worker-thread-only state.
  std::unique_ptr<StagingPool> pool_;       // sending
  std::unique_ptr<StagingPool> recv_pool_;  // receiving
  // Sending jobs not finished, by transfer id (several chunks of one transfer may each
  // have one); worker thread only. For WriteOffTransfer.
  absl::flat_hash_map<std::string, std::vector<std::weak_ptr<Job>>> jobs_;
  std::atomic<uint64_t> buffers_written_off_{0};
  std::atomic<uint64_t> write_offs_refused_{0};
  // Receive buffers lent to UCX: read replies being sent and rendezvous chunks being
  // received, oldest first (worker thread); their count for the sweep thread, which
  // checks them every 500 ms while there are any.
  struct LentBuffer {
    std::weak_ptr<StagingPool::Lease> lease;
    uint64_t since_us = 0;
    std::string peer;  // the reader, or the sender
    std::string transfer_id;
    bool reply = false;  // a read reply; else a chunk being received
  };
  std::deque<LentBuffer> lent_;
  std::atomic<size_t> lent_watched_{0};
  void Lend(std::shared_ptr<StagingPool::Lease> lease, const std::string& peer,
            const std::string& transfer_id, bool reply);
  // Worker thread: drops given-back buffers from lent_ and writes off those lent for
  // longer than reply_timeout_ms.
  void WriteOffStaleLent();
  std::unique_ptr<DeviceCopier> cuda_copier_;
  std::unique_ptr<DeviceCopier> host_copier_;
  // The fixed fields of the largest header a job's chunks travel with (Run sizes the
  // pieces' share of a UCX active-message header from it).
  wire::StagedReadRequest header_probe_;
  absl::flat_hash_map<std::string, Arrival> arrivals_;  // by from/incarnation/transfer
  PerPeer arrivals_by_sender_;  // arrivals_ per `from`
  // Every insert into and erase from arrivals_ goes through these (they keep the count).
  Arrival& ArrivalFor(const std::string& key, const std::string& from);
  void EraseArrival(absl::flat_hash_map<std::string, Arrival>::iterator it);
  std::atomic<bool> arrivals_full_logged_{false};       // one warning per full spell
  // Arrivals holding their DATA_READY (Hold), in all and by sender; EraseArrival
  // counts them out.
  uint32_t held_ = 0;
  PerPeer held_by_sender_;
  uint64_t regions_version_ = UINT64_MAX;
  std::vector<StagedRegion> regions_;  // every region of ours, by base
  // The same as CheckReadPieces takes them (index for index), rebuilt with regions_:
  // a read request checks against every region, so it must not copy them each time.
  std::vector<planning::StagedRange> ranges_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<ReadRequest>> reads_;  // by request id
  // Unguessable ids for reads_ (see NewRequestId); worker thread only.
  std::random_device request_ids_;
  uint64_t NewRequestId();
  uint32_t serving_ = 0;          // reply parts waiting for or holding a buffer
  PerPeer serving_by_peer_;  // serving_ per reader
  void PartServed(const std::string& reader);  // one of serving_ is done
  // The serial of the last reply endpoint ServePart found gone (logged once, not once
  // a part); worker thread only.
  uint64_t gone_reader_logged_ = 0;
  // Rendezvous chunks waiting for or being received (StagerOptions::max_receiving), by
  // sender, and the bytes of those received into heap memory (bigger than our buffers).
  uint32_t receiving_ = 0;
  PerPeer receiving_by_peer_;
  // Rendezvous receives that failed, by sender: a chunk that arrived before the
  // sender's latest failure is dropped unread (see OnChunk). One entry per sender
  // that ever failed one.
  absl::flat_hash_map<std::string, uint64_t> rendezvous_failures_;
  uint64_t RendezvousFailuresOf(const std::string& from) const {
    auto it = rendezvous_failures_.find(from);
    return it == rendezvous_failures_.end() ? 0 : it->second;
  }
  uint64_t heap_receiving_ = 0;
  std::atomic<uint32_t> reads_outstanding_{0};  // reads_.size(), for the sweep thread
  // arrivals_ held something at the last insert or sweep (worker thread writes it): the
  // sweep thread sweeps every 500 ms only then; with nothing to sweep it sleeps.
  std::atomic<bool> arrivals_held_{false};
  // Worker thread, after an insert into arrivals_: wakes an idle sweep thread.
  void NoteArrival();
  std::atomic<uint64_t> reads_served_{0};
  std::atomic<uint64_t> reads_refused_{0};

  std::atomic<uint64_t> chunks_received_{0};
  std::atomic<uint64_t> chunks_rejected_{0};
  std::atomic<uint64_t> rendezvous_received_{0};
  std::atomic<bool> stopping_{false};
  absl::Mutex sweep_mu_;
  absl::CondVar sweep_cv_;
  std::thread sweep_thread_;
};

}  // namespace kvagent::agent
