// Mutual TLS building blocks against a real grpc::Server on 127.0.0.1:0: who gets in
// (good certificate) and who does not (none, another CA's, expired), that clients verify
// the server's chain but not its host name, identities on both sides, the --tls-* file
// checks' messages, and the throwaway CertAuthority's certificates.
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "agent/tls.h"
#include "catch2/catch.hpp"
#include "cli/cert_authority.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_certificate_verifier.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "proto/kvagent.grpc.pb.h"

// Under --config=asan: Debian's c-ares 1.18 leaks 10 bytes inside ares_getaddrinfo each
// time gRPC's resolver looks up "localhost" (gone with GRPC_DNS_RESOLVER=native). Not
// ours; suppressed for this test only.
extern "C" const char* __lsan_default_suppressions() { return "leak:libcares.so\n"; }

namespace {

using kvagent::agent::CheckTlsFiles;
using kvagent::agent::IdentityMatches;
using kvagent::agent::MakeChannelCredentials;
using kvagent::agent::MakeServerCredentials;
using kvagent::agent::PeerIdentities;
using kvagent::agent::TlsFiles;
using kvagent::cli::CertAuthority;
using kvagent::cli::IssueOptions;
using kvagent::cli::TlsFilePaths;
namespace gx = grpc::experimental;

constexpr int64_t kDay = 24 * 3600;

TlsFiles Files(const TlsFilePaths& p) { return TlsFiles{p.cert, p.key, p.ca}; }

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteAll(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << data;
}

// Every certificate the tests need, made once per process under TEST_TMPDIR.
struct Pki {
  std::string dir;
  std::unique_ptr<CertAuthority> cluster;
  std::unique_ptr<CertAuthority> rogue;
  TlsFilePaths server;          // CN agent-server; SAN DNS:agent-server only (no IP, no localhost)
  TlsFilePaths server_local;    // CN agent-local; SAN DNS:localhost, IP:127.0.0.1
  TlsFilePaths client;          // CN agent-client; SAN DNS:agent-client, DNS:client-alias, IP
  TlsFilePaths expired_client;  // valid from now-2d to now-1d
  TlsFilePaths future_client;   // valid from now+1d
  TlsFilePaths rogue_client;    // issued by the rogue CA
  TlsFilePaths rogue_server;    // CN agent-server from the rogue CA, trusting the cluster CA

  static const Pki& Get() {
    static const Pki* pki = [] {
      auto* p = new Pki;
      const char* tmp = std::getenv("TEST_TMPDIR");
      p->dir = std::string(tmp != nullptr ? tmp : "/tmp") + "/tls_test_" +
               std::to_string(::getpid());
      auto cluster = CertAuthority::Create(p->dir + "/cluster", "cluster");
      auto rogue = CertAuthority::Create(p->dir + "/rogue", "rogue");
      REQUIRE(cluster.ok());
      REQUIRE(rogue.ok());
      p->cluster = std::make_unique<CertAuthority>(std::move(*cluster));
      p->rogue = std::make_unique<CertAuthority>(std::move(*rogue));
      auto issue = [](const CertAuthority& ca, const std::string& cn, IssueOptions o) {
        auto paths = ca.Issue(cn, o);
        INFO(paths.status().ToString());
        REQUIRE(paths.ok());
        return *paths;
      };
      p->server = issue(*p->cluster, "agent-server", {});
      IssueOptions local;
      local.dns_names = {"localhost"};
      local.ip_addresses = {"127.0.0.1", "::1"};
      p->server_local = issue(*p->cluster, "agent-local", local);
      IssueOptions client;
      client.dns_names = {"client-alias"};
      client.ip_addresses = {"127.0.0.1"};
      p->client = issue(*p->cluster, "agent-client", client);
      IssueOptions expired;
      expired.not_before_s = -2 * kDay;
      expired.not_after_s = -kDay;
      p->expired_client = issue(*p->cluster, "agent-expired", expired);
      IssueOptions future;
      future.not_before_s = kDay;
      future.not_after_s = 2 * kDay;
      p->future_client = issue(*p->cluster, "agent-future", future);
      p->rogue_client = issue(*p->rogue, "rogue-client", {});
      p->rogue_server = issue(*p->rogue, "agent-server", {});
      p->rogue_server.ca = p->cluster->ca_path();
      return p;
    }();
    return *pki;
  }
};

// kvagent.v1.Peer whose GetMetadata echoes what the server learned about the caller:
// name = PeerIdentities joined by ',', pid = 1 when IdentityMatches("agent-client").
class EchoPeer final : public kvagent::v1::Peer::CallbackService {
 public:
  grpc::ServerUnaryReactor* GetMetadata(grpc::CallbackServerContext* context,
                                        const kvagent::v1::GetMetadataRequest*,
                                        kvagent::v1::AgentMetadata* reply) override {
    calls_.fetch_add(1);
    std::shared_ptr<const grpc::AuthContext> auth = context->auth_context();
    reply->set_name(absl::StrJoin(PeerIdentities(*auth), ","));
    reply->set_pid(IdentityMatches(*auth, "agent-client") ? 1 : 0);
    auto* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  int calls() const { return calls_.load(); }

 private:
  std::atomic<int> calls_{0};
};

struct TestServer {
  EchoPeer service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;

  explicit TestServer(std::shared_ptr<grpc::ServerCredentials> credentials) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", std::move(credentials), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    REQUIRE(server != nullptr);
    REQUIRE(port > 0);
  }
  ~TestServer() { server->Shutdown(std::chrono::system_clock::now()); }
  std::string at(const std::string& host) const { return host + ":" + std::to_string(port); }
};

std::unique_ptr<TestServer> StartTlsServer(const TlsFilePaths& paths) {
  auto credentials = MakeServerCredentials(Files(paths));
  INFO(credentials.status().ToString());
  REQUIRE(credentials.ok());
  return std::make_unique<TestServer>(*credentials);
}

struct CallResult {
  grpc::Status status;
  kvagent::v1::AgentMetadata reply;
  std::vector<std::string> server_identities;  // as the client saw them after the call
  bool server_matches = false;                  // IdentityMatches(.., "agent-server")
};

// One GetMetadata on a fresh channel (own subchannel pool: no connection reuse between
// credentials), with a 3 s deadline.
CallResult Call(const std::string& target, std::shared_ptr<grpc::ChannelCredentials> creds,
                grpc::ChannelArguments args = {}, const std::string& authority = "") {
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto channel = grpc::CreateCustomChannel(target, std::move(creds), args);
  auto stub = kvagent::v1::Peer::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  if (!authority.empty()) context.set_authority(authority);
  kvagent::v1::GetMetadataRequest request;
  request.set_caller("tls_test");
  CallResult result;
  result.status = stub->GetMetadata(&context, request, &result.reply);
  std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth != nullptr) {
    result.server_identities = PeerIdentities(*auth);
    result.server_matches = IdentityMatches(*auth, "agent-server");
  }
  return result;
}

std::shared_ptr<grpc::ChannelCredentials> Ours(const TlsFilePaths& paths) {
  auto credentials = MakeChannelCredentials(Files(paths));
  INFO(credentials.status().ToString());
  REQUIRE(credentials.ok());
  return *credentials;
}

// The experimental TLS channel options as MakeChannelCredentials sets them, except for
// the verifier (null: gRPC's default) and check_call_host, to show what each one does.
std::shared_ptr<grpc::ChannelCredentials> TlsVariant(
    const TlsFilePaths& paths, std::shared_ptr<gx::CertificateVerifier> verifier,
    bool check_call_host, bool verify_server_certs = true) {
  auto provider = std::make_shared<gx::StaticDataCertificateProvider>(
      ReadAll(paths.ca),
      std::vector<gx::IdentityKeyCertPair>{{ReadAll(paths.key), ReadAll(paths.cert)}});
  gx::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(provider);
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(verify_server_certs);
  if (verifier != nullptr) options.set_certificate_verifier(verifier);
  options.set_check_call_host(check_call_host);
  return gx::TlsCredentials(options);
}

std::string Describe(const CallResult& r) {
  return "status " + std::to_string(r.status.error_code()) + ": " + r.status.error_message() +
         " | reply.name=" + r.reply.name() +
         " | server identities=" + absl::StrJoin(r.server_identities, ",");
}

}  // namespace

TEST_CASE("a client with a cluster certificate gets in, and both sides see identities") {
  const Pki& pki = Pki::Get();
  auto server = StartTlsServer(pki.server);
  // The server's certificate names only DNS:agent-server: neither 127.0.0.1 nor
  // localhost, so these calls pass only because host names are not checked.
  for (std::string host : {"127.0.0.1", "localhost"}) {
    CAPTURE(host);
    CallResult r = Call(server->at(host), Ours(pki.client));
    INFO(Describe(r));
    REQUIRE(r.status.ok());
    // DNS SANs in order, the CN once, no IP SAN.
    CHECK(r.reply.name() == "agent-client,client-alias");
    CHECK(r.reply.pid() == 1);
    CHECK(r.server_identities == std::vector<std::string>{"agent-server"});
    CHECK(r.server_matches);
  }
  CHECK(server->service.calls() == 2);
}

TEST_CASE("clients without a cluster certificate fail the handshake") {
  const Pki& pki = Pki::Get();
  auto server = StartTlsServer(pki.server);
  grpc::ChannelArguments override_host;  // so that only the client certificate matters
  override_host.SetSslTargetNameOverride("agent-server");

  SECTION("plaintext") {
    CallResult r = Call(server->at("127.0.0.1"), grpc::InsecureChannelCredentials());
    INFO(Describe(r));
    CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  }
  SECTION("TLS without a client certificate") {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = ReadAll(pki.cluster->ca_path());
    CallResult r =
        Call(server->at("127.0.0.1"), grpc::SslCredentials(options), override_host);
    INFO(Describe(r));
    CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
    // Control: the same SslCredentials with the client's key pair get in.
    options.pem_private_key = ReadAll(pki.client.key);
    options.pem_cert_chain = ReadAll(pki.client.cert);
    CallResult good =
        Call(server->at("127.0.0.1"), grpc::SslCredentials(options), override_host);
    INFO(Describe(good));
    CHECK(good.status.ok());
    CHECK(good.reply.name() == "agent-client,client-alias");
  }
  SECTION("a certificate from another CA") {
    CallResult r = Call(server->at("127.0.0.1"), Ours(pki.rogue_client));
    INFO(Describe(r));
    CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  }
  SECTION("an expired certificate") {
    CallResult r = Call(server->at("127.0.0.1"), Ours(pki.expired_client));
    INFO(Describe(r));
    CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  }
  SECTION("a certificate not valid yet") {
    CallResult r = Call(server->at("127.0.0.1"), Ours(pki.future_client));
    INFO(Describe(r));
    CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  }
  // No rejected client ever reached the handler.
  CHECK(server->service.calls() <= 1);
}

TEST_CASE("a client refuses a server whose certificate comes from another CA") {
  const Pki& pki = Pki::Get();
  // This server trusts the cluster CA, so it would accept our client: only the client's
  // check of the server's chain can refuse.
  auto server = StartTlsServer(pki.rogue_server);
  CallResult r = Call(server->at("127.0.0.1"), Ours(pki.client));
  INFO(Describe(r));
  CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  CHECK(server->service.calls() == 0);

  // Control: a client that skips the server check gets in, so the refusal above was the
  // client's chain verification.
  CallResult skip = Call(server->at("127.0.0.1"),
                         TlsVariant(pki.client, std::make_shared<gx::NoOpCertificateVerifier>(),
                                    false, /*verify_server_certs=*/false));
  INFO(Describe(skip));
  CHECK(skip.status.ok());
  CHECK(skip.reply.name() == "agent-client,client-alias");
}

TEST_CASE("host names: gRPC's defaults check them, MakeChannelCredentials does not") {
  const Pki& pki = Pki::Get();
  auto server = StartTlsServer(pki.server);  // SAN DNS:agent-server only
  auto local = StartTlsServer(pki.server_local);  // SAN DNS:localhost, IP:127.0.0.1

  SECTION("default verifier (none set) is a host name check") {
    CallResult r = Call(server->at("127.0.0.1"), TlsVariant(pki.client, nullptr, false));
    INFO(Describe(r));
    CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
    CallResult l = Call(server->at("localhost"), TlsVariant(pki.client, nullptr, false));
    INFO(Describe(l));
    CHECK(l.status.error_code() == grpc::StatusCode::UNAVAILABLE);
    // ... which passes when the certificate names the host dialed.
    for (std::string host : {"127.0.0.1", "localhost"}) {
      CAPTURE(host);
      CallResult ok = Call(local->at(host), TlsVariant(pki.client, nullptr, false));
      INFO(Describe(ok));
      CHECK(ok.status.ok());
    }
  }
  SECTION("HostNameCertificateVerifier refuses, as the default does") {
    CallResult r =
        Call(server->at("127.0.0.1"),
             TlsVariant(pki.client, std::make_shared<gx::HostNameCertificateVerifier>(), false));
    INFO(Describe(r));
    CHECK(r.status.error_code() == grpc::StatusCode::UNAVAILABLE);
  }
  SECTION("check_call_host compares a call's authority with the certificate") {
    // With the host check on, a call whose :authority the certificate does not name fails;
    // with ours (off) it passes.
    CallResult r =
        Call(server->at("127.0.0.1"),
             TlsVariant(pki.client, std::make_shared<gx::NoOpCertificateVerifier>(), true), {},
             "not-in-cert.example");
    INFO(Describe(r));
    CHECK_FALSE(r.status.ok());
    CallResult ours =
        Call(server->at("127.0.0.1"), Ours(pki.client), {}, "not-in-cert.example");
    INFO(Describe(ours));
    CHECK(ours.status.ok());
    CHECK(ours.server_matches);
  }
  SECTION("MakeChannelCredentials: any host, any authority; the identity is the name") {
    for (std::string host : {"127.0.0.1", "localhost"}) {
      CAPTURE(host);
      CallResult r = Call(server->at(host), Ours(pki.client));
      INFO(Describe(r));
      CHECK(r.status.ok());
      CHECK(r.server_identities == std::vector<std::string>{"agent-server"});
    }
  }
}

TEST_CASE("identities are empty without TLS") {
  TestServer server(grpc::InsecureServerCredentials());
  CallResult r = Call(server.at("127.0.0.1"), grpc::InsecureChannelCredentials());
  INFO(Describe(r));
  REQUIRE(r.status.ok());
  CHECK(r.reply.name().empty());
  CHECK(r.reply.pid() == 0);
  CHECK(r.server_identities.empty());
  CHECK_FALSE(r.server_matches);
}

TEST_CASE("CheckTlsFiles accepts good files and explains bad ones") {
  const Pki& pki = Pki::Get();
  const std::string bad_dir = pki.dir + "/bad";
  ::mkdir(bad_dir.c_str(), 0700);

  auto expect = [](const TlsFiles& files, absl::StatusCode code,
                   std::vector<std::string> needles) {
    absl::Status s = CheckTlsFiles(files, "kvagentd");
    INFO(s.ToString());
    CHECK(s.code() == code);
    CHECK(s.message().rfind("kvagentd: ", 0) == 0);
    CHECK(s.message().find("fix: ") != std::string_view::npos);
    for (const std::string& n : needles) {
      CAPTURE(n);
      CHECK(s.message().find(n) != std::string_view::npos);
    }
  };

  SECTION("good files") {
    CHECK(CheckTlsFiles(Files(pki.client), "kvagentd").ok());
    CHECK(CheckTlsFiles(Files(pki.server), "kvagentd").ok());
    CHECK_FALSE(Files(pki.client).empty());
  }
  SECTION("unset") {
    CHECK(TlsFiles{}.empty());
    expect(TlsFiles{}, absl::StatusCode::kInvalidArgument, {"--tls-cert is not set"});
    TlsFiles partial = Files(pki.client);
    partial.ca.clear();
    CHECK_FALSE(partial.empty());
    expect(partial, absl::StatusCode::kInvalidArgument, {"--tls-ca is not set"});
  }
  SECTION("missing file") {
    TlsFiles files = Files(pki.client);
    files.key = bad_dir + "/nope.key";
    expect(files, absl::StatusCode::kInvalidArgument,
           {"--tls-key", files.key, "No such file or directory"});
  }
  SECTION("garbage PEM") {
    const std::string garbage = bad_dir + "/garbage.pem";
    WriteAll(garbage, "this is not a certificate\n");
    TlsFiles files = Files(pki.client);
    files.cert = garbage;
    expect(files, absl::StatusCode::kInvalidArgument,
           {"--tls-cert", garbage, "no readable PEM certificate", "openssl req"});
    files = Files(pki.client);
    files.key = garbage;
    expect(files, absl::StatusCode::kInvalidArgument,
           {"--tls-key", garbage, "not an unencrypted PEM private key"});
    files = Files(pki.client);
    files.ca = garbage;
    expect(files, absl::StatusCode::kInvalidArgument,
           {"--tls-ca", garbage, "no readable PEM certificate", "cluster CA"});
    // A damaged body after a good header.
    const std::string damaged = bad_dir + "/damaged.pem";
    WriteAll(damaged, "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n");
    files = Files(pki.client);
    files.cert = damaged;
    expect(files, absl::StatusCode::kInvalidArgument, {"--tls-cert", damaged});
  }
  SECTION("key of another certificate") {
    TlsFiles files = Files(pki.client);
    files.key = pki.server.key;
    expect(files, absl::StatusCode::kInvalidArgument,
           {"--tls-key", pki.server.key, "is not the key of --tls-cert", pki.client.cert,
            "CN=agent-client", "openssl req"});
  }
  SECTION("expired certificate") {
    expect(Files(pki.expired_client), absl::StatusCode::kFailedPrecondition,
           {"--tls-cert", pki.expired_client.cert, "expired", "valid from 20", " UTC",
            "issue a new certificate from the cluster CA"});
  }
  SECTION("certificate not valid yet") {
    expect(Files(pki.future_client), absl::StatusCode::kFailedPrecondition,
           {"--tls-cert", pki.future_client.cert, "not valid yet", "clock"});
  }
  SECTION("certificate from another CA") {
    TlsFiles files = Files(pki.rogue_client);
    files.ca = pki.cluster->ca_path();
    expect(files, absl::StatusCode::kInvalidArgument,
           {"--tls-cert", pki.rogue_client.cert, "does not chain to --tls-ca",
            pki.cluster->ca_path(), "CN=rogue", "unable to get local issuer certificate",
            "cluster CA"});
  }
  SECTION("a leaf as the CA") {
    TlsFiles files = Files(pki.client);
    files.ca = pki.server.cert;
    expect(files, absl::StatusCode::kInvalidArgument, {"does not chain to --tls-ca"});
  }
}

TEST_CASE("Make*Credentials name the flag of a file they cannot read") {
  const Pki& pki = Pki::Get();
  TlsFiles files = Files(pki.client);
  files.ca = pki.dir + "/missing-ca.pem";
  auto server = MakeServerCredentials(files);
  REQUIRE_FALSE(server.ok());
  CHECK(server.status().message().find("--tls-ca " + files.ca) != std::string_view::npos);
  auto channel = MakeChannelCredentials(files);
  REQUIRE_FALSE(channel.ok());
  CHECK(channel.status().message().find("--tls-ca " + files.ca) != std::string_view::npos);
}

TEST_CASE("CertAuthority writes P-256 certificates with the asked-for names and dates") {
  const Pki& pki = Pki::Get();
  CHECK(pki.cluster->ca_path() == pki.dir + "/cluster/cluster-ca.pem");
  CHECK(pki.client.cert == pki.dir + "/cluster/agent-client.pem");
  CHECK(pki.client.key == pki.dir + "/cluster/agent-client.key");
  CHECK(pki.client.ca == pki.cluster->ca_path());
  for (const std::string& key : {pki.client.key, pki.cluster->ca_key_path()}) {
    struct stat st {};
    REQUIRE(::stat(key.c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0600);
  }

  FILE* f = std::fopen(pki.client.cert.c_str(), "r");
  REQUIRE(f != nullptr);
  X509* cert = PEM_read_X509(f, nullptr, nullptr, nullptr);
  std::fclose(f);
  REQUIRE(cert != nullptr);
  // Key: EC P-256; signature: ECDSA with SHA-256.
  EVP_PKEY* key = X509_get0_pubkey(cert);
  REQUIRE(key != nullptr);
  CHECK(EVP_PKEY_is_a(key, "EC"));
  char group[64] = {};
  size_t group_len = 0;
  CHECK(EVP_PKEY_get_group_name(key, group, sizeof group, &group_len) == 1);
  CHECK(std::string(group) == "prime256v1");
  CHECK(X509_get_signature_nid(cert) == NID_ecdsa_with_SHA256);
  // Both TLS roles, not a CA.
  uint32_t xku = X509_get_extended_key_usage(cert);
  CHECK((xku & XKU_SSL_SERVER) != 0);
  CHECK((xku & XKU_SSL_CLIENT) != 0);
  CHECK(X509_check_ca(cert) == 0);
  // subjectAltName: DNS:CN, the DNS names, the IPs.
  std::vector<std::string> dns;
  std::vector<std::string> ips;
  auto* names = static_cast<GENERAL_NAMES*>(
      X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr));
  REQUIRE(names != nullptr);
  for (int i = 0; i < sk_GENERAL_NAME_num(names); ++i) {
    const GENERAL_NAME* n = sk_GENERAL_NAME_value(names, i);
    if (n->type == GEN_DNS) {
      dns.emplace_back(reinterpret_cast<const char*>(ASN1_STRING_get0_data(n->d.dNSName)),
                       ASN1_STRING_length(n->d.dNSName));
    } else if (n->type == GEN_IPADD) {
      ips.push_back(std::to_string(ASN1_STRING_length(n->d.iPAddress)) + " bytes");
    }
  }
  GENERAL_NAMES_free(names);
  CHECK(dns == std::vector<std::string>{"agent-client", "client-alias"});
  CHECK(ips == std::vector<std::string>{"4 bytes"});
  X509_free(cert);

  // IPv6 too, on the local server's certificate.
  f = std::fopen(pki.server_local.cert.c_str(), "r");
  REQUIRE(f != nullptr);
  cert = PEM_read_X509(f, nullptr, nullptr, nullptr);
  std::fclose(f);
  REQUIRE(cert != nullptr);
  CHECK(X509_check_ip_asc(cert, "::1", 0) == 1);
  CHECK(X509_check_ip_asc(cert, "127.0.0.1", 0) == 1);
  CHECK(X509_check_host(cert, "localhost", 0, 0, nullptr) == 1);
  X509_free(cert);
}

TEST_CASE("CertAuthority refuses bad names and empty validity") {
  const Pki& pki = Pki::Get();
  auto bad_cn = pki.cluster->Issue("../escape");
  CHECK(bad_cn.status().code() == absl::StatusCode::kInvalidArgument);
  auto bad_ip = pki.cluster->Issue("ok-name", IssueOptions{{}, {"300.1.2.3"}});
  CHECK(bad_ip.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(bad_ip.status().message().find("300.1.2.3") != std::string_view::npos);
  IssueOptions empty;
  empty.not_before_s = 10;
  empty.not_after_s = 10;
  CHECK(pki.cluster->Issue("ok-name", empty).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(pki.cluster->Issue("cluster-ca").status().code() ==
        absl::StatusCode::kInvalidArgument);
  auto bad_ca = CertAuthority::Create(pki.dir + "/x", "a/b");
  CHECK(bad_ca.status().code() == absl::StatusCode::kInvalidArgument);
}
