// PeerManager connects this agent to peer agents: it authenticates them (a same-host
// peer through its local door, identified by the kernel; any other by its
// certificate), fetches their metadata over gRPC (untrusted: validated by
// registry::RemoteCatalog), and only then opens a UCX endpoint and unpacks their
// rkeys. It then watches each peer over a WatchMetadata stream (changes pushed, acked
// once installed; the stream's end and the peer's liveness door carry liveness), or
// polls it every refresh period (--metadata-push off, or a peer without the stream). The transfer engine reads immutable PeerSnapshots from it.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "agent/endpoint_pings.h"
#include "agent/liveness.h"
#include "agent/peer_snapshot.h"
#include "agent/tls.h"
#include "client/local_session.h"
#include "proto/kvagent.grpc.pb.h"
#include "registry/cuda_ipc_mapping.h"
#include "registry/remote_catalog.h"
#include "registry/shm_mapping.h"
#include "transport/ucx_hardening.h"
#include "transport/ucx_worker.h"

namespace grpc {
class ChannelArguments;
class ServerBuilder;
}

namespace kvagent::agent {

// Peer liveness (metadata push on) is the liveness door's (agent/liveness.h): a signed
// datagram every kLivenessPeriodMs, another kLivenessRetryMs after one that is not
// answered; a peer none of whose pings was answered for kLivenessTimeoutMs is marked
// unreachable (0.4-1 s after it stops; the bound is 2 s). At 300 ms without retries
// the watched agent answered 3.3 pings a second per watcher; at 600 ms + retries, 1.7.
// A peer that announces no door (an older kvagentd, --liveness off), or whose door
// does not answer, is polled with a known-version GetMetadata every refresh period.
// HTTP/2 keepalive stays, slow: it still ends the stream of a connection that died
// without a reset. Before the door, these pings carried liveness at 500 + 500 ms and
// cost the watched agent a thread wake-up each: 3-10 % of a core at 1,000 peers
// (docs/BENCHMARKS.md, "Peers at scale").
inline constexpr int kLivenessPeriodMs = 600;
inline constexpr int kLivenessRetryMs = 150;
inline constexpr int kLivenessTimeoutMs = 1000;
inline constexpr int kPeerKeepaliveTimeMs = 20000;
inline constexpr int kPeerKeepaliveTimeoutMs = 5000;
// Pings closer than this are strikes at a door. It stays at what older agents send
// (500 ms keepalive) so that a rolling upgrade does not drop their connections.
inline constexpr int kPeerKeepaliveMinRecvMs = 400;
// A door lets peers ping that often without calls in progress, and pings its own
// clients every 10 s so a vanished watcher's stream ends (it then stops counting).
void AllowPeerKeepalive(grpc::ServerBuilder* builder);
// A peer channel's arguments: its own connection, a reconnect backoff near the poll
// period and, with `keepalive` (metadata push on), the pings above.
grpc::ChannelArguments PeerChannelArgs(bool keepalive);

// How this agent reaches one peer's Peer service: a gRPC channel and, for a same-host
// peer, the session on its local door (its token goes with every call; descriptors of
// its memory come over it). Shared by the polls that use it.
struct PeerLink {
  std::string address;
  bool local = false;  // unix:PATH: the peer's local door, kernel-identified
  // The pid behind the door (local, or a network door of this host whose process was
  // found), whose shared memory and TCP port UCX may reach while this lives.
  transport::SameHostPeerHold same_host;
  // UCX's TCP connections to this host for this peer are checked (SameHostTcpCheck):
  // false only for a network door of this host whose process was not found.
  bool tcp_checked = true;
  bool tls = false;    // HOST:PORT with mutual TLS
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Peer::Stub> stub;
  std::unique_ptr<client::LocalSession> session;  // local only

  // Adds the session token to a call (local links).
  void Prepare(grpc::ClientContext* context) const;
  // After a call answered: the agent that answered is the one the reply names. TLS:
  // the certificate names it; local: it is the process behind the socket (pid) and
  // the session's agent. PERMISSION_DENIED naming both sides otherwise.
  absl::Status Verify(const grpc::ClientContext& context, const v1::AgentMetadata& reply) const;
};

// What PeerManager needs to open links.
struct PeerLinkOptions {
  TlsFiles tls;           // mutual TLS to network peers (empty: none)
  bool insecure = false;  // plain TCP to network peers (this agent runs --insecure-listen)
  std::set<uid_t> peer_uids;  // a same-host peer's agent must run as one of these
};

enum class ErrorModeChoice { kAuto, kPeer, kNone };

// A peer was lost: it stopped answering (its poll failed, or its UCX endpoint
// failed), or it restarted (a new incarnation was installed). `cause` is an
// UNAVAILABLE status naming the peer, what happened and the fix.
struct PeerLoss {
  std::string name;
  absl::Status cause;
  // Restart: the incarnation now installed; transfers planned against any other one
  // are lost. 0 when the peer stopped answering (every transfer to it is lost).
  uint64_t current_incarnation = 0;
};
using PeerLossListener = std::function<void(const PeerLoss&)>;

struct PeerManagerOptions {
  std::string self_name;
  // GetMetadataRequest.data_addresses: this agent's data interface addresses.
  std::vector<std::string> data_addresses;
  uint64_t incarnation = 0;  // ours: connecting to ourselves is refused
  std::string host_id;
  ErrorModeChoice error_mode = ErrorModeChoice::kAuto;
  uint32_t refresh_ms = 200;
  // Watch each peer's metadata over Peer.WatchMetadata (falling back to polls for a
  // peer without it) instead of polling every refresh_ms.
  bool metadata_push = true;
  uint32_t connect_timeout_ms = 5000;
  // Map a same-host peer's shared memory and copy directly (see DirectMappings).
  bool shm_direct = true;
  // Tests only (--allow-rendezvous): Endpoint::AllowRendezvous on every endpoint made.
  bool allow_rendezvous = false;
  // Host memory objects of one peer mapped at once: each takes one of the process's
  // guarded mappings (FaultGuard, 65,536, shared with our own engines' regions), so one
  // peer exporting ever more objects cannot take them all. Regions in objects past the
  // first this many (in catalog order) move through UCX, each named in fallbacks.
  uint32_t max_memory_objects = 4096;
  // The time one peer's pushed views may take to apply here (checked, catalog built,
  // keys unpacked on the worker thread): a budget of metadata_burst_ms, refilled at
  // metadata_share_percent of the time. A peer past it has its next view read once
  // the budget is back (HTTP/2 flow control holds its pushes meanwhile), so a peer
  // pushing large catalogs without end takes at most that share of a pool thread and
  // of the worker's time. 100: never paced.
  uint32_t metadata_share_percent = 25;
  uint32_t metadata_burst_ms = 2000;
  PeerLinkOptions link;
  // Ping watched peers' liveness doors (metadata push on): LivenessProber.
  bool liveness = true;
  uint32_t liveness_period_ms = kLivenessPeriodMs;
  uint32_t liveness_timeout_ms = kLivenessTimeoutMs;
};

class PeerManager {
 public:
  // `pings` (outlives this; null: none sent) proves each new endpoint works both ways
  // before its peer is called connected (EndpointPings), for peers that take pings.
  PeerManager(transport::UcxWorker* worker, PeerManagerOptions options,
              EndpointPings* pings = nullptr);
  ~PeerManager();

  // Fetches the peer's metadata and connects; `done` runs on a connector, gRPC or
  // worker thread. Connecting an already connected peer refreshes it. Returns at once:
  // attaching to a same-host peer's session socket blocks (up to connect_timeout_ms
  // when it does not answer), so each call runs on its own connector thread, never on
  // the caller's (a gRPC thread that other calls need). The caller bounds how many
  // run at once (the pending_connects limit).
  void Connect(const std::string& address, std::function<void(absl::StatusOr<v1::PeerInfo>)> done);
  // NOT_FOUND (with the connected names and the fix) when `name` is not connected;
  // UNAVAILABLE when it stopped answering.
  absl::StatusOr<std::shared_ptr<const PeerSnapshot>> Get(const std::string& name) const;
  // Fetches `name`'s metadata now instead of at the next poll (a region the peer
  // registered a moment ago); `done` runs on a gRPC or worker thread.
  void RefreshAsync(const std::string& name, std::function<void(absl::Status)> done);
  // Asks connected peer `name` which incarnation answers at its address now (one
  // GetMetadata naming the installed version, so an unchanged peer answers briefly;
  // nothing is installed from the answer), within `timeout_ms`. `done` runs on a gRPC
  // thread, or at once: NOT_FOUND when `name` is not connected, UNAVAILABLE when it did
  // not answer, PERMISSION_DENIED when another agent answered there.
  void AskIncarnation(const std::string& name, uint32_t timeout_ms,
                      std::function<void(absl::StatusOr<uint64_t>)> done);
  // True when this agent has an endpoint to peer `name` (any state) and it has no
  // native RMA (tcp); false otherwise. Worker thread (a snapshot's endpoint is the
  // worker's); no allocation.
  bool EndpointLacksNativeRma(std::string_view name) const;
  std::vector<v1::PeerInfo> List() const;
  size_t size() const;
  // Forgets peer `name`: no more polls, its endpoint and mappings close once nothing
  // uses them, its local session (same host) ends. NOT_FOUND naming the connected peers.
  absl::Status Disconnect(const std::string& name);

  // The fleet directory says incarnation `incarnation` of `name` is gone (its lease
  // expired) or was replaced (a restart): marks it unreachable now, failing its
  // transfers, when that incarnation is still the one installed; the polls reconnect it
  // once it answers.
  void MarkGone(const std::string& name, uint64_t incarnation, const std::string& why) {
    MarkUnreachable(name, incarnation, why, /*endpoint_failed=*/true);
  }

  // Set once, before StartMonitor. Called on the monitor, gRPC or worker thread,
  // never under PeerManager's lock (the listener may take its own locks, but must not
  // call back into PeerManager while holding one that PeerManager callers hold).
  void SetLossListener(PeerLossListener listener) { loss_listener_ = std::move(listener); }

  // Liveness datagrams the prober dropped (forged, replayed, malformed).
  uint64_t liveness_dropped() const { return prober_ ? prober_->dropped() : 0; }
  uint64_t liveness_lost() const { return prober_ ? prober_->lost() : 0; }
  uint64_t liveness_refused() const { return prober_ ? prober_->refused() : 0; }
  // Same-host peers' CUDA VMM allocations this agent failed to import, over its life:
  // each view rebuild retries the ones that failed, so a peer whose imports keep
  // failing adds them again with each metadata change (PeerInfo.vmm_import_failures
  // is the current view's).
  uint64_t vmm_import_failures_total() const {
    return vmm_import_failures_total_.load(std::memory_order_relaxed);
  }

  void StartMonitor();
  // Stops the monitor and drops every peer (endpoints close on the worker).
  void Stop();

 private:
  class MetadataWatch;  // one peer's WatchMetadata stream (peer_manager.cc)
  friend class MetadataWatch;
  struct Peer {
    std::shared_ptr<const PeerSnapshot> snapshot;
    // Shared: a poll keeps using its link while ConnectPeer with a new address
    // replaces it.
    std::shared_ptr<PeerLink> link;
    uint64_t version = 0;
    // The newest version whose older operations were drained (DrainPosted) before a
    // poll told the peer that this agent holds it.
    uint64_t drained_version = 0;
    // The UCX endpoint reported an error: the next answered poll opens a new one.
    bool endpoint_failed = false;
    std::string state = "connected";
    std::string last_error;
    uint64_t last_seen_us = 0;
    // PeerInfo.metadata_bytes_last and the rest (RecordRefresh).
    uint64_t metadata_bytes_last = 0;
    uint64_t refresh_us_last = 0;
    uint64_t deltas_applied = 0;
    uint64_t full_fetches = 0;
    // Its pushed views: whole views at a version already held here (dropped unbuilt),
    // the time spent applying them, and the time its next view waited for the budget
    // (ChargeMetadata). The budget: microseconds left, and when it was last refilled.
    uint64_t views_ignored = 0;
    uint64_t apply_us_total = 0;
    uint64_t paced_us_total = 0;
    int64_t budget_us = 0;
    uint64_t budget_at_us = 0;
    bool budget_started = false;
    uint64_t paced_until_us = 0;  // its polls wait until then (QueuePoll)
    bool pacing_logged = false;  // said once per stretch of pacing
    // Its open WatchMetadata stream (null: none open; polled).
    std::shared_ptr<MetadataWatch> watch;
    // It answered WatchMetadata with UNIMPLEMENTED: polled from then on.
    bool push_unsupported = false;
    // A poll of it is queued or running in the pool (one at a time per peer).
    bool polling = false;
    // Its liveness door as it announced it (AgentMetadata.liveness_address), and
    // whether it is polled for liveness instead (no door, or the door is silent).
    std::string liveness_address;
    bool liveness_polled = false;
  };

  // Validates metadata and builds a snapshot on the worker thread, reusing the
  // endpoint of `previous` when the peer's worker is the same.
  // With `delta` (metadata is a delta, applied to previous's catalog), the keys of the
  // regions it kept are taken from `previous` and only its own are unpacked; that
  // needs previous's endpoint (else FAILED_PRECONDITION: fetch the whole catalog).
  void BuildSnapshot(const std::shared_ptr<PeerLink>& link, const v1::AgentMetadata& metadata,
                     std::shared_ptr<const PeerSnapshot> previous,
                     std::function<void(absl::StatusOr<std::shared_ptr<const PeerSnapshot>>)> done,
                     bool reuse_endpoint = true,
                     std::optional<registry::AppliedDelta> delta = std::nullopt);
  // What a changed view cost (PeerInfo.metadata_bytes_last and the rest): its bytes,
  // the time from the poll's start, and whether it came as a delta.
  struct RefreshCost {
    uint64_t bytes = 0;
    uint64_t micros = 0;
    bool delta = false;
  };
  // Installs `snapshot`; tells the loss listener (after unlocking) when it replaces
  // another incarnation.
  // `view` is the metadata it was built from (its liveness door).
  void Install(std::shared_ptr<PeerLink> link, std::shared_ptr<const PeerSnapshot> snapshot,
               uint64_t version, const RefreshCost& cost, const v1::AgentMetadata& view);
  // Has the prober ping `snapshot`'s peer at its announced door (or stop pinging it).
  void WatchLiveness(const PeerLink& link, const PeerSnapshot& snapshot,
                     const std::string& announced);
  std::optional<PeerLoss> InstallLocked(std::shared_ptr<PeerLink> link,
                                        std::shared_ptr<const PeerSnapshot> snapshot,
                                        uint64_t version, const RefreshCost& cost)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Opens a link to `address` (see ConnectPeerRequest.address).
  absl::StatusOr<std::shared_ptr<PeerLink>> OpenLink(const std::string& address) const;
  // Connect's work, on a connector thread.
  void ConnectNow(const std::string& address,
                  std::function<void(absl::StatusOr<v1::PeerInfo>)> done);
  // Marks `name` unreachable with `error` (only while `incarnation` is still the one
  // installed, when not 0) and tells the loss listener.
  void MarkUnreachable(const std::string& name, uint64_t incarnation, const std::string& error,
                       bool endpoint_failed);
  void NotifyLoss(const PeerLoss& loss) const;
  // Maps the peer's shm-backed regions, reusing `previous` mappings that match. Never
  // null; the caller installs it only when `mapped` > 0.
  std::shared_ptr<const DirectMappings> MapDirect(const registry::RemoteCatalog& catalog,
                                                  PeerLink& link,
                                                  const DirectMappings* previous) const;
  // MapDirect's part for VRAM by CUDA VMM: fetches the descriptors of the peer's
  // allocations over its session socket, checks them against what it announced and
  // imports each once (reusing `previous`'s), filling direct's vmm_* and base_by_slot;
  // each region it cannot map goes to `fallback` with the reason (host staging).
  void MapVmm(const registry::RemoteCatalog& catalog, PeerLink& link,
              const DirectMappings* previous, DirectMappings* direct,
              const std::function<void(const registry::RemoteRegion&, std::string)>& fallback)
      const;
  void MonitorLoop();
  // Waits (up to `timeout`) until every operation posted to the peer through
  // `snapshot`'s endpoint before this call has completed or failed: direct copies run
  // on the worker thread, so a closure queued after them runs after them, and an
  // endpoint flush covers what UCX still has in flight. False on timeout.
  bool DrainPosted(const std::shared_ptr<const PeerSnapshot>& snapshot, absl::Duration timeout);
  // Returns true when the peer had changed and a new snapshot was installed.
  bool RefreshOne(const std::string& name);
  v1::PeerInfo InfoLocked(const Peer& peer) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The version a poll or an acknowledgement may report for `name` after draining
  // what was posted before it (see RefreshOne); 0 when `previous` is no longer the
  // view installed.
  uint64_t DrainedVersion(const std::string& name,
                          const std::shared_ptr<const PeerSnapshot>& previous);
  // Opens `name`'s WatchMetadata stream unless one is open or stopping.
  void OpenWatch(const std::string& name);
  // A pushed view from `watch`, on a pool thread: verified, applied, installed, then
  // acknowledged once drained.
  // Applies one pushed view; returns how long to wait before reading the next one
  // (ChargeMetadata: 0 unless the peer is past its budget).
  absl::Duration ApplyPushed(const std::shared_ptr<MetadataWatch>& watch,
                             const v1::AgentMetadata& reply);
  void ApplyPushedView(const std::shared_ptr<MetadataWatch>& watch,
                       const v1::AgentMetadata& reply);
  // Charges `cost_us` of applying a view to peer `name`'s budget (PeerManagerOptions::
  // metadata_share_percent); returns how long its next view must wait.
  absl::Duration ChargeMetadata(const std::string& name, uint64_t cost_us);
  // `watch` ended with `status` (not by this agent's own cancel).
  void WatchEnded(MetadataWatch* watch, const grpc::Status& status);
  // Runs `job` on the pool (kPollThreads threads); dropped, not run, at Stop.
  void Enqueue(std::function<void()> job);
  // Runs `job` on the pool once `delay` has passed (dropped, like queued jobs, at Stop).
  void EnqueueAfter(absl::Duration delay, std::function<void()> job);
  // Queues a poll of `name` (RefreshOne), then a stream if push is on and it answers.
  void QueuePoll(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PoolLoop();
  // Wakes the monitor for a round now (it sleeps while every peer is watched).
  void KickMonitor();

  transport::UcxWorker* worker_;
  EndpointPings* pings_;  // null: no pings sent
  PeerManagerOptions options_;
  std::unique_ptr<LivenessProber> prober_;  // null: metadata push or liveness off
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Peer> peers_ ABSL_GUARDED_BY(mu_);
  PeerLossListener loss_listener_;
  // UCX endpoint error callbacks run on the worker thread and may come after Stop();
  // they reach this manager only through the guard, which Stop() clears.
  struct CallbackGuard {
    absl::Mutex mu;
    PeerManager* manager ABSL_GUARDED_BY(mu) = nullptr;
  };
  std::shared_ptr<CallbackGuard> guard_ = std::make_shared<CallbackGuard>();
  std::atomic<bool> stopping_{false};
  mutable std::atomic<uint64_t> vmm_import_failures_total_{0};  // MapVmm (const) counts
  // Connector threads (Connect), joined when finished or at Stop.
  struct Connector {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> finished;
  };
  absl::Mutex connect_mu_;
  std::vector<Connector> connectors_ ABSL_GUARDED_BY(connect_mu_);
  absl::Mutex monitor_mu_;
  absl::CondVar monitor_cv_;
  bool monitor_kicked_ ABSL_GUARDED_BY(monitor_mu_) = false;
  std::thread monitor_;
  // Polls and pushed views are worked by a few threads, however many peers there are.
  static constexpr int kPollThreads = 4;
  absl::Mutex pool_mu_;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(pool_mu_);
  // EnqueueAfter's jobs by when they are due (absl::Now() based).
  std::multimap<absl::Time, std::function<void()>> delayed_ ABSL_GUARDED_BY(pool_mu_);
  bool pool_stopping_ ABSL_GUARDED_BY(pool_mu_) = false;
  std::vector<std::thread> pool_;
  // WatchMetadata streams whose reactor has not finished (Stop waits for none).
  absl::Mutex watches_mu_;
  int live_watches_ ABSL_GUARDED_BY(watches_mu_) = 0;
};

}  // namespace kvagent::agent
