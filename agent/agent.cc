#include "agent/agent.h"

#include <pthread.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/strings/str_join.h"
#include "agent/doctor.h"
#include "agent/status_util.h"
#include "agent/unix_listener.h"
#include "base/cpu_list.h"
#include "base/format.h"
#include "base/interfaces.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "base/text.h"
#include "fmt/format.h"
#include "grpcpp/grpcpp.h"
#include "transport/ucx_tcp_guard.h"

namespace kvagent::agent {
namespace {
constexpr log::Logger kLog("agent");
constexpr log::Logger kAudit("audit");

std::string ReadBootId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << port << "\n";
    if (!out) {
      return absl::FailedPreconditionError(fmt::format(
          "--port-file {}: cannot write {}; choose a writable path", path, tmp));
    }
  }
  // Rename so a reader never sees a half-written file.
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::FailedPreconditionError(
        fmt::format("--port-file {}: cannot rename {} into place", path, tmp));
  }
  return absl::OkStatus();
}
// The interface that holds `host` (an IP literal; "localhost" counts as 127.0.0.1), for
// UCX_NET_DEVICES; "" when the host is a wildcard or no interface has it.
std::string InterfaceOf(std::string host) {
  if (!host.empty() && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (host == "localhost") host = "127.0.0.1";
  unsigned char want[16];
  int family = AF_INET;
  if (inet_pton(AF_INET, host.c_str(), want) != 1) {
    family = AF_INET6;
    if (inet_pton(AF_INET6, host.c_str(), want) != 1) return "";
  }
  const size_t size = family == AF_INET ? 4 : 16;
  bool wildcard = true;
  for (size_t i = 0; i < size; ++i) wildcard = wildcard && want[i] == 0;
  if (wildcard) return "";
  return InterfaceHolding(family, want).value_or("");
}

std::string HostOf(const std::string& address) {
  return address.substr(0, address.rfind(':'));
}

// UCX's TCP transport listens on every interface it is allowed: restrict it to the
// data interface(s) (an explicit UCX_NET_DEVICES in the environment wins).
void RestrictUcxInterfaces(const AgentOptions& options) {
  std::string devices = options.data_interface;
  if (devices.empty()) {
    const std::string& door = !options.listen.empty() ? options.listen : options.insecure_listen;
    // Without a network door every peer is on this host: loopback is enough.
    devices = door.empty() ? "lo" : InterfaceOf(HostOf(door));
  }
  if (const char* env = std::getenv("UCX_NET_DEVICES"); env != nullptr) {
    kLog.Info("UCX_NET_DEVICES={} from the environment (--data-interface {} not applied)", env,
              devices.empty() ? "(default)" : devices);
    return;
  }
  if (devices.empty()) {
    kLog.Warn("UCX's TCP transport listens on every interface: the network door listens on a "
              "wildcard address; name the data interface(s) with --data-interface (e.g. eth0 "
              "or mlx5_0:1)");
    return;
  }
  setenv("UCX_NET_DEVICES", devices.c_str(), 1);
  kLog.Info("UCX data path restricted to interface(s) {}", devices);
}

absl::Status CheckSocketPath(const std::string& path) {
  if (path.empty()) {
    return absl::InvalidArgumentError(
        "--local-socket is empty; give a path for the local door (default "
        "/run/kvagent/kvagent.sock)");
  }
  const size_t limit = sizeof(sockaddr_un::sun_path) - 1;
  // The session socket adds ".session".
  if (path.size() + 8 > limit) {
    return absl::InvalidArgumentError(fmt::format(
        "--local-socket {} is {} bytes; with '.session' it must fit the {} bytes of a Unix "
        "socket path: choose a shorter path",
        path, path.size(), limit));
  }
  return absl::OkStatus();
}
}  // namespace

absl::StatusOr<std::unique_ptr<Agent>> Agent::Start(const AgentOptions& options) {
  RETURN_IF_ERROR(ValidateStagingOptions(options.staging));
  if (options.copy_lanes != 0) RETURN_IF_ERROR(ValidateCopyLanes(options.copy_lanes));
  if (options.name.empty()) {
    return absl::InvalidArgumentError(
        "--name is empty; give this agent a name unique among its peers (e.g. the host and "
        "GPU: node3-gpu0)");
  }
  RETURN_IF_ERROR(CheckSocketPath(options.local_socket));
  if (!options.listen.empty()) {
    if (options.tls.empty()) {
      return absl::InvalidArgumentError(fmt::format(
          "--listen {} is the mutual-TLS network door and needs --tls-cert, --tls-key and "
          "--tls-ca (the cluster CA); without certificates use only the local door, or "
          "--insecure-listen on a network where everyone is trusted",
          options.listen));
    }
    RETURN_IF_ERROR(CheckTlsFiles(options.tls, "kvagentd"));
  } else if (!options.tls.empty()) {
    RETURN_IF_ERROR(CheckTlsFiles(options.tls, "kvagentd"));
  }
  RestrictUcxInterfaces(options);
  // Announced to peers, whose UCX TCP guard then keeps connections from them.
  const char* ucx_devices = std::getenv("UCX_NET_DEVICES");
  std::vector<std::string> data_addresses =
      AddressesOfDevices(ucx_devices != nullptr ? ucx_devices : "");
  if (data_addresses.size() > transport::kMaxHostsPerOwner) {
    kLog.Warn("the data interface(s) {} hold {} addresses; peers take the first {} ({}) as "
              "those this agent's UCX connects from: name the data interface with "
              "--data-interface",
              ucx_devices != nullptr ? ucx_devices : "(all)", data_addresses.size(),
              transport::kMaxHostsPerOwner, absl::StrJoin(data_addresses, ","));
    data_addresses.resize(transport::kMaxHostsPerOwner);
  }

  std::unique_ptr<Agent> agent(new Agent());
  Agent* self = agent.get();
  agent->options_ = options;
  agent->identity_.name = options.name;
  agent->identity_.incarnation = std::random_device{}() | (uint64_t{std::random_device{}()} << 32);
  agent->identity_.host_id = ReadBootId();
  agent->identity_.start_us = MonotonicMicros();
  agent->identity_.local_socket = options.local_socket;
  agent->path_policy_.allowed_dirs = options.shm_dirs;

  ASSIGN_OR_RETURN(agent->context_, transport::UcxContext::Create());
  const auto& caps = agent->context_->capabilities();
  kLog.Info("UCX {}: transports [{}], memory types [{}]", caps.version,
            absl::StrJoin(caps.transports, ","), absl::StrJoin(caps.memory_types, ","));
  ASSIGN_OR_RETURN(agent->worker_,
                   transport::UcxWorker::Create(*agent->context_, "ucx-" + options.name,
                                                options.ucx_spin_us, options.worker_cpus));
  if (!options.worker_cpus.empty()) {
    kLog.Info("UCX progress thread kept on CPUs {} (--worker-cpus)",
              FormatCpuList(options.worker_cpus));
  }
  registry::RegistryOptions registry_options;
  registry_options.vram_staging = options.vram_staging;
  registry_options.stage_host_regions = options.stage_host_regions;
  agent->registry_ =
      std::make_unique<registry::RegionRegistry>(agent->context_.get(), registry_options);
  agent->limits_ = options.limits;
  agent->quota_ = std::make_unique<grpc::ResourceQuota>("kvagentd-" + options.name);
  agent->quota_->Resize(options.grpc_memory_bytes);
  agent->quota_->SetMaxThreads(static_cast<int>(options.grpc_max_threads));
  agent->streams_ = std::make_unique<StreamTable>(&agent->limits_);
  agent->notifications_ = std::make_unique<NotificationQueue>(&agent->limits_);
  agent->notifications_->set_subscription_ttl_ms(options.subscription_ttl_ms);
  // A caller dropped from the table (gone quiet) no longer vouches for hosts on UCX's
  // TCP port.
  agent->watchers_ = std::make_unique<MetadataWatchers>(
      /*recent_ms=*/5000, options.ucx_tcp_host_ttl_ms, [](const std::string& caller) {
        transport::ForgetUcxTcpHosts(transport::UcxTcpCallerOwner(caller));
      });
  // Off, WatchMetadata answers UNIMPLEMENTED, so peers poll this agent as it polls them.
  if (options.metadata_push) agent->push_ = std::make_unique<MetadataPush>();
  PeerManagerOptions peer_options;
  peer_options.self_name = options.name;
  peer_options.data_addresses = data_addresses;
  peer_options.incarnation = agent->identity_.incarnation;
  peer_options.host_id = agent->identity_.host_id;
  peer_options.error_mode = options.error_mode;
  peer_options.refresh_ms = options.peer_refresh_ms;
  peer_options.metadata_push = options.metadata_push;
  peer_options.shm_direct = options.shm_direct;
  peer_options.allow_rendezvous = options.allow_rendezvous;
  peer_options.max_memory_objects = options.max_peer_memory_objects;
  peer_options.metadata_share_percent = options.peer_metadata_share_percent;
  peer_options.metadata_burst_ms = options.peer_metadata_burst_ms;
  peer_options.liveness = options.liveness;
  peer_options.link.tls = options.tls;
  peer_options.link.insecure = !options.insecure_listen.empty();
  peer_options.link.peer_uids = options.policy.peer_uids;
  agent->pings_ = std::make_unique<EndpointPings>(agent->worker_.get(), &agent->counters_);
  agent->peers_ = std::make_unique<PeerManager>(agent->worker_.get(), peer_options,
                                                agent->pings_.get());
  if (!options.directory.url.empty()) {
    ASSIGN_OR_RETURN(agent->directory_, Directory::Create(options.directory));
    agent->directory_->SetListener(
        [self](const std::string& name, const directory::AgentRecord* before,
               const directory::AgentRecord* now) {
          NoteHeapActivity();
          self->OnDirectoryChange(name, before, now);
        });
  }
  StagerOptions stager_options;
  stager_options.self_name = options.name;
  stager_options.incarnation = agent->identity_.incarnation;
  stager_options.pool = options.staging;
  stager_options.reply_timeout_ms = options.drain_timeout_ms;
  stager_options.verify_peer = [self](std::string_view from, std::string_view secret) {
    return self->secrets_.Verify(from, secret);
  };
  stager_options.on_dropped = [self] {
    NoteHeapActivity();
    self->counters_.dropped_peer_messages.fetch_add(1);
  };
  stager_options.eager_only_from = [self](std::string_view from) {
    return self->peers_->EndpointLacksNativeRma(from);
  };
  agent->stager_ = std::make_unique<Stager>(
      agent->worker_.get(), agent->context_.get(), agent->registry_.get(), stager_options,
      [self](v1::Notification n, absl::Status data) {
        self->engine_->StagedDataInPlace(std::move(n), std::move(data));
      });
  agent->transfer_metrics_ = std::make_unique<TransferMetrics>();
  IncomingOptions incoming_options;
  incoming_options.self_name = options.name;
  incoming_options.max_finished = options.ended_transfers_kept;
  incoming_options.on_ended = [metrics = agent->transfer_metrics_.get()](
                                  const v1::TransferState& state) {
    // Transfers that arrive start no call here: their end is this agent's activity.
    NoteHeapActivity();
    metrics->IncomingEnded(state);
  };
  agent->incoming_ = std::make_unique<IncomingTransfers>(
      incoming_options, agent->registry_.get(), agent->notifications_.get(),
      // Through the Inbox (made below, before any DATA_READY can arrive): it holds the
      // acknowledgements of a notification batch and answers them as one.
      [self](const transport::ReplyEndpoint& reply_ep, const wire::TransferAck& ack) {
        self->inbox_->SendAck(reply_ep, ack);
      });
  TransferEngineOptions engine_options;
  engine_options.self_name = options.name;
  engine_options.default_timeout_ms = options.transfer_timeout_ms;
  engine_options.ucx_cuda = caps.cuda_memory;
  engine_options.incarnation = agent->identity_.incarnation;
  engine_options.stager = agent->stager_.get();
  engine_options.secrets = &agent->secrets_;
  engine_options.counters = &agent->counters_;
  engine_options.incoming = agent->incoming_.get();
  engine_options.drain_timeout_ms = options.drain_timeout_ms;
  engine_options.max_finished = options.ended_transfers_kept;
  engine_options.limits = &agent->limits_;
  engine_options.metrics = agent->transfer_metrics_.get();
  engine_options.copy_lanes =
      options.copy_lanes != 0 ? options.copy_lanes : DefaultCopyLanes();
  kLog.Info("same-host host copies: {} copy lane(s)", engine_options.copy_lanes);
  agent->engine_ = std::make_unique<TransferEngine>(
      agent->worker_.get(), agent->registry_.get(), agent->peers_.get(),
      agent->notifications_.get(), engine_options);
  agent->engine_->Start();
  agent->stager_->Start();
  // Everything peers send arrives through the Inbox (agent/inbox.cc has the table).
  agent->inbox_ = std::make_unique<Inbox>(agent->worker_.get(), &agent->secrets_,
                                          &agent->counters_, options.name);
  agent->inbox_->SetEagerOnlyFrom(
      [self](std::string_view from) { return self->peers_->EndpointLacksNativeRma(from); });
  agent->inbox_->Install(agent->engine_.get(), agent->stager_.get(), agent->pings_.get());
  // A lost peer fails its transfers at once instead of at their deadline. The engine
  // outlives the peer manager's callers: peers stop in Shutdown, before the engine
  // is destroyed.
  agent->peers_->SetLossListener(
      [engine = agent->engine_.get()](const PeerLoss& loss) {
        NoteHeapActivity();
        engine->FailPeer(loss);
      });

  agent->deps_ = ServiceDeps{&agent->identity_,
                             agent->context_.get(),
                             agent->worker_.get(),
                             agent->registry_.get(),
                             agent->peers_.get(),
                             agent->engine_.get(),
                             agent->notifications_.get(),
                             agent->incoming_.get(),
                             agent->watchers_.get(),
                             nullptr,
                             &agent->options_.policy,
                             &agent->path_policy_,
                             &agent->secrets_,
                             &agent->counters_,
                             &agent->open_streams_,
                             &agent->limits_,
                             agent->streams_.get(),
                             &agent->pending_connects_,
                             options.deregister_wait_ms};
  agent->deps_.directory = agent->directory_.get();
  agent->deps_.push = agent->push_.get();
  agent->deps_.releases = &agent->releases_;
  agent->deps_.wire_features = kWireFeatures & options.wire_features;
  agent->deps_.data_addresses = data_addresses;

  // Before the first door: each door's server gets gRPC's health service, which the
  // monitor keeps NOT_SERVING until UCX answers (Start below).
  agent->health_ = std::make_unique<HealthMonitor>(agent->worker_.get());
  agent->deps_.health = agent->health_.get();
  // A receive queue that never drains (transport::ReceiveStall): the worker answers
  // heartbeats, but no peer's message reaches it. Not live: only a restart helps.
  agent->health_->AddCondition("ucx-receive", [worker = agent->worker_.get()]() -> absl::Status {
    const uint64_t since = worker->receive_stalled_since_us();
    if (since == 0) return absl::OkStatus();
    return absl::UnavailableError(fmt::format(
        "the UCX receive queue has not drained for {} s: a same-host peer most likely died "
        "or was stopped while writing into this agent's shared-memory receive queue, which "
        "UCX 1.13 cannot recover from; no peer's message arrives until this agent restarts "
        "(restart it; a stopped peer that resumes unblocks it)",
        (MonotonicMicros() - since) / 1000000));
  });
  agent->worker_->SetReceiveStallListener([health = agent->health_.get()] { health->Recheck(); });
  if (agent->directory_) {
    // Not ready while peers cannot find this agent; still live (kvagent.liveness), so a
    // lost etcd does not get every agent of the fleet restarted.
    agent->health_->AddCondition(
        "directory",
        [directory = agent->directory_.get()]() -> absl::Status {
          DirectoryState state = directory->State();
          if (state.published) return absl::OkStatus();
          return absl::UnavailableError(fmt::format(
              "this agent's record is not held in etcd ({}): {}; peers cannot find it by "
              "name until it is",
              state.endpoints, state.last_error.empty() ? "publishing" : state.last_error));
        },
        /*readiness_only=*/true);
    // Its lease won or lost: health follows at once, not at the monitor's next round.
    agent->directory_->SetStateListener([health = agent->health_.get()] { health->Recheck(); });
  }
  agent->deps_.transfer_metrics = agent->transfer_metrics_.get();

  // The fast path submits and cancels exactly as the gRPC methods do.
  FastPathOptions fast_options;
  fast_options.spin_us = options.fast_path_spin_us;
  fast_options.features = options.fast_path_features;
  FastPathBackend backend;
  backend.submit = [self](const v1::SubmitTransferRequest& request, const Caller& caller,
                          FastPathBackend::Done done) {
    NoteHeapActivity();  // as IdentifyCaller does for a gRPC call
    // As gRPC's `wait`: the last chunk answers when the transfer ends, others when taken.
    SubmitTransfer(self->deps_, request, caller, /*wait=*/!request.more_chunks(),
                   std::move(done));
  };
  backend.cancel = [self](const std::string& transfer_id, const Caller& caller) {
    return self->engine_->Cancel(transfer_id, caller);
  };
  backend.notifications = agent->notifications_.get();
  agent->fast_path_ = std::make_unique<FastPathServer>(fast_options, std::move(backend));
  agent->fast_path_->Start(agent->worker_.get());  // entries taken on the UCX thread
  agent->deps_.fast_path = agent->fast_path_.get();

  // The local door: sessions first (their tokens open the gRPC socket), then gRPC.
  LocalDoorOptions door_options;
  if (options.fast_path) door_options.fast_path = agent->fast_path_.get();
  door_options.policy = options.policy;
  door_options.agent_name = options.name;
  door_options.incarnation = agent->identity_.incarnation;
  door_options.limits = &agent->limits_;
  agent->releaser_ = std::thread([self] { self->RunReleaser(); });
  agent->local_door_ = std::make_unique<LocalDoor>(
      door_options, agent->registry_.get(), &agent->counters_,
      // A session that ends takes its regions with it (after peers let go of them).
      [self](const Caller& caller) { self->ReleaseSession(caller); });
  agent->deps_.local_door = agent->local_door_.get();
  // A registration whose session closed before it committed fails instead of leaving
  // regions nobody owns (ReleaseSession may already have run).
  agent->registry_->SetOwnerCheck([door = agent->local_door_.get()](const std::string& owner) {
    return door->Ended(owner);
  });
  SessionServerOptions session_options;
  session_options.path = options.local_socket + ".session";
  session_options.mode = options.local_socket_mode;
  session_options.group = options.local_socket_group;
  session_options.max_sessions = options.max_sessions;
  // Ended sessions hold their regions until released: they count against the limit.
  session_options.releasing = [self] { return self->releases_.sessions(); };
  ASSIGN_OR_RETURN(agent->session_server_,
                   SessionServer::Start(session_options, agent->local_door_.get()));
  agent->deps_.session_server = agent->session_server_.get();

  // gRPC creates its socket with the process umask: the session socket's mode and
  // group are applied right after (a caller that slips in between still needs a
  // session token for any call).
  RETURN_IF_ERROR(PrepareUnixSocketPath(options.local_socket));
  // The liveness door before the gRPC doors (its socket beside the local door's): the
  // first GetMetadata announces it.
  if (options.liveness) {
    LivenessDoorOptions liveness;
    const std::string& network =
        !options.listen.empty() ? options.listen : options.insecure_listen;
    if (!network.empty()) {
      liveness.udp_host = HostOf(network);
      liveness.udp_port = options.liveness_port;
    } else if (options.liveness_port != 0) {
      // No network door: a port given opens UDP on loopback (kvagentctl bench-peers'
      // fake peers ping it; a Unix datagram socket queues only
      // /proc/sys/net/unix/max_dgram_qlen pings, 10 by default, between two reads).
      liveness.udp_host = "127.0.0.1";
      liveness.udp_port = options.liveness_port;
    }
    liveness.unix_path = LivenessUnixPath(options.local_socket);
    if (liveness.unix_path.size() >= sizeof(sockaddr_un::sun_path)) {
      kLog.Warn("the liveness socket path {} is longer than a Unix socket path may be: "
                "same-host peers poll this agent for liveness instead (use a shorter "
                "--local-socket)",
                liveness.unix_path);
      liveness.unix_path.clear();
    }
    liveness.incarnation = agent->identity_.incarnation;
    ASSIGN_OR_RETURN(agent->liveness_, LivenessDoor::Start(liveness));
    agent->deps_.liveness = agent->liveness_.get();
    // Who may write to it is who may use the local door: another user's junk could
    // fill its small queue (max_dgram_qlen) and crowd out peers' pings.
    if (!liveness.unix_path.empty()) {
      RETURN_IF_ERROR(SetUnixSocketAccess(liveness.unix_path, options.local_socket_mode,
                                          options.local_socket_group));
    }
  }

  RETURN_IF_ERROR(agent->StartDoor(Door::kLocal, "unix:" + options.local_socket,
                                   grpc::InsecureServerCredentials()));
  RETURN_IF_ERROR(SetUnixSocketAccess(options.local_socket, options.local_socket_mode,
                                      options.local_socket_group));
  agent->identity_.network_door = "none";
  if (!options.listen.empty()) {
    ASSIGN_OR_RETURN(auto credentials, MakeServerCredentials(options.tls));
    RETURN_IF_ERROR(agent->StartDoor(Door::kNetwork, options.listen, credentials));
  }
  if (!options.insecure_listen.empty()) {
    RETURN_IF_ERROR(agent->StartDoor(Door::kInsecure, options.insecure_listen,
                                     grpc::InsecureServerCredentials()));
    agent->insecure_warning_ = std::thread([self] { self->WarnInsecure(); });
  }
  if (!options.health_listen.empty()) {
    ASSIGN_OR_RETURN(agent->health_door_,
                     StartHealthDoor(options.health_listen, agent->quota_.get()));
    agent->identity_.health_address = agent->health_door_->address;
    agent->health_->Follow(agent->health_door_->server->GetHealthCheckService());
  }
  // Under systemd (Type=notify): READY=1 once serving (below), STOPPING=1 at Shutdown,
  // a STATUS= line as health changes, and with WatchdogSec= a WATCHDOG=1 from every
  // health round while kvagent.liveness holds, rounds at most a third of it apart: a
  // stalled worker or receive queue gets the agent restarted, as a liveness probe would.
  agent->systemd_ = options.systemd;
  if (agent->systemd_) {
    const absl::Duration watchdog = agent->systemd_->watchdog();
    kLog.Info("systemd: notifying {}; {}", agent->systemd_->socket(),
              watchdog > absl::ZeroDuration()
                  ? fmt::format("watchdog {} (WATCHDOG=1 while kvagent.liveness holds)",
                                absl::FormatDuration(watchdog))
                  : std::string("no watchdog (WatchdogSec= not set)"));
    agent->health_->SetWatchdog(
        watchdog > absl::ZeroDuration() ? watchdog / 3 : absl::InfiniteDuration(),
        [notifier = agent->systemd_.get()](bool live, const std::string& status) {
          notifier->Health(live, status);
        });
  }
  agent->health_->Start();
  if (!options.metrics.listen.empty()) {
    ASSIGN_OR_RETURN(agent->metrics_, MetricsServer::Start(options.metrics, [self] {
                       return RenderMetrics({&self->deps_, self->transfer_metrics_.get(),
                                             self->stager_.get(), self->metrics_.get()});
                     }));
    agent->identity_.metrics_address = agent->metrics_->address();
  }
  agent->peers_->StartMonitor();
  if (agent->directory_) {
    directory::AgentRecord record;
    record.set_name(options.name);
    record.set_address(agent->identity_.listen_address);
    record.set_local_socket("unix:" + options.local_socket);
    record.set_host(agent->identity_.host_id);
    record.set_incarnation(agent->identity_.incarnation);
    record.set_metadata_version(agent->registry_->version());
    agent->directory_->Start(std::move(record));
  }
  agent->heap_trimmer_ = std::make_unique<HeapTrimmer>();
  kLog.Info("heap allocator: {}", HeapAllocatorName());
  if (!options.port_file.empty()) RETURN_IF_ERROR(WritePortFile(options.port_file, agent->port_));
  kLog.Info("agent '{}' serving: local door {} (sessions {}.session), network door {} (pid {}, "
            "incarnation {:x})",
            options.name, options.local_socket, options.local_socket,
            agent->identity_.network_door, getpid(), agent->identity_.incarnation);
  // The same checks `kvagentctl doctor` runs; also loads the CUDA driver once, off the
  // RPC path.
  DoctorInputs doctor;
  doctor.agent = options.name;
  doctor.ucx = &caps;
  doctor.device_copy = TransferEngine::device_copy_mode();
  LogDoctorReport(RunDoctor(doctor));
  if (agent->systemd_) (void)agent->systemd_->Notify("READY=1\n");
  return agent;
}

absl::Status Agent::StartDoor(Door door, const std::string& address,
                              std::shared_ptr<grpc::ServerCredentials> credentials) {
  DoorServer d;
  d.door = door;
  d.agent_service = std::make_unique<AgentService>(door, deps_);
  d.peer_service = std::make_unique<PeerService>(door, deps_);
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, std::move(credentials), door == Door::kLocal ? nullptr : &port);
  builder.RegisterService(d.agent_service.get());
  builder.RegisterService(d.peer_service.get());
  AddReflection(&builder);
  builder.SetMaxReceiveMessageSize(64 << 20);
  // Fairness: one quota of memory (and threads) for calls in progress on every door,
  // and at most kMaxCallsPerConnection calls at once per client connection (more
  // wait in the client's HTTP/2 flow, they are not refused).
  builder.SetResourceQuota(*quota_);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kMaxCallsPerConnection);
  // Peers' HTTP/2 keepalive pings (their liveness check of this agent) are welcome.
  AllowPeerKeepalive(&builder);
  d.server = builder.BuildAndStart();
  const std::string flag = door == Door::kLocal      ? "--local-socket"
                           : door == Door::kNetwork ? "--listen"
                                                     : "--insecure-listen";
  if (!d.server || (door != Door::kLocal && port == 0)) {
    return absl::UnavailableError(fmt::format(
        "{} {}: cannot listen there (address in use, not local, malformed, or a directory "
        "that is not writable); use {}",
        flag, address,
        door == Door::kLocal ? "a writable path (the directory is created if missing)"
                             : "HOST:PORT with a free port, or port 0 to pick one"));
  }
  health_->Follow(d.server->GetHealthCheckService());
  if (door != Door::kLocal) {
    d.address = fmt::format("{}:{}", HostOf(address), port);
    // The first network door is the one peers are told about.
    if (port_ == 0) {
      port_ = port;
      identity_.listen_address = d.address;
      identity_.network_door = fmt::format("{} {}", DoorName(door), d.address);
    }
  } else {
    d.address = address;
  }
  doors_.push_back(std::move(d));
  return absl::OkStatus();
}

void Agent::ReleaseSession(const Caller& caller) {
  // After Shutdown stopped the releaser, what the session held goes with the agent.
  releases_.Add(caller.principal, absl::Now());
}

void Agent::RunReleaser() {
  pthread_setname_np(pthread_self(), "releaser");
  while (std::optional<SessionReleases::Ended> next = releases_.Take()) {
    ReleaseNow(next->principal, next->ended);
    releases_.Done();
  }
}

void Agent::ReleaseNow(const std::string& principal, absl::Time ended) {
  NoteHeapActivity();  // a session's calls and streams ended with it
  // Everything the session holds, gathered under the registry's writer lock: a
  // registration of it still running either committed before (and goes now) or fails
  // (SetOwnerCheck: the door closed the session before calling here), and a region
  // of it deregistered meanwhile (its own DeregisterRegions in flight, a scheduler's)
  // does not stop the rest. A list taken first and deregistered by name missed both.
  // Then as DeregisterAndWait: the memory stays mapped until our transfers using it
  // drained and polling peers hold the new version, or the waits end.
  auto retired = std::make_shared<std::vector<registry::RegionPtr>>();
  const uint64_t version = registry_->DeregisterOwner(principal, retired.get());
  const absl::Duration waited = absl::Now() - ended;
  if (waited >= absl::Seconds(1)) {
    // Behind a registration holding the registry (or earlier releases): the sessions
    // thread went on serving meanwhile.
    kLog.Info("{} ended {} ms ago; its release waited for the registry until now",
              principal, absl::ToInt64Milliseconds(waited));
  }
  if (retired->empty()) return;
  kLog.Info("{} ended: deregistered its {} regions (version {}); releasing them once peers "
            "let go",
            principal, retired->size(), version);
  if (deps_.push != nullptr) deps_.push->Changed();  // watching peers drain and acknowledge
  const ServiceDeps* d = &deps_;
  deps_.engine->StopUsersOf(
      *retired, principal, absl::Milliseconds(deps_.deregister_wait_ms),
      [d, version, retired, principal](std::vector<std::string> draining) {
        for (const auto& id : draining) {
          kLog.Warn("transfer '{}' using a region of ended {} had not drained within the "
                    "wait; its memory stays mapped until it does",
                    id, principal);
        }
        d->watchers->WaitForVersion(
            version, d->deregister_wait_ms, [retired](std::vector<std::string> unconfirmed) {
              for (const auto& name : unconfirmed) {
                kLog.Warn("peer '{}' had not picked up the deregistration within the wait; "
                          "its late writes, if any, may reach released memory",
                          name);
              }
              retired->clear();
            });
      });
}

void Agent::WarnInsecure() {
  absl::MutexLock lock(&stop_mu_);
  while (!stopping_) {
    kLog.Warn("INSECURE: --insecure-listen {} accepts calls from anyone who reaches it, with "
              "every right (read and write every registered region, deregister, cancel, read "
              "notifications); use the mutual-TLS door (--listen with --tls-*) outside a "
              "trusted test network",
              options_.insecure_listen);
    stop_cv_.WaitWithTimeout(&stop_mu_, absl::Minutes(1));
  }
}

void Agent::OnDirectoryChange(const std::string& name, const directory::AgentRecord* before,
                              const directory::AgentRecord* now) {
  if (absl::IsNotFound(peers_->Get(name).status())) return;  // not a peer of ours
  DirectoryEvent event;
  event.listed = now != nullptr;
  if (now != nullptr) {
    event.again = before == nullptr;
    event.incarnation = now->incarnation();
    absl::StatusOr<std::string> address = DialAddress(*now, identity_.host_id);
    if (address.ok()) {
      event.address = *std::move(address);
    } else {
      event.address_error = std::string(address.status().message());
    }
  }
  FollowDirectory(name, std::move(event));
}

void Agent::FollowDirectory(const std::string& name, DirectoryEvent event) {
  {
    absl::MutexLock lock(&directory_events_mu_);
    auto [it, first] = directory_events_.try_emplace(name);
    if (!first) {
      it->second = std::move(event);  // handled once the running one ends
      return;
    }
  }
  if (HandleDirectoryEvent(name, event)) DirectoryEventDone(name);
}

bool Agent::HandleDirectoryEvent(const std::string& name, const DirectoryEvent& event) {
  auto known = peers_->Get(name);
  if (absl::IsNotFound(known.status())) return true;  // disconnected meanwhile
  const uint64_t installed = known.ok() ? (*known)->incarnation : 0;
  if (event.listed && known.ok() && installed == event.incarnation) return true;
  std::string why =
      event.listed
          ? fmt::format("it restarted (the directory lists incarnation {:x} instead of {:x})",
                        event.incarnation, installed)
          : "its record left the directory (its etcd lease expired: the agent stopped, or "
            "lost etcd for longer than its TTL)";
  if (!known.ok()) {  // already unreachable: nothing to ask
    peers_->MarkGone(name, installed, why);
    return ReconnectFromDirectory(name, event);
  }
  // A peer that died refuses at once; one that is stopped or hung does not answer
  // within the deadline. Either way it is failed as before, a little later.
  constexpr uint32_t kAskMs = 2000;
  peers_->AskIncarnation(
      name, kAskMs,
      [this, name, event, installed, why = std::move(why)](absl::StatusOr<uint64_t> answer) {
        if (absl::IsNotFound(answer.status())) {  // disconnected meanwhile
          DirectoryEventDone(name);
          return;
        }
        if (answer.ok() && *answer == installed) {
          static LogBudget budget(4);
          uint64_t skipped = 0;
          if (budget.Take(&skipped)) {
            kAudit.Warn("the directory says of peer '{}' that {}, but incarnation {:x} still "
                        "answers at its address: it stays connected (whoever can write the "
                        "directory's prefix in etcd can write such a record){}",
                        Printable(name), why, installed,
                        skipped > 0 ? fmt::format(" ({} such lines skipped)", skipped) : "");
          }
          DirectoryEventDone(name);
          return;
        }
        peers_->MarkGone(name, installed,
                         answer.ok() ? fmt::format("{}, and incarnation {:x} answers at its "
                                                   "address",
                                                   why, *answer)
                                     : fmt::format("{}, and {}", why, answer.status().message()));
        if (ReconnectFromDirectory(name, event)) DirectoryEventDone(name);
      });
  return false;
}

bool Agent::ReconnectFromDirectory(const std::string& name, const DirectoryEvent& event) {
  if (!event.listed) return true;
  if (event.address.empty()) {
    kLog.Warn("peer '{}' is back but cannot be reconnected: {}", Printable(name),
              event.address_error);
    return true;
  }
  // Both come from the directory (etcd): escaped where they are logged.
  kLog.Info("peer '{}' {} (incarnation {:x}); reconnecting at {}", Printable(name),
            event.again ? "is listed again" : "restarted", event.incarnation,
            Printable(event.address, 256));
  peers_->Connect(event.address, [this, name](absl::StatusOr<v1::PeerInfo> info) {
    if (!info.ok()) {
      kLog.Warn("reconnecting peer '{}': {}", Printable(name), info.status().message());
    }
    DirectoryEventDone(name);
  });
  return false;
}

void Agent::DirectoryEventDone(const std::string& name) {
  // A loop, not a recursion: events handled at once follow one another here.
  for (;;) {
    bool stopping;
    {
      absl::MutexLock lock(&stop_mu_);
      stopping = stopping_;
    }
    DirectoryEvent next;
    {
      absl::MutexLock lock(&directory_events_mu_);
      auto it = directory_events_.find(name);
      if (it == directory_events_.end()) return;
      // While stopping, PeerManager answers at once (under its own locks): nothing more.
      if (stopping || !it->second.has_value()) {
        directory_events_.erase(it);
        return;
      }
      next = *std::move(it->second);
      it->second.reset();
    }
    if (!HandleDirectoryEvent(name, next)) return;  // its callback goes on from there
  }
}

void Agent::Shutdown(absl::Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  kLog.Info("agent '{}' shutting down", options_.name);
  {
    absl::MutexLock lock(&stop_mu_);
    stopping_ = true;
    stop_cv_.SignalAll();
  }
  if (systemd_) (void)systemd_->Notify("STOPPING=1\nSTATUS=shutting down\n");
  // Probes see NOT_SERVING at once, while transfers still drain.
  if (health_) health_->Stop();
  // Peers learn at once that this incarnation is leaving (the lease is revoked).
  if (directory_) directory_->Stop();
  if (insecure_warning_.joinable()) insecure_warning_.join();
  if (heap_trimmer_) heap_trimmer_->Stop();
  // No new fast path entries; completions of what runs still reach open rings.
  if (fast_path_) fast_path_->Stop();
  // Transfers finish first (their notifications need the worker, not gRPC).
  if (engine_) engine_->Stop(grace);
  if (stager_) stager_->Stop();
  // No new sessions; the ones open end without releasing regions (all go below).
  if (session_server_) session_server_->Stop();
  // A release running finishes; queued ones are dropped (their regions go below).
  if (const size_t dropped = releases_.Stop(); dropped > 0) {
    kLog.Info("{} ended sessions' regions go with the agent (it is stopping)", dropped);
  }
  if (releaser_.joinable()) releaser_.join();
  // Transfers had their grace above and handlers never block: 100 ms lets answers in
  // flight go out, then calls still open (watch streams) are cancelled. With 1 s, a
  // SIGTERM during a transfer measured grace + 1.0 s to exit; with 100 ms, grace + 0.12 s.
  for (auto& d : doors_) {
    d.server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  }
  if (health_door_) health_door_->server->Shutdown(std::chrono::system_clock::now());
  if (metrics_) metrics_->Stop();
  if (peers_) peers_->Stop();
  liveness_.reset();  // after the doors: no peer is told about it any more
  if (!options_.local_socket.empty()) unlink(options_.local_socket.c_str());
}

Agent::~Agent() {
  Shutdown(absl::ZeroDuration());
  doors_.clear();
  session_server_.reset();
  local_door_.reset();
  fast_path_.reset();
  // The worker progresses UCX until it is destroyed: from here on, what peers send is
  // dropped unread (a message must never reach an object being torn down).
  if (inbox_) inbox_->Silence();
  // Peer views (endpoints, keys) die on the worker thread, so before the worker.
  if (engine_) engine_->ReleasePeers();
  // The worker runs its last closures and completions (flushes, sends, staged chunks)
  // into the engine, the Stager, the receiving side and the peer manager, so they all
  // go after it.
  worker_.reset();
  engine_.reset();
  stager_.reset();
  incoming_.reset();
  peers_.reset();
  pings_.reset();  // its timers and sends ended with the worker
  push_.reset();  // after the doors: no stream is left to push to
  watchers_.reset();
  registry_.reset();
  context_.reset();
}

}  // namespace kvagent::agent
