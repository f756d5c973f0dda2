// The fleet directory (agent/directory, --directory) against real etcd 3.4 processes
// on free loopback ports: agents publish themselves and list the fleet, ConnectPeer
// "agent:NAME" resolves through etcd, a peer that dies or restarts is failed and
// reconnected by what etcd says (the agents' own polls are slowed to a minute, so only
// the directory can be what noticed), a peer that still answers is not failed for a forged
// record, a record rewritten in etcd 100 times costs one reconnect at a time, a
// prefix over one answer's bound is read in pages, etcd going away leaves established peers
// working and lookups failing clearly, and a 3-member cluster survives losing the
// member the agents talk to.
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "agent/etcd_client.h"
#include "base/unique_fd.h"
#include "catch2/catch.hpp"
#include "cli/agent_client.h"
#include "cli/daemon_process.h"
#include "cli/kv_pool.h"
#include "fmt/format.h"
#include "grpcpp/grpcpp.h"
#include "proto/directory.pb.h"
#include "proto/health.grpc.pb.h"
#include "tests/integration/agent_pair.h"
#include "tests/integration/etcd_fixture.h"
#include "tests/unit/catch_main.h"

namespace kvagent::testing {
namespace {

using Catch::Matchers::Contains;

// The agents' own polls of their peers slowed to a minute, and no metadata streams
// (whose end and keepalive would see a death first), so that only the directory can
// notice a peer's death or restart quickly.
const std::vector<std::string> kSlowPolls = {"--peer-refresh-ms", "60000", "--metadata-push",
                                             "off"};

// prefill and decode publishing in `etcd`, both listed, prefill connected to decode
// by name.
struct Fleet {
  std::string dir;
  FleetAgent prefill;
  std::unique_ptr<FleetAgent> decode;

  Fleet(const std::string& url, const std::string& tag);
};

// grpc.health.v1 Check of `service` on the agent's local door (no token needed).
bool Serving(const cli::DaemonProcess& agent, const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(agent.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = stub->Check(&context, request, &response);
  INFO(status.error_message());
  REQUIRE(status.ok());
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

v1::ListAgentsResponse Agents(cli::AgentClient& client) {
  return Require(client.Agents(), "ListAgents");
}

const v1::DirectoryAgent* Find(const v1::ListAgentsResponse& r, const std::string& name) {
  for (const auto& a : r.agents()) {
    if (a.name() == name) return &a;
  }
  return nullptr;
}

std::string PeerState(cli::AgentClient& client, const std::string& name, std::string* error) {
  auto peers = Require(client.Peers(), "ListPeers");
  for (const auto& p : peers.peers()) {
    if (p.name() != name) continue;
    if (error) *error = p.last_error();
    return p.state() + "/" + std::to_string(p.incarnation());
  }
  return "absent";
}

void PrintFleet(const char* when, cli::AgentClient& client) {
  auto r = Agents(client);
  std::printf("%s: published %d, watching %d, %d agents (%llu records ignored):", when,
              r.published(), r.watching(), r.agents_size(),
              static_cast<unsigned long long>(r.ignored_records()));
  for (const auto& a : r.agents()) std::printf(" %s(%s)", a.name().c_str(), a.peer_state().c_str());
  std::printf("%s%s\n", r.last_error().empty() ? "" : "; last error: ", r.last_error().c_str());
}

// Setup: both agents listed in the directory. Each publishes once it has started and
// the other's watch then sees it, which takes well under a second alone but several
// under ASan with the CI's other suites beside it: the wait is long, and a miss prints
// what the directory held.
void RequireBothListed(cli::AgentClient& client) {
  const bool listed = WaitFor([&] { return Agents(client).agents_size() == 2; }, 30000);
  if (!listed) PrintFleet("not both listed after 30 s", client);
  REQUIRE(listed);
}

Fleet::Fleet(const std::string& url, const std::string& tag)
    : dir(FleetWorkDir(tag)),
      prefill(dir, "prefill", url, kSlowPolls),
      decode(std::make_unique<FleetAgent>(dir, "decode", url, kSlowPolls)) {
  RequireBothListed(*prefill.client);
  REQUIRE(prefill.client->Connect("agent:decode").ok());
}

void WriteAndCheck(FleetAgent& prefill, FleetAgent& decode, const std::string& id, uint64_t page) {
  for (uint32_t r = 0; r < prefill.pool.regions(); ++r) {
    cli::FillPage(prefill.pool.Page(r, page), prefill.pool.shape.page_bytes, 11, r, page);
  }
  REQUIRE(prefill.client->Submit(KvWrite(id, {page}, {page})).ok());
  auto done = prefill.client->WaitTransfer(id, 20000);
  REQUIRE(done.ok());
  INFO(done->DebugString());
  REQUIRE(done->phase() == v1::COMPLETED);
  for (uint32_t r = 0; r < prefill.pool.regions(); ++r) {
    CHECK(std::memcmp(prefill.pool.Page(r, page), decode.pool.Page(r, page),
                      prefill.pool.shape.page_bytes) == 0);
  }
}

TEST_CASE("directory: agents publish, list the fleet, and connect by name") {
  NEEDS_ETCD();
  Etcd etcd(1);
  const std::string dir = FleetWorkDir("fleet");
  FleetAgent prefill(dir, "prefill", etcd.url(), kSlowPolls);
  FleetAgent decode(dir, "decode", etcd.url(), kSlowPolls);

  RequireBothListed(*prefill.client);
  auto fleet = Agents(*prefill.client);
  CHECK(fleet.published());
  CHECK(fleet.watching());
  CHECK(fleet.publishes() == 1);
  const v1::DirectoryAgent* d = Find(fleet, "decode");
  REQUIRE(d != nullptr);
  CHECK(d->local_socket() == decode.process.address());
  CHECK_FALSE(d->self());
  CHECK(d->peer_state().empty());
  CHECK(Find(fleet, "prefill")->self());
  PrintFleet("before connecting", *prefill.client);

  // By name: same host, so through decode's local door (memory by descriptor).
  auto info = Require(prefill.client->Connect("agent:decode"), "ConnectPeer agent:decode");
  CHECK(info.name() == "decode");
  CHECK(info.address() == decode.process.address());
  CHECK(Find(Agents(*prefill.client), "decode")->peer_state() == "connected");
  WriteAndCheck(prefill, decode, "by-name", 3);

  auto unknown = prefill.client->Connect("agent:nobody");
  REQUIRE_FALSE(unknown.ok());
  CHECK(unknown.status().code() == absl::StatusCode::kNotFound);
  CHECK_THAT(std::string(unknown.status().message()),
             Contains("no agent 'nobody'") && Contains("listed: [decode, prefill]") &&
                 Contains("--directory-prefix"));
  std::printf("ConnectPeer agent:nobody -> %s\n", unknown.status().ToString().c_str());

  // An agent that stops cleanly revokes its lease: it leaves the list at once.
  REQUIRE(Require(decode.process.Stop(), "stopping decode") == 0);
  CHECK(WaitFor([&] { return Find(Agents(*prefill.client), "decode") == nullptr; }, 1500));
}

TEST_CASE("directory: a peer that dies is failed, one that restarts is reconnected") {
  NEEDS_ETCD();
  Etcd etcd(1);
  Fleet fleet(etcd.url(), "restart");
  FleetAgent& prefill = fleet.prefill;
  std::unique_ptr<FleetAgent>& decode = fleet.decode;
  const std::string& dir = fleet.dir;
  WriteAndCheck(prefill, *decode, "before", 1);
  std::string first = PeerState(*prefill.client, "decode", nullptr);

  // Killed (no lease revoke): its record expires after the 2 s TTL; with polls a
  // minute apart, only the directory can mark it.
  const auto killed = std::chrono::steady_clock::now();
  decode->process.Kill();
  std::string error;
  REQUIRE(WaitFor([&] {
    return PeerState(*prefill.client, "decode", &error).rfind("unreachable", 0) == 0;
  }, 8000));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  std::printf("decode killed: marked unreachable after %.1f s: %s\n", seconds, error.c_str());
  CHECK_THAT(error, Contains("left the directory"));
  // A transfer submitted now fails at once, naming why.
  auto refused = prefill.client->Submit(KvWrite("to-the-dead", {2}, {2}));
  if (refused.ok()) {
    auto ended = prefill.client->WaitTransfer("to-the-dead", 5000);
    REQUIRE(ended.ok());
    CHECK(ended->phase() == v1::FAILED);
  } else {
    CHECK(refused.status().code() == absl::StatusCode::kUnavailable);
  }

  // Restarted with the same name: a new incarnation appears, prefill reconnects to it
  // without a ConnectPeer (the polls would take a minute).
  decode = std::make_unique<FleetAgent>(dir, "decode", etcd.url(), kSlowPolls);
  REQUIRE(WaitFor([&] {
    return PeerState(*prefill.client, "decode", nullptr).rfind("connected", 0) == 0;
  }, 8000));
  CHECK(PeerState(*prefill.client, "decode", nullptr) != first);
  // Its new pool is in the catalog prefill fetched, or is fetched at submit.
  WriteAndCheck(prefill, *decode, "after-restart", 5);

  // Killed and restarted before its lease expires: the record is replaced (another
  // incarnation) and prefill fails the old one and follows the new one.
  const std::string second = PeerState(*prefill.client, "decode", nullptr);
  decode->process.Kill();
  decode = std::make_unique<FleetAgent>(dir, "decode", etcd.url(), kSlowPolls);
  REQUIRE(WaitFor([&] {
    const std::string now = PeerState(*prefill.client, "decode", nullptr);
    return now.rfind("connected", 0) == 0 && now != second;
  }, 8000));
  WriteAndCheck(prefill, *decode, "after-quick-restart", 6);
}

TEST_CASE("directory: a stopped peer's lease expires, failing its transfer in flight") {
  NEEDS_ETCD();
  Etcd etcd(1);
  Fleet fleet(etcd.url(), "stopped");
  FleetAgent& prefill = fleet.prefill;
  FleetAgent& decode = *fleet.decode;
  WriteAndCheck(prefill, decode, "before-stop", 1);

  // Stopped, not dead: its endpoint raises no error and polls are a minute apart; the
  // WRITE below waits for decode's acknowledgement with a 60 s deadline. Only the
  // directory (decode's lease, 2 s, no longer kept alive) can end it sooner.
  REQUIRE(SuspendAgent(decode.process.pid()) == "");
  auto request = KvWrite("in-flight", {2}, {2}, "ready");
  request.set_timeout_ms(60000);
  REQUIRE(prefill.client->Submit(request).ok());
  const auto submitted = std::chrono::steady_clock::now();
  auto ended = prefill.client->WaitTransfer("in-flight", 15000);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - submitted).count();
  kill(decode.process.pid(), SIGCONT);
  REQUIRE(ended.ok());
  INFO(ended->DebugString());
  CHECK(ended->phase() == v1::FAILED);
  CHECK_THAT(ended->error_message(), Contains("left the directory"));
  CHECK(seconds < 10);
  std::printf("in-flight WRITE to a stopped peer failed after %.1f s: %s\n", seconds,
              ended->error_message().c_str());

  // Resumed: decode finds its lease gone, publishes again, and prefill reconnects.
  REQUIRE(WaitFor([&] { return Agents(*decode.client).publishes() == 2; }, 8000));
  REQUIRE(WaitFor([&] {
    return PeerState(*prefill.client, "decode", nullptr).rfind("connected", 0) == 0;
  }, 8000));
  WriteAndCheck(prefill, decode, "after-resume", 3);
}

TEST_CASE("directory: etcd gone leaves peers working and lookups failing clearly") {
  NEEDS_ETCD();
  Etcd etcd(1);
  Fleet fleet(etcd.url(), "etcdgone");
  FleetAgent& prefill = fleet.prefill;
  FleetAgent& decode = *fleet.decode;

  // Ready once published (the health monitor looks every 500 ms).
  CHECK(WaitFor([&] { return Serving(prefill.process, ""); }, 3000));
  etcd.members[0]->Kill();
  REQUIRE(WaitFor([&] { return !Agents(*prefill.client).watching(); }, 5000));
  PrintFleet("etcd killed", *prefill.client);
  // Not ready (peers cannot find it by name), still live (no restart for an etcd outage).
  CHECK(WaitFor([&] { return !Serving(prefill.process, ""); }, 6000));
  CHECK(Serving(prefill.process, "kvagent.liveness"));
  WriteAndCheck(prefill, decode, "without-etcd", 7);
  auto lookup = prefill.client->Connect("agent:decode");
  REQUIRE_FALSE(lookup.ok());
  CHECK(lookup.status().code() == absl::StatusCode::kUnavailable);
  CHECK_THAT(std::string(lookup.status().message()),
             Contains(etcd.members[0]->endpoint()) && Contains("connect by address"));
  std::printf("ConnectPeer agent:decode without etcd -> %s\n", lookup.status().ToString().c_str());
  // Longer than the TTL: established peers are not failed because etcd went away.
  std::this_thread::sleep_for(std::chrono::seconds(3));
  CHECK(PeerState(*prefill.client, "decode", nullptr).rfind("connected", 0) == 0);
  WriteAndCheck(prefill, decode, "still-without-etcd", 8);

  // etcd back (same data): both agents publish again and lookups work.
  etcd.members[0]->Start(etcd.cluster);
  REQUIRE(Etcd::Ready(*etcd.members[0]));
  REQUIRE(WaitFor([&] {
    auto r = Agents(*prefill.client);
    return r.watching() && r.published() && r.agents_size() == 2;
  }, 10000));
  PrintFleet("etcd back", *prefill.client);
  CHECK(WaitFor([&] { return Serving(prefill.process, ""); }, 3000));
  CHECK(prefill.client->Connect("agent:decode").ok());
  WriteAndCheck(prefill, decode, "etcd-back", 9);
}

TEST_CASE("directory: a 3-member etcd cluster loses the member the agents use") {
  NEEDS_ETCD();
  Etcd etcd(3);
  Fleet fleet(etcd.url(), "cluster");
  FleetAgent& prefill = fleet.prefill;
  FleetAgent& decode = *fleet.decode;

  // The agents start with the first endpoint; it goes.
  etcd.members[0]->Kill();
  // Their leases live on (keepalives move to another member) and the watch resumes.
  std::this_thread::sleep_for(std::chrono::seconds(3));
  REQUIRE(WaitFor([&] {
    auto r = Agents(*prefill.client);
    return r.watching() && r.published() && r.agents_size() == 2;
  }, 10000));
  PrintFleet("member e0 killed", *prefill.client);
  CHECK(Agents(*decode.client).published());
  CHECK(PeerState(*prefill.client, "decode", nullptr).rfind("connected", 0) == 0);
  CHECK(prefill.client->Connect("agent:decode").ok());
  WriteAndCheck(prefill, decode, "after-member-loss", 10);
}

TEST_CASE("directory: bad flags are refused at start, naming the flag") {
  const std::string dir = FleetWorkDir("flags");
  for (const auto& [args, text] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--directory", "http://127.0.0.1:2379"}, "does not start with etcd://"},
           {{"--directory", "etcd://127.0.0.1"}, "is not HOST:PORT"},
           {{"--directory", "etcd://127.0.0.1:2379", "--directory-ttl-s", "1"}, "--directory-ttl-s 1"},
           {{"--directory", "etcd://127.0.0.1:2379", "--directory-prefix", "kv"},
            "--directory-prefix 'kv'"}}) {
    cli::DaemonOptions d;
    d.binary = Require(cli::FindKvagentd(""), "finding kvagentd");
    d.name = "bad";
    d.work_dir = dir;
    d.extra_args = args;
    d.start_timeout_ms = 5000;
    auto started = cli::DaemonProcess::Start(d);
    REQUIRE_FALSE(started.ok());
    CHECK_THAT(std::string(started.status().message()), Contains(text));
  }
  // ListAgents on an agent without a directory says how to get one.
  AgentPair pair;
  auto none = pair.prefill().Agents();
  REQUIRE_FALSE(none.ok());
  CHECK(none.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(none.status().message()), Contains("--directory etcd://"));
  auto by_name = pair.prefill().Connect("agent:decode");
  REQUIRE_FALSE(by_name.ok());
  CHECK_THAT(std::string(by_name.status().message()), Contains("without a directory"));
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The number of threads of process `pid` (its /proc/PID/task entries).
int Threads(pid_t pid) {
  int count = 0;
  std::error_code ignored;
  for (const auto& entry :
       std::filesystem::directory_iterator(fmt::format("/proc/{}/task", pid), ignored)) {
    (void)entry;
    ++count;
  }
  return count;
}

// Whoever can write the directory's prefix in etcd can rewrite a peer's record as fast
// as etcd takes puts. A peer that still answers as itself must not be failed for it,
// and while one that does not answer is reconnected (at an address that accepts and
// never answers), the changes that keep coming must not each hold a thread: one
// attempt per peer at a time, the newest record followed after.
TEST_CASE("directory: forged or flapping records of a peer: asked first, one reconnect at a time") {
  NEEDS_ETCD();
  Etcd etcd(1);
  Fleet fleet(etcd.url(), "flap");
  FleetAgent& prefill = fleet.prefill;
  WriteAndCheck(prefill, *fleet.decode, "before", 1);

  // A local door that takes connections into its backlog and never answers them: its
  // gRPC socket and its session socket.
  // (Under /tmp: a Unix socket's path has 108 bytes, fewer than Bazel's TEST_TMPDIR.)
  char short_dir[] = "/tmp/kvagent-hole.XXXXXX";
  REQUIRE(mkdtemp(short_dir) != nullptr);
  const std::string hole = std::string(short_dir) + "/hole.sock";
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ignored;
      std::filesystem::remove_all(dir, ignored);
    }
  } cleanup{short_dir};
  std::vector<UniqueFd> listeners;
  for (const std::string& path : {hole, hole + ".session"}) {
    const int type = path == hole ? SOCK_STREAM : SOCK_SEQPACKET;  // as the agent's
    UniqueFd listener(socket(AF_UNIX, type | SOCK_CLOEXEC, 0));
    REQUIRE(listener.get() >= 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    REQUIRE(path.size() < sizeof(address.sun_path));
    std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
    REQUIRE(bind(listener.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
    REQUIRE(listen(listener.get(), 4096) == 0);
    listeners.push_back(std::move(listener));
  }

  // decode's record as etcd holds it.
  agent::EtcdClient etcd_client(Require(agent::ParseEtcdUrl(etcd.url()), "the etcd URL"),
                                absl::Seconds(5));
  const std::string key = "/kvagent/agents/decode";
  directory::EtcdRangeRequest range;
  range.set_key(key);
  directory::EtcdRangeResponse listed;
  REQUIRE(etcd_client.Call("/v3/kv/range", range, &listed).ok());
  REQUIRE(listed.kvs_size() == 1);
  directory::AgentRecord record;
  REQUIRE(agent::ParseEtcdJson(listed.kvs(0).value(), &record).ok());
  const std::string real_socket = record.local_socket();
  auto put = [&](const std::string& socket_address, uint64_t incarnation) {
    directory::AgentRecord forged = record;
    forged.set_local_socket(socket_address);
    forged.set_incarnation(incarnation);
    directory::EtcdPutRequest request;
    request.set_key(key);
    request.set_value(agent::EtcdJson(forged));
    directory::EtcdHeader ignored;
    REQUIRE(etcd_client.Call("/v3/kv/put", request, &ignored).ok());
  };

  const pid_t pid = prefill.process.pid();
  constexpr int kChanges = 100;
  uint64_t next_incarnation = record.incarnation() + 1;
  // Puts kChanges records, each a new incarnation at the silent socket, as fast as etcd
  // takes them, then waits 2 s (longer than the watch takes to deliver them); returns
  // the most threads prefill had meanwhile.
  auto flap = [&] {
    int most = Threads(pid);
    for (int i = 0; i < kChanges; ++i) {
      put("unix:" + hole, next_incarnation++);
      most = std::max(most, Threads(pid));
    }
    for (int i = 0; i < 40; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      most = std::max(most, Threads(pid));
    }
    return most;
  };

  // 1. Forged: decode still answers as the incarnation prefill holds, so prefill asks it
  // and stays connected through 100 false restarts and a false departure.
  const std::string connected = PeerState(*prefill.client, "decode", nullptr);
  REQUIRE(connected.rfind("connected", 0) == 0);
  int threads_before = Threads(pid);
  int most = flap();
  directory::EtcdDeleteRangeRequest remove;
  remove.set_key(key);
  directory::EtcdHeader removed;
  REQUIRE(etcd_client.Call("/v3/kv/deleterange", remove, &removed).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::printf("forged: prefill's threads %d before %d false restarts of decode, at most %d "
              "during; decode is %s\n",
              threads_before, kChanges, most,
              PeerState(*prefill.client, "decode", nullptr).c_str());
  CHECK(PeerState(*prefill.client, "decode", nullptr) == connected);
  CHECK(most <= threads_before + 4);
  WriteAndCheck(prefill, *fleet.decode, "after-forgeries", 2);
  const std::string log = ReadText(prefill.process.log_path());
  CHECK_THAT(log, Contains("still answers at its address: it stays connected"));

  // 2. decode stopped (it does not answer), its record flapping: prefill asks, gives up
  // after 2 s, fails it and reconnects at the silent socket; the changes that come
  // meanwhile wait behind that one attempt instead of each taking a connector thread.
  REQUIRE(SuspendAgent(fleet.decode->process.pid()) == "");
  threads_before = Threads(pid);
  most = flap();
  kill(fleet.decode->process.pid(), SIGCONT);
  // The real record again, as a new incarnation: prefill follows it once the attempt
  // at the silent socket has ended.
  put(real_socket, next_incarnation++);
  std::printf("stopped: prefill's threads %d before %d changes of decode's record, at most %d "
              "during\n",
              threads_before, kChanges, most);
  CHECK(most <= threads_before + 4);
  REQUIRE(WaitFor([&] {
    return PeerState(*prefill.client, "decode", nullptr).rfind("connected", 0) == 0;
  }, 20000));
  WriteAndCheck(prefill, *fleet.decode, "after-flaps", 3);
}

// Whoever can write the prefix can fill it: 300 values of 64 KiB that are no agent's
// record, about 26 MB as etcd's JSON answer, over the 16 MiB one answer may hold. The
// agents read the prefix in pages (halved while a page is too large), list each other,
// count the rest as ignored, and connect by name.
TEST_CASE("directory: a prefix over one answer's bound is read in pages") {
  NEEDS_ETCD();
  Etcd etcd(1);
  agent::EtcdClient etcd_client(Require(agent::ParseEtcdUrl(etcd.url()), "the etcd URL"),
                                absl::Seconds(10));
  const std::string junk(64 << 10, 'j');
  constexpr int kJunk = 300;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kJunk; ++i) {
    directory::EtcdPutRequest put;
    put.set_key(fmt::format("/kvagent/agents/junk-{:04}", i));
    put.set_value(junk);
    directory::EtcdHeader ignored;
    REQUIRE(etcd_client.Call("/v3/kv/put", put, &ignored).ok());
  }
  std::printf("%d values of 64 KiB put under /kvagent/agents/ in %lld ms\n", kJunk,
              static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                         std::chrono::steady_clock::now() - start)
                                         .count()));
  Fleet fleet(etcd.url(), "junk");  // both listed, prefill connected to decode by name
  auto listed = Agents(*fleet.prefill.client);
  PrintFleet("with the junk", *fleet.prefill.client);
  CHECK(listed.watching());
  CHECK(listed.agents_size() == 2);
  CHECK(listed.ignored_records() >= static_cast<uint64_t>(kJunk));
  WriteAndCheck(fleet.prefill, *fleet.decode, "through-the-junk", 1);
}

}  // namespace
}  // namespace kvagent::testing
