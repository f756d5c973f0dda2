// grpc.health.v1 and server reflection on a real kvagentd: the doors a probe or a
// standard tool (grpcurl, grpc_health_probe, Kubernetes' gRPC probes) would use.
#include <signal.h>

#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "cli/agent_client.h"
#include "cli/daemon_process.h"
#include "google/protobuf/descriptor.pb.h"
#include "grpcpp/grpcpp.h"
#include "proto/health.grpc.pb.h"
#include "tests/integration/agent_pair.h"
#include "tests/integration/reflection_client.grpc.pb.h"

namespace kvagent::testing {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;
using grpc::reflection::v1alpha::ServerReflection;
using grpc::reflection::v1alpha::ServerReflectionRequest;
using grpc::reflection::v1alpha::ServerReflectionResponse;

std::shared_ptr<grpc::Channel> Plain(const std::string& address) {
  return grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
}

void Deadline(grpc::ClientContext* context, int ms = 5000) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms));
}

// Health.Check with no session token, no certificate: the status, or the gRPC error.
grpc::Status Check(const std::string& address, const std::string& service,
                   HealthCheckResponse* response) {
  auto stub = Health::NewStub(Plain(address));
  grpc::ClientContext context;
  Deadline(&context);
  HealthCheckRequest request;
  request.set_service(service);
  return stub->Check(&context, request, response);
}

// One reflection request on a fresh stream; the response, or the stream's error.
grpc::Status Reflect(const std::string& address, const ServerReflectionRequest& request,
                     ServerReflectionResponse* response) {
  auto stub = ServerReflection::NewStub(Plain(address));
  grpc::ClientContext context;
  Deadline(&context);
  auto stream = stub->ServerReflectionInfo(&context);
  stream->Write(request);
  stream->WritesDone();
  const bool got = stream->Read(response);
  grpc::Status status = stream->Finish();
  if (status.ok() && !got) return grpc::Status(grpc::StatusCode::INTERNAL, "no response");
  return status;
}

cli::DaemonProcess StartAgent(const std::string& dir) {
  cli::DaemonOptions d;
  auto binary = cli::FindKvagentd("");
  REQUIRE(binary.ok());
  d.binary = *binary;
  d.name = "probed";
  d.work_dir = dir;
  d.network = cli::NetworkDoor::kInsecure;
  d.extra_args = {"--health-listen", "127.0.0.1:0"};
  std::filesystem::create_directories(dir);
  auto process = cli::DaemonProcess::Start(d);
  INFO(process.status().ToString());
  REQUIRE(process.ok());
  return *std::move(process);
}

std::string WorkDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return std::string(tmp ? tmp : "/tmp");
}

}  // namespace

TEST_CASE("Health answers SERVING on every door, without a session or a certificate",
          "[health]") {
  cli::DaemonProcess agent = StartAgent(WorkDir() + "/serving");
  cli::AgentClient client(agent.address());
  auto status = client.Status();
  REQUIRE(status.ok());
  CHECK(status->health() == "SERVING");
  const std::string health_door = status->health_address();
  REQUIRE(health_door.rfind("127.0.0.1:", 0) == 0);
  REQUIRE(health_door != "127.0.0.1:0");

  for (const std::string& door : {agent.address(), agent.network_address(), health_door}) {
    for (const char* service : {"", "kvagent.v1.Agent", "kvagent.v1.Peer"}) {
      INFO(door << " service '" << service << "'");
      HealthCheckResponse response;
      grpc::Status checked = Check(door, service, &response);
      REQUIRE(checked.error_message() == "");
      CHECK(response.status() == HealthCheckResponse::SERVING);
    }
    HealthCheckResponse response;
    CHECK(Check(door, "no.such.Service", &response).error_code() == grpc::StatusCode::NOT_FOUND);
  }

  // The health-only door serves nothing else: no agent API, no reflection.
  v1::GetStatusRequest request;
  v1::AgentStatus reply;
  grpc::ClientContext context;
  Deadline(&context);
  auto stub = v1::Agent::NewStub(Plain(health_door));
  CHECK(stub->GetStatus(&context, request, &reply).error_code() ==
        grpc::StatusCode::UNIMPLEMENTED);
  ServerReflectionRequest list;
  list.set_list_services("*");
  ServerReflectionResponse listed;
  CHECK(Reflect(health_door, list, &listed).error_code() == grpc::StatusCode::UNIMPLEMENTED);

  // The local door still refuses the agent API without a session token.
  grpc::ClientContext bare;
  Deadline(&bare);
  CHECK(v1::Agent::NewStub(Plain(agent.address()))->GetStatus(&bare, request, &reply).error_code() ==
        grpc::StatusCode::UNAUTHENTICATED);
}

TEST_CASE("Health.Watch sees NOT_SERVING as soon as the agent begins to shut down", "[health]") {
  cli::DaemonProcess agent = StartAgent(WorkDir() + "/watch");
  auto stub = Health::NewStub(Plain(agent.address()));
  grpc::ClientContext context;
  Deadline(&context, 15000);
  HealthCheckRequest request;
  auto stream = stub->Watch(&context, request);
  HealthCheckResponse response;
  REQUIRE(stream->Read(&response));
  CHECK(response.status() == HealthCheckResponse::SERVING);
  REQUIRE(kill(agent.pid(), SIGTERM) == 0);
  // Shutdown flips health before it stops anything else, so the change is written
  // before the door closes.
  REQUIRE(stream->Read(&response));
  CHECK(response.status() == HealthCheckResponse::NOT_SERVING);
  context.TryCancel();
  auto exit = agent.Stop();
  REQUIRE(exit.ok());
  CHECK(*exit == 0);
}

TEST_CASE("Server reflection lists and describes the agent's services", "[reflection]") {
  cli::DaemonProcess agent = StartAgent(WorkDir() + "/reflection");
  for (const std::string& door : {agent.address(), agent.network_address()}) {
    INFO(door);
    ServerReflectionRequest list;
    list.set_list_services("*");
    ServerReflectionResponse listed;
    grpc::Status status = Reflect(door, list, &listed);
    REQUIRE(status.error_message() == "");
    std::set<std::string> names;
    for (const auto& service : listed.list_services_response().service()) {
      names.insert(service.name());
    }
    CHECK(names == std::set<std::string>{"kvagent.v1.Agent", "kvagent.v1.Peer",
                                         "grpc.health.v1.Health",
                                         "grpc.reflection.v1alpha.ServerReflection"});

    // A tool that calls the agent by reflection needs each service's descriptor.
    for (const auto& [symbol, method] :
         std::vector<std::pair<std::string, std::string>>{{"kvagent.v1.Agent", "SubmitTransfer"},
                                                          {"grpc.health.v1.Health", "Watch"}}) {
      INFO(symbol);
      ServerReflectionRequest describe;
      describe.set_file_containing_symbol(symbol);
      ServerReflectionResponse described;
      REQUIRE(Reflect(door, describe, &described).ok());
      REQUIRE(described.has_file_descriptor_response());
      bool found = false;
      for (const std::string& bytes : described.file_descriptor_response().file_descriptor_proto()) {
        google::protobuf::FileDescriptorProto file;
        REQUIRE(file.ParseFromString(bytes));
        for (const auto& service : file.service()) {
          if (file.package() + "." + service.name() != symbol) continue;
          for (const auto& m : service.method()) found = found || m.name() == method;
        }
      }
      CHECK(found);
    }
    ServerReflectionRequest unknown;
    unknown.set_file_containing_symbol("kvagent.v1.NoSuchThing");
    ServerReflectionResponse refused;
    REQUIRE(Reflect(door, unknown, &refused).ok());
    CHECK(refused.error_response().error_code() == static_cast<int>(grpc::StatusCode::NOT_FOUND));
  }
}

}  // namespace kvagent::testing
