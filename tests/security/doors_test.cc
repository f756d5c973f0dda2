// Attacks on kvagentd's doors, made against real kvagentd processes with a throwaway
// cluster CA under TEST_TMPDIR: callers of the network door without a cluster
// certificate or without a role, a stranger agent from another CA, fake peers served
// by this process (plain TCP, another CA, a name their certificate does not hold, a
// claimed host id), where UCX listens, the insecure door, and floods of session-socket
// connections that never say hello or that end while another engine's large
// registration holds the registry. Each attack must be refused with an error that
// names its cause, the victim must still serve, and an honest WRITE between two
// agents over mutual TLS must still move the right bytes.
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "agent/tls.h"
#include "base/unique_fd.h"
#include "catch2/catch.hpp"
#include "cli/agent_client.h"
#include "cli/cert_authority.h"
#include "cli/daemon_process.h"
#include "cli/kv_pool.h"
#include "client/fast_path.h"
#include "client/session_wire.h"
#include "fmt/format.h"
#include "grpcpp/grpcpp.h"
#include "proto/kvagent.grpc.pb.h"
#include "tests/integration/agent_pair.h"
#include "tests/integration/metrics_scrape.h"
#include "tests/unit/catch_main.h"
#include "tests/unit/text_count.h"
#include "transport/ucx_context.h"
#include "transport/ucx_worker.h"

namespace kvagent::testing {
namespace {

using Catch::Contains;
using Catch::StartsWith;

// Deadlines: attackers' calls fail fast; ConnectPeer waits on the victim's own 5 s
// GetMetadata deadline, so the clients that ask for it wait longer.
constexpr uint32_t kAttackMs = 4000;
constexpr uint32_t kLocalMs = 8000;
constexpr uint32_t kTransferMs = 5000;

template <typename T>
T Require(absl::StatusOr<T> value, const std::string& what) {
  INFO(what << ": " << value.status().ToString());
  REQUIRE(value.ok());
  return *std::move(value);
}

std::string Text(const absl::Status& status) { return std::string(status.message()); }

std::string MakeWorkDir(const std::string& tag) {
  static int counter = 0;
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir =
      fmt::format("{}/doors.{}.{}.{}", tmp ? tmp : "/tmp", ::getpid(), tag, counter++);
  std::filesystem::create_directories(dir);
  return dir;
}

agent::TlsFiles Files(const cli::TlsFilePaths& paths) {
  return agent::TlsFiles{paths.cert, paths.key, paths.ca};
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string BootId() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

// A client of `address`: the local door (unix:PATH) or a network door, with mutual TLS
// when `tls` is set and plain TCP otherwise.
std::unique_ptr<cli::AgentClient> Client(const std::string& address, uint32_t timeout_ms,
                                         const agent::TlsFiles& tls = {}) {
  cli::AgentClientOptions options;
  options.timeout_ms = timeout_ms;
  options.client_name = "doors_test";
  options.tls = tls;
  return std::make_unique<cli::AgentClient>(address, options);
}

// One Peer.GetMetadata (what hands out rkeys and a notification secret) on a fresh
// channel of its own.
grpc::Status CallGetMetadata(const std::string& address, const agent::TlsFiles& tls,
                             v1::AgentMetadata* reply) {
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!tls.empty()) {
    auto made = agent::MakeChannelCredentials(tls);
    REQUIRE(made.ok());
    credentials = *made;
  }
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto stub = v1::Peer::NewStub(grpc::CreateCustomChannel(address, credentials, args));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(kAttackMs));
  v1::GetMetadataRequest request;
  request.set_caller("doors_test");
  return stub->GetMetadata(&context, request, reply);
}

cli::KvPoolShape SmallShape() {
  cli::KvPoolShape shape;
  shape.layers = 2;
  shape.pages = 16;
  shape.page_bytes = 4096;
  return shape;
}

// A WRITE of "kv" pages src[i] -> dst[i] to peer "decode" that answers when it has ended.
v1::SubmitTransferRequest KvWrite(const std::string& id, const std::vector<uint64_t>& src,
                                  const std::vector<uint64_t>& dst) {
  v1::SubmitTransferRequest request;
  request.set_transfer_id(id);
  request.set_peer("decode");
  request.set_op(v1::WRITE);
  request.set_wait(true);
  request.set_timeout_ms(kTransferMs);
  auto* items = request.add_segments()->mutable_items();
  items->set_local_group("kv");
  items->set_remote_group("kv");
  for (uint64_t i : src) items->add_local_indices(i);
  for (uint64_t i : dst) items->add_remote_indices(i);
  return request;
}

cli::DaemonProcess StartAgent(const std::string& dir, const std::string& name,
                              cli::NetworkDoor door, const agent::TlsFiles& tls,
                              const std::vector<std::string>& extra_args = {},
                              const std::map<std::string, std::string>& env = {}) {
  cli::DaemonOptions options;
  options.binary = Require(cli::FindKvagentd(""), "finding kvagentd");
  options.name = name;
  options.work_dir = dir;
  options.network = door;
  options.tls = tls;
  options.extra_args = extra_args;
  // gRPC's default, made explicit: its log line is the only place a failed TLS
  // handshake's reason shows (see ExpectShutOut).
  options.env = env;
  options.env.emplace("GRPC_VERBOSITY", "ERROR");
  return Require(cli::DaemonProcess::Start(options), "starting " + name);
}

// The victim answers its local door (GetStatus) as itself.
void ExpectServing(cli::AgentClient& local, const std::string& name) {
  auto status = local.Status();
  INFO(name << " after the attack: " << status.status().ToString());
  REQUIRE(status.ok());
  CHECK(status->name() == name);
}

// Two agents, "prefill" and "decode", each with a mutual-TLS network door on
// 127.0.0.1:0 and a certificate of one throwaway cluster CA, KV pools registered
// through their local doors, and prefill connected to decode at decode's NETWORK door:
// the link is authenticated by certificate, not by the local door, so the data
// moves through UCX as between hosts.
struct Cluster {
  std::string dir;
  std::unique_ptr<cli::CertAuthority> ca;
  cli::DaemonProcess prefill, decode;
  std::unique_ptr<cli::AgentClient> prefill_local, decode_local;
  cli::KvPool prefill_pool, decode_pool;
  v1::PeerInfo link;  // prefill's view of decode
  int writes = 0;

  explicit Cluster(const std::string& tag, const std::vector<std::string>& prefill_args = {})
      : dir(MakeWorkDir(tag)) {
    ca = std::make_unique<cli::CertAuthority>(
        Require(cli::CertAuthority::Create(dir + "/cluster", "cluster"), "making the cluster CA"));
    prefill =
        StartAgent(dir, "prefill", cli::NetworkDoor::kTls, Files(Issue("prefill")), prefill_args);
    decode = StartAgent(dir, "decode", cli::NetworkDoor::kTls, Files(Issue("decode")));
    prefill_local = Client(prefill.address(), kLocalMs);
    decode_local = Client(decode.address(), kLocalMs);
    prefill_pool = Require(cli::CreateKvPool(*prefill_local, "prefill", SmallShape()),
                           "registering prefill's pool");
    decode_pool = Require(cli::CreateKvPool(*decode_local, "decode", SmallShape()),
                          "registering decode's pool");
    link = Require(prefill_local->Connect(decode.network_address()),
                   "connecting prefill to decode's network door");
    INFO(link.DebugString());
    REQUIRE(link.name() == "decode");
    REQUIRE(link.address() == decode.network_address());
    REQUIRE_FALSE(link.same_host());
    REQUIRE(link.data_path() == "ucx-am");  // tcp: no native RMA
    REQUIRE(link.error_mode() == "peer");
  }

  cli::TlsFilePaths Issue(const std::string& name, const cli::IssueOptions& options = {}) const {
    return Require(ca->Issue(name, options), "issuing a certificate for " + name);
  }

  // Fills prefill's pages with a fresh pattern and decode's with 0xEE, has `submitter`
  // WRITE four scattered pages, and checks that exactly those bytes arrived.
  void HonestWrite(cli::AgentClient& submitter, const std::string& id) {
    const uint64_t seed = 1000 + writes++;
    for (uint32_t r = 0; r < prefill_pool.regions(); ++r) {
      for (uint64_t p = 0; p < prefill_pool.shape.pages; ++p) {
        cli::FillPage(prefill_pool.Page(r, p), prefill_pool.shape.page_bytes, seed, r, p);
      }
    }
    std::memset(decode_pool.mapping.data(), 0xEE, decode_pool.bytes());
    const std::vector<uint64_t> src = {1, 5, 6, 7};
    const std::vector<uint64_t> dst = {9, 2, 3, 4};
    auto done = Require(submitter.Submit(KvWrite(id, src, dst)), "submitting WRITE " + id);
    INFO(done.DebugString());
    REQUIRE(done.phase() == v1::COMPLETED);
    CHECK(done.bytes_total() ==
          src.size() * prefill_pool.regions() * prefill_pool.shape.page_bytes);
    CHECK(done.bytes_done() == done.bytes_total());
    for (size_t i = 0; i < src.size(); ++i) {
      for (uint32_t r = 0; r < prefill_pool.regions(); ++r) {
        CAPTURE(i, r);
        CHECK(std::memcmp(prefill_pool.Page(r, src[i]), decode_pool.Page(r, dst[i]),
                          prefill_pool.shape.page_bytes) == 0);
      }
    }
    for (uint64_t untouched : {0, 1, 15}) {
      for (uint32_t r = 0; r < decode_pool.regions(); ++r) {
        const uint8_t* page = decode_pool.Page(r, untouched);
        CHECK(std::all_of(page, page + decode_pool.shape.page_bytes,
                          [](uint8_t b) { return b == 0xEE; }));
      }
    }
    std::printf("honest WRITE %s: %s, %lu bytes over %s (transports %s), byte-exact\n", id.c_str(),
                v1::TransferPhase_Name(done.phase()).c_str(),
                static_cast<unsigned long>(done.bytes_done()), link.address().c_str(),
                link.transports().c_str());
  }

  // Both agents still serve, prefill still holds decode as it was, and an honest
  // WRITE from prefill's engine still lands byte-exact.
  void ExpectUnharmed(const std::string& id) {
    ExpectServing(*prefill_local, "prefill");
    ExpectServing(*decode_local, "decode");
    auto peers = Require(prefill_local->Peers(), "listing prefill's peers");
    bool found = false;
    for (const auto& p : peers.peers()) {
      if (p.name() != "decode") continue;
      found = true;
      INFO(p.DebugString());
      CHECK(p.state() == "connected");
      CHECK(p.incarnation() == link.incarnation());
      CHECK(p.address() == decode.network_address());
    }
    CHECK(found);
    HonestWrite(*prefill_local, id);
  }
};

// ---------------------------------------------------------------------------------
// 1. The network door.

// A caller that must not get through the TLS handshake: every Agent and Peer call (each
// on a fresh channel) fails UNAVAILABLE at once, naming the door, before any handler
// runs. gRPC tells the client only that the socket closed; the victim's log holds the
// handshake's reason (`reason`, from OpenSSL).
void ExpectShutOut(const std::string& who, const std::string& door, const agent::TlsFiles& tls,
                   const Cluster& cluster, const std::string& reason) {
  INFO("attacker: " << who);
  const std::string handshake_failed = "Handshake failed with fatal error SSL_ERROR_SSL";
  const std::string before = ReadFile(cluster.prefill.log_path());
  auto expect_refused = [&](const std::string& call, const absl::Status& status, int64_t ms) {
    INFO(call << ": " << status.ToString());
    CHECK(status.code() == absl::StatusCode::kUnavailable);
    CHECK_THAT(Text(status), Contains("ipv4:" + door));
    CHECK(ms < kAttackMs);  // refused by the handshake, not by a deadline
    std::printf("%s -> %s: %s (%ld ms)\n", who.c_str(), call.c_str(), status.ToString().c_str(),
                static_cast<long>(ms));
  };
  auto timed = [](auto&& call) {
    const auto start = std::chrono::steady_clock::now();
    absl::Status status = call();
    return std::make_pair(status, std::chrono::duration_cast<std::chrono::milliseconds>(
                                      std::chrono::steady_clock::now() - start)
                                      .count());
  };
  auto [status, status_ms] = timed([&] { return Client(door, kAttackMs, tls)->Status().status(); });
  expect_refused("GetStatus", status, status_ms);
  auto [regions, regions_ms] =
      timed([&] { return Client(door, kAttackMs, tls)->Regions().status(); });
  expect_refused("ListRegions", regions, regions_ms);
  auto [submitted, submitted_ms] = timed(
      [&] { return Client(door, kAttackMs, tls)->Submit(KvWrite("stolen", {0}, {0})).status(); });
  expect_refused("SubmitTransfer", submitted, submitted_ms);
  auto [dropped, dropped_ms] = timed([&] {
    return Client(door, kAttackMs, tls)
        ->Deregister({cluster.prefill_pool.region_names[0]})
        .status();
  });
  expect_refused("DeregisterRegions", dropped, dropped_ms);
  v1::AgentMetadata metadata;
  auto [peer, peer_ms] = timed([&] {
    grpc::Status s = CallGetMetadata(door, tls, &metadata);
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  });
  expect_refused("GetMetadata", peer, peer_ms);
  CHECK(metadata.worker_address().empty());
  CHECK(metadata.notify_secret().empty());
  CHECK(metadata.regions_size() == 0);

  // The victim logged why (gRPC's own log line, written as the handshake fails).
  std::string after;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while ((after = ReadFile(cluster.prefill.log_path()), Occurrences(after, reason)) <=
             Occurrences(before, reason) &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  INFO("victim's log:\n" << after.substr(before.size()));
  CHECK(Occurrences(after, handshake_failed) > Occurrences(before, handshake_failed));
  CHECK(Occurrences(after, reason) > Occurrences(before, reason));
  // ... and nothing reached kvagent's handlers: no refusal was audited, none counted.
  CHECK(Occurrences(after, "refused ") == Occurrences(before, "refused "));
}

TEST_CASE("the network door refuses callers without a cluster certificate or a role") {
  Cluster cluster("door", {"--scheduler-identities", "sched,late-sched"});
  const std::string door = cluster.prefill.network_address();
  auto rogue = Require(cli::CertAuthority::Create(cluster.dir + "/rogue", "rogue"), "rogue CA");

  // No client certificate at all: plain TCP to the mutual-TLS port.
  ExpectShutOut("plain TCP", door, {}, cluster, "wrong version number");
  // Another CA's certificate, under a name the victim lists as a scheduler; it trusts
  // the cluster CA so that only the victim's check of the client can refuse it.
  auto forged = Require(rogue.Issue("sched"), "issuing the forged scheduler");
  forged.ca = cluster.ca->ca_path();
  ExpectShutOut("another CA's 'sched'", door, Files(forged), cluster, "certificate verify failed");
  // The cluster's own certificate for a listed scheduler, but expired.
  cli::IssueOptions expired;
  expired.not_before_s = -2 * 24 * 3600;
  expired.not_after_s = -24 * 3600;
  // (OpenSSL's reason does not say "expired": gRPC logs only the generic one.)
  ExpectShutOut("expired 'late-sched'", door, Files(cluster.Issue("late-sched", expired)), cluster,
                "certificate verify failed");
  ExpectServing(*cluster.prefill_local, "prefill");

  // A valid cluster certificate without the scheduler role.
  auto viewer = Client(door, kAttackMs, Files(cluster.Issue("viewer")));
  auto viewer_status = Require(viewer->Status(), "viewer's GetStatus");
  CHECK(viewer_status.caller() == "cert:viewer");
  CHECK(std::vector<std::string>(viewer_status.caller_roles().begin(),
                                 viewer_status.caller_roles().end()) ==
        std::vector<std::string>{"peer"});
  CHECK(viewer_status.network_door() == "mtls " + door);
  auto viewer_regions = Require(viewer->Regions(), "viewer's ListRegions");
  CHECK(viewer_regions.regions_size() == 0);

  auto stolen = viewer->Submit(KvWrite("viewer-write", {0, 1}, {0, 1}));
  INFO(stolen.status().ToString());
  REQUIRE_FALSE(stolen.ok());
  CHECK(stolen.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK_THAT(Text(stolen.status()), Contains("SubmitTransfer") && Contains("cert:viewer") &&
                                        Contains("engine or scheduler role") &&
                                        Contains("--scheduler-identities"));
  std::printf("viewer -> SubmitTransfer: %s\n", stolen.status().ToString().c_str());

  auto dropped = viewer->Deregister({cluster.prefill_pool.region_names[0]});
  INFO(dropped.status().ToString());
  REQUIRE_FALSE(dropped.ok());
  CHECK(dropped.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK_THAT(Text(dropped.status()), Contains("DeregisterRegions") && Contains("cert:viewer") &&
                                         Contains("engine or scheduler role") &&
                                         Contains("--scheduler-identities"));
  std::printf("viewer -> DeregisterRegions: %s\n", dropped.status().ToString().c_str());

  v1::RegisterRegionsRequest grab;
  auto* spec = grab.add_regions();
  spec->set_name("viewer-region");
  spec->set_kind(v1::AUX);
  spec->set_length(4096);
  spec->mutable_shm()->set_name("/doors-test-nothing");
  auto registered = viewer->Register(grab);
  INFO(registered.status().ToString());
  REQUIRE_FALSE(registered.ok());
  CHECK(registered.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK_THAT(Text(registered.status()),
             Contains("RegisterRegions") && Contains("engine role") && Contains("--engine-uids"));
  std::printf("viewer -> RegisterRegions: %s\n", registered.status().ToString().c_str());

  // Nothing changed: every region still there, and the refusals were counted.
  auto regions = Require(cluster.prefill_local->Regions(), "prefill's regions");
  CHECK(static_cast<size_t>(regions.regions_size()) == cluster.prefill_pool.region_names.size());
  auto after = Require(cluster.prefill_local->Status(), "prefill's status");
  CHECK(after.refused_calls() == 3);  // the three above; failed handshakes never got here

  // A certificate listed in --scheduler-identities sees and moves the engine's regions.
  auto sched = Client(door, kAttackMs, Files(cluster.Issue("sched")));
  auto sched_status = Require(sched->Status(), "scheduler's GetStatus");
  CHECK(sched_status.caller() == "cert:sched");
  CHECK(std::vector<std::string>(sched_status.caller_roles().begin(),
                                 sched_status.caller_roles().end()) ==
        std::vector<std::string>{"scheduler", "peer"});
  auto sched_regions = Require(sched->Regions(), "scheduler's ListRegions");
  std::set<std::string> names;
  for (const auto& r : sched_regions.regions()) names.insert(r.spec().name());
  CHECK(names == std::set<std::string>(cluster.prefill_pool.region_names.begin(),
                                       cluster.prefill_pool.region_names.end()));
  cluster.HonestWrite(*sched, "sched-write");
  // Transfers, like regions, are shown to whom may act on them.
  auto sched_transfers = Require(sched->Transfers(false), "scheduler's ListTransfers");
  CHECK(sched_transfers.transfers_size() == 1);
  auto viewer_transfers = Require(viewer->Transfers(false), "viewer's ListTransfers");
  CHECK(viewer_transfers.transfers_size() == 0);
  for (const auto& hidden : {viewer->Get("sched-write"), viewer->Cancel("sched-write")}) {
    INFO(hidden.status().ToString());
    CHECK(hidden.status().code() == absl::StatusCode::kNotFound);
    CHECK_THAT(Text(hidden.status()),
               Contains("'sched-write' is not known here (or is another client's"));
  }

  cluster.ExpectUnharmed("after-door");
}

// ---------------------------------------------------------------------------------
// 2. A stranger agent.

// ConnectPeer's answer when the TLS handshake with the other side fails: UNAVAILABLE,
// naming the address, OpenSSL's reason (`reason`) and the CA as what to check.
void ExpectPeerHandshakeRefused(const absl::StatusOr<v1::PeerInfo>& connected,
                                const std::string& address, const std::string& reason) {
  INFO(connected.status().ToString());
  REQUIRE_FALSE(connected.ok());
  CHECK(connected.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(Text(connected.status()),
             Contains("peer at " + address + " did not answer GetMetadata") &&
                 Contains("Tls handshake failed") && Contains("SSL routines::" + reason) &&
                 Contains("certificates come from the same CA"));
}

TEST_CASE("a stranger agent from another CA can neither join nor be joined") {
  Cluster cluster("stranger");
  auto rogue = Require(cli::CertAuthority::Create(cluster.dir + "/rogue", "rogue"), "rogue CA");
  cli::DaemonProcess mallory = StartAgent(cluster.dir, "mallory", cli::NetworkDoor::kTls,
                                          Files(Require(rogue.Issue("mallory"), "mallory's cert")));
  auto mallory_local = Client(mallory.address(), kLocalMs);

  auto in = mallory_local->Connect(cluster.decode.network_address());
  ExpectPeerHandshakeRefused(in, cluster.decode.network_address(), "certificate verify failed");
  std::printf("mallory -> ConnectPeer decode: %s\n", in.status().ToString().c_str());

  auto out = cluster.decode_local->Connect(mallory.network_address());
  ExpectPeerHandshakeRefused(out, mallory.network_address(), "certificate verify failed");
  std::printf("decode -> ConnectPeer mallory: %s\n", out.status().ToString().c_str());

  auto decode_status = Require(cluster.decode_local->Status(), "decode's status");
  CHECK(decode_status.peers() == 0);
  auto mallory_status = Require(mallory_local->Status(), "mallory's status");
  CHECK(mallory_status.peers() == 0);
  cluster.ExpectUnharmed("after-stranger");
}

// ---------------------------------------------------------------------------------
// 3. Fake peers served by this process.

// kvagent.v1.Peer that answers every GetMetadata with the same metadata and records
// who called.
class FakePeer final : public v1::Peer::CallbackService {
 public:
  explicit FakePeer(v1::AgentMetadata reply) : reply_(std::move(reply)) {}

  grpc::ServerUnaryReactor* GetMetadata(grpc::CallbackServerContext* context,
                                        const v1::GetMetadataRequest* request,
                                        v1::AgentMetadata* reply) override {
    calls_.fetch_add(1);
    std::shared_ptr<const grpc::AuthContext> auth = context->auth_context();
    {
      std::lock_guard<std::mutex> lock(mu_);
      callers_ = auth ? agent::PeerIdentities(*auth) : std::vector<std::string>{};
    }
    *reply = reply_;
    auto* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  int calls() const { return calls_.load(); }
  std::vector<std::string> callers() const {
    std::lock_guard<std::mutex> lock(mu_);
    return callers_;
  }

 private:
  const v1::AgentMetadata reply_;
  std::atomic<int> calls_{0};
  mutable std::mutex mu_;
  std::vector<std::string> callers_;
};

struct FakeServer {
  FakePeer service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;

  FakeServer(v1::AgentMetadata reply, std::shared_ptr<grpc::ServerCredentials> credentials)
      : service(std::move(reply)) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", std::move(credentials), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    REQUIRE(server != nullptr);
    REQUIRE(port > 0);
  }
  ~FakeServer() { server->Shutdown(std::chrono::system_clock::now()); }
  std::string address() const { return fmt::format("127.0.0.1:{}", port); }
};

std::shared_ptr<grpc::ServerCredentials> TlsServer(const agent::TlsFiles& files) {
  auto credentials = agent::MakeServerCredentials(files);
  INFO(credentials.status().ToString());
  REQUIRE(credentials.ok());
  return *credentials;
}

// Metadata that passes the catalog's checks but whose worker address and rkeys are
// random bytes: what UCX would be handed if the link were not authenticated first.
v1::AgentMetadata GarbageMetadata(const std::string& name) {
  std::mt19937_64 rng(0xbadc0de);
  auto bytes = [&](size_t n) {
    std::string s(n, '\0');
    for (auto& c : s) c = static_cast<char>(rng());
    return s;
  };
  v1::AgentMetadata m;
  m.set_name(name);
  m.set_incarnation(rng());
  m.set_version(7);
  m.set_host_id(BootId());
  m.set_pid(1);
  m.set_worker_address(bytes(512));
  m.set_notify_secret(bytes(32));
  for (uint32_t i = 0; i < 4; ++i) {
    auto* r = m.add_regions();
    r->set_name(fmt::format("evil.L{}", i));
    r->set_kind(v1::KV);
    r->set_group("kv");
    r->set_group_position(i);
    r->set_memory(v1::DRAM);
    r->set_base_address(0x7f0000000000ull + i * 0x100000ull);
    r->set_length(16 * 4096);
    r->mutable_layout()->set_num_items(16);
    r->mutable_layout()->set_item_bytes(4096);
    r->set_rkey(bytes(96));
    r->set_memory_path("host");
  }
  return m;
}

// Sets an environment variable for this scope only (what UCX reads when a context is
// created), restoring what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  const std::optional<std::string>& old() const { return old_; }

 private:
  std::string name_;
  std::optional<std::string> old_;
};

TEST_CASE("fake peers: unauthenticated bytes never reach UCX, claims are not trusted") {
  Cluster cluster("fakes");
  cli::AgentClient& victim = *cluster.prefill_local;
  auto rogue = Require(cli::CertAuthority::Create(cluster.dir + "/rogue", "rogue"), "rogue CA");
  const auto carol = cluster.Issue("carol");

  {
    INFO("(a) plain TCP serving garbage");
    FakeServer fake(GarbageMetadata("carol"), grpc::InsecureServerCredentials());
    auto connected = victim.Connect(fake.address());
    ExpectPeerHandshakeRefused(connected, fake.address(), "wrong version number");
    CHECK(fake.service.calls() == 0);
    std::printf("(a) plain-TCP fake: %s; calls that reached the fake: %d\n",
                connected.status().ToString().c_str(), fake.service.calls());
    ExpectServing(victim, "prefill");
  }
  {
    INFO("(b) TLS, another CA's certificate, serving garbage");
    auto forged = Require(rogue.Issue("carol"), "rogue carol");
    forged.ca = cluster.ca->ca_path();  // it would accept the victim: only the victim refuses
    FakeServer fake(GarbageMetadata("carol"), TlsServer(Files(forged)));
    auto connected = victim.Connect(fake.address());
    ExpectPeerHandshakeRefused(connected, fake.address(), "certificate verify failed");
    CHECK(fake.service.calls() == 0);
    std::printf("(b) other-CA fake: %s; calls that reached the fake: %d\n",
                connected.status().ToString().c_str(), fake.service.calls());
    ExpectServing(victim, "prefill");
  }
  {
    INFO("(c) TLS, valid 'carol' certificate, metadata says 'decode'");
    FakeServer fake(GarbageMetadata("decode"), TlsServer(Files(carol)));
    auto connected = victim.Connect(fake.address());
    INFO(connected.status().ToString());
    REQUIRE_FALSE(connected.ok());
    CHECK(connected.status().code() == absl::StatusCode::kPermissionDenied);
    CHECK_THAT(Text(connected.status()),
               Contains("the agent at " + fake.address() + " calls itself 'decode'") &&
                   Contains("its certificate names [carol]"));
    // The fake was asked (the handshake passed) and saw the victim's certificate.
    CHECK(fake.service.calls() == 1);
    CHECK(fake.service.callers() == std::vector<std::string>{"prefill"});
    std::printf("(c) carol posing as decode: %s\n", connected.status().ToString().c_str());
    ExpectServing(victim, "prefill");
  }
  {
    INFO("(d) TLS, valid 'carol', the victim's host id, a real UCX worker");
    std::unique_ptr<transport::UcxContext> context;
    {
      // The fake's worker on loopback, where the victim's UCX is restricted too.
      ScopedEnv devices("UCX_NET_DEVICES", "lo");
      context = Require(transport::UcxContext::Create(), "creating the fake's UCX context");
    }
    auto worker = Require(transport::UcxWorker::Create(*context, "fake-carol"),
                          "creating the fake's UCX worker");
    v1::AgentMetadata metadata;
    metadata.set_name("carol");
    metadata.set_incarnation(0xca701ull << 20);
    metadata.set_version(1);
    metadata.set_host_id(BootId());
    metadata.set_pid(static_cast<uint32_t>(::getpid()));
    metadata.set_worker_address(worker->address());
    metadata.set_notify_secret(std::string(32, 'c'));
    REQUIRE_FALSE(metadata.host_id().empty());
    {
      FakeServer fake(metadata, TlsServer(Files(carol)));
      auto connected = victim.Connect(fake.address());
      INFO(connected.status().ToString());
      REQUIRE(connected.ok());
      INFO(connected->DebugString());
      CHECK(connected->name() == "carol");
      CHECK(connected->regions() == 0);
      CHECK(connected->state() == "connected");
      // Same boot id, yet not the same host: only the local door proves that.
      CHECK_FALSE(connected->same_host());
      CHECK(connected->data_path() == "ucx");
      CHECK(connected->error_mode() == "peer");
      CHECK(fake.service.callers() == std::vector<std::string>{"prefill"});
      std::printf(
          "(d) carol claiming host id %s: connected, same_host %s, data_path %s, "
          "error_mode %s, transports %s\n",
          metadata.host_id().c_str(), connected->same_host() ? "true" : "false",
          connected->data_path().c_str(), connected->error_mode().c_str(),
          connected->transports().c_str());
      ExpectServing(victim, "prefill");
      cluster.ExpectUnharmed("after-fakes");
    }
    // The fake's server goes first, then its worker; the victim marks carol
    // unreachable and keeps serving.
    worker.reset();
    context.reset();
  }
  ExpectServing(victim, "prefill");
}

// ---------------------------------------------------------------------------------
// 4. Where the agent listens.

struct Listener {
  std::string address;
  int port = 0;
  bool loopback = false;
};

std::set<std::string> SocketInodes(pid_t pid) {
  std::set<std::string> inodes;
  const std::string dir = fmt::format("/proc/{}/fd", pid);
  DIR* d = ::opendir(dir.c_str());
  REQUIRE(d != nullptr);
  while (struct dirent* e = ::readdir(d)) {
    char target[256];
    const std::string path = dir + "/" + e->d_name;
    const ssize_t n = ::readlink(path.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    const std::string link(target, static_cast<size_t>(n));
    if (link.rfind("socket:[", 0) == 0) inodes.insert(link.substr(8, link.size() - 9));
  }
  ::closedir(d);
  return inodes;
}

// The LISTEN rows of /proc/PID/net/tcp{,6} whose socket the process holds.
std::vector<Listener> TcpListeners(pid_t pid) {
  const std::set<std::string> inodes = SocketInodes(pid);
  std::vector<Listener> out;
  for (const bool v6 : {false, true}) {
    std::ifstream in(fmt::format("/proc/{}/net/{}", pid, v6 ? "tcp6" : "tcp"));
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
          timeout >> inode;
      if (state != "0A" || inodes.count(inode) == 0) continue;
      const size_t colon = local.find(':');
      const std::string hex = local.substr(0, colon);
      Listener l;
      l.port = static_cast<int>(std::stoul(local.substr(colon + 1), nullptr, 16));
      // The kernel prints each 32-bit word of the address as the CPU holds it.
      char text[INET6_ADDRSTRLEN] = {};
      if (!v6) {
        in_addr a{};
        a.s_addr = static_cast<uint32_t>(std::stoul(hex, nullptr, 16));
        ::inet_ntop(AF_INET, &a, text, sizeof(text));
        l.loopback = (ntohl(a.s_addr) >> 24) == 127;
      } else {
        in6_addr a{};
        for (int w = 0; w < 4; ++w) {
          const uint32_t word =
              static_cast<uint32_t>(std::stoul(hex.substr(w * 8, 8), nullptr, 16));
          std::memcpy(&a.s6_addr[w * 4], &word, 4);
        }
        ::inet_ntop(AF_INET6, &a, text, sizeof(text));
        l.loopback = IN6_IS_ADDR_LOOPBACK(&a) || (IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127);
      }
      l.address = text;
      out.push_back(l);
    }
  }
  return out;
}

TEST_CASE("UCX and gRPC listen on loopback only, for a local agent and a --listen 127.0.0.1 one") {
  // The agent's own restriction is under test: an inherited UCX_NET_DEVICES would win
  // over it, and UCX_TLS should be UCX's default.
  ScopedEnv devices("UCX_NET_DEVICES", nullptr);
  ScopedEnv transports("UCX_TLS", nullptr);
  if (devices.old())
    std::printf("note: UCX_NET_DEVICES=%s unset for this case\n", devices.old()->c_str());
  if (transports.old())
    std::printf("note: UCX_TLS=%s unset for this case\n", transports.old()->c_str());
  const std::string dir = MakeWorkDir("listen");
  auto ca = Require(cli::CertAuthority::Create(dir + "/cluster", "cluster"), "cluster CA");
  cli::DaemonProcess local_only = StartAgent(dir, "local-only", cli::NetworkDoor::kNone, {});
  cli::DaemonProcess networked = StartAgent(dir, "networked", cli::NetworkDoor::kTls,
                                            Files(Require(ca.Issue("networked"), "cert")));
  for (auto* process : {&local_only, &networked}) {
    const bool has_door = process->port() > 0;
    const std::vector<Listener> listeners = TcpListeners(process->pid());
    std::string found;
    for (const auto& l : listeners) found += fmt::format(" {}:{}", l.address, l.port);
    std::printf("%s (pid %d) listens on TCP:%s\n", has_door ? "networked" : "local-only",
                static_cast<int>(process->pid()), found.empty() ? " (nothing)" : found.c_str());
    for (const auto& l : listeners) {
      CAPTURE(l.address, l.port);
      CHECK(l.loopback);
    }
    if (has_door) {
      // The scan sees the gRPC door itself (gRPC binds a dual-stack socket, so it shows
      // as ::ffff:127.0.0.1), so a miss above would be a real miss.
      CHECK(std::any_of(listeners.begin(), listeners.end(), [&](const Listener& l) {
        return l.port == process->port() && l.loopback;
      }));
      // ... and UCX's tcp transport beside it.
      CHECK(listeners.size() >= 2);
    } else if (listeners.empty()) {
      std::printf(
          "note: local-only has no TCP listener with UCX_TLS unset (UCX's tcp "
          "transport did not listen)\n");
    }
    auto client = Client(process->address(), kLocalMs);
    ExpectServing(*client, has_door ? "networked" : "local-only");
  }
  const std::string log = ReadFile(local_only.log_path());
  CHECK_THAT(log, Contains("UCX data path restricted to interface(s) lo"));

  // Control, to show the scan is not blind: UCX_NET_DEVICES=all from the environment
  // wins over the agent's restriction, and UCX's tcp transport then also listens on
  // every other interface this machine has (none: nothing more to see).
  cli::DaemonProcess unrestricted = StartAgent(dir, "unrestricted", cli::NetworkDoor::kNone, {}, {},
                                               {{"UCX_NET_DEVICES", "all"}});
  std::string beyond;
  for (const auto& l : TcpListeners(unrestricted.pid())) {
    if (!l.loopback) beyond += fmt::format(" {}:{}", l.address, l.port);
  }
  std::printf("control: with UCX_NET_DEVICES=all, UCX also listens beyond loopback on:%s\n",
              beyond.empty() ? " (nothing: no other interface here)" : beyond.c_str());
}

// ---------------------------------------------------------------------------------
// 5. The insecure door.

TEST_CASE("--insecure-listen warns, and gives every plain caller every role") {
  const std::string dir = MakeWorkDir("insecure");
  cli::DaemonProcess open = StartAgent(dir, "open", cli::NetworkDoor::kInsecure, {});
  auto local = Client(open.address(), kLocalMs);
  auto pool = Require(cli::CreateKvPool(*local, "open", SmallShape()), "registering a pool");

  // The warning thread starts with the door; give it a moment to write.
  std::string log;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  while ((log = ReadFile(open.log_path())).find("INSECURE") == std::string::npos &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK_THAT(log, Contains("INSECURE: --insecure-listen 127.0.0.1:0 accepts calls from anyone"));
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("INSECURE") != std::string::npos) std::printf("open's log: %s\n", line.c_str());
  }

  auto plain = Client(open.network_address(), kAttackMs);
  auto status = Require(plain->Status(), "a plain caller's GetStatus");
  CHECK(status.network_door() == "insecure " + open.network_address());
  CHECK_THAT(status.network_door(), StartsWith("insecure 127.0.0.1:"));
  CHECK(status.caller() == "insecure");
  CHECK(std::vector<std::string>(status.caller_roles().begin(), status.caller_roles().end()) ==
        std::vector<std::string>{"engine", "scheduler", "peer"});
  // What that means: a stranger sees every region the engine registered.
  auto regions = Require(plain->Regions(), "a plain caller's ListRegions");
  CHECK(static_cast<size_t>(regions.regions_size()) == pool.region_names.size());
  std::printf(
      "plain caller on the insecure door: network_door '%s', caller '%s', %d regions "
      "visible\n",
      status.network_door().c_str(), status.caller().c_str(), regions.regions_size());
  ExpectServing(*local, "open");
}

TEST_CASE("a session without the engine or scheduler role cannot open a fast path ring") {
  // Only the peer role is left for the local uid (a same-host peer agent's session):
  // the ring would let it submit transfers, so it is refused like SubmitTransfer is.
  const std::string dir = MakeWorkDir("fastpeer");
  cli::DaemonProcess agent = StartAgent(dir, "peer-only", cli::NetworkDoor::kNone, {},
                                        {"--engine-uids", "none", "--scheduler-uids", "none"});
  auto local = Client(agent.address(), kLocalMs);
  auto session = Require(local->Session(), "attaching a session");
  auto before = Require(local->Status(), "status before");
  CHECK(std::vector<std::string>(before.caller_roles().begin(), before.caller_roles().end()) ==
        std::vector<std::string>{"peer"});

  auto refused = client::FastPath::Open(session);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK_THAT(Text(refused.status()), Contains("OpenFastPath") &&
                                         Contains("engine or scheduler role") &&
                                         Contains("--engine-uids or --scheduler-uids"));
  std::printf("peer-only session -> OpenFastPath: %s\n", refused.status().ToString().c_str());

  // Counted and logged; no ring was made; the session and the agent go on.
  auto after = Require(local->Status(), "status after");
  CHECK(after.refused_calls() == before.refused_calls() + 1);
  CHECK(after.fast_path_rings() == 0);
  const std::string log = ReadFile(agent.log_path());
  CHECK_THAT(log, Contains("open_fast_path"));
  ExpectServing(*local, "peer-only");
}

// ---------------------------------------------------------------------------------
// 6. The session socket: connections that never say hello.

// The agent's bounds (agent/session_server.h), as this test starts it.
constexpr uint32_t kMaxSessions = 8;
constexpr uint32_t kWaitingPerUid = kMaxSessions / 4;
constexpr int kHelloDeadlineMs = 5000;

// `n` raw SOCK_SEQPACKET connections to `path` that send nothing: what anyone who may
// connect() to the session socket can make.
std::vector<UniqueFd> Flood(const std::string& path, uint32_t n) {
  auto address = Require(client::MakeUnixAddress(path), "the session socket's address");
  std::vector<UniqueFd> fds;
  for (uint32_t i = 0; i < n; ++i) {
    UniqueFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    REQUIRE(fd);
    INFO("connect #" << i << " to " << path << ": " << std::strerror(errno));
    REQUIRE(connect(fd.get(), reinterpret_cast<const sockaddr*>(&address.address),
                    address.length) == 0);
    fds.push_back(std::move(fd));
  }
  return fds;
}

// The same from uid `uid` (root only): a thread of this process takes that effective
// uid for its connect()s, which is what SO_PEERCRED reports. Raw syscalls change the
// calling thread only (glibc's wrappers would change every thread). Its saved and
// file-system uid stay 0 so that it can reach the socket under TEST_TMPDIR: the uid
// stands for one that the socket's group lets in but that holds no role.
// FAILED_PRECONDITION when the thread cannot take the uid (not root, or a user
// namespace, such as Bazel's sandbox, that does not map it).
absl::StatusOr<std::vector<UniqueFd>> FloodAs(uid_t uid, const std::string& path, uint32_t n) {
  std::vector<UniqueFd> fds;
  absl::Status cannot;
  std::string error;
  std::thread([&] {
    if (syscall(SYS_setresuid, uid, uid, 0) != 0) {
      cannot = absl::FailedPreconditionError(
          fmt::format("this process cannot take uid {}: setresuid: {}", uid, std::strerror(errno)));
      return;
    }
    syscall(SYS_setfsuid, 0);
    auto address = client::MakeUnixAddress(path);
    for (uint32_t i = 0; i < n && address.ok(); ++i) {
      UniqueFd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
      if (connect(fd.get(), reinterpret_cast<const sockaddr*>(&address->address),
                  address->length) != 0) {
        error = fmt::format("connect #{} as uid {}: {}", i, uid, std::strerror(errno));
        return;
      }
      fds.push_back(std::move(fd));
    }
  }).join();
  if (!cannot.ok()) return cannot;
  INFO(error);
  REQUIRE(error.empty());
  REQUIRE(fds.size() == n);
  return fds;
}

// What the agent said on the flood's connections within `ms`: those it refused at once
// (a reply, then the end of the stream) and those it holds, waiting for their hello.
struct Sorted {
  std::vector<v1::SessionReply> refusals;
  std::vector<UniqueFd> held;
};

Sorted SortFlood(std::vector<UniqueFd> flood, size_t expected_refusals, int ms) {
  Sorted out;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (out.refusals.size() < expected_refusals && std::chrono::steady_clock::now() < until) {
    std::vector<pollfd> polled;
    for (const UniqueFd& fd : flood) {
      if (fd) polled.push_back({fd.get(), POLLIN, 0});
    }
    if (poll(polled.data(), polled.size(), 50) <= 0) continue;
    for (UniqueFd& fd : flood) {
      if (!fd) continue;
      v1::SessionReply reply;
      std::vector<UniqueFd> fds;
      if (!client::ReceiveMessage(fd.get(), &reply, &fds, 0).ok()) continue;
      v1::SessionReply more;
      CHECK(absl::IsUnavailable(client::ReceiveMessage(fd.get(), &more, &fds, 1000)));
      out.refusals.push_back(reply);
      fd.reset();
    }
  }
  for (UniqueFd& fd : flood) {
    if (fd) out.held.push_back(std::move(fd));
  }
  return out;
}

// Waits for the agent to close each held connection for want of a hello: a
// DEADLINE_EXCEEDED reply, then the end of the stream. Returns when the last one ended.
std::chrono::steady_clock::time_point ExpectClosedForNoHello(const std::vector<UniqueFd>& held) {
  for (const UniqueFd& fd : held) {
    v1::SessionReply reply;
    std::vector<UniqueFd> fds;
    absl::Status got = client::ReceiveMessage(fd.get(), &reply, &fds, kHelloDeadlineMs + 5000);
    INFO("a connection that sent nothing: " << got << " " << reply.DebugString());
    REQUIRE(got.ok());
    CHECK(reply.error_code() == static_cast<int>(absl::StatusCode::kDeadlineExceeded));
    CHECK_THAT(reply.error_message(), Contains("no hello within 5 s"));
    CHECK(absl::IsUnavailable(client::ReceiveMessage(fd.get(), &reply, &fds, 2000)));
  }
  return std::chrono::steady_clock::now();
}

long MsSince(std::chrono::steady_clock::time_point start,
             std::chrono::steady_clock::time_point end = std::chrono::steady_clock::now()) {
  return static_cast<long>(
      std::chrono::duration_cast<std::chrono::milliseconds>(end - start).count());
}

TEST_CASE("connections that never say hello cannot lock engines out of the session socket") {
  const std::string dir = MakeWorkDir("nohello");
  // Only this test's uid is an engine: uid 65534 below can connect but holds no role.
  cli::DaemonProcess agent =
      StartAgent(dir, "guarded", cli::NetworkDoor::kNone, {},
                 {"--max-sessions", std::to_string(kMaxSessions), "--engine-uids",
                  std::to_string(getuid()), "--metrics-listen", "127.0.0.1:0"});
  const std::string session_path = agent.local_socket() + ".session";
  // An engine attached before the floods keeps its session through them.
  auto engine = Client(agent.address(), kLocalMs);
  auto pool = Require(cli::CreateKvPool(*engine, "guarded", SmallShape()), "registering a pool");
  REQUIRE(Require(engine->Status(), "status before").sessions() == 1);

  // A uid without a role opens --max-sessions connections and says nothing: it holds
  // its share, the rest are refused at once naming it, and an engine attaches while
  // the held ones still wait (well within their deadline).
  auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::vector<UniqueFd>> stranger = FloodAs(65534, session_path, kMaxSessions);
  if (stranger.ok()) {
    Sorted flood =
        SortFlood(*std::move(stranger), kMaxSessions - kWaitingPerUid, 2000);
    std::printf("uid 65534 opened %u connections sending nothing: %zu refused at once, %zu held\n",
                kMaxSessions, flood.refusals.size(), flood.held.size());
    CHECK(flood.held.size() == kWaitingPerUid);
    CHECK(flood.refusals.size() == kMaxSessions - kWaitingPerUid);
    for (const auto& refusal : flood.refusals) {
      CHECK(refusal.error_code() == static_cast<int>(absl::StatusCode::kResourceExhausted));
      CHECK_THAT(refusal.error_message(),
                 Contains("uid 65534 already has 2 connections waiting for their hello") &&
                     Contains("the bound per uid (2: a quarter of --max-sessions 8)"));
    }
    if (!flood.refusals.empty()) {
      std::printf("refusal: %s\n", flood.refusals[0].error_message().c_str());
    }
    auto newcomer = Client(agent.address(), kLocalMs);
    auto during = newcomer->Status();
    const long attached_ms = MsSince(start);
    INFO("a new engine during the flood: " << during.status());
    REQUIRE(during.ok());
    CHECK(during->sessions() == 2);
    CHECK(attached_ms < kHelloDeadlineMs);
    std::printf("a new engine attached %ld ms after the flood began (sessions: %lu)\n", attached_ms,
                static_cast<unsigned long>(during->sessions()));
    const long closed_ms = MsSince(start, ExpectClosedForNoHello(flood.held));
    std::printf("uid 65534's held connections closed %ld ms after they opened\n", closed_ms);
    CHECK(closed_ms >= kHelloDeadlineMs - 500);
    ExpectServing(*newcomer, "guarded");
  } else {
    std::printf("note: the flood from another uid is skipped: %s\n",
                stranger.status().ToString().c_str());
  }

  // The same from an engine's own uid: again only its share is held. Once those are
  // closed for want of a hello, every slot is free for engines again.
  start = std::chrono::steady_clock::now();
  Sorted flood =
      SortFlood(Flood(session_path, kMaxSessions), kMaxSessions - kWaitingPerUid, 2000);
  std::printf("uid %u opened %u connections sending nothing: %zu refused at once, %zu held\n",
              static_cast<unsigned>(getuid()), kMaxSessions, flood.refusals.size(),
              flood.held.size());
  CHECK(flood.held.size() == kWaitingPerUid);
  CHECK(flood.refusals.size() == kMaxSessions - kWaitingPerUid);
  const long closed_ms = MsSince(start, ExpectClosedForNoHello(flood.held));
  std::printf("uid %u's held connections closed %ld ms after they opened\n",
              static_cast<unsigned>(getuid()), closed_ms);
  std::vector<std::unique_ptr<cli::AgentClient>> engines;
  for (uint32_t i = 1; i < kMaxSessions; ++i) {
    engines.push_back(Client(agent.address(), kLocalMs));
    INFO("engine #" << i << " after the flood");
    REQUIRE(engines.back()->Status().ok());
  }
  auto full = Require(engine->Status(), "status with every slot taken");
  CHECK(full.sessions() == kMaxSessions);
  std::printf("after the flood: %lu sessions attached (--max-sessions %u)\n",
              static_cast<unsigned long>(full.sessions()), kMaxSessions);
  // One more is refused as it connects: every slot is taken.
  auto over = Client(agent.address(), kLocalMs);
  CHECK(over->Status().status().code() == absl::StatusCode::kResourceExhausted);
  over.reset();

  // GetStatus counts each refusal of the session socket: per flood, those over the
  // uid's share refused at once and its held ones closed for want of a hello; and the
  // one refused as it connected.
  const size_t floods = stranger.ok() ? 2 : 1;
  const v1::AgentStatus counted = Require(engine->Status(), "status after the refusals");
  CHECK(counted.sessions_refused_waiting() == floods * (kMaxSessions - kWaitingPerUid));
  CHECK(counted.sessions_hello_timeouts() == floods * kWaitingPerUid);
  CHECK(counted.sessions_refused_connecting() == 1);
  CHECK(counted.sessions_refused_releasing() == 0);
  // And so do the metrics.
  const std::string metrics = Scrape(MetricsAddress(*engine));
  CHECK(Value(metrics, "kvagent_sessions_refused_waiting_total") ==
        floods * (kMaxSessions - kWaitingPerUid));
  CHECK(Value(metrics, "kvagent_sessions_hello_timeouts_total") == floods * kWaitingPerUid);
  CHECK(Value(metrics, "kvagent_sessions_refused_connecting_total") == 1);
  CHECK(Value(metrics, "kvagent_sessions_refused_releasing_total") == 0);
  // `kvagentctl status` prints them on its sessions line (it needs a slot: one engine
  // detaches, and its release ends first).
  engines.pop_back();
  for (int i = 0; i < 400; ++i) {
    const v1::AgentStatus status = Require(engine->Status(), "status after a detach");
    if (status.sessions() < kMaxSessions && status.sessions_releasing() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  const absl::StatusOr<std::string> printed =
      KvagentctlOutput({"--agent", agent.address(), "status"}, dir + "/status.txt");
  INFO(printed.status() << "\n" << printed.value_or(""));
  REQUIRE(printed.ok());
  CHECK_THAT(*printed,
             Contains(fmt::format(", {} closed for no hello in time", floods * kWaitingPerUid)) &&
                 Contains(fmt::format(", {} closed over the bounds of connections waiting for "
                                      "a hello",
                                      floods * (kMaxSessions - kWaitingPerUid))) &&
                 Contains(", 1 refused as they connected"));
  CHECK_THAT(*printed, !Contains("refused while ended ones counted"));

  // The first engine's session and its regions were never touched.
  auto regions = Require(engine->Regions(), "the first engine's regions");
  CHECK(static_cast<size_t>(regions.regions_size()) == pool.region_names.size());
  // Logged once per burst, each line naming the uid, the count and the bound.
  const std::string log = ReadFile(agent.log_path());
  const size_t refusal_lines = Occurrences(log, "already has 2 connections waiting for their hello");
  const size_t timeout_lines = Occurrences(log, "that sent no hello within 5 s");
  std::printf("agent's log: %zu refusal line(s), %zu timeout line(s)\n", refusal_lines,
              timeout_lines);
  CHECK(refusal_lines == floods);
  CHECK(timeout_lines == floods);
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("waiting for their hello") != std::string::npos ||
        line.find("sent no hello") != std::string::npos) {
      std::printf("guarded's log: %s\n", line.c_str());
    }
  }
}

// Each uid within its share (a quarter of --max-sessions), four uids together would
// still hold every slot: all uids' waiting connections are bounded to half, and past it
// the one waiting longest is closed (an engine whose hello is on its way is not refused).
TEST_CASE("connections of several uids that never say hello cannot lock engines out together") {
  const std::string dir = MakeWorkDir("uids");
  cli::DaemonProcess agent =
      StartAgent(dir, "shared", cli::NetworkDoor::kNone, {},
                 {"--max-sessions", std::to_string(kMaxSessions), "--engine-uids",
                  std::to_string(getuid())});
  const std::string session_path = agent.local_socket() + ".session";
  constexpr uint32_t kWaitingInAll = kMaxSessions / 2;
  const auto start = std::chrono::steady_clock::now();
  std::vector<UniqueFd> flood;
  for (uid_t uid = 65531; uid <= 65534; ++uid) {
    absl::StatusOr<std::vector<UniqueFd>> share = FloodAs(uid, session_path, kWaitingPerUid);
    if (!share.ok()) KVAGENT_SKIP(share.status().ToString());
    for (UniqueFd& fd : *share) flood.push_back(std::move(fd));
  }
  // The first four wait; each later one closes the one waiting longest.
  Sorted sorted = SortFlood(std::move(flood), kMaxSessions - kWaitingInAll, 2000);
  std::printf("uids 65531-65534 opened %u connections each (their share), %u in all, sending "
              "nothing: %zu closed, %zu held\n",
              kWaitingPerUid, kMaxSessions, sorted.refusals.size(), sorted.held.size());
  CHECK(sorted.held.size() == kWaitingInAll);
  CHECK(sorted.refusals.size() == kMaxSessions - kWaitingInAll);
  for (const auto& refusal : sorted.refusals) {
    CHECK(refusal.error_code() == static_cast<int>(absl::StatusCode::kResourceExhausted));
    CHECK_THAT(refusal.error_message(),
               Contains("5 connections of all uids were waiting for their hello") &&
                   Contains("over the bound for all together (4: half of --max-sessions 8)") &&
                   Contains("had waited longest"));
  }
  if (!sorted.refusals.empty()) {
    std::printf("closed: %s\n", sorted.refusals[0].error_message().c_str());
  }
  // Engines attach while those still wait (closing them as they come, when their hello
  // is not there yet at accept).
  std::vector<std::unique_ptr<cli::AgentClient>> engines;
  for (uint32_t i = 0; i < kMaxSessions - kWaitingInAll; ++i) {
    engines.push_back(Client(agent.address(), kLocalMs));
    auto status = engines.back()->Status();
    INFO("engine #" << i << " during the flood: " << status.status());
    REQUIRE(status.ok());
  }
  const long attached_ms = MsSince(start);
  std::printf("%u engines attached %ld ms after the flood began\n",
              kMaxSessions - kWaitingInAll, attached_ms);
  CHECK(attached_ms < kHelloDeadlineMs);
  // Each held connection ends: closed for want of a hello, or to make room for an engine.
  for (const UniqueFd& fd : sorted.held) {
    v1::SessionReply reply;
    std::vector<UniqueFd> fds;
    absl::Status got = client::ReceiveMessage(fd.get(), &reply, &fds, kHelloDeadlineMs + 5000);
    INFO("a connection that sent nothing: " << got << " " << reply.DebugString());
    REQUIRE(got.ok());
    CHECK((reply.error_code() == static_cast<int>(absl::StatusCode::kDeadlineExceeded) ||
           reply.error_message().find("had waited longest") != std::string::npos));
    CHECK(absl::IsUnavailable(client::ReceiveMessage(fd.get(), &reply, &fds, 2000)));
  }
  ExpectServing(*engines.front(), "shared");
}

// A session's end deregisters its regions, which waits for the registry's writer lock,
// and another engine's registration holds that lock while it maps and faults in its
// memory (seconds for a large pool). That wait must not run on the session socket's
// thread: every hello and every session request (ShareMemory, OpenFastPath) of every
// engine would wait behind it.
TEST_CASE("a session that ends while another engine registers a large pool holds up no attach") {
  const std::string dir = MakeWorkDir("release");
  cli::DaemonProcess agent = StartAgent(dir, "busy", cli::NetworkDoor::kNone, {});
  auto registering = Client(agent.address(), 120000);
  // 2 GiB in 64 regions of 32 MiB, allocated first: the registration then faults in
  // every page under the registry's writer lock (about 0.3 s a GiB here).
  constexpr uint64_t kRegionBytes = 32 << 20;
  constexpr int kRegions = 64;
  auto memory = Require(registering->AllocateMemory("large", kRegions * kRegionBytes),
                        "allocating 2 GiB");
  v1::RegisterRegionsRequest large;
  for (int r = 0; r < kRegions; ++r) {
    auto* spec = large.add_regions();
    spec->set_name(fmt::format("large.{}", r));
    spec->set_kind(v1::KV);
    spec->set_memory(v1::DRAM);
    spec->set_length(kRegionBytes);
    spec->mutable_layout()->set_num_items(kRegionBytes / 4096);
    spec->mutable_layout()->set_item_bytes(4096);
    spec->mutable_shm()->set_memory_handle(memory.info.handle());
    spec->mutable_shm()->set_offset(r * kRegionBytes);
  }
  // A session with regions of its own, registered before; it ends while the pool registers.
  auto holder = Client(agent.address(), kLocalMs);
  Require(cli::CreateKvPool(*holder, "holder", SmallShape()), "the holder's pool");

  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  std::atomic<bool> registered{false};
  Clock::time_point registered_at;
  absl::Status registration;
  std::thread registrar([&] {
    auto answer = registering->Register(large);
    registered_at = Clock::now();
    registration = answer.status();
    registered = true;
  });
  struct Joiner {
    std::thread& thread;
    ~Joiner() {
      if (thread.joinable()) thread.join();
    }
  } joiner{registrar};
  // Sessions that end while it runs: the holder, then short-lived clients (as
  // `kvagentctl status` is); after each, a new engine attaches and allocates memory.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  struct Round {
    Clock::time_point began, ended, registered;
  };
  std::vector<Round> rounds;
  holder.reset();  // its session closes; the agent releases its regions
  for (int round = 0; round < 20 && (round == 0 || !registered); ++round) {
    if (round > 0) {
      auto brief = Client(agent.address(), kLocalMs);
      Require(brief->Status(), "a brief session's status");
    }  // its session closes here
    Round r;
    r.began = Clock::now();
    auto newcomer = Client(agent.address(), kLocalMs);
    auto attached = newcomer->Status();
    INFO("a new engine while the large pool registers: " << attached.status());
    REQUIRE(attached.ok());
    auto shared = newcomer->AllocateMemory("newcomer", 1 << 20);
    INFO("its AllocateMemory: " << shared.status());
    REQUIRE(shared.ok());
    r.ended = Clock::now();
    // It registers a pool of its own and deregisters it.
    cli::KvPoolShape own = SmallShape();
    own.group = fmt::format("newcomer{}", round);
    auto pool = cli::CreateKvPool(*newcomer, own.group, own);
    INFO("its RegisterRegions: " << pool.status());
    REQUIRE(pool.ok());
    auto gone = newcomer->Deregister(pool->region_names);
    INFO("its DeregisterRegions: " << gone.status());
    REQUIRE(gone.ok());
    r.registered = Clock::now();
    rounds.push_back(r);
  }
  registrar.join();
  INFO("the large pool's registration: " << registration);
  REQUIRE(registration.ok());
  const long registration_ms = MsSince(start, registered_at);
  long slowest = 0, slowest_pool = 0;
  int during = 0;
  for (const Round& r : rounds) {
    if (r.began >= registered_at) continue;
    ++during;
    slowest = std::max(slowest, MsSince(r.began, r.ended));
    slowest_pool = std::max(slowest_pool, MsSince(r.ended, r.registered));
  }
  std::printf("a 2 GiB pool registered in %ld ms; %d sessions ended and %d new ones attached and "
              "allocated memory meanwhile, the slowest in %ld ms (the first in %ld ms); each "
              "registered and deregistered a pool of its own, the slowest in %ld ms\n",
              registration_ms, static_cast<int>(rounds.size()), during, slowest,
              MsSince(rounds[0].began, rounds[0].ended), slowest_pool);
  if (registration_ms < 200 || during == 0) {
    // Nothing ran beside it: a registration this fast proves nothing either way.
    WARN("the 2 GiB registration took only " << registration_ms
                                             << " ms: no attach ran while it did");
    return;
  }
  // The session socket's thread answered while the registration held the registry's
  // writer lock: the old build answered the first attach only once it ended.
  CHECK(rounds[0].ended < registered_at);
  CHECK(slowest < registration_ms / 2);
  // Nor did the large pool's page faults hold the registry: other engines registered
  // and deregistered meanwhile.
  CHECK(rounds[0].registered < registered_at);
  CHECK(slowest_pool < registration_ms / 2);
  // The holder's regions went with its session; the large pool's stayed.
  int regions = -1;
  for (int i = 0; i < 100 && regions != kRegions; ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    regions = Require(registering->Regions(), "regions after").regions_size();
  }
  CHECK(regions == kRegions);
}

// Engines that keep the registry's writer lock busy: each registers 16,384 regions of
// 4 KiB (--max-regions-per-owner) of one allocation in one call, then deregisters them,
// back to back until Stop. The lock covers each region's mapping and UCX registration
// (about 0.3 s a batch here), so a session that ends meanwhile waits in the releaser's
// queue. Each registrar is an attached session of its own.
class BusyRegistry {
 public:
  static constexpr int kRegistrars = 2;
  static constexpr uint64_t kRegionBytes = 4096;
  static constexpr int kRegions = 16384;

  explicit BusyRegistry(const std::string& address) {
    for (int k = 0; k < kRegistrars; ++k) {
      registrars_.push_back(Client(address, 120000));
      auto memory = Require(registrars_[k]->AllocateMemory(fmt::format("many{}", k),
                                                           kRegions * kRegionBytes),
                            "allocating a registrar's memory");
      for (int r = 0; r < kRegions; ++r) {
        auto* spec = batches_[k].add_regions();
        spec->set_name(fmt::format("many{}.{}", k, r));
        spec->set_kind(v1::KV);
        spec->set_memory(v1::DRAM);
        spec->set_length(kRegionBytes);
        spec->mutable_layout()->set_num_items(1);
        spec->mutable_layout()->set_item_bytes(kRegionBytes);
        spec->mutable_shm()->set_memory_handle(memory.info.handle());
        spec->mutable_shm()->set_offset(r * kRegionBytes);
        names_[k].push_back(spec->name());
      }
    }
    for (int k = 0; k < kRegistrars; ++k) {
      threads_.emplace_back([this, k] {
        while (!stop_ && failures_[k].ok()) {
          failures_[k] = registrars_[k]->Register(batches_[k]).status();
          if (failures_[k].ok()) failures_[k] = registrars_[k]->Deregister(names_[k]).status();
          ++registrations_;
        }
      });
    }
  }
  ~BusyRegistry() { Join(); }

  // Stops the registrars once their batch in progress is done, and checks that none
  // failed. Their sessions stay attached until this is destroyed.
  void Stop() {
    Join();
    for (int k = 0; k < kRegistrars; ++k) {
      INFO("registrar " << k << ": " << failures_[k]);
      CHECK(failures_[k].ok());
    }
  }
  int registrations() const { return registrations_.load(); }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<int> registrations_{0};
  std::vector<absl::Status> failures_ = std::vector<absl::Status>(kRegistrars);
  std::vector<std::unique_ptr<cli::AgentClient>> registrars_;
  std::vector<v1::RegisterRegionsRequest> batches_ =
      std::vector<v1::RegisterRegionsRequest>(kRegistrars);
  std::vector<std::vector<std::string>> names_ =
      std::vector<std::vector<std::string>>(kRegistrars);
  void Join() {
    stop_ = true;
    for (std::thread& t : threads_) t.join();
    threads_.clear();
  }

  std::vector<std::thread> threads_;
};

// GetStatus through `watcher` once no ended session waits for its release (or after
// 10 s, for the caller to check).
v1::AgentStatus AwaitReleased(cli::AgentClient& watcher) {
  v1::AgentStatus status;
  for (int i = 0; i < 400; ++i) {
    status = Require(watcher.Status(), "status while releases finish");
    if (status.sessions_releasing() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  return status;
}

// GetStatus counts the sessions that ended and whose regions are not released yet
// (sessions_releasing) and the oldest one's wait, and answers while the releases wait:
// it reads neither the registry's writer lock nor the releaser's progress. Registrations
// of many regions, back to back from two engines, hold the writer lock most of the time
// (it covers each region's mapping and UCX registration), so a session that ends
// meanwhile waits in the releaser's queue.
TEST_CASE("GetStatus counts ended sessions whose release waits behind registrations") {
  const std::string dir = MakeWorkDir("releasing");
  cli::DaemonProcess agent = StartAgent(dir, "releasing", cli::NetworkDoor::kNone, {});
  auto watcher = Client(agent.address(), kLocalMs);
  const v1::AgentStatus idle = Require(watcher->Status(), "status before");
  CHECK(idle.sessions_releasing() == 0);
  CHECK(idle.oldest_release_wait_ms() == 0);

  BusyRegistry busy(agent.address());
  constexpr int kRegions = BusyRegistry::kRegions;

  // Sessions end while they run, two at a time (short-lived clients, as `kvagentctl
  // status` is), each with a small pool of its own: the releaser takes the first and
  // waits for the lock, the second waits in its queue. Each pair starts from none
  // waiting, as the registry says too (its pools gone), and GetStatus is asked meanwhile.
  using Clock = std::chrono::steady_clock;
  struct Sample {
    uint64_t releasing = 0, oldest_ms = 0;
  };
  std::vector<Sample> samples;
  constexpr int kPair = 2;
  const int pool_regions = static_cast<int>(SmallShape().layers * SmallShape().tensors_per_layer);
  int ended = 0;
  bool seen_pair = false, seen_growing = false;
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (!(seen_pair && seen_growing) && Clock::now() < deadline) {
    // Every earlier pair released: the gauge at 0 and their pools gone (the registrars
    // hold whole batches of kRegions).
    v1::AgentStatus settled;
    for (int i = 0; i < 400; ++i) {
      settled = Require(watcher->Status(), "status between pairs");
      if (settled.sessions_releasing() == 0 && settled.regions() % kRegions == 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    REQUIRE(settled.sessions_releasing() == 0);
    REQUIRE(settled.regions() % kRegions == 0);
    CHECK(settled.oldest_release_wait_ms() == 0);
    std::vector<std::unique_ptr<cli::AgentClient>> brief;
    for (int b = 0; b < kPair; ++b) {
      brief.push_back(Client(agent.address(), kLocalMs));
      cli::KvPoolShape shape = SmallShape();
      shape.group = fmt::format("brief{}", ended + b);
      auto pool = cli::CreateKvPool(*brief.back(), shape.group, shape);
      INFO("a brief session's pool: " << pool.status());
      REQUIRE(pool.ok());
      REQUIRE(static_cast<int>(pool->region_names.size()) == pool_regions);
    }
    // Their registrations just had the lock: close at another moment of a batch's.
    std::this_thread::sleep_for(std::chrono::milliseconds(40 * (1 + ended / kPair % 4)));
    const auto closed = Clock::now();  // before they close
    brief.clear();  // their sessions close here
    ended += kPair;
    std::optional<Sample> previous;
    for (int i = 0; i < 200; ++i) {
      const v1::AgentStatus status = Require(watcher->Status(), "status meanwhile");
      const Sample sample{status.sessions_releasing(), status.oldest_release_wait_ms()};
      // At most this pair, waiting no longer than since it closed.
      CHECK(sample.releasing <= kPair);
      CHECK(sample.oldest_ms <= static_cast<uint64_t>(MsSince(closed, Clock::now())) + 1);
      if (sample.releasing == 0) CHECK(sample.oldest_ms == 0);
      if (sample.releasing == kPair) seen_pair = true;
      if (previous && previous->releasing > 0 && sample.releasing > 0 &&
          sample.oldest_ms > previous->oldest_ms) {
        seen_growing = true;
      }
      samples.push_back(sample);
      previous = sample;
      if (sample.releasing == 0 && i > 0) break;  // both released: the next pair
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  busy.Stop();
  uint64_t most = 0, longest = 0;
  for (const Sample& sample : samples) {
    most = std::max(most, sample.releasing);
    longest = std::max(longest, sample.oldest_ms);
  }
  std::printf("%d sessions ended while %d registrations of %d regions ran; GetStatus asked %zu "
              "times: at most %lu ended sessions not released yet, the oldest waiting %lu ms\n",
              ended, busy.registrations(), kRegions, samples.size(),
              static_cast<unsigned long>(most), static_cast<unsigned long>(longest));
  CHECK(seen_pair);
  CHECK(seen_growing);

  // Once the registrations stopped, every release ends and the gauge is back to 0.
  const v1::AgentStatus after = AwaitReleased(*watcher);
  CHECK(after.sessions_releasing() == 0);
  CHECK(after.oldest_release_wait_ms() == 0);
}

// Sessions that ended and whose regions are not released yet count against
// --max-sessions with those attached: each still holds its regions (registered and
// mapped) until the releaser, waiting behind registrations that hold the registry,
// deregisters them. Opening and closing sessions meanwhile fills the slots; the next
// one is refused naming both counts and the flag, counted in GetStatus, the sessions
// attached go on working, and once the releases finished sessions are accepted again.
TEST_CASE("sessions ended and not released yet count against --max-sessions") {
  using Clock = std::chrono::steady_clock;
  constexpr uint64_t kLimit = 5;
  const std::string dir = MakeWorkDir("fullreleasing");
  cli::DaemonProcess agent = StartAgent(dir, "fullreleasing", cli::NetworkDoor::kNone, {},
                                        {"--max-sessions", std::to_string(kLimit)});
  auto watcher = Client(agent.address(), kLocalMs);
  REQUIRE(Require(watcher->Status(), "status before").sessions() == 1);
  BusyRegistry busy(agent.address());
  constexpr uint64_t kAttached = 1 + BusyRegistry::kRegistrars;  // the watcher, registrars
  REQUIRE(Require(watcher->Status(), "status with the registrars").sessions() == kAttached);

  // Brief sessions (a GetStatus each, as `kvagentctl status`) open and close one after
  // another, each once the last one's close was seen, until one is refused: the
  // attached ones leave kLimit - kAttached slots, and each ended session takes one
  // until its release (behind the registrations) finished.
  std::optional<absl::Status> refused;
  int accepted = 0;
  uint64_t most_releasing = 0;
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (!refused.has_value() && Clock::now() < deadline) {
    auto brief = Client(agent.address(), kLocalMs);
    absl::StatusOr<v1::AgentStatus> seen = brief->Status();
    if (!seen.ok()) {
      refused = seen.status();
      break;
    }
    ++accepted;
    // It was let in only with a slot free; none opened since.
    CHECK(seen->sessions() + seen->sessions_releasing() <= kLimit);
    brief.reset();  // its session closes here
    for (int i = 0; i < 400; ++i) {
      const v1::AgentStatus status = Require(watcher->Status(), "status after a brief session");
      most_releasing = std::max(most_releasing, status.sessions_releasing());
      if (status.sessions() == kAttached) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  INFO(accepted << " brief sessions accepted, at most " << most_releasing
                << " ended ones not released at once");
  REQUIRE(refused.has_value());
  std::printf("after %d brief sessions (at most %lu ended and not released at once), one "
              "refused: %s\n",
              accepted, static_cast<unsigned long>(most_releasing), refused->ToString().c_str());
  CHECK(refused->code() == absl::StatusCode::kResourceExhausted);
  const std::string text = Text(*refused);
  CHECK_THAT(text, Contains("ended sessions whose regions are not released yet reach the limit "
                            "of --max-sessions (5)") &&
                       Contains("releases wait behind registrations holding the registry") &&
                       Contains("retry shortly, or raise --max-sessions"));
  std::smatch counts;
  REQUIRE(std::regex_search(text, counts,
                            std::regex("([0-9]+) sessions attached and ([0-9]+) ended sessions")));
  const uint64_t attached = std::stoull(counts[1]);
  const uint64_t releasing = std::stoull(counts[2]);
  CHECK(attached < kLimit);
  CHECK(releasing >= 1);
  CHECK(attached + releasing == kLimit);

  // The sessions attached are untouched: the watcher's (and the registrars', checked
  // when they stop) calls go on; the refusal is counted.
  const v1::AgentStatus during = Require(watcher->Status(), "status after the refusal");
  CHECK(during.sessions() == kAttached);
  CHECK(during.sessions_refused_releasing() == 1);
  const int registrations = busy.registrations();
  for (int i = 0; i < 400 && busy.registrations() < registrations + 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  CHECK(busy.registrations() >= registrations + 2);

  // Once the registrations stopped, every release ends and sessions are accepted again.
  busy.Stop();
  REQUIRE(AwaitReleased(*watcher).sessions_releasing() == 0);
  auto newcomer = Client(agent.address(), kLocalMs);
  const v1::AgentStatus accepted_again = Require(newcomer->Status(), "a new session after");
  CHECK(accepted_again.sessions() == kAttached + 1);
  CHECK(accepted_again.sessions_refused_releasing() == 1);
}

}  // namespace
}  // namespace kvagent::testing
