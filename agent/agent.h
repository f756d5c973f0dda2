// Agent wires one kvagentd together: UCX context and worker, region registry, peer
// manager, transfer engine, notification queue, and its doors: the local door (a gRPC
// Unix socket plus the session socket), the mutual-TLS network door and, only when
// asked, an insecure one. main.cc parses flags into AgentOptions; tests and tools can
// embed an Agent the same way.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "agent/access.h"
#include "agent/agent_service.h"
#include "agent/directory.h"
#include "agent/health.h"
#include "agent/systemd_notify.h"
#include "agent/heap_trimmer.h"
#include "agent/metrics.h"
#include "agent/transfer_metrics.h"
#include "agent/inbox.h"
#include "agent/incoming.h"
#include "agent/limits.h"
#include "agent/local_door.h"
#include "agent/metadata_watchers.h"
#include "agent/notification_queue.h"
#include "agent/peer_manager.h"
#include "agent/peer_secrets.h"
#include "agent/session_releases.h"
#include "agent/session_server.h"
#include "agent/staging.h"
#include "agent/tls.h"
#include "agent/transfer_engine.h"
#include "grpcpp/resource_quota.h"
#include "grpcpp/server.h"
#include "registry/region_registry.h"
#include "transport/ucx_context.h"
#include "transport/ucx_worker.h"

namespace kvagent::agent {

struct AgentOptions {
  std::string name;
  // The local door: gRPC on this Unix socket, sessions on PATH.session (mode, group).
  std::string local_socket = "/run/kvagent/kvagent.sock";
  std::string local_socket_group;
  uint32_t local_socket_mode = 0660;
  uint32_t max_sessions = 1024;
  // The network door, mutual TLS: HOST:PORT (port 0 picks a free port); "" for none.
  std::string listen;
  TlsFiles tls;
  // A plain-TCP door where nobody is identified and everybody may do everything; ""
  // for none. Also lets this agent reach network peers without TLS.
  std::string insecure_listen;
  AccessPolicy policy;  // roles; main.cc fills the defaults (the agent's own uid)
  std::vector<std::string> shm_dirs = {"/dev/shm", "/dev/hugepages"};
  // UCX_NET_DEVICES for the data path; "" derives it from the network door's address.
  std::string data_interface;
  std::string port_file;  // written with the network door's port (0: none) once serving
  uint32_t transfer_timeout_ms = 30000;
  uint32_t peer_refresh_ms = 200;
  // Peers' metadata pushed over Peer.WatchMetadata streams (--metadata-push on, the
  // default) or polled every peer_refresh_ms (off: the old way, for comparison).
  bool metadata_push = true;
  // The liveness door (agent/liveness.h): watched peers ping it instead of relying on
  // HTTP/2 keepalive (--liveness), UDP on this port of the network door's host (0: any
  // free port, announced to peers; --liveness-port).
  bool liveness = true;
  uint32_t liveness_port = 0;
  ErrorModeChoice error_mode = ErrorModeChoice::kAuto;
  // --ucx-tcp-remote any: UCX's TCP port keeps connections from every other host, not
  // only from authenticated peers' addresses (transport/ucx_tcp_guard.h; main sets the
  // guard from it).
  bool ucx_tcp_remote_any = false;
  // How long a calling peer's addresses stay allowed there after it stopped watching
  // and polling this agent (--ucx-tcp-host-ttl-ms; MetadataWatchers' forget_ms).
  uint32_t ucx_tcp_host_ttl_ms = 60000;
  // Replies to one peer endpoint that may wait unread in UCX (--ucx-held-replies; main
  // sets transport::SetHeldRepliesPerEndpoint from it).
  uint64_t ucx_held_replies = 65536;
  // Endpoints UCX may make for peers' wireup requests and checks that the agent did not
  // open itself (--ucx-peer-endpoints; main sets transport::SetPeerEndpointCap).
  uint64_t ucx_peer_endpoints = 1024;
  bool shm_direct = true;
  // Memory objects of one same-host peer mapped here (--max-peer-memory-objects).
  uint32_t max_peer_memory_objects = 4096;
  // One peer's pushed metadata views: their share of this agent's time and burst
  // (--peer-metadata-share, --peer-metadata-burst-ms; PeerManagerOptions).
  uint32_t peer_metadata_share_percent = 25;
  uint32_t peer_metadata_burst_ms = 2000;
  uint32_t deregister_wait_ms = 2000;
  // How long a transfer that ended with operations posted waits for them before it
  // reports drain_unknown (--drain-timeout-ms).
  uint32_t drain_timeout_ms = 5000;
  // Ended transfers kept for queries, outgoing and incoming each (--ended-transfers-kept;
  // TransferEngineOptions and IncomingOptions max_finished).
  uint32_t ended_transfers_kept = 10000;
  // A notification subscription idle this long is dropped, its held ones requeued.
  uint32_t subscription_ttl_ms = 600000;
  bool vram_staging = true;
  // Host staging pool (--staging-buffers, --staging-chunk-bytes).
  StagingPoolOptions staging;
  // For tests only (--stage-host-regions): host regions take the staged path, so the
  // staging protocol runs end to end on machines without a GPU.
  bool stage_host_regions = false;
  // For tests only (--allow-rendezvous): same-host endpoints send large active messages
  // by rendezvous (Endpoint::AllowRendezvous), as agents of older versions did.
  bool allow_rendezvous = false;
  // Under systemd with Type=notify: main takes it from the environment before any thread
  // starts (SystemdNotifier::FromEnvironment unsets the variables); null otherwise.
  std::shared_ptr<SystemdNotifier> systemd;
  // Every bound on what callers and peers can grow (--max-* flags; docs/LIMITS.md).
  Limits limits;
  // gRPC's resource quota for this agent's servers: memory for calls in progress
  // (--grpc-memory-bytes) and threads (--grpc-max-threads).
  uint64_t grpc_memory_bytes = 512ull << 20;
  uint32_t grpc_max_threads = 256;
  // The local fast path (--fast-path, --fast-path-spin-us; agent/fast_path.h).
  bool fast_path = true;
  uint32_t fast_path_spin_us = 50;
  uint32_t fast_path_features = ~0u;  // --fast-path-features (FastPathOptions::features)
  // --wire-features: AgentMetadata.wire_features announced to peers, masked with what
  // this build takes (agent/am_ids.h kWire*); fewer make peers talk to this agent as to
  // an older one (for testing the fallbacks).
  uint32_t wire_features = ~0u;
  // How long the UCX progress thread polls after work before it sleeps (--ucx-spin-us).
  uint32_t ucx_spin_us = 0;
  // CPUs the UCX progress thread (which also takes the fast path's rings) runs on
  // (--worker-cpus); empty: wherever the kernel places it.
  std::vector<int> worker_cpus;
  // Threads that copy one batch of same-host host memory (--copy-lanes); 0: the
  // default, the cores this agent may use up to 4 (DefaultCopyLanes).
  uint32_t copy_lanes = 0;
  // A plain-TCP door with grpc.health.v1.Health only (--health-listen HOST:PORT), for
  // probes without a certificate; "" for none. Every gRPC door serves Health too.
  std::string health_listen;
  // The Prometheus endpoint (--metrics-listen, --metrics-listen-any,
  // --metrics-max-connections); listen "" for none.
  MetricsServerOptions metrics;
  // The fleet directory in etcd (--directory, --directory-prefix, --directory-ttl-s);
  // url "" for none (peers by address only).
  DirectoryOptions directory;
};

class Agent {
 public:
  static absl::StatusOr<std::unique_ptr<Agent>> Start(const AgentOptions& options);
  ~Agent();

  int port() const { return port_; }  // the network door's (mutual TLS, else insecure)
  const AgentIdentity& identity() const { return identity_; }
  // Stops accepting RPCs, lets transfers finish for up to `grace`, fails the rest,
  // then releases peers, memory and UCX. Idempotent.
  void Shutdown(absl::Duration grace);

 private:
  Agent() = default;
  absl::Status StartDoor(Door door, const std::string& address,
                         std::shared_ptr<grpc::ServerCredentials> credentials);
  // A local session ended: queues its release for the releaser thread and returns (it
  // runs on the session socket's thread, which every hello and session request needs).
  void ReleaseSession(const Caller& caller);
  // The releaser thread: runs the queued releases in order until Shutdown.
  void RunReleaser();
  // Deregisters every region `principal` holds (after peers let go). Waits for the
  // registry's writer lock, which a registration holds while it maps and registers its
  // memory (not while it faults the pages in): 0.3 s for 16,384 regions here.
  void ReleaseNow(const std::string& principal, absl::Time ended);
  void WarnInsecure();
  // The directory saw agent `name` leave, restart or (re)appear: when it is a peer here
  // whose installed incarnation is not `now`'s, fails its transfers at once and
  // reconnects it at its new record's address.
  void OnDirectoryChange(const std::string& name, const directory::AgentRecord* before,
                         const directory::AgentRecord* now);
  // What the directory said of a peer connected here.
  struct DirectoryEvent {
    bool listed = false;       // a record is there (else the record left)
    bool again = false;        // listed after it had left (for the log)
    uint64_t incarnation = 0;  // the record's
    std::string address;       // where to reach it, or empty with...
    std::string address_error;  // ...why it cannot be reached from here
  };
  // One event per peer is handled at a time (a record rewritten in etcd again and again
  // started a connector thread per change); one that comes meanwhile replaces any
  // other waiting and is handled once the running one ends.
  void FollowDirectory(const std::string& name, DirectoryEvent event);
  // Before failing the installed incarnation's transfers, asks it (whoever can write
  // the directory's prefix can write any record): one that still answers as itself
  // stays connected. Then reconnects at the record's address. Both return true when
  // the event is handled already, false when a callback calls DirectoryEventDone.
  bool HandleDirectoryEvent(const std::string& name, const DirectoryEvent& event);
  bool ReconnectFromDirectory(const std::string& name, const DirectoryEvent& event);
  // The running event of `name` ended: handles the one waiting, if any.
  void DirectoryEventDone(const std::string& name);

  AgentOptions options_;
  AgentIdentity identity_;
  int port_ = 0;
  std::unique_ptr<transport::UcxContext> context_;
  // Declared before the worker, so it goes after it (its handlers are silenced first).
  std::unique_ptr<Inbox> inbox_;
  std::unique_ptr<transport::UcxWorker> worker_;
  std::unique_ptr<registry::RegionRegistry> registry_;
  std::unique_ptr<NotificationQueue> notifications_;
  std::unique_ptr<IncomingTransfers> incoming_;
  std::unique_ptr<MetadataWatchers> watchers_;
  std::unique_ptr<MetadataPush> push_;  // null with --metadata-push off
  std::unique_ptr<EndpointPings> pings_;  // used by peers_ and the Inbox; after the worker
  std::unique_ptr<PeerManager> peers_;
  std::unique_ptr<LivenessDoor> liveness_;  // null with --liveness off
  std::unique_ptr<Directory> directory_;  // null without --directory
  std::unique_ptr<Stager> stager_;  // used by the engine; destroyed after the worker
  std::unique_ptr<TransferEngine> engine_;
  SecurityCounters counters_;
  std::atomic<int64_t> open_streams_{0};
  Limits limits_;
  std::unique_ptr<StreamTable> streams_;
  std::atomic<uint64_t> pending_connects_{0};
  static constexpr int kMaxCallsPerConnection = 1024;
  std::unique_ptr<grpc::ResourceQuota> quota_;
  PeerSecrets secrets_;
  registry::PathPolicy path_policy_;
  std::unique_ptr<FastPathServer> fast_path_;  // used by the local door
  std::unique_ptr<LocalDoor> local_door_;
  std::unique_ptr<SessionServer> session_server_;
  ServiceDeps deps_{};
  // AgentOptions::systemd (agent/systemd_notify.h), else null; outlives the health
  // monitor, whose rounds ping its watchdog.
  std::shared_ptr<SystemdNotifier> systemd_;
  // grpc.health.v1 status of every door (agent/health.h) and the health-only door.
  std::unique_ptr<HealthMonitor> health_;
  std::unique_ptr<HealthDoor> health_door_;
  // Ended transfers counted for the metrics endpoint, and the endpoint itself.
  std::unique_ptr<TransferMetrics> transfer_metrics_;
  std::unique_ptr<MetricsServer> metrics_;
  // One Agent and one Peer service per door, each on its own server.
  struct DoorServer {
    Door door;
    std::string address;
    std::unique_ptr<AgentService> agent_service;
    std::unique_ptr<PeerService> peer_service;
    std::unique_ptr<grpc::Server> server;
  };
  std::vector<DoorServer> doors_;
  // --insecure-listen: a warning every minute while it runs that way.
  std::thread insecure_warning_;
  // After a burst of calls glibc keeps what they freed in its arenas: with 1,500 watch
  // streams, RssAnon stayed at 29-31 MiB (3 before) once they had ended, 45-56 MiB
  // after two more bursts. The trimmer gives it back (malloc_trim) a moment after
  // activity, and sleeps while there is none: 6 MiB after.
  // Pages that still hold a live object stay (docs/LIMITS.md, Tested by).
  std::unique_ptr<HeapTrimmer> heap_trimmer_;
  // Peers whose directory event is being handled -> the newest event that came
  // meanwhile, if any. Bounded by the peers connected.
  absl::Mutex directory_events_mu_;
  absl::flat_hash_map<std::string, std::optional<DirectoryEvent>> directory_events_
      ABSL_GUARDED_BY(directory_events_mu_);
  // Sessions that ended and whose regions are not released yet, added by
  // ReleaseSession, taken by `releaser_` in order (AgentStatus.sessions_releasing).
  SessionReleases releases_;
  std::thread releaser_;
  absl::Mutex stop_mu_;
  absl::CondVar stop_cv_;
  bool stopping_ ABSL_GUARDED_BY(stop_mu_) = false;
  bool shut_down_ = false;
};

}  // namespace kvagent::agent
