// kvagentd: parses flags, starts the Agent, and waits for SIGTERM/SIGINT.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <string_view>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "agent/agent.h"
#include "fmt/format.h"
#include "transport/base/log.h"

namespace {

constexpr std::string_view kUsage = R"(usage: kvagentd --name NAME [flags]

  --name NAME                 agent name, unique among its peers (required)

 Doors (see docs/SECURITY.md):
  --local-socket PATH         the local door: gRPC on PATH, sessions on PATH.session
                              (default /run/kvagent/kvagent.sock)
  --local-socket-group GROUP  group of both sockets (name or gid); with mode 0660 its
                              members may attach
  --local-socket-mode OCTAL   mode of both sockets (default 0660)
  --max-sessions N            local sessions attached at once (default 1024)
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
                              `kvagentctl agents` lists the fleet. Default: none (peers by
                              address only)
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
  --peer-refresh-ms N         how often peers are polled for changes and liveness (default 200)
  --ucx-error-mode MODE       auto|peer|none (default auto: none for same-host peers,
                              whose shared-memory transports UCX 1.13 disables under
                              peer error handling; peer otherwise)
  --shm-direct auto|off       auto (default): map a same-host peer's shared memory and
                              copy into it directly; off: move all data through UCX
  --vram-staging auto|off     VRAM when UCX lacks CUDA: auto (default) registers it for
                              same-host CUDA IPC copies ("staged" path); off refuses it
  --staging-buffers N         host staging: bounce buffers per direction (default 8)
  --staging-chunk-bytes N     host staging: bytes of one bounce buffer, the chunk size
                              (default 4194304)
  --deregister-wait-ms N      how long DeregisterRegions waits for polling peers to see
                              the change, and for this agent's transfers that use the
                              regions to drain (default 2000)
  --drain-timeout-ms N        a transfer that ended with operations posted to a peer
                              reports drain_unknown if they are not confirmed by then
                              (default 5000)
  --shutdown-grace-ms N       on SIGTERM, how long running transfers may finish (default 5000)
  --subscription-ttl-ms N     a notification subscription with no watch, poll or ack for
                              this long is dropped; what it held unacknowledged goes
                              back to the queue (default 600000)
  --grpc-memory-bytes N       gRPC's memory quota for calls in progress, all doors
                              (default 536870912)
  --grpc-max-threads N        gRPC's thread quota (default 256)
  --fast-path on|off          on (default): local sessions may open a submission and a
                              completion ring in shared memory (OpenFastPathRequest)
  --fast-path-spin-us N       how long the fast path's thread polls the rings after the
                              last entry before it sleeps on their doorbells (default 50)
  --ucx-spin-us N             how long the UCX progress thread polls after work before
                              it sleeps (default 0: at once; polling pays only where
                              cores are spare: on 2 shared cores 50 us made one-page
                              transfers 30 % slower)
  --copy-lanes N              threads that copy one batch of same-host host memory side
                              by side (1-64; default: the cores this agent may use, at
                              most 4)
)";

std::string Usage() { return std::string(kUsage) + kvagent::agent::Limits::Usage(); }

int Fail(const std::string& message) {
  std::fprintf(stderr, "kvagentd: %s\n%s", message.c_str(), Usage().c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using kvagent::agent::ErrorModeChoice;
  kvagent::agent::AgentOptions options;
  uint32_t grace_ms = 5000;
  bool scheduler_uids_set = false;
  bool peer_uids_set = false;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      const std::string usage = Usage();
      std::fwrite(usage.data(), 1, usage.size(), stdout);
      return 0;
    }
    if (arg == "--stage-host-regions") {
      // Hidden, for tests only: host regions take the staged path (memcpy stands in for
      // the device copy), so the staging protocol runs on machines without a GPU.
      options.stage_host_regions = true;
      continue;
    }
    std::string_view key = arg;
    std::string value;
    if (auto eq = arg.find('='); eq != std::string_view::npos) {
      key = arg.substr(0, eq);
      value = std::string(arg.substr(eq + 1));
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return Fail(fmt::format("flag {} needs a value", arg));
    }
    auto uids = [&](std::set<uid_t>* out) {
      auto parsed = kvagent::agent::ParseUidList(value, key);
      if (!parsed.ok()) std::exit(Fail(std::string(parsed.status().message())));
      *out = *std::move(parsed);
    };
    auto number = [&](uint32_t* out) {
      if (!absl::SimpleAtoi(value, out)) {
        std::exit(Fail(fmt::format("flag {}: '{}' is not a non-negative integer", key, value)));
      }
    };
    if (key == "--name") {
      options.name = value;
    } else if (key == "--listen") {
      options.listen = value;
    } else if (key == "--insecure-listen") {
      options.insecure_listen = value;
    } else if (key == "--local-socket") {
      options.local_socket = value;
    } else if (key == "--local-socket-group") {
      options.local_socket_group = value;
    } else if (key == "--local-socket-mode") {
      char* end = nullptr;
      const unsigned long mode = std::strtoul(value.c_str(), &end, 8);
      if (value.empty() || *end != '\0' || mode > 0777) {
        return Fail(fmt::format("--local-socket-mode '{}': give an octal mode such as 0660", value));
      }
      options.local_socket_mode = static_cast<uint32_t>(mode);
    } else if (key == "--max-sessions") {
      number(&options.max_sessions);
    } else if (key == "--tls-cert") {
      options.tls.cert = value;
    } else if (key == "--tls-key") {
      options.tls.key = value;
    } else if (key == "--tls-ca") {
      options.tls.ca = value;
    } else if (key == "--engine-uids") {
      uids(&options.policy.engine_uids);
      options.policy.any_engine_uid = false;  // "none" means nobody, not everybody
    } else if (key == "--scheduler-uids") {
      uids(&options.policy.scheduler_uids);
      scheduler_uids_set = true;
    } else if (key == "--peer-uids") {
      uids(&options.policy.peer_uids);
      peer_uids_set = true;
    } else if (key == "--scheduler-identities") {
      options.policy.scheduler_identities = kvagent::agent::ParseIdentityList(value);
    } else if (key == "--peer-identities") {
      options.policy.any_peer_identity = value == "*";
      if (!options.policy.any_peer_identity) {
        options.policy.peer_identities = kvagent::agent::ParseIdentityList(value);
      }
    } else if (key == "--shm-dirs") {
      options.shm_dirs = absl::StrSplit(value, ',', absl::SkipEmpty());
    } else if (key == "--data-interface") {
      options.data_interface = value;
    } else if (key == "--directory") {
      options.directory.url = value;
    } else if (key == "--directory-prefix") {
      options.directory.prefix = value;
    } else if (key == "--directory-ttl-s") {
      number(&options.directory.ttl_s);
    } else if (key == "--metrics-listen") {
      options.metrics.listen = value;
    } else if (key == "--metrics-listen-any") {
      if (value != "on" && value != "off") {
        return Fail(fmt::format("--metrics-listen-any '{}': use on or off", value));
      }
      options.metrics.allow_any = value == "on";
    } else if (key == "--metrics-max-connections") {
      number(&options.metrics.max_connections);
    } else if (key == "--health-listen") {
      options.health_listen = value;
    } else if (key == "--port-file") {
      options.port_file = value;
    } else if (key == "--log-level") {
      auto level = kvagent::log::ParseLevel(value);
      if (!level.ok()) return Fail(std::string(level.status().message()));
      kvagent::log::SetLevel(*level);
    } else if (key == "--transfer-timeout-ms") {
      number(&options.transfer_timeout_ms);
    } else if (key == "--peer-refresh-ms") {
      number(&options.peer_refresh_ms);
    } else if (key == "--vram-staging") {
      if (value != "auto" && value != "off") {
        return Fail(fmt::format("--vram-staging '{}': use auto or off", value));
      }
      options.vram_staging = value == "auto";
    } else if (key == "--staging-buffers") {
      number(&options.staging.buffers);
    } else if (key == "--staging-chunk-bytes") {
      if (!absl::SimpleAtoi(value, &options.staging.chunk_bytes)) {
        return Fail(fmt::format("flag {}: '{}' is not a non-negative integer", key, value));
      }
    } else if (key == "--stage-host-regions") {
      if (value != "on" && value != "off") {
        return Fail(fmt::format("--stage-host-regions '{}': use on or off (tests only)", value));
      }
      options.stage_host_regions = value == "on";
    } else if (key == "--deregister-wait-ms") {
      number(&options.deregister_wait_ms);
    } else if (key == "--drain-timeout-ms") {
      number(&options.drain_timeout_ms);
    } else if (key == "--subscription-ttl-ms") {
      number(&options.subscription_ttl_ms);
    } else if (key == "--shutdown-grace-ms") {
      number(&grace_ms);
    } else if (key == "--grpc-memory-bytes") {
      if (!absl::SimpleAtoi(value, &options.grpc_memory_bytes) || options.grpc_memory_bytes == 0) {
        return Fail(fmt::format("flag {}: '{}' is not a positive integer", key, value));
      }
    } else if (key == "--fast-path") {
      if (value != "on" && value != "off") {
        return Fail(fmt::format("--fast-path '{}': use on or off", value));
      }
      options.fast_path = value == "on";
    } else if (key == "--fast-path-spin-us") {
      number(&options.fast_path_spin_us);
    } else if (key == "--ucx-spin-us") {
      number(&options.ucx_spin_us);
    } else if (key == "--copy-lanes") {
      number(&options.copy_lanes);
      if (absl::Status lanes = kvagent::agent::ValidateCopyLanes(options.copy_lanes); !lanes.ok()) {
        return Fail(std::string(lanes.message()));
      }
    } else if (key == "--grpc-max-threads") {
      number(&options.grpc_max_threads);
      if (options.grpc_max_threads == 0) return Fail("--grpc-max-threads: give at least 1");
    } else if (absl::Status limit = options.limits.SetFromFlag(key, value);
               limit.code() != absl::StatusCode::kNotFound) {
      if (!limit.ok()) return Fail(std::string(limit.message()));
    } else if (key == "--shm-direct") {
      if (value != "auto" && value != "off") {
        return Fail(fmt::format("--shm-direct '{}': use auto or off", value));
      }
      options.shm_direct = value == "auto";
    } else if (key == "--ucx-error-mode") {
      if (value == "auto") {
        options.error_mode = ErrorModeChoice::kAuto;
      } else if (value == "peer") {
        options.error_mode = ErrorModeChoice::kPeer;
      } else if (value == "none") {
        options.error_mode = ErrorModeChoice::kNone;
      } else {
        return Fail(fmt::format("--ucx-error-mode '{}': use auto, peer or none", value));
      }
    } else {
      return Fail(fmt::format("unknown flag {}", key));
    }
  }

  // The agent's own user administers it and is its same-host peers' user.
  if (!scheduler_uids_set) options.policy.scheduler_uids = {geteuid()};
  if (!peer_uids_set) options.policy.peer_uids = {geteuid()};

  // Block the stop signals before any thread starts so only sigwait sees them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  if (absl::Status staging = kvagent::agent::ValidateStagingOptions(options.staging);
      !staging.ok()) {
    return Fail(std::string(staging.message()));
  }
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
