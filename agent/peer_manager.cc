#include "agent/peer_manager.h"

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "agent/access.h"
#include "agent/am_ids.h"
#include "agent/status_util.h"
#include "base/format.h"
#include "base/interfaces.h"
#include "base/log.h"
#include "fmt/format.h"
#include "grpcpp/grpcpp.h"
#include "registry/cuda_vmm_mapping.h"
#include "registry/device_memory_object.h"
#include "transport/ucx_hardening.h"
#include "transport/ucx_tcp_guard.h"

namespace kvagent::agent {
namespace {
constexpr log::Logger kLog("peers");
constexpr log::Logger kAudit("audit");

// Who asks (informational), and the data addresses this agent's UCX connects from, which
// the peer then lets through its UCX TCP guard (transport/ucx_tcp_guard.h).
void Stamp(const PeerManagerOptions& options, v1::GetMetadataRequest* request) {
  request->set_caller(options.self_name);
  request->clear_data_addresses();
  for (const std::string& address : options.data_addresses) request->add_data_addresses(address);
}

// One GetMetadata call to a peer, kept alive until its callback ran.
struct MetadataCall {
  grpc::ClientContext context;
  v1::GetMetadataRequest request;
  v1::AgentMetadata reply;
  std::shared_ptr<PeerLink> link;
};

void SetDeadline(grpc::ClientContext* context, uint32_t ms) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms));
}

// gRPC's default reconnect backoff grows to 120 s; a peer restarted on the same
// address would then look dead for minutes. A poll fails fast while the channel
// backs off, so keep the backoff near the poll period.
constexpr int kReconnectBackoffInitialMs = 200;
constexpr int kReconnectBackoffMaxMs = 1000;
// gRPC takes GRPC_ARG_MIN_RECONNECT_BACKOFF_MS as the least time one connection attempt
// gets, its HTTP/2 handshake included (not as a backoff). At 200 ms, a peer too busy to
// answer that handshake within 200 ms (eight senders streaming into it on two cores)
// failed ConnectPeer and polls with UNAVAILABLE although it was up; a refused
// connection still fails at once and is retried after the backoff above.
constexpr int kConnectAttemptMs = 5000;
}  // namespace

grpc::ChannelArguments PeerChannelArgs(bool keepalive) {
  grpc::ChannelArguments args;
  if (keepalive) {
    // A connection that died without a reset (a host gone) ends the watch's stream: a
    // ping every kPeerKeepaliveTimeMs, with or without a call, however long no data
    // came (gRPC's defaults stop pinging after two pings without data and space them 5
    // minutes apart). A hung peer is the liveness door's to see, far sooner.
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kPeerKeepaliveTimeMs);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kPeerKeepaliveTimeoutMs);
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    args.SetInt(GRPC_ARG_HTTP2_MIN_SENT_PING_INTERVAL_WITHOUT_DATA_MS, kPeerKeepaliveTimeMs);
  }
  // Our own connections: gRPC's process-wide subchannel pool would hand a new channel
  // the broken connection of an old one to the same address (an agent restarted on
  // the same socket path), and its first call would fail.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, kReconnectBackoffInitialMs);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, kConnectAttemptMs);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, kReconnectBackoffMaxMs);
  args.SetMaxReceiveMessageSize(64 << 20);
  return args;
}

namespace {

constexpr char kSessionTokenKey[] = "kvagent-session";
}  // namespace

void AllowPeerKeepalive(grpc::ServerBuilder* builder) {
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Pings closer than this count as strikes (a flood); peers ping every
  // kPeerKeepaliveTimeMs now, older ones every 500 ms (kPeerKeepaliveMinRecvMs).
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                              kPeerKeepaliveMinRecvMs);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 10);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
}

// One peer's WatchMetadata stream. Reads one view at a time: the next read starts
// once the pool has applied the last (so views install in order, and a slow install
// holds the peer's pushes in HTTP/2 flow control). Holds keep OnDone away while a
// read may still be started (the read side) or a write is in flight.
class PeerManager::MetadataWatch final
    : public grpc::ClientBidiReactor<v1::GetMetadataRequest, v1::AgentMetadata> {
 public:
  MetadataWatch(PeerManager* owner, std::string name, std::shared_ptr<PeerLink> link,
                uint64_t incarnation)
      : owner_(owner), guard_(owner->guard_), name_(std::move(name)), link_(std::move(link)),
        incarnation_(incarnation) {}

  const std::string& name() const { return name_; }
  const std::shared_ptr<PeerLink>& link() const { return link_; }
  uint64_t incarnation() const { return incarnation_; }
  const grpc::ClientContext& context() const { return context_; }
  bool verified = false;  // the first view was checked (pool, one view at a time)

  void Start(std::shared_ptr<MetadataWatch> self, const v1::GetMetadataRequest& first) {
    self_ = std::move(self);
    link_->Prepare(&context_);
    link_->stub->async()->WatchMetadata(&context_, this);
    AddHold();  // the read side, released when a read fails
    Send(first);
    StartRead(&read_);
    StartCall();
  }
  // An acknowledgement (or a request for the whole catalog), after the one in flight.
  void Send(const v1::GetMetadataRequest& request) {
    absl::MutexLock lock(&mu_);
    if (writing_) {
      pending_ = request;
      has_pending_ = true;
      return;
    }
    writing_ = true;
    write_ = request;
    AddHold();
    StartWrite(&write_);
  }
  void Cancel() { context_.TryCancel(); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      RemoveHold();
      return;
    }
    absl::MutexLock lock(&guard_->mu);
    if (guard_->manager == nullptr) {
      RemoveHold();  // stopping: no more reads
      return;
    }
    auto self = self_;  // OnDone has not run: the read side's hold is held
    // Runs when the job is done or dropped (Stop): then the next read starts, or
    // fails on a cancelled call and lets the reactor finish.
    std::shared_ptr<void> turn(nullptr, [self](void*) { self->StartRead(&self->read_); });
    guard_->manager->Enqueue([manager = guard_->manager, self, reply = std::move(read_), turn] {
      const absl::Duration wait = manager->ApplyPushed(self, reply);
      // Past its budget: the next read waits (the peer's pushes meanwhile wait in
      // HTTP/2 flow control); the delayed job holds the turn.
      if (wait > absl::ZeroDuration()) manager->EnqueueAfter(wait, [turn] {});
    });
  }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (ok && has_pending_) {
        has_pending_ = false;
        writing_ = true;
        write_ = pending_;
        AddHold();
        StartWrite(&write_);
      }
    }
    RemoveHold();
  }

  void OnDone(const grpc::Status& status) override {
    std::shared_ptr<MetadataWatch> keep = std::move(self_);
    {
      absl::MutexLock lock(&guard_->mu);
      if (guard_->manager != nullptr) guard_->manager->WatchEnded(this, status);
    }
    absl::MutexLock lock(&owner_->watches_mu_);
    --owner_->live_watches_;  // the last touch of the manager: Stop waits for it
  }

 private:
  PeerManager* const owner_;
  const std::shared_ptr<CallbackGuard> guard_;
  const std::string name_;
  const std::shared_ptr<PeerLink> link_;
  const uint64_t incarnation_;
  grpc::ClientContext context_;
  std::shared_ptr<MetadataWatch> self_;  // until OnDone
  v1::AgentMetadata read_;
  absl::Mutex mu_;
  v1::GetMetadataRequest write_ ABSL_GUARDED_BY(mu_);
  v1::GetMetadataRequest pending_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool has_pending_ ABSL_GUARDED_BY(mu_) = false;
};

void PeerLink::Prepare(grpc::ClientContext* context) const {
  if (session) context->AddMetadata(kSessionTokenKey, session->token());
}

absl::Status PeerLink::Verify(const grpc::ClientContext& context,
                              const v1::AgentMetadata& reply) const {
  if (local) {
    const auto& welcome = session->welcome();
    const auto credentials = session->agent_credentials();
    if (reply.name() != welcome.agent() || reply.incarnation() != welcome.incarnation() ||
        reply.pid() != static_cast<uint32_t>(credentials.pid)) {
      return absl::PermissionDeniedError(fmt::format(
          "the agent answering at {} says it is '{}' (incarnation {:x}, pid {}) but its session "
          "socket belongs to '{}' (incarnation {:x}, pid {}); something stands between the "
          "two sockets: check who listens at that path",
          address, Printable(reply.name()), reply.incarnation(), reply.pid(),
          Printable(welcome.agent()), welcome.incarnation(), credentials.pid));
    }
    return absl::OkStatus();
  }
  if (!tls) return absl::OkStatus();  // --insecure-listen: nobody is identified
  std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !IdentityMatches(*auth, reply.name())) {
    std::vector<std::string> names = auth ? PeerIdentities(*auth) : std::vector<std::string>{};
    for (auto& n : names) n = Printable(n);
    return absl::PermissionDeniedError(fmt::format(
        "the agent at {} calls itself '{}' but its certificate names [{}]; a peer's agent name "
        "must be in its certificate (DNS subject alternative name or common name): issue it "
        "one for its --name",
        address, Printable(reply.name()), absl::StrJoin(names, ", ")));
  }
  return absl::OkStatus();
}

namespace {
// Whether `address` (HOST:PORT as dialled) is a door of this host, and the process that
// listens there when it can be found.
struct DoorOnHost {
  bool this_host = false;
  std::optional<int> pid;
};
DoorOnHost FindDoorProcess(const std::string& address) {
  bool had_port = false;
  const std::string host = HostOfDialled(address, &had_port);
  if (!had_port) return {};
  const std::string port = address.substr(address.rfind(':') + 1);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0) return {};
  DoorOnHost door;
  for (const addrinfo* a = found; a != nullptr && !door.pid.has_value(); a = a->ai_next) {
    const auto listeners = transport::UcxTcpLocalListeners(a->ai_addr, a->ai_addrlen);
    if (!listeners.has_value()) continue;
    door.this_host = true;
    door.pid = transport::ProcessListeningOn(*listeners);
  }
  ::freeaddrinfo(found);
  return door;
}
}  // namespace

absl::StatusOr<std::shared_ptr<PeerLink>> PeerManager::OpenLink(const std::string& address) const {
  auto link = std::make_shared<PeerLink>();
  link->address = address;
  if (absl::StartsWith(address, "unix:")) {
    const std::string path = address.substr(5);
    auto session = client::LocalSession::Attach(path + ".session", options_.self_name,
                                                options_.connect_timeout_ms);
    if (!session.ok()) {
      return absl::Status(session.status().code(),
                          fmt::format("peer at {}: {}", address, session.status().message()));
    }
    const uid_t uid = (*session)->agent_credentials().uid;
    if (options_.link.peer_uids.count(uid) == 0) {
      return absl::PermissionDeniedError(fmt::format(
          "peer at {}: the process listening there runs as uid {}, which is not in this "
          "agent's --peer-uids; same-host agents run as the agent user (or list its uid)",
          address, uid));
    }
    const auto& roles = (*session)->welcome().roles();
    if (std::find(roles.begin(), roles.end(), "peer") == roles.end()) {
      return absl::PermissionDeniedError(fmt::format(
          "peer at {}: agent '{}' does not accept this agent (uid {}) as a peer; run both "
          "agents as the same user, or add our uid to its --peer-uids",
          address, Printable((*session)->welcome().agent()), geteuid()));
    }
    link->local = true;
    link->same_host = transport::SameHostPeerHold((*session)->agent_credentials().pid);
    link->session = *std::move(session);
    link->channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(),
                                              PeerChannelArgs(options_.metadata_push));
  } else if (!options_.link.tls.empty()) {
    auto credentials = MakeChannelCredentials(options_.link.tls);
    if (!credentials.ok()) return credentials.status();
    link->tls = true;
    link->channel = grpc::CreateCustomChannel(address, *credentials,
                                              PeerChannelArgs(options_.metadata_push));
  } else if (options_.link.insecure) {
    link->channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(),
                                              PeerChannelArgs(options_.metadata_push));
  } else {
    return absl::FailedPreconditionError(fmt::format(
        "peer at {}: a network peer needs mutual TLS and this agent has no certificate; start "
        "it with --tls-cert, --tls-key and --tls-ca (or, on a trusted network only, "
        "--insecure-listen), or connect a same-host peer as unix:PATH",
        Printable(address, 256)));
  }
  if (!link->local) {
    // A network door of this host: its process is held as a local door's would be, so
    // that its UCX port passes the same-host TCP check; one whose process is not found
    // (another uid's) leaves that check out, as before it.
    const DoorOnHost door = FindDoorProcess(address);
    if (door.pid.has_value()) {
      kLog.Info("peer at {}: a door of this host, served by pid {}", Printable(address, 256),
                *door.pid);
      link->same_host = transport::SameHostPeerHold(*door.pid);
    } else if (door.this_host) {
      kLog.Warn("peer at {}: a door of this host whose process this agent cannot see "
                "(another uid's?): UCX's TCP connections to this host are not checked for "
                "this peer",
                Printable(address, 256));
    }
    link->tcp_checked = !door.this_host || door.pid.has_value();
  }
  link->stub = v1::Peer::NewStub(link->channel);
  return link;
}

PeerManager::PeerManager(transport::UcxWorker* worker, PeerManagerOptions options,
                         EndpointPings* pings)
    : worker_(worker), pings_(pings), options_(std::move(options)) {
  absl::MutexLock lock(&guard_->mu);
  guard_->manager = this;
}

PeerManager::~PeerManager() { Stop(); }

void PeerManager::Connect(const std::string& address,
                          std::function<void(absl::StatusOr<v1::PeerInfo>)> done) {
  absl::MutexLock lock(&connect_mu_);
  if (stopping_.load()) {
    done(absl::UnavailableError("ConnectPeer: this agent is shutting down"));
    return;
  }
  // Join the connectors that finished.
  for (auto it = connectors_.begin(); it != connectors_.end();) {
    if (it->finished->load()) {
      it->thread.join();
      it = connectors_.erase(it);
    } else {
      ++it;
    }
  }
  auto finished = std::make_shared<std::atomic<bool>>(false);
  connectors_.push_back(Connector{
      std::thread([this, address, done = std::move(done), finished]() mutable {
        ConnectNow(address, std::move(done));
        finished->store(true);
      }),
      finished});
}

void PeerManager::ConnectNow(const std::string& address,
                             std::function<void(absl::StatusOr<v1::PeerInfo>)> done) {
  auto link = OpenLink(address);
  if (!link.ok()) {
    kAudit.Warn("peer connection to {} refused: {}", Printable(address, 256),
                link.status().message());
    done(link.status());
    return;
  }
  auto call = std::make_shared<MetadataCall>();
  call->link = *std::move(link);
  Stamp(options_, &call->request);
  call->link->Prepare(&call->context);
  SetDeadline(&call->context, options_.connect_timeout_ms);
  call->link->stub->async()->GetMetadata(
      &call->context, &call->request, &call->reply,
      [this, call, address, done = std::move(done)](grpc::Status status) {
        if (!status.ok()) {
          kAudit.Warn("peer connection to {} failed: {} (gRPC code {})", Printable(address, 256),
                      Printable(status.error_message(), 256),
                      static_cast<int>(status.error_code()));
          done(absl::UnavailableError(fmt::format(
              "peer at {} did not answer GetMetadata: {} ({}); check that kvagentd runs there, "
              "that the address and port are right, and (network peers) that both agents' "
              "certificates come from the same CA",
              Printable(address, 256), status.error_message(),
              static_cast<int>(status.error_code()))));
          return;
        }
        absl::Status who = call->link->Verify(call->context, call->reply);
        if (who.ok() && call->reply.incarnation() == options_.incarnation) {
          who = absl::InvalidArgumentError(fmt::format(
              "ConnectPeer {}: that is this agent itself ('{}'); connect other agents",
              Printable(address, 256), options_.self_name));
        }
        if (!who.ok()) {
          kAudit.Warn("peer connection to {} refused: {}", Printable(address, 256), who.message());
          done(who);
          return;
        }
        kAudit.Info("peer '{}' at {} authenticated ({})", Printable(call->reply.name()),
                    Printable(address, 256),
                    call->link->local ? fmt::format("local door, uid {}",
                                                    call->link->session->agent_credentials().uid)
                    : call->link->tls ? std::string("certificate")
                                      : std::string("INSECURE: not authenticated"));
        std::shared_ptr<const PeerSnapshot> previous;
        {
          absl::MutexLock lock(&mu_);
          auto it = peers_.find(call->reply.name());
          if (it != peers_.end()) previous = it->second.snapshot;
        }
        const uint64_t version = call->reply.version();
        BuildSnapshot(call->link, call->reply, previous,
                      [this, call, version, done](
                          absl::StatusOr<std::shared_ptr<const PeerSnapshot>> snapshot) {
                        if (!snapshot.ok()) {
                          done(snapshot.status());
                          return;
                        }
                        Install(call->link, *snapshot, version,
                                RefreshCost{call->reply.ByteSizeLong(), 0, false}, call->reply);
                        OpenWatch((*snapshot)->name);
                        absl::MutexLock lock(&mu_);
                        // DisconnectPeer may have removed it since Install.
                        auto it = peers_.find((*snapshot)->name);
                        if (it == peers_.end()) {
                          done(absl::AbortedError(fmt::format(
                              "peer '{}' was disconnected while it was being connected; "
                              "connect it again",
                              (*snapshot)->name)));
                          return;
                        }
                        done(InfoLocked(it->second));
                      });
      });
}

namespace {
// A network peer's endpoint that does not finish connecting: only the peer's log and
// status name a refusal by its UCX TCP guard.
constexpr std::string_view kTcpGuardHint =
    "; over tcp, the peer's guard may have refused this host's address: its log then says "
    "'UCX TCP: refused a connection from HOST' and its ucx_tcp_refused_connections rises "
    "(this agent's UCX connects from an address it did not announce: check "
    "--data-interface or UCX_NET_DEVICES, and any NAT between the agents)";
}  // namespace

void PeerManager::BuildSnapshot(
    const std::shared_ptr<PeerLink>& link, const v1::AgentMetadata& metadata,
    std::shared_ptr<const PeerSnapshot> previous,
    std::function<void(absl::StatusOr<std::shared_ptr<const PeerSnapshot>>)> done,
    bool reuse_endpoint, std::optional<registry::AppliedDelta> delta) {
  const std::string& address = link->address;
  absl::StatusOr<registry::RemoteCatalog> catalog =
      delta ? std::move(delta->catalog) : registry::RemoteCatalog::FromMetadata(metadata);
  if (!catalog.ok()) {
    done(absl::Status(catalog.status().code(),
                      fmt::format("peer at {} sent metadata that fails validation: {}", address,
                                  catalog.status().message())));
    return;
  }
  auto snapshot = std::make_shared<PeerSnapshot>();
  snapshot->name = metadata.name();
  snapshot->address = address;
  snapshot->incarnation = metadata.incarnation();
  snapshot->worker_address = metadata.worker_address();
  // Same host only when proven: the peer answered on its local door (a Unix socket the
  // kernel vouches for). A host_id in metadata is just a claim.
  snapshot->same_host = link->local;
  snapshot->notify_secret = metadata.notify_secret();
  snapshot->wire_features = metadata.wire_features();
  if (!link->local) {
    // Its UCX may connect here (the guard keeps other hosts' connections only from
    // peers): from the addresses it announced, or the one dialled.
    // First, never cut; an IP literal or a name (which the guard ignores).
    std::vector<std::string> hosts = {HostOfDialled(address)};
    hosts.insert(hosts.end(), metadata.data_addresses().begin(), metadata.data_addresses().end());
    transport::AllowUcxTcpHosts(transport::UcxTcpDialledOwner(snapshot->name), hosts);
  }
  switch (options_.error_mode) {
    case ErrorModeChoice::kPeer: snapshot->error_mode = transport::ErrorMode::kPeer; break;
    case ErrorModeChoice::kNone: snapshot->error_mode = transport::ErrorMode::kNone; break;
    case ErrorModeChoice::kAuto:
      // UCX 1.13 refuses shared-memory transports under peer error handling, so a
      // same-host peer gets none and is watched by the agent itself.
      snapshot->error_mode =
          snapshot->same_host ? transport::ErrorMode::kNone : transport::ErrorMode::kPeer;
      break;
  }
  snapshot->catalog = std::make_shared<registry::RemoteCatalog>(*std::move(catalog));
  if (snapshot->same_host && options_.shm_direct) {
    const bool same_process = previous && previous->incarnation == snapshot->incarnation;
    std::shared_ptr<const DirectMappings> direct =
        MapDirect(*snapshot->catalog, *link, same_process ? previous->direct.get() : nullptr);
    snapshot->direct_fallbacks = direct->fallbacks;
    snapshot->direct_fallback_regions = direct->fallback_regions;
    snapshot->vmm_import_failures = direct->vmm_import_failures;
    if (direct->mapped > 0) snapshot->direct = std::move(direct);
  }
  // The packed rkey of each slot; with a delta, only the slots it brought have one
  // here (the others take previous's unpacked key, see base_slots).
  std::vector<std::string> rkeys;
  std::vector<uint32_t> base_slots;
  rkeys.reserve(snapshot->catalog->regions().size());
  if (delta) {
    base_slots = std::move(delta->base_slots);
    int next = 0;
    for (uint32_t base : base_slots) {
      rkeys.push_back(base == registry::AppliedDelta::kNew ? metadata.regions(next++).rkey()
                                                           : std::string());
    }
  } else {
    for (const auto& region : metadata.regions()) rkeys.push_back(region.rkey());
  }
  worker_->Post([this, snapshot, previous, rkeys = std::move(rkeys),
                 base_slots = std::move(base_slots), done = std::move(done), reuse_endpoint,
                 tcp_check = link->tcp_checked]() mutable {
    const bool reused = reuse_endpoint && previous &&
                        previous->incarnation == snapshot->incarnation &&
                        previous->worker_address == snapshot->worker_address &&
                        previous->error_mode == snapshot->error_mode;
    // This agent's own refusals of what peers answered on its UCX's connections
    // (any peer's), before this endpoint dials: the flush's failure names them.
    const uint64_t dialled_refused_before = transport::UcxTcpRefusedDialledConnections();
    if (reused) {
      snapshot->endpoint = previous->endpoint;
      snapshot->transports = previous->transports;
      snapshot->round_trip_us = previous->round_trip_us;
    } else if (!base_slots.empty()) {
      done(absl::FailedPreconditionError(fmt::format(
          "peer '{}': a delta keeps the previous endpoint's keys, but the endpoint must be "
          "replaced; fetch the whole catalog",
          snapshot->name)));
      return;
    } else {
      const std::string name = snapshot->name;
      const uint64_t incarnation = snapshot->incarnation;
      // UCX's TCP connections to this host must reach a port a proven peer's process
      // listens on: a same-host peer's address offering no shared memory this agent
      // reaches takes TCP on loopback, and a network peer's address names no port here.
      std::optional<transport::SameHostTcpCheck> tcp_checked;
      if (tcp_check) tcp_checked.emplace();
      // kPeer mode only: UCX saw the peer fail (often before the next poll does).
      auto endpoint = transport::Endpoint::Connect(
          *worker_, snapshot->worker_address, snapshot->error_mode,
          [guard = guard_, name, incarnation](absl::Status status) {
            kLog.Warn("peer '{}' endpoint failed: {}", name, status.message());
            absl::MutexLock lock(&guard->mu);
            if (guard->manager == nullptr) return;
            guard->manager->MarkUnreachable(
                name, incarnation, fmt::format("its UCX endpoint failed: {}", status.message()),
                /*endpoint_failed=*/true);
          });
      tcp_checked.reset();
      if (!endpoint.ok()) {
        done(absl::Status(endpoint.status().code(),
                          fmt::format("peer '{}': cannot open a UCX endpoint: {}", name,
                                      endpoint.status().message())));
        return;
      }
      if (options_.allow_rendezvous) (*endpoint)->AllowRendezvous();
      snapshot->endpoint = OwnedByWorker(worker_, *std::move(endpoint));
    }
    auto finish = [this, snapshot, previous, rkeys = std::move(rkeys),
                   base_slots = std::move(base_slots), done, reused]() {
      // After wireup the lanes are final.
      if (!reused) snapshot->transports = snapshot->endpoint->ReadLanes();
      // UCX takes its self transport only to an address naming this very worker: every
      // put and get "to that peer" would be a memcpy inside this process, to and from
      // whatever addresses its catalog names.
      const std::vector<absl::string_view> lanes = absl::StrSplit(snapshot->transports, ',');
      if (std::find(lanes.begin(), lanes.end(), "self") != lanes.end()) {
        kLog.Warn("peer '{}': refused: its UCX worker address is this agent's own",
                  snapshot->name);
        done(absl::PermissionDeniedError(fmt::format(
            "peer '{}': its UCX worker address is this agent's own (UCX reaches it by its "
            "self transport), so its catalog would direct transfers into this agent's own "
            "memory; a peer agent gives its own worker's address (GetMetadata)",
            snapshot->name)));
        return;
      }
      snapshot->am_data =
          !snapshot->endpoint->NativeRma() && (snapshot->wire_features & kWireAmData) != 0;
      auto table = std::make_unique<RkeyTable>();
      table->endpoint = snapshot->endpoint;
      const auto& regions = snapshot->catalog->regions();
      table->keys.reserve(regions.size());
      // rkey_slot is the region's index in the metadata, so keys follow that order.
      // Staged VRAM regions export no rkey: UCX cannot reach them, their slot stays empty.
      for (size_t i = 0; i < regions.size(); ++i) {
        if (!base_slots.empty() && base_slots[i] != registry::AppliedDelta::kNew) {
          table->keys.push_back(previous->keys->keys[base_slots[i]]);  // same endpoint
          continue;
        }
        if (rkeys[i].empty()) {
          table->keys.emplace_back();
          continue;
        }
        auto key = snapshot->endpoint->UnpackRkey(rkeys[i]);
        if (!key.ok()) {
          done(absl::InvalidArgumentError(fmt::format(
              "peer '{}' region '{}': its rkey does not unpack: {}; the peer's UCX may differ "
              "from ours (compare `kvagentctl status` on both)",
              snapshot->name, regions[i].name, key.status().message())));
          return;
        }
        table->keys.push_back(std::make_shared<const transport::RemoteKey>(*std::move(key)));
      }
      snapshot->keys = OwnedByWorker(worker_, std::move(table));
      snapshot->endpoint_only = EndpointOnly(*snapshot);
      done(std::shared_ptr<const PeerSnapshot>(snapshot));
    };
    if (reused) {
      finish();
      return;
    }
    // Then a round trip, for a peer that takes pings: the flush proves only the way
    // there; the pong comes the way every acknowledgement and notice of the peer's
    // comes (EndpointPings says why).
    auto ping = [this, snapshot, finish, done]() {
      if (pings_ == nullptr || (snapshot->wire_features & kWirePing) == 0) {
        kLog.Info("peer '{}' takes no pings (an older build): called connected without a "
                  "UCX round trip",
                  snapshot->name);
        finish();
        return;
      }
      pings_->Ping(*snapshot->endpoint, snapshot->name,
                   std::chrono::milliseconds(options_.connect_timeout_ms),
                   [snapshot, finish, done](absl::StatusOr<uint64_t> round_trip_us) {
                     if (!round_trip_us.ok()) {
                       done(round_trip_us.status());
                       return;
                     }
                     snapshot->round_trip_us = *round_trip_us;
                     finish();
                   });
    };
    // Finish wireup before the first data: with UCX 1.13's tcp transport, puts that
    // race the connection setup crashed the receiving worker (seen here under load).
    snapshot->endpoint->Flush([snapshot, ping, done,
                               dialled_refused_before](absl::Status flushed) {
      if (!flushed.ok()) {
        const uint64_t refused =
            transport::UcxTcpRefusedDialledConnections() - dialled_refused_before;
        std::string own_refusals;
        if (refused > 0) {
          own_refusals = fmt::format(
              "; meanwhile this agent closed {} connection(s) its UCX dialled at an answer "
              "UCT would abort on (its log: 'UCX TCP: closed a connection this agent's UCX "
              "dialled'): the peer's UCX is not one this agent's UCX 1.13 can talk to, or "
              "the peer is hostile",
              refused);
        }
        done(absl::UnavailableError(fmt::format(
            "peer '{}': the new UCX endpoint did not finish connecting: {}; check that the "
            "peer's transports are reachable from here (`kvagentctl doctor` on both){}{}",
            snapshot->name, flushed.message(), own_refusals,
            // Only the peer's log and status name a refusal by its UCX TCP guard.
            snapshot->same_host ? "" : kTcpGuardHint)));
        return;
      }
      ping();
    });
  });
}

std::shared_ptr<const DirectMappings> PeerManager::MapDirect(
    const registry::RemoteCatalog& catalog, PeerLink& link, const DirectMappings* previous) const {
  auto direct = std::make_shared<DirectMappings>();
  const auto& regions = catalog.regions();
  // previous's slots by mapping identity (a peer may export 100,000 regions).
  absl::flat_hash_map<std::string_view, size_t> previous_memory;
  absl::flat_hash_map<std::string_view, size_t> previous_cuda;
  for (size_t j = 0; previous != nullptr && j < previous->memory_keys.size(); ++j) {
    if (previous->mappings[j]) previous_memory.try_emplace(previous->memory_keys[j], j);
  }
  for (size_t j = 0; previous != nullptr && j < previous->handles.size(); ++j) {
    if (previous->cuda_mappings[j]) previous_cuda.try_emplace(previous->handles[j], j);
  }
  direct->base_by_slot.assign(regions.size(), nullptr);
  direct->mappings.resize(regions.size());
  direct->memory_keys.resize(regions.size());
  // The descriptors of the peer's memory objects this view needs and the previous
  // view did not map, fetched over the peer's session socket (never opened by name).
  absl::flat_hash_map<uint64_t, std::shared_ptr<const registry::MemoryObject>> objects;
  // The peer's objects this view may map: the first max_memory_objects, in catalog order.
  absl::flat_hash_set<uint64_t> allowed;
  for (const auto& r : regions) {
    if (r.memory_id != 0 && allowed.size() < options_.max_memory_objects) {
      allowed.insert(r.memory_id);
    }
  }
  {
    std::vector<uint64_t> wanted;
    for (const auto& r : regions) {
      if (r.memory_id == 0 || objects.contains(r.memory_id) || !allowed.contains(r.memory_id)) {
        continue;
      }
      const std::string key = fmt::format("{}:{}:{}", r.memory_id, r.memory_offset, r.length);
      auto found = previous_memory.find(key);
      if (found != previous_memory.end() && !previous->mappings[found->second]->broken()) continue;
      objects[r.memory_id] = nullptr;
      wanted.push_back(r.memory_id);
    }
    if (!wanted.empty() && link.session != nullptr) {
      auto fds = link.session->PeerMemory(wanted);
      if (!fds.ok()) {
        kLog.Warn("peer '{}': cannot get descriptors of its memory ({}); its host regions move "
                  "through UCX",
                  catalog.peer(), fds.status().message());
      } else {
        for (auto& [id, fd] : *fds) {
          auto object = registry::MemoryObject::FromDescriptor(
              std::move(fd), fmt::format("peer '{}' memory {}", catalog.peer(), id));
          if (!object.ok()) {
            kLog.Warn("peer '{}' memory {}: {}; regions in it move through UCX", catalog.peer(),
                      id, object.status().message());
            continue;
          }
          objects[id] = *std::move(object);
        }
      }
    }
  }
  direct->cuda_mappings.resize(regions.size());
  direct->handles.resize(regions.size());
  auto fallback = [&](const registry::RemoteRegion& r, std::string why) {
    kLog.Warn("peer '{}' region '{}': {}", catalog.peer(), r.name, why);
    ++direct->fallback_regions;
    if (direct->fallbacks.size() < DirectMappings::kMaxFallbacks) {
      direct->fallbacks.push_back(fmt::format("region '{}': {}", r.name, why));
    }
  };
  MapVmm(catalog, link, previous, direct.get(), fallback);
  size_t mapped = 0;
  for (size_t i = 0; i < regions.size(); ++i) {
    const registry::RemoteRegion& r = regions[i];
    if (direct->vmm_mappings[i] != nullptr) {
      ++mapped;
      continue;
    }
    if (r.cuda_vmm_id != 0) continue;  // MapVmm said why
    if (r.memory == v1::VRAM && !r.cuda_ipc_handle.empty()) {
      std::shared_ptr<registry::CudaIpcMapping> cuda;
      const std::string key = fmt::format("{}:{}:{}:{}", r.cuda_ipc_handle, r.cuda_device,
                                          r.cuda_offset, r.length);
      if (auto found = previous_cuda.find(key); found != previous_cuda.end()) {
        cuda = previous->cuda_mappings[found->second];
      }
      if (!cuda) {
        v1::CudaIpcSource source;
        source.set_ipc_handle(r.cuda_ipc_handle);
        source.set_device(r.cuda_device);
        source.set_offset(r.cuda_offset);
        auto opened = registry::CudaIpcMapping::Open(
            source, r.length, fmt::format("peer '{}' region '{}'", catalog.peer(), r.name));
        if (!opened.ok()) {
          fallback(r, fmt::format("cannot open its CUDA IPC handle here ({}); moves through "
                                  "UCX or host staging",
                                  opened.status().message()));
          continue;
        }
        cuda = std::make_shared<registry::CudaIpcMapping>(*std::move(opened));
      }
      direct->base_by_slot[i] = reinterpret_cast<uint8_t*>(cuda->device_pointer());
      direct->cuda_mappings[i] = std::move(cuda);
      direct->handles[i] = key;
      ++mapped;
      continue;
    }
    if (r.memory_id == 0) continue;
    if (!allowed.contains(r.memory_id)) {
      fallback(r, fmt::format("its memory object {} is past the {} of this peer mapped here "
                              "(--max-peer-memory-objects); moves through UCX",
                              r.memory_id, options_.max_memory_objects));
      continue;
    }
    const std::string key = fmt::format("{}:{}:{}", r.memory_id, r.memory_offset, r.length);
    std::shared_ptr<registry::ShmMapping> mapping;
    // A mapping a caught fault broke (FaultGuard) is not reused: the peer
    // re-registering the region maps its memory anew.
    if (auto found = previous_memory.find(key);
        found != previous_memory.end() && !previous->mappings[found->second]->broken()) {
      mapping = previous->mappings[found->second];
    }
    if (!mapping) {
      auto object = objects.find(r.memory_id);
      if (object == objects.end() || object->second == nullptr) continue;
      auto mapped_now = registry::ShmMapping::Map(
          object->second, r.memory_offset, r.length,
          fmt::format("peer '{}' region '{}'", catalog.peer(), r.name));
      if (!mapped_now.ok()) {
        fallback(r, fmt::format("cannot map its memory here ({}); moves through UCX",
                                mapped_now.status().message()));
        continue;
      }
      mapping = std::make_shared<registry::ShmMapping>(*std::move(mapped_now));
    }
    direct->memory_keys[i] = key;
    direct->base_by_slot[i] = static_cast<uint8_t*>(mapping->data());
    direct->mappings[i] = std::move(mapping);
    ++mapped;
  }
  direct->complete = mapped == regions.size();
  direct->mapped = mapped;
  return direct;
}

void PeerManager::MapVmm(const registry::RemoteCatalog& catalog, PeerLink& link,
                         const DirectMappings* previous, DirectMappings* direct,
                         const std::function<void(const registry::RemoteRegion&, std::string)>&
                             fallback) const {
  const auto& regions = catalog.regions();
  direct->vmm_mappings.resize(regions.size());
  direct->vmm_keys.resize(regions.size());
  // An import's identity: the peer process's allocation id with the size and device it
  // announced (a view of the same incarnation reuses the import).
  auto key_of = [](const registry::RemoteRegion& r) {
    return fmt::format("{}:{}:{}", r.cuda_vmm_id, r.cuda_vmm_bytes, r.cuda_device);
  };
  absl::flat_hash_map<std::string, std::shared_ptr<const registry::CudaVmmMapping>> imports;
  for (size_t j = 0; previous != nullptr && j < previous->vmm_keys.size(); ++j) {
    if (previous->vmm_mappings[j]) {
      imports.try_emplace(previous->vmm_keys[j], previous->vmm_mappings[j]);
    }
  }
  // Announcements that cannot be right are refused before anything is fetched.
  std::vector<uint64_t> wanted;
  absl::flat_hash_map<uint64_t, std::string> refused;  // by allocation id: why
  auto in_bounds = [](const registry::RemoteRegion& r) {
    uint64_t end = 0;
    return !__builtin_add_overflow(r.cuda_vmm_offset, r.length, &end) && end <= r.cuda_vmm_bytes;
  };
  for (const auto& r : regions) {
    if (r.cuda_vmm_id == 0) continue;
    if (!in_bounds(r)) {
      fallback(r, fmt::format("announced at CUDA VMM offset {} + length {}, past its "
                              "allocation's {} bytes; moves through host staging (the peer's "
                              "registry should have refused it: report this)",
                              r.cuda_vmm_offset, r.length, r.cuda_vmm_bytes));
      continue;
    }
    const std::string key = key_of(r);
    if (imports.contains(key) || refused.contains(r.cuda_vmm_id)) continue;
    if (std::find(wanted.begin(), wanted.end(), r.cuda_vmm_id) == wanted.end()) {
      wanted.push_back(r.cuda_vmm_id);
    }
  }
  if (!wanted.empty()) {
    absl::StatusOr<std::vector<client::LocalSession::PeerDeviceMemory>> fetched =
        link.session == nullptr
            ? absl::FailedPreconditionError("no session with it on its local door")
            : link.session->PeerDeviceMemories(wanted);
    if (!fetched.ok()) {
      for (uint64_t id : wanted) {
        refused[id] = fmt::format("cannot get the descriptor of its CUDA VMM memory {} ({})", id,
                                  fetched.status().message());
      }
    } else {
      // The first region of each allocation says what was announced.
      absl::flat_hash_map<uint64_t, const registry::RemoteRegion*> announced;
      for (const auto& r : regions) {
        if (r.cuda_vmm_id != 0) announced.try_emplace(r.cuda_vmm_id, &r);
      }
      for (auto& memory : *fetched) {
        const registry::RemoteRegion& r = *announced.at(memory.id);
        const std::string label =
            fmt::format("peer '{}' CUDA VMM memory {}", catalog.peer(), memory.id);
        if (memory.bytes != r.cuda_vmm_bytes || memory.device != r.cuda_device) {
          refused[memory.id] = fmt::format(
              "its CUDA VMM memory {} was announced as {} bytes on device {}, but its "
              "descriptor came as {} bytes on device {}",
              memory.id, r.cuda_vmm_bytes, r.cuda_device, memory.bytes, memory.device);
          continue;
        }
        auto object = registry::DeviceMemoryObject::FromDescriptor(
            std::move(memory.fd), r.cuda_device, r.cuda_vmm_bytes, label);
        // Driver errors say "region '<entry>'": the first region in it.
        const std::string entry = fmt::format("{}' of peer '{}", r.name, catalog.peer());
        absl::StatusOr<std::shared_ptr<const registry::CudaVmmMapping>> imported =
            object.ok() ? registry::CudaVmmMapping::Import(*std::move(object), entry)
                        : absl::StatusOr<std::shared_ptr<const registry::CudaVmmMapping>>(
                              object.status());
        if (!imported.ok()) {
          refused[memory.id] = fmt::format("cannot import its CUDA VMM memory {} here ({})",
                                           memory.id, imported.status().message());
          continue;
        }
        imports[key_of(r)] = *std::move(imported);
      }
    }
    direct->vmm_import_failures += refused.size();
    vmm_import_failures_total_.fetch_add(refused.size(), std::memory_order_relaxed);
  }
  for (size_t i = 0; i < regions.size(); ++i) {
    const registry::RemoteRegion& r = regions[i];
    if (r.cuda_vmm_id == 0 || !in_bounds(r)) continue;  // !in_bounds: said above
    if (auto why = refused.find(r.cuda_vmm_id); why != refused.end()) {
      fallback(r, why->second + "; moves through host staging");
      continue;
    }
    auto found = imports.find(key_of(r));
    if (found == imports.end()) {
      fallback(r, fmt::format("its CUDA VMM memory {} was announced as {} bytes on device {} "
                              "here, otherwise for other regions; moves through host staging",
                              r.cuda_vmm_id, r.cuda_vmm_bytes, r.cuda_device));
      continue;
    }
    // Checked above: offset + length within the announced size, which the import
    // mapped whole (rounded up to the granularity).
    direct->base_by_slot[i] =
        reinterpret_cast<uint8_t*>(found->second->address() + r.cuda_vmm_offset);
    direct->vmm_mappings[i] = found->second;
    direct->vmm_keys[i] = found->first;
  }
}

void PeerManager::Install(std::shared_ptr<PeerLink> link,
                          std::shared_ptr<const PeerSnapshot> snapshot, uint64_t version,
                          const RefreshCost& cost, const v1::AgentMetadata& view) {
  std::optional<PeerLoss> restarted;
  std::shared_ptr<MetadataWatch> stale;
  std::shared_ptr<PeerLink> installed_link;
  std::shared_ptr<const PeerSnapshot> installed;
  {
    absl::MutexLock lock(&mu_);
    const std::string name = snapshot->name;
    restarted = InstallLocked(std::move(link), std::move(snapshot), version, cost);
    // A stream to another address or incarnation (ConnectPeer named a new one, a
    // restart) watches what is no longer installed: the caller opens a new one.
    Peer& peer = peers_.at(name);
    if (peer.watch && (peer.watch->link() != peer.link ||
                       peer.watch->incarnation() != peer.snapshot->incarnation)) {
      stale = std::move(peer.watch);
    }
    if (peer.snapshot->incarnation == view.incarnation()) {
      peer.liveness_address = view.liveness_address();
      installed_link = peer.link;
      installed = peer.snapshot;
    }
  }
  if (stale) stale->Cancel();
  if (installed) WatchLiveness(*installed_link, *installed, view.liveness_address());
  if (restarted) NotifyLoss(*restarted);
}

void PeerManager::WatchLiveness(const PeerLink& link, const PeerSnapshot& snapshot,
                                const std::string& announced) {
  if (!prober_) return;
  absl::StatusOr<LivenessTarget> target = ResolveLivenessTarget(announced, link.address);
  if (!target.ok()) {
    // Polled for liveness instead (MonitorLoop says so once). The monitor may be asleep
    // (every peer it knew was answering): wake it, or this peer would never be polled
    // and a hang of it would go unseen (ASan's CI run of liveness_test found it).
    kLog.Debug("peer '{}': no liveness pings: {}", snapshot.name, target.status().message());
    prober_->Unwatch(snapshot.name);
    KickMonitor();
    return;
  }
  prober_->Watch(snapshot.name, snapshot.incarnation, *target, snapshot.notify_secret);
}

namespace {
// True when `now` lacks a region of `before`, or has it at another address or length.
bool RemovesRegions(const registry::RemoteCatalog& before, const registry::RemoteCatalog& now) {
  for (const auto& was : before.regions()) {
    const registry::RemoteRegion* is = now.Find(was.name);
    if (is == nullptr || is->base_address != was.base_address || is->length != was.length) {
      return true;
    }
  }
  return false;
}
}  // namespace

std::optional<PeerLoss> PeerManager::InstallLocked(std::shared_ptr<PeerLink> link,
                                                   std::shared_ptr<const PeerSnapshot> snapshot,
                                                   uint64_t version, const RefreshCost& cost) {
  const std::string address = link->address;
  Peer& peer = peers_[snapshot->name];
  // Two refreshes may race; never go back to an older view of the same incarnation.
  if (peer.snapshot && peer.snapshot->incarnation == snapshot->incarnation &&
      peer.version > version) {
    return std::nullopt;
  }
  std::optional<PeerLoss> restarted;
  if (peer.snapshot && peer.snapshot->incarnation != snapshot->incarnation) {
    restarted = PeerLoss{
        snapshot->name,
        absl::UnavailableError(fmt::format(
            "peer '{}' restarted (incarnation {:x} at {} -> {:x} at {}): the old process's "
            "memory is gone; register the new process's pool and submit again",
            snapshot->name, peer.snapshot->incarnation, peer.snapshot->address,
            snapshot->incarnation, address)),
        snapshot->incarnation};
    kLog.Warn("{}", restarted->cause.message());
  }
  if (peer.link != link) peer.link = std::move(link);
  const bool changed = !peer.snapshot || peer.version != version ||
                       peer.snapshot->incarnation != snapshot->incarnation;
  if (changed) {
    kLog.Info("peer '{}' at {}: incarnation {:x}, metadata version {}, {} regions, UCX "
              "transports {}, error mode {}, data path {}",
              snapshot->name, address, snapshot->incarnation, version,
              snapshot->catalog->regions().size(), snapshot->transports,
              transport::ErrorModeName(snapshot->error_mode),
              snapshot->direct ? "shm-direct" : "ucx");
  }
  // Only a version that removed or moved a region of the same incarnation must be
  // drained before a poll acknowledges it (RefreshOne); any other is acknowledged
  // at once, so a first poll or a version that only added regions never waits.
  if (!peer.snapshot || peer.snapshot->incarnation != snapshot->incarnation) {
    peer.drained_version = version;  // nothing was posted under this incarnation yet
  } else if (peer.drained_version == peer.version &&
             !RemovesRegions(*peer.snapshot->catalog, *snapshot->catalog)) {
    peer.drained_version = version;
  }
  peer.snapshot = std::move(snapshot);
  peer.version = version;
  peer.metadata_bytes_last = cost.bytes;
  peer.refresh_us_last = cost.micros;
  ++(cost.delta ? peer.deltas_applied : peer.full_fetches);
  peer.state = "connected";
  peer.last_error.clear();
  peer.endpoint_failed = false;
  peer.last_seen_us = MonotonicMicros();
  return restarted;
}

void PeerManager::MarkUnreachable(const std::string& name, uint64_t incarnation,
                                  const std::string& error, bool endpoint_failed) {
  std::string address;
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(name);
    if (it == peers_.end()) return;
    Peer& peer = it->second;
    // A late report about an incarnation that was replaced meanwhile.
    if (incarnation != 0 && peer.snapshot->incarnation != incarnation) return;
    address = peer.snapshot->address;
    if (peer.state == "connected") {
      kLog.Warn("peer '{}' at {} stopped answering: {}", name, address, error);
    }
    peer.state = "unreachable";
    peer.last_error = error;
    peer.endpoint_failed = peer.endpoint_failed || endpoint_failed;
  }
  KickMonitor();  // unreachable peers are polled until they answer
  // Every time, not only on the first failure: a transfer submitted just before the
  // peer was marked is caught by the next failed poll.
  NotifyLoss(PeerLoss{
      name,
      absl::UnavailableError(fmt::format(
          "peer '{}' at {} stopped answering: {}; check that its kvagentd runs (`kvagentctl "
          "--agent {} status`), then submit again (ConnectPeer its new address if it moved)",
          name, address, error, address)),
      0});
}

void PeerManager::NotifyLoss(const PeerLoss& loss) const {
  if (loss_listener_) loss_listener_(loss);
}

void PeerManager::RefreshAsync(const std::string& name, std::function<void(absl::Status)> done) {
  struct Call : MetadataCall {
    std::shared_ptr<const PeerSnapshot> previous;
  };
  auto call = std::make_shared<Call>();
  {
    absl::ReaderMutexLock lock(&mu_);
    auto it = peers_.find(name);
    if (it == peers_.end()) {
      done(absl::NotFoundError(fmt::format("peer '{}' is not connected", name)));
      return;
    }
    call->previous = it->second.snapshot;
    call->link = it->second.link;
    // Only a drained version may be acknowledged (see RefreshOne); until the monitor
    // has drained the newest, this poll names the last drained one and so refetches.
    call->request.set_known_version(it->second.drained_version == it->second.version
                                        ? it->second.version
                                        : it->second.drained_version);
    call->request.set_known_incarnation(call->previous->incarnation);
  }
  Stamp(options_, &call->request);
  call->link->Prepare(&call->context);
  SetDeadline(&call->context, options_.connect_timeout_ms);
  call->link->stub->async()->GetMetadata(
      &call->context, &call->request, &call->reply,
      [this, call, name, done = std::move(done)](grpc::Status status) {
        if (!status.ok()) {
          done(absl::UnavailableError(fmt::format("peer '{}' did not answer GetMetadata: {}", name,
                                                  status.error_message())));
          return;
        }
        absl::Status who = call->link->Verify(call->context, call->reply);
        if (who.ok() && call->reply.name() != name) {
          // Another agent now answers at this address: not the peer we refresh.
          who = absl::PermissionDeniedError(fmt::format(
              "the agent at {} now calls itself '{}', not '{}'; ConnectPeer the new agent if "
              "it is meant to replace the old one",
              call->link->address, Printable(call->reply.name()), name));
        }
        if (!who.ok()) {
          kAudit.Warn("refresh of peer '{}' refused: {}", name, who.message());
          done(who);
          return;
        }
        if (call->reply.incarnation() == call->previous->incarnation &&
            call->reply.version() == call->request.known_version()) {
          done(absl::OkStatus());
          return;
        }
        const uint64_t version = call->reply.version();
        BuildSnapshot(call->link, call->reply, call->previous,
                      [this, call, version, done](
                          absl::StatusOr<std::shared_ptr<const PeerSnapshot>> snapshot) {
                        if (!snapshot.ok()) {
                          done(snapshot.status());
                          return;
                        }
                        Install(call->link, *snapshot, version,
                                RefreshCost{call->reply.ByteSizeLong(), 0, false}, call->reply);
                        done(absl::OkStatus());
                      });
      });
}

void PeerManager::AskIncarnation(const std::string& name, uint32_t timeout_ms,
                                 std::function<void(absl::StatusOr<uint64_t>)> done) {
  auto call = std::make_shared<MetadataCall>();
  {
    absl::ReaderMutexLock lock(&mu_);
    auto it = peers_.find(name);
    if (it == peers_.end() || it->second.link == nullptr || it->second.snapshot == nullptr) {
      done(absl::NotFoundError(fmt::format("peer '{}' is not connected", Printable(name))));
      return;
    }
    call->link = it->second.link;
    call->request.set_known_version(it->second.version);
    call->request.set_known_incarnation(it->second.snapshot->incarnation);
  }
  Stamp(options_, &call->request);
  call->link->Prepare(&call->context);
  SetDeadline(&call->context, timeout_ms);
  call->link->stub->async()->GetMetadata(
      &call->context, &call->request, &call->reply,
      [call, name, done = std::move(done)](grpc::Status status) {
        if (!status.ok()) {
          done(absl::UnavailableError(fmt::format("it did not answer GetMetadata at {}: {}",
                                                  Printable(call->link->address, 256),
                                                  status.error_message())));
          return;
        }
        absl::Status who = call->link->Verify(call->context, call->reply);
        if (who.ok() && call->reply.name() != name) {
          who = absl::PermissionDeniedError(
              fmt::format("the agent at {} now calls itself '{}'",
                          Printable(call->link->address, 256), Printable(call->reply.name())));
        }
        if (!who.ok()) {
          done(who);
          return;
        }
        done(call->reply.incarnation());
      });
}

absl::StatusOr<std::shared_ptr<const PeerSnapshot>> PeerManager::Get(const std::string& name) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = peers_.find(name);
  if (it == peers_.end()) {
    std::vector<std::string> names;
    for (const auto& [n, p] : peers_) names.push_back(n);
    return absl::NotFoundError(fmt::format(
        "peer '{}' is not connected (connected: [{}]); connect it first with ConnectPeer "
        "(`kvagentctl --agent ADDR connect PEER_ADDR`)",
        name, absl::StrJoin(names, ", ")));
  }
  if (it->second.state != "connected") {
    return absl::UnavailableError(fmt::format(
        "peer '{}' at {} is {}: {}; transfers to it fail until it answers again", name,
        it->second.snapshot->address, it->second.state, it->second.last_error));
  }
  return it->second.snapshot;
}

bool PeerManager::EndpointLacksNativeRma(std::string_view name) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = peers_.find(absl::string_view(name.data(), name.size()));
  if (it == peers_.end() || it->second.snapshot == nullptr) return false;
  const auto& endpoint = it->second.snapshot->endpoint;
  return endpoint != nullptr && !endpoint->NativeRma();
}

v1::PeerInfo PeerManager::InfoLocked(const Peer& peer) const {
  v1::PeerInfo info;
  const PeerSnapshot& s = *peer.snapshot;
  info.set_name(s.name);
  info.set_address(s.address);
  info.set_incarnation(s.incarnation);
  info.set_metadata_version(peer.version);
  info.set_regions(static_cast<uint32_t>(s.catalog->regions().size()));
  info.set_error_mode(std::string(transport::ErrorModeName(s.error_mode)));
  info.set_transports(s.transports);
  info.set_ucx_round_trip_us(s.round_trip_us);
  info.set_same_host(s.same_host);
  info.set_state(peer.state);
  info.set_last_error(peer.last_error);
  // A watched peer is seen all the time: its stream is open under keepalive.
  const bool pushed = peer.watch != nullptr && peer.state == "connected";
  info.set_last_seen_ms_ago(pushed ? 0 : (MonotonicMicros() - peer.last_seen_us) / 1000);
  info.set_metadata_source(pushed ? "push"
                           : !options_.metadata_push || peer.push_unsupported ? "poll"
                                                                               : "reconnecting");
  info.set_metadata_bytes_last(peer.metadata_bytes_last);
  info.set_refresh_us_last(peer.refresh_us_last);
  info.set_deltas_applied(peer.deltas_applied);
  info.set_full_fetches(peer.full_fetches);
  info.set_metadata_views_ignored(peer.views_ignored);
  info.set_metadata_apply_us_total(peer.apply_us_total);
  info.set_metadata_paced_us_total(peer.paced_us_total);
  info.set_data_path(s.data_path());
  for (const std::string& why : s.direct_fallbacks) info.add_direct_fallbacks(why);
  info.set_direct_fallback_regions(s.direct_fallback_regions);
  info.set_vmm_import_failures(s.vmm_import_failures);
  return info;
}

std::vector<v1::PeerInfo> PeerManager::List() const {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<v1::PeerInfo> out;
  for (const auto& [name, peer] : peers_) out.push_back(InfoLocked(peer));
  std::sort(out.begin(), out.end(),
            [](const v1::PeerInfo& a, const v1::PeerInfo& b) { return a.name() < b.name(); });
  return out;
}

absl::Status PeerManager::Disconnect(const std::string& name) {
  Peer gone;
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(name);
    if (it == peers_.end()) {
      std::vector<std::string> names;
      for (const auto& [n, p] : peers_) names.push_back(n);
      return absl::NotFoundError(fmt::format(
          "DisconnectPeer: peer '{}' is not connected (connected: [{}])", Printable(name),
          absl::StrJoin(names, ", ")));
    }
    gone = std::move(it->second);
    peers_.erase(it);
  }
  if (prober_) prober_->Unwatch(name);
  if (gone.watch) gone.watch->Cancel();
  transport::ForgetUcxTcpHosts(transport::UcxTcpDialledOwner(name));
  kLog.Info("peer '{}' at {} disconnected", name, gone.snapshot->address);
  return absl::OkStatus();  // `gone` lets go of the endpoint (on the worker) and the link
}

size_t PeerManager::size() const {
  absl::ReaderMutexLock lock(&mu_);
  return peers_.size();
}

void PeerManager::StartMonitor() {
  if (options_.metadata_push && options_.liveness) {
    LivenessProberOptions liveness;
    liveness.period_ms = options_.liveness_period_ms;
    liveness.timeout_ms = options_.liveness_timeout_ms;
    liveness.retry_ms = kLivenessRetryMs;
    liveness.answer_grace_ms = std::min(options_.liveness_timeout_ms * 2 / 5, 400u);
    auto prober = LivenessProber::Start(
        liveness, [this](const std::string& name, uint64_t incarnation, const std::string& why,
                         bool ever_answered) {
          // A door that never answered proves nothing about the peer (UDP may be
          // blocked): it is polled for liveness from now on (MonitorLoop).
          if (ever_answered) {
            MarkUnreachable(name, incarnation, why, /*endpoint_failed=*/false);
          } else {
            KickMonitor();
          }
        },
        // A lost peer answers again: poll it now rather than at the next retry.
        [this](const std::string&) { KickMonitor(); });
    if (prober.ok()) {
      prober_ = *std::move(prober);
    } else {
      kLog.Warn("{}; watched peers are polled every {} ms for liveness instead",
                prober.status().message(), options_.refresh_ms);
    }
  }
  for (int i = 0; i < kPollThreads; ++i) pool_.emplace_back([this] { PoolLoop(); });
  monitor_ = std::thread([this] { MonitorLoop(); });
}

void PeerManager::Stop() {
  {
    absl::MutexLock lock(&guard_->mu);
    guard_->manager = nullptr;
  }
  prober_.reset();  // no loss reported after this
  if (!stopping_.exchange(true)) {
    {
      absl::MutexLock lock(&monitor_mu_);
      monitor_cv_.SignalAll();
    }
    if (monitor_.joinable()) monitor_.join();
  }
  std::vector<std::shared_ptr<MetadataWatch>> watches;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [name, peer] : peers_) {
      if (peer.watch) watches.push_back(std::move(peer.watch));
    }
  }
  for (auto& watch : watches) watch->Cancel();
  {
    absl::MutexLock lock(&pool_mu_);
    pool_stopping_ = true;
  }
  for (auto& t : pool_) t.join();
  pool_.clear();
  std::deque<std::function<void()>> dropped;
  std::multimap<absl::Time, std::function<void()>> dropped_later;
  {
    absl::MutexLock lock(&pool_mu_);
    dropped.swap(jobs_);
    dropped_later.swap(delayed_);
  }
  dropped.clear();  // a dropped view lets its (cancelled) stream finish
  dropped_later.clear();  // a paced read's turn too
  {
    absl::MutexLock lock(&watches_mu_);
    auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(watches_mu_) { return live_watches_ == 0; };
    watches_mu_.Await(absl::Condition(&none));
  }
  std::vector<Connector> connectors;
  {
    absl::MutexLock lock(&connect_mu_);
    connectors.swap(connectors_);
  }
  for (auto& c : connectors) c.thread.join();
  absl::flat_hash_map<std::string, Peer> peers;
  {
    absl::MutexLock lock(&mu_);
    peers.swap(peers_);
  }
}

void PeerManager::Enqueue(std::function<void()> job) {
  absl::MutexLock lock(&pool_mu_);
  if (pool_stopping_) return;  // dropped: `job` dies here
  jobs_.push_back(std::move(job));
}

void PeerManager::EnqueueAfter(absl::Duration delay, std::function<void()> job) {
  absl::MutexLock lock(&pool_mu_);
  if (pool_stopping_) return;  // dropped: `job` dies once the lock is released
  delayed_.emplace(absl::Now() + delay, std::move(job));
}

void PeerManager::PoolLoop() {
  for (;;) {
    std::function<void()> job;
    {
      absl::MutexLock lock(&pool_mu_);
      for (;;) {
        // Woken by a job, by Stop, or by a delayed job due sooner than the one waited for.
        const absl::Time due = delayed_.empty() ? absl::InfiniteFuture() : delayed_.begin()->first;
        auto ready = [this, due]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool_mu_) {
          return pool_stopping_ || !jobs_.empty() ||
                 (!delayed_.empty() && delayed_.begin()->first < due);
        };
        pool_mu_.AwaitWithDeadline(absl::Condition(&ready), due);
        if (pool_stopping_) return;
        if (!jobs_.empty()) {
          job = std::move(jobs_.front());
          jobs_.pop_front();
          break;
        }
        if (!delayed_.empty() && delayed_.begin()->first <= absl::Now()) {
          job = std::move(delayed_.begin()->second);
          delayed_.erase(delayed_.begin());
          break;
        }
      }
    }
    job();
  }
}

void PeerManager::QueuePoll(const std::string& name) {
  auto it = peers_.find(name);
  if (it == peers_.end() || it->second.polling) return;
  // Past its metadata budget: polled once it is back (the monitor polls it in a later
  // round, each refresh period, until then).
  if (it->second.paced_until_us > MonotonicMicros()) return;
  it->second.polling = true;
  Enqueue([this, name] {
    // After a change, poll again at once: that poll tells the peer we hold the new
    // version (a deregistration on the peer waits for it).
    if (RefreshOne(name)) RefreshOne(name);
    {
      absl::MutexLock lock(&mu_);
      auto it = peers_.find(name);
      if (it == peers_.end()) return;
      it->second.polling = false;
    }
    OpenWatch(name);  // when push is on and the peer answered
  });
}

void PeerManager::OpenWatch(const std::string& name) {
  auto first = std::make_unique<v1::GetMetadataRequest>();
  std::shared_ptr<MetadataWatch> watch;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_.load() || !options_.metadata_push) return;
    auto it = peers_.find(name);
    if (it == peers_.end()) return;
    Peer& peer = it->second;
    if (peer.watch || peer.push_unsupported || peer.state != "connected") return;
    watch = std::make_shared<MetadataWatch>(this, name, peer.link, peer.snapshot->incarnation);
    peer.watch = watch;
    Stamp(options_, first.get());
    first->set_known_incarnation(peer.snapshot->incarnation);
    // Only a drained version may be acknowledged (see RefreshOne); until it is, ask for
    // the whole catalog from the last drained one.
    const bool drained = peer.drained_version == peer.version;
    first->set_known_version(drained ? peer.version : peer.drained_version);
    first->set_accept_delta(drained && !peer.endpoint_failed &&
                            peer.snapshot->catalog->version() == peer.version);
  }
  {
    absl::MutexLock lock(&watches_mu_);
    ++live_watches_;
  }
  watch->Start(watch, *first);
}

void PeerManager::WatchEnded(MetadataWatch* watch, const grpc::Status& status) {
  const std::string& name = watch->name();
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(name);
    // Replaced or cancelled by this agent (Disconnect, a new address, Stop).
    if (it == peers_.end() || it->second.watch.get() != watch || stopping_.load()) return;
    it->second.watch.reset();
    if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
      kLog.Info("peer '{}' has no WatchMetadata ({}); polling it every {} ms", name,
                status.error_message(), options_.refresh_ms);
      it->second.push_unsupported = true;
      QueuePoll(name);
    }
  }
  if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
    KickMonitor();  // polled from now on
    return;
  }
  // Its process died (connection reset), hung (keepalive unanswered) or is stopping:
  // its transfers fail now; the poll reconnects it when it answers again.
  MarkUnreachable(name, watch->incarnation(),
                  fmt::format("its metadata stream ended: {} (gRPC code {})",
                              status.error_message(), static_cast<int>(status.error_code())),
                  /*endpoint_failed=*/false);
  absl::MutexLock lock(&mu_);
  QueuePoll(name);
}

absl::Duration PeerManager::ApplyPushed(const std::shared_ptr<MetadataWatch>& watch,
                                        const v1::AgentMetadata& reply) {
  const uint64_t started = MonotonicMicros();
  ApplyPushedView(watch, reply);
  return ChargeMetadata(watch->name(), MonotonicMicros() - started);
}

absl::Duration PeerManager::ChargeMetadata(const std::string& name, uint64_t cost_us) {
  const uint64_t share = options_.metadata_share_percent;
  const int64_t burst = int64_t{options_.metadata_burst_ms} * 1000;
  int64_t wait_us = 0;
  int64_t budget = 0;
  bool say = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(name);
    if (it == peers_.end()) return absl::ZeroDuration();
    Peer& peer = it->second;
    peer.apply_us_total += cost_us;
    if (share >= 100) return absl::ZeroDuration();
    const uint64_t now = MonotonicMicros();
    if (!peer.budget_started) {
      peer.budget_started = true;
      peer.budget_us = burst;
    } else {
      const int64_t refill = static_cast<int64_t>((now - peer.budget_at_us) * share / 100);
      peer.budget_us = std::min(burst, peer.budget_us + refill);
    }
    peer.budget_at_us = now;
    peer.budget_us -= static_cast<int64_t>(cost_us);
    if (peer.budget_us >= 0) {
      peer.pacing_logged = false;
      return absl::ZeroDuration();
    }
    // Refilled to zero after this long; the refill above counts the wait.
    wait_us = -peer.budget_us * 100 / static_cast<int64_t>(share);
    peer.paced_us_total += static_cast<uint64_t>(wait_us);
    peer.paced_until_us = now + static_cast<uint64_t>(wait_us);
    budget = peer.budget_us;
    say = !peer.pacing_logged;
    peer.pacing_logged = true;
  }
  if (say) {
    kLog.Warn("peer '{}': applying its metadata views took {:.1f} ms past its budget here "
              "({} ms, refilled at {}% of the time: --peer-metadata-burst-ms, "
              "--peer-metadata-share); its next view is taken in {:.1f} ms, and so on while "
              "it sends this much (PeerInfo.metadata_paced_us_total)",
              name, -budget / 1000.0, options_.metadata_burst_ms, share, wait_us / 1000.0);
  }
  return absl::Microseconds(wait_us);
}

void PeerManager::ApplyPushedView(const std::shared_ptr<MetadataWatch>& watch,
                                  const v1::AgentMetadata& reply) {
  const std::string& name = watch->name();
  const auto started = std::chrono::steady_clock::now();
  std::shared_ptr<const PeerSnapshot> previous;
  bool endpoint_failed = false;
  uint64_t held = 0;
  {
    absl::ReaderMutexLock lock(&mu_);
    auto it = peers_.find(name);
    if (it == peers_.end() || it->second.watch != watch) return;
    previous = it->second.snapshot;
    endpoint_failed = it->second.endpoint_failed;
    held = it->second.version;
  }
  const std::shared_ptr<PeerLink>& link = watch->link();
  // What this agent holds (an acknowledgement), or a request for the whole catalog.
  auto send = [&](uint64_t known_version, uint64_t incarnation, bool accept_delta) {
    v1::GetMetadataRequest request;
    Stamp(options_, &request);
    request.set_known_version(known_version);
    request.set_known_incarnation(incarnation);
    request.set_accept_delta(accept_delta);
    watch->Send(request);
  };
  if (!watch->verified) {
    absl::Status who = link->Verify(watch->context(), reply);
    if (who.ok() && reply.name() != name) {
      who = absl::PermissionDeniedError(fmt::format(
          "the agent at {} now calls itself '{}', not '{}'", link->address,
          Printable(reply.name()), name));
    }
    if (!who.ok()) {
      kAudit.Warn("metadata stream of peer '{}' refused: {}", name, who.message());
      {
        absl::MutexLock lock(&mu_);
        auto it = peers_.find(name);
        if (it != peers_.end() && it->second.watch == watch) it->second.watch.reset();
      }
      watch->Cancel();
      MarkUnreachable(name, previous->incarnation, std::string(who.message()),
                      /*endpoint_failed=*/false);
      return;
    }
    watch->verified = true;
  }
  const bool same_incarnation = reply.incarnation() == previous->incarnation;
  if (same_incarnation && !reply.delta() && reply.worker_address().empty() &&
      reply.version() == held) {
    // The unchanged form: it answered our first request, we hold its current view.
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(name);
    if (it != peers_.end() && it->second.snapshot == previous && !endpoint_failed) {
      it->second.state = "connected";
      it->second.last_error.clear();
      it->second.last_seen_us = MonotonicMicros();
    }
    return;
  }
  if (same_incarnation && !reply.delta() && !endpoint_failed && reply.version() <= held) {
    // A whole view at a version we hold (or an older one): the same catalog, or an
    // outdated one. Building it would unpack every key on the worker thread for
    // nothing; an honest peer sends the unchanged form above instead.
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(name);
    if (it != peers_.end() && it->second.watch == watch) {
      if (it->second.views_ignored++ == 0) {
        kLog.Warn("peer '{}' pushed its whole catalog at version {}, which this agent holds "
                  "(it holds {}); not rebuilt (PeerInfo.metadata_views_ignored counts them)",
                  name, reply.version(), held);
      }
    }
    return;
  }
  std::optional<registry::AppliedDelta> applied;
  if (reply.delta()) {
    absl::StatusOr<registry::AppliedDelta> delta =
        !same_incarnation ? absl::InvalidArgumentError("it is a delta for another incarnation")
        : endpoint_failed ? absl::FailedPreconditionError("its endpoint failed and is replaced")
                          : previous->catalog->ApplyDelta(reply);
    if (!delta.ok()) {
      kLog.Warn("peer '{}': pushed delta not applied: {}; asking for its whole catalog", name,
                delta.status().message());
      send(held, previous->incarnation, /*accept_delta=*/false);
      return;
    }
    applied = *std::move(delta);
  }
  absl::Notification built;
  std::shared_ptr<const PeerSnapshot> installed;
  const bool is_delta = applied.has_value();
  BuildSnapshot(
      link, reply, previous,
      [&](absl::StatusOr<std::shared_ptr<const PeerSnapshot>> snapshot) {
        if (snapshot.ok()) {
          Install(link, *snapshot, reply.version(),
                  RefreshCost{reply.ByteSizeLong(),
                              static_cast<uint64_t>(
                                  std::chrono::duration_cast<std::chrono::microseconds>(
                                      std::chrono::steady_clock::now() - started)
                                      .count()),
                              is_delta},
                  reply);
          installed = *snapshot;
        } else {
          MarkUnreachable(name, previous->incarnation, std::string(snapshot.status().message()),
                          /*endpoint_failed=*/false);
        }
        built.Notify();
      },
      /*reuse_endpoint=*/!endpoint_failed, std::move(applied));
  built.WaitForNotification();
  if (installed == nullptr) return;
  // Acknowledged once what was posted under the older view has completed.
  const uint64_t version = DrainedVersion(name, installed);
  if (version != 0) send(version, installed->incarnation, /*accept_delta=*/true);
}

void PeerManager::KickMonitor() {
  if (!options_.metadata_push) return;  // polling: a round each period, no sooner
  absl::MutexLock lock(&monitor_mu_);
  monitor_kicked_ = true;
  monitor_cv_.SignalAll();
}

void PeerManager::MonitorLoop() {
  bool idle = false;  // a first round; then, polling, one each refresh period
  while (!stopping_.load()) {
    {
      absl::MutexLock lock(&monitor_mu_);
      // With every peer watched (or none), nothing is due until a stream ends, a
      // peer is lost or one cannot be watched: those kick the monitor. Otherwise
      // (polls, retries), a round each refresh period.
      if (idle) {
        while (!monitor_kicked_ && !stopping_.load()) monitor_cv_.Wait(&monitor_mu_);
      } else {
        monitor_cv_.WaitWithTimeout(&monitor_mu_, absl::Milliseconds(options_.refresh_ms));
      }
      monitor_kicked_ = false;
    }
    if (stopping_.load()) break;
    // Watched peers need nothing here: their changes and their loss come by their
    // stream. The others (push off, a peer without the stream, one that stopped
    // answering) are polled on the pool, a few at a time, one poll per peer at once.
    std::vector<std::string> to_watch;
    std::vector<std::shared_ptr<MetadataWatch>> stale;
    bool polled = false;
    {
      absl::MutexLock lock(&mu_);
      for (auto& [name, peer] : peers_) {
        if (peer.watch && peer.watch->link() != peer.link) {
          stale.push_back(std::move(peer.watch));  // ConnectPeer gave it a new address
        }
        if (options_.metadata_push && !peer.push_unsupported && peer.state == "connected") {
          if (!peer.watch) to_watch.push_back(name);
          // Its liveness is its door's; without one that answers, a known-version poll
          // each period (as before the door: an older peer, UDP blocked).
          const bool silent = prober_ == nullptr || !prober_->Answering(name);
          if (silent != peer.liveness_polled) {
            peer.liveness_polled = silent;
            kLog.Info("peer '{}': {}", name,
                      !silent ? std::string("its liveness door answers; no more liveness polls")
                      : peer.liveness_address.empty()
                          ? fmt::format("it announces no liveness door (an older kvagentd or "
                                        "--liveness off); polled every {} ms for liveness",
                                        options_.refresh_ms)
                          : fmt::format("its liveness door ({}) does not answer (UDP blocked "
                                        "on the way?); polled every {} ms for liveness",
                                        peer.liveness_address, options_.refresh_ms));
          }
          if (!silent) continue;
        }
        QueuePoll(name);
        polled = true;
      }
    }
    idle = options_.metadata_push && !polled && to_watch.empty() && stale.empty();
    for (auto& watch : stale) watch->Cancel();
    for (const auto& name : to_watch) OpenWatch(name);
  }
}

uint64_t PeerManager::DrainedVersion(const std::string& name,
                                     const std::shared_ptr<const PeerSnapshot>& previous) {
  uint64_t version = 0;
  {
    absl::ReaderMutexLock lock(&mu_);
    auto it = peers_.find(name);
    if (it == peers_.end() || it->second.snapshot != previous) return 0;
    version = it->second.version;
    if (it->second.drained_version == version) return version;
  }
  // Reporting this version lets the peer release the memory of regions it
  // deregistered. Transfers stop posting to such regions once they see the new
  // version (TransferEngine::CheckRegionsCurrent); what was posted before must
  // complete first.
  if (!DrainPosted(previous, absl::Seconds(2))) {
    kLog.Warn("peer '{}': operations posted before its metadata version {} did not "
              "complete within 2 s; acknowledging the version anyway",
              name, version);
  }
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(name);
  if (it != peers_.end() && it->second.snapshot == previous) {
    it->second.drained_version = version;
  }
  return version;
}

bool PeerManager::DrainPosted(const std::shared_ptr<const PeerSnapshot>& snapshot,
                              absl::Duration timeout) {
  auto drained = std::make_shared<absl::Notification>();
  worker_->Post([snapshot, drained] {
    if (snapshot->endpoint == nullptr) {
      drained->Notify();
      return;
    }
    snapshot->endpoint->Flush([drained](absl::Status) { drained->Notify(); });
  });
  return drained->WaitForNotificationWithTimeout(timeout);
}

bool PeerManager::RefreshOne(const std::string& name) {
  v1::GetMetadataRequest request;
  Stamp(options_, &request);
  std::shared_ptr<const PeerSnapshot> previous;
  std::shared_ptr<PeerLink> link;
  bool endpoint_failed = false;
  {
    absl::ReaderMutexLock lock(&mu_);
    auto it = peers_.find(name);
    if (it == peers_.end()) return false;
    previous = it->second.snapshot;
    link = it->second.link;
    endpoint_failed = it->second.endpoint_failed;
    request.set_known_version(it->second.version);
    request.set_known_incarnation(previous->incarnation);
    // A delta applies to the view we hold, over the endpoint we hold.
    request.set_accept_delta(!endpoint_failed &&
                             previous->catalog->version() == it->second.version);
  }
  if (request.known_version() != 0) DrainedVersion(name, previous);
  // Detection bound: a dead peer refuses or resets the connection, so its poll fails
  // at once; a hung one (SIGSTOP, a wedged host) holds the poll until this deadline.
  // A peer is therefore marked unreachable, and its transfers failed, within
  // refresh_ms + max(5 * refresh_ms, 1000) ms of its failure: 1.2 s with the default
  // 200 ms, under the 2 s the fault-handling target asks. The deadline stays well
  // above a loaded peer's answer time, since a false alarm fails live transfers.
  auto poll = [&](grpc::ClientContext* context, v1::AgentMetadata* reply) {
    link->Prepare(context);
    // At most 5 s: a hung peer holds one of the few pool threads until then.
    SetDeadline(context, std::clamp<uint32_t>(options_.refresh_ms * 5, 1000, 5000));
    return link->stub->GetMetadata(context, request, reply);
  };
  const auto started = std::chrono::steady_clock::now();
  auto context = std::make_unique<grpc::ClientContext>();
  v1::AgentMetadata reply;
  grpc::Status status = poll(context.get(), &reply);
  if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED && link->local) {
    // A same-host peer restarted on the same path: the agent there does not know our
    // session. Attach to it (authenticated as on ConnectPeer) and ask again; its new
    // incarnation is then installed like any restart. (A dead or hung peer answers
    // UNAVAILABLE or not at all, and is marked unreachable below without waiting.)
    auto fresh = OpenLink(link->address);
    if (fresh.ok()) {
      {
        absl::MutexLock lock(&mu_);
        auto it = peers_.find(name);
        if (it == peers_.end() || it->second.snapshot != previous) return false;
        it->second.link = *fresh;
      }
      link = *std::move(fresh);
      context = std::make_unique<grpc::ClientContext>();
      reply.Clear();
      status = poll(context.get(), &reply);
    }
  }
  // False (the peer marked unreachable) unless the reply answered and comes from
  // the peer we poll.
  auto answered = [&] {
    if (!status.ok()) {
      MarkUnreachable(name, previous->incarnation,
                      fmt::format("GetMetadata failed: {} (gRPC code {})", status.error_message(),
                                  static_cast<int>(status.error_code())),
                      /*endpoint_failed=*/false);
      return false;
    }
    if (absl::Status who = link->Verify(*context, reply); !who.ok()) {
      MarkUnreachable(name, previous->incarnation, std::string(who.message()),
                      /*endpoint_failed=*/false);
      return false;
    }
    if (reply.name() != name) {
      MarkUnreachable(name, previous->incarnation,
                      fmt::format("the agent at {} now calls itself '{}'", previous->address,
                                  reply.name()),
                      /*endpoint_failed=*/false);
      return false;
    }
    return true;
  };
  if (!answered()) return false;
  // A delta is applied to the view we hold; one that does not apply (it should not
  // happen: the log is the agent's) costs a second poll for the whole catalog.
  std::optional<registry::AppliedDelta> applied;
  if (reply.delta()) {
    absl::StatusOr<registry::AppliedDelta> delta =
        reply.incarnation() == previous->incarnation
            ? previous->catalog->ApplyDelta(reply)
            : absl::InvalidArgumentError("it is a delta for another incarnation");
    if (delta.ok()) {
      applied = *std::move(delta);
    } else {
      kLog.Warn("peer '{}': {}; fetching its whole catalog", name, delta.status().message());
      request.set_accept_delta(false);
      context = std::make_unique<grpc::ClientContext>();
      reply.Clear();
      status = poll(context.get(), &reply);
      if (!answered()) return false;
    }
  }
  const uint64_t reply_bytes = reply.ByteSizeLong();
  const bool is_delta = applied.has_value();
  if (reply.incarnation() == previous->incarnation &&
      reply.version() == request.known_version() && !endpoint_failed) {
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(name);
    if (it == peers_.end()) return false;
    // Only the view this poll asked about; ConnectPeer may have replaced it meanwhile.
    if (it->second.snapshot != previous) return false;
    it->second.state = "connected";
    it->second.last_error.clear();
    it->second.last_seen_us = MonotonicMicros();
    return false;
  }
  if (reply.incarnation() == previous->incarnation && !reply.delta() &&
      reply.version() < request.known_version() && !endpoint_failed) {
    // An older whole catalog than the one we hold: not built (see ApplyPushedView).
    absl::MutexLock lock(&mu_);
    auto it = peers_.find(name);
    if (it != peers_.end() && it->second.snapshot == previous) ++it->second.views_ignored;
    return false;
  }
  // Changed (or the endpoint failed and needs replacing): rebuild the snapshot, and
  // wait for it so refreshes stay in order. Its cost is charged to the peer's budget:
  // past it, the peer's next poll waits (QueuePoll).
  const uint64_t building = MonotonicMicros();
  absl::Notification built;
  bool installed = false;
  const uint64_t version = reply.version();
  BuildSnapshot(
      link, reply, previous,
      [&](absl::StatusOr<std::shared_ptr<const PeerSnapshot>> snapshot) {
        if (snapshot.ok()) {
          Install(link, *snapshot, version,
                  RefreshCost{reply_bytes,
                              static_cast<uint64_t>(
                                  std::chrono::duration_cast<std::chrono::microseconds>(
                                      std::chrono::steady_clock::now() - started)
                                      .count()),
                              is_delta},
                  reply);
          installed = true;
        } else {
          MarkUnreachable(name, previous->incarnation, std::string(snapshot.status().message()),
                          /*endpoint_failed=*/false);
        }
        built.Notify();
      },
      /*reuse_endpoint=*/!endpoint_failed, std::move(applied));
  built.WaitForNotification();
  ChargeMetadata(name, MonotonicMicros() - building);
  return installed;
}

}  // namespace kvagent::agent
