// Peer.WatchMetadata streams that are opened and never written to, against a real
// kvagentd with a mutual-TLS network door and a throwaway cluster CA under
// TEST_TMPDIR. The door names the caller when the stream is created, so each stream
// counts against the watcher limits at once (4 streams per peer identity, each
// identity once in --max-peer-callers): a fifth silent stream of one identity, or a
// silent stream of an identity past --max-peer-callers, is refused at once with
// RESOURCE_EXHAUSTED naming the call, the identity, the limit and the fix, counted in
// refused_calls and logged; closing a stream frees its place.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "agent/tls.h"
#include "catch2/catch.hpp"
#include "cli/agent_client.h"
#include "cli/cert_authority.h"
#include "cli/daemon_process.h"
#include "fmt/format.h"
#include "grpcpp/grpcpp.h"
#include "proto/kvagent.grpc.pb.h"

namespace kvagent::testing {
namespace {

using Catch::Contains;

template <typename T>
T Require(absl::StatusOr<T> value, const std::string& what) {
  INFO(what << ": " << value.status().ToString());
  REQUIRE(value.ok());
  return *std::move(value);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// One identity's channel to the agent's Peer service over mutual TLS.
struct Watcher {
  std::unique_ptr<v1::Peer::Stub> stub;

  Watcher(const std::string& address, const cli::TlsFilePaths& cert) {
    auto credentials = agent::MakeChannelCredentials(agent::TlsFiles{cert.cert, cert.key, cert.ca});
    REQUIRE(credentials.ok());
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    stub = v1::Peer::NewStub(grpc::CreateCustomChannel(address, *credentials, args));
  }
};

// A WatchMetadata stream opened and left silent: no request is ever written.
struct SilentStream {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::GetMetadataRequest, v1::AgentMetadata>> call;

  explicit SilentStream(Watcher& watcher) { call = watcher.stub->WatchMetadata(&context); }
  // The status the agent ended it with (waits for it: only for a refused stream).
  grpc::Status Refusal() { return call->Finish(); }
  void Close() {
    context.TryCancel();
    call->Finish();
  }
};

struct Agent {
  std::string dir;
  std::unique_ptr<cli::CertAuthority> ca;
  cli::DaemonProcess daemon;
  std::unique_ptr<cli::AgentClient> local;

  explicit Agent(const std::vector<std::string>& args) {
    const char* tmp = std::getenv("TEST_TMPDIR");
    dir = fmt::format("{}/watch_streams.{}", tmp ? tmp : "/tmp", ::getpid());
    std::filesystem::create_directories(dir);
    ca = std::make_unique<cli::CertAuthority>(
        Require(cli::CertAuthority::Create(dir + "/cluster", "cluster"), "making the CA"));
    cli::DaemonOptions options;
    options.binary = Require(cli::FindKvagentd(""), "finding kvagentd");
    options.name = "watched";
    options.work_dir = dir;
    options.network = cli::NetworkDoor::kTls;
    const cli::TlsFilePaths own = Issue("watched");
    options.tls = agent::TlsFiles{own.cert, own.key, own.ca};
    options.extra_args = args;
    daemon = Require(cli::DaemonProcess::Start(options), "starting the agent");
    cli::AgentClientOptions client;
    client.timeout_ms = 5000;
    client.client_name = "watch_streams_test";
    local = std::make_unique<cli::AgentClient>(daemon.address(), client);
  }

  cli::TlsFilePaths Issue(const std::string& name) const {
    return Require(ca->Issue(name, {}), "issuing a certificate for " + name);
  }

  v1::AgentStatus Status() { return Require(local->Status(), "the agent's status"); }

  // Waits (up to 5 s) until the agent counts `streams` open metadata streams.
  void AwaitStreams(uint32_t streams) {
    uint32_t seen = 0;
    for (int i = 0; i < 500; ++i) {
      seen = Status().metadata_streams();
      if (seen == streams) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    FAIL("the agent counts " << seen << " metadata streams, expected " << streams);
  }
};

void ExpectRefused(SilentStream& stream, const std::string& identity,
                   const std::vector<std::string>& says) {
  const grpc::Status refused = stream.Refusal();
  INFO(refused.error_message());
  CHECK(refused.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK_THAT(refused.error_message(), Contains("WatchMetadata") && Contains(identity));
  for (const auto& text : says) CHECK_THAT(refused.error_message(), Contains(text));
  std::printf("%s -> WatchMetadata: %s\n", identity.c_str(), refused.error_message().c_str());
}

TEST_CASE("silent WatchMetadata streams count at creation: a fifth of one identity is refused") {
  // Room for two peer identities: "carol" below is the third.
  Agent agent({"--max-peer-callers", "2"});
  const std::string door = agent.daemon.network_address();
  Watcher alice(door, agent.Issue("alice"));
  Watcher bob(door, agent.Issue("bob"));
  Watcher carol(door, agent.Issue("carol"));
  const uint64_t refused_before = agent.Status().refused_calls();

  std::vector<std::unique_ptr<SilentStream>> held;
  for (int i = 0; i < 4; ++i) held.push_back(std::make_unique<SilentStream>(alice));
  agent.AwaitStreams(4);  // counted though none of them ever wrote a request

  SilentStream fifth(alice);
  ExpectRefused(fifth, "alice", {"already holds 4 metadata streams", "close the others"});
  CHECK(agent.Status().refused_calls() == refused_before + 1);
  CHECK(agent.Status().metadata_streams() == 4);

  // Another identity is not affected by alice's streams.
  auto bobs = std::make_unique<SilentStream>(bob);
  agent.AwaitStreams(5);
  // A third identity passes --max-peer-callers 2, also before it writes anything.
  SilentStream carols(carol);
  ExpectRefused(carols, "carol", {"limit peer_callers (2 peers) reached", "--max-peer-callers"});
  CHECK(agent.Status().refused_calls() == refused_before + 2);

  // Closing one of alice's streams lets a new one in.
  held.front()->Close();
  held.erase(held.begin());
  agent.AwaitStreams(4);
  held.push_back(std::make_unique<SilentStream>(alice));
  agent.AwaitStreams(5);
  CHECK(agent.Status().refused_calls() == refused_before + 2);

  // Each refusal is in the agent's log, naming the call and who made it.
  const std::string log = ReadFile(agent.daemon.log_path());
  CHECK_THAT(log, Contains("refused WatchMetadata from cert:alice") &&
                      Contains("refused WatchMetadata from cert:carol"));

  // However they end, the streams are released: none is left counted.
  bobs->Close();
  for (auto& stream : held) stream->Close();
  agent.AwaitStreams(0);
}

}  // namespace
}  // namespace kvagent::testing
