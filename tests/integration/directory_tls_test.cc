// The fleet directory over TLS (`--directory etcds://...`): a real etcd 3.4 serving
// its client URL over https and asking for client certificates, certificates from a
// throwaway CA (cli/cert_authority). Agents that present the right files publish,
// list the fleet and connect by name; an agent that does not trust etcd's
// certificate, one with no client certificate, and one speaking plain HTTP to it
// publish nothing and say which of those it is; bad TLS flags stop the agent at start.
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "cli/cert_authority.h"
#include "cli/daemon_process.h"
#include "tests/integration/etcd_fixture.h"
#include "tests/unit/catch_main.h"

namespace kvagent::testing {
namespace {

using Catch::Matchers::Contains;

struct Certificates {
  std::string dir = FleetWorkDir("tls");
  cli::CertAuthority ca = Require(cli::CertAuthority::Create(dir, "etcd-ca"), "a CA");
  cli::CertAuthority stranger = Require(cli::CertAuthority::Create(dir, "other-ca"), "a CA");
  cli::TlsFilePaths etcd = Require(ca.Issue("etcd", {{}, {"127.0.0.1"}}), "etcd's certificate");
  cli::TlsFilePaths agent = Require(ca.Issue("agent"), "the agents' certificate");

  EtcdTls ForEtcd() const { return {etcd.cert, etcd.key, ca.ca_path(), true, agent.cert, agent.key}; }
  std::vector<std::string> AgentFlags() const {
    return {"--directory-ca", ca.ca_path(), "--directory-cert", agent.cert, "--directory-key",
            agent.key};
  }
};

std::string LastError(FleetAgent& agent) {
  return Require(agent.client->Agents(), "ListAgents").last_error();
}

TEST_CASE("directory over TLS: agents with client certificates publish and connect by name") {
  NEEDS_ETCD();
  Certificates certs;
  Etcd etcd(1, certs.ForEtcd());
  REQUIRE(etcd.url().rfind("etcds://", 0) == 0);
  FleetAgent prefill(certs.dir, "prefill", etcd.url(), certs.AgentFlags());
  FleetAgent decode(certs.dir, "decode", etcd.url(), certs.AgentFlags());

  REQUIRE(WaitFor([&] {
    return Require(prefill.client->Agents(), "ListAgents").agents_size() == 2;
  }, 10000));
  auto fleet = Require(prefill.client->Agents(), "ListAgents");
  CHECK(fleet.published());
  CHECK(fleet.watching());
  CHECK(fleet.last_error().empty());
  auto info = Require(prefill.client->Connect("agent:decode"), "ConnectPeer agent:decode");
  CHECK(info.address() == decode.process.address());
}

TEST_CASE("directory over TLS: wrong CA, no client certificate and plain HTTP each named") {
  NEEDS_ETCD();
  Certificates certs;
  Etcd etcd(1, certs.ForEtcd());
  const std::string port = std::to_string(etcd.members[0]->client_port);
  struct Case {
    const char* name;
    std::string url;
    std::vector<std::string> flags;
    std::vector<std::string> texts;
  };
  const std::vector<Case> cases = {
      {"stranger", etcd.url(),
       {"--directory-ca", certs.stranger.ca_path(), "--directory-cert", certs.agent.cert,
        "--directory-key", certs.agent.key},
       {"etcd's certificate was not accepted", "--directory-ca"}},
      {"nocert", etcd.url(), {"--directory-ca", certs.ca.ca_path()},
       {"etcd refused this TLS session", "--directory-cert and --directory-key"}},
      {"plain", "etcd://127.0.0.1:" + port, {}, {"use etcds://"}},
  };
  for (const Case& c : cases) {
    FleetAgent agent(certs.dir, c.name, c.url, c.flags);
    std::string error;
    REQUIRE(WaitFor([&] {
      error = LastError(agent);
      return !error.empty();
    }, 10000));
    std::printf("%s: %s\n", c.name, error.c_str());
    INFO(c.name << ": " << error);
    for (const auto& text : c.texts) CHECK_THAT(error, Contains(text));
    auto fleet = Require(agent.client->Agents(), "ListAgents");
    CHECK_FALSE(fleet.published());
    CHECK(fleet.agents_size() == 0);
  }
}

TEST_CASE("directory over TLS: bad TLS flags are refused at start, naming flag and file") {
  Certificates certs;
  const std::string tls_url = "etcds://127.0.0.1:2379";
  for (const auto& [args, text] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--directory", "etcd://127.0.0.1:2379", "--directory-ca", certs.ca.ca_path()},
            "is plain etcd://: write etcds://"},
           {{"--directory", tls_url, "--directory-cert", certs.agent.cert},
            "--directory-cert is given without --directory-key"},
           {{"--directory", tls_url, "--directory-ca", certs.dir + "/missing.pem"},
            "cannot read it (No such file or directory)"},
           {{"--directory", tls_url, "--directory-ca", certs.agent.key}, "not a PEM CA certificate"},
           {{"--directory", tls_url, "--directory-cert", certs.agent.cert, "--directory-key",
             certs.etcd.key},
            "not the PEM private key of --directory-cert"}}) {
    cli::DaemonOptions d;
    d.binary = Require(cli::FindKvagentd(""), "finding kvagentd");
    d.name = "bad";
    d.work_dir = certs.dir;
    d.extra_args = args;
    d.start_timeout_ms = 5000;
    auto started = cli::DaemonProcess::Start(d);
    REQUIRE_FALSE(started.ok());
    std::printf("%s\n", std::string(started.status().message()).c_str());
    CHECK_THAT(std::string(started.status().message()), Contains(text));
  }
}

}  // namespace
}  // namespace kvagent::testing
