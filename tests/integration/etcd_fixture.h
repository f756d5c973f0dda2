// Real etcd processes and agents that publish in them, for the tests of the fleet
// directory (directory_test, fleet_test): etcd members on free loopback ports (one
// member or a cluster), and an agent with a KV pool started with --directory.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "catch2/catch.hpp"
#include "cli/agent_client.h"
#include "cli/daemon_process.h"
#include "cli/kv_pool.h"
#include "tests/unit/catch_main.h"

namespace kvagent::testing {

inline constexpr const char* kEtcdBinary = "/usr/bin/etcd";

// Skips the test case, saying why, where Debian's etcd-server is not installed.
#define NEEDS_ETCD()                                                                 \
  if (access(::kvagent::testing::kEtcdBinary, X_OK) != 0)                            \
  KVAGENT_SKIP("needs etcd 3.4 at /usr/bin/etcd (Debian's etcd-server, which "       \
               "deploy/bootstrap.sh installs)")

// The value, or the test fails naming `what` and the status.
template <typename T>
T Require(absl::StatusOr<T> value, const std::string& what) {
  INFO(what << ": " << value.status().ToString());
  REQUIRE(value.ok());
  return *std::move(value);
}

// A new folder under $TEST_TMPDIR (or /tmp) named after `tag`.
std::string FleetWorkDir(const std::string& tag);

// Polls `ready` every 50 ms for up to `ms`; its last answer.
bool WaitFor(const std::function<bool()>& ready, int ms);

// TLS on the members' client URLs (https://): their certificate and key, the CA that
// signed it (and, with client_cert_auth, the clients' certificates), and the client
// certificate the fixture's own readiness checks present.
struct EtcdTls {
  std::string cert, key, ca;
  bool client_cert_auth = false;
  std::string client_cert, client_key;
};

// One etcd member; `cluster` is the --initial-cluster of all members.
struct EtcdMember {
  std::string name, dir;
  int client_port = 0, peer_port = 0;
  pid_t pid = -1;
  std::optional<EtcdTls> tls;

  std::string client_url() const;
  std::string peer_url() const;
  std::string endpoint() const;  // 127.0.0.1:PORT

  void Start(const std::string& cluster);
  void Kill();
  ~EtcdMember() { Kill(); }
};

// 1 or 3 members, ready to answer.
struct Etcd {
  std::vector<std::unique_ptr<EtcdMember>> members;
  std::string cluster;

  explicit Etcd(int size, std::optional<EtcdTls> tls = std::nullopt);
  // etcd://HOST:PORT[,...] (etcds:// with TLS), the agents' --directory
  std::string url() const;
  static bool Ready(const EtcdMember& m);
};

// An agent with a KV pool (AgentPairOptions' shape) registered through its session,
// publishing in the directory at `url` (--directory-ttl-s 2), with `extra_args`.
struct FleetAgent {
  cli::DaemonProcess process;
  std::unique_ptr<cli::AgentClient> client;
  cli::KvPool pool;

  FleetAgent(const std::string& dir, const std::string& name, const std::string& url,
             const std::vector<std::string>& extra_args = {});
};

}  // namespace kvagent::testing
