// kvagentd: parses flags (Abseil flags, with --flagfile), starts the Agent, and waits
// for SIGTERM/SIGINT. --help prints the grouped text below, not Abseil's per-file list.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "agent/agent.h"
#include "agent/copy_lanes.h"
#include "agent/flags.h"
#include "agent/systemd_notify.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "fmt/format.h"
#include "registry/shm_mapping.h"
#include "transport/ucx_hardening.h"
#include "transport/ucx_tcp_guard.h"

namespace {

using kvagent::agent::AutoOff;
using kvagent::agent::Count;
using kvagent::agent::DeviceCopyFlag;
using kvagent::agent::ErrorModeChoice;
using kvagent::agent::FileMode;
using kvagent::agent::GivenList;
using kvagent::agent::OnOff;

constexpr std::string_view kUsage = R"(usage: kvagentd --name NAME [flags]

  --name NAME                 agent name, unique among its peers (required)
  --flagfile PATH             read flags from PATH, one --flag=VALUE a line (# begins a
                              comment line); a flag given after --flagfile overrides it
  --check-flags               check the flags (and flag files) and exit without starting:
                              0 when accepted, 2 naming the first refused (addresses are
                              checked later, as the doors open)

 Doors (see docs/SECURITY.md):
  --local-socket PATH         the local door: gRPC on PATH, sessions on PATH.session
                              (default /run/kvagent/kvagent.sock)
  --local-socket-group GROUP  group of both sockets (name or gid); with mode 0660 its
                              members may attach
  --local-socket-mode OCTAL   mode of both sockets (default 0660)
  --max-sessions N            local sessions attached at once (default 1024); those
                              ended whose regions are not released yet count too
  --listen HOST:PORT          the network door, mutual TLS only (needs --tls-cert,
                              --tls-key, --tls-ca); port 0 picks one. Default: none
  --tls-cert PATH             this agent's certificate (PEM); its DNS name or CN must be
                              --name; also used to reach network peers
  --tls-key PATH              its private key (PEM)
  --tls-ca PATH               the cluster CA: the only issuer of peers and schedulers
  --insecure-listen HOST:PORT a plain-TCP door where NOBODY IS IDENTIFIED and every
                              caller may read and write every registered region; for a
                              trusted test network only (warns every minute)
  --port-file PATH            write the network door's port (0: none) once serving
  --metrics-listen [HOST:]PORT
                              serve Prometheus metrics at http://HOST:PORT/metrics on
                              a listener of its own (HOST defaults to 127.0.0.1; port 0
                              picks one; see GetStatus.metrics_address). Default: none
  --metrics-listen-any on|off allow a wildcard HOST (0.0.0.0, [::]) for
                              --metrics-listen (default off: name the scraper's address)
  --metrics-max-connections N scrapes served at once; more are refused with 503
                              (default 16)
  --health-listen HOST:PORT   a plain-TCP door with grpc.health.v1.Health only (no
                              other service, nobody identified), for probes that have
                              no certificate, e.g. Kubernetes' gRPC probes; port 0
                              picks one. Every gRPC door also serves Health and server
                              reflection. Default: none

 Fleet directory (etcd v3, through its JSON gateway; docs/ARCHITECTURE.md "Directory"):
  --directory etcd://HOST:PORT[,HOST:PORT...]
                              publish this agent (name, doors, host, incarnation) under
                              a lease and watch the others: ConnectPeer "agent:NAME"
                              resolves through it, a peer whose record expires or that
                              restarts fails its transfers at once and is reconnected,
                              `kvagentctl agents` lists the fleet. etcds://... speaks TLS.
                              Default: none (peers by address only)
  --directory-ca FILE         etcds://: PEM CA that signed etcd's certificate (default:
                              the system's trust store)
  --directory-cert FILE       etcds://: PEM client certificate, for an etcd started with
  --directory-key FILE        --client-cert-auth (both or neither)
  --directory-prefix PREFIX   key prefix in etcd (default /kvagent/)
  --directory-ttl-s N         lease TTL: how long a dead agent stays listed (default 10)

 Roles (comma-separated uids or user names; "none" for nobody):
  --engine-uids LIST          local uids that may register memory (default: any uid
                              that can open the socket)
  --scheduler-uids LIST       local uids that may act on every engine's regions,
                              transfers and notifications (default: the agent's own uid)
  --peer-uids LIST            uids a same-host peer agent may run as (default: the
                              agent's own uid)
  --scheduler-identities LIST certificate names with the scheduler role (default none)
  --peer-identities LIST      certificate names that may act as peers (default: every
                              certificate of the cluster CA)

 Memory and data path:
  --shm-dirs DIR[,DIR]        where registration by file name may look (default
                              /dev/shm,/dev/hugepages); descriptors need none
  --data-interface IF[,IF]    UCX_NET_DEVICES for data (default: the interface of the
                              --listen address; lo without a network door)
  --log-level LEVEL           trace|debug|info|warn|error|off (default info)
  --transfer-timeout-ms N     default deadline of a transfer (default 30000)
  --peer-refresh-ms N         how often peers without a metadata stream are polled, and
                              unreachable ones retried (default 200)
  --metadata-push on|off      on (default): peers push their metadata over a stream and
                              their liveness doors are pinged; off: poll every peer each
                              --peer-refresh-ms (the old way)
  --liveness on|off           on (default): answer watching peers' liveness pings (UDP
                              beside the network door, a Unix datagram socket beside
                              the local door) and ping the peers this agent watches;
                              off: peers poll this agent for liveness
  --liveness-port N           the liveness door's UDP port on the --listen host (default
                              0: any free port, announced to peers); open it for UDP.
                              Without a network door, N > 0 opens it on 127.0.0.1
  --ucx-error-mode MODE       auto|peer|none (default auto: none for same-host peers,
                              whose shared-memory transports UCX 1.13 disables under
                              peer error handling; peer otherwise)
  --ucx-tcp-remote peers|any  whom UCX's TCP port keeps connections from on other hosts:
                              peers (default) only from addresses of authenticated peers
                              (where their metadata calls came from, or data addresses
                              they announced); any: every host (fence UCX's ports then)
  --ucx-tcp-host-ttl-ms N     a calling peer's addresses stay allowed on UCX's TCP port
                              this long after it stopped watching and polling this
                              agent's metadata (default 60000; at least 100)
  --shm-direct auto|off       auto (default): map a same-host peer's shared memory and
                              copy into it directly; off: move all data through UCX
  --ucx-held-replies N        replies to one peer endpoint that may wait unread in UCX
                              (a software put's completion or a get's data, about 350
                              bytes each); past it that endpoint's software puts and
                              gets are dropped (default 65536; at least 256)
  --max-peer-memory-objects N shm-direct: memory objects of one same-host peer mapped
                              here (default 4096); regions in objects past them move
                              through UCX (each mapped object takes one of the 65,536
                              guarded mappings this process shares with its engines)
  --peer-metadata-share PCT   the share of this agent's time one peer's pushed metadata
                              views may take to apply (checked, catalog built, keys
                              unpacked; default 25); past it (and past the burst below)
                              its next view is read later: a peer pushing large catalogs
                              without end cannot hold the worker. 100: no pacing
  --peer-metadata-burst-ms MS what one peer's views may take at once before the share
                              applies (default 2000: a whole catalog of ~100,000 regions)
  --max-mapped-bytes N        address space the host memory objects mapped here may take
                              in all (engines' objects and same-host peers'; each is
                              mapped whole; default 17592186044416, 16 TiB of the
                              process's 128 TiB): past it a region is refused, a peer's
                              moves through UCX
  --warm-mappings on|off      on: after mapping host memory (a region, a peer's region
                              for a same-host copy), a background thread reads one byte
                              per page of it, so the first transfers do not pay each
                              page's first-access fault (5-18 us per page on some VMs;
                              doctor's first-touch check measures it); while it runs it
                              competes with transfers there. off (default)
  --vram-staging auto|off     VRAM when UCX lacks CUDA: auto (default) registers it for
                              same-host CUDA IPC copies ("staged" path); off refuses it
  --staging-buffers N         host staging: bounce buffers per direction (default 8)
  --staging-chunk-bytes N     host staging: bytes of one bounce buffer, the chunk size
                              (default 4194304)
  --am-message-bytes N        data as messages (data path ucx-am: tcp, no native RMA):
                              bytes of one message, at most --staging-chunk-bytes. A
                              receiver's UCX assembles each message whole, so this is
                              what it buffers per sender at a time (default 524288)
  --deregister-wait-ms N      how long DeregisterRegions waits for polling peers to see
                              the change, and for this agent's transfers that use the
                              regions to drain (default 2000)
  --drain-timeout-ms N        a transfer that ended with operations posted to a peer
                              reports drain_unknown if they are not confirmed by then
                              (default 5000); host staging then writes off the bounce
                              buffers those sends hold, and those of read replies a
                              reader has not taken by then, and replaces them
  --ended-transfers-kept N    ended transfers kept for GetTransfer and ListTransfers,
                              outgoing and incoming each, the oldest let go first (1 to
                              1000000, default 10000); the newest 256 (64 incoming) are
                              kept whole, 1-2 KiB of heap each, the rest compact, a few
                              hundred bytes each (docs/LIMITS.md)
  --shutdown-grace-ms N       on SIGTERM, how long running transfers may finish (default 5000)
  --subscription-ttl-ms N     a notification subscription with no watch, poll or ack for
                              this long is dropped; what it held unacknowledged goes
                              back to the queue (default 600000)
  --grpc-memory-bytes N       gRPC's memory quota for calls in progress, all doors
                              (default 536870912)
  --grpc-max-threads N        gRPC's thread quota (default 256)
  --fast-path on|off          on (default): local sessions may open a submission and a
                              completion ring in shared memory (OpenFastPathRequest)
  --fast-path-spin-us N       how long the UCX thread, which takes the rings' entries,
                              keeps polling them after the last one before it sleeps on
                              their doorbells and UCX's events (default 50)
  --fast-path-features N      FastPathInfo.features the rings announce and take (a mask
                              of client/fast_ring.h kFeature*: 1 notifications, 2 durable
                              subscriptions, 4 a wake-up per count of completions;
                              default all): fewer make the rings behave
                              as an older agent's, for testing clients against one
  --wire-features N           AgentMetadata.wire_features announced to peers (a mask of
                              agent/am_ids.h kWire*: 1 notice batches, 2 data over active
                              messages, 4 an open inside DATA_READY, 8 a committed
                              DATA_READY, 16 a ping at connect; default all): fewer
                              make peers talk to this agent as to an older one, for
                              testing
  --ucx-spin-us N             how long the UCX progress thread polls after work before
                              it sleeps (default 0: at once; polling pays only where
                              cores are spare: on 2 shared cores 50 us made one-page
                              transfers 30 % slower)
  --worker-cpus LIST          CPUs the UCX progress thread runs on (e.g. 3, or 2-3): it
                              moves the data, answers peers and takes the fast path's
                              rings, and polls after work; on a CPU of its own it does
                              not take turns with the engines' threads it answers
                              (default: none given, the kernel places it; GetStatus
                              worker_cpus shows where it may run)
  --copy-lanes N              lanes that copy one batch of same-host memory side by
                              side: threads for host memory, CUDA streams for VRAM
                              (1-64; default: the cores this agent may use, at most 4)
  --device-copy MECHANISM     how same-host VRAM pages are copied: auto (default: the
                              best this host has), batch (cuMemcpyBatchAsync), kernel
                              (the gather kernel) or per-page (cuMemcpyAsync per page);
                              overrides KVAGENT_DEVICE_COPY; GetStatus, peers and
                              doctor show what is used and why
)";

std::string Usage() { return std::string(kUsage) + kvagent::agent::Limits::Usage(); }

constexpr std::string_view kSeeHelp =
    "kvagentd: `kvagentd --help` lists every flag with its values and default\n";

int Fail(const std::string& message) {
  std::fprintf(stderr, "kvagentd: %s\n%s", message.c_str(), kSeeHelp.data());
  return 2;
}

// The defaults are AgentOptions' own, so the flags and the library cannot disagree.
const kvagent::agent::AgentOptions& Defaults() {
  static const auto* defaults = new kvagent::agent::AgentOptions;
  return *defaults;
}

}  // namespace

// Every flag of kUsage, by its dashed name. Help texts stay in kUsage (one place).
KVAGENT_FLAG(std::string, name, "name", "", "");
KVAGENT_FLAG(std::string, local_socket, "local-socket", Defaults().local_socket, "");
KVAGENT_FLAG(std::string, local_socket_group, "local-socket-group", "", "");
KVAGENT_FLAG(FileMode, local_socket_mode, "local-socket-mode",
             FileMode{Defaults().local_socket_mode}, "");
KVAGENT_FLAG(Count<uint32_t>, max_sessions, "max-sessions", {Defaults().max_sessions}, "");
KVAGENT_FLAG(std::string, listen, "listen", "", "");
KVAGENT_FLAG(std::string, tls_cert, "tls-cert", "", "");
KVAGENT_FLAG(std::string, tls_key, "tls-key", "", "");
KVAGENT_FLAG(std::string, tls_ca, "tls-ca", "", "");
KVAGENT_FLAG(std::string, insecure_listen, "insecure-listen", "", "");
KVAGENT_FLAG(std::string, port_file, "port-file", "", "");
KVAGENT_FLAG(std::string, metrics_listen, "metrics-listen", "", "");
KVAGENT_FLAG(OnOff, metrics_listen_any, "metrics-listen-any",
             OnOff{Defaults().metrics.allow_any}, "");
KVAGENT_FLAG(Count<uint32_t>, metrics_max_connections, "metrics-max-connections",
             {Defaults().metrics.max_connections}, "");
KVAGENT_FLAG(std::string, health_listen, "health-listen", "", "");
KVAGENT_FLAG(std::string, directory, "directory", "", "");
KVAGENT_FLAG(std::string, directory_ca, "directory-ca", "", "");
KVAGENT_FLAG(std::string, directory_cert, "directory-cert", "", "");
KVAGENT_FLAG(std::string, directory_key, "directory-key", "", "");
KVAGENT_FLAG(std::string, directory_prefix, "directory-prefix", Defaults().directory.prefix, "");
KVAGENT_FLAG(Count<uint32_t>, directory_ttl_s, "directory-ttl-s", {Defaults().directory.ttl_s},
             "");
KVAGENT_FLAG(GivenList, engine_uids, "engine-uids", {}, "");
KVAGENT_FLAG(GivenList, scheduler_uids, "scheduler-uids", {}, "");
KVAGENT_FLAG(GivenList, peer_uids, "peer-uids", {}, "");
KVAGENT_FLAG(std::string, scheduler_identities, "scheduler-identities", "", "");
KVAGENT_FLAG(GivenList, peer_identities, "peer-identities", {}, "");
KVAGENT_FLAG(std::string, shm_dirs, "shm-dirs", absl::StrJoin(Defaults().shm_dirs, ","), "");
KVAGENT_FLAG(std::string, data_interface, "data-interface", "", "");
KVAGENT_FLAG(std::string, log_level, "log-level", "info", "");
KVAGENT_FLAG(Count<uint32_t>, transfer_timeout_ms, "transfer-timeout-ms",
             {Defaults().transfer_timeout_ms}, "");
KVAGENT_FLAG(Count<uint32_t>, peer_refresh_ms, "peer-refresh-ms", {Defaults().peer_refresh_ms},
             "");
KVAGENT_FLAG(OnOff, metadata_push, "metadata-push", OnOff{Defaults().metadata_push}, "");
KVAGENT_FLAG(OnOff, liveness, "liveness", OnOff{Defaults().liveness}, "");
KVAGENT_FLAG(Count<uint32_t>, liveness_port, "liveness-port", {Defaults().liveness_port}, "");
KVAGENT_FLAG(ErrorModeChoice, ucx_error_mode, "ucx-error-mode", Defaults().error_mode, "");
KVAGENT_FLAG(std::string, ucx_tcp_remote, "ucx-tcp-remote", "peers", "");
KVAGENT_FLAG(Count<uint32_t>, ucx_tcp_host_ttl_ms, "ucx-tcp-host-ttl-ms",
             {Defaults().ucx_tcp_host_ttl_ms}, "");
KVAGENT_FLAG(Count<uint64_t>, ucx_held_replies, "ucx-held-replies",
             {Defaults().ucx_held_replies}, "");
KVAGENT_FLAG(Count<uint64_t>, ucx_peer_endpoints, "ucx-peer-endpoints",
             {Defaults().ucx_peer_endpoints}, "");
KVAGENT_FLAG(AutoOff, shm_direct, "shm-direct", AutoOff{Defaults().shm_direct}, "");
KVAGENT_FLAG(Count<uint32_t>, max_peer_memory_objects, "max-peer-memory-objects",
             {Defaults().max_peer_memory_objects}, "");
KVAGENT_FLAG(Count<uint32_t>, peer_metadata_share, "peer-metadata-share",
             {Defaults().peer_metadata_share_percent}, "");
KVAGENT_FLAG(Count<uint32_t>, peer_metadata_burst_ms, "peer-metadata-burst-ms",
             {Defaults().peer_metadata_burst_ms}, "");
KVAGENT_FLAG(OnOff, warm_mappings, "warm-mappings", OnOff{false}, "");
KVAGENT_FLAG(Count<uint64_t>, max_mapped_bytes, "max-mapped-bytes",
             {kvagent::registry::ShmMapping::kDefaultMappedBytesBound}, "");
KVAGENT_FLAG(AutoOff, vram_staging, "vram-staging", AutoOff{Defaults().vram_staging}, "");
KVAGENT_FLAG(Count<uint32_t>, staging_buffers, "staging-buffers",
             {Defaults().staging.buffers}, "");
KVAGENT_FLAG(Count<uint64_t>, staging_chunk_bytes, "staging-chunk-bytes",
             {Defaults().staging.chunk_bytes}, "");
KVAGENT_FLAG(Count<uint64_t>, am_message_bytes, "am-message-bytes",
             {Defaults().staging.am_message_bytes}, "");
KVAGENT_FLAG(Count<uint32_t>, deregister_wait_ms, "deregister-wait-ms",
             {Defaults().deregister_wait_ms}, "");
KVAGENT_FLAG(Count<uint32_t>, drain_timeout_ms, "drain-timeout-ms",
             {Defaults().drain_timeout_ms}, "");
KVAGENT_FLAG(Count<uint32_t>, ended_transfers_kept, "ended-transfers-kept",
             {Defaults().ended_transfers_kept}, "");
KVAGENT_FLAG(Count<uint32_t>, shutdown_grace_ms, "shutdown-grace-ms", {5000}, "");
KVAGENT_FLAG(Count<uint32_t>, subscription_ttl_ms, "subscription-ttl-ms",
             {Defaults().subscription_ttl_ms}, "");
KVAGENT_FLAG(Count<uint64_t>, grpc_memory_bytes, "grpc-memory-bytes",
             {Defaults().grpc_memory_bytes}, "");
KVAGENT_FLAG(Count<uint32_t>, grpc_max_threads, "grpc-max-threads",
             {Defaults().grpc_max_threads}, "");
KVAGENT_FLAG(OnOff, fast_path, "fast-path", OnOff{Defaults().fast_path}, "");
KVAGENT_FLAG(Count<uint32_t>, fast_path_spin_us, "fast-path-spin-us",
             {Defaults().fast_path_spin_us}, "");
KVAGENT_FLAG(Count<uint32_t>, fast_path_features, "fast-path-features",
             {Defaults().fast_path_features}, "");
KVAGENT_FLAG(Count<uint32_t>, wire_features, "wire-features", {Defaults().wire_features}, "");
KVAGENT_FLAG(Count<uint32_t>, ucx_spin_us, "ucx-spin-us", {Defaults().ucx_spin_us}, "");
KVAGENT_FLAG(Count<uint32_t>, copy_lanes, "copy-lanes", {Defaults().copy_lanes}, "");
KVAGENT_FLAG(kvagent::agent::CpuList, worker_cpus, "worker-cpus", {}, "");
KVAGENT_FLAG(DeviceCopyFlag, device_copy, "device-copy", {}, "");
KVAGENT_FLAG(bool, check_flags, "check-flags", false, "");
// Hidden, for tests only: host regions take the staged path (memcpy stands in for the
// device copy), so the staging protocol runs on machines without a GPU.
KVAGENT_FLAG(bool, stage_host_regions, "stage-host-regions", false, "");
// Hidden, for tests only: same-host endpoints send large active messages by rendezvous,
// as an agent of an older version did (transport Endpoint::AllowRendezvous), so the
// receiving side's rendezvous paths run with real agents on one machine.
KVAGENT_FLAG(bool, allow_rendezvous, "allow-rendezvous", false, "");

// The limits (agent/limits.h): "" keeps the limit's default; main() reads them by name
// from Limits' table, and refuses to start if one of its flags is missing here.
KVAGENT_FLAG(std::string, max_regions, "max-regions", "", "");
KVAGENT_FLAG(std::string, max_regions_per_owner, "max-regions-per-owner", "", "");
KVAGENT_FLAG(std::string, max_registered_bytes_per_owner, "max-registered-bytes-per-owner", "",
             "");
KVAGENT_FLAG(std::string, max_metadata_bytes, "max-metadata-bytes", "", "");
KVAGENT_FLAG(std::string, max_allocated_bytes, "max-allocated-bytes", "", "");
KVAGENT_FLAG(std::string, max_allocated_bytes_per_owner, "max-allocated-bytes-per-owner", "",
             "");
KVAGENT_FLAG(std::string, max_active_transfers, "max-active-transfers", "", "");
KVAGENT_FLAG(std::string, max_active_transfers_per_owner, "max-active-transfers-per-owner", "",
             "");
KVAGENT_FLAG(std::string, max_ops_per_chunk, "max-ops-per-chunk", "", "");
KVAGENT_FLAG(std::string, max_planned_ops, "max-planned-ops", "", "");
KVAGENT_FLAG(std::string, max_queued_notifications, "max-queued-notifications", "", "");
KVAGENT_FLAG(std::string, max_queued_notification_bytes, "max-queued-notification-bytes", "",
             "");
KVAGENT_FLAG(std::string, max_streams, "max-streams", "", "");
KVAGENT_FLAG(std::string, max_streams_per_caller, "max-streams-per-caller", "", "");
KVAGENT_FLAG(std::string, max_pending_connects, "max-pending-connects", "", "");
KVAGENT_FLAG(std::string, max_peer_callers, "max-peer-callers", "", "");
KVAGENT_FLAG(std::string, max_subscriptions, "max-subscriptions", "", "");
KVAGENT_FLAG(std::string, max_in_flight_per_subscription, "max-in-flight-per-subscription", "",
             "");
KVAGENT_FLAG(std::string, max_memory_handles, "max-memory-handles", "", "");
KVAGENT_FLAG(std::string, max_memory_handles_per_session, "max-memory-handles-per-session", "",
             "");

namespace {

// True from the start of parsing until it succeeded: Abseil reports a refused flag
// itself and calls exit(1); ReportRefusedFlags (atexit) then adds where to look and
// makes it exit 2, as every other bad usage of kvagentd.
std::atomic<bool> parsing{false};

void ReportRefusedFlags() {
  if (!parsing.load()) return;
  std::fputs(kSeeHelp.data(), stderr);
  std::fflush(stderr);
  _exit(2);
}

// An argument's flag name without its dashes and value ("--help=x" -> "help").
std::string_view FlagName(std::string_view arg) {
  arg = arg.substr(0, arg.find('='));
  while (!arg.empty() && arg[0] == '-') arg.remove_prefix(1);
  return arg;
}

// Abseil's --only_check_args exits 0 from inside parsing: ReportRefusedFlags must not
// turn that into a refusal.
bool OnlyChecksArgs(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (FlagName(argv[i]) == "only_check_args") return true;
  }
  return false;
}

// --help and its Abseil variants print the grouped text and exit 0 (Abseil's own
// handling would list flags file by file and exit 1).
bool AsksForHelp(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--") break;
    const std::string_view name = FlagName(arg);
    if (arg == "-h" || name == "help" || name == "helpfull" || name == "helpshort" ||
        name == "helppackage" || name == "helpon" || name == "helpmatch") {
      return true;
    }
  }
  return false;
}

// The uids a --*-uids flag names (user names are looked up here), or `fallback` when
// the flag was not given.
absl::StatusOr<std::set<uid_t>> Uids(const GivenList& list, std::string_view flag,
                                     std::set<uid_t> fallback) {
  if (!list.given) return fallback;
  return kvagent::agent::ParseUidList(list.text, flag);
}

// Fills `options` from the parsed flags; INVALID_ARGUMENT naming the flag when they do
// not hold together.
absl::Status ReadFlags(kvagent::agent::AgentOptions* options, uint32_t* grace_ms) {
  using absl::GetFlag;
  options->name = GetFlag(FLAGS_name);
  options->local_socket = GetFlag(FLAGS_local_socket);
  options->local_socket_group = GetFlag(FLAGS_local_socket_group);
  options->local_socket_mode = GetFlag(FLAGS_local_socket_mode).bits;
  options->max_sessions = GetFlag(FLAGS_max_sessions).value;
  options->listen = GetFlag(FLAGS_listen);
  options->tls.cert = GetFlag(FLAGS_tls_cert);
  options->tls.key = GetFlag(FLAGS_tls_key);
  options->tls.ca = GetFlag(FLAGS_tls_ca);
  options->insecure_listen = GetFlag(FLAGS_insecure_listen);
  options->port_file = GetFlag(FLAGS_port_file);
  options->metrics.listen = GetFlag(FLAGS_metrics_listen);
  options->metrics.allow_any = GetFlag(FLAGS_metrics_listen_any).on;
  options->metrics.max_connections = GetFlag(FLAGS_metrics_max_connections).value;
  options->health_listen = GetFlag(FLAGS_health_listen);
  options->directory.url = GetFlag(FLAGS_directory);
  options->directory.tls = {GetFlag(FLAGS_directory_ca), GetFlag(FLAGS_directory_cert),
                            GetFlag(FLAGS_directory_key)};
  options->directory.prefix = GetFlag(FLAGS_directory_prefix);
  options->directory.ttl_s = GetFlag(FLAGS_directory_ttl_s).value;
  options->shm_dirs = absl::StrSplit(GetFlag(FLAGS_shm_dirs), ',', absl::SkipEmpty());
  options->data_interface = GetFlag(FLAGS_data_interface);
  options->transfer_timeout_ms = GetFlag(FLAGS_transfer_timeout_ms).value;
  options->peer_refresh_ms = GetFlag(FLAGS_peer_refresh_ms).value;
  options->metadata_push = GetFlag(FLAGS_metadata_push).on;
  options->liveness = GetFlag(FLAGS_liveness).on;
  options->liveness_port = GetFlag(FLAGS_liveness_port).value;
  options->error_mode = GetFlag(FLAGS_ucx_error_mode);
  const std::string ucx_tcp_remote = GetFlag(FLAGS_ucx_tcp_remote);
  if (ucx_tcp_remote != "peers" && ucx_tcp_remote != "any") {
    return absl::InvalidArgumentError(fmt::format(
        "--ucx-tcp-remote: '{}' is neither peers nor any; peers (the default) keeps UCX "
        "connections from other hosts only from authenticated peers' addresses, any keeps "
        "them from every host (fence UCX's ports then)",
        ucx_tcp_remote.substr(0, 64)));
  }
  options->ucx_tcp_remote_any = ucx_tcp_remote == "any";
  options->ucx_tcp_host_ttl_ms = GetFlag(FLAGS_ucx_tcp_host_ttl_ms).value;
  options->ucx_held_replies = GetFlag(FLAGS_ucx_held_replies).value;
  if (options->ucx_held_replies < 256) {
    return absl::InvalidArgumentError(fmt::format(
        "--ucx-held-replies: {} is below 256; an honest peer's software puts and gets may "
        "have that many replies in flight (the default, 65536, holds at most about 22 MiB "
        "per endpoint)",
        options->ucx_held_replies));
  }
  options->ucx_peer_endpoints = GetFlag(FLAGS_ucx_peer_endpoints).value;
  if (options->ucx_peer_endpoints < 16) {
    return absl::InvalidArgumentError(fmt::format(
        "--ucx-peer-endpoints: {} is below 16; each peer agent connected to this one may "
        "hold one (the default, 1024, holds at most about 18 MiB)",
        options->ucx_peer_endpoints));
  }
  if (options->ucx_tcp_host_ttl_ms < 100) {
    return absl::InvalidArgumentError(fmt::format(
        "--ucx-tcp-host-ttl-ms: {} is below 100; a peer's addresses must outlast a watch "
        "stream's reconnect (the default, 60000, does)",
        options->ucx_tcp_host_ttl_ms));
  }
  options->shm_direct = GetFlag(FLAGS_shm_direct).on;
  options->max_peer_memory_objects = GetFlag(FLAGS_max_peer_memory_objects).value;
  options->peer_metadata_share_percent = GetFlag(FLAGS_peer_metadata_share).value;
  options->peer_metadata_burst_ms = GetFlag(FLAGS_peer_metadata_burst_ms).value;
  options->vram_staging = GetFlag(FLAGS_vram_staging).on;
  options->staging.buffers = GetFlag(FLAGS_staging_buffers).value;
  options->staging.chunk_bytes = GetFlag(FLAGS_staging_chunk_bytes).value;
  options->staging.am_message_bytes = GetFlag(FLAGS_am_message_bytes).value;
  options->stage_host_regions = GetFlag(FLAGS_stage_host_regions);
  options->allow_rendezvous = GetFlag(FLAGS_allow_rendezvous);
  options->deregister_wait_ms = GetFlag(FLAGS_deregister_wait_ms).value;
  options->drain_timeout_ms = GetFlag(FLAGS_drain_timeout_ms).value;
  options->ended_transfers_kept = GetFlag(FLAGS_ended_transfers_kept).value;
  options->subscription_ttl_ms = GetFlag(FLAGS_subscription_ttl_ms).value;
  options->grpc_memory_bytes = GetFlag(FLAGS_grpc_memory_bytes).value;
  options->grpc_max_threads = GetFlag(FLAGS_grpc_max_threads).value;
  options->fast_path = GetFlag(FLAGS_fast_path).on;
  options->fast_path_spin_us = GetFlag(FLAGS_fast_path_spin_us).value;
  options->fast_path_features = GetFlag(FLAGS_fast_path_features).value;
  options->wire_features = GetFlag(FLAGS_wire_features).value;
  options->ucx_spin_us = GetFlag(FLAGS_ucx_spin_us).value;
  options->copy_lanes = GetFlag(FLAGS_copy_lanes).value;
  options->worker_cpus = GetFlag(FLAGS_worker_cpus).cpus;
  *grace_ms = GetFlag(FLAGS_shutdown_grace_ms).value;

  if (options->grpc_memory_bytes == 0) {
    return absl::InvalidArgumentError(
        "--grpc-memory-bytes: '0' is not a positive integer; give the bytes of gRPC's memory "
        "quota for calls in progress");
  }
  if (options->peer_metadata_share_percent == 0 || options->peer_metadata_share_percent > 100) {
    return absl::InvalidArgumentError(fmt::format(
        "--peer-metadata-share: {} is not a percentage from 1 to 100; give the share of this "
        "agent's time one peer's metadata may take (100: no pacing)",
        options->peer_metadata_share_percent));
  }
  if (options->transfer_timeout_ms == 0 || options->transfer_timeout_ms > 600000) {
    return absl::InvalidArgumentError(fmt::format(
        "--transfer-timeout-ms: {} is not from 1 to 600000 (10 minutes, the longest deadline "
        "a transfer may have)",
        options->transfer_timeout_ms));
  }
  if (options->ended_transfers_kept == 0 || options->ended_transfers_kept > 1000000) {
    return absl::InvalidArgumentError(fmt::format(
        "--ended-transfers-kept: {} is not from 1 to 1000000 (ended transfers kept for "
        "queries; default 10000)",
        options->ended_transfers_kept));
  }
  if (options->grpc_max_threads == 0) {
    return absl::InvalidArgumentError("--grpc-max-threads: give at least 1");
  }
  RETURN_IF_ERROR(kvagent::CheckCpusAllowed(options->worker_cpus, "--worker-cpus"));
  if (GetFlag(FLAGS_copy_lanes).given) {
    RETURN_IF_ERROR(kvagent::agent::ValidateCopyLanes(options->copy_lanes));
  }
  // Process-wide, read at the first device copy or status; unset, KVAGENT_DEVICE_COPY
  // (or auto) decides.
  if (const DeviceCopyFlag device_copy = GetFlag(FLAGS_device_copy); device_copy.given) {
    kvagent::agent::SetDeviceCopyChoice(device_copy.choice);
  }
  auto level = kvagent::log::ParseLevel(GetFlag(FLAGS_log_level));
  if (!level.ok()) {
    return absl::InvalidArgumentError(fmt::format("--log-level: {}", level.status().message()));
  }
  kvagent::log::SetLevel(*level);

  kvagent::agent::AccessPolicy& policy = options->policy;
  // The agent's own user administers it and is its same-host peers' user.
  auto engines = Uids(GetFlag(FLAGS_engine_uids), "--engine-uids", policy.engine_uids);
  auto schedulers = Uids(GetFlag(FLAGS_scheduler_uids), "--scheduler-uids", {geteuid()});
  auto peers = Uids(GetFlag(FLAGS_peer_uids), "--peer-uids", {geteuid()});
  for (const auto* uids : {&engines, &schedulers, &peers}) {
    if (!uids->ok()) return uids->status();
  }
  // Given, even as "none", engines are those listed: "none" means nobody, not everybody.
  if (GetFlag(FLAGS_engine_uids).given) policy.any_engine_uid = false;
  policy.engine_uids = *std::move(engines);
  policy.scheduler_uids = *std::move(schedulers);
  policy.peer_uids = *std::move(peers);
  policy.scheduler_identities =
      kvagent::agent::ParseIdentityList(GetFlag(FLAGS_scheduler_identities));
  if (const GivenList identities = GetFlag(FLAGS_peer_identities); identities.given) {
    policy.any_peer_identity = identities.text == "*";
    if (!policy.any_peer_identity) {
      policy.peer_identities = kvagent::agent::ParseIdentityList(identities.text);
    }
  }

  for (int i = 0; i < kvagent::agent::kLimitCount; ++i) {
    const std::string_view flag =
        kvagent::agent::InfoOf(static_cast<kvagent::agent::Limit>(i)).flag;
    const absl::CommandLineFlag* defined =
        absl::FindCommandLineFlag(absl::string_view(flag.data() + 2, flag.size() - 2));
    if (defined == nullptr) {
      return absl::InternalError(
          fmt::format("limit flag {} is not defined in agent/main.cc (a build defect)", flag));
    }
    if (const std::string value = defined->CurrentValue(); !value.empty()) {
      RETURN_IF_ERROR(options->limits.SetFromFlag(flag, value));
    }
  }
  return kvagent::agent::ValidateStagingOptions(options->staging);
}

}  // namespace

int main(int argc, char** argv) {
  // Debian's Abseil is built without NDEBUG, so every Mutex lock records its place in a
  // lock-order graph (extra bookkeeping and futex traffic on the transfer path: 20 %
  // of the futex calls per fast path transfer). The daemon does without it; the unit
  // tests, which link the same classes in-process, keep it as the checker it is.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  const std::string usage = Usage();
  if (AsksForHelp(argc, argv)) {
    std::fwrite(usage.data(), 1, usage.size(), stdout);
    return 0;
  }
  // A --help inside a --flagfile reaches Abseil: it prints the same text (and no
  // per-file list of flags).
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view) { return false; };
  usage_config.contains_helpshort_flags = [](absl::string_view) { return false; };
  absl::SetFlagsUsageConfig(usage_config);

  parsing = !OnlyChecksArgs(argc, argv);
  std::atexit(ReportRefusedFlags);
  const std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  parsing = false;
  if (positional.size() > 1) {
    return Fail(fmt::format(
        "unexpected argument '{}': kvagentd takes only flags, as --flag VALUE or --flag=VALUE",
        positional[1]));
  }

  kvagent::agent::AgentOptions options;
  uint32_t grace_ms = 0;
  if (absl::Status flags = ReadFlags(&options, &grace_ms); !flags.ok()) {
    return Fail(std::string(flags.message()));
  }
  kvagent::registry::ShmMapping::SetWarming(absl::GetFlag(FLAGS_warm_mappings).on);
  kvagent::registry::ShmMapping::SetMappedBytesBound(absl::GetFlag(FLAGS_max_mapped_bytes).value);
  if (absl::GetFlag(FLAGS_check_flags)) {
    std::printf("kvagentd: flags accepted; agent '%s' not started (--check-flags)\n",
                options.name.c_str());
    return 0;
  }

  // Block the stop signals before any thread starts so only sigwait sees them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  // Read (and unset) while this is the only thread: unsetenv beside threads that read
  // the environment (UCX, gRPC) would race them.
  options.systemd = kvagent::agent::SystemdNotifier::FromEnvironment();
  // Before any UCX context: what a peer holding the worker address may make UCX do
  // here is cut down to what kvagent uses (transport/ucx_hardening.h).
  if (absl::Status hardened = kvagent::transport::HardenUcxForPeers(); !hardened.ok()) {
    const char* unhardened = std::getenv("KVAGENT_UCX_UNHARDENED");
    if (unhardened == nullptr || std::string_view(unhardened) != "1") {
      std::fprintf(stderr, "kvagentd: cannot start: %s\n",
                   std::string(hardened.message()).c_str());
      return 1;
    }
    std::fprintf(stderr,
                 "kvagentd: WARNING: running with UCX unhardened (KVAGENT_UCX_UNHARDENED=1): "
                 "%s\n",
                 std::string(hardened.message()).c_str());
  }
  // UCX's TCP transport lets whoever connects write anywhere in this process (UCT's
  // put request): a local process may connect only as a peer uid, the agent's own or
  // root (the trusted ones, docs/SECURITY.md), before any worker listens.
  {
    std::set<uid_t> allowed = options.policy.peer_uids;
    allowed.insert(geteuid());
    allowed.insert(0);
    kvagent::transport::GuardUcxTcpAccepts(std::move(allowed),
                                           options.ucx_tcp_remote_any
                                               ? kvagent::transport::RemoteUcxTcp::kAny
                                               : kvagent::transport::RemoteUcxTcp::kPeers);
  }
  // What a peer that posts software puts and gets without reading the replies may hold.
  kvagent::transport::SetHeldRepliesPerEndpoint(options.ucx_held_replies);
  // How many endpoints peers' wireup requests and checks may have UCX make.
  kvagent::transport::SetPeerEndpointCap(options.ucx_peer_endpoints);
  // The biggest fragmented active message a peer may send that this agent's handlers
  // take: a staged chunk (the larger of StagerOptions::max_chunk_message and this
  // agent's chunk) with its header (InboxLimits::max_staged_header_bytes); in all, four
  // of them or the default, the larger.
  {
    kvagent::transport::AmAssemblyLimits limits;
    limits.max_message_bytes =
        std::max<uint64_t>(kvagent::agent::StagerOptions{}.max_chunk_message,
                           options.staging.chunk_bytes) +
        kvagent::agent::InboxLimits{}.max_staged_header_bytes;
    limits.max_bytes = std::max(limits.max_bytes, 4 * limits.max_message_bytes);
    kvagent::transport::SetAmAssemblyLimits(limits);
  }
  // Memory a peer's software get was served from is retired, not unmapped, while the
  // reply may still wait in UCX (RetireMapping; it unmaps nothing itself when unhardened).
  kvagent::registry::ShmMapping::SetRetire(&kvagent::transport::RetireMapping);
  auto agent = kvagent::agent::Agent::Start(options);
  if (!agent.ok()) {
    std::fprintf(stderr, "kvagentd: cannot start: %s\n",
                 std::string(agent.status().message()).c_str());
    return 1;
  }
  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  (*agent)->Shutdown(absl::Milliseconds(grace_ms));
  agent->reset();
  return 0;
}
