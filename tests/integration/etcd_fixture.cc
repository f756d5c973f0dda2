#include "tests/integration/etcd_fixture.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "agent/etcd_client.h"
#include "cli/local_agents.h"
#include "fmt/format.h"
#include "proto/directory.pb.h"
#include "tests/integration/agent_pair.h"

extern char** environ;

namespace kvagent::testing {

std::string FleetWorkDir(const std::string& tag) {
  static int counter = 0;
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = fmt::format("{}/dir.{}.{}.{}", tmp ? tmp : "/tmp", tag, getpid(), counter++);
  std::filesystem::create_directories(dir);
  return dir;
}

bool WaitFor(const std::function<bool()>& ready, int ms) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < until) {
    if (ready()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return ready();
}

std::string EtcdMember::client_url() const {
  return fmt::format("{}://127.0.0.1:{}", tls ? "https" : "http", client_port);
}
std::string EtcdMember::peer_url() const { return fmt::format("http://127.0.0.1:{}", peer_port); }
std::string EtcdMember::endpoint() const { return fmt::format("127.0.0.1:{}", client_port); }

void EtcdMember::Start(const std::string& cluster) {
  std::vector<std::string> args = {kEtcdBinary,
                                   "--name", name,
                                   "--data-dir", dir + "/data",
                                   "--listen-client-urls", client_url(),
                                   "--advertise-client-urls", client_url(),
                                   "--listen-peer-urls", peer_url(),
                                   "--initial-advertise-peer-urls", peer_url(),
                                   "--initial-cluster", cluster,
                                   "--initial-cluster-state", "new",
                                   "--heartbeat-interval", "50",
                                   "--election-timeout", "500",
                                   "--log-level", "warn"};
  if (tls) {
    args.insert(args.end(), {"--cert-file", tls->cert, "--key-file", tls->key});
    if (tls->client_cert_auth) {
      args.insert(args.end(), {"--client-cert-auth", "--trusted-ca-file", tls->ca});
    }
  }
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  const std::string log = dir + "/etcd.log";
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                   O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  REQUIRE(posix_spawn(&pid, kEtcdBinary, &actions, nullptr, argv.data(), environ) == 0);
  posix_spawn_file_actions_destroy(&actions);
}

void EtcdMember::Kill() {
  if (pid <= 0) return;
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  pid = -1;
}

Etcd::Etcd(int size, std::optional<EtcdTls> tls) {
  const std::string dir = FleetWorkDir("etcd");
  for (int i = 0; i < size; ++i) {
    auto m = std::make_unique<EtcdMember>();
    m->name = fmt::format("e{}", i);
    m->dir = fmt::format("{}/{}", dir, m->name);
    m->tls = tls;
    std::filesystem::create_directories(m->dir);
    // etcd takes no port 0 (it must advertise its URLs): ports nobody listens on now.
    m->client_port = Require(cli::FreePort(), "a free loopback port");
    m->peer_port = Require(cli::FreePort(), "a free loopback port");
    cluster += fmt::format("{}{}={}", i ? "," : "", m->name, m->peer_url());
    members.push_back(std::move(m));
  }
  for (auto& m : members) m->Start(cluster);
  for (auto& m : members) REQUIRE(Ready(*m));
}

std::string Etcd::url() const {
  std::string out = !members.empty() && members[0]->tls ? "etcds://" : "etcd://";
  for (size_t i = 0; i < members.size(); ++i) out += (i ? "," : "") + members[i]->endpoint();
  return out;
}

bool Etcd::Ready(const EtcdMember& m) {
  agent::EtcdTlsContext tls;
  if (m.tls) {
    tls = Require(agent::MakeEtcdTlsContext({m.tls->ca, m.tls->client_cert, m.tls->client_key}),
                  "the readiness check's TLS context");
  }
  agent::EtcdClient client(
      {{"127.0.0.1", static_cast<uint16_t>(m.client_port), m.endpoint(), m.tls.has_value()}},
      absl::Milliseconds(500), tls);
  directory::EtcdRangeRequest range;
  range.set_key("/");
  directory::EtcdRangeResponse answer;
  return WaitFor([&] { return client.Call("/v3/kv/range", range, &answer).ok(); }, 20000);
}

FleetAgent::FleetAgent(const std::string& dir, const std::string& name, const std::string& url,
                       const std::vector<std::string>& extra_args) {
  cli::DaemonOptions d;
  d.binary = Require(cli::FindKvagentd(""), "finding kvagentd");
  d.name = name;
  d.work_dir = dir;
  d.extra_args = {"--directory", url, "--directory-ttl-s", "2"};
  d.extra_args.insert(d.extra_args.end(), extra_args.begin(), extra_args.end());
  process = Require(cli::DaemonProcess::Start(d), "starting " + name);
  client = std::make_unique<cli::AgentClient>(process.address());
  AgentPairOptions shape;
  pool = Require(cli::CreateKvPool(*client, name, shape.shape), name + "'s pool");
}

}  // namespace kvagent::testing
