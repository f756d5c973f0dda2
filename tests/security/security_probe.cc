// security_probe: one client action against a kvagentd local door, run by the
// unprivileged-user tests under `setpriv` as another uid. Prints one line,
// "<StatusCode>\t<message>", and exits 0 whatever the agent answered (2 on bad usage).
//   security_probe unix:SOCKET register-path NAME   register a 4 KiB AUX region by file name
//   security_probe unix:SOCKET status               the caller's principal and roles
//   security_probe unix:SOCKET metadata             Peer.GetMetadata (needs the peer role)
//   security_probe unix:SOCKET peer-memory ID       a peer agent's descriptor request
//   security_probe unix:SOCKET peer-device-memory ID  the same for a CUDA VMM allocation
#include <chrono>
#include <cstdio>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "fmt/format.h"
#include "agent/status_util.h"
#include "cli/agent_client.h"
#include "grpcpp/grpcpp.h"
#include "proto/kvagent.grpc.pb.h"

namespace {

int Print(const absl::Status& status, const std::string& detail = "") {
  std::printf("%s\t%s\n", absl::StatusCodeToString(status.code()).c_str(),
              status.ok() ? detail.c_str() : std::string(status.message()).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: security_probe unix:SOCKET COMMAND [ARG]\n");
    return 2;
  }
  const std::string address = argv[1];
  const std::string command = argv[2];
  kvagent::cli::AgentClientOptions options;
  // metadata-as NAME: a session named NAME (a peer agent names itself so).
  const bool named = command == "metadata-as" && argc == 4;
  options.client_name = named ? argv[3] : "probe";
  options.timeout_ms = 5000;
  kvagent::cli::AgentClient client(address, options);
  if (command == "register-path" && argc == 4) {
    kvagent::v1::RegisterRegionsRequest request;
    auto* spec = request.add_regions();
    spec->set_name("probe.region");
    spec->set_kind(kvagent::v1::AUX);
    spec->set_length(4096);
    spec->mutable_shm()->set_name(argv[3]);
    auto registered = client.Register(request);
    return Print(registered.status(), "registered");
  }
  if (command == "status") {
    auto status = client.Status();
    if (!status.ok()) return Print(status.status());
    return Print(absl::OkStatus(), status->caller() + " [" +
                                       absl::StrJoin(status->caller_roles(), ",") + "]");
  }
  if (command == "metadata" || named) {
    auto session = client.Session();
    if (!session.ok()) return Print(session.status());
    auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
    auto stub = kvagent::v1::Peer::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    context.AddMetadata("kvagent-session", (*session)->token());
    kvagent::v1::GetMetadataRequest request;
    request.set_caller(options.client_name);
    kvagent::v1::AgentMetadata reply;
    grpc::Status status = stub->GetMetadata(&context, request, &reply);
    std::string secret;
    for (unsigned char c : reply.notify_secret()) secret += fmt::format("{:02x}", c);
    return Print(kvagent::agent::FromGrpcStatus(status),
                 std::to_string(reply.regions_size()) + " regions" +
                     (named ? ", secret " + secret : std::string()));
  }
  if ((command == "peer-memory" || command == "peer-device-memory") && argc == 4) {
    uint64_t id = 0;
    if (!absl::SimpleAtoi(argv[3], &id)) return 2;
    auto session = client.Session();
    if (!session.ok()) return Print(session.status());
    const absl::Status asked = command == "peer-memory"
                                   ? (*session)->PeerMemory({id}).status()
                                   : (*session)->PeerDeviceMemories({id}).status();
    return Print(asked, "descriptor received");
  }
  std::fprintf(stderr, "security_probe: unknown command '%s'\n", command.c_str());
  return 2;
}
