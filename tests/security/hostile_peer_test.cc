// A hostile peer agent's metadata, played by the test process: a gRPC Peer service on
// 127.0.0.1 that prefill connects to as a network peer (plain TCP, --insecure-listen).
// Its catalog is real: decode's 12,000 regions as decode serves them to a peer (real
// rkeys of decode's worker), renamed "mallory". What it pushes over WatchMetadata:
// (1) its whole catalog again and again at the version prefill holds: not rebuilt
// (every key unpacked on prefill's worker thread, for nothing); (2) a new whole
// catalog, at a new version, as fast as prefill reads them: prefill applies them
// within its --peer-metadata-share of the time (after --peer-metadata-burst-ms), and
// its transfers to decode keep moving meanwhile. (3) A region key naming a shared
// memory segment to attach: refused, and prefill serves on. And as a same-host peer on
// a local door of its own (LocalDoorSessions), mallory gives another agent's worker
// address and catalog as its own: (4) prefill's own, (5) a third agent's; both refused
// when prefill connects, and no byte moves.
#include <poll.h>
#include <sys/socket.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "catch2/catch.hpp"
#include "base/unique_fd.h"
#include "cli/agent_client.h"
#include "cli/daemon_process.h"
#include "cli/kv_pool.h"
#include "client/local_session.h"
#include "client/session_wire.h"
#include "fmt/format.h"
#include "grpcpp/grpcpp.h"
#include "proto/kvagent.grpc.pb.h"
#include "tests/integration/agent_pair.h"
#include "tests/integration/metrics_scrape.h"
#include "tests/integration/stock_ucx_peer.h"
#include "tests/security/fake_peer.h"

namespace kvagent::testing {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kRegions = 12000;
constexpr int kBatch = 4000;
constexpr uint64_t kItem = 4096;
constexpr uint32_t kBurstMs = 300;
constexpr uint32_t kSharePercent = 25;

// An agent's whole catalog as a peer gets it, fetched through a session of this process.
v1::AgentMetadata CatalogOf(cli::DaemonProcess& agent, int at_least) {
  auto session = client::LocalSession::Attach(agent.local_socket() + ".session",
                                              "catalog-reader", 5000);
  INFO(session.status().ToString());
  REQUIRE(session.ok());
  auto stub = v1::Peer::NewStub(
      grpc::CreateChannel(agent.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  context.AddMetadata("kvagent-session", (*session)->token());
  v1::GetMetadataRequest request;
  request.set_caller("catalog-reader");
  v1::AgentMetadata reply;
  grpc::Status status = stub->GetMetadata(&context, request, &reply);
  INFO(status.error_message());
  REQUIRE(status.ok());
  REQUIRE(reply.regions_size() >= at_least);
  return reply;
}

v1::AgentMetadata DecodeCatalog(AgentPair& pair, int at_least = kRegions) {
  return CatalogOf(pair.decode_process(), at_least);
}

// The hostile peer. GetMetadata answers honestly (the unchanged form when the caller
// holds the current version, else the whole catalog at it); WatchMetadata runs the
// scenario once, then holds the stream open until the caller or Stop ends it.
class HostilePeer final : public v1::Peer::Service {
 public:
  enum class Push { kSameVersion, kNewVersions };

  // Served on 127.0.0.1 (a network peer), or on unix:`door` (a same-host peer's local
  // door, with a LocalDoorSessions beside it).
  HostilePeer(v1::AgentMetadata catalog, Push push, int count, const std::string& door = "")
      : view_(std::move(catalog)), push_(push), count_(count), door_(door) {
    view_.set_name("mallory");
    view_.set_liveness_address("");  // none: polled for liveness, as an older agent is
    view_.set_version(1);
    if (door.empty()) {
      server_ = StartFakePeer(this, &port_);
    } else {
      grpc::ServerBuilder builder;
      builder.AddListeningPort("unix:" + door, grpc::InsecureServerCredentials());
      builder.RegisterService(this);
      server_ = builder.BuildAndStart();
      REQUIRE(server_ != nullptr);
    }
  }
  ~HostilePeer() override { Stop(); }

  std::string address() const {
    return door_.empty() ? fmt::format("127.0.0.1:{}", port_) : "unix:" + door_;
  }
  // Pushes end; the stream stays open.
  void Quiet() { quiet_.store(true); }
  void Stop() {
    quiet_.store(true);
    if (server_) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
      server_.reset();
    }
  }
  int pushed() const { return pushed_.load(); }
  Clock::time_point first_push() {
    absl::MutexLock lock(&mu_);
    return first_push_;
  }

  grpc::Status GetMetadata(grpc::ServerContext*, const v1::GetMetadataRequest* request,
                           v1::AgentMetadata* reply) override {
    absl::MutexLock lock(&mu_);
    AnswerMetadata(view_, *request, reply);
    return grpc::Status::OK;
  }

  grpc::Status WatchMetadata(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::AgentMetadata, v1::GetMetadataRequest>* stream) override {
    v1::GetMetadataRequest first;
    if (!stream->Read(&first)) return grpc::Status::OK;
    if (!started_.exchange(true)) {
      {
        absl::MutexLock lock(&mu_);
        first_push_ = Clock::now();
      }
      for (int i = 0; i < count_ && !quiet_.load() && !context->IsCancelled(); ++i) {
        v1::AgentMetadata view;
        {
          absl::MutexLock lock(&mu_);
          if (push_ == Push::kNewVersions) view_.set_version(view_.version() + 1);
          view = view_;
        }
        if (!stream->Write(view)) break;
        pushed_.fetch_add(1);
      }
    }
    v1::GetMetadataRequest ack;
    while (stream->Read(&ack)) {
    }
    return grpc::Status::OK;
  }

 private:
  absl::Mutex mu_;
  v1::AgentMetadata view_ ABSL_GUARDED_BY(mu_);
  Clock::time_point first_push_ ABSL_GUARDED_BY(mu_);
  const Push push_;
  const int count_;
  const std::string door_;
  std::atomic<bool> started_{false};
  std::atomic<bool> quiet_{false};
  std::atomic<int> pushed_{0};
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// The session socket of a same-host peer's local door (PATH.session), played by this
// process: each hello is answered with a welcome naming "mallory" and granting the peer
// role, and the session stays open while this lives. The kernel vouches for this
// process (SO_PEERCRED), so a catalog served beside it names this process's pid.
class LocalDoorSessions {
 public:
  static constexpr uint64_t kIncarnation = 0x6d616c6c6f7279;

  explicit LocalDoorSessions(const std::string& door) {
    listener_ = UniqueFd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    REQUIRE(listener_.valid());
    auto address = client::MakeUnixAddress(door + ".session");
    REQUIRE(address.ok());
    REQUIRE(::bind(listener_.get(), reinterpret_cast<const sockaddr*>(&address->address),
                   address->length) == 0);
    REQUIRE(::listen(listener_.get(), 8) == 0);
    serving_ = std::thread([this] { Serve(); });
  }
  ~LocalDoorSessions() {
    stop_.store(true);
    serving_.join();
  }

 private:
  void Serve() {
    std::vector<UniqueFd> sessions;
    while (!stop_.load()) {
      pollfd ready{listener_.get(), POLLIN, 0};
      if (::poll(&ready, 1, 50) <= 0) continue;
      UniqueFd session(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (!session.valid()) continue;
      v1::SessionRequest hello;
      std::vector<UniqueFd> fds;
      if (!client::ReceiveMessage(session.get(), &hello, &fds, 5000).ok()) continue;
      v1::SessionReply reply;
      reply.set_seq(hello.seq());
      v1::SessionWelcome* welcome = reply.mutable_welcome();
      welcome->set_agent("mallory");
      welcome->set_incarnation(kIncarnation);
      welcome->set_session_id(1);
      welcome->set_token("00");
      welcome->add_roles("peer");
      if (client::SendMessage(session.get(), reply, {}).ok()) sessions.push_back(std::move(session));
    }
  }

  UniqueFd listener_;
  std::atomic<bool> stop_{false};
  std::thread serving_;
};

AgentPairOptions HostileOptions() {
  AgentPairOptions options;
  options.extra_args = {"--insecure-listen",           "127.0.0.1:0",
                        "--peer-metadata-burst-ms",    std::to_string(kBurstMs),
                        "--peer-metadata-share",       std::to_string(kSharePercent)};
  return options;
}

// Decode exports kRegions one-item regions of one AllocateMemory object.
void ExportRegions(AgentPair& pair) {
  auto memory = pair.decode().AllocateMemory("many", kRegions * kItem);
  INFO(memory.status().ToString());
  REQUIRE(memory.ok());
  for (int first = 0; first < kRegions; first += kBatch) {
    v1::RegisterRegionsRequest request;
    for (int i = first; i < std::min(kRegions, first + kBatch); ++i) {
      *request.add_regions() =
          AuxRegion(fmt::format("block.{}", i), memory->info.handle(), i * kItem, kItem);
    }
    auto registered = pair.decode().Register(request);
    INFO(registered.status().ToString());
    REQUIRE(registered.ok());
  }
}

absl::StatusOr<v1::PeerInfo> Mallory(AgentPair& pair) {
  auto peers = pair.prefill().Peers();
  if (!peers.ok()) return peers.status();
  for (const auto& p : peers->peers()) {
    if (p.name() == "mallory") return p;
  }
  return absl::NotFoundError("prefill has no peer 'mallory'");
}

void ConnectMallory(AgentPair& pair, HostilePeer& mallory) {
  auto connected = pair.prefill().Connect(mallory.address());
  INFO(connected.status().ToString());
  REQUIRE(connected.ok());
  REQUIRE(connected->name() == "mallory");
  REQUIRE(connected->regions() >= kRegions);
}

void PrintMallory(const v1::PeerInfo& p, const char* when) {
  std::printf("%s: state %s, full fetches %llu, deltas %llu, views ignored %llu, applying "
              "%.1f ms, paced %.1f ms, last view %.1f ms\n",
              when, p.state().c_str(), static_cast<unsigned long long>(p.full_fetches()),
              static_cast<unsigned long long>(p.deltas_applied()),
              static_cast<unsigned long long>(p.metadata_views_ignored()),
              p.metadata_apply_us_total() / 1000.0, p.metadata_paced_us_total() / 1000.0,
              p.refresh_us_last() / 1000.0);
}

TEST_CASE("a peer pushing its whole catalog again at the version held is not rebuilt") {
  constexpr int kPushes = 30;
  AgentPair pair(HostileOptions());
  ExportRegions(pair);
  HostilePeer mallory(DecodeCatalog(pair), HostilePeer::Push::kSameVersion, kPushes);
  ConnectMallory(pair, mallory);
  // Every push is either ignored or (the old way) rebuilt and installed as a full fetch.
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  v1::PeerInfo seen;
  for (;;) {
    auto info = Mallory(pair);
    INFO(info.status().ToString());
    REQUIRE(info.ok());
    seen = *info;
    // Mallory counts a push once its Write returned, which can be after prefill took
    // that view (a CI run read 29 of 30 here): wait for both counts.
    if (seen.metadata_views_ignored() + seen.full_fetches() >= kPushes + 1 &&
        mallory.pushed() >= kPushes) {
      break;
    }
    INFO("mallory pushed " << mallory.pushed() << "; ignored "
                           << seen.metadata_views_ignored() << ", full fetches "
                           << seen.full_fetches());
    REQUIRE(Clock::now() < deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  PrintMallory(seen, "after the pushes");
  CHECK(mallory.pushed() == kPushes);
  CHECK(seen.metadata_views_ignored() == kPushes);
  CHECK(seen.full_fetches() == 1);  // ConnectPeer's
  CHECK(seen.state() == "connected");
}

TEST_CASE("a peer pushing new whole catalogs without end gets its share of the agent's time") {
  constexpr auto kFlood = std::chrono::seconds(5);
  AgentPair pair(HostileOptions());
  ExportRegions(pair);
  HostilePeer mallory(DecodeCatalog(pair), HostilePeer::Push::kNewVersions, 1 << 30);
  const auto connecting = Clock::now();
  ConnectMallory(pair, mallory);
  // Meanwhile prefill's WRITEs to decode keep completing, bytes checked.
  pair.ResetContents();
  int writes = 0;
  while (Clock::now() - connecting < kFlood) {
    const uint64_t page = writes % 32;
    auto state = SubmitThrough(pair.prefill(), KvWrite(fmt::format("w{}", writes), {page}, {page}));
    INFO(state.status().ToString());
    REQUIRE(state.ok());
    auto done = pair.prefill().WaitTransfer(fmt::format("w{}", writes), 20000);
    INFO(done.status().ToString());
    REQUIRE(done.ok());
    INFO(done->error_message());
    REQUIRE(done->phase() == v1::COMPLETED);
    REQUIRE(pair.PageEqual(page, page));
    ++writes;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  auto info = Mallory(pair);
  const auto elapsed_us =
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - connecting).count();
  mallory.Quiet();
  INFO(info.status().ToString());
  REQUIRE(info.ok());
  PrintMallory(*info, "after the flood");
  std::printf("%d views pushed in %.1f s; %d WRITEs completed meanwhile\n", mallory.pushed(),
              elapsed_us / 1e6, writes);
  // The budget: the burst, the share of the time since, and the view that went past it
  // (charged once applied); ConnectPeer's own fetch is not charged. Pacing holds the
  // total near that; 10 points more leave room for when each side reads its clock.
  const double bound_us = kBurstMs * 1000.0 + elapsed_us * (kSharePercent + 10) / 100.0 +
                          2.0 * static_cast<double>(info->refresh_us_last());
  INFO("applying " << info->metadata_apply_us_total() << " us, bound " << bound_us << " us of "
                   << elapsed_us);
  CHECK(info->metadata_apply_us_total() <= bound_us);
  CHECK(info->metadata_paced_us_total() > 0);
  // Paced, not starved: its views still arrive.
  CHECK(info->full_fetches() >= 3);
  CHECK(info->state() == "connected");
}

// A region key whose entry for UCX's sysv domain names a shared memory segment: UCX
// 1.13 attaches whatever segment it names as the peer's memory (another engine's, one
// of this agent's own), and when the segment does not attach (segment 0) it releases
// the half-built key and dies of SIGSEGV. Against the build before, prefill died at the
// second Connect. Now each view is refused naming the region and the entry, nothing is
// attached, and prefill serves on.
TEST_CASE("a peer's region key naming a shared memory segment to attach is refused, and the "
          "agent serves on") {
  AgentPairOptions options = HostileOptions();
  options.extra_args.insert(options.extra_args.end(), {"--metrics-listen", "127.0.0.1:0"});
  AgentPair pair(options);
  auto memory = pair.decode().AllocateMemory("one", kItem);
  INFO(memory.status().ToString());
  REQUIRE(memory.ok());
  v1::RegisterRegionsRequest request;
  *request.add_regions() = AuxRegion("block.0", memory->info.handle(), 0, kItem);
  REQUIRE(pair.decode().Register(request).ok());
  const v1::AgentMetadata honest = DecodeCatalog(pair, 1);
  int at = -1;
  for (int i = 0; i < honest.regions_size(); ++i) {
    if (honest.regions(i).name() == "block.0") at = i;
  }
  REQUIRE(at >= 0);

  // The key of a segment UCX allocated in this process: its sysv entry names it.
  UcxSysvSegment segment;
  const std::string metrics = MetricsAddress(pair.prefill());
  double refused = Value(Scrape(metrics), "kvagent_ucx_rkey_entries_refused_total");
  CHECK(refused == 0);
  for (const std::string& forged : {segment.key(), segment.KeyNamingSegmentZero()}) {
    v1::AgentMetadata view = honest;
    view.mutable_regions(at)->set_rkey(forged);
    HostilePeer mallory(view, HostilePeer::Push::kSameVersion, 0);
    auto connected = pair.prefill().Connect(mallory.address());
    INFO(connected.status().ToString());
    CHECK_FALSE(connected.ok());
    CHECK_THAT(std::string(connected.status().message()),
               Catch::Contains("region 'block.0'") &&
                   Catch::Contains("remote key was refused: its entry for UCX's sysv domain "
                                   "names a shared memory segment"));
    CHECK(segment.Attached() == 1);  // this process's own mapping only
    const double now = Value(Scrape(metrics), "kvagent_ucx_rkey_entries_refused_total");
    CHECK(now == refused + 1);
    refused = now;
    // Prefill serves on: a WRITE to decode lands, bytes checked.
    pair.ResetContents();
    const std::string id = fmt::format("after-{}", refused);
    auto state = SubmitThrough(pair.prefill(), KvWrite(id, {3}, {5}));
    INFO(state.status().ToString());
    REQUIRE(state.ok());
    auto done = pair.prefill().WaitTransfer(id, 20000);
    INFO(done.status().ToString());
    REQUIRE(done.ok());
    CHECK(done->phase() == v1::COMPLETED);
    CHECK(pair.PageEqual(3, 5));
  }
}

// A same-host peer (its local door: a uid in --peer-uids, here this agent's own),
// played by this process, whose catalog gives another agent's worker address and
// regions (`whose`: prefill itself, or a third agent) as its own.
struct RelayPeer {
  static v1::AgentMetadata View(cli::DaemonProcess& whose) {
    v1::AgentMetadata view = CatalogOf(whose, 1);
    view.set_incarnation(LocalDoorSessions::kIncarnation);
    view.set_pid(static_cast<uint32_t>(::getpid()));
    for (auto& region : *view.mutable_regions()) region.set_memory_id(0);  // UCX, not shm
    return view;
  }
  // Beside prefill's door, whose path fits a Unix socket's with ".session" appended
  // (DaemonProcess picks a short directory when the work directory's does not).
  static std::string DoorBeside(const std::string& socket) {
    return socket.substr(0, socket.rfind('/')) + "/m.sock";
  }
  // `network`: mallory is a network peer (127.0.0.1; prefill runs --insecure-listen).
  RelayPeer(AgentPair& pair, cli::DaemonProcess& whose, bool network = false)
      : door(network ? "" : DoorBeside(pair.prefill_process().local_socket())),
        sessions(network ? nullptr : std::make_unique<LocalDoorSessions>(door)),
        mallory(View(whose), HostilePeer::Push::kSameVersion, 0, door) {}
  const std::string door;
  std::unique_ptr<LocalDoorSessions> sessions;
  HostilePeer mallory;
};

// Prefill's page `dst` differs from its page `src` in every region.
bool PrefillPagesDiffer(AgentPair& pair, uint64_t src, uint64_t dst) {
  cli::KvPool& pool = pair.prefill_pool();
  for (uint32_t r = 0; r < pool.regions(); ++r) {
    if (std::memcmp(pool.Page(r, src), pool.Page(r, dst), pool.shape.page_bytes) == 0) {
      return false;
    }
  }
  return true;
}

// After the peer: prefill's WRITE to decode lands.
void WriteToDecode(AgentPair& pair, const std::string& id) {
  pair.ResetContents();
  auto state = SubmitThrough(pair.prefill(), KvWrite(id, {3}, {5}));
  INFO(state.status().ToString());
  REQUIRE(state.ok());
  auto done = pair.prefill().WaitTransfer(id, 20000);
  REQUIRE(done.ok());
  CHECK(done->phase() == v1::COMPLETED);
  CHECK(pair.PageEqual(3, 5));
}

// Prefill connects to the relaying peer and, where that succeeds (the build before),
// writes its page 3 to mallory's page 5; returns how the connect went.
absl::StatusOr<v1::PeerInfo> ConnectAndRelay(AgentPair& pair, RelayPeer& peer) {
  auto connected = pair.prefill().Connect(peer.mallory.address());
  if (connected.ok()) {
    v1::SubmitTransferRequest relay = KvWrite("relay", {3}, {5});
    relay.set_peer("mallory");
    if (SubmitThrough(pair.prefill(), relay).ok()) {
      pair.prefill().WaitTransfer("relay", 5000).IgnoreError();
    }
  }
  return connected;
}

// Connected without error handling, UCX reaches this agent's own address by its self
// transport, and a WRITE "to mallory" was a memcpy inside prefill to wherever the
// catalog said (the build before: connected, and prefill's page 3 landed on its own
// page 5).
TEST_CASE("a same-host peer giving this agent's own UCX worker address is refused") {
  AgentPair pair;
  RelayPeer peer(pair, pair.prefill_process());
  pair.ResetContents();
  const absl::StatusOr<v1::PeerInfo> connected = ConnectAndRelay(pair, peer);
  INFO(connected.status().ToString());
  CHECK_FALSE(connected.ok());
  CHECK(connected.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK_THAT(std::string(connected.status().message()),
             Catch::Contains("peer 'mallory': its UCX worker address is this agent's own"));
  CHECK(PrefillPagesDiffer(pair, 3, 5));
  WriteToDecode(pair, "after");
}

// The same with a third agent's address: creating the endpoint attached the victim
// agent's receive FIFO, and prefill's WRITE "to mallory" landed in the victim's pool
// (the victim's UCX serves its peers' regions to whoever reaches its worker, and never
// authenticated prefill). Now prefill's UCX reaches only processes a local door proved.
// A directory for UCX_POSIX_DIR, removed with what UCX left in it: short, as UCX 1.13
// packs it into an interface address of at most 63 bytes (and stops on a longer one).
class PosixDirectory {
 public:
  PosixDirectory() {
    char name[] = "/tmp/kvposix.XXXXXX";
    REQUIRE(::mkdtemp(name) != nullptr);
    path_ = name;
  }
  ~PosixDirectory() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Named posix FIFOs are UCX's only in the initial PID namespace: elsewhere (Bazel's
// sandbox) it finds them unreachable, so these cases run unsandboxed (BUILD).
TEST_CASE("a same-host peer giving another agent's UCX worker address is refused") {
  // The victim's receive FIFO: System V (UCX's first choice), posix by /proc/PID/fd
  // link, posix by name under /dev/shm, posix by name in a directory; or none (4), so
  // that prefill's UCX takes the victim's TCP port on loopback (and cma, whose RMA lane
  // makes UCP emulate puts over TCP: the build before wrote the victim's page); or (5)
  // prefill runs with peer error handling, which takes TCP alone; or (6) mallory is a
  // network peer, whose endpoint takes TCP alone.
  const int fifo = GENERATE(0, 1, 2, 3, 4, 5, 6);
  AgentPairOptions pair_options;
  if (fifo == 5) pair_options.extra_args = {"--ucx-error-mode", "peer"};
  if (fifo == 6) pair_options.extra_args = {"--insecure-listen", "127.0.0.1:0"};
  AgentPair pair(pair_options);
  PosixDirectory directory;
  cli::DaemonOptions options;
  if (fifo > 0) options.env["UCX_TLS"] = fifo == 4 ? "tcp,cma,self" : "^sysv";
  if (fifo == 2 || fifo == 3) options.env["UCX_POSIX_USE_PROC_LINK"] = "n";
  if (fifo == 3) options.env["UCX_POSIX_DIR"] = directory.path();
  INFO("victim's FIFO " << fifo);
  auto binary = cli::FindKvagentd("");
  REQUIRE(binary.ok());
  options.binary = *binary;
  options.name = "victim";
  options.work_dir = pair.work_dir();
  auto started = cli::DaemonProcess::Start(options);
  INFO(started.status().ToString());
  REQUIRE(started.ok());
  cli::DaemonProcess victim = *std::move(started);
  cli::AgentClient victim_client(victim.address());
  auto created = cli::CreateKvPool(victim_client, "victim", pair.prefill_pool().shape);
  INFO(created.status().ToString());
  REQUIRE(created.ok());
  cli::KvPool pool = *std::move(created);
  std::memset(pool.mapping.data(), 0xEE, pool.bytes());
  RelayPeer peer(pair, victim, /*network=*/fifo == 6);
  const absl::StatusOr<v1::PeerInfo> connected = ConnectAndRelay(pair, peer);
  INFO(connected.status().ToString());
  CHECK_FALSE(connected.ok());
  CHECK(connected.status().code() == absl::StatusCode::kPermissionDenied);
  const std::string refusal[] = {
      fmt::format("UCX was to attach shared memory of pid {}, no peer proven on this host",
                  victim.pid()),
      fmt::format("UCX was to attach shared memory of pid {}, no peer proven on this host",
                  victim.pid()),
      "UCX was to open the shared memory file /dev/shm/ucx_shm_posix_",
      "the peer's posix receive FIFO is a file in a directory its worker address names",
      "a TCP port on this host that no peer proven on this host listens on",
      "a TCP port on this host that no peer proven on this host listens on",
      "a TCP port on this host that no peer proven on this host listens on"};
  CHECK_THAT(std::string(connected.status().message()),
             Catch::Contains("peer 'mallory'") && Catch::Contains(refusal[fifo]));
  bool untouched = true;
  for (uint32_t r = 0; r < pool.regions(); ++r) {
    const uint8_t* page = pool.Page(r, 5);
    for (uint64_t b = 0; b < pool.shape.page_bytes; ++b) untouched = untouched && page[b] == 0xEE;
  }
  CHECK(untouched);
  WriteToDecode(pair, "after");
}

// The control: kvagentd keeps a FIFO named by file when the peer the local door proved
// has it mapped, so two honest agents run with UCX_POSIX_USE_PROC_LINK=n still move
// every byte over posix shared memory, both ways.
TEST_CASE("agents whose UCX names its posix FIFOs by file move bytes over shared memory") {
  const bool in_directory = GENERATE(false, true);
  INFO((in_directory ? "UCX_POSIX_DIR set" : "under /dev/shm"));
  PosixDirectory directory;
  AgentPairOptions options;
  options.env["UCX_TLS"] = "posix,self";
  options.env["UCX_POSIX_USE_PROC_LINK"] = "n";
  if (in_directory) options.env["UCX_POSIX_DIR"] = directory.path();
  options.extra_args = {"--shm-direct", "off"};
  AgentPair pair(options);
  pair.ResetContents();
  auto peers = pair.prefill().Peers();
  REQUIRE(peers.ok());
  REQUIRE(peers->peers_size() == 1);
  CHECK(peers->peers(0).transports() == "posix");
  REQUIRE(SubmitThrough(pair.prefill(), KvWrite("posix-write", {1, 2}, {9, 4})).ok());
  auto written = pair.prefill().WaitTransfer("posix-write", 20000);
  REQUIRE(written.ok());
  CHECK(written->phase() == v1::COMPLETED);
  auto back = pair.decode().Connect(pair.prefill_process().address());
  INFO(back.status().ToString());
  REQUIRE(back.ok());
  CHECK(back->transports() == "posix");
  v1::SubmitTransferRequest read = KvWrite("posix-read", {12}, {6});  // decode <- prefill
  read.set_peer("prefill");
  read.set_op(v1::READ);
  REQUIRE(SubmitThrough(pair.decode(), read).ok());
  auto pulled = pair.decode().WaitTransfer("posix-read", 20000);
  REQUIRE(pulled.ok());
  CHECK(pulled->phase() == v1::COMPLETED);
  CHECK(pair.PageEqual(1, 9));
  CHECK(pair.PageEqual(2, 4));
  CHECK(pair.PageEqual(6, 12));
}

}  // namespace
}  // namespace kvagent::testing
